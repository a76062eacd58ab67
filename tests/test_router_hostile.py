"""Hostile clients and workers against the router (issue #42, the router's findings), each
with the probe's inputs scaled to seconds, asserting what a user sees.

- 2: a request that makes the engines answer 500 never opens a breaker, however many come;
  a worker fault still does (tests/test_router_faults.py keeps those);
- 3: a trickling head or body is cut at its deadline (408), an idle connection sending only
  line ends at the idle one; partial uploads are bounded together (503), a chunked body in
  2-byte chunks and unread pipelined requests cost bounded memory, returned after close;
- 4: `"kv_transfer_params": null` is a client's params like any other: dropped, counted;
- 8: P's params that would crash D (bad logprobs shape, a huge token id) are P's fault: the
  request is served by another P, D never sees them;
- 9: one SSE event without end, in 4 KB chunks, costs the router linear work: cut at
  --max-upstream-event-bytes, the loop free meanwhile;
- 12: /kv_transfer_info fetched with the API key; /metrics shows engine URLs only to the
  key /workers takes; error bodies echo no oversized input, no traceback, no path.

The RSS and loop checks run a router process (benchmarks/router_attacks.py, which
measures the same attacks before and after) in front of a hostile worker.
"""
from __future__ import annotations

import asyncio
import pathlib
import select
import socket
import time

import aiohttp
import pytest

from benchmarks import router_attacks as A
from tests.fake_workers import Cluster, make

__all__ = ["make"]  # the fixture, shared (tests/fake_workers.py)

REPO = pathlib.Path(__file__).resolve().parents[1]
MIB = 1 << 20
COMPLETION = {"model": "fake-model", "prompt": "the quick brown fox", "max_tokens": 4}


def breakers(c: Cluster, headers: dict | None = None) -> dict[str, str]:
    return {w["url"]: w["circuit_breaker"] for w in c.get("/workers", headers).json()["workers"]}


# ------------------------------------------------------------------ 2: request-caused 5xx

@pytest.mark.unit
@pytest.mark.timeout(60)
def test_eleven_requests_that_break_the_engines_open_no_breaker(make):
    """The probe: guided_json nested 5,000 deep made P's engine answer 500; eleven in 0.08 s
    opened P's then D's breaker and every client got 503 for 10 s."""
    c = make(n_prefill=2)
    for p in c.prefill:
        p.fail_status, p.fail_message = 500, "RecursionError: maximum recursion depth exceeded"
    bomb = dict(COMPLETION, guided_json="[" * 5000)

    async def burst():
        async with aiohttp.ClientSession() as s:
            async def one():
                async with s.post(c.url + "/v1/completions", json=bomb) as r:
                    return r.status
            return await asyncio.gather(*(one() for _ in range(11)))

    assert c.loop.run(burst()) == [502] * 11
    assert set(breakers(c).values()) == {"closed"}
    for p in c.prefill:
        p.fail_status = None
    r = c.post("/v1/completions", COMPLETION)  # the next client is served, over two legs
    assert r.status == 200 and len(c.decode[0].requests) == 1


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_worker_that_cannot_serve_still_opens_its_breaker(make):
    c = make(breaker_failures=2)
    c.prefill[0].fail_status = 503  # the engine core is dead
    for _ in range(2):
        c.post("/v1/completions", COMPLETION)
    assert breakers(c)[c.prefill[0].url] == "open"


# ------------------------------------------------------------------ 4: null params

@pytest.mark.unit
@pytest.mark.timeout(60)
def test_null_kv_transfer_params_are_scrubbed_and_counted(make):
    c = make()
    r = c.post("/v1/completions", dict(COMPLETION, kv_transfer_params=None))
    assert r.status == 200
    sent = c.decode[0].requests[0][1]["kv_transfer_params"]
    assert sent is not None and sent["transfer_id"] == c.prefill[0].requests[0][1]["kv_transfer_params"]["transfer_id"]
    assert "atomd_router:client_kv_params_dropped_total 1.0" in c.get("/metrics").body.decode()


# ------------------------------------------------------------------ 8: a bad producer

@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", [{"first_token_logprobs": {"unexpected": 1}}, {"first_token_id": 10 ** 9},
                                 {"first_token_logprobs": {"logprob": -1.0, "top": [[-5, 0.0]]}},
                                 {"prompt_logprobs": [1, 2]}], ids=["logprobs_shape", "token_id", "top_id",
                                                                    "prompt_logprobs"])
def test_params_that_would_crash_d_are_the_prefill_workers_fault(make, bad):
    c = make(n_prefill=2, prefill_policy="round_robin", breaker_failures=1)
    hostile, good = c.prefill
    hostile.kv_extra = bad
    for _ in range(2):  # round robin: one of them goes to the hostile P first, then to the good one
        assert c.post("/v1/completions", COMPLETION).status == 200
    assert hostile.requests and all(
        b["kv_transfer_params"]["transfer_id"] in {g[1]["kv_transfer_params"]["transfer_id"] for g in good.requests}
        for _, b in c.decode[0].requests)  # D only ever got the good P's params
    assert breakers(c)[hostile.url] == "open"  # a worker fault
    c2 = make(breaker_failures=5)
    c2.prefill[0].kv_extra = bad
    r = c2.post("/v1/completions", COMPLETION)
    assert r.status == 502 and "invalid kv_transfer_params" in r.json()["error"]["message"]
    assert c2.decode[0].requests == []


# ------------------------------------------------------------------ 12: keys, metrics, bodies

@pytest.mark.unit
@pytest.mark.timeout(60)
def test_kv_transfer_info_is_fetched_with_the_api_key(make):
    c = make(api_key="sekret")  # every worker's info is fetched as it enters rotation
    assert [f.kv_info_authorizations for f in c.prefill + c.decode] == [["Bearer sekret"]] * 2


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("keys", [{"api_key": "k"}, {"api_key": "k", "admin_api_key": "adm"}])
def test_metrics_name_engine_urls_only_to_the_workers_key(make, keys):
    c = make(**keys)
    url = c.prefill[0].url
    open_text = c.get("/metrics").body.decode()
    assert "atomd_router:retries_total" in open_text
    assert url not in open_text and "circuit_breaker_state" not in open_text
    key = keys.get("admin_api_key", keys["api_key"])
    assert url in c.get("/metrics", {"Authorization": f"Bearer {key}"}).body.decode()
    if "admin_api_key" in keys:  # a client key does not show them either
        assert url not in c.get("/metrics", {"Authorization": "Bearer k"}).body.decode()
    open_cluster = make()  # no key at all: as before
    assert open_cluster.prefill[0].url in open_cluster.get("/metrics").body.decode()


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_error_bodies_echo_no_oversized_input_no_traceback_no_path(make):
    c = make()
    huge = "x" * 200_000
    for r in (c.post("/v1/completions", dict(COMPLETION, stream=huge)),
              c.get("/" + "y" * 8000)):
        assert r.status in (400, 404) and len(r.body) < 1000, r.body[:200]
    c.prefill[0].fail_status = 500
    c.prefill[0].fail_message = ("KeyError: 'logprob'\nTraceback (most recent call last):\n  File "
                                 "\"/opt/atomd/atomd/engine/llm_engine.py\", line 12, in step\n" + huge)
    r = c.post("/v1/completions", COMPLETION)
    assert r.status == 502 and len(r.body) < 1000
    assert b"Traceback" not in r.body and b".py" not in r.body and b"KeyError" in r.body


# ------------------------------------------------------------------ 3, 9: a router process

@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    log = tmp_path_factory.mktemp("router") / "router.log"
    with A.Bench(REPO, 3 * MIB, "--max-upstream-event-bytes", str(2 * MIB), "--client-header-timeout-s", "1",
                 "--client-body-timeout-s", "1.5", "--client-idle-timeout-s", "2.5",
                 "--max-pending-body-bytes", str(8 * MIB), "--breaker-failures", "1000", log=str(log)) as b:
        b.alone = A.probe_alone(b.port, 0.5)  # GET /health latency with no attack
        yield b


def answer_and_close(s: socket.socket, timeout_s: float) -> bytes:
    """What the router sends before it closes `s` (AssertionError when it does not)."""
    s.settimeout(timeout_s)
    got = bytearray()
    deadline = time.monotonic() + timeout_s
    try:
        while chunk := s.recv(65536):
            got += chunk
            assert time.monotonic() < deadline, "not closed"
    except socket.timeout:
        raise AssertionError(f"the router kept the connection open {timeout_s} s; sent {bytes(got[:200])!r}")
    except ConnectionResetError:
        pass
    return bytes(got)


def serves(b: A.Bench) -> bool:
    status, _ = A.http_get(b.port, "/openapi.json")
    return status == 200


def kept_its_pace(b: A.Bench, out: dict) -> bool:
    """/health during the attack answered in the same order of time as alone (median, 20x)."""
    return out["health_during"]["median_ms"] <= 20 * b.alone["median_ms"]


def trickle(sends: dict[socket.socket, bytes], rounds: int, interval_s: float) -> dict[socket.socket, bytes]:
    """Send each socket its bytes one per `interval_s` until the router answers it; what
    each got before the router closed it (b"" for a close without a word)."""
    got: dict[socket.socket, bytes] = {}
    for i in range(rounds):
        for s, data in sends.items():
            if s in got:
                continue
            r, _, _ = select.select([s], [], [], 0)
            if r:
                got[s] = answer_and_close(s, 10)
            elif i < len(data):
                try:
                    s.sendall(data[i:i + 1])
                except OSError:
                    got[s] = b""
        time.sleep(interval_s)
    for s in sends:
        if s not in got:
            got[s] = answer_and_close(s, 10)
    return got


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_trickled_heads_and_bodies_are_cut_at_their_deadlines(bench):
    """Deadlines 1 s (head), 1.5 s (body), 2.5 s (idle); a byte every 0.25 s for 4 s."""
    one_byte = A.connect(bench.port)
    one_byte.sendall(b"G")  # the probe's: one byte, then nothing
    heads = [A.connect(bench.port) for _ in range(20)]
    line_ends = A.connect(bench.port)
    body = A.connect(bench.port)
    body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
    sends = {s: b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 1000 for s in heads}
    sends[line_ends] = b"\r\n" * 1000  # what a parser skips between requests: still idle
    sends[body] = b"x" * 999
    got = trickle(sends, 16, 0.25)
    assert answer_and_close(one_byte, 10).startswith(b"HTTP/1.1 408 ")
    assert all(got[s].startswith(b"HTTP/1.1 408 ") for s in heads), {got[s][:40] for s in heads}
    assert got[body].startswith(b"HTTP/1.1 408 ") and b"body" in got[body]
    assert got[line_ends] == b""  # closed (idle) without a word
    assert serves(bench)
    for s in [one_byte, *heads, line_ends, body]:
        s.close()


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_partial_uploads_are_bounded_together_and_memory_returns(bench):
    out = bench.measure(A.partial_uploads, 8, 4 * MIB, 3 * MIB, settle_s=1.0)
    assert out["router_alive"] and serves(bench) and kept_its_pace(bench, out), (bench.alone, out)
    # 8 uploads of 3 MiB: the 8 MiB budget takes two; the others are refused (503) and closed
    assert out["rss_peak_mib"] - out["rss_before_mib"] < 40, out
    assert out["rss_after_mib"] - out["rss_before_mib"] < 16, out


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_body_in_two_byte_chunks_costs_bounded_memory(bench):
    s = A.connect(bench.port)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    try:
        s.sendall(b"2\r\nxx\r\n" * 200_000)
    except OSError:
        pass
    assert answer_and_close(s, 10).startswith(b"HTTP/1.1 400 ")
    s.close()
    out = bench.measure(A.chunked_tiny, 3, 3 * MIB, settle_s=1.0)  # the probe's three, scaled
    assert out["router_alive"] and serves(bench) and kept_its_pace(bench, out), (bench.alone, out)
    assert out["rss_peak_mib"] - out["rss_before_mib"] < 24, out
    assert out["rss_after_mib"] - out["rss_before_mib"] < 16, out


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_pipelined_requests_never_read_cost_bounded_memory(bench):
    out = bench.measure(A.pipelined, 200_000, settle_s=1.0)  # ~5,000 GET /openapi.json (24 KB each)
    assert out["router_alive"] and serves(bench) and kept_its_pace(bench, out), (bench.alone, out)
    assert out["rss_peak_mib"] - out["rss_before_mib"] < 24, out
    assert out["rss_after_mib"] - out["rss_before_mib"] < 16, out


@pytest.mark.unit
@pytest.mark.timeout(120)
def test_an_sse_event_without_end_costs_linear_work_and_is_cut(bench):
    """One event of 3 MiB (limit 2 MiB), in 4 KB chunks, against the same bytes in 256 KB
    chunks: linear relaying takes the same order of time (quadratic took over 100x). The
    hostile worker's breaker is kept out of the way (a cut event is its fault)."""

    def timed(chunk: int) -> tuple[float, dict]:
        bench.worker.chunk = chunk
        t = time.perf_counter()
        out = A.sse_bomb(bench.port)
        return time.perf_counter() - t, out

    with A.Prober(bench.port) as probes:
        small = min(timed(4096) for _ in range(3))
    big = min(timed(256 << 10) for _ in range(3))
    for _, out in (small, big):
        assert out["status"] == 502 and out["error"], out  # cut before any event reached the client
    assert small[0] < 20 * big[0], (small, big)  # the same order (quadratic: > 100x)
    assert probes.latencies and bench.router.alive() and serves(bench)


@pytest.mark.chaos
@pytest.mark.timeout(600)
def test_the_probes_attacks_at_their_full_sizes(tmp_path):
    """The probe's own sizes (~1 minute, `make chaos`): a 16 MiB event in 4 KB chunks, three
    15 MiB bodies in 2-byte chunks, twelve 15.9 MiB partial uploads of 16 MiB, 780 KB of
    unread pipelined requests, 200 slow heads."""
    with A.Bench(REPO, 17 * MIB, "--client-header-timeout-s", "5", log=str(tmp_path / "router.log")) as b:
        alone = A.probe_alone(b.port)
        sse = b.measure(A.sse_bomb)
        assert sse["status"] == 502 and sse["error"], sse
        assert sse["health_during"]["median_ms"] <= 5 * alone["median_ms"], (alone, sse)
        chunked = b.measure(A.chunked_tiny, 3, 15 * MIB)
        assert chunked["rss_peak_mib"] - chunked["rss_before_mib"] < 32, chunked
        partial = b.measure(A.partial_uploads, 12, 16 * MIB, int(15.9 * MIB))
        assert partial["rss_peak_mib"] - partial["rss_before_mib"] < 128 + 32, partial  # the 128 MiB budget
        assert partial["rss_after_mib"] - partial["rss_before_mib"] < 24, partial
        piped = b.measure(A.pipelined, 780_000)
        assert piped["rss_peak_mib"] - piped["rss_before_mib"] < 24, piped
        slow = A.slowloris(b.port, 200, 15, 5)
        assert slow["still_open"] == 0, slow
        assert b.router.alive() and serves(b)
