"""Tests of a C path that only an AVX-512 build of the kernels has (the batch-1 decode layer and its
GEMV rows, moe_q8's experts in one call, DeepSeek's C layers, the MTP pass in one call) against the
per-op path: on a CPU without AVX-512 (an AVX2-only AMD EPYC, Zen 3) the kernels leave those paths out
and the engine runs the per-op path itself, so there is nothing to compare. Keyed on the CPU's flags,
not on what was built: on an AVX-512 CPU a build that lost them still fails the test."""
from __future__ import annotations

import pytest

from atomd.config import cpu_flags

AVX512 = "avx512f" in cpu_flags()


def needs_avx512(path: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not AVX512, reason=f"{path} is built for AVX-512 CPUs only; this one runs the "
                                                 f"per-op path the test compares it with")
