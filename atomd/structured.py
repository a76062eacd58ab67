"""Structured outputs: grammar-constrained decoding with llguidance (issue 22).

A request's `StructuredOutputsParams` (scheduler/sequence.py; the server fills it from
`response_format`, `structured_outputs`, `guided_*` or a forced tool call) becomes one
llguidance grammar (`grammar_text`). The API process checks it without a tokenizer
(`check`, so a schema or regex that cannot compile is a 400 naming its field); the engine
compiles it against its tokenizer once per distinct grammar (`GrammarCompiler`, an LRU of
pristine matchers) and gives every sequence its own copy (`GrammarMatcher`, a deep copy:
~1 us, sharing the compiled grammar and its lexer caches).

Each sample, the sampler brings a sequence's matcher up to date with the tokens the
sequence accepted since (`advance`: its sampled tokens, a forked choice's first token, the
T0 a decode engine received from the prefill engine, a speculative run), fills the
sequence's row of a vocabulary bitmask (`fill`, 32 tokens per int32 word, llguidance's
layout) and drops the disallowed tokens of that row (`apply_bitmask`: -1e30, a zero
probability, in one arithmetic pass). Only the constrained rows pay. The pass is a small C
kernel (atomd/kernels/csrc/bitmask.c, built at first use like the attention kernels; a word of 32
allowed tokens is a copy, or nothing in place), else numpy (no compiler, a failed build,
or `ATOMD_BITMASK_KERNEL=0`): the same bits either way. The matcher state is
a function of the grammar and the tokens, so a decode engine rebuilds it by replaying T0
and a PD answer equals a colocated one.

Why llguidance and not xgrammar (benchmarks/grammar_engines.py and
benchmarks/results/structured.md, this CPU, the built-in model's 4096-token vocabulary):
xgrammar fills a mask 2-4x faster (a JSON row 3.6 vs 13.6 us, a regex row 30 vs 63 us,
means at batch 16), llguidance compiles 3-5x faster (0.7 vs 3 ms). But `import xgrammar`
loads torch and transformers, so the API process (torch-free) could not check a grammar
and name the bad field in a 400, and its wheel requires triton (286 MB of GPU kernels) on
every install; llguidance is one 3 MB wheel without dependencies that builds its tokenizer
from `tokenizer.json` alone and drops the GIL while it computes. The price, at 16
constrained rows of 16: the sampler adds 0.3-0.55 ms to a ~4.5-5 ms decode step (+5-11%,
most of it llguidance's fill) instead of an estimated +5-8%.

JSON is generated without free whitespace, with `", "` and `": "` separators (Python's
`json.dumps` style): a small model cannot pad an object with newlines forever, and the
text reads as the tokenizer's training data does. A schema's own `x-guidance` options
override that.
"""
from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import re
from collections import OrderedDict
from typing import Sequence as Seq

import llguidance
import numpy as np

from atomd.kernels import cbuild
from contracts.sampling import ReasoningSpan, StructuredOutputsParams

log = logging.getLogger(__name__)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # distinct compiled grammars an engine keeps
DROP = np.float32(1e30)  # subtracted from a masked token's logit


def load_schema(schema: str | dict) -> dict:
    """A JSON schema given as an object or as JSON text; ValueError when it is neither."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
    return schema


def grammar_text(so: StructuredOutputsParams) -> str:
    """The llguidance grammar of `so` (a JSON string; the compile cache's key)."""
    if so.json is not None:
        return llguidance.LLMatcher.grammar_from_json_schema(load_schema(so.json), defaults=JSON_OPTIONS)
    if so.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if so.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(so.regex)
    if so.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(so.choice))
    return llguidance.grammar_from("grammar", so.grammar)  # Lark, or GBNF (converted); ValueError


MAX_ERROR_CHARS = 300
_PATH = re.compile(r"(?<![#\w])(?:/[\w.@+-]+){3,}(?::\d+)*")  # a file path (not a JSON pointer: #/a/b)


def clean_error(message: str) -> str:
    """llguidance's message as a client may see it: on one line, without the native
    backtrace or any build path it may carry, and short."""
    lines = []
    for line in message.strip().splitlines():
        if "backtrace" in line.lower():
            break
        lines.append(line.strip())
    text = _PATH.sub("<path>", " ".join(line for line in lines if line))
    return text[:MAX_ERROR_CHARS] + ("..." if len(text) > MAX_ERROR_CHARS else "")


@functools.lru_cache(maxsize=CACHE_SIZE)
def _grammar_error(grammar: str) -> str:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    return clean_error(messages[0]) if is_error and messages else ""


def check(so: StructuredOutputsParams) -> None:
    """ValueError with llguidance's message when `so` cannot compile (no tokenizer needed)."""
    try:
        text = grammar_text(so)
    except ValueError as e:
        raise ValueError(clean_error(str(e))) from None
    error = _grammar_error(text)
    if error:
        raise ValueError(error)


# where a sequence is relative to its reasoning block (ReasoningSpan); a grammar without
# one is always in _GRAMMAR
_GRAMMAR, _OPENING, _REASONING = 0, 1, 2  # the grammar's tokens; the first token; free text


class GrammarMatcher:
    """One sequence's position in its grammar. With a `ReasoningSpan` the grammar starts
    after the reasoning block (vLLM's rule): while the sequence is inside it every token is
    allowed and none is fed to the grammar; the token that ends it is not the grammar's
    either; at the first token of a span that may open the block (`start_token_id`), the
    grammar's tokens and that one are allowed."""

    __slots__ = ("matcher", "num_consumed", "end_mask", "span", "phase")

    def __init__(self, matcher: "llguidance.LLMatcher", end_mask: np.ndarray, span: ReasoningSpan | None = None):
        self.matcher = matcher
        self.num_consumed = 0  # completion tokens taken so far (the grammar's and the reasoning's)
        self.end_mask = end_mask  # the bitmask row allowing only the end tokens
        self.span = span
        self.phase = _GRAMMAR if span is None else _REASONING if span.start_token_id is None else _OPENING

    def _split(self, tokens: Seq[int]) -> tuple[int, Seq[int]]:
        """The phase after `tokens` and the part of them that is the grammar's (pure)."""
        phase = self.phase
        if phase == _GRAMMAR or not tokens:
            return phase, tokens
        if phase == _OPENING:
            if tokens[0] != self.span.start_token_id:
                return _GRAMMAR, tokens
            tokens = tokens[1:]
        for k, t in enumerate(tokens):
            if t == self.span.end_token_id:
                return _GRAMMAR, tokens[k + 1:]
        return _REASONING, ()

    def advance(self, tokens: Seq[int]) -> bool:
        """Feed the tokens the sequence accepted since the last call; False when one broke
        the grammar (the matcher then allows only the end tokens: the sequence stops)."""
        self.num_consumed += len(tokens)
        self.phase, tokens = self._split(tokens)
        if tokens and not self.matcher.is_error():
            return self.matcher.consume_tokens(list(tokens))
        return not self.matcher.is_error()

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed tokens into `row` (int32, C-contiguous, one bit per token)."""
        self.fill_at(row.reshape(1, -1), 0, row.ctypes.data)

    def fill_at(self, bitmask: np.ndarray, j: int, address: int) -> None:
        """fill(bitmask[j]) without making the row's view (the sampler's loop: numpy's
        `.ctypes` is slow): `bitmask` int32, C-contiguous, `address` the data pointer of its row j."""
        if self.phase == _REASONING:
            bitmask[j] = -1  # every token
        elif self.matcher.is_error():
            bitmask[j] = self.end_mask
        else:
            self.matcher.unsafe_compute_mask_ptr(address, bitmask.strides[0])
            if self.phase == _OPENING:
                t = self.span.start_token_id
                bitmask[j].view(np.uint32)[t // 32] |= np.uint32(1 << (t % 32))

    def fill_after(self, tokens: Seq[int], row: np.ndarray) -> None:
        """fill() as it would be after `tokens` (speculative drafts), the state left as it
        was; the end tokens only when `tokens` break the grammar."""
        phase, tokens = self._split(tokens)
        if phase == _REASONING:
            row[:] = -1
            return
        n = 0 if self.matcher.is_error() else self.matcher.try_consume_tokens(list(tokens))
        if n == len(tokens):
            saved, self.phase = self.phase, phase
            self.fill(row)
            self.phase = saved
        else:
            row[:] = self.end_mask
        if n:
            self.matcher.rollback(n)

    def sync(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        """advance() by what a sequence with these tokens accepted since the last sync."""
        start = num_prompt_tokens + self.num_consumed
        if len(token_ids) == start + 1 and self.phase == _GRAMMAR:  # one decode step: no slice, no list
            self.num_consumed += 1
            if not self.matcher.is_error():
                self.matcher.consume_token(token_ids[-1])
        elif len(token_ids) > start:
            self.advance(token_ids[start:])


class GrammarCompiler:
    """The engine's grammars: each distinct one compiled once against the tokenizer (an LRU
    of pristine matchers), copied for every sequence that uses it."""

    def __init__(self, tokenizer_json: str, vocab_size: int, end_token_ids: Seq[int], cache_size: int = CACHE_SIZE):
        self.vocab_size = vocab_size
        self.end_token_ids = [int(t) for t in end_token_ids]
        self.cache_size = cache_size
        self.words = (vocab_size + 31) // 32  # int32 words per bitmask row
        self._tokenizer_json: str | None = tokenizer_json
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self.hits = self.misses = 0
        self.end_mask = np.zeros(self.words, dtype=np.int32)
        for t in self.end_token_ids:
            self.end_mask.view(np.uint32)[t // 32] |= np.uint32(1 << (t % 32))

    @property
    def tokenizer(self) -> "llguidance.LLTokenizer":
        if self._tokenizer is None:  # built at the first structured request (~10-20 ms)
            self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                     eos_token=self.end_token_ids or None)
            self._tokenizer_json = None
        return self._tokenizer

    def compile(self, so: StructuredOutputsParams) -> "llguidance.LLMatcher":
        """The pristine matcher of `so`'s grammar; ValueError when it does not compile (or
        its reasoning span names a token outside the vocabulary)."""
        span = so.reasoning
        if span is not None and max(span.end_token_id, span.start_token_id or 0) >= self.vocab_size:
            raise ValueError(f"the reasoning tags' token ids ({span.start_token_id}, {span.end_token_id}) "
                             f"lie outside the vocabulary of {self.vocab_size}")
        try:
            key = grammar_text(so)
        except ValueError as e:
            raise ValueError(clean_error(str(e))) from None
        matcher = self._cache.get(key)
        if matcher is not None:
            self.hits += 1
            self._cache.move_to_end(key)
            return matcher
        self.misses += 1
        matcher = llguidance.LLMatcher(self.tokenizer, key, log_level=0)
        if matcher.is_error():
            raise ValueError(clean_error(matcher.get_error()))
        self._cache[key] = matcher
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return matcher

    def matcher(self, so: StructuredOutputsParams) -> GrammarMatcher:
        return GrammarMatcher(self.compile(so).deep_copy(), self.end_mask, so.reasoning)

    def new_bitmask(self, rows: int) -> np.ndarray:
        return np.zeros((rows, self.words), dtype=np.int32)


KERNEL_ENV = "ATOMD_BITMASK_KERNEL"  # "0": apply masks with numpy even where the C kernel builds
_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64
_DROP_C = float(DROP)  # ctypes takes a Python float; exactly DROP again as a C float


@functools.cache
def bitmask_kernel() -> "ctypes._CFuncPtr | None":
    """atomd/kernels/csrc/bitmask.c's `atomd_apply_bitmask` (prebuilt or built at first use, like the
    attention kernels: atomd/kernels/cbuild.py), or None: no compiler, a failed build (both logged),
    or $ATOMD_BITMASK_KERNEL=0. `apply_bitmask` then takes the numpy path (same results)."""
    if os.environ.get(KERNEL_ENV, "1") == "0":
        log.info("%s=0: grammar masks are applied by numpy", KERNEL_ENV)
        return None
    lib = cbuild.load(*cbuild.bitmask_kernel(), log, "grammar masks are applied by numpy")
    if lib is None:
        return None
    fn = lib.atomd_apply_bitmask
    fn.restype = ctypes.c_int
    fn.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, ctypes.c_float, ctypes.c_int]
    fn.lib = lib  # keeps the library loaded as long as the function is
    return fn


def apply_bitmask(logits: np.ndarray, rows: Seq[int], bitmask: np.ndarray, out: np.ndarray | None = None,
                  kernel: bool | None = None) -> np.ndarray:
    """out[rows[j], t] = logits[rows[j], t] - DROP for every token t whose bit in bitmask[j]
    is 0, logits[rows[j], t] - 0 for the others, the rows not in `rows` copied (`logits` a
    float32 [batch, vocab] array, bitmask int32 [len(rows), >= words], `rows` distinct, a
    little-endian machine; `out` defaults to `logits`: in place). A masked logit becomes
    ~-1e30: softmax gives it exactly 0, as it would -inf. `kernel`: True the C kernel
    (ValueError where it did not build), False numpy, None (the default) the kernel where it
    built and the arrays' layout suits it (rows of contiguous floats). Both give the same bits."""
    if out is None:
        out = logits
    if len(rows) == 0:  # (an empty array's strides are 0)
        if out is not logits:
            out[...] = logits
        return out
    fn = bitmask_kernel() if kernel is not False else None
    if fn is not None:
        assert logits.dtype == out.dtype == np.float32 and bitmask.dtype == np.int32 and out.shape == logits.shape
        assert bitmask.shape[0] == len(rows) and bitmask.shape[1] * 32 >= logits.shape[1]
        if not (logits.strides[1] == out.strides[1] == bitmask.strides[1] == 4 and logits.strides[0] % 4 == 0
                and out.strides[0] % 4 == 0 and bitmask.strides[0] % 4 == 0):
            fn = None
    if fn is None:
        if kernel:
            raise ValueError("the bitmask kernel did not build (see the log) or cannot read these arrays")
        return _apply_bitmask_numpy(logits, rows, bitmask, out)
    apply_bitmask_at(fn, logits.ctypes.data, logits.strides[0] // 4, out.ctypes.data, out.strides[0] // 4,
                     bitmask.ctypes.data, bitmask.strides[0] // 4, rows, *logits.shape)
    return out


def apply_bitmask_at(fn, logits: int, logits_stride: int, out: int, out_stride: int, bitmask: int,
                     mask_stride: int, rows: Seq[int], batch: int, vocab: int) -> None:
    """apply_bitmask through the kernel `fn` (bitmask_kernel()) on addresses, for a caller
    that has them (the sampler: torch's data_ptr() costs 0.06 us, numpy's .ctypes 1 us):
    float32 rows of `vocab` contiguous floats `logits_stride` / `out_stride` floats apart
    (out == logits: in place, the same stride), int32 bitmask rows `mask_stride` words
    apart; that layout is the caller's to get right."""
    n = len(rows)
    if out == logits and out_stride != logits_stride:
        raise ValueError("apply_bitmask in place with two strides")
    index = None if n == batch and list(rows) == list(range(n)) else np.array(rows, dtype=np.int64)
    status = fn(logits, logits_stride, out, out_stride, bitmask, mask_stride,
                None if index is None else index.ctypes.data, n, batch, vocab, _DROP_C, 1)
    if status != 0:
        raise ValueError(f"apply_bitmask: rows {list(rows)} out of range for {batch} rows (or out of memory)")


# a bitmask byte -> the drops of its 8 tokens (0 where the bit is set, DROP where not;
# little-endian bit order, llguidance's layout)
_DROP_BY_BYTE = ((1 - np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little"))
                 * DROP).astype(np.float32)


def _apply_bitmask_numpy(logits: np.ndarray, rows: Seq[int], bitmask: np.ndarray, out: np.ndarray) -> np.ndarray:
    """apply_bitmask without the kernel: one table lookup per mask byte and one subtraction,
    no branch per token (a `putmask` to -inf costs 5-10x as much on a mask that is half
    ones) and no copy of the logits first."""
    vocab = logits.shape[1]
    drop = np.take(_DROP_BY_BYTE, bitmask.view(np.uint8), axis=0).reshape(len(bitmask), -1)[:, :vocab]
    if len(rows) == logits.shape[0] and list(rows) == list(range(len(rows))):
        np.subtract(logits, drop, out=out)
    else:
        if out is not logits:
            out[...] = logits
        for j, r in enumerate(rows):  # a row of a C-contiguous array: a view, written in place
            np.subtract(logits[r], drop[j], out=out[r])
    return out
