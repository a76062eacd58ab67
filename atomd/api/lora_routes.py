"""LoRA adapters as the HTTP process sees them: which `model` names are adapters, the
/v1/models cards for them, and the admin routes that load and unload one at run time
(vLLM's `POST /v1/load_lora_adapter` {"lora_name", "lora_path"} and
`POST /v1/unload_lora_adapter` {"lora_name"}).

The engine core holds the weights (atomd/engine/lora_registry.py); this side keeps the
names (name -> path) so a request's `model` is checked without a round trip: a name the
engine has not loaded is a 404 naming it. Loads and unloads go to every DP rank.

`--lora-load-policy load` with `--lora-path-map name=path ...`: a completions or chat request (a
decode leg's KV pull too) naming an adapter of the map that this engine has not loaded loads it first (requests
for it meanwhile wait for that one load); `refuse`, the default, answers the 404.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

import msgspec

from atomd.api import protocol, responses
from contracts.lora import check_name, parse_lora_modules

MAX_PATH_CHARS = 4096
LORA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")  # admin routes (--admin-api-key)


class LoadLoraRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str | None = None  # unload: ignored, as vLLM


class ModelOnly(msgspec.Struct):
    """A request body's `model` alone (the rest is parsed later, on the parser thread)."""

    model: Any = None


class LoraCard(responses.ModelCard):
    parent: str | None = None  # the base model's id (vLLM's field)
    root: str | None = None  # the adapter's path


class LoraNames:
    def __init__(self, config: Any):
        self.enabled = bool(getattr(config, "enable_lora", False))
        self.paths: dict[str, str] = dict(config.lora_adapters()) if self.enabled else {}
        on_demand = self.enabled and getattr(config, "lora_load_policy", "refuse") == "load"
        self.on_demand: dict[str, str] = dict(parse_lora_modules(config.lora_path_map, "lora_path_map")) \
            if on_demand else {}
        self._loading: dict[str, asyncio.Task] = {}

    async def load_missing(self, body: bytes, base: str, call: Callable[..., Awaitable[Any]]) -> None:
        """--lora-load-policy load: the adapter a request body names, when the path map has it
        and this engine has not loaded it, is loaded now (module docstring)."""
        if not self.on_demand:
            return
        try:
            model = msgspec.json.decode(body, type=ModelOnly).model
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            return  # the parser answers the body's error
        if not isinstance(model, str) or model == base or model in self.paths or model not in self.on_demand:
            return
        task = self._loading.get(model)
        if task is None:
            task = self._loading[model] = asyncio.ensure_future(self._load(model, call))
            task.add_done_callback(lambda _: self._loading.pop(model, None))
        await asyncio.shield(task)

    async def _load(self, name: str, call: Callable[..., Awaitable[Any]]) -> None:
        path = self.on_demand[name]
        error = engine_error(await call("load_lora_adapter", name, path, timeout_s=60.0))
        if error is not None:
            raise error
        self.paths[name] = path

    def of(self, model: str | None, base: str) -> str | None:
        """The adapter a request's `model` names (None: the base model); a 404 naming an unknown one."""
        if not model or model == base:
            return None
        if model in self.paths:
            return model
        known = ", ".join(repr(n) for n in [base, *self.paths][:20])
        raise protocol.APIError(404, f"model {model!r} does not exist; this server serves {known}",
                                param="model", code="model_not_found")

    def cards(self, base: str, max_model_len: int) -> list[responses.ModelCard]:
        now = int(time.time())
        return [LoraCard(id=name, created=now, max_model_len=max_model_len, parent=base, root=path)
                for name, path in self.paths.items()]

    def parse(self, body: bytes, base: str, load: bool) -> LoadLoraRequest:
        """The body of a load / unload, checked (400s)."""
        if not self.enabled:
            raise protocol.APIError(400, "this server runs without --enable-lora", code="lora_disabled")
        try:
            req = msgspec.json.decode(body, type=LoadLoraRequest)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
            raise protocol.invalid("body", f"invalid request: {e}") from None
        try:
            check_name(req.lora_name)
        except ValueError as e:
            raise protocol.invalid("lora_name", str(e)) from None
        if req.lora_name == base:
            raise protocol.invalid("lora_name", f"{req.lora_name!r} is the base model's name")
        if load and (not req.lora_path or len(req.lora_path) > MAX_PATH_CHARS):
            raise protocol.invalid("lora_path", f"lora_path must be 1-{MAX_PATH_CHARS} characters")
        if load and req.lora_name in self.paths:
            raise protocol.invalid("lora_name", f"LoRA adapter {req.lora_name!r} is already loaded")
        if not load and req.lora_name not in self.paths:
            raise protocol.APIError(404, f"LoRA adapter {req.lora_name!r} is not loaded", param="lora_name",
                                    code="model_not_found")
        return req


def engine_error(result: Any) -> protocol.APIError | None:
    """The engine's answer to a load / unload as an API error, or None when it succeeded."""
    if isinstance(result, dict) and result.get("error"):
        status = int(result.get("status", 400))
        kind = {404: "not_found_error", 503: "service_unavailable"}.get(status, "invalid_request_error")
        return protocol.APIError(status, str(result["error"]), param="lora_path" if status == 400 else "lora_name",
                                 type=kind, code="model_not_found" if status == 404 else None)
    return None
