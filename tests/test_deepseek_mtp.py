"""DeepSeek V3's MTP layer as the speculative drafter (atomd/model/deepseek_mtp.py,
atomd/engine/mtp_proposer.py) on a tiny random V3 checkpoint written here: transformers'
DeepseekV3 drops MTP weights, so the checkpoint is a 3-layer HF model whose last layer becomes
the MTP's decoder layer (config says 2 layers and num_nextn_predict_layers 1) plus random
enorm / hnorm / eh_proj / shared_head tensors, and the reference MTP is written here in torch
from DeepSeek-V3's description (embedding of the next token and the main model's final-normed
hidden state, each RMS-normed, concatenated, eh_proj, the decoder layer run by transformers'
own DeepseekV3DecoderLayer, shared_head's norm and head); k > 1 drafts chain it on its own
output state (before shared_head's norm) and its own draft, one position on, as vLLM and SGLang
do, and the reference runs that chain on the same layer."""
from __future__ import annotations

import json
import pathlib

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from atomd.llm import LLM
from atomd.model.deepseek_mtp import load_mtp
from atomd.model.loader import load_model
from contracts.sampling import SamplingParams
from scheduler.block_manager import BlockPool
from tests.cpu_builds import needs_avx512
from tests.families import DEEPSEEK_COMMON as COMMON, YARN, make_deepseek
from tests.test_model_hf import (BLOCK, assert_equals_hf, engine_greedy, make_checkpoint, prompts_of,
                                 write_tokenizer)

pytestmark = pytest.mark.unit
torch.set_num_threads(1)

LAYERS = 2  # main layers; layer 2 is the MTP's
V3 = dict(q_lora_rank=24, first_k_dense_replace=1, n_group=4, topk_group=2, rope_parameters=YARN)
MTP = {"method": "mtp", "num_speculative_tokens": 1}
MTP3 = {**MTP, "num_speculative_tokens": 3}
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def write_v3_with_mtp(path: pathlib.Path, seed: int, own_head: bool, mimic: bool = False, leak: float = 0.0):
    """The checkpoint and the 3-layer HF model it came from. own_head: the MTP layer has its own
    embed_tokens and shared_head.head (random, unlike released checkpoints, so reading them is
    tested; with mimic, copies of the main ones, as released checkpoints have); else the main ones
    are used. mimic: the MTP layer passes the hidden state through
    (eh_proj = [0 | I], its attention and MLP outputs zero), so it drafts the main model's own
    next token again, and the main model leans to repeating its input token (its lm_head is
    its embedding): drafts accepted where it does. leak: the mimic's attention and MLP outputs
    and eh_proj's embedding half scaled down to that instead of zero (its latent cache then
    moves every logit, and drafts are still often accepted)."""
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
                t.mul_(leak)
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
        mtp[p + "embed_tokens.weight"] = full.model.embed_tokens.weight.detach().clone() if mimic else \
            torch.randn(COMMON["vocab_size"], hidden, generator=g) * 0.1
        mtp[p + "shared_head.head.weight"] = full.lm_head.weight.detach().clone() if mimic else \
            torch.randn(COMMON["vocab_size"], hidden, generator=g) * 0.1
    if mimic:
        for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            mtp[p + name] = torch.ones(hidden)
        mtp[p + "eh_proj.weight"] = torch.cat([leak * mtp[p + "eh_proj.weight"][:, :hidden], torch.eye(hidden)], dim=1)
    save_file({**tensors, **mtp}, path / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": LAYERS, "num_nextn_predict_layers": 1}))
    return path, full, mtp


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_v3_with_mtp(tmp_path_factory.mktemp("v3mtp"), seed=50, own_head=True)


@pytest.fixture(scope="module")
def mimic(tmp_path_factory):
    return write_v3_with_mtp(tmp_path_factory.mktemp("v3mimic"), seed=51, own_head=False, mimic=True, leak=0.05)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_mtp(path: pathlib.Path, full, mtp: dict, tokens: list[int]):
    """The reference MTP over `tokens` (a final sequence): a function (p, drafts) -> logits
    [len(drafts) + 1, vocab] of the draft chain from row p: the first from the main model's
    final-normed state at p and the token at p + 1 (it predicts the token at p + 2), draft j + 1
    from the layer's output state of draft j and draft j, one position on."""
    p_ = f"model.layers.{LAYERS}."
    main = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([tokens])
    with torch.inference_mode():
        h = main.model(ids).last_hidden_state[0, :-1]
    embed = mtp.get(p_ + "embed_tokens.weight", main.model.embed_tokens.weight)
    head = mtp.get(p_ + "shared_head.head.weight", main.lm_head.weight)

    def mtp_input(token_ids: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        e = rms(embed[token_ids], mtp[p_ + "enorm.weight"])
        return torch.cat([e, rms(state, mtp[p_ + "hnorm.weight"])], dim=-1) @ mtp[p_ + "eh_proj.weight"].T

    def layer(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
        out = full.model.layers[LAYERS](x[None], attention_mask=mask, position_ids=positions,
                                        position_embeddings=full.model.rotary_emb(x[None], positions))
        return (out[0] if isinstance(out, tuple) else out)[0]

    def chain(p: int, drafts: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            x = mtp_input(ids[0, 1:p + 2], h[:p + 1])
            rows = []
            for d in [None, *drafts]:
                if d is not None:
                    x = torch.cat([x, mtp_input(torch.tensor([d]), out[-1:])])
                out = layer(x)
                rows.append(rms(out[-1], mtp[p_ + "shared_head.norm.weight"]) @ head.T)
            return torch.stack(rows)
    return chain


def chains_of(trace: list, request_id: str) -> list[tuple[int, torch.Tensor]]:
    """The drafting passes of one request as chains: (row p, the logits of each draft)."""
    out = []
    for depth, request_ids, positions, logits in trace:
        for rid, pos, row in zip(request_ids, positions.tolist(), logits):
            if rid != request_id:
                continue
            if depth == 1:
                out.append((pos, [row]))
            else:
                assert pos == out[-1][0] + depth - 1 and len(out[-1][1]) == depth - 1
                out[-1][1].append(row)
    return [(p, torch.stack(rows)) for p, rows in out]


def assert_chains_equal_the_reference(trace: list, finals: dict[str, list[int]], ref, atol=1e-4) -> int:
    """Every draft chain in `trace` of every request (its final sequence, prompt included, in
    `finals`) against the reference; how many drafts were checked."""
    checked = 0
    for request_id, tokens in finals.items():
        want = ref(tokens)
        for p, logits in chains_of(trace, request_id):
            drafts = logits.argmax(dim=-1).tolist()[:-1]  # the tokens the chain was fed
            torch.testing.assert_close(logits.float(), want(p, drafts), atol=atol, rtol=0)
            checked += len(logits)
    return checked


def finals_of(outs, prompts) -> dict[str, list[int]]:
    return {o.request_id: p + o.outputs[0].token_ids for o, p in zip(outs, prompts)}


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_mtp_logits_equal_the_reference_and_greedy_is_unchanged(backend, ckpt):
    """Every draft's MTP logits (prefill in chunks, decode over the MTP's latent cache, verify
    steps; three drafts a step, chained) against the reference over the final sequence; greedy
    output with MTP drafts equals HF's and the engine's without."""
    path, full, mtp = ckpt
    llm = LLM(str(path), num_threads=1, max_model_len=256, max_num_batched_tokens=2 * BLOCK,
              attention_backend=backend, speculative_config=MTP3)
    llm.engine.proposer.trace = []
    assert llm.engine.kv_cache.num_layers == LAYERS + 1  # the MTP's latent layer beside the main ones
    prompts = prompts_of([3 * BLOCK + 5, 7, 1], seed=11)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    got = [o.outputs[0].token_ids for o in outs]
    assert_equals_hf(path, prompts, got, n=24)
    plain = LLM(str(path), num_threads=1, max_model_len=256, attention_backend=backend)
    assert engine_greedy(plain, prompts, GREEDY) == got
    depths = [d for d, *_ in llm.engine.proposer.trace]
    assert {1, 2, 3} <= set(depths)
    ref = lambda t: reference_mtp(path, full, mtp, t)  # noqa: E731
    assert assert_chains_equal_the_reference(llm.engine.proposer.trace, finals_of(outs, prompts), ref) >= 60
    stats = llm.engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0


def test_chained_mtp_under_tensor_parallelism_equals_the_reference(tmp_path):
    """TP=2 with three chained drafts a step (the MTP layer's MLA, experts, embedding and head split
    like the main layers'; every rank runs its share of each pass, announced by rank 0 right before
    it runs it), on a mimicking checkpoint whose MTP layer has its own embedding and head (copies of
    the main ones, as released checkpoints have), through chunked prefill, verify steps and
    preemption by a tiny pool: greedy equal to HF's and to a TP=1 engine without drafts, every
    draft's gathered MTP logits on rank 0 within 1e-4 of the reference chain, drafts accepted and
    counted, chained rows on borrowed scratch blocks, chains cut short on rank 0 where no block was
    vacant (every other borrow refused here: the workers ran exactly the passes rank 0 ran, or the
    run would hang or time out), and every block back in the pool."""
    path, full, mtp = write_v3_with_mtp(tmp_path / "v3mimic", seed=52, own_head=True, mimic=True, leak=0.05)
    llm = LLM(str(path), num_threads=1, max_model_len=256, max_num_batched_tokens=2 * BLOCK, num_kvcache_blocks=9,
              tensor_parallel_size=2, speculative_config=MTP3)
    borrowed, refused = [], []

    class EveryOther:
        """The scheduler's pool as the drafter sees it: every other scratch block refused."""

        def __init__(self, pool: BlockPool):
            self.pool = pool

        def __getattr__(self, name):
            return getattr(self.pool, name)

        def take_vacant(self):
            if len(borrowed) > len(refused):
                refused.append(None)
                return None
            borrowed.append(self.pool.take_vacant())
            return borrowed[-1]
    llm.engine.proposer.pool = EveryOther(llm.engine.proposer.pool)
    try:
        llm.engine.proposer.trace = []
        assert llm.engine.kv_cache.num_layers == LAYERS + 1
        prompts = prompts_of([20, 9, 30], seed=12)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        got = [o.outputs[0].token_ids for o in outs]
        assert_equals_hf(path, prompts, got, n=40)
        assert engine_greedy(LLM(str(path), num_threads=1, max_model_len=256), prompts,
                             SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)) == got
        assert {1, 2, 3} <= {d for d, *_ in llm.engine.proposer.trace}
        ref = lambda t: reference_mtp(path, full, mtp, t)  # noqa: E731
        assert assert_chains_equal_the_reference(llm.engine.proposer.trace, finals_of(outs, prompts), ref) > 100
        stats = llm.engine.stats()
        assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == 9
        assert any(b is not None for b in borrowed) and refused  # scratch blocks used, chains cut short
        assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
        kept = stats["spec_decode"]["distribution"]
        assert stats["spec_decode_num_accepted_tokens"] == sum(n * steps for n, steps in kept.items())
    finally:
        llm.engine.close()


def test_mtp_in_bfloat16_is_near_the_float32_reference(ckpt):
    """bfloat16 weights, latent cache (the MTP's layer too) and activations: the MTP logits of
    every draft within bf16's error of the float32 reference (seen: 0.03 on logits up to 3)."""
    path, full, mtp = ckpt
    llm = LLM(str(path), num_threads=1, max_model_len=256, dtype="bfloat16", speculative_config=MTP)
    llm.engine.proposer.trace = []
    prompt = prompts_of([37], seed=11)[0]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=16, temperature=0.0,
                                                                      ignore_eos=True))[0]
    assert all(logits.dtype == torch.bfloat16 for *_, logits in llm.engine.proposer.trace)
    ref = lambda t: reference_mtp(path, full, mtp, t)  # noqa: E731
    assert assert_chains_equal_the_reference(llm.engine.proposer.trace, finals_of([out], [prompt]), ref,
                                             atol=0.1) >= 16


@needs_avx512("deepseek_mtp.MtpPass (the MTP pass in one C call)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mtp_pass_in_one_c_call_gives_the_per_op_passs_bits(dtype, ckpt):
    """Batch 1: the MTP pass in one C call (deepseek_mtp.MtpPass: norms, eh_proj, the layer, the head)
    against the same engine's pass made of separate calls: the same greedy ids, and the first draft's
    logits at every position both drafted from bit for bit (one-row passes: the same GEMV sums)."""
    path, _, _ = ckpt
    llm = LLM(str(path), num_threads=1, max_model_len=256, dtype=dtype, enable_prefix_caching=False,
              speculative_config=MTP3)
    mtp = llm.engine.proposer.mtp
    assert mtp.fused is not None
    prompt = prompts_of([30], seed=13)[0]
    got = {}
    for fused in (mtp.fused, None):
        mtp.fused, llm.engine.proposer.trace = fused, []
        out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        got[fused is not None] = out, {int(at[-1]): logits[-1] for depth, _, at, logits in llm.engine.proposer.trace
                                       if depth == 1 and len(at) == 1}
    assert got[True][0] == got[False][0]
    both = got[True][1].keys() & got[False][1].keys()
    assert len(both) >= 8 and all(torch.equal(got[True][1][p], got[False][1][p]) for p in both)


def test_mtp_drafts_are_accepted_and_counted(mimic, monkeypatch):
    """The mimicking MTP layer (its attention leaking into every logit) drafts the token the
    main model just produced, three times: accepted wherever the greedy output repeats a token,
    so verify steps keep all, some or none of the chain. Through preemption by a tiny pool, every
    chain's logits still equal the reference (the rejected drafts' latent rows never read), the
    chained rows past a sequence's blocks borrow scratch blocks and every block comes back, and
    the counters say how many drafts were kept."""
    path, full, mtp = mimic
    borrowed = []
    take_vacant = BlockPool.take_vacant
    monkeypatch.setattr(BlockPool, "take_vacant", lambda pool: borrowed.append(take_vacant(pool)) or borrowed[-1])
    llm = LLM(str(path), num_threads=1, max_model_len=256, num_kvcache_blocks=9, speculative_config=MTP3)
    llm.engine.proposer.trace = []
    prompts = prompts_of([20, 9, 30], seed=12)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    got = [o.outputs[0].token_ids for o in outs]
    assert_equals_hf(path, prompts, got, n=40)
    ref = lambda t: reference_mtp(path, full, mtp, t)  # noqa: E731
    assert assert_chains_equal_the_reference(llm.engine.proposer.trace, finals_of(outs, prompts), ref) > 100
    stats = llm.engine.stats()
    print(stats["spec_decode"], stats["num_preemptions"], len(borrowed), borrowed.count(None))
    assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == 9
    assert any(b is not None for b in borrowed)  # a chain past a sequence's last block
    kept = stats["spec_decode"]["distribution"]
    assert kept[0] and kept[3] and kept[1] + kept[2]  # none, all and some of a step's drafts kept
    assert stats["spec_decode_num_accepted_tokens"] == sum(n * steps for n, steps in kept.items())
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


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
    sharded = load_model(ckpt[0], expert_shard=(0, 2))  # an expert-parallel rank's model, not in its group yet
    with pytest.raises(ValueError, match="MTP layer loads after use_expert_parallel"):
        load_mtp(ckpt[0], sharded)
