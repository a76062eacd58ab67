"""int8 activations for the int8 / int4 linears (atomd/kernels/csrc/quant.h, quant.py's
use_int8_activations): x quantised per act block (the weight's group capped at 256, quant.act_block_of; 32
is llama.cpp's Q8_0 of the row), integer dot products with the stored weight integers. Against a numpy reference of the same arithmetic
(the same rounding of x, exact integer dots, float64 sums: within 1e-5 of the sum of the
terms' magnitudes) on every kernel path: AVX512-VNNI, AVX-512 without VNNI, AVX2, under every
ATOMD_KERNEL_ISA narrowing; the fused batch-1 layer bit for bit with the per-op path; and the
accuracy contract against float activations (docs/design.md)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from atomd.kernels import cbuild
from atomd.model import quant
from tests.cpu_builds import ISAS

pytestmark = pytest.mark.unit
BUILDS = [(isa, vnni) for isa in ISAS for vnni in (True, False)]


def expected_path(isa: str, vnni: bool) -> str:
    flags = cbuild.narrow_flags(cbuild.cpu_flags(), isa)
    if "avx512bw" in flags and "avx512vl" in flags:
        return "AVX512-VNNI" if vnni and "avx512_vnni" in flags else "AVX-512"
    return "AVX2"


@pytest.fixture(params=BUILDS, ids=[f"{i}-{'vnni' if v else 'novnni'}" for i, v in BUILDS])
def lib(request):
    isa, vnni = request.param
    built = quant.build_kernels(isa, vnni)
    assert built is not None, f"the quant kernels did not build for {isa}"
    assert quant.Q8_PATHS[built.atomd_quant_q8_path()] == expected_path(isa, vnni)
    return built


def random_weight(rng, bits, n, k, group, zero_points):
    groups = k // group
    values = rng.integers(-128, 128, (n, k)) if bits == 8 else rng.integers(0, 16, (n, k))
    scales = rng.uniform(0.001, 0.02, (n, groups)).astype(np.float32)
    offsets = (-rng.integers(0, 16, (n, groups)) * scales).astype(np.float32) if zero_points else None
    return values, scales, offsets


def q8_reference(x, values, scales, offsets, group, ab=None):
    """(y, bound): the module docstring's arithmetic in numpy, act blocks of `ab` inputs (None: the
    weight's, quant.act_block_of); bound: the sum of |terms|."""
    m, k = x.shape
    ab = ab or quant.act_block_of(group)
    xb = x.reshape(m, k // ab, ab).astype(np.float32)
    amax = np.abs(xb).max(-1)
    d = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, np.float32(1)), np.float32(0))
    xq = np.rint(xb * inv[..., None].astype(np.float32)).astype(np.int64)
    assert np.abs(xq).max() <= 127
    xds = (d * xq.sum(-1).astype(np.float32)).astype(np.float64)  # [m, act blocks]
    idot = np.einsum("nbi,mbi->mnb", values.reshape(values.shape[0], k // ab, ab), xq)  # exact
    per = group // ab
    dot = (d[:, None, :].astype(np.float64) * idot).reshape(m, -1, k // group, per)  # [m, n, groups, per]
    s = scales.astype(np.float64)[None]
    terms = s * dot.sum(-1)
    bound = np.abs(s[..., None] * dot).sum((-1, -2))
    sx = xds.reshape(m, 1, k // group, per).sum(-1)
    if offsets is not None:
        terms = terms + offsets.astype(np.float64)[None] * sx
        bound = bound + np.abs(offsets.astype(np.float64)[None] * sx).sum(-1)
    return terms.sum(-1), bound


CASES = [  # bits, N, K, group (K: per channel), zero points; act blocks 32 / 64 / 128 / 256 by the group
    (8, 37, 96, 96, False), (8, 45, 256, 32, True), (8, 19, 192, 64, False), (8, 21, 384, 128, True),
    (4, 37, 96, 32, True), (4, 29, 192, 64, False), (4, 33, 256, 128, True), (4, 7, 160, 32, False),
    (8, 11, 1536, 1536, False),  # act blocks of 256, 6 a row (int4's 256: test_every_act_block_on_one_weight)
    # batch 1 (4 rows at once, a short last set): per channel of whole pairs, odd groups of 128, > 16 groups
    (8, 13, 320, 320, False), (4, 11, 640, 128, True), (8, 9, 1088, 64, True), (4, 5, 1088, 64, True),
    (4, 3, 128, 64, True),  # fewer rows than batch 1 takes at once
]


def numpy_checked(lib, bits, n, k, group, zero_points, m, ab=None):
    """qlinear on `lib` of a random packed weight and x (an all-zero block, an outlier) against
    q8_reference: within 1e-5 of the terms' magnitudes; ab: the act block (None: the weight's own).
    Returns (w, x, out, bound)."""
    rng = np.random.default_rng(n * k + m + bits)
    values, scales, offsets = random_weight(rng, bits, n, k, group, zero_points)
    w = quant.pack(torch.from_numpy(values), torch.from_numpy(scales),
                   None if offsets is None else torch.from_numpy(offsets), bits, group)
    assert w.act_block == quant.act_block_of(group)
    w.act_block = ab or w.act_block
    assert quant.use_int8_activations([w]) == 1
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[0, :32] = 0  # an all-zero block: scale 0
    x[-1, 40] = 50.0  # an outlier: its block's other values round coarsely
    out = quant.qlinear(torch.from_numpy(x), w, lib=lib).numpy()
    ref, bound = q8_reference(x, values, scales, offsets, group, ab)
    assert np.all(np.abs(out - ref) <= 1e-5 * bound + 1e-6), np.abs(out - ref).max()
    return w, x, out, bound


@pytest.mark.parametrize("bits,n,k,group,zero_points", CASES)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 16, quant.QGEMM_Q8_MAX_M - 3])
def test_int8_activations_equal_numpy_of_the_same_arithmetic(lib, bits, n, k, group, zero_points, m):
    numpy_checked(lib, bits, n, k, group, zero_points, m)


@pytest.mark.parametrize("bits,n,k,group,zero_points", CASES)
def test_a_rows_bits_are_its_own_beside_other_rows(lib, bits, n, k, group, zero_points):
    """The int8-activation rows on 2 and 3 rows of x (each weight row read once for the rows of x side by side):
    each row's outputs are, to the bit, those of the row alone (batch 1: gemv4_q8 or the rows), so a sequence's
    logits do not depend on its batch here."""
    w, x, _, _ = numpy_checked(lib, bits, n, k, group, zero_points, 3)
    x = torch.from_numpy(x)
    for m in (2, 3):
        assert quant.product_of(lib, w, m) == "rows"
        got = quant.qlinear(x[:m], w, lib=lib)
        for i in range(m):
            assert torch.equal(got[i], quant.qlinear(x[i:i + 1], w, lib=lib)[0]), (m, i)


@pytest.mark.parametrize("bits,group", [(8, 512), (4, 256)])
def test_every_act_block_on_one_weight(lib, bits, group):
    """The kernels take any act block of 32 / 64 / 128 / 256 inputs that divides the group (the rows,
    gemv4_q8 at one row, the AMX tiles from quant.QGEMM_AMX_MIN_M rows where the build has them)."""
    for ab in (32, 64, 128, 256):
        for m in (1, 6):
            numpy_checked(lib, bits, 7, 512, group, bits == 4, m, ab)


def test_act_block_follows_the_group():
    """The contract's rule: the group, capped at 256 (per channel: the input size); none where no block of
    32 divides it (those weights keep float activations)."""
    assert [quant.act_block_of(g) for g in (32, 64, 128, 256, 512, 1024, 1536, 320, 96, 688, 16)] == \
        [32, 64, 128, 256, 256, 256, 256, 64, 32, 0, 0]
    assert quant.quantize(torch.randn(4, 3072), "int8").act_block == 256
    assert quant.quantize(torch.randn(4, 3072), "int4").act_block == 128  # groups of 128
    assert not quant.quantize(torch.randn(4, 688), "int8").int8_activations_fit()


@pytest.mark.parametrize("m", [1, quant.QGEMM_AMX_MIN_M])
def test_int8_weights_of_minus_128_are_exact(lib, m):
    """VNNI's u8 x s8 product takes the weight + 128: -128 must come back as -128 (M =
    QGEMM_AMX_MIN_M: the AMX tiles' signed product where the build has them; 17 rows: a partial
    16-row tile)."""
    k = 64
    values = np.full((17, k), -128)
    values[1] = 127
    w = quant.pack(torch.from_numpy(values), torch.ones(17, 1), None, 8, k)
    quant.use_int8_activations([w])
    x = np.full((m, k), -1.0, np.float32)
    out = quant.qlinear(torch.from_numpy(x), w, lib=lib).numpy()
    expect = np.full((m, 17), 128.0 * k)
    expect[:, 1] = -127.0 * k
    np.testing.assert_array_equal(out, expect)


@pytest.mark.parametrize("bits,group", [(8, 32), (4, 32), (8, 1024), (4, 128)])
def test_accuracy_against_float_activations(bits, group):
    """The contract in docs/design.md: on Gaussian activations, the int8-activation output's
    rms error against the float-activation path is under 1% of the output's rms (8 bits of an
    act block's max; measured act blocks of 32: 0.51% int8, 0.55% int4; 128 (int4): 0.59%; 256 (int8 per
    channel): 0.70%)."""
    rng = np.random.default_rng(bits)
    n, k = 256, 1024
    values, scales, offsets = random_weight(rng, bits, n, k, group, bits == 4)
    w = quant.pack(torch.from_numpy(values), torch.from_numpy(scales),
                   None if offsets is None else torch.from_numpy(offsets), bits, group)
    x = torch.from_numpy(rng.standard_normal((4, k)).astype(np.float32))
    exact = quant.qlinear(x, w)
    quant.use_int8_activations([w])
    approx = quant.qlinear(x, w)
    err = ((approx - exact).pow(2).mean() / exact.pow(2).mean()).sqrt()
    assert 1e-4 < err < 0.01


def test_shapes_that_do_not_fit_keep_float_activations():
    w = quant.pack(torch.zeros(4, 100, dtype=torch.int32), torch.ones(4, 1), None, 8, 100)  # K not whole blocks
    assert quant.use_int8_activations([w]) == 0 and not w.int8_activations


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from tests.test_model_hf import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("q8llama"), "llama", seed=31, hidden_size=128,
                           intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_engine_fused_layer_equals_per_op_and_stays_near_float_activations(method, llama_dir):
    """--quantized-activations int8 end to end: the fused batch-1 layer (its GEMV rows quantise x
    themselves) gives the per-op path's tokens; a prompt of 12 tokens (one chunk <= 16 rows: int8
    activations in prefill too) has logits near float activations' (random model, mean |logit|
    0.9): mean |difference| under 0.04, max under 0.2 (measured 0.025 / 0.13 for int8 weights, act
    blocks of 128 / 256, 0.021 / 0.10 for int4, act blocks of 128; 0.018 / 0.087 with blocks of 32;
    int8 weights' own rounding is 0.021 / 0.15 from the float model); the KV fingerprint says which
    it is."""
    from atomd.llm import LLM
    from tests.test_model_hf import _prompt_logits, prompts_of
    from tests.test_quant_engine import greedy

    def make(activations):
        return LLM(str(llama_dir), num_threads=1, max_model_len=256, quantization=method,
                   quantized_activations=activations)

    fused, per_op, floats = make("int8"), make("int8"), make("float32")
    assert fused.engine.model.decode_layer is not None  # (an AVX2 build has the dense layer too)
    per_op.engine.model.decode_layer = None  # batch-1 decode through qlinear per op
    assert all(w.int8_activations for w in fused.engine.model.layers[0].linears())
    prompts = prompts_of([1, 12, 40], seed=32)
    got = greedy(fused, prompts)
    assert got == greedy(per_op, prompts)
    prompt = prompts_of([12], seed=33)[0]
    q8, fl = _prompt_logits(fused, prompt), _prompt_logits(floats, prompt)
    diff = (q8 - fl).abs()
    assert 1e-5 < diff.max() < 0.2 and diff.mean() < 0.04
    assert fused.engine.compat != floats.engine.compat
    assert fused.engine.compat["model_id"].endswith("+aint8b256")  # the act-block contract (an older P: "+aint8")


def test_int8_activations_without_quantized_weights_is_refused(llama_dir):
    from atomd.llm import LLM

    with pytest.raises(ValueError, match="quantized-activations int8 needs quantized linears"):
        LLM(str(llama_dir), num_threads=1, max_model_len=256, quantized_activations="int8")
