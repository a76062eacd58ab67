"""The decoder-only transformer every family runs (atomd/model/registry.py): the layers'
weights, packing at load, and the forward over a paged KV cache. A family's file (llama.py,
qwen3.py, ...) says how its config and tensor names map onto this.

Plain tensors, no nn.Module: the weights are packed at load time (one QKV and one
gate/up matmul per layer, MoE experts stacked) so a decode step is a handful of large
matmuls per layer. Tokens arrive packed (`[T]`, several sequences back to back); attention
reads each sequence's context from the paged cache as described by `AttentionMetadata`.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from atomd.engine.kv_cache import AttentionMetadata, KVCache, KVGeometry
from atomd.kernels import cbuild
from atomd.model import huge_pages, layer_ops, moe as moe_mod, quant
from atomd.model.attention import paged_attention, qk_norm_
from atomd.model.config import ModelConfig
from atomd.model.huge_pages import on_huge_pages, release_freed_memory
from atomd.model.layer_ops import rms_norm, rope_, rope_store_, silu_mul
from atomd.model.linear import GEMV_ENV, GEMV_MAX_BYTES, dense, linear, linear_f32, pack_linear_weight
from atomd.model.lora import LayerLora, LoraStep
from atomd.model.moe import MoeWeights, moe, moe_tp
from atomd.model.quant import QuantizedWeight
from atomd.model.rotary import long_rope_positions, rope_tables

log = logging.getLogger(__name__)

# A long prefill runs everything after attention this many float32 rows at a time, 4x as many
# in bf16: the [rows, 2 * intermediate] MLP activations then stay in cache (float32 8 x 512:
# ~13% faster than one tile), and in bf16 oneDNN's down projection gets rows enough to use
# both threads (K 1536 -> N 576 runs on one thread up to M = 1280). Steady state, separate
# processes, 135M shape bf16: 1024 rows 5.9k tok/s, 2048 6.9k, 4096 6.8k; small shape 25.3k /
# 30.2k / 28.9k; float32 512 / 1024 / 2048 rows within 2% (benchmarks/results/offline.md). 4x
# too where the layers' linears are 16-bit weights with float32 compute (`--dtype auto` without
# bf16 arithmetic): each tile reads those weights from memory again and widens them in registers;
# Qwen3-0.6B's prefill 1.04x faster at 2048 rows than at 512 on both such kinds (RESULTS.md, #35
# session 27). DecoderModel.prefill_row_tile
ROW_TILE = 512
KV_LAYOUT_VERSION = "atomd-kv-1"  # block-major [layers, k|v, block_size, kv_heads, head_dim]


class TensorSource(Protocol):
    """Tensor name -> tensor of the checkpoint (atomd/model/loader.py)."""

    def __contains__(self, name: str) -> bool: ...

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor: ...


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]: q, k, v stacked
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor | None  # [2 * intermediate, hidden]: gate, up stacked; None: an MoE layer
    down: torch.Tensor | None
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [head_dim], with k_norm: ModelConfig.qk_norm
    k_norm: torch.Tensor | None = None
    moe: MoeWeights | None = None  # the sparse MLP in place of gate_up / down
    pre_mlp_norm: torch.Tensor | None = None  # Gemma's norms around the MLP (post_norm: after attention)
    post_mlp_norm: torch.Tensor | None = None
    # plain row-major copies of qkv, o, gate_up, down for batch-1 decode (DecoderModel._pack_weights);
    # a quantized linear's is its packed weight as it is
    rows: tuple[torch.Tensor | QuantizedWeight | None, ...] | None = None

    def linears(self) -> list[torch.Tensor]:
        return [t for t in (self.qkv, self.o, self.gate_up, self.down) if t is not None]


def cat(src: TensorSource, names: list[str], dtype: torch.dtype) -> torch.Tensor | QuantizedWeight:
    parts = [src.get(n, dtype) for n in names]
    if isinstance(parts[0], QuantizedWeight):
        return quant.cat(parts)
    return torch.cat(parts, dim=0).contiguous()


@dataclass
class DecoderModel:
    config: ModelConfig
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor | QuantizedWeight
    max_positions: int
    cos: torch.Tensor = field(init=False)  # [max_positions (x 2: longrope's long rows), head_dim // 2]
    sin: torch.Tensor = field(init=False)
    lm_head_rows: torch.Tensor | None = field(init=False, default=None)  # plain lm_head, batch-1 decode
    decode_layer: layer_ops.DecodeLayer | None = field(init=False, default=None)  # batch-1 decode in C
    # the torch decode path's workspace (atomd/engine/runner.py) copies this model's cache as k, v
    # heads; False: the model's cache has another layout (MLA's latent) and it gathers what it reads
    paged_kv_heads = True
    ep: Any = field(init=False, default=None)  # the ranks' ExpertParallel (use_expert_parallel)
    tp: Any = field(init=False, default=None)  # this worker's TensorParallel (use_tensor_parallel)
    # TP x EP (load_model): TP rank 0 holds its DP rank's routed experts whole and runs the exchange, the
    # other TP ranks none (routed_experts)
    tp_experts_rank0: bool = field(init=False, default=False)

    # ------------------------------------------------------------------ the family's part

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any], arch: str) -> ModelConfig:
        return ModelConfig.from_hf(hf, arch)

    @classmethod
    def tensor_source(cls, src: TensorSource, cfg: ModelConfig) -> TensorSource:
        """The checkpoint's tensors under HF's text-model names (a family whose checkpoints
        nest them elsewhere maps them)."""
        return src

    @classmethod
    def load_layer(cls, src: TensorSource, cfg: ModelConfig, i: int, dtype: torch.dtype) -> LayerWeights:
        """Layer i under HF's Llama names (model.layers.i.self_attn.q_proj, mlp.gate_proj, ...);
        a sparse layer's MLP through load_moe."""
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        qkv = [f"{attn}{n}_proj" for n in "qkv"]
        w = LayerWeights(
            input_norm=src.get(p + "input_layernorm.weight", dtype),
            qkv=cat(src, [n + ".weight" for n in qkv], dtype),
            o=src.get(attn + "o_proj.weight", dtype),
            post_norm=src.get(p + "post_attention_layernorm.weight", dtype), gate_up=None, down=None)
        if i in cfg.sparse_layers:
            w.moe = cls.load_moe(src, cfg, p, dtype)
            w.moe.first_expert = cfg.local_experts.start
        else:
            gate_up = [mlp + "gate_proj", mlp + "up_proj"]
            w.gate_up, w.down = cat(src, [n + ".weight" for n in gate_up], dtype), src.get(mlp + "down_proj.weight", dtype)
            if cfg.mlp_bias:
                w.gate_up_bias = cat(src, [n + ".bias" for n in gate_up], dtype)
                w.down_bias = src.get(mlp + "down_proj.bias", dtype)
        if cfg.qkv_bias:
            w.qkv_bias = cat(src, [n + ".bias" for n in qkv], dtype)
        if cfg.o_bias:
            w.o_bias = src.get(attn + "o_proj.bias", dtype)
        if cfg.qk_norm:
            w.q_norm, w.k_norm = src.get(attn + "q_norm.weight", dtype), src.get(attn + "k_norm.weight", dtype)
        return w

    @classmethod
    def load_moe(cls, src: TensorSource, cfg: ModelConfig, prefix: str, dtype: torch.dtype) -> MoeWeights:
        raise NotImplementedError(f"{cfg.architecture} has no sparse layers")

    # ------------------------------------------------------------------ shared

    def __post_init__(self) -> None:
        self.cos, self.sin = rope_tables(self.config, self.max_positions, self.embed.dtype)
        self._pack_weights()
        release_freed_memory()  # load's float32 reads and the moved weights (engine/allocator.py keeps freed pages)
        layer_ops.kernels()  # compiled (once per machine) at load, not inside the first request
        cfg, first = self.config, self.layers[0]
        if first.rows is None:
            return
        quantized = [isinstance(t, QuantizedWeight) for t in first.linears()]
        if any(quantized) and not (all(quantized) and self.dtype == torch.float32
                                   and all(t.perm is None for w in self.layers for t in w.linears())):
            log.info("quantized linears: batch-1 decode runs per op (the int8 / int4 GEMV per linear): the fused "
                     "C layer takes float32 activations, every linear quantized, no act-order permutation")
            return
        missing = self.unfused_reason()
        if missing:
            log.info("%s: batch-1 decode falls back to the per-op path (the GEMV kernel per linear%s): "
                     "the fused C layer has no %s", cfg.architecture, " and chosen expert" if cfg.sparse_layers else "",
                     missing)
            return
        strips = {t.panels_layout for w in self.layers for t in w.linears() if isinstance(t, QuantizedWeight)
                  and t.strips_only}
        if strips - {layer_ops.kernels().w16_layout}:  # (the two builds come from one $ATOMD_KERNEL_ISA)
            raise RuntimeError("the layer kernels read another 16-bit layout than the quantized kernels packed: "
                               f"builds of two ISAs (${cbuild.ISA_ENV} changed during load?)")
        self.decode_layer = layer_ops.DecodeLayer(self.dtype, cfg.hidden_size, cfg.intermediate_size,
                                                  cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                                                  quantized=any(quantized))

    def unfused_reason(self) -> str | None:
        """What this model has that the fused batch-1 C layer (layer_ops.DecodeLayer) does not, or None."""
        first = self.layers[0]
        for m in (w.moe for w in self.layers if w.moe is not None):
            if m.quantized and (self.dtype != torch.float32 or not moe_mod.Q8 or m.q8_experts() is None
                                or max(m.down[0].in_features, m.gate_up[0].in_features) > layer_ops.Q8_OWN_K):
                return "MoE block with quantized experts outside moe_q8 (layer_ops.moe_q8_kind, int8 activations)"
            if not m.quantized and not m.gemv:
                return "MoE block whose experts have no GEMV kernel here"
            if m.router.shape[0] > layer_ops.MOE_MAX_EXPERTS or m.top_k > layer_ops.MOE_MAX_K:
                return f"MoE block routing to more than {layer_ops.MOE_MAX_K} of {layer_ops.MOE_MAX_EXPERTS} experts"
        if first.o_bias is not None or first.gate_up_bias is not None or first.down_bias is not None:
            return "o_proj / MLP bias"
        return None

    def kv_geometry(self) -> KVGeometry:
        """What the paged cache holds per token and layer: a key and a value per KV head."""
        return KVGeometry(2, self.config.num_kv_heads, self.config.head_dim, KV_LAYOUT_VERSION)

    def attention_shape(self) -> tuple[int, int]:
        """(head size, query heads per KV head) of the native attention kernels this model runs."""
        return self.config.head_dim, self.config.num_heads // self.config.num_kv_heads

    def rope(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos, sin tables of layer `layer` (one pair for every layer here)."""
        return self.cos, self.sin

    # qk_norm_ below is layer_ops.qk_norm_ (plain RMSNorm per head), which rope_store_ may run in its own
    # pass; a family whose q / k norm is another (Gemma's (1 + w)) sets False
    plain_qk_norm = True

    def qk_norm_(self, qkv: torch.Tensor, w: LayerWeights) -> None:
        cfg = self.config
        qk_norm_(qkv, w.q_norm, w.k_norm, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)

    def _pack_weights(self) -> None:
        """Reorder the linear weights once, in place, into oneDNN's blocked layout: in
        float32 the packed matmul runs ~1.2x / 1.8x / 1.2x F.linear at M = 1 / 16 / 4096 on
        the AMD CPU kind (benchmarks/results/offline_vllm.md; on Sapphire Rapids ~1.5x at
        M = 16 but ~0.7x at M = 1, where MKL's gemv wins); in bfloat16 it is what reaches the
        AVX512_BF16 / AMX kernels at all: 2-4x F.linear at M = 1 / 16 on the 135M shape's
        layers (F.linear in bf16 is slower than in float32 there). Where batch-1 decode keeps
        the plain rows (keep_rows) a packed weight is a second copy: the LM head, then layer
        after layer, are packed while those copies stay within GEMV_MAX_BYTES; the others run
        oneDNN on their plain rows at M > 1 (linear.linear: ~1.3x the packed time at M = 16,
        ~1.03x at M = 512 on the 0.6B shape). Without plain rows the packed weight replaces the
        plain one (held once). A tied lm_head gets its own packed copy: the embedding lookup
        needs the plain table. MoE experts stay plain, stacked [E, ...]: each expert's GEMM
        runs on its slice (and, where moe_amx runs, a second copy in its tile layout: MoeWeights.amx_weights)."""
        for w in self.layers:
            if w.moe is not None and moe_mod.AMX:
                w.moe.amx_weights()
        if self.dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
            return
        self._strips_only()
        rows = keep_rows(self)
        if rows:  # the weights as loaded, on huge pages (a tied head's rows: the embedding table)
            self._rows_on_huge_pages()
            self.lm_head_rows = None if isinstance(self.lm_head, QuantizedWeight) else self.lm_head.contiguous()
            for w in self.layers:
                w.rows = tuple(t if t is None or isinstance(t, QuantizedWeight) else t.contiguous()
                               for t in (w.qkv, w.o, w.gate_up, w.down))
        if self.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            # oneDNN refuses to pack bf16 without AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT: F.linear
            log.warning("bfloat16 weights stay unpacked: this CPU has no oneDNN bf16 path (float32 is faster here)")
            return
        left = GEMV_MAX_BYTES if rows else math.inf  # bytes of second (packed) copies still allowed
        left -= self._prepack_16bit_panels(GEMV_MAX_BYTES)
        if not isinstance(self.lm_head, QuantizedWeight) and self.lm_head.nbytes <= left:
            left -= self.lm_head.nbytes
            self.lm_head = pack_linear_weight(self.lm_head)
        for i, w in enumerate(self.layers):  # quantized linears are packed already (atomd/model/quant.py)
            size = sum(t.nbytes for t in w.linears() if isinstance(t, torch.Tensor))
            if size > left:
                log.info("layers %d-%d stay plain (one copy): packing them would pass the %d MiB of second copies "
                         "beside batch-1 decode's plain rows", i, len(self.layers) - 1, GEMV_MAX_BYTES >> 20)
                break
            left -= size
            w.qkv, w.o, w.gate_up, w.down = (t if t is None or isinstance(t, QuantizedWeight) else pack_linear_weight(t)
                                             for t in (w.qkv, w.o, w.gate_up, w.down))

    def _prepack_16bit_panels(self, budget: int) -> int:
        """16-bit weights (`--quantization bf16 / fp16`, float32 compute): each layer's, then the LM head's, packed
        once into the panels a batch's decode step and prefill read (quant.prepack_panels: a second copy beside the
        rows batch-1 decode streams) while those copies stay within `budget` bytes; the rest are packed per call
        (an AVX2 build's are strips only already: _strips_only). Returns the bytes kept."""
        used, left_out = 0, 0
        for t in self._16bit_weights():
            if t.strips_only:
                continue
            if left_out or used + quant.panel_bytes(t) > budget:
                left_out += 1
            else:
                used += quant.prepack_panels(t)
        if used or left_out:
            log.info("16-bit weights: %d MiB of panels packed at load for batches and prefill%s", used >> 20,
                     f"; {left_out} weights packed per call instead (the {budget >> 20} MiB of second copies)"
                     if left_out else "")
        return used

    def _16bit_weights(self) -> list[QuantizedWeight]:
        return [t for t in [t for w in self.layers for t in w.linears()] + [self.lm_head]
                if isinstance(t, QuantizedWeight) and t.bits == 16]

    def _strips_only(self) -> None:
        """On an AVX2 build, held as their strips only (quant.keep_strips_only: one copy, no budget, read at every
        batch size, batch-1 decode too), before _rows_on_huge_pages moves the layers' and the head's: every 16-bit
        weight (layers, LM head, MoE experts), and the int8 / int4 MoE experts with int8 activations
        (quant.INT_STRIPS: the int8 GEMM's products at every count of rows, without a panel packed per call; at the
        ~2 rows an expert of a batch-16 MoE block the int8-activation rows were bound by their ALU work). Not the
        layers' or the head's int weights: at one row streamed from memory the strips took 1.04-1.25x the rows' time
        (RESULTS.md, #35 int8 / int4 MoE experts held as strips)."""
        experts = [t for w in self.layers if w.moe is not None for t in w.moe.linears()]
        strips = sum(quant.keep_strips_only(t) for t in self._16bit_weights() + [t for t in experts if t.bits == 16])
        held = sum(quant.keep_strips_only(t) for t in experts if t.bits != 16 and quant.INT_STRIPS)
        if strips:
            log.info("16-bit weights: %d MiB held once, as strips read at every batch size", strips >> 20)
        if held:
            log.info("int8 / int4 MoE experts: %d MiB held once, as the int8 GEMM's strips read at every batch size",
                     held >> 20)

    def _rows_on_huge_pages(self) -> None:
        """Move what batch-1 decode streams (every layer linear, float MoE experts, the LM head, plain or quantized) onto 2 MiB
        pages (atomd/model/huge_pages.py: ~1.2x the GEMV's read rate), one tensor at a time,
        every reference rebound (a tied head is the embedding table); the tensors too small
        for a huge page of their own share one mapping, in layer order (huge_pages.side_by_side)."""
        small = []  # (owner, attribute) of each tensor left for the shared mapping

        def move(owner, name):
            t = getattr(owner, name)
            if isinstance(t, QuantizedWeight):  # its packed values and scales (or strips); its C struct made again
                for part in ("q", "scales", "offsets", "panels"):
                    move(t, part)
                t._ref = None
            elif t is not None and t.numel():  # an empty one (a TP x EP worker's experts) stays
                t = t.contiguous()
                setattr(owner, name, on_huge_pages(t))
                if t.nbytes < huge_pages.MIN_BYTES:
                    small.append((owner, name))
        tied = self.lm_head is self.embed
        move(self, "lm_head")
        if tied:
            self.embed = self.lm_head
        small.clear()  # the head's small parts (an int8 head's scales) stay where they are
        for w in self.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                move(w, name)
            if w.moe is not None and not w.moe.quantized:  # a token reads k experts' rows of these
                move(w.moe, "gate_up")
                move(w.moe, "down")
        if small:
            for (owner, name), t in zip(small, huge_pages.side_by_side([getattr(o, n) for o, n in small])):
                setattr(owner, name, t)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache, logits_indices: torch.Tensor, lora: LoraStep | None = None,
                hidden_indices: torch.Tensor | None = None):
        """Logits [len(logits_indices), vocab] of the packed tokens at `logits_indices`; with
        `hidden_indices` (a prefill pooling embeddings), (logits, the final-normed hidden states
        [len(hidden_indices), hidden] of those tokens).
        Each residual add is fused with the RMSNorm after it (atomd/model/layer_ops.py):
        h holds the normed input of the next matmul, x the residual stream. `lora`: the
        step's rows by adapter (atomd/model/lora.py); their deltas go onto every linear."""
        cfg = self.config
        if positions.numel() and int(positions.max()) >= self.max_positions:  # the C RoPE reads its tables there
            raise IndexError(f"position {int(positions.max())} past the {self.max_positions} the model was loaded for")
        x = self.embed_tokens(input_ids)
        h = self.norm_rows(x, self.layers[0].input_norm)
        positions = self.rope_rows(positions.contiguous(), meta)  # from here on: rows of the RoPE tables
        if lora is not None and not lora.groups:
            lora = None
        rows, fused = x.shape[0], self._fused_decode(meta, kv_cache, lora)
        kinds = self._rows_kinds(rows, meta) if fused and rows > 1 else None
        if fused and (rows == 1 or kinds is not None):  # every layer in one C call
            if rows == 1:
                self._decode_one_row(x, h, positions, meta, kv_cache)
            else:
                self.decode_layer.run_rows(self.layers, [cfg.window(i) for i in range(len(self.layers))], h, x,
                                           self.cos, self.sin, positions, kv_cache.slot_rows(meta), kinds,
                                           meta.kernels, kv_cache, meta.block_tables, meta.context_lens, cfg.attn_scale,
                                           (*moe_mod.q8_min_m(layer_ops.moe_q8_kind()), quant.QGEMM_W16_MIN_M))
            return linear(rms_norm(x[logits_indices], self.norm, cfg.rms_norm_eps), self.lm_head, None,
                          self.lm_head_rows)
        slot_rows = kv_cache.slot_rows(meta)
        q_end, k_end = cfg.q_size, cfg.q_size + cfg.kv_size
        step = self.prefill_row_tile(x.dtype)
        if self.ep is not None:  # one exchange per sparse layer and step on every rank: one tile
            step = max(x.shape[0], 1)
        tiles = [(slice(r, r + step), lora and lora.tile(r, r + step)) for r in range(0, x.shape[0], step)]
        every_row = lora and lora.tile(0, x.shape[0])
        for i, w in enumerate(self.layers):
            qkv = self._qkv_stored(h, w, i, positions, slot_rows, meta, kv_cache, every_row and every_row.layer(i))
            q = qkv[:, :q_end].view(-1, cfg.num_heads, cfg.head_dim)
            k = qkv[:, q_end:k_end].view(-1, cfg.num_kv_heads, cfg.head_dim)
            v = qkv[:, k_end:].view(-1, cfg.num_kv_heads, cfg.head_dim)
            attn = paged_attention(q, k, v, kv_cache, i, meta, cfg.window(i), cfg.attn_scale)
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else None
            for tile, rows in tiles:
                self._attn_out_and_mlp(x[tile], attn[tile], w, next_norm, h[tile], rows and rows.layer(i))
        logits = self.logits(self.norm_rows(x[logits_indices], self.norm))
        if hidden_indices is not None:
            return logits, self.norm_rows(x[hidden_indices], self.norm)
        return logits

    def use_expert_parallel(self, ep: Any) -> None:
        """Run the sparse layers across the ranks through `ep` (atomd/model/expert_parallel.py);
        this model holds its slice of the experts (load_model's expert_shard)."""
        self.ep = ep
        if self.decode_layer is not None:
            log.info("expert parallelism: batch-1 decode runs per op (the fused C layer has no exchange)")
            self.decode_layer = None
        for w in self.layers:
            if w.moe is not None:
                # the AMX copies freed and moe_q8's arrays dropped (unfused_reason made them at load): ep rewrites the
                # expert slots
                w.moe.ep, w.moe.amx, w.moe.q8 = ep, (), ()
                ep.attach(w.moe)

    def use_tensor_parallel(self, tp: Any) -> None:
        """Run as one worker of tensor parallelism through `tp` (atomd/model/tensor_parallel.py);
        this model holds its shard (load_model's tp_split). The fused batch-1 C layer does a whole
        layer in one call, with no place for the all-reduces: batch-1 decode runs per op."""
        self.tp = tp
        if self.decode_layer is not None:
            log.info("tensor parallelism: batch-1 decode runs per op (the fused C layer has no all-reduce)")
            self.decode_layer = None
        if self.dtype == torch.bfloat16:  # row_parallel's float32 partials read the plain weights: packed copies go
            for w in self.layers:
                self.unpack_row_parallel(w)

    def unpack_row_parallel(self, w: LayerWeights) -> None:
        """A bf16 TP layer's row-parallel linears (o, down) as plain weights (their float32 partials)."""
        rows = w.rows or (None,) * 4
        w.o, w.down = _plain(w.o, rows[1]), _plain(w.down, rows[3])

    def reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """A row-parallel linear's output summed over the TP workers (as it is without TP)."""
        return t if self.tp is None else self.tp.reduce_(t)

    def row_parallel(self, lora: LayerLora | None, fused: str, x: torch.Tensor, weight, bias, rows) -> torch.Tensor:
        """lora_linear of a row-parallel linear (o, down) summed over the TP workers. In bf16 each
        worker's partial stays float32 into the all-reduce and the sum is rounded once, as TP=1's
        one dot is: partials rounded to bf16 first leave TP=1's greedy ids (Phi-3)."""
        if self.tp is None or x.dtype != torch.bfloat16 or not isinstance(weight, torch.Tensor):
            return self.reduce_(lora_linear(lora, fused, x, weight, bias, rows))
        return self.tp.reduce_(row_partial(lora, fused, x, weight, bias)).to(x.dtype)

    def routed_experts(self, h: torch.Tensor, w: MoeWeights,
                       routed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """moe(), but under TP x EP (tp_experts_rank0) zeros on a TP rank other than 0: rank 0's
        block output (its exchange with the other DP ranks' rank 0) is then the all-reduce's sum,
        to the bit (x + 0), so TP x EP computes EP's values."""
        if self.tp_experts_rank0 and w.ep is None:
            return torch.zeros_like(h)
        return moe(h, w, routed)

    def idle_forward(self) -> None:
        """A rank with nothing to run this step: its part in every sparse layer's exchange
        (no tokens of its own, its experts for the others'), so the ranks' collectives match."""
        empty = torch.empty(0, self.config.hidden_size, dtype=self.dtype)
        for w in self.layers:
            if w.moe is not None:
                self.ep.moe(empty, w.moe)

    def rope_rows(self, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Each token's row of the RoPE tables: its position, or with longrope's long rows
        (atomd/model/rotary.py) the long one where its sequence reaches past the original length
        in this step."""
        if self.cos.shape[0] == self.max_positions:
            return positions
        original = self.config.rope_scaling["original_max_position_embeddings"]
        if not positions.numel() or int(positions.max()) < original:
            return positions
        return long_rope_positions(positions, step_last_positions(positions, meta), original, self.max_positions)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:  # this worker's vocabulary rows
            return self.tp.embed(input_ids, self.embed)
        return F.embedding(input_ids, self.embed)

    def norm_rows(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The model's RMSNorm of rows x [T, hidden] (a new tensor)."""
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """LM head of the final-normed rows x (with TP: every worker's vocabulary rows gathered)."""
        logits = linear(x, self.lm_head, None, self.lm_head_rows)
        return logits if self.tp is None else self.tp.gather_logits(logits)

    def _qkv_stored(self, h: torch.Tensor, w: LayerWeights, i: int, positions: torch.Tensor,
                    slot_rows: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache,
                    lora: LayerLora | None = None) -> torch.Tensor:
        """qkv [T, width] of the rows h: projected (plus the LoRA deltas), q/k normed where the
        family has it, RoPE'd, and its key and value rows stored in layer i's cache slots."""
        cfg = self.config
        qkv = linear(h, w.qkv, w.qkv_bias, w.rows and w.rows[0])
        if lora is not None:
            lora.add("qkv", h, qkv)
        fused = w.q_norm is not None and self.plain_qk_norm  # the q / k norm inside rope_store_'s pass
        if w.q_norm is not None and not fused:
            self.qk_norm_(qkv, w)
        cos, sin = self.rope(i)
        if not rope_store_(qkv, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cos, sin, positions,
                           kv_cache.kv, slot_rows, i * 2 * kv_cache.block_size, kv_cache.block_size,
                           (w.q_norm, w.k_norm, cfg.rms_norm_eps) if fused else None):
            if fused:
                self.qk_norm_(qkv, w)
            rope_(qkv, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim, cos, sin, positions)
            k_end = cfg.q_size + cfg.kv_size
            kv_cache.write(i, meta, qkv[:, cfg.q_size:k_end].view(-1, cfg.num_kv_heads, cfg.head_dim),
                           qkv[:, k_end:].view(-1, cfg.num_kv_heads, cfg.head_dim))
        return qkv

    def _fused_decode(self, meta: AttentionMetadata, kv_cache: KVCache, lora: LoraStep | None) -> bool:
        """Whether this step may run its layers in one C call (layer_ops.DecodeLayer): a decode step without LoRA
        over the native attention kernels and a cache the C layer stores into."""
        return (self.decode_layer is not None and lora is None and meta.kernels is not None and not meta.is_prefill
                and (not kv_cache.narrow or layer_ops.fused_kv_narrow(self.dtype, kv_cache)))

    def _rows_kinds(self, rows: int, meta: AttentionMetadata) -> torch.Tensor | None:
        """For a fused decode step of rows >= 2 (_fused_decode), the products DecodeLayer.run_rows runs them with,
        or None: per op (drafts in the step, float linears, more rows than a tile, a product the C call has not:
        rows_kinds_for)."""
        fused = self.decode_layer
        # (past ROW_TILE rows the per-op path runs its tiles' products, which the C call's one R would not be)
        if fused.rows_fn is None or not 2 <= rows <= ROW_TILE or meta.query_starts is not None:
            return None
        return fused.rows_kinds_for(rows, self.layers)

    def _decode_one_row(self, x: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                        kv_cache: KVCache) -> None:
        """Batch-1 decode through layer_ops.DecodeLayer: every layer in one C call (QKV, the q/k
        norm where the family has one, RoPE, the KV write, attention, the rest of the layer).
        x ends as the last layer's residual stream."""
        cfg, fused = self.config, self.decode_layer
        half, position = cfg.head_dim // 2 * self.cos.element_size(), int(positions[0])
        cos, sin = self.cos.data_ptr() + position * half, self.sin.data_ptr() + position * half
        k_dst, v_dst, layer_bytes = kv_cache.slot_addresses(int(meta.slot_blocks[0]), int(meta.slot_offsets[0]))
        fused.run_layers(self.layers, [cfg.window(i) for i in range(len(self.layers))], h, x, cos, sin, k_dst,
                         v_dst, layer_bytes, meta.kernels, kv_cache, meta.block_tables, meta.context_lens,
                         cfg.attn_scale)

    def prefill_row_tile(self, dtype: torch.dtype) -> int:
        """Rows a tile of a long prefill's part after attention, for activations of `dtype` (ROW_TILE's why)."""
        wide = dtype == torch.bfloat16 or any(isinstance(t, QuantizedWeight) and t.bits == 16
                                              for t in self.layers[0].linears())
        return ROW_TILE * (4 if wide else 1)

    def _attn_out_and_mlp(self, x: torch.Tensor, attn: torch.Tensor, w: LayerWeights,
                          next_norm: torch.Tensor | None, next_h: torch.Tensor, lora: LayerLora | None = None) -> None:
        """The rest of the layer after attention on these rows: the residual x updated in
        place, and (unless this is the last layer) the next layer's normed input written to
        next_h. `lora`: these rows' adapter deltas (a tile's rows, this layer)."""
        rows = w.rows or (None,) * 4
        h = self._add_norm(lora, "o", attn, w.o, w.o_bias, rows[1], x, w.post_norm,
                           torch.empty_like(x, memory_format=torch.contiguous_format))
        if w.moe is not None:
            if self.tp is None:
                down = moe(h, w.moe)
            elif self.tp_experts_rank0:
                down = self.reduce_(self.routed_experts(h, w.moe))
            else:
                down = moe_tp(h, w.moe, self.tp.reduce_)
            add_then_norm(x, down, next_norm, self.config.rms_norm_eps, next_h)
            return
        act = None  # (silu in the gate_up product where the build has it: quant.qlinear_silu)
        if lora is None and w.gate_up_bias is None and isinstance(w.gate_up, QuantizedWeight):
            act = quant.qlinear_silu(h, w.gate_up)
        if act is None:
            act = silu_mul(lora_linear(lora, "gate_up", h, w.gate_up, w.gate_up_bias, rows[2]))
        self._add_norm(lora, "down", act, w.down, w.down_bias, rows[3], x, next_norm, next_h)

    def _add_norm(self, lora: LayerLora | None, fused: str, act: torch.Tensor, weight, bias, rows, x: torch.Tensor,
                  norm: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        """x += the row-parallel linear `fused` of act, then out = RMSNorm(x) * norm (no norm: x alone, the last
        layer); in the product's own pass where the build has it (quant.qlinear_add_norm: a 16-bit weight's AVX2
        strips, no LoRA, bias or TP)."""
        eps = self.config.rms_norm_eps
        if (norm is not None and lora is None and bias is None and self.tp is None
                and isinstance(weight, QuantizedWeight) and quant.qlinear_add_norm(act, weight, x, norm, eps, out)):
            return out
        return add_then_norm(x, self.row_parallel(lora, fused, act, weight, bias, rows), norm, eps, out)


def add_then_norm(x: torch.Tensor, delta: torch.Tensor, norm: torch.Tensor | None, eps: float,
                  out: torch.Tensor) -> torch.Tensor:
    """x += delta, then out = RMSNorm(x) * norm (the next layer's input, rms_norm's one pass); no norm (the last
    layer): x alone."""
    if norm is None:
        return x.add_(delta)
    return rms_norm(x, norm, eps, delta=delta, out=out)


def _plain(weight, rows):
    """A float weight as a plain tensor: its batch-1 rows where kept (the same weight, no copy), else
    unpacked; a quantized weight or None as it is."""
    if not isinstance(weight, torch.Tensor):
        return weight
    return rows if rows is not None else dense(weight)


def row_partial(lora: LayerLora | None, fused: str, x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """A TP worker's float32 partial of a row-parallel bf16 linear (a plain weight) plus its LoRA
    delta (lora.add's bf16), for an all-reduce in float32 (DecoderModel.row_parallel)."""
    out = linear_f32(x, weight, bias)
    if lora is not None:
        out.add_(lora.add(fused, x, x.new_zeros(out.shape)))
    return out


def lora_linear(lora: LayerLora | None, fused: str, x: torch.Tensor, weight, bias, rows) -> torch.Tensor:
    """linear(x, weight, bias, rows) plus the LoRA deltas of the fused linear `fused`, if any."""
    out = linear(x, weight, bias, rows)
    return out if lora is None else lora.add(fused, x, out)


def step_last_positions(positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Per token, the furthest position of the transformers forward that would compute it: a
    prefill chunk's last row (transformers runs a prompt in one forward), a decode row's own
    (one forward per token), also for a decode row's drafts (each as if decoded alone)."""
    if not meta.is_prefill or meta.verify:
        return positions
    ends = torch.tensor([s.end for s in meta.seqs], dtype=torch.int64)
    return torch.repeat_interleave(positions[ends - 1], torch.tensor([s.end - s.start for s in meta.seqs]))


def keep_rows(model: DecoderModel) -> bool:
    """Keep plain rows of the linear weights for batch-1 decode (layer_ops.gemv): where the
    kernel runs the model's dtype, unless $ATOMD_GEMV=0. The rows are the weights as loaded,
    moved onto huge pages (held once); DecoderModel._pack_weights bounds the packed copies beside them."""
    return os.environ.get(GEMV_ENV) != "0" and layer_ops.has_decode_layer(model.dtype)
