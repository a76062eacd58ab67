"""Quantized Hugging Face checkpoints (atomd/model/quant_formats.py): a tiny random Llama's
linears quantised here and packed by hand, in numpy, in each format's documented on-disk
layout (GPTQ v1 incl. act-order g_idx, 4 and 8 bit; AWQ GEMM; compressed-tensors W4A16 / W8A16
pack-quantized and int-quantized), written as safetensors with the format's
quantization_config; the engine's prompt logits within 2e-4 of HF run on the dequantised float
weights ((q - zero) * scale in numpy; both float32, summation order apart) and greedy ids equal.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from atomd.llm import LLM
from atomd.model.quant import QuantizedWeight
from tests.test_model_hf import _prompt_logits, hf_model, make_checkpoint, prompts_of
from tests.test_quant_engine import greedy, hf_greedy

pytestmark = pytest.mark.unit
torch.set_num_threads(1)
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's: nibble i of an int32 holds output column 8c + AWQ_ORDER[i]


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    # hidden 128, inter 256: every linear's input divides into groups of 32, 64 and 128
    return make_checkpoint(tmp_path_factory.mktemp("qfloat"), "llama", seed=11, hidden_size=128,
                           intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)


def asym_quantise(w, bits, g_idx, groups):
    """Per-group asymmetric round-to-nearest of w [N, K] by each input's group g_idx[k]:
    values [N, K] in 0..2^bits - 1, zeros and scales [groups, N] (scales fp16 as stored)."""
    top = (1 << bits) - 1
    zeros = np.zeros((groups, w.shape[0]), np.int64)
    scales = np.zeros((groups, w.shape[0]), np.float16)
    values = np.zeros(w.shape, np.int64)
    for g in range(groups):
        cols = g_idx == g
        lo, hi = np.minimum(w[:, cols].min(1), 0), np.maximum(w[:, cols].max(1), 0)
        s = ((hi - lo) / top).astype(np.float16)
        s[s == 0] = 1
        z = np.clip(np.round(-lo / s.astype(np.float32)), 1, top)  # >= 1: GPTQ v1 stores zero - 1
        scales[g], zeros[g] = s, z
        values[:, cols] = np.clip(np.round(w[:, cols] / s[:, None].astype(np.float32)) + z[:, None], 0, top)
    deq = (values - zeros[g_idx].T) * scales[g_idx].T.astype(np.float32)
    return values, zeros, scales, deq.astype(np.float32)


def pack_rows(v, bits):
    """[R, C] values -> int32 [R / (32 / bits), C]: rows i*per + j in bits j*bits.. of word i."""
    per = 32 // bits
    out = np.zeros((v.shape[0] // per, v.shape[1]), np.uint32)
    for j in range(per):
        out |= (v[j::per].astype(np.uint32) & ((1 << bits) - 1)) << np.uint32(bits * j)
    return out.view(np.int32)


def gptq_tensors(name, w, bits, group, desc_act, rng):
    n, k = w.shape
    group = k if group == -1 else group
    groups = -(-k // group)
    g_idx = np.arange(k) // group
    if desc_act:  # act-order: the inputs quantised in a permuted order, each input's group by its rank
        g_idx = np.argsort(rng[k]) // group
    values, zeros, scales, deq = asym_quantise(w, bits, g_idx, groups)
    return deq, {f"{name}.qweight": pack_rows(values.T, bits), f"{name}.qzeros": pack_rows((zeros - 1).T, bits).T,
                 f"{name}.scales": scales, f"{name}.g_idx": g_idx.astype(np.int32),
                 f"{name}.bias": np.zeros(n, np.float16)}  # AutoGPTQ writes a bias even where the model has none


def awq_pack(v):
    """[R, N] 4-bit values -> int32 [R, N / 8] in AutoAWQ's interleaved nibble order."""
    out = np.zeros((v.shape[0], v.shape[1] // 8), np.uint32)
    for i, col in enumerate(AWQ_ORDER):
        out |= v[:, col::8].astype(np.uint32) << np.uint32(4 * i)
    return out.view(np.int32)


def awq_tensors(name, w, group):
    k = w.shape[1]
    values, zeros, scales, deq = asym_quantise(w, 4, np.arange(k) // group, k // group)
    return deq, {f"{name}.qweight": awq_pack(values.T), f"{name}.qzeros": awq_pack(zeros), f"{name}.scales": scales}


def ct_tensors(name, w, bits, group, fmt):
    """compressed-tensors symmetric: signed values, scale = max|w| / (2^(bits-1) - 1)."""
    n, k = w.shape
    group = k if group == -1 else group
    top = (1 << (bits - 1)) - 1
    scales = (np.abs(w.reshape(n, k // group, group)).max(2) / top).astype(np.float16)
    scales[scales == 0] = 1
    s = np.repeat(scales.astype(np.float32), group, axis=1)
    values = np.clip(np.round(w / s), -top - 1, top).astype(np.int64)
    deq = (values * s).astype(np.float32)
    if fmt == "int-quantized":
        return deq, {f"{name}.weight": values.astype(np.int8), f"{name}.weight_scale": scales}
    stored = values + (1 << (bits - 1))  # pack_to_int32: unsigned, then packed along the inputs
    return deq, {f"{name}.weight_packed": pack_rows(stored.T, bits).T.copy(), f"{name}.weight_scale": scales,
                 f"{name}.weight_shape": np.array([n, k], np.int64)}


FORMATS = {  # id -> (quantization_config, packer(name, w, rng))
    "gptq4-g32": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False,
                   "checkpoint_format": "gptq"}, lambda n, w, r: gptq_tensors(n, w, 4, 32, False, r)),
    "gptq4-g64-act-order": ({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True, "sym": False},
                            lambda n, w, r: gptq_tensors(n, w, 4, 64, True, r)),
    "gptq8-g128-act-order": ({"quant_method": "gptq", "bits": 8, "group_size": 128, "desc_act": True, "sym": False},
                             lambda n, w, r: gptq_tensors(n, w, 8, 128, True, r)),
    "gptq8-per-channel": ({"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": False, "sym": False},
                          lambda n, w, r: gptq_tensors(n, w, 8, -1, False, r)),
    "awq-gemm-g32": ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
                     lambda n, w, r: awq_tensors(n, w, 32)),
    "ct-w4a16-g32": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                      "quantization_status": "compressed", "config_groups": {"group_0": {
                          "targets": ["Linear"], "input_activations": None, "output_activations": None,
                          "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                      "group_size": 32, "dynamic": False}}}},
                     lambda n, w, r: ct_tensors(n, w, 4, 32, "pack-quantized")),
    "ct-w8a16-channel": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                          "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                                        "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                                    "strategy": "channel"}}}},
                         lambda n, w, r: ct_tensors(n, w, 8, -1, "pack-quantized")),
    "ct-w8a16-int-quantized": ({"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
                                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                    "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}}},
                               lambda n, w, r: ct_tensors(n, w, 8, -1, "int-quantized")),
}


def write_quantized(float_dir, out, fmt, legacy_file=False):
    """The float checkpoint's decoder linears packed in format `fmt`; returns the dequantised
    float weights by module name, for HF."""
    quant_config, packer = FORMATS[fmt]
    shutil.copytree(float_dir, out)
    tensors = load_file(out / "model.safetensors")
    rng = {k: np.random.default_rng(k).random(k) for k in (128, 256)}  # one act-order per input: shared by q/k/v
    packed, deq = {}, {}
    for name in list(tensors):
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            module = name.removesuffix(".weight")
            deq[module], parts = packer(module, tensors.pop(name).numpy(), rng)
            packed.update({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in parts.items()})
    save_file({**tensors, **packed}, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    if legacy_file:  # AutoGPTQ's quantize_config.json beside a config.json without the field
        (out / "quantize_config.json").write_text(json.dumps({k: v for k, v in quant_config.items()
                                                              if k != "quant_method"}))
    else:
        config["quantization_config"] = quant_config
    (out / "config.json").write_text(json.dumps(config))
    return deq


_HF: dict = {}  # (float checkpoint, format) -> HF model on its dequantised weights


def hf_on(float_dir, fmt, deq):
    # keyed by the checkpoint too: test_tensor_parallel_quant packs another float checkpoint in
    # the same format (keyed by fmt alone, whichever ran first set the other's reference)
    key = (str(float_dir), fmt)
    if key not in _HF:
        import copy
        model = copy.deepcopy(hf_model(float_dir))
        with torch.no_grad():
            for name, module in model.named_modules():
                if name in deq:
                    module.weight.copy_(torch.from_numpy(deq[name]))
        _HF[key] = model
    return _HF[key]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_checkpoint_loads_packed_and_equals_hf_on_dequantised_weights(fmt, float_dir, tmp_path):
    deq = write_quantized(float_dir, tmp_path / fmt, fmt)
    llm = LLM(str(tmp_path / fmt), num_threads=1, max_model_len=256)
    layer = llm.engine.model.layers[0]
    bits = 8 if "8" in fmt.split("-")[0] or "w8" in fmt else 4
    assert all(isinstance(w, QuantizedWeight) and w.bits == bits for w in (layer.qkv, layer.o, layer.gate_up,
                                                                           layer.down))
    assert (layer.down.perm is not None) == ("act-order" in fmt)  # K 256: two groups even of 128
    prompt = prompts_of([2 * 16 + 7], seed=12)[0]
    hf = hf_on(float_dir, fmt, deq)
    with torch.inference_mode():
        want = hf(torch.tensor([prompt])).logits[0]
        plain = hf_model(float_dir)(torch.tensor([prompt])).logits[0]
    got = _prompt_logits(llm, prompt)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    assert (got - plain).abs().max() > 1e-3  # the packed weights are what ran
    prompts = prompts_of([1, 20], seed=13)
    for p, ids in zip(prompts, greedy(llm, prompts)):
        assert ids == hf_greedy(hf, p, 48)


def test_autogptq_quantize_config_file_is_read(float_dir, tmp_path):
    deq = write_quantized(float_dir, tmp_path / "legacy", "gptq4-g32", legacy_file=True)
    llm = LLM(str(tmp_path / "legacy"), num_threads=1, max_model_len=256)
    prompt = prompts_of([9], seed=14)[0]
    with torch.inference_mode():
        want = hf_on(float_dir, "gptq4-g32", deq)(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(_prompt_logits(llm, prompt), want, atol=2e-4, rtol=0)


@pytest.mark.parametrize("edit,message", [
    ({"bits": 3}, "gptq checkpoint with 3-bit weights is not supported"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "awq checkpoint .* version gemv"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "format 'float-quantized'"),
])
def test_unsupported_variants_are_refused_by_name(float_dir, tmp_path, edit, message):
    write_quantized(float_dir, tmp_path / "m", "gptq4-g32")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["quantization_config"].update(edit)
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path / "m"), num_threads=1, max_model_len=256)


def test_quantization_flag_on_a_quantized_checkpoint_is_refused(float_dir, tmp_path):
    write_quantized(float_dir, tmp_path / "m", "awq-gemm-g32")
    with pytest.raises(ValueError, match="already quantized \\(awq\\)"):
        LLM(str(tmp_path / "m"), num_threads=1, max_model_len=256, quantization="int8")
