"""Loading HF checkpoints: single-file and sharded safetensors give the weights transformers
saved; unsupported architectures and missing tensors are errors that name them."""
from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from atomd.model.linear import dense
from atomd.model.loader import load_model
from tests.test_model_hf import make_checkpoint

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> pathlib.Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=4)


def _edit_config(path: pathlib.Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.unit
def test_weights_are_packed_from_the_checkpoint(llama_dir):
    model = load_model(llama_dir)
    tensors = load_file(llama_dir / "model.safetensors")
    p = "model.layers.1."
    want_qkv = torch.cat([tensors[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"])
    assert torch.equal(dense(model.layers[1].qkv), want_qkv)
    want_gate_up = torch.cat([tensors[f"{p}mlp.gate_proj.weight"], tensors[f"{p}mlp.up_proj.weight"]])
    assert torch.equal(dense(model.layers[1].gate_up), want_gate_up)
    assert torch.equal(dense(model.lm_head), tensors["lm_head.weight"])
    # fp32 weights are held once, in oneDNN's packed layout (no plain copy beside them)
    assert model.layers[1].qkv.is_mkldnn == torch.backends.mkldnn.is_available()
    assert model.config.num_kv_heads == 2 and model.config.rope_scaling["rope_type"] == "llama3"


@pytest.mark.unit
def test_sharded_checkpoint_loads_the_same_weights(llama_dir, tmp_path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    a, b = load_model(llama_dir), load_model(tmp_path)
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(dense(la.qkv), dense(lb.qkv)) and torch.equal(dense(la.down), dense(lb.down))
    assert torch.equal(a.embed, b.embed) and torch.equal(dense(a.lm_head), dense(b.lm_head))


@pytest.mark.unit
def test_tied_embeddings_read_the_embedding(tmp_path):
    model = load_model(make_checkpoint(tmp_path, "qwen2", seed=1))
    assert torch.equal(dense(model.lm_head), model.embed) and model.layers[0].qkv_bias is not None


@pytest.mark.unit
def test_unsupported_architecture_is_named(llama_dir, tmp_path):
    shutil.copytree(llama_dir, tmp_path / "m")
    _edit_config(tmp_path / "m", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_model(tmp_path / "m")


@pytest.mark.unit
def test_unsupported_rope_type_is_named(llama_dir, tmp_path):
    shutil.copytree(llama_dir, tmp_path / "m")
    _edit_config(tmp_path / "m", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        load_model(tmp_path / "m")


@pytest.mark.unit
@pytest.mark.parametrize("name", ["model.layers.1.mlp.down_proj.weight", "lm_head.weight"])
def test_missing_tensor_is_named(llama_dir, tmp_path, name):
    shutil.copytree(llama_dir, tmp_path / "m")
    tensors = load_file(llama_dir / "model.safetensors")
    del tensors[name]
    save_file(tensors, tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"missing tensor '{name}'"):
        load_model(tmp_path / "m")


@pytest.mark.unit
def test_missing_files_are_named(llama_dir, tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path)
    shutil.copy(llama_dir / "config.json", tmp_path)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(tmp_path)


@pytest.mark.unit
def test_bfloat16_weights_when_asked(llama_dir):
    model = load_model(llama_dir, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.layers[0].qkv.dtype == torch.bfloat16


@pytest.mark.unit
def test_a_bf16_checkpoint_runs_in_the_asked_dtype_and_says_so(llama_dir, tmp_path, caplog):
    """The checkpoint's own dtype never picks the run's: bf16 files load as float32 when
    float32 is asked (exactly: bf16 -> fp32 is lossless), and the start-up log says both."""
    shutil.copytree(llama_dir, tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    tensors = {k: v.bfloat16() for k, v in load_file(path).items()}
    save_file(tensors, path)
    with caplog.at_level("INFO", logger="atomd.model.loader"):
        model = load_model(tmp_path / "m", dtype=torch.float32)
    assert model.dtype == torch.float32
    assert torch.equal(model.embed, tensors["model.embed_tokens.weight"].float())
    assert "weights stored as BF16, run as float32" in caplog.text


@pytest.mark.unit
@pytest.mark.parametrize("method", ["fp8", "bitsandbytes", "no-method"])
def test_unknown_quantization_method_is_refused_by_name(llama_dir, tmp_path, method):
    """A quantized checkpoint of a method atomd does not read (fp8, bitsandbytes, ...) is
    refused naming it, never cast as floats; GPTQ / AWQ / compressed-tensors load
    (tests/test_quant_formats.py)."""
    shutil.copytree(llama_dir, tmp_path / "m")
    quant = {"fp8": lambda: transformers.FineGrainedFP8Config().to_dict(),
             "bitsandbytes": lambda: transformers.BitsAndBytesConfig(load_in_4bit=True).to_dict(),
             "no-method": lambda: {"bits": 4}}[method]()
    _edit_config(tmp_path / "m", quantization_config=quant)
    want = getattr(quant.get("quant_method", "unknown"), "value", quant.get("quant_method", "unknown"))
    with pytest.raises(ValueError, match=f"quantized checkpoint \\({want}\\) is not supported"):
        load_model(tmp_path / "m")
