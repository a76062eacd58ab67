"""LoRA adapters as the HTTP process sees them: which `model` names are adapters, the
/v1/models cards for them, and the admin routes that load and unload one at run time
(vLLM's `POST /v1/load_lora_adapter` {"lora_name", "lora_path"} and
`POST /v1/unload_lora_adapter` {"lora_name"}).

The engine core holds the weights (atomd/engine/lora_registry.py); this side keeps the
names (name -> path) so a request's `model` is checked without a round trip: a name the
engine has not loaded is a 404 naming it. Loads and unloads go to every DP rank.
"""
from __future__ import annotations

import time
from typing import Any

import msgspec

from atomd.api import protocol, responses
from contracts.lora import check_name

MAX_PATH_CHARS = 4096
LORA_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")  # admin routes (--admin-api-key)


class LoadLoraRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str | None = None  # unload: ignored, as vLLM


class LoraCard(responses.ModelCard):
    parent: str | None = None  # the base model's id (vLLM's field)
    root: str | None = None  # the adapter's path


class LoraNames:
    def __init__(self, config: Any):
        self.enabled = bool(getattr(config, "enable_lora", False))
        self.paths: dict[str, str] = dict(config.lora_adapters()) if self.enabled else {}

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
