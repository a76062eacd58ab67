"""Speculative drafts from DeepSeek V3's MTP layer (atomd/model/deepseek_mtp.py).

Every forward of the engine runs the MTP layer over the same rows, positions and KV slots
as the main model, after sampling: row p gets the main model's hidden state h_p and the token
at p + 1, which is known for every row whose output counts: a prompt token, or this step's
sampled token (for a verify step's row j, the token sampled there). A verify step's rows past
its last accepted draft are left out (`trim_rows`: their KV would sit at positions the next
step rewrites before anything reads them); under TP every rank runs all the rows, as announced. So the MTP's latent cache follows the sequence shifted by one, including chunked
prefills, prefix hits (the hit blocks' MTP rows were computed with the next token of the
sequence that stored them: a later sequence with another next token reads one stale MTP row
at the boundary, which costs acceptance, never output) and preemption (recomputed). The
first draft of a sequence that sampled is the MTP's argmax at its last accepted row p: the
token after the one it just got.

k > 1 (num_speculative_tokens): `propose` chains the layer on its own output, as vLLM and
SGLang do with V3's one MTP layer: draft j + 1 comes from the MTP's output state of draft j
and draft j itself, one position on (p + j), as a decode row over the MTP's latent cache.
Those chained rows write the MTP layer's KV at positions p + 1 .. p + k - 1, past every
computed token: the rejected drafts' slots of this step, or slots no step wrote yet. The next
step's MTP pass rewrites each of them before any row reads it (it writes its rows first, and
computes positions in order), so a rejection leaves nothing stale. Chained rows past the
sequence's blocks go to scratch blocks borrowed from the pool's vacant ones (never a cached
prefix) and returned at once; with none free the chain stops at the sequence's last block.
The drafts go out under the SpecController's limit, as the n-gram proposer's do; the verify
step keeps each only if the main model samples it.

Expert parallelism: the MTP layer's MoE exchanges across the ranks, so every rank runs exactly
k MTP passes each step any rank runs (the first pass, the chain, then empty exchanges for the
depths it did not reach: `end_step`; an idle rank all k: `idle`).

Tensor parallelism: every rank runs its share of every pass (the MTP layer split as the main
ones), and rank 0 announces each pass to the workers just before it runs it: the first with the
step's next tokens and drafting rows (`TPWorkers.send_mtp`), each chained one with its live
chains' slots, last drafts, positions and block tables, scratch blocks included
(`TPWorkers.send_mtp_pass`). A worker (`MtpShare`) runs exactly the passes announced, in their
order, and expects none: it reads the next message whatever it is (the next step's, a pass), so a
chain that stops early on rank 0 (a limit, max_model_len, no vacant block) has announced only the
passes it ran and leaves no worker inside a collective. A chained pass reads each chain's state
from the pass before on that rank (the same bits on every rank: the all-reduce hands every rank
the same sum); the drafts rank 0 picked travel with the announcement. Under TP x EP only rank 0
exchanges (the workers hold no routed expert of the MTP layer either and add zeros), so
`end_step`'s empty passes concern rank 0 alone.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from atomd.engine.kv_cache import AttentionMetadata, KVCache
from atomd.engine.runner import decode_reads, pad_tables
from atomd.model.deepseek_mtp import MtpLayer, mtp_exchange_idle, mtp_forward


@dataclass
class _Chain:
    """A sequence's drafts so far and where the next one starts."""

    request_id: str
    position: int  # the row of the last draft (p + len(drafts) - 1)
    state: torch.Tensor  # [hidden] the MTP's output at that row
    table: list[int]  # the sequence's blocks this step
    drafts: list[int]
    slot: int  # its row among the first pass's drafting rows (a TP worker's state of the chain: MtpShare)


class MtpProposer:
    def __init__(self, model, mtp: MtpLayer, num_speculative_tokens: int, max_model_len: int, kv_cache: KVCache,
                 kernels=None, share=None):
        self.model, self.mtp, self.kv_cache, self.kernels = model, mtp, kv_cache, kernels
        self.share = share  # under TP: TPWorkers, which announces each pass to the workers (send_mtp, send_mtp_pass)
        self.k, self.max_model_len = num_speculative_tokens, max_model_len
        self.pool = None  # the scheduler's BlockPool (set once it exists): chained rows' scratch blocks
        self.chains: dict[int, _Chain] = {}  # seq id -> its first draft, from the last forward
        self.passes = 0  # MTP passes this step (expert parallelism: k on every rank)
        # tests and debugging: [] records every drafting pass as (depth, request ids, positions, logits)
        self.trace: list[tuple[int, list[str], torch.Tensor, torch.Tensor]] | None = None

    def run(self, batch, hidden: torch.Tensor, positions: torch.Tensor, meta, kv_cache,
            sampled: list[list[int]], accepted: list[list[int]]) -> None:
        """After a forward: the MTP layer over its rows (module docstring); `sampled[i]` the
        tokens sampled at sequence i's rows (one per row for a verify step, one for its last
        row otherwise, none if it did not sample), `accepted[i]` what it kept."""
        num = batch.num_scheduled_tokens.astype(np.int64)
        ends = np.cumsum(num)
        computed = batch.num_computed_tokens.astype(np.int64)
        next_ids = np.zeros(int(ends[-1]), dtype=np.int64)
        logits_rows, drafting = [], []
        kept = num.copy()  # each sequence's rows the pass runs: a verify step's up to its last accepted one
        for i, seq in enumerate(batch.seqs):
            start, n, c = int(ends[i] - num[i]), int(num[i]), int(computed[i])
            known = seq.token_ids[c + 1:c + n + 1]  # the next token of each row, where the sequence has it
            tail = sampled[i][:n - len(known)]
            row_ids = list(known) + list(tail)
            next_ids[start:start + len(row_ids)] = row_ids
            if accepted[i]:
                if len(sampled[i]) > 1:
                    kept[i] = n - len(sampled[i]) + len(accepted[i])
                logits_rows.append(start + kept[i] - 1)
                drafting.append(i)
        if self.share is None and (kept < num).any() and not meta.is_prefill:
            # the rows past a sequence's last accepted draft: their latent rows are rewritten by the
            # next step before anything reads them, so they need no pass at all
            hidden, positions, meta, next_ids, logits_rows = trim_rows(num, kept, hidden, positions, meta, next_ids,
                                                                       logits_rows)
        rows = torch.tensor(logits_rows, dtype=torch.int64)
        self.passes = 1
        if self.share is not None:
            self.share.send_mtp(next_ids, rows)
        logits, states = mtp_forward(self.model, self.mtp, torch.from_numpy(next_ids), hidden, positions, meta,
                                     kv_cache, rows)
        at = positions[rows].tolist()
        self.chains = {batch.seqs[i].id: _Chain(batch.seqs[i].request_id, p, states[j], batch.block_tables[i], [d], j)
                       for j, (i, p, d) in enumerate(zip(drafting, at, logits.argmax(dim=-1).tolist()))}
        if self.trace is not None:
            self.trace.append((1, [c.request_id for c in self.chains.values()], positions[rows], logits))

    def propose(self, seq_ids: list[int], token_ids: list[list[int]], new: list[list[int]],
                limits: list[int]) -> list[list[int]]:
        """NgramProposer.propose's contract: each sequence's drafts (at most k) under its limit,
        and never past max_model_len."""
        depths = {}
        for s, history, got, limit in zip(seq_ids, token_ids, new, limits):
            if limit > 0 and s in self.chains:
                depths[s] = max(1, min(limit, self.k, self.max_model_len - len(history) - len(got)))
        if any(d > 1 for d in depths.values()):
            self._chain(depths)
        return [self.chains[s].drafts[:depths[s]] if s in depths else [] for s in seq_ids]

    def _chain(self, depths: dict[int, int]) -> None:
        """Drafts 2 .. depths[s] of each sequence: one decode row a sequence per depth."""
        bs = self.kv_cache.block_size
        borrowed = []
        try:
            for s in [s for s, d in depths.items() if d > 1]:
                chain = self.chains[s]
                chain.table = table = list(chain.table)
                last = chain.position + depths[s] - 1  # the row of the last chained draft
                while len(table) <= last // bs and self.pool is not None:
                    block = self.pool.take_vacant()
                    if block is None:
                        break
                    borrowed.append(block)
                    table.append(block.block_id)
                depths[s] = min(depths[s], len(table) * bs - chain.position)
            for depth in range(2, max(depths.values()) + 1):
                live = [s for s, d in depths.items() if d >= depth]
                chains = [self.chains[s] for s in live]
                positions = torch.tensor([c.position + 1 for c in chains], dtype=torch.int64)
                tables, tokens = [c.table for c in chains], torch.tensor([c.drafts[-1] for c in chains])
                meta = chain_meta(tables, positions, self.kv_cache.block_size, self.kernels)
                if self.share is not None:  # announced right before it runs: a worker runs this pass and no other
                    self.share.send_mtp_pass([c.slot for c in chains], tokens, positions, tables)
                self.passes += 1
                logits, states = mtp_forward(self.model, self.mtp, tokens, torch.stack([c.state for c in chains]),
                                             positions, meta, self.kv_cache, torch.arange(len(chains)))
                for c, state, d in zip(chains, states, logits.argmax(dim=-1).tolist()):
                    c.position, c.state = c.position + 1, state
                    c.drafts.append(d)
                if self.trace is not None:
                    self.trace.append((depth, [c.request_id for c in chains], positions, logits))
        finally:
            for block in borrowed:
                self.pool.release(block)

    def end_step(self) -> None:
        """After the step's drafts: the passes it did not run, as empty exchanges (expert parallelism)."""
        for _ in range(self.k - self.passes):
            mtp_exchange_idle(self.model, self.mtp)
        self.passes = self.k

    def idle(self) -> None:
        """A rank with no rows while another runs a step: its part in that step's k MTP passes."""
        self.passes = 0
        self.end_step()

    def forget(self, seq_id: int) -> None:
        self.chains.pop(seq_id, None)


def trim_rows(num: np.ndarray, kept: np.ndarray, hidden: torch.Tensor, positions: torch.Tensor,
              meta: AttentionMetadata, next_ids: np.ndarray, logits_rows: list[int]):
    """A decode step's rows cut to the first kept[i] of each sequence's num[i] (a verify step's
    rows up to its last accepted draft): the rows' hidden states, positions, next tokens, their
    decode metadata (each sequence's context ending at its last kept row) and the logits rows
    renumbered."""
    ends, dropped = np.cumsum(num), num - kept
    keep = np.concatenate([np.arange(e - n, e - n + k) for e, n, k in zip(ends.tolist(), num.tolist(), kept.tolist())])
    before = np.cumsum(dropped) - dropped  # rows dropped before each sequence's
    at = torch.from_numpy(keep)
    trimmed = dataclasses.replace(meta, slot_blocks=meta.slot_blocks[at], slot_offsets=meta.slot_offsets[at],
                                  context_lens=meta.context_lens - torch.from_numpy(dropped),
                                  query_starts=torch.from_numpy(np.concatenate([[0], np.cumsum(kept)]))
                                  if (kept > 1).any() else None)
    trimmed.verify = trimmed.query_starts is not None
    trimmed.max_context = int(trimmed.context_lens.max())
    rows = np.asarray(logits_rows, dtype=np.int64)
    rows = (rows - before[np.searchsorted(ends, rows, side="right")]).tolist()
    return hidden[at], positions[at], trimmed, next_ids[keep], rows


def chain_meta(tables: list[list[int]], positions: torch.Tensor, block_size: int, kernels) -> AttentionMetadata:
    """A chained pass's metadata: one decode row a sequence at `positions`, over its blocks `tables`."""
    padded, at = pad_tables(tables), positions.numpy()
    meta = AttentionMetadata(False, torch.from_numpy(padded[np.arange(len(tables)), at // block_size]),
                             positions % block_size, [], kernels=kernels)
    decode_reads(meta, padded, at + 1, block_size)
    return meta


class MtpShare:
    """A TP worker's share of the drafter (module docstring): the passes rank 0 announces, each run
    when its announcement arrives; the first pass's output states kept for the chained ones."""

    def __init__(self, model, mtp: MtpLayer, kv_cache: KVCache, kernels=None):
        self.model, self.mtp, self.kv_cache, self.kernels = model, mtp, kv_cache, kernels
        self.states: torch.Tensor | None = None  # [drafting rows, hidden]: each chain's state, by slot

    def first(self, next_ids: torch.Tensor, rows: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              meta: AttentionMetadata) -> None:
        """The step's first pass over every row (MtpProposer.run's), after the step's forward."""
        _, self.states = mtp_forward(self.model, self.mtp, next_ids, hidden, positions, meta, self.kv_cache, rows)

    def chained(self, slots: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor,
                tables: list[list[int]]) -> None:
        """One chained pass (MtpProposer._chain's) over the live chains `slots`."""
        meta = chain_meta(tables, positions, self.kv_cache.block_size, self.kernels)
        _, states = mtp_forward(self.model, self.mtp, token_ids, self.states[slots], positions, meta, self.kv_cache,
                                torch.arange(len(slots)))
        self.states[slots] = states
