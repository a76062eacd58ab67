"""Offline throughput: atomd's engine vs Hugging Face `transformers` generate, one run.

Same random Llama checkpoint for both (hidden 512, 8 layers, 8 heads / 4 KV heads,
intermediate 1408, vocab 4096, untied), same thread count, float32:

- batch 1: output tokens/s of one 128-token prompt generating 128 tokens;
- batch 16: output tokens/s of 16 such prompts at once (HF: one batched generate, KV cache on),
  the prompts' prefill included; "decode only" subtracts a 1-token run of the same batch;
- prefill: prompt tokens/s of 8 x 512-token prompts, one output token each;
- achieved GFLOP/s of atomd's decode and prefill against a plain torch matmul chain of the
  same shapes (the model's linear layers at M = 16 and M = 4096) timed in the same run.

    .venv/bin/python -m benchmarks.offline [--threads 2] [--out benchmarks/results/offline.json]
        [--with-torch-attention]   # also atomd on torch SDPA decode attention: the kernel's share
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

import torch

SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=1408, vocab_size=4096, tie_word_embeddings=False, max_position_embeddings=2048)


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


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, SHAPE["vocab_size"], (n, length), generator=g).tolist()


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


def atomd_generator(path: pathlib.Path, threads: int, attention_backend: str = "auto"):
    from atomd import LLM, SamplingParams

    llm = LLM(str(path), num_threads=threads, max_model_len=1024, enable_prefix_caching=False,
              attention_backend=attention_backend)

    def gen(batch: list[list[int]], new: int):
        llm.generate([{"prompt_token_ids": p} for p in batch],
                     SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return gen


# name -> (prompts, prompt length, new tokens, seed); tokens counted: output, or prompt for prefill
WORKLOADS = {"batch1": (1, 128, 128, 1), "batch16": (16, 128, 128, 2), "batch16_first": (16, 128, 1, 2),
             "prefill": (8, 512, 1, 3)}


def run_workloads(gens: dict) -> dict[str, dict[str, float]]:
    """tokens/s per engine per workload; the engines alternate per workload so that both
    see the same background load on a shared machine."""
    for gen in gens.values():
        gen(prompts(2, 16, 9), 4)  # warm-up
    out: dict[str, dict[str, float]] = {name: {} for name in gens}
    for workload, (n, length, new, seed) in WORKLOADS.items():
        batch = prompts(n, length, seed)
        tokens = n * length if workload == "prefill" else n * new
        for name, gen in gens.items():
            out[name][workload] = tokens / timed(lambda: gen(batch, new))
    for r in out.values():  # decode alone: the batch 16 run minus its prefill and first token
        decode_s = 16 * 128 / r["batch16"] - 16 / r.pop("batch16_first")
        r["batch16_decode"] = 16 * 127 / decode_s
    return out


def linear_shapes() -> list[tuple[int, int]]:
    """(out, in) of every matmul of one token's forward, as atomd packs them."""
    h, i, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["vocab_size"]
    d = h // SHAPE["num_attention_heads"]
    kv = SHAPE["num_key_value_heads"] * d
    layer = [(h + 2 * kv, h), (h, h), (2 * i, h), (h, i)]
    return layer * SHAPE["num_hidden_layers"] + [(v, h)]


def flops_per_token(context: float, with_head: bool = True) -> float:
    """Matmul FLOPs of one token (2 per multiply-add) plus attention over `context` keys."""
    shapes = linear_shapes() if with_head else linear_shapes()[:-1]
    attn = 2 * 2 * context * SHAPE["hidden_size"] * SHAPE["num_hidden_layers"]
    return sum(2 * o * k for o, k in shapes) + attn


def matmul_gflops(m: int, with_head: bool = True, repeats: int = 5) -> float:
    """GFLOP/s of a plain chain of F.linear calls with the model's weight shapes at M = m."""
    shapes = linear_shapes() if with_head else linear_shapes()[:-1]
    weights = [torch.randn(o, k) * 0.02 for o, k in shapes]
    xs = {k: torch.randn(m, k) for _, k in shapes}
    with torch.inference_mode():
        for w in weights:
            torch.nn.functional.linear(xs[w.shape[1]], w)
        best = min(timed(lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in weights])
                   for _ in range(repeats))
    return sum(2 * m * o * k for o, k in shapes) / best / 1e9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=pathlib.Path, default=None, help="also write the figures as JSON")
    p.add_argument("--with-torch-attention", action="store_true",
                   help="also run atomd with --attention-backend torch (the native kernel's ablation)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(pathlib.Path(tmp) / "llama")
        gens = {"hf": hf_generator(path), "atomd": atomd_generator(path, args.threads)}
        if args.with_torch_attention:
            gens["atomd_torch_attention"] = atomd_generator(path, args.threads, "torch")
        results = run_workloads(gens)
    hf, ours = results["hf"], results["atomd"]
    torch.set_num_threads(args.threads)
    mm16, mm4096 = matmul_gflops(16), matmul_gflops(4096, with_head=False)
    # batch 16 run: its 16 x 128 prefill (mean causal context 64, head on 16 rows) plus 16 x 128
    # decode tokens (mean context 192), over the run's time; prefill: 8 x 512, mean context 256
    batch16_s = 16 * 128 / ours["batch16"]
    batch16_flops = (16 * 128 * flops_per_token(64, with_head=False) + 16 * 2 * 4096 * 512
                     + 16 * 128 * flops_per_token(192))
    decode_gflops = batch16_flops / batch16_s / 1e9
    prefill_gflops = ours["prefill"] * flops_per_token(256, with_head=False) / 1e9
    rows = [("batch 1 (tok/s)", hf["batch1"], ours["batch1"]),
            ("batch 16 (output tok/s)", hf["batch16"], ours["batch16"]),
            ("batch 16 decode only", hf["batch16_decode"], ours["batch16_decode"]),
            ("prefill 8x512 (tok/s)", hf["prefill"], ours["prefill"])]
    print(f"threads={args.threads} dtype=float32")
    print(f"{'metric':26} {'HF':>9} {'atomd':>9} {'atomd/HF':>9}")
    for name, a, b in rows:
        print(f"{name:26} {a:9.1f} {b:9.1f} {b / a:8.2f}x")
    if args.with_torch_attention:
        alt = results["atomd_torch_attention"]
        print("atomd, native vs torch decode attention (same run):")
        for key, name in (("batch1", "batch 1"), ("batch16", "batch 16"), ("batch16_decode", "batch 16 decode"),
                          ("prefill", "prefill")):
            print(f"  {name:18} {alt[key]:9.1f} -> {ours[key]:9.1f}  {ours[key] / alt[key]:.2f}x")
    print(f"decode batch 16: {decode_gflops:.1f} GFLOP/s vs plain matmul {mm16:.1f} "
          f"({decode_gflops / mm16:.0%})")
    print(f"prefill 8x512: {prefill_gflops:.1f} GFLOP/s vs plain matmul {mm4096:.1f} "
          f"({prefill_gflops / mm4096:.0%})")
    if args.out:
        args.out.write_text(json.dumps({"threads": args.threads, **results,
                                        "decode_gflops": decode_gflops, "matmul_gflops_m16": mm16,
                                        "prefill_gflops": prefill_gflops, "matmul_gflops_m4096": mm4096},
                                       indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
