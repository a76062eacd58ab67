"""Tensor parallelism inside the model: a worker's slice of the checkpoint (`ShardedSource`) and
the collectives of its forward (`TensorParallel`).

Megatron's split (atomd/model/tp_split.py says which rows): q/k/v and gate/up column-parallel
(this worker's heads, this worker's intermediate rows), o and down row-parallel (the matching
input columns; their outputs are partial sums, all-reduced once after attention and once after
the MLP); each MoE expert split along its intermediate dimension the same way, the router
whole; the embedding and the LM head vocabulary-parallel (a lookup outside this worker's rows
is zero and the sum of the workers' lookups is the row; the logits of each worker's rows are
gathered). Norms and the q/k norms are whole on every worker. A row-parallel bias is held by
worker 0 only (the others' is zero), so the sum adds it once.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from atomd.model.quant import QuantizedWeight
from atomd.model.tp_split import TPSplit

COLUMN = ("gate_proj", "up_proj", "w1", "w3")  # rows: intermediate (dense MLP, each expert)
ROW = ("down_proj", "w2")  # columns: intermediate
VOCAB = ("embed_tokens", "lm_head")


class ShardedSource:
    """A TensorSource (atomd/model/decoder.py) that returns worker `split.rank`'s slice of each
    tensor, by the tensor's HF name."""

    def __init__(self, src, split: TPSplit):
        self.src, self.split = src, split

    def __contains__(self, name: str) -> bool:
        return name in self.src

    def stored_dtype(self, name: str) -> str:
        return self.src.stored_dtype(name)

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        t = self.src.get(name, dtype)
        parts = name.split(".")
        kind, suffix = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
        if kind not in ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_up_proj", *COLUMN, *ROW, *VOCAB):
            return t
        if isinstance(t, QuantizedWeight):
            raise ValueError(f"tensor parallelism: {name} is quantized; quantized weights are not split yet")
        s, d = self.split, self.split.head_dim
        if kind == "q_proj":
            return _heads(t, s.q_heads(), d)
        if kind in ("k_proj", "v_proj"):
            return _heads(t, s.kv_heads(), d)
        if kind == "qkv_proj":  # Phi-3: q, k, v stacked
            q, k, v = t.split([s.num_heads * d, s.num_kv_heads * d, s.num_kv_heads * d])
            return torch.cat([_heads(q, s.q_heads(), d), _heads(k, s.kv_heads(), d), _heads(v, s.kv_heads(), d)])
        if kind == "o_proj":
            return _columns(t, s.q_heads().start * d, s.local_heads * d) if suffix == "weight" else _bias_once(t, s)
        if kind == "gate_up_proj":  # Phi-3: gate then up
            return torch.cat([_chunk(half, s, name) for half in t.chunk(2)])
        if kind in COLUMN:
            return _chunk(t, s, name)
        if kind in ROW:
            if suffix != "weight":
                return _bias_once(t, s)
            if t.shape[1] % s.size:
                raise ValueError(f"tensor parallelism: {name} has {t.shape[1]} columns, not a multiple of {s.size}")
            n = t.shape[1] // s.size
            return _columns(t, s.rank * n, n)
        rows = t[s.vocab_start:s.vocab_start + s.vocab_rows]  # the vocabulary: padded to vocab_rows
        if rows.shape[0] < s.vocab_rows:
            rows = torch.cat([rows, rows.new_zeros(s.vocab_rows - rows.shape[0], *rows.shape[1:])])
        return rows.contiguous()


def _heads(t: torch.Tensor, heads: range, head_dim: int) -> torch.Tensor:
    return t[heads.start * head_dim:heads.stop * head_dim].contiguous()


def _columns(t: torch.Tensor, start: int, n: int) -> torch.Tensor:
    return t[:, start:start + n].contiguous()


def _chunk(t: torch.Tensor, s: TPSplit, name: str) -> torch.Tensor:
    if t.shape[0] % s.size:
        raise ValueError(f"tensor parallelism: {name} has {t.shape[0]} rows, not a multiple of {s.size}")
    n = t.shape[0] // s.size
    return t[s.rank * n:(s.rank + 1) * n].contiguous()


def _bias_once(t: torch.Tensor, s: TPSplit) -> torch.Tensor:
    return t if s.rank == 0 else torch.zeros_like(t)


class TensorParallel:
    """This worker's place in the forward's collectives (`comm`: atomd/engine/tp_collective.py)."""

    def __init__(self, comm, split: TPSplit):
        self.comm, self.split = comm, split
        # calls and seconds inside them (waits for the slowest worker included): benchmarks/tensor_parallel.py
        self.num_all_reduce = self.num_all_gather = 0
        self.collective_s = 0.0

    def reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of every worker's partial `t` (a row-parallel linear's output)."""
        self.num_all_reduce += 1
        start = time.perf_counter()
        out = self.comm.all_reduce_(t if t.is_contiguous() else t.contiguous())
        self.collective_s += time.perf_counter() - start
        return out

    def embed(self, input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Rows of the whole vocabulary's embedding from this worker's slice `table`."""
        s = self.split
        local = input_ids - s.vocab_start
        outside = (local < 0) | (local >= s.vocab_rows)
        x = F.embedding(local.clamp(0, s.vocab_rows - 1), table)
        x[outside] = 0
        return self.reduce_(x)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[T, vocab] from every worker's [T, vocab_rows] (the padding rows cut)."""
        self.num_all_gather += 1
        start = time.perf_counter()
        out = self.comm.all_gather(logits.contiguous())
        self.collective_s += time.perf_counter() - start
        return out if out.shape[1] == self.split.vocab_size else out[:, :self.split.vocab_size].contiguous()
