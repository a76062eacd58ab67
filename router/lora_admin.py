"""LoRA adapters across the cluster, from the router (issue #39).

`POST /v1/load_lora_adapter` {"lora_name", "lora_path", "role"} and `POST /v1/unload_lora_adapter`
{"lora_name", "role"} (the engines' routes, vLLM's bodies, plus `role`: "prefill", "decode",
"worker" or "all", the default: PD needs an adapter on P and on D) send the load or unload to
every registered worker of the role at once and answer each engine's result. All of them
succeeded: 200. Any failed: an OpenAI-style error naming the engines that failed (their
common 4xx when every one refused the same way, else 502 `lora_partial_failure`), still with
every engine's result; nothing is rolled back (a retry converges: an engine that already
serves the adapter counts as done, an unload of an adapter an engine does not serve too).
Each engine that succeeded is asked for its /kv_transfer_info at once, so placement and
/v1/models follow without waiting for the next health round.

`/v1/models` through the router lists an adapter only where a request naming it can be
served: on a prefill and a decode worker in rotation (a decode one alone while no prefill
worker is), or on a colocated worker (`servable`).
"""
from __future__ import annotations

import asyncio
from typing import Literal

import msgspec

from contracts.lora import check_name
from router.errors import worker_text
from router.http import UpstreamError
from router.workers import ROLES, Worker, WorkerRegistry, describe

LOAD_TIMEOUT_S = 60.0  # an engine reads the adapter's safetensors: as the engine's own utility call
MAX_PATH_CHARS = 4096  # as the engines' limit


class LoraAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter on the router."""

    lora_name: str
    lora_path: str | None = None  # load: the PEFT directory, as each engine's host sees it
    role: Literal["prefill", "decode", "worker", "all"] = "all"


def parse(body: bytes | None, load: bool) -> LoraAdapterRequest:
    """The body, checked: a ValueError names what is wrong (the caller's 400)."""
    try:
        req = msgspec.json.decode(body or b"", type=LoraAdapterRequest)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
        raise ValueError(f"invalid request: {e}") from None
    check_name(req.lora_name)
    if load and (not req.lora_path or len(req.lora_path) > MAX_PATH_CHARS):
        raise ValueError(f"lora_path must be 1-{MAX_PATH_CHARS} characters")
    return req


def targets(registry: WorkerRegistry, role: str) -> list[Worker]:
    return [w for r in (ROLES if role == "all" else (role,)) for w in registry.workers(r)]


async def apply(workers: list[Worker], req: LoraAdapterRequest, load: bool, auth: bytes) -> list[dict]:
    """Send the load / unload to every worker at once; one result per worker, in order."""
    path = b"/v1/load_lora_adapter" if load else b"/v1/unload_lora_adapter"
    payload = msgspec.json.encode({"lora_name": req.lora_name, "lora_path": req.lora_path} if load
                                  else {"lora_name": req.lora_name})
    headers = b"Content-Type: application/json\r\n" + auth

    async def one(w: Worker) -> dict:
        result = {"url": w.url, "role": w.role}
        if load and w.loras is not None and req.lora_name in w.loras:
            return dict(result, ok=True, status=200, message="already loaded")
        try:
            status, _, body = await w.pool.fetch(b"POST", path, headers, payload, timeout_s=LOAD_TIMEOUT_S)
        except (UpstreamError, OSError) as e:
            return dict(result, ok=False, status=None, message=f"unreachable: {describe(e)}")
        if status == 200 or (not load and status == 404):  # an unload of what it does not serve: done
            await w.fetch_kv_info()  # its adapters now, for placement and /v1/models
            return dict(result, ok=True, status=status, message="done" if status == 200 else "was not loaded")
        return dict(result, ok=False, status=status, message=engine_message(body))

    return list(await asyncio.gather(*(one(w) for w in workers)))


def engine_message(body: bytes) -> str:
    try:
        err = msgspec.json.decode(body)["error"]
        text = str(err["message"] if isinstance(err, dict) else err)
    except (msgspec.DecodeError, RecursionError, KeyError, TypeError):
        text = body.decode("utf-8", "replace")
    return worker_text(text)


def failure(req: LoraAdapterRequest, load: bool, results: list[dict]) -> tuple[int, str, str] | None:
    """(status, code, message) when some engine failed, else None."""
    failed = [r for r in results if not r["ok"]]
    if not failed:
        return None
    verb = "load" if load else "unload"
    named = "; ".join(f"{r['url']} ({r['role']}): {r['status'] or 'no answer'} {r['message']}" for r in failed[:8])
    statuses = {r["status"] for r in failed}
    if len(failed) == len(results) and len(statuses) == 1 and (s := next(iter(statuses))) and 400 <= s < 500:
        return s, "lora_load_refused" if load else "lora_unload_refused", \
            f"every engine refused to {verb} LoRA adapter {req.lora_name!r}: {named}"
    return 502, "lora_partial_failure", (f"LoRA adapter {req.lora_name!r}: {verb} failed on {len(failed)} of "
                                         f"{len(results)} engines (the others succeeded): {named}")


def servable(registry: WorkerRegistry) -> set[str]:
    """The adapters a request can be served under now (module docstring)."""
    def serving(role: str) -> set[str] | None:
        up = registry.available(role)
        if not up:
            return None
        return set().union(*(w.loras or () for w in up))

    prefill, decode, worker = serving("prefill"), serving("decode"), serving("worker")
    out = set(worker or ())
    if decode is not None:
        out |= decode if prefill is None else decode & prefill
    return out


def models_body(body: bytes, registry: WorkerRegistry) -> bytes:
    """An engine's /v1/models answer with its adapter cards replaced by the servable adapters
    (an engine's own card where it has one, else one made from the base model's)."""
    try:
        doc = msgspec.json.decode(body)
        cards = doc["data"]
        if not isinstance(cards, list) or not all(isinstance(c, dict) for c in cards):
            return body
    except (msgspec.DecodeError, RecursionError, KeyError, TypeError):
        return body
    if not any(w.loras is not None for w in registry.workers()):  # no engine serves adapters
        return body
    base = [c for c in cards if not c.get("parent")]
    own = {c.get("id"): c for c in cards if c.get("parent")}
    parent = base[0] if base else {}
    adapters = [own.get(name) or {"id": name, "object": "model", "created": parent.get("created"),
                                  "owned_by": parent.get("owned_by", "atomd"),
                                  "max_model_len": parent.get("max_model_len"), "parent": parent.get("id"),
                                  "root": None}
                for name in sorted(servable(registry))]
    return msgspec.json.encode(dict(doc, data=base + adapters))


__all__ = ["LoraAdapterRequest", "parse", "targets", "apply", "failure", "servable", "models_body"]
