"""`--dtype auto` on a CPU without bf16 dot products (issue #35): what auto picks there (float32
compute, the weights read as bf16: `--quantization bf16`) against float32 and bfloat16, same run.

This machine may have AVX512_BF16; the CPU kind the choice is for is then emulated, for every
engine alike: ATOMD_KERNEL_ISA=no-bf16-dot (atomd's kernels and its CPU flags without bf16 dot
products, so auto resolves as it would there) and ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI (torch's
oneDNN without bf16 instructions). The emulation picks the same code paths as such a CPU; its
memory system and clocks are this machine's.

One child process per engine (loaded once), alternating round by round; per workload the
engine's CPU seconds (time.process_time: the load of a shared machine inflates wall time, not
CPU time) and wall time. Workloads (offline.py's): batch 1 (128-token prompt, 32 new tokens; its
decode alone = that run less a 1-token run), one 512-token prefill.

    nice -n 19 .venv/bin/python -m benchmarks.dtype_auto --model-shape smollm-135m --rounds 3 [--threads 1]
        [--float16]   # the checkpoint written as float16 first: auto then reads fp16 weights
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.machine import cpu_model, loadavg

ENGINES = {"float32": {"dtype": "float32"}, "auto": {"dtype": "auto"}, "bfloat16": {"dtype": "bfloat16"}}
EMULATED = {"ATOMD_KERNEL_ISA": "no-bf16-dot", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}
WORKLOADS = ("batch1_short", "batch1_short_first", "prefill_1x512")


def float16_copy(path, dest):
    """`path`'s checkpoint with its tensors as float16 (config.json saying so) in `dest`."""
    import shutil

    from safetensors.torch import load_file, save_file

    dest.mkdir(parents=True, exist_ok=True)
    for f in path.iterdir():
        if f.suffix == ".safetensors":
            save_file({k: v.half() for k, v in load_file(f).items()}, dest / f.name, metadata={"format": "pt"})
        elif f.name == "config.json":
            (dest / f.name).write_text(json.dumps({**json.loads(f.read_text()), "torch_dtype": "float16"}))
        elif f.is_file():
            shutil.copy(f, dest / f.name)
    return dest


def child(shape: str, engine: str, threads: int, half: bool) -> None:
    """Load one engine, then one round of WORKLOADS per line on stdin, a JSON line per round."""
    import tempfile
    import pathlib

    from atomd.config import EngineConfig
    from benchmarks.offline import WORKLOADS as SPECS, atomd_generator, checkpoint, model_config, prompts

    tmp = pathlib.Path(tempfile.mkdtemp())
    path = checkpoint(shape, tmp)
    if half:
        path = float16_copy(path, tmp / "float16")
    resolved = EngineConfig(model=str(path), **ENGINES[engine])  # what auto chose, for the report
    gen = atomd_generator(path, threads, dtype=resolved.dtype, quantization=resolved.quantization)
    vocab = model_config(path)["vocab_size"]
    gen(prompts(2, 16, 9, vocab), 4)  # warm-up
    print(json.dumps({"ready": True, "dtype": resolved.dtype, "quantization": resolved.quantization}), flush=True)
    for _ in sys.stdin:
        out = {}
        for w in WORKLOADS:
            n, length, new, seed = SPECS[w]
            batch = prompts(n, length, seed, vocab)
            cpu, wall = time.process_time(), time.perf_counter()
            gen(batch, new)
            out[w] = {"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall}
        print(json.dumps(out), flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model-shape", default="smollm-135m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--float16", action="store_true", help="run a float16 copy of the checkpoint")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.model_shape, args.child, args.threads, args.float16)
        return 0
    env = {**os.environ, **EMULATED}
    procs, chosen = {}, {}
    for name in ENGINES:
        procs[name] = subprocess.Popen([sys.executable, "-m", "benchmarks.dtype_auto", "--model-shape", args.model_shape,
                                        "--threads", str(args.threads), "--child", name,
                                        *(["--float16"] if args.float16 else [])],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        chosen[name] = json.loads(procs[name].stdout.readline())
    load = [loadavg()]
    runs = {name: [] for name in ENGINES}
    try:
        for r in range(args.rounds):
            for name in (list(ENGINES)[r % 3:] + list(ENGINES)[:r % 3]):  # rotating order
                procs[name].stdin.write("go\n")
                procs[name].stdin.flush()
                runs[name].append(json.loads(procs[name].stdout.readline()))
            load.append(loadavg())
            print(f"round {r + 1}/{args.rounds} (load {load[-1]})", file=sys.stderr, flush=True)
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait(60)

    def per_token(run: dict, key: str) -> dict[str, float]:
        decode = (run["batch1_short"][key] - run["batch1_short_first"][key]) / 31  # tokens 2..32
        return {"decode_ms": 1e3 * decode, "prefill_ms": 1e3 * run["prefill_1x512"][key] / 512}

    print(f"CPU: {cpu_model()}, emulated {EMULATED}, threads {args.threads}, shape {args.model_shape}, "
          f"{'float16 checkpoint, ' if args.float16 else ''}load {min(load)}-{max(load)}")
    print("| engine (resolved) | decode CPU ms/token | prefill CPU ms/token | decode wall ms | prefill wall ms |")
    print("|---|---:|---:|---:|---:|")
    med = {}
    for name in ENGINES:
        cpu = [per_token(run, "cpu_s") for run in runs[name]]
        wall = [per_token(run, "wall_s") for run in runs[name]]
        med[name] = {k: statistics.median(c[k] for c in cpu) for k in cpu[0]}
        mw = {k: statistics.median(c[k] for c in wall) for k in wall[0]}
        what = f"{chosen[name]['dtype']}" + (f" + {chosen[name]['quantization']} weights"
                                             if chosen[name]["quantization"] else "")
        print(f"| {name} ({what}) | {med[name]['decode_ms']:.2f} | {med[name]['prefill_ms']:.3f} | "
              f"{mw['decode_ms']:.2f} | {mw['prefill_ms']:.3f} |")
    for name in ("auto", "bfloat16"):
        print(f"{name} vs float32 (CPU time, speed): decode {med['float32']['decode_ms'] / med[name]['decode_ms']:.2f}x, "
              f"prefill {med['float32']['prefill_ms'] / med[name]['prefill_ms']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
