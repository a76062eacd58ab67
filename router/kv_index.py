"""What every engine's prefix cache holds, exactly, from its KV events (kv_aware's index).

For each worker the router reads `GET /kv_transfer_info` when the worker enters rotation:
every DP rank reports its `kv_events` (PUB endpoint, replay endpoint, topic, block size,
hash algorithm; atomd/engine/kv_events.py). The index subscribes to each rank and keeps the set
of block hashes it holds, per (worker, dp_rank):

- `BlockStored` adds hashes, `BlockRemoved` drops them, `AllBlocksCleared` empties the set;
- batches carry a sequence number per rank. A gap (a batch lost by PUB/SUB, e.g. the
  subscriber was slow or disconnected) is repaired from the rank's replay socket, asked
  from the last batch applied on: its replayed copy (same seq, same timestamp) proves the
  publisher is the same, and the rest is applied. Otherwise (the buffer no longer reaches
  back, or the engine restarted meanwhile) the set is rebuilt from what the buffer holds.
  A number that goes back with a newer timestamp is an engine restart: the set is cleared
  (the engine's first batch is `AllBlocksCleared` anyway) and rebuilt from its replay; one
  that goes back with a timestamp already seen is a batch a replay applied (skipped);
- the first batch a subscriber sees is followed by a replay from seq 0, so a router that
  starts after the engines learns what they already hold;
- an engine with the KV secret reports `auth: "curve"` and its CURVE server key: the index
  connects with the keys it derives from its own KV secret (kv_transfer/trust.py); without
  the secret, or with another one (the reported key is not the one it derives), that
  worker's events are not followed, the reason is kept in `errors` (`kv_events_error` in
  GET /workers), and kv_aware places its requests by load alone;
- a rank silent for `stale_s` (engines send an empty batch every 2 s) is scored as empty:
  it may have died, and its set may be stale.

`match(worker, rank, hashes)` is the length of the longest prefix of a request's chained
block hashes (contracts/block_hash.py, the engines' own naming) that the rank holds.
"""
from __future__ import annotations

import asyncio
import logging
import time
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from contracts.block_hash import ALGO
from kv_transfer.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kv_transfer.trust import CurveKeys, kv_events_curve_keys

logger = logging.getLogger("atomd.router.kv_index")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_TIMEOUT_S = 2.0
WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "")


class RankState:
    __slots__ = ("worker", "rank", "endpoint", "replay_endpoint", "topic", "block_size", "curve", "hashes",
                 "last_seq", "last_ts", "last_msg", "batches", "gaps", "repaired", "rebuilt", "restarts", "replays",
                 "task")

    def __init__(self, worker: str, rank: int, endpoint: str, replay_endpoint: str | None, topic: str,
                 block_size: int, curve: bool = False):
        self.worker, self.rank, self.curve = worker, rank, curve
        self.endpoint, self.replay_endpoint, self.topic, self.block_size = endpoint, replay_endpoint, topic, block_size
        self.hashes: set[int] = set()
        self.last_seq: int | None = None
        self.last_ts = 0.0  # the publisher's timestamp of that batch
        self.last_msg = 0.0  # monotonic time of the last batch (0: none yet)
        self.batches = self.gaps = self.repaired = self.rebuilt = self.restarts = self.replays = 0
        self.task: asyncio.Task | None = None

    def apply(self, batch: EventBatch) -> None:
        hashes = self.hashes
        for e in batch.events:
            if isinstance(e, BlockStored):
                hashes.update(e.block_hashes)
                self.block_size = e.block_size
            elif isinstance(e, BlockRemoved):
                hashes.difference_update(e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                hashes.clear()
        self.batches += 1

    def describe(self, stale_s: float) -> dict:
        return {"dp_rank": self.rank, "endpoint": self.endpoint, "blocks": len(self.hashes),
                "last_seq": self.last_seq, "stale": is_stale(self, stale_s), "batches": self.batches,
                "gaps": self.gaps, "repaired": self.repaired, "rebuilt": self.rebuilt, "restarts": self.restarts}


def is_stale(st: RankState, stale_s: float) -> bool:
    return st.last_msg == 0.0 or time.monotonic() - st.last_msg > stale_s


def connectable(endpoint: str, worker_url: str) -> str:
    """An endpoint bound to a wildcard address, as the router reaches it: the worker's host."""
    scheme, sep, rest = endpoint.partition("://")
    if scheme != "tcp" or not sep:
        return endpoint
    host, _, port = rest.rpartition(":")
    if host in WILDCARD_HOSTS:
        h = urlsplit(worker_url).hostname or "127.0.0.1"
        return f"tcp://[{h}]:{port}" if ":" in h else f"tcp://{h}:{port}"
    return endpoint


class KVIndex:
    def __init__(self, stale_s: float = 10.0, secret: bytes | None = None):
        self.stale_s = stale_s
        # from the KV secret: the keys of engines whose events are CURVE (atomd/engine/kv_events.py)
        self.keys: CurveKeys | None = kv_events_curve_keys(secret) if secret is not None else None
        self.ranks: dict[tuple[str, int], RankState] = {}
        self.by_worker: dict[str, list[RankState]] = {}
        self.ctx = zmq.asyncio.Context()
        self.decoder = msgspec.msgpack.Decoder(EventBatch)
        self.errors: dict[str, str] = {}  # worker url -> why it is not followed

    # ------------------------------------------------------------------ workers

    def follow(self, url: str, info: dict | None) -> None:
        """(Re)subscribe to every rank `info` (GET /kv_transfer_info) reports events for."""
        if not info:
            self.errors[url] = "no /kv_transfer_info"
            return
        ranks = info.get("ranks") or [info]
        wanted = []
        for r in ranks:
            ev = r.get("kv_events") if isinstance(r, dict) else None
            if not ev or not ev.get("endpoint"):
                continue
            if ev.get("hash", ALGO) != ALGO:
                self.errors[url] = f"unknown block hash {ev.get('hash')!r}"
                continue
            refused = self._auth_refused(ev)
            if refused:
                self.errors[url] = refused
                continue
            wanted.append((int(ev.get("dp_rank", r.get("dp_rank", 0)) or 0), connectable(ev["endpoint"], url),
                           connectable(ev["replay_endpoint"], url) if ev.get("replay_endpoint") else None,
                           ev.get("topic", ""), int(ev.get("block_size") or 16), ev.get("auth") == "curve"))
        if not wanted:
            self.errors.setdefault(url, "the engine publishes no KV events (--kv-events-endpoint)")
            return
        self.errors.pop(url, None)
        current = {st.rank: st for st in self.by_worker.get(url, [])}
        keep = []
        for rank, endpoint, replay, topic, block_size, curve in wanted:
            st = current.pop(rank, None)
            if st is not None and (st.endpoint, st.replay_endpoint, st.topic, st.curve) == (endpoint, replay, topic,
                                                                                             curve):
                keep.append(st)
                continue
            if st is not None:
                self._stop(st)
            st = RankState(url, rank, endpoint, replay, topic, block_size, curve)
            st.task = asyncio.get_running_loop().create_task(self._subscribe(st))
            self.ranks[(url, rank)] = st
            keep.append(st)
        for st in current.values():
            self._stop(st)
        self.by_worker[url] = keep

    def _auth_refused(self, ev: dict) -> str | None:
        """Why a rank's events cannot be followed with this router's keys (None: they can)."""
        auth = ev.get("auth", "none")  # vLLM's engines report no `auth`: the plain wire
        if auth == "none":
            return None
        if auth != "curve":
            return f"unknown KV events auth {str(auth)[:40]!r}"
        if self.keys is None:
            return ("the engine's KV events are encrypted and keyed by its KV secret (CURVE); this router "
                    "has no KV secret (--kv-params-secret-file): placing by load")
        if ev.get("server_key") != self.keys.server_public.decode():
            return ("the engine's KV events are keyed by another KV secret than this router's "
                    "(--kv-params-secret-file): placing by load")
        return None

    def forget(self, url: str) -> None:
        for st in self.by_worker.pop(url, []):
            self._stop(st)
        self.errors.pop(url, None)

    def _stop(self, st: RankState) -> None:
        if st.task is not None:
            st.task.cancel()
        self.ranks.pop((st.worker, st.rank), None)

    async def close(self) -> None:
        tasks = [st.task for st in self.ranks.values() if st.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.ranks.clear()
        self.by_worker.clear()
        self.ctx.destroy(linger=0)

    # ------------------------------------------------------------------ queries

    def rank_states(self, url: str) -> list[RankState]:
        return self.by_worker.get(url, [])

    def match(self, st: RankState, hashes: list[int]) -> int:
        """Leading blocks of `hashes` the rank holds (0 when its events went stale)."""
        if is_stale(st, self.stale_s):
            return 0
        held = st.hashes
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def describe(self, url: str) -> list[dict]:
        return [st.describe(self.stale_s) for st in self.by_worker.get(url, [])]

    # ------------------------------------------------------------------ one rank's stream

    async def _subscribe(self, st: RankState) -> None:
        sub = self._socket(zmq.SUB, st)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, st.topic.encode())
        sub.connect(st.endpoint)
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue
                await self._on_batch(st, int.from_bytes(frames[1], "big"), frames[2])
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("KV events of %s rank %d: subscriber stopped", st.worker, st.rank)
        finally:
            sub.close(linger=0)

    def _socket(self, kind: int, st: RankState) -> zmq.asyncio.Socket:
        """A socket to one of the rank's endpoints; a CURVE client with the derived keys when
        the rank's events are keyed (follow() checked that they are keyed as ours)."""
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if st.curve:
            assert self.keys is not None
            sock.setsockopt(zmq.CURVE_SERVERKEY, self.keys.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self.keys.client_public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.keys.client_secret)
        return sock

    async def _on_batch(self, st: RankState, seq: int, payload: bytes) -> None:
        st.last_msg = time.monotonic()
        batch = self.decoder.decode(payload)
        last = st.last_seq
        if last is not None and seq <= last:
            if batch.ts <= st.last_ts:
                return  # a batch a replay already applied
            # the numbering went back and the batch is newer: the engine restarted
            st.restarts += 1
            st.hashes.clear()
            st.last_seq = last = None
        if last is None:  # the first batch we see (of this engine's life)
            if seq > 0 and st.replay_endpoint is not None:  # joined late: learn what it already holds
                await self._rebuild(st)
                if st.last_seq is not None and seq <= st.last_seq:
                    return
        elif seq > last + 1:  # batches lost on the way
            st.gaps += 1
            if st.replay_endpoint is not None:
                await self._repair(st)
                if st.last_seq is not None and seq <= st.last_seq:
                    return
            else:
                logger.warning("KV events of %s rank %d: batches %d..%d lost and no replay socket; "
                               "its picture may be off", st.worker, st.rank, last + 1, seq - 1)
        st.apply(batch)
        st.last_seq, st.last_ts = seq, batch.ts

    async def _repair(self, st: RankState) -> None:
        """Fill a gap: replay from our last batch on. The replayed copy of that batch proves
        the publisher is the one we followed (same seq, same timestamp); otherwise (another
        engine's life, or a buffer that no longer reaches back) rebuild from the buffer."""
        last = st.last_seq
        got = await self._fetch(st, last)
        if got and got[0][0] == last and got[0][1].ts == st.last_ts:
            for seq, batch in got[1:]:
                st.apply(batch)
                st.last_seq, st.last_ts = seq, batch.ts
            st.repaired += 1
            return
        if got and got[0][0] <= last:
            st.restarts += 1
        await self._rebuild(st)

    async def _rebuild(self, st: RankState) -> None:
        """Forget the rank's set and replay everything its buffer holds (an underestimate
        when the buffer no longer reaches back to the engine's start)."""
        got = await self._fetch(st, 0)
        if not got:
            return
        st.hashes.clear()
        st.rebuilt += 1
        for seq, batch in got:
            st.apply(batch)
            st.last_seq, st.last_ts = seq, batch.ts

    async def _fetch(self, st: RankState, start: int) -> list[tuple[int, EventBatch]]:
        """Every buffered batch from `start` on, in order ([] when the replay fails)."""
        st.replays += 1
        dealer = self._socket(zmq.DEALER, st)
        dealer.connect(st.replay_endpoint)
        got: list[tuple[int, EventBatch]] = []
        try:
            try:  # a refused CURVE handshake drops the DEALER's only pipe: its send would wait forever
                await asyncio.wait_for(dealer.send_multipart([b"", start.to_bytes(8, "big")]), REPLAY_TIMEOUT_S)
            except asyncio.TimeoutError:
                logger.warning("KV events of %s rank %d: replay request not sent (handshake refused?)",
                               st.worker, st.rank)
                return []
            while True:
                if not await dealer.poll(REPLAY_TIMEOUT_S * 1000):
                    logger.warning("KV events of %s rank %d: replay from %d timed out", st.worker, st.rank, start)
                    return []
                frames = await dealer.recv_multipart()
                if len(frames) != 3:
                    continue
                if frames[1] == END_SEQ:
                    return got
                got.append((int.from_bytes(frames[1], "big"), self.decoder.decode(frames[2])))
        finally:
            dealer.close(linger=0)
