"""The online planner (launch/autoscale.py): the window quantile against numpy, the hysteresis
and cooldown against a scripted latency series, and a rate ramp up and down on simulated
engines behind a real router: both pools grow under load and shrink after it, every request
completes whole (a drain never cuts a stream), and every drained engine went with its whole
KV pool free."""
from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from atomd.sim.hardware import LinearStep
from launch import autoscale
from launch.autoscale import Autoscaler, PoolPolicy, ProcessLauncher, window_quantile
from launch.process import RouterServer, http
from tests.pd_fixtures import sse_events
from tests.server_fixtures import ENGINE_ARGS, REPO, START_TIMEOUT_S, server_log
from tests.sim_fixtures import default_model_profile, sim_flags


def test_the_window_quantile_is_the_bucket_holding_numpys_quantile():
    rng = np.random.default_rng(0)
    les = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, float("inf")]
    old, new = rng.exponential(0.05, 300), rng.exponential(0.2, 500)

    def cumulative(samples):
        return {le: float((samples <= le).sum()) for le in les}

    before = cumulative(old)
    after = cumulative(np.concatenate([old, new]))
    want = next(le for le in les if le >= np.quantile(new, 0.9, method="inverted_cdf"))
    assert window_quantile(before, after, 0.9) == want
    assert window_quantile(after, after, 0.9) is None  # nothing in the window


class FakeLauncher:
    def __init__(self):
        self.started, self.stopped = [], []

    def start(self, role):
        url = f"http://{role}-{len(self.started)}"
        self.started.append(url)
        return url

    def stop(self, url):
        self.stopped.append(url)


def test_hysteresis_and_cooldown(monkeypatch):
    """Windows of 5 s: up after 2 hot windows, not inside the 10 s cooldown, never past max;
    nothing in the band; down after 3 cold windows, by a drain of an idle engine."""
    idle = {"num_running": 0, "num_waiting": 0, "api_requests_in_flight": 0, "num_free_blocks": 8,
            "num_total_blocks": 8, "kv_transfer": {"blocks_pinned": 0}}
    calls = []

    def fake_http(method, url, body=None, headers=None, timeout=60.0):
        calls.append((method, url))
        return (200, json.dumps(idle).encode()) if url.endswith("/debug/stats") else (201, b"{}")

    monkeypatch.setattr(autoscale, "http", fake_http)
    clock = [0.0]
    policy = PoolPolicy(min=1, max=3, slo_s=1.0, up=0.9, down=0.3, up_windows=2, down_windows=3, cooldown_s=10)
    a = Autoscaler("http://router", FakeLauncher(), policy, PoolPolicy(min=1, max=1, slo_s=1.0),
                   clock=lambda: clock[0])
    a.start_minimum()
    pool = a.pools["prefill"]

    def window(p90):
        clock[0] += 5
        a._decide("prefill", pool, p90, clock[0])
        return len(pool.urls)

    assert [window(2.0), window(2.0)] == [1, 2]  # two hot windows: up
    assert [window(2.0), window(2.0)] == [2, 3]  # the first inside the 10 s cooldown
    assert [window(2.0) for _ in range(3)] == [3] * 3  # at max
    assert [window(0.5) for _ in range(4)] == [3] * 4  # the band: nothing
    assert [window(None), window(0.1), window(0.1)] == [3, 3, 2]  # three cold windows: one drained
    assert a.drained[-1].free_blocks == a.drained[-1].total_blocks
    assert ("DELETE", "http://router/workers") in calls
    # one window suffices, but the 10 s cooldown after any change holds every other one back ...
    policy.up_windows, policy.down_windows, policy.max = 1, 1, 6
    assert [window(2.0) for _ in range(4)] == [2, 3, 3, 4]
    assert [window(0.1) for _ in range(3)] == [4, 3, 3]
    # ... while with a short up-cooldown each hot window adds one (a ramp), and a drain still
    # waits out the whole cooldown after any change
    policy.up_cooldown_s = 0.0
    assert [window(2.0) for _ in range(3)] == [4, 5, 6]
    assert [window(0.1) for _ in range(3)] == [6, 5, 5]


def test_a_learnt_rate_keeps_a_drain_from_a_size_that_ran_hot_and_scales_up_ahead(monkeypatch):
    """learn_rates: the rate at which a size ran hot (a scale-up on latency) blocks draining
    back to it at rate_margin x that rate, and scales up ahead of the latency there; the rate
    is the router's answered requests a second over the last windows."""
    idle = {"num_running": 0, "num_waiting": 0, "api_requests_in_flight": 0, "num_free_blocks": 8,
            "num_total_blocks": 8, "kv_transfer": {"blocks_pinned": 0}}
    monkeypatch.setattr(autoscale, "http", lambda method, url, body=None, headers=None, timeout=60.0:
                        (200, json.dumps(idle).encode()) if url.endswith("/debug/stats") else (201, b"{}"))
    policy = PoolPolicy(min=1, max=3, slo_s=1.0, up_windows=1, down_windows=1, cooldown_s=0, learn_rates=True)
    a = Autoscaler("http://router", FakeLauncher(), policy, PoolPolicy(min=1, max=1, slo_s=1.0), clock=lambda: 0.0)
    a.start_minimum()
    pool = a.pools["prefill"]

    def window(p90, rate):
        a._decide("prefill", pool, p90, 0.0, rate)
        return len(pool.urls)

    assert window(2.0, 4.0) == 2 and pool.hot_rate == {1: 4.0}  # 1 engine ran hot at 4 req/s
    assert window(0.1, 4.0) == 2  # cold, but 1 engine ran hot at this rate: no drain
    assert window(0.1, 3.0) == 1  # under 0.9 x 4: drained
    assert window(0.5, 3.7) == 2 and pool.hot_rate == {1: 4.0}  # latency in the band, the rate there: up ahead
    # a hot window with nothing answered learns no rate (0 req/s would block every later drain)
    assert window(2.0, 0.0) == 3 and pool.hot_rate == {1: 4.0}
    assert window(0.1, 0.0) == 2
    # without learn_rates the same windows only follow the latency
    policy.learn_rates = False
    assert [window(0.1, 4.0), window(0.5, 3.7)] == [1, 1]
    # the rate itself: the counter's delta over the time between reads, averaged over the windows
    text = "# TYPE atomd_router:requests counter\natomd_router:requests_total{endpoint=\"a\",status=\"200\"} %d\n" \
        "atomd_router:requests_total{endpoint=\"b\",status=\"200\"} 5\n"
    assert autoscale.counter_total(text % 10, "atomd_router:requests") == 15
    assert a._rate(0.0, 15) is None and a._rate(2.0, 25) == 5.0 and a._rate(4.0, 29) == 3.5
    assert a._rate(6.0, 3) is None  # a restarted router's counter: no rate this window


# ---------------------------------------------------------------- a ramp on simulated engines

SLOW_PREFILL = LinearStep(base_s=0.02, per_token_s=1e-3, per_attention_s=0.0)  # 64 tokens: 84 ms alone
SLOW_DECODE = LinearStep(base_s=0.01, per_token_s=5e-3, per_attention_s=0.0)  # 15 ms a token alone, 50 at 8


# e2e: one of the longest multi-process runs (`make e2e`), kept out of make test's 10 minutes
@pytest.mark.e2e
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_rate_ramp_grows_and_shrinks_both_pools_without_cutting_a_stream(tmp_path):
    profile = default_model_profile(tmp_path / "slow.json", prefill=SLOW_PREFILL, decode=SLOW_DECODE)
    flags = [*ENGINE_ARGS, *sim_flags(profile)]
    launcher = ProcessLauncher(None, {"prefill": flags, "decode": flags}, log_dir=str(tmp_path))
    router = RouterServer([], [], "--health-interval-s", "0.3", log=server_log(), cwd=REPO)
    scaler = None
    try:
        router.wait_ready(START_TIMEOUT_S, path="/health")
        scaler = Autoscaler(router.url, launcher,
                            # down at 0.6 x SLO: one client alone (TTFT ~0.1 s, ITL ~15 ms: the router's
                            # buckets 0.1 / 0.25 s and 25 ms) is cold, so the drains happen while its
                            # streams run; ten clients (TTFT ~0.7 s, ITL ~60 ms) are hot
                            PoolPolicy(min=1, max=2, slo_s=0.5, down=0.6, up_windows=2, down_windows=2, cooldown_s=2),
                            PoolPolicy(min=1, max=2, slo_s=0.05, down=0.6, up_windows=2, down_windows=2,
                                       cooldown_s=2),
                            window_s=1.0)
        scaler.start_minimum()
        scaler.start()
        results, stop = [], threading.Event()

        def client(seed: int):
            rng = np.random.default_rng(seed)
            while not stop.is_set():
                body = {"prompt": rng.integers(10, 4096, 64).tolist(), "max_tokens": 24, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}
                status, raw = http("POST", router.url + "/v1/completions", body, timeout=120)
                events = sse_events(raw) if status == 200 else []
                usage = next((e["usage"] for e in reversed(events) if e.get("usage")), {})
                results.append((status, raw.rstrip().endswith(b"data: [DONE]"), usage.get("completion_tokens"),
                                any("error" in e for e in events)))

        def run_clients(n: int, until) -> None:
            threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
            stop.clear()
            for t in threads:
                t.start()
            deadline = time.monotonic() + 90
            while not until() and time.monotonic() < deadline:
                time.sleep(0.2)
            stop.set()
            for t in threads:
                t.join(120)

        def sizes():
            return len(scaler.pools["prefill"].urls), len(scaler.pools["decode"].urls)

        run_clients(10, lambda: sizes() == (2, 2))  # ramp up: ~10x one pair's capacity
        assert max(p for _, p, _ in scaler.history) == 2 and max(d for _, _, d in scaler.history) == 2
        during = len(results)
        run_clients(1, lambda: sizes() == (1, 1))  # ramp down: one client streams while the planner drains
        assert sizes() == (1, 1), scaler.history
        assert len(results) > during  # the drains ran beside live streams
        assert results and all(r == (200, True, 24, False) for r in results), \
            [r for r in results if r != (200, True, 24, False)][:5]
        scaler.stop()  # a drain in progress finishes first
        assert {d.role for d in scaler.drained} == {"prefill", "decode"}
        assert all(d.free_blocks == d.total_blocks for d in scaler.drained)  # no block leaked
    finally:
        if scaler is not None:
            scaler.stop()
        launcher.stop_all()
        router.stop()
