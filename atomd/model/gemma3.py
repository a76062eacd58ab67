"""Gemma 3 text models (`Gemma3ForCausalLM`, config model_type gemma3_text), as transformers
computes them:

- layers interleaved sliding-window and global (`layer_types`, else every
  `sliding_window_pattern`-th layer global, 6 by default), each kind with its own RoPE: local
  layers `rope_local_base_freq` unscaled, global ones `rope_theta` with `rope_scaling`
  (transformers 5 writes both under rope_parameters.{sliding,full}_attention);
- Gemma's RMSNorm, x * rsqrt(mean(x^2) + eps) * (1 + weight) in float32, rounded once to the
  model's dtype; q/k norm per head before RoPE; norms before and after attention and before
  and after the MLP (the residual adds what the post-norms return);
- a GELU-tanh gated MLP, embeddings times sqrt(hidden) rounded to the model's dtype,
  scores scaled by query_pre_attn_scalar ** -0.5, logits soft-capped by
  final_logit_softcapping where the config sets it; tied LM head.

`Gemma3ForConditionalGeneration` (the vision-language checkpoints, gemma-3-4b/12b/27b): its text
model is served: the config's nested `text_config` (with Gemma3TextConfig's defaults for the
fields a hub config leaves out) and the weights under `language_model.model.` (the hub's
layout, as transformers writes it) or `model.language_model.`; no logit soft-capping (its
transformers class has none); the vision tower and projector are never read, and a request
with an image part is a 400 (atomd/api/validation.py).

Refused with the reason: attn_logit_softcapping (no Gemma 3 checkpoint sets it; it would need a
tanh inside every attention kernel) and bidirectional attention (EmbeddingGemma).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from atomd.model.config import ModelConfig, windows_of_types
from atomd.model.decoder import DecoderModel, LayerWeights, TensorSource, lora_linear
from atomd.model.layer_ops import rms_norm
from atomd.model.lora import LayerLora
from atomd.model.rotary import rope_tables
from atomd.model.text_config import GEMMA3_ACT as ACT, VISION_LANGUAGE, text_config



@dataclass
class Gemma3Config(ModelConfig):
    local_rope_theta: float = 10000.0
    local_rope_scaling: dict[str, Any] | None = None
    final_logit_softcapping: float | None = None


def _rope_params(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global, local) RoPE parameters: rope_theta plus the scaling's fields."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5
        return dict(params["full_attention"] or {}), dict(params.get("sliding_attention") or {})
    glob = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1_000_000.0)}
    return glob, {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}


def _scaling(params: dict[str, Any]) -> dict[str, Any] | None:
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return scaling if scaling.get("rope_type", scaling.get("type", "default")) != "default" else None


class TextModelSource:
    """A vision-language checkpoint's text model under the names a text-only one uses
    (`model.*`, `lm_head.weight`)."""

    LAYOUTS = (("language_model.model.", "language_model.lm_head.weight"),  # the hub's (transformers writes it)
               ("model.language_model.", "lm_head.weight"))

    def __init__(self, src: TensorSource):
        for body, head in self.LAYOUTS:
            if body + "embed_tokens.weight" in src:
                self.src, self.body, self.head = src, body, head
                return
        raise ValueError(f"{VISION_LANGUAGE}: no text model weights in the checkpoint (looked for "
                         f"{' and '.join(b + 'embed_tokens.weight' for b, _ in self.LAYOUTS)})")

    def name(self, name: str) -> str:
        if name.startswith("model."):
            return self.body + name[len("model."):]
        return self.head if name == "lm_head.weight" else name

    def __contains__(self, name: str) -> bool:
        return self.name(name) in self.src

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return self.src.get(self.name(name), dtype)

    def stored_dtype(self, name: str) -> str:
        return self.src.stored_dtype(self.name(name))


class Gemma3Model(DecoderModel):
    @classmethod
    def tensor_source(cls, src: TensorSource, cfg: ModelConfig) -> TensorSource:
        return TextModelSource(src) if cfg.architecture == VISION_LANGUAGE else src

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any], arch: str) -> ModelConfig:
        if arch == VISION_LANGUAGE:
            hf = text_config(hf)
        if hf.get("attn_logit_softcapping") is not None:
            raise ValueError(f"{arch}: attn_logit_softcapping={hf['attn_logit_softcapping']} is not supported "
                             f"(Gemma 3 checkpoints leave it null)")
        if hf.get("use_bidirectional_attention"):
            raise ValueError(f"{arch}: use_bidirectional_attention (an embedding model) is not supported")
        act = hf.get("hidden_activation") or hf.get("hidden_act") or ACT
        if act != ACT:
            raise ValueError(f"unsupported hidden_activation {act!r} for {arch} (only {ACT})")
        layers = hf["num_hidden_layers"]
        pattern = hf.get("sliding_window_pattern", 6)
        types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                          for i in range(layers)]
        window = hf.get("sliding_window") or 4096
        glob, local = _rope_params(hf)
        hf = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling", "hidden_act")}
        cfg = Gemma3Config.from_hf(
            {**hf, "rope_theta": glob.get("rope_theta", 1_000_000.0)}, arch, hidden_act=ACT, qk_norm=True,
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
            local_rope_theta=float(local.get("rope_theta", 10_000.0)), local_rope_scaling=_scaling(local),
            final_logit_softcapping=hf.get("final_logit_softcapping"))
        return replace(cfg, rope_scaling=_scaling(glob), sliding_window=window,
                       layer_windows=windows_of_types(types, window, layers),
                       tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)))

    @classmethod
    def load_layer(cls, src: TensorSource, cfg: ModelConfig, i: int, dtype: torch.dtype) -> LayerWeights:
        """Llama's names plus pre_/post_feedforward_layernorm; every norm's weight as (1 + w) in float32."""
        w = super().load_layer(src, cfg, i, dtype)
        p = f"model.layers.{i}."
        w.pre_mlp_norm = src.get(p + "pre_feedforward_layernorm.weight", dtype)
        w.post_mlp_norm = src.get(p + "post_feedforward_layernorm.weight", dtype)
        for name in ("input_norm", "post_norm", "pre_mlp_norm", "post_mlp_norm", "q_norm", "k_norm"):
            setattr(w, name, _one_plus(getattr(w, name)))
        return w

    def __post_init__(self) -> None:
        cfg = self.config
        self.norm = _one_plus(self.norm)
        local = replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=cfg.local_rope_scaling)
        self.local_cos, self.local_sin = rope_tables(local, self.max_positions, self.embed.dtype)
        # transformers: the scale a float32 tensor, cast to the weights' dtype before the product
        self.embed_scale = torch.tensor(math.sqrt(cfg.hidden_size), dtype=self.embed.dtype)
        super().__post_init__()

    def unfused_reason(self) -> str | None:
        return "Gemma's norms around attention and MLP, its (1 + w) float32 norm and GELU"

    def rope(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.cos, self.sin) if self.config.window(layer) is None else (self.local_cos, self.local_sin)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed_tokens(input_ids) * self.embed_scale

    def norm_rows(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return gemma_rms_norm(x, weight, self.config.rms_norm_eps)

    plain_qk_norm = False  # its own (1 + w) norm below, not rope_store_'s

    def qk_norm_(self, qkv: torch.Tensor, w: LayerWeights) -> None:
        cfg = self.config
        rows, q_end, k_end = qkv.shape[0], cfg.q_size, cfg.q_size + cfg.kv_size
        for part, weight in ((slice(0, q_end), w.q_norm), (slice(q_end, k_end), w.k_norm)):
            qkv[:, part] = gemma_rms_norm(qkv[:, part].reshape(-1, cfg.head_dim), weight,
                                          cfg.rms_norm_eps).view(rows, -1)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().logits(x)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _attn_out_and_mlp(self, x: torch.Tensor, attn: torch.Tensor, w: LayerWeights,
                          next_norm: torch.Tensor | None, next_h: torch.Tensor, lora: LayerLora | None = None) -> None:
        """x += post_norm(o(attn)); x += post_mlp_norm(mlp(pre_mlp_norm(x))); next_h = next_norm(x)."""
        eps, rows = self.config.rms_norm_eps, w.rows or (None,) * 4
        x.add_(gemma_rms_norm(self.row_parallel(lora, "o", attn, w.o, None, rows[1]), w.post_norm, eps))
        h = gemma_rms_norm(x, w.pre_mlp_norm, eps)
        gate, up = lora_linear(lora, "gate_up", h, w.gate_up, None, rows[2]).chunk(2, dim=-1)
        down = self.row_parallel(lora, "down", F.gelu(gate, approximate="tanh").mul_(up), w.down, None, rows[3])
        x.add_(gemma_rms_norm(down, w.post_mlp_norm, eps))
        if next_norm is not None:
            next_h.copy_(gemma_rms_norm(x, next_norm, eps))


def _one_plus(weight: torch.Tensor) -> torch.Tensor:
    """Gemma's norm weight as it multiplies: 1 + w, in float32 (transformers: 1.0 + w.float())."""
    return 1.0 + weight.float()


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight (float32, 1 + w) computed in float32, rounded once to
    x's dtype (transformers' Gemma3RMSNorm); float32 rows through the C kernel."""
    if x.dtype == torch.float32:
        return rms_norm(x, weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)
