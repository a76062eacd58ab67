"""Linear layers: oneDNN weight packing and the matmul that picks the batch-1 GEMV kernel
(plain weight rows) or oneDNN (packed) or F.linear, or the int8 / int4 kernels (quant.py)."""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from atomd.kernels import cbuild
from atomd.model import layer_ops
from atomd.model.quant import QuantizedWeight, gemm_bf16, gemm_bf16_f32, qlinear, kernels as quant_kernels

GEMV_ENV = "ATOMD_GEMV"  # "0": batch-1 decode through oneDNN too, no plain copies kept
GEMV_MAX_BYTES = 1 << 30  # the packed copies kept beside batch-1 decode's plain rows, at most
# a bf16 x of 2 .. AMX_MAX_ROWS rows (a batch's decode step) through a packed weight without bias on AMX
# tiles (layer_ops.linear_amx: oneDNN's bits, its packed weight read as tiles) where the CPU has them;
# False (or $ATOMD_LINEAR_AMX=0 at import): oneDNN's call (the A/B)
AMX = os.environ.get("ATOMD_LINEAR_AMX") != "0"
AMX_MAX_ROWS = 32  # from 33 rows oneDNN's AMX kernel sums in another order (other bits): its call
# a bf16 x of at least this many rows over a bf16 weight's plain rows, on a CPU with AVX512_BF16 but no AMX
# tiles (the AMD EPYC kind): quant.gemm_bf16_f32's panels (csrc/quant_w16.h; vdpbf16ps or widened float32 FMAs,
# quant.BF16_DOT), rounded to bf16 once, instead of oneDNN's brg_matmul:avx512_core_bf16 on the packed copy
# (0.63-0.66x oneDNN's own float32 there). The AMD kind emulated here (Intel Xeon with AMX narrowed, the widened
# float32 FMAs), SmolLM2-135M / Qwen3-0.6B linears, 1 and 2 threads: the panels 0.64-0.90x oneDNN bf16's time from
# 128 rows, 0.81-1.25x at 32, 1.0-3.0x at 2-16 (batch decode: oneDNN's bf16 stays there); 33-127 rows not measured
# (benchmarks/qlinear_16.py; RESULTS.md, #35 bf16 prefill on the AVX512_BF16 kind). 0 ($ATOMD_LINEAR_PANELS=0): never
BF16_PANELS_MIN_M = 0 if os.environ.get("ATOMD_LINEAR_PANELS") == "0" else 33


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, 16)  # 16: the decode batch it is tuned for


def dense(weight: torch.Tensor) -> torch.Tensor:
    """A weight as a plain tensor, packed or not."""
    return weight.to_dense() if weight.is_mkldnn else weight


def linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None,
           rows: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias); one row of x (batch-1 decode, a one-row LM head or prefill
    chunk) with the weight's plain `rows` kept: the GEMV kernel, which streams them at the
    read bandwidth (oneDNN's M = 1 path does not). Its sums run in another order than
    oneDNN's, so float32 logits of a row differ in the last bits between M = 1 and M > 1.
    A quantized weight: atomd/model/quant.py's kernels at any M. bf16 x of BF16_PANELS_MIN_M rows or more with
    the plain `rows` kept, on a CPU with AVX512_BF16 and no AMX tiles: quant.gemm_bf16_f32's panels (float32
    sums, the bias added, one rounding to bf16; without a bias quant.gemm_bf16, the same bits in one call)."""
    if isinstance(weight, QuantizedWeight):
        return qlinear(x, weight, bias)
    if rows is not None and x.shape[0] == 1:
        out = layer_ops.gemv(x, rows)
        return out if bias is None else out.add_(bias)
    if rows is not None and 0 < BF16_PANELS_MIN_M <= x.shape[0] and x.dtype == rows.dtype == torch.bfloat16 \
            and bf16_panels_run():
        if bias is None:
            return gemm_bf16(x, rows)
        return gemm_bf16_f32(x, rows).add_(bias).to(torch.bfloat16)
    if (weight.is_mkldnn and bias is None and x.dtype == weight.dtype == torch.bfloat16
            and 1 < x.shape[0] <= AMX_MAX_ROWS and AMX and reads_onednn_layout(*weight.shape, cbuild.kernel_isa())):
        out = layer_ops.linear_amx(x, weight)
        if out is not None:
            return out
    if weight.is_mkldnn or (weight is rows and onednn_runs(weight.dtype)):
        # a plain weight kept unpacked (decoder._pack_weights): oneDNN beats F.linear on it in float32 (~1.3x at M = 16)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def linear_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias) in float32, unrounded, for bf16 x and a plain bf16 weight (a TP
    worker's row-parallel partial: the all-reduce adds the workers' float32 partials and the sum
    is rounded once, as TP=1's one dot is). torch has no bf16 matmul with a float32 output on the
    CPU: quant.gemm_bf16_f32's panels where the kernels have AVX-512 (float32 sums of the exact bf16
    products; benchmarks/tp_row_parallel.py), else torch's float32 matmul on upcast copies."""
    out = gemm_bf16_f32(x, weight) if not weight.is_mkldnn else None
    if out is None:
        out = F.linear(x.float(), dense(weight).float())
    return out if bias is None else out.add_(bias)


@functools.cache
def bf16_panels_run() -> bool:
    """Whether linear() takes bf16 x of BF16_PANELS_MIN_M rows or more to quant.gemm_bf16_f32's panels: the
    kernels have AVX512_BF16 and the CPU (as $ATOMD_KERNEL_ISA narrows it) no AMX-BF16 tiles, which oneDNN's bf16
    kernel and layer_ops.linear_amx use instead."""
    lib = quant_kernels()
    return lib is not None and lib.bf16_panels and "amx_bf16" not in cbuild.narrow_flags(cbuild.cpu_flags())


@functools.cache
def onednn_runs(dtype: torch.dtype) -> bool:
    """Whether oneDNN's linear takes this dtype here (bf16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)."""
    return torch.backends.mkldnn.is_available() and (
        dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()))


@functools.cache
def reads_onednn_layout(n: int, k: int, isa: str) -> bool:
    """Whether layer_ops.linear_amx (the kernels built for `isa`) reads a bf16 weight [n, k] as
    pack_linear_weight packs it here: AMX tiles in this process, n and k multiples of 32, oneDNN's
    packed copy exactly n * k values (no padding), and the kernel's output bit-equal to oneDNN's on
    random probes of 2 and AMX_MAX_ROWS rows (the layout is oneDNN's choice for the shape and CPU:
    checked once a shape, never assumed)."""
    if not (layer_ops.has_linear_amx() and n % 32 == 0 and k % 32 == 0 and onednn_runs(torch.bfloat16)):
        return False
    g = torch.Generator().manual_seed(n * 31 + k)
    weight = pack_linear_weight(torch.randn(n, k, generator=g).to(torch.bfloat16))
    if torch.ops.mkldnn._nbytes(weight) != n * k * 2:
        return False
    for rows in (2, AMX_MAX_ROWS):
        x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
        got = layer_ops.linear_amx(x, weight)
        if got is None or not torch.equal(got, torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")):
            return False
    return True
