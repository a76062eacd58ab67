#!/usr/bin/env python
"""PD pull of a TP engine's KV, staging vs direct (atomd/engine/tp_pd.py), per 1k prompt tokens.

P with TP=a and D with TP=b over a model shape's cache, one process, the ZMQ transport over tcp
loopback (KVSender -> KVReceiver, each its own I/O thread, as P and D):

  staging  P gathers the blocks' worker slices into TP=1-layout rows (TPKVStaging.gather, after
           the forward that wrote them; a TP=1 P's blocks are those rows), D pulls those rows,
           then scatters them to its workers' slices (TPKVStaging.scatter) before the sequence may
           decode;
  direct   --tp-kv-transfer direct: D pulls P's slice rows straight into its own workers' slices
           (direct_rows / direct_pull: each set of KV heads once, a replicating worker's copy made
           on D when the pull lands); only where each worker holds as many heads on both sides.

Shapes: `135m` (smollm-135m: 30 layers, 3 KV heads of 64, block 16, float32; TP=3 the split it
allows: one KV head a worker) and `mla` (deepseek-v2-lite's latent cache: 27 layers, one
576-wide latent row a token, bf16, every worker caching all of it). Each round runs both
(alternating which goes first), checks every D worker's slices against P's blocks, and records wall
and CPU (time.process_time: both ends' threads) seconds; medians over the rounds.

    .venv/bin/python -m benchmarks.tp_pd_pull --rounds 3                      # 135m, TP=3 -> TP=3
    .venv/bin/python -m benchmarks.tp_pd_pull --shape mla --p-tp 1 --d-tp 2 --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from atomd.engine.tp_pd import TPKVStaging, direct_pull, direct_rows
from benchmarks.machine import cpu_model, loadavg
from contracts.kv_layout import TPKVLayout, convert_block, slices_match
from kv_transfer.params import compat_fingerprint, new_access_token, new_transfer_id
from kv_transfer.zmq_receiver import KVReceiver
from kv_transfer.zmq_sender import KVSender

BLOCK = 16
# (layers, planes, KV heads, head_dim, dtype)
SHAPES = {"135m": (30, 2, 3, 64, torch.float32), "mla": (27, 1, 1, 576, torch.bfloat16)}


def cache(tp: int, blocks: int, shape: tuple) -> torch.Tensor:
    """A TP engine's shared cache [N, blocks, layers, planes, block, heads a worker, head_dim] (TP=1: N = 1)."""
    layers, planes, heads, head_dim, dtype = shape
    return torch.zeros(tp, blocks, layers, planes, BLOCK, max(1, heads // tp), head_dim, dtype=dtype)


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
    ap.add_argument("--shape", choices=sorted(SHAPES), default="135m")
    ap.add_argument("--p-tp", type=int, default=3)
    ap.add_argument("--d-tp", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    shape, blocks = SHAPES[args.shape], args.tokens // BLOCK
    layers, planes, heads, head_dim, dtype = shape
    name = str(dtype).removeprefix("torch.")
    p_layout, d_layout = (TPKVLayout(tp, heads, head_dim, planes, layers, BLOCK, name) for tp in (args.p_tp, args.d_tp))
    if not slices_match(p_layout, d_layout):
        raise SystemExit(f"direct cannot pair {p_layout.describe()} with {d_layout.describe()}")
    p_kv, d_kv = cache(args.p_tp, blocks, shape), cache(args.d_tp, blocks, shape)
    p_kv.view(torch.uint8).copy_(torch.randint(0, 256, p_kv.view(torch.uint8).shape, dtype=torch.uint8))
    compat = compat_fingerprint("bench", "float32", BLOCK, layers, heads, head_dim, "bench")
    # the TP=1 layout's rows: a TP=1 engine's cache as it is, a TP engine's staging copy
    p_stage = TPKVStaging(p_kv, heads, name) if args.p_tp > 1 else None
    d_stage = TPKVStaging(d_kv, heads, name) if args.d_tp > 1 else None
    p_wire = p_stage.blocks if p_stage else direct_rows(p_kv)
    d_wire = d_stage.blocks if d_stage else direct_rows(d_kv)
    d_rows = direct_rows(d_kv)
    ends = {"staging": (KVSender(p_wire, compat), KVReceiver(d_wire, compat)),
            "direct": (KVSender(direct_rows(p_kv), compat), KVReceiver(d_rows, compat))}
    ids = list(range(blocks))
    want = [convert_block(p_layout, d_layout, [p_kv[w, b].view(torch.uint8).numpy() for w in range(args.p_tp)])
            for b in ids]  # every D worker's slice of each block

    def staging() -> None:
        if p_stage:
            p_stage.gather(ids)
        pull(*ends["staging"], ids, ids)
        if d_stage:
            d_stage.scatter(ids)

    def direct() -> None:
        remote, local, copies = direct_pull(p_layout, d_layout, ids, ids, blocks, blocks)
        pull(*ends["direct"], remote, local)
        for src, dst in copies:  # TPDirectConnector.get_finished
            d_rows[dst * blocks:(dst + 1) * blocks] = d_rows[src * blocks:(src + 1) * blocks]

    print(f"CPU {cpu_model()}; load {loadavg()}; {args.shape}: P {p_layout.describe()} -> D TP={args.d_tp}; "
          f"{args.tokens} tokens = {blocks} blocks, {p_kv.nbytes / 2**20:.1f} MiB on P")
    runs: dict[str, list[tuple[float, float]]] = {"staging": [], "direct": []}
    try:
        for r in range(args.rounds):
            for kind in (("staging", "direct") if r % 2 == 0 else ("direct", "staging")):
                d_kv.zero_()
                runs[kind].append(timed(staging if kind == "staging" else direct))
                got = d_kv.view(torch.uint8).numpy()
                assert all((got[w, b].reshape(-1) == want[b][w]).all() for b in ids for w in range(args.d_tp)), \
                    f"{kind}: D's cache differs from P's"
    finally:
        for sender, receiver in ends.values():
            receiver.close()
            sender.close()
    per_k = 1024 / args.tokens
    med = {k: (statistics.median(w for w, _ in v) * per_k, statistics.median(c for _, c in v) * per_k)
           for k, v in runs.items()}
    for kind, (wall, cpu) in med.items():
        print(f"{kind:8s}: {wall * 1e3:7.2f} ms wall, {cpu * 1e3:7.2f} ms CPU per 1k tokens "
              f"(rounds: {', '.join(f'{w * per_k * 1e3:.1f}' for w, _ in runs[kind])} ms)")
    copied = sum(s.copied_bytes for s in (p_stage, d_stage) if s) / args.rounds
    replicas = len(direct_pull(p_layout, d_layout, ids, ids, blocks, blocks)[2]) * blocks * d_rows.shape[1]
    print(f"direct / staging: wall {med['direct'][0] / med['staging'][0]:.2f}x, "
          f"CPU {med['direct'][1] / med['staging'][1]:.2f}x; local copies per pull: staging {copied / 2**20:.1f} MiB "
          f"(gather + scatter), direct {replicas / 2**20:.1f} MiB (replicas); load after {loadavg()}")


if __name__ == "__main__":
    main()
