"""A normal client's latency through a PD pair under a sustained mix of #42's attacks, against
the same client with no attack, same run; and the router's and engines' RSS after.

    .venv/bin/python -m benchmarks.hostile_mix [--seconds 20] [--rounds 3] [--tree PATH]

P, D (one thread each) and the router run on 127.0.0.1 from this checkout, or from `--tree`
(another checkout, e.g. a worktree of the commit before the fixes: the servers run its code,
this script stays the same). Each round measures the normal client alone, then under the
attack mix, alternating; the normal client sends one short completion (8 tokens) at a time.
The attack mix, at a fixed rate each:
  slowloris   new connections to the router sending one header byte a second (30 at a time)
  big bodies  a 15 MB Content-Length, 8 MB of it sent, then silence
  bombs       guided_choice of 100,000 strings and guided_json nested 5,000 deep through
              the router, one each a second
Printed as a Markdown table: p50 / p99 latency alone and under attack (medians over rounds),
their ratio, the attack requests' answers, RSS of each process after, the machine's load.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import threading
import time

from benchmarks.machine import loadavg
from launch.process import EngineServer, RouterServer, http

ENGINE_ARGS = ["--num-threads", "1", "--max-model-len", "512"]
NORMAL = {"prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) / 1024


def normal_latencies(url: str, seconds: float) -> list[float]:
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        status, raw = http("POST", url + "/v1/completions", NORMAL, timeout=120)
        out.append(time.perf_counter() - t0)
        assert status == 200, raw[:300]
    return out


class Attacks:
    """The mix, on background threads, until stop(); counts what the router answered."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.stop_at = threading.Event()
        self.answers: dict[str, int] = {}
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self.slowloris, self.big_bodies,
                                                                           self.bombs)]

    def count(self, what: str) -> None:
        with self.lock:
            self.answers[what] = self.answers.get(what, 0) + 1

    def start(self) -> "Attacks":
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> dict[str, int]:
        self.stop_at.set()
        for t in self.threads:
            t.join(60)
        return self.answers

    def slowloris(self) -> None:
        socks: list[socket.socket] = []
        while not self.stop_at.is_set():
            while len(socks) < 30:
                try:
                    s = socket.create_connection((self.host, self.port), timeout=5)
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                    socks.append(s)
                except OSError:
                    break
            for s in list(socks):
                try:
                    s.sendall(b"a")
                except OSError:  # the router closed it (a 408 or a reset): a new one takes its place
                    self.count("slowloris closed by the router")
                    socks.remove(s)
                    s.close()
            self.stop_at.wait(1.0)
        for s in socks:
            s.close()

    def big_bodies(self) -> None:
        while not self.stop_at.is_set():
            try:
                with socket.create_connection((self.host, self.port), timeout=5) as s:
                    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 15000000\r\n\r\n" + b" " * (8 << 20))
                    self.stop_at.wait(2.0)
                self.count("big body sent")
            except OSError:
                self.count("big body refused")

    def bombs(self) -> None:
        bodies = [dict(NORMAL, guided_choice=[f"c{i}" for i in range(100_000)]),
                  dict(NORMAL, guided_json="[" * 5000 + "]" * 5000)]
        url = f"http://{self.host}:{self.port}/v1/completions"
        while not self.stop_at.is_set():
            for body in bodies:
                try:
                    status, _ = http("POST", url, body, timeout=120)
                    self.count(f"bomb {status}")
                except OSError:
                    self.count("bomb connection error")
            self.stop_at.wait(1.0)


def pcts(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=20.0, help="per measurement")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tree", default=None, help="run the servers from this checkout")
    args = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=args.tree) if args.tree else None
    kw = {"cwd": args.tree, "env": env}
    logs = tempfile.mkdtemp(prefix="hostile-mix-")
    p = EngineServer(None, "--kv-role", "producer", *ENGINE_ARGS, log=f"{logs}/p.log", **kw)
    d = EngineServer(None, "--kv-role", "consumer", *ENGINE_ARGS, log=f"{logs}/d.log", **kw)
    servers = [p, d]
    try:
        p.wait_ready(300)
        d.wait_ready(300)
        router = RouterServer([p.url], [d.url], log=f"{logs}/router.log", **kw)
        servers.append(router)
        router.wait_ready(60)
        normal_latencies(router.url, 3)  # warm
        load_before = loadavg()
        rows: dict[str, list[float]] = {k: [] for k in ("alone p50", "alone p99", "attack p50", "attack p99")}
        answers: dict[str, int] = {}
        for _ in range(args.rounds):
            alone = pcts(normal_latencies(router.url, args.seconds))
            attacks = Attacks(router.host, router.port).start()
            under = pcts(normal_latencies(router.url, args.seconds))
            for k, v in attacks.stop().items():
                answers[k] = answers.get(k, 0) + v
            rows["alone p50"].append(alone[0])
            rows["alone p99"].append(alone[1])
            rows["attack p50"].append(under[0])
            rows["attack p99"].append(under[1])
        med = {k: statistics.median(v) for k, v in rows.items()}
        print(f"tree: {args.tree or 'this checkout'} (logs in {logs}); load before {load_before}, after {loadavg()}; "
              f"{args.rounds} rounds of {args.seconds:g} s alone and under attack")
        print("| | p50 ms | p99 ms |\n|---|---:|---:|")
        print(f"| alone | {med['alone p50'] * 1e3:.0f} | {med['alone p99'] * 1e3:.0f} |")
        print(f"| under attack | {med['attack p50'] * 1e3:.0f} | {med['attack p99'] * 1e3:.0f} |")
        print(f"| ratio | {med['attack p50'] / med['alone p50']:.2f}x | {med['attack p99'] / med['alone p99']:.2f}x |")
        print("attack answers:", json.dumps(answers, sort_keys=True))
        print("RSS after (MB):", ", ".join(f"{s.name} {rss_mb(s.pid):.0f}" for s in servers))
    finally:
        for s in reversed(servers):
            s.stop()


if __name__ == "__main__":
    main()
