"""Issue 34: structured outputs under a reasoning parser start after the reasoning (vLLM's
rule): the reasoning is free text, the grammar shapes what follows `</think>`.

In process: the engine's matcher with a `ReasoningSpan` (atomd/structured.py) against the
plain grammar matcher fed only the answer's tokens (the reference: the grammar alone on
the text after `</think>`), every phase, speculative drafts across the boundary, replay
(preemption, a decode engine's T0), and which tokenizers give a span at all.

End to end: a tiny checkpoint whose tokenizer has `<think>` / `</think>` as added tokens
(the built-in model with two more embedding rows, written with transformers) behind
`atomd serve --reasoning-parser qwen3`, colocated and as a prefill / decode pair behind the
router, read with the official openai client: the reasoning equals what the model writes
unconstrained with the same seed (a reasoning row is not masked), the answer fullmatches the
regex, PD answers as colocated; `include_reasoning: false` drops the reasoning streamed and
not."""
from __future__ import annotations

import json
import re
import shutil

import numpy as np
import openai
import pytest
import tokenizers

from atomd.api.reasoning import grammar_after_reasoning, reasoning_span
from atomd.model.default import default_model_dir
from atomd.structured import GrammarCompiler
from atomd.tokenizer import Tokenizer
from contracts.sampling import ReasoningSpan, StructuredOutputsParams as SO

END = [2, 6]
REGEX = r"[A-Z][a-z]{2,8}( [a-z]{2,8}){0,2}\."


def tokenizer_with_tags(special: bool = False) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    tok.add_tokens([tokenizers.AddedToken("<think>", special=special),
                    tokenizers.AddedToken("</think>", special=special)])
    return tok


@pytest.fixture(scope="module")
def tags():
    tok = tokenizer_with_tags()
    vocab = tok.get_vocab_size(with_added_tokens=True)
    compiler = GrammarCompiler(tok.to_str(), vocab, END)
    return {"tok": tok, "compiler": compiler, "vocab": vocab, "start": tok.token_to_id("<think>"),
            "end": tok.token_to_id("</think>")}


def allowed(matcher, compiler, vocab: int, drafts=None) -> np.ndarray:
    """The tokens `matcher` allows next (after `drafts`, when given), as a bool vector."""
    row = compiler.new_bitmask(1)[0]
    if drafts is None:
        matcher.fill(row)
    else:
        matcher.fill_after(drafts, row)
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab].astype(bool)


def reference(compiler, vocab: int, answer: list[int]) -> np.ndarray:
    """The plain grammar after the answer's tokens: what a gated matcher must allow once the
    reasoning ended."""
    plain = compiler.matcher(SO(regex=REGEX))
    plain.advance(answer)
    return allowed(plain, compiler, vocab)


def encode(tags, text: str) -> list[int]:
    return tags["tok"].encode(text, add_special_tokens=False).ids


@pytest.mark.unit
def test_inside_reasoning_every_token_is_allowed_then_the_grammar_takes_over(tags):
    c, vocab, end = tags["compiler"], tags["vocab"], tags["end"]
    reasoning = encode(tags, "so {x: 1} -- 42 lower case?")
    answer = encode(tags, "Hello big world.")
    output = reasoning + [end] + answer
    prompt = [5, 7, 9]
    gated = c.matcher(SO(regex=REGEX, reasoning=ReasoningSpan(end_token_id=end)))
    for k in range(len(output) + 1):  # one sample after another, as the sampler syncs
        gated.sync(prompt + output[:k], len(prompt))
        mask = allowed(gated, c, vocab)
        if k <= len(reasoning):
            assert mask.all(), k  # the reasoning (and its closing tag) is free text
        else:
            assert (mask == reference(c, vocab, answer[:k - len(reasoning) - 1])).all(), k
    assert set(np.flatnonzero(mask)) == set(END)  # the answer completed the grammar


@pytest.mark.unit
def test_a_block_the_first_token_may_open(tags):
    c, vocab, start, end = tags["compiler"], tags["vocab"], tags["start"], tags["end"]
    span = ReasoningSpan(end_token_id=end, start_token_id=start)
    first = allowed(c.matcher(SO(regex=REGEX, reasoning=span)), c, vocab)
    want = reference(c, vocab, [])
    assert not want[start] and first[start] and (np.delete(first, start) == np.delete(want, start)).all()
    # opened: free until </think>, then the grammar from its start
    opened = c.matcher(SO(regex=REGEX, reasoning=span))
    opened.advance([start] + encode(tags, "hmm 1 2"))
    assert allowed(opened, c, vocab).all()
    opened.advance([end])
    assert (allowed(opened, c, vocab) == want).all()
    # not opened: the first token was the grammar's, so is every later one (no reasoning at all)
    answer = encode(tags, "Yes sir.")
    direct = c.matcher(SO(regex=REGEX, reasoning=span))
    direct.advance(answer[:1])
    assert (allowed(direct, c, vocab) == reference(c, vocab, answer[:1])).all()
    assert not allowed(direct, c, vocab)[start] and not allowed(direct, c, vocab)[end]
    assert direct.advance(answer[1:]) and set(np.flatnonzero(allowed(direct, c, vocab))) == set(END)


@pytest.mark.unit
def test_drafts_across_the_boundary_and_replay_match_the_stepwise_state(tags):
    """fill_after (speculative drafts) equals the state a matcher reaches by taking the same
    tokens, and leaves its own state as it was; one sync over many tokens (a preempted
    sequence, a decode engine's T0 and drafts) equals token by token."""
    c, vocab, start, end = tags["compiler"], tags["vocab"], tags["start"], tags["end"]
    output = [start] + encode(tags, "a b") + [end] + encode(tags, "Fine now.")
    span = ReasoningSpan(end_token_id=end, start_token_id=start)
    for k in range(len(output) + 1):
        for cut in range(k, len(output) + 1):
            m = c.matcher(SO(regex=REGEX, reasoning=span))
            m.advance(output[:k])
            before = allowed(m, c, vocab)
            after = allowed(m, c, vocab, drafts=output[k:cut])
            stepped = c.matcher(SO(regex=REGEX, reasoning=span))
            for t in output[:cut]:
                stepped.advance([t])
            assert (after == allowed(stepped, c, vocab)).all(), (k, cut)
            assert (allowed(m, c, vocab) == before).all(), (k, cut)  # unchanged
    replayed = c.matcher(SO(regex=REGEX, reasoning=span))
    replayed.sync([1, 2] + output, 2)
    assert (allowed(replayed, c, vocab) == allowed(stepped, c, vocab)).all()


@pytest.mark.unit
def test_an_answer_that_breaks_the_grammar_allows_only_the_end_tokens(tags):
    c, vocab, end = tags["compiler"], tags["vocab"], tags["end"]
    m = c.matcher(SO(regex=REGEX, reasoning=ReasoningSpan(end_token_id=end)))
    assert m.advance(encode(tags, "free") + [end])
    assert not m.advance(encode(tags, "lower"))  # the regex wants a capital first
    assert set(np.flatnonzero(allowed(m, c, vocab))) == set(END)


@pytest.mark.unit
def test_a_span_is_checked(tags):
    for bad in ({"end_token_id": -1}, {"end_token_id": 3, "start_token_id": 3}, {"end_token_id": True}):
        with pytest.raises(ValueError, match="reasoning"):
            ReasoningSpan(**bad)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tags["compiler"].compile(SO(regex="a", reasoning=ReasoningSpan(end_token_id=tags["vocab"])))


@pytest.mark.unit
def test_which_tokenizers_give_a_span(tags):
    """The parser's rule in token ids: inside from the start for deepseek_r1 or a prompt that
    opened <think>, else a block the first token may open; none where a tag is no single
    token or a special one (its text would never reach the parser)."""
    with_tags = Tokenizer(tokenizer_with_tags(), {})
    start, end = tags["start"], tags["end"]
    assert reasoning_span(with_tags, "qwen3", False) == ReasoningSpan(end_token_id=end, start_token_id=start)
    assert reasoning_span(with_tags, "qwen3", True) == ReasoningSpan(end_token_id=end)
    assert reasoning_span(with_tags, "deepseek_r1", False) == ReasoningSpan(end_token_id=end)
    assert reasoning_span(Tokenizer.from_dir(default_model_dir()), "deepseek_r1", True) is None  # "</think>": pieces
    assert reasoning_span(Tokenizer(tokenizer_with_tags(special=True), {}), "qwen3", True) is None
    prompt = with_tags.encode("<|user|>\nhi<|end|>\n<|assistant|>\n<think>\n", add_special_tokens=False)
    assert grammar_after_reasoning(with_tags, "qwen3", SO(regex="a"), prompt).reasoning == ReasoningSpan(end_token_id=end)
    assert grammar_after_reasoning(with_tags, "qwen3", SO(regex="a"), prompt[:-2]).reasoning.start_token_id == start


# ---------------------------------------------------------------------------- end to end

# thinking=true: the template opens <think> itself (the output starts inside the reasoning)
THINK_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>\n{% if thinking is defined and thinking %}<think>\n"
                  "{% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "Say something."}]
NAME = "think-model"


@pytest.fixture(scope="module")
def think_model(tmp_path_factory):
    """The built-in model with `<think>` / `</think>` as added (not special) tokens, as Qwen3's
    tokenizer has them: two more embedding and head rows (random), written by transformers."""
    import torch
    import transformers

    out = tmp_path_factory.mktemp("think-model")
    tok = transformers.AutoTokenizer.from_pretrained(default_model_dir())
    tok.add_tokens(["<think>", "</think>"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir())
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "think.jinja").write_text(THINK_TEMPLATE)
    return out, tok


@pytest.fixture(scope="module")
def cluster(think_model):
    """A colocated engine `ref` and a prefill / decode pair behind a router, all with the flags."""
    from tests.pd_fixtures import ref_and_pd

    path, _ = think_model
    with ref_and_pd("--served-model-name", NAME, "--reasoning-parser", "qwen3", "--chat-template",
                    str(path / "think.jinja"), model=path) as cluster:
        yield cluster
        cluster.assert_settled()  # no block leaked, nothing left pinned on P


@pytest.fixture(scope="module")
def server(cluster):
    return cluster["ref"]


def prompt_ids(think_model, **kwargs) -> list[int]:
    _, tok = think_model
    text = tok.apply_chat_template(MESSAGES, chat_template=THINK_TEMPLATE, add_generation_prompt=True,
                                   tokenize=False, **kwargs)
    return tok(text, add_special_tokens=False).input_ids


def raw_text(srv, ids: list[int], **params) -> str:
    """What the model writes after these prompt ids (/v1/completions parses nothing)."""
    from launch.process import http

    status, body = http("POST", srv.url + "/v1/completions", {"prompt": ids, **params})
    assert status == 200, body
    return json.loads(body)["choices"][0]["text"]


def chat(srv, stream: bool, **extra):
    """(reasoning, content, finish_reason) through the official openai client; deltas joined."""
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)  # an engine or the router
    kw = {k: extra.pop(k) for k in ("temperature", "seed", "max_tokens", "logit_bias") if k in extra}
    resp = client.chat.completions.create(model=NAME, messages=MESSAGES, stream=stream, extra_body=extra, **kw)
    if not stream:
        choice = resp.choices[0]
        return choice.message.model_extra.get("reasoning_content"), choice.message.content, choice.finish_reason
    reasoning = content = ""
    reason = None
    for chunk in resp:
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return reasoning or None, content or None, reason


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", [0, 1])
def test_the_reasoning_runs_free_and_the_answer_follows_the_grammar(server, cluster, think_model, seed):
    """The prompt opened <think>: the model reasons unconstrained (the same tokens it writes
    without any grammar, same seed), closes the block, and the answer fullmatches the regex.
    Through PD the same answer: P samples T0 under the same span, D replays it."""
    _, tok = think_model
    end = tok.convert_tokens_to_ids("</think>")
    params = dict(temperature=1.0, seed=seed, max_tokens=96, logit_bias={str(end): 9.0})
    raw = raw_text(server, prompt_ids(think_model, thinking=True), **params)
    assert "</think>" in raw, raw  # (the bias makes the model close the block soon)
    want_reasoning = raw.split("</think>")[0]
    assert not re.fullmatch(REGEX, want_reasoning.strip())  # free text: the grammar would not allow it
    answers = {}
    for stream in (False, True):
        reasoning, content, reason = chat(server, stream, chat_template_kwargs={"thinking": True},
                                          guided_regex=REGEX, **params)
        assert reasoning == (want_reasoning or None) and reason == "stop", (reasoning, content)
        assert re.fullmatch(REGEX, content), content
        answers[stream] = content
        # include_reasoning false: the same answer, no reasoning
        assert chat(server, stream, chat_template_kwargs={"thinking": True}, guided_regex=REGEX,
                    include_reasoning=False, **params) == (None, content, "stop")
        assert chat(cluster.router, stream, chat_template_kwargs={"thinking": True}, guided_regex=REGEX,
                    **params) == (want_reasoning or None, content, "stop")
    assert answers[False] == answers[True]


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_an_output_that_does_not_open_a_block_is_the_grammars_from_its_first_token(server, think_model):
    """qwen3's rule: reasoning only when the output opens with <think>. Greedy, the model does
    not open one here, so the answer is what the grammar alone gives (the same request on
    /v1/completions) and there is no reasoning."""
    raw = raw_text(server, prompt_ids(think_model), temperature=0.0, max_tokens=40, guided_regex=REGEX)
    assert re.fullmatch(REGEX, raw), raw
    for stream in (False, True):
        assert chat(server, stream, temperature=0.0, max_tokens=40, guided_regex=REGEX) == (None, raw, "stop")
    response_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"], "additionalProperties": False}}}
    # a json_schema answer after reasoning (response_format takes the same path)
    reasoning, content, reason = chat(server, False, temperature=1.0, seed=0, max_tokens=60,
                                      response_format=response_format, chat_template_kwargs={"thinking": True},
                                      logit_bias={str(think_model[1].convert_tokens_to_ids("</think>")): 9.0})
    assert reason == "stop" and 0 <= json.loads(content)["n"] <= 99, (reasoning, content)
