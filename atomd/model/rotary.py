"""RoPE as transformers computes it: inverse frequencies (default, linear, llama3, yarn and
longrope scaling) and the cos / sin tables the kernels read.

longrope past original_max_position_embeddings: transformers picks the long factors for a
whole forward when its furthest position is past the original length, the short ones
otherwise (`longrope_frequency_update`). The tables then hold both: rows 0 .. max_positions - 1
the short factors', rows max_positions .. 2 * max_positions - 1 the long ones'; a token reads
row position + max_positions where its sequence's furthest position in the step is past the
original length (`long_rope_positions`)."""
from __future__ import annotations

import math

import torch

from atomd.model.config import ModelConfig


def rope_tables(cfg: ModelConfig, max_positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, head_dim // 2] in `dtype`, times longrope's attention factor;
    [2 * max_positions, ...] for longrope past its original length (short rows, then long)."""
    kinds = [False, True] if has_long_rows(cfg, max_positions) else [False]
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.cat([torch.outer(positions, rope_inv_freq(cfg, long)) for long in kinds])
    scale = {"longrope": longrope_attention_factor, "yarn": yarn_attention_factor}.get(rope_kind(cfg), lambda _: 1.0)(cfg)
    return (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)


def has_long_rows(cfg: ModelConfig, max_positions: int) -> bool:
    """longrope with positions past original_max_position_embeddings: the long factors' rows too."""
    return rope_kind(cfg) == "longrope" and max_positions > cfg.rope_scaling["original_max_position_embeddings"]


def long_rope_positions(positions: torch.Tensor, seq_last: torch.Tensor, original: int,
                        max_positions: int) -> torch.Tensor:
    """The table row of each token: `positions` for the short factors, + max_positions (the long
    rows) where seq_last, its sequence's furthest position in this step, is past the original
    length (position >= original: transformers' seq_len > original_max_position_embeddings)."""
    return torch.where(seq_last >= original, positions + max_positions, positions).contiguous()


def rope_kind(cfg: ModelConfig) -> str:
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return "longrope" if kind == "su" else kind  # "su": Phi-3's first name for it


def longrope_attention_factor(cfg: ModelConfig) -> float:
    scaling = cfg.rope_scaling
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    original = yarn_original_length(cfg)
    factor = scaling.get("factor") or cfg.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(cfg: ModelConfig) -> float:
    """What yarn multiplies cos and sin by: the config's attention_factor, else
    mscale(mscale) / mscale(mscale_all_dim) where both are set (DeepSeek), else mscale(1)."""
    scaling = cfg.rope_scaling
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    factor = yarn_factor(cfg)
    mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
    return yarn_mscale(factor)


def yarn_factor(cfg: ModelConfig) -> float:
    scaling = cfg.rope_scaling
    return scaling.get("factor") or cfg.max_position_embeddings / yarn_original_length(cfg)


def yarn_original_length(cfg: ModelConfig) -> int:
    """The pre-training context yarn extends (transformers: max_position_embeddings without one)."""
    return cfg.rope_scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings


def yarn_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """YaRN's blend of the interpolated (/ factor) and the original frequencies: original above
    beta_fast rotations over the original length, interpolated below beta_slow, a linear ramp
    between (transformers' _compute_yarn_parameters, `truncate` included)."""
    scaling, dim, base = cfg.rope_scaling, cfg.head_dim, cfg.rope_theta
    original = yarn_original_length(cfg)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return 1.0 / (yarn_factor(cfg) * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


def rope_inv_freq(cfg: ModelConfig, long: bool = False) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2]; long: longrope's long factors."""
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
    if kind == "yarn":
        return yarn_inv_freq(cfg)
    if kind == "longrope":
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        factors = scaling["long_factor" if long else "short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * cfg.rope_theta ** shape)
    raise ValueError(f"unsupported rope_scaling rope_type {kind!r} (supported: default, linear, llama3, longrope, yarn)")
