"""All-to-all between the DP ranks of one host through shared memory: the alternative to
gloo's that benchmarks/expert_parallel.py measures against it for expert parallelism (the
engine uses gloo's: this measured faster only for exchanges of a few tokens here,
benchmarks/RESULTS.md "Expert parallelism").

Each rank owns one segment: a header (its `ready` and `done` exchange counters, its split
sizes and row width) and an outbox. An exchange: wait until every peer is `done` reading the
previous exchange's outboxes, copy the rows into this rank's outbox, publish `ready`, wait
for every peer's `ready`, copy this rank's chunk out of each peer's outbox, publish `done`.
Waits spin, yielding the CPU between polls, under a deadline: a peer that stops or dies
breaks the group (CollectiveBroken) after `timeout_s`, as a gloo timeout would. x86 keeps
stores in order, so a peer that sees `ready` sees the rows written before it.
"""
from __future__ import annotations

import math
import time
from multiprocessing import shared_memory

import numpy as np
import torch

from atomd.engine.dp_collective import CollectiveBroken

HEADER_INTS = 4  # ready, done, row bytes, (pad)
# Between polls, after a short spin: a sleep, not sched_yield: with more runnable processes
# than cores a yielding waiter still takes turns from the peer it waits for
POLL_SLEEP_S = 20e-6


class ShmAllToAll:
    """This rank's side; `name`: the group's (unique per group, e.g. from its gloo port);
    `capacity_bytes`: the most one rank sends in one all-to-all."""

    def __init__(self, name: str, rank: int, world_size: int, capacity_bytes: int, timeout_s: float):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.capacity = capacity_bytes
        self.header_bytes = 8 * (HEADER_INTS + world_size)
        self.names = [f"{name}-{r}" for r in range(world_size)]
        self.mine = shared_memory.SharedMemory(self.names[rank], create=True,
                                               size=self.header_bytes + capacity_bytes)
        self.peers: list[shared_memory.SharedMemory] = []
        self.seq = 0
        self.broken: str | None = None

    def connect(self) -> None:
        """Open every peer's segment (after every rank created its own: a barrier before)."""
        for r, n in enumerate(self.names):
            if r == self.rank:
                self.peers.append(self.mine)
                continue
            self.peers.append(shared_memory.SharedMemory(n))  # the owner unlinks it
        self.headers = [np.ndarray(HEADER_INTS + self.world_size, np.int64, s.buf) for s in self.peers]
        self.boxes = [torch.frombuffer(s.buf, dtype=torch.uint8, offset=self.header_bytes) for s in self.peers]

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        if self.broken is not None:
            raise CollectiveBroken(self.broken)
        self.seq += 1
        seq, me = self.seq, self.headers[self.rank]
        row_bytes = math.prod(inp.shape[1:]) * inp.element_size()
        payload = inp.contiguous().view(torch.uint8).flatten() if inp.numel() else None
        if payload is not None and payload.numel() > self.capacity:
            raise ValueError(f"all-to-all of {payload.numel()} bytes > the shared segment's {self.capacity}")
        self._wait(1, seq - 1)  # every peer read the previous exchange out of this outbox
        if payload is not None:
            self.boxes[self.rank][:payload.numel()].copy_(payload)
        me[HEADER_INTS:] = in_splits
        me[2] = row_bytes
        me[0] = seq
        self._wait(0, seq)
        dest = out.view(torch.uint8).flatten() if out.numel() else None
        at = 0
        for src, h in enumerate(self.headers):
            splits = h[HEADER_INTS:]
            start, n = int(splits[:self.rank].sum()), int(splits[self.rank])
            nbytes = n * int(h[2])
            if nbytes:
                dest[at:at + nbytes].copy_(self.boxes[src][start * int(h[2]):start * int(h[2]) + nbytes])
            at += nbytes
        me[1] = seq

    def _wait(self, field: int, value: int) -> None:
        deadline = None
        for h in self.headers:
            spins = 0
            while h[field] < value:
                spins += 1
                if spins > 64:
                    time.sleep(POLL_SLEEP_S)
                    if deadline is None:
                        deadline = time.monotonic() + self.timeout_s
                    elif time.monotonic() > deadline:
                        self.broken = f"shared-memory all-to-all: a peer missed exchange {value} for {self.timeout_s} s"
                        raise CollectiveBroken(self.broken)

    def close(self) -> None:
        self.headers = self.boxes = []
        for shm in self.peers:
            if shm is not self.mine:
                shm.close()
        self.mine.close()
        self.mine.unlink()
