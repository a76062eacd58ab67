"""Routing policies (router/policies.py) and the kv_aware index (router/kv_index.py), in
process: deterministic distributions, stickiness, thresholds, and the index against a real
KVEventPublisher (late join, a forced gap, a restart, a stale rank)."""
from __future__ import annotations

import asyncio
import collections
import time
from types import SimpleNamespace

import pytest

from atomd.engine.kv_events import KVEventPublisher
from contracts.block_hash import block_hashes
from kv_transfer.events import BlockStored
from launch.process import free_port
from router.kv_index import KVIndex, RankState, connectable
from router.policies import (CacheAware, ConsistentHash, KVAware, PowerOfTwo, RouteRequest, Session,
                             make_policy)
from router.prefix_tree import PrefixTree
from tests.fake_workers import Cluster

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def workers(n: int) -> list:
    return [SimpleNamespace(url=f"http://w{i}:1", name=f"w{i}", in_flight=0, in_flight_tokens=0) for i in range(n)]


def req(prompt: str = "", **body) -> RouteRequest:
    return RouteRequest(dict(body, prompt=prompt), {})


class Decisions(collections.Counter):
    def __call__(self, policy: str, decision: str) -> None:
        self[decision] += 1


def with_decisions(policy):
    policy.decide = Decisions()
    return policy


# ------------------------------------------------------------------ simple policies

def test_power_of_two_weighs_tokens_in_flight():
    ws = workers(2)
    ws[0].in_flight_tokens = 5000  # one long prompt in flight ...
    ws[1].in_flight = 3  # ... against three short ones
    ws[1].in_flight_tokens = 300
    p2 = PowerOfTwo(seed=1)
    assert all(p2.choose(ws, req()) is ws[1] for _ in range(20))


def test_every_policy_is_known_by_name_and_refuses_unknown_ones():
    for name in ("round_robin", "random", "power_of_two", "cache_aware", "kv_aware", "consistent_hash", "session"):
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="policy must be one of"):
        make_policy("fastest")


# ------------------------------------------------------------------ cache_aware

def test_cache_aware_keeps_a_prefix_on_one_worker_and_spreads_new_ones():
    ws = workers(3)
    p = with_decisions(CacheAware(cache_threshold=0.5))
    homes = {}
    for family in "abcdef":
        prefix = family * 400
        first = p.choose(ws, req(prefix + " first"))
        homes[family] = first.url
        for i in range(5):
            assert p.choose(ws, req(prefix + f" variant {i}")) is first  # sticky
    # six new prefixes over three empty trees: the smallest tree gets each new one
    assert collections.Counter(homes.values()) == {w.url: 2 for w in ws}
    assert p.decide["cache_hit"] == 30 and p.decide["cache_miss"] == 6


def test_cache_aware_below_the_threshold_is_a_miss():
    ws = workers(2)
    p = with_decisions(CacheAware(cache_threshold=0.5))
    home = p.choose(ws, req("x" * 100))
    other = p.choose(ws, req("x" * 10 + "y" * 200))  # shares 10 of 210 characters: not worth following
    assert other is not home and p.decide["cache_miss"] == 2


def test_cache_aware_balances_when_the_load_is_lopsided():
    ws = workers(2)
    p = with_decisions(CacheAware(cache_threshold=0.1, balance_abs_threshold=4, balance_rel_threshold=1.5))
    home = p.choose(ws, req("shared " * 50))
    home.in_flight = 10  # the cached worker is swamped
    other = p.choose(ws, req("shared " * 50 + "more"))
    assert other is not home and p.decide["load_balance"] == 1
    home.in_flight = 3  # within the thresholds again: the cache decides (both have seen the prefix now)
    p.choose(ws, req("shared " * 50 + "again"))
    assert p.decide["cache_hit"] == 1


def test_prefix_tree_matches_splits_and_evicts_least_recent_first():
    clock = iter(range(1000))
    t = PrefixTree(clock=lambda: next(clock))
    t.insert("hello world", "a")
    t.insert("hello there", "b")
    assert t.match("hello world!", ["a", "b"]) == ("a", 11)
    assert t.match("hello there", ["a", "b"]) == ("b", 11)
    assert t.match("hello", ["a", "b"])[1] == 5 and t.match("xyz", ["a"]) == (None, 0)
    assert t.size("a") == 11 and t.size("b") == 11
    t.insert("goodbye", "a")  # a's newest
    t.evict(max_chars=11)  # a holds 18: its least recent leaves ("world", then "hello ") go
    assert t.match("goodbye", ["a"]) == ("a", 7)
    assert t.match("hello world", ["a"])[1] == 0 and t.size("a") == 7
    assert t.match("hello there", ["b"]) == ("b", 11)  # b untouched
    t.remove_tenant("b")
    assert t.match("hello there", ["b"]) == (None, 0)


# ------------------------------------------------------------------ consistent_hash / session

def test_consistent_hash_is_stable_and_moves_only_the_removed_workers_keys():
    ws = workers(4)
    p = with_decisions(ConsistentHash())
    keys = [f"user-{i}" for i in range(400)]
    before = {k: p.choose(ws, req("x", user=k)).url for k in keys}
    assert before == {k: p.choose(ws, req("y", user=k)).url for k in keys}  # the prompt does not matter
    assert min(collections.Counter(before.values()).values()) > 40  # spread over all four
    after = {k: p.choose(ws[:3], req("x", user=k)).url for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == ws[3].url for k in moved)
    by_header = RouteRequest({"prompt": "x"}, {"x-session-id": "s1"})
    assert p.choose(ws, by_header) is p.choose(ws, RouteRequest({"prompt": "other"}, {"x-session-id": "s1"}))
    assert p.decide["session_key"] == 1202 and p.choose(ws, req("same prompt")) is p.choose(ws, req("same prompt"))


def test_session_sticks_moves_when_its_worker_leaves_and_expires():
    now = [0.0]
    ws = workers(3)
    p = with_decisions(Session(session_ttl_s=10, clock=lambda: now[0]))
    ws[0].in_flight = 2
    first = p.choose(ws, req(user="alice"))
    assert first is not ws[0]
    first.in_flight = 5  # busier now, but alice stays
    assert all(p.choose(ws, req(user="alice")) is first for _ in range(5))
    rest = [w for w in ws if w is not first]
    moved = p.choose(rest, req(user="alice"))  # her worker left rotation
    assert moved in rest and p.choose(ws, req(user="alice")) is moved
    now[0] = 100.0  # idle past the TTL: placed anew, by load
    for w in ws:
        w.in_flight = 0
    ws[2].in_flight = ws[1].in_flight = 1
    assert p.choose(ws, req(user="alice")) is ws[0]
    assert p.decide == {"new_session": 2, "sticky": 6, "moved": 1}
    assert p.choose(ws, req()) is ws[0] and p.decide["no_key"] == 1


# ------------------------------------------------------------------ kv_aware

class FakeIndex(KVIndex):
    def __init__(self):
        self.stale_s = 10.0
        self.ranks, self.by_worker, self.errors = {}, {}, {}

    def hold(self, url: str, rank: int, hashes, block_size: int = 4) -> RankState:
        st = RankState(url, rank, "tcp://x:1", None, "", block_size)
        st.hashes = set(hashes)
        st.last_msg = time.monotonic()
        self.ranks[(url, rank)] = st
        self.by_worker.setdefault(url, []).append(st)
        return st


def test_kv_aware_picks_the_longest_held_prefix_balanced_against_load():
    ws = workers(3)
    index = FakeIndex()
    tokens = list(range(1, 42))  # 10 full blocks of 4, the last token in the 11th
    hs = block_hashes(tokens, 4)
    hits = []
    index.hold(ws[0].url, 0, hs[:2])
    index.hold(ws[1].url, 0, hs[:7])
    index.hold(ws[2].url, 0, [])
    p = with_decisions(KVAware(kv_index=index, observe_hit=lambda role, n: hits.append(n)))
    assert p.choose(ws, req(tokens)) is ws[1] and hits == [28]
    ws[1].in_flight_tokens = 100  # 100 tokens queued outweigh 20 tokens saved
    assert p.choose(ws, req(tokens)) is ws[0]
    index.ranks[(ws[1].url, 0)].hashes = set(hs)  # every block, incl. the last full one
    ws[1].in_flight_tokens = 0
    p.choose(ws, req(tokens))
    assert hits[-1] == 40  # 10 blocks: the one holding the last token never counts
    index.ranks[(ws[1].url, 0)].last_msg = 0.0  # its events went silent: scored as empty
    assert p.choose(ws, req(tokens)) is ws[0]
    assert p.choose(ws, req("text, no tokenizer")).url in {w.url for w in ws}
    assert p.decide == {"kv_hit": 4, "no_tokens": 1}


def test_kv_aware_pins_the_dp_rank_that_holds_the_prefix():
    ws = workers(2)
    index = FakeIndex()
    tokens = list(range(100, 133))
    hs = block_hashes(tokens, 4)
    index.hold(ws[0].url, 0, [])
    index.hold(ws[0].url, 1, hs[:5])
    index.hold(ws[1].url, 0, hs[:3])
    p = KVAware(kv_index=index)
    p.role = "prefill"
    r = req(tokens)
    assert p.choose(ws, r) is ws[0] and r.dp_rank == {"prefill": 1}


# ------------------------------------------------------------------ the index against a publisher

def tcp() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def stored(hashes: list[int]) -> list:
    return [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[0] * 4 * len(hashes), block_size=4)]


def info_of(pub: KVEventPublisher) -> dict:
    return {"dp_size": 1, "kv_events": pub.info()}


async def until(pred, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("secret", [None, b"kv-secret"], ids=["plain", "curve"])
def test_index_joins_late_repairs_a_gap_and_follows_a_restart(secret):
    """On vLLM's plain wire, and over CURVE keyed by the KV secret both sides have."""
    ep, rp = tcp(), tcp()

    async def scenario():
        pub = KVEventPublisher(ep, rp, heartbeat_s=0.05, secret=secret)
        try:
            pub.publish(stored([1, 2, 3]))  # before the router listens
            await until(lambda: pub.num_published >= 2, what="publish")
            index = KVIndex(stale_s=5, secret=secret)
            index.follow("http://e:1", info_of(pub))
            st = index.ranks[("http://e:1", 0)]
            await until(lambda: st.hashes == {1, 2, 3}, what="the late join's replay")
            # forced gap: drop what the subscriber would get, keep it for replay
            st.task.cancel()
            await until(lambda: st.task.done(), what="unsubscribe")
            pub.publish(stored([4]))
            pub.publish([])  # (nothing)
            await until(lambda: pub.num_published >= st.last_seq + 3, what="more batches")
            st.task = asyncio.get_running_loop().create_task(index._subscribe(st))
            await until(lambda: 4 in st.hashes and st.repaired >= 1, what="the gap repaired")
            assert st.gaps >= 1 and st.rebuilt == 1 and st.restarts == 0
            # restart: a new publisher on the same endpoints numbers from 0 again
            pub.close()
            pub = KVEventPublisher(ep, rp, heartbeat_s=0.05, secret=secret)
            await until(lambda: st.restarts >= 1 and st.hashes == set(), what="the restart")
            pub.publish(stored([9]))
            await until(lambda: st.hashes == {9}, what="events after the restart")
            assert st.curve == (secret is not None) and index.errors == {} and pub.num_auth_refused == 0
            await index.close()
        finally:
            pub.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("router_secret", [None, b"another secret"])
def test_index_refuses_a_keyed_engine_it_has_no_key_for_and_says_why(router_secret):
    """The engine reports `auth: curve` and its server key; a router without the secret, or
    with another one, follows nothing there (kv_aware then places by load) and records why."""
    pub = KVEventPublisher(tcp(), tcp(), heartbeat_s=0.05, secret=b"kv-secret")
    ws = workers(2)

    async def scenario():
        index = KVIndex(stale_s=5, secret=router_secret)
        index.follow(ws[0].url, info_of(pub))
        index.follow(ws[1].url, {"kv_events": {**pub.info(), "auth": "kerberos"}})
        assert index.ranks == {}
        want = "no KV secret" if router_secret is None else "another KV secret"
        assert want in index.errors[ws[0].url] and "unknown KV events auth" in index.errors[ws[1].url]
        ws[0].in_flight_tokens, ws[1].in_flight_tokens = 50, 0
        p = with_decisions(KVAware(kv_index=index))
        assert p.choose(ws, req(list(range(40)))) is ws[1] and p.decide == {"no_hit": 1}
        await index.close()

    try:
        asyncio.run(scenario())
    finally:
        pub.close()


def test_wildcard_endpoints_are_reached_at_the_workers_host():
    assert connectable("tcp://*:5557", "http://10.1.2.3:8000") == "tcp://10.1.2.3:5557"
    assert connectable("tcp://0.0.0.0:5557", "http://[fd00::1]:8000") == "tcp://[fd00::1]:5557"
    assert connectable("tcp://10.9.9.9:5557", "http://10.1.2.3:8000") == "tcp://10.9.9.9:5557"


# ------------------------------------------------------------------ through the router

def test_policies_per_role_and_decisions_in_metrics(loop):
    c = Cluster(loop, n_prefill=2, n_decode=2, health_interval_s=60, prefill_policy="cache_aware",
                decode_policy="session").start()
    try:
        for i in range(4):
            r = c.post("/v1/completions", {"prompt": "the same long prefix " * 20 + str(i), "max_tokens": 2,
                                           "user": "u1"})
            assert r.status == 200
        assert sorted(len(p.requests) for p in c.prefill) == [0, 4]  # one prefix, one prefill worker
        assert sorted(len(d.requests) for d in c.decode) == [0, 4]  # one session, one decode worker
        text = c.get("/metrics").body.decode()
        assert 'atomd_router:decision_total{decision="cache_hit",policy="cache_aware",role="prefill"} 3.0' in text
        assert 'atomd_router:decision_total{decision="sticky",policy="session",role="decode"} 3.0' in text
        assert 'atomd_router:decision_total{decision="pd"} 4.0' in text
    finally:
        c.stop()
