"""Expert parallelism over DP ranks (`--enable-expert-parallel`, atomd/model/expert_parallel.py):
the sharded block against the whole one, two sharded engines (one thread each, the exchange
in process) against Hugging Face and a DP=1 engine under uneven schedules, the delayer's
and the exchanges' collective counts equal on every rank after random schedules, and the real
thing (`atomd serve`, two rank processes over gloo): greedy equal to HF, expert load in
/metrics, a rank killed or stopped mid-step failing every request within the group timeout."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from atomd.config import EngineConfig
from atomd.engine.dp_collective import make_prefill_delayer
from atomd.engine.llm_engine import LLMEngine
from atomd.model import moe as moe_mod
from atomd.model.expert_parallel import ExpertParallel
from atomd.model.loader import load_model
from atomd.model.moe import MoeWeights, moe
from contracts.sampling import SamplingParams
from launch.process import http
from scheduler.sequence import SequenceType
from tests.in_process_group import InProcessGroup
from tests.server_fixtures import start_server
from tests.test_model_hf import BLOCK, hf_greedy, make_checkpoint, prompts_of
from tests.test_models import random_moe

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(240)

# 2 ranks: qwen3_moe with 8 experts (4 a rank), mixtral with 16 (8 a rank); both top-2
MODELS = {"qwen3_moe": ("qwen3_moe", {}), "mixtral": ("mixtral", {"num_local_experts": 16})}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, pathlib.Path]:
    return {name: make_checkpoint(tmp_path_factory.mktemp(name), kind, seed=40 + i, **kw)
            for i, (name, (kind, kw)) in enumerate(MODELS.items())}


def on_ranks(n: int, fn) -> list:
    """fn(rank) on n threads at once (the in-process group's ranks); the first error re-raised."""
    results, errors = [None] * n, []

    def run(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as e:  # the peers then time out on the group's barrier
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def shard(w: MoeWeights, rank: int, ranks: int) -> MoeWeights:
    per = w.gate_up.shape[0] // ranks
    mine = slice(rank * per, (rank + 1) * per)
    return MoeWeights(router=w.router, gate_up=w.gate_up[mine], down=w.down[mine], top_k=w.top_k,
                      norm_topk_prob=w.norm_topk_prob, cast_weights=w.cast_weights, first_expert=rank * per)


# ---------------------------------------------------------------- the block


@pytest.mark.unit
@pytest.mark.parametrize("experts,ranks", [(8, 2), (16, 2), (8, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cast", [True, False])
def test_the_sharded_block_equals_the_whole_block(experts, ranks, dtype, cast, monkeypatch):
    """Each rank's rows (none on rank 0: its part is the exchange alone) through the sharded
    block equal the whole block's on the same rows: bit-equal in bf16 (the same roundings),
    float32 to its last bits (an expert's GEMM over other rows). The whole block without the AMX
    experts (moe.AMX), which expert parallelism does not run."""
    monkeypatch.setattr(moe_mod, "AMX", False)
    w = random_moe(experts=experts, dtype=dtype, seed=experts + ranks)
    w.cast_weights = cast
    g = torch.Generator().manual_seed(1)
    rows = [0, 1, 7, 40][:ranks] if ranks > 2 else [0, 9]
    hs = [torch.randn(n, 32, generator=g).to(dtype) for n in rows]
    group = InProcessGroup(ranks)

    def rank(r: int) -> tuple[torch.Tensor, MoeWeights]:
        mine = shard(w, r, ranks)
        mine.ep = ExpertParallel(group.rank(r), r, ranks)
        return moe(hs[r], mine), mine

    got = on_ranks(ranks, rank)
    assert got[0][0].shape == (0, 32)
    for (out, _), h in zip(got[1:], hs[1:]):
        want = moe(h, w)
        if dtype == torch.bfloat16:
            assert torch.equal(out, want)
        else:
            torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    # each expert's load counted once, on the rank holding it: every (token, choice) pair
    per = experts // ranks
    assert torch.equal(sum(m.routed for _, m in got), w.routed)
    assert all(not m.routed[:r * per].any() and not m.routed[(r + 1) * per:].any() for r, (_, m) in enumerate(got))
    assert int(w.routed.sum()) == 2 * sum(rows[1:])


@pytest.mark.unit
def test_load_holds_only_this_ranks_experts_and_refuses_what_does_not_split(checkpoints, tmp_path):
    path = checkpoints["mixtral"]
    whole = load_model(path)
    for rank in (0, 1):
        part = load_model(path, expert_shard=(rank, 2))
        for w, m in zip(whole.layers, part.layers):
            assert m.moe.first_expert == 8 * rank and m.moe.gate_up.shape[0] == 8
            assert torch.equal(m.moe.gate_up, w.moe.gate_up[8 * rank:8 * rank + 8])
            assert torch.equal(m.moe.down, w.moe.down[8 * rank:8 * rank + 8])
            assert torch.equal(m.moe.router, w.moe.router)
    with pytest.raises(ValueError, match="16 experts do not split evenly over data_parallel_size=3"):
        load_model(path, expert_shard=(0, 3))
    dense = make_checkpoint(tmp_path / "qwen3", "qwen3", seed=1)
    with pytest.raises(ValueError, match="needs an MoE model"):
        load_model(dense, expert_shard=(0, 2))


@pytest.mark.unit
def test_a_config_ep_cannot_run_is_refused_at_start_naming_why(checkpoints):
    with pytest.raises(ValueError, match="enable_expert_parallel is not simulated"):
        EngineConfig(model_runner="simulated", hardware="h100:llama3-8b", enable_expert_parallel=True)
    with pytest.raises(ValueError, match="enable_expert_parallel needs an MoE model; the built-in model has no"):
        EngineConfig(data_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="16 experts do not split evenly over data_parallel_size=3"):
        EngineConfig(model=str(checkpoints["mixtral"]), data_parallel_size=3, enable_expert_parallel=True)
    EngineConfig(model=str(checkpoints["mixtral"]), data_parallel_size=4, enable_expert_parallel=True)


# ---------------------------------------------------------------- two engines, one thread each


class Ranks:
    """Two expert-parallel LLMEngines of one checkpoint over an in-process group, stepped
    tick by tick on one thread each (as DPEngineCore steps them: every tick, idle or not)."""

    def __init__(self, path: pathlib.Path, policy: str = "off", ranks: int = 2, **config):
        self.group = InProcessGroup(ranks, timeout_s=60)
        self.colls = [self.group.rank(r) for r in range(ranks)]
        self.ran: list[str] = ["idle"] * ranks  # what each rank's forward ran this tick
        self.mixed = [0] * ranks  # prefill forwards that carried decode rows too (enable_mixed_chunk)
        # per rank: decode rows in those forwards, and of them the rows the decode kernel read (one call a layer)
        self.mixed_rows = [[0, 0] for _ in range(ranks)]

        def build(r: int) -> LLMEngine:
            cfg = EngineConfig(model=str(path), data_parallel_size=ranks, data_parallel_rank=r,
                               enable_expert_parallel=True, prefill_delayer=policy, num_threads=1,
                               max_model_len=256, **config)
            delayer = make_prefill_delayer(cfg, self.colls[r]) if policy != "off" else None
            engine = LLMEngine(cfg, prefill_delayer=delayer, expert_group=self.colls[r])
            forward = engine._forward

            def observed(batch):
                self.ran[r] = "prefill" if batch.is_prefill else "decode"
                decode = [i for i, s in enumerate(batch.seqs) if s.type is SequenceType.DECODE]
                self.mixed[r] += batch.is_prefill and bool(decode)
                out = forward(batch)
                if batch.is_prefill and decode:
                    self.mixed_rows[r][0] += len(decode)
                    self.mixed_rows[r][1] += decode_kernel_rows(engine, batch, decode)
                return out
            engine._forward = observed
            return engine

        self.engines = on_ranks(ranks, build)

    def decisions(self) -> list[int]:
        return [sum(n for *_, n in e.scheduler.prefill_delayer.stats()["outcomes"]) for e in self.engines]

    def run(self, arrivals: list[dict[int, list[tuple[str, list[int]]]]], params=GREEDY,
            max_ticks: int = 400) -> tuple[dict[str, list[int]], list[list[str]]]:
        """arrivals[rank][tick]: (request id, prompt) added before that tick's step. Every rank
        steps until no rank has work left (decided together: a rank alone must not stop).
        Returns the tokens by request id and, per rank, what each tick's forward ran (prefill,
        decode, or idle: the exchange alone)."""
        last = max((t for a in arrivals for t in a), default=0)
        tokens: dict[str, list[int]] = {}
        kinds: list[list[str]] = [[] for _ in self.engines]
        busy = [True] * len(self.engines)
        sync = threading.Barrier(len(self.engines))

        def rank(r: int) -> None:
            engine = self.engines[r]
            for tick in range(max_ticks):
                for rid, prompt in arrivals[r].get(tick, []):
                    engine.add_request(rid, prompt, params)
                self.ran[r] = "idle"
                for out in engine.step():
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                kinds[r].append(self.ran[r])
                busy[r] = engine.has_unfinished_requests()
                sync.wait(60)  # every rank has set busy
                done = tick >= last and not any(busy)
                sync.wait(60)  # every rank has read it
                if done:
                    return
            raise AssertionError("ranks still busy after max_ticks")

        before = [(c.num_collectives, c.num_all_to_all) for c in self.colls]
        on_ranks(len(self.engines), rank)
        self.counts = [(c.num_collectives - b[0], c.num_all_to_all - b[1]) for c, b in zip(self.colls, before)]
        return tokens, kinds


def decode_kernel_rows(engine: LLMEngine, batch, decode: list[int]) -> int:
    """How many of a prefill batch's decode rows (`decode`, batch indices) the last forward read
    through the decode kernel (the runner's metadata: AttentionMetadata.decode_rows)."""
    rows = engine.runner.last_step[1].decode_rows
    starts = (batch.num_scheduled_tokens.cumsum() - batch.num_scheduled_tokens)[decode].tolist()
    return 0 if rows is None else len(set(starts) & set(rows.tolist()))


def one_engine_greedy(path: pathlib.Path, placed: dict[str, list[int]],
                      **config) -> tuple[dict[str, list[int]], LLMEngine]:
    """The same requests on one DP=1 engine, all at once: the tokens by request id, and the engine."""
    dp1 = LLMEngine(EngineConfig(model=str(path), num_threads=1, max_model_len=256, **config))
    for rid, prompt in placed.items():
        dp1.add_request(rid, prompt, GREEDY)
    alone: dict[str, list[int]] = {}
    while dp1.has_unfinished_requests():
        for out in dp1.step():
            alone.setdefault(out.request_id, []).extend(out.new_token_ids)
    return alone, dp1


def busy_ticks(kinds: list[list[str]]) -> int:
    """Ticks where some rank ran a forward (the others exchanged with it)."""
    return sum(any(k != "idle" for k in tick) for tick in zip(*kinds))


@pytest.fixture(scope="module")
def reference(checkpoints):
    """HF's greedy tokens, memoised per (model, prompt)."""
    memo: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    def greedy(name: str, prompt: list[int], n: int = 8) -> list[int]:
        key = (name, tuple(prompt))
        if key not in memo:
            memo[key] = hf_greedy(checkpoints[name], prompt, n)
        return memo[key]
    return greedy


@pytest.fixture(scope="module")
def ep_ranks(checkpoints):
    """Ranks per (model, delayer policy, mixed steps), built once."""
    memo: dict[tuple[str, str, bool], Ranks] = {}

    def get(name: str, policy: str = "off", mixed: bool = False) -> Ranks:
        if (name, policy, mixed) not in memo:
            memo[name, policy, mixed] = Ranks(checkpoints[name], policy, enable_mixed_chunk=mixed)
        return memo[name, policy, mixed]
    return get


PROMPTS = prompts_of([5, 3 * BLOCK + 7, 1, 2 * BLOCK, 40], seed=5)


@pytest.mark.unit
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("schedule", ["one_idle", "prefill_while_decoding", "both_busy"])
@pytest.mark.parametrize("mixed", [False, True], ids=["seed_steps", "mixed_steps"])
def test_ep2_greedy_equals_hf_and_dp1_under_uneven_load(name, schedule, mixed, checkpoints, ep_ranks, reference):
    """mixed_steps: --enable-mixed-chunk, where a rank's prefill forward carries its running
    streams' decode rows (both_busy and prefill_while_decoding make one)."""
    ranks = ep_ranks(name, mixed=mixed)
    mixed_before, rows_before = sum(ranks.mixed), [sum(n) for n in zip(*ranks.mixed_rows)]
    if schedule == "one_idle":  # rank 1 never has a request: its every tick is the exchange alone
        arrivals = [{0: [(f"p{i}", p) for i, p in enumerate(PROMPTS)]}, {}]
    elif schedule == "prefill_while_decoding":  # rank 0 decodes; rank 1's prompts land mid-way
        arrivals = [{0: [("p0", PROMPTS[0]), ("p2", PROMPTS[2])]}, {3: [("p1", PROMPTS[1])], 6: [("p4", PROMPTS[4])]}]
    else:
        arrivals = [{0: [("p0", PROMPTS[0]), ("p1", PROMPTS[1])], 2: [("p3", PROMPTS[3])]},
                    {0: [("p2", PROMPTS[2]), ("p4", PROMPTS[4])]}]
    tokens, kinds = ranks.run(arrivals)
    placed = {rid: p for a in arrivals for batch in a.values() for rid, p in batch}
    for rid, prompt in placed.items():
        assert tokens[rid] == reference(name, prompt), rid
    assert one_engine_greedy(checkpoints[name], placed)[0] == {rid: tokens[rid] for rid in placed}
    pairs = set(zip(*kinds))
    if schedule == "one_idle":
        assert set(kinds[1]) == {"idle"} and ("prefill", "idle") in pairs and ("decode", "idle") in pairs
    if schedule == "prefill_while_decoding":
        assert ("decode", "prefill") in pairs, kinds
    assert (sum(ranks.mixed) > mixed_before) == (mixed and schedule != "one_idle")
    # a mixed step's decode rows: every one read through the decode kernel (one call a layer)
    in_mixed, through_kernel = (sum(n) - before for n, before in zip(zip(*ranks.mixed_rows), rows_before))
    assert through_kernel == in_mixed and (in_mixed > 0) == (mixed and schedule != "one_idle")
    # every tick: the gate's all-reduce, then where any rank has rows 3 all-to-alls per sparse
    # layer on every rank, idle or not
    (c0, a0), (c1, a1) = ranks.counts
    assert c0 == c1 == len(kinds[0])
    assert a0 == a1 == 3 * len(ranks.engines[0].model.config.sparse_layers) * busy_ticks(kinds)
    for engine in ranks.engines:  # every block back
        bm = engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_total_blocks


@pytest.mark.unit
@pytest.mark.parametrize("name", list(MODELS))
def test_mixed_steps_decode_rows_through_the_decode_kernel_equal_one_kind_steps_and_hf(name, checkpoints, reference):
    """DP=1, float32, --enable-mixed-chunk with a small token budget (prompts chunked while others
    decode): the decode rows of every mixed step go through the decode kernel, and each request's
    greedy tokens equal one-kind steps' (the seed's scheduler) and HF's, their logprobs within
    float32 rounding of one-kind steps' (there a decode row is a decode step's)."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    runs = {}
    for mixed in (False, True):
        engine = LLMEngine(EngineConfig(model=str(checkpoints[name]), num_threads=1, max_model_len=256,
                                        max_num_batched_tokens=32, enable_mixed_chunk=mixed))
        forward, seen = engine._forward, [0, 0]  # decode rows in prefill forwards; of them, the kernel's

        def observed(batch, engine=engine, forward=forward, seen=seen):
            out = forward(batch)
            decode = [i for i, s in enumerate(batch.seqs) if s.type is SequenceType.DECODE]
            if batch.is_prefill and decode:
                seen[0] += len(decode)
                seen[1] += decode_kernel_rows(engine, batch, decode)
            return out
        engine._forward = observed
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"p{i}", prompt, params)
        got: dict[str, tuple[list[int], list[float]]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                ids, lps = got.setdefault(out.request_id, ([], []))
                ids.extend(out.new_token_ids)
                lps.extend(lp.logprob for lp in out.new_logprobs)
        runs[mixed] = got, seen
    (seed, none), (mixed, seen) = runs[False], runs[True]
    assert none[0] == 0 and seen[0] >= 8 and seen[1] == seen[0], (none, seen)
    for i, prompt in enumerate(PROMPTS):
        rid = f"p{i}"
        assert mixed[rid][0] == seed[rid][0] == reference(name, prompt), rid
        torch.testing.assert_close(mixed[rid][1], seed[rid][1], rtol=0, atol=1e-5)


@pytest.mark.unit
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(policy=st.sampled_from(["align", "coalesce"]), mixed=st.booleans(), max_tokens=st.integers(1, 6),
       schedule=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 12), st.integers(0, len(PROMPTS) - 1)),
                         min_size=1, max_size=6), aligned_tokens=st.sampled_from([0, 2 * BLOCK]))
def test_collective_counts_equal_on_every_rank_after_random_schedules(policy, mixed, max_tokens, schedule,
                                                                       aligned_tokens, ep_ranks, reference):
    """Random arrivals (rank, tick, prompt): every rank made one delayer decision per tick and
    the same number of all-to-alls, and every request got HF's greedy tokens, with the seed's
    one-kind steps and with mixed steps, with and without an aligned tick's budget split between
    the ranks (--prefill-delayer-aligned-tokens: prompts chunked, leftovers going on while held)."""
    ranks = ep_ranks("qwen3_moe", policy, mixed)
    arrivals: list[dict[int, list]] = [{}, {}]
    for i, (rank, tick, p) in enumerate(schedule):
        arrivals[rank].setdefault(tick, []).append((f"h{i}", PROMPTS[p]))
    decided = ranks.decisions()
    for engine in ranks.engines:
        engine.scheduler.prefill_delayer.aligned_tokens = aligned_tokens
    try:
        tokens, kinds = ranks.run(arrivals, params=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                   ignore_eos=True))
    finally:
        for engine in ranks.engines:
            engine.scheduler.prefill_delayer.aligned_tokens = 0
    for rid, prompt in ((rid, p) for a in arrivals for b in a.values() for rid, p in b):
        assert tokens[rid] == reference("qwen3_moe", prompt)[:max_tokens]
    (c0, a0), (c1, a1) = ranks.counts  # the delayer's all-reduce and the gate's, every tick
    ticks = len(kinds[0])
    layers = len(ranks.engines[0].model.config.sparse_layers)
    assert c0 == c1 == 2 * ticks and a0 == a1 == 3 * layers * busy_ticks(kinds)
    assert [now - then for now, then in zip(ranks.decisions(), decided)] == [ticks, ticks]
    for engine in ranks.engines:
        assert engine.scheduler.prefill_delayer.stats()["collective_errors"] == 0


# ---------------------------------------------------------------- atomd serve: two rank processes over gloo

EP_SERVE = ["--data-parallel-size", "2", "--enable-expert-parallel", "--prefill-delayer", "align",
            "--dp-collective-timeout-s", "5"]


def complete(server, prompt: list[int], max_tokens: int = 8, rank: int | None = None) -> tuple[int, dict]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if rank is not None:
        body["data_parallel_rank"] = rank
    status, raw = http("POST", server.url + "/v1/completions", body, timeout=60)
    return status, json.loads(raw)


def hf_text(path: pathlib.Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json")).decode(ids)


@pytest.fixture(scope="module")
def ep_server(checkpoints):
    with pytest.MonkeyPatch.context() as mp:  # the ranks keep their ticks (idle ones too: 200 a second)
        mp.setenv("ATOMD_STEP_SAMPLES", "100000")
        server = start_server(checkpoints["qwen3_moe"], *EP_SERVE)
    yield server
    server.stop()


@pytest.mark.integration
def test_served_ep2_greedy_equals_hf_on_either_rank_and_metrics_show_each_ranks_experts(ep_server, reference,
                                                                                         checkpoints):
    prompts = [[t % 297 + 3 for t in p] for p in PROMPTS[:4]]  # in the tokenizer's 300 ids (the model has 320)
    with ThreadPoolExecutor(4) as pool:  # rank 0 gets three, rank 1 one (pinned): uneven
        answers = list(pool.map(lambda ip: complete(ep_server, ip[1], rank=0 if ip[0] < 3 else 1),
                                enumerate(prompts)))
    for (status, body), prompt in zip(answers, prompts):
        assert status == 200, body
        assert body["choices"][0]["text"] == hf_text(checkpoints["qwen3_moe"], reference("qwen3_moe", prompt))
    status, raw = http("GET", ep_server.url + "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(raw.decode())}
    tokens = [s for s in families["atomd:expert_tokens"].samples if s.name.endswith("_total")]
    experts = {(s.labels["dp_rank"], s.labels["expert"]) for s in tokens}
    assert experts == {("0", str(e)) for e in range(4)} | {("1", str(e)) for e in range(4, 8)}
    # every (token, choice) pair of every sparse layer ran on exactly one rank: 2 choices x 2 layers per token
    computed = sum(len(p) + 8 - 1 for p in prompts)
    assert sum(s.value for s in tokens) == 2 * 2 * computed
    exchange = families["atomd:expert_parallel_exchange_seconds"].samples
    assert {s.labels["dp_rank"] for s in exchange} == {"0", "1"}
    # the tick trace: each rank's prompt tokens prefilled and 7 decode tokens a request, and
    # tick i of one rank overlapping tick i of the other (their collectives meet)
    ticks = [r["tick_samples"] for r in ep_server.stats()["ranks"]]
    for rank, mine in enumerate([prompts[:3], prompts[3:]]):
        assert sum(t for *_, kind, t in ticks[rank] if kind == 1) == sum(map(len, mine))
        assert sum(t for *_, kind, t in ticks[rank] if kind == 0) == 7 * len(mine)
        assert all(cpu <= wall + 1e-3 for _, wall, cpu, *_ in ticks[rank])
    assert abs(len(ticks[0]) - len(ticks[1])) <= 1  # read between ticks
    for (s0, w0, *_), (s1, w1, *_) in zip(*ticks):
        assert s0 <= s1 + w1 and s1 <= s0 + w0


@pytest.mark.integration
def test_served_ep2_x_tp2_greedy_equals_hf_on_either_rank(checkpoints, reference):
    """TP inside each EP rank (`--tensor-parallel-size 2`): each DP rank's engine core (TP rank 0) holds
    its 4 experts whole and runs the exchange, its worker the attention's and the dense MLP's halves and
    no expert (a zero block output into the all-reduce): greedy equal to HF on both ranks, each rank's
    expert load counted on its core."""
    server = start_server(checkpoints["qwen3_moe"], *EP_SERVE, "--tensor-parallel-size", "2")
    try:
        ranks = server.stats()["ranks"]
        assert [len(r["tensor_parallel"]["worker_pids"]) for r in ranks] == [1, 1]
        prompts = [[t % 297 + 3 for t in p] for p in PROMPTS[:3]]
        with ThreadPoolExecutor(3) as pool:  # rank 0 two, rank 1 one, at once
            answers = list(pool.map(lambda ip: complete(server, ip[1], rank=ip[0] // 2), enumerate(prompts)))
        for (status, body), prompt in zip(answers, prompts):
            assert status == 200, body
            assert body["choices"][0]["text"] == hf_text(checkpoints["qwen3_moe"], reference("qwen3_moe", prompt))
        experts = [{e for e, n in r["expert_tokens"] if n} for r in server.stats()["ranks"]]
        assert experts[0] <= set(range(4)) and experts[1] <= set(range(4, 8)) and experts[0] and experts[1]
    finally:
        server.stop()


def fail_a_rank_mid_step(servers: list, sig: int) -> None:
    """Long requests on both ranks (`servers`: one running both, or one a rank, on two hosts);
    the last server's rank process stopped (or killed) while both step: the other rank's next
    all-to-all fails within --dp-collective-timeout-s (5 s), its core exits, and every server
    fails every request of both ranks (the stopped one's too: an expert-parallel engine is one
    unit), reports unhealthy, and keeps answering."""
    victim = None
    try:
        prompt = [t % 297 + 3 for t in PROMPTS[0]]
        at = [servers[rank % len(servers)] for rank in (0, 1)]
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(complete, server, prompt, 240, rank) for rank, server in enumerate(at)]
            deadline = time.monotonic() + 30
            while not all(r["num_running"] for server in servers for r in server.stats()["ranks"]):
                assert time.monotonic() < deadline and not any(f.done() for f in futures), "not both running"
                time.sleep(0.02)
            victim = max(servers[-1].engine_pids())
            os.kill(victim, sig)
            hit = time.monotonic()
            answers = [f.result(timeout=30) for f in futures]
            failed_after = time.monotonic() - hit
        for status, body in answers:
            assert status == 503 and body["error"]["code"] == "engine_dead", body
        if sig == signal.SIGSTOP:  # the stopped rank never exits: its request failed with its peer
            assert any("expert-parallel DP rank" in body["error"]["message"] for _, body in answers), answers
        assert failed_after < 5 + 10, failed_after  # the group timeout, plus the core's exit and the API's notice
        for server in servers:
            status, raw = http("GET", server.url + "/health")
            assert status == 503 and json.loads(raw)["status"] == "engine dead"
            status, body = complete(server, prompt, 2)
            assert status == 503, body
            assert server.proc.poll() is None  # the API process lives on and answers
    finally:
        if victim is not None and sig == signal.SIGSTOP:
            os.kill(victim, signal.SIGKILL)  # a stopped process would never see the server's SIGTERM


@pytest.mark.integration
def test_a_rank_stopped_mid_step_fails_every_request_within_the_group_timeout(checkpoints):
    server = start_server(checkpoints["qwen3_moe"], *EP_SERVE)
    try:
        fail_a_rank_mid_step([server], signal.SIGSTOP)
    finally:
        server.stop()


@pytest.mark.integration
def test_a_rank_killed_mid_step_fails_every_request(ep_server):
    """After it the module's server is dead."""
    fail_a_rank_mid_step([ep_server], signal.SIGKILL)


# ---------------------------------------------------------------- EP=2 over two hosts


@pytest.fixture(scope="module")
def ep_over_hosts(checkpoints):
    """Rank 0's `atomd serve` on test host a, rank 1's on host b (network namespaces on one
    bridge, tests/netns.py): their gloo group meets at a's address, and the hosts reach each
    other only over the bridge."""
    from tests.netns import HostEngine, hosts, next_port

    with hosts(2) as net:
        a, b = net.hosts
        group = [*EP_SERVE, "--data-parallel-size-local", "1", "--data-parallel-address", a.ip,
                 "--dp-master-port", str(next_port(net, a))]
        servers = [HostEngine(net, a, checkpoints["qwen3_moe"], *group),
                   HostEngine(net, b, checkpoints["qwen3_moe"], *group, "--data-parallel-start-rank", "1")]
        try:
            for server in servers:
                server.wait_ready()
            yield servers
        finally:
            for server in servers:
                server.stop()


@pytest.mark.integration
@pytest.mark.netns
@pytest.mark.netns_full  # ~30 s of start-ups: `make e2e-netns`
def test_ep2_over_two_hosts_equals_hf_and_each_host_holds_its_experts(ep_over_hosts, reference, checkpoints):
    """Uneven: three requests on host a's rank, one on b's, at once; each equals HF (and so the
    DP=1 engine, above); each host's /metrics count only its own experts; a server refuses a
    rank it does not run."""
    prompts = [[t % 297 + 3 for t in p] for p in PROMPTS[:4]]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda ip: complete(ep_over_hosts[ip[0] // 3], ip[1]), enumerate(prompts)))
    for (status, body), prompt in zip(answers, prompts):
        assert status == 200, body
        assert body["choices"][0]["text"] == hf_text(checkpoints["qwen3_moe"], reference("qwen3_moe", prompt))
    routed = 0
    for rank, server in enumerate(ep_over_hosts):
        status, raw = http("GET", server.url + "/metrics")
        assert status == 200
        families = {f.name: f for f in text_string_to_metric_families(raw.decode())}
        tokens = [s for s in families["atomd:expert_tokens"].samples if s.name.endswith("_total")]
        assert {(s.labels["dp_rank"], s.labels["expert"]) for s in tokens} == \
            {(str(rank), str(e)) for e in range(4 * rank, 4 * rank + 4)}
        routed += sum(s.value for s in tokens)
        status, body = complete(server, prompts[0], 2, rank=1 - rank)
        assert status == 400 and body["error"]["param"] == "data_parallel_rank", body
    # every (token, choice) pair of every sparse layer ran on exactly one host: 2 choices x 2 layers per token
    assert routed == 2 * 2 * sum(len(p) + 8 - 1 for p in prompts)


@pytest.mark.integration
@pytest.mark.netns
@pytest.mark.netns_full  # ~30 s of start-ups: `make e2e-netns`
def test_a_rank_killed_on_the_other_host_fails_both_hosts_within_the_group_timeout(ep_over_hosts):
    """After it the module's servers are dead."""
    fail_a_rank_mid_step(ep_over_hosts, signal.SIGKILL)
