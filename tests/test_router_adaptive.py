"""Adaptive disaggregation (`--pd-mode adaptive`, router/adaptive.py): per request, two legs
or a local prefill on the chosen decode engine, and every decision counted with its reason.
Against fake engines (the decision, the legs, the counters); greedy equality with real
engines is in tests/test_pd_adaptive_e2e.py."""
from __future__ import annotations

import asyncio

import pytest

from router.adaptive import PDDecider
from router.app import RouterConfig
from tests.fake_workers import Cluster, http, wait_until

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

SHORT = {"model": "fake-model", "prompt": "the quick brown fox", "max_tokens": 4}
LONG = {"model": "fake-model", "prompt": "word " * 400, "max_tokens": 4}  # ~500 tokens by the router's estimate


@pytest.fixture
def make(loop):
    made = []

    def make(**kw):
        c = Cluster(loop, health_interval_s=60, **kw).start()
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


def decisions(cluster) -> dict:
    return {k: v for k, v in cluster.router.metrics.decisions.items() if len(k) <= 2}


def test_short_prompt_prefills_locally_on_decode(make):
    c = make(pd_mode="adaptive", local_prefill_max_tokens=64)
    p, d = c.prefill[0], c.decode[0]
    r = c.post("/v1/completions", SHORT)
    assert r.status == 200 and r.body == d.answers[0]
    assert p.requests == []
    assert d.requests == [("/v1/completions", SHORT)]  # the client's request, no kv_transfer_params
    assert decisions(c) == {("local_prefill", "short_prompt"): 1}
    text = c.get("/metrics").body.decode()
    assert 'atomd_router:decision_total{decision="local_prefill",reason="short_prompt"} 1.0' in text
    assert c.router.relay.decider.local_pending == {}  # no longer in flight


def test_a_local_prefill_is_in_flight_until_its_first_event_or_its_leg_ends(make, loop):
    c = make(pd_mode="adaptive", local_prefill_max_tokens=64)
    d = c.decode[0]
    decider = c.router.relay.decider
    loop.run(_clear(d.gate))  # D holds the request before any event
    held = asyncio.run_coroutine_threadsafe(http("POST", c.url + "/v1/completions", dict(SHORT, stream=True)),
                                            loop.loop)
    wait_until(lambda: decider.local_pending.get(d.url, 0) > 0, what="the local prefill counted on D")
    text = c.get("/metrics").body.decode()
    assert f'atomd_router:pd_local_prefill_tokens_in_flight{{worker="{d.url}"}}' in text
    loop.run(_set(d.gate))
    assert held.result(30).status == 200
    assert decider.local_pending == {} and decider.local_rate.samples == 1  # learnt from its first event
    d.fail_status = 500  # a leg that ends without an event is no longer in flight either
    assert c.post("/v1/completions", SHORT).status >= 500
    assert decider.local_pending == {}


def test_long_prompt_at_idle_takes_two_legs(make):
    c = make(pd_mode="adaptive", local_prefill_max_tokens=64)
    p, d = c.prefill[0], c.decode[0]
    r = c.post("/v1/completions", dict(LONG, stream=True))
    assert r.status == 200
    assert len(p.requests) == 1 and "kv_transfer_params" in d.requests[0][1]
    assert decisions(c) == {("pd", "long_prompt"): 1}
    decider = c.router.relay.decider
    assert decider.rate[p.url].samples == 1 and decider.transfer[p.url].samples == 1  # learnt from the legs
    text = c.get("/metrics").body.decode()
    assert 'atomd_router:decision_total{decision="pd",reason="long_prompt"} 1.0' in text
    assert f'atomd_router:pd_prefill_tokens_per_second{{worker="{p.url}"}}' in text
    assert f'atomd_router:pd_transfer_seconds{{worker="{p.url}"}}' in text
    assert "atomd_router:pd_local_prefill_tokens_per_second " in text


def test_long_prompt_while_every_prefill_worker_is_backed_up_prefills_locally(make, loop):
    c = make(pd_mode="adaptive", local_prefill_max_tokens=64)
    p, d = c.prefill[0], c.decode[0]
    loop.run(_clear(p.gate))  # P holds every prefill: its queue grows
    first = asyncio.run_coroutine_threadsafe(http("POST", c.url + "/v1/completions", LONG), loop.loop)
    wait_until(lambda: len(p.requests) == 1, what="the first long prompt queued on P")
    r = c.post("/v1/completions", LONG)  # P's queue ahead now costs more than a local prefill
    assert r.status == 200
    assert len(p.requests) == 1 and d.requests == [("/v1/completions", LONG)]
    loop.run(_set(p.gate))
    assert first.result(30).status == 200
    assert decisions(c) == {("pd", "long_prompt"): 1, ("local_prefill", "prefill_backlog"): 1}


def test_no_local_prefill_while_decode_streams_are_at_the_itl_bound(make, loop):
    """--local-prefill-max-itl-ms: the router learns D's pace from the events it relays; with
    P backed up, a long prompt still prefills on D when D runs no stream, and goes to P
    (`decode_busy`) when D's streams are already at the bound."""
    c = make(pd_mode="adaptive", local_prefill_max_tokens=64, local_prefill_max_itl_ms=20)
    p, d = c.prefill[0], c.decode[0]
    decider = c.router.relay.decider
    d.token_delay_s = 0.05  # D's streams get a token every 50 ms
    assert c.post("/v1/completions", dict(LONG, stream=True)).status == 200  # at idle: two legs
    assert decider.itl[d.url].value >= 0.02  # learnt from the relayed events
    text = c.get("/metrics").body.decode()
    assert f'atomd_router:pd_decode_itl_seconds{{worker="{d.url}"}}' in text
    decider.rate[p.url].value = 1.0  # P drains 1 token/s: backed up once anything queues
    loop.run(_clear(p.gate))
    queued = [asyncio.run_coroutine_threadsafe(http("POST", c.url + "/v1/completions", LONG), loop.loop)]
    wait_until(lambda: len(p.requests) == 2, what="a long prompt queued on P")
    assert c.post("/v1/completions", LONG).status == 200  # D runs no stream: local despite its pace
    loop.run(_clear(d.hold_after_first_event))
    queued.append(asyncio.run_coroutine_threadsafe(
        http("POST", c.url + "/v1/completions", dict(SHORT, stream=True)), loop.loop))
    (dw,) = c.router.registry.workers("decode")
    wait_until(lambda: dw.in_flight == 1, what="a stream held on D")
    queued.append(asyncio.run_coroutine_threadsafe(http("POST", c.url + "/v1/completions", LONG), loop.loop))
    wait_until(lambda: len(p.requests) == 3, what="the long prompt sent to P")  # counted when D answers
    loop.run(_set(p.gate))
    loop.run(_set(d.hold_after_first_event))
    assert [f.result(30).status for f in queued] == [200, 200, 200]
    assert decisions(c) == {("pd", "long_prompt"): 2, ("local_prefill", "prefill_backlog"): 1,
                            ("local_prefill", "short_prompt"): 1, ("pd", "decode_busy"): 1}


def test_strict_mode_never_prefills_locally_and_strict_pd_is_its_alias(make):
    for kw in ({"pd_mode": "strict"}, {"strict_pd": True}):
        c = make(local_prefill_max_tokens=64, **kw)
        p, d = c.prefill[0], c.decode[0]
        for body in (SHORT, LONG):
            assert c.post("/v1/completions", body).status == 200
        assert len(p.requests) == 2 and all("kv_transfer_params" in b for _, b in d.requests)
        assert decisions(c) == {("pd", "strict"): 2}
        p.keeps_kv = False  # a fallback is an error
        r = c.post("/v1/completions", SHORT)
        assert r.status == 502 and "strict-pd" in r.json()["error"]["message"]


def test_the_prefix_decode_has_cached_is_not_counted_against_a_local_prefill(make):
    c = make(pd_mode="adaptive", local_prefill_max_tokens=64)
    policy = c.router.policies["decode"]
    choose = policy.choose

    def cached_on_decode(workers, request):  # as kv_aware does from KV events
        request.expected_hit["decode"] = request.est_tokens - 10
        return choose(workers, request)

    policy.choose = cached_on_decode
    assert c.post("/v1/completions", LONG).status == 200  # long, but D holds all but 10 tokens
    assert c.prefill[0].requests == [] and decisions(c) == {("local_prefill", "short_prompt"): 1}


def test_without_prefill_workers_adaptive_prefills_locally(make):
    c = make(n_prefill=0, pd_mode="adaptive", local_prefill_max_tokens=64)
    assert c.post("/v1/completions", LONG).status == 200
    assert decisions(c) == {("local_prefill", "no_prefill_worker"): 1}


def test_default_mode_is_unchanged_two_legs_without_a_reason(make):
    c = make()
    assert c.post("/v1/completions", SHORT).status == 200
    assert len(c.prefill[0].requests) == 1 and decisions(c) == {("pd",): 1}
    assert c.router.relay.decider is None


def test_config_checks():
    assert RouterConfig(strict_pd=True).pd_mode == "strict"
    assert RouterConfig(pd_mode="strict").strict_pd is True
    with pytest.raises(ValueError, match="pd_mode"):
        RouterConfig(pd_mode="sometimes")
    with pytest.raises(ValueError, match="contradicts"):
        RouterConfig(pd_mode="adaptive", strict_pd=True)
    with pytest.raises(ValueError, match="local_prefill_max_tokens"):
        RouterConfig(local_prefill_max_tokens=-1)
    with pytest.raises(ValueError, match="local_prefill_max_itl_ms"):
        RouterConfig(local_prefill_max_itl_ms=-1)


class W:
    def __init__(self, url, queued):
        self.url, self.in_flight_tokens = url, queued


def test_decider_rule_and_learning():
    d = PDDecider(local_prefill_max_tokens=100, prefill_tokens_per_s=1000.0, transfer_s=0.01)
    assert d.decide(100, [W("a", 0)]) == ("local_prefill", "short_prompt")
    assert d.decide(500, []) == ("local_prefill", "no_prefill_worker")
    assert d.decide(500, [W("a", 0)]) == ("pd", "long_prompt")  # 0.01 s extra vs 0.5 s locally
    assert d.decide(500, [W("a", 1000)]) == ("local_prefill", "prefill_backlog")  # 1.01 s vs 0.5 s
    assert d.decide(500, [W("a", 1000), W("b", 100)]) == ("pd", "long_prompt")  # the best P counts
    d.observe_prefill("a", 4000, 1.0)  # a faster P than the prior: its queue drains sooner
    assert d.decide(500, [W("a", 1000)]) == ("pd", "long_prompt")
    d.observe_transfer("a", 2.0)  # a slow transfer makes local the better choice
    assert d.decide(500, [W("a", 0)]) == ("local_prefill", "prefill_backlog")
    d.observe_local(500, 5.0)  # ... until D's local prefill is measured slower still
    assert d.decide(500, [W("a", 0)]) == ("pd", "long_prompt")
    d.forget("a")
    assert "a" not in d.rate and "a" not in d.transfer


def test_local_prefills_in_flight_on_decode_count_against_another():
    d = PDDecider(local_prefill_max_tokens=100, prefill_tokens_per_s=1000.0, transfer_s=1.0)
    assert d.decide(500, [W("a", 0)], "d1") == ("local_prefill", "prefill_backlog")  # 1 s extra vs 0.5 s
    assert d.start_local("d1", 600) == 0
    assert d.decide(500, [W("a", 0)], "d1") == ("pd", "long_prompt")  # 1 s vs (600 + 500) / 1000 s
    assert d.decide(500, [W("a", 0)], "d2") == ("local_prefill", "prefill_backlog")  # another D: its own count
    assert d.start_local("d1", 100) == 600
    d.end_local("d1", 600)
    d.end_local("d1", 100)
    assert d.local_pending == {}
    assert d.decide(500, [W("a", 0)], "d1") == ("local_prefill", "prefill_backlog")


def test_the_itl_bound_rule():
    d = PDDecider(local_prefill_max_tokens=100, prefill_tokens_per_s=1000.0, transfer_s=1.0,
                  local_prefill_max_itl_s=0.02)
    backed_up = [W("a", 0)]  # 1 s extra on P vs 0.5 s locally
    assert d.decide(500, backed_up, "d1", 3) == ("local_prefill", "prefill_backlog")  # D's pace not measured
    d.observe_itl("d1", 0.03)
    assert d.decide(500, backed_up, "d1", 3) == ("pd", "decode_busy")
    assert d.decide(500, backed_up, "d1", 0) == ("local_prefill", "prefill_backlog")  # no stream to slow
    assert d.decide(500, backed_up, "d2", 3) == ("local_prefill", "prefill_backlog")  # another D: its own pace
    assert d.decide(50, backed_up, "d1", 3) == ("local_prefill", "short_prompt")
    for _ in range(10):
        d.observe_itl("d1", 0.005)  # its streams sped up
    assert d.decide(500, backed_up, "d1", 3) == ("local_prefill", "prefill_backlog")
    unbounded = PDDecider(local_prefill_max_tokens=100, prefill_tokens_per_s=1000.0, transfer_s=1.0)
    unbounded.observe_itl("d1", 1.0)
    assert unbounded.decide(500, backed_up, "d1", 3) == ("local_prefill", "prefill_backlog")
    d.forget("d1")
    assert "d1" not in d.itl
    with pytest.raises(ValueError, match="local_prefill_max_itl_s"):
        PDDecider(local_prefill_max_itl_s=0)


async def _clear(event: asyncio.Event) -> None:
    event.clear()


async def _set(event: asyncio.Event) -> None:
    event.set()
