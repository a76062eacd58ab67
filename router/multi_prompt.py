"""Several prompts in one `/v1/completions` request (OpenAI's batch form) through the router:
each prompt is its own relayed request (router/pd.py: in PD its own two legs, with its own
transfer), run concurrently, and their answers are merged as the engines merge them
(atomd/api/multi_prompt.py): choices indexed prompt-major (prompt i's choice j is
`i * n + j`), usage summed, streamed chunks interleaved as they arrive, one usage chunk and
one `[DONE]` at the end.

Each prompt's relay writes into a `PartResponse` (the slice of router/http.py's Response it
uses). The client's answer starts once every prompt's answer started, so a prompt an engine
refuses (a 4xx, a failed leg) makes the whole request that error, and the other prompts'
relays are cancelled (which aborts their legs as a client hanging up does). A prompt that
fails after the client's stream began gets its error event in the stream; the others go on.
"""
from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from router.http import Request, Response
from router.pd import PDRelay, PDRequest, request_id_of
from router.sse_relay import DONE_EVENT, ERROR_EVENT_PREFIX, SSE_HEADERS

_encode, _decode = msgspec.json.encode, msgspec.json.decode


def several_prompts(body: dict) -> list[Any] | None:
    """The prompts of a completions body that holds more than one (strings or token-id
    lists), else None (one prompt, or a malformed one the engine judges)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        return prompt
    return None


class PartResponse:
    """What one prompt's relay writes to, in router/http.py Response's shape."""

    __slots__ = ("merge", "index", "status", "started", "finished", "body", "content_type")

    def __init__(self, merge: "MultiPrompt", index: int):
        self.merge, self.index = merge, index
        self.status = 0
        self.started = self.finished = False
        self.body = b""
        self.content_type = b"application/json"

    @property
    def prepared(self) -> bool:
        return self.started

    @property
    def paused(self) -> bool:  # the client's flow control holds every prompt's relay
        return self.merge.resp.paused

    async def drain(self) -> None:
        await self.merge.resp.drain()

    def send(self, status: int, body: bytes = b"", content_type: bytes = b"application/json",
             headers: bytes = b"") -> None:
        self.started = self.finished = True
        self.status, self.body, self.content_type = status, body, content_type
        self.merge.part_answered(self)

    def start_stream(self, status: int = 200, headers: bytes = b"", first: bytes = b"") -> None:
        self.started, self.status = True, status
        self.merge.part_events(self, first)

    def write(self, data: bytes) -> None:
        self.merge.part_events(self, data)

    def end(self, data: bytes = b"") -> None:
        if not self.finished:
            self.finished = True
            self.merge.part_events(self, data)


class MultiPrompt:
    """One client request of several prompts: their relays, and the merged answer."""

    def __init__(self, relay: PDRelay, req: Request, resp: Response, body: dict, prompts: list[Any]):
        self.relay, self.req, self.resp = relay, req, resp
        n = body.get("n", 1)
        self.n = n if type(n) is int and n > 0 else 1  # a bad n: every engine refuses it anyway
        self.stream = body.get("stream") is True
        if "kv_transfer_params" in body:  # only the router writes those (as PDRelay.handle)
            relay.metrics.client_kv_params_dropped += 1
        base = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        self.bodies = [dict(base, prompt=p) for p in prompts]
        self.parts = [PartResponse(self, i) for i in range(len(prompts))]
        self.pending: list[list[bytes]] = [[] for _ in prompts]  # events held until every prompt started
        self.usage: list[dict | None] = [None] * len(prompts)
        self.head: dict | None = None  # id, created, model of the first chunk (for the usage chunk)
        self.tasks: list[asyncio.Task] = []
        rid = request_id_of(req)
        req.headers["x-request-id"] = rid  # every prompt's legs carry the client's request id
        self.echo = b"X-Request-Id: " + rid.encode() + b"\r\n"

    async def run(self, endpoint: str) -> None:
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(PDRequest(self.relay, self.req, part, endpoint, body, _encode(body)).run())
                      for part, body in zip(self.parts, self.bodies)]
        try:
            await asyncio.gather(*self.tasks, return_exceptions=True)
        finally:
            for task in self.tasks:
                task.cancel()  # the client went away: every prompt's legs end with it
        if self.resp.started:
            if self.stream:
                self.finish_stream()
            return
        failed = next((p for p in self.parts if p.status != 200), None)
        if failed is not None:
            self.resp.send(failed.status, failed.body, failed.content_type, self.echo)
            return
        self.send_merged()

    # ---------------------------------------------------------------- a prompt's answer

    def part_answered(self, part: PartResponse) -> None:
        """A whole answer (JSON): an error before the client's answer started is the answer."""
        if self.resp.finished:
            return
        if part.status == 200 and not self.stream:
            return  # merged once all are in
        if not self.resp.started:
            self.resp.send(part.status, part.body, part.content_type, self.echo)
            self.cancel_others(part)
        elif self.stream and not self.resp.finished:  # after the client's stream began: an error event
            self.resp.write(b"data: " + part.body.strip() + b"\n\n")

    def cancel_others(self, part: PartResponse) -> None:
        for i, task in enumerate(self.tasks):
            if i != part.index:
                task.cancel()

    def part_events(self, part: PartResponse, data: bytes) -> None:
        if self.resp.finished:  # another prompt's error was the answer; this relay is being cancelled
            return
        out = self.rewrite(part.index, data)
        if not self.resp.started:
            self.pending[part.index].append(out)
            if not all(p.started for p in self.parts):
                return
            self.resp.start_stream(200, SSE_HEADERS + self.echo, b"".join(b"".join(p) for p in self.pending))
            self.pending = []
        elif out:
            self.resp.write(out)

    def rewrite(self, index: int, data: bytes) -> bytes:
        """A prompt's complete events with its choice indices moved to its place; its usage
        chunk and [DONE] kept back (one of each closes the client's stream)."""
        out = []
        for event in data.replace(b"\r\n", b"\n").split(b"\n\n"):
            event = event.strip()
            if not event or event == DONE_EVENT:
                continue
            if event.startswith(ERROR_EVENT_PREFIX) or not event.startswith(b"data: "):
                out.append(event + b"\n\n")
                continue
            try:
                chunk = _decode(event[6:])
            except msgspec.DecodeError:
                out.append(event + b"\n\n")
                continue
            if isinstance(chunk, dict):
                self.head = self.head or chunk
                choices = chunk.get("choices")
                if choices == [] and chunk.get("usage"):
                    self.usage[index] = chunk["usage"]
                    continue
                for c in choices or ():
                    if isinstance(c, dict) and type(c.get("index")) is int:
                        c["index"] += index * self.n
            out.append(b"data: " + _encode(chunk) + b"\n\n")
        return b"".join(out)

    def finish_stream(self) -> None:
        if self.resp.finished:
            return
        tail = b""
        if any(u is not None for u in self.usage) and self.head is not None:
            usage = summed([u for u in self.usage if u is not None])
            tail = b"data: " + _encode({"id": self.head.get("id"), "object": "text_completion",
                                        "created": self.head.get("created"), "model": self.head.get("model"),
                                        "choices": [], "usage": usage}) + b"\n\n"
        self.resp.end(tail + DONE_EVENT + b"\n\n")

    def send_merged(self) -> None:
        merged: dict | None = None
        usages = []
        for part in self.parts:
            answer = _decode(part.body)  # relay_body checked it is a JSON object
            for c in answer.get("choices") or ():
                if isinstance(c, dict) and type(c.get("index")) is int:
                    c["index"] += part.index * self.n
            if answer.get("usage"):
                usages.append(answer["usage"])
            if merged is None:
                merged = answer
            else:
                merged["choices"] = (merged.get("choices") or []) + (answer.get("choices") or [])
        merged["usage"] = summed(usages)
        merged["kv_transfer_params"] = None
        self.resp.send(200, _encode(merged), b"application/json", self.echo)


def summed(usages: list[dict]) -> dict:
    prompt = sum(u.get("prompt_tokens") or 0 for u in usages)
    completion = sum(u.get("completion_tokens") or 0 for u in usages)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
