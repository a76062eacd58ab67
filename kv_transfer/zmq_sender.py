"""P's side of the ZMQ side channel (kv_transfer/zmq_transport.py).

Producer (P), `KVSender`: `grant()` pins a transfer's blocks under a lease; exactly one
of DONE / ABORT / `revoke()` / lease expiry releases it; the engine thread polls
`take_released()` and frees the blocks itself (its scheduler is not thread-safe).

Hostile peers (issue 42): every message that changes a transfer's state (READ, DONE, ABORT,
HEARTBEAT) carries its access token and does nothing without it; inbound messages are
bounded by zmq (MAXMSGSIZE: a larger one drops the connection) and by field (ids,
strings, ids per message); a HEARTBEAT's unknown ids get one REFUSED reply; refusals are
logged at most LOG_PER_S times a second; D closes a producer's socket idle for IDLE_PEER_S.
"""
from __future__ import annotations

import collections
import hmac
import logging
import secrets
import time
from typing import Any

import msgspec
import numpy as np
import zmq

from kv_transfer import faults as _faults
from kv_transfer.params import compat_mismatch
from kv_transfer.side_channel import (ABORTED, Abort, BACKEND_MISMATCH, BAD_TOKEN, COMPAT_MISMATCH,
                                      DEFAULT_MAX_MESSAGE_BYTES, DONE, Data, Done, EXPIRED, End, Error,
                                      FOREIGN_BLOCKS, Heartbeat, Hello, MALFORMED, MAX_CONTROL_BYTES, Msg,
                                      PEER_GONE, REVOKED, Read, Refused, UNKNOWN_TRANSFER, Welcome, decode,
                                      encode, plan_messages)
from kv_transfer.zmq_transport import (BUSY_POLL_MS, IOLoop, MAX_POLL_MS, MAX_TOMBSTONES, RateLimitedLog,
                                       check_block_ids, check_kv)

log = logging.getLogger(__name__)


class SenderStats(msgspec.Struct):
    bytes_sent: int = 0
    transfers_served: int = 0  # READs answered with END
    heartbeats: int = 0
    leases_expired: int = 0
    blocks_pinned: int = 0  # granted and not yet handed back by take_released()
    drains_forced: int = 0  # released while zmq still held frames past drain_s
    failures: dict[str, int] = {}  # refusals by ERROR code
    released: dict[str, int] = {}  # releases by reason


class _Serve:
    """One READ being answered: END goes out once zmq let go of every DATA frame."""

    __slots__ = ("rid", "trackers", "num_blocks", "nbytes")

    def __init__(self, rid: bytes, num_blocks: int, nbytes: int) -> None:
        self.rid, self.num_blocks, self.nbytes = rid, num_blocks, nbytes
        self.trackers: collections.deque[zmq.MessageTracker] = collections.deque()

    def sent(self) -> bool:
        while self.trackers and self.trackers[0].done:
            self.trackers.popleft()
        return not self.trackers


class _Grant:
    __slots__ = ("block_ids", "block_set", "token", "lease_s", "deadline", "serves")

    def __init__(self, block_ids: np.ndarray, token: str, lease_s: float, now: float) -> None:
        self.block_ids = block_ids
        self.block_set = frozenset(block_ids.tolist())
        self.token = token.encode()
        self.lease_s = lease_s
        self.deadline = now + lease_s
        self.serves: list[_Serve] = []


class KVSender(IOLoop):
    """P's side channel: one ROUTER socket serving granted, pinned blocks to their holders.

    A released transfer's frames may still sit in zmq's queue (zero-copy, they point into
    the KV cache); its release is reported only once zmq let go of them (or after
    `drain_s`, for a peer that stopped reading), and END is never sent after a release,
    so D never accepts bytes read from a block that was reused.
    """

    backend = "zmq"

    def __init__(
        self,
        kv_blocks: np.ndarray,
        compat: dict[str, Any],
        host: str = "127.0.0.1",
        port: int = 0,
        engine_id: str | None = None,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        copy_below_bytes: int = 256 << 10,
        drain_s: float = 2.0,
    ) -> None:
        if host.strip("[]") in ("", "*", "0.0.0.0", "::"):  # D would dial its own host
            raise ValueError(f"the KV side channel host must be an address decode engines can reach, "
                             f"not the wildcard {host!r}: --kv-side-channel-host is what P advertises to D")
        check_kv(kv_blocks)
        super().__init__("kv-sender")
        self._kv = kv_blocks
        self._compat = dict(compat)
        self._blocks_per_message = max(1, max_message_bytes // kv_blocks.shape[1])
        # A transfer this small is copied into zmq: cheaper than tracking when zmq lets go of
        # zero-copy frames (END waits for that), and then nothing points into the cache.
        self._copy_below_bytes = copy_below_bytes
        self._drain_s = drain_s
        self._grants: dict[str, _Grant] = {}
        self._tombstones: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._draining: dict[str, tuple[_Grant, str, float]] = {}
        self._released: list[tuple[str, str, int]] = []
        self._stats = SenderStats()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a gone peer raises, never drops silently
        self._sock.setsockopt(zmq.SNDHWM, 0)  # frames are zero-copy: queueing them costs no memory
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)  # a larger one drops that peer
        self._log = RateLimitedLog()
        try:
            if port == 0:
                port = self._sock.bind_to_random_port(f"tcp://{host}")
            else:
                self._sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            self.close()
            # P advertises this address to D (remote_host): it must be one of this host's own
            raise ValueError(f"cannot bind the KV side channel at tcp://{host}:{port or '*'} "
                             f"({zmq.strerror(e.errno)}): --kv-side-channel-host must be an address of this "
                             f"host that decode engines can reach") from None
        self._address = (host, port)
        self.engine_id = engine_id or f"{host}:{port}"
        self.instance = secrets.token_hex(8)  # told in the handshake: a restarted P is another peer
        self._poller.register(self._sock, zmq.POLLIN)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return self._address

    # Engine-thread API.

    def grant(self, transfer_id: str, block_ids: list[int], access_token: str, lease_s: float) -> None:
        """Pin `block_ids` for `transfer_id`: served to the holder of `access_token` until released."""
        ids = check_block_ids("block_ids", block_ids, len(self._kv))
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        if not access_token:
            raise ValueError("access_token must be non-empty")
        with self._lock:
            if transfer_id in self._grants or transfer_id in self._tombstones or transfer_id in self._draining:
                raise ValueError(f"transfer_id {transfer_id!r} was already granted")
            self._grants[transfer_id] = _Grant(ids, access_token, lease_s, time.monotonic())
            self._stats.blocks_pinned += len(ids)
        self._wake()

    def revoke(self, transfer_id: str) -> bool:
        """Local abort (e.g. the router's POST /kv_transfer/abort); False if not live.

        An id not granted yet is remembered (a tombstone), so that a later `grant` of it is
        refused: the router's abort can overtake the prefill it gives up (a client gone while
        P computes the prompt), and that prefill must then free its blocks at once instead of
        pinning them for a whole lease."""
        with self._lock:
            live = transfer_id in self._grants
            if live:
                self._release(transfer_id, REVOKED, time.monotonic())
            elif transfer_id not in self._tombstones and transfer_id not in self._draining:
                self._tombstone(transfer_id, REVOKED)
        self._wake()
        return live

    def take_released(self) -> list[tuple[str, str]]:
        """(transfer_id, reason) released since the last call; the caller frees their blocks now."""
        with self._lock:
            out, self._released = self._released, []
            self._stats.blocks_pinned -= sum(n for _, _, n in out)
        return [(tid, reason) for tid, reason, _ in out]

    def stats(self) -> SenderStats:
        with self._lock:
            s = self._stats
            return msgspec.structs.replace(s, failures=dict(s.failures), released=dict(s.released))

    # I/O thread.

    def _release(self, tid: str, reason: str, now: float) -> None:
        grant = self._grants.pop(tid)
        self._tombstone(tid, reason)
        self._stats.released[reason] = self._stats.released.get(reason, 0) + 1
        self._draining[tid] = (grant, reason, now + self._drain_s)

    def _tombstone(self, tid: str, reason: str) -> None:
        self._tombstones[tid] = reason
        if len(self._tombstones) > MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)

    def _refuse(self, rid: bytes, tid: str, code: str, message: str = "") -> None:
        self._stats.failures[code] = self._stats.failures.get(code, 0) + 1
        self._log(logging.INFO, "kv-sender: refusing %s: %s %s", tid[:64], code, message)
        self._send(rid, Error(tid, code, message))

    def _holder(self, tid: str, token: str) -> _Grant | None:
        """The live grant of `tid` when `token` is its access token, else None."""
        grant = self._grants.get(tid)
        if grant is None or not hmac.compare_digest(token.encode(), grant.token):
            return None
        return grant

    def _send(self, rid: bytes, msg: Msg) -> bool:
        try:
            self._sock.send_multipart([rid, encode(msg)], zmq.NOBLOCK)
            return True
        except zmq.ZMQError:  # EHOSTUNREACH: that peer disconnected
            self._stats.failures[PEER_GONE] = self._stats.failures.get(PEER_GONE, 0) + 1
            return False

    def _on_message(self, sock: zmq.Socket, frames: list[zmq.Frame]) -> None:
        rid = frames[0].bytes
        try:
            msg = decode(frames[1].buffer)
        except (IndexError, msgspec.DecodeError):  # ValidationError (a field over its bound) included
            self._refuse(rid, "", MALFORMED, "undecodable header")
            return
        now = time.monotonic()
        if isinstance(msg, Read):
            self._on_read(rid, msg, now)
        elif isinstance(msg, Done):  # late, duplicate or without the token: nothing to do
            if self._holder(msg.transfer_id, msg.access_token) is not None:
                self._on_done(rid, msg.transfer_id, now)
        elif isinstance(msg, Abort):
            if self._holder(msg.transfer_id, msg.access_token) is not None:
                self._release(msg.transfer_id, ABORTED, now)
        elif isinstance(msg, Hello):
            self._send(rid, Welcome(self.backend, self.instance, self._handshake_info()))
        elif isinstance(msg, Heartbeat):
            self._stats.heartbeats += 1
            refusals = []
            for tid, token in zip(msg.transfer_ids, [*msg.access_tokens, *[""] * len(msg.transfer_ids)]):
                grant = self._holder(tid, token)
                if grant is not None:
                    grant.deadline = now + grant.lease_s
                elif tid in self._grants:  # someone else's: neither renewed nor answered
                    continue
                elif self._tombstones.get(tid) != DONE:  # tell a waiting D at once, not at its timeout
                    refusals.append((tid, self._tombstones.get(tid, UNKNOWN_TRANSFER)))
            if refusals:  # one reply, one log line, whatever the count
                for _, code in refusals:
                    self._stats.failures[code] = self._stats.failures.get(code, 0) + 1
                self._log(logging.INFO, "kv-sender: heartbeat names %d transfers not held here", len(refusals))
                self._send(rid, Refused(refusals))
        else:
            self._refuse(rid, getattr(msg, "transfer_id", ""), MALFORMED, f"unexpected {type(msg).__name__}")

    def _on_read(self, rid: bytes, msg: Read, now: float) -> None:
        if _faults.ACTIVE:
            _faults.point("between_legs")
        tid = msg.transfer_id
        if msg.backend != self.backend:
            self._refuse(rid, tid, BACKEND_MISMATCH,
                         f"this producer serves KV over {self.backend!r}, the consumer pulls over {msg.backend!r}: "
                         "start both engines with the same --kv-transfer-backend")
            return
        grant = self._grants.get(tid)
        if grant is None:
            self._refuse(rid, tid, self._tombstones.get(tid, UNKNOWN_TRANSFER))
            return
        if not hmac.compare_digest(msg.access_token.encode(), grant.token):
            self._refuse(rid, tid, BAD_TOKEN)
            return
        mismatch = compat_mismatch(self._compat, msg.compat, peer="consumer")
        if mismatch:
            self._refuse(rid, tid, COMPAT_MISMATCH, mismatch)
            return
        foreign = [b for b in msg.block_ids if b not in grant.block_set]
        if foreign:
            self._refuse(rid, tid, FOREIGN_BLOCKS, f"not granted to this transfer: {foreign[:8]}")
            return
        grant.deadline = now + grant.lease_s
        serve = self._serve(rid, tid, np.asarray(msg.block_ids, dtype=np.int64))
        if serve is not None:
            grant.serves.append(serve)

    # Data plane (ZMQ): a checked READ is answered with DATA frames, END once zmq let go of them.

    def _handshake_info(self) -> dict[str, Any]:
        """What a consumer learns in WELCOME besides the backend and instance."""
        return {}

    def _on_done(self, rid: bytes, tid: str, now: float) -> None:
        if tid in self._grants:  # late or duplicate: the tombstone says it's done
            self._release(tid, DONE, now)

    def _serve(self, rid: bytes, tid: str, ids: np.ndarray) -> _Serve | None:
        """Answer a READ that passed every check; a returned _Serve is tracked until sent()."""
        serve = _Serve(rid, len(ids), len(ids) * self._kv.shape[1])
        zero_copy = serve.nbytes >= self._copy_below_bytes
        try:
            for start, frames in plan_messages(ids, self._blocks_per_message):
                header = encode(Data(tid, start, [n for _, n in frames]))
                self._sock.send_multipart([rid, header], zmq.SNDMORE | zmq.NOBLOCK)
                for i, (first, n) in enumerate(frames):
                    more = zmq.SNDMORE if i + 1 < len(frames) else 0
                    view = memoryview(self._kv[first : first + n]).cast("B")
                    if zero_copy:
                        serve.trackers.append(self._sock.send(view, more | zmq.NOBLOCK, copy=False, track=True))
                    else:
                        self._sock.send(view, more | zmq.NOBLOCK, copy=True)
                if _faults.ACTIVE and start == 0:
                    _faults.point("kv_pull_mid")
        except zmq.ZMQError:
            self._stats.failures[PEER_GONE] = self._stats.failures.get(PEER_GONE, 0) + 1
            serve.num_blocks = -1  # never END a partial answer
        return serve

    def _on_tick(self, now: float) -> None:
        for tid, grant in list(self._grants.items()):
            pending = []
            for serve in grant.serves:
                if not serve.sent():
                    pending.append(serve)
                elif serve.num_blocks >= 0 and self._send(serve.rid, End(tid, serve.num_blocks)):
                    self._stats.bytes_sent += serve.nbytes
                    self._stats.transfers_served += 1
            grant.serves = pending
            if grant.deadline < now:
                self._stats.leases_expired += 1
                self._release(tid, EXPIRED, now)
        for tid, (grant, reason, deadline) in list(self._draining.items()):
            drained = all(serve.sent() for serve in grant.serves)
            if drained or deadline < now:
                if not drained:
                    self._stats.drains_forced += 1
                del self._draining[tid]
                self._released.append((tid, reason, len(grant.block_ids)))

    def _idle(self) -> None:
        """Sleep until zmq lets go of the oldest pending frame (END waits for it), at most 1 ms."""
        with self._lock:
            serves = [s for g in self._grants.values() for s in g.serves]
            serves += [s for g, _, _ in self._draining.values() for s in g.serves]
            tracker = next((s.trackers[0] for s in serves if s.trackers), None)
        if tracker is not None:
            try:
                tracker.wait(BUSY_POLL_MS / 1e3)
            except zmq.NotDone:
                pass

    def _poll_timeout_ms(self) -> int:
        with self._lock:
            if self._draining or any(g.serves for g in self._grants.values()):
                return 0  # _idle() then waits on the frames themselves
            if not self._grants:
                return MAX_POLL_MS
            next_deadline = min(g.deadline for g in self._grants.values())
        return int(max(0.0, min(MAX_POLL_MS / 1e3, next_deadline - time.monotonic())) * 1e3) + 1
