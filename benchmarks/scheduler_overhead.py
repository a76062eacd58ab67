"""Scheduler overhead: CPU time of schedule() + postprocess() per engine step, no model.

    .venv/bin/python -m benchmarks.scheduler_overhead [--steps 200] [--seqs 256]

Cases: a steady decode step with N running sequences (prefix caching on and off, and
with 2 speculative tokens), and a burst of 64 prompts admitted through chunked prefill.
The "model" returns a fixed token, so the numbers are the scheduler's own cost.
"""
from __future__ import annotations

import argparse
import statistics
import time

from atomd.config import EngineConfig
from scheduler.scheduler import ScheduledBatchOutput, Scheduler, SchedulerConfig
from contracts.sampling import SamplingParams
from scheduler.sequence import Sequence


def fake_output(batch, spec: int) -> ScheduledBatchOutput:
    n = len(batch.seqs)
    tokens = [[7] * (1 + len(d)) for d in batch.spec_token_ids] if spec else [[7]] * n
    if batch.is_prefill:
        tokens = [[7] if s else [] for s in batch.needs_sample]
    drafts = [[7] * spec] * n if spec else None
    return ScheduledBatchOutput([s.id for s in batch.seqs], tokens, draft_token_ids=drafts)


def make(num_seqs: int, prompt_len: int, prefix: bool, spec: int) -> Scheduler:
    engine = EngineConfig()  # the engine's defaults, then this benchmark's shape
    cfg = SchedulerConfig(num_kvcache_blocks=num_seqs * (prompt_len + 4096) // 16 + 16,
                          max_num_seqs=num_seqs, max_num_batched_tokens=8192, max_model_len=8192,
                          block_size=engine.block_size, enable_prefix_caching=prefix,
                          enable_chunked_prefill=engine.enable_chunked_prefill,
                          scheduler_delay_factor=engine.scheduler_delay_factor,
                          long_prefill_token_threshold=engine.long_prefill_token_threshold,
                          num_speculative_tokens=spec, eos_token_id=0)
    return Scheduler(cfg)


def prompts(num: int, length: int) -> list[Sequence]:
    return [Sequence([(i * 31 + j) % 30000 + 1 for j in range(length)], SamplingParams(max_tokens=4000))
            for i in range(num)]


def timed_step(sched: Scheduler, spec: int) -> tuple[float, bool]:
    t0 = time.perf_counter()
    batch = sched.schedule()
    t1 = time.perf_counter()
    out = fake_output(batch, spec)  # not timed: the model's part
    t2 = time.perf_counter()
    sched.postprocess(batch, out)
    t3 = time.perf_counter()
    return (t1 - t0) + (t3 - t2), batch.is_prefill


def decode_case(num_seqs: int, steps: int, prefix: bool, spec: int) -> float:
    sched = make(num_seqs, 128, prefix, spec)
    for seq in prompts(num_seqs, 128):
        sched.add(seq)
    while timed_step(sched, spec)[1]:
        pass  # get every sequence past its prefill
    return statistics.median(timed_step(sched, spec)[0] for _ in range(steps))


def burst_case(num_reqs: int = 64, prompt_len: int = 1000) -> tuple[float, int]:
    sched = make(num_reqs, prompt_len, True, 0)
    for seq in prompts(num_reqs, prompt_len):
        sched.add(seq)
    total, steps = 0.0, 0
    while True:
        dt, was_prefill = timed_step(sched, 0)
        if not was_prefill:
            return total, steps
        total, steps = total + dt, steps + 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seqs", type=int, default=256)
    args = ap.parse_args()
    rows = []
    base = decode_case(args.seqs, args.steps, True, 0)
    rows.append((f"decode, {args.seqs} running, prefix cache on", base))
    rows.append((f"decode, {args.seqs} running, prefix cache off", decode_case(args.seqs, args.steps, False, 0)))
    rows.append((f"decode, {args.seqs} running, 2 speculative tokens", decode_case(args.seqs, args.steps, True, 2)))
    rows.append(("decode, 32 running, prefix cache on", decode_case(32, args.steps, True, 0)))
    total, steps = burst_case()
    rows.append((f"prefill burst, 64 x 1000 tokens: {steps} steps, per step", total / steps))
    print("| case | ms per step (median) | vs. 256-seq decode |")
    print("|---|---|---|")
    for name, sec in rows:
        print(f"| {name} | {sec * 1e3:.3f} | {sec / base:.2f}x |")
    print(f"\nprefill burst total: {total * 1e3:.2f} ms for {steps} steps")


if __name__ == "__main__":
    main()
