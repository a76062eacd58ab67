#!/usr/bin/env python
"""Grammar engines compared (issue 22): xgrammar vs llguidance on this CPU, with the
built-in default model's tokenizer (byte-level BPE, 4096 tokens).

Per engine: tokenizer set-up, compile time of a JSON schema and a regex, and the per-step
cost of what a decode step adds for constrained rows: fill the vocabulary bitmask of every
constrained matcher, then advance each by its sampled token. At batch 1 and 16, each row a
matcher in its own state. The tokens are a seeded walk over the allowed tokens (half the
steps a uniform pick, half a pick among tokens without letters, which closes strings and
moves through the structure), the same walk for both engines; a matcher that finishes or
reaches 64 tokens restarts. llguidance is timed one matcher at a time and with its
`LLExecutor` (the batch across threads, the GIL released).

xgrammar's PyPI wheel requires triton (hundreds of MB, GPU kernels only), so it is not a
project dependency; to run its half install it aside:

    .venv/bin/pip install --no-deps --target /tmp/xgr xgrammar apache-tvm-ffi
    PYTHONPATH=/tmp/xgr .venv/bin/python -m benchmarks.grammar_engines --rounds 3

Without it only llguidance runs. Per round the mean over the steps (expensive states
count in full), then the median over --rounds rounds; the load average is printed (the
machine is shared).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from atomd.model.default import default_model_dir
from benchmarks.machine import loadavg

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3,10}@[a-z]{3,8}\.(com|org|net)"
VOCAB = 4096
END = [2, 6]
WALK = 64


def allowed_of(bitmask_row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:VOCAB])


class Walk:
    """The seeded token choice both engines replay."""

    def __init__(self, texts: list[str], seed: int):
        self.rng = np.random.default_rng(seed)
        self.no_letters = np.array([not any(c.isalpha() for c in t) for t in texts])

    def pick(self, allowed: np.ndarray) -> int:
        if self.rng.random() < 0.5:
            plain = allowed[self.no_letters[allowed]]
            if len(plain):
                return int(self.rng.choice(plain))
        return int(self.rng.choice(allowed))


class Llg:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, threads: int | None):
        import llguidance as llg

        self.llg = llg
        t0 = time.perf_counter()
        self.tok = llg.LLTokenizer(tokenizer_json, n_vocab=VOCAB, eos_token=END)
        self.setup_s = time.perf_counter() - t0
        self.executor = llg.LLExecutor(num_threads=threads) if threads else None

    def compile(self, kind: str, spec):
        g = (self.llg.LLMatcher.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False})
             if kind == "json" else self.llg.LLMatcher.grammar_from_regex(spec))
        m = self.llg.LLMatcher(self.tok, g, log_level=0)
        assert not m.is_error(), m.get_error()
        return g

    def matcher(self, compiled):
        return self.llg.LLMatcher(self.tok, compiled, log_level=0)

    def fill(self, matchers, bitmask: np.ndarray) -> None:
        if self.executor is not None:
            self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.ctypes.data,
                                                  bitmask.shape[1] * 4, bitmask.shape[0])
        else:
            for i, m in enumerate(matchers):
                m.unsafe_compute_mask_ptr(bitmask[i].ctypes.data, bitmask.shape[1] * 4)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)

    def done(self, m) -> bool:
        return m.is_stopped()


class Xgr:
    name = "xgrammar"

    def __init__(self, tokenizer_dir, threads: int | None):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgr
        t0 = time.perf_counter()
        hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"), eos_token="<|eos|>")
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB, stop_token_ids=END)
        self.setup_s = time.perf_counter() - t0
        self.threads = threads
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads) if threads else None

    def compile(self, kind: str, spec):
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        return (compiler.compile_json_schema(json.dumps(spec), any_whitespace=False) if kind == "json"
                else compiler.compile_regex(spec))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers, bitmask: np.ndarray) -> None:
        import torch

        t = torch.from_numpy(bitmask)
        if self.batch is not None:
            self.batch.batch_fill_next_token_bitmask(matchers, t)
        else:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(t, i)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def done(self, m) -> bool:
        return m.is_terminated()


def run_engine(eng, kind: str, spec, batch: int, steps: int, texts: list[str], seed: int) -> dict:
    t0 = time.perf_counter()
    compiled = eng.compile(kind, spec)
    compile_s = time.perf_counter() - t0
    matchers = [eng.matcher(compiled) for _ in range(batch)]
    lengths = [0] * batch
    walks = [Walk(texts, seed + i) for i in range(batch)]
    bitmask = np.zeros((batch, (VOCAB + 31) // 32), dtype=np.int32)
    fill_t, accept_t = [], []
    for _ in range(steps):
        a = time.perf_counter()
        eng.fill(matchers, bitmask)
        b = time.perf_counter()
        tokens = [walks[i].pick(allowed_of(bitmask[i])) for i in range(batch)]
        c = time.perf_counter()
        for i, m in enumerate(matchers):
            ok = eng.accept(m, tokens[i])
            assert ok, (eng.name, tokens[i])
            lengths[i] += 1
        d = time.perf_counter()
        for i, m in enumerate(matchers):
            if tokens[i] in END or eng.done(m) or lengths[i] >= WALK:
                matchers[i], lengths[i] = eng.matcher(compiled), 0
        fill_t.append(b - a)
        accept_t.append(d - c)
    return {"compile_ms": compile_s * 1e3, "fill_us": statistics.mean(fill_t) * 1e6,  # means: the cost adds up
            "accept_us": statistics.mean(accept_t) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--threads", type=int, default=2, help="threads of the batched fill (llguidance LLExecutor, "
                    "xgrammar BatchGrammarMatcher)")
    args = ap.parse_args()
    import tokenizers

    model_dir = default_model_dir()
    tok_json = (model_dir / "tokenizer.json").read_text()
    hf = tokenizers.Tokenizer.from_str(tok_json)
    texts = [hf.decode([i], skip_special_tokens=False) for i in range(VOCAB)]
    engines = [("llguidance", lambda: Llg(tok_json, None)), ("llguidance, LLExecutor", lambda: Llg(tok_json, args.threads))]
    try:
        import xgrammar  # noqa: F401

        engines += [("xgrammar", lambda: Xgr(model_dir, None)),
                    ("xgrammar, BatchGrammarMatcher", lambda: Xgr(model_dir, args.threads))]
    except ImportError:
        print("xgrammar not importable: llguidance only (see the module docstring)")
    print(f"load average at start: {loadavg()}")
    rows = []
    for label, make in engines:
        eng = make()
        for kind, spec in (("json", SCHEMA), ("regex", REGEX)):
            for batch in (1, 16):
                rs = [run_engine(eng, kind, spec, batch, args.steps, texts, 1000 * r) for r in range(args.rounds)]
                med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                rows.append((label, kind, batch, eng.setup_s * 1e3, med))
                print(f"{label:32s} {kind:5s} batch {batch:2d}: tokenizer {eng.setup_s * 1e3:7.1f} ms, "
                      f"compile {med['compile_ms']:7.2f} ms, fill {med['fill_us']:8.1f} us, "
                      f"accept {med['accept_us']:7.1f} us, per row {(med['fill_us'] + med['accept_us']) / batch:7.1f} us",
                      flush=True)
    print(f"load average at end: {loadavg()}")
    print("\n| engine | grammar | batch | tokenizer set-up (ms) | compile (ms) | fill masks (us/step) "
          "| accept tokens (us/step) | per row (us) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for label, kind, batch, setup, med in rows:
        print(f"| {label} | {kind} | {batch} | {setup:.1f} | {med['compile_ms']:.2f} | {med['fill_us']:.1f} "
              f"| {med['accept_us']:.1f} | {(med['fill_us'] + med['accept_us']) / batch:.1f} |")


if __name__ == "__main__":
    main()
