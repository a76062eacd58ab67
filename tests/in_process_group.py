"""N simulated DP ranks in one process (one thread per rank): the PrefillDelayer's
Collective and expert parallelism's all-to-all for tests, without gloo or processes."""
from __future__ import annotations

import threading

import numpy as np
import torch

from scheduler.prefill_delayer import Collective


class InProcessGroup:
    """N simulated ranks in one process (one thread per rank)."""

    def __init__(self, world_size: int, timeout_s: float = 10.0):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._slots: list[np.ndarray | None] = [None] * world_size
        self._barrier = threading.Barrier(world_size)
        self._result: np.ndarray | None = None

    def rank(self, r: int) -> "InProcessCollective":
        if not 0 <= r < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {r}")
        return InProcessCollective(self, r)

    def _all_reduce(self, r: int, vec: np.ndarray) -> np.ndarray:
        self._slots[r] = np.asarray(vec, dtype=np.int64)
        if self._barrier.wait(self.timeout_s) == 0:  # one thread sums for all
            self._result = np.sum(self._slots, axis=0, dtype=np.int64)
        self._barrier.wait(self.timeout_s)
        result = self._result.copy()
        self._barrier.wait(self.timeout_s)  # nobody overwrites _result before all have read it
        return result

    def _all_to_all(self, r: int, out, inp, out_splits: list[int], in_splits: list[int]) -> None:
        """torch.distributed.all_to_all_single's contract: inp's in_splits[d] rows to rank d."""
        self._slots[r] = list(inp.split(in_splits))
        self._barrier.wait(self.timeout_s)
        chunks = [self._slots[s][r] for s in range(self.world_size)]
        assert [c.shape[0] for c in chunks] == out_splits, (r, out_splits)
        if chunks:
            out.copy_(torch.cat(chunks))
        self._barrier.wait(self.timeout_s)  # nobody overwrites a slot before all have read it


class InProcessCollective(Collective):
    def __init__(self, group: InProcessGroup, rank: int):
        self.group, self.rank, self.world_size = group, rank, group.world_size
        self.num_collectives = self.num_all_to_all = 0
        self.broken = None

    def all_reduce_sum(self, vec: np.ndarray) -> np.ndarray:
        self.num_collectives += 1
        return self.group._all_reduce(self.rank, vec)

    def all_to_all(self, out, inp, out_splits: list[int], in_splits: list[int]) -> None:
        self.num_all_to_all += 1
        self.group._all_to_all(self.rank, out, inp, out_splits, in_splits)
