"""DeepSeek V3's multi-token prediction (MTP) module, as the speculative drafter
(`--speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'`).

A V3 checkpoint with `num_nextn_predict_layers` = n keeps n MTP layers after the main ones,
model.layers.{num_hidden_layers + j}: `enorm`, `hnorm`, `eh_proj` [hidden, 2 * hidden], a full
decoder layer (MLA + DeepSeekMoE, loaded as the main layers are), `shared_head.norm`, and
optionally its own `embed_tokens` and `shared_head.head` (released checkpoints copy the main
ones there; without them the main ones are used, as SGLang shares them). At position p it reads
the main model's final-normed hidden state h_p and the embedding of the token at p + 1:

    x = eh_proj([enorm(embed(t_{p+1})) ; hnorm(h_p)])      (embedding first: the checkpoints' order,
    x = decoder_layer(x) at position p                      vLLM's and SGLang's)
    logits = head(shared_head.norm(x))                      -> the token at p + 2

Its attention has its own latent KV cache over the sequence shifted by one: the engine's cache
gets one more layer (index num_hidden_layers) in the same blocks, written at the same positions
and slots as the main layers, so the block tables, PD transfer and preemption need nothing more.
Only the first MTP layer is loaded; k > 1 drafts chain it on its own output (x before
shared_head's norm, in place of h, and its own draft as the next token, one position on: what
vLLM and SGLang do with V3's one layer; atomd/engine/mtp_proposer.py). Under expert parallelism
its experts are sharded and exchanged as a main sparse layer's; every rank runs k MTP passes a
step in lockstep (empty ones where it has nothing to draft), so the collective counts match.

Under tensor parallelism (`split`) the MTP layer is split as the main layers are (its MLA by
heads, its experts by rows, its embedding and head by vocabulary rows; enorm / hnorm / eh_proj
whole): every rank runs `mtp_forward` over the same rows, its two all-reduces and the logits'
gather, for each of the step's passes (atomd/engine/mtp_proposer.py: rank 0 announces each pass to
the workers). Under TP x EP its routed experts follow the main layers' rule: TP rank 0 holds its DP
rank's whole and exchanges, the other TP ranks hold none and add zeros.
"""
from __future__ import annotations

import ctypes
import dataclasses
import pathlib
from dataclasses import dataclass

import torch

from atomd.engine.kv_cache import AttentionMetadata, KVCache
from atomd.kernels import native
from atomd.model import layer_ops
from atomd.model.deepseek import MAX_ROWS, DeepseekModel, MlaDecodeLayers, MlaLayerWeights
from atomd.model.huge_pages import on_huge_pages
from atomd.model.layer_ops import rms_norm
from atomd.model.linear import linear, pack_linear_weight
from atomd.model.loader import _TensorSource, read_config, read_hf_config, sharded_source
from atomd.model.tp_split import TPSplit


@dataclass
class MtpLayer:
    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: torch.Tensor  # [hidden, 2 * hidden]: embedding half first, hidden-state half second
    layer: MlaLayerWeights
    head_norm: torch.Tensor
    embed: torch.Tensor  # its own embed_tokens, or the main model's
    head: torch.Tensor  # shared_head.head, or the main model's lm_head
    kv_layer: int  # its layer in the engine's KV cache: num_hidden_layers
    batch1: MlaDecodeLayers | None = None  # its layer over one sequence's decode rows, as the main model's
    head_rows: torch.Tensor | None = None  # plain rows of `head` (the main model's when it shares that head): GEMV
    eh_rows: torch.Tensor | None = None  # plain rows of eh_proj: a one-row pass's GEMV
    fused: "MtpPass | None" = None  # one sequence's decode rows: the whole pass in one C call


class MtpPass:
    """mtp_forward over one sequence's decode rows (its token, or token and drafts: where the batch-1
    C layer runs) as one C call, csrc/layer_ops.c atomd_mtp_pass: the norms, eh_proj and the head on
    the GEMV kernel's plain rows around the layer's atomd_mla_layers, where the per-op pass made ~12
    Python-level calls (~0.25 ms a step at hidden 256)."""

    def __init__(self, model: DeepseekModel, mtp: MtpLayer):
        suffix = "bf16" if model.dtype == torch.bfloat16 else "f32"
        self.fn = getattr(mtp.batch1.lib, f"atomd_mtp_pass_{suffix}")
        ptr = lambda t: t.data_ptr()  # noqa: E731
        self.weights = layer_ops.MtpWeights(
            embed=ptr(mtp.embed), enorm=ptr(mtp.enorm), hnorm=ptr(mtp.hnorm), eh_proj=ptr(mtp.eh_rows),
            input_norm=ptr(mtp.layer.input_norm), head_norm=ptr(mtp.head_norm), head=ptr(mtp.head_rows),
            vocab=mtp.head_rows.shape[0])
        self.held = (mtp.embed, mtp.enorm, mtp.hnorm, mtp.eh_rows, mtp.layer.input_norm, mtp.head_norm, mtp.head_rows)
        assert all(t.is_contiguous() and t.dtype == model.dtype for t in self.held)
        hidden = model.config.hidden_size
        self.eh = torch.empty(MAX_ROWS, 2 * hidden, dtype=model.dtype)
        self.h = torch.empty(MAX_ROWS, hidden, dtype=model.dtype)

    @staticmethod
    def takes(model: DeepseekModel, mtp: MtpLayer) -> bool:
        return (mtp.batch1 is not None and mtp.eh_rows is not None and mtp.head_rows is not None
                and model.tp is None and mtp.embed.dtype == model.dtype)

    def __call__(self, model: DeepseekModel, mtp: MtpLayer, next_ids: torch.Tensor, hidden: torch.Tensor,
                 positions: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache,
                 logits_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = len(next_ids)
        x = torch.empty(rows, hidden.shape[1], dtype=hidden.dtype)
        next_ids, hidden = next_ids.contiguous(), hidden.contiguous()
        logits_rows = logits_rows.to(torch.int64).contiguous()
        logits = torch.empty(len(logits_rows), self.weights.vocab, dtype=hidden.dtype)
        args, scratch, threads = mtp.batch1.call_args(x, self.h, positions, meta, kv_cache, model)
        b = mtp.batch1
        native._check_status(self.fn(
            ctypes.byref(self.weights), b.structs, ctypes.byref(b.config), ctypes.byref(args), rows,
            next_ids.data_ptr(), hidden.data_ptr(), self.eh.data_ptr(), self.h.data_ptr(), x.data_ptr(),
            len(logits_rows), logits_rows.data_ptr(), logits.data_ptr(), model.cos.data_ptr(), model.sin.data_ptr(),
            b.q.data_ptr(), b.attn.data_ptr(), scratch.data_ptr(), threads), "MTP pass")
        return logits, x[logits_rows]


def mtp_layer_count(hf: dict) -> int:
    return int(hf.get("num_nextn_predict_layers") or 0)


def load_mtp(model_dir: pathlib.Path, model: DeepseekModel, split: TPSplit | None = None) -> MtpLayer:
    """The first MTP layer of a DeepSeek checkpoint (ValueError saying why there is none); `split`:
    tensor-parallel worker split.rank's slice of it (the model is that worker's shard)."""
    cfg, hf = model.config, read_hf_config(model_dir)
    if not isinstance(model, DeepseekModel) or not mtp_layer_count(hf):
        raise ValueError(f"speculative_config method mtp: the checkpoint ({cfg.architecture}) has no MTP module "
                         f"(DeepSeek V3's num_nextn_predict_layers is {mtp_layer_count(hf)}); use method ngram")
    # TP x EP (loader.load_model): TP rank 0 holds its DP rank's routed experts whole, the other TP ranks none
    experts = "split" if not model.tp_experts_rank0 else "whole" if split.rank == 0 else "none"
    if cfg.expert_ranks > 1 and model.ep is None and experts != "none":  # a slice with nothing to exchange
        raise ValueError("an expert-parallel rank's MTP layer loads after use_expert_parallel")
    i, dtype = cfg.num_layers, model.dtype
    src = type(model).tensor_source(_TensorSource(model_dir), cfg)
    if split is not None:
        src = sharded_source(src, read_config(model_dir), split, experts=experts)
    p = f"model.layers.{i}."
    if p + "eh_proj.weight" not in src:
        raise ValueError(f"speculative_config method mtp: num_nextn_predict_layers is {mtp_layer_count(hf)} but the "
                         f"checkpoint has no {p}eh_proj.weight (its MTP weights were dropped)")
    first, freq = hf.get("first_k_dense_replace", 3), hf.get("moe_layer_freq", 1)
    sparse = cfg.num_experts and i >= first and i % freq == 0  # DeepSeek's rule, as for the main layers
    layer_cfg = dataclasses.replace(cfg, sparse_layers=cfg.sparse_layers + ((i,) if sparse else ()))
    get = lambda name: src.get(p + name, dtype)  # noqa: E731
    own = lambda name, main: get(name) if p + name in src else main  # noqa: E731
    pack = pack_linear_weight if model.packs() else (lambda t: t)

    def rows_and_weight(t: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """A linear's plain rows for a one-row pass's GEMV (as the main model keeps them), and the
        weight the other passes read (oneDNN's layout, or those rows: held once)."""
        rows = on_huge_pages(t.contiguous()) if model.keeps_rows else None
        return rows, pack(t) if model.packs() or rows is None else rows
    layer = DeepseekModel.load_layer(src, layer_cfg, i, dtype)  # this rank's experts under expert parallelism
    model.pack_layer(layer)  # as the main layers run
    if model.ep is not None and layer.moe is not None:  # its MoE exchanges as the main sparse layers' do
        layer.moe.ep = model.ep
        model.ep.attach(layer.moe)
    if p + "shared_head.head.weight" in src:
        head_rows, head = rows_and_weight(get("shared_head.head.weight"))
    else:
        head, head_rows = model.lm_head, model.lm_head_rows
    eh_rows, eh_proj = rows_and_weight(get("eh_proj.weight"))
    mtp = MtpLayer(enorm=get("enorm.weight"), hnorm=get("hnorm.weight"), eh_proj=eh_proj,
                   layer=layer, head_norm=get("shared_head.norm.weight"),
                   embed=own("embed_tokens.weight", model.embed), head=head, kv_layer=i,
                   batch1=MlaDecodeLayers(model, [layer], kv_layer=i) if model.batch1 is not None else None,
                   head_rows=head_rows, eh_rows=eh_rows)
    mtp.fused = MtpPass(model, mtp) if MtpPass.takes(model, mtp) else None
    return mtp


def mtp_exchange_idle(model: DeepseekModel, mtp: MtpLayer) -> None:
    """Expert parallelism: one MTP pass's part in the exchange with no rows of this rank's own
    (a rank with no drafting pass to run while another runs one), so the collectives match."""
    if model.ep is not None and mtp.layer.moe is not None:
        model.ep.moe(torch.empty(0, model.config.hidden_size, dtype=model.dtype), mtp.layer.moe)


def mtp_forward(model: DeepseekModel, mtp: MtpLayer, next_ids: torch.Tensor, hidden: torch.Tensor,
                positions: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache,
                logits_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [len(logits_rows), vocab] of the MTP layer over the step's rows, and those rows'
    output states [len(logits_rows), hidden] (before shared_head's norm: what a chained draft
    reads as its `hidden`): next_ids [T] the token after each row's, hidden [T, hidden] the main
    model's final-normed states of the rows (or a chained draft's MTP states), at the forward's
    positions and metadata (its latent rows stored in the MTP's cache layer for every row)."""
    if mtp.fused is not None and len(logits_rows) and mtp.batch1.runs(hidden, meta, kv_cache, None, model):
        return mtp.fused(model, mtp, next_ids, hidden, model.rope_rows(positions.contiguous(), meta), meta, kv_cache,
                         logits_rows)
    eps, size = model.config.rms_norm_eps, hidden.shape[1]
    embed = torch.nn.functional.embedding(next_ids, mtp.embed) if model.tp is None else \
        model.tp.embed(next_ids, mtp.embed)  # this worker's vocabulary rows, summed over the workers
    eh = torch.empty(len(hidden), 2 * size, dtype=hidden.dtype)  # [enorm(e) ; hnorm(h)], normed in place
    rms_norm(embed, mtp.enorm, eps, out=eh[:, :size])
    rms_norm(hidden, mtp.hnorm, eps, out=eh[:, size:])
    x = linear(eh, mtp.eh_proj, None, mtp.eh_rows)
    w = mtp.layer
    h = rms_norm(x, w.input_norm, eps)
    positions = model.rope_rows(positions.contiguous(), meta)
    if mtp.batch1 is not None and mtp.batch1.runs(x, meta, kv_cache, None, model):
        mtp.batch1(x, h, positions, meta, kv_cache, model)  # one sequence's decode rows: the C layer
    else:
        attn = model._attention(h, w, mtp.kv_layer, positions, meta, kv_cache)
        model._attn_out_and_mlp(x, attn, w, None, h)  # x += attention out, then += the MLP's (in place)
    if not len(logits_rows):  # a prefill chunk that samples nothing: only the MTP's KV rows
        return x.new_empty(0, model.config.vocab_size), x[:0]
    states = x[logits_rows]
    logits = linear(rms_norm(states, mtp.head_norm, eps), mtp.head, None, mtp.head_rows)
    return (logits if model.tp is None else model.tp.gather_logits(logits)), states
