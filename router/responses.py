"""`/v1/responses` through the router: relayed like chat (router/pd.py: two legs in PD, P's
leg with `max_output_tokens=1` and `store: false`), with one addition for
`previous_response_id`.

A response's conversation is stored by the engine that rendered it (atomd/api/responses_api.py):
D in PD, the worker when colocated. So the router mints each response's id (vLLM's
`request_id` field; a client's own is kept), remembers which engine answered it (bounded,
oldest forgotten first), and sends a request continuing that response to that engine alone,
as one leg (D prefills it locally, the earlier turns likely in its prefix cache). An id this
router never relayed (or forgot) takes the usual legs; the engine that lacks it answers 404
`previous_response_not_found`.

The same memory serves `GET` / `DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`
and `GET /v1/responses/{id}/input_items` (router/app.py): relayed to the engine that stored
the response; an id the router does not know (another router replica relayed it, or this one
before a restart) is asked of each decode and colocated engine in turn, the first that has it
answers; none: a 404 `response_not_found`.
Background mode (`background: true`) in PD: P's leg runs as always (not in the background),
then D gets the request with the KV params and answers at once `queued`, generating on; so the
client's answer waits for the prompt's prefill on P, not for the output.
"""
from __future__ import annotations

import collections
import os

import msgspec

from router.errors import clip
from router.http import Request, Response
from router.pd import PDRelay, PDRequest
from router.policies import RouteRequest
from router.workers import Worker, WorkerRegistry

MAX_REMEMBERED = 1 << 16  # response ids -> engine URL (~100 bytes each)
RESPONSE = "/v1/responses/{response_id}"  # GET, DELETE; + /cancel (POST), /input_items (GET)


class ResponseAffinity:
    def __init__(self, capacity: int = MAX_REMEMBERED):
        self.capacity = capacity
        self.by_id: collections.OrderedDict[str, str] = collections.OrderedDict()

    def remember(self, response_id: str, url: str) -> None:
        self.by_id[response_id] = url
        self.by_id.move_to_end(response_id)
        while len(self.by_id) > self.capacity:
            self.by_id.popitem(last=False)

    def url_of(self, response_id: object) -> str | None:
        return self.by_id.get(response_id) if isinstance(response_id, str) else None

    def forget(self, response_id: str) -> None:
        self.by_id.pop(response_id, None)

    def worker_of(self, response_id: str, registry: WorkerRegistry) -> Worker | str:
        """The engine that stored the response, in rotation; else why not (an error code)."""
        url = self.url_of(response_id)
        if url is None:
            return "response_not_found"
        worker = next((w for w in registry.workers() if w.url == url and w.role in ("decode", "worker")), None)
        return worker if worker is not None and worker.available() else "response_engine_unavailable"

    def explain(self, response_id: str, code: str) -> str:
        if code == "response_not_found":
            return (f"response {clip(response_id)} not found on any decode or colocated engine in rotation "
                    "(never stored, store: false, deleted or evicted)")
        return f"the engine that stored response {clip(response_id)} ({self.by_id.get(response_id)}) is not in rotation"


def routing_view(body: dict) -> dict:
    """The request as the chat request an engine renders it as (atomd/api/responses_api.py
    to_chat: `instructions` a system message, `input` a user message or its items as messages,
    `reasoning.effort` the template's `reasoning_effort`), for the policies that read the prompt
    (kv_aware renders it with the chat template, as a chat request's). Only a guess at
    placement: whatever it cannot read it leaves out; the engine checks the request."""
    messages: list[dict] = []
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    for item in items if isinstance(items, list) else ():
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content")
            if isinstance(content, list):  # text parts
                content = "".join(t for p in content if isinstance(p, dict) and isinstance(t := p.get("text"), str))
            messages.append({"role": item.get("role"), "content": content if isinstance(content, str) else ""})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": _arguments(item.get("arguments"))}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "content": output if isinstance(output, str) else "",
                             "tool_call_id": item.get("call_id")})
    view = {k: v for k, v in body.items() if k not in ("input", "instructions")}
    view["messages"] = messages
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and isinstance(reasoning.get("effort"), str):
        view["chat_template_kwargs"] = {"reasoning_effort": reasoning["effort"]}
    return view


def _arguments(arguments: object) -> object:
    """A call's arguments as the template sees them: the JSON object decoded (as the engine does)."""
    if isinstance(arguments, str):
        try:
            decoded = msgspec.json.decode(arguments)
        except (msgspec.DecodeError, RecursionError):
            return arguments
        return decoded if isinstance(decoded, dict) else arguments
    return arguments


async def relay_response(relay: PDRelay, affinity: ResponseAffinity, req: Request, resp: Response, body: dict) -> None:
    if "kv_transfer_params" in body:  # only the router writes those (as PDRelay.handle)
        del body["kv_transfer_params"]
        relay.metrics.client_kv_params_dropped += 1
    if not isinstance(body.get("request_id"), str):
        body["request_id"] = "resp_" + os.urandom(16).hex()
    one = ResponseRequest(relay, req, resp, "responses", body, msgspec.json.encode(body))
    one.affinity = affinity
    one.route = RouteRequest(routing_view(body), req.headers, relay.tokenizer)  # placed by its chat prompt
    url = affinity.url_of(body.get("previous_response_id"))
    if url is not None:
        one.pinned = next((w for w in relay.registry.workers() if w.url == url and w.role in ("decode", "worker")
                           and w.available()), None)
    await one.run()


class ResponseRequest(PDRequest):
    """A /v1/responses request: the engine that answers it stores the response, so the router
    remembers which one before the answer reaches the client (whose next request may continue it
    the moment the last byte arrives)."""

    __slots__ = ("affinity",)

    def answered(self, worker: Worker) -> None:
        self.affinity.remember(self.body["request_id"], worker.url)
