"""DNS discovery of workers: `--prefill-dns NAME:PORT` / `--decode-dns NAME:PORT`.

Every address NAME resolves to is a worker at http://ADDRESS:PORT. On Kubernetes NAME
is a headless Service, whose A/AAAA records are its pods' IPs, so a `kubectl scale`, a
restarted pod (new IP) or a rolling update shows up at the next resolution, without
RBAC or a router restart. Resolution runs every `refresh_s` seconds:

- an address that appears is registered (WorkerRegistry.add) and health-checked at
  once, so it enters rotation as soon as its /ready answers;
- an address that is no longer resolved is removed (WorkerRegistry.remove): it leaves
  rotation at once, and its connection pool closes only when its last in-flight request
  ends (Worker.retire), so removal never cuts a request;
- a name that does not exist (NXDOMAIN: a headless Service with no pods) resolves to
  no workers; any other failure (timeout, SERVFAIL) keeps what the name resolved to
  last time, so a DNS hiccup does not empty the router.

Discovery only ever removes workers it added: static `--prefill` / `--decode` URLs and
workers registered by POST /workers stay. A discovered worker removed by
DELETE /workers comes back at the next resolution while DNS still names it.

The resolver is injectable (`Resolver`): tests map names to 127.0.0.1 ports with it.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from typing import Awaitable, Callable, NamedTuple

from router.workers import ROLES, WorkerRegistry, check_role

logger = logging.getLogger("atomd.router.discovery")

RESOLVE_TIMEOUT_S = 5.0
# getaddrinfo's answers for "this name has no addresses": the name resolves to no workers
NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}

# (name, port) -> the (host, port) addresses serving it
Resolver = Callable[[str, int], Awaitable[list[tuple[str, int]]]]


class NameNotFound(Exception):
    """The name has no addresses (as opposed to a failed lookup)."""


class DnsTarget(NamedTuple):
    role: str
    name: str
    port: int

    def __str__(self) -> str:
        return f"{self.name}:{self.port}"


def parse_target(spec: object, role: str) -> DnsTarget:
    """'NAME:PORT' -> DnsTarget; a ValueError names what is wrong."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"{role}_dns must look like NAME:PORT, got {spec!r}")
    name, _, port = spec.rpartition(":")
    if not name or "/" in name or name.startswith("[") or ":" in name:
        raise ValueError(f"{role}_dns must look like NAME:PORT (a DNS name, no scheme), got {spec!r}")
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"{role}_dns port must be a number, got {spec!r}") from None
    if not 0 < number < 65536:
        raise ValueError(f"{role}_dns port must be in 1..65535, got {spec!r}")
    return DnsTarget(check_role(role), name, number)


async def system_resolver(name: str, port: int) -> list[tuple[str, int]]:
    """Every address getaddrinfo gives for `name` (all of a headless Service's pods)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        if e.errno in NO_SUCH_NAME:
            raise NameNotFound(f"{name}: {e.strerror}") from None
        raise
    return sorted({(info[4][0], port) for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)})


def worker_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class DnsDiscovery:
    """Keeps the registry's workers in step with what the targets resolve to."""

    def __init__(self, registry: WorkerRegistry, targets: list[DnsTarget], refresh_s: float,
                 resolver: Resolver | None = None):
        if not refresh_s > 0:
            raise ValueError(f"dns_refresh_s must be > 0, got {refresh_s!r}")
        self.registry = registry
        self.targets = list(targets)
        self.refresh_s = refresh_s
        self.resolver = resolver or system_resolver
        self.resolved: dict[DnsTarget, set[str]] = {}  # last good answer per target, as URLs
        self.errors: dict[DnsTarget, str] = {}  # targets whose last lookup failed, and why
        self.owned: set[tuple[str, str]] = set()  # (role, url) this discovery registered
        self._task: asyncio.Task | None = None

    async def resolve(self, target: DnsTarget) -> set[str]:
        """The target's worker URLs now; on a failed lookup, the last good answer."""
        try:
            addresses = await asyncio.wait_for(self.resolver(target.name, target.port), RESOLVE_TIMEOUT_S)
        except NameNotFound as e:
            addresses = []
            self._note_error(target, None)
            if self.resolved.get(target):
                logger.warning("%s worker name %s no longer exists (%s): its workers leave", target.role,
                               target, e)
        except Exception as e:  # timeout, SERVFAIL, a resolver bug: keep the last answer
            self._note_error(target, f"{type(e).__name__}: {e}")
            return self.resolved.get(target, set())
        else:
            self._note_error(target, None)
        urls = {worker_url(host, port) for host, port in addresses}
        self.resolved[target] = urls
        return urls

    def _note_error(self, target: DnsTarget, error: str | None) -> None:
        if error is None:
            if self.errors.pop(target, None) is not None:
                logger.info("%s worker name %s resolves again", target.role, target)
        elif self.errors.get(target) != error:
            self.errors[target] = error
            logger.warning("cannot resolve %s worker name %s (keeping its %d last known workers): %s",
                           target.role, target, len(self.resolved.get(target, ())), error)

    async def refresh(self) -> None:
        """One round: resolve every target, add what appeared, remove what went away."""
        answers = await asyncio.gather(*(self.resolve(t) for t in self.targets))
        wanted = {(t.role, url) for t, urls in zip(self.targets, answers) for url in urls}
        added = []
        for role, url in sorted(wanted):
            worker, created = self.registry.add(url, role)
            if created:
                self.owned.add((role, worker.url))
                added.append(worker)
                logger.info("discovered %s worker %s", role, worker.url)
        for role, url in sorted(self.owned - wanted):
            self.owned.discard((role, url))
            removed = await self.registry.remove(url, role)
            if removed:
                logger.info("%s worker %s is no longer resolved: out of rotation (%d requests in flight "
                            "finish first)", role, url, sum(w.in_flight for w in removed))
        await asyncio.gather(*(self.registry.check(w) for w in added))  # in rotation once /ready answers

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except Exception:  # one bad round must not end discovery for good
                logger.exception("DNS discovery round failed")

    def start(self) -> None:
        """Resolve every refresh_s seconds from now on (refresh() once before, for the first set)."""
        if self.targets:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def describe(self) -> list[dict]:
        return [{"role": t.role, "name": str(t), "workers": sorted(self.resolved.get(t, ())),
                 "error": self.errors.get(t)} for t in self.targets]


def targets_of(prefill_dns: list[str], decode_dns: list[str]) -> list[DnsTarget]:
    return [parse_target(spec, role) for role, specs in zip(ROLES, (prefill_dns, decode_dns)) for spec in specs]
