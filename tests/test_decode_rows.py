"""A batch's decode step in one C call (layer_ops.DecodeLayer.run_rows, csrc/layer_ops.c
atomd_decode_rows_q_f32): quantized linears (int8 / int4 with int8 or float activations, bf16 / float16
weights widened), every layer of R >= 2 decoding sequences at once. Held to the per-op path (the same
engine with the call off): greedy ids and every logprob equal, bit for bit, at batches that take each
product qlinear has for them on this CPU (the int8-activation rows, GEMM and AMX tiles, the float-activation rows,
the 16-bit rows and panels), under every ATOMD_KERNEL_ISA narrowing, over the layer variants of the
families (qkv bias, q / k norm, a sliding window) and the KV caches the fused layers store into (the
model's dtype, float16, fp8)."""
from __future__ import annotations

import pytest

from atomd.kernels import cbuild
from contracts.sampling import SamplingParams
from tests.cpu_builds import ISAS
from tests.test_model_hf import make_checkpoint, prompts_of

pytestmark = pytest.mark.unit
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
BATCHES = (3, 17)  # 3: rows on every kind (the AMX tiles start at 4; 16-bit weights with load-time panels read those
# from 2 rows, an AVX2 build's at every M: test_rows_of_16_bit_weights_without_load_time_panels has the 16-bit rows of
# AVX-512 builds); 17: the GEMMs, the AMX tiles and the panels
# (quantization, quantized activations): int weights with int8 activations, 16-bit weights (float) under every
# narrowing; int4 with float activations and float16 weights (the same kernels' other instances) natively
NARROWED = [("int8", "int8"), ("int4", "int8"), ("bf16", "float32")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("rows")
    shape = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    return {kind: make_checkpoint(root / kind, kind, seed=41, **shape, **extra)
            for kind, extra in (("llama", {}), ("qwen2", {}), ("qwen3", {}), ("mistral", {"sliding_window": 8}))}


def engines(path, method: str, activations: str = "int8", **kwargs):
    from atomd.llm import LLM

    def make():
        return LLM(str(path), num_threads=2, max_model_len=256, quantization=method,
                   quantized_activations=activations, **kwargs)
    fused, per_op = make(), make()
    assert fused.engine.model.decode_layer.rows_fn is not None
    per_op.engine.model.decode_layer.rows_fn = None  # every batch through qlinear and the ops one by one
    return fused, per_op


def same_outputs(fused, per_op, batch: int, seed: int) -> None:
    prompts = [{"prompt_token_ids": p} for p in prompts_of([5 + 3 * i for i in range(batch)], seed=seed)]
    layer = fused.engine.model.decode_layer
    steps = layer.rows_steps
    got, want = fused.generate(prompts, PARAMS, use_tqdm=False), per_op.generate(prompts, PARAMS, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs  # every float equal
    # the batch's decode steps took the C call wherever it has the products qlinear runs there
    fusable = layer.rows_kinds_for(batch, fused.engine.model.layers) is not None
    assert (layer.rows_steps > steps) == fusable
    if batch == 3:
        assert fusable


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("method,activations", NARROWED)
def test_rows_equal_per_op_under_every_narrowing(checkpoints, method, activations, isa, monkeypatch):
    monkeypatch.setenv(cbuild.ISA_ENV, isa)
    fused, per_op = engines(checkpoints["llama"], method, activations)
    for batch in BATCHES:
        same_outputs(fused, per_op, batch, seed=batch)


@pytest.mark.parametrize("method,activations", [("int8", "float32"), ("int4", "float32"), ("fp16", "float32")])
def test_rows_equal_per_op_float_activations(checkpoints, method, activations):
    """int8 / int4 with float activations: the rows to QGEMM_MAX_M = 16 rows (17: float tiles, per op); float16
    weights."""
    fused, per_op = engines(checkpoints["llama"], method, activations)
    for batch in (3, 16, 17):
        same_outputs(fused, per_op, batch, seed=batch)


def test_rows_of_16_bit_weights_without_load_time_panels(checkpoints, monkeypatch):
    """With no second copies allowed (decoder.GEMV_MAX_BYTES 0) no 16-bit weight has load-time panels: the C call
    runs qlinear's other 16-bit products, the rows at 3 rows and the panels packed per call at 17 (AVX-512 builds:
    an AVX2 build holds 16-bit weights as their strips only, whatever the budget)."""
    from atomd.model import decoder, quant

    if quant.kernels() is None or quant.kernels().w16_panels != 1:
        pytest.skip("no AVX-512 here: an AVX2 build's 16-bit weights are strips only (quant.keep_strips_only)")
    monkeypatch.setattr(decoder, "GEMV_MAX_BYTES", 0)
    fused, per_op = engines(checkpoints["llama"], "bf16", "float32")
    assert all(t.panels is None for w in fused.engine.model.layers for t in w.linears())
    for batch in BATCHES:
        same_outputs(fused, per_op, batch, seed=3 + batch)


@pytest.mark.parametrize("kind,method,activations", [("qwen2", "int4", "int8"), ("qwen3", "int4", "int8"),
                                                      ("mistral", "int4", "int8"), ("qwen3", "bf16", "float32")])
def test_rows_equal_per_op_across_families(checkpoints, kind, method, activations):
    """qwen2: a qkv bias (added after the product); qwen3: the per-head q / k norm before RoPE; mistral: a
    window of 8 keys under contexts of 10-59 tokens."""
    fused, per_op = engines(checkpoints[kind], method, activations)
    for batch in BATCHES:
        same_outputs(fused, per_op, batch, seed=7 + batch)


@pytest.mark.parametrize("cache", ["float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"])
def test_rows_store_narrow_caches_as_kv_cache_write(checkpoints, cache):
    """The C call stores each row's K / V as KVCache.write's casts (store_narrow) and reads them through the
    narrow attention kernel, as the per-op path does."""
    fused, per_op = engines(checkpoints["qwen3"], "int4", kv_cache_dtype=cache)
    same_outputs(fused, per_op, 3, seed=5)



def test_more_rows_than_a_tile_run_per_op(checkpoints):
    """Past ROW_TILE rows the per-op path runs o / gate_up / down a tile of rows at a time (each tile's product
    chosen for its own rows), so a step of more rows than a tile is not the C call's."""
    from types import SimpleNamespace

    from atomd.model.decoder import ROW_TILE

    fused, _ = engines(checkpoints["llama"], "int4")
    model, kv = fused.engine.model, SimpleNamespace(narrow=False)
    meta = SimpleNamespace(kernels=object(), is_prefill=False, query_starts=None)
    assert model._fused_decode(meta, kv, None)
    kinds = model.decode_layer.rows_kinds_for  # (None where this CPU's products at so many rows are tiles)
    assert model._rows_kinds(ROW_TILE, meta) is kinds(ROW_TILE, model.layers)
    assert model._rows_kinds(ROW_TILE + 1, meta) is None
    assert (kinds(ROW_TILE + 1, model.layers) is not None) == (kinds(ROW_TILE, model.layers) is not None)
