#!/usr/bin/env python
"""Expert parallelism's exchange on this host: the per-layer all-to-all, gloo against shared
memory, and against the step it sits in. Two rank processes, one torch thread each.

`transport`: one sparse layer's exchange as ExpertParallel runs it (the counts, the rows out,
the outputs back: three all-to-alls), each rank sending `rows` x top_k rows of the shape's
hidden size split evenly over the ranks; gloo (`GlooCollective.all_to_all`) and shared memory
(benchmarks/shm_all_to_all.py) alternate per round; median microseconds per exchange.

`step`: each rank an expert-parallel LLMEngine (the shape of `--shape`, its experts split)
decoding `--batch` sequences; the step time and the time in the exchanges per sparse layer,
against the same batch on an engine holding every expert (a DP replica), per transport.

    .venv/bin/python -m benchmarks.expert_parallel --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

from benchmarks.machine import cpu_model, loadavg
from benchmarks.model_shapes import CHOICES, model_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_comms(rank: int, world: int, port: int, capacity: int):
    from atomd.engine.dp_collective import GlooCollective
    from benchmarks.shm_all_to_all import ShmAllToAll

    gloo = GlooCollective(rank, world, port, timeout_s=60, join_timeout_s=120)
    shm = ShmAllToAll(f"atomd-ep-bench-{port}", rank, world, capacity, timeout_s=60)
    gloo.barrier()
    shm.connect()
    shm.all_reduce_sum = gloo.all_reduce_sum  # the step's gate (ExpertParallel.anyone_has_rows): gloo's
    return {"gloo": gloo, "shm": shm}


def exchange(comm, rows: int, k: int, hidden: int, world: int) -> None:
    """One sparse layer's three all-to-alls for `rows` tokens a rank, spread evenly."""
    per = [rows * k // world] * world
    counts = torch.full((world * 4,), rows * k // (world * 4), dtype=torch.int64)
    recv = torch.empty_like(counts)
    comm.all_to_all(recv, counts, [4] * world, [4] * world)
    x = torch.randn(rows * k, hidden) if rows else torch.empty(0, hidden)
    got = torch.empty(sum(per), hidden)
    comm.all_to_all(got, x, per, per)
    comm.all_to_all(x, got, per, per)


def transport_rank(rank: int, world: int, port: int, args: dict, out: str) -> None:
    torch.set_num_threads(1)
    hidden, k = args["hidden"], args["k"]
    comms = make_comms(rank, world, port, max(args["rows"]) * k * hidden * 4 + 4096)
    results: dict[str, list[float]] = {}
    for _ in range(args["rounds"]):
        for rows in args["rows"]:
            for name, comm in comms.items():
                for _ in range(5):
                    exchange(comm, rows, k, hidden, world)
                n = max(20, 2000 // max(rows, 1))
                comms["gloo"].barrier()
                start = time.perf_counter()
                for _ in range(n):
                    exchange(comm, rows, k, hidden, world)
                results.setdefault(f"{rows}/{name}", []).append((time.perf_counter() - start) / n * 1e6)
    comms["shm"].close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def step_rank(rank: int, world: int, port: int, args: dict, out: str) -> None:
    torch.set_num_threads(1)
    from atomd.config import EngineConfig
    from atomd.engine.llm_engine import LLMEngine
    from contracts.sampling import SamplingParams

    path = args["model"]
    cfg = json.loads(open(os.path.join(path, "config.json")).read())
    hidden, k = cfg["hidden_size"], cfg["num_experts_per_tok"]
    # a rank sends back the outputs of every rank's rows
    comms = make_comms(rank, world, port, world * args["batch"] * args["prompt_len"] * k * hidden * 4 + 4096)
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(rank)
    prompts = [torch.randint(10, 4000, (args["prompt_len"],), generator=g).tolist() for _ in range(args["batch"])]
    results: dict[str, list[float]] = {}

    def engine_for(name: str) -> LLMEngine:
        base = dict(model=path, num_threads=1, max_model_len=2048, max_num_seqs=args["batch"])
        if name == "replica":
            return LLMEngine(EngineConfig(**base))
        return LLMEngine(EngineConfig(**base, data_parallel_size=world, data_parallel_rank=rank,
                                      enable_expert_parallel=True), expert_group=comms[name])

    engines = {name: engine_for(name) for name in ("gloo", "shm", "replica")}
    for rnd in range(args["rounds"]):
        for name, engine in engines.items():
            for i, p in enumerate(prompts):
                engine.add_request(f"{rnd}-{i}", p, params)
            while engine.scheduler.waiting:  # the prefills, then decode only
                engine.step()
            ep = engine.model.ep
            comms["gloo"].barrier()
            before = ep.exchange_s if ep else 0.0
            start = time.perf_counter()
            for _ in range(args["steps"]):
                engine.step()
            elapsed = time.perf_counter() - start
            layers = len(engine.model.config.sparse_layers)
            results.setdefault(f"{name}/step_ms", []).append(elapsed / args["steps"] * 1e3)
            if ep:
                results.setdefault(f"{name}/layer_exchange_ms", []).append(
                    (ep.exchange_s - before) / (args["steps"] * layers) * 1e3)
            for i in range(len(prompts)):
                engine.abort_request(f"{rnd}-{i}")
            engine.step()
            comms["gloo"].barrier()
    comms["shm"].close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shape", choices=CHOICES, default="qwen3-moe-small")
    ap.add_argument("--rows", default="1,16,256,2048", help="transport: tokens a rank per exchange")
    ap.add_argument("--batch", type=int, default=16, help="step: sequences decoding on each rank")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--parts", default="transport,step")
    args = ap.parse_args()
    path = str(model_dir(args.shape))
    cfg = json.loads(open(os.path.join(path, "config.json")).read())
    print(f"CPU: {cpu_model()}; load average before: {loadavg()}; shape {args.shape}: hidden {cfg['hidden_size']}, "
          f"{cfg['num_hidden_layers']} sparse layers, {cfg.get('num_experts') or cfg['num_local_experts']} experts "
          f"top-{cfg['num_experts_per_tok']}")
    world, work = 2, tempfile.mkdtemp(prefix="atomd-ep-bench-")
    if "transport" in args.parts:
        rows = [int(r) for r in args.rows.split(",")]
        out = os.path.join(work, "transport.json")
        mp.spawn(transport_rank, args=(world, free_port(), dict(rows=rows, hidden=cfg["hidden_size"],
                 k=cfg["num_experts_per_tok"], rounds=args.rounds), out), nprocs=world)
        res = json.load(open(out))
        print(f"\none sparse layer's exchange (3 all-to-alls), us, median of {args.rounds} rounds (rank 0)\n")
        print("| tokens a rank | rows out (x top-k) | gloo us | shm us | gloo / shm |")
        print("|---|---|---|---|---|")
        for r in rows:
            g, s = statistics.median(res[f"{r}/gloo"]), statistics.median(res[f"{r}/shm"])
            print(f"| {r} | {r * cfg['num_experts_per_tok']} | {g:.0f} | {s:.0f} | {g / s:.1f}x |")
    if "step" in args.parts:
        out = os.path.join(work, "step.json")
        mp.spawn(step_rank, args=(world, free_port(), dict(model=path, batch=args.batch, prompt_len=args.prompt_len,
                 steps=args.steps, rounds=args.rounds), out), nprocs=world)
        res = json.load(open(out))
        med = {k: statistics.median(v) for k, v in res.items()}
        layers = cfg["num_hidden_layers"]
        print(f"\ndecode step of {args.batch} sequences a rank (context ~{args.prompt_len}), ms, median of "
              f"{args.rounds} rounds (rank 0)\n")
        print("| engine | step ms | exchange per sparse layer ms | exchanges' share of the step | step vs replica |")
        print("|---|---|---|---|---|")
        for name in ("replica", "gloo", "shm"):
            ex = med.get(f"{name}/layer_exchange_ms")
            share = f"{ex:.2f} | {ex * layers / med[f'{name}/step_ms']:.0%}" if ex is not None else "- | -"
            print(f"| {'EP=2 ' + name if name != 'replica' else 'DP replica (all experts)'} | "
                  f"{med[f'{name}/step_ms']:.2f} | {share} | {med[f'{name}/step_ms'] / med['replica/step_ms']:.2f} |")
    print(f"\nload average after: {loadavg()}", file=sys.stdout)


if __name__ == "__main__":
    main()
