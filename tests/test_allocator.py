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
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the policy is glibc's mallopt")
def test_a_block_past_glibcs_largest_mmap_threshold_is_reused_not_faulted_in_again():
    """A 40 MiB activation (past the 32 MiB that glibc's threshold can reach: the 0.6B shape's 4096-row QKV
    output is 32 MiB and a bit) comes from the heap: once the heap has grown to hold it (a few allocations:
    each aligned request is a little larger than the chunk freed before it), writing it again costs no page
    faults. A fresh mapping every time (the threshold alone) costs 10240 each time."""
    import resource

    from atomd.model.huge_pages import release_freed_memory

    assert allocator.retain_freed_memory()
    rows = 40 << 20 >> 12  # 4 KiB rows: one page each

    def write_block() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(rows, 4096, dtype=torch.uint8).fill_(1)
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    try:
        faults = [write_block() for _ in range(16)]
        assert min(faults[1:]) < rows // 10, faults
    finally:
        release_freed_memory()  # the grown heap back to the system


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
