"""`atomd serve`: an OpenAI-compatible HTTP server (aiohttp on uvloop) over an EngineCore.

This process owns HTTP, the tokenizer (prompt encoding, chat templates, incremental
detokenization, stop strings) and the metrics; the engine core process only sees token
ids (atomd/engine/core.py, reached through atomd/api/core_client.py). Routes:

  POST /v1/completions, /v1/chat/completions   JSON or SSE (`stream: true`)
  GET  /v1/models
  GET  /health     200 while the engine core process lives (503 once it died); no API key
  GET  /ready      200 once the engine is loaded and answers a stats call within 2 s
  GET  /metrics    Prometheus text
  POST /reset_prefix_cache
  GET  /debug/stats   the engine's stats() (free blocks, queues), for tests and operators
  GET  /kv_transfer_info     PD role, side-channel address, DP size, compat fingerprint
  POST /kv_transfer/abort    {"transfer_id"}: a producer frees that transfer's pinned blocks

Length policy (like vLLM): a prompt longer than max_model_len goes to the engine, whose
scheduler rejects it, and its unschedulable message comes back as a 400. A prompt that
fits but whose `max_tokens` would run past max_model_len is a 400 as well (no silent
clamp); a chat request without max_tokens gets the rest of the context.

A streamed response starts (headers, then the first chunk) once the engine has produced
the first token, so a request the scheduler rejects still gets a plain JSON 400. A client
that disconnects (mid-stream or while waiting) has its request aborted in the engine,
which frees its blocks; an engine that dies mid-stream ends the stream with an error
event and `data: [DONE]`.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import errno
import hmac
import json
import logging
import signal
import sys
import time
import uuid
from typing import Any

import msgspec
import uvloop
from aiohttp import http_exceptions, web
from aiohttp.web_protocol import RequestHandler
from prometheus_client import CONTENT_TYPE_LATEST

from atomd.api import chat_templates
from atomd.api import limits as L
from atomd.api import protocol as P
from atomd.api.core_client import EngineClient, EngineDeadError, RequestStream, make_engine_client
from atomd.messages import RequestOutput
from atomd.api.metrics import ServerMetrics
from atomd.api.reasoning import REASONING_PARSERS, ReasoningParser, prompt_opens_reasoning
from atomd.api.tool_parsers import TOOL_CALL_PARSERS
from scheduler.sequence import ErrorCode
from scheduler.stop import cut_at_stop

logger = logging.getLogger("atomd.api.server")
access_logger = logging.getLogger("atomd.access")

READY_PROBE_TIMEOUT_S = 2.0
SHUTDOWN_TIMEOUT_S = 5.0  # on SIGTERM, in-flight requests get this long before they are cut
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
OPEN_PATHS = ("/health", "/ready", "/metrics", "/openapi.json")
PROBE_PATHS = ("/health", "/ready", "/metrics")  # not in the access log unless --access-log-probes
ADMIN_PATHS = ("/reset_prefix_cache", "/kv_transfer/abort")  # and everything under /debug/
RANK_HEADER = "X-data-parallel-rank"
PARSER_THREADS = 2  # requests parsed and tokenized at once (tokenizers drop the GIL)
PROMPT_TAIL_TOKENS = 16  # decoded to see whether the chat template opened <think> (<= 7 tokens + whitespace)
# Limits on a request head (aiohttp's parser enforces them; router/http.py has the same):
# the request line, one header field, the number of headers. The body: --max-request-body-bytes.
MAX_LINE_BYTES = 8190
MAX_FIELD_BYTES = 8190
MAX_HEADERS = 128
ERROR_STATUS = {ErrorCode.INVALID_REQUEST: (400, "invalid_request_error"),
                ErrorCode.UNSCHEDULABLE: (400, "invalid_request_error"),
                ErrorCode.KV_TRANSFER_FAILED: (503, "service_unavailable"),
                ErrorCode.KV_PARAMS_UNTRUSTED: (403, "permission_error")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from atomd.config import add_engine_args

    add_engine_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` (all routes but /health, /ready, /metrics, "
                        "/openapi.json)")
    g.add_argument("--admin-api-key", default=None,
                   help="the admin routes (/reset_prefix_cache, /kv_transfer/abort, /debug/*) take this key "
                        "instead of --api-key, which then opens only the client routes (the router passes "
                        "it with --engine-admin-api-key)")
    g.add_argument("--max-request-body-bytes", type=int, default=16 << 20,
                   help="larger request bodies get a 413")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send and see (default: the engine's model name)")
    g.add_argument("--engine-start-timeout-s", type=float, default=600.0,
                   help="give up when the engine core is not ready by then")
    g.add_argument("--engine-stall-timeout-s", type=float, default=60.0,
                   help="/health answers 503 while the engine core, with requests in flight, has not answered "
                        "for this long (probed every third of it), so a router takes a wedged engine out of "
                        "rotation; it must exceed the longest engine step")
    L.add_arguments(parser.add_argument_group("request limits (a request over one is a 400 naming it)"))
    g.add_argument("--disable-access-log", "--disable-uvicorn-access-log", dest="disable_access_log",
                   action="store_true", help="write no access log lines (vLLM's name is accepted too)")
    g.add_argument("--access-log-probes", action="store_true",
                   help="log the probes too (%s: a router asks every few seconds), which are left out by default"
                        % ", ".join(PROBE_PATHS))
    g.add_argument("--tool-call-parser", choices=tuple(TOOL_CALL_PARSERS), default="hermes",
                   help="how tool calls are read from the model's output (chat requests with tools): hermes "
                        "(<tool_call> JSON: Hermes, Qwen2.5, Qwen3), llama3_json (Llama 3's JSON calls)")
    g.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split <think>...</think> out of chat output into reasoning_content: qwen3 (when the "
                        "output opens with <think>), deepseek_r1 (the template opened it: output starts in it)")
    g.add_argument("--chat-template", default=None, metavar="PATH_OR_TEMPLATE",
                   help="a chat template (a jinja file, or the template inline) instead of the checkpoint's")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat request's own chat_template (it runs in jinja's sandbox, but can loop; "
                        "off: such a request is a 400)")


def run(args: argparse.Namespace) -> int:
    from atomd.config import EngineConfig

    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    access = logging.StreamHandler(sys.stderr)  # bare JSON lines, one per request
    access.setFormatter(logging.Formatter("%(message)s"))
    access_logger.addHandler(access)
    access_logger.propagate = False
    try:
        config = EngineConfig.from_args(args)
        config.check_model_dir()
        if args.chat_template is not None:  # a bad one stops here, not at the first request
            args.chat_template = chat_templates.load_chat_template(args.chat_template)
    except ValueError as e:
        print(f"atomd serve: error: {e}", file=sys.stderr)
        return 2
    return uvloop.run(serve(config, args))


async def serve(config: Any, args: argparse.Namespace) -> int:
    """Listen at once (so /health answers while the model loads), then start the core."""
    server = Server(config, args)
    runner = JSONErrorRunner(server.app, handler_cancellation=True, access_log=None,
                             shutdown_timeout=SHUTDOWN_TIMEOUT_S, **HEAD_LIMITS)
    await runner.setup()
    try:
        await web.TCPSite(runner, args.host, args.port).start()
    except OSError as e:  # the user's to fix: one line naming the flag (the trace with --debug)
        logger.debug("cannot listen on %s:%s", args.host, args.port, exc_info=True)
        await runner.cleanup()
        print(f"atomd serve: error: {listen_error(e, args.host, args.port)}", file=sys.stderr)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start(args.engine_start_timeout_s)
        print(f"atomd serve: ready at http://{args.host}:{args.port} (model {server.model_name})", flush=True)
        await stop.wait()
        return 0
    except Exception as e:  # the engine core or the tokenizer could not start
        print(f"atomd serve: failed to start: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        if server.watchdog is not None:
            server.watchdog.cancel()
        await runner.cleanup()
        await server.client.shutdown()
        server.parser.shutdown(wait=False)


def unschedulable_param(code: ErrorCode | None, req: Any, params: Any, max_num_seqs: int) -> str | None:
    """The field to blame for the scheduler's refusal: more choices than --max-num-seqs (best_of
    or n), else the prompt is too long (for the context or the KV pool)."""
    if code is not ErrorCode.UNSCHEDULABLE:
        return None
    if params.num_samples > max_num_seqs:
        return "best_of" if params.best_of is not None else "n"
    return "messages" if isinstance(req, P.ChatCompletionRequest) else "prompt"


def listen_error(e: OSError, host: str, port: int) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is in use by another process; pick a free one with --port"
    return f"cannot listen on {host}:{port} ({e.strerror or e}); check --host and --port"


HEAD_LIMITS = dict(max_line_size=MAX_LINE_BYTES, max_field_size=MAX_FIELD_BYTES, max_headers=MAX_HEADERS)


class JSONErrorRequestHandler(RequestHandler):
    """aiohttp's connection handler, whose own answers (a request its parser refused: a
    line or header over the limits, too many headers, not HTTP) are OpenAI-style JSON
    errors like every other, carrying no client bytes, trace or path. A malformed request
    is the client's, so it is logged at debug level, not with a traceback."""

    __slots__ = ()

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp: too late for an error answer
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        else:
            self.logger.debug("refused a request from %s: %r", request.remote, exc)
        code, kind = "bad_request", "invalid_request_error"
        if isinstance(exc, http_exceptions.LineTooLong):
            text = (f"the request line or a header is longer than {MAX_LINE_BYTES} bytes")
            code = "request_too_large"
        elif isinstance(exc, http_exceptions.BadHttpMessage) and "too many headers" in str(exc).lower():
            status, text, code = 431, f"more than {MAX_HEADERS} request headers", "request_too_large"
        elif status >= 500:
            text, kind, code = "internal error", "server_error", "internal_error"
        elif status == 504:
            text, kind, code = "timed out", "timeout", "timeout"
        else:
            text = f"malformed HTTP request ({type(exc).__name__ if exc else 'unknown'})"
        resp = error_response(P.APIError(status, text, type=kind, code=code))
        resp.force_close()
        return resp


class JSONErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        handler = super().__call__()
        handler.__class__ = JSONErrorRequestHandler  # same slots: only handle_error differs
        return handler


class JSONErrorRunner(web.AppRunner):
    """web.AppRunner whose connections answer parser errors with JSON (JSONErrorRequestHandler)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = JSONErrorServer
        return server


def load_tokenizer(config: Any):
    """The engine's tokenizer, resolved like atomd.engine.llm_engine.resolve_model_dir (which this
    process does not import: it would pull in torch)."""
    from atomd.model.default import default_model_dir
    from atomd.model.hub import model_path
    from atomd.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_path(config.model) if config.model else default_model_dir())


class Server:
    def __init__(self, config: Any, args: argparse.Namespace):
        self.config, self.args = config, args
        self.client: EngineClient = make_engine_client(config, on_abort_confirmed=self.on_abort_confirmed)
        self.model_name = args.served_model_name
        self.tokenizer = None
        self.metrics: ServerMetrics | None = None
        self.watchdog: asyncio.Task | None = None  # watch_core(), once the core is up
        self.max_model_len = config.max_model_len
        limits = L.from_args(args)
        self.limits = msgspec.structs.replace(limits, max_prompt_chars=limits.prompt_chars(config.max_model_len))
        # Parsing, validation and tokenization of a request run here, off the event loop:
        # a large request never stalls /health or the other requests' streams.
        self.parser = concurrent.futures.ThreadPoolExecutor(PARSER_THREADS, thread_name_prefix="atomd-parse")
        app = web.Application(client_max_size=args.max_request_body_bytes,
                              middlewares=[self.access_log, self.errors, self.auth])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_route)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_get("/debug/stats", self.debug_stats)
        app.router.add_get("/kv_transfer_info", self.kv_transfer_info)
        app.router.add_post("/kv_transfer/abort", self.kv_transfer_abort)
        app.router.add_get("/openapi.json", self.openapi)
        app.on_response_prepare.append(echo_request_id)
        self.app = app

    async def start(self, timeout_s: float) -> None:
        ready = await self.client.start(timeout_s)
        self.model_name = self.model_name or ready.model_name
        self.tokenizer = await asyncio.to_thread(load_tokenizer, self.config)
        if self.args.chat_template is not None:
            self.tokenizer.chat_template = self.args.chat_template
        self.metrics = ServerMetrics(self.model_name, self.config.data_parallel_rank)
        self.watchdog = asyncio.get_running_loop().create_task(self.watch_core())

    def on_abort_confirmed(self) -> None:
        if self.metrics is not None:
            self.metrics.on_aborted()

    # ------------------------------------------------------------ middlewares

    @web.middleware
    async def access_log(self, request: web.Request, handler):
        """One JSON line per request, written when the response (stream included) is done."""
        t0 = time.perf_counter()
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        request["request_id"] = request_id
        status = 500
        try:
            response = await handler(request)
            status = 499 if request.get("client_gone") else response.status
            return response
        except web.HTTPException as e:
            status = e.status
            raise
        except asyncio.CancelledError:
            status = 499  # client closed the connection
            raise
        finally:
            if not self.args.disable_access_log and (self.args.access_log_probes or request.path not in PROBE_PATHS):
                access_logger.info(json.dumps({
                    "ts": round(time.time(), 6), "method": request.method, "path": request.path, "status": status,
                    "latency_s": round(time.perf_counter() - t0, 6), "request_id": request_id}))

    @web.middleware
    async def errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except P.APIError as e:
            return error_response(e)
        except EngineDeadError as e:
            return error_response(P.APIError(503, f"engine is not available: {e}",
                                             type="service_unavailable", code="engine_dead"))
        except web.HTTPRequestEntityTooLarge:
            return error_response(P.APIError(
                413, f"request body is larger than {self.args.max_request_body_bytes} bytes",
                code="request_too_large"))
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return error_response(P.APIError(e.status, e.reason, type="invalid_request_error"))
        except Exception:  # a bug: answer it in the API's error shape, keep serving
            # The trace goes to the log only: no stack, message or internal path in the body.
            logger.exception("unhandled error on %s %s (request %s)", request.method, request.path,
                             request.get("request_id"))
            return error_response(P.APIError(
                500, f"internal error; the server log has it under request id {request.get('request_id')}",
                type="server_error", code="internal_error"))

    @web.middleware
    async def auth(self, request: web.Request, handler):
        """Client routes take --api-key; admin routes take --admin-api-key when one is set (a
        client key never opens them), else --api-key. Compared in constant time."""
        path = request.path
        admin = self.args.admin_api_key is not None and (path in ADMIN_PATHS or path.startswith("/debug/"))
        key = self.args.admin_api_key if admin else self.args.api_key
        # surrogateescape: a header that is not UTF-8 is a wrong key, not an error
        if key and path not in OPEN_PATHS and not hmac.compare_digest(
                request.headers.get("Authorization", "").encode("utf-8", "surrogateescape"),
                f"Bearer {key}".encode()):
            which = "admin API key" if admin else "API key"
            raise P.APIError(401, f"missing or invalid {which} (expected `Authorization: Bearer <key>`)",
                             type="authentication_error", code="invalid_admin_key" if admin else "invalid_api_key")
        return await handler(request)

    # ------------------------------------------------------------ operational routes

    async def health(self, request: web.Request) -> web.Response:
        if self.client.dead is not None:
            return json_response({"status": "engine dead", "reason": self.client.dead}, 503)
        silent = self.client.silent_s()
        if silent > self.args.engine_stall_timeout_s:
            return json_response({"status": "engine stalled",
                                  "reason": f"the engine core has not answered for {silent:.0f} s"}, 503)
        return json_response({"status": "ok"})

    async def watch_core(self) -> None:
        """While requests are in flight and the core has been quiet a while, ask it for its
        stats: a core that steps answers between steps (refreshing its silence), so only a
        wedged one stays silent long enough for /health to say so."""
        period = self.args.engine_stall_timeout_s / 3
        while self.client.dead is None:
            await asyncio.sleep(period)
            if self.client.alive and self.client.silent_s() > period:
                try:
                    await self.client.call("stats", timeout_s=self.args.engine_stall_timeout_s)
                except (EngineDeadError, asyncio.TimeoutError, RuntimeError):
                    pass  # dead: the sentinel says so; silent: /health says so

    async def ready(self, request: web.Request) -> web.Response:
        if not self.client.alive or self.tokenizer is None:
            return json_response({"status": "dead" if self.client.dead else "loading"}, 503)
        try:
            await self.client.call("stats", timeout_s=READY_PROBE_TIMEOUT_S)
        except (EngineDeadError, asyncio.TimeoutError, RuntimeError) as e:
            return json_response({"status": "not answering", "reason": str(e) or "timeout"}, 503)
        return json_response({"status": "ready"})

    async def metrics_route(self, request: web.Request) -> web.Response:
        if self.metrics is None:
            return web.Response(status=503, text="engine is loading\n")
        stats = None
        if self.client.alive:
            try:
                stats = await self.client.call("stats", timeout_s=READY_PROBE_TIMEOUT_S)
            except (EngineDeadError, asyncio.TimeoutError, RuntimeError):
                pass  # serve the API-side series; engine gauges keep their last value
        return web.Response(body=self.metrics.render(stats), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.require_engine()
        return json_response({"reset": bool(await self.client.call("reset_prefix_cache"))})

    async def debug_stats(self, request: web.Request) -> web.Response:
        """The engine's stats plus this process's view: requests it still streams, and
        aborts the engine has not confirmed yet (both 0 once everything has settled)."""
        self.require_engine()
        stats = await self.client.call("stats")
        return json_response(dict(stats, api_requests_in_flight=len(self.client.streams),
                                  api_aborts_unconfirmed=len(self.client.aborting)))

    async def kv_transfer_info(self, request: web.Request) -> web.Response:
        self.require_engine()
        return json_response(await self.client.call("kv_transfer_info"))

    async def kv_transfer_abort(self, request: web.Request) -> web.Response:
        """The router's abort of a transfer D never pulled; unknown ids answer revoked=false."""
        self.require_engine()
        try:
            body = msgspec.json.decode(await request.read())
        except (msgspec.DecodeError, RecursionError) as e:
            raise P.invalid("body", f"not JSON: {e}") from None
        transfer_id = body.get("transfer_id") if isinstance(body, dict) else None
        if not isinstance(transfer_id, str) or not transfer_id:
            raise P.invalid("transfer_id", "transfer_id must be a non-empty string")
        return json_response({"transfer_id": transfer_id,
                              "revoked": bool(await self.client.call("kv_transfer_abort", transfer_id))})

    async def openapi(self, request: web.Request) -> web.Response:
        """OpenAPI 3.1 from the structs that validate the bodies (atomd/api/openapi.py)."""
        from atomd import __version__
        from atomd.api.openapi import openapi_document

        return json_response(openapi_document(__version__))

    async def models(self, request: web.Request) -> web.Response:
        self.require_engine()
        card = P.ModelCard(id=self.model_name, created=int(time.time()), max_model_len=self.max_model_len)
        return json_response(P.ModelList([card]))

    def require_engine(self) -> None:
        if self.client.dead is not None:
            raise EngineDeadError(self.client.dead)
        if not self.client.alive or self.tokenizer is None:
            raise P.APIError(503, "engine is loading", type="service_unavailable", code="engine_loading")

    # ------------------------------------------------------------ generation routes

    async def read_request(self, request: web.Request) -> bytes:
        self.require_engine()
        if request.content_length is not None and request.content_length > self.args.max_request_body_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=self.args.max_request_body_bytes,
                                                actual_size=request.content_length)
        return await request.read()

    def check_model(self, req) -> None:
        if req.model and req.model != self.model_name:
            raise P.APIError(404, f"model {req.model!r} does not exist; this server serves {self.model_name!r}",
                             param="model", code="model_not_found")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self.read_request(request)
        req, checked, ids, params, prompt = await asyncio.get_running_loop().run_in_executor(
            self.parser, self.parse_completion, body)
        out = CompletionRenderer(self, f"cmpl-{uuid.uuid4().hex}", req, checked, ids,
                                 prompt if isinstance(prompt, str) else None)
        return await self.generate(request, req, checked, ids, params, out)

    def parse_completion(self, body: bytes):
        """Body -> (request, checks, prompt ids, sampling params, prompt): on a parser thread."""
        req = P.decode_request(body, P.CompletionRequest)
        self.check_model(req)
        checked = P.validate_completion_request(req, self.limits)
        prompt = P.prompt_input(req.prompt)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else self.check_token_ids(prompt)
        self.check_sampling_token_ids(req, checked)
        params = P.sampling_params(req, self.max_tokens(ids, req.max_tokens, "max_tokens", 16), checked)
        return req, checked, ids, params, prompt

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self.read_request(request)
        req, checked, ids, params = await asyncio.get_running_loop().run_in_executor(
            self.parser, self.parse_chat, body)
        out = ChatRenderer(self, f"chatcmpl-{uuid.uuid4().hex}", req, checked, ids)
        return await self.generate(request, req, checked, ids, params, out)

    def parse_chat(self, body: bytes):
        """As parse_completion, for a chat request."""
        req = P.decode_request(body, P.ChatCompletionRequest)
        self.check_model(req)
        checked = P.validate_chat_request(req, self.limits, self.args.tool_call_parser)
        ids = chat_templates.prompt_ids(self.tokenizer, req, P.chat_messages(req), checked.tools,
                                        self.args.trust_request_chat_template, self.limits.max_prompt_chars)
        requested, param = (req.max_completion_tokens, "max_completion_tokens") \
            if req.max_completion_tokens is not None else (req.max_tokens, "max_tokens")
        self.check_sampling_token_ids(req, checked)
        params = P.sampling_params(req, self.max_tokens(ids, requested, param, None), checked)
        return req, checked, ids, params

    def check_token_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise P.invalid(param, f"token id {bad} is outside the vocabulary [0, {vocab})")
        return ids

    def check_sampling_token_ids(self, req, checked: P.Checked) -> None:
        """logit_bias keys and allowed_token_ids must be token ids of this vocabulary."""
        if checked.logit_bias:
            self.check_token_ids(list(checked.logit_bias), "logit_bias")
        if req.allowed_token_ids is not None:
            if not req.allowed_token_ids:
                raise P.invalid("allowed_token_ids", "allowed_token_ids must not be empty")
            if len(req.allowed_token_ids) > self.tokenizer.vocab_size:
                raise P.invalid("allowed_token_ids", f"allowed_token_ids has {len(req.allowed_token_ids)} ids; "
                                                     f"the vocabulary has {self.tokenizer.vocab_size}")
            self.check_token_ids(req.allowed_token_ids, "allowed_token_ids")

    def max_tokens(self, ids: list[int], requested: int | None, param: str, default: int | None) -> int:
        """The max_tokens the engine gets, or a 400 when the request cannot fit (see module doc)."""
        room = self.max_model_len - len(ids)
        if room < 0:
            return requested or default or 1  # the scheduler rejects it with its own message
        wanted = requested if requested is not None else (default if default is not None else room)
        if wanted > room or room == 0:
            raise P.invalid(param, (
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(ids)} tokens and {param}={wanted} would need {len(ids) + wanted}"))
        return wanted

    def requested_dp_rank(self, request: web.Request, req) -> int | None:
        """The rank a request asks for (body field first, then header), or None; a 400 when bad."""
        rank = req.data_parallel_rank
        if rank is None and RANK_HEADER in request.headers:
            try:
                rank = int(request.headers[RANK_HEADER])
            except ValueError:
                raise P.invalid("data_parallel_rank", f"{RANK_HEADER} must be an integer") from None
        size = self.config.data_parallel_size
        if rank is not None and not 0 <= rank < size:
            raise P.invalid("data_parallel_rank", f"data_parallel_rank must be in [0, {size}), got {rank}")
        return rank

    async def generate(self, request: web.Request, req, checked: P.Checked, ids: list[int], params,
                       out: "RequestRenderer"):
        stream = self.client.add_request(out.id, ids, params, checked.kv_transfer_params,
                                         dp_rank=self.requested_dp_rank(request, req))
        try:
            first = await stream.next_batch()
            head = first[0]
            if head.error is not None:  # refused or rejected by the engine, or a failed KV pull
                status, kind = ERROR_STATUS.get(head.error_code, (500, "server_error"))
                code = head.error_code.value if head.error_code is not None else None
                raise P.APIError(status, head.error, type=kind, code=code,
                                 param=unschedulable_param(head.error_code, req, params, self.config.max_num_seqs))
            if req.stream:
                return await self.stream_response(request, stream, first, out)
            batch = first
            while True:
                out.add(batch)  # the chunks are for streams
                if out.finished:
                    return web.Response(body=out.full_response(), content_type="application/json")
                batch = await stream.next_batch()
        finally:
            self.client.abort(out.id)  # no-op once finished; frees the blocks of a gone client

    async def stream_response(self, request: web.Request, stream: RequestStream,
                              batch: list[RequestOutput], out: "RequestRenderer") -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        try:
            while True:
                for chunk in out.add(batch):
                    await resp.write(sse(chunk))
                if out.finished:
                    break
                batch = await stream.next_batch()
            for chunk in out.stream_end():
                await resp.write(sse(chunk))
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:  # the client went away mid-stream; generate() aborts
            request["client_gone"] = True
            return resp
        except EngineDeadError as e:
            err = P.APIError(503, f"engine is not available: {e}", type="service_unavailable", code="engine_dead")
            await resp.write(sse(err.body()) + b"data: [DONE]\n\n")  # as the router ends a broken stream
        await resp.write_eof()
        return resp


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["X-Request-Id"] = request.get("request_id", "")


def sse(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type="application/json")


def error_response(e: P.APIError) -> web.Response:
    return web.Response(body=e.body(), status=e.status, content_type="application/json")


# ---------------------------------------------------------------- per-request output state

class Choice:
    """One choice's output so far: text (incremental, stop strings held back), tokens, logprobs."""

    __slots__ = ("index", "detok", "text", "emitted", "token_ids", "logprobs", "sent_logprobs", "finished",
                 "finish_reason", "started", "closed")

    def __init__(self, index: int, detok):
        self.index, self.detok = index, detok
        self.text = ""         # everything decoded so far
        self.emitted = 0       # chars of `text` already handed out
        self.token_ids: list[int] = []
        self.logprobs: list[tuple[int, dict]] = []  # (token id, engine entry)
        self.sent_logprobs = 0
        self.finished = False
        self.finish_reason: str | None = None
        self.started = False   # its first chunk went out (a stream's role / echo prefix)
        self.closed = False    # its last chunk went out


class RequestRenderer:
    """Accumulates one request's deltas: per choice text (incremental, stop strings held
    back) and logprobs, then usage and metrics for the request. Subclasses render the
    endpoint's JSON. Choices stream interleaved, in the order their tokens arrive."""

    opens_early = False  # a choice's first chunk goes out before it has text (chat's role, echo)

    def __init__(self, server: Server, request_id: str, req, checked: P.Checked, prompt_ids: list[int],
                 prompt_text: str | None = None):
        self.id, self.req, self.num_logprobs = request_id, req, checked.logprobs
        self.model, self.created = server.model_name, int(time.time())
        self.tokenizer, self.metrics = server.tokenizer, server.metrics
        self.choices = [Choice(i, server.tokenizer.incremental_decoder()) for i in range(req.n)]
        self.prompt_ids = prompt_ids
        self.prompt_text = prompt_text
        self.prompt_logprobs: list | None = None  # the engine's entries, from the first output
        self.stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.finished = False
        self.finish_reason: str | None = None
        self.num_prompt_tokens = self.num_cached_tokens = 0
        self.kv_transfer_params: dict | None = None
        self.t_arrival = self.t_last = time.perf_counter()
        self.first_token_seen = False

    def add(self, deltas: list[RequestOutput]) -> list[bytes]:
        """Fold `deltas` in; return the stream chunks for what is new (one per choice that has
        something to say, in arrival order)."""
        touched: dict[int, None] = {}
        last: RequestOutput | None = None
        for d in deltas:
            self.observe(d)
            if d.prompt_logprobs is not None:
                self.prompt_logprobs = d.prompt_logprobs
            c = self.choices[d.index] if d.index < len(self.choices) else self.choices[0]
            if d.finished:
                self.kv_transfer_params, last = d.kv_transfer_params, d
            if c.finished:  # cut at a stop string here already: the rest is past it
                continue
            touched[c.index] = None
            for i, tid in enumerate(d.new_token_ids):
                c.token_ids.append(tid)
                if self.num_logprobs is not None and d.new_logprobs:
                    c.logprobs.append((tid, d.new_logprobs[i]))
                c.text += c.detok.step(tid)
            if d.finish_reason is not None or d.finished:
                self.finish_choice(c, d.finish_reason)
            if d.finished:  # the request's last output: every choice is done
                for other in self.choices:
                    if not other.finished:
                        touched[other.index] = None
                        self.finish_choice(other, d.finish_reason)
        parts = []
        for index in touched:
            c = self.choices[index]
            self.cut_at_stop(c)
            start = c.emitted
            end = len(c.text) if c.finished else max(c.emitted, len(c.text) - self.hold)
            c.emitted = end
            items = c.logprobs[c.sent_logprobs:]
            c.sent_logprobs = len(c.logprobs)
            if c.text[start:end] or (c.finished and not c.closed) or items or (not c.started and self.opens_early):
                parts.append((c, c.text[start:end], items))
        if not self.finished and (last is not None or all(c.finished for c in self.choices)):
            self.finish(last)
            if not parts:  # the request's end still gets its chunk (it carries kv_transfer_params)
                parts.append((self.choices[0], "", []))
        chunks = []
        for j, (c, text, items) in enumerate(parts):
            final = self.finished and j == len(parts) - 1
            chunks.extend(self.chunks(c, text, items, c.finish_reason if c.finished else None, final))
            c.started = True
            c.closed = c.finished
        return chunks

    def finish_choice(self, c: Choice, reason: str | None) -> None:
        if c.finished:
            return
        c.text += c.detok.flush()
        self.cut_at_stop(c)
        if not c.finished:
            c.finished, c.finish_reason = True, reason

    def observe(self, d: RequestOutput) -> None:
        self.num_prompt_tokens, self.num_cached_tokens = d.num_prompt_tokens, d.num_cached_tokens
        now = time.perf_counter()
        if d.new_token_ids:
            if not self.first_token_seen:
                self.metrics.ttft.observe(now - self.t_arrival)
            self.metrics.on_tokens(len(d.new_token_ids), now - self.t_last if self.first_token_seen else None)
            self.first_token_seen, self.t_last = True, now

    def finish(self, d: RequestOutput | None) -> None:
        """Every choice is done: by the engine (`d`, the request's last output), or by the
        text of a stop string first."""
        self.finished = True
        self.finish_reason = self.choices[0].finish_reason
        self.metrics.on_finished(self.finish_reason or "unknown", self.num_prompt_tokens,
                                 time.perf_counter() - self.t_arrival, d.timing if d else None)

    def cut_at_stop(self, c: Choice) -> None:
        """Truncate a choice's text at the first stop string: the engine stops on it too, but
        the text of the token that completed it may run past it."""
        if not self.stops:
            return
        # text up to `emitted` was searched before (the last `hold` characters are held back)
        c.text, stop = cut_at_stop(c.text, self.stops, self.req.include_stop_str_in_output, c.emitted)
        if stop is not None and not c.finished:
            c.finished, c.finish_reason = True, "stop"

    def usage(self) -> P.Usage:
        n = sum(len(c.token_ids) for c in self.choices)  # every returned choice counts
        return P.Usage(self.num_prompt_tokens, n, self.num_prompt_tokens + n,
                       P.PromptTokensDetails(self.num_cached_tokens))

    def token_text(self, tid: int) -> str:
        return self.tokenizer.decode([tid])

    def include_usage(self) -> bool:
        return bool(self.req.stream_options and self.req.stream_options.include_usage)

    def vllm_prompt_logprobs(self) -> P.PromptLogprobs | msgspec.UnsetType:
        """vLLM's `prompt_logprobs` (when the request asked for them by that name)."""
        if self.req.prompt_logprobs is None:
            return msgspec.UNSET
        out: P.PromptLogprobs = []
        for pos, entry in enumerate(self.prompt_logprobs or []):
            if entry is None:
                out.append(None)
                continue
            tid = self.prompt_ids[pos]
            tokens = {str(tid): P.PromptLogprob(entry["logprob"], entry["rank"], self.token_text(tid))}
            for rank, (t, lp) in enumerate(entry["top"], start=1):
                tokens.setdefault(str(t), P.PromptLogprob(lp, rank, self.token_text(t)))
            out.append(tokens)
        return out

    def stream_end(self) -> list[bytes]:
        return []


class CompletionRenderer(RequestRenderer):
    @property
    def opens_early(self) -> bool:
        return self.req.echo

    def logprobs_block(self, items: list[tuple[int, dict]], offset: int,
                       echo: bool = False) -> P.CompletionLogprobs:
        tokens, lps, tops, offsets = [], [], [], []
        if echo:  # the prompt's tokens first: the first has no logprob (OpenAI's echo)
            entries = self.prompt_logprobs or []
            for pos, tid in enumerate(self.prompt_ids):
                entry = entries[pos] if pos < len(entries) else None
                text = self.token_text(tid)
                tokens.append(text)
                lps.append(entry["logprob"] if entry else None)
                tops.append({self.token_text(t): lp for t, lp in entry["top"]} if entry else None)
                offsets.append(offset)
                offset += len(text)
        for tid, entry in items:
            text = self.token_text(tid)
            tokens.append(text)
            lps.append(entry["logprob"])
            tops.append({self.token_text(t): lp for t, lp in entry.get("top") or []})
            offsets.append(offset)
            offset += len(text)
        return P.CompletionLogprobs(tokens, lps, tops, offsets)

    def echo_text(self) -> str:
        if self.prompt_text is None:
            self.prompt_text = self.tokenizer.decode(self.prompt_ids)
        return self.prompt_text

    def chunks(self, c: Choice, text: str, items, finish_reason, final: bool) -> list[bytes]:
        echo_now = self.req.echo and not c.started  # a choice's first chunk starts with the prompt
        prefix = self.echo_text() if self.req.echo else ""
        offset = 0 if echo_now else len(prefix) + c.emitted - len(text)  # of this chunk's text, echo included
        if echo_now:
            text = prefix + text
        lp = self.logprobs_block(items, offset, echo_now) if self.num_logprobs is not None else None
        usage = None if self.include_usage() else msgspec.UNSET
        kv = self.kv_transfer_params if final else msgspec.UNSET
        plp = self.vllm_prompt_logprobs() if not c.started else msgspec.UNSET
        return [msgspec.json.encode(P.CompletionResponse(
            self.id, self.created, self.model, [P.CompletionChoice(c.index, text, lp, finish_reason, plp)],
            usage=usage, kv_transfer_params=kv))]

    def full_response(self) -> bytes:
        echo = self.req.echo
        plp = self.vllm_prompt_logprobs()
        choices = []
        for c in self.choices:
            lp = self.logprobs_block(c.logprobs, 0, echo) if self.num_logprobs is not None else None
            text = self.echo_text() + c.text if echo else c.text
            choices.append(P.CompletionChoice(c.index, text, lp, c.finish_reason, plp))
        return msgspec.json.encode(P.CompletionResponse(
            self.id, self.created, self.model, choices, usage=self.usage(), kv_transfer_params=self.kv_transfer_params))

    def stream_end(self) -> list[bytes]:
        if not self.include_usage():
            return []
        return [msgspec.json.encode(P.CompletionResponse(self.id, self.created, self.model, [],
                                                         usage=self.usage()))]


class ChatRenderer(RequestRenderer):
    """Chat JSON / chunks. Each choice's text goes through the reasoning parser (with
    --reasoning-parser; atomd/api/reasoning.py): `<think>` text becomes `reasoning_content`;
    then, with tools (tool_choice not none), the rest through the tool-call parser
    (atomd/api/tool_parsers.py): calls become `tool_calls` (streamed as OpenAI's deltas: the
    call's id, type and name with empty arguments, then its arguments) and `finish_reason`
    "tool_calls"; the rest is `content`, the same streamed or not."""

    opens_early = True

    def __init__(self, server: Server, request_id: str, req, checked: P.Checked, prompt_ids: list[int]):
        super().__init__(server, request_id, req, checked, prompt_ids)
        self.tool_parser = TOOL_CALL_PARSERS[server.args.tool_call_parser] if checked.parse_tool_calls else None
        self.tool_parsers = [self.tool_parser() for _ in self.choices] if self.tool_parser else None
        # messages carry reasoning_content (maybe null) whenever the server parses reasoning
        self.reasoning_field = None if server.args.reasoning_parser else msgspec.UNSET
        self.reasoning = server.args.reasoning_parser if not checked.forced_tool_call else None  # output: the call
        self.constrained = checked.structured_outputs is not None
        # the template opened <think> itself (Qwen3-Thinking, DeepSeek-R1): a few tokens hold the tag
        self.prompt_opened = bool(self.reasoning) and prompt_opens_reasoning(
            server.tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False))
        self.reasoning_parsers = [self.new_reasoning_parser() for _ in self.choices] if self.reasoning else None

    def new_reasoning_parser(self) -> ReasoningParser:
        return ReasoningParser.for_request(self.reasoning, self.constrained, self.prompt_opened)

    def tool_finish_reason(self, reason: str | None, num_calls: int) -> str | None:
        return "tool_calls" if num_calls and reason == "stop" else reason

    def logprobs_block(self, items: list[tuple[int, dict]]) -> P.ChatLogprobs:
        def entry_of(tid: int, lp: float) -> tuple[str, float, list[int]]:
            text = self.token_text(tid)
            return text, lp, list(text.encode("utf-8"))

        content = []
        for tid, entry in items:
            tops = [P.TopLogprob(*entry_of(t, lp)) for t, lp in (entry.get("top") or [])]
            content.append(P.TokenLogprob(*entry_of(tid, entry["logprob"]), top_logprobs=tops))
        return P.ChatLogprobs(content)

    def chunk_of(self, index: int, delta: P.ChatDelta, items, finish_reason, **extra) -> bytes:
        lp = self.logprobs_block(items) if self.num_logprobs is not None and items else None
        usage = None if self.include_usage() else msgspec.UNSET
        return msgspec.json.encode(P.ChatCompletionChunk(
            self.id, self.created, self.model, [P.ChatChunkChoice(index, delta, lp, finish_reason)],
            usage=usage, **extra))

    def chunks(self, c: Choice, text: str, items, finish_reason, final: bool) -> list[bytes]:
        out = []
        if not c.started:  # OpenAI: each choice opens with the role
            first = not any(o.started for o in self.choices)
            plp = self.vllm_prompt_logprobs() if first else msgspec.UNSET
            out.append(self.chunk_of(c.index, P.ChatDelta(role="assistant", content=""), [], None,
                                     prompt_logprobs=plp))
            if not (text or items or finish_reason or final):
                return out
        kv = self.kv_transfer_params if final else msgspec.UNSET
        if self.tool_parsers is None and self.reasoning_parsers is None:
            out.append(self.chunk_of(c.index, P.ChatDelta(content=text), items, finish_reason, kv_transfer_params=kv))
            return out
        deltas, num_calls = self.parsed_deltas(c, text)
        if not deltas:
            if not (items or finish_reason is not None or kv is not msgspec.UNSET):
                return out
            deltas.append(P.ChatDelta(content=""))
        reason = self.tool_finish_reason(finish_reason, num_calls)
        return out + [self.chunk_of(c.index, d, items if j == 0 else [], reason if j == len(deltas) - 1 else None,
                                    **({"kv_transfer_params": kv} if j == len(deltas) - 1 else {}))
                      for j, d in enumerate(deltas)]

    def parsed_deltas(self, c: Choice, text: str) -> tuple[list[P.ChatDelta], int]:
        """A choice's new text through its parsers: the deltas to send (reasoning and content
        in one, then each completed call as two) and the choice's calls so far."""
        reasoning = ""
        if self.reasoning_parsers is not None:
            parser = self.reasoning_parsers[c.index]
            reasoning, text = parser.stream(text)
            if c.finished:
                more_reasoning, more_text = parser.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        calls, num_calls = [], 0
        if self.tool_parsers is not None:
            tools = self.tool_parsers[c.index]
            first_call = tools.num_calls
            text, calls = tools.stream(text)
            if c.finished:
                text += tools.finish()[0]
            calls, num_calls = list(enumerate(calls, start=first_call)), tools.num_calls
        deltas = [P.ChatDelta(content=text or None, reasoning_content=reasoning or None)] if text or reasoning else []
        for k, call in calls:
            fn = call["function"]
            deltas.append(P.ChatDelta(tool_calls=[{"index": k, "id": call["id"], "type": "function",
                                                   "function": {"name": fn["name"], "arguments": ""}}]))
            deltas.append(P.ChatDelta(tool_calls=[{"index": k, "function": {"arguments": fn["arguments"]}}]))
        return deltas, num_calls

    def message(self, c: Choice) -> tuple[P.ChatMessageOut, str | None]:
        if self.tool_parsers is None and self.reasoning_parsers is None:
            return P.ChatMessageOut("assistant", c.text), c.finish_reason
        reasoning, content = self.reasoning_field, c.text
        if self.reasoning_parsers is not None:
            reasoning, content = self.new_reasoning_parser().parse(c.text)
        calls = []
        if self.tool_parser is not None:
            content, calls = self.tool_parser.parse(content or "")
        return (P.ChatMessageOut("assistant", content, tool_calls=calls or msgspec.UNSET, reasoning_content=reasoning),
                self.tool_finish_reason(c.finish_reason, len(calls)))

    def full_response(self) -> bytes:
        choices = []
        for c in self.choices:
            message, reason = self.message(c)
            choices.append(P.ChatChoice(c.index, message, self.logprobs_block(c.logprobs)
                                        if self.num_logprobs is not None else None, reason))
        return msgspec.json.encode(P.ChatCompletionResponse(
            self.id, self.created, self.model, choices, usage=self.usage(),
            kv_transfer_params=self.kv_transfer_params, prompt_logprobs=self.vllm_prompt_logprobs()))

    def stream_end(self) -> list[bytes]:
        if not self.include_usage():
            return []
        return [msgspec.json.encode(P.ChatCompletionChunk(self.id, self.created, self.model, [],
                                                          usage=self.usage()))]
