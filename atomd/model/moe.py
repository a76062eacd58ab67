"""The sparse MoE block (Mixtral, Qwen3-MoE, DeepSeekMoE's routed experts): softmax top-k
routing, then the tokens grouped by expert (one argsort) and every active expert over its
tokens, scaled by their routing weights and scattered back: one C call where the GEMV kernel
runs the dtype (layer_ops.moe_experts for one token, moe_grouped for several), else one GEMM
pair per active expert. No per-token Python loop; only the active experts' weights are read. Batch-1
decode through the fused C layer (layer_ops.DecodeLayer) runs the whole block there, routing
included, and skips this module. With expert parallelism the weights hold this rank's slice of the experts
and `ep` runs the block across the ranks (atomd/model/expert_parallel.py)."""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from atomd.model import layer_ops, quant
from atomd.model.layer_ops import silu_mul
from atomd.model.linear import GEMV_ENV, linear, linear_f32
from atomd.model.quant import QuantizedWeight


# several tokens through the experts: one C call (layer_ops.moe_grouped) where the GEMV kernel
# runs this dtype; False: one torch linear pair per active expert (the A/B of benchmarks/deepseek_decode_step.py)
GROUPED = True
# ... each active expert with at most this many (token, choice) pairs: past it one oneDNN
# GEMM pair for that expert is faster (bf16, 64 experts top-8, hidden 1024, inter 256, one thread:
# grouped / per-expert 0.53x at 16 tokens (2 pairs an expert), 0.86x at 128 (16), 1.02x at 256
# (32), 1.13x at 512, 1.25x at 2048: a prefill's experts; benchmarks/RESULTS.md "MoE prefill")
GROUPED_MAX_PAIRS = 32
# several tokens through the experts on AMX tiles (layer_ops.moe_amx, any number of pairs) where the
# CPU has them: bf16 float experts packed for the tiles at load (MoeWeights.amx_weights; a second
# copy of the experts: the batch-1 kernels read the plain rows), not under expert parallelism
# (which rewrites the expert slots); False (or $ATOMD_MOE_AMX=0 at import): the paths above (the A/B of
# benchmarks/moe_block.py and engine-level runs)
AMX = os.environ.get("ATOMD_MOE_AMX") != "0"
# int8 / int4 experts with int8 activations in one C call a block (layer_ops.moe_q8: AMX-INT8 tiles from
# quant.QGEMM_AMX_MIN_M rows an expert, without them the int8 GEMM (VNNI or AVX2) from quant.q8_gemm_min_m, the
# int8-activation rows below), batch 1 included, where the kernel is built (AVX-512 and AVX2 builds); with neither
# tiles nor GEMM only experts of at most quant.QGEMM_Q8_MAX_M pairs (qlinear's float tiles past it); 16-bit experts
# (`--dtype auto` on a CPU without AVX512_BF16) in the same call, each expert's linears as qlinear runs them (the
# panels from quant.QGEMM_W16_MIN_M rows; an AVX2 build's load-time strips at every m); False (or $ATOMD_MOE_Q8=0
# at import): one qlinear pair per expert (the A/B of engine-level runs)
Q8 = os.environ.get("ATOMD_MOE_Q8") != "0"
# ... an expert with at least this many pairs in a block (a prompt's) on the bf16 AMX tiles instead, where the CPU
# has them (layer_ops.has_moe_amx): its int8 / int4 weights dequantised to bf16 once a call (moe_q8's work item),
# bf16 activations (not int8), float32 sums: the AMX-INT8 tiles store and rescale every 32-input block's dot
# (~5x a bf16 tile product), which left int prefill at ~0.4x bf16's (benchmarks/RESULTS.md "#34 seventh session");
# 0 (or $ATOMD_MOE_WIDE=0 at import): every expert on int8 activations (the per-expert path's bits)
Q8_WIDE_MIN_PAIRS = 0 if os.environ.get("ATOMD_MOE_WIDE") == "0" else 128
# moe()'s pairs [T * k, hidden], kept from call to call (per thread and dtype; summed before moe() returns): a bf16
# prefill tile's (2048 rows, top-8, hidden 1024) is 32 MiB, past glibc's largest mmap threshold, so a new one was
# a new mapping every call whose pages the experts then faulted in (~9 ms of CPU a call, 48 a Qwen3-MoE prefill of
# 8 x 512; benchmarks/RESULTS.md "#34 eighth session")
_PAIRS = threading.local()
NEVER = 1 << 62  # q8_min_m's rows where moe_q8 runs neither tiles nor a GEMM


@dataclass
class MoeWeights:
    router: torch.Tensor  # [E, hidden]: every expert's row, also under expert parallelism
    # [E_local, 2 * inter, hidden]: each expert's gate and up stacked, experts stacked (quantized: a
    # list of E_local QuantizedWeight)
    gate_up: torch.Tensor | list
    down: torch.Tensor | list  # [E_local, hidden, inter]
    top_k: int
    norm_topk_prob: bool  # renormalise the k chosen weights to sum to 1 (Mixtral always does)
    # the routing weights cast to the model's dtype before they scale an expert's output
    # (Qwen3-MoE); False: the product in float32, then rounded (transformers 5's Mixtral)
    cast_weights: bool = True
    first_expert: int = 0  # gate_up[0]'s expert id (expert parallelism: this rank's first)
    ep: Any = None  # the ranks' ExpertParallel when this rank holds a slice of the experts
    # (token, choice) pairs each expert ran here since load, by expert id: the expert load counters
    routed: torch.Tensor = field(init=False)
    # the expert id in each slot of gate_up / down (expert parallelism adds replica slots: -1 empty)
    slot_experts: torch.Tensor = field(init=False)
    # (gate_up, down) in layer_ops.pack_amx's layout once amx_weights made them; () where they do not apply
    amx: tuple = field(init=False, default=None, repr=False)
    # quantized experts: (gate_up, down) as quant.qweight_array once q8_experts made them; () where they do not apply
    q8: tuple = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        # one row through an expert: the GEMV kernel on its slice of the stacked tensor (quantized
        # experts, a list of QuantizedWeight: quant.py's kernels, expert by expert)
        self.quantized = isinstance(self.gate_up, list)
        self.gemv = not self.quantized and os.environ.get(GEMV_ENV) != "0" and layer_ops.has_gemv(self.gate_up.dtype)
        self.routed = torch.zeros(self.router.shape[0], dtype=torch.int64)
        self.slot_experts = torch.arange(self.first_expert, self.first_expert + len(self.gate_up))

    def linears(self) -> tuple:
        """Each quantized expert's QuantizedWeights, gate_up's then down's (float experts: none)."""
        return (*self.gate_up, *self.down) if self.quantized else ()

    def amx_weights(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The experts packed for layer_ops.moe_amx (made at the first call: the model's load), or None where it does not run
        them: quantized or non-bf16 experts, expert parallelism, shapes off the tiles, no AMX here."""
        if self.amx is None:
            fits = (not self.quantized and self.ep is None and self.gate_up.dtype == torch.bfloat16
                    and self.gate_up.shape[2] % layer_ops.AMX_MULTIPLE == 0
                    and self.down.shape[2] % layer_ops.AMX_MULTIPLE == 0 and layer_ops.has_moe_amx())
            self.amx = (layer_ops.pack_amx(self.gate_up), layer_ops.pack_amx(self.down)) if fits else ()
        return self.amx or None

    def q8_experts(self) -> tuple | None:
        """The quantized experts as layer_ops.moe_q8 takes them (made once, after int8 activations are set: at load by
        DecoderModel.unfused_reason for the fused batch-1 layer, else at the first call), or None where it does not run them: float experts, int8 / int4 experts
        without int8 activations, 16-bit and int experts mixed, experts with an act-order permutation, expert
        parallelism, no kernel here, 16-bit experts with load-time panels beside their rows (qlinear's choice between
        the two by rows: never made at load, where an AVX2 build keeps the strips alone), experts held as strips of
        another layout than the layer kernels read (builds of two ISAs: qlinear's product_of refuses them)."""
        if self.q8 is None:
            linears = self.linears()  # all int8-activation ones or all 16-bit ones (the kernel's two kinds)
            fits = (self.quantized and self.ep is None and layer_ops.moe_q8_kind() > 0
                    and all(q.perm is None and (q.panels is None or q.strips_only) for q in linears)
                    and all(q.panels_layout == layer_ops.kernels().w16_layout for q in linears if q.strips_only)
                    and (all(q.int8_activations for q in linears) or all(q.bits == 16 for q in linears)))
            self.q8 = (quant.qweight_array(self.gate_up), quant.qweight_array(self.down)) if fits else ()
        return self.q8 or None


def q8_experts(w: MoeWeights, dtype: torch.dtype) -> tuple | None:
    """w's experts for layer_ops.moe_q8 where it runs them for activations of `dtype` (Q8 on), else None."""
    return w.q8_experts() if w.quantized and Q8 and dtype in (torch.float32, torch.bfloat16) else None


def q8_min_m(kind: int) -> tuple[int, int]:
    """(int4, int8): the rows an expert from which moe_q8 of `kind` (layer_ops.moe_q8_kind) leaves the
    int8-activation rows for an int4 / int8 linear, where qlinear does (quant.product_of)."""
    if kind == 2:
        return quant.QGEMM_AMX_MIN_M, quant.QGEMM_AMX_MIN_M
    lib = quant.kernels()
    if kind == 3 and lib is not None and lib.q8_gemm:
        return quant.q8_gemm_min_m(lib, 4), quant.q8_gemm_min_m(lib, 8)
    return NEVER, NEVER


def load_experts(src, prefix: str, experts: range, gate: str, up: str, down: str,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | tuple[list, list]:
    """From src (decoder.TensorSource), the tensors `{prefix}{e}.{gate|up|down}.weight` of the
    experts e in `experts` (ModelConfig.local_experts: this rank's) stacked: ([E, 2 * inter,
    hidden] with each expert's gate then up rows, [E, hidden, inter]). Quantized experts (a
    GGUF's): a list of QuantizedWeight per expert each, the gate's and up's rows joined."""
    gates = [(src.get(f"{prefix}{e}.{gate}.weight", dtype), src.get(f"{prefix}{e}.{up}.weight", dtype)) for e in experts]
    downs = [src.get(f"{prefix}{e}.{down}.weight", dtype) for e in experts]
    if isinstance(downs[0], QuantizedWeight) or isinstance(gates[0][0], QuantizedWeight):
        if not all(isinstance(w, QuantizedWeight) for pair in gates for w in pair):
            raise ValueError(f"{prefix}: experts with quantized and float linears mixed are not supported")
        return [quant.cat(list(pair)) for pair in gates], downs
    return torch.stack([torch.cat(pair) for pair in gates]), torch.stack(downs)


def route(h: torch.Tensor, w: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]) as transformers routes: softmax over all experts in
    float32, top-k, optionally renormalised; the weights in h's dtype with cast_weights."""
    probs = torch.softmax(F.linear(h, w.router), dim=-1, dtype=torch.float32)
    top, ids = probs.topk(w.top_k, dim=-1)
    if w.norm_topk_prob:
        top /= top.sum(dim=-1, keepdim=True)
    return (top.to(h.dtype) if w.cast_weights else top), ids


def moe(h: torch.Tensor, w: MoeWeights,
        routed: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The block's output [T, hidden] for the normed input h [T, hidden]. Each (token, choice)
    pair's weighted expert output goes to its own row, then each token's k rows are summed
    (float32 sums, one rounding): transformers' default (grouped_mm) experts to the bit in
    bf16, where an index_add_ in bf16 would round after every expert. `routed`: the (weights,
    ids) of a family's own router (DeepSeek's grouped top-k, atomd/model/deepseek.py)."""
    if w.ep is not None:  # expert parallelism: the rows go to the ranks that own their experts
        return w.ep.moe(h, w, routed)
    weights, ids = routed if routed is not None else route(h, w)
    if h.shape[0] == 1:
        return _moe_one(h, w, weights, ids)
    rows, k = h.shape[0], w.top_k
    flat = ids.flatten()
    order = flat.argsort(stable=True)  # (token, choice) pairs grouped by expert, token order kept within
    counts = torch.bincount(flat, minlength=len(w.gate_up))
    w.routed += counts
    scales = weights.flatten()[order].unsqueeze(1)
    pairs = pairs_scratch(rows * k, h.shape[1], h.dtype if w.cast_weights else torch.float32)
    rest = grouped_experts(h, w, counts, order, k, scales.flatten().contiguous(), pairs)
    ends, sizes = (counts.cumsum(0).tolist(), counts.tolist()) if rest else ((), ())
    for e in rest:
        group = slice(ends[e] - sizes[e], ends[e])
        pairs.index_copy_(0, order[group], expert(h[order[group] // k], w, e) * scales[group])
    return layer_ops.moe_sum(pairs, k, h.dtype)


def pairs_scratch(rows: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised [rows, hidden] tensor of `dtype` over this thread's pairs buffer (grown, never shrunk):
    moe()'s, valid until its next call on this thread."""
    bufs = _PAIRS.__dict__.setdefault("by_dtype", {})
    buf = bufs.get(dtype)
    if buf is None or buf.numel() < rows * hidden:
        with torch.inference_mode(False):  # a normal tensor: written in place in inference mode and outside it
            buf = bufs[dtype] = torch.empty(rows * hidden, dtype=dtype)
    return buf[:rows * hidden].view(rows, hidden)


def grouped_experts(x: torch.Tensor, w: MoeWeights, counts: torch.Tensor, order: torch.Tensor, per_row: int,
                    scales: torch.Tensor | None, out: torch.Tensor) -> list[int]:
    """Runs the active experts with at most GROUPED_MAX_PAIRS pairs in one C call
    (layer_ops.moe_grouped: out[order[i]] from the row x[order[i] // per_row] of each sorted pair i
    of theirs, times scales[i]); returns the other active experts, for the caller's GEMM pair each.
    `counts`: pairs per expert slot, `order`: the pairs sorted by slot. The rule is per expert, so a
    whole block, its expert-parallel shards and its TP workers run each expert the same way (the
    same bits whatever else is in the batch). Where the experts run on AMX tiles (AMX,
    MoeWeights.amx_weights: not under expert parallelism) every active expert goes in one
    layer_ops.moe_amx call instead, and none is returned. Quantized experts with int8 activations
    (MoeWeights.q8_experts) go in one layer_ops.moe_q8 call (16-bit experts too, every active one): every active expert where it has the
    AMX-INT8 tiles or the VNNI GEMM, else those of at most quant.QGEMM_Q8_MAX_M pairs (the others: a qlinear
    pair each)."""
    active = counts.nonzero().flatten()
    if w.quantized:
        q8 = q8_experts(w, x.dtype)
        if q8 is None:
            return active.tolist()
        kind = layer_ops.moe_q8_kind()  # 2: AMX-INT8 tiles, 3: the int8 GEMM, any M; 1: the rows only
        any_m = kind >= 2 or w.down[0].bits == 16  # 16-bit experts: the panels past the rows
        few = torch.ones_like(active, dtype=torch.bool) if any_m else counts[active] <= quant.QGEMM_Q8_MAX_M
        run = lambda *a: layer_ops.moe_q8(x.contiguous(), *q8, w.down[0].in_features, *a,  # noqa: E731
                                          q8_min_m(kind), Q8_WIDE_MIN_PAIRS, quant.QGEMM_W16_MIN_M)
    else:
        packed = w.amx_weights() if AMX else None
        if packed is not None:
            starts = torch.cat([counts.new_zeros(1), counts[active].cumsum(0)])
            if layer_ops.moe_amx(x.contiguous(), *packed, active, starts, order // per_row, order, scales, out):
                return []
        if not (GROUPED and w.gemv):
            return active.tolist()
        few = counts[active] <= GROUPED_MAX_PAIRS
        run = lambda *a: layer_ops.moe_grouped(x.contiguous(), w.gate_up, w.down, *a)  # noqa: E731
    if bool(few.any()):
        experts, sel = active[few], order
        if not bool(few.all()):  # only their pairs: the sorted positions whose slot is grouped
            member = torch.zeros(len(counts), dtype=torch.bool)
            member[experts] = True
            keep = member.repeat_interleave(counts)
            sel, scales = order[keep], None if scales is None else scales[keep]
        starts = torch.cat([counts.new_zeros(1), counts[experts].cumsum(0)])
        if run(experts, starts, sel // per_row, sel, scales, out) is False:
            return active.tolist()
    return active[~few].tolist()


def _moe_one(h: torch.Tensor, w: MoeWeights, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """moe() of one token (batch-1 decode): its k experts in turn, without the grouping (an
    argsort, a bincount and a scatter per expert: ~0.4 ms a block, benchmarks/moe_decode.py),
    in one C call where the GEMV kernel runs (layer_ops.moe_experts); the same products in
    the same rows and the same float32 sum, so the same bits."""
    k = w.top_k
    w.routed[ids[0]] += 1  # the expert load counters (a token's k experts are distinct)
    pairs = torch.empty(k, h.shape[1], dtype=h.dtype if w.cast_weights else torch.float32)
    q8 = q8_experts(w, h.dtype)
    if q8 is not None:  # one C call, each expert one row: only the k experts' bytes read
        every = torch.arange(k + 1)
        if layer_ops.moe_q8(h.contiguous(), *q8, w.down[0].in_features, ids[0].contiguous(), every,
                            torch.zeros(k, dtype=torch.int64), every[:k], weights[0].contiguous(), pairs,
                            q8_min_m(layer_ops.moe_q8_kind()), 0, quant.QGEMM_W16_MIN_M):
            return pairs.view(1, k, -1).sum(dim=1).to(h.dtype)
    if w.gemv:  # one C call for the k experts (the per-op loop below was ~0.2 ms of calls a block)
        layer_ops.moe_experts(h.contiguous(), w.gate_up, w.down, ids[0].contiguous(),
                              weights[0].contiguous(), pairs)
        return pairs.view(1, k, -1).sum(dim=1).to(h.dtype)
    for j, e in enumerate(ids[0].tolist()):
        # weights[0, j:j + 1], not a 0-d scalar: float32 weights promote a bf16 product as before
        torch.mul(expert(h, w, e), weights[0, j:j + 1], out=pairs[j:j + 1])
    return pairs.view(1, k, -1).sum(dim=1).to(h.dtype)


def expert(x: torch.Tensor, w: MoeWeights, e: int) -> torch.Tensor:
    """Expert e's SwiGLU MLP over the rows x [n, hidden]."""
    down = w.down[e]
    return linear(expert_act(x, w, e), down, None, down if w.gemv else None)


def expert_act(x: torch.Tensor, w: MoeWeights, e: int) -> torch.Tensor:
    """Expert e's activations silu(gate) * up over the rows x [n, hidden] (its down projection's input)."""
    gate_up = w.gate_up[e]
    return silu_mul(linear(x, gate_up, None, gate_up if w.gemv else None))


def moe_tp(h: torch.Tensor, w: MoeWeights, reduce_) -> torch.Tensor:
    """moe() of a tensor-parallel worker (each expert's intermediate rows a slice: its down output
    a partial sum), summed over the workers by `reduce_` (an all-reduce). Float bf16 experts: each
    (token, choice) pair's down partial stays float32 into the all-reduce (tp_partials), and the
    sums are rounded, weighted and added as TP=1's moe() does (from_tp_sums), so TP=2 computes
    TP=1's values (up to the float32 summation order); partials rounded to bf16 and weighted before
    one all-reduce of the block's output left TP=1's greedy ids (Mixtral, Qwen3-MoE). The price: the
    all-reduce moves [T * k, hidden] float32, 2k times the block output's bf16 bytes
    (benchmarks/RESULTS.md "#41 MoE in bf16 under TP"). Other dtypes and quantized experts: the
    block's output partials, one all-reduce."""
    if not tp_exact(h, w):
        return reduce_(moe(h, w))
    partial, weights = tp_partials(h, w)
    return from_tp_sums(reduce_(partial), weights, w)


def tp_exact(h: torch.Tensor, w: MoeWeights) -> bool:
    """Whether moe_tp all-reduces the pairs' float32 partials (bf16, float experts)."""
    return h.dtype == torch.bfloat16 and not w.quantized


def tp_partials(h: torch.Tensor, w: MoeWeights,
                routed: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(each (token, choice) pair's float32 down partial [T * k, hidden], the pairs' routing
    weights [T * k]) of this worker's expert slices (moe_tp's, before the all-reduce)."""
    weights, ids = routed if routed is not None else route(h, w)
    rows, k = h.shape[0], w.top_k
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=len(w.gate_up))
    w.routed += counts
    partial = torch.empty(rows * k, h.shape[1], dtype=torch.float32)
    rest = grouped_experts(h, w, counts, order, k, None, partial)  # the grouped call: down sums left float32
    ends, sizes = (counts.cumsum(0).tolist(), counts.tolist()) if rest else ((), ())
    for e in rest:
        group = order[ends[e] - sizes[e]:ends[e]]
        partial.index_copy_(0, group, linear_f32(expert_act(h[group // k], w, e), w.down[e]))
    return partial, weights.flatten()


def from_tp_sums(sums: torch.Tensor, weights: torch.Tensor, w: MoeWeights) -> torch.Tensor:
    """The block's output from the all-reduced pair sums [T * k, hidden] (tp_partials'): each
    rounded as TP=1 rounds an expert's output, times its routing weight into moe()'s pair dtype,
    the k pairs of a token summed in float32, rounded once."""
    pairs = (sums.to(torch.bfloat16) * weights.unsqueeze(1)).to(torch.bfloat16 if w.cast_weights else torch.float32)
    return pairs.view(-1, w.top_k, sums.shape[1]).sum(dim=1).to(torch.bfloat16)
