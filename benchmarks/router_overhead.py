"""What the router costs: added latency at concurrency 1 and throughput at concurrency 64.

Zero-delay fake engines (benchmarks/fake_engine.py, one process) stand in for P and D, so every
millisecond measured is HTTP and relay work. In one run, with the same load generator:

  direct D     the client calls the fake decode worker itself (one leg, the floor)
  direct P+D   the client runs both legs itself, back to back (what any PD relay must do)
  router       the client calls `python -m router` (its own process), which runs both legs

Reported: p50/p99 latency at c=1, req/s at c=64, for streamed (SSE, 4 tokens) and
non-streamed completions. Run: `.venv/bin/python -m benchmarks.router_overhead`.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time

import aiohttp
import uvloop

from benchmarks.fake_engine import FakeEngine
from launch.process import RouterServer, ServerProcess, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BODY = {"model": "fake-model", "prompt": "the quick brown fox jumps", "max_tokens": 4}


async def serve_fakes(p_port: int, d_port: int) -> None:
    p, d = FakeEngine("prefill", record=False), FakeEngine("decode", record=False)
    await p.start(p_port)
    await d.start(d_port)
    print("fakes ready", flush=True)
    await asyncio.Event().wait()


class Target:
    """One way of getting a completion: a list of (url, body) legs run in order."""

    def __init__(self, name: str, legs):
        self.name, self.legs = name, legs

    async def once(self, session: aiohttp.ClientSession, stream: bool) -> float:
        started = time.perf_counter()
        kv = None
        for url, make_body in self.legs:
            async with session.post(url, json=make_body(stream, kv)) as r:
                data = await r.read()
                assert r.status == 200 and data, (url, r.status, data[:200])
                if "kv_transfer_params" in data.decode():
                    kv = (await r.json()).get("kv_transfer_params")
        return time.perf_counter() - started


def client_body(stream, kv):
    return dict(BODY, stream=stream)


def prefill_leg(stream, kv):
    return dict(BODY, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True,
                                                                       "transfer_id": os.urandom(16).hex()})


def decode_leg(stream, kv):
    return dict(BODY, stream=stream, kv_transfer_params=kv or {"do_remote_prefill": True, "transfer_id": "x"})


async def latency_c1(targets: list[Target], stream: bool, n: int) -> list[list[float]]:
    """Round-robin over the targets, one request each per round: a load change on the
    shared machine then hits every target alike instead of skewing one."""
    sessions = [aiohttp.ClientSession() for _ in targets]
    try:
        for t, s in zip(targets, sessions):
            for _ in range(20):  # warm the pools
                await t.once(s, stream)
        lat: list[list[float]] = [[] for _ in targets]
        for _ in range(n):
            for i, (t, s) in enumerate(zip(targets, sessions)):
                lat[i].append(await t.once(s, stream))
        return lat
    finally:
        for s in sessions:
            await s.close()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc), to price the router per request even when
    other processes share the cores and make req/s noisy."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def throughput(target: Target, stream: bool, concurrency: int, seconds: float) -> tuple[float, int]:
    done = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        deadline = time.perf_counter() + seconds

        async def client():
            nonlocal done
            while time.perf_counter() < deadline:
                await target.once(s, stream)
                done += 1

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return done / (time.perf_counter() - started), done


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] * 1e3


async def bench(args) -> None:
    p_port, d_port = free_port(), free_port()
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    fakes = ServerProcess([sys.executable, "-m", "benchmarks.router_overhead", "--serve-fakes", str(p_port),
                           str(d_port)], d_url, "fake engines", cwd=ROOT)
    router = RouterServer([p_url], [d_url], log=os.devnull, cwd=ROOT)
    try:
        fakes.wait_ready(30, path="/health")
        router.wait_ready(30)
        p, d, r = (u + "/v1/completions" for u in (p_url, d_url, router.url))
        targets = [Target("direct D", [(d, decode_leg)]),
                   Target("direct P+D", [(p, prefill_leg), (d, decode_leg)]),
                   Target("router", [(r, client_body)])]
        rows = []
        for stream in (True, False):
            lats = await latency_c1(targets, stream, args.n)
            for t, lat in zip(targets, lats):
                cpu0 = cpu_seconds(router.pid)
                rps, n = await throughput(t, stream, args.concurrency, args.seconds)
                cpu = (cpu_seconds(router.pid) - cpu0) / n * 1e3 if t.name == "router" else None
                rows.append((t.name, "stream" if stream else "json", pct(lat, 50), pct(lat, 99), rps, cpu))
        print(f"\n| path | mode | p50 c=1 (ms) | p99 c=1 (ms) | req/s c={args.concurrency} "
              f"| router CPU ms/req c={args.concurrency} |")
        print("|---|---|---|---|---|---|")
        for name, mode, p50, p99, rps, cpu in rows:
            print(f"| {name} | {mode} | {p50:.2f} | {p99:.2f} | {rps:.0f} | {'' if cpu is None else f'{cpu:.2f}'} |")
        for mode in ("stream", "json"):
            by = {name: (p50, rps) for name, m, p50, _, rps, _ in rows if m == mode}
            print(f"\n{mode}: router adds {by['router'][0] - by['direct D'][0]:.2f} ms p50 over direct D, "
                  f"{by['router'][0] - by['direct P+D'][0]:.2f} ms over direct P+D; "
                  f"router req/s = {by['router'][1] / by['direct P+D'][1]:.2f}x direct P+D")
        print(f"\nmachine: nproc={os.cpu_count()}, python {platform.python_version()}, "
              f"aiohttp {aiohttp.__version__}, uvloop {uvloop.__version__}")
    finally:
        for proc in (router, fakes):
            proc.stop(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=300, help="requests per c=1 latency measurement")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=4.0, help="length of each throughput measurement")
    ap.add_argument("--serve-fakes", nargs=2, type=int, metavar=("P_PORT", "D_PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_fakes:
        uvloop.run(serve_fakes(*args.serve_fakes))
    else:
        uvloop.run(bench(args))


if __name__ == "__main__":
    main()
