"""How a tensor-parallel engine's KV block is laid out across its workers, and how a block of
one TP layout maps onto another's (heterogeneous TP through PD: P with TP=a, D with TP=b).

A block of a TP=N engine is N per-worker slices, worker w's slice
[layers, planes, block_size, heads_of(w), head_dim] (its KVCache block, atomd/engine/kv_cache.py),
so a TP=1 layout's single slice is exactly today's block bytes. KV heads are split when N
divides them (worker w holds heads [w*k/N, (w+1)*k/N)), replicated when N is a multiple of
them (worker w holds head w // (N/k), the one its query heads read, as
atomd/model/tp_split.py splits them); any other N cannot hold the model. Converting a block
takes each head from the first source worker that holds it and writes it to every
destination worker that holds it. Pure numpy: the connector sees blocks as bytes.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

# bytes per element of the cache dtypes (numpy has no bfloat16: the bytes are moved, never read)
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1,
            "uint8": 1}
_WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass(frozen=True)
class TPKVLayout:
    """One engine's KV block across its TP workers; `kv_heads`: the model's, all workers'."""

    tp_size: int
    kv_heads: int
    head_dim: int
    planes: int
    layers: int
    block_size: int
    dtype: str

    def __post_init__(self):
        for name in ("tp_size", "kv_heads", "head_dim", "planes", "layers", "block_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"TPKVLayout.{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"TPKVLayout.dtype must be one of {sorted(ITEMSIZE)}, got {self.dtype!r}")

    @property
    def even(self) -> bool:
        """Whether tp_size splits the heads evenly (divides them or is a multiple of them)."""
        return self.kv_heads % self.tp_size == 0 or self.tp_size % self.kv_heads == 0

    def worker_heads(self, worker: int) -> range:
        """The KV heads worker `worker` holds, in its slice's order."""
        if not 0 <= worker < self.tp_size:
            raise ValueError(f"worker must be in [0, {self.tp_size}), got {worker}")
        if not self.even:
            raise ValueError(f"{self.describe()}: {self.tp_size} workers split {self.kv_heads} KV heads unevenly")
        if self.tp_size <= self.kv_heads:
            per = self.kv_heads // self.tp_size
            return range(worker * per, (worker + 1) * per)
        head = worker // (self.tp_size // self.kv_heads)
        return range(head, head + 1)

    def slice_shape(self, worker: int) -> tuple[int, int, int, int, int]:
        return (self.layers, self.planes, self.block_size, len(self.worker_heads(worker)), self.head_dim)

    def slice_bytes(self, worker: int) -> int:
        return int(np.prod(self.slice_shape(worker))) * ITEMSIZE[self.dtype]

    def describe(self) -> str:
        if not self.even:
            heads = "uneven"
        elif self.tp_size <= self.kv_heads:
            heads = f"{self.kv_heads // self.tp_size} per worker"
        else:
            heads = f"each replicated on {self.tp_size // self.kv_heads} workers"
        return (f"TP={self.tp_size} x {self.kv_heads} KV heads ({heads}), head_dim {self.head_dim}, "
                f"{self.planes} plane(s), {self.layers} layers, block {self.block_size}, {self.dtype}")

    def to_dict(self) -> dict:
        return asdict(self)


def check_mappable(producer: TPKVLayout, consumer: TPKVLayout) -> None:
    """ValueError naming both layouts unless every block of `producer` maps onto `consumer`:
    everything but the TP size must be equal, and both TP sizes must split the heads evenly."""
    differ = [name for name in ("kv_heads", "head_dim", "planes", "layers", "block_size", "dtype")
              if getattr(producer, name) != getattr(consumer, name)]
    if not producer.even:
        differ.append(f"the producer's TP={producer.tp_size} splits {producer.kv_heads} KV heads unevenly")
    if not consumer.even:
        differ.append(f"the consumer's TP={consumer.tp_size} splits {consumer.kv_heads} KV heads unevenly")
    if differ:
        raise ValueError(f"KV layouts cannot map ({', '.join(differ)}): producer {producer.describe()}; "
                         f"consumer {consumer.describe()}")


def holder(layout: TPKVLayout, head: int) -> tuple[int, int]:
    """(the first worker holding `head`, its index in that worker's slice)."""
    if layout.tp_size <= layout.kv_heads:
        per = layout.kv_heads // layout.tp_size
        return head // per, head % per
    return head * (layout.tp_size // layout.kv_heads), 0


def slices_match(producer: TPKVLayout, consumer: TPKVLayout) -> bool:
    """Whether each of `consumer`'s worker slices is, byte for byte, one of `producer`'s (both
    layouts' workers hold as many KV heads: equal TP sizes, both TP sizes at least the KV heads, or
    one KV head as MLA's latent), so that blocks move between them as the workers' slices lie."""
    return producer.even and consumer.even and producer.slice_bytes(0) == consumer.slice_bytes(0)


def convert_block(src: TPKVLayout, dst: TPKVLayout, per_worker_src_bytes, out=None) -> list[np.ndarray]:
    """One block in `src`'s layout (a bytes-like or uint8 array per source worker) as `dst`'s
    (a uint8 array per destination worker; written into `out`'s arrays when given)."""
    check_mappable(src, dst)
    if len(per_worker_src_bytes) != src.tp_size:
        raise ValueError(f"{len(per_worker_src_bytes)} source slices for {src.describe()}")
    word = _WORD[ITEMSIZE[src.dtype]]
    srcs = []
    for w, raw in enumerate(per_worker_src_bytes):
        a = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw.reshape(-1)
        if a.size != src.slice_bytes(w):
            raise ValueError(f"source slice {w} is {a.size} bytes, {src.describe()} has {src.slice_bytes(w)}")
        srcs.append(a.view(word).reshape(src.slice_shape(w)))
    if out is None:
        out = [np.empty(dst.slice_bytes(w), dtype=np.uint8) for w in range(dst.tp_size)]
    if len(out) != dst.tp_size or any(o.size != dst.slice_bytes(w) for w, o in enumerate(out)):
        raise ValueError(f"destination slices do not fit {dst.describe()}")
    for w, o in enumerate(out):
        view = o.reshape(-1).view(word).reshape(dst.slice_shape(w))
        for j, head in enumerate(dst.worker_heads(w)):
            s, i = holder(src, head)
            view[:, :, :, j] = srcs[s][:, :, :, i]
    return out
