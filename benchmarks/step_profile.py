"""Where atomd's step time goes on a benchmark shape: cProfile over offline.py's workloads.

    nice -n 19 .venv/bin/python -m benchmarks.step_profile --model-shape qwen3-moe \\
        [--dtype bfloat16] [--quantization int8] [--threads 2] [--workloads batch1_short batch16_short] [--top 12]
        [--cpu-kind avx512-vnni]

One atomd LLM (in this process: cProfile sees the engine loop, the model's Python and every
C or torch call it makes), a warm-up, then each workload once under cProfile (`--warm`: after
one unprofiled run of it: a fresh process's first pass over a MoE's experts runs several
times slower, RESULTS.md's #34 engine benchmark). Prints, per
workload, the functions with the most self time (time not in a profiled callee: for a
ctypes kernel or a torch op, the kernel itself) as a share of the run, and the CPU seconds
of the run (this machine is shared: wall time includes waits for a core). cProfile's own
per-call overhead inflates the Python-heavy rows a little.
"""
from __future__ import annotations

import argparse
import cProfile
import pathlib
import pstats
import sys
import time



def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-shape", default="qwen3-moe")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "auto"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workloads", nargs="+", default=["batch1_short", "batch16_short"], help="names from offline.WORKLOADS")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--warm", action="store_true", help="run each workload once unprofiled first")
    p.add_argument("--quantization", choices=["int8", "int4"],
                   help="int8 / int4 weights with int8 activations (engine_compare's --int8 / --int4 engines)")
    p.add_argument("--cpu-kind", default=None, help="narrow this process to a kind of CPU (atomd.kernels.cbuild.CPU_KIND_ENV)")
    args = p.parse_args()
    import os
    from atomd.kernels import cbuild
    if args.cpu_kind and any(os.environ.get(k) != v for k, v in cbuild.CPU_KIND_ENV[args.cpu_kind].items()):
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.step_profile", *sys.argv[1:]],
                  {**os.environ, **cbuild.CPU_KIND_ENV[args.cpu_kind]})  # before torch loads oneDNN
    import atomd  # noqa: F401  (before torch: its OpenMP wait policy, atomd/__init__.py, as offline.py and the engines run)
    import torch

    from benchmarks.machine import cpu_model, loadavg
    from benchmarks.offline import WORKLOADS, atomd_generator, checkpoint, model_config, prompts
    if unknown := set(args.workloads) - set(WORKLOADS):
        p.error(f"unknown workloads {sorted(unknown)}: choose from {', '.join(WORKLOADS)}")
    torch.set_num_threads(args.threads)
    path = checkpoint(args.model_shape)
    vocab = model_config(path)["vocab_size"]
    quant = {"quantization": args.quantization, "quantized_activations": "int8"} if args.quantization else {}
    gen = atomd_generator(path, args.threads, dtype=args.dtype, **quant)
    gen(prompts(2, 16, 9, vocab), 4)  # warm-up
    print(f"{args.model_shape} atomd {args.dtype}{' ' + args.quantization if args.quantization else ''}, {args.threads} threads, {cpu_model()}, kind {args.cpu_kind or 'native'}, load {loadavg()}")
    for w in args.workloads:
        n, length, new, seed = WORKLOADS[w]
        batch = prompts(n, length, seed, vocab)
        if args.warm:
            gen(batch, new)  # the same run once unprofiled: a fresh process's first pass costs more
        prof = cProfile.Profile()
        wall, cpu = time.perf_counter(), time.process_time()
        prof.runcall(gen, batch, new)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        stats = pstats.Stats(prof)
        total = sum(row[2] for row in stats.stats.values())  # self times add up to the run
        print(f"\n{w} ({n} x {length} prompt + {new} new): wall {wall:.2f} s, CPU {cpu:.2f} s, "
              f"load {loadavg()}\n| self time | s | calls | function |\n|---:|---:|---:|---|")
        rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:args.top]
        for (file, line, name), (_, calls, self_time, _, _) in rows:
            where = f"{pathlib.Path(file).parent.name}/{pathlib.Path(file).name}:{line}" if line else file
            print(f"| {self_time / total:.1%} | {self_time:.3f} | {calls} | {name} ({where}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
