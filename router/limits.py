"""Admission control: at most `max_concurrent` requests routed at once, up to `max_queued`
more waiting (first come, first served) for at most `queue_timeout_s`; beyond that a
request is refused at once with 429 and `Retry-After` (router/app.py), so an overloaded
router sheds load early instead of timing everything out.
"""
from __future__ import annotations

import asyncio
from collections import deque


class Rejected(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Admission:
    def __init__(self, max_concurrent: int = 0, max_queued: int = 0, queue_timeout_s: float = 30.0):
        self.max_concurrent = max_concurrent  # 0: no cap
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.active = 0
        self.queue: deque[asyncio.Future] = deque()

    def state(self) -> tuple[int, int]:
        return self.active, len(self.queue)

    async def enter(self) -> None:
        """A slot, or Rejected("queue_full" | "queue_timeout")."""
        if self.max_concurrent <= 0 or (self.active < self.max_concurrent and not self.queue):
            self.active += 1
            return
        if len(self.queue) >= self.max_queued:
            raise Rejected("queue_full")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.queue.append(fut)
        timer = loop.call_later(self.queue_timeout_s, _expire, fut)
        try:
            await fut  # resolved by leave(): the slot is handed over, `active` unchanged
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.leave()  # got the slot just as it was cancelled: pass it on
            else:
                try:
                    self.queue.remove(fut)
                except ValueError:
                    pass
            raise
        finally:
            timer.cancel()

    def leave(self) -> None:
        while self.queue:
            fut = self.queue.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.active -= 1


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(Rejected("queue_timeout"))
