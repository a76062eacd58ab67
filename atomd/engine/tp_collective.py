"""Tensor parallelism's collectives: the N processes of one engine rank (the engine core is
TP rank 0, its workers ranks 1..N-1) sum partial activations, gather vocabulary slices and
receive each step's inputs.

Two communicators, one interface (`TPCommunicator`):

- `ShmCommunicator` (`--tp-communicator shm`, one host): one shared-memory segment in
  /dev/shm, named by rank 0. It holds a header (one 64-byte line per rank: its `arrive` and
  `done` round counters, its pid, the size of the call's whole tensor or payload) and one slot per rank. A round: wait
  until every peer is `done` with the previous round (so this rank's slot is free), copy this
  rank's part into its slot, publish `arrive`, wait for every peer's `arrive`, read the
  slots, publish `done`. Tensors larger than a slot take several rounds (chunks).
- `GlooCommunicator` (`--tp-communicator gloo`, across hosts): a standalone gloo process
  group on a TCPStore (not the process-global default group: an engine core of a DP x TP
  deployment already holds the DP ranks' group there, atomd/engine/dp_collective.py).

Both sum in rank order (rank 0's part + rank 1's + ...), bf16 / fp16 in fp32 and rounded
once, so every rank gets the same bits and the two communicators agree with each other:
gloo's all-reduce is an all-gather and a local sum for that reason (its ring sums in a
per-chunk order).

Every wait has a deadline (`timeout_s`, 5 s by default): a peer that died or was stopped
raises `CollectiveTimeout` naming the ranks that did not arrive on every survivor, and the
communicator is broken from then on (every call raises at once: the ranks are out of step
and nothing waits on a dead peer again). A waiting shm rank also notices a peer's process
exit before the deadline. An idle worker waiting for rank 0's next step can wait longer
(`broadcast_bytes(None, timeout_s=...)`, `math.inf` included): it still notices rank 0's exit.

The segment's name is unlinked as soon as every rank has mapped it (the join), so no crash,
of any rank, at any time after the join leaves a file in /dev/shm; a join that times out
unlinks it too.

x86 keeps stores in order and loads in order: a peer that sees `arrive` sees the slot bytes
written before it. The shm communicator relies on that (TSO); other architectures use gloo.
"""
from __future__ import annotations

import datetime
import math
import mmap
import os
import secrets
import time
from dataclasses import dataclass

import numpy as np
import torch

from atomd.engine.dp_collective import CollectiveBroken

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_SLOT_BYTES = 4 << 20  # per rank; a bigger tensor takes several rounds
# an all-reduce chunk at least this big is summed share by share (each rank its 1/N, then
# every rank copies the shares: two rounds, 1/N of the arithmetic); smaller ones in one round
SCATTER_MIN_BYTES = 256 << 10
MAX_BROADCAST_BYTES = 256 << 20  # one step's inputs; more is a bug, not a step
SHM_DIR = "/dev/shm"
COMMUNICATORS = ("shm", "gloo")

_LINE = 8  # int64s per rank line: 64 bytes, so ranks never share a cache line
_ARRIVE, _DONE, _PID, _NBYTES = range(4)
_HEADER_INTS = 8  # magic, world size, slot bytes, (pad); then one line per rank
_MAGIC = 0x61746F6D64545031  # "atomdTP1"
_SPIN = 64  # polls before the first sleep: a peer on another core answers in microseconds
# a sleep, not sched_yield: with more runnable processes than cores a yielding waiter still
# takes turns from the peer it waits for (benchmarks/shm_all_to_all.py)
_POLL_SLEEP_S = 20e-6
# past this without progress (an idle worker waiting for the next step) the sleep doubles up to
# _IDLE_SLEEP_S: a thousand wake-ups a second instead of tens of thousands, and a step after an
# idle spell starts at most that much later
_BACKOFF_AFTER_S = 0.01
_IDLE_SLEEP_S = 1e-3
_LIVENESS_EVERY_S = 0.1
_REDUCIBLE = (torch.float32, torch.bfloat16, torch.float16)


class CollectiveTimeout(CollectiveBroken):
    """A peer did not arrive in time (or its process exited); `ranks` names them (None where
    the transport cannot tell, gloo)."""

    def __init__(self, message: str, ranks: list[int] | None = None):
        super().__init__(message)
        self.ranks = ranks


class TPCommunicator:
    """The collectives a TP rank calls, the same count and order on every rank."""

    rank: int
    world_size: int

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` (contiguous fp32 / bf16 / fp16, the same shape on every rank) over the
        ranks, in place; returns `t`."""
        raise NotImplementedError

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` (the same shape and dtype on every rank) concatenated along the
        last dim, in rank order."""
        raise NotImplementedError

    def broadcast_bytes(self, payload: bytes | None, timeout_s: float | None = None) -> bytes:
        """Rank 0's `payload` (at most MAX_BROADCAST_BYTES) on every rank; the others pass
        None. `timeout_s` overrides the communicator's for this call (an idle worker)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def _check_reducible(t: torch.Tensor) -> None:
    if t.dtype not in _REDUCIBLE:
        raise TypeError(f"all_reduce_ takes float32, bfloat16 or float16, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError("all_reduce_ needs a contiguous tensor")


def _sum_in_rank_order(parts: list[torch.Tensor], out: torch.Tensor) -> None:
    """out = parts[0] + parts[1] + ... (fp32 accumulation for 16-bit floats, one rounding)."""
    if out.dtype == torch.float32:
        torch.add(parts[0], parts[1], out=out) if len(parts) > 1 else out.copy_(parts[0])
        for p in parts[2:]:
            out.add_(p)
        return
    acc = torch.empty(out.shape, dtype=torch.float32)
    acc.copy_(parts[0])
    for p in parts[1:]:
        acc.add_(p)  # fp32 += bf16: the bf16 operand is widened exactly, no temporary
    out.copy_(acc)


def _pid_alive(pid: int) -> bool:
    """False once `pid` exited (a zombie, not yet reaped by its parent, counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True  # no /proc here: rely on the deadline


class ShmCommunicator(TPCommunicator):
    """This process's rank of one host's TP group over /dev/shm/`name` (rank 0 creates it,
    the others map it; see the module docstring)."""

    def __init__(self, name: str, rank: int, world_size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 slot_bytes: int = DEFAULT_SLOT_BYTES, join_timeout_s: float = 60.0,
                 scatter_min_bytes: int = SCATTER_MIN_BYTES):
        if not 0 <= rank < world_size:
            raise ValueError(f"tp rank must be in [0, {world_size}), got {rank}")
        self.scatter_min_bytes = scatter_min_bytes
        if slot_bytes < 64 or slot_bytes % 64:
            raise ValueError(f"slot_bytes must be a positive multiple of 64, got {slot_bytes}")
        if "/" in name or not name:
            raise ValueError(f"a shared-memory name is one path component, got {name!r}")
        self.name, self.rank, self.world_size = name, rank, world_size
        self.timeout_s, self.slot_bytes = timeout_s, slot_bytes
        self.path = os.path.join(SHM_DIR, name)
        self.header_bytes = 8 * (_HEADER_INTS + _LINE * world_size)
        size = self.header_bytes + world_size * slot_bytes
        self.seq = 0
        self.broken: str | None = None
        self._mm = self._open(size, join_timeout_s)
        self.header = np.ndarray(_HEADER_INTS + _LINE * world_size, np.int64, self._mm)
        self.lines = [self.header[_HEADER_INTS + _LINE * r:_HEADER_INTS + _LINE * (r + 1)]
                      for r in range(world_size)]
        self.slots = [torch.frombuffer(self._mm, dtype=torch.uint8, count=slot_bytes,
                                       offset=self.header_bytes + r * slot_bytes) for r in range(world_size)]
        if rank == 0:
            self.header[1], self.header[2] = world_size, slot_bytes
            self.header[0] = _MAGIC
        self.lines[rank][_PID] = os.getpid()
        try:
            self._round(0, lambda slot: None, lambda: None, timeout_s=join_timeout_s, what="join")
            for r, line in enumerate(self.lines):  # arrived, then died before this rank came
                if not _pid_alive(int(line[_PID])):
                    self._fail(_ARRIVE, math.inf, "join", "exited", [r])
        except CollectiveBroken:
            self._unlink()
            raise
        self._unlink()  # every rank has it mapped: the name is no longer needed

    def _open(self, size: int, join_timeout_s: float) -> mmap.mmap:
        if self.rank == 0:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, size)
                return mmap.mmap(fd, size)
            finally:
                os.close(fd)
        deadline = time.monotonic() + join_timeout_s
        while True:  # a worker may start before rank 0 created the segment
            try:
                fd = os.open(self.path, os.O_RDWR)
            except FileNotFoundError:
                fd = None
            if fd is not None:
                try:
                    if os.fstat(fd).st_size == size:
                        mm = mmap.mmap(fd, size)
                        if int(np.frombuffer(mm, np.int64, 1)[0]) == _MAGIC:
                            return mm
                        mm.close()
                    elif os.fstat(fd).st_size > 0:
                        raise ValueError(f"{self.path} is {os.fstat(fd).st_size} bytes, this group "
                                         f"needs {size}: another group's segment, or a different world size")
                finally:
                    os.close(fd)
            if time.monotonic() > deadline:
                self._unlink()  # rank 0 created it and died before it was ready
                raise CollectiveTimeout(f"tp rank {self.rank}: rank 0 did not create {self.path} "
                                        f"within {join_timeout_s} s", [0])
            time.sleep(0.005)

    def _unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    # the round protocol

    def _wait(self, field: int, value: int, timeout_s: float, what: str) -> None:
        """Until every rank's `field` >= value, or CollectiveTimeout naming the late ranks."""
        start = time.monotonic()
        next_liveness = start + _LIVENESS_EVERY_S
        spins, sleep_s = 0, _POLL_SLEEP_S
        for r, line in enumerate(self.lines):
            while line[field] < value:
                spins += 1
                if spins <= _SPIN:
                    continue
                time.sleep(sleep_s)
                now = time.monotonic()
                if now - start > _BACKOFF_AFTER_S:
                    sleep_s = min(2 * sleep_s, _IDLE_SLEEP_S)
                if now - start > timeout_s:
                    self._fail(field, value, what, f"did not arrive within {timeout_s} s")
                if now > next_liveness:
                    next_liveness = now + _LIVENESS_EVERY_S
                    pid = int(line[_PID])
                    if pid and not _pid_alive(pid):
                        self._fail(field, value, what, "exited")

    def _fail(self, field: int, value: float, what: str, why: str, late: list[int] | None = None) -> None:
        if late is None:
            late = [r for r, line in enumerate(self.lines) if line[field] < value]
        pids = [int(self.lines[r][_PID]) for r in late]
        self.broken = (f"tp rank {self.rank}: {what} (round {self.seq}): rank(s) {late} (pid {pids}) {why}; "
                       f"the TP group is broken")
        raise CollectiveTimeout(self.broken, late)

    def _round(self, nbytes: int, write, read, *, timeout_s: float, what: str):
        """One round: publish `nbytes` (the call's whole size), write(slot) this rank's part,
        then read() once every rank has written."""
        if self.broken is not None:
            raise CollectiveTimeout(self.broken)
        self.seq += 1
        seq, me = self.seq, self.lines[self.rank]
        self._wait(_DONE, seq - 1, timeout_s, what)  # every peer is done reading my slot
        me[_NBYTES] = nbytes
        write(self.slots[self.rank])
        me[_ARRIVE] = seq
        self._wait(_ARRIVE, seq, timeout_s, what)
        try:
            return read()
        finally:
            me[_DONE] = seq

    # the collectives

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        _check_reducible(t)
        flat = t.view(-1)
        total = flat.numel() * t.element_size()
        per_round = self.slot_bytes // t.element_size()
        for at in range(0, flat.numel(), per_round):
            part = flat[at:at + per_round]
            nb = part.numel() * t.element_size()

            def write(slot, part=part, nb=nb):
                slot[:nb].view(part.dtype).copy_(part)

            if nb < self.scatter_min_bytes or self.world_size == 1:
                def read(part=part, nb=nb, first=at == 0):
                    if first:
                        self._check_same_sizes(total, "all_reduce_")
                    _sum_in_rank_order([s[:nb].view(part.dtype) for s in self.slots], part)

                self._round(total, write, read, timeout_s=self.timeout_s, what="all_reduce_")
                continue
            # big: each rank sums its share of the elements into the same place of its own slot
            # (no peer reads there: they read their own shares), then every rank copies the shares
            n, size = part.numel(), self.world_size
            bounds = [n * r // size for r in range(size + 1)]
            lo, hi = bounds[self.rank], bounds[self.rank + 1]

            def reduce_share(part=part, nb=nb, lo=lo, hi=hi, first=at == 0):
                if first:
                    self._check_same_sizes(total, "all_reduce_")
                views = [s[:nb].view(part.dtype) for s in self.slots]
                share = torch.empty(hi - lo, dtype=part.dtype)  # not in place: this slot is an operand
                _sum_in_rank_order([v[lo:hi] for v in views], share)
                views[self.rank][lo:hi].copy_(share)

            def gather_shares(part=part, nb=nb, bounds=bounds):
                for r, s in enumerate(self.slots):
                    part[bounds[r]:bounds[r + 1]].copy_(s[:nb].view(part.dtype)[bounds[r]:bounds[r + 1]])

            self._round(total, write, reduce_share, timeout_s=self.timeout_s, what="all_reduce_")
            self._round(total, lambda slot: None, gather_shares, timeout_s=self.timeout_s, what="all_reduce_")
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        src = t.contiguous().view(-1).view(torch.uint8)
        parts = [torch.empty_like(src) for _ in range(self.world_size)]
        for at in range(0, max(src.numel(), 1), self.slot_bytes):
            nb = min(self.slot_bytes, src.numel() - at)

            def write(slot, at=at, nb=nb):
                slot[:nb].copy_(src[at:at + nb])

            def read(at=at, nb=nb):
                if at == 0:
                    self._check_same_sizes(src.numel(), "all_gather")
                for r, s in enumerate(self.slots):
                    parts[r][at:at + nb].copy_(s[:nb])

            self._round(src.numel(), write, read, timeout_s=self.timeout_s, what="all_gather")
        return torch.cat([p.view(t.dtype).view(t.shape) for p in parts], dim=-1)

    def _check_same_sizes(self, nbytes: int, what: str) -> None:
        """In a call's first round: every rank sees every rank's size, so all raise together
        and stay in step."""
        sizes = [int(line[_NBYTES]) for line in self.lines]
        if any(s != nbytes for s in sizes):
            raise ValueError(f"{what}: the ranks' tensors differ in size ({sizes} bytes by rank)")

    def broadcast_bytes(self, payload: bytes | None, timeout_s: float | None = None) -> bytes:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if self.rank == 0:
            if payload is None:
                raise ValueError("rank 0 broadcasts a payload")
            if len(payload) > MAX_BROADCAST_BYTES:
                raise ValueError(f"broadcast of {len(payload)} bytes > {MAX_BROADCAST_BYTES}")
            src = np.frombuffer(payload, np.uint8)
        elif payload is not None:
            raise ValueError("only rank 0 broadcasts a payload; the others pass None")
        # the first round tells the length; the others wait for it as long as asked (an idle
        # worker), later rounds under the communicator's timeout
        out = bytearray()
        total = None
        while total is None or len(out) < total:
            at = len(out)

            def write(slot, at=at):
                if self.rank == 0:
                    nb = min(self.slot_bytes, len(payload) - at)
                    slot[:nb].numpy()[:] = src[at:at + nb]

            def read(at=at):
                n = int(self.lines[0][_NBYTES])
                if not 0 <= n <= MAX_BROADCAST_BYTES:  # a corrupt header, never a real step
                    self.broken = f"tp rank {self.rank}: broadcast of {n} bytes announced"
                    raise CollectiveBroken(self.broken)
                return n, bytes(self.slots[0][:min(self.slot_bytes, n - at)].numpy())

            total, chunk = self._round(len(payload) if self.rank == 0 else 0, write, read,
                                       timeout_s=timeout_s if total is None else self.timeout_s,
                                       what="broadcast_bytes")
            out += chunk
        return payload if self.rank == 0 else bytes(out)

    def close(self) -> None:
        """Unmap (the name is gone since the join). Peers that still wait time out."""
        if self._mm is None:
            return
        self.header = self.lines = self.slots = None
        try:
            self._mm.close()
        except BufferError:  # a tensor view the caller still holds: the mapping goes with it
            pass
        self._mm = None
        self._unlink()


class GlooCommunicator(TPCommunicator):
    """This process's rank of a TP group over a standalone gloo process group; rank 0 hosts the
    TCPStore at host:port."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, join_timeout_s: float = 60.0):
        import torch.distributed as dist
        from torch._C._distributed_c10d import AllgatherOptions, BroadcastOptions
        if not 0 <= rank < world_size:
            raise ValueError(f"tp rank must be in [0, {world_size}), got {rank}")
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.broken: str | None = None
        self._allgather_opts, self._broadcast_opts = AllgatherOptions, BroadcastOptions
        self.store = dist.TCPStore(host, port, world_size, rank == 0,
                                   timeout=datetime.timedelta(seconds=join_timeout_s))
        self.group = dist.ProcessGroupGloo(self.store, rank, world_size,
                                           datetime.timedelta(seconds=timeout_s))

    def _run(self, what: str, start, timeout_s: float | None = None):
        """start(opts) -> Work; waits under the timeout; a failure breaks the group."""
        if self.broken is not None:
            raise CollectiveTimeout(self.broken)
        try:
            work = start(timeout_s)
            work.wait()
        except Exception as exc:
            self.broken = f"tp rank {self.rank}: gloo {what} failed: {type(exc).__name__}: {exc}; the TP group is broken"
            raise CollectiveTimeout(self.broken) from exc

    def _opts(self, cls, timeout_s: float | None):
        opts = cls()
        t = self.timeout_s if timeout_s is None else min(timeout_s, 10 * 365 * 86400)
        opts.timeout = datetime.timedelta(seconds=t)
        return opts

    def _gather(self, flat: torch.Tensor, what: str) -> list[torch.Tensor]:
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._run(what, lambda t: self.group.allgather([sizes], [torch.tensor([flat.numel()])],
                                                       self._opts(self._allgather_opts, t)))
        if any(int(s) != flat.numel() for s in sizes):
            raise ValueError(f"{what}: the ranks' tensors differ in size ({[int(s) for s in sizes]} elements by rank)")
        parts = [torch.empty_like(flat) for _ in range(self.world_size)]
        self._run(what, lambda t: self.group.allgather([parts], [flat], self._opts(self._allgather_opts, t)))
        return parts

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        _check_reducible(t)
        flat = t.view(-1)
        _sum_in_rank_order(self._gather(flat, "all_reduce_"), flat)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        src = t.contiguous().view(-1).view(torch.uint8)
        parts = self._gather(src, "all_gather")
        return torch.cat([p.view(t.dtype).view(t.shape) for p in parts], dim=-1)

    def broadcast_bytes(self, payload: bytes | None, timeout_s: float | None = None) -> bytes:
        if self.rank == 0:
            if payload is None:
                raise ValueError("rank 0 broadcasts a payload")
            if len(payload) > MAX_BROADCAST_BYTES:
                raise ValueError(f"broadcast of {len(payload)} bytes > {MAX_BROADCAST_BYTES}")
        elif payload is not None:
            raise ValueError("only rank 0 broadcasts a payload; the others pass None")
        n = torch.tensor([len(payload) if self.rank == 0 else 0], dtype=torch.int64)
        self._run("broadcast_bytes", lambda _: self.group.broadcast([n], self._opts(self._broadcast_opts, timeout_s)))
        total = int(n[0])
        if not 0 <= total <= MAX_BROADCAST_BYTES:
            self.broken = f"tp rank {self.rank}: broadcast of {total} bytes announced"
            raise CollectiveBroken(self.broken)
        buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.rank == 0 and total
               else torch.empty(total, dtype=torch.uint8))
        if total:
            self._run("broadcast_bytes", lambda t: self.group.broadcast([buf], self._opts(self._broadcast_opts, t)))
        return payload if self.rank == 0 else bytes(buf.numpy())

    def close(self) -> None:
        self.group = None
        self.store = None


@dataclass(frozen=True)
class TPGroup:
    """What a TP rank needs to join its group (picklable: rank 0 makes it, passes it to each
    worker it spawns). `address`: shm, the segment's name; gloo, host:port of rank 0's store."""

    communicator: str
    world_size: int
    address: str
    timeout_s: float = DEFAULT_TIMEOUT_S
    slot_bytes: int = DEFAULT_SLOT_BYTES
    join_timeout_s: float = 60.0
    scatter_min_bytes: int = SCATTER_MIN_BYTES

    def join(self, rank: int) -> TPCommunicator:
        """This process's rank; blocks until every rank joined (rank 0 may join before or after
        spawning its workers: a worker waits for the segment)."""
        if self.communicator == "shm":
            return ShmCommunicator(self.address, rank, self.world_size, timeout_s=self.timeout_s,
                                   slot_bytes=self.slot_bytes, join_timeout_s=self.join_timeout_s,
                                   scatter_min_bytes=self.scatter_min_bytes)
        host, _, port = self.address.rpartition(":")
        return GlooCommunicator(host, int(port), rank, self.world_size, timeout_s=self.timeout_s,
                                join_timeout_s=self.join_timeout_s)


def new_tp_group(communicator: str, world_size: int, *, host: str = "127.0.0.1", port: int | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, slot_bytes: int = DEFAULT_SLOT_BYTES,
                 join_timeout_s: float = 60.0, scatter_min_bytes: int = SCATTER_MIN_BYTES) -> TPGroup:
    """Rank 0's new group (`--tp-communicator`): shm, a fresh unique segment name; gloo, rank
    0's store at host:port (a free loopback port when none is given)."""
    if communicator not in COMMUNICATORS:
        raise ValueError(f"tp communicator must be one of {COMMUNICATORS}, got {communicator!r}")
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    if not timeout_s > 0:
        raise ValueError(f"tp collective timeout must be > 0, got {timeout_s}")
    if communicator == "shm":
        address = f"atomd-tp-{os.getpid()}-{secrets.token_hex(8)}"
    else:
        if port is None:
            import socket
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        address = f"{host}:{port}"
    return TPGroup(communicator, world_size, address, timeout_s, slot_bytes, join_timeout_s, scatter_min_bytes)
