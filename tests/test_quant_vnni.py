"""int8 activations as the AVX512-VNNI GEMM (atomd/kernels/csrc/quant_vnni.h): on a CPU with VNNI but no
AMX-INT8 (the no-amx and no-bf16-dot builds stand for AMD EPYC and the Intel AVX-512/VNNI Xeons), from
quant.QGEMM_VNNI_MIN_M rows of x on, int8 / int4 weights times int8 activations run as a register-blocked
GEMM instead of the VNNI rows (up to QGEMM_Q8_MAX_M) and the float tiles (past it). The rows' contract: x
quantised per act block as quantize_row_q8 does (checked to the bit on a weight whose products are exact),
exact int32 act-block dots, only the float sums in another order: against numpy of that arithmetic and against
the VNNI rows within 1e-5 / 2e-5 of the terms' magnitudes, on odd M (a short last set of rows), N not a
multiple of the 32-column strips, K not a multiple of 64, int8 per channel and per group, int4 groups of
32 / 64 / 128, zero points; a row's bits do not depend on the rows beside it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from atomd.kernels import cbuild
from atomd.model import quant
from tests.test_quant_int8_activations import numpy_checked

pytestmark = pytest.mark.unit


@pytest.fixture(params=["no-amx", "no-bf16-dot"])
def lib(request):
    if not {"avx512bw", "avx512vl", "avx512_vnni"} <= cbuild.cpu_flags():
        pytest.skip("the CPU has no AVX512-VNNI: no VNNI GEMM to build (the rows and float tiles run)")
    built = quant.build_kernels(request.param)
    assert built is not None and built.vnni and not built.amx, f"{request.param}: the VNNI GEMM without AMX tiles"
    return built


@pytest.fixture
def rows(monkeypatch):
    """A callable: qlinear on the VNNI rows at any M (the GEMM off)."""
    def run(x, w, lib):
        with monkeypatch.context() as m:
            m.setattr(quant, "QGEMM_VNNI_MIN_M", 1 << 30)
            m.setattr(quant, "QGEMM_Q8_MAX_M", 1 << 30)
            return quant.qlinear(x, w, lib=lib)
    return run


CASES = [  # bits, N, K, group (K: per channel), zero points; act blocks by the group (quant.act_block_of)
    (8, 37, 96, 96, False), (8, 45, 160, 32, True), (8, 70, 1088, 64, True), (8, 33, 1536, 1536, False),
    (4, 37, 96, 32, True), (4, 29, 192, 64, False), (4, 65, 640, 128, True), (4, 7, 160, 32, False),
]


@pytest.mark.parametrize("bits,n,k,group,zero_points", CASES)
@pytest.mark.parametrize("m", [quant.QGEMM_VNNI_MIN_M, 13, quant.QGEMM_Q8_MAX_M + 5])
def test_gemm_equals_numpy_and_the_vnni_rows(lib, rows, bits, n, k, group, zero_points, m):
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
    output has the same bits in any batch of QGEMM_VNNI_MIN_M rows or more (a prompt's rows beside others)."""
    torch.manual_seed(5)
    w = quant.quantize(torch.randn(100, 384) * 0.05, method)
    assert quant.use_int8_activations([w]) == 1
    x = torch.randn(90, 384)
    whole = quant.qlinear(x, w, lib=lib)
    for part in (slice(0, 4), slice(7, 20), slice(33, 90)):
        assert torch.equal(quant.qlinear(x[part], w, lib=lib), whole[part])


def test_gemm_only_without_amx_tiles_and_with_vnni():
    """The GEMM is built where the build has VNNI (native included: it runs there if Linux refuses the AMX
    tiles, which come first); a build without VNNI answers 1 (nothing read) and keeps the rows."""
    novnni = quant.build_kernels("native", vnni=False)
    assert not novnni.vnni
    assert novnni.atomd_qgemm_vnni(None, 0, 0, None, 8, None, None, 0, 0, 32, 32, None, 0, None, None, None, 1) == 1
