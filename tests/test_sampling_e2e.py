"""Issue 23 end to end: sampling parameters, n / best_of, echo and prompt logprobs against
real `atomd serve` processes on 127.0.0.1 with the built-in default model, colocated and
through PD (router -> P -> D), and the two must agree. After every test each engine is
idle with its whole pool free and P has nothing pinned."""
from __future__ import annotations

import json

import numpy as np
import pytest

from launch.process import http
from tests.pd_fixtures import pd, settled, sse_events  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PROMPT = "def fibonacci(n):\n    "
LOOP = "import os\nimport os\nimport os\nimport os\nimport"  # the model loops on it


def complete(url: str, body: dict, path: str = "/v1/completions"):
    status, raw = http("POST", url + path, body)
    assert status == 200, raw
    return sse_events(raw) if body.get("stream") else json.loads(raw)


def both(pd, body: dict, path: str = "/v1/completions"):
    """The colocated answer and the PD answer to the same body."""
    return complete(pd["ref"].url, body, path), complete(pd.router.url, body, path)


def texts(resp: dict) -> list[str]:
    return [c["text"] for c in sorted(resp["choices"], key=lambda c: c["index"])]


def greedy(**kw) -> dict:
    return {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **kw}


def test_logit_bias_minus_100_removes_the_greedy_token(pd):
    want = complete(pd["ref"].url, greedy(logprobs=0))
    first = want["choices"][0]["logprobs"]["tokens"][0]
    same_text = [i for i in range(4096) if pd_decode(pd, i) == first]  # the greedy token is one of them
    for resp in both(pd, greedy(logprobs=0, logit_bias={str(i): -100 for i in same_text})):
        assert first not in resp["choices"][0]["logprobs"]["tokens"]
        assert resp["choices"][0]["text"] != want["choices"][0]["text"]


_VOCAB: dict[int, str] = {}


def pd_decode(pd, token_id: int) -> str:
    """A token's text as the server renders it (from the engine's tokenizer)."""
    if not _VOCAB:
        from atomd.tokenizer import Tokenizer
        tok = Tokenizer.from_dir(pd.model)
        _VOCAB.update({i: tok.decode([i]) for i in range(tok.vocab_size)})
    return _VOCAB[token_id]


def test_repetition_penalty_reduces_repeats_on_a_looping_prompt(pd):
    body = {"prompt": LOOP, "max_tokens": 32, "temperature": 0, "ignore_eos": True, "logprobs": 0}

    def repeats(resp) -> int:
        tokens = resp["choices"][0]["logprobs"]["tokens"]
        return len(tokens) - len(set(tokens))

    plain_ref, plain_pd = both(pd, body)
    pen_ref, pen_pd = both(pd, dict(body, repetition_penalty=2.0))
    assert texts(plain_ref) == texts(plain_pd) and texts(pen_ref) == texts(pen_pd)
    assert repeats(plain_ref) >= 16  # it loops
    assert repeats(pen_ref) <= repeats(plain_ref) // 2, (texts(plain_ref), texts(pen_ref))


def test_frequency_and_presence_penalties_colocated_equal_pd(pd):
    body = {"prompt": LOOP, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "frequency_penalty": 1.5, "presence_penalty": 0.5}
    ref, routed = both(pd, body)
    plain = complete(pd["ref"].url, dict(body, frequency_penalty=0, presence_penalty=0))
    assert texts(ref) == texts(routed) and texts(ref) != texts(plain)


def test_min_p_099_equals_greedy(pd):
    want = complete(pd["ref"].url, greedy())
    for resp in both(pd, greedy(temperature=1.0, min_p=0.99, seed=3)):
        assert texts(resp) == texts(want)


def test_bad_words_and_allowed_token_ids(pd):
    want = texts(complete(pd["ref"].url, greedy()))[0]
    word = want.split("(")[0].strip().split()[-1] if "(" in want else want.split()[0]
    for resp in both(pd, greedy(bad_words=[word])):
        assert word not in texts(resp)[0]
    allowed = [i for i in range(300, 340)]
    allowed_text = {pd_decode(pd, i) for i in allowed}
    ref, routed = both(pd, greedy(allowed_token_ids=allowed, logprobs=0, max_tokens=8))
    assert texts(ref) == texts(routed)
    assert set(ref["choices"][0]["logprobs"]["tokens"]) <= allowed_text


def test_seeded_n_equals_single_requests_with_derived_seeds(pd):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "top_p": 0.95, "seed": 42, "ignore_eos": True}
    singles = [texts(complete(pd["ref"].url, dict(body, seed=42 + i)))[0] for i in range(3)]
    ref, routed = both(pd, dict(body, n=3))
    assert texts(ref) == texts(routed) == singles
    assert len(set(singles)) == 3
    assert ref["usage"]["completion_tokens"] == routed["usage"]["completion_tokens"] == 36
    assert ref["usage"]["prompt_tokens"] == routed["usage"]["prompt_tokens"]


def test_streamed_choices_interleave_by_index_and_count_in_usage(pd):
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 7, "ignore_eos": True, "n": 3}
    want = texts(complete(pd["ref"].url, body))
    for events in both(pd, dict(body, stream=True, stream_options={"include_usage": True})):
        by_index: dict[int, str] = {}
        order = []
        for e in events:
            for c in e["choices"]:
                by_index[c["index"]] = by_index.get(c["index"], "") + c["text"]
                order.append(c["index"])
        assert [by_index[i] for i in range(3)] == want
        assert sorted(set(order)) == [0, 1, 2] and order != sorted(order)  # interleaved as produced
        assert events[-1]["usage"]["completion_tokens"] == 30


def test_chat_n_through_the_router(pd):
    body = {"messages": [{"role": "user", "content": "Write a loop."}], "max_tokens": 8, "temperature": 0.8,
            "seed": 1, "n": 2}
    ref, routed = both(pd, body, "/v1/chat/completions")
    get = lambda r: [c["message"]["content"] for c in sorted(r["choices"], key=lambda c: c["index"])]  # noqa: E731
    assert get(ref) == get(routed) and len(get(ref)) == 2
    events = complete(pd.router.url, dict(body, stream=True), "/v1/chat/completions")
    roles = [c["index"] for e in events for c in e["choices"] if c["delta"].get("role") == "assistant"]
    assert sorted(roles) == [0, 1]


def test_best_of_returns_the_two_best_by_cumulative_logprob(pd):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.2, "seed": 100, "ignore_eos": True}
    scored = []
    for i in range(4):
        resp = complete(pd["ref"].url, dict(body, seed=100 + i, logprobs=0))
        scored.append((-sum(resp["choices"][0]["logprobs"]["token_logprobs"]), i, resp["choices"][0]["text"]))
    want = [text for _, _, text in sorted(scored)[:2]]
    ref, routed = both(pd, dict(body, n=2, best_of=4))
    assert texts(ref) == texts(routed) == want
    assert ref["usage"]["completion_tokens"] == 16


def test_echo_starts_with_the_prompt_and_carries_prompt_logprobs(pd):
    body = greedy(echo=True, logprobs=1, max_tokens=4)
    ref, routed = both(pd, body)
    for resp in (ref, routed):
        choice = resp["choices"][0]
        assert choice["text"].startswith(PROMPT)
        lp = choice["logprobs"]
        n_prompt = resp["usage"]["prompt_tokens"]
        assert len(lp["tokens"]) == n_prompt + 4 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None and all(v is not None for v in lp["token_logprobs"][1:])
    np.testing.assert_allclose(ref["choices"][0]["logprobs"]["token_logprobs"][1:],
                               routed["choices"][0]["logprobs"]["token_logprobs"][1:], atol=1e-4)
    events = complete(pd.router.url, dict(body, stream=True))
    assert "".join(c["text"] for e in events for c in e["choices"]).startswith(PROMPT)
    assert complete(pd["ref"].url, greedy(echo=True))["choices"][0]["text"].startswith(PROMPT)


def test_prompt_logprobs_vllm_field_colocated_equal_pd(pd):
    body = greedy(prompt_logprobs=2, max_tokens=3)
    ref, routed = both(pd, body)
    a, b = ref["choices"][0]["prompt_logprobs"], routed["choices"][0]["prompt_logprobs"]
    assert len(a) == ref["usage"]["prompt_tokens"] and a[0] is None and b[0] is None
    for x, y in zip(a[1:], b[1:]):
        assert x.keys() == y.keys() and 2 <= len(x) <= 3
        for token, entry in x.items():
            assert entry["rank"] >= 1 and entry["decoded_token"] == y[token]["decoded_token"]
            assert entry["logprob"] == pytest.approx(y[token]["logprob"], abs=1e-4)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0}
    ref, routed = both(pd, chat, "/v1/chat/completions")
    assert len(ref["prompt_logprobs"]) == len(routed["prompt_logprobs"]) == ref["usage"]["prompt_tokens"]


def test_unknown_and_unsupported_fields_are_refused_through_the_router(pd):
    for body, param in ((greedy(temprature=0.5), "temprature"), (greedy(suffix="x"), "suffix")):
        for url in (pd["ref"].url, pd.router.url):
            status, raw = http("POST", url + "/v1/completions", body)
            assert status == 400 and json.loads(raw)["error"]["param"] == param
