"""A wedged engine core (SIGSTOP: its API process lives and answers) with a request in
flight turns /health to 503 once it has been silent past --engine-stall-timeout-s, so a
router's liveness probe takes it out of rotation; resumed, it answers, /health is 200 again
and the request completes. An idle core, or a busy one that steps, stays healthy."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from launch.process import http
from tests.server_fixtures import model_dir, start_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

STALL_S = 1.5


def health(url: str) -> tuple[int, dict]:
    status, body = http("GET", url + "/health")
    return status, json.loads(body)


def wait_for(predicate, what: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)
    return value


def test_a_wedged_core_with_work_turns_health_503_and_back(request):
    server = start_server(model_dir(), "--engine-stall-timeout-s", str(STALL_S))
    request.addfinalizer(server.stop)
    core = server.engine_pid()
    request.addfinalizer(lambda: os.kill(core, signal.SIGCONT))  # never leave it stopped
    body = {"prompt": "def add(a, b):", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    status, want = http("POST", server.url + "/v1/completions", body)
    assert status == 200
    time.sleep(STALL_S * 2)  # idle and silent: healthy, it owes nothing
    assert health(server.url)[0] == 200

    os.kill(core, signal.SIGSTOP)
    answer: dict = {}
    client = threading.Thread(target=lambda: answer.update(zip(("status", "body"), http(
        "POST", server.url + "/v1/completions", body, timeout=60))))
    client.start()
    status, info = wait_for(lambda: (h := health(server.url))[0] == 503 and h, "/health 503 while wedged")
    assert info["status"] == "engine stalled" and "has not answered" in info["reason"]

    os.kill(core, signal.SIGCONT)
    wait_for(lambda: health(server.url)[0] == 200, "/health 200 once resumed")
    client.join(60)
    assert answer["status"] == 200  # the same greedy answer as before the stall
    assert json.loads(answer["body"])["choices"][0]["text"] == json.loads(want)["choices"][0]["text"]


def test_a_busy_core_that_steps_stays_healthy(request):
    server = start_server(model_dir(), "--engine-stall-timeout-s", str(STALL_S))
    request.addfinalizer(server.stop)
    body = {"prompt": "import os", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    statuses = []
    done = threading.Event()

    def probe():
        while not done.is_set():
            statuses.append(health(server.url)[0])
            time.sleep(0.1)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        for _ in range(3):
            status, _ = http("POST", server.url + "/v1/completions", body, timeout=60)
            assert status == 200
    finally:
        done.set()
        prober.join()
    assert statuses and set(statuses) == {200}
