"""Multi-head latent attention (DeepSeek V2 / V3) over a latent paged cache.

The cache holds, per token and layer, one row of kv_lora_rank + qk_rope_head_dim values: the
normed compressed KV (c) and the RoPE'd key part shared by every head (k_pe); KVCache with one
plane and one "head" of that width (KVGeometry in atomd/model/deepseek.py). Per head h,
kv_b_proj splits into W_UK[h] [nope, rank] and W_UV[h] [v, rank]:

    k_h = [W_UK[h] c ; k_pe]        v_h = W_UV[h] c

Prefill up-projects each sequence's latent context into k, v (the work is per context token
anyway) and runs SDPA. Decode runs the absorbed form, reading only the latent: the query goes
into latent space once per token (q_h W_UK[h], [rank]), scores against the cached rows are
[q_h W_UK[h] ; q_pe_h] . [c ; k_pe], and the probability-weighted latent sum goes through
W_UV[h] once per token: no per-context-token up-projection, and every head reads the same rows
(one KV head, MQA over rank + rope values). With the native kernels all of that is one C call
a layer (csrc/mla.c: the absorption, the attention over the paged latent in place, W_UV);
over an fp8 cache, or where that kernel does not build, the absorption and W_UV are batched
matmuls around the attention kernel built for heads of rank + rope values (all query heads in
one group, the rows as their own values, the rope part of its output dropped). On AMX CPUs the
kernel's bf16 blocks of 4 or more rows (a batch's decode) multiply their queries into latent
space and their weighted latents through W_UV as tile products (AMX below).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atomd.engine.kv_cache import AttentionMetadata, KVCache
from atomd.kernels import native
from atomd.kernels.native import decode_attention
from atomd.model.linear import linear, pack_linear_weight

# csrc/mla.c's bf16 blocks of 4 or more query rows on AMX tiles where the CPU has them (W_UK and
# W_UV read as stored, once per 32 rows); False (or $ATOMD_MLA_AMX=0 at import): its AVX-512 path
# (the A/B of benchmarks/engine_compare.py --atomd-baseline-env). ATOMD_KERNEL_ISA=no-amx builds without tiles.
AMX = os.environ.get("ATOMD_MLA_AMX") != "0"


@dataclass
class LatentUp:
    """kv_b_proj of one layer, as prefill and decode read it."""

    kv_b: torch.Tensor  # [heads * (nope + v), rank], packed for the prefill up-projection
    # per head, as the left operand of a batched matmul (a matrix-vector product per head at
    # batch 1: ~2.5x the [1, nope] x [nope, rank] form there)
    uk_t: torch.Tensor  # [heads, rank, nope]: W_UK[h] transposed, the query's absorption into latent space
    uv: torch.Tensor  # [heads, v, rank]: W_UV[h], latent -> value space
    nope: int
    v: int

    @classmethod
    def of(cls, kv_b: torch.Tensor, heads: int, nope: int, v: int, pack: bool) -> "LatentUp":
        """From kv_b_proj's plain weight; pack: the prefill copy in oneDNN's layout."""
        per_head = kv_b.view(heads, nope + v, -1)
        return cls(pack_linear_weight(kv_b) if pack else kv_b, per_head[:, :nope].transpose(1, 2).contiguous(),
                   per_head[:, nope:].contiguous(), nope, v)


def store_latent(kv_cache: KVCache, layer: int, meta: AttentionMetadata, latent: torch.Tensor) -> None:
    """The batch's new latent rows [T, rank + rope] into their slots of layer `layer`."""
    kv_cache.kv[:, layer, 0][meta.slot_blocks, meta.slot_offsets] = latent.unsqueeze(1)


def gather_latent(kv_cache: KVCache, layer: int, block_ids: torch.Tensor) -> torch.Tensor:
    """The latent rows of the blocks `block_ids` ([..., n]) as [..., n * block_size, rank + rope]."""
    rows = kv_cache.kv[:, layer, 0].index_select(0, block_ids.reshape(-1))
    return rows.view(*block_ids.shape[:-1], -1, kv_cache.head_dim)


def up_project(latent: torch.Tensor, up: LatentUp, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k [n, heads, nope + rope], v [n, heads, max(v, nope + rope)] of latent rows [n, rank + rope]:
    v narrower than k padded with zeros (SDPA's flash kernel on CPU takes only one head size: with
    V2-Lite's 128-wide v under 192-wide keys it fell back to its math path, ~13x slower at 512
    tokens, bf16; the padded columns of the output are zeros, the others the same attention)."""
    kv = linear(latent[:, :rank].contiguous(), up.kv_b).view(latent.shape[0], -1, up.nope + up.v)
    heads, qk = kv.shape[1], up.nope + latent.shape[1] - rank
    k = torch.cat([kv[..., :up.nope], latent[:, None, rank:].expand(-1, heads, -1)], dim=-1)
    v = kv[..., up.nope:]
    if up.v < qk:
        v = torch.cat([v, v.new_zeros(v.shape[0], heads, qk - up.v)], dim=-1)
    return k, v


# fresh prompts of one length share an up-projection and an SDPA up to this many rows together: kv_b
# read once for them, their k, v still in cache for the attention (16 prompts of 32 tokens: two groups;
# one group of 1024 rows or more was slower than a sequence at a time, its k, v out of cache)
PREFILL_GROUP_ROWS = 256


def mla_prefill(q: torch.Tensor, latent: torch.Tensor, kv_cache: KVCache, layer: int, meta: AttentionMetadata,
                up: LatentUp, scale: float) -> torch.Tensor:
    """Causal attention [T, heads * v] of the packed queries q [T, heads, nope + rope] (RoPE'd)
    over their sequences' contexts: a fresh prompt's from its own new latent rows [T, rank +
    rope], one with cached tokens (chunked prefill, prefix hit, drafts to verify) from the cache
    (this step's rows stored already). SDPA over the up-projected k, v; consecutive fresh prompts of
    one length in groups of up to PREFILL_GROUP_ROWS rows: one up-projection and one batched SDPA a
    group (16 prompts of 32 tokens read kv_b's 4 MB 16 times a layer one at a time)."""
    rank, heads = kv_cache.head_dim - (q.shape[2] - up.nope), q.shape[1]
    out = torch.empty(q.shape[0], heads * up.v, dtype=q.dtype)
    seqs, i = meta.seqs, 0
    while i < len(seqs):
        s, j = seqs[i], i + 1
        n = s.end - s.start
        if s.num_computed == 0:
            while (j < len(seqs) and (j - i + 1) * n <= PREFILL_GROUP_ROWS and seqs[j].num_computed == 0
                   and seqs[j].end - seqs[j].start == n and seqs[j].start == seqs[j - 1].end):
                j += 1
            start, end, batch, mask, context = s.start, seqs[j - 1].end, j - i, None, latent[s.start:seqs[j - 1].end]
        else:
            start, end, batch, mask = s.start, s.end, 1, s.mask
            context = gather_latent(kv_cache, layer, s.block_ids)[:s.context_len]
        k, v = (t.view(batch, -1, heads, t.shape[-1]).transpose(1, 2) for t in up_project(context, up, rank))
        o = F.scaled_dot_product_attention(q[start:end].view(batch, n, heads, -1).transpose(1, 2), k, v,
                                           attn_mask=mask, is_causal=mask is None, scale=scale)
        out[start:end] = o[..., :up.v].transpose(1, 2).reshape(end - start, -1)
        i = j
    return out


def fused_decode_kernels(kernels, kv_cache: KVCache, rank: int, rope: int, up: LatentUp):
    """The one-call absorbed decode (csrc/mla.c) when the native attention kernels run this
    step (`kernels`, built under their ISA narrowing) over a cache in the model's dtype; else None."""
    if kernels is None or kv_cache.narrow:
        return None
    lib = native.mla_kernels(rank, rope, up.nope, up.v, kernels.isa)
    if lib is not None and lib.amx_on != AMX:
        native.mla_amx(lib, AMX)
    return lib


def mla_decode(q: torch.Tensor, kv_cache: KVCache, layer: int, meta: AttentionMetadata, up: LatentUp,
               scale: float) -> torch.Tensor:
    """Decode query rows q [R, heads, nope + rope] (RoPE'd) over their cached latent contexts in
    the absorbed form: [R, heads * v]. With the native kernels (meta.kernels) straight from the
    paged cache, also several rows a sequence (drafts, meta.query_starts): one C call
    (fused_decode_kernels), or over an fp8 cache the attention kernel built for heads of rank +
    rope values, every query head on the one latent "head"; else one row a sequence, contexts
    gathered, batched matmuls."""
    rank = kv_cache.head_dim - (q.shape[2] - up.nope)
    lib = fused_decode_kernels(meta.kernels, kv_cache, rank, q.shape[2] - up.nope, up)
    if lib is not None:
        return native.mla_decode(lib, q, up.uk_t, up.uv, kv_cache, layer, meta.block_tables, meta.context_lens,
                                 meta.query_starts, scale)
    q_latent = torch.bmm(up.uk_t, q[..., :up.nope].permute(1, 2, 0))  # [heads, rank, R]
    query = torch.cat([q_latent.permute(2, 0, 1), q[..., up.nope:]], dim=-1)  # [R, heads, rank + rope]
    if meta.kernels is not None:
        o = decode_attention(meta.kernels, query, kv_cache, layer, meta.block_tables, meta.context_lens,
                             meta.query_starts, scale=scale).view(q.shape[0], q.shape[1], -1)[..., :rank]
    else:  # batched matmuls over the one latent "head" (SDPA's GQA path would copy it per query head)
        context = gather_latent(kv_cache, layer, meta.block_tables)[:, :meta.max_context]  # [B, L, rank + rope]
        scores = torch.bmm(query, context.transpose(1, 2)).mul_(scale)  # [B, heads, L]
        if meta.decode_mask is not None:
            scores.masked_fill_(~meta.decode_mask[:, 0], float("-inf"))
        o = torch.bmm(torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype), context[..., :rank])
    out = torch.bmm(up.uv, o.permute(1, 2, 0))  # [heads, v, R]
    return out.permute(2, 0, 1).reshape(q.shape[0], -1)
