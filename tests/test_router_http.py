"""The router's own HTTP layer (router/http.py) at the byte level: keep-alive and pipelining,
Expect: 100-continue, the body limit answered before the body, HTTP/1.0 streams, malformed
requests, routing errors, a client that hangs up; and the upstream client's typed failures."""
from __future__ import annotations

import asyncio
import socket

import pytest

from router.http import ConnectError, Disconnected, HTTPServer, Pool, Timeout

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


async def serve(handler, max_body: int = 1000) -> tuple[HTTPServer, int]:
    server = HTTPServer(handler, max_body)
    _, port = await server.start("127.0.0.1", 0)
    return server, port


async def exchange(port: int, data: bytes, until: bytes = b"", timeout_s: float = 5.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    got = b""
    try:
        while not (until and until in got):
            chunk = await asyncio.wait_for(reader.read(65536), timeout_s)
            if not chunk:
                break
            got += chunk
    finally:
        writer.close()
    return got


async def echo(req, resp):
    if req.body is None:
        return resp.send(413, b'{"error": "too large"}')
    if req.path == "/stream":
        resp.start_stream(200, b"Content-Type: text/event-stream\r\n", b"data: 1\n\n")
        resp.write(b"data: 2\n\n")
        resp.end(b"data: [DONE]\n\n")
        return
    resp.send(200, req.method.encode() + b" " + req.path.encode() + b" " + req.body)


def test_keep_alive_and_pipelined_requests_are_answered_in_order():
    async def go():
        server, port = await serve(echo)
        try:
            data = (b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\none"
                    b"POST /b HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\ntwo\r\n0\r\n\r\n"
                    b"GET /c HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return await exchange(port, data)
        finally:
            await server.close()
    out = asyncio.run(go())
    assert out.count(b"HTTP/1.1 200 OK") == 3
    assert out.index(b"POST /a one") < out.index(b"POST /b two") < out.index(b"GET /c ")
    assert b"Connection: close" in out.split(b"GET /c")[0].rsplit(b"HTTP/1.1", 1)[1]


def test_expect_continue_and_a_body_over_the_limit_is_refused_before_it_is_sent():
    async def go():
        server, port = await serve(echo, max_body=10)
        try:
            ok = await exchange(port, b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\nhi",
                                until=b"POST /a hi")
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\nExpect: 100-continue\r\n\r\n")
            first = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)  # no 100 Continue: straight to 413
            writer.write(b"x" * 100000)
            rest = await asyncio.wait_for(reader.read(65536), 5)
            writer.close()
            return ok, first + rest
        finally:
            await server.close()
    ok, big = asyncio.run(go())
    assert ok.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK") and ok.endswith(b"POST /a hi")
    assert big.startswith(b"HTTP/1.1 413")


def test_streams_are_chunked_for_http11_and_close_delimited_for_http10():
    async def go():
        server, port = await serve(echo)
        try:
            v11 = await exchange(port, b"GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            v10 = await exchange(port, b"GET /stream HTTP/1.0\r\n\r\n")
            return v11, v10
        finally:
            await server.close()
    v11, v10 = asyncio.run(go())
    assert b"Transfer-Encoding: chunked" in v11 and v11.endswith(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
    assert b"Transfer-Encoding" not in v10 and b"Connection: close" in v10
    assert v10.endswith(b"\r\n\r\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n")


def test_malformed_requests_are_400_and_close():
    async def go():
        server, port = await serve(echo)
        try:
            return await exchange(port, b"NOT HTTP AT ALL\r\n\r\n")
        finally:
            await server.close()
    out = asyncio.run(go())
    assert out.startswith(b"HTTP/1.1 400") and b"Connection: close" in out


def test_a_client_that_hangs_up_cancels_its_handler():
    async def go():
        seen = asyncio.Event()
        gone = asyncio.Event()

        async def slow(req, resp):
            seen.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                gone.set()
                raise

        server, port = await serve(slow)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.wait_for(seen.wait(), 5)
            writer.close()
            await asyncio.wait_for(gone.wait(), 5)
        finally:
            await server.close()
    asyncio.run(go())


def test_router_answers_404_and_405_as_json():
    from tests.fake_workers import Cluster, LoopThread

    loop = LoopThread()
    c = Cluster(loop, health_interval_s=60)
    try:
        c.start()
        r = c.get("/nope")
        assert r.status == 404 and r.json()["error"]["code"] == "not_found"
        r = c.request("PUT", "/v1/completions")
        assert r.status == 405 and "POST" in r.json()["error"]["message"]
    finally:
        c.stop()
        loop.close()


def test_upstream_failures_are_typed():
    async def go():
        closed_port = _closed_port()
        pool = Pool(f"http://127.0.0.1:{closed_port}")
        with pytest.raises(ConnectError):
            await pool.request(b"GET", b"/")

        async def hang(reader, writer):
            await reader.read(100)
            await asyncio.sleep(30)

        async def drop(reader, writer):
            await reader.read(100)
            writer.close()

        out = []
        for handler, exc in ((hang, Timeout), (drop, Disconnected)):
            srv = await asyncio.start_server(handler, "127.0.0.1", 0)
            port = srv.sockets[0].getsockname()[1]
            pool = Pool(f"http://127.0.0.1:{port}")
            try:
                await pool.request(b"GET", b"/", timeout_s=0.2)
            except exc as e:
                out.append(type(e))
            finally:
                pool.abort_all()
                srv.close()
        return out
    assert asyncio.run(go()) == [Timeout, Disconnected]


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port
