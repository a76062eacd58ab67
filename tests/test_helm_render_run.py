"""Render-and-run: the chart's own wiring, run here, serves the offline engine's greedy tokens.

`helm template` a 1-prefill / 1-decode / 1-router release; take each pod's command, args
and env as rendered; run them the way a kubelet would (tests/helm_tools.Pod: env from the
rendered Secrets and the downward API, $(VAR) expanded, Secret / ConfigMap / emptyDir
volumes as local directories) as local processes on 127.0.0.1; resolve the router's
--prefill-dns / --decode-dns names through the router's resolver hook (tests/dns_router.py),
which maps each rendered headless Service's name to the local processes of the
StatefulSet it selects. Then one greedy request through the router (JSON and SSE) must
give the offline engine's text, the prefill pod must advertise its "pod IP", the decode
engine must have pulled the KV over the side channel, and every probe answers 200.

Rewritten, because every pod here shares one host and one loopback address: the listen
host (0.0.0.0 -> 127.0.0.1), the HTTP, side-channel and KV-event ports (free local ports),
status.podIP (-> 127.0.0.1), mount paths (-> the local copies) and the entry points
(`atomd` -> this virtualenv's console script; `atomd-router` -> tests/dns_router.py,
which runs router.__main__.main with the resolver hook). Everything else is as rendered.
"""
from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from launch.process import ServerProcess, free_port, http
from tests.helm_tools import (CHART, REPO, SECRET_FLAG, Pod, by_kind, dashboard_metric_names, local_argv, one,
                              pod_labels, render, replace_flag, secret_data, secret_flag_known, strip_flag)
from tests.server_fixtures import START_TIMEOUT_S

# e2e: a rendered release's processes run for ~30 s, one of the longest multi-process runs (`make e2e`)
pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.timeout(300)]

RELEASE, NAMESPACE = "atomd", "serving"
VALUES = {"prefill.replicas": 1, "decode.replicas": 1, "router.replicas": 1,
          "prefill.dataParallelSize": 1, "decode.dataParallelSize": 1,
          # two shared cores here: one torch thread per engine, a short context
          "prefill.numThreads": 1, "decode.numThreads": 1, "engine.maxModelLen": 256,
          "serviceMonitor.enabled": True}
MONITORING_API = "monitoring.coreos.com/v1"  # the Prometheus operator's CRDs, so the ServiceMonitor renders
PROMPT = "def fibonacci(n):"
MAX_TOKENS = 24


def started(pod: Pod, argv: list[str], http_port: int, log: pathlib.Path) -> ServerProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATOMD_")}
    env.update({k: pod.local_path(v) if v.startswith("/") else v for k, v in pod.env.items()})
    return ServerProcess(argv, f"http://127.0.0.1:{http_port}", pod.name, log=log, cwd=REPO, env=env)


def listen_here(argv: list[str], http_port: int) -> list[str]:
    return replace_flag(replace_flag(argv, "--host", "127.0.0.1"), "--port", str(http_port))


def metric_names(text: str) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update({"counter": [family.name + "_total"],
                      "histogram": [family.name + s for s in ("_bucket", "_sum", "_count")]}.get(family.type, []))
        names.update(s.name for s in family.samples)
    return names


def sample(text: str, name: str, **labels: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def service_monitor_headers(objs: list[dict]) -> dict[str, str]:
    """The header the rendered ServiceMonitor's endpoint scrapes with (its Secret's key as a Bearer)."""
    [endpoint] = one(objs, "ServiceMonitor")["spec"]["endpoints"]
    credentials = endpoint["authorization"]["credentials"]
    assert endpoint["authorization"]["type"] == "Bearer"
    return {"Authorization": "Bearer " + secret_data(objs, credentials["name"])[credentials["key"]].decode()}


def test_rendered_release_serves_the_offline_greedy_tokens(tmp_path):
    objs = render(set_values=VALUES, release=RELEASE, namespace=NAMESPACE, api_versions=[MONITORING_API])
    domain = yaml.safe_load((CHART / "values.yaml").read_text())["clusterDomain"]
    pods = {pod_labels(w)["app.kubernetes.io/component"]: Pod(objs, w, tmp_path, pod_ip="127.0.0.1")
            for w in by_kind(objs, "StatefulSet") + by_kind(objs, "Deployment")}
    assert sorted(pods) == ["decode", "prefill", "router"]
    assert all(w["spec"]["replicas"] == 1 for w in by_kind(objs, "StatefulSet") + by_kind(objs, "Deployment"))
    with_secret = secret_flag_known(pods["router"].local_path("/etc/atomd/kv-params-secret/key"))
    api_key = pods["router"].env["ATOMD_API_KEY"]
    assert api_key and all(p.env["ATOMD_API_KEY"] == api_key for p in pods.values())

    procs: list[ServerProcess] = []
    ports = {role: free_port() for role in pods}
    side_channel_port = free_port()
    try:
        for role in ("prefill", "decode"):
            pod = pods[role]
            argv = local_argv(pod, pod.argv())
            assert argv[:2] == ["atomd", "serve"]
            argv = [str(pathlib.Path(sys.executable).with_name("atomd")), *listen_here(argv, ports[role])[1:]]
            argv = replace_flag(argv, "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}")
            if role == "prefill":
                argv = replace_flag(argv, "--kv-side-channel-port", str(side_channel_port))
            if not with_secret:
                argv = strip_flag(argv, SECRET_FLAG)
            procs.append(started(pod, argv, ports[role], tmp_path / f"{role}.log"))

        # DNS as the cluster would answer it: each headless Service -> the pods it selects
        hosts = {}
        for role in ("prefill", "decode"):
            sts = one(objs, "StatefulSet", f"-{role}")
            svc = one(objs, "Service", sts["spec"]["serviceName"])
            assert svc["spec"]["clusterIP"] == "None"
            port = next(p for p in svc["spec"]["ports"] if p["name"] == "http")
            assert pods[role].port(port["targetPort"]) == pods[role].port("http")
            name = f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.{domain}:{port['port']}"
            hosts[name] = [f"127.0.0.1:{ports[role]}"]
        hosts_file = tmp_path / "hosts.json"
        hosts_file.write_text(json.dumps(hosts))

        router = pods["router"]
        argv = local_argv(router, router.argv())
        assert argv[0] == "atomd-router"
        argv = [sys.executable, "-m", "tests.dns_router", str(hosts_file), *listen_here(argv, ports["router"])[1:]]
        if not with_secret:
            argv = strip_flag(argv, SECRET_FLAG)
        procs.append(started(router, argv, ports["router"], tmp_path / "router.log"))

        from atomd import LLM, SamplingParams  # while the pods load

        engine_cfg = json.loads(one(objs, "ConfigMap", "-config")["data"]["decode.json"])
        llm = LLM(max_model_len=engine_cfg["max_model_len"], num_threads=1)
        greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
        expected = llm.generate([PROMPT], greedy)[0].outputs[0].text
        assert expected.strip()

        for proc, pod in zip(procs, (pods["prefill"], pods["decode"], router)):
            proc.wait_ready(START_TIMEOUT_S, path=pod.probes()["readinessProbe"][0])
        for role, pod in pods.items():
            for kind, (path, port) in pod.probes().items():
                assert port == pod.port("http")
                status, body = http("GET", f"http://127.0.0.1:{ports[role]}{path}")
                assert status == 200, f"{role} {kind} GET {path}: {status} {body[:200]}"

        auth = {"Authorization": f"Bearer {api_key}"}
        status, body = http("GET", f"http://127.0.0.1:{ports['prefill']}/kv_transfer_info", headers=auth)
        assert status == 200, body
        assert json.loads(body)["side_channel"] == {"host": "127.0.0.1", "port": side_channel_port}  # $(POD_IP)

        url = f"http://127.0.0.1:{ports['router']}/v1/completions"
        request = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        assert http("POST", url, request)[0] == 401  # the router wants the chart's key
        status, body = http("POST", url, request, headers=auth, timeout=120)
        assert status == 200, body
        assert json.loads(body)["choices"][0]["text"] == expected
        status, body = http("POST", url, dict(request, stream=True), headers=auth, timeout=120)
        assert status == 200, body
        events = [json.loads(line[6:]) for line in body.decode().split("\n\n") if line.startswith("data: {")]
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == expected

        scrape_auth = service_monitor_headers(objs)  # as Prometheus scrapes: the router's per-worker series need it
        scraped = {role: http("GET", f"http://127.0.0.1:{ports[role]}/metrics", headers=scrape_auth)[1].decode()
                   for role in pods}
        assert sample(scraped["router"], "atomd_router:decision_total", decision="pd") == 2
        assert sample(scraped["decode"], "atomd:kv_transfer_bytes_total") > 0  # pulled from P, not recomputed
        served = set().union(*(metric_names(text) for text in scraped.values()))
        assert dashboard_metric_names() - served == set(), "the Grafana dashboard queries metrics no server exports"
    finally:
        for proc in reversed(procs):
            proc.stop()
