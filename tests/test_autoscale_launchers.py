"""The online planner's launchers beyond this host: the Kubernetes StatefulSet launcher
(launch/kubernetes.py) against a stand-in API server that records every call and plays a
StatefulSet controller (a scale-up's pod turns Ready a few polls later), and the Autoscaler
driving it through a scale-up and a drained scale-down (the router and the engine's stats
stood in by a recorded fake). No cluster exists here; the calls are the API's documented
ones (apps/v1 statefulsets/scale, merge-patch; core/v1 pods)."""
from __future__ import annotations

import http.server
import json
import threading

import pytest

from launch import autoscale
from launch.autoscale import Autoscaler, PoolPolicy
from launch.kubernetes import KubernetesError, StatefulSetLauncher

pytestmark = pytest.mark.unit

NS = "serving"
SETS = {"prefill": "atomd-prefill", "decode": "atomd-decode"}


class FakeAPI:
    """apps/v1 StatefulSet scale and core/v1 pods of one namespace, recorded."""

    def __init__(self, replicas: dict[str, int], polls_until_ready: int = 2):
        self.replicas = dict(replicas)  # set name -> spec.replicas
        self.polls: dict[str, int] = {}  # pod -> GETs so far
        self.polls_until_ready = polls_until_ready
        self.calls: list[tuple[str, str, dict | None, str | None, str | None]] = []
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, code: int, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _handle(self, method: str) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                api.calls.append((method, self.path, body, self.headers.get("Authorization"),
                                  self.headers.get("Content-Type")))
                code, answer = api.route(method, self.path, body)
                self._answer(code, answer)

            def do_GET(self):
                self._handle("GET")

            def do_PATCH(self):
                self._handle("PATCH")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def route(self, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        prefix = f"/apis/apps/v1/namespaces/{NS}/statefulsets/"
        if path.startswith(prefix) and path.endswith("/scale"):
            name = path[len(prefix):-len("/scale")]
            if name not in self.replicas:
                return 404, {"kind": "Status", "code": 404}
            if method == "PATCH":
                self.replicas[name] = body["spec"]["replicas"]
            return 200, {"kind": "Scale", "spec": {"replicas": self.replicas[name]}}
        pods = f"/api/v1/namespaces/{NS}/pods/"
        if method == "GET" and path.startswith(pods):
            pod = path[len(pods):]
            name, _, ordinal = pod.rpartition("-")
            if name not in self.replicas or int(ordinal) >= self.replicas[name]:
                return 404, {"kind": "Status", "code": 404}
            self.polls[pod] = self.polls.get(pod, 0) + 1
            ready = self.polls[pod] > self.polls_until_ready
            return 200, {"kind": "Pod", "status": {
                "podIP": f"10.1.{list(self.replicas).index(name)}.{ordinal}",
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
        return 404, {"kind": "Status", "code": 404}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def api():
    fake = FakeAPI({"atomd-prefill": 1, "atomd-decode": 2})
    yield fake
    fake.close()


def launcher(api: FakeAPI, **kw) -> StatefulSetLauncher:
    return StatefulSetLauncher(SETS, port=8000, namespace=NS, api_url=api.url, token="t0ken", poll_s=0.01, **kw)


def test_a_scale_up_patches_replicas_and_waits_for_the_new_pod(api):
    k8s = launcher(api)
    url = k8s.start("decode")
    assert url == "http://10.1.1.2:8000"  # pod atomd-decode-2, the new highest ordinal
    assert api.replicas["atomd-decode"] == 3 and api.polls["atomd-decode-2"] == 3
    scale = f"/apis/apps/v1/namespaces/{NS}/statefulsets/atomd-decode/scale"
    assert api.calls[:2] == [("GET", scale, None, "Bearer t0ken", None),
                             ("PATCH", scale, {"spec": {"replicas": 3}}, "Bearer t0ken",
                              "application/merge-patch+json")]
    assert {c[1] for c in api.calls[2:]} == {f"/api/v1/namespaces/{NS}/pods/atomd-decode-2"}
    k8s.stop(url)
    assert api.replicas["atomd-decode"] == 2 and api.calls[-1][2] == {"spec": {"replicas": 2}}


def test_only_the_highest_ordinal_is_scaled_away_and_failures_are_clear(api):
    k8s = launcher(api)
    first, second = k8s.start("prefill"), k8s.start("prefill")
    with pytest.raises(KubernetesError, match="would remove atomd-prefill-2"):
        k8s.stop(first)
    assert api.replicas["atomd-prefill"] == 3
    k8s.stop(second)
    k8s.stop(first)
    assert api.replicas["atomd-prefill"] == 1
    missing = StatefulSetLauncher({"decode": "nope"}, port=8000, namespace=NS, api_url=api.url, poll_s=0.01)
    with pytest.raises(KubernetesError, match="no StatefulSet nope"):
        missing.start("decode")
    slow = FakeAPI({"atomd-decode": 0}, polls_until_ready=10**9)
    try:
        with pytest.raises(KubernetesError, match="not Ready within"):
            launcher(slow, ready_timeout_s=0.05).start("decode")
    finally:
        slow.close()
    for bad in ({"decode": "Not_A_Name"}, {"router": "atomd-router"}):
        with pytest.raises(ValueError, match="not a role and a StatefulSet name"):
            StatefulSetLauncher(bad, port=8000, namespace=NS, api_url=api.url)


def test_the_autoscaler_drains_a_pod_before_the_scale_down(api, monkeypatch):
    """Hot decode windows add pod atomd-decode-2 (POST /workers with its pod URL); cold ones
    take it out of rotation, wait while it still streams, and only then scale the set down."""
    busy = {"num_running": 1, "num_waiting": 0, "api_requests_in_flight": 1, "num_free_blocks": 6,
            "num_total_blocks": 8, "kv_transfer": {"blocks_pinned": 0}}
    idle = dict(busy, num_running=0, api_requests_in_flight=0, num_free_blocks=8)
    stats = [busy, busy, idle]
    router_calls = []
    latency = {"v": 1.0}
    cumulative = {"0.025": 0, "+Inf": 0}  # the router's ITL histogram: 10 more tokens a window

    def fake_http(method, url, body=None, headers=None, timeout=60.0):
        router_calls.append((method, url, body, api.replicas["atomd-decode"]))
        if url.endswith("/metrics"):
            cumulative["+Inf"] += 10
            cumulative["0.025"] += 10 if latency["v"] <= 0.025 else 0
            lines = [f'atomd_router:inter_token_latency_seconds_bucket{{le="{le}"}} {n}' for le, n in cumulative.items()]
            return 200, ("# TYPE atomd_router:inter_token_latency_seconds histogram\n" + "\n".join(lines)
                         + "\n").encode()
        if url.endswith("/debug/stats"):
            return 200, json.dumps(stats.pop(0)).encode()
        return 201, b"{}"

    monkeypatch.setattr(autoscale, "http", fake_http)
    now = [0.0]
    scaler = Autoscaler("http://router", launcher(api), PoolPolicy(1, 1, 1.0),
                        PoolPolicy(2, 3, 0.1, up_windows=1, down_windows=1, cooldown_s=0), clock=lambda: now[0])
    scaler.pools["decode"].urls = ["http://10.1.1.0:8000", "http://10.1.1.1:8000"]  # the set's two pods
    scaler.pools["prefill"].urls = ["http://10.1.0.0:8000"]
    scaler.tick()  # first window: the baseline
    now[0] += 1
    scaler.tick()  # ITL p90 +Inf > 0.09: one decode pod more
    assert api.replicas["atomd-decode"] == 3
    assert ("POST", "http://router/workers", {"url": "http://10.1.1.2:8000", "role": "decode"}, 3) in router_calls
    latency["v"] = 0.01
    now[0] += 1
    scaler.tick()  # cold: drain the newest
    drain = [c for c in router_calls if c[0] in ("DELETE",) or c[1].endswith("/debug/stats")]
    assert drain[0] == ("DELETE", "http://router/workers", {"url": "http://10.1.1.2:8000", "role": "decode"}, 3)
    assert [c[3] for c in drain[1:]] == [3, 3, 3]  # still 3 replicas while it streamed
    assert api.replicas["atomd-decode"] == 2
    assert [(d.url, d.free_blocks, d.total_blocks) for d in scaler.drained] == [("http://10.1.1.2:8000", 8, 8)]
