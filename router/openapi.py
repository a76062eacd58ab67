"""`GET /openapi.json` of the router: OpenAPI 3.1, built once per process.

The OpenAI routes it relays are described by the structs the engines validate them with
(atomd/api/protocol.py): router/ must not import atomd, so atomd/api/openapi.py writes that part,
paths and component schemas, to openapi_surface.json (`python -m atomd.api.openapi`; a test
holds the file current). The router adds the answers only it gives (429 at capacity,
502 / 504 from a failed or silent worker) and its own routes, whose bodies are described
by the structs below, the ones `POST|DELETE /workers` decode with.
"""
from __future__ import annotations

import copy
import functools
import json
import pathlib
from importlib import metadata
from typing import Any, Literal

import msgspec

from router.lora_admin import LoraAdapterRequest

SURFACE = pathlib.Path(__file__).with_name("openapi_surface.json")
REF = "#/components/schemas/{name}"
ERROR_REF = {"$ref": REF.format(name="ErrorBody")}  # defined by the surface (atomd/api/openapi.py)

Role = Literal["prefill", "decode", "worker"]


class AddWorker(msgspec.Struct):
    """POST /workers: register a worker (idempotent)."""

    url: str  # http(s)://host:port, no path
    role: Role


class RemoveWorker(msgspec.Struct):
    """DELETE /workers: unregister a worker, in one role or (no role) in every role."""

    url: str
    role: Role | None = None


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _error(description: str) -> dict:
    return {"description": description, "content": _json(ERROR_REF)}


ROUTER_ERRORS = {
    "401": _error("missing or wrong API key"),
    "413": _error("body too large"),
    "429": _error("the router is at capacity (with Retry-After)"),
    "502": _error("a worker failed or answered wrong"),
    "503": _error("no worker of a needed role in rotation"),
    "504": _error("a worker was silent past the timeout"),
}


def version() -> str:
    try:
        return metadata.version("atomd")
    except metadata.PackageNotFoundError:
        return "0+unknown"


@functools.cache  # the structs and the surface do not change while the router runs
def openapi_document() -> dict[str, Any]:
    surface = json.loads(SURFACE.read_text())
    paths: dict[str, Any] = copy.deepcopy(surface["paths"])
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        paths[path]["post"]["responses"].update(ROUTER_ERRORS)
    for path, method in (("/v1/models", "get"), ("/tokenize", "post"), ("/detokenize", "post"),
                         ("/tokenizer_info", "get"), ("/v1/embeddings", "post")):
        paths[path][method]["responses"].update({k: ROUTER_ERRORS[k] for k in ("401", "502", "503")})
    for path, item in paths.items():  # a stored response: to the engine that stored it
        if path.startswith("/v1/responses/"):
            for op in item.values():
                op["responses"].update({k: ROUTER_ERRORS[k] for k in ("401", "502", "503")})
    (add, remove, lora), own = msgspec.json.schema_components([AddWorker, RemoveWorker, LoraAdapterRequest],
                                                              ref_template=REF)
    schemas = {**surface["components"]["schemas"], **own}

    def get(summary: str, content_type: str = "application/json", *errors: str, **more: dict) -> dict:
        schema = {"type": "object"} if content_type == "application/json" else {"type": "string"}
        return {"get": {"summary": summary, "responses": {
            "200": {"description": "ok", "content": {content_type: {"schema": schema}}},
            **{e: ROUTER_ERRORS[e] for e in errors}, **more}}}

    admin = ("401",)
    query = [{"name": name, "in": "query", "required": False, "schema": {"type": "string"}} for name in ("url", "role")]
    paths.update({
        "/health": get("200 while the router runs"),
        "/ready": get("200 when a prefill and a decode worker, or a colocated one, are in rotation",
                      **{"503": {"description": "not ready", "content": _json({"type": "object"})}}),
        "/metrics": get("Prometheus text, `atomd_router:` series", "text/plain"),
        "/dashboard": get("the status page", "text/html"),
        "/dashboard/state": get("what the status page shows", "application/json", *admin),
        "/openapi.json": get("this document"),
        **{path: {"post": {"summary": f"{verb} a LoRA adapter on every worker of `role` (default all), each "
                                      "engine's result in `results` (the admin key when one is set)",
                           "requestBody": {"required": True, "content": _json(lora)},
                           "responses": {"200": {"description": "done on every engine", "content": _json({"type": "object"})},
                                         "400": _error("a bad body, no worker of the role, or every engine "
                                                       "refused it"),
                                         "502": _error("some engine failed (`results` names each)"),
                                         **{e: ROUTER_ERRORS[e] for e in admin}}}}
           for verb, path in (("load", "/v1/load_lora_adapter"), ("unload", "/v1/unload_lora_adapter"))},
        "/workers": {
            **get("the registered workers, their health and load", "application/json", *admin),
            "post": {"summary": "register a worker (the admin key when one is set)",
                     "requestBody": {"required": True, "content": _json(add)},
                     "responses": {"200": {"description": "already registered", "content": _json({"type": "object"})},
                                   "201": {"description": "registered", "content": _json({"type": "object"})},
                                   "400": _error("a bad url or role"), **{e: ROUTER_ERRORS[e] for e in admin}}},
            "delete": {"summary": "unregister a worker (the body, or the query string)",
                       "parameters": query,
                       "requestBody": {"required": False, "content": _json(remove)},
                       "responses": {"200": {"description": "removed", "content": _json({"type": "object"})},
                                     "400": _error("a bad url or role"), "404": _error("no such worker"),
                                     **{e: ROUTER_ERRORS[e] for e in admin}}},
        },
    })
    return {
        "openapi": "3.1.0",
        "info": {"title": "atomd router", "version": version(),
                 "description": "OpenAI-compatible completions and chat completions over prefill / decode "
                                "engines, and the router's operations."},
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


@functools.cache
def openapi_json() -> bytes:
    """The document, encoded once."""
    return msgspec.json.encode(openapi_document())
