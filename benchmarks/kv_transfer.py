"""KV transfer goodput: both backends (ZMQ, Mooncake TCP) against raw ZMQ, raw Mooncake and memcpy.

All of them move the same contiguous block range over tcp loopback in one process (each
end with its own zmq context and I/O thread, and its own Mooncake TransferEngine, as P
and D in two processes), in the same run, so the ratios hold even where absolute numbers
are noisy:

  zmq        KVSender -> KVReceiver, start_pull() until take_finished() reports it: READ,
             DATA frames zero-copy out of P's buffer, one copy into D's blocks, END, DONE.
  mooncake   MooncakeSender -> MooncakeReceiver, the same control plane: READ, READY, one
             Mooncake batch read (tcp) straight into D's registered blocks, DONE, END.
  raw zmq    one request on a DEALER, a bare ROUTER answers with the same frames zero-copy,
             D receives them zero-copy and drops them (no protocol, no destination copy);
             "+ copy" also copies each frame into D's buffer, as any pull must.
  raw mooncake  one batch_transfer_sync_read of the same bytes between two bare engines.
  memcpy     numpy copy of the same bytes from P's buffer into D's.

The machine's load (/proc/loadavg) is recorded before and after: the machine is shared.

    .venv/bin/python -m benchmarks.kv_transfer [--num-layers 6 --num-kv-heads 4 --head-dim 32]
    .venv/bin/python -m benchmarks.kv_transfer --cross-host    # P and D in two network namespaces (root):
                                                               # benchmarks/cross_host.py
"""
from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import numpy as np
import zmq

from kv_transfer import mooncake_transport as mooncake
from kv_transfer.params import compat_fingerprint, new_access_token, new_transfer_id
from kv_transfer.side_channel import DEFAULT_MAX_MESSAGE_BYTES
from kv_transfer.zmq_receiver import KVReceiver
from kv_transfer.zmq_sender import KVSender
from benchmarks.machine import loadavg
from benchmarks.zmq_ceiling import machine_notes, raw_zmq_server, time_raw


def time_ours(sender: KVSender, receiver: KVReceiver, num_blocks: int) -> float:
    tid, token, ids = new_transfer_id(), new_access_token(), list(range(num_blocks))
    sender.grant(tid, ids, token, lease_s=60.0)
    t0 = time.perf_counter()
    receiver.start_pull(tid, *sender.address, token, ids, ids, timeout_s=30.0)
    while True:
        receiver.wait(30.0)
        done, failed = receiver.take_finished()
        if done or failed:
            break
    elapsed = time.perf_counter() - t0
    if failed or done != [tid]:
        raise RuntimeError(f"transfer failed: {failed}")
    deadline = time.monotonic() + 10
    while not sender.take_released():  # keep the sender's pins from piling up
        if time.monotonic() > deadline:
            raise RuntimeError("sender never released the transfer")
        time.sleep(0.001)
    return elapsed


class RawMooncake:
    """Two bare TransferEngines (tcp) over the same buffers: the engine alone, no protocol."""

    def __init__(self, src: np.ndarray, dst: np.ndarray) -> None:
        self.p = mooncake.new_engine("127.0.0.1", "tcp", None)
        self.d = mooncake.new_engine("127.0.0.1", "tcp", None)
        self.src, self.dst = mooncake.register(self.p, src), mooncake.register(self.d, dst)
        self.session = f"127.0.0.1:{self.p.get_rpc_port()}"
        self.block_bytes = src.shape[1]

    def time(self, num_blocks: int) -> float:
        t0 = time.perf_counter()
        rc = self.d.batch_transfer_sync_read(self.session, [self.dst], [self.src], [num_blocks * self.block_bytes])
        elapsed = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"raw Mooncake read failed: {rc}")
        return elapsed


def time_memcpy(src: np.ndarray, dst: np.ndarray, num_blocks: int) -> float:
    t0 = time.perf_counter()
    np.copyto(dst[:num_blocks], src[:num_blocks])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-layers", type=int, default=6)
    ap.add_argument("--num-kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype-bytes", type=int, default=4)
    ap.add_argument("--sizes", default="1,4,16,64,256,1024", help="transfer sizes in blocks")
    ap.add_argument("--cache-gib", type=float, default=1.0, help="also move a whole cache this big (0: skip)")
    ap.add_argument("--repeats", type=int, default=20, help="runs per size (median, >= 3); the whole cache runs 5")
    ap.add_argument("--max-message-mib", type=float, default=DEFAULT_MAX_MESSAGE_BYTES / (1 << 20))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "kv_transfer.md"))
    # Cross-host column (benchmarks/cross_host.py): P and D in two test hosts (network
    # namespaces, root only), unshaped and shaped 2 ms +- 1 ms / 1 Gbit/s, vs a raw ZMQ stream.
    ap.add_argument("--cross-host", action="store_true", help="measure between two network namespaces instead")
    ap.add_argument("--cross-host-sizes", default="1,4,16,64,256,1024", help="--cross-host transfer sizes in blocks")
    ap.add_argument("--cross-host-repeats", type=int, default=5, help="--cross-host runs per size per round")
    ap.add_argument("--rounds", type=int, default=3, help="--cross-host rounds (>= 3; medians)")
    ap.add_argument("--cross-host-out", default=os.path.join(os.path.dirname(__file__), "results",
                                                             "kv_transfer_cross_host.md"))
    args = ap.parse_args()
    if args.repeats < 3:
        ap.error("--repeats must be >= 3 (medians)")
    if args.cross_host:
        from benchmarks.cross_host import run_kv

        run_kv(args)
        return
    mooncake.load_transfer_engine()  # MooncakeUnavailable names the install command

    block_bytes = args.num_layers * 2 * args.block_size * args.num_kv_heads * args.head_dim * args.dtype_bytes
    sizes = [int(s) for s in args.sizes.split(",")]
    cache_blocks = int(args.cache_gib * (1 << 30)) // block_bytes
    num_blocks = max(sizes + [cache_blocks])
    rng = np.random.default_rng(0)
    src = np.frombuffer(rng.bytes(num_blocks * block_bytes), dtype=np.uint8).reshape(num_blocks, block_bytes)
    dst = np.zeros_like(src)
    max_message_bytes = int(args.max_message_mib * (1 << 20))
    blocks_per_message = max(1, max_message_bytes // block_bytes)

    compat = compat_fingerprint("bench", "float32", args.block_size, args.num_layers, args.num_kv_heads, args.head_dim, "bench")
    sender = KVSender(src, compat, max_message_bytes=max_message_bytes)
    receiver = KVReceiver(dst, compat)
    mc_sender = mooncake.MooncakeSender(src, compat)
    mc_receiver = mooncake.MooncakeReceiver(dst, compat)
    raw_mc = RawMooncake(src, dst)
    load_before = loadavg()
    # One context (one zmq I/O thread) per end, as P and D have in their own processes; a shared
    # one would let a single I/O thread both write and read the loopback socket.
    p_ctx, d_ctx = zmq.Context(), zmq.Context()
    router, dealer = p_ctx.socket(zmq.ROUTER), d_ctx.socket(zmq.DEALER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.setsockopt(zmq.RCVHWM, 8)  # the same receive-side bound as KVReceiver's default
    dealer.connect(f"tcp://127.0.0.1:{port}")
    stop = threading.Event()
    server = threading.Thread(target=raw_zmq_server, args=(router, src, blocks_per_message, stop), daemon=True)
    server.start()

    rows = []
    try:
        runs = [(n, args.repeats) for n in sizes] + ([(cache_blocks, 5)] if cache_blocks else [])
        for n, repeats in runs:
            # warm up connections, handshakes and pages
            time_ours(sender, receiver, n), time_ours(mc_sender, mc_receiver, n), time_raw(dealer, n, block_bytes)
            raw_mc.time(n)
            ours, mc, raw, raw_copy, raw_mooncake, mem = [], [], [], [], [], []
            for _ in range(repeats):  # interleaved, so background load hits all of them alike
                ours.append(time_ours(sender, receiver, n))
                mc.append(time_ours(mc_sender, mc_receiver, n))
                raw.append(time_raw(dealer, n, block_bytes))
                raw_copy.append(time_raw(dealer, n, block_bytes, into=dst))
                raw_mooncake.append(raw_mc.time(n))
                mem.append(time_memcpy(src, dst, n))
            for pair in ((sender, receiver), (mc_sender, mc_receiver)):
                dst[:n] = 0
                time_ours(*pair, n)
                if not np.array_equal(dst[:n], src[:n]):
                    raise RuntimeError(f"bytes differ after a {n}-block transfer over {type(pair[0]).__name__}")
            nbytes = n * block_bytes
            gbs = [nbytes / statistics.median(t) / 1e9 for t in (ours, mc, raw, raw_copy, raw_mooncake, mem)]
            rows.append((n, nbytes, *gbs, statistics.median(ours), statistics.median(mc)))
            print(f"{n:6d} blocks {nbytes / (1 << 20):9.2f} MiB  zmq {gbs[0]:6.2f}  mooncake {gbs[1]:6.2f}  "
                  f"raw zmq {gbs[2]:6.2f}  raw zmq+copy {gbs[3]:6.2f}  raw mooncake {gbs[4]:6.2f}  "
                  f"memcpy {gbs[5]:6.2f} GB/s  mooncake/zmq {gbs[1] / gbs[0]:.2f}", flush=True)
    finally:
        stop.set()
        server.join()
        p_ctx.destroy(linger=0)
        d_ctx.destroy(linger=0)
        for endpoint in (sender, receiver, mc_sender, mc_receiver):
            endpoint.close()
    write_report(args, block_bytes, rows, (load_before, loadavg()))


def verdict(rows: list[tuple]) -> list[str]:
    """The issue's target (Mooncake tcp >= 0.7x ZMQ from 64 blocks up), read off this run."""
    big = [(n, mc / ours, mc / raw_mc) for n, _, ours, mc, _, _, raw_mc, *_ in rows if n >= 64]
    if not big:
        return []
    worst = min(big, key=lambda r: r[1])
    met = [n for n, ratio, _ in big if ratio >= 0.7]
    return [
        f"Target mooncake / zmq >= 0.7 from 64 blocks up: met at {', '.join(map(str, met)) or 'no size'} blocks; "
        f"lowest {worst[1]:.2f} at {worst[0]} blocks. mooncake / raw Mooncake from 64 blocks up: "
        f"{min(r[2] for r in big):.2f}-{max(r[2] for r in big):.2f}, so where Mooncake trails ZMQ it is the engine's",
        "own tcp transport that sets the pace, not the shared control plane or the batching.",
    ]


def write_report(args: argparse.Namespace, block_bytes: int, rows: list[tuple], load: tuple[str, str]) -> None:
    lines = [
        "# KV transfer goodput (ZMQ side channel, Mooncake TCP)",
        "",
        f"block_bytes = {args.num_layers} layers x 2 x {args.block_size} tokens x {args.num_kv_heads} kv heads "
        f"x {args.head_dim} head_dim x {args.dtype_bytes} B = {block_bytes} B; DATA messages up to "
        f"{args.max_message_mib:g} MiB; tcp loopback, both ends in one process, each end with its own zmq "
        f"context and its own Mooncake TransferEngine (as P and D in two processes); median of {args.repeats} "
        "runs per size (5 for the whole cache), all columns interleaved run by run.",
        "",
        "| blocks | MiB | zmq GB/s | mooncake GB/s | mooncake / zmq | raw ZMQ GB/s | raw ZMQ + copy GB/s | "
        "raw Mooncake GB/s | memcpy GB/s | zmq / (raw + copy) | mooncake / raw Mooncake | zmq ms | mooncake ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, nbytes, ours, mc, raw, raw_copy, raw_mc, mem, t, t_mc in rows:
        lines.append(f"| {n} | {nbytes / (1 << 20):.2f} | {ours:.2f} | {mc:.2f} | {mc / ours:.2f} | {raw:.2f} | "
                     f"{raw_copy:.2f} | {raw_mc:.2f} | {mem:.2f} | {ours / raw_copy:.2f} | {mc / raw_mc:.2f} | "
                     f"{t * 1e3:.2f} | {t_mc * 1e3:.2f} |")
    lines += [
        "",
        "zmq: READ -> DATA (zero-copy from P's blocks) -> one copy into D's blocks -> END -> DONE, timed from",
        "start_pull() to take_finished(). mooncake: the same control plane, READ -> READY -> one Mooncake batch",
        "read (tcp, one entry per run of consecutive blocks) straight into D's registered blocks -> DONE -> END.",
        "raw ZMQ: one request, the same frames zero-copy, received zero-copy and dropped (no protocol, no copy",
        "into a destination). raw ZMQ + copy: the same, plus the one copy of each frame into D's buffer that any",
        "pull needs. raw Mooncake: one batch_transfer_sync_read between two bare engines, called on the timing",
        "thread at normal priority (the binding spins while it waits; ours waits at nice 19, so it can be the",
        "faster of the two). memcpy: numpy copy.",
        "",
        "Small transfers are latency-bound: a pull is a READ round trip plus hand-offs between the engine thread",
        "and the I/O threads (Mooncake adds READY -> read -> DONE -> END: one more round trip). Large transfers",
        "are bandwidth-bound. Mooncake's Python binding waits for a batch by spinning on its status; D's reader",
        "thread runs it at nice 19 so the spin does not take the core its own tcp transport threads need.",
        "",
        *verdict(rows),
        "",
        "What RDMA would change (not measurable here: no RDMA NIC): the read becomes one-sided NIC DMA from P's",
        "registered KV straight into D's, with no CPU copy and no kernel TCP stack on either side, so goodput",
        "should approach the link (tens of GB/s on 100-400 Gb/s NICs) instead of the ~1-2 GB/s of loopback",
        "tcp, and P's CPU does nothing per byte. The control plane stays ZMQ over tcp: READ / READY / DONE /",
        "END cost about the same few hundred microseconds, which then dominates small pulls. To measure on",
        "hardware that has it: `--kv-mooncake-protocol rdma --kv-mooncake-device <hca>` on P and D on two",
        "hosts; this benchmark's columns for 1..1024 blocks and the whole cache (goodput, mooncake / raw",
        "Mooncake, which shows the control plane's share), P's and D's CPU seconds per GB, the first pull's",
        "cost (QP setup in the handshake), D's kv_transfer_seconds and the router's TTFT split (benchmarks/",
        "pd_ttft.py) against ZMQ over the same NIC, and concurrent pulls from several P (one batch per pull).",
        "",
        f"Command: `.venv/bin/python -m benchmarks.kv_transfer --num-layers {args.num_layers} --num-kv-heads "
        f"{args.num_kv_heads} --head-dim {args.head_dim} --sizes {args.sizes} --cache-gib {args.cache_gib:g} "
        f"--repeats {args.repeats}`",
        "",
        f"Machine: {machine_notes()}. Load average (1, 5, 15 min) before: {load[0]}, after: {load[1]}. "
        "Shared with other jobs while it ran: read the ratios, not the absolutes.",
        "",
    ]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
