#!/usr/bin/env python
"""The cost of TP=1's bits in a bf16 MoE block under tensor parallelism (atomd/model/moe.py's
moe_tp): each (token, expert) pair's down partial float32 into the all-reduce ([T * k, hidden]
float32), against the block's output partials in bf16 ([T, hidden], what TP ran before: not
TP=1's greedy ids). Two processes (TP=2, 1 torch thread each) on the shared-memory communicator,
each with its worker's half of every expert's intermediate rows; random weights; a
Qwen3-30B-A3B-like block scaled to fit here: hidden 2048, 32 experts of 768, top-8. Per round the
two variants alternate (order reversed every other round) at each step size; wall seconds per
block call on rank 0 (the collective's waits included) and the all-reduce's share; medians.

    .venv/bin/python -m benchmarks.tp_moe_bf16 --rounds 3
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

HIDDEN, EXPERTS, INTER, TOP_K, TP = 2048, 32, 768, 8, 2


def rank_main(rank: int, group, rounds: int, rows_list, conn) -> None:
    import torch

    from atomd.model.moe import MoeWeights, moe, moe_tp

    torch.set_num_threads(1)
    comm = group.join(rank)
    g = torch.Generator().manual_seed(rank)
    local = INTER // TP
    w = MoeWeights(router=torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(9)).bfloat16(),
                   gate_up=(torch.randn(EXPERTS, 2 * local, HIDDEN, generator=g) * 0.02).bfloat16(),
                   down=(torch.randn(EXPERTS, HIDDEN, local, generator=g) * 0.02).bfloat16(),
                   top_k=TOP_K, norm_topk_prob=True)
    reduce_s = [0.0]

    def reduce_(t):
        t0 = time.perf_counter()
        out = comm.all_reduce_(t)
        reduce_s[0] += time.perf_counter() - t0
        return out

    variants = {"bf16 partials": lambda h: reduce_(moe(h, w)), "exact": lambda h: moe_tp(h, w, reduce_)}
    out: dict[str, list[tuple[float, float]]] = {}
    for r in range(rounds):
        for m in rows_list:
            h = torch.randn(m, HIDDEN, generator=torch.Generator().manual_seed(m)).bfloat16()
            calls = max(2, 64 // m)
            for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                variants[name](h)  # warm-up
                comm.all_reduce_(torch.zeros(1))  # a barrier: both ranks start together
                reduce_s[0], t0 = 0.0, time.perf_counter()
                for _ in range(calls):
                    variants[name](h)
                out.setdefault(f"{m} {name}", []).append(((time.perf_counter() - t0) / calls, reduce_s[0] / calls))
    if rank == 0:
        conn.send(out)
    comm.close()


def main() -> None:
    from atomd.engine.tp_collective import new_tp_group
    from benchmarks.machine import cpu_model, loadavg

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 512])
    args = ap.parse_args()
    before = loadavg()
    ctx = mp.get_context("spawn")
    group = new_tp_group("shm", TP, timeout_s=120)
    recv, send = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=rank_main, args=(r, group, args.rounds, args.rows, send)) for r in range(TP)]
    for p in procs:
        p.start()
    try:
        if not recv.poll(1200):
            raise RuntimeError("the ranks did not finish in 20 minutes")
        res = recv.recv()
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    print(f"CPU {cpu_model()}; load {before} -> {loadavg()}; TP={TP} x 1 thread, shm; MoE block hidden {HIDDEN}, "
          f"{EXPERTS} experts of {INTER} ({INTER // TP} a worker), top-{TOP_K}, bf16; {args.rounds} rounds")
    for m in args.rows:
        med = {v: (statistics.median(t for t, _ in res[f"{m} {v}"]), statistics.median(a for _, a in res[f"{m} {v}"]))
               for v in ("bf16 partials", "exact")}
        (old, old_ar), (new, new_ar) = med["bf16 partials"], med["exact"]
        print(f"M={m:4d}: bf16 partials {old * 1e3:8.3f} ms (all-reduce {old_ar * 1e3:.3f}), exact {new * 1e3:8.3f} ms "
              f"(all-reduce {new_ar * 1e3:.3f}); exact / bf16 {new / old:.2f}x "
              f"(rounds {', '.join(f'{t * 1e3:.2f}' for t, _ in res[f'{m} exact'])} / "
              f"{', '.join(f'{t * 1e3:.2f}' for t, _ in res[f'{m} bf16 partials'])} ms)")


if __name__ == "__main__":
    main()
