"""TTFT through the router (P -> D) split into prefill leg, KV transfer and first decode
step, against a colocated engine's TTFT, on the default model, same run, same machine.

    .venv/bin/python -m benchmarks.pd_ttft [--lengths 16 256 1024] [--reps 5]
    .venv/bin/python -m benchmarks.pd_ttft --cross-host   # P, D, router, colocated in four network
                                                          # namespaces (root): benchmarks/cross_host.py

For each prompt length (fresh random token prompts, so no prefix-cache hit):
  colocated   streamed request to a colocated `atomd serve`: time to the first event
  router      the same through the router: P's leg, the pull, D's first step, relays
  prefill leg POST to P with do_remote_decode (max_tokens=1), as the router sends it
  decode leg  streamed request to D with P's kv_transfer_params: time to the first event
  transfer    D's atomd:kv_transfer_seconds (READ to END) for that pull
Medians are printed as a Markdown table.
"""
from __future__ import annotations

import argparse
import http.client as httplib
import json
import os
import statistics
import time
import uuid

import numpy as np

from atomd.model.default import default_model_dir
from benchmarks.cross_host import ENGINE_ARGS, run_ttft
from benchmarks.pd_vs_colocated import scrape, total
from launch.process import EngineServer, RouterServer, http


def first_event_s(url: str, body: dict) -> float:
    """Seconds from sending a streamed completion to its first SSE event."""
    host, port = url.removeprefix("http://").split(":")
    conn = httplib.HTTPConnection(host, int(port), timeout=120)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(dict(body, stream=True)),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    while not resp.readline().startswith(b"data: "):
        pass
    elapsed = time.perf_counter() - t0
    resp.read()
    conn.close()
    return elapsed


def one_length(ref, p, d, router, n: int, reps: int, rng) -> dict[str, float]:
    rows: dict[str, list[float]] = {k: [] for k in ("colocated", "router", "prefill leg", "decode leg", "transfer")}
    for _ in range(reps):
        body = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}
        rows["colocated"].append(first_event_s(ref.url, dict(body, prompt=rng.integers(10, 4096, n).tolist())))
        rows["router"].append(first_event_s(router.url, dict(body, prompt=rng.integers(10, 4096, n).tolist())))
        prompt = rng.integers(10, 4096, n).tolist()
        t0 = time.perf_counter()
        status, raw = http("POST", p.url + "/v1/completions", dict(
            body, prompt=prompt, max_tokens=1,
            kv_transfer_params={"do_remote_decode": True, "transfer_id": uuid.uuid4().hex}))
        rows["prefill leg"].append(time.perf_counter() - t0)
        assert status == 200, raw
        params = json.loads(raw)["kv_transfer_params"]
        before = total(scrape(d.url), "atomd:kv_transfer_seconds_sum")
        rows["decode leg"].append(first_event_s(d.url, dict(body, prompt=prompt, kv_transfer_params=params)))
        rows["transfer"].append(total(scrape(d.url), "atomd:kv_transfer_seconds_sum") - before)
    return {k: statistics.median(v) for k, v in rows.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 256, 1024])
    ap.add_argument("--reps", type=int, default=5)
    # Cross-host column (benchmarks/cross_host.py): P, D, router and a colocated engine each in
    # a test host (network namespace, root only), unshaped and shaped 2 ms +- 1 ms / 1 Gbit/s.
    ap.add_argument("--cross-host", action="store_true", help="P, D, router, colocated in four network namespaces")
    ap.add_argument("--rounds", type=int, default=3, help="--cross-host rounds (>= 3; medians)")
    ap.add_argument("--itl-tokens", type=int, default=32, help="--cross-host: tokens of the ITL request")
    ap.add_argument("--cross-host-out", default=os.path.join(os.path.dirname(__file__), "results",
                                                             "pd_cross_host.md"))
    args = ap.parse_args()
    if args.cross_host:
        run_ttft(args)
        return
    model = default_model_dir()
    engines = [EngineServer(model, *ENGINE_ARGS, *flags, log=os.devnull)
               for flags in ([], ["--kv-role", "producer"], ["--kv-role", "consumer"])]
    router = None
    try:
        ref, p, d = (e.wait_ready() for e in engines)
        router = RouterServer([p.url], [d.url], "--health-interval-s", "0.5", log=os.devnull).wait_ready()
        rng = np.random.default_rng(0)
        one_length(ref, p, d, router, 16, 2, rng)  # warm-up: first forwards, connections
        print("| prompt tokens | colocated TTFT ms | router TTFT ms | prefill leg ms | decode leg ms "
              "| transfer ms | first decode step ms (decode leg - transfer) | router / colocated |")
        print("|---|---|---|---|---|---|---|---|")
        for n in args.lengths:
            m = {k: v * 1e3 for k, v in one_length(ref, p, d, router, n, args.reps, rng).items()}
            print(f"| {n} | {m['colocated']:.1f} | {m['router']:.1f} | {m['prefill leg']:.1f} | "
                  f"{m['decode leg']:.1f} | {m['transfer']:.2f} | {m['decode leg'] - m['transfer']:.1f} | "
                  f"{m['router'] / m['colocated']:.2f}x |")
    finally:
        if router is not None:
            router.stop()
        for e in engines:
            e.stop()


if __name__ == "__main__":
    main()
