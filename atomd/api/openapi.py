"""`GET /openapi.json` of `atomd serve`: an OpenAPI 3.1 description generated from the
same msgspec structs that decode and validate the bodies (atomd/api/protocol.py), so the
description and the server cannot drift apart and outside tools (schemathesis, client
generators) can test against it.

The router's `/openapi.json` describes the same OpenAI routes (the engines validate what it
relays), but router/ must not import atomd (tests/test_architecture.py): `openai_surface()`
(those paths and their component schemas) is written to router/openapi_surface.json by
`python -m atomd.api.openapi`, and a test holds the file equal to what the structs give now.
"""
from __future__ import annotations

import functools
import json
import pathlib
import sys
from typing import Any

import msgspec

from atomd.api import embeddings, protocol, responses, responses_api, tokenize

REF = "#/components/schemas/{name}"
ROUTER_SURFACE = pathlib.Path(__file__).resolve().parents[2] / "router" / "openapi_surface.json"


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(msgspec.Struct):
    """Every error answer: OpenAI's shape (atomd.api.protocol.APIError.body)."""

    error: ErrorDetail


def _json(ref: dict) -> dict:
    return {"application/json": {"schema": ref}}


def _errors(*statuses: int) -> dict:
    return {str(s): {"description": desc, "content": _json(ERROR_REF)} for s, desc in
            ((400, "invalid request, naming the field"), (401, "missing or wrong API key"),
             (403, "kv_transfer_params from an untrusted producer"), (404, "unknown model"),
             (413, "body too large"), (429, "too many background responses running"),
             (503, "engine loading, dead, or a failed KV pull")) if s in statuses}


ERROR_REF = {"$ref": REF.format(name="ErrorBody")}


def openai_surface() -> dict[str, Any]:
    """The OpenAI routes (paths) and the schemas they name (components.schemas), from the
    structs that validate the bodies: what engines and router both serve."""
    (completion_req, chat_req, completion, chat, models, _, tok_prompt, tok_chat, tokenized, detok_req,
     detokenized, responses_req, embedding_req, embedding), components = msgspec.json.schema_components(
        [protocol.CompletionRequest, protocol.ChatCompletionRequest, responses.CompletionResponse,
         responses.ChatCompletionResponse,
         responses.ModelList, ErrorBody, tokenize.TokenizeCompletionRequest, tokenize.TokenizeChatRequest,
         tokenize.TokenizeResponse, tokenize.DetokenizeRequest, tokenize.DetokenizeResponse,
         responses_api.ResponsesRequest, embeddings.EmbeddingRequest, embeddings.EmbeddingResponse],
        ref_template=REF)

    def generate(summary: str, request: dict, response: dict) -> dict:
        return {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(request)},
            "responses": {
                "200": {"description": "the answer; with `stream: true` server-sent events, each `data:` "
                                       "line one chunk, then `data: [DONE]`",
                        "content": {**_json(response), "text/event-stream": {"schema": {"type": "string"}}}},
                **_errors(400, 401, 403, 404, 413, 503)}}}

    create_response = generate("Create a response (OpenAI's Responses API)", responses_req, {"type": "object"})
    create_response["post"]["responses"].update(_errors(429))  # background: true past the bound
    response_id = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}

    def stored(summary: str, *errors: int, query: tuple[str, ...] = ()) -> dict:
        params = [response_id] + [{"name": q, "in": "query", "required": False, "schema": {"type": "string"}}
                                  for q in query]
        return {"summary": summary, "parameters": params, "responses": {
            "200": {"description": "ok", "content": _json({"type": "object"})}, **_errors(401, 404, 503, *errors)}}

    def plain(summary: str, request: dict, response: dict) -> dict:
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": _json(request)},
                         "responses": {"200": {"description": "ok", "content": _json(response)},
                                       **_errors(400, 401, 404, 413, 503)}}}

    return {
        "paths": {
            "/v1/completions": generate("Create a completion", completion_req, completion),
            "/v1/chat/completions": generate("Create a chat completion", chat_req, chat),
            "/v1/responses": create_response,
            # stored responses (atomd/api/responses_store.py)
            "/v1/responses/{response_id}": {
                "get": stored("A stored response (background: its state so far)", 400, query=("stream",)),
                "delete": stored("Delete a stored response (a running background one is cancelled)")},
            "/v1/responses/{response_id}/cancel": {
                "post": stored("Cancel a background response (queued or in progress)", 400)},
            "/v1/responses/{response_id}/input_items": {
                "get": stored("A stored response's input items", 400, query=("order", "after", "limit"))},
            "/v1/models": {"get": {"summary": "The served model", "responses": {
                "200": {"description": "ok", "content": _json(models)}, **_errors(401, 503)}}},
            # vLLM's tokenizer routes (atomd/api/tokenize.py)
            "/v1/embeddings": plain("Create embeddings (an engine started with --task embed)", embedding_req,
                                    embedding),
            "/tokenize": plain("Tokenize a prompt, or chat messages through the chat template",
                               {"anyOf": [tok_prompt, tok_chat]}, tokenized),
            "/detokenize": plain("Token ids back to text", detok_req, detokenized),
            "/tokenizer_info": {"get": {"summary": "The tokenizer's config, special tokens and chat template",
                                        "responses": {"200": {"description": "ok",
                                                              "content": _json({"type": "object"})},
                                                      **_errors(401, 503)}}},
        },
        "components": {"schemas": components},
    }


def render_router_surface() -> str:
    """router/openapi_surface.json's text."""
    return json.dumps(openai_surface(), indent=1, sort_keys=True) + "\n"


@functools.cache  # the structs do not change while the server runs: build the document once
def openapi_document(version: str) -> dict[str, Any]:
    surface = openai_surface()

    def status(summary: str) -> dict:
        return {"get": {"summary": summary, "responses": {
            "200": {"description": "ok", "content": _json({"type": "object"})},
            "503": {"description": "not (yet) able to serve", "content": _json({"type": "object"})}}}}

    return {
        "openapi": "3.1.0",
        "info": {"title": "atomd serve", "version": version,
                 "description": "OpenAI-compatible completions and chat completions of one atomd engine, "
                                "and vLLM's tokenizer routes."},
        "paths": {
            **surface["paths"],
            "/health": status("200 while the engine core process lives"),
            "/ready": status("200 once the engine is loaded and answering"),
        },
        "components": {"schemas": surface["components"]["schemas"],
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


if __name__ == "__main__":  # python -m atomd.api.openapi: regenerate router/openapi_surface.json
    ROUTER_SURFACE.write_text(render_router_surface())
    print(f"wrote {ROUTER_SURFACE}", file=sys.stderr)
