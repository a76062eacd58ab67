"""The real PrefillDelayer over a real gloo group: 2 and 3 rank processes on 127.0.0.1,
scripted per-rank inputs, decisions checked against hand-computed outcomes.

Every scenario of one group runs in one spawn (one torch import per rank); each rank
writes its decisions, outcomes and collective counts to a JSON file the test reads.
"""
from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch.multiprocessing as mp

from launch.process import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

JOIN_S = 90.0


def spawn_ranks(target, world: int, tmp_path: pathlib.Path, *args) -> list[dict]:
    """Run target(rank, world, port, out_path, *args) in `world` spawned processes; each
    rank's JSON result (None for a rank that wrote none). Every process is reaped."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, str(tmp_path / f"rank{r}.json"), *args))
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(JOIN_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    results = []
    for r in range(world):
        path = tmp_path / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return results


def run_scenarios(rank, world, port, out_path, scenarios, timeout_s, die_after=None):
    """A rank: one gloo group, one fresh delayer per scenario over it. `die_after`:
    (rank, scenario name) after which that rank exits without a word."""
    import torch

    from atomd.engine.dp_collective import GlooCollective, ObservedPrefillDelayer
    from tests.fake_connector import make_delayer

    torch.set_num_threads(1)
    coll = GlooCollective(rank, world, port, timeout_s=timeout_s, join_timeout_s=60)
    results = {}
    for name, kwargs, script in scenarios:
        delayer = make_delayer(coll, cls=ObservedPrefillDelayer, **kwargs)
        before = coll.num_collectives
        decisions = [delayer.should_allow_prefill(**inputs) for inputs in script[rank]]
        stats = delayer.stats()
        results[name] = {"decisions": decisions, "collectives": coll.num_collectives - before,
                         "reasons": {f"{o}/{r}": n for _, o, r, n in stats["outcomes"]},
                         "hold_ticks": stats["hold_ticks"], "errors": stats["collective_errors"]}
        if die_after == (rank, name):
            pathlib.Path(out_path).write_text(json.dumps(results))
            os._exit(0)
    pathlib.Path(out_path).write_text(json.dumps(results))
    coll.close()


def P(usage=0.5, **kw):  # prefillable
    return dict(local_prefillable=True, token_usage=usage, **kw)


def IDLE(**kw):
    return dict(local_prefillable=False, token_usage=0.5, **kw)


def ticks(*per_rank):
    """per_rank[r]: rank r's inputs, one dict per tick."""
    return [list(x) for x in per_rank]


COALESCE = dict(policy="coalesce", max_num_batched_tokens=100, ttft_max_ticks=1000,
                partial_max_ticks=1000, stall_ticks=1000, queue_max_ticks=1000)
GROW = [P(pending_tokens=10 * (t + 1), num_decodes=1) for t in range(5)]  # never stalls

TWO = [
    ("all", dict(policy="align"), ticks([P()], [P()])),
    ("none", dict(policy="align"), ticks([IDLE()], [IDLE()])),
    # mixed: held on ticks with 0, 1, 2 passes behind it, allowed at the 3rd
    ("mixed_max_delay", dict(policy="align", max_delay_passes=3), ticks([P()] * 4, [IDLE()] * 4)),
    ("low_watermark", dict(policy="align", max_delay_passes=3, token_usage_low_watermark=0.2),
     ticks([P(usage=0.5), P(usage=0.1)], [IDLE(), IDLE()])),
    # fill target 0.9 * 100 * 2 = 180 tokens: 100 + 90 fires, 100 + 70 does not
    ("coalesce_hold_then_fill", COALESCE,
     ticks([P(pending_tokens=100, num_decodes=1)] * 2,
           [P(pending_tokens=70, num_decodes=1), P(pending_tokens=90, num_decodes=1)])),
    ("coalesce_idle", COALESCE, ticks([P(pending_tokens=5)], [IDLE()])),
    ("coalesce_kv_high", COALESCE, ticks([P(usage=0.95, pending_tokens=5, num_decodes=1)], [IDLE()])),
    ("coalesce_kv_low", COALESCE, ticks([P(usage=0.05, pending_tokens=5, num_decodes=1)], [IDLE()])),
    ("coalesce_partial", dict(COALESCE, partial_max_ticks=2),
     ticks([dict(g, has_partial=True) for g in GROW[:3]], [IDLE(num_decodes=1)] * 3)),
    ("coalesce_ttft", dict(COALESCE, ttft_max_ticks=3), ticks(GROW[:4], [IDLE(num_decodes=1)] * 4)),
    ("coalesce_stall", dict(COALESCE, stall_ticks=2),
     ticks([P(pending_tokens=10, num_decodes=1)] * 3, [IDLE()] * 3)),
    ("coalesce_queue", dict(COALESCE, queue_max_ticks=2), ticks(GROW[:2], [IDLE(num_decodes=1)] * 2)),
]

EXPECTED_TWO = {  # name -> (decisions, {outcome/reason: count}, hold ticks per admitted prefill)
    "all": ([True], {"allow/all": 1}, [[0, 1]]),
    "none": ([True], {"allow/none": 1}, []),
    "mixed_max_delay": ([False, False, False, True], {"delay/mixed": 3, "allow/max_delay": 1}, [[3, 1]]),
    "low_watermark": ([False, True], {"delay/mixed": 1, "allow/low_watermark": 1}, [[1, 1]]),
    "coalesce_hold_then_fill": ([False, True], {"delay/coalescing": 1, "allow/fill": 1}, [[1, 1]]),
    "coalesce_idle": ([True], {"allow/idle": 1}, [[0, 1]]),
    "coalesce_kv_high": ([True], {"allow/kv": 1}, [[0, 1]]),
    "coalesce_kv_low": ([True], {"allow/kv": 1}, [[0, 1]]),
    "coalesce_partial": ([False, False, True], {"delay/coalescing": 2, "allow/partial": 1}, [[2, 1]]),
    "coalesce_ttft": ([False] * 3 + [True], {"delay/coalescing": 3, "allow/ttft": 1}, [[3, 1]]),
    "coalesce_stall": ([False, False, True], {"delay/coalescing": 2, "allow/stall": 1}, [[2, 1]]),
    "coalesce_queue": ([False, True], {"delay/coalescing": 1, "allow/queue": 1}, [[1, 1]]),
}

THREE = [
    # two of three ranks ready: mixed, held; the third becomes ready: all, allowed
    ("align_mixed_then_all", dict(policy="align"),
     ticks([P()] * 3, [P()] * 3, [IDLE(), IDLE(), P()])),
    ("align_one_of_three_max_delay", dict(policy="align", max_delay_passes=1),
     ticks([IDLE()] * 2, [P()] * 2, [IDLE()] * 2)),
    ("coalesce_three_fill", COALESCE,  # 0.9 * 100 * 3 = 270
     ticks([P(pending_tokens=100, num_decodes=1)] * 2, [P(pending_tokens=100, num_decodes=1)] * 2,
           [IDLE(num_decodes=2), P(pending_tokens=80, num_decodes=1)])),
]

EXPECTED_THREE = {
    "align_mixed_then_all": ([False, False, True], {"delay/mixed": 2, "allow/all": 1}),
    "align_one_of_three_max_delay": ([False, True], {"delay/mixed": 1, "allow/max_delay": 1}),
    "coalesce_three_fill": ([False, True], {"delay/coalescing": 1, "allow/fill": 1}),
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn_ranks(run_scenarios, 2, tmp_path_factory.mktemp("two"), TWO, 20.0)


@pytest.mark.parametrize("name", list(EXPECTED_TWO))
def test_two_ranks_decide_alike_with_one_collective_per_tick(two_ranks, name):
    decisions, reasons, hold = EXPECTED_TWO[name]
    script = dict((n, s) for n, _, s in TWO)[name]
    for rank, result in enumerate(two_ranks):
        got = result[name]
        assert got["decisions"] == decisions, (rank, got)
        assert got["reasons"] == reasons
        assert got["collectives"] == len(script[rank])  # idle ranks tick too, exactly once
        assert got["hold_ticks"] == hold
        assert got["errors"] == 0


def test_three_ranks_decide_alike(tmp_path):
    results = spawn_ranks(run_scenarios, 3, tmp_path, THREE, 20.0)
    for name, (decisions, reasons) in EXPECTED_THREE.items():
        for result in results:
            assert result[name]["decisions"] == decisions, (name, result[name])
            assert result[name]["reasons"] == reasons
            assert result[name]["collectives"] == len(decisions)


def test_a_rank_that_dies_makes_the_others_fail_open(tmp_path):
    scenarios = [("before", dict(policy="align"), ticks([P()] * 2, [IDLE()] * 2)),
                 ("after", dict(policy="align"), ticks([P()] * 4, [IDLE()] * 4))]
    survivor, dead = spawn_ranks(run_scenarios, 2, tmp_path, scenarios, 5.0, (1, "before"))
    assert survivor["before"]["decisions"] == [False, False]  # mixed, held, while both live
    assert dead is not None and "after" not in dead
    after = survivor["after"]
    assert after["decisions"] == [True] * 4  # every tick after the death allows prefill
    assert after["reasons"] == {"allow/collective_error": 4}
    assert after["errors"] == 4 and after["collectives"] == 4


@pytest.mark.unit
def test_the_group_listens_on_the_interface_that_routes_to_rank_0():
    """gloo's device: lo for a loopback group (another host's address: test_expert_parallel's
    group over two network namespaces, where each host's is its eth0)."""
    from atomd.engine.dp_collective import interface_towards

    assert interface_towards("127.0.0.1") == "lo"
    assert interface_towards("localhost") == "lo"
    with pytest.raises(RuntimeError, match="data_parallel_address 'no-such-host.invalid' cannot be reached"):
        interface_towards("no-such-host.invalid")
