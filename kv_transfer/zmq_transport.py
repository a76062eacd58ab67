"""ZMQ side channel: D pulls a transfer's pinned KV blocks from P (docs/design.md, "Side channel").

Every message is `[header, *payload]`; the header is a msgpack tagged struct, the payload
frames are raw block bytes.

    D -> P  READ {transfer_id, access_token, block_ids, compat, backend}
    P -> D  DATA {transfer_id, start, counts} + one frame per count (counts[i] blocks), ...
    P -> D  END {transfer_id, num_blocks}       after every DATA frame left P's memory
    D -> P  DONE {transfer_id, access_token}    P frees the blocks (idempotent)
    D -> P  HEARTBEAT {transfer_ids, access_tokens}  P renews the leases
    D -> P  ABORT {transfer_id, access_token}   P frees now
    P -> D  ERROR {transfer_id, code, message}  refused: bad token, foreign blocks, compat, ...
    P -> D  REFUSED {[[transfer_id, code]]}     a HEARTBEAT's ids P does not hold, in one reply
    D -> P  HELLO {backend}                     handshake: P answers WELCOME {backend, instance, info}

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

Producer (P), `KVSender`: `grant()` pins a transfer's blocks under a lease; exactly one
of DONE / ABORT / `revoke()` / lease expiry releases it; the engine thread polls
`take_released()` and frees the blocks itself (its scheduler is not thread-safe).
Consumer (D), `KVReceiver`: `hold()` keeps a waiting transfer's lease alive, `start_pull()`
pulls it, `abort()` gives it up; every id handed to hold/start_pull comes back exactly once
from `take_finished()`, as finished or as failed, and only then may its local blocks be
reused. `abort()` is also a write barrier: once it returns, nothing writes that
transfer's blocks any more.

Both run one I/O thread that owns every socket; the engine-facing methods only touch
state under a lock and wake that thread.

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
import socket
import threading
import time
from typing import Annotated, Any

import msgspec
import numpy as np
import zmq

from kv_transfer import faults as _faults
from kv_transfer.params import compat_mismatch

log = logging.getLogger(__name__)

# ERROR codes (P -> D) and the receiver's own failure reasons.
BAD_TOKEN = "bad_token"
FOREIGN_BLOCKS = "foreign_blocks"
COMPAT_MISMATCH = "compat_mismatch"
UNKNOWN_TRANSFER = "unknown_transfer"
MALFORMED = "malformed"
PEER_GONE = "peer_gone"
TIMEOUT = "timeout"
PEER_PING_MS, PEER_DEAD_MS = 1000, 3000  # D's pings to each P, and the silence that drops the connection
INCOMPLETE = "incomplete"
# Release reasons (P), also sent as ERROR codes for late messages about a released transfer.
DONE = "done"
ABORTED = "aborted"
EXPIRED = "expired"
REVOKED = "revoked"
# P and D run different data planes (--kv-transfer-backend, or Mooncake's protocol)
BACKEND_MISMATCH = "backend_mismatch"

DEFAULT_MAX_MESSAGE_BYTES = 8 << 20  # tcp loopback peaks with 4-16 MiB frames (docs/design.md, "CPU facts")
_MAX_POLL_MS = 100  # lease/timeout checks run at least this often
_BUSY_POLL_MS = 1  # while waiting for zmq to let go of sent frames
_MAX_TOMBSTONES = 1 << 16
MAX_CONTROL_BYTES = 4 << 20  # P's inbound messages (control only: READ's block ids at most)
MAX_DATA_FRAME_BYTES = 64 << 20  # D's inbound frames (DATA payload; raised to one block when larger)
MAX_IDS_PER_MESSAGE = 4096  # transfer ids in one HEARTBEAT
LOG_PER_S = 5  # refusal log lines per second; the rest are counted (stats().failures)
IDLE_PEER_S = 60.0  # D closes a producer's socket unused for this long

Ident = Annotated[str, msgspec.Meta(max_length=256)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
BlockIds = Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=1 << 18)]


class _Msg(msgspec.Struct, tag_field="kind", array_like=True):
    pass


class Read(_Msg, tag="READ"):
    transfer_id: Ident
    access_token: Ident
    block_ids: BlockIds
    compat: Annotated[dict[str, Any], msgspec.Meta(max_length=64)]
    backend: Ident = "zmq"  # the consumer's data plane; P refuses any other than its own


class Data(_Msg, tag="DATA"):
    transfer_id: str
    start: int  # position in the READ's block_ids of the first block of the first frame
    counts: list[int]  # blocks per payload frame


class End(_Msg, tag="END"):
    transfer_id: str
    num_blocks: int


class Done(_Msg, tag="DONE"):
    transfer_id: Ident
    access_token: Ident = ""


class Heartbeat(_Msg, tag="HEARTBEAT"):
    transfer_ids: Annotated[list[Ident], msgspec.Meta(max_length=MAX_IDS_PER_MESSAGE)]
    access_tokens: Annotated[list[Ident], msgspec.Meta(max_length=MAX_IDS_PER_MESSAGE)] = []  # one per id


class Abort(_Msg, tag="ABORT"):
    transfer_id: Ident
    access_token: Ident = ""


class Error(_Msg, tag="ERROR"):
    transfer_id: Ident
    code: Ident
    message: Text = ""


class Refused(_Msg, tag="REFUSED"):
    """P -> D: the ids of one HEARTBEAT that P does not hold, with the reason of each."""

    refusals: Annotated[list[tuple[Ident, Ident]], msgspec.Meta(max_length=MAX_IDS_PER_MESSAGE)]


class Hello(_Msg, tag="HELLO"):
    """D -> P handshake, once per producer before the first READ of a one-sided data plane."""

    backend: str


class Welcome(_Msg, tag="WELCOME"):
    """P's handshake answer: its backend, an id of this sender instance (a restarted P has
    another), and what the data plane needs (Mooncake: session port, buffer base, geometry)."""

    backend: str
    instance: str
    info: dict[str, Any] = {}


class Ready(_Msg, tag="READY"):
    """P -> D, one-sided data planes: the READ passed every check and its blocks may be read now."""

    transfer_id: str
    instance: str
    num_blocks: int


Message = Read | Data | End | Done | Heartbeat | Abort | Error | Hello | Welcome | Ready | Refused
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


def decode(buf: bytes | memoryview) -> Message:
    """Raises msgspec.DecodeError (or ValidationError) for anything that is not a header."""
    return _decoder.decode(buf)


def block_runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """(position, length) of each run of consecutive ids, in order."""
    if len(ids) == 0:
        return []
    breaks = (np.flatnonzero(np.diff(ids) != 1) + 1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, len(ids)]
    return [(a, b - a) for a, b in zip(starts, ends)]


def plan_messages(block_ids: np.ndarray, blocks_per_message: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """Split a READ into DATA messages: (start position, [(first block id, count) per frame]).

    Runs of consecutive ids become one frame each, split so no message carries more than
    `blocks_per_message` blocks; short runs share a message, so frames stay few and large.
    """
    # Even out the messages (256 blocks at 85 per message: 4 x 64, not 85, 85, 85, 1).
    num_messages = -(-len(block_ids) // blocks_per_message)
    blocks_per_message = -(-len(block_ids) // num_messages) if num_messages else blocks_per_message
    messages, frames, filled, start = [], [], 0, 0
    for pos, length in block_runs(block_ids):
        first, done = int(block_ids[pos]), 0
        while done < length:
            n = min(blocks_per_message - filled, length - done)
            frames.append((first + done, n))
            filled += n
            done += n
            if filled == blocks_per_message:
                messages.append((start, frames))
                start, frames, filled = start + filled, [], 0
    if frames:
        messages.append((start, frames))
    return messages


def _check_kv(kv_blocks: np.ndarray) -> None:
    if not (isinstance(kv_blocks, np.ndarray) and kv_blocks.dtype == np.uint8 and kv_blocks.ndim == 2):
        raise ValueError("kv_blocks must be a numpy uint8 array [num_blocks, block_bytes]")
    if not kv_blocks.flags.c_contiguous:
        raise ValueError("kv_blocks must be C-contiguous (one block = one contiguous row)")


def _check_block_ids(name: str, ids: list[int], num_blocks: int) -> np.ndarray:
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if len(arr) and (arr.min() < 0 or arr.max() >= num_blocks):
        raise ValueError(f"{name} must lie in [0, {num_blocks}), got {ids}")
    return arr


class _RateLimitedLog:
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


class _IOLoop:
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


# ----------------------------------------------------------------------------- producer


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


class KVSender(_IOLoop):
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
        _check_kv(kv_blocks)
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
        self._log = _RateLimitedLog()
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
        ids = _check_block_ids("block_ids", block_ids, len(self._kv))
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
        if len(self._tombstones) > _MAX_TOMBSTONES:
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

    def _send(self, rid: bytes, msg: _Msg) -> bool:
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
        mismatch = compat_mismatch(self._compat, msg.compat)
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
                tracker.wait(_BUSY_POLL_MS / 1e3)
            except zmq.NotDone:
                pass

    def _poll_timeout_ms(self) -> int:
        with self._lock:
            if self._draining or any(g.serves for g in self._grants.values()):
                return 0  # _idle() then waits on the frames themselves
            if not self._grants:
                return _MAX_POLL_MS
            next_deadline = min(g.deadline for g in self._grants.values())
        return int(max(0.0, min(_MAX_POLL_MS / 1e3, next_deadline - time.monotonic())) * 1e3) + 1


# ----------------------------------------------------------------------------- consumer


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


class KVReceiver(_IOLoop):
    """D's side channel: pulls transfers from P engines into local blocks.

    `timeout_s` of a pull is a receive timeout: the longest P may stay silent (no DATA
    or END) before the pull fails with "timeout", so a large transfer that keeps moving
    never times out.
    """

    backend = "zmq"
    _pull_type = _Pull

    def __init__(self, kv_blocks: np.ndarray, compat: dict[str, Any], *, heartbeat_s: float = 5.0, rcvhwm: int = 8) -> None:
        _check_kv(kv_blocks)
        if not kv_blocks.flags.writeable:
            raise ValueError("kv_blocks must be writeable")
        super().__init__("kv-receiver")
        self._kv = kv_blocks
        self._compat = dict(compat)
        self._heartbeat_s = heartbeat_s
        self._rcvhwm = rcvhwm  # DATA messages buffered per peer: bounds D's memory per P
        self._cond = threading.Condition(self._lock)
        self._pulls: dict[str, _Pull] = {}
        self._outbox: list[tuple[tuple[str, int], _Msg]] = []
        self._finished: list[str] = []
        self._failed: list[tuple[str, str]] = []
        self._seconds: list[float] = []
        self._sockets: dict[tuple[str, int], zmq.Socket] = {}
        self._peers: dict[zmq.Socket, tuple[str, int]] = {}
        self._peer_used: dict[tuple[str, int], float] = {}  # last send: idle sockets are closed
        self._max_frame_bytes = max(MAX_DATA_FRAME_BYTES, 2 * kv_blocks.shape[1])
        self._log = _RateLimitedLog()
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
        local = _check_block_ids("local_block_ids", local_block_ids, len(self._kv))
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

    def _send(self, peer: tuple[str, int], msg: _Msg) -> None:
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
        wait = min(_MAX_POLL_MS / 1e3, min(deadlines) - time.monotonic())
        return int(max(0.0, wait) * 1e3) + 1
