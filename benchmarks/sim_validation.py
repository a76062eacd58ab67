#!/usr/bin/env python
"""Does a simulated engine reproduce the real one here? (issue #38's validation)

Two calibrations of the built-in model on this machine (one torch thread, as the engines
serve): `grid`, `atomd profile` timing the forward alone over its grid, once; `served`, per
round: the real engines of the round ran with $ATOMD_STEP_SAMPLES, and `atomd profile
--from-servers` fits a profile from their forwards (colocated; P's prefills and D's decodes
for 1P+1D) as they ran beside the API processes, the other engine, the router, the client
and whatever else loaded the machine then; that round's simulated run uses it. So `served`
checks the simulator's scheduling, queueing, KV and HTTP paths given the step times the real
engines had (the machine is shared, and its load moves more between minutes than 15%), and
`grid` checks the whole, step model included. Each round runs the same seeded Poisson
workload (`atomd bench serve`, seed = round) against the setups, each started fresh: a
colocated engine and 1P+1D behind the router, real and simulated (`--model-runner simulated
--hardware PROFILE`, the loopback link). The report takes each setup's median over the
rounds of TTFT p50 / p99, TPOT p50 and output throughput, the simulated / real ratio
(target: within 15%), and the real engines' own round-to-round spread (max / min). The work
directory (printed first) keeps every run's bench result and each engine's /debug/stats and
/metrics; `python -m benchmarks.sim_trace DIR` compares a round's real and simulated runs step
by step.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
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


def simulated(profile: pathlib.Path) -> list[str]:
    return ["--model-runner", "simulated", "--hardware", str(profile)]


@contextlib.contextmanager
def setup(kind: str, runner: dict[str, list[str]], logs: pathlib.Path, env: dict | None = None):
    """Yields (the URL a client sends to: the colocated engine, or the router before P and D;
    {role: engine URL}). `runner`: the extra flags of each role (colocated, p, d)."""
    procs = []
    try:
        if kind == "colocated":
            e = EngineServer(None, *ENGINE, *runner["colocated"], log=logs / "colocated.log", cwd=REPO, env=env)
            procs.append(e)
            e.wait_ready(300)
            url, engines = e.url, {"colocated": e.url}
        else:
            p = EngineServer(None, *ENGINE, *runner["p"], "--kv-role", "producer", log=logs / "p.log", cwd=REPO,
                             env=env)
            d = EngineServer(None, *ENGINE, *runner["d"], "--kv-role", "consumer", log=logs / "d.log", cwd=REPO,
                             env=env)
            procs += [p, d]
            p.wait_ready(300)
            d.wait_ready(300)
            r = RouterServer([p.url], [d.url], "--health-interval-s", "0.5", log=logs / "router.log", cwd=REPO)
            procs.append(r)
            r.wait_ready(120)
            url, engines = r.url, {"p": p.url, "d": d.url, "router": r.url}
        for i in range(2):  # warm-up
            http("POST", url + "/v1/completions", {"prompt": list(range(10, 60 + i)), "max_tokens": 4})
        yield url, engines
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


def keep_stats(engines: dict[str, str], stem: pathlib.Path) -> None:
    """Each engine's GET /debug/stats (its step samples among them) beside the run's bench
    result, for comparing a real run's steps with its simulated runs' (`stem`-ROLE.stats.json)."""
    for role, url in engines.items():
        for path, suffix in (("/debug/stats", "stats.json"), ("/metrics", "metrics.txt")):
            status, body = http("GET", url + path)
            if status == 200:
                stem.with_name(f"{stem.name}-{role}.{suffix}").write_bytes(body)


def served_profile(engines: dict[str, str], path: pathlib.Path) -> tuple[list[str], list[str]]:
    """`atomd profile --from-servers --spread-in-order` on a real setup's engines; the
    simulated flags using it, and using the same steps fitted as before session 6
    (`--no-contention --no-served-link`: each engine alone, pulls on the named link's
    constants; the A/B of that)."""
    alone = path.with_name(path.stem + "-as-before.json")
    for out, extra in ((path, []), (alone, ["--no-contention", "--no-served-link"])):
        subprocess.run([sys.executable, "-m", "atomd", "profile", "--from-servers",
                        *(u for role, u in engines.items() if role != "router"),
                        "--spread-in-order", *extra, "--name", out.stem, "-o", str(out)], cwd=REPO, check=True)
    return simulated(path), simulated(alone)


def served_summary(role: str, path: pathlib.Path) -> str:
    step = json.loads(path.read_text())["step"]
    p, d = step["prefill"], step["decode"]
    gaps = "".join(f", {kind} gap {g['base_s'] * 1e3:.2f} ms + {g['per_output_s'] * 1e3:.3f} ms/output + "
                   f"{g['per_pull_s'] * 1e3:.2f} ms/pull + {g['per_request_s'] * 1e3:.2f} ms/request "
                   f"(mean {step[kind + '_gap_s'] * 1e3:.2f} ms)"
                   for kind, g in (("prefill", step.get("prefill_gap")), ("decode", step.get("decode_gap"))) if g)
    link = json.loads(path.read_text())["link"]
    return (f"{role} link {link['name']} {link['bandwidth'] / 1e9:.3f} GB/s + {link['latency_s'] * 1e3:.2f} ms, "
            f"prefill {p['base_s'] * 1e3:.2f} ms + {p['per_token_s'] * 1e6:.1f} us/token + "
            f"{p['per_attention_s'] * 1e9:.1f} ns/pair, decode {d['base_s'] * 1e3:.2f} ms + "
            f"{d['per_token_s'] * 1e6:.1f} us/row + {d['per_attention_s'] * 1e9:.1f} ns/context token"
            + "".join(f", decode at {n} seqs {v * 1e3:+.3f} ms"
                      for n, v in sorted(step.get("decode_by_seqs", {}).items(), key=lambda kv: int(kv[0])))
            + "".join(f", {kind} contention +{step[kind + '_contention']:.3f} s/s" for kind in ("prefill", "decode")
                      if step.get(kind + "_contention"))
            + gaps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--profile", default=None, help="a grid profile to use instead of calibrating one now")
    ap.add_argument("--no-grid", action="store_true", help="simulate with the served profiles only")
    ap.add_argument("--report", default=str(REPO / "benchmarks/results/sim_validation.md"))
    args = ap.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="sim-validation-"))
    print(f"work files (bench results, engines' stats, profiles): {work}", flush=True)
    profile = pathlib.Path(args.profile) if args.profile else work / "profile.json"
    load_before = loadavg()
    if not args.profile and not args.no_grid:
        subprocess.run([sys.executable, "-m", "atomd", "profile", "--num-threads", "1", "--max-model-len", "1024",
                        "-o", str(profile)], cwd=REPO, check=True)
    grid = {role: simulated(profile) for role in ("colocated", "p", "d")} if not args.no_grid else None
    real = {role: [] for role in ("colocated", "p", "d")}
    env = dict(os.environ, ATOMD_STEP_SAMPLES="20000")
    names = ["real", "served", "served-as-before"] + ([] if args.no_grid else ["grid"])
    results: dict[tuple[str, str], list[dict]] = {(k, n): [] for k in ("colocated", "pd") for n in names}
    loads, served = [], {}
    for r in range(args.rounds):
        for kind in (("colocated", "pd") if r % 2 == 0 else ("pd", "colocated")):
            with setup(kind, real, work, env=env) as (url, engines):
                results[kind, "real"].append(bench(url, args, seed=r, out=work / f"{kind}-real-{r}.json"))
                keep_stats(engines, work / f"{kind}-real-{r}")
                served[kind] = work / f"served-{kind}-{r}.json"
                flags, alone_flags = served_profile(engines, served[kind])
            runs = [("served", {"colocated": flags, "p": flags, "d": flags}),
                    ("served-as-before", {"colocated": alone_flags, "p": alone_flags, "d": alone_flags})] + \
                ([] if grid is None else [("grid", grid)])
            for name, runner in (runs if r % 2 == 0 else runs[::-1]):
                # `served`: the simulated engines of a setup share this machine's cores as the real
                # ones did (a board of their forwards; spinning through them); as before: sleeping
                host = dict(env, ATOMD_SIM_SHARED_CORES=str(work / f"cores-{kind}-{name}-{r}")) \
                    if name == "served" else env
                with setup(kind, runner, work, env=host) as (url, sim_engines):
                    results[kind, name].append(bench(url, args, seed=r, out=work / f"{kind}-{name}-{r}.json"))
                    keep_stats(sim_engines, work / f"{kind}-{name}-{r}")
            loads.append(loadavg())
            for name in names:
                got = results[kind, name][-1]
                print(f"round {r} {kind:>9} {name}: " + ", ".join(f"{m} {v:.2f}" for m, v in got.items()), flush=True)
    sims = names[1:]
    rows = []
    worst = {name: 0.0 for name in sims}
    for kind in ("colocated", "pd"):
        label = "1P+1D" if kind == "pd" else "colocated"
        got = results[kind, "real"]
        real_med = {m: float(np.median([x[m] for x in got])) for m in METRICS}
        rows.append(f"| {label} | real | " + " | ".join(
            f"{real_med[m]:.1f} (spread {max(x[m] for x in got) / min(x[m] for x in got):.2f}x)"
            for m in METRICS) + " |")
        for name in sims:
            sim_med = {m: float(np.median([x[m] for x in results[kind, name]])) for m in METRICS}
            ratios = {m: sim_med[m] / real_med[m] for m in METRICS}
            worst[name] = max(worst[name], *(abs(v - 1) for v in ratios.values()))
            rows.append(f"| {label} | simulated, {name} profile | "
                        + " | ".join(f"{sim_med[m]:.1f} ({ratios[m]:.2f}x)" for m in METRICS) + " |")
    per_round = []
    for kind in ("colocated", "pd"):
        for name in sims:
            ratios = [{m: sim[m] / real[m] for m in METRICS} for sim, real in zip(results[kind, name], results[kind, "real"])]
            cells = [" / ".join(f"{r[m]:.2f}" for m in METRICS) for r in ratios]
            med = " / ".join(f"{np.median([r[m] for r in ratios]):.2f}" for m in METRICS)
            per_round.append(f"| {'1P+1D' if kind == 'pd' else 'colocated'} | {name} | " + " | ".join(cells) + f" | {med} |")
    fit = json.loads(profile.read_text())["step"] if not args.no_grid else None
    grid = "" if fit is None else f"""Grid profile: `atomd profile --num-threads 1` on this machine (prefill {fit['prefill']['base_s'] * 1e3:.2f} ms +
{fit['prefill']['per_token_s'] * 1e6:.1f} us/token + {fit['prefill']['per_attention_s'] * 1e9:.1f} ns/pair; decode
{fit['decode']['base_s'] * 1e3:.2f} ms + {fit['decode']['per_token_s'] * 1e6:.1f} us/row +
{fit['decode']['per_attention_s'] * 1e9:.1f} ns/context token).
"""
    text = f"""## Simulator validation (issue #38)

`python -m benchmarks.sim_validation --rounds {args.rounds} --num-prompts {args.num_prompts} --rate {args.rate} \\
--input-len {args.input_len} --output-len {args.output_len}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())};
{cpu_name()} ({platform.machine()}), load before {load_before}, after each setup kind's real and simulated runs: {', '.join(loads)}.
{grid}Served profiles (`atomd profile --from-servers` on each round's real engines; the 1P+1D one fits P's prefills and
D's decodes; each busy gap from the gap model (the loop's work since the last forward: outputs, pulls landed,
requests added), the served residuals walked in their order from a seeded start, each batch size's mean residual
kept where a line misses it, each busy gap's deviation from the gap model added to its step's residual; `served`
fits how much longer a forward is beside the other engine's (contention; the simulated engines share a board of
their forwards, atomd/sim/shared_cores.py, spinning through each forward as a real one holds its core) and
times pulls on the link D served (the loopback's latency, the bandwidth of D's pulls); `served-as-before` fits
each engine alone, times pulls on the loopback's constants and sleeps through forwards), the last round's: {'; '.join(served_summary(kind, path) for kind, path in served.items())}.
Link loopback; every engine one torch thread. Real rows: medians of {args.rounds} rounds and (spread) max / min over
the rounds; simulated rows: medians and (simulated / real); target within 15% (0.85-1.15x).

| setup | engines | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | output tok/s |
|---|---|---|---|---|---|
{chr(10).join(rows)}

Per round, simulated / real of the same round (TTFT p50 / p99 / TPOT p50 / output tok/s; each round
runs its real setup, then the simulated ones on that round's served profile, then the other setup kind):

| setup | profile | {' | '.join(f'round {r}' for r in range(args.rounds))} | median of the rounds |
|---|---|{'---|' * args.rounds}---|
{chr(10).join(per_round)}

Worst deviation: {'; '.join(f"{name} profile {100 * w:.0f}% ({'within' if w <= 0.15 else 'outside'} the 15% target)"
                            for name, w in worst.items())}.
"""
    pathlib.Path(args.report).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
