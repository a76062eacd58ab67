"""What CURVE (the KV secret's keys, issue #42) costs the KV events path: one publisher
(atomd/engine/kv_events.py) and one subscriber on loopback, plain wire vs CURVE, in the
same run, alternating per round.

Per mode and batch shape: the time from the first `publish` until the subscriber has
decoded the last batch (publisher queue, I/O thread, encryption, TCP, decryption), as
batches/s and MB/s, and one replay of the whole buffer (`--replay` batches). Shapes: a
one-block step (1 BlockStored of 16 tokens) and a 2,048-token prefill step (128 blocks).

    python -m benchmarks.kv_events_curve [--rounds 3] [--batches 5000]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import threading
import time

import zmq

from atomd.engine.kv_events import END_SEQ, KVEventPublisher
from benchmarks.machine import loadavg
from kv_transfer.events import BlockStored
from kv_transfer.trust import kv_events_curve_keys
from launch.process import free_port

SECRET = b"benchmark-kv-secret"
SHAPES = {"1 block": 1, "128 blocks": 128}  # blocks of 16 tokens per batch


def tcp() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def keyed(sock: zmq.Socket, curve: bool) -> zmq.Socket:
    sock.setsockopt(zmq.LINGER, 0)
    if curve:
        keys = kv_events_curve_keys(SECRET)
        sock.curve_serverkey = keys.server_public
        sock.curve_publickey, sock.curve_secretkey = keys.client_public, keys.client_secret
    return sock


def one_run(curve: bool, blocks: int, batches: int) -> tuple[float, float, int, float]:
    """(seconds for `batches` published -> received, payload bytes, received, replay seconds)."""
    pub = KVEventPublisher(tcp(), tcp(), heartbeat_s=0.05, buffer_steps=batches + 1,
                           secret=SECRET if curve else None)
    ctx = zmq.Context()
    try:
        sub = keyed(ctx.socket(zmq.SUB), curve)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        assert sub.poll(10_000), "no heartbeat"  # connected (and handshaken)
        while sub.poll(100):  # the heartbeats so far
            sub.recv_multipart()
        events = [BlockStored(block_hashes=list(range(i, i + blocks)), parent_block_hash=None,
                              token_ids=list(range(16 * blocks)), block_size=16) for i in range(batches)]
        got = {"n": 0, "bytes": 0, "t": 0.0}
        done = threading.Event()

        def receive():
            while got["n"] < batches and sub.poll(10_000):
                _, _, payload = sub.recv_multipart()
                if len(payload) > 40:  # not a heartbeat
                    got["n"] += 1
                    got["bytes"] += len(payload)
            got["t"] = time.perf_counter()
            done.set()

        t = threading.Thread(target=receive, daemon=True)
        t.start()
        t0 = time.perf_counter()
        for e in events:
            pub.publish([e])
        done.wait(120)
        elapsed = got["t"] - t0
        dealer = keyed(ctx.socket(zmq.DEALER), curve)
        dealer.connect(pub.replay_endpoint)
        t1 = time.perf_counter()
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while dealer.poll(10_000) and dealer.recv_multipart()[1] != END_SEQ:
            pass
        replay_s = time.perf_counter() - t1
        return elapsed, got["bytes"], got["n"], replay_s
    finally:
        ctx.destroy(linger=0)
        pub.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=5000)
    args = ap.parse_args()
    load_before = loadavg()
    rows = {}
    for _ in range(args.rounds):
        for shape, blocks in SHAPES.items():
            n = args.batches if blocks == 1 else max(1, args.batches // 10)
            for curve in (False, True):
                rows.setdefault((shape, curve), []).append((n, *one_run(curve, blocks, n)))
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"CPU: {cpu}; load before {load_before}, after {loadavg()}; {args.rounds} rounds, medians")
    print("| batch | batches | wire | batches/s | MB/s | replay of all (ms) | received | CURVE / plain time |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in SHAPES:
        plain_s = statistics.median(r[1] for r in rows[(shape, False)])
        for curve in (False, True):
            rs = rows[(shape, curve)]
            n = rs[0][0]
            s = statistics.median(r[1] for r in rs)
            mb = statistics.median(r[2] for r in rs) / 1e6
            rep = statistics.median(r[4] for r in rs) * 1000
            recv = min(r[3] for r in rs)
            print(f"| {shape} | {n} | {'CURVE' if curve else 'plain'} | {n / s:,.0f} | {mb / s:.1f} | {rep:.1f} "
                  f"| {recv}/{n} | {s / plain_s:.2f}x |")


if __name__ == "__main__":
    main()
