"""Attention over the paged KV cache (atomd/kernels/native.py's C kernels or torch SDPA), and the
per-head q/k RMSNorm some families run before RoPE."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from atomd.engine.kv_cache import AttentionMetadata, KVCache
from atomd.model import layer_ops
from atomd.model.layer_ops import rms_norm
from atomd.kernels.native import decode_attention, prefill_attention


def qk_norm_(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, q_heads: int, kv_heads: int,
             head_dim: int, eps: float) -> None:
    """RMSNorm over each query and key head of qkv [T, width] in place (Qwen3: before RoPE): one C call
    (layer_ops.qk_norm_), else each part copied out, normed and copied back."""
    if layer_ops.qk_norm_(qkv, q_norm, k_norm, q_heads, kv_heads, head_dim, eps):
        return
    rows, q_end, k_end = qkv.shape[0], q_heads * head_dim, (q_heads + kv_heads) * head_dim
    for part, weight in ((slice(0, q_end), q_norm), (slice(q_end, k_end), k_norm)):
        qkv[:, part] = rms_norm(qkv[:, part].reshape(-1, head_dim), weight, eps).view(rows, -1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, layer: int,
                    meta: AttentionMetadata, window: int | None = None, scale: float | None = None) -> torch.Tensor:
    """Causal attention of the packed queries q [T, H, D] over their sequences' contexts, in
    the model's dtype (the native kernels run float32 and bfloat16 over the cache as stored).
    window: the layer's sliding window (a query at position p sees keys p - window < j <= p;
    None: all); scale: the scores' (default head_dim ** -0.5).

    Prefill: a sequence without cached prefix attends to its own fresh k/v (no gather):
    all of them in one call of the native kernel (atomd/kernels/native.py), else one SDPA each; one
    with a prefix (chunked prefill, prefix hit) reads its whole context from the cache, one
    SDPA each, except its one-token rows over a cached context (a mixed step's decode rows): with
    the native kernels those go through the decode kernel, all in one call (`meta.decode_rows`).
    Decode: the native kernel reads each context straight from the paged cache
    (with speculative decoding several rows per sequence, causal inside its drafts; without
    the kernel the runner sends such a batch down the prefill path); without it, one SDPA over the batch, contexts gathered block by block and padded (into
    the decode workspace when there is one, which later steps extend instead of gathering
    again), the padding masked out.
    """
    heads, head_dim = q.shape[1], q.shape[2]
    if meta.kernels is not None and not meta.is_prefill:
        return decode_attention(meta.kernels, q, kv_cache, layer, meta.block_tables, meta.context_lens,
                                meta.query_starts, window, scale)
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
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=decode_mask(meta, window),
                                             enable_gqa=True, scale=scale)
        return out.view(-1, heads * head_dim)
    out = torch.empty(q.shape[0], heads * head_dim, dtype=q.dtype)
    seqs = meta.seqs
    if meta.fresh_lens is not None:
        prefill_attention(meta.kernels, q, k, v, out, meta.fresh_starts, meta.fresh_lens, window, scale)
        seqs = [s for s in seqs if s.num_computed > 0]
    if meta.decode_rows is not None:  # one-token rows over a cached context: the decode kernel, one call
        rows = meta.decode_rows
        out[rows] = decode_attention(meta.kernels, q[rows], kv_cache, layer, meta.block_tables, meta.context_lens,
                                     None, window, scale).view(len(rows), -1)
        seqs = [s for s in seqs if not s.decode_row]
    for s in seqs:
        # 4-d inputs: with 3-d ones torch takes its (3x slower) math path on CPU
        qs = q[s.start:s.end].transpose(0, 1).unsqueeze(0)
        if s.num_computed == 0 and window is None:
            ks, vs = k[s.start:s.end].transpose(0, 1), v[s.start:s.end].transpose(0, 1)
            o = F.scaled_dot_product_attention(qs, ks.unsqueeze(0), vs.unsqueeze(0), is_causal=True,
                                               enable_gqa=True, scale=scale)
        elif s.num_computed == 0:
            ks, vs = k[s.start:s.end].transpose(0, 1), v[s.start:s.end].transpose(0, 1)
            o = F.scaled_dot_product_attention(qs, ks.unsqueeze(0), vs.unsqueeze(0), enable_gqa=True, scale=scale,
                                               attn_mask=windowed(causal_mask(0, s.end - s.start), 0, window))
        else:
            ks, vs = kv_cache.gather(layer, s.block_ids, s.context_len)
            o = F.scaled_dot_product_attention(qs, ks.unsqueeze(0), vs.unsqueeze(0), enable_gqa=True, scale=scale,
                                               attn_mask=windowed(s.mask, s.num_computed, window))
        out[s.start:s.end] = o[0].transpose(0, 1).reshape(s.end - s.start, heads * head_dim)
    return out


def causal_mask(done: int, context: int) -> torch.Tensor:
    """[context - done, context] bool: query i sits at position done + i and sees keys 0 .. done + i."""
    return torch.arange(context).unsqueeze(0) <= torch.arange(done, context).unsqueeze(1)


def windowed(mask: torch.Tensor, done: int, window: int | None) -> torch.Tensor:
    """A prefill chunk's causal mask [chunk, context] (query i at position done + i) with the
    keys before each query's window masked too: key j seen while done + i - j < window."""
    if window is None:
        return mask
    chunk, context = mask.shape
    return mask & (torch.arange(done, done + chunk).unsqueeze(1) - torch.arange(context).unsqueeze(0) < window)


def decode_mask(meta: AttentionMetadata, window: int | None) -> torch.Tensor | None:
    """The torch decode path's [B, 1, 1, max_context] mask: each row's context, and of it only
    its last `window` keys with a window (made once a step per window, shared by its layers)."""
    if window is None:
        return meta.decode_mask
    if window not in meta.window_masks:
        keys = torch.arange(meta.max_context).unsqueeze(0)
        lens = meta.context_lens.unsqueeze(1)
        meta.window_masks[window] = ((keys < lens) & (keys >= lens - window))[:, None, None, :]
    return meta.window_masks[window]
