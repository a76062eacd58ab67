#!/usr/bin/env python
"""LoRA placement through the router (issue 39): 8 adapters over 4 engines holding 2-4 each.

Four real colocated engines (`atomd serve`, the built-in model, one torch thread each) with
`--max-loras` 2, 2, 3 and 4 each know all 8 adapters (random rank-8 PEFT adapters written
here) and hold a different 2-4 of them in memory, so every adapter is resident somewhere
(11 slots for 8 adapters). A router in this process (router.app.Router on a loop thread)
sends them --requests short completions (adapter uniform over the 8, --concurrency at once,
round_robin among the candidates). Placements compared in the same run, each round in turn
from the same starting residency:

- resident: this branch's router/pd.py `with_adapter` (the engines that know the adapter,
  those holding it in memory first);
- known: the engines that know the adapter, whether in memory or not (the router before);
- any: every engine (an adapter-blind router).

Measured: the loads requests waited for (the engines' `lora_request_loads`, /debug/stats:
a request whose adapter had been evicted there loads it inside the engine loop), and the
requests' wall latency (p50, p99). Medians over --rounds; the load average and CPU before
and after (a shared 2-core machine).

    .venv/bin/python -m benchmarks.lora_placement --rounds 3
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import pathlib
import random
import statistics
import tempfile
import threading
import time

from benchmarks.lora_overhead import write_adapter
from benchmarks.machine import cpu_model, loadavg
from benchmarks.model_shapes import model_dir
from launch.process import EngineServer, http

ADAPTERS = [f"a{i}" for i in range(8)]
SLOTS = [2, 2, 3, 4]  # --max-loras of each engine: 11 slots for 8 adapters
RESIDENT = [["a0", "a1"], ["a2", "a3"], ["a4", "a5", "a6"], ["a7", "a0", "a1", "a2"]]  # what each holds at the start


def placements():
    import router.pd as pd

    resident = pd.with_adapter

    def known(candidates, route):
        model = route.body.get("model")
        serving = [w for w in candidates if w.loras is not None and model in w.loras]
        if serving:
            route.lora = model
        return serving or candidates

    return {"resident": resident, "known": known, "any": lambda candidates, route: candidates}


def reset_residency(engines: list[EngineServer], paths: dict[str, pathlib.Path]) -> None:
    """Every engine knows all 8; the ones of RESIDENT loaded last, so they are the resident ones."""
    for engine, hold in zip(engines, RESIDENT):
        for name in ADAPTERS:
            http("POST", engine.url + "/v1/unload_lora_adapter", {"lora_name": name})
        for name in [n for n in ADAPTERS if n not in hold] + hold:
            status, raw = http("POST", engine.url + "/v1/load_lora_adapter",
                               {"lora_name": name, "lora_path": str(paths[name])})
            assert status == 200, raw
        info = json.loads(http("GET", engine.url + "/kv_transfer_info")[1])
        assert sorted(info["loras_resident"]) == sorted(hold), info


def loads(engines: list[EngineServer]) -> int:
    return sum(json.loads(http("GET", e.url + "/debug/stats")[1])["lora_request_loads"] for e in engines)


class RouterThread:
    def __init__(self, urls: list[str]):
        from router.app import Router, RouterConfig

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def start():
            self.router = Router(RouterConfig(worker=urls, port=0, health_interval_s=0.2))
            return await self.router.start()

        self.url = self.run(start())

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def fresh(self) -> None:
        """Every worker's residency as the engines say now (a health round)."""
        self.run(self.router.registry.check_all())

    def stop(self) -> None:
        self.run(self.router.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)


def run_load(url: str, n: int, concurrency: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    bodies = [{"model": rng.choice(ADAPTERS), "prompt": [rng.randrange(3, 200) for _ in range(16)],
               "max_tokens": 4, "temperature": 0, "ignore_eos": True} for _ in range(n)]

    def one(body):
        t = time.perf_counter()
        status, raw = http("POST", url + "/v1/completions", body, timeout=120)
        assert status == 200, raw
        return time.perf_counter() - t

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, bodies))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    print(f"load before: {loadavg()}; CPU: {cpu_model()}", flush=True)
    import router.pd as pd

    model = model_dir("builtin")
    from atomd.model.loader import read_config

    cfg = read_config(model)
    root = pathlib.Path(tempfile.mkdtemp(prefix="lora-placement-"))
    paths = {name: write_adapter(root / name, cfg, 8, seed=i) for i, name in enumerate(ADAPTERS)}
    engines = [EngineServer(None, "--enable-lora", "--max-loras", str(k), "--max-lora-rank", "8", "--num-threads", "1",
                            log=root / f"engine{i}.log") for i, k in enumerate(SLOTS)]
    router = None
    results: dict[str, list[tuple[int, float, float]]] = {}
    try:
        for e in engines:
            e.wait_ready(300)
        router = RouterThread([e.url for e in engines])
        variants = placements()
        for r in range(args.rounds):
            for name, place in variants.items():
                reset_residency(engines, paths)
                router.fresh()
                pd.with_adapter = place
                before = loads(engines)
                times = sorted(run_load(router.url, args.requests, args.concurrency, seed=r))
                waited = loads(engines) - before
                p50, p99 = statistics.median(times), times[min(len(times) - 1, int(0.99 * len(times)))]
                results.setdefault(name, []).append((waited, p50, p99))
                print(f"round {r} {name}: {waited} loads waited for in {args.requests} requests; "
                      f"latency p50 {p50 * 1e3:.0f} ms p99 {p99 * 1e3:.0f} ms", flush=True)
        pd.with_adapter = variants["resident"]
    finally:
        if router is not None:
            router.stop()
        for e in engines:
            e.stop()
    print(f"\n{args.requests} requests x {args.rounds} rounds, 8 adapters over engines with {SLOTS} slots; "
          f"medians over rounds (p50 latency ratio: the median of each round's ratio to `any`, the adapter-blind "
          f"router, measured in the same round):")
    for name, rows in results.items():
        waited = statistics.median(w for w, _, _ in rows)
        p50 = statistics.median(p for _, p, _ in rows)
        p99 = statistics.median(p for _, _, p in rows)
        ratio = statistics.median(row[1] / base[1] for row, base in zip(rows, results["any"]))
        print(f"  {name:9s} loads waited for {waited:5.0f} ({waited / args.requests:.0%} of requests)  "
              f"p50 {p50 * 1e3:6.0f} ms ({ratio:.2f}x)  p99 {p99 * 1e3:6.0f} ms")
    print(f"load after: {loadavg()}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
