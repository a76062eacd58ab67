"""PrefillDelayer over N simulated ranks (threads): align and coalesce decisions, fail-open,
exactly one collective per call, and the scheduler calling it every tick."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from scheduler import prefill_delayer
from scheduler.prefill_delayer import Collective, SingleRank
from tests.in_process_group import InProcessGroup
from scheduler.scheduler import Scheduler
from contracts.sampling import SamplingParams
from scheduler.sequence import Sequence
from tests.fake_connector import FakeKV, make_delayer, reference_completion, scheduler_config, FakeModel, step

pytestmark = pytest.mark.unit


def ranks(n, policy="align", **kw):
    group = InProcessGroup(n, timeout_s=5.0)
    return [make_delayer(group.rank(r), policy, **kw) for r in range(n)]


def decide(delayers, inputs):
    """One tick on every rank at once; inputs[r] are rank r's keyword arguments."""
    out = [None] * len(delayers)

    def run(r):
        out[r] = delayers[r].should_allow_prefill(**inputs[r])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(delayers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return out


def same(n, **kw):
    return [dict(kw) for _ in range(n)]


def outcome(delayer):
    """The only (policy, outcome, reason) counted so far."""
    (key,) = [k for k, v in delayer.outcomes.items() if v]
    return key


P = dict(local_prefillable=True, token_usage=0.5)
IDLE = dict(local_prefillable=False, token_usage=0.5)


def test_in_process_group_sums_int64_vectors_across_ranks():
    group = InProcessGroup(3)
    out = [None] * 3
    big = 2**40

    def run(r):
        out[r] = group.rank(r).all_reduce_sum(np.array([r, big], dtype=np.int64))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    [t.start() for t in threads]
    [t.join(5) for t in threads]
    assert all(o.tolist() == [3, 3 * big] and o.dtype == np.int64 for o in out)


@pytest.mark.parametrize("inputs, allow, reason", [
    ([P, P, P], [True] * 3, "all"),
    ([IDLE, IDLE, IDLE], [True] * 3, "none"),
    ([P, IDLE, IDLE], [False] * 3, "mixed"),
])
def test_align_all_none_mixed(inputs, allow, reason):
    delayers = ranks(3)
    assert decide(delayers, inputs) == allow
    assert all(outcome(d) == ("align", "allow" if allow[0] else "delay", reason) for d in delayers)


def test_align_holds_a_mixed_state_for_max_delay_passes_then_allows():
    delayers = ranks(2, max_delay_passes=3)
    results = [decide(delayers, [P, IDLE]) for _ in range(5)]
    assert results == [[False, False]] * 3 + [[True, True], [False, False]]
    assert delayers[0].outcomes[("align", "allow", "max_delay")] == 1
    assert delayers[1].outcomes[("align", "delay", "mixed")] == 4


def test_align_low_watermark_releases_a_mixed_state_early():
    delayers = ranks(2, token_usage_low_watermark=0.2)
    low = dict(local_prefillable=True, token_usage=0.1)
    assert decide(delayers, [low, IDLE]) == [True, True]
    assert outcome(delayers[1]) == ("align", "allow", "low_watermark")
    assert decide(delayers, [dict(IDLE, token_usage=0.1), P]) == [False, False]  # the idle rank's usage does not count


def test_align_alignment_ready_gates_the_all_case():
    delayers = ranks(2)
    half = dict(P, local_alignment_ready=False)
    assert decide(delayers, [P, half]) == [False, False]


def test_aligned_share_splits_the_aligned_budget_between_the_ranks_that_prefill_together():
    delayers = ranks(3, aligned_tokens=96)
    assert decide(delayers, [P, P, P]) == [True] * 3
    assert [d.aligned_share() for d in delayers] == [32] * 3
    # an aligned tick's leftover: the rank prefills in the tick (ready) but has nothing to align
    leftover = dict(IDLE, local_alignment_ready=True)
    assert decide(delayers, [leftover, P, IDLE]) == [False] * 3  # align's meaning unchanged: mixed
    assert [d.aligned_share() for d in delayers] == [0] * 3
    assert decide(delayers, [leftover, IDLE, IDLE]) == [True] * 3  # "none"; one rank prefills: its own budget
    assert [d.aligned_share() for d in delayers] == [0] * 3
    two = ranks(2, aligned_tokens=96)
    assert decide(two, [leftover, P]) == [True, True]  # the new prompt aligns with the leftover
    assert outcome(two[0]) == ("align", "allow", "all") and [d.aligned_share() for d in two] == [48, 48]
    fired = ranks(2, "coalesce", aligned_tokens=96, max_num_batched_tokens=1000)
    idle = dict(local_prefillable=True, token_usage=0.5, pending_tokens=100, num_decodes=0)
    assert decide(fired, [idle, idle]) == [True, True] and [d.aligned_share() for d in fired] == [48, 48]
    assert [d.aligned_share() for d in ranks(2)] == [0, 0]  # aligned_tokens 0 (the default): off
    with pytest.raises(ValueError, match="aligned_tokens must be >= 0"):
        make_delayer(SingleRank(), aligned_tokens=-1)


def test_a_lone_release_gets_the_share_of_an_aligned_tick():
    """A rank released alone (max delay, the valve, coalesce firing for it) prefills
    aligned_tokens // world_size, the chunk it would have had beside every other rank, and so
    goes on as a leftover (unheld); "none", a failed collective, RELEASE_SHARE off: no share."""
    delayers = ranks(2, max_delay_passes=1, aligned_tokens=96)
    assert decide(delayers, [P, IDLE]) == [False, False] and [d.aligned_share() for d in delayers] == [0, 0]
    assert decide(delayers, [P, IDLE]) == [True, True] and delayers[0].reason == "max_delay"
    assert [d.aligned_share() for d in delayers] == [48, 48]
    assert decide(delayers, [dict(IDLE, local_alignment_ready=True), IDLE]) == [True, True]  # a leftover: "none"
    assert [d.aligned_share() for d in delayers] == [0, 0]  # the leftover keeps the share it has
    three = ranks(3, token_usage_low_watermark=0.2, aligned_tokens=96)
    assert decide(three, [dict(P, token_usage=0.1), IDLE, IDLE]) == [True] * 3  # the valve
    assert outcome(three[0]) == ("align", "allow", "low_watermark") and three[0].aligned_share() == 32
    fired = coalesce(aligned_tokens=96)
    assert decide(fired, [C(usage=0.95), C(prefillable=False)]) == [True, True]  # kv: rank 0 alone
    assert [d.aligned_share() for d in fired] == [48, 48]
    failed = make_delayer(Failing(), aligned_tokens=96)
    assert failed.should_allow_prefill(**P) is True and failed.aligned_share() == 0
    off = ranks(2, max_delay_passes=1, aligned_tokens=96)
    decide(off, [P, IDLE])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prefill_delayer, "RELEASE_SHARE", False)
        assert decide(off, [P, IDLE]) == [True, True] and [d.aligned_share() for d in off] == [0, 0]


def C(prefillable=True, usage=0.5, pending=100, decodes=4, partial=False):
    return dict(local_prefillable=prefillable, token_usage=usage, pending_tokens=pending,
                num_decodes=decodes, has_partial=partial)


def coalesce(n=2, **kw):
    kw.setdefault("max_num_batched_tokens", 1000)
    return ranks(n, "coalesce", **kw)


def test_coalesce_holds_while_the_batch_is_filling_and_fires_on_fill():
    delayers = coalesce()
    assert decide(delayers, [C(pending=300), C(pending=300)]) == [False, False]
    assert outcome(delayers[0]) == ("coalesce", "delay", "coalescing")
    assert decide(delayers, [C(pending=1000), C(pending=800)]) == [True, True]  # 1800 >= 0.9 * 2000
    assert delayers[0].outcomes[("coalesce", "allow", "fill")] == 1


@pytest.mark.parametrize("a, b, reason", [
    (C(prefillable=False), C(prefillable=False), "none"),
    (C(decodes=0), C(prefillable=False, decodes=0), "idle"),
    (C(usage=0.95), C(), "kv"),
    (C(usage=0.05), C(), "kv"),
])
def test_coalesce_fires_at_once(a, b, reason):
    delayers = coalesce()
    assert decide(delayers, [a, b]) == [True, True]
    assert outcome(delayers[1]) == ("coalesce", "allow", reason)


def held_then(delayers, inputs, max_ticks=500):
    """Ticks until the first allow; returns (ticks held, reason)."""
    for held in range(max_ticks):
        if decide(delayers, inputs)[0]:
            (reason,) = [k[2] for k, v in delayers[0].outcomes.items() if k[1] == "allow" and v]
            return held, reason
    raise AssertionError("never allowed")


def test_coalesce_ttft_bounds_every_hold():
    delayers = coalesce(ttft_max_ticks=7, stall_ticks=10**6, queue_max_ticks=10**6)
    growing = iter(range(1, 10**6))
    for _ in range(7):
        p = next(growing)
        assert decide(delayers, [C(pending=p), C(pending=p)]) == [False, False]
    p = next(growing)
    assert decide(delayers, [C(pending=p), C(pending=p)]) == [True, True]
    assert delayers[0].outcomes[("coalesce", "allow", "ttft")] == 1


def test_coalesce_partial_prefill_is_held_at_most_partial_max_ticks():
    delayers = coalesce(partial_max_ticks=4, stall_ticks=10**6, queue_max_ticks=10**6)
    assert held_then(delayers, [C(partial=True), C(prefillable=False)]) == (4, "partial")


def test_coalesce_stall_fires_when_pending_tokens_stop_growing():
    delayers = coalesce(stall_ticks=3, queue_max_ticks=10**6)
    # ticks 1, 2, 3 add nothing to tick 0's pending tokens: the third such tick fires
    assert held_then(delayers, [C(pending=50), C(pending=50)]) == (3, "stall")


def test_coalesce_queue_age_fires_for_a_long_prefillable_queue():
    delayers = coalesce(queue_max_ticks=5, stall_ticks=10**6)
    assert held_then(delayers, [C(pending=10), C(prefillable=False)]) == (4, "queue")


class Failing(Collective):
    world_size = 2

    def all_reduce_sum(self, vec):
        raise RuntimeError("gloo: connection reset")


@pytest.mark.parametrize("policy", ["align", "coalesce"])
def test_a_failed_collective_fails_open_and_is_counted(policy):
    d = make_delayer(Failing(), policy)
    assert d.should_allow_prefill(local_prefillable=True, token_usage=0.5) is True
    assert d.num_collective_errors == 1 and outcome(d) == (policy, "allow", "collective_error")


def test_a_missing_rank_times_out_and_fails_open():
    group = InProcessGroup(2, timeout_s=0.05)
    d = make_delayer(group.rank(0))
    assert d.should_allow_prefill(local_prefillable=True, token_usage=0.5) is True
    assert d.num_collective_errors == 1


class Counting(Collective):
    world_size = 1

    def __init__(self):
        self.calls = 0

    def all_reduce_sum(self, vec):
        self.calls += 1
        return np.asarray(vec, dtype=np.int64)


def test_the_scheduler_calls_the_delayer_once_per_tick_even_when_idle():
    coll = Counting()
    delayer = make_delayer(coll)
    sched = Scheduler(scheduler_config(num_kvcache_blocks=16, block_size=4), prefill_delayer=delayer)
    assert sched.schedule() is None and coll.calls == 1
    model = FakeModel(FakeKV(16, 4))
    sched.add(Sequence([3, 4, 5], SamplingParams(max_tokens=3)))
    ticks = 1
    while not sched.is_finished():
        step(sched, model)
        ticks += 1
    assert coll.calls == ticks
    assert sum(delayer.outcomes.values()) == ticks


def test_a_veto_holds_new_and_chunked_prefills_but_decodes_go_on():
    class Veto:
        calls = []

        def should_allow_prefill(self, **kw):
            self.calls.append(kw)
            return False

        def aligned_share(self):
            return 0

    cfg = scheduler_config(num_kvcache_blocks=32, block_size=4, max_num_batched_tokens=8)
    sched = Scheduler(cfg)
    model = FakeModel(FakeKV(32, 4))
    decoding = Sequence([3, 4, 5], SamplingParams(max_tokens=20))
    chunked = Sequence(list(range(2, 22)), SamplingParams(max_tokens=2))
    sched.add(decoding)
    step(sched, model)
    sched.add(chunked)
    step(sched, model)  # first chunk of the long prompt
    sched.prefill_delayer = Veto()
    sched.add(Sequence([7, 8]))
    batch, _ = step(sched, model)
    assert not batch.is_prefill and batch.seqs == [decoding]
    kw = Veto.calls[-1]
    assert kw["local_prefillable"] and kw["has_partial"] and kw["num_decodes"] == 1
    assert kw["pending_tokens"] == 8  # capped at the budget


def test_two_simulated_dp_ranks_prefill_in_the_same_ticks():
    group = InProcessGroup(2, timeout_s=5.0)
    scheds, models = [], []
    for r in range(2):
        d = make_delayer(group.rank(r), "align", max_delay_passes=1000)
        scheds.append(Scheduler(scheduler_config(num_kvcache_blocks=64, block_size=4), prefill_delayer=d))
        models.append(FakeModel(FakeKV(64, 4)))
    kinds = [[], []]
    arrivals = {0: {0: [3, 4, 5]}, 1: {3: [6, 7, 8, 9]}}  # rank -> tick -> prompt

    def run(r):
        for tick in range(12):
            if tick in arrivals[r]:
                scheds[r].add(Sequence(arrivals[r][tick], SamplingParams(max_tokens=30)))
            batch, _ = step(scheds[r], models[r])
            kinds[r].append(None if batch is None else batch.is_prefill)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(20) for t in threads]
    prefill_ticks = [[t for t, k in enumerate(ks) if k] for ks in kinds]
    # rank 0's request waits (mixed) until rank 1 has one too; then both prefill together
    assert prefill_ticks == [[3], [3]]
    assert kinds[0][:3] == [None, None, None]


def test_single_rank_collective_and_bad_policy():
    assert SingleRank().all_reduce_sum(np.array([1, 2])).tolist() == [1, 2]
    with pytest.raises(ValueError, match="policy"):
        make_delayer(SingleRank(), "greedy")


@pytest.mark.parametrize("mixed", [False, True], ids=["seed_steps", "mixed_steps"])
def test_an_aligned_tick_splits_its_budget_and_its_leftover_goes_on_while_held(mixed):
    """Two ranks, align with aligned_tokens 16 (8 a rank in a tick both prefill): rank 0's held
    prompt goes out with rank 1's in 8-token chunks; a leftover neither holds nor releases anybody,
    and a new prompt on the other rank aligns with it; rank 0's leftover goes on while the delayer
    holds its newly queued prompt (not admitted then); that prompt goes lone at max delay, at the
    share, and its leftover goes on unheld."""
    group = InProcessGroup(2, timeout_s=5.0)
    scheds, models = [], []
    for r in range(2):
        d = make_delayer(group.rank(r), "align", max_delay_passes=3, aligned_tokens=16)
        cfg = scheduler_config(num_kvcache_blocks=64, block_size=4, enable_mixed_chunk=mixed)
        scheds.append(Scheduler(cfg, prefill_delayer=d))
        models.append(FakeModel(FakeKV(64, 4)))
    seqs = {"a": Sequence(list(range(2, 54)), SamplingParams(max_tokens=6)),
            "b": Sequence(list(range(60, 72)), SamplingParams(max_tokens=6)),
            "c": Sequence(list(range(80, 90)), SamplingParams(max_tokens=12)),
            "d": Sequence(list(range(90, 100)), SamplingParams(max_tokens=12))}
    arrivals = {0: {0: ["a"], 7: ["b"]}, 1: {2: ["c"], 4: ["d"]}}  # rank -> tick -> sequences
    chunks = [[], []]  # per rank, per tick: {sequence: prompt tokens} of its forward
    got = {}

    def run(r):
        for tick in range(40):
            for name in arrivals[r].get(tick, []):
                scheds[r].add(seqs[name])
            batch, updates = step(scheds[r], models[r])
            prompt_rows = {} if batch is None else {
                name: n for name, s in seqs.items() for row, n, start in
                zip(batch.seqs, batch.num_scheduled_tokens, batch.num_computed_tokens)
                if row is s and start < s.num_prompt_tokens}
            chunks[r].append(prompt_rows)
            for u in updates:
                got.setdefault(u.seq.id, []).extend(u.new_token_ids)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(20) for t in threads]
    prefills = [[(t, c) for t, c in enumerate(ticks) if c] for ticks in chunks]
    # tick 2: aligned, 8 each; 3: both leftovers, nothing to align ("none"), 8 each again; 4: d
    # aligns with a's leftover ("all"); 5: leftovers ("none"); 6: a's leftover alone ("none", not a
    # hold); 7-9: held (b queued, rank 1 decodes): a goes on, b is not admitted beside it (tick 8
    # leaves room); 10: max delay, b alone at an aligned tick's share (16 // 2); 11: b's leftover goes
    # on ("none", not held again as a chunked prefill would be)
    assert prefills[0] == [(2, {"a": 8}), (3, {"a": 8}), (4, {"a": 8}), (5, {"a": 8}), (6, {"a": 8}), (7, {"a": 8}),
                           (8, {"a": 4}), (10, {"b": 8}), (11, {"b": 4})]
    assert prefills[1] == [(2, {"c": 8}), (3, {"c": 2}), (4, {"d": 8}), (5, {"d": 2})]
    d0 = scheds[0].prefill_delayer
    assert d0.outcomes[("align", "allow", "all")] == 2 and d0.outcomes[("align", "allow", "max_delay")] == 1
    assert d0.outcomes[("align", "delay", "mixed")] == 2 + 3  # ticks 0-1 (a alone), 7-9 (b alone)
    for s in seqs.values():
        assert got[s.id] == reference_completion(s.token_ids[:s.num_prompt_tokens], s.sampling_params.max_tokens)
