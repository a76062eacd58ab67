"""`atomd serve`: an OpenAI-compatible HTTP server (aiohttp on uvloop) over an EngineCore.

This process owns HTTP, the tokenizer (prompt encoding, chat templates, incremental
detokenization, stop strings) and the metrics; the engine core process only sees token
ids (atomd/engine/core.py, reached through atomd/api/core_client.py). Routes:

  POST /v1/completions, /v1/chat/completions   JSON or SSE (`stream: true`)
  POST /v1/responses   OpenAI's Responses API over the chat pipeline (atomd/api/responses_api.py)
  POST /v1/embeddings  with --task embed: pooled hidden states (atomd/api/embeddings.py)
  GET  /v1/models
  POST /tokenize, /detokenize; GET /tokenizer_info   vLLM's shapes (atomd/api/tokenize.py)
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
import hmac
import json
import logging
import time
import uuid
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from atomd.api import chat_templates
from atomd.api import limits as L
from atomd.api import embeddings, multi_prompt, protocol, reasoning, responses, responses_api, tokenize, validation
from atomd.api.core_client import EngineClient, EngineDeadError, RequestStream, make_engine_client
from atomd.api.http import SSE_HEADERS, error_response, json_response, sse
from atomd.api.lora_routes import LORA_PATHS, LoraNames, engine_error
from atomd.api.metrics import ServerMetrics
from atomd.api.renderers import ChatRenderer, CompletionRenderer, RequestRenderer
from atomd.messages import RequestOutput
from contracts.errors import ErrorCode
from contracts.sampling import SamplingParams, check_in_vocabulary

logger = logging.getLogger("atomd.api.server")
access_logger = logging.getLogger("atomd.access")


READY_PROBE_TIMEOUT_S = 2.0




OPEN_PATHS = ("/health", "/ready", "/metrics", "/openapi.json")


PROBE_PATHS = ("/health", "/ready", "/metrics")  # not in the access log unless --access-log-probes


ADMIN_PATHS = ("/reset_prefix_cache", "/kv_transfer/abort", *LORA_PATHS)  # and everything under /debug/


RANK_HEADER = "X-data-parallel-rank"


PARSER_THREADS = 2  # requests parsed and tokenized at once (tokenizers drop the GIL)


ERROR_STATUS = {ErrorCode.INVALID_REQUEST: (400, "invalid_request_error"),
                ErrorCode.UNSCHEDULABLE: (400, "invalid_request_error"),
                ErrorCode.KV_TRANSFER_FAILED: (503, "service_unavailable"),
                ErrorCode.KV_PARAMS_UNTRUSTED: (403, "permission_error"),
                ErrorCode.MODEL_NOT_FOUND: (404, "not_found_error"),
                ErrorCode.LORA_LOAD_FAILED: (400, "invalid_request_error")}


def unschedulable_param(code: ErrorCode | None, req: Any, params: Any, max_num_seqs: int) -> str | None:
    """The field to blame for the scheduler's refusal: more choices than --max-num-seqs (best_of
    or n), else the prompt is too long (for the context or the KV pool)."""
    if code is not ErrorCode.UNSCHEDULABLE:
        return None
    if params.num_samples > max_num_seqs:
        return "best_of" if params.best_of is not None else "n"
    return "messages" if isinstance(req, protocol.ChatCompletionRequest) else "prompt"


def load_tokenizer(config: Any):
    """The engine's tokenizer, resolved like atomd.engine.engine_loop.resolve_model_dir (which this
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
        self.loras = LoraNames(config)  # the LoRA adapters a request's `model` may name
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
        app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        tokenize.add_routes(app, self)  # /tokenize, /detokenize, /tokenizer_info (vLLM's shapes)
        responses_api.add_routes(app, self)  # /v1/responses over the chat pipeline
        embeddings.add_routes(app, self)  # /v1/embeddings (with --task embed)
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

    async def stop(self, runner: web.AppRunner) -> None:
        """Stop serving: the core watchdog, the HTTP side, the engine core, the parser thread."""
        if self.watchdog is not None:
            self.watchdog.cancel()
        await runner.cleanup()
        await self.client.shutdown()
        self.parser.shutdown(wait=False)

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
        except protocol.APIError as e:
            return error_response(e)
        except EngineDeadError as e:
            return error_response(protocol.APIError(503, f"engine is not available: {e}",
                                             type="service_unavailable", code="engine_dead"))
        except web.HTTPRequestEntityTooLarge:
            return error_response(protocol.APIError(
                413, f"request body is larger than {self.args.max_request_body_bytes} bytes",
                code="request_too_large"))
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return error_response(protocol.APIError(e.status, e.reason, type="invalid_request_error"))
        except Exception:  # a bug: answer it in the API's error shape, keep serving
            # The trace goes to the log only: no stack, message or internal path in the body.
            logger.exception("unhandled error on %s %s (request %s)", request.method, request.path,
                             request.get("request_id"))
            return error_response(protocol.APIError(
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
            raise protocol.APIError(401, f"missing or invalid {which} (expected `Authorization: Bearer <key>`)",
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
            raise protocol.invalid("body", f"not JSON: {e}") from None
        transfer_id = body.get("transfer_id") if isinstance(body, dict) else None
        if not isinstance(transfer_id, str) or not transfer_id:
            raise protocol.invalid("transfer_id", "transfer_id must be a non-empty string")
        return json_response({"transfer_id": transfer_id,
                              "revoked": bool(await self.client.call("kv_transfer_abort", transfer_id))})

    async def openapi(self, request: web.Request) -> web.Response:
        """OpenAPI 3.1 from the structs that validate the bodies (atomd/api/openapi.py)."""
        from atomd import __version__
        from atomd.api.openapi import openapi_document

        return json_response(openapi_document(__version__))

    async def models(self, request: web.Request) -> web.Response:
        self.require_engine()
        card = responses.ModelCard(id=self.model_name, created=int(time.time()), max_model_len=self.max_model_len)
        return json_response(responses.ModelList([card, *self.loras.cards(self.model_name, self.max_model_len)]))

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's route: {"lora_name", "lora_path"} -> 200 text; every DP rank loads it."""
        self.require_engine()
        req = self.loras.parse(await self.read_request(request), self.model_name, load=True)
        error = engine_error(await self.client.call("load_lora_adapter", req.lora_name, req.lora_path, timeout_s=60.0))
        if error is not None:
            raise error
        self.loras.paths[req.lora_name] = req.lora_path
        return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """{"lora_name"}: new requests naming it get a 404; running ones finish under it."""
        self.require_engine()
        req = self.loras.parse(await self.read_request(request), self.model_name, load=False)
        self.loras.paths.pop(req.lora_name, None)  # before the engine: no new request races in
        error = engine_error(await self.client.call("unload_lora_adapter", req.lora_name))
        if error is not None:
            raise error
        return web.Response(text=f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    def require_engine(self) -> None:
        if self.client.dead is not None:
            raise EngineDeadError(self.client.dead)
        if not self.client.alive or self.tokenizer is None:
            raise protocol.APIError(503, "engine is loading", type="service_unavailable", code="engine_loading")

    # ------------------------------------------------------------ generation routes

    async def read_request(self, request: web.Request) -> bytes:
        self.require_engine()
        if request.content_length is not None and request.content_length > self.args.max_request_body_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=self.args.max_request_body_bytes,
                                                actual_size=request.content_length)
        return await request.read()

    def check_model(self, req) -> None:
        if not self.loras.enabled and req.model and req.model != self.model_name:
            raise protocol.APIError(404, f"model {req.model!r} does not exist; this server serves {self.model_name!r}",
                             param="model", code="model_not_found")
        self.loras.of(req.model, self.model_name)  # a 404 naming an adapter not loaded

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self.read_request(request)
        await self.loras.load_missing(body, self.model_name, self.client.call)  # --lora-load-policy load
        req, checked, prompts = await asyncio.get_running_loop().run_in_executor(
            self.parser, self.parse_completion, body)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if len(prompts) > 1:  # several prompts: each its own engine request (atomd/api/multi_prompt.py)
            return await multi_prompt.generate(self, request, request_id, req, checked, prompts)
        (ids, params, prompt), = prompts
        out = CompletionRenderer(self, request_id, req, checked, ids, prompt if isinstance(prompt, str) else None)
        return await self.generate(request, req, checked, ids, params, out)

    def parse_completion(self, body: bytes):
        """Body -> (request, checks, [(prompt ids, sampling params, prompt)] one per prompt): on a
        parser thread."""
        req = protocol.decode_request(body, protocol.CompletionRequest)
        self.check_model(req)
        checked = validation.validate_completion_request(req, self.limits)
        prompts = validation.prompt_inputs(req.prompt, self.limits.max_prompts)
        if len(prompts) > 1 and checked.kv_transfer_params is not None:
            raise protocol.invalid("kv_transfer_params", "kv_transfer_params go with one prompt per request")
        self.check_priority(req)
        parsed = []
        for prompt in prompts:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else self.check_token_ids(prompt)
            params = validation.sampling_params(req, self.max_tokens(ids, req.max_tokens, "max_tokens", 16), checked)
            self.check_vocabulary(params)
            parsed.append((ids, params, prompt))
        return req, checked, parsed

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self.read_request(request)
        await self.loras.load_missing(body, self.model_name, self.client.call)  # --lora-load-policy load
        req, checked, ids, params = await asyncio.get_running_loop().run_in_executor(
            self.parser, self.parse_chat, body)
        out = ChatRenderer(self, f"chatcmpl-{uuid.uuid4().hex}", req, checked, ids)
        return await self.generate(request, req, checked, ids, params, out)

    def parse_chat(self, body: bytes):
        """As parse_completion, for a chat request."""
        req = protocol.decode_request(body, protocol.ChatCompletionRequest)
        return (req, *self.prepare_chat(req))

    def prepare_chat(self, req: protocol.ChatCompletionRequest):
        """A decoded chat request -> (checks, prompt ids, sampling params); /v1/responses too."""
        self.check_model(req)
        checked = validation.validate_chat_request(req, self.limits, self.args.tool_call_parser)
        ids = chat_templates.prompt_ids(self.tokenizer, req, validation.chat_messages(req), checked.tools,
                                        self.args.trust_request_chat_template, self.limits.max_prompt_chars)
        requested, param = (req.max_completion_tokens, "max_completion_tokens") \
            if req.max_completion_tokens is not None else (req.max_tokens, "max_tokens")
        self.check_priority(req)
        if self.args.reasoning_parser and checked.structured_outputs is not None and not checked.forced_tool_call:
            checked.structured_outputs = reasoning.grammar_after_reasoning(  # the grammar waits for </think>
                self.tokenizer, self.args.reasoning_parser, checked.structured_outputs, ids)
        params = validation.sampling_params(req, self.max_tokens(ids, requested, param, None), checked)
        self.check_vocabulary(params)
        return checked, ids, params

    def check_priority(self, req) -> None:
        """As vLLM: a priority other than 0 needs --scheduling-policy priority."""
        if req.priority != 0 and self.config.scheduling_policy != "priority":
            raise protocol.invalid("priority", f"priority={req.priority} needs --scheduling-policy priority "
                                               "(this server schedules first come first served)")

    def check_token_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        try:
            check_in_vocabulary(param, ids, self.tokenizer.vocab_size)
        except ValueError as e:
            raise protocol.invalid(param, str(e)) from None
        return ids

    def check_vocabulary(self, params: SamplingParams) -> None:
        """A 400 here rather than the engine's refusal after the stream's headers."""
        try:
            params.check_vocabulary(self.tokenizer.vocab_size)
        except ValueError as e:  # the message starts with the field's name
            raise protocol.invalid(str(e).split(":", 1)[0], str(e)) from None

    def max_tokens(self, ids: list[int], requested: int | None, param: str, default: int | None) -> int:
        """The max_tokens the engine gets, or a 400 when the request cannot fit (see module doc)."""
        room = self.max_model_len - len(ids)
        if room < 0:
            return requested or default or 1  # the scheduler rejects it with its own message
        wanted = requested if requested is not None else (default if default is not None else room)
        if wanted > room or room == 0:
            raise protocol.invalid(param, (
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
                raise protocol.invalid("data_parallel_rank", f"{RANK_HEADER} must be an integer") from None
        here = self.config.local_dp_ranks
        if rank is not None and rank not in here:
            raise protocol.invalid("data_parallel_rank", f"data_parallel_rank must be in [{here.start}, {here.stop}) "
                                   f"(the DP ranks this server runs), got {rank}")
        return rank

    async def generate(self, request: web.Request, req, checked: validation.Checked, ids: list[int], params,
                       out: "RequestRenderer"):
        stream = self.client.add_request(out.id, ids, params, checked.kv_transfer_params,
                                         dp_rank=self.requested_dp_rank(request, req),
                                         lora_name=self.loras.of(req.model, self.model_name))
        try:
            first = await stream.next_batch()
            head = first[0]
            if head.error is not None:  # refused or rejected by the engine, or a failed KV pull
                raise self.engine_error(head, req, params)
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

    def engine_error(self, head: RequestOutput, req, params) -> protocol.APIError:
        """The answer to a request the engine refused or rejected, or whose KV pull failed."""
        status, kind = ERROR_STATUS.get(head.error_code, (500, "server_error"))
        code = head.error_code.value if head.error_code is not None else None
        return protocol.APIError(status, head.error, type=kind, code=code,
                                 param=unschedulable_param(head.error_code, req, params, self.config.max_num_seqs))

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
            err = protocol.APIError(503, f"engine is not available: {e}", type="service_unavailable",
                                    code="engine_dead")
            await resp.write(sse(err.body()) + b"data: [DONE]\n\n")  # as the router ends a broken stream
        await resp.write_eof()
        return resp


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["X-Request-Id"] = request.get("request_id", "")
