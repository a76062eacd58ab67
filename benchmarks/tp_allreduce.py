"""TP all-reduce latency per call: the shared-memory communicator vs gloo, same run.

Two processes (1 torch thread each) join one ShmCommunicator, one GlooCommunicator (its
all-reduce: an all-gather and a rank-order sum, so both give the same bits) and, as gloo's
own number, a plain gloo all-reduce (ring; rank-dependent order) on the same group. Shapes:
rows x hidden for the hidden sizes of the benchmark model shapes (576, 1024, 2048, 4096) at
1 / 16 / 512 rows, fp32 and bf16. Per round, the three run one after another on each shape
(same load), each timed over enough calls for ~10 ms; the ranks line up on a shm barrier
before each timing. Medians over the rounds; ratios gloo / shm.

    .venv/bin/python -m benchmarks.tp_allreduce --rounds 5 [--append-results]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

HIDDEN = (576, 1024, 2048, 4096)
ROWS = (1, 16, 512)
DTYPES = ("float32", "bfloat16")
VARIANTS = ("shm", "gloo", "gloo_ring")


def rank_main(rank: int, groups, rounds: int, conn) -> None:
    import torch

    torch.set_num_threads(1)
    shm, gloo = (g.join(rank) for g in groups)
    from torch._C._distributed_c10d import AllreduceOptions

    def ring(t):  # gloo's own all-reduce, for reference
        gloo.group.allreduce([t], AllreduceOptions()).wait()

    calls = {"shm": shm.all_reduce_, "gloo": gloo.all_reduce_, "gloo_ring": ring}
    out: dict[str, list[float]] = {}
    for _ in range(rounds):
        for dtype in DTYPES:
            for hidden in HIDDEN:
                for rows in ROWS:
                    t = torch.randn(rows, hidden).to(getattr(torch, dtype))
                    iters = max(3, min(400, int(2e6 / (t.numel() * t.element_size()))))
                    for name in VARIANTS:
                        shm.all_reduce_(torch.zeros(1))  # a barrier: both ranks start together
                        t0 = time.perf_counter()
                        for _ in range(iters):
                            calls[name](t)
                        out.setdefault(f"{dtype} {rows}x{hidden} {name}", []).append(
                            (time.perf_counter() - t0) / iters)
    if rank == 0:
        conn.send(out)
    shm.close()
    gloo.close()


def measure(rounds: int) -> dict[str, list[float]]:
    from atomd.engine.tp_collective import new_tp_group

    ctx = mp.get_context("spawn")
    groups = (new_tp_group("shm", 2, timeout_s=60), new_tp_group("gloo", 2, timeout_s=60))
    recv, send = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=rank_main, args=(r, groups, rounds, send)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        if not recv.poll(1800):
            raise RuntimeError("the ranks did not finish in 30 minutes")
        return recv.recv()
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def table(results: dict[str, list[float]], rounds: int, load_before: str, load_after: str) -> str:
    from benchmarks.machine import cpu_model

    lines = [f"`benchmarks/tp_allreduce.py --rounds {rounds}`: 2 processes x 1 thread, {cpu_model()}, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {load_before} -> {load_after}. "
             "Latency per call, median of the rounds (us); gloo = GlooCommunicator (all-gather + "
             "rank-order sum, same bits as shm), gloo_ring = gloo's own all-reduce.", "",
             "| dtype | rows x hidden | shm us | gloo us | gloo_ring us | gloo / shm | gloo_ring / shm |",
             "|---|---|---|---|---|---|---|"]
    for dtype in DTYPES:
        for hidden in HIDDEN:
            for rows in ROWS:
                med = {v: statistics.median(results[f"{dtype} {rows}x{hidden} {v}"]) * 1e6 for v in VARIANTS}
                lines.append(f"| {dtype} | {rows}x{hidden} | {med['shm']:.0f} | {med['gloo']:.0f} | "
                             f"{med['gloo_ring']:.0f} | {med['gloo'] / med['shm']:.2f}x | "
                             f"{med['gloo_ring'] / med['shm']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    from benchmarks.machine import loadavg

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, help="also write the raw per-round seconds here")
    ap.add_argument("--append-results", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = ap.parse_args()
    if args.rounds < 3:
        ap.error("--rounds must be >= 3 (medians)")
    before = loadavg()
    results = measure(args.rounds)
    text = table(results, args.rounds, before, loadavg())
    print(text)
    if args.json:
        args.json.write_text(json.dumps(results))
    if args.append_results:
        with open(Path(__file__).with_name("RESULTS.md"), "a") as f:
            f.write("\n\n## TP all-reduce: shared memory vs gloo, 2 processes (issue 41)\n" + text + "\n")


if __name__ == "__main__":
    main()
