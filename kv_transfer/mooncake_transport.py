"""Mooncake data plane: D reads P's pinned KV blocks with Mooncake's TransferEngine
(docs/design.md, "Side channel", "Mooncake data plane").

Only the bytes move differently from kv_transfer/zmq_transport.py. The control plane is
that module's, shared, not copied: grants, access tokens, the compat check, leases,
heartbeats, DONE / ABORT / revoke / expiry releasing exactly once, tombstones, the
receiver's exactly-once reports. `MooncakeSender` / `MooncakeReceiver` subclass
`KVSender` / `KVReceiver` and override only their data-plane hooks.

Both ends register their whole paged KV buffer with a TransferEngine once, at start-up
(P2P handshake metadata: no etcd; protocol "tcp" by default, "rdma" with a device name by
configuration). Per transfer:

    D -> P  HELLO {backend}                       once per producer (and after P restarted)
    P -> D  WELCOME {backend, instance, info}     info: protocol, rpc_port, base, num_blocks, block_bytes
    D -> P  READ {..., backend="mooncake"}        the shared checks: token, compat, granted ids
    P -> D  READY {transfer_id, instance, num_blocks}
    D       one batch_transfer_sync_read per pull: one entry per run of ids consecutive on both
            sides, from P's base + id * block_bytes straight into D's registered blocks
    D -> P  DONE {transfer_id}
    P -> D  END {transfer_id, num_blocks}         only if the grant was still live at DONE

The read is one-sided: P cannot stop it, so P never vouches for bytes it did not see read
while pinned. D accepts a pull only on END, which P sends only when DONE found the grant
live (a DONE after revoke / expiry gets ERROR with the release reason), so bytes read
from a block P had already reused are never accepted. D's side: a batch writes D's
blocks outside the I/O thread, so a pull that fails or is aborted while its batch runs is
reported (and its blocks handed back) only once the batch returned.

P and D must run the same backend and protocol: P refuses a READ over another backend
(`backend_mismatch`), D refuses a WELCOME from another backend or Mooncake protocol.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
from typing import Any

import numpy as np

from kv_transfer.connector import KVConnectorConfig
from kv_transfer.zmq_connector import ZmqConsumer, ZmqProducer, build_connector
from kv_transfer.side_channel import (BACKEND_MISMATCH, COMPAT_MISMATCH, DONE, MALFORMED, PEER_GONE, Data,
                                      Done, End, Hello, Ready, Welcome)
from kv_transfer.zmq_receiver import KVReceiver, _Pull
from kv_transfer.zmq_sender import KVSender
from kv_transfer.zmq_transport import check_kv

log = logging.getLogger(__name__)

BACKEND = "mooncake"
PROTOCOLS = ("tcp", "rdma")
PACKAGE = "mooncake-transfer-engine-non-cuda"
INSTALL_COMMAND = "pip install 'atomd[mooncake]'"
LIBS_COMMAND = "apt-get install -y libibverbs1 librdmacm1"
READ_FAILED = "read_failed"  # D's failure reason: Mooncake's batch read returned an error
# A batch is one step with no progress signal: its pull's timeout grows by its size at this
# rate (1 GiB adds ~21 s), so a large pull that moves is not timed out as silent.
MIN_READ_BYTES_PER_S = 50e6


class MooncakeUnavailable(RuntimeError):
    """The Mooncake transfer engine cannot be loaded here; the message names the fix."""


_engine_class = None


def load_transfer_engine():
    """mooncake.engine.TransferEngine, or MooncakeUnavailable naming the install command."""
    global _engine_class
    if _engine_class is not None:
        return _engine_class
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        missing = isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "mooncake"
        if missing:
            raise MooncakeUnavailable(
                f"kv_transfer_backend mooncake needs the Mooncake transfer engine (PyPI {PACKAGE}), which is "
                f"not installed: {INSTALL_COMMAND}") from e
        raise MooncakeUnavailable(
            f"kv_transfer_backend mooncake: the Mooncake transfer engine is installed but does not load ({e}); "
            f"it needs the RDMA user-space libraries even for tcp: {LIBS_COMMAND} (Debian/Ubuntu, as root)") from e
    _engine_class = TransferEngine
    return TransferEngine


def check_protocol(protocol: str, device: str | None) -> None:
    if protocol not in PROTOCOLS:
        raise ValueError(f"mooncake protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    if device and protocol != "rdma":
        raise ValueError(f"a mooncake device ({device!r}) needs protocol rdma, got {protocol!r}")


def new_engine(hostname: str, protocol: str, device: str | None):
    """An initialized TransferEngine: P2P handshake metadata (no etcd), `protocol` over `device`."""
    check_protocol(protocol, device)
    engine = load_transfer_engine()()
    rc = engine.initialize(hostname, "P2PHANDSHAKE", protocol, device or "")
    if rc != 0:
        hint = (" (no usable RDMA device? name one with --kv-mooncake-device, e.g. mlx5_0)"
                if protocol == "rdma" else "")
        raise RuntimeError(f"Mooncake TransferEngine.initialize({hostname!r}, 'P2PHANDSHAKE', {protocol!r}, "
                           f"{device or ''!r}) failed with {rc}{hint}")
    if protocol == "rdma":  # without an HCA Mooncake quietly runs tcp: refuse instead of pretending
        hcas = rdma_devices(engine)
        absent = [d for d in (device or "").split(",") if d.strip() and d.strip() not in hcas]
        if not hcas or absent:
            raise RuntimeError(f"mooncake protocol rdma: Mooncake sees RDMA devices {sorted(hcas)}"
                               + (f", not {', '.join(absent)}" if absent else "")
                               + " (it would fall back to tcp); fix the RDMA setup (`ibv_devices` lists them), "
                               "name one with --kv-mooncake-device, or run --kv-mooncake-protocol tcp")
    return engine


def rdma_devices(engine) -> set[str]:
    """The HCAs Mooncake's topology discovery found (its JSON: {"cpu:0": [[preferred], [available]], ...})."""
    try:
        topology = json.loads(engine.get_local_topology(""))
    except (ValueError, TypeError):
        return set()
    return {name for entry in topology.values() for names in entry for name in names}


_engines: dict[tuple[str, str, str, str | None], Any] = {}
_engines_lock = threading.Lock()


def shared_engine(role: str, hostname: str, protocol: str, device: str | None):
    """One TransferEngine per process and role, as Mooncake intends: endpoints register and
    unregister their buffers on it. Never destroyed before exit (its destructor holds the
    GIL for ~1 s); one per role so a P and a D in one process (tests, benchmarks) still
    move bytes between two engines."""
    key = (role, hostname, protocol, device)
    with _engines_lock:
        if key not in _engines:
            _engines[key] = new_engine(hostname, protocol, device)
        return _engines[key]


def register(engine, kv_blocks: np.ndarray) -> int:
    """Register the whole paged KV buffer once; returns its base address."""
    base = kv_blocks.ctypes.data
    rc = engine.register_memory(base, kv_blocks.nbytes)
    if rc != 0:
        raise RuntimeError(f"Mooncake register_memory of the KV buffer ({kv_blocks.nbytes} bytes) failed with {rc}")
    return base


def joint_runs(remote: np.ndarray, local: np.ndarray) -> list[tuple[int, int]]:
    """(position, length) of each run of ids consecutive on both sides: one batch entry each."""
    if len(remote) == 0:
        return []
    breaks = (np.flatnonzero((np.diff(remote) != 1) | (np.diff(local) != 1)) + 1).tolist()
    starts, ends = [0, *breaks], [*breaks, len(remote)]
    return [(a, b - a) for a, b in zip(starts, ends)]


# ----------------------------------------------------------------------------- producer


class MooncakeSender(KVSender):
    """P: the shared control plane; a checked READ is answered READY and D reads the blocks itself."""

    backend = BACKEND

    def __init__(self, kv_blocks: np.ndarray, compat: dict[str, Any], host: str = "127.0.0.1", port: int = 0,
                 engine_id: str | None = None, *, protocol: str = "tcp", device: str | None = None,
                 drain_s: float = 2.0) -> None:
        check_kv(kv_blocks)
        self.protocol = protocol
        self._engine = shared_engine("producer", host, protocol, device)
        self._base = register(self._engine, kv_blocks)
        self._readies: dict[str, int] = {}  # transfer id -> blocks of the READ answered READY
        try:
            super().__init__(kv_blocks, compat, host, port, engine_id, drain_s=drain_s)
        except BaseException:
            self._drop_engine()
            raise

    def close(self) -> None:
        super().close()
        self._drop_engine()

    def _drop_engine(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.unregister_memory(self._base)

    # Data plane hooks (I/O thread, lock held).

    def _handshake_info(self) -> dict[str, Any]:
        return {"protocol": self.protocol, "rpc_port": self._engine.get_rpc_port(), "base": self._base,
                "num_blocks": int(self._kv.shape[0]), "block_bytes": int(self._kv.shape[1])}

    def _serve(self, rid: bytes, tid: str, ids: np.ndarray) -> None:
        self._readies[tid] = len(ids)
        self._send(rid, Ready(tid, self.instance, len(ids)))
        return None  # nothing of ours in flight: D reads, and its DONE says when it is done

    def _on_done(self, rid: bytes, tid: str, now: float) -> None:
        num_blocks = self._readies.pop(tid, None)
        if tid in self._grants:  # still pinned: whatever D read was these blocks' bytes
            if num_blocks is not None and self._send(rid, End(tid, num_blocks)):
                self._stats.bytes_sent += num_blocks * self._kv.shape[1]
                self._stats.transfers_served += 1
            self._release(tid, DONE, now)
        elif self._tombstones.get(tid, DONE) != DONE:  # released while D read: its bytes may be stale
            self._refuse(rid, tid, self._tombstones[tid])

    def _release(self, tid: str, reason: str, now: float) -> None:
        self._readies.pop(tid, None)
        super()._release(tid, reason, now)


# ----------------------------------------------------------------------------- consumer


class _MooncakePull(_Pull):
    __slots__ = ("reading", "confirming", "ready_instance", "final")

    def __init__(self, peer: tuple[str, int], lease_s: float | None, token: str = "") -> None:
        super().__init__(peer, lease_s, token)
        self.reading = False  # a batch is writing this pull's blocks
        self.confirming = False  # read, DONE sent, waiting for END
        self.ready_instance: str | None = None  # READY from a P instance D has no handshake with yet
        self.final: str | None = None  # failure decided while the batch ran, reported when it returns


class _PeerInfo:
    __slots__ = ("instance", "session", "base", "num_blocks")

    def __init__(self, instance: str, session: str, base: int, num_blocks: int) -> None:
        self.instance, self.session, self.base, self.num_blocks = instance, session, base, num_blocks


class _Reader:
    """One thread per producer running its batches in order: a stuck P stalls only its own pulls."""

    def __init__(self, engine, name: str, on_done) -> None:
        self.engine, self.on_done = engine, on_done
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:  # the binding waits for a batch by spinning on its status: let the transport threads
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # and the engine's go first
        except (AttributeError, OSError):
            pass
        while (job := self.jobs.get()) is not None:
            tid, pull, session, dst, src, lengths = job
            try:  # releases the GIL; returns once every entry landed, failed or timed out
                rc = self.engine.batch_transfer_sync_read(session, dst, src, lengths)
            except Exception:
                log.exception("kv-receiver: Mooncake batch read of %s failed", tid)
                rc = -1
            self.on_done(tid, pull, rc)


class MooncakeReceiver(KVReceiver):
    """D: the shared control plane; a READY pull is read in one Mooncake batch, accepted on END."""

    backend = BACKEND
    _pull_type = _MooncakePull

    def __init__(self, kv_blocks: np.ndarray, compat: dict[str, Any], *, hostname: str = "127.0.0.1",
                 protocol: str = "tcp", device: str | None = None, heartbeat_s: float = 5.0, rcvhwm: int = 8) -> None:
        check_kv(kv_blocks)
        if not kv_blocks.flags.writeable:
            raise ValueError("kv_blocks must be writeable")
        self.protocol = protocol
        self._engine = shared_engine("consumer", hostname, protocol, device)
        self._base = register(self._engine, kv_blocks)
        self._peer_info: dict[tuple[str, int], _PeerInfo] = {}
        self._hello_pending: set[tuple[str, int]] = set()
        self._readers: dict[tuple[str, int], _Reader] = {}
        self._completed: list[tuple[str, _MooncakePull, int]] = []
        super().__init__(kv_blocks, compat, heartbeat_s=heartbeat_s, rcvhwm=rcvhwm)

    def close(self) -> None:
        super().close()
        for reader in self._readers.values():
            reader.jobs.put(None)
        for reader in self._readers.values():
            reader.thread.join(timeout=5)
        if any(r.thread.is_alive() for r in self._readers.values()):
            log.warning("kv-receiver: a Mooncake batch is still running at close; its engine is left alive")
            return
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.unregister_memory(self._base)

    # Data plane hooks (I/O thread, lock held).

    def _handshake(self, peer: tuple[str, int]) -> None:
        if peer not in self._hello_pending:
            self._hello_pending.add(peer)
            self._outbox.append((peer, Hello(self.backend)))

    def _before_read(self, pull: _Pull) -> None:
        if pull.peer not in self._peer_info:  # HELLO goes first on the same socket: WELCOME precedes READY
            self._handshake(pull.peer)

    def _on_welcome(self, peer: tuple[str, int], msg: Welcome, now: float) -> None:
        self._hello_pending.discard(peer)
        problem, reason = self._check_welcome(msg)
        if problem:
            log.warning("kv-receiver: refusing producer %s:%d: %s", peer[0], peer[1], problem)
            self._peer_info.pop(peer, None)
            for tid, pull in list(self._pulls.items()):
                if pull.peer == peer and pull.pulling and not (pull.reading or pull.confirming):
                    self._fail(tid, reason, now)
            return
        info = _PeerInfo(msg.instance, f"{peer[0]}:{msg.info['rpc_port']}", msg.info["base"], msg.info["num_blocks"])
        self._peer_info[peer] = info
        for tid, pull in list(self._pulls.items()):
            if pull.peer == peer and pull.ready_instance is not None:
                instance, pull.ready_instance = pull.ready_instance, None
                if instance == info.instance:
                    self._start_read(tid, pull, info, now)
                else:  # READY came from a P instance that is gone, and its grant with it
                    self._fail(tid, PEER_GONE, now)

    def _check_welcome(self, msg: Welcome) -> tuple[str | None, str]:
        if msg.backend != self.backend:
            return (f"it serves KV over {msg.backend!r}, this consumer pulls over {self.backend!r}: start both "
                    "engines with the same --kv-transfer-backend"), BACKEND_MISMATCH
        info = msg.info
        if info.get("protocol") != self.protocol:
            return (f"its Mooncake protocol is {info.get('protocol')!r}, this consumer's {self.protocol!r}: start "
                    "both engines with the same --kv-mooncake-protocol"), BACKEND_MISMATCH
        if not all(isinstance(info.get(k), int) and info[k] >= 0 for k in ("rpc_port", "base", "num_blocks")):
            return f"malformed handshake {info!r}", MALFORMED
        if info.get("block_bytes") != self._kv.shape[1]:
            return (f"its KV blocks are {info.get('block_bytes')} bytes, this consumer's {self._kv.shape[1]}",
                    COMPAT_MISMATCH)
        return None, ""

    def _on_transfer_message(self, pull: _MooncakePull, msg, frames, now: float) -> None:
        tid = msg.transfer_id
        idle = not (pull.reading or pull.confirming or pull.ready_instance is not None)
        if isinstance(msg, Ready) and idle and msg.num_blocks == len(pull.local_ids):
            info = self._peer_info.get(pull.peer)
            if info is not None and info.instance == msg.instance:
                self._start_read(tid, pull, info, now)
            else:  # no handshake with this P instance yet (it restarted): WELCOME starts the read
                pull.ready_instance = msg.instance
                pull.deadline = now + pull.timeout_s
                self._peer_info.pop(pull.peer, None)
                self._handshake(pull.peer)
        elif isinstance(msg, End) and pull.confirming and msg.num_blocks == len(pull.local_ids):
            pull.got[:] = True
            self._stats.bytes_received += len(pull.local_ids) * self._kv.shape[1]
            self._finish(tid, None, now)
        elif isinstance(msg, Ready | End | Data):  # out of order, the wrong size, or another data plane's
            self._stats.malformed_messages += 1
            self._fail(tid, MALFORMED, now)

    def _start_read(self, tid: str, pull: _MooncakePull, info: _PeerInfo, now: float) -> None:
        remote = np.asarray(pull.remote_ids, dtype=np.int64)
        if len(remote) and (remote.min() < 0 or remote.max() >= info.num_blocks):  # outside P's buffer
            self._stats.malformed_messages += 1
            self._fail(tid, MALFORMED, now)
            return
        block_bytes = self._kv.shape[1]
        runs = joint_runs(remote, pull.local_ids)
        dst = [self._base + int(pull.local_ids[pos]) * block_bytes for pos, _ in runs]
        src = [info.base + int(remote[pos]) * block_bytes for pos, _ in runs]
        lengths = [n * block_bytes for _, n in runs]
        if not runs:  # nothing to read (an empty pull): straight to DONE
            self._confirm(tid, pull, now)
            return
        pull.reading = True
        pull.deadline = now + pull.timeout_s + sum(lengths) / MIN_READ_BYTES_PER_S
        reader = self._readers.get(pull.peer)
        if reader is None:
            reader = self._readers[pull.peer] = _Reader(self._engine, f"kv-mooncake-read-{pull.peer[1]}",
                                                        self._read_done)
        reader.jobs.put((tid, pull, info.session, dst, src, lengths))

    def _read_done(self, tid: str, pull: _MooncakePull, rc: int) -> None:
        """Reader thread: hand the result to the I/O thread."""
        with self._lock:
            self._completed.append((tid, pull, rc))
        self._wake()

    def _confirm(self, tid: str, pull: _MooncakePull, now: float) -> None:
        pull.confirming = True
        pull.deadline = now + pull.timeout_s
        self._send(pull.peer, Done(tid, pull.token))

    def _finish(self, tid: str, reason: str | None, now: float) -> None:
        pull = self._pulls.pop(tid)
        if pull.reading:  # the batch still writes its blocks: report when it returned
            pull.final = reason
            return
        self._report(tid, pull, reason, now)

    def _on_tick(self, now: float) -> None:
        completed, self._completed = self._completed, []
        for tid, pull, rc in completed:
            pull.reading = False
            if self._pulls.get(tid) is not pull:  # failed or aborted meanwhile: its writes have stopped now
                self._report(tid, pull, pull.final or MALFORMED, now)
            elif rc != 0:
                log.info("kv-receiver: Mooncake read of %s from %s failed (%d)", tid, pull.peer, rc)
                self._fail(tid, READ_FAILED, now)
            else:
                self._confirm(tid, pull, now)
        super()._on_tick(now)

    def _poll_timeout_ms(self) -> int:
        with self._lock:
            if self._completed:
                return 0
        return super()._poll_timeout_ms()


# ----------------------------------------------------------------------------- connector


def _options(config: KVConnectorConfig) -> dict[str, Any]:
    extra = config.extra_config or {}
    return {"protocol": extra.get("mooncake_protocol") or "tcp", "device": extra.get("mooncake_device") or None}


class MooncakeProducer(ZmqProducer):
    """The ZMQ producer connector (grants, leases, release) over a MooncakeSender."""

    def make_sender(self, buffer) -> MooncakeSender:
        return MooncakeSender(buffer, self.config.compat, self.config.side_channel_host,
                              self.config.side_channel_port, **_options(self.config))


class MooncakeConsumer(ZmqConsumer):
    """The ZMQ consumer connector (trust, checks, heartbeats, policies) over a MooncakeReceiver."""

    def make_receiver(self, buffer) -> MooncakeReceiver:
        return MooncakeReceiver(buffer, self.config.compat, hostname=self.config.side_channel_host,
                                **_options(self.config))


def create_mooncake_connector(role: str, config: KVConnectorConfig):
    """The factory registered as "mooncake"; MooncakeUnavailable (naming the fix) if it cannot load."""
    load_transfer_engine()
    options = _options(config)
    check_protocol(options["protocol"], options["device"])
    return build_connector(role, config, MooncakeProducer, MooncakeConsumer, backend=BACKEND)
