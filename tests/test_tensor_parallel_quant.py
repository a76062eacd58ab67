"""Quantized weights under tensor parallelism (atomd/model/tensor_parallel.py): a weight is quantised
whole, then sliced, so every worker holds the unsplit weight's integers, scales and zero points.

Unit: each worker's slice dequantises to exactly its rows / columns of the whole dequantised
weight, and the workers' partial products sum to the whole product (float32 summation order
apart: 1e-4) for int8 per channel, int4 in groups (whole groups a worker, and one group shared by
the workers), bf16, int8 activations (act blocks of the weight's group capped at 256: a slice on an
act-block boundary quantises the same blocks, so the quantised activations are the unsplit ones; others
refused) and GPTQ act-order; shapes that do not cut on a group refused naming the numbers.

Engine: TP=2 greedy ids equal TP=1's and Hugging Face's run on the dequantised weights, and TP=2's
prompt logits within 2e-4 of HF's (the bound test_quant_engine holds TP=1 to)."""
from __future__ import annotations

import pytest
import torch

from atomd.model import quant
from atomd.model.tensor_parallel import _columns, _pad_rows, _rows

torch.set_num_threads(1)


def _workers(t, size: int, **kw) -> list:
    n = t.shape[1] // size
    return [_columns(t, r * n, n, "w", **kw) for r in range(size)]


def _assert_split_exact(t, size: int, rows: int = 3, **kw) -> None:
    parts = _workers(t, size, **kw)
    whole = t.dequantize()
    assert torch.equal(torch.cat([p.dequantize() for p in parts], dim=1), whole)
    x = torch.randn(rows, t.in_features, generator=torch.Generator().manual_seed(1))
    n = t.in_features // size
    total = sum(quant.qlinear(x[:, r * n:(r + 1) * n], p) for r, p in enumerate(parts))
    torch.testing.assert_close(total, quant.qlinear(x, t), atol=1e-4, rtol=0)
    torch.testing.assert_close(total, x @ whole.T, atol=2e-4 if not t.int8_activations else 0.5, rtol=0)


def _weight(n: int, k: int, method: str) -> quant.QuantizedWeight:
    return quant.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(k + n)), method)


@pytest.mark.unit
@pytest.mark.parametrize("method,k,size", [
    ("int8", 128, 2),  # one scale a row: every worker keeps it, its group the worker's 64 inputs
    ("int4", 128, 2),  # one group of 128: each worker's 64 inputs lie in it
    ("int4", 512, 2),  # groups of 128: two whole groups a worker
    ("int4", 256, 4),
    ("bf16", 96, 2),
])
@pytest.mark.parametrize("rows", [1, 3, 40])  # the kernel's row paths and the float tiles past QGEMM_MAX_M
def test_row_parallel_slices_are_the_whole_weights_columns(method, k, size, rows):
    _assert_split_exact(_weight(24, k, method), size, rows)


@pytest.mark.unit
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 5])
def test_int8_activations_quantise_the_same_blocks_on_each_worker(method, rows):
    """A row-parallel slice keeps the unsplit weight's act block (int8 per channel of 512: 256; int4 groups of
    128: 128) and must fall on its boundaries, so each worker quantises TP=1's blocks; else refused."""
    w = _weight(16, 512, method)
    assert quant.use_int8_activations([w]) == 1 and w.act_block == (256 if method == "int8" else 128)
    parts = _workers(w, 2, q8_aligned=True)
    assert all(p.int8_activations and p.act_block == w.act_block for p in parts)
    _assert_split_exact(w, 2, rows, q8_aligned=True)
    # a worker's 48 inputs would cut a block of 32, 128 one of 256: the quantised activations would differ
    for k, block in ((96, 32), (256, 256)):
        w = _weight(16, k, "int8")
        quant.use_int8_activations([w])
        with pytest.raises(ValueError, match=rf"w \({k} inputs, {k // 2} a worker\): int8 activations quantise this "
                                             rf"weight's inputs in act blocks of {block} \(its group of {k}"):
            _workers(w, 2, q8_aligned=True)
        _assert_split_exact(_weight(16, k, "int8"), 2, rows)  # with float activations the same shape splits


@pytest.mark.unit
def test_rows_and_padding_keep_each_rows_scales():
    w = _weight(10, 64, "int4")
    assert torch.equal(_rows(w, 3, 7).dequantize(), w.dequantize()[3:7])
    padded = _pad_rows(_rows(w, 6, 10), 6)
    assert torch.equal(padded.dequantize(), torch.cat([w.dequantize()[6:], torch.zeros(2, 64)]))


@pytest.mark.unit
def test_act_order_splits_only_when_each_workers_inputs_stay_its_own():
    """GPTQ act-order: kernel column c is input perm[c]. A permutation inside each worker's half
    splits (each worker its own permutation of its inputs); one across halves is refused."""
    w = _weight(8, 128, "int8")
    g = torch.Generator().manual_seed(3)
    inside = torch.cat([torch.randperm(64, generator=g), 64 + torch.randperm(64, generator=g)])
    _assert_split_exact(quant.QuantizedWeight(8, w.q, w.scales, None, 128, 128, inside), 2)
    across = torch.randperm(128, generator=g)
    with pytest.raises(ValueError, match="act-order .* mix inputs of different workers"):
        _workers(quant.QuantizedWeight(8, w.q, w.scales, None, 128, 128, across), 2)


@pytest.mark.unit
def test_groups_that_do_not_cut_on_a_worker_boundary_are_refused():
    values = torch.randint(-127, 128, (4, 96))
    w = quant.pack(values, torch.rand(4, 3), None, 8, 32)  # groups of 32, 48 inputs a worker
    with pytest.raises(ValueError, match="groups of 32 inputs neither divide a worker's 48 inputs"):
        _workers(w, 2)
    w = quant.pack(torch.randint(0, 16, (4, 96)), torch.rand(4, 1), None, 4, 96)  # int4 runs of 32
    with pytest.raises(ValueError, match="int4 packs runs of 32 inputs; 48"):
        _workers(w, 2)


# ---------------------------------------------------------------- the engine: TP=2 vs TP=1 vs HF

_LLAMA: dict = {}  # id(tmp_path_factory) -> the checkpoint: written once for the module's cases


def _llama(tmp_path_factory, hidden: int = 128, seed: int = 31):
    # 4 heads of 32, 2 KV heads: o_proj's 128 inputs are 64 a worker, down's 256 are 128 (int4 groups: one
    # group of 128 shared by both workers on o, a whole group a worker on down)
    from tests.test_model_hf import make_checkpoint

    key = (id(tmp_path_factory), hidden, seed)
    if key not in _LLAMA:
        _LLAMA[key] = make_checkpoint(
            tmp_path_factory.mktemp("tpq-llama"), "llama", seed=seed, hidden_size=hidden,
            intermediate_size=2 * hidden, num_attention_heads=4, num_key_value_heads=2)
    return _LLAMA[key]


def _case_rtn(method: str, activations: str = "float32", hidden: int = 128):
    def build(tmp_path_factory):
        from tests.test_quant_engine import hf_dequantised

        path = _llama(tmp_path_factory, hidden)
        kw = {"quantization": method, "quantized_activations": activations}
        # int8 activations: HF has no counterpart; the reference is TP=1 with the same activation blocks
        return path, kw, None if activations == "int8" else hf_dequantised(path, method)
    return build


def _case_moe_int4(tmp_path_factory):
    from tests.test_model_hf import make_checkpoint
    from tests.test_quant_engine import hf_rtn_from_files

    # each expert's 64 intermediate rows: 32 a worker, inside down's one int4 group of 64
    path = make_checkpoint(tmp_path_factory.mktemp("tpq-moe"), "qwen3_moe", seed=32, moe_intermediate_size=64,
                           mlp_only_layers=[1])
    return path, {"quantization": "int4"}, hf_rtn_from_files(path, "int4", tmp_path_factory.mktemp("tpq-moe-hf") / "hf")


def _case_gptq(tmp_path_factory):
    from tests.test_quant_formats import hf_on, write_quantized

    float_dir = _llama(tmp_path_factory)
    path = tmp_path_factory.mktemp("tpq-gptq") / "gptq"
    return path, {}, hf_on(float_dir, "gptq4-g32", write_quantized(float_dir, path, "gptq4-g32"))


def _case_gguf(name: str):
    def build(tmp_path_factory):
        import gguf

        from tests.test_gguf import ROPE, SHAPE, hf_on, write_gguf
        from tests.test_model_hf import make_checkpoint

        q = gguf.GGMLQuantizationType
        arch, types = {"qwen2-Q8_0-tied": ("qwen2", {"linear": q.Q8_0, "embed": q.Q8_0}),
                       "llama-Q4_K_M-like": ("llama", {"linear": q.Q4_K, "v": q.Q6_K, "down": q.Q5_K,
                                                       "embed": q.Q4_K, "output": q.Q6_K})}[name]
        root = tmp_path_factory.mktemp(f"tpq-{name}")
        float_dir = make_checkpoint(root / "float", arch, seed=33, **SHAPE, **(ROPE if arch == "llama" else {}))
        path = root / f"{name}.gguf"
        return path, {}, hf_on(float_dir, write_gguf(float_dir, path, arch, types))
    return build


CASES = {
    # int4 groups of 128: act blocks of 128, whole ones a worker on o_proj's 256 inputs and down's 512 (int8 per
    # channel of 128 inputs: one 128-input block, refused at 64 a worker; test_int8_activations_quantise_...)
    "int8-activations": _case_rtn("int4", "int8", hidden=256),
    "bf16": _case_rtn("bf16"),
    "int4-qwen3_moe": _case_moe_int4,
    "gptq4-g32": _case_gptq,
    "gguf-qwen2-Q8_0-tied": _case_gguf("qwen2-Q8_0-tied"),
    "gguf-llama-Q4_K_M-like": _case_gguf("llama-Q4_K_M-like"),
}
N_TOKENS = 16


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory):
    """GGUF checkpoint directories go to this module's own cache (the workers inherit it)."""
    from tests.test_gguf import module_cache_dir

    yield from module_cache_dir(tmp_path_factory)


@pytest.mark.unit
@pytest.mark.parametrize("case", list(CASES))
def test_tp2_quantized_equals_tp1_and_hf_on_dequantised_weights(case, gguf_cache, tmp_path_factory):
    from atomd.llm import LLM
    from atomd.model.quant import QuantizedWeight
    from tests.test_model_hf import _prompt_logits, prompts_of
    from tests.test_quant_engine import greedy, hf_greedy
    from contracts.sampling import SamplingParams

    path, kw, hf = CASES[case](tmp_path_factory)
    params = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
    one = LLM(str(path), num_threads=1, max_model_len=256, **kw)
    two = LLM(str(path), num_threads=1, max_model_len=256, tensor_parallel_size=2, **kw)
    try:
        layer = two.engine.model.layers[0]
        assert isinstance(layer.o, QuantizedWeight) and layer.o.in_features == one.engine.model.layers[0].o.in_features // 2
        prompts = prompts_of([1, 20, 37], seed=12)
        ids = greedy(two, prompts, params)
        assert ids == greedy(one, prompts, params)
        # alone: TP=1 decodes through the fused batch-1 layer, TP=2 per op (with int8 activations a batch's rows
        # past QGEMM_Q8_MAX_M take float tiles, so alone is compared with alone, not with the batch)
        assert greedy(two, prompts[1:2], params) == greedy(one, prompts[1:2], params)
        fresh = prompts_of([37], seed=13)[0]  # not in either prefix cache: every position computed
        logits = _prompt_logits(two, fresh)
        torch.testing.assert_close(logits, _prompt_logits(one, fresh), atol=1e-3 if hf is None else 2e-4, rtol=0)
        if hf is not None:
            for p, got in zip(prompts, ids):
                assert got == hf_greedy(hf, p, N_TOKENS), f"prompt of {len(p)}"
            with torch.inference_mode():
                torch.testing.assert_close(logits, hf(torch.tensor([fresh])).logits[0], atol=2e-4, rtol=0)
    finally:
        two.engine.close()


@pytest.mark.unit
def test_act_order_checkpoint_whose_groups_cross_workers_is_refused(tmp_path_factory):
    from atomd.model.loader import load_model, read_config, tp_split
    from tests.test_quant_formats import write_quantized

    float_dir = _llama(tmp_path_factory)
    path = tmp_path_factory.mktemp("tpq-act-order") / "gptq"
    write_quantized(float_dir, path, "gptq4-g64-act-order")
    with pytest.raises(ValueError, match=r"o_proj\.weight \(128 inputs, 64 a worker\): GPTQ act-order"):
        load_model(path, tp=tp_split(read_config(path), 0, 2))
