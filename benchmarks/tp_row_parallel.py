#!/usr/bin/env python
"""The cost of tensor parallelism's float32 row-parallel partials in bf16 (DecoderModel.row_parallel):
one TP worker's o_proj and down_proj as linear.linear_f32 runs them (quant.gemm_bf16_f32, csrc/quant_w16.h's
vdpbf16ps panels) against the bf16 linear
they replace (oneDNN on the packed weight, output rounded to bf16), at several step sizes M, one
thread, same run, alternating per round. The shapes: a worker's slice of the smollm-135m shape
(hidden 576, intermediate 1536, 9 query heads of 64) at TP=3, the split that shape allows; the
per-step figure is 30 layers x (o + down). Wall and CPU time (time.process_time) per call, medians.

    .venv/bin/python -m benchmarks.tp_row_parallel --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from atomd.model.linear import linear, linear_f32, onednn_runs, pack_linear_weight
from benchmarks.machine import cpu_model, loadavg

HIDDEN, INTER, HEADS, HEAD_DIM, LAYERS, TP = 576, 1536, 9, 64, 30, 3


def per_call(fn, calls: int) -> tuple[float, float]:
    """(wall, CPU) seconds per call of fn, over `calls` calls after one warm-up call."""
    fn()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - wall) / calls, (time.process_time() - cpu) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 512])
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    shapes = {"o": (HIDDEN, HEADS * HEAD_DIM // TP), "down": (HIDDEN, INTER // TP)}  # [N, K] of a worker
    plain = {name: torch.randn(*shape, generator=g).bfloat16() for name, shape in shapes.items()}
    packed = {name: pack_linear_weight(w) if onednn_runs(torch.bfloat16) else w for name, w in plain.items()}
    print(f"CPU {cpu_model()}; load {loadavg()}; 1 thread; TP={TP} worker of smollm-135m, {LAYERS} layers")
    for m in args.rows:
        xs = {name: torch.randn(m, shape[1], generator=g).bfloat16() for name, shape in shapes.items()}
        calls = max(3, 2000 // m)
        rounds: dict[str, list[tuple[float, float]]] = {"bf16": [], "f32": []}
        for _ in range(args.rounds):
            rounds["bf16"].append(tuple(map(sum, zip(*(per_call(lambda n=n: linear(xs[n], packed[n]), calls)
                                                         for n in shapes)))))
            rounds["f32"].append(tuple(map(sum, zip(*(per_call(lambda n=n: linear_f32(xs[n], plain[n]), calls)
                                                        for n in shapes)))))
        med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for k, v in rounds.items()}
        extra = (med["f32"][0] - med["bf16"][0]) * LAYERS * 1e3
        extra_cpu = (med["f32"][1] - med["bf16"][1]) * LAYERS * 1e3
        print(f"M={m:4d}: o+down bf16 {med['bf16'][0] * 1e6:8.1f} us (cpu {med['bf16'][1] * 1e6:8.1f}), "
              f"float32 partials {med['f32'][0] * 1e6:8.1f} us (cpu {med['f32'][1] * 1e6:8.1f}); "
              f"f32/bf16 {med['f32'][0] / med['bf16'][0]:.2f}x; per step {extra:+.2f} ms (cpu {extra_cpu:+.2f} ms)")
    print(f"load after {loadavg()}")


if __name__ == "__main__":
    main()
