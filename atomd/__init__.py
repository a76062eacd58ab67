"""atomd: disaggregated prefill/decode LLM serving.

`from atomd import LLM, SamplingParams` is the offline API. Imports are lazy so
that `atomd --help` and the router never pay for torch.
"""
from __future__ import annotations

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
