"""The paged KV cache: one tensor per engine, block-major (docs/contracts.md):

    kv[num_blocks, num_layers, 2 (k, v), block_size, num_kv_heads, head_dim]

so one block of every layer is one contiguous byte range, which the KV transfer moves as
a single frame (`as_numpy_blocks`). Per layer, `kv[:, layer, 0]` is a strided view
[num_blocks, block_size, kv_heads, head_dim]; writes scatter by (block, offset), reads
gather whole blocks. A model with another cache layout (MLA's latent: one plane, one
"head" per token, atomd/model/mla.py) says so in its `KVGeometry`: `planes` 1 instead of k, v.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from atomd.config import KV_CACHE_DTYPES
from atomd.model.huge_pages import zeros_on_huge_pages

# --kv-cache-dtype (auto: the model's dtype); fp8 is vLLM's alias of fp8_e4m3
CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
                "bfloat16": torch.bfloat16, "float16": torch.float16}
FP8_NAMES = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
SATURATED = (*FP8_NAMES, torch.float16)  # the narrow dtypes whose range is under float32's


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the paged cache stores (--kv-cache-dtype; auto: the model's). A 16-bit cache
    under another 16-bit model is refused: it saves nothing, and float16 <-> bfloat16 loses
    range or digits (bf16 values past float16's range would read back as inf)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    dtype = CACHE_DTYPES[kv_cache_dtype]
    if dtype.itemsize == 2 and model_dtype not in (torch.float32, dtype):
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype} is a 16-bit cache for a float32 model; this model runs in "
                         f"{str(model_dtype).removeprefix('torch.')} (--dtype): use auto or fp8")
    return dtype


def check_kv_planes(kv_dtype: torch.dtype, model_dtype: torch.dtype, planes: int, kv_cache_dtype: str,
                    architecture: str) -> None:
    """A narrow cache holds key and value planes only: MLA's latent cache (one plane) is refused."""
    if kv_dtype != model_dtype and planes != 2:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype}: {architecture}'s MLA latent cache is not built narrower "
                         f"than the model (its absorbed decode reads the latent in "
                         f"{str(model_dtype).removeprefix('torch.')}); use auto")


def kv_dtype_name(dtype: torch.dtype) -> str:
    """A cache dtype's name in the KV compatibility fingerprint: fp8 as vLLM names it, else torch's."""
    return FP8_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def to_narrow(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x / scale in the narrow cache `dtype`; fp8 and float16 saturated at their largest finite
    value (torch's cast gives an inf past it), rounded to nearest even by torch's cast."""
    y = x.float() if scale == 1.0 else x.float() / scale
    if dtype in SATURATED:  # not in place: x.float() is x itself for a float32 x
        limit = torch.finfo(dtype).max
        y = y.clamp(-limit, limit)
    return y.to(dtype)


@dataclass
class SeqSlice:
    """One prefill sequence's rows in the packed batch and where its context lives."""

    start: int
    end: int
    num_computed: int  # tokens of KV already cached before this chunk
    context_len: int  # num_computed + chunk length
    block_ids: torch.Tensor | None  # blocks covering the context (only with num_computed > 0)
    mask: torch.Tensor | None  # [chunk, context_len] causal mask shifted by num_computed
    decode_row: bool = False  # a one-token row over a cached context read by the decode kernel (decode_rows)


@dataclass
class AttentionMetadata:
    """Where the batch's tokens write their KV and which KV each of them reads."""

    is_prefill: bool
    slot_blocks: torch.Tensor  # [T] block id of each token's KV slot
    slot_offsets: torch.Tensor  # [T] offset inside that block
    seqs: list[SeqSlice]  # prefill only
    verify: bool = False  # speculative verify rows (decode rows with drafts), on either path
    block_tables: torch.Tensor | None = None  # decode: [B, max_blocks], padded with block 0
    decode_mask: torch.Tensor | None = None  # decode: [B, 1, 1, max_context] bool; None if all full
    max_context: int = 0  # decode: the longest context of the batch
    workspace: "DecodeWorkspace | None" = None  # decode: contiguous copy of the batch's contexts
    workspace_fresh: bool = False  # decode: fill the workspace from the cache this step
    new_positions: torch.Tensor | None = None  # decode: [B] position of each row's new token
    kernels: Any = None  # atomd.kernels.native's library when it computes the attention
    context_lens: torch.Tensor | None = None  # decode: [B] int64
    window_masks: dict = field(default_factory=dict)  # decode, torch path: window -> its mask (attention.decode_mask)
    query_starts: torch.Tensor | None = None  # decode with kernels and drafts: [B + 1] row offsets
    fresh_starts: torch.Tensor | None = None  # prefill with kernels: first row of each fresh prompt
    fresh_lens: torch.Tensor | None = None  # prefill with kernels: its rows this step
    # prefill with kernels: the rows of one token over a cached context (a mixed step's decode rows),
    # read by the decode kernel in one call; block_tables / context_lens / max_context are theirs
    decode_rows: torch.Tensor | None = None


@dataclass(frozen=True)
class KVGeometry:
    """What a model caches per token and layer: `planes` tensors (2: k and v) of `heads` x
    `head_dim` values; `version` names the layout in the KV compatibility fingerprint."""

    planes: int
    heads: int
    head_dim: int
    version: str


class KVCache:
    def __init__(self, num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, planes: int = 2, kv: torch.Tensor | None = None,
                 compute_dtype: torch.dtype | None = None):
        """`kv`: the zeroed tensor to hold the cache in (a tensor-parallel worker's slice of the
        shared-memory cache, atomd/engine/tp_workers.py), else a new one. `dtype`: what is
        stored; `compute_dtype`: the model's, what readers get back (default: `dtype`, so a bf16 / float16
        cache is the model's own unless compute_dtype says float32; float32 for fp8)."""
        # zeros, not empty: padded (masked) slots are read too, and garbage NaNs would
        # survive a zero attention weight (0 * nan = nan); on 2 MiB pages (huge_pages.zeros_on_huge_pages)
        shape = (num_blocks, num_layers, planes, block_size, num_kv_heads, head_dim)
        if kv is not None and (tuple(kv.shape) != shape or kv.dtype != dtype or not kv.is_contiguous()):
            raise ValueError(f"KV cache tensor {tuple(kv.shape)} {kv.dtype}, expected {shape} {dtype} contiguous")
        self.kv = kv if kv is not None else zeros_on_huge_pages(shape, dtype)
        self.num_blocks, self.num_layers, self.block_size = num_blocks, num_layers, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.compute_dtype = compute_dtype or (torch.float32 if dtype in FP8_NAMES else dtype)
        self.narrow = dtype != self.compute_dtype  # stored narrower than the model computes: fp8, 16 bits under float32
        self.k_scale = self.v_scale = 1.0  # per-tensor scales of a narrow cache (vLLM's fp8 default without calibration)
        self._k = [self.kv[:, i, 0] for i in range(num_layers)]
        self._v = [self.kv[:, i, 1] for i in range(num_layers)] if planes == 2 else []

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, planes: int = 2) -> int:
        return num_layers * planes * block_size * num_kv_heads * head_dim * dtype.itemsize

    @property
    def block_bytes(self) -> int:
        return self.kv[0].numel() * self.kv.element_size()

    def as_numpy_blocks(self) -> np.ndarray:
        """uint8 view [num_blocks, block_bytes] sharing memory with the cache (for kv_transfer)."""
        return self.kv.view(torch.uint8).numpy().reshape(self.num_blocks, self.block_bytes)

    def write(self, layer: int, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the batch's new k, v [T, kv_heads, head_dim] in their slots. In a narrow cache
        k and v are then overwritten in place with what the cache holds (rounded to its dtype and
        widened back): this step's attention sees the keys every later step reads, so a
        prompt attends alike fresh, chunked, after a prefix hit or pulled over PD."""
        if not self.narrow:
            self._k[layer][meta.slot_blocks, meta.slot_offsets] = k
            self._v[layer][meta.slot_blocks, meta.slot_offsets] = v
            return
        stored_k, stored_v = to_narrow(k, self.kv.dtype, self.k_scale), to_narrow(v, self.kv.dtype, self.v_scale)
        self._k[layer][meta.slot_blocks, meta.slot_offsets] = stored_k
        self._v[layer][meta.slot_blocks, meta.slot_offsets] = stored_v
        k.copy_(self.widen(stored_k, self.k_scale))
        v.copy_(self.widen(stored_v, self.v_scale))

    def widen(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        """Cached values x back in the model's dtype (a narrow cache's times its scale; else x itself)."""
        if not self.narrow:
            return x
        y = x.to(torch.float32 if scale != 1.0 else self.compute_dtype)
        return y if scale == 1.0 else (y * scale).to(self.compute_dtype)

    def slot_rows(self, meta: AttentionMetadata) -> torch.Tensor:
        """Each new token's layer-0 K row in the cache seen as [rows, kv_heads * head_dim]
        (int64 [T]); layer l's is l * 2 * block_size rows further, the V row block_size rows
        after the K row (layer_ops.rope_store_)."""
        if meta.slot_blocks.numel() and int(meta.slot_blocks.max()) >= self.num_blocks:  # C writes there
            raise IndexError(f"KV slot in block {int(meta.slot_blocks.max())} of a {self.num_blocks}-block cache")
        return self._first_row(meta.slot_blocks, meta.slot_offsets).contiguous()

    def _first_row(self, block, offset):
        """Slot (block, offset)'s layer-0 K row in the cache seen as rows (ints or tensors)."""
        return block * (self.num_layers * 2 * self.block_size) + offset

    def slot_addresses(self, block: int, offset: int) -> tuple[int, int, int]:
        """Addresses of layer 0's K and V rows of slot (block, offset), and the bytes from one
        layer's rows to the next's (what `write` stores, for a C caller)."""
        if not (0 <= block < self.num_blocks and 0 <= offset < self.block_size):  # C writes there
            raise IndexError(f"KV slot ({block}, {offset}) outside a {self.num_blocks} x {self.block_size} cache")
        row = self.num_kv_heads * self.head_dim * self.kv.element_size()
        k = self.kv.data_ptr() + self._first_row(block, offset) * row
        return k, k + self.block_size * row, 2 * self.block_size * row

    def gather(self, layer: int, block_ids: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's first `length` cached k, v as [kv_heads, length, head_dim]."""
        shape = (-1, self.num_kv_heads, self.head_dim)
        k = self.widen(self._k[layer].index_select(0, block_ids).view(shape)[:length], self.k_scale)
        v = self.widen(self._v[layer].index_select(0, block_ids).view(shape)[:length], self.v_scale)
        return k.transpose(0, 1), v.transpose(0, 1)

    def gather_padded(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [B, kv_heads, max_blocks * block_size, head_dim] of padded block tables [B, max_blocks]."""
        b = block_tables.shape[0]
        shape = (b, -1, self.num_kv_heads, self.head_dim)
        flat = block_tables.view(-1)
        k = self.widen(self._k[layer].index_select(0, flat).view(shape), self.k_scale)
        v = self.widen(self._v[layer].index_select(0, flat).view(shape), self.v_scale)
        return k.transpose(1, 2), v.transpose(1, 2)


class DecodeWorkspace:
    """The decode batch's contexts as contiguous [B, kv_heads, capacity, head_dim] per layer.

    Gathering every context from the paged cache on every step costs as much as the
    attention itself; a decode batch usually repeats with each context one token longer,
    so the contexts are gathered once and each step only appends its new k, v (the paged
    cache gets them too: it stays the truth, the workspace is a cache of it).
    """

    def __init__(self, seq_ids: list[int], context_lens: np.ndarray, capacity: int, num_layers: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype):
        self.seq_ids, self.context_lens, self.capacity = seq_ids, context_lens, capacity
        self.kv = torch.zeros(num_layers, 2, len(seq_ids), num_kv_heads, capacity, head_dim, dtype=dtype)
        self.rows = torch.arange(len(seq_ids))

    @staticmethod
    def nbytes(batch: int, capacity: int, num_layers: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype) -> int:
        return num_layers * 2 * batch * num_kv_heads * capacity * head_dim * dtype.itemsize

    def continues(self, seq_ids: list[int], context_lens: np.ndarray) -> bool:
        """True when this step is the previous one with every context one token longer."""
        return (seq_ids == self.seq_ids and bool((context_lens == self.context_lens + 1).all())
                and int(context_lens.max()) <= self.capacity)

    def fill(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        n = min(keys.shape[2], self.capacity)
        self.kv[layer, 0, :, :, :n] = keys[:, :, :n]
        self.kv[layer, 1, :, :, :n] = values[:, :, :n]

    def append(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv[layer, 0, self.rows, :, positions] = k
        self.kv[layer, 1, self.rows, :, positions] = v

    def context(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[layer, 0, :, :, :length], self.kv[layer, 1, :, :, :length]
