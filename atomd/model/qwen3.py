"""Qwen3 (dense): per-head q/k RMSNorm before RoPE, no qkv bias, tied or untied LM head."""
from __future__ import annotations

from typing import Any

from atomd.model.config import ModelConfig
from atomd.model.decoder import DecoderModel


class Qwen3Model(DecoderModel):
    @classmethod
    def config_from_hf(cls, hf: dict[str, Any], arch: str) -> ModelConfig:
        return ModelConfig.from_hf(hf, arch, window_layers_by_type=True, qk_norm=True)
