"""The Llama family (Llama incl. llama3 RoPE scaling, Mistral, Qwen2) over a paged KV cache.

Plain tensors, no nn.Module: the weights are packed at load time (one QKV and one
gate/up matmul per layer) so a decode step is a handful of large matmuls per layer.
Tokens arrive packed (`[T]`, several sequences back to back); attention reads each
sequence's context from the paged cache as described by `AttentionMetadata`.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from atomd.kv_cache import AttentionMetadata, KVCache
from atomd.model import layer_ops
from atomd.model.layer_ops import rms_norm, rope_, rope_store_, silu_mul
from atomd.native import decode_attention, prefill_attention

log = logging.getLogger(__name__)

# A long prefill runs everything after attention this many float32 rows at a time, 4x as many
# in bf16: the [rows, 2 * intermediate] MLP activations then stay in cache (float32 8 x 512:
# ~13% faster than one tile), and in bf16 oneDNN's down projection gets rows enough to use
# both threads (K 1536 -> N 576 runs on one thread up to M = 1280). Steady state, separate
# processes, 135M shape bf16: 1024 rows 5.9k tok/s, 2048 6.9k, 4096 6.8k; small shape 25.3k /
# 30.2k / 28.9k; float32 512 / 1024 / 2048 rows within 2% (benchmarks/results/offline.md)
ROW_TILE = 512
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                           "Qwen2ForCausalLM": "qwen2"}


@dataclass
class ModelConfig:
    """The fields of an HF config.json this implementation uses."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    eos_token_id: Any = None
    bos_token_id: Any = None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported architecture {archs or hf.get('model_type')!r}: "
                             f"supported are {', '.join(SUPPORTED_ARCHITECTURES)}")
        quant = hf.get("quantization_config")
        if quant:  # its tensors are packed integers or fp8 with scales: cast as floats they are garbage
            method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
            raise ValueError(f"quantized checkpoint ({method}) is not supported yet: "
                             f"atomd loads float16, bfloat16 and float32 weights only")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r} for {arch} (only silu)")
        heads = hf["num_attention_heads"]
        # transformers 5 writes rope_parameters; older checkpoints rope_theta + rope_scaling
        rope = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"}
                                            if rope.get("rope_type", "default") != "default" else None)
        family = SUPPORTED_ARCHITECTURES[arch]
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            architecture=arch, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
            num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or attention_bias, o_bias=family != "qwen2" and attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)), rope_scaling=scaling,
            sliding_window=hf.get("sliding_window") if hf.get("use_sliding_window", family == "mistral") else None,
            eos_token_id=hf.get("eos_token_id"), bos_token_id=hf.get("bos_token_id"))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]: q, k, v stacked
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]: gate, up stacked
    down: torch.Tensor
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    # plain row-major copies of qkv, o, gate_up, down for batch-1 decode (LlamaModel._pack_weights)
    rows: tuple[torch.Tensor, ...] | None = None


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies as transformers computes them (default, linear, llama3)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling rope_type {kind!r} (supported: default, linear, llama3)")


@dataclass
class LlamaModel:
    config: ModelConfig
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor
    max_positions: int
    cos: torch.Tensor = field(init=False)  # [max_positions, head_dim // 2]
    sin: torch.Tensor = field(init=False)
    lm_head_rows: torch.Tensor | None = field(init=False, default=None)  # plain lm_head, batch-1 decode
    decode_layer: layer_ops.DecodeLayer | None = field(init=False, default=None)  # batch-1 decode in C

    def __post_init__(self) -> None:
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), rope_inv_freq(self.config))
        self.cos = freqs.cos().to(self.embed.dtype)
        self.sin = freqs.sin().to(self.embed.dtype)
        self._pack_weights()
        layer_ops.kernels()  # compiled (once per machine) at load, not inside the first request
        cfg, first = self.config, self.layers[0]
        if first.rows is not None and first.o_bias is None and first.gate_up_bias is None and first.down_bias is None:
            self.decode_layer = layer_ops.DecodeLayer(self.dtype, cfg.hidden_size, cfg.intermediate_size,
                                                      cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)

    def _pack_weights(self) -> None:
        """Reorder every linear weight once, in place, into oneDNN's blocked layout: in
        float32 the packed matmul runs ~1.2x / 1.8x / 1.2x F.linear at M = 1 / 16 / 4096 on
        the AMD CPU kind (benchmarks/results/offline_vllm.md; on Sapphire Rapids ~1.5x at
        M = 16 but ~0.7x at M = 1, where MKL's gemv wins); in bfloat16 it is what reaches the
        AVX512_BF16 / AMX kernels at all: 2-4x F.linear at M = 1 / 16 on the 135M shape's
        layers (F.linear in bf16 is slower than in float32 there). The plain copies are
        dropped (a checkpoint's weights are held once); `dense()` reads a packed weight back.
        A tied lm_head gets its own packed copy: the embedding lookup needs the plain table."""
        if self.dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
            return
        if keep_rows(self):  # batch-1 decode reads plain rows (layer_ops.gemv): the copies stay too
            self.lm_head_rows = self.lm_head.contiguous()
            for w in self.layers:
                w.rows = (w.qkv.contiguous(), w.o.contiguous(), w.gate_up.contiguous(), w.down.contiguous())
        if self.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            # oneDNN refuses to pack bf16 without AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT: F.linear
            log.warning("bfloat16 weights stay unpacked: this CPU has no oneDNN bf16 path (float32 is faster here)")
            return
        self.lm_head = pack_linear_weight(self.lm_head)
        for w in self.layers:
            w.qkv, w.o = pack_linear_weight(w.qkv), pack_linear_weight(w.o)
            w.gate_up, w.down = pack_linear_weight(w.gate_up), pack_linear_weight(w.down)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache, logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits [len(logits_indices), vocab] of the packed tokens at `logits_indices`.
        Each residual add is fused with the RMSNorm after it (atomd/model/layer_ops.py):
        h holds the normed input of the next matmul, x the residual stream."""
        cfg = self.config
        if positions.numel() and int(positions.max()) >= self.max_positions:  # the C RoPE reads its tables there
            raise IndexError(f"position {int(positions.max())} past the {self.max_positions} the model was loaded for")
        x = F.embedding(input_ids, self.embed)
        h = rms_norm(x, self.layers[0].input_norm, cfg.rms_norm_eps)
        if self.decode_layer is not None and x.shape[0] == 1 and meta.kernels is not None and not meta.is_prefill:
            self._decode_one_row(x, h, int(positions[0]), meta, kv_cache)
            return linear(rms_norm(x[logits_indices], self.norm, cfg.rms_norm_eps), self.lm_head, None,
                          self.lm_head_rows)
        positions = positions.contiguous()
        slot_rows = kv_cache.slot_rows(meta)
        q_end, k_end = cfg.q_size, cfg.q_size + cfg.kv_size
        step = ROW_TILE * (4 if x.dtype == torch.bfloat16 else 1)  # rows a tile
        for i, w in enumerate(self.layers):
            qkv = linear(h, w.qkv, w.qkv_bias, w.rows and w.rows[0])
            q = qkv[:, :q_end].view(-1, cfg.num_heads, cfg.head_dim)
            k = qkv[:, q_end:k_end].view(-1, cfg.num_kv_heads, cfg.head_dim)
            v = qkv[:, k_end:].view(-1, cfg.num_kv_heads, cfg.head_dim)
            if not rope_store_(qkv, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.cos, self.sin, positions,
                               kv_cache.kv, slot_rows, i * 2 * kv_cache.block_size, kv_cache.block_size):
                rope_(qkv, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim, self.cos, self.sin, positions)
                kv_cache.write(i, meta, k, v)
            attn = paged_attention(q, k, v, kv_cache, i, meta)
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else None
            for rows in range(0, x.shape[0], step):
                tile = slice(rows, rows + step)
                self._attn_out_and_mlp(x[tile], attn[tile], w, next_norm, h[tile])
        x = rms_norm(x[logits_indices], self.norm, cfg.rms_norm_eps)
        return linear(x, self.lm_head, None, self.lm_head_rows)

    def _decode_one_row(self, x: torch.Tensor, h: torch.Tensor, position: int, meta: AttentionMetadata,
                        kv_cache: KVCache) -> None:
        """Batch-1 decode through layer_ops.DecodeLayer: per layer one C call before attention
        (QKV, RoPE, the KV write) and one after it (the rest of the layer); x ends as the
        last layer's residual stream."""
        cfg, fused = self.config, self.decode_layer
        half = cfg.head_dim // 2 * self.cos.element_size()
        cos, sin = self.cos.data_ptr() + position * half, self.sin.data_ptr() + position * half
        k_dst, v_dst, layer_bytes = kv_cache.slot_addresses(int(meta.slot_blocks[0]), int(meta.slot_offsets[0]))
        for i, w in enumerate(self.layers):
            qkv = fused.head(h, w.rows[0], w.qkv_bias, cos, sin, k_dst + i * layer_bytes, v_dst + i * layer_bytes)
            q = qkv[:, :cfg.q_size].view(1, cfg.num_heads, cfg.head_dim)
            attn = decode_attention(meta.kernels, q, kv_cache, i, meta.block_tables, meta.context_lens)
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else None
            fused.tail(attn, x, w.rows, w.post_norm, next_norm, h)

    def _attn_out_and_mlp(self, x: torch.Tensor, attn: torch.Tensor, w: LayerWeights,
                          next_norm: torch.Tensor | None, next_h: torch.Tensor) -> None:
        """The rest of the layer after attention on these rows: the residual x updated in
        place, and (unless this is the last layer) the next layer's normed input written to
        next_h."""
        eps = self.config.rms_norm_eps
        rows = w.rows or (None,) * 4
        h = rms_norm(x, w.post_norm, eps, delta=linear(attn, w.o, w.o_bias, rows[1]))
        down = linear(silu_mul(linear(h, w.gate_up, w.gate_up_bias, rows[2])), w.down, w.down_bias, rows[3])
        if next_norm is None:
            x.add_(down)
        else:
            rms_norm(x, next_norm, eps, delta=down, out=next_h)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, 16)  # 16: the decode batch it is tuned for


def dense(weight: torch.Tensor) -> torch.Tensor:
    """A weight as a plain tensor, packed or not."""
    return weight.to_dense() if weight.is_mkldnn else weight


GEMV_ENV = "ATOMD_GEMV"  # "0": batch-1 decode through oneDNN too, no plain copies kept
GEMV_MAX_BYTES = 1 << 30  # the plain copies batch-1 decode may add, at most


def keep_rows(model: "LlamaModel") -> bool:
    """Keep plain copies of the linear weights for batch-1 decode (layer_ops.gemv): where the
    kernel runs the model's dtype, unless $ATOMD_GEMV=0 or the copies would pass 1 GiB (they
    double the linears' memory: 540 MB more for the 135M shape in float32, 270 in bf16)."""
    if os.environ.get(GEMV_ENV) == "0" or not layer_ops.has_gemv(model.dtype):
        return False
    size = sum(t.numel() for w in model.layers for t in (w.qkv, w.o, w.gate_up, w.down)) + model.lm_head.numel()
    return size * model.lm_head.element_size() <= GEMV_MAX_BYTES


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           rows: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias); one row of x (batch-1 decode, a one-row LM head or prefill
    chunk) with the weight's plain `rows` kept: the GEMV kernel, which streams them at the
    read bandwidth (oneDNN's M = 1 path does not). Its sums run in another order than
    oneDNN's, so float32 logits of a row differ in the last bits between M = 1 and M > 1."""
    if rows is not None and x.shape[0] == 1:
        out = layer_ops.gemv(x, rows)
        return out if bias is None else out.add_(bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, layer: int,
                    meta: AttentionMetadata) -> torch.Tensor:
    """Causal attention of the packed queries q [T, H, D] over their sequences' contexts, in
    the model's dtype (the native kernels run float32 and bfloat16 over the cache as stored).

    Prefill: a sequence without cached prefix attends to its own fresh k/v (no gather):
    all of them in one call of the native kernel (atomd/native.py), else one SDPA each; one
    with a prefix (chunked prefill, prefix hit) reads its whole context from the cache, one
    SDPA each. Decode: the native kernel reads each context straight from the paged cache
    (with speculative decoding several rows per sequence, causal inside its drafts; without
    the kernel the runner sends such a batch down the prefill path); without it, one SDPA over the batch, contexts gathered block by block and padded (into
    the decode workspace when there is one, which later steps extend instead of gathering
    again), the padding masked out.
    """
    heads, head_dim = q.shape[1], q.shape[2]
    if meta.kernels is not None and not meta.is_prefill:
        return decode_attention(meta.kernels, q, kv_cache, layer, meta.block_tables, meta.context_lens,
                                meta.query_starts)
    if not meta.is_prefill:
        ws = meta.workspace
        if ws is None or meta.workspace_fresh:
            keys, values = kv_cache.gather_padded(layer, meta.block_tables)
            if ws is not None:
                ws.fill(layer, keys, values)
        else:
            ws.append(layer, meta.new_positions, k, v)
        if ws is not None:
            keys, values = ws.context(layer, meta.max_context)
        else:
            keys, values = keys[:, :, :meta.max_context], values[:, :, :meta.max_context]
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask,
                                             enable_gqa=True)
        return out.view(-1, heads * head_dim)
    out = torch.empty(q.shape[0], heads * head_dim, dtype=q.dtype)
    seqs = meta.seqs
    if meta.fresh_lens is not None:
        prefill_attention(meta.kernels, q, k, v, out, meta.fresh_starts, meta.fresh_lens)
        seqs = [s for s in seqs if s.num_computed > 0]
    for s in seqs:
        # 4-d inputs: with 3-d ones torch takes its (3x slower) math path on CPU
        qs = q[s.start:s.end].transpose(0, 1).unsqueeze(0)
        if s.num_computed == 0:
            ks, vs = k[s.start:s.end].transpose(0, 1), v[s.start:s.end].transpose(0, 1)
            o = F.scaled_dot_product_attention(qs, ks.unsqueeze(0), vs.unsqueeze(0), is_causal=True,
                                               enable_gqa=True)
        else:
            ks, vs = kv_cache.gather(layer, s.block_ids, s.context_len)
            o = F.scaled_dot_product_attention(qs, ks.unsqueeze(0), vs.unsqueeze(0), attn_mask=s.mask,
                                               enable_gqa=True)
        out[s.start:s.end] = o[0].transpose(0, 1).reshape(s.end - s.start, heads * head_dim)
    return out
