"""Gemma 3 text (atomd/model/gemma3.py) against Hugging Face transformers on a tiny random
`Gemma3ForCausalLM` written by `save_pretrained`: 4 layers, every 3rd global (layers 0, 1, 3
windowed, window 24: prompts and outputs run well past it), linear RoPE scaling on the global
layer and another base on the local ones, query_pre_attn_scalar, final logit soft-capping,
random norm weights (Gemma's factor is 1 + w). Prompt logits within 1e-4 of HF's and 48
greedy ids equal to HF's in float32, through both attention backends, chunked prefill, prefix
hits and n-gram speculation; bfloat16 against HF bfloat16 with the bf16 tests' tie rule.

`Gemma3ForConditionalGeneration` (the vision-language checkpoint) served as its text model:
a tiny random one written by transformers (the same text shape, a one-layer SigLIP tower)
against HF's Gemma3ForConditionalGeneration on text-only input, in the hub's weight layout
(language_model.model.*) and the other (model.language_model.*); a hub-style config whose
text_config leaves the defaults out reads as transformers reads it.
"""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from atomd.llm import LLM
from atomd.model import registry
from atomd.model.gemma3 import Gemma3Model
from atomd.model.loader import read_config
from contracts.sampling import SamplingParams
from tests.test_bf16 import assert_greedy_follows_hf_bf16
from tests.test_model_hf import (BLOCK, VOCAB, _prompt_logits, assert_equals_hf, engine_greedy, hf_model,
                                 make_checkpoint, prompts_of, write_tokenizer)
from tests.test_spec_decode import SPEC_JSON

PAST = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("gemma3"), "gemma3", seed=6, num_hidden_layers=4)


@pytest.mark.unit
def test_config_as_transformers_reads_it(gemma3_dir):
    cfg = read_config(gemma3_dir)
    assert cfg.layer_windows == (24, 24, None, 24)
    assert (cfg.rope_theta, cfg.rope_scaling["factor"], cfg.local_rope_theta) == (100000.0, 2.0, 1000.0)
    assert (cfg.attn_scale, cfg.final_logit_softcapping, cfg.tie_word_embeddings) == (24 ** -0.5, 3.0, True)
    # an older config.json: sliding_window_pattern, rope_theta / rope_local_base_freq / rope_scaling
    hf = json.loads((gemma3_dir / "config.json").read_text())
    old = {k: v for k, v in hf.items() if k not in ("layer_types", "rope_parameters")}
    old.update(sliding_window_pattern=2, rope_theta=5e5, rope_local_base_freq=7e3,
               rope_scaling={"rope_type": "linear", "factor": 8.0})
    cfg = Gemma3Model.config_from_hf(old, "Gemma3ForCausalLM")
    assert cfg.layer_windows == (24, None, 24, None)
    assert (cfg.rope_theta, cfg.rope_scaling["factor"], cfg.local_rope_theta, cfg.local_rope_scaling) == \
        (5e5, 8.0, 7e3, None)
    for bad, match in (({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
                       ({"use_bidirectional_attention": True}, "bidirectional"),
                       ({"hidden_activation": "silu"}, "hidden_activation")):
        with pytest.raises(ValueError, match=match):
            Gemma3Model.config_from_hf({**hf, **bad}, "Gemma3ForCausalLM")
    assert registry.architecture({"architectures": ["Gemma3ForConditionalGeneration"]}) == \
        "Gemma3ForConditionalGeneration"


@pytest.mark.unit
@pytest.mark.parametrize("chunk", [None, BLOCK])
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_prompt_logits_match_hf(gemma3_dir, chunk, backend):
    args = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = LLM(str(gemma3_dir), num_threads=1, max_model_len=256, attention_backend=backend, **args)
    prompt = prompts_of([5 * BLOCK + 3], seed=3)[0]
    got = _prompt_logits(llm, prompt)
    with torch.inference_mode():
        want = hf_model(gemma3_dir)(torch.tensor([prompt])).logits[0]
    assert want.abs().max() <= 3.0  # soft-capped: the cap is in the reference too
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.unit
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_greedy_48_tokens_past_the_window_equals_hf(gemma3_dir, backend):
    llm = LLM(str(gemma3_dir), num_threads=1, max_model_len=256, attention_backend=backend)
    prompts = prompts_of([70, 1, 5, 33], seed=2)
    assert_equals_hf(gemma3_dir, prompts, engine_greedy(llm, prompts, PAST), n=48)


@pytest.mark.unit
def test_prefix_hits_chunks_and_speculation_equal_hf(gemma3_dir):
    llm = LLM(str(gemma3_dir), num_threads=1, max_model_len=256, max_num_batched_tokens=BLOCK,
              speculative_config=SPEC_JSON)
    loops = [(p * 20)[:3 * BLOCK + 5] for p in prompts_of([3, 5, 7], seed=21)]  # repetitive: drafts
    first = engine_greedy(llm, loops, PAST)
    second = engine_greedy(llm, loops, PAST)
    stats = llm.engine.stats()
    assert first == second
    assert stats["prefix_cache_hits"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert_equals_hf(gemma3_dir, loops, second, n=48)


@pytest.mark.unit
def test_bf16_greedy_follows_hf_bf16(gemma3_dir):
    hf = {dtype: transformers.AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=dtype).eval()
          for dtype in (torch.float32, torch.bfloat16)}
    llm = LLM(str(gemma3_dir), num_threads=1, max_model_len=256, dtype="bfloat16")
    prompts = prompts_of([40, 7], seed=11)
    got = engine_greedy(llm, prompts, PAST)
    assert_greedy_follows_hf_bf16(hf, prompts, got, n=48)


# ------------------------------------------------ Gemma3ForConditionalGeneration: the text model


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory, gemma3_dir):
    """A tiny random vision-language Gemma 3: gemma3_dir's text shape, a one-layer vision tower
    (image tokens inside the vocabulary), random norm weights; saved by transformers (the hub's
    layout: language_model.model.*)."""
    text = transformers.Gemma3TextConfig.from_pretrained(gemma3_dir)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=32, patch_size=8)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                                       boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2,
                                       image_token_index=VOCAB - 1)
    torch.manual_seed(8)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(9)) * 0.3)
    path = tmp_path_factory.mktemp("gemma3-vl")
    model.save_pretrained(path)
    write_tokenizer(path)
    return path


@pytest.mark.unit
def test_vl_config_is_its_text_config(vl_dir, gemma3_dir):
    assert read_config(vl_dir).architecture == "Gemma3ForConditionalGeneration"
    text, plain = read_config(vl_dir), read_config(gemma3_dir)
    assert (text.layer_windows, text.rope_theta, text.local_rope_theta, text.attn_scale, text.vocab_size) == \
        (plain.layer_windows, plain.rope_theta, plain.local_rope_theta, plain.attn_scale, plain.vocab_size)
    # transformers' Gemma3ForConditionalGeneration applies no final soft-cap (the text config has 3.0)
    assert (text.final_logit_softcapping, plain.final_logit_softcapping) == (None, 3.0)
    # google/gemma-3-4b-it's config.json: its text_config gives only what differs from the defaults
    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"model_type": "siglip_vision_model"}}
    want = transformers.Gemma3Config.from_dict(hub).text_config
    cfg = Gemma3Model.config_from_hf(hub, "Gemma3ForConditionalGeneration")
    full = want.rope_parameters["full_attention"]
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size, cfg.num_layers) == \
        (want.num_attention_heads, want.num_key_value_heads, want.head_dim, want.vocab_size, want.num_hidden_layers)
    assert cfg.layer_windows == tuple(None if t == "full_attention" else want.sliding_window for t in want.layer_types)
    assert (cfg.rope_theta, cfg.rope_scaling["factor"], cfg.local_rope_theta) == \
        (full["rope_theta"], full["factor"], want.rope_parameters["sliding_attention"]["rope_theta"])
    assert (cfg.attn_scale, cfg.tie_word_embeddings) == (want.query_pre_attn_scalar ** -0.5, True)
    with pytest.raises(ValueError, match="text_config"):
        Gemma3Model.config_from_hf({"architectures": ["Gemma3ForConditionalGeneration"]},
                                   "Gemma3ForConditionalGeneration")


def _other_layout(vl_dir, path):
    """vl_dir with its tensors under transformers' module names (model.language_model.*, lm_head)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(vl_dir / "model.safetensors")
    def rename(name: str) -> str:
        if name.startswith("language_model.model."):
            return "model.language_model." + name[len("language_model.model."):]
        return "lm_head.weight" if name == "language_model.lm_head.weight" else "model." + name  # the tower's

    renamed = {rename(k): v for k, v in tensors.items()}
    assert "model.language_model.embed_tokens.weight" in renamed and "model.vision_tower.head.probe" in renamed
    for f in vl_dir.iterdir():
        if f.name != "model.safetensors":
            (path / f.name).write_bytes(f.read_bytes())
    save_file(renamed, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.unit
def test_vl_prompt_logits_and_greedy_equal_hf_text_only(vl_dir, tmp_path):
    prompt = prompts_of([5 * BLOCK + 3], seed=4)[0]
    with torch.inference_mode():
        want = hf_model(vl_dir)(input_ids=torch.tensor([prompt])).logits[0]
    assert type(hf_model(vl_dir)).__name__ == "Gemma3ForConditionalGeneration"
    other = _other_layout(vl_dir, tmp_path)
    for path in (vl_dir, other):
        llm = LLM(str(path), num_threads=1, max_model_len=256)
        torch.testing.assert_close(_prompt_logits(llm, prompt), want, atol=1e-4, rtol=0)
    prompts = prompts_of([70, 5], seed=12)
    assert_equals_hf(vl_dir, prompts, engine_greedy(llm, prompts, PAST), n=48)
