"""Issue #42's attacks on the router's HTTP server (3) and SSE relay (9): router RSS and
event-loop stall, before / after a fix.

    .venv/bin/python -m benchmarks.router_attacks [--repo PATH] [--scale S] [--only NAME ...]

Starts `python -m router` from --repo (default: this tree; a worktree of an older commit
measures "before") with one colocated worker: `HostileWorker`, in this process, whose
every stream is one SSE event that never ends, sent in 4 KB chunks. Per attack: the
router's RSS before, at its peak and after the attack's connections closed; the latency
of `GET /health` probes sent every 10 ms during the attack (median, max) against the same
probes alone (the stall of the router's event loop); what the attack connections saw.
tests/test_router_hostile.py runs the same attacks, scaled down, as assertions.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import pathlib
import socket
import statistics
import sys
import threading
import time

from launch.process import RouterServer, free_port

REPO = pathlib.Path(__file__).resolve().parent.parent
MIB = 1 << 20


def rss_bytes(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


# ------------------------------------------------------------------ a hostile worker

class HostileWorker:
    """An engine that is healthy, and answers every POST with one endless SSE event
    (`event_bytes` of `data: xxx...`, no terminator) in `chunk`-byte chunks."""

    def __init__(self, event_bytes: int, chunk: int = 4096):
        self.event_bytes, self.chunk = event_bytes, chunk
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.streams_sent = 0
        self._closing = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        f = conn.makefile("rb")
        try:
            while True:
                line = f.readline()
                if not line:
                    return
                method = line.split(b" ", 1)[0]
                length = 0
                while (h := f.readline()) not in (b"\r\n", b""):
                    if h.lower().startswith(b"content-length:"):
                        length = int(h.split(b":", 1)[1])
                f.read(length)
                if method != b"POST":
                    body = b'{"status": "ok"}'
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(body), body))
                    continue
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
                piece = b"data: " + b"x" * (self.chunk - 6)
                sent = 0
                while sent < self.event_bytes:
                    conn.sendall(b"%x\r\n%b\r\n" % (len(piece), piece))
                    sent += len(piece)
                    piece = b"x" * self.chunk
                self.streams_sent += 1
                conn.sendall(b"0\r\n\r\n")
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self._closing = True
        self.sock.close()


# ------------------------------------------------------------------ probes

class Prober:
    """GET /health every `interval_s` on one kept-alive connection, latencies kept."""

    def __init__(self, port: int, interval_s: float = 0.01):
        self.port, self.interval_s = port, interval_s
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        while not self._stop.is_set():
            t = time.perf_counter()
            try:
                conn.request("GET", "/health")
                conn.getresponse().read()
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
                continue
            self.latencies.append(time.perf_counter() - t)
            self._stop.wait(self.interval_s)
        conn.close()

    def __enter__(self) -> "Prober":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(130)

    def summary(self) -> dict:
        xs = self.latencies or [float("nan")]
        return {"probes": len(self.latencies), "median_ms": round(statistics.median(xs) * 1e3, 2),
                "max_ms": round(max(xs) * 1e3, 1)}


def probe_alone(port: int, seconds: float = 1.0) -> dict:
    with Prober(port) as p:
        time.sleep(seconds)
    return p.summary()


def http_get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def closed_by_peer(s: socket.socket, timeout_s: float) -> bool:
    """Whether the router closes `s` within `timeout_s` (what it answered, if anything, is read)."""
    s.settimeout(timeout_s)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if not s.recv(65536):
                return True
    except socket.timeout:
        return False
    except OSError:
        return True
    return False


# ------------------------------------------------------------------ attacks

def slowloris(port: int, conns: int, seconds: float, header_deadline_s: float) -> dict:
    """`conns` connections each sending a request head one byte per second: how many are
    still open after `seconds` (a head deadline closes them)."""
    socks = [connect(port) for _ in range(conns)]
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000
    deadline = time.monotonic() + seconds
    i = 0
    open_socks = list(socks)
    while time.monotonic() < deadline and open_socks:
        still = []
        for s in open_socks:
            try:
                s.sendall(head[i:i + 1])
                still.append(s)
            except OSError:
                pass
        open_socks = still
        i += 1
        time.sleep(1.0)
    alive = sum(not closed_by_peer(s, 0.2) for s in open_socks)
    for s in socks:
        s.close()
    return {"connections": conns, "still_open_after_s": seconds, "still_open": alive,
            "header_deadline_s": header_deadline_s}


def partial_uploads(port: int, conns: int, length: int, sent: int) -> dict:
    """`conns` uploads announcing `length` bytes, each stopping after `sent` (held open)."""
    socks, refused = [], 0
    for _ in range(conns):
        s = connect(port)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % length)
        try:
            s.sendall(b"x" * sent)
        except OSError:
            refused += 1
        socks.append(s)
    return {"socks": socks, "refused_while_sending": refused}


def chunked_tiny(port: int, conns: int, body_bytes: int) -> dict:
    """`conns` chunked uploads of `body_bytes` in 2-byte chunks (never finished: no last chunk)."""
    socks, cut = [], 0
    payload = b"2\r\nxx\r\n" * (body_bytes // 2)
    for _ in range(conns):
        s = connect(port)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        try:
            s.sendall(payload)
        except OSError:
            cut += 1
        socks.append(s)
    return {"socks": socks, "cut_while_sending": cut}


def pipelined(port: int, request_bytes: int) -> dict:
    """`request_bytes` of pipelined `GET /openapi.json`, answers never read."""
    s = connect(port)
    one = b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n"
    data = one * (request_bytes // len(one))
    s.settimeout(10)
    try:
        s.sendall(data)
        sent_all = True
    except OSError:
        sent_all = False
    return {"socks": [s], "requests": request_bytes // len(one), "sent_all": sent_all}


def sse_bomb(port: int) -> dict:
    """One streamed request through the router to the hostile worker: what the client got."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/v1/completions", b'{"model": "m", "prompt": "hi", "stream": true}',
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    try:
        got = r.read()
    except (OSError, http.client.HTTPException):
        got = b""
    conn.close()
    return {"status": r.status, "client_bytes": len(got), "error": b'"error"' in got}


# ------------------------------------------------------------------ driver

class Bench:
    """A router process from `repo` in front of a HostileWorker."""

    def __init__(self, repo: pathlib.Path, event_bytes: int, *router_args: str, log: str | None = None):
        self.worker = HostileWorker(event_bytes)
        self.port = free_port()
        self.router = RouterServer((), (), "--worker", self.worker.url, "--health-interval-s", "60",
                                   *router_args, port=self.port, log=log or "/dev/null", cwd=repo,
                                   env=dict(os.environ, PYTHONPATH=str(repo)))

    def __enter__(self) -> "Bench":
        self.router.wait_ready(60, path="/health")
        return self

    def __exit__(self, *exc) -> None:
        self.router.stop()
        self.worker.close()

    def rss(self) -> int:
        return rss_bytes(self.router.pid)

    def measure(self, attack, *args, settle_s: float = 2.0) -> dict:
        """RSS before / peak / after the attack's sockets closed; probes during it."""
        before = self.rss()
        peak = [before]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.05):
                peak.append(self.rss())

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        with Prober(self.port) as probes:
            t = time.perf_counter()
            out = attack(self.port, *args)
            time.sleep(0.5)  # the router works on what arrived
            elapsed = time.perf_counter() - t
        for s in out.pop("socks", []):
            s.close()
        time.sleep(settle_s)
        stop.set()
        sampler.join()
        out.update({"rss_before_mib": round(before / MIB, 1), "rss_peak_mib": round(max(peak) / MIB, 1),
                    "rss_after_mib": round(self.rss() / MIB, 1), "attack_s": round(elapsed, 2),
                    "health_during": probes.summary(), "router_alive": self.router.alive()})
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=pathlib.Path, default=REPO, help="the tree whose router runs")
    ap.add_argument("--scale", type=float, default=0.25, help="of the probe's sizes (1.0: 16 MiB event, ...)")
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    sc = args.scale
    event = int(16 * MIB * sc)
    results: dict = {"repo": str(args.repo), "scale": sc}
    attacks = {
        "sse_event_without_end": (sse_bomb,),
        "chunked_2_byte_chunks": (chunked_tiny, 3, int(15 * MIB * sc)),
        "partial_uploads": (partial_uploads, 12, 16 * MIB, int(15.9 * MIB)),
        "pipelined_unread": (pipelined, int(780_000 * sc)),
    }
    for name, (fn, *fargs) in attacks.items():  # each on a fresh router: RSS of that attack alone
        if args.only and name not in args.only:
            continue
        with Bench(args.repo, event + MIB, "--max-upstream-event-bytes", str(event)) as b:
            results.setdefault("health_alone", probe_alone(b.port))
            results[name] = b.measure(fn, *fargs)
        print(name, json.dumps(results[name]), file=sys.stderr, flush=True)
    if not args.only or "slowloris" in args.only:
        with Bench(args.repo, MIB) as b:
            results["slowloris"] = slowloris(b.port, 100, 25, 20)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
