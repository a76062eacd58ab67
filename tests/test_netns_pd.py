"""PD across hosts: P on test host a, D on host b, the router on host c (network namespaces on
one bridge, tests/netns.py), against the offline engine.

The hosts reach each other only over the bridge, so the request path (router -> P, router
-> D) and the KV path (D -> P's side channel) cross real (virtual) network interfaces:
P advertises its host's address, never 127.0.0.1, and D trusts it because the router signs
P's params with the secret the three share. `make test` runs this file and
test_netns_cluster.py (shaped links, a cut link); test_netns_ray.py (a two-node Ray
cluster) runs under `make e2e-netns`.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from launch.process import http
from tests.kv_backends import BACKENDS, require_backend
from tests.netns import HostEngine, HostRouter, complete, hosts, offline_llm, prometheus, secret_file, sse_text
from tests.pd_fixtures import block_bytes
from tests.server_fixtures import model_dir

pytestmark = [pytest.mark.e2e, pytest.mark.netns, pytest.mark.timeout(300)]

VOCAB = 4096  # the default model's


def token_prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, VOCAB, n)]


@pytest.fixture(scope="module", params=BACKENDS)
def pd(request, tmp_path_factory):
    require_backend(request.param)
    tmp = tmp_path_factory.mktemp("netns-pd")
    with hosts(3) as net, secret_file(tmp) as secret:
        a, b, c = net.hosts
        model = model_dir()
        trust = ["--kv-params-secret-file", str(secret)]
        backend = ["--kv-transfer-backend", request.param]
        p = HostEngine(net, a, model, "--kv-role", "producer", "--kv-side-channel-host", a.ip, *trust, *backend)
        d = HostEngine(net, b, model, "--kv-role", "consumer", *trust, *backend)
        net.engines = [p, d]
        net.llm = offline_llm()  # loads while the engines do
        p.wait_ready()
        d.wait_ready()
        net.p, net.d = p, d
        net.router = HostRouter(net, c, [p.url], [d.url], *trust).wait_ready()
        net.baseline = {e.url: e.stats()["num_total_blocks"] for e in (p, d)}
        yield net


def offline_text(pd, prompt, max_tokens: int) -> str:
    from atomd import SamplingParams

    prompt = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
    out = pd.llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                          use_tqdm=False)
    return out[0].outputs[0].text


def metrics(engine) -> dict[str, float]:
    status, body = http("GET", engine.url + "/metrics")
    assert status == 200, body
    return prometheus(body)


def test_producer_advertises_its_host_address(pd):
    a = pd.hosts[0]
    status, raw = http("GET", pd.p.url + "/kv_transfer_info")
    assert status == 200, raw
    assert json.loads(raw)["side_channel"]["host"] == a.ip  # what D dials: a's address, not 127.0.0.1
    assert pd.p.url.startswith(f"http://{a.ip}:") and pd.d.url.startswith(f"http://{pd.hosts[1].ip}:")


@pytest.mark.parametrize("n", [5, 32, 150])
def test_pd_across_hosts_equals_offline(pd, n):
    """Greedy through router (c) -> P (a) -> KV over the bridge -> D (b) equals the offline
    engine, JSON and SSE; P's sent and D's received KV bytes agree and crossed a's link."""
    prompt = token_prompt(n, n)
    want = offline_text(pd, prompt, 12)
    before_p, before_d = metrics(pd.p), metrics(pd.d)
    a_tx_before = pd.link_bytes("a")[0]
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}

    status, got = complete(pd.router.url, body)
    assert status == 200, got
    assert got["choices"][0]["text"] == want
    assert got["usage"]["prompt_tokens"] == n and got["usage"]["completion_tokens"] == 12
    # a fresh prompt: D pulled every prompt block, the last partial one included
    moved = metrics(pd.d)["atomd:kv_transfer_bytes_total"] - before_d["atomd:kv_transfer_bytes_total"]
    assert moved == -(-n // 16) * block_bytes()
    assert metrics(pd.p)["atomd:kv_transfer_bytes_total"] - before_p["atomd:kv_transfer_bytes_total"] == moved
    assert pd.link_bytes("a")[0] - a_tx_before >= moved  # the KV left host a over its interface

    status, raw = complete(pd.router.url, dict(body, stream=True))
    assert status == 200, raw
    assert sse_text(raw) == want
    after_p, after_d = metrics(pd.p), metrics(pd.d)
    sent = after_p["atomd:kv_transfer_bytes_total"] - before_p["atomd:kv_transfer_bytes_total"]
    received = after_d["atomd:kv_transfer_bytes_total"] - before_d["atomd:kv_transfer_bytes_total"]
    assert sent == received > moved  # the second pull moved at least the partial last block

    # pools at baseline: nothing running or pinned, every block free on both engines
    for engine in (pd.p, pd.d):
        engine.wait_idle(pd.baseline[engine.url])
    assert metrics(pd.p)["atomd:kv_blocks_pinned"] == 0


def test_chat_across_hosts_equals_offline(pd):
    prompt = "def fibonacci(n):"
    want = offline_text(pd, prompt, 16)
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    status, got = complete(pd.router.url, body)
    assert status == 200 and got["choices"][0]["text"] == want, got
    for engine in (pd.p, pd.d):
        engine.wait_idle(pd.baseline[engine.url])


def test_decode_refuses_unsigned_params_naming_a_remote_producer(pd):
    """D pulls only for params the router signed: a client naming host a's side channel
    itself gets a 403 before D connects anywhere."""
    status, raw = http("GET", pd.p.url + "/kv_transfer_info")
    side = json.loads(raw)["side_channel"]
    forged = {"do_remote_prefill": True, "transfer_id": "f" * 32, "remote_host": side["host"],
              "remote_port": side["port"], "remote_block_ids": [0], "num_prompt_tokens": 3, "access_token": "ab" * 16}
    status, raw = http("POST", pd.d.url + "/v1/completions",
                       {"prompt": [11, 12, 13], "max_tokens": 2, "kv_transfer_params": forged})
    assert status == 403 and json.loads(raw)["error"]["code"] == "kv_params_untrusted", raw


def test_engine_refuses_a_side_channel_host_it_cannot_bind(pd):
    """On host a, b's address is not a local one: the producer exits at start-up saying so."""
    a, b = pd.hosts[0], pd.hosts[1]
    argv = [sys.executable, "-m", "atomd", "serve", "--host", a.ip, "--port", "8199", "--kv-role", "producer",
            "--kv-side-channel-host", b.ip, "--num-threads", "1", "--max-model-len", "256"]
    t0 = time.monotonic()
    result = pd.run(a, argv, timeout=120)
    assert result.returncode != 0
    assert f"cannot bind the KV side channel at tcp://{b.ip}" in result.stderr, result.stderr[-3000:]
    assert "--kv-side-channel-host must be an address of this host" in result.stderr
    assert time.monotonic() - t0 < 120  # refused at start-up, not after a hang


def test_hosts_reach_only_their_cluster(pd):
    """The test hosts route their /24 and nothing else: no default route leaves the cluster."""
    a = pd.hosts[0]
    routes = pd.run(a, ["ip", "-4", "route", "show"]).stdout.strip().splitlines()
    assert routes == [f"{pd.subnet} dev eth0 proto kernel scope link src {a.ip}"], routes
    r = subprocess.run(["ip", "-4", "route", "show", "dev", pd.root_if], capture_output=True, text=True)
    assert [line.split()[0] for line in r.stdout.strip().splitlines()] == [pd.subnet]
