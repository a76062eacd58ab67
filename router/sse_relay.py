"""D's SSE stream relayed to the client from the connection's data callback: no coroutine
switch per chunk, only complete events forwarded (an event split across chunks is held until
its end), linear in the bytes (the unended event is appended in place and only the new bytes
scanned), bounded (an event longer than `max_event_bytes` ends the relay), with backpressure
(a client that reads slower than D writes pauses D's connection until the client drains).

The relay does the bytes; router/pd.py judges the outcome (whose fault, which error the
client gets) and keeps the request's metrics through the callbacks.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

from router.http import BrokenResponse, ClientConnection, Response

SSE_HEADERS = b"Content-Type: text/event-stream\r\nCache-Control: no-cache\r\nX-Accel-Buffering: no\r\n"
DONE_EVENT = b"data: [DONE]"
ERROR_EVENT_PREFIX = b'data: {"error"'
DRAIN_TIMEOUT_S = 1.0  # after [DONE], how long the end of D's body is awaited (to reuse the connection)


def complete_events_end(buf: bytes | bytearray, start: int = 0) -> int:
    """Length of the prefix of `buf` that is whole SSE events (0 when none), looking for the
    last event end at or after `start` only (so a relay scans each byte once)."""
    lf, crlf = buf.rfind(b"\n\n", start), buf.rfind(b"\r\n\r\n", start)
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


def _ignore(*_) -> None:
    pass


class SSERelay:
    """One stream from `conn` to `resp`. `run()` returns how it ended: None after [DONE] or a
    first event that is an error (`error_first`), else the connection's error (None: D ended
    the body without [DONE]). Callbacks: `on_started()` once the client's response began,
    `on_events(n, now)` per forwarded batch of n data events, `on_error_event()` the first
    time an error event follows the start (relayed as is)."""

    __slots__ = ("resp", "conn", "echo", "max_event_bytes", "buf", "last", "saw_done", "error_first", "error_mid",
                 "paused", "drain_timer", "done", "on_started", "on_events", "on_error_event")

    def __init__(self, resp: Response, conn: ClientConnection, echo: bytes, max_event_bytes: int):
        self.resp, self.conn, self.echo, self.max_event_bytes = resp, conn, echo, max_event_bytes
        self.buf = bytearray()  # the unended event so far: no terminator in it
        self.last = b""  # the last batch of events forwarded
        self.saw_done = False
        self.error_first: bytes | None = None
        self.error_mid = False
        self.paused = False
        self.drain_timer: asyncio.TimerHandle | None = None
        self.done: asyncio.Future | None = None
        self.on_started: Callable[[], None] = _ignore
        self.on_events: Callable[[int, float], None] = _ignore
        self.on_error_event: Callable[[], None] = _ignore

    async def run(self) -> BaseException | None:
        loop = asyncio.get_running_loop()
        self.done = loop.create_future()
        self.conn.stream(self._sink, self._on_end)
        try:
            return await self.done
        finally:
            if self.drain_timer is not None:
                self.drain_timer.cancel()

    def _on_end(self, error: BaseException | None) -> None:
        if not self.done.done():
            self.done.set_result(error)

    def _saw_done(self) -> None:
        # the client has everything: wait briefly for the end of D's body (so the
        # connection can be reused), no longer
        self.saw_done = True
        if not self.conn.done:
            self.drain_timer = asyncio.get_running_loop().call_later(DRAIN_TIMEOUT_S, self._on_end, None)

    def _sink(self, data: bytes) -> None:
        buf, resp, conn = self.buf, self.resp, self.conn
        if buf:  # appended in place and only the new bytes scanned: linear in the event
            start = len(buf) - 3  # an event end may straddle the chunks
            buf += data
            cut = complete_events_end(buf, max(start, 0))
            if cut:
                with memoryview(buf) as view:
                    events = bytes(view[:cut])
                del buf[:cut]
        else:
            cut = complete_events_end(data)
            events = data if cut == len(data) else data[:cut]
            if cut < len(data):
                buf += memoryview(data)[cut:]
        if len(buf) > self.max_event_bytes:  # an event that does not end
            self.buf = bytearray()
            conn.abort()
            self._on_end(BrokenResponse(f"an SSE event longer than {self.max_event_bytes} bytes"))
            return
        if not cut:
            return
        now = time.perf_counter()
        if not resp.started:
            if events.startswith(ERROR_EVENT_PREFIX):
                self.error_first = events
                conn.abort()
                self._on_end(None)
                return
            end = events.rstrip().endswith(DONE_EVENT)
            resp.start_stream(200, SSE_HEADERS + self.echo, events)
            self.on_started()
            if end:
                resp.end()
                self._saw_done()
        elif events.rstrip().endswith(DONE_EVENT):
            resp.end(events)  # the last event and the end of the body in one write
            self._saw_done()
        else:
            resp.write(events)
        if resp.started and ERROR_EVENT_PREFIX in events and not self.error_mid:  # relayed as is, counted once
            self.error_mid = True
            self.on_error_event()
        self.last = events
        n = events.count(b"\n\n") + events.count(b"\r\n\r\n") - (DONE_EVENT in events)
        if n > 0:
            self.on_events(n, now)
        if resp.paused and not self.paused:  # the client reads slower than D writes
            self.paused = True
            conn.pause_reading()
            asyncio.get_running_loop().create_task(self._resume_when_drained())

    async def _resume_when_drained(self) -> None:
        await self.resp.drain()
        self.paused = False
        self.conn.resume_reading()
