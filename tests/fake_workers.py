"""The router's test harness on fake engines (benchmarks/fake_engine.py).

`LoopThread` runs servers on a background event loop, so that synchronous clients in
the test thread (the official `openai` client) can talk to them; `Cluster` is a router
(in-process) in front of fake prefill and decode engines on one LoopThread.
"""
from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest

from benchmarks.fake_engine import FakeEngine


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fake-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 20.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


class Reply(msgspec.Struct):
    status: int
    headers: dict
    body: bytes

    def json(self):
        return msgspec.json.decode(self.body)


async def http(method: str, url: str, json=None, headers: dict | None = None) -> Reply:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async with s.request(method, url, json=json, headers=headers) as r:
            return Reply(r.status, dict(r.headers), await r.read())


class Cluster:
    """A router (in-process) in front of fake prefill and decode engines, on one LoopThread."""

    def __init__(self, loop: LoopThread, n_prefill: int = 1, n_decode: int = 1, n_worker: int = 0, **router_kwargs):
        self.loop = loop
        self.prefill = [FakeEngine("prefill") for _ in range(n_prefill)]
        self.decode = [FakeEngine("decode") for _ in range(n_decode)]
        self.worker = [FakeEngine("decode") for _ in range(n_worker)]  # colocated: answers like a decode engine
        self.router_kwargs = router_kwargs
        self.router = None

    def start(self) -> "Cluster":
        from router.app import Router, RouterConfig

        async def start():
            for f in self.prefill + self.decode + self.worker:
                await f.start()
            config = RouterConfig(prefill=[f.url for f in self.prefill], decode=[f.url for f in self.decode],
                                  worker=[f.url for f in self.worker], port=0, **self.router_kwargs)
            self.router = Router(config)
            return await self.router.start()

        self.url = self.loop.run(start())
        return self

    def stop(self) -> None:
        async def stop():
            if self.router is not None:
                await self.router.stop()
            for f in self.prefill + self.decode + self.worker:
                if f._runner is not None:
                    f.gate.set()
                    f.hold_after_first_event.set()
                await f.stop()

        self.loop.run(stop())

    def request(self, method: str, path: str, json=None, headers: dict | None = None) -> Reply:
        return self.loop.run(http(method, self.url + path, json, headers))

    def post(self, path: str, json=None, headers: dict | None = None) -> Reply:
        return self.request("POST", path, json, headers)

    def get(self, path: str, headers: dict | None = None) -> Reply:
        return self.request("GET", path, headers=headers)


def wait_until(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    """Poll with a deadline (tests never sleep a fixed time)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def make(loop, request):
    """A fixture: `make(**kw)` starts a Cluster (no periodic health checks unless asked) and
    stops it at the test's end."""
    def make(**kw) -> Cluster:
        kw.setdefault("health_interval_s", 60)
        c = Cluster(loop, **kw).start()
        request.addfinalizer(c.stop)
        return c
    return make
