"""Admission control: at most `max_concurrent` slots in use at once (a request takes one; a
completions request of several prompts one per prompt, at most the whole cap), up to
`max_queued` more requests waiting for at most `queue_timeout_s`; beyond that a request is
refused at once with 429 and `Retry-After` (router/app.py), so an overloaded router sheds load
early instead of timing everything out.

The queue is in the request's `priority` order (lower first, as the engines' priority
scheduling), then arrival; its head is admitted as soon as its slots are free, and nothing
overtakes it (a request of many prompts is not starved by single ones).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools


class Rejected(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Admission:
    def __init__(self, max_concurrent: int = 0, max_queued: int = 0, queue_timeout_s: float = 30.0):
        self.max_concurrent = max_concurrent  # 0: no cap
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.active = 0  # slots in use
        self.queue: list[list] = []  # heap of [priority, arrival, future, slots]
        self.arrivals = itertools.count()

    def state(self) -> tuple[int, int]:
        """(slots in use, requests waiting)."""
        return self.active, len(self.queue)

    async def enter(self, priority: int = 0, slots: int = 1) -> int:
        """Take `slots` (at most the cap) and return how many, to give back to leave(); or
        Rejected("queue_full" | "queue_timeout")."""
        if self.max_concurrent > 0:
            slots = min(slots, self.max_concurrent)
        if self.max_concurrent <= 0 or (not self.queue and self.active + slots <= self.max_concurrent):
            self.active += slots
            return slots
        if len(self.queue) >= self.max_queued:
            raise Rejected("queue_full")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        entry = [priority, next(self.arrivals), fut, slots]
        heapq.heappush(self.queue, entry)
        timer = loop.call_later(self.queue_timeout_s, _expire, fut)
        try:
            await fut  # resolved by _admit(): the slots are counted in `active` already
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.leave(slots)  # got the slots just as it was cancelled: pass them on
            else:
                try:
                    self.queue.remove(entry)
                    heapq.heapify(self.queue)
                except ValueError:
                    pass
                self._admit()  # it may have held back smaller requests behind it
            raise
        finally:
            timer.cancel()
        return slots

    def leave(self, slots: int = 1) -> None:
        self.active -= slots
        self._admit()

    def _admit(self) -> None:
        while self.queue:
            _, _, fut, slots = self.queue[0]
            if fut.done():  # timed out: enter() removes it too
                heapq.heappop(self.queue)
                continue
            if self.active + slots > self.max_concurrent:
                return
            heapq.heappop(self.queue)
            self.active += slots
            fut.set_result(None)


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(Rejected("queue_timeout"))
