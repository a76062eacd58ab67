"""Helpers for the `atomd serve` tests: start a real server process, poll it, stop it.

A module-scoped fixture per test file keeps the suite fast (one model load per file).
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from tests.conftest import free_port

REPO = pathlib.Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 120.0
MAX_MODEL_LEN = 256
# A small pool and one torch thread: the tests share two cores with everyone else.
ENGINE_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--num-threads", "1", "--max-num-seqs", "64"]


def model_dir() -> pathlib.Path:
    """The built-in default model: a real tokenizer and chat template, small enough for CPU."""
    from atomd.model.default import default_model_dir

    return default_model_dir()


def http(method: str, url: str, body: bytes | dict | None = None, headers: dict | None = None,
         timeout: float = 60.0) -> tuple[int, bytes]:
    """(status, body) for one request; error statuses are returned, not raised."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None and "Content-Type" not in (headers or {}):
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_until_ready(proc: subprocess.Popen, url: str, name: str, timeout_s: float) -> None:
    """Poll `url`/ready until 200; fail at once if the process exits, or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} before /ready")
        try:
            if http("GET", url + "/ready", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{name} not ready after {timeout_s} s")


class ServerProcess:
    """`python -m atomd serve` on a free port of 127.0.0.1."""

    def __init__(self, model: str | os.PathLike, *extra: str, engine_args: list[str] = ENGINE_ARGS,
                 log_path: pathlib.Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "atomd", "serve", "--model", str(model), "--port", str(self.port),
               *engine_args, *extra]
        # the server's stdout/stderr: a file a test reads, the terminal when debugging, or nowhere
        self.log = open(log_path or os.devnull, "wb") if not os.environ.get("ATOMD_TEST_SERVER_LOG") else None
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=self.log)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> "ServerProcess":
        wait_until_ready(self.proc, self.url, "atomd serve", timeout_s)
        return self

    def engine_pid(self) -> int:
        """The engine core: the server's child that is not multiprocessing's resource tracker."""
        children = pathlib.Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        cores = [int(c) for c in children
                 if b"resource_tracker" not in pathlib.Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(cores) == 1, cores
        return cores[0]

    def stats(self, headers: dict | None = None) -> dict:
        status, body = http("GET", self.url + "/debug/stats", headers=headers)
        assert status == 200, body
        return json.loads(body)

    def wait_idle(self, baseline_free: int, headers: dict | None = None, timeout_s: float = 30.0) -> dict:
        """Poll until nothing runs or waits, the free-block count is back at `baseline_free`
        and the engine has confirmed every abort the API process sent."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats(headers)
            if stats["num_running"] == 0 and stats["num_waiting"] == 0 and \
                    stats["num_free_blocks"] == baseline_free and stats["api_requests_in_flight"] == 0 \
                    and stats["api_aborts_unconfirmed"] == 0:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not back to baseline ({baseline_free} free): {stats}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.log is not None:
            self.log.close()


def start_server(model, *extra: str, log_path: pathlib.Path | None = None) -> ServerProcess:
    server = ServerProcess(model, *extra, log_path=log_path)
    try:
        return server.wait_ready()
    except BaseException:
        server.stop()
        raise
