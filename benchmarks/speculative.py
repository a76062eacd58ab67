#!/usr/bin/env python
"""Speculative decoding (issue 19): tokens/s with n-gram speculation on vs off.

In process (`LLM`, no HTTP), the built-in default model, one torch thread, greedy, the same
prompts on and off. Two prompt sets:

- repetitive: code that repeats itself (literal lists, dicts, attribute blocks, a file
  excerpt followed by its own beginning); on these the default model (5M parameters,
  trained on Python) keeps repeating, which is what the n-gram drafter predicts;
- random: prompts of random token ids, sampled (temperature 1.0, top_p 0.95, one seed per
  prompt): text the n-grams do not predict, the non-repetitive case. (Greedy, the default
  model loops even after a random prompt, which the n-grams predict: "random greedy".)

Batch B = an engine with max_num_seqs B given 4 prompts (B = 1: one after the other) or 6B
prompts at once (B > 1: B run, the next starts as one finishes, as a busy server would), so
a sequence that speculates well frees its seat early. Every run generates --max-tokens
tokens per prompt (ignore_eos) with the prefix cache reset first; tokens/s = output tokens
/ wall time of `LLM.generate` (prefill included, the same on and off). The on and off runs alternate within each round; every number is the median over
--rounds rounds (the speed-up: the median of the rounds' ratios); "in CPU time" is the
ratio of the engine's CPU seconds (one torch thread, so other jobs' load hardly moves it;
the wall-clock ratio swings +-15% on this shared machine). The output with speculation must equal the output without (checked:
greedy, and seeded sampling, whose draws depend only on the seed and the output position).
Acceptance rate = accepted / proposed drafts; mean accepted length = tokens per verify step
(accepted drafts + 1). The load average is printed before and after (the machine is shared).

    .venv/bin/python -m benchmarks.speculative --rounds 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from atomd.llm import LLM
from contracts.sampling import SamplingParams
from benchmarks.machine import loadavg


NAMES = ["alpha", "beta", "gamma", "delta", "value", "item", "node", "point", "count", "total", "left", "right",
         "width", "height", "start", "stop"]


def repetitive_prompts(n: int) -> list[str]:
    """Code that repeats its context, 4 shapes x varied names and values."""
    with open(__file__.replace("benchmarks/speculative.py", "scheduler/stop.py")) as f:
        source = f.read()
    out = []
    for i in range(n):
        suffix = str(i // len(NAMES)) if i >= len(NAMES) else ""
        name, other = NAMES[i % len(NAMES)] + suffix, NAMES[(i + 5) % len(NAMES)] + suffix
        shape = i % 4
        if shape == 0:
            nums = ", ".join(str((i + j) % 5) for j in range(4))
            out.append(f"{name} = [{nums}, {nums}, {nums}, {nums},")
        elif shape == 1:
            keys = [NAMES[(i + j) % len(NAMES)] for j in range(5)]
            out.append(f"{name} = {{\n" + "".join(f"    '{k}': '{k}',\n" for k in keys))
        elif shape == 2:
            out.append(f"        self.{name} = {name}\n        self.{other} = {other}\n" * 2)
        else:
            start = (i * 97) % 400
            excerpt = source[start:start + 600]
            out.append(excerpt + f"\n\n# {name}: the same code again\n" + excerpt[:160])
    return out


def random_prompts(n: int, vocab: int, length: int = 64) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(10, vocab, length)] for _ in range(n)]


def run(llm: LLM, prompts: list, max_tokens: int, sampled: bool = False) -> tuple[float, int, list[list[int]], dict]:
    """(seconds, output tokens, token ids, spec stats delta) of one pass over the prompts, all
    submitted at once (the engine runs max_num_seqs of them at a time)."""
    if sampled:
        params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.95, seed=i, ignore_eos=True)
                  for i in range(len(prompts))]
    else:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    inputs = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    llm.engine.reset_prefix_cache()
    before = llm.engine.stats()
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(inputs, params, use_tqdm=False)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    after = llm.engine.stats()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in
             ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")}
    delta["cpu_s"] = cpu
    ids = [o.outputs[0].token_ids for o in outs]
    return seconds, sum(len(t) for t in ids), ids, delta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    args = ap.parse_args()
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2,
                       "prompt_lookup_max": 5})
    print(f"load average at start: {loadavg()}", flush=True)
    engines = {(batch, on): LLM(None, num_threads=1, max_model_len=1024, max_num_seqs=batch,
                                speculative_config=spec if on else None)
               for batch in (1, 16) for on in (False, True)}
    vocab = engines[1, False].engine.model.config.vocab_size
    sets = {"repetitive": (repetitive_prompts(96), False), "random": (random_prompts(96, vocab), True),
            "random greedy": (random_prompts(96, vocab), False)}
    for llm in engines.values():  # warm-up: kernels built, allocator and caches settled
        run(llm, sets["repetitive"][0][:4], 32)
    rows = []
    for name, (prompts, sampled) in sets.items():
        for batch in (1, 16):
            use = prompts[:4] if batch == 1 else prompts[:6 * batch]
            off, on = engines[batch, False], engines[batch, True]
            tps = {"off": [], "on": []}
            rates, lengths, cpu_ratio = [], [], []
            for _ in range(args.rounds):
                s_off, n_off, ids_off, d_off = run(off, use, args.max_tokens, sampled)
                s_on, n_on, ids_on, d = run(on, use, args.max_tokens, sampled)
                assert ids_on == ids_off, f"{name} batch {batch}: the output with speculation differs"
                tps["off"].append(n_off / s_off)
                tps["on"].append(n_on / s_on)
                cpu_ratio.append(d_off["cpu_s"] / d["cpu_s"])  # one thread: immune to other jobs' load
                drafts, steps = d["spec_decode_num_draft_tokens"], d["spec_decode_num_drafts"]
                rates.append(d["spec_decode_num_accepted_tokens"] / drafts if drafts else 0.0)
                lengths.append(1 + d["spec_decode_num_accepted_tokens"] / steps if steps else 0.0)
            t_off, t_on = statistics.median(tps["off"]), statistics.median(tps["on"])
            ratio = statistics.median(on / off for on, off in zip(tps["on"], tps["off"]))
            rows.append((name, batch, t_off, t_on, ratio, statistics.median(cpu_ratio), statistics.median(rates),
                         statistics.median(lengths), d["spec_decode_num_draft_tokens"]))
            print(f"{name} batch {batch}: off {t_off:.1f} tok/s, on {t_on:.1f} tok/s, {ratio:.2f}x "
                  f"(CPU time {rows[-1][5]:.2f}x), acceptance {rows[-1][6]:.2f}, mean accepted length "
                  f"{rows[-1][7]:.2f}", flush=True)
    print(f"load average at end: {loadavg()}\n")
    print(f"| prompts | batch | off (tok/s) | ngram k={args.k} (tok/s) | speed-up | speed-up in CPU time | "
          f"acceptance rate | mean accepted length | drafts / run |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, batch, t_off, t_on, ratio, cpu, rate, length, drafts in rows:
        print(f"| {name} | {batch} | {t_off:.1f} | {t_on:.1f} | **{ratio:.2f}x** | {cpu:.2f}x | {rate:.2f} | "
              f"{length:.2f} | {drafts} |")


if __name__ == "__main__":
    main()
