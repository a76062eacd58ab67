"""LoRA adapters on the decoder's fused linears: PEFT adapter directories read into per-layer
low-rank pairs, and the batched delta of one step (a batch mixes adapters and the base model).

An adapter directory is what PEFT's `save_pretrained` writes: adapter_config.json
(`r`, `lora_alpha`, `use_rslora`, `target_modules`) and adapter_model.safetensors
(`...layers.{i}.self_attn.q_proj.lora_A.weight` [r, in], `...lora_B.weight` [out, r]).
PEFT's delta of a target is `x @ A.T @ B.T * scale`, scale = alpha / r (alpha / sqrt(r)
with rsLoRA). The decoder runs q/k/v as one QKV matmul and gate/up as one (decoder.py), so
an adapter's targets of one fused linear are stacked: A [sum of r, in] and a B [out, sum of
r] that is zero outside each target's own rows and rank columns (scale folded in). A step
puts the adapters its rows use side by side (`LoraStack`) and masks each row to its own
adapter's columns (`LoraStep`): two matmuls and a mask per fused linear, base-model rows adding zeros.
benchmarks/lora_overhead.py measures what it costs against one pass per adapter group.
"""
from __future__ import annotations

import json
import math
import pathlib
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from safetensors import safe_open

from atomd.model import layer_ops
from atomd.model.config import ModelConfig

# PEFT module name -> (the decoder's fused linear, which part of its output rows); phi3's
# checkpoint names its fused linears qkv_proj / gate_up_proj: the whole output
TARGETS = {"q_proj": ("qkv", "q"), "k_proj": ("qkv", "k"), "v_proj": ("qkv", "v"), "qkv_proj": ("qkv", None),
           "o_proj": ("o", None), "gate_proj": ("gate_up", "gate"), "up_proj": ("gate_up", "up"),
           "gate_up_proj": ("gate_up", None), "down_proj": ("down", None)}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
STACKED_MAX = 4  # adapters in one step the stacked form takes (LoraStep, mode auto)
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20


@dataclass
class LoraLinear:
    """One fused linear's low-rank pair, laid out for the two matmuls (no transposes):
    delta = (x @ a_t) @ b_t (PEFT's x @ A.T @ B.T * scale)."""

    a_t: torch.Tensor  # [in, R]
    b_t: torch.Tensor  # [R, out], scale folded in


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int
    layers: list[dict[str, LoraLinear]]  # per layer: fused linear name -> its pair (absent: untouched)

    def __post_init__(self) -> None:
        pairs = [pair for layer in self.layers for pair in layer.values()]
        self.width = max((pair.a_t.shape[1] for pair in pairs), default=0)  # the widest fused pair's rank columns
        self.dtype = pairs[0].a_t.dtype if pairs else torch.float32


def _out_slices(cfg: ModelConfig) -> dict[str, dict[str | None, tuple[int, int]]]:
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"qkv": {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv), None: (0, q + 2 * kv)},
            "o": {None: (0, cfg.hidden_size)},
            "gate_up": {"gate": (0, inter), "up": (inter, 2 * inter), None: (0, 2 * inter)},
            "down": {None: (0, cfg.hidden_size)}}


def _in_features(cfg: ModelConfig, fused: str) -> int:
    return {"qkv": cfg.hidden_size, "o": cfg.q_size, "gate_up": cfg.hidden_size, "down": cfg.intermediate_size}[fused]


def read_adapter_config(path: pathlib.Path, max_rank: int) -> tuple[int, float]:
    """(r, scale) of a PEFT LoRA adapter directory; ValueError naming what does not fit."""
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file() or not (path / WEIGHTS_FILE).is_file():
        raise ValueError(f"{path}: not a PEFT adapter directory ({CONFIG_FILE} and {WEIGHTS_FILE} expected)")
    if cfg_file.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"{cfg_file}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        conf = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise ValueError(f"{cfg_file}: not JSON: {e}") from None
    if not isinstance(conf, dict) or conf.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{cfg_file}: peft_type {conf.get('peft_type')!r} is not LORA")
    r, alpha = conf.get("r"), conf.get("lora_alpha", conf.get("r"))
    if type(r) is not int or r < 1:
        raise ValueError(f"{cfg_file}: r must be an integer >= 1, got {r!r}")
    if r > max_rank:
        raise ValueError(f"{path}: rank {r} is above --max-lora-rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{cfg_file}: lora_alpha must be a number, got {alpha!r}")
    # what would change the delta's form: refused rather than served wrong
    for key, ok in (("target_parameters", not conf.get("target_parameters")),  # LoRA on fused expert weights
                    ("use_dora", not conf.get("use_dora")), ("bias", conf.get("bias", "none") == "none"),
                    ("modules_to_save", not conf.get("modules_to_save")),
                    ("fan_in_fan_out", not conf.get("fan_in_fan_out")),
                    ("rank_pattern", not conf.get("rank_pattern")), ("alpha_pattern", not conf.get("alpha_pattern"))):
        if not ok:
            raise ValueError(f"{cfg_file}: {key}={conf.get(key)!r} is not supported")
    scale = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
    return r, float(scale)


def read_pairs(path: pathlib.Path, key_pattern: re.Pattern, num_layers: int,
               refuse: Callable[[int, str], str | None]) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """Each (layer, module)'s lora_A / lora_B tensors (float32) from the adapter's weights file, by
    `key_pattern` (groups: layer, module, A or B); ValueError naming a key that is not a LoRA weight,
    a layer the model has not, or what `refuse(layer, module)` says of a module it cannot take."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        for key in f.keys():
            m = key_pattern.search(key)
            why = None if m is None else refuse(int(m.group(1)), m.group(2))
            if m is None or why is not None:
                raise ValueError(f"{path}: tensor {key!r} " + (why or "is not a LoRA weight of a decoder layer"))
            layer = int(m.group(1))
            if not 0 <= layer < num_layers:
                raise ValueError(f"{path}: {key!r}: the model has {num_layers} layers")
            pairs.setdefault((layer, m.group(2)), {})[m.group(3)] = f.get_tensor(key).to(torch.float32)
    if not pairs:
        raise ValueError(f"{path}: no LoRA weights in {WEIGHTS_FILE}")
    return pairs


def checked_pair(path: pathlib.Path, layer: int, module: str, ab: dict[str, torch.Tensor], r: int, fan_in: int,
                 fan_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lora_A [r, fan_in], lora_B [fan_out, r]); ValueError naming the one missing or a shape that does not fit."""
    a, b = ab.get("A"), ab.get("B")
    if a is None or b is None:
        raise ValueError(f"{path}: layer {layer} {module} has lora_{'A' if a is None else 'B'} missing")
    if a.ndim != 2 or b.ndim != 2 or a.shape != (r, fan_in) or b.shape != (fan_out, r):
        raise ValueError(f"{path}: layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not "
                         f"fit rank {r} and this model ({fan_in} in, {fan_out} out)")
    return a, b


def load_adapter(name: str, path: str | pathlib.Path, cfg: ModelConfig, dtype: torch.dtype,
                 max_rank: int) -> LoraAdapter:
    """The adapter at `path` for a model of `cfg`, in `dtype`; ValueError naming the problem
    (not an adapter, rank above max_rank, a target this model has not, a shape that does not fit)."""
    path = pathlib.Path(path)
    r, scale = read_adapter_config(path, max_rank)

    def refuse(layer: int, module: str) -> str | None:
        if module not in TARGETS:
            return f"is not a LoRA weight of {', '.join(TARGETS)}"
        if TARGETS[module][0] in ("gate_up", "down") and layer in cfg.sparse_layers:
            return f"is in layer {layer}, an MoE block (LoRA on experts is not supported)"
        return None

    pairs = read_pairs(path, _KEY, cfg.num_layers, refuse)
    slices = _out_slices(cfg)
    parts: dict[tuple[int, str], list[tuple[tuple[int, int], torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), ab in sorted(pairs.items()):
        fused, part = TARGETS[module]
        lo, hi = slices[fused][part]
        a, b = checked_pair(path, layer, module, ab, r, _in_features(cfg, fused), hi - lo)
        parts.setdefault((layer, fused), []).append(((lo, hi), a, b * scale))
    out_sizes = {key: slices[key[1]][None][1] for key in parts}
    return LoraAdapter(name, str(path), r, fuse_pairs(parts, out_sizes, r, cfg.num_layers, dtype))


def fuse_pairs(parts: dict[tuple[int, str], list[tuple[tuple[int, int], torch.Tensor, torch.Tensor]]],
               out_sizes: dict[tuple[int, str], int], r: int, num_layers: int,
               dtype: torch.dtype) -> list[dict[str, LoraLinear]]:
    """Per layer, each fused linear's pair from its targets' (out rows [lo, hi), A, scaled B):
    the A's stacked, B [out_sizes[layer, fused], ...] zero outside each target's rows and rank
    columns (module docstring)."""
    layers: list[dict[str, LoraLinear]] = [{} for _ in range(num_layers)]
    for (layer, fused), items in parts.items():
        a = torch.cat([p[1] for p in items])
        b = torch.zeros(out_sizes[layer, fused], a.shape[0])
        for j, ((lo, hi), _, bt) in enumerate(items):
            b[lo:hi, j * r:(j + 1) * r] = bt
        layers[layer][fused] = LoraLinear(a.T.to(dtype).contiguous(), b.T.to(dtype).contiguous())
    return layers


class LoraStack:
    """The pairs of a set of adapters side by side, per layer and fused linear: A [C, in] (each
    adapter's rows in turn; zeros where an adapter has no pair in that layer) and B [out, C].
    Built once per set of adapters a step uses (ModelRunner keeps the last one: a decode batch
    keeps its set for many steps)."""

    def __init__(self, adapters: tuple[LoraAdapter, ...]):
        self.adapters = adapters
        self.cols: dict[str, list[tuple[int, int]]] = {}  # fused linear -> each adapter's columns
        self.layers: list[dict[str, LoraLinear]] = [{} for _ in adapters[0].layers]
        for fused in dict.fromkeys(f for a in adapters for layer in a.layers for f in layer):
            widths = [max((layer[fused].a_t.shape[1] for layer in a.layers if fused in layer), default=0)
                      for a in adapters]
            ends = np.cumsum(widths).tolist()
            self.cols[fused] = [(e - w, e) for e, w in zip(ends, widths)]
            for i, stacked in enumerate(self.layers):
                here = [a.layers[i].get(fused) for a in adapters]
                first = next((p for p in here if p is not None), None)
                if first is None:  # no adapter has it in this layer (its shape may differ there: DeepSeek's MLPs)
                    continue
                dtype = first.a_t.dtype
                a_t = torch.zeros(first.a_t.shape[0], ends[-1], dtype=dtype)
                b_t = torch.zeros(ends[-1], first.b_t.shape[1], dtype=dtype)
                for pair, (lo, hi) in zip(here, self.cols[fused]):
                    if pair is not None:
                        w = pair.a_t.shape[1]
                        a_t[:, lo:lo + w], b_t[lo:lo + w] = pair.a_t, pair.b_t
                stacked[fused] = LoraLinear(a_t, b_t)

    def serves(self, adapters: tuple[LoraAdapter, ...]) -> bool:
        return len(adapters) == len(self.adapters) and all(x is y for x, y in zip(adapters, self.adapters))


class LoraStep:
    """One forward's LoRA, in one of two forms (`mode`; benchmarks/lora_overhead.py compares them):

    - stacked: the adapters the rows use side by side (LoraStack) and, per fused linear, a
      [rows, C] 0/1 mask keeping each row to its own adapter's columns: ((x @ A) * mask) @ B,
      three ops whatever the number of adapters, but k adapters' columns for every row;
    - grouped: the adapter rows sorted by adapter once per tile, then per fused linear one
      gather, one matmul pair per adapter on its contiguous rows, one scatter-add: only each
      row's own columns, 2k + 2 ops.

    - sgmv (float32 with the C kernels built): per fused linear one C call in which each row does
      its own adapter's pair only (layer_ops.lora_sgmv): 1x the LoRA FLOPs, one call.

    In the torch forms one adapter (or rows of one adapter only) is the stacked form without a mask.
    `auto` (the default) runs sgmv where it can, else stacks up to STACKED_MAX adapters and
    groups beyond: measured CPU time
    per batch-16 step, 4 adapters tie, at 16 the grouped form is 1.20x the base step against
    1.53x (135M shape, rank 8) and 3.1x against 4.7x (built-in model, rank 64)
    (benchmarks/results/lora.md)."""

    mode = "auto"  # "stacked" | "grouped" | "sgmv" | "auto"

    def __init__(self, token_adapters: list[LoraAdapter | None], counts: np.ndarray,
                 stack: "LoraStack | SgmvStack | None" = None):
        """token_adapters[i]: sequence i's adapter (None: the base model); counts[i]: its rows;
        `stack`: the previous step's, reused when it holds the same adapters."""
        active: dict[int, LoraAdapter] = {}
        for adapter in token_adapters:
            if adapter is not None:
                active.setdefault(id(adapter), adapter)
        self.groups = tuple(active.values())  # empty: no adapter row in this step
        self.stack = stack
        if not self.groups:
            return
        slot = {id(a): j for j, a in enumerate(self.groups)}
        self.row_slot = np.repeat([-1 if a is None else slot[id(a)] for a in token_adapters], counts)
        self.sgmv = self.mode in ("sgmv", "auto") and layer_ops.has_lora_sgmv(
            self.groups[0].dtype, max(a.width for a in self.groups))
        if self.sgmv:
            self.stack = stack if isinstance(stack, SgmvStack) and stack.serves(self.groups) else SgmvStack(self.groups)
            self.slots = torch.from_numpy(self.row_slot.astype(np.int64))
            return
        self.grouped = len(self.groups) > 1 and (
            self.mode == "grouped" or (self.mode == "auto" and len(self.groups) > STACKED_MAX))
        if self.grouped:
            return
        self.stack = stack if isinstance(stack, LoraStack) and stack.serves(self.groups) else LoraStack(self.groups)
        self.masks: dict[str, torch.Tensor | None] = {}
        for fused, cols in self.stack.cols.items():
            if (self.row_slot == 0).all() and len(cols) == 1:  # every row under the one adapter: nothing to mask
                self.masks[fused] = None
                continue
            mask = np.zeros((len(self.row_slot), cols[-1][1]), dtype=np.float32)
            for j, (lo, hi) in enumerate(cols):
                mask[self.row_slot == j, lo:hi] = 1.0
            dtype = next(layer[fused] for layer in self.stack.layers if fused in layer).a_t.dtype
            self.masks[fused] = torch.from_numpy(mask).to(dtype)

    def tile(self, start: int, stop: int) -> "LoraRows | GroupedRows | None":
        """Rows [start, stop) of the step; None: no adapter row there."""
        if not self.groups:
            return None
        slots = self.row_slot[start:stop]
        if (slots < 0).all():
            return None
        if self.sgmv:
            return SgmvRows(self.stack, self.slots[start:stop])
        if not self.grouped:
            return LoraRows(self.stack, {f: None if m is None else m[start:stop] for f, m in self.masks.items()})
        order = np.argsort(slots, kind="stable")
        order = order[slots[order] >= 0]  # adapter rows, by adapter
        sorted_slots = slots[order]
        bounds = [(j, int(np.searchsorted(sorted_slots, j)), int(np.searchsorted(sorted_slots, j, "right")))
                  for j in range(len(self.groups))]
        return GroupedRows(self.groups, torch.from_numpy(order.astype(np.int64)), bounds)


class SgmvStack:
    """The pairs of a set of adapters, per layer and fused linear, as the SGMV kernel reads them:
    A [adapters, w, in] (A's rank rows) and B [adapters, w, out], w the widest adapter's (zeros past
    an adapter's own width and for an adapter without that pair). Cached like LoraStack."""

    def __init__(self, adapters: tuple[LoraAdapter, ...]):
        self.adapters = adapters
        self.layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for i in range(len(adapters[0].layers)):
            here: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            for fused in dict.fromkeys(f for a in adapters for f in a.layers[i]):
                pairs = [a.layers[i].get(fused) for a in adapters]
                first = next(p for p in pairs if p is not None)
                w = max(p.a_t.shape[1] for p in pairs if p is not None)
                a_all = first.a_t.new_zeros(len(adapters), w, first.a_t.shape[0])
                b_all = first.b_t.new_zeros(len(adapters), w, first.b_t.shape[1])
                for j, pair in enumerate(pairs):
                    if pair is not None:
                        a_all[j, :pair.a_t.shape[1]], b_all[j, :pair.b_t.shape[0]] = pair.a_t.T, pair.b_t
                here[fused] = (a_all, b_all)
            self.layers.append(here)

    def serves(self, adapters: tuple[LoraAdapter, ...]) -> bool:
        return len(adapters) == len(self.adapters) and all(x is y for x, y in zip(adapters, self.adapters))


class SgmvRows:
    """A tile of rows (sgmv form): the stack and each row's adapter slot (-1: the base model)."""

    def __init__(self, stack: SgmvStack, slots: torch.Tensor):
        self.stack, self.slots = stack, slots

    def layer(self, i: int) -> "SgmvLayer":
        return SgmvLayer(self, i)


class SgmvLayer:
    def __init__(self, rows: SgmvRows, layer: int):
        self.rows, self.index = rows, layer

    def add(self, fused: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out plus each row's own adapter delta, in place (one C call); returns out."""
        pair = self.rows.stack.layers[self.index].get(fused)
        if pair is None:
            return out
        return layer_ops.lora_sgmv(x if x.stride(-1) == 1 else x.contiguous(), pair[0], pair[1], self.rows.slots, out)


class GroupedRows:
    """A tile's adapter rows sorted by adapter: `idx` (tile row of each), each adapter's [lo, hi)."""

    def __init__(self, groups: tuple[LoraAdapter, ...], idx: torch.Tensor, bounds: list[tuple[int, int, int]]):
        self.groups, self.idx, self.bounds = groups, idx, [b for b in bounds if b[1] < b[2]]

    def layer(self, i: int) -> "GroupedLayer":
        return GroupedLayer(self, i)


class GroupedLayer:
    def __init__(self, rows: GroupedRows, layer: int):
        self.rows, self.index = rows, layer

    def add(self, fused: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        rows = self.rows
        xs = x.index_select(0, rows.idx)
        delta = out.new_zeros((len(rows.idx), out.shape[1]))
        for j, lo, hi in rows.bounds:
            pair = rows.groups[j].layers[self.index].get(fused)
            if pair is not None:
                torch.mm(torch.mm(xs[lo:hi], pair.a_t), pair.b_t, out=delta[lo:hi])
        return out.index_add_(0, rows.idx, delta)


class LoraRows:
    """A tile of rows of one step (stacked form): the stack and the tile's masks."""

    def __init__(self, stack: LoraStack, masks: dict[str, torch.Tensor | None]):
        self.stack, self.masks = stack, masks

    def layer(self, i: int) -> "LayerLora":
        return LayerLora(self, i)


class LayerLora:
    """A tile at one layer (stacked form); `add` puts a fused linear's deltas on its output."""

    def __init__(self, rows: LoraRows, layer: int):
        self.rows, self.index = rows, layer

    def add(self, fused: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (x's projection by `fused`) plus each row's adapter delta, in place; returns out."""
        pair = self.rows.stack.layers[self.index].get(fused)
        if pair is None:
            return out
        xa = torch.mm(x, pair.a_t)
        mask = self.rows.masks[fused]
        if mask is not None:
            xa.mul_(mask)
        return out.addmm_(xa, pair.b_t)
