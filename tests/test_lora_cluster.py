"""LoRA adapters across a cluster, the parts with no engine to start (issue #39): a DP engine's
load that one rank refuses leaves no rank holding the adapter; cache_aware keeps one prefix
tree per adapter; placement prefers the engines holding the adapter in memory; /v1/models
through the router lists the adapters a request can be served under; the router's load
route's answer when engines fail. The engines' side of these is in tests/test_lora_serve.py."""
from __future__ import annotations

import asyncio

import msgspec
import pytest

from atomd.api.core_client import DPEngineClient
from router import lora_admin
from router.pd import with_adapter
from router.policies import CacheAware, RouteRequest
from router.workers import WorkerRegistry

pytestmark = pytest.mark.unit


class Rank:
    """A DP rank's core as the API process sees it: utility calls load / unload names."""

    def __init__(self, refuse: bool = False, silent: bool = False):
        self.loaded: set[str] = set()
        self.refuse, self.silent = refuse, silent

    async def call(self, method: str, *args, timeout_s: float = 5.0):
        if method == "load_lora_adapter":
            if self.silent:
                self.loaded.add(args[0])  # it loads, but its answer never comes in time
                raise asyncio.TimeoutError()
            if self.refuse:
                return {"error": f"LoRA adapter {args[0]!r}: not a PEFT adapter directory", "status": 400}
            self.loaded.add(args[0])
            return {"name": args[0]}
        if method == "unload_lora_adapter":
            if args[0] not in self.loaded:
                return {"error": f"LoRA adapter {args[0]!r} is not loaded", "status": 404}
            self.loaded.discard(args[0])
            return {"name": args[0]}
        raise AssertionError(method)


def dp_client(ranks: list[Rank]) -> DPEngineClient:
    client = DPEngineClient.__new__(DPEngineClient)  # its ranks only: no core process
    client.ranks = ranks
    return client


@pytest.mark.parametrize("failing", [Rank(refuse=True), Rank(silent=True)], ids=["refuses", "silent"])
def test_a_dp_load_one_rank_fails_leaves_no_rank_holding_it(failing):
    ranks = [Rank(), failing, Rank()]
    answer = asyncio.run(dp_client(ranks).call("load_lora_adapter", "sql", "/adapters/sql", timeout_s=1.0))
    assert answer["status"] in (400, 503) and "DP rank 1" in answer["error"] and "no rank keeps" in answer["error"]
    assert [r.loaded for r in ranks] == [set(), set(), set()]


def test_a_dp_load_every_rank_takes_is_on_every_rank():
    ranks = [Rank(), Rank()]
    assert asyncio.run(dp_client(ranks).call("load_lora_adapter", "sql", "/adapters/sql")) == {"name": "sql"}
    assert [r.loaded for r in ranks] == [{"sql"}, {"sql"}]


class W:
    def __init__(self, url: str, loras=None, resident=(), in_flight: int = 0):
        self.url, self.in_flight, self.in_flight_tokens = url, in_flight, 0
        self.loras = frozenset(loras) if loras is not None else None
        self.loras_resident = frozenset(resident)


def route(text: str, model: str | None = None) -> RouteRequest:
    return RouteRequest({"prompt": text, **({"model": model} if model else {})})


def test_cache_aware_keys_its_tree_by_adapter():
    a, b = W("http://a:1", {"sql", "poet"}), W("http://b:1", {"sql", "poet"})
    policy = CacheAware(cache_threshold=0.5)
    text = "You are a helpful assistant. Translate the following table into SQL: " * 3

    def place(model):
        req = route(text, model)
        return policy.choose(with_adapter([a, b], req), req)

    first = place("sql")
    assert place("sql") is first  # the same adapter's requests go where its prefix is
    other = place("poet")  # the same text under another adapter shares no prefix: a miss, to the smaller tree
    assert other is not first
    assert place("poet") is other and place("sql") is first
    base = place(None)  # the base model is a tree of its own too
    assert place(None) is base
    assert set(policy.trees) == {None, "sql", "poet"}
    policy.forget(first.url)
    assert all(t.size(first.url) == 0 for t in policy.trees.values())


def test_placement_prefers_engines_holding_the_adapter_in_memory():
    evicted = W("http://a:1", {"sql", "poet"}, resident={"poet"})
    holding = W("http://b:1", {"sql", "poet"}, resident={"sql"})
    plain = W("http://c:1", None)
    req = route("x", "sql")
    assert with_adapter([evicted, holding, plain], req) == [holding] and req.lora == "sql"
    req = route("x", "math")  # nobody serves it: any worker (the engine answers the 404)
    assert with_adapter([evicted, holding, plain], req) == [evicted, holding, plain] and req.lora is None
    req = route("x", "sql")  # known but resident nowhere: any engine that knows it
    evicted.loras_resident = holding.loras_resident = frozenset()
    assert with_adapter([evicted, holding, plain], req) == [evicted, holding]


def registry(**roles: list[W]) -> WorkerRegistry:
    reg = WorkerRegistry()
    for role, workers in roles.items():
        for w in workers:
            worker, _ = reg.add(w.url, role)
            worker.healthy, worker.loras = True, w.loras
    return reg


ENGINE_MODELS = msgspec.json.encode({"object": "list", "data": [
    {"id": "base", "object": "model", "created": 1, "owned_by": "atomd", "max_model_len": 64},
    {"id": "sql", "object": "model", "created": 1, "owned_by": "atomd", "max_model_len": 64, "parent": "base",
     "root": "/adapters/sql"}]})


def test_models_lists_an_adapter_only_where_a_request_can_be_served():
    asyncio.run(models_listing())  # a registry's connection pools live on a loop


async def models_listing():
    # PD: an adapter on D but not on P is not servable; on both it is
    reg = registry(prefill=[W("http://p:1", {"sql", "poet"})], decode=[W("http://d:1", {"sql", "math"})])
    assert lora_admin.servable(reg) == {"sql"}
    cards = msgspec.json.decode(lora_admin.models_body(ENGINE_MODELS, reg))["data"]
    assert [c["id"] for c in cards] == ["base", "sql"] and cards[1]["root"] == "/adapters/sql"
    # no prefill worker in rotation: D computes the prompt, its adapters are servable
    reg = registry(decode=[W("http://d:1", {"math", "sql"})])
    cards = msgspec.json.decode(lora_admin.models_body(ENGINE_MODELS, reg))["data"]
    assert [(c["id"], c["parent"] if "parent" in c else None) for c in cards] == [
        ("base", None), ("math", "base"), ("sql", "base")]
    # colocated workers: the union; engines without --enable-lora: the answer as it came
    reg = registry(worker=[W("http://w:1", {"a"}), W("http://w:2", {"b"})])
    assert lora_admin.servable(reg) == {"a", "b"}
    reg = registry(worker=[W("http://w:1", None)])
    assert lora_admin.models_body(ENGINE_MODELS, reg) == ENGINE_MODELS


def test_the_load_answer_names_every_engine_that_failed():
    req = lora_admin.parse(b'{"lora_name": "sql", "lora_path": "/adapters/sql"}', load=True)
    ok = {"url": "http://p:1", "role": "prefill", "ok": True, "status": 200, "message": "done"}
    bad = {"url": "http://d:1", "role": "decode", "ok": False, "status": 400, "message": "not a PEFT adapter directory"}
    down = {"url": "http://d:2", "role": "decode", "ok": False, "status": None, "message": "unreachable: refused"}
    assert lora_admin.failure(req, True, [ok]) is None
    status, code, message = lora_admin.failure(req, True, [ok, bad, down])
    assert (status, code) == (502, "lora_partial_failure")
    assert "2 of 3" in message and "http://d:1" in message and "http://d:2" in message and "http://p:1" not in message
    status, code, message = lora_admin.failure(req, True, [bad, dict(bad, url="http://d:3")])
    assert (status, code) == (400, "lora_load_refused") and "every engine" in message


@pytest.mark.parametrize("body", [b'{"lora_name": "sql"}', b'{"lora_name": "a b", "lora_path": "/x"}',
                                  b'{"lora_name": "sql", "lora_path": "/x", "role": "gpu"}',
                                  b'{"lora_name": "sql", "lora_path": "/x", "extra": 1}', b"[", b""])
def test_a_bad_load_body_is_a_value_error_naming_it(body):
    with pytest.raises(ValueError):
        lora_admin.parse(body, load=True)


def test_the_routers_lora_routes_take_only_the_admin_key():
    from launch.process import http
    from router.app import Router, RouterConfig

    async def main():
        router = Router(RouterConfig(port=0, api_key="client-key", admin_api_key="admin-key"))
        url = await router.start()
        loop = asyncio.get_running_loop()
        body = {"lora_name": "sql", "lora_path": "/adapters/sql"}
        try:
            answers = {}
            for who, key in (("none", None), ("client", "client-key"), ("admin", "admin-key")):
                headers = {"Authorization": f"Bearer {key}"} if key else None
                answers[who] = await loop.run_in_executor(None, lambda h=headers: http(
                    "POST", url + "/v1/load_lora_adapter", body, h, timeout=10))
            return answers
        finally:
            await router.stop()

    answers = asyncio.run(main())
    assert answers["none"][0] == 401 and answers["client"][0] == 401
    status, raw = answers["admin"]  # past the door: no worker to load it on, named
    assert status == 400 and msgspec.json.decode(raw)["error"]["code"] == "no_worker"
