"""kv_aware vs round_robin placement of prefill legs, through real engines.

Two prefill engines (`atomd serve --kv-role producer`, KV events on, a KV cache that holds
about half the workload's shared prefixes) and one decode engine, the built-in model, one
torch thread each, behind `python -m router --prefill-policy POLICY`. The workload is
`atomd bench serve --dataset shared-prefix --shared-prefix-groups G`: G system prompts of
`--prefix-len` tokens, each prompt draws one and adds `--input-len` tokens of its own.

round_robin sends every prefix to both engines, so each engine's cache must hold all G and
thrashes; kv_aware follows the engines' KV events and sends a prompt to the engine that
holds its prefix, so each engine keeps about half of them; cache_aware guesses the same
from a prefix tree of what it routed. Reported per policy (medians
over `--rounds` rounds, the policies alternating, every prefix cache reset before a run):
the prefill engines' prefix-cache hit rate (hit tokens / looked-up tokens, from their
/metrics) and the client's TTFT (mean and median, from the bench's result JSON), with
the machine's load average.

Run: `.venv/bin/python -m benchmarks.router_kv_aware --rounds 3 --out benchmarks/results/router_kv_aware.md`.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from launch.process import EngineServer, RouterServer, free_port, http
from benchmarks.machine import loadavg

ROOT = pathlib.Path(__file__).resolve().parents[1]


def counters(url: str) -> dict[str, float]:
    status, body = http("GET", url + "/metrics")
    assert status == 200, body
    out = {"hits": 0.0, "queries": 0.0}
    for line in body.decode().splitlines():
        if line.startswith("atomd:prefix_cache_hits_total"):
            out["hits"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("atomd:prefix_cache_queries_total"):
            out["queries"] += float(line.rsplit(" ", 1)[1])
    return out


def run_once(args, engines: dict[str, EngineServer], policy: str, seed: int, workdir: pathlib.Path) -> dict:
    for e in engines.values():
        status, body = http("POST", e.url + "/reset_prefix_cache")
        assert status == 200, body
    router = RouterServer([engines["p0"].url, engines["p1"].url], [engines["d"].url], "--prefill-policy", policy,
                          "--decode-policy", "round_robin", "--health-interval-s", "0.5",
                          log=workdir / f"router-{policy}-{seed}.log", cwd=ROOT).wait_ready(60)
    try:
        if policy == "kv_aware":  # subscribed to both engines' events before the first request
            deadline = time.monotonic() + 30
            while True:
                listing = json.loads(http("GET", router.url + "/workers")[1])
                ranks = [r for w in listing["workers"] if w["role"] == "prefill" for r in w.get("kv_events", [])]
                if len(ranks) == 2 and all(r["last_seq"] is not None for r in ranks):
                    break
                assert time.monotonic() < deadline, listing
                time.sleep(0.2)
        before = {n: counters(engines[n].url) for n in ("p0", "p1")}
        result_json = workdir / f"bench-{policy}-{seed}.json"
        load_before = loadavg()
        cmd = [sys.executable, "-m", "atomd", "bench", "serve", "--base-url", router.url, "--dataset", "shared-prefix",
               "--shared-prefix-len", str(args.prefix_len), "--shared-prefix-groups", str(args.groups),
               "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--num-prompts",
               str(args.num_prompts), "--max-concurrency", str(args.concurrency), "--seed", str(seed),
               "--result-json", str(result_json), "--disable-tqdm", "--label", policy]
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        after = {n: counters(engines[n].url) for n in ("p0", "p1")}
        bench = json.loads(result_json.read_text())
        hits = sum(after[n]["hits"] - before[n]["hits"] for n in after)
        queries = sum(after[n]["queries"] - before[n]["queries"] for n in after)
        status, metrics = http("GET", router.url + "/metrics")
        decisions = {line.split("{", 1)[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
                     for line in metrics.decode().splitlines()
                     if line.startswith("atomd_router:decision_total{") and 'role="prefill"' in line}
        return {"policy": policy, "seed": seed, "hit_rate": hits / queries if queries else 0.0, "hit_tokens": hits,
                "queried_tokens": queries, "mean_ttft_ms": bench["mean_ttft_ms"],
                "median_ttft_ms": bench["median_ttft_ms"], "completed": bench["completed"],
                "per_engine_queries": {n: after[n]["queries"] - before[n]["queries"] for n in after},
                "decisions": decisions, "loadavg": f"{load_before} -> {loadavg()}"}
    finally:
        router.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--groups", type=int, default=8, help="distinct shared prefixes")
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--kv-blocks", type=int, default=0,
                    help="prefill engines' KV cache in blocks (default: room for about half the prefixes)")
    ap.add_argument("--policies", default="round_robin,kv_aware,cache_aware",
                    help="prefill policies to compare (round_robin and kv_aware required)")
    ap.add_argument("--out", default=None, help="write the markdown report here")
    ap.add_argument("--json", default=None, help="write the raw results here")
    args = ap.parse_args()
    per_prompt = -(-(args.prefix_len + args.input_len + args.output_len) // 16)
    blocks = args.kv_blocks or (args.groups // 2) * (args.prefix_len // 16) + 2 * per_prompt
    max_len = str(max(512, 16 * per_prompt))
    common = ["--num-threads", "1", "--max-model-len", max_len, "--max-num-seqs", "16"]
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="router-kv-aware-"))
    engines: dict[str, EngineServer] = {}
    try:
        for name in ("p0", "p1"):
            port, events, replay = free_port(), free_port(), free_port()
            engines[name] = EngineServer(None, *common, "--kv-role", "producer", "--num-kvcache-blocks", str(blocks),
                                         "--kv-events-endpoint", f"tcp://127.0.0.1:{events}",
                                         "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}", port=port,
                                         log=workdir / f"{name}.log", cwd=ROOT)
        engines["d"] = EngineServer(None, *common, "--kv-role", "consumer", log=workdir / "d.log", cwd=ROOT)
        for e in engines.values():
            e.wait_ready(300)
        runs = []
        policies = args.policies.split(",")
        for rnd in range(args.rounds):
            order = policies[rnd % len(policies):] + policies[:rnd % len(policies)]
            for policy in order:
                r = run_once(args, engines, policy, seed=rnd, workdir=workdir)
                runs.append(r)
                print(json.dumps(r), flush=True)
    finally:
        for e in engines.values():
            e.stop()
    med = {}
    for policy in policies:
        rs = [r for r in runs if r["policy"] == policy]
        med[policy] = {k: statistics.median(r[k] for r in rs) for k in ("hit_rate", "mean_ttft_ms", "median_ttft_ms")}
    rr, kv = med["round_robin"], med["kv_aware"]
    lines = [
        f"Workload: {args.num_prompts} prompts, {args.groups} shared prefixes of {args.prefix_len} tokens + "
        f"{args.input_len} own tokens, {args.output_len} output tokens, concurrency {args.concurrency}; 2 prefill "
        f"engines with {blocks} KV blocks each (about {args.groups // 2} prefixes), 1 decode engine; "
        f"{args.rounds} rounds, medians.", "",
        "| prefill policy | prefix-cache hit rate (P engines) | mean TTFT (ms) | median TTFT (ms) |",
        "|---|---|---|---|"]
    for policy in policies:
        m = med[policy]
        lines.append(f"| {policy} | {m['hit_rate'] * 100:.1f}% | {m['mean_ttft_ms']:.1f} | {m['median_ttft_ms']:.1f} |")
    lines += ["", f"- kv_aware: hit rate {kv['hit_rate'] * 100:.1f}% vs {rr['hit_rate'] * 100:.1f}% "
                  f"({kv['hit_rate'] / rr['hit_rate']:.2f}x); mean TTFT {kv['mean_ttft_ms']:.1f} vs "
                  f"{rr['mean_ttft_ms']:.1f} ms ({(1 - kv['mean_ttft_ms'] / rr['mean_ttft_ms']) * 100:.0f}% saved), "
                  f"median {kv['median_ttft_ms']:.1f} vs {rr['median_ttft_ms']:.1f} ms.",
              "- per run (policy, hit rate, mean TTFT ms, load average before -> after): " +
              "; ".join(f"{r['policy']} {r['hit_rate'] * 100:.0f}% {r['mean_ttft_ms']:.0f} ({r['loadavg']})"
                        for r in runs),
              f"- machine: nproc={os.cpu_count()}"]
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
