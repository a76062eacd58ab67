"""Why a request ended without generating: one code per cause, each mapped to one HTTP status
by the API (docs/design.md, "Error codes")."""
from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    """Why a sequence ended without generating; the API maps each to an HTTP status."""

    INVALID_REQUEST = "invalid_request"  # refused on arrival (e.g. kv_transfer_params do not fit)
    UNSCHEDULABLE = "unschedulable"  # can never run on this engine's configuration
    KV_TRANSFER_FAILED = "kv_transfer_failed"  # the prompt KV could not be pulled from P
    KV_PARAMS_UNTRUSTED = "kv_params_untrusted"  # names a producer this engine does not trust
    MODEL_NOT_FOUND = "model_not_found"  # a LoRA adapter this engine has not loaded
    LORA_LOAD_FAILED = "lora_load_failed"  # loading the request's adapter (again) failed
