"""The worker registry: which engines exist, which may take traffic, and how to reach them.

A worker is in rotation when its last health check passed (`GET /ready` to get in,
`GET /health` to stay) and its circuit breaker lets traffic through. Health checks catch
an engine that is down or still loading; the breaker catches one that fails the requests
themselves (connection refused, 5xx, timeouts) faster than the next health check would.

Every worker owns one `aiohttp.ClientSession`, i.e. one keep-alive connection pool,
reused by every request routed to it: opening a TCP connection per leg would add a
round trip and a slow-start to every request. aiohttp's protocol sets TCP_NODELAY on
each upstream socket (without it a small SSE event can sit ~40 ms behind Nagle).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Iterable
from urllib.parse import urlsplit

import aiohttp

logger = logging.getLogger("atomd.router.workers")

ROLES = ("prefill", "decode")
HEALTH_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 5.0


class CircuitBreaker:
    """closed -> open after `failure_threshold` consecutive failures; open refuses traffic
    for `cooldown_s`; then half-open lets exactly one trial request through, whose success
    closes the breaker and whose failure opens it for another cool-down."""

    CLOSED, OPEN, HALF_OPEN = 0, 1, 2
    NAMES = {CLOSED: "closed", OPEN: "open", HALF_OPEN: "half_open"}

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

    @property
    def state(self) -> int:
        if self._opened_at is None:
            return self.CLOSED
        if self.clock() - self._opened_at < self.cooldown_s:
            return self.OPEN
        return self.HALF_OPEN

    def allows(self) -> bool:
        """May a request be sent now? Side-effect free: policies call it on every candidate."""
        state = self.state
        return state == self.CLOSED or (state == self.HALF_OPEN and not self._trial_in_flight)

    def on_dispatch(self) -> bool:
        """Note a request sent; True when it is the half-open trial."""
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
            self._opened_at = self.clock()
        self._trial_in_flight = False


class Worker:
    """One engine server (`atomd serve`) in one role, with its own connection pool."""

    def __init__(self, url: str, role: str, breaker: CircuitBreaker):
        self.url = url
        self.role = role
        self.breaker = breaker
        self.healthy = False  # until the first health check passes
        self.in_flight = 0
        self.last_error: str | None = None
        self.session = aiohttp.ClientSession(
            base_url=url,
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S),
            auto_decompress=False,  # relay bytes as the engine sent them
            cookie_jar=aiohttp.DummyCookieJar(),  # engines set none; a router must not keep any
        )
        self._retired = False

    def available(self) -> bool:
        return self.healthy and not self._retired and self.breaker.allows()

    def acquire(self, dispatch: bool = True) -> bool:
        """Count a request in flight; `dispatch` marks it as traffic the breaker judges.
        Returns whether it is the breaker's trial; hand that back to release()."""
        self.in_flight += 1
        return self.breaker.on_dispatch() if dispatch else False

    async def release(self, trial: bool = False) -> None:
        if trial:
            self.breaker.abandon_trial()  # a no-op once a success or failure was recorded
        self.in_flight -= 1
        if self._retired and self.in_flight == 0:
            await self.session.close()

    async def retire(self) -> None:
        """Out of the registry: close the pool now, or when the last request on it ends."""
        self._retired = True
        if self.in_flight == 0:
            await self.session.close()

    async def check_health(self) -> bool:
        """Readiness to enter, liveness to stay: out of rotation, a worker must pass GET
        /ready (model loaded, engine answering); in rotation, GET /health (process alive)
        keeps it there, so a worker busy with a long prefill is not dropped under load."""
        path = "/health" if self.healthy else "/ready"
        try:
            async with self.session.get(path, timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)) as r:
                await r.read()
                ok = r.status == 200
                self.last_error = None if ok else f"GET {path} answered {r.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            ok = False
            self.last_error = f"GET {path} failed: {describe(e)}"
        if ok and not self.healthy:
            logger.info("worker %s (%s) is ready", self.url, self.role)
        elif not ok and self.healthy:
            logger.warning("worker %s (%s) is out of rotation: %s", self.url, self.role, self.last_error)
        self.healthy = ok
        return ok

    def describe(self) -> dict:
        return {"url": self.url, "role": self.role, "healthy": self.healthy,
                "circuit_breaker": CircuitBreaker.NAMES[self.breaker.state],
                "in_flight": self.in_flight, "last_error": self.last_error}


def describe(e: BaseException) -> str:
    """An exception for an error message (a timeout's str() is empty)."""
    return str(e) or type(e).__name__


def normalize_url(url: object) -> str:
    """`http(s)://host:port` with no path; a ValueError names the field otherwise."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"url must be a non-empty string, got {url!r}")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url must look like http://host:port, got {url!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"url must have no path or query (the router adds /v1/...), got {url!r}")
    return f"{parts.scheme}://{parts.netloc}"


def check_role(role: object) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be one of {list(ROLES)}, got {role!r}")
    return role  # type: ignore[return-value]


class WorkerRegistry:
    """All workers by (role, url) and the periodic health checks."""

    def __init__(self, health_interval_s: float = 2.0, breaker_failures: int = 5,
                 breaker_cooldown_s: float = 10.0):
        self.health_interval_s = health_interval_s
        self.breaker_failures = breaker_failures
        self.breaker_cooldown_s = breaker_cooldown_s
        self._workers: dict[tuple[str, str], Worker] = {}
        self._health_task: asyncio.Task | None = None

    def add(self, url: str, role: str) -> tuple[Worker, bool]:
        """Register a worker (idempotent). Returns (worker, created)."""
        key = (check_role(role), normalize_url(url))
        if key in self._workers:
            return self._workers[key], False
        worker = Worker(key[1], key[0], CircuitBreaker(self.breaker_failures, self.breaker_cooldown_s))
        self._workers[key] = worker
        return worker, True

    async def remove(self, url: str, role: str | None = None) -> list[Worker]:
        url = normalize_url(url)
        roles = ROLES if role is None else (check_role(role),)
        removed = [self._workers.pop((r, url)) for r in roles if (r, url) in self._workers]
        for w in removed:
            await w.retire()
        return removed

    def workers(self, role: str | None = None) -> list[Worker]:
        return [w for (r, _), w in self._workers.items() if role is None or r == role]

    def available(self, role: str, exclude: Iterable[Worker] = ()) -> list[Worker]:
        skip = set(map(id, exclude))
        return [w for w in self.workers(role) if w.available() and id(w) not in skip]

    async def check_all(self) -> None:
        await asyncio.gather(*(w.check_health() for w in self.workers()))

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
        self._workers.clear()
