"""The router's aiohttp application: OpenAI routes relayed over two legs, plus operations.

  POST /v1/completions, /v1/chat/completions   two-leg PD relay (router/pd.py), stream or not
  GET  /v1/models      from a decode worker
  GET  /health         200 while the router runs (no API key)
  GET  /ready          200 when at least one prefill and one decode worker are in rotation
  GET  /metrics        Prometheus text, `atomd_router:` names (no API key)
  GET|POST|DELETE /workers   run-time registration: {"url": ..., "role": "prefill"|"decode"}

Workers come from static URLs (--prefill / --decode), POST /workers, and DNS names
re-resolved every dns_refresh_s seconds (--prefill-dns / --decode-dns, router/discovery.py).

The server runs with handler cancellation on: a client that hangs up cancels its handler
at once, which closes the decode leg's connection (D aborts the request) and lets the
relay abort P's pinned transfer, instead of noticing only at the next write.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
from dataclasses import dataclass, field

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kv_transfer.trust import load_secret
from router.discovery import DnsDiscovery, Resolver, targets_of
from router.metrics import RouterMetrics
from router.pd import LegError, PDRelay, error_body
from router.policies import make_policy
from router.workers import ROLES, WorkerRegistry, describe

logger = logging.getLogger("atomd.router")

OPEN_PATHS = ("/health", "/ready", "/metrics")


@dataclass
class RouterConfig:
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    prefill_dns: list[str] = field(default_factory=list)  # NAME:PORT, every address NAME resolves to
    decode_dns: list[str] = field(default_factory=list)
    dns_refresh_s: float = 5.0
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port
    policy: str = "round_robin"
    health_interval_s: float = 2.0
    request_timeout_s: float = 600.0  # P's whole leg; the longest silence between D's bytes
    api_key: str | None = None
    breaker_failures: int = 5
    breaker_cooldown_s: float = 10.0
    max_request_body_bytes: int = 16 << 20  # as `atomd serve`: a bigger body no engine would take
    # the secret shared with the engines that the router signs kv_transfer_params with
    # (kv_transfer/trust.py); None: $ATOMD_KV_PARAMS_SECRET, else the params go unsigned
    kv_params_secret_file: str | None = None

    def __post_init__(self) -> None:
        make_policy(self.policy)  # raises ValueError naming the policy
        targets_of(self.prefill_dns, self.decode_dns)  # raises ValueError naming the bad NAME:PORT
        for name in ("health_interval_s", "request_timeout_s", "breaker_cooldown_s", "dns_refresh_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes must be >= 1, got {self.max_request_body_bytes!r}")
        if self.breaker_failures < 1:
            raise ValueError(f"breaker_failures must be >= 1, got {self.breaker_failures!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port!r}")


def json_error(status: int, message: str, type: str = "invalid_request_error", code: str | None = None) -> web.Response:
    return web.Response(status=status, body=error_body(message, type, code), content_type="application/json")


def json_response(obj: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(obj), content_type="application/json")


class Router:
    """Owns the registry, the relay and the HTTP server. Construct inside a running loop.
    `resolver`: how DNS names are looked up (default: getaddrinfo), for tests."""

    def __init__(self, config: RouterConfig, resolver: Resolver | None = None):
        self.config = config
        self.registry = WorkerRegistry(config.health_interval_s, config.breaker_failures, config.breaker_cooldown_s)
        for role, urls in (("prefill", config.prefill), ("decode", config.decode)):
            for url in urls:
                self.registry.add(url, role)
        self.discovery = DnsDiscovery(self.registry, targets_of(config.prefill_dns, config.decode_dns),
                                      config.dns_refresh_s, resolver)
        self.metrics = RouterMetrics(self.registry.workers)
        self.relay = PDRelay(self.registry, make_policy(config.policy), make_policy(config.policy),
                             self.metrics, config.request_timeout_s,
                             kv_params_secret=load_secret(path=config.kv_params_secret_file))
        self.app = web.Application(middlewares=[self.auth] if config.api_key else [],
                                   client_max_size=config.max_request_body_bytes)
        add = self.app.router
        add.add_post("/v1/completions", self.completions)
        add.add_post("/v1/chat/completions", self.chat_completions)
        add.add_get("/v1/models", self.models)
        add.add_get("/health", self.health)
        add.add_get("/ready", self.ready)
        add.add_get("/metrics", self.metrics_route)
        add.add_get("/workers", self.list_workers)
        add.add_post("/workers", self.add_worker)
        add.add_delete("/workers", self.remove_worker)
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        """Check every worker once and resolve the DNS names (so /ready is right at once),
        serve, start health checks and re-resolution."""
        await self.registry.check_all()
        await self.discovery.refresh()
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.config.host, self.config.port)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        self.registry.start()
        self.discovery.start()
        return self.url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        await self.relay.close()
        await self.discovery.close()
        await self.registry.close()

    @web.middleware
    async def auth(self, request: web.Request, handler):
        key = self.config.api_key
        if request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return json_error(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                  "authentication_error", "invalid_api_key")
        return await handler(request)

    # ---------------------------------------------------------------- OpenAI routes

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.generate(request, "completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.generate(request, "chat_completions")

    async def generate(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError as e:
            return json_error(400, f"request body is not valid JSON: {e}")
        except web.HTTPRequestEntityTooLarge:
            return json_error(413, f"request body is larger than {self.config.max_request_body_bytes} bytes")
        if not isinstance(body, dict):
            return json_error(400, "request body must be a JSON object")
        if not isinstance(body.get("stream", False), bool):
            return json_error(400, f"stream must be a boolean, got {body['stream']!r}")
        return await self.relay.handle(request, endpoint, body)

    async def models(self, request: web.Request) -> web.Response:
        workers = self.registry.available("decode")
        if not workers:
            return json_error(503, "no healthy decode worker", "service_unavailable", "no_decode_worker")
        worker = workers[0]
        headers = {k: v for k, v in request.headers.items() if k == "Authorization"}
        try:
            async with worker.session.get("/v1/models", headers=headers,
                                          timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_s)) as r:
                body = await r.read()
                return web.Response(status=r.status, body=body, content_type=r.content_type)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return LegError(502, f"decode worker {worker.url} did not answer /v1/models: {describe(e)}").response()

    # ---------------------------------------------------------------- operations

    async def health(self, request: web.Request) -> web.Response:
        return json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        counts = {role: len(self.registry.available(role)) for role in ROLES}
        ready = all(counts.values())
        return json_response({"ready": ready, "available": counts}, 200 if ready else 503)

    async def metrics_route(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def list_workers(self, request: web.Request) -> web.Response:
        return json_response({"workers": [w.describe() for w in self.registry.workers()],
                              "dns": self.discovery.describe()})

    async def worker_request(self, request: web.Request) -> dict:
        """The worker spec from a JSON body, or from the query string (handy for DELETE)."""
        if request.can_read_body:
            try:
                spec = msgspec.json.decode(await request.read())
            except msgspec.DecodeError as e:
                raise ValueError(f"request body is not valid JSON: {e}")
            if not isinstance(spec, dict):
                raise ValueError("request body must be a JSON object with url and role")
            return spec
        return dict(request.query)

    async def add_worker(self, request: web.Request) -> web.Response:
        try:
            spec = await self.worker_request(request)
            worker, created = self.registry.add(spec.get("url"), spec.get("role"))
        except ValueError as e:
            return json_error(400, str(e))
        if created:
            await worker.check_health()  # in rotation at once when it answers
            logger.info("registered %s worker %s (healthy=%s)", worker.role, worker.url, worker.healthy)
        return json_response(worker.describe(), 201 if created else 200)

    async def remove_worker(self, request: web.Request) -> web.Response:
        try:
            spec = await self.worker_request(request)
            removed = await self.registry.remove(spec.get("url"), spec.get("role"))
        except ValueError as e:
            return json_error(400, str(e))
        if not removed:
            return json_error(404, f"no worker {spec.get('url')!r} is registered", code="unknown_worker")
        return json_response({"removed": [w.describe() for w in removed]})
