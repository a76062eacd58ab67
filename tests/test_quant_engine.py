"""`--quantization int8|int4|bf16` through the engine against Hugging Face run on the dequantised
weights: the test's own numpy round-to-nearest (tests/test_quant_kernels.py's numpy_rtn, float32
like the engine's) written into HF's linears. Prompt logits within 2e-4 (both float32 on the
same dequantised weights: summation order, and the dequantisation's q * s + offset rounding
against HF's (q - z) * s), greedy ids equal for 48 tokens; the prefix cache and speculative
decoding give the same ids; PD (P and D both int4) equals the colocated engine and HF."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer

import atomd.config
from atomd.config import EngineConfig
from atomd.kernels import cbuild
from atomd.llm import LLM
from atomd.model import huge_pages, layer_ops, quant
from atomd.model.quant import QuantizedWeight
from launch.process import http
from contracts.sampling import SamplingParams
from tests.pd_fixtures import metric, ref_and_pd
from tests.test_model_hf import _prompt_logits, hf_model, make_checkpoint, prompts_of
from tests.test_pd_e2e import complete
from tests.test_quant_kernels import numpy_rtn

torch.set_num_threads(1)
GREEDY_48 = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    # hidden 96: int4 groups of 32 on q/k/v/o/gate/up, 64 on down (inter 192)
    return make_checkpoint(tmp_path_factory.mktemp("qllama"), "llama", seed=7, hidden_size=96,
                           intermediate_size=192, num_attention_heads=6, num_key_value_heads=2)


_HF_DEQUANT: dict = {}


def hf_dequantised(path, method: str) -> torch.nn.Module:
    """HF's model with every decoder linear replaced by its numpy round-to-nearest, the LM
    head by its int8 one (int4's too, as llama.cpp keeps its output tensor above Q4_0), bf16's by bf16."""
    if (path, method) not in _HF_DEQUANT:
        model = copy.deepcopy(hf_model(path))
        with torch.no_grad():
            for name, module in model.named_modules():
                if name.startswith("model.layers.") and name.endswith("_proj") or name == "lm_head":
                    w = numpy_rtn(module.weight.numpy(), method if name != "lm_head" or method == "bf16" else "int8")
                    module.weight.copy_(torch.from_numpy(w.astype(np.float32)))
        _HF_DEQUANT[path, method] = model
    return _HF_DEQUANT[path, method]


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = []
    with torch.inference_mode():
        tokens = list(prompt)
        for _ in range(n):  # no KV cache: every step the whole sequence (tiny model, 48 steps)
            ids.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
            tokens.append(ids[-1])
    return ids


def greedy(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY_48) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.fixture(scope="module", params=["int8", "int4", "bf16"])
def quantized(request, llama_dir):
    with pytest.MonkeyPatch.context() as mp:  # every weight onto huge pages, as a full-size model's are
        mp.setattr(huge_pages, "MIN_BYTES", 0)
        return request.param, LLM(str(llama_dir), num_threads=1, max_model_len=256, quantization=request.param)


@pytest.mark.unit
def test_linears_are_packed_not_float(quantized):
    method, llm = quantized
    layer = llm.engine.model.layers[0]
    for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
        assert isinstance(w, QuantizedWeight) and w.bits == {"int8": 8, "int4": 4, "bf16": 16}[method]
    # batch-1 decode in the fused C layer over the packed weights where it builds (AVX-512)
    assert (llm.engine.model.decode_layer is not None) == layer_ops.has_decode_layer(torch.float32)
    lm_head = llm.engine.model.lm_head
    assert isinstance(lm_head, QuantizedWeight) and lm_head.bits == (16 if method == "bf16" else 8)
    if layer.rows is not None:  # batch-1 decode streams them: moved onto 2 MiB pages (huge_pages)
        assert all(t.data_ptr() % huge_pages.HUGE_PAGE == 0 for w in (*layer.rows, lm_head)
                   for t in (w.panels if w.strips_only else w.q, w.scales) if t is not None)


@pytest.mark.unit
def test_prompt_logits_match_hf_on_dequantised_weights(quantized, llama_dir):
    method, llm = quantized
    prompt = prompts_of([3 * 16 + 5], seed=4)[0]
    got = _prompt_logits(llm, prompt)
    with torch.inference_mode():
        want = hf_dequantised(llama_dir, method)(torch.tensor([prompt])).logits[0]
        plain = hf_model(llama_dir)(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    assert (got - plain).abs().max() > (1e-4 if method == "bf16" else 1e-3)  # the weights really are quantised


@pytest.mark.unit
def test_greedy_48_tokens_equal_hf_on_dequantised_weights(quantized, llama_dir):
    method, llm = quantized
    prompts = prompts_of([1, 16, 37], seed=5)
    for prompt, ids in zip(prompts, greedy(llm, prompts)):
        assert ids == hf_greedy(hf_dequantised(llama_dir, method), prompt, 48), f"prompt of {len(prompt)}"


@pytest.mark.unit
def test_batch_1_decode_equals_hf_on_dequantised_weights(quantized, llama_dir):
    """One sequence alone: its decode steps take the fused batch-1 layer (where it builds)."""
    method, llm = quantized
    prompt = prompts_of([21], seed=10)[0]
    assert greedy(llm, [prompt]) == [hf_greedy(hf_dequantised(llama_dir, method), prompt, 48)]


@pytest.mark.unit
def test_dtype_auto_on_a_cpu_without_bf16_dot_products_runs_bf16_weights(monkeypatch, llama_dir):
    """`--dtype auto` where the CPU has neither AVX512_BF16 nor AMX: float32 compute over the
    weights read as bf16 (the engine against HF float32 on the bf16-rounded weights)."""
    monkeypatch.setattr(atomd.config, "cpu_flags", lambda: {"avx2", "fma", "avx512f", "avx512_vnni"})
    llm = LLM(str(llama_dir), num_threads=1, max_model_len=256, dtype="auto")
    assert llm.engine.model.dtype == torch.float32 and llm.engine.config.quantization == "bf16"
    assert all(isinstance(w, QuantizedWeight) and w.bits == 16 for w in llm.engine.model.layers[0].linears())
    prompts = prompts_of([1, 37], seed=5)
    for prompt, ids in zip(prompts, greedy(llm, prompts)):
        assert ids == hf_greedy(hf_dequantised(llama_dir, "bf16"), prompt, 48), f"prompt of {len(prompt)}"


@pytest.mark.unit
def test_an_avx2_build_runs_silu_and_the_norms_in_the_products_with_hf_tokens(monkeypatch, llama_dir):
    """On an AVX2 build the 16-bit projections held as strips run silu in the gate_up product's pass
    (quant.qlinear_silu) and the residual add and next RMSNorm in the o / down products' (quant.qlinear_add_norm),
    every layer of each per-op step, a step's rows split between the threads (normed per block) and not (normed
    after), and the greedy ids equal HF float32 on the bf16-rounded weights."""
    monkeypatch.setenv(cbuild.ISA_ENV, "no-avx512")
    ran, real = [], quant.qlinear_silu
    monkeypatch.setattr(quant, "qlinear_silu", lambda *a, **k: ran.append(real(*a, **k)) or ran[-1])
    normed, real_norm = [], quant.qlinear_add_norm
    monkeypatch.setattr(quant, "qlinear_add_norm",
                        lambda x, *a, **k: normed.append((x.shape[0], real_norm(x, *a, **k))) or normed[-1][1])
    llm = LLM(str(llama_dir), num_threads=2, max_model_len=320, quantization="bf16")
    prompts = prompts_of([1, 37, 260, 270], seed=5)
    hf = hf_dequantised(llama_dir, "bf16")
    for batch in (prompts, prompts[1:2]):  # (one prefill step of 568 rows, then one of 37)
        for prompt, ids in zip(batch, greedy(llm, batch)):
            assert ids == hf_greedy(hf, prompt, 48), f"prompt of {len(prompt)}"
    assert ran and all(act is not None for act in ran)
    assert normed and all(done for _, done in normed)
    assert max(m for m, _ in normed) >= 2 * 256 > min(m for m, _ in normed)  # (W16_AVX2_BY_ROWS rows a thread)


@pytest.mark.unit
def test_dtype_auto_keeps_a_float16_checkpoint_as_float16_weights(monkeypatch, llama_dir, tmp_path):
    """A float16 checkpoint under `--dtype auto` without bf16 dot products: its weights as
    stored (float16, widened exactly), so the engine follows HF float32 on the checkpoint."""
    half = tmp_path / "fp16"
    copy.deepcopy(hf_model(llama_dir)).half().save_pretrained(half)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (half / name).write_bytes((llama_dir / name).read_bytes())
    assert json.loads((half / "config.json").read_text())["dtype"] == "float16"
    monkeypatch.setattr(atomd.config, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512f", "avx512_vnni"})
    llm = LLM(str(half), num_threads=1, max_model_len=256, dtype="auto")
    assert (llm.engine.model.dtype, llm.engine.config.quantization) == (torch.float32, "fp16")
    assert all(w.q.dtype == torch.float16 for w in llm.engine.model.layers[0].linears())
    reference = transformers.AutoModelForCausalLM.from_pretrained(half, dtype=torch.float32).eval()
    prompts = prompts_of([1, 37], seed=5)
    for prompt, ids in zip(prompts, greedy(llm, prompts)):
        assert ids == hf_greedy(reference, prompt, 48), f"prompt of {len(prompt)}"


@pytest.mark.unit
def test_prefix_cache_and_speculative_decoding_keep_the_ids(quantized, llama_dir):
    method, llm = quantized
    shared = prompts_of([40], seed=6)[0]
    prompts = [shared + [5, 6, 7], shared + [9]]  # the second hits the first's cached blocks
    plain = greedy(llm, prompts)
    spec = LLM(str(llama_dir), num_threads=1, max_model_len=256, quantization=method, speculative_config=SPEC)
    repeat = [p * 3 for p in prompts_of([8, 12], seed=8)]  # repetitive: the n-gram drafter proposes
    assert greedy(spec, prompts) == plain
    assert greedy(spec, repeat) == greedy(llm, repeat)
    assert spec.engine.scheduler.spec_stats.num_draft_tokens > 0


@pytest.mark.unit
def test_quantization_flag_is_checked():
    with pytest.raises(ValueError, match="quantization must be one of int8, int4, bf16"):
        EngineConfig(quantization="int3")


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_pd_int4_equals_colocated_and_hf(llama_dir):
    with ref_and_pd("--quantization", "int4", model=llama_dir) as cluster:
        prompt = [t % 297 + 3 for t in prompts_of([2 * 16 + 3], seed=9)[0]]
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        status, want = complete(cluster["ref"].url, body)
        assert status == 200, want
        status, got = complete(cluster.router.url, body)
        assert status == 200, got
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert metric(cluster["D"], "atomd:kv_transfer_bytes_total") > 0
        compat = json.loads(http("GET", cluster["P"].url + "/kv_transfer_info")[1])["compat"]
        assert compat["model_id"].endswith("+int4")  # a float32 peer of the same checkpoint is refused
        hf_ids = hf_greedy(hf_dequantised(llama_dir, "int4"), prompt, 16)
        assert got["choices"][0]["text"] == Tokenizer.from_file(str(llama_dir / "tokenizer.json")).decode(hf_ids)
        cluster.assert_settled()


@pytest.mark.unit
def test_tied_embeddings_keep_a_float_table_and_quantize_the_head(tmp_path):
    from safetensors.torch import load_file

    from atomd.model.loader import load_model

    path = make_checkpoint(tmp_path / "qwen2", "qwen2", seed=3)  # tied embeddings
    model = load_model(path, quantization="int4")
    table = load_file(path / "model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(model.embed, table)  # the lookup reads the floats
    want = numpy_rtn(table.numpy(), "int8")
    np.testing.assert_allclose(model.lm_head.dequantize().numpy(), want, rtol=1e-5, atol=1e-7)


@pytest.mark.unit
def test_int4_keeps_int8_for_inputs_not_a_multiple_of_32(caplog):
    """The built-in model's down projection has 688 inputs: int8 per channel, said once."""
    from atomd.model.default import default_model_dir
    from atomd.model.loader import load_model

    with caplog.at_level("WARNING", logger="atomd.model.quant_formats"):
        model = load_model(default_model_dir(), quantization="int4")
    layer = model.layers[0]
    assert (layer.qkv.bits, layer.gate_up.bits, layer.down.bits) == (4, 4, 8) and layer.down.in_features == 688
    assert caplog.text.count("not a multiple of 32") == 1


def hf_from_files(float_dir, weights: dict[str, np.ndarray], out) -> torch.nn.Module:
    """HF's model from a copy of float_dir whose tensors are `weights` (by checkpoint name: how
    transformers turns per-expert tensors into its own layout is then its business)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(float_dir, out)
    tensors = load_file(out / "model.safetensors")
    tensors.update({name: np.ascontiguousarray(w, np.float32) for name, w in weights.items()})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def hf_rtn_from_files(path, method: str, out) -> torch.nn.Module:
    """hf_from_files with the decoder linears, experts included, as their numpy round-to-nearest
    and the LM head as --quantization rounds it (int8 for the int methods)."""
    from safetensors.numpy import load_file

    from atomd.model.quant_formats import is_layer_linear

    tensors = load_file(path / "model.safetensors")
    head = quant.LM_HEAD_QUANTIZATION[method]
    return hf_from_files(path, {name: numpy_rtn(w, method if name != "lm_head.weight" else head)
                                for name, w in tensors.items() if is_layer_linear(name) or name == "lm_head.weight"},
                         out)


def assert_equals_hf_on(llm: LLM, hf: torch.nn.Module, prompt_len: int, seed: int) -> None:
    """Prompt logits within 2e-4 of `hf`'s (the same dequantised weights) for one prompt of
    prompt_len tokens, and 48 greedy ids equal for prompts of 1 and 20 tokens (seed + 1)."""
    prompt = prompts_of([prompt_len], seed=seed)[0]
    with torch.inference_mode():
        want = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(_prompt_logits(llm, prompt), want, atol=2e-4, rtol=0)
    prompts = prompts_of([1, 20], seed=seed + 1)
    for p, ids in zip(prompts, greedy(llm, prompts)):
        assert ids == hf_greedy(hf, p, 48)


@pytest.mark.unit
@pytest.mark.parametrize("method", ["int8", "bf16"])
def test_phi3_fused_projections_quantised_equal_hf_on_dequantised_weights(method, tmp_path):
    """Phi-3's checkpoint holds qkv and gate_up fused: quantized at load like any linear (the loader made them
    contiguous as tensors, which a QuantizedWeight is already), HF's logits and greedy ids on the same weights."""
    path = make_checkpoint(tmp_path / "phi3", "phi3", seed=9)
    llm = LLM(str(path), num_threads=1, max_model_len=256, quantization=method)
    assert all(isinstance(t, QuantizedWeight) for t in llm.engine.model.layers[0].linears())
    assert_equals_hf_on(llm, hf_dequantised(path, method), 21, seed=4)


@pytest.mark.unit
@pytest.mark.parametrize("kind,method", [("qwen3_moe", "int8"), ("mixtral", "int4"), ("qwen3_moe", "bf16")])
def test_moe_experts_quantised_equal_hf_on_dequantised_weights(kind, method, tmp_path):
    # hidden 64, expert intermediate 32 (Qwen3-MoE) / 128 (Mixtral): int4 groups of 32 everywhere
    path = make_checkpoint(tmp_path / kind, kind, seed=9, **({"moe_intermediate_size": 32} if kind == "qwen3_moe" else {}))
    llm = LLM(str(path), num_threads=1, max_model_len=256, quantization=method)
    moe = llm.engine.model.layers[0].moe
    assert moe.quantized and all(isinstance(w, QuantizedWeight) and w.bits == {"int8": 8, "int4": 4, "bf16": 16}[method]
                                 for w in [*moe.gate_up, *moe.down])
    # bf16 experts on an AVX2 build: held as their strips only (moe_q8 reads them)
    assert all(w.strips_only for w in moe.down) == (method == "bf16" and quant.kernels().w16_panels == 2)
    hf = hf_rtn_from_files(path, method, tmp_path / "hf")
    assert_equals_hf_on(llm, hf, 2 * 16 + 5, seed=4)
    # batch-1 decode of one sequence: 16-bit experts (float activations, moe_q8's) in the fused layer, whose router
    # and softmax run in C; int ones here take float activations, which moe_q8 does not run: per op
    assert (llm.engine.model.decode_layer is not None) == (method == "bf16")
    alone = prompts_of([7], seed=5)
    assert greedy(llm, alone)[0] == hf_greedy(hf, alone[0], 48)


def ran_rows(layer, layers) -> bool:
    """Whether a batch of 4 decode rows ran in the fused rows call where this CPU's products at 4 rows let it
    (DecodeLayer.rows_kinds_for: not where qlinear would take tiles the call has not)."""
    return layer.rows_steps > 0 or layer.rows_kinds_for(4, layers) is None


@pytest.mark.unit
# 3 threads, top-2: the fused layer's experts with their rows shared by the threads (moe_q_expert_rows), 1: whole
# experts a thread (moe_q_expert_own)
@pytest.mark.parametrize("kind,method,threads", [("qwen3_moe", "int8", 1), ("mixtral", "int4", 3)])
def test_moe_q8_experts_give_the_per_expert_paths_tokens(kind, method, threads, monkeypatch, tmp_path):
    """int8 / int4 experts with int8 activations in one C call a block (layer_ops.moe_q8: AMX-INT8 tiles
    from QGEMM_AMX_MIN_M rows an expert where the CPU has them, the int8-activation rows below) against one
    qlinear pair per expert (moe.Q8 off: what ran before), through the engine: prompts in 32-token chunks,
    batched decode of four sequences: the same token ids and logprobs (each expert's rows go through qlinear's
    own arithmetic, so the bits agree) in the prompts; in the batched steps and then one sequence alone, whose decode
    with moe.Q8 on runs the fused layer (DecodeLayer's rows and batch-1 calls: the router, its softmax in C and the
    experts as moe_q8 runs them, so its logits differ from the per-op path's in the last bits, as the float experts'
    fused layer does): the same token ids, logprobs within 1e-4. With
    experts of 2+ pairs widened to bf16 tiles (moe.Q8_WIDE_MIN_PAIRS; where the CPU has AMX): the same
    first tokens, logprobs within 0.05 (bf16 activations in place of int8 ones)."""
    from atomd.model import moe

    path = make_checkpoint(tmp_path / kind, kind, seed=11, **({"moe_intermediate_size": 32} if kind == "qwen3_moe" else {}))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    calls, real = [], layer_ops.moe_q8
    monkeypatch.setattr(layer_ops, "moe_q8", lambda *a: calls.append(len(a[4])) or real(*a))

    fused_layer = []

    def run() -> list:
        llm = LLM(str(path), num_threads=threads, max_model_len=256, quantization=method,
                  quantized_activations="int8", max_num_batched_tokens=32)
        layer = llm.engine.model.decode_layer
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts_of([40, 9, 3, 17], 12)],
                                                   params)]
        fused_layer.append(layer is not None and ran_rows(layer, llm.engine.model.layers))  # the batched steps
        outs += [o.outputs[0] for o in llm.generate([{"prompt_token_ids": prompts_of([5], 13)[0]}], params)]
        return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]

    monkeypatch.setattr(moe, "Q8_WIDE_MIN_PAIRS", 0)  # every expert on int8 activations: the per-expert path's bits
    fused = run()
    assert calls and max(calls) > 2  # the prompts' chunks (several experts a call)
    monkeypatch.setattr(moe, "Q8", False)
    calls.clear()
    per_op = run()
    assert not calls and fused_layer == [True, False]
    for (ids, lps), (want_ids, want_lps) in zip(fused, per_op):
        assert ids == want_ids
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(want_lps), atol=1e-4, rtol=0)
    # experts of several pairs widened to bf16 tiles where the CPU has them (bf16 activations in the prompt
    # chunks and batched steps): the same first tokens, their logprobs near int8 activations' ones
    monkeypatch.setattr(moe, "Q8", True)
    monkeypatch.setattr(moe, "Q8_WIDE_MIN_PAIRS", 2)
    widened = run()
    for (ids, lps), (want_ids, want_lps) in zip(widened, fused):
        assert ids[0] == want_ids[0] and abs(lps[0] - want_lps[0]) < 0.05


@pytest.mark.unit
@pytest.mark.parametrize("kind,method,threads", [("qwen3_moe", "bf16", 2), ("mixtral", "fp16", 3)])
def test_moe_16bit_experts_in_one_call_give_the_per_expert_paths_tokens(kind, method, threads, monkeypatch, tmp_path):
    """16-bit experts (`--quantization bf16|fp16`, what `--dtype auto` loads on a CPU without AVX512_BF16) in one
    C call a block (layer_ops.moe_q8: each expert's rows through the rows kernel, from QGEMM_W16_MIN_M rows the
    panels; an AVX2 build's load-time strips) against one qlinear pair per expert (moe.Q8 off), prompts in 32-token
    chunks, batched decode, then batch 1; the panels' cut-over lowered so both kernels run. With moe.Q8 on the decode
    steps run the fused layer (its rows and batch-1 calls; the router's softmax in C): the same ids, logprobs within
    1e-4 (test_moe_q8_experts_give_the_per_expert_paths_tokens)."""
    from atomd.model import moe

    path = make_checkpoint(tmp_path / kind, kind, seed=12, **({"moe_intermediate_size": 32} if kind == "qwen3_moe" else {}))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    calls, real = [], layer_ops.moe_q8
    monkeypatch.setattr(layer_ops, "moe_q8", lambda *a: calls.append(len(a[4])) or real(*a))
    monkeypatch.setattr(quant, "QGEMM_W16_MIN_M", 3)

    fused_layer = []

    def run() -> list:
        llm = LLM(str(path), num_threads=threads, max_model_len=256, quantization=method, max_num_batched_tokens=32)
        layer = llm.engine.model.decode_layer
        moe_w = llm.engine.model.layers[0].moe
        assert moe_w.quantized and {w.q.dtype for w in [*moe_w.gate_up, *moe_w.down]} == {
            torch.bfloat16 if method == "bf16" else torch.float16}
        outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts_of([40, 9, 3, 17], 14)],
                                                   params)]
        fused_layer.append(layer is not None and ran_rows(layer, llm.engine.model.layers))
        outs += [o.outputs[0] for o in llm.generate([{"prompt_token_ids": prompts_of([5], 15)[0]}], params)]
        return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]

    fused = run()
    assert calls and max(calls) > 2  # the prompts' chunks (several experts a call)
    monkeypatch.setattr(moe, "Q8", False)
    calls.clear()
    per_op = run()
    assert not calls and fused_layer == [True, False]
    for (ids, lps), (want_ids, want_lps) in zip(fused, per_op):
        assert ids == want_ids
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(want_lps), atol=1e-4, rtol=0)


@pytest.mark.unit
def test_nan_router_logits_still_route_k_distinct_experts(tmp_path):
    """Router logits of NaN (a broken checkpoint, an overflow upstream) in the fused layers' C routing (the batch
    rows call and the batch-1 layer), as torch's topk per op: k distinct experts in range a token (it chose expert
    -1 before: indexing before its arrays), so the requests finish and each token counts k experts a layer."""
    path = make_checkpoint(tmp_path / "moe", "qwen3_moe", seed=11, moe_intermediate_size=32)
    llm = LLM(str(path), num_threads=2, max_model_len=256, quantization="int8", quantized_activations="int8")
    model, new = llm.engine.model, 4
    blocks = [w.moe for w in model.layers if w.moe is not None]
    assert model.decode_layer is not None and blocks
    for m in blocks:
        m.router.fill_(float("nan"))
    batches = (prompts_of([9, 5, 7], 21), prompts_of([6], 22))  # the rows call, then the batch-1 layer
    for prompts in batches:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
        assert [len(o.outputs[0].token_ids) for o in outs] == [new] * len(prompts)
    assert ran_rows(model.decode_layer, model.layers)
    passes = sum(len(p) + new - 1 for prompts in batches for p in prompts)  # each prompt token and fed-back token
    for m in blocks:
        assert int(m.routed.min()) >= 0 and int(m.routed.sum()) == m.top_k * passes
