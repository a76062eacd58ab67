"""Offline throughput: atomd's engine vs Hugging Face `transformers` generate, one run.

Checkpoints (`--model-shape`), random weights, float32 on disk, the same for every engine:
- small: a Llama of hidden 512, 8 layers, 8 heads / 4 KV heads, intermediate 1408, vocab
  4096, untied (27.8M parameters; made in a temporary directory);
- smollm-135m: SmolLM2-135M's shape (hidden 576, 30 layers, 9 / 3 heads, intermediate 1536,
  vocab 49152, tied; benchmarks/model_shapes.py, cached).

Workloads (greedy, ignore_eos, prefix caching off; atomd's KV pool holds the largest workload's
sequences at full length, KV_BLOCKS, so that none is preempted):
- batch 1: output tokens/s of one 128-token prompt generating 128 tokens;
- batch 16: output tokens/s of 16 such prompts at once (HF: one batched generate, KV cache on),
  the prompts' prefill included; "decode only" subtracts a 1-token run of the same batch;
- prefill: prompt tokens/s of 8 x 512-token prompts, one output token each;
- achieved GFLOP/s of atomd's batch-16 run and prefill against the machine's best GEMM for
  the same shapes and dtype (the faster of F.linear and oneDNN's packed linear, the model's
  linear layers at M = 16 and M = 512) timed in the same run.

atomd runs at each `--dtype` (the checkpoint cast at load); HF runs float32 (`--no-hf`
skips it). Every engine runs every workload in turn, `--rounds` times; medians.

    .venv/bin/python -m benchmarks.offline [--model-shape small|smollm-135m] [--dtype float32 bfloat16]
        [--rounds 3] [--threads 2] [--out benchmarks/results/offline.json] [--no-hf]
        [--with-torch-attention]   # also atomd on torch SDPA decode attention: the kernel's share
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

import atomd  # noqa: F401  (before torch: its OpenMP wait policy, atomd/__init__.py)
import torch

from atomd.config import EngineConfig
from benchmarks.machine import loadavg

SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=1408, vocab_size=4096, tie_word_embeddings=False, max_position_embeddings=2048)
SHAPE_CHOICES = ("small", "smollm-135m", "qwen3-0.6b", "qwen3-moe-small", "qwen3-moe", "deepseek-v2-lite")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# --dtype names beyond DTYPES: (dtype, quantization) of that engine
FLOAT_FORMATS = {"auto": ("auto", None), "bf16w": ("float32", "bf16")}


def make_checkpoint(path: pathlib.Path) -> pathlib.Path:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, bos_token_id=1, eos_token_id=2))
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(SHAPE["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t1", "eos_token": "t2"}))
    return path


def checkpoint(shape: str, tmp: pathlib.Path | None = None) -> pathlib.Path:
    """The checkpoint directory of `shape` (SHAPE_CHOICES): the named shapes' cached one; "small" made in `tmp`
    (a new temporary folder, the caller's to remove, when None)."""
    if shape == "small":
        return make_checkpoint((tmp or pathlib.Path(tempfile.mkdtemp(prefix="atomd-small-"))) / "llama")
    from benchmarks.model_shapes import model_dir
    return model_dir(shape)


def model_config(path: pathlib.Path) -> dict:
    cfg = json.loads((path / "config.json").read_text())
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return cfg


def prompts(n: int, length: int, seed: int, vocab_size: int = SHAPE["vocab_size"]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (n, length), generator=g).tolist()


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def hf_generator(path: pathlib.Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def gen(batch: list[list[int]], new: int):
        ids = torch.tensor(batch)
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, use_cache=True, pad_token_id=0)
    return gen


def atomd_generator(path: pathlib.Path, threads: int, attention_backend: str = "auto", dtype: str = "float32",
                    quantization: str | None = None, quantized_activations: str = "float32",
                    kv_cache_dtype: str = "auto"):
    from atomd import LLM, SamplingParams
    from atomd.config import auto_dtype

    if kv_cache_dtype in ("float16", "bfloat16") and (auto_dtype()[0] if dtype == "auto" else dtype) != "float32":
        kv_cache_dtype = "auto"  # a 16-bit model keeps its own 16-bit cache (another one is refused): the same bytes
    llm = LLM(str(path), num_threads=threads, max_model_len=1024, enable_prefix_caching=False,
              attention_backend=attention_backend, dtype=dtype, quantization=quantization,
              quantized_activations=quantized_activations, num_kvcache_blocks=KV_BLOCKS, kv_cache_dtype=kv_cache_dtype)

    def gen(batch: list[list[int]], new: int):
        llm.generate([{"prompt_token_ids": p} for p in batch],
                     SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True), use_tqdm=False)
    gen.model = llm.engine.model  # serve_rounds: the bytes a batch-1 step streams
    return gen


# name -> (prompts, prompt length, new tokens, seed); tokens counted: output, or prompt for prefill
WORKLOADS = {"batch1": (1, 128, 128, 1), "batch16": (16, 128, 128, 2), "batch16_first": (16, 128, 1, 2),
             "prefill": (8, 512, 1, 3),
             # the same three at fewer tokens, for shapes too slow for the above on 2 shared cores
             # (engine_compare.py; llama.cpp runs the same counts)
             "batch1_first": (1, 128, 1, 1), "batch1_short": (1, 128, 32, 1), "batch1_short_first": (1, 128, 1, 1),
             "batch16_short": (16, 32, 32, 2), "batch16_short_first": (16, 32, 1, 2),
             "prefill_1x512": (1, 512, 1, 3)}


# the KV pool of every atomd engine here: the largest workload's sequences at full length at once, as
# llama_cpp.py gives llama-batched-bench a context of n * (prompt + new) tokens. The default 256 MiB
# holds 2340 bf16 tokens of Qwen3-0.6B (28 layers x 8 KV heads x 128): batch16's 16 x 256 preempted
# and recomputed sequences there (#35, RESULTS.md "the 0.6B batch 16 was preempting")
KV_BLOCKS = max(n * -(-(length + new + 1) // EngineConfig().block_size) for n, length, new, _ in WORKLOADS.values())


def run_workloads(gens: dict, vocab_size: int = SHAPE["vocab_size"], rounds: int = 1,
                  workloads: tuple[str, ...] = tuple(WORKLOADS)) -> dict[str, dict[str, float]]:
    """tokens/s per engine per workload (of `workloads`), the median over `rounds`; the engines
    alternate per workload so that all see the same background load on a shared machine."""
    for gen in gens.values():
        gen(prompts(2, 16, 9, vocab_size), 4)  # warm-up
    runs: dict[str, dict[str, list[float]]] = {name: {w: [] for w in workloads} for name in gens}
    for r in range(rounds):
        for workload in workloads:
            n, length, new, seed = WORKLOADS[workload]
            batch = prompts(n, length, seed, vocab_size)
            tokens = n * length if workload.startswith("prefill") else n * new
            for name, gen in gens.items():
                runs[name][workload].append(tokens / timed(lambda: gen(batch, new)))
        print(f"round {r + 1}/{rounds} done (load {loadavg()})", file=sys.stderr, flush=True)
    out: dict[str, dict[str, float]] = {}
    for name, per in runs.items():
        # decode alone: each round's batch run minus its prefill and first token (its "_first" run)
        decode = {}
        for w in [w for w in per if f"{w}_first" in per]:
            n, _, new, _ = WORKLOADS[w]
            decode[f"{w}_decode"] = [n * (new - 1) / (n * new / full - n / first)
                                     for full, first in zip(per[w], per.pop(f"{w}_first"))]
        out[name] = {w: statistics.median(v) for w, v in {**per, **decode}.items() if v}
    return out


def weight_bytes(model) -> tuple[int, int]:
    """(bytes a batch-1 step streams: every layer linear and the LM head once, as loaded;
    the packed linears alone)."""
    def size(t) -> int:
        if hasattr(t, "nbytes") and callable(t.nbytes):
            return t.nbytes()
        return (t.to_dense() if t.is_mkldnn else t).numel() * t.element_size()
    linears = sum(size(t) for w in model.layers for t in w.linears())
    return linears + size(model.lm_head), linears


def serve_rounds(gens: dict, vocab_size: int, workloads: tuple[str, ...]) -> None:
    """One round of `workloads` per line read on stdin, its figures (and each engine's CPU
    seconds, this process's: a child process's are not in them) as one JSON line on stdout:
    engine_compare.py keeps this process (its engines loaded) and the other engines' alive and
    alternates them round by round. The ready line carries each atomd engine's bytes streamed per
    batch-1 step (weight_bytes: counted from the loaded tensors)."""
    streamed = {name: weight_bytes(gen.model)[0] for name, gen in gens.items() if hasattr(gen, "model")}
    print(json.dumps({"ready": True, "streamed_bytes": streamed}), flush=True)
    for _ in sys.stdin:
        out = {}
        for name, gen in gens.items():  # one engine after the other, each with its CPU seconds
            cpu = time.process_time()
            out[name] = {**run_workloads({name: gen}, vocab_size, 1, workloads)[name],
                         "cpu_s": time.process_time() - cpu}
        print(json.dumps(out), flush=True)


def linear_shapes(cfg: dict) -> list[tuple[int, int]]:
    """(out, in) of every matmul of one token's forward, as atomd packs them."""
    h, i, v, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    layer = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]
    return layer * cfg["num_hidden_layers"] + [(v, h)]


def flops_per_token(cfg: dict, context: float, with_head: bool = True) -> float:
    """Matmul FLOPs of one token (2 per multiply-add) plus attention over `context` keys."""
    shapes = linear_shapes(cfg) if with_head else linear_shapes(cfg)[:-1]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    attn = 2 * 2 * context * q * cfg["num_hidden_layers"]
    return sum(2 * o * k for o, k in shapes) + attn


def matmul_gflops(cfg: dict, m: int, dtype: torch.dtype, with_head: bool = True, repeats: int = 5) -> float:
    """GFLOP/s of a chain of the model's linear layers at M = m in `dtype`: the faster of
    plain F.linear and oneDNN's packed linear (what atomd's model calls), best of `repeats`."""
    from atomd.model.linear import linear, pack_linear_weight

    shapes = linear_shapes(cfg) if with_head else linear_shapes(cfg)[:-1]
    plain = [(torch.randn(o, k) * 0.02).to(dtype) for o, k in shapes]
    xs = {k: torch.randn(m, k).to(dtype) for _, k in shapes}
    best = float("inf")
    with torch.inference_mode():
        for weights in (plain, [pack_linear_weight(w) for w in plain]):
            chain = lambda: [linear(xs[k], w) for w, (_, k) in zip(weights, shapes)]  # noqa: E731
            chain()
            best = min(best, *(timed(chain) for _ in range(repeats)))
    return sum(2 * m * o * k for o, k in shapes) / best / 1e9


ROWS = (("batch1", "batch 1 (tok/s)"), ("batch16", "batch 16 (output tok/s)"),
        ("batch16_decode", "batch 16 decode only"), ("prefill", "prefill 8x512 (tok/s)"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-shape", choices=SHAPE_CHOICES, default="small")
    p.add_argument("--dtype", nargs="*", choices=[*DTYPES, *FLOAT_FORMATS], default=["float32"],
                   help="atomd's float dtypes (none: only --int8 / --int4); auto: what `--dtype auto` picks for "
                        "this CPU; bf16w: float32 compute over bf16 weights (--quantization bf16)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-hf", action="store_true", help="skip Hugging Face generate (the slowest engine)")
    p.add_argument("--out", type=pathlib.Path, default=None, help="also write the figures as JSON")
    p.add_argument("--with-torch-attention", action="store_true",
                   help="also run atomd with --attention-backend torch (the native kernel's ablation)")
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=["batch1", "batch16", "batch16_first", "prefill"],
                   help="a subset (batch16_first goes with batch16; the GFLOP/s lines need batch16 and prefill)")
    p.add_argument("--int8", action="store_true",
                   help="also atomd with int8 weights and int8 activations (llama.cpp Q8_0's counterpart)")
    p.add_argument("--int4", action="store_true",
                   help="also atomd with int4 weights and int8 activations (llama.cpp Q4_0's counterpart)")
    p.add_argument("--int-dtype", nargs="+", choices=list(DTYPES), default=["float32"],
                   help="the --int8 / --int4 engines' model dtype (activations, attention, norms): atomd_int8 for "
                        "float32, atomd_int8_bfloat16 for bfloat16, both where both are given")
    p.add_argument("--kv-cache-dtype", default="auto", help="the atomd engines' --kv-cache-dtype (float16: "
                   "llama.cpp's default F16 cache under float32 models; a bf16 model, --dtype auto's on a CPU with "
                   "bf16 dot products too, keeps its bf16 cache of the same bytes)")
    p.add_argument("--stdin-rounds", action="store_true",
                   help="load the engines, then one round per stdin line, JSON out (serve_rounds)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    load_before = loadavg()
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(args.model_shape, pathlib.Path(tmp))
        cfg = model_config(path)
        gens = {} if args.no_hf else {"hf": hf_generator(path)}
        for dtype in args.dtype:
            dtype_of, quantization = FLOAT_FORMATS.get(dtype, (dtype, None))
            gens[f"atomd_{dtype}"] = atomd_generator(path, args.threads, dtype=dtype_of, quantization=quantization,
                                                     kv_cache_dtype=args.kv_cache_dtype)
            if args.with_torch_attention:
                gens[f"atomd_{dtype}_torch_attention"] = atomd_generator(path, args.threads, "torch", dtype,
                                                                         kv_cache_dtype=args.kv_cache_dtype)
        for method in [m for m in ("int8", "int4") if getattr(args, m)]:
            for dtype in args.int_dtype:
                gens[f"atomd_{method}" + ("" if dtype == "float32" else f"_{dtype}")] = atomd_generator(
                    path, args.threads, dtype=dtype, quantization=method, quantized_activations="int8",
                    kv_cache_dtype=args.kv_cache_dtype)
        if args.stdin_rounds:
            serve_rounds(gens, cfg["vocab_size"], tuple(args.workloads))
            return 0
        results = run_workloads(gens, cfg["vocab_size"], args.rounds, tuple(args.workloads))
    torch.set_num_threads(args.threads)
    full = {"batch16", "batch16_first", "prefill"} <= set(args.workloads)
    mm = {d: (matmul_gflops(cfg, 16, DTYPES[d]), matmul_gflops(cfg, 512, DTYPES[d], with_head=False))
          for d in args.dtype if d in DTYPES} if full else {}
    print(f"shape={args.model_shape} threads={args.threads} rounds={args.rounds} (medians) "
          f"load {load_before} -> {loadavg()}")
    names = list(results)
    print(f"{'metric':26} " + " ".join(f"{n:>16}" for n in names) + ("  vs HF" if "hf" in results else ""))
    for key, label in ROWS:
        if key not in results[names[0]]:
            continue
        ratios = " ".join(f"{results[n][key] / results['hf'][key]:.2f}x" for n in names if n != "hf") \
            if "hf" in results else ""
        print(f"{label:26} " + " ".join(f"{results[n][key]:16.1f}" for n in names) + f"  {ratios}")
    # batch 16 run: its 16 x 128 prefill (mean causal context 64, head on 16 rows) plus 16 x 128
    # decode tokens (mean context 192), over the run's time; prefill: 8 x 512, mean context 256
    batch16_flops = (16 * 128 * flops_per_token(cfg, 64, with_head=False) + 16 * 2 * cfg["vocab_size"]
                     * cfg["hidden_size"] + 16 * 128 * flops_per_token(cfg, 192))
    gflops = {}
    for dtype in (mm if full else ()):
        ours = results[f"atomd_{dtype}"]
        decode = batch16_flops / (16 * 128 / ours["batch16"]) / 1e9
        prefill = ours["prefill"] * flops_per_token(cfg, 256, with_head=False) / 1e9
        gflops[dtype] = {"batch16_gflops": decode, "matmul_gflops_m16": mm[dtype][0],
                         "prefill_gflops": prefill, "matmul_gflops_m512": mm[dtype][1]}
        print(f"{dtype}: batch 16 {decode:.1f} GFLOP/s vs best GEMM at M=16 {mm[dtype][0]:.1f} "
              f"({decode / mm[dtype][0]:.0%}); prefill {prefill:.1f} vs M=512 {mm[dtype][1]:.1f} "
              f"({prefill / mm[dtype][1]:.0%})")
    if args.out:
        args.out.write_text(json.dumps({"shape": args.model_shape, "threads": args.threads, "rounds": args.rounds,
                                        "load": [load_before, loadavg()], **results, "gflops": gflops}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
