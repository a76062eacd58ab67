"""Qwen3-MoE: Qwen3's attention (q/k norm) with a sparse MLP (atomd/model/moe.py) on every
`decoder_sparse_step`-th layer not in `mlp_only_layers` (those run the dense MLP of
`intermediate_size`); routing renormalised only with `norm_topk_prob`."""
from __future__ import annotations

from typing import Any

import torch

from atomd.model.config import ModelConfig
from atomd.model.decoder import DecoderModel, TensorSource
from atomd.model.moe import MoeWeights, load_experts


class Qwen3MoeModel(DecoderModel):
    @classmethod
    def config_from_hf(cls, hf: dict[str, Any], arch: str) -> ModelConfig:
        experts = hf.get("num_experts") or hf.get("num_local_experts") or 0  # transformers 5 writes the latter
        step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
        sparse = tuple(i for i in range(hf["num_hidden_layers"])
                       if i not in dense and experts > 0 and (i + 1) % step == 0)
        return ModelConfig.from_hf(hf, arch, qk_norm=True, sparse_layers=sparse, num_experts=experts,
                                   num_experts_per_tok=hf["num_experts_per_tok"],
                                   moe_intermediate_size=hf["moe_intermediate_size"],
                                   norm_topk_prob=bool(hf.get("norm_topk_prob", False)))

    @classmethod
    def load_moe(cls, src: TensorSource, cfg: ModelConfig, prefix: str, dtype: torch.dtype) -> MoeWeights:
        gate_up, down = load_experts(src, prefix + "mlp.experts.", cfg.local_experts, "gate_proj", "up_proj",
                                     "down_proj", dtype)
        return MoeWeights(router=src.get(prefix + "mlp.gate.weight", dtype), gate_up=gate_up, down=down,
                          top_k=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob)
