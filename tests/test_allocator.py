"""atomd/engine/allocator.py: the engine's malloc policy (freed activation memory stays mapped)."""
from __future__ import annotations

import platform

import pytest
import torch

from atomd.engine import allocator


@pytest.mark.unit
def test_the_policy_applies_on_glibc_unless_turned_off(monkeypatch):
    """Applied where glibc is (its effect, 14k-150k minor faults a 135M prefill down to ~0, is
    measured on that shape: benchmarks/results/offline.md; the test models' activations are
    too small to be mmapped at all)."""
    monkeypatch.setenv(allocator.ENV, "0")
    assert not allocator.retain_freed_memory()
    monkeypatch.delenv(allocator.ENV)
    assert allocator.retain_freed_memory() == (platform.libc_ver()[0] == "glibc")


@pytest.mark.unit
def test_c_writes_refuse_slots_outside_the_cache():
    from atomd.engine.kv_cache import AttentionMetadata, KVCache

    cache = KVCache(4, 2, 16, 2, 32)
    meta = AttentionMetadata(is_prefill=True, slot_blocks=torch.tensor([1, 4]), slot_offsets=torch.tensor([0, 3]),
                             seqs=[])
    with pytest.raises(IndexError, match="block 4 of a 4-block cache"):
        cache.slot_rows(meta)
    with pytest.raises(IndexError, match="outside a 4 x 16 cache"):
        cache.slot_addresses(0, 16)
