"""Fuzzing `atomd serve`: schemathesis against its own /openapi.json, then hypothesis-made
bodies (wrong types, huge numbers, NaN, truncated JSON, deep nesting, invalid UTF-8).
Never a 5xx, never a hang, never a crashed engine; afterwards it still serves and every
KV block is free."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_fixtures import model_dir, start_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

REQUEST_TIMEOUT_S = 60.0  # a hang fails the test instead of stalling it
# Bound what one generated request may cost on two cores: the fuzzer explores the fields'
# types and ranges, not the engine's throughput.
MAX_TOKENS_CAP = 8


@pytest.fixture(scope="module")
def server():
    srv = start_server(model_dir())
    srv.baseline = srv.stats()["num_free_blocks"]
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


@schemathesis.hook
def map_body(ctx, body):
    """Keep generated generation requests cheap (small max_tokens, n, best_of)."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and body[key] > MAX_TOKENS_CAP:
                body[key] = MAX_TOKENS_CAP
        for key in ("n", "best_of"):
            if isinstance(body.get(key), int) and body[key] > 2:
                body[key] = 2
    return body


OPERATIONS = [("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/v1/models", "GET"),
              ("/health", "GET"), ("/ready", "GET")]


@pytest.mark.parametrize("path,method", OPERATIONS)
def test_schemathesis_finds_no_server_error(api_schema, path, method):
    operation = api_schema[path][method]

    @settings(max_examples=25 if method == "POST" else 3, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy())
    def check(case):
        response = case.call(timeout=REQUEST_TIMEOUT_S)
        assert response.status_code < 500, (case.body, response.text[:500])
        if response.status_code >= 400:  # every error is OpenAI-shaped JSON without a trace
            error = response.json()["error"]
            assert isinstance(error["message"], str) and "Traceback" not in error["message"]

    check()


def post_raw(url: str, data: bytes) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)
FIELDS = ["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n", "best_of", "stop", "seed",
          "logprobs", "logit_bias", "stream", "stream_options", "kv_transfer_params", "min_tokens",
          "presence_penalty", "repetition_penalty", "echo", "response_format", "data_parallel_rank"]


def deep(n: int) -> bytes:
    return b'{"prompt": ' + b"[" * n + b"]" * n + b"}"


bodies = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6).map(
        lambda d: json.dumps({**d, "max_tokens": MAX_TOKENS_CAP} if "max_tokens" not in d else d).encode()),
    st.binary(max_size=64),  # invalid UTF-8, not JSON at all
    st.builds(lambda d, cut: json.dumps(d).encode()[:cut],
              st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=4), st.integers(0, 40)),
    st.sampled_from([deep(2000), deep(100_000), b'{"prompt": "hi", "max_tokens": NaN}',
                     b'{"prompt": "hi", "max_tokens": 1e400}', b'{"prompt": "\xff\xfe"}',
                     b'{"prompt": "hi", "max_tokens": 99999999999999999999999}']),
)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=bodies)
def test_hypothesis_bodies_never_break_the_server(server, path, body):
    status, raw = post_raw(server.url + path, body)
    assert status < 500, (body[:200], raw[:300])
    if status >= 400:
        assert "error" in json.loads(raw)


def test_still_serving_and_no_block_leaked_after_the_fuzzing(server):
    status, raw = post_raw(server.url + "/v1/completions",
                           json.dumps({"prompt": "def f(x):", "max_tokens": 4, "temperature": 0}).encode())
    assert status == 200, raw
    server.wait_idle(server.baseline)
    assert server.alive()


@pytest.mark.unit
def test_the_openapi_description_is_made_from_the_request_structs():
    from atomd import protocol as P
    from atomd.openapi import openapi_document

    doc = openapi_document("0")
    schemas = doc["components"]["schemas"]
    for struct in (P.CompletionRequest, P.ChatCompletionRequest):
        assert set(schemas[struct.__name__]["properties"]) == set(struct.__struct_fields__)
    completions = doc["paths"]["/v1/completions"]["post"]
    assert completions["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/CompletionRequest")
    assert {"200", "400", "503"} <= set(completions["responses"])


@pytest.fixture(scope="module")
def router(server):
    """The router in front of the real engine (a colocated --worker: one leg)."""
    from launch.process import RouterServer
    from tests.server_fixtures import REPO, START_TIMEOUT_S, server_log

    srv = RouterServer((), (), "--worker", server.url, log=server_log(), cwd=REPO).wait_ready(START_TIMEOUT_S)
    yield srv
    srv.stop()


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=bodies)
def test_hypothesis_bodies_never_break_the_router(router, path, body):
    """The same bodies through the router: a malformed one is the router's own 400, a
    well-formed one the engine's answer; never a 5xx."""
    status, raw = post_raw(router.url + path, body)
    assert status < 500, (body[:200], raw[:300])
