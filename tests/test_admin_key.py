"""Admin routes of an engine (`--admin-api-key`): /reset_prefix_cache, /kv_transfer/abort, the
LoRA load / unload routes and /debug/* take the admin key and never a client key; client routes never take the admin key;
the router carries the engines' admin key on its aborts (`--engine-admin-api-key`)."""
from __future__ import annotations

import pytest
from aiohttp import web

from benchmarks.fake_engine import FakeEngine
from launch.process import http
from tests.fake_workers import Cluster, LoopThread, wait_until
from tests.server_fixtures import model_dir, start_server

CLIENT, ADMIN = "sk-client", "sk-admin"


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def engine():
    srv = start_server(model_dir(), "--api-key", CLIENT, "--admin-api-key", ADMIN)
    yield srv
    srv.stop()


@pytest.mark.integration
@pytest.mark.timeout(180)
@pytest.mark.parametrize("method,path,body", [("GET", "/debug/stats", None), ("POST", "/reset_prefix_cache", None),
                                              ("POST", "/kv_transfer/abort", {"transfer_id": "t1"})])
def test_admin_routes_take_only_the_admin_key(engine, method, path, body):
    for headers in ({}, bearer(CLIENT), bearer("wrong")):
        status, raw = http(method, engine.url + path, body, headers=headers)
        assert status == 401 and b"invalid_admin_key" in raw, (headers, raw)
    status, raw = http(method, engine.url + path, body, headers=bearer(ADMIN))
    assert status == 200, raw


@pytest.mark.integration
@pytest.mark.timeout(180)
@pytest.mark.parametrize("path", ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"])
def test_lora_admin_routes_take_only_the_admin_key(engine, path):
    body = {"lora_name": "a", "lora_path": "/nonexistent"}
    for headers in ({}, bearer(CLIENT)):
        status, raw = http("POST", engine.url + path, body, headers=headers)
        assert status == 401 and b"invalid_admin_key" in raw, (headers, raw)
    status, raw = http("POST", engine.url + path, body, headers=bearer(ADMIN))  # past auth: this engine has no LoRA
    assert status == 400 and b"without --enable-lora" in raw, raw


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_client_routes_take_only_the_client_key(engine):
    body = {"prompt": "def f(x):", "max_tokens": 2}
    assert http("POST", engine.url + "/v1/completions", body, headers=bearer(ADMIN))[0] == 401
    assert http("POST", engine.url + "/v1/completions", body, headers=bearer(CLIENT))[0] == 200
    assert http("GET", engine.url + "/health")[0] == 200  # probes stay open


class AdminKeyedPrefill(FakeEngine):
    """A prefill engine that, like `atomd serve --admin-api-key`, wants the admin key on aborts."""

    async def abort(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {ADMIN}":
            return web.json_response({"error": {"message": "missing or invalid admin API key"}}, status=401)
        return await super().abort(request)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_the_router_aborts_with_the_engines_admin_key():
    loop = LoopThread()
    cluster = Cluster(loop, api_key=CLIENT, engine_admin_api_key=ADMIN)
    cluster.prefill = [AdminKeyedPrefill("prefill")]
    try:
        cluster.start()
        cluster.decode[0].fail_status = 500  # D fails: nobody pulls P's blocks, the router aborts them
        reply = cluster.post("/v1/completions", {"prompt": "a b c", "max_tokens": 2}, headers=bearer(CLIENT))
        assert reply.status == 502
        wait_until(lambda: len(cluster.prefill[0].aborts) == 1, 5, "the admin-keyed abort")
    finally:
        cluster.stop()
        loop.close()
