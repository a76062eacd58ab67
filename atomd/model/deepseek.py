"""DeepSeek V2 / V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`), as transformers computes them:

- multi-head latent attention (atomd/model/mla.py) over a latent cache, q through q_a_proj,
  q_a_layernorm, q_b_proj (q_lora_rank set) or one q_proj; the KV latent through
  kv_a_proj_with_mqa and kv_a_layernorm. The q and latent projections run as one matmul.
  RoPE only on the qk_rope_head_dim part: in interleaved pairs (V2 always, V3 with
  rope_interleave), which here become halves at load (the rope rows of q and of the latent
  permuted once: both sides of every dot product alike), so the plain rotate-half RoPE runs.
  Scores scaled by qk_head_dim ** -0.5 times yarn's mscale(factor, mscale_all_dim) squared.
- DeepSeekMoE on layers from first_k_dense_replace on (every moe_layer_freq-th, as DeepSeek's
  own code; transformers ignores moe_layer_freq, every released config has 1): n_shared_experts
  always-on experts beside the routed ones. Routing in float32 on a float32 router weight:
  V2 softmax, top-k greedy or group_limited_greedy (the n_group groups with the largest best
  score, top-k among their experts); V3 sigmoid, chosen by score + e_score_correction_bias
  within the topk_group groups with the largest sum of two best biased scores (noaux_tc),
  weighed by the unbiased scores, renormalised with norm_topk_prob. Then x routed_scaling_factor.
  V2's norm_topk_prob is not read (transformers' DeepseekV2 does not either; V2 configs set it false).

V3's MTP layer (model.layers.{num_hidden_layers}) is atomd/model/deepseek_mtp.py's (drafts).
Not here yet: quantized weights.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from atomd.engine.kv_cache import AttentionMetadata, KVCache, KVGeometry
from atomd.kernels import native
from atomd.model import layer_ops, moe as moe_mod
from atomd.model.config import ModelConfig
from atomd.model.decoder import DecoderModel, TensorSource, cat, row_partial
from atomd.model.huge_pages import on_huge_pages, release_freed_memory
from atomd.model.layer_ops import rms_norm, silu_mul
from atomd.model.linear import GEMV_ENV, GEMV_MAX_BYTES, dense, linear, pack_linear_weight
from atomd.model.lora import LayerLora, LoraStep
from atomd.model.mla import LatentUp, fused_decode_kernels, mla_decode, mla_prefill, store_latent
from atomd.model.moe import MoeWeights, from_tp_sums, load_experts, moe, tp_exact, tp_partials
from atomd.model.quant import QuantizedWeight
from atomd.model.rotary import rope_kind, rope_tables, yarn_factor, yarn_mscale

MLA_KV_LAYOUT_VERSION = "atomd-mla-kv-1"  # block-major [layers, 1, block_size, 1, kv_lora_rank + qk_rope_head_dim]
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass
class DeepseekConfig(ModelConfig):
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0  # also head_dim: RoPE's tables are this wide
    v_head_dim: int = 0
    rope_interleave: bool = True
    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    scoring: str = "softmax"  # V2; V3: sigmoid (noaux_tc)
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def mla_scale(self) -> float:
        """The scores' scale: qk_head_dim ** -0.5, times yarn's mscale(factor, mscale_all_dim) ** 2."""
        scale = self.qk_head_dim ** -0.5
        scaling = self.rope_scaling or {}
        if rope_kind(self) != "default" and scaling.get("mscale_all_dim"):
            scale *= yarn_mscale(yarn_factor(self), scaling["mscale_all_dim"]) ** 2
        return scale


@dataclass
class DeepseekRouting:
    """One sparse layer's router (module docstring)."""

    weight: torch.Tensor  # [E, hidden] float32
    correction_bias: torch.Tensor | None  # [E] float32, V3
    cfg: DeepseekConfig

    def __call__(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k])."""
        cfg, k = self.cfg, self.cfg.num_experts_per_tok
        logits = F.linear(h.float(), self.weight)
        if cfg.scoring == "sigmoid":
            scores = logits.sigmoid()
            choice = scores + self.correction_bias
            groups = choice.view(h.shape[0], cfg.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
            choice = choice.masked_fill(~group_mask(groups, cfg.topk_group, choice.shape[1]), float("-inf"))
            ids = choice.topk(k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
            if cfg.norm_topk_prob:
                weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        else:
            scores = logits.softmax(dim=-1)
            if cfg.topk_method == "group_limited_greedy":
                groups = scores.view(h.shape[0], cfg.n_group, -1).max(dim=-1).values
                scores = scores.masked_fill(~group_mask(groups, cfg.topk_group, scores.shape[1]), 0.0)
            weights, ids = scores.topk(k, dim=-1, sorted=False)
        return weights * cfg.routed_scaling_factor, ids


def group_mask(group_scores: torch.Tensor, topk_group: int, experts: int) -> torch.Tensor:
    """[T, E] bool: the experts of each token's topk_group best groups."""
    chosen = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    return mask.repeat_interleave(experts // group_scores.shape[1], dim=1)


@dataclass
class MlaLayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv_a: torch.Tensor  # [q_lora_rank (or heads * qk_head_dim) + kv_lora_rank + rope, hidden]
    qkv_a_bias: torch.Tensor | None
    q_a_norm: torch.Tensor | None  # q_lora only
    q_b: torch.Tensor | None  # [heads * qk_head_dim, q_lora_rank], q_lora only
    kv_a_norm: torch.Tensor
    up: LatentUp
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor | None = None  # a dense layer's MLP
    down: torch.Tensor | None = None
    moe: MoeWeights | None = None  # a sparse layer's routed experts, shared ones below
    routing: DeepseekRouting | None = None
    shared_gate_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None
    rows: dict[str, torch.Tensor] | None = None  # plain copies of the linears for batch-1 decode (GEMV)

    def linear(self, name: str, x: torch.Tensor, bias: torch.Tensor | None = None,
               lora: LayerLora | None = None) -> torch.Tensor:
        """x through the linear `name`: the GEMV kernel on its plain rows for one row, if kept;
        plus the rows' LoRA deltas (the shared experts' under the dense MLP's names, LORA_NAMES)."""
        out = linear(x, getattr(self, name), bias, self.rows.get(name) if self.rows else None)
        return out if lora is None else lora.add(LORA_NAMES.get(name, name), x, out)


    def linears(self) -> list:
        """The layer's linears as loaded (DecoderModel's LayerWeights.linears: benchmarks/offline.py's streamed bytes)."""
        return [t for t in (getattr(self, n) for n in LINEARS) if t is not None]

    def plain(self, name: str) -> torch.Tensor:
        """The float linear `name` as a plain tensor (its batch-1 rows where kept, else unpacked: a
        copy a call where use_tensor_parallel has not unpacked it, a worker's MTP layer)."""
        rows = self.rows.get(name) if self.rows else None
        return rows if rows is not None else dense(getattr(self, name))


LINEARS = ("qkv_a", "q_b", "o", "gate_up", "down", "shared_gate_up", "shared_down")
LORA_NAMES = {"shared_gate_up": "gate_up", "shared_down": "down"}  # a layer has one or the other


def _interleaved_to_halves(rope_dim: int) -> torch.Tensor:
    """Row order that turns pairs (x0, x1), (x2, x3), ... into (x0, x2, ..., x1, x3, ...)."""
    return torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])


def rope_row_orders(cfg: DeepseekConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The row orders load_layer gives q (q_proj / q_b_proj: per head its nope rows, then its rope
    rows in halves order) and kv_a_proj_with_mqa (the latent, then the rope rows in halves order)."""
    heads, nope, rope = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    halves = _interleaved_to_halves(rope) if cfg.rope_interleave else torch.arange(rope)
    q_rows = torch.cat([h * (nope + rope) + torch.cat([torch.arange(nope), nope + halves]) for h in range(heads)])
    return q_rows, torch.cat([torch.arange(cfg.kv_lora_rank), cfg.kv_lora_rank + halves])


def _weight(src: TensorSource, name: str, dtype: torch.dtype) -> torch.Tensor:
    t = src.get(name, dtype)
    if isinstance(t, QuantizedWeight):
        raise ValueError(f"{name}: quantized weights are not supported for DeepSeek (MLA) models")
    return t


class DeepseekModel(DecoderModel):
    paged_kv_heads = False  # the latent cache: atomd/model/mla.py attends over it

    @classmethod
    def config_from_hf(cls, hf: dict[str, Any], arch: str) -> ModelConfig:
        v3 = arch == "DeepseekV3ForCausalLM"
        layers, experts = hf["num_hidden_layers"], hf.get("n_routed_experts") or 0
        first, freq = hf.get("first_k_dense_replace", 3 if v3 else 0), hf.get("moe_layer_freq", 1)
        sparse = tuple(i for i in range(layers) if experts and i >= first and i % freq == 0)
        method = "noaux_tc" if v3 else hf.get("topk_method") or "greedy"
        if not v3 and method not in V2_TOPK_METHODS:
            raise ValueError(f"{arch}: topk_method {method!r} is not supported (supported: {', '.join(V2_TOPK_METHODS)})")
        groups, chosen_groups, top_k = hf.get("n_group") or 1, hf.get("topk_group") or 1, hf.get("num_experts_per_tok") or 0
        if experts and (experts % groups or not 1 <= chosen_groups <= groups
                        or not 1 <= top_k <= experts // groups * chosen_groups or v3 and experts // groups < 2):
            raise ValueError(f"{arch}: n_routed_experts={experts}, n_group={groups}, topk_group={chosen_groups}, "
                             f"num_experts_per_tok={top_k} do not make groups to route within (V3 scores a group "
                             f"by its two best experts)")
        rope = hf["qk_rope_head_dim"]
        if rope % 2:
            raise ValueError(f"{arch}: qk_rope_head_dim {rope} must be even")
        return DeepseekConfig.from_hf(
            {**hf, "head_dim": rope, "num_key_value_heads": 1}, arch, sparse_layers=sparse, num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=hf.get("moe_intermediate_size") or 0,
            norm_topk_prob=bool(hf.get("norm_topk_prob", v3)), q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=rope,
            v_head_dim=hf["v_head_dim"], rope_interleave=bool(hf.get("rope_interleave", True)) if v3 else True,
            n_shared_experts=hf.get("n_shared_experts") or 0,
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            scoring="sigmoid" if v3 else "softmax", topk_method=method, n_group=groups,
            topk_group=chosen_groups)

    @classmethod
    def load_layer(cls, src: TensorSource, cfg: DeepseekConfig, i: int, dtype: torch.dtype) -> MlaLayerWeights:
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        heads, nope = cfg.num_heads, cfg.qk_nope_head_dim
        get = lambda name: _weight(src, name, dtype)  # noqa: E731
        q_rows, kv_a_rows = rope_row_orders(cfg)
        kv_a = get(attn + "kv_a_proj_with_mqa.weight")[kv_a_rows]
        bias = cfg.qkv_bias  # attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj have one
        if cfg.q_lora_rank:
            q_first, q_b = get(attn + "q_a_proj.weight"), get(attn + "q_b_proj.weight")[q_rows]
            q_bias = get(attn + "q_a_proj.bias") if bias else None
        else:
            q_first, q_b, q_bias = get(attn + "q_proj.weight")[q_rows], None, None
            if bias:
                q_bias = torch.zeros(q_first.shape[0], dtype=dtype)  # transformers' q_proj has none
        w = MlaLayerWeights(
            input_norm=get(p + "input_layernorm.weight"), post_norm=get(p + "post_attention_layernorm.weight"),
            qkv_a=torch.cat([q_first, kv_a]).contiguous(),
            qkv_a_bias=torch.cat([q_bias, get(attn + "kv_a_proj_with_mqa.bias")[kv_a_rows]]) if bias else None,
            q_a_norm=get(attn + "q_a_layernorm.weight") if cfg.q_lora_rank else None, q_b=q_b,
            kv_a_norm=get(attn + "kv_a_layernorm.weight"),
            up=LatentUp.of(get(attn + "kv_b_proj.weight"), heads, nope, cfg.v_head_dim, pack=False),
            o=get(attn + "o_proj.weight"), o_bias=get(attn + "o_proj.bias") if bias else None)
        if i in cfg.sparse_layers:
            gate_up, down = load_experts(src, mlp + "experts.", cfg.local_experts, "gate_proj", "up_proj",
                                         "down_proj", dtype)
            bias_name = mlp + "gate.e_score_correction_bias"
            w.routing = DeepseekRouting(src.get(mlp + "gate.weight", torch.float32),
                                        src.get(bias_name, torch.float32) if cfg.scoring == "sigmoid" else None, cfg)
            # the router's rows size the load counters (MoeWeights.routed); w.routing routes
            w.moe = MoeWeights(router=w.routing.weight, gate_up=gate_up, down=down, top_k=cfg.num_experts_per_tok,
                               norm_topk_prob=cfg.norm_topk_prob, cast_weights=False,
                               first_expert=cfg.local_experts.start)
            if cfg.n_shared_experts:
                shared = mlp + "shared_experts."
                w.shared_gate_up = cat(src, [shared + "gate_proj.weight", shared + "up_proj.weight"], dtype)
                w.shared_down = get(shared + "down_proj.weight")
        else:
            w.gate_up = cat(src, [mlp + "gate_proj.weight", mlp + "up_proj.weight"], dtype)
            w.down = get(mlp + "down_proj.weight")
        return w

    def __post_init__(self) -> None:
        cfg = self.config
        self.cos, self.sin = rope_tables(cfg, self.max_positions, self.embed.dtype)
        layer_ops.kernels()
        self.keeps_rows = self._keep_rows()
        if self.keeps_rows:  # batch-1 decode: the GEMV kernel on plain rows (DecoderModel._pack_weights)
            self.lm_head_rows = on_huge_pages(self.lm_head.contiguous())
        if self.packs():
            self.lm_head = pack_linear_weight(self.lm_head)
        elif self.keeps_rows:
            self.lm_head = self.lm_head_rows  # held once
        for w in self.layers:
            self.pack_layer(w)
        release_freed_memory()
        self.batch1 = MlaDecodeLayers(self) if self.keeps_rows and MlaDecodeLayers.takes(self) else None
        self.rows = MlaRows(self) if MlaRows.built(self) else None

    def packs(self) -> bool:
        """oneDNN's blocked layout for every other M (DecoderModel._pack_weights says why)."""
        return self.dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available() and (
            self.dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported())

    def pack_layer(self, w: MlaLayerWeights) -> None:
        """A layer's linears as the forward reads them: plain rows for the GEMV kernel (when the
        model keeps them), oneDNN's layout for the rest (also the MTP layer's, deepseek_mtp.py)."""
        if self.keeps_rows:  # the rows batch-1 decode streams on 2 MiB pages (huge_pages.py), held once
            w.rows = {name: on_huge_pages(getattr(w, name).contiguous()) for name in LINEARS
                      if getattr(w, name) is not None}
            if not self.packs():  # the rows are the weights: held once
                for name, rows in w.rows.items():
                    setattr(w, name, rows)
            w.up = replace(w.up, uk_t=on_huge_pages(w.up.uk_t), uv=on_huge_pages(w.up.uv))
            if w.moe is not None and w.moe.gemv:
                w.moe.gate_up, w.moe.down = on_huge_pages(w.moe.gate_up), on_huge_pages(w.moe.down)
        if w.moe is not None and w.moe.ep is None and moe_mod.AMX:  # the experts in moe_amx's layout where it runs
            w.moe.amx_weights()
        if self.packs():
            for name in LINEARS:
                if getattr(w, name) is not None:
                    setattr(w, name, pack_linear_weight(getattr(w, name)))
            w.up = replace(w.up, kv_b=pack_linear_weight(w.up.kv_b))
        if self.tp is not None and self.dtype == torch.bfloat16:  # (an MTP layer loaded after use_tensor_parallel)
            self.unpack_row_parallel(w)

    def unpack_row_parallel(self, w: MlaLayerWeights) -> None:
        """DecoderModel's for MLA's row-parallel linears: o_proj, the dense MLP's or shared experts' down."""
        for name in ("o", "down", "shared_down"):
            if isinstance(getattr(w, name), torch.Tensor):
                setattr(w, name, w.plain(name))

    def _keep_rows(self) -> bool:
        """The GEMV kernel runs this dtype, $ATOMD_GEMV is not 0, and all the linears' plain copies
        stay under GEMV_MAX_BYTES (every one is packed too; DecoderModel._pack_weights instead
        keeps the rows at any size and bounds the packed copies)."""
        if os.environ.get(GEMV_ENV) == "0" or not layer_ops.has_gemv(self.dtype):
            return False
        size = self.lm_head.numel() + sum(getattr(w, n).numel() for w in self.layers for n in LINEARS
                                          if getattr(w, n) is not None)
        return size * self.embed.element_size() <= GEMV_MAX_BYTES

    def attention_shape(self) -> tuple[int, int]:
        """The absorbed decode's (atomd/model/mla.py): one latent "head" for all the query heads."""
        return self.config.latent_dim, self.config.num_heads

    def kv_geometry(self) -> KVGeometry:
        """One latent row per token and layer: kv_lora_rank + qk_rope_head_dim values."""
        return KVGeometry(1, 1, self.config.latent_dim, MLA_KV_LAYOUT_VERSION)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache, logits_indices: torch.Tensor, lora: LoraStep | None = None,
                hidden_indices: torch.Tensor | None = None):
        """DecoderModel.forward's contract (LoRA and hidden_indices too); attention over the
        latent cache (atomd/model/mla.py). LoRA deltas on the linears atomd/model/deepseek_lora.py
        maps adapters onto (qkv_a, q_b, o, the dense MLP's or shared experts' gate_up / down)."""
        if positions.numel() and int(positions.max()) >= self.max_positions:
            raise IndexError(f"position {int(positions.max())} past the {self.max_positions} the model was loaded for")
        x = self.embed_tokens(input_ids)
        h = self.norm_rows(x, self.layers[0].input_norm)
        positions = self.rope_rows(positions.contiguous(), meta)
        step = self.prefill_row_tile(x.dtype)
        if self.ep is not None:  # one exchange per sparse layer and step on every rank: one tile
            step = max(x.shape[0], 1)
        lora = lora if lora is not None and lora.groups else None
        tiles = [(slice(r, r + step), lora and lora.tile(r, r + step)) for r in range(0, x.shape[0], step)]
        every_row = lora and lora.tile(0, x.shape[0])
        if self.batch1 is not None and self.batch1.runs(x, meta, kv_cache, lora, self):
            self.batch1(x, h, positions, meta, kv_cache, self)
        else:
            for i, w in enumerate(self.layers):
                attn = self._attention(h, w, i, positions, meta, kv_cache, every_row and every_row.layer(i))
                next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else None
                for tile, rows in tiles:
                    self._attn_out_and_mlp(x[tile], attn[tile], w, next_norm, h[tile], rows and rows.layer(i),
                                           not meta.is_prefill)
        logits = self.logits(self.norm_rows(x[logits_indices], self.norm))
        if hidden_indices is not None:
            return logits, self.norm_rows(x[hidden_indices], self.norm)
        return logits

    def _attention(self, h: torch.Tensor, w: MlaLayerWeights, i: int, positions: torch.Tensor,
                   meta: AttentionMetadata, kv_cache: KVCache, lora: LayerLora | None = None) -> torch.Tensor:
        """Layer i's attention output [T, heads * v_head_dim] before o_proj; the rows' latents stored."""
        cfg = self.config
        heads, rope, rank = cfg.num_heads, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        qkv_a = w.linear("qkv_a", h, w.qkv_a_bias, lora)
        q_end = qkv_a.shape[1] - cfg.latent_dim
        if w.q_b is not None:
            q = w.linear("q_b", rms_norm(qkv_a[:, :q_end], w.q_a_norm, cfg.rms_norm_eps), None, lora)
        else:
            q = qkv_a[:, :q_end]
        if self.rows is not None and self.rows.takes(h, meta, kv_cache):  # the glue below in one C call
            if not meta.is_prefill:  # the latents straight into the cache
                q = self.rows.head(qkv_a, q_end, q, w.kv_a_norm, positions, *self.rows.cache_slots(meta, kv_cache, i))
                return mla_decode(q, kv_cache, i, meta, w.up, cfg.mla_scale)
            latent = torch.empty(len(h), cfg.latent_dim, dtype=h.dtype)  # a fresh prompt's attention reads them
            q = self.rows.head(qkv_a, q_end, q, w.kv_a_norm, positions, latent.data_ptr(),
                               torch.arange(0, latent.numel(), cfg.latent_dim))
            store_latent(kv_cache, i, meta, latent)
            return mla_prefill(q, latent, kv_cache, i, meta, w.up, cfg.mla_scale)
        q = q.reshape(-1, heads, cfg.qk_head_dim)
        latent = torch.cat([rms_norm(qkv_a[:, q_end:q_end + rank], w.kv_a_norm, cfg.rms_norm_eps),
                            qkv_a[:, q_end + rank:]], dim=1)
        cos, sin = self.cos[positions], self.sin[positions]
        q[..., -rope:] = rotate_half_rope(q[..., -rope:], cos.unsqueeze(1), sin.unsqueeze(1))
        latent[:, rank:] = rotate_half_rope(latent[:, rank:], cos, sin)
        store_latent(kv_cache, i, meta, latent)
        if meta.is_prefill:
            return mla_prefill(q, latent, kv_cache, i, meta, w.up, cfg.mla_scale)
        return mla_decode(q, kv_cache, i, meta, w.up, cfg.mla_scale)

    def _tp_bf16_out_and_mlp(self, x: torch.Tensor, attn: torch.Tensor, w: MlaLayerWeights,
                             lora: LayerLora | None) -> torch.Tensor:
        """_attn_out_and_mlp's MLP output of a bf16 TP worker (float weights), rounded where TP=1
        rounds: o_proj's and the dense or shared experts' down partials float32 into the all-reduce
        (DecoderModel.row_parallel's rule), the routed experts' per (token, expert) pair (moe.moe_tp);
        in a sparse layer the pairs' and the shared experts' partials share one all-reduce. x gets the
        attention output added (the residual, as rms_norm's delta does)."""
        o = self.reduce_(row_partial(lora, "o", attn, w.plain("o"), w.o_bias)).to(attn.dtype)
        h = rms_norm(x, w.post_norm, self.config.rms_norm_eps, delta=o)
        if w.moe is None:
            act = silu_mul(w.linear("gate_up", h, None, lora))
            return self.reduce_(row_partial(lora, "down", act, w.plain("down"), None)).to(h.dtype)
        if self.tp_experts_rank0:  # TP x EP: rank 0's routed output (bf16, EP's bits) beside the shared partials
            routed = self.routed_experts(h, w.moe, w.routing(h))
            if w.shared_gate_up is None:
                return self.reduce_(routed)
            shared = silu_mul(w.linear("shared_gate_up", h, None, lora))
            sums = self.reduce_(torch.cat([routed.float(), row_partial(lora, "down", shared, w.plain("shared_down"),
                                                                       None)]))
            return sums[:len(h)].to(h.dtype) + sums[len(h):].to(h.dtype)
        if not tp_exact(h, w.moe):
            return self.reduce_(moe(h, w.moe, w.routing(h)) + (0 if w.shared_gate_up is None else w.linear(
                "shared_down", silu_mul(w.linear("shared_gate_up", h, None, lora)), None, lora)))
        partial, weights = tp_partials(h, w.moe, w.routing(h))
        if w.shared_gate_up is None:
            return from_tp_sums(self.reduce_(partial), weights, w.moe)
        shared = silu_mul(w.linear("shared_gate_up", h, None, lora))
        sums = self.reduce_(torch.cat([partial, row_partial(lora, "down", shared, w.plain("shared_down"), None)]))
        return from_tp_sums(sums[:len(partial)], weights, w.moe) + sums[len(partial):].to(h.dtype)

    def _attn_out_and_mlp(self, x: torch.Tensor, attn: torch.Tensor, w: MlaLayerWeights,
                          next_norm: torch.Tensor | None, next_h: torch.Tensor, lora: LayerLora | None = None,
                          rows_moe: bool = False) -> None:
        """DecoderModel's, with DeepSeekMoE: routed experts plus the shared ones (LoRA's gate_up /
        down deltas on the shared experts in a sparse layer, on the MLP in a dense one). rows_moe:
        a decode step's rows, whose routed experts MlaRows.moe runs where it can."""
        eps = self.config.rms_norm_eps
        if self.tp is not None and attn.dtype == torch.bfloat16 and isinstance(w.o, torch.Tensor):
            down = self._tp_bf16_out_and_mlp(x, attn, w, lora)
        else:
            h = rms_norm(x, w.post_norm, eps, delta=self.reduce_(w.linear("o", attn, w.o_bias, lora)))
            if w.moe is not None:
                # the routed experts (and the shared ones, without LoRA) in one C call where it runs them
                rows = self.rows.moe(h, w, lora is None) if self.rows is not None and rows_moe and self.tp is None \
                    else None
                down = self.routed_experts(h, w.moe, w.routing(h)) if rows is None else rows
                if w.shared_gate_up is not None and (rows is None or lora is not None):
                    shared = silu_mul(w.linear("shared_gate_up", h, None, lora))
                    down = down + w.linear("shared_down", shared, None, lora)
            else:
                down = w.linear("down", silu_mul(w.linear("gate_up", h, None, lora)), None, lora)
            down = self.reduce_(down)  # under TP: routed and shared experts' partial sums in one all-reduce
        if next_norm is None:
            x.add_(down)
        else:
            rms_norm(x, next_norm, eps, delta=down, out=next_h)


MAX_ROWS = 4  # MlaDecodeLayers: a sequence's token and up to 3 drafts
# batch-1 decode through MlaDecodeLayers where it runs; False: the per-op layer (the A/B of
# benchmarks/deepseek_decode_step.py --switch layer)
FUSED = True


class MlaDecodeLayers:
    """Batch-1 decode of a DeepseekModel's layers: per layer csrc/layer_ops.c's atomd_mla_head
    (projections, norms, RoPE, the latent row stored), csrc/mla.c's absorbed decode and
    atomd_mla_tail (o_proj, the MLP or DeepSeekMoE's routing, experts and shared experts, the
    norms), one C call for every layer where the per-op layer made ~30 calls a layer. The ctypes
    structs are built once at load over the layers' plain rows (held by the model); the scratch
    per thread count."""

    @staticmethod
    def takes(model: "DeepseekModel") -> bool:
        """The model's layers are what the C layer runs (plain rows, no biases, experts on the GEMV kernel)."""
        return (layer_ops.has_gemv(model.dtype) and not model.config.qkv_bias
                and all(w.moe is None or w.moe.gemv and not w.moe.quantized for w in model.layers))

    def __init__(self, model: "DeepseekModel", layers: list[MlaLayerWeights] | None = None, kv_layer: int = 0):
        """Over `layers` (the model's by default; deepseek_mtp.py: its MTP layer), the first of them
        at layer `kv_layer` of the cache."""
        cfg, lib = model.config, layer_ops.kernels()
        layers = model.layers if layers is None else layers
        self.kv_layer = kv_layer
        suffix = "bf16" if model.dtype == torch.bfloat16 else "f32"
        self.layers_fn = getattr(lib, f"atomd_mla_layers_{suffix}")
        self.lib, self.dtype = lib, model.dtype
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        widths = [cfg.moe_intermediate_size if cfg.sparse_layers else 0]
        self.structs = []
        for i, w in enumerate(layers):
            r, moe = w.rows, w.moe
            gate_up, down = r.get("gate_up", r.get("shared_gate_up")), r.get("down", r.get("shared_down"))
            widths.append(0 if gate_up is None else gate_up.shape[0] // 2)
            if moe is not None:
                assert moe.gate_up.is_contiguous() and moe.down.is_contiguous() and w.routing.weight.is_contiguous()
            self.structs.append(layer_ops.MlaLayerWeights(
                qkv_a=ptr(r["qkv_a"]), q_a_norm=ptr(w.q_a_norm), q_b=ptr(r.get("q_b")), kv_a_norm=ptr(w.kv_a_norm),
                o=ptr(r["o"]), post_norm=ptr(w.post_norm), gate_up=ptr(gate_up), down=ptr(down),
                router=moe and ptr(w.routing.weight), correction=moe and ptr(w.routing.correction_bias),
                experts_gate_up=moe and ptr(moe.gate_up), experts_down=moe and ptr(moe.down),
                routed=moe and ptr(moe.routed),
                next_norm=ptr(layers[i + 1].input_norm) if i + 1 < len(layers) else None,
                inter=widths[-1], uk_t=ptr(w.up.uk_t), uv=ptr(w.up.uv)))
        self.structs = (layer_ops.MlaLayerWeights * len(self.structs))(*self.structs)
        self.config = mla_layer_config(cfg, max(widths), MAX_ROWS)
        self.q = torch.empty(MAX_ROWS, cfg.num_heads, cfg.qk_head_dim, dtype=model.dtype)
        self.attn = torch.empty(MAX_ROWS, cfg.num_heads * cfg.v_head_dim, dtype=model.dtype)
        self.scratch: dict[int, torch.Tensor] = {}

    def runs(self, x: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache, lora, model: "DeepseekModel") -> bool:
        """This step is one sequence's decode row, or its row and drafts (a verify step), this
        path takes (no LoRA, TP, EP; the C absorbed decode over a cache in the model's dtype)."""
        return (FUSED and x.shape[0] <= MAX_ROWS and not meta.is_prefill and meta.block_tables.shape[0] == 1
                and (x.shape[0] == 1 or meta.query_starts is not None) and lora is None
                and model.tp is None and model.ep is None and meta.kernels is not None
                and fused_decode_kernels(meta.kernels, kv_cache, self.config.rank, self.config.rope,
                                         model.layers[0].up) is not None)

    def __call__(self, x: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_cache: KVCache, model: "DeepseekModel") -> None:
        """Every layer over the rows x [R, hidden] (updated in place) from h, their first norm: one C call."""
        args, scratch, threads = self.call_args(x, h, positions, meta, kv_cache, model)
        native._check_status(self.layers_fn(
            self.structs, len(self.structs), ctypes.byref(self.config), ctypes.byref(args), x.shape[0], h.data_ptr(),
            x.data_ptr(), model.cos.data_ptr(), model.sin.data_ptr(), self.q.data_ptr(), self.attn.data_ptr(),
            scratch.data_ptr(), threads), "MLA decode")

    def call_args(self, x: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                  kv_cache: KVCache, model: "DeepseekModel") -> tuple[layer_ops.MlaAttentionArgs, torch.Tensor, int]:
        """A call's attention arguments, its scratch and thread count (also deepseek_mtp.py's MTP pass)."""
        c, threads, rows = self.config, torch.get_num_threads(), x.shape[0]
        scratch = self.scratch.get(threads)
        if scratch is None:
            scratch = self.scratch[threads] = torch.empty(
                int(self.lib.atomd_mla_scratch_elems(ctypes.byref(c), threads)), dtype=self.dtype)
        mla_lib = fused_decode_kernels(meta.kernels, kv_cache, c.rank, c.rope, model.layers[0].up)
        kv, tables, lens = kv_cache.kv, meta.block_tables, meta.context_lens
        # what native.mla_decode checks per call: this path made q, attn and the weights
        assert kv.is_contiguous() and tables.is_contiguous() and lens.is_contiguous() and positions.is_contiguous()
        assert x.is_contiguous() and h.is_contiguous() and positions.dtype == torch.int64
        layer_elems = kv_cache.block_size * kv_cache.head_dim
        block_elems = kv_cache.num_layers * layer_elems
        slots = meta.slot_blocks * block_elems + meta.slot_offsets * kv_cache.head_dim  # layer 0's, from kv
        starts = meta.query_starts
        args = layer_ops.MlaAttentionArgs(
            fn=ctypes.cast(mla_lib.atomd_mla_decode, ctypes.c_void_p).value,
            kv=kv.data_ptr() + self.kv_layer * layer_elems * kv.element_size(),
            block_tables=tables.data_ptr(), context_lens=lens.data_ptr(),
            query_starts=None if rows == 1 else starts.data_ptr(), block_size=kv_cache.block_size,
            table_width=tables.shape[1], block_stride=block_elems, layer_stride=layer_elems,
            scale=model.config.mla_scale, slots=slots.data_ptr(), positions=positions.data_ptr())
        args.keep = slots  # the C call reads it
        return args, scratch, threads


def mla_layer_config(cfg: DeepseekConfig, max_inter: int = 0, max_rows: int = 0) -> layer_ops.MlaLayerConfig:
    """csrc/layer_ops.c's mla_layer_config of the model (max_inter, max_rows: the batch-1 layer's scratch)."""
    scoring = 2 if cfg.scoring == "sigmoid" else int(cfg.topk_method == "group_limited_greedy")
    return layer_ops.MlaLayerConfig(
        hidden=cfg.hidden_size, heads=cfg.num_heads, nope=cfg.qk_nope_head_dim, rope=cfg.qk_rope_head_dim,
        rank=cfg.kv_lora_rank, v=cfg.v_head_dim, q_lora=cfg.q_lora_rank or 0, experts=cfg.num_experts,
        moe_inter=cfg.moe_intermediate_size, top_k=cfg.num_experts_per_tok, n_group=cfg.n_group,
        topk_group=cfg.topk_group, max_inter=max_inter, scoring=scoring, norm_topk_prob=int(cfg.norm_topk_prob),
        routed_scaling_factor=cfg.routed_scaling_factor, eps=cfg.rms_norm_eps, max_rows=max_rows)


# a decode step's rows through MlaRows (the glue between the linears in C); False: the per-op glue
# (the A/B of benchmarks/deepseek_decode_step.py --switch rows)
ROWS = True


class MlaRows:
    """A step's rows (a decode batch; batch 1 where MlaDecodeLayers does not take it; a prefill's head)
    with the per-op layer's glue between oneDNN's linears in C (csrc/layer_ops.c): after qkv_a (and
    q_b), atomd_mla_rows_head (q RoPE'd, the latent normed, RoPE'd and stored: ~15 torch ops a layer,
    each a pass over a prefill's rows),
    and a decode step's sparse layers' routed and shared experts, atomd_mla_rows_moe_bf16 (router,
    pair sort, AMX experts, the pairs' sum, the shared MLP on the tiles too: ~25 calls a layer,
    where the experts run on AMX tiles; a prefill's experts keep moe(): its router is one GEMM there). Why: at batch 16 about
    a third of the per-op step was such serial glue between the parallel kernels (benchmarks/RESULTS.md #37)."""

    @staticmethod
    def built(model: "DeepseekModel") -> bool:
        """The C glue is built for the model's dtype here (the batch-1 layer's kernels). Tensor
        parallelism starts after the load (use_tensor_parallel), so takes() and the MoE call check it
        a step, as MlaDecodeLayers.runs does."""
        return layer_ops.has_gemv(model.dtype)

    def __init__(self, model: "DeepseekModel"):
        self.model, self.lib, self.config = model, layer_ops.kernels(), mla_layer_config(model.config)
        self.head_fn = getattr(self.lib, f"atomd_mla_rows_head_{layer_ops._SUFFIX[model.dtype]}")
        self.slots: tuple[AttentionMetadata, torch.Tensor] | None = None  # cache_slots'
        self.shared: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}  # shared_amx's, by id of the layer

    def takes(self, h: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache) -> bool:
        """Not under TP; a decode step (rows over cached contexts) over a contiguous cache in the model's
        dtype (its latents go straight in), or a prefill step."""
        return ROWS and self.model.tp is None and (meta.is_prefill or kv_cache.kv.dtype == h.dtype
                                                   and kv_cache.kv.is_contiguous())

    def cache_slots(self, meta: AttentionMetadata, kv_cache: KVCache, layer: int) -> tuple[int, torch.Tensor]:
        """(address of layer `layer`'s latent rows in the cache, each decode row's slot: elements from there)."""
        if self.slots is None or self.slots[0] is not meta:  # the step's, reused by every layer
            layer_elems = kv_cache.block_size * kv_cache.head_dim
            self.slots = meta, (meta.slot_blocks * (kv_cache.num_layers * layer_elems)
                                + meta.slot_offsets * kv_cache.head_dim).contiguous()
        kv = kv_cache.kv
        return kv.data_ptr() + layer * kv_cache.block_size * kv_cache.head_dim * kv.element_size(), self.slots[1]

    def head(self, qkv_a: torch.Tensor, q_end: int, q: torch.Tensor, kv_a_norm: torch.Tensor,
             positions: torch.Tensor, latents: int, slots: torch.Tensor) -> torch.Tensor:
        """q [R, heads, nope + rope] RoPE'd (a new tensor) from q (qkv_a's first q_end columns or
        q_b's output); the rows' latents from qkv_a's other columns, normed, RoPE'd, row r's written
        slots[r] elements past the address `latents` (the cache's layer, or a [R, latent] tensor)."""
        c, rows = self.config, qkv_a.shape[0]
        assert qkv_a.stride(1) == q.stride(1) == 1 and positions.dtype == torch.int64 and positions.is_contiguous()
        assert slots.dtype == torch.int64 and slots.is_contiguous() and len(slots) == rows == len(positions)
        out = torch.empty(rows, c.heads, c.nope + c.rope, dtype=qkv_a.dtype)
        self.head_fn(ctypes.byref(c), rows, qkv_a.data_ptr(), qkv_a.stride(0), q_end, q.data_ptr(), q.stride(0),
                     kv_a_norm.data_ptr(), self.model.cos.data_ptr(), self.model.sin.data_ptr(), positions.data_ptr(),
                     latents, slots.data_ptr(), out.data_ptr(), torch.get_num_threads())
        return out

    def moe(self, h: torch.Tensor, w: MlaLayerWeights, shared: bool) -> torch.Tensor | None:
        """The routed experts' output [R, hidden] of the rows h (moe(h, w.moe, w.routing(h))'s values, its
        load counters counted), plus the shared experts' (a bf16 add, as the per-op layer's) where
        `shared` and the layer has them; None where this call does not run them (not bf16 experts on
        AMX tiles)."""
        packed = w.moe.amx_weights() if ROWS and moe_mod.AMX and h.dtype == torch.bfloat16 else None
        if packed is None:
            return None
        c, rows, k = self.config, h.shape[0], w.moe.top_k
        h = h.contiguous()
        pairs = torch.empty(rows * k, h.shape[1], dtype=torch.float32)
        out = torch.empty_like(h)
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        both = self.shared_amx(w) if shared and w.shared_gate_up is not None else None
        shared_out = torch.empty_like(h) if both is not None else None
        status = self.lib.atomd_mla_rows_moe_bf16(
            ctypes.byref(c), w.routing.weight.data_ptr(), ptr(w.routing.correction_bias), packed[0].data_ptr(),
            packed[1].data_ptr(), w.moe.routed.data_ptr(), h.data_ptr(), rows, pairs.data_ptr(), out.data_ptr(),
            *((None, None, 0) if both is None else (both[0].data_ptr(), both[1].data_ptr(), both[0].shape[1] * 8)),
            ptr(shared_out), torch.get_num_threads())
        if status < 0:
            raise MemoryError("MLA rows MoE: no scratch memory")
        return out if status == 0 else None

    def shared_amx(self, w: MlaLayerWeights) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's shared experts as one expert packed for the tiles (layer_ops.pack_amx; made at
        the first call), or None where their width is off the tiles."""
        if id(w) not in self.shared:
            gate_up, down = w.plain("shared_gate_up"), w.plain("shared_down")
            fits = gate_up.shape[0] // 2 % layer_ops.AMX_MULTIPLE == 0
            self.shared[id(w)] = (layer_ops.pack_amx(gate_up[None]), layer_ops.pack_amx(down[None])) if fits else None
        return self.shared[id(w)]


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., rope] rotated: halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
