"""One int8 / int4 linear with int8 activations by rows of x on a CPU kind without AMX (issue #35): the VNNI
GEMM (csrc/quant_vnni.h) against what ran before it and against the float32 engine's linear.

    ATOMD_KERNEL_ISA=no-amx ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 flock /tmp/atomd-heavy.lock nice -n 5 \\
        .venv/bin/python -m benchmarks.qlinear_vnni --model-shape smollm-135m --ms 4 16 64 512 --threads 2

Run under a CPU kind's narrowing (atomd.kernels.cbuild.CPU_KIND_ENV: the line above is the AMD EPYC kind,
avx512-bf16; ATOMD_KERNEL_ISA=no-bf16-dot ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI the Intel AVX-512/VNNI one).
Paths: `f32` (oneDNN's packed float32 linear, the float32 engine's: torch.ops.mkldnn._linear_pointwise on a
weight reordered once), `before` (quant.qlinear with the VNNI GEMM off: the VNNI rows up to QGEMM_Q8_MAX_M,
float tiles of the dequantised weight past it), `rows` (the VNNI rows at any M; only up to --rows-max-m),
`gemm` (quant.qlinear from QGEMM_VNNI_MIN_M: the VNNI GEMM at every M here). Weights random, quantised as
--quantization does (act blocks by the group, quant.act_block_of). Per (linear, method, M): ms a call, the
median over --rounds rounds alternating the paths, each round the median of --reps calls; ratios are
f32's time over the path's (above 1: faster than float32). Prints a markdown table and the load.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from atomd.model import quant
from benchmarks.machine import loadavg, median_call_seconds
from benchmarks.model_shapes import SHAPES
from benchmarks.qlinear_m import linears


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-shape", default="smollm-135m", choices=sorted(SHAPES))
    p.add_argument("--ms", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128, 512, 2048])
    p.add_argument("--methods", nargs="+", default=["int8", "int4"])
    p.add_argument("--linears", nargs="+", default=["qkv", "o", "gate_up", "down"], help="names from linears()")
    p.add_argument("--paths", nargs="+", default=["f32", "before", "gemm"])
    p.add_argument("--rows-max-m", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    lib = quant.kernels()
    assert lib is not None and lib.q8_gemm == 3 and not lib.amx, "needs the VNNI kernels without AMX-INT8 (a CPU kind's narrowing)"
    shape = SHAPES[a.model_shape]
    print(f"load before {loadavg()}; {a.model_shape}, {a.threads} thread(s), {a.rounds} rounds x {a.reps} calls")
    results = []
    for name in a.linears:
        n, k = linears(shape)[name]
        torch.manual_seed(0)
        wf = torch.randn(n, k) * 0.02
        for method in a.methods:
            w = quant.quantize(wf, method)
            assert quant.use_int8_activations([w]) == 1
            for m in a.ms:
                x = torch.randn(m, k)
                packed = torch.ops.mkldnn._reorder_linear_weight(wf, m)
                paths = [p for p in a.paths if p != "rows" or m <= a.rows_max_m]
                times = {path: [] for path in paths}
                for _ in range(a.rounds):
                    for path in paths:
                        quant.QGEMM_VNNI_MIN_M = 1 if path == "gemm" else 1 << 30
                        quant.QGEMM_Q8_MAX_M = 1 << 30 if path == "rows" else 32
                        if path == "f32":
                            call = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
                        else:
                            call = lambda: quant.qlinear(x, w, lib=lib)  # noqa: E731
                        times[path].append(median_call_seconds(call, a.reps))
                row = {"linear": f"{name} {n}x{k}", "method": f"{method} ab{w.act_block}", "m": m,
                       **{path: statistics.median(v) * 1e3 for path, v in times.items()}}
                results.append(row)
                print(" | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()), flush=True)
    quant.QGEMM_VNNI_MIN_M, quant.QGEMM_Q8_MAX_M = 1 << 30, 32
    print(f"load after {loadavg()}")
    ratios = [p for p in a.paths if p != "f32"]
    print("\n| linear | method | M | " + " | ".join(f"{p} ms" for p in a.paths) + " | "
          + " | ".join(f"{p} vs f32" for p in ratios) + " |")
    print("|---|---|---:|" + "---:|" * (len(a.paths) + len(ratios)))
    for r in results:
        cell = lambda p: f"{r[p]:.3f}" if p in r else "-"  # noqa: E731
        ratio = lambda p: f"{r['f32'] / r[p]:.2f}x" if p in r and "f32" in r else "-"  # noqa: E731
        print(f"| {r['linear']} | {r['method']} | {r['m']} | " + " | ".join(cell(p) for p in a.paths) + " | "
              + " | ".join(ratio(p) for p in ratios) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
