#!/usr/bin/env python
"""Batch-1 decode's linears through atomd's GEMV (layer_ops.gemv over plain weight copies)
against oneDNN's packed matmul, which the engine uses otherwise (issue 21).

1. The linears alone: the 30 layers of the SmolLM2-135M shape (qkv 576->960, o 576->576,
   gate_up 576->3072, down 1536->576: 425 MB in fp32, out of cache), one pass over all of
   them per call at M = 1, both kernels in one process alternating, medians of --rounds;
   GB/s = weight bytes / time.
2. The engine (--model-shape): two LLMs in one process, one with the copies kept and one
   with ATOMD_GEMV=0, alternating per round: offline.py's batch 1 (one 128-token prompt,
   128 greedy tokens, prompt included), its decode only (minus a 1-token run), and batch 16
   decode only (16 x 128-token prompts, 128 tokens, minus a 1-token run: M = 16, oneDNN in
   both, a control for the noise); and how many greedy
   tokens the two paths agree on at batch 1 (the sums run in another order).
llama.cpp's figures for the same checkpoints come from benchmarks/llama_cpp.py.

    .venv/bin/python -m benchmarks.gemv --model-shape smollm-135m --rounds 5
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

import torch

from atomd.model import layer_ops
from atomd.model.linear import GEMV_ENV, pack_linear_weight
from benchmarks.machine import loadavg
from benchmarks.offline import SHAPE_CHOICES, WORKLOADS, checkpoint, prompts

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K): qkv, o, gate_up, down


def linears(dtype: torch.dtype, rounds: int, threads: int) -> None:
    torch.set_num_threads(threads)
    plain = [[torch.randn(n, k).to(dtype) for n, k in LAYER_SHAPES] for _ in range(30)]
    packed = [[pack_linear_weight(w.clone()) for w in layer] for layer in plain]
    nbytes = sum(w.numel() * w.element_size() for layer in plain for w in layer)
    print(f"\n{dtype}, {nbytes / 1e6:.0f} MB of weights\n")
    print("| M | gemv (ms) | GB/s | oneDNN packed (ms) | GB/s | gemv speed-up |")
    print("|---:|---:|---:|---:|---:|---:|")
    for m in (1,):
        xs = {k: torch.randn(m, k).to(dtype) for k in (576, 1536)}

        def rows() -> None:
            for layer in plain:
                for w in layer:
                    layer_ops.gemv(xs[w.shape[1]], w)

        def onednn() -> None:
            for layer in packed:
                for w in layer:
                    torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], w, None, "none", [], "")

        times: dict[str, list[float]] = {"rows": [], "onednn": []}
        rows(), onednn()
        for _ in range(rounds):
            for name, fn in (("rows", rows), ("onednn", onednn)):
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        a, b = statistics.median(times["rows"]), statistics.median(times["onednn"])
        print(f"| {m} | {a * 1e3:.2f} | {nbytes / a / 1e9:.1f} | {b * 1e3:.2f} | {nbytes / b / 1e9:.1f} | {b / a:.2f}x |",
              flush=True)


def engine(shape: str, dtype: str, rounds: int, threads: int) -> None:
    from atomd import LLM, SamplingParams

    path = checkpoint(shape, pathlib.Path(tempfile.mkdtemp(prefix="atomd-gemv-")))
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    llms = {}
    for tag, env in (("gemv", "1"), ("oneDNN", "0")):
        os.environ[GEMV_ENV] = env  # read when the weights are packed, at load
        llms[tag] = LLM(str(path), num_threads=threads, max_model_len=1024, enable_prefix_caching=False, dtype=dtype)
    os.environ.pop(GEMV_ENV, None)
    if llms["gemv"].engine.model.lm_head_rows is None:
        raise SystemExit(f"the GEMV does not run {dtype} on this CPU (layer_ops.has_gemv)")
    _, length, new, seed = WORKLOADS["batch1"]
    one = [{"prompt_token_ids": p} for p in prompts(1, length, seed, vocab)]
    sixteen = [{"prompt_token_ids": p} for p in prompts(16, length, WORKLOADS["batch16"][3], vocab)]
    full = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def timed(llm, batch, params) -> float:
        t = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - t

    ids = {tag: llm.generate(one, full, use_tqdm=False)[0].outputs[0].token_ids for tag, llm in llms.items()}
    same = sum(a == b for a, b in zip(ids["gemv"], ids["oneDNN"]))
    runs: dict[str, list[tuple[float, float, float]]] = {tag: [] for tag in llms}
    for _ in range(rounds):
        for tag, llm in llms.items():
            whole1, first1 = timed(llm, one, full), timed(llm, one, first)
            whole16, first16 = timed(llm, sixteen, full), timed(llm, sixteen, first)
            runs[tag].append((new / whole1, (new - 1) / (whole1 - first1), 16 * (new - 1) / (whole16 - first16)))
    print(f"\n{shape}, {dtype}, {threads} threads (tok/s, median of {rounds}; greedy ids equal at batch 1: "
          f"{same}/{new})\n")
    print("| path | batch 1 (prompt incl.) | batch 1 decode only | batch 16 decode only |")
    print("|---|---:|---:|---:|")
    for tag in llms:
        med = [statistics.median(r[i] for r in runs[tag]) for i in range(3)]
        print(f"| {tag} | {med[0]:.1f} | {med[1]:.1f} | {med[2]:.1f} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-shape", choices=SHAPE_CHOICES, default="smollm-135m")
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-linears", action="store_true", help="only part 2, the engine")
    args = ap.parse_args()
    print(f"load average at start {loadavg()}", flush=True)
    for dtype in args.dtype:
        if not args.skip_linears:
            linears(getattr(torch, dtype), args.rounds, args.threads)
        engine(args.model_shape, dtype, args.rounds, args.threads)
    print(f"\nload average at end {loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
