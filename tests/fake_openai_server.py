"""A stand-in OpenAI server for the `atomd bench` tests: it streams one token per SSE chunk
with a controllable delay, reports usage, and fails on purpose when asked.

    python -m tests.fake_openai_server --port P [--ttft-ms 20] [--token-delay-ms 2]
        [--fail-every K] [--error-event-every K]

Prompt tokens are counted as token ids (a list prompt) or as words (text), so a test can
compute the expected usage by hand. GET /stats returns how many generation requests arrived,
how many asked for ignore_eos, and the most that were in flight at once.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web

MODEL = "fake-model"


class FakeServer:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.requests = self.ignore_eos = 0
        self.inflight = self.max_inflight = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/stats", self.stats)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response({"requests": self.requests, "max_inflight": self.max_inflight,
                                  "ignore_eos": self.ignore_eos})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests += 1
        self.ignore_eos += body.get("ignore_eos") is True
        n = self.requests
        if self.args.fail_every and n % self.args.fail_every == 0:
            return web.json_response({"error": {"message": "injected failure", "type": "server_error"}},
                                     status=500)
        if not body.get("stream"):
            return web.json_response({"error": {"message": "this fake only streams"}}, status=400)
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            return await self.stream(request, body, n)
        finally:
            self.inflight -= 1

    async def stream(self, request: web.Request, body: dict, n: int) -> web.StreamResponse:
        chat = request.path.endswith("chat/completions")
        if chat:
            prompt_tokens = sum(len(str(m.get("content") or "").split()) for m in body["messages"])
            max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        else:
            prompt = body["prompt"]
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            max_tokens = body.get("max_tokens") or 16
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        created = int(time.time())

        async def send(choices: list, usage=None) -> None:
            obj = {"id": f"req-{n}", "created": created, "model": MODEL, "choices": choices}
            if usage is not None:
                obj["usage"] = usage
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        def choice(text: str, finish=None) -> dict:
            if chat:
                return {"index": 0, "delta": {"content": text}, "finish_reason": finish}
            return {"index": 0, "text": text, "finish_reason": finish}

        if chat:
            await send([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        await asyncio.sleep(self.args.ttft_ms / 1000)
        for i in range(max_tokens):
            if i:
                await asyncio.sleep(self.args.token_delay_ms / 1000)
            if i == 2 and self.args.error_event_every and n % self.args.error_event_every == 0:
                await resp.write(b'data: {"error": {"message": "injected stream error"}}\n\n')
                break
            await send([choice(f"t{i} ", "length" if i == max_tokens - 1 else None)])
        else:
            if (body.get("stream_options") or {}).get("include_usage"):
                await send([], {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                                "total_tokens": prompt_tokens + max_tokens})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument("--token-delay-ms", type=float, default=2.0)
    p.add_argument("--fail-every", type=int, default=0, help="answer every Kth request with HTTP 500")
    p.add_argument("--error-event-every", type=int, default=0,
                   help="end every Kth stream with an SSE error event after two tokens")
    args = p.parse_args()
    web.run_app(FakeServer(args).app(), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
