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

from atomd.model import quant
from atomd.model.quant import QuantizedWeight
from atomd.model.tp_split import TPSplit

COLUMN = ("gate_proj", "up_proj", "w1", "w3")  # rows: intermediate (dense MLP, each expert)
ROW = ("down_proj", "w2")  # columns: intermediate
VOCAB = ("embed_tokens", "lm_head", "head")  # head: DeepSeek MTP's shared_head.head
MLA = ("q_b_proj", "kv_b_proj")  # DeepSeek's per-head linears beside q_proj / o_proj


class ShardedSource:
    """A TensorSource (atomd/model/decoder.py) that returns worker `split.rank`'s slice of each
    tensor, by the tensor's HF name. It wraps the quantising sources (atomd/model/quant_formats.py,
    GGUF's), so a quantized weight is quantised whole and then sliced (`_rows`, `_columns`): every
    worker's integers, scales and zero points are the unsplit weight's. `q8_aligned`: the linears
    run with int8 activations (act blocks of QuantizedWeight.act_block inputs, each its own scale), so a
    row-parallel slice must start and end on an act-block boundary to quantise the same blocks (the slice
    keeps the unsplit weight's act block)."""

    def __init__(self, src, split: TPSplit, q8_aligned: bool = False, mla: tuple[int, int, int] | None = None,
                 experts: str = "split"):
        self.src, self.split, self.q8_aligned = src, split, q8_aligned
        self.mla = mla  # DeepSeek: rows a head of q_proj / q_b_proj, of kv_b_proj, o_proj's inputs a head
        # the routed experts' tensors (".experts." in the name): split like the MLP, whole (rank 0 under
        # expert parallelism: it runs them), or none (the other ranks then: an empty tensor, nothing read)
        self.experts = experts

    def __contains__(self, name: str) -> bool:
        return name in self.src

    def stored_dtype(self, name: str) -> str:
        return self.src.stored_dtype(name)

    def tied_head(self, embed):
        """GGUF's tied LM head (packed token_embd where the file packs it): this worker's vocabulary rows."""
        head = self.src.tied_head(embed)
        return head if head is embed else self._vocab(head)

    def get(self, name: str, dtype: torch.dtype):
        if self.experts != "split" and ".experts." in name:
            return torch.empty(0, 0, dtype=dtype) if self.experts == "none" else self.src.get(name, dtype)
        t = self.src.get(name, dtype)
        parts = name.split(".")
        kind, suffix = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
        if kind not in ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_up_proj", *COLUMN, *ROW, *VOCAB, *MLA):
            return t
        s, d = self.split, self.split.head_dim
        if self.mla is not None and kind in ("q_proj", "q_b_proj", "kv_b_proj", "o_proj"):
            return self._mla(t, name, kind, suffix)
        if kind == "q_proj":
            return _rows(t, s.q_heads().start * d, s.q_heads().stop * d)
        if kind in ("k_proj", "v_proj"):
            return _rows(t, s.kv_heads().start * d, s.kv_heads().stop * d)
        if kind == "qkv_proj":  # Phi-3: q, k, v stacked
            q, kv = s.num_heads * d, s.num_kv_heads * d
            return _cat([_rows(t, s.q_heads().start * d, s.q_heads().stop * d),
                         _rows(t, q + s.kv_heads().start * d, q + s.kv_heads().stop * d),
                         _rows(t, q + kv + s.kv_heads().start * d, q + kv + s.kv_heads().stop * d)])
        if kind == "o_proj":
            if suffix != "weight":
                return _bias_once(t, s)
            return _columns(t, s.q_heads().start * d, s.local_heads * d, name, self.q8_aligned)
        if kind == "gate_up_proj":  # Phi-3: gate then up
            half = t.shape[0] // 2
            return _cat([_chunk(_rows(t, 0, half), s, name), _chunk(_rows(t, half, 2 * half), s, name)])
        if kind in COLUMN:
            return _chunk(t, s, name)
        if kind in ROW:
            if suffix != "weight":
                return _bias_once(t, s)
            if t.shape[1] % s.size:
                raise ValueError(f"tensor parallelism: {name} has {t.shape[1]} columns, not a multiple of {s.size}")
            n = t.shape[1] // s.size
            return _columns(t, s.rank * n, n, name, self.q8_aligned)
        return self._vocab(t)

    def _mla(self, t, name: str, kind: str, suffix: str):
        """MLA's per-head linears: q (q_proj, or q_b_proj after the shared q_a_proj) and kv_b_proj
        (the latent's up-projection to each head's k_nope and v) column-parallel by heads, o_proj
        row-parallel by heads; q_a_proj and kv_a_proj_with_mqa (the latent) stay whole on every worker."""
        q, kv_b, v = self.mla
        heads = self.split.q_heads()
        if kind == "o_proj":
            return _bias_once(t, self.split) if suffix != "weight" else \
                _columns(t, heads.start * v, len(heads) * v, name, self.q8_aligned)
        d = kv_b if kind == "kv_b_proj" else q
        return _rows(t, heads.start * d, heads.stop * d)

    def _vocab(self, t):
        """This worker's vocabulary rows, padded to vocab_rows with zero rows."""
        s = self.split
        rows = _rows(t, s.vocab_start, min(s.vocab_start + s.vocab_rows, s.vocab_size))
        return _pad_rows(rows, s.vocab_rows)


def _rows(t, start: int, stop: int):
    """Output rows start..stop of a weight (float or quantized: each row keeps its own scales) or a bias."""
    if not isinstance(t, QuantizedWeight):
        return t[start:stop].contiguous()
    cut = lambda x: None if x is None else x[start:stop].contiguous()  # noqa: E731
    return quant.derived(t, q=cut(t.q), scales=cut(t.scales), offsets=cut(t.offsets))


def _cat(parts: list):
    return quant.cat(parts) if isinstance(parts[0], QuantizedWeight) else torch.cat(parts).contiguous()


def _pad_rows(t, rows: int):
    """t with zero rows appended up to `rows` (a quantized one: q, scales and offsets 0, so w = 0)."""
    missing = rows - t.shape[0]
    if missing <= 0:
        return t
    pad = lambda x: None if x is None else torch.cat([x, x.new_zeros(missing, *x.shape[1:])])  # noqa: E731
    if isinstance(t, QuantizedWeight):
        return quant.derived(t, q=pad(t.q), scales=pad(t.scales), offsets=pad(t.offsets))
    return pad(t).contiguous()


def _columns(t, start: int, n: int, name: str, q8_aligned: bool = False):
    """Input columns start..start+n of a row-parallel weight. A quantized one is cut at its
    groups: the groups whole when n is a multiple of the group size, else the one group this
    slice lies in (a per-channel scale, or a group of several slices) with n as its group size;
    any other shape is refused naming the numbers. int4 packs runs of 32 inputs: slices of 32s.
    GPTQ act-order (`perm`): the slice's kernel columns must be this slice's inputs."""
    if not isinstance(t, QuantizedWeight):
        return t[:, start:start + n].contiguous()
    where = f"tensor parallelism: {name} ({t.in_features} inputs, {n} a worker)"
    if t.bits == 16:  # bf16: no scales
        return quant.derived(t, q=t.q[:, start:start + n].contiguous(), group_size=n, in_features=n)
    g = t.group_size
    if n % g == 0:
        scales = slice(start // g, (start + n) // g)
        group = g
    elif g % n == 0:
        scales = slice(start // g, start // g + 1)
        group = n
    else:
        raise ValueError(f"{where}: quantization groups of {g} inputs neither divide a worker's {n} inputs "
                         f"nor are a multiple of them")
    if t.bits == 4 and n % 32:
        raise ValueError(f"{where}: int4 packs runs of 32 inputs; {n} is not a multiple of 32")
    a = t.act_block
    if (q8_aligned or t.int8_activations) and a and (n % a or start % a):
        raise ValueError(f"{where}: int8 activations quantise this weight's inputs in act blocks of {a} (its group "
                         f"of {g}, capped at {quant.ACT_BLOCKS[0]}); a worker's {n} inputs from input {start} do not fall on act-block "
                         f"boundaries (run with float activations)")
    perm = None
    if t.perm is not None:
        perm = t.perm[start:start + n]
        if not bool(((perm >= start) & (perm < start + n)).all()):
            raise ValueError(f"{where}: GPTQ act-order (desc_act) groups mix inputs of different workers")
        perm = None if torch.equal(perm, torch.arange(start, start + n)) else (perm - start).contiguous()
    q = t.q[:, start:start + n] if t.bits == 8 else t.q[:, start // 2:(start + n) // 2]
    cut = lambda x: None if x is None else x[:, scales].contiguous()  # noqa: E731
    return quant.derived(t, q=q.contiguous(), scales=cut(t.scales), offsets=cut(t.offsets), group_size=group,
                         in_features=n, perm=perm)


def _chunk(t, s: TPSplit, name: str):
    if t.shape[0] % s.size:
        raise ValueError(f"tensor parallelism: {name} has {t.shape[0]} rows, not a multiple of {s.size}")
    n = t.shape[0] // s.size
    return _rows(t, s.rank * n, (s.rank + 1) * n)


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


def shard_adapter(adapter, split: TPSplit, cfg):
    """A LoRA adapter (atomd/model/lora.py, loaded for the whole model `cfg`) as worker
    `split.rank` runs it: a column-parallel linear's (qkv, gate_up) A whole and B's columns of
    this worker's output rows; a row-parallel linear's (o, down) A's rows of this worker's inputs
    and B whole. The row-parallel delta is then a partial sum like the base linear's output, and
    the one all-reduce after attention / the MLP adds both."""
    from atomd.model.lora import LoraAdapter, LoraLinear

    layers = []
    for i, layer in enumerate(adapter.layers):
        out_cols, in_rows = _mla_lora_cuts(cfg, split, i) if getattr(cfg, "kv_lora_rank", 0) else \
            _lora_cuts(cfg, split)
        out = {}
        for fused, pair in layer.items():
            if fused in out_cols:
                b_t = torch.cat([pair.b_t[:, lo:hi] for lo, hi in out_cols[fused]], dim=1).contiguous()
                out[fused] = LoraLinear(pair.a_t, b_t)
            else:
                lo, hi = in_rows[fused]
                out[fused] = LoraLinear(pair.a_t[lo:hi].contiguous(), pair.b_t)
        layers.append(out)
    return LoraAdapter(adapter.name, adapter.path, adapter.rank, layers)


def _mlp_cuts(inter: int, s: TPSplit) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """gate_up's output columns (this worker's gate rows, then its up rows) and down's input rows."""
    mine = inter // s.size
    lo, hi = s.rank * mine, (s.rank + 1) * mine
    return [(lo, hi), (inter + lo, inter + hi)], (lo, hi)


def _lora_cuts(cfg, s: TPSplit) -> tuple[dict, dict]:
    """(out columns of each column-parallel linear, in rows of each row-parallel one) of a decoder layer."""
    d = s.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    qh, kh = s.q_heads(), s.kv_heads()
    gate_up, down = _mlp_cuts(cfg.intermediate_size, s)
    return ({"qkv": [(qh.start * d, qh.stop * d), (q + kh.start * d, q + kh.stop * d),
                     (q + kv + kh.start * d, q + kv + kh.stop * d)], "gate_up": gate_up},
            {"o": (qh.start * d, qh.stop * d), "down": down})


def _mla_lora_cuts(cfg, s: TPSplit, i: int) -> tuple[dict, dict]:
    """_lora_cuts for DeepSeek's linears (atomd/model/deepseek_lora.py): qkv_a whole but for q_proj's
    heads (no q_lora), q_b by heads, o by heads' value inputs, the dense MLP's or shared experts' rows."""
    qh, qk = s.q_heads(), cfg.qk_head_dim
    q = cfg.q_lora_rank or cfg.num_heads * qk
    qkv_a = [(0, q + cfg.latent_dim)] if cfg.q_lora_rank else \
        [(qh.start * qk, qh.stop * qk), (q, q + cfg.latent_dim)]
    inter = cfg.moe_intermediate_size * cfg.n_shared_experts if i in cfg.sparse_layers else cfg.intermediate_size
    gate_up, down = _mlp_cuts(inter, s)
    return ({"qkv_a": qkv_a, "q_b": [(qh.start * qk, qh.stop * qk)], "gate_up": gate_up},
            {"o": (qh.start * cfg.v_head_dim, qh.stop * cfg.v_head_dim), "down": down})


def load_tp_adapter(name: str, path: str, cfg, split: TPSplit, dtype: torch.dtype, max_rank: int):
    """The PEFT adapter at `path`, checked against the whole model `cfg`, as worker `split.rank` runs it."""
    from atomd.model.deepseek_lora import load_deepseek_adapter
    from atomd.model.lora import load_adapter

    load = load_deepseek_adapter if getattr(cfg, "kv_lora_rank", 0) else load_adapter  # MLA's linears
    return shard_adapter(load(name, path, cfg, dtype, max_rank), split, cfg)
