"""Issue 40's two benchmarks, in one run on this machine, as ratios against a baseline
measured in the same run (>= 3 rounds, medians; the load average before and after each
round, the CPU model):

1. Embeddings throughput: `atomd serve --task embed` (one /v1/embeddings request of `--batch`
   token-id inputs of 128 and of 512 tokens) against Hugging Face transformers on the same
   checkpoint (AutoModel, float32, the same batch as one padded-free forward, last-token
   pooling and normalisation in torch): inputs per second, both on `--threads` torch threads.
2. Responses API streaming overhead: the same prompts streamed from /v1/responses and from
   /v1/chat/completions (greedy, the same max tokens: the same tokens), requests one after
   the other, alternating the APIs per prompt; the ratio of total wall times.

Run: `.venv/bin/python -m benchmarks.api_breadth --rounds 3` (default model; a few minutes).
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np

from benchmarks.machine import loadavg
from launch.process import EngineServer, http

PROMPTS = ["def fibonacci(n):", "import os\nimport", "class Stack:", "for i in range(", "x = [1, 2,",
           "while True:", "print(", "def main():"]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "?"


def atomd_embeddings(url: str, batch: list[list[int]]) -> float:
    t0 = time.perf_counter()
    status, raw = http("POST", url + "/v1/embeddings", {"input": batch}, timeout=600)
    assert status == 200, raw[:300]
    return len(batch) / (time.perf_counter() - t0)


def hf_embeddings(model, batch: list[list[int]]) -> float:
    import torch

    t0 = time.perf_counter()
    with torch.no_grad():
        hidden = model(torch.tensor(batch)).last_hidden_state[:, -1]
        torch.nn.functional.normalize(hidden, dim=-1).tolist()
    return len(batch) / (time.perf_counter() - t0)


def stream_seconds(url: str, path: str, body: dict) -> float:
    t0 = time.perf_counter()
    status, raw = http("POST", url + path, dict(body, stream=True), timeout=600)
    assert status == 200 and raw.rstrip().endswith(b"data: [DONE]"), raw[-300:]
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    import torch
    import transformers
    from atomd.model.default import default_model_dir

    torch.set_num_threads(args.threads)
    model_dir = default_model_dir()
    hf = transformers.AutoModel.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    vocab = hf.config.vocab_size
    batches = {n: rng.integers(10, vocab, size=(args.batch, n)).tolist() for n in (128, 512)}
    server = EngineServer(model_dir, "--task", "embed", "--num-threads", str(args.threads), "--max-model-len", "1024",
                          "--max-num-batched-tokens", "8192").wait_ready(300)
    emb = {("atomd", n): [] for n in batches} | {("hf", n): [] for n in batches}
    api = {"chat": [], "responses": []}
    loads = []
    try:
        for n, batch in batches.items():  # warm both (kernels, allocator)
            atomd_embeddings(server.url, batch[:2])
            hf_embeddings(hf, batch[:2])
        for r in range(args.rounds):
            before = loadavg()
            for n, batch in batches.items():
                order = [("atomd", atomd_embeddings, server.url), ("hf", hf_embeddings, hf)]
                for name, fn, target in (order if r % 2 == 0 else order[::-1]):
                    emb[(name, n)].append(fn(target, batch))
            totals = {"chat": 0.0, "responses": 0.0}
            for i, prompt in enumerate(PROMPTS):
                runs = [("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}],
                                                          "max_tokens": args.max_tokens, "temperature": 0}),
                        ("responses", "/v1/responses", {"input": prompt, "max_output_tokens": args.max_tokens,
                                                        "temperature": 0})]
                for name, path, body in (runs if (i + r) % 2 == 0 else runs[::-1]):
                    totals[name] += stream_seconds(server.url, path, body)
            for name in totals:
                api[name].append(totals[name])
            loads.append((before, loadavg()))
    finally:
        server.stop()
    print(f"CPU: {cpu_model()}; torch threads {args.threads}; batch {args.batch}; rounds {args.rounds}")
    print(f"load before/after each round: {loads}")
    print("| inputs/s (median) | atomd | HF transformers | atomd / HF |")
    print("|---|---:|---:|---:|")
    for n in batches:
        a, h = statistics.median(emb[("atomd", n)]), statistics.median(emb[("hf", n)])
        print(f"| {n} tokens | {a:.1f} | {h:.1f} | {a / h:.2f}x |")
    c, s = statistics.median(api["chat"]), statistics.median(api["responses"])
    print(f"streaming {len(PROMPTS)} prompts x {args.max_tokens} tokens (median of rounds): chat {c:.2f} s, "
          f"responses {s:.2f} s, responses / chat {s / c:.3f} (per round: "
          f"{[round(x / y, 3) for x, y in zip(api['responses'], api['chat'])]})")


if __name__ == "__main__":
    main()
