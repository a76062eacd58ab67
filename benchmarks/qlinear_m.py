"""One int8 / int4 linear (atomd.model.quant.qlinear, int8 activations) by rows of x, per kernel path, on a
model shape's linears (issue #35): where the bf16-widened tiles (QGEMM_WIDE_MIN_M) and the AMX-INT8 tiles
belong, against torch's bf16 linear (oneDNN) of the same shape.

    flock /tmp/atomd-heavy.lock nice -n 5 .venv/bin/python -m benchmarks.qlinear_m --model-shape qwen3-0.6b \\
        --ms 1 16 64 128 256 512 2048 --rounds 3 --threads 1

Paths: `int8-tiles` (QGEMM_WIDE_MIN_M off: the AMX-INT8 tiles from QGEMM_AMX_MIN_M rows, the VNNI rows
below; act blocks by the weight, quant.act_block_of), `int8-tiles-b32` (the same with act blocks of 32: the
contract before #35's act block, each 32 inputs' tile result stored and rescaled), `wide` (every weight, int8
act blocks of 256 too: quant.QGEMM_WIDE_INT8_KEEP off) (every M >= 1 through atomd_qgemm_wide), `bf16` (torch.nn.functional.linear on the
dequantised weight in bf16). Weights are random, quantised as --quantization does; each call takes the
next of enough copies of the weight to pass --pool-mb (the decode case: weights streamed from memory, not
L2 / L3). Per (linear, method, M): ms a call, median over --rounds rounds alternating the paths, each
round the median of --reps calls. Prints a markdown table and the load (/proc/loadavg) before / after.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.machine import loadavg
from benchmarks.model_shapes import SHAPES
from atomd.model import quant


def linears(shape: dict) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the shape's layer linears (q / k / v fused, gate / up fused) and the LM head"""
    h, heads, kv, d = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    inter = shape["intermediate_size"]
    return {"qkv": ((heads + 2 * kv) * d, h), "o": (h, heads * d), "gate_up": (2 * inter, h), "down": (h, inter),
            "lm_head": (shape["vocab_size"], h)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--ms", type=int, nargs="+", default=[1, 16, 64, 512])
    p.add_argument("--methods", nargs="+", default=["int8", "int4"])
    p.add_argument("--linears", nargs="+", default=None, help="names from linears() (default: all)")
    p.add_argument("--paths", nargs="+", default=["int8-tiles", "wide", "bf16"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--pool-mb", type=int, default=600)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    lib = quant.kernels()
    assert lib is not None and lib.amx, "needs the AMX-INT8 kernels"
    if "wide" in a.paths:
        assert lib.wide, "needs the bf16 AMX tiles (atomd_quant_wide)"
    shape = SHAPES[a.model_shape]
    names = a.linears or list(linears(shape))
    print(f"load before {loadavg()}; {a.model_shape}, {a.threads} thread(s), {a.rounds} rounds x {a.reps} calls")
    rows = []
    for name in names:
        n, k = linears(shape)[name]
        for method in a.methods:
            torch.manual_seed(0)
            w = quant.quantize(torch.randn(n, k) * 0.02, method)
            w.int8_activations = True
            copies = max(1, min(64, (a.pool_mb << 20) // max(1, w.nbytes())))
            pool = [w] + [quant.QuantizedWeight(w.bits, w.q.clone(), w.scales.clone(),
                                                None if w.offsets is None else w.offsets.clone(), w.group_size,
                                                w.in_features, int8_activations=True) for _ in range(copies - 1)]
            wb = w.dequantize().to(torch.bfloat16) if "bf16" in a.paths else None
            bpool = [wb] + [wb.clone() for _ in range(max(0, min(copies, (a.pool_mb << 20) // (2 * n * k)) - 1))] \
                if wb is not None else []
            for m in a.ms:
                x = torch.randn(m, k).to(torch.bfloat16)
                times = {path: [] for path in a.paths}
                turn = 0
                for _ in range(a.rounds):
                    for path in a.paths:
                        quant.QGEMM_WIDE_MIN_M = {"int8-tiles": 0, "wide": 1}.get(path, 0)
                        quant.QGEMM_WIDE_INT8_KEEP = 1 << 30  # "wide": every weight widened
                        for q in pool:
                            q.act_block = quant.Q8_BLOCK if path == "int8-tiles-b32" else quant.act_block_of(q.group_size)
                        calls = []
                        for _ in range(a.reps + 1):
                            turn += 1
                            t0 = time.perf_counter()
                            if path == "bf16":
                                torch.nn.functional.linear(x, bpool[turn % len(bpool)])
                            else:
                                quant.qlinear(x, pool[turn % len(pool)], lib=lib)
                            calls.append(time.perf_counter() - t0)
                        times[path].append(statistics.median(calls[1:]))
                row = {"linear": f"{name} {n}x{k}", "method": method, "m": m,
                       **{path: statistics.median(v) * 1e3 for path, v in times.items()}}
                rows.append(row)
                print(" | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()), flush=True)
            del pool, bpool
    print(f"load after {loadavg()}")
    # the speed-up: of the act blocks over blocks of 32 where both ran, else of the widened tiles over the int8 tiles
    fast, slow = ("int8-tiles", "int8-tiles-b32") if "int8-tiles-b32" in a.paths else ("wide", "int8-tiles")
    print("\n| linear | method | M | " + " | ".join(f"{p} ms" for p in a.paths) + f" | {slow} / {fast} |")
    print("|---|---|---:|" + "---:|" * (len(a.paths) + 1))
    for r in rows:
        ratio = r[slow] / r[fast] if slow in r and fast in r else float("nan")
        print(f"| {r['linear']} | {r['method']} | {r['m']} | " + " | ".join(f"{r[p]:.3f}" for p in a.paths)
              + f" | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
