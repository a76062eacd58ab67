#!/usr/bin/env python
"""Issue 34: what the chat output parsers cost per streamed token, against the per-token text
path every chat stream already pays (IncrementalDecoder.step, measured in the same run).

In process, no server: an output of ~N tokens (the built-in model's tokenizer) is fed token
by token through the detokenizer alone (the baseline), then through the detokenizer and
each parser chain the server runs per choice (atomd/api/server.py ChatRenderer):

- reasoning: `<think>` + reasoning text + `</think>` + content, ReasoningParser (qwen3)
- reasoning+hermes: the same with a `<tool_call>` after the content, reasoning then HermesParser
- llama3_json: one Llama 3 call whose arguments are ~N tokens of small objects (a `}` every
  few tokens: the parser scans each delta once for where the call closes, then decodes it)

Per configuration the median over --rounds rounds of the wall time per token; the ratio
is against the baseline of the same round. The load average and the CPU are printed (the
machine is shared).

    .venv/bin/python -m benchmarks.output_parsers --rounds 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from atomd.api.reasoning import ReasoningParser
from atomd.api.tool_parsers import HermesParser, Llama3JsonParser
from atomd.model.default import default_model_dir
from atomd.tokenizer import Tokenizer
from benchmarks.machine import cpu_model, loadavg

WORDS = "the sum of two and two is four so the answer must be four because counting gives it".split()


def texts(n_words: int) -> dict[str, str]:
    prose = " ".join(WORDS[i % len(WORDS)] for i in range(n_words))
    call = json.dumps({"name": "add", "arguments": {"a": 2, "b": 2}})
    nested = {"items": [{"k": i, "v": {"x": WORDS[i % len(WORDS)]}} for i in range(n_words // 6)]}
    return {"reasoning": f"<think>\n{prose}\n</think>\n\n{prose}",
            "reasoning+hermes": f"<think>\n{prose}\n</think>\n\n{prose}\n<tool_call>\n{call}\n</tool_call>",
            "llama3_json": json.dumps({"name": "store", "parameters": nested})}


def chain(name: str):
    """The per-token work after detokenization, as ChatRenderer does it for one choice."""
    if name == "baseline":
        return lambda text: None
    if name == "llama3_json":
        parser = Llama3JsonParser()
        return parser.stream
    reasoning = ReasoningParser.for_request("qwen3", False)
    tools = HermesParser() if name.endswith("hermes") else None

    def step(text: str) -> None:
        _, content = reasoning.stream(text)
        if tools is not None:
            tools.stream(content)
    return step


def per_token_us(tokenizer: Tokenizer, ids: list[int], name: str) -> float:
    detok, step = tokenizer.incremental_decoder(), chain(name)
    t0 = time.perf_counter()
    for tid in ids:
        step(detok.step(tid))
    return (time.perf_counter() - t0) / len(ids) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--words", type=int, default=1000, help="words of reasoning and of content (~2 tokens each)")
    args = ap.parse_args()
    tokenizer = Tokenizer.from_dir(default_model_dir())
    outputs = {k: tokenizer.encode(v, add_special_tokens=False) for k, v in texts(args.words).items()}
    print(f"cpu: {cpu_model()}; load before: {loadavg()}")
    rows = []
    for kind, ids in outputs.items():
        base, parsed = [], []
        for _ in range(args.rounds):
            base.append(per_token_us(tokenizer, ids, "baseline"))
            parsed.append(per_token_us(tokenizer, ids, kind))
        b, p = statistics.median(base), statistics.median(parsed)
        rows.append((kind, len(ids), b, p, statistics.median(q / r for q, r in zip(parsed, base))))
    print("| output | tokens | detokenize us/token | + parsers us/token | ratio |")
    print("|---|---|---|---|---|")
    for kind, n, b, p, ratio in rows:
        print(f"| {kind} | {n} | {b:.2f} | {p:.2f} | {ratio:.3f} |")
    print(f"load after: {loadavg()}")


if __name__ == "__main__":
    main()
