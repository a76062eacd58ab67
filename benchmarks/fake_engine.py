"""A fake engine server for the router's tests and its overhead benchmark.

`FakeEngine` is an in-process aiohttp app that speaks the engine server's HTTP API
(docs/contracts.md "HTTP API of an engine server") in one role, and records what it was
sent: a prefill worker answers the `do_remote_decode` leg with an OpenAI body plus
top-level `kv_transfer_params`; a decode worker takes the original request plus those
params, "pulls" (records the transfer id; a test can hold requests with `gate`) and
streams SSE or returns a body. Knobs make it fail the ways a real engine fails.

It lives here, not under tests/, because benchmarks/router_overhead.py runs it too and
nothing outside tests/ imports tests/; tests/fake_workers.py builds the test harness
(an in-process router in front of these, on a background loop) on top of it.

`python -m benchmarks.fake_engine --prefill-port P --decode-port D [--tokens N]
[--token-delay-s S]` serves one of each in its own process (record off), for load tests.
"""
from __future__ import annotations

import argparse
import asyncio
import secrets
import time

import msgspec
from aiohttp import web

MODEL = "fake-model"
BLOCK_SIZE = 16


def prompt_words(body: dict) -> int:
    if "messages" in body:
        return sum(len(str(m.get("content", "")).split()) for m in body["messages"])
    return len(str(body.get("prompt", "")).split())


def error_json(message: str, type: str, param: str | None = None) -> bytes:
    return msgspec.json.encode({"error": {"message": message, "type": type, "param": param, "code": None}})


class FakeEngine:
    def __init__(self, role: str, tokens: tuple[str, ...] = ("Hello", ",", " world", "!"),
                 prefix_cache_hit_tokens: int = 16, record: bool = True):
        assert role in ("prefill", "decode")
        self.role = role
        self.tokens = tokens
        self.prefix_cache_hit_tokens = prefix_cache_hit_tokens
        self.record = record  # off in the benchmark: recording every body would be the bottleneck
        # knobs
        self.healthy = True  # GET /health
        self.loaded = True  # GET /ready (and only when healthy)
        self.fail_status: int | None = None
        self.fail_message = "engine exploded"
        self.die_after_events: int | None = None  # decode: drop the connection after N events
        self.bad_answer: bytes | None = None  # decode: answer 200 with these bytes instead
        self.keeps_kv = True  # prefill: False answers without kv_transfer_params (nothing pinned)
        self.kv_extra: dict = {}  # prefill: merged into the kv_transfer_params it answers
        self.drop_next = 0  # drop this many requests' connections without answering
        self.kv_info: dict | None = None  # GET /kv_transfer_info answers it (404 while None)
        self.token_delay_s = 0.0  # decode: pause between streamed events
        # what happened
        self.requests: list[tuple[str, dict]] = []
        self.authorizations: list[str | None] = []  # the Authorization header of each request
        self.request_ids: list[str | None] = []  # the X-Request-Id header of each request
        self.dp_ranks: list[str | None] = []  # the X-data-parallel-rank header of each request
        self.answers: list[bytes] = []  # the exact JSON bodies answered
        self.streams: list[bytes] = []  # decode: the exact bytes of each SSE response
        self.aborts: list[str] = []
        self.pulled: list[str] = []
        self.cancelled: list[str] = []
        self.health_checks = 0  # GET /health calls
        self.kv_info_authorizations: list[str | None] = []  # the Authorization of each GET /kv_transfer_info
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self, port: int = 0) -> str:
        self.gate = asyncio.Event()  # cleared: requests wait before the work (P: prefill, D: pull)
        self.gate.set()
        self.hold_after_first_event = asyncio.Event()  # cleared: stream pauses after one event
        self.hold_after_first_event.set()
        app = web.Application()
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_post("/v1/responses", self.generate)  # answered in chat's shape: the router relays bytes
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_post("/kv_transfer/abort", self.abort)
        app.router.add_get("/kv_transfer_info", self.kv_transfer_info)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ------------------------------------------------------------------ routes

    async def health(self, request: web.Request) -> web.Response:
        self.health_checks += 1
        return web.json_response({"status": "ok"} if self.healthy else {"status": "down"},
                                 status=200 if self.healthy else 503)

    async def ready(self, request: web.Request) -> web.Response:
        ok = self.healthy and self.loaded
        return web.json_response({"status": "ready" if ok else "loading"}, status=200 if ok else 503)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": MODEL, "object": "model", "created": 0, "owned_by": "atomd"}]})

    async def kv_transfer_info(self, request: web.Request) -> web.Response:
        self.kv_info_authorizations.append(request.headers.get("Authorization"))
        if self.kv_info is None:
            return web.Response(status=404)
        return web.json_response(self.kv_info)

    async def abort(self, request: web.Request) -> web.Response:
        self.aborts.append((await request.json())["transfer_id"])
        return web.json_response({"aborted": True})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = msgspec.json.decode(await request.read())
        if self.record:
            self.requests.append((request.path, body))
            self.authorizations.append(request.headers.get("Authorization"))
            self.request_ids.append(request.headers.get("X-Request-Id"))
            self.dp_ranks.append(request.headers.get("X-data-parallel-rank"))
        if self.drop_next > 0:
            self.drop_next -= 1
            request.transport.close()
            await asyncio.Event().wait()  # connection_lost cancels this handler
        if self.fail_status is not None:
            kind = "invalid_request_error" if self.fail_status < 500 else "internal_error"
            return web.Response(status=self.fail_status, body=error_json(self.fail_message, kind, "max_tokens"),
                                content_type="application/json")
        kv = body.get("kv_transfer_params") or {}
        tid = kv.get("transfer_id", "")
        try:
            await self.gate.wait()
            if self.role == "prefill":
                return self.prefill_answer(request.path, body)
            if self.record:
                self.pulled.append(tid)
            if self.bad_answer is not None:
                kind = "text/event-stream" if body.get("stream") else "application/json"
                return web.Response(body=self.bad_answer, content_type=kind)
            if body.get("stream"):
                return await self.stream(request, body, kv)
            return self.answer(self.full_answer(request.path, body, kv))
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled.append(tid)
            raise

    # ------------------------------------------------------------------ prefill

    def prefill_answer(self, path: str, body: dict) -> web.Response:
        kv_in = body.get("kv_transfer_params") or {}
        if not kv_in.get("do_remote_decode"):
            return web.Response(status=400, body=error_json("expected a prefill leg", "invalid_request_error"),
                                content_type="application/json")
        n = prompt_words(body)
        # vllm-router sends no transfer_id (P mints one then, as an atomd engine does)
        kv = {"do_remote_prefill": True, "transfer_id": kv_in.get("transfer_id") or secrets.token_hex(16),
              "remote_engine_id": f"127.0.0.1:{self.port + 1}", "remote_host": "127.0.0.1",
              "remote_port": self.port + 1, "remote_block_ids": list(range((n + BLOCK_SIZE - 1) // BLOCK_SIZE)),
              "num_prompt_tokens": n, "first_token_id": 42, "first_token_logprobs": None,
              "draft_token_ids": [], "prefix_cache_hit_tokens": self.prefix_cache_hit_tokens,
              "access_token": secrets.token_hex(16), "lease_s": 30.0,
              "compat": {"model": MODEL, "block_size": BLOCK_SIZE}, "dp_rank": 0, **self.kv_extra}
        usage = {"prompt_tokens": n, "completion_tokens": 1, "total_tokens": n + 1,
                 "prompt_tokens_details": {"cached_tokens": self.prefix_cache_hit_tokens}}
        if "messages" in path or "messages" in body:
            choice = {"index": 0, "message": {"role": "assistant", "content": self.tokens[0]},
                      "logprobs": None, "finish_reason": "length"}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": self.tokens[0], "logprobs": None, "finish_reason": "length"}
            obj = "text_completion"
        answer = {"id": "p-" + kv["transfer_id"], "object": obj, "created": int(time.time()), "model": MODEL,
                  "choices": [choice], "usage": usage, "kv_transfer_params": kv if self.keeps_kv else None}
        return self.answer(msgspec.json.encode(answer))

    def answer(self, data: bytes) -> web.Response:
        if self.record:
            self.answers.append(data)
        return web.Response(body=data, content_type="application/json")

    # ------------------------------------------------------------------ decode

    def usage(self, body: dict, kv: dict, completion_tokens: int) -> dict:
        n = kv.get("num_prompt_tokens", prompt_words(body))
        return {"prompt_tokens": n, "completion_tokens": completion_tokens, "total_tokens": n + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": kv.get("prefix_cache_hit_tokens", 0)}}

    def generated(self, body: dict) -> tuple[str, ...]:
        limit = body.get("max_completion_tokens", body.get("max_tokens", len(self.tokens)))
        return self.tokens[:limit]

    def full_answer(self, path: str, body: dict, kv: dict) -> bytes:
        toks = self.generated(body)
        text = "".join(toks)
        if path.endswith("chat/completions"):
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": "length"}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
            obj = "text_completion"
        return msgspec.json.encode({"id": "d-1", "object": obj, "created": int(time.time()), "model": MODEL,
                                    "choices": [choice], "usage": self.usage(body, kv, len(toks))})

    def events(self, path: str, body: dict, kv: dict) -> list[bytes]:
        toks = self.generated(body)
        chat = path.endswith("chat/completions")
        base = {"id": "d-1", "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": MODEL}
        chunks = [dict(base, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}])] if chat else []
        for i, tok in enumerate(toks):
            finish = "length" if i == len(toks) - 1 else None
            choice = ({"index": 0, "delta": {"content": tok}, "logprobs": None, "finish_reason": finish} if chat
                      else {"index": 0, "text": tok, "logprobs": None, "finish_reason": finish})
            chunks.append(dict(base, choices=[choice]))
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append(dict(base, choices=[], usage=self.usage(body, kv, len(toks))))
        return [b"data: " + msgspec.json.encode(c) + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]

    async def stream(self, request: web.Request, body: dict, kv: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        sent = bytearray()
        if self.record:
            self.streams.append(b"")
        for i, event in enumerate(self.events(request.path, body, kv)):
            if self.die_after_events is not None and i == self.die_after_events:
                request.transport.close()  # flushes what was written, then drops the connection
                await asyncio.Event().wait()  # connection_lost cancels this handler
            if self.token_delay_s and i:
                await asyncio.sleep(self.token_delay_s)
            await resp.write(event)
            sent += event
            if self.record:
                self.streams[-1] = bytes(sent)
            if i == 0:
                await self.hold_after_first_event.wait()
        await resp.write_eof()
        return resp


async def _serve(args) -> None:
    tokens = tuple(f" t{i}" for i in range(args.tokens))
    p, d = FakeEngine("prefill", tokens, record=False), FakeEngine("decode", tokens, record=False)
    d.token_delay_s = args.token_delay_s
    await p.start(args.prefill_port)
    await d.start(args.decode_port)
    print(f"fake engines ready: prefill {p.url}, decode {d.url}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    ap = argparse.ArgumentParser(description="a fake prefill and a fake decode engine on 127.0.0.1")
    ap.add_argument("--prefill-port", type=int, required=True)
    ap.add_argument("--decode-port", type=int, required=True)
    ap.add_argument("--tokens", type=int, default=8, help="events a stream carries (then [DONE])")
    ap.add_argument("--token-delay-s", type=float, default=0.0, help="pause between streamed events")
    args = ap.parse_args()
    try:
        import uvloop
        uvloop.run(_serve(args))
    except ImportError:
        asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
