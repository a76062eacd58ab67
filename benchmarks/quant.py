"""Weight-only int8 / int4 (issue #35) on the SmolLM2-135M shape (random weights): atomd
`--quantization int8|int4` against its own float32 and bfloat16 in the same run, and
llama.cpp Q8_0 / Q4_0 / F32 on the same checkpoint with --llama-cpp.

    nice -n 19 .venv/bin/python -m benchmarks.quant [--rounds 3] [--threads 2] [--llama-cpp]

atomd engines (one process, each loaded once; the engines alternate inside every round so
all see the same background load; medians of --rounds), greedy, ignore_eos, no prefix cache:
- batch1: one 128-token prompt, 128 new tokens (prefill included), output tok/s;
  batch1_decode: the same less a 1-token run of it (decode steps alone);
- batch16: 16 such prompts at once, output tok/s (prefill included); batch16_decode as above;
- prefill: 8 x 512-token prompts, one token each, prompt tok/s.
Linears: the int8 / int4 kernels against the float32 matmul atomd runs (GEMV rows at M = 1,
oneDNN's packed weight above) on the shape's four layer linears at M = 1, 4, 8, 16, 64, 512,
each as the in-register GEMM and as dequantised tiles + BLAS: where the cut-over
(atomd.model.quant.QGEMM_MAX_M) belongs.
Bytes per decoded token: what a batch-1 step streams (every packed linear once, the LM head,
counted from the loaded tensors: q, scales, offsets) against the packed weight size, and the
read bandwidth that decode rate implies. Counted, not measured with hardware counters (none
reachable here).
llama.cpp (benchmarks/llama_cpp.py's build from PyPI's source, --llama-cpp): batch-1 pairs in
the same rounds as atomd float32 / int8 / int4 (see llama_cpp()); Q8_0 written by
convert_hf_to_gguf, Q4_0 by llama-quantize from the F32 GGUF (which keeps its own choice for
the output / embedding tensor).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile

import torch

from benchmarks.machine import loadavg
from benchmarks.offline import prompts, timed, weight_bytes

ENGINES = {"float32": ("float32", None, "float32"), "bfloat16": ("bfloat16", None, "float32"),
           "int8": ("float32", "int8", "float32"), "int4": ("float32", "int4", "float32"),
           "int8-a8": ("float32", "int8", "int8"), "int4-a8": ("float32", "int4", "int8")}  # a8: int8 activations
# name -> (prompts, prompt length, new tokens, seed)
WORKLOADS = {"batch1": (1, 128, 128, 1), "batch1_first": (1, 128, 1, 1), "batch16": (16, 128, 128, 2),
             "batch16_first": (16, 128, 1, 2), "prefill": (8, 512, 1, 3)}
LINEAR_MS = (1, 4, 8, 16, 64, 512)


def cpu_kind() -> str:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.processor()


def engines(path: pathlib.Path, threads: int, names: list[str]) -> dict:
    from atomd import LLM, SamplingParams

    out = {}
    for name in names:
        dtype, quantization, activations = ENGINES[name]
        llm = LLM(str(path), num_threads=threads, max_model_len=1024, enable_prefix_caching=False, dtype=dtype,
                  quantization=quantization, quantized_activations=activations)

        def gen(batch, new, llm=llm):
            llm.generate([{"prompt_token_ids": p} for p in batch],
                         SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True), use_tqdm=False)
        out[name] = (llm, gen)
    return out


def run_engines(gens: dict, vocab: int, rounds: int) -> dict[str, dict[str, float]]:
    for _, gen in gens.values():
        gen(prompts(2, 16, 9, vocab), 4)  # warm-up
    runs = {name: {w: [] for w in WORKLOADS} for name in gens}
    for r in range(rounds):
        for workload, (n, length, new, seed) in WORKLOADS.items():
            batch = prompts(n, length, seed, vocab)
            tokens = n * length if workload == "prefill" else n * new
            for name, (_, gen) in gens.items():
                runs[name][workload].append(tokens / timed(lambda: gen(batch, new)))
        print(f"round {r + 1}/{rounds} (load {loadavg()})", file=sys.stderr, flush=True)
    out = {}
    for name, per in runs.items():
        res = {}
        for full, n in (("batch1", 1), ("batch16", 16)):
            first = per.pop(f"{full}_first")
            res[f"{full}_decode"] = statistics.median(
                n * 127 / (n * 128 / f - n / s) for f, s in zip(per[full], first))
        out[name] = {**{w: statistics.median(v) for w, v in per.items()}, **res}
    return out


def linears(cfg: dict, threads: int, repeats: int = 5) -> list[dict]:
    """us per call of each kernel on the shape's layer linears (summed), per M."""
    from atomd.engine.allocator import retain_freed_memory
    from atomd.model import quant
    from atomd.model.linear import linear, pack_linear_weight

    retain_freed_memory()  # the engine's malloc policy: a tile buffer is not mmap'd and faulted in every call
    torch.set_num_threads(threads)
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]
    ws = [torch.randn(n, k) * 0.02 for n, k in shapes]
    packed = [pack_linear_weight(w) for w in ws]
    qs = {m: [quant.quantize(w, m) for w in ws] for m in ("int8", "int4")}
    for m in ("int8", "int4"):  # the same weights with int8 activations (--quantized-activations int8)
        qs[f"{m}_a8"] = [dataclasses.replace(w, _ref=None) for w in qs[m]]
        quant.use_int8_activations(qs[f"{m}_a8"])
    rows = []
    for m in LINEAR_MS:
        xs = [torch.randn(m, k) for _, k in shapes]
        best = lambda fn: min(timed(fn) for _ in range(repeats)) * 1e6  # noqa: E731
        row = {"M": m, "float32": best(lambda: [linear(x, p, None, w if m == 1 else None)
                                                for x, p, w in zip(xs, packed, ws)])}
        for method, weights in qs.items():
            cut = quant.QGEMM_MAX_M
            try:
                quant.QGEMM_MAX_M = 1 << 30
                row[f"{method}_gemm"] = best(lambda: [quant.qlinear(x, w) for x, w in zip(xs, weights)])
                quant.QGEMM_MAX_M = 0
                row[f"{method}_tiles"] = best(lambda: [quant.qlinear(x, w) for x, w in zip(xs, weights)])
            finally:
                quant.QGEMM_MAX_M = cut
        rows.append({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def llama_cpp(path: pathlib.Path, threads: int, rounds: int) -> dict:
    """Same-run pairs at batch 1: atomd float32 / int8 / int4 (float and int8 activations, and
    int8 activations on llama.cpp's own Q8_0 / Q4_0 files) and llama.cpp F32 / Q8_0 / Q4_0,
    alternating in every round (one llama-bench repetition each): tok/s of a 128-token prompt
    + 128 new (batch1) and of the decode steps alone (tg: atomd's full run less a 1-token one,
    llama-bench's tg128); medians of `rounds`."""
    from atomd import LLM, SamplingParams
    from benchmarks import llama_cpp as lc

    src, binary = lc.ensure_build(2)
    tmp = pathlib.Path(tempfile.mkdtemp())
    ggufs = {"F32": tmp / "f32.gguf", "Q8_0": tmp / "q8_0.gguf", "Q4_0": tmp / "q4_0.gguf"}
    lc.convert(src, path, "f32", ggufs["F32"])
    lc.convert(src, path, "q8_0", ggufs["Q8_0"])
    subprocess.run([str(binary.parent / "llama-quantize"), str(ggufs["F32"]), str(ggufs["Q4_0"]), "Q4_0",
                    str(threads)], check=True, capture_output=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # atomd reads the GGUFs' vocabulary from beside them
        shutil.copyfile(path / f, tmp / f)
    common = dict(num_threads=threads, max_model_len=1024, enable_prefix_caching=False)
    llms = {m: LLM(str(path), quantization=q, quantized_activations=a, **common)
            for m, q, a in (("float32", None, "float32"), ("int8", "int8", "float32"), ("int4", "int4", "float32"),
                            ("int8-a8", "int8", "int8"), ("int4-a8", "int4", "int8"))}
    # atomd on llama.cpp's own files (atomd/model/gguf_weights.py): the very same integers and scales
    llms.update({f"gguf-{name}-a8": LLM(str(ggufs[name]), quantized_activations="int8", **common)
                 for name in ("Q8_0", "Q4_0")})
    batch = prompts(1, 128, 1, 49152)

    def run(llm, new):
        llm.generate([{"prompt_token_ids": p} for p in batch],
                     SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for llm in llms.values():
        run(llm, 4)
    res = {k: {"batch1": [], "tg": []} for k in [*llms, *ggufs]}
    for _ in range(rounds):
        for m, llm in llms.items():
            full, first = timed(lambda: run(llm, 128)), timed(lambda: run(llm, 1))
            res[m]["batch1"].append(128 / full)
            res[m]["tg"].append(127 / (full - first))
        for name, gguf in ggufs.items():
            out = subprocess.run([str(binary), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json", "-p", "0",
                                  "-n", "128", "-pg", "128,128"], check=True, capture_output=True, text=True).stdout
            for t in json.loads(out):
                seconds = statistics.median(t["samples_ns"]) / 1e9
                res[name]["tg" if t["n_prompt"] == 0 else "batch1"].append(128 / seconds)
        print(f"llama.cpp pairs: round done (load {loadavg()})", file=sys.stderr, flush=True)
    sizes = {name: g.stat().st_size for name, g in ggufs.items()}
    shutil.rmtree(tmp, ignore_errors=True)
    return {"gguf_bytes": sizes, **{k: {w: statistics.median(v) for w, v in d.items()} for k, d in res.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-cpp", action="store_true")
    p.add_argument("--no-linears", action="store_true")
    p.add_argument("--no-engines", action="store_true", help="the linears alone")
    p.add_argument("--pairs-only", action="store_true", help="the llama.cpp pairs alone (implies --llama-cpp)")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated ENGINES to run (default: all)")
    p.add_argument("--out", type=pathlib.Path, default=None)
    args = p.parse_args()
    from benchmarks.model_shapes import model_dir

    path = model_dir("smollm-135m")
    cfg = json.loads((path / "config.json").read_text())
    result: dict = {"cpu": cpu_kind(), "threads": args.threads, "rounds": args.rounds, "load_before": loadavg()}
    if args.pairs_only:
        result["llama_cpp_pairs"] = llama_cpp(path, args.threads, args.rounds)
        result["load_after"] = loadavg()
        print(json.dumps(result, indent=1))
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
        return 0
    if not args.no_linears:
        result["linears_us"] = linears(cfg, args.threads)
    if args.no_engines:
        print(json.dumps(result, indent=1))
        return 0
    gens = engines(path, args.threads, args.engines.split(","))
    result["bytes_per_token"] = {name: dict(zip(("streamed", "linears"), weight_bytes(llm.engine.model)))
                                 for name, (llm, _) in gens.items()}
    result["atomd"] = run_engines(gens, cfg["vocab_size"], args.rounds)
    if args.llama_cpp:
        del gens
        result["llama_cpp_pairs"] = llama_cpp(path, args.threads, args.rounds)
    result["load_after"] = loadavg()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
