"""Fuzzing `atomd serve` and the router: schemathesis against each one's own /openapi.json
(the router's: its OpenAI routes, relayed to the real engine, and its own operations,
/workers writes included), then hypothesis-made bodies (wrong types, huge numbers, NaN,
truncated JSON, deep nesting, invalid UTF-8) to both. Never a 5xx, never a hang, never a
crashed engine, no trace or internal path in an error body; afterwards both still serve
and every KV block is free."""
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
ROUTER_ADMIN_KEY = "fuzz-admin-key"  # the fuzzer holds it: /workers writes get parsed, not just refused
ADMIN = {"Authorization": f"Bearer {ROUTER_ADMIN_KEY}"}
LEAKS = ("Traceback", "/work", '.py"', "site-packages", 'File "')
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
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if isinstance(body.get(key), int) and body[key] > MAX_TOKENS_CAP:
                body[key] = MAX_TOKENS_CAP
        for key in ("n", "best_of"):
            if isinstance(body.get(key), int) and body[key] > 2:
                body[key] = 2
    return body


OPERATIONS = [("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/v1/models", "GET"),
              ("/health", "GET"), ("/ready", "GET"), ("/tokenize", "POST"), ("/detokenize", "POST"),
              ("/tokenizer_info", "GET"), ("/v1/responses", "POST"), ("/v1/embeddings", "POST")]


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


def assert_clean_error(status: int, text: str) -> None:
    """An error answer: OpenAI-shaped JSON, no trace, no internal path."""
    assert 400 <= status < 500, (status, text[:500])
    for leak in LEAKS:
        assert leak not in text, text[:500]
    error = json.loads(text)["error"]
    assert isinstance(error["message"], str)


def post_raw(url: str, data: bytes, method: str = "POST", headers: dict | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
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
    from atomd.api import protocol
    from atomd.api.openapi import openapi_document

    doc = openapi_document("0")
    schemas = doc["components"]["schemas"]
    for struct in (protocol.CompletionRequest, protocol.ChatCompletionRequest):
        assert set(schemas[struct.__name__]["properties"]) == set(struct.__struct_fields__)
    completions = doc["paths"]["/v1/completions"]["post"]
    assert completions["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/CompletionRequest")
    assert {"200", "400", "503"} <= set(completions["responses"])


@pytest.fixture(scope="module")
def router(server):
    """The router in front of the real engine (a colocated --worker: one leg)."""
    from launch.process import RouterServer
    from tests.server_fixtures import REPO, START_TIMEOUT_S, server_log

    srv = RouterServer((), (), "--worker", server.url, "--admin-api-key", ROUTER_ADMIN_KEY, log=server_log(),
                       cwd=REPO).wait_ready(START_TIMEOUT_S)
    yield srv
    srv.stop()


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=bodies)
def test_hypothesis_bodies_never_break_the_router(router, path, body):
    """The same bodies through the router: a malformed one is the router's own 400, a
    well-formed one the engine's answer; never a 5xx."""
    status, raw = post_raw(router.url + path, body)
    assert status < 500, (body[:200], raw[:300])


# ---------------------------------------------------------------------- the router's own /openapi.json


def router_operations() -> list[tuple[str, str]]:
    from router.openapi import openapi_document

    return [(path, method.upper()) for path, item in sorted(openapi_document()["paths"].items())
            for method in sorted(item)]


@pytest.fixture(scope="module")
def router_schema(router):
    return schemathesis.openapi.from_url(router.url + "/openapi.json")


@pytest.mark.parametrize("path,method", router_operations())
def test_schemathesis_finds_no_server_error_in_the_router(router_schema, router, path, method):
    """Every operation the router describes, with the admin key (so POST / DELETE /workers
    bodies are decoded and checked, not refused at the door)."""
    operation = router_schema[path][method]

    @settings(max_examples=25 if method in ("POST", "DELETE") else 3, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy())
    def check(case):
        response = case.call(timeout=REQUEST_TIMEOUT_S, headers=ADMIN)
        assert response.status_code < 500, (case.body, response.text[:500])
        if response.status_code >= 400:
            assert_clean_error(response.status_code, response.text)

    check()


MALFORMED = [  # (method, path, body): each answered by a clean 4xx
    ("POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": '),
    ("POST", "/v1/completions", b"\xff\xfe\x00{"),
    ("POST", "/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("POST", "/v1/completions", b'{"prompt": {"a": 1}, "max_tokens": -1}'),
    ("POST", "/v1/completions", b'{"prompt": "hi", "no_such_field": 1}'),
    ("POST", "/v1/chat/completions", b'{"messages": "hi"}'),
    ("POST", "/v1/chat/completions", b'[1, 2, 3]'),
    ("GET", "/v1/completions", None),
    ("GET", "/no/such/route", None),
    ("POST", "/kv_transfer/abort", b'{"transfer_id": 7}'),
    ("POST", "/kv_transfer/abort", b"not json"),
    ("POST", "/workers", b'{"url": 7, "role": "decode"}'),
    ("POST", "/workers", b'{"url": "http://x:1/path", "role": "decode"}'),
    ("DELETE", "/workers", b"[]"),
]


@pytest.mark.parametrize("target", ["engine", "router"])
def test_malformed_requests_get_errors_without_traces_or_paths(server, router, target):
    base = (server if target == "engine" else router).url
    for method, path, body in MALFORMED:
        if (target, path) in (("engine", "/workers"), ("router", "/kv_transfer/abort")):
            continue  # not a route there (the 404 is checked with /no/such/route)
        status, raw = post_raw(base + path, body, method, ADMIN if target == "router" else None)
        assert_clean_error(status, raw.decode("utf-8", "replace"))


def test_the_router_still_serves_after_the_fuzzing_and_no_block_leaked(server, router):
    status, raw = post_raw(router.url + "/v1/completions",
                           json.dumps({"prompt": "def f(x):", "max_tokens": 4, "temperature": 0}).encode())
    assert status == 200, raw
    status, raw = post_raw(router.url + "/workers", None, "GET", ADMIN)
    assert status == 200 and server.url in [w["url"] for w in json.loads(raw)["workers"]]
    server.wait_idle(server.baseline)
    assert server.alive() and router.alive()


@pytest.mark.unit
def test_the_router_openapi_surface_is_current():
    """router/openapi_surface.json is what the engines' structs describe now."""
    from atomd.api.openapi import ROUTER_SURFACE, render_router_surface

    assert ROUTER_SURFACE.read_text() == render_router_surface(), "run: python -m atomd.api.openapi"


@pytest.mark.unit
def test_the_router_openapi_describes_every_route_and_its_structs():
    import asyncio

    from atomd.api.openapi import openapi_document as engine_document
    from router.app import Router, RouterConfig
    from router.openapi import AddWorker, RemoveWorker, openapi_document

    doc = openapi_document()
    assert openapi_document() is doc  # built once per process

    async def routes():
        router = Router(RouterConfig())
        try:
            return {(r.resource.canonical, r.method) for r in router.app.router.routes()}
        finally:
            await router.stop()

    described = {(path, method.upper()) for path, item in doc["paths"].items() for method in item}
    assert described == asyncio.run(routes())
    engine = engine_document("0")
    for path in ("/v1/completions", "/v1/chat/completions"):  # the engines' request structs, one source
        assert doc["paths"][path]["post"]["requestBody"] == engine["paths"][path]["post"]["requestBody"]
        assert {"429", "502", "504"} <= set(doc["paths"][path]["post"]["responses"])
    schemas = doc["components"]["schemas"]
    assert schemas["CompletionRequest"] == engine["components"]["schemas"]["CompletionRequest"]
    for struct in (AddWorker, RemoveWorker):
        assert set(schemas[struct.__name__]["properties"]) == set(struct.__struct_fields__)
    workers = doc["paths"]["/workers"]
    assert workers["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/AddWorker")
    schemathesis.openapi.from_dict(doc)  # loads as OpenAPI


content_parts = st.lists(st.fixed_dictionaries({}, optional={"type": json_values, "text": json_values}), max_size=3)
messages = st.lists(st.fixed_dictionaries({}, optional={"role": json_values,
                                                        "content": st.one_of(json_values, content_parts)}), max_size=3)
route_bodies = st.fixed_dictionaries({}, optional={"messages": st.one_of(json_values, messages), "prompt": json_values,
                                                   "stream": json_values, "max_tokens": json_values})


@pytest.mark.unit
@pytest.mark.parametrize("name", sorted(__import__("router.policies", fromlist=["POLICIES"]).POLICIES))
def test_every_routing_policy_takes_any_json_object(name):
    """The router reads the prompt of a body the engine has not checked yet (to route it):
    whatever JSON object a client sends, every policy picks a worker, nothing raises (a
    chat content part whose text was null once made the router answer 500)."""
    from types import SimpleNamespace

    from router.kv_index import KVIndex
    from router.policies import RouteRequest, make_policy

    policy = make_policy(name, kv_index=KVIndex(stale_s=5))
    workers = [SimpleNamespace(url=f"http://w{i}:1", name=f"w{i}", in_flight=0, in_flight_tokens=0) for i in range(3)]

    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=route_bodies)
    def check(body):
        route = RouteRequest(body, {"x-session-id": "s"})
        assert policy.choose(workers, route) in workers
        assert isinstance(route.text, str) and route.leg_tokens("decode") >= 0

    check()
