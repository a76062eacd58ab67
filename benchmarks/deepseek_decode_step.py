"""CPU time per decode step, before / after a kernel (issue #37), on a benchmarks/model_shapes.py shape.

One engine per shape (random weights, --dtype, --threads); its decode steps' model forwards
(ModelRunner.execute on a batch of one token per sequence) are timed in the calling thread's
CPU time (time.thread_time: at one thread the whole forward, and the machine's load moves it
far less than the wall clock), in the process's (time.process_time: every OpenMP thread,
spin included) and in wall time (at 2 threads what a step takes when both cores are free), all reported. Workloads: batch 1 (one 128-token prompt, 32 new tokens) and
batch 16 (16 prompts of 32 tokens, 32 new). Variants, alternating within every round, switched
in the running engine (the same weights, the same prompts):
- mla: `torch` (the absorption and W_UV as torch bmm around the attention kernel) vs `c`
  (csrc/mla.c, one call a layer); DeepSeek shapes only;
- mla-amx: csrc/mla.c's `avx512` path (mla.AMX off) vs its AMX `tiles` (bf16, 4 or more rows:
  batch 16; an AMX CPU);
- moe: `loop` (one torch linear pair per active expert, moe.GROUPED and moe.AMX off) vs `grouped`
  (the MoE block's experts in one C call, layer_ops.moe_grouped);
- layer: `perop` (the batch-1 layer as ~30 Python-level calls, deepseek.FUSED off) vs `c`
  (deepseek.MlaDecodeLayers: three C calls a layer);
- rows: `perop` (a decode batch's glue between the linears as torch ops, deepseek.ROWS off) vs `c`
  (deepseek.MlaRows: the head's RoPE / norm / latent store and the routed experts one C call each);
- linear-amx: `onednn` (a batch's bf16 linears through oneDNN's call, linear.AMX off) vs `tiles`
  (layer_ops.linear_amx on oneDNN's packed weights: the same bits; an AMX CPU).
Each variant's figure: its mean per decode step in one run, medians over --rounds.
`--llama-cpp`: llama-bench's tg128 at depth 128 on the shape's BF16 GGUF (the same checkpoint,
benchmarks/decode_step_profile.py's llama_bench: its CPU time per token, comparable to the
thread CPU time at one thread) in every round after the variants; the ratio llama.cpp ms /
atomd ms per decode token (> 1: atomd faster).

    flock /tmp/atomd-heavy.lock .venv/bin/python -m benchmarks.deepseek_decode_step \\
        --model-shape deepseek-v2-lite --dtype bfloat16 --rounds 3 --threads 1 --switch mla
"""
from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import statistics
import sys
import time

import torch

from atomd.llm import LLM
from atomd.model import deepseek, linear, mla, moe
from benchmarks.machine import cpu_model, loadavg
from benchmarks.model_shapes import SHAPES, model_dir
from benchmarks.offline import prompts
from contracts.sampling import SamplingParams

WORKLOADS = {"batch1": (1, 128, 32), "batch16": (16, 32, 32)}  # sequences, prompt tokens, new tokens


@contextlib.contextmanager
def switched(module, **values):
    """The module's attributes set to `values` while inside, restored after."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def variant(switch: str, name: str):
    """The engine's code path for `name` of `switch` while inside."""
    if switch == "mla" and name == "torch":
        return switched(mla, fused_decode_kernels=lambda *args: None)
    if switch == "mla-amx" and name == "avx512":
        return switched(mla, AMX=False)
    if switch == "layer" and name == "perop":
        return switched(deepseek, FUSED=False)
    if switch == "rows" and name == "perop":
        return switched(deepseek, ROWS=False)
    if switch == "linear-amx" and name == "onednn":
        return switched(linear, AMX=False)
    if switch == "moe" and name == "loop":
        return switched(moe, GROUPED=False, AMX=False)
    return contextlib.nullcontext()


VARIANTS = {"mla": ("torch", "c"), "mla-amx": ("avx512", "tiles"), "moe": ("loop", "grouped"), "layer": ("perop", "c"), "rows": ("perop", "c"),
            "linear-amx": ("onednn", "tiles")}


def timed_decode_steps(llm: LLM, batch: list[list[int]], new: int) -> tuple[float, float, int, float]:
    """(thread CPU s, process CPU s, steps, wall s) of the decode steps' forwards of one generate."""
    runner = llm.engine.runner
    execute, spent = runner.execute, [0.0, 0.0, 0, 0.0]

    def timed(step, *args, **kwargs):
        if not all(int(n) == 1 for n in step.num_scheduled_tokens):
            return execute(step, *args, **kwargs)
        t0, p0, w0 = time.thread_time(), time.process_time(), time.perf_counter()
        out = execute(step, *args, **kwargs)
        spent[0] += time.thread_time() - t0
        spent[1] += time.process_time() - p0
        spent[2] += 1
        spent[3] += time.perf_counter() - w0
        return out

    runner.execute = timed
    try:
        llm.generate([{"prompt_token_ids": p} for p in batch],
                     SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:
        runner.execute = execute
    return spent[0], spent[1], spent[2], spent[3]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-shape", default="deepseek-v2-lite", choices=list(SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--switch", default="mla", choices=list(VARIANTS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workloads", default="batch1,batch16")
    ap.add_argument("--json", help="write the figures here too")
    ap.add_argument("--llama-cpp", action="store_true", help="llama-bench tg128 (BF16 GGUF) in every round")
    ap.add_argument("--gguf-dir", type=pathlib.Path, default=None, help="keep (and reuse) the GGUF here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load = [loadavg()]
    llm = LLM(str(model_dir(args.model_shape)), dtype=args.dtype, num_threads=args.threads, max_model_len=512)
    vocab = llm.engine.model.config.vocab_size
    names = VARIANTS[args.switch]
    workloads = args.workloads.split(",")
    gguf = None
    if args.llama_cpp:
        from benchmarks.decode_step_profile import ggufs, llama_bench
        binary, files = ggufs(model_dir(args.model_shape), ["bfloat16"], args.threads, args.gguf_dir)
        gguf = files["BF16"]
    with variant(args.switch, names[0]):  # warm: every path's first pass over the weights
        for w in workloads:
            timed_decode_steps(llm, prompts(WORKLOADS[w][0], WORKLOADS[w][1], 99, vocab), 4)
    timed_decode_steps(llm, prompts(1, 16, 98, vocab), 4)
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        for w in workloads:
            n, length, new = WORKLOADS[w]
            batch = prompts(n, length, r, vocab)
            for name in names if r % 2 == 0 else names[::-1]:
                with variant(args.switch, name):
                    thread_s, process_s, steps, wall_s = timed_decode_steps(llm, batch, new)
                runs.setdefault((w, name), []).append((thread_s / steps * 1e3, process_s / steps * 1e3,
                                                       wall_s / steps * 1e3))
                print(f"round {r} {w} {name}: {thread_s / steps * 1e3:.2f} ms thread CPU, "
                      f"{process_s / steps * 1e3:.2f} ms process CPU, {wall_s / steps * 1e3:.2f} ms wall a step "
                      f"({steps} steps), load {loadavg()}",
                      file=sys.stderr, flush=True)
        if gguf is not None:
            wall, cpu = llama_bench(binary, gguf, args.threads)
            runs.setdefault(("llama.cpp", "tg128"), []).append((1e3 / cpu, 1e3 / wall))
            print(f"round {r} llama.cpp BF16 tg128 at depth 128: {1e3 / cpu:.2f} ms CPU, {1e3 / wall:.2f} ms wall "
                  f"a token, load {loadavg()}", file=sys.stderr, flush=True)
        load.append(loadavg())
    report = {"shape": args.model_shape, "dtype": args.dtype, "threads": args.threads, "cpu": cpu_model(),
              "load": load, "rounds": args.rounds, "figures": {}}
    print(f"{args.model_shape} {args.dtype}, {args.threads} thread(s), {cpu_model()}, load {load}")
    print(f"| workload | {names[0]} thread ms | {names[1]} thread ms | ratio | {names[0]} process ms | "
          f"{names[1]} process ms | ratio | {names[0]} wall ms | {names[1]} wall ms | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for w in workloads:
        before = [statistics.median(x[i] for x in runs[(w, names[0])]) for i in (0, 1, 2)]
        after = [statistics.median(x[i] for x in runs[(w, names[1])]) for i in (0, 1, 2)]
        report["figures"][w] = {names[0]: before, names[1]: after}
        print(f"| {w} | " + " | ".join(f"{before[i]:.2f} | {after[i]:.2f} | {before[i] / after[i]:.2f}x"
                                       for i in (0, 1, 2)) + " |")
    if gguf is not None:
        cpu, wall = (statistics.median(x[i] for x in runs[("llama.cpp", "tg128")]) for i in (0, 1))
        report["figures"]["llama.cpp"] = {"cpu_ms": cpu, "wall_ms": wall}
        print(f"llama.cpp BF16 tg128 (depth 128): {cpu:.2f} ms CPU ({wall:.2f} ms wall) a token")
        for w in workloads:
            if WORKLOADS[w][0] == 1:
                for name in names:
                    ours = report["figures"][w][name][0]
                    print(f"{w} {name}: atomd {ours:.2f} ms thread CPU a decode step: llama.cpp / atomd = "
                          f"{cpu / ours:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
