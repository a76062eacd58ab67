"""SGLang's PrefillDelayer failure modes as regression tests: real Schedulers (fake model)
on 2 rank processes, the real delayer over the real gloo group.

- mismatched collective counts (an early return that skips the collective: deadlock)
- an unbounded delay branch (a mixed state held forever)
- starvation of one rank while another has a steady stream
- negotiating before the local admission check (a rank "ready" that cannot admit)
"""
from __future__ import annotations

import json
import pathlib

import pytest

from tests.test_dp_collective import IDLE, P, run_scenarios, spawn_ranks, ticks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def run_schedulers(rank, world, port, out_path, cases, timeout_s):
    """A rank: per case a fresh Scheduler + delayer over one gloo group, driven tick by tick.
    case = (name, delayer kwargs, scheduler kwargs, {rank: {tick: [(id, prompt_len, max_tokens)]}}, ticks)."""
    import torch

    from atomd.engine.dp_collective import GlooCollective, ObservedPrefillDelayer
    from scheduler.scheduler import Scheduler
    from contracts.sampling import SamplingParams
    from scheduler.sequence import Sequence
    from tests.fake_connector import FakeKV, make_delayer, scheduler_config, FakeModel, prompt, step

    torch.set_num_threads(1)
    coll = GlooCollective(rank, world, port, timeout_s=timeout_s, join_timeout_s=60)
    results = {}
    for name, delayer_kw, sched_kw, arrivals, num_ticks in cases:
        delayer = make_delayer(coll, cls=ObservedPrefillDelayer, **delayer_kw)
        cfg = scheduler_config(**sched_kw)
        sched = Scheduler(cfg, prefill_delayer=delayer)
        model = FakeModel(FakeKV(cfg.num_kvcache_blocks, cfg.block_size))
        before = coll.num_collectives
        first_prefill, finished, prefill_ticks = {}, {}, []
        mine = arrivals.get(str(rank), {})
        for tick in range(num_ticks):
            for i, (rid, n, max_tokens) in enumerate(mine.get(str(tick), [])):
                sched.add(Sequence(prompt(1000 * rank + 17 * tick + i, n), SamplingParams(max_tokens=max_tokens),
                                   request_id=rid))
            batch, updates = step(sched, model)
            if batch is not None and batch.is_prefill:
                prefill_ticks.append(tick)
                for seq in batch.seqs:
                    first_prefill.setdefault(seq.request_id, tick)
            for u in updates:
                if u.finished:
                    finished[u.seq.request_id] = tick
        stats = delayer.stats()
        results[name] = {"collectives": coll.num_collectives - before, "first_prefill": first_prefill,
                         "finished": finished, "prefill_ticks": prefill_ticks,
                         "reasons": {f"{o}/{r}": n for _, o, r, n in stats["outcomes"]},
                         "errors": stats["collective_errors"]}
    pathlib.Path(out_path).write_text(json.dumps(results))
    coll.close()


def stream(ticks_, prefix, n=4, max_tokens=2):
    """One short request every tick."""
    return {str(t): [(f"{prefix}{t}", n, max_tokens)] for t in range(ticks_)}


SCHED = dict(num_kvcache_blocks=256, block_size=4)
ALIGN = dict(policy="align", max_delay_passes=4)
COALESCE = dict(policy="coalesce", max_num_batched_tokens=8192, ttft_max_ticks=5, stall_ticks=1000,
                queue_max_ticks=1000)

CASES = [
    # rank 0 never has work (schedule() takes its earliest return every tick); rank 1 has a
    # chunked prefill (20 tokens, 8 per step) and short requests
    ("idle_and_chunked", ALIGN, dict(SCHED, max_num_batched_tokens=8),
     {"1": {"0": [("long", 20, 3)], "2": [("short", 4, 2)]}}, 30),
    # rank 0 gets a request every tick; rank 1 gets one at tick 3 and nothing else
    ("stream_align", ALIGN, SCHED, {"0": stream(20, "s"), "1": {"3": [("lone", 4, 2)]}}, 20),
    ("stream_coalesce", COALESCE, SCHED, {"0": stream(20, "s"), "1": {"3": [("lone", 4, 2)]}}, 20),
    # rank 0's KV is full (a 12-token prompt growing to 16 in 4 blocks of 4): its next request
    # cannot be admitted until the first one finishes; rank 1's request is admissible at once
    ("admission", dict(policy="align", max_delay_passes=1000), dict(num_kvcache_blocks=4, block_size=4),
     {"0": {"0": [("fill", 12, 5)], "1": [("blocked", 8, 2)]},
      "1": {"0": [("first", 4, 2)], "1": [("ready", 4, 2)]}}, 20),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    results = spawn_ranks(run_schedulers, 2, tmp_path_factory.mktemp("sched"), CASES, 20.0)
    return {name: [r[name] for r in results] for name, *_ in CASES}


def test_an_idle_rank_makes_exactly_as_many_collectives_as_a_busy_one(runs):
    idle, busy = runs["idle_and_chunked"]
    assert idle["collectives"] == busy["collectives"] == 30
    assert idle["errors"] == busy["errors"] == 0
    assert set(busy["finished"]) == {"long", "short"}
    # the 20-token prompt took three chunked prefill steps, all under the delayer's veto rule
    assert len([t for t in busy["prefill_ticks"] if t < busy["finished"]["long"]]) >= 3
    assert idle["reasons"] == busy["reasons"]


def test_mismatched_collective_counts_fail_open_instead_of_deadlocking(tmp_path):
    # rank 1 skips its third call (the early-return bug): rank 0's unmatched call must come
    # back (fail open, counted) within the group's timeout, not hang
    scenarios = [("skip", dict(policy="align"), ticks([P()] * 3, [P()] * 2))]
    longer, shorter = spawn_ranks(run_scenarios, 2, tmp_path, scenarios, 3.0)
    assert shorter["skip"]["decisions"] == [True, True]
    assert longer["skip"]["decisions"] == [True, True, True]
    assert longer["skip"]["reasons"] == {"allow/all": 2, "allow/collective_error": 1}


def test_align_never_holds_a_steady_stream_past_max_delay_passes(runs):
    ticks_ = runs["stream_align"][0]["prefill_ticks"]
    gaps = [b - a for a, b in zip([-1] + ticks_, ticks_)]
    assert ticks_ and max(gaps) <= ALIGN["max_delay_passes"] + 1
    assert runs["stream_align"][0]["reasons"].get("allow/max_delay", 0) > 0


def test_a_steady_stream_on_one_rank_does_not_starve_the_other(runs):
    # align: rank 1's request makes both ranks ready at its arrival tick: prefilled at once
    assert runs["stream_align"][1]["first_prefill"]["lone"] == 3
    # coalesce: held at most ttft_max_ticks
    lone = runs["stream_coalesce"][1]["first_prefill"]["lone"]
    assert 3 <= lone <= 3 + COALESCE["ttft_max_ticks"]
    for rank in runs["stream_coalesce"]:
        assert rank["errors"] == 0 and rank["collectives"] == 20


def test_a_rank_that_cannot_admit_does_not_report_ready(runs):
    rank0, rank1 = runs["admission"]
    # tick 0: both admit (all); from tick 1 rank 0 waits for blocks, so the state is mixed
    # and rank 1's request is held until rank 0 can admit, then both prefill together
    assert rank0["first_prefill"]["fill"] == rank1["first_prefill"]["first"] == 0
    blocked = rank0["first_prefill"]["blocked"]
    assert blocked > rank0["finished"]["fill"]
    assert rank1["first_prefill"]["ready"] == blocked
    assert rank0["reasons"]["delay/mixed"] == blocked - 1
