"""`GET /openapi.json` of `atomd serve`: an OpenAPI 3.1 description generated from the
same msgspec structs that decode and validate the bodies (atomd/protocol.py), so the
description and the server cannot drift apart and outside tools (schemathesis, client
generators) can test against it.
"""
from __future__ import annotations

import functools
from typing import Any

import msgspec

from atomd import protocol as P

REF = "#/components/schemas/{name}"


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(msgspec.Struct):
    """Every error answer: OpenAI's shape (atomd.protocol.APIError.body)."""

    error: ErrorDetail


def _json(ref: dict) -> dict:
    return {"application/json": {"schema": ref}}


def _errors(*statuses: int) -> dict:
    return {str(s): {"description": desc, "content": _json(ERROR_REF)} for s, desc in
            ((400, "invalid request, naming the field"), (401, "missing or wrong API key"),
             (403, "kv_transfer_params from an untrusted producer"), (404, "unknown model"),
             (413, "body too large"), (503, "engine loading, dead, or a failed KV pull")) if s in statuses}


ERROR_REF = {"$ref": REF.format(name="ErrorBody")}


@functools.cache  # the structs do not change while the server runs: build the document once
def openapi_document(version: str) -> dict[str, Any]:
    (completion_req, chat_req, completion, chat, models, _), components = msgspec.json.schema_components(
        [P.CompletionRequest, P.ChatCompletionRequest, P.CompletionResponse, P.ChatCompletionResponse,
         P.ModelList, ErrorBody], ref_template=REF)

    def generate(summary: str, request: dict, response: dict) -> dict:
        return {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(request)},
            "responses": {
                "200": {"description": "the answer; with `stream: true` server-sent events, each `data:` "
                                       "line one chunk, then `data: [DONE]`",
                        "content": {**_json(response), "text/event-stream": {"schema": {"type": "string"}}}},
                **_errors(400, 401, 403, 404, 413, 503)}}}

    def status(summary: str) -> dict:
        return {"get": {"summary": summary, "responses": {
            "200": {"description": "ok", "content": _json({"type": "object"})},
            "503": {"description": "not (yet) able to serve", "content": _json({"type": "object"})}}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "atomd serve", "version": version,
                 "description": "OpenAI-compatible completions and chat completions of one atomd engine."},
        "paths": {
            "/v1/completions": generate("Create a completion", completion_req, completion),
            "/v1/chat/completions": generate("Create a chat completion", chat_req, chat),
            "/v1/models": {"get": {"summary": "The served model", "responses": {
                "200": {"description": "ok", "content": _json(models)}, **_errors(401, 503)}}},
            "/health": status("200 while the engine core process lives"),
            "/ready": status("200 once the engine is loaded and answering"),
        },
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
