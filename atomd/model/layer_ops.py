"""RMSNorm (with the residual add before it), SiLU-and-mul and RoPE for the Llama family:
one C call each (atomd/kernels/csrc/layer_ops.c) where the kernels build, torch ops where not.

Why: at decode sizes torch runs these as ~20 small ops per layer (RMSNorm alone is six), each
~5-20 us of dispatch; at prefill sizes each op is a pass over the activations. The C
versions make one pass and one call, float32 and bfloat16 (rounding where Hugging Face's
bf16 modules round). `$ATOMD_LAYER_OPS=torch` forces the torch path (a same-run A/B, and
what a machine without a C compiler runs).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch
import torch.nn.functional as F

from atomd.kernels import cbuild

log = logging.getLogger(__name__)
ENV = "ATOMD_LAYER_OPS"
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


class _MoeWeights(ctypes.Structure):  # csrc/layer_ops.c decode_moe_weights
    _fields_ = ([(n, _PTR) for n in ("router", "gate_up", "down", "routed")] + [(n, _I64) for n in ("experts", "top_k", "inter")]
                + [("norm_topk", ctypes.c_int), ("f32_pairs", ctypes.c_int)])


class _LayerWeights(ctypes.Structure):  # csrc/layer_ops.c decode_layer_weights
    _fields_ = ([(n, _PTR) for n in ("qkv", "bias", "o", "post_norm", "gate_up", "down", "next_norm")]
                + [("window", _I64), ("q_norm", _PTR), ("k_norm", _PTR), ("moe", ctypes.POINTER(_MoeWeights))])


MOE_MAX_EXPERTS, MOE_MAX_K = 1024, 64  # csrc/layer_ops.c: the fused layer's sparse block routes at most these
Q8_OWN_K = 32768  # csrc/quant.h: the inputs of a linear whose x each thread quantises into its own row


class _AttentionArgs(ctypes.Structure):  # csrc/layer_ops.c decode_attention_args
    _fields_ = [("fn", _PTR), ("kv", _PTR), ("block_tables", _PTR), ("context_lens", _PTR), ("block_size", _I64),
                ("table_width", _I64), ("block_stride", _I64), ("layer_stride", _I64), ("v_offset", _I64),
                ("scale", ctypes.c_float), ("kv_narrow", ctypes.c_int)]


class MlaLayerWeights(ctypes.Structure):  # csrc/layer_ops.c mla_layer_weights (DeepSeek's batch-1 layer)
    _fields_ = ([(n, _PTR) for n in ("qkv_a", "q_a_norm", "q_b", "kv_a_norm", "o", "post_norm", "gate_up", "down",
                                     "router", "correction", "experts_gate_up", "experts_down", "routed", "next_norm")]
                + [("inter", _I64), ("uk_t", _PTR), ("uv", _PTR)])


class MtpWeights(ctypes.Structure):  # csrc/layer_ops.c mtp_weights (DeepSeek V3's MTP pass, batch 1)
    _fields_ = ([(n, _PTR) for n in ("embed", "enorm", "hnorm", "eh_proj", "input_norm", "head_norm", "head")]
                + [("vocab", _I64)])


class MlaAttentionArgs(ctypes.Structure):  # csrc/layer_ops.c mla_attention_args
    _fields_ = ([(n, _PTR) for n in ("fn", "kv", "block_tables", "context_lens", "query_starts")]
                + [(n, _I64) for n in ("block_size", "table_width", "block_stride", "layer_stride")]
                + [("scale", ctypes.c_float), ("slots", _PTR), ("positions", _PTR)])


class MlaLayerConfig(ctypes.Structure):  # csrc/layer_ops.c mla_layer_config
    _fields_ = ([(n, _I64) for n in ("hidden", "heads", "nope", "rope", "rank", "v", "q_lora", "experts", "moe_inter",
                                     "top_k", "n_group", "topk_group", "max_inter")]
                + [("scoring", ctypes.c_int), ("norm_topk_prob", ctypes.c_int),
                   ("routed_scaling_factor", ctypes.c_float), ("eps", ctypes.c_float), ("max_rows", _I64)])


_LAYERS_ARGTYPES = [_PTR, _I64, _PTR] + [_PTR] * 8 + [_I64] + [_PTR] * 2 + [_I64] * 5 + [ctypes.c_float, ctypes.c_int]


_FORCE_TORCH = os.environ.get(ENV, "native") == "torch"  # read once: kernels() runs ~17 times a decode step


def kernels() -> ctypes.CDLL | None:
    """The built library, or None (torch ops) with the reason logged."""
    if _FORCE_TORCH:
        return None
    return build_kernels(cbuild.kernel_isa())


@functools.cache
def build_kernels(isa: str) -> ctypes.CDLL | None:
    """The library built with `isa` (atomd.kernels.cbuild.ISA_FLAGS: `native`, or narrowed to test
    the fallbacks on a CPU that has everything: `no-bf16-dot` drops the AVX512_BF16
    conversions, `no-avx512` all of AVX-512, `no-amx` the AMX tiles of the MoE experts), or None
    with the reason logged."""
    lib = cbuild.load(*cbuild.layer_ops_kernel(), log, "RMSNorm, SiLU and RoPE run as torch ops", isa)
    if lib is None:
        return None
    lib.atomd_gemv_kinds.restype = ctypes.c_int
    # bit 0: float32 (AVX-512), bit 1: bfloat16, bit 2: float32 with AVX2 (the GEMV and the dense decode layers only)
    lib.gemv_kinds = lib.atomd_gemv_kinds()
    for bit, suffix in ((1 | 4, "f32"), (2, "bf16")):
        if lib.gemv_kinds & bit:
            fn = getattr(lib, f"atomd_gemv_{suffix}")
            fn.argtypes, fn.restype = [_PTR, _PTR, _PTR, _I64, _I64, ctypes.c_int], None
            head, tail = getattr(lib, f"atomd_decode_layer_head_{suffix}"), getattr(lib, f"atomd_decode_layer_tail_{suffix}")
            head.argtypes, head.restype = [_PTR] * 10 + [_I64] * 4 + [ctypes.c_float, ctypes.c_int], None
            tail.argtypes, tail.restype = [_PTR] * 9 + [_I64] * 3 + [ctypes.c_float, ctypes.c_int], None
            every = getattr(lib, f"atomd_decode_layers_{suffix}")
            every.argtypes, every.restype = _LAYERS_ARGTYPES, ctypes.c_int
            experts = getattr(lib, f"atomd_moe_experts_{suffix}")
            experts.argtypes, experts.restype = [_PTR] * 6 + [ctypes.c_int, _PTR] + [_I64] * 3 + [ctypes.c_int], None
        if lib.gemv_kinds & bit & 3:  # AVX-512 only
            mla_layers = getattr(lib, f"atomd_mla_layers_{suffix}")
            mla_layers.argtypes = [_PTR, _I64, _PTR, _PTR, _I64] + [_PTR] * 7 + [ctypes.c_int]
            mla_layers.restype = ctypes.c_int
            mtp_pass = getattr(lib, f"atomd_mtp_pass_{suffix}")
            mtp_pass.argtypes = [_PTR] * 4 + [_I64] + [_PTR] * 5 + [_I64] + [_PTR] * 7 + [ctypes.c_int]
            mtp_pass.restype = ctypes.c_int
            rows_head = getattr(lib, f"atomd_mla_rows_head_{suffix}")
            rows_head.argtypes, rows_head.restype = [_PTR, _I64, _PTR, _I64, _I64, _PTR, _I64] + [_PTR] * 7 + [ctypes.c_int], None
            grouped = getattr(lib, f"atomd_moe_grouped_{suffix}")
            grouped.argtypes, grouped.restype = [_PTR] * 9 + [ctypes.c_int, _PTR] + [_I64] * 4 + [ctypes.c_int], None
    if lib.gemv_kinds & 3:
        lib.atomd_mla_scratch_elems.argtypes, lib.atomd_mla_scratch_elems.restype = [_PTR, ctypes.c_int], _I64
    if lib.gemv_kinds & (1 | 4):  # the layer over int8 / int4 linears (csrc/quant.h), built beside the float32 one
        lib.atomd_decode_layer_head_q_f32.argtypes = lib.atomd_decode_layer_head_f32.argtypes
        lib.atomd_decode_layer_tail_q_f32.argtypes = lib.atomd_decode_layer_tail_f32.argtypes
        lib.atomd_decode_layers_q_f32.argtypes, lib.atomd_decode_layers_q_f32.restype = _LAYERS_ARGTYPES, ctypes.c_int
        lib.atomd_decode_rows_q_f32.argtypes = ([_PTR, _I64, _PTR, _I64] + [_PTR] * 12 + [_I64] * 3 + [_PTR] * 2
                                                + [_I64] * 6 + [ctypes.c_float, ctypes.c_int])
        lib.atomd_decode_rows_q_f32.restype = ctypes.c_int
    for suffix in _SUFFIX.values():
        getattr(lib, f"atomd_rms_norm_{suffix}").argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64,
                                                              ctypes.c_float, ctypes.c_int]
        getattr(lib, f"atomd_silu_mul_{suffix}").argtypes = [_PTR, _PTR, _I64, _I64, ctypes.c_int]
        getattr(lib, f"atomd_qk_norm_{suffix}").argtypes = [_PTR] + [_I64] * 5 + [_PTR, _PTR, ctypes.c_float, ctypes.c_int]
        getattr(lib, f"atomd_rope_{suffix}").argtypes = [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64, ctypes.c_int]
        getattr(lib, f"atomd_rope_store_{suffix}").argtypes = [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR,
                                                                _PTR, _I64, _I64, _I64, _PTR, _PTR, ctypes.c_float,
                                                                ctypes.c_int]
        for op in ("rms_norm", "qk_norm", "silu_mul", "rope", "rope_store"):
            getattr(lib, f"atomd_{op}_{suffix}").restype = None
    lib.atomd_lora_sgmv_f32.argtypes, lib.atomd_lora_sgmv_f32.restype = [_PTR, _I64, _PTR, _PTR, _PTR, _PTR] + [_I64] * 5, None
    lib.atomd_moe_amx_kind.argtypes, lib.atomd_moe_amx_kind.restype = [], ctypes.c_int
    lib.atomd_moe_sum_bf16.argtypes, lib.atomd_moe_sum_bf16.restype = [_PTR, ctypes.c_int, _PTR] + [_I64] * 3 + [ctypes.c_int], None
    lib.atomd_moe_amx_bf16.argtypes = [_PTR] * 9 + [ctypes.c_int] + [_I64] * 3 + [ctypes.c_int]
    lib.atomd_moe_amx_bf16.restype = ctypes.c_int
    lib.atomd_mla_rows_moe_bf16.argtypes = [_PTR] * 6 + [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, ctypes.c_int]
    lib.atomd_mla_rows_moe_bf16.restype = ctypes.c_int
    lib.moe_amx = bool(lib.atomd_moe_amx_kind())  # built with AMX tiles and granted their state
    lib.atomd_linear_amx_bf16.argtypes = [_PTR, _I64, _PTR, _PTR] + [_I64] * 3 + [ctypes.c_int]
    lib.atomd_linear_amx_bf16.restype = lib.atomd_linear_amx_kind.restype = ctypes.c_int
    lib.linear_amx = bool(lib.atomd_linear_amx_kind())
    lib.atomd_moe_q8.argtypes = [_PTR, ctypes.c_int] + [_PTR] * 8 + [ctypes.c_int] + [_I64] * 3 + [_PTR] + [_I64] * 2 + [ctypes.c_int]
    lib.atomd_moe_q8.restype = lib.atomd_moe_q8_kind.restype = ctypes.c_int
    lib.moe_q8_kind = lib.atomd_moe_q8_kind()
    lib.atomd_layer_w16_layout.restype = ctypes.c_int
    lib.w16_layout = lib.atomd_layer_w16_layout()  # the 16-bit panels' layout its quantized layer reads (1 / 2)
    return lib


LORA_SGMV_MAX_WIDTH = 256  # csrc/layer_ops.c SGMV_MAX_W: a fused linear's summed ranks, at most


def has_lora_sgmv(dtype: torch.dtype, width: int) -> bool:
    """lora_sgmv runs for this dtype and fused width (float32, the kernels built)."""
    return dtype == torch.float32 and width <= LORA_SGMV_MAX_WIDTH and kernels() is not None


def lora_sgmv(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[i] += (x[i] @ a[slots[i]].T) @ b[slots[i]] for the rows with slots[i] >= 0, in one C call:
    x [T, k] and out [T, n] float32 with contiguous rows, a [adapters, w, k] (A's rank rows),
    b [adapters, w, n] contiguous, slots int64 [T] (has_lora_sgmv). Returns out."""
    kernels().atomd_lora_sgmv_f32(x.data_ptr(), x.stride(0), a.data_ptr(), b.data_ptr(), slots.data_ptr(),
                                  out.data_ptr(), out.stride(0), x.shape[0], a.shape[2], a.shape[1], b.shape[2])
    return out


def _native(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The library when it takes these tensors (one dtype it has, rows contiguous)."""
    lib = kernels()
    if lib is None or tensors[0].dtype not in _SUFFIX:
        return None
    for t in tensors:
        if t.dtype != tensors[0].dtype or t.stride(-1) != 1:
            return None
    return lib


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm(x) * weight of x [T, hidden], after `x += delta` in place when delta is given.
    Written into `out` (a new tensor by default)."""
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    lib = _native(x, weight, out, *(() if delta is None else (delta,)))
    if lib is None or x.dim() != 2 or not weight.is_contiguous():
        if delta is not None:
            x.add_(delta)
        return out.copy_(F.rms_norm(x, (x.shape[-1],), weight, eps))
    fn = getattr(lib, f"atomd_rms_norm_{_SUFFIX[x.dtype]}")
    fn(x.data_ptr(), x.stride(0), None if delta is None else delta.data_ptr(),
       0 if delta is None else delta.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0),
       x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return out


def qk_norm_(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, q_heads: int, kv_heads: int,
             head_dim: int, eps: float) -> bool:
    """RMSNorm in place over each query and key head of qkv [T, width] (rows contiguous) in one C call, each head
    as rms_norm normalises a row; False: not run here (no kernel for this dtype or layout: the caller's torch path)."""
    lib = _native(qkv, q_norm, k_norm)
    if lib is None or qkv.dim() != 2 or not (qkv.is_contiguous() and q_norm.is_contiguous() and k_norm.is_contiguous()):
        return False
    getattr(lib, f"atomd_qk_norm_{_SUFFIX[qkv.dtype]}")(qkv.data_ptr(), qkv.shape[0], qkv.shape[1], q_heads, kv_heads,
                                                        head_dim, q_norm.data_ptr(), k_norm.data_ptr(), eps,
                                                        torch.get_num_threads())
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [T, 2 * inter] (gate first): a new [T, inter] tensor."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    lib = _native(gate_up)
    if lib is None or not gate_up.is_contiguous():
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    getattr(lib, f"atomd_silu_mul_{_SUFFIX[gate_up.dtype]}")(gate_up.data_ptr(), out.data_ptr(), rows, inter,
                                                             torch.get_num_threads())
    return out


def rope_(qkv: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
          positions: torch.Tensor) -> None:
    """Rotate-half RoPE (HF layout), in place, of the first `heads` heads of each row of qkv
    [T, width] (the query heads, then the key heads); cos, sin [max_positions, head_dim // 2]
    tables, positions int64 [T]."""
    lib = _native(qkv, cos, sin)
    if lib is None or not (cos.is_contiguous() and sin.is_contiguous() and positions.is_contiguous()
                           and positions.dtype == torch.int64):
        x = qkv[:, :heads * head_dim].view(-1, heads, head_dim)
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        half = head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))
        return
    getattr(lib, f"atomd_rope_{_SUFFIX[qkv.dtype]}")(qkv.data_ptr(), qkv.stride(0), heads, head_dim, cos.data_ptr(),
                                                     sin.data_ptr(), positions.data_ptr(), qkv.shape[0],
                                                     torch.get_num_threads())


def rope_store_(qkv: torch.Tensor, q_heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor,
                sin: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, slot_rows: torch.Tensor,
                layer_rows: int, v_rows: int, qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> bool:
    """rope_ on the query and key heads of qkv [T, width], then each row's key and value heads
    stored in the paged cache: its K row at row slot_rows[t] + layer_rows of `cache` seen as
    [rows, kv_heads * head_dim], its V row v_rows rows further (KVCache.slot_rows). With
    `qk_norm` (q_norm, k_norm, eps): qk_norm_ first, in the same pass (the same bits). One C call;
    False (nothing done) where the kernels do not take these tensors: the caller runs qk_norm_,
    rope_ and KVCache.write."""
    q_w, k_w, eps = qk_norm or (None, None, 0.0)
    lib = _native(qkv, cos, sin, cache, *(() if qk_norm is None else (q_w, k_w)))
    if lib is None or not (cos.is_contiguous() and sin.is_contiguous() and cache.is_contiguous()
                           and positions.is_contiguous() and slot_rows.is_contiguous()
                           and positions.dtype == slot_rows.dtype == torch.int64):
        return False
    if qk_norm is not None and not (qkv.dim() == 2 and qkv.is_contiguous() and q_w.is_contiguous()
                                    and k_w.is_contiguous()):
        return False
    getattr(lib, f"atomd_rope_store_{_SUFFIX[qkv.dtype]}")(
        qkv.data_ptr(), qkv.stride(0), q_heads, kv_heads, head_dim, cos.data_ptr(), sin.data_ptr(),
        positions.data_ptr(), cache.data_ptr(), slot_rows.data_ptr(), layer_rows, v_rows, qkv.shape[0],
        None if q_w is None else q_w.data_ptr(), None if k_w is None else k_w.data_ptr(), eps,
        torch.get_num_threads())
    return True


def has_gemv(dtype: torch.dtype) -> bool:
    """Whether the GEMV kernel family runs this dtype here (the kernels built with AVX-512): `gemv`, the batch-1
    decode layer, the MoE experts' and the MLA layers' C calls."""
    lib = kernels()
    return lib is not None and dtype in _SUFFIX and bool(lib.gemv_kinds & (1 if dtype == torch.float32 else 2))


def has_decode_layer(dtype: torch.dtype) -> bool:
    """Whether `gemv` and the dense batch-1 decode layer (`DecodeLayer`) run this dtype here: has_gemv, or float32
    on an AVX2 build (no MoE / MLA calls there)."""
    lib = kernels()
    return has_gemv(dtype) or (lib is not None and dtype == torch.float32 and bool(lib.gemv_kinds & 4))


def gemv(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [1, K] @ rows.T for a plain contiguous weight `rows` [N, K] of x's dtype (has_gemv):
    a new [1, N] tensor, float32 sums (bf16 rounded to nearest even)."""
    lib = kernels()
    x = x.contiguous()
    out = torch.empty(1, rows.shape[0], dtype=x.dtype)
    getattr(lib, f"atomd_gemv_{_SUFFIX[x.dtype]}")(x.data_ptr(), rows.data_ptr(), out.data_ptr(), rows.shape[1],
                                                  rows.shape[0], torch.get_num_threads())
    return out


def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor,
                scales: torch.Tensor, pairs: torch.Tensor) -> None:
    """pairs[j] = (silu_mul(x @ gate_up[ids[j]].T) @ down[ids[j]].T) * scales[j] for one token
    x [1, hidden] (has_gemv(x.dtype)) over stacked contiguous expert weights, ids int64 [k],
    scales [k] and pairs [k, hidden] contiguous, both float32 or both x's dtype: the batch-1
    MoE experts (atomd/model/moe.py) in one C call, the bits of those ops one by one."""
    lib, inter, threads = kernels(), down.shape[2], torch.get_num_threads()
    scratch = torch.empty(threads * (3 * inter + x.shape[1]), dtype=x.dtype)  # one a thread: each runs whole experts
    getattr(lib, f"atomd_moe_experts_{_SUFFIX[x.dtype]}")(
        x.data_ptr(), gate_up.data_ptr(), down.data_ptr(), ids.data_ptr(), scales.data_ptr(), pairs.data_ptr(),
        int(pairs.dtype == torch.float32), scratch.data_ptr(), x.shape[1], inter, ids.shape[0], threads)


def moe_grouped(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor,
                starts: torch.Tensor, tokens: torch.Tensor, dest: torch.Tensor, scales: torch.Tensor | None,
                pairs: torch.Tensor) -> None:
    """pairs[dest[i]] = (silu_mul(x[tokens[i]] @ gate_up[e].T) @ down[e].T) * scales[i] for the
    pairs i in starts[g] .. starts[g + 1] - 1 of each expert e = experts[g]: an MoE block's
    experts over several tokens x [T, hidden] (has_gemv(x.dtype)) in one C call, rounded where
    the per-expert ops round. gate_up / down stacked and contiguous; experts, starts, tokens,
    dest int64 contiguous; scales [pairs] and pairs [T * k, hidden] contiguous, both float32
    or both x's dtype; scales None: pairs[dest[i]] = the float32 down output, unrounded and unscaled
    (pairs float32; a TP worker's partial, moe.moe_tp). The indices are trusted (moe.py makes them):
    out of range reads memory."""
    lib, inter, threads = kernels(), down.shape[2], torch.get_num_threads()
    max_rows = int((starts[1:] - starts[:-1]).max()) if len(experts) else 0
    scratch = torch.empty(threads * max_rows * (3 * inter + x.shape[1]), dtype=x.dtype)  # one a thread
    getattr(lib, f"atomd_moe_grouped_{_SUFFIX[x.dtype]}")(
        x.data_ptr(), gate_up.data_ptr(), down.data_ptr(), experts.data_ptr(), starts.data_ptr(), tokens.data_ptr(),
        dest.data_ptr(), 0 if scales is None else scales.data_ptr(), pairs.data_ptr(),
        2 if scales is None else int(pairs.dtype == torch.float32), scratch.data_ptr(),
        x.shape[1], inter, len(experts), max_rows, threads)


def has_moe_amx() -> bool:
    """Whether moe_amx runs here: the kernels built with AMX tiles (not narrowed by
    $ATOMD_KERNEL_ISA below `native`) and Linux granted this process the tile state."""
    lib = kernels()
    return lib is not None and lib.moe_amx


AMX_MULTIPLE = 32  # hidden and an expert's intermediate size: multiples of this for pack_amx / moe_amx


def has_linear_amx() -> bool:
    """Whether linear_amx runs here: the kernels built with AMX tiles (not narrowed by $ATOMD_KERNEL_ISA)
    and Linux granted this process the tile state."""
    lib = kernels()
    return lib is not None and lib.linear_amx


def linear_amx(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] @ weight.T (bf16) on AMX tiles (csrc/linear_amx.h) over `weight` as oneDNN packed it
    (a bf16 mkldnn tensor [N, K] in its AB16b32a2b layout; N, K multiples of AMX_MULTIPLE: the caller,
    linear.py, checks the layout); None where the kernel does not run here. x's rows may be strided."""
    lib = kernels()
    if lib is None:  # the layout check is cached per shape; the kernels may be gone since (tests' fallback)
        return None
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    status = lib.atomd_linear_amx_bf16(x.data_ptr(), x.stride(0), torch.ops.mkldnn.data_ptr(weight),
                                             out.data_ptr(), x.shape[0], x.shape[1], weight.shape[0],
                                             torch.get_num_threads())
    if status < 0:
        raise MemoryError("linear_amx: no scratch memory")
    return out if status == 0 else None


def pack_amx(w: torch.Tensor) -> torch.Tensor:
    """Stacked bf16 weights [E, N, K] (N, K multiples of AMX_MULTIPLE) in moe_amx's tile layout:
    [E, N / 16, K / 32, 16 k pairs, 16 n, 2], each 16 x 32 block one contiguous 1 KB tile operand."""
    e, n, k = w.shape
    if w.dtype != torch.bfloat16 or n % AMX_MULTIPLE or k % AMX_MULTIPLE:
        raise ValueError(f"pack_amx takes bf16 [E, N, K] with N, K multiples of {AMX_MULTIPLE}, got {w.dtype} {list(w.shape)}")
    return w.view(e, n // 16, 16, k // 32, 16, 2).permute(0, 1, 3, 4, 2, 5).contiguous()


def moe_amx(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor,
            starts: torch.Tensor, tokens: torch.Tensor, dest: torch.Tensor, scales: torch.Tensor | None,
            pairs: torch.Tensor) -> bool:
    """moe_grouped's results (arguments alike; x bf16) on AMX tiles, gate_up [E, 2 * inter, hidden]
    and down [E, hidden, inter] packed by pack_amx. False: nothing done (no AMX for this
    process: the caller runs moe_grouped); MemoryError where its scratch cannot be allocated."""
    hidden, inter = x.shape[1], gate_up.shape[1] * 16 // 2
    status = kernels().atomd_moe_amx_bf16(
        x.data_ptr(), gate_up.data_ptr(), down.data_ptr(), experts.data_ptr(), starts.data_ptr(), tokens.data_ptr(),
        dest.data_ptr(), 0 if scales is None else scales.data_ptr(), pairs.data_ptr(),
        2 if scales is None else int(pairs.dtype == torch.float32), hidden, inter, len(experts),
        torch.get_num_threads())
    if status < 0:
        raise MemoryError("moe_amx: the AMX experts kernel could not allocate its scratch memory")
    return status == 0


def moe_q8_kind() -> int:
    """How moe_q8 runs here: 0 not built (neither an AVX-512 nor an AVX2 build: the experts one qlinear pair each), 1
    on the int8-activation rows (csrc/quant.h), 2 also on AMX-INT8 tiles from quant.QGEMM_AMX_MIN_M rows an expert
    (csrc/quant_amx.h; built with them, not narrowed by $ATOMD_KERNEL_ISA, granted by Linux), 3 also on the int8 GEMM
    from quant.q8_gemm_min_m rows an expert (csrc/quant_gemm.h: its VNNI or AVX2 half; no tiles)."""
    lib = kernels()
    return 0 if lib is None else lib.moe_q8_kind


def moe_q8(x: torch.Tensor, gate_up: ctypes.Array, down: ctypes.Array, inter: int, experts: torch.Tensor,
           starts: torch.Tensor, tokens: torch.Tensor, dest: torch.Tensor, scales: torch.Tensor | None,
           pairs: torch.Tensor, min_m: tuple[int, int], wide_min: int = 0, w16_min: int = 0) -> bool:
    """moe_grouped's results (arguments alike; x float32 or bf16) for int8 / int4 experts with int8
    activations, or 16-bit experts (csrc/moe_q8.h): gate_up and down the experts' atomd_qweight arrays
    (quant.qweight_array; inter: an expert's intermediate size); a 16-bit expert's linears on the panels from
    w16_min rows (0: never), else the rows (an AVX2 build's load-time strips at every m where the weight is held as
    them), as qlinear runs them,
    each expert's linears run as qlinear runs them on its rows (from min_m rows an expert, (int4, int8) linears: tiles
    where moe_q8_kind() is 2, the int8 GEMM where it is 3), so the pairs equal the per-expert path's. Experts with at least wide_min
    pairs (0: none) where has_moe_amx(): their weights dequantised to bf16 a call, bf16 activations,
    moe_amx's bf16 AMX tiles instead (float32 sums; a float32 x's gate_up and SiLU in float32). False:
    not built here (nothing done); MemoryError where its scratch cannot be allocated."""
    rows = (ctypes.c_int64 * 2)(*min_m)
    status = kernels().atomd_moe_q8(
        x.data_ptr(), int(x.dtype == torch.bfloat16), ctypes.addressof(gate_up), ctypes.addressof(down),
        experts.data_ptr(), starts.data_ptr(), tokens.data_ptr(), dest.data_ptr(),
        0 if scales is None else scales.data_ptr(), pairs.data_ptr(),
        2 if scales is None else int(pairs.dtype == torch.float32), x.shape[1], inter, len(experts), rows,
        wide_min, w16_min, torch.get_num_threads())
    if status < 0:
        raise MemoryError("moe_q8: the int8 experts kernel could not allocate its scratch memory")
    return status == 0


def moe_sum(pairs: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """An MoE block's output [T, hidden] in `dtype` from its pairs [T * k, hidden] (contiguous, in
    (token, choice) order): the float32 sum of each token's k rows in choice order, rounded once
    (pairs.view(T, k, hidden).sum(dim=1).to(dtype)); one C call for bf16 outputs."""
    lib = kernels()
    if lib is None or dtype != torch.bfloat16 or pairs.dtype not in _SUFFIX or not pairs.is_contiguous():
        return pairs.view(-1, k, pairs.shape[1]).sum(dim=1).to(dtype)
    rows, hidden = pairs.shape[0] // k, pairs.shape[1]
    out = torch.empty(rows, hidden, dtype=dtype)
    lib.atomd_moe_sum_bf16(pairs.data_ptr(), int(pairs.dtype == torch.float32), out.data_ptr(), rows, k, hidden,
                           torch.get_num_threads())
    return out


# what the fused layer stores a float32 row as in a narrow cache (csrc/layer_ops.c KV_STORE_*; 0: the model's dtype)
KV_STORE_MODEL = 0
KV_STORE = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2, torch.bfloat16: 3, torch.float16: 4}


def fused_kv_narrow(dtype: torch.dtype, kv_cache) -> bool:
    """Whether the fused batch-1 layer (DecodeLayer) runs over this narrow cache (fp8, 16 bits): float32
    activations (the narrow decode kernel's q and out) and unit scales (it stores x as KVCache.write does at scale 1)."""
    return dtype == torch.float32 and kv_cache.k_scale == kv_cache.v_scale == 1.0


class DecodeLayer:
    """Batch-1 decode of a whole model's layers, two C calls a layer around attention
    (csrc/layer_ops.c, atomd_decode_layer_*): the same bits as the per-op path, without its
    ~11 Python-level calls a layer. Made once at load by DecoderModel (its qkv and scratch
    buffers are reused every step); the pointers it passes are the step's tensors'."""

    def __init__(self, dtype: torch.dtype, hidden: int, inter: int, q_heads: int, kv_heads: int, head_dim: int,
                 eps: float, quantized: bool = False):
        """quantized: the linears are atomd/model/quant.py's QuantizedWeights (float32 only),
        whose data_ptr() is their atomd_qweight."""
        lib = kernels()
        suffix = "q_f32" if quantized else _SUFFIX[dtype]
        self.head_fn = getattr(lib, f"atomd_decode_layer_head_{suffix}")
        self.tail_fn = getattr(lib, f"atomd_decode_layer_tail_{suffix}")
        self.layers_fn = getattr(lib, f"atomd_decode_layers_{suffix}")
        self.attn = torch.empty(1, q_heads * head_dim, dtype=dtype)
        self.weights: ctypes.Array | None = None  # every layer's pointers, made at the first run_layers
        self.args = _AttentionArgs()
        self.dims = (hidden, q_heads, kv_heads, head_dim)
        self.hidden, self.q_size, self.inter, self.eps = hidden, q_heads * head_dim, inter, eps
        self.qkv = torch.empty(1, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype)
        self.scratch = torch.empty(0, dtype=dtype)
        self.moe: list[_MoeWeights] = []  # the sparse layers' structs (their pointers kept alive beside self.weights)
        self.moe_scratch = torch.empty(0, dtype=torch.float32)
        # a batch's decode rows in one call (atomd_decode_rows_q_f32): quantized linears (and MoE blocks' experts)
        self.rows_fn = lib.atomd_decode_rows_q_f32 if quantized else None
        self.rows_kinds: dict[int, torch.Tensor | None] = {}  # rows -> rows_kinds_for's
        self.rows_buffer = torch.empty(0, dtype=dtype)
        self.rows_steps = 0  # steps run_rows took (the tests: the fused rows did run)

    def scratch_for(self, threads: int) -> int:
        """The address of the C layer's scratch for `threads` threads (csrc/layer_ops.c: shared
        rows, then each thread's copies of the residual, the normed row and the SiLU output)."""
        size = self.hidden + 2 * self.inter + threads * (2 * self.hidden + self.inter)
        if self.scratch.numel() < size:
            self.scratch = torch.empty(size, dtype=self.scratch.dtype)
        return self.scratch.data_ptr()

    def moe_scratch_for(self, threads: int) -> int | None:
        """The sparse block's float32 scratch (csrc/layer_ops.c MOE_STEPS): the logits, the k pairs,
        shared rows, then each thread's; None for a dense model."""
        if not self.moe:
            return None
        hidden = self.hidden
        size = max(m.experts + m.top_k * hidden + (threads + 1) * (3 * m.inter + 2 * hidden) for m in self.moe)
        if self.moe_scratch.numel() < size:
            self.moe_scratch = torch.empty(size, dtype=torch.float32)
        return self.moe_scratch.data_ptr()

    def head(self, h: torch.Tensor, w_qkv: torch.Tensor, bias: torch.Tensor | None, cos: int, sin: int,
             k_dst: int, v_dst: int, q_norm: torch.Tensor | None = None,
             k_norm: torch.Tensor | None = None) -> torch.Tensor:
        """qkv of the one row h [1, hidden], its query and key heads RMSNormed by q_norm / k_norm
        where given (Qwen3), RoPE'd (cos, sin: the position's table rows), its key and value
        rows stored at k_dst, v_dst (addresses); returns qkv [1, width]."""
        self.head_fn(h.data_ptr(), w_qkv.data_ptr(), _ptr(bias), _ptr(q_norm), _ptr(k_norm), self.qkv.data_ptr(),
                     cos, sin, k_dst, v_dst, *self.dims, self.eps, torch.get_num_threads())
        return self.qkv

    def tail(self, attn: torch.Tensor, x: torch.Tensor, rows: tuple[torch.Tensor, ...], post_norm: torch.Tensor,
             next_norm: torch.Tensor | None, next_h: torch.Tensor) -> None:
        """The layer after attention: x (the residual, [1, hidden]) updated in place, next_h
        the next layer's normed input (next_norm None: the last layer, x only)."""
        threads = torch.get_num_threads()
        self.tail_fn(attn.data_ptr(), x.data_ptr(), rows[1].data_ptr(), post_norm.data_ptr(), rows[2].data_ptr(),
                     rows[3].data_ptr(), None if next_norm is None else next_norm.data_ptr(), next_h.data_ptr(),
                     self.scratch_for(threads), self.hidden, self.q_size, self.inter, self.eps, threads)

    def run_layers(self, layers: list, windows: list[int | None], h: torch.Tensor, x: torch.Tensor, cos: int,
                   sin: int, k_dst: int, v_dst: int, layer_bytes: int, attention: ctypes.CDLL, kv_cache,
                   block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> None:
        """Every layer of one decoding sequence in one C call (atomd_decode_layers_*): head,
        the decode attention kernel `attention` (atomd.kernels.native, this model's shape) over
        kv_cache, tail; x ends as the last layer's residual stream, h its input norm's output
        on the way. `layers`: the model's LayerWeights (their rows, biases and norms do not
        move after load: their pointers are taken once)."""
        assert block_tables.shape[0] == 1 == len(context_lens)
        hidden, q_heads, kv_heads, head_dim = self.dims
        a = self._attention_args(layers, windows, h.dtype, attention, kv_cache, block_tables, context_lens, scale)
        threads = torch.get_num_threads()
        status = self.layers_fn(self.weights, len(layers), ctypes.byref(a), h.data_ptr(), x.data_ptr(),
                                self.qkv.data_ptr(), self.attn.data_ptr(), cos, sin, k_dst, v_dst, layer_bytes,
                                self.scratch_for(threads), self.moe_scratch_for(threads), hidden, q_heads, kv_heads, head_dim, self.inter, self.eps,
                                threads)
        if status != 0:
            raise MemoryError("decode attention: the attention kernel could not allocate its scratch memory")

    def _attention_args(self, layers: list, windows: list[int | None], dtype: torch.dtype, attention: ctypes.CDLL,
                        kv_cache, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> _AttentionArgs:
        """self.args set for this step's attention over kv_cache (and every layer's pointers taken at the first call)."""
        from atomd.kernels.native import KERNEL_DTYPES, NARROW_KERNELS, check_shape

        _, q_heads, _, head_dim = self.dims
        c = kv_cache
        check_shape(attention, q_heads, c.num_kv_heads, head_dim)
        assert (fused_kv_narrow(dtype, c) if c.narrow else c.kv.dtype == dtype in KERNEL_DTYPES) and c.kv.is_contiguous()
        assert block_tables.dtype == context_lens.dtype == torch.int64 and block_tables.shape[0] == len(context_lens)
        assert block_tables.is_contiguous() and context_lens.is_contiguous()
        if self.weights is None:
            self.weights = (_LayerWeights * len(layers))(*(
                _LayerWeights(w.rows[0].data_ptr(), _ptr(w.qkv_bias), w.rows[1].data_ptr(), w.post_norm.data_ptr(),
                              _ptr(w.rows[2]), _ptr(w.rows[3]),
                              layers[i + 1].input_norm.data_ptr() if i + 1 < len(layers) else None,
                              0 if windows[i] is None else windows[i], _ptr(w.q_norm), _ptr(w.k_norm),
                              self._moe_struct(w.moe, dtype))
                for i, w in enumerate(layers)))
        row, planes = c.num_kv_heads * head_dim, c.kv.shape[2]
        a = self.args
        if c.narrow:  # the narrow kernel (float32 q and out); the layer stores the K / V rows in the cache's dtype
            kernel, a.kv_narrow = getattr(attention, NARROW_KERNELS[c.kv.dtype]), KV_STORE[c.kv.dtype]
        else:
            kernel = attention.atomd_decode_attention if dtype == torch.float32 else attention.atomd_decode_attention_bf16
            a.kv_narrow = KV_STORE_MODEL
        a.fn = ctypes.cast(kernel, _PTR).value
        a.kv, a.block_tables, a.context_lens = c.kv.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr()
        a.block_size, a.table_width = c.block_size, block_tables.shape[1]
        a.block_stride, a.layer_stride = c.num_layers * planes * c.block_size * row, planes * c.block_size * row
        a.v_offset, a.scale = c.block_size * row if planes == 2 else 0, scale
        return a

    def rows_kinds_for(self, rows: int, layers: list) -> torch.Tensor | None:
        """Per layer and linear (qkv, o, gate_up, down) the product run_rows runs it with on `rows` rows of x
        (ROWS_PRODUCTS' codes: qlinear's own choice, quant.product_of), int64 [layers * 4]; None: some linear
        takes a product the C call has not (float tiles, bf16 tiles): per op. An MoE layer's block (its quantized
        experts, as this layer's batch-1 form takes them) runs in the call as moe_q8 runs it (its two codes unused)."""
        if rows not in self.rows_kinds:
            from atomd.model import quant

            lib, kinds = quant.kernels(), []
            for w in layers:
                read = 2 if w.moe is not None else 4  # qkv, o (and gate_up, down): what the C call reads
                linears = (w.rows or ())[:read]  # (self.weights)
                if len(linears) != read or not all(isinstance(t, quant.QuantizedWeight) for t in linears):
                    kinds = None
                    break
                kinds += [ROWS_PRODUCTS.get(quant.product_of(lib, t, rows), -1) for t in linears]
                kinds += [0, 0] if w.moe is not None else []
            ok = kinds is not None and min(kinds) >= 0
            self.rows_kinds[rows] = torch.tensor(kinds, dtype=torch.int64) if ok else None
        return self.rows_kinds[rows]

    def run_rows(self, layers: list, windows: list[int | None], h: torch.Tensor, x: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, positions: torch.Tensor, slot_rows: torch.Tensor, kinds: torch.Tensor,
                 attention: ctypes.CDLL, kv_cache, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 scale: float, moe_rows: tuple[int, int, int]) -> None:
        """A batch's decode step, R >= 2 sequences one row each (h, x [R, hidden]), every layer in one C call
        (atomd_decode_rows_q_f32): the per-op path's bits, its products as rows_kinds_for chose them (an MoE block's
        router and softmax in C: its logits differ from the per-op path's in the last bits). x ends as
        the last layer's residual stream. positions: each row's RoPE table row; slot_rows: KVCache.slot_rows; moe_rows:
        an MoE block's moe_q8 thresholds, as moe.py passes them (moe.q8_min_m's (int4, int8), then w16_min)."""
        hidden, q_heads, kv_heads, head_dim = self.dims
        rows, q_size, inter, c = x.shape[0], self.q_size, self.inter, kv_cache
        assert h.is_contiguous() and x.is_contiguous() and positions.is_contiguous() and slot_rows.is_contiguous()
        assert positions.dtype == slot_rows.dtype == torch.int64 and len(positions) == len(slot_rows) == rows
        assert len(context_lens) == rows and kinds.numel() == 4 * len(layers)  # one token a sequence
        a = self._attention_args(layers, windows, h.dtype, attention, c, block_tables, context_lens, scale)
        widths = (q_size + 2 * kv_heads * head_dim, q_size, q_size, hidden, 2 * inter, inter)
        if self.rows_buffer.numel() < rows * sum(widths):
            self.rows_buffer = torch.empty(rows * sum(widths), dtype=self.rows_buffer.dtype)
        parts = torch.split(self.rows_buffer[:rows * sum(widths)], [rows * n for n in widths])
        min_m = (ctypes.c_int64 * 2)(*moe_rows[:2])
        status = self.rows_fn(self.weights, len(layers), ctypes.byref(a), rows, h.data_ptr(), x.data_ptr(),
                              *(t.data_ptr() for t in parts), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
                              slot_rows.data_ptr(), 2 * c.block_size, c.block_size, c.kv.element_size(), kinds.data_ptr(),
                              min_m, moe_rows[2], hidden, q_heads, kv_heads, head_dim, inter, self.eps,
                              torch.get_num_threads())
        if status == -2:  # (rows_kinds_for chose it from quant.product_of: the same build's products)
            raise RuntimeError(f"batch decode of {rows} rows: a product of kinds {kinds.unique().tolist()} not built here")
        if status != 0:
            raise MemoryError(f"batch decode of {rows} rows: out of memory (status {status})")
        self.rows_steps += 1

    def _moe_struct(self, moe, dtype: torch.dtype):
        """A sparse layer's decode_moe_weights (moe: atomd/model/moe.py MoeWeights, every expert on this rank:
        DecoderModel.unfused_reason; float experts stacked and contiguous, or quantized ones as moe_q8 takes them,
        MoeWeights.q8_experts, whose arrays the MoeWeights keeps), or None for a dense one."""
        if moe is None:
            return None
        if moe.quantized:
            q8 = moe.q8_experts()
            gate_up, down, inter = ctypes.addressof(q8[0]), ctypes.addressof(q8[1]), moe.down[0].in_features
        else:
            gate_up, down, inter = moe.gate_up.data_ptr(), moe.down.data_ptr(), moe.down.shape[2]
        m = _MoeWeights(moe.router.data_ptr(), gate_up, down, moe.routed.data_ptr(), moe.router.shape[0], moe.top_k,
                        inter, int(moe.norm_topk_prob), int(dtype == torch.float32 or not moe.cast_weights))
        self.moe.append(m)
        return ctypes.pointer(m)


# quant.product_of's products that DecodeLayer.run_rows runs (csrc/layer_ops.c ROWS_*)
ROWS_PRODUCTS = {"rows": 0, "gemm": 1, "int_rows": 2, "w16_rows": 3, "w16_panels": 4, "w16_prepacked": 5, "amx": 6}


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
