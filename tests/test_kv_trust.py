"""KV peers are configured, never client-chosen (kv_transfer/trust.py): the router signs the
kv_transfer_params it forwards, a consumer engine refuses unsigned / forged / untrusted
params with a 403 before it opens any connection, and the router drops whatever
kv_transfer_params a client sends, on every path."""
from __future__ import annotations

import hashlib
import hmac
import json
import select
import socket
import uuid

import msgspec
import pytest

from kv_transfer.params import KVTransferParams, compat_fingerprint
from kv_transfer.trust import (BAD_SIGNATURE, SECRET_ENV, UNSIGNED, UNTRUSTED_PRODUCER, ProducerTrust,
                               UntrustedKVParams, load_secret, sign)
from launch.process import RouterServer, free_port, http
from tests.fake_workers import Cluster
from tests.pd_fixtures import PDCluster, metric
from tests.server_fixtures import REPO, START_TIMEOUT_S, server_log

SECRET = b"s3cret-shared-by-router-and-engines"


def remote_params(host: str = "127.0.0.1", port: int = 5601, **kw) -> KVTransferParams:
    return KVTransferParams(do_remote_prefill=True, transfer_id=uuid.uuid4().hex, remote_host=host,
                            remote_port=port, remote_block_ids=[3, 1], num_prompt_tokens=20, first_token_id=7,
                            access_token="ab" * 16, compat=compat_fingerprint("m", "float32", 16, 2, 2, 8, "v"),
                            **kw)


def refusal(trust: ProducerTrust, params: KVTransferParams) -> str | None:
    try:
        trust.check(params)
    except UntrustedKVParams as e:
        return e.reason
    return None


# ---------------------------------------------------------------- unit: sign and check

@pytest.mark.unit
def test_a_signature_is_an_hmac_sha256_the_engine_recomputes_from_the_json_it_received():
    signed = sign(remote_params(), SECRET)
    # stdlib reference: HMAC-SHA256 of every field but the signature (defaults included) as
    # compact JSON with every key sorted
    fields = {f: getattr(signed, f) for f in KVTransferParams.__struct_fields__ if f != "signature"}
    payload = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    assert signed.signature == hmac.new(SECRET, payload, hashlib.sha256).hexdigest()
    # What the engine sees went through JSON: reordered keys and explicit defaults change nothing.
    wire = json.loads(json.dumps(msgspec.to_builtins(signed), sort_keys=True))
    wire["lease_s"] = 30.0
    assert refusal(ProducerTrust(SECRET), KVTransferParams.from_json_obj(wire)) is None


@pytest.mark.unit
@pytest.mark.parametrize("field,value", [("remote_host", "127.0.0.9"), ("remote_port", 22), ("transfer_id", "t2"),
                                         ("access_token", "cd" * 16), ("remote_block_ids", [0, 1])])
def test_any_change_after_signing_is_a_bad_signature(field, value):
    forged = msgspec.structs.replace(sign(remote_params(), SECRET), **{field: value})
    assert refusal(ProducerTrust(SECRET), forged) == BAD_SIGNATURE
    assert refusal(ProducerTrust(b"another secret"), sign(remote_params(), SECRET)) == BAD_SIGNATURE


@pytest.mark.unit
def test_with_a_secret_unsigned_params_are_refused():
    assert refusal(ProducerTrust(SECRET), remote_params()) == UNSIGNED


@pytest.mark.unit
def test_without_configuration_only_loopback_producers_are_trusted():
    trust = ProducerTrust(None)
    assert refusal(trust, remote_params("127.0.0.1")) is None
    assert refusal(trust, remote_params("127.3.2.1")) is None
    assert refusal(trust, remote_params("::1")) is None
    assert refusal(trust, remote_params("localhost")) is None
    for host in ("10.1.2.3", "169.254.169.254", "metadata.internal", "::ffff:10.0.0.1"):
        assert refusal(trust, remote_params(host)) == UNTRUSTED_PRODUCER, host


@pytest.mark.unit
def test_an_allow_list_of_networks_and_names_replaces_the_loopback_default():
    trust = ProducerTrust(None, ["10.0.0.0/8", "fd00::/8", "Prefill-0.atomd-prefill"])
    assert refusal(trust, remote_params("10.200.0.7")) is None
    assert refusal(trust, remote_params("fd00::5")) is None
    assert refusal(trust, remote_params("prefill-0.atomd-prefill")) is None
    assert refusal(trust, remote_params("127.0.0.1")) == UNTRUSTED_PRODUCER
    assert refusal(trust, remote_params("11.0.0.1")) == UNTRUSTED_PRODUCER
    # both configured: a signature and a trusted address are both required
    both = ProducerTrust(SECRET, ["10.0.0.0/8"])
    assert refusal(both, sign(remote_params("10.0.0.1"), SECRET)) is None
    assert refusal(both, sign(remote_params("127.0.0.1"), SECRET)) == UNTRUSTED_PRODUCER
    assert refusal(both, remote_params("10.0.0.1")) == UNSIGNED


@pytest.mark.unit
def test_the_secret_comes_from_a_file_or_the_environment(tmp_path):
    path = tmp_path / "key"
    path.write_text("  file-secret\n")
    assert load_secret(path=str(path), env={}) == b"file-secret"
    assert load_secret(env={SECRET_ENV: "env-secret"}) == b"env-secret"
    assert load_secret(path=str(path), env={SECRET_ENV: "env-secret"}) == b"file-secret"
    assert load_secret(env={}) is None
    path.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        load_secret(path=str(path), env={})
    with pytest.raises(ValueError, match="cannot be read"):
        load_secret(path=str(tmp_path / "missing"), env={})


# ---------------------------------------------------------------- router: only it writes the params

def client_params() -> dict:
    return {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 22, "transfer_id": "client-chosen",
            "remote_block_ids": [0], "num_prompt_tokens": 4, "access_token": "ee" * 16}


@pytest.mark.unit
def test_the_router_drops_a_clients_kv_transfer_params_and_signs_its_own(loop):
    cluster = Cluster(loop, health_interval_s=60).start()
    cluster.router.relay.kv_params_secret = SECRET
    try:
        r = cluster.post("/v1/completions", {"model": "fake-model", "prompt": "the quick brown fox", "max_tokens": 4,
                                             "kv_transfer_params": client_params()})
        assert r.status == 200
        (_, p_body), = cluster.prefill[0].requests
        (_, d_body), = cluster.decode[0].requests
        assert p_body["kv_transfer_params"]["transfer_id"] != "client-chosen"
        kv = d_body["kv_transfer_params"]
        assert kv["remote_host"] == "127.0.0.1" and kv["transfer_id"] == p_body["kv_transfer_params"]["transfer_id"]
        assert refusal(ProducerTrust(SECRET), KVTransferParams.from_json_obj(kv)) is None
        text = cluster.get("/metrics").body.decode()
        assert "atomd_router:client_kv_params_dropped_total 1.0" in text
    finally:
        cluster.stop()


@pytest.mark.unit
def test_a_decode_only_fallback_never_carries_the_clients_params(loop):
    cluster = Cluster(loop, health_interval_s=60).start()
    cluster.prefill[0].keeps_kv = False  # P kept nothing: D prefills the prompt itself
    try:
        r = cluster.post("/v1/completions", {"model": "fake-model", "prompt": "hello there", "max_tokens": 4,
                                             "kv_transfer_params": client_params()})
        assert r.status == 200
        (_, d_body), = cluster.decode[0].requests
        assert "kv_transfer_params" not in d_body
    finally:
        cluster.stop()


@pytest.mark.unit
def test_the_router_refuses_to_start_with_an_unreadable_secret(tmp_path):
    from router.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--kv-params-secret-file", str(tmp_path / "missing")])


# ---------------------------------------------------------------- real engines

@pytest.fixture(scope="module")
def trusted(tmp_path_factory):
    key = tmp_path_factory.mktemp("secret") / "key"
    key.write_text(SECRET.decode())
    cluster = PDCluster()
    try:
        secret = ["--kv-params-secret-file", str(key)]
        cluster.start_engines(ref=[], P=["--kv-role", "producer", *secret], D=["--kv-role", "consumer", *secret],
                              DA=["--kv-role", "consumer", "--kv-trusted-producers", "127.0.0.1"])
        cluster.routers.append(RouterServer([cluster["P"].url], [cluster["D"].url], "--health-interval-s", "0.5",
                                            *secret, log=server_log(), cwd=REPO))
        cluster.router = cluster.routers[-1].wait_ready(START_TIMEOUT_S)
        cluster.baseline = {name: e.stats()["num_total_blocks"] for name, e in cluster.engines.items()}
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def listener():
    """A TCP listener on 127.0.0.2 standing in for an internal service; says whether anyone connected."""
    host = "127.0.0.2"
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, free_port(host)))
    sock.listen(4)
    yield sock
    sock.close()


def connected(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0.3)[0])  # a pending connection makes it readable


def post_remote_prefill(engine, params: dict) -> tuple[int, dict]:
    status, raw = http("POST", engine.url + "/v1/completions",
                       {"prompt": list(range(10, 30)), "max_tokens": 2, "kv_transfer_params": params})
    return status, json.loads(raw)


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_consumer_with_a_secret_refuses_unsigned_and_forged_params_before_connecting(trusted, listener):
    d = trusted["D"]
    host, port = listener.getsockname()
    params = remote_params(host, port, lease_s=5.0)
    params = msgspec.structs.replace(params, num_prompt_tokens=20, remote_block_ids=[0, 1])
    for given, reason in ((params, UNSIGNED), (msgspec.structs.replace(params, signature="00" * 32), BAD_SIGNATURE)):
        status, body = post_remote_prefill(d, msgspec.to_builtins(given))
        assert status == 403, body
        assert body["error"]["type"] == "permission_error" and body["error"]["code"] == "kv_params_untrusted"
        assert metric(d, "atomd:kv_params_refused_total", reason=reason) == 1
    assert not connected(listener)
    d.wait_idle(trusted.baseline["D"])
    # the same engine still serves, and through the router (which signs) it equals colocated
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    status, want = http("POST", trusted["ref"].url + "/v1/completions", body)
    assert status == 200
    status, got = http("POST", trusted.router.url + "/v1/completions", body)
    assert status == 200, got
    assert json.loads(got)["choices"][0]["text"] == json.loads(want)["choices"][0]["text"]
    assert metric(trusted.router, "atomd_router:decision_total", decision="pd") == 1
    assert metric(d, "atomd:kv_transfer_bytes_total") > 0  # the KV really moved, signed
    for name in ("P", "D"):
        trusted[name].wait_idle(trusted.baseline[name])


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_a_consumer_with_an_allow_list_refuses_other_producers_before_connecting(trusted, listener):
    da = trusted["DA"]
    host, port = listener.getsockname()
    params = msgspec.structs.replace(remote_params(host, port, lease_s=5.0), remote_block_ids=[0, 1])
    status, body = post_remote_prefill(da, msgspec.to_builtins(params))
    assert status == 403, body
    assert "127.0.0.2" in body["error"]["message"]
    assert metric(da, "atomd:kv_params_refused_total", reason=UNTRUSTED_PRODUCER) == 1
    assert not connected(listener)
    da.wait_idle(trusted.baseline["DA"])
    status, _ = http("POST", da.url + "/v1/completions", {"prompt": "hello", "max_tokens": 2})
    assert status == 200  # still serving


@pytest.mark.unit
@pytest.mark.parametrize("signature", ["é", "\udcff", "0" * 64, "x" * 10_000, ""])
def test_any_signature_string_is_a_refusal_never_a_crash(signature):
    """Issue 42: hmac.compare_digest raised TypeError on a non-ASCII str, killing D's core."""
    params = msgspec.structs.replace(sign(remote_params(), SECRET), signature=signature)
    assert refusal(ProducerTrust(SECRET), params) in (BAD_SIGNATURE, UNSIGNED)
