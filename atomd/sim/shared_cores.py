"""Simulated engines that share a host's cores: each one's forward is slowed while another's runs.

Real engines on one small host (1P+1D on this 2-core machine) contend for the cores: a
decode step of D's that runs while P computes a prefill takes longer than one that runs
alone, and P's prefill is slower while D decodes. A served profile fitted from each engine's
steps alone saw that only as noise (its spread), and a simulated engine drew it at random,
so a request whose decode overlapped another's prefill was no slower than one decoding
alone (real 1P+1D, one round: TPOT p50 3.9 vs 1.6 ms; simulated: 1.8 vs 1.8 ms).

`atomd profile --from-servers` with several engines of one host lines their step samples up
by start time and fits each kind's `contention` q (hardware.Calibrated): a forward is
longer by q x the seconds another engine spent in a forward during it (processor sharing:
it progresses at 1 - q of its speed then). Simulated engines started with
`$ATOMD_SIM_SHARED_CORES=PATH` publish their forwards on one board at PATH (a small file,
mmap'd, one slot per engine: the engine's pid, its finished forward seconds so far, the
running forward's start and planned end) and stretch their own forward by q x the other
slots' forward seconds inside it, rechecking at its end (another engine may have started a
forward meanwhile).

While it waits out a forward such an engine spins on the clock instead of sleeping: the real
forward holds a core, and the engine's API process, the router and the client then get less of
the machine; a sleeping simulated forward handed them the core, and the real 1P+1D's first token
took ~2.5 ms longer from D's core to the client than the simulated one's (RESULTS.md, #38
session 6).

A slot is written without a lock; a reader may, for the microseconds between two writes,
see a forward both finished and running (or neither): an error of at most one forward's
overlap, once.
"""
from __future__ import annotations

import fcntl
import math
import mmap
import os

import numpy as np

SHARED_CORES_ENV = "ATOMD_SIM_SHARED_CORES"
SLOTS = 64
FIELDS = 4  # pid, done seconds, running forward's start (nan: none), its planned end
MAX_RECHECKS = 8  # a forward re-reads the board at most this many times at its end
YIELD_S = 2e-4  # a spinning forward lets the engine's other threads have the GIL this often


class SharedCores:
    """One engine's slot on the board at `path` (created when missing)."""

    def __init__(self, path: str, spin: bool = True):
        self.path, self.spin = path, spin
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # claiming a slot: one engine at a time
            if os.fstat(fd).st_size < SLOTS * FIELDS * 8:
                os.ftruncate(fd, SLOTS * FIELDS * 8)
            self._map = mmap.mmap(fd, SLOTS * FIELDS * 8)
            self.board = np.frombuffer(self._map, dtype=np.float64).reshape(SLOTS, FIELDS)
            free = [i for i in range(SLOTS) if not alive(int(self.board[i, 0]))]
            if not free:
                raise ValueError(f"{SHARED_CORES_ENV}: all {SLOTS} slots of {path} are held by running processes")
            self.slot = free[0]
            self.board[self.slot] = (os.getpid(), 0.0, math.nan, math.nan)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)  # the mapping holds a dup of fd: the lock would outlive the close
            os.close(fd)  # the mapping stays

    def busy(self, t: float) -> np.ndarray:
        """Each slot's forward seconds up to time `t` (the running forward counted to its
        planned end at most); this engine's own slot 0."""
        b = self.board.copy()
        start, end = b[:, 2], b[:, 3]
        running = np.where(np.isnan(start), 0.0, np.clip(np.minimum(t, end) - start, 0.0, None))
        out = b[:, 1] + running
        out[self.slot] = 0.0
        return out

    def ahead(self, now: float, until: float) -> float:
        """Other engines' forward seconds planned in (now, until] (their running forwards)."""
        b = self.board.copy()
        b[self.slot, 2] = math.nan
        start, end = b[:, 2], b[:, 3]
        return float(np.where(np.isnan(start), 0.0, np.clip(np.minimum(end, until) - np.maximum(start, now),
                                                             0.0, None)).sum())

    def begin(self, start: float, planned_end: float) -> np.ndarray:
        self.board[self.slot, 3] = planned_end
        self.board[self.slot, 2] = start
        return self.busy(start)

    def plan(self, planned_end: float) -> None:
        self.board[self.slot, 3] = planned_end

    def end(self, start: float, end: float) -> None:
        self.board[self.slot, 2] = math.nan
        self.board[self.slot, 1] += end - start


def hold_core(until: float, clock, sleep, spin: bool) -> None:
    """Waits until `clock()` reaches `until`: spinning (the core held, as a real forward holds
    it), or sleeping when not `spin`. A spin yields the GIL (sleep(0)) every YIELD_S: the
    engine's connector threads serve and land pulls while a real forward computes (torch
    releases the GIL), and a pure Python spin kept them out for up to the 5 ms switch
    interval (measured: ~0.8 of a core held, other threads' wake-ups late by <= 0.4 ms)."""
    if not spin:
        remaining = until - clock()
        if remaining > 0:
            sleep(remaining)
        return
    yielded = now = clock()
    while now < until:
        if now - yielded >= YIELD_S:
            sleep(0)
            yielded = now
        now = clock()


def alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def shared_cores_from_env() -> SharedCores | None:
    path = os.environ.get(SHARED_CORES_ENV)
    return SharedCores(path) if path else None
