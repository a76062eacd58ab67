"""Mixtral: Mistral's attention with a sparse MLP (atomd/model/moe.py) on every layer,
`num_local_experts` experts of `intermediate_size`, the top-k weights always renormalised
and kept in float32 where they scale the experts' outputs (as transformers 5 runs it)."""
from __future__ import annotations

from typing import Any

import torch

from atomd.model.config import ModelConfig
from atomd.model.decoder import DecoderModel, TensorSource
from atomd.model.moe import MoeWeights, load_experts


class MixtralModel(DecoderModel):
    @classmethod
    def config_from_hf(cls, hf: dict[str, Any], arch: str) -> ModelConfig:
        return ModelConfig.from_hf(hf, arch, sliding_by_default=True,
                                   sparse_layers=tuple(range(hf["num_hidden_layers"])),
                                   num_experts=hf["num_local_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
                                   moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True)

    @classmethod
    def load_moe(cls, src: TensorSource, cfg: ModelConfig, prefix: str, dtype: torch.dtype) -> MoeWeights:
        gate_up, down = load_experts(src, prefix + "block_sparse_moe.experts.", cfg.local_experts, "w1", "w3",
                                     "w2", dtype)
        return MoeWeights(router=src.get(prefix + "block_sparse_moe.gate.weight", dtype), gate_up=gate_up,
                          down=down, top_k=cfg.num_experts_per_tok, norm_topk_prob=True, cast_weights=False)
