"""Tensor parallelism inside an engine (atomd/engine/tp_workers.py, atomd/model/tensor_parallel.py):
TP=2 greedy ids equal TP=1's and Hugging Face transformers' for every family of the registry on
tiny random checkpoints, DeepSeek's MLA included (fp32, prompt logits within 1e-4 of HF's; bf16
against HF bf16 with tests/test_bf16.py's tie rule), n-gram drafts and the gloo communicator on
one family each, LoRA against PEFT, KV heads replicated when N exceeds them, the split checked
with the numbers named, and a worker SIGKILLed under a real `atomd serve` failing its engine
cleanly (errors, /health 503, no process left). Quantized weights: tests/test_tensor_parallel_quant.py."""
from __future__ import annotations

from http.client import HTTPConnection
import json
import os
import pathlib
import signal
import threading
import time

import pytest
import torch

from atomd.config import EngineConfig
from atomd.engine.tp_collective import _pid_alive
from atomd.llm import LLM
from atomd.model.tp_split import TPSplit, check_split
from contracts.sampling import SamplingParams
from launch.process import http
from tests.server_fixtures import start_server
from tests.test_bf16 import assert_greedy_follows_hf_bf16
from tests.test_model_hf import (BLOCK, MIXED, _prompt_logits, assert_equals_hf, engine_greedy, hf_model,
                                  make_checkpoint, prompts_of)
from tests.test_models import hf_both

torch.set_num_threads(1)

# every family of the registry (Mistral is Llama's class); each 4 query heads, 2 KV heads, but DeepSeek's
# (tests/families.py: MLA, 4 heads over one latent row a token, replicated on both workers)
FAMILIES = {"llama": {}, "qwen2": {}, "qwen3": {}, "qwen3_moe": {"mlp_only_layers": [1]},
            "mixtral": {}, "phi3": {}, "gemma3": {"num_hidden_layers": 3}}
DEEPSEEK = ["deepseek-v2-lite", "deepseek-v3"]
# the TP=2 engine's extra flags for some families (one start each family, not one per feature): gloo (the
# communicator that crosses hosts) in place of shared memory; n-gram drafts verified across both workers
TP2_FLAGS = {"qwen3_moe": {"tp_communicator": "gloo"},
             "gemma3": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}}}
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, pathlib.Path]:
    from tests.families import write_families

    return {**{kind: make_checkpoint(tmp_path_factory.mktemp(kind), kind, seed=i + 40, **over)
               for i, (kind, over) in enumerate(FAMILIES.items())}, **write_families(tmp_path_factory, DEEPSEEK)}


def tp_llm(path: pathlib.Path, size: int, **kw) -> LLM:
    return LLM(str(path), num_threads=1, max_model_len=256, tensor_parallel_size=size, **kw)


@pytest.fixture(scope="module")
def llama_adapters(checkpoints, tmp_path_factory) -> dict[str, pathlib.Path]:
    """test_lora's PEFT adapters on the llama checkpoint (its TP=2 engine starts with two of them)."""
    from tests.test_lora import ADAPTERS, make_adapter

    root = tmp_path_factory.mktemp("tp-lora")
    return {name: make_adapter(checkpoints["llama"], root / name, r, a, rs, t, seed=i + 11)
            for i, (name, r, a, rs, t) in enumerate(ADAPTERS)}


class TP2Engines:
    """The fp32 TP=2 engine of each family, started on first use with TP2_FLAGS' extras (llama's with
    LoRA: the family test and the LoRA test after it share one start); `done` stops one."""

    def __init__(self, checkpoints, adapters):
        self.checkpoints, self.adapters, self.llms = checkpoints, adapters, {}

    def __call__(self, kind: str) -> LLM:
        if kind not in self.llms:
            flags = dict(TP2_FLAGS.get(kind, {}))
            if kind == "llama":
                flags.update(enable_lora=True, max_loras=2, max_lora_rank=8,
                             lora_modules=[f"{n}={self.adapters[n]}" for n in ("sql", "attn")])
            self.llms[kind] = tp_llm(self.checkpoints[kind], 2, **flags)
        return self.llms[kind]

    def done(self, kind: str) -> None:
        llm = self.llms.pop(kind, None)
        if llm is not None:
            llm.engine.close()


@pytest.fixture(scope="module")
def tp2_engines(checkpoints, llama_adapters):
    engines = TP2Engines(checkpoints, llama_adapters)
    yield engines
    for kind in list(engines.llms):
        engines.done(kind)


@pytest.fixture
def closing():
    """LLMs whose TP workers the test stops at its end."""
    llms: list[LLM] = []
    yield llms.append
    for llm in llms:
        llm.engine.close()


@pytest.mark.unit
def test_split_is_checked_with_the_numbers_named(checkpoints):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the 4 attention heads"):
        check_split(4, 2, [128], 3)
    with pytest.raises(ValueError, match="neither divides the 4 KV heads .* nor is a multiple"):
        check_split(24, 4, [128], 6)
    with pytest.raises(ValueError, match="intermediate size 102"):
        check_split(4, 2, [102], 4)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the 4 attention heads"):
        EngineConfig(model=str(checkpoints["llama"]), tensor_parallel_size=3)  # the API process's check
    from tests.test_serve_flags import serve_parser  # TP x EP with chained MTP drafts: accepted (test_deepseek_ep)

    mtp3 = json.dumps({"method": "mtp", "num_speculative_tokens": 3})
    flags = serve_parser().parse_args(["--model", str(checkpoints["deepseek-v3"]), "--tensor-parallel-size", "2",
                                       "--data-parallel-size", "2", "--enable-expert-parallel",
                                       "--speculative-config", mtp3])
    assert EngineConfig.from_args(flags).speculative().num_speculative_tokens == 3
    with pytest.raises(ValueError, match="tp_kv_transfer must be one of staging, direct"):
        EngineConfig(tensor_parallel_size=2, tp_kv_transfer="zero-copy")
    with pytest.raises(ValueError, match="tp_communicator must be one of shm, gloo"):
        EngineConfig(tensor_parallel_size=2, tp_communicator="nccl")
    # replicated KV heads: the one each worker's query heads read (GQA groups of 2 query heads)
    splits = [TPSplit(r, 4, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=301) for r in range(4)]
    assert [list(s.q_heads()) for s in splits] == [[0], [1], [2], [3]]
    assert [list(s.kv_heads()) for s in splits] == [[0], [0], [1], [1]]
    assert [s.vocab_start for s in splits] == [0, 76, 152, 228] and splits[0].vocab_rows == 76


@pytest.mark.unit
@pytest.mark.parametrize("n,kv_heads,dtype", [(2, 4, torch.float32), (4, 2, torch.float32),  # split, replicated
                                              (2, 4, torch.float8_e4m3fn)])  # --kv-cache-dtype fp8: a byte a value
def test_pd_staging_gathers_and_scatters_every_worker_slice(n, kv_heads, dtype):
    """atomd/engine/tp_pd.py against a full-heads reference: P's gather makes the TP=1 block,
    D's scatter gives every worker (each replica) its heads."""
    from atomd.engine.kv_cache import kv_dtype_name
    from atomd.engine.tp_pd import TPKVStaging
    from atomd.model.tp_split import TPSplit

    full = torch.randn(3, 2, 2, 4, kv_heads, 8).to(dtype).view(torch.uint8 if dtype.itemsize == 1 else dtype)
    heads = [TPSplit(w, n, 4, kv_heads, 8, 100).kv_heads() for w in range(n)]
    kv_all = torch.stack([full[..., h.start:h.stop, :] for h in heads]).contiguous()
    staging = TPKVStaging(kv_all.view(dtype), kv_heads, kv_dtype_name(dtype))
    staging.gather([0, 2])
    rows = torch.from_numpy(staging.blocks).view(full.dtype).view(full.shape)
    assert torch.equal(rows[[0, 2]], full[[0, 2]]) and not rows[1].any()
    want = kv_all.clone()
    kv_all.zero_()
    staging.scatter([0, 2])
    assert torch.equal(kv_all[:, [0, 2]], want[:, [0, 2]]) and not kv_all[:, 1].any()


@pytest.mark.unit
@pytest.mark.parametrize("kind", [k for k in [*FAMILIES, *DEEPSEEK] if k != "llama"] + ["llama"])  # llama's: LoRA's next
def test_tp2_greedy_equals_tp1_and_hf(kind, checkpoints, tp2_engines):
    """Mixed lengths (one token .. many blocks, a batch, then batch-1 decode alone); prompt logits
    within 1e-4 of HF's (test_models' bound for TP=1)."""
    path = checkpoints[kind]
    prompts = prompts_of(MIXED, seed=4)
    one = engine_greedy(tp_llm(path, 1), prompts, GREEDY)
    tp = tp2_engines(kind)
    two = engine_greedy(tp, prompts, GREEDY)
    assert two == one
    assert engine_greedy(tp, prompts[2:3], GREEDY) == one[2:3]
    assert_equals_hf(path, prompts, two, n=GREEDY.max_tokens)
    if "speculative_config" in TP2_FLAGS.get(kind, {}):
        assert tp.engine.scheduler.spec_stats.num_draft_tokens > 0
    fresh = prompts_of([2 * BLOCK + 5], seed=14)[0]  # in no prefix cache: every position computed
    with torch.inference_mode():
        torch.testing.assert_close(_prompt_logits(tp, fresh), hf_model(path)(torch.tensor([fresh])).logits[0],
                                   atol=1e-4, rtol=0)
    assert tp.engine.stats()["tensor_parallel"]["size"] == 2
    if kind != "llama":  # llama's serves the LoRA test next
        tp2_engines.done(kind)


@pytest.mark.unit
def test_tp2_lora_equals_peft(checkpoints, tp2_engines, llama_adapters):
    """PEFT adapters under TP=2 (tensor_parallel.shard_adapter): a batch mixing two adapters (every
    target kind; attention only) and the base model, then a third adapter that evicts one (max_loras 2)
    on rank 0 and on the worker: each request's greedy ids equal transformers + PeftModel's."""
    from tests.test_lora import reference

    base, adapters = checkpoints["llama"], llama_adapters
    tp = tp2_engines("llama")
    for names, lengths in ((["sql", None, "attn"], [5, 37, 1]), (["poet"], [20])):
        if "poet" in names:  # loaded while serving (as POST /v1/load_lora_adapter does): evicts one
            tp.engine.loras.add("poet", str(adapters["poet"]))
        prompts = prompts_of(lengths, seed=len(names))
        outs = tp.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_name=names)
        for prompt, name, out in zip(prompts, names, outs):
            assert out.outputs[0].token_ids == reference(base, adapters.get(name), prompt, tokens=GREEDY.max_tokens), \
                (name, len(prompt))
    tp2_engines.done("llama")


# e2e: one of the longest multi-process runs (`make e2e`), kept out of make test's 10 minutes
@pytest.mark.e2e
@pytest.mark.unit
def test_kv_heads_replicated_tp4_chunked_prefix_hits_and_ngram_drafts(checkpoints, closing):
    """N = 4 > 2 KV heads (each replicated on two workers); chunked prefill, prefix-cache hits
    and speculative verify rows on the same workers."""
    path = checkpoints["qwen3"]
    tp = tp_llm(path, 4, max_num_batched_tokens=BLOCK,
                speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    closing(tp)
    shared = prompts_of([3 * BLOCK], seed=5)[0]
    prompts = [shared + tail for tail in prompts_of([5, 1], seed=6)] + [prompts_of([12], seed=8)[0] * 4]
    first = engine_greedy(tp, prompts, GREEDY)
    assert engine_greedy(tp, prompts, GREEDY) == first  # the second run reads the shared blocks
    assert tp.engine.stats()["prefix_cache_hits"] >= 2 * 3 * BLOCK
    assert_equals_hf(path, prompts, first, n=GREEDY.max_tokens)


@pytest.mark.unit
# (llama's and qwen2's checkpoints here: HF's own bf16 leaves its fp32 within 6 tokens, too few to compare.)
# TP=2 equals TP=1 in bf16: each worker's o / down partial stays float32 into the all-reduce, rounded once
# after it (DecoderModel.row_parallel; phi3's 21-token prompt left TP=1 at token 13 when the partials were
# rounded to bf16), and an MoE block all-reduces each (token, expert) pair's float32 down partial before
# TP=1's rounding and routing weight (moe.moe_tp; the block's bf16 output partials left TP=1 at token 8
# of mixtral's first prompt and in qwen3_moe's third). DeepSeek: o_proj's, the dense MLP's and the shared
# experts' down partials float32 too, the routed pairs' and the shared experts' in one all-reduce (its
# bf16 partials left TP=1 at token 9 of deepseek-v3's second prompt).
@pytest.mark.parametrize("kind", ["phi3", "qwen3", "gemma3", "mixtral", "qwen3_moe", "deepseek-v3"])
def test_tp2_bf16_greedy_follows_hf_bf16_and_equals_tp1(kind, checkpoints, closing):
    path = checkpoints[kind]
    tp = tp_llm(path, 2, dtype="bfloat16")
    closing(tp)
    prompts = prompts_of([BLOCK + 5, 40, 21], seed=11)
    two = engine_greedy(tp, prompts, GREEDY)
    assert two == engine_greedy(tp_llm(path, 1, dtype="bfloat16"), prompts, GREEDY)
    assert_greedy_follows_hf_bf16(hf_both(path), prompts, two, n=GREEDY.max_tokens, min_compared=8)


# ---------------------------------------------------------------- a worker dies under `atomd serve`

def _post(url: str, body: dict, timeout_s: float) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    conn = HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def _gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still alive after `timeout_s` (polled)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if _pid_alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


# e2e: one of the longest multi-process runs (`make e2e`), kept out of make test's 10 minutes
@pytest.mark.e2e
@pytest.mark.integration
def test_killed_worker_fails_the_engine_cleanly(checkpoints, tmp_path):
    timeout_s = 3.0
    server = start_server(checkpoints["llama"], "--tensor-parallel-size", "4", "--tp-collective-timeout-s",
                          str(timeout_s), "--max-model-len", "512", log_path=tmp_path / "serve.log")
    try:
        core = server.engine_pid()
        workers = server.stats()["tensor_parallel"]["worker_pids"]
        assert len(workers) == 3
        model = json.loads(http("GET", server.url + "/v1/models")[1])
        body = {"model": model["data"][0]["id"], "prompt": "def main():", "max_tokens": 480,
                "temperature": 0, "ignore_eos": True}
        answers: list[tuple[int, dict]] = []
        threads = [threading.Thread(target=lambda: answers.append(_post(server.url, body, 120))) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while server.stats()["num_running"] < 2:  # both mid-generation
            assert time.monotonic() < deadline, "the requests never ran"
            time.sleep(0.02)
        os.kill(workers[1], signal.SIGKILL)
        for t in threads:
            t.join(60)  # a hang check: the step's collective gives up after timeout_s
        assert not any(t.is_alive() for t in threads), "a request hung after its TP worker died"
        assert len(answers) == 2
        for status, answer in answers:
            assert status == 503 and "engine" in answer["error"]["message"], (status, answer)
        status, health = http("GET", server.url + "/health")
        assert status == 503, health
        assert _gone([core, *workers], 30) == [], "engine core or TP workers left behind"
        assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"atomd-tp-kv-{core}-")]
    finally:
        server.stop()


@pytest.mark.integration
@pytest.mark.e2e  # make e2e: 2 DP ranks x 2 TP workers served (~20 s of a worker), out of make test's 10 min
def test_dp2_x_tp2_serve_equals_one_process(tmp_path):
    """`atomd serve --data-parallel-size 2 --tensor-parallel-size 2` (two engine cores, each rank 0
    of its own two workers) on the built-in model: each DP rank's greedy text equals one process's."""
    prompts = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].text for o in LLM(None, num_threads=1, max_model_len=256).generate(prompts, params)]
    server = start_server(None, "--data-parallel-size", "2", "--tensor-parallel-size", "2",
                          log_path=tmp_path / "serve.log")
    try:
        ranks = server.stats()["ranks"]
        assert [len(r["tensor_parallel"]["worker_pids"]) for r in ranks] == [1, 1]
        model = json.loads(http("GET", server.url + "/v1/models")[1])["data"][0]["id"]
        for rank in (0, 1):
            for prompt, text in zip(prompts, want):
                status, answer = _post(server.url, {"model": model, "prompt": prompt, "max_tokens": 24,
                                                    "temperature": 0, "ignore_eos": True,
                                                    "data_parallel_rank": rank}, 60)
                assert status == 200 and answer["choices"][0]["text"] == text, (rank, prompt, answer)
        # a worker of an idle engine dies: the core finds out by itself (no request needed)
        worker = ranks[1]["tensor_parallel"]["worker_pids"][0]
        core = int(pathlib.Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[1])  # its parent
        assert core in server.engine_pids()
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while http("GET", server.url + "/health")[0] != 503:
            assert time.monotonic() < deadline, "/health still 200 after a TP worker of an idle engine died"
            time.sleep(0.05)
        assert _gone([worker, core], 30) == []
    finally:
        server.stop()


@pytest.mark.unit
def test_a_worker_that_dies_loading_fails_the_start_at_once(checkpoints, tmp_path):
    """A worker exits before the join (here: its checkpoint directory is gone): rank 0's start
    raises naming the rank and exit code, instead of waiting out the join timeout; nothing is left."""
    from atomd.engine.tp_workers import TPWorkers
    from atomd.model.loader import read_config, tp_split

    config = EngineConfig(model=str(checkpoints["llama"]), num_threads=1, tensor_parallel_size=2)
    workers = TPWorkers(config, tmp_path / "missing", (4, 2, 2, BLOCK, 1, 16), torch.float32)
    try:
        with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) exited with code 1 while loading"):
            workers.join(tp_split(read_config(checkpoints["llama"]), 0, 2))
        assert not os.path.exists(workers.kv_path)
    finally:
        pids = workers.pids
        workers.close()
    assert _gone(pids, 10) == []


# ---------------------------------------------------------------- PD with different TP sizes

@pytest.fixture(scope="module")
def hetero_pd():
    """P TP=1 -> D TP=2 and P TP=2 -> D TP=1 behind two routers (built-in model: 8 query / 4 KV
    heads), the second pair over fp8 KV caches (P's staging gathers and D's pull moves a byte a
    value); the colocated reference is the pair's D asked directly (a request without
    kv_transfer_params runs its whole prompt there)."""
    from tests.pd_fixtures import PDCluster

    cluster = PDCluster()
    try:
        tp2, fp8, direct = ["--tensor-parallel-size", "2"], ["--kv-cache-dtype", "fp8"], ["--tp-kv-transfer", "direct"]
        cluster.start_engines(P1=["--kv-role", "producer"], D2=[*tp2, "--kv-role", "consumer"],
                              P2=[*tp2, *fp8, "--kv-role", "producer"], D1=[*fp8, "--kv-role", "consumer"],
                              P2d=[*tp2, *direct, "--kv-role", "producer"], D2d=[*tp2, *direct, "--kv-role", "consumer"])
        cluster.routers_by_pair = {pair: cluster.start_router(*pair.split("->"))
                                   for pair in ("P1->D2", "P2->D1", "P2d->D2d", "P2d->D2")}
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.integration
@pytest.mark.e2e  # make e2e: PD pairs across TP sizes (~20-45 s of a worker), out of make test's 10 min
@pytest.mark.parametrize("pair", ["P1->D2", "P2->D1", "P2d->D2d"])
def test_pd_with_different_tp_sizes_equals_colocated(hetero_pd, pair):
    """P2d->D2d: TP=2 on both sides with --tp-kv-transfer direct: each worker's slices sent and pulled
    as they lie (no staging copy on either side: kv_staging_bytes 0 where the staging pairs count theirs)."""
    prompts = ["def fibonacci(n):\n    " * 6, "import os\nimport sys\n\nclass Stack:\n    def"]  # several blocks
    ref = hetero_pd[pair.split("->")[0]]  # the pair's P asked directly: its D pulls every block, none cached
    model = json.loads(http("GET", ref.url + "/v1/models")[1])["data"][0]["id"]
    router = hetero_pd.routers_by_pair[pair]
    for prompt in prompts:
        body = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        status, want = _post(ref.url, body, 60)
        assert status == 200, want
        status, got = _post(router.url, body, 60)
        assert status == 200 and got["choices"][0]["text"] == want["choices"][0]["text"], (pair, got, want)
    producer, consumer = (hetero_pd[name].stats() for name in pair.split("->"))
    decode = consumer["kv_transfer"]
    assert decode["fallbacks"] == {} and decode["bytes"] > 0 and not decode["failures"], decode  # pulled, not recomputed
    staged = [s["tensor_parallel"]["kv_staging_bytes"] for s in (producer, consumer) if "tensor_parallel" in s]
    assert all(n == 0 for n in staged) if pair == "P2d->D2d" else all(n > 0 for n in staged), staged


@pytest.mark.integration
def test_direct_slices_to_a_staging_consumer_are_refused_before_any_byte(hetero_pd):
    """A --tp-kv-transfer direct P (TP=2 slices on the wire) and a staging D (TP=2, the TP=1 layout on
    the wire): D refuses P's params by their fingerprint before it connects (its 503 kv_transfer_failed,
    the router's 502, as any compat mismatch; the message naming both TP sizes: tests/test_kv_layout.py);
    nothing is pulled. (After the pairs above: D2's
    failures count this one.)"""
    d2 = hetero_pd["D2"]
    before = d2.stats()["kv_transfer"]
    model = json.loads(http("GET", d2.url + "/v1/models")[1])["data"][0]["id"]
    body = {"model": model, "prompt": "def fibonacci(n):\n    " * 6, "max_tokens": 4, "temperature": 0}
    status, err = _post(hetero_pd.routers_by_pair["P2d->D2"].url, body, 60)
    assert status == 502 and "answered 503: kv_transfer_failed" in err["error"]["message"], (status, err)  # D's 503
    after = d2.stats()["kv_transfer"]
    assert after["failures"].get("compat_mismatch", 0) == before["failures"].get("compat_mismatch", 0) + 1, after
    assert after["bytes"] == before["bytes"]



@pytest.fixture(scope="module")
def mla_direct_pd(checkpoints):
    """DeepSeek's MLA (one latent row a token, every TP worker caching all of it) with --tp-kv-transfer
    direct across TP sizes: P TP=1 -> D TP=2 direct and P TP=2 direct -> D TP=1, each behind a router."""
    from tests.pd_fixtures import PDCluster

    cluster = PDCluster(checkpoints["deepseek-v2-lite"])
    try:
        tp2d = ["--tensor-parallel-size", "2", "--tp-kv-transfer", "direct"]
        cluster.start_engines(P1=["--kv-role", "producer"], D2d=[*tp2d, "--kv-role", "consumer"],
                              P2d=[*tp2d, "--kv-role", "producer"], D1=["--kv-role", "consumer"])
        cluster.routers_by_pair = {pair: cluster.start_router(*pair.split("->")) for pair in ("P1->D2d", "P2d->D1")}
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.integration
@pytest.mark.e2e  # make e2e: PD pairs across TP sizes (~20-45 s of a worker), out of make test's 10 min
@pytest.mark.parametrize("pair", ["P1->D2d", "P2d->D1"])
def test_direct_pd_across_tp_sizes_equals_colocated(mla_direct_pd, pair):
    """Direct slices between different TP sizes where every worker holds as many KV heads (MLA's latent
    row): D pulls each block once into the worker first holding its heads and copies it to the worker
    replicating them when it lands (P1->D2d: the local copy's bytes are the pulled bytes); a TP=1 D
    pulls a direct P's worker-0 rows as its blocks. No staging on a direct side."""
    prompt = [t % 297 + 3 for t in prompts_of([3 * BLOCK + 5], seed=23)[0]]  # several blocks, the tokenizer's ids
    ref = mla_direct_pd[pair.split("->")[0]]  # the pair's P asked directly: its D pulls every block
    model = json.loads(http("GET", ref.url + "/v1/models")[1])["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    status, want = _post(ref.url, body, 60)
    assert status == 200, want
    status, got = _post(mla_direct_pd.routers_by_pair[pair].url, body, 60)
    assert status == 200 and got["choices"][0]["text"] == want["choices"][0]["text"], (pair, got, want)
    producer, consumer = (mla_direct_pd[name].stats() for name in pair.split("->"))
    pulled = consumer["kv_transfer"]
    assert pulled["fallbacks"] == {} and pulled["bytes"] > 0 and not pulled["failures"], pulled  # pulled, not recomputed
    if pair == "P1->D2d":
        assert consumer["tensor_parallel"]["kv_staging_bytes"] == pulled["bytes"]
    else:
        assert producer["tensor_parallel"]["kv_staging_bytes"] == 0
