"""Multiply-adds a second of one core's zmm vdpbf16ps (AVX512_BF16: 32 bf16 products summed into 16 float32
lanes) against vfmadd231ps (16 float32 multiply-adds), each as --chains independent accumulator chains in
registers, no memory: which instruction quant.gemm_bf16_f32 should run on this CPU (quant.BF16_DOT; #35).

    .venv/bin/python -m benchmarks.dot_rate --rounds 3

Prints GMAC/s of each and their ratio (> 1: vdpbf16ps does more multiply-adds a second), per round alternating,
medians, and the load before / after. Needs a C compiler and a CPU with AVX512_BF16.
"""
from __future__ import annotations

import argparse
import ctypes
import pathlib
import statistics
import subprocess
import tempfile

from atomd.kernels import cbuild
from benchmarks.machine import cpu_model, loadavg

SOURCE = r"""
#include <immintrin.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define CHAINS(N, BODY) for (long it = 0; it < iters; it++) { _Pragma("GCC unroll 32") for (int i = 0; i < N; i++) BODY; \
                                                              __asm__ volatile("" : "+v"(a)); }
double fma_rate(long iters, float *sink) {  /* GMAC/s */
    __m512 c[CHAINS_N], a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(0.9999f);
    for (int i = 0; i < CHAINS_N; i++) c[i] = _mm512_set1_ps(i * 1e-3f);
    double t = now();
    CHAINS(CHAINS_N, c[i] = _mm512_fmadd_ps(a, b, c[i]))
    t = now() - t;
    for (int i = 1; i < CHAINS_N; i++) c[0] = _mm512_add_ps(c[0], c[i]);
    *sink = _mm512_reduce_add_ps(c[0]);
    return (double)iters * CHAINS_N * 16 / t / 1e9;
}
double dot_rate(long iters, float *sink) {
    __m512 c[CHAINS_N];
    __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = a;
    for (int i = 0; i < CHAINS_N; i++) c[i] = _mm512_set1_ps(i * 1e-3f);
    double t = now();
    CHAINS(CHAINS_N, c[i] = _mm512_dpbf16_ps(c[i], a, b))
    t = now() - t;
    for (int i = 1; i < CHAINS_N; i++) c[0] = _mm512_add_ps(c[0], c[i]);
    *sink = _mm512_reduce_add_ps(c[0]);
    return (double)iters * CHAINS_N * 32 / t / 1e9;
}
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chains", type=int, default=24)
    p.add_argument("--iters", type=int, default=20_000_000)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    compiler, name = cbuild.find_compiler()
    if compiler is None:
        raise SystemExit(f"no C compiler ({name})")
    with tempfile.TemporaryDirectory() as tmp:
        src, lib_path = pathlib.Path(tmp, "dot_rate.c"), pathlib.Path(tmp, "dot_rate.so")
        src.write_text(SOURCE)
        subprocess.run([compiler, "-O2", "-march=native", "-fPIC", "-shared", f"-DCHAINS_N={a.chains}", str(src),
                        "-o", str(lib_path)], check=True)
        lib = ctypes.CDLL(str(lib_path))
    for fn in (lib.fma_rate, lib.dot_rate):
        fn.argtypes, fn.restype = [ctypes.c_long, ctypes.POINTER(ctypes.c_float)], ctypes.c_double
    sink = ctypes.c_float()
    print(f"{cpu_model()}; load before {loadavg()}; {a.chains} chains, {a.rounds} rounds")
    fma, dot = [], []
    for _ in range(a.rounds):
        fma.append(lib.fma_rate(a.iters, ctypes.byref(sink)))
        dot.append(lib.dot_rate(a.iters, ctypes.byref(sink)))
        print(f"vfmadd231ps {fma[-1]:.1f} GMAC/s, vdpbf16ps {dot[-1]:.1f} GMAC/s, ratio {dot[-1] / fma[-1]:.2f}")
    f, d = statistics.median(fma), statistics.median(dot)
    print(f"median: vfmadd231ps {f:.1f}, vdpbf16ps {d:.1f} GMAC/s, vdpbf16ps / vfmadd231ps {d / f:.2f}x; "
          f"load after {loadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
