"""The sampling contract: what a request asks of the sampler, and the checks its values must pass.
Shared by the API process and the engine; msgspec only."""
from __future__ import annotations

import math
from typing import Any, Iterable

import msgspec


class ReasoningSpan(msgspec.Struct, kw_only=True, frozen=True):
    """Where a reasoning block (`<think>...</think>`) lies in the output, by token ids, so a
    grammar can start after it (vLLM's structured outputs with a reasoning parser): the
    output is free text up to and including `end_token_id`, the grammar shapes what follows.
    `start_token_id` None: the output starts inside the block (the prompt opened it); else it
    may open one with that token as its very first token, and any other first token is the
    grammar's (no reasoning at all)."""

    end_token_id: int
    start_token_id: int | None = None

    def __post_init__(self) -> None:
        ids = [self.end_token_id] + ([] if self.start_token_id is None else [self.start_token_id])
        _require(all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
                 and len(set(ids)) == len(ids), "reasoning", f"must name distinct token ids, got {ids}")


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Grammar-constrained decoding (vLLM's names): exactly one of `json` (a JSON schema, as
    an object or as JSON text), `regex`, `choice` (one of these strings), `grammar` (Lark,
    or llama.cpp's GBNF) or `json_object` (any JSON object). atomd/structured.py compiles it
    (llguidance); the sampler masks every token the grammar does not allow. `reasoning`
    (set by the server under --reasoning-parser, never by a client): the grammar starts
    after the reasoning block."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    reasoning: ReasoningSpan | None = None

    def __post_init__(self) -> None:
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        _require(len(given) == 1, "structured_outputs",
                 f"must set exactly one of json, regex, choice, grammar, json_object; got {given or 'none'}")
        _require(self.choice is None or (bool(self.choice) and all(isinstance(c, str) and c for c in self.choice)),
                 "structured_outputs", "choice must be a non-empty list of non-empty strings")


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to pick tokens and when to stop (vLLM names and defaults)."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: sampled token's logprob plus top-k
    include_stop_str_in_output: bool = False
    # n and best_of: `best_of` candidates (None: n) share one prefill, the top n by
    # cumulative logprob are returned
    n: int = 1
    best_of: int | None = None
    # logits processing (vLLM's order: atomd/engine/sampler.py)
    presence_penalty: float = 0.0  # OpenAI, over generated tokens
    frequency_penalty: float = 0.0  # OpenAI, over generated tokens
    repetition_penalty: float = 1.0  # vLLM/HF, over prompt and generated tokens
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = []
    bad_words_token_ids: list[list[int]] = []  # derived from bad_words by the engine's tokenizer
    prompt_logprobs: int | None = None  # None: none; k >= 0: each prompt token's logprob plus top-k
    structured_outputs: StructuredOutputsParams | None = None  # grammar-constrained decoding
    # vLLM's request priority (lower runs first) under --scheduling-policy priority; not a sampling
    # knob, but it travels with the request to the scheduler like the stops do
    priority: int = 0
    # an embedding request (/v1/embeddings): the engine pools the final-normed hidden states of
    # the prompt ("last": the last token's; "mean": the mean over every prompt token) and
    # returns them on the request's last output (RequestOutput.embedding); None: generation
    pooling: str | None = None

    def __post_init__(self) -> None:
        for name, types in _FIELD_TYPES:
            value = getattr(self, name)
            _require(isinstance(value, types) and not isinstance(value, bool), name,
                     f"must be a number, got {value!r}")
        _require(self.seed is None or isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        _require(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _require(0 <= self.min_tokens <= self.max_tokens, "min_tokens",
                 f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        _require(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _require(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.top_k >= -1, "top_k", f"must be -1, 0 (off) or positive, got {self.top_k}")
        _require(self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0), "logprobs",
                 f"must be None or >= 0, got {self.logprobs}")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop",
                 "must be a list of non-empty strings")
        _require(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                 "stop_token_ids", "must be a list of non-negative token ids")
        _require(self.n >= 1, "n", f"must be >= 1, got {self.n}")
        _require(self.pooling in (None, "last", "mean"), "pooling", f"must be None, 'last' or 'mean', got {self.pooling!r}")
        _require(self.best_of is None or (isinstance(self.best_of, int) and not isinstance(self.best_of, bool)
                                          and self.best_of >= self.n),
                 "best_of", f"must be an integer >= n={self.n}, got {self.best_of!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        _require(0.0 < self.repetition_penalty and math.isfinite(self.repetition_penalty), "repetition_penalty",
                 f"must be > 0, got {self.repetition_penalty}")
        _require(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        if self.logit_bias is not None:
            for token, bias in self.logit_bias.items():
                _require(isinstance(token, int) and not isinstance(token, bool) and token >= 0, "logit_bias",
                         f"keys must be non-negative token ids, got {token!r}")
                _require(isinstance(bias, (int, float)) and not isinstance(bias, bool) and -100.0 <= bias <= 100.0,
                         "logit_bias", f"values must be in [-100, 100], got {bias!r} for token {token}")
        if self.allowed_token_ids is not None:
            _require(bool(self.allowed_token_ids) and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids),
                     "allowed_token_ids", "must be a non-empty list of non-negative token ids")
        _require(all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words",
                 "must be a list of non-empty strings")
        _require(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and self.prompt_logprobs >= 0),
                 "prompt_logprobs", f"must be None or >= 0, got {self.prompt_logprobs}")

    def check_vocabulary(self, vocab: int) -> None:
        """logit_bias keys and allowed_token_ids are ids of a vocabulary of `vocab` tokens
        (ValueError naming the field): what only the engine's model can tell."""
        check_in_vocabulary("logit_bias", self.logit_bias or (), vocab)
        check_in_vocabulary("allowed_token_ids", self.allowed_token_ids or (), vocab)

    @property
    def num_samples(self) -> int:
        """Sequences the prompt forks into: best_of, else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def ranked(self) -> bool:
        """best_of > n: candidates are ranked by cumulative logprob, nothing streams."""
        return self.num_samples > self.n

    def for_choice(self, index: int) -> "SamplingParams":
        """Choice `index`'s params: seed + index when seeded (vLLM's derivation), else these."""
        if index == 0 or self.seed is None:
            return self
        return msgspec.structs.replace(self, seed=self.seed + index)


_FIELD_TYPES = (("max_tokens", int), ("min_tokens", int), ("temperature", (int, float)),
                ("top_p", (int, float)), ("top_k", int), ("n", int), ("presence_penalty", (int, float)),
                ("frequency_penalty", (int, float)), ("repetition_penalty", (int, float)),
                ("min_p", (int, float)))


def check_in_vocabulary(field: str, ids: Iterable[int], vocab: int) -> None:
    """ValueError naming `field` for its first token id outside [0, vocab): the one message the
    API (a 400 before the engine) and the engine (offline callers, a producer's tokens) give."""
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"{field}: token id {bad} is outside the vocabulary [0, {vocab})")


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")
