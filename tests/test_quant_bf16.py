"""`--quantization bf16` / `fp16`: 16-bit weights widened to float32 in registers (csrc/quant.h
row_b16 / row_h16), float32 activations and sums, against numpy under every ATOMD_KERNEL_ISA narrowing (the CPU
without AVX512_BF16 is the one this path is for) and with no kernels (torch): the widening
exact (a one-hot input gives back the stored column bit for bit: float16 subnormals and the
vector loops' scalar tails included), the products within float32 summation order of float64
numpy on the same 16-bit values, at batch 1, small M and the tiled path; the fused batch-1
decode layer over 16-bit weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from atomd.kernels import cbuild
from atomd.model import quant
from tests.cpu_builds import ISAS
from tests.test_quant_kernels import lib, numpy_bf16  # noqa: F401 (lib: the kernels per ISA path, a fixture)

pytestmark = pytest.mark.unit


FORMATS = ("bf16", "fp16")


def numpy_16(w: np.ndarray, fmt: str) -> np.ndarray:
    """The values the format stores, as float32 (numpy's own rounding, to nearest even)."""
    return numpy_bf16(w) if fmt == "bf16" else w.astype(np.float16).astype(np.float32)


def weight16(rng, n, k, fmt="bf16"):
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[:, -3:] *= 1e-4  # the last columns (a scalar tail): float16 subnormals (below 6.1e-5)
    return w, quant.quantize(torch.from_numpy(w), fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_16_bits_is_half_the_bytes_rounded_to_nearest_even(fmt):
    rng = np.random.default_rng(0)
    w, packed = weight16(rng, 33, 70, fmt)
    assert packed.bits == 16 and packed.q.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[fmt]
    assert packed.nbytes() == w.nbytes // 2
    np.testing.assert_array_equal(packed.dequantize().numpy(), numpy_16(w, fmt))
    assert not packed.int8_activations_fit()  # no integer path for 16-bit weights


def test_fp16_refuses_values_beyond_its_range():
    w = torch.zeros(4, 8)
    w[1, 2] = 70000.0
    with pytest.raises(ValueError, match="beyond float16's range.*use bf16"):
        quant.quantize(w, "fp16")
    assert quant.quantize(w, "bf16").bits == 16


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(37, 101), (16, 64), (45, 576), (7, 33), (5, 8), (3, 40)])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 40])
def test_16_bit_linear_equals_numpy_on_the_same_values(lib, fmt, n, k, m):
    rng = np.random.default_rng(n * k + m)
    w, packed = weight16(rng, n, k, fmt)
    x = rng.standard_normal((m, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    out = quant.qlinear(torch.from_numpy(x), packed, torch.from_numpy(bias), lib=lib)
    ref = x.astype(np.float64) @ numpy_16(w, fmt).astype(np.float64).T + bias
    assert out.shape == (m, n) and out.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", [*FORMATS, "int8"])
@pytest.mark.parametrize("n,k", [(37, 101), (45, 576), (5, 8)])
def test_the_rows_sum_a_row_alone_as_in_a_batch(isa, fmt, n, k):
    """The C rows (16-bit weights and float-activation int8, below the panels and tiles) sum each row
    of x in the same operations whatever rows run beside it, scalar tails included (int8: per channel, K any): a sequence's logits do
    not depend on whether it decodes alone (torch's BLAS, the fallback without kernels, promises no such thing)."""
    lib = quant.build_kernels(isa)
    rng = np.random.default_rng(n + k)
    packed = quant.quantize(torch.from_numpy((rng.standard_normal((n, k)) * 0.05).astype(np.float32)), fmt)
    x = torch.from_numpy(rng.standard_normal((3, k)).astype(np.float32))
    one = quant.qlinear(x[:1], packed, lib=lib)
    assert torch.equal(one[0], quant.qlinear(x, packed, lib=lib)[0])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 5, quant.QGEMM_MAX_M + 1])
def test_widening_is_exact(lib, fmt, m):
    """x = one-hot rows: each output is one stored weight, widened; equal bit for bit (the
    last columns, a scalar tail of the vector loop, hold float16 subnormals)."""
    rng = np.random.default_rng(m)
    w, packed = weight16(rng, 29, 83, fmt)
    cols = np.concatenate([rng.integers(0, 80, m - min(m, 3)), [80, 81, 82][:min(m, 3)]])
    x = np.zeros((m, 83), np.float32)
    x[np.arange(m), cols] = 1.0
    out = quant.qlinear(torch.from_numpy(x), packed, lib=lib).numpy()
    np.testing.assert_array_equal(out, numpy_16(w, fmt)[:, cols].T)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_fused_decode_layer_reads_16_bit_weights(monkeypatch, fmt):
    """One decoder layer at batch 1 through atomd_decode_layer_*_q_f32 over 16-bit weights
    equals numpy on the same widened weights, under every narrowing."""
    from atomd.model import layer_ops
    from atomd.model.default import default_model_dir
    from atomd.model.loader import load_model

    for isa in cbuild.ISA_FLAGS:
        monkeypatch.setenv(cbuild.ISA_ENV, isa)
        if not layer_ops.has_decode_layer(torch.float32):  # no fused layer in this build
            continue
        model = load_model(default_model_dir(), quantization=fmt)
        w, cfg = model.layers[0], model.config
        assert all(isinstance(t, quant.QuantizedWeight) and t.bits == 16 for t in w.linears())
        assert all(t.q.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[fmt] for t in w.linears())
        fused = layer_ops.DecodeLayer(torch.float32, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                                      cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, quantized=True)
        rng = np.random.default_rng(1)
        attn = torch.from_numpy(rng.standard_normal((1, cfg.q_size)).astype(np.float32))
        x = torch.from_numpy(rng.standard_normal((1, cfg.hidden_size)).astype(np.float32))
        x_fused, next_h = x.clone(), torch.empty_like(x)
        fused.tail(attn, x_fused, (w.qkv, w.o, w.gate_up, w.down), w.post_norm, None, next_h)
        # the same layer tail per op, numpy on the widened weights
        dq = lambda t: t.dequantize().double().numpy()  # noqa: E731
        r = x.double().numpy() + attn.double().numpy() @ dq(w.o).T
        h = r / np.sqrt((r ** 2).mean() + cfg.rms_norm_eps) * w.post_norm.double().numpy()
        gu = h @ dq(w.gate_up).T
        g, u = gu[:, :cfg.intermediate_size], gu[:, cfg.intermediate_size:]
        want = r + (g / (1 + np.exp(-g)) * u) @ dq(w.down).T
        np.testing.assert_allclose(x_fused.numpy(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


# ---- many rows: the packed, widened weight panels (csrc/quant_w16.h, atomd_qgemm_b16_panels / _h16_panels) ----
PANEL_CASES = [  # m, n, k: rows of x not a multiple of the micro-kernel's 14 (and fewer than it), weight rows not a
    # multiple of the 32-row panel (1, 37, 45, 450), inputs not a multiple of the 16-input transposes (101, 33, 257, 8),
    # two k-blocks (1100 > W16_KC), two packed blocks of panels a thread (600 inputs: 13 panels a 1 MiB block)
    (1, 37, 101), (13, 32, 16), (17, 45, 576), (29, 1, 33), (31, 70, 1100), (45, 450, 600), (7, 5, 8), (20, 64, 257),
    # AVX2's load-time strips in two blocks of x's rows (54 at K 1100) ending on a 4-row micro-kernel; 3 inputs only;
    # one row against a pair of strips whose second is partial (20 weight rows); 2 threads each a run of rows
    # (W16_AVX2_BY_ROWS: 256 rows a thread and more), the second ending on a 1-row micro-kernel
    (64, 37, 1100), (10, 19, 3), (1, 20, 33), (523, 37, 100),
]


def panel_builds() -> list[str]:
    """The narrowings with 16-bit panels (per call and packed at load) on this CPU: every one that keeps AVX-512
    (csrc/quant_w16.h), and no-avx512 (AVX2: quant_w16_avx2.h)."""
    flags = cbuild.cpu_flags()
    avx512 = [isa for isa in cbuild.ISA_FLAGS if isa != "no-avx512"] if {"avx512f", "avx512bw", "avx512vl"} <= flags else []
    return avx512 + (["no-avx512"] if {"avx2", "fma"} <= flags else [])


@pytest.fixture(params=panel_builds())
def panels_lib(request):
    """The kernels of each narrowing with the 16-bit panels (AVX-512: every form; AVX2: float32 x's)."""
    built = quant.build_kernels(request.param)
    assert built.w16_panels == (2 if request.param == "no-avx512" else 1)
    return built


@pytest.mark.skipif(not {"avx2", "fma"} <= cbuild.cpu_flags(), reason="this CPU has no AVX2 / FMA")
def test_avx2_build_has_no_bf16_x_panels_and_keeps_its_load_time_strips_at_any_m(monkeypatch):
    """The AVX2 build runs no bf16-x products (gemm_bf16_f32 answers None: torch's widened matmul runs them), packs
    16-bit weights at load in its own layout (16-row strips), and qlinear reads those at
    every M from QGEMM_W16_PREPACKED_MIN_M on (test_qlinear_packs_per_call_again_from_its_threshold: past
    QGEMM_W16_PER_CALL_MIN_M too), never the float32 tiles: the per-call panels' bits."""
    lib = quant.build_kernels("no-avx512")
    assert lib.w16_panels == 2
    rng = np.random.default_rng(3)
    w, packed = weight16(rng, 37, 101)
    assert quant.gemm_bf16_f32(torch.ones(3, 101, dtype=torch.bfloat16), torch.ones(37, 101, dtype=torch.bfloat16),
                               lib) is None
    assert quant.prepack_panels(packed, lib) == 48 * 101 * 2  # (16-row strips)
    assert quant.product_of(lib, packed, 2) == "w16_prepacked"
    packed.panels_layout = 1  # AVX-512's panels (packed before $ATOMD_KERNEL_ISA changed): not read by this build
    assert quant.product_of(lib, packed, 16) == "w16_panels" and quant.product_of(lib, packed, 2) == "w16_rows"
    packed.panels_layout = 2
    x = rng.standard_normal((40, 101)).astype(np.float32)
    calls, widen = [], lib.atomd_qdequant_b16
    monkeypatch.setattr(lib, "atomd_qdequant_b16", lambda *a: calls.append(a) or widen(*a))
    out = quant.qlinear(torch.from_numpy(x), packed, lib=lib).numpy()
    assert not calls
    np.testing.assert_array_equal(out, panels(lib, x, packed, 1))
    np.testing.assert_allclose(out, x.astype(np.float64) @ numpy_16(w, "bf16").astype(np.float64).T, rtol=1e-5, atol=1e-5)


def panels(lib, x: np.ndarray, packed: quant.QuantizedWeight, threads: int) -> np.ndarray:
    m, k = x.shape
    n = packed.q.shape[0]
    out = torch.full((m, n), float("nan"))
    xt = torch.from_numpy(np.ascontiguousarray(x))
    rc = getattr(lib, f"atomd_qgemm_{quant._w16(packed)}_panels")(xt.data_ptr(), k, m, packed.q.data_ptr(), n, k,
                                                                  out.data_ptr(), n, threads)
    assert rc == 0
    return out.numpy()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,k", PANEL_CASES)
def test_panels_equal_float64_numpy_within_the_float32_sum_bound(panels_lib, fmt, m, n, k):
    """y within K * 2^-24 * sum_k |x||w| of float64 numpy on the same 16-bit values (the bound of a float32 chain
    of FMAs, which is what each output is), every output written (NaN-filled before), at 1 and 2 threads
    bit for bit alike, and each row of x alone giving the same bits as in the batch (nothing depends on M)."""
    rng = np.random.default_rng(m * n + k)
    w, packed = weight16(rng, n, k, fmt)
    x = rng.standard_normal((m, k)).astype(np.float32)
    wv = numpy_16(w, fmt).astype(np.float64)
    ref, scale = x.astype(np.float64) @ wv.T, np.abs(x).astype(np.float64) @ np.abs(wv).T
    one = panels(panels_lib, x, packed, 1)
    assert np.all(np.abs(one - ref) <= k * 2.0 ** -24 * scale + 1e-30)
    np.testing.assert_array_equal(panels(panels_lib, x, packed, 2), one)
    for r in {0, m // 2, m - 1}:
        np.testing.assert_array_equal(panels(panels_lib, x[r:r + 1], packed, 1), one[r:r + 1])


@pytest.mark.parametrize("fmt", FORMATS)
def test_panels_widen_exactly_and_qlinear_takes_them_from_their_threshold(panels_lib, fmt):
    """One-hot rows of x give back the stored weights bit for bit (float16 subnormals in the last columns, which
    are the packing's scalar tail); qlinear from QGEMM_W16_MIN_M rows returns the panels' bits, plus the bias."""
    rng = np.random.default_rng(5)
    m = quant.QGEMM_W16_MIN_M
    w, packed = weight16(rng, 41, 83, fmt)
    cols = np.concatenate([rng.integers(0, 80, m - 3), [80, 81, 82]])
    x = np.zeros((m, 83), np.float32)
    x[np.arange(m), cols] = 1.0
    np.testing.assert_array_equal(panels(panels_lib, x, packed, 2), numpy_16(w, fmt)[:, cols].T)
    x = rng.standard_normal((m, 83)).astype(np.float32)
    bias = torch.from_numpy(rng.standard_normal(41).astype(np.float32))
    out = quant.qlinear(torch.from_numpy(x), packed, bias, lib=panels_lib)
    np.testing.assert_array_equal(out.numpy(), (torch.from_numpy(panels(panels_lib, x, packed, 1)) + bias).numpy())


# ---- the panels packed once at load (quant.prepack_panels, atomd_qgemm_b16_prepacked / _h16_prepacked) ----
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,k", PANEL_CASES)
def test_prepacked_panels_give_the_per_call_panels_bits(panels_lib, fmt, m, n, k):
    """The weight packed once at load (16-bit, widened in registers) gives the per-call panels' bits (tested against
    numpy above) at 1 and 2 threads: the same chain of FMAs over k per output, only the weight's layout differs;
    qlinear takes them from QGEMM_W16_PREPACKED_MIN_M rows once they are there."""
    rng = np.random.default_rng(m * n + k + 1)
    w, packed = weight16(rng, n, k, fmt)
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = panels(panels_lib, x, packed, 1)
    rows = 32 if panels_lib.w16_panels == 1 else 16  # (AVX-512's panels, AVX2's strips)
    assert quant.prepack_panels(packed, panels_lib) == (n + rows - 1) // rows * rows * k * 2
    xt = torch.from_numpy(x)
    for threads in (1, 2):
        out = torch.full((m, n), float("nan"))
        rc = getattr(panels_lib, f"atomd_qgemm_{quant._w16(packed)}_prepacked")(
            xt.data_ptr(), k, m, packed.panels.data_ptr(), n, k, out.data_ptr(), n, threads)
        assert rc == 0
        np.testing.assert_array_equal(out.numpy(), want)
    if m >= quant.QGEMM_W16_PREPACKED_MIN_M:
        np.testing.assert_array_equal(quant.qlinear(xt, packed, lib=panels_lib).numpy(), want)


def test_qlinear_packs_per_call_again_from_its_threshold(panels_lib, monkeypatch):
    """From QGEMM_W16_PER_CALL_MIN_M rows qlinear packs the weight per call (float32 panels) although its load-time
    panels are there; below it the load-time ones: the same bits either way (numpy-checked above)."""
    rng = np.random.default_rng(13)
    w, packed = weight16(rng, 45, 576)
    assert quant.prepack_panels(packed, panels_lib) > 0
    x = torch.from_numpy(rng.standard_normal((17, 576)).astype(np.float32))
    want = panels(panels_lib, x.numpy(), packed, 1)
    monkeypatch.setattr(quant, "QGEMM_W16_PER_CALL_MIN_M", 17)
    for m, kind in ((16, "prepacked"), (17, "panels" if panels_lib.w16_panels == 1 else "prepacked")):  # (AVX2: at any m)
        calls = {name: [] for name in ("panels", "prepacked")}
        for name, record in calls.items():
            fn = getattr(panels_lib, f"atomd_qgemm_b16_{name}")
            monkeypatch.setattr(panels_lib, f"atomd_qgemm_b16_{name}", lambda *a, fn=fn, record=record: record.append(a) or fn(*a))
        np.testing.assert_array_equal(quant.qlinear(x[:m], packed, lib=panels_lib).numpy(), want[:m])
        assert [name for name, record in calls.items() if record] == [kind]


@pytest.mark.skipif(not {"avx2", "fma"} <= cbuild.cpu_flags(), reason="this CPU has no AVX2 / FMA")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,inter,k", [(7, 32, 100), (523, 48, 576), (17, 16, 1100), (1, 32, 33)])
def test_avx2_gate_up_with_silu_is_the_product_then_silu_mul(fmt, m, inter, k):
    """atomd_qgemm_*_prepacked_silu (quant.qlinear_silu) on a gate_up weight's load-time strips: silu(x @ gate^T) *
    (x @ up^T) within float32 rounding of numpy's float64 on the same 16-bit values, and the bits of the product
    then layer_ops.silu_mul at 1 and 2 threads (rows split at 523, strips below; two k-blocks at 1100; one row);
    None where it does not run (an AVX-512 build, inter not a multiple of 16)."""
    from atomd.model import layer_ops

    lib = quant.build_kernels("no-avx512")
    rng = np.random.default_rng(m + inter + k)
    w, packed = weight16(rng, 2 * inter, k, fmt)
    assert quant.keep_strips_only(packed, lib) > 0  # (as an AVX2 model holds it: read at every M)
    x = rng.standard_normal((m, k)).astype(np.float32)
    wv = numpy_16(w, fmt).astype(np.float64)
    gate, up = x.astype(np.float64) @ wv[:inter].T, x.astype(np.float64) @ wv[inter:].T
    np.testing.assert_allclose(quant.qlinear_silu(torch.from_numpy(x), packed, lib=lib).numpy(),
                               gate / (1 + np.exp(-gate)) * up, rtol=1e-4, atol=1e-5)
    want = layer_ops.silu_mul(quant.qlinear(torch.from_numpy(x), packed, lib=lib))
    for threads in (1, 2):
        out = torch.full((m, inter), float("nan"))
        assert getattr(lib, f"atomd_qgemm_{quant._w16(packed)}_prepacked_silu")(
            x.ctypes.data, k, m, packed.panels.data_ptr(), inter, k, out.data_ptr(), inter, threads) == 0
        assert torch.equal(out, want)
    odd = weight16(rng, 2 * (inter + 8), k, fmt)[1]
    quant.keep_strips_only(odd, lib)
    assert quant.qlinear_silu(torch.from_numpy(x), odd, lib=lib) is None
    avx512 = quant.build_kernels("native")
    if avx512.w16_panels == 1:
        assert quant.qlinear_silu(torch.from_numpy(x), packed, lib=avx512) is None
        assert avx512.atomd_qgemm_b16_prepacked_silu(x.ctypes.data, k, m, packed.panels.data_ptr(), inter, k,
                                                     out.data_ptr(), inter, 1) == 1


@pytest.mark.skipif(not {"avx2", "fma"} <= cbuild.cpu_flags(), reason="this CPU has no AVX2 / FMA")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,k", [(7, 40, 100), (523, 48, 576), (17, 37, 1100), (1, 24, 33), (600, 576, 1536)])
def test_avx2_product_with_the_residual_add_and_norm_after_it(fmt, m, n, k):
    """atomd_qgemm_*_prepacked_norm (quant.qlinear_add_norm) on an output projection's load-time strips: res += x @
    w^T, out = RMSNorm(res) * norm_w, within float32 rounding of numpy's float64, and the bits of the product then
    layer_ops.rms_norm with it as delta (an AVX2 build of each) at 1 and 2 threads, the residual's rows outside the
    strided views untouched (rows split at 523 / 600 and normed per block, strips below and normed after; two
    k-blocks at 1100; one row); False where it does not run (an AVX-512 build)."""
    from atomd.model import layer_ops

    lib, norm_lib = quant.build_kernels("no-avx512"), layer_ops.build_kernels("no-avx512")
    rng = np.random.default_rng(m + n + k)
    w, packed = weight16(rng, n, k, fmt)
    assert quant.keep_strips_only(packed, lib) > 0  # (as an AVX2 model holds it: read at every M)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    res0 = torch.from_numpy(rng.standard_normal((m, n + 3)).astype(np.float32))  # (a residual's rows: stride n + 3)
    norm_w = torch.from_numpy(rng.uniform(0.5, 1.5, n).astype(np.float32))
    eps = 1e-5
    total = res0[:, :n].double().numpy() + x.double().numpy() @ numpy_16(w, fmt).astype(np.float64).T
    want_out = total / np.sqrt((total ** 2).mean(axis=1, keepdims=True) + eps) * norm_w.double().numpy()
    res = res0.clone()
    out = torch.empty(m, n)
    assert quant.qlinear_add_norm(x, packed, res[:, :n], norm_w, eps, out, lib=lib)
    np.testing.assert_allclose(res[:, :n].numpy(), total, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out.numpy(), want_out, rtol=1e-4, atol=1e-4)
    assert torch.equal(res[:, n:], res0[:, n:])
    assert not quant.qlinear_add_norm(x, packed, res[:, :n], norm_w, eps, torch.empty(m, n + 1), lib=lib)
    want_res, want, product = res0.clone(), torch.empty(m, n), quant.qlinear(x, packed, lib=lib)
    norm_lib.atomd_rms_norm_f32(want_res.data_ptr(), n + 3, product.data_ptr(), n,
                                norm_w.data_ptr(), want.data_ptr(), n, m, n, eps, 1)
    for threads in (1, 2):
        res, out = res0.clone(), torch.full((m, n), float("nan"))
        assert getattr(lib, f"atomd_qgemm_{quant._w16(packed)}_prepacked_norm")(
            x.data_ptr(), k, m, packed.panels.data_ptr(), n, k, res.data_ptr(), n + 3, norm_w.data_ptr(), eps,
            out.data_ptr(), n, threads) == 0
        assert torch.equal(res, want_res) and torch.equal(out, want)
    avx512 = quant.build_kernels("native")
    if avx512.w16_panels == 1:
        assert not quant.qlinear_add_norm(x, packed, res[:, :n], norm_w, eps, out, lib=avx512)
        assert avx512.atomd_qgemm_b16_prepacked_norm(x.data_ptr(), k, m, packed.panels.data_ptr(), n, k,
                                                     res.data_ptr(), n + 3, norm_w.data_ptr(), eps, out.data_ptr(),
                                                     n, 1) == 1


@pytest.mark.skipif(not {"avx2", "fma"} <= cbuild.cpu_flags(), reason="this CPU has no AVX2 / FMA")
@pytest.mark.parametrize("fmt", FORMATS)
def test_an_avx2_16_bit_weight_held_as_its_strips_only(fmt):
    """quant.keep_strips_only (an AVX2 build): the strips replace the rows (q [N, 0]), unpack to them exactly
    (dequantize), are made once, and qlinear reads them at every M, one row included, with the bits of the per-call
    panels on the rows; a build of the other layout refuses them by name."""
    lib = quant.build_kernels("no-avx512")
    rng = np.random.default_rng(17)
    _, packed = weight16(rng, 37, 101, fmt)
    rows = packed.q.clone()
    assert quant.keep_strips_only(packed, lib) == 48 * 101 * 2
    assert packed.strips_only and tuple(packed.q.shape) == (37, 0) and packed.shape == (37, 101)
    assert packed.nbytes() == 48 * 101 * 2
    with pytest.raises(AssertionError):
        quant.derived(packed, in_features=101)
    assert torch.equal(packed.dequantize(), rows.float())
    assert quant.keep_strips_only(packed, lib) == 0 and quant.prepack_panels(packed, lib) == 0
    plain = quant.QuantizedWeight(16, rows, None, None, 101, 101)
    for m in (1, 2, 17):
        x = rng.standard_normal((m, 101)).astype(np.float32)
        assert quant.product_of(lib, packed, m) == "w16_prepacked"
        np.testing.assert_array_equal(quant.qlinear(torch.from_numpy(x), packed, lib=lib).numpy(), panels(lib, x, plain, 1))
    packed.panels_layout = 1
    with pytest.raises(RuntimeError, match="strips only"):
        quant.product_of(lib, packed, 1)


def test_a_16_bit_model_packs_its_panels_at_load_within_the_budget(monkeypatch):
    """load_model with `--quantization bf16` at float32 packs every layer's weights and then the LM head once (where
    the kernels have AVX-512), as many as the budget of second copies (linear.GEMV_MAX_BYTES) allows, layers first;
    the rest stay packed per call. Prefill's linears give the same bits either way. (An AVX2 build holds each as its
    strips only, no budget: test_an_avx2_16_bit_model_holds_each_weight_once.)"""
    from atomd.model import decoder
    from atomd.model.default import default_model_dir
    from atomd.model.loader import load_model

    if not (quant.kernels() is not None and quant.kernels().w16_panels == 1):
        pytest.skip("this CPU has no AVX-512: no budget of second copies (an AVX2 build keeps one copy)")
    model = load_model(default_model_dir(), quantization="bf16")
    weights = [t for w in model.layers for t in w.linears()] + [model.lm_head]
    assert all(isinstance(t, quant.QuantizedWeight) and t.bits == 16 for t in weights)
    assert all(t.panels is not None for t in weights)
    first = weights[0]
    monkeypatch.setattr(decoder, "GEMV_MAX_BYTES", first.panels.nbytes)
    small = load_model(default_model_dir(), quantization="bf16")
    kept = [t.panels is not None for w in small.layers for t in w.linears()] + [small.lm_head.panels is not None]
    assert kept == [True] + [False] * (len(kept) - 1)
    x = torch.randn(quant.QGEMM_W16_MIN_M + 3, first.in_features)  # where both take panels: the same sums
    for a, b in zip(weights, [t for w in small.layers for t in w.linears()] + [small.lm_head]):
        if a.in_features == first.in_features:
            np.testing.assert_array_equal(quant.qlinear(x, a).numpy(), quant.qlinear(x, b).numpy())


@pytest.mark.skipif(not {"avx2", "fma"} <= cbuild.cpu_flags(), reason="this CPU has no AVX2 / FMA")
def test_an_avx2_16_bit_model_holds_each_weight_once(monkeypatch):
    """load_model with `--quantization bf16` on an AVX2 build: every layer linear and the LM head held as strips
    only, whatever the budget of second copies, and their values the float32 model's rounded to bf16; layer kernels
    that read another layout (builds of two ISAs) refused at load."""
    from atomd.model import decoder
    from atomd.model.default import default_model_dir
    from atomd.model.loader import load_model

    monkeypatch.setenv(cbuild.ISA_ENV, "no-avx512")
    monkeypatch.setattr(decoder, "GEMV_MAX_BYTES", 0)
    model = load_model(default_model_dir(), quantization="bf16")
    weights = [t for w in model.layers for t in w.linears()] + [model.lm_head]
    assert all(isinstance(t, quant.QuantizedWeight) and t.strips_only for t in weights)
    float_model = load_model(default_model_dir())
    want = [decoder.dense(t) if not isinstance(t, quant.QuantizedWeight) else t.dequantize()
            for t in [t for w in float_model.layers for t in (w.rows or w.linears())] + [float_model.lm_head]]
    for got, w in zip(weights, want):
        assert torch.equal(got.dequantize(), w.to(torch.bfloat16).float())
    from atomd.model import layer_ops

    if model.decode_layer is not None:  # layer kernels of another layout than the strips': refused at load
        monkeypatch.setattr(layer_ops.kernels(), "w16_layout", 1)
        with pytest.raises(RuntimeError, match="another 16-bit layout"):
            load_model(default_model_dir(), quantization="bf16")


# ---- bf16 x bf16 -> float32 (csrc/quant_w16.h, atomd_gemm_bf16_panels): vdpbf16ps over packed pairs of inputs
# (dot), or both widened, float32 FMAs ----
PAIR_CASES = [  # m, n, k: every row tail 1..14 of the micro-kernel (m 1..15, 29, 45), odd K (its last pair padded:
    # 1, 3, 101, 2051), inputs past a k-block of 2048 (2051: two, 4100: three), weight rows not a multiple of 32
    *((m, 37, 101) for m in range(1, 16)), (29, 1, 3), (45, 70, 2051), (3, 33, 4100), (17, 450, 600), (2, 5, 1),
]


def bf16_built(isa: str) -> bool:
    """Whether the kernels narrowed to `isa` have vdpbf16ps here (AVX512_BF16 on this CPU, not narrowed away)."""
    return "avx512_bf16" in cbuild.cpu_flags() and isa in ("native", "no-amx")


@pytest.fixture(scope="module")
def pairs_lib():
    if not bf16_built("no-amx"):
        pytest.skip("this CPU has no AVX512_BF16")
    return quant.build_kernels("no-amx")  # the native build's loops are the same code


def bf16_values(rng, *shape) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).bfloat16()


@pytest.mark.parametrize("dot", [True, False])
@pytest.mark.parametrize("m,n,k", PAIR_CASES)
def test_bf16_panels_equal_float64_numpy_within_the_float32_sum_bound(pairs_lib, m, n, k, dot, monkeypatch):
    """y within K * 2^-24 * sum_k |x||w| of float64 numpy on the same bf16 values (each output one float32 chain
    over the exact products), at 1 and 2 threads bit for bit alike, each row of x alone (and x's rows strided)
    giving the batch's bits; both kernels."""
    rng = np.random.default_rng(m * n + k)
    x, w = bf16_values(rng, m, k), bf16_values(rng, n, k)
    ref, scale = x.double() @ w.double().T, x.double().abs() @ w.double().abs().T
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    one = quant.gemm_bf16_f32(x, w, pairs_lib, dot)
    assert one.dtype == torch.float32 and one.shape == (m, n)
    assert ((one.double() - ref).abs() <= k * 2.0 ** -24 * scale + 1e-30).all()
    for r in {0, m // 2, m - 1}:
        assert torch.equal(quant.gemm_bf16_f32(x[r:r + 1], w, pairs_lib, dot), one[r:r + 1])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert torch.equal(quant.gemm_bf16_f32(x, w, pairs_lib, dot), one)
    wide = torch.cat([x, x[:, :5]], 1)[:, :k]  # rows of stride k + 5
    assert torch.equal(quant.gemm_bf16_f32(wide, w, pairs_lib, dot), one)


def test_bf16_panels_give_back_the_weights_and_are_not_built_without_avx512_bf16(pairs_lib):
    """One-hot rows of x give back the stored bf16 columns bit for bit (the odd K's padded last pair included),
    both kernels; the builds without AVX512_BF16 have the widened one only (vdpbf16ps: answer 1, None), the AVX2
    build neither."""
    rng = np.random.default_rng(7)
    m, n, k = 30, 41, 83
    w = bf16_values(rng, n, k)
    cols = torch.from_numpy(np.concatenate([rng.integers(0, k, m - 3), [0, k - 2, k - 1]]))
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    x[torch.arange(m), cols] = 1.0
    for dot in (True, False):
        assert torch.equal(quant.gemm_bf16_f32(x, w, pairs_lib, dot), w.float()[:, cols].T)
    no_dot = quant.build_kernels("no-bf16-dot")
    assert not no_dot.bf16_panels and no_dot.atomd_gemm_bf16_panels(0, 8, 3, 0, 4, 8, 0, 4, 1) == 1
    assert quant.gemm_bf16_f32(x, w, no_dot, True) is None and quant.gemm_bf16(x, w, no_dot, True) is None
    assert torch.equal(quant.gemm_bf16_f32(x, w, no_dot, False), w.float()[:, cols].T)
    assert torch.equal(quant.gemm_bf16(x, w, no_dot, False), w[:, cols].T)
    no_avx512 = quant.build_kernels("no-avx512")
    assert no_avx512.atomd_gemm_bf16_panels(0, 8, 3, 0, 4, 8, 0, 4, 1) == 1
    assert no_avx512.atomd_gemm_bf16_rounded(0, 8, 3, 0, 4, 8, 0, 4, 0, 4, 0, 1) == 1
    assert quant.gemm_bf16_f32(x, w, no_avx512, False) is None and quant.gemm_bf16(x, w, no_avx512, False) is None


ROUNDED_CASES = [  # m, n, k: row tails, odd K, K within one k-block (sums kept in the thread's sliver) and past it
    # (widened: 1024 inputs a block, so 1025; pairs: 2048, so 2051 and 4100), weight rows not a multiple of 32
    (1, 37, 101), (14, 37, 101), (15, 33, 1025), (29, 70, 2051), (45, 450, 600), (3, 33, 4100), (2, 5, 1),
]


@pytest.mark.parametrize("dot", [True, False])
def test_bf16_rounded_is_the_float32_sums_rounded_once(pairs_lib, dot, monkeypatch):
    """quant.gemm_bf16 (atomd_gemm_bf16_rounded: x widened and the sums rounded to bf16 inside the call) gives
    gemm_bf16_f32's sums rounded as torch rounds them, bit for bit, at 1 and 2 threads and with x's rows strided;
    so within the float32 sum bound of float64 numpy plus half a bf16 step; ties round to even, overflow to inf."""
    for m, n, k in ROUNDED_CASES:
        rng = np.random.default_rng(m * n + k)
        x, w = bf16_values(rng, m, k), bf16_values(rng, n, k)
        for threads in (1, 2):
            monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
            got = quant.gemm_bf16(x, w, pairs_lib, dot)
            assert got.dtype == torch.bfloat16 and got.shape == (m, n)
            assert torch.equal(got, quant.gemm_bf16_f32(x, w, pairs_lib, dot).bfloat16())
        assert torch.equal(quant.gemm_bf16(torch.cat([x, x[:, :5]], 1)[:, :k], w, pairs_lib, dot), got)
        ref, bound = x.double() @ w.double().T, k * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)
        assert ((got.double() - ref).abs() <= (ref.abs() + bound) * 2.0 ** -8 + bound + 1e-30).all()
    one = 1.0 + 2.0 ** -7  # the bf16 after 1.0: sums 1 + 2^-8 and one + 2^-8 are ties (to 1.0 and to 1 + 2^-6)
    x = torch.tensor([[1.0, 2.0 ** -8, 0.0], [one, 2.0 ** -8, 0.0], [2.0 ** 100, 0.0, 0.0]]).bfloat16()
    w = torch.tensor([[1.0, 1.0, 0.0], [2.0 ** 100, 0.0, 0.0]]).bfloat16()
    got = quant.gemm_bf16(x, w, pairs_lib, dot).float()
    assert got[0, 0] == 1.0 and got[1, 0] == 1.0 + 2.0 ** -6 and got[2, 1] == float("inf")


@pytest.mark.parametrize("isa", ["native", "no-amx", "no-bf16-dot"])
def test_linear_takes_the_bf16_panels_where_avx512_bf16_has_no_amx_tiles(isa, monkeypatch):
    """linear() sends bf16 x of BF16_PANELS_MIN_M rows or more over a weight's plain rows to the panels (their
    float32 sums plus the bias, rounded to bf16 once) only on the AMD EPYC kind: AVX512_BF16 without AMX tiles
    (the no-amx narrowing); the AMX kind (native here) and the no-bf16-dot kind keep oneDNN; fewer rows too."""
    from atomd.model import linear as linear_mod

    monkeypatch.setenv(cbuild.ISA_ENV, isa)
    lib = quant.build_kernels(isa)
    monkeypatch.setattr(quant, "kernels", lambda: lib)
    linear_mod.bf16_panels_run.cache_clear()
    monkeypatch.setattr(linear_mod, "bf16_panels_run", linear_mod.bf16_panels_run.__wrapped__)
    calls, rounded = [], []
    monkeypatch.setattr(linear_mod, "gemm_bf16_f32", lambda *a: calls.append(a) or quant.gemm_bf16_f32(*a))
    monkeypatch.setattr(linear_mod, "gemm_bf16", lambda *a: rounded.append(a) or quant.gemm_bf16(*a))
    rng = np.random.default_rng(11)
    m = max(linear_mod.BF16_PANELS_MIN_M, 2)
    x, rows, bias = bf16_values(rng, m, 96), bf16_values(rng, 40, 96), bf16_values(rng, 40)
    weight = linear_mod.pack_linear_weight(rows) if linear_mod.onednn_runs(torch.bfloat16) else rows
    got = linear_mod.linear(x, weight, bias, rows)
    takes = bf16_built(isa) and "amx_bf16" not in cbuild.narrow_flags(cbuild.cpu_flags(), isa)
    assert bool(calls) == takes
    if takes:
        assert torch.equal(got, (quant.gemm_bf16_f32(x, rows, lib) + bias).bfloat16())
        calls.clear()
        linear_mod.linear(x[:linear_mod.BF16_PANELS_MIN_M - 1], weight, bias, rows)
        assert not calls
        assert not rounded  # without a bias: the sums rounded in the kernel, the same bits
        assert torch.equal(linear_mod.linear(x, weight, None, rows), quant.gemm_bf16_f32(x, rows, lib).bfloat16())
        assert rounded and not calls
        rounded.clear()
        linear_mod.linear(x[:linear_mod.BF16_PANELS_MIN_M - 1], weight, None, rows)
        assert not rounded
    want = (x.double() @ rows.double().T + bias.double())
    assert ((got.double() - want).abs() <= want.abs() * 2.0 ** -8 + 1e-2).all()
