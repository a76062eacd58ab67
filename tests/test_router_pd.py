"""The router's two-leg relay against fake engines that follow the engine HTTP contract."""
from __future__ import annotations

import asyncio
import re

import aiohttp
import msgspec
import openai
import pytest

from tests.fake_workers import Cluster, LoopThread, wait_until
from tests.fake_workers import http as fake_http

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

COMPLETION = {"model": "fake-model", "prompt": "the quick brown fox", "max_tokens": 8}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 8}


@pytest.fixture
def cluster(loop):
    c = Cluster(loop, health_interval_s=60).start()
    yield c
    c.stop()


def sse_events(data: bytes) -> list[bytes]:
    return [e for e in data.split(b"\n\n") if e]


def test_legs_in_order_with_the_right_bodies(cluster):
    p, d = cluster.prefill[0], cluster.decode[0]
    body = dict(CHAT, stream_options={"include_usage": True}, min_tokens=2, max_completion_tokens=4, n=1)
    r = cluster.post("/v1/chat/completions", body)
    assert r.status == 200
    (p_path, p_body), = p.requests
    assert p_path == "/v1/chat/completions"
    kv_in = p_body.pop("kv_transfer_params")
    assert kv_in["do_remote_decode"] is True and re.fullmatch(r"[0-9a-f]{32}", kv_in["transfer_id"])
    expected_p = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    expected_p.update(max_tokens=1, max_completion_tokens=1, stream=False, n=1)
    assert p_body == expected_p
    # D gets the client's body untouched plus exactly what P returned.
    (d_path, d_body), = d.requests
    p_kv = msgspec.json.decode(p.answers[0])["kv_transfer_params"]
    assert d_path == "/v1/chat/completions"
    assert d_body == dict(body, kv_transfer_params=p_kv)
    assert p_kv["transfer_id"] == kv_in["transfer_id"] and d.pulled == [kv_in["transfer_id"]]
    assert r.body == d.answers[0]  # non-stream body relayed byte for byte
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == p.prefix_cache_hit_tokens
    assert p.aborts == []  # D pulled, nothing to abort


def test_a_prefill_without_kv_params_sends_the_plain_request_to_decode(cluster):
    p, d = cluster.prefill[0], cluster.decode[0]
    p.keeps_kv = False
    r = cluster.post("/v1/completions", COMPLETION)
    assert r.status == 200 and r.body == d.answers[0]
    assert d.requests == [("/v1/completions", COMPLETION)]  # D prefills it itself
    assert p.aborts == []  # P pinned nothing
    assert 'atomd_router:decision_total{decision="decode_without_kv"} 1.0' in cluster.get("/metrics").body.decode()


def test_kv_params_from_p_are_checked_but_relayed_verbatim(cluster):
    p, d = cluster.prefill[0], cluster.decode[0]
    p.kv_extra = {"field_from_a_newer_engine": [1, 2]}
    assert cluster.post("/v1/completions", COMPLETION).status == 200
    assert d.requests[0][1]["kv_transfer_params"]["field_from_a_newer_engine"] == [1, 2]
    p.kv_extra = {"remote_port": "not a port"}
    r = cluster.post("/v1/completions", COMPLETION)
    assert r.status == 502 and "remote_port" in r.json()["error"]["message"]
    assert len(d.requests) == 1  # D never saw the broken one
    wait_until(lambda: len(p.aborts) == 1, what="abort of the broken transfer")


def test_each_request_mints_a_fresh_transfer_id(cluster):
    for _ in range(3):
        assert cluster.post("/v1/completions", COMPLETION).status == 200
    ids = [b["kv_transfer_params"]["transfer_id"] for _, b in cluster.prefill[0].requests]
    assert len(set(ids)) == 3


@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_stream_is_relayed_byte_for_byte(cluster, path, body):
    r = cluster.post(path, dict(body, stream=True, stream_options={"include_usage": True}))
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    d = cluster.decode[0]
    assert r.body == d.streams[0]
    assert sse_events(r.body)[-1] == b"data: [DONE]"
    assert cluster.prefill[0].requests[0][1]["stream"] is False


def test_prefill_5xx_is_a_502_with_the_prefill_message(cluster):
    cluster.prefill[0].fail_status = 500
    r = cluster.post("/v1/completions", COMPLETION)
    assert r.status == 502
    err = r.json()["error"]
    assert "engine exploded" in err["message"] and {"message", "type", "param", "code"} <= err.keys()
    assert cluster.decode[0].requests == []


def test_prefill_4xx_passes_through(cluster):
    p = cluster.prefill[0]
    p.fail_status, p.fail_message = 400, "max_tokens is too large"
    r = cluster.post("/v1/chat/completions", dict(CHAT, stream=True))
    assert r.status == 400
    assert r.json() == {"error": {"message": "max_tokens is too large", "type": "invalid_request_error",
                                  "param": "max_tokens", "code": None}}
    assert cluster.decode[0].requests == []


def test_decode_5xx_before_any_byte_is_a_502_and_aborts_the_transfer(cluster):
    p, d = cluster.prefill[0], cluster.decode[0]
    d.fail_status = 503
    r = cluster.post("/v1/completions", dict(COMPLETION, stream=True))
    assert r.status == 502 and "engine exploded" in r.json()["error"]["message"]
    tid = p.requests[0][1]["kv_transfer_params"]["transfer_id"]
    wait_until(lambda: p.aborts == [tid], what="abort on P")


def test_decode_dying_mid_stream_ends_with_an_error_event(cluster):
    d = cluster.decode[0]
    d.die_after_events = 2
    r = cluster.post("/v1/completions", dict(COMPLETION, stream=True))
    assert r.status == 200
    events = sse_events(r.body)
    assert b"\n\n".join(events[:2]) + b"\n\n" == d.streams[0]  # what D sent, untouched
    assert "error" in msgspec.json.decode(events[2][len(b"data: "):])
    assert events[3:] == [b"data: [DONE]"]


@pytest.mark.parametrize("stream,answer", [
    (False, b'{"error": {"message": "pull failed", "type": "internal_error"}}'),
    (False, b""),
    (False, b"not json"),
    (True, b'data: {"error": {"message": "pull failed", "type": "internal_error"}}\n\n'),
    (True, b""),
    (True, b'data: {"choices": []}\n\n'),  # ends before [DONE]
])
def test_never_a_200_with_an_empty_or_error_body(cluster, stream, answer):
    cluster.decode[0].bad_answer = answer
    r = cluster.post("/v1/completions", dict(COMPLETION, stream=stream))
    if r.status == 200:  # only once bytes went out: then the stream must end with an error event
        events = sse_events(r.body)
        assert answer.startswith(b"data: {") and b'"error"' in events[-2] and events[-1] == b"data: [DONE]"
    else:
        assert r.status == 502 and "error" in r.json()
        if b"pull failed" in answer:
            assert "pull failed" in r.json()["error"]["message"]


def test_decode_leg_moves_when_a_decode_worker_refuses_connections(loop):
    c = Cluster(loop, n_decode=2, health_interval_s=60).start()
    try:
        loop.run(c.decode[1].stop())
        for _ in range(2):
            assert c.post("/v1/completions", dict(COMPLETION, stream=True)).status == 200
        assert len(c.decode[0].requests) == 2
        assert 'atomd_router:retries_total{leg="decode"} 1.0' in c.get("/metrics").body.decode()
        assert c.prefill[0].aborts == []
    finally:
        c.stop()


async def read_one_event_and_hang_up(url: str, body: dict) -> None:
    async with aiohttp.ClientSession() as s:
        r = await s.post(url, json=body)
        await r.content.readuntil(b"\n\n")
        r.close()  # drop the connection mid-stream


def hang_up_when(loop: LoopThread, url: str, body: dict, condition) -> None:
    """Send a request and drop the connection, before any byte came back, once `condition()`."""
    async def go():
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(s.post(url, json=body))
            deadline = asyncio.get_running_loop().time() + 10
            while not condition():
                assert asyncio.get_running_loop().time() < deadline, "the request never arrived"
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    loop.run(go())


def test_client_disconnect_before_the_pull_cancels_d_and_aborts_p(cluster, loop):
    p, d = cluster.prefill[0], cluster.decode[0]
    d.gate.clear()  # D holds the request before pulling
    hang_up_when(loop, cluster.url + "/v1/completions", dict(COMPLETION, stream=True), lambda: d.requests)
    tid = p.requests[0][1]["kv_transfer_params"]["transfer_id"]
    wait_until(lambda: d.cancelled == [tid], what="D to see its request cancelled")
    wait_until(lambda: p.aborts == [tid], what="abort on P")
    assert d.pulled == []


def test_client_disconnect_during_the_prefill_leg_cancels_p_and_aborts(cluster, loop):
    p, d = cluster.prefill[0], cluster.decode[0]
    p.gate.clear()  # P holds the prefill
    hang_up_when(loop, cluster.url + "/v1/chat/completions", dict(CHAT, stream=True), lambda: p.requests)
    tid = p.requests[0][1]["kv_transfer_params"]["transfer_id"]
    wait_until(lambda: p.cancelled == [tid], what="P to see its request cancelled")
    wait_until(lambda: p.aborts == [tid], what="abort on P")
    assert d.requests == []


def test_client_disconnect_after_the_pull_cancels_d_without_abort(cluster, loop):
    p, d = cluster.prefill[0], cluster.decode[0]
    d.hold_after_first_event.clear()  # D streams one event, then waits
    loop.run(read_one_event_and_hang_up(cluster.url + "/v1/completions", dict(COMPLETION, stream=True)))
    tid = p.requests[0][1]["kv_transfer_params"]["transfer_id"]
    wait_until(lambda: d.cancelled == [tid], what="D to see its request cancelled")
    wait_until(lambda: 'status="client_disconnect"' in cluster.get("/metrics").body.decode(),
               what="the router to finish the request")
    # An abort is counted when it is sent, before the request is counted as finished.
    assert "atomd_router:kv_transfer_aborts_total 0.0" in cluster.get("/metrics").body.decode()
    assert d.pulled == [tid] and p.aborts == []


def test_prefill_leg_moves_to_another_worker_when_one_is_unreachable(loop):
    c = Cluster(loop, n_prefill=2, health_interval_s=60).start()
    try:
        dead = c.prefill[1]
        loop.run(dead.stop())  # healthy at the last check, refusing connections now
        for _ in range(2):  # round robin sends one of the two to the dead worker first
            r = c.post("/v1/completions", COMPLETION)
            assert r.status == 200, r.body
        assert len(c.prefill[0].requests) == 2 and len(c.decode[0].requests) == 2
        metrics = c.get("/metrics").body.decode()
        assert 'atomd_router:retries_total{leg="prefill"} 1.0' in metrics
    finally:
        c.stop()


def test_a_dropped_prefill_connection_is_retried_with_a_fresh_transfer_id(cluster):
    p = cluster.prefill[0]
    p.drop_next = 1  # e.g. a keep-alive connection P closed just as the router used it
    r = cluster.post("/v1/completions", COMPLETION)
    assert r.status == 200
    first, second = (b["kv_transfer_params"]["transfer_id"] for _, b in p.requests)
    assert first != second
    assert cluster.decode[0].requests[0][1]["kv_transfer_params"]["transfer_id"] == second
    wait_until(lambda: p.aborts == [first], what="abort of the dropped try")
    assert 'atomd_router:retries_total{leg="prefill"} 1.0' in cluster.get("/metrics").body.decode()


def test_all_prefill_workers_unreachable_is_a_502(loop):
    c = Cluster(loop, health_interval_s=60).start()
    try:
        loop.run(c.prefill[0].stop())
        r = c.post("/v1/completions", COMPLETION)
        assert r.status == 502 and "unreachable" in r.json()["error"]["message"]
        assert c.decode[0].requests == []
    finally:
        c.stop()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_silent_worker_is_a_504_and_the_transfer_is_aborted(loop, role):
    c = Cluster(loop, health_interval_s=60, request_timeout_s=0.3).start()
    try:
        p, d = c.prefill[0], c.decode[0]
        (p if role == "prefill" else d).gate.clear()  # holds the request past the timeout
        r = c.post("/v1/completions", dict(COMPLETION, stream=True))
        assert r.status == 504 and r.json()["error"]["type"] == "timeout"
        tid = p.requests[0][1]["kv_transfer_params"]["transfer_id"]
        wait_until(lambda: p.aborts == [tid], what="abort on P")
        assert d.requests == [] if role == "prefill" else d.pulled == []
    finally:
        c.stop()


def test_official_openai_client_stream_and_non_stream(cluster):
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    d = cluster.decode[0]
    full = "".join(d.tokens)
    out = client.completions.create(model="fake-model", prompt="the quick brown fox", max_tokens=8)
    assert out.choices[0].text == full and out.usage.completion_tokens == len(d.tokens)
    chat = client.chat.completions.create(model="fake-model", messages=CHAT["messages"], max_tokens=8)
    assert chat.choices[0].message.content == full
    stream = client.chat.completions.create(model="fake-model", messages=CHAT["messages"], max_tokens=8,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cluster.prefill[0].prefix_cache_hit_tokens
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="fake-model", prompt="hello", max_tokens=8, stream=True))
    assert text == full
    client.close()


def test_openai_client_sees_a_prefill_failure_as_an_api_error(cluster):
    cluster.prefill[0].fail_status = 500
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="fake-model", prompt="x", max_tokens=4)
    assert e.value.status_code == 502 and "engine exploded" in str(e.value)
    client.close()


def test_no_decode_worker_is_a_503(loop):
    c = Cluster(loop, n_decode=0, health_interval_s=60).start()
    try:
        r = c.post("/v1/completions", COMPLETION)
        assert r.status == 503 and r.json()["error"]["code"] == "no_decode_worker"
        # P pinned blocks for a transfer nobody will pull: they are aborted.
        wait_until(lambda: len(c.prefill[0].aborts) == 1, what="abort on P")
    finally:
        c.stop()


def test_bad_request_bodies_are_400(cluster):
    for raw in (b"{not json", b"[1, 2]"):
        r = cluster.loop.run(raw_post(cluster.url + "/v1/completions", raw))
        assert r[0] == 400 and "error" in msgspec.json.decode(r[1])
    r = cluster.post("/v1/completions", dict(COMPLETION, stream="yes"))
    assert r.status == 400 and "stream" in r.json()["error"]["message"]
    assert cluster.prefill[0].requests == []


def test_an_oversized_body_is_a_413(loop):
    c = Cluster(loop, health_interval_s=60, max_request_body_bytes=1000).start()
    try:
        r = c.post("/v1/completions", dict(COMPLETION, prompt="x " * 1000))
        assert r.status == 413 and "1000 bytes" in r.json()["error"]["message"]
        assert c.prefill[0].requests == []
    finally:
        c.stop()


async def raw_post(url: str, data: bytes) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.read()



def test_a_response_continued_before_its_stream_ends_goes_to_the_engine_that_stored_it(cluster, loop):
    """The client may send `previous_response_id` as soon as it has read `response.completed`,
    before D's stream (and so the router's relay) has ended: the router knows where the response
    is stored from D's first byte on, so the continuation is one leg on that D, not a P leg that
    lacks the response (a 404 in a real pair)."""
    p, d = cluster.prefill[0], cluster.decode[0]
    d.hold_after_first_event.clear()  # D streams one event, then waits
    first = asyncio.run_coroutine_threadsafe(
        fake_http("POST", cluster.url + "/v1/responses", {"input": "hi there", "stream": True}), loop.loop)
    wait_until(lambda: d.streams and d.streams[0], what="D's first event")
    stored = d.requests[0][1]["request_id"]
    assert stored.startswith("resp_") and len(p.requests) == 1
    follow = cluster.post("/v1/responses", {"input": "and again", "previous_response_id": stored})
    assert follow.status == 200, follow.body
    assert len(p.requests) == 1 and [b.get("previous_response_id") for _, b in d.requests] == [None, stored]
    loop.loop.call_soon_threadsafe(d.hold_after_first_event.set)
    assert first.result(20).status == 200
