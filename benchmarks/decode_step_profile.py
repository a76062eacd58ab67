"""Where a batch-1 decode step's time goes (issue #35): one sequence decoding on the
SmolLM2-135M shape (or --model-shape; random weights), its step split into

- `c_layers`: the fused C call of every layer (layer_ops.DecodeLayer.run_layers: every layer
  linear, norms, RoPE, SiLU and the decode attention over the paged cache), with their weight
  bytes / time as `c_layers_GBps` (understated by the attention's share);
- `lm_head`: the final norm's linear over the vocabulary;
- `forward_python`: the rest of the model's forward (embedding, the first norm, the RoPE rows,
  the arguments of the C call);
- `runner`: ModelRunner.execute less the forward (the step's metadata, block tables);
- `sampling`: Sampler.sample;
- `engine_loop`: EngineLoop.step less the forward + sampling (scheduling, outputs, detokenizing);
- `outside_step`: LLM.generate's own loop around the steps;
all per decoded token (128 decode steps after a 128-token prompt, the prompt's step excluded),
in the engine thread's CPU time (`time.thread_time`: one torch thread runs everything on it, so
the neighbours' load on a shared machine moves it far less than the wall clock; both reported).

`read_GBps`: a plain one-thread read of the same bytes as the C layers' weights (a float32 sum
over a buffer of that size, min of 5): the weight-read bound the C layers could reach.
`--llama-cpp`: llama-bench's tg128 on the matching GGUF (F32 for float32, BF16 for bf16-weights,
Q8_0 for int8, Q4_0 for int4) with the same thread count, in wall and CPU time (llama_bench()),
its tokens/s times the GGUF's size as its bytes/s (it reads every tensor but the embedding rows
once a token; the tied output tensor is read whole). Its tg128 runs at depth 128 (`-d`): the
same context lengths as atomd's 128 steps after the prompt. The engines and llama-bench alternate in every round; medians of
--rounds.

`--per-op`: each engine also with the fused layer off (the same weights through the per-op path).
`--touched` (MoE models): the expert bytes a decode step touches, by page (expert_bytes_touched).

    nice -n 19 .venv/bin/python -m benchmarks.decode_step_profile [--rounds 3] [--threads 1]
        [--engines float32,bf16-weights,int8,int8-a8,int4-a8] [--llama-cpp] [--per-op] [--touched]
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.machine import cpu_model, loadavg
from benchmarks.offline import prompts

# name -> (dtype, --quantization, --quantized-activations); a8: int8 activations
ENGINES = {"float32": ("float32", None, "float32"), "bfloat16": ("bfloat16", None, "float32"),
           "bf16-weights": ("float32", "bf16", "float32"), "int8": ("float32", "int8", "float32"),
           "int4": ("float32", "int4", "float32"), "int8-a8": ("float32", "int8", "int8"),
           "int4-a8": ("float32", "int4", "int8")}
GGUF = {"float32": "F32", "bf16-weights": "BF16", "bfloat16": "BF16", "int8": "Q8_0", "int4": "Q4_0",
        "int8-a8": "Q8_0", "int4-a8": "Q4_0"}
PROMPT, NEW = 128, 128


class Clock:
    """Per-part totals of thread CPU time and wall time, filled by wrapped callables."""

    def __init__(self):
        self.cpu, self.wall = collections.Counter(), collections.Counter()

    def wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu[part] += time.thread_time_ns() - c0
                self.wall[part] += time.perf_counter_ns() - w0
        return timed


def instrument(llm, clock: Clock) -> None:
    """Wrap the step's parts of this engine (instance attributes and the decoder module's names)."""
    import atomd.model.decoder as decoder

    engine, model = llm.engine, llm.engine.model
    fused = model.decode_layer  # None: the per-op path (--per-op), its total only
    if fused is not None:
        fused.run_layers = clock.wrap("c_layers", fused.run_layers)
    engine.step = clock.wrap("step", engine.step)
    engine._forward = clock.wrap("forward_and_sampling", engine._forward)
    engine.runner.execute = clock.wrap("runner_execute", engine.runner.execute)
    model.forward = clock.wrap("model_forward", model.forward)
    engine.sampler.sample = clock.wrap("sampling", engine.sampler.sample)
    # the module's names: the batch-1 path calls them from DecoderModel (restored by uninstrument)
    decoder.linear = clock.wrap("lm_head", ORIGINAL["linear"])


def uninstrument(llm) -> None:
    import atomd.model.decoder as decoder

    for name, fn in ORIGINAL.items():
        setattr(decoder, name, fn)
    fused, engine = llm.engine.model.decode_layer, llm.engine
    for obj, names in ((fused, ("run_layers",)), (engine, ("step", "_forward")), (engine.runner, ("execute",)),
                       (llm.engine.model, ("forward",)), (engine.sampler, ("sample",))):
        if obj is None:
            continue
        for n in names:
            obj.__dict__.pop(n, None)


ORIGINAL: dict = {}


def linear_bytes(model) -> int:
    """Bytes of every layer linear as loaded that the C layers stream once a token: of an MoE
    layer, its router and top_k experts' rows (the chosen ones; all experts are the same size)."""
    total = 0
    for w in model.layers:
        for t in (w.rows or w.linears()):
            if t is None:
                continue
            total += t.nbytes() if callable(getattr(t, "nbytes", None)) else t.numel() * t.element_size()
        if w.moe is not None:
            total += w.moe.router.nbytes + w.moe.top_k * (w.moe.gate_up[0].nbytes + w.moe.down[0].nbytes)
    return total


def expert_bytes_touched(llm, batch: list[list[int]], steps: int = 16) -> dict[str, float]:
    """What a batch-1 decode step of an MoE model reads of its experts, by the pages it touches:
    every stacked expert tensor copied into its own 4 KiB-page mapping (huge pages would count
    2 MiB at a time; guard pages keep the mappings apart), the pages' referenced bits cleared
    (/proc/self/clear_refs) before each fused C call and counted after it (/proc/self/smaps);
    against the chosen experts' bytes (top_k x (gate_up + down) a sparse layer). Medians over
    `steps` decode steps. Done after the timed rounds: the engine's experts stay on 4 KiB pages."""
    import ctypes
    import mmap
    import re

    from atomd import SamplingParams

    model, page = llm.engine.model, mmap.PAGESIZE
    libc = ctypes.CDLL(None)
    ranges, keep = [], []
    for w in model.layers:
        if w.moe is None:
            continue
        for name in ("gate_up", "down"):
            t = getattr(w.moe, name)
            size = (t.nbytes + page - 1) // page * page
            region = mmap.mmap(-1, size + page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            address = ctypes.addressof(ctypes.c_char.from_buffer(region))
            libc.mprotect(ctypes.c_void_p(address + size), ctypes.c_size_t(page), 0)  # the guard page
            moved = torch.frombuffer(region, dtype=torch.uint8, count=t.nbytes).view(t.dtype).view(t.shape)
            moved.copy_(t)
            setattr(w.moe, name, moved)
            ranges.append((address, address + size))
            keep.append(region)
    model.decode_layer.weights = None  # its pointers made again from the moved tensors

    def touched() -> int:
        total = 0
        for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", pathlib.Path("/proc/self/smaps").read_text()):
            lo, hi = (int(x, 16) for x in block.split(None, 1)[0].split("-"))
            if any(lo < b and a < hi for a, b in ranges):  # a mapping of the experts (maybe merged)
                total += int(re.search(r"Referenced:\s+(\d+) kB", block).group(1)) * 1024
        return total
    samples, run_layers = [], model.decode_layer.run_layers

    def counted(*args, **kwargs):
        pathlib.Path("/proc/self/clear_refs").write_text("1")
        run_layers(*args, **kwargs)
        samples.append(touched())
    model.decode_layer.run_layers = counted
    try:
        llm.generate([{"prompt_token_ids": p} for p in batch],
                     SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:
        del model.decode_layer.run_layers
    active = sum(w.moe.top_k * (w.moe.gate_up[0].nbytes + w.moe.down[0].nbytes) for w in model.layers if w.moe is not None)
    every = sum(w.moe.gate_up.nbytes + w.moe.down.nbytes for w in model.layers if w.moe is not None)
    med = statistics.median(samples)
    return {"experts_touched_MB": round(med / 1e6, 2), "active_experts_MB": round(active / 1e6, 2),
            "all_experts_MB": round(every / 1e6, 2), "touched_vs_active": round(med / active, 4),
            "touched_min_max_MB": [round(min(samples) / 1e6, 2), round(max(samples) / 1e6, 2)], "steps": len(samples)}


def profile_one(llm, batch: list[list[int]]) -> dict[str, float]:
    """One run of PROMPT + NEW tokens less a PROMPT + 1 run (the prompt step, sampled once):
    each part per decoded token, microseconds of thread CPU (and wall for the whole)."""
    from atomd import SamplingParams

    def run(new: int) -> tuple[Clock, int, int]:
        clock = Clock()
        instrument(llm, clock)
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        try:
            llm.generate([{"prompt_token_ids": p} for p in batch],
                         SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True), use_tqdm=False)
        finally:
            uninstrument(llm)
        return clock, time.thread_time_ns() - c0, time.perf_counter_ns() - w0
    full, full_cpu, full_wall = run(NEW)
    first, first_cpu, first_wall = run(1)
    steps = NEW - 1

    def per(part: str) -> float:
        return (full.cpu[part] - first.cpu[part]) / steps / 1e3
    out = {part: per(part) for part in ("c_layers", "lm_head", "model_forward", "runner_execute",
                                        "sampling", "forward_and_sampling", "step")}
    out["total_cpu"] = (full_cpu - first_cpu) / steps / 1e3
    out["total_wall"] = (full_wall - first_wall) / steps / 1e3
    return {
        "c_layers": out["c_layers"], "lm_head": out["lm_head"],
        "forward_python": out["model_forward"] - out["c_layers"] - out["lm_head"],
        "runner": out["runner_execute"] - out["model_forward"], "sampling": out["sampling"],
        "engine_loop": out["step"] - out["runner_execute"] - out["sampling"],
        "outside_step": out["total_cpu"] - out["step"], "total_cpu": out["total_cpu"], "total_wall": out["total_wall"],
    }


def read_bound(nbytes: int, repeats: int = 5) -> float:
    """GB/s of a one-thread float32 sum over a fresh buffer of nbytes (min time of `repeats`)."""
    buf = torch.rand(nbytes // 4)
    best = float("inf")
    for _ in range(repeats):
        c0 = time.thread_time_ns()
        buf.sum()
        best = min(best, time.thread_time_ns() - c0)
    return nbytes / best


def llama_bench(binary: pathlib.Path, gguf: pathlib.Path, threads: int) -> tuple[float, float]:
    """llama-bench's tg128 at depth 128 (NEW tokens after PROMPT already in its cache, as
    atomd's steps here): (tokens/s of the wall clock, median of 3 repetitions; tokens/s of its
    CPU time: a 3-repetition run's user + sys less a 1-repetition run's (the load and the
    warm-up cancel), less the same difference for pp128 (each repetition fills its depth-128
    context first, untimed by llama-bench but on the CPU clock), over the 2 x NEW tokens left;
    with one thread, comparable to atomd's thread CPU time)."""
    from benchmarks import llama_cpp as lc

    def run(reps: int, test: list[str]) -> tuple[list, float]:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        out = subprocess.run([str(binary), "-m", str(gguf), "-t", str(threads), "-r", str(reps), "-o", "json", *test],
                             check=True, capture_output=True, text=True, env=lc.run_env()).stdout
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return json.loads(out)[0]["samples_ns"], (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    tg = ["-p", "0", "-n", str(NEW), "-d", str(PROMPT)]
    pp = ["-p", str(PROMPT), "-n", "0"]
    samples, cpu3 = run(3, tg)
    cpu1 = run(1, tg)[1]
    fill = run(3, pp)[1] - run(1, pp)[1]
    return NEW / (statistics.median(samples) / 1e9), 2 * NEW / max(cpu3 - cpu1 - fill, 1e-9)


def ggufs(path: pathlib.Path, names: list[str], threads: int,
          keep: pathlib.Path | None) -> tuple[pathlib.Path, dict[str, pathlib.Path]]:
    """The GGUFs of `names`, written into `keep` (reused when there) or a temporary folder."""
    from benchmarks import llama_cpp as lc

    src, binary = lc.ensure_build(2)
    tmp = keep or pathlib.Path(tempfile.mkdtemp())
    tmp.mkdir(parents=True, exist_ok=True)
    out = {}
    for kind in dict.fromkeys(GGUF[n] for n in names):
        f = tmp / f"{kind.lower()}.gguf"
        if not f.exists() and kind == "Q4_0":
            f32 = tmp / "f32.gguf"
            if not f32.exists():
                lc.convert(src, path, "f32", f32)
            subprocess.run([str(binary.parent / "llama-quantize"), str(f32), str(f), "Q4_0", str(threads)], check=True,
                           capture_output=True)
        elif not f.exists():
            lc.convert(src, path, kind.lower(), f)
        out[kind] = f
    return binary, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--engines", default="float32,bf16-weights,int8,int8-a8,int4-a8")
    p.add_argument("--llama-cpp", action="store_true")
    p.add_argument("--gguf-dir", type=pathlib.Path, default=None, help="keep (and reuse) the GGUFs here")
    p.add_argument("--out", type=pathlib.Path, default=None)
    p.add_argument("--model-shape", default="smollm-135m", help="benchmarks/model_shapes.py's shape (random weights)")
    p.add_argument("--per-op", action="store_true",
                   help="also each engine with the fused layer off (NAME/per-op: the per-op path, its total only)")
    p.add_argument("--touched", action="store_true",
                   help="an MoE model: the expert bytes a decode step touches (expert_bytes_touched), after the rounds")
    args = p.parse_args()
    import atomd.model.decoder as decoder
    from atomd import LLM
    from benchmarks.model_shapes import model_dir

    ORIGINAL.update(linear=decoder.linear)
    torch.set_num_threads(args.threads)
    path = model_dir(args.model_shape)
    names = args.engines.split(",")
    llms = {n: LLM(str(path), num_threads=args.threads, max_model_len=1024, enable_prefix_caching=False,
                   dtype=ENGINES[n][0], quantization=ENGINES[n][1], quantized_activations=ENGINES[n][2])
            for n in names}
    vocab = llms[names[0]].engine.model.config.vocab_size
    batch = prompts(1, PROMPT, 1, vocab)
    binary, files = ggufs(path, names, args.threads, args.gguf_dir) if args.llama_cpp else (None, {})
    result: dict = {"shape": args.model_shape, "cpu": cpu_model(), "threads": args.threads, "rounds": args.rounds, "load_before": loadavg(),
                    "bytes": {n: linear_bytes(llm.engine.model) for n, llm in llms.items()},
                    "gguf_bytes": {k: f.stat().st_size for k, f in files.items()}}
    for llm in llms.values():
        profile_one(llm, batch)  # warm-up: kernels built, caches touched
    per_op = [f"{n}/per-op" for n in names] if args.per_op else []
    samples: dict = {n: collections.defaultdict(list) for n in [*names, *per_op, *files]}
    for r in range(args.rounds):
        for n, llm in llms.items():
            for part, us in profile_one(llm, batch).items():
                samples[n][part].append(us)
            samples[n]["read_GBps"].append(read_bound(result["bytes"][n]))
            if args.per_op:  # the same engine and weights, every op from Python
                model = llm.engine.model
                fused, model.decode_layer = model.decode_layer, None
                try:
                    for part in ("total_cpu", "total_wall"):
                        samples[f"{n}/per-op"][part].append(profile_one(llm, batch)[part])
                finally:
                    model.decode_layer = fused
        for kind, f in files.items():
            wall, cpu = llama_bench(binary, f, args.threads)
            samples[kind]["tok_s"].append(wall)
            samples[kind]["tok_s_cpu"].append(cpu)
        print(f"round {r + 1} done (load {loadavg()})", file=sys.stderr, flush=True)
        if args.out:  # every round's samples so far: a run cut short still leaves them
            args.out.write_text(json.dumps({**result, "rounds_done": r + 1, "samples": samples}, indent=1))
    med = {n: {part: round(statistics.median(v), 2) for part, v in d.items()} for n, d in samples.items()}
    for n in names:
        m = med[n]
        m["c_layers_GBps"] = round(result["bytes"][n] / (m["c_layers"] * 1e3), 2)
        m["tok_s_cpu"] = round(1e6 / m["total_cpu"], 1)
        m["tok_s_wall"] = round(1e6 / m["total_wall"], 1)
        if GGUF[n] in files:
            m["llama_cpp_tok_s"] = med[GGUF[n]]["tok_s"]
            m["llama_cpp_tok_s_cpu"] = med[GGUF[n]]["tok_s_cpu"]
            m["llama_cpp_GBps_cpu"] = round(med[GGUF[n]]["tok_s_cpu"] * result["gguf_bytes"][GGUF[n]] / 1e9, 2)
            m["vs_llama_cpp_wall"] = round(m["tok_s_wall"] / m["llama_cpp_tok_s"], 2)
            m["vs_llama_cpp_cpu"] = round(m["tok_s_cpu"] / m["llama_cpp_tok_s_cpu"], 2)
    for n in per_op:
        m = med[n]
        m["tok_s_cpu"], m["tok_s_wall"] = round(1e6 / m["total_cpu"], 1), round(1e6 / m["total_wall"], 1)
        m["fused_speedup_cpu"] = round(m["total_cpu"] / med[n.split("/")[0]]["total_cpu"], 3)
    result["per_token_us"] = {n: med[n] for n in [*names, *per_op]}
    if args.touched:
        result["touched"] = {n: expert_bytes_touched(llm, batch) for n, llm in llms.items()
                             if any(w.moe is not None for w in llm.engine.model.layers)}
    result["load_after"] = loadavg()
    if files and args.gguf_dir is None:
        shutil.rmtree(next(iter(files.values())).parent, ignore_errors=True)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
