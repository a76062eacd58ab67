"""`POST /v1/embeddings` (OpenAI's shape, vLLM's extras `normalize`, `add_special_tokens`),
served by an engine started with `--task embed`.

Each input (a string, a list of token ids, or a list of several of either, at most
--max-prompts) is its own engine request that runs through the scheduler like any prompt
(batched with the others, chunked, preempted by recompute), with `SamplingParams.pooling`
set: the engine pools the final-normed hidden states of its prompt (`--pooling-type last`:
the last token's, the default, as for causal-LM embedders; `mean`: the mean over every
prompt token, which then takes no prefix-cache hit) and returns the vector on the request's
last output. The request samples one token on the way (the scheduler's normal end of a
prefill; discarded) and its blocks are freed at once. The vector is L2-normalised here unless
`normalize: false`, and sent as floats or (`encoding_format: base64`) as the base64 of its
little-endian float32 bytes, as OpenAI does. Each input counts in the `atomd:` request metrics
(request_success with reason stop, prompt_tokens, e2e latency and the engine's phase times).
"""
from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any, Literal

import msgspec
import numpy as np
from aiohttp import web

from atomd.api import protocol, validation
from atomd.api.http import json_response
from contracts.sampling import SamplingParams


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    input: str | list[Any]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # only a Matryoshka model could honour another size: none here
    user: str | None = None
    normalize: bool = True  # vLLM's
    add_special_tokens: bool = True  # vLLM's


class EmbeddingData(msgspec.Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
    object: str = "list"


def _as_input(e: protocol.APIError) -> protocol.APIError:
    if e.param is not None and e.param.startswith("prompt"):
        e.param = "input" + e.param[len("prompt"):]
        e.message = e.message.replace("prompt", "input")
    return e


def parse(server: Any, body: bytes) -> tuple[EmbeddingRequest, list[list[int]]]:
    """On a parser thread: the request and each input's token ids."""
    req = protocol.decode_request(body, EmbeddingRequest)
    server.check_model(req)
    if req.dimensions is not None:
        raise protocol.APIError(400, "dimensions: this model is not a Matryoshka model; its embeddings have one "
                                     "size (leave dimensions out)", param="dimensions", code="unsupported_field")
    limits = server.limits
    try:
        inputs = validation.prompt_inputs(req.input, limits.max_prompts)
        chars = sum(len(p) for p in inputs)
        if chars > limits.max_prompt_chars:
            raise validation.too_large("prompt", f"inputs of {chars} characters (or token ids)",
                                       limits.max_prompt_chars, "max-prompt-chars")
        out = []
        for i, p in enumerate(inputs):
            ids = server.tokenizer.encode(p, add_special_tokens=req.add_special_tokens) if isinstance(p, str) \
                else server.check_token_ids(p, "prompt")
            if not ids:
                raise protocol.invalid("prompt", f"input {i} has no tokens")
            if len(ids) + 1 > server.max_model_len:  # the prefill ends by sampling one token
                raise protocol.invalid("prompt", f"input {i} has {len(ids)} tokens; this model takes at most "
                                                 f"{server.max_model_len - 1} per input")
            out.append(ids)
    except protocol.APIError as e:
        raise _as_input(e) from None
    return req, out


def encode(vector: list[float], normalize: bool, encoding_format: str) -> list[float] | str:
    v = np.asarray(vector, dtype=np.float32)
    if normalize:
        norm = float(np.linalg.norm(v.astype(np.float64)))
        v = v / norm if norm > 0 else v
    if encoding_format == "base64":
        return base64.b64encode(v.astype("<f4").tobytes()).decode()
    return v.tolist()


def add_routes(app: web.Application, server: Any) -> None:
    """`server`: atomd/api/server.py's Server (not imported: it imports this module)."""

    async def create(request: web.Request) -> web.Response:
        body = await server.read_request(request)
        if server.args.task != "embed":
            raise protocol.APIError(400, "this server generates (--task generate); start it with --task embed to "
                                         "serve /v1/embeddings", code="embeddings_not_served")
        req, inputs = await asyncio.get_running_loop().run_in_executor(server.parser, parse, server, body)
        request_id = f"embd-{uuid.uuid4().hex}"
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=server.args.pooling_type)
        ids = [f"{request_id}-{i}" for i in range(len(inputs))]
        t0 = time.perf_counter()
        streams = [server.client.add_request(rid, tokens, params) for rid, tokens in zip(ids, inputs)]
        try:
            data = []
            for i, stream in enumerate(streams):
                while True:
                    last = (await stream.next_batch())[-1]
                    if last.error is not None:
                        raise _as_input(server.engine_error(last, req, params))
                    if last.finished:
                        break
                # an input is a finished request in atomd:request_success (reason stop, as vLLM's pooling
                # requests) and atomd:prompt_tokens; its one sampled token is no generation
                server.metrics.on_finished("stop", len(inputs[i]), time.perf_counter() - t0, last.timing)
                if last.embedding is None:  # an engine that did not pool (a bug: every runner pools)
                    raise protocol.APIError(500, "the engine returned no embedding", type="server_error",
                                            code="no_embedding")
                data.append(EmbeddingData(i, encode(last.embedding, req.normalize, req.encoding_format)))
        finally:
            for rid in ids:
                server.client.abort(rid)  # no-op once finished
        tokens = sum(len(t) for t in inputs)
        return json_response(EmbeddingResponse(request_id, int(time.time()), server.model_name, data,
                                               EmbeddingUsage(tokens, tokens)))

    app.router.add_post("/v1/embeddings", create)
