"""D's side of the ZMQ side channel (kv_transfer/zmq_transport.py).

Consumer (D), `KVReceiver`: `hold()` keeps a waiting transfer's lease alive, `start_pull()`
pulls it, `abort()` gives it up; every id handed to hold/start_pull comes back exactly once
from `take_finished()`, as finished or as failed, and only then may its local blocks be
reused. `abort()` is also a write barrier: once it returns, nothing writes that
transfer's blocks any more.

Hostile peers (issue 42): every message that changes a transfer's state (READ, DONE, ABORT,
HEARTBEAT) carries its access token and does nothing without it; inbound messages are
bounded by zmq (MAXMSGSIZE: a larger one drops the connection) and by field (ids,
strings, ids per message); a HEARTBEAT's unknown ids get one REFUSED reply; refusals are
logged at most LOG_PER_S times a second; D closes a producer's socket idle for IDLE_PEER_S.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import msgspec
import numpy as np
import zmq

from kv_transfer import faults as _faults
from kv_transfer.side_channel import (ABORTED, Abort, BACKEND_MISMATCH, Data, Done, End, Error, Heartbeat,
                                      INCOMPLETE, MALFORMED, MAX_DATA_FRAME_BYTES, MAX_IDS_PER_MESSAGE,
                                      Message, Msg, Read, Ready, Refused, TIMEOUT, Welcome, block_runs,
                                      decode, encode)
from kv_transfer.zmq_transport import IOLoop, MAX_POLL_MS, RateLimitedLog, check_block_ids, check_kv

log = logging.getLogger(__name__)


PEER_PING_MS, PEER_DEAD_MS = 1000, 3000  # D's pings to each P, and the silence that drops the connection
IDLE_PEER_S = 60.0  # D closes a producer's socket unused for this long


class ReceiverStats(msgspec.Struct):
    bytes_received: int = 0
    transfers_finished: int = 0
    transfer_seconds_sum: float = 0.0
    transfer_seconds_count: int = 0
    failures: dict[str, int] = {}  # failed transfers by reason
    malformed_messages: int = 0
    peers_open: int = 0  # producer sockets open (idle ones are closed after IDLE_PEER_S)


class _Pull:
    __slots__ = ("peer", "lease_s", "remote_ids", "local_ids", "got", "timeout_s", "deadline", "t0", "pulling",
                 "token")

    def __init__(self, peer: tuple[str, int], lease_s: float | None, token: str = "") -> None:
        self.peer, self.lease_s, self.pulling, self.token = peer, lease_s, False, token


class KVReceiver(IOLoop):
    """D's side channel: pulls transfers from P engines into local blocks.

    `timeout_s` of a pull is a receive timeout: the longest P may stay silent (no DATA
    or END) before the pull fails with "timeout", so a large transfer that keeps moving
    never times out.
    """

    backend = "zmq"
    _pull_type = _Pull

    def __init__(self, kv_blocks: np.ndarray, compat: dict[str, Any], *, heartbeat_s: float = 5.0, rcvhwm: int = 8) -> None:
        check_kv(kv_blocks)
        if not kv_blocks.flags.writeable:
            raise ValueError("kv_blocks must be writeable")
        super().__init__("kv-receiver")
        self._kv = kv_blocks
        self._compat = dict(compat)
        self._heartbeat_s = heartbeat_s
        self._rcvhwm = rcvhwm  # DATA messages buffered per peer: bounds D's memory per P
        self._cond = threading.Condition(self._lock)
        self._pulls: dict[str, _Pull] = {}
        self._outbox: list[tuple[tuple[str, int], Msg]] = []
        self._finished: list[str] = []
        self._failed: list[tuple[str, str]] = []
        self._seconds: list[float] = []
        self._sockets: dict[tuple[str, int], zmq.Socket] = {}
        self._peers: dict[zmq.Socket, tuple[str, int]] = {}
        self._peer_used: dict[tuple[str, int], float] = {}  # last send: idle sockets are closed
        self._max_frame_bytes = max(MAX_DATA_FRAME_BYTES, 2 * kv_blocks.shape[1])
        self._log = RateLimitedLog()
        self._next_heartbeat = time.monotonic() + heartbeat_s
        self._stats = ReceiverStats()
        self._thread.start()

    # Engine-thread API.

    def hold(self, transfer_id: str, host: str, port: int, lease_s: float | None = None, *,
             access_token: str) -> None:
        """Heartbeat a transfer D will pull later, so P keeps its blocks meanwhile (P renews
        only for the holder of its access token)."""
        with self._lock:
            if transfer_id in self._pulls:
                raise ValueError(f"transfer_id {transfer_id!r} is already held or pulling")
            self._pulls[transfer_id] = self._pull_type((host, port), lease_s, access_token)
            self._schedule_heartbeat(lease_s)
        self._wake()

    def start_pull(
        self,
        transfer_id: str,
        host: str,
        port: int,
        access_token: str,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        timeout_s: float,
        lease_s: float | None = None,
    ) -> None:
        """Pull P's `remote_block_ids` into `local_block_ids` (same order), asynchronously."""
        local = check_block_ids("local_block_ids", local_block_ids, len(self._kv))
        if len(local) != len(remote_block_ids):
            raise ValueError(
                f"local_block_ids ({len(local)}) and remote_block_ids ({len(remote_block_ids)}) differ in length"
            )
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        with self._lock:
            pull = self._pulls.get(transfer_id)
            if pull is not None and (pull.pulling or pull.peer != (host, port)):
                raise ValueError(f"transfer_id {transfer_id!r} is already pulling or held for another peer")
            pull = pull or self._pull_type((host, port), lease_s, access_token)
            pull.pulling, pull.lease_s, pull.token = True, lease_s or pull.lease_s, access_token
            pull.remote_ids, pull.local_ids = list(remote_block_ids), local
            pull.got = np.zeros(len(local), dtype=bool)
            pull.timeout_s, pull.t0 = timeout_s, time.monotonic()
            pull.deadline = pull.t0 + timeout_s
            self._pulls[transfer_id] = pull
            self._schedule_heartbeat(pull.lease_s)
            self._before_read(pull)
            self._outbox.append((pull.peer, Read(transfer_id, access_token, pull.remote_ids, self._compat,
                                                 self.backend)))
        self._wake()

    def abort(self, transfer_id: str) -> bool:
        """Give up a held or pulling transfer: ABORT goes to P, the id is reported failed
        ("aborted"), and from the moment this returns nothing writes its blocks.
        False if the id is not active (already finished or failed: it is reported as such)."""
        with self._lock:
            pull = self._pulls.get(transfer_id)
            if pull is None:
                return False
            self._finish(transfer_id, ABORTED, time.monotonic())
            self._outbox.append((pull.peer, Abort(transfer_id, pull.token)))
        self._wake()
        return True

    def take_finished(self) -> tuple[list[str], list[tuple[str, str]]]:
        """(finished ids, [(failed id, reason)]) since the last call; their blocks are free to reuse."""
        with self._lock:
            done, self._finished = self._finished, []
            failed, self._failed = self._failed, []
        return done, failed

    def take_transfer_seconds(self) -> list[float]:
        """Durations of the pulls finished since the last call (for a histogram)."""
        with self._lock:
            out, self._seconds = self._seconds, []
        return out

    def wait(self, timeout_s: float) -> bool:
        """Block until take_finished() has something, or timeout; True if it has."""
        with self._cond:
            return bool(self._cond.wait_for(lambda: self._finished or self._failed, timeout_s))

    def stats(self) -> ReceiverStats:
        with self._lock:
            return msgspec.structs.replace(self._stats, failures=dict(self._stats.failures),
                                           peers_open=len(self._sockets))

    # I/O thread.

    def _finish(self, tid: str, reason: str | None, now: float) -> None:
        """The only exit of a transfer: reported once, then forgotten (late messages ignored).
        A data plane whose writes into D's blocks may outlive this call defers the report."""
        self._report(tid, self._pulls.pop(tid), reason, now)

    def _report(self, tid: str, pull: _Pull, reason: str | None, now: float) -> None:
        if reason is None:
            self._finished.append(tid)
            self._seconds.append(now - pull.t0)
            self._stats.transfers_finished += 1
            self._stats.transfer_seconds_sum += now - pull.t0
            self._stats.transfer_seconds_count += 1
        else:
            self._failed.append((tid, reason))
            self._stats.failures[reason] = self._stats.failures.get(reason, 0) + 1
        self._cond.notify_all()

    def _fail(self, tid: str, reason: str, now: float) -> None:
        pull = self._pulls[tid]
        self._finish(tid, reason, now)
        self._send(pull.peer, Abort(tid, pull.token))  # let P free at once rather than at lease expiry

    def _socket(self, peer: tuple[str, int]) -> zmq.Socket:
        sock = self._sockets.get(peer)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, self._rcvhwm)
            # ZMTP pings: a connection P stopped answering (its host cut off) is dropped and
            # redialled within seconds, instead of the next READ waiting behind TCP's
            # retransmission back-off (tens of seconds after a long cut) until its timeout
            sock.setsockopt(zmq.HEARTBEAT_IVL, PEER_PING_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, PEER_DEAD_MS)
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_frame_bytes)  # a larger frame drops that producer
            sock.connect(f"tcp://{peer[0]}:{peer[1]}")
            self._sockets[peer] = sock
            self._peers[sock] = peer
            self._poller.register(sock, zmq.POLLIN)
        return sock

    def _send(self, peer: tuple[str, int], msg: Msg) -> None:
        self._peer_used[peer] = time.monotonic()
        try:
            self._socket(peer).send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # P unreachable and its queue full: the pull's timeout handles it
            pass

    def _on_message(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        try:
            msg = decode(frames[0].buffer)
        except msgspec.DecodeError:
            self._stats.malformed_messages += 1
            return
        now = time.monotonic()
        if isinstance(msg, Welcome):
            self._on_welcome(self._peers[sock], msg, now)
            return
        refusals = msg.refusals if isinstance(msg, Refused) else [(msg.transfer_id, msg.code)] \
            if isinstance(msg, Error) else []
        for tid, code in refusals:
            pull = self._pulls.get(tid)
            if pull is not None and pull.peer == self._peers[sock]:  # else late: already reported
                level = logging.WARNING if code == BACKEND_MISMATCH else logging.INFO
                self._log(level, "kv-receiver: %s refused by %s: %s %s", tid, pull.peer, code,
                          getattr(msg, "message", ""))
                self._finish(tid, code, now)
        if isinstance(msg, (Refused, Error)):
            return
        pull = self._pulls.get(getattr(msg, "transfer_id", None))
        if pull is None or pull.peer != self._peers[sock]:
            return  # late message about a transfer that already finished, failed or was aborted
        if pull.pulling:
            self._on_transfer_message(pull, msg, frames, now)

    # Data plane (ZMQ): DATA frames are copied into place on this thread; END completes.

    def _before_read(self, pull: _Pull) -> None:
        """start_pull() is about to queue the READ (lock held): a data plane may queue a handshake first."""

    def _on_welcome(self, peer: tuple[str, int], msg: Welcome, now: float) -> None:
        """A producer's handshake answer (ZMQ needs none)."""

    def _on_transfer_message(self, pull: _Pull, msg: Message, frames: list[zmq.Frame], now: float) -> None:
        if isinstance(msg, Data):
            if not self._write(pull, msg, frames[1:]):
                self._stats.malformed_messages += 1
                self._fail(msg.transfer_id, MALFORMED, now)
            else:
                pull.deadline = now + pull.timeout_s
                if _faults.ACTIVE and msg.start == 0:
                    _faults.point("kv_pull_mid")
        elif isinstance(msg, End):
            if msg.num_blocks == len(pull.got) and pull.got.all():
                self._send(pull.peer, Done(msg.transfer_id, pull.token))
                self._finish(msg.transfer_id, None, now)
            else:
                self._fail(msg.transfer_id, INCOMPLETE, now)
        elif isinstance(msg, Ready):  # another data plane's message
            self._stats.malformed_messages += 1
            self._fail(msg.transfer_id, MALFORMED, now)

    def _write(self, pull: _Pull, msg: Data, payload: list[zmq.Frame]) -> bool:
        """Copy each frame into its destination rows; False (nothing written) if it doesn't fit."""
        block_bytes = self._kv.shape[1]
        if len(payload) != len(msg.counts) or msg.start < 0 or msg.start + sum(msg.counts) > len(pull.got):
            return False
        if any(n <= 0 or len(f) != n * block_bytes for f, n in zip(payload, msg.counts)):
            return False
        pos = msg.start
        for frame, n in zip(payload, msg.counts):
            src = np.frombuffer(frame.buffer, dtype=np.uint8).reshape(n, block_bytes)
            ids = pull.local_ids[pos : pos + n]
            for off, length in block_runs(ids):
                first = int(ids[off])
                self._kv[first : first + length] = src[off : off + length]
            pull.got[pos : pos + n] = True
            pos += n
        self._stats.bytes_received += (pos - msg.start) * block_bytes
        return True

    def _on_tick(self, now: float) -> None:
        outbox, self._outbox = self._outbox, []
        for peer, msg in outbox:
            self._send(peer, msg)
        for tid, pull in list(self._pulls.items()):
            if pull.pulling and pull.deadline < now:
                self._fail(tid, TIMEOUT, now)
        if now >= self._next_heartbeat:
            by_peer: dict[tuple[str, int], list[str]] = collections.defaultdict(list)
            for tid, pull in self._pulls.items():
                by_peer[pull.peer].append(tid)
            for peer, tids in by_peer.items():
                for i in range(0, len(tids), MAX_IDS_PER_MESSAGE):
                    part = tids[i:i + MAX_IDS_PER_MESSAGE]
                    self._send(peer, Heartbeat(part, [self._pulls[t].token for t in part]))
            self._next_heartbeat = now + self._heartbeat_interval()
        self._close_idle_peers(now)

    def _close_idle_peers(self, now: float) -> None:
        """A producer this engine has no transfer with and has not talked to for
        IDLE_PEER_S loses its socket (a D that saw many producers keeps none forever)."""
        busy = {pull.peer for pull in self._pulls.values()}
        for peer, used in list(self._peer_used.items()):
            if peer not in busy and now - used > IDLE_PEER_S:
                del self._peer_used[peer]
                sock = self._sockets.pop(peer, None)
                if sock is not None:
                    self._poller.unregister(sock)
                    del self._peers[sock]
                    sock.close(linger=0)

    def _schedule_heartbeat(self, lease_s: float | None) -> None:
        if lease_s:  # a short lease must not wait for a heartbeat scheduled for longer ones
            self._next_heartbeat = min(self._next_heartbeat, time.monotonic() + lease_s / 3)

    def _heartbeat_interval(self) -> float:
        """A third of the shortest lease, so two heartbeats may be lost before P expires it."""
        leases = [p.lease_s for p in self._pulls.values() if p.lease_s]
        return min([self._heartbeat_s, *(lease / 3 for lease in leases)])

    def _poll_timeout_ms(self) -> int:
        with self._lock:
            if self._outbox:
                return 0
            deadlines = [self._next_heartbeat, *(p.deadline for p in self._pulls.values() if p.pulling)]
        wait = min(MAX_POLL_MS / 1e3, min(deadlines) - time.monotonic())
        return int(max(0.0, wait) * 1e3) + 1
