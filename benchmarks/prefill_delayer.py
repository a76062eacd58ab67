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
"""
from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
from collections import Counter

from prometheus_client.parser import text_string_to_metric_families

from atomd.model.default import default_model_dir
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


def run_mode(mode: str, args: argparse.Namespace, work: pathlib.Path, rnd: int) -> dict:
    # a pool the load fills past the delayer's 10% low watermark, as a loaded GPU server would
    engine = ["--max-model-len", "1024", "--num-threads", "1", "--max-num-seqs", "64", "--num-kvcache-blocks", "512",
              "--data-parallel-size", "2", "--dp-lockstep", "--prefill-delayer", mode]
    server = EngineServer(default_model_dir(), *engine, log=work / f"{mode}-{rnd}.log", cwd=REPO)
    try:
        server.wait_ready()
        result_path = work / f"{mode}-{rnd}.json"
        subprocess.run([sys.executable, "-m", "atomd", "bench", "serve", "--base-url", server.url,
                        "--dataset", "random", "--num-prompts", str(args.num_prompts),
                        "--input-len", str(args.input_len), "--range-ratio", str(args.range_ratio),
                        "--output-len", str(args.output_len), "--request-rate", str(args.request_rate),
                        "--burstiness", str(args.burstiness), "--ignore-eos", "--seed", str(args.seed),
                        "--metric-percentiles", "50,99", "--result-json", str(result_path), "--disable-tqdm"],
                       cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        result = json.loads(result_path.read_text())
        result["delayer"] = delayer_outcomes(server.url) if mode != "off" else Counter()
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
    ap.add_argument("--burstiness", type=float, default=0.25, help="gamma shape; < 1 is burstier than Poisson")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="atomd-delayer-bench-"))
    rows = []
    for rnd in range(args.rounds):
        results = {mode: run_mode(mode, args, work, rnd) for mode in MODES}
        for mode in MODES:
            r = results[mode]
            ratio = r["output_throughput"] / results["off"]["output_throughput"]
            rows.append([str(rnd), mode] + [f"{r[k]:.1f}" for k, _ in KEYS] + [f"{ratio:.2f}",
                        ", ".join(f"{k} {v}" for k, v in sorted(r["delayer"].items())) or "-"])
    header = ["round", "delayer"] + [name for _, name in KEYS] + ["tok/s vs off", "rank 0 decisions"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\nlogs and result JSON: {work}")


if __name__ == "__main__":
    main()
