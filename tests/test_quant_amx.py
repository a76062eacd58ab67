"""int8 activations on AMX-INT8 tiles (atomd/kernels/csrc/quant_amx.h): from
quant.QGEMM_AMX_MIN_M rows of x on, int8 / int4 weights times int8 activations run as tile
products on a CPU with AMX. The same arithmetic as the VNNI rows (x quantised per act block to the
same int8 values, exact int32 act-block dots summed in the tile, only the float sums in another order): checked
against numpy of that arithmetic and against the VNNI rows and GEMM (the no-amx build) within 1e-5 of the
terms' magnitudes, on odd M, N not a multiple of 16, K not a multiple of 64, every group size,
zero points; -128 weights exact (signed operands here); the engine's greedy ids equal to the VNNI
rows'. From quant.QGEMM_WIDE_MIN_M rows on (prefill) the tiles are widened to bf16 (atomd_qgemm_wide):
checked against float64 of the bf16-rounded x and weight, and through the engine against float32
activations (nearer them than the int8 tiles); builds without the bf16 tiles never widen. On a CPU
without AMX the tile tests skip with the reason, and the no-AMX path is checked: the kernels say so
and qlinear takes the VNNI rows, then the VNNI GEMM."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from atomd.kernels import cbuild
from atomd.model import quant
from tests.test_quant_int8_activations import numpy_checked, random_weight

pytestmark = pytest.mark.unit
CPU_AMX = {"amx_tile", "amx_int8"} <= cbuild.cpu_flags()


@pytest.fixture(scope="module")
def amx():
    lib = quant.build_kernels("native")
    assert lib is not None
    if not lib.amx:
        pytest.skip("no AMX-INT8 tiles here: " + ("Linux refused the tile state" if CPU_AMX else
                                                  "the CPU has no amx_tile / amx_int8 flags"))
    return lib


@pytest.fixture(scope="module")
def wide(amx):
    """The AMX build with the widened bf16 tiles: every AMX CPU has amx_bf16 beside amx_int8, so there
    they must be built; skipped only on a CPU that lacks the flag."""
    if "amx_bf16" in cbuild.cpu_flags():
        assert amx.wide, "a CPU with amx_bf16 built no widened tiles"
    elif not amx.wide:
        pytest.skip("the CPU has no amx_bf16 flag: no widened tiles")
    return amx


@pytest.fixture(scope="module")
def vnni():
    lib = quant.build_kernels("no-amx")
    assert lib is not None and not lib.amx
    return lib


def test_amx_only_where_the_cpu_has_it(vnni):
    """native: tiles where the CPU has AMX-INT8 (and Linux grants it); no-amx / no-VNNI builds: never."""
    native = quant.build_kernels("native")
    assert native.amx == CPU_AMX or (CPU_AMX and not native.amx)  # a refusal is the only other outcome
    assert not vnni.amx and not quant.build_kernels("native", vnni=False).amx
    no_tiles = vnni.atomd_qgemm_amx(None, 0, 0, None, 8, None, None, 0, 0, 32, 32, None, 0, None, None, None, 1)
    assert no_tiles == 1  # nothing read: "run the rows"


CASES = [  # bits, N, K, group (K: per channel), zero points
    (8, 37, 96, 96, False), (8, 45, 160, 32, True), (8, 16, 1088, 64, True), (8, 50, 384, 128, False),
    (4, 37, 96, 32, True), (4, 29, 192, 64, False), (4, 33, 640, 128, True), (4, 7, 160, 32, False),
    (4, 64, 1088, 64, True),
    (8, 33, 1536, 1536, False), (4, 18, 768, 256, True),  # act blocks of 256 (6 a row: a short set of 4)
]


@pytest.fixture
def int8_tiles(monkeypatch):
    """the AMX-INT8 tiles at every M (the bf16-widened products of QGEMM_WIDE_MIN_M rows off)"""
    monkeypatch.setattr(quant, "QGEMM_WIDE_MIN_M", 0)


@pytest.mark.parametrize("bits,n,k,group,zero_points", CASES)
@pytest.mark.parametrize("m", [quant.QGEMM_AMX_MIN_M, 3, 17, 100, 130])  # 130: 9 m-tiles, the chunked order
def test_tiles_equal_numpy_and_the_vnni_rows(amx, vnni, int8_tiles, bits, n, k, group, zero_points, m):
    w, x, out, bound = numpy_checked(amx, bits, n, k, group, zero_points, m)
    rows = quant.qlinear(torch.from_numpy(x), w, lib=vnni).numpy()  # the VNNI rows, from q8_gemm_min_m the GEMM
    assert np.all(np.abs(out - rows) <= 2e-5 * bound + 1e-6), np.abs(out - rows).max()


@pytest.mark.parametrize("bits,n,k,group", [(8, 45, 160, 32), (4, 33, 640, 128), (8, 1200, 64, 64)])
def test_a_row_gives_the_same_bits_at_any_m(amx, int8_tiles, bits, n, k, group):
    """From 8 m-tiles on the n-tiles go in chunks over every m-tile (quant_amx.h's QAMX_MANY_MT): the
    same tile products and sums per row as n-tile by n-tile, so a row's output does not depend on
    the rows beside it (a batch of prompts, the MoE experts' per-item products)."""
    torch.manual_seed(7)
    w = quant.quantize(torch.randn(n, k) * 0.05, "int8" if bits == 8 else "int4")
    w.int8_activations = True
    x = torch.randn(200, k)
    whole = quant.qlinear(x, w, lib=amx)
    for rows in (slice(0, 16), slice(37, 60), slice(192, 200)):
        assert torch.equal(quant.qlinear(x[rows], w, lib=amx), whole[rows])


WIDENED = [c for c in CASES if not (c[0] == 8 and quant.act_block_of(c[3]) >= quant.QGEMM_WIDE_INT8_KEEP)]


@pytest.mark.parametrize("bits,n,k,group,zero_points", WIDENED)
def test_widened_tiles_equal_float64_of_the_bf16_operands(wide, bits, n, k, group, zero_points, monkeypatch):
    """From quant.QGEMM_WIDE_MIN_M rows on (prefill) the tiles are widened (atomd_qgemm_wide): x and the
    dequantised weight rounded to bf16, bf16 tile products with float32 sums over K. Against float64 of
    exactly those bf16 operands (the weight as QuantizedWeight.dequantize gives it, then rounded): within
    1e-6 of the terms' magnitudes (float32 sums; K up to 1088 in k-blocks, N not a multiple of 16 or 32:
    a short n-tile and an odd last one, rows not a multiple of 16 or 32). A row's bits do not depend on the
    rows beside it or on M."""
    lib = wide
    rng = np.random.default_rng(n * k + bits)
    values, scales, offsets = random_weight(rng, bits, n, k, group, zero_points)
    w = quant.pack(torch.from_numpy(values), torch.from_numpy(scales),
                   None if offsets is None else torch.from_numpy(offsets), bits, group)
    quant.use_int8_activations([w])
    wb = w.dequantize().bfloat16().double()
    x = torch.from_numpy(rng.standard_normal((quant.QGEMM_WIDE_MIN_M + 37, k)).astype(np.float32))
    x[-1, 40] = 50.0
    out = quant.qlinear(x, w, lib=lib)
    xb = x.bfloat16().double()
    ref, bound = xb @ wb.T, xb.abs() @ wb.abs().T
    assert torch.all((out.double() - ref).abs() <= 1e-6 * bound + 1e-9), (out.double() - ref).abs().max()
    monkeypatch.setattr(quant, "QGEMM_WIDE_MIN_M", 1)
    for rows in (slice(0, 1), slice(3, 20), slice(100, 133)):
        assert torch.equal(quant.qlinear(x[rows], w, lib=lib), out[rows])


def test_int8_weights_of_act_blocks_of_256_stay_on_the_int8_tiles(wide):
    """int8 weights whose act block is 256 (per channel) keep the int8 tiles at any M (quant.widens): past
    QGEMM_WIDE_MIN_M rows the same bits as below it; an int4 weight of the same shape is widened (other bits)."""
    torch.manual_seed(9)
    x = torch.randn(quant.QGEMM_WIDE_MIN_M + 5, 512)
    for method, stays in (("int8", True), ("int4", False)):
        w = quant.quantize(torch.randn(40, 512) * 0.05, method)
        quant.use_int8_activations([w])
        assert quant.widens(w, x.shape[0]) != stays
        out = quant.qlinear(x, w, lib=wide)
        assert torch.equal(out[:16], quant.qlinear(x[:16], w, lib=wide)) == stays


@pytest.mark.parametrize("isa", ["no-amx", "no-bf16-dot"])
def test_no_widened_tiles_without_the_bf16_tiles(isa):
    """Builds without AMX or AVX512_BF16 have no widened product (atomd_qgemm_wide answers 1, nothing read):
    their qlinear keeps its path (the int8 tiles, the VNNI rows and GEMM, or the float tiles) at any M."""
    lib = quant.build_kernels(isa)
    assert not lib.wide
    assert lib.atomd_qgemm_wide(None, 0, 0, None, 8, None, None, 0, 0, 32, None, 0, 1) == 1


@pytest.mark.parametrize("isa", ["no-amx", "no-bf16-dot"])
def test_no_int8_tiles_on_a_cpu_kind_without_amx(isa):
    """The narrowings that stand for the CPU kinds without AMX (cbuild.CPU_KIND_ENV) build no AMX-INT8
    product: their int8 activations take the VNNI rows and GEMM, as on those CPUs (the no-bf16-dot build kept
    the tiles until session 13, so its engine runs measured the AMX kind's int8 path)."""
    assert not quant.build_kernels(isa).amx


@pytest.mark.parametrize("below", [True, False])
def test_no_amx_takes_the_rows_then_the_gemm(vnni, below):
    """The no-AMX path (what a CPU without AMX runs, on any CPU): qlinear through atomd_qgemm_q8 below
    q8_gemm_min_m rows, atomd_qgemm_q8_gemm (tests/test_quant_gemm.py) from it on."""
    assert vnni.q8_gemm, "the no-amx build of a VNNI or AVX2 CPU has the int8 GEMM"
    m = quant.q8_gemm_min_m(vnni, 4) + (-1 if below else 1)
    w, x, out, _ = numpy_checked(vnni, 4, 21, 256, 64, True, m)
    xq, xd, xsg = quant._q8_scratch(m, 256)
    direct = torch.empty(m, 21)
    getattr(vnni, "atomd_qgemm_q8" if below else "atomd_qgemm_q8_gemm")(
        x.ctypes.data, 256, m, w.q.data_ptr(), 4, w.scales.data_ptr(), w.offsets.data_ptr(), 21, 256, 64, 64,
        direct.data_ptr(), 21, xq.data_ptr(), xd.data_ptr(), xsg.data_ptr(), 1)
    assert torch.equal(torch.from_numpy(out), direct)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_engine_greedy_equals_the_vnni_rows(amx, method, monkeypatch, tmp_path):
    """Prefill in a 32-row chunk and batched decode (4 sequences: M = 4 = QGEMM_AMX_MIN_M) on the tiles
    against the VNNI rows (QGEMM_AMX_MIN_M past every M: what ran before the tiles). The first
    token's logprobs agree to 0.03; the greedy ids are equal, or part only at a near-tie: the
    float sums' order moves a value by ~1e-7, which now and then flips x's rounding to 8 bits in
    a later layer (a step of max|x| / 127 over the act block: the larger the block, the larger the
    step) and moves a logprob by up to ~0.03 (measured on this model, act blocks of 128 / 256: 3 of 4
    prompts' first logprobs within 3e-7, one 8e-4 apart (a flip in prefill) and parting at token 16; act
    blocks of 64: one 8e-3 apart; session 25, Intel Xeon with AMX, int4: three within 1e-5, one 0.020 apart,
    the tiles' -3.2029 nearer float32 activations' -3.1971 than the rows' -3.2230: x's int8 rounding alone moves
    these first logprobs by 0.02-0.05 from float32 activations' on this model)."""
    from atomd import SamplingParams
    from atomd.llm import LLM
    from tests.test_model_hf import make_checkpoint, prompts_of

    path = make_checkpoint(tmp_path, "llama", seed=35, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                           num_key_value_heads=2)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in prompts_of([5, 9, 12, 6], seed=36)]

    def run():
        llm = LLM(str(path), num_threads=1, max_model_len=256, quantization=method, quantized_activations="int8",
                  max_num_batched_tokens=32)
        return [o.outputs[0] for o in llm.generate(prompts, params)]

    tiles = run()
    monkeypatch.setattr(quant, "QGEMM_AMX_MIN_M", 1 << 30)
    monkeypatch.setattr(quant, "QGEMM_VNNI_MIN_M", 1 << 30)  # (the VNNI GEMM: tests/test_quant_gemm.py)
    rows = run()
    equal = 0
    for t, r in zip(tiles, rows):
        assert abs(t.logprobs[0].logprob - r.logprobs[0].logprob) < 0.03
        part = next((i for i, (a, b) in enumerate(zip(t.token_ids, r.token_ids)) if a != b), None)
        if part is None:
            equal += 1
            continue
        (_, first), (_, second) = r.logprobs[part].top
        assert first - second < 0.05, f"parted at token {part} where the rows' top two were {first - second:.3f} apart"
    assert equal >= len(prompts) // 2


@pytest.mark.parametrize("method", ["int4"])  # int4 layers, an int8 LM head (quant.LM_HEAD_QUANTIZATION)
def test_engine_widened_prefill_nearer_float_activations(wide, method, monkeypatch, tmp_path):
    """Prompts prefilled in one chunk of more than QGEMM_WIDE_MIN_M rows (the widened bf16 tiles) against
    the same engine on the int8 tiles (QGEMM_WIDE_MIN_M off) and against float32 activations on the same
    weights (--quantized-activations float32: the dequantised weight, what both approximate): the same
    first tokens as float32 activations, and the first tokens' logprobs nearer them than the int8 tiles'
    (bf16 rounds x and the weight to 8 bits of mantissa, the int8 tiles x to a step of max|x| / 127 per
    32 inputs)."""
    from atomd import SamplingParams
    from atomd.llm import LLM
    from tests.test_model_hf import make_checkpoint, prompts_of

    path = make_checkpoint(tmp_path, "llama", seed=35, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                           num_key_value_heads=2)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in prompts_of([150, 90, 70, 60, 40], seed=37)]

    def run(activations):
        llm = LLM(str(path), num_threads=1, max_model_len=256, quantization=method, quantized_activations=activations,
                  max_num_batched_tokens=512)
        return [(o.outputs[0].token_ids[0], o.outputs[0].logprobs[0].logprob) for o in llm.generate(prompts, params)]

    assert 150 + 90 + 70 + 60 + 40 >= quant.QGEMM_WIDE_MIN_M > 0
    widened = run("int8")
    monkeypatch.setattr(quant, "QGEMM_WIDE_MIN_M", 0)
    int8_tiles, floats = run("int8"), run("float32")
    assert [t for t, _ in widened] == [t for t, _ in floats]  # (the int8 tiles part at a near-tie here)
    print("first tokens' logprobs: widened", widened, "int8 tiles", int8_tiles, "float32 activations", floats)
    error = sum(abs(a - b) for (_, a), (_, b) in zip(widened, floats))
    int8_error = sum(abs(a - b) for (_, a), (_, b) in zip(int8_tiles, floats))
    assert error < int8_error, (error, int8_error)
