"""The int8 / int4 weight-only linears (atomd/model/quant.py, atomd/kernels/csrc/quant.c) against a numpy
dequantise-then-matmul reference, on random packed weights: odd sizes, every group size, with
and without zero points, an act-order permutation; batch-1 GEMV, small-M GEMM and the tiled
path; under every ATOMD_KERNEL_ISA narrowing and with no kernels at all (torch)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from atomd.kernels import cbuild
from atomd.model import quant
from tests.cpu_builds import ISAS

pytestmark = pytest.mark.unit
PATHS = [*ISAS, "torch"]


@pytest.fixture(params=PATHS)
def lib(request):
    if request.param == "torch":
        return None
    built = quant.build_kernels(request.param)
    assert built is not None, f"the quant kernels did not build for {request.param}"
    return built


def random_weight(rng, bits, n, k, group, zero_points):
    """(values, scales, offsets or None) as a checkpoint would hold them, float64 for the reference."""
    groups = -(-k // group)
    values = rng.integers(-128, 128, (n, k)) if bits == 8 else rng.integers(0, 16, (n, k))
    scales = rng.uniform(0.001, 0.02, (n, groups))
    offsets = -rng.integers(0, 16 if bits == 4 else 8, (n, groups)) * scales if zero_points else None
    return values, scales.astype(np.float32), None if offsets is None else offsets.astype(np.float32)


def reference(x, values, scales, offsets, group):
    k = values.shape[1]
    expand = lambda t: np.repeat(t.astype(np.float64), group, axis=1)[:, :k]  # noqa: E731
    w = values * expand(scales) + (0 if offsets is None else expand(offsets))
    return x.astype(np.float64) @ w.T


CASES = [  # bits, N, K, group (K: per channel), zero points
    (8, 37, 101, 101, False), (8, 45, 256, 32, True), (8, 19, 200, 64, False), (8, 21, 384, 128, True),
    (4, 37, 96, 32, True), (4, 29, 192, 64, False), (4, 33, 256, 128, True), (4, 7, 160, 32, False),
]


@pytest.mark.parametrize("bits,n,k,group,zero_points", CASES)
@pytest.mark.parametrize("m", [1, 3, 8, 9, 40])
def test_qlinear_equals_numpy_dequantise_then_matmul(lib, bits, n, k, group, zero_points, m):
    rng = np.random.default_rng(n * k + m)
    values, scales, offsets = random_weight(rng, bits, n, k, group, zero_points)
    w = quant.pack(torch.from_numpy(values), torch.from_numpy(scales),
                   None if offsets is None else torch.from_numpy(offsets), bits, group)
    x = rng.standard_normal((m, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    out = quant.qlinear(torch.from_numpy(x), w, torch.from_numpy(bias), lib=lib)
    ref = reference(x, values, scales, offsets, group) + bias
    assert out.shape == (m, n) and out.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_tiles_cover_every_row(lib, monkeypatch):
    """Past QGEMM_MAX_M rows the weight goes to BLAS in tiles: several of them, the last short."""
    monkeypatch.setattr(quant, "TILE_FLOATS", 64 * 20)  # 20 rows of K 64 a tile: 53 rows in 3 tiles
    rng = np.random.default_rng(2)
    values, scales, offsets = random_weight(rng, 4, 53, 64, 32, True)
    w = quant.pack(torch.from_numpy(values), torch.from_numpy(scales), torch.from_numpy(offsets), 4, 32)
    x = rng.standard_normal((quant.QGEMM_MAX_M + 3, 64)).astype(np.float32)
    ref = reference(x, values, scales, offsets, 32)
    np.testing.assert_allclose(quant.qlinear(torch.from_numpy(x), w, lib=lib).numpy(), ref, rtol=1e-4,
                               atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("bits", [8, 4])
def test_act_order_permutation_gathers_the_input_columns(lib, bits):
    """A GPTQ desc_act weight: kernel column c holds the checkpoint's input perm[c]."""
    rng = np.random.default_rng(bits)
    n, k, group = 24, 128, 32
    values, scales, offsets = random_weight(rng, bits, n, k, group, True)
    perm = rng.permutation(k)
    w = quant.pack(torch.from_numpy(values), torch.from_numpy(scales), torch.from_numpy(offsets), bits, group,
                   perm=torch.from_numpy(perm))
    x = rng.standard_normal((2, k)).astype(np.float32)
    ref = reference(x[:, perm], values, scales, offsets, group)
    np.testing.assert_allclose(quant.qlinear(torch.from_numpy(x), w, lib=lib).numpy(), ref, rtol=1e-4,
                               atol=1e-5 * np.abs(ref).max())
    dense = x.astype(np.float64) @ w.dequantize().double().numpy().T  # dequantize() undoes the permutation
    np.testing.assert_allclose(dense, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


def test_bf16_activations_come_back_in_bf16(lib):
    rng = np.random.default_rng(0)
    values, scales, offsets = random_weight(rng, 4, 16, 64, 32, True)
    w = quant.pack(torch.from_numpy(values), torch.from_numpy(scales), torch.from_numpy(offsets), 4, 32)
    x = torch.from_numpy(rng.standard_normal((1, 64)).astype(np.float32)).bfloat16()
    out = quant.qlinear(x, w, lib=lib)
    ref = reference(x.float().numpy(), values, scales, offsets, 32)
    assert out.dtype == torch.bfloat16
    np.testing.assert_allclose(out.float().numpy(), ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())


def numpy_bf16(w):
    """float32 -> bfloat16 round to nearest even, back as float32 (the top 16 bits kept; no NaNs here)."""
    u = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def numpy_rtn(w, method):
    """Round-to-nearest as documented on quant.quantize, written again in numpy, dequantised;
    float32 like the engine's, so every rounding decision is the same."""
    w = w.astype(np.float32)
    if method == "bf16":
        return numpy_bf16(w)
    if method == "int8":
        s = np.abs(w).max(axis=1, keepdims=True) / np.float32(127)
        s[s == 0] = 1
        return np.clip(np.round(w / s), -127, 127) * s
    n, k = w.shape
    group = next(g for g in (128, 64, 32) if k % g == 0)
    g = w.reshape(n, k // group, group)
    lo, hi = np.minimum(g.min(axis=2, keepdims=True), 0), np.maximum(g.max(axis=2, keepdims=True), 0)
    s = (hi - lo) / np.float32(15)
    s[s == 0] = 1
    z = np.clip(np.round(-lo / s), 0, 15)
    return ((np.clip(np.round(g / s) + z, 0, 15) - z) * s).reshape(n, k)


@pytest.mark.parametrize("method,k", [("int8", 75), ("int4", 192), ("int4", 96), ("int4", 576)])
def test_round_to_nearest_matches_a_numpy_quantiser(method, k):
    w = np.random.default_rng(k).standard_normal((40, k)).astype(np.float32) * 0.05
    w[3] = 0  # an all-zero row: scale 1, not a division by zero
    packed = quant.quantize(torch.from_numpy(w), method)
    np.testing.assert_allclose(packed.dequantize().double().numpy(), numpy_rtn(w, method), rtol=1e-5, atol=1e-7)
    assert packed.nbytes() < w.nbytes / (3.5 if method == "int8" else 5)  # packed, not a float copy


def test_bad_layouts_are_refused_by_name():
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.pack(torch.zeros(4, 48, dtype=torch.int32), torch.ones(4, 3), None, 4, 16)
    with pytest.raises(ValueError, match="3-bit"):
        quant.pack(torch.zeros(4, 64, dtype=torch.int32), torch.ones(4, 2), None, 3, 32)
    with pytest.raises(ValueError, match="divisible by 32"):
        quant.quantize(torch.ones(4, 40), "int4")


def test_each_narrowing_builds_its_vector_path():
    """The narrowings really reach the AVX2 loop (an AVX-512 CPU would otherwise test one path)."""
    avx512 = {"avx512f", "avx512bw", "avx512vl"} <= cbuild.cpu_flags()
    for isa in cbuild.ISA_FLAGS:
        path = quant.PATHS[quant.build_kernels(isa).atomd_quant_path()]
        assert path == ("AVX-512" if avx512 and isa != "no-avx512" else "AVX2")
