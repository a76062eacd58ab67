#!/usr/bin/env python
"""Structured outputs (issue 22): what grammar-constrained decoding costs per decode step,
and what compiling a grammar costs with and without the cache.

1. Decode steps in process (LLMEngine, one torch thread; the built-in default model, or with
   --model-shape smollm-135m the random-weight checkpoint shaped like SmolLM2-135M of
   benchmarks/model_shapes.py, its vocabulary the built-in tokenizer's padded to 49152): 16
   requests decoding together with 0, 1 or 16 of them constrained by a JSON schema, and by
   a regex; and one request, free or constrained. Per configuration and round, --steps
   decode steps are timed once every request decodes: the wall time of `LLMEngine.step()`
   and of the sampler inside it (which syncs the matchers, fills the bitmask rows and
   applies them). Grammars: a JSON array of records with bounded fields (strings with
   maxLength, bounded integers, enums, a pattern, nested objects), the same with plain
   string / integer fields, and a regex of e-mail lines. None lets a request end inside
   the window (at least 1000 records, 100 lines), so the batch stays whole; free rows use
   ignore_eos. Configurations run back to back on the same prompts in every round.
   Target (the issue's): <= 10% added per decode step at batch 16, grammars compiled.
2. Compile time per grammar: a fresh engine-side compiler (llguidance against the
   tokenizer), then the same grammar again (a cache hit), the per-sequence matcher copy,
   and the API process's check (no tokenizer; cached the same way).

Every number is the median over --rounds rounds; the load average is printed before and
after (the machine is shared). The engine choice (llguidance vs xgrammar) is measured by
benchmarks/grammar_engines.py.

    .venv/bin/python -m benchmarks.structured --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from atomd import structured
from atomd.config import EngineConfig
from atomd.engine.llm_engine import LLMEngine, resolve_model_dir
from atomd.api.tools import forced_grammar
from benchmarks.machine import loadavg
from benchmarks.model_shapes import model_dir
from benchmarks.sampling import Timed, decode_steps, prompts
from contracts.sampling import SamplingParams, StructuredOutputsParams as SO

RECORD = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "role", "tags", "address"], "additionalProperties": False}
PLAIN = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"},
                                          "tags": {"type": "array", "items": {"type": "string"}}},
         "required": ["name", "n", "tags"], "additionalProperties": False}
JSON = SO(json={"type": "array", "items": RECORD, "minItems": 1000})
REGEX = SO(regex=r"([a-z]{3,10}@[a-z]{3,8}\.(com|org|net)\n){100}")
GRAMMARS = {"JSON, bounded fields": JSON, "JSON, plain fields": SO(json={"type": "array", "items": PLAIN,
                                                                          "minItems": 1000}), "regex": REGEX}
TOOL = SO(grammar=forced_grammar([("get_weather", RECORD)], several=False))


def configs(batch: int, steps: int) -> dict[str, list[SamplingParams]]:
    def free(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=steps + 50, temperature=1.0, seed=i, ignore_eos=True)

    def constrained(i: int, so: SO) -> SamplingParams:
        return SamplingParams(max_tokens=steps + 50, temperature=1.0, seed=i, structured_outputs=so)

    out = {f"batch {batch}, 0 constrained": [free(i) for i in range(batch)]}
    for label, so in GRAMMARS.items():
        out[f"batch {batch}, 1 constrained ({label})"] = [constrained(0, so)] + [free(i) for i in range(1, batch)]
        out[f"batch {batch}, {batch} constrained ({label})"] = [constrained(i, so) for i in range(batch)]
    out["batch 1, free"] = [free(0)]
    for label, so in GRAMMARS.items():
        out[f"batch 1, {label}"] = [constrained(0, so)]
    return out


def compile_times(engine: LLMEngine, rounds: int) -> list[tuple[str, float, float, float, float, float]]:
    """(grammar, cold compile ms, cache hit us, matcher copy us, API check cold ms, cached us)."""
    tokenizer_json = (resolve_model_dir(engine.config) / "tokenizer.json").read_text()
    rows = []
    for label, so in (("JSON schema (record)", SO(json=RECORD)), ("JSON array of records", JSON),
                      ("regex", REGEX), ("forced tool call", TOOL), ("choice (3)", SO(choice=["a", "bb", "ccc"]))):
        per_round = []
        for _ in range(rounds):
            comp = structured.GrammarCompiler(tokenizer_json, engine.model.config.vocab_size, [2, 6])
            comp.tokenizer  # built once per engine, not per grammar
            structured._grammar_error.cache_clear()
            per_round.append((us_per_call(comp.compile, so, 1) / 1e3, us_per_call(comp.compile, so),
                              us_per_call(comp.matcher, so), us_per_call(structured.check, so, 1) / 1e3,
                              us_per_call(structured.check, so)))
        rows.append((label, *(statistics.median(r[k] for r in per_round) for k in range(5))))
    return rows


def us_per_call(fn, arg, calls: int = 100) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn(arg)
    return (time.perf_counter() - t) / calls * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100, help="decode steps timed per configuration and round")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model-shape", choices=["builtin", "smollm-135m"], default="builtin")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    print(f"load average at start: {loadavg()}; {args.model_shape}, {args.dtype}", flush=True)
    model = None if args.model_shape == "builtin" else str(model_dir(args.model_shape))
    engine = LLMEngine(EngineConfig(model=model, dtype=args.dtype, num_threads=args.threads, max_model_len=1024))
    timed = Timed(engine)
    vocab = engine.model.config.vocab_size
    batch = prompts(args.batch, args.prompt_len, vocab, seed=0)
    cfgs = configs(args.batch, args.steps)
    for so in GRAMMARS.values():
        engine.sampler.grammars.compile(so)  # the target is "after the grammar is compiled"
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in cfgs}
    for r in range(args.rounds):
        for name, params in cfgs.items():
            results[name].append(decode_steps(engine, timed, batch[:len(params)], params, args.steps,
                                              f"r{r}-{name}"))
        print(f"round {r + 1}/{args.rounds} done, load {loadavg()}", flush=True)
    load_mid = loadavg()

    def med(name: str, i: int) -> float:
        return statistics.median(x[i] for x in results[name])

    print(f"\n## Decode step ({args.prompt_len}-token prompts, {args.threads} thread(s), "
          f"median of {args.rounds} rounds x {args.steps} steps)\n")
    print("| configuration | step (ms) | step extra vs free | sampler (ms) | sampler extra vs free |")
    print("|---|---:|---:|---:|---:|")
    for name in cfgs:
        base = f"batch {args.batch}, 0 constrained" if name.startswith(f"batch {args.batch}") else "batch 1, free"
        step_extra = (med(name, 0) - med(base, 0)) / med(base, 0) * 100
        extra = med(name, 1) - med(base, 1)
        print(f"| {name} | {med(name, 0):.2f} | {step_extra:+.1f}% | {med(name, 1):.3f} | {extra:+.3f} ms "
              f"({extra / med(base, 0) * 100:+.1f}% of the free step) |")
    print("\nper round (step ms / sampler ms): " + "; ".join(
        f"{name}: " + ", ".join(f"{a:.2f}/{b:.3f}" for a, b in results[name]) for name in cfgs))

    print(f"\n## Compile time per grammar (median of {args.rounds} rounds)\n")
    print("| grammar | engine compile, cold (ms) | cache hit (us) | per-sequence matcher (us) "
          "| API check, cold (ms) | API check, cached (us) |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, cold, hit, copy, check_cold, check_hit in compile_times(engine, args.rounds):
        print(f"| {label} | {cold:.2f} | {hit:.1f} | {copy:.1f} | {check_cold:.2f} | {check_hit:.1f} |")
    print(f"\nload average: start (above), after part 1 {load_mid}, at end {loadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
