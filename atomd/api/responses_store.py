"""Stored responses of /v1/responses, and what reads them: `GET /v1/responses/{id}`,
`DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`, background mode
(`background: true`) and `POST /v1/responses/{id}/cancel`.

The store is in memory, per engine, bounded (`--max-stored-responses`, the oldest finished
one evicted first; a background response still running is never evicted). Each entry keeps
the response object as the client sees it, the conversation for `previous_response_id` (its
input after expansion, without instructions, and its output; only once it completed) and its
input items (this request's `input` as OpenAI's items, with ids). `store: false` keeps a
response out of it: such a response is not retrievable.

Background: the request is checked and tokenized as any, handed to the engine, and answered
at once with the response `queued`; the generation runs on in a task here, which makes it
`in_progress` at its first output and `completed` / `incomplete` at its end (`failed` with an
`error` when the engine refuses it or dies). Cancel aborts the engine request (its KV blocks
are freed) and leaves it `cancelled`; cancelling a cancelled one answers it again, a finished
one is a 400. At most `--max-background-responses` run at once per engine (a 429 past it).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import uuid
from typing import Any

from aiohttp import web

from atomd.api import protocol
from atomd.api.http import json_response

logger = logging.getLogger("atomd.api.responses")

RUNNING = ("queued", "in_progress")
MAX_LIST_LIMIT = 100  # input_items' `limit`, as OpenAI


class StoredResponse:
    __slots__ = ("body", "conversation", "input_items", "task")

    def __init__(self, body: dict[str, Any], conversation: list[protocol.ChatMessage] | None,
                 input_items: list[dict[str, Any]]):
        self.body = body
        self.conversation = conversation  # None until it completed
        self.input_items = input_items
        self.task: asyncio.Task | None = None  # a background generation still running


def not_found(response_id: str, capacity: int) -> protocol.APIError:
    return protocol.APIError(404, f"response {response_id!r} not found (never stored, stored with store=false or "
                                  f"by another engine, deleted, or evicted: this engine keeps the last {capacity})",
                             code="response_not_found")


class ResponseStore:
    """Stored responses by id: at most `capacity` finished ones, the oldest evicted first."""

    def __init__(self, capacity: int, max_background: int = 0):
        self.capacity = capacity
        self.max_background = max_background
        self.items: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self.items[response_id] = entry
        self.items.move_to_end(response_id)
        while len(self.items) > self.capacity:
            victim = next((k for k, v in self.items.items() if v.task is None), None)
            if victim is None:  # only running background responses: they stay
                break
            del self.items[victim]

    def completed(self, response_id: str, body: dict[str, Any], conversation: list[protocol.ChatMessage],
                  input_items: list[dict[str, Any]]) -> None:
        """A response finished: its background entry takes the result, else a new entry."""
        entry = self.items.get(response_id)
        if entry is not None and entry.task is not None:
            entry.body, entry.conversation = body, conversation
        else:
            self.put(response_id, StoredResponse(body, conversation, input_items))

    def find(self, response_id: str) -> StoredResponse:
        entry = self.items.get(response_id)
        if entry is None:
            raise not_found(response_id, self.capacity)
        return entry

    def get(self, response_id: str) -> list[protocol.ChatMessage]:
        """The conversation a `previous_response_id` continues."""
        entry = self.items.get(response_id)
        if entry is None:
            raise protocol.APIError(404, f"previous response {response_id!r} not found (never stored, stored by "
                                         f"another engine, or evicted: this engine keeps the last {self.capacity})",
                                    param="previous_response_id", code="previous_response_not_found")
        if entry.conversation is None:
            raise protocol.APIError(400, f"previous response {response_id!r} is {entry.body['status']}; only a "
                                         "completed response can be continued", param="previous_response_id",
                                    code="previous_response_not_completed")
        return entry.conversation

    def running(self) -> int:
        return sum(1 for v in self.items.values() if v.task is not None)


def input_items(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's `input` (already checked by input_messages) as OpenAI's input items, with ids."""
    def text_parts(content: Any, kind: str) -> list[dict[str, Any]]:
        if isinstance(content, str):
            content = [{"text": content}]
        return [{"type": kind, "text": p["text"], **({"annotations": []} if kind == "output_text" else {})}
                for p in content]

    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    out = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = item["role"]
            out.append({"type": "message", "id": item.get("id") or f"msg_{uuid.uuid4().hex}", "role": role,
                        "status": "completed", "content": text_parts(
                            item["content"], "output_text" if role == "assistant" else "input_text")})
        elif kind == "function_call":
            out.append({"type": "function_call", "id": item.get("id") or f"fc_{uuid.uuid4().hex}",
                        "call_id": item["call_id"], "name": item["name"], "arguments": item["arguments"],
                        "status": "completed"})
        elif kind == "function_call_output":
            out.append({"type": "function_call_output", "id": item.get("id") or f"fco_{uuid.uuid4().hex}",
                        "call_id": item["call_id"], "output": item["output"], "status": "completed"})
        else:  # reasoning: as sent
            out.append(dict(item, id=item.get("id") or f"rs_{uuid.uuid4().hex}", summary=item.get("summary") or []))
    return out


def page(items: list[dict[str, Any]], query: Any) -> dict[str, Any]:
    """OpenAI's list of input items: `order` (desc, the default, or asc), `after` (an item id),
    `limit` (1..100, default 20)."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise protocol.invalid("order", "order must be asc or desc")
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        raise protocol.invalid("limit", "limit must be an integer") from None
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise protocol.invalid("limit", f"limit must be in [1, {MAX_LIST_LIMIT}], got {limit}")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        at = next((i for i, item in enumerate(ordered) if item["id"] == after), None)
        if at is None:
            raise protocol.invalid("after", f"no input item {after!r} in this response")
        ordered = ordered[at + 1:]
    data = ordered[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ordered) > limit}


async def run_background(server: Any, out: Any, stream: Any, params: Any, entry: StoredResponse) -> None:
    """A background response's generation (see the module doc); `out` its ResponsesRenderer."""
    from atomd.api.core_client import EngineDeadError  # no cycle: core_client does not import this

    try:
        batch = await stream.next_batch()
        if batch[0].error is not None:
            raise server.engine_error(batch[0], out.req, params)
        entry.body["status"] = "in_progress"
        while True:
            out.add(batch)
            if out.finished:
                break
            batch = await stream.next_batch()
        out.full_response()  # the finished body goes into the entry (ResponsesRenderer.remember)
    except asyncio.CancelledError:
        entry.body["status"] = "cancelled"
    except protocol.APIError as e:
        entry.body.update(status="failed", error={
            "code": "invalid_prompt" if e.status == 400 else "server_error", "message": e.message})
    except EngineDeadError as e:
        entry.body.update(status="failed", error={"code": "server_error", "message": f"engine is not available: {e}"})
    except Exception:  # a bug: the response says failed, the log has the trace
        logger.exception("background response %s failed", out.id)
        entry.body.update(status="failed", error={"code": "server_error", "message": "internal error"})
    finally:
        server.client.abort(out.id)  # no-op once finished; frees the blocks of a cancelled one
        entry.task = None


def start_background(server: Any, request: web.Request, store: ResponseStore, out: Any, chat: Any, checked: Any,
                     ids: list[int], params: Any) -> web.Response:
    """Hand the request to the engine and answer it `queued` (see the module doc)."""
    rreq = out.rreq
    if not rreq.store or store.capacity <= 0:
        raise protocol.invalid("background", "background needs store: true (and --max-stored-responses > 0): the "
                                             "result is read back with GET /v1/responses/{id}")
    if rreq.stream:
        raise protocol.APIError(400, "background with stream is not supported; poll GET /v1/responses/{id}",
                                param="background", code="unsupported_field")
    if store.running() >= store.max_background:
        raise protocol.APIError(429, f"{store.max_background} background responses are running on this engine "
                                     "(--max-background-responses); retry later", type="rate_limit_error",
                                param="background", code="too_many_background_responses")
    old = store.items.get(out.id)
    if old is not None and old.task is not None:
        raise protocol.invalid("request_id", f"response {out.id!r} is still running")
    stream = server.client.add_request(out.id, ids, params, checked.kv_transfer_params,
                                       dp_rank=server.requested_dp_rank(request, chat),
                                       lora_name=server.loras.of(chat.model, server.model_name))
    entry = StoredResponse(dict(out.response("in_progress", []), status="queued"), None, out.input_items)
    store.put(out.id, entry)
    entry.task = asyncio.get_running_loop().create_task(run_background(server, out, stream, params, entry))
    return json_response(entry.body)


def add_routes(app: web.Application, server: Any, store: ResponseStore) -> None:
    def entry_of(request: web.Request) -> StoredResponse:
        server.require_engine()
        return store.find(request.match_info["response_id"])

    async def retrieve(request: web.Request) -> web.Response:
        entry = entry_of(request)
        if request.query.get("stream", "false") not in ("false", "False"):
            raise protocol.APIError(400, "stream: a stored response is read whole here", param="stream",
                                    code="unsupported_field")
        return json_response(entry.body)

    async def delete(request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        entry = entry_of(request)
        if entry.task is not None:
            entry.task.cancel()  # its engine request is aborted on the way out
        store.items.pop(response_id, None)
        return json_response({"id": response_id, "object": "response.deleted", "deleted": True})

    async def cancel(request: web.Request) -> web.Response:
        entry = entry_of(request)
        if entry.task is not None:
            task = entry.task
            task.cancel()
            await asyncio.wait([task])  # cancelled, its engine request aborted
        elif entry.body["status"] != "cancelled":
            raise protocol.APIError(400, f"response {request.match_info['response_id']!r} is "
                                         f"{entry.body['status']}: only a queued or in-progress background response "
                                         "can be cancelled", code="response_not_cancellable")
        return json_response(entry.body)

    async def list_input_items(request: web.Request) -> web.Response:
        return json_response(page(entry_of(request).input_items, request.query))

    async def cancel_running(app: web.Application) -> None:
        """Shutdown: running background responses abort their engine requests (the core still runs)."""
        tasks = [e.task for e in store.items.values() if e.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)

    app.on_shutdown.append(cancel_running)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_delete("/v1/responses/{response_id}", delete)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel)
    app.router.add_get("/v1/responses/{response_id}/input_items", list_input_items)
