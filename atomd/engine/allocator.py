"""The C allocator's policy for an engine process: freed activation memory stays mapped.

Why: a prefill allocates and frees tens of MB every layer (the QKV, gate/up and SiLU
outputs of thousands of rows). glibc serves blocks past its mmap threshold with fresh
mappings and returns a heap's free top to the kernel, so every layer faults those pages in
again, zeroed: 14k-150k minor faults a prefill of 8 x 512 tokens on the SmolLM2-135M shape
(bf16), 5-25% of its time. With every block served from the heap (no mmap'd blocks at all:
glibc's threshold stops at 32 MiB, and Qwen3-0.6B's QKV output of 4096 rows is 32 MiB and a
bit, so it was mapped and faulted in, 8192 pages, every layer: 229k faults a prefill, ~10%
of it, benchmarks/RESULTS.md #34 s34h) and the heap never trimmed, the faults stop after the
first step (vLLM's CPU backend gets the same from tcmalloc, preloaded). The price: memory
freed by the process stays mapped, up to its peak, which an engine reaches every step anyway
(huge_pages.release_freed_memory gives back what load left). glibc only (elsewhere nothing
changes); `$ATOMD_MALLOC_TUNING=0` leaves the allocator as it is. A thread arena that cannot
grow still maps what it must (glibc's last resort), so no allocation fails for it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

log = logging.getLogger(__name__)
ENV = "ATOMD_MALLOC_TUNING"
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters
TRIM_THRESHOLD = (1 << 31) - 1  # free heap top kept mapped up to 2 GiB (mallopt takes a C int)


def retain_freed_memory() -> bool:
    """Apply the policy above to this process; True where it did (once is enough: repeats are
    harmless)."""
    if os.environ.get(ENV) == "0" or platform.libc_ver()[0] != "glibc":
        return False
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    done = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if done:
        log.debug("glibc malloc: every block from the heap, no trimming (%s=0 to leave it)", ENV)
    return done
