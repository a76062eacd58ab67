"""Simulated engines (atomd/sim/): hardware profiles against the vendors' public numbers and
the models' published sizes, the fit against numpy on known data, profile files and flags,
and SimulatedEngine in-process: deterministic tokens, blocks in = blocks out under
preemption and aborts, the KV pool counted from the profile, no torch, the link's queue.

The PD, adaptive and KV-event behaviour of simulated engines over HTTP is in the e2e files,
parametrized over the model runner (tests/test_pd_e2e.py, tests/test_pd_adaptive_e2e.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import numpy as np
import pytest

from atomd.config import EngineConfig
from atomd.sim.hardware import (ACCELERATORS, LINKS, MODELS, Link, StepShape, fit_linear, load_profile,
                                roofline_seconds)
from kv_transfer.connector import KVConnectorOutput
from contracts.sampling import SamplingParams, StructuredOutputsParams
from tests.server_fixtures import REPO
from tests.sim_fixtures import default_model_profile

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------- profiles


def test_model_shapes_match_the_published_parameter_counts():
    llama = MODELS["llama3-8b"]
    assert llama.total_params == pytest.approx(8.03e9, rel=0.005)  # Meta: 8.03B
    assert llama.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2  # 128 KiB a token in bf16
    qwen = MODELS["qwen3-30b-a3b"]
    assert qwen.total_params == pytest.approx(30.5e9, rel=0.01)  # Qwen: 30.5B total
    embedding = qwen.vocab_size * qwen.hidden_size  # Qwen's 3.3B activated counts the input embeddings
    assert qwen.active_params + embedding == pytest.approx(3.3e9, rel=0.02)


def test_a_derived_decode_step_is_memory_bound_on_the_public_bandwidth():
    """Batch 1 on an H100: every weight but the input embeddings, and the KV, over 80% of
    3.35 TB/s, plus the 1 ms step overhead."""
    p = load_profile("h100:llama3-8b")
    m = MODELS["llama3-8b"]
    weights = (m.total_params - m.vocab_size * m.hidden_size) * 2
    context = 1000
    want = 1e-3 + (weights + (context + 1) * m.kv_bytes_per_token) / (3.35e12 * 0.8)
    assert p.step_seconds(StepShape(False, 1, 1, context + 1, context)) == pytest.approx(want, rel=1e-6)
    h200 = load_profile("h200:llama3-8b").step_seconds(StepShape(False, 1, 1, context + 1, context))
    assert h200 == pytest.approx(1e-3 + (want - 1e-3) * 3.35 / 4.8, rel=1e-6)  # same bytes, faster HBM


def test_a_derived_long_prefill_is_compute_bound_on_the_public_flops():
    m = MODELS["llama3-8b"]
    n = 8192
    shape = StepShape.of(True, [n], [0])
    assert shape.attention == n * (n + 1) / 2
    linear = 2 * (m.total_params - 2 * m.vocab_size * m.hidden_size) * n + 2 * m.vocab_size * m.hidden_size
    attention = 4 * m.num_layers * m.num_heads * m.head_dim * n * (n + 1) / 2
    want = 1e-3 + (linear + attention) / (989e12 * 0.6)
    assert load_profile("h100:llama3-8b").step_seconds(shape) == pytest.approx(want, rel=1e-6)
    mi300x = ACCELERATORS["mi300x"]
    assert load_profile("mi300x:llama3-8b").step_seconds(shape) == pytest.approx(
        1e-3 + (linear + attention) / (1307e12 * mi300x.compute_efficiency), rel=1e-6)


def test_moe_decode_reads_the_experts_its_tokens_route_to():
    """One token reads 8 of 128 experts a layer; a batch of 512 nearly all of them."""
    qwen = MODELS["qwen3-30b-a3b"]
    acc = ACCELERATORS["h100"]
    one = roofline_seconds(acc, qwen, StepShape(False, 1, 1, 1, 1))
    dense_part = qwen.num_layers * qwen.dense_layer_params + qwen.lm_head_params
    bw = acc.memory_bandwidth * acc.memory_efficiency
    expect_one = (dense_part + qwen.num_layers * 8 * qwen.expert_params) * 2
    assert one == pytest.approx(1e-3 + (expect_one + 2 * qwen.kv_bytes_per_token) / bw, rel=1e-6)
    many = roofline_seconds(acc, qwen, StepShape(False, 512, 512, 512, 512))
    all_experts = (dense_part + qwen.num_layers * 128 * qwen.expert_params) * 2
    assert many >= 1e-3 + 0.98 * all_experts / bw


def test_the_kv_pool_of_a_derived_profile_is_what_the_memory_holds_after_the_weights(monkeypatch):
    p = load_profile("h100:llama3-8b")
    assert p.kv_cache_bytes == int(80e9 * 0.9) - MODELS["llama3-8b"].total_params * 2
    small = msgspec.structs.replace(ACCELERATORS["h100"], name="small", memory_bytes=10 * 10**9)
    monkeypatch.setitem(ACCELERATORS, "small", small)
    with pytest.raises(ValueError, match="do not fit"):  # 16 GB of weights in 9 GB
        load_profile("small:llama3-8b")


def test_the_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    steps = [StepShape.of(True, list(rng.integers(1, 512, b)), list(rng.integers(0, 256, b)))
             for b in rng.integers(1, 6, 40)]
    truth = (3e-3, 40e-6, 150e-9)
    seconds = [truth[0] + truth[1] * s.tokens + truth[2] * s.attention for s in steps]
    fit = fit_linear(steps, seconds)
    np.testing.assert_allclose([fit.base_s, fit.per_token_s, fit.per_attention_s], truth, rtol=1e-6)
    # a term that only hurts (decode times that fall with context) is dropped, never negative
    decode = [StepShape(False, b, b, 0, c) for b, c in ((1, 100), (4, 400), (8, 50), (16, 3000), (2, 10))]
    fit = fit_linear(decode, [1e-3 + 1e-4 * s.tokens - 1e-8 * s.context for s in decode])
    assert min(fit.base_s, fit.per_token_s, fit.per_attention_s) >= 0 and fit.per_attention_s == 0


def test_profile_files_round_trip_and_bad_ones_are_clear_errors(tmp_path):
    path = default_model_profile(tmp_path / "p.json")
    p = load_profile(str(path))
    assert p.model.num_layers == 4 and p.link == LINKS["loopback"] and p.kv_cache_bytes is None
    assert load_profile(str(path)).with_link("nvlink").link == LINKS["nvlink"]
    raw = json.loads(path.read_text())
    for bad, match in ((dict(raw, link=dict(raw["link"], bandwidth=0)), "bandwidth"),
                       (dict(raw, step={"type": "guessed"}), "not a profile"),
                       ({"name": "x"}, "not a profile")):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            load_profile(str(tmp_path / "bad.json"))
    (tmp_path / "big.json").write_bytes(b" " * (2 << 20))
    with pytest.raises(ValueError, match="larger than"):
        load_profile(str(tmp_path / "big.json"))
    for spec, match in (("h100", "ACCELERATOR:MODEL"), ("tpu:llama3-8b", "unknown accelerator"),
                        ("h100:gpt-5", "unknown model shape")):
        with pytest.raises(ValueError, match=match):
            load_profile(spec)


def test_engine_flags_are_checked(tmp_path):
    with pytest.raises(ValueError, match="needs hardware"):
        EngineConfig(model_runner="simulated")
    with pytest.raises(ValueError, match="only with model_runner simulated"):
        EngineConfig(hardware="h100:llama3-8b")
    with pytest.raises(ValueError, match="kv_link"):
        EngineConfig(model_runner="simulated", hardware="h100:llama3-8b", kv_link="carrier-pigeon")
    with pytest.raises(ValueError, match="speculative_config is not simulated"):
        EngineConfig(model_runner="simulated", hardware="h100:llama3-8b",
                     speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    with pytest.raises(ValueError, match="model_runner must be one of"):
        EngineConfig(model_runner="dreamed")


# ---------------------------------------------------------------- the engine, in-process


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    return default_model_profile(tmp_path_factory.mktemp("sim") / "profile.json")


def make_engine(profile, **kw):
    from atomd.sim.engine import SimulatedEngine

    return SimulatedEngine(EngineConfig(model_runner="simulated", hardware=str(profile), max_model_len=256, **kw))


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, dict[int, list]]:
    """Every request to the end: {request id: {choice index: [(token, logprob entry)]}}."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    out: dict[str, dict[int, list]] = {rid: {} for rid in requests}
    while engine.has_unfinished_requests():
        for o in engine.step():
            entries = o.new_logprobs or [None] * len(o.new_token_ids)
            out[o.request_id].setdefault(o.index, []).extend(zip(o.new_token_ids, entries))
    return out


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 4096, n).tolist()


def test_tokens_are_a_function_of_the_request_and_its_seed(profile):
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    reqs = {"a": (prompt(1, 40), params), "b": (prompt(2, 7), params),
            "seeded": (prompt(1, 40), SamplingParams(max_tokens=12, ignore_eos=True, seed=7)),
            "choices": (prompt(3, 20), SamplingParams(max_tokens=6, ignore_eos=True, n=3, seed=1))}
    first, second = run(make_engine(profile), reqs), run(make_engine(profile, seed=0, max_num_seqs=3), reqs)
    assert first == second  # another engine, another batching: the same tokens and logprobs
    tokens = {rid: [t for t, _ in out[0]] for rid, out in first.items()}
    assert tokens["a"] != tokens["seeded"]  # same prompt, another seed
    assert len(set(tokens["a"])) > 6 and all(0 <= t < 4096 for t in tokens["a"])
    assert sorted(first["choices"]) == [0, 1, 2] and len({tuple(c) for c in first["choices"].values()}) == 3
    for token, entry in first["a"][0]:
        assert entry.top[0] == (token, entry.logprob) and len(entry.top) == 2 and entry.logprob < 0


def test_allowed_token_ids_and_min_tokens_hold(profile):
    allowed = [11, 12, 13]
    out = run(make_engine(profile), {"x": (prompt(4, 10), SamplingParams(max_tokens=20, allowed_token_ids=allowed,
                                                                         ignore_eos=True))})
    assert {t for t, _ in out["x"][0]} <= set(allowed)


def test_blocks_in_equal_blocks_out_under_preemption_and_aborts(profile):
    engine = make_engine(profile, num_kvcache_blocks=24, max_num_seqs=8)
    bm = engine.scheduler.block_manager
    total = bm.num_total_blocks
    rng = np.random.default_rng(5)
    ids = []
    for i in range(24):
        rid = f"r{i}"
        engine.add_request(rid, prompt(100 + i, int(rng.integers(5, 90))),
                           SamplingParams(max_tokens=int(rng.integers(5, 60)), ignore_eos=True, n=1 + i % 3))
        ids.append(rid)
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps in (5, 17, 40):  # abort one running and one waiting request
            for rid in ids[steps % 7::11][:2]:
                engine.abort_request(rid)
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o.finish_reason
    assert set(finished) == set(ids)
    assert engine.scheduler.num_preemptions > 0  # the pool was too small for the load
    assert bm.num_free_blocks == total and engine.stats()["num_running"] == 0


def test_the_kv_pool_is_counted_from_the_profile_not_allocated():
    from atomd.sim.engine import SimulatedEngine

    engine = SimulatedEngine(EngineConfig(model_runner="simulated", hardware="h100:llama3-8b", max_model_len=8192,
                                          max_num_seqs=512))
    block = 16 * MODELS["llama3-8b"].kv_bytes_per_token
    want = min((int(80e9 * 0.9) - MODELS["llama3-8b"].total_params * 2) // block, 512 * 8192 // 16)
    assert engine.scheduler.block_manager.num_total_blocks == want
    assert want * block > 50e9  # 56 GB of KV on a 24 GiB machine: counted, never allocated


def test_requests_the_simulator_cannot_follow_are_refused(profile):
    engine = make_engine(profile)
    with pytest.raises(ValueError, match="structured_outputs"):
        engine.add_request("g", prompt(1, 5), SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+")))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.add_request("p", prompt(1, 5), SamplingParams(prompt_logprobs=1))
    assert not engine.has_unfinished_requests()


def test_the_simulated_engine_never_imports_torch(profile):
    code = f"""
import sys
from atomd.config import EngineConfig
from atomd.engine.core import engine_class_of
from contracts.sampling import SamplingParams
config = EngineConfig(model_runner="simulated", hardware={str(profile)!r}, kv_role="producer")
engine = engine_class_of(config)(config)
engine.add_request("x", list(range(10, 50)), SamplingParams(max_tokens=3))
while engine.has_unfinished_requests() and not engine.only_serving_kv():
    engine.step()
engine.close()
assert "torch" not in sys.modules, "torch was imported"
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


# ---------------------------------------------------------------- the link


class FakeConsumer:
    """The real connector's surface SimulatedLink wraps: loads in, landed pulls out."""

    is_producer = False

    def __init__(self):
        self.landed: list[int] = []
        self.failed: list[int] = []

    def start_load_kv(self, meta):
        pass

    def get_finished(self):
        out = KVConnectorOutput(finished_recving=self.landed, failed_recving=self.failed)
        self.landed, self.failed = [], []
        return out

    def stats(self):
        return {"bytes": 7}


class Load(msgspec.Struct):
    seq_id: int
    local_block_ids: list[int]


class Meta(msgspec.Struct):
    loads: list[Load]


def test_landed_pulls_wait_for_the_link_and_queue_on_it(monkeypatch):
    from atomd.sim import engine as sim_engine

    clock = [100.0]
    monkeypatch.setattr(sim_engine.time, "monotonic", lambda: clock[0])
    inner = FakeConsumer()
    link = sim_engine.SimulatedLink(inner, Link(name="slow", bandwidth=1000.0, latency_s=0.5), block_bytes=100)
    link.start_load_kv(Meta([Load(1, [0, 1, 2, 3, 4]), Load(2, [5, 6, 7, 8, 9]), Load(3, [10])]))
    inner.landed, inner.failed = [1, 2], [3]  # the real pulls landed at once; 3 failed
    out = link.get_finished()
    assert out.finished_recving == [] and out.failed_recving == [3]  # failures are not held
    clock[0] = 100.0 + 0.5 + 0.5 - 1e-9  # 500 bytes at 1000 B/s + 0.5 s latency
    assert link.get_finished().finished_recving == []
    clock[0] = 101.0
    assert link.get_finished().finished_recving == [1]
    clock[0] = 101.5  # the second pull queued behind the first on the link
    assert link.get_finished().finished_recving == [2]
    assert link.stats()["bytes"] == 700 and link.is_producer is False


def test_the_offline_llm_runs_the_simulated_engine_too(profile):
    from atomd import LLM
    from atomd.sim.engine import SimulatedEngine

    llm = LLM(model_runner="simulated", hardware=str(profile), max_model_len=256)
    assert isinstance(llm.engine, SimulatedEngine)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": prompt(9, 30)}], params)[0].outputs[0].token_ids
    want = [t for t, _ in run(make_engine(profile), {"r": (prompt(9, 30), params)})["r"][0]]
    assert got == want


# ---------------------------------------------------------------- served profiles


def test_an_engine_keeps_its_step_samples_only_when_asked(profile, monkeypatch):
    from atomd.engine.engine_loop import STEP_SAMPLES_ENV

    assert "step_samples" not in make_engine(profile).stats()
    monkeypatch.setenv(STEP_SAMPLES_ENV, "100")
    engine = make_engine(profile)
    run(engine, {"a": (prompt(1, 20), SamplingParams(max_tokens=4, ignore_eos=True))})
    samples = engine.stats()["step_samples"]
    # [is_prefill, tokens, seqs, attention pairs, context, forward s, gap s]: the prefill after
    # an idle engine, then three decode rows reading 20, 21, 22 tokens of KV plus their own
    assert [s[:5] for s in samples] == [[True, 20, 1, 20 * 21 / 2, 20]] + \
        [[False, 1, 1, c + 1, c + 1] for c in (20, 21, 22)]
    assert samples[0][6] == -1 and all(s[6] >= 0 for s in samples[1:]) and all(s[5] > 0 for s in samples)
    # the loop's work before each: the request added, then the last forward's one output each
    assert [s[7:10] for s in samples] == [[0, 0, 1], [1, 0, 0], [1, 0, 0], [1, 0, 0]]
    # each forward's start on the host's monotonic clock: after the previous forward and its gap
    assert all(b[10] == pytest.approx(a[10] + a[5] + b[6]) for a, b in zip(samples, samples[1:]))
    # "a" done, the engine is idle (its core waits for input without stepping): the next
    # request's prefill follows a wait, not a busy gap
    run(engine, {"b": (prompt(2, 20), SamplingParams(max_tokens=2, ignore_eos=True))})
    assert [s[6] >= 0 for s in engine.stats()["step_samples"][4:]] == [False, True]
    # a step without a forward in between (the loop waited: for input, a pull): no busy gap
    engine = make_engine(profile)
    schedule = engine.scheduler.schedule
    calls = []
    engine.scheduler.schedule = lambda: None if len(calls.append(0) or calls) == 3 else schedule()
    run(engine, {"a": (prompt(1, 20), SamplingParams(max_tokens=4, ignore_eos=True))})
    assert [s[6] >= 0 for s in engine.stats()["step_samples"]] == [False, True, False, True]
    monkeypatch.setenv(STEP_SAMPLES_ENV, "2")  # a ring of the last N
    engine = make_engine(profile)
    run(engine, {"a": (prompt(1, 20), SamplingParams(max_tokens=6, ignore_eos=True))})
    assert [s[4] for s in engine.stats()["step_samples"]] == [24, 25]
    monkeypatch.setenv(STEP_SAMPLES_ENV, "many")
    with pytest.raises(ValueError, match=STEP_SAMPLES_ENV):
        make_engine(profile)


def test_a_served_fit_recovers_the_mean_step_and_its_spread():
    """Steps of a known model plus a known delay (exponential, mean 4 ms, like a shared
    machine's time slices): the mean fit finds the model with the delay's mean in its base,
    the spread the delay's quantiles less that mean."""
    from atomd.sim.profile import SPREAD_QUANTILES, fit_served

    rng = np.random.default_rng(0)
    steps = [StepShape(False, int(b), int(b), 0.0, int(c))
             for b, c in zip(rng.integers(1, 32, 20000), rng.integers(64, 8192, 20000))]
    truth = (2e-3, 100e-6, 500e-9)
    delay = rng.exponential(4e-3, len(steps))
    samples = [(s, truth[0] + truth[1] * s.tokens + truth[2] * s.context + d) for s, d in zip(steps, delay)]
    fit, spread, by_seqs = fit_served(samples, "decode")
    assert by_seqs == {}  # linear in the batch: no batch size's mean residual stands out of the noise
    np.testing.assert_allclose([fit.base_s, fit.per_token_s, fit.per_attention_s],
                               [truth[0] + 4e-3, truth[1], truth[2]], rtol=0.05)
    q = (np.arange(SPREAD_QUANTILES) + 0.5) / SPREAD_QUANTILES
    want = -4e-3 * np.log1p(-q)  # the exponential's quantiles
    np.testing.assert_allclose(spread, want - want.mean(), atol=1e-3)
    assert abs(np.mean(spread)) < 1e-6
    # in served order: the last MAX_SPREAD residuals themselves (the delays less their mean)
    from atomd.sim.hardware import MAX_SPREAD

    _, ordered, _ = fit_served(samples, "decode", in_order=True)
    assert len(ordered) == MAX_SPREAD and abs(np.mean(ordered)) < 1e-6
    np.testing.assert_allclose(ordered, delay[-MAX_SPREAD:] - delay[-MAX_SPREAD:].mean(), atol=2e-4)
    # a step stalled for minutes (a machine out of memory) stays within what a profile may hold
    stalled = samples[:-1] + [(samples[-1][0], 100.0)]
    assert max(abs(v) for v in fit_served(stalled, "decode", in_order=True)[1]) < 60
    with pytest.raises(ValueError, match="too few"):
        fit_served(samples[:2], "decode")


def test_a_served_fit_keeps_the_mean_of_each_batch_size_a_line_misses():
    """Served decode steps that are not linear in the batch (1P+1D on a shared machine: a batch
    of 2 is one whose new request's prefill ran beside it), most of them batches of 1: the
    profile predicts each well-sampled batch size's own mean (numpy's, per size), where the
    line alone over-predicts the batch of 1 (what set the simulated 1P+1D's TPOT 17% high); a
    size seen too rarely keeps the line; the residuals left are at mean 0 within each size."""
    from atomd.sim.hardware import Calibrated, Link, ModelShape, Profile
    from atomd.sim.profile import MIN_BY_SEQS_STEPS, fit_served

    rng = np.random.default_rng(3)
    mean_s = {1: 1.5e-3, 2: 4.9e-3, 3: 5.2e-3, 4: 6.0e-3}
    count = {1: 870, 2: 130, 3: 40, 4: MIN_BY_SEQS_STEPS - 1}
    samples = []
    for b in rng.permutation([b for b, n in count.items() for _ in range(n)]).tolist():
        samples.append((StepShape(False, b, b, 0.0, 300 * b), mean_s[b] + rng.exponential(0.5e-3) - 0.5e-3))
    fit, spread, by_seqs = fit_served(samples, "decode")
    assert {1, 2} <= set(by_seqs) and 4 not in by_seqs
    line = {b: fit.seconds(StepShape(False, b, b, 0.0, 300 * b)) for b in mean_s}
    measured = {b: np.mean([t for s, t in samples if s.seqs == b]) for b in mean_s}
    assert line[1] > 1.1 * measured[1]  # the line alone: > 10% high where most steps are
    shape = ModelShape(name="m", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                       head_dim=16, vocab_size=100, dtype_bytes=4)
    profile = Profile(name="served", model=shape, link=Link(name="l", bandwidth=1e9, latency_s=0.0),
                      step=Calibrated(prefill=fit, decode=fit, decode_spread=spread, decode_by_seqs=by_seqs))
    profile = msgspec.json.decode(profile.to_json(), type=Profile)  # through the file format
    for b in (1, 2, 3):  # a size the line already meets (within its noise) keeps the line
        got = [t for s, t in samples if s.seqs == b]
        want = measured[b] if b in by_seqs else line[b]
        assert profile.step_seconds(StepShape(False, b, b, 0.0, 300 * b)) == pytest.approx(want, rel=1e-6)
        assert abs(want - measured[b]) <= 3 * np.std(got, ddof=1) / np.sqrt(len(got))
    assert profile.step_seconds(StepShape(False, 4, 4, 0.0, 1200)) == pytest.approx(line[4], rel=1e-9)
    # the spread is what is left around each size's mean: within one time slice of 0 for the batch of 1
    _, ordered, _ = fit_served(samples, "decode", in_order=True)
    left = np.array(ordered)[np.array([s.seqs for s, _ in samples[-len(ordered):]]) == 1]
    assert abs(left.mean()) < 1e-4 and abs(np.mean(ordered)) < 1e-6


def test_a_simulated_step_is_the_fit_plus_a_draw_from_the_spread(tmp_path, monkeypatch):
    from atomd.sim.hardware import Calibrated

    base = load_profile(str(default_model_profile(tmp_path / "p.json")))
    step = Calibrated(prefill=base.step.prefill, decode=base.step.decode, prefill_spread=[0.02],
                      decode_spread=[-1.0])
    path = tmp_path / "spread.json"
    path.write_bytes(msgspec.structs.replace(base, step=step).to_json())
    engine = make_engine(path)
    run(engine, {"a": (prompt(1, 20), SamplingParams(max_tokens=3, ignore_eos=True))})
    want = base.step_seconds(StepShape.of(True, [20], [0])) + 0.02  # decode steps: max(0, fit - 1 s)
    assert engine.stats()["sim"]["forward_seconds"] == pytest.approx(want)
    # in served order: the steps walk the residuals from a seeded start, wrapping around
    slept = fake_sim_clock(monkeypatch)
    residuals = [0.001, 0.002, 0.003, 0.004]
    step = Calibrated(prefill=base.step.prefill, decode=base.step.decode, decode_spread=residuals,
                      spread_in_order=True)
    path.write_bytes(msgspec.structs.replace(base, step=step).to_json())
    engine = make_engine(path)
    run(engine, {"a": (prompt(1, 20), SamplingParams(max_tokens=7, ignore_eos=True))})
    drawn = [t - base.step_seconds(StepShape.of(False, [1], [c])) for t, c in zip(slept[1:], range(20, 26))]
    start = residuals.index(pytest.approx(drawn[0]))
    assert drawn == pytest.approx([residuals[(start + k) % 4] for k in range(6)])
    raw = json.loads(path.read_text())
    for bad in ([0.0] * 1001, [61.0]):
        raw["step"]["decode_spread"] = bad
        path.write_text(json.dumps(raw))
        with pytest.raises(ValueError, match="spread holds at most"):
            load_profile(str(path))


def fake_sim_clock(monkeypatch) -> list[float]:
    """The simulated engine's clock, advanced only by its sleeps: the list of those sleeps."""
    import atomd.sim.engine as sim_engine

    clock, slept = [1000.0], []

    class FakeTime:
        @staticmethod
        def perf_counter():
            return clock[0]

        @staticmethod
        def monotonic():
            return clock[0]

        @staticmethod
        def sleep(s):
            slept.append(s)
            clock[0] += s

    monkeypatch.setattr(sim_engine, "time", FakeTime)
    return slept


def test_atomd_profile_from_servers_fits_what_they_report(tmp_path):
    """Against a stand-in /debug/stats (the engine side is tested above): the written profile
    holds the mean fit of the prefill and decode samples; a server keeping none is an error."""
    import http.server
    import threading

    rng = np.random.default_rng(1)
    samples = []
    for _ in range(200):
        n, c, b = int(rng.integers(8, 400)), int(rng.integers(20, 900)), int(rng.integers(1, 9))
        samples.append([True, n, 1, n * (n + 1) / 2, n, 0.004 + 50e-6 * n + 20e-9 * n * (n + 1) / 2, -1])
        outputs, pulls, added = b, int(rng.integers(0, 3)), int(rng.integers(0, 4))
        samples.append([False, b, b, b * c, b * c, 0.003 + 200e-6 * b + 100e-9 * b * c,
                        0.001 + 300e-6 * outputs + 4e-3 * pulls + 150e-6 * added, outputs, pulls, added])
    # the same steps whose busy gaps stray from their model by +-0.5 ms (a shared machine's gaps)
    noisy = [x[:6] + [x[6] + (0.5e-3 if i % 4 == 1 else -0.5e-3)] + x[7:] if not x[0] else x
             for i, x in enumerate(samples)]
    # a PD pair's consumer: 40 pulls of 1 MB in 2.5 ms each on average
    pulls = {"role": "consumer", "bytes": 40 * 10**6, "seconds": {"buckets": [0.001, 0.01], "counts": [0, 40, 0],
                                                                   "sum": 40 * 2.5e-3}}
    bodies = {"/with/debug/stats": {"num_running": 0, "step_samples": samples}, "/without/debug/stats": {},
              "/noisy/debug/stats": {"num_running": 0, "step_samples": noisy},
              "/consumer/debug/stats": {"num_running": 0, "step_samples": samples, "kv_transfer": pulls}}

    class Stats(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(bodies[self.path]).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stats)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        out = tmp_path / "served.json"
        cmd = [sys.executable, "-m", "atomd", "profile", "--from-servers", url + "/with", "-o", str(out)]
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=120)
        step = load_profile(str(out)).step
        np.testing.assert_allclose([step.prefill.base_s, step.prefill.per_token_s, step.prefill.per_attention_s],
                                   [0.004, 50e-6, 20e-9], rtol=1e-6)
        np.testing.assert_allclose([step.decode.base_s, step.decode.per_token_s, step.decode.per_attention_s],
                                   [0.003, 200e-6, 100e-9], rtol=1e-6)
        assert step.decode_spread == pytest.approx([0.0] * 50, abs=1e-9)
        assert step.prefill_gap is None  # no busy gap before a prefill was served
        np.testing.assert_allclose(msgspec.structs.astuple(step.decode_gap), [0.001, 300e-6, 4e-3, 150e-6],
                                   rtol=1e-6)
        bad = subprocess.run([*cmd[:5], url + "/without", "-o", str(out)], cwd=REPO, capture_output=True,
                             text=True, timeout=120)
        assert bad.returncode == 2 and "ATOMD_STEP_SAMPLES" in bad.stderr
        # noisy gaps: the gap model stays their least-squares fit (numpy's), and each gap's deviation
        # from it rides on its step's residual (in served order); --no-gap-in-spread leaves the spread at 0
        dec = [x for x in noisy if not x[0]]
        work = np.array([[1.0, *x[7:10]] for x in dec])
        coef = np.linalg.lstsq(work, np.array([x[6] for x in dec]), rcond=None)[0]
        deviation = np.array([x[6] for x in dec]) - work @ coef
        import argparse

        from atomd.sim.profile import add_arguments, run_from_servers

        parser = argparse.ArgumentParser()
        add_arguments(parser)
        noisy_args = ["--from-servers", url + "/noisy", "--spread-in-order", "-o", str(out)]
        assert run_from_servers(parser.parse_args(noisy_args)) == 0  # in process: the CLI is run above
        step = load_profile(str(out)).step
        np.testing.assert_allclose(msgspec.structs.astuple(step.decode_gap), coef, rtol=1e-6, atol=1e-9)
        # (the line, refit on step + deviation, takes a little of it: the outputs term follows the batch)
        spread = np.array(step.decode_spread)
        assert np.corrcoef(spread, deviation)[0, 1] > 0.95
        assert np.std(spread) == pytest.approx(np.std(deviation), rel=0.15)
        assert run_from_servers(parser.parse_args([*noisy_args, "--no-gap-in-spread"])) == 0
        assert load_profile(str(out)).step.decode_spread == pytest.approx([0.0] * len(dec), abs=1e-9)
        # no consumer served: pulls keep the named link's constants; a consumer's pulls give the
        # bandwidth at that latency (1 MB in 2.5 - 1 ms); --no-served-link keeps the constants
        assert load_profile(str(out)).link == LINKS["loopback"]
        assert run_from_servers(parser.parse_args(["--from-servers", url + "/consumer", "-o", str(out)])) == 0
        link = load_profile(str(out)).link
        assert link.latency_s == LINKS["loopback"].latency_s and link.bandwidth == pytest.approx(1e6 / 1.5e-3)
        assert link.seconds(10**6) == pytest.approx(2.5e-3)
        assert run_from_servers(parser.parse_args(["--from-servers", url + "/consumer", "--no-served-link",
                                                   "-o", str(out)])) == 0
        assert load_profile(str(out)).link == LINKS["loopback"]
    finally:
        server.shutdown()
        server.server_close()


def test_a_simulated_engine_waits_out_the_served_gap_its_own_loop_does_not_take(tmp_path, monkeypatch):
    """On a fake clock the loop's own gap between forwards is 0: every forward after a busy
    one sleeps the prediction plus the whole served gap of its kind (decode here); the first
    (a prefill after idle) none of it."""
    from atomd.sim.hardware import Calibrated

    base = load_profile(str(default_model_profile(tmp_path / "p.json")))
    step = Calibrated(prefill=base.step.prefill, decode=base.step.decode, prefill_gap_s=0.5, decode_gap_s=0.02)
    path = tmp_path / "gap.json"
    path.write_bytes(msgspec.structs.replace(base, step=step).to_json())
    slept = fake_sim_clock(monkeypatch)
    engine = make_engine(path)
    run(engine, {"a": (prompt(1, 20), SamplingParams(max_tokens=3, ignore_eos=True))})
    want = [base.step_seconds(StepShape.of(True, [20], [0]))] + \
        [base.step_seconds(StepShape.of(False, [1], [c])) + 0.02 for c in (20, 21)]
    assert slept == pytest.approx(want)
    # idle once "a" is done: the next prefill waits none of the served prefill gap
    run(engine, {"b": (prompt(2, 20), SamplingParams(max_tokens=1, ignore_eos=True))})
    assert slept[3:] == pytest.approx([base.step_seconds(StepShape.of(True, [20], [0]))])


# ---------------------------------------------------------------- embeddings, nested configs


def pooled(engine, prompts: list[list[int]], pooling: str) -> list[list[float]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"e{i}", p, SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling))
    got = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                got[o.request_id] = o.embedding
    return [got[f"e{i}"] for i in range(len(prompts))]


def test_a_pooling_request_gets_a_deterministic_vector_of_the_hidden_size(profile):
    """--task embed on a simulated engine: the vector has the model's hidden size (its
    config.json's), depends on the input and the pooling only (not on batching or chunking),
    and its steps are timed as the same prompt's prefill is; no block leaks."""
    from tests.server_fixtures import model_dir

    hidden = json.loads((model_dir() / "config.json").read_text())["hidden_size"]
    prompts = [prompt(21, 40), prompt(22, 7), prompt(21, 40)]
    engine = make_engine(profile)
    last = pooled(engine, prompts, "last")
    chunked = make_engine(profile, max_num_batched_tokens=16, max_num_seqs=1)
    assert pooled(chunked, prompts, "last") == last  # other batching, a chunked prefill
    assert all(len(v) == hidden and np.isfinite(v).all() for v in last)
    assert last[0] == last[2] and last[0] != last[1]
    mean = pooled(make_engine(profile), prompts, "mean")
    assert mean[0] != last[0] and len(mean[0]) == hidden
    v = np.array(last[0])
    assert abs(v.mean()) < 0.2 and 0.8 < v.std() < 1.2  # no degenerate vector for the API to normalise
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
    timed = make_engine(profile)
    pooled(timed, [prompts[0]], "last")
    generated = make_engine(profile)
    run(generated, {"g": (prompts[0], SamplingParams(max_tokens=1, temperature=0.0))})
    assert timed.forward_steps == generated.forward_steps == 1
    assert timed.forward_seconds == generated.forward_seconds == load_profile(str(profile)).step_seconds(
        StepShape.of(True, [40], [0]))


@pytest.fixture(scope="module")
def gemma3_vl_dir(tmp_path_factory):
    """A Gemma 3 vision-language config.json written by transformers (no weights: a simulated
    engine reads the config and the tokenizer only), with the built-in model's tokenizer."""
    import shutil

    transformers = pytest.importorskip("transformers")
    from tests.server_fixtures import model_dir

    text = transformers.Gemma3TextConfig(vocab_size=5000, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=24)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=32, patch_size=8)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                       architectures=["Gemma3ForConditionalGeneration"])  # as a model's save does
    path = tmp_path_factory.mktemp("gemma3-vl-config")
    config.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir() / name, path / name)
    return path, config.text_config


def test_the_simulator_reads_a_nested_text_config_as_transformers_does(gemma3_vl_dir, profile):
    transformers = pytest.importorskip("transformers")
    from atomd.sim.engine import SimulatedEngine
    from atomd.sim.hardware import ModelShape

    path, text = gemma3_vl_dir
    hf = json.loads((path / "config.json").read_text())
    assert "num_hidden_layers" not in hf  # nested
    # google/gemma-3-4b-it's config.json gives only what differs from Gemma3TextConfig's defaults
    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "sliding_window": 1024},
           "vision_config": {"model_type": "siglip_vision_model"}}
    for config, want in ((hf, text), (hub, transformers.Gemma3Config.from_dict(hub).text_config)):
        shape = ModelShape.from_hf_config("g", config, 2)
        assert (shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                shape.intermediate_size, shape.vocab_size, shape.tie_word_embeddings) == \
            (want.num_hidden_layers, want.hidden_size, want.num_attention_heads, want.num_key_value_heads,
             want.head_dim, want.intermediate_size, want.vocab_size, want.tie_word_embeddings)
    engine = SimulatedEngine(EngineConfig(model=str(path), model_runner="simulated", hardware=str(profile),
                                          max_model_len=256))
    assert engine.vocab_size == text.vocab_size == 5000
    tokens = [t for t, _ in run(engine, {"r": (prompt(3, 12), SamplingParams(max_tokens=40, ignore_eos=True))})["r"][0]]
    assert len(tokens) == 40 and all(0 <= t < 5000 for t in tokens) and max(tokens) > 4096  # the text vocabulary


def test_the_gap_fit_recovers_known_coefficients_without_negatives():
    from atomd.sim.hardware import fit_gap

    rng = np.random.default_rng(3)
    work = [(int(o), int(p), int(a)) for o, p, a in zip(rng.integers(1, 64, 5000), rng.integers(0, 3, 5000),
                                                        rng.integers(0, 5, 5000))]
    gaps = [0.002 + 100e-6 * o + 6e-3 * p + 0.0 * a + d for (o, p, a), d in zip(work, rng.exponential(1e-3, 5000))]
    fit = fit_gap(work, gaps)
    np.testing.assert_allclose([fit.base_s, fit.per_output_s, fit.per_pull_s], [0.003, 100e-6, 6e-3], rtol=0.05)
    assert 0 <= fit.per_request_s < 5e-5  # no work of its own: near 0, never negative
    # a gap that shrinks with work is clamped: the term goes, the rest refit
    clamped = fit_gap([(o, 0, 0) for o, _, _ in work], [0.01 - 1e-5 * o for o, _, _ in work])
    assert clamped.per_output_s == 0 and clamped.base_s > 0


def test_a_simulated_engine_waits_out_its_gap_model_for_the_work_in_the_gap(tmp_path, monkeypatch):
    """With a gap model the wait before a busy forward is the model's gap for the loop's work
    since the last forward (here the outputs of the last forward's two sequences) less the
    loop's own gap (0 on a fake clock); the mean gaps are not used."""
    from atomd.sim.hardware import Calibrated, LinearGap

    base = load_profile(str(default_model_profile(tmp_path / "p.json")))
    step = Calibrated(prefill=base.step.prefill, decode=base.step.decode, prefill_gap_s=0.5, decode_gap_s=0.5,
                      prefill_gap=LinearGap(0.1, 0.0, 0.0, 0.0), decode_gap=LinearGap(0.004, 0.003, 0.0, 0.0))
    path = tmp_path / "gap-model.json"
    path.write_bytes(msgspec.structs.replace(base, step=step).to_json())
    slept = fake_sim_clock(monkeypatch)
    engine = make_engine(path)
    run(engine, {"a": (prompt(1, 20), SamplingParams(max_tokens=3, ignore_eos=True)),
                 "b": (prompt(2, 10), SamplingParams(max_tokens=2, ignore_eos=True))})
    want = [base.step_seconds(StepShape.of(True, [20, 10], [0, 0])),  # after idle: no gap
            base.step_seconds(StepShape.of(False, [1, 1], [20, 10])) + 0.004 + 2 * 0.003,
            base.step_seconds(StepShape.of(False, [1], [21])) + 0.004 + 2 * 0.003]  # b ended in the last one
    assert slept == pytest.approx(want)
    # a step without a forward (the loop waited) between the decodes: the next one waits no gap
    slept.clear()
    engine = make_engine(path)
    schedule = engine.scheduler.schedule
    calls = []
    engine.scheduler.schedule = lambda: None if len(calls.append(0) or calls) == 3 else schedule()
    run(engine, {"a": (prompt(1, 20), SamplingParams(max_tokens=3, ignore_eos=True)),
                 "b": (prompt(2, 10), SamplingParams(max_tokens=2, ignore_eos=True))})
    assert slept == pytest.approx(want[:2] + [base.step_seconds(StepShape.of(False, [1], [21]))])
    raw = json.loads(path.read_text())
    raw["step"]["decode_gap"]["per_pull_s"] = -1.0
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="gap model"):
        load_profile(str(path))


# ---------------------------------------------------------------- engines sharing a host's cores


def two_engines_steps(q: float, rng) -> list[tuple]:
    """served_samples' tuples of two engines on one host: engine 0 a 30 ms prefill every
    100 ms, engine 1 a decode step every 2 ms of 1 ms alone (+ 0.5 ms a second sequence),
    stretched by q x the seconds engine 0's prefill ran inside it (processor sharing)."""
    from atomd.sim.hardware import StepShape

    out = []
    prefills = [(t0, t0 + 0.03) for t0 in np.arange(0.0, 4.0, 0.1) + 0.013]
    for start, end in prefills:
        out.append((StepShape(True, 256, 1, 256 * 257 / 2, 256), end - start, -1.0, (0, 0, 1), 0, 1000.0 + start))
    for k in range(2000):
        start, seqs = k * 0.002, 1 + (k % 5 == 0)
        work = 0.001 + 0.0005 * (seqs - 1) + rng.normal(0, 2e-5)
        beside = sum(max(0.0, min(start + work / (1 - q), e) - max(start, s)) for s, e in prefills)
        out.append((StepShape(False, seqs, seqs, 0.0, 100 * seqs), work + q * beside, 0.0002, (seqs, 0, 0), 1,
                    1000.0 + start))
    return out


def test_a_served_fit_finds_how_much_longer_a_forward_is_beside_another_engines():
    """Two engines' samples lined up by start time: the overlap of each step with the other
    engine's forwards, the contention (0.25 s a second beside) recovered from steps alone
    and beside, and none where every step ran alone or one engine is all there is."""
    from atomd.sim.profile import fit_contention, overlaps

    samples = two_engines_steps(0.25, np.random.default_rng(0))
    overlap = overlaps(samples)
    decode = [i for i, s in enumerate(samples) if not s[0].is_prefill]
    for i, (_, seconds, _, _, engine, start) in enumerate(samples[:5] + samples[40:45]):
        i = i if i < 5 else 35 + i  # each step's overlap: the other engine's forwards inside it, by brute force
        want = sum(max(0.0, min(start + seconds, s[5] + s[1]) - max(start, s[5])) for s in samples if s[4] != engine)
        assert overlap[i] == pytest.approx(want, abs=1e-12)
    beside = [i for i in decode if overlap[i] > 0]
    assert 0.25 * len(decode) < len(beside) < 0.4 * len(decode)  # 30 ms of every 100 (and the edges)
    assert fit_contention([samples[i] for i in decode], overlap[decode]) == pytest.approx(0.25, abs=0.01)
    alone = two_engines_steps(0.0, np.random.default_rng(0))
    assert fit_contention([alone[i] for i in decode], overlaps(alone)[decode]) == pytest.approx(0.0, abs=0.01)
    one_engine = [s for s in samples if s[4] == 1]
    assert not overlaps(one_engine).any()
    no_start = [s[:5] + (None,) for s in samples]  # an engine that does not record start times
    assert not overlaps(no_start).any()


def test_simulated_engines_sharing_cores_stretch_a_forward_beside_anothers(tmp_path, monkeypatch):
    """On a fake clock, a simulated decode whose profile says 0.25 s longer a second beside
    another engine's forward: alone it sleeps the prediction; while another engine on the
    same board runs a long forward it sleeps the prediction / (1 - 0.25) (the whole step
    beside it); and a board's finished forwards inside a step count as run beside it."""
    from atomd.sim.hardware import Calibrated
    from atomd.sim.shared_cores import SHARED_CORES_ENV, SharedCores

    base = load_profile(str(default_model_profile(tmp_path / "p.json")))
    step = Calibrated(prefill=base.step.prefill, decode=base.step.decode, decode_contention=0.25)
    path = tmp_path / "contention.json"
    path.write_bytes(msgspec.structs.replace(base, step=step).to_json())
    board = tmp_path / "cores"
    monkeypatch.setenv(SHARED_CORES_ENV, str(board))
    slept = fake_sim_clock(monkeypatch)
    import atomd.sim.engine as sim_engine

    engine = make_engine(path)
    engine.cores.spin = False  # on the fake clock: sleeps, recorded (a spin is tested below)
    other = SharedCores(str(board))
    assert other.slot != engine.cores.slot
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    run(engine, {"a": (prompt(1, 20), params)})
    prefill, decode = (base.step_seconds(StepShape.of(True, [20], [0])),
                       base.step_seconds(StepShape.of(False, [1], [20])))
    assert sum(slept) == pytest.approx(prefill + decode)  # alone: the predictions
    now = sim_engine.time.perf_counter()
    other.begin(now, now + 100.0)  # another engine's long forward, running
    slept.clear()
    run(engine, {"b": (prompt(2, 20), params)})
    assert sum(slept) == pytest.approx(prefill + decode / 0.75, rel=1e-4)  # the prefill has no contention
    other.end(now, now + 100.0)
    # without the board (the old engine) the same steps sleep the predictions only
    monkeypatch.delenv(SHARED_CORES_ENV)
    slept.clear()
    run(make_engine(path), {"c": (prompt(3, 20), params)})
    assert sum(slept) == pytest.approx(prefill + decode)
    raw = json.loads(path.read_text())
    raw["step"]["decode_contention"] = 1.0  # no progress at all beside another forward: refused
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="contention"):
        load_profile(str(path))


def test_a_forward_on_shared_cores_spins_instead_of_sleeping():
    """hold_core spins on the clock until the end (the core held, as a real forward holds it),
    never sleeping but for sleep(0) every YIELD_S (the GIL to the engine's other threads);
    without spin it sleeps the rest once."""
    from atomd.sim.shared_cores import YIELD_S, hold_core

    clock, reads, yields = [0.0], [], []

    def tick():
        reads.append(clock[0])
        clock[0] += YIELD_S / 4
        return clock[0]

    def only_yield(s):
        assert s == 0, "slept"
        yields.append(clock[0])

    hold_core(10.5 * YIELD_S, tick, only_yield, spin=True)
    assert 10.5 * YIELD_S <= clock[0] < 10.5 * YIELD_S + YIELD_S / 4 + 1e-12  # to the end, no further
    assert 9 <= len(yields) <= 10  # one every YIELD_S (on this clock: every 4th or 5th read)
    assert all(YIELD_S * 0.999 <= b - a <= YIELD_S * 1.251 for a, b in zip(yields, yields[1:]))
    slept = []
    hold_core(clock[0] + 0.5, lambda: clock[0], slept.append, spin=False)
    assert slept == [pytest.approx(0.5)]
