"""A decode engine prefilling a prompt locally protects its running streams
(`max_local_prefill_tokens_per_step`, docs/design.md "Adaptive disaggregation"): between two
tokens of a running stream, the prefill steps in between carry at most the cap's worth of
prompt tokens. Measured in tokens per step with the fake model; the time cap
(`max_local_prefill_ms_per_step`) with a fake clock that charges a fixed cost per token."""
from __future__ import annotations

import pytest

from scheduler.scheduler import Scheduler
from contracts.sampling import SamplingParams
from scheduler.sequence import Sequence
from tests.fake_connector import FakeKV, FakeModel, prompt, reference_completion, scheduler_config, step

pytestmark = pytest.mark.unit

CAP = 16
LONG = 300


def drive(cap: int, ms_cap: float = 0.0, ms_per_token: float = 0.0):
    """3 streams decoding, then a LONG-token prompt arrives. Returns, per running stream, the
    prompt tokens prefilled between each two of its tokens after the long prompt arrived,
    the emitted tokens, and the sequences. `ms_per_token` > 0: every prefill step is reported
    to the scheduler as taking that many ms per token (the engine's measurement, faked)."""
    cfg = scheduler_config(num_kvcache_blocks=256, block_size=4, max_num_batched_tokens=512, max_num_seqs=8,
                           max_model_len=1024, max_local_prefill_tokens_per_step=cap,
                           max_local_prefill_ms_per_step=ms_cap)
    sched = Scheduler(cfg)
    model = FakeModel(FakeKV(256, 4), 0)
    streams = [Sequence(prompt(i, 9), SamplingParams(max_tokens=60, ignore_eos=True)) for i in range(3)]
    for s in streams:
        sched.add(s)
    emitted: dict[int, list[int]] = {}

    def one():
        batch, updates = step(sched, model)
        if ms_per_token and batch is not None and batch.is_prefill:
            sched.observe_prefill_step(batch.num_tokens, batch.num_tokens * ms_per_token / 1e3)
        for u in updates:
            emitted.setdefault(u.seq.id, []).extend(u.new_token_ids)
        return batch, updates

    for _ in range(3):  # streams admitted and decoding
        one()
    long = Sequence(prompt(7, LONG), SamplingParams(max_tokens=5, ignore_eos=True))
    sched.add(long)
    gaps = {s.id: [] for s in streams}
    pending = {s.id: 0 for s in streams}
    for _ in range(1000):
        if sched.is_finished():
            break
        batch, updates = one()
        prefilled = sum(int(n) for n in batch.num_scheduled_tokens) if batch is not None and batch.is_prefill else 0
        for sid in pending:
            pending[sid] += prefilled
        for u in updates:
            if u.seq.id in pending and u.new_token_ids:
                gaps[u.seq.id].append(pending[u.seq.id])
                pending[u.seq.id] = 0
    assert sched.is_finished()
    return gaps, emitted, streams, long


def test_a_local_prefill_never_stalls_running_streams_for_more_than_the_cap():
    gaps, emitted, streams, long = drive(CAP)
    for s in streams:
        assert gaps[s.id], "the stream produced tokens while the long prompt prefilled"
        assert max(gaps[s.id]) <= CAP, gaps[s.id]
        assert emitted[s.id] == reference_completion(s.prompt_token_ids, 60)
    assert emitted[long.id] == reference_completion(long.prompt_token_ids, 5)
    assert sum(1 for s in streams for g in gaps[s.id] if g > 0) > 0  # the long prompt ran alongside


def test_without_the_cap_a_local_prefill_stalls_running_streams_for_the_whole_prompt():
    gaps, emitted, streams, long = drive(0)
    assert max(max(gaps[s.id]) for s in streams) >= LONG - 4  # (the control: the test can see a stall)
    assert emitted[long.id] == reference_completion(long.prompt_token_ids, 5)


def test_the_cap_does_not_hold_back_a_prefill_when_nothing_decodes():
    cfg = scheduler_config(num_kvcache_blocks=256, block_size=4, max_num_batched_tokens=512,
                           max_local_prefill_tokens_per_step=CAP)
    sched = Scheduler(cfg)
    sched.add(Sequence(prompt(1, LONG), SamplingParams(max_tokens=2)))
    batch = sched.schedule()
    assert batch.is_prefill and batch.num_scheduled_tokens.tolist() == [LONG]


@pytest.mark.parametrize("ms_per_token, expected_cap", [(1.0, 20), (0.25, 80), (5.0, 4)])
def test_the_time_cap_carries_what_fits_in_its_milliseconds_at_the_measured_cost(ms_per_token, expected_cap):
    """20 ms a step: 20 tokens at 1 ms a token, 80 at 0.25 ms; never under one block (4)."""
    gaps, emitted, streams, long = drive(0, ms_cap=20.0, ms_per_token=ms_per_token)
    worst = max(max(gaps[s.id]) for s in streams)
    assert worst <= expected_cap, worst
    assert worst * ms_per_token <= max(20.0, 4 * ms_per_token)  # the stall in (fake) time
    assert worst >= expected_cap - 4  # the cap is used, not undershot by more than a block
    for s in streams:
        assert emitted[s.id] == reference_completion(s.prompt_token_ids, 60)
    assert emitted[long.id] == reference_completion(long.prompt_token_ids, 5)


def test_the_time_cap_takes_four_blocks_until_a_prefill_step_is_measured_and_the_smaller_cap_wins():
    cfg = scheduler_config(num_kvcache_blocks=256, block_size=4, max_local_prefill_ms_per_step=50.0)
    sched = Scheduler(cfg)
    assert sched.local_prefill_cap() == 16
    sched.observe_prefill_step(8, 1.0)  # under four blocks: a fixed cost, not counted
    assert sched.prefill_s_per_token is None
    sched.observe_prefill_step(100, 0.1)  # 1 ms a token: 50 ms = 50 tokens, 48 in whole blocks
    assert sched.local_prefill_cap() == 48
    both = Scheduler(scheduler_config(num_kvcache_blocks=256, block_size=4, max_local_prefill_ms_per_step=50.0,
                                      max_local_prefill_tokens_per_step=12))
    both.observe_prefill_step(100, 0.1)
    assert both.local_prefill_cap() == 12
