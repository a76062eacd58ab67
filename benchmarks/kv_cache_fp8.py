"""The narrow KV caches (--kv-cache-dtype fp8; float16 / bfloat16 under a float32 model) against the
model's own float32 and bfloat16 caches, same run:

  memory     KV bytes per token of the engine's cache (KVCache.block_bytes / block_size) and the
             tokens a 256 MiB cache holds.
  PD pull    one prompt's KV blocks (1024 tokens = 64 blocks) through the real transport
             (KVSender -> KVReceiver over tcp loopback, benchmarks/kv_transfer.time_ours) at each
             dtype's block size: ms per 1k prompt tokens.
  decode     one decode step at batch 1 and batch 8 (--batch), every context 256 tokens
             (--context), in-process engines (one thread): float32 model over a float32 / fp8
             cache, bfloat16 model over a bfloat16 / fp8 cache (--caches: also float32 over float16 /
             bfloat16; --threads, --quantization int8 / int4 for the weights); CPU (the ratios: the
             machine is shared) and wall ms per step.

Rounds alternate the configurations (background load hits them alike); 3 rounds, medians of
each round's median; the load and CPU are recorded. Results are appended to benchmarks/RESULTS.md.

    .venv/bin/python -m benchmarks.kv_cache_fp8 [--shape smollm-135m] [--rounds 3]
        [--caches float32/auto float32/float16 ...] [--threads 1] [--quantization int4]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from benchmarks.kv_transfer import time_ours
from benchmarks.machine import cpu_model, loadavg
from benchmarks.model_shapes import CHOICES, model_dir

CACHES = ["float32/auto", "float32/fp8", "bfloat16/auto", "bfloat16/fp8"]  # model dtype / --kv-cache-dtype


def pull_ms(block_bytes: int, blocks: int, repeats: int) -> float:
    """Median ms of one pull of `blocks` blocks of `block_bytes` through KVSender -> KVReceiver."""
    from kv_transfer.params import compat_fingerprint
    from kv_transfer.zmq_receiver import KVReceiver
    from kv_transfer.zmq_sender import KVSender

    src = np.frombuffer(np.random.default_rng(0).bytes(blocks * block_bytes), np.uint8).reshape(blocks, block_bytes)
    dst = np.zeros_like(src)
    compat = compat_fingerprint("bench", "float32", 16, 1, 1, block_bytes, "bench")
    sender, receiver = KVSender(src, compat), KVReceiver(dst, compat)
    try:
        time_ours(sender, receiver, blocks)  # connections, handshakes, pages
        return 1000 * statistics.median(time_ours(sender, receiver, blocks) for _ in range(repeats))
    finally:
        receiver.close()
        sender.close()


def decode_ms(llm, batch: int, context: int, steps: int) -> tuple[float, float]:
    """Median wall and CPU ms of a decode step of `batch` sequences at about `context` tokens."""
    from contracts.sampling import SamplingParams

    engine = llm.engine
    rng = np.random.default_rng(batch)
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}-{time.monotonic_ns()}",
                           rng.integers(10, 4000, context).tolist(), params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                          for s in engine.scheduler.running):
        engine.step()  # the prefills
    walls, cpus = [], []
    for _ in range(steps):
        w, c = time.perf_counter(), time.process_time()
        engine.step()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    while engine.has_unfinished_requests():
        engine.step()
    return 1000 * statistics.median(walls), 1000 * statistics.median(cpus)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm-135m", choices=CHOICES)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="the larger decode batch (besides batch 1)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per batch and round")
    ap.add_argument("--pull-repeats", type=int, default=9)
    ap.add_argument("--caches", nargs="+", default=CACHES, help="model dtype / --kv-cache-dtype pairs; each "
                    "model dtype's auto is the baseline of its rows")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quantization", default=None, help="the engines' weights (int8, int4); default the checkpoint's")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "RESULTS.md"))
    args = ap.parse_args()
    if args.rounds < 3:
        ap.error("--rounds must be >= 3 (medians)")
    from atomd.llm import LLM

    path = model_dir(args.shape)
    caches = [tuple(c.split("/")) for c in args.caches]
    if any(len(c) != 2 for c in caches) or any((d, "auto") not in caches for d, _ in caches):
        ap.error("--caches: dtype/kv pairs, each dtype with its dtype/auto baseline")
    load_before = loadavg()
    llms = {(d, kv): LLM(str(path), dtype=d, kv_cache_dtype=kv, num_threads=args.threads, max_model_len=args.context + 64,
                         kv_cache_memory=256 << 20, max_num_seqs=max(args.batch, 1), quantization=args.quantization)
            for d, kv in caches}
    per_token = {key: llm.engine.kv_cache.block_bytes // llm.engine.kv_cache.block_size for key, llm in llms.items()}
    tokens = {key: llm.engine.kv_cache.num_blocks * llm.engine.kv_cache.block_size for key, llm in llms.items()}
    pulls: dict[tuple, list[float]] = {key: [] for key in caches}
    steps: dict[tuple, list[tuple]] = {(key, b): [] for key in caches for b in (1, args.batch)}
    for r in range(args.rounds):
        for key in caches if r % 2 == 0 else caches[::-1]:
            pulls[key].append(pull_ms(per_token[key] * 16, 64, args.pull_repeats))
            for b in (1, args.batch):
                steps[(key, b)].append(decode_ms(llms[key], b, args.context, args.steps))
        print(f"round {r + 1} done, load {loadavg()}", flush=True)
    load_after = loadavg()

    def med(values):
        return statistics.median(values)

    lines = [f"\n## Narrow KV caches (#35): memory, PD pull and decode step, {args.shape} shape\n",
             f"`python -m benchmarks.kv_cache_fp8 --shape {args.shape} --caches {' '.join(args.caches)} --threads "
             f"{args.threads}{f' --quantization {args.quantization}' if args.quantization else ''}`: {cpu_model()}, "
             f"load {load_before} -> {load_after}, {args.rounds} rounds alternating the caches, medians; "
             f"{args.threads} thread(s) per engine; "
             f"contexts {args.context}; pull = 1024 prompt tokens (64 blocks) KVSender -> KVReceiver on loopback.\n",
             "| model / cache | KV bytes/token | tokens in 256 MiB | PD pull ms / 1k tokens | vs model dtype's | "
             f"batch-1 step CPU ms (wall) | CPU vs | batch-{args.batch} step CPU ms (wall) | CPU vs |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for d, kv in caches:
        base = (d, "auto")
        row = [f"{d} / {'fp8_e4m3' if kv == 'fp8' else d if kv == 'auto' else kv}", str(per_token[(d, kv)]), str(tokens[(d, kv)]),
               f"{med(pulls[(d, kv)]):.2f}", f"{med(pulls[(d, kv)]) / med(pulls[base]):.2f}x"]
        for b in (1, args.batch):
            wall = med(w for w, _ in steps[((d, kv), b)])
            cpu = med(c for _, c in steps[((d, kv), b)])
            base_cpu = med(c for _, c in steps[(base, b)])
            row += [f"{cpu:.1f} ({wall:.1f})", f"{cpu / base_cpu:.2f}x"]
        lines.append("| " + " | ".join(row) + " |")
    lines.append(f"\nPer round (pull ms; batch-1 / batch-{args.batch} CPU ms): " + "; ".join(
        f"{d}/{kv}: " + ", ".join(f"{p:.2f}" for p in pulls[(d, kv)]) + " / " +
        ", ".join(f"{c:.1f}" for _, c in steps[((d, kv), 1)]) + " / " +
        ", ".join(f"{c:.1f}" for _, c in steps[((d, kv), args.batch)]) for d, kv in caches) + "\n")
    text = "\n".join(lines)
    print(text)
    with open(args.out, "a") as f:
        f.write(text)


if __name__ == "__main__":
    main()
