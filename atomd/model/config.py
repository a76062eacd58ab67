"""The fields of an HF config.json the model code uses, read the same way for every family
(atomd/model/registry.py picks the family; its class adds what only it has)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# the quantization_config methods atomd/model/quant_formats.py reads; any other is refused by name
QUANT_METHODS = ("gptq", "awq", "compressed-tensors")


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense MLP's
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None  # the config's window, where it applies at all
    # per layer: its sliding window (position p sees keys p - window < j <= p), None: global
    layer_windows: tuple[int | None, ...] = ()
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power (Gemma), else head_dim's
    eos_token_id: Any = None
    bos_token_id: Any = None
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    # MoE (atomd/model/moe.py): the layers whose MLP is a sparse block, and its shape
    sparse_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    # expert parallelism (atomd/model/expert_parallel.py): this rank holds experts
    # [expert_rank * E / expert_ranks, (expert_rank + 1) * E / expert_ranks)
    expert_rank: int = 0
    expert_ranks: int = 1
    quantization: dict[str, Any] | None = None  # the checkpoint's quantization_config (QUANT_METHODS)

    @property
    def local_experts(self) -> range:
        """The experts this rank loads and runs (every one without expert parallelism)."""
        per = self.num_experts // self.expert_ranks
        return range(self.expert_rank * per, (self.expert_rank + 1) * per)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], arch: str, qkv_bias: bool = False, sliding_by_default: bool = False,
                window_layers_by_type: bool = False, hidden_act: str = "silu", **family: Any) -> "ModelConfig":
        """The config of `arch`; qkv_bias: the family always has one (Qwen2);
        sliding_by_default: `sliding_window` applies unless use_sliding_window says not
        (Mistral); window_layers_by_type: the window applies to the layers `layer_types` names
        sliding_attention, else to those from max_window_layers on (Qwen2, Qwen3, as
        transformers reads them), not to every layer; `family`: fields only the family sets
        (qk_norm, the MoE shape)."""
        quant = hf.get("quantization_config") or None
        if quant is not None:  # packed integers with scales: read by quant_formats, never cast as floats
            method = str(quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown").lower()
            if method not in QUANT_METHODS:
                raise ValueError(f"quantized checkpoint ({method}) is not supported: atomd loads float16, "
                                 f"bfloat16 and float32 weights and {', '.join(QUANT_METHODS)} checkpoints")
            quant = {**quant, "quant_method": method}
        if hf.get("hidden_act", hidden_act) != hidden_act:
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r} for {arch} (only {hidden_act})")
        heads = hf["num_attention_heads"]
        # transformers 5 writes rope_parameters; older checkpoints rope_theta + rope_scaling
        rope = dict(hf.get("rope_parameters") or {})
        scaling = hf.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"}
                                            if rope.get("rope_type", "default") != "default" else None)
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            architecture=arch, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
            num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias or attention_bias, o_bias=not qkv_bias and attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)), rope_scaling=scaling,
            **layer_windows(hf, sliding_by_default, window_layers_by_type),
            eos_token_id=hf.get("eos_token_id"), bos_token_id=hf.get("bos_token_id"), quantization=quant,
            **family)

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, None: global."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def all_windowed(self) -> bool:
        """Every layer has a sliding window: KV before the largest window is never read again."""
        return bool(self.layer_windows) and all(w is not None for w in self.layer_windows)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def layer_windows(hf: dict[str, Any], sliding_by_default: bool, by_type: bool) -> dict[str, Any]:
    """sliding_window and layer_windows (ModelConfig) of an HF config, as transformers applies
    them: Mistral, Mixtral, Phi-3, Qwen3-MoE to every layer; Qwen2 / Qwen3 (by_type) to the
    layers `layer_types` calls sliding_attention, else (older config.json files) to layers
    max_window_layers and on."""
    layers = hf["num_hidden_layers"]
    window = hf.get("sliding_window") if hf.get("use_sliding_window", sliding_by_default) else None
    if window is None:
        return {"sliding_window": None, "layer_windows": (None,) * layers}
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"sliding_window {window!r} must be a positive integer")
    if not by_type:
        return {"sliding_window": window, "layer_windows": (window,) * layers}
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers", 28)  # transformers' default for Qwen2 / Qwen3
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return {"sliding_window": window, "layer_windows": windows_of_types(types, window, layers)}


def windows_of_types(types: list[str], window: int, layers: int) -> tuple[int | None, ...]:
    """Per layer: `window` where `types` says sliding_attention, None where full_attention."""
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types must name sliding_attention or full_attention for each of the {layers} "
                         f"layers, got {types!r}")
    return tuple(window if t == "sliding_attention" else None for t in types)
