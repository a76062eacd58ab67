"""Pools, retries that hold, limits and request ids (issue #15), against fake workers.

- pools: several prefill and decode workers, colocated workers (one leg), /workers behind
  an admin key that client keys do not open;
- faults: a prefill worker answering 503, hanging, or dying mid-request: the client still
  gets its answer from another prefill worker (fresh transfer_id, the abandoned one
  aborted); a decode worker dying mid-stream: an error event, no hang; the breaker opens on
  5xx and closes again; --strict-pd turns fallbacks into errors;
- limits: a concurrency cap with a bounded queue (429 + Retry-After), a total timeout;
  X-Request-Id reaches both legs and comes back.
"""
from __future__ import annotations

import asyncio
import collections
import random

import aiohttp
import pytest

from tests.fake_workers import Cluster, make, wait_until

__all__ = ["make"]  # the fixture, shared (tests/fake_workers.py)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

COMPLETION = {"model": "fake-model", "prompt": "the quick brown fox", "max_tokens": 4}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4}


def transfer_ids(engine) -> list[str]:
    return [b["kv_transfer_params"]["transfer_id"] for _, b in engine.requests]


# ------------------------------------------------------------------ retries

def test_one_of_two_prefill_workers_answering_503_costs_no_request(make):
    """The issue's reproduction: 200 mixed requests, one of two prefill workers answers 503.
    Before #15, 66 of them failed with 502; every one must now succeed."""
    c = make(n_prefill=2, n_decode=2)
    bad, good = c.prefill
    bad.fail_status, bad.fail_message = 503, "engine is loading"
    rng = random.Random(15)

    async def one(session, i):
        path, body = ("/v1/chat/completions", CHAT) if rng.random() < 0.5 else ("/v1/completions", COMPLETION)
        stream = rng.random() < 0.5
        async with session.post(c.url + path, json=dict(body, stream=stream)) as r:
            data = await r.read()
            return r.status, data

    async def run():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(one(s, i) for i in range(200)))

    results = c.loop.run(run(), timeout=60)
    statuses = collections.Counter(status for status, _ in results)
    assert statuses == {200: 200}
    assert all(b"error" not in data for _, data in results)
    assert len(good.requests) == 200 and 0 < len(bad.requests) <= 200
    # every try the bad worker got was aborted (it might have pinned blocks)
    wait_until(lambda: sorted(bad.aborts) == sorted(transfer_ids(bad)), 10, "aborts of the abandoned tries")
    text = c.get("/metrics").body.decode()
    assert 'atomd_router:upstream_errors_total{leg="prefill",reason="status_503"}' in text
    assert c.get("/workers").json()["workers"][0]["circuit_breaker"] == "open"  # 5xx opens it too


def test_a_hanging_prefill_worker_is_left_for_another(make):
    c = make(n_prefill=2, prefill_timeout_s=0.3, prefill_policy="round_robin")
    hung, ok = c.prefill
    hung.gate.clear()  # accepts the request and never answers
    for _ in range(2):  # round robin: one of the two first goes to the hung worker
        r = c.post("/v1/completions", dict(COMPLETION, stream=True))
        assert r.status == 200 and r.body.rstrip().endswith(b"data: [DONE]")
    tids = transfer_ids(hung)
    assert tids and not set(tids) & set(transfer_ids(ok))  # a fresh transfer id for each new try
    assert c.decode[0].pulled == transfer_ids(ok)
    wait_until(lambda: sorted(hung.aborts) == sorted(tids), 10, "the abort of the hung tries")
    assert 'atomd_router:upstream_errors_total{leg="prefill",reason="timeout"}' in c.get("/metrics").body.decode()


def test_a_prefill_worker_dying_mid_request_is_retried_elsewhere(make):
    c = make(n_prefill=2, prefill_policy="round_robin")
    dying, ok = c.prefill
    dying.drop_next = 10  # reads the request, then the connection drops
    for _ in range(4):
        assert c.post("/v1/completions", COMPLETION).status == 200
    assert len(ok.requests) == 4 and c.decode[0].pulled == transfer_ids(ok)
    wait_until(lambda: sorted(dying.aborts) == sorted(transfer_ids(dying)), 10, "aborts")


def test_retries_are_bounded_and_backed_off(make):
    c = make(n_prefill=3, max_prefill_tries=2, retry_backoff_s=0.001)
    for p in c.prefill:
        p.fail_status = 500
    r = c.post("/v1/completions", COMPLETION)
    assert r.status == 502 and "engine exploded" in r.json()["error"]["message"]
    assert sum(len(p.requests) for p in c.prefill) == 2 and c.decode[0].requests == []
    assert 'atomd_router:retries_total{leg="prefill"} 1.0' in c.get("/metrics").body.decode()


def test_no_retry_once_the_stream_started(make):
    c = make(n_decode=2)
    c.decode[0].die_after_events = 1
    c.decode[1].die_after_events = 1
    r = c.post("/v1/completions", dict(COMPLETION, stream=True))
    assert r.status == 200
    events = [e for e in r.body.split(b"\n\n") if e]
    assert b'"error"' in events[-2] and events[-1] == b"data: [DONE]"
    assert sum(len(d.requests) for d in c.decode) == 1


@pytest.mark.parametrize("how", ["dies", "goes_silent"])
def test_a_decode_worker_failing_mid_stream_never_hangs_the_client(make, loop, how):
    c = make(request_timeout_s=0.5)
    d = c.decode[0]
    if how == "dies":
        d.die_after_events = 1  # its connection drops after one event
    else:
        d.hold_after_first_event.clear()  # one event, then nothing

    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(c.url + "/v1/completions", json=dict(COMPLETION, stream=True)) as r:
                return r.status, await asyncio.wait_for(r.read(), 10)  # a deadline, not a hang
    status, body = loop.run(go())
    events = [e for e in body.split(b"\n\n") if e]
    assert status == 200 and events[0].startswith(b"data: {")
    assert b'"error"' in events[-2] and events[-1] == b"data: [DONE]"
    d.hold_after_first_event.set()


def test_the_breaker_opens_on_5xx_and_closes_after_a_good_trial(make):
    c = make(n_prefill=2, breaker_failures=2, breaker_cooldown_s=0.3, prefill_policy="round_robin")
    bad = c.prefill[0]
    bad.fail_status = 500

    def state():
        return {w["url"]: w["circuit_breaker"] for w in c.get("/workers").json()["workers"]}[bad.url]

    for _ in range(4):
        assert c.post("/v1/completions", COMPLETION).status == 200
    assert state() == "open" and len(bad.requests) == 2
    bad.fail_status = None  # healed
    wait_until(lambda: state() == "half_open", 5, "the cool-down")
    for _ in range(4):
        assert c.post("/v1/completions", COMPLETION).status == 200
    assert state() == "closed" and len(bad.requests) >= 3


def test_strict_pd_turns_fallbacks_into_errors(make):
    loose = make()
    loose.prefill[0].keeps_kv = False
    assert loose.post("/v1/completions", COMPLETION).status == 200
    assert 'atomd_router:fallbacks_total{reason="prefill_kept_no_kv"} 1.0' in loose.get("/metrics").body.decode()
    strict = make(strict_pd=True)
    strict.prefill[0].keeps_kv = False
    r = strict.post("/v1/completions", COMPLETION)
    assert r.status == 502 and "strict-pd" in r.json()["error"]["message"]
    assert strict.decode[0].requests == []
    none = make(n_prefill=0)
    assert none.post("/v1/completions", COMPLETION).status == 200  # D prefills itself
    assert 'atomd_router:fallbacks_total{reason="no_prefill_worker"} 1.0' in none.get("/metrics").body.decode()
    none_strict = make(n_prefill=0, strict_pd=True)
    r = none_strict.post("/v1/completions", COMPLETION)
    assert r.status == 503 and r.json()["error"]["code"] == "no_prefill_worker"


# ------------------------------------------------------------------ pools

def test_pools_of_any_size_spread_both_legs(make):
    c = make(n_prefill=3, n_decode=2)
    for _ in range(12):
        assert c.post("/v1/completions", COMPLETION).status == 200
    assert [len(p.requests) for p in c.prefill] == [4, 4, 4]
    assert [len(d.requests) for d in c.decode] == [6, 6]


def test_colocated_workers_serve_one_leg_with_the_same_policies(make):
    c = make(n_prefill=0, n_decode=0, n_worker=2, decode_policy="session")
    for user in ("a", "b", "a", "b", "a"):
        r = c.post("/v1/chat/completions", dict(CHAT, user=user, stream=True))
        assert r.status == 200 and r.body.rstrip().endswith(b"data: [DONE]")
    homes = {u: {i for i, w in enumerate(c.worker) for _, b in w.requests if b["user"] == u} for u in "ab"}
    assert all(len(h) == 1 for h in homes.values())  # sticky per user
    assert all("kv_transfer_params" not in body for w in c.worker for _, body in w.requests)
    assert c.get("/ready").json() == {"ready": True, "available": {"prefill": 0, "decode": 0, "worker": 2}}
    assert c.get("/v1/models").status == 200
    c.worker[0].fail_status = 500  # a colocated 5xx before any byte moves to the other worker
    for _ in range(2):
        assert c.post("/v1/completions", COMPLETION).status == 200


def test_colocated_workers_take_over_when_the_pd_pool_is_down(make):
    c = make(n_worker=1, health_interval_s=0.05)
    c.decode[0].healthy = False
    wait_until(lambda: c.get("/ready").json()["available"]["decode"] == 0, 5, "decode out of rotation")
    assert c.post("/v1/completions", COMPLETION).status == 200
    assert len(c.worker[0].requests) == 1
    assert 'atomd_router:fallbacks_total{reason="colocated"} 1.0' in c.get("/metrics").body.decode()


def test_workers_routes_take_the_admin_key_not_a_client_key(make):
    c = make(api_key="client-key", admin_api_key="admin-key")
    client, admin = {"Authorization": "Bearer client-key"}, {"Authorization": "Bearer admin-key"}
    assert c.post("/v1/completions", COMPLETION, headers=client).status == 200
    assert c.post("/v1/completions", COMPLETION, headers=admin).status == 401
    for method in ("GET", "POST", "DELETE"):
        assert c.request(method, "/workers", {"url": "http://127.0.0.1:1", "role": "decode"},
                         headers=client).status == 401
    assert c.get("/dashboard/state", headers=client).status == 401
    assert c.get("/workers", headers=admin).status == 200
    r = c.request("POST", "/workers", {"url": "http://127.0.0.1:1", "role": "decode"}, headers=admin)
    assert r.status == 201 and r.json()["healthy"] is False
    assert c.request("DELETE", "/workers", {"url": "http://127.0.0.1:1"}, headers=admin).status == 200
    assert c.get("/dashboard").status == 200  # the page itself is static; its data needs the key
    with pytest.raises(ValueError, match="admin_api_key"):
        from router.app import RouterConfig
        RouterConfig(api_key="same", admin_api_key="same")


# ------------------------------------------------------------------ limits, request ids

def test_a_full_queue_is_a_429_with_retry_after(make, loop):
    c = make(max_concurrent_requests=1, max_queued_requests=1, queue_timeout_s=30, retry_after_s=3)
    d = c.decode[0]
    d.gate.clear()  # the first request holds the only slot

    async def go():
        async with aiohttp.ClientSession() as s:
            first = asyncio.create_task(s.post(c.url + "/v1/completions", json=COMPLETION))
            await wait_async(lambda: d.requests)
            second = asyncio.create_task(s.post(c.url + "/v1/completions", json=COMPLETION))
            await wait_async(lambda: c.router.admission.state() == (1, 1))
            third = await s.post(c.url + "/v1/completions", json=COMPLETION)
            body3 = await third.json()
            d.gate.set()
            r1, r2 = await first, await second
            return r1.status, r2.status, third.status, third.headers.get("Retry-After"), body3
    s1, s2, s3, retry_after, body3 = loop.run(go())
    assert (s1, s2, s3) == (200, 200, 429) and retry_after == "3"
    assert body3["error"]["type"] == "rate_limit_error" and body3["error"]["code"] == "queue_full"
    assert 'atomd_router:rejected_total{reason="queue_full"} 1.0' in c.get("/metrics").body.decode()


def test_a_queued_request_waits_at_most_queue_timeout(make, loop):
    c = make(max_concurrent_requests=1, max_queued_requests=4, queue_timeout_s=0.2)
    d = c.decode[0]
    d.gate.clear()

    async def go():
        async with aiohttp.ClientSession() as s:
            first = asyncio.create_task(s.post(c.url + "/v1/completions", json=COMPLETION))
            await wait_async(lambda: d.requests)
            second = await s.post(c.url + "/v1/completions", json=COMPLETION)
            d.gate.set()
            return (await first).status, second.status, (await second.json())["error"]["code"]
    assert loop.run(go()) == (200, 429, "queue_timeout")


def test_the_queue_admits_by_priority_then_arrival(make, loop):
    """Behind --max-concurrent-requests the router's queue is in `priority` order (lower first,
    as the engines' priority scheduling), then arrival: the reference is that sort."""
    c = make(max_concurrent_requests=1, max_queued_requests=8, queue_timeout_s=30)
    d = c.decode[0]
    d.gate.clear()
    waiting = [("p5", 5), ("p0a", 0), ("p3", 3), ("p0b", 0), ("pm1", -1)]

    async def go():
        async with aiohttp.ClientSession() as s:
            tasks = [asyncio.create_task(s.post(c.url + "/v1/completions", json=dict(COMPLETION, prompt="hold")))]
            await wait_async(lambda: d.requests)
            for n, (prompt, priority) in enumerate(waiting, start=1):
                tasks.append(asyncio.create_task(s.post(c.url + "/v1/completions", json=dict(
                    COMPLETION, prompt=prompt, priority=priority))))
                await wait_async(lambda: c.router.admission.state() == (1, n))
            d.gate.set()
            return [r.status for r in await asyncio.gather(*tasks)]
    assert loop.run(go()) == [200] * 6
    order = [b["prompt"] for path, b in d.requests]
    assert order == ["hold"] + [p for p, _ in sorted(waiting, key=lambda w: (w[1], waiting.index(w)))]


def test_a_request_of_several_prompts_takes_a_slot_per_prompt(make, loop):
    """Three prompts take three of four slots; a later single request waits behind a waiting
    two-prompt one (nothing overtakes the head), and all run once slots free."""
    c = make(max_concurrent_requests=4, max_queued_requests=8, queue_timeout_s=30)
    d = c.decode[0]
    d.gate.clear()

    async def go():
        async with aiohttp.ClientSession() as s:
            def post(prompt):
                return asyncio.create_task(s.post(c.url + "/v1/completions", json=dict(COMPLETION, prompt=prompt)))
            tasks = [post(["a", "b", "c"])]
            await wait_async(lambda: c.router.admission.state() == (3, 0) and len(d.requests) == 3)
            tasks.append(post(["d", "e"]))
            await wait_async(lambda: c.router.admission.state() == (3, 1))
            tasks.append(post("f"))  # one slot is free, but the two-prompt request is first
            await wait_async(lambda: c.router.admission.state() == (3, 2))
            assert len(d.requests) == 3
            d.gate.set()
            statuses = [r.status for r in await asyncio.gather(*tasks)]
            await wait_async(lambda: c.router.admission.state() == (0, 0))
            return statuses
    assert loop.run(go()) == [200, 200, 200]
    assert sorted(b["prompt"] for _, b in d.requests) == list("abcdef")


def test_total_timeout_before_and_after_the_first_byte(make):
    c = make(total_timeout_s=0.3)
    d = c.decode[0]
    d.gate.clear()
    r = c.post("/v1/completions", COMPLETION)
    assert r.status == 504 and "total-timeout-s" in r.json()["error"]["message"]
    d.gate.set()
    d.hold_after_first_event.clear()
    r = c.post("/v1/completions", dict(COMPLETION, stream=True))
    events = [e for e in r.body.split(b"\n\n") if e]
    assert r.status == 200 and b"total-timeout-s" in events[-2] and events[-1] == b"data: [DONE]"
    d.hold_after_first_event.set()


def test_x_request_id_reaches_both_legs_and_comes_back(make):
    c = make()
    p, d = c.prefill[0], c.decode[0]

    class R:
        def __init__(self, reply):
            self.status, self.headers = reply.status, {k.lower(): v for k, v in reply.headers.items()}
            self.reply = reply

        def json(self):
            return self.reply.json()

    post = c.post
    c.post = lambda *a, **kw: R(post(*a, **kw))
    r = c.post("/v1/completions", COMPLETION, headers={"X-Request-Id": "client-chosen-42"})
    assert r.headers["x-request-id"] == "client-chosen-42"
    assert p.request_ids == d.request_ids == ["client-chosen-42"]
    r = c.post("/v1/completions", dict(COMPLETION, stream=True))
    minted = r.headers["x-request-id"]
    assert len(minted) == 32 and p.request_ids[-1] == d.request_ids[-1] == minted
    r = c.post("/v1/completions", COMPLETION, headers={"X-Request-Id": "bad id with spaces"})
    assert r.headers["x-request-id"] != "bad id with spaces"
    p.fail_status = 400
    r = c.post("/v1/completions", COMPLETION, headers={"X-Request-Id": "on-errors-too"})
    assert r.status == 400 and r.headers["x-request-id"] == "on-errors-too"


async def wait_async(pred, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pred():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)
