#!/usr/bin/env python
"""The PrefillDelayer under DP = 2 in lockstep mode: delayer off, align and coalesce, one run.

Each mode starts `atomd serve --data-parallel-size 2 --dp-lockstep --prefill-delayer MODE`
(one torch thread per rank) and drives it with `atomd bench serve`: random token-id
prompts of mixed lengths (--input-len with --range-ratio), bursty arrivals (gamma
inter-arrival times, --burstiness < 1), exactly --output-len tokens each (ignore_eos).
Lockstep ends every tick with an all-reduce over the two ranks, as MoE expert parallelism
forces, so a prefill on one rank stalls the other rank's decode: the cost the delayer cuts.
Modes are interleaved per round; the table reports each mode and its ratio to `off` in the
same round, plus the delayer's decisions from /metrics.

    .venv/bin/python -m benchmarks.prefill_delayer --rounds 1

With `--expert-parallel` (an MoE shape, `--shape qwen3-moe-small`) the coupling is real
instead of emulated: `--enable-expert-parallel` in place of `--dp-lockstep`, each rank holding
half the experts and exchanging tokens per sparse layer; mode `replicas` is the same model as
two independent DP replicas (every expert on each, no group), at the same cores. The table
then adds each rank's time in the all-to-alls per exchange (a sparse layer's three) and as a
share of the run.

    .venv/bin/python -m benchmarks.prefill_delayer --shape qwen3-moe-small --expert-parallel \
        --modes off,align,coalesce,replicas --rounds 3 --burstiness 1,0.25

`--burstiness` takes a list (1: Poisson; < 1 bursts): each round runs every mode under each.

On a loaded machine wall-clock throughput mostly measures the other processes. So the engines
run with $ATOMD_STEP_SAMPLES and the table also gives the tick trace's view (the ranks' ticks,
atomd/engine/core.py `tick_samples`): the critical path, the sum over ticks of the slower rank's
CPU time in that tick (what the run would take on two cores of its own, the transport aside),
output tokens per critical-path second, how many ticks had both ranks prefilling (coalesced)
and how many had one prefilling while the other decoded (a stall: the decoding rank waits in
every sparse layer). For `replicas` (no group, no ticks) the critical path is the busier
engine core's CPU time over the run.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from collections import Counter

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.machine import cpu_model, loadavg
from benchmarks.model_shapes import CHOICES, model_dir
from launch.process import EngineServer, http

REPO = pathlib.Path(__file__).resolve().parent.parent

MODES = ("off", "align", "coalesce")
KEYS = (("output_throughput", "out tok/s"), ("median_ttft_ms", "TTFT p50 ms"), ("p99_ttft_ms", "TTFT p99 ms"),
        ("p99_itl_ms", "ITL p99 ms"))


def delayer_outcomes(url: str) -> Counter:
    status, body = http("GET", url + "/metrics")
    assert status == 200, body
    out: Counter = Counter()
    for family in text_string_to_metric_families(body.decode()):
        if family.name == "atomd:prefill_delayer_outcomes":
            for s in family.samples:
                if s.name.endswith("_total") and s.labels["dp_rank"] == "0":
                    out[f"{s.labels['outcome']}/{s.labels['reason']}"] += int(s.value)
    return out


def exchange_stats(url: str) -> list[dict]:
    """Each rank's expert-parallel exchange counters (/debug/stats)."""
    status, body = http("GET", url + "/debug/stats")
    assert status == 200, body
    return [r.get("expert_parallel") or {} for r in json.loads(body).get("ranks", [])]


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tick_view(url: str, keep: pathlib.Path) -> dict:
    """The tick trace's numbers (see the module docstring) from the ranks' `tick_samples`
    (kept in `keep`): ticks with a forward on some rank only (idle ticks before and after the load are the
    exchanges' gate alone)."""
    status, body = http("GET", url + "/debug/stats")
    assert status == 200, body
    ranks = [r["tick_samples"] for r in json.loads(body)["ranks"]]
    keep.write_text(json.dumps(ranks))
    busy = [tick for tick in zip(*ranks) if any(kind >= 0 for *_, kind, _ in tick)]
    kinds = [{kind for *_, kind, _ in tick} for tick in busy]
    return {"critical_s": sum(max(cpu for _, _, cpu, *_ in tick) for tick in busy),
            "busy_ticks": len(busy),
            "coalesced": sum(all(kind == 1 for *_, kind, _ in tick) for tick in busy),
            "stalls": sum(k >= {0, 1} for k in kinds),
            "prefill_ticks": sum(1 in k for k in kinds)}


KIND = {1: "P", 0: "D", -1: "-"}


def tick_breakdown(work: pathlib.Path) -> None:
    """Where each mode's critical path went, over every kept tick trace of the run: per pair of
    the ranks' tick kinds (P prefill, D decode, - none), the ticks and their critical seconds."""
    by_mode: dict[tuple[str, str], Counter] = {}
    for path in sorted(work.glob("*-ticks.json")):
        mode, _, b = path.name[:-len("-ticks.json")].split("-")
        ticks, seconds = by_mode.setdefault((b[1:], mode), Counter()), by_mode.setdefault((b[1:], mode + "_s"), Counter())
        for tick in zip(*json.loads(path.read_text())):
            pair = "".join(sorted(KIND[kind] for *_, kind, _ in tick))
            if pair != "--":
                ticks[pair] += 1
                seconds[pair] += max(cpu for _, _, cpu, *_ in tick)
    pairs = ["PP", "DP", "-P", "DD", "-D"]
    print("\nWhere the critical path went (all rounds; ticks, critical s), per pair of the ranks' tick kinds "
          "(P prefill, D decode, - no forward):\n")
    print("| burstiness | mode | " + " | ".join(pairs) + " |\n|---|---|" + "---|" * len(pairs))
    for (b, mode), ticks in sorted(by_mode.items()):
        if not mode.endswith("_s"):
            seconds = by_mode[b, mode + "_s"]
            print(f"| {b} | {mode} | " + " | ".join(f"{ticks[p]}, {seconds[p]:.2f} s" for p in pairs) + " |")


def run_mode(mode: str, args: argparse.Namespace, work: pathlib.Path, rnd: int, burstiness: float) -> dict:
    # a pool the load fills past the delayer's 10% low watermark, as a loaded GPU server would
    engine = ["--max-model-len", "1024", "--num-threads", "1", "--max-num-seqs", "64", "--num-kvcache-blocks", "512",
              "--data-parallel-size", "2"]
    if mode == "replicas":  # two independent replicas: no group, no coupling
        engine += ["--prefill-delayer", "off"]
    else:
        engine += ["--enable-expert-parallel" if args.expert_parallel else "--dp-lockstep", "--prefill-delayer", mode]
    name = f"{mode}-{rnd}-b{burstiness}"
    server = EngineServer(model_dir(args.shape), *engine, log=work / f"{name}.log", cwd=REPO,
                          env=dict(os.environ, ATOMD_STEP_SAMPLES="100000"))
    try:
        server.wait_ready()
        result_path = work / f"{name}.json"
        cores = server.engine_pids()
        cpu_before = [process_cpu_s(pid) for pid in cores]
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "atomd", "bench", "serve", "--base-url", server.url,
                        "--dataset", "random", "--num-prompts", str(args.num_prompts),
                        "--input-len", str(args.input_len), "--range-ratio", str(args.range_ratio),
                        "--output-len", str(args.output_len), "--request-rate", str(args.request_rate),
                        "--burstiness", str(burstiness), "--ignore-eos", "--seed", str(args.seed),
                        "--metric-percentiles", "50,99", "--result-json", str(result_path), "--disable-tqdm"],
                       cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        result = json.loads(result_path.read_text())
        result["wall_s"] = time.monotonic() - started
        cpu = [process_cpu_s(pid) - before for pid, before in zip(cores, cpu_before)]
        result["ticks"] = {"critical_s": max(cpu)} if mode == "replicas" else tick_view(server.url, work / f"{name}-ticks.json")
        result["ticks"]["cpu_s"] = cpu
        result["critical_tput"] = result["total_output_tokens"] / result["ticks"]["critical_s"]
        result["delayer"] = delayer_outcomes(server.url) if mode not in ("off", "replicas") else Counter()
        result["exchange"] = exchange_stats(server.url) if args.expert_parallel and mode != "replicas" else []
        return result
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=384)
    ap.add_argument("--range-ratio", type=float, default=0.9, help="prompt lengths in L*(1 -+ r)")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--request-rate", type=float, default=8.0)
    ap.add_argument("--burstiness", default="0.25", help="gamma shapes, comma-separated: 1 is Poisson, < 1 burstier")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shape", choices=CHOICES, default="builtin", help="benchmarks/model_shapes.py")
    ap.add_argument("--expert-parallel", action="store_true",
                    help="--enable-expert-parallel (an MoE --shape) instead of --dp-lockstep")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {MODES} and replicas "
                    "(two independent replicas; with --expert-parallel)")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if "off" not in modes or not set(modes) <= {*MODES, "replicas"}:
        ap.error(f"--modes: off and any of {MODES[1:]} and replicas")
    work = pathlib.Path(tempfile.mkdtemp(prefix="atomd-delayer-bench-"))
    print(f"CPU: {cpu_model()}; load average before: {loadavg()}", flush=True)
    burstinesses = [float(b) for b in args.burstiness.split(",")]
    rows = []
    ratios = {(b, m): {"wall": [], "critical": [], "itl": []} for b in burstinesses for m in modes}
    for rnd in range(args.rounds):
        for b in burstinesses:
            results = {mode: run_mode(mode, args, work, rnd, b) for mode in modes}
            off = results["off"]
            for mode in modes:
                r, t = results[mode], results[mode]["ticks"]
                ratio = ratios[b, mode]
                ratio["wall"].append(r["output_throughput"] / off["output_throughput"])
                ratio["critical"].append(r["critical_tput"] / off["critical_tput"])
                ratio["itl"].append(r["p99_itl_ms"] / off["p99_itl_ms"])
                exchange = "; ".join(f"{1000 * e['exchange_s'] / max(e['num_exchanges'], 1):.2f} ms, "
                                     f"{e['exchange_s'] / r['wall_s']:.0%}" for e in r["exchange"] if e) or "-"
                trace = (f"{t['busy_ticks']} / {t['prefill_ticks']} / {t['coalesced']} / {t['stalls']}"
                         if "busy_ticks" in t else "-")
                rows.append([str(rnd), f"{b:g}", mode] + [f"{r[k]:.1f}" for k, _ in KEYS]
                            + [f"{ratio['wall'][-1]:.2f}", f"{t['critical_s']:.2f}",
                               " + ".join(f"{c:.1f}" for c in t["cpu_s"]), f"{r['critical_tput']:.1f}",
                               f"{ratio['critical'][-1]:.2f}", trace, exchange,
                               ", ".join(f"{k} {v}" for k, v in sorted(r["delayer"].items())) or "-"])
            print(f"round {rnd} burstiness {b:g} done; load average: {loadavg()}", file=sys.stderr, flush=True)
    header = (["round", "burstiness", "mode"] + [name for _, name in KEYS]
              + ["tok/s vs off", "critical path s", "CPU s (rank 0 + 1)", "tok per critical s", "vs off",
                 "busy / prefill / coalesced / stall ticks", "all-to-all per exchange, share of run (rank 0; 1)",
                 "rank 0 decisions"])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")

    def median(v: list[float]) -> str:
        return f"{sorted(v)[len(v) // 2]:.2f}x ({min(v):.2f}-{max(v):.2f})"
    print("\n| burstiness | mode | wall tok/s vs off | critical-path tok/s vs off | ITL p99 vs off |\n|---|---|---|---|---|")
    for (b, m), v in ratios.items():
        print(f"| {b:g} | {m} | {median(v['wall'])} | {median(v['critical'])} | {median(v['itl'])} |")
    tick_breakdown(work)
    print(f"load average after: {loadavg()}")
    print(f"logs and result JSON: {work}")


if __name__ == "__main__":
    main()
