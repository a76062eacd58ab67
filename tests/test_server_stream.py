"""SSE streaming of `atomd serve`: byte-level framing, disconnects, 64 concurrent streams."""
from __future__ import annotations

import asyncio
import http.client as httpclient
import json
import re

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launch.process import http
from tests.server_fixtures import model_dir, start_server

pytestmark = pytest.mark.integration

EVENT = re.compile(rb"data: (\{[^\n]*\})\n\n")


@pytest.fixture(scope="module")
def server():
    srv = start_server(model_dir())
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def baseline(server):
    return server.stats()["num_free_blocks"]


def raw_stream(server, route: str, body: dict) -> tuple[httpclient.HTTPResponse, bytes]:
    """The de-chunked response body exactly as the server framed it."""
    conn = httpclient.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", route, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp, data


def split_events(data: bytes) -> list[dict]:
    """Every byte belongs to a `data: {...}\\n\\n` event, and `data: [DONE]\\n\\n` ends it."""
    assert data.endswith(b"data: [DONE]\n\n")
    body, pos, events = data[: -len(b"data: [DONE]\n\n")], 0, []
    while pos < len(body):
        m = EVENT.match(body, pos)
        assert m, f"bad SSE framing at byte {pos}: {body[pos:pos + 80]!r}"
        events.append(json.loads(m.group(1)))
        pos = m.end()
    return events


def completion_text(server, prompt, max_tokens: int) -> str:
    status, body = http("POST", server.url + "/v1/completions",
                        {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, body
    return json.loads(body)["choices"][0]["text"]


def test_completion_sse_framing_and_text(server, baseline):
    body = {"prompt": "def parse(", "max_tokens": 12, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    resp, data = raw_stream(server, "/v1/completions", body)
    assert resp.status == 200
    assert resp.getheader("Content-Type").startswith("text/event-stream")
    events = split_events(data)
    *text_events, usage_event = events
    assert all(e["object"] == "text_completion" and e["usage"] is None for e in text_events)
    assert [e["choices"][0]["finish_reason"] for e in text_events[:-1]] == [None] * (len(text_events) - 1)
    assert text_events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert usage_event["choices"] == [] and usage_event["usage"]["completion_tokens"] <= 12
    text = "".join(e["choices"][0]["text"] for e in text_events)
    assert text == completion_text(server, "def parse(", 12)
    server.wait_idle(baseline)


def test_chat_sse_framing(server, baseline):
    body = {"messages": [{"role": "user", "content": "Return the sum of a list."}], "max_tokens": 8,
            "temperature": 0, "stream": True, "kv_transfer_params": {"transfer_id": "abc"}}
    resp, data = raw_stream(server, "/v1/chat/completions", body)
    assert resp.status == 200
    events = split_events(data)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" and "usage" not in e for e in events)
    assert all("role" not in e["choices"][0]["delta"] for e in events[1:])
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    # the extension field rides on the final chunk only
    assert [("kv_transfer_params" in e) for e in events] == [False] * (len(events) - 1) + [True]
    server.wait_idle(baseline)


async def one_stream(session, url: str, i: int, disconnect: bool) -> dict:
    body = {"prompt": f"def function_{i}(x):", "max_tokens": 200 if disconnect else 8, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200  # the server answers once the first token exists
        if disconnect:
            resp.close()  # the client goes away mid-stream
            return {"disconnected": True}
        events, done = [], False
        async for line in resp.content:
            if line == b"data: [DONE]\n":
                done = True
            elif line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
        return {"disconnected": False, "done": done, "usage": events[-1]["usage"],
                "finish": events[-2]["choices"][0]["finish_reason"]}


def success_counts(server) -> dict[str, float]:
    text = http("GET", server.url + "/metrics")[1].decode()
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "atomd:request_success":
            for s in family.samples:
                if s.name.endswith("_total"):
                    counts[s.labels["finished_reason"]] = s.value
    return counts


def test_64_concurrent_streams_with_disconnects(server, baseline):
    before = success_counts(server)

    async def main():
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(120)) as s:
            return await asyncio.gather(*(one_stream(s, server.url, i, i % 4 == 0) for i in range(64)))

    results = asyncio.run(main())
    survivors = [r for r in results if not r["disconnected"]]
    assert len(survivors) == 48
    for r in survivors:
        assert r["done"] and r["finish"] == "length" and r["usage"]["completion_tokens"] == 8
    server.wait_idle(baseline)
    after = success_counts(server)
    assert after.get("length", 0) - before.get("length", 0) == 48
    # the engine confirmed an abort for every client that went away
    assert after.get("abort", 0) - before.get("abort", 0) == 16


def test_disconnect_while_waiting_non_stream_aborts(server, baseline):
    """A non-streaming client that gives up is aborted too (aiohttp handler cancellation)."""
    before = success_counts(server).get("abort", 0)

    async def main():
        async with aiohttp.ClientSession() as s:
            body = {"prompt": "class Parser:", "max_tokens": 200, "ignore_eos": True}
            request = asyncio.create_task(s.post(server.url + "/v1/completions", json=body))
            while server.stats()["num_running"] == 0:  # until the engine runs it
                assert not request.done()
                await asyncio.sleep(0.01)
            request.cancel()  # the client hangs up while the server is still generating

    asyncio.run(main())
    server.wait_idle(baseline)
    assert success_counts(server).get("abort", 0) - before == 1


@pytest.mark.parametrize("include", [False, True])
def test_streamed_stop_string_is_held_back_and_cut(server, baseline, include):
    """Text that might begin a stop string is held back: the streamed text ends exactly
    where the non-streamed full text puts the stop string."""
    full = completion_text(server, "import os\nimport sys\n", 24)
    assert len(full) >= 8, full
    stop = full[4:8]
    cut = full.index(stop) + (len(stop) if include else 0)
    body = {"prompt": "import os\nimport sys\n", "max_tokens": 24, "temperature": 0, "stream": True,
            "stop": [stop, "\x00never"], "include_stop_str_in_output": include}
    _, data = raw_stream(server, "/v1/completions", body)
    events = split_events(data)
    assert "".join(e["choices"][0]["text"] for e in events) == full[:cut]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    server.wait_idle(baseline)
