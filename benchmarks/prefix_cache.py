#!/usr/bin/env python
"""TTFT and throughput with and without prefix caching on a shared-prefix workload (one
system prompt, many users), colocated and through PD.

Four setups, all started by this script and run back to back per request rate (see
benchmarks/pd_vs_colocated.py, whose helpers this reuses): one colocated engine and one
1P+1D pair behind the router, each with prefix caching on and with
`--no-enable-prefix-caching`. From the engines' /metrics around each run: the prefix-cache
hit rate, and in PD the KV bytes P sent to D (`kv_transfer_bytes_total`), which D's own
prefix hits should cut to the per-user suffix.

    .venv/bin/python -m benchmarks.prefix_cache --rates 8 --num-prompts 40
"""
from __future__ import annotations

import argparse
import json
import pathlib
import signal
import sys

from benchmarks.pd_vs_colocated import colocated, disaggregated, run_all

NO_CACHE = "--no-enable-prefix-caching"


def engine_deltas(row: dict) -> tuple[float, float, float]:
    """(prefix hits, prefix queries, KV bytes D received) over the run; hits and queries are
    summed over the setup's engines (in PD: P's and D's lookups)."""
    engines = [d for role, d in row["delta"].items() if role != "router"]
    received = row["delta"].get("decode", {}).get("kv_transfer_bytes", 0.0)  # P counts the same bytes as sent
    return (sum(d["prefix_cache_hits"] for d in engines), sum(d["prefix_cache_queries"] for d in engines), received)


def markdown(rows: list[dict]) -> str:
    lines = ["| setup | rate (req/s) | mean TTFT (ms) | p99 TTFT (ms) | output tok/s | req/s | "
             "prefix hit rate | KV bytes D pulled per request | PD decisions (pd / without KV) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        r = row["result"]
        hits, queries, kv_bytes = engine_deltas(row)
        router = row["delta"].get("router")
        pd = f"{router['pd']:.0f} / {router['decode_without_kv']:.0f}" if router else "-"
        per_req = f"{kv_bytes / r['completed'] / 1024:.0f} KiB" if router and r["completed"] else "-"
        lines.append(f"| {row['setup']} | {row['rate']} | {r['mean_ttft_ms']:.1f} | {r['p99_ttft_ms']:.1f} | "
                     f"{r['output_throughput']:.1f} | {r['request_throughput']:.2f} | "
                     f"{hits / queries if queries else 0:.2f} | {per_req} | {pd} |")
    return "\n".join(lines)


def ratios(rows: list[dict]) -> str:
    """cache-off / cache-on mean TTFT and cache-on / cache-off throughput, per topology and rate."""
    by = {(row["setup"], row["rate"]): row["result"] for row in rows}
    lines = []
    for topo in ("colocated", "pd"):
        for rate in sorted({r for _, r in by}):
            on, off = by.get((f"{topo}-cache", rate)), by.get((f"{topo}-nocache", rate))
            if on and off:
                lines.append(f"{topo} rate {rate}: mean TTFT off/on {off['mean_ttft_ms'] / on['mean_ttft_ms']:.2f}x, "
                             f"p99 TTFT off/on {off['p99_ttft_ms'] / on['p99_ttft_ms']:.2f}x, output throughput on/off "
                             f"{on['output_throughput'] / off['output_throughput']:.2f}x")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[8.0, float("inf")],
                    help="inf: every request at once, the throughput limit")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--shared-prefix-len", type=int, default=448, help="the system prompt every request shares")
    ap.add_argument("--input-len", type=int, default=64, help="each user's own tokens after the prefix")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1, help="sweeps of every rate")
    ap.add_argument("--warmup-prompts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the colocated engine")
    ap.add_argument("--topologies", nargs="+", default=["colocated", "pd"], choices=["colocated", "pd"])
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="leave P and D on every core")
    ap.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("/tmp/atomd-bench/prefix_cache"))
    ap.add_argument("--run-timeout-s", type=float, default=300)
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    workload = ["--dataset", "shared-prefix", "--shared-prefix-len", str(args.shared_prefix_len),
                "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--range-ratio", "0"]
    setups = {}
    for cache, extra in (("cache", ()), ("nocache", (NO_CACHE,))):
        if "colocated" in args.topologies:
            setups[f"colocated-{cache}"] = (lambda e=extra, c=cache: colocated(f"colocated-{c}", args.threads, 1,
                                                                                 args.out_dir, e))
        if "pd" in args.topologies:
            setups[f"pd-{cache}"] = (lambda e=extra, c=cache: disaggregated(list(e), args.out_dir, args.pin,
                                                                              f"pd-{c}"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks on SIGTERM
    rows = run_all(setups, args, workload, args.out_dir)
    print(markdown(rows))
    print(ratios(rows))
    (args.out_dir / "rows.json").write_text(json.dumps(
        [{k: v for k, v in row.items() if k != "result"} for row in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
