"""Counters the scheduler keeps for metrics: prefix-cache hits and speculative acceptance.

Plain Python ints: they never wrap (the seed's int32 counters did on long-running engines).
"""
from __future__ import annotations


class CacheStats:
    """Prefix-cache lookups, counted in tokens at each admission (vLLM's queries/hits)."""

    __slots__ = ("requests", "queries", "hits")

    def __init__(self) -> None:
        self.requests = 0
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of those, tokens whose KV was found cached

    def update(self, num_cached_tokens: int, num_tokens: int) -> None:
        self.requests += 1
        self.hits += int(num_cached_tokens)
        self.queries += int(num_tokens)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def as_dict(self) -> dict:
        return {"requests": self.requests, "queries": self.queries, "hits": self.hits,
                "hit_rate": self.hit_rate}


class SpecStats:
    """Speculative decoding: how many drafts each verify step accepted."""

    __slots__ = ("num_speculative_tokens", "num_steps", "num_draft_tokens",
                 "num_accepted_tokens", "distribution")

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.num_steps = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # accepted drafts per step -> number of steps
        self.distribution = {k: 0 for k in range(num_speculative_tokens + 1)}

    def update(self, num_drafts: int, num_accepted_drafts: int) -> None:
        """One sequence's verify step: `num_drafts` proposed, the first `num_accepted_drafts` kept."""
        self.num_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted_drafts
        self.distribution[num_accepted_drafts] = self.distribution.get(num_accepted_drafts, 0) + 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self) -> dict:
        return {"num_steps": self.num_steps, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": self.acceptance_rate, "distribution": dict(self.distribution)}
