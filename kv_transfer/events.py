"""KV cache events: what the block manager tells the world about its prefix cache.

The types match vLLM's `vllm.distributed.kv_events` field for field and in the same
order (msgpack arrays, tagged unions), so a consumer written for vLLM's events decodes
ours. Every field is always encoded (no omit_defaults), so a decoder that requires the
trailing optional fields still accepts our frames; ours accepts frames that omit them.
"""
from __future__ import annotations

import msgspec


class KVCacheEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    """Base of the tagged union; the tag is the class name, as in vLLM."""


class BlockStored(KVCacheEvent):
    """Blocks whose KV is now computed and findable by hash (one chain, parent first)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    # vLLM's newer field: the adapter by name (lora_id is engine-local); a six-field frame decodes with None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    """Hashes that no longer resolve to a block (evicted or dropped)."""

    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix index was dropped (reset_prefix_cache)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """One publish: the events of one engine step."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None
