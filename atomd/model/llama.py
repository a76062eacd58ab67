"""The Llama family: Llama (incl. llama3 RoPE scaling), Mistral (its sliding window on by
default, every layer) and Qwen2 (a qkv bias always; a window, with use_sliding_window, on the
layers from max_window_layers on) -- the shared decoder as it is."""
from __future__ import annotations

from typing import Any

from atomd.model.config import ModelConfig
from atomd.model.decoder import DecoderModel


class LlamaModel(DecoderModel):
    @classmethod
    def config_from_hf(cls, hf: dict[str, Any], arch: str) -> ModelConfig:
        return ModelConfig.from_hf(hf, arch, qkv_bias=arch == "Qwen2ForCausalLM",
                                   sliding_by_default=arch == "MistralForCausalLM",
                                   window_layers_by_type=arch == "Qwen2ForCausalLM")
