"""`atomd serve --data-parallel-size 2` against `--data-parallel-size 1`: the same greedy
outputs, requests spread over both ranks (least-loaded), an explicit rank honoured, the
delayer's outcomes per rank in /metrics, blocks back to baseline, and a dead rank making
the server not-ready (the other rank fails open, nothing hangs)."""
from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from atomd.config import EngineConfig
from atomd.api.core_client import DPEngineClient, rank_config
from launch.process import http
from tests.server_fixtures import model_dir, start_server

pytestmark = pytest.mark.timeout(240)

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time there was a little",
           "def fib(n):", "Hello", "The quick brown fox jumps over the lazy dog and then"]
DP = ["--data-parallel-size", "2", "--prefill-delayer", "align", "--dp-collective-timeout-s", "10"]


@pytest.mark.unit
@pytest.mark.parametrize("field,value", [("prefill_delayer", "nagle"), ("prefill_delayer_target_fill", 1.5),
                                         ("prefill_delayer_stall_ticks", 0), ("dp_collective_timeout_s", 0.0),
                                         ("prefill_delayer_aligned_tokens", -1)])
def test_bad_delayer_settings_are_a_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


@pytest.mark.unit
def test_an_aligned_budget_without_a_delayer_or_chunked_prefill_is_refused():
    with pytest.raises(ValueError, match="prefill_delayer_aligned_tokens .* needs prefill_delayer align or coalesce"):
        EngineConfig(prefill_delayer_aligned_tokens=512)
    with pytest.raises(ValueError, match="prefill_delayer_aligned_tokens needs enable_chunked_prefill"):
        EngineConfig(prefill_delayer="align", prefill_delayer_aligned_tokens=512, enable_chunked_prefill=False)


@pytest.mark.unit
def test_each_rank_gets_its_index_the_group_port_and_its_own_kv_events_port():
    cfg = EngineConfig(data_parallel_size=3, kv_events_endpoint="tcp://127.0.0.1:5557")
    ranks = [rank_config(cfg, r, 29500) for r in range(3)]
    assert [c.data_parallel_rank for c in ranks] == [0, 1, 2]
    assert {c.dp_master_port for c in ranks} == {29500}
    assert [c.kv_events_endpoint for c in ranks] == [f"tcp://127.0.0.1:{5557 + r}" for r in range(3)]


@pytest.mark.unit
def test_placement_is_least_loaded_with_ties_to_the_lower_rank_and_skips_dead_ranks():
    client = DPEngineClient(EngineConfig(data_parallel_size=3, dp_master_port=29500))
    assert client.place(None) == 0  # all empty: the lowest rank
    client.ranks[0].streams = {"a": None, "b": None}
    client.ranks[1].streams = {"c": None}
    client.ranks[2].aborting = {"d"}  # aborted, not yet freed by its engine: still load
    assert client.place(None) == 1
    client.ranks[1].dead = "exited"
    assert client.place(None) == 2
    assert client.place(0) == 0  # an explicit rank is honoured as asked
    assert client.rank_of("c") == 1


@pytest.mark.unit
def test_a_server_of_a_group_over_hosts_runs_its_ranks_and_places_by_global_rank():
    """`--data-parallel-size 4 --data-parallel-size-local 2 --data-parallel-start-rank 2`: this
    host's server runs ranks 2 and 3 of the group meeting at rank 0's address and port."""
    cfg = EngineConfig(data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2,
                       data_parallel_address="10.0.0.1", dp_master_port=29500)
    client = DPEngineClient(cfg)
    assert [c.config.data_parallel_rank for c in client.ranks] == [2, 3]
    assert {(c.config.data_parallel_address, c.config.dp_master_port) for c in client.ranks} == {("10.0.0.1", 29500)}
    assert client.place(3) == 1 and client.place(None) == 0


@pytest.mark.unit
@pytest.mark.parametrize("kw,match", [
    ({"data_parallel_size_local": 0}, r"data_parallel_size_local must be in \[1, data_parallel_size=2\]"),
    ({"data_parallel_size_local": 3}, r"data_parallel_size_local must be in \[1, data_parallel_size=2\]"),
    ({"data_parallel_size_local": 1, "data_parallel_start_rank": 2, "dp_master_port": 1},
     r"data_parallel_start_rank=2 \+ data_parallel_size_local=1 must be <= data_parallel_size=2"),
    ({"data_parallel_start_rank": 1, "dp_master_port": 1}, "data_parallel_start_rank=1"),
    ({"data_parallel_start_rank": -1}, "data_parallel_start_rank=-1"),
    ({"data_parallel_size_local": 1}, "needs dp_master_port"),
    ({"dp_master_port": 70000}, r"dp_master_port must be in \[1, 65535\]"),
    ({"data_parallel_address": ""}, "data_parallel_address must be a host name or address")])
def test_a_group_over_hosts_that_cannot_form_is_refused_naming_the_flag(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(data_parallel_size=2, **kw)


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


@pytest.mark.integration
def test_dp2_greedy_outputs_equal_dp1_and_spread_over_both_ranks(single, dp2):
    baseline = rank_stats(dp2)
    assert [r["dp_rank"] for r in baseline] == [0, 1]
    assert complete_all(dp2) == complete_all(single)
    after = wait_back(dp2, baseline)
    for before, now in zip(baseline, after):  # both ranks looked prompts up: both served some
        assert now["prefix_cache_queries"] > before["prefix_cache_queries"]


@pytest.mark.integration
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


@pytest.mark.integration
@pytest.mark.parametrize("rank", ["2", "-1", "x"])
def test_a_bad_rank_is_a_400_naming_the_field(dp2, rank):
    status, body = http("POST", dp2.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2},
                        headers={"X-data-parallel-rank": rank})
    assert status == 400
    assert json.loads(body)["error"]["param"] == "data_parallel_rank"


@pytest.mark.integration
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


@pytest.mark.integration
def test_lockstep_coalesce_serves_the_same_tokens_and_a_dead_rank_makes_it_not_ready(single):
    server = start_server(model_dir(), "--data-parallel-size", "2", "--prefill-delayer", "coalesce",
                          "--dp-lockstep", "--dp-collective-timeout-s", "10")
    try:
        assert complete_all(server) == complete_all(single)
        cores = server.engine_pids()
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
