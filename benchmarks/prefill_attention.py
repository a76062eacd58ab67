#!/usr/bin/env python
"""bf16 prefill attention of fresh prompts: atomd's kernel (AMX tiles where the CPU and the
build have them) against torch's flash SDPA, the path the engine took on AMX CPUs before
(issue 21).

1. The attention alone, per layer: packed q, k, v views of one QKV projection output, causal,
   GQA, both paths in one process alternating, medians of --rounds; and each path's error
   against float32 SDPA on the same bf16 inputs (max and mean absolute).
2. The engine: one bf16 LLM on the checkpoint of --model-shape, offline.py's prefill workload
   (8 prompts x 512 tokens, 1 output token), the runner switched between the kernel and SDPA
   per round (`runner.fresh_prefill_kernel`), medians of --rounds.

    .venv/bin/python -m benchmarks.prefill_attention --model-shape smollm-135m --rounds 5
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from atomd.kernels import native
from benchmarks.machine import loadavg
from benchmarks.offline import SHAPE_CHOICES, checkpoint, model_config, prompts, timed

# (label, query heads, KV heads, head_dim, sequence lengths)
CASES = [("135M 8x512", 9, 3, 64, [512] * 8), ("135M 1x512", 9, 3, 64, [512]), ("135M 2x2048", 9, 3, 64, [2048] * 2),
         ("small 8x512", 8, 4, 64, [512] * 8)]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], dtype: torch.dtype) -> torch.Tensor:
    """The engine's SDPA path: one call per sequence, 4-d views."""
    out, start = [], 0
    for n in lens:
        qs, ks, vs = (t[start:start + n].transpose(0, 1).unsqueeze(0).to(dtype) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        out.append(o[0].transpose(0, 1).reshape(n, -1))
        start += n
    return torch.cat(out)


def attention_alone(rounds: int) -> None:
    print("| case | kernel (ms) | SDPA (ms) | kernel / SDPA | kernel error max / mean | SDPA error max / mean |")
    print("|---|---:|---:|---:|---|---|")
    for label, heads, kv_heads, head_dim, lens in CASES:
        lib = native.attention_kernels(head_dim, heads // kv_heads)
        total = sum(lens)
        torch.manual_seed(0)
        qkv = torch.randn(total, (heads + 2 * kv_heads) * head_dim).bfloat16()
        q = qkv[:, :heads * head_dim].view(total, heads, head_dim)
        k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(total, kv_heads, head_dim)
        v = qkv[:, (heads + kv_heads) * head_dim:].view(total, kv_heads, head_dim)
        starts = torch.tensor([sum(lens[:i]) for i in range(len(lens))], dtype=torch.int64)
        seq_lens = torch.tensor(lens, dtype=torch.int64)

        def kernel() -> torch.Tensor:
            out = torch.empty(total, heads * head_dim, dtype=torch.bfloat16)
            native.prefill_attention(lib, q, k, v, out, starts, seq_lens)
            return out

        ref = sdpa(q, k, v, lens, torch.float32)
        errors = {}
        for name, fn in (("kernel", kernel), ("sdpa", lambda: sdpa(q, k, v, lens, torch.bfloat16))):
            diff = (fn().float() - ref).abs()
            errors[name] = f"{diff.max().item():.2e} / {diff.mean().item():.2e}"
        times: dict[str, list[float]] = {"kernel": [], "sdpa": []}
        for r in range(rounds):
            order = [("kernel", kernel), ("sdpa", lambda: sdpa(q, k, v, lens, torch.bfloat16))]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                times[name].append(min(timed(fn) for _ in range(3)) * 1e3)
        kt, st = statistics.median(times["kernel"]), statistics.median(times["sdpa"])
        print(f"| {label} | {kt:.2f} | {st:.2f} | {kt / st:.2f}x | {errors['kernel']} | {errors['sdpa']} |")


def engine(shape: str, rounds: int, threads: int) -> None:
    from atomd import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(shape, pathlib.Path(tmp))
        llm = LLM(str(path), num_threads=threads, max_model_len=1024, enable_prefix_caching=False, dtype="bfloat16")
        runner = llm.engine.runner
        if not runner.fresh_prefill_kernel:
            print("the engine does not run the kernel for fresh bf16 prompts here: nothing to compare")
            return
        batch = prompts(8, 512, 3, model_config(path)["vocab_size"])
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

        def prefill() -> None:
            llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)

        prefill()
        rates: dict[bool, list[float]] = {True: [], False: []}
        for r in range(rounds):
            for use_kernel in (True, False) if r % 2 == 0 else (False, True):
                runner.fresh_prefill_kernel = use_kernel
                rates[use_kernel].append(8 * 512 / timed(prefill))
            print(f"round {r + 1}/{rounds} done (load {loadavg()})", file=sys.stderr, flush=True)
        k, s = statistics.median(rates[True]), statistics.median(rates[False])
        print(f"\n{shape} bf16 prefill 8x512 (tok/s): kernel {k:.1f}, SDPA {s:.1f}, kernel / SDPA {k / s:.3f}x")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-shape", choices=SHAPE_CHOICES, default="smollm-135m")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lib = native.attention_kernels(64, 3)
    if lib is None:
        print("the attention kernels did not build here")
        return 1
    print(f"load {loadavg()}; bf16 prefill on AMX tiles: {lib.prefill_amx}\n")
    attention_alone(args.rounds)
    engine(args.model_shape, args.rounds, args.threads)
    print(f"\nload {loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
