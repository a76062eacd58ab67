"""Routing policies: which of the available workers of one role gets the next leg.

A policy sees only the workers in rotation (healthy, breaker closed) and the request
(`RouteRequest`: the client's JSON body, its headers, and lazily its prompt text and
token ids). The router holds one policy instance per role (`--prefill-policy`,
`--decode-policy`, `--policy` for both), so state such as a round-robin cursor, a prefix
tree or a session table is per role. Every choice is counted in
`atomd_router:decision_total{role,policy,decision}`.

- round_robin      in turn.
- random           uniformly.
- power_of_two     two random candidates, the one with fewer prompt tokens in flight wins
                   (then fewer legs in flight).
- cache_aware      sgl-router's: an approximate prefix tree over request text per role and
                   LoRA adapter (router/prefix_tree.py). When the load is imbalanced (max - min legs in
                   flight > balance_abs_threshold and max > min * balance_rel_threshold) the
                   least loaded worker wins; otherwise the worker that has seen the longest
                   prefix of the text, if it covers more than cache_threshold of it, else the
                   worker with the smallest tree.
- kv_aware         exact: the engines' KV events (router/kv_index.py) say which blocks each
                   (worker, DP rank) holds; a request's chained block hashes
                   (contracts/block_hash.py, the engines' own) give each rank's hit. Cost =
                   prompt tokens not cached + kv_load_weight x uncached prompt tokens already
                   in flight on the worker (a leg counts what it will compute, not its cached
                   prefix); the cheapest rank wins, and with DP the leg is pinned to that rank
                   (X-data-parallel-rank). A worker without events or gone stale scores an
                   empty cache. The hit it expected is observed per choice.
- consistent_hash  a hash ring (160 points per worker) keyed by the session (header
                   --session-header, else the body's `user`), else the prompt's first 256
                   characters: the same key meets the same worker while the set holds.
- session          sticky: a session's first request goes to the least loaded worker, and
                   its later ones follow while that worker is in rotation (idle TTL).
"""
from __future__ import annotations

import bisect
import itertools
import random
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any, Callable, Sequence

import xxhash

from contracts.block_hash import block_hashes
from router.prefix_tree import PrefixTree
from router.tokenizer import RouterTokenizer, prompt_token_ids

SESSION_HEADER = "x-session-id"
PROMPT_KEY_CHARS = 256


class RouteRequest:
    """What a policy may look at. Text and tokens are computed once, on first use."""

    __slots__ = ("body", "headers", "tokenizer", "dp_rank", "expected_hit", "lora", "_text", "_tokens", "_tokenized",
                 "_est")

    def __init__(self, body: dict, headers: dict | None = None, tokenizer: RouterTokenizer | None = None):
        self.body = body
        self.headers = headers or {}
        self.tokenizer = tokenizer
        self.dp_rank: dict[str, int] = {}  # role -> DP rank a policy pinned the leg to
        self.expected_hit: dict[str, int] = {}  # role -> prompt tokens kv_aware expects cached there
        self.lora: str | None = None  # the LoRA adapter `model` names (a worker serves it), else None
        self._text: str | None = None
        self._tokens: list[int] | None = None
        self._tokenized = False
        self._est: int | None = None

    @property
    def text(self) -> str:
        """The prompt as text: a completion prompt, or the chat messages' roles and contents."""
        if self._text is None:
            b = self.body
            if "messages" in b and isinstance(b["messages"], list):
                parts = []
                for m in b["messages"]:
                    if isinstance(m, dict):
                        c = m.get("content")
                        if isinstance(c, list):  # content parts
                            c = "".join(t for p in c if isinstance(p, dict) and isinstance(t := p.get("text"), str))
                        parts.append(f"{m.get('role', '')}:{c or ''}\n")
                self._text = "".join(parts)
            else:
                p = b.get("prompt", "")
                if isinstance(p, list) and p and not isinstance(p[0], int):
                    p = p[0]
                self._text = p if isinstance(p, str) else " ".join(map(str, p)) if isinstance(p, list) else ""
        return self._text

    @property
    def tokens(self) -> list[int] | None:
        if not self._tokenized:
            self._tokenized = True
            if self.tokenizer is not None:
                self._tokens = self.tokenizer.token_ids(self.body)
            elif "messages" not in self.body:
                self._tokens = prompt_token_ids(self.body.get("prompt"), None)
        return self._tokens

    @property
    def est_tokens(self) -> int:
        """Prompt tokens: counted when tokenized, else ~4 characters a token."""
        if self._est is None:
            toks = self._tokens if self._tokenized else None
            self._est = len(toks) if toks is not None else len(self.text) // 4 + 1
        return self._est

    def leg_tokens(self, role: str) -> int:
        """The prompt tokens a leg costs its worker: the uncached ones when kv_aware knows."""
        return max(0, self.est_tokens - self.expected_hit.get(role, 0))

    def session_key(self, header: str = SESSION_HEADER) -> str | None:
        key = self.headers.get(header)
        if key:
            return key
        user = self.body.get("user")
        return user if isinstance(user, str) and user else None


def as_request(request: Any) -> RouteRequest:
    return request if isinstance(request, RouteRequest) else RouteRequest(request if isinstance(request, dict) else {})


def load_of(w: Any) -> tuple[int, int]:
    return getattr(w, "in_flight_tokens", 0), w.in_flight


Decide = Callable[[str, str], None]  # (policy, decision)


class RoutingPolicy(ABC):
    name: str

    def __init__(self, **options: Any) -> None:
        self.decide: Decide = lambda policy, decision: None
        self.role = ""

    @abstractmethod
    def choose(self, workers: Sequence[Any], request: Any) -> Any:
        """Pick one of `workers` (non-empty) for `request` (a RouteRequest, or the body)."""

    def forget(self, url: str) -> None:
        """A worker left the registry."""


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self._turn = itertools.count()

    def choose(self, workers, request):
        self.decide(self.name, "round_robin")
        return workers[next(self._turn) % len(workers)]


class RandomChoice(RoutingPolicy):
    name = "random"

    def __init__(self, seed: int | None = None, **options: Any) -> None:
        super().__init__()
        self._rng = random.Random(seed)

    def choose(self, workers, request):
        self.decide(self.name, "random")
        return self._rng.choice(workers)


class PowerOfTwo(RoutingPolicy):
    """Two random candidates, the one with less work in flight wins: near least-loaded
    balance without a global scan or herding onto one idle worker."""

    name = "power_of_two"

    def __init__(self, seed: int | None = None, **options: Any) -> None:
        super().__init__()
        self._rng = random.Random(seed)

    def choose(self, workers, request):
        if len(workers) == 1:
            self.decide(self.name, "only_one")
            return workers[0]
        a, b = self._rng.sample(list(workers), 2)
        self.decide(self.name, "less_loaded")
        return a if load_of(a) <= load_of(b) else b


class CacheAware(RoutingPolicy):
    """One prefix tree per LoRA adapter (None: the base model): the engines never share a
    block between adapters, so the same text under two adapters shares no prefix."""

    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_size: int = 1 << 25,
                 eviction_interval_s: float = 120.0, clock=time.monotonic, **options: Any) -> None:
        super().__init__()
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self.eviction_interval_s = eviction_interval_s
        self.clock = clock
        # adapter -> its tree; the adapters are names some worker serves (router/pd.py with_adapter)
        self.trees: dict[str | None, PrefixTree] = {None: PrefixTree(clock)}
        self._next_eviction = clock() + eviction_interval_s

    @property
    def tree(self) -> PrefixTree:  # the base model's
        return self.trees[None]

    def choose(self, workers, request):
        req = as_request(request)
        text = req.text
        tree = self.trees.get(req.lora)
        if tree is None:
            tree = self.trees[req.lora] = PrefixTree(self.clock)
        loads = [w.in_flight for w in workers]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            chosen = workers[loads.index(lo)]
            decision = "load_balance"
        else:
            by_url = {w.url: w for w in workers}
            tenant, matched = tree.match(text, by_url)
            if tenant is not None and text and matched / len(text) > self.cache_threshold:
                chosen, decision = by_url[tenant], "cache_hit"
            else:
                chosen = min(workers, key=lambda w: (sum(t.size(w.url) for t in self.trees.values()), w.in_flight))
                decision = "cache_miss"
        self.decide(self.name, decision)
        if text:
            tree.insert(text, chosen.url)
        now = self.clock()
        if now >= self._next_eviction:
            self._next_eviction = now + self.eviction_interval_s
            for name, t in list(self.trees.items()):
                t.evict(self.max_tree_size)
                if name is not None and not t.chars:
                    del self.trees[name]  # an adapter no request named lately
        return chosen

    def forget(self, url: str) -> None:
        for t in self.trees.values():
            t.remove_tenant(url)


class KVAware(RoutingPolicy):
    name = "kv_aware"

    def __init__(self, kv_index=None, kv_load_weight: float = 1.0, observe_hit: Callable[[str, int], None] | None = None,
                 seed: int | None = None, **options: Any) -> None:
        super().__init__()
        self.index = kv_index
        self.load_weight = kv_load_weight
        self.observe_hit = observe_hit or (lambda role, tokens: None)
        self._rng = random.Random(seed)

    def choose(self, workers, request):
        req = as_request(request)
        tokens = req.tokens if self.index is not None else None
        if tokens is None:
            chosen = min(workers, key=lambda w: (load_of(w), self._rng.random()))
            self.decide(self.name, "no_tokens")
            return chosen
        n = len(tokens)
        hashes_by_bs: dict[int, list[int]] = {}
        best = None
        for w in workers:
            load = getattr(w, "in_flight_tokens", 0) * self.load_weight
            states = self.index.rank_states(w.url)
            dp = max(1, len(states))
            options = [(st.rank, st) for st in states] or [(None, None)]
            for rank, st in options:
                hit = 0
                if st is not None:
                    bs = st.block_size
                    hs = hashes_by_bs.get(bs)
                    if hs is None:  # the engine never reuses the block holding the last token
                        hs = hashes_by_bs[bs] = block_hashes(tokens, bs, (n - 1) // bs, lora_name=req.lora)
                    hit = self.index.match(st, hs) * bs
                cost = (n - hit) + load / dp
                key = (cost, load, self._rng.random())
                if best is None or key < best[0]:
                    best = (key, w, rank, hit, dp)
        _, chosen, rank, hit, dp = best
        if rank is not None and dp > 1:
            req.dp_rank[self.role] = rank
        req.expected_hit[self.role] = hit
        self.decide(self.name, "kv_hit" if hit else "no_hit")
        self.observe_hit(self.role, hit)
        return chosen


class ConsistentHash(RoutingPolicy):
    name = "consistent_hash"
    POINTS = 160

    def __init__(self, session_header: str = SESSION_HEADER, **options: Any) -> None:
        super().__init__()
        self.session_header = session_header
        self._ring_of: tuple[tuple[str, ...], list[int], list[Any]] | None = None

    def _ring(self, workers) -> tuple[list[int], list[Any]]:
        urls = tuple(w.url for w in workers)
        if self._ring_of is None or self._ring_of[0] != urls:
            points = sorted(((xxhash.xxh64_intdigest(f"{w.url}#{i}".encode()), w) for w in workers
                             for i in range(self.POINTS)), key=lambda p: p[0])
            self._ring_of = (urls, [p for p, _ in points], [w for _, w in points])
        return self._ring_of[1], self._ring_of[2]

    def choose(self, workers, request):
        req = as_request(request)
        key = req.session_key(self.session_header)
        if key is not None:
            self.decide(self.name, "session_key")
        else:
            key = req.text[:PROMPT_KEY_CHARS]
            self.decide(self.name, "prompt_key")
        if len(workers) == 1:
            return workers[0]
        hashes, owners = self._ring(workers)
        i = bisect.bisect(hashes, xxhash.xxh64_intdigest(key.encode())) % len(hashes)
        return owners[i]


class Session(RoutingPolicy):
    name = "session"

    def __init__(self, session_header: str = SESSION_HEADER, session_ttl_s: float = 3600.0,
                 max_sessions: int = 100_000, clock=time.monotonic, **options: Any) -> None:
        super().__init__()
        self.session_header = session_header
        self.ttl_s = session_ttl_s
        self.max_sessions = max_sessions
        self.clock = clock
        self.sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()  # key -> (worker url, last use)

    def choose(self, workers, request):
        req = as_request(request)
        key = req.session_key(self.session_header)
        least = None
        if key is None:
            self.decide(self.name, "no_key")
            return min(workers, key=load_of)
        now = self.clock()
        held = self.sessions.get(key)
        if held is not None and now - held[1] <= self.ttl_s:
            for w in workers:
                if w.url == held[0]:
                    self.sessions[key] = (w.url, now)
                    self.sessions.move_to_end(key)
                    self.decide(self.name, "sticky")
                    return w
            decision = "moved"  # its worker left rotation
        else:
            decision = "new_session"
        least = min(workers, key=load_of)
        self.sessions[key] = (least.url, now)
        self.sessions.move_to_end(key)
        while len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)
        self.decide(self.name, decision)
        return least

    def forget(self, url: str) -> None:
        for key in [k for k, (u, _) in self.sessions.items() if u == url]:
            del self.sessions[key]


POLICIES: dict[str, type[RoutingPolicy]] = {p.name: p for p in (RoundRobin, RandomChoice, PowerOfTwo, CacheAware,
                                                                KVAware, ConsistentHash, Session)}


def make_policy(name: str, **options: Any) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name](**options)
