#!/usr/bin/env python
"""One MoE block (atomd/model/moe.py moe()) over T tokens, by path: where batch-16 decode and
prefill spend their expert time (issue 34).

The block of the issue's Qwen3-MoE benchmark shape (hidden 1024, 64 experts top-8, expert
intermediate 256), bf16, random weights and router, a new random batch each call. Paths:
`amx` (the AMX tile kernel over experts packed at load, layer_ops.moe_amx: where the CPU has
AMX), `grouped` (the AVX512_BF16 grouped C call, layer_ops.moe_grouped), `per-expert` (one
oneDNN GEMM pair per active expert), `default` (what moe() picks); `int8` / `int4` (the same experts
rounded as `--quantization int8|int4` rounds them, int8 activations, float32 x as that engine runs:
layer_ops.moe_q8, AMX-INT8 tiles where the CPU has them, experts of many pairs widened to bf16 tiles),
`int8-int` / `int4-int` (moe.Q8_WIDE_MIN_PAIRS 0: every expert on int8 activations) and `int8-per-expert` /
`int4-per-expert` (moe.Q8 off: one qlinear pair per active expert, what ran before). Each round times every path
in turn (alternating), --calls calls each, in this process's CPU time (both threads: the
machine is shared, so wall time counts waits for a core) and wall time; medians over --rounds.

    .venv/bin/python -m benchmarks.moe_block --tokens 16 128 512 4096 --threads 1 2 --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from atomd.model import layer_ops, moe as moe_mod, quant
from atomd.model.moe import MoeWeights
from benchmarks.machine import cpu_model, loadavg

HIDDEN, EXPERTS, TOP_K, INTER = 1024, 64, 8, 256
PATHS = {  # (moe.AMX, moe.GROUPED, moe.GROUPED_MAX_PAIRS)
    "amx": (True, False, 0),
    "grouped": (False, True, 10**9),
    "per-expert": (False, False, 0),
}
QUANT_PATHS = {"int8": ("int8", True, None), "int4": ("int4", True, None), "int8-per-expert": ("int8", False, None),
               "int4-per-expert": ("int4", False, None), "int8-int": ("int8", True, 0),
               "int4-int": ("int4", True, 0)}  # (--quantization, moe.Q8, moe.Q8_WIDE_MIN_PAIRS: None as set)


def weights(seed: int = 0) -> MoeWeights:
    g = torch.Generator().manual_seed(seed)
    return MoeWeights(router=(torch.randn(EXPERTS, HIDDEN, generator=g) * 0.05).to(torch.bfloat16),
                      gate_up=(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.03).to(torch.bfloat16),
                      down=(torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.06).to(torch.bfloat16),
                      top_k=TOP_K, norm_topk_prob=True)


def quantized(w: MoeWeights, method: str) -> MoeWeights:
    """w's experts rounded as `--quantization method` rounds them (quant.quantize), int8 activations."""
    gate_up, down = [quant.quantize(t.float(), method) for t in w.gate_up], [quant.quantize(t.float(), method) for t in w.down]
    quant.use_int8_activations(gate_up + down)
    return MoeWeights(router=w.router.float(), gate_up=gate_up, down=down, top_k=w.top_k, norm_topk_prob=True)


def timed(fn, calls: int) -> tuple[float, float]:
    """(median process CPU seconds, median wall seconds) per call of fn(i)."""
    cpu, wall = [], []
    for i in range(calls):
        c, t = time.process_time(), time.perf_counter()
        fn(i)
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - t)
    return statistics.median(cpu), statistics.median(wall)


def run(w: MoeWeights, tokens: int, rounds: int, calls: int, paths: list[str]) -> dict[str, tuple[float, float]]:
    g = torch.Generator().manual_seed(tokens)
    xs = [torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16) for _ in range(max(calls, 2))]
    saved = moe_mod.AMX, moe_mod.GROUPED, moe_mod.GROUPED_MAX_PAIRS
    qw = {m: quantized(w, m) for m in {QUANT_PATHS[p][0] for p in paths if p in QUANT_PATHS}}

    def with_path(name):
        if name in QUANT_PATHS:
            method, q8, wide = QUANT_PATHS[name]
            xf = [x.float() for x in xs]
            wide_set = moe_mod.Q8_WIDE_MIN_PAIRS

            def call_q(i):
                moe_mod.Q8, moe_mod.Q8_WIDE_MIN_PAIRS = q8, wide_set if wide is None else wide
                try:
                    moe_mod.moe(xf[i % len(xf)], qw[method])
                finally:
                    moe_mod.Q8, moe_mod.Q8_WIDE_MIN_PAIRS = True, wide_set
            return call_q

        def call(i):
            moe_mod.AMX, moe_mod.GROUPED, moe_mod.GROUPED_MAX_PAIRS = PATHS[name] if name in PATHS else saved
            try:
                moe_mod.moe(xs[i % len(xs)], w)
            finally:
                moe_mod.AMX, moe_mod.GROUPED, moe_mod.GROUPED_MAX_PAIRS = saved
        return call

    fns = {name: with_path(name) for name in paths}
    for fn in fns.values():
        fn(0)  # warm
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            out[name].append(timed(fn, calls))
    return {k: (statistics.median(c for c, _ in v), statistics.median(t for _, t in v)) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 128, 512, 4096])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=0, help="calls a round (0: ~64k tokens' worth, 3 at least)")
    ap.add_argument("--paths", nargs="+", default=["default", *PATHS], choices=["default", *PATHS, *QUANT_PATHS])
    args = ap.parse_args()
    w = weights()
    paths = [p for p in args.paths if p != "amx" or layer_ops.has_moe_amx()]
    print(f"CPU: {cpu_model()}; load before: {loadavg()}; AMX kernel: {layer_ops.has_moe_amx()}")
    print(f"block: hidden {HIDDEN}, {EXPERTS} experts top-{TOP_K}, inter {INTER}, bf16 (int8 / int4: float32 x); "
          f"int8 experts' kernel: {layer_ops.moe_q8_kind()} (2: AMX-INT8 tiles); medians of {args.rounds} "
          f"rounds; ms per call, process CPU / wall")
    print("| threads | tokens | " + " | ".join(paths) + " | " + " | ".join(f"{p} / amx" for p in paths if p != "amx")
          + " |")
    print("|---|---:|" + "---:|" * (2 * len(paths) - ("amx" in paths)))
    for threads in args.threads:
        torch.set_num_threads(threads)
        for tokens in args.tokens:
            calls = args.calls or max(3, 65536 // tokens // 8)
            m = run(w, tokens, args.rounds, calls, paths)
            cells = [f"{m[p][0] * 1e3:.2f} / {m[p][1] * 1e3:.2f}" for p in paths]
            ratios = [f"{m[p][0] / m['amx'][0]:.2f}x / {m[p][1] / m['amx'][1]:.2f}x" for p in paths
                      if p != "amx" and "amx" in m]
            print(f"| {threads} | {tokens} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |", flush=True)
    print(f"load after: {loadavg()}")


if __name__ == "__main__":
    main()
