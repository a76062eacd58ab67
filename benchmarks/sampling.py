#!/usr/bin/env python
"""Sampling parameters (issue 23): what the logits processing costs per decode step, and
what n > 1 gains over separate requests.

1. Decode step at batch 16, in process (LLMEngine, built-in default model): every request
   plain (temperature 1.0), then with the three penalties on (presence 0.5, frequency 0.5,
   repetition 1.2), then with everything on (the penalties, min_p 0.05, a 32-token
   logit_bias, two bad words, allowed_token_ids = half the vocabulary). Each round runs
   the configurations back to back on the same prompts; per step the wall time of
   `LLMEngine.step()` and of the sampler inside it. Also greedy (temperature 0) plain vs
   everything. Target: the sampler's extra time with everything on <= 5% of the plain step.
2. n=4 vs 4 separate requests with the same prompt, all arriving at once: one request
   prefills the prompt once and forks (blocks shared), the four separate ones prefill it
   four times (they are admitted in the same step, so the prefix cache cannot help). Wall
   time to finish, output tokens/s and prompt tokens forwarded, at a short and a long prompt.

Every number is the median over --rounds rounds; the load average is printed before and
after (the machine is shared).

    .venv/bin/python -m benchmarks.sampling --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from atomd.config import EngineConfig
from atomd.engine.llm_engine import LLMEngine
from contracts.sampling import SamplingParams
from benchmarks.machine import loadavg

BATCH = 16


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(10, vocab, length)] for _ in range(n)]


def configs(vocab: int) -> dict[str, dict]:
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2)
    everything = dict(penalties, min_p=0.05, logit_bias={t: (-1.0) ** t * 2.0 for t in range(100, 132)},
                      bad_words=["import", "return"], allowed_token_ids=list(range(0, vocab, 2)))
    return {"plain": dict(temperature=1.0), "penalties": dict(penalties, temperature=1.0),
            "everything": dict(everything, temperature=1.0),
            "greedy plain": dict(temperature=0.0), "greedy everything": dict(everything, temperature=0.0)}


class Timed:
    """Wraps the engine's sampler.sample and runner.execute to time / count them."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.sample_s = 0.0
        self.prefill_tokens = 0
        sample, execute = engine.sampler.sample, engine.runner.execute

        def timed_sample(*a, **kw):
            t = time.perf_counter()
            try:
                return sample(*a, **kw)
            finally:
                self.sample_s += time.perf_counter() - t

        def counted_execute(batch, *a, **kw):
            if batch.is_prefill:
                self.prefill_tokens += int(batch.num_scheduled_tokens.sum())
            return execute(batch, *a, **kw)

        engine.sampler.sample, engine.runner.execute = timed_sample, counted_execute


def decode_steps(engine: LLMEngine, timed: Timed, batch: list[list[int]],
                 params: SamplingParams | list[SamplingParams], steps: int, tag: str) -> tuple[float, float]:
    """Median step time and median sampler time (ms) over `steps` decode steps of the batch
    (`params`: every request's, or one per request)."""
    ids = [f"{tag}-{i}" for i in range(len(batch))]
    each = params if isinstance(params, list) else [params] * len(batch)
    for rid, prompt, sp in zip(ids, batch, each):
        engine.add_request(rid, prompt, sp)
    s = engine.scheduler
    while s.waiting or s._prefilling:  # every request decoding
        engine.step()
    for _ in range(5):
        engine.step()
    step_ms, sample_ms = [], []
    for _ in range(steps):
        timed.sample_s = 0.0
        t = time.perf_counter()
        engine.step()
        step_ms.append((time.perf_counter() - t) * 1e3)
        sample_ms.append(timed.sample_s * 1e3)
    assert len(s.running) == len(batch), "a request finished during the measurement"
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(step_ms), statistics.median(sample_ms)


def fork_vs_separate(engine: LLMEngine, timed: Timed, prompt: list[int], n: int, output_len: int,
                     forked: bool) -> tuple[float, int, int]:
    """(wall seconds, output tokens, prompt tokens forwarded) for n samples of one prompt."""
    engine.reset_prefix_cache()
    timed.prefill_tokens = 0
    base = dict(max_tokens=output_len, temperature=1.0, ignore_eos=True)
    t = time.perf_counter()
    if forked:
        engine.add_request("forked", prompt, SamplingParams(**base, n=n, seed=1))
    else:
        for i in range(n):
            engine.add_request(f"single-{i}", prompt, SamplingParams(**base, seed=1 + i))
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return time.perf_counter() - t, tokens, timed.prefill_tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100, help="decode steps timed per configuration and round")
    ap.add_argument("--prompt-len", type=int, default=128, help="part 1's prompts")
    ap.add_argument("--fork-prompt-lens", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--fork-output-len", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    print(f"load average at start: {loadavg()}", flush=True)
    engine = LLMEngine(EngineConfig(num_threads=args.threads, max_model_len=2048))
    timed = Timed(engine)
    vocab = engine.model.config.vocab_size
    batch = prompts(BATCH, args.prompt_len, vocab, seed=0)
    cfgs = configs(vocab)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in cfgs}
    for r in range(args.rounds):
        for name, kw in cfgs.items():
            params = SamplingParams(max_tokens=args.steps + 50, ignore_eos=True, **kw)
            results[name].append(decode_steps(engine, timed, batch, params, args.steps, f"r{r}-{name}"))
        print(f"round {r + 1}/{args.rounds} done, load {loadavg()}", flush=True)

    def med(name: str, i: int) -> float:
        return statistics.median(x[i] for x in results[name])

    print(f"\n## Decode step at batch {BATCH} ({args.prompt_len}-token prompts, {args.threads} thread(s), "
          f"median of {args.rounds} rounds x {args.steps} steps)\n")
    print("| configuration | step (ms) | sampler (ms) | sampler extra vs plain | extra / plain step |")
    print("|---|---:|---:|---:|---:|")
    for name in cfgs:
        base = "greedy plain" if name.startswith("greedy") else "plain"
        extra = med(name, 1) - med(base, 1)
        print(f"| {name} | {med(name, 0):.2f} | {med(name, 1):.3f} | {extra:+.3f} ms | "
              f"{extra / med(base, 0) * 100:+.1f}% |")
    print("\nper round (step ms / sampler ms): " + "; ".join(
        f"{name}: " + ", ".join(f"{a:.2f}/{b:.3f}" for a, b in results[name]) for name in cfgs))

    print(f"\n## n={args.n} vs {args.n} separate requests, same prompt, all at once "
          f"({args.fork_output_len} output tokens each, median of {args.rounds} rounds)\n")
    print("| prompt tokens | setup | wall (s) | output tok/s | prompt tokens forwarded | speed-up |")
    print("|---:|---|---:|---:|---:|---:|")
    for length in args.fork_prompt_lens:
        prompt = prompts(1, length, vocab, seed=length)[0]
        runs = {True: [], False: []}
        for _ in range(args.rounds):
            for forked in (True, False):
                runs[forked].append(fork_vs_separate(engine, timed, prompt, args.n, args.fork_output_len, forked))
        wall = {k: statistics.median(x[0] for x in v) for k, v in runs.items()}
        for forked in (True, False):
            _, tokens, forwarded = runs[forked][0]
            name = f"n={args.n}" if forked else f"{args.n} x n=1"
            speedup = f"{wall[False] / wall[True]:.2f}x" if forked else "1.00x"
            print(f"| {length} | {name} | {wall[forked]:.3f} | {tokens / wall[forked]:.0f} | {forwarded} | {speedup} |")
        print(f"per round wall s: n={args.n} " + ", ".join(f"{x[0]:.3f}" for x in runs[True]) +
              "; separate " + ", ".join(f"{x[0]:.3f}" for x in runs[False]))
    print(f"\nload average at end: {loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
