"""DeepSeek V2 / V3 (atomd/model/deepseek.py, atomd/model/mla.py) against Hugging Face
transformers' DeepseekV2 / DeepseekV3 on tiny random checkpoints written by `save_pretrained`:
V2-Lite-shaped (no q_lora, a dense first layer, group_limited_greedy routing, yarn with
mscale / mscale_all_dim), V2 with q_lora, greedy routing and attention biases, V3-shaped
(q_lora, sigmoid noaux_tc grouped routing with a random correction bias, yarn, interleaved
RoPE) and V3 with rope_interleave off and every layer sparse (tests/families.py). And the absorbed MLA decode
against the naive up-projected attention on the same latent cache."""
from __future__ import annotations

import json
import pathlib
import shutil
import time

import pytest
import torch
import transformers

from atomd.config import cpu_flags
from atomd.engine.kv_cache import AttentionMetadata, KVCache
from atomd.kernels import native
from atomd.kernels.native import ISA_FLAGS, attention_kernels, mla_kernels
from atomd.llm import LLM
from atomd.model.deepseek import MLA_KV_LAYOUT_VERSION, DeepseekModel, DeepseekRouting
from atomd.model.loader import read_config
from atomd.model import mla
from atomd.model.mla import LatentUp, mla_decode, store_latent
from contracts.sampling import SamplingParams
from tests.cpu_builds import AVX512, ISAS, needs_avx512
from tests.families import DEEPSEEK, DEEPSEEK_COMMON, FAMILIES, YARN, make_deepseek, write_families
from tests.test_model_hf import BLOCK, assert_equals_hf, engine_greedy, prompts_of

pytestmark = pytest.mark.unit
torch.set_num_threads(1)

# the DeepSeek checkpoints of tests/families.py, by their short names ("v2-lite", "v3", ...); the
# prompt-logits and 48-token greedy checks every family shares are in tests/test_models.py
CASES = [name.removeprefix("deepseek-") for name in DEEPSEEK]
GREEDY48 = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, pathlib.Path]:
    return {name.removeprefix("deepseek-"): path for name, path in write_families(tmp_path_factory, DEEPSEEK).items()}


@pytest.mark.parametrize("name", CASES)
def test_layers_and_latent_cache_are_what_the_config_says(name, checkpoints):
    llm = LLM(str(checkpoints[name]), num_threads=1, max_model_len=128)
    model, cfg = llm.engine.model, llm.engine.model.config
    assert isinstance(model, DeepseekModel)
    assert tuple(i for i, w in enumerate(model.layers) if w.moe is not None) == FAMILIES[f"deepseek-{name}"].sparse == cfg.sparse_layers
    assert all((w.gate_up is None) == (w.moe is not None) for w in model.layers)
    assert all((w.q_b is not None) == (cfg.q_lora_rank is not None) for w in model.layers)
    # one latent row per token and layer: kv_lora_rank + qk_rope_head_dim values, no k / v heads
    cache = llm.engine.kv_cache
    assert cache.kv.shape[1:] == (cfg.num_layers, 1, BLOCK, 1, 32 + 8)
    assert cache.block_bytes == cfg.num_layers * BLOCK * (32 + 8) * 4
    assert llm.engine.compat["head_dim"] == 40 and llm.engine.compat["num_kv_heads"] == 1
    assert llm.engine.compat["version"] == MLA_KV_LAYOUT_VERSION
    # the absorbed decode's native kernel: heads of the latent's width, every query head on the one latent row
    kernels = llm.engine.runner.kernels
    assert kernels is None or (kernels.head_dim, kernels.group) == (40, 4)
    assert llm.engine.runner.workspace is None


@pytest.mark.parametrize("name,backend", [("v2-lite", "auto"), ("v3", "auto"), ("v3", "torch")])
def test_greedy_equals_hf_through_preemption_and_ngram_speculation(name, backend, checkpoints):
    """Drafts verified several rows a sequence: by the native decode kernel, or (torch) on the
    prefill path over the latent cache."""
    path = checkpoints[name]
    llm = LLM(str(path), num_threads=1, max_model_len=256, num_kvcache_blocks=9, attention_backend=backend)
    prompts = prompts_of([BLOCK + 10] * 6, seed=7)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert_equals_hf(path, prompts, engine_greedy(llm, prompts, params), n=12)
    assert llm.engine.stats()["num_preemptions"] > 0
    spec = LLM(str(path), num_threads=1, max_model_len=256, attention_backend=backend,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    prompts = [prompts_of([12], seed=8)[0] * 4, prompts_of([7], seed=9)[0]]
    assert_equals_hf(path, prompts, engine_greedy(spec, prompts, GREEDY48), n=48)
    assert spec.engine.stats()["spec_decode_num_accepted_tokens"] > 0


def test_refused_with_the_reason(tmp_path, checkpoints):
    bad = tmp_path / "bad"
    shutil.copytree(checkpoints["v2-lite"], bad)
    hf = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**hf, "topk_method": "noaux_tc"}))
    with pytest.raises(ValueError, match="topk_method 'noaux_tc' is not supported"):
        read_config(bad)
    (bad / "config.json").write_text(json.dumps({**hf, "topk_group": 5}))  # of 4 groups
    with pytest.raises(ValueError, match="topk_group=5.* do not make groups"):
        read_config(bad)
    with pytest.raises(ValueError, match="quantized weights are not supported for DeepSeek"):
        LLM(str(checkpoints["v2-lite"]), num_threads=1, max_model_len=64, quantization="int8")


# ---------------------------------------------------------------- the absorbed decode


def naive_attention(q: torch.Tensor, latent: torch.Tensor, kv_b: torch.Tensor, heads: int, nope: int, v: int,
                    rank: int, scale: float) -> torch.Tensor:
    """One query row q [heads, nope + rope] over latent rows [L, rank + rope], in float64: k and
    v up-projected per context token (transformers' expand_kv), then softmax attention."""
    kv = (latent[:, :rank].double() @ kv_b.double().T).view(-1, heads, nope + v)
    k = torch.cat([kv[..., :nope], latent[:, None, rank:].double().expand(-1, heads, -1)], dim=-1)
    probs = torch.softmax(torch.einsum("hd,lhd->hl", q.double(), k) * scale, dim=-1)
    return torch.einsum("hl,lhv->hv", probs, kv[..., nope:]).reshape(-1)


def latent_cache(lens: list[int], rank: int, rope: int, dtype: torch.dtype, layers: int, g: torch.Generator):
    """A latent cache with `layers` layers of random rows for sequences of `lens` tokens, each on
    scattered blocks (the padding of short tables on block 0): (cache, block tables, latents per layer)."""
    width = -(-max(lens) // BLOCK)
    cache = KVCache(len(lens) * width + 3, layers, BLOCK, 1, rank + rope, dtype, planes=1)
    order = torch.randperm(cache.num_blocks - 1, generator=g) + 1
    tables = torch.zeros(len(lens), width, dtype=torch.int64)
    for b, n in enumerate(lens):
        tables[b, :-(-n // BLOCK)] = order[b * width:b * width + -(-n // BLOCK)]
    positions = torch.cat([torch.arange(n) for n in lens])
    rows = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    meta = AttentionMetadata(True, tables[rows, positions // BLOCK], positions % BLOCK, [])
    latents = [torch.randn(sum(lens), rank + rope, generator=g).to(dtype) for _ in range(layers)]
    for layer in range(layers):
        store_latent(cache, layer, meta, latents[layer])
    return cache, tables, latents


def decode_meta(tables: torch.Tensor, lens: list[int], kernels, query_starts: torch.Tensor | None = None):
    context = torch.tensor(lens)
    return AttentionMetadata(False, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), [],
                             block_tables=tables, max_context=max(lens), context_lens=context, kernels=kernels,
                             query_starts=query_starts,
                             decode_mask=(torch.arange(max(lens)) < context[:, None])[:, None, None, :])


def kernels_for(isa: str, shape: tuple[int, int, int, int], heads: int):
    nope, rope, v, rank = shape
    kernels = attention_kernels(rank + rope, heads, isa)
    if kernels is None:
        pytest.fail(f"the attention kernels for d{rank + rope} g{heads} did not build under {isa}")
    if mla_kernels(rank, rope, nope, v, isa) is None:
        pytest.fail(f"the MLA decode kernel did not build under {isa}")
    return kernels


# (nope, rope, v, rank): dims the C kernel runs in plain C loops, and dims that are whole AVX-512
# vectors but v (its AVX-512 path where the CPU has it, with a partial block of 16 value rows)
MLA_SHAPES = {"odd": (16, 8, 12, 32), "vec": (32, 16, 20, 32)}


# torch's batched matmuls; the one-call C kernel (csrc/mla.c) under every narrowing; the
# attention kernel between torch's absorption matmuls (what an fp8 cache runs)
@pytest.mark.parametrize("path", ["torch", *ISAS, "attention-kernel"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("lens,heads,shape", [([1], 4, "odd"), ([5, 16, 17], 4, "odd"), ([40, 3, 33, 64], 4, "odd"),
                                              ([37], 20, "odd"), ([9, 50], 20, "odd"), ([1], 4, "vec"),
                                              ([40, 3, 33, 64, 7], 4, "vec"), ([9, 50], 20, "vec")])
def test_absorbed_decode_equals_the_up_projected_attention(lens, heads, shape, dtype, tol, path, monkeypatch):
    """Against float64 attention over k, v up-projected per token, and the C kernel against
    torch's absorbed path too. 20 heads: more than the kernel's 16 a work item, chunked unevenly;
    5 rows: a block of 4 and one more through the weights."""
    (nope, rope, v, rank), layers = MLA_SHAPES[shape], 2
    g = torch.Generator().manual_seed(sum(lens) + heads)
    cache, tables, latents = latent_cache(lens, rank, rope, dtype, layers, g)
    kernels = None if path == "torch" else kernels_for("native" if path == "attention-kernel" else path,
                                                       MLA_SHAPES[shape], heads)
    if path == "attention-kernel":
        monkeypatch.setattr(mla, "fused_decode_kernels", lambda *args: None)
    decode, torch_path = decode_meta(tables, lens, kernels), decode_meta(tables, lens, None)
    scale = 0.3
    for layer in range(layers):
        kv_b = (torch.randn(heads * (nope + v), rank, generator=g) * 0.2).to(dtype)
        q = torch.randn(len(lens), heads, nope + rope, generator=g).to(dtype)
        up = LatentUp.of(kv_b, heads, nope, v, pack=False)
        got = mla_decode(q, cache, layer, decode, up, scale)
        assert got.shape == (len(lens), heads * v) and got.dtype == dtype
        ends = torch.tensor(lens).cumsum(0)
        for b, n in enumerate(lens):
            want = naive_attention(q[b], latents[layer][ends[b] - n:ends[b]], kv_b, heads, nope, v, rank, scale)
            torch.testing.assert_close(got[b].double(), want, atol=tol, rtol=tol)
        if path in ISA_FLAGS:
            torch.testing.assert_close(got, mla_decode(q, cache, layer, torch_path, up, scale), atol=tol, rtol=tol)


@pytest.mark.parametrize("shape,group_rows", [("odd", mla.PREFILL_GROUP_ROWS), ("vec", mla.PREFILL_GROUP_ROWS),
                                              ("vec", 10)])
def test_prefill_batches_fresh_prompts_of_one_length(shape, group_rows, monkeypatch):
    """mla_prefill: consecutive fresh prompts of one length one up-projection and one batched SDPA
    (5, 5, 5; 5, 5 after a 7; a lone 1; with groups of at most 10 rows the first run cut into 5, 5
    and 5), a sequence with cached tokens (a 4-token chunk after 9, the step's first rows) alone:
    every row against float64 causal attention over its own sequence's up-projected latents."""
    from atomd.engine.kv_cache import SeqSlice
    from atomd.engine.runner import causal_mask

    monkeypatch.setattr(mla, "PREFILL_GROUP_ROWS", group_rows)
    sdpa, batches = mla.F.scaled_dot_product_attention, []
    monkeypatch.setattr(mla.F, "scaled_dot_product_attention",
                        lambda q, *a, **k: batches.append(q.shape[0]) or sdpa(q, *a, **k))

    (nope, rope, v, rank), heads, scale, dtype = MLA_SHAPES[shape], 4, 0.3, torch.float32
    lens, done = [13, 5, 5, 5, 7, 5, 5, 1], [9, 0, 0, 0, 0, 0, 0, 0]  # context lengths; tokens cached before
    g = torch.Generator().manual_seed(11)
    cache, tables, latents = latent_cache(lens, rank, rope, dtype, 1, g)
    ends = torch.tensor(lens).cumsum(0).tolist()
    rows = torch.cat([torch.arange(e - n + d, e) for n, d, e in zip(lens, done, ends)])  # the step's rows
    seqs, start = [], 0
    for b, (n, d) in enumerate(zip(lens, done)):
        ctx_blocks = tables[b, :-(-n // BLOCK)]
        seqs.append(SeqSlice(start, start + n - d, d, n, ctx_blocks if d else None, causal_mask(d, n) if d else None))
        start += n - d
    meta = AttentionMetadata(True, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), seqs)
    kv_b = (torch.randn(heads * (nope + v), rank, generator=g) * 0.2).to(dtype)
    q = torch.randn(len(rows), heads, nope + rope, generator=g).to(dtype)
    got = mla.mla_prefill(q, latents[0][rows], cache, 0, meta, LatentUp.of(kv_b, heads, nope, v, pack=False), scale)
    assert batches == ([1, 3, 1, 2, 1] if group_rows >= 15 else [1, 2, 1, 1, 2, 1])  # sequences an SDPA
    for s, n, d, e in zip(seqs, lens, done, ends):
        for i in range(s.end - s.start):
            want = naive_attention(q[s.start + i], latents[0][e - n:e - n + d + i + 1], kv_b, heads, nope, v, rank,
                                   scale)
            torch.testing.assert_close(got[s.start + i].double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", MLA_SHAPES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_absorbed_decode_kernel_verifies_drafts_causally(dtype, tol, shape, isa, monkeypatch):
    """Several query rows a sequence (its last token and its drafts, meta.query_starts): row j of
    a sequence of n tokens with k rows sees its first n - (k - 1 - j) tokens. On 3 threads (the
    count the C call is given): heads split into chunks, rows and heads shared out."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    (nope, rope, v, rank), heads, lens, runs = MLA_SHAPES[shape], 4, [20, 4, 35], [3, 1, 4]
    g = torch.Generator().manual_seed(5)
    cache, tables, latents = latent_cache(lens, rank, rope, dtype, 1, g)
    starts = torch.tensor([0, *runs]).cumsum(0)
    decode = decode_meta(tables, lens, kernels_for(isa, MLA_SHAPES[shape], heads), starts)
    kv_b = (torch.randn(heads * (nope + v), rank, generator=g) * 0.2).to(dtype)
    q = torch.randn(sum(runs), heads, nope + rope, generator=g).to(dtype)
    got = mla_decode(q, cache, 0, decode, LatentUp.of(kv_b, heads, nope, v, pack=False), 0.3)
    ends = torch.tensor(lens).cumsum(0)
    for b, (n, k) in enumerate(zip(lens, runs)):
        for j in range(k):
            seen = latents[0][ends[b] - n:ends[b] - (k - 1 - j)]
            want = naive_attention(q[starts[b] + j], seen, kv_b, heads, nope, v, rank, 0.3)
            torch.testing.assert_close(got[starts[b] + j].double(), want, atol=tol, rtol=tol)


# (nope, rope, v, rank) of the AMX tile path (csrc/mla.c MLA_AMX: nope and rank whole tiles of 32,
# v whole tiles of 16: 48 leaves an odd block of 16 value rows)
TILE_SHAPE = (64, 32, 48, 64)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("lens,heads,runs", [([9] * 4, 16, None), ([5, 16, 17] * 6 + [3], 20, None),
                                             ([30, 1, 17, 64, 40] * 8, 3, None), ([20, 4, 35, 18], 16, [3, 1, 4, 9])])
def test_absorbed_decode_on_amx_tiles(lens, heads, runs, isa, monkeypatch):
    """bf16 blocks of 4 or more query rows (one block of 16, 19 rows and 20 heads: a full block
    and a partial one, 40 rows: past the 32 a pass over the weights, drafts of 1-9 rows a
    sequence): the tile path (on AMX CPUs under the native build) against float64 attention over
    up-projected k, v and against the kernel's AVX-512 path on the same inputs. The kernel reports
    the tiles where the CPU has them and the build keeps them, and the switch turns them off. On
    3 threads (each configures its own tiles and runs all three phases for its share of the heads),
    bit-equal to one thread."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    (nope, rope, v, rank), dtype, scale = TILE_SHAPE, torch.bfloat16, 0.3
    g = torch.Generator().manual_seed(len(lens) + heads)
    cache, tables, latents = latent_cache(lens, rank, rope, dtype, 1, g)
    starts = None if runs is None else torch.tensor([0, *runs]).cumsum(0)
    lib = mla_kernels(rank, rope, nope, v, isa)
    kv_b = (torch.randn(heads * (nope + v), rank, generator=g) * 0.2).to(dtype)
    q = torch.randn(len(lens) if runs is None else sum(runs), heads, nope + rope, generator=g).to(dtype)
    up = LatentUp.of(kv_b, heads, nope, v, pack=False)
    tiles = isa == "native" and {"amx_tile", "amx_bf16"} <= cpu_flags()

    def decode():
        return native.mla_decode(lib, q, up.uk_t, up.uv, cache, 0, tables, torch.tensor(lens), starts, scale)

    try:
        assert native.mla_amx(lib, True) == tiles
        got = decode()
        monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # every head on one thread, 16 a pass
        assert torch.equal(decode(), got)  # the heads' shares (3 threads: 8 or fewer a pass) change no bit
        monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
        assert not native.mla_amx(lib, False)
        avx512 = decode()
    finally:
        native.mla_amx(lib, True)
    ends = torch.tensor(lens).cumsum(0)
    for b, n in enumerate(lens):
        for j in range(1 if runs is None else runs[b]):
            k = 1 if runs is None else runs[b]
            row = b if runs is None else starts[b] + j
            want = naive_attention(q[row], latents[0][ends[b] - n:ends[b] - (k - 1 - j)], kv_b, heads, nope, v, rank,
                                   scale)
            torch.testing.assert_close(got[row].double(), want, atol=3e-2, rtol=3e-2)
    # the same bf16 products in another order: the outputs at most a bf16 rounding or two apart
    torch.testing.assert_close(got, avx512, atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------- routing


@pytest.mark.parametrize("config_class,extra", [
    ("DeepseekV3Config", dict(n_group=4, topk_group=2, norm_topk_prob=True)),
    ("DeepseekV3Config", dict(n_group=2, topk_group=1, norm_topk_prob=False)),
    ("DeepseekV2Config", dict(n_group=4, topk_group=2, topk_method="group_limited_greedy")),
    ("DeepseekV2Config", dict(topk_method="greedy"))])
def test_routing_equals_transformers_router(config_class, extra):
    """DeepseekRouting against transformers' TopkRouter on 200 random tokens: the same experts, weights."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf_config = getattr(transformers, config_class)(**{**DEEPSEEK_COMMON, **extra})
    v3 = config_class == "DeepseekV3Config"
    hf = (DeepseekV3TopkRouter if v3 else DeepseekV2TopkRouter)(hf_config)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hf.weight.shape, generator=g))
        if v3:
            hf.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.2)
    arch = "DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"
    cfg = DeepseekModel.config_from_hf(hf_config.to_dict(), arch)
    ours = DeepseekRouting(hf.weight.detach().clone(), hf.e_score_correction_bias.clone() if v3 else None, cfg)
    h = torch.randn(200, 64, generator=g)
    weights, ids = ours(h)
    with torch.no_grad():
        _, want_weights, want_ids = hf(h)
    order, want_order = ids.argsort(dim=1), want_ids.argsort(dim=1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order), atol=1e-6, rtol=1e-6)


def assert_bf16_as_close_as_hf_bf16(path: pathlib.Path, prompts: list[list[int]], batch: bool) -> None:
    """The engine's bf16 logprobs of its greedy tokens (the first from the prefill, 23 from the
    absorbed decode; the prompts one at a time, or in one generate call when batch) are, for nine
    in ten of them at least, as close to HF's float32 ones as HF's own bfloat16 run is."""
    hf = {dtype: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
          for dtype in (torch.float32, torch.bfloat16)}
    llm = LLM(str(path), num_threads=1, max_model_len=256, dtype="bfloat16")
    assert llm.engine.kv_cache.kv.dtype == torch.bfloat16
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    requests = [{"prompt_token_ids": prompt} for prompt in prompts]
    outs = llm.generate(requests, params) if batch else [llm.generate([r], params)[0] for r in requests]
    for prompt, out in zip(prompts, (o.outputs[0] for o in outs)):
        ours = torch.tensor([lp.logprob for lp in out.logprobs])
        rows, ids = torch.arange(len(prompt) - 1, len(prompt) + 23), torch.tensor(out.token_ids)
        with torch.inference_mode():
            ref = {dtype: torch.log_softmax(m(torch.tensor([prompt + out.token_ids])).logits[0].float(), -1)[rows, ids]
                   for dtype, m in hf.items()}
        hf_error = (ref[torch.bfloat16] - ref[torch.float32]).abs().max()
        within = (ours - ref[torch.float32]).abs() <= 1.5 * hf_error + 0.02
        # all but a token in ten: a bf16 rounding of a router input can flip one token's expert
        # (met once, torch ops without the C kernels: 0.94 off at one of 24, the rest <= 0.03)
        assert within.float().mean() >= 0.9, (len(prompt), hf_error, ours - ref[torch.float32])


@pytest.mark.parametrize("name", ["v2-lite", "v3"])
def test_bf16_is_as_close_to_float32_as_hf_bf16(name, checkpoints):
    """bfloat16 weights, latent cache and activations (routing in float32, as transformers), one
    sequence at a time. (Greedy ids themselves are no test in bf16 here: random tiny routers flip
    experts on a bf16 rounding, HF's own bf16 leaves its float32 ids within a few tokens.)"""
    assert_bf16_as_close_as_hf_bf16(checkpoints[name], prompts_of([1, 5 * BLOCK + 3], seed=4), batch=False)


def test_bf16_batch_on_amx_tiles_is_as_close_to_float32_as_hf_bf16(tmp_path):
    """A V2-Lite-shaped checkpoint with head dims the kernel's AMX tile path takes (TILE_SHAPE's
    kind: nope, rope, rank 32, v 32), six prompts decoded as one batch: on an AMX CPU
    its bf16 decode runs csrc/mla.c's tiles (the kernel says so), as close to HF as above."""
    path = make_deepseek(tmp_path / "v2-lite-tiles", "DeepseekV2Config", 40, q_lora_rank=None, first_k_dense_replace=1,
                         topk_method="greedy", rope_parameters=YARN, qk_nope_head_dim=32, qk_rope_head_dim=32,
                         v_head_dim=32, kv_lora_rank=32)
    lib = mla_kernels(32, 32, 32, 32)
    assert native.mla_amx(lib, mla.AMX) == (mla.AMX and {"amx_tile", "amx_bf16"} <= cpu_flags())
    assert_bf16_as_close_as_hf_bf16(path, prompts_of([3, 9, BLOCK, 2 * BLOCK + 5, 20, 7], seed=6), batch=True)


def test_kv_events_name_the_latent_blocks_by_their_tokens(request, checkpoints):
    """KV events are the prefix cache's, whatever a block holds: a DeepSeek engine publishes
    BlockStored for a prompt's full latent blocks under the documented hash chain."""
    from contracts.block_hash import block_hashes
    from tests.test_kv_events import Sub, tcp

    llm = LLM(str(checkpoints["v3"]), num_threads=1, max_model_len=128, num_kvcache_blocks=12,
              kv_events_endpoint=tcp(), kv_events_replay_endpoint=tcp(), kv_events_topic="atomd")
    request.addfinalizer(llm.engine.close)
    pub = llm.engine.kv_events
    sub = Sub(pub)
    request.addfinalizer(sub.close)
    ids = list(range(10, 50))  # 2 full blocks and a partial one
    llm.engine.add_request("a", ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    llm.engine.step()  # the prefill's forward: its full blocks are indexed, then published
    deadline = time.monotonic() + 10
    while pub.num_published < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    (event,) = sub.replay(1)[0][1].events
    assert event.block_hashes == block_hashes(ids, BLOCK) and event.token_ids == ids[:2 * BLOCK]


# ---------------------------------------------------------------- the batch-1 C layer


@needs_avx512("deepseek.MlaDecodeLayers (the batch-1 C layer)")
@pytest.mark.parametrize("name,dtype,threads", [("v2-lite", "float32", 1), ("v2-lite", "bfloat16", 2),
                                                ("v3", "float32", 3), ("v3", "bfloat16", 1),
                                                ("v3-halves-all-sparse", "bfloat16", 2)])
def test_batch1_c_layer_equals_the_per_op_layer(name, dtype, threads, checkpoints, monkeypatch):
    """deepseek.MlaDecodeLayers (atomd_mla_head, mla.c, atomd_mla_tail) against the per-op layer
    in the same engine: the same greedy ids, the same logprobs (bf16 to the bit; float32 within
    the router's summation order), the same expert load counters; the C layer ran every decode
    step (the prompt's step is the per-op path's). Threads: the tail's experts a thread each (1,
    2) and with more threads than a layer has experts to spare (3)."""
    from atomd.model import deepseek

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # the C calls' thread count
    # no prefix cache: both runs compute every prompt token (the load counters count them)
    llm = LLM(str(checkpoints[name]), num_threads=1, max_model_len=128, dtype=dtype, enable_prefix_caching=False)
    model = llm.engine.model
    assert model.batch1 is not None
    ran = []
    monkeypatch.setattr(deepseek.MlaDecodeLayers, "__call__",
                        lambda self, *a, f=deepseek.MlaDecodeLayers.__call__: ran.append(1) or f(self, *a))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    got = runs_switched(model, monkeypatch, "FUSED", lambda: [
        llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0]
        for p in prompts_of([1, 2 * BLOCK + 3], seed=5)])
    assert len(ran) == 22  # 11 decode steps a prompt in the C layer's run, none in the per-op one
    assert got[True][0] == got[False][0]
    tol = 0.0 if dtype == "bfloat16" else 1e-5
    torch.testing.assert_close(got[True][1], got[False][1], atol=tol, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(got[True][2], got[False][2]))


def runs_switched(model, monkeypatch, switch: str, generate) -> dict[bool, tuple]:
    """With atomd.model.deepseek's `switch` on, then off: (greedy ids, logprobs, the expert load counters
    from zero) of generate()'s completions."""
    from atomd.model import deepseek

    got = {}
    for on in (True, False):
        monkeypatch.setattr(deepseek, switch, on)
        for w in model.layers:
            if w.moe is not None:
                w.moe.routed.zero_()
        outs = generate()
        got[on] = ([o.token_ids for o in outs], torch.tensor([[lp.logprob for lp in o.logprobs] for o in outs]),
                   [w.moe.routed.clone() for w in model.layers if w.moe is not None])
    return got


def test_batch1_c_layer_not_taken_where_it_does_not_run(checkpoints):
    """Attention biases (V2 with attention_bias): the per-op layer, still HF's greedy ids."""
    path = checkpoints["v2-qlora-bias"]
    llm = LLM(str(path), num_threads=1, max_model_len=128)
    assert llm.engine.model.batch1 is None
    prompts = prompts_of([9], seed=6)
    assert_equals_hf(path, prompts, engine_greedy(llm, prompts))


@needs_avx512("deepseek.MlaDecodeLayers (the batch-1 C layer)")
@pytest.mark.parametrize("name,dtype", [("v2-lite", "float32"), ("v3", "bfloat16")])
def test_batch1_c_layer_verifies_drafts(name, dtype, checkpoints, monkeypatch):
    """A verify step of one sequence (its token and n-gram drafts, up to 4 rows, causal) through
    the C layer: the same greedy ids as the per-op layer (float32: HF's), drafts accepted; and each
    verify row whose token and earlier drafts were kept leaves the state that row got decoded alone,
    to the bit (two rows share each load of a weight row, and of an expert both are routed to)."""
    from atomd.model import deepseek

    path = checkpoints[name]
    llm = LLM(str(path), num_threads=1, max_model_len=256, dtype=dtype, enable_prefix_caching=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    calls = []  # (positions, input rows, output rows) of each C layer call

    def record(self, x, h, positions, *a, f=deepseek.MlaDecodeLayers.__call__):
        before = x.clone()
        f(self, x, h, positions, *a)
        calls.append((positions.tolist(), before, x.clone()))
    monkeypatch.setattr(deepseek.MlaDecodeLayers, "__call__", record)
    prompt = prompts_of([12], seed=8)[0] * 4
    got = {}
    for fused in (True, False):
        monkeypatch.setattr(deepseek, "FUSED", fused)
        got[fused] = engine_greedy(llm, [prompt], GREEDY48)
    assert got[True] == got[False]
    assert max(len(c[0]) for c in calls) > 1 and llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0
    if dtype == "float32":
        assert_equals_hf(path, [prompt], got[True], n=48)
    verify, calls[:] = list(calls), []
    monkeypatch.setattr(deepseek, "FUSED", True)
    assert engine_greedy(LLM(str(path), num_threads=1, max_model_len=256, dtype=dtype, enable_prefix_caching=False),
                         [prompt], GREEDY48) == got[True]
    alone = {p[0]: out[0] for p, _, out in calls}  # one row a step: position -> its output state
    assert len(alone) == 47
    embed, final = llm.engine.model.embed, prompt + got[True][0]
    compared = 0
    for positions, before, out in verify:
        for r, p in enumerate(positions):
            if p >= len(final) - 1 or not torch.equal(before[r], embed[final[p]]):
                break  # this row's token (a draft) was rejected: the rows after it are not the sequence's
            assert torch.equal(out[r], alone[p]), (positions, r)
            compared += 1
    assert compared == 47 and len(verify) < 47  # every decoded token, in fewer steps


# ---------------------------------------------------------------- a decode batch's C glue


@pytest.mark.parametrize("name,dtype,threads,isa", [
    ("v2-lite", "bfloat16", 2, "native"), ("v3", "bfloat16", 1, "native"), ("v3-halves-all-sparse", "bfloat16", 3, "native"),
    ("v2-lite", "bfloat16", 2, "no-amx"), ("v2-lite", "float32", 2, "no-bf16-dot"), ("v3", "float32", 1, "no-avx512")])
def test_decode_batch_c_glue_equals_the_per_op_layer(name, dtype, threads, isa, checkpoints, monkeypatch):
    """deepseek.MlaRows (atomd_mla_rows_head between the projections and the absorbed decode;
    atomd_mla_rows_moe_bf16: router, pair sort, AMX experts, the pairs' sum, the shared experts on
    the tiles too) against the per-op
    glue in the same engine, five sequences decoded as one batch: the same greedy ids, the same
    expert load counters (the same experts chosen), the same logprobs up to float32 operation order
    (the router's sums, V3's weight normalisation, RoPE's products: bf16 1e-4, float32 1e-5, the
    batch-1 layer's bounds); the C head ran in every step's every layer (the prompts' too), the C
    experts in every decode step's sparse layers where AMX runs them. Under every ISA narrowing: without AVX-512 (no batch-1 layer kernels) it is not taken."""
    from atomd.model import deepseek, layer_ops

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # the C calls' thread count
    monkeypatch.setenv("ATOMD_KERNEL_ISA", isa)  # every kernel of the engine narrowed
    llm = LLM(str(checkpoints[name]), num_threads=1, max_model_len=128, dtype=dtype, enable_prefix_caching=False)
    model = llm.engine.model
    calls = {"head": 0, "moe": 0}

    def counted(kind):
        f = getattr(deepseek.MlaRows, kind)
        return lambda self, *a: calls.__setitem__(kind, calls[kind] + 1) or f(self, *a)
    monkeypatch.setattr(deepseek.MlaRows, "head", counted("head"))
    moe_rows = deepseek.MlaRows.moe
    monkeypatch.setattr(deepseek.MlaRows, "moe",
                        lambda self, *a: (lambda out: calls.__setitem__("moe", calls["moe"] + (out is not None))
                                          or out)(moe_rows(self, *a)))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    requests = [{"prompt_token_ids": p} for p in prompts_of([1, 4, BLOCK + 2, 2 * BLOCK + 3, 7], seed=7)]
    got = runs_switched(model, monkeypatch, "ROWS",
                        lambda: [o.outputs[0] for o in llm.generate(requests, params, use_tqdm=False)])
    sparse, built = sum(w.moe is not None for w in model.layers), isa != "no-avx512" and AVX512
    assert (model.rows is not None) == built
    assert calls["head"] == (10 * len(model.layers) if built else 0)  # the prompts' step, 9 decode steps; none per-op
    amx = dtype == "bfloat16" and layer_ops.has_moe_amx()
    assert amx == (isa == "native" and dtype == "bfloat16" and {"amx_tile", "amx_bf16"} <= cpu_flags())
    assert calls["moe"] == (9 * sparse if amx else 0)
    if amx:  # the shared experts ran on the tiles in the same call
        assert len(model.rows.shared) == sparse and all(model.rows.shared.values())
    assert got[True][0] == got[False][0]
    torch.testing.assert_close(got[True][1], got[False][1], atol=1e-4 if dtype == "bfloat16" else 1e-5, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(got[True][2], got[False][2]))
