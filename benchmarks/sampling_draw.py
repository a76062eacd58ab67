#!/usr/bin/env python
"""How a sampled row draws its token: the inverse CDF (atomd's sampler: one uniform per row)
against the exponential race it replaced (one uniform per token: argmax p_i / E_i, E_i = -log
U_i), in one process, alternating per round on the same engine.

Decode steps at batch 16 (LLMEngine, one torch thread, every request temperature 1.0 with
its own seed, ignore_eos), --steps steps per round once all decode; per step the wall time of
`LLMEngine.step()` and of the sampler inside it, medians over --rounds rounds. Models: the
built-in one (vocabulary 4096) and the SmolLM2-135M shape (49152, benchmarks/model_shapes.py).

    .venv/bin/python -m benchmarks.sampling_draw --model-shape smollm-135m --dtype bfloat16
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from atomd.config import EngineConfig
from atomd.engine.llm_engine import LLMEngine
from atomd.engine.sampler import Sampler, draw_seed
from benchmarks.machine import loadavg
from benchmarks.model_shapes import model_dir
from benchmarks.sampling import Timed, decode_steps, prompts
from contracts.sampling import SamplingParams


def race(self: Sampler, probs: torch.Tensor, seqs, params, extra) -> torch.Tensor:
    """The exponential race over `probs` (what the sampler drew before inverse CDF)."""
    noise = torch.empty_like(probs)
    for i, p in enumerate(params):
        index = len(seqs[i].token_ids) - seqs[i].num_prompt_tokens + (len(extra[i]) if extra else 0)
        self._draw.manual_seed(draw_seed(p.seed, index))
        torch.rand(probs.shape[1], generator=self._draw, out=noise[i])
    return probs.div_(noise.log_().neg_()).argmax(dim=-1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-shape", choices=["builtin", "smollm-135m"], default="builtin")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    print(f"load average at start {loadavg()}; {args.model_shape}, {args.dtype}", flush=True)
    model = None if args.model_shape == "builtin" else str(model_dir(args.model_shape))
    engine = LLMEngine(EngineConfig(model=model, dtype=args.dtype, num_threads=1, max_model_len=1024))
    timed = Timed(engine)
    batch = prompts(16, 32, engine.model.config.vocab_size, seed=0)
    params = [SamplingParams(max_tokens=args.steps + 50, temperature=1.0, seed=i, ignore_eos=True)
              for i in range(16)]
    inverse_cdf = Sampler._draw_from
    results: dict[str, list[tuple[float, float]]] = {"inverse CDF": [], "exponential race": []}
    for r in range(args.rounds):
        for name, draw in (("inverse CDF", inverse_cdf), ("exponential race", race)):
            Sampler._draw_from = draw
            results[name].append(decode_steps(engine, timed, batch, params, args.steps, f"r{r}-{name}"))
        print(f"round {r + 1}/{args.rounds} done, load {loadavg()}", flush=True)
    Sampler._draw_from = inverse_cdf
    print(f"\n| draw | step (ms) | sampler (ms) |\n|---|---:|---:|")
    for name, rows in results.items():
        print(f"| {name} | {statistics.median(x[0] for x in rows):.2f} | {statistics.median(x[1] for x in rows):.3f} |")
    print(f"\nload average at end {loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
