"""BlockManager: chained-hash prefix cache, publication after the forward, LRU eviction, events."""
from __future__ import annotations

import numpy as np
import pytest
import xxhash

import scheduler.block_manager as bm_module
from kv_transfer.events import AllBlocksCleared, BlockRemoved, BlockStored
from scheduler.block_manager import BlockManager
from scheduler.sequence import Sequence

pytestmark = pytest.mark.unit
BS = 4


def reference_hashes(tokens: list[int], block_size: int) -> list[int]:
    """docs/design.md's definition, written out independently: parent as 8 LE bytes, then int64 ids."""
    out, parent = [], None
    for i in range(len(tokens) // block_size):
        data = b"" if parent is None else parent.to_bytes(8, "little")
        data += np.asarray(tokens[i * block_size:(i + 1) * block_size], dtype="<i8").tobytes()
        parent = xxhash.xxh64(data).intdigest()
        out.append(parent)
    return out


def admit(bm: BlockManager, tokens: list[int]) -> Sequence:
    """Allocate like the scheduler, pretend the forward ran over the whole prompt, publish."""
    seq = Sequence(tokens)
    n = bm.can_allocate(seq)
    assert n >= 0
    bm.allocate(seq, n)
    seq.num_computed_tokens = seq.num_tokens
    bm.publish(seq)
    return seq


def test_block_hashes_are_chained_xxh64_over_int64_tokens():
    bm = BlockManager(16, BS, enable_events=True)
    tokens = list(range(100, 111))  # 2 full blocks + 3 tokens
    seq = admit(bm, tokens)
    assert seq.block_hashes == reference_hashes(tokens, BS)
    stored = bm.take_events()
    assert stored == [BlockStored(block_hashes=reference_hashes(tokens, BS), parent_block_hash=None,
                                  token_ids=tokens[:8], block_size=BS)]


def test_second_request_reuses_prefix_but_never_the_last_prompt_block():
    bm = BlockManager(16, BS)
    first = admit(bm, list(range(12)))  # 3 full blocks
    same = Sequence(list(range(12)))
    assert bm.can_allocate(same) == 2  # the block with the last prompt token is recomputed
    longer = Sequence(list(range(13)))
    assert bm.can_allocate(longer) == 3
    bm.allocate(longer, 3)
    assert longer.block_table[:3] == first.block_table and longer.num_computed_tokens == 12
    assert all(bm.blocks[b].ref_count == 2 for b in first.block_table)


def test_hashes_are_not_published_before_the_forward():
    bm = BlockManager(16, BS)
    a = Sequence(list(range(9)))
    bm.allocate(a, bm.can_allocate(a))
    assert bm.can_allocate(Sequence(list(range(9)))) == 0  # allocated but not computed
    a.num_computed_tokens = 4  # first chunk's forward done
    bm.publish(a)
    assert bm.can_allocate(Sequence(list(range(9)))) == 1


def test_hash_collision_is_caught_by_the_token_guard(monkeypatch):
    monkeypatch.setattr(bm_module, "chain_hash", lambda parent, tokens: 42)
    bm = BlockManager(16, BS)
    admit(bm, [1, 2, 3, 4, 5])
    assert bm.can_allocate(Sequence([9, 9, 9, 9, 5])) == 0  # same hash, other tokens
    assert bm.can_allocate(Sequence([1, 2, 3, 4, 5])) == 1


def test_frees_go_to_lru_and_evict_tail_first_oldest_first():
    bm = BlockManager(6, BS, enable_events=True)
    a = admit(bm, list(range(0, 12)))  # blocks 0,1,2 hashed
    b = admit(bm, list(range(100, 112)))  # blocks 3,4,5 hashed
    ha, hb = a.block_hashes, b.block_hashes
    bm.deallocate(a)
    bm.deallocate(b)
    bm.take_events()
    assert bm.num_free_blocks == 6
    fresh = Sequence(list(range(500, 516)))  # 4 new blocks: evicts a's blocks tail first, then b's tail
    bm.allocate(fresh, bm.can_allocate(fresh))
    removed = [e.block_hashes[0] for e in bm.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [ha[2], ha[1], ha[0], hb[2]]
    # what is left of b still serves a hit
    bm.deallocate(fresh)
    assert bm.can_allocate(Sequence(list(range(100, 112)) + [7])) == 2


def test_a_hit_on_a_free_cached_block_revives_it_instead_of_evicting_it():
    bm = BlockManager(3, BS)
    a = admit(bm, list(range(8)) + [99])  # 3 blocks, 2 hashed
    table = list(a.block_table)
    bm.deallocate(a)
    again = Sequence(list(range(8)) + [98])
    assert bm.can_allocate(again) == 2
    bm.allocate(again, 2)
    assert again.block_table[:2] == table[:2]
    assert bm.num_free_blocks == 0 and again.num_computed_tokens == 8


def test_vacant_blocks_are_handed_out_lowest_id_first_and_counts_add_up():
    bm = BlockManager(8, BS)
    a = admit(bm, [1] * 9)
    assert a.block_table == [0, 1, 2]
    b = Sequence([2] * 5)
    bm.allocate(b, bm.can_allocate(b))
    assert b.block_table == [3, 4]
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_total_blocks == 8
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.num_free_blocks == 8 and a.block_table == [] and a.num_computed_tokens == 0


def test_clear_index_drops_every_hit_and_reports_it():
    bm = BlockManager(8, BS, enable_events=True)
    a = admit(bm, list(range(9)))
    bm.deallocate(a)
    bm.take_events()
    bm.clear_index()
    assert bm.take_events() == [AllBlocksCleared()]
    assert bm.can_allocate(Sequence(list(range(9)))) == 0
    assert bm.num_free_blocks == 8


def test_can_allocate_counts_revived_blocks_against_the_free_pool():
    bm = BlockManager(3, BS)
    a = admit(bm, list(range(8)) + [1])
    bm.deallocate(a)  # 3 free, 2 of them cached
    too_big = Sequence(list(range(8)) + list(range(200, 206)))  # 4 blocks, 2 cached
    assert bm.can_allocate(too_big) == -1


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    admit(bm, list(range(9)))
    assert bm.can_allocate(Sequence(list(range(9)))) == 0


def test_append_slots_grows_the_table_only_at_block_boundaries():
    bm = BlockManager(8, BS)
    seq = admit(bm, [3] * 4)
    seq.token_ids.append(5)
    seq.num_computed_tokens = 4
    assert bm.append_slots(seq, 1) and len(seq.block_table) == 2
    assert bm.append_slots(seq, 1) and len(seq.block_table) == 2
    seq.num_computed_tokens = 8
    assert not bm.append_slots(seq, 4 * 7) and len(seq.block_table) == 2  # 7 more do not fit: none taken


def test_an_adapter_chains_from_its_seed_and_never_shares_the_base_models_blocks():
    """The same prompt under a LoRA adapter: its first block's parent is the adapter's seed
    (xxh64 of b"lora:" + name), so neither a hit on the base model's chain nor another
    adapter's; its BlockStored names the adapter."""
    bm = BlockManager(16, BS, enable_events=True)
    tokens = list(range(100, 109))  # 2 full blocks + 1 token
    admit(bm, tokens)
    bm.take_events()
    seq = Sequence(tokens, lora_name="sql", lora_id=3)
    assert bm.can_allocate(seq) == 0  # no hit on the base model's blocks
    bm.allocate(seq, 0)
    seq.num_computed_tokens = seq.num_tokens
    bm.publish(seq)
    seed = xxhash.xxh64(b"lora:sql").intdigest()
    first = xxhash.xxh64(seed.to_bytes(8, "little") + np.asarray(tokens[:4], dtype="<i8").tobytes()).intdigest()
    assert seq.block_hashes[0] == first
    (stored,) = bm.take_events()
    assert stored.block_hashes == seq.block_hashes[:2] and stored.lora_id == 3 and stored.lora_name == "sql"
    assert stored.parent_block_hash is None
    assert bm.can_allocate(Sequence(tokens, lora_name="sql")) == 2  # its own chain hits
    assert bm.can_allocate(Sequence(tokens, lora_name="poet")) == 0
