"""Prefill/decode disaggregation end to end: router -> P (producer) -> D (consumer), real
processes on 127.0.0.1, against a colocated `atomd serve` as the reference; every test runs
with the real model runner and with the simulated one (`runner`).

One cluster per KV transfer backend (zmq, mooncake: every test runs over both), sharing
one reference: P and D behind the main router, P2 (killed in the
P-crash test) and DR (a recompute-policy consumer behind a second router with P, killed
in the D-crash test) and DK (killed before it could pull); the mooncake cluster adds PZ,
a zmq producer, for the mixed-backend refusal. P's lease and the consumers' receive timeout are short so the
fault tests end quickly. After every test each live engine is idle with all its blocks
free, and P has no block pinned.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import uuid

import numpy as np
import openai
import pytest

from launch.process import http
from tests.kv_backends import BACKENDS, require_backend
from tests.pd_fixtures import PDCluster, block_bytes, kill_engine, metric, metrics, sse_events
from tests.sim_fixtures import default_model_profile, sim_flags

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

LEASE = ["--kv-lease-s", "3"]
RECV_TIMEOUT = ["--kv-recv-timeout-s", "3"]
VOCAB = 4096  # the default model's (config.json)


@pytest.fixture(scope="module", params=["real", "simulated"])
def runner(request, tmp_path_factory) -> list[str]:
    """Every engine's model runner: the model, or the simulated one (atomd/sim/) with a
    profile of the built-in model's shape, which must behave the same on every path."""
    if request.param == "real":
        return []
    return sim_flags(default_model_profile(tmp_path_factory.mktemp("sim") / "profile.json"))


@pytest.fixture(scope="module")
def references():
    """The colocated references, one per runner, each started at first use and stopped at the
    module's end: pytest orders this module's clusters backend-major (real, simulated, then
    simulated, real), so a reference stopped with its runner would start again."""
    cluster = PDCluster()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def reference(runner, references):
    """The colocated engine every backend's cluster is compared with."""
    name = "ref-simulated" if runner else "ref-real"
    if name not in references.engines:
        references.start_engines(**{name: [*runner]})
    return references[name]


# mooncake first: test_mixed_backends_are_refused_at_the_handshake asks for the mooncake cluster
# alone (its own parametrize: param index 0), and pytest groups a module's tests by a fixture's
# param *index* when it orders them: at index 1 that test went among the zmq cluster's tests and
# the mooncake cluster started twice a runner
PD_BACKENDS = sorted(BACKENDS, key=lambda backend: backend != "mooncake")


@pytest.fixture(scope="module", params=PD_BACKENDS)
def pd(request, reference, runner):
    require_backend(request.param)
    backend = ["--kv-transfer-backend", request.param, *runner]
    engines = dict(P=["--kv-role", "producer", *LEASE, *backend], D=["--kv-role", "consumer", *RECV_TIMEOUT, *backend],
                   P2=["--kv-role", "producer", *LEASE, *backend],
                   DR=["--kv-role", "consumer", *RECV_TIMEOUT, "--kv-load-failure-policy", "recompute", *backend],
                   DK=["--kv-role", "consumer", *backend])
    if request.param != "zmq":
        engines["PZ"] = ["--kv-role", "producer", *LEASE, *runner]  # the other backend, for the mixed-backend refusal
    cluster = PDCluster()
    cluster.backend = request.param
    try:
        cluster.start_engines(**engines)
        status, raw = http("POST", reference.url + "/reset_prefix_cache")  # cached_tokens as a fresh engine's
        assert status == 200 and json.loads(raw)["reset"] is True, raw
        cluster.engines["ref"] = reference
        cluster.router = cluster.start_router("P", "D")
        cluster.router_r = cluster.start_router("P", "DR")
        cluster.router_k = cluster.start_router("P", "DK")
        cluster.baseline = {name: e.stats()["num_total_blocks"] for name, e in cluster.engines.items()}
        yield cluster
    finally:
        cluster.engines.pop("ref", None)  # the reference outlives this backend's cluster
        cluster.stop()


@pytest.fixture(autouse=True)
def settled(pd):
    """After each test: every live engine idle, all blocks free, nothing pinned on P."""
    yield
    for name, engine in pd.engines.items():
        if engine.proc.poll() is None:
            engine.wait_idle(pd.baseline[name])
    # the router's abort of a transfer is fire-and-forget: it may still be on its way to P (a
    # client gone after P granted the blocks); it must land well inside the 3 s lease
    deadline = time.monotonic() + 2.0
    while metric(pd["P"], "atomd:kv_blocks_pinned") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(pd["P"], "atomd:kv_blocks_pinned") == 0


def token_prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, VOCAB, n)]


def complete(url: str, body: dict) -> tuple[int, dict | list]:
    status, raw = http("POST", url + "/v1/completions", body)
    if body.get("stream") and status == 200:
        return status, sse_events(raw)
    return status, json.loads(raw)


def streamed_text(events: list) -> str:
    return "".join(c["text"] for e in events for c in e.get("choices", []))


def prefill_leg(engine, prompt: list[int]) -> dict:
    """What the router sends P first; returns P's kv_transfer_params."""
    status, body = complete(engine.url, {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                         "kv_transfer_params": {"do_remote_decode": True,
                                                                "transfer_id": uuid.uuid4().hex}})
    assert status == 200, body
    return body["kv_transfer_params"]


@pytest.mark.parametrize("n", [5, 32, 150], ids=["under-one-block", "block-aligned", "many-blocks"])
def test_completions_equal_colocated(pd, n):
    body = {"prompt": token_prompt(n, n), "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    status, want = complete(pd["ref"].url, body)
    assert status == 200, want
    status, got = complete(pd.router.url, body)
    assert status == 200, got
    w, g = want["choices"][0], got["choices"][0]
    assert g["text"] == w["text"] and g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
    assert g["finish_reason"] == w["finish_reason"] == "length"
    np.testing.assert_allclose(g["logprobs"]["token_logprobs"], w["logprobs"]["token_logprobs"], atol=1e-4)
    assert got["usage"]["prompt_tokens"] == n and got["usage"]["completion_tokens"] == 12

    stream = dict(body, stream=True, logprobs=None)
    status, events = complete(pd.router.url, stream)
    assert status == 200
    assert streamed_text(events) == w["text"]
    assert metric(pd.router, "atomd_router:decision_total", decision="pd") >= 2
    assert metric(pd.router, "atomd_router:decision_total", decision="decode_without_kv") == 0  # KV moved


def test_chat_through_openai_client(pd):
    messages = [{"role": "user", "content": "Write a function that returns the sum of a list."}]
    ref = openai.OpenAI(base_url=pd["ref"].url + "/v1", api_key="x")
    routed = openai.OpenAI(base_url=pd.router.url + "/v1", api_key="x")
    kwargs = dict(model=ref.models.list().data[0].id, messages=messages, max_tokens=16, temperature=0)
    want = ref.chat.completions.create(**kwargs)
    got = routed.chat.completions.create(**kwargs)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.usage.completion_tokens == want.usage.completion_tokens
    chunks = routed.chat.completions.create(**kwargs, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.choices[0].message.content


def test_shared_prefix_pulls_only_the_delta(pd):
    """A second prompt sharing 4 full blocks: D pulls 1 block, cached_tokens as colocated."""
    first = token_prompt(1001, 80)  # 5 blocks
    second = first[:64] + token_prompt(1002, 10)  # 4 shared full blocks + 1 new
    d = pd["D"]
    for prompt, pulled_blocks in ((first, 5), (second, 1)):
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        status, want = complete(pd["ref"].url, body)
        assert status == 200, want
        before = metric(d, "atomd:kv_transfer_bytes_total")
        status, got = complete(pd.router.url, body)
        assert status == 200, got
        assert metric(d, "atomd:kv_transfer_bytes_total") - before == pulled_blocks * block_bytes()
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == \
            want["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 64


def test_kv_transfer_info(pd):
    cfg = json.loads((pd.model / "config.json").read_text())
    for name, role in (("P", "producer"), ("D", "consumer"), ("ref", "both")):
        status, raw = http("GET", pd[name].url + "/kv_transfer_info")
        info = json.loads(raw)
        assert status == 200 and info["role"] == role and info["dp_size"] == 1
        assert info["backend"] == (pd.backend if role != "both" else "zmq")
        assert info["compat"]["block_size"] == 16 and info["compat"]["dtype"] == "float32"
        assert info["compat"]["num_layers"] == cfg["num_hidden_layers"]
        assert info["compat"]["num_kv_heads"] == cfg["num_key_value_heads"]
        assert (info["side_channel"] is not None) == (role == "producer")
    assert json.loads(http("GET", pd["P"].url + "/kv_transfer_info")[1])["compat"] == \
        json.loads(http("GET", pd["D"].url + "/kv_transfer_info")[1])["compat"]


def test_unpulled_transfer_freed_by_lease_expiry_or_abort(pd):
    p = pd["P"]
    expired = metric(p, "atomd:kv_leases_expired_total")
    params = prefill_leg(p, token_prompt(7, 40))
    assert params["do_remote_prefill"] and len(params["remote_block_ids"]) == 3
    assert metric(p, "atomd:kv_blocks_pinned") == 3
    p.wait_idle(pd.baseline["P"])  # nobody pulls: the 3 s lease runs out
    assert metric(p, "atomd:kv_leases_expired_total") == expired + 1

    params = prefill_leg(p, token_prompt(8, 20))
    status, raw = http("POST", p.url + "/kv_transfer/abort", {"transfer_id": params["transfer_id"]})
    assert status == 200 and json.loads(raw)["revoked"] is True
    p.wait_idle(pd.baseline["P"])
    assert metric(p, "atomd:kv_leases_expired_total") == expired + 1
    status, raw = http("POST", p.url + "/kv_transfer/abort", {"transfer_id": params["transfer_id"]})
    assert status == 200 and json.loads(raw)["revoked"] is False  # once only
    assert http("POST", p.url + "/kv_transfer/abort", {"transfer_id": 5})[0] == 400


def test_decode_leg_checks_prompt_length_and_compat(pd):
    prompt = token_prompt(9, 20)
    params = prefill_leg(pd["P"], prompt)
    body = {"prompt": prompt[:-1], "max_tokens": 4, "temperature": 0, "kv_transfer_params": params}
    status, err = complete(pd["D"].url, body)
    assert status == 400 and "num_prompt_tokens" in err["error"]["message"]

    failures = metric(pd["D"], "atomd:kv_transfer_failures_total", reason="compat_mismatch")
    foreign = dict(params, compat=dict(params["compat"], block_size=32))
    status, err = complete(pd["D"].url, dict(body, prompt=prompt, kv_transfer_params=foreign))
    assert status == 503 and err["error"]["code"] == "kv_transfer_failed"
    assert metric(pd["D"], "atomd:kv_transfer_failures_total", reason="compat_mismatch") == failures + 1


def test_wrong_access_token_is_refused_by_p(pd):
    prompt = token_prompt(10, 20)
    params = prefill_leg(pd["P"], prompt)
    refused = metric(pd["P"], "atomd:kv_transfer_failures_total", reason="bad_token")
    forged = dict(params, access_token="0" * 32)
    status, err = complete(pd["D"].url, {"prompt": prompt, "max_tokens": 4, "kv_transfer_params": forged})
    assert status == 503 and err["error"]["code"] == "kv_transfer_failed"
    assert metric(pd["P"], "atomd:kv_transfer_failures_total", reason="bad_token") == refused + 1
    assert metric(pd["D"], "atomd:kv_transfer_failures_total", reason="bad_token") >= 1
    assert metric(pd["P"], "atomd:kv_blocks_pinned") == 2  # a forged READ frees nothing
    http("POST", pd["P"].url + "/kv_transfer/abort", {"transfer_id": params["transfer_id"]})


def open_stream(port: int, prompt: list[int]) -> tuple[socket.socket, bytes]:
    """A raw streamed completion of 200 tokens, read up to its first event."""
    body = json.dumps({"prompt": prompt, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    got = b""
    while b"data: " not in got:
        got += s.recv(4096)
    assert got.startswith(b"HTTP/1.1 200"), got
    return s, got


def test_client_disconnect_during_prefill_leg_frees_both(pd):
    body = json.dumps({"prompt": token_prompt(12, 220), "max_tokens": 8, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", pd.router.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
    # gone before any byte: settled() checks that whatever leg ran freed its blocks


def test_client_disconnect_during_decode_frees_both(pd):
    s, _ = open_stream(pd.router.port, token_prompt(11, 40))
    s.close()
    # settled(): D aborted its sequence, P freed on DONE; both back at baseline


def test_prefill_engine_killed_after_prefill_leg(pd):
    """P2 dies holding the blocks: `fail` answers 503 before any byte, `recompute` prefills on D."""
    prompt = token_prompt(13, 40)
    to_fail, to_recompute = prefill_leg(pd["P2"], prompt), prefill_leg(pd["P2"], prompt)
    kill_engine(pd["P2"])
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    status, raw = http("POST", pd["D"].url + "/v1/completions",
                       dict(body, stream=True, kv_transfer_params=to_fail))
    assert status == 503 and json.loads(raw)["error"]["code"] == "kv_transfer_failed"

    fallbacks = fallback_total(pd["DR"])
    status, got = complete(pd["DR"].url, dict(body, kv_transfer_params=to_recompute))
    assert status == 200, got
    _, want = complete(pd["ref"].url, body)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert fallback_total(pd["DR"]) == fallbacks + 1


def fallback_total(server) -> float:
    return sum(v for (name, _), v in metrics(server).items() if name == "atomd:pd_fallback_total")


def test_decode_engine_killed_mid_stream(pd):
    """DR dies while streaming: the client's stream ends, P ends with nothing pinned."""
    s, got = open_stream(pd.router_r.port, token_prompt(17, 40))
    with s:
        os.kill(pd["DR"].engine_pid(), signal.SIGSTOP)  # not one more token, then the crash
        kill_engine(pd["DR"])
        while b"data: [DONE]" not in got and (chunk := s.recv(65536)):
            got += chunk
    assert b'data: {"error"' in got  # the router ends the broken stream with an error event


def test_decode_engine_killed_before_pulling(pd):
    """DK's core is frozen, then killed, while the router's decode leg waits on it: the client
    gets a 5xx, and P frees the pinned blocks (the router's abort, or the lease)."""
    os.kill(pd["DK"].engine_pid(), signal.SIGSTOP)
    answer = {}
    body = {"prompt": token_prompt(19, 40), "max_tokens": 8, "temperature": 0}
    leg = threading.Thread(target=lambda: answer.update(status=complete(pd.router_k.url, body)[0]))
    leg.start()
    deadline = time.monotonic() + 60
    while metric(pd["P"], "atomd:kv_blocks_pinned") == 0:  # P's leg is done: D holds the params
        assert time.monotonic() < deadline, "P never finished the prefill leg"
        time.sleep(0.05)
    kill_engine(pd["DK"])
    leg.join(60)
    assert answer["status"] >= 500


@pytest.mark.parametrize("pd", ["mooncake"], indirect=True)  # its cluster has a zmq producer too
def test_mixed_backends_are_refused_at_the_handshake(pd):
    """P on zmq, D on mooncake: D refuses P's handshake before any byte moves (503, counted
    as backend_mismatch) and P frees the blocks; the other direction is in the transport tests."""
    prompt = token_prompt(23, 40)
    params = prefill_leg(pd["PZ"], prompt)
    before = metric(pd["D"], "atomd:kv_transfer_failures_total", reason="backend_mismatch")
    moved = metric(pd["D"], "atomd:kv_transfer_bytes_total")
    status, err = complete(pd["D"].url, {"prompt": prompt, "max_tokens": 4, "kv_transfer_params": params})
    assert status == 503 and err["error"]["code"] == "kv_transfer_failed"
    assert metric(pd["D"], "atomd:kv_transfer_failures_total", reason="backend_mismatch") == before + 1
    assert metric(pd["D"], "atomd:kv_transfer_bytes_total") == moved
    pd["PZ"].wait_idle(pd.baseline["PZ"])  # D's ABORT freed P's blocks at once
    assert metric(pd["PZ"], "atomd:kv_blocks_pinned") == 0
