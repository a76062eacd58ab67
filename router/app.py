"""The router: OpenAI routes relayed over two legs (or one, colocated), plus operations.

  POST /v1/completions, /v1/chat/completions   the relay (router/pd.py), stream or not; a completions
                       request of several prompts is one relay per prompt (router/multi_prompt.py)
  POST /v1/responses   relayed like chat; previous_response_id to the engine that stored it (router/responses.py)
  GET  /v1/models      from a decode (or colocated) worker; LoRA adapters where servable (router/lora_admin.py)
  POST /v1/load_lora_adapter, /v1/unload_lora_adapter   an adapter on every worker of a role, or all
                       (router/lora_admin.py; behind --admin-api-key when set, else --api-key)
  POST /tokenize, /detokenize; GET /tokenizer_info   relayed to one engine (any role: all share the tokenizer)
  POST /v1/embeddings  relayed to one engine (colocated, else prefill, else decode), in turn
  GET  /health         200 while the router runs (no API key)
  GET  /ready          200 when a prefill and a decode worker, or a colocated one, are in rotation
  GET  /metrics        Prometheus text, `atomd_router:` names (no API key; the per-worker series, which
                       name engine URLs, only with the key /workers takes)
  GET  /openapi.json   OpenAPI 3.1 of all of these (no API key; router/openapi.py)
  GET|POST|DELETE /workers   run-time registration: {"url": ..., "role": "prefill"|"decode"|"worker"}
                       (behind --admin-api-key when set; else --api-key)
  GET  /dashboard      the status page (static HTML + JS, no key); it polls
  GET  /dashboard/state  JSON: workers, health, breakers, load, KV usage, KV events, recent
                       TTFT / ITL, decisions, limits (admin key when set, else the API key)

Workers come from static URLs (--prefill / --decode / --worker), POST /workers, and DNS names
re-resolved every dns_refresh_s seconds (--prefill-dns / --decode-dns, router/discovery.py).
HTTP is router/http.py's: a client that hangs up cancels its handler at once, which closes
the decode leg's connection (D aborts the request) and lets the relay abort P's transfer.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
import pathlib
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, NamedTuple

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST

from kv_transfer.trust import load_secret
from router.discovery import DnsDiscovery, Resolver, targets_of
from router.errors import clip
from router.http import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, IDLE_TIMEOUT_S, MAX_PENDING_BODY_BYTES, HTTPServer, \
    Request, Response, UpstreamError
from router.kv_index import KVIndex
from router import lora_admin
from router.limits import Admission, Rejected
from router.metrics import RouterMetrics, percentile
from router.multi_prompt import MultiPrompt, several_prompts
from router.responses import RESPONSE, ResponseAffinity, relay_response
from router.openapi import AddWorker, RemoveWorker, openapi_json
from router.pd import LegError, PDRelay, RelayConfig, error_body
from router.adaptive import PD_MODES
from router.policies import POLICIES, make_policy
from router.tokenizer import RouterTokenizer
from router.workers import PD_ROLES, ROLES, Worker, WorkerRegistry, describe

logger = logging.getLogger("atomd.router")

OPEN_PATHS = ("/health", "/ready", "/metrics", "/dashboard", "/openapi.json")
ADMIN_PATHS = ("/workers", "/dashboard/state", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
DASHBOARD = pathlib.Path(__file__).with_name("dashboard.html")
ENGINE_STATS_MAX_AGE_S = 2.0
ENGINE_SERIES = ("atomd:kv_cache_usage_perc", "atomd:num_requests_running", "atomd:num_requests_waiting")


@dataclass
class RouterConfig:
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    worker: list[str] = field(default_factory=list)  # colocated engines (--kv-role both): one leg
    prefill_dns: list[str] = field(default_factory=list)  # NAME:PORT, every address NAME resolves to
    decode_dns: list[str] = field(default_factory=list)
    dns_refresh_s: float = 5.0
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port
    policy: str = "round_robin"  # both roles, unless prefill_policy / decode_policy say otherwise
    prefill_policy: str | None = None
    decode_policy: str | None = None
    health_interval_s: float = 2.0
    request_timeout_s: float = 600.0  # P's whole leg (unless prefill_timeout_s); the longest silence of D
    prefill_timeout_s: float | None = None
    total_timeout_s: float | None = None  # a whole request once admitted (legs + stream); None: none
    max_prefill_tries: int = 3
    retry_backoff_s: float = 0.01
    strict_pd: bool = False  # the alias of pd_mode="strict"
    pd_mode: str = "always"  # always | adaptive | strict (router/adaptive.py)
    local_prefill_max_tokens: int = 256  # adaptive: a prompt up to this many uncached tokens prefills on D
    local_prefill_max_itl_ms: float = 0.0  # adaptive: a backed-up P's long prompt stays remote while D's streams are this slow (0: no bound)
    api_key: str | None = None
    admin_api_key: str | None = None
    engine_admin_api_key: str | None = None  # the engines' --admin-api-key (for POST /kv_transfer/abort)
    breaker_failures: int = 5
    breaker_cooldown_s: float = 10.0
    max_request_body_bytes: int = 16 << 20  # as `atomd serve`: a bigger body no engine would take
    # what a client owes the router's HTTP server (router/http.py ServerConnection)
    client_idle_timeout_s: float = IDLE_TIMEOUT_S
    client_header_timeout_s: float = HEADER_TIMEOUT_S
    client_body_timeout_s: float = BODY_TIMEOUT_S
    max_pending_body_bytes: int = MAX_PENDING_BODY_BYTES
    max_upstream_event_bytes: int = 16 << 20  # a longer SSE event from a worker ends its stream (error event)
    max_prompts: int = 256  # prompts in one completions request (router/multi_prompt.py), as the engines' flag
    max_concurrent_requests: int = 0  # 0: no cap
    max_queued_requests: int = 1024
    queue_timeout_s: float = 30.0
    retry_after_s: int = 1
    # policies' knobs
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 1 << 25
    eviction_interval_s: float = 120.0
    kv_load_weight: float = 1.0
    kv_events_stale_s: float = 10.0
    tokenizer: str | None = None  # for kv_aware; None: the one a local engine reports
    chat_template: str | None = None  # for kv_aware: the engines' --chat-template (a file or inline); None: the model's
    session_header: str = "X-Session-Id"
    session_ttl_s: float = 3600.0
    # the secret shared with the engines that the router signs kv_transfer_params with
    # (kv_transfer/trust.py); None: $ATOMD_KV_PARAMS_SECRET, else the params go unsigned
    kv_params_secret_file: str | None = None

    def __post_init__(self) -> None:
        for name in (self.policy, self.prefill_policy, self.decode_policy):
            if name is not None:
                make_policy(name)  # raises ValueError naming the policy
        targets_of(self.prefill_dns, self.decode_dns)  # raises ValueError naming the bad NAME:PORT
        if self.pd_mode not in PD_MODES:
            raise ValueError(f"pd_mode must be one of {', '.join(PD_MODES)}, got {self.pd_mode!r}")
        if self.strict_pd and self.pd_mode == "adaptive":
            raise ValueError("--strict-pd is --pd-mode strict: it contradicts --pd-mode adaptive")
        if self.strict_pd:
            self.pd_mode = "strict"
        self.strict_pd = self.pd_mode == "strict"
        if self.local_prefill_max_tokens < 0:
            raise ValueError(f"local_prefill_max_tokens must be >= 0, got {self.local_prefill_max_tokens}")
        if self.local_prefill_max_itl_ms < 0:
            raise ValueError(f"local_prefill_max_itl_ms must be >= 0, got {self.local_prefill_max_itl_ms}")
        for name in ("health_interval_s", "request_timeout_s", "breaker_cooldown_s", "dns_refresh_s",
                     "queue_timeout_s", "kv_events_stale_s", "eviction_interval_s", "session_ttl_s",
                     "client_idle_timeout_s", "client_header_timeout_s", "client_body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("prefill_timeout_s", "total_timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        for name in ("max_request_body_bytes", "max_upstream_event_bytes", "breaker_failures", "max_prefill_tries",
                     "max_pending_body_bytes", "max_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("max_concurrent_requests", "max_queued_requests", "retry_backoff_s", "retry_after_s",
                     "balance_abs_threshold", "kv_load_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port!r}")
        if self.admin_api_key is not None and self.admin_api_key == self.api_key:
            raise ValueError("admin_api_key must differ from api_key (clients must not be admins)")

    def policy_of(self, role: str) -> str:
        own = {"prefill": self.prefill_policy, "decode": self.decode_policy, "worker": self.decode_policy}.get(role)
        return own or self.policy


def json_error(resp: Response, status: int, message: str, type: str = "invalid_request_error",
               code: str | None = None, headers: bytes = b"", param: str | None = None) -> None:
    resp.send(status, error_body(message, type, code, param), headers=headers)


def json_response(resp: Response, obj: object, status: int = 200) -> None:
    resp.send(status, msgspec.json.encode(obj))


class Route(NamedTuple):
    method: str
    resource: "Resource"
    handler: Callable[[Request, Response], Awaitable[None]]


class Resource(NamedTuple):
    canonical: str


class RouteTable:
    """(method, path) -> handler; `routes()` lists them (aiohttp's shape: .method, .resource.canonical).
    A path may have `{name}` segments (one segment each): `canonical()` finds its template."""

    def __init__(self) -> None:
        self.table: dict[tuple[str, str], Callable] = {}
        self.paths: dict[str, list[str]] = {}
        self.templates: list[tuple[list[str], str]] = []  # (segments, the template)

    def add(self, method: str, path: str, handler: Callable) -> None:
        self.table[(method, path)] = handler
        self.paths.setdefault(path, []).append(method)
        if "{" in path and self.paths[path] == [method]:
            self.templates.append((path.split("/"), path))

    def canonical(self, path: str) -> str:
        """The route `path` is served by: itself, or the template it fills in."""
        if path in self.paths:
            return path
        parts = path.split("/")
        for segments, template in self.templates:
            if len(segments) == len(parts) and all(
                    s == p or (s.startswith("{") and p) for s, p in zip(segments, parts)):
                return template
        return path

    def routes(self) -> list[Route]:
        return [Route(m, Resource(p), h) for (m, p), h in self.table.items()]


class App(NamedTuple):
    router: RouteTable


class Router:
    """Owns the registry, the relay and the HTTP server. Construct inside a running loop.
    `resolver`: how DNS names are looked up (default: getaddrinfo), for tests."""

    def __init__(self, config: RouterConfig, resolver: Resolver | None = None):
        self.config = config
        self.started_at = time.time()
        # the engines take the router's --api-key too: GET /kv_transfer_info needs it
        self.registry = WorkerRegistry(config.health_interval_s, config.breaker_failures, config.breaker_cooldown_s,
                                       f"Authorization: Bearer {config.api_key}\r\n".encode("latin-1")
                                       if config.api_key else b"")
        for role, urls in (("prefill", config.prefill), ("decode", config.decode), ("worker", config.worker)):
            for url in urls:
                self.registry.add(url, role)
        self.discovery = DnsDiscovery(self.registry, targets_of(config.prefill_dns, config.decode_dns),
                                      config.dns_refresh_s, resolver)
        self.admission = Admission(config.max_concurrent_requests, config.max_queued_requests,
                                   config.queue_timeout_s)
        self.kv_index: KVIndex | None = None
        self.tokenizer: RouterTokenizer | None = None
        self.metrics = RouterMetrics(self.registry.workers)
        self.metrics.queue_state = self.admission.state
        self.policies = {}
        for role in ROLES:
            name = config.policy_of(role)
            if name == "kv_aware" and self.kv_index is None:
                self.kv_index = KVIndex(config.kv_events_stale_s, load_secret(path=config.kv_params_secret_file))
            policy = make_policy(name, cache_threshold=config.cache_threshold,
                                 balance_abs_threshold=config.balance_abs_threshold,
                                 balance_rel_threshold=config.balance_rel_threshold, max_tree_size=config.max_tree_size,
                                 eviction_interval_s=config.eviction_interval_s, kv_index=self.kv_index,
                                 kv_load_weight=config.kv_load_weight, observe_hit=self.metrics.observe_hit,
                                 session_header=config.session_header.lower(), session_ttl_s=config.session_ttl_s)
            policy.role = role
            policy.decide = self.metrics.decide(role)
            self.policies[role] = policy
        if config.tokenizer is not None:
            self.tokenizer = RouterTokenizer(config.tokenizer, config.chat_template)
        self.registry.on_ready.append(self._worker_ready)
        self.registry.on_removed.append(self._worker_removed)
        self.affinity = ResponseAffinity()
        self._forwarded = 0  # requests forward() relayed (it takes the workers in turn)
        self.relay = PDRelay(self.registry, self.policies, self.metrics, RelayConfig(
            request_timeout_s=config.request_timeout_s, prefill_timeout_s=config.prefill_timeout_s,
            total_timeout_s=config.total_timeout_s, max_prefill_tries=config.max_prefill_tries,
            retry_backoff_s=config.retry_backoff_s, strict_pd=config.strict_pd,
            engine_admin_api_key=config.engine_admin_api_key, pd_mode=config.pd_mode,
            local_prefill_max_tokens=config.local_prefill_max_tokens,
            local_prefill_max_itl_ms=config.local_prefill_max_itl_ms,
            max_event_bytes=config.max_upstream_event_bytes),
            kv_params_secret=load_secret(path=config.kv_params_secret_file), tokenizer=self.tokenizer)
        if self.relay.decider is not None:
            self.metrics.adaptive = self.relay.decider.describe
        self.auth_key = f"Bearer {config.api_key}".encode() if config.api_key else None
        self.admin_key = f"Bearer {config.admin_api_key}".encode() if config.admin_api_key else None
        routes = self.routes = RouteTable()
        routes.add("POST", "/v1/completions", self.completions)
        routes.add("POST", "/v1/chat/completions", self.chat_completions)
        routes.add("POST", "/v1/responses", self.responses)
        for method, path in (("GET", RESPONSE), ("DELETE", RESPONSE), ("POST", RESPONSE + "/cancel"),
                             ("GET", RESPONSE + "/input_items")):
            routes.add(method, path, self.stored_response)
        routes.add("GET", "/v1/models", self.models)
        routes.add("POST", "/v1/embeddings", self.embeddings)
        routes.add("POST", "/v1/load_lora_adapter", self.load_lora_adapter)
        routes.add("POST", "/v1/unload_lora_adapter", self.unload_lora_adapter)
        routes.add("POST", "/tokenize", self.tokenizer_route)
        routes.add("POST", "/detokenize", self.tokenizer_route)
        routes.add("GET", "/tokenizer_info", self.tokenizer_route)
        routes.add("GET", "/health", self.health)
        routes.add("GET", "/ready", self.ready)
        routes.add("GET", "/metrics", self.metrics_route)
        routes.add("GET", "/workers", self.list_workers)
        routes.add("POST", "/workers", self.add_worker)
        routes.add("DELETE", "/workers", self.remove_worker)
        routes.add("GET", "/dashboard", self.dashboard)
        routes.add("GET", "/dashboard/state", self.dashboard_state)
        routes.add("GET", "/openapi.json", self.openapi)
        self.app = App(routes)
        self.server: HTTPServer | None = None
        self.url = ""
        self._engine_stats_at = 0.0

    async def start(self) -> str:
        """Check every worker once and resolve the DNS names (so /ready is right at once),
        serve, start health checks and re-resolution."""
        await self.registry.check_all()
        await self.discovery.refresh()
        c = self.config
        self.server = HTTPServer(self.handle, c.max_request_body_bytes, c.client_idle_timeout_s,
                                 c.client_header_timeout_s, c.client_body_timeout_s, c.max_pending_body_bytes)
        host, port = await self.server.start(self.config.host, self.config.port)
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        self.registry.start()
        self.discovery.start()
        return self.url

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.close()
        await self.relay.close()
        await self.discovery.close()
        await self.registry.close()
        if self.kv_index is not None:
            await self.kv_index.close()

    # ---------------------------------------------------------------- workers entering / leaving

    async def _worker_ready(self, worker: Worker) -> None:
        """A worker entered rotation: learn its DP ranks and KV event endpoints."""
        info = await worker.fetch_kv_info()
        if self.kv_index is not None:
            if self.tokenizer is None and info:
                self._tokenizer_from(info)
            self.kv_index.follow(worker.url, info)

    def _tokenizer_from(self, info: dict) -> None:
        path = (info.get("kv_events") or {}).get("tokenizer")
        if path and os.path.exists(path):
            try:
                self.tokenizer = self.relay.tokenizer = RouterTokenizer(path, self.config.chat_template)
                logger.info("kv_aware: tokenizing with %s (reported by an engine)", path)
            except (ValueError, OSError) as e:
                logger.warning("kv_aware: cannot load the tokenizer at %s: %s", path, e)

    def _worker_removed(self, worker: Worker) -> None:
        if self.kv_index is not None:
            self.kv_index.forget(worker.url)
        for policy in self.policies.values():
            policy.forget(worker.url)
        if self.relay.decider is not None:
            self.relay.decider.forget(worker.url)

    # ---------------------------------------------------------------- dispatch

    async def handle(self, req: Request, resp: Response) -> None:
        route = self.routes.canonical(req.path)
        handler = self.routes.table.get((req.method, route))
        if handler is None:
            methods = self.routes.paths.get(route)
            if methods is None:
                return json_error(resp, 404, f"no route {clip(req.path)}", code="not_found")
            return json_error(resp, 405, f"{req.method} {clip(req.path)} is not allowed (allowed: {', '.join(methods)})")
        path = req.path
        if path in ADMIN_PATHS and self.admin_key is not None:
            if not self._key_ok(req, self.admin_key):
                return json_error(resp, 401, "missing or wrong admin API key (Authorization: Bearer ADMIN_KEY)",
                                  "authentication_error", "invalid_api_key")
        elif self.auth_key is not None and path not in OPEN_PATHS:
            if not self._key_ok(req, self.auth_key):
                return json_error(resp, 401, "missing or wrong API key (Authorization: Bearer KEY)",
                                  "authentication_error", "invalid_api_key")
        await handler(req, resp)

    @staticmethod
    def _key_ok(req: Request, want: bytes) -> bool:
        return hmac.compare_digest(req.headers.get("authorization", "").encode("latin-1"), want)

    # ---------------------------------------------------------------- OpenAI routes

    async def completions(self, req: Request, resp: Response) -> None:
        await self.generate(req, resp, "completions")

    async def chat_completions(self, req: Request, resp: Response) -> None:
        await self.generate(req, resp, "chat_completions")

    async def responses(self, req: Request, resp: Response) -> None:
        await self.generate(req, resp, "responses")

    async def generate(self, req: Request, resp: Response, endpoint: str) -> None:
        raw = req.body
        if raw is None:
            return json_error(resp, 413, f"request body is larger than {self.config.max_request_body_bytes} bytes")
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError as e:
            return json_error(resp, 400, f"request body is not valid JSON: {e}", code="invalid_json")
        except RecursionError:  # msgspec's nesting limit: the client's body, not our bug
            return json_error(resp, 400, "request body is not valid JSON: nested too deeply", code="invalid_json")
        if not isinstance(body, dict):
            return json_error(resp, 400, "request body must be a JSON object", code="invalid_json")
        stream = body.get("stream", False)
        if stream is not False and not isinstance(stream, bool):
            return json_error(resp, 400, f"stream must be a boolean, got {clip(stream)}", code="invalid_value",
                              param="stream")
        prompts = several_prompts(body) if endpoint == "completions" else None
        if prompts is not None and len(prompts) > self.config.max_prompts:
            return json_error(resp, 400, f"prompt: {len(prompts)} prompts; the limit is {self.config.max_prompts} "
                                         "(--max-prompts)", code="limit_exceeded", param="prompt")
        admission = self.admission
        priority = body.get("priority", 0)  # the queue's order (the engines check the value)
        try:
            slots = await admission.enter(priority if type(priority) is int else 0, len(prompts) if prompts else 1)
        except Rejected as e:
            self.metrics.rejected.inc((e.reason,))
            self.metrics.requests.inc((endpoint, "429"))
            return json_error(resp, 429, f"the router is at capacity ({e.reason.replace('_', ' ')}); retry later",
                              "rate_limit_error", e.reason, b"Retry-After: %d\r\n" % self.config.retry_after_s)
        try:
            if prompts is not None:  # each prompt its own relay (its own two legs), answers merged
                await MultiPrompt(self.relay, req, resp, body, prompts).run(endpoint)
            elif endpoint == "responses":  # the router mints the id; a continuation goes where it is stored
                await relay_response(self.relay, self.affinity, req, resp, body)
            else:
                await self.relay.handle(req, resp, endpoint, body, raw)
        finally:
            admission.leave(slots)

    async def stored_response(self, req: Request, resp: Response) -> None:
        """GET / DELETE /v1/responses/{id}, POST .../cancel, GET .../input_items: to the engine
        that stored the response (router/responses.py). An id this router does not know (another
        router relayed it, or this one before a restart) is asked of each decode and colocated
        engine in rotation in turn, the first that knows it answers (and is remembered)."""
        response_id = req.path.split("/")[3]
        worker = self.affinity.worker_of(response_id, self.registry)
        if isinstance(worker, Worker):
            answer = await self.fetch_from(worker, req)
        elif worker == "response_engine_unavailable":
            return json_error(resp, 503, self.affinity.explain(response_id, worker), "service_unavailable", worker)
        else:
            answer = failed = None
            for candidate in self.registry.available("decode") + self.registry.available("worker"):
                got = await self.fetch_from(candidate, req)
                if isinstance(got, LegError):
                    failed = got  # that engine may hold it: unless another has it, a 502
                elif got[0] != 404:
                    answer = got
                    self.affinity.remember(response_id, candidate.url)
                    break
            if answer is None:
                if failed is not None:
                    return failed.send(resp)
                return json_error(resp, 404, self.affinity.explain(response_id, worker), code=worker)
        if isinstance(answer, LegError):
            return answer.send(resp)
        status, ctype, body = answer
        resp.send(status, body, (ctype or "application/json").encode())
        if req.method == "DELETE" and status == 200:
            self.affinity.forget(response_id)

    async def models(self, req: Request, resp: Response) -> None:
        await self.forward(req, resp, ("decode", "worker"), lambda body: lora_admin.models_body(body, self.registry))

    async def load_lora_adapter(self, req: Request, resp: Response) -> None:
        await self.lora_adapter(req, resp, load=True)

    async def unload_lora_adapter(self, req: Request, resp: Response) -> None:
        await self.lora_adapter(req, resp, load=False)

    async def lora_adapter(self, req: Request, resp: Response, load: bool) -> None:
        """Load / unload an adapter on every worker of a role (router/lora_admin.py)."""
        if req.body is None:
            return json_error(resp, 413, f"request body is larger than {self.config.max_request_body_bytes} bytes")
        try:
            spec = lora_admin.parse(req.body, load)
        except ValueError as e:
            return json_error(resp, 400, str(e), code="invalid_value")
        workers = lora_admin.targets(self.registry, spec.role)
        if not workers:
            which = "" if spec.role == "all" else f"{spec.role} "
            return json_error(resp, 400, f"no {which}worker is registered", code="no_worker", param="role")
        key = self.config.engine_admin_api_key or self.config.api_key  # the engines' admin routes
        auth = f"Authorization: Bearer {key}\r\n".encode("latin-1") if key else b""
        results = await lora_admin.apply(workers, spec, load, auth)
        failed = lora_admin.failure(spec, load, results)
        if failed is None:
            return json_response(resp, {"lora_name": spec.lora_name, "results": results})
        status, code, message = failed
        json_response(resp, {"error": {"message": message, "type": "upstream_error" if status == 502 else
                                       "invalid_request_error", "param": None, "code": code},
                             "lora_name": spec.lora_name, "results": results}, status)

    async def embeddings(self, req: Request, resp: Response) -> None:
        """Prefill only, no KV moves: any engine serves it (started with --task embed); counted in
        atomd_router:requests and e2e_request_latency_seconds under endpoint="embeddings"."""
        arrival = time.perf_counter()
        try:
            await self.forward(req, resp, ("worker", "prefill", "decode"))
        finally:
            self.metrics.requests.inc(("embeddings", str(resp.status) if resp.status else "client_disconnect"))
            self.metrics.endpoint("embeddings").request_latency.observe(time.perf_counter() - arrival)

    async def tokenizer_route(self, req: Request, resp: Response) -> None:
        """/tokenize, /detokenize, /tokenizer_info: every engine has the model's tokenizer."""
        await self.forward(req, resp, ("decode", "worker", "prefill"))

    async def forward(self, req: Request, resp: Response, roles: tuple[str, ...],
                      rewrite: Callable[[bytes], bytes] | None = None) -> None:
        """The request as it came to a worker of the first of `roles` with one in rotation,
        and its answer back (a 200's body through `rewrite` when given)."""
        if req.body is None:
            return json_error(resp, 413, f"request body is larger than {self.config.max_request_body_bytes} bytes")
        workers = next((w for w in (self.registry.available(r) for r in roles) if w), None)
        if not workers:
            return json_error(resp, 503, "no healthy decode worker", "service_unavailable", "no_decode_worker")
        self._forwarded += 1
        await self.forward_to(workers[self._forwarded % len(workers)], req, resp, rewrite)  # in turn

    async def forward_to(self, worker: Worker, req: Request, resp: Response,
                         rewrite: Callable[[bytes], bytes] | None = None) -> None:
        answer = await self.fetch_from(worker, req)
        if isinstance(answer, LegError):
            return answer.send(resp)
        status, ctype, body = answer
        if rewrite is not None and status == 200:
            body = rewrite(body)
        resp.send(status, body, (ctype or "application/json").encode())

    async def fetch_from(self, worker: Worker, req: Request) -> tuple[int, str, bytes] | LegError:
        """The request as it came, sent to `worker`: its (status, content type, body), or the 502."""
        auth = req.headers.get("authorization")
        headers = b"Authorization: " + auth.encode("latin-1") + b"\r\n" if auth else b""
        if req.method == "POST":
            headers += b"Content-Type: application/json\r\n"
        try:
            target = req.path + ("?" + req.query_string if req.query_string else "")
            status, ctype, body = await worker.pool.fetch(req.method.encode(), target.encode(), headers,
                                                          req.body if req.method == "POST" else None,
                                                          timeout_s=self.config.request_timeout_s)
        except (UpstreamError, OSError) as e:
            return LegError(502, f"{worker.role} worker {worker.url} did not answer {clip(req.path)}: "
                                 f"{describe(e)}")
        return status, ctype, body

    # ---------------------------------------------------------------- operations

    async def health(self, req: Request, resp: Response) -> None:
        json_response(resp, {"status": "ok"})

    def available_counts(self) -> dict[str, int]:
        counts = {role: len(self.registry.available(role)) for role in PD_ROLES}
        if self.registry.workers("worker"):
            counts["worker"] = len(self.registry.available("worker"))
        return counts

    async def ready(self, req: Request, resp: Response) -> None:
        counts = self.available_counts()
        ready = (counts["prefill"] > 0 and counts["decode"] > 0) or counts.get("worker", 0) > 0
        json_response(resp, {"ready": ready, "available": counts}, 200 if ready else 503)

    async def metrics_route(self, req: Request, resp: Response) -> None:
        """Open, as vLLM's and SGLang's are (scrapers need no key); but the per-worker series
        name the engines' URLs, which /workers keeps behind a key: only that key shows them."""
        key = self.admin_key or self.auth_key
        workers = key is None or self._key_ok(req, key)
        resp.send(200, self.metrics.render(workers), CONTENT_TYPE_LATEST.encode())

    async def list_workers(self, req: Request, resp: Response) -> None:
        json_response(resp, {"workers": [self.describe_worker(w) for w in self.registry.workers()],
                             "dns": self.discovery.describe()})

    def describe_worker(self, w: Worker) -> dict:
        d = w.describe()
        if self.kv_index is not None:
            d["kv_events"] = self.kv_index.describe(w.url)
            if w.url in self.kv_index.errors:
                d["kv_events_error"] = self.kv_index.errors[w.url]
        return d

    @staticmethod
    def worker_request(req: Request, struct: type[AddWorker] | type[RemoveWorker]) -> AddWorker | RemoveWorker:
        """The worker spec from a JSON body, or from the query string (handy for DELETE),
        checked by the struct /openapi.json describes it with (router/openapi.py)."""
        try:
            if req.body:
                return msgspec.json.decode(req.body, type=struct)
            return msgspec.convert(dict(req.query), struct)
        except msgspec.ValidationError as e:
            raise ValueError(f"invalid worker: {e}") from None
        except (msgspec.DecodeError, RecursionError) as e:
            raise ValueError(f"request body is not valid JSON: {e}") from None

    async def add_worker(self, req: Request, resp: Response) -> None:
        try:
            spec = self.worker_request(req, AddWorker)
            worker, created = self.registry.add(spec.url, spec.role)
        except ValueError as e:
            return json_error(resp, 400, str(e), code="invalid_value")
        if created:
            await self.registry.check(worker)  # in rotation at once when it answers
            logger.info("registered %s worker %s (healthy=%s)", worker.role, worker.url, worker.healthy)
        json_response(resp, self.describe_worker(worker), 201 if created else 200)

    async def remove_worker(self, req: Request, resp: Response) -> None:
        try:
            spec = self.worker_request(req, RemoveWorker)
            removed = await self.registry.remove(spec.url, spec.role)
        except ValueError as e:
            return json_error(resp, 400, str(e), code="invalid_value")
        if not removed:
            return json_error(resp, 404, f"no worker {clip(spec.url)} is registered", code="unknown_worker")
        json_response(resp, {"removed": [w.describe() for w in removed]})

    async def openapi(self, req: Request, resp: Response) -> None:
        resp.send(200, openapi_json())

    # ---------------------------------------------------------------- dashboard

    async def dashboard(self, req: Request, resp: Response) -> None:
        resp.send(200, DASHBOARD.read_bytes(), b"text/html; charset=utf-8", b"Cache-Control: no-cache\r\n")

    async def dashboard_state(self, req: Request, resp: Response) -> None:
        await self._refresh_engine_stats()
        m = self.metrics
        latency = {}
        for endpoint, em in m.endpoints.items():
            latency[endpoint] = {name: {"p50": percentile(h.recent, 0.5), "p99": percentile(h.recent, 0.99),
                                        "count": h.count}
                                 for name, h in (("ttft_s", em.ttft), ("itl_s", em.itl), ("e2e_s", em.request_latency))}
        decisions = [{"role": k[0], "policy": k[1], "decision": k[2], "count": v} if len(k) == 3 else
                     {"role": "relay", "policy": "", "decision": k[0] if len(k) == 1 else f"{k[0]} ({k[1]})",
                      "count": v} for k, v in sorted(m.decisions.items())]
        active, queued = self.admission.state()
        json_response(resp, {
            "now": time.time(), "uptime_s": time.time() - self.started_at,
            "policies": {role: p.name for role, p in self.policies.items()},
            "workers": [dict(self.describe_worker(w), engine=w.engine_stats) for w in self.registry.workers()],
            "requests": [{"endpoint": e, "status": s, "count": v} for (e, s), v in sorted(m.requests.items())],
            "latency": latency, "decisions": decisions,
            "fallbacks": {k[0]: v for k, v in m.fallbacks.items()},
            "retries": {k[0]: v for k, v in m.retries.items()},
            "limits": {"active": active, "queued": queued,
                       "max_concurrent": self.config.max_concurrent_requests,
                       "rejected": {k[0]: v for k, v in m.rejected.items()}},
        })

    async def _refresh_engine_stats(self) -> None:
        """KV usage and queue lengths from each engine's /metrics (open, no key), at most
        every ENGINE_STATS_MAX_AGE_S, only while someone looks at the dashboard."""
        now = time.monotonic()
        if now - self._engine_stats_at < ENGINE_STATS_MAX_AGE_S:
            return
        self._engine_stats_at = now

        async def one(w: Worker) -> None:
            try:
                status, _, body = await w.pool.fetch(b"GET", b"/metrics", timeout_s=1.0)
            except (UpstreamError, OSError):
                w.engine_stats = None
                return
            w.engine_stats = engine_stats(body.decode("utf-8", "replace")) if status == 200 else None

        await asyncio.gather(*(one(w) for w in self.registry.workers() if w.healthy))


def engine_stats(text: str) -> dict:
    """The few series of an engine's /metrics the dashboard shows (summed over labels)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(ENGINE_SERIES):
            continue
        name, _, value = line.partition("{")[0], None, line.rsplit(" ", 1)[-1]
        key = name.split()[0].removeprefix("atomd:")
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            pass
    return out


__all__ = ["Router", "RouterConfig", "POLICIES"]
