"""PEFT LoRA adapters on DeepSeek V2 / V3 (atomd/model/deepseek.py): PEFT's module names mapped
onto the model's linears, then stacked and served as atomd/model/lora.py serves every family.

- q_proj (no q_lora) and q_a_proj -> qkv_a's q rows, kv_a_proj_with_mqa -> qkv_a's latent rows
  (the one matmul of the q and latent projections); q_b_proj -> q_b; o_proj -> o;
- gate_proj / up_proj / down_proj -> a dense layer's MLP (mlp.*), or a sparse layer's shared
  experts (mlp.shared_experts.*), under the names gate_up / down.

B's rows go through the same permutation as the base weight's (the RoPE rows of q and of the
latent, interleaved pairs made halves at load: deepseek.rope_row_orders), so the delta lands on
the rows it was trained for. Refused by name: kv_b_proj (the absorbed decode folds W_UK into
the query and W_UV into the output per head, shared by every row of a step: an adapter's delta
there would need its own absorbed matrices per request), the routed experts and the router
(transformers' DeepSeek keeps the experts in fused parameters PEFT's target_modules does not
reach), and any other module.
"""
from __future__ import annotations

import pathlib
import re

import torch

from atomd.model.deepseek import DeepseekConfig, rope_row_orders
from atomd.model.lora import LoraAdapter, checked_pair, fuse_pairs, read_adapter_config, read_pairs

# PEFT module (under self_attn. or mlp. / mlp.shared_experts.) -> (the model's linear, which part of its rows)
ATTENTION = {"q_proj": ("qkv_a", "q"), "q_a_proj": ("qkv_a", "q"), "kv_a_proj_with_mqa": ("qkv_a", "kv"),
             "q_b_proj": ("q_b", None), "o_proj": ("o", None)}
MLP = {"gate_proj": ("gate_up", "gate"), "up_proj": ("gate_up", "up"), "down_proj": ("down", None)}
REFUSED = {"kv_b_proj": "the absorbed MLA decode folds kv_b_proj into the query and output projections, "
                        "shared by every request"}
_KEY = re.compile(r"layers\.(\d+)\.(.+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


def _shapes(cfg: DeepseekConfig, sparse: bool) -> dict[str, tuple[int, dict[str | None, tuple[int, int]]]]:
    """Per linear: (in features, out rows of each part)."""
    q = cfg.q_lora_rank or cfg.num_heads * cfg.qk_head_dim
    inter = cfg.moe_intermediate_size * cfg.n_shared_experts if sparse else cfg.intermediate_size
    return {"qkv_a": (cfg.hidden_size, {"q": (0, q), "kv": (q, q + cfg.latent_dim), None: (0, q + cfg.latent_dim)}),
            "q_b": (cfg.q_lora_rank or 0, {None: (0, cfg.num_heads * cfg.qk_head_dim)}),
            "o": (cfg.num_heads * cfg.v_head_dim, {None: (0, cfg.hidden_size)}),
            "gate_up": (cfg.hidden_size, {"gate": (0, inter), "up": (inter, 2 * inter), None: (0, 2 * inter)}),
            "down": (inter, {None: (0, cfg.hidden_size)})}


def _target(cfg: DeepseekConfig, layer: int, module: str) -> tuple[str, str | None] | str:
    """(linear, part) of a PEFT module path under layer `layer`, or why it is refused."""
    parent, _, name = module.rpartition(".")
    if name in REFUSED:
        return f"LoRA on {name} is not supported: {REFUSED[name]}"
    if parent == "self_attn" and name in ATTENTION:
        if name == "q_proj" and cfg.q_lora_rank or name in ("q_a_proj", "q_b_proj") and not cfg.q_lora_rank:
            return f"this model has no {name} (q_lora_rank={cfg.q_lora_rank})"
        return ATTENTION[name]
    sparse = layer in cfg.sparse_layers
    if name in MLP and parent == ("mlp.shared_experts" if sparse else "mlp"):
        if sparse and not cfg.n_shared_experts:
            return "the layer has no shared experts"
        return MLP[name]
    if sparse and parent.startswith("mlp"):
        return f"layer {layer} is an MoE block: LoRA on its routed experts or router is not supported"
    return f"not a module LoRA targets here ({', '.join([*ATTENTION, *MLP])})"


def load_deepseek_adapter(name: str, path: str | pathlib.Path, cfg: DeepseekConfig, dtype: torch.dtype,
                          max_rank: int) -> LoraAdapter:
    """lora.load_adapter's contract for a DeepSeek model (module docstring)."""
    path = pathlib.Path(path)
    r, scale = read_adapter_config(path, max_rank)

    def refuse(layer: int, module: str) -> str | None:
        target = _target(cfg, layer, module) if 0 <= layer < cfg.num_layers else None
        return f": {target}" if isinstance(target, str) else None

    pairs = read_pairs(path, _KEY, cfg.num_layers, refuse)
    q_rows, kv_a_rows = rope_row_orders(cfg)
    parts: dict = {}
    out_sizes: dict[tuple[int, str], int] = {}
    for (layer, module), ab in sorted(pairs.items()):
        fused, part = _target(cfg, layer, module)
        fan_in, slices = _shapes(cfg, layer in cfg.sparse_layers)[fused]
        (lo, hi), short = slices[part], module.rpartition(".")[2]
        a, b = checked_pair(path, layer, module, ab, r, fan_in, hi - lo)
        if short in ("q_proj", "q_b_proj"):
            b = b[q_rows]
        elif short == "kv_a_proj_with_mqa":
            b = b[kv_a_rows]
        parts.setdefault((layer, fused), []).append(((lo, hi), a, b * scale))
        out_sizes[layer, fused] = slices[None][1]  # gate_up / down: the dense MLP's or the shared experts' width
    layers = fuse_pairs(parts, out_sizes, r, cfg.num_layers, dtype)
    return LoraAdapter(name, str(path), r, layers)
