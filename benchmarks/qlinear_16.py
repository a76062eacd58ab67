"""One 16-bit-weight linear (`--quantization bf16 / fp16` with float32 compute: atomd.model.quant.qlinear) by
rows of x, per path, against the float32 engine's linear of the same shape (oneDNN on the weight packed at
load, atomd.model.linear): where the packed panels (csrc/quant_w16.h, quant.QGEMM_W16_MIN_M) belong (#35).

    flock /tmp/atomd-heavy.lock nice -n 5 env ATOMD_KERNEL_ISA=no-bf16-dot ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI \\
        .venv/bin/python -m benchmarks.qlinear_16 --model-shape smollm-135m --ms 32 128 512 2048 --threads 2

(`--cpu-kind avx512-vnni` sets those two variables itself, as engine_compare does.)
Paths: `f32` (oneDNN, float32 weight packed as the engine packs it), `prepacked` (atomd_qgemm_b16_prepacked /
_h16_prepacked on the weight's panels packed once, quant.prepack_panels, at any M), `panels` (atomd_qgemm_b16_panels /
_h16_panels, packed each call, at any M), `before` (the path without them: up to quant.QGEMM_MAX_M rows the weight widened in
registers, atomd_qgemm_b16; past it widened into float32 tiles of quant.TILE_FLOATS for torch.mm, still the path
where the CPU has no AVX-512). bf16 compute (the AVX512_BF16 kind's `--dtype auto`, #35): `bf16` (oneDNN, bf16
weight packed as the engine packs it), `bf16-panels` and `bf16-widened` (csrc/quant_w16.h's panels over the plain
bf16 rows, quant.gemm_bf16_f32 by vdpbf16ps or by float32 FMAs on widened operands, rounded to bf16 as linear.linear
routes bf16 prefill where the CPU has no AMX tiles):

    flock /tmp/atomd-heavy.lock nice -n 5 .venv/bin/python -m benchmarks.qlinear_16 --cpu-kind avx512-bf16 \
        --paths f32 bf16 bf16-panels bf16-widened --ms 2 8 16 32 128 512 2048 --threads 2

`bf16-rounded`: quant.gemm_bf16, the widened panels with x widened and the sums rounded inside the call (what
linear.linear runs there without a bias). The whole weight widened once a call into a float32 buffer (atomd_qdequant_*,
all rows; #35 session 15's test of "the float32 engine's own GEMM plus an O(N K) widening"): `widen-mm` then torch.mm
(MKL), `widen-dnn` then oneDNN's linear on the plain buffer (kept between calls; `widen-dnn-new`: a new one each call),
and for bf16 x `bf16-f32dnn` (x widened by torch, oneDNN float32 on the widened weight, rounded once).

Weights random; per (linear, M): ms a call,
median over --rounds rounds alternating the paths, each round the median of --reps calls. Prints a markdown
table (each path's time over f32's: > 1 slower) and the load (/proc/loadavg) before / after.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

PATHS = ("f32", "prepacked", "panels", "before", "bf16", "bf16-panels", "bf16-widened", "widen-mm", "widen-dnn",
         "widen-dnn-new", "bf16-f32dnn", "bf16-rounded")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-shape", default="smollm-135m")
    p.add_argument("--ms", type=int, nargs="+", default=[32, 128, 512, 2048])
    p.add_argument("--format", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--linears", nargs="+", default=["qkv", "gate_up", "down"], help="names from qlinear_m.linears()")
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cpu-kind", default=None, help="narrow this process to a kind of CPU (atomd.kernels.cbuild.CPU_KIND_ENV)")
    a = p.parse_args()
    from atomd.kernels import cbuild
    if a.cpu_kind and any(os.environ.get(k) != v for k, v in cbuild.CPU_KIND_ENV[a.cpu_kind].items()):
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.qlinear_16", *sys.argv[1:]],
                  {**os.environ, **cbuild.CPU_KIND_ENV[a.cpu_kind]})  # before torch loads oneDNN
    import torch

    from atomd.model import quant
    from atomd.model.linear import linear, pack_linear_weight
    from benchmarks.machine import loadavg, median_call_seconds

    def onednn(x, w):  # oneDNN's linear itself (linear.linear takes the panels for bf16 prefill where they win)
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    from benchmarks.model_shapes import SHAPES
    from benchmarks.qlinear_m import linears

    torch.set_num_threads(a.threads)
    lib = quant.kernels()
    if {"panels", "prepacked"} & set(a.paths):
        assert lib is not None and lib.w16_panels, "needs the AVX-512 or AVX2 quant kernels (atomd_quant_w16_panels)"
    if "bf16-panels" in a.paths:
        assert lib is not None and lib.bf16_panels, "needs the AVX512_BF16 quant kernels (atomd_quant_bf16_panels)"
    shape = SHAPES[a.model_shape]
    isa = cbuild.kernel_isa()
    print(f"load before {loadavg()}; {a.model_shape}, {a.format}, {a.threads} thread(s), kernels {isa}, "
          f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '-')}, {a.rounds} rounds x {a.reps} calls")
    rows = []
    for name in a.linears:
        n, k = linears(shape)[name]
        torch.manual_seed(0)
        w = torch.randn(n, k) * 0.02
        qw = quant.quantize(w, a.format)
        packed = pack_linear_weight(qw.dequantize())  # the float32 engine's weight (same values)
        prepacked = qw.panels if quant.prepack_panels(qw, lib) else None
        wb = qw.dequantize().to(torch.bfloat16)  # the bf16 engine's weight: plain rows, and packed
        packed_bf16 = pack_linear_weight(wb) if "bf16" in a.paths else None
        wide = torch.empty(n, k)  # widen-*: the whole weight widened each call into a buffer kept between calls
        w16 = "h16" if qw.q.dtype == torch.float16 else "b16"
        widen = getattr(lib, f"atomd_qdequant_{w16}") if lib is not None else None

        def widened(buf=None):
            buf = torch.empty(n, k) if buf is None else buf
            widen(qw.q.data_ptr(), k, 0, n, buf.data_ptr(), a.threads)
            return buf

        def bf16_f32dnn(xb):  # bf16 x and the bf16 weight widened, oneDNN float32 on the plain weight, one rounding
            return onednn(xb.float(), widened(wide)).to(torch.bfloat16)
        for m in a.ms:
            x = torch.randn(m, k)
            xb = x.to(torch.bfloat16)
            calls = {"f32": lambda: linear(x, packed), "bf16": lambda: onednn(xb, packed_bf16),
                     "bf16-panels": lambda: quant.gemm_bf16_f32(xb, wb, lib, True).to(torch.bfloat16),
                     "bf16-widened": lambda: quant.gemm_bf16_f32(xb, wb, lib, False).to(torch.bfloat16),
                     "widen-mm": lambda: torch.mm(x, widened(wide).T), "widen-dnn": lambda: onednn(x, widened(wide)),
                     "widen-dnn-new": lambda: onednn(x, widened()), "bf16-f32dnn": lambda: bf16_f32dnn(xb),
                     "bf16-rounded": lambda: quant.gemm_bf16(xb, wb, lib, False)}
            times = {path: [] for path in a.paths}
            for _ in range(a.rounds):
                for path in a.paths:
                    quant.QGEMM_W16_MIN_M = 1 if path in ("panels", "prepacked") else 0
                    qw.panels = prepacked if path == "prepacked" else None
                    times[path].append(median_call_seconds(calls.get(path, lambda: quant.qlinear(x, qw, lib=lib)), a.reps))
            row = {"linear": f"{name} {n}x{k}", "m": m, **{path: statistics.median(v) * 1e3 for path, v in times.items()}}
            rows.append(row)
            print(" | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()), flush=True)
    print(f"load after {loadavg()}")
    others = [path for path in a.paths if path != "f32"]
    print("\n| linear | M | " + " | ".join(f"{path} ms" for path in a.paths)
          + "".join(f" | {path} / f32" for path in others if "f32" in a.paths) + " |")
    print("|---|---:|" + "---:|" * (len(a.paths) + len(others) * ("f32" in a.paths)))
    for r in rows:
        ratios = "".join(f" | {r[path] / r['f32']:.2f}x" for path in others if "f32" in a.paths)
        print(f"| {r['linear']} | {r['m']} | " + " | ".join(f"{r[path]:.3f}" for path in a.paths) + ratios + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
