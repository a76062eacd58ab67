"""Paged KV blocks and the prefix cache over them.

Rules (docs/design.md, "Scheduler semantics"):

- A full block is named by a chained xxh64: the parent block's hash as 8 little-endian
  bytes (absent for the first block), then the block's token ids as int64 bytes. Equal
  names mean equal prefixes, so a block's KV can be shared.
- A hash match is confirmed against the token ids stored with the block (collision guard).
- The block holding the last prompt token is never taken from the cache: the prefill
  must forward at least one token to get logits.
- A block enters the index only after the forward that computed its KV (`publish`), so
  a second request never reads KV that is still being written.
- Freed blocks keep their hash and go to an LRU list; their hash is dropped only when
  the block is taken for new content (lazy eviction). Sequences free their blocks in
  reverse, so a chain's tail is evicted before its head (heads are shared more often).
- Blocks that never held a hash sit in a min-heap, so allocation is deterministic.
- Forks (n / best_of): a forked sequence shares every block of its parent by reference
  count (`fork`). A block is written only while one sequence holds it: `append_slots`
  gives a sequence about to write into a shared block its own copy first (copy-on-write:
  a fresh block, and a (src, dst) pair in `take_copies()` that the engine copies before
  the forward that writes it). Only the partly filled last prompt block is ever copied:
  full blocks are never written again.
- A sequence that asks for prompt logprobs never takes a prefix hit (its every prompt
  position must be forwarded to have logits), as in vLLM.
- Sliding window (a model whose every layer has one): `release_outside_window` returns the
  leading blocks no future query reads while the sequence runs; their table entries become
  FREED (the table keeps its length: position // block_size still finds a block). A released
  published block keeps its hash in the LRU list like any freed block: its KV is still that
  prefix's until the block is taken for new content, which unindexes it, so a reused block is
  never a prefix hit.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict

from contracts.block_hash import chain_hash, lora_seed  # the names KV events carry: one definition
from kv_transfer.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from scheduler.sequence import Sequence

NO_HASH = -1
FREED = -1  # a block-table entry released as outside the sliding window (never read again)


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash = NO_HASH  # set while the block is in the prefix index
        self.token_ids: list[int] | None = None  # the tokens the hash names (collision guard)


class BlockPool:
    """Physical blocks, the two free lists and the hash index."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.vacant: list[int] = list(range(num_blocks))  # a sorted list is a valid heap
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.index: dict[int, int] = {}  # hash -> block id
        self.events: list[KVEvent] | None = None  # None: not recording

    @property
    def num_free(self) -> int:
        return len(self.vacant) + len(self.cached_free)

    def take(self) -> Block:
        """A free block for new content; evicts the least recently freed cached block."""
        block = self.take_vacant()
        if block is None:
            block_id, _ = self.cached_free.popitem(last=False)
            block = self.blocks[block_id]
            self._unindex(block)
            block.ref_count = 1
        return block

    def take_vacant(self) -> Block | None:
        """A free block that names no prefix, or None: never evicts a cached one (the MTP
        drafter's scratch rows past a sequence's blocks, released within the step)."""
        if not self.vacant:
            return None
        block = self.blocks[heapq.heappop(self.vacant)]
        block.ref_count = 1
        return block

    def share(self, block: Block) -> None:
        """One more user of a cached block (revives it from the LRU list if free)."""
        if block.ref_count == 0:
            del self.cached_free[block.block_id]
        block.ref_count += 1

    def release(self, block: Block) -> None:
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash != NO_HASH:
                self.cached_free[block.block_id] = None
            else:
                heapq.heappush(self.vacant, block.block_id)

    def lookup(self, block_hash: int, token_ids: list[int]) -> Block | None:
        block_id = self.index.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        return block if block.token_ids == token_ids else None

    def index_block(self, block: Block, block_hash: int, token_ids: list[int]) -> bool:
        """Name a computed block; False when another block already holds that content."""
        if block_hash in self.index:
            return self.index[block_hash] == block.block_id
        block.hash, block.token_ids = block_hash, token_ids
        self.index[block_hash] = block.block_id
        return True

    def _unindex(self, block: Block) -> None:
        if self.index.get(block.hash) == block.block_id:
            del self.index[block.hash]
            self.record(BlockRemoved(block_hashes=[block.hash]))
        block.hash, block.token_ids = NO_HASH, None

    def clear_index(self) -> None:
        for block_id in self.index.values():
            block = self.blocks[block_id]
            block.hash, block.token_ids = NO_HASH, None
        for block_id in self.cached_free:
            heapq.heappush(self.vacant, block_id)
        self.cached_free.clear()
        self.index.clear()
        self.record(AllBlocksCleared())

    def record(self, event: KVEvent) -> None:
        if self.events is not None:
            self.events.append(event)


class BlockManager:
    """Gives sequences block tables and shares computed prefixes between them."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 enable_events: bool = False):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, block_size)
        self.pool.events = [] if enable_events else None
        self.copies: list[tuple[int, int]] = []  # copy-on-write (src, dst), not yet taken
        self.num_window_released = 0  # blocks returned by release_outside_window (a counter)

    @property
    def blocks(self) -> list[Block]:
        return self.pool.blocks

    @property
    def num_total_blocks(self) -> int:
        return len(self.pool.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return len(self.pool.blocks) - self.pool.num_free

    @property
    def usage(self) -> float:
        return self.num_used_blocks / len(self.pool.blocks) if self.pool.blocks else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ------------------------------------------------------------------ prefix lookup

    def _block_tokens(self, seq: Sequence, i: int) -> list[int]:
        bs = self.block_size
        return seq.token_ids[i * bs:(i + 1) * bs]

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """seq.block_hashes extended to at least `num_blocks` full blocks."""
        hashes = seq.block_hashes
        while len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else lora_seed(seq.lora_name)
            hashes.append(chain_hash(parent, self._block_tokens(seq, len(hashes))))
        return hashes

    def _cached_prefix(self, seq: Sequence) -> list[Block]:
        """Cached blocks that hold this sequence's leading full blocks, the last token's excepted."""
        # prompt logprobs and mean pooling need every prompt position forwarded
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None \
                or seq.sampling_params.pooling == "mean":
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        hashes = self._hashes(seq, limit)
        found = []
        for i in range(limit):
            block = self.pool.lookup(hashes[i], self._block_tokens(seq, i))
            if block is None:
                break
            found.append(block)
        return found

    # ------------------------------------------------------------------ allocation

    def can_allocate(self, seq: Sequence) -> int:
        """Number of leading blocks the cache can supply, or -1 when the rest does not fit."""
        cached = self._cached_prefix(seq)
        revived = sum(1 for b in cached if b.ref_count == 0)  # these leave the free lists too
        needed = self.num_blocks_for(seq.num_tokens) - len(cached) + revived
        return len(cached) if needed <= self.pool.num_free else -1

    def allocate(self, seq: Sequence, num_cached_blocks: int) -> int:
        """Block table for every token of `seq`; the first `num_cached_blocks` are shared.
        Returns the prefix-cache hit in tokens (their KV counts as computed)."""
        assert not seq.block_table, f"seq {seq.id} already holds blocks"
        cached = self._cached_prefix(seq)[:num_cached_blocks]
        for block in cached:  # before `take`, so eviction cannot pick a block we reuse
            self.pool.share(block)
        table = [b.block_id for b in cached]
        for _ in range(self.num_blocks_for(seq.num_tokens) - len(cached)):
            table.append(self.pool.take().block_id)
        seq.block_table = table
        seq.num_computed_tokens = len(cached) * self.block_size
        seq.num_published_blocks = len(cached)
        return seq.num_computed_tokens

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Blocks for `num_new_tokens` more positions, and an own copy of every shared block
        those positions fall in; False (and nothing taken) if they do not fit."""
        bs = self.block_size
        table, blocks = seq.block_table, self.pool.blocks
        first = seq.num_computed_tokens // bs
        end = (seq.num_computed_tokens + num_new_tokens + bs - 1) // bs
        shared = [i for i in range(first, min(end, len(table))) if blocks[table[i]].ref_count > 1]
        needed = end - len(table)
        if needed <= 0 and not shared:
            return True  # the common decode step: room left in an own last block
        if max(needed, 0) + len(shared) > self.pool.num_free:
            return False
        for i in shared:  # copy-on-write
            fresh = self.pool.take()
            self.copies.append((table[i], fresh.block_id))
            self.pool.release(blocks[table[i]])
            table[i] = fresh.block_id
        for _ in range(needed):
            table.append(self.pool.take().block_id)
        return True

    def trim(self, seq: Sequence) -> None:
        """Speculative decoding's rollback: release the tail blocks past the sequence's tokens
        (taken for drafts it rejected; never published, so they go back without a hash).
        Their KV slots inside the kept blocks are past the computed tokens: never read,
        overwritten by the next step."""
        keep = self.num_blocks_for(seq.num_tokens)
        table, blocks = seq.block_table, self.pool.blocks
        while len(table) > keep:
            self.pool.release(blocks[table.pop()])

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` (a fork of `parent`) shares every block of its parent."""
        for block_id in parent.block_table:
            if block_id != FREED:
                self.pool.share(self.pool.blocks[block_id])
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_published_blocks = parent.num_published_blocks
        child.num_released_blocks = parent.num_released_blocks

    def take_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write pairs (src, dst) the next forward must copy before it writes."""
        out, self.copies = self.copies, []
        return out

    def deallocate(self, seq: Sequence) -> None:
        """Return the blocks, tail first, and forget the computed KV."""
        blocks = self.pool.blocks
        for block_id in reversed(seq.block_table):
            if block_id != FREED:
                self.pool.release(blocks[block_id])
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_published_blocks = 0
        seq.num_released_blocks = 0

    def release_outside_window(self, seq: Sequence, window: int) -> int:
        """Return the leading blocks of `seq` that hold only keys no future query reads: the
        next query sits at position num_computed_tokens (chunks, drafts and decode steps only
        go forward from there) and reads keys from num_computed_tokens - window + 1 on. With the
        prefix cache on, only published blocks (their hash named, so they stay prefix hits
        while cached). Returns how many were released."""
        end = max(0, seq.num_computed_tokens - window + 1) // self.block_size
        if self.enable_prefix_caching:
            end = min(end, seq.num_published_blocks)
        return self._release_leading(seq, end)

    def release_unpulled(self, seq: Sequence, window: int) -> int:
        """D, a remote prefill just allocated: the prompt blocks before the window of its first
        query (position num_prompt_tokens - 1 at the earliest) are never pulled from P nor read;
        released now, and never published (their KV is not here). Returns how many."""
        released = self._release_leading(seq, max(0, seq.num_prompt_tokens - window) // self.block_size)
        seq.num_published_blocks = max(seq.num_published_blocks, seq.num_released_blocks)
        return released

    def _release_leading(self, seq: Sequence, end: int) -> int:
        """Release seq's blocks from its last released one up to `end` (FREED in its table)."""
        table, start = seq.block_table, seq.num_released_blocks
        end = min(end, len(table))
        for i in range(start, end):
            self.pool.release(self.pool.blocks[table[i]])
            table[i] = FREED
        if end <= start:
            return 0
        seq.num_released_blocks = end
        self.num_window_released += end - start
        return end - start

    # ------------------------------------------------------------------ publication

    def publish(self, seq: Sequence) -> None:
        """Index the full blocks whose KV is now computed (call after the forward)."""
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        start = seq.num_published_blocks
        if not self.enable_prefix_caching or num_full <= start:
            return
        hashes = self._hashes(seq, num_full)
        run: list[int] = []  # consecutive newly indexed blocks: one BlockStored each run
        run_start = start
        for i in range(start, num_full):
            block = self.pool.blocks[seq.block_table[i]]
            tokens = self._block_tokens(seq, i)
            if block.hash == hashes[i]:
                fresh = False  # shared from the cache already
            else:
                fresh = self.pool.index_block(block, hashes[i], tokens)
            if fresh:
                if not run:
                    run_start = i
                run.append(i)
            elif run:
                self._record_stored(seq, hashes, run_start, run)
                run = []
        if run:
            self._record_stored(seq, hashes, run_start, run)
        seq.num_published_blocks = num_full

    def _record_stored(self, seq: Sequence, hashes: list[int], first: int, run: list[int]) -> None:
        if self.pool.events is None:
            return
        bs = self.block_size
        self.pool.record(BlockStored(
            block_hashes=[hashes[i] for i in run],
            parent_block_hash=hashes[first - 1] if first > 0 else None,
            token_ids=seq.token_ids[first * bs:(run[-1] + 1) * bs],
            block_size=bs, lora_id=seq.lora_id, lora_name=seq.lora_name))

    def clear_index(self) -> None:
        """Forget every hash (reset_prefix_cache); blocks in use keep their KV."""
        self.pool.clear_index()

    def take_events(self) -> list[KVEvent]:
        events = self.pool.events
        if not events:
            return []
        self.pool.events = []
        return events
