#!/usr/bin/env python
"""Does a simulated engine reproduce the real one here? (issue #38's validation)

`atomd profile` calibrates a profile of the built-in model on this machine (one torch thread,
as the engines serve), then each round runs the same seeded Poisson workload (`atomd bench
serve`) against four setups, each started fresh: a colocated engine and 1P+1D behind the
router, real and simulated (`--model-runner simulated --hardware PROFILE`, the loopback
link). Every engine runs one torch thread. The report takes each setup's median over the
rounds of TTFT p50 / p99, TPOT p50 and output throughput and the simulated / real ratio
(target: within 15%). The setup order alternates per round.

    .venv/bin/python -m benchmarks.sim_validation --rounds 3
"""
from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.machine import loadavg
from launch.process import EngineServer, RouterServer, http

REPO = pathlib.Path(__file__).resolve().parent.parent
METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "output_throughput")
ENGINE = ["--num-threads", "1", "--max-model-len", "1024"]


def cpu_name() -> str:
    from atomd.sim.profile import cpu_name as name

    return name()


@contextlib.contextmanager
def setup(kind: str, runner: list[str], logs: pathlib.Path):
    """Yields the URL a client sends to: the colocated engine, or the router before P and D."""
    procs = []
    try:
        if kind == "colocated":
            e = EngineServer(None, *ENGINE, *runner, log=logs / "colocated.log", cwd=REPO)
            procs.append(e)
            e.wait_ready(300)
            url = e.url
        else:
            p = EngineServer(None, *ENGINE, *runner, "--kv-role", "producer", log=logs / "p.log", cwd=REPO)
            d = EngineServer(None, *ENGINE, *runner, "--kv-role", "consumer", log=logs / "d.log", cwd=REPO)
            procs += [p, d]
            p.wait_ready(300)
            d.wait_ready(300)
            r = RouterServer([p.url], [d.url], "--health-interval-s", "0.5", log=logs / "router.log", cwd=REPO)
            procs.append(r)
            r.wait_ready(120)
            url = r.url
        for i in range(2):  # warm-up
            http("POST", url + "/v1/completions", {"prompt": list(range(10, 60 + i)), "max_tokens": 4})
        yield url
    finally:
        for proc in reversed(procs):
            proc.stop()


def bench(url: str, args, seed: int, out: pathlib.Path) -> dict:
    cmd = [sys.executable, "-m", "atomd", "bench", "serve", "--base-url", url, "--num-prompts", str(args.num_prompts),
           "--request-rate", str(args.rate), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--seed", str(seed), "--ignore-eos", "--disable-tqdm", "--result-json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"bench serve failed: {proc.stderr[-2000:]}")
    result = json.loads(out.read_text())
    return {m: float(result[m]) for m in METRICS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--profile", default=None, help="a profile to use instead of calibrating one now")
    ap.add_argument("--report", default=str(REPO / "benchmarks/results/sim_validation.md"))
    args = ap.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="sim-validation-"))
    profile = pathlib.Path(args.profile) if args.profile else work / "profile.json"
    load_before = loadavg()
    if not args.profile:
        subprocess.run([sys.executable, "-m", "atomd", "profile", "--num-threads", "1", "--max-model-len", "1024",
                        "-o", str(profile)], cwd=REPO, check=True)
    sim = ["--model-runner", "simulated", "--hardware", str(profile)]
    setups = [(kind, name, runner) for kind in ("colocated", "pd") for name, runner in (("real", []), ("sim", sim))]
    results: dict[tuple[str, str], list[dict]] = {(k, n): [] for k, n, _ in setups}
    loads = []
    for r in range(args.rounds):
        order = setups if r % 2 == 0 else list(reversed(setups))
        for kind, name, runner in order:
            with setup(kind, runner, work) as url:
                got = bench(url, args, seed=r, out=work / f"{kind}-{name}-{r}.json")
            results[kind, name].append(got)
            loads.append(loadavg())
            print(f"round {r} {kind:>9} {name}: " + ", ".join(f"{m} {v:.2f}" for m, v in got.items()), flush=True)
    rows = []
    worst = 0.0
    for kind in ("colocated", "pd"):
        real = {m: float(np.median([x[m] for x in results[kind, "real"]])) for m in METRICS}
        simulated = {m: float(np.median([x[m] for x in results[kind, "sim"]])) for m in METRICS}
        ratios = {m: simulated[m] / real[m] for m in METRICS}
        worst = max(worst, *(abs(v - 1) for v in ratios.values()))
        rows.append(f"| {'1P+1D' if kind == 'pd' else 'colocated'} | "
                    + " | ".join(f"{real[m]:.1f} / {simulated[m]:.1f} ({ratios[m]:.2f}x)" for m in METRICS) + " |")
    fit = json.loads(profile.read_text())["step"]
    text = f"""## Simulator validation (issue #38)

`python -m benchmarks.sim_validation --rounds {args.rounds} --num-prompts {args.num_prompts} --rate {args.rate} \\
--input-len {args.input_len} --output-len {args.output_len}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())};
{cpu_name()} ({platform.machine()}), load before {load_before}, after each setup: {', '.join(loads)}.
Profile: `atomd profile --num-threads 1` on this machine (prefill {fit['prefill']['base_s'] * 1e3:.2f} ms +
{fit['prefill']['per_token_s'] * 1e6:.1f} us/token + {fit['prefill']['per_attention_s'] * 1e9:.1f} ns/pair; decode
{fit['decode']['base_s'] * 1e3:.2f} ms + {fit['decode']['per_token_s'] * 1e6:.1f} us/row +
{fit['decode']['per_attention_s'] * 1e9:.1f} ns/context token), link loopback. Every engine one torch thread; each
cell: real / simulated (simulated / real), medians of {args.rounds} rounds; target within 15% (0.85-1.15x).

| setup | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | output tok/s |
|---|---|---|---|---|
{chr(10).join(rows)}

Worst deviation: {100 * worst:.0f}% ({'within' if worst <= 0.15 else 'outside'} the 15% target).
"""
    pathlib.Path(args.report).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
