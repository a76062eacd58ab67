#!/usr/bin/env python
"""Where a simulated 1P+1D run differs from the real one: a sim_validation work directory's
files (each run's bench result, each engine's GET /debug/stats with its step samples) read
per round and run, real beside simulated (issue #38).

Per run: P's and D's forwards alone and beside the other engine's (n, mean ms; the busy gap
before them, median; the contention `atomd profile` fits from them, s per second beside), and each request's time line on the one
host clock: the client's send (bench's start times, offset so that the quickest send -> P's
forward is 0), P's forward start and end (P's prefill samples, in arrival order after the two
warm-ups), the client's first token, and D's next forward after P's end; medians in ms.

    python -m benchmarks.sim_trace /tmp/sim-validation-XXXX [--kind pd]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

import numpy as np

from atomd.sim.hardware import StepShape
from atomd.sim.profile import ALONE_FRACTION, fit_contention, overlaps

WARM_UPS = 2  # sim_validation's warm-up requests, before the benchmark's


def samples_of(stats: list[dict]) -> list[tuple]:
    """served_samples' tuples from the engines' saved stats (one engine per entry)."""
    out = []
    for engine, st in enumerate(stats):
        for x in st.get("step_samples", []):
            if len(x) >= 11:
                out.append((StepShape(bool(x[0]), int(x[1]), int(x[2]), float(x[3]), int(x[4])), float(x[5]),
                            float(x[6]), tuple(x[7:10]), engine, float(x[10])))
    return out


def contention_line(samples: list[tuple]) -> str:
    overlap = overlaps(samples)
    parts = []
    for kind, is_prefill in (("prefill", True), ("decode", False)):
        idx = [i for i, s in enumerate(samples) if s[0].is_prefill == is_prefill and s[0].seqs == 1]
        if not idx:
            continue
        t, ov = np.array([samples[i][1] for i in idx]), overlap[idx]
        beside = ov > ALONE_FRACTION * t
        mine = [i for i, s in enumerate(samples) if s[0].is_prefill == is_prefill]
        q = fit_contention([samples[i] for i in mine], overlap[mine])
        gaps = [samples[i][2] for i in idx if samples[i][2] >= 0]
        parts.append(f"{kind} (1 seq) alone n{(~beside).sum()} {t[~beside].mean() * 1e3 if (~beside).any() else 0:.2f}"
                     f" ms, beside n{beside.sum()} {t[beside].mean() * 1e3 if beside.any() else 0:.2f} ms, "
                     f"busy gap p50 {np.median(gaps) * 1e3 if gaps else 0:.2f} ms; contention {q:.2f} s/s")
    return " | ".join(parts)


def time_line(result: dict, p: dict, d: dict) -> str:
    order = np.argsort(result["start_times"])
    sent, ttft = np.array(result["start_times"])[order], np.array(result["ttfts"])[order]
    prefills = [(x[10], x[10] + x[5]) for x in p.get("step_samples", []) if x[0] and len(x) >= 11
                for _ in range(int(x[2]))][WARM_UPS:]
    if len(prefills) != len(sent):
        return f"(P served {len(prefills)} prompts for {len(sent)} requests: no time line)"
    start, end = np.array(prefills).T
    sent = sent + np.min(start - sent)
    d_starts = np.sort([x[10] for x in d.get("step_samples", []) if len(x) >= 11])
    k = np.searchsorted(d_starts, end)
    d_next = np.where(k < len(d_starts), d_starts[np.minimum(k, len(d_starts) - 1)], np.nan)
    ms = {"send -> P": start - sent, "P's forward": end - start, "P's end -> first token": sent + ttft - end,
          "P's end -> D's next forward": d_next - end}
    return ", ".join(f"{k} {np.nanmedian(v) * 1e3:.2f}" for k, v in ms.items())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work", help="a sim_validation work directory")
    ap.add_argument("--kind", default="pd", choices=("pd", "colocated"))
    args = ap.parse_args()
    work = pathlib.Path(args.work)
    runs = sorted({(int(m.group(2)), m.group(1)) for f in work.glob(f"{args.kind}-*.json")
                   if (m := re.fullmatch(rf"{args.kind}-(.+)-(\d+)\.json", f.name))})
    if not runs:
        print(f"sim_trace: no {args.kind} runs in {work}", file=sys.stderr)
        return 2
    for r, name in sorted(runs, key=lambda rn: (rn[0], rn[1] != "real", rn[1])):
        roles = ("p", "d") if args.kind == "pd" else ("colocated",)
        paths = [work / f"{args.kind}-{name}-{r}-{role}.stats.json" for role in roles]
        if not all(p.exists() for p in paths):
            continue
        stats = [json.loads(p.read_text()) for p in paths]
        print(f"round {r} {name}: {contention_line(samples_of(stats))}")
        if args.kind == "pd":
            result = json.loads((work / f"{args.kind}-{name}-{r}.json").read_text())
            print(f"    time line (medians, ms): {time_line(result, *stats)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
