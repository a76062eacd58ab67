"""Phi-3 (`Phi3ForCausalLM`): Llama's layer with fused weights in the checkpoint (qkv_proj:
q, k, v stacked; gate_up_proj: gate then up, the layout the decoder packs to anyway) and
longrope ("su") RoPE scaling (atomd/model/rotary.py: the short factors, and past
original_max_position_embeddings the long ones, chosen per sequence and step as transformers
chooses per forward). Rotary over part of each head (Phi-4-mini's partial_rotary_factor) is
refused."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from atomd.model.config import ModelConfig
from atomd.model.decoder import DecoderModel, LayerWeights, TensorSource
from atomd.model.quant import QuantizedWeight


class Phi3Model(DecoderModel):
    @classmethod
    def config_from_hf(cls, hf: dict[str, Any], arch: str) -> ModelConfig:
        partial = (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if partial != 1.0:
            raise ValueError(f"{arch}: partial_rotary_factor={partial} (RoPE on part of each head) is not supported")
        cfg = ModelConfig.from_hf(hf, arch, sliding_by_default=True)
        if cfg.rope_scaling is None:
            return cfg
        # older config.json files keep the original length beside rope_scaling, not in it
        original = cfg.rope_scaling.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
        return replace(cfg, rope_scaling={**cfg.rope_scaling, "original_max_position_embeddings": original})

    @classmethod
    def load_layer(cls, src: TensorSource, cfg: ModelConfig, i: int, dtype: torch.dtype) -> LayerWeights:
        p = f"model.layers.{i}."
        return LayerWeights(input_norm=src.get(p + "input_layernorm.weight", dtype),
                            qkv=_contiguous(src.get(p + "self_attn.qkv_proj.weight", dtype)),
                            o=src.get(p + "self_attn.o_proj.weight", dtype),
                            post_norm=src.get(p + "post_attention_layernorm.weight", dtype),
                            gate_up=_contiguous(src.get(p + "mlp.gate_up_proj.weight", dtype)),
                            down=src.get(p + "mlp.down_proj.weight", dtype))


def _contiguous(t):
    """A fused projection as the kernels read it: a float tensor made contiguous; a QuantizedWeight (--quantization,
    or --dtype auto's bf16 weights) is packed contiguous already."""
    return t if isinstance(t, QuantizedWeight) else t.contiguous()
