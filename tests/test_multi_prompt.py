"""Several prompts in one /v1/completions request (issue 40), colocated and through the
router's PD pair: each prompt answers exactly as it does alone (the reference: the same
server's single-prompt answers), choices indexed prompt-major (`n` per prompt), usage summed,
streams interleaved by index; bounded by --max-prompts; a prompt the engine refuses makes
the whole request a 400. After every test each engine is idle with its pool free and P has
nothing pinned."""
from __future__ import annotations

import json

import openai
import pytest

from launch.process import http
from tests.pd_fixtures import pd, settled, sse_events  # noqa: F401 (fixtures)
from tests.server_fixtures import MAX_MODEL_LEN

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport", "class Stack:\n    def"]


def post(url: str, body: dict) -> tuple[int, dict | list]:
    status, raw = http("POST", url + "/v1/completions", body)
    return status, (sse_events(raw) if body.get("stream") and status == 200 else json.loads(raw))


def complete(url: str, body: dict):
    status, answer = post(url, body)
    assert status == 200, answer
    return answer


def alone(url: str, body: dict, prompts: list) -> tuple[list[dict], dict]:
    """Each prompt's choices sent alone, renumbered prompt-major, and the usages summed."""
    choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    n = body.get("n", 1)
    for i, p in enumerate(prompts):
        one = complete(url, dict(body, prompt=p))
        for c in one["choices"]:
            choices.append(dict(c, index=i * n + c["index"]))
        for k in usage:
            usage[k] += one["usage"][k]
    return sorted(choices, key=lambda c: c["index"]), usage


def by_index(answer: dict) -> list[dict]:
    return sorted(answer["choices"], key=lambda c: c["index"])


def streamed_texts(events: list[dict]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    return texts


SAMPLED = {"max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 2, "ignore_eos": True}


@pytest.mark.parametrize("where", ["ref", "router"])
def test_each_prompt_answers_as_alone_prompt_major(pd, where):
    url = pd["ref"].url if where == "ref" else pd.router.url
    body = dict(SAMPLED, prompt=PROMPTS, logprobs=1)
    got = complete(url, body)
    want, usage = alone(pd["ref"].url, body, PROMPTS)
    assert [c["index"] for c in by_index(got)] == list(range(len(PROMPTS) * 2))
    for g, w in zip(by_index(got), want):
        assert (g["text"], g["finish_reason"]) == (w["text"], w["finish_reason"])
        assert g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
        assert g["logprobs"]["token_logprobs"] == pytest.approx(w["logprobs"]["token_logprobs"], abs=1e-4)
    assert {k: got["usage"][k] for k in usage} == usage
    assert len({c["text"] for c in got["choices"]}) > len(PROMPTS)  # seeded choices differ: n is per prompt


@pytest.mark.parametrize("where", ["ref", "router"])
def test_token_id_prompts_and_lm_eval_scoring(pd, where):
    """lm-eval's loglikelihood request: token-id prompts, echo, logprobs, max_tokens 1."""
    url = pd["ref"].url if where == "ref" else pd.router.url
    ids = [[504, 1023, 29, 7], [88, 9, 300], [12, 13, 14, 15, 16]]
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True, "seed": 1234}
    got = complete(url, body)
    want, usage = alone(pd["ref"].url, body, ids)
    for g, w in zip(by_index(got), want):
        assert g["text"] == w["text"]
        assert g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
        assert g["logprobs"]["token_logprobs"][1:] == pytest.approx(w["logprobs"]["token_logprobs"][1:], abs=1e-5)
    assert got["usage"]["prompt_tokens"] == usage["prompt_tokens"] == sum(map(len, ids))


@pytest.mark.parametrize("where", ["ref", "router"])
def test_stream_interleaves_by_index_with_one_usage_chunk(pd, where):
    url = pd["ref"].url if where == "ref" else pd.router.url
    body = dict(SAMPLED, prompt=PROMPTS, stream=True, stream_options={"include_usage": True})
    status, raw = http("POST", url + "/v1/completions", body)
    assert status == 200, raw
    assert raw.decode().count("data: [DONE]") == 1 and raw.decode().rstrip().endswith("data: [DONE]")
    events = sse_events(raw)
    want, usage = alone(pd["ref"].url, dict(SAMPLED), PROMPTS)
    assert streamed_texts(events) == {w["index"]: w["text"] for w in want}
    finishes = {c["index"]: c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]}
    assert finishes == {w["index"]: w["finish_reason"] for w in want}
    usage_chunks = [e for e in events if e.get("usage")]
    assert len(usage_chunks) == 1 and usage_chunks[0] is events[-1] and usage_chunks[0]["choices"] == []
    assert {k: usage_chunks[0]["usage"][k] for k in usage} == usage


@pytest.mark.parametrize("where", ["ref", "router"])
def test_openai_client_batch(pd, where):
    url = pd["ref"].url if where == "ref" else pd.router.url
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    got = client.completions.create(model=None, prompt=PROMPTS[:2], max_tokens=6, temperature=0)
    want, _ = alone(pd["ref"].url, {"max_tokens": 6, "temperature": 0}, PROMPTS[:2])
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [w["text"] for w in want]


@pytest.mark.parametrize("where", ["ref", "router"])
def test_more_prompts_than_the_limit_is_a_400(pd, where):
    url = pd["ref"].url if where == "ref" else pd.router.url
    status, answer = post(url, {"prompt": ["a"] * 257, "max_tokens": 1})
    assert status == 400, answer
    assert answer["error"]["code"] == "limit_exceeded" and answer["error"]["param"] == "prompt"
    assert "--max-prompts" in answer["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("where", ["ref", "router"])
def test_one_refused_prompt_refuses_the_request(pd, where, stream):
    """A prompt longer than the context among good ones: a plain JSON 400, nothing leaks."""
    url = pd["ref"].url if where == "ref" else pd.router.url
    status, answer = post(url, {"prompt": [PROMPTS[0], [5] * (MAX_MODEL_LEN + 8), PROMPTS[1]], "max_tokens": 4,
                                "stream": stream})
    assert status == 400, answer
    assert answer["error"]["param"] == "prompt"


@pytest.mark.parametrize("where", ["ref", "router"])
def test_malformed_prompt_lists_are_400(pd, where):
    url = pd["ref"].url if where == "ref" else pd.router.url
    for prompt in (["ok", ""], ["ok", [1, "x"]], ["ok", []], []):
        status, answer = post(url, {"prompt": prompt, "max_tokens": 1})
        assert status == 400, (prompt, answer)
        assert answer["error"]["param"] == "prompt"
