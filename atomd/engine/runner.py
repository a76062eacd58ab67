"""ModelRunner: a ScheduledBatch -> logits of the rows that sample.

Turns the scheduler's numpy arrays (packed token ids, per-sequence scheduled/computed
counts, block tables) into the tensors the model reads: positions, the KV slot of every
token, and per-path attention metadata. All of it vectorised; the only Python loop is
over sequences, never over tokens.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from atomd import config
from atomd.engine.kv_cache import AttentionMetadata, DecodeWorkspace, KVCache, SeqSlice
from atomd.model.attention import causal_mask
from atomd.model.decoder import DecoderModel
from atomd.model.lora import LoraStep
from atomd.kernels.native import KERNEL_DTYPES, attention_kernels, bf16_path

log = logging.getLogger(__name__)


WORKSPACE_SLACK = 128  # decode steps a workspace can grow before it is rebuilt
WORKSPACE_MAX_BYTES = 256 << 20  # larger decode batches gather from the paged cache every step
# a prefill batch's one-token rows over a cached context through the decode kernel, one call a layer
# (ModelRunner._decode_rows); False: a gather + SDPA each (the A/B of benchmarks/delayer_virtual_clock.py)
DECODE_ROWS_KERNEL = True


class ModelRunner:
    def __init__(self, model: DecoderModel, kv_cache: KVCache, attention_backend: str = "auto"):
        self.model, self.kv_cache = model, kv_cache
        self.block_size = kv_cache.block_size
        self.workspace: DecodeWorkspace | None = None
        self.loras = None  # --enable-lora: the engine's LoraRegistry (name -> resident adapter weights)
        self._lora_stack = None  # the last step's adapters side by side (atomd/model/lora.py)
        self.last_step = None  # (positions, metadata) of the last forward: the MTP drafter runs on them
        self.kernels = None  # the native attention kernels; None: torch SDPA (decode over a workspace)
        dtype = kv_cache.compute_dtype  # a narrow cache is read widened to the model's dtype
        if attention_backend == "native" and dtype not in KERNEL_DTYPES:
            raise ValueError(f"attention_backend native runs float32 and bfloat16, not {dtype}")
        if attention_backend != "torch" and dtype in KERNEL_DTYPES:
            self.kernels = attention_kernels(*model.attention_shape())
            if self.kernels is not None and dtype == torch.bfloat16:
                log.info("bfloat16 attention: native kernels, %s", bf16_path(self.kernels))
            if self.kernels is not None and kv_cache.narrow:
                log.info("%s KV cache: native decode kernel, %s", kv_cache.kv.dtype, self.kernels.narrow_path)
        # Fresh prompts: the native prefill kernel, except in bf16 on an AMX CPU where the build
        # has no AMX path (an older compiler, or Linux refused the tiles): torch's flash SDPA
        # reaches the tiles through oneDNN there and runs ~4x the AVX512_BF16 loop (8 x 512
        # tokens, 135M shape: 8.3 vs 34 ms a layer; benchmarks/results/offline.md)
        self.fresh_prefill_kernel = self.kernels is not None and not (
            dtype == torch.bfloat16 and "amx_bf16" in config.cpu_flags() and not self.kernels.prefill_amx)
        if self.kernels is not None and dtype == torch.bfloat16 and self.kernels.prefill_amx:
            log.info("bfloat16 prefill of fresh prompts: native kernel on AMX tiles")
        elif self.kernels is not None and not self.fresh_prefill_kernel:
            log.info("bfloat16 prefill of fresh prompts: torch SDPA (this CPU has AMX, the kernel build does not)")
        if attention_backend == "native" and self.kernels is None:
            raise RuntimeError("attention_backend native: the attention kernels did not build "
                               "(see the warning above); use --attention-backend torch")

    @torch.inference_mode()
    def execute(self, batch, all_logits: bool = False, hidden_indices: torch.Tensor | None = None):
        """Logits [num sampled rows, vocab], batch order (the last token of each sampling
        sequence); with all_logits, logits of every scheduled token (for prompt logprobs); with
        `hidden_indices` (a prefill batch), (logits, those rows' final-normed hidden states). A
        decode batch with drafts returns the logits of every scheduled token too: row j of a
        sequence predicts the token after its j-th draft (atomd/engine/spec_decode.py verifies them)."""
        num_sched = batch.num_scheduled_tokens.astype(np.int64)
        computed = batch.num_computed_tokens.astype(np.int64)
        ends = np.cumsum(num_sched)
        starts = ends - num_sched
        positions = np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(starts - computed, num_sched)
        tables = pad_tables(batch.block_tables)
        row = np.repeat(np.arange(len(num_sched)), num_sched)
        slot_blocks = tables[row, positions // self.block_size]
        # speculative decoding: a decode row with drafts verifies them all in this forward
        verify = not batch.is_prefill and bool((num_sched > 1).any())
        # without the kernels such a batch takes the prefill path (a causal mask per sequence)
        as_prefill = batch.is_prefill or (verify and self.kernels is None)
        meta = AttentionMetadata(as_prefill, torch.from_numpy(slot_blocks),
                                 torch.from_numpy(positions % self.block_size), [], verify=verify, kernels=self.kernels)
        if as_prefill:
            meta.seqs = self._prefill_slices(batch.block_tables, starts, ends, computed)
            fresh = computed == 0
            if self.fresh_prefill_kernel and fresh.any():  # the kernel takes every fresh prompt at once
                meta.fresh_starts = torch.from_numpy(starts[fresh])
                meta.fresh_lens = torch.from_numpy(num_sched[fresh])
            if self.kernels is not None and not verify and DECODE_ROWS_KERNEL:
                self._decode_rows(meta, tables, starts, num_sched, computed)
            if verify:
                self.workspace = None  # its contexts miss this step's KV
        else:
            self._decode_metadata(meta, batch.seq_ids, tables, computed + num_sched)
            if verify:  # rows of a sequence: its last token, then its drafts
                meta.query_starts = torch.from_numpy(np.concatenate([[0], ends]))
        if all_logits or verify:  # verify: every row's logits (each checks the draft after it)
            logits_indices = torch.arange(int(ends[-1]))
        else:
            logits_indices = torch.from_numpy((ends - 1)[batch.needs_sample])
        input_ids = torch.from_numpy(batch.token_ids.astype(np.int64))
        # only what this step uses
        extra = {"lora": self._lora_step(batch, num_sched), "hidden_indices": hidden_indices}
        self.last_step = (torch.from_numpy(positions), meta)
        return self.model.forward(input_ids, self.last_step[0], meta, self.kv_cache, logits_indices,
                                  **{k: v for k, v in extra.items() if v is not None})

    def _lora_step(self, batch, num_sched: np.ndarray) -> LoraStep | None:
        """The step's rows by adapter (a request holds its adapter resident while it runs)."""
        if self.loras is None or all(s.lora_name is None for s in batch.seqs):
            return None
        resident = self.loras.resident
        step = LoraStep([None if s.lora_name is None else resident[s.lora_name] for s in batch.seqs], num_sched,
                        self._lora_stack)
        self._lora_stack = step.stack  # the next step's, while it uses the same adapters
        return step

    def _prefill_slices(self, block_tables: list[list[int]], starts: np.ndarray, ends: np.ndarray,
                        computed: np.ndarray) -> list[SeqSlice]:
        slices = []
        for table, start, end, done in zip(block_tables, starts.tolist(), ends.tolist(), computed.tolist()):
            ctx = done + end - start
            block_ids = mask = None
            if done > 0:  # FREED entries (before a sliding window): block 0, masked out
                block_ids = torch.tensor(table[:-(-ctx // self.block_size)], dtype=torch.int64).clamp_(min=0)
                mask = causal_mask(done, ctx)
            slices.append(SeqSlice(start, end, done, ctx, block_ids, mask))
        return slices

    def _decode_rows(self, meta: AttentionMetadata, tables: np.ndarray, starts: np.ndarray, num_sched: np.ndarray,
                     computed: np.ndarray) -> None:
        """A prefill batch's one-token rows over a cached context (a mixed step's decode rows, a
        pulled prompt's last token) read their contexts through the decode kernel, all in one
        call, as in a decode step, instead of a gather and an SDPA each per layer."""
        one = (num_sched == 1) & (computed > 0)
        if not one.any():
            return
        meta.decode_rows = torch.from_numpy(starts[one])
        decode_reads(meta, tables[one], computed[one] + 1, self.block_size)
        for i in np.flatnonzero(one).tolist():
            meta.seqs[i].decode_row = True

    def _decode_metadata(self, meta: AttentionMetadata, seq_ids: list[int], tables: np.ndarray,
                         context_lens: np.ndarray) -> None:
        decode_reads(meta, tables, context_lens, self.block_size)
        if self.kernels is not None:  # reads the paged cache directly: no workspace
            return
        if not self.model.paged_kv_heads:  # no k, v heads to copy into a workspace
            return
        ws = self.workspace
        if ws is not None and ws.continues(seq_ids, context_lens):
            ws.context_lens = context_lens
            meta.new_positions = torch.from_numpy(context_lens - 1)
        else:
            ws = self.workspace = self._new_workspace(seq_ids, context_lens)
            meta.workspace_fresh = True
        meta.workspace = ws

    def _new_workspace(self, seq_ids: list[int], context_lens: np.ndarray) -> DecodeWorkspace | None:
        """Room for WORKSPACE_SLACK more steps of this batch, if that fits WORKSPACE_MAX_BYTES."""
        c = self.kv_cache
        capacity = int(context_lens.max()) + WORKSPACE_SLACK
        dtype = c.compute_dtype
        self.workspace = None  # free the old one before allocating
        if DecodeWorkspace.nbytes(len(seq_ids), capacity, c.num_layers, c.num_kv_heads, c.head_dim,
                                  dtype) > WORKSPACE_MAX_BYTES:
            return None
        return DecodeWorkspace(seq_ids, context_lens, capacity, c.num_layers, c.num_kv_heads, c.head_dim, dtype)


def decode_reads(meta: AttentionMetadata, tables: np.ndarray, context_lens: np.ndarray, block_size: int) -> None:
    """What a decode row reads of the paged cache: its blocks (`tables`, pad_tables' form) up to
    the longest context, its context length, and on the torch path (no kernels: it pads every row
    to the longest) the mask of the shorter rows."""
    max_context = int(context_lens.max())
    max_blocks = -(-max_context // block_size)
    meta.block_tables = torch.from_numpy(np.ascontiguousarray(tables[:, :max_blocks]))
    meta.max_context = max_context
    meta.context_lens = torch.from_numpy(context_lens)
    if meta.kernels is None and (context_lens != max_context).any():
        keys = torch.arange(max_context)
        meta.decode_mask = (keys.unsqueeze(0) < torch.from_numpy(context_lens).unsqueeze(1))[:, None, None, :]


def pad_tables(block_tables: list[list[int]]) -> np.ndarray:
    """Block tables as one int64 array, short rows padded with block 0 (masked when read), and
    so are the FREED entries before a sliding window (scheduler/block_manager.py)."""
    width = max(len(t) for t in block_tables)
    out = np.zeros((len(block_tables), width), dtype=np.int64)
    for i, t in enumerate(block_tables):
        out[i, :len(t)] = t
    return np.maximum(out, 0, out=out)
