"""Weight-only int8 / int4 linears with float activations: the packed layout, round-to-nearest
quantisation (`--quantization int8|int4`), and the matmul (atomd/kernels/csrc/quant.c; torch where no
compiler). Checkpoints already quantised (GPTQ, AWQ, compressed-tensors) are unpacked into
this layout by atomd/model/quant_formats.py.

Every format becomes w[n, k] = q[n, k] * scale[n, g] + offset[n, g], g = k // group_size
(offset = -zero_point * scale; None where the format is symmetric), float32 scales and
offsets. int8: q int8 [N, K], per channel (group_size = K) or per group. int4: q 0..15 in
uint8 [N, K / 2], each run of 32 values in 16 bytes (llama.cpp's Q4_0 order, one load and a
mask/shift give the run in order), group_size a multiple of 32. `--quantization bf16` (bits 16): the float weight rounded to bfloat16 and kept as 16 bits, no scales,
widened to float32 in registers (exact) with float32 activations and sums: half float32's bytes on
any CPU, bf16 arithmetic not needed (what llama.cpp's BF16 does on CPUs without AVX512_BF16).
`--quantization fp16` the same with float16 values (a float16 checkpoint's weights as stored;
widened exactly, F16C / AVX-512 conversions). GPTQ's act-order (desc_act)
checkpoints keep their groups contiguous by permuting the input columns once at load:
`perm`, and x's columns are gathered in that order before each matmul.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from atomd.kernels import cbuild
from atomd.config import QUANTIZATIONS

log = logging.getLogger(__name__)
# --quantization's LM head by method (a tied one: its own copy, the embedding lookup keeps the
# floats): int8 for int4 too, as llama.cpp keeps its output tensor above Q4_0 (Q6_K)
LM_HEAD_QUANTIZATION = {"int8": "int8", "int4": "int8", "bf16": "bf16", "fp16": "fp16"}
QBITS_F16 = -16  # csrc/quant.h: the atomd_qweight `bits` of float16 weights (16: bfloat16)
FLOAT16_MAX = 65504.0
INT4_GROUPS = (128, 64, 32)  # --quantization int4: the largest that divides a linear's input size
# rows of x up to which the C kernel dequantises in registers; past it, float tiles of the
# weight go to torch's BLAS (135M shape's layer linears, one thread, two runs: at M = 16 the
# kernel 2.5-2.8 ms against 9.7-10.3 ms for 16 MiB tiles, at M = 64 17.4 against 9.9-11.5;
# benchmarks/results/quant.md)
QGEMM_MAX_M = 16
# the same cut-over with int8 activations (csrc/quant.h): their integer dots stay ahead of the tiles to
# M = 32 (135M shape's gate_up / down, one thread, int8 and int4: 0.8-0.96x the tiles' time at M = 32,
# 0.3-1.07x at 64; benchmarks/RESULTS.md, #35 int8 activations)
QGEMM_Q8_MAX_M = 32
# int8 activations on a CPU with AMX-INT8 (csrc/quant_amx.h): from this many rows of x on, at any M, the
# tile product instead of the VNNI rows (M <= 32) and the float tiles (past 32). A tile product costs the
# same at M = 1..16 (the 16 x 16 block dots are stored and scaled whatever M is), the rows grow with M:
# one thread, 135M / 0.6B linears, rows / tiles at M = 2 0.5-1.0x (tiles slower), at M = 4 0.8-1.4x,
# at 16 3-5x (benchmarks/RESULTS.md, #35 AMX-INT8); batch 1 stays on the rows
QGEMM_AMX_MIN_M = 4
# int8 activations on a CPU with AVX512-VNNI but no AMX-INT8 tiles (csrc/quant_vnni.h): from this many rows of
# x on, at any M, a register-blocked VNNI GEMM (each thread's weight columns packed per call into an L2 panel)
# instead of the VNNI rows (M <= 32) and the float tiles (past 32). Both no-AMX kinds, 1 and 2 threads, 135M / 0.6B
# linears: the GEMM 0.87-1.49x the rows' speed at M = 4 (0.8-1.2x at M = 2), 1.25-2.0x at 8 (RESULTS.md, #35 the VNNI GEMM)
QGEMM_VNNI_MIN_M = 4
# ... its AVX2 form (csrc/quant_gemm_avx2.h: 8 columns a vector, vpmaddubsw) on CPUs without AVX-512, from this many
# rows by the weight's bits. 135M's linears, 2 threads, AVX2 EPYC, the GEMM's time over the AVX2 rows': int4 0.66-0.97x
# at 5 rows (1.0x at 4), 0.50-0.75x at 16; int8 0.7-1.0x at 6-14 rows but down's (act blocks of 256, whose rows
# convert once an act block) 1.0-1.3x, 0.72-0.97x at 16; past 32 rows 0.46-0.82x the float tiles' (RESULTS.md, #35
# the AVX2 int8 GEMM)
QGEMM_AVX2_GEMM_MIN_M = {4: 5, 8: 16}
# ... and on a CPU with the bf16 AMX tiles, from this many rows of x on (prefill), the tile product widened
# (atomd_qgemm_wide, csrc/quant_amx.h): each work item's weight rows dequantised and rounded to bf16 once,
# x rounded to bf16, bf16 tiles with float32 sums over all of K: the int8 tiles store and rescale each
# 32-input block's result (measured: benchmarks/RESULTS.md, #35 the dense int linears widened). Not the
# int8-activation bits above it (docs/design.md). 0 (or $ATOMD_QLINEAR_WIDE=0 at import): never.
QGEMM_WIDE_MIN_M = 0 if os.environ.get("ATOMD_QLINEAR_WIDE") == "0" else 256
# ... but int8 weights with act blocks of at least this many inputs (per channel: 256) stay on the int8 tiles at any M
# (their int8-activation bits): the tiles sum an act block's 4 products before a store, and measured 0.70-1.13x
# the widened tiles' time at M = 128..2048 (Qwen3-0.6B's qkv / gate_up / down, one thread; int4 groups of 128:
# 0.9-1.2x, widened from 256 rows as before; RESULTS.md, #35 the act block)
QGEMM_WIDE_INT8_KEEP = 256
# 16-bit weights (bits 16) from this many rows of x on, where the kernels have AVX-512 (lib.w16_panels):
# csrc/quant_w16.h's packed panels (each call widens and packs the weight once, a float32 micro-kernel over
# every row of x) instead of the rows widened in registers (up to QGEMM_MAX_M) and the float32 tiles for torch's
# BLAS past it; 0: never (benchmarks/qlinear_16.py's A/B). At 16 rows (a batch-16 decode step) the panels take
# 0.78-1.02x the rows' time (Qwen3-0.6B's linears, 2 threads, VNNI kind; SmolLM2 0.71-1.01x), at 8 1.07-1.52x
# (RESULTS.md, #35 batch 16 with 16-bit weights). An AVX2 build's per-call panels (csrc/quant_w16_avx2.h) from the
# same 16 rows: 0.84-0.96x oneDNN float32's time at 16 rows where its rows take 0.91-1.08x, at 8 rows 0.77-1.02x
# against the rows' 0.56-0.73x (AVX2 EPYC, 135M's linears, 2 threads; RESULTS.md, #35 the AVX2 16-bit panels)
QGEMM_W16_MIN_M = 16
# ... and from this many rows where the weight's panels were packed once at load (prepack_panels: 16-bit, widened
# in registers, no per-call packing): 0.51-0.64x oneDNN float32's time at 2-8 rows and 0.76-0.88x at 16 on the
# 135M / 0.6B linears, where the rows in registers take 0.58-1.1x and the per-call panels 1.0-1.3x; about level
# with both at 128-2048 rows (RESULTS.md, #35 16-bit panels packed at load). An AVX2 build's (csrc/quant_w16_avx2.h's
# strips): 0.86-1.01x the rows' time at 2-4 rows, 0.65-0.81x at 8, 0.46-0.58x at 16, and 0.55-0.67x the per-call
# panels' at 16 (the same linears, AVX2 EPYC, 2 threads)
QGEMM_W16_PREPACKED_MIN_M = 2
# ... up to this many rows: from it the weight is packed per call as float32 panels again (the same sums, the same
# bits), as the load-time 16-bit panels cost the micro-kernel a shift or a mask per weight vector on the FMA ports,
# while the per-call packing is one widening pass over the weight, amortised over M / 14 slivers. VNNI kind, 135M
# linears at 2048 / 4096 rows (a long prefill's QKV runs every row of the step): per-call 0.93-0.96x the load-time
# panels' time at 1 thread, 0.90-0.96x at 2 (Qwen3-0.6B at 4096 rows: 0.97-1.02x); at 512 rows they tie (RESULTS.md,
# #35 16-bit prefill on the SmolLM2-135M shape). 0: never. An AVX2 build keeps its load-time strips at every M: 0.89-0.97x
# the per-call panels' time at 512-2048 rows on the 135M / 0.6B linears (AVX2 EPYC, 2 threads; RESULTS.md, #35 the
# AVX2 16-bit strips packed at load)
QGEMM_W16_PER_CALL_MIN_M = 2048
# gemm_bf16_f32's products: by vdpbf16ps (True) or both operands widened, float32 FMAs (False). Measured on the Intel
# Xeon with AMX here (register-only loop, 24 chains, 1 core): vdpbf16ps zmm 57 GMAC/s, vfmadd231ps zmm 111, so
# the widened FMAs win on it (benchmarks/qlinear_16.py; RESULTS.md, #35 bf16 prefill on the AVX512_BF16 kind);
# on AMD's Zen 4 a zmm vdpbf16ps is reported to do 2x vfmadd231ps's multiply-adds a cycle (an assumption: no AMD CPU
# here to measure; benchmarks/dot_rate.py does): vdpbf16ps on AMD CPUs. $ATOMD_BF16_DOT=0 / 1 at import overrides
BF16_DOT = os.environ.get("ATOMD_BF16_DOT", "1" if cbuild.cpu_vendor() == "AuthenticAMD" else "0") == "1"
# a dequantised tile, float32: up to 16 MiB, so a small model's linear is one BLAS call (135M
# shape, M = 512, one thread: 4 MiB tiles 1.1-1.6x the time of 16 MiB ones; 1 MiB up to 2x)
TILE_FLOATS = 1 << 22
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
PATHS = {2: "AVX-512", 1: "AVX2", 0: "scalar"}  # atomd_quant_path
Q8_PATHS = {3: "AVX512-VNNI", 2: "AVX-512", 1: "AVX2", 0: "scalar"}  # atomd_quant_q8_path
Q8_BLOCK = 32  # int8 activations: the smallest act block, the kernels' unit (csrc/quant.h)
# int8 / int4 MoE experts with int8 activations held on an AVX2 build as the int8 GEMM's strips alone (keep_strips_only,
# DecoderModel._strips_only): the GEMM's products at every count of rows, one row too, where below q8_gemm_min_m the
# int8-activation rows ran them and each GEMM call packed its panels; False (or $ATOMD_INT_STRIPS=0 at import): the
# rows as loaded (the A/B of engine-level runs)
INT_STRIPS = os.environ.get("ATOMD_INT_STRIPS") != "0"
# int8 activations' act block by the weight's group: the largest of these that divides it (per channel: the
# input size), one scale d per act block per row of x, so the AMX-INT8 tiles sum act_block / 64 products in
# int32 before one store and rescale (csrc/quant_amx.h). 256 keeps a trained model's logits within 1.5x the
# int8 weights' own rounding (benchmarks/act_block_accuracy.py; RESULTS.md, #35 the act block)
ACT_BLOCKS = (256, 128, 64, Q8_BLOCK)


def act_block_of(group_size: int) -> int:
    """The int8 activations' block for a weight of groups of `group_size` inputs (0: none fits)."""
    return next((a for a in ACT_BLOCKS if group_size % a == 0), 0)


class _QWeightStruct(ctypes.Structure):
    _fields_ = [("q", _PTR), ("scales", _PTR), ("offsets", _PTR), ("group", _I64), ("bits", _I64),
                ("xq", _PTR), ("xd", _PTR), ("xsg", _PTR), ("ablock", _I64), ("panels", _PTR)]


@dataclass
class QuantizedWeight:
    bits: int  # 8, 4 or 16 (bf16 or fp16: q's dtype says which)
    q: torch.Tensor  # int8 [N, K], uint8 [N, K // 2], bfloat16 or float16 [N, K] (module docstring)
    scales: torch.Tensor | None  # float32 [N, groups]; None for 16-bit weights
    offsets: torch.Tensor | None  # float32 [N, groups]; None: symmetric
    group_size: int
    in_features: int
    perm: torch.Tensor | None = None  # int64 [K]: kernel column c is the checkpoint's input perm[c]
    # the activations quantised to int8 per act block, integer dot products (csrc/quant.h):
    # set by use_int8_activations where int8_activations_fit
    int8_activations: bool = False
    _ref: Any = field(default=None, repr=False, compare=False)  # its atomd_qweight (data_ptr)
    _scratch: Any = field(default=None, repr=False, compare=False)  # xq, xd, xsg of one row (the fused layer's)
    # int8 activations' block (inputs per scale of x): act_block_of(group_size) where the weight is made, kept
    # when a TP slice changes group_size (tensor_parallel._columns: a slice on act-block boundaries)
    act_block: int = 0
    # a 16-bit weight's panels packed once at load (prepack_panels), read by qlinear from QGEMM_W16_PREPACKED_MIN_M
    # rows instead of packing the weight each call; None: packed per call
    panels: torch.Tensor | None = field(default=None, repr=False, compare=False)
    # the lib.w16_panels of the build that packed them (1: AVX-512's 32-row panels, 2: AVX2's 16-row strips): a build
    # reads only its own layout (another, after $ATOMD_KERNEL_ISA changed: packed per call)
    panels_layout: int = field(default=0, repr=False, compare=False)

    def __post_init__(self):
        if not self.act_block and self.bits != 16:
            self.act_block = act_block_of(self.group_size)

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.in_features

    @property
    def strips_only(self) -> bool:
        """A weight whose load-time strips are its only copy (keep_strips_only: q is [N, 0])."""
        return self.q.shape[1] == 0 and self.panels is not None

    def data_ptr(self) -> int:
        """The address of this weight's atomd_qweight (csrc/quant.h), what the fused batch-1
        decode layer (layer_ops.DecodeLayer) takes where a float weight passes its data."""
        if self._ref is None:
            scratch = (None, None, None)
            if self.int8_activations:  # (the rows quantise x into each thread's own row up to Q8_OWN_K inputs)
                self._scratch = _q8_scratch(1, self.in_features)
                scratch = tuple(t.data_ptr() for t in self._scratch)
            self._ref = _QWeightStruct(None if self.strips_only else self.q.data_ptr(), _ptr(self.scales), _ptr(self.offsets),
                                       self.group_size, self.c_bits(), *scratch, self.act_block, _ptr(self.panels))
        return ctypes.addressof(self._ref)

    def c_bits(self) -> int:
        """Its atomd_qweight's `bits`: 8, 4, 16 (bfloat16) or QBITS_F16 (float16)."""
        return QBITS_F16 if self.q.dtype == torch.float16 else self.bits

    def int8_activations_fit(self) -> bool:
        """Whether int8 activations can run: inputs and groups whole act blocks (of 32 inputs at least)."""
        a = self.act_block
        return self.bits != 16 and a in ACT_BLOCKS and self.in_features % a == 0 and self.group_size % a == 0

    def nbytes(self) -> int:
        parts = (self.q, self.scales, self.offsets) + ((self.panels,) if self.strips_only else ())
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def int_values(self) -> torch.Tensor:
        """q as int32 [N, K] in the kernel's column order."""
        if self.strips_only:
            return held_values(self)
        if self.bits == 8:
            return self.q.to(torch.int32)
        runs = self.q.view(self.q.shape[0], -1, 16).to(torch.int32)
        return torch.stack((runs & 15, runs >> 4), dim=2).reshape(self.q.shape[0], self.in_features)

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        """The float32 weight [N, K] (rows of it), in the checkpoint's column order."""
        if self.strips_only and self.bits == 16:
            return strips_rows(self)[rows].float()
        if self.bits == 16:
            return self.q[rows].float()
        w = self.int_values()[rows].float()
        groups = lambda t: t[rows].repeat_interleave(self.group_size, dim=1)[:, :self.in_features]  # noqa: E731
        w = w * groups(self.scales) + (0 if self.offsets is None else groups(self.offsets))
        return w if self.perm is None else w[:, torch.argsort(self.perm)]


def pack(values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, bits: int, group_size: int,
         perm: torch.Tensor | None = None) -> QuantizedWeight:
    """The packed weight of integer `values` [N, K] (int8: -128..127, int4: 0..15) with
    per-group `scales` / `offsets` [N, ceil(K / group_size)], already in kernel column order."""
    n, k = values.shape
    groups = -(-k // group_size)
    if bits not in (4, 8):
        raise ValueError(f"{bits}-bit weights are not supported (int8 and int4 only)")
    if tuple(scales.shape) != (n, groups) or (offsets is not None and tuple(offsets.shape) != (n, groups)):
        raise ValueError(f"scales {tuple(scales.shape)} do not match {n} rows of {groups} groups of {group_size}")
    if bits == 8:
        q = values.to(torch.int8).contiguous()
    else:
        if group_size % 32 or k % group_size:
            raise ValueError(f"int4 needs a group size that is a multiple of 32 and divides {k}, got {group_size}")
        runs = values.to(torch.uint8).view(n, k // 32, 2, 16)
        q = (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    return QuantizedWeight(bits, q, scales.float().contiguous(), None if offsets is None else offsets.float().contiguous(),
                           group_size, k, perm)


def quantize(w: torch.Tensor, method: str) -> QuantizedWeight:
    """Round-to-nearest of a float weight [N, K]: int8 symmetric per output channel
    (scale = max|w| / 127); int4 asymmetric per group of INT4_GROUPS (the range [min, max]
    of each group, widened to hold 0 as GPTQ's quantiser does, in 15 steps; zero point =
    round(-min / scale))."""
    if method == "bf16":  # rounded to nearest even once, here; widened exactly at every use
        return QuantizedWeight(16, w.to(torch.bfloat16).contiguous(), None, None, w.shape[1], w.shape[1])
    if method == "fp16":  # exact for a float16 checkpoint; a float32 one's values must fit the range
        if w.dtype != torch.float16 and bool((w.abs() > FLOAT16_MAX).any()):
            raise ValueError(f"--quantization fp16: a weight of shape {tuple(w.shape)} holds values beyond float16's "
                             f"range (|w| up to {float(w.abs().max()):g} > {FLOAT16_MAX:g}): use bf16")
        return QuantizedWeight(16, w.to(torch.float16).contiguous(), None, None, w.shape[1], w.shape[1])
    w = w.float()
    n, k = w.shape
    if method == "int8":
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        return pack(torch.round(w / scale).clamp(-127, 127), scale, None, 8, k)
    if method != "int4":
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {method!r}")
    group = next((g for g in INT4_GROUPS if k % g == 0), None)
    if group is None:
        raise ValueError(f"int4 needs input sizes divisible by 32; a linear has {k}")
    g = w.view(n, k // group, group)
    lo, hi = g.amin(dim=2).clamp(max=0), g.amax(dim=2).clamp(min=0)
    scale = (hi - lo) / 15
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = (torch.round(g / scale.unsqueeze(2)) + zero.unsqueeze(2)).clamp(0, 15).view(n, k)
    return pack(q, scale, -zero * scale, 4, group)


def use_int8_activations(weights: list[QuantizedWeight]) -> int:
    """`--quantized-activations int8`: these weights' matmuls up to QGEMM_MAX_M rows quantise x
    to int8 (csrc/quant.h); those whose shape does not fit keep float activations. Returns how many switched."""
    switched = 0
    for w in weights:
        if w.int8_activations_fit():
            w.int8_activations, w._ref = True, None
            switched += 1
    return switched


def qweight_array(weights: list[QuantizedWeight]) -> ctypes.Array:
    """The weights' atomd_qweight structs (csrc/quant.h) as one C array, pointing at their own integers
    and scales (a weight held as an AVX2 build's strips only: at them), without scratch: the int8 and 16-bit MoE
    experts (layer_ops.moe_q8, which quantises x into its own). The caller keeps the weights alive as long as the
    array."""
    return (_QWeightStruct * len(weights))(*(_QWeightStruct(None if w.strips_only else w.q.data_ptr(), _ptr(w.scales),
                                                            _ptr(w.offsets),
                                                            w.group_size, w.c_bits(), ablock=w.act_block,
                                                            panels=_ptr(w.panels) if w.strips_only else None)
                                             for w in weights))


def cat(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Weights of one input stacked along their outputs (q, k, v; gate, up), as loaded (not strips only)."""
    assert not any(w.strips_only for w in weights), "cat of weights whose rows were dropped (keep_strips_only)"
    first = weights[0]
    for w in weights[1:]:
        same_perm = (w.perm is None) == (first.perm is None) and (w.perm is None or torch.equal(w.perm, first.perm))
        if (w.bits, w.group_size, w.in_features, w.act_block) != (first.bits, first.group_size, first.in_features,
                                                                   first.act_block) or not same_perm \
                or (w.offsets is None) != (first.offsets is None):
            raise ValueError("linears that share an input (q/k/v, gate/up) must be quantised alike "
                             "(bits, group size, zero points, act-order permutation, act block)")
    return QuantizedWeight(first.bits, torch.cat([w.q for w in weights]),
                           None if first.scales is None else torch.cat([w.scales for w in weights]),
                           None if first.offsets is None else torch.cat([w.offsets for w in weights]),
                           first.group_size, first.in_features, first.perm, first.int8_activations,
                           act_block=first.act_block)


@functools.cache
def build_kernels(isa: str, vnni: bool = True) -> ctypes.CDLL | None:
    """The library built for `isa` (atomd.kernels.cbuild.ISA_FLAGS), or None (torch) with the
    reason logged. vnni False: without the AVX512-VNNI int8 path (what an AVX-512 CPU without
    VNNI runs; tests)."""
    source, flags, name = cbuild.quant_kernel()
    if not vnni:
        flags, name = [*flags, "-DATOMD_NO_VNNI"], name + "-novnni"
    lib = cbuild.load(source, flags, name, log, "int8 / int4 linears dequantise tiles with torch", isa)
    if lib is None:
        return None
    for bits in (8, 4):
        gemm, deq = getattr(lib, f"atomd_qgemm_i{bits}"), getattr(lib, f"atomd_qdequant_i{bits}")
        gemm.argtypes, gemm.restype = [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, ctypes.c_int], None
        deq.argtypes, deq.restype = [_PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, ctypes.c_int], None
    lib.atomd_qgemm_q8.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _I64,
                                   _PTR, _PTR, _PTR, ctypes.c_int]
    lib.atomd_qgemm_q8.restype = None
    lib.atomd_qgemm_amx.argtypes = lib.atomd_qgemm_q8.argtypes
    lib.atomd_qgemm_amx.restype = lib.atomd_quant_amx.restype = ctypes.c_int
    lib.amx = bool(lib.atomd_quant_amx())  # int8 activations on AMX-INT8 tiles from QGEMM_AMX_MIN_M rows
    lib.atomd_qgemm_q8_gemm.argtypes = lib.atomd_qgemm_q8.argtypes
    lib.atomd_qgemm_q8_gemm.restype = lib.atomd_quant_q8_gemm.restype = ctypes.c_int
    lib.atomd_qhold_q8.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, ctypes.c_int]
    lib.atomd_qgemm_q8_held.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR,
                                        _PTR, ctypes.c_int]
    lib.atomd_qhold_q8.restype = lib.atomd_qgemm_q8_held.restype = ctypes.c_int
    lib.atomd_qhold_strip_bytes.argtypes, lib.atomd_qhold_strip_bytes.restype = [_I64, _I64, _I64], _I64
    # int8 activations as a GEMM from q8_gemm_min_m rows (no tiles): Q8_PATHS' 3 (VNNI), 1 (AVX2), 0 none
    lib.q8_gemm = lib.atomd_quant_q8_gemm()
    lib.atomd_qgemm_wide.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, ctypes.c_int]
    lib.atomd_qgemm_wide.restype = lib.atomd_quant_wide.restype = ctypes.c_int
    lib.wide = bool(lib.atomd_quant_wide())  # ... widened to bf16 tiles from QGEMM_WIDE_MIN_M rows
    for w16 in ("b16", "h16"):
        gemm, deq = getattr(lib, f"atomd_qgemm_{w16}"), getattr(lib, f"atomd_qdequant_{w16}")
        gemm.argtypes, gemm.restype = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, ctypes.c_int], None
        deq.argtypes, deq.restype = [_PTR, _I64, _I64, _I64, _PTR, ctypes.c_int], None
        for panels in (getattr(lib, f"atomd_qgemm_{w16}_panels"), getattr(lib, f"atomd_qgemm_{w16}_prepacked"),
                       getattr(lib, f"atomd_qgemm_{w16}_prepacked_silu")):
            panels.argtypes, panels.restype = gemm.argtypes, ctypes.c_int
        getattr(lib, f"atomd_qgemm_{w16}_prepacked_norm").argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64,
                                                                      _PTR, ctypes.c_float, _PTR, _I64, ctypes.c_int]
        getattr(lib, f"atomd_qgemm_{w16}_prepacked_norm").restype = ctypes.c_int
        prepack = getattr(lib, f"atomd_qprepack_{w16}")
        prepack.argtypes, prepack.restype = [_PTR, _I64, _I64, _PTR, ctypes.c_int], ctypes.c_int
    lib.atomd_quant_w16_panels.restype = lib.atomd_quant_bf16_panels.restype = ctypes.c_int
    lib.atomd_gemm_bf16_panels.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, ctypes.c_int]
    lib.atomd_gemm_bf16_panels.restype = ctypes.c_int
    lib.atomd_gemm_bf16_rounded.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _PTR, _I64, ctypes.c_int,
                                            ctypes.c_int]
    lib.atomd_gemm_bf16_rounded.restype = ctypes.c_int
    lib.atomd_w16_kc.restype = _I64
    lib.bf16_panels = bool(lib.atomd_quant_bf16_panels())  # gemm_bf16_f32 by vdpbf16ps (AVX512_BF16 built)
    # 16-bit weights from QGEMM_W16_MIN_M rows as packed panels: 1 every form (AVX-512), 2 per call and packed at load,
    # float32 x only (AVX2), 0 none
    lib.w16_panels = lib.atomd_quant_w16_panels()
    lib.atomd_quant_path.restype = lib.atomd_quant_q8_path.restype = ctypes.c_int
    log.info("int8 / int4 linears: %s kernels (int8 activations: %s%s%s)%s", PATHS[lib.atomd_quant_path()],
             Q8_PATHS[lib.atomd_quant_q8_path()], f", AMX-INT8 tiles from {QGEMM_AMX_MIN_M} rows" if lib.amx else "",
             f", bf16 tiles from {QGEMM_WIDE_MIN_M} rows" if lib.wide and QGEMM_WIDE_MIN_M else "",
             f"; 16-bit weights as packed panels from {QGEMM_W16_MIN_M} rows" if lib.w16_panels and QGEMM_W16_MIN_M else "")
    return lib


def kernels() -> ctypes.CDLL | None:
    return build_kernels(cbuild.kernel_isa())


def gemm_bf16_f32(x: torch.Tensor, weight: torch.Tensor, lib: ctypes.CDLL | None | str = "auto",
                  dot: bool | None = None) -> torch.Tensor | None:
    """x [M, K] @ weight.T as a new float32 [M, N], unrounded, for bf16 x (rows of any stride, unit column
    stride) and a plain contiguous bf16 weight [N, K]: float32 sums of the exact bf16 products through packed
    weight panels (csrc/quant_w16.h, atomd_gemm_bf16_panels), each output one chain over K in order (its bits
    independent of M and the threads): of vdpbf16ps over K's pairs (dot; default BF16_DOT), else of float32
    FMAs on both operands widened. None where the kernels lack AVX-512 (dot: AVX512_BF16)."""
    return _gemm_bf16(x, weight, lib, dot, False)


def gemm_bf16(x: torch.Tensor, weight: torch.Tensor, lib: ctypes.CDLL | None | str = "auto",
              dot: bool | None = None) -> torch.Tensor | None:
    """gemm_bf16_f32(x, weight, lib, dot).to(torch.bfloat16), the same bits, in one call (atomd_gemm_bf16_rounded):
    without dot x is widened a sliver of rows at a time inside the kernel instead of into a float32 copy, and each
    sliver's sums are rounded to bf16 as they are done instead of in a pass over a float32 [M, N] (K within one
    k-block: the float32 sums never leave the thread's sliver). Those two torch passes were 9% of SmolLM2-135M's
    bf16 prefill on the AMD EPYC kind (RESULTS.md, #35 16-bit prefill on the SmolLM2-135M shape). None where
    gemm_bf16_f32 is None."""
    return _gemm_bf16(x, weight, lib, dot, True)


def _gemm_bf16(x: torch.Tensor, weight: torch.Tensor, lib: ctypes.CDLL | None | str, dot: bool | None,
               rounded: bool) -> torch.Tensor | None:
    """gemm_bf16_f32 (rounded False) or gemm_bf16."""
    lib = kernels() if lib == "auto" else lib
    dot = BF16_DOT if dot is None else dot
    if lib is None or lib.w16_panels != 1 or (dot and not lib.bf16_panels):
        return None
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, (n, k), threads = x.shape[0], weight.shape, torch.get_num_threads()
    if rounded:
        out = torch.empty(m, n, dtype=torch.bfloat16)
        sums = torch.empty(m, n, dtype=torch.float32) if k > lib.atomd_w16_kc() * (2 if dot else 1) else None
        rc = lib.atomd_gemm_bf16_rounded(x.data_ptr(), x.stride(0), m, weight.data_ptr(), n, k, _ptr(sums), n,
                                         out.data_ptr(), n, int(dot), threads)
    else:
        out = torch.empty(m, n, dtype=torch.float32)
        if not dot:  # x widened once (a GPR broadcast per input in the micro-kernel costs a port-5 uop an FMA needs)
            x = x.float()
        rc = (lib.atomd_gemm_bf16_panels if dot else lib.atomd_qgemm_b16_panels)(
            x.data_ptr(), x.stride(0), m, weight.data_ptr(), n, k, out.data_ptr(), n, threads)
    if rc != 0:
        raise MemoryError(f"bf16 weight panels of {m} x {k} by {n} rows: out of memory")
    return out


def _q8_scratch(m: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """xq, xd, xsg of m quantised rows of k inputs (csrc/quant.h: Q8_XD, Q8_XSG)."""
    return torch.empty(m, k, dtype=torch.int8), torch.empty(m, -(-k // (2 * Q8_BLOCK)) * 16), torch.empty(m, k // Q8_BLOCK)


def _amx_scratch(m: int, k: int, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """xt, dt, xsgt of m rows of x for the AMX product (csrc/quant_amx.h: QAMX_XT, QAMX_DT, QAMX_XSG)."""
    tiles = -(-m // 16)
    return (torch.empty(tiles * (k // Q8_BLOCK) * 512, dtype=torch.int8), torch.empty(tiles * (k // Q8_BLOCK) * 16),
            torch.empty(tiles * (k // g) * 16))


def widens(w: QuantizedWeight, m: int) -> bool:
    """Whether an int8-activation product of m rows of x runs widened to bf16 tiles (where lib.wide)."""
    return 0 < QGEMM_WIDE_MIN_M <= m and not (w.bits == 8 and w.act_block >= QGEMM_WIDE_INT8_KEEP)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def derived(w: QuantizedWeight, **changes) -> QuantizedWeight:
    """A weight made from w with `changes` (a slice, padding: tensor_parallel), without w's state derived from its
    tensors: the C struct, the scratch, the load-time panels. Not of a strips-only weight (its rows are gone)."""
    assert not w.strips_only, "a weight made from one whose rows were dropped (keep_strips_only)"
    return replace(w, **changes, _ref=None, _scratch=None, panels=None)


def panel_bytes(w: QuantizedWeight, rows: int = 32) -> int:
    """The bytes prepack_panels keeps for a 16-bit weight: its rows padded to whole panels of `rows` (AVX-512's 32;
    an AVX2 build's strips, 16)."""
    n, k = w.shape
    return (n + rows - 1) // rows * rows * k * 2


def prepack_panels(w: QuantizedWeight, lib: ctypes.CDLL | None | str = "auto") -> int:
    """Pack a 16-bit weight once into the panels qlinear reads from QGEMM_W16_PREPACKED_MIN_M rows (csrc/quant_w16.h
    w16_prepack: per 32 weight rows, each input's 32 values in one 64-byte line, widened in registers; an AVX2
    build's quant_w16_avx2.h: per 16 rows, 32 bytes), a second
    copy beside the rows batch-1 decode streams: a batch's decode step and prefill skip the per-call widening and
    transposing (#35: at 16 rows that was most of the linear's time). Returns the bytes kept (0: nothing done:
    not a 16-bit weight, or no AVX-512 / AVX2 kernels)."""
    lib = kernels() if lib == "auto" else lib
    if lib is None or not lib.w16_panels or w.bits != 16 or w.strips_only:
        return 0
    n, k = w.shape
    panels = torch.empty(panel_bytes(w, 32 if lib.w16_panels == 1 else 16) // 2, dtype=torch.int16)
    rc = getattr(lib, f"atomd_qprepack_{_w16(w)}")(w.q.data_ptr(), n, k, panels.data_ptr(), torch.get_num_threads())
    if rc != 0:
        return 0
    w.panels, w.panels_layout, w._ref = panels, lib.w16_panels, None  # (its atomd_qweight made again with them)
    return panels.nbytes


def keep_strips_only(w: QuantizedWeight, lib: ctypes.CDLL | None | str = "auto") -> int:
    """A weight packed into an AVX2 build's strips, which then replace its rows: they serve every M, batch-1 decode
    too, so the weight is held once and q becomes [N, 0]. A 16-bit weight's (prepack_panels; at one row 0.89-1.05x
    the rows' time: RESULTS.md, #35 the AVX2 16-bit strips; DecoderModel moves them onto 2 MiB pages, as it does the
    rows batch-1 decode streams); an int8 / int4 weight with int8 activations and no act-order permutation, the int8
    GEMM's (hold_strips: the MoE experts, DecoderModel._strips_only). Returns the strips' bytes (0: not done: neither
    such weight, or not an AVX2 build)."""
    lib = kernels() if lib == "auto" else lib
    if lib is None or lib.w16_panels != 2 or w.strips_only:
        return 0
    if w.bits == 16 and not prepack_panels(w, lib) or w.bits != 16 and not hold_strips(w, lib):
        return 0
    w.q, w._ref = w.q.new_empty((w.q.shape[0], 0)), None
    return w.panels.nbytes


def hold_strips(w: QuantizedWeight, lib: ctypes.CDLL) -> bool:
    """An int8 / int4 weight's strips (csrc/quant_gemm_avx2.h qv_hold: per 8 rows the int8 GEMM's packed panel,
    int4 two values a byte, then the strip's scales and offsets) into w.panels, beside its rows; False where not
    made (float activations, an act-order permutation; keep_strips_only checks the build)."""
    n, k = w.shape
    if not w.int8_activations or w.perm is not None:
        return False
    size = lib.atomd_qhold_strip_bytes(k, w.group_size, w.bits)
    panels = torch.empty(-(-n // 8) * size, dtype=torch.uint8)
    if not size or lib.atomd_qhold_q8(w.q.data_ptr(), w.bits, w.scales.data_ptr(), _ptr(w.offsets), n, k, w.group_size,
                                      panels.data_ptr(), torch.get_num_threads()):
        return False
    w.panels, w.panels_layout, w._ref = panels, lib.w16_panels, None
    return True


def held_values(w: QuantizedWeight) -> torch.Tensor:
    """The int32 values [N, K] (kernel column order) of an int8 / int4 weight held as strips (hold_strips: per strip
    of 8 rows, 4 inputs of the 8 rows a 32-byte vector; int4 a block of 32 inputs 4 such vectors, c holding inputs
    4c.. in its low nibbles and 16 + 4c.. in its high), its scales and offsets after them."""
    n, k = w.shape
    strips, wbytes = -(-n // 8), 8 * k * w.bits // 8
    raw = w.panels.view(strips, -1)[:, :wbytes]
    if w.bits == 8:
        v = raw.view(torch.int8).view(strips, k // 4, 8, 4).permute(0, 2, 1, 3).to(torch.int32)
    else:
        b = raw.view(strips, k // 32, 4, 8, 4).to(torch.int32)  # [strip, block, c, row, byte]
        v = torch.stack((b & 15, b >> 4), dim=2).permute(0, 4, 1, 2, 3, 5)  # [strip, row, block, half, c, byte]
    return v.reshape(strips * 8, k)[:n]


def strips_rows(w: QuantizedWeight) -> torch.Tensor:
    """The 16-bit rows [N, K] of a strips-only weight, unpacked from the strips (csrc/quant_w16_avx2.h w16_prepack:
    [strip][k][16], bf16 rows 0-3, 8-11, 4-7, 12-15 in slots 0-15, float16 rows in order)."""
    n, k = w.shape
    strips = -(-n // 16)
    slots = w.panels[:strips * k * 16].view(strips, k, 16)
    if w.q.dtype == torch.bfloat16:
        slots = slots[:, :, [j & 3 | j >> 3 << 2 | (j >> 2 & 1) << 3 for j in range(16)]]
    return slots.transpose(1, 2).reshape(strips * 16, k)[:n].view(w.q.dtype)


def product_of(lib: ctypes.CDLL | None, w: QuantizedWeight, m: int) -> str:
    """The product qlinear runs for m rows of x on w (qlinear's docstring): with int8 activations "wide"
    (atomd_qgemm_wide), "amx" (atomd_qgemm_amx), "gemm" (atomd_qgemm_q8_gemm) or "rows" (atomd_qgemm_q8); a
    16-bit weight's "w16_prepacked" / "w16_panels" (atomd_qgemm_*_prepacked / _panels) or "w16_rows"
    (atomd_qgemm_b16 / _h16); an int weight's float-activation "int_rows" (atomd_qgemm_i8 / _i4); else "tiles"
    (dequantised float tiles and torch's matmul). Also layer_ops.DecodeLayer's choice for a batch's rows, so the
    fused rows compute qlinear's bits."""
    if w.strips_only:  # (held nowhere else: only the build that packed them reads them)
        if lib is None or lib.w16_panels != w.panels_layout:
            raise RuntimeError("a weight kept as an AVX2 build's strips only is read by that build only "
                               f"(${cbuild.ISA_ENV} changed after load?)")
        return "w16_prepacked" if w.bits == 16 else "q8_held"
    if lib is None:
        return "tiles"
    if w.int8_activations:
        if widens(w, m) and lib.wide:
            return "wide"
        if m >= QGEMM_AMX_MIN_M and lib.amx:
            return "amx"
        if lib.q8_gemm and m >= q8_gemm_min_m(lib, w.bits):
            return "gemm"
        if m <= QGEMM_Q8_MAX_M:
            return "rows"
    packed = w.panels is not None and w.panels_layout == lib.w16_panels  # (this build's layout)
    if w.bits == 16 and lib.w16_panels and (0 < QGEMM_W16_MIN_M <= m or (packed and 0 < QGEMM_W16_PREPACKED_MIN_M <= m)):
        per_call = lib.w16_panels == 1 and 0 < QGEMM_W16_PER_CALL_MIN_M <= m  # (AVX2: load-time ones at every m)
        return "w16_prepacked" if packed and not per_call else "w16_panels"
    if m <= QGEMM_MAX_M:
        return "w16_rows" if w.bits == 16 else "int_rows"
    return "tiles"


def q8_gemm_min_m(lib: ctypes.CDLL, bits: int) -> int:
    """The rows of x from which qlinear runs int8 activations on a weight of `bits` as `lib`'s GEMM (lib.q8_gemm:
    VNNI or AVX2)."""
    return QGEMM_VNNI_MIN_M if lib.q8_gemm == 3 else QGEMM_AVX2_GEMM_MIN_M[bits]


def _on_avx2_strips(lib: ctypes.CDLL | None, w: QuantizedWeight, x: torch.Tensor) -> bool:
    """Whether qlinear(x, w) runs on an AVX2 build's load-time strips of 16-bit w with float32 x (product
    "w16_prepacked"): where the products with the next op in their pass (qlinear_silu, qlinear_add_norm) run."""
    return (lib is not None and lib.w16_panels == 2 and w.bits == 16 and w.perm is None and x.dtype == torch.float32
            and product_of(lib, w, x.shape[0]) == "w16_prepacked")


def qlinear_silu(x: torch.Tensor, w: QuantizedWeight, lib: ctypes.CDLL | None | str = "auto") -> torch.Tensor | None:
    """silu(gate) * up of x @ w.T for a gate_up weight w [2 * inter, K] (gate rows first) in one pass over its
    load-time strips where an AVX2 build runs qlinear on them (product "w16_prepacked", inter % 16 == 0): the
    [M, inter] float32 activation with the bits of layer_ops.silu_mul(qlinear(x, w)), no [M, 2 * inter] product in
    memory (silu_mul's own pass was ~2% of a 135M prefill: RESULTS.md #35 session 28). None where it does not run
    (the caller runs those two)."""
    lib = kernels() if lib == "auto" else lib
    (n, k), m = w.shape, x.shape[0]
    if n % 32 or not _on_avx2_strips(lib, w, x):
        return None
    xf = x.contiguous()
    out = torch.empty(m, n // 2, dtype=torch.float32)
    if getattr(lib, f"atomd_qgemm_{_w16(w)}_prepacked_silu")(xf.data_ptr(), k, m, w.panels.data_ptr(), n // 2, k,
                                                             out.data_ptr(), n // 2, torch.get_num_threads()) != 0:
        raise MemoryError(f"16-bit gate_up strips of {m} x {k} by {n} rows: out of memory")
    return out


def qlinear_add_norm(x: torch.Tensor, w: QuantizedWeight, res: torch.Tensor, norm: torch.Tensor, eps: float,
                     out: torch.Tensor, lib: ctypes.CDLL | None | str = "auto") -> bool:
    """res += x @ w.T, then out = RMSNorm(res) * norm (layer_ops.rms_norm's bits with the product as its delta), in
    one call where an AVX2 build runs qlinear on w's load-time strips (product "w16_prepacked"): each block of a
    thread's rows normed while in L2, no [M, N] product to memory and back (an output projection then the next
    norm). res, out: float32 [M, N], rows contiguous. False where it does not run (the caller runs those two)."""
    lib = kernels() if lib == "auto" else lib
    (n, k), m = w.shape, x.shape[0]
    if (not (res.dtype == out.dtype == norm.dtype == torch.float32) or res.shape != (m, n) or out.shape != (m, n)
            or res.stride(1) != 1 or out.stride(1) != 1 or not norm.is_contiguous() or not _on_avx2_strips(lib, w, x)):
        return False
    xf = x.contiguous()
    if getattr(lib, f"atomd_qgemm_{_w16(w)}_prepacked_norm")(xf.data_ptr(), k, m, w.panels.data_ptr(), n, k,
                                                             res.data_ptr(), res.stride(0), norm.data_ptr(), eps,
                                                             out.data_ptr(), out.stride(0), torch.get_num_threads()) != 0:
        raise MemoryError(f"16-bit strips of {m} x {k} by {n} rows: out of memory")
    return True


def _w16(w: QuantizedWeight) -> str:
    """The kernels' name of a 16-bit weight's values: b16 (bfloat16) or h16 (float16)."""
    return "h16" if w.q.dtype == torch.float16 else "b16"


def qlinear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None = None,
            lib: ctypes.CDLL | None | str = "auto") -> torch.Tensor:
    """x [M, K] @ dequantised(w).T (+ bias) in float32, returned in x's dtype. Up to
    QGEMM_MAX_M rows the weight is dequantised in registers (atomd_qgemm_*), up to
    QGEMM_Q8_MAX_M with int8 activations (atomd_qgemm_q8), and with int8 activations on a CPU with
    AMX-INT8 any M from QGEMM_AMX_MIN_M on as tile products (atomd_qgemm_amx) (without the tiles, on a VNNI
    or AVX2 CPU: any M from q8_gemm_min_m on as a GEMM, atomd_qgemm_q8_gemm), from QGEMM_WIDE_MIN_M on
    widened to bf16 tiles where the CPU has them (atomd_qgemm_wide: bf16-rounded x and weights, not the
    int8-activation bits; not int8 weights of act blocks from QGEMM_WIDE_INT8_KEEP: `widens`); 16-bit
    weights from QGEMM_W16_MIN_M rows as packed float32 panels where the kernels have AVX-512 or AVX2
    (atomd_qgemm_b16_panels / _h16_panels), from QGEMM_W16_PREPACKED_MIN_M rows where prepack_panels packed them
    at load (atomd_qgemm_b16_prepacked / _h16_prepacked; on AVX-512 from QGEMM_W16_PER_CALL_MIN_M rows per call
    again, the same bits); more rows, or no kernels (lib None), go through float tiles of
    TILE_FLOATS (a transient buffer per call)."""
    lib = kernels() if lib == "auto" else lib
    xf = x.float()
    if w.perm is not None:
        xf = xf.index_select(1, w.perm)
    xf = xf.contiguous()
    m, (n, k) = xf.shape[0], w.shape
    threads = torch.get_num_threads()
    out = torch.empty(m, n, dtype=torch.float32)
    product = product_of(lib, w, m)
    if product == "wide":
        rc = lib.atomd_qgemm_wide(xf.data_ptr(), k, m, w.q.data_ptr(), w.bits, w.scales.data_ptr(), _ptr(w.offsets), n,
                                  k, w.group_size, out.data_ptr(), n, threads)
        if rc != 0:
            raise MemoryError(f"bf16 AMX product of {m} x {k} by {n} rows: out of memory")
    elif product == "amx":
        xt, dt, xsgt = _amx_scratch(m, k, w.group_size)
        rc = lib.atomd_qgemm_amx(xf.data_ptr(), k, m, w.q.data_ptr(), w.bits, w.scales.data_ptr(), _ptr(w.offsets), n,
                                 k, w.group_size, w.act_block, out.data_ptr(), n, xt.data_ptr(), dt.data_ptr(),
                                 xsgt.data_ptr(), threads)
        if rc != 0:
            raise MemoryError(f"AMX int8 product of {m} x {k} by {n} rows: out of memory")
    elif product == "gemm":
        xq, xd, xsg = _q8_scratch(m, k)
        rc = lib.atomd_qgemm_q8_gemm(xf.data_ptr(), k, m, w.q.data_ptr(), w.bits, w.scales.data_ptr(), _ptr(w.offsets),
                                  n, k, w.group_size, w.act_block, out.data_ptr(), n, xq.data_ptr(), xd.data_ptr(),
                                  xsg.data_ptr(), threads)
        if rc != 0:
            raise MemoryError(f"int8 GEMM of {m} x {k} by {n} rows: out of memory")
    elif product == "q8_held":
        xq, xd, xsg = _q8_scratch(m, k)
        if lib.atomd_qgemm_q8_held(xf.data_ptr(), k, m, w.panels.data_ptr(), w.bits, n, k, w.group_size, w.act_block,
                                   out.data_ptr(), n, xq.data_ptr(), xd.data_ptr(), xsg.data_ptr(), threads) != 0:
            raise RuntimeError("held int8 / int4 strips read by a build without them (not an AVX2 build)")
    elif product == "rows":
        xq, xd, xsg = _q8_scratch(m, k)
        lib.atomd_qgemm_q8(xf.data_ptr(), k, m, w.q.data_ptr(), w.bits, w.scales.data_ptr(), _ptr(w.offsets), n, k,
                           w.group_size, w.act_block, out.data_ptr(), n, xq.data_ptr(), xd.data_ptr(), xsg.data_ptr(),
                           threads)
    elif product in ("w16_prepacked", "w16_panels"):
        packed, kind = (w.panels, "prepacked") if product == "w16_prepacked" else (w.q, "panels")
        rc = getattr(lib, f"atomd_qgemm_{_w16(w)}_{kind}")(xf.data_ptr(), k, m, packed.data_ptr(), n, k,
                                                           out.data_ptr(), n, threads)
        if rc != 0:
            raise MemoryError(f"16-bit weight panels of {m} x {k} by {n} rows: out of memory")
    elif product == "w16_rows":
        getattr(lib, f"atomd_qgemm_{_w16(w)}")(xf.data_ptr(), k, m, w.q.data_ptr(), n, k, out.data_ptr(), n, threads)
    elif product == "int_rows":
        getattr(lib, f"atomd_qgemm_i{w.bits}")(xf.data_ptr(), k, m, w.q.data_ptr(), w.scales.data_ptr(),
                                               _ptr(w.offsets), n, k, w.group_size, out.data_ptr(), n, threads)
    else:
        step = max(16, TILE_FLOATS // k)
        tile = torch.empty(min(step, n), k, dtype=torch.float32)
        plain = QuantizedWeight(w.bits, w.q, w.scales, w.offsets, w.group_size, k)  # kernel column order
        for n0 in range(0, n, step):
            n1 = min(n0 + step, n)
            if lib is not None and w.bits == 16:
                getattr(lib, f"atomd_qdequant_{_w16(w)}")(w.q.data_ptr(), k, n0, n1, tile.data_ptr(), threads)
                t = tile[:n1 - n0]
            elif lib is not None:
                getattr(lib, f"atomd_qdequant_i{w.bits}")(w.q.data_ptr(), w.scales.data_ptr(), _ptr(w.offsets), k,
                                                          w.group_size, n0, n1, tile.data_ptr(), threads)
                t = tile[:n1 - n0]
            else:
                t = plain.dequantize(slice(n0, n1))
            torch.mm(xf, t.T, out=out[:, n0:n1]) if n1 - n0 == n else out[:, n0:n1].copy_(xf @ t.T)
    if bias is not None:
        out.add_(bias.float())
    return out if x.dtype == torch.float32 else out.to(x.dtype)
