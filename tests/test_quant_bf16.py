"""`--quantization bf16`: 16-bit weights widened to float32 in registers (csrc/quant.h row_b16),
float32 activations and sums, against numpy under every ATOMD_KERNEL_ISA narrowing (the CPU
without AVX512_BF16 is the one this path is for) and with no kernels (torch): the widening
exact (a one-hot input gives back the stored bf16 column bit for bit), the products within
float32 summation order of float64 numpy on the same bf16 values, at batch 1, small M and the
tiled path; the fused batch-1 decode layer over bf16 weights."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from atomd.kernels import cbuild
from atomd.model import quant
from tests.test_quant_kernels import lib, numpy_bf16  # noqa: F401 (lib: the kernels per ISA path, a fixture)

pytestmark = pytest.mark.unit


def bf16_weight(rng, n, k):
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    return w, quant.quantize(torch.from_numpy(w), "bf16")


def test_bf16_is_half_the_bytes_rounded_to_nearest_even():
    rng = np.random.default_rng(0)
    w, packed = bf16_weight(rng, 33, 70)
    assert packed.bits == 16 and packed.q.dtype == torch.bfloat16 and packed.nbytes() == w.nbytes // 2
    np.testing.assert_array_equal(packed.dequantize().numpy(), numpy_bf16(w))
    assert not packed.int8_activations_fit()  # no integer path for 16-bit weights


@pytest.mark.parametrize("n,k", [(37, 101), (16, 64), (45, 576), (7, 33), (5, 8)])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 40])
def test_bf16_linear_equals_numpy_on_the_same_bf16_values(lib, n, k, m):
    rng = np.random.default_rng(n * k + m)
    w, packed = bf16_weight(rng, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    out = quant.qlinear(torch.from_numpy(x), packed, torch.from_numpy(bias), lib=lib)
    ref = x.astype(np.float64) @ numpy_bf16(w).astype(np.float64).T + bias
    assert out.shape == (m, n) and out.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("m", [1, 5, quant.QGEMM_MAX_M + 1])
def test_widening_is_exact(lib, m):
    """x = one-hot rows: each output is one stored weight, widened; equal bit for bit."""
    rng = np.random.default_rng(m)
    w, packed = bf16_weight(rng, 29, 83)
    cols = rng.integers(0, 83, m)
    x = np.zeros((m, 83), np.float32)
    x[np.arange(m), cols] = 1.0
    out = quant.qlinear(torch.from_numpy(x), packed, lib=lib).numpy()
    np.testing.assert_array_equal(out, numpy_bf16(w)[:, cols].T)


def test_the_fused_decode_layer_reads_bf16_weights(monkeypatch):
    """One decoder layer at batch 1 through atomd_decode_layer_*_q_f32 over bf16 weights equals
    the per-op path (qlinear per linear) on the same weights, under every narrowing."""
    from atomd.model import layer_ops
    from atomd.model.default import default_model_dir
    from atomd.model.loader import load_model

    for isa in cbuild.ISA_FLAGS:
        monkeypatch.setenv(cbuild.ISA_ENV, isa)
        if not layer_ops.has_gemv(torch.float32):  # the fused layer is AVX-512 only
            continue
        model = load_model(default_model_dir(), quantization="bf16")
        w, cfg = model.layers[0], model.config
        assert all(isinstance(t, quant.QuantizedWeight) and t.bits == 16 for t in w.linears())
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
