"""The two-leg relay of one request (docs/design.md "PD: two legs through the router").

1. Prefill leg, to a prefill worker P: the client's body with max_tokens=1, stream=false,
   n=1, no stream_options/min_tokens, and kv_transfer_params={"do_remote_decode": true,
   "transfer_id": <fresh uuid4 hex>}. P answers an OpenAI body whose top-level
   kv_transfer_params say where the prompt's KV blocks are (and T0, the access token).
2. Decode leg, to a decode worker D: the client's body plus P's kv_transfer_params. D pulls
   the blocks, decodes, and its SSE stream (or JSON body) is relayed byte for byte, one
   complete event at a time, each written as soon as it is complete. Usage comes from D
   (which reports P's prefix hit as cached_tokens).

Failures, answered before any byte reached the client as an OpenAI-style JSON error:
a 4xx from either leg passes through with its status and body (the client's fault); a 5xx,
a dropped connection or a broken body is a 502 with the worker's message; a timeout is a 504.
After the first byte, a failure ends the stream with `data: {"error": ...}` and `data: [DONE]`.
A 200 is never sent with an empty or error body.

Retries: the prefill leg is retried only when the request never got a response
(connection refused or dropped), on another P when there is one (the same P may get
another go after a dropped keep-alive connection, never after a refused one). Each try
carries a fresh transfer_id and the old one is aborted, so a P that did run it frees its
blocks. The decode leg moves only when the connection to D could not even be opened;
once D answered, it is never retried.

Abort: P pins the prompt blocks until D pulls them (or a lease expires). When the request
ends without D having produced output (client gone, D failed), D never pulled, so the
router sends P `POST /kv_transfer/abort {"transfer_id"}`; P ignores unknown ids, so an
abort that races a finished pull is harmless.
"""
from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import msgspec
from aiohttp import web

from kv_transfer.params import KVTransferParams, new_transfer_id
from kv_transfer.trust import signature_of
from router.metrics import RouterMetrics
from router.policies import RoutingPolicy
from router.workers import Worker, WorkerRegistry, describe

logger = logging.getLogger("atomd.router.pd")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE_EVENT = b"data: [DONE]"
ERROR_EVENT_PREFIX = b'data: {"error"'
MAX_PREFILL_TRIES = 3
MAX_DECODE_TRIES = 3
ABORT_TIMEOUT_S = 5.0
DRAIN_TIMEOUT_S = 1.0
# Errors raised before a response started: the request may not have reached the worker.
RETRYABLE_PREFILL = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


def error_body(message: str, type: str = "upstream_error", code: str | None = None) -> bytes:
    return msgspec.json.encode({"error": {"message": message, "type": type, "param": None, "code": code}})


class LegError(Exception):
    """A request that ends before any byte reached the client, with this answer."""

    def __init__(self, status: int, message: str, *, type: str = "upstream_error", code: str | None = None,
                 body: bytes | None = None, content_type: str = "application/json"):
        super().__init__(message)
        self.status = status
        self.body = body if body is not None else error_body(message, type, code)
        self.content_type = content_type

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=self.body, content_type=self.content_type)


def upstream_message(data: bytes) -> str:
    """The `error.message` of an OpenAI-style error body, else the body's text."""
    try:
        err = msgspec.json.decode(data)["error"]
        return str(err["message"] if isinstance(err, dict) else err)
    except (msgspec.DecodeError, KeyError, TypeError):
        return data.decode("utf-8", "replace")[:500] or "(empty body)"


def failed_answer(leg: str, worker: Worker, status: int, data: bytes, content_type: str) -> LegError:
    """4xx: the worker judged the request; pass it through. 5xx: the worker broke; 502."""
    if 400 <= status < 500:
        worker.breaker.record_success()  # it answered properly; the client was wrong
        return LegError(status, "", body=data, content_type=content_type or "application/json")
    worker.breaker.record_failure()
    return LegError(502, f"{leg} worker {worker.url} answered {status}: {upstream_message(data)}")


def prefill_body(body: dict, transfer_id: str) -> dict:
    kv = KVTransferParams(do_remote_decode=True, transfer_id=transfer_id).to_json_obj()
    leg = dict(body, max_tokens=1, stream=False, n=1, kv_transfer_params=kv)
    leg.pop("stream_options", None)
    leg.pop("min_tokens", None)  # would contradict max_tokens=1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    return leg


def complete_events_end(buf: bytes) -> int:
    """Length of the prefix of `buf` that is whole SSE events (0 when none)."""
    return max(buf.rfind(b"\n\n") + 2, buf.rfind(b"\r\n\r\n") + 4, 0)


class PDRelay:
    """Shared state of all relays: workers, policies, metrics, in-flight abort tasks."""

    def __init__(self, registry: WorkerRegistry, prefill_policy: RoutingPolicy,
                 decode_policy: RoutingPolicy, metrics: RouterMetrics, request_timeout_s: float,
                 kv_params_secret: bytes | None = None):
        self.registry = registry
        self.kv_params_secret = kv_params_secret
        self.policies = {"prefill": prefill_policy, "decode": decode_policy}
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s
        self.prefill_timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self.decode_timeout = aiohttp.ClientTimeout(total=None, sock_read=request_timeout_s)
        self._background: set[asyncio.Task] = set()

    async def handle(self, request: web.Request, endpoint: str, body: dict) -> web.StreamResponse:
        if body.pop("kv_transfer_params", None) is not None:
            # Clients never steer KV transfers: only the router writes these, on every path.
            self.metrics.client_kv_params_dropped.inc()
        return await PDRequest(self, request, endpoint, body).run()

    def pick(self, role: str, body: dict, tried: list[Worker], last_error: str | None,
             refused: list[Worker] | None = None) -> Worker:
        """A worker not tried yet for this request; failing that, when given, one that did
        not refuse the connection (a dropped keep-alive connection is worth another go)."""
        candidates = self.registry.available(role, exclude=tried)
        if not candidates and refused is not None:
            candidates = self.registry.available(role, exclude=refused)
        if not candidates:
            self.metrics.decisions.labels(f"no_{role}_worker").inc()
            if last_error is not None:
                raise LegError(502, last_error)
            raise LegError(503, f"no healthy {role} worker", type="service_unavailable",
                           code=f"no_{role}_worker")
        return self.policies[role].choose(candidates, body)

    def abort_transfer(self, worker: Worker, transfer_id: str, headers: dict | None = None) -> None:
        """Fire and forget: the abort must outlive a cancelled request handler. `headers`:
        the legs' headers (their Authorization: an engine with an API key wants it here too)."""
        self.metrics.aborts.inc()
        worker.acquire(dispatch=False)  # keeps the pool open until the abort is sent
        task = asyncio.get_running_loop().create_task(self._abort(worker, transfer_id, headers))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, worker: Worker, transfer_id: str, headers: dict | None = None) -> None:
        try:
            async with worker.session.post("/kv_transfer/abort", json={"transfer_id": transfer_id}, headers=headers,
                                           timeout=aiohttp.ClientTimeout(total=ABORT_TIMEOUT_S)) as r:
                await r.read()
                if r.status != 200:
                    logger.warning("abort of transfer %s on %s answered %d", transfer_id, worker.url, r.status)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            logger.warning("abort of transfer %s on %s failed: %s", transfer_id, worker.url, describe(e))
        finally:
            await worker.release()

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(set(self._background), timeout=ABORT_TIMEOUT_S)


class PDRequest:
    """One client request: the prefill leg, then the decode leg relayed to the client."""

    def __init__(self, relay: PDRelay, request: web.Request, endpoint: str, body: dict):
        self.relay = relay
        self.metrics = relay.metrics
        self.series = relay.metrics.endpoint(endpoint)
        self.request = request
        self.endpoint = endpoint
        self.path = request.path
        self.body = body
        self.headers = {"Content-Type": "application/json"}
        if "Authorization" in request.headers:
            self.headers["Authorization"] = request.headers["Authorization"]
        self.arrival = time.perf_counter()
        self.last_send = self.arrival
        self.first_event_sent = False
        self.prefill_worker: Worker | None = None
        self.transfer_id: str | None = None
        self.pulled = False  # D produced output, so it is done with P's blocks

    async def run(self) -> web.StreamResponse:
        status = "500"  # a bug: aiohttp answers 500
        try:
            kv = await self.prefill()
            response = await self.decode(kv)
            status = str(response.status)
            return response
        except LegError as e:
            status = str(e.status)
            return e.response()
        except asyncio.CancelledError:
            status = "client_disconnect"
            raise
        finally:
            if self.transfer_id is not None and not self.pulled:
                self.relay.abort_transfer(self.prefill_worker, self.transfer_id, self.headers)
            self.metrics.requests.labels(self.endpoint, status).inc()
            self.series.request_latency.observe(time.perf_counter() - self.arrival)

    # ------------------------------------------------------------------ prefill leg

    async def prefill(self) -> dict | None:
        tried: list[Worker] = []
        refused: list[Worker] = []
        last_error = None
        for _ in range(MAX_PREFILL_TRIES):
            worker = self.relay.pick("prefill", self.body, tried, last_error, refused)
            if tried:
                self.metrics.retries.labels("prefill").inc()
            self.prefill_worker, self.transfer_id = worker, new_transfer_id()
            try:
                return await self.prefill_on(worker)
            except RETRYABLE_PREFILL as e:
                worker.breaker.record_failure()
                self.metrics.upstream_errors.labels("prefill", "connection").inc()
                last_error = f"prefill worker {worker.url} unreachable: {describe(e)}"
                self.relay.abort_transfer(worker, self.transfer_id, self.headers)  # in case it did run
                self.transfer_id = None
                tried.append(worker)
                if isinstance(e, aiohttp.ClientConnectorError):
                    refused.append(worker)
        raise LegError(502, last_error or "prefill failed")

    async def prefill_on(self, worker: Worker) -> dict | None:
        """P's kv_transfer_params; raises RETRYABLE_PREFILL only before P's response began."""
        data = msgspec.json.encode(prefill_body(self.body, self.transfer_id))
        started = time.perf_counter()
        responded = False
        trial = worker.acquire()
        try:
            r = await worker.session.post(self.path, data=data, headers=self.headers,
                                          timeout=self.relay.prefill_timeout)
            responded = True
            try:
                answer = await r.read()
            finally:
                r.close()
        except asyncio.TimeoutError:
            worker.breaker.record_failure()
            self.metrics.upstream_errors.labels("prefill", "timeout").inc()
            raise LegError(504, f"prefill worker {worker.url} timed out after {self.relay.request_timeout_s} s",
                           type="timeout")
        except aiohttp.ClientError as e:
            if not responded and isinstance(e, RETRYABLE_PREFILL):
                raise
            worker.breaker.record_failure()
            self.metrics.upstream_errors.labels("prefill", "broken_answer").inc()
            raise LegError(502, f"prefill worker {worker.url} broke off its answer: {describe(e)}")
        finally:
            await worker.release(trial)
        self.metrics.prefill_leg.observe(time.perf_counter() - started)
        if r.status != 200:
            self.metrics.upstream_errors.labels("prefill", f"status_{r.status}").inc()
            raise failed_answer("prefill", worker, r.status, answer, r.content_type)
        worker.breaker.record_success()
        return self.prefill_params(worker, answer)

    def prefill_params(self, worker: Worker, answer: bytes) -> dict | None:
        try:
            kv = msgspec.json.decode(answer).get("kv_transfer_params")
        except (msgspec.DecodeError, AttributeError):
            raise LegError(502, f"prefill worker {worker.url} answered 200 with a body that is not a JSON object")
        if kv is None:
            # P kept nothing for us: D computes the prompt itself. Counted, since it costs a prefill.
            self.metrics.decisions.labels("decode_without_kv").inc()
            self.transfer_id = None
            return None
        try:
            params = KVTransferParams.from_json_obj(kv)  # checked here, so a bad P is a 502, not D's 400
        except ValueError as e:
            worker.breaker.record_failure()
            raise LegError(502, f"prefill worker {worker.url} returned {e}")
        # Relayed as P sent it: fields this router does not know still reach D.
        kv.setdefault("transfer_id", self.transfer_id)
        secret = self.relay.kv_params_secret
        if secret is not None:  # vouch for P's params to D (kv_transfer/trust.py)
            params = msgspec.structs.replace(params, transfer_id=kv["transfer_id"])
            kv["signature"] = signature_of(params, secret)
        self.metrics.decision_pd.inc()
        return kv

    # ------------------------------------------------------------------ decode leg

    async def decode(self, kv: dict | None) -> web.StreamResponse:
        body = dict(self.body, kv_transfer_params=kv) if kv is not None else self.body
        data = msgspec.json.encode(body)
        tried: list[Worker] = []
        last_error = None
        for _ in range(MAX_DECODE_TRIES):
            worker = self.relay.pick("decode", self.body, tried, last_error)
            if tried:
                self.metrics.retries.labels("decode").inc()
            started = time.perf_counter()
            trial = worker.acquire()
            try:
                try:
                    upstream = await worker.session.post(self.path, data=data, headers=self.headers,
                                                         timeout=self.relay.decode_timeout)
                except aiohttp.ClientConnectorError as e:  # D never saw the request: P's blocks still wait
                    worker.breaker.record_failure()
                    self.metrics.upstream_errors.labels("decode", "connection").inc()
                    last_error = f"decode worker {worker.url} unreachable: {describe(e)}"
                    tried.append(worker)
                    continue
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    worker.breaker.record_failure()
                    if isinstance(e, asyncio.TimeoutError):
                        self.metrics.upstream_errors.labels("decode", "timeout").inc()
                        raise LegError(504, f"decode worker {worker.url} sent nothing for "
                                       f"{self.relay.request_timeout_s} s", type="timeout")
                    self.metrics.upstream_errors.labels("decode", "no_answer").inc()
                    raise LegError(502, f"decode worker {worker.url} did not answer: {describe(e)}")
                try:
                    return await self.relay_answer(worker, upstream)
                finally:
                    upstream.close()  # a no-op after EOF; otherwise cancels D's request
                    self.metrics.decode_leg.observe(time.perf_counter() - started)
            finally:
                await worker.release(trial)
        raise LegError(502, last_error or "decode failed")

    async def relay_answer(self, worker: Worker, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        if upstream.status != 200:
            try:
                answer = await upstream.read()
            except (aiohttp.ClientError, asyncio.TimeoutError):
                answer = b""
            self.metrics.upstream_errors.labels("decode", f"status_{upstream.status}").inc()
            raise failed_answer("decode", worker, upstream.status, answer, upstream.content_type)
        if upstream.content_type == "text/event-stream":
            return await self.relay_stream(worker, upstream)
        return await self.relay_body(worker, upstream)

    async def relay_body(self, worker: Worker, upstream: aiohttp.ClientResponse) -> web.Response:
        try:
            answer = await upstream.read()
            parsed = msgspec.json.decode(answer)
        except (aiohttp.ClientError, asyncio.TimeoutError, msgspec.DecodeError) as e:
            worker.breaker.record_failure()
            self.metrics.upstream_errors.labels("decode", "broken_body").inc()
            raise LegError(502, f"decode worker {worker.url} sent a broken body: {describe(e)}")
        if not isinstance(parsed, dict) or "error" in parsed:
            worker.breaker.record_failure()
            self.metrics.upstream_errors.labels("decode", "error_body").inc()
            raise LegError(502, f"decode worker {worker.url} answered 200 with: {upstream_message(answer)}")
        worker.breaker.record_success()
        self.pulled = True
        return web.Response(body=answer, content_type="application/json")

    async def relay_stream(self, worker: Worker, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        out = web.StreamResponse(headers=SSE_HEADERS)
        buf = last = b""
        error = None
        try:
            async for chunk in upstream.content.iter_any():
                buf += chunk
                cut = complete_events_end(buf)
                if not cut:
                    continue
                events, buf = buf[:cut], buf[cut:]
                if not out.prepared and events.startswith(ERROR_EVENT_PREFIX):
                    raise LegError(502, f"decode worker {worker.url} failed: {upstream_message(events[6:])}")
                if events.rstrip().endswith(DONE_EVENT):
                    await self.send(out, events, end=True)  # the last event and our EOF in one write
                    worker.breaker.record_success()
                    await self.drain(upstream)
                    return out
                await self.send(out, events)
                last = events
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            error = f"decode worker {worker.url} broke off the stream: {describe(e)}"
        worker.breaker.record_failure()
        self.metrics.upstream_errors.labels("decode", "broken_stream").inc()
        error = error or f"decode worker {worker.url} ended the stream before [DONE]"
        if not out.prepared:
            raise LegError(502, error)
        tail = b"" if last.startswith(ERROR_EVENT_PREFIX) else b"data: " + error_body(error) + b"\n\n"
        await self.send(out, tail + DONE_EVENT + b"\n\n", end=True)
        return out

    @staticmethod
    async def drain(upstream: aiohttp.ClientResponse) -> None:
        """Read D's end of body after [DONE], so its connection goes back to the pool; a D
        that lingers is cut off (decode() closes the connection) instead of holding us."""
        if upstream.content.at_eof():  # the usual case: the connection is back in the pool
            return
        try:
            async with asyncio.timeout(DRAIN_TIMEOUT_S):
                await upstream.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass

    async def send(self, out: web.StreamResponse, data: bytes, end: bool = False) -> None:
        """Write whole events to the client (`end`: and finish the body in the same write).
        TTFT/ITL count the events the client receives ([DONE] excluded); events that
        arrived in one read share one time."""
        now = time.perf_counter()
        events = data.count(b"\n\n") + data.count(b"\r\n\r\n") - (DONE_EVENT in data)
        try:
            if not out.prepared:
                await out.prepare(self.request)
                self.pulled = True
            await (out.write_eof(data) if end else out.write(data))
        except ConnectionResetError:
            # The client is gone; end the handler the way aiohttp's disconnect cancellation does.
            raise asyncio.CancelledError()
        if events > 0:
            if self.first_event_sent:
                self.series.itl.observe(now - self.last_send)
            else:
                self.series.ttft.observe(now - self.arrival)
                self.first_event_sent = True
            for _ in range(events - 1):
                self.series.itl.observe(0.0)
            self.last_send = now
