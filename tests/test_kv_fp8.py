"""The fp8 KV cache (--kv-cache-dtype fp8_e4m3 / fp8_e5m2, atomd/engine/kv_cache.py): the C
decode kernel over one-byte values against a float64 reference on the same fp8 values (torch's
float8 casts are the rounding), under every ATOMD_KERNEL_ISA narrowing, both formats; the cache's
write and read paths; the flag's validation."""
from __future__ import annotations

import pytest
import torch

from atomd.config import EngineConfig
from atomd.engine.kv_cache import AttentionMetadata, KVCache, kv_dtype_name, kv_storage_dtype, to_fp8
from atomd.kernels import cbuild, native
from tests.test_sliding_window import windowed_reference

ISAS = list(cbuild.ISA_FLAGS)
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


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
@pytest.mark.parametrize("dtype", FP8)
def test_every_fp8_byte_widens_as_torch_casts_it(isa, dtype):
    """One key per sequence: the output is its V row itself, so each of the 256 bytes comes out as
    the kernel widens it (infinities and NaNs included)."""
    head_dim, lib = 64, _kernels(isa, 64, 1)
    cache = KVCache(4, 1, 16, 1, head_dim, dtype)
    cache.kv.view(torch.uint8)[:, 0, 1, 0, 0] = torch.arange(256, dtype=torch.uint8).view(4, head_dim)
    tables = torch.arange(4).view(4, 1).contiguous()
    got = native.decode_attention(lib, torch.randn(4, 1, head_dim), cache, 0, tables, torch.ones(4, dtype=torch.int64))
    want = cache.kv[:, 0, 1, 0, 0].float().reshape(4, head_dim)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.unit
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (14, 2, 80), (3, 1, 8), (6, 3, 40), (8, 1, 128)])
@pytest.mark.parametrize("window", [None, 37])
def test_decode_kernel_over_fp8_equals_reference(isa, dtype, heads, kv_heads, head_dim, window):
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
@pytest.mark.parametrize("dtype", FP8)
def test_decode_kernel_over_fp8_with_drafts_scales_and_bf16(isa, dtype):
    """Speculative verify rows (causal inside a sequence's run), per-tensor scales other than 1,
    and a bfloat16 model (q widened, the output rounded back to bf16)."""
    torch.manual_seed(3)
    heads, kv_heads, head_dim, lens = 4, 2, 48, [5, 40, 70]
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
@pytest.mark.parametrize("dtype", FP8)
def test_write_stores_one_byte_and_hands_back_the_stored_values(dtype):
    cache = KVCache(3, 2, 4, 2, 8, dtype, compute_dtype=torch.float32)
    assert cache.block_bytes == 2 * 2 * 4 * 2 * 8  # layers x planes x block x heads x dims, 1 byte each
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
def test_kv_cache_dtype_names():
    assert kv_storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_storage_dtype("fp8", torch.float32) == kv_storage_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert kv_storage_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    assert [kv_dtype_name(d) for d in (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float32)] == \
        ["fp8_e4m3", "fp8_e5m2", "bfloat16", "float32"]
    assert to_fp8(torch.tensor([1e9]), torch.float8_e5m2).float().item() == 57344.0
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2, got 'int8'"):
        EngineConfig(kv_cache_dtype="int8")
