"""The registry's families as tiny random Hugging Face checkpoints, one table for every test
that runs "each family": name -> how to write it. Each is written by `save_pretrained`
(tests/test_model_hf.py's make_checkpoint, or make_deepseek for transformers' DeepSeek
configs), so the reference is always transformers reading the same files."""
from __future__ import annotations

import pathlib
from typing import NamedTuple

import torch
import transformers

from tests.test_model_hf import VOCAB, make_checkpoint, write_tokenizer

DEEPSEEK_COMMON = dict(
    hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=4, vocab_size=VOCAB, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=512,
    initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0, routed_scaling_factor=1.5)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 0.8,
        "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}


def make_deepseek(path: pathlib.Path, config_class: str, seed: int, **overrides) -> pathlib.Path:
    """A tiny random DeepSeek V2 / V3 (`config_class` names transformers' config)."""
    config = getattr(transformers, config_class)(**{**DEEPSEEK_COMMON, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # biases and V3's correction bias start at zero: random, so they are tested
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(".bias") or name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.3)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path)
    return path


class Family(NamedTuple):
    kind: str  # make_checkpoint's kind, or a transformers DeepSeek config class
    seed: int
    overrides: dict
    sparse: tuple[int, ...]  # the layers with an MoE block

    def write(self, path: pathlib.Path) -> pathlib.Path:
        if self.kind.startswith("Deepseek"):
            return make_deepseek(path, self.kind, self.seed, **self.overrides)
        return make_checkpoint(path, self.kind, seed=self.seed, **self.overrides)


# each a GQA model (4 query heads, 2 KV heads) but DeepSeek's (MLA: one latent row a token)
FAMILIES = {
    "qwen3-untied": Family("qwen3", 20, {}, ()),
    "qwen3-tied": Family("qwen3", 21, {"tie_word_embeddings": True, "num_hidden_layers": 3}, ()),
    # layers 0, 2, 3 sparse, 1 dense; top-2 weights renormalised
    "qwen3_moe-mlp_only": Family("qwen3_moe", 22, {"num_hidden_layers": 4, "mlp_only_layers": [1],
                                                   "norm_topk_prob": True}, (0, 2, 3)),
    # decoder_sparse_step 2: layer 1 sparse, 0 and 2 dense; top-2 weights as the softmax gave them
    "qwen3_moe-step2": Family("qwen3_moe", 23, {"num_hidden_layers": 3, "decoder_sparse_step": 2,
                                                "norm_topk_prob": False, "tie_word_embeddings": True}, (1,)),
    "mixtral": Family("mixtral", 24, {}, (0, 1)),
    "phi3": Family("phi3", 25, {}, ()),  # longrope, attention factor sqrt(1 + ln 2 / ln 256)
    # V2-Lite-shaped: no q_lora, a dense first layer, group-limited routing, yarn with mscale
    "deepseek-v2-lite": Family("DeepseekV2Config", 40, dict(
        q_lora_rank=None, first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        rope_parameters=YARN), (1, 2)),
    "deepseek-v2-qlora-bias": Family("DeepseekV2Config", 41, dict(
        q_lora_rank=24, first_k_dense_replace=1, topk_method="greedy", attention_bias=True,
        num_hidden_layers=2), (1,)),
    # V3: q_lora, sigmoid noaux_tc grouped routing with a random correction bias, yarn, interleaved RoPE
    "deepseek-v3": Family("DeepseekV3Config", 42, dict(
        q_lora_rank=24, first_k_dense_replace=1, n_group=4, topk_group=2, rope_parameters=YARN), (1, 2)),
    "deepseek-v3-halves-all-sparse": Family("DeepseekV3Config", 43, dict(
        q_lora_rank=24, first_k_dense_replace=0, n_group=2, topk_group=1, rope_interleave=False,
        num_hidden_layers=2), (0, 1)),
}
DEEPSEEK = [name for name in FAMILIES if name.startswith("deepseek")]


def write_families(tmp_path_factory, names=FAMILIES) -> dict[str, pathlib.Path]:
    """Each named family's checkpoint in a temporary folder of its own (a module fixture's body)."""
    return {name: FAMILIES[name].write(tmp_path_factory.mktemp(name)) for name in names}
