#!/usr/bin/env python
"""Batch-1 decode of one MoE block (atomd/model/moe.py) against the weight-read bound (issue 34).

The block of the issue's Qwen3-MoE benchmark shape: hidden 1024, 64 experts, top-8, expert
intermediate 256. A batch-1 token reads the router and its 8 experts' gate_up [512, 1024] and
down [1024, 256]: 25.4 MB in float32. The bound is one GEMV (layer_ops.gemv, the kernel the
experts run on) over as many bytes ([6144, 1024] plus the router), and the block's time is
split into its parts: the routing (router linear, softmax, top-k), the 16 expert GEMVs alone
(called one by one from Python), and the rest (SiLU-and-mul, scaling, the sum). "before": the
block as it ran a batch-1 token before the one-call path (`grouped`, kept here for the A/B;
the same bits, asserted). Every call gets a new
random token (so new experts) and the 64 experts (201 MB fp32) and the GEMV's weights rotate
through more than the caches hold. Medians over --rounds rounds of --calls calls each, one
thread, timed in the thread's CPU time (this machine is shared: wall time there counts the
waits for a core, several ms at load 10 on 2 cores).

    .venv/bin/python -m benchmarks.moe_decode --rounds 5
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from atomd.model import layer_ops, moe as moe_mod
from atomd.model.moe import MoeWeights
from benchmarks.machine import loadavg

HIDDEN, EXPERTS, TOP_K, INTER = 1024, 64, 8, 256


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())


def weights(dtype: torch.dtype, seed: int = 0) -> MoeWeights:
    g = torch.Generator().manual_seed(seed)
    return MoeWeights(router=(torch.randn(EXPERTS, HIDDEN, generator=g) * 0.05).to(dtype),
                      gate_up=(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.03).to(dtype),
                      down=(torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.06).to(dtype),
                      top_k=TOP_K, norm_topk_prob=True)


def grouped(h: torch.Tensor, w: MoeWeights) -> torch.Tensor:
    """moe() as it ran a batch-1 token before this benchmark's fix (atomd 439ef00): the
    grouping of a batch (argsort, bincount, a scatter per expert) and ~5 calls an expert."""
    weights_, ids = moe_mod.route(h, w)
    rows, k = h.shape[0], w.top_k
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=w.gate_up.shape[0])
    scales = weights_.flatten()[order].unsqueeze(1)
    pairs = torch.empty(rows * k, h.shape[1], dtype=h.dtype if w.cast_weights else torch.float32)
    ends, sizes = counts.cumsum(0).tolist(), counts.tolist()
    for e in counts.nonzero().flatten().tolist():
        group = slice(ends[e] - sizes[e], ends[e])
        x = h if rows == 1 else h[order[group] // k]
        pairs.index_copy_(0, order[group], moe_mod.expert(x, w, e) * scales[group])
    return pairs.view(rows, k, -1).sum(dim=1).to(h.dtype)


def timed(fn, calls: int) -> float:
    """Median seconds per call of fn(i) over `calls` calls, in this thread's CPU time (one
    thread: what the call costs, not the time it waited for a core on a shared machine)."""
    times = []
    for i in range(calls):
        t = time.thread_time()
        fn(i)
        times.append(time.thread_time() - t)
    return statistics.median(times)


def run(dtype: torch.dtype, rounds: int, calls: int) -> dict[str, float]:
    w = weights(dtype)
    assert w.gemv, "the GEMV kernel does not run this dtype here"
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(1, HIDDEN, generator=g).to(dtype) for _ in range(calls)]
    active = TOP_K * 3 * INTER * HIDDEN + EXPERTS * HIDDEN  # elements a token reads
    n = TOP_K * 3 * INTER + EXPERTS  # the GEMV over as many bytes: [n, HIDDEN]
    flats = [torch.randn(n, HIDDEN, generator=g).to(dtype) for _ in range(8)]  # 8 x 25 MB: out of cache
    routes = [moe_mod.route(x, w)[1][0].tolist() for x in xs]

    def experts_only(i: int) -> None:  # the 16 GEMVs of the token's experts, nothing else
        x = xs[i]
        for e in routes[i]:
            layer_ops.gemv(layer_ops.gemv(x, w.gate_up[e])[:, :INTER], w.down[e])

    parts = {"moe block": lambda i: moe_mod.moe(xs[i], w), "before": lambda i: grouped(xs[i], w),
             "bound: one GEMV, same bytes": lambda i: layer_ops.gemv(xs[i], flats[i % len(flats)]),
             "routing": lambda i: moe_mod.route(xs[i], w), "16 expert GEMVs": experts_only}
    assert all(torch.equal(moe_mod.moe(x, w), grouped(x, w)) for x in xs[:20])  # the same bits
    out: dict[str, list[float]] = {k: [] for k in parts}
    for fn in parts.values():
        timed(fn, 4)  # warm
    for _ in range(rounds):
        for name, fn in parts.items():
            out[name].append(timed(fn, calls))
    medians = {k: statistics.median(v) for k, v in out.items()}
    medians["bytes"] = active * w.gate_up.element_size()
    return medians


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    torch.set_num_threads(1)  # CPU time of this thread is the call's cost
    print(f"CPU: {cpu_model()}; 1 thread; load before: {loadavg()}")
    print(f"block: hidden {HIDDEN}, {EXPERTS} experts top-{TOP_K}, expert intermediate {INTER}; "
          f"medians of {args.rounds} rounds x {args.calls} calls\n")
    print("| dtype | MB read / token | before (ms) | moe block (ms) | GB/s | bound: one GEMV (ms) | block / bound "
          "| before / bound | routing (ms) | 16 expert GEMVs (ms) | rest (ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        if not layer_ops.has_gemv(dtype):
            print(f"| {name} | GEMV kernel not built for this CPU | | | | | | | |")
            continue
        m = run(dtype, args.rounds, args.calls)
        block, bound = m["moe block"], m["bound: one GEMV, same bytes"]
        rest = block - m["routing"] - m["16 expert GEMVs"]
        print(f"| {name} | {m['bytes'] / 1e6:.1f} | {m['before'] * 1e3:.2f} | {block * 1e3:.2f} | "
              f"{m['bytes'] / block / 1e9:.1f} | {bound * 1e3:.2f} | {block / bound:.2f}x | "
              f"{m['before'] / bound:.2f}x | {m['routing'] * 1e3:.3f} | {m['16 expert GEMVs'] * 1e3:.2f} | "
              f"{rest * 1e3:.2f} |", flush=True)
    print(f"\nload after: {loadavg()}")


if __name__ == "__main__":
    main()
