"""Helpers for the `atomd serve` tests: a real server process with the tests' engine flags.

Starting, probing and stopping it is launch/process.py's; this adds what only tests need
(small engine flags, ATOMD_TEST_SERVER_LOG, the stats readers). A module-scoped fixture
per test file keeps the suite fast (one model load per file).
"""
from __future__ import annotations

import json
import os
import pathlib
import time

from launch.process import EngineServer, http

REPO = pathlib.Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 120.0
MAX_MODEL_LEN = 256
# A small pool and one torch thread: the tests share two cores with everyone else.
ENGINE_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--num-threads", "1", "--max-num-seqs", "64"]


def model_dir() -> pathlib.Path:
    """The built-in default model: a real tokenizer and chat template, small enough for CPU."""
    from atomd.model.default import default_model_dir

    return default_model_dir()


def server_log(log_path: pathlib.Path | None = None) -> str | pathlib.Path | None:
    """Where a test server's output goes: the terminal when ATOMD_TEST_SERVER_LOG is set
    (debugging), else the file a test reads, else nowhere."""
    return None if os.environ.get("ATOMD_TEST_SERVER_LOG") else (log_path or os.devnull)


class ServerUnderTest(EngineServer):
    """`python -m atomd serve` with ENGINE_ARGS on a free port of 127.0.0.1."""

    ready_timeout_s = START_TIMEOUT_S

    def __init__(self, model: str | os.PathLike, *extra: str, log_path: pathlib.Path | None = None):
        super().__init__(model, *ENGINE_ARGS, *extra, log=server_log(log_path), cwd=REPO)

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


def start_server(model, *extra: str, log_path: pathlib.Path | None = None) -> ServerUnderTest:
    """A ready server; one that fails to start is stopped before the error propagates."""
    return ServerUnderTest(model, *extra, log_path=log_path).wait_ready()
