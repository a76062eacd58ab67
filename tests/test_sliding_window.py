"""Sliding-window attention (a per-layer window, None = global) against references.

Kernels: the C decode and prefill kernels with a window against a float64 torch reference
with transformers' mask (position p sees keys p - window < j <= p), float32 and bfloat16,
under every $ATOMD_KERNEL_ISA narrowing this CPU allows (the kernels' code paths of the
three CPU kinds and AVX2), on a shuffled paged cache whose blocks before each window are
garbage (NaN): a kernel that reads a block outside the window fails.
"""
from __future__ import annotations

import pytest
import torch

from atomd import cbuild, native
from atomd.kv_cache import KVCache

ISAS = list(cbuild.ISA_FLAGS)


def windowed_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                       window: int | None, scale: float) -> torch.Tensor:
    """float64 softmax attention of q [R, H, D] at `positions` over keys, values [L, KV, D]
    (key j at position j), each row seeing keys p - window < j <= p."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    keys, values = keys.nan_to_num(), values.nan_to_num()  # the freed blocks' garbage: masked out below
    k = keys.double().repeat_interleave(heads // kv_heads, dim=1)
    v = values.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("rhd,lhd->rhl", q.double(), k) * scale
    j, p = torch.arange(keys.shape[0]).unsqueeze(0), positions.unsqueeze(1)
    allowed = (j <= p) & ((p - j < window) if window else True)
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    return torch.einsum("rhl,lhd->rhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


def _kernels(isa, head_dim, group):
    lib = native.attention_kernels(head_dim, group, isa=isa)
    if lib is None:
        pytest.skip("no C compiler here: the kernels cannot be built")  # the torch path is tested elsewhere
    return lib


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.unit
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (8, 1, 64)])
@pytest.mark.parametrize("window", [1, 5, 16, 37, None])
def test_decode_kernel_window_equals_reference(isa, dtype, heads, kv_heads, head_dim, window):
    torch.manual_seed(heads + head_dim + (window or 0))
    block = 16
    lens = torch.tensor([1, 15, 16, 17, 40, 100], dtype=torch.int64)  # inside, at and past the window
    width = int(-(-lens.max() // block))
    cache = KVCache(len(lens) * width + 3, 2, block, kv_heads, head_dim, dtype=dtype)
    cache.kv.normal_()
    tables = torch.randperm(cache.num_blocks)[:len(lens) * width].view(len(lens), width).contiguous()
    scale = 0.7 / head_dim ** 0.5  # not the default: query_pre_attn_scalar
    if window:  # blocks wholly before every window: garbage a kernel must not read (freed blocks)
        for b, n in enumerate(lens.tolist()):
            for i in range(max(0, n - window) // block):
                cache.kv[tables[b, i]] = float("nan")
    lib = _kernels(isa, head_dim, heads // kv_heads)
    for layer in range(2):
        q = (torch.randn(len(lens), heads, head_dim) * 3).to(dtype)
        got = native.decode_attention(lib, q, cache, layer, tables, lens, window=window, scale=scale)
        for b, n in enumerate(lens.tolist()):
            keys, values = cache.gather(layer, tables[b], n)
            want = windowed_reference(q[b:b + 1], keys.transpose(0, 1), values.transpose(0, 1),
                                      torch.tensor([n - 1]), window, scale)
            torch.testing.assert_close(got[b:b + 1].double(), want, **TOL[dtype])


@pytest.mark.unit
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 5, 37, 64, 100])
def test_decode_kernel_window_with_drafts(isa, dtype, window):
    """Speculative verify: rows of one sequence at consecutive positions, each its own window."""
    torch.manual_seed(window)
    heads, kv_heads, head_dim, block = 4, 2, 32, 16
    lens, drafts = torch.tensor([9, 70, 130], dtype=torch.int64), [1, 4, 3]
    width = int(-(-lens.max() // block))
    cache = KVCache(len(lens) * width, 1, block, kv_heads, head_dim, dtype=dtype)
    cache.kv.normal_()
    tables = torch.randperm(cache.num_blocks).view(len(lens), width).contiguous()
    starts = torch.tensor([0, *torch.tensor(drafts).cumsum(0).tolist()], dtype=torch.int64)
    q = (torch.randn(int(starts[-1]), heads, head_dim) * 3).to(dtype)
    lib = _kernels(isa, head_dim, heads // kv_heads)
    got = native.decode_attention(lib, q, cache, 0, tables, lens, starts, window=window)
    for b, n in enumerate(lens.tolist()):
        keys, values = cache.gather(0, tables[b], n)
        rows = slice(int(starts[b]), int(starts[b + 1]))
        positions = torch.arange(n - drafts[b], n)
        want = windowed_reference(q[rows], keys.transpose(0, 1), values.transpose(0, 1), positions, window,
                                  head_dim ** -0.5)
        torch.testing.assert_close(got[rows].double(), want, **TOL[dtype])


@pytest.mark.unit
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (8, 1, 64), (3, 3, 16)])
@pytest.mark.parametrize("window", [1, 7, 64, 65, 150, None])
def test_prefill_kernel_window_equals_reference(isa, dtype, heads, kv_heads, head_dim, window):
    torch.manual_seed(heads * head_dim + (window or 0))
    lens = [1, 15, 17, 70, 130, 200]  # under, at and over a query tile, a key tile and the window
    total = sum(lens)
    q = (torch.randn(total, heads, head_dim) * 2).to(dtype)
    k = (torch.randn(total, kv_heads, head_dim) * 2).to(dtype)
    v = torch.randn(total, kv_heads, head_dim).to(dtype)
    starts = torch.tensor([sum(lens[:i]) for i in range(len(lens))])
    lib = _kernels(isa, head_dim, heads // kv_heads)
    out = torch.full((total, heads * head_dim), float("nan"), dtype=dtype)
    scale = 1.3 / head_dim ** 0.5
    native.prefill_attention(lib, q, k, v, out, starts, torch.tensor(lens), window=window, scale=scale)
    for s, n in zip(starts.tolist(), lens):
        rows = slice(s, s + n)
        want = windowed_reference(q[rows], k[rows], v[rows], torch.arange(n), window, scale)
        torch.testing.assert_close(out[rows].double(), want, **TOL[dtype])
