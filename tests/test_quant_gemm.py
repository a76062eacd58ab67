"""int8 activations as a register-blocked GEMM (atomd/kernels/csrc/quant_gemm.h) on the CPUs without
AMX-INT8: its AVX512-VNNI half (quant_vnni.h; the no-amx and no-bf16-dot builds stand for AMD EPYC and the
Intel AVX-512/VNNI Xeons) and its AVX2 half (quant_gemm_avx2.h; the no-avx512 build, what an AVX2-only CPU
runs, on every CPU here). From quant.q8_gemm_min_m rows of x on, int8 / int4 weights times int8 activations
run as the GEMM instead of the int8-activation rows (up to QGEMM_Q8_MAX_M) and the float tiles (past it).
The rows' contract: x quantised per act block as quantize_row_q8 does (checked to the bit on a weight whose
products are exact), exact int32 act-block dots, only the float sums in another order: against numpy of that
arithmetic and against the rows within 1e-5 / 2e-5 of the terms' magnitudes, on odd M (a short last set of
rows), N not a multiple of the strips (32 / 8 columns), K not a multiple of 64, int8 per channel and per
group, int4 groups of 32 / 64 / 128, zero points; a row's bits do not depend on the rows beside it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from atomd.kernels import cbuild
from atomd.model import quant
from tests.cpu_builds import ISAS
from tests.test_quant_int8_activations import numpy_checked

pytestmark = pytest.mark.unit


def gemm_builds() -> list[str]:
    """The narrowings whose build has a GEMM on this CPU: VNNI where the CPU has it, AVX2 on every CPU here."""
    flags = cbuild.cpu_flags()
    vnni = ["no-amx", "no-bf16-dot"] if {"avx512bw", "avx512vl", "avx512_vnni"} <= flags else []
    return vnni + (["no-avx512"] if {"avx2", "fma"} <= flags else [])


@pytest.fixture(params=gemm_builds())
def lib(request):
    built = quant.build_kernels(request.param)
    expect = 1 if request.param == "no-avx512" else 3  # quant.Q8_PATHS: AVX2, AVX512-VNNI
    assert built is not None and built.q8_gemm == expect and not built.amx, f"{request.param}: no GEMM"
    return built


@pytest.fixture
def rows(monkeypatch):
    """A callable: qlinear on the int8-activation rows at any M (the GEMM off)."""
    def run(x, w, lib):
        with monkeypatch.context() as m:
            m.setattr(quant, "QGEMM_VNNI_MIN_M", 1 << 30)
            m.setattr(quant, "QGEMM_AVX2_GEMM_MIN_M", {4: 1 << 30, 8: 1 << 30})
            m.setattr(quant, "QGEMM_Q8_MAX_M", 1 << 30)
            return quant.qlinear(x, w, lib=lib)
    return run


CASES = [  # bits, N, K, group (K: per channel), zero points; act blocks by the group (quant.act_block_of)
    (8, 37, 96, 96, False), (8, 45, 160, 32, True), (8, 70, 1088, 64, True), (8, 33, 1536, 1536, False),
    (4, 37, 96, 32, True), (4, 29, 192, 64, False), (4, 65, 640, 128, True), (4, 7, 160, 32, False),
]


@pytest.mark.parametrize("bits,n,k,group,zero_points", CASES)
@pytest.mark.parametrize("m", [max(quant.QGEMM_VNNI_MIN_M, *quant.QGEMM_AVX2_GEMM_MIN_M.values()), 21, quant.QGEMM_Q8_MAX_M + 5])
def test_gemm_equals_numpy_and_the_rows(lib, rows, bits, n, k, group, zero_points, m):
    w, x, out, bound = numpy_checked(lib, bits, n, k, group, zero_points, m)
    ref = rows(torch.from_numpy(x), w, lib).numpy()
    assert np.all(np.abs(out - ref) <= 2e-5 * bound + 1e-6), np.abs(out - ref).max()


@pytest.mark.parametrize("k,group", [(256, 256), (320, 64)])
def test_x_quantised_as_the_rows_quantise_it(lib, rows, k, group):
    """A weight whose products are exact in float32: int4 identity rows (y[m, n] = d[m, a] * xq[m, n], one
    non-zero term) and a zero row of offset 1 per group (y = sum_g xsg[m, g]: one term a group, the
    groups' terms in the rows' order for one group), scales 1: the GEMM's output equals the rows' to the
    bit, so x's int8 values, d and xsg are quantize_row_q8's."""
    values = np.zeros((k + 1, k), np.int64)
    values[np.arange(k), np.arange(k)] = 1
    offsets = torch.zeros(k + 1, k // group)
    offsets[k] = 1.0
    w = quant.pack(torch.from_numpy(values), torch.ones(k + 1, k // group), offsets, 4, group)
    assert quant.use_int8_activations([w]) == 1
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(3))
    x[2, 5] = 40.0  # an outlier: its block rounds coarsely
    x[4, :64] = 0.0  # an all-zero block
    out, ref = quant.qlinear(x, w, lib=lib), rows(x, w, lib)
    assert torch.equal(out[:, :k], ref[:, :k])
    if k == group:
        assert torch.equal(out[:, k], ref[:, k])


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_row_gives_the_same_bits_at_any_m(lib, method):
    """Rows of x are independent in the GEMM (6 at a time, any split of the columns over threads): a row's
    output has the same bits in any batch of q8_gemm_min_m rows or more (a prompt's rows beside others)."""
    torch.manual_seed(5)
    w = quant.quantize(torch.randn(100, 384) * 0.05, method)
    assert quant.use_int8_activations([w]) == 1
    x = torch.randn(90, 384)
    whole = quant.qlinear(x, w, lib=lib)
    for part in (slice(0, quant.q8_gemm_min_m(lib, w.bits)), slice(7, 30), slice(33, 90)):
        assert torch.equal(quant.qlinear(x[part], w, lib=lib), whole[part])


@pytest.mark.parametrize("isa,vnni", [(i, v) for i in ISAS for v in (True, False)])
def test_gemm_where_the_build_has_vnni_or_avx2(isa, vnni):
    """The GEMM is built where the build has VNNI (native included: it runs there if Linux refuses the AMX
    tiles, which come first) or, without AVX-512, AVX2; an AVX-512 build without VNNI has none: it answers 1
    (nothing read) and keeps the rows."""
    built = quant.build_kernels(isa, vnni)
    assert built.q8_gemm == built.atomd_quant_q8_path() in (3, 1) or (built.q8_gemm == 0 and
                                                                       built.atomd_quant_q8_path() == 2)
    if not built.q8_gemm:
        assert built.atomd_qgemm_q8_gemm(None, 0, 0, None, 8, None, None, 0, 0, 32, 32, None, 0, None, None, None, 1) == 1


@pytest.fixture
def avx2():
    """The AVX2 build (what an AVX2-only CPU runs; every CPU here has one): the build that holds an int8 / int4
    weight as its GEMM's strips alone (quant.keep_strips_only: the MoE experts, DecoderModel._strips_only)."""
    built = quant.build_kernels("no-avx512")
    assert built is not None and built.q8_gemm == 1 and built.w16_panels == 2
    return built


@pytest.mark.parametrize("bits,n,k,group,zero_points", CASES + [(4, 9, 1088, 64, True), (8, 16, 256, 128, False)])
def test_weights_held_as_strips_are_the_gemm_at_every_m(avx2, monkeypatch, bits, n, k, group, zero_points):
    """A weight held as its strips (int4 two values a byte, each strip's scales and offsets beside it): its values
    and dequantised floats unpacked from them are the loaded ones exactly, and qlinear over them at any M (one
    row, the int8-activation rows' counts, a short last set of rows, past QGEMM_Q8_MAX_M) equals to the bit the
    per-call GEMM over the loaded rows (the same micro-kernel sums), and numpy of the arithmetic within 2e-5 of the
    terms' magnitudes (the GEMM's bound, test_gemm_equals_numpy_and_the_rows), with 1 and 2 threads (the strips split
    between them)."""
    for m in [1, 2, 3, 5, 8, 21, quant.QGEMM_Q8_MAX_M + 5]:
        w, x, out, bound = numpy_checked(avx2, bits, n, k, group, zero_points, m)  # (a weight and x of m's own)
        loaded = quant.QuantizedWeight(w.bits, w.q.clone(), w.scales, w.offsets, w.group_size, w.in_features,
                                       int8_activations=True, act_block=w.act_block)
        values, floats = w.int_values(), w.dequantize()
        assert quant.keep_strips_only(w, avx2) > 0 and w.strips_only and w.q.numel() == 0
        assert torch.equal(w.int_values(), values) and torch.equal(w.dequantize(), floats)
        assert quant.keep_strips_only(w, avx2) == 0  # (held already: nothing to do)
        x = torch.from_numpy(x)
        with monkeypatch.context() as patch:
            patch.setattr(quant, "QGEMM_AVX2_GEMM_MIN_M", {4: 1, 8: 1})  # the loaded rows: the GEMM at every m
            for threads in (1, 2):
                patch.setattr(torch, "get_num_threads", lambda: threads)
                assert quant.product_of(avx2, w, m) == "q8_held"
                held = quant.qlinear(x, w, lib=avx2)
                assert torch.equal(held, quant.qlinear(x, loaded, lib=avx2)), (m, threads)
                assert np.all(np.abs(held.numpy() - out) <= 2e-5 * bound + 1e-6), (m, np.abs(held.numpy() - out).max())


def test_held_strips_are_read_by_their_build_only(avx2):
    """A weight held as the AVX2 build's strips is refused by name by a build of another layout, and a weight with
    float activations or an act-order permutation is not held (its rows stay)."""
    torch.manual_seed(2)
    w = quant.quantize(torch.randn(24, 128) * 0.05, "int4")
    assert not quant.keep_strips_only(w, avx2)  # float activations: the int rows read it
    quant.use_int8_activations([w])
    assert quant.keep_strips_only(w, avx2)
    w.panels_layout = 1  # as an AVX-512 build's (its 32-row panels) would see the strips
    with pytest.raises(RuntimeError, match="strips only"):
        quant.qlinear(torch.randn(1, 128), w, lib=avx2)
    p = quant.quantize(torch.randn(24, 128) * 0.05, "int8")
    quant.use_int8_activations([p])
    p.perm = torch.randperm(128)
    assert not quant.keep_strips_only(p, avx2)
