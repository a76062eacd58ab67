"""/v1/embeddings (issue 40): `atomd serve --task embed` pools the final-normed hidden states
of each input through the scheduler; the reference is Hugging Face transformers on the same
checkpoint (`output_hidden_states`, its last entry: after the final norm), pooled the same
way in float64. Last-token and mean pooling, normalised or not, floats or base64, several
inputs per request (a chunked prefill and a repeated prompt for mean pooling), the official
`openai` client, the router; bounded and refused inputs; no block leaked."""
from __future__ import annotations

import base64
import json

import numpy as np
import openai
import pytest
import torch
import transformers

from launch.process import RouterServer, http
from tests.server_fixtures import REPO, START_TIMEOUT_S, ServerUnderTest, model_dir, server_log

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TEXTS = ["def fibonacci(n):\n    return n", "import os", "class Stack:\n    def push(self, x):\n        " * 6]


@pytest.fixture(scope="module")
def servers():
    """last pooling, and mean pooling with a small step budget (long inputs prefill in chunks)."""
    started = {}
    try:
        started["last"] = ServerUnderTest(model_dir(), "--task", "embed")
        started["mean"] = ServerUnderTest(model_dir(), "--task", "embed", "--pooling-type", "mean",
                                          "--max-num-batched-tokens", "32")
        for srv in started.values():
            srv.wait_ready()
        started["router"] = RouterServer((), (), "--worker", started["last"].url, log=server_log(),
                                         cwd=REPO).wait_ready(START_TIMEOUT_S)
        for name in ("last", "mean"):
            started[name].baseline = started[name].stats()["num_total_blocks"]
        yield started
    finally:
        for srv in started.values():
            srv.stop()


@pytest.fixture(autouse=True)
def settled(servers):
    yield
    for name in ("last", "mean"):
        servers[name].wait_idle(servers[name].baseline)


@pytest.fixture(scope="module")
def hf():
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir()))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir()), torch_dtype=torch.float32).eval()
    return tok, model


def reference(hf, ids: list[int], pooling: str, normalize: bool) -> np.ndarray:
    _, model = hf
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].double().numpy()
    v = hidden[-1] if pooling == "last" else hidden.mean(axis=0)
    return v / np.linalg.norm(v) if normalize else v


def embed(url: str, body: dict) -> dict:
    status, raw = http("POST", url + "/v1/embeddings", body)
    assert status == 200, raw
    return json.loads(raw)


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("normalize", [True, False])
def test_embeddings_equal_hf_pooling(servers, hf, pooling, normalize):
    tok, _ = hf
    ids = [tok(t)["input_ids"] for t in TEXTS]
    assert len(ids[2]) > 32  # mean: prefilled in several chunks
    got = embed(servers[pooling].url, {"input": TEXTS, "normalize": normalize})
    assert [d["index"] for d in got["data"]] == [0, 1, 2]
    assert got["usage"]["prompt_tokens"] == sum(map(len, ids))
    for d, want_ids in zip(got["data"], ids):
        want = reference(hf, want_ids, pooling, normalize)
        np.testing.assert_allclose(d["embedding"], want, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(want).max()))


def test_token_ids_base64_and_a_repeated_prompt(servers, hf):
    """Token-id inputs; base64 (float32 little-endian) equals the floats; mean pooling takes no
    prefix-cache hit, so the same long prompt twice embeds the same."""
    tok, _ = hf
    ids = tok(TEXTS[2])["input_ids"]
    url = servers["mean"].url
    floats = embed(url, {"input": [ids, ids]})["data"]
    b64 = embed(url, {"input": ids, "encoding_format": "base64"})["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(b64), dtype="<f4")
    np.testing.assert_allclose(decoded, floats[0]["embedding"], rtol=1e-6)
    np.testing.assert_allclose(floats[1]["embedding"], floats[0]["embedding"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(floats[0]["embedding"], reference(hf, ids, "mean", True), atol=1e-4)


@pytest.mark.parametrize("where", ["last", "router"])
def test_openai_client(servers, hf, where):
    client = openai.OpenAI(base_url=servers[where].url + "/v1", api_key="none", max_retries=0)
    got = client.embeddings.create(model=None, input=TEXTS[:2])  # the client asks for base64 and decodes it
    tok, _ = hf
    for d, text in zip(got.data, TEXTS[:2]):
        np.testing.assert_allclose(d.embedding, reference(hf, tok(text)["input_ids"], "last", True), atol=1e-4)
    floats = client.embeddings.create(model=None, input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, got.data[0].embedding, rtol=1e-6)


def test_inputs_count_in_the_request_metrics_of_engine_and_router(servers, hf):
    """Each input is a finished request in atomd:request_success (reason stop, as vLLM's pooling
    requests) with its tokens (the HF tokenizer's count) in atomd:prompt_tokens; the router counts
    the request under endpoint="embeddings"."""
    from tests.pd_fixtures import metric

    tok, _ = hf
    engine, router = servers["last"], servers["router"]

    def counts():
        return (metric(engine, "atomd:request_success_total", finished_reason="stop"),
                metric(engine, "atomd:prompt_tokens_total"),
                metric(router, "atomd_router:requests_total", endpoint="embeddings", status="200"),
                metric(router, "atomd_router:requests_total", endpoint="embeddings", status="400"))
    before = counts()
    for base in (engine.url, router.url):
        status, raw = http("POST", base + "/v1/embeddings", {"input": TEXTS[:2]})
        assert status == 200, raw
    assert http("POST", router.url + "/v1/embeddings", {"input": ""})[0] == 400
    after = counts()
    tokens = sum(len(tok(t)["input_ids"]) for t in TEXTS[:2])
    assert [a - b for a, b in zip(after, before)] == [4, 2 * tokens, 1, 1]


@pytest.mark.parametrize("body,param,code", [
    ({"input": "x", "dimensions": 8}, "dimensions", "unsupported_field"),
    ({"input": ["x"] * 257}, "input", "limit_exceeded"),
    ({"input": [1, 2, 10 ** 6]}, "input", "invalid_value"),
    ({"input": "x " * 400}, "input", "invalid_value"),
    ({"input": ""}, "input", "invalid_value"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", "invalid_value"),
    ({"input": "x", "nope": 1}, "nope", "unknown_field"),
])
def test_bad_inputs_are_400(servers, body, param, code):
    for where in ("last", "router"):
        status, raw = http("POST", servers[where].url + "/v1/embeddings", body)
        assert status == 400, raw
        error = json.loads(raw)["error"]
        assert (error["param"], error["code"]) == (param, code), error


def test_a_simulated_engine_serves_embeddings(tmp_path):
    """`--model-runner simulated --task embed`: the official client gets a unit vector of the
    model's hidden size for each input, the one the simulated engine pools in-process (its
    pseudo-embedding, normalised here by numpy), the same for the same input."""
    from atomd.config import EngineConfig
    from atomd.sim.engine import SimulatedEngine
    from contracts.sampling import SamplingParams
    from tests.sim_fixtures import default_model_profile, sim_flags

    profile = default_model_profile(tmp_path / "profile.json")
    hidden = json.loads((model_dir() / "config.json").read_text())["hidden_size"]
    srv = ServerUnderTest(model_dir(), *sim_flags(profile), "--task", "embed")
    try:
        srv.wait_ready()
        baseline = srv.stats()["num_total_blocks"]
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        got = client.embeddings.create(model=None, input=[TEXTS[0], TEXTS[1], TEXTS[0]])
        vectors = [np.array(d.embedding) for d in got.data]
        assert all(v.shape == (hidden,) and abs(np.linalg.norm(v) - 1) < 1e-5 for v in vectors)
        np.testing.assert_array_equal(vectors[0], vectors[2])
        assert not np.allclose(vectors[0], vectors[1])
        assert got.usage.prompt_tokens > 0
        srv.wait_idle(baseline)
    finally:
        srv.stop()
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir()))
    engine = SimulatedEngine(EngineConfig(model_runner="simulated", hardware=str(profile)))
    engine.add_request("x", tok(TEXTS[0])["input_ids"], SamplingParams(max_tokens=1, temperature=0.0, pooling="last"))
    while engine.has_unfinished_requests():
        out = [o for o in engine.step() if o.finished]
        if out:
            want = np.array(out[0].embedding, dtype=np.float64)
    np.testing.assert_allclose(vectors[0], want / np.linalg.norm(want), rtol=1e-5, atol=1e-6)
