#!/usr/bin/env python
"""Sliding-window attention (issue 34): what a window saves at long contexts.

1. The C kernels alone, per layer, windowed against global on the same inputs, both in one
   process alternating, medians of --rounds: decode (a batch of sequences over a shuffled
   paged cache; the window's blocks only are read) and prefill of fresh prompts (key tiles
   before a query tile's first window skipped), float32 and bfloat16.
2. The engine's pool: the KV blocks one long request holds at its end, a windowed Mistral
   (every layer windowed: blocks before the window go back) against the same checkpoint
   without a window (random weights, a small shape; the counts do not depend on them).

    .venv/bin/python -m benchmarks.sliding_window --rounds 3
"""
from __future__ import annotations

import argparse
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import torch

from atomd.kernels import native
from atomd.engine.kv_cache import KVCache
from benchmarks.machine import loadavg

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 2, 64, 16  # a small model's attention shape, GQA 4


def _median_ms(fn, rounds: int, reps: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - start) / reps * 1e3)
    return statistics.median(times)


def kernels(rounds: int) -> None:
    lib = native.attention_kernels(HEAD_DIM, HEADS // KV_HEADS)
    print("| kernel | dtype | shape | window | global (ms) | windowed (ms) | global / windowed |")
    print("|---|---|---|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        batch, ctx, window = 16, 4096, 512
        width = ctx // BLOCK
        cache = KVCache(batch * width, 1, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
        cache.kv.normal_()
        tables = torch.randperm(cache.num_blocks).view(batch, width).contiguous()
        lens = torch.full((batch,), ctx, dtype=torch.int64)
        q = torch.randn(batch, HEADS, HEAD_DIM).to(dtype)
        runs = {w: (lambda w=w: native.decode_attention(lib, q, cache, 0, tables, lens, window=w)) for w in (None, window)}
        got = {w: [] for w in runs}
        for _ in range(rounds):  # alternating: both paths see the same load
            for w, fn in runs.items():
                got[w].append(_median_ms(fn, 1, 10))
        g, s = statistics.median(got[None]), statistics.median(got[window])
        print(f"| decode | {str(dtype)[6:]} | {batch} x {ctx} ctx | {window} | {g:.2f} | {s:.2f} | {g / s:.1f}x |")
        n = 4096
        qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
        qp = qkv[:, :HEADS * HEAD_DIM].view(n, HEADS, HEAD_DIM)
        kp = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(n, KV_HEADS, HEAD_DIM)
        vp = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(n, KV_HEADS, HEAD_DIM)
        out = torch.empty(n, HEADS * HEAD_DIM, dtype=dtype)
        starts, seq_lens = torch.tensor([0]), torch.tensor([n])
        runs = {w: (lambda w=w: native.prefill_attention(lib, qp, kp, vp, out, starts, seq_lens, window=w))
                for w in (None, window)}
        got = {w: [] for w in runs}
        for _ in range(rounds):
            for w, fn in runs.items():
                got[w].append(_median_ms(fn, 1, 2))
        g, s = statistics.median(got[None]), statistics.median(got[window])
        print(f"| prefill | {str(dtype)[6:]} | 1 x {n} prompt | {window} | {g:.1f} | {s:.1f} | {g / s:.1f}x |")


def pool() -> None:
    import shutil

    import transformers

    from atomd.llm import LLM
    from atomd.model.default import default_model_dir
    from contracts.sampling import SamplingParams

    prompt_len, new, window = 1024, 256, 256
    print("\n| model | window | prompt + generated | blocks held at the end | released during the run |")
    print("|---|---:|---|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for w in (None, window):
            path = pathlib.Path(tmp) / f"m{w}"
            config = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, vocab_size=4096,
                                                max_position_embeddings=2048, sliding_window=w)
            torch.manual_seed(0)
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
            for name in ("tokenizer.json", "tokenizer_config.json"):  # the built-in model's (4096 ids)
                shutil.copy(default_model_dir() / name, path / name)
            llm = LLM(str(path), num_threads=1, max_model_len=2048)
            engine = llm.engine
            engine.add_request("r", [3 + i % 300 for i in range(prompt_len)], SamplingParams(max_tokens=new, ignore_eos=True))
            seq = next(iter(engine.scheduler._live.values()))
            held = 0
            while engine.has_unfinished_requests():
                if seq.block_table:
                    held = sum(1 for b in seq.block_table if b >= 0)
                engine.step()
            print(f"| Mistral-shaped, 2 layers | {w or 'none'} | {prompt_len} + {new} | {held} | "
                  f"{engine.stats()['num_window_released_blocks']} |")


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        name = next((ln.partition(":")[2].strip() for ln in f if ln.startswith("model name")), platform.machine())
    flags = open("/proc/cpuinfo").read()
    return f"{name} ({', '.join(k for k in ('avx512_bf16', 'amx_tile') if k in flags) or 'no bf16/AMX'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load before: {loadavg()}; CPU: {cpu_model()}; threads 1; "
          f"{sys.argv[0]} --rounds {args.rounds}\n")
    kernels(args.rounds)
    pool()
    print(f"\nload after: {loadavg()}")


if __name__ == "__main__":
    main()
