#!/usr/bin/env python
"""Tensor parallelism on this host: an engine of `--tp` worker processes (one torch thread each)
against the same model in one process (one thread), offline, same run, alternating per round.

Three workloads (greedy, ignore_eos): batch-1 decode (1 x (16 + 64) tokens), batch-16 decode
(16 x (16 + 32)) and prefill (4 x 256 prompt tokens, 1 output). Per workload: tokens/s of each
side (median of the rounds) and TP / single-process; for TP also the steps, the all-reduces and
gathers per step and rank 0's seconds inside the collectives per step (its waits for the slowest
worker included: on a machine with fewer free cores than ranks that is most of it).

The 135M shape has 9 query / 3 KV heads: TP=3 is the split it allows (2 does not divide 9).

    .venv/bin/python -m benchmarks.tensor_parallel --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import time

from atomd.llm import LLM
from benchmarks.machine import cpu_model, loadavg
from benchmarks.model_shapes import CHOICES, model_dir
from contracts.sampling import SamplingParams

WORKLOADS = {"batch 1 decode": (1, 16, 64), "batch 16 decode": (16, 16, 32), "prefill 4 x 256": (4, 256, 1)}


def prompts(batch: int, length: int) -> list[dict]:
    return [{"prompt_token_ids": [(7 * i + 13 * j) % 4000 + 3 for j in range(length)]} for i in range(batch)]


def run(llm: LLM, batch: int, length: int, out: int) -> tuple[float, int]:
    """(tokens/s, forward steps) of one workload; decode counts output tokens, prefill prompt tokens."""
    params = SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True)
    runner, steps = llm.engine.runner, [0]
    execute = runner.execute

    def counted(*a, **kw):
        steps[0] += 1
        return execute(*a, **kw)

    runner.execute = counted
    start = time.perf_counter()
    llm.generate(prompts(batch, length), params)
    elapsed = time.perf_counter() - start
    runner.execute = execute
    return batch * (length if out == 1 else out) / elapsed, steps[0]


def warm(llm: LLM) -> LLM:
    llm.generate(prompts(1, 8), SamplingParams(max_tokens=2))
    return llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-shape", choices=CHOICES, default="smollm-135m")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--communicator", default="shm", choices=["shm", "gloo"])
    args = ap.parse_args()
    path = str(model_dir(args.model_shape))
    common = dict(num_threads=1, max_model_len=512, enable_prefix_caching=False)
    print(f"# {args.model_shape}, TP={args.tp} ({args.communicator}) vs 1 process, 1 thread each; "
          f"CPU {cpu_model()}; load before {loadavg()}", flush=True)
    single: dict[str, list[float]] = {w: [] for w in WORKLOADS}
    tp: dict[str, list[float]] = {w: [] for w in WORKLOADS}
    cost: dict[str, list[tuple[int, int, int, float]]] = {w: [] for w in WORKLOADS}
    for _ in range(args.rounds):
        llm = warm(LLM(path, **common))
        for w, shape in WORKLOADS.items():
            single[w].append(run(llm, *shape)[0])
        del llm
        llm = warm(LLM(path, **common, tensor_parallel_size=args.tp, tp_communicator=args.communicator))
        try:
            t = llm.engine.model.tp
            for w, shape in WORKLOADS.items():
                before = (t.num_all_reduce, t.num_all_gather, t.collective_s)
                rate, steps = run(llm, *shape)
                tp[w].append(rate)
                cost[w].append((steps, t.num_all_reduce - before[0], t.num_all_gather - before[1],
                                t.collective_s - before[2]))
        finally:
            llm.engine.close()
    print(f"# load after {loadavg()}")
    print(f"| workload | 1 process tok/s | TP={args.tp} tok/s | TP / 1 | steps | all-reduces / step | "
          f"gathers / step | collective ms / step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for w in WORKLOADS:
        a, b = statistics.median(single[w]), statistics.median(tp[w])
        steps, red, gat, sec = cost[w][len(cost[w]) // 2]
        print(f"| {w} | {a:.1f} | {b:.1f} | {b / a:.2f}x | {steps} | {red / steps:.1f} | {gat / steps:.1f} | "
              f"{1000 * sec / steps:.2f} |")


if __name__ == "__main__":
    main()
