"""Several prompts in one `/v1/completions` request (OpenAI's batch form, as vLLM serves it):
each prompt is its own engine request (its own `n` choices), the answer one completion whose
choices are indexed prompt-major (prompt i's choice j is `i * n + j`), usage summed over the
prompts. Streamed, the prompts' chunks go out interleaved in the order the engine produced
them, each with its index; the usage chunk (`stream_options.include_usage`) once, at the end.

As for one prompt, the answer starts only once every prompt's first output arrived, so a
prompt the engine refuses (unschedulable, too long) makes the whole request a plain JSON
error, and every prompt's engine request is aborted when the request ends (a client gone,
an error), which frees its blocks. The router splits such a request the same way
(router/multi_prompt.py), so in PD each prompt takes its own two legs.
"""
from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from aiohttp import web

from atomd.api import protocol, responses
from atomd.api.core_client import EngineDeadError
from atomd.api.http import SSE_HEADERS, sse
from atomd.api.renderers import CompletionRenderer

_END = object()  # a prompt's pump has no more chunks


def summed_usage(outs: list[CompletionRenderer]) -> responses.Usage:
    usages = [o.usage() for o in outs]
    prompt, completion = sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    return responses.Usage(prompt, completion, prompt + completion, responses.PromptTokensDetails(cached))


async def generate(server: Any, request: web.Request, request_id: str, req: protocol.CompletionRequest,
                   checked, prompts: list) -> web.StreamResponse:
    """`server`: atomd/api/server.py's Server (not imported: it imports this module).
    `prompts`: [(token ids, SamplingParams, prompt as sent)], one per prompt, in order."""
    rank = server.requested_dp_rank(request, req)
    outs: list[CompletionRenderer] = []
    streams = []
    try:
        for i, (ids, params, prompt) in enumerate(prompts):
            out = CompletionRenderer(server, request_id, req, checked, ids, prompt if isinstance(prompt, str) else None)
            out.index_base = i * req.n
            outs.append(out)
            streams.append(server.client.add_request(f"{request_id}-{i}", ids, params, None, dp_rank=rank))
        firsts = []
        for (_, params, _), stream in zip(prompts, streams):
            first = await stream.next_batch()
            if first[0].error is not None:
                raise server.engine_error(first[0], req, params)
            firsts.append(first)
        if req.stream:
            return await stream_response(request, outs, streams, firsts)
        merged = None
        for out, stream, batch in zip(outs, streams, firsts):
            while True:
                out.add(batch)
                if out.finished:
                    break
                batch = await stream.next_batch()
            part = out.response()
            merged = part if merged is None else msgspec.structs.replace(merged, choices=merged.choices + part.choices)
        merged = msgspec.structs.replace(merged, usage=summed_usage(outs), kv_transfer_params=None)
        return web.Response(body=msgspec.json.encode(merged), content_type="application/json")
    finally:
        for i in range(len(streams)):
            server.client.abort(f"{request_id}-{i}")  # no-op once finished


async def pump(out: CompletionRenderer, stream, batch, queue: asyncio.Queue) -> None:
    """One prompt's chunks onto the shared queue, then _END (or the engine's death)."""
    try:
        while True:
            for chunk in out.add(batch):
                queue.put_nowait(chunk)
            if out.finished:
                break
            batch = await stream.next_batch()
        queue.put_nowait(_END)
    except EngineDeadError as e:
        queue.put_nowait(e)


async def stream_response(request: web.Request, outs: list[CompletionRenderer], streams, firsts) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    pumps = [loop.create_task(pump(out, stream, first, queue)) for out, stream, first in zip(outs, streams, firsts)]
    try:
        running = len(pumps)
        while running:
            item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, EngineDeadError):
                err = protocol.APIError(503, f"engine is not available: {item}", type="service_unavailable",
                                        code="engine_dead")
                await resp.write(sse(err.body()) + b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
            else:
                await resp.write(sse(item))
        if outs[0].include_usage():
            head = outs[0]
            await resp.write(sse(msgspec.json.encode(responses.CompletionResponse(
                head.id, head.created, head.model, [], usage=summed_usage(outs)))))
        await resp.write(b"data: [DONE]\n\n")
    except ConnectionResetError:  # the client went away mid-stream; generate() aborts
        request["client_gone"] = True
        return resp
    finally:
        for task in pumps:
            task.cancel()
    await resp.write_eof()
    return resp
