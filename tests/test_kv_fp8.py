"""The narrow KV caches (--kv-cache-dtype fp8_e4m3 / fp8_e5m2, and bfloat16 / float16 under a float32
model; atomd/engine/kv_cache.py): the C decode kernel over one- and two-byte values against a float64
reference on the same values (torch's casts are the rounding), under every ATOMD_KERNEL_ISA narrowing,
every format; the cache's write and read paths; the flag's validation; the engine against HF on the
same rounding."""
from __future__ import annotations

import json

import pytest
import torch

from atomd.config import EngineConfig, cpu_flags
from atomd.engine.kv_cache import AttentionMetadata, KVCache, kv_dtype_name, kv_storage_dtype, to_narrow
from atomd.kernels import native
from tests.cpu_builds import ISAS
from tests.families import FAMILIES
from tests.test_model_hf import BLOCK, MIXED, _prompt_logits, make_checkpoint, prompts_of
from tests.test_quant_engine import greedy, hf_greedy
from tests.test_sliding_window import windowed_reference
from atomd.llm import LLM

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
NARROW = [*FP8, torch.bfloat16, torch.float16]  # under a float32 model


def _kernels(isa: str, head_dim: int, group: int):
    lib = native.attention_kernels(head_dim, group, isa=isa)
    if lib is None:
        pytest.fail(f"the attention kernel (head_dim {head_dim}, group {group}, isa {isa}) did not build")
    return lib


def _filled_cache(lens: list[int], layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                  compute: torch.dtype = torch.float32, block: int = 16) -> tuple[KVCache, torch.Tensor]:
    """A cache whose sequences' slots (shuffled blocks) hold random k, v written through KVCache.write."""
    width = -(-max(lens) // block)
    cache = KVCache(len(lens) * width + 3, layers, block, kv_heads, head_dim, dtype, compute_dtype=compute)
    tables = torch.randperm(cache.num_blocks)[:len(lens) * width].view(len(lens), width).contiguous()
    blocks = torch.cat([tables[b, torch.arange(n) // block] for b, n in enumerate(lens)])
    offsets = torch.cat([torch.arange(n) % block for n in lens])
    meta = AttentionMetadata(False, blocks, offsets, [])
    for layer in range(layers):
        k = (torch.randn(len(blocks), kv_heads, head_dim) * 2).to(compute)
        v = torch.randn(len(blocks), kv_heads, head_dim).to(compute)
        cache.write(layer, meta, k, v)
    return cache, tables


@pytest.mark.unit
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize("head_dim", [64, 36])  # 36: no whole 8-lane vectors, AVX2 builds widen in plain C
def test_every_narrow_value_widens_as_torch_casts_it(isa, dtype, head_dim):
    """One key per sequence: the output is its V row itself, so each of the 256 fp8 bytes (65536 16-bit
    values) comes out as the kernel widens it (subnormals, infinities and NaNs included)."""
    values = 1 << (8 * dtype.itemsize)
    lib, seqs = _kernels(isa, head_dim, 2), -(-values // head_dim)
    avx512 = isa != "no-avx512" and {"avx512f", "avx512bw", "avx512vl"} <= cpu_flags()
    avx2 = head_dim % 8 == 0 and {"avx2", "fma", "f16c"} <= cpu_flags()
    assert lib.narrow_path == native.NARROW_PATHS[1 if avx512 else 2 if avx2 else 0]  # each narrowing runs the path it names
    cache = KVCache(seqs, 1, 16, 1, head_dim, dtype, compute_dtype=torch.float32)
    bits = torch.uint8 if dtype.itemsize == 1 else torch.int16
    every_value = torch.zeros(seqs * head_dim, dtype=torch.int32)
    every_value[:values] = torch.arange(values) - (0 if dtype.itemsize == 1 else values // 2)
    cache.kv.view(bits)[:, 0, 1, 0, 0] = every_value.to(bits).view(seqs, head_dim)
    tables = torch.arange(seqs).view(seqs, 1).contiguous()
    got = native.decode_attention(lib, torch.randn(seqs, 2, head_dim), cache, 0, tables,
                                  torch.ones(seqs, dtype=torch.int64))
    want = cache.kv[:, 0, 1, 0, 0].float().reshape(seqs, 1, head_dim).expand(seqs, 2, head_dim)
    torch.testing.assert_close(got.view(seqs, 2, head_dim), want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.unit
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", NARROW)
# head sizes under one vector (8), of whole vectors (32, 80, 128), with a partial last one (40 on AVX-512) and
# not of 8-lane vectors (36: the table on AVX2 builds); a sliding window on some
@pytest.mark.parametrize("heads,kv_heads,head_dim,window", [(4, 2, 32, None), (14, 2, 80, 37), (3, 1, 8, 37),
                                                            (6, 3, 40, None), (16, 1, 128, 37), (4, 1, 36, 37)])
def test_decode_kernel_over_a_narrow_cache_equals_reference(isa, dtype, heads, kv_heads, head_dim, window):
    torch.manual_seed(heads * head_dim + (window or 0))
    lens = [1, 15, 16, 17, 100]  # partial, exact and many blocks; inside and past the window
    cache, tables = _filled_cache(lens, 2, kv_heads, head_dim, dtype)
    lib, scale = _kernels(isa, head_dim, heads // kv_heads), 0.7 / head_dim ** 0.5
    lens_t = torch.tensor(lens, dtype=torch.int64)
    for layer in range(2):
        q = torch.randn(len(lens), heads, head_dim) * 3
        got = native.decode_attention(lib, q, cache, layer, tables, lens_t, window=window, scale=scale)
        for b, n in enumerate(lens):
            keys, values = cache.gather(layer, tables[b], n)  # torch's widening of the stored bytes
            want = windowed_reference(q[b:b + 1], keys.transpose(0, 1), values.transpose(0, 1),
                                      torch.tensor([n - 1]), window, scale)
            torch.testing.assert_close(got[b:b + 1].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.unit
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [*FP8, torch.float16])
def test_decode_kernel_over_a_narrow_cache_with_drafts_scales_and_bf16(isa, dtype):
    """Speculative verify rows (causal inside a sequence's run), per-tensor scales other than 1,
    and a bfloat16 model (q widened, the output rounded back to bf16)."""
    torch.manual_seed(3)
    heads, kv_heads, head_dim, lens = 4, 2, 32, [5, 40, 70]
    cache, tables = _filled_cache(lens, 1, kv_heads, head_dim, dtype, compute=torch.bfloat16)
    cache.k_scale, cache.v_scale = 0.5, 3.0  # applied on read: the stored bytes stand for 0.5x / 3x
    starts = torch.tensor([0, 1, 4, 7], dtype=torch.int64)  # 1, 3 and 3 rows
    q = (torch.randn(7, heads, head_dim) * 2).to(torch.bfloat16)
    got = native.decode_attention(_kernels(isa, head_dim, heads // kv_heads), q, cache, 0, tables,
                                  torch.tensor(lens, dtype=torch.int64), query_starts=starts)
    assert got.dtype == torch.bfloat16
    for b, n in enumerate(lens):
        keys, values = cache.gather(0, tables[b], n)  # widened times the scales (in bf16, as the model reads them)
        rows = range(int(starts[b]), int(starts[b + 1]))
        want = windowed_reference(q[rows.start:rows.stop].float(), keys.transpose(0, 1).float(),
                                  values.transpose(0, 1).float(), torch.arange(n - len(rows), n), None,
                                  head_dim ** -0.5)
        torch.testing.assert_close(got[rows.start:rows.stop].double(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.unit
@pytest.mark.parametrize("dtype", NARROW)
def test_write_stores_the_narrow_values_and_hands_them_back(dtype):
    cache = KVCache(3, 2, 4, 2, 8, dtype, compute_dtype=torch.float32)
    assert cache.block_bytes == 2 * 2 * 4 * 2 * 8 * dtype.itemsize  # layers x planes x block x heads x dims x bytes
    assert cache.block_bytes == KVCache.bytes_per_block(2, 4, 2, 8, dtype)
    assert cache.as_numpy_blocks().shape == (3, cache.block_bytes)
    k = torch.randn(3, 2, 8) * 4
    k[0, 0, 0], k[0, 0, 1] = 1e6, -1e6  # past the format's largest: saturated, never inf or NaN
    v, original = torch.randn(3, 2, 8), k.clone()
    meta = AttentionMetadata(False, torch.tensor([2, 0, 2]), torch.tensor([1, 3, 0]), [])
    cache.write(1, meta, k, v)
    limit = torch.finfo(dtype).max
    want = original.clamp(-limit, limit).to(dtype)
    assert torch.equal(cache.kv[meta.slot_blocks, 1, 0, meta.slot_offsets].view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(k, want.float())  # the caller's k now holds what the cache does
    keys, _ = cache.gather(1, torch.tensor([2]), 2)
    assert torch.equal(keys.transpose(0, 1), want.float()[[2, 0]])


@pytest.mark.unit
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", NARROW)
def test_the_fused_layers_store_rounds_as_to_narrow(isa, dtype):
    """The fused batch-1 layer's own store of K / V rows (csrc/layer_ops.c store_narrow) against
    KVCache.write's torch casts: every float32 whose low 12 bits are 0 (each rounding boundary and
    tie of the 16- and 8-bit formats, subnormals, saturation, inf, both signs) and a million random
    bit patterns, bit for bit; NaN as NaN (torch's vectorised cast and C may give other NaN bits)."""
    import ctypes

    import numpy as np
    from atomd.model.layer_ops import KV_STORE, build_kernels

    lib = build_kernels(isa)
    assert lib is not None
    bits = np.concatenate([np.arange(1 << 20, dtype=np.uint32) << 12,
                           np.random.default_rng(1).integers(0, 1 << 32, 1 << 20, dtype=np.uint32)])
    x = torch.from_numpy(bits.view(np.float32))
    want = to_narrow(x, dtype)
    got = torch.empty_like(want)
    lib.atomd_kv_store.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.atomd_kv_store(x.data_ptr(), got.data_ptr(), x.numel(), KV_STORE[dtype])
    as_int = torch.uint8 if dtype.itemsize == 1 else torch.int16
    nan = want.float().isnan()
    assert torch.equal(got.float().isnan(), nan)
    assert torch.equal(got.view(as_int)[~nan], want.view(as_int)[~nan])


@pytest.mark.unit
def test_a_16_bit_cache_is_refused_under_another_16_bit_model(fp8_llama):
    with pytest.raises(ValueError, match="kv_cache_dtype float16 is a 16-bit cache for a float32 model; this model "
                                         "runs in bfloat16"):
        kv_storage_dtype("float16", torch.bfloat16)
    with pytest.raises(ValueError, match="kv_cache_dtype float16 is a 16-bit cache for a float32 model"):
        _llm(fp8_llama[0], dtype="bfloat16", kv_cache_dtype="float16")  # the engine, with the model's dtype resolved
    assert kv_storage_dtype("bfloat16", torch.bfloat16) == torch.bfloat16  # the model's own: a plain cache


@pytest.mark.unit
def test_kv_cache_dtype_names():
    assert kv_storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_storage_dtype("fp8", torch.float32) == kv_storage_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert kv_storage_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    assert [kv_dtype_name(d) for d in (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float32)] == \
        ["fp8_e4m3", "fp8_e5m2", "bfloat16", "float32"]
    assert to_narrow(torch.tensor([1e9]), torch.float8_e5m2).float().item() == 57344.0
    assert to_narrow(torch.tensor([-1e9]), torch.float16).float().item() == -65504.0
    assert kv_storage_dtype("float16", torch.float32) == torch.float16
    assert kv_storage_dtype("bfloat16", torch.bfloat16) == torch.bfloat16  # the model's own: a plain cache
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2, bfloat16, float16, "
                                         "got 'int8'"):
        EngineConfig(kv_cache_dtype="int8")


@pytest.mark.unit
def test_the_serve_flag_takes_vllms_names_and_refuses_others(capsys):
    from tests.test_serve_flags import serve_parser

    parser = serve_parser()
    for name in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"):
        args = parser.parse_args(["--kv-cache-dtype", name])
        assert EngineConfig.from_args(args).kv_cache_dtype == name
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--kv-cache-dtype", "fp8_e4m3fn"])
    assert e.value.code == 2
    assert "argument --kv-cache-dtype: invalid choice: 'fp8_e4m3fn'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- the engine

def hf_on_narrow_kv(path, dtype: torch.dtype):
    """transformers' float32 model at `path` whose SDPA attention reads keys and values rounded to
    the narrow `dtype` as the cache stores them (after RoPE, saturated at the format's largest value,
    widened back): the reference. Its masks (causal, sliding window) are SDPA's own."""
    import transformers
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def attention(module, query, key, value, *args, **kwargs):
        return sdpa_attention_forward(module, query, to_narrow(key, dtype).to(key.dtype),
                                      to_narrow(value, dtype).to(value.dtype), *args, **kwargs)
    name = f"atomd_{kv_dtype_name(dtype)}"
    transformers.AttentionInterface.register(name, attention)
    transformers.AttentionMaskInterface.register(name, sdpa_mask)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=name).eval()


@pytest.fixture(scope="module")
def fp8_llama(tmp_path_factory):
    """A tiny Llama (GQA 4 / 2 heads of 16) and, per narrow format, HF on it with the KV rounded."""
    path = make_checkpoint(tmp_path_factory.mktemp("llama_fp8"), "llama", seed=5)
    return path, {kv_dtype_name(d): hf_on_narrow_kv(path, d) for d in NARROW}


def _llm(path, **kw) -> LLM:
    return LLM(str(path), num_threads=1, max_model_len=256, **kw)


def _hf_logits(model, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0]


@pytest.mark.unit
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"])
@pytest.mark.parametrize("backend,chunk", [("native", None), ("native", BLOCK), ("torch", BLOCK)])
def test_prompt_logits_equal_hf_on_fp8_rounded_kv(fp8_llama, kv, backend, chunk):
    """Prompt logits equal HF's with K and V rounded to the cache's dtype (float32 tolerance): one prefill,
    and in 16-token chunks (each chunk reads the earlier ones back from the narrow cache)."""
    path, refs = fp8_llama
    llm = _llm(path, kv_cache_dtype=kv, attention_backend=backend,
               **({"max_num_batched_tokens": chunk} if chunk else {}))
    assert kv_dtype_name(llm.engine.kv_cache.kv.dtype) == kv
    prompt = prompts_of([4 * BLOCK + 5], seed=3)[0]
    torch.testing.assert_close(_prompt_logits(llm, prompt), _hf_logits(refs[kv], prompt), atol=1e-4, rtol=0)


@pytest.mark.unit
@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2", "float16", "bfloat16"])
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_greedy_equals_hf_on_fp8_rounded_kv(fp8_llama, kv, backend):
    """48 greedy ids of mixed-length prompts (batched decode, batch-1 decode: the fused C layer on the
    native backend, per op on torch's) equal HF's on
    the same rounding; then again through prefix-cache hits, and with n-gram speculative decoding."""
    path, refs = fp8_llama
    ref = refs["fp8_e4m3" if kv == "fp8" else kv]
    prompts = prompts_of(MIXED, seed=7)
    want = [hf_greedy(ref, p, 48) for p in prompts]
    llm = _llm(path, kv_cache_dtype=kv, attention_backend=backend)
    assert greedy(llm, prompts) == want
    hits = llm.engine.stats()["prefix_cache_hits"]
    assert greedy(llm, prompts[2:3]) == want[2:3]  # a prefix hit: its 5 blocks read back from the cache
    assert llm.engine.stats()["prefix_cache_hits"] - hits >= 5 * BLOCK
    spec = _llm(path, kv_cache_dtype=kv, attention_backend=backend, speculative_config=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}))
    assert greedy(spec, prompts) == want


@pytest.mark.unit
def test_preemption_by_a_tiny_pool_equals_hf_on_fp8_rounded_kv(fp8_llama):
    path, refs = fp8_llama
    prompts = prompts_of([40, 33, 50], seed=11)
    llm = _llm(path, kv_cache_dtype="fp8_e4m3", num_kvcache_blocks=8)  # 3 x (prompt + 48) > 8 blocks: preempts
    assert greedy(llm, prompts) == [hf_greedy(refs["fp8_e4m3"], p, 48) for p in prompts]


@pytest.mark.unit
def test_fp8_cache_holds_four_times_float32s_tokens_and_stays_near_it(fp8_llama):
    """Memory: --kv-cache-memory gives 4x the blocks of float32 (2x bfloat16's), the 16-bit caches 2x.
    Accuracy against the unquantised cache (float32 model): the prompt logits' rms error relative to their
    rms under 6% (e4m3, 3 mantissa bits; measured 4.1%), 12% (e5m2, 2 bits; measured 8.2%), 1% (bfloat16,
    7 bits; measured 0.31%) and 0.2% (float16, 10 bits; measured 0.041%). A narrow cache does change
    outputs: greedy ids are checked against HF on the same rounding (above), not against float32."""
    path, _ = fp8_llama
    memory = 1 << 20
    f32, e4, e5, b16, f16 = (_llm(path, kv_cache_memory=memory, kv_cache_dtype=kv)
                             for kv in ("auto", "fp8", "fp8_e5m2", "bfloat16", "float16"))
    assert e4.engine.kv_cache.num_blocks == e5.engine.kv_cache.num_blocks == 4 * f32.engine.kv_cache.num_blocks
    assert b16.engine.kv_cache.num_blocks == f16.engine.kv_cache.num_blocks == 2 * f32.engine.kv_cache.num_blocks
    assert e4.engine.kv_cache.block_bytes * 4 == f32.engine.kv_cache.block_bytes == f16.engine.kv_cache.block_bytes * 2
    prompt = prompts_of([3 * BLOCK], seed=9)[0]
    exact = _prompt_logits(f32, prompt)
    for llm, bound in ((e4, 0.06), (e5, 0.12), (b16, 0.01), (f16, 0.002)):
        assert 0 < float((_prompt_logits(llm, prompt) - exact).norm() / exact.norm()) < bound


@pytest.mark.unit
def test_bfloat16_model_over_an_fp8_cache(fp8_llama):
    """A bfloat16 model reads the fp8 cache widened to bf16: its logits within bf16's tolerance of HF's
    float32 on the same rounding (test_bf16's 0.25)."""
    path, refs = fp8_llama
    llm = _llm(path, dtype="bfloat16", kv_cache_dtype="fp8")
    assert llm.engine.kv_cache.block_bytes * 2 == KVCache.bytes_per_block(2, BLOCK, 2, 16, torch.bfloat16)
    prompt = prompts_of([2 * BLOCK + 3], seed=4)[0]
    torch.testing.assert_close(_prompt_logits(llm, prompt).float(), _hf_logits(refs["fp8_e4m3"], prompt),
                               atol=0.25, rtol=0)
    assert len(greedy(llm, [prompt])[0]) == 48


@pytest.mark.unit
def test_tp2_over_fp8_caches_equals_tp1_and_hf_on_fp8_rounded_kv(fp8_llama):
    """--tensor-parallel-size 2 with fp8: each worker's slice of the shared cache holds its KV head in
    fp8 (a byte a value); greedy ids of mixed-length prompts (batched, then batch-1 decode alone) equal
    TP=1's over fp8 and HF's on the same rounding; the whole engine's cache is fp8 on every rank."""
    path, refs = fp8_llama
    prompts = prompts_of(MIXED, seed=7)
    want = [hf_greedy(refs["fp8_e4m3"], p, 48) for p in prompts]
    tp = _llm(path, kv_cache_dtype="fp8", tensor_parallel_size=2)
    try:
        assert tp.engine.tp_workers.kv_all.dtype == torch.float8_e4m3fn and tp.engine.tp_workers.kv_all.shape[5] == 1
        assert greedy(tp, prompts) == want == greedy(_llm(path, kv_cache_dtype="fp8"), prompts)
        assert greedy(tp, prompts[2:3]) == want[2:3]
    finally:
        tp.engine.close()


@pytest.mark.unit
def test_fingerprint_names_the_kv_cache_dtype(fp8_llama):
    from kv_transfer.params import compat_mismatch

    path, _ = fp8_llama
    fp8, plain = _llm(path, kv_cache_dtype="fp8").engine.compat, _llm(path).engine.compat
    assert fp8["kv_cache_dtype"] == "fp8_e4m3" and plain["kv_cache_dtype"] == "float32" == plain["dtype"]
    assert compat_mismatch(plain, fp8) == "compat mismatch on kv_cache_dtype: expected 'float32', got 'fp8_e4m3'"
    assert compat_mismatch(fp8, _llm(path, kv_cache_dtype="fp8_e4m3").engine.compat) is None  # fp8 is e4m3


@pytest.mark.unit
def test_what_fp8_does_not_run_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="kv_cache_dtype fp8_e5m2 needs model_runner real"):
        EngineConfig(kv_cache_dtype="fp8_e5m2", model_runner="simulated", hardware="h100:llama3-8b")
    path = FAMILIES["deepseek-v3"].write(tmp_path / "deepseek")
    with pytest.raises(ValueError, match="kv_cache_dtype fp8: DeepseekV3ForCausalLM's MLA latent cache is not built "
                                         "narrower than the model"):
        _llm(path, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="MLA latent cache is not built narrower"):  # refused before any TP worker starts
        _llm(path, kv_cache_dtype="fp8", tensor_parallel_size=2)
