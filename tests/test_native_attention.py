"""The C decode-attention kernel (atomd/kernels/native.py) against torch's SDPA, the reference, and the
engine's choice of backend: greedy tokens equal Hugging Face through both backends, and an
engine whose kernel cannot be built says so and keeps serving through SDPA."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from atomd.kernels import native
from atomd.config import EngineConfig
from atomd.llm import LLM
from atomd.engine.kv_cache import KVCache
from tests.cpu_builds import ISAS
from tests.test_model_hf import MIXED, assert_equals_hf, engine_greedy, llama_dir, prompts_of, qwen2_dir  # noqa: F401


def sdpa_reference(q: torch.Tensor, cache: KVCache, layer: int, tables: torch.Tensor,
                   lens: torch.Tensor) -> torch.Tensor:
    keys, values = cache.gather_padded(layer, tables)
    mask = (torch.arange(keys.shape[2]).unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, enable_gqa=True)
    return out.reshape(q.shape[0], -1)


@pytest.mark.unit
# 36: no whole 8-lane vectors (AVX2 builds run the plain C loops); (9, 3, 80): a group of 3, the AVX2 decode row's
# weighted values two 8-lane vectors a chunk over 10
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 32), (8, 4, 64), (8, 2, 16), (14, 2, 80),
                                                     (16, 1, 128), (32, 2, 256), (6, 2, 36), (9, 3, 80)])
def test_decode_kernel_equals_sdpa_on_a_shuffled_paged_cache(heads, kv_heads, head_dim):
    torch.manual_seed(heads * head_dim)
    layers, block = 3, 16
    lens = torch.tensor([1, 15, 16, 17, 100, 257], dtype=torch.int64)  # partial, exact and many blocks
    width = int(-(-lens.max() // block))
    cache = KVCache(len(lens) * width + 5, layers, block, kv_heads, head_dim)
    cache.kv.normal_()
    tables = torch.randperm(cache.num_blocks)[:len(lens) * width].view(len(lens), width).contiguous()
    lib = native.attention_kernels(head_dim, heads // kv_heads)
    assert lib is not None
    for layer in range(layers):
        q = torch.randn(len(lens), heads, head_dim) * 3  # peaked softmaxes too
        got = native.decode_attention(lib, q, cache, layer, tables, lens)
        torch.testing.assert_close(got, sdpa_reference(q, cache, layer, tables, lens), rtol=1e-5, atol=1e-5)


@pytest.mark.unit
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 80: a last vector of 16 lanes part-filled; 36: no whole 8-lane vectors (the AVX2 build's plain C row); 128: a group of 16
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(14, 2, 80), (6, 2, 36), (16, 1, 128)])
def test_every_builds_decode_kernel_equals_sdpa(isa, dtype, heads, kv_heads, head_dim):
    """float32 and bf16 models' decode rows in each build this CPU runs (cpu_builds.ISAS: AVX-512 with and without the
    bf16 dot products, AVX2): every one but the bf16 dot products' is attention_avx2.h's or attention_narrow.h's row,
    over the model's own cache. Against SDPA in float32 on the same (bf16-rounded) values: float32 to the summation
    order, bf16 to its output's rounding."""
    torch.manual_seed(heads * head_dim)
    lens = torch.tensor([1, 16, 17, 100, 257], dtype=torch.int64)
    width = int(-(-lens.max() // 16))
    cache = KVCache(len(lens) * width + 3, 1, 16, kv_heads, head_dim, dtype=dtype)
    cache.kv.copy_(torch.randn(cache.kv.shape))
    tables = torch.randperm(cache.num_blocks)[:len(lens) * width].view(len(lens), width).contiguous()
    lib = native.attention_kernels(head_dim, heads // kv_heads, isa=isa)
    assert lib is not None
    q = (torch.randn(len(lens), heads, head_dim) * 3).to(dtype)
    got = native.decode_attention(lib, q, cache, 0, tables, lens)
    want = sdpa_reference(q.float(), KVCache(cache.num_blocks, 1, 16, kv_heads, head_dim, kv=cache.kv.float()), 0,
                          tables, lens)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.unit
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 32), (8, 4, 64), (8, 2, 16), (14, 2, 80), (3, 1, 8),
                                                     (16, 1, 128), (32, 2, 256)])
def test_prefill_kernel_equals_causal_sdpa_per_sequence(heads, kv_heads, head_dim):
    torch.manual_seed(heads + head_dim)
    lens = [1, 15, 16, 17, 70, 130]  # under, at and over a query tile and a key tile
    total = sum(lens)
    # views with the model's token strides: q, k from the RoPE output, v from the QKV projection
    qk = torch.randn(total, heads + kv_heads, head_dim) * 2
    qkv = torch.randn(total, (heads + 2 * kv_heads) * head_dim)
    q, k = qk[:, :heads], qk[:, heads:]
    v = qkv[:, (heads + kv_heads) * head_dim:].view(total, kv_heads, head_dim)
    starts = torch.tensor([sum(lens[:i]) for i in range(len(lens))])
    lib = native.attention_kernels(head_dim, heads // kv_heads)
    out = torch.full((total, heads * head_dim), float("nan"))
    native.prefill_attention(lib, q, k, v, out, starts, torch.tensor(lens))
    for start, n in zip(starts.tolist(), lens):
        rows = slice(start, start + n)
        want = F.scaled_dot_product_attention(*(t[rows].transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                                              is_causal=True, enable_gqa=True)
        torch.testing.assert_close(out[rows], want[0].transpose(0, 1).reshape(n, -1), rtol=1e-5, atol=1e-5)


@pytest.mark.unit
def test_kernel_is_built_once_per_shape_into_the_cache(fresh_kernels):
    assert native.attention_kernels(32, 2) is native.attention_kernels(32, 2)
    native.attention_kernels(32, 4)
    built = sorted(p.name for p in (fresh_kernels / "kernels").iterdir())
    assert len(built) == 2 and built[0].startswith("attention-d32-g2-"), built


@pytest.mark.unit
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_greedy_equals_hf_through_each_backend(backend, llama_dir, qwen2_dir):
    for path in (llama_dir, qwen2_dir):
        llm = LLM(str(path), num_threads=1, max_model_len=256, attention_backend=backend)
        assert (llm.engine.runner.kernels is not None) == (backend == "native")
        prompts = prompts_of(MIXED, seed=11)
        assert_equals_hf(path, prompts, engine_greedy(llm, prompts))


@pytest.mark.unit
def test_no_compiler_falls_back_to_sdpa_with_a_warning(fresh_kernels, monkeypatch, llama_dir, caplog):
    monkeypatch.setenv("CC", "no-such-compiler")
    with caplog.at_level(logging.WARNING, logger="atomd.kernels.native"):
        llm = LLM(str(llama_dir), num_threads=1, max_model_len=256)
    assert llm.engine.runner.kernels is None
    assert "no C compiler (no-such-compiler)" in caplog.text
    prompts = prompts_of([19, 4], seed=12)
    assert_equals_hf(llama_dir, prompts, engine_greedy(llm, prompts))
    with pytest.raises(RuntimeError, match="attention_backend native: the attention kernels did not build"):
        LLM(str(llama_dir), num_threads=1, max_model_len=256, attention_backend="native")


@pytest.mark.unit
def test_a_failing_build_names_the_compiler_error(fresh_kernels, monkeypatch, tmp_path, caplog):
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'cc: fatal error: out of luck' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    with caplog.at_level(logging.WARNING, logger="atomd.kernels.native"):
        assert native.attention_kernels(32, 2) is None
    assert "out of luck" in caplog.text and not list((fresh_kernels / "kernels").glob("*.so"))


@pytest.mark.unit
def test_a_kernel_refuses_a_shape_it_was_not_built_for():
    lib = native.attention_kernels(32, 2)
    cache = KVCache(4, 1, 16, 2, 16)
    one = torch.ones(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="built for head_dim 32, group 2; called with head_dim 16"):
        native.decode_attention(lib, torch.zeros(1, 4, 16), cache, 0, torch.zeros(1, 1, dtype=torch.int64), one)
    q, k = torch.zeros(3, 6, 32), torch.zeros(3, 2, 32)  # group 3
    with pytest.raises(ValueError, match="called with head_dim 32, 6 heads / 2 KV heads"):
        native.prefill_attention(lib, q, k, k, torch.empty(3, 6 * 32), torch.zeros(1, dtype=torch.int64), one)


@pytest.mark.unit
def test_attention_backend_is_validated():
    with pytest.raises(ValueError, match="attention_backend must be one of auto, native, torch"):
        EngineConfig(attention_backend="flash")
    with pytest.raises(ValueError, match="attention_backend native runs float32 and bfloat16, got dtype 'float16'"):
        EngineConfig(attention_backend="native", dtype="float16")
    assert EngineConfig(attention_backend="native", dtype="bfloat16").dtype == "bfloat16"  # tests/test_bf16.py


@pytest.mark.unit
def test_kernel_shares_torchs_openmp_runtime():
    """A second libgomp would bring a second thread pool spinning against torch's."""
    assert native.attention_kernels(32, 2) is not None
    with open("/proc/self/maps") as f:
        runtimes = {line.split()[-1] for line in f if any(name in line for name in ("libgomp", "libiomp", "libomp"))}
    assert len(runtimes) == 1, runtimes
