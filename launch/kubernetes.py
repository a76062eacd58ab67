"""The online planner's Kubernetes launcher: engines are the pods of the Helm chart's prefill
and decode StatefulSets, scaled one at a time through the API server's `scale` subresource
(standard library only; no kubernetes client).

Why a scale call per StatefulSet and not an HPA on an external metric: a scale-down must
drain first (the engine out of the router's rotation, then idle: nothing running, waiting,
in flight or pinned for a consumer), and an HPA removes a pod when it decides, without
waiting. A StatefulSet removes its highest ordinal on a scale-down, which is the engine the
planner drains (the newest: `Autoscaler._drain` takes the last one it added), so the order
is: DELETE /workers, wait until idle, PATCH replicas - 1.

`start(role)`: read the set's scale, PATCH replicas + 1, wait until pod NAME-n is Ready with
an IP, return http://POD_IP:PORT (the URL the router's DNS discovery would form for it; the
planner registers it by POST /workers). `stop(url)`: that pod must be the set's highest
ordinal; PATCH replicas - 1. `adopt(role)`: the set's pods as they are (GET scale, GET each
pod), for a planner that starts or restarts beside a running set. `refresh(role)`: the pods
that came back with a new IP (the planner swaps them in the router every window). With the planner owning membership, run the router without
--prefill-dns / --decode-dns for the pools it scales: DNS discovery re-adds a pod removed by
DELETE /workers while DNS still names it (router/discovery.py), which would end the drain's
quiet. RBAC: get and patch on `statefulsets/scale`, get on `pods`, in the release namespace.

In a pod, the API server, token and CA are the service account's
(/var/run/secrets/kubernetes.io/serviceaccount); tests point `api_url` at a recorded stand-in.
"""
from __future__ import annotations

import json
import pathlib
import re
import ssl
import time
import urllib.error
import urllib.request

SERVICE_ACCOUNT = pathlib.Path("/var/run/secrets/kubernetes.io/serviceaccount")
IN_CLUSTER_API = "https://kubernetes.default.svc"
HTTP_TIMEOUT_S = 10.0
MAX_BODY_BYTES = 1 << 20  # a scale or pod object is a few KB
NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")  # an RFC 1123 label


class KubernetesError(RuntimeError):
    pass


class StatefulSetLauncher:
    def __init__(self, statefulsets: dict[str, str], port: int, namespace: str | None = None,
                 api_url: str | None = None, token: str | None = None, ca_file: str | None = None,
                 ready_timeout_s: float = 900.0, poll_s: float = 2.0):
        for role, name in statefulsets.items():
            if role not in ("prefill", "decode") or not NAME.fullmatch(name or ""):
                raise ValueError(f"statefulsets: {role!r} -> {name!r} is not a role and a StatefulSet name")
        in_cluster = api_url is None
        self.api_url = (api_url or IN_CLUSTER_API).rstrip("/")
        self.namespace = namespace or (SERVICE_ACCOUNT / "namespace").read_text().strip()
        if not NAME.fullmatch(self.namespace):
            raise ValueError(f"namespace {self.namespace!r} is not a Kubernetes name")
        if token is None and in_cluster:
            token = (SERVICE_ACCOUNT / "token").read_text().strip()
        self.token = token
        self.ssl = None
        if self.api_url.startswith("https://"):
            self.ssl = ssl.create_default_context(cafile=ca_file or (str(SERVICE_ACCOUNT / "ca.crt")
                                                                     if in_cluster else None))
        self.statefulsets, self.port = dict(statefulsets), port
        self.ready_timeout_s, self.poll_s = ready_timeout_s, poll_s
        self.pods: dict[str, tuple[str, int]] = {}  # engine URL -> (role, ordinal)

    # ------------------------------------------------------------------ the API

    def _call(self, method: str, path: str, body: dict | None = None) -> dict | None:
        """The decoded answer; None for a 404; KubernetesError for any other failure."""
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/merge-patch+json"
        req = urllib.request.Request(self.api_url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S, context=self.ssl) as r:
                return json.loads(r.read(MAX_BODY_BYTES))
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise KubernetesError(f"{method} {path}: {e.code} {e.read(2000).decode(errors='replace')}") from None
        except (OSError, ValueError) as e:
            raise KubernetesError(f"{method} {path}: {e}") from None

    def _scale_path(self, role: str) -> str:
        return f"/apis/apps/v1/namespaces/{self.namespace}/statefulsets/{self.statefulsets[role]}/scale"

    def replicas(self, role: str) -> int:
        scale = self._call("GET", self._scale_path(role))
        if scale is None:
            raise KubernetesError(f"no StatefulSet {self.statefulsets[role]} in namespace {self.namespace}")
        return int(scale.get("spec", {}).get("replicas", 0))

    def _set_replicas(self, role: str, n: int) -> None:
        self._call("PATCH", self._scale_path(role), {"spec": {"replicas": n}})

    def _ready_ip(self, pod: str) -> str | None:
        got = self._call("GET", f"/api/v1/namespaces/{self.namespace}/pods/{pod}")
        status = (got or {}).get("status", {})
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", []))
        return status.get("podIP") if ready and status.get("podIP") else None

    # ------------------------------------------------------------------ Launcher

    def _wait_ready(self, role: str, ordinal: int) -> str:
        """Pod NAME-ordinal's engine URL once it is Ready."""
        pod = f"{self.statefulsets[role]}-{ordinal}"
        deadline = time.monotonic() + self.ready_timeout_s
        while (ip := self._ready_ip(pod)) is None:
            if time.monotonic() > deadline:
                raise KubernetesError(f"pod {pod} not Ready within {self.ready_timeout_s:g} s "
                                      f"(the StatefulSet stays at {self.replicas(role)} replicas)")
            time.sleep(self.poll_s)
        url = self._url(ip)
        self.pods[url] = (role, ordinal)
        return url

    def _url(self, ip: str) -> str:
        return f"http://[{ip}]:{self.port}" if ":" in ip else f"http://{ip}:{self.port}"

    def adopt(self, role: str) -> list[str]:
        """The engines the set already runs (pods 0 .. replicas - 1, each once Ready), oldest
        first: what the planner starts from, e.g. after its own restart."""
        return [self._wait_ready(role, i) for i in range(self.replicas(role))]

    def refresh(self, role: str) -> dict[str, str]:
        """{old URL: new URL} for this role's pods that came back with another IP (a restart,
        a rolling update, a lost node): the router has only the old address, and without DNS
        discovery nothing else tells it. A pod not Ready yet keeps its old URL until it is."""
        moved = {}
        for url, (r, ordinal) in list(self.pods.items()):
            ip = self._ready_ip(f"{self.statefulsets[role]}-{ordinal}") if r == role else None
            new = ip and self._url(ip)
            if new and new != url:
                del self.pods[url]
                self.pods[new] = (role, ordinal)
                moved[url] = new
        return moved

    def start(self, role: str) -> str:
        n = self.replicas(role)
        self._set_replicas(role, n + 1)
        return self._wait_ready(role, n)

    def stop(self, url: str) -> None:
        """Scale the set down by its highest ordinal, which must be `url`'s (drained before)."""
        role, ordinal = self.pods[url]
        n = self.replicas(role)
        if ordinal != n - 1:
            raise KubernetesError(f"{url} is pod {self.statefulsets[role]}-{ordinal}, but a scale-down to {n - 1} "
                                  f"would remove {self.statefulsets[role]}-{n - 1}")
        self._set_replicas(role, n - 1)
        del self.pods[url]
