"""What this CPU's kernel builds run, for the tests that pick builds by it.

ISAS: the narrowings of the kernels (cbuild.ISA_FLAGS) that run different code here. Those that
leave this CPU the same flags build the same paths (on an AVX2-only CPU all four; on the Intel
Xeon with AVX-512/VNNI native, no-amx and no-bf16-dot), so of each such set only the narrowest
is taken: its name says what runs, and no test runs one path three times.

needs_avx512: tests of a C path that only an AVX-512 build has (DeepSeek's MLA C layers, the MTP pass
in one call) against
the per-op path: on a CPU without AVX-512 (an AVX2-only AMD EPYC, Zen 3) the kernels leave those
paths out and the engine runs the per-op path itself, so there is nothing to compare. Keyed on the
CPU's flags, not on what was built: on an AVX-512 CPU a build that lost them still fails the test."""
from __future__ import annotations

import pytest

from atomd.config import cpu_flags
from atomd.kernels import cbuild

AVX512 = "avx512f" in cpu_flags()


def distinct_isas(flags: set[str]) -> list[str]:
    narrowest = {frozenset(cbuild.narrow_flags(flags, isa)): isa for isa in cbuild.ISA_FLAGS}  # widest first
    return [isa for isa in cbuild.ISA_FLAGS if isa in narrowest.values()]


ISAS = distinct_isas(cpu_flags())  # as $ATOMD_KERNEL_ISA narrows it (tests/test_cpu_kinds.py's runs)


def needs_avx512(path: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not AVX512, reason=f"{path} is built for AVX-512 CPUs only; this one runs the "
                                                 f"per-op path the test compares it with")
