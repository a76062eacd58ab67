"""The worker registry: which engines exist, which may take traffic, and how to reach them.

Roles: `prefill` and `decode` workers serve the two legs of a PD request; a `worker` is a
colocated engine (`--kv-role both`) that serves a request alone (one leg).

A worker is in rotation when its last health check passed (`GET /ready` to get in,
`GET /health` to stay) and its circuit breaker lets traffic through. Health checks catch
an engine that is down or still loading; the breaker catches one that fails the requests
themselves (connection refused, timeouts, 502-504 answers, broken answers) faster than the
next health check; never a request's own failure (a 4xx, or a 500 no other worker serves
either: router/pd.py).

Every worker owns one keep-alive connection pool (router/http.py), reused by every leg
routed to it; every upstream socket has TCP_NODELAY (without it a small SSE event can sit
~40 ms behind Nagle). A worker also counts its legs and their prompt tokens in flight (the
load the policies balance) and what it told us in `GET /kv_transfer_info` (its DP ranks
and their KV event endpoints, for kv_aware).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Iterable
from urllib.parse import urlsplit

import msgspec

from contracts.roles import Role
from router.errors import clip
from router.http import Pool, UpstreamError

logger = logging.getLogger("atomd.router.workers")

ROLES = tuple(r.value for r in Role)  # plain strings: they key dicts and JSON
PD_ROLES = (Role.PREFILL.value, Role.DECODE.value)
HEALTH_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 5.0


MAX_LORAS_SEEN = 4096  # adapter names kept per worker (a bound on what a worker can make us hold)
MAX_TP_SIZE = 1024  # an engine's tp_size past this is a bad answer, shown as 1

class CircuitBreaker:
    """closed -> open after `failure_threshold` consecutive failures; open refuses traffic
    for `cooldown_s`; then half-open lets exactly one trial request through, whose success
    closes the breaker and whose failure opens it for another cool-down."""

    CLOSED, OPEN, HALF_OPEN = 0, 1, 2
    NAMES = {CLOSED: "closed", OPEN: "open", HALF_OPEN: "half_open"}

    __slots__ = ("failure_threshold", "cooldown_s", "clock", "consecutive_failures", "_opened_at",
                 "_trial_in_flight", "times_opened")

    def __init__(self, failure_threshold: int = 5, cooldown_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.consecutive_failures = 0
        self._opened_at: float | None = None
        self._trial_in_flight = False
        self.times_opened = 0

    @property
    def state(self) -> int:
        if self._opened_at is None:
            return self.CLOSED
        if self.clock() - self._opened_at < self.cooldown_s:
            return self.OPEN
        return self.HALF_OPEN

    def allows(self) -> bool:
        """May a request be sent now? Side-effect free: policies call it on every candidate."""
        if self._opened_at is None:
            return True
        return self.state == self.HALF_OPEN and not self._trial_in_flight

    def on_dispatch(self) -> bool:
        """Note a request sent; True when it is the half-open trial."""
        if self._opened_at is None:
            return False
        if self.state == self.HALF_OPEN and not self._trial_in_flight:
            self._trial_in_flight = True
            return True
        return False

    def abandon_trial(self) -> None:
        """The trial ended with no verdict (the client hung up): let the next one try."""
        self._trial_in_flight = False

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self._opened_at = None
        self._trial_in_flight = False

    def record_failure(self) -> None:
        self.consecutive_failures += 1
        if self._trial_in_flight or self.consecutive_failures >= self.failure_threshold:
            if self._opened_at is None or self._trial_in_flight:
                self.times_opened += 1
            self._opened_at = self.clock()
        self._trial_in_flight = False


class Worker:
    """One engine server (`atomd serve`) in one role, with its own connection pool."""

    def __init__(self, url: str, role: str, breaker: CircuitBreaker, auth: bytes = b""):
        self.url = url
        self.auth = auth  # `Authorization: ...\r\n` for the engine's keyed routes the router calls itself
        self.role = role
        self.breaker = breaker
        self.healthy = False  # until the first health check passes
        self.in_flight = 0  # legs in flight
        self.in_flight_tokens = 0  # their prompt tokens (an estimate without a tokenizer)
        self.requests = 0  # legs sent
        self.failures = 0  # legs that failed on the worker's side
        self.last_error: str | None = None
        self.host = urlsplit(url).hostname or ""
        self.pool = Pool(url, CONNECT_TIMEOUT_S)
        self.kv_info: dict | None = None  # GET /kv_transfer_info, fetched when it enters rotation
        self.dp_size = 1
        self.tp_size = 1  # processes per DP rank (its --tensor-parallel-size), shown in /workers
        self.vocab_size: int | None = None  # the model's, when /kv_transfer_info says (router/kv_check.py)
        self.engine_stats: dict | None = None  # from its /metrics, for the dashboard
        # the LoRA adapters it serves (/kv_transfer_info `loras`, refreshed each health round);
        # None: an engine without --enable-lora (or one that does not say)
        self.loras: frozenset[str] | None = None
        self.loras_resident: frozenset[str] = frozenset()  # of those, the ones in memory (no load to wait for)
        self._retired = False

    @property
    def session(self) -> Pool:  # the connection pool (its `closed` says whether it was closed)
        return self.pool

    def available(self) -> bool:
        return self.healthy and not self._retired and self.breaker.allows()

    def acquire(self, dispatch: bool = True, tokens: int = 0) -> bool:
        """Count a leg in flight; `dispatch` marks it as traffic the breaker judges.
        Returns whether it is the breaker's trial; hand that back to done()."""
        self.in_flight += 1
        self.in_flight_tokens += tokens
        if dispatch:
            self.requests += 1
            return self.breaker.on_dispatch()
        return False

    def done(self, trial: bool = False, tokens: int = 0) -> None:
        if trial:
            self.breaker.abandon_trial()  # a no-op once a success or failure was recorded
        self.in_flight -= 1
        self.in_flight_tokens -= tokens
        if self._retired and self.in_flight == 0:
            self.pool.close()

    async def release(self, trial: bool = False, tokens: int = 0) -> None:
        self.done(trial, tokens)

    def failed(self, error: str) -> None:
        """The worker failed a leg (connection, 5xx, timeout, broken answer)."""
        self.failures += 1
        self.last_error = error
        self.breaker.record_failure()

    async def retire(self) -> None:
        """Out of the registry: close the pool now, or when the last request on it ends."""
        self._retired = True
        if self.in_flight == 0:
            self.pool.close()

    @property
    def retired(self) -> bool:
        return self._retired

    async def check_health(self) -> bool:
        """Readiness to enter, liveness to stay: out of rotation, a worker must pass GET
        /ready (model loaded, engine answering); in rotation, GET /health (process alive)
        keeps it there, so a worker busy with a long prefill is not dropped under load."""
        path = "/health" if self.healthy else "/ready"
        try:
            status, _, _ = await self.pool.fetch(b"GET", path.encode(), timeout_s=HEALTH_TIMEOUT_S)
            ok = status == 200
            error = None if ok else f"GET {path} answered {status}"
        except (UpstreamError, OSError) as e:
            ok = False
            error = f"GET {path} failed: {describe(e)}"
        if ok and not self.healthy:
            logger.info("worker %s (%s) is ready", self.url, self.role)
            self.last_error = None
        elif not ok:
            self.last_error = error
            if self.healthy:
                logger.warning("worker %s (%s) is out of rotation: %s", self.url, self.role, error)
        self.healthy = ok
        return ok

    async def fetch_kv_info(self) -> dict | None:
        """GET /kv_transfer_info (its DP ranks and KV event endpoints); None when it has none."""
        try:
            status, _, body = await self.pool.fetch(b"GET", b"/kv_transfer_info", self.auth,
                                                    timeout_s=HEALTH_TIMEOUT_S)
            info = msgspec.json.decode(body) if status == 200 else None
            if status in (401, 403):  # not silent: kv_aware would place by load alone
                logger.warning("worker %s refused GET /kv_transfer_info (%d): start the router with the "
                               "engines' --api-key", self.url, status)
        except (UpstreamError, OSError, msgspec.DecodeError, RecursionError):
            info = None
        if isinstance(info, dict):
            self.kv_info = info
            self.dp_size = int(info.get("dp_size") or 1)
            tp = info.get("tp_size")
            self.tp_size = tp if type(tp) is int and 1 <= tp <= MAX_TP_SIZE else 1
            vocab = info.get("vocab_size")
            self.vocab_size = vocab if type(vocab) is int and vocab > 0 else None
            loras = info.get("loras")
            self.loras = frozenset(n for n in loras[:MAX_LORAS_SEEN] if isinstance(n, str)) \
                if isinstance(loras, list) else None
            resident = info.get("loras_resident")
            self.loras_resident = frozenset(n for n in resident[:MAX_LORAS_SEEN] if isinstance(n, str)) \
                if isinstance(resident, list) and self.loras is not None else frozenset()
        return self.kv_info

    def describe(self) -> dict:
        return {"url": self.url, "role": self.role, "healthy": self.healthy,
                "circuit_breaker": CircuitBreaker.NAMES[self.breaker.state],
                "in_flight": self.in_flight, "in_flight_tokens": self.in_flight_tokens,
                "requests": self.requests, "failures": self.failures, "last_error": self.last_error,
                "dp_size": self.dp_size, "tp_size": self.tp_size,
                "loras": sorted(self.loras) if self.loras is not None else None,
                "loras_resident": sorted(self.loras_resident)}


def describe(e: BaseException) -> str:
    """An exception for an error message (a timeout's str() is empty)."""
    return str(e) or type(e).__name__


def normalize_url(url: object) -> str:
    """`http(s)://host:port` with no path; a ValueError names the field otherwise."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"url must be a non-empty string, got {clip(url)}")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url must look like http://host:port, got {clip(url)}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"url must have no path or query (the router adds /v1/...), got {clip(url)}")
    return f"{parts.scheme}://{parts.netloc}"


def check_role(role: object) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be one of {list(ROLES)}, got {clip(role)}")
    return role  # type: ignore[return-value]


class WorkerRegistry:
    """All workers by (role, url) and the periodic health checks. Listeners hear of a
    worker entering rotation (`on_ready`) and leaving the registry (`on_removed`)."""

    def __init__(self, health_interval_s: float = 2.0, breaker_failures: int = 5,
                 breaker_cooldown_s: float = 10.0, auth: bytes = b""):
        self.health_interval_s = health_interval_s
        self.auth = auth
        self.breaker_failures = breaker_failures
        self.breaker_cooldown_s = breaker_cooldown_s
        self._workers: dict[tuple[str, str], Worker] = {}
        self._by_role: dict[str, list[Worker]] = {r: [] for r in ROLES}
        self._health_task: asyncio.Task | None = None
        self.on_ready: list[Callable[[Worker], object]] = []
        self.on_removed: list[Callable[[Worker], object]] = []
        self.version = 0  # bumped on every add/remove (policies cache per-set structures)

    def add(self, url: str, role: str) -> tuple[Worker, bool]:
        """Register a worker (idempotent). Returns (worker, created)."""
        key = (check_role(role), normalize_url(url))
        if key in self._workers:
            return self._workers[key], False
        worker = Worker(key[1], key[0], CircuitBreaker(self.breaker_failures, self.breaker_cooldown_s), self.auth)
        self._workers[key] = worker
        self._by_role[key[0]].append(worker)
        self.version += 1
        return worker, True

    async def remove(self, url: str, role: str | None = None) -> list[Worker]:
        url = normalize_url(url)
        roles = ROLES if role is None else (check_role(role),)
        removed = [self._workers.pop((r, url)) for r in roles if (r, url) in self._workers]
        for w in removed:
            self._by_role[w.role].remove(w)
            self.version += 1
            await w.retire()
            for listener in self.on_removed:
                listener(w)
        return removed

    def workers(self, role: str | None = None) -> list[Worker]:
        if role is None:
            return list(self._workers.values())
        return list(self._by_role[role])

    def available(self, role: str, exclude: Iterable[Worker] = ()) -> list[Worker]:
        if exclude:
            return [w for w in self._by_role[role] if w.available() and w not in exclude]
        return [w for w in self._by_role[role] if w.available()]

    def any_available(self, role: str) -> bool:
        return any(w.available() for w in self._by_role[role])

    async def check(self, worker: Worker) -> bool:
        was = worker.healthy
        ok = await worker.check_health()
        if ok and not was:
            for listener in self.on_ready:
                result = listener(worker)
                if asyncio.iscoroutine(result):
                    await result
        elif ok and worker.loras is not None:  # adapters load and unload at run time: follow them
            await worker.fetch_kv_info()
        return ok

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.workers()))

    async def _health_loop(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.check_all()
            except Exception:  # a bug in one round must not stop health checking for good
                logger.exception("health check round failed")
            await asyncio.sleep(max(0.0, self.health_interval_s - (time.monotonic() - started)))

    def start(self) -> None:
        self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        for w in self.workers():
            await w.retire()
            w.pool.abort_all()
        self._workers.clear()
        for lst in self._by_role.values():
            lst.clear()
