#!/usr/bin/env python
"""PD pull of a TP engine's KV, staging vs direct (atomd/engine/tp_pd.py), per 1k prompt tokens.

P and D both TP=N over the smollm-135m shape's cache (30 layers, 3 KV heads of 64, block 16,
float32; N = 3, the split that shape allows: one KV head a worker), one process, the ZMQ
transport over tcp loopback (KVSender -> KVReceiver, each its own I/O thread, as P and D):

  staging  P gathers the blocks' worker slices into TP=1-layout rows (TPKVStaging.gather, after
           the forward that wrote them), D pulls those rows, then scatters them to its workers'
           slices (TPKVStaging.scatter) before the sequence may decode;
  direct   --tp-kv-transfer direct: D pulls P's N slice rows of each block straight into its own
           workers' slices (direct_rows / slice_rows): the same bytes on the wire, no copies.

Each round runs both (alternating which goes first), checks D's cache equals P's, and records
wall and CPU (time.process_time: both ends' threads) seconds; medians over the rounds.

    .venv/bin/python -m benchmarks.tp_pd_pull --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from atomd.engine.tp_pd import TPKVStaging, direct_rows, slice_rows
from benchmarks.machine import cpu_model, loadavg
from kv_transfer.params import compat_fingerprint, new_access_token, new_transfer_id
from kv_transfer.zmq_receiver import KVReceiver
from kv_transfer.zmq_sender import KVSender

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16


def pull(sender: KVSender, receiver: KVReceiver, remote: list[int], local: list[int]) -> None:
    tid, token = new_transfer_id(), new_access_token()
    sender.grant(tid, remote, token, lease_s=60.0)
    receiver.start_pull(tid, *sender.address, token, remote, local, timeout_s=60.0)
    while True:
        receiver.wait(60.0)
        done, failed = receiver.take_finished()
        if done or failed:
            break
    if failed or done != [tid]:
        raise RuntimeError(f"transfer failed: {failed}")
    deadline = time.monotonic() + 10
    while not sender.take_released():  # P's pins released before the next round
        if time.monotonic() > deadline:
            raise RuntimeError("sender never released the transfer")
        time.sleep(0.001)


def timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    n, blocks = args.tp, args.tokens // BLOCK
    shape = (n, blocks, LAYERS, 2, BLOCK, KV_HEADS // n, HEAD_DIM)
    p_kv, d_kv = torch.randn(shape), torch.zeros(shape)
    compat = compat_fingerprint("bench", "float32", BLOCK, LAYERS, KV_HEADS, HEAD_DIM, "bench")
    p_stage, d_stage = TPKVStaging(p_kv, KV_HEADS, "float32"), TPKVStaging(d_kv, KV_HEADS, "float32")
    ends = {"staging": (KVSender(p_stage.blocks, compat), KVReceiver(d_stage.blocks, compat)),
            "direct": (KVSender(direct_rows(p_kv), compat), KVReceiver(direct_rows(d_kv), compat))}
    ids = list(range(blocks))

    def staging() -> None:
        p_stage.gather(ids)
        pull(*ends["staging"], ids, ids)
        d_stage.scatter(ids)

    def direct() -> None:
        rows = slice_rows(ids, n, blocks)
        pull(*ends["direct"], rows, rows)

    print(f"CPU {cpu_model()}; load {loadavg()}; TP={n} both sides, {args.tokens} tokens = {blocks} blocks of "
          f"{p_stage.blocks.shape[1]} bytes ({p_kv.nbytes / 2**20:.1f} MiB)")
    runs: dict[str, list[tuple[float, float]]] = {"staging": [], "direct": []}
    try:
        for r in range(args.rounds):
            for name in (("staging", "direct") if r % 2 == 0 else ("direct", "staging")):
                d_kv.zero_()
                runs[name].append(timed(staging if name == "staging" else direct))
                assert torch.equal(d_kv, p_kv), f"{name}: D's cache differs from P's"
    finally:
        for sender, receiver in ends.values():
            receiver.close()
            sender.close()
    per_k = 1024 / args.tokens
    med = {k: (statistics.median(w for w, _ in v) * per_k, statistics.median(c for _, c in v) * per_k)
           for k, v in runs.items()}
    for name, (wall, cpu) in med.items():
        print(f"{name:8s}: {wall * 1e3:7.2f} ms wall, {cpu * 1e3:7.2f} ms CPU per 1k tokens "
              f"(rounds: {', '.join(f'{w * per_k * 1e3:.1f}' for w, _ in runs[name])} ms)")
    print(f"direct / staging: wall {med['direct'][0] / med['staging'][0]:.2f}x, "
          f"CPU {med['direct'][1] / med['staging'][1]:.2f}x; staging copies {2 * p_kv.nbytes / 2**20:.1f} MiB "
          f"(gather + scatter) per pull, direct none; load after {loadavg()}")


if __name__ == "__main__":
    main()
