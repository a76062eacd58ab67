"""`atomd serve --data-parallel-size 2` against `--data-parallel-size 1`: the same greedy
outputs, requests spread over both ranks (least-loaded), an explicit rank honoured, the
delayer's outcomes per rank in /metrics, blocks back to baseline, and a dead rank making
the server not-ready (the other rank fails open, nothing hangs)."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_fixtures import http, model_dir, start_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time there was a little",
           "def fib(n):", "Hello", "The quick brown fox jumps over the lazy dog and then"]
DP = ["--data-parallel-size", "2", "--prefill-delayer", "align", "--dp-collective-timeout-s", "10"]


@pytest.fixture(scope="module")
def single():
    server = start_server(model_dir())
    yield server
    server.stop()


@pytest.fixture(scope="module")
def dp2():
    server = start_server(model_dir(), *DP)
    yield server
    server.stop()


def complete(server, prompt: str, headers: dict | None = None, **extra) -> dict:
    status, body = http("POST", server.url + "/v1/completions",
                        {"prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}, headers=headers)
    assert status == 200, body
    return json.loads(body)


def complete_all(server) -> list[str]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return [r["choices"][0]["text"] for r in pool.map(lambda p: complete(server, p), PROMPTS)]


def rank_stats(server) -> list[dict]:
    return server.stats()["ranks"]


def wait_back(server, baseline: list[dict], timeout_s: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        ranks = rank_stats(server)
        if all(r["num_running"] == r["num_waiting"] == 0 and r["num_free_blocks"] == b["num_free_blocks"]
               for r, b in zip(ranks, baseline)):
            return ranks
        assert time.monotonic() < deadline, f"ranks not back to baseline: {ranks}"
        time.sleep(0.05)


def test_dp2_greedy_outputs_equal_dp1_and_spread_over_both_ranks(single, dp2):
    baseline = rank_stats(dp2)
    assert [r["dp_rank"] for r in baseline] == [0, 1]
    assert complete_all(dp2) == complete_all(single)
    after = wait_back(dp2, baseline)
    for before, now in zip(baseline, after):  # both ranks looked prompts up: both served some
        assert now["prefix_cache_queries"] > before["prefix_cache_queries"]


@pytest.mark.parametrize("how", ["header", "body"])
def test_an_explicit_rank_is_honoured(dp2, how):
    baseline = rank_stats(dp2)
    for rank in (1, 0):
        before = rank_stats(dp2)
        if how == "header":
            complete(dp2, "Pinned prompt number one", headers={"X-data-parallel-rank": str(rank)})
        else:
            complete(dp2, "Pinned prompt number two", data_parallel_rank=rank)
        now = wait_back(dp2, baseline)
        grew = [n["prefix_cache_queries"] > b["prefix_cache_queries"] for n, b in zip(now, before)]
        assert grew == [r == rank for r in range(2)]


@pytest.mark.parametrize("rank", ["2", "-1", "x"])
def test_a_bad_rank_is_a_400_naming_the_field(dp2, rank):
    status, body = http("POST", dp2.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                        headers={"X-data-parallel-rank": rank})
    assert status == 400
    assert json.loads(body)["error"]["param"] == "data_parallel_rank"


def test_metrics_count_the_delayer_outcomes_per_rank(dp2):
    complete_all(dp2)
    status, body = http("GET", dp2.url + "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    outcomes = [s for s in families["atomd:prefill_delayer_outcomes"].samples if s.name.endswith("_total")]
    assert {s.labels["dp_rank"] for s in outcomes} == {"0", "1"}
    assert {s.labels["policy"] for s in outcomes} == {"align"}
    by_rank = {r: sum(s.value for s in outcomes if s.labels["dp_rank"] == r) for r in ("0", "1")}
    assert by_rank["0"] > 0 and by_rank["1"] > 0  # every rank decides every tick
    holds = [s for s in families["atomd:prefill_delayer_hold_ticks"].samples if s.name.endswith("_count")]
    assert {s.labels["dp_rank"] for s in holds} == {"0", "1"} and all(s.value > 0 for s in holds)


def test_a_dead_rank_makes_the_server_not_ready(tmp_path):
    server = start_server(model_dir(), *DP)
    try:
        assert complete(server, "Hello")["choices"][0]["text"]
        children = pathlib.Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()
        cores = [int(c) for c in children
                 if b"resource_tracker" not in pathlib.Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(cores) == 2
        os.kill(max(cores), signal.SIGKILL)  # one of the two ranks (the later spawned)
        deadline = time.monotonic() + 30
        while http("GET", server.url + "/ready")[0] != 503:
            assert time.monotonic() < deadline, "still ready with a dead rank"
            time.sleep(0.05)
        status, body = http("POST", server.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 503, body
        assert server.proc.poll() is None  # the API process lives on and answers
    finally:
        server.stop()
