"""Limits of every HTTP server, at the byte level (issue #18): the router's own HTTP layer
(router/http.py) and the engine's aiohttp server (atomd/api/server.py, run here in-process
without a model: the head is refused before any route runs).

A URL, a header, the number of headers and the whole head are bounded; over a bound the
answer is an OpenAI-style JSON error (414 / 431 / 400) and the connection closes, and the
server still serves. The router's upstream side is bounded too: an SSE event (line) from a
worker that does not end is cut at --max-upstream-event-bytes with a clean error event and
[DONE] (the router stops reading it: the worker sees its connection closed), a collected
answer over the pool's limit and an oversized response head are failures, not memory.
No error body carries a trace or an internal path."""
from __future__ import annotations

import argparse
import asyncio
import json

import pytest
from aiohttp import web

from router import http as H
from router.app import Router, RouterConfig
from router.http import BrokenResponse, HTTPServer, Pool

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

LEAKS = (b"Traceback", b"/work", b'.py"', b"site-packages", b'File "')


async def exchange(port: int, data: bytes, timeout_s: float = 10.0, until: bytes = b"") -> bytes:
    """Send `data`, read until the server closes (or `until` arrived)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
    except ConnectionError:
        pass
    got = b""
    try:
        while not (until and until in got):
            chunk = await asyncio.wait_for(reader.read(1 << 16), timeout_s)
            if not chunk:
                break
            got += chunk
    except ConnectionError:
        pass
    finally:
        writer.close()
    return got


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def error_of(answer: bytes) -> dict:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), answer[:300]
    for leak in LEAKS:
        assert leak not in body, body
    return json.loads(body)["error"]


def heads(n_headers: int = 1, header_len: int = 10, url_len: int = 1) -> bytes:
    return (b"GET /" + b"a" * (url_len - 1) + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            + b"".join(b"X-%d: %b\r\n" % (i, b"v" * header_len) for i in range(n_headers)) + b"\r\n")


OVER_LIMITS = [  # (request, status, what the message names)
    (heads(url_len=H.MAX_URL_BYTES + 1), 414, "URL"),
    (heads(header_len=H.MAX_HEADER_BYTES + 1), 431, "header"),
    (heads(n_headers=H.MAX_HEADERS + 1), 431, "headers"),
    (heads(n_headers=40, header_len=2000), 431, "head"),  # each header fine, the head too large
]


# ------------------------------------------------------------------------------- router: requests


async def ok(req, resp):
    if req.body is None:
        return resp.send(413, H.error_json("too large"))
    resp.send(200, b'{"ok": true}')


@pytest.mark.parametrize("data,status,names", OVER_LIMITS, ids=["url", "header", "count", "head"])
def test_router_refuses_a_head_over_a_limit_with_a_json_error(data, status, names):
    async def go():
        server = HTTPServer(ok, 1000)
        _, port = await server.start("127.0.0.1", 0)
        try:
            answer = await exchange(port, data)
            fine = await exchange(port, heads(n_headers=H.MAX_HEADERS - 2, header_len=100))
            return answer, fine
        finally:
            await server.close()
    answer, fine = asyncio.run(go())
    assert status_of(answer) == status, answer[:200]
    assert b"Connection: close" in answer
    error = error_of(answer)
    assert names in error["message"] and error["code"] == "request_too_large"
    assert status_of(fine) == 200  # under every limit: served


def test_router_bounds_a_header_that_never_ends():
    """A header trickled forever (no CRLF): the parser would buffer it all; the head limit
    answers 431 and closes once MAX_HEAD_BYTES have come, whatever the chunking."""
    async def go():
        server = HTTPServer(ok, 1000)
        _, port = await server.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nX-Long: ")
            sent = 0
            try:
                while sent < 4 * H.MAX_HEAD_BYTES:
                    writer.write(b"v" * 4096)
                    await writer.drain()
                    sent += 4096
                    await asyncio.sleep(0)
            except ConnectionError:
                pass
            answer = await asyncio.wait_for(reader.read(1 << 16), 10)
            rest = await asyncio.wait_for(reader.read(1 << 16), 10)
            writer.close()
            return answer, rest
        finally:
            await server.close()
    answer, rest = asyncio.run(go())
    assert status_of(answer) == 431 and "head" in error_of(answer)["message"]
    assert rest == b""  # closed


def test_router_body_limit_and_malformed_requests_answer_json_without_internals():
    async def go():
        server = HTTPServer(ok, 1000)
        _, port = await server.start("127.0.0.1", 0)
        try:
            return [await exchange(port, data) for data in (
                b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n",
                b"\x16\x03\x01\x02\x00garbage\r\n\r\n",
                b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
                b"GET / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                b"GET / HTTP/1.1\r\nBad Header\r\n\r\n",
                b"GET / HTTP/1.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
            )]
        finally:
            await server.close()
    answers = asyncio.run(go())
    assert status_of(answers[0]) == 413
    for answer in answers:
        assert 400 <= status_of(answer) < 500, answer[:200]
        assert isinstance(error_of(answer)["message"], str)


# ------------------------------------------------------------------------------- router: upstream


class FakeWorker:
    """A colocated engine on router/http.py's server: healthy; /v1/completions streams one
    event, then (prompt "endless") one event that never ends, until the router hangs up."""

    def __init__(self):
        self.cut_off = asyncio.Event()
        self.server: HTTPServer | None = None
        self.url = ""

    async def start(self):
        self.server = HTTPServer(self.handle)
        _, port = await self.server.start("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def handle(self, req, resp):
        if req.method == "GET":
            return resp.send(200, b'{"status": "ok"}')
        first = b'data: {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "a"}]}\n\n'
        resp.start_stream(200, b"Content-Type: text/event-stream\r\n", first)
        resp.write(b'data: {"choices": [{"text": "')
        try:
            while not resp.conn.closed:
                resp.write(b"x" * 8192)
                await resp.drain()
                await asyncio.sleep(0)
        finally:
            self.cut_off.set()

    async def stop(self):
        await self.server.close()


def test_router_ends_a_stream_whose_event_never_ends_with_an_error_event():
    limit = 100_000

    async def go():
        worker = await FakeWorker().start()
        router = Router(RouterConfig(port=0, worker=[worker.url], max_upstream_event_bytes=limit,
                                     health_interval_s=60))
        try:
            url = await router.start()
            port = int(url.rsplit(":", 1)[1])
            body = b'{"model": "m", "prompt": "endless", "stream": true, "max_tokens": 5}'
            answer = await exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b"
                                    % (len(body), body), until=b"data: [DONE]\n\n")
            await asyncio.wait_for(worker.cut_off.wait(), 10)  # the router hung up on the worker
            health = await exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return answer, health
        finally:
            await router.stop()
            await worker.stop()
    answer, health = asyncio.run(go())
    assert status_of(answer) == 200 and b'"text": "a"' in answer
    events = [line for line in answer.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert f"longer than {limit} bytes" in error["message"]
    assert len(answer) < 2 * limit  # the partial event was never relayed
    for leak in LEAKS:
        assert leak not in answer
    assert status_of(health) == 200


async def raw_upstream(payload: bytes) -> tuple[asyncio.AbstractServer, str]:
    """A worker that answers every request with `payload` (its status line and head included)."""
    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        try:
            writer.write(payload)
            await writer.drain()
        except ConnectionError:
            pass
        writer.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.mark.parametrize("payload,names", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 300000\r\n\r\n" + b"x" * 300_000, "more than 100000 bytes"),
    (b"HTTP/1.1 200 OK\r\nX-Big: " + b"v" * (H.MAX_HEADER_BYTES + 1) + b"\r\nContent-Length: 0\r\n\r\n", "header"),
    (b"HTTP/1.1 200 OK\r\nX-Endless: " + b"v" * (2 * H.MAX_HEAD_BYTES), "head"),
], ids=["body", "header", "head"])
def test_upstream_answers_over_a_limit_are_failures_not_memory(payload, names):
    async def go():
        server, url = await raw_upstream(payload)
        pool = Pool(url, max_body_bytes=100_000)
        try:
            with pytest.raises(BrokenResponse) as e:
                await pool.fetch(b"GET", b"/x", timeout_s=10)
            return str(e.value)
        finally:
            pool.abort_all()
            server.close()
            await server.wait_closed()
    assert names in asyncio.run(go())


# ------------------------------------------------------------------------------- the engine's server


@pytest.fixture
def engine_port(loop):
    """`atomd serve`'s HTTP server (routes, middlewares, limits) without starting the engine."""
    from atomd.config import EngineConfig
    from atomd.api.http import HEAD_LIMITS, JSONErrorRunner
    from atomd.api.serve import add_arguments
    from atomd.api.server import Server

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--port", "0"])
    server = Server(EngineConfig.from_args(args), args)

    async def start():
        runner = JSONErrorRunner(server.app, handler_cancellation=True, access_log=None, **HEAD_LIMITS)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]

    runner, port = loop.run(start())
    yield port
    loop.run(runner.cleanup())


@pytest.mark.parametrize("data,status,names", [
    (heads(url_len=8191), 400, "longer than 8190 bytes"),  # aiohttp: one check for line and field
    (heads(header_len=8191), 400, "longer than 8190 bytes"),
    (heads(n_headers=129), 431, "more than 128 request headers"),
    (b"\x16\x03\x01\x02\x00garbage\r\n\r\n", 400, "malformed HTTP request"),
    (b"GET / HTTP/1.1\r\nBad Header\r\n\r\n", 400, "malformed HTTP request"),
], ids=["url", "header", "count", "tls", "bad-header"])
def test_engine_refuses_requests_over_its_limits_with_a_json_error(loop, engine_port, data, status, names):
    answer = loop.run(exchange(engine_port, data))
    assert status_of(answer) == status, answer[:300]
    assert names in error_of(answer)["message"]
    health = loop.run(exchange(engine_port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
    assert status_of(health) == 200  # still serving


def test_router_and_engine_bound_a_head_alike():
    from atomd.api import http as engine_http

    assert (H.MAX_URL_BYTES, H.MAX_HEADER_BYTES, H.MAX_HEADERS) == \
        (engine_http.MAX_LINE_BYTES, engine_http.MAX_FIELD_BYTES, engine_http.MAX_HEADERS)
    assert engine_http.HEAD_LIMITS == {"max_line_size": engine_http.MAX_LINE_BYTES,
                                       "max_field_size": engine_http.MAX_FIELD_BYTES,
                                       "max_headers": engine_http.MAX_HEADERS}
