"""LoRA adapters on the decoder's fused linears: PEFT adapter directories read into per-layer
low-rank pairs, and the batched delta of one step (rows grouped by adapter).

An adapter directory is what PEFT's `save_pretrained` writes: adapter_config.json
(`r`, `lora_alpha`, `use_rslora`, `target_modules`) and adapter_model.safetensors
(`...layers.{i}.self_attn.q_proj.lora_A.weight` [r, in], `...lora_B.weight` [out, r]).
PEFT's delta of a target is `x @ A.T @ B.T * scale`, scale = alpha / r (alpha / sqrt(r)
with rsLoRA). The decoder runs q/k/v as one QKV matmul and gate/up as one (decoder.py), so
an adapter's targets of one fused linear are stacked: A [sum of r, in] and a B [out, sum of
r] that is zero outside each target's own rows and rank columns (scale folded in). A step
then adds, per adapter group of rows, two small matmuls per fused linear; rows of the base
model get nothing. The simplest correct batching (one pass per adapter group);
benchmarks/lora_overhead.py measures what it costs.
"""
from __future__ import annotations

import json
import math
import pathlib
import re
from dataclasses import dataclass

import numpy as np
import torch
from safetensors import safe_open

from atomd.model.config import ModelConfig

# PEFT module name -> (the decoder's fused linear, which part of its output rows); phi3's
# checkpoint names its fused linears qkv_proj / gate_up_proj: the whole output
TARGETS = {"q_proj": ("qkv", "q"), "k_proj": ("qkv", "k"), "v_proj": ("qkv", "v"), "qkv_proj": ("qkv", None),
           "o_proj": ("o", None), "gate_proj": ("gate_up", "gate"), "up_proj": ("gate_up", "up"),
           "gate_up_proj": ("gate_up", None), "down_proj": ("down", None)}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20


@dataclass
class LoraLinear:
    """One fused linear's low-rank pair: delta = (x @ a.T) @ b.T."""

    a: torch.Tensor  # [R, in]
    b: torch.Tensor  # [out, R], scale folded in


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int
    layers: list[dict[str, LoraLinear]]  # per layer: fused linear name -> its pair (absent: untouched)


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
    for key, ok in (("use_dora", not conf.get("use_dora")), ("bias", conf.get("bias", "none") == "none"),
                    ("modules_to_save", not conf.get("modules_to_save")),
                    ("fan_in_fan_out", not conf.get("fan_in_fan_out")),
                    ("rank_pattern", not conf.get("rank_pattern")), ("alpha_pattern", not conf.get("alpha_pattern"))):
        if not ok:
            raise ValueError(f"{cfg_file}: {key}={conf.get(key)!r} is not supported")
    scale = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
    return r, float(scale)


def load_adapter(name: str, path: str | pathlib.Path, cfg: ModelConfig, dtype: torch.dtype,
                 max_rank: int) -> LoraAdapter:
    """The adapter at `path` for a model of `cfg`, in `dtype`; ValueError naming the problem
    (not an adapter, rank above max_rank, a target this model has not, a shape that does not fit)."""
    path = pathlib.Path(path)
    r, scale = read_adapter_config(path, max_rank)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
        for key in f.keys():
            m = _KEY.search(key)
            if m is None or m.group(2) not in TARGETS:
                raise ValueError(f"{path}: tensor {key!r} is not a LoRA weight of {', '.join(TARGETS)}")
            layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
            if not 0 <= layer < cfg.num_layers:
                raise ValueError(f"{path}: {key!r}: the model has {cfg.num_layers} layers")
            if TARGETS[module][0] in ("gate_up", "down") and layer in cfg.sparse_layers:
                raise ValueError(f"{path}: {key!r}: layer {layer} is an MoE block (LoRA on experts is not supported)")
            pairs.setdefault((layer, module), {})[ab] = f.get_tensor(key).to(torch.float32)
    if not pairs:
        raise ValueError(f"{path}: no LoRA weights in {WEIGHTS_FILE}")
    slices = _out_slices(cfg)
    parts: dict[tuple[int, str], list[tuple[tuple[int, int], torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), ab in sorted(pairs.items()):
        fused, part = TARGETS[module]
        lo, hi = slices[fused][part]
        a, b = ab.get("A"), ab.get("B")
        if a is None or b is None:
            raise ValueError(f"{path}: layer {layer} {module} has lora_{'A' if a is None else 'B'} missing")
        if a.ndim != 2 or b.ndim != 2 or a.shape != (r, _in_features(cfg, fused)) or b.shape != (hi - lo, r):
            raise ValueError(f"{path}: layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not "
                             f"fit rank {r} and this model ({_in_features(cfg, fused)} in, {hi - lo} out)")
        parts.setdefault((layer, fused), []).append(((lo, hi), a, b * scale))
    layers: list[dict[str, LoraLinear]] = [{} for _ in range(cfg.num_layers)]
    for (layer, fused), items in parts.items():
        out = slices[fused][None][1]
        a = torch.cat([p[1] for p in items])
        b = torch.zeros(out, a.shape[0])
        for j, ((lo, hi), _, bt) in enumerate(items):
            b[lo:hi, j * r:(j + 1) * r] = bt
        layers[layer][fused] = LoraLinear(a.to(dtype).contiguous(), b.to(dtype).contiguous())
    return LoraAdapter(name, str(path), r, layers)


class LoraStep:
    """One forward's rows by adapter: `groups` pairs an adapter with the token rows it serves
    (a slice where they are contiguous, else an index tensor); rows of no adapter are absent."""

    def __init__(self, token_adapters: list[LoraAdapter | None], counts: np.ndarray):
        """token_adapters[i]: sequence i's adapter (None: the base model); counts[i]: its rows."""
        ends = np.cumsum(counts)
        self.num_rows = int(ends[-1]) if len(ends) else 0
        rows: dict[int, tuple[LoraAdapter, list[np.ndarray]]] = {}
        for adapter, end, n in zip(token_adapters, ends.tolist(), counts.tolist()):
            if adapter is not None and n:
                rows.setdefault(id(adapter), (adapter, []))[1].append(np.arange(end - n, end))
        self.groups = [(adapter, np.concatenate(parts)) for adapter, parts in rows.values()]

    def tile(self, start: int, stop: int) -> "LoraRows | None":
        """The groups restricted to rows [start, stop), renumbered from 0; None: no adapter row there."""
        out = []
        for adapter, idx in self.groups:
            sel = idx[(idx >= start) & (idx < stop)] - start
            if len(sel):
                out.append((adapter, _rows(sel)))
        return LoraRows(out) if out else None


def _rows(idx: np.ndarray) -> slice | torch.Tensor:
    if idx[-1] - idx[0] + 1 == len(idx):  # contiguous: a view, no gather / scatter
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return torch.from_numpy(idx.astype(np.int64))


class LoraRows:
    """The adapter groups of one tile of rows."""

    def __init__(self, groups: list[tuple[LoraAdapter, slice | torch.Tensor]]):
        self.groups = groups

    def layer(self, i: int) -> "LayerLora":
        return LayerLora(self.groups, i)


class LayerLora:
    """The adapter groups of one tile at one layer; `add` puts a fused linear's delta on its output."""

    def __init__(self, groups: list[tuple[LoraAdapter, slice | torch.Tensor]], layer: int):
        self.groups, self.index = groups, layer

    def add(self, fused: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (x's projection by `fused`) plus each group's delta, in place; returns out."""
        for adapter, rows in self.groups:
            pair = adapter.layers[self.index].get(fused)
            if pair is None:
                continue
            if isinstance(rows, slice):
                out[rows] += (x[rows] @ pair.a.T) @ pair.b.T
            else:
                out.index_add_(0, rows, (x[rows] @ pair.a.T) @ pair.b.T)
        return out
