"""What an engine is in a cluster, one word each: the router's worker roles and the engines'
`--kv-role` name the same three things."""
from __future__ import annotations

import enum


class Role(str, enum.Enum):
    """An engine's role; its value is the router's word (`--prefill` / `--decode` / `--worker`
    URLs, `/workers` bodies), `kv_role` the engine's `--kv-role` for it (vLLM's words)."""

    PREFILL = "prefill"  # P: runs the prompt, produces its KV for a decode engine
    DECODE = "decode"  # D: pulls the prompt KV from P, generates
    WORKER = "worker"  # colocated: prompt and generation in one engine, no KV moves

    @property
    def kv_role(self) -> str:
        return _KV_ROLES[self]


_KV_ROLES = {Role.PREFILL: "producer", Role.DECODE: "consumer", Role.WORKER: "both"}
