"""atomd: disaggregated prefill/decode LLM serving.

`from atomd import LLM, SamplingParams` is the offline API. Imports are lazy so
that `atomd --help` and the router never pay for torch.
"""
from __future__ import annotations

import os

# OpenMP threads that wait (a barrier, the next parallel region) sleep instead of spinning:
# read once, when torch loads libgomp, so set before any torch import. On a shared or loaded
# CPU a spinning thread whose peer lost its core burns its whole time slice at every barrier:
# 2-thread batch-1 decode of the Qwen3-0.6B shape at load ~25 took 680-1010 CPU ms a token
# spinning against 70 sleeping (= its 1-thread CPU; benchmarks/RESULTS.md, #34). A user's own
# OMP_WAIT_POLICY wins (ACTIVE: the lowest latency on dedicated cores). Sleeping at once costs each wait a
# futex wake-up, which on a VM's idle vCPU is tens of microseconds: a batch-1 step has ~6 waits a layer, and
# 2-thread int4 decode of the 135M shape on the AVX2 EPYC ran at 37-41 tok/s sleeping at once, 95-106 after
# GOMP_SPINCOUNT=1000-3000 spins first (~20-100 us at most, then asleep: the loaded case stays bounded), 75-92 with
# ACTIVE (benchmarks/RESULTS.md, #35 session 17). A user's own GOMP_SPINCOUNT wins too.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from atomd.llm import LLM

        return LLM
    if name == "SamplingParams":
        from contracts.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
