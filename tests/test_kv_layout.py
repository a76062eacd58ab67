"""The TP KV layout (contracts/kv_layout.py) against a numpy reference built from full-head
blocks, and its place in the KV compatibility fingerprint (kv_transfer/params.py): engines of
different TP sizes pair when their layouts map, and are refused, naming both layouts, before
any byte moves when they do not."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from contracts.kv_layout import ITEMSIZE, TPKVLayout, check_mappable, convert_block
from kv_transfer.params import COMPAT_FIELDS, compat_fingerprint, compat_mismatch, tp_layout

pytestmark = pytest.mark.unit

HEADS, TPS = (1, 2, 4, 8), (1, 2, 4)


def reference_heads(tp: int, kv_heads: int, worker: int) -> list[int]:
    """Split: contiguous equal chunks; replicated: each head on tp/kv_heads consecutive workers."""
    if tp <= kv_heads:
        return list(np.array_split(np.arange(kv_heads), tp)[worker])
    return [list(np.repeat(np.arange(kv_heads), tp // kv_heads))[worker]]


def full_block(layout: TPKVLayout, seed: int) -> np.ndarray:
    """A whole block [layers, planes, block, all heads, head_dim] of random element bits."""
    word = {4: np.uint32, 2: np.uint16, 1: np.uint8}[ITEMSIZE[layout.dtype]]
    rng = np.random.default_rng(seed)
    shape = (layout.layers, layout.planes, layout.block_size, layout.kv_heads, layout.head_dim)
    return rng.integers(0, np.iinfo(word).max, size=shape, dtype=word)


def slices(full: np.ndarray, tp: int) -> list[bytes]:
    return [np.ascontiguousarray(full[:, :, :, reference_heads(tp, full.shape[3], w)]).tobytes()
            for w in range(tp)]


def layout(tp, heads, dtype="bfloat16", planes=2, head_dim=8, layers=3, block=4):
    return TPKVLayout(tp, heads, head_dim, planes, layers, block, dtype)


@pytest.mark.parametrize("heads", HEADS)
def test_every_split_and_replicate_combination_converts_like_the_reference(heads):
    for src_tp, dst_tp in itertools.product(TPS, TPS):
        src, dst = layout(src_tp, heads), layout(dst_tp, heads)
        for w in range(src_tp):
            assert list(src.worker_heads(w)) == reference_heads(src_tp, heads, w)
        full = full_block(src, seed=100 * heads + 10 * src_tp + dst_tp)
        got = convert_block(src, dst, slices(full, src_tp))
        assert [g.tobytes() for g in got] == slices(full, dst_tp), (heads, src_tp, dst_tp)


def test_worker_heads_are_the_heads_the_engines_split_gives_each_worker():
    """The layout's slices are the engine's KV caches: the same heads per worker as the model
    split (atomd/model/tp_split.py) loads, for every even combination."""
    from atomd.model.tp_split import TPSplit
    for heads, tp in itertools.product(HEADS, TPS):
        for w in range(tp):
            split = TPSplit(rank=w, size=tp, num_heads=8 * heads, num_kv_heads=heads, head_dim=8, vocab_size=64)
            assert layout(tp, heads).worker_heads(w) == split.kv_heads(), (heads, tp, w)


def test_replicas_come_from_the_first_worker_that_holds_the_head():
    src, dst = layout(4, 2, "float32"), layout(1, 2, "float32")  # workers 0,1 hold head 0; 2,3 head 1
    full = full_block(src, seed=7)
    parts = slices(full, 4)
    parts[1] = bytes(len(parts[1]))  # a stale replica on worker 1 (and 3) is never read
    parts[3] = bytes(len(parts[3]))
    assert convert_block(src, dst, parts)[0].tobytes() == full.tobytes()


@pytest.mark.parametrize("tp", TPS)
def test_mla_latent_one_plane_one_head_is_replicated_on_every_worker(tp):
    src = TPKVLayout(tp, 1, 576, 1, 2, 16, "bfloat16")  # DeepSeek's latent: 512 + 64 rope dims
    full = full_block(src, seed=tp)
    for dst_tp in TPS:
        got = convert_block(src, TPKVLayout(dst_tp, 1, 576, 1, 2, 16, "bfloat16"), slices(full, tp))
        assert [g.tobytes() for g in got] == [full.tobytes()] * dst_tp


def test_a_tp1_slice_is_todays_kv_cache_block_and_converts_to_itself():
    from atomd.engine.kv_cache import KVCache
    cache = KVCache(5, 3, 4, 2, 8, torch.bfloat16)
    cache.kv.copy_(torch.randn(cache.kv.shape))
    one = layout(1, 2, "bfloat16")
    assert one.slice_bytes(0) == KVCache.bytes_per_block(3, 4, 2, 8, torch.bfloat16)
    block = cache.kv[2].contiguous().view(torch.uint8).numpy().tobytes()
    assert convert_block(one, one, [block])[0].tobytes() == block
    # and TP=2's slices are that block's heads 0 and 1 (the reference's split of the same bytes)
    two = convert_block(one, layout(2, 2, "bfloat16"), [block])
    assert [t.tobytes() for t in two] == [cache.kv[2][:, :, :, [h]].contiguous().view(torch.uint8).numpy().tobytes()
                                          for h in (0, 1)]


def test_convert_writes_into_given_destination_slices():
    src, dst = layout(2, 4, "float16"), layout(4, 4, "float16")
    full = full_block(src, seed=3)
    out = [np.zeros(dst.slice_bytes(w), np.uint8) for w in range(4)]
    assert convert_block(src, dst, slices(full, 2), out=out) is out
    assert [o.tobytes() for o in out] == slices(full, 4)


@pytest.mark.parametrize("field,value", [("kv_heads", 8), ("head_dim", 16), ("planes", 1), ("layers", 4),
                                         ("block_size", 16), ("dtype", "float32")])
def test_layouts_that_differ_in_more_than_tp_cannot_map(field, value):
    producer = layout(2, 4)
    consumer = TPKVLayout(**{**producer.to_dict(), "tp_size": 1, field: value})
    with pytest.raises(ValueError) as err:
        check_mappable(producer, consumer)
    assert field in str(err.value)
    assert producer.describe() in str(err.value) and consumer.describe() in str(err.value)
    with pytest.raises(ValueError):
        convert_block(producer, consumer, [b""] * 2)


def test_a_tp_that_splits_heads_unevenly_cannot_map():
    uneven, even = layout(4, 6), layout(2, 6)
    with pytest.raises(ValueError, match="splits 6 KV heads unevenly") as err:
        check_mappable(uneven, even)
    assert "producer TP=4" in str(err.value) and "consumer TP=2" in str(err.value)
    with pytest.raises(ValueError, match="unevenly"):
        uneven.worker_heads(0)


def test_bad_layouts_and_slices_are_refused():
    with pytest.raises(ValueError, match="tp_size"):
        layout(0, 2)
    with pytest.raises(ValueError, match="dtype"):
        layout(1, 2, "float64")
    with pytest.raises(ValueError, match="worker"):
        layout(2, 2).worker_heads(2)
    with pytest.raises(ValueError, match="source slice 0"):
        convert_block(layout(1, 2), layout(2, 2), [b"\0" * 3])
    with pytest.raises(ValueError, match="source slices"):
        convert_block(layout(2, 2), layout(1, 2), [b""])


# the fingerprint

def fp(tp, heads=4):
    return compat_fingerprint("m", "bfloat16", 16, 6, heads, 32, "atomd-kv-1", tp_size=tp)


def test_a_tp1_fingerprint_is_unchanged_and_an_old_peer_counts_as_tp1():
    assert list(fp(1)) == list(COMPAT_FIELDS)
    assert fp(2)["tp_size"] == 2 and tp_layout(fp(2)) == TPKVLayout(2, 4, 32, 2, 6, 16, "bfloat16")
    assert compat_mismatch(fp(1), {**fp(1), "tp_size": 1}) is None


@pytest.mark.parametrize("p_tp,d_tp,heads", [(1, 2, 4), (2, 1, 4), (4, 2, 2), (1, 4, 1), (2, 4, 8)])
def test_different_tp_sizes_pair_when_the_layouts_map(p_tp, d_tp, heads):
    assert compat_mismatch(fp(d_tp, heads), fp(p_tp, heads)) is None  # D checks P's
    assert compat_mismatch(fp(p_tp, heads), fp(d_tp, heads), peer="consumer") is None  # P checks D's READ


def test_a_layout_that_cannot_map_is_refused_naming_both():
    message = compat_mismatch(fp(1, 6), fp(4, 6))  # D with TP=1 gets params from a P with TP=4
    assert message.startswith("compat mismatch on tp_size: KV layouts cannot map")
    assert "producer TP=4 x 6 KV heads" in message and "consumer TP=1 x 6 KV heads" in message
    message = compat_mismatch(fp(1, 6), fp(4, 6), peer="consumer")  # P with TP=1 gets D's TP=4 READ
    assert "producer TP=1" in message and "consumer TP=4" in message
    # the exact fields are still compared first, whatever the TP sizes
    assert "head_dim" in compat_mismatch(fp(1), {**fp(2), "head_dim": 64})
    for bad in ("2", 0, -1, None, 1.5):
        assert "malformed KV layout" in compat_mismatch(fp(1), {**fp(1), "tp_size": bad})


def test_workers_slices_on_the_wire_pair_where_the_workers_hold_as_many_heads():
    """--tp-kv-transfer direct (fingerprint `tp_rows`: the slice rows' stride, not compared): equal TP
    sizes pair whatever their pools, and so do other sizes (or a TP=1-layout peer: a TP=1 or staging
    engine) whose workers hold as many KV heads (one each: TP >= the KV heads, MLA's latent); anything
    else is refused both ways, naming both layouts, as nobody converts one slice into another."""
    direct = lambda tp, rows, heads=4: compat_fingerprint("m", "bfloat16", 16, 6, heads, 32, "atomd-kv-1",  # noqa: E731
                                                          tp_size=tp, tp_rows=rows)
    assert compat_mismatch(direct(2, 100), direct(2, 37)) is None
    for mine, theirs in ((direct(4, 10, 2), direct(2, 7, 2)), (direct(2, 10, 2), direct(8, 7, 2)),
                         (direct(2, 10, 1), fp(1, 1)), (fp(1, 1), direct(4, 10, 1)), (direct(4, 3, 4), direct(8, 5, 4))):
        assert compat_mismatch(mine, theirs) is None and compat_mismatch(theirs, mine, peer="consumer") is None
    for mine, theirs in ((direct(2, 10), fp(1)), (fp(1), direct(2, 10)), (direct(2, 10), direct(4, 10)),
                         (fp(1, 2), direct(2, 10, 2))):  # (a staging TP=2 engine shows TP=1's layout)
        message = compat_mismatch(mine, theirs)
        assert message.startswith("compat mismatch on tp_size: workers' slices travel as they lie"), message
        assert f"producer TP={theirs.get('tp_size', 1)} x" in message and f"consumer TP={mine.get('tp_size', 1)} x" in message


@pytest.mark.parametrize("p_tp,d_tp,heads", [(2, 2, 4), (2, 4, 2), (4, 2, 2), (1, 2, 1), (2, 1, 1), (4, 8, 4), (1, 3, 1)])
def test_a_direct_pull_lands_each_worker_its_heads(p_tp, d_tp, heads):
    """atomd/engine/tp_pd.direct_pull against convert_block: P's slice rows pulled as the transport
    moves rows (row for row), then the replicas' local copies, give every D worker the heads it holds;
    each set of heads crosses the wire once."""
    from atomd.engine.tp_pd import direct_pull, slice_rows

    def rows_of(layout, blocks):  # direct_rows: worker w's slice of block b is row w * blocks + b
        return np.zeros((layout.tp_size * blocks, layout.slice_bytes(0)), dtype=np.uint8)

    p, d = TPKVLayout(p_tp, heads, 4, 2, 3, 2, "float32"), TPKVLayout(d_tp, heads, 4, 2, 3, 2, "float32")
    p_rows, d_rows = rows_of(p, 5), rows_of(d, 7)
    p_rows[:] = np.random.default_rng(p_tp * 10 + d_tp).integers(0, 256, p_rows.shape, dtype=np.uint8)
    remote_ids, local_ids = [4, 1, 2], [0, 6, 3]
    remote, local, copies = direct_pull(p, d, remote_ids, local_ids, 5, 7)
    assert set(remote) <= set(slice_rows(remote_ids, p_tp, 5))  # what P granted
    assert len(remote) == len(local) == len(local_ids) * len({tuple(d.worker_heads(w)) for w in range(d_tp)})
    d_rows[local] = p_rows[remote]  # the transport
    for src, dst in copies:  # TPDirectConnector.get_finished
        d_rows[[dst * 7 + b for b in local_ids]] = d_rows[[src * 7 + b for b in local_ids]]
    for rb, lb in zip(remote_ids, local_ids):
        want = convert_block(p, d, [p_rows[w * 5 + rb] for w in range(p_tp)])
        assert all(np.array_equal(d_rows[w * 7 + lb], want[w]) for w in range(d_tp)), (rb, lb)
    assert not d_rows[[w * 7 + b for w in range(d_tp) for b in set(range(7)) - set(local_ids)]].any()


def test_the_sender_refuses_a_read_whose_layout_cannot_map_before_any_byte(tmp_path):
    """P's side channel (the zmq sender) checks a READ's fingerprint: a TP layout that cannot
    map is an ERROR naming both layouts, and D's blocks stay untouched."""
    from tests.test_zmq_transport import (SENTINEL, assert_pull_refused_before_any_byte, make_receiver,
                                          make_sender, random_blocks)
    p_fp = compat_fingerprint("test-model", "float32", 16, 2, 6, 8, "0.1.0")
    d_fp = compat_fingerprint("test-model", "float32", 16, 2, 6, 8, "0.1.0", tp_size=4)
    src = random_blocks(3)
    dst = np.full_like(src, SENTINEL)
    sender, receiver = make_sender("zmq", src, p_fp), make_receiver("zmq", dst, d_fp)
    try:
        assert_pull_refused_before_any_byte(sender, receiver, dst)
    finally:
        receiver.close()
        sender.close()
