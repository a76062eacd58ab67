"""The KV events publisher: what one engine rank's prefix cache holds, told over ZMQ the
way vLLM's `ZmqEventPublisher` tells it, so any consumer written for vLLM's events
(this project's router, Dynamo, llm-d) can follow an atomd engine.

Wire (docs/design.md "KV events"):

- PUB socket bound at `--kv-events-endpoint`: one multipart message per engine step that
  changed the cache, `[topic, seq (8 bytes, big-endian, unsigned), payload]`, payload the
  msgpack of `EventBatch(ts, events, data_parallel_rank)` (kv_transfer/events.py: arrays,
  events tagged by class name, vLLM's field order). `seq` counts from 0 per publisher; the
  first batch (seq 0) is `[AllBlocksCleared()]`, so a consumer that sees seq go back to 0
  knows the engine restarted with an empty cache. An empty batch goes out after
  HEARTBEAT_S without one, so a consumer can tell an idle engine from a dead one.
- ROUTER socket bound at `--kv-events-replay-endpoint` (optional): a request
  `[b"", start_seq (8 bytes big-endian)]` (from a DEALER; a REQ socket adds the empty
  frame itself) is answered with `[b"", seq, payload]` for every buffered batch whose seq
  is >= start_seq, in order, then `[b"", (-1 as 8 signed bytes), b""]`. At most
  REPLAYS_PER_S requests a second are served (a burst of as many); the rest get the end
  marker alone at once.
- The last `--kv-events-buffer-steps` batches are kept for replay.
- With the KV secret (`--kv-params-secret-file`) both sockets are ZMQ CURVE servers keyed
  by it (kv_transfer/trust.py `kv_events_curve_keys`): the stream is encrypted, and a ZAP
  handler on the I/O thread admits only a client presenting the client public key derived
  from the same secret; any other peer never completes the handshake and gets nothing.
  Without a secret the wire is vLLM's, in the clear and open to anyone who reaches it.

The engine thread only encodes a batch and hands it to an in-process queue (a ZMQ inproc
PUSH with a bound; nothing blocks: a batch that does not fit is dropped and counted); one
I/O thread owns the PUB, ROUTER and ZAP sockets, numbers the batches, serves replays and
answers the CURVE handshakes' ZAP requests. A slow
subscriber costs nothing: PUB drops what exceeds its high-water mark for that subscriber
(who then sees a gap in seq and asks the replay socket).

Under DP every rank runs its own publisher: `kv_events_endpoint` is already rank r's
(atomd/api/core_client.py adds r to the port); the replay endpoint's port gets + r here.
"""
from __future__ import annotations

import hmac
import logging
import re
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq
from zmq.utils import z85

from contracts.block_hash import ALGO
from kv_transfer.events import AllBlocksCleared, EventBatch, KVEvent
from kv_transfer.trust import kv_events_curve_keys

logger = logging.getLogger("atomd.engine.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
HEARTBEAT_S = 2.0  # an empty batch after this long without one
SNDHWM = 100_000  # per subscriber, in messages
MAX_QUEUE = 100_000  # batches between the engine thread and the I/O thread
HASH_ALGO = ALGO  # how BlockStored hashes are made (contracts/block_hash.py)
REPLAYS_PER_S = 20  # replay requests served a second (and the burst); the rest get the end marker
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks who may complete a handshake (RFC 27)
ZAP_DOMAIN = b"atomd-kv-events"


def offset_port(endpoint: str | None, rank: int) -> str | None:
    """`tcp://host:P` -> `tcp://host:P+rank` (ipc/inproc: a `_dpR` suffix)."""
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    m = re.fullmatch(r"(.*:)(\d+)", endpoint)
    if m is None:
        raise ValueError(f"a KV events endpoint must end in :PORT with data_parallel_size > 1, got {endpoint!r}")
    return f"{m.group(1)}{int(m.group(2)) + rank}"


class KVEventPublisher:
    """PUB + replay ROUTER for one engine rank. Construct in the engine thread; `publish`
    is called from that thread only; `close` stops the I/O thread."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, dp_rank: int = 0, block_size: int = 16,
                 heartbeat_s: float = HEARTBEAT_S, extra_info: dict[str, Any] | None = None,
                 secret: bytes | None = None, replays_per_s: float = REPLAYS_PER_S):
        if buffer_steps < 1:
            raise ValueError(f"kv_events_buffer_steps must be >= 1, got {buffer_steps}")
        self.topic = topic.encode()
        self.dp_rank = dp_rank
        self.block_size = block_size
        self.heartbeat_s = heartbeat_s
        self.extra_info = dict(extra_info or {})
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.num_published = 0
        self.num_dropped = 0
        self.num_replays = 0
        self.num_replays_refused = 0  # malformed
        self.num_replays_throttled = 0  # over replays_per_s
        self.num_auth_refused = 0  # CURVE handshakes with a client key not derived from the secret
        self.keys = kv_events_curve_keys(secret) if secret is not None else None
        self.replays_per_s = replays_per_s
        self._replay_budget, self._budget_t = float(replays_per_s), time.monotonic()
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, SNDHWM)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        self._zap: zmq.Socket | None = None
        if self.keys is not None:  # bound before the sockets it guards: no handshake gets past it
            self._zap = self._ctx.socket(zmq.REP)
            self._zap.setsockopt(zmq.LINGER, 0)
            self._zap.bind(ZAP_ENDPOINT)
        self._curve_server(self._pub)
        inproc = f"inproc://kv-events-{id(self)}"
        self._queue_in = self._ctx.socket(zmq.PULL)
        self._queue_in.bind(inproc)
        self._queue = self._ctx.socket(zmq.PUSH)
        self._queue.setsockopt(zmq.SNDHWM, MAX_QUEUE)
        self._queue.setsockopt(zmq.LINGER, 0)
        self._queue.connect(inproc)
        try:
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._curve_server(self._replay)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"cannot bind the KV events socket ({endpoint}, replay {replay_endpoint}): {e}") from None
        self._stop = threading.Event()
        # seq 0: the cache starts empty (a consumer that sees seq restart clears this rank)
        self._queue.send(self._encoder.encode(EventBatch(time.time(), [AllBlocksCleared()], dp_rank)))
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{dp_rank}", daemon=True)
        self._thread.start()

    def _curve_server(self, sock: zmq.Socket) -> None:
        """With the secret: `sock` is a CURVE server keyed by it, its handshakes asked of our ZAP."""
        if self.keys is None:
            return
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.server_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.server_public)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)

    # ------------------------------------------------------------------ engine thread

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one step's events (nothing to do for none). Never blocks."""
        if not events:
            return
        payload = self._encoder.encode(EventBatch(time.time(), events, self.dp_rank))
        try:
            self._queue.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning("KV events: the publisher queue is full, %d batches dropped", self.num_dropped)

    def info(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "topic": self.topic.decode(), "dp_rank": self.dp_rank, "block_size": self.block_size,
                "hash": HASH_ALGO, "buffer_steps": self.buffer.maxlen, "published": self.num_published,
                "dropped": self.num_dropped, "auth": "curve" if self.keys is not None else "none",
                "server_key": self.keys.server_public.decode() if self.keys is not None else None,
                "auth_refused": self.num_auth_refused,
                **self.extra_info}

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (for up to `timeout_s`), then stop."""
        if self._thread.is_alive():
            try:
                self._queue.send(b"", zmq.NOBLOCK)  # the stop marker, after everything queued
            except zmq.Again:
                self._stop.set()
            self._thread.join(timeout_s)
            self._stop.set()
            self._thread.join(timeout_s)
        if self._thread.is_alive():  # stuck in a send: tear the sockets down under it
            self._ctx.destroy(linger=0)
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._queue, self._queue_in, self._pub, self._replay, self._zap):
            if s is not None:
                s.close(linger=0)
        self._ctx.term()

    # ------------------------------------------------------------------ I/O thread

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._queue_in, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        if self._zap is not None:
            poller.register(self._zap, zmq.POLLIN)
        seq = 0
        last_send = time.monotonic()
        timeout_ms = max(1, int(self.heartbeat_s * 1000))
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(min(timeout_ms, 200)))
                if self._zap is not None and self._zap in ready:
                    self._answer_zap()
                if self._replay is not None and self._replay in ready:
                    self._serve_replays()
                if self._queue_in in ready:
                    while True:  # drain: batches keep their order
                        try:
                            payload = self._queue_in.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if not payload:
                            return  # close(): everything before the marker went out
                        self._send(seq, payload)
                        seq += 1
                        last_send = time.monotonic()
                elif time.monotonic() - last_send >= self.heartbeat_s:
                    self._send(seq, self._encoder.encode(EventBatch(time.time(), [], self.dp_rank)))
                    seq += 1
                    last_send = time.monotonic()
        except zmq.ZMQError as e:  # the context went away under us: shutting down
            if e.errno != zmq.ETERM:
                logger.exception("KV events publisher stopped")
        except Exception:
            logger.exception("KV events publisher stopped")

    def _send(self, seq: int, payload: bytes) -> None:
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), copy=False)
        self.buffer.append((seq, payload))
        self.num_published += 1

    def _serve_replays(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                self.num_replays_refused += 1
                if self.num_replays_refused % 1000 == 1:
                    logger.warning("KV events: malformed replay request (%d frames; %d refused so far)",
                                   len(frames), self.num_replays_refused)
                continue
            client, start = frames[0], frames[2]
            if not self._may_replay():
                self._replay.send_multipart((client, b"", END_SEQ, b""))
                continue
            start_seq = int.from_bytes(start, "big")
            self.num_replays += 1
            for seq, payload in list(self.buffer):
                if seq >= start_seq:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _may_replay(self) -> bool:
        """The rate allows one more."""
        now = time.monotonic()
        self._replay_budget = min(float(self.replays_per_s),
                                  self._replay_budget + (now - self._budget_t) * self.replays_per_s)
        self._budget_t = now
        if self._replay_budget < 1:
            self.num_replays_throttled += 1
            return False
        self._replay_budget -= 1
        return True

    def _answer_zap(self) -> None:
        """ZAP (RFC 27): admit a CURVE handshake only with the client key derived from the
        secret. The requests come from libzmq, one per handshake: REP answers each in turn."""
        assert self._zap is not None and self.keys is not None
        client_key = z85.decode(self.keys.client_public)
        while True:
            try:
                frames = self._zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            request_id = frames[1] if len(frames) > 1 else b""
            ok = (len(frames) == 7 and frames[0] == b"1.0" and frames[5] == b"CURVE"
                  and hmac.compare_digest(frames[6], client_key))
            if not ok:
                self.num_auth_refused += 1
                if self.num_auth_refused % 1000 == 1:
                    logger.warning("KV events: a peer without the KV secret's client key was refused "
                                   "(%d so far)", self.num_auth_refused)
            self._zap.send_multipart((b"1.0", request_id, b"200" if ok else b"400",
                                      b"OK" if ok else b"not keyed by the KV secret", b"", b""))
