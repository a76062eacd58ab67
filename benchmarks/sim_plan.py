#!/usr/bin/env python
"""DistServe-style on simulated H100s (issue #38, benchmark 2): goodput per GPU of the best
xPyD layout against the best colocated one, by `atomd plan`'s fleet simulator
(atomd/sim/fleet.py), for a Llama-3-8B-shaped and a Qwen3-30B-A3B-shaped model, a chat and a
long-prompt workload, under a tight and a loose SLO, at each GPU count of --gpus.

Goodput is DistServe's (the highest Poisson rate with >= 90% of requests within both the
TTFT and the TPOT SLO), bisected --iterations times with --requests-per-engine requests per
engine and at least --duration-ttfts TTFT SLOs of arrivals. Layouts per size: colocated, and xPyD at the profile's predicted split and one
either side (atomd/sim/plan.py). The H100 profile is derived from public peak numbers with
assumed efficiencies (atomd/sim/hardware.py); RDMA 400G between engines.

    .venv/bin/python -m benchmarks.sim_plan --gpus 2 4 8
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

from atomd.sim.fleet import SLO, Workload
from atomd.sim.hardware import load_profile
from atomd.sim.plan import plan
from benchmarks.machine import loadavg

REPO = pathlib.Path(__file__).resolve().parent.parent
WORKLOADS = {"chat": (512, 128), "long-prompt": (4096, 128)}
SLOS = {("chat", "tight"): SLO(0.25, 0.025), ("chat", "loose"): SLO(1.0, 0.1),
        ("long-prompt", "tight"): SLO(1.0, 0.025), ("long-prompt", "loose"): SLO(4.0, 0.1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--models", nargs="+", default=["llama3-8b", "qwen3-30b-a3b"])
    ap.add_argument("--requests-per-engine", type=int, default=30)
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--slos", nargs="+", default=["tight", "loose"], choices=["tight", "loose"])
    ap.add_argument("--duration-ttfts", type=float, default=5.0,
                    help="every simulated trace lasts at least this many TTFT SLOs (atomd/sim/fleet.py Workload)")
    ap.add_argument("--report", default=str(REPO / "benchmarks/results/sim_plan.md"))
    args = ap.parse_args()
    started, load = time.monotonic(), loadavg()
    rows = []
    for model in args.models:
        profile = load_profile(f"h100:{model}")
        for wname in args.workloads:
            inp, out = WORKLOADS[wname]
            for tight in args.slos:
                slo = SLOS[wname, tight]
                workload = Workload(input_len=inp, output_len=out, num_requests=args.requests_per_engine,
                                    min_duration_s=args.duration_ttfts * slo.ttft_s)
                for g in args.gpus:
                    t0 = time.monotonic()
                    ranked = plan(profile, workload, slo, max_gpus=g, min_gpus=g, decode_max_seqs=[256],
                                  iterations=args.iterations,
                                  progress=lambda r: print(f"  {r.layout.label()}: {r.per_gpu:.2f} req/s/GPU "
                                                           f"({time.monotonic() - t0:.0f} s)", flush=True))
                    pd = next(r for r in ranked if r.layout.kind == "pd")
                    co = next(r for r in ranked if r.layout.kind == "colocated")
                    ratio = pd.per_gpu / co.per_gpu if co.per_gpu else float("inf")
                    row = (f"| {model} | {wname} | {tight} (TTFT {slo.ttft_s * 1e3:.0f} ms, TPOT "
                           f"{slo.tpot_s * 1e3:.0f} ms) | {g} | {pd.layout.num_prefill}P{pd.layout.num_decode}D "
                           f"{pd.per_gpu:.2f} | {co.per_gpu:.2f} | {ratio:.2f}x |")
                    rows.append(row)
                    print(row, flush=True)
    text = f"""## Simulated H100: best xPyD vs best colocated (issue #38, benchmark 2)

`python -m benchmarks.sim_plan --gpus {' '.join(map(str, args.gpus))} --requests-per-engine \\
{args.requests_per_engine} --iterations {args.iterations} --models {' '.join(args.models)} --workloads {' '.join(args.workloads)} --slos {' '.join(args.slos)} --duration-ttfts {args.duration_ttfts:g}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, \\
load {load} (virtual time: the load does not change the numbers, only the {time.monotonic() - started:.0f} s it took).
Profile `h100:MODEL` (989 TFLOPS x 0.6, 3.35 TB/s x 0.8, 1 ms a step, 80 GB x 0.9 less the
weights for KV), RDMA 400G link; workloads chat {WORKLOADS['chat'][0]} in / {WORKLOADS['chat'][1]} out and
long-prompt {WORKLOADS['long-prompt'][0]} / {WORKLOADS['long-prompt'][1]} tokens (uniform +-50%), Poisson
arrivals; goodput per GPU in req/s at >= 90% SLO attainment; D engines max_num_seqs 256.

| model | workload | SLO | GPUs | best xPyD (req/s/GPU) | best colocated (req/s/GPU) | PD / colocated |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}
"""
    pathlib.Path(args.report).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
