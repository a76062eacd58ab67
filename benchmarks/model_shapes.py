"""Benchmark checkpoints shaped like real small models, with random weights (no download
possible here): made once with transformers into the atomd cache, with the built-in
model's tokenizer, its vocabulary filled up to the model's with tokens `<id>` that no text
encodes to but every id decodes from (a random model samples them all; a token that
decodes to nothing would look like an empty stream to a client).

    smollm-135m: SmolLM2-135M's shape: hidden 576, 30 layers, 9 query / 3 KV heads (head
    dim 64), intermediate 1536, vocabulary 49152, tied embeddings, float32 (~540 MB).
    A 512-token prefill there costs dozens of decode steps, as on real deployments; on
    the built-in model (hidden 256, 4 layers) it costs a few.
    qwen3-moe-small: Qwen3-MoE with the built-in model's attention (hidden 256, 4 layers, 8
    query / 4 KV heads of 32, vocabulary 4096) and a sparse MLP on every layer: 16 experts of
    intermediate 172, top-4 (Qwen3-30B-A3B's 128 / top-8 ratio scaled down; the 4 chosen
    together as wide as the built-in's dense 688), float32 (~60 MB).
    qwen3-moe-a3b-small: Qwen3-30B-A3B's proportions at the built-in model's width (issue #36's
    delayer shape): hidden 256, 4 layers each sparse, 8 query heads / 1 KV head of 64 (A3B: 32 /
    4 of 128, so queries 2x hidden, KV a quarter of it), 16 experts of 192 top-4 (the chosen
    experts together 3x hidden wide, as A3B's 8 of 768; half as many, twice as wide, so a CPU
    expert matmul is not all overhead), vocabulary 4096, float32 (~40 MB). Its experts are 46 %
    of a 768-token prefill's multiply-adds (`flops_per_token`; the rest runs on the token's own
    rank under expert parallelism), A3B's 58 % at 2K-token prompts and 42 % at 8K;
    qwen3-moe-small's are 64 % at 384 tokens (its attention is narrower).
    qwen3-moe: issue #34's Qwen3-MoE benchmark shape (Qwen3-30B-A3B's MoE at 0.6B's width):
    hidden 1024, 24 layers, 0.6B's attention (16 query / 8 KV heads of 128), a sparse MLP on
    every layer of 64 experts of intermediate 256, top-8 (norm_topk_prob), vocabulary 151936,
    tied; 1.52B parameters, 0.33B active a token (head included), float32 (~6 GB).
    qwen3-0.6b: Qwen3-0.6B's shape (Qwen3ForCausalLM: q/k norm): hidden 1024, 28 layers, 16
    query / 8 KV heads of 128, intermediate 3072, vocabulary 151936, tied, float32 (~3 GB;
    the issue's dense comparison shape).
    deepseek-v2-lite: issue #37's benchmark shape, DeepSeek-V2-Lite sized for this machine:
    V2-Lite's attention as it is (MLA, 16 heads, no q_lora, kv_lora_rank 512, qk_nope 128,
    qk_rope 64, v 128, yarn factor 40 with mscale 0.707) and its 26 or 27 layers (llama.cpp
    reads a deepseek2 GGUF without q_lora only at those counts): hidden 1024 (V2-Lite: 2048),
    26 layers, the first dense (intermediate 2816), then DeepSeekMoE of 16 routed experts of
    128 (V2-Lite: 64 of 1408) top-6 softmax greedy plus 2 shared, vocabulary 32000 (V2-Lite:
    102400), untied; 0.46B parameters, ~0.32B active a token (head included), float32 (~1.8 GB).
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys
import tempfile

from atomd.model.default import cache_root, default_model_dir

SHAPES = {
    "smollm-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                        head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                        max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=100000.0),
    "qwen3-moe-small": dict(architecture="Qwen3Moe", hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                            num_key_value_heads=4, head_dim=32, intermediate_size=688, num_experts=16,
                            num_experts_per_tok=4, moe_intermediate_size=172, norm_topk_prob=True,
                            vocab_size=4096, max_position_embeddings=2048, rms_norm_eps=1e-5),
    "qwen3-moe-a3b-small": dict(architecture="Qwen3Moe", hidden_size=256, num_hidden_layers=4,
                                num_attention_heads=8, num_key_value_heads=1, head_dim=64, intermediate_size=688,
                                num_experts=16, num_experts_per_tok=4, moe_intermediate_size=192,
                                norm_topk_prob=True, vocab_size=4096, max_position_embeddings=4096,
                                rms_norm_eps=1e-6, rope_theta=1000000.0),
    "qwen3-moe": dict(architecture="Qwen3Moe", hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128, intermediate_size=3072, num_experts=64,
                      num_experts_per_tok=8, moe_intermediate_size=256, norm_topk_prob=True, vocab_size=151936,
                      tie_word_embeddings=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
                      rope_theta=1000000.0),
    "qwen3-0.6b": dict(architecture="Qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
                       tie_word_embeddings=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
                       rope_theta=1000000.0),
    "deepseek-v2-lite": dict(architecture="DeepseekV2", hidden_size=1024, num_hidden_layers=26,
                             num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=2816,
                             moe_intermediate_size=128, n_routed_experts=16, n_shared_experts=2,
                             num_experts_per_tok=6, first_k_dense_replace=1, topk_method="greedy", n_group=1,
                             topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False, vocab_size=32000,
                             tie_word_embeddings=False, max_position_embeddings=163840, rms_norm_eps=1e-6,
                             rope_parameters={"rope_type": "yarn", "factor": 40.0, "rope_theta": 10000.0,
                                              "original_max_position_embeddings": 4096, "mscale": 0.707,
                                              "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}),
}
CHOICES = ["builtin", *SHAPES]


def flops_per_token(fields: dict, prompt_len: int) -> dict[str, float]:
    """Multiply-adds per prompt token of a prefill of `prompt_len` tokens, by part, for a Qwen3-MoE
    shape (every layer sparse): what runs on the token's own rank under expert parallelism
    (attention's projections, its scores and weighted sum at the mean causal context, the router)
    and what is spread over the ranks (the chosen experts). The head runs for the last token only."""
    h, layers = fields["hidden_size"], fields["num_hidden_layers"]
    q = fields["num_attention_heads"] * fields["head_dim"]
    kv = fields["num_key_value_heads"] * fields["head_dim"]
    context = (prompt_len + 1) / 2
    per_rank = layers * (h * (q + 2 * kv) + q * h + 2 * q * context + h * fields["num_experts"]) \
        + h * fields["vocab_size"] / prompt_len
    experts = layers * fields["num_experts_per_tok"] * 3 * h * fields["moe_intermediate_size"]
    return {"per_rank": per_rank, "experts": experts, "expert_share": experts / (per_rank + experts)}


def write_tokenizer(src: pathlib.Path, dest: pathlib.Path, vocab_size: int) -> None:
    """`src`'s tokenizer.json with its BPE vocabulary filled up to `vocab_size` ids."""
    tok = json.loads(src.read_text())
    vocab = tok["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in tok.get("added_tokens", [])}
    for i in range(vocab_size):
        if i not in taken:
            vocab[f"<{i}>"] = i
    dest.write_text(json.dumps(tok, ensure_ascii=False))


def model_dir(shape: str) -> pathlib.Path:
    """The checkpoint directory of `shape` ("builtin": the default model), made on first use."""
    if shape == "builtin":
        return default_model_dir()
    target = cache_root() / f"shape-{shape}-random"
    if (target / "model.safetensors").is_file():
        return target
    import torch
    import transformers

    print(f"writing a random-weight {shape}-shaped checkpoint to {target} (once)", file=sys.stderr, flush=True)
    builtin = default_model_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        torch.manual_seed(0)
        fields = dict(SHAPES[shape])
        arch = fields.pop("architecture", "Llama")
        config = getattr(transformers, f"{arch}Config")(**fields, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                                        torch_dtype="float32")
        getattr(transformers, f"{arch}ForCausalLM")(config).save_pretrained(tmp, safe_serialization=True)
        shutil.copyfile(builtin / "tokenizer_config.json", tmp / "tokenizer_config.json")
        write_tokenizer(builtin / "tokenizer.json", tmp / "tokenizer.json", config.vocab_size)
        os.chmod(tmp, 0o755)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
