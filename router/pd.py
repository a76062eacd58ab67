"""The relay of one request: two legs (PD) or one (a colocated worker) (docs/design.md
"PD: two legs through the router").

1. Prefill leg, to a prefill worker P: the client's body with max_tokens=1, stream=false,
   n=1, no stream_options/min_tokens, and kv_transfer_params={"do_remote_decode": true,
   "transfer_id": <fresh uuid4 hex>}. P answers an OpenAI body whose top-level
   kv_transfer_params say where the prompt's KV blocks are (and T0, the access token).
2. Decode leg, to a decode worker D: the client's body (its bytes, not re-encoded) with
   P's kv_transfer_params spliced in first. D pulls the blocks, decodes, and its SSE stream
   (or JSON body) is relayed one complete event at a time, each written as soon as it is
   complete, from the upstream connection's callback (router/http.py). Usage comes from D.

A router with colocated workers (`--worker`) and no prefill/decode pair in rotation sends
the client's body to one worker and relays its answer (one leg).

Failures before any byte reached the client are an OpenAI-style JSON error: a 4xx from a
leg passes through with its status and body (the client's fault); a 5xx, a dropped
connection or a broken body is a 502 with the worker's message; a timeout is a 504. After
the first byte a failure ends the stream with `data: {"error": ...}` and `data: [DONE]`.
A 200 is never sent with an empty or error body.

Retries (docs/design.md "Failures"): the prefill leg is always before the client's first
byte, so any failure of P but a 4xx (connection refused or dropped, 5xx, timeout, broken
answer) is retried on another prefill worker, up to `max_prefill_tries` tries with full-
jitter exponential backoff, each with a fresh transfer_id, and the abandoned transfer is
aborted on its P. The same P gets another go only after a dropped connection (a kept-alive
connection it closed), never after a refusal, a 5xx or a timeout. A worker's fault counts
against its circuit breaker: no connection, a broken or malformed answer (P's params
included, router/kv_check.py), a timeout, a 502-504; any other 5xx may be the request's
doing, and counts only when another worker then serves the same request. The decode leg moves to another D only when the
connection could not be opened (D may have started on the request otherwise); a colocated
worker's leg moves on a refused connection or a 5xx (nothing was streamed). Nothing is
retried once a byte reached the client.

Adaptive disaggregation (`--pd-mode adaptive`, router/adaptive.py): the decode worker is
picked first, then the request either takes the two legs above or goes to that D alone, as
the client sent it (a local prefill), decided per request from the uncached prompt, the
prefill workers' queues and their learnt rates and transfer costs. Decisions are counted
as `atomd_router:decision_total{decision, reason}`; prefill and transfer times of completed
legs feed the estimates.

Fallbacks (`atomd_router:fallbacks_total{reason}`; with --pd-mode strict, alias --strict-pd,
each is an error):
`prefill_kept_no_kv` (P answered without kv_transfer_params: D computes the prompt),
`no_prefill_worker` (none in rotation: D computes the prompt), `colocated` (no PD pair in
rotation: a colocated worker serves it).

Abort: P pins the prompt blocks until D pulls them (or a lease expires). When the request
ends without D having produced output (client gone, D failed), the router sends P
`POST /kv_transfer/abort {"transfer_id"}`; P ignores unknown ids.

Limits: once admitted (a queued wait is bounded by --queue-timeout-s), a request's legs and
its stream end by `--total-timeout-s` (504 before the first byte, an error event after). X-Request-Id (the client's, else a fresh one) goes to
both legs, so the engines' access logs name the same request, and back to the client.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
import re
import time

import msgspec

from kv_transfer.params import KVTransferParams
from kv_transfer.trust import signature_of
from router.adaptive import LocalPrefill, PDDecider, RemotePrefill
from router.errors import worker_text
from router.http import ClientConnection, ConnectError, Disconnected, Request, Response, Timeout, \
    UpstreamError
from router.kv_check import check_producer_params
from router.metrics import RouterMetrics
from router.policies import RouteRequest, RoutingPolicy
from router.sse_relay import DONE_EVENT, ERROR_EVENT_PREFIX, SSERelay
from router.workers import Worker, WorkerRegistry, describe

logger = logging.getLogger("atomd.router.pd")

MAX_DECODE_TRIES = 3
# a worker answering these says it cannot serve (loading, core dead, overloaded): its fault
WORKER_FAULT_STATUSES = (502, 503, 504)
ABORT_TIMEOUT_S = 5.0
BACKOFF_CAP_S = 1.0
REQUEST_ID = re.compile(r"[\x21-\x7e]{1,200}")
_encode = msgspec.json.encode
_decode = msgspec.json.decode


def error_body(message: str, type: str = "upstream_error", code: str | None = None,
               param: str | None = None) -> bytes:
    return _encode({"error": {"message": message, "type": type, "param": param, "code": code}})


class LegError(Exception):
    """A request that ends before any byte reached the client, with this answer. `suspect`:
    the worker whose 5xx may be the request's doing (PDRequest.failed_answer)."""

    suspect: "Worker | None" = None

    def __init__(self, status: int, message: str, *, type: str = "upstream_error", code: str | None = None,
                 body: bytes | None = None, content_type: str = "application/json", headers: bytes = b""):
        super().__init__(message)
        self.status = status
        self.body = body if body is not None else error_body(message, type, code)
        self.content_type = content_type
        self.headers = headers

    def send(self, resp: Response, headers: bytes = b"") -> None:
        resp.send(self.status, self.body, self.content_type.encode(), headers + self.headers)


def upstream_message(data: bytes) -> str:
    """The `error.message` of an OpenAI-style error body, else the body's text, as a client
    may see it (router/errors.py: one line, no traceback or path, short)."""
    try:
        err = _decode(data)["error"]
        text = str(err["message"] if isinstance(err, dict) else err)
    except (msgspec.DecodeError, KeyError, TypeError, RecursionError):
        text = data[:4096].decode("utf-8", "replace") or "(empty body)"
    return worker_text(text)


def error_event_is_fault(data: bytes) -> bool:
    """An error event a worker streams first is its fault when it says it cannot serve
    (as a 502-504 would: `service_unavailable`, `timeout`) or is not an OpenAI error."""
    try:
        err = _decode(data.strip())["error"]
        return err.get("type") in ("service_unavailable", "timeout", "upstream_error")
    except (msgspec.DecodeError, KeyError, TypeError, AttributeError, RecursionError):
        return True


def prefill_body(body: dict, transfer_id: str, endpoint: str = "completions") -> dict:
    kv = KVTransferParams(do_remote_decode=True, transfer_id=transfer_id).to_json_obj()
    if endpoint == "responses":  # its own names; P's one-token answer is not stored (nor run in the background)
        return dict(body, max_output_tokens=1, stream=False, store=False, background=False, kv_transfer_params=kv)
    leg = dict(body, max_tokens=1, stream=False, n=1, kv_transfer_params=kv)
    leg.pop("stream_options", None)
    leg.pop("min_tokens", None)  # would contradict max_tokens=1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    return leg


def with_kv_params(raw: bytes, kv_json: bytes) -> bytes:
    """The client's JSON object with `"kv_transfer_params": kv` as its first member, without
    decoding and re-encoding the rest (the caller made sure the object is not empty and has
    no kv_transfer_params of its own)."""
    start = raw.index(b"{") + 1
    return b'{"kv_transfer_params":' + kv_json + b"," + raw[start:]


def new_id() -> str:
    """128 random bits as 32 hex digits: a transfer_id (as kv_transfer.params.new_transfer_id,
    without uuid4's cost) or a request id."""
    return os.urandom(16).hex()


def request_id_of(req: Request) -> str:
    rid = req.headers.get("x-request-id")
    if rid and REQUEST_ID.fullmatch(rid):
        return rid
    return new_id()


class RelayConfig(msgspec.Struct, kw_only=True):
    request_timeout_s: float = 600.0  # P's whole leg (unless prefill_timeout_s); the longest silence of D
    prefill_timeout_s: float | None = None
    total_timeout_s: float | None = None
    max_prefill_tries: int = 3
    retry_backoff_s: float = 0.01
    strict_pd: bool = False  # --pd-mode strict
    # the engines' --admin-api-key: what an abort carries instead of the client's Authorization
    engine_admin_api_key: str | None = None
    pd_mode: str = "always"  # always | adaptive | strict (router/adaptive.py)
    local_prefill_max_tokens: int = 256  # adaptive: prompts up to this many uncached tokens prefill on D
    local_prefill_max_itl_ms: float = 0.0  # adaptive: a backed-up P's long prompt stays remote while D's streams are this slow (0: no bound)
    # the longest SSE event (its unended lines) buffered from D: a longer one ends the stream
    # with an error event (the router's memory per stream stays bounded)
    max_event_bytes: int = 16 << 20


class PDRelay:
    """Shared state of all relays: workers, policies, metrics, in-flight abort tasks."""

    def __init__(self, registry: WorkerRegistry, policies: dict[str, RoutingPolicy], metrics: RouterMetrics,
                 config: RelayConfig, kv_params_secret: bytes | None = None, tokenizer=None):
        self.registry = registry
        self.kv_params_secret = kv_params_secret
        self.policies = policies
        self.metrics = metrics
        self.config = config
        self.tokenizer = tokenizer
        self.prefill_timeout = config.prefill_timeout_s or config.request_timeout_s
        self.decider = PDDecider(config.local_prefill_max_tokens, local_prefill_max_itl_s=(
            config.local_prefill_max_itl_ms / 1e3 or None)) if config.pd_mode == "adaptive" else None
        self._background: set[asyncio.Task] = set()
        self._rng = random.Random()

    async def handle(self, req: Request, resp: Response, endpoint: str, body: dict, raw: bytes) -> None:
        if "kv_transfer_params" in body:
            # Clients never steer KV transfers: only the router writes these, on every path.
            # `null` too: D would take it as "no params" and recompute while P's blocks stay pinned.
            del body["kv_transfer_params"]
            self.metrics.client_kv_params_dropped += 1
            raw = _encode(body)
        await PDRequest(self, req, resp, endpoint, body, raw).run()

    def pick(self, role: str, route: RouteRequest, exclude: list[Worker], last_error: str | None,
             also: list[Worker] | None = None) -> Worker:
        """A worker of `role` not in `exclude`; failing that, when given, one not in `also`."""
        candidates = self.registry.available(role, exclude)
        if not candidates and also is not None:
            candidates = self.registry.available(role, also)
        if not candidates:
            name = "colocated" if role == "worker" else role
            self.metrics.decisions.inc((f"no_{name}_worker",))
            if last_error is not None:
                raise LegError(502, last_error)
            raise LegError(503, f"no healthy {name} worker", type="service_unavailable", code=f"no_{name}_worker")
        return self.policies[role].choose(with_adapter(candidates, route), route)

    def backoff(self, attempt: int) -> float:
        """Full jitter: uniform in [0, base * 2^attempt], capped."""
        base = self.config.retry_backoff_s
        return self._rng.uniform(0, min(BACKOFF_CAP_S, base * (2 ** attempt))) if base > 0 else 0.0

    def abort_transfer(self, worker: Worker, transfer_id: str, headers: bytes) -> None:
        """Fire and forget: the abort must outlive a cancelled request handler. `headers`:
        the legs' headers (their Authorization: an engine with an API key wants it here too)."""
        self.metrics.aborts += 1
        if self.config.engine_admin_api_key is not None:  # an admin route of the engine
            headers = (b"Content-Type: application/json\r\nAuthorization: Bearer " +
                       self.config.engine_admin_api_key.encode("latin-1") + b"\r\n")
        worker.acquire(dispatch=False)  # keeps the pool open until the abort is sent
        task = asyncio.get_running_loop().create_task(self._abort(worker, transfer_id, headers))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, worker: Worker, transfer_id: str, headers: bytes) -> None:
        try:
            status, _, _ = await worker.pool.fetch(b"POST", b"/kv_transfer/abort", headers,
                                                   _encode({"transfer_id": transfer_id}), ABORT_TIMEOUT_S)
            if status != 200:
                logger.warning("abort of transfer %s on %s answered %d", transfer_id, worker.url, status)
        except (UpstreamError, OSError) as e:
            logger.warning("abort of transfer %s on %s failed: %s", transfer_id, worker.url, describe(e))
        finally:
            worker.done()

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(set(self._background), timeout=ABORT_TIMEOUT_S)


class PDRequest:
    """One client request: the prefill leg, then the decode leg relayed to the client (or
    one leg on a colocated worker). The legs' retries and their outcome are its own; the
    SSE bytes are router/sse_relay.py's, a failed exchange's mapping `connection_failure`'s,
    and what the adaptive decider learns from the request its handle's (`learning`)."""

    __slots__ = ("relay", "metrics", "series", "req", "resp", "endpoint", "path", "body", "raw", "route",
                 "request_id", "headers", "echo", "arrival", "last_send", "first_event_sent", "prefill_worker",
                 "transfer_id", "pulled", "deadline_hit", "_deadline", "reason", "learning", "pinned")

    def __init__(self, relay: PDRelay, req: Request, resp: Response, endpoint: str, body: dict, raw: bytes):
        self.relay = relay
        self.metrics = relay.metrics
        self.series = relay.metrics.endpoint(endpoint)
        self.req, self.resp = req, resp
        self.endpoint = endpoint
        self.path = req.path.encode()
        self.body, self.raw = body, raw
        self.route = RouteRequest(body, req.headers, relay.tokenizer)
        self.request_id = request_id_of(req)
        auth = req.headers.get("authorization")
        self.headers = (b"Content-Type: application/json\r\n" +
                        (b"Authorization: " + auth.encode("latin-1") + b"\r\n" if auth else b"") +
                        b"X-Request-Id: " + self.request_id.encode() + b"\r\n")
        self.echo = b"X-Request-Id: " + self.request_id.encode() + b"\r\n"
        self.arrival = self.last_send = time.perf_counter()
        self.first_event_sent = False
        self.prefill_worker: Worker | None = None
        self.transfer_id: str | None = None
        self.pulled = False  # D produced output, so it is done with P's blocks
        self.deadline_hit = False
        self._deadline: asyncio.TimerHandle | None = None
        self.reason: str | None = None  # why two legs (adaptive / strict); None: --pd-mode always
        # adaptive: what D's first event teaches the decider (router/adaptive.py); None otherwise
        self.learning: LocalPrefill | RemotePrefill | None = None
        # a worker that must serve the request alone (one leg; router/responses.py: the engine that
        # stored a previous response)
        self.pinned: Worker | None = None

    def answered(self, worker: Worker) -> None:
        """`worker` answers 200 and its answer is about to be relayed: the client may send its
        next request (continuing this one) as soon as the last byte arrives, so whatever the
        router must know of who answered is recorded now (router/responses.py), not after."""

    def leg_headers(self, role: str) -> bytes:
        rank = self.route.dp_rank.get(role)
        return self.headers if rank is None else self.headers + b"X-data-parallel-rank: %d\r\n" % rank

    async def run(self) -> None:
        status = "500"  # a bug: the server answers 500
        total = self.relay.config.total_timeout_s
        if total:
            task = asyncio.current_task()
            self._deadline = asyncio.get_running_loop().call_later(total, self._on_deadline, task)
        try:
            await self.serve()
            status = str(self.resp.status)
        except LegError as e:
            status = str(e.status)
            e.send(self.resp, self.echo)
        except asyncio.CancelledError:
            if not self.deadline_hit:
                status = "client_disconnect"
                raise
            asyncio.current_task().uncancel()
            status = self.timed_out()
        finally:
            if self._deadline is not None:
                self._deadline.cancel()
            if self.transfer_id is not None and not self.pulled:
                self.relay.abort_transfer(self.prefill_worker, self.transfer_id, self.headers)
            self.metrics.requests.inc((self.endpoint, status))
            self.series.request_latency.observe(time.perf_counter() - self.arrival)

    def _on_deadline(self, task: asyncio.Task) -> None:
        self.deadline_hit = True
        task.cancel()

    def timed_out(self) -> str:
        message = f"the request took longer than --total-timeout-s {self.relay.config.total_timeout_s} s"
        self.metrics.upstream_errors.inc(("request", "total_timeout"))
        if not self.resp.started:
            LegError(504, message, type="timeout").send(self.resp, self.echo)
            return "504"
        self.resp.end(b"data: " + error_body(message, "timeout") + b"\n\n" + DONE_EVENT + b"\n\n")
        return str(self.resp.status)

    async def serve(self) -> None:
        """Two legs while a decode worker is in rotation (or no colocated worker exists);
        else one leg on a colocated worker."""
        registry, strict = self.relay.registry, self.relay.config.strict_pd
        if self.pinned is not None:
            await self.one_leg(self.pinned.role, self.raw, self.pinned)
            return
        pd_registered = bool(registry.workers("prefill") or registry.workers("decode"))
        colocated = bool(registry.workers("worker"))
        if not colocated or (registry.any_available("decode") and pd_registered) or \
                (pd_registered and not registry.any_available("worker")):
            first = None
            decider = self.relay.decider
            if decider is not None and registry.any_available("decode"):
                # adaptive: D first (kv_aware learns its cached prefix), then one leg or two
                first = self.relay.pick("decode", self.route, [], None)
                uncached = self.route.leg_tokens("decode")
                decision, self.reason = decider.decide(uncached, registry.available("prefill"), first.url,
                                                       first.in_flight)
                if decision == "local_prefill":
                    self.metrics.decisions.inc(("local_prefill", self.reason))
                    self.learning = local = LocalPrefill(decider, first.url, uncached)
                    try:
                        await self.decode(None, first)
                    finally:
                        local.end()
                    return
            elif strict:
                self.reason = "strict"
            kv = await self.prefill()
            await self.decode(kv, first)
            return
        if pd_registered:  # a PD pool that is down: colocated workers take over
            if strict:
                raise LegError(503, "no decode worker in rotation (--strict-pd: no colocated fallback)",
                               type="service_unavailable", code="no_decode_worker")
            self.metrics.fallbacks.inc(("colocated",))
        await self.colocated()

    # ------------------------------------------------------------------ prefill leg

    async def prefill(self) -> dict | None:
        relay = self.relay
        tried: list[Worker] = []  # every P that failed this request
        closed: list[Worker] = []  # ... except for a dropped connection: those may get another go
        suspects: list[tuple[Worker, str]] = []  # 5xx that may be the request's: blamed if another P serves it
        last_error: str | None = None
        last_status = 502
        for attempt in range(relay.config.max_prefill_tries):
            if attempt:
                delay = relay.backoff(attempt - 1)
                if delay:
                    await asyncio.sleep(delay)
            try:
                worker = relay.pick("prefill", self.route, tried, last_error, closed)
                if attempt:
                    self.metrics.retries.inc(("prefill",))
            except LegError:
                if last_error is not None:
                    break
                if relay.config.strict_pd or not self.relay.registry.any_available("decode"):
                    raise
                # no prefill worker in rotation: D computes the prompt
                self.metrics.fallbacks.inc(("no_prefill_worker",))
                return None
            self.prefill_worker, self.transfer_id = worker, new_id()
            try:
                kv = await self.prefill_on(worker)
                blame(suspects)
                return kv
            except LegError as e:
                if e.status < 500:
                    raise  # the worker judged the request: pass it through
                if e.suspect is not None:
                    suspects.append((e.suspect, str(e)))
                last_error, last_status = str(e), e.status
                closed.append(worker)
                tried.append(worker)
            except Disconnected as e:  # the same P may get another go (a kept-alive connection it closed)
                last_error, last_status = f"prefill worker {worker.url} dropped the connection: {describe(e)}", 502
                tried.append(worker)
            # the abandoned try: P may have run it and pinned blocks
            if self.transfer_id is not None:
                relay.abort_transfer(worker, self.transfer_id, self.headers)
                self.transfer_id = None
        raise LegError(last_status, last_error or "prefill failed", type="timeout" if last_status == 504 else
                       "upstream_error")

    async def prefill_on(self, worker: Worker) -> dict | None:
        """P's kv_transfer_params. Raises Disconnected (the connection dropped before any
        answer), LegError (anything else)."""
        data = _encode(prefill_body(self.body, self.transfer_id, self.endpoint))
        started = time.perf_counter()
        tokens = self.route.leg_tokens("prefill")
        ahead = worker.in_flight_tokens  # what P has to prefill before this leg
        trial = worker.acquire(tokens=tokens)
        try:
            conn = await worker.pool.request(b"POST", self.path, self.leg_headers("prefill"), data,
                                             self.relay.prefill_timeout)
            try:
                answer = await conn.read()
            except BaseException:
                conn.abort()
                raise
            conn.release()
        except UpstreamError as e:
            err = connection_failure(self.metrics, "prefill", worker, e, self.relay.prefill_timeout)
            if isinstance(e, Disconnected):
                raise  # prefill() may give the same P another go
            raise err from None
        finally:
            worker.done(trial, tokens)
        elapsed = time.perf_counter() - started
        self.metrics.legs["prefill"].observe(elapsed)
        if conn.status == 200 and self.relay.decider is not None:
            self.relay.decider.observe_prefill(worker.url, ahead + tokens, elapsed)
        if conn.status != 200:
            self.metrics.upstream_errors.inc(("prefill", f"status_{conn.status}"))
            raise self.failed_answer("prefill", worker, conn.status, answer, conn.content_type)
        return self.prefill_params(worker, answer)

    def failed_answer(self, leg: str, worker: Worker, status: int, data: bytes, content_type: str) -> LegError:
        """4xx: the worker judged the request; pass it through. 5xx: a 502. Only 502-504 (the
        worker says it cannot serve) count against its breaker at once; any other 5xx may be
        the request's doing (a body that breaks the engine), so the worker is only a suspect,
        blamed when another worker then serves the same request (`blame`)."""
        if 400 <= status < 500:
            worker.breaker.record_success()  # it answered properly; the client was wrong
            return LegError(status, "", body=data, content_type=content_type or "application/json")
        message = f"{leg} worker {worker.url} answered {status}: {upstream_message(data)}"
        err = LegError(502, message)
        if status in WORKER_FAULT_STATUSES:
            worker.failed(message)
        else:
            err.suspect = worker
        return err

    def prefill_params(self, worker: Worker, answer: bytes) -> dict | None:
        try:
            kv = _decode(answer).get("kv_transfer_params")
        except (msgspec.DecodeError, AttributeError):
            worker.failed("a 200 that is not a JSON object")
            raise LegError(502, f"prefill worker {worker.url} answered 200 with a body that is not a JSON object")
        if kv is None:
            # P kept nothing for us: D computes the prompt itself. Counted, since it costs a prefill.
            self.transfer_id = None
            if self.relay.config.strict_pd:
                raise LegError(502, f"prefill worker {worker.url} kept no KV for the request (--strict-pd)")
            worker.breaker.record_success()
            self.metrics.decisions.inc(("decode_without_kv",))
            self.metrics.fallbacks.inc(("prefill_kept_no_kv",))
            return None
        try:
            # checked here (and what D indexes by, router/kv_check.py), so a bad P is a 502 or a
            # retry, never forwarded to D
            params = KVTransferParams.from_json_obj(kv)
            check_producer_params(kv, params, worker.vocab_size)
        except ValueError as e:
            worker.failed(str(e))
            raise LegError(502, f"prefill worker {worker.url} returned {e}")
        worker.breaker.record_success()
        # Relayed as P sent it: fields this router does not know still reach D.
        kv.setdefault("transfer_id", self.transfer_id)
        secret = self.relay.kv_params_secret
        if secret is not None:  # vouch for P's params to D (kv_transfer/trust.py)
            params = msgspec.structs.replace(params, transfer_id=kv["transfer_id"])
            kv["signature"] = signature_of(params, secret)
        self.metrics.decisions.inc(("pd",) if self.reason is None else ("pd", self.reason))
        if self.relay.decider is not None:
            self.learning = RemotePrefill(self.relay.decider, worker.url, time.perf_counter())
        return kv

    # ------------------------------------------------------------------ decode leg

    async def decode(self, kv: dict | None, first: Worker | None = None) -> None:
        if kv is None:
            data = self.raw
        elif self.body:
            data = with_kv_params(self.raw, _encode(kv))
        else:
            data = _encode({"kv_transfer_params": kv})
        await self.one_leg("decode", data, first)

    async def colocated(self) -> None:
        self.metrics.decisions.inc(("colocated",))
        await self.one_leg("worker", self.raw)

    async def one_leg(self, role: str, data: bytes, first: Worker | None = None) -> None:
        """Send `data` to a worker of `role` (first to `first`, already picked, while it is in
        rotation) and relay its answer. Moves to another worker only when the connection
        could not be opened (or, colocated, on a 5xx)."""
        relay = self.relay
        tried: list[Worker] = []
        suspects: list[tuple[Worker, str]] = []
        last_error = None
        for attempt in range(MAX_DECODE_TRIES):
            if attempt == 0 and first is not None and first.available():
                worker = first
            else:
                worker = relay.pick(role, self.route, tried, last_error)
            if attempt:
                self.metrics.retries.inc((role,))
            tokens = self.route.leg_tokens(role)
            trial = worker.acquire(tokens=tokens)
            started = time.perf_counter()
            if self.learning is not None:
                self.learning.leg_started(started)
            try:
                try:
                    conn = await worker.pool.request(b"POST", self.path, self.leg_headers(role), data,
                                                     relay.config.request_timeout_s, idle_timeout=True)
                except UpstreamError as e:
                    err = connection_failure(self.metrics, role, worker, e, relay.config.request_timeout_s)
                    if isinstance(e, ConnectError):  # never reached the worker: another may take it
                        last_error = str(err)
                        tried.append(worker)
                        continue
                    if isinstance(e, Disconnected) and role == "worker" and e.reused:
                        last_error = str(err)  # a kept-alive connection it closed: it may get another go
                        continue
                    raise err from None
                try:
                    if conn.status != 200 and role == "worker" and conn.status >= 500:
                        answer = await conn.read()
                        conn.release()
                        self.metrics.upstream_errors.inc((role, f"status_{conn.status}"))
                        err = self.failed_answer(role, worker, conn.status, answer, conn.content_type)
                        if err.suspect is not None:
                            suspects.append((err.suspect, str(err)))
                        last_error = str(err)
                        tried.append(worker)
                        continue
                    if conn.status == 200:
                        self.answered(worker)
                    await self.relay_answer(role, worker, conn)
                except BaseException:
                    conn.abort()
                    raise
                blame(suspects)
                self.metrics.legs[role].observe(time.perf_counter() - started)
                return
            finally:
                worker.done(trial, tokens)
        raise LegError(502, last_error or f"{role} failed")

    async def relay_answer(self, role: str, worker: Worker, conn: ClientConnection) -> None:
        if conn.status != 200:
            try:
                answer = await conn.read()
            except UpstreamError:
                answer = b""
            conn.release()
            self.metrics.upstream_errors.inc((role, f"status_{conn.status}"))
            raise self.failed_answer(role, worker, conn.status, answer, conn.content_type)
        if conn.content_type == "text/event-stream":
            await self.relay_stream(role, worker, conn)
        else:
            await self.relay_body(role, worker, conn)

    async def relay_body(self, role: str, worker: Worker, conn: ClientConnection) -> None:
        try:
            answer = await conn.read()
            parsed = _decode(answer)
        except (UpstreamError, msgspec.DecodeError) as e:
            worker.failed(str(e))
            self.metrics.upstream_errors.inc((role, "broken_body"))
            if isinstance(e, Timeout):
                raise LegError(504, f"{role} worker {worker.url} timed out mid-answer", type="timeout")
            raise LegError(502, f"{role} worker {worker.url} sent a broken body: {describe(e)}")
        conn.release()
        if not isinstance(parsed, dict) or parsed.get("error") is not None:  # a Response has "error": null
            worker.failed("a 200 with an error body")
            self.metrics.upstream_errors.inc((role, "error_body"))
            raise LegError(502, f"{role} worker {worker.url} answered 200 with: {upstream_message(answer)}")
        worker.breaker.record_success()
        self.pulled = True
        self.resp.send(200, answer, conn.content_type.encode() or b"application/json", self.echo)

    async def relay_stream(self, role: str, worker: Worker, conn: ClientConnection) -> None:
        """Relay D's SSE events (router/sse_relay.py), then judge how the stream ended."""
        relay = SSERelay(self.resp, conn, self.echo, self.relay.config.max_event_bytes)
        relay.on_started = self.stream_started
        relay.on_events = functools.partial(self.events_relayed, role, worker)
        relay.on_error_event = functools.partial(self.metrics.upstream_errors.inc, (role, "error_event_mid_stream"))
        error = await relay.run()
        if relay.error_first is not None:
            message = f"{role} worker {worker.url} failed: {upstream_message(relay.error_first[6:])}"
            if error_event_is_fault(relay.error_first[6:]):
                worker.failed(message)
            self.metrics.upstream_errors.inc((role, "error_event"))
            raise LegError(502, message)
        if relay.saw_done:
            worker.breaker.record_success()
            conn.release() if conn.done else conn.abort()
            return
        conn.abort()
        if isinstance(error, Timeout):
            message = f"{role} worker {worker.url} went silent for {self.relay.config.request_timeout_s} s"
        elif error is not None:
            message = f"{role} worker {worker.url} broke off the stream: {describe(error)}"
        else:
            message = f"{role} worker {worker.url} ended the stream before [DONE]"
        worker.failed(message)
        self.metrics.upstream_errors.inc((role, "broken_stream"))
        if not self.resp.started:
            raise LegError(504 if isinstance(error, Timeout) else 502, message,
                           type="timeout" if isinstance(error, Timeout) else "upstream_error")
        tail = b"" if relay.last.startswith(ERROR_EVENT_PREFIX) else b"data: " + error_body(message) + b"\n\n"
        self.resp.end(tail + DONE_EVENT + b"\n\n")

    def stream_started(self) -> None:
        self.pulled = True  # D produced output: it is done with P's blocks

    def events_relayed(self, role: str, worker: Worker, n: int, now: float) -> None:
        """`n` events went to the client at `now`: TTFT, ITL (one gap per event), and what the
        adaptive decider learns from them."""
        series = self.series
        if self.first_event_sent:
            series.itl.observe(now - self.last_send)
            # D's pace (a gap per event: per token unless D packs drafts into one); not after
            # D left the registry (forget() dropped its entry)
            if role == "decode" and self.relay.decider is not None and not worker.retired:
                self.relay.decider.observe_itl(worker.url, (now - self.last_send) / n)
        else:
            series.ttft.observe(now - self.arrival)
            self.first_event_sent = True
            if self.learning is not None:
                self.learning.first_event(now)
        for _ in range(n - 1):
            series.itl.observe(0.0)
        self.last_send = now


def connection_failure(metrics: RouterMetrics, role: str, worker: Worker, e: UpstreamError,
                       timeout_s: float) -> LegError:
    """A leg's failed exchange (no connection, a dropped one, a timeout, a broken answer): the
    worker's fault, counted against its breaker and in `upstream_errors`, and the error the
    client gets if the request goes no further."""
    if isinstance(e, ConnectError):
        kind, err = "connect", LegError(502, f"{role} worker {worker.url} unreachable: {describe(e)}")
    elif isinstance(e, Disconnected):
        kind, err = "connection", LegError(502, f"{role} worker {worker.url} dropped the connection: {describe(e)}")
    elif isinstance(e, Timeout):
        kind, err = "timeout", LegError(504, f"{role} worker {worker.url} timed out after {timeout_s} s", type="timeout")
    else:
        kind, err = "broken_answer", LegError(502, f"{role} worker {worker.url} broke off its answer: {describe(e)}")
    worker.failed("timeout" if isinstance(e, Timeout) else str(e))
    metrics.upstream_errors.inc((role, kind))
    return err


def blame(suspects: list[tuple[Worker, str]]) -> None:
    """Another worker served the request these answered with a 5xx: theirs was a fault."""
    for worker, message in suspects:
        worker.failed(message)


def with_adapter(candidates: list[Worker], route: RouteRequest) -> list[Worker]:
    """Adapter-aware placement: a request whose `model` is a LoRA adapter some candidate serves
    goes to one of those, and to those holding it in memory when any does (no load to wait
    for); the policy picks among them (`route.lora` names the adapter for cache_aware's tree and
    kv_aware's hashes). Otherwise every candidate (an unknown name gets the engine's 404)."""
    model = route.body.get("model")
    if not isinstance(model, str):
        return candidates
    serving = [w for w in candidates if w.loras is not None and model in w.loras]
    if not serving:
        return candidates
    route.lora = model
    return [w for w in serving if model in w.loras_resident] or serving
