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
