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
        self.restarts: dict[str, int] = {}  # pod -> times it came back (with a new IP)
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
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

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
                "podIP": f"10.{1 + self.restarts.get(pod, 0)}.{list(self.replicas).index(name)}.{ordinal}",
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


# ---------------------------------------------------------------------- atomd-autoscale


LES = (0.005, 0.025, 0.1, 0.5, 2.5, 10.0, float("inf"))


class RouterStandIn:
    """`launch.process.http` for the router (GET/POST/DELETE /workers, /metrics: the TTFT and
    ITL histograms with 10 more observations a window at the window's latency from
    `schedule[role]`) and the engines (/debug/stats: idle), every call recorded. No sockets:
    the pod URLs the fake API hands out are never dialled."""

    def __init__(self, schedule: dict[str, list[float]], status: int = 200, forget_at: int | None = None,
                 on_read=None):
        self.schedule, self.status, self.forget_at, self.on_read = schedule, status, forget_at, on_read
        self.workers: set[tuple[str, str]] = set()
        self.counts = {role: dict.fromkeys(LES, 0) for role in ("prefill", "decode")}
        self.reads = 0
        self.calls: list[tuple[str, str, dict | None, str | None]] = []

    def http(self, method, url, body=None, headers=None, timeout=60.0):
        self.calls.append((method, url, body, (headers or {}).get("Authorization")))
        path = "/" + url.split("/", 3)[3] if url.count("/") >= 3 else "/"
        if self.status != 200:
            return self.status, b'{"error": {"message": "no"}}'
        if path == "/workers":
            if method == "GET":
                return 200, json.dumps({"workers": [{"role": r, "url": u} for r, u in sorted(self.workers)]}).encode()
            key = (body["role"], body["url"])
            if method == "POST":
                created = key not in self.workers
                self.workers.add(key)
                return (201 if created else 200), b"{}"
            self.workers.discard(key)
            return 200, b"{}"
        if path == "/metrics":
            self.reads += 1
            if self.reads == self.forget_at:
                self.workers.clear()  # the router restarted
            if self.on_read:
                self.on_read(self.reads)
            lines = []
            for role, name in autoscale.SIGNALS.items():
                seq = self.schedule[role]
                latency = seq[min(self.reads, len(seq)) - 1]
                lines.append(f"# TYPE {name} histogram")
                for le in LES:
                    self.counts[role][le] += 10 if latency <= le else 0
                    lines.append(f'{name}_bucket{{le="{"+Inf" if le == float("inf") else le}"}} '
                                 f'{self.counts[role][le]}')
            return 200, ("\n".join(lines) + "\n").encode()
        if path == "/debug/stats":
            return 200, json.dumps({"num_running": 0, "num_waiting": 0, "api_requests_in_flight": 0,
                                    "num_free_blocks": 8, "num_total_blocks": 8,
                                    "kv_transfer": {"blocks_pinned": 0}}).encode()
        return 404, b"{}"


def cli(api: FakeAPI, *extra: str) -> list[str]:
    return ["--launcher", "kubernetes", "--router-url", "http://router", "--namespace", NS,
            "--prefill-statefulset", SETS["prefill"], "--decode-statefulset", SETS["decode"],
            "--kubernetes-api", api.url, "--admin-api-key", "adm1n", "--interval-s", "0.01", "--cooldown-s", "0",
            "--up-windows", "1", "--down-windows", "1", "--router-timeout-s", "0", *extra]


@pytest.fixture
def ready_api():
    fake = FakeAPI({"atomd-prefill": 1, "atomd-decode": 1}, polls_until_ready=0)
    yield fake
    fake.close()


def test_the_cli_adopts_the_running_pods_scales_up_and_drains_down(ready_api, monkeypatch, capsys):
    from launch import autoscale_cli

    router = RouterStandIn({"prefill": [0.01], "decode": [0.5, 0.5, 0.001]}, forget_at=2)
    monkeypatch.setattr(autoscale, "http", router.http)
    monkeypatch.setattr(autoscale_cli, "http", router.http)
    rc = autoscale_cli.main(cli(ready_api, "--decode-max", "2", "--ttft-slo-s", "1", "--itl-slo-s", "0.05",
                                "--windows", "3"))
    err = capsys.readouterr().err
    assert rc == 0, err
    p0, d0, d1 = "http://10.1.0.0:8000", "http://10.1.1.0:8000", "http://10.1.1.1:8000"
    posts = [(c[2]["role"], c[2]["url"]) for c in router.calls if c[0] == "POST"]
    # adopted pods 0 first, the new decode pod on the hot window, both again after the router restarted
    assert posts[:3] == [("prefill", p0), ("decode", d0), ("decode", d1)]
    assert sorted(posts[3:]) == [("decode", d0), ("decode", d1), ("prefill", p0)]
    assert [c[2] for c in router.calls if c[0] == "DELETE"] == [{"url": d1, "role": "decode"}]
    assert ("GET", d1 + "/debug/stats", None, "Bearer adm1n") in router.calls
    assert {c[3] for c in router.calls} == {"Bearer adm1n"}
    patches = [(c[1].split("/")[-2], c[2]["spec"]["replicas"]) for c in ready_api.calls if c[0] == "PATCH"]
    assert patches == [("atomd-decode", 2), ("atomd-decode", 1)]
    assert ready_api.replicas == {"atomd-prefill": 1, "atomd-decode": 1}
    assert router.workers == {("prefill", p0), ("decode", d0)}
    windows = [ln for ln in err.splitlines() if "window:" in ln]
    assert len(windows) == 3
    assert "decode 1 engine, ITL p90 0.5 s (SLO 0.05 s) -> up to 2" in windows[0]
    assert "prefill 1 engine, TTFT p90 0.025 s (SLO 1 s)" in windows[0]
    assert "decode 2 engines, ITL p90 0.005 s (SLO 0.05 s) -> drained, down to 1" in windows[2]
    assert "the router does not list" in err and "stopping after 3 windows with 1 prefill and 1 decode" in err


def test_a_pod_that_comes_back_with_a_new_ip_is_swapped_in_the_router(ready_api, monkeypatch, capsys):
    """Without DNS discovery only the planner can tell the router a restarted pod's address."""
    from launch import autoscale_cli

    def restart_decode_0(reads):
        if reads == 2:
            ready_api.restarts["atomd-decode-0"] = 1

    router = RouterStandIn({"prefill": [0.01], "decode": [0.01]}, on_read=restart_decode_0)
    monkeypatch.setattr(autoscale, "http", router.http)
    monkeypatch.setattr(autoscale_cli, "http", router.http)
    assert autoscale_cli.main(cli(ready_api, "--windows", "3", "--down", "0.01")) == 0
    old, new = "http://10.1.1.0:8000", "http://10.2.1.0:8000"
    assert [c[2] for c in router.calls if c[0] == "DELETE"] == [{"url": old, "role": "decode"}]
    assert router.workers == {("prefill", "http://10.1.0.0:8000"), ("decode", new)}
    assert f"decode engine {old} came back as {new}" in capsys.readouterr().err
    assert [c for c in ready_api.calls if c[0] == "PATCH"] == []


def test_a_dry_run_decides_but_changes_nothing(ready_api, monkeypatch, capsys):
    from launch import autoscale_cli

    router = RouterStandIn({"prefill": [5.0], "decode": [0.001]})
    monkeypatch.setattr(autoscale, "http", router.http)
    monkeypatch.setattr(autoscale_cli, "http", router.http)
    assert autoscale_cli.main(cli(ready_api, "--dry-run", "--windows", "2", "--prefill-min", "2")) == 0
    err = capsys.readouterr().err
    assert [c[0] for c in ready_api.calls if c[0] != "GET"] == []
    assert {c[0] for c in router.calls} == {"GET"} and router.workers == set()
    assert "dry run: would start prefill engines up to min 2 (has 1)" in err
    assert err.count("prefill 1 engine, TTFT p90 10 s (SLO 2 s) -> would scale up (dry run)") == 2


@pytest.mark.parametrize("extra,status,rc,message", [
    (["--router-url", ""], 200, 2, "--launcher kubernetes needs --router-url"),
    (["--prefill-statefulset", ""], 200, 2, "needs --prefill-statefulset"),
    (["--decode-min", "3", "--decode-max", "2"], 200, 2, "decode pool (--decode-min / --decode-max, --up / --down): "
                                                          "pool bounds must be 1 <= min <= max, got 3..2"),
    (["--down", "0.95"], 200, 2, "need 0 < down < up"),
    (["--itl-slo-s", "0"], 200, 2, "--itl-slo-s must be > 0"),
    (["--decode-statefulset", "missing"], 200, 1, "no StatefulSet missing in namespace serving"),
    (["--decode-statefulset", "Bad_Name"], 200, 2, "is not a role and a StatefulSet name"),
    ([], 401, 2, "refused the admin key (401): pass its --admin-api-key"),
    ([], 503, 1, "the router at http://router is not up after 0 s: answered 503"),
    (["--launcher", "ray"], 200, 2, "--launcher ray starts its own router; drop --router-url"),
    (["--launcher", "ray", "--router-url", ""], 200, 2, "--launcher ray needs --ray-config"),
])
def test_the_cli_refuses_with_one_clear_line(ready_api, monkeypatch, capsys, extra, status, rc, message):
    from launch import autoscale_cli

    router = RouterStandIn({"prefill": [0.01], "decode": [0.01]}, status=status)
    monkeypatch.setattr(autoscale, "http", router.http)
    monkeypatch.setattr(autoscale_cli, "http", router.http)
    assert autoscale_cli.main(cli(ready_api, "--windows", "1", *extra)) == rc
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("atomd-autoscale: error: ") and message in err[-1], err
    assert [c for c in ready_api.calls if c[0] == "PATCH"] == []


def test_the_cli_reports_an_unreachable_router(ready_api, capsys):
    """No stand-in: a closed port on 127.0.0.1."""
    from launch import autoscale_cli
    from launch.process import free_port

    argv = cli(ready_api, "--windows", "1")
    argv[argv.index("http://router")] = f"http://127.0.0.1:{free_port()}"
    assert autoscale_cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "is not up after 0 s: no answer" in err
