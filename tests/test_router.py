"""The router's workers, policies, breaker, operational routes, metrics and CLI."""
from __future__ import annotations

import collections
import os
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.fake_engine import FakeEngine
from router.app import RouterConfig
from router.policies import PowerOfTwo, RandomChoice, RoundRobin, make_policy
from router.workers import CircuitBreaker, normalize_url
from tests.fake_workers import Cluster, http, wait_until

COMPLETION = {"model": "fake-model", "prompt": "the quick brown fox", "max_tokens": 4}


def cluster_of(loop, request, **kw) -> Cluster:
    c = Cluster(loop, **kw).start()
    request.addfinalizer(c.stop)
    return c


def samples(metrics_text: str) -> dict:
    """{(sample name, sorted labels): value} parsed by prometheus_client's own parser."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(metrics_text) for s in fam.samples}


# ---------------------------------------------------------------------- pure units

@pytest.mark.unit
def test_circuit_breaker_opens_cools_down_and_trials_once():
    now = [0.0]
    b = CircuitBreaker(failure_threshold=3, cooldown_s=10.0, clock=lambda: now[0])
    for _ in range(2):
        b.record_failure()
    assert b.state == b.CLOSED and b.allows()
    b.record_failure()
    assert b.state == b.OPEN and not b.allows()
    now[0] = 10.0
    assert b.state == b.HALF_OPEN and b.allows()
    b.on_dispatch()
    assert not b.allows()  # exactly one trial request
    b.record_failure()  # the trial failed: open for another cool-down
    assert b.state == b.OPEN
    now[0] = 20.0
    b.on_dispatch()
    b.record_success()
    assert b.state == b.CLOSED and b.consecutive_failures == 0


@pytest.mark.unit
def test_a_trial_without_verdict_lets_the_next_request_try():
    now = [0.0]
    b = CircuitBreaker(failure_threshold=1, cooldown_s=1.0, clock=lambda: now[0])
    b.record_failure()
    now[0] = 1.0
    assert b.on_dispatch() is True and b.on_dispatch() is False  # one trial only
    b.abandon_trial()  # e.g. the client hung up mid-trial
    assert b.allows() and b.state == b.HALF_OPEN


@pytest.mark.unit
def test_success_resets_the_failure_run():
    b = CircuitBreaker(failure_threshold=2)
    b.record_failure()
    b.record_success()
    b.record_failure()
    assert b.state == b.CLOSED


def fake_workers(n: int) -> list:
    return [SimpleNamespace(name=f"w{i}", in_flight=0) for i in range(n)]


@pytest.mark.unit
def test_round_robin_spreads_evenly():
    ws = fake_workers(3)
    rr = RoundRobin()
    picks = collections.Counter(rr.choose(ws, {}).name for _ in range(30))
    assert picks == {"w0": 10, "w1": 10, "w2": 10}


@pytest.mark.unit
def test_power_of_two_prefers_the_less_loaded():
    ws = fake_workers(2)
    ws[0].in_flight = 5
    p2 = PowerOfTwo(seed=1)
    assert all(p2.choose(ws, {}) is ws[1] for _ in range(20))
    assert p2.choose(ws[:1], {}) is ws[0]


@pytest.mark.unit
def test_random_reaches_every_worker():
    ws = fake_workers(3)
    r = RandomChoice(seed=0)
    assert {r.choose(ws, {}).name for _ in range(100)} == {"w0", "w1", "w2"}


@pytest.mark.unit
def test_bad_configuration_names_the_field():
    with pytest.raises(ValueError, match="policy"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="health_interval_s"):
        RouterConfig(health_interval_s=0)
    with pytest.raises(ValueError, match="request_timeout_s"):
        RouterConfig(request_timeout_s=-1)
    with pytest.raises(ValueError, match="url"):
        normalize_url("127.0.0.1:8000")
    with pytest.raises(ValueError, match="path"):
        normalize_url("http://127.0.0.1:8000/v1")
    assert normalize_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"


# ---------------------------------------------------------------------- in-process servers

@pytest.mark.unit
@pytest.mark.timeout(60)
def test_round_robin_spreads_requests_over_workers(loop, request):
    c = cluster_of(loop, request, n_prefill=2, n_decode=2, health_interval_s=60)
    for _ in range(6):
        assert c.post("/v1/completions", COMPLETION).status == 200
    assert [len(f.requests) for f in c.prefill + c.decode] == [3, 3, 3, 3]


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_health_checks_take_a_worker_out_and_bring_it_back(loop, request):
    c = cluster_of(loop, request, n_decode=2, health_interval_s=0.05)
    d0, d1 = c.decode

    def healthy(url):
        return {w["url"]: w["healthy"] for w in c.get("/workers").json()["workers"] if w["role"] == "decode"}[url]

    d1.healthy = False
    wait_until(lambda: not healthy(d1.url), what="d1 out of rotation")
    for _ in range(4):
        assert c.post("/v1/completions", COMPLETION).status == 200
    assert (len(d0.requests), len(d1.requests)) == (4, 0)
    d1.healthy = True
    wait_until(lambda: healthy(d1.url), what="d1 back in rotation")
    for _ in range(4):
        assert c.post("/v1/completions", COMPLETION).status == 200
    assert len(d1.requests) == 2
    m = samples(c.get("/metrics").body.decode())
    assert m[("atomd_router:worker_healthy", (("role", "decode"), ("worker", d1.url)))] == 1.0


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_worker_enters_on_ready_and_stays_on_health(loop, request):
    c = cluster_of(loop, request, n_decode=0, health_interval_s=0.05)
    d = FakeEngine("decode")
    loop.run(d.start())
    request.addfinalizer(lambda: loop.run(d.stop()))
    d.loaded = False  # process up (/health 200), model still loading (/ready 503)
    assert c.post("/workers", {"url": d.url, "role": "decode"}).json()["healthy"] is False
    assert c.get("/ready").status == 503
    d.loaded = True
    wait_until(lambda: c.get("/ready").status == 200, what="the loaded worker to enter rotation")
    d.loaded = False  # e.g. /ready's engine probe times out under a long prefill: stays in
    checks = d.health_checks
    wait_until(lambda: d.health_checks >= checks + 2, what="two liveness checks")
    for _ in range(3):
        assert c.post("/v1/completions", COMPLETION).status == 200
    assert c.get("/ready").status == 200 and len(d.requests) == 3


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_every_400_names_its_code_and_param(loop, request):
    """The router's own 400s have the engine's error shape: a code always, the field when one is to blame."""
    import json

    from launch.process import http as raw_http

    c = cluster_of(loop, request, health_interval_s=60)
    cases = [(b'{"prompt": "a", ', "invalid_json", None), (b'["a"]', "invalid_json", None),
             (b'{"prompt": "a", "stream": "yes"}', "invalid_value", "stream")]
    for body, code, param in cases:
        status, answer = raw_http("POST", c.url + "/v1/completions", body)
        err = json.loads(answer)["error"]
        assert (status, err["code"], err["param"]) == (400, code, param), answer
    bad = c.post("/workers", {"url": "localhost", "role": "decode"})
    assert bad.status == 400 and bad.json()["error"]["code"] == "invalid_value"


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_workers_can_be_registered_and_removed_at_run_time(loop, request):
    c = cluster_of(loop, request, n_decode=0, health_interval_s=60)
    assert c.get("/ready").status == 503  # no decode worker
    d = FakeEngine("decode")
    loop.run(d.start())
    request.addfinalizer(lambda: loop.run(d.stop()))
    r = c.post("/workers", {"url": d.url, "role": "decode"})
    assert r.status == 201 and r.json()["healthy"] is True
    assert c.post("/workers", {"url": d.url, "role": "decode"}).status == 200  # idempotent
    assert c.get("/ready").status == 200
    assert c.post("/v1/completions", COMPLETION).status == 200 and len(d.requests) == 1
    bad = c.post("/workers", {"url": d.url, "role": "both"})
    assert bad.status == 400 and "role" in bad.json()["error"]["message"]
    assert c.post("/workers", {"url": "localhost", "role": "decode"}).status == 400
    assert c.request("DELETE", "/workers", {"url": d.url}).status == 200
    assert [w["role"] for w in c.get("/workers").json()["workers"]] == ["prefill"]
    assert c.get("/ready").status == 503
    assert c.request("DELETE", "/workers", {"url": d.url}).status == 404


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_workers_show_each_engines_dp_and_tp_size(loop, request):
    """/workers shows the engine shape /kv_transfer_info tells (tp_size: 1 from an engine that
    does not say, or says something that is not a TP size)."""
    c = cluster_of(loop, request, n_decode=0, health_interval_s=60)
    shapes = {"tp4": {"dp_size": 2, "tp_size": 4}, "old": {"dp_size": 1}, "bad": {"dp_size": 1, "tp_size": "2"}}
    urls = {}
    for name, info in shapes.items():
        d = FakeEngine("decode")
        d.kv_info = {"role": "consumer", **info}
        loop.run(d.start())
        request.addfinalizer(lambda d=d: loop.run(d.stop()))
        assert c.post("/workers", {"url": d.url, "role": "decode"}).status == 201
        urls[d.url] = name
    seen = {urls[w["url"]]: (w["dp_size"], w["tp_size"]) for w in c.get("/workers").json()["workers"]
            if w["url"] in urls}
    assert seen == {"tp4": (2, 4), "old": (1, 1), "bad": (1, 1)}


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_ready_needs_a_healthy_prefill_and_decode_worker(loop, request):
    c = cluster_of(loop, request, health_interval_s=0.05)
    assert c.get("/ready").status == 200 and c.get("/health").status == 200
    c.decode[0].healthy = False
    wait_until(lambda: c.get("/ready").status == 503, what="/ready to turn false")
    assert c.get("/ready").json()["available"] == {"prefill": 1, "decode": 0}
    assert c.get("/health").status == 200  # the router itself is fine


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_metrics_parse_and_move(loop, request):
    c = cluster_of(loop, request, health_interval_s=60)
    before = samples(c.get("/metrics").body.decode())
    assert c.post("/v1/completions", dict(COMPLETION, stream=True)).status == 200
    assert c.post("/v1/completions", COMPLETION).status == 200
    c.prefill[0].fail_status = 500
    assert c.post("/v1/completions", COMPLETION).status == 502
    after = samples(c.get("/metrics").body.decode())

    def moved(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert moved("atomd_router:requests_total", endpoint="completions", status="200") == 2
    assert moved("atomd_router:requests_total", endpoint="completions", status="502") == 1
    assert moved("atomd_router:decision_total", decision="pd") == 2
    assert moved("atomd_router:time_to_first_token_seconds_count", endpoint="completions") == 1
    # D's stream for 4 tokens is 4 token events + [DONE]: 3 gaps between token events.
    assert moved("atomd_router:inter_token_latency_seconds_count", endpoint="completions") == 3
    assert moved("atomd_router:e2e_request_latency_seconds_count", endpoint="completions") == 3
    assert moved("atomd_router:leg_latency_seconds_count", leg="prefill") == 3
    assert moved("atomd_router:leg_latency_seconds_count", leg="decode") == 2
    assert moved("atomd_router:upstream_errors_total", leg="prefill", reason="status_500") == 1
    p_url = c.prefill[0].url
    assert after[("atomd_router:circuit_breaker_state", (("role", "prefill"), ("worker", p_url)))] == 0.0


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_breaker_takes_a_failing_worker_out_of_rotation(loop, request):
    c = cluster_of(loop, request, n_prefill=2, health_interval_s=60, breaker_failures=2, breaker_cooldown_s=60)
    bad, good = c.prefill
    bad.fail_status = 500
    statuses = [c.post("/v1/completions", COMPLETION).status for _ in range(6)]
    assert statuses == [200] * 6  # each 500 was retried on the good worker (issue #15)
    assert len(bad.requests) == 2 and len(good.requests) == 6  # the breaker opened after two failures
    state = {w["url"]: w["circuit_breaker"] for w in c.get("/workers").json()["workers"]}
    assert state[bad.url] == "open"


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_models_come_from_a_decode_worker(loop, request):
    c = cluster_of(loop, request, health_interval_s=60)
    r = c.get("/v1/models")
    assert r.status == 200 and r.json()["data"][0]["id"] == "fake-model"


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_api_key_guards_all_but_the_open_routes(loop, request):
    c = cluster_of(loop, request, health_interval_s=60, api_key="sekret")
    r = c.post("/v1/completions", COMPLETION)
    assert r.status == 401 and r.json()["error"]["type"] == "authentication_error"
    assert c.get("/workers").status == 401
    ok = c.post("/v1/completions", COMPLETION, headers={"Authorization": "Bearer sekret"})
    assert ok.status == 200
    assert c.prefill[0].authorizations == c.decode[0].authorizations == ["Bearer sekret"]  # forwarded
    for path in ("/health", "/ready", "/metrics"):
        assert c.get(path).status == 200


def tcp_sockets_of_this_process() -> list[socket.socket]:
    socks = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            dup = os.dup(int(fd))
        except OSError:  # closed since listdir
            continue
        try:
            s = socket.socket(fileno=dup)
        except OSError:  # not a socket
            os.close(dup)
            continue
        if s.family == socket.AF_INET and s.type == socket.SOCK_STREAM:
            socks.append(s)
        else:
            s.close()
    return socks


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_tcp_nodelay_on_client_and_upstream_sockets(loop, request):
    c = cluster_of(loop, request, health_interval_s=60)
    d = c.decode[0]
    d.hold_after_first_event.clear()  # keep both the client and the decode connection open
    router_port = int(c.url.rsplit(":", 1)[1])

    async def first_event():
        import aiohttp
        session = aiohttp.ClientSession()
        r = await session.post(c.url + "/v1/completions", json=dict(COMPLETION, stream=True))
        await r.content.readuntil(b"\n\n")
        return session, r

    session, r = loop.run(first_event())
    try:
        socks = tcp_sockets_of_this_process()
        try:
            def nodelay(pred):
                found = []
                for s in socks:
                    try:
                        local, peer = s.getsockname(), s.getpeername()
                    except OSError:
                        continue
                    if pred(local, peer):
                        found.append(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0)
                return found
            accepted = nodelay(lambda local, peer: local[1] == router_port)  # router <- client
            upstream = nodelay(lambda local, peer: peer[1] == d.port)  # router -> D
            assert accepted and all(accepted)
            assert upstream and all(upstream)
        finally:
            for s in socks:
                s.close()
    finally:
        d.hold_after_first_event.set()
        loop.run(finish(session, r))


async def finish(session, r):
    await r.read()
    await session.close()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_cli_prints_the_url_and_serves(loop, request):
    p, d = FakeEngine("prefill"), FakeEngine("decode")
    loop.run(p.start())
    loop.run(d.start())
    request.addfinalizer(lambda: (loop.run(p.stop()), loop.run(d.stop())))
    proc = subprocess.Popen([sys.executable, "-m", "router", "--port", "0", "--prefill", p.url,
                             "--decode", d.url, "--health-interval-s", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def stop():
        proc.stdout.close()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    request.addfinalizer(stop)
    line = proc.stdout.readline()
    assert line.startswith("atomd-router: ready at http://127.0.0.1:"), line
    url = line.split()[-1]
    assert loop.run(http("GET", url + "/ready")).status == 200
    r = loop.run(http("POST", url + "/v1/completions", COMPLETION))
    assert r.status == 200 and r.body == d.answers[0]
    proc.terminate()
    assert proc.wait(10) == 0


@pytest.mark.unit
def test_cli_rejects_bad_flags():
    from router.__main__ import parse_args
    with pytest.raises(SystemExit):
        parse_args(["--request-timeout-s", "0"])
    cfg = parse_args(["--prefill", "http://a:1", "--prefill", "http://b:2", "--decode", "http://c:3"])
    assert cfg.prefill == ["http://a:1", "http://b:2"] and cfg.decode == ["http://c:3"]
