"""DeepSeek V3's MTP layer as the speculative drafter (atomd/model/deepseek_mtp.py,
atomd/engine/mtp_proposer.py) on a tiny random V3 checkpoint written here: transformers'
DeepseekV3 drops MTP weights, so the checkpoint is a 3-layer HF model whose last layer becomes
the MTP's decoder layer (config says 2 layers and num_nextn_predict_layers 1) plus random
enorm / hnorm / eh_proj / shared_head tensors, and the reference MTP is written here in torch
from DeepSeek-V3's description (embedding of the next token and the main model's final-normed
hidden state, each RMS-normed, concatenated, eh_proj, the decoder layer run by transformers'
own DeepseekV3DecoderLayer, shared_head's norm and head)."""
from __future__ import annotations

import json
import pathlib

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from atomd.engine.mtp_proposer import MtpProposer
from atomd.llm import LLM
from atomd.model.deepseek_mtp import load_mtp
from atomd.model.loader import load_model
from contracts.sampling import SamplingParams
from tests.families import DEEPSEEK_COMMON as COMMON, YARN, make_deepseek
from tests.test_model_hf import (BLOCK, assert_equals_hf, engine_greedy, make_checkpoint, prompts_of,
                                 write_tokenizer)

pytestmark = pytest.mark.unit
torch.set_num_threads(1)

LAYERS = 2  # main layers; layer 2 is the MTP's
V3 = dict(q_lora_rank=24, first_k_dense_replace=1, n_group=4, topk_group=2, rope_parameters=YARN)
MTP = {"method": "mtp", "num_speculative_tokens": 1}
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def write_v3_with_mtp(path: pathlib.Path, seed: int, own_head: bool, mimic: bool = False):
    """The checkpoint and the 3-layer HF model it came from. own_head: the MTP layer has its own
    embed_tokens and shared_head.head (random, unlike released checkpoints, so reading them is
    tested); else the main ones are used. mimic: the MTP layer passes the hidden state through
    (eh_proj = [0 | I], its attention and MLP outputs zero), so it drafts the main model's own
    next token again, and the main model leans to repeating its input token (its lm_head is
    its embedding): drafts accepted where it does."""
    config = transformers.DeepseekV3Config(**{**COMMON, **V3, "num_hidden_layers": LAYERS + 1})
    torch.manual_seed(seed)
    full = transformers.AutoModelForCausalLM.from_config(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in full.named_buffers():
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.3)
        for name, t in full.named_parameters():
            if mimic and name.startswith(f"model.layers.{LAYERS}.") and ("o_proj" in name or "down_proj" in name):
                t.zero_()
        if mimic:  # the head reads the embedding back: the main model tends to repeat its input token
            full.lm_head.weight.copy_(full.model.embed_tokens.weight)
    full.save_pretrained(path)
    write_tokenizer(path)
    hidden, p = COMMON["hidden_size"], f"model.layers.{LAYERS}."
    tensors = load_file(path / "model.safetensors")
    mtp = {p + "enorm.weight": 1 + 0.2 * torch.randn(hidden, generator=g),
           p + "hnorm.weight": 1 + 0.2 * torch.randn(hidden, generator=g),
           p + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=g) * 0.1,
           p + "shared_head.norm.weight": 1 + 0.2 * torch.randn(hidden, generator=g)}
    if own_head:
        mtp[p + "embed_tokens.weight"] = torch.randn(COMMON["vocab_size"], hidden, generator=g) * 0.1
        mtp[p + "shared_head.head.weight"] = torch.randn(COMMON["vocab_size"], hidden, generator=g) * 0.1
    if mimic:
        for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            mtp[p + name] = torch.ones(hidden)
        mtp[p + "eh_proj.weight"] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)
    save_file({**tensors, **mtp}, path / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": LAYERS, "num_nextn_predict_layers": 1}))
    return path, full, mtp


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_v3_with_mtp(tmp_path_factory.mktemp("v3mtp"), seed=50, own_head=True)


@pytest.fixture(scope="module")
def mimic(tmp_path_factory):
    return write_v3_with_mtp(tmp_path_factory.mktemp("v3mimic"), seed=51, own_head=False, mimic=True)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_mtp_logits(path: pathlib.Path, full, mtp: dict, tokens: list[int]) -> torch.Tensor:
    """The MTP's logits [len(tokens) - 1, vocab]: row p from the main model's final-normed state
    at p and the token at p + 1 (it predicts the token at p + 2)."""
    p = f"model.layers.{LAYERS}."
    main = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([tokens])
    with torch.inference_mode():
        h = main.model(ids).last_hidden_state[0, :-1]
        embed = mtp.get(p + "embed_tokens.weight", main.model.embed_tokens.weight)
        e = rms(embed[ids[0, 1:]], mtp[p + "enorm.weight"])
        x = torch.cat([e, rms(h, mtp[p + "hnorm.weight"])], dim=-1) @ mtp[p + "eh_proj.weight"].T
        n = x.shape[0]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
        out = full.model.layers[LAYERS](x[None], attention_mask=mask, position_ids=positions,
                                        position_embeddings=full.model.rotary_emb(x[None], positions))
        out = out[0] if isinstance(out, tuple) else out
        head = mtp.get(p + "shared_head.head.weight", main.lm_head.weight)
        return rms(out[0], mtp[p + "shared_head.norm.weight"]) @ head.T


def record_mtp_runs(monkeypatch) -> list:
    runs = []
    run = MtpProposer.run

    def spy(self, *args):
        run(self, *args)
        runs.append(self.last)

    monkeypatch.setattr(MtpProposer, "run", spy)
    return runs


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_mtp_logits_equal_the_reference_and_greedy_is_unchanged(backend, ckpt, monkeypatch):
    """Every draft's MTP logits (prefill in chunks, decode over the MTP's latent cache, verify
    steps) against the reference over the final sequence; greedy output with MTP drafts equals
    HF's and the engine's without."""
    path, full, mtp = ckpt
    runs = record_mtp_runs(monkeypatch)
    llm = LLM(str(path), num_threads=1, max_model_len=256, max_num_batched_tokens=2 * BLOCK,
              attention_backend=backend, speculative_config=MTP)
    assert llm.engine.kv_cache.num_layers == LAYERS + 1  # the MTP's latent layer beside the main ones
    prompts = prompts_of([3 * BLOCK + 5, 7, 1], seed=11)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    got = [o.outputs[0].token_ids for o in outs]
    assert_equals_hf(path, prompts, got, n=24)
    plain = LLM(str(path), num_threads=1, max_model_len=256, attention_backend=backend)
    assert engine_greedy(plain, prompts, GREEDY) == got
    checked = 0
    for out, prompt, tokens in zip(outs, prompts, got):
        want = reference_mtp_logits(path, full, mtp, prompt + tokens)
        for request_ids, positions, logits in runs:
            for rid, pos, row in zip(request_ids, positions.tolist(), logits):
                if rid == out.request_id:
                    torch.testing.assert_close(row, want[pos], atol=1e-4, rtol=0)
                    checked += 1
    assert checked >= 3 * 20  # a draft after the prompt and after every decode step
    stats = llm.engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0


def test_mtp_under_tensor_parallelism_equals_the_reference(ckpt, monkeypatch):
    """TP=2 (the MTP layer's MLA, experts, embedding and head split like the main layers'):
    every draft's gathered MTP logits on rank 0 against the reference, greedy equal to HF's (which
    the TP=1 test above equals on the same prompts), chunked prefill and verify steps included."""
    path, full, mtp = ckpt
    runs = record_mtp_runs(monkeypatch)
    llm = LLM(str(path), num_threads=1, max_model_len=256, max_num_batched_tokens=2 * BLOCK,
              tensor_parallel_size=2, speculative_config=MTP)
    try:
        assert llm.engine.kv_cache.num_layers == LAYERS + 1
        prompts = prompts_of([3 * BLOCK + 5, 7, 1], seed=11)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        got = [o.outputs[0].token_ids for o in outs]
        assert_equals_hf(path, prompts, got, n=24)
        checked = 0
        for out, prompt, tokens in zip(outs, prompts, got):
            want = reference_mtp_logits(path, full, mtp, prompt + tokens)
            for request_ids, positions, logits in runs:
                for rid, pos, row in zip(request_ids, positions.tolist(), logits):
                    if rid == out.request_id:
                        torch.testing.assert_close(row, want[pos], atol=1e-4, rtol=0)
                        checked += 1
        assert checked >= 3 * 20
        assert llm.engine.stats()["spec_decode_num_draft_tokens"] > 0
    finally:
        llm.engine.close()


def test_mtp_in_bfloat16_is_near_the_float32_reference(ckpt, monkeypatch):
    """bfloat16 weights, latent cache (the MTP's layer too) and activations: the MTP logits of
    every draft within bf16's error of the float32 reference (seen: 0.03 on logits up to 3)."""
    path, full, mtp = ckpt
    runs = record_mtp_runs(monkeypatch)
    llm = LLM(str(path), num_threads=1, max_model_len=256, dtype="bfloat16", speculative_config=MTP)
    prompt = prompts_of([37], seed=11)[0]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=16, temperature=0.0,
                                                                      ignore_eos=True))[0]
    want = reference_mtp_logits(path, full, mtp, prompt + out.outputs[0].token_ids)
    rows = [(pos, row) for _, positions, logits in runs for pos, row in zip(positions.tolist(), logits)]
    assert len(rows) >= 16 and all(row.dtype == torch.bfloat16 for _, row in rows)
    for pos, row in rows:
        torch.testing.assert_close(row.float(), want[pos], atol=0.1, rtol=0)


def test_mtp_drafts_are_accepted_and_counted(mimic):
    """The mimicking MTP layer drafts the token the main model just produced: accepted wherever
    the greedy output repeats a token, and the counters say how many were."""
    path, _, _ = mimic
    llm = LLM(str(path), num_threads=1, max_model_len=256, speculative_config=MTP)
    prompts = prompts_of([20, 9], seed=12)
    got = engine_greedy(llm, prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    assert_equals_hf(path, prompts, got, n=40)
    repeats = sum(a == b for tokens, p in zip(got, prompts) for a, b in zip([p[-1]] + tokens, tokens))
    stats = llm.engine.stats()
    assert 0 < repeats < sum(map(len, got))  # repeats and changes: drafts accepted and rejected
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert stats["spec_decode"]["num_accepted_tokens"] == stats["spec_decode_num_accepted_tokens"]


def test_mtp_refused_with_the_reason(tmp_path, ckpt):
    # transformers writes num_nextn_predict_layers 1 (its default) and drops the weights
    plain = make_deepseek(tmp_path / "v3", "DeepseekV3Config", seed=3, **V3)
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 1 but the checkpoint has no "
                                         "model.layers.3.eh_proj.weight"):
        LLM(str(plain), num_threads=1, max_model_len=64, speculative_config=MTP)
    hf = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**hf, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match="has no MTP module .*num_nextn_predict_layers is 0"):
        LLM(str(plain), num_threads=1, max_model_len=64, speculative_config=MTP)
    llama = make_checkpoint(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match=r"\(LlamaForCausalLM\) has no MTP module"):
        LLM(str(llama), num_threads=1, max_model_len=64, speculative_config=MTP)
    with pytest.raises(ValueError, match="num_speculative_tokens must be 1"):
        LLM(str(ckpt[0]), num_threads=1, max_model_len=64, speculative_config={**MTP, "num_speculative_tokens": 2})
    sharded = load_model(ckpt[0], expert_shard=(0, 2))  # an expert-parallel rank's model
    with pytest.raises(ValueError, match="mtp is not supported with --enable-expert-parallel"):
        load_mtp(ckpt[0], sharded)
