"""Helpers for the cross-host tests: test hosts made of network namespaces (launch/netns.py),
engines and routers started inside them, and the offline engine as the reference.

Every test host, process and link a test makes is removed when its fixture ends, also on
failure: `hosts()` tears the cluster down in a `finally` (SIGTERM, then SIGKILL, by PID,
to every process inside its namespaces; then the namespaces, the bridge and the root
namespace's veth), and asserts that nothing of it is left. A run that was killed before it
could clean up is cleaned by the next one (`launch.netns.clean_stale`, called whenever a
cluster starts). Traffic stays inside the cluster's own /24: the hosts have no other route,
and the root namespace routes only that /24 to the cluster (the tests' client side).

The tests need root and iproute2 (`ip netns`, veth, bridge, tun/tap); without them they skip.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import secrets
import sys
from pathlib import Path

import pytest

from launch.netns import NetnsCluster, netem_available, netns_pids, unavailable_reason
from launch.shaping import Shaping
from launch.process import EngineServer, RouterServer, http
from tests.server_fixtures import ENGINE_ARGS, MAX_MODEL_LEN, REPO, START_TIMEOUT_S, ServerUnderTest, server_log

__all__ = ["HostEngine", "HostRouter", "Shaping", "hosts", "offline_llm", "require_netns", "secret_file"]

FIRST_PORT = 8100  # every host is a fresh network namespace: its ports are all free
_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


def _unavailable(message: str) -> None:
    """Skip where a developer's machine lacks root / iproute2 / tun; in CI (root, as
    `make test` there runs) the same gap is a failure, never a silent skip."""
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def require_netns() -> None:
    reason = unavailable_reason()
    if reason:
        _unavailable(f"cross-host tests need test hosts: {reason}")


@contextlib.contextmanager
def hosts(num_hosts: int, **kwargs):
    """A started NetnsCluster (root_link on: the test talks to the hosts from here), torn down
    at the end however the block exits; then nothing of it may be left."""
    require_netns()
    if kwargs.get("shaping") is not None and not (Path("/dev/net/tun").exists() or netem_available()):
        _unavailable("shaped test links need the kernel's netem or /dev/net/tun (launch/netns.py's link emulator)")
    with pytest.MonkeyPatch.context() as mp:
        for var in _PROXY_VARS:  # a proxy must never see the test hosts' traffic
            mp.delenv(var, raising=False)
        net = NetnsCluster(num_hosts, root_link=True, **kwargs)
        net.start()
        net.ports = {h.label: itertools.count(FIRST_PORT) for h in net.hosts}
        namespaces = [net.switch_ns, *(h.ns for h in net.hosts)]
        try:
            yield net
        finally:
            net.teardown()
        left = [n for n in net.namespaces()] + [f"pid {p} in {ns}" for ns in namespaces for p in netns_pids(ns)]
        assert not left, f"the test hosts were not removed: {left}"
        assert not Path(f"/sys/class/net/{net.root_if}").exists(), f"{net.root_if} is still in the root namespace"


def next_port(net: NetnsCluster, host) -> int:
    return next(net.ports[net.host(host).label])


@contextlib.contextmanager
def secret_file(tmp_dir: Path):
    """The router's and the engines' shared kv_transfer_params secret, as pd_pair.sh makes it."""
    path = Path(tmp_dir) / "kv-params-secret"
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


class HostEngine(ServerUnderTest):
    """`atomd serve` with the tests' engine flags inside a test host, on the host's address."""

    def __init__(self, net: NetnsCluster, host, model, *extra: str, log_path: Path | None = None):
        self.host_name = net.host(host)
        EngineServer.__init__(self, model, *ENGINE_ARGS, *extra, host=self.host_name.ip, port=next_port(net, host),
                              name=f"atomd serve on {self.host_name}", log=server_log(log_path), cwd=REPO,
                              wrapper=net.exec_prefix(host))


class HostRouter(RouterServer):
    ready_timeout_s = START_TIMEOUT_S

    def __init__(self, net: NetnsCluster, host, prefill: list[str], decode: list[str], *extra: str,
                 log_path: Path | None = None):
        super().__init__(prefill, decode, "--health-interval-s", "0.5", *extra, host=net.host(host).ip,
                         port=next_port(net, host), name=f"router on {net.host(host)}", log=server_log(log_path),
                         cwd=REPO, wrapper=net.exec_prefix(host))


def offline_llm():
    """The offline engine with the test servers' settings: the reference for greedy output."""
    from atomd import LLM

    return LLM(max_model_len=MAX_MODEL_LEN, num_threads=1, max_num_seqs=64)


def get_in_host(net: NetnsCluster, host, url: str, timeout_s: float = 30.0) -> tuple[int, bytes]:
    """GET `url` from inside `host` (e.g. its own server while its cable is cut)."""
    code = ("import sys, urllib.request, urllib.error\n"
            "try:\n r = urllib.request.urlopen(sys.argv[1], timeout=10); print(r.status); sys.stdout.flush()\n"
            " sys.stdout.buffer.write(r.read())\n"
            "except urllib.error.HTTPError as e:\n print(e.code); sys.stdout.flush(); sys.stdout.buffer.write(e.read())\n")
    result = net.run(host, [sys.executable, "-c", code, url], timeout=timeout_s, text=False)
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    status, _, body = result.stdout.partition(b"\n")
    return int(status), body


def prometheus(body: bytes) -> dict[str, float]:
    """{sample name: value summed over its labels} of a /metrics body (0 for a series with no sample yet)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = collections.defaultdict(float)
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def sse_text(body: bytes) -> str:
    events = [json.loads(line[6:]) for line in body.decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return "".join(c["text"] for e in events for c in e.get("choices", []))


def complete(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict | bytes]:
    status, raw = http("POST", url + "/v1/completions", body, timeout=timeout)
    if body.get("stream") or status != 200:
        return status, raw
    return status, json.loads(raw)


def env_without_proxies() -> dict:
    return {k: v for k, v in os.environ.items() if k not in _PROXY_VARS}
