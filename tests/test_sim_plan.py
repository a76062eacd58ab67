"""`atomd plan` and its fleet simulator (atomd/sim/fleet.py, atomd/sim/plan.py): one request's
times are the profile's step and link times added by hand; every engine's pool is whole
after a run; on profiles built so that the answer is known (prefill-bound traffic needs more
P, decode-bound more D) the planner picks it; its best layout is within 5% of an exhaustive
sweep's; the Ray config it writes loads in the Ray launcher and its Helm values are the
chart's keys."""
from __future__ import annotations

import pathlib

import msgspec
import pytest
import yaml

from atomd.sim.fleet import SLO, Fleet, Layout, Request, Workload, attainment
from atomd.sim.hardware import LINKS, Calibrated, LinearStep, ModelShape, Profile, StepShape, load_profile
from atomd.sim.plan import helm_values, plan, ray_config
from tests.server_fixtures import REPO

pytestmark = pytest.mark.unit

SHAPE = ModelShape(name="toy", num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=32,
                   intermediate_size=688, vocab_size=4096, dtype_bytes=4)


def toy_profile(prefill: LinearStep, decode: LinearStep, link: str = "rdma400") -> Profile:
    return Profile(name="toy", model=SHAPE, step=Calibrated(prefill=prefill, decode=decode), link=LINKS[link],
                   kv_cache_bytes=2 << 30)


def test_one_request_takes_the_profiles_step_and_link_times():
    p = toy_profile(LinearStep(base_s=0.01, per_token_s=1e-4, per_attention_s=0.0),
                    LinearStep(base_s=0.005, per_token_s=1e-3, per_attention_s=0.0), link="tcp")
    prompt = list(range(10, 110))  # 100 tokens: 7 blocks
    (colocated,) = Fleet(p, Layout("colocated", 0, 1)).run([Request(0.0, prompt, 5)])
    assert colocated.ttft == pytest.approx(0.01 + 100 * 1e-4)
    assert colocated.tpot == pytest.approx(0.005 + 1e-3)
    (pd,) = Fleet(p, Layout("pd", 1, 1)).run([Request(0.0, prompt, 5)])
    pull = LINKS["tcp"].latency_s + 7 * SHAPE.kv_bytes_per_token * 16 / LINKS["tcp"].bandwidth
    assert pd.ttft == pytest.approx(0.01 + 100 * 1e-4 + pull)  # T0 goes out when the pull lands
    assert pd.tpot == pytest.approx(0.005 + 1e-3)


def test_every_pool_is_whole_after_a_run_with_preemption():
    p = toy_profile(LinearStep(base_s=1e-3, per_token_s=1e-5, per_attention_s=0.0),
                    LinearStep(base_s=1e-3, per_token_s=1e-5, per_attention_s=0.0))
    p = msgspec.structs.replace(p, kv_cache_bytes=40 * SHAPE.kv_bytes_per_token * 16)  # 40 blocks
    for layout in (Layout("colocated", 0, 2), Layout("pd", 1, 2)):
        fleet = Fleet(p, layout, max_model_len=512)
        outcomes = fleet.run(Workload(input_len=120, output_len=60, num_requests=40, prefix_share=0.5)
                             .requests(rate=200.0, vocab=4096))
        assert all(o.finish_s is not None and not o.failed for o in outcomes)
        for e in (*fleet.prefill, *fleet.decode):
            bm = e.scheduler.block_manager
            assert bm.num_free_blocks == bm.num_total_blocks and not e.owners
        assert sum(e.scheduler.num_preemptions for e in fleet.decode) > 0


PREFILL_BOUND = toy_profile(LinearStep(base_s=2e-3, per_token_s=4e-4, per_attention_s=0.0),
                            LinearStep(base_s=2e-3, per_token_s=1e-5, per_attention_s=0.0))
DECODE_BOUND = toy_profile(LinearStep(base_s=1e-3, per_token_s=2e-6, per_attention_s=0.0),
                           LinearStep(base_s=20e-3, per_token_s=1e-3, per_attention_s=0.0))


@pytest.mark.parametrize("profile, workload, want", [
    (PREFILL_BOUND, Workload(input_len=256, output_len=8, num_requests=20), (3, 1)),
    (DECODE_BOUND, Workload(input_len=32, output_len=64, num_requests=20), (1, 3)),
], ids=["prefill-bound", "decode-bound"])
def test_the_planner_picks_the_split_the_traffic_needs(profile, workload, want):
    """4 accelerators: a prompt costs ~100 ms of prefill and ~1 ms of decode share, so three
    P feed one D; the other way round with a 4-sequence decode batch of 25 ms steps."""
    slo = SLO(ttft_s=1.0, tpot_s=0.2)
    seqs = [4] if profile is DECODE_BOUND else [256]
    ranked = plan(profile, workload, slo, max_gpus=4, min_gpus=4, decode_max_seqs=seqs, iterations=6)
    best = next(r.layout for r in ranked if r.layout.kind == "pd")
    assert (best.num_prefill, best.num_decode) == want


@pytest.mark.e2e  # the exhaustive sweep: ~25 s of simulation, in `make e2e` (make test's 10 minutes)
def test_the_planners_best_is_within_5_percent_of_an_exhaustive_sweep():
    profile = load_profile("h100:llama3-8b")
    slo = SLO(ttft_s=0.15, tpot_s=0.02)
    workload = Workload(input_len=512, output_len=16, num_requests=6, min_duration_s=5 * slo.ttft_s)
    kw = dict(max_gpus=4, min_gpus=4, decode_max_seqs=[64], iterations=4)  # the same best as 10 requests, 6 bisections
    planned, sweep = plan(profile, workload, slo, **kw), plan(profile, workload, slo, exhaustive=True, **kw)
    assert len(sweep) > len(planned)
    assert planned[0].per_gpu >= 0.95 * sweep[0].per_gpu
    # goodput is a rate at which the SLO holds: re-simulated there it holds
    best = sweep[0]
    scaled = msgspec.structs.replace(workload, num_requests=workload.num_requests * best.layout.num_engines)
    fleet = Fleet(profile, best.layout, max_model_len=2 * (512 + 16) + 16)
    assert attainment(fleet.run(scaled.requests(best.goodput)), slo) >= slo.attainment


def test_a_run_stopped_once_its_slo_is_out_of_reach_answers_as_the_whole_run():
    """Goodput's search stops a run when too many requests already missed (TTFT passed with
    no first token, TPOT deadline passed unfinished, or ended outside): the same held / not
    held as the whole run at every rate, and the overloaded runs stop with requests left."""
    profile = load_profile("h100:qwen3-30b-a3b")
    slo = SLO(ttft_s=0.25, tpot_s=0.025)
    workload = Workload(input_len=512, output_len=64, num_requests=60)
    stopped_early = 0
    for layout in (Layout("colocated", 0, 2), Layout("pd", 1, 1)):
        for rate in (20.0, 40.0, 60.0, 90.0, 140.0):
            whole = attainment(Fleet(profile, layout).run(workload.requests(rate)), slo)
            cut = Fleet(profile, layout).run(workload.requests(rate), stop_below=slo)
            assert (attainment(cut, slo) >= slo.attainment) == (whole >= slo.attainment), (layout, rate, whole)
            stopped_early += any(o.finish_s is None for o in cut)
            if whole >= slo.attainment:
                assert all(o.finish_s is not None for o in cut)
    assert stopped_early >= 2


def test_the_written_layout_loads_in_the_ray_launcher_and_the_helm_chart(tmp_path):
    from launch.ray_config import load_config

    layout = Layout("pd", 3, 2, decode_max_num_seqs=64)
    path = tmp_path / "ray.yaml"
    path.write_text(yaml.safe_dump(ray_config(layout, None)))
    config = load_config(str(path))
    assert (config.prefill.count, config.decode.count) == (3, 2)
    assert config.decode.extra_args == ["--max-num-seqs", "64"]
    chart = yaml.safe_load(pathlib.Path(REPO, "helm/atomd/values.yaml").read_text())
    values = helm_values(layout)
    for role in ("prefill", "decode"):
        assert set(values[role]) <= set(chart[role])
    assert values["prefill"]["replicas"] == 3 and values["decode"]["replicas"] == 2


def test_lockstep_ranks_step_together_the_slowest_ranks_time():
    """Two ranks of one lockstep group: the short prompt's prefill waits for the long one's
    (its TTFT is the long prefill's time), and a decode row waits out the other rank's
    prefill; without lockstep each engine keeps its own times."""
    p = toy_profile(LinearStep(base_s=0.01, per_token_s=1e-3, per_attention_s=0.0),
                    LinearStep(base_s=0.005, per_token_s=0.0, per_attention_s=0.0))
    long_, short = Request(0.0, list(range(10, 110)), 3), Request(0.0, list(range(10, 20)), 3)
    alone = Fleet(p, Layout("colocated", 0, 2)).run([long_, short])
    assert [o.ttft for o in alone] == pytest.approx([0.01 + 0.1, 0.01 + 0.01])
    lockstep = Fleet(p, Layout("colocated", 0, 2, dp_lockstep=2)).run([long_, short])
    assert [o.ttft for o in lockstep] == pytest.approx([0.11, 0.11])
    assert [o.tpot for o in lockstep] == pytest.approx([0.005, 0.005])
    # a prompt arriving while the other rank decodes (steps end at 0.02 + k x 5 ms): it waits
    # for the step in flight, then the decoding rank's next step lasts the prefill
    late = Request(0.052, list(range(10, 110)), 2)
    first, second = Fleet(p, Layout("colocated", 0, 2, dp_lockstep=2)).run([Request(0.0, [10] * 10, 20), late])
    assert second.ttft == pytest.approx(0.11 + (0.055 - 0.052))
    assert first.finish_s - first.first_token_s == pytest.approx(19 * 0.005 + 0.11 - 0.005)


def test_adaptive_pd_prefills_short_prompts_on_d_and_long_ones_on_p():
    """The router's rule with its priors (2000 tokens/s, 10 ms transfers): a prompt of at most
    256 tokens prefills on D (no pull: D's own prefill time), a longer one on an idle P."""
    p = toy_profile(LinearStep(base_s=0.01, per_token_s=1e-4, per_attention_s=0.0),
                    LinearStep(base_s=0.005, per_token_s=1e-3, per_attention_s=0.0), link="tcp")
    layout = Layout("pd", 1, 1, adaptive=True)
    (short,) = Fleet(p, layout).run([Request(0.0, list(range(10, 110)), 3)])
    assert short.ttft == pytest.approx(0.01 + 100 * 1e-4)
    fleet = Fleet(p, layout)
    (long_,) = fleet.run([Request(0.0, [7] * 400, 3)])
    pull = LINKS["tcp"].latency_s + 25 * SHAPE.kv_bytes_per_token * 16 / LINKS["tcp"].bandwidth
    assert long_.ttft == pytest.approx(0.01 + 400 * 1e-4 + pull)
    assert fleet.decider.rate["p0"].samples == 1 and fleet.decider.transfer["p0"].samples == 1


def test_adaptive_pd_with_only_short_prompts_is_its_decode_pool_colocated():
    """Every prompt under the local threshold: the P idles and the D engines serve as a
    colocated pool of their size would, request for request."""
    p = toy_profile(LinearStep(base_s=2e-3, per_token_s=1e-4, per_attention_s=0.0),
                    LinearStep(base_s=2e-3, per_token_s=2e-4, per_attention_s=0.0))
    requests = Workload(input_len=100, output_len=20, num_requests=60).requests(rate=300.0, vocab=4096)
    adaptive = Fleet(p, Layout("pd", 1, 2, adaptive=True))
    got = adaptive.run(requests)
    want = Fleet(p, Layout("colocated", 0, 2)).run(requests)
    assert [t for o in got for t in (o.first_token_s, o.finish_s)] == \
        pytest.approx([t for o in want for t in (o.first_token_s, o.finish_s)])
    assert adaptive.prefill[0].scheduler.block_manager.num_free_blocks == \
        adaptive.prefill[0].scheduler.block_manager.num_total_blocks
    for e in adaptive.decode:
        assert e.scheduler.block_manager.num_free_blocks == e.scheduler.block_manager.num_total_blocks


def test_the_planner_searches_adaptive_pd_and_lockstep_layouts():
    slo = SLO(ttft_s=1.0, tpot_s=0.2)
    workload = Workload(input_len=256, output_len=8, num_requests=10)
    ranked = plan(PREFILL_BOUND, workload, slo, max_gpus=4, min_gpus=4, decode_max_seqs=[256], iterations=3,
                  adaptive=(False, True), dp_lockstep=2)
    labels = {(r.layout.kind, r.layout.num_prefill, r.layout.adaptive, r.layout.dp_lockstep) for r in ranked}
    assert labels == {("colocated", 0, False, 2), ("pd", 2, False, 2), ("pd", 2, True, 2)}
    with pytest.raises(ValueError, match="multiple of dp_lockstep"):
        Fleet(PREFILL_BOUND, Layout("pd", 1, 2, dp_lockstep=2))
    with pytest.raises(ValueError, match="adaptive PD needs a pd layout"):
        Fleet(PREFILL_BOUND, Layout("colocated", 0, 2, adaptive=True))


def test_an_adaptive_lockstep_layout_loads_in_the_ray_launcher_and_the_helm_chart(tmp_path):
    from launch.ray_config import load_config

    layout = Layout("pd", 2, 4, decode_max_num_seqs=64, adaptive=True, dp_lockstep=2)
    path = tmp_path / "ray.yaml"
    path.write_text(yaml.safe_dump(ray_config(layout, None)))
    config = load_config(str(path))
    assert (config.prefill.count, config.decode.count) == (1, 2)
    assert config.prefill.data_parallel_size == config.decode.data_parallel_size == 2
    assert config.decode.extra_args == ["--max-num-seqs", "64", "--dp-lockstep"]
    assert config.router.extra_args == ["--pd-mode", "adaptive"]
    chart = yaml.safe_load(pathlib.Path(REPO, "helm/atomd/values.yaml").read_text())
    values = helm_values(layout)
    for role in ("prefill", "decode", "router"):
        assert set(values[role]) <= set(chart[role])
    assert (values["decode"]["replicas"], values["decode"]["dataParallelSize"]) == (2, 2)


def test_step_shapes_of_a_prefill_chunk_count_its_causal_pairs():
    s = StepShape.of(True, [4, 2], [0, 10])  # 4 fresh tokens: 1+2+3+4; 2 after 10: 11+12
    assert (s.tokens, s.seqs, s.attention, s.context) == (6, 2, 10 + 23, 16)
