"""`architectures` in config.json -> the model class of its family (one small file each
under atomd/model/, on the shared layers of atomd/model/decoder.py), imported on first use."""
from __future__ import annotations

import importlib
from typing import Any

ARCHITECTURES = {
    "LlamaForCausalLM": "atomd.model.llama:LlamaModel",
    "MistralForCausalLM": "atomd.model.llama:LlamaModel",
    "Qwen2ForCausalLM": "atomd.model.llama:LlamaModel",
    "Qwen3ForCausalLM": "atomd.model.qwen3:Qwen3Model",
    "Qwen3MoeForCausalLM": "atomd.model.qwen3_moe:Qwen3MoeModel",
    "MixtralForCausalLM": "atomd.model.mixtral:MixtralModel",
    "Phi3ForCausalLM": "atomd.model.phi3:Phi3Model",
    "Gemma3ForCausalLM": "atomd.model.gemma3:Gemma3Model",
    "Gemma3ForConditionalGeneration": "atomd.model.gemma3:Gemma3Model",  # its text model (text inputs only)
    "DeepseekV2ForCausalLM": "atomd.model.deepseek:DeepseekModel",
    "DeepseekV3ForCausalLM": "atomd.model.deepseek:DeepseekModel",
}


def architecture(hf: dict[str, Any]) -> str:
    """The first of the config's `architectures` atomd serves; ValueError naming them if none."""
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"unsupported architecture {archs or hf.get('model_type')!r}: "
                         f"supported are {', '.join(ARCHITECTURES)}")
    return arch


def model_class(arch: str) -> type:
    module, name = ARCHITECTURES[arch].split(":")
    return getattr(importlib.import_module(module), name)
