"""KV events (atomd/engine/kv_events.py): vLLM's wire format, seq numbers, replay, the buffer
bound, a slow subscriber, and an engine that publishes after the forward.

Frames are decoded here with copies of vLLM's own structs (vllm/distributed/kv_events.py:
array-like, omit_defaults, tagged by class name), so "a vLLM consumer reads our frames"
is what is checked, not our decoder against our encoder.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import numpy as np
import pytest
import xxhash
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from zmq.utils.monitor import recv_monitor_message

from atomd.engine.kv_events import END_SEQ, KVEventPublisher, offset_port
from contracts.block_hash import block_hashes, chain_hash
from kv_transfer.events import AllBlocksCleared, BlockRemoved, BlockStored
from kv_transfer.trust import CurveKeys, kv_events_curve_keys
from launch.process import free_port

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


# ---------------------------------------------------------------- vLLM's consumer-side types

class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VBlockRemoved(VKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class VAllBlocksCleared(VKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VEventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


VDECODER = msgspec.msgpack.Decoder(VKVEventBatch)


def tcp() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


class Sub:
    """A SUB socket and a replay DEALER, as any consumer would open them; with `keys`, a CURVE
    client (pyzmq's own options) presenting keys.client_* and expecting keys.server_public."""

    def __init__(self, pub: KVEventPublisher, topic: bytes = b"", keys: CurveKeys | None = None):
        self.ctx = zmq.Context()
        self.keys = keys
        self.sub = self.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        # the outcome of each handshake with the publisher (before connecting: none is missed)
        self.handshakes = self.sub.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.sub.connect(pub.endpoint)
        self.pub = pub

    def socket(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self.keys is not None:
            sock.curve_serverkey = self.keys.server_public
            sock.curve_publickey, sock.curve_secretkey = self.keys.client_public, self.keys.client_secret
        return sock

    def recv(self, timeout_s: float = 10.0) -> tuple[bytes, int, VKVEventBatch]:
        assert self.sub.poll(int(timeout_s * 1000)), "no KV events message"
        topic, seq, payload = self.sub.recv_multipart()
        assert len(seq) == 8
        return topic, int.from_bytes(seq, "big"), VDECODER.decode(payload)

    def replay(self, start: int, timeout_s: float = 10.0) -> list[tuple[int, VKVEventBatch]]:
        dealer = self.socket(zmq.DEALER)
        # a refused CURVE handshake can drop the only pipe, and a DEALER with none blocks in send
        dealer.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        dealer.connect(self.pub.replay_endpoint)
        out = []
        try:
            try:
                dealer.send_multipart([b"", start.to_bytes(8, "big")])
            except zmq.Again:
                raise AssertionError("the replay did not end: its request could not be sent") from None
            while True:
                assert dealer.poll(int(timeout_s * 1000)), "the replay did not end"
                empty, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if seq == END_SEQ:
                    assert payload == b""
                    return out
                out.append((int.from_bytes(seq, "big"), VDECODER.decode(payload)))
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def subscribed(pub: KVEventPublisher, topic: bytes = b"", keys: CurveKeys | None = None) -> Sub:
    """A subscriber that is surely connected (PUB drops what is sent before a SUB joined):
    it has seen a heartbeat. Later messages arrive in order, heartbeats among them."""
    s = Sub(pub, topic, keys)
    s.recv()
    return s


def events_only(s: Sub, n: int) -> list[tuple[int, VKVEventBatch]]:
    """The next `n` non-empty batches; every seq on the way (heartbeats too) is the last + 1."""
    out, last = [], None
    while len(out) < n:
        _, seq, batch = s.recv()
        assert last is None or seq == last + 1, (last, seq)
        last = seq
        if batch.events:
            out.append((seq, batch))
    return out


def stored(i: int) -> BlockStored:
    return BlockStored(block_hashes=[i], parent_block_hash=None, token_ids=list(range(4)), block_size=4)


@pytest.fixture
def pub(request):
    p = KVEventPublisher(tcp(), tcp(), topic="kv", buffer_steps=1000, dp_rank=3, block_size=4,
                         heartbeat_s=0.05)
    request.addfinalizer(p.close)
    return p


def test_frames_are_topic_seq_and_a_vllm_event_batch(pub):
    s = subscribed(pub, b"kv")
    try:
        pub.publish([stored(7), BlockRemoved(block_hashes=[5]), AllBlocksCleared()])
        ((seq, batch),) = events_only(s, 1)
        assert seq >= 1  # seq 0 was the start-up AllBlocksCleared
        assert s.replay(seq)[0] == (seq, batch)
        assert batch.data_parallel_rank == 3 and batch.ts > 0
        st, rm, cl = batch.events
        assert isinstance(st, VBlockStored) and st.block_hashes == [7] and st.token_ids == [0, 1, 2, 3]
        assert st.block_size == 4 and st.parent_block_hash is None and st.lora_id is None and st.medium is None
        assert isinstance(rm, VBlockRemoved) and rm.block_hashes == [5]
        assert isinstance(cl, VAllBlocksCleared)
        # every field is on the wire (a strict decoder that requires lora_id/medium accepts it); the
        # six-field decoder above (vLLM's older BlockStored) read the frame, which has lora_name too
        raw = msgspec.msgpack.decode(next(p for q, p in pub.buffer if q == seq))
        assert raw[2] == 3 and raw[1][0] == ["BlockStored", [7], None, [0, 1, 2, 3], 4, None, None, None]
    finally:
        s.close()


def test_seq_is_monotonic_and_starts_with_a_cleared_cache(pub):
    s = subscribed(pub)
    try:
        for i in range(5):
            pub.publish([stored(i)])
            pub.publish([])  # nothing changed this step: nothing is sent
        got = events_only(s, 5)
        assert [b.events[0].block_hashes[0] for _, b in got] == [0, 1, 2, 3, 4]
        replayed = s.replay(0)
        assert [seq for seq, _ in replayed] == list(range(len(replayed)))  # no hole from 0 on
        assert replayed[0][1].events == [VAllBlocksCleared()]
        assert [(q, b) for q, b in replayed if b.events][1:] == got
    finally:
        s.close()


def test_replay_from_any_seq_and_the_buffer_bound(request):
    pub = KVEventPublisher(tcp(), tcp(), buffer_steps=8, heartbeat_s=60)
    request.addfinalizer(pub.close)
    s = Sub(pub)
    request.addfinalizer(s.close)
    for i in range(20):
        pub.publish([stored(i)])
    deadline = time.monotonic() + 10
    while pub.num_published < 21:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for start in (0, 13, 20, 21, 99):
        got = s.replay(start)
        want = list(range(max(start, 20 - 8 + 1), 21))  # only the last 8 are kept
        assert [seq for seq, _ in got] == want, start
        assert [b.events[0].block_hashes[0] for _, b in got] == [seq - 1 for seq in want]
    assert len(pub.buffer) == 8


def test_a_slow_subscriber_never_blocks_the_publisher(monkeypatch, request):
    monkeypatch.setattr("atomd.engine.kv_events.SNDHWM", 4)
    pub = KVEventPublisher(tcp(), tcp(), buffer_steps=16, heartbeat_s=0.05)
    request.addfinalizer(pub.close)
    s = subscribed(pub)  # connected, then never reads
    request.addfinalizer(s.close)
    big = BlockStored(block_hashes=list(range(64)), parent_block_hash=None, token_ids=list(range(4096)),
                      block_size=64)
    done = threading.Event()

    def flood():
        for _ in range(3000):
            pub.publish([big])
        done.set()

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    assert done.wait(30), "publish() blocked behind a subscriber that does not read"
    # the I/O thread keeps going: every batch is numbered and the replay socket still answers
    deadline = time.monotonic() + 30
    while pub.num_published + pub.num_dropped < 3001 + 1:
        assert time.monotonic() < deadline, (pub.num_published, pub.num_dropped)
        time.sleep(0.01)
    n = pub.num_published
    seqs = [seq for seq, _ in s.replay(n - 2)]
    assert seqs[:2] == [n - 2, n - 1] and seqs == list(range(n - 2, n - 2 + len(seqs)))


def test_heartbeats_are_empty_batches(request):
    pub = KVEventPublisher(tcp(), None, heartbeat_s=0.05)
    request.addfinalizer(pub.close)
    s = Sub(pub)
    request.addfinalizer(s.close)
    _, seq, batch = s.recv()
    while batch.events:  # the start-up batch, if this subscriber was in time for it
        _, seq, batch = s.recv()
    assert batch.events == [] and seq >= 1


def test_dp_ranks_get_their_own_ports():
    assert offset_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_port("ipc:///tmp/ev", 1) == "ipc:///tmp/ev_dp1"
    assert offset_port(None, 3) is None
    with pytest.raises(ValueError, match="PORT"):
        offset_port("tcp://host", 1)


def test_a_port_taken_is_a_clear_error():
    ep = tcp()
    first = KVEventPublisher(ep, heartbeat_s=60)
    try:
        with pytest.raises(ValueError, match="cannot bind"):
            KVEventPublisher(ep, heartbeat_s=60)
    finally:
        first.close()


def test_block_hashes_follow_the_documented_chain():
    """Against the rule as docs/design.md states it, computed here from xxhash directly, and
    against the names a real BlockManager gives a sequence's blocks."""
    from scheduler.block_manager import BlockManager
    from scheduler.sequence import Sequence

    def spec(parent: int | None, tokens: list[int]) -> int:
        head = b"" if parent is None else parent.to_bytes(8, "little")
        return xxhash.xxh64_intdigest(head + np.asarray(tokens, dtype="<i8").tobytes())

    tokens = list(range(100, 170))
    hs = block_hashes(tokens, 16)
    parent = None
    for i, h in enumerate(hs):
        parent = spec(parent, tokens[i * 16:(i + 1) * 16])
        assert h == parent == chain_hash(hs[i - 1] if i else None, tokens[i * 16:(i + 1) * 16])
    assert len(hs) == 4 and block_hashes(tokens, 16, limit=2) == hs[:2]
    bm, seq = BlockManager(num_blocks=8, block_size=16), Sequence(tokens)
    bm.allocate(seq, 0)
    seq.num_computed_tokens = len(tokens)  # as after the prefill's forward
    bm.publish(seq)
    assert seq.block_hashes == hs


# ---------------------------------------------------------------- an engine publishing

def drain(s: Sub, timeout_s: float = 0.3) -> list[VKVEventBatch]:
    out = []
    while s.sub.poll(int(timeout_s * 1000)):
        out.append(VDECODER.decode(s.sub.recv_multipart()[2]))
    return [b for b in out if b.events]


def test_an_engine_publishes_what_its_prefix_cache_indexed_after_the_forward(request):
    from atomd.llm import LLM
    from contracts.sampling import SamplingParams

    llm = LLM(num_threads=1, max_model_len=256, num_kvcache_blocks=12, kv_events_endpoint=tcp(),
              kv_events_replay_endpoint=tcp(), kv_events_topic="atomd")
    request.addfinalizer(llm.engine.close)
    info = llm.engine.kv_transfer_info()["kv_events"]
    assert info["block_size"] == 16 and info["hash"] == "xxh64_chain_le_int64" and info["topic"] == "atomd"
    assert info["tp_size"] == 1 and llm.engine.kv_transfer_info()["tp_size"] == 1  # the engine's shape
    pub = llm.engine.kv_events
    s = Sub(pub)
    request.addfinalizer(s.close)
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    ids = list(range(10, 50))  # 2 full blocks and a partial one
    llm.engine.add_request("a", ids, greedy)
    llm.engine.step()  # the prefill's forward: its full blocks are indexed, then published
    deadline = time.monotonic() + 10
    while pub.num_published < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    stored_batch = s.replay(1)[0][1]
    (ev,) = stored_batch.events
    assert ev.block_hashes == block_hashes(ids, 16) and ev.parent_block_hash is None
    assert ev.token_ids == ids[:32] and ev.block_size == 16
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    # other prompts push the cached blocks out: BlockRemoved for exactly the hashes stored
    for i in range(8):
        llm.generate([{"prompt_token_ids": [1000 + 50 * i + j for j in range(40)]}], greedy)
    batches = [b for _, b in s.replay(0)]
    removed = {h for b in batches for e in b.events if isinstance(e, VBlockRemoved) for h in e.block_hashes}
    assert set(block_hashes(ids, 16)) <= removed
    assert llm.engine.reset_prefix_cache()
    deadline = time.monotonic() + 10
    while not isinstance(s.replay(0)[-1][1].events[-1], VAllBlocksCleared):
        assert time.monotonic() < deadline, "AllBlocksCleared was not published at the reset"
        time.sleep(0.01)


# ---------------------------------------------------------------- hostile subscribers (issue 42)

SECRET = b"kv-secret"


def published(pub: KVEventPublisher, n: int) -> None:
    for i in range(n):
        pub.publish([stored(i)])
    deadline = time.monotonic() + 10
    while pub.num_published < n + 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_curve_keys_are_hmac_sha256_of_the_secret_under_fixed_labels():
    """The derivation as docs/design.md states it, computed here with hashlib and libsodium's
    Curve25519 (through zmq.curve_public) directly."""
    import hashlib
    import hmac

    def pair(label: bytes) -> tuple[bytes, bytes]:
        sk = zmq.utils.z85.encode(hmac.new(SECRET, label, hashlib.sha256).digest())
        return zmq.curve_public(sk), sk

    keys = kv_events_curve_keys(SECRET)
    assert keys == (*pair(b"atomd-kv-events-curve-server-v1"), *pair(b"atomd-kv-events-curve-client-v1"))
    assert len(set(keys)) == 4 and kv_events_curve_keys(b"another secret").server_public != keys.server_public


def first_handshake(s: Sub, timeout_s: float = 10.0) -> int:
    """How the SUB's first handshake with the publisher ended (a zmq.EVENT_HANDSHAKE_*)."""
    assert s.handshakes.poll(int(timeout_s * 1000)), "no handshake outcome"
    return recv_monitor_message(s.handshakes)["event"]


def test_with_the_kv_secret_only_a_subscriber_keyed_by_it_hears_the_events(request):
    """The PUB and replay ports gave anyone the token ids of other clients' prompts. With
    the KV secret they are CURVE servers: a plain subscriber (vLLM's), one keyed by another
    secret, and one that knows the server key but not the client key get nothing, from the
    stream or from a replay; the keyed one gets everything."""
    pub = KVEventPublisher(tcp(), tcp(), heartbeat_s=0.05, secret=SECRET)
    request.addfinalizer(pub.close)
    info = pub.info()
    keys = kv_events_curve_keys(SECRET)
    assert info["auth"] == "curve" and info["server_key"] == keys.server_public.decode()
    other = kv_events_curve_keys(b"another secret")
    strangers = [Sub(pub), Sub(pub, keys=other), Sub(pub, keys=other._replace(server_public=keys.server_public))]
    for s in strangers:
        request.addfinalizer(s.close)
    keyed = subscribed(pub, keys=keys)
    request.addfinalizer(keyed.close)
    # the events of the one that knew the server key but not the client's: ZAP said 400
    outcomes = [first_handshake(s) for s in strangers]
    assert outcomes[2] == zmq.EVENT_HANDSHAKE_FAILED_AUTH and zmq.EVENT_HANDSHAKE_SUCCEEDED not in outcomes
    assert pub.num_auth_refused >= 1
    pub.publish([stored(7)])
    ((seq, batch),) = events_only(keyed, 1)
    assert batch.events[0].token_ids == [0, 1, 2, 3]
    for s in strangers:
        assert not s.sub.poll(200), "a subscriber without the key got a batch"
        with pytest.raises(AssertionError, match="did not end"):
            s.replay(0, timeout_s=0.5)
    assert [q for q, b in keyed.replay(0) if b.events][-1] == seq


def test_without_a_secret_the_wire_is_vllms_plain_one(pub):
    assert pub.info()["auth"] == "none" and pub.info()["server_key"] is None
    s = subscribed(pub, b"kv")  # no keys: the plain ZMQ wire
    try:
        assert s.replay(0)[0][1].events == [VAllBlocksCleared()]
    finally:
        s.close()


def test_replays_are_rate_bounded_and_a_flood_costs_the_publisher_little(request):
    """200k replay requests stalled a publisher for minutes: over the rate, each gets the
    end marker alone; the publisher keeps publishing meanwhile."""
    pub = KVEventPublisher(tcp(), tcp(), heartbeat_s=60, replays_per_s=5)
    request.addfinalizer(pub.close)
    s = Sub(pub)
    request.addfinalizer(s.close)
    published(pub, 50)
    flood = s.ctx.socket(zmq.DEALER)
    request.addfinalizer(lambda: flood.close(linger=0))
    flood.connect(pub.replay_endpoint)
    n = 2000
    started = time.monotonic()
    for _ in range(n):
        flood.send_multipart([b"", (0).to_bytes(8, "big")])
    deadline = started + 30  # the publisher answers every request (its own counters say so) ...
    while pub.num_replays + pub.num_replays_throttled < n:
        assert time.monotonic() < deadline, (pub.num_replays, pub.num_replays_throttled)
        time.sleep(0.01)
    elapsed = time.monotonic() - started
    served = pub.num_replays
    assert served <= 5 + 5 * (elapsed + 1) and pub.num_replays_throttled == n - served  # a burst, then 5/s
    batches = ends = 0  # ... though a flooder that reads slower than it asks loses replies past zmq's HWM
    while flood.poll(1000):
        seq = flood.recv_multipart()[1]
        ends, batches = ends + (seq == END_SEQ), batches + (seq != END_SEQ)
    assert 0 < ends <= n and batches <= served * 51
    while s.sub.poll(0):  # the SUB may have joined during the first 50 (PUB drops what precedes a join): drain
        s.recv()
    pub.publish([stored(99)])  # still publishing
    assert [b.events[0].block_hashes for _, b in events_only(s, 1)] == [[99]]


@settings(max_examples=100, deadline=None)
@given(frames=st.lists(st.binary(max_size=64), min_size=1, max_size=6))
def test_fuzz_replay_frames_never_stop_the_publisher(fuzz_pub, frames):
    pub, s, dealer = fuzz_pub
    dealer.send_multipart(frames)
    assert [seq for seq, _ in s.replay(0)][:1] == [0]


@pytest.fixture(scope="module")
def fuzz_pub():
    pub = KVEventPublisher(tcp(), tcp(), heartbeat_s=60, secret=SECRET, replays_per_s=1000)
    s = Sub(pub, keys=kv_events_curve_keys(SECRET))
    dealer = s.socket(zmq.DEALER)
    dealer.connect(pub.replay_endpoint)
    yield pub, s, dealer
    s.close()
    pub.close()


def test_block_stored_carries_the_adapter_and_reads_the_older_six_field_form():
    """vLLM's newer BlockStored names the LoRA adapter (lora_name, after medium); a frame in the
    older six-field form still decodes (lora_name None)."""
    ours = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[5] * 4, block_size=4, lora_id=2,
                       lora_name="sql")
    frame = msgspec.msgpack.encode(ours)
    assert msgspec.msgpack.decode(frame)[-3:] == [2, None, "sql"]
    older = msgspec.msgpack.encode(["BlockStored", [1], None, [5] * 4, 4, 2, None])
    got = msgspec.msgpack.decode(older, type=BlockStored)
    assert got.lora_id == 2 and got.lora_name is None and got.block_hashes == [1]
    assert msgspec.msgpack.decode(frame, type=VBlockStored).lora_id == 2  # an older consumer reads ours
