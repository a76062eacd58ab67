"""Weights that batch-1 decode streams, moved onto 2 MiB pages (transparent huge pages).

Why: at batch 1 every linear streams its weight rows once a token, and with 4 KiB pages that
stream takes a TLB miss every 4 KiB and the hardware prefetchers stop at each page's end. On
the AMD EPYC here (THP `madvise` mode, so plain allocations get 4 KiB pages) the bf16 GEMV over
the 0.6B shape's 311 MB LM head read 28-29 GB/s on 4 KiB pages and 34-35 GB/s on 2 MiB ones,
one thread (benchmarks/RESULTS.md, #34 third session). So the rows are copied once at load into
one anonymous mapping per tensor, aligned to 2 MiB and madvise(MADV_HUGEPAGE)d before the copy
touches it; where the kernel has no THP (or `never`) the copy is plain memory, no slower.
"""
from __future__ import annotations

import ctypes
import logging
import math
import mmap

import torch

log = logging.getLogger(__name__)
HUGE_PAGE = 2 << 20
MIN_BYTES = HUGE_PAGE  # smaller tensors would not fill one huge page


def _region(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping with nbytes from a 2 MiB boundary on (that offset into it),
    madvise(MADV_HUGEPAGE)d before anything touches it."""
    size = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    offset = -address % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE, offset, size)
        except OSError as e:  # no THP in this kernel: plain pages
            log.debug("madvise(MADV_HUGEPAGE): %s", e)
    return region, offset


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t in a 2 MiB-aligned MADV_HUGEPAGE mapping (t itself when smaller
    than a huge page). The mapping lives as long as the returned tensor."""
    if t.nbytes < MIN_BYTES or not t.is_contiguous():
        return t
    return side_by_side([t])[0]


def side_by_side(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of `tensors`, in order, in one 2 MiB-aligned MADV_HUGEPAGE mapping,
    each from a 64-byte boundary: tensors too small for a huge page of their own (most of a
    135M model's linears) share them, in the order decode streams them. The mapping lives as
    long as any returned tensor."""
    starts, end = [], 0
    for t in tensors:
        starts.append(end)
        end = (end + t.nbytes + 63) // 64 * 64
    region, offset = _region(max(end, 1))
    out = []
    for t, start in zip(tensors, starts):
        view = torch.frombuffer(region, dtype=torch.uint8, count=t.nbytes, offset=offset + start)
        view = view.view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
    return out


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed contiguous tensor in its own 2 MiB-aligned MADV_HUGEPAGE mapping (an anonymous
    mapping reads as zeros; its pages are taken as they are first written): the paged KV cache,
    whose decode attention reads one KV head's row of each token, a row every 4 KiB at the Qwen3-0.6B
    shape's float32 cache, so a TLB miss a row on 4 KiB pages (2 MiB pages: the attention 1.10-1.21x
    on the AVX2 EPYC, benchmarks/RESULTS.md #35 session 19). The mapping lives as long as the tensor."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MIN_BYTES:
        return torch.zeros(shape, dtype=dtype)
    region, offset = _region(nbytes)
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)


def release_freed_memory() -> None:
    """Give the pages of freed allocations back to the system (glibc's malloc_trim), once after
    load: its float32 reads and the weights moved onto huge pages leave freed chunks in the heap,
    which the engine's allocator policy (atomd/engine/allocator.py: blocks up to 32 MiB from the
    heap, never trimmed) keeps mapped otherwise."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
