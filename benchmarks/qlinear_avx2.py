"""Where an AVX2-only CPU's quantized linears should leave the rows in registers for dequantised float32
tiles and torch's GEMM (issue #35: "batch 16 and prefill must not fall off a cliff ... measure"). The
thresholds quant.QGEMM_Q8_MAX_M (int8 / int4 weights, int8 activations) and QGEMM_MAX_M (16-bit weights)
were measured on AVX-512 CPUs, whose rows run VNNI / 16-wide FMAs; AVX2's rows (vpmaddwd, 8 wide) cost
more a row.

    flock /tmp/atomd-heavy.lock nice -n 5 .venv/bin/python -m benchmarks.qlinear_avx2 --model-shape smollm-135m \\
        --ms 1 2 4 8 16 32 --threads 2

Per (linear, format, M): `rows` (qlinear as it is: atomd_qgemm_q8 up to QGEMM_Q8_MAX_M rows, the 16-bit
rows atomd_qgemm_b16 up to QGEMM_MAX_M), `rows-f` (int8 / int4 weights' rows with float32 activations,
atomd_qgemm_i8 / _i4, at any M; for bf16 the same as rows),
`tiles` (the same weight dequantised into float32 tiles, torch.mm: qlinear with both thresholds 0), and
`float32` (the engine's float32 linear on the oneDNN-packed weight: the baseline). Each call takes the next
of enough copies of the weight to pass --pool-mb (weights streamed from memory, as in decode). ms a call,
median over --rounds rounds alternating the paths, each round the median of --reps calls; load before / after.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from atomd.model import quant
from atomd.model.linear import linear, pack_linear_weight
from benchmarks.machine import loadavg
from benchmarks.model_shapes import SHAPES
from benchmarks.qlinear_m import linears


def weights(n: int, k: int, fmt: str, copies: int) -> list:
    out = []
    for i in range(copies):
        w = torch.randn(n, k, generator=torch.Generator().manual_seed(i)) * 0.05
        if fmt == "float32":
            out.append(pack_linear_weight(w))
            continue
        q = quant.quantize(w, fmt)
        if fmt in ("int8", "int4"):
            quant.use_int8_activations([q])
        out.append(q)
    return out


def timed(fn, ws: list, x: torch.Tensor, reps: int) -> float:
    times = []
    for r in range(reps):
        t = time.perf_counter()
        fn(x, ws[r % len(ws)])
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-shape", default="smollm-135m", choices=sorted(SHAPES))
    p.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--formats", nargs="+", default=["int8", "int4", "bf16"])
    p.add_argument("--linears", nargs="+", default=["qkv", "o", "gate_up", "down"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pool-mb", type=int, default=256)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    lib = quant.kernels()
    print(f"kernel path {quant.PATHS[lib.atomd_quant_path()]}, threads {a.threads}, load {loadavg()}")
    print("| linear | format | M | rows ms | rows-f ms | tiles ms | float32 ms | best / float32 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    shape = SHAPES[a.model_shape]
    rows_m = (quant.QGEMM_Q8_MAX_M, quant.QGEMM_MAX_M)
    for name in a.linears:
        n, k = linears(shape)[name]
        copies = max(2, a.pool_mb * 2 ** 20 // (n * k * 4))
        floats = weights(n, k, "float32", copies)
        for fmt in a.formats:
            ws = weights(n, k, fmt, copies)
            for m in a.ms:
                x = torch.randn(m, k)
                got = {"rows": [], "rows-f": [], "tiles": [], "float32": []}
                for _ in range(a.rounds):
                    quant.QGEMM_Q8_MAX_M, quant.QGEMM_MAX_M = rows_m
                    got["rows"].append(timed(quant.qlinear, ws, x, a.reps))
                    quant.QGEMM_Q8_MAX_M, quant.QGEMM_MAX_M = 0, max(m, rows_m[1])
                    got["rows-f"].append(timed(quant.qlinear, ws, x, a.reps))
                    quant.QGEMM_Q8_MAX_M, quant.QGEMM_MAX_M = 0, 0
                    got["tiles"].append(timed(quant.qlinear, ws, x, a.reps))
                    got["float32"].append(timed(linear, floats, x, a.reps))
                quant.QGEMM_Q8_MAX_M, quant.QGEMM_MAX_M = rows_m
                r, rf, t, f = (statistics.median(got[k]) for k in ("rows", "rows-f", "tiles", "float32"))
                print(f"| {name} | {fmt} | {m} | {r:.3f} | {rf:.3f} | {t:.3f} | {f:.3f} | {min(r, rf, t) / f:.2f} |",
                      flush=True)
    print(f"load {loadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
