"""The Mooncake data plane: what is its own beyond the shared control plane (which
test_zmq_transport.py runs over both backends).

References: numpy indexing for bytes; the batches Mooncake is asked for, seen through a
spy around the consumer's engine (one batch per pull, one entry per run consecutive on
both sides); raw ZMQ sockets playing P's control plane, so a handshake is checked as it
is on the wire. A "gated" engine holds a batch until the test lets it go, so a failure
decided while the batch runs (abort, timeout, revoke, P killed) is observed in order,
with no sleeps.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading

import numpy as np
import pytest
import zmq

import kv_transfer.mooncake_transport as mt
from atomd.config import EngineConfig
from kv_transfer.connector import KVConnectorConfig
from kv_transfer.factory import create_connector
from kv_transfer.mooncake_transport import (INSTALL_COMMAND, LIBS_COMMAND, MooncakeReceiver, MooncakeSender,
                                            MooncakeUnavailable, joint_runs, load_transfer_engine)
from kv_transfer.side_channel import Done, End, Hello, Read, Ready, Welcome, decode, encode
from kv_transfer.zmq_receiver import KVReceiver
from kv_transfer.zmq_sender import KVSender
from tests.kv_backends import require_backend
from tests.test_zmq_transport import (BLOCK_BYTES, COMPAT, REPO, SENDER_CHILD, SENTINEL, TOKEN, Collector,
                                      assert_untouched, child_processes, closing, deadline_poll, random_blocks,
                                      read_line)

__all__ = ["child_processes", "closing"]  # fixtures shared with test_zmq_transport.py



@pytest.fixture
def mooncake_loaded():
    require_backend("mooncake")  # make test installs it: failing to load is a failure, not a skip


needs_mooncake = pytest.mark.usefixtures("mooncake_loaded")


class SpyEngine:
    """The consumer's TransferEngine, recording every batch and holding it until `gate` is set."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.batches: list[tuple[str, list[int], list[int], list[int]]] = []
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()

    def batch_transfer_sync_read(self, session, dst, src, lengths):
        self.batches.append((session, list(dst), list(src), list(lengths)))
        self.entered.set()
        assert self.gate.wait(30), "the test never released the batch"
        return self.engine.batch_transfer_sync_read(session, dst, src, lengths)

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.fixture
def spied(closing):
    """A Mooncake sender over random blocks, a receiver over sentinel blocks whose engine is spied on."""
    src = random_blocks(31)
    dst = np.full_like(src, SENTINEL)
    sender = closing(MooncakeSender(src, COMPAT))
    receiver = closing(MooncakeReceiver(dst, COMPAT, heartbeat_s=0.05))
    spy = receiver._engine = SpyEngine(receiver._engine)  # readers are made on first use, with this engine
    return src, dst, sender, receiver, spy


def held_in_batch(spy: SpyEngine, receiver, sender, tid: str, remote: list[int], local: list[int]) -> None:
    """Grant and pull `tid`, and return once its batch is running (held by the gate)."""
    spy.gate.clear()
    spy.entered.clear()
    sender.grant(tid, remote, TOKEN, lease_s=30)
    receiver.start_pull(tid, *sender.address, TOKEN, remote, local, timeout_s=10)
    assert spy.entered.wait(10), "the batch never started"


# --------------------------------------------------------------------------- batches


@pytest.mark.unit
def test_joint_runs_split_where_either_side_breaks():
    remote = np.array([3, 4, 5, 9, 10, 20, 21], dtype=np.int64)
    local = np.array([7, 8, 9, 1, 2, 30, 40], dtype=np.int64)
    assert joint_runs(remote, local) == [(0, 3), (3, 2), (5, 1), (6, 1)]
    assert joint_runs(np.arange(5), np.arange(10, 15)) == [(0, 5)]
    assert joint_runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == []


@needs_mooncake
@pytest.mark.unit
def test_one_batch_per_pull_with_coalesced_runs(spied):
    src, dst, sender, receiver, spy = spied
    seen = Collector(sender, receiver)
    remote, local = [3, 4, 5, 9, 10, 20], [7, 8, 9, 1, 2, 30]
    sender.grant("t1", remote, TOKEN, lease_s=30)
    receiver.start_pull("t1", *sender.address, TOKEN, remote, local, timeout_s=10)
    seen.wait_reported()
    assert seen.finished == ["t1"] and np.array_equal(dst[local], src[remote])
    assert_untouched(dst, local)
    assert len(spy.batches) == 1
    session, dst_addrs, src_addrs, lengths = spy.batches[0]
    info = sender._handshake_info()
    assert session == f"127.0.0.1:{info['rpc_port']}"
    assert lengths == [3 * BLOCK_BYTES, 2 * BLOCK_BYTES, BLOCK_BYTES]
    assert src_addrs == [info["base"] + b * BLOCK_BYTES for b in (3, 9, 20)]
    assert dst_addrs == [dst.ctypes.data + b * BLOCK_BYTES for b in (7, 1, 30)]
    assert seen.wait_released() == [("t1", "done")]
    assert sender.stats().bytes_sent == receiver.stats().bytes_received == len(remote) * BLOCK_BYTES
    # A second pull from the same P: no second handshake, one more batch.
    sender.grant("t2", [0], TOKEN, lease_s=30)
    receiver.start_pull("t2", *sender.address, TOKEN, [0], [0], timeout_s=10)
    seen.wait_reported(2)
    assert seen.finished == ["t1", "t2"] and len(spy.batches) == 2


# --------------------------------------------------------------------------- failures while a batch runs


@needs_mooncake
@pytest.mark.unit
def test_abort_during_a_batch_is_reported_only_once_the_batch_returned(spied):
    src, dst, sender, receiver, spy = spied
    seen = Collector(sender, receiver)
    held_in_batch(spy, receiver, sender, "t1", [1, 2, 3], [10, 11, 12])
    assert receiver.abort("t1") is True and receiver.abort("t1") is False
    assert seen.wait_released() == [("t1", "aborted")]  # P frees at once: D's bytes are thrown away
    seen.poll()
    assert seen.failed == [] and seen.finished == []  # the batch may still write D's blocks
    spy.gate.set()
    seen.wait_reported()
    assert seen.failed == [("t1", "aborted")] and seen.finished == []


@needs_mooncake
@pytest.mark.unit
def test_timeout_of_a_stuck_batch_waits_for_the_batch(spied):
    src, dst, sender, receiver, spy = spied
    seen = Collector(sender, receiver)
    held_in_batch(spy, receiver, sender, "t1", [4], [4])
    with receiver._lock:  # the pull's deadline passes while its batch runs (no waiting on a clock)
        receiver._pulls["t1"].deadline = 0.0
    receiver._wake()
    assert seen.wait_released() == [("t1", "aborted")]  # D gave up and told P
    seen.poll()
    assert seen.failed == []
    spy.gate.set()
    seen.wait_reported()
    assert seen.failed == [("t1", "timeout")]


@needs_mooncake
@pytest.mark.unit
def test_blocks_revoked_while_d_reads_are_never_accepted(spied):
    """P cannot stop a one-sided read: END comes only if DONE found the grant live."""
    src, dst, sender, receiver, spy = spied
    seen = Collector(sender, receiver)
    held_in_batch(spy, receiver, sender, "t1", [5, 6], [5, 6])
    assert sender.revoke("t1") is True
    assert seen.wait_released() == [("t1", "revoked")]
    spy.gate.set()  # the read completes (the bytes happen to be intact), but P no longer vouches for them
    seen.wait_reported()
    assert seen.failed == [("t1", "revoked")] and seen.finished == []
    assert sender.stats().bytes_sent == 0 and receiver.stats().bytes_received == 0


@needs_mooncake
@pytest.mark.integration
def test_producer_killed_mid_pull_fails_the_pull_after_the_batch(child_processes, closing):
    num_blocks, remote, local = 32, [0, 1, 2, 3], [8, 9, 10, 11]
    proc = child_processes(SENDER_CHILD, 41, num_blocks, BLOCK_BYTES, "t1", TOKEN, 30, json.dumps(COMPAT),
                           json.dumps(remote), "mooncake")
    port = json.loads(read_line(proc))["port"]
    dst = np.full((num_blocks, BLOCK_BYTES), SENTINEL, dtype=np.uint8)
    receiver = closing(MooncakeReceiver(dst, COMPAT))
    spy = receiver._engine = SpyEngine(receiver._engine)
    spy.gate.clear()
    seen = Collector(receiver=receiver)
    receiver.start_pull("t1", "127.0.0.1", port, TOKEN, remote, local, timeout_s=10)
    assert spy.entered.wait(10), "the batch never started"  # READY came: P granted, D is reading
    proc.kill()
    proc.wait(timeout=10)
    seen.poll()
    assert seen.failed == [] and seen.finished == []
    spy.gate.set()
    seen.wait_reported(timeout_s=60)
    assert seen.finished == [] and seen.failed[0][0] == "t1"
    assert seen.failed[0][1] in ("read_failed", "timeout")  # the read fails fast; a silent P times out
    assert receiver.stats().bytes_received == 0


# --------------------------------------------------------------------------- handshake


def fake_producer(closing) -> tuple[zmq.Socket, int]:
    router = closing(zmq.Context.instance().socket(zmq.ROUTER))
    return router, router.bind_to_random_port("tcp://127.0.0.1")


def recv_msg(router: zmq.Socket, kind: type, timeout_s: float = 10.0):
    """Next message of that kind (heartbeats skipped), with the sender's routing id."""
    deadline_poll(lambda: router.poll(0), timeout_s, f"a {kind.__name__}")
    while True:
        rid, header = router.recv_multipart()
        msg = decode(header)
        if isinstance(msg, kind):
            return rid, msg
        assert type(msg).__name__ == "Heartbeat", msg
        deadline_poll(lambda: router.poll(0), timeout_s, f"a {kind.__name__}")


@needs_mooncake
@pytest.mark.unit
def test_handshake_then_ready_from_a_restarted_producer_handshakes_again(closing):
    """WELCOME carries P's instance; a READY from another instance (P restarted on the same
    address) makes D handshake again before it reads."""
    src = random_blocks(32)
    memory = closing(MooncakeSender(src, COMPAT))  # only its registered buffer: the fake P points D at it
    info = memory._handshake_info()
    dst = np.full_like(src, SENTINEL)
    receiver = closing(MooncakeReceiver(dst, COMPAT))
    seen = Collector(receiver=receiver)
    router, port = fake_producer(closing)
    receiver.start_pull("t1", "127.0.0.1", port, TOKEN, [1, 2], [5, 6], timeout_s=10)
    rid, hello = recv_msg(router, Hello)
    assert hello == Hello("mooncake")
    router.send_multipart([rid, encode(Welcome("mooncake", "old", info))])
    _, read = recv_msg(router, Read)
    assert read == Read("t1", TOKEN, [1, 2], COMPAT, "mooncake")
    router.send_multipart([rid, encode(Ready("t1", "new", 2))])
    recv_msg(router, Hello)  # READY from an instance D has not shaken hands with
    router.send_multipart([rid, encode(Welcome("mooncake", "new", info))])
    _, done = recv_msg(router, Done)
    assert done == Done("t1", TOKEN)
    router.send_multipart([rid, encode(End("t1", 2))])
    seen.wait_reported()
    assert seen.finished == ["t1"] and np.array_equal(dst[[5, 6]], src[[1, 2]])
    assert_untouched(dst, [5, 6])


@needs_mooncake
@pytest.mark.unit
@pytest.mark.parametrize("welcome, reason", [
    (Welcome("zmq", "x", {}), "backend_mismatch"),
    (Welcome("mooncake", "x", {"protocol": "rdma"}), "backend_mismatch"),
    (Welcome("mooncake", "x", {"protocol": "tcp", "rpc_port": 1, "base": 0, "num_blocks": 64, "block_bytes": 7}),
     "compat_mismatch"),
], ids=["zmq-producer", "rdma-producer", "other-geometry"])
def test_a_handshake_from_another_backend_protocol_or_geometry_is_refused(closing, welcome, reason):
    dst = np.full((8, BLOCK_BYTES), SENTINEL, dtype=np.uint8)
    receiver = closing(MooncakeReceiver(dst, COMPAT))
    seen = Collector(receiver=receiver)
    router, port = fake_producer(closing)
    receiver.start_pull("t1", "127.0.0.1", port, TOKEN, [1], [1], timeout_s=10)
    rid, _ = recv_msg(router, Hello)
    router.send_multipart([rid, encode(welcome)])
    seen.wait_reported()
    assert seen.failed == [("t1", reason)]
    assert_untouched(dst)


@needs_mooncake
@pytest.mark.unit
@pytest.mark.parametrize("p_backend, d_backend", [("zmq", "mooncake"), ("mooncake", "zmq")])
def test_mixed_backends_are_refused_before_any_byte(closing, p_backend, d_backend):
    src = random_blocks(33)
    dst = np.full_like(src, SENTINEL)
    sender = closing((MooncakeSender if p_backend == "mooncake" else KVSender)(src, COMPAT))
    receiver = closing((MooncakeReceiver if d_backend == "mooncake" else KVReceiver)(dst, COMPAT))
    seen = Collector(sender, receiver)
    sender.grant("t1", [1, 2], TOKEN, lease_s=30)
    receiver.start_pull("t1", *sender.address, TOKEN, [1, 2], [1, 2], timeout_s=10)
    seen.wait_reported()
    assert seen.failed == [("t1", "backend_mismatch")]
    assert_untouched(dst)
    # P refused the READ as well (D's own refusal may come first): named, counted, nothing served
    deadline_poll(lambda: sender.stats().failures.get("backend_mismatch") == 1, what="P's refusal")
    assert sender.stats().bytes_sent == 0


@needs_mooncake
@pytest.mark.unit
def test_mooncake_read_names_the_mismatch_on_the_wire(closing):
    sender = closing(MooncakeSender(random_blocks(34), COMPAT))
    peer = closing(zmq.Context.instance().socket(zmq.DEALER))
    peer.connect("tcp://%s:%d" % sender.address)
    peer.send(encode(Read("t1", TOKEN, [0], COMPAT)))  # a zmq consumer's READ
    assert peer.poll(5000)
    error = decode(peer.recv())
    assert error.code == "backend_mismatch" and "'mooncake'" in error.message
    assert "--kv-transfer-backend" in error.message
    peer.send(encode(Hello("zmq")))
    assert peer.poll(5000)
    welcome = decode(peer.recv())
    assert welcome.backend == "mooncake" and welcome.instance == sender.instance
    assert welcome.info == {"protocol": "tcp", "rpc_port": welcome.info["rpc_port"],
                            "base": sender._base, "num_blocks": 64, "block_bytes": BLOCK_BYTES}


# --------------------------------------------------------------------------- start-up errors


@pytest.fixture
def unloaded(monkeypatch):
    """As if the Mooncake engine had never been loaded in this process."""
    monkeypatch.setattr(mt, "_engine_class", None)
    monkeypatch.delitem(sys.modules, "mooncake.engine", raising=False)
    return monkeypatch


class _FailingFinder:
    """Makes `import mooncake.engine` fail as a wheel without its system libraries does."""

    def find_spec(self, name, path=None, target=None):
        if name == "mooncake.engine":
            raise ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")
        return None


@pytest.mark.unit
def test_missing_package_names_the_install_command(unloaded):
    unloaded.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(MooncakeUnavailable, match=re.escape(INSTALL_COMMAND)):
        load_transfer_engine()
    with pytest.raises(ValueError, match=re.escape(INSTALL_COMMAND)):
        EngineConfig(kv_transfer_backend="mooncake", kv_role="producer")
    config = KVConnectorConfig(block_size=16, compat=COMPAT, side_channel_host="127.0.0.1", side_channel_port=0,
                               lease_s=30, recv_timeout_s=10, load_failure_policy="fail", dp_rank=0,
                               params_secret=None, trusted_producers=[])
    with pytest.raises(MooncakeUnavailable, match=re.escape(INSTALL_COMMAND)):
        create_connector("mooncake", "consumer", config)


@pytest.mark.unit
def test_missing_system_library_names_the_apt_command(unloaded):
    unloaded.setattr(sys, "meta_path", [_FailingFinder(), *sys.meta_path])
    with pytest.raises(MooncakeUnavailable, match=re.escape(LIBS_COMMAND)) as e:
        load_transfer_engine()
    assert "libibverbs.so.1" in str(e.value)


@pytest.mark.integration  # one subprocess, no model load: the flag check refuses first
def test_atomd_serve_refuses_mooncake_it_cannot_load_with_the_command(tmp_path):
    shim = tmp_path / "mooncake"
    shim.mkdir()
    (shim / "__init__.py").write_text(
        "raise ImportError('libibverbs.so.1: cannot open shared object file: No such file or directory')\n")
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "atomd", "serve", "--kv-role", "producer",
                           "--kv-transfer-backend", "mooncake", "--port", "0"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert LIBS_COMMAND in proc.stderr and "mooncake" in proc.stderr


@pytest.mark.unit
def test_mooncake_flags_are_checked():
    with pytest.raises(ValueError, match="kv_mooncake_protocol"):
        EngineConfig(kv_mooncake_protocol="udp")
    with pytest.raises(ValueError, match="only with kv_transfer_backend mooncake"):
        EngineConfig(kv_mooncake_protocol="rdma")
    with pytest.raises(ValueError, match="needs kv_mooncake_protocol rdma"):
        EngineConfig(kv_transfer_backend="mooncake", kv_mooncake_device="mlx5_0")
    # colocated: no connector, so nothing to load
    assert EngineConfig(kv_transfer_backend="mooncake", kv_mooncake_protocol="rdma",
                        kv_mooncake_device="mlx5_0").kv_mooncake_device == "mlx5_0"


@needs_mooncake
@pytest.mark.unit
def test_rdma_without_a_device_is_refused_not_run_over_tcp():
    """Mooncake quietly falls back to tcp when it finds no HCA; asking for rdma must not."""
    try:
        engine = mt.new_engine("127.0.0.1", "rdma", None)
    except RuntimeError as e:
        assert "fall back to tcp" in str(e) and "--kv-mooncake-protocol tcp" in str(e)
    else:  # a host with an RDMA device
        assert mt.rdma_devices(engine)
