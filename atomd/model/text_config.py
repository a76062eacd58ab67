"""A checkpoint's config.json as its text model sees it, torch-free, so that the loader, the
simulated engine and `atomd profile` read a nested config alike: Gemma 3's vision-language
checkpoints (Gemma3ForConditionalGeneration) keep the text model's fields under `text_config`
and leave out those equal to transformers' Gemma3TextConfig defaults."""
from __future__ import annotations

from typing import Any

VISION_LANGUAGE = "Gemma3ForConditionalGeneration"
GEMMA3_ACT = "gelu_pytorch_tanh"
# transformers' Gemma3TextConfig defaults: a vision-language config.json's text_config leaves
# out the fields that equal them (google/gemma-3-4b-it's gives 5)
TEXT_DEFAULTS = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                 "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": GEMMA3_ACT,
                 "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
                 "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                 "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "tie_word_embeddings": True}


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A vision-language config.json's text model config, flat as a Gemma3ForCausalLM's."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{VISION_LANGUAGE}: config.json has no text_config object")
    top = {k: hf[k] for k in ("quantization_config", "tie_word_embeddings") if k in hf}
    # transformers' Gemma3ForConditionalGeneration never soft-caps its logits (every Gemma 3
    # checkpoint leaves final_logit_softcapping null anyway)
    return {**TEXT_DEFAULTS, **text, **top, "final_logit_softcapping": None}


def text_model_config(hf: dict[str, Any]) -> dict[str, Any]:
    """`hf` flat: a vision-language checkpoint's text_config (as the loader's Gemma 3 reads
    it), any other config as it is."""
    return text_config(hf) if VISION_LANGUAGE in (hf.get("architectures") or []) else hf
