"""The router's priority queue (issue 40): how long an urgent request waits behind a backlog.

An in-process router (`--max-concurrent-requests 4`) in front of fake P and D engines
(benchmarks/fake_engine.py; D streams 8 tokens `--token-delay-s` apart). Each round sends a
backlog of `--backlog` requests at priority 1, waits until they queue, then one probe request,
twice: at priority 0 (urgent: admitted at the next free slot) and at priority 1 (the baseline:
first come first served, behind the whole backlog), the two alternating first. Reports the
probe's latency (median over rounds) and the ratio urgent / baseline, and the backlog's drain
time (all priority-1 requests in, all answers out), with the load average and the CPU.

Run: `.venv/bin/python -m benchmarks.router_priority --rounds 3`.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import aiohttp

from benchmarks.fake_engine import FakeEngine
from benchmarks.machine import cpu_model, loadavg
from router.app import Router, RouterConfig

TOKENS = tuple(f" t{i}" for i in range(8))


async def one(session: aiohttp.ClientSession, url: str, priority: int) -> float:
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json={
            "model": "fake-model", "prompt": "the quick brown fox", "max_tokens": 8, "stream": True,
            "priority": priority}) as r:
        await r.read()
        assert r.status == 200, r.status
    return time.perf_counter() - t0


async def backlog_then_probe(router: Router, session, n: int, probe_priority: int) -> tuple[float, float]:
    """(the probe's latency, the whole backlog's drain time)."""
    t0 = time.perf_counter()
    backlog = [asyncio.create_task(one(session, router.url, 1)) for _ in range(n)]
    cap = router.config.max_concurrent_requests
    while router.admission.state()[1] < n - cap:  # the backlog is queued behind the cap
        await asyncio.sleep(0.001)
    probe = await one(session, router.url, probe_priority)
    await asyncio.gather(*backlog)
    return probe, time.perf_counter() - t0


async def main(args: argparse.Namespace) -> None:
    p, d = FakeEngine("prefill", TOKENS, record=False), FakeEngine("decode", TOKENS, record=False)
    d.token_delay_s = args.token_delay_s
    await p.start()
    await d.start()
    router = Router(RouterConfig(prefill=[p.url], decode=[d.url], port=0, max_concurrent_requests=4,
                                 max_queued_requests=4 * args.backlog, queue_timeout_s=600))
    await router.start()
    results: dict[int, list[tuple[float, float]]] = {0: [], 1: []}
    loads = [loadavg()]
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await backlog_then_probe(router, session, 8, 0)  # warm up the connections
            for r in range(args.rounds):
                for priority in ((0, 1) if r % 2 == 0 else (1, 0)):
                    results[priority].append(await backlog_then_probe(router, session, args.backlog, priority))
                loads.append(loadavg())
    finally:
        await router.stop()
        await p.stop()
        await d.stop()
    urgent = statistics.median(x[0] for x in results[0])
    fcfs = statistics.median(x[0] for x in results[1])
    drain = statistics.median(x[1] for x in results[0] + results[1])
    print(f"CPU: {cpu_model()}; load before/after rounds: {' | '.join(loads)}")
    print(f"backlog {args.backlog} at priority 1, cap 4, D token delay {args.token_delay_s * 1000:.1f} ms, "
          f"{args.rounds} rounds")
    print("| probe | latency (median) | per round |")
    print("|---|---:|---|")
    for name, prio in (("priority 0 (urgent)", 0), ("priority 1 (FCFS, baseline)", 1)):
        rounds = ", ".join(f"{x[0] * 1000:.0f}" for x in results[prio])
        print(f"| {name} | {statistics.median(x[0] for x in results[prio]) * 1000:.0f} ms | {rounds} ms |")
    print(f"urgent / baseline: {urgent / fcfs:.3f}; backlog drain (median): {drain * 1000:.0f} ms")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backlog", type=int, default=64)
    ap.add_argument("--token-delay-s", type=float, default=0.002)
    asyncio.run(main(ap.parse_args()))
