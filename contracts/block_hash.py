"""The prefix cache's block names: the engine's block manager (scheduler/block_manager.py)
and the consumers of its KV events (the kv_aware router, which must not import the
scheduler) compute them here, once.

An engine names a full block of `block_size` tokens by a chained xxh64: the parent block's
hash as 8 little-endian bytes (absent for the first block), then the block's token ids as
little-endian int64. `BlockStored.block_hashes` carry these values. A LoRA adapter's
blocks chain from a seed named by the adapter (`lora_seed`) in place of the absent parent,
so the same tokens under two adapters (or an adapter and the base model) never share a
block: their KV differs.
"""
from __future__ import annotations

import struct

import xxhash

ALGO = "xxh64_chain_le_int64"  # what an engine reports as kv_events.hash in GET /kv_transfer_info


def chain_hash(parent: int | None, token_ids: list[int]) -> int:
    h = xxhash.xxh64()
    if parent is not None:
        h.update(parent.to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.intdigest()


def lora_seed(lora_name: str | None) -> int | None:
    """The parent of a sequence's first block: None for the base model, else the adapter's
    name hashed (names, not engine-local ids: P, D and the router agree on them)."""
    return None if lora_name is None else xxhash.xxh64(b"lora:" + lora_name.encode()).intdigest()


def block_hashes(token_ids: list[int], block_size: int, limit: int | None = None,
                 lora_name: str | None = None) -> list[int]:
    """The chained hashes of the full blocks of `token_ids` (at most `limit` of them), under
    adapter `lora_name` (None: the base model)."""
    n = len(token_ids) // block_size
    if limit is not None:
        n = min(n, limit)
    out: list[int] = []
    parent = lora_seed(lora_name)
    pack = struct.Struct(f"<{block_size}q").pack
    for i in range(n):
        h = xxhash.xxh64()
        if parent is not None:
            h.update(parent.to_bytes(8, "little"))
        h.update(pack(*token_ids[i * block_size:(i + 1) * block_size]))
        parent = h.intdigest()
        out.append(parent)
    return out
