"""The ZMQ side channel: bytes, ownership and failure, against numpy indexing and hand-written peers.

Reference for bytes: `src[remote_ids]` must equal `dst[local_ids]` and nothing else in
`dst` may change. Reference for the protocol: raw ZMQ sockets in the test playing the
other side, so a message is checked as it is on the wire, not as our own code decodes it.

The control plane is shared by every data plane, so the tests of bytes, ownership,
refusals and lifecycle run over each backend (`backend` fixture: zmq, mooncake); the
ones that play P's DATA frames by hand, or stall zmq's queue, are the ZMQ data plane's.
Mooncake's own cases are in test_mooncake_transport.py.
"""
from __future__ import annotations

import itertools
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_transfer import zmq_receiver
from kv_transfer.params import compat_fingerprint
from kv_transfer.side_channel import (MAX_CONTROL_BYTES, Abort, Data, Done, End, Error, Heartbeat, Read,
                                      decode, encode, plan_messages)
from kv_transfer.zmq_receiver import KVReceiver
from kv_transfer.zmq_sender import KVSender
from launch.process import free_port
from tests.kv_backends import BACKENDS, make_receiver, make_sender, require_backend

REPO = pathlib.Path(__file__).resolve().parent.parent
BLOCK_BYTES = 3 * 1024 + 17  # odd on purpose: nothing may assume alignment
NUM_BLOCKS = 64
SENTINEL = 0xA5
COMPAT = compat_fingerprint("test-model", "float32", 16, 2, 2, 8, "0.1.0")
TOKEN = "0123456789abcdef0123456789abcdef"


def deadline_poll(fn, timeout_s: float = 10.0, what: str = "condition"):
    """fn() until it returns something truthy, or fail after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.002)
    raise AssertionError(f"timed out waiting for {what}")


class Collector:
    """Accumulates what a sender / receiver reports, so a test can wait for a count."""

    def __init__(self, sender: KVSender | None = None, receiver: KVReceiver | None = None):
        self.sender, self.receiver = sender, receiver
        self.released: list[tuple[str, str]] = []
        self.finished: list[str] = []
        self.failed: list[tuple[str, str]] = []

    def poll(self) -> None:
        if self.sender is not None:
            self.released += self.sender.take_released()
        if self.receiver is not None:
            done, failed = self.receiver.take_finished()
            self.finished += done
            self.failed += failed

    def wait_released(self, n: int = 1, timeout_s: float = 10.0) -> list[tuple[str, str]]:
        deadline_poll(lambda: (self.poll(), len(self.released) >= n)[1], timeout_s, f"{n} released")
        return self.released

    def wait_reported(self, n: int = 1, timeout_s: float = 10.0) -> None:
        deadline_poll(lambda: (self.poll(), len(self.finished) + len(self.failed) >= n)[1], timeout_s,
                      f"{n} transfers reported")


def random_blocks(seed: int, num_blocks: int = NUM_BLOCKS, block_bytes: int = BLOCK_BYTES) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(num_blocks, block_bytes), dtype=np.uint8)


@pytest.fixture
def closing():
    """Register senders, receivers and sockets; all are closed at teardown, whatever happened."""
    things = []
    yield lambda thing: things.append(thing) or thing
    for thing in reversed(things):
        thing.close(linger=0) if isinstance(thing, zmq.Socket) else thing.close()


@pytest.fixture(params=BACKENDS)
def backend(request):
    require_backend(request.param)
    return request.param


@pytest.fixture
def pair(closing, backend):
    """A sender over random blocks and a receiver over sentinel blocks, on `backend`."""
    src = random_blocks(1)
    dst = np.full((NUM_BLOCKS, BLOCK_BYTES), SENTINEL, dtype=np.uint8)
    sender = closing(make_sender(backend, src, COMPAT))
    receiver = closing(make_receiver(backend, dst, COMPAT, heartbeat_s=0.05))
    return src, dst, sender, receiver


def assert_untouched(dst: np.ndarray, except_ids=()) -> None:
    rest = np.setdiff1d(np.arange(len(dst)), np.asarray(except_ids, dtype=np.int64))
    assert (dst[rest] == SENTINEL).all(), "bytes were written outside the transfer's blocks"


# --------------------------------------------------------------------------- bytes


CASES = {
    "one block": ([5], [60]),
    "contiguous many": (list(range(10, 50)), list(range(0, 40))),
    "non-contiguous both sides": ([3, 9, 10, 11, 40, 2, 63, 0], [7, 8, 20, 30, 31, 32, 1, 62]),
    "contiguous remote, scattered local": (list(range(20, 30)), [9, 1, 2, 3, 50, 51, 52, 53, 0, 63]),
    "last block partly filled is just a block": (list(range(0, 7)), list(range(30, 37))),
}


DATA_PLANES = [("zmq", blocks, zero_copy) for zero_copy in (True, False) for blocks in (1, 3, 1000)] + \
    [("mooncake", None, None)]  # one batch per pull: no message size, nothing copied


@pytest.mark.unit
@pytest.mark.parametrize("backend, max_message_blocks, zero_copy", DATA_PLANES, indirect=["backend"],
                         ids=[f"{b}-{n}-{'zero-copy' if z else 'copied'}" if n else b for b, n, z in DATA_PLANES])
@pytest.mark.parametrize("case", list(CASES))
def test_bytes_arrive_exactly(closing, case, backend, max_message_blocks, zero_copy):
    remote, local = CASES[case]
    src = random_blocks(2)
    dst = np.full_like(src, SENTINEL)
    options = {} if max_message_blocks is None else dict(
        max_message_bytes=max_message_blocks * BLOCK_BYTES, copy_below_bytes=0 if zero_copy else 1 << 30)
    sender = closing(make_sender(backend, src, COMPAT, **options))
    receiver = closing(make_receiver(backend, dst, COMPAT))
    seen = Collector(sender, receiver)
    sender.grant("t1", remote, TOKEN, lease_s=30)
    receiver.start_pull("t1", *sender.address, TOKEN, remote, local, timeout_s=10)
    seen.wait_reported()
    assert seen.finished == ["t1"] and seen.failed == []
    assert np.array_equal(dst[local], src[remote])
    assert_untouched(dst, local)
    assert seen.wait_released() == [("t1", "done")]
    nbytes = len(remote) * BLOCK_BYTES
    assert sender.stats().bytes_sent == nbytes and receiver.stats().bytes_received == nbytes
    assert sender.stats().blocks_pinned == 0
    assert receiver.take_transfer_seconds()[0] > 0


@pytest.mark.unit
def test_pull_of_a_subset_past_the_prefix_hit(pair):
    """D pulls only the blocks past its own prefix hit: a subset of the grant is served."""
    src, dst, sender, receiver = pair
    granted = [4, 5, 6, 7, 8]
    sender.grant("t1", granted, TOKEN, lease_s=30)
    receiver.start_pull("t1", *sender.address, TOKEN, granted[2:], [10, 11, 12], timeout_s=10)
    seen = Collector(sender, receiver)
    seen.wait_reported()
    assert seen.finished == ["t1"]
    assert np.array_equal(dst[[10, 11, 12]], src[[6, 7, 8]])
    assert seen.wait_released() == [("t1", "done")]


@pytest.mark.unit
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=60), st.integers(1, 9))
def test_plan_messages_covers_the_ids_in_order_with_bounded_messages(ids, per_message):
    plan = plan_messages(np.asarray(ids, dtype=np.int64), per_message)
    flat = [first + k for _, frames in plan for first, n in frames for k in range(n)]
    assert flat == ids
    starts = [start for start, _ in plan]
    sizes = [sum(n for _, n in frames) for _, frames in plan]
    assert starts == [sum(sizes[:i]) for i in range(len(plan))]
    assert all(0 < size <= per_message for size in sizes)
    assert len(plan) == -(-len(ids) // per_message)  # no more messages than the bound forces


@pytest.mark.unit
def test_plan_messages_coalesces_runs_and_bounds_messages():
    ids = np.array([4, 5, 6, 7, 9, 1, 2], dtype=np.int64)
    plan = plan_messages(ids, 3)
    # Evened out to 3 messages of at most 3 blocks; runs [4..7], [9], [1, 2] split only at message edges.
    assert plan == [(0, [(4, 3)]), (3, [(7, 1), (9, 1), (1, 1)]), (6, [(2, 1)])]
    flat = [first + k for _, frames in plan for first, n in frames for k in range(n)]
    assert flat == ids.tolist()
    assert plan_messages(np.arange(256), 85) == [(i * 64, [(i * 64, 64)]) for i in range(4)]
    assert plan_messages(np.array([], dtype=np.int64), 8) == []


# --------------------------------------------------------------------------- ownership


@pytest.mark.unit
def test_duplicate_done_abort_and_late_read_are_harmless(pair, closing, backend):
    src, dst, sender, receiver = pair
    seen = Collector(sender, receiver)
    sender.grant("t1", [1, 2], TOKEN, lease_s=30)
    receiver.start_pull("t1", *sender.address, TOKEN, [1, 2], [1, 2], timeout_s=10)
    seen.wait_reported()
    assert seen.wait_released() == [("t1", "done")]

    peer = closing(zmq.Context.instance().socket(zmq.DEALER))
    peer.connect("tcp://%s:%d" % sender.address)
    for msg in (Done("t1", TOKEN), Abort("t1", TOKEN), Done("t1", TOKEN), Done("never-granted"), Abort("never-granted")):
        peer.send(encode(msg))
    peer.send(encode(Read("t1", TOKEN, [1, 2], COMPAT, backend)))
    reply = decode(peer.recv()) if peer.poll(5000) else None
    assert reply == Error("t1", "done", "")  # the tombstone answers, nothing is served again
    seen.poll()
    assert seen.released == [("t1", "done")]
    assert sender.stats().released == {"done": 1} and sender.stats().blocks_pinned == 0


@pytest.mark.unit
def test_lease_expiry_frees_once_and_is_counted(pair):
    src, dst, sender, receiver = pair
    seen = Collector(sender, receiver)
    sender.grant("t1", [3, 4, 5], TOKEN, lease_s=0.2)
    assert sender.stats().blocks_pinned == 3
    assert seen.wait_released() == [("t1", "expired")]
    stats = sender.stats()
    assert stats.leases_expired == 1 and stats.blocks_pinned == 0
    # A pull that comes too late is refused with the reason, and writes nothing.
    receiver.start_pull("t1", *sender.address, TOKEN, [3, 4, 5], [3, 4, 5], timeout_s=10)
    seen.wait_reported()
    assert seen.failed == [("t1", "expired")]
    assert_untouched(dst)
    seen.poll()
    assert seen.released == [("t1", "expired")]


@pytest.mark.unit
def test_heartbeats_keep_a_held_transfer_alive_past_its_lease(pair):
    src, dst, sender, receiver = pair
    seen = Collector(sender, receiver)
    lease_s = 0.5  # heartbeats every 0.05 s: a loaded machine must lose ten in a row to fail this
    sender.grant("t1", [8, 9], TOKEN, lease_s=lease_s)
    receiver.hold("t1", *sender.address, lease_s=lease_s, access_token=TOKEN)
    past_lease = time.monotonic() + 3 * lease_s
    while time.monotonic() < past_lease:  # a deadline loop: the transfer must stay pinned all along
        seen.poll()
        assert seen.released == [] and seen.failed == []
        time.sleep(0.01)
    assert sender.stats().heartbeats >= 3
    receiver.start_pull("t1", *sender.address, TOKEN, [8, 9], [0, 1], timeout_s=10)
    seen.wait_reported()
    assert seen.finished == ["t1"] and np.array_equal(dst[[0, 1]], src[[8, 9]])
    assert seen.wait_released() == [("t1", "done")]
    assert sender.stats().leases_expired == 0


@pytest.mark.unit
def test_revoke_frees_and_a_later_pull_is_refused(pair):
    src, dst, sender, receiver = pair
    seen = Collector(sender, receiver)
    sender.grant("t1", [1], TOKEN, lease_s=30)
    assert sender.revoke("t1") is True and sender.revoke("t1") is False
    assert seen.wait_released() == [("t1", "revoked")]
    receiver.start_pull("t1", *sender.address, TOKEN, [1], [1], timeout_s=10)
    seen.wait_reported()
    assert seen.failed == [("t1", "revoked")]
    assert_untouched(dst)


@pytest.mark.unit
def test_receiver_abort_of_a_held_transfer_frees_it_at_the_sender(pair):
    src, dst, sender, receiver = pair
    seen = Collector(sender, receiver)
    sender.grant("t1", [1, 2], TOKEN, lease_s=30)
    receiver.hold("t1", *sender.address, access_token=TOKEN)
    assert receiver.abort("t1") is True and receiver.abort("t1") is False
    assert seen.wait_released() == [("t1", "aborted")]
    seen.poll()
    assert seen.failed == [("t1", "aborted")] and seen.finished == []


# --------------------------------------------------------------------------- refusals


@pytest.mark.unit
def test_wrong_access_token_is_refused_counted_and_frees_nothing(pair):
    src, dst, sender, receiver = pair
    seen = Collector(sender, receiver)
    sender.grant("t1", [1, 2], TOKEN, lease_s=30)
    receiver.start_pull("t1", *sender.address, "f" * 32, [1, 2], [1, 2], timeout_s=10)
    seen.wait_reported()
    assert seen.failed == [("t1", "bad_token")]
    assert_untouched(dst)
    assert sender.stats().failures == {"bad_token": 1}
    assert receiver.stats().failures == {"bad_token": 1}
    # The rightful holder still gets the blocks: a refusal is not a release.
    receiver.start_pull("t1", *sender.address, TOKEN, [1, 2], [1, 2], timeout_s=10)
    seen.wait_reported(2)
    assert seen.finished == ["t1"] and np.array_equal(dst[[1, 2]], src[[1, 2]])
    assert seen.wait_released() == [("t1", "done")]


@pytest.mark.unit
def test_block_ids_not_granted_to_the_transfer_are_refused(pair):
    src, dst, sender, receiver = pair
    seen = Collector(sender, receiver)
    sender.grant("t1", [1, 2, 3], TOKEN, lease_s=30)
    sender.grant("t2", [4, 5], TOKEN, lease_s=30)  # same token, other transfer: still foreign
    receiver.start_pull("t1", *sender.address, TOKEN, [2, 3, 4], [2, 3, 4], timeout_s=10)
    seen.wait_reported()
    assert seen.failed == [("t1", "foreign_blocks")]
    assert_untouched(dst)
    assert sender.stats().failures == {"foreign_blocks": 1}


@pytest.mark.unit
def assert_pull_refused_before_any_byte(sender, receiver, dst) -> None:
    """A whole pull of the sender's blocks, refused as compat_mismatch: D's blocks untouched,
    no byte received, the sender counting the one failure."""
    seen = Collector(sender, receiver)
    sender.grant("t1", list(range(NUM_BLOCKS)), TOKEN, lease_s=30)
    receiver.start_pull("t1", *sender.address, TOKEN, list(range(NUM_BLOCKS)), list(range(NUM_BLOCKS)), 10)
    seen.wait_reported()
    assert seen.failed == [("t1", "compat_mismatch")]
    assert_untouched(dst)
    assert receiver.stats().bytes_received == 0 and sender.stats().failures == {"compat_mismatch": 1}


def test_compat_mismatch_is_refused_before_any_byte(closing, backend):
    src = random_blocks(3)
    dst = np.full_like(src, SENTINEL)
    sender = closing(make_sender(backend, src, COMPAT))
    other = {**COMPAT, "dtype": "bfloat16"}
    receiver = closing(make_receiver(backend, dst, other))
    assert_pull_refused_before_any_byte(sender, receiver, dst)
    # On the wire the ERROR names the field that differs.
    peer = closing(zmq.Context.instance().socket(zmq.DEALER))
    peer.connect("tcp://%s:%d" % sender.address)
    peer.send(encode(Read("t1", TOKEN, [0], other, backend)))
    assert peer.poll(5000)
    frames = peer.recv_multipart()
    assert len(frames) == 1  # a header and no payload
    error = decode(frames[0])
    assert isinstance(error, Error) and error.code == "compat_mismatch" and "dtype" in error.message


@pytest.mark.unit
def test_malformed_header_is_refused_not_fatal(pair, closing):
    src, dst, sender, receiver = pair
    peer = closing(zmq.Context.instance().socket(zmq.DEALER))
    peer.connect("tcp://%s:%d" % sender.address)
    peer.send(b"\xc1 not msgpack")
    assert peer.poll(5000) and decode(peer.recv()).code == "malformed"
    # The sender still serves.
    seen = Collector(sender, receiver)
    sender.grant("t1", [1], TOKEN, lease_s=30)
    receiver.start_pull("t1", *sender.address, TOKEN, [1], [1], timeout_s=10)
    seen.wait_reported()
    assert seen.finished == ["t1"]


# --------------------------------------------------------------------------- failures at D


@pytest.mark.unit
def test_dead_sender_makes_the_pull_time_out(closing, backend):
    dst = np.full((4, BLOCK_BYTES), SENTINEL, dtype=np.uint8)
    receiver = closing(make_receiver(backend, dst, COMPAT))
    seen = Collector(receiver=receiver)
    receiver.start_pull("t1", "127.0.0.1", free_port(), TOKEN, [0, 1], [0, 1], timeout_s=0.3)
    seen.wait_reported()
    assert seen.failed == [("t1", "timeout")] and seen.finished == []
    assert receiver.stats().failures == {"timeout": 1}
    assert_untouched(dst)


def fake_producer(closing) -> tuple[zmq.Socket, int]:
    """A bare ROUTER standing in for P, so a test decides exactly what D receives and when."""
    router = closing(zmq.Context.instance().socket(zmq.ROUTER))
    port = router.bind_to_random_port("tcp://127.0.0.1")
    return router, port


def recv_kind(router: zmq.Socket, kind: type, timeout_s: float = 5.0) -> tuple[bytes, object]:
    """Next message of that kind (heartbeats in between are skipped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if router.poll(50):
            rid, header = router.recv_multipart()
            msg = decode(header)
            if isinstance(msg, kind):
                return rid, msg
            assert isinstance(msg, Heartbeat), msg
    raise AssertionError(f"no {kind.__name__} arrived")


@pytest.mark.unit
def test_abort_during_an_inflight_pull_stops_all_writes(closing):
    src = random_blocks(4, num_blocks=8)
    dst = np.full((16, BLOCK_BYTES), SENTINEL, dtype=np.uint8)
    receiver = closing(KVReceiver(dst, COMPAT, heartbeat_s=0.05))
    seen = Collector(receiver=receiver)
    router, port = fake_producer(closing)
    local = [10, 11, 12, 13]
    receiver.start_pull("t1", "127.0.0.1", port, TOKEN, [0, 1, 2, 3], local, timeout_s=10)
    rid, read = recv_kind(router, Read)
    assert read == Read("t1", TOKEN, [0, 1, 2, 3], COMPAT)

    router.send_multipart([rid, encode(Data("t1", 0, [1])), src[0].tobytes()])
    deadline_poll(lambda: receiver.stats().bytes_received == BLOCK_BYTES, what="the first block")
    assert np.array_equal(dst[10], src[0])
    assert receiver.abort("t1") is True
    _, abort = recv_kind(router, Abort)
    assert abort == Abort("t1", TOKEN)

    # P had the rest in flight: it arrives after the abort and must not be written.
    router.send_multipart([rid, encode(Data("t1", 1, [2, 1])), src[1:3].tobytes(), src[3].tobytes()])
    router.send(rid, zmq.SNDMORE)
    router.send(encode(End("t1", 4)))
    # A second transfer on the same connection: once it is reported, the late t1 frames were seen.
    receiver.start_pull("t2", "127.0.0.1", port, TOKEN, [5], [0], timeout_s=10)
    rid, _ = recv_kind(router, Read)
    router.send_multipart([rid, encode(Data("t2", 0, [1])), src[5].tobytes()])
    router.send_multipart([rid, encode(End("t2", 1))])
    _, done = recv_kind(router, Done)
    assert done == Done("t2", TOKEN)
    seen.wait_reported(2)
    assert seen.failed == [("t1", "aborted")] and seen.finished == ["t2"]
    assert (dst[11:14] == SENTINEL).all()
    assert np.array_equal(dst[0], src[5])
    assert receiver.stats().bytes_received == 2 * BLOCK_BYTES


@pytest.mark.unit
def test_end_before_all_blocks_fails_the_pull_as_incomplete(closing):
    dst = np.full((4, BLOCK_BYTES), SENTINEL, dtype=np.uint8)
    receiver = closing(KVReceiver(dst, COMPAT))
    seen = Collector(receiver=receiver)
    router, port = fake_producer(closing)
    receiver.start_pull("t1", "127.0.0.1", port, TOKEN, [0, 1], [0, 1], timeout_s=10)
    rid, _ = recv_kind(router, Read)
    router.send_multipart([rid, encode(Data("t1", 0, [1])), bytes(BLOCK_BYTES)])
    router.send_multipart([rid, encode(End("t1", 2))])
    seen.wait_reported()
    assert seen.failed == [("t1", "incomplete")]
    assert recv_kind(router, Abort)[1] == Abort("t1", TOKEN)  # P may free at once


@pytest.mark.unit
def test_data_that_does_not_fit_is_malformed_and_not_written(closing):
    dst = np.full((4, BLOCK_BYTES), SENTINEL, dtype=np.uint8)
    receiver = closing(KVReceiver(dst, COMPAT))
    seen = Collector(receiver=receiver)
    router, port = fake_producer(closing)
    receiver.start_pull("t1", "127.0.0.1", port, TOKEN, [0, 1], [0, 1], timeout_s=10)
    rid, _ = recv_kind(router, Read)
    router.send_multipart([rid, encode(Data("t1", 1, [2])), bytes(2 * BLOCK_BYTES)])  # past the end
    seen.wait_reported()
    assert seen.failed == [("t1", "malformed")]
    assert_untouched(dst)


# --------------------------------------------------------------------------- scale and lifecycle


@pytest.mark.unit
def test_many_concurrent_transfers_from_two_producers(closing, backend):
    num_blocks = 256
    srcs = [random_blocks(10 + i, num_blocks=num_blocks) for i in range(2)]
    dst = np.full((num_blocks, BLOCK_BYTES), SENTINEL, dtype=np.uint8)
    senders = [closing(make_sender(backend, src, COMPAT, max_message_bytes=4 * BLOCK_BYTES, copy_below_bytes=0))
               for src in srcs]
    receiver = closing(make_receiver(backend, dst, COMPAT))
    rng = np.random.default_rng(7)
    free_local = rng.permutation(num_blocks).tolist()
    expected = {}
    for i in range(40):
        which = i % 2
        n = int(rng.integers(1, 7))
        remote = rng.choice(num_blocks, size=n, replace=False).tolist()
        local = [free_local.pop() for _ in range(n)]
        tid = f"t{i}"
        senders[which].grant(tid, remote, TOKEN, lease_s=30)
        receiver.start_pull(tid, *senders[which].address, TOKEN, remote, local, timeout_s=10)
        expected[tid] = (which, remote, local)
    seen = Collector(receiver=receiver)
    seen.wait_reported(len(expected))
    assert sorted(seen.finished) == sorted(expected) and seen.failed == []
    for which, remote, local in expected.values():
        assert np.array_equal(dst[local], srcs[which][remote])
    released = []
    for which, sender in enumerate(senders):
        mine = sum(1 for w, _, _ in expected.values() if w == which)
        released += Collector(sender).wait_released(mine)
    assert sorted(released) == sorted((tid, "done") for tid in expected)


@pytest.mark.unit
def test_close_is_idempotent(backend):
    kv = random_blocks(5, num_blocks=4)
    for endpoint in (make_sender(backend, kv, COMPAT), make_receiver(backend, kv.copy(), COMPAT)):
        endpoint.close()
        endpoint.close()
    with make_sender(backend, kv, COMPAT) as sender:
        assert sender.address[1] > 0
    sender.close()


@pytest.mark.unit
def test_bad_arguments_are_value_errors(pair):
    src, dst, sender, receiver = pair
    with pytest.raises(ValueError, match="block_ids"):
        sender.grant("t1", [0, NUM_BLOCKS], TOKEN, lease_s=30)
    with pytest.raises(ValueError, match="lease_s"):
        sender.grant("t1", [0], TOKEN, lease_s=0)
    sender.grant("t1", [0], TOKEN, lease_s=30)
    with pytest.raises(ValueError, match="already granted"):
        sender.grant("t1", [1], TOKEN, lease_s=30)
    with pytest.raises(ValueError, match="differ in length"):
        receiver.start_pull("t1", *sender.address, TOKEN, [0, 1], [0], timeout_s=1)
    with pytest.raises(ValueError, match="local_block_ids"):
        receiver.start_pull("t1", *sender.address, TOKEN, [0], [-1], timeout_s=1)
    with pytest.raises(ValueError, match="kv_blocks"):
        type(receiver)(np.zeros((4, 8), dtype=np.float32), COMPAT)


# --------------------------------------------------------------------------- two processes

SENDER_CHILD = """
import json, sys, time
import numpy as np
from tests.kv_backends import make_sender
seed, num_blocks, block_bytes, tid, token, lease_s = sys.argv[1:7]
compat = json.loads(sys.argv[7])
ids = json.loads(sys.argv[8])
kv = np.random.default_rng(int(seed)).integers(0, 256, size=(int(num_blocks), int(block_bytes)), dtype=np.uint8)
sender = make_sender(sys.argv[9], kv, compat, copy_below_bytes=0)
sender.grant(tid, ids, token, float(lease_s))
print(json.dumps({"port": sender.address[1]}), flush=True)
deadline = time.monotonic() + 30
released = []
while not released and time.monotonic() < deadline:
    released = sender.take_released()
    time.sleep(0.005)
stats = sender.stats()
print(json.dumps({"released": released, "bytes_sent": stats.bytes_sent, "pinned": stats.blocks_pinned}), flush=True)
sender.close()
"""

STALLED_RECEIVER_CHILD = """
import json, sys, time, zmq
from kv_transfer.side_channel import Read, decode, encode
port, tid, token = sys.argv[1:4]
compat, ids = json.loads(sys.argv[4]), json.loads(sys.argv[5])
sock = zmq.Context.instance().socket(zmq.DEALER)
sock.setsockopt(zmq.RCVHWM, 1)
sock.setsockopt(zmq.RCVBUF, 65536)
sock.connect(f"tcp://127.0.0.1:{port}")
print("ready", flush=True)
sys.stdin.readline()  # the parent grants first: the lease must not run out while we start
sock.send(encode(Read(tid, token, ids, compat)))
print(type(decode(sock.recv_multipart()[0])).__name__, flush=True)
time.sleep(120)  # alive, connected, no longer reading: P's frames stay queued
"""


@pytest.fixture
def child_processes():
    procs = []

    def spawn(script: str, *args: str) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.Popen([sys.executable, "-c", script, *map(str, args)], cwd=REPO, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        return proc

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        proc.stdin.close()
        proc.stdout.close()


def read_line(proc: subprocess.Popen, timeout_s: float = 30.0) -> str:
    """One stdout line of a child, failing (not hanging) if it dies first."""
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            raise AssertionError("child process said nothing")
    line = proc.stdout.readline()
    assert line, f"child exited with {proc.wait(timeout=10)}"
    return line


@pytest.mark.integration
def test_pull_from_a_sender_in_another_process(child_processes, closing, backend):
    num_blocks, remote = 32, [31, 0, 1, 2, 3, 17, 18, 5]
    proc = child_processes(SENDER_CHILD, 21, num_blocks, BLOCK_BYTES, "t1", TOKEN, 30, json.dumps(COMPAT),
                           json.dumps(remote), backend)
    port = json.loads(read_line(proc))["port"]
    src = random_blocks(21, num_blocks=num_blocks)  # the child's buffer, rebuilt from the same seed
    dst = np.full((num_blocks, BLOCK_BYTES), SENTINEL, dtype=np.uint8)
    receiver = closing(make_receiver(backend, dst, COMPAT))
    local = [0, 1, 2, 3, 4, 5, 6, 7]
    receiver.start_pull("t1", "127.0.0.1", port, TOKEN, remote, local, timeout_s=10)
    seen = Collector(receiver=receiver)
    seen.wait_reported()
    assert seen.finished == ["t1"]
    assert np.array_equal(dst[local], src[remote])
    assert_untouched(dst, local)
    report = json.loads(read_line(proc))
    assert report == {"released": [["t1", "done"]], "bytes_sent": len(remote) * BLOCK_BYTES, "pinned": 0}
    assert proc.wait(timeout=10) == 0


@pytest.mark.integration
def test_killed_receiver_frees_by_lease_expiry_after_its_frames_are_dropped(child_processes, closing):
    """A stalled D keeps P's zero-copy frames queued; P reports the release only once zmq
    dropped them (D's death closes the connection), so no reused block is ever read."""
    block_bytes, num_blocks = 256 * 1024, 256  # 64 MiB: far more than D's buffers hold
    src = random_blocks(6, num_blocks=num_blocks, block_bytes=block_bytes)
    sender = closing(KVSender(src, COMPAT, max_message_bytes=1 << 20, drain_s=60))
    seen = Collector(sender)
    ids = list(range(num_blocks))
    proc = child_processes(STALLED_RECEIVER_CHILD, sender.address[1], "t1", TOKEN, json.dumps(COMPAT),
                           json.dumps(ids))
    assert read_line(proc) == "ready\n"
    sender.grant("t1", ids, TOKEN, lease_s=0.3)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert read_line(proc) == "Data\n"
    deadline_poll(lambda: sender.stats().leases_expired == 1, what="the lease to expire")
    past = time.monotonic() + 1.0
    while time.monotonic() < past:  # expired, but frames still queued: not released yet
        seen.poll()
        assert seen.released == []
        time.sleep(0.01)
    assert sender.stats().blocks_pinned == num_blocks
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert seen.wait_released() == [("t1", "expired")]
    stats = sender.stats()
    assert stats.leases_expired == 1 and stats.drains_forced == 0 and stats.blocks_pinned == 0
    assert stats.bytes_sent == 0 and stats.transfers_served == 0  # END never went out


@pytest.mark.integration
def test_kv_transfer_imports_no_torch():
    """kv_transfer sees the KV cache only as numpy buffers (docs/design.md): a fresh interpreter proves it."""
    code = ("import sys, kv_transfer.params, kv_transfer.zmq_sender, kv_transfer.zmq_receiver, "
            "kv_transfer.mooncake_transport; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'atomd')); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------- hostile peers (issue 42)


def hostile_peer(closing, sender: KVSender) -> zmq.Socket:
    peer = closing(zmq.Context.instance().socket(zmq.DEALER))
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect("tcp://%s:%d" % sender.address)
    return peer


def replies(peer: zmq.Socket, quiet_s: float = 0.3, first_s: float | None = None) -> list:
    """Every message the peer got until it has been quiet for `quiet_s` (the first one waited
    for up to `first_s` where a reply is due: a loaded machine may take longer to answer)."""
    out = []
    while peer.poll(int((quiet_s if out or first_s is None else first_s) * 1000)):
        out.append(decode(peer.recv_multipart()[0]))
    return out


def assert_pull_works(sender: KVSender, receiver: KVReceiver, src: np.ndarray, dst: np.ndarray, tid: str) -> None:
    seen = Collector(sender, receiver)
    sender.grant(tid, [5, 6], TOKEN, lease_s=30)
    receiver.start_pull(tid, *sender.address, TOKEN, [5, 6], [5, 6], timeout_s=10)
    seen.wait_reported()
    assert seen.finished == [tid] and np.array_equal(dst[[5, 6]], src[[5, 6]])


@pytest.mark.unit
def test_done_abort_and_heartbeat_without_the_access_token_change_nothing(pair, closing):
    """An ABORT without the token released a live grant (the transfer id was enough)."""
    src, dst, sender, receiver = pair
    seen = Collector(sender, receiver)
    sender.grant("t1", [1, 2], TOKEN, lease_s=0.5)
    peer = hostile_peer(closing, sender)
    for msg in (Abort("t1"), Abort("t1", "f" * 32), Done("t1"), Done("t1", "f" * 32),
                Heartbeat(["t1"]), Heartbeat(["t1"], ["f" * 32])):
        peer.send(encode(msg))
    assert replies(peer) == []  # someone else's transfer: not even an answer
    seen.poll()
    assert seen.released == [] and sender.stats().blocks_pinned == 2
    # the heartbeats without the token did not renew the lease either: it expires on time
    assert seen.wait_released() == [("t1", "expired")]


@pytest.mark.unit
def test_a_heartbeat_of_unknown_ids_gets_one_reply(pair, closing):
    """One HEARTBEAT naming 20,000 unknown ids gave 20,000 replies and log lines."""
    src, dst, sender, receiver = pair
    peer = hostile_peer(closing, sender)
    peer.send(encode(Heartbeat([f"u{i}" for i in range(4000)])))
    got = replies(peer, first_s=10)
    assert len(got) == 1 and len(got[0].refusals) == 4000
    assert sender.stats().failures == {"unknown_transfer": 4000}
    peer.send(encode(Heartbeat([f"u{i}" for i in range(20_000)])))  # over the per-message bound
    got = replies(peer, first_s=10)
    assert [(type(m).__name__, m.code) for m in got] == [("Error", "malformed")]
    assert_pull_works(sender, receiver, src, dst, "t9")


@pytest.mark.unit
def test_an_oversized_frame_drops_that_peer_and_nothing_else(pair, closing):
    """A 512 MiB frame was accepted (+447 MB in P): zmq now drops a peer over MAXMSGSIZE."""
    src, dst, sender, receiver = pair
    peer = hostile_peer(closing, sender)
    peer.send(bytes(2 * MAX_CONTROL_BYTES))
    assert replies(peer) == []
    assert_pull_works(sender, receiver, src, dst, "t2")


@pytest.mark.unit
def test_a_receiver_closes_idle_producer_sockets(pair, monkeypatch):
    src, dst, sender, receiver = pair
    monkeypatch.setattr(zmq_receiver, "IDLE_PEER_S", 0.2)
    assert_pull_works(sender, receiver, src, dst, "t3")
    deadline_poll(lambda: receiver.stats().peers_open == 0, what="the idle producer socket closed")
    assert_pull_works(sender, receiver, src, dst, "t4")  # a later transfer opens a new one


FUZZ_IDS = itertools.count()
HEADERS = st.sampled_from(["READ", "DATA", "END", "DONE", "HEARTBEAT", "ABORT", "ERROR", "HELLO", "WELCOME",
                           "READY", "REFUSED", "BOGUS"])
JUNK = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=40)
                    | st.binary(max_size=40), lambda inner: st.lists(inner, max_size=5), max_leaves=20)


@pytest.mark.unit
@settings(max_examples=60, deadline=None)
@given(frames=st.lists(st.one_of(st.binary(max_size=200),
                                 st.tuples(HEADERS, st.lists(JUNK, max_size=6)).map(
                                     lambda t: msgspec.msgpack.encode([t[0], *t[1]]))),
                       min_size=1, max_size=4))
def test_fuzz_side_channel_frames_never_hurt_a_producer_or_a_consumer(fuzz_pair, frames):
    """Random msgpack / bytes frames at P's ROUTER and at D's DEALER (from a fake P): both
    keep serving, nothing is released or written that should not be."""
    src, dst, sender, receiver, peer, router, port = fuzz_pair
    live = held = f"t{next(FUZZ_IDS)}"
    sender.grant(live, [7], TOKEN, lease_s=30)
    peer.send_multipart(frames)
    receiver.hold(held, "127.0.0.1", port, access_token=TOKEN)
    deadline = time.monotonic() + 5
    while True:  # the heartbeat naming `held` (earlier examples' ABORTs may come first)
        assert router.poll(max(1, int((deadline - time.monotonic()) * 1000))), "no heartbeat"
        rid, header = router.recv_multipart()
        msg = decode(header)
        if isinstance(msg, Heartbeat) and held in msg.transfer_ids:
            break
    router.send_multipart([rid, *frames])
    assert sender.revoke(live) is True  # still granted: no junk released it
    assert receiver.abort(held) is True  # still held: no junk finished it
    assert (dst[:4] == SENTINEL).all()
    seen = Collector(sender, receiver)
    seen.wait_released()
    seen.wait_reported()


@pytest.fixture(scope="module")
def fuzz_pair():
    src = random_blocks(2)
    dst = np.full((NUM_BLOCKS, BLOCK_BYTES), SENTINEL, dtype=np.uint8)
    sender = KVSender(src, COMPAT)
    receiver = KVReceiver(dst, COMPAT, heartbeat_s=0.02)
    ctx = zmq.Context.instance()
    peer, router = ctx.socket(zmq.DEALER), ctx.socket(zmq.ROUTER)
    peer.connect("tcp://%s:%d" % sender.address)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    yield src, dst, sender, receiver, peer, router, port
    for s in (peer, router):
        s.close(linger=0)
    receiver.close()
    sender.close()
