"""kv_aware and cache_aware placement through real engines (issue #15).

Two prefill engines publish KV events (one of them with two DP ranks, each its own PUB and
replay socket, reported in GET /kv_transfer_info), one decode engine, and an in-process
router (so its index can be looked at). A long shared prefix must land on the engine
that holds it, and that engine reports the hit (`cached_tokens`); the index follows the
engines' real events, repairs a forced gap from the replay socket, and empties a rank
whose engine restarted. Every test runs on real and on simulated engines.

The prefill engines and the router share a KV secret (as the Helm chart deploys them), so
every event here travels over CURVE with the keys derived from it (issue #42); a plain
subscriber, and a router without the secret or with another one, learn nothing. (D has no
secret: it trusts loopback producers, so the unkeyed routers' requests still complete.)
"""
from __future__ import annotations

import json
import pathlib
import socket
import time

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from launch.process import free_port, http as sync_http, reserve_port
from kv_transfer.trust import kv_events_curve_keys
from router.app import Router, RouterConfig
from tests.fake_workers import LoopThread, http, wait_until
from launch.process import EngineServer
from tests.server_fixtures import ENGINE_ARGS, REPO, START_TIMEOUT_S, ServerUnderTest, model_dir, server_log
from tests.sim_fixtures import default_model_profile, sim_flags

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PREFIX = ("def read_config(path):\n    with open(path) as f:\n        data = json.load(f)\n"
          "    for key, value in data.items():\n        if isinstance(value, dict):\n"
          "            data[key] = normalize(value)\n    return data\n\n") * 3


SECRET = "kv-aware-test-secret"


def events_flags(port: int, secret_file: pathlib.Path) -> list[str]:
    return ["--kv-events-endpoint", f"tcp://127.0.0.1:{port}", "--kv-events-replay-endpoint",
            f"tcp://127.0.0.1:{port + 10}", "--kv-params-secret-file", str(secret_file)]


def event_ports(held: list[socket.socket]) -> int:
    """p such that p, p+1 (the DP ranks' PUB) and p+10, p+11 (their replay) are reserved (their
    sockets appended to `held`): free of every other process until the engines are stopped,
    p0's restart included."""
    for _ in range(50):
        block = [reserve_port()]
        p = block[0].getsockname()[1]
        try:
            block += [reserve_port(q) for q in (p + 1, p + 10, p + 11)]
        except (OSError, OverflowError):  # one of them is taken (or past 65535): another block
            for sock in block:
                sock.close()
            continue
        held += block
        return p
    raise RuntimeError("no free port block")


class Engines:
    def __init__(self, logs, runner: list[str]):
        self.model = model_dir()
        self.logs = logs
        self.runner = runner
        self.secret_file = logs / "kv-secret"
        self.secret_file.write_text(SECRET + "\n")
        self.held: list[socket.socket] = []  # the reserved ports, released by stop()
        self.ports = {"p0": event_ports(self.held), "p1": event_ports(self.held)}
        self.p0_http = reserve_port()  # p0's HTTP port: it restarts on it
        self.held.append(self.p0_http)
        self.p0 = self.start_p0(logs / "p0.log")
        self.p1 = ServerUnderTest(self.model, "--kv-role", "producer", "--data-parallel-size", "2",
                                  *events_flags(self.ports["p1"], self.secret_file), *runner, log_path=logs / "p1.log")
        self.d = ServerUnderTest(self.model, "--kv-role", "consumer", *runner, log_path=logs / "d.log")
        for e in (self.p0, self.p1, self.d):
            e.wait_ready(START_TIMEOUT_S)

    def start_p0(self, log: pathlib.Path) -> EngineServer:
        return EngineServer(self.model, *ENGINE_ARGS, "--kv-role", "producer",
                            *events_flags(self.ports["p0"], self.secret_file), *self.runner,
                            port=self.p0_http.getsockname()[1], log=server_log(log), cwd=REPO)

    def restart_p0(self) -> None:
        """The same engine (HTTP port, event endpoints) back with an empty cache."""
        self.p0.stop()
        self.p0 = self.start_p0(self.logs / "p0-restarted.log")
        self.p0.wait_ready(START_TIMEOUT_S)

    def stop(self):
        try:
            for e in (self.p0, self.p1, self.d):
                e.stop()
        finally:
            for sock in self.held:
                sock.close()


@pytest.fixture(scope="module", params=["real", "simulated"])
def engines(request, tmp_path_factory):
    """The engines with the real model runner, or the simulated one (atomd/sim/), whose
    prefix cache and KV events are the real ones."""
    runner = [] if request.param == "real" else \
        sim_flags(default_model_profile(tmp_path_factory.mktemp("sim") / "profile.json"))
    e = Engines(tmp_path_factory.mktemp("engine-logs"), runner)
    yield e
    e.stop()


@pytest.fixture(scope="module")
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


def start_router(loop, engines, policy: str, secret_file: pathlib.Path | str | None = "engines'") -> Router:
    """A router with the engines' KV secret (or with `secret_file`'s, None: without one)."""
    secret_file = engines.secret_file if secret_file == "engines'" else secret_file

    async def go():
        r = Router(RouterConfig(prefill=[engines.p0.url, engines.p1.url], decode=[engines.d.url], port=0,
                                prefill_policy=policy, decode_policy="round_robin", health_interval_s=0.2,
                                kv_params_secret_file=None if secret_file is None else str(secret_file)))
        await r.start()
        return r
    return loop.run(go())


def complete(loop, router: Router, prompt: str) -> dict:
    r = loop.run(http("POST", router.url + "/v1/completions",
                      {"prompt": prompt, "max_tokens": 2, "temperature": 0}), timeout=60)
    assert r.status == 200, r.body
    return r.json()


send_completion = complete


def send_response(loop, router: Router, text: str) -> dict:
    """A /v1/responses request whose instructions are `text` but its last line (the input), its
    usage in chat's names."""
    instructions, _, question = text.rpartition("\n")
    r = loop.run(http("POST", router.url + "/v1/responses", {
        "instructions": instructions, "input": question, "max_output_tokens": 2, "temperature": 0}), timeout=60)
    assert r.status == 200, r.body
    u = r.json()["usage"]
    return {"usage": {"prompt_tokens": u["input_tokens"],
                      "prompt_tokens_details": {"cached_tokens": u["input_tokens_details"]["cached_tokens"]}}}


def prefill_counts(engines) -> dict[str, int]:
    return {name: json.loads(sync_http("GET", e.url + "/debug/stats")[1])["prefix_cache_queries"]
            for name, e in (("p0", engines.p0), ("p1", engines.p1))}


def placed(engines, before: dict) -> str:
    after = prefill_counts(engines)
    (name,) = [n for n in after if after[n] != before[n]]
    return name


def test_engines_report_their_event_endpoints_per_dp_rank(engines):
    info = json.loads(sync_http("GET", engines.p1.url + "/kv_transfer_info")[1])
    ranks = [r["kv_events"] for r in info["ranks"]]
    base = engines.ports["p1"]
    assert [r["endpoint"] for r in ranks] == [f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"]
    assert [r["replay_endpoint"] for r in ranks] == [f"tcp://127.0.0.1:{base + 10}", f"tcp://127.0.0.1:{base + 11}"]
    assert [r["dp_rank"] for r in ranks] == [0, 1] and {r["block_size"] for r in ranks} == {16}
    keys = kv_events_curve_keys(SECRET.encode())
    assert {(r["auth"], r["server_key"]) for r in ranks} == {("curve", keys.server_public.decode())}


def test_a_plain_subscriber_to_a_keyed_engine_fails_its_handshake_and_hears_nothing(engines):
    """vLLM's plain SUB (what any consumer opens) against an engine with the KV secret."""
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        mon = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                     | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sub.connect(f"tcp://127.0.0.1:{engines.ports['p0']}")
        assert mon.poll(10_000), "no handshake outcome"
        assert recv_monitor_message(mon)["event"] != zmq.EVENT_HANDSHAKE_SUCCEEDED
        assert not sub.poll(2500), "a plain subscriber got a batch (heartbeats go out every 2 s)"
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("policy,endpoint", [("kv_aware", "completions"), ("cache_aware", "completions"),
                                             ("kv_aware", "responses")])
def test_a_repeated_long_prefix_goes_to_the_engine_that_holds_it(engines, loop, policy, endpoint):
    """/v1/responses: the prefix is its `instructions`, placed by the chat prompt it renders to."""
    router = start_router(loop, engines, policy)
    complete = send_completion if endpoint == "completions" else send_response
    try:
        for e in (engines.p0, engines.p1):
            assert sync_http("POST", e.url + "/reset_prefix_cache")[0] == 200
        if policy == "kv_aware":
            wait_until(lambda: len(router.kv_index.ranks) == 3, 20, "subscriptions to 3 ranks")
            wait_until(lambda: all(not st.hashes and st.last_seq is not None
                                   for st in router.kv_index.ranks.values()), 20, "the reset to be seen")
        prefix = PREFIX + policy + endpoint
        before = prefill_counts(engines)
        first = complete(loop, router, prefix + "\n# first")
        home = placed(engines, before)
        hits = []
        for i in range(4):
            if policy == "kv_aware":  # the events of the last prefill reach the router first
                wait_until(lambda: router.kv_index.ranks and any(
                    st.hashes for st in router.kv_index.ranks.values()), 10, "events")
            before = prefill_counts(engines)
            out = complete(loop, router, prefix + f"\n# variant {i}")
            assert placed(engines, before) == home, f"request {i} left the engine holding the prefix"
            hits.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert min(hits) >= 16 * ((first["usage"]["prompt_tokens"] - 1) // 16) - 32, hits
        if endpoint == "responses":
            assert router.tokenizer is not None  # rendered and tokenized, not placed by load
        decisions = router.metrics.decisions
        want = "kv_hit" if policy == "kv_aware" else "cache_hit"
        assert decisions.get(("prefill", policy, want), 0) >= 4
        if policy == "kv_aware":
            assert sum(router.metrics.kv_hit["prefill"].recent) >= 4 * 16
    finally:
        loop.run(router.stop())


def test_kv_aware_repairs_a_gap_from_replay_and_clears_a_restarted_engine(engines, loop):
    router = start_router(loop, engines, "kv_aware")
    try:
        index = router.kv_index
        wait_until(lambda: len(index.ranks) == 3 and all(st.last_seq is not None for st in index.ranks.values()),
                   20, "subscriptions")
        st = index.ranks[(engines.p0.url, 0)]
        # forced gap: the router stops listening to p0 while p0 caches a new prefix
        st.task.cancel()
        wait_until(lambda: st.task.done(), 5, "the subscriber to stop")
        prompt = PREFIX + "# cached while the router was not listening\n"
        r = sync_http("POST", engines.p0.url + "/v1/completions", {"prompt": prompt, "max_tokens": 1})
        assert r[0] == 200
        seen = st.last_seq

        async def resubscribe():
            import asyncio
            st.task = asyncio.get_running_loop().create_task(index._subscribe(st))
        loop.run(resubscribe())
        wait_until(lambda: st.gaps >= 1 and st.repaired >= 1 and st.last_seq > seen, 20, "the gap repaired")
        before = prefill_counts(engines)
        out = complete(loop, router, prompt + "# through the router")
        assert placed(engines, before) == "p0" and out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert st.hashes
        # restart: the same p0 comes back with an empty cache; its numbering starts over
        engines.restart_p0()
        wait_until(lambda: st.restarts >= 1 and st.last_seq is not None, 30, "the restart to be seen")
        assert index.ranks[(engines.p0.url, 0)] is st and st.hashes == set()  # it holds nothing, and we know
    finally:
        loop.run(router.stop())


def test_a_stale_rank_scores_an_empty_cache(engines, loop):
    router = start_router(loop, engines, "kv_aware")
    try:
        index = router.kv_index
        wait_until(lambda: len(index.ranks) == 3 and all(st.last_seq is not None for st in index.ranks.values()),
                   20, "subscriptions")
        st = index.ranks[(engines.p1.url, 0)]
        st.hashes.add(12345)
        assert index.match(st, [12345]) == 1
        st.last_msg = time.monotonic() - index.stale_s - 1  # as if its events stopped
        assert index.match(st, [12345]) == 0
    finally:
        loop.run(router.stop())


@pytest.mark.parametrize("secret", [None, "another secret"])
def test_a_router_without_the_kv_secret_records_why_and_places_by_load(engines, loop, tmp_path, secret):
    secret_file = None
    if secret is not None:
        secret_file = tmp_path / "other-secret"
        secret_file.write_text(secret)
    router = start_router(loop, engines, "kv_aware", secret_file)
    try:
        index = router.kv_index
        wait_until(lambda: {engines.p0.url, engines.p1.url} <= set(index.errors), 20, "the refusals")
        assert index.ranks == {}
        why = "no KV secret" if secret is None else "another KV secret"
        r = loop.run(http("GET", router.url + "/workers"))
        by_url = {w["url"]: w for w in r.json()["workers"]}
        for url in (engines.p0.url, engines.p1.url):
            assert why in by_url[url]["kv_events_error"] and by_url[url]["kv_events"] == []
        for i in range(2):  # still served, placed by load
            assert complete(loop, router, PREFIX + f"# unkeyed {i}")["usage"]["prompt_tokens"] > 0
        decisions = router.metrics.decisions
        assert decisions.get(("prefill", "kv_aware", "no_hit"), 0) >= 2
        assert decisions.get(("prefill", "kv_aware", "kv_hit"), 0) == 0
    finally:
        loop.run(router.stop())


def test_x_request_id_reaches_both_engines_access_logs(engines, loop):
    router = start_router(loop, engines, "round_robin")
    try:
        r = loop.run(http("POST", router.url + "/v1/completions", {"prompt": "def f(x):", "max_tokens": 2},
                          headers={"X-Request-Id": "trace-me-15"}), timeout=60)
        assert r.status == 200
        logs = sorted(engines.logs.glob("*.log"))

        def lines():
            out = []
            for path in logs:
                for line in path.read_text(errors="replace").splitlines():
                    if line.startswith("{") and '"trace-me-15"' in line:
                        out.append((path.name, json.loads(line)))
            return out
        wait_until(lambda: len(lines()) == 2, 10, "one access line on P and one on D")
        found = lines()
        assert {name for name, _ in found} - {"d.log"} and "d.log" in {name for name, _ in found}
        assert all(entry["path"] == "/v1/completions" and entry["status"] == 200 for _, entry in found)
    finally:
        loop.run(router.stop())


def test_dashboard_state_shows_engine_kv_usage_and_event_state(engines, loop):
    router = start_router(loop, engines, "kv_aware")
    try:
        wait_until(lambda: len(router.kv_index.ranks) == 3, 20, "subscriptions")
        r = loop.run(http("GET", router.url + "/dashboard/state"))
        assert r.status == 200
        state = r.json()
        by_url = {w["url"]: w for w in state["workers"]}
        assert set(by_url) == {engines.p0.url, engines.p1.url, engines.d.url}
        for w in state["workers"]:
            assert w["healthy"] and "kv_cache_usage_perc" in w["engine"] and "num_requests_running" in w["engine"]
        assert [r["dp_rank"] for r in by_url[engines.p1.url]["kv_events"]] == [0, 1]
        assert by_url[engines.p1.url]["dp_size"] == 2
        assert state["policies"]["prefill"] == "kv_aware"
    finally:
        loop.run(router.stop())


def test_a_replay_refused_by_the_handshake_gives_up_in_bounded_time(monkeypatch):
    """An engine whose KV secret changed under the router refuses the replay DEALER's CURVE
    handshake; libzmq then drops the DEALER's only pipe, and an unbounded send would wait for
    ever, leaving that rank's subscription stuck. The replay must come back empty in bounded time."""
    import asyncio
    from atomd.engine.kv_events import KVEventPublisher
    from router import kv_index
    from router.kv_index import KVIndex, RankState
    monkeypatch.setattr(kv_index, "REPLAY_TIMEOUT_S", 0.3)
    tcp = lambda: f"tcp://127.0.0.1:{free_port()}"  # noqa: E731
    pub = KVEventPublisher(tcp(), tcp(), heartbeat_s=0.05, secret=b"the engine's new secret")
    index = KVIndex(secret=b"the secret the router was given")
    # it knows the engine's server key but not the client key: ZAP refuses it (the case that drops the pipe)
    index.keys = index.keys._replace(server_public=kv_events_curve_keys(b"the engine's new secret").server_public)
    make_socket = index._socket

    def handshake_over_before_use(kind, st):
        """The DEALER as a descheduled router thread finds it: connected and already refused."""
        sock = make_socket(kind, st)
        connect = sock.connect

        def connect_and_wait(endpoint):
            sock.monitor(f"inproc://handshake-{id(sock)}", zmq.EVENT_HANDSHAKE_FAILED_AUTH)
            mon = zmq.Context.shadow(index.ctx.underlying).socket(zmq.PAIR)
            mon.connect(f"inproc://handshake-{id(sock)}")
            connect(endpoint)
            assert mon.poll(5000), "the handshake was not refused"
            assert recv_monitor_message(mon)["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
            sock.disable_monitor()
            mon.close(linger=0)
        object.__setattr__(sock, "connect", connect_and_wait)
        return sock
    monkeypatch.setattr(index, "_socket", handshake_over_before_use)
    try:
        st = RankState("http://engine", 0, pub.endpoint, pub.replay_endpoint, "", 16, curve=True)

        async def fetches():
            return [await asyncio.wait_for(index._fetch(st, 0), 10) for _ in range(3)]
        assert asyncio.run(fetches()) == [[]] * 3
        assert st.replays == 3 and pub.num_auth_refused >= 3
    finally:
        index.ctx.destroy(linger=0)
        pub.close()
