"""The C layer ops (atomd/kernels/csrc/layer_ops.c via atomd/model/layer_ops.py) against Hugging
Face's formulas written in torch, float32 and bfloat16, and the model's torch fallback
against the C path.

bfloat16: the kernels round where HF's bf16 modules round, so results are equal to HF's
except where float32 sums differ in order (RMSNorm's sum of squares): at most one bf16 ulp
there. float32: within a few float32 ulps (summation order, FMA contraction).
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

from atomd.config import cpu_flags
from atomd.kernels import cbuild
from atomd.model import layer_ops, quant
from tests.cpu_builds import AVX512, ISAS  # native: everything this CPU has; the others its fallbacks

DTYPES = [torch.float32, torch.bfloat16]




@pytest.fixture(autouse=True, params=ISAS)
def isa(request, monkeypatch):
    """Every test once per build: the ops as this CPU runs them, and the fallback code paths."""
    lib = layer_ops.build_kernels(request.param)
    assert lib is not None, "the layer-op kernels must build on the test machine"
    monkeypatch.setattr(layer_ops, "kernels", lambda: lib)
    # every other kernel (quant's per-op linears, attention) of the same build, as in a process narrowed so: a
    # comparison of the fused path with the per-op one then compares one build's code with itself
    monkeypatch.setenv(cbuild.ISA_ENV, request.param)
    return request.param


@pytest.fixture
def torch_ops(monkeypatch):
    """layer_ops with its kernels unavailable: the torch fallback."""
    monkeypatch.setattr(layer_ops, "kernels", lambda: None)


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def hf_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on x [T, heads, D] (cos, sin [T, D // 2] halves)."""
    cos, sin = torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((sin, sin), -1).unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def close(got: torch.Tensor, want: torch.Tensor, ulps: int = 1) -> None:
    if got.dtype == torch.bfloat16:  # ulps of bf16 at each value's magnitude
        tol = want.float().abs().clamp_min(1e-30) * 2.0 ** -7 * ulps
        assert ((got.float() - want.float()).abs() <= tol).all(), (got - want).abs().max()
    else:
        torch.testing.assert_close(got, want, rtol=4e-6, atol=4e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 600])  # 600: past the kernel's threshold for threads
def test_rms_norm_with_and_without_the_residual_add(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    hidden = 576
    base = torch.randn(rows, hidden + 8, generator=g).to(dtype)  # strided rows: a view of wider ones
    delta = torch.randn(rows, hidden, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    x, padding = base[:, :hidden], base[:, hidden:].clone()
    want_x = x + delta
    out = torch.empty(rows, hidden + 3, dtype=dtype)[:, :hidden]
    got = layer_ops.rms_norm(x, w, 1e-5, delta=delta, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(x, want_x)  # the residual add, rounded as torch's add rounds
    close(got, hf_rms_norm(want_x, w, 1e-5))
    assert torch.equal(base[:, hidden:], padding)  # the columns past the view untouched
    close(layer_ops.rms_norm(x, w, 1e-6), hf_rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,q_heads,kv_heads,head_dim", [(1, 4, 2, 64), (40, 16, 8, 128)])
def test_qk_norm_in_one_call_is_rms_norm_of_each_head(dtype, rows, q_heads, kv_heads, head_dim):
    """Qwen3's q / k norm in place in one C call (layer_ops.qk_norm_) equals rms_norm of the heads copied out (the
    per-part path, what ran before) to the bit, and HF's RMSNorm per head; the value heads untouched."""
    from atomd.model.attention import qk_norm_

    g = torch.Generator().manual_seed(rows)
    width = (q_heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(rows, width, generator=g).to(dtype)
    q_w, k_w = ((1 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype) for _ in range(2))
    want = qkv.clone()
    for part, w in ((slice(0, q_heads * head_dim), q_w), (slice(q_heads * head_dim, (q_heads + kv_heads) * head_dim), k_w)):
        want[:, part] = layer_ops.rms_norm(want[:, part].reshape(-1, head_dim), w, 1e-6).view(rows, -1)
        close(want[:, part].reshape(-1, head_dim), hf_rms_norm(qkv[:, part].reshape(-1, head_dim), w, 1e-6))
    got = qkv.clone()
    qk_norm_(got, q_w, k_w, q_heads, kv_heads, head_dim, 1e-6)
    assert torch.equal(got, want)
    assert torch.equal(got[:, (q_heads + kv_heads) * head_dim:], qkv[:, (q_heads + kv_heads) * head_dim:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 16, 40])
def test_silu_mul(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536, generator=g) * 4).to(dtype)  # silu's both tails
    gate, up = gate_up.chunk(2, dim=-1)
    close(layer_ops.silu_mul(gate_up), F.silu(gate) * up, ulps=1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rope_in_place_on_the_query_and_key_heads_only(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    heads, kv_heads, head_dim = 9, 3, 64
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(4096, dtype=torch.float32), inv)
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)  # tables as the model holds them
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 4096, (rows,), generator=g)
    rotated = heads + kv_heads
    want = hf_rope(qkv[:, :rotated * head_dim].view(rows, rotated, head_dim), cos[positions], sin[positions])
    got = qkv.clone()
    layer_ops.rope_(got, rotated, head_dim, cos, sin, positions)
    close(got[:, :rotated * head_dim].view(rows, rotated, head_dim), want)
    assert torch.equal(got[:, rotated * head_dim:], qkv[:, rotated * head_dim:])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("norm", [False, True])  # True: Qwen3's q / k norm in the same pass
def test_rope_store_equals_rope_then_the_cache_write(dtype, rows, norm):
    """One pass (the q / k norm, RoPE, then each row's K and V into its paged slot) against qk_norm_, rope_ and
    KVCache.write one after another: the same qkv and the same cache, to the bit; the other slots untouched."""
    from atomd.engine.kv_cache import AttentionMetadata, KVCache
    from atomd.model.attention import qk_norm_

    g = torch.Generator().manual_seed(rows)
    heads, kv_heads, head_dim, layers, block = 9, 3, 64, 3, 16
    freqs = torch.outer(torch.arange(2048, dtype=torch.float32), torch.rand(head_dim // 2, generator=g))
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 2048, (rows,), generator=g)
    num_blocks = rows // block + 3
    slots = torch.randperm(num_blocks * block, generator=g)[:rows]  # scattered slots, distinct
    meta = AttentionMetadata(is_prefill=True, slot_blocks=slots // block, slot_offsets=slots % block, seqs=[])
    want_cache, got_cache = (KVCache(num_blocks, layers, block, kv_heads, head_dim, dtype) for _ in range(2))
    want_cache.kv.normal_(generator=g)
    got_cache.kv.copy_(want_cache.kv)
    q_w, k_w = ((1 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype) for _ in range(2))
    for layer in range(layers):
        want, got = qkv.clone(), qkv.clone()
        if norm:
            qk_norm_(want, q_w, k_w, heads, kv_heads, head_dim, 1e-6)
        layer_ops.rope_(want, heads + kv_heads, head_dim, cos, sin, positions)
        k, v = want[:, heads * head_dim:].view(rows, 2, kv_heads, head_dim).unbind(1)
        want_cache.write(layer, meta, k, v)
        assert layer_ops.rope_store_(got, heads, kv_heads, head_dim, cos, sin, positions, got_cache.kv,
                                     got_cache.slot_rows(meta), layer * 2 * block, block,
                                     (q_w, k_w, 1e-6) if norm else None)
        assert torch.equal(got, want)
        assert torch.equal(got_cache.kv, want_cache.kv)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_torch_fallback_computes_the_same(dtype, torch_ops):
    g = torch.Generator().manual_seed(0)
    x, delta = torch.randn(5, 64, generator=g).to(dtype), torch.randn(5, 64, generator=g).to(dtype)
    w = torch.randn(64, generator=g).to(dtype)
    want_x = x + delta
    close(layer_ops.rms_norm(x, w, 1e-5, delta=delta), hf_rms_norm(want_x, w, 1e-5), ulps=2)
    assert torch.equal(x, want_x)
    gate_up = torch.randn(5, 128, generator=g).to(dtype)
    close(layer_ops.silu_mul(gate_up), F.silu(gate_up[:, :64]) * gate_up[:, 64:])
    qkv = torch.randn(5, 4 * 16, generator=g).to(dtype)
    freqs = torch.outer(torch.arange(32, dtype=torch.float32), torch.rand(8, generator=g))
    cos, sin, pos = freqs.cos().to(dtype), freqs.sin().to(dtype), torch.tensor([0, 3, 9, 31, 2])
    want = hf_rope(qkv[:, :48].view(5, 3, 16), cos[pos], sin[pos])
    layer_ops.rope_(qkv, 3, 16, cos, sin, pos)
    close(qkv[:, :48].view(5, 3, 16), want, ulps=2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_greedy_ids_equal_with_the_torch_fallback(dtype, monkeypatch):
    """The whole model through the C ops and through torch's: the same greedy tokens on the
    built-in model (float32: the logits agree to ~1e-5; bf16: rounded at the same places)."""
    from atomd import LLM, SamplingParams

    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 40, 130)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def run() -> list[list[int]]:
        llm = LLM(num_threads=1, dtype=dtype, enable_prefix_caching=False)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    native = run()
    monkeypatch.setattr(layer_ops, "kernels", lambda: None)
    assert run() == native


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, n", [(576, 960), (1536, 576), (577, 33), (64, 5)])
def test_gemv_equals_a_float32_linear_to_the_dtypes_rounding(isa, dtype, k, n):
    """Batch-1 decode's GEMV (plain rows) against F.linear in float32 on the same inputs: float32
    to summation order, bf16 to one rounding of the output (1 ulp). Built where the ISA is:
    float32 with AVX-512F (the whole GEMV family: has_gemv) or AVX2 + FMA (the GEMV and the dense decode
    layer: has_decode_layer), bf16 with AVX512_BF16 too (the narrowed builds have less)."""
    flags = cpu_flags()
    avx512 = "avx512f" in flags and isa != "no-avx512"
    built = avx512 or {"avx2", "fma"} <= flags
    if dtype == torch.bfloat16:
        avx512 = built = avx512 and "avx512_bf16" in flags and isa in ("native", "no-amx")
    assert layer_ops.has_gemv(dtype) == avx512 and layer_ops.has_decode_layer(dtype) == built
    if not built:
        return
    g = torch.Generator().manual_seed(k * n)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(1, k, generator=g).to(dtype)
    got = layer_ops.gemv(x, w)
    want = F.linear(x.float(), w.float())
    assert got.dtype == dtype and got.shape == (1, n)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:
        ulp = want.abs().clamp_min(1e-3) * 2.0 ** -7
        assert ((got.float() - want).abs() <= ulp + 1e-3).all()


@pytest.mark.parametrize("m, k, n", [(1, 576, 96), (3, 577, 33), (16, 64, 5), (17, 96, 42)])
def test_bf16_linear_with_float32_output_is_the_unrounded_sum(isa, m, k, n, monkeypatch):
    """linear_f32 (a TP worker's row-parallel partial): bf16 inputs, the float32 sum of the exact
    products left unrounded (within float32 summation order of a float64 reference, far below a
    bf16 ulp), through the vdpbf16ps panels where the kernels have AVX512_BF16 (quant.gemm_bf16_f32;
    tests/test_quant_bf16.py checks their edges), else torch; a bias added in float32."""
    from atomd.model.linear import linear_f32

    lib = quant.build_kernels(isa)
    monkeypatch.setattr(quant, "kernels", lambda: lib)
    g = torch.Generator().manual_seed(m * k + n)
    x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    want = x.double() @ w.double().T + bias.double()
    got = linear_f32(x, w, bias)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert (got.double() - want).abs().max() < k * 2.0 ** -20
    panels = quant.gemm_bf16_f32(x, w)
    if panels is not None:
        assert torch.equal(panels + bias, got)


def test_batch1_decode_through_the_gemv_gives_onednns_greedy_ids(monkeypatch):
    """One sequence decoding (M = 1) reads the plain weight rows through the GEMV kernel;
    with ATOMD_GEMV=0 none are kept and oneDNN runs it. A model whose packed copies would pass
    GEMV_MAX_BYTES packs the head and the first layers only: the rest run oneDNN on their plain
    rows at M > 1 (the 70-token prompt). float32: the same greedy ids (sums differ in order)."""
    from atomd import LLM, SamplingParams
    from atomd.model import decoder, linear

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run():
        llm = LLM(num_threads=2, dtype="float32", enable_prefix_caching=False)
        model = llm.engine.model
        ids = [llm.generate([{"prompt_token_ids": list(range(5, 5 + n))}], params, use_tqdm=False)[0]
               .outputs[0].token_ids for n in (3, 70)]
        kept = model.lm_head_rows is not None and all(w.rows is not None for w in model.layers)
        return kept, [model.lm_head.is_mkldnn] + [w.qkv.is_mkldnn for w in model.layers], ids, model

    kept, packed, gemv_ids, model = run()
    assert kept == layer_ops.has_decode_layer(torch.float32) and all(packed)
    if kept:  # room for the head's packed copy and one layer's
        head, layer = model.lm_head_rows.nbytes, sum(t.nbytes for t in model.layers[0].rows)
        monkeypatch.setattr(decoder, "GEMV_MAX_BYTES", head + layer)
        _, packed_part, part_ids, _ = run()
        assert packed_part == [True, True] + [False] * (len(packed_part) - 2)
        assert part_ids == gemv_ids
        monkeypatch.setattr(decoder, "GEMV_MAX_BYTES", linear.GEMV_MAX_BYTES)
    monkeypatch.setenv(linear.GEMV_ENV, "0")
    kept_off, packed_off, onednn_ids, _ = run()
    assert not kept_off and all(packed_off)
    assert gemv_ids == onednn_ids


def greedy_ids_and_logprobs(llm, params) -> list:
    """(token ids, logprobs) of a 3- and a 40-token prompt: what the batch-1 layer tests compare."""
    outs = [llm.generate([{"prompt_token_ids": list(range(7, 7 + n))}], params, use_tqdm=False)[0].outputs[0]
            for n in (3, 40)]
    return [(o.token_ids, o.logprobs) for o in outs]


@pytest.mark.parametrize("kind,overrides", [("llama", {}), ("qwen2", {}),  # qwen2: the QKV projection's bias
                                             ("llama", {"head_dim": 32}),  # heads x head_dim != hidden
                                             ("qwen3", {})])  # q/k norm: the head per op, the tail fused
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch1_decode_layer_gives_the_per_op_paths_bits(kind, overrides, dtype, tmp_path):
    """Batch-1 decode through layer_ops.DecodeLayer (two C calls a layer around attention)
    against the per-op path on the same engine: the same greedy ids and logprobs to the bit
    (each intermediate rounded where the per-op path rounds it, the same kernels)."""
    from atomd import LLM, SamplingParams
    from tests.test_model_hf import make_checkpoint

    path = make_checkpoint(tmp_path / kind, kind, seed=5, **overrides)
    llm = LLM(str(path), num_threads=2, dtype=str(dtype).removeprefix("torch."), max_model_len=256,
              enable_prefix_caching=False)
    model = llm.engine.model
    assert (model.decode_layer is not None) == layer_ops.has_decode_layer(dtype)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=3)

    fused = greedy_ids_and_logprobs(llm, params)
    model.decode_layer = None  # the per-op path
    assert greedy_ids_and_logprobs(llm, params) == fused


def assert_fused_layer_gives_the_per_op_bits(llm) -> None:
    """20 greedy tokens (logprobs too) with every decode step after the prompt's in the fused layer's one C
    call, then the same with the per-op path: equal to the bit (where the build has no fused float32 layer,
    that the model has none)."""
    from atomd import SamplingParams

    model = llm.engine.model
    if not layer_ops.has_decode_layer(torch.float32):
        assert model.decode_layer is None
        return
    calls, run_layers = [], model.decode_layer.run_layers
    model.decode_layer.run_layers = lambda *a, **k: calls.append(1) or run_layers(*a, **k)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=3)

    fused = greedy_ids_and_logprobs(llm, params)
    assert len(calls) == 2 * 19  # every decode step after the prompt's
    model.decode_layer = None
    assert greedy_ids_and_logprobs(llm, params) == fused


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("threads", [2, 3])
def test_batch1_quantized_layer_on_several_threads_gives_the_per_op_paths_bits(method, threads, tmp_path):
    """int8 / int4 weights with int8 activations: every thread of the fused layer quantises x into its own
    thread-local row (csrc/quant.h's q8_own, no barrier): the per-op path's greedy ids and logprobs to the bit,
    every decode step in the one C call, with 2 and 3 threads (rows split unevenly)."""
    from atomd import LLM
    from tests.test_model_hf import make_checkpoint

    path = make_checkpoint(tmp_path / "llama", "llama", seed=7)
    llm = LLM(str(path), num_threads=threads, dtype="float32", max_model_len=256, enable_prefix_caching=False,
              quantization=method, quantized_activations="int8")
    assert_fused_layer_gives_the_per_op_bits(llm)


@pytest.mark.parametrize("method,threads", [("bf16", 2), ("fp16", 3)])
def test_batch1_16_bit_layer_gives_the_per_op_paths_bits(isa, method, threads, tmp_path, monkeypatch):
    """16-bit weights, float32 compute: an AVX2 build holds them as their strips only (quant.keep_strips_only),
    which the fused layer's GEMV reads with the per-op qlinear's FMA chains (an orphaned loop over the strips, split
    unevenly by 3 threads); other builds keep the rows. qwen2: the qkv bias added after the product. The per-op
    path's greedy ids and logprobs to the bit, every decode step in the one C call."""
    from atomd import LLM
    from tests.test_model_hf import make_checkpoint

    path = make_checkpoint(tmp_path / "qwen2", "qwen2", seed=9)
    llm = LLM(str(path), num_threads=threads, dtype="float32", max_model_len=256, enable_prefix_caching=False,
              quantization=method)
    weights = [t for w in llm.engine.model.layers for t in w.linears()] + [llm.engine.model.lm_head]
    assert all(t.strips_only for t in weights) == (quant.kernels().w16_panels == 2)
    assert_fused_layer_gives_the_per_op_bits(llm)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"])
def test_batch1_decode_layer_over_an_fp8_cache_gives_the_per_op_paths_bits(kv, tmp_path):
    """float32 over a narrow KV cache: the fused layer stores each K / V row as fp8, bf16 or float16 (KVCache.write's
    rounding and saturation at scale 1) and reads the cache through the narrow decode kernel: the
    per-op path's greedy ids and logprobs to the bit, every decode step in the one C call."""
    from atomd import LLM
    from tests.test_model_hf import make_checkpoint

    path = make_checkpoint(tmp_path / "qwen3", "qwen3", seed=5)
    llm = LLM(str(path), num_threads=2, dtype="float32", max_model_len=256, enable_prefix_caching=False,
              kv_cache_dtype=kv)
    assert_fused_layer_gives_the_per_op_bits(llm)  # per op: KVCache.write's to_narrow, the narrow kernel per layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cast_weights", [True, False])  # Qwen3-MoE's bf16 products; Mixtral's float32 ones
@pytest.mark.parametrize("threads", [1, 2, 4])  # k = 3: whole experts a thread (one with two), rows shared at 4
def test_moe_experts_in_one_call_equal_the_ops_one_by_one(isa, dtype, cast_weights, threads, monkeypatch):
    """Batch-1 decode of an MoE block (atomd/model/moe.py): its k experts in one C call where the
    GEMV kernel is built (layer_ops.moe_experts), the bits of expert() (GEMV, SiLU-and-mul,
    GEMV), the scaling and the float32 sum run op by op; odd sizes (masked tails)."""
    from atomd.model import moe
    from atomd.model.moe import MoeWeights

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # the thread count the C call is given

    g = torch.Generator().manual_seed(7)
    experts, hidden, inter = 8, 72, 40
    w = MoeWeights(router=torch.randn(experts, hidden, generator=g).to(dtype),
                   gate_up=(torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).to(dtype),
                   down=(torch.randn(experts, hidden, inter, generator=g) * 0.2).to(dtype), top_k=3,
                   norm_topk_prob=cast_weights, cast_weights=cast_weights)
    assert w.gemv == layer_ops.has_gemv(dtype)
    for _ in range(12):
        h = torch.randn(1, hidden, generator=g).to(dtype)
        weights, ids = moe.route(h, w)
        pairs = torch.stack([moe.expert(h, w, e)[0] * weights[0, j:j + 1] for j, e in enumerate(ids[0].tolist())])
        want = pairs.view(1, 3, -1).sum(dim=1).to(dtype)
        assert torch.equal(moe.moe(h, w), want)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 0.1)])
@pytest.mark.parametrize("cast_weights", [True, False])
@pytest.mark.parametrize("tokens,threads", [(2, 1), (5, 2), (16, 3)])
def test_moe_experts_of_several_tokens_in_one_call(isa, dtype, tol, cast_weights, tokens, threads, monkeypatch):
    """An MoE block over several tokens (moe.py's grouped path, layer_ops.moe_grouped where the
    GEMV kernel is built) against float64 SwiGLU experts and against one torch linear pair per
    active expert (moe.GROUPED off): the same values to the dtype's rounding (the C sums in
    another order), and in bf16 no further from float64 than the per-expert path (its rounded
    intermediates alone put both ~0.05 off at values ~2); odd sizes (masked tails, a partial
    block of 16 output rows)."""
    from atomd.model import moe
    from atomd.model.moe import MoeWeights

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, k = 8, 72, 40, 3
    w = MoeWeights(router=torch.randn(experts, hidden, generator=g).to(dtype),
                   gate_up=(torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).to(dtype),
                   down=(torch.randn(experts, hidden, inter, generator=g) * 0.2).to(dtype), top_k=k,
                   norm_topk_prob=cast_weights, cast_weights=cast_weights)
    assert w.gemv == layer_ops.has_gemv(dtype)
    for _ in range(3):
        h = torch.randn(tokens, hidden, generator=g).to(dtype)
        weights, ids = moe.route(h, w)
        got = moe.moe(h, w, (weights, ids))
        assert got.shape == h.shape and got.dtype == dtype
        want = torch.zeros(tokens, hidden, dtype=torch.float64)
        for t in range(tokens):
            for j, e in enumerate(ids[t].tolist()):
                gate, up = (h[t].double() @ w.gate_up[e].double().T).split(inter)
                want[t] += weights[t, j].double() * ((F.silu(gate) * up) @ w.down[e].double().T)
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
        monkeypatch.setattr(moe, "GROUPED", False)
        per_expert = moe.moe(h, w, (weights, ids))
        monkeypatch.setattr(moe, "GROUPED", True)
        torch.testing.assert_close(got, per_expert, atol=tol, rtol=tol)
        error, per_expert_error = ((x.double() - want).abs().max() for x in (got, per_expert))
        assert error <= 1.5 * per_expert_error + 1e-5, (error, per_expert_error)
    assert int(w.routed.sum()) == 2 * 3 * tokens * k  # the load counters: each pass counted once


def test_moe_experts_with_many_pairs_run_a_gemm_pair_each(monkeypatch):
    """An active expert with more than moe.GROUPED_MAX_PAIRS (token, choice) pairs (a prefill's
    experts) runs one oneDNN GEMM pair, the others stay in the grouped C call, in moe() and the TP
    partials alike: the grouped call gets exactly the experts at or under the bound, the pairs of
    the others are bit-equal to one torch linear pair per expert (moe.GROUPED off), the rest
    within bf16's rounding; the bound at 0: the grouped call never made."""
    from atomd.model import moe
    from atomd.model.moe import MoeWeights

    g = torch.Generator().manual_seed(3)
    bf16 = torch.bfloat16  # the TP partials are bf16's (moe.tp_exact)
    w = MoeWeights(router=torch.randn(4, 32, generator=g).to(bf16),
                   gate_up=(torch.randn(4, 48, 32, generator=g) * 0.2).to(bf16),
                   down=(torch.randn(4, 32, 24, generator=g) * 0.2).to(bf16), top_k=2, norm_topk_prob=True)
    h = torch.randn(40, 32, generator=g).to(bf16)
    weights = torch.full((40, 2), 0.5, dtype=bf16)
    ids = torch.tensor([[0, 1]] * 30 + [[2, 3]] * 6 + [[1, 2]] * 4)  # pairs an expert: 30, 34, 10, 6
    monkeypatch.setattr(moe, "GROUPED", False)
    per_expert = moe.moe(h, w, (weights, ids)), moe.tp_partials(h, w, (weights, ids))[0]
    monkeypatch.setattr(moe, "GROUPED", True)
    monkeypatch.setattr(moe, "GROUPED_MAX_PAIRS", 12)
    calls, real = [], layer_ops.moe_grouped
    monkeypatch.setattr(layer_ops, "moe_grouped", lambda x, gu, d, experts, *a: calls.append(experts.tolist())
                        or real(x, gu, d, experts, *a))
    got, partial = moe.moe(h, w, (weights, ids)), moe.tp_partials(h, w, (weights, ids))[0]
    grouped_calls = [[2, 3], [2, 3]] if w.gemv else []  # no bf16 GEMV kernel here: a GEMM pair each
    assert calls == grouped_calls
    gemm_pairs = (ids.flatten() < 2).nonzero().flatten()  # experts 0 and 1: a GEMM pair each
    assert torch.equal(partial[gemm_pairs], per_expert[1][gemm_pairs])
    torch.testing.assert_close(partial, per_expert[1], atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got, per_expert[0], atol=0.1, rtol=0.1)
    monkeypatch.setattr(moe, "GROUPED_MAX_PAIRS", 0)
    assert torch.equal(moe.moe(h, w, (weights, ids)), per_expert[0])
    assert torch.equal(moe.tp_partials(h, w, (weights, ids))[0], per_expert[1]) and calls == grouped_calls


def routings(g: torch.Generator, tokens: int, experts: int, k: int) -> list[torch.Tensor]:
    """Expert ids [tokens, k] (each row k distinct experts): random; every token on experts 0 .. k - 1
    (expert 0 gets every token); only k + 1 of the experts used (the others idle)."""
    random = torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :k]
    few = torch.rand(tokens, k + 1, generator=g).argsort(dim=1)[:, :k] * (experts // (k + 1))
    return [random, torch.arange(k).repeat(tokens, 1), few]


@pytest.mark.parametrize("isa", ["native", "no-amx"], indirect=True)  # the other narrowings: as no-amx here
@pytest.mark.parametrize("hidden,inter,experts,k,tokens,threads", [(64, 32, 8, 2, 2, 1), (96, 64, 32, 8, 17, 2),
                                                                    (128, 96, 16, 4, 150, 3)])
@pytest.mark.parametrize("cast_weights", [True, False])
def test_moe_amx_experts_equal_the_per_expert_path(isa, hidden, inter, experts, k, cast_weights, tokens, threads,
                                                   monkeypatch):
    """Several tokens' bf16 experts on AMX tiles (layer_ops.moe_amx over pack_amx's layout: moe.AMX;
    it runs on the native build of a CPU with AMX, and every narrowed build must say it does not and
    run the other paths) against one torch linear pair per active expert (moe.AMX and moe.GROUPED off)
    and float64 SwiGLU experts: the same values to bf16's rounding (the tiles sum in another order),
    no further from float64 than the per-expert path; random routings, experts left idle, every
    token on one expert (150 tokens: two of the kernel's row chunks); the TP partials (float32 down
    sums, scales None) alike."""
    from atomd.model import moe
    from atomd.model.moe import MoeWeights

    amx = isa == "native" and {"amx_tile", "amx_bf16"} <= cpu_flags()
    assert layer_ops.has_moe_amx() == amx
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(hidden + tokens)
    w = MoeWeights(router=torch.randn(experts, hidden, generator=g).bfloat16(),
                   gate_up=(torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).bfloat16(),
                   down=(torch.randn(experts, hidden, inter, generator=g) * 0.2).bfloat16(), top_k=k,
                   norm_topk_prob=cast_weights, cast_weights=cast_weights)
    h = torch.randn(tokens, hidden, generator=g).bfloat16()
    scales = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)
    for ids in routings(g, tokens, experts, k):
        routed = (scales.bfloat16() if cast_weights else scales, ids)
        got, (partial, _) = moe.moe(h, w, routed), moe.tp_partials(h, w, routed)
        assert (w.amx_weights() is not None) == amx
        monkeypatch.setattr(moe, "AMX", False)
        monkeypatch.setattr(moe, "GROUPED", False)
        per_expert, (per_expert_partial, _) = moe.moe(h, w, routed), moe.tp_partials(h, w, routed)
        monkeypatch.setattr(moe, "AMX", True)
        monkeypatch.setattr(moe, "GROUPED", True)
        gate, up = torch.einsum("th,tkih->tki", h.double(), w.gate_up[ids].double()).split(inter, dim=-1)
        down = torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, w.down[ids].double())
        exact = (routed[0].double().unsqueeze(-1) * down).sum(dim=1)
        torch.testing.assert_close(got, per_expert, atol=0.1, rtol=0.1)
        error, per_expert_error = ((x.double() - exact).abs().max() for x in (got, per_expert))
        assert error <= 1.5 * per_expert_error + 1e-5, (error, per_expert_error)
        torch.testing.assert_close(partial, per_expert_partial, atol=2e-2, rtol=2e-2)
        error, per_expert_error = ((x.view(tokens, k, hidden).double() - down).abs().max()
                                   for x in (partial, per_expert_partial))
        assert error <= 1.5 * per_expert_error + 1e-5, (error, per_expert_error)


def per_expert_and_exact(h, w, routed, wg, wd, inter: int, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE block of `routed` (scales, ids) with moe.Q8 off (one qlinear pair per active expert), and float64
    experts on the dequantised weights wg [experts, 2 * inter, hidden], wd [experts, hidden, inter]."""
    from atomd.model import moe

    monkeypatch.setattr(moe, "Q8", False)
    per_expert = moe.moe(h, w, routed)
    monkeypatch.setattr(moe, "Q8", True)
    gate, up = torch.einsum("th,tkih->tki", h.double(), wg[routed[1]]).split(inter, dim=-1)
    exact = (routed[0].double().unsqueeze(-1)
             * torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, wd[routed[1]])).sum(dim=1)
    return per_expert, exact


# the other narrowings: the no-amx rows; no-avx512 (every CPU here): the experts held as the AVX2 GEMM's strips
@pytest.mark.parametrize("isa,held", [("native", False), ("no-amx", False), ("no-avx512", True)],
                         indirect=["isa"])
@pytest.mark.parametrize("method", ["int8", "int4", "int4+int8"])
def test_moe_q8_experts_equal_the_per_expert_path(isa, held, method, monkeypatch):
    """int8 / int4 experts with int8 activations in one C call (layer_ops.moe_q8: AMX-INT8 tiles from
    QGEMM_AMX_MIN_M rows an expert on the native build of an AMX CPU, the int8 GEMM from quant.q8_gemm_min_m
    without them (VNNI, or AVX2 on a CPU without AVX-512: its own rows for int4 and int8 linears, so also
    int4 gate_up with int8 down, as a Q4_K_M GGUF's Q6_K tensors load), the int8-activation rows below them)
    against one qlinear pair per active expert (moe.Q8 off, the same
    narrowing for qlinear): the same bits (each expert's rows go through qlinear's own arithmetic),
    float32 and bf16 models (bf16 rounds gate_up, silu, down and the scaled pair as the torch ops do;
    Mixtral's float32 products too, cast_weights off); 1 token (moe()'s batch-1 form), 2, 17, 150 (two
    row chunks); random routings, idle experts, every token on one expert (past QGEMM_Q8_MAX_M pairs
    without the tiles or the GEMM: that expert a qlinear pair, the rest in the call); near float64 SwiGLU experts on
    the dequantised weights (int8 activations: ~1% of the terms). `held`: the experts held as the AVX2 build's
    int8 GEMM strips alone (quant.keep_strips_only, what such a build loads), the GEMM's products at every row
    count in both paths; and each expert's output the bits of the per-call GEMM over its rows as loaded."""
    from atomd.model import moe, quant
    from atomd.model.moe import MoeWeights

    monkeypatch.setattr(moe, "Q8_WIDE_MIN_PAIRS", 0)  # every expert on int8 activations (the widened ones: below)
    qlib = quant.build_kernels(isa)
    monkeypatch.setattr(quant, "kernels", lambda: qlib)
    tiles = isa == "native" and {"amx_tile", "amx_int8"} <= cpu_flags()
    # the int8 GEMM where no tiles (csrc/quant_gemm.h): VNNI, or AVX2 where the build has no AVX-512
    gemm = held or not tiles and ("avx512_vnni" in cpu_flags() or not AVX512)
    assert layer_ops.moe_q8_kind() == (2 if tiles else 3 if gemm else 1)
    calls, real = [], layer_ops.moe_q8
    monkeypatch.setattr(layer_ops, "moe_q8", lambda x, gu, d, inter, experts, *a: calls.append(len(experts))
                        or real(x, gu, d, inter, experts, *a))
    # act blocks (quant.act_block_of) 32 / 64 / 128 / 256, gate_up's and down's apart (the tiles' k-step changes)
    for hidden, inter, experts, k, tokens, threads in [(64, 32, 8, 2, 1, 2), (96, 64, 16, 4, 2, 1),
                                                        (128, 96, 32, 8, 17, 2), (64, 64, 8, 2, 150, 1),
                                                        (256, 128, 8, 2, 9, 1)]:
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        g = torch.Generator().manual_seed(hidden + tokens)
        gate_up = [quant.quantize(torch.randn(2 * inter, hidden, generator=g) * 0.2, method[:4])
                   for _ in range(experts)]
        down = [quant.quantize(torch.randn(hidden, inter, generator=g) * 0.2, method[-4:]) for _ in range(experts)]
        quant.use_int8_activations(gate_up + down)
        wg = torch.stack([q.dequantize() for q in gate_up]).double()
        wd = torch.stack([q.dequantize() for q in down]).double()
        if held:
            loaded = [copy.copy(q) for q in gate_up + down]
            assert all(quant.keep_strips_only(q, qlib) for q in gate_up + down)
            assert all(torch.equal(q.dequantize(), r.dequantize()) for q, r in zip(gate_up + down, loaded))
            x = torch.randn(5, hidden, generator=g)
            with monkeypatch.context() as m:  # the loaded rows as the per-call GEMM at every row count
                m.setattr(quant, "QGEMM_AVX2_GEMM_MIN_M", {4: 1, 8: 1})
                for q, r in zip(gate_up[:2] + down[:2], loaded[:2] + loaded[experts:experts + 2]):
                    for rows in (1, 2, 5):
                        assert torch.equal(quant.qlinear(x[:rows, :q.in_features], q, lib=qlib),
                                           quant.qlinear(x[:rows, :q.in_features], r, lib=qlib))
        scales = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)
        for dtype, cast in ((torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)):
            w = MoeWeights(router=torch.randn(experts, hidden, generator=g).to(dtype), gate_up=gate_up, down=down,
                           top_k=k, norm_topk_prob=True, cast_weights=cast)
            h = torch.randn(tokens, hidden, generator=g).to(dtype)
            for ids in routings(g, tokens, experts, k)[:1 if tokens == 1 else 3]:
                routed = (scales.to(dtype) if cast else scales, ids)
                calls.clear()
                got = moe.moe(h, w, routed)
                counts = torch.bincount(ids.flatten())
                in_call = int(((counts > 0) & (tiles | gemm | (counts <= quant.QGEMM_Q8_MAX_M))).sum())
                assert calls == ([in_call] if in_call else []) and w.q8_experts() is not None
                per_expert, exact = per_expert_and_exact(h, w, routed, wg, wd, inter, monkeypatch)
                assert torch.equal(got, per_expert), (hidden, tokens, dtype, cast)
                assert (got.double() - exact).abs().max() <= 0.05 * exact.abs().max() + 1e-3


@pytest.mark.parametrize("method", ["bf16", "fp16"])
def test_moe_q8_16_bit_experts_equal_the_per_expert_path(method, monkeypatch):
    """16-bit experts (float32 activations) in one moe_q8 call against one qlinear pair per active expert (moe.Q8
    off): the same bits, float32 and bf16 models, 1 token (batch 1), 2, 17 and 150 (two row chunks), 1 and 2
    threads; held as their rows (the rows, from QGEMM_W16_MIN_M rows an expert the panels packed per call) and,
    on an AVX2 build, as the strips packed at load alone (quant.keep_strips_only: what such a build loads,
    read at every row count)."""
    from atomd.model import moe, quant
    from atomd.model.moe import MoeWeights

    monkeypatch.setattr(quant, "QGEMM_W16_MIN_M", 3)  # both kernels of the rows-held experts at these sizes
    calls, real = [], layer_ops.moe_q8
    monkeypatch.setattr(layer_ops, "moe_q8", lambda x, gu, d, inter, experts, *a: calls.append(len(experts))
                        or real(x, gu, d, inter, experts, *a))
    hidden, inter, experts, k = 96, 40, 8, 2  # strips of 16 rows: the last one short in gate_up (80) and down (96)
    for strips in (False, True) if quant.kernels().w16_panels == 2 else (False,):  # strips: an AVX2 build's
        g = torch.Generator().manual_seed(7)
        gate_up = [quant.quantize(torch.randn(2 * inter, hidden, generator=g) * 0.2, method) for _ in range(experts)]
        down = [quant.quantize(torch.randn(hidden, inter, generator=g) * 0.2, method) for _ in range(experts)]
        wg = torch.stack([q.dequantize() for q in gate_up]).double()
        wd = torch.stack([q.dequantize() for q in down]).double()
        if strips:
            assert all(quant.keep_strips_only(q) for q in gate_up + down)
        for tokens, threads in [(1, 2), (2, 1), (17, 2), (150, 1), (150, 2)]:
            monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
            scales = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)
            for dtype in (torch.float32, torch.bfloat16):
                w = MoeWeights(router=torch.randn(experts, hidden, generator=g).to(dtype), gate_up=gate_up, down=down,
                               top_k=k, norm_topk_prob=True)
                h = torch.randn(tokens, hidden, generator=g).to(dtype)
                for ids in routings(g, tokens, experts, k)[:1 if tokens == 1 else 3]:
                    routed = (scales.to(dtype), ids)
                    calls.clear()
                    got = moe.moe(h, w, routed)
                    assert calls == [int((torch.bincount(ids.flatten()) > 0).sum())]
                    per_expert, exact = per_expert_and_exact(h, w, routed, wg, wd, inter, monkeypatch)
                    assert torch.equal(got, per_expert), (strips, tokens, threads, dtype)
                    assert (got.double() - exact).abs().max() <= 0.03 * exact.abs().max() + 1e-4


@pytest.mark.parametrize("isa", ["native", "no-amx"], indirect=True)
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_moe_q8_widened_experts_are_the_bf16_amx_experts_of_the_dequantised_weights(isa, method, monkeypatch):
    """moe_q8's experts of at least moe.Q8_WIDE_MIN_PAIRS pairs where the bf16 AMX experts run
    (layer_ops.has_moe_amx): their int8 / int4 weights dequantised and rounded to bf16 in the call,
    bf16 tiles. A bf16 model's block then equals, to the bit, moe_amx's over those bf16 weights packed at
    load (the same tile code and rounding points; pack_amx's layout from the kernel's own widening);
    a float32 model's (gate_up and SiLU in float32) is near float64 experts on the bf16 weights and x,
    nearer than int8 activations; a threshold that widens some experts and not others (two 512-row
    items of one expert, 600 tokens) stays near float64. Builds without AMX ignore the threshold: the
    int8-activation path's bits."""
    from atomd.model import moe, quant
    from atomd.model.moe import MoeWeights

    wide = isa == "native" and {"amx_tile", "amx_bf16", "amx_int8"} <= cpu_flags()
    assert layer_ops.has_moe_amx() == wide
    qlib = quant.build_kernels("native" if isa == "native" else "no-amx")
    monkeypatch.setattr(quant, "kernels", lambda: qlib)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    hidden, inter, experts, k = 64, 32, 8, 2
    g = torch.Generator().manual_seed(7)
    gate_up = [quant.quantize(torch.randn(2 * inter, hidden, generator=g) * 0.2, method) for _ in range(experts)]
    down = [quant.quantize(torch.randn(hidden, inter, generator=g) * 0.2, method) for _ in range(experts)]
    quant.use_int8_activations(gate_up + down)
    wg = torch.stack([q.dequantize() for q in gate_up]).bfloat16()
    wd = torch.stack([q.dequantize() for q in down]).bfloat16()
    bf16_experts = MoeWeights(router=torch.randn(experts, hidden, generator=g).bfloat16(), gate_up=wg, down=wd,
                              top_k=k, norm_topk_prob=True)
    for tokens in (40, 600):
        scales = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)
        for ids in routings(g, tokens, experts, k)[:2]:
            for dtype in (torch.bfloat16, torch.float32):
                w = MoeWeights(router=bf16_experts.router.to(dtype), gate_up=gate_up, down=down, top_k=k,
                               norm_topk_prob=True)
                h = torch.randn(tokens, hidden, generator=g).to(dtype)
                routed = (scales.to(dtype), ids)
                monkeypatch.setattr(moe, "Q8_WIDE_MIN_PAIRS", 0)
                int8_acts = moe.moe(h, w, routed)
                monkeypatch.setattr(moe, "Q8_WIDE_MIN_PAIRS", 1)
                got = moe.moe(h, w, routed)
                if not wide:
                    assert torch.equal(got, int8_acts)
                    continue
                hb = h.bfloat16()
                gate, up = torch.einsum("th,tkih->tki", hb.double(), wg[ids].double()).split(inter, dim=-1)
                exact = (routed[0].double().unsqueeze(-1)
                         * torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, wd[ids].double())).sum(dim=1)
                error, int8_error = ((x.double() - exact).abs().max() for x in (got, int8_acts))
                if dtype == torch.bfloat16:
                    assert torch.equal(got, moe.moe(hb, bf16_experts, routed)), (method, tokens)
                else:
                    assert error <= 0.01 * exact.abs().max() and error < int8_error, (error, int8_error)
                monkeypatch.setattr(moe, "Q8_WIDE_MIN_PAIRS", tokens // 2)  # expert 0 of routing 1, or none
                mixed = moe.moe(h, w, routed)
                assert (mixed.double() - exact).abs().max() <= 0.03 * exact.abs().max()


@pytest.mark.parametrize("pairs_dtype", [torch.bfloat16, torch.float32])
def test_moe_sum_is_torchs_sum_of_the_pairs(isa, pairs_dtype):
    """layer_ops.moe_sum (an MoE block's output from its pairs): torch's float32 sum over each
    token's k rows rounded once, to the bit; odd widths (a partial 512-column block), k = 1."""
    g = torch.Generator().manual_seed(5)
    for tokens, k, hidden in [(3, 2, 72), (17, 8, 1024), (5, 3, 600), (4, 1, 32)]:
        pairs = (torch.randn(tokens * k, hidden, generator=g) * 3).to(pairs_dtype)
        want = pairs.view(tokens, k, hidden).sum(dim=1).to(torch.bfloat16)
        assert torch.equal(layer_ops.moe_sum(pairs, k, torch.bfloat16), want)
    assert torch.equal(layer_ops.moe_sum(pairs, k, torch.float32), pairs.view(tokens, k, hidden).sum(dim=1).float())


def test_pack_amx_layout_and_refusals():
    """pack_amx puts w[e, n, k] at [e, n // 16, k // 32, (k % 32) // 2, n % 16, k % 2] (one 16 x 32 block
    a contiguous tile operand) and refuses what the kernel cannot take, naming it."""
    w = torch.arange(2 * 64 * 96, dtype=torch.float32).view(2, 64, 96).bfloat16()
    packed = layer_ops.pack_amx(w)
    e, n, k = torch.meshgrid(torch.arange(2), torch.arange(64), torch.arange(96), indexing="ij")
    assert torch.equal(packed[e, n // 16, k // 32, (k % 32) // 2, n % 16, k % 2], w)
    with pytest.raises(ValueError, match=r"multiples of 32, got torch.bfloat16 \[2, 64, 72\]"):
        layer_ops.pack_amx(w[:, :, :72])
    with pytest.raises(ValueError, match="torch.float32"):
        layer_ops.pack_amx(w.float())


@pytest.mark.parametrize("cast_weights", [True, False])
@pytest.mark.parametrize("tokens,threads", [(1, 1), (6, 2)])
def test_moe_tp_float32_partials_give_tp1s_block_in_bf16(isa, cast_weights, tokens, threads, monkeypatch):
    """moe.moe_tp in bf16 (the pairs' float32 down partials: layer_ops.moe_grouped with scales None
    where the bf16 GEMV kernel is built, linear_f32 per expert elsewhere): one worker holding every
    intermediate row gives moe()'s bits (the grouped kernel's same float sums, rounded in the same
    place; other builds to bf16's rounding), and two workers' halves summed as the all-reduce sums
    them give moe() of the whole experts to bf16's rounding, closer to float64 than bf16 partials
    rounded before the sum are allowed to be (2^-7 relative)."""
    from atomd.model import moe
    from atomd.model.moe import MoeWeights

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(tokens + 40)
    experts, hidden, inter, k = 8, 72, 48, 3
    whole = dict(router=torch.randn(experts, hidden, generator=g).bfloat16(),
                 gate_up=(torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).bfloat16(),
                 down=(torch.randn(experts, hidden, inter, generator=g) * 0.2).bfloat16(), top_k=k,
                 norm_topk_prob=cast_weights, cast_weights=cast_weights)
    w = MoeWeights(**whole)
    halves = [MoeWeights(**{**whole, "gate_up": torch.cat([whole["gate_up"][:, r * 24:(r + 1) * 24],
                                                           whole["gate_up"][:, inter + r * 24:inter + (r + 1) * 24]], 1),
                            "down": whole["down"][:, :, r * 24:(r + 1) * 24].contiguous()}) for r in range(2)]
    for _ in range(2):
        h = torch.randn(tokens, hidden, generator=g).bfloat16()
        want = moe.moe(h, w)
        one = moe.moe_tp(h, w, lambda t: t)
        if w.gemv and tokens > 1:  # moe() runs the same grouped kernel
            assert torch.equal(one, want)
        else:
            torch.testing.assert_close(one, want, atol=2e-2, rtol=2e-2)
        partials = []
        moe.moe_tp(h, halves[0], lambda t: partials.append(t) or t)
        two = moe.moe_tp(h, halves[1], lambda t: partials[0] + t)  # the all-reduce: rank order
        torch.testing.assert_close(two, want, atol=2e-2, rtol=2e-2)
        weights, ids = moe.route(h, w)
        exact = torch.zeros(tokens, hidden, dtype=torch.float64)
        for t in range(tokens):
            for j, e in enumerate(ids[t].tolist()):
                gate, up = (h[t].double() @ w.gate_up[e].double().T).split(inter)
                exact[t] += weights[t, j].double() * ((F.silu(gate) * up) @ w.down[e].double().T)
        assert ((two.double() - exact).abs() <= 2 ** -7 * exact.abs() + 5e-2).all()


@pytest.mark.parametrize("policy", [None, "ACTIVE"])
def test_openmp_threads_sleep_while_waiting_unless_the_user_says(policy):
    """Importing atomd (before torch) makes OpenMP's waiting threads sleep after a short spin, not spin on
    (libgomp reads OMP_WAIT_POLICY and GOMP_SPINCOUNT when torch loads it); a user's own OMP_WAIT_POLICY is
    kept, and then no spin count is set for them."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run([sys.executable, "-c", "import atomd, os; print(os.environ['OMP_WAIT_POLICY'], "
                          "os.environ.get('GOMP_SPINCOUNT'))"],
                         env=env, capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert out == ([policy, "None"] if policy else ["PASSIVE", "1000"])


def test_lora_sgmv_adds_each_rows_own_adapter_delta(isa):
    """The LoRA SGMV kernel (atomd/model/lora.py's sgmv form) against float64 row by row: each row
    gets (x @ A_s) @ B_s of its own adapter s, base rows (slot -1) nothing; odd sizes, strided x
    and out rows (a tile of a wider tensor), an adapter padded with zero columns."""
    g = torch.Generator().manual_seed(3)
    rows, k, w, n = 7, 141, 5, 21  # k: two 64-lane chunks and a tail
    a, b = torch.randn(3, w, k, generator=g), torch.randn(3, w, n, generator=g)
    a[1, 3:], b[1, 3:] = 0, 0  # a rank-3 adapter among rank-5 ones
    x = torch.randn(rows, k + 4, generator=g)[:, 2:k + 2]
    out_all = torch.randn(rows, n + 3, generator=g)
    out, before, tail = out_all[:, :n], out_all[:, :n].clone(), out_all[:, n:].clone()
    slots = torch.tensor([0, -1, 2, 1, 0, -1, 2])
    layer_ops.lora_sgmv(x, a, b, slots, out)
    want = before.double()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            want[i] += (x[i].double() @ a[s].double().T) @ b[s].double()
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(out_all[:, n:], tail)  # nothing past each row's n outputs
