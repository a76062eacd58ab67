"""RoPE as transformers computes it: inverse frequencies (default, linear, llama3 and
longrope scaling) and the cos / sin tables the kernels read."""
from __future__ import annotations

import math

import torch

from atomd.model.config import ModelConfig


def rope_tables(cfg: ModelConfig, max_positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, head_dim // 2] in `dtype`, times longrope's attention factor."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(cfg, max_positions))
    scale = longrope_attention_factor(cfg) if rope_kind(cfg) == "longrope" else 1.0
    return (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)


def rope_kind(cfg: ModelConfig) -> str:
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return "longrope" if kind == "su" else kind  # "su": Phi-3's first name for it


def longrope_attention_factor(cfg: ModelConfig) -> float:
    scaling = cfg.rope_scaling
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or cfg.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_inv_freq(cfg: ModelConfig, max_positions: int) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling, kind = cfg.rope_scaling or {}, rope_kind(cfg)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind == "longrope":  # the short factors: transformers takes the long ones past the original length
        original = scaling["original_max_position_embeddings"]
        if max_positions > original:
            raise ValueError(f"longrope: max_model_len={max_positions} is past original_max_position_embeddings="
                             f"{original}, where the long factors apply, which this engine does not implement; "
                             f"lower --max-model-len to {original}")
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * cfg.rope_theta ** shape)
    raise ValueError(f"unsupported rope_scaling rope_type {kind!r} (supported: default, linear, llama3, longrope)")
