"""1000 concurrent streaming clients through the router (its own process) to fake engines
(their own process) on 127.0.0.1, for a bounded time: no error, no stuck connection,
router RSS flat. Marker `load`: not in `make test` (`make load` runs it, ~1 minute)."""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import sys
import time

import aiohttp
import pytest

from launch.process import RouterServer, ServerProcess, free_port, http

pytestmark = [pytest.mark.load, pytest.mark.timeout(300)]

ROOT = pathlib.Path(__file__).resolve().parents[1]
CLIENTS = 1000
DURATION_S = float(os.environ.get("ATOMD_LOAD_SECONDS", "30"))
TOKENS = 16
TOKEN_DELAY_S = 0.05  # a stream lasts ~0.8 s: the 1000 streams overlap


def rss_bytes(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def router_gauges(url: str) -> dict[str, float]:
    status, body = http("GET", url + "/metrics")
    assert status == 200
    out: dict[str, float] = {}
    for line in body.decode().splitlines():
        for name in ("atomd_router:worker_requests_in_flight", "atomd_router:requests_active",
                     "atomd_router:requests_queued"):
            if line.startswith(name):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_1000_concurrent_streams_no_error_no_stuck_connection_rss_flat(tmp_path):
    p_port, d_port = free_port(), free_port()
    fakes = ServerProcess([sys.executable, "-m", "benchmarks.fake_engine", "--prefill-port", str(p_port),
                           "--decode-port", str(d_port), "--tokens", str(TOKENS), "--token-delay-s", str(TOKEN_DELAY_S)],
                          f"http://127.0.0.1:{d_port}", "fake engines", log=tmp_path / "fakes.log", cwd=ROOT)
    router = RouterServer([f"http://127.0.0.1:{p_port}"], [f"http://127.0.0.1:{d_port}"], "--health-interval-s", "1",
                          log=tmp_path / "router.log", cwd=ROOT)
    try:
        fakes.wait_ready(30, path="/health")
        router.wait_ready(30)
        url = router.url + "/v1/completions"
        body = {"model": "fake-model", "prompt": "the quick brown fox", "max_tokens": TOKENS, "stream": True}
        counts = {"ok": 0, "errors": []}
        rss: list[tuple[float, int]] = []

        async def client(session: aiohttp.ClientSession, deadline: float) -> None:
            while time.monotonic() < deadline:
                try:
                    async with session.post(url, json=body) as r:
                        data = await r.read()
                    if r.status != 200 or not data.rstrip().endswith(b"data: [DONE]") or b'"error"' in data:
                        counts["errors"].append((r.status, data[-200:]))
                    elif data.count(b"\n\n") != TOKENS + 1:
                        counts["errors"].append(("events", data.count(b"\n\n")))
                    else:
                        counts["ok"] += 1
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    counts["errors"].append(repr(e))

        async def sample(stop: asyncio.Event, started: float) -> None:
            while not stop.is_set():
                rss.append((time.monotonic() - started, rss_bytes(router.pid)))
                try:
                    await asyncio.wait_for(stop.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass

        async def run() -> None:
            conn = aiohttp.TCPConnector(limit=0, force_close=False)
            timeout = aiohttp.ClientTimeout(total=60)
            async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
                started = time.monotonic()
                stop = asyncio.Event()
                sampler = asyncio.create_task(sample(stop, started))
                deadline = started + DURATION_S
                # every client must be done shortly after the deadline: a stuck stream fails here
                await asyncio.wait_for(asyncio.gather(*(client(session, deadline) for _ in range(CLIENTS))),
                                       DURATION_S + 90)
                stop.set()
                await sampler

        asyncio.run(run())
        assert not counts["errors"], (len(counts["errors"]), counts["errors"][:5])
        assert counts["ok"] >= CLIENTS  # every client got at least one full stream
        # nothing left in flight at the router once the clients are gone
        deadline = time.monotonic() + 10
        while any(router_gauges(router.url).values()):
            assert time.monotonic() < deadline, router_gauges(router.url)
            time.sleep(0.1)
        # RSS flat: after the warm-up third, the router grows by at most max(16 MiB, 10%)
        warm = [v for t, v in rss if t >= DURATION_S / 3]
        assert len(warm) >= 3, rss
        growth = max(warm) - warm[0]
        report = {"streams": counts["ok"], "streams_per_s": counts["ok"] / DURATION_S,
                  "rss_mib": [round(v / 2**20, 1) for _, v in rss]}
        print(json.dumps(report))
        assert growth <= max(16 << 20, 0.10 * warm[0]), report
    finally:
        router.stop()
        fakes.stop()
