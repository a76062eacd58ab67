#!/usr/bin/env python
"""LoRA serving (issue 39): what batched adapters cost a decode step.

A batch of 16 requests decoding together (128 prompt tokens each), in process (LLMEngine),
with no adapter (the base model) and with 1, 4 and 16 distinct adapters (request i under
adapter i mod k, so an adapter's rows are not contiguous: the gather / index_add path), at
rank 8 and rank 64, every target (q, k, v, o, gate, up, down), in the forms of atomd/model/lora.py's LoraStep
(`--modes`: sgmv, the C kernel float32 runs; stacked with a mask; grouped by adapter) where more than
one adapter runs (one adapter: the first mode). Random adapters in PEFT's
file format, written here. Each round runs every configuration back to back on the same
prompts and takes the median step time (the engine thread's CPU time, 1 torch thread: the
wall clock of a shared 2-core machine mostly measures the other jobs) over --steps decode
steps (and the wall time beside it); a configuration's ratio
is its median over rounds of (its step / that round's base step). Target: <= 1.15x at 4
adapters of rank 8. The load average is printed before and after (the machine is shared).

    .venv/bin/python -m benchmarks.lora_overhead --rounds 3
    .venv/bin/python -m benchmarks.lora_overhead --rounds 3 --model-shape smollm-135m
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
from safetensors.torch import save_file

from atomd.config import EngineConfig
from atomd.engine.llm_engine import LLMEngine
from atomd.model.config import ModelConfig
from atomd.model.lora import LoraStep
from atomd.model.loader import read_config
from benchmarks.machine import loadavg
from benchmarks.model_shapes import CHOICES, model_dir
from contracts.sampling import SamplingParams

BATCH = 16
TARGETS = {"self_attn": ["q_proj", "k_proj", "v_proj", "o_proj"], "mlp": ["gate_proj", "up_proj", "down_proj"]}


def write_adapter(path: pathlib.Path, cfg: ModelConfig, rank: int, seed: int) -> pathlib.Path:
    """A random PEFT LoRA adapter of `rank` on every target of every layer."""
    g = torch.Generator().manual_seed(seed)
    dims = {"q_proj": (cfg.hidden_size, cfg.q_size), "k_proj": (cfg.hidden_size, cfg.kv_size),
            "v_proj": (cfg.hidden_size, cfg.kv_size), "o_proj": (cfg.q_size, cfg.hidden_size),
            "gate_proj": (cfg.hidden_size, cfg.intermediate_size), "up_proj": (cfg.hidden_size, cfg.intermediate_size),
            "down_proj": (cfg.intermediate_size, cfg.hidden_size)}
    tensors = {}
    for i in range(cfg.num_layers):
        for block, names in TARGETS.items():
            for name in names:
                fan_in, fan_out = dims[name]
                key = f"base_model.model.model.layers.{i}.{block}.{name}"
                tensors[key + ".lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.02
                tensors[key + ".lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sum(TARGETS.values(), []),
        "bias": "none"}))
    return path


def decode_step_ms(engine: LLMEngine, prompts: list[list[int]], loras: list[str | None], steps: int,
                   tag: str) -> tuple[float, float]:
    """(median CPU ms, median wall ms) of a decode step of the batch under `loras`."""
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    sp = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    for rid, prompt, lora in zip(ids, prompts, loras):
        engine.add_request(rid, prompt, sp, lora_name=lora)
    s = engine.scheduler
    while s.waiting or s._prefilling:
        engine.step()
    for _ in range(5):
        engine.step()
    times, walls = [], []
    for _ in range(steps):  # CPU time of this thread (torch runs the step on it with 1 thread):
        t, w = time.thread_time(), time.perf_counter()  # on a shared machine the wall clock mostly
        engine.step()  # measures the neighbours
        times.append((time.thread_time() - t) * 1e3)
        walls.append((time.perf_counter() - w) * 1e3)
    assert len(s.running) == len(prompts), "a request finished during the measurement"
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times), statistics.median(walls)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--model-shape", choices=CHOICES, default="builtin")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--modes", nargs="+", default=["stacked", "grouped"],
                    help="LoraStep forms compared at more than one adapter (atomd/model/lora.py; auto: "
                         "the engine's own choice)")
    args = ap.parse_args()
    model = model_dir(args.model_shape)
    cfg = read_config(model)
    print(f"load before: {loadavg()}; cpu: {platform.processor() or platform.machine()}; model {args.model_shape}, "
          f"{args.dtype}, 1 thread", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        modules = [f"r{rank}-{i}={write_adapter(pathlib.Path(tmp) / f'r{rank}-{i}', cfg, rank, seed=rank * 100 + i)}"
                   for rank in args.ranks for i in range(max(args.adapters))]
        engine = LLMEngine(EngineConfig(model=str(model), dtype=args.dtype, num_threads=1, enable_lora=True,
                                        lora_modules=modules, max_loras=len(modules), max_lora_rank=max(args.ranks),
                                        enable_prefix_caching=False, max_model_len=512))
        rng = np.random.default_rng(0)
        prompts = [[int(t) for t in rng.integers(10, cfg.vocab_size, 128)] for _ in range(BATCH)]
        configs = {"base": ([None] * BATCH, "stacked")}
        for rank in args.ranks:
            for k in args.adapters:
                for mode in args.modes if k > 1 else args.modes[:1]:
                    configs[f"{k} x rank {rank}" + (f" {mode}" if k > 1 else "")] = \
                        ([f"r{rank}-{i % k}" for i in range(BATCH)], mode)
        ratios: dict[str, list[float]] = {name: [] for name in configs}
        wall_ratios: dict[str, list[float]] = {name: [] for name in configs}
        steps: dict[str, list[float]] = {name: [] for name in configs}
        walls: dict[str, list[float]] = {name: [] for name in configs}
        for r in range(args.rounds):
            base = None
            for name, (loras, mode) in configs.items():
                LoraStep.mode = mode
                ms, wall = decode_step_ms(engine, prompts, loras, args.steps, f"r{r}-{name}")
                base = (ms, wall) if base is None else base
                steps[name].append(ms)
                walls[name].append(wall)
                ratios[name].append(ms / base[0])
                wall_ratios[name].append(wall / base[1])
            print(f"round {r + 1}: " + ", ".join(f"{n} {steps[n][-1]:.2f} ms" for n in configs), flush=True)
    print(f"load after: {loadavg()}")
    print("\n| adapters in the batch of 16 | step CPU (ms, median) | vs base, CPU | step wall (ms, median) "
          "| vs base, wall |\n|---|---:|---:|---:|---:|")
    for name in configs:
        print(f"| {name} | {statistics.median(steps[name]):.2f} | {statistics.median(ratios[name]):.3f}x "
              f"| {statistics.median(walls[name]):.2f} | {statistics.median(wall_ratios[name]):.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
