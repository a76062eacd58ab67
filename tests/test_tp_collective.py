"""Tensor parallelism's collectives (atomd/engine/tp_collective.py) across real processes:
results equal a torch reference exactly (sums folded in rank order, 16-bit floats summed in
fp32 and rounded once), chunking past the segment, a killed or stopped peer raising
CollectiveTimeout on the survivors, and no /dev/shm name left behind."""
from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest
import torch

from atomd.engine.tp_collective import CollectiveTimeout, ShmCommunicator, new_tp_group

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SLOT = 4096  # small, so the bigger cases take several rounds
DEADLINE_S = 120.0

# (op, dtype, shape or payload length)
CASES = [
    ("reduce", torch.float32, (7,)),
    ("reduce", torch.float32, (16, 1000)),  # 16 chunks, the last one partial; each summed share by share
    ("reduce", torch.bfloat16, (3, 1111)),
    ("reduce", torch.float16, (5, 3)),
    ("gather", torch.float32, (2, 3, 5)),
    ("gather", torch.bfloat16, (4, 2000)),  # 4 rounds
    ("gather", torch.int64, (3, 1)),
    ("bcast", None, 0),
    ("bcast", None, 100),
    ("bcast", None, 3 * SLOT + 5),  # 4 rounds
    ("mismatch", torch.float32, None),  # sizes differ by rank: ValueError on every rank, still in step
    ("reduce", torch.float32, (2 * SLOT,)),  # ... as the next call shows
]


def case_input(i: int, rank: int):
    op, dtype, shape = CASES[i]
    g = torch.Generator().manual_seed(1000 * i + rank)
    if op == "bcast":
        return bytes(torch.randint(0, 256, (shape,), generator=g, dtype=torch.uint8).tolist())
    if op == "mismatch":
        return torch.randn(10 + rank, generator=g)
    if dtype == torch.int64:
        return torch.randint(-10**12, 10**12, shape, generator=g)
    # wide magnitudes, so the summation order and the rounding show in the last bits
    return (torch.randn(shape, generator=g) * 10.0 ** torch.randint(-3, 4, shape, generator=g)).to(dtype)


def reference(i: int, world: int):
    op, dtype, _ = CASES[i]
    xs = [case_input(i, r) for r in range(world)]
    if op == "bcast":
        return xs[0]
    if op == "gather":
        return torch.cat(xs, dim=-1)
    acc = xs[0].float()
    for x in xs[1:]:
        acc = acc + x.float()  # left to right: rank 0 + rank 1 + ...
    return acc.to(dtype)


def pack(t):
    """A tensor as plain bytes: torch would share it through a file descriptor that dies
    with the rank."""
    return t if not isinstance(t, torch.Tensor) else (t.dtype, tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())


def unpack(x):
    if not isinstance(x, tuple):
        return x
    dtype, shape, raw = x
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).view(shape)


def run_cases(comm, rank):
    out = []
    for i, (op, _, _) in enumerate(CASES):
        x = case_input(i, rank)
        if op == "bcast":
            out.append(comm.broadcast_bytes(x if rank == 0 else None))
        elif op == "gather":
            out.append(pack(comm.all_gather(x)))
        else:
            try:
                out.append(pack(comm.all_reduce_(x)))
            except ValueError as exc:
                out.append(f"ValueError: {exc}")
    return out


def rank_main(groups, rank, conn, victim_op):
    """One TP rank: join each group, say so, wait for `go`, then run the cases (or, for the
    failure tests, one collective), and report."""
    torch.set_num_threads(1)
    comms = []
    try:
        comms = [g.join(rank) for g in groups]
        conn.send(("joined", rank, os.getpid()))
        if not conn.poll(DEADLINE_S):
            return
        conn.recv()
        if victim_op is None:
            conn.send(("done", rank, [run_cases(c, rank) for c in comms]))
            return
        t0 = time.monotonic()
        try:
            if victim_op == "idle":  # a worker waiting for rank 0's next step, without a deadline
                comms[0].broadcast_bytes(None, timeout_s=math.inf)
            else:
                comms[0].all_reduce_(torch.ones(8))
            conn.send(("done", rank, "no error"))
        except CollectiveTimeout as exc:
            conn.send(("done", rank, ("timeout", exc.ranks, str(exc), time.monotonic() - t0)))
    finally:
        for c in comms:
            c.close()


@pytest.fixture(scope="module")
def ctx():
    # children fork from one server that imported torch once: a spawn per rank costs seconds here
    c = mp.get_context("forkserver")
    c.set_forkserver_preload(["torch", "atomd.engine.tp_collective", "tests.test_tp_collective"])
    return c


class Ranks:
    """`world` rank processes of the given groups; every one is reaped at exit."""

    def __init__(self, ctx, groups, world, victim_op=None, ranks=None):
        # a pipe per rank, not a shared Queue or Event: a rank killed while it held their lock
        # would block every other rank's writes (or the parent's set)
        self.pipes = {r: ctx.Pipe() for r in (range(world) if ranks is None else ranks)}
        self.procs = {r: ctx.Process(target=rank_main, args=(groups, r, self.pipes[r][1], victim_op))
                      for r in self.pipes}
        for p in self.procs.values():
            p.start()

    def go(self, *ranks):
        for r in ranks:
            self.pipes[r][0].send("go")

    def collect(self, kind, *ranks):
        got, deadline = {}, time.monotonic() + DEADLINE_S
        for r in ranks or self.pipes:
            conn = self.pipes[r][0]
            assert conn.poll(max(0.0, deadline - time.monotonic())), f"rank {r} sent no {kind!r}"
            msg = conn.recv()
            assert msg[:2] == (kind, r), msg
            got[r] = msg[2]
        return got

    def stop(self):
        for p in self.procs.values():
            if p.is_alive():
                # a forkserver child is reaped by the forkserver: it may be gone between the two lines
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                    p.kill()
            p.join(10)


def rank_0_arrived(name):
    """Rank 0's `arrive` counter in the segment's header (the first int64 of its line)."""
    try:
        header = np.fromfile(f"/dev/shm/{name}", dtype=np.int64, count=16)
    except (FileNotFoundError, ValueError):
        return False
    return len(header) == 16 and header[8] >= 1


def shm_names():
    return {n for n in os.listdir("/dev/shm") if n.startswith("atomd-tp-")}


def assert_same(got, want):
    if isinstance(want, bytes):
        assert got == want
    else:
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_equal_a_torch_reference_on_both_communicators(ctx, world):
    before = shm_names()
    groups = [new_tp_group("shm", world, slot_bytes=SLOT, timeout_s=30, scatter_min_bytes=SLOT // 4),
              new_tp_group("gloo", world, timeout_s=30)]
    ranks = Ranks(ctx, groups, world)
    try:
        ranks.collect("joined")
        assert groups[0].address not in shm_names()  # unlinked once every rank mapped it
        ranks.go(*range(world))
        done = ranks.collect("done")
    finally:
        ranks.stop()
    for i, (op, _, _) in enumerate(CASES):
        want = reference(i, world) if op != "mismatch" else None
        for rank in range(world):
            for c, comm in enumerate(("shm", "gloo")):
                got = unpack(done[rank][c][i])
                if op == "mismatch":
                    assert isinstance(got, str) and got.startswith("ValueError") and "differ in size" in got
                else:
                    assert_same(got, want)
    assert shm_names() <= before


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_dead_or_stopped_peer_raises_collective_timeout_on_the_survivors(ctx, how):
    timeout = 2.0
    group = new_tp_group("shm", 3, timeout_s=timeout)
    ranks = Ranks(ctx, [group], 3, victim_op="reduce")
    try:
        pids = ranks.collect("joined")
        os.kill(pids[2], signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        ranks.go(0, 1)
        done = ranks.collect("done", 0, 1)
    finally:
        ranks.stop()
    for rank in (0, 1):
        kind, late, message, elapsed = done[rank]
        assert kind == "timeout" and late == [2], done[rank]
        assert f"pid [{pids[2]}]" in message
        assert ("exited" if how == "kill" else f"did not arrive within {timeout} s") in message
        if how == "stop":
            assert elapsed >= timeout  # a stopped peer is waited for, then given up
    assert group.address not in shm_names()


def test_workers_notice_rank_0_crash_without_a_deadline_and_nothing_is_left_in_dev_shm(ctx):
    group = new_tp_group("shm", 3, timeout_s=2.0)
    ranks = Ranks(ctx, [group], 3, victim_op="idle")
    try:
        pids = ranks.collect("joined")
        os.kill(pids[0], signal.SIGKILL)
        ranks.go(1, 2)
        done = ranks.collect("done", 1, 2)
    finally:
        ranks.stop()
    for rank in (1, 2):
        kind, late, message, _ = done[rank]
        assert kind == "timeout" and late == [0] and "exited" in message, done[rank]
    assert group.address not in shm_names()


def test_rank_0_crash_before_the_join_completes_leaves_nothing_in_dev_shm(ctx):
    """Rank 0 created the segment, then died while waiting for its workers: the worker that
    comes later finds a dead rank 0, gives up, and removes the name."""
    group = new_tp_group("shm", 2, timeout_s=2.0, join_timeout_s=60)
    ranks = Ranks(ctx, [group], 2, ranks=[0])
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not rank_0_arrived(group.address):  # rank 0 waits in the join for rank 1 now
            assert time.monotonic() < deadline and ranks.procs[0].is_alive()
            time.sleep(0.01)
        ranks.procs[0].kill()
        ranks.procs[0].join(10)
        with pytest.raises(CollectiveTimeout) as err:
            ShmCommunicator(group.address, 1, 2, join_timeout_s=30)
        assert err.value.ranks == [0] and "exited" in str(err.value)
    finally:
        ranks.stop()
    assert group.address not in shm_names()


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_gloo_peer_killed_or_stopped_raises_collective_timeout(ctx, how):
    timeout = 2.0
    group = new_tp_group("gloo", 2, timeout_s=timeout)
    ranks = Ranks(ctx, [group], 2, victim_op="reduce")
    try:
        pids = ranks.collect("joined")
        os.kill(pids[1], signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        ranks.go(0)
        done = ranks.collect("done", 0)
    finally:
        ranks.stop()
    kind, _, message, elapsed = done[0]
    assert kind == "timeout" and "gloo all_reduce_ failed" in message
    if how == "stop":
        assert elapsed >= timeout * 0.9  # gloo's own deadline, not a connection error


def test_bad_arguments_are_refused_before_any_round():
    with pytest.raises(ValueError, match="tp communicator"):
        new_tp_group("nccl", 2)
    with pytest.raises(ValueError, match="tp rank"):
        ShmCommunicator("x", 2, 2)
    with pytest.raises(ValueError, match="one path component"):
        ShmCommunicator("../etc", 0, 2)
    one = new_tp_group("shm", 1).join(0)  # TP=1: a group of one, every call a copy
    try:
        t = torch.arange(6, dtype=torch.float32)
        assert torch.equal(one.all_reduce_(t.clone()), t)
        with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
            one.all_reduce_(torch.arange(3))
        with pytest.raises(ValueError, match="contiguous"):
            one.all_reduce_(torch.ones(4, 4).t())
        with pytest.raises(ValueError, match="rank 0 broadcasts a payload"):
            ShmCommunicator.broadcast_bytes(one, None)
        assert one.broadcast_bytes(b"abc") == b"abc"
    finally:
        one.close()
