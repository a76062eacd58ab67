#!/usr/bin/env python
"""1 prefill + 1 decode engine (one core each, via the router) against one colocated engine
given the same two cores, on the same Poisson arrivals of long prompts with long outputs.

Setups: colocated-2t (one engine, 2 torch threads), colocated-dp2 (`--data-parallel-size 2`,
one thread per rank), colocated-1t (a control: one engine, one thread), pd-1p1d (P's and D's
engine threads pinned to cores 0 and 1), pd-1p1d-unpinned, and pinned 1P+1D behind a router in
`--pd-mode strict` (pd-1p1d-strict) or `--pd-mode adaptive` with D capped by
`--max-local-prefill-tokens-per-step` (pd-1p1d-adaptive; router/adaptive.py).

Every setup is started fresh by this script (free ports, stopped in `finally`), warmed up
with two requests, then `atomd bench serve` (a subprocess) runs the same seeded workload at
each request rate; its result JSON gives TTFT/ITL p99, output throughput and goodput under
an SLO. The router's `decision_total` is read from its /metrics around each run: a PD run
where D recomputed prompts (decision="decode_without_kv") is flagged, not reported as PD.

    .venv/bin/python -m benchmarks.pd_vs_colocated --rates 4 8 12 --num-prompts 40
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from atomd.model.default import default_model_dir
from launch.process import EngineServer, RouterServer

REPO = pathlib.Path(__file__).resolve().parent.parent
ENGINE_ARGS = ["--max-model-len", "1024", "--max-num-seqs", "64"]


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
    srv = EngineServer(default_model_dir(), *ENGINE_ARGS, "--num-threads", str(threads), "--data-parallel-size",
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
            started.append(EngineServer(default_model_dir(), *ENGINE_ARGS, "--num-threads", "1", "--kv-role", role,
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
    """Start every setup (idle engines cost no CPU), warm each up, then per rate run the setups
    back to back, in alternating order, so they see the same background load of the machine."""
    rows = []
    with contextlib.ExitStack() as stack:
        started = {name: stack.enter_context(make()) for name, make in setups.items()}
        for name, (url, _) in started.items():
            # another seed: other prompts (and another shared prefix), so the runs start with a cold cache
            bench(url, out_dir / f"{name}-warmup.json", args, "inf", args.warmup_prompts, workload, f"{name} warmup",
                  args.seed + 1)
        for i, rate in enumerate(args.rates):
            for name in (list(started) if i % 2 == 0 else list(started)[::-1]):
                url, metric_urls = started[name]
                before = {k: scrape(u) for k, u in metric_urls.items()}
                # a seed per rate, the same for every setup: a rate's prompts miss the prefix cache
                result = bench(url, out_dir / f"{name}-rate{rate}.json", args, rate, args.num_prompts, workload,
                               f"{name} rate {rate}", args.seed + 2 + i)
                after = {k: scrape(u) for k, u in metric_urls.items()}
                rows.append({"setup": name, "rate": rate, "load": os.getloadavg()[0], "result": result,
                             "delta": {k: metric_delta(before[k], after[k]) for k in metric_urls}})
                print(f"{name} rate {rate}: {summary(rows[-1])}", file=sys.stderr, flush=True)
    return sorted(rows, key=lambda row: (list(setups).index(row["setup"]), row["rate"]))


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


def markdown(rows: list[dict], slo: str) -> str:
    lines = [f"| setup | rate (req/s) | TTFT p99 (ms) | ITL p99 (ms) | TPOT p99 (ms) | output tok/s | "
             f"goodput (req/s) | within SLO ({slo}) | PD decisions (pd / without KV / local prefill) | load avg |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for row in rows:
        r, d = row["result"], row["delta"]
        router = d.get("router", {})
        pd = f"{router['pd']:.0f} / {router['decode_without_kv']:.0f} / {router['local_prefill']:.0f}" \
            if router else "-"
        lines.append(f"| {row['setup']} | {row['rate']} | {r['p99_ttft_ms']:.0f} | {r['p99_itl_ms']:.0f} | "
                     f"{r['p99_tpot_ms']:.0f} | {r['output_throughput']:.1f} | {r['request_goodput']:.3f} | "
                     f"{r['good_completed']}/{r['completed'] + r['failed']} | {pd} | {row['load']:.1f} |")
    return "\n".join(lines)


def factors(rows: list[dict]) -> str:
    """PD / colocated requests within SLO at each rate, for every PD and colocated setup."""
    by = {(row["setup"], row["rate"]): row["result"] for row in rows}
    setups = list(dict.fromkeys(row["setup"] for row in rows))
    lines = []
    for pd_name in (s for s in setups if s.startswith("pd")):
        for base in (s for s in setups if not s.startswith("pd")):
            for rate in sorted({r for _, r in by}):
                pd, col = by.get((pd_name, rate)), by.get((base, rate))
                if pd and col:
                    ratio = f"{pd['good_completed'] / col['good_completed']:.2f}x" if col["good_completed"] else "inf"
                    lines.append(f"rate {rate}: {pd_name} {pd['good_completed']} vs {base} {col['good_completed']} "
                                 f"requests within SLO ({ratio})")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[4.0, 8.0, 12.0])
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-prompts", type=int, default=8)
    ap.add_argument("--slo", nargs="+", default=["ttft:1000", "tpot:20"], help="bench serve --goodput SLOs")
    ap.add_argument("--setups", nargs="+", default=["colocated-2t", "colocated-dp2", "colocated-1t", "pd-1p1d",
                                                    "pd-1p1d-unpinned"],
                    choices=["colocated-2t", "colocated-1t", "colocated-dp2", "pd-1p1d", "pd-1p1d-unpinned",
                             "pd-1p1d-strict", "pd-1p1d-adaptive"])
    ap.add_argument("--local-prefill-max-tokens", type=int, default=256, help="pd-1p1d-adaptive's router flag")
    ap.add_argument("--max-local-prefill-tokens-per-step", type=int, default=64, help="pd-1p1d-adaptive's D flag")
    ap.add_argument("--out-dir", type=pathlib.Path, default=pathlib.Path("/tmp/atomd-bench/pd_vs_colocated"))
    ap.add_argument("--run-timeout-s", type=float, default=300)
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    workload = ["--dataset", "random", "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                "--range-ratio", str(args.range_ratio), "--goodput", *args.slo]
    setups = {"colocated-2t": lambda: colocated("colocated-2t", 2, 1, args.out_dir),
              # a control: what one engine does with one thread, the other core left to the rest
              "colocated-1t": lambda: colocated("colocated-1t", 1, 1, args.out_dir),
              "colocated-dp2": lambda: colocated("colocated-dp2", 1, 2, args.out_dir),
              "pd-1p1d": lambda: disaggregated([], args.out_dir, True),
              # the scheduler free to move P and D off a core a neighbour is busy on
              "pd-1p1d-unpinned": lambda: disaggregated([], args.out_dir, False, "pd-unpinned"),
              "pd-1p1d-strict": lambda: disaggregated([], args.out_dir, True, "pd-strict", ("--pd-mode", "strict")),
              "pd-1p1d-adaptive": lambda: disaggregated(
                  [], args.out_dir, True, "pd-adaptive",
                  ("--pd-mode", "adaptive", "--local-prefill-max-tokens", str(args.local_prefill_max_tokens)),
                  ("--max-local-prefill-tokens-per-step", str(args.max_local_prefill_tokens_per_step)))}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks on SIGTERM
    rows = run_all({name: setups[name] for name in args.setups}, args, workload, args.out_dir)
    print(markdown(rows, " ".join(args.slo)))
    print(factors(rows))
    (args.out_dir / "rows.json").write_text(json.dumps(
        [{k: v for k, v in row.items() if k != "result"} | {"json": f"{row['setup']}-rate{row['rate']}.json"}
         for row in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
