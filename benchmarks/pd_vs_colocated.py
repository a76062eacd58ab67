#!/usr/bin/env python
"""1 prefill + 1 decode engine (one core each, via the router) against one colocated engine
given the same two cores, on the same Poisson arrivals of long prompts with long outputs.

Setups: colocated-2t (one engine, 2 torch threads), colocated-dp2 (`--data-parallel-size 2`,
one thread per rank), colocated-1t (a control: one engine, one thread), pd-1p1d (P's and D's
engine threads pinned to cores 0 and 1), pd-1p1d-unpinned, and pinned 1P+1D behind a router in
`--pd-mode strict` (pd-1p1d-strict) or `--pd-mode adaptive` with D capped by
`--max-local-prefill-tokens-per-step` or `--max-local-prefill-ms-per-step`, its router bounded
by `--local-prefill-max-itl-ms` if given (pd-1p1d-adaptive; router/adaptive.py).

Every setup is started fresh by this script (free ports, stopped in `finally`), warmed up
with two requests, then `atomd bench serve` (a subprocess) runs the same seeded workload at
each request rate; its result JSON gives TTFT/ITL p99, output throughput and goodput under
an SLO. The router's `decision_total` is read from its /metrics around each run: a PD run
where D recomputed prompts (decision="decode_without_kv") is flagged, not reported as PD.

Models (`--model`): the built-in one, or `smollm-135m`, a random-weight checkpoint shaped like
SmolLM2-135M (benchmarks/model_shapes.py), where a prefill costs what it costs on real
deployments. `--slo-from-idle TTFT_X TPOT_X` derives the SLO from idle measurements of that
model instead of `--slo`: one engine with one torch thread (each engine's share in DP=2 and
PD) serves `--idle-prompts` requests of the same workload one at a time; the SLO is TTFT_X x
their median TTFT and TPOT_X x their median TPOT, the same for every setup. `--rounds N`
repeats the whole sweep (the setup order alternating per rate and per round); the report
takes the median per setup and rate, and a setup's goodput is DistServe's: the highest rate
up to which >= 90% of requests met the SLO (the median round's count) at every rate of the
sweep. `--rescore ROWS_JSON --slo ...` reports an earlier run under another SLO, from the
per-request data it kept.

    .venv/bin/python -m benchmarks.pd_vs_colocated --rates 4 8 12 --num-prompts 40
    .venv/bin/python -m benchmarks.pd_vs_colocated --model smollm-135m --slo-from-idle 5 3 --rounds 3 \\
        --setups colocated-2t colocated-dp2 pd-1p1d-strict pd-1p1d-adaptive --rates 0.5 0.75 1 1.5 2 \\
        --num-prompts 24 --input-len 256 --output-len 32
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from atomd.bench.metrics import RequestResult, meets_slos, parse_goodput
from benchmarks.model_shapes import CHOICES as MODELS, model_dir
from launch.process import EngineServer, RouterServer

REPO = pathlib.Path(__file__).resolve().parent.parent
ENGINE_ARGS = ["--max-model-len", "1024", "--max-num-seqs", "64"]
MODEL_DIR: list[pathlib.Path] = []  # --model's checkpoint, set by main()


def checkpoint() -> pathlib.Path:
    """The engines' checkpoint: --model's, else the built-in model."""
    return MODEL_DIR[0] if MODEL_DIR else model_dir("builtin")


def pin_engine(server: EngineServer, cpus: set[int]) -> None:
    """Pin every thread of the server's engine core (affinity is per thread on Linux)."""
    pid = server.engine_pid()
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a Prometheus /metrics page."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(metrics: dict, name: str, **labels) -> float:
    """Sum of `name` over series whose labels include `labels` (0 when absent)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in metrics.items() if n == name and want <= set(ls))


def bench(url: str, out: pathlib.Path, args, rate: float | str, num_prompts: int, extra: list[str],
          label: str, seed: int) -> dict:
    """One `atomd bench serve` run; its result JSON."""
    cmd = [sys.executable, "-m", "atomd", "bench", "serve", "--base-url", url, "--label", label,
           "--num-prompts", str(num_prompts), "--request-rate", str(rate), "--seed", str(seed),
           "--ignore-eos", "--disable-tqdm", "--result-json", str(out), *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.run_timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"bench serve failed ({label}): {proc.stderr[-2000:]}")
    return json.loads(out.read_text())


@contextlib.contextmanager
def colocated(name: str, threads: int, dp: int, logs: pathlib.Path, extra: tuple[str, ...] = ()):
    """One server with `dp` engine cores of `threads` torch threads, on every core.
    Yields (url, {role: metrics url})."""
    srv = EngineServer(checkpoint(), *ENGINE_ARGS, "--num-threads", str(threads), "--data-parallel-size",
                       str(dp), *extra, log=logs / f"{name}.log", cwd=REPO)
    try:
        srv.wait_ready()
        if len(srv.engine_pids()) != dp:  # the flag parses before the server spawns the ranks
            raise RuntimeError(f"{name}: atomd serve --data-parallel-size {dp} runs "
                               f"{len(srv.engine_pids())} engine core(s)")
        yield srv.url, {"engine": srv.url}
    finally:
        srv.stop()


@contextlib.contextmanager
def disaggregated(extra: list[str], logs: pathlib.Path, pin: bool, name: str = "pd", router_args: tuple = (),
                  decode_extra: tuple = ()):
    """P (core 0) and D (core 1), one torch thread each, behind the router."""
    started: list[EngineServer | RouterServer] = []
    try:
        for role in ("producer", "consumer"):
            own = decode_extra if role == "consumer" else ()
            started.append(EngineServer(checkpoint(), *ENGINE_ARGS, "--num-threads", "1", "--kv-role", role,
                                        *extra, *own, log=logs / f"{name}-{role}.log", cwd=REPO))
        p, d = (s.wait_ready() for s in started)
        if pin:
            pin_engine(p, {0})
            pin_engine(d, {1 % os.cpu_count()})
        router = RouterServer([p.url], [d.url], "--health-interval-s", "0.5", *router_args,
                              log=logs / f"{name}-router.log", cwd=REPO)
        started.append(router)
        router.wait_ready()
        yield router.url, {"prefill": p.url, "decode": d.url, "router": router.url}
    finally:
        for s in reversed(started):
            s.stop()


def run_all(setups: dict, args, workload: list[str], out_dir: pathlib.Path) -> list[dict]:
    """Start every setup (idle engines cost no CPU), warm each up, then per round and rate run
    the setups back to back, in alternating order, so they see the same background load."""
    rows = []
    with contextlib.ExitStack() as stack:
        started = {name: stack.enter_context(make()) for name, make in setups.items()}
        for name, (url, _) in started.items():
            # another seed: other prompts (and another shared prefix), so the runs start with a cold cache
            bench(url, out_dir / f"{name}-warmup.json", args, "inf", args.warmup_prompts, workload, f"{name} warmup",
                  args.seed + 1)
        turn = 0
        for rnd in range(args.rounds):
            for i, rate in enumerate(args.rates):
                for name in (list(started) if turn % 2 == 0 else list(started)[::-1]):
                    url, metric_urls = started[name]
                    before = {k: scrape(u) for k, u in metric_urls.items()}
                    # a seed per round and rate, the same for every setup: the prompts miss the prefix cache
                    seed = args.seed + 2 + rnd * len(args.rates) + i
                    result = bench(url, out_dir / f"{name}-round{rnd}-rate{rate}.json", args, rate, args.num_prompts,
                                   workload, f"{name} round {rnd} rate {rate}", seed)
                    after = {k: scrape(u) for k, u in metric_urls.items()}
                    rows.append({"setup": name, "round": rnd, "rate": rate, "load": os.getloadavg()[0],
                                 "result": result, "delta": {k: metric_delta(before[k], after[k]) for k in metric_urls}})
                    print(f"{name} round {rnd} rate {rate}: {summary(rows[-1])}", file=sys.stderr, flush=True)
                turn += 1
    return sorted(rows, key=lambda row: (list(setups).index(row["setup"]), row["rate"], row["round"]))


def idle_slo(args, workload: list[str], out_dir: pathlib.Path) -> tuple[list[str], float, float]:
    """--slo-from-idle: the SLO as multiples of one 1-thread engine's idle TTFT and TPOT, that idle TPOT (ms),
    and its idle prefill cost per prompt token (ms: the median TTFT over the mean prompt)."""
    ttft_x, tpot_x = args.slo_from_idle
    with colocated("idle", 1, 1, out_dir) as (url, _):
        bench(url, out_dir / "idle-warmup.json", args, "inf", 2, workload, "idle warmup", args.seed + 1)
        r = bench(url, out_dir / "idle.json", args, "inf", args.idle_prompts, [*workload, "--max-concurrency", "1"],
                  "idle", args.seed)
    ttft, tpot = r["median_ttft_ms"], r["median_tpot_ms"]
    slo = [f"ttft:{ttft * ttft_x:.0f}", f"tpot:{tpot * tpot_x:.1f}"]
    print(f"idle (one engine, one thread, one request at a time, {args.idle_prompts} requests): median TTFT "
          f"{ttft:.1f} ms, median TPOT {tpot:.2f} ms -> SLO {' '.join(slo)} ({ttft_x:g}x, {tpot_x:g}x)", flush=True)
    return slo, tpot, ttft / (r["total_input_tokens"] / r["completed"])


def metric_delta(before: dict, after: dict) -> dict[str, float]:
    """The counters this report reads, as increments over one run."""
    names = {"pd": ("atomd_router:decision_total", {"decision": "pd"}),
             "decode_without_kv": ("atomd_router:decision_total", {"decision": "decode_without_kv"}),
             "local_prefill": ("atomd_router:decision_total", {"decision": "local_prefill"}),
             "kv_transfer_bytes": ("atomd:kv_transfer_bytes_total", {}),
             "prefix_cache_hits": ("atomd:prefix_cache_hits_total", {}),
             "prefix_cache_queries": ("atomd:prefix_cache_queries_total", {})}
    return {k: total(after, n, **ls) - total(before, n, **ls) for k, (n, ls) in names.items()}


def summary(row: dict) -> str:
    r = row["result"]
    good = r.get("good_completed")
    return (f"ttft p99 {r['p99_ttft_ms']:.0f} ms, itl p99 {r['p99_itl_ms']:.0f} ms, tpot p99 {r['p99_tpot_ms']:.0f} ms, "
            f"out {r['output_throughput']:.1f} tok/s, good {good}/{r['completed']}, failed {r['failed']}, "
            f"metrics {row['delta']}")


def median_rows(rows: list[dict]) -> list[dict]:
    """One row per setup and rate: the median over rounds of each figure."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["setup"], row["rate"]), []).append(row)
    out = []
    for (setup, rate), rs in groups.items():
        med = {k: statistics.median(r["result"][k] for r in rs)
               for k in ("median_ttft_ms", "p99_ttft_ms", "p99_itl_ms", "p99_tpot_ms", "output_throughput")}
        router = [r["delta"].get("router") for r in rs]
        out.append({"setup": setup, "rate": rate, **med,
                    "total": rs[0]["result"]["completed"] + rs[0]["result"]["failed"],
                    "good": statistics.median(r["result"]["good_completed"] for r in rs),
                    "good_each": [r["result"]["good_completed"] for r in rs],
                    "failed": sum(r["result"]["failed"] for r in rs),
                    "decisions": None if router[0] is None else
                    {k: sum(d[k] for d in router) for k in ("pd", "decode_without_kv", "local_prefill")},
                    "load": [round(r["load"], 1) for r in rs]})
    return out


def rescore(result: dict, slos_ms: dict[str, float]) -> int:
    """Requests of one `bench serve` result that meet `slos_ms`, from its per-request arrays
    (the same test as bench serve's --goodput: atomd/bench/metrics.meets_slos)."""
    good = 0
    for prompt_len, output_len, ttft, itl, latency, error in zip(
            result["input_lens"], result["output_lens"], result["ttfts"], result["itls"], result["e2els"],
            result["errors"]):
        r = RequestResult(success=not error, prompt_len=prompt_len, output_len=output_len, ttft=ttft, itl=itl,
                          latency=latency)
        good += r.success and meets_slos(r, slos_ms)
    return good


def goodput(med: list[dict]) -> dict[str, float]:
    """Per setup, the highest rate up to which >= 90% of requests met the SLO at every rate
    of the sweep (0: not even the lowest): a noisy pass above a failed rate does not count."""
    best: dict[str, float] = {}
    failed: set[str] = set()
    for m in sorted(med, key=lambda m: m["rate"]):
        best.setdefault(m["setup"], 0.0)
        if m["setup"] in failed:
            continue
        if m["good"] >= 0.9 * m["total"]:
            best[m["setup"]] = m["rate"]
        else:
            failed.add(m["setup"])
    return best


def markdown(med: list[dict], slo: str) -> str:
    lines = [f"| setup | rate (req/s) | within SLO ({slo}), median (each round) | TTFT p50 (ms) | TTFT p99 (ms) | "
             f"ITL p99 (ms) | TPOT p99 (ms) | output tok/s | failed | PD decisions, all rounds "
             f"(pd / without KV / local prefill) | load avg |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for m in med:
        d = m["decisions"]
        pd = f"{d['pd']:.0f} / {d['decode_without_kv']:.0f} / {d['local_prefill']:.0f}" if d else "-"
        lines.append(f"| {m['setup']} | {m['rate']:g} | {m['good']:.0f}/{m['total']} "
                     f"({', '.join(map(str, m['good_each']))}) | {m['median_ttft_ms']:.0f} | {m['p99_ttft_ms']:.0f} | "
                     f"{m['p99_itl_ms']:.0f} | {m['p99_tpot_ms']:.0f} | {m['output_throughput']:.1f} | {m['failed']} | "
                     f"{pd} | {' '.join(map(str, m['load']))} |")
    return "\n".join(lines)


def targets(med: list[dict]) -> str:
    """The issue's comparisons: goodput per setup; each PD setup against the best colocated
    one; ITL p99 against DP=2 at the highest rate both sustain; TTFT p50 at half that rate."""
    gp = goodput(med)
    by = {(m["setup"], m["rate"]): m for m in med}
    lines = ["goodput (highest rate with >= 90% within SLO): " + ", ".join(f"{k} {v:g} req/s" for k, v in gp.items())]
    colocated_gp = {k: v for k, v in gp.items() if not k.startswith("pd")}
    for pd_name in (k for k in gp if k.startswith("pd")):
        if colocated_gp:
            base = max(colocated_gp, key=colocated_gp.get)
            ratio = f"{gp[pd_name] / gp[base]:.2f}x" if gp[base] else \
                ("n/a: neither sustains the lowest rate" if not gp[pd_name] else "colocated sustains no rate")
            lines.append(f"{pd_name} goodput / best colocated ({base}): {ratio}")
        both = min(gp[pd_name], gp.get("colocated-dp2", 0.0))
        if both:
            a, b = by[(pd_name, both)], by[("colocated-dp2", both)]
            lines.append(f"{pd_name} ITL p99 / colocated-dp2's at {both:g} req/s: {a['p99_itl_ms']:.0f} / "
                         f"{b['p99_itl_ms']:.0f} ms = {a['p99_itl_ms'] / b['p99_itl_ms']:.2f}x")
            for base in colocated_gp:
                if (pd_name, both / 2) in by and (base, both / 2) in by:
                    a, b = by[(pd_name, both / 2)], by[(base, both / 2)]
                    lines.append(f"{pd_name} TTFT p50 / {base}'s at {both / 2:g} req/s: {a['median_ttft_ms']:.0f} / "
                                 f"{b['median_ttft_ms']:.0f} ms = {a['median_ttft_ms'] / b['median_ttft_ms']:.2f}x")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=MODELS, default="builtin", help="benchmarks/model_shapes.py")
    ap.add_argument("--rates", type=float, nargs="+", default=[4.0, 8.0, 12.0])
    ap.add_argument("--rounds", type=int, default=1, help="sweeps of every rate; the report takes medians")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-prompts", type=int, default=8)
    ap.add_argument("--slo", nargs="+", default=["ttft:1000", "tpot:20"], help="bench serve --goodput SLOs")
    ap.add_argument("--slo-from-idle", type=float, nargs=2, metavar=("TTFT_X", "TPOT_X"),
                    help="instead of --slo: these multiples of a 1-thread engine's idle median TTFT and TPOT")
    ap.add_argument("--idle-prompts", type=int, default=8, help="requests of the idle measurement")
    ap.add_argument("--rescore", type=pathlib.Path, metavar="ROWS_JSON",
                    help="run nothing: report an earlier run's rows.json under --slo (per-request data)")
    ap.add_argument("--setups", nargs="+", default=["colocated-2t", "colocated-dp2", "colocated-1t", "pd-1p1d",
                                                    "pd-1p1d-unpinned"],
                    choices=["colocated-2t", "colocated-1t", "colocated-dp2", "pd-1p1d", "pd-1p1d-unpinned",
                             "pd-1p1d-strict", "pd-1p1d-adaptive"])
    ap.add_argument("--local-prefill-max-tokens", type=int, default=256,
                    help="pd-1p1d-adaptive's router flag; -1: what D prefills within one capped step at the idle "
                         "cost per prompt token (with --slo-from-idle and --max-local-prefill-ms-per-step)")
    ap.add_argument("--max-local-prefill-tokens-per-step", type=int, default=64, help="pd-1p1d-adaptive's D flag")
    ap.add_argument("--max-local-prefill-ms-per-step", type=float, default=0.0,
                    help="pd-1p1d-adaptive's D flag instead of the token cap; -1: half the TPOT SLO's slack over the "
                         "idle TPOT ((SLO - idle) / 2; with --slo-from-idle)")
    ap.add_argument("--local-prefill-max-itl-ms", type=float, default=0.0,
                    help="pd-1p1d-adaptive's router flag: a backed-up P's long prompts stay remote while D's streams "
                         "are this slow; -1: the TPOT SLO minus D's time cap (a stream's gap with one capped chunk "
                         "added stays in the SLO)")
    ap.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("/tmp/atomd-bench/pd_vs_colocated"))
    ap.add_argument("--run-timeout-s", type=float, default=300)
    args = ap.parse_args()
    if args.rescore:
        saved = json.loads(args.rescore.read_text())
        slos = parse_goodput(args.slo)
        for row in saved["rows"]:
            row["result"]["good_completed"] = rescore(row["result"], slos)
        med = median_rows(saved["rows"])
        print(f"{saved['model']}, rescored under {' '.join(args.slo)} (the run's own SLO: {' '.join(saved['slo'])})")
        print(markdown(med, " ".join(args.slo)))
        print(targets(med))
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    MODEL_DIR.append(model_dir(args.model))
    print(f"model {args.model} ({MODEL_DIR[0]}), load average at start {os.getloadavg()}", flush=True)
    workload = ["--dataset", "random", "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                "--range-ratio", str(args.range_ratio)]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks on SIGTERM
    slo, idle_tpot, ms_per_prompt_token = idle_slo(args, workload, args.out_dir) if args.slo_from_idle else \
        (args.slo, None, None)
    workload += ["--goodput", *slo]
    cap = ["--max-local-prefill-tokens-per-step", str(args.max_local_prefill_tokens_per_step)]
    if args.max_local_prefill_ms_per_step:
        ms = args.max_local_prefill_ms_per_step
        if ms < 0:  # half a stream's slack per token under the SLO; the ITL bound keeps the other half
            tpot_slo = parse_goodput(slo).get("tpot")
            if tpot_slo is None or idle_tpot is None:
                ap.error("--max-local-prefill-ms-per-step -1 needs --slo-from-idle (and its TPOT)")
            ms = (tpot_slo - idle_tpot) / 2
        cap = ["--max-local-prefill-ms-per-step", f"{ms:.1f}"]
        print(f"pd-1p1d-adaptive: D's local prefill steps capped at {ms:.1f} ms", flush=True)
    short = args.local_prefill_max_tokens
    if short < 0:  # a prompt D prefills within one capped step at the idle cost per token
        if ms_per_prompt_token is None or not args.max_local_prefill_ms_per_step:
            ap.error("--local-prefill-max-tokens -1 needs --slo-from-idle and --max-local-prefill-ms-per-step")
        short = max(1, int(ms / ms_per_prompt_token))
        print(f"pd-1p1d-adaptive: prompts of up to {short} uncached tokens prefill on D", flush=True)
    router_flags = ("--pd-mode", "adaptive", "--local-prefill-max-tokens", str(short))
    if args.local_prefill_max_itl_ms:
        itl_ms = args.local_prefill_max_itl_ms
        if itl_ms < 0:  # D's streams at this gap plus one capped chunk stay within the TPOT SLO
            tpot_slo = parse_goodput(slo).get("tpot")
            if tpot_slo is None or not args.max_local_prefill_ms_per_step:
                ap.error("--local-prefill-max-itl-ms -1 needs a TPOT SLO and --max-local-prefill-ms-per-step")
            itl_ms = tpot_slo - ms
        router_flags += ("--local-prefill-max-itl-ms", f"{itl_ms:.1f}")
        print(f"pd-1p1d-adaptive: long prompts stay remote while D's ITL is >= {itl_ms:.1f} ms", flush=True)
    setups = {"colocated-2t": lambda: colocated("colocated-2t", 2, 1, args.out_dir),
              # a control: what one engine does with one thread, the other core left to the rest
              "colocated-1t": lambda: colocated("colocated-1t", 1, 1, args.out_dir),
              "colocated-dp2": lambda: colocated("colocated-dp2", 1, 2, args.out_dir),
              "pd-1p1d": lambda: disaggregated([], args.out_dir, True),
              # the scheduler free to move P and D off a core a neighbour is busy on
              "pd-1p1d-unpinned": lambda: disaggregated([], args.out_dir, False, "pd-unpinned"),
              "pd-1p1d-strict": lambda: disaggregated([], args.out_dir, True, "pd-strict", ("--pd-mode", "strict")),
              "pd-1p1d-adaptive": lambda: disaggregated(
                  [], args.out_dir, True, "pd-adaptive", router_flags, tuple(cap))}
    rows = run_all({name: setups[name] for name in args.setups}, args, workload, args.out_dir)
    med = median_rows(rows)
    print(f"load average at end {os.getloadavg()}")
    print(markdown(med, " ".join(slo)))
    print(targets(med))
    (args.out_dir / "rows.json").write_text(json.dumps(
        {"model": args.model, "slo": slo, "rows": [{k: v for k, v in row.items() if k != "result"}
                                                     | {"result": row["result"]} for row in rows]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
