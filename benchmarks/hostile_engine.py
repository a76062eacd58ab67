"""Issue 42, the engine's attacks 5 and 6: one engine's API-process RSS and event-loop stall
(the slowest /health answered while the attack runs) and a concurrent normal request's
latency against the same request alone.

    python -m benchmarks.hostile_engine [--prompt-mb 4] [--choices 20000] [atomd serve flags...]

Attack 5 sends one prompt of --prompt-mb MB (the probe: 15 MB), attack 6 a guided_choice of
--choices strings (the probe: 100,000). Run it from a checkout: the server is that
checkout's `python -m atomd serve` (built-in model, 1 thread). Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import threading
import time

from launch.process import EngineServer, http

GOOD = {"prompt": "def main():", "max_tokens": 8, "temperature": 0}


def rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def attack(server: EngineServer, body: dict) -> dict:
    """Send `body` while /health is polled and a normal request runs concurrently."""
    alone = min(timed(lambda: http("POST", server.url + "/v1/completions", GOOD)) for _ in range(3))
    result: dict = {}

    def send():
        t0 = time.perf_counter()
        result["status"] = http("POST", server.url + "/v1/completions", body, timeout=600)[0]
        result["attack_s"] = round(time.perf_counter() - t0, 3)

    thread = threading.Thread(target=send)
    health: list[float] = []

    def poll_health():
        while thread.is_alive():
            health.append(timed(lambda: http("GET", server.url + "/health", timeout=600)))

    poller = threading.Thread(target=poll_health)
    thread.start()
    poller.start()
    time.sleep(0.05)
    concurrent = timed(lambda: http("POST", server.url + "/v1/completions", GOOD, timeout=600))
    poller.join()
    thread.join()
    time.sleep(1.0)
    return dict(result, health_max_s=round(max(health, default=0.0), 3), normal_alone_s=round(alone, 3),
                normal_during_s=round(concurrent, 3), rss_after_mb=round(rss_mb(server.proc.pid), 1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-mb", type=float, default=4.0)
    ap.add_argument("--choices", type=int, default=20_000)
    args, serve_args = ap.parse_known_args()  # the rest go to `atomd serve` (e.g. raised limits)
    with EngineServer(None, "--max-model-len", "256", "--num-threads", "1", *serve_args) as server:
        server.wait_ready(timeout_s=300)
        http("POST", server.url + "/v1/completions", GOOD)
        out = {"rss_before_mb": round(rss_mb(server.proc.pid), 1)}
        text = "hello world, this is a test " * int(args.prompt_mb * (1 << 20) / 28)
        out["attack5_prompt"] = attack(server, {"prompt": text, "max_tokens": 1})
        choices = [f"choice number {i}" for i in range(args.choices)]
        out["attack6_guided_choice"] = attack(server, {"prompt": "x", "max_tokens": 2, "guided_choice": choices})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
