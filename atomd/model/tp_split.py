"""How a model splits over the N workers of tensor parallelism: which query heads, KV heads,
MLP rows and vocabulary rows worker r holds. Torch-free: the API process checks a
--tensor-parallel-size against config.json with it before any engine starts, and the loader
(atomd/model/tensor_parallel.py) slices the checkpoint by it.

Query heads split evenly (N must divide them). KV heads split when N divides them; when N is a
multiple of them each KV head is replicated on N / kv_heads workers (worker r holds head
r // (N / kv_heads), the one its query heads read: GQA's grouping kept); any other N is refused.
The MLP's intermediate rows (each expert's too) split evenly; the vocabulary splits in
ceil(V / N) rows a worker, the last one's padded.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class TPSplit:
    rank: int
    size: int
    num_heads: int  # the model's, whole
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def local_kv_heads(self) -> int:
        return max(self.num_kv_heads // self.size, 1)

    def q_heads(self) -> range:
        return range(self.rank * self.local_heads, (self.rank + 1) * self.local_heads)

    def kv_heads(self) -> range:
        """The KV heads this worker holds (one, replicated, when size > num_kv_heads)."""
        if self.size <= self.num_kv_heads:
            return range(self.rank * self.local_kv_heads, (self.rank + 1) * self.local_kv_heads)
        first = self.rank // (self.size // self.num_kv_heads)
        return range(first, first + 1)

    @property
    def vocab_rows(self) -> int:
        """Vocabulary rows a worker holds (the last worker's real rows may be fewer: padded)."""
        return -(-self.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows


def check_split(num_heads: int, num_kv_heads: int, intermediate_sizes: list[int], size: int,
                what: str = "the model") -> None:
    """ValueError naming the numbers unless `size` workers can split this model."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if num_heads % size:
        raise ValueError(f"tensor_parallel_size={size} must divide the {num_heads} attention heads of {what}")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={size} neither divides the {num_kv_heads} KV heads of {what} "
                         f"(split) nor is a multiple of them (replicated)")
    for inter in intermediate_sizes:
        if inter % size:
            raise ValueError(f"tensor_parallel_size={size} must divide the MLP intermediate size {inter} of {what}")


def check_hf_config(hf: dict[str, Any], size: int, what: str = "the model") -> None:
    """check_split for a config.json (its text model's, for a vision-language Gemma 3)."""
    hf = hf.get("text_config") or hf
    heads = hf["num_attention_heads"]
    inters = [hf[k] for k in ("intermediate_size", "moe_intermediate_size") if hf.get(k)]
    check_split(heads, hf.get("num_key_value_heads") or heads, inters, size, what)


def shard_config(cfg: Any, split: TPSplit) -> Any:
    """The ModelConfig worker `split.rank` runs: its heads and MLP rows (the vocabulary stays whole:
    the sampler sees the gathered logits)."""
    size = split.size
    return replace(cfg, num_heads=split.local_heads, num_kv_heads=split.local_kv_heads,
                   intermediate_size=cfg.intermediate_size // size,
                   moe_intermediate_size=cfg.moe_intermediate_size // size)
