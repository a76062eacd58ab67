"""The C allocator's policy for an engine process: freed activation memory stays mapped.

Why: a prefill allocates and frees tens of MB every layer (the QKV, gate/up and SiLU
outputs of thousands of rows). glibc serves blocks past its mmap threshold with fresh
mappings and returns a heap's free top to the kernel, so every layer faults those pages in
again, zeroed: 14k-150k minor faults a prefill of 8 x 512 tokens on the SmolLM2-135M shape
(bf16), 5-25% of its time. With blocks up to 32 MiB served from the heap and the heap never
trimmed, the faults stop after the first step (vLLM's CPU backend gets the same from
tcmalloc, preloaded). The price: memory freed by the process stays mapped, up to its peak,
which an engine reaches every step anyway. glibc only (elsewhere nothing changes);
`$ATOMD_MALLOC_TUNING=0` leaves the allocator as it is.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

log = logging.getLogger(__name__)
ENV = "ATOMD_MALLOC_TUNING"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks up to this come from the heap
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
    done = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if done:
        log.debug("glibc malloc: blocks up to %d MiB from the heap, no trimming (%s=0 to leave it)",
                  MMAP_THRESHOLD >> 20, ENV)
    return done
