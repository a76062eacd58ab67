"""Attention over the paged KV cache (atomd/kernels/native.py's C kernels or torch SDPA), and the
per-head q/k RMSNorm some families run before RoPE."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from atomd.engine.kv_cache import AttentionMetadata, KVCache
from atomd.model.layer_ops import rms_norm
from atomd.kernels.native import decode_attention, prefill_attention


def qk_norm_(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, q_heads: int, kv_heads: int,
             head_dim: int, eps: float) -> None:
    """RMSNorm over each query and key head of qkv [T, width] in place (Qwen3: before RoPE)."""
    rows, q_end, k_end = qkv.shape[0], q_heads * head_dim, (q_heads + kv_heads) * head_dim
    for part, weight in ((slice(0, q_end), q_norm), (slice(q_end, k_end), k_norm)):
        qkv[:, part] = rms_norm(qkv[:, part].reshape(-1, head_dim), weight, eps).view(rows, -1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, layer: int,
                    meta: AttentionMetadata) -> torch.Tensor:
    """Causal attention of the packed queries q [T, H, D] over their sequences' contexts, in
    the model's dtype (the native kernels run float32 and bfloat16 over the cache as stored).

    Prefill: a sequence without cached prefix attends to its own fresh k/v (no gather):
    all of them in one call of the native kernel (atomd/kernels/native.py), else one SDPA each; one
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
