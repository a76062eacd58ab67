"""A lean HTTP/1.1 server and client for the router, on asyncio protocols and httptools.

Why not aiohttp here: the router's work per request is a few small HTTP exchanges, so
per-request framework overhead (request/response objects, middlewares, header multidicts,
timeouts as tasks, one coroutine switch per relayed chunk) is most of its CPU. This module
does only what the router needs, with the parsing in C (httptools, llhttp):

Server (`HTTPServer`, `ServerConnection`, `Request`, `Response`):
- keep-alive and pipelined requests (answered in order), `Expect: 100-continue`,
  chunked or Content-Length request bodies, a body limit answered with 413 before the body
  is read, limits on the request head (414 for a URL over MAX_URL_BYTES, 431 for more than
  MAX_HEADERS headers, one over MAX_HEADER_BYTES or a head over MAX_HEAD_BYTES; each an
  OpenAI-style JSON error, then the connection closes), HTTP/1.0 clients (close-delimited
  streams), deadlines for what a client owes (the next request, its head, its body: a
  trickle does not extend them), bounded memory per connection and for partial bodies
  together (ServerConnection), TCP_NODELAY on every accepted socket;
- a client that hangs up cancels its request's handler at once (as aiohttp's
  handler_cancellation), so the relay can abort upstream work;
- a response is written in one `transport.write` (status line, headers and body);
  a stream uses chunked transfer encoding and `Response.write` never awaits: flow control
  is `Response.paused` / `await Response.drain()`.

Client (`Pool`, `ClientConnection`): one keep-alive pool per upstream worker; a request is
written in one `transport.write` from pre-encoded header bytes; the response body is
either collected (`read()`) or pushed chunk by chunk into a callback (`stream()`), so a
relay writes each upstream chunk to its client from inside `data_received`, without a
coroutine switch per chunk. Failures are typed so the caller knows whether the request
could have reached the worker: `ConnectError` (no connection: the request never left),
`Disconnected` (the connection dropped before any response byte; `reused` tells a stale
keep-alive connection from a fresh one), `Timeout`, `BrokenResponse` (after the head).
An upstream's head is bounded as a client's is, and a collected (`read()`) body by
`Pool.max_body_bytes`: a worker cannot make the router buffer without bound either.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections import deque
from http import HTTPStatus
from typing import Awaitable, Callable
from urllib.parse import parse_qsl, urlsplit

import httptools
import msgspec

logger = logging.getLogger("atomd.router.http")

IDLE_TIMEOUT_S = 75.0  # a kept-alive client connection with no request this long is closed
HEADER_TIMEOUT_S = 20.0  # a request head must arrive whole within this, from its first byte
BODY_TIMEOUT_S = 60.0  # a request body must arrive whole within this, from the end of its head
MAX_PENDING_BODY_BYTES = 128 << 20  # request bodies still arriving, all connections together
MAX_PIPELINED = 64  # requests received and not yet answered on one connection
MAX_BODY_CHUNKS = 1 << 16  # chunks of one chunked request body
_IDLE, _HEAD, _BODY = 0, 1, 2  # what a connection waits for from its client
POOL_IDLE_S = 60.0  # an idle upstream connection older than this is not reused
WRITE_HIGH_WATER = 256 << 10
_STATUS = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# Limits on a request head, as the engines' aiohttp server has them (atomd/api/http.py): a
# URL, one header (name and value) and the number of headers; plus the whole head, which
# also bounds what the parser buffers of a header still arriving.
MAX_URL_BYTES = 8190
MAX_HEADER_BYTES = 8190
MAX_HEADERS = 128
MAX_HEAD_BYTES = 64 << 10
MAX_UPSTREAM_BODY_BYTES = 64 << 20  # a collected (not streamed) answer of a worker
LINGER_S = 1.0  # after refusing a request: read and drop what the client still sends, then close


class HeadTooLarge(Exception):
    """A request refused by a parser callback (a head or body over a limit, an upgrade), or
    an upstream response head over a limit: (status, message, OpenAI error code)."""

    def __init__(self, status: int, message: str, code: str | None = "request_too_large"):
        super().__init__(message)
        self.status = status
        self.code = code if status != 400 else None


class PipelineFull(Exception):
    """MAX_PIPELINED requests wait unanswered on one connection: the parser stops there."""


def error_json(message: str, type: str = "invalid_request_error", code: str | None = None) -> bytes:
    return msgspec.json.encode({"error": {"message": message, "type": type, "param": None, "code": code}})


def status_line(status: int) -> bytes:
    return _STATUS.get(status) or f"HTTP/1.1 {status} Unknown\r\n".encode()


def set_nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass


# =============================================================================== server

class Request:
    __slots__ = ("method", "path", "query_string", "headers", "body", "keep_alive", "version", "conn",
                 "peer", "_query")

    def __init__(self, method: str, path: str, query_string: str, headers: dict[str, str], body: bytes,
                 keep_alive: bool, version: str, conn: "ServerConnection"):
        self.method, self.path, self.query_string = method, path, query_string
        self.headers, self.body, self.keep_alive, self.version, self.conn = headers, body, keep_alive, version, conn
        self.peer = conn.peer
        self._query: dict[str, str] | None = None

    @property
    def query(self) -> dict[str, str]:
        if self._query is None:
            self._query = dict(parse_qsl(self.query_string, keep_blank_values=True))
        return self._query

    @property
    def can_read_body(self) -> bool:
        return bool(self.body)


class Response:
    """The answer to one request. `send` writes a whole response; `start_stream` + `write`
    + `end` a streamed one (chunked; close-delimited for HTTP/1.0)."""

    __slots__ = ("conn", "request", "status", "started", "finished", "_chunked")

    def __init__(self, conn: "ServerConnection", request: Request):
        self.conn, self.request = conn, request
        self.status = 0
        self.started = self.finished = False
        self._chunked = False

    @property
    def prepared(self) -> bool:
        return self.started

    @property
    def paused(self) -> bool:
        return self.conn.paused

    async def drain(self) -> None:
        await self.conn.drain()

    def _connection_header(self) -> bytes:
        return b"" if self.request.keep_alive else b"Connection: close\r\n"

    def send(self, status: int, body: bytes = b"", content_type: bytes = b"application/json",
             headers: bytes = b"") -> None:
        """The whole response in one write. `headers`: extra `Name: value\\r\\n` lines."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = self.finished = True
        self.status = status
        self.conn.write(b"".join((status_line(status), b"Content-Type: ", content_type, b"\r\nContent-Length: ",
                                  str(len(body)).encode(), b"\r\n", headers, self._connection_header(), b"\r\n",
                                  body)))

    def start_stream(self, status: int = 200, headers: bytes = b"", first: bytes = b"") -> None:
        """Status and headers (`headers`: the `Name: value\\r\\n` lines, Content-Type included),
        with `first` as the first body data in the same write."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        self.status = status
        if self.request.version == "1.0":
            self.request.keep_alive = False
            self.conn.write(b"".join((status_line(status), headers, b"Connection: close\r\n\r\n", first)))
            return
        self._chunked = True
        head = b"".join((status_line(status), headers, b"Transfer-Encoding: chunked\r\n",
                         self._connection_header(), b"\r\n"))
        self.conn.write(head + (b"%x\r\n%b\r\n" % (len(first), first) if first else b""))

    def write(self, data: bytes) -> None:
        """More of a started stream. Never blocks: check `paused` / `await drain()` for flow control."""
        if data:
            self.conn.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)

    def end(self, data: bytes = b"") -> None:
        """The last data of a stream and its end, in one write."""
        if self.finished:
            return
        self.finished = True
        if self._chunked:
            self.conn.write((b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data)) if data else b"0\r\n\r\n")
        else:
            if data:
                self.conn.write(data)
            self.request.keep_alive = False  # close-delimited: the close ends the body


Handler = Callable[[Request, Response], Awaitable[None]]


class ServerConnection(asyncio.Protocol):
    """One client connection. While nothing of it is being answered the connection waits on
    the client, under one deadline for what it waits for, however the bytes trickle in: a
    request's first byte (`idle_timeout_s` after the last answer), the rest of its head
    (`header_timeout_s` from its first byte), its body (`body_timeout_s` from the end of
    the head), our answers being read (`idle_timeout_s`, while the client reads none). A
    missed head or body deadline is a 408, then the connection closes.

    Memory: a body grows in one bytearray (chunked or not, whatever the chunk size);
    partial bodies of all connections together stay under the server's
    `max_pending_body_bytes` (503 past it); pipelined requests wait in a queue of at most
    MAX_PIPELINED, the next one is started only while the client reads our answers, and
    reading stops while it does not."""

    __slots__ = ("server", "loop", "transport", "parser", "peer", "paused", "closed", "_drain", "_url", "_headers",
                 "_body", "_body_size", "_too_large", "_queue", "_task", "_timer", "_head_bytes", "_in_body",
                 "_fields_bytes", "_phase", "_phase_at", "_pending", "_chunks", "_reading_paused", "_last_request",
                 "_stalled_at")

    def __init__(self, server: "HTTPServer"):
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.peer = None
        self.paused = False
        self.closed = False
        self._drain: asyncio.Future | None = None
        self._queue: deque[Request] = deque()
        self._task: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # bytes received since the current head began (an upper bound)
        self._in_body = False
        self._phase = _IDLE  # what the client owes us: a request, the rest of a head, a body
        self._phase_at = 0.0  # ... since when
        self._stalled_at: float | None = None  # since when queued requests wait for the client to read
        self._pending = 0  # bytes of a partial body counted in the server's pending_body_bytes
        self._reading_paused = False
        self._last_request = False  # the queue is full: answer it, then close
        self._reset()

    def _reset(self) -> None:
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body = bytearray()
        self._body_size = 0
        self._chunks = 0
        self._too_large = False
        self._head_bytes = 0
        self._fields_bytes = 0  # the URL and the headers so far (exact, where _head_bytes is a bound)

    # ---------------------------------------------------------------- transport events

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        set_nodelay(transport)
        transport.set_write_buffer_limits(WRITE_HIGH_WATER)  # type: ignore[attr-defined]
        self.peer = transport.get_extra_info("peername")
        self.server.connections.add(self)
        self._enter(_IDLE)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self._release_pending()
        self._body = bytearray()
        self._queue.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client is gone: its handler stops now
        self._wake_drain()

    def pause_writing(self) -> None:
        self.paused = True
        self._pause_reading()  # a client that does not read our answers sends no more requests

    def resume_writing(self) -> None:
        self.paused = False
        if self._reading_paused and not self.closed and not self._last_request:
            self._reading_paused = False
            self.transport.resume_reading()
        self._wake_drain()
        if self._task is None and self._queue:  # a pipelined request waited for the client to read
            self._next()

    def _pause_reading(self) -> None:
        if not self._reading_paused and not self.closed:
            self._reading_paused = True
            self.transport.pause_reading()

    def _wake_drain(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    async def drain(self) -> None:
        if self.paused and not self.closed:
            if self._drain is None:
                self._drain = self.loop.create_future()
            await self._drain

    def data_received(self, data: bytes) -> None:
        if self.closed or self._last_request:  # refused, lingering or full: what still comes is dropped
            return
        if not self._in_body:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, "protocol upgrades are not supported")
        except httptools.HttpParserCallbackError as e:
            refused = e.__context__
            if isinstance(refused, PipelineFull):
                self._last_request = True
                self._pause_reading()
            elif isinstance(refused, HeadTooLarge):
                self._fail(refused.status, str(refused), refused.code)
            else:  # a bug of ours in a callback: the log has it, the client a plain 400
                logger.error("HTTP parser callback failed", exc_info=e.__context__)
                self._fail(400, "malformed HTTP request")
        except httptools.HttpParserError as e:
            self._fail(400, f"malformed HTTP request: {e}")
        else:
            # a head still arriving (the parser buffers a header until its end) is bounded too
            if not self._in_body and self._head_bytes > MAX_HEAD_BYTES:
                self._fail(431, f"the request head is larger than {MAX_HEAD_BYTES} bytes", "request_too_large")

    def eof_received(self) -> bool | None:
        return None  # close our side too (a half-closed client is gone for a streaming server)

    def write(self, data: bytes) -> None:
        if not self.closed:
            self.transport.write(data)

    def _fail(self, status: int, message: str, code: str | None = None, headers: bytes = b"") -> None:
        """Answer a request the parser refused (when no earlier one is still to be answered), close."""
        self._release_pending()
        self._body = bytearray()
        if self._task is None and not self._queue and not self.closed:
            body = error_json(message, code=code)
            self.transport.write(b"%sContent-Type: application/json\r\nContent-Length: %d\r\n%b"
                                 b"Connection: close\r\n\r\n%s" % (status_line(status), len(body), headers, body))
            self._linger()
        else:
            self.close()

    def _linger(self) -> None:
        """Close after an answer to a refused request, so that the client reads it: closing
        with its unread bytes in our buffer would reset the connection and lose the answer.
        So: end our side, drop what still comes for LINGER_S, then close."""
        self.closed = True  # nothing more is parsed or answered here
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            self.transport.write_eof()
        except (OSError, RuntimeError, NotImplementedError):
            self.transport.close()
            return
        if self._reading_paused:  # read (and drop) what still comes, so the close is clean
            self.transport.resume_reading()
        self.loop.call_later(LINGER_S, self.transport.close)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.closed = True

    # ---------------------------------------------------------------- deadlines

    def _enter(self, phase: int) -> None:
        self._phase, self._phase_at = phase, self.loop.time()
        if self._task is None:
            self._arm()

    def _due(self) -> float:
        """When what the connection waits for now is overdue."""
        server = self.server
        if self._queue:  # answers the client does not read
            return self._stalled_at + server.idle_timeout_s
        if self._phase == _HEAD:
            return self._phase_at + server.header_timeout_s
        if self._phase == _BODY:
            return self._phase_at + server.body_timeout_s
        return self._phase_at + server.idle_timeout_s

    def _arm(self) -> None:
        """Make sure a timer fires by the current deadline (nothing while a request is
        answered). A timer due earlier is kept: it re-checks when it fires, so a request
        costs no timer of its own on a busy connection."""
        if self._task is not None or self.closed:
            return
        due = self._due()
        timer = self._timer
        if timer is not None:
            if timer.when() <= due:
                return
            timer.cancel()
        self._timer = self.loop.call_at(due, self._deadline)

    def _deadline(self) -> None:
        self._timer = None
        if self._task is not None or self.closed:
            return  # re-armed when the answer is done
        due = self._due()
        if self.loop.time() < due:
            self._timer = self.loop.call_at(due, self._deadline)
        elif self._phase == _HEAD and not self._queue:
            self._fail(408, f"the request head did not arrive within {self.server.header_timeout_s} s",
                       "request_timeout")
        elif self._phase == _BODY and not self._queue:
            self._fail(408, f"the request body did not arrive within {self.server.body_timeout_s} s",
                       "request_timeout")
        else:
            self.close()

    # ---------------------------------------------------------------- body memory

    def _release_pending(self) -> None:
        if self._pending:
            self.server.pending_body_bytes -= self._pending
            self._pending = 0

    # ---------------------------------------------------------------- parser callbacks

    def on_message_begin(self) -> None:
        self._reset()
        self._enter(_HEAD)

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_URL_BYTES:
            raise HeadTooLarge(414, f"the request URL is longer than {MAX_URL_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) > MAX_HEADER_BYTES:
            raise HeadTooLarge(431, f"a request header is longer than {MAX_HEADER_BYTES} bytes")
        headers = self._headers
        if len(headers) >= MAX_HEADERS:
            raise HeadTooLarge(431, f"more than {MAX_HEADERS} request headers")
        self._fields_bytes += len(name) + len(value) + 4
        if self._fields_bytes + len(self._url) > MAX_HEAD_BYTES:
            raise HeadTooLarge(431, f"the request head is larger than {MAX_HEAD_BYTES} bytes")
        headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self._in_body = True
        self._head_bytes = 0
        if self.parser.should_upgrade():  # refused before the request is queued
            raise HeadTooLarge(400, "protocol upgrades are not supported")
        self._enter(_BODY)
        length = self._headers.get("content-length")
        expect = self._headers.get("expect", "").lower() == "100-continue"
        if length is not None and length.isdigit() and int(length) > self.server.max_body_bytes:
            self._too_large = True
            if expect:  # the client waits for our word before sending the body: refuse now
                raise HeadTooLarge(413, f"request body is larger than {self.server.max_body_bytes} bytes")
        elif expect:
            self.transport.write(_CONTINUE)

    def on_chunk_header(self) -> None:
        self._chunks += 1
        if self._chunks > MAX_BODY_CHUNKS:  # bounded work per body, however small its chunks
            raise HeadTooLarge(400, f"the request body came in more than {MAX_BODY_CHUNKS} chunks", None)

    def on_body(self, body: bytes) -> None:
        if self._too_large:
            return
        n = len(body)
        self._body_size += n
        if self._body_size > self.server.max_body_bytes:
            self._too_large = True  # read on (and drop) to answer 413 after it
            self._body = bytearray()
            self._release_pending()
            return
        server = self.server
        if server.pending_body_bytes + n > server.max_pending_body_bytes:
            raise HeadTooLarge(503, f"the router holds {server.max_pending_body_bytes} bytes of request bodies "
                                    "still arriving; retry later", "server_busy")
        server.pending_body_bytes += n
        self._pending += n
        self._body += body

    def on_message_complete(self) -> None:
        self._in_body = False
        self._head_bytes = 0
        self._release_pending()
        parser = self.parser
        url = self._url
        q = url.find(b"?")
        path, query = (url, b"") if q < 0 else (url[:q], url[q + 1:])
        body, self._body = bytes(self._body), bytearray()
        req = Request(parser.get_method().decode(), path.decode("latin-1"), query.decode("latin-1"),
                      self._headers, body, parser.should_keep_alive(), parser.get_http_version(), self)
        if self._too_large:
            req.body = None  # type: ignore[assignment]  # the handler answers 413
        self._queue.append(req)
        self._phase, self._phase_at = _IDLE, self.loop.time()
        if self._task is None:
            self._next()
        if len(self._queue) >= MAX_PIPELINED:  # answer these, read no more, close
            req.keep_alive = False
            raise PipelineFull()

    # ---------------------------------------------------------------- handling

    def _next(self) -> None:
        if self._queue and not self.closed and not self.paused:
            req = self._queue.popleft()
            self._stalled_at = None
            self._task = self.loop.create_task(self._handle(req))
        else:
            self._task = None
            if self._last_request and not self._queue:
                self.close()
            elif not self.closed:
                if self._queue:
                    if self._stalled_at is None:
                        self._stalled_at = self.loop.time()  # answers wait for the client to read
                elif self._phase == _IDLE:
                    self._phase_at = self.loop.time()  # idle since this answer
                self._arm()

    async def _handle(self, req: Request) -> None:
        resp = Response(self, req)
        try:
            await self.server.handler(req, resp)
        except asyncio.CancelledError:
            self.close()
            return
        except Exception:
            logger.exception("handler of %s %s failed", req.method, req.path)
            if not resp.started:
                resp.send(500, b'{"error": {"message": "internal error", "type": "internal_error", '
                               b'"param": null, "code": null}}')
            else:
                req.keep_alive = False  # a broken stream: closing tells the client
        if not resp.started:
            resp.send(500, b'{"error": {"message": "no answer", "type": "internal_error", "param": null, '
                           b'"code": null}}')
        elif not resp.finished:
            req.keep_alive = False
        if not req.keep_alive:
            self.close()
        self._next()


class HTTPServer:
    """`max_body_bytes`: one request body (413 past it); `max_pending_body_bytes`: the partial
    bodies of all connections together (503); the timeouts: ServerConnection's deadlines."""

    def __init__(self, handler: Handler, max_body_bytes: int = 16 << 20, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 header_timeout_s: float = HEADER_TIMEOUT_S, body_timeout_s: float = BODY_TIMEOUT_S,
                 max_pending_body_bytes: int = MAX_PENDING_BODY_BYTES):
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.idle_timeout_s = idle_timeout_s
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.max_pending_body_bytes = max_pending_body_bytes
        self.pending_body_bytes = 0  # of bodies still arriving, all connections
        self.connections: set[ServerConnection] = set()
        self.loop = asyncio.get_running_loop()
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        self._server = await self.loop.create_server(lambda: ServerConnection(self), host, port, backlog=4096,
                                                     reuse_address=True)
        return self._server.sockets[0].getsockname()[:2]

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stop listening, close idle connections, give running handlers `timeout_s`, then cancel them."""
        if self._server is not None:
            self._server.close()
        tasks = [c._task for c in self.connections if c._task is not None and not c._task.done()]
        for c in list(self.connections):
            if c._task is None:
                c.close()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        for c in list(self.connections):
            c.close()
        if self._server is not None:
            await self._server.wait_closed()


# =============================================================================== client

class UpstreamError(Exception):
    """A failed exchange with a worker."""


class ConnectError(UpstreamError):
    """No connection could be opened: the request never reached the worker."""


class Disconnected(UpstreamError):
    """The connection dropped before any byte of a response. `reused`: it was a kept-alive
    connection (the worker may have closed it idle just as it was used)."""

    def __init__(self, message: str, reused: bool):
        super().__init__(message)
        self.reused = reused


class Timeout(UpstreamError):
    """The worker did not answer (or went silent) in time."""


class BrokenResponse(UpstreamError):
    """The response began, then broke (dropped connection, malformed framing)."""


Sink = Callable[[bytes], None]


class ClientConnection(asyncio.Protocol):
    """One upstream connection; one exchange at a time. After `request()` returned (the head
    arrived) the body is taken with `read()` or `stream()`; `release()` hands the connection
    back to its pool (or closes it when it cannot be reused)."""

    __slots__ = ("pool", "loop", "transport", "parser", "reused", "status", "headers", "content_type", "done",
                 "lost", "keep_alive", "body", "sink", "on_end", "_waiter", "_timer", "_timeout",
                 "_idle_based", "last_data", "idle_since", "error", "_head_done", "_close_delimited", "_head_bytes",
                 "_body_size")

    def __init__(self, pool: "Pool"):
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpResponseParser | None = None
        self.reused = False
        self.lost = False
        self.idle_since = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.content_type = ""
        self.done = False
        self.keep_alive = False
        self.body = bytearray()  # a worker's tiny chunks cost their size, not an object each
        self.sink: Sink | None = None
        self.on_end: Callable[[BaseException | None], None] | None = None
        self._waiter: asyncio.Future | None = None
        self.error: BaseException | None = None
        self._head_done = False
        self._close_delimited = False
        self._head_bytes = 0
        self._body_size = 0

    # ---------------------------------------------------------------- transport events

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        set_nodelay(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.discard(self)
        if self.parser is not None and not self.done:
            if self._head_done and self._close_delimited and exc is None:
                self.on_message_complete()  # the close ends a body without length or chunks
            elif not self._head_done:
                self._fail(Disconnected(f"{self.pool.url} closed the connection before answering"
                                        + (f": {exc}" if exc else ""), self.reused))
            else:
                self._fail(BrokenResponse(f"{self.pool.url} closed the connection mid-answer"
                                          + (f": {exc}" if exc else "")))

    def data_received(self, data: bytes) -> None:
        if self.parser is None:  # nothing asked: a worker talking out of turn is not reused
            self.transport.close()
            return
        self.last_data = self.loop.time()
        if not self._head_done:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
            if not self._head_done and self._head_bytes > MAX_HEAD_BYTES:
                raise HeadTooLarge(502, f"a response head larger than {MAX_HEAD_BYTES} bytes")
        except (httptools.HttpParserError, HeadTooLarge) as e:
            cause = e.__context__ if isinstance(e.__context__, HeadTooLarge) else e
            self._fail(BrokenResponse(f"{self.pool.url} sent a malformed response: {cause}"))
            self.transport.close()

    # ---------------------------------------------------------------- parser callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) > MAX_HEADER_BYTES or len(self.headers) >= MAX_HEADERS:
            raise HeadTooLarge(502, f"a header over {MAX_HEADER_BYTES} bytes or over {MAX_HEADERS} headers")
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self._head_done = True
        self.status = self.parser.get_status_code()
        h = self.headers
        self.content_type = h.get("content-type", "").split(";", 1)[0].strip()
        self._close_delimited = "content-length" not in h and "chunked" not in h.get("transfer-encoding", "") \
            and self.status not in (204, 304) and self.status >= 200
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.sink is not None:
            try:
                self.sink(body)
            except Exception as e:  # a relay bug must not kill the loop's protocol
                logger.exception("stream sink failed")
                self._fail(BrokenResponse(f"relay failed: {e}"))
                self.transport.close()
        else:
            self._body_size += len(body)
            if self._body_size > self.pool.max_body_bytes:
                self.body = bytearray()
                self._fail(BrokenResponse(f"{self.pool.url} answered more than {self.pool.max_body_bytes} bytes"))
                self.transport.close()
                return
            self.body += body

    def on_message_complete(self) -> None:
        if self.error is not None:  # over a limit: already failed
            return
        self.done = True
        self.keep_alive = self.parser.should_keep_alive() and not self._close_delimited
        self._cancel_timer()
        self._wake()
        if self.on_end is not None:
            cb, self.on_end = self.on_end, None
            cb(None)

    # ---------------------------------------------------------------- waiting

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._cancel_timer()
        w = self._waiter
        if w is not None and not w.done():
            w.set_exception(error)
        if self.on_end is not None:
            cb, self.on_end = self.on_end, None
            cb(error)

    def _arm(self, timeout_s: float | None, idle_based: bool) -> None:
        self._cancel_timer()
        self._timeout = timeout_s
        self._idle_based = idle_based
        if timeout_s is not None:
            self._timer = self.loop.call_later(timeout_s, self._on_timer)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        if self.done or self.error is not None:
            return
        if self._idle_based:
            left = self.last_data + self._timeout - self.loop.time()
            if left > 0.001:
                self._timer = self.loop.call_later(left, self._on_timer)
                return
        self._fail(Timeout(f"{self.pool.url} did not answer within {self._timeout} s"))
        self.transport.close()

    async def _wait(self) -> None:
        if self.error is not None:
            raise self.error
        self._waiter = self.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # ---------------------------------------------------------------- the exchange

    async def exchange(self, data: bytes, timeout_s: float | None, idle_timeout: bool) -> None:
        """Send one request (`data`: request line, headers and body) and wait for the head."""
        self._reset()
        self.parser = httptools.HttpResponseParser(self)
        self.last_data = self.loop.time()
        self._arm(timeout_s, idle_timeout)
        self.transport.write(data)
        while not self._head_done:
            await self._wait()

    async def read(self) -> bytes:
        """The whole body."""
        while not self.done:
            await self._wait()
        return bytes(self.body)

    def stream(self, sink: Sink, on_end: Callable[[BaseException | None], None]) -> None:
        """Push the body into `sink` as it arrives (what arrived with the head first), then call
        `on_end(None)`, or `on_end(error)` when it breaks or times out."""
        if self.body:
            early, self.body = bytes(self.body), bytearray()
            sink(early)
        if self.done:
            on_end(None)
        elif self.error is not None:
            on_end(self.error)
        else:
            self.sink, self.on_end = sink, on_end

    def pause_reading(self) -> None:
        if not self.lost:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if not self.lost:
            self.transport.resume_reading()

    def release(self) -> None:
        """Back to the pool when the exchange ended cleanly, else closed."""
        self._cancel_timer()
        self.sink = self.on_end = None
        if self.done and self.keep_alive and self.error is None and not self.lost:
            self.parser = None
            self.pool.put(self)
        else:
            self.abort()

    def abort(self) -> None:
        self._cancel_timer()
        self.sink = self.on_end = None
        if self.transport is not None and not self.lost:
            self.transport.close()
        self.lost = True
        self.pool.discard(self)


class Pool:
    """Keep-alive connections to one worker (`http(s)://host:port`), unlimited in number."""

    def __init__(self, url: str, connect_timeout_s: float = 5.0, max_body_bytes: int = MAX_UPSTREAM_BODY_BYTES):
        parts = urlsplit(url)
        self.max_body_bytes = max_body_bytes
        self.url = url
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        host_header = parts.netloc
        self.host_header = f"Host: {host_header}\r\n".encode()
        self.connect_timeout_s = connect_timeout_s
        self.loop = asyncio.get_running_loop()
        self.idle: list[ClientConnection] = []
        self.busy: set[ClientConnection] = set()
        self.closed = False

    async def connect(self) -> ClientConnection:
        """A kept-alive connection (the most recently used), else a new one."""
        now = self.loop.time()
        while self.idle:
            conn = self.idle.pop()
            if not conn.lost and now - conn.idle_since < POOL_IDLE_S:
                conn.reused = True
                self.busy.add(conn)
                return conn
            conn.abort()
        try:
            _, conn = await asyncio.wait_for(self.loop.create_connection(
                lambda: ClientConnection(self), self.host, self.port, ssl=self.ssl,
                server_hostname=self.host if self.ssl else None), self.connect_timeout_s)
        except asyncio.TimeoutError:
            raise ConnectError(f"cannot connect to {self.url}: timed out after {self.connect_timeout_s} s") from None
        except OSError as e:
            raise ConnectError(f"cannot connect to {self.url}: {e.strerror or e}") from None
        conn.reused = False
        if self.closed:
            conn.abort()
            raise ConnectError(f"{self.url} was removed")
        self.busy.add(conn)
        return conn

    def put(self, conn: ClientConnection) -> None:
        self.busy.discard(conn)
        if self.closed:
            conn.abort()
        else:
            conn.idle_since = self.loop.time()
            self.idle.append(conn)

    def discard(self, conn: ClientConnection) -> None:
        self.busy.discard(conn)
        try:
            self.idle.remove(conn)
        except ValueError:
            pass

    async def request(self, method: bytes, path: bytes, headers: bytes = b"", body: bytes | None = None,
                      timeout_s: float | None = None, idle_timeout: bool = False) -> ClientConnection:
        """Send a request; returns the connection once the response head arrived (then read()
        or stream() the body, and release()). `headers`: extra `Name: value\\r\\n` lines.
        `timeout_s`: for the whole exchange, or (`idle_timeout`) for each silence."""
        conn = await self.connect()
        if body is None:
            data = b"%b %b HTTP/1.1\r\n%b%b\r\n" % (method, path, self.host_header, headers)
        else:
            data = b"%b %b HTTP/1.1\r\n%bContent-Length: %d\r\n%b\r\n%b" % (method, path, self.host_header,
                                                                           len(body), headers, body)
        try:
            await conn.exchange(data, timeout_s, idle_timeout)
        except BaseException:
            conn.abort()
            raise
        return conn

    async def fetch(self, method: bytes, path: bytes, headers: bytes = b"", body: bytes | None = None,
                    timeout_s: float | None = None) -> tuple[int, str, bytes]:
        """A whole exchange: (status, content type, body)."""
        conn = await self.request(method, path, headers, body, timeout_s)
        try:
            data = await conn.read()
        except BaseException:
            conn.abort()
            raise
        conn.release()
        return conn.status, conn.content_type, data

    def close(self) -> None:
        """No more requests; idle connections close now, busy ones when released."""
        self.closed = True
        for conn in self.idle:
            conn.abort()
        self.idle.clear()

    def abort_all(self) -> None:
        self.close()
        for conn in list(self.busy):
            conn.abort()
