"""ZMQ side channel: D pulls a transfer's pinned KV blocks from P (docs/design.md, "Side channel").

Here: the control plane's I/O loop, shared by every data plane: one thread per side that
owns every socket (IOLoop), the checks both sides make, and rate-limited refusal logs.
KVSender (kv_transfer/zmq_sender.py, P) and KVReceiver (kv_transfer/zmq_receiver.py, D)
subclass IOLoop; kv_transfer/side_channel.py is the wire.

This module is also the control plane of every other data plane (kv_transfer/
mooncake_transport.py): grants, leases, heartbeats, access tokens, the compat check,
exactly-once release and the receiver's exactly-once reports live here once. A data plane
subclasses KVSender / KVReceiver and overrides only the hooks marked "data plane": how a
checked READ is served (`_serve`, `_on_done`), what the handshake tells D
(`_handshake_info`), and how D moves and accepts the bytes (`_on_transfer_message`,
`_before_read`, `_on_welcome`, `_finish`). READ names the consumer's backend and P refuses
another one (`backend_mismatch`), so P and D on different backends never move a byte.

KV memory is a numpy uint8 view `kv_blocks[num_blocks, block_bytes]` of the engine's
block-major KV tensor: one block of every layer is one contiguous row, so a run of
consecutive block ids is one contiguous slice (and DATA needs no layer range). P sends
such slices zero-copy, in messages of up to 8 MiB; D copies each received frame once,
straight into its destination rows. Transfers under 256 KiB are copied into zmq instead:
for them, waiting for zmq to release zero-copy frames costs more than the copy.

Both run one I/O thread that owns every socket; the engine-facing methods only touch
state under a lock and wake that thread.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import numpy as np
import zmq

from kv_transfer import faults as _faults

log = logging.getLogger(__name__)

MAX_POLL_MS = 100  # lease/timeout checks run at least this often
BUSY_POLL_MS = 1  # while waiting for zmq to let go of sent frames
MAX_TOMBSTONES = 1 << 16
LOG_PER_S = 5  # refusal log lines per second; the rest are counted (stats().failures)


def check_kv(kv_blocks: np.ndarray) -> None:
    if not (isinstance(kv_blocks, np.ndarray) and kv_blocks.dtype == np.uint8 and kv_blocks.ndim == 2):
        raise ValueError("kv_blocks must be a numpy uint8 array [num_blocks, block_bytes]")
    if not kv_blocks.flags.c_contiguous:
        raise ValueError("kv_blocks must be C-contiguous (one block = one contiguous row)")


def check_block_ids(name: str, ids: list[int], num_blocks: int) -> np.ndarray:
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if len(arr) and (arr.min() < 0 or arr.max() >= num_blocks):
        raise ValueError(f"{name} must lie in [0, {num_blocks}), got {ids}")
    return arr


class RateLimitedLog:
    """At most `per_s` lines a second; the next line that gets through says how many were dropped."""

    def __init__(self, per_s: int = LOG_PER_S) -> None:
        self.per_s, self.window, self.count, self.dropped = per_s, 0.0, 0, 0

    def __call__(self, level: int, fmt: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self.window >= 1.0:
            self.window, self.count = now, 0
        if self.count >= self.per_s:
            self.dropped += 1
            return
        self.count += 1
        if self.dropped:
            fmt, args = fmt + " (%d similar lines dropped)", (*args, self.dropped)
            self.dropped = 0
        log.log(level, fmt, *args)


class IOLoop:
    """One I/O thread that owns the sockets; other threads wake it through a socketpair."""

    def __init__(self, name: str) -> None:
        self._ctx = zmq.Context(io_threads=1)
        self._poller = zmq.Poller()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._stopping = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # a wake-up is already pending, or we are closing

    def _run(self) -> None:
        while not self._stopping:
            events = self._poller.poll(self._poll_timeout_ms())
            for sock, _ in events:
                if isinstance(sock, zmq.Socket):
                    self._drain(sock)
                else:
                    self._drain_wakeups()
            if not events:
                self._idle()
            if _faults.ACTIVE:  # side-channel messages an injected fault delayed or held back
                for sock, frames in _faults.channel_due(self._thread.name):
                    self._deliver(sock, frames)
            with self._lock:
                try:
                    self._on_tick(time.monotonic())
                except Exception:  # the loop must survive anything one transfer does
                    log.exception("%s: tick failed", self._thread.name)

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _drain(self, sock: zmq.Socket, budget: int = 64) -> None:
        for _ in range(budget):  # bounded, so lease and timeout checks still run
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if _faults.ACTIVE:  # tests: drop / duplicate / delay / reorder what arrived
                for held in _faults.channel(self._thread.name, sock, frames):
                    self._deliver(sock, held)
                continue
            self._deliver(sock, frames)

    def _deliver(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        with self._lock:
            try:
                self._on_message(sock, frames)
            except Exception:
                log.exception("%s: message handling failed", self._thread.name)

    def close(self) -> None:
        """Stop the I/O thread and drop every socket (linger 0). Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stopping = True
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._ctx.destroy(linger=0)
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # Subclass hooks; _on_message and _on_tick run on the I/O thread with the lock held.
    def _poll_timeout_ms(self) -> int:
        raise NotImplementedError

    def _on_message(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        raise NotImplementedError

    def _on_tick(self, now: float) -> None:
        raise NotImplementedError

    def _idle(self) -> None:
        """Nothing arrived; called without the lock."""
