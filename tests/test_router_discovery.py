"""The router's DNS discovery (router/discovery.py): --prefill-dns / --decode-dns NAME:PORT.

Unit tests drive DnsDiscovery and an in-process Router over fake engines with a fake
resolver (names -> 127.0.0.1 ports that the test changes, as a `kubectl scale` or a
restarted pod would); the integration test runs the real router CLI with a real name
(`localhost`, resolved by getaddrinfo) in front of fake engines.
"""
from __future__ import annotations

import asyncio
import json
import socket

import pytest

from benchmarks.fake_engine import FakeEngine
from launch.process import RouterServer, http as sync_http
from router.__main__ import parse_args
from router.app import Router, RouterConfig
from router.discovery import DnsDiscovery, DnsTarget, NameNotFound, parse_target, system_resolver, targets_of
from router.workers import WorkerRegistry
from tests.fake_workers import Cluster, LoopThread, http, wait_until

COMPLETION = {"model": "fake-model", "prompt": "the quick brown fox", "max_tokens": 4}


class FakeDNS:
    """name -> [(host, port)]; a name missing is NXDOMAIN, `failing` makes lookups time out."""

    def __init__(self, records: dict[str, list[tuple[str, int]]] | None = None):
        self.records = dict(records or {})
        self.failing: Exception | None = None
        self.lookups = 0

    async def __call__(self, name: str, port: int) -> list[tuple[str, int]]:
        self.lookups += 1
        if self.failing is not None:
            raise self.failing
        if name not in self.records:
            raise NameNotFound(name)
        return list(self.records[name])


def urls(registry: WorkerRegistry, role: str) -> list[str]:
    return sorted(w.url for w in registry.workers(role))


# ---------------------------------------------------------------------- parsing


@pytest.mark.unit
def test_targets_parse_and_bad_ones_are_named():
    assert parse_target("atomd-prefill.ns.svc.cluster.local:8000", "prefill") == \
        DnsTarget("prefill", "atomd-prefill.ns.svc.cluster.local", 8000)
    assert [str(t) for t in targets_of(["p:1", "q:2"], ["d:3"])] == ["p:1", "q:2", "d:3"]
    for bad in ("no-port", "name:http", "http://name:8000", "name:0", "name:70000", ":8000", "[::1]:8000"):
        with pytest.raises(ValueError, match="prefill_dns"):
            parse_target(bad, "prefill")
    with pytest.raises(ValueError, match="decode_dns"):
        RouterConfig(decode_dns=["decode"])
    with pytest.raises(ValueError, match="dns_refresh_s"):
        RouterConfig(dns_refresh_s=0)


@pytest.mark.unit
def test_cli_takes_repeated_dns_names_next_to_static_urls():
    cfg = parse_args(["--prefill-dns", "p.svc:8000", "--prefill-dns", "p2.svc:8000", "--decode-dns", "d.svc:9000",
                      "--decode", "http://127.0.0.1:8200", "--dns-refresh-s", "0.5"])
    assert cfg.prefill_dns == ["p.svc:8000", "p2.svc:8000"] and cfg.decode_dns == ["d.svc:9000"]
    assert cfg.decode == ["http://127.0.0.1:8200"] and cfg.dns_refresh_s == 0.5
    assert RouterConfig().dns_refresh_s == 5.0


@pytest.mark.unit
def test_system_resolver_resolves_a_real_name_and_reports_a_missing_one():
    async def go():
        assert ("127.0.0.1", 8000) in await system_resolver("localhost", 8000)
        with pytest.raises(NameNotFound):
            await system_resolver("no-such-host.invalid", 8000)  # RFC 6761: never resolves

    asyncio.run(go())


# ---------------------------------------------------------------------- DnsDiscovery over a registry


def run_discovery(dns: FakeDNS, scenario, prefill=("p.svc:8000",), decode=("d.svc:8000",)):
    async def go():
        registry = WorkerRegistry(health_interval_s=60)
        discovery = DnsDiscovery(registry, targets_of(list(prefill), list(decode)), 60, dns)
        try:
            await scenario(registry, discovery)
        finally:
            await discovery.close()
            await registry.close()

    asyncio.run(go())


@pytest.mark.unit
def test_scale_up_and_down_follows_the_records():
    dns = FakeDNS({"p.svc": [("10.0.0.1", 8000)], "d.svc": [("10.0.1.1", 8000), ("fd00::7", 8000)]})

    async def scenario(registry, discovery):
        await discovery.refresh()
        assert urls(registry, "prefill") == ["http://10.0.0.1:8000"]
        assert urls(registry, "decode") == ["http://10.0.1.1:8000", "http://[fd00::7]:8000"]
        dns.records["p.svc"] = [("10.0.0.1", 8000), ("10.0.0.2", 8000), ("10.0.0.3", 8000)]  # scale to 3
        await discovery.refresh()
        assert urls(registry, "prefill") == [f"http://10.0.0.{i}:8000" for i in (1, 2, 3)]
        dns.records["p.svc"] = [("10.0.0.9", 8000)]  # a rollout: every pod replaced, new IPs
        await discovery.refresh()
        assert urls(registry, "prefill") == ["http://10.0.0.9:8000"]
        assert {d["name"]: d["workers"] for d in discovery.describe()} == {
            "p.svc:8000": ["http://10.0.0.9:8000"], "d.svc:8000": ["http://10.0.1.1:8000", "http://[fd00::7]:8000"]}

    run_discovery(dns, scenario)


@pytest.mark.unit
def test_a_name_that_no_longer_exists_empties_it_but_a_failed_lookup_keeps_the_last_answer():
    dns = FakeDNS({"p.svc": [("10.0.0.1", 8000)], "d.svc": [("10.0.1.1", 8000)]})

    async def scenario(registry, discovery):
        await discovery.refresh()
        dns.failing = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        await discovery.refresh()
        assert urls(registry, "prefill") == ["http://10.0.0.1:8000"]  # a DNS hiccup empties nothing
        assert all("Temporary failure" in d["error"] for d in discovery.describe())
        dns.failing = asyncio.TimeoutError()
        await discovery.refresh()
        assert urls(registry, "decode") == ["http://10.0.1.1:8000"]
        dns.failing = None
        del dns.records["p.svc"]  # a headless Service with no pods: NXDOMAIN
        await discovery.refresh()
        assert urls(registry, "prefill") == [] and urls(registry, "decode") == ["http://10.0.1.1:8000"]
        assert all(d["error"] is None for d in discovery.describe())

    run_discovery(dns, scenario)


@pytest.mark.unit
def test_static_and_registered_workers_are_never_removed_and_a_deleted_one_returns():
    dns = FakeDNS({"p.svc": [("10.0.0.1", 8000), ("10.0.0.2", 8000)], "d.svc": []})

    async def scenario(registry, discovery):
        registry.add("http://10.0.0.1:8000", "prefill")  # static (--prefill) before discovery starts
        await discovery.refresh()
        assert urls(registry, "prefill") == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
        dns.records["p.svc"] = []
        await discovery.refresh()
        assert urls(registry, "prefill") == ["http://10.0.0.1:8000"]  # only what discovery added leaves
        dns.records["p.svc"] = [("10.0.0.3", 8000)]
        await discovery.refresh()
        await registry.remove("http://10.0.0.3:8000", "prefill")  # DELETE /workers
        await discovery.refresh()
        assert "http://10.0.0.3:8000" in urls(registry, "prefill")  # DNS still names it

    run_discovery(dns, scenario)


@pytest.mark.unit
def test_removal_waits_for_the_requests_in_flight():
    dns = FakeDNS({"p.svc": [("10.0.0.1", 8000)], "d.svc": [("10.0.1.1", 8000)]})

    async def scenario(registry, discovery):
        await discovery.refresh()
        worker = registry.workers("decode")[0]
        worker.healthy = True
        worker.acquire()  # a decode leg streaming
        dns.records["d.svc"] = []
        await discovery.refresh()
        assert registry.workers("decode") == [] and not worker.available()  # out of rotation at once
        assert not worker.session.closed  # but its connection stays for the leg in flight
        await worker.release()
        assert worker.session.closed

    run_discovery(dns, scenario)


# ---------------------------------------------------------------------- a router over fake engines


class DnsCluster(Cluster):
    """An in-process router whose workers come only from `p.svc` / `d.svc` in a FakeDNS."""

    def __init__(self, loop: LoopThread, n_prefill: int, n_decode: int):
        super().__init__(loop, n_prefill, n_decode)
        self.dns = FakeDNS()

    def publish(self, prefill: list[FakeEngine], decode: list[FakeEngine]) -> None:
        self.dns.records = {"p.svc": [("127.0.0.1", e.port) for e in prefill],
                            "d.svc": [("127.0.0.1", e.port) for e in decode]}

    def start(self, published: int = 1) -> "DnsCluster":
        async def start():
            for e in self.prefill + self.decode:
                await e.start()
            self.publish(self.prefill[:published], self.decode[:published])
            cfg = RouterConfig(prefill_dns=["p.svc:8000"], decode_dns=["d.svc:8000"], dns_refresh_s=0.05,
                               health_interval_s=0.2, port=0)
            self.router = Router(cfg, resolver=self.dns)
            return await self.router.start()

        self.url = self.loop.run(start())
        return self

    def workers(self, role: str) -> list[str]:
        return sorted(w["url"] for w in self.get("/workers").json()["workers"] if w["role"] == role)



@pytest.fixture
def dns_cluster(loop, request):
    def make(n_prefill: int = 2, n_decode: int = 2, published: int = 1) -> DnsCluster:
        c = DnsCluster(loop, n_prefill, n_decode).start(published)
        request.addfinalizer(c.stop)
        return c
    return make


@pytest.mark.unit
def test_router_serves_through_discovered_workers_and_picks_up_a_scale_up(dns_cluster):
    c = dns_cluster()
    assert c.get("/ready").status == 200  # resolved and health-checked before start() returned
    r = c.loop.run(http("POST", c.url + "/v1/completions", json=COMPLETION))
    assert r.status == 200 and r.json()["choices"][0]["text"] == "Hello, world!"
    c.publish(c.prefill, c.decode)  # kubectl scale --replicas=2, both roles
    wait_until(lambda: len(c.workers("prefill")) == 2 and len(c.workers("decode")) == 2, 5, "the scale-up")
    wait_until(lambda: c.get("/ready").json()["available"] == {"prefill": 2, "decode": 2}, 5, "new pods ready")
    for _ in range(4):
        assert c.loop.run(http("POST", c.url + "/v1/completions", json=COMPLETION)).status == 200
    assert all(e.requests for e in c.prefill + c.decode)  # round robin reached the new pods


@pytest.mark.unit
def test_a_pod_gone_from_dns_finishes_its_stream_and_gets_no_new_requests(dns_cluster):
    c = dns_cluster(n_prefill=1, n_decode=2, published=2)
    d0, d1 = c.decode
    wait_until(lambda: len(c.workers("decode")) == 2, 5, "both decode pods")
    d0.hold_after_first_event.clear()
    d1.hold_after_first_event.clear()
    streaming = asyncio.run_coroutine_threadsafe(
        http("POST", c.url + "/v1/completions", json=dict(COMPLETION, stream=True)), c.loop.loop)
    wait_until(lambda: any(e.streams for e in c.decode), 5, "the stream to start")
    busy, other = (d0, d1) if d0.streams else (d1, d0)
    other.hold_after_first_event.set()
    c.publish(c.prefill, [other])  # the busy pod's IP leaves the Service (scale-down, eviction)
    wait_until(lambda: c.workers("decode") == [other.url], 5, "the removal")
    busy.hold_after_first_event.set()
    reply = streaming.result(10)
    assert reply.status == 200
    assert reply.body.rstrip().endswith(b"data: [DONE]") and b'"error"' not in reply.body  # not cut
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in reply.body.decode().split("\n\n")
                   if line.startswith("data: {"))
    assert text == "Hello, world!"
    before = len(busy.requests)
    for _ in range(3):
        assert c.loop.run(http("POST", c.url + "/v1/completions", json=COMPLETION)).status == 200
    assert len(busy.requests) == before  # new requests all went to the pod DNS still names


# ---------------------------------------------------------------------- the real CLI, a real name


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_router_process_finds_engines_by_a_real_dns_name(loop, request):
    engines = [FakeEngine("prefill"), FakeEngine("decode")]
    for e in engines:
        loop.run(e.start())
    request.addfinalizer(lambda: [loop.run(e.stop()) for e in engines])
    p, d = engines
    router = RouterServer((), (), "--prefill-dns", f"localhost:{p.port}", "--decode-dns", f"localhost:{d.port}",
                          "--dns-refresh-s", "0.2", "--health-interval-s", "0.2", log="/dev/null")
    request.addfinalizer(router.stop)
    router.wait_ready(60)
    status, body = sync_http("POST", router.url + "/v1/completions", COMPLETION)
    assert status == 200 and json.loads(body)["choices"][0]["text"] == "Hello, world!"
    status, body = sync_http("GET", router.url + "/workers")
    listing = json.loads(body)
    assert {(w["role"], w["url"]) for w in listing["workers"]} >= {("prefill", p.url), ("decode", d.url)}
    assert [x["name"] for x in listing["dns"]] == [f"localhost:{p.port}", f"localhost:{d.port}"]
