"""The engine's side of issue 23, in process on a small random Llama: n / best_of forks
(prompt prefilled once, blocks shared, seeds seed + i, best_of ranked by cumulative
logprob), prompt logprobs against transformers (chunked prefill included), penalties and
logit processing applied to greedy decoding, and the pool back at its baseline."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from atomd.llm import LLM
from contracts.sampling import SamplingParams
from tests.test_engine import assert_idle, llama_dir  # noqa: F401 (llama_dir is a fixture)
from tests.test_model_hf import hf_greedy, hf_model, prompts_of

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:  # noqa: F811
    return LLM(str(llama_dir), num_threads=1, max_model_len=128, num_kvcache_blocks=64, max_num_batched_tokens=64)


def ids(prompt: list[int]) -> dict:
    return {"prompt_token_ids": prompt}


def test_seeded_n_equals_single_requests_with_derived_seeds(llm):
    prompt = prompts_of([21], seed=1)[0]  # a partly filled last block: the choices copy it on write
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=5, ignore_eos=True, n=3, logprobs=1)
    forwards = llm.engine.runner.execute
    prefilled = []

    def counting(batch, all_logits=False):
        if batch.is_prefill:
            prefilled.append(int(batch.num_scheduled_tokens.sum()))
        return forwards(batch, all_logits)

    llm.engine.runner.execute = counting
    try:
        out = llm.generate([ids(prompt)], sp)[0].outputs
    finally:
        llm.engine.runner.execute = forwards
    assert sum(prefilled) == len(prompt)  # the prompt is prefilled once for the three choices
    assert [o.index for o in out] == [0, 1, 2]
    for i, o in enumerate(out):
        single = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=5 + i, ignore_eos=True, logprobs=1)
        alone = llm.generate([ids(prompt)], single)[0].outputs[0]
        assert o.token_ids == alone.token_ids
        assert o.cumulative_logprob == pytest.approx(sum(e.logprob for e in o.logprobs), abs=1e-4)
    assert len({tuple(o.token_ids) for o in out}) == 3
    assert_idle(llm)


def test_best_of_returns_the_best_n_by_cumulative_logprob(llm):
    prompt = prompts_of([16], seed=2)[0]  # block-aligned: nothing to copy
    sp = SamplingParams(max_tokens=8, temperature=1.5, seed=11, ignore_eos=True, n=2, best_of=5)
    out = llm.generate([ids(prompt)], sp)[0].outputs
    candidates = []
    for i in range(5):
        single = SamplingParams(max_tokens=8, temperature=1.5, seed=11 + i, ignore_eos=True, logprobs=0)
        alone = llm.generate([ids(prompt)], single)[0].outputs[0]
        candidates.append((-sum(e.logprob for e in alone.logprobs), i, alone.token_ids))
    best = sorted(candidates)[:2]
    assert [o.token_ids for o in out] == [c[2] for c in best]
    assert [o.index for o in out] == [0, 1] and out[0].cumulative_logprob >= out[1].cumulative_logprob
    assert out[0].logprobs is None  # not asked for: only the ranking used them
    assert_idle(llm)


def test_greedy_choices_share_the_prompt_and_agree(llm, llama_dir):
    prompt = prompts_of([37], seed=3)[0]
    want = hf_greedy(llama_dir, prompt, 6)
    out = llm.generate([ids(prompt)], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=4))[0]
    assert [o.token_ids for o in out.outputs] == [want] * 4
    assert_idle(llm)


def test_abort_of_a_forked_request_frees_every_choice(llm):
    engine = llm.engine
    engine.add_request("forked", prompts_of([30], seed=4)[0],
                       SamplingParams(max_tokens=50, temperature=1.0, ignore_eos=True, n=3))
    outs = []
    for _ in range(3):
        outs += engine.step()
    assert {o.index for o in outs if o.new_token_ids} == {0, 1, 2}
    assert engine.stats()["num_running"] == 3
    assert engine.abort_request("forked")
    (out,) = engine.step()
    assert out.finished and out.finish_reason == "abort"
    assert_idle(llm)


@pytest.mark.parametrize("budget", [64, 8], ids=["one-chunk", "chunked"])
def test_prompt_logprobs_equal_transformers(llama_dir, budget):
    llm = LLM(str(llama_dir), num_threads=1, max_model_len=128, num_kvcache_blocks=64,
              max_num_batched_tokens=budget)
    prompt = prompts_of([29], seed=5)[0]
    llm.generate([ids(prompt)], SamplingParams(max_tokens=1))  # a cached prefix must not skip logits
    res = llm.generate([ids(prompt)], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3))[0]
    with torch.inference_mode():
        logits = hf_model(llama_dir)(torch.tensor([prompt])).logits[0]
    ref = torch.log_softmax(logits.double(), -1)
    entries = res.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None and res.num_cached_tokens == 0
    for pos in range(1, len(prompt)):
        row, token = ref[pos - 1], prompt[pos]
        assert entries[pos].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entries[pos].rank == int((row > row[token]).sum()) + 1
        top = row.topk(3)
        assert [t for t, _ in entries[pos].top] == top.indices.tolist()
    assert_idle(llm)


def test_penalties_and_logit_processing_shape_greedy_output(llm, llama_dir):
    prompt = prompts_of([12], seed=6)[0]
    plain = hf_greedy(llama_dir, prompt, 10)
    first = plain[0]

    def run(**kw) -> list[int]:
        return llm.generate([ids(prompt)], SamplingParams(**{"max_tokens": 10, "temperature": 0.0, "ignore_eos": True,
                                                             **kw}))[0].outputs[0].token_ids

    assert run() == plain
    assert first not in run(logit_bias={first: -100.0})
    allowed = sorted(set(plain[:3]) | {3, 4, 5})
    assert set(run(allowed_token_ids=allowed)) <= set(allowed)
    assert run(temperature=1.0, min_p=0.99, seed=1) == plain  # only the most likely token is left
    repeats = len(plain) - len(set(plain))
    penalised = run(repetition_penalty=2.0, presence_penalty=2.0)
    assert len(penalised) - len(set(penalised)) <= repeats
    assert_idle(llm)


def test_bad_words_are_tokenized_the_vllm_way_and_never_completed(llm):
    tok = llm.get_tokenizer()
    text = llm.generate("def main():", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    word = tok.decode(text.outputs[0].token_ids[2:4]).strip() or "x"
    bad = llm.engine.bad_words_token_ids([word])
    assert bad[0] == tok.encode(word, add_special_tokens=False)
    out = llm.generate("def main():", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                     bad_words=[word]))[0].outputs[0].token_ids
    for w in bad:
        assert not any(out[i:i + len(w)] == w for i in range(len(out) - len(w) + 1))
    assert_idle(llm)


def test_token_ids_outside_the_vocabulary_are_refused(llm):
    vocab = llm.engine.model.config.vocab_size
    for kw in ({"logit_bias": {vocab: 1.0}}, {"allowed_token_ids": [1, vocab + 3]}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            llm.engine.add_request("bad", [1, 2], SamplingParams(**kw))
    assert_idle(llm)


def test_n_larger_than_max_num_seqs_is_unschedulable(llama_dir):
    llm = LLM(str(llama_dir), num_threads=1, max_model_len=64, num_kvcache_blocks=16, max_num_seqs=2)
    res = llm.generate([ids([5, 6, 7])], SamplingParams(max_tokens=2, n=3))[0]
    assert res.error is not None and "max_num_seqs=2" in res.error
    out = llm.generate([ids([5, 6, 7])], SamplingParams(max_tokens=2, n=2, temperature=0.0))[0]
    assert len(out.outputs) == 2 and np.array_equal(out.outputs[0].token_ids, out.outputs[1].token_ids)
    assert_idle(llm)
