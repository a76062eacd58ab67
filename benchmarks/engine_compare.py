"""Issue #34's engine benchmark: atomd, vLLM-CPU and llama.cpp on one checkpoint, one run.

    nice -n 19 .venv/bin/python -m benchmarks.engine_compare --model-shape qwen3-0.6b|qwen3-moe \\
        [--rounds 3] [--threads 2] [--short] [--int8] [--vllm-dtype bfloat16] \\
        [--vllm-python /tmp/vllm-venv/bin/python] [--out benchmarks/results/engine_compare.json]

The checkpoint is offline.checkpoint(shape) (random weights, float32 on disk; the two
issue shapes are benchmarks/model_shapes.py's, cached). Engines, all at --threads:
- atomd at float32 and bfloat16 (`--int8` / `--int4`: also int8 / int4 weights with int8
  activations, llama.cpp Q8_0's / Q4_0's counterparts): a `benchmarks.offline --stdin-rounds`
  process in this venv for each engine (`--atomd-process one`: all in one process); `--no-amx-baseline`: the baseline process (below) runs the int8 / int4
  engines alone under ATOMD_KERNEL_ISA=no-amx (names `baseline_...`: the AVX512-VNNI rows and
  float tiles an AMX CPU ran before the AMX-INT8 tiles, beside them in the same rounds);
- vLLM-CPU at --vllm-dtype: one `benchmarks.offline_vllm --stdin-rounds` process in its own
  venv (offline_vllm.py's docstring); skipped, with its error, when it does not start;
- llama.cpp: GGUF F32, BF16 and Q8_0 written from the same checkpoint by its converter
  (llama_cpp.convert), Q4_0 and Q4_K_M by llama-quantize from the F32 file (llama_cpp.write_gguf:
  its output tensor stays at llama.cpp's own choice, Q6_K), llama-bench and llama-batched-bench
  (llama_cpp.bench_round), once per `--llama-runs` entry (llama_cpp.RUNS: which build, weight
  repacking on or off), reported as llama.cpp_TYPE_RUN (F32 / BF16, which no build repacks: with the
  first run alone); a run that fails is reported under "errors" and left out of the later rounds.
The engine processes are loaded once and kept; every round runs atomd, vLLM, then each
GGUF in turn (so all see the same background load), `--rounds` rounds, medians
(`--atomd-baseline-env`: a second atomd process under other settings, the before of an A/B, in
the same rounds; `--atomd-kv-cache-dtype float16`: atomd's float32 engines over a 16-bit KV cache, as
llama.cpp's default F16 one). Workloads:
offline.py's batch1 / batch16 / prefill 8x512 or, with --short (for shapes too slow for those
on 2 shared cores), batch1_short (128 + 32), batch16_short (16 x (32 + 32)), prefill_1x512
(one 512-token prompt, llama-bench's pp512) -- the same counts for every engine; --workloads mixes the
two sets (five names in that order); --no-prefill
leaves the prefill out (the batch 1 / batch 16 targets first, where a whole run does not fit). Each
engine's CPU seconds per round (its whole process tree: vLLM's engine-core child included)
are recorded beside the wall-clock figures: on a shared machine they show whether an engine
was starved rather than slow.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks import llama_cpp as lc
from benchmarks.machine import cpu_model, loadavg
from benchmarks.offline import WORKLOADS, checkpoint, model_config
from atomd.kernels.cbuild import CPU_KIND_ENV

REPO = pathlib.Path(__file__).resolve().parent.parent
# --cpu-kind -> the llama.cpp run of a build without the instructions that kind lacks (llama_cpp.BUILDS)
KIND_LLAMA_RUN = {"native": "amxfix", "avx512-bf16": "noamx", "avx512-vnni": "vnni", "avx2": "avx2"}
FULL = ("batch1", "batch1_first", "batch16", "batch16_first", "prefill")
SHORT = ("batch1_short", "batch1_short_first", "batch16_short", "batch16_short_first", "prefill_1x512")
GGUFS = {"llama.cpp_F32": "f32", "llama.cpp_BF16": "bf16", "llama.cpp_Q8_0": "q8_0", "llama.cpp_Q4_0": "q4_0",
         "llama.cpp_Q4_K_M": "q4_k_m"}
NOT_REPACKED = {"f32", "bf16"}  # GGUF types no llama.cpp build repacks (AMX, CPU_REPACK take quantized ones)
SAME_DTYPE = {"atomd_float32": ["llama.cpp_F32"], "atomd_bfloat16": ["llama.cpp_BF16"], "atomd_auto": ["llama.cpp_BF16"],
              "atomd_bf16w": ["llama.cpp_BF16"],
              "atomd_int8": ["llama.cpp_Q8_0"], "atomd_int4": ["llama.cpp_Q4_0", "llama.cpp_Q4_K_M"],
              "baseline_atomd_int8": ["llama.cpp_Q8_0"], "baseline_atomd_int4": ["llama.cpp_Q4_0", "llama.cpp_Q4_K_M"]}


def log(msg: str) -> None:
    print(f"[engine_compare {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def tree_cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of `pid` and its live descendants (/proc)."""
    parents, ticks = {}, {}
    for d in pathlib.Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(d.name)] = int(fields[1])
            ticks[int(d.name)] = int(fields[11]) + int(fields[12])
    tree, todo = set(), [pid]
    while todo:
        p = todo.pop()
        tree.add(p)
        todo += [c for c, pp in parents.items() if pp == p and c not in tree]
    return sum(ticks.get(p, 0) for p in tree) / os.sysconf("SC_CLK_TCK")


class Worker:
    """An engine process serving offline.serve_rounds: one round per line sent."""

    def __init__(self, name: str, cmd: list[str], env: dict | None = None, prefix: str = "",
                 cwd: pathlib.Path = REPO):
        self.name, self.prefix = name, prefix  # prefix: before each engine name it reports
        log(f"starting {name}{'' if cwd == REPO else f' in {cwd}'}: {' '.join(cmd)}")
        self.proc = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)
        line = self.proc.stdout.readline()
        self.ready = json.loads(line) if line else {}
        if not self.ready.get("ready"):
            self.proc.wait()
            raise RuntimeError(f"{name} did not start (exit {self.proc.returncode}): see its stderr above")

    def round(self) -> tuple[dict, float]:
        cpu = tree_cpu_seconds(self.proc.pid)
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        out = json.loads(self.proc.stdout.readline())
        return out, tree_cpu_seconds(self.proc.pid) - cpu

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def atomd_engines(dtypes: list[str], ints: list[str], int_dtype: list[str], process: str) -> list[tuple[str, list]]:
    """(label, offline.py flags) for each atomd process: every engine in one, or one engine a process.

    One a process by default: an engine that shared its process with a 2.4 GB float32 engine ran ~25%
    slower at batch 1 than alone (RESULTS.md, #35 session 10), so a crowded process is no fair figure."""
    if process == "one":
        return [("", ["--dtype", *dtypes, *ints, *int_dtype])]
    return ([(f" {d}", ["--dtype", d]) for d in dtypes]
            + [(f" {i[2:]}", ["--dtype", i, *int_dtype]) for i in ints])  # "--dtype --int8": no float engine


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-shape", default="qwen3-0.6b")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup-rounds", type=int, default=0,
                   help="rounds of every engine first, not counted: a fresh atomd process runs the MoE shapes' first "
                        "passes several times slower (RESULTS.md, #34), and these rounds let every engine settle")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--short", action="store_true", help="the _short workloads (same counts for every engine)")
    p.add_argument("--int8", action="store_true", help="also atomd int8 weights + int8 activations")
    p.add_argument("--int4", action="store_true", help="also atomd int4 weights + int8 activations")
    p.add_argument("--int-dtype", nargs="+", choices=["float32", "bfloat16"], default=["float32"],
                   help="the int engines' model dtype(s) (offline.py's; the baseline's int engines too)")
    p.add_argument("--no-amx-baseline", action="store_true",
                   help="also the --int8 / --int4 engines under ATOMD_KERNEL_ISA=no-amx, in a second process")
    # amxfix by default: its two patches only mend bugs (the AMX tile config, batched-bench's lost
    # output), so it is llama.cpp's own fast path on every CPU; the shipped build dies on an AMX CPU
    p.add_argument("--cpu-kind", choices=list(KIND_LLAMA_RUN), default="native",
                   help="run as that kind of CPU (#35's targets hold on each): every atomd engine narrowed as "
                        "tests/test_cpu_kinds.py does (cbuild.CPU_KIND_ENV), vLLM's oneDNN alike, and llama.cpp "
                        "the build without the same instructions (KIND_LLAMA_RUN) unless --llama-runs says")
    p.add_argument("--llama-runs", nargs="+", choices=list(lc.RUNS), default=None,
                   help="llama.cpp builds / repacking to run each GGUF with (llama_cpp.RUNS; default amxfix, "
                        "llama.cpp's fast path with the AMX tile-config and log-flush fixes; 'native' as shipped "
                        "crashes in prompts on an AMX CPU; 'norepack' the old anchor)")
    p.add_argument("--atomd-dtype", nargs="*", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "auto", "bf16w"],
                   help="bfloat16 alone where both copies of a checkpoint do not fit in memory beside vLLM's; auto: "
                        "what --dtype auto picks (float32 over bf16 weights where the CPU lacks bf16 dot products); "
                        "bf16w: float32 compute over bf16 weights (--quantization bf16) on any CPU")
    p.add_argument("--atomd-process", choices=["each", "one"], default="each",
                   help="each: every atomd engine (dtype, int8, int4) in its own offline.py process, loaded once and "
                        "kept (default); one: all in one process, as before session 11")
    p.add_argument("--gguf-dir", type=pathlib.Path, default=None,
                   help="keep the GGUF files here (reused when present) instead of a temporary folder")
    p.add_argument("--vllm-python", type=pathlib.Path, default=pathlib.Path("/tmp/vllm-venv/bin/python"))
    p.add_argument("--vllm-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--no-vllm", action="store_true")
    p.add_argument("--atomd-baseline-env", nargs="+", default=None, metavar="NAME=VALUE",
                   help="also run atomd's engines in a second process with these environment settings (e.g. "
                        "ATOMD_MOE_AMX=0), reported as baseline_*, alternated with the others round by round")
    p.add_argument("--atomd-baseline-tree", type=pathlib.Path, default=None, metavar="DIR",
                   help="run the baseline process (--atomd-baseline-env's, or one with no settings) from another "
                        "checkout of atomd, e.g. a worktree of main: the before of a branch, same venv (with --int8 / "
                        "--int4: the int engines alone)")
    p.add_argument("--gguf", nargs="*", choices=list(GGUFS), default=list(GGUFS))
    p.add_argument("--out", type=pathlib.Path, default=None)
    p.add_argument("--atomd-kv-cache-dtype", default="auto",
                   help="the atomd engines' --kv-cache-dtype (float16: llama.cpp's default F16 cache)")
    p.add_argument("--no-prefill", action="store_true",
                   help="batch 1 and batch 16 only (the issue's targets), where a whole run does not fit")
    p.add_argument("--workloads", nargs=5, default=None, metavar=("B1", "B1_FIRST", "B16", "B16_FIRST", "PREFILL"),
                   help="offline.py's workloads in FULL's order, mixed (e.g. batch1_short batch1_short_first "
                        "batch16 batch16_first prefill: the full batch 16 and 8 x 512 with the short batch 1)")
    args = p.parse_args()
    workloads = tuple(args.workloads) if args.workloads else SHORT if args.short else FULL
    args.llama_runs = args.llama_runs or [KIND_LLAMA_RUN[args.cpu_kind]]
    kind_env = dict(os.environ, **CPU_KIND_ENV.get(args.cpu_kind, {}))
    if args.no_prefill:
        workloads = workloads[:4]
    path = checkpoint(args.model_shape)
    cfg = model_config(path)
    load = [loadavg()]
    src = binary = None
    binaries: dict[str, pathlib.Path] = {}
    if args.gguf:  # llama.cpp built (minutes, once) only where a GGUF is measured
        src, binary = lc.ensure_build(2)
        lc.ensure_batched_bench(binary)
        binaries = {run: lc.ensure_build(2, lc.RUNS[run][0])[1] for run in args.llama_runs}
    workers: list[Worker] = []
    errors: dict[str, str] = {}
    runs: dict[str, list[dict]] = {}
    cpu: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.gguf_dir or pathlib.Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        ggufs = {name: folder / f"{args.model_shape}-{t}.gguf" for name, t in GGUFS.items() if name in args.gguf}
        for name, gguf in ggufs.items():
            if not gguf.is_file():
                part = gguf.with_name(f"{gguf.stem}.part.gguf")
                lc.write_gguf(src, binary, path, GGUFS[name], part, folder / f"{args.model_shape}-f32.gguf")
                part.rename(gguf)
        gguf_bytes = {name: gguf.stat().st_size for name, gguf in ggufs.items()}
        try:
            ints = [*(["--int8"] if args.int8 else []), *(["--int4"] if args.int4 else [])]
            int_dtype = ["--int-dtype", *args.int_dtype] if ints and args.int_dtype != ["float32"] else []
            base = [sys.executable, "-m", "benchmarks.offline", "--model-shape", args.model_shape, "--no-hf",
                    "--threads", str(args.threads), "--workloads", *workloads, "--stdin-rounds",
                    *(["--kv-cache-dtype", args.atomd_kv_cache_dtype] if args.atomd_kv_cache_dtype != "auto" else [])]
            engines = atomd_engines(args.atomd_dtype, ints, int_dtype, args.atomd_process)
            for label, flags in engines:
                workers.append(Worker(f"atomd{label}", base + flags, env=kind_env))
            baseline_env = dict(kv.split("=", 1) for kv in args.atomd_baseline_env or [])
            if (args.no_amx_baseline or args.atomd_baseline_tree) and ints:
                engines = atomd_engines([], ints, int_dtype, args.atomd_process)  # the int engines alone
            if args.no_amx_baseline and ints:
                baseline_env["ATOMD_KERNEL_ISA"] = "no-amx"
            if baseline_env or args.atomd_baseline_tree:  # the same engines under other settings or code (an A/B's before)
                tree = (args.atomd_baseline_tree or REPO).resolve()
                for label, flags in engines:
                    workers.append(Worker(f"atomd baseline{label}", base + flags,
                                          env=dict(kind_env, **baseline_env, PYTHONPATH=str(tree)),
                                          prefix="baseline_", cwd=tree))
            if not args.no_vllm:
                cmd = [str(args.vllm_python), "-m", "benchmarks.offline_vllm", "--model-shape", args.model_shape,
                       "--model", str(path), "--dtype", args.vllm_dtype, "--threads", str(args.threads),
                       "--workloads", *workloads, "--stdin-rounds"]
                try:
                    workers.append(Worker("vllm", cmd, env={k: v for k, v in kind_env.items()
                                                             if k not in ("PYTHONPATH", "VIRTUAL_ENV")}))
                except Exception as e:  # noqa: BLE001 -- reported, the others still run
                    errors["vllm"] = str(e)
                    log(f"vLLM-CPU skipped: {e}")
            for r in range(args.warmup_rounds):
                log(f"warm-up round {r + 1}/{args.warmup_rounds} (not counted), load {loadavg()}")
                for w in workers:
                    w.round()
            streamed = {w.prefix + n: b for w in workers for n, b in w.ready.get("streamed_bytes", {}).items()}
            for r in range(args.rounds):
                log(f"round {r + 1}/{args.rounds}, load {loadavg()}")
                for w in workers:
                    out, seconds = w.round()
                    for name, figures in out.items():
                        name = w.prefix + name
                        own = figures.pop("cpu_s")  # a lone engine: its whole process tree's
                        runs.setdefault(name, []).append(figures)
                        cpu.setdefault(name, []).append(seconds if len(out) == 1 else own)
                for name, gguf in ggufs.items():
                    for run, run_binary in binaries.items():
                        if f"{name}_{run}" in errors or (GGUFS[name] in NOT_REPACKED and run != args.llama_runs[0]):
                            continue
                        before = children_cpu()
                        try:
                            figures = lc.bench_round(run_binary, gguf, args.threads,
                                                     {w: WORKLOADS[w] for w in workloads}, repack=lc.RUNS[run][1])
                        except subprocess.CalledProcessError as e:  # reported; the other runs go on
                            errors[f"{name}_{run}"] = f"{pathlib.Path(e.cmd[0]).name} exit {e.returncode}"
                            log(f"{name}_{run} failed: {errors[f'{name}_{run}']}")
                            continue
                        runs.setdefault(f"{name}_{run}", []).append(figures)
                        cpu.setdefault(f"{name}_{run}", []).append(children_cpu() - before)
                load.append(loadavg())
                if args.out:  # every round's figures so far: a run cut short still leaves them
                    args.out.write_text(json.dumps({"shape": args.model_shape, "threads": args.threads,
                                                    "kv_cache_dtype": args.atomd_kv_cache_dtype, "rounds_done": r + 1, "load": load, "errors": errors,
                                                    "runs": runs, "cpu_seconds_per_round": cpu}, indent=2))
        finally:
            for w in workers:
                w.close()
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
           if name not in errors}
    report(args, cfg, workloads, med, {n: statistics.median(c) for n, c in cpu.items()}, load, errors)
    report_bytes(workloads[0], med, streamed, gguf_bytes)
    if args.out:
        args.out.write_text(json.dumps({"shape": args.model_shape, "threads": args.threads,
                                        "kv_cache_dtype": args.atomd_kv_cache_dtype, "rounds": args.rounds,
                                        "load": load, "errors": errors, "runs": runs, "medians": med,
                                        "cpu_seconds_per_round": cpu, "streamed_bytes": streamed,
                                        "gguf_bytes": gguf_bytes}, indent=2))
    return 0


def report(args, cfg: dict, workloads: tuple, med: dict, cpu: dict, load: list, errors: dict) -> None:
    """Markdown: tok/s per engine (medians), then the issue's ratios."""
    b1, b1_first, b16, _, pf = tuple(args.workloads) if args.workloads else SHORT if args.short else FULL
    rows = [(b1, "batch 1 (prompt included)"), (f"{b1}_decode", "batch 1 decode only"),
            (b16, "batch 16 (prompt included)"), (f"{b16}_decode", "batch 16 decode only"),
            (pf, "prefill (prompt tok/s)")]
    names = list(med)
    print(f"\n{args.model_shape} ({cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}), "
          f"threads {args.threads}, {args.rounds} rounds (medians; {args.warmup_rounds} warm-up rounds not counted), workloads {', '.join(workloads)}; "
          f"load {' -> '.join(load)}; {cpu_model()}"
          + ("" if args.cpu_kind == "native" else f", run as the {args.cpu_kind} kind ({CPU_KIND_ENV[args.cpu_kind]})") + (f"; errors: {errors}" if errors else ""))
    print("\n| tok/s | " + " | ".join(names) + " |\n|---|" + "---:|" * len(names))
    for key, label in rows:
        print(f"| {label} | " + " | ".join(f"{med[n][key]:.1f}" if key in med[n] else "" for n in names) + " |")
    print("| CPU s / round (all workloads) | " + " | ".join(f"{cpu[n]:.0f}" for n in names) + " |")
    atomd = [n for n in names if n.startswith("atomd_")]
    vllm = [n for n in names if n.startswith("vllm_")]
    print("\n| ratio | " + " | ".join(label for _, label in rows) + " |\n|---|" + "---:|" * len(rows))
    if vllm:
        cells = []
        for key, _ in rows:
            best = max(atomd, key=lambda n: med[n].get(key, 0))
            cells.append(f"{med[best][key] / med[vllm[0]][key]:.2f}x ({best[6:]})"
                         if key in med[vllm[0]] and key in med[best] else "")
        print(f"| atomd best / {vllm[0]} | " + " | ".join(cells) + " |")
    pairs = [(ours, theirs) for ours, types in SAME_DTYPE.items() for t in types
             for theirs in names if theirs.startswith(f"{t}_")]
    pairs += [(q + d, base) for q in ("atomd_int8", "atomd_int4") for d in ("", "_bfloat16")
              for base in (f"baseline_{q}", "atomd_float32", "atomd_bfloat16")] + [(f, "atomd_float32") for f in ("atomd_auto", "atomd_bf16w", "atomd_bfloat16")]
    for ours, theirs in pairs:
        if ours in med and theirs in med:
            print(f"| {ours} / {theirs} | " + " | ".join(
                f"{med[ours][k] / med[theirs][k]:.2f}x" if k in med[theirs] and k in med[ours] else ""
                for k, _ in rows) + " |")


def report_bytes(b1: str, med: dict, streamed: dict, gguf_bytes: dict) -> None:
    """Markdown: per atomd engine the bytes a batch-1 step streams (counted from its loaded tensors:
    benchmarks.offline.weight_bytes), the GGUF of the same format (llama.cpp's packed file: every
    weight once), their ratio and the read rate the batch-1 decode figure implies."""
    if not streamed:
        return
    print("\n| atomd engine | MB streamed per batch-1 token | GGUF of the format (MB) | streamed / GGUF "
          "| implied GB/s at batch-1 decode |\n|---|---:|---:|---:|---:|")
    for name, b in streamed.items():
        cells = []
        for t in SAME_DTYPE.get(name, []):
            if t in gguf_bytes:
                cells.append((f"{gguf_bytes[t] / 1e6:.1f} ({t[10:]})", f"{b / gguf_bytes[t]:.2f}"))
        rate = med.get(name, {}).get(f"{b1}_decode")
        print(f"| {name} | {b / 1e6:.1f} | {' / '.join(c[0] for c in cells)} | {' / '.join(c[1] for c in cells)} | "
              + (f"{b * rate / 1e9:.2f}" if rate else "") + " |")


if __name__ == "__main__":
    sys.exit(main())
