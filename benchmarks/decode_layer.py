#!/usr/bin/env python
"""Batch-1 decode through layer_ops.DecodeLayer (two C calls a layer around attention)
against the per-op path (~11 calls a layer from Python) on one engine, switched per round
(`model.decode_layer`), issue 21. offline.py's batch 1 (one 128-token prompt, 128 greedy
tokens, prompt included) and its decode only (minus a 1-token run); medians of --rounds.

    .venv/bin/python -m benchmarks.decode_layer --model-shape small --dtype bfloat16 --rounds 5
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile

import torch

from benchmarks.machine import loadavg
from benchmarks.offline import DTYPES, SHAPE_CHOICES, checkpoint, model_config, prompts, timed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-shape", choices=SHAPE_CHOICES, default="small")
    p.add_argument("--dtype", choices=list(DTYPES), nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    from atomd import LLM, SamplingParams

    print(f"load {loadavg()}")
    print("| shape, dtype | fused batch 1 (tok/s) | per-op batch 1 | fused / per-op | fused decode only | per-op decode only | fused / per-op |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(args.model_shape, pathlib.Path(tmp))
        prompt = prompts(1, 128, 1, model_config(path)["vocab_size"])
        for dtype in args.dtype:
            llm = LLM(str(path), num_threads=args.threads, max_model_len=1024, enable_prefix_caching=False, dtype=dtype)
            model = llm.engine.model
            fused_layer = model.decode_layer
            if fused_layer is None:
                print(f"| {args.model_shape}, {dtype} | not built here (no GEMV for {dtype}) | | | | | |")
                continue

            def gen(n: int) -> float:
                return timed(lambda: llm.generate([{"prompt_token_ids": p} for p in prompt],
                                                  SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                                                  use_tqdm=False))
            gen(8)
            full: dict[bool, list[float]] = {True: [], False: []}
            decode: dict[bool, list[float]] = {True: [], False: []}
            for r in range(args.rounds):
                for fused in (True, False) if r % 2 == 0 else (False, True):
                    model.decode_layer = fused_layer if fused else None
                    t128, t1 = gen(128), gen(1)
                    full[fused].append(128 / t128)
                    decode[fused].append(127 / (t128 - t1))
                print(f"round {r + 1}/{args.rounds} done (load {loadavg()})", file=sys.stderr, flush=True)
            f, o = statistics.median(full[True]), statistics.median(full[False])
            fd, od = statistics.median(decode[True]), statistics.median(decode[False])
            print(f"| {args.model_shape}, {dtype} | {f:.1f} | {o:.1f} | {f / o:.2f}x | {fd:.1f} | {od:.1f} | {fd / od:.2f}x |")
            del llm
    print(f"load {loadavg()}")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(2)
    sys.exit(main())
