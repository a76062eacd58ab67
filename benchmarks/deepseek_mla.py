"""DeepSeek-V2-Lite-shaped MLA model (issue #37): what the latent KV cache saves, and how fast.

Checkpoints (random weights, float32 on disk, made in a temporary folder):
- mla: V2-Lite's attention (16 heads, kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128, yarn
  factor 40 with mscale 0.707) with a q_lora_rank of 512 as V2 / V3 have (llama.cpp reads a
  deepseek2 model without q_lora only at V2-Lite's 27 layers), and V2-Lite's MoE shape scaled
  to this machine: hidden 1024, 4 layers (the first dense, intermediate 2816), 32 routed experts of
  352 (top 6, group-limited greedy over 4 groups), 2 shared, vocab 4096;
- gqa: the same model with GQA attention instead of MLA (Qwen3-MoE: 16 query heads, 4 KV
  heads of 128, the same MoE, layers, vocab): a model of similar parameter count.

Measured (one run; the load is recorded before and after, the machine is shared):
1. KV bytes per prompt token of each engine (its cache's block bytes / block size; what PD
   moves per token), and of MLA cached up-projected (16 x (192 + 128) values a layer);
2. PD pull time per 1k prompt tokens: the ZMQ KV connector (KVSender -> KVReceiver, tcp
   loopback, benchmarks/kv_transfer.py's time_ours) moving 64 blocks of each geometry, the two
   geometries alternating, `--rounds` rounds of 20 pulls, medians;
3. the absorbed decode's attention (atomd/model/mla.py) per layer call: on the native kernel,
   in torch (batched matmuls), against the naive up-projected attention (k, v of every context token
   through kv_b_proj each step, as transformers runs it), batch 1 / 16, context 512 / 2048;
4. offline throughput (benchmarks/offline.py's workloads: batch 1 and 16 of 128 + 128 tokens,
   prefill 8 x 512): atomd on the mla checkpoint vs transformers on it, alternating, rounds, medians.

5. with --llama-cpp: llama-bench on the mla checkpoint's F32 GGUF (convert_hf_to_gguf, the
   build of benchmarks/llama_cpp.py): tg128, pp128 + tg128, pp512 (no batch-16 figure: the
   build has llama-bench only).

    nice -n 19 .venv/bin/python -m benchmarks.deepseek_mla [--rounds 3] [--threads 1] [--no-hf] [--llama-cpp]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.machine import loadavg

MLA = dict(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=352, num_hidden_layers=4,
           num_attention_heads=16, num_key_value_heads=16, vocab_size=4096, n_routed_experts=32, n_shared_experts=2,
           num_experts_per_tok=6, n_group=4, topk_group=2, topk_method="group_limited_greedy", first_k_dense_replace=1,
           q_lora_rank=512, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
           routed_scaling_factor=1.0, max_position_embeddings=4096 * 40, bos_token_id=1, eos_token_id=2,
           rope_parameters={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                            "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
                            "rope_theta": 10000.0})
GQA = dict(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=352, num_hidden_layers=4,
           num_attention_heads=16, num_key_value_heads=4, head_dim=128, vocab_size=4096, num_experts=32,
           num_experts_per_tok=6, mlp_only_layers=[0], max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
BLOCK = 16


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make(path: pathlib.Path, kind: str) -> pathlib.Path:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.DeepseekV2Config(**MLA) if kind == "mla" else transformers.Qwen3MoeConfig(**GQA)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t1", "eos_token": "t2"}))
    return path


def params(path: pathlib.Path) -> int:
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", framework="pt") as f:
        return sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())


def kv_bytes_per_token(path: pathlib.Path) -> tuple[int, dict]:
    from atomd.llm import LLM

    engine = LLM(str(path), num_threads=1, max_model_len=1024, num_kvcache_blocks=8).engine
    return engine.kv_cache.block_bytes // engine.kv_cache.block_size, engine.compat


def pull_ms_per_1k(block_bytes: dict[str, int], rounds: int, repeats: int = 20) -> dict[str, float]:
    """Median ms to pull 1024 tokens' blocks over the ZMQ connector, per geometry."""
    from benchmarks.kv_transfer import time_ours
    from kv_transfer.params import compat_fingerprint
    from kv_transfer.zmq_receiver import KVReceiver
    from kv_transfer.zmq_sender import KVSender

    blocks = 1024 // BLOCK
    ends = {}
    for name, size in block_bytes.items():
        rng = np.random.default_rng(0)
        src = np.frombuffer(rng.bytes(blocks * size), dtype=np.uint8).reshape(blocks, size).copy()
        compat = compat_fingerprint("bench", "float32", BLOCK, 1, 1, size, name)
        dst = np.zeros_like(src)
        ends[name] = (KVSender(src, compat), KVReceiver(dst, compat), src, dst)
    times: dict[str, list[float]] = {name: [] for name in block_bytes}
    try:
        for _ in range(rounds):
            for name, (sender, receiver, _, _) in ends.items():
                time_ours(sender, receiver, blocks)  # warm
                times[name] += [time_ours(sender, receiver, blocks) for _ in range(repeats)]
        for name, (_, _, src, dst) in ends.items():
            if not np.array_equal(dst, src):
                raise RuntimeError(f"{name}: the pulled blocks differ from the sent ones")
    finally:
        for sender, receiver, _, _ in ends.values():
            sender.close()
            receiver.close()
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def attention_ms(rounds: int) -> list[dict]:
    """Per layer call of V2-Lite's attention dims: absorbed (kernel, torch) vs naive up-projection."""
    from atomd.engine.kv_cache import AttentionMetadata, KVCache
    from atomd.kernels.native import attention_kernels
    from atomd.model.mla import LatentUp, gather_latent, mla_decode, up_project

    heads, nope, rope, v, rank = 16, 128, 64, 128, 512
    kernels = attention_kernels(rank + rope, heads)
    g = torch.Generator().manual_seed(0)
    up = LatentUp.of(torch.randn(heads * (nope + v), rank, generator=g) * 0.05, heads, nope, v, pack=True)
    rows = []
    for batch, context in ((1, 512), (1, 2048), (16, 512), (16, 2048)):
        width = context // BLOCK
        cache = KVCache(batch * width + 1, 1, BLOCK, 1, rank + rope, planes=1)
        cache.kv.normal_(generator=g)
        tables = (torch.arange(batch * width) + 1).view(batch, width)
        lens = torch.full((batch,), context, dtype=torch.int64)
        q = torch.randn(batch, heads, nope + rope, generator=g)

        def meta(k):
            return AttentionMetadata(False, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), [],
                                     block_tables=tables, max_context=context, context_lens=lens, kernels=k)

        def naive():
            latent = gather_latent(cache, 0, tables)
            out = []
            for b in range(batch):
                k, vv = (t.transpose(0, 1) for t in up_project(latent[b], up, rank))  # [heads, n, d]
                out.append(F.scaled_dot_product_attention(q[b][None, :, None], k.unsqueeze(0), vv.unsqueeze(0),
                                                          scale=0.1))
            return out

        fns = {"absorbed, native kernel": lambda: mla_decode(q, cache, 0, meta(kernels), up, 0.1),
               "absorbed, torch": lambda: mla_decode(q, cache, 0, meta(None), up, 0.1),
               "naive up-projected": naive}
        times: dict[str, list[float]] = {name: [] for name in fns}
        with torch.inference_mode():
            for _ in range(rounds):
                for name, fn in fns.items():
                    fn()
                    for _ in range(5):
                        t0 = time.perf_counter()
                        fn()
                        times[name].append(time.perf_counter() - t0)
        rows.append({"batch": batch, "context": context,
                     **{name: 1000 * statistics.median(t) for name, t in times.items()}})
        log(f"attention b{batch} ctx{context}: {rows[-1]}")
    return rows


def throughput(path: pathlib.Path, threads: int, rounds: int, hf: bool) -> dict[str, dict[str, float]]:
    from benchmarks.offline import atomd_generator, hf_generator, run_workloads

    gens = {"atomd float32": atomd_generator(path, threads)}
    if hf:
        gens["transformers float32"] = hf_generator(path)
    return run_workloads(gens, vocab_size=MLA["vocab_size"], rounds=rounds)


# benchmarks/llama_cpp.py's converter run, plus: our WordLevel tokenizer written as tokenizer
# model "none" for deepseek2 too (its set_vocab wants a GPT-2 BPE); llama-bench never tokenizes
DEEPSEEK_VOCAB = """
from conversion import deepseek
def deepseek_set_vocab(self):
    print("atomd: WordLevel tokenizer: written as tokenizer model 'none'", file=sys.stderr)
    self.gguf_writer.add_tokenizer_model("none")
deepseek.DeepseekV2Model.set_vocab = deepseek_set_vocab
"""


def llama_cpp(path: pathlib.Path, threads: int, rounds: int) -> dict:
    """llama-bench (tg128, pp128 + tg128, pp512; `rounds` repetitions, medians) on the checkpoint's F32 GGUF."""
    import os
    import subprocess

    from benchmarks import llama_cpp as lc

    src, binary = lc.ensure_build(jobs=1)
    gguf = path.parent / "mla-f32.gguf"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src / "gguf-py"), os.environ.get("PYTHONPATH", "")]))
    script = lc.CONVERT.replace("cli.main()", DEEPSEEK_VOCAB + "cli.main()")
    proc = subprocess.run([*lc.NICE, sys.executable, "-c", script, str(src / "convert_hf_to_gguf.py"), str(path),
                           "--outtype", "f32", "--outfile", str(gguf)], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed: {proc.stderr[-3000:]}")
    return lc.bench(binary, gguf, threads, rounds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers in the throughput table")
    ap.add_argument("--llama-cpp", action="store_true", help="also llama-bench on the checkpoint's F32 GGUF "
                    "(benchmarks/llama_cpp.py's build)")
    ap.add_argument("--only-llama-cpp", action="store_true", help="llama-bench alone (debugging the conversion)")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "deepseek_mla.json"))
    args = ap.parse_args()
    if args.rounds < 3:
        ap.error("--rounds must be >= 3 (medians)")
    torch.set_num_threads(args.threads)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    result: dict = {"cpu": cpu, "threads": args.threads, "load_before": loadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        mla = make(pathlib.Path(tmp) / "mla", "mla")
        if args.only_llama_cpp:
            print(json.dumps(llama_cpp(mla, args.threads, args.rounds)))
            return 0
        gqa = make(pathlib.Path(tmp) / "gqa", "gqa")
        result["params"] = {"mla": params(mla), "gqa": params(gqa)}
        per_token = {}
        for name, path in (("mla", mla), ("gqa", gqa)):
            per_token[name], compat = kv_bytes_per_token(path)
            log(f"{name}: {per_token[name]} KV bytes a token, fingerprint {compat}")
        per_token["mla, up-projected k and v"] = MLA["num_hidden_layers"] * MLA["num_attention_heads"] * (
            MLA["qk_nope_head_dim"] + MLA["qk_rope_head_dim"] + MLA["v_head_dim"]) * 4
        result["kv_bytes_per_token"] = per_token
        result["pull_ms_per_1k_tokens"] = pull_ms_per_1k(
            {name: per_token[name] * BLOCK for name in ("mla", "gqa")}, args.rounds)
        log(f"pull ms per 1k tokens: {result['pull_ms_per_1k_tokens']}")
        result["attention_ms_per_layer_call"] = attention_ms(args.rounds)
        result["throughput_tok_s"] = throughput(mla, args.threads, args.rounds, not args.no_hf)
        if args.llama_cpp:
            result["llama_cpp_f32"] = llama_cpp(mla, args.threads, args.rounds)
    result["load_after"] = loadavg()
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
