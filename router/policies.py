"""Routing policies: which of the available workers of one role gets the next leg.

A policy sees only the workers that are in rotation (healthy, breaker closed) and the
request body, so request-aware policies (cache_aware by prompt prefix, session by a
user/session field, kv_aware from the engines' KV events) fit the same interface.
The router holds one policy instance per role, so state such as a round-robin cursor
is per role.
"""
from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from typing import Sequence

from router.workers import Worker


class RoutingPolicy(ABC):
    name: str

    @abstractmethod
    def choose(self, workers: Sequence[Worker], request: dict) -> Worker:
        """Pick one of `workers` (non-empty) for `request` (the client's JSON body)."""


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, workers: Sequence[Worker], request: dict) -> Worker:
        return workers[next(self._turn) % len(workers)]


class RandomChoice(RoutingPolicy):
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, workers: Sequence[Worker], request: dict) -> Worker:
        return self._rng.choice(workers)


class PowerOfTwo(RoutingPolicy):
    """Two random candidates, the one with fewer requests in flight wins: near
    least-loaded balance without a global scan or herding onto one idle worker."""

    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, workers: Sequence[Worker], request: dict) -> Worker:
        if len(workers) == 1:
            return workers[0]
        a, b = self._rng.sample(list(workers), 2)
        return a if a.in_flight <= b.in_flight else b


POLICIES: dict[str, type[RoutingPolicy]] = {p.name: p for p in (RoundRobin, RandomChoice, PowerOfTwo)}


def make_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name]()
