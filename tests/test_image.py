"""The image, built and run: the chart's prefill, decode and router as three containers.

`make image-check` (marker `image`, not in `make test`: it installs Docker when missing and
builds the image, minutes). A private Docker daemon (benchmarks/image.py: its own socket
and data root, no iptables, no bridge) builds the repository's Dockerfile from a local
Debian base and a local package index, then runs the chart's rendered pods the way a
kubelet would (tests/helm_tools.Pod: env from the rendered Secrets, ConfigMap and Secret
volumes as read-only bind mounts, emptyDirs as tmpfs) with the chart's security settings
(read-only root filesystem, its non-root user, no capabilities, no privilege escalation)
and the host's network. Rewritten, because the three share one host: the listen address
(0.0.0.0 -> 127.0.0.1), the ports (free local ones), status.podIP (127.0.0.1), and the
router's --prefill-dns / --decode-dns ports (the names resolve through --add-host).

Checked: the probes answer; the engines run the C kernels prebuilt in the image (none built,
none fallen back); the router's PD greedy output is the offline `LLM`'s; `docker stop`
drains: a stream in flight through the router completes, every container exits 0; the
daemon leaves the host's network as it found it (FORWARD policy, no DOCKER rules, no
docker0 / br- bridge) and no folder or mount of its own. Fails, never skips,
where Docker cannot be installed or started. The image's size, build time and start-up
time (container start to /ready) are written to CACHE/measurements.json and printed.
"""
from __future__ import annotations

import http.client
import json
import threading
import time

import pytest
import yaml

from benchmarks import image
from launch.process import free_port
from launch.process import http as http_call
from tests.helm_tools import (CHART, SECRET_FLAG, Pod, by_kind, flag_value, one, pod_labels, render,
                              replace_flag)

pytestmark = [pytest.mark.image, pytest.mark.timeout(3600)]

RELEASE, NAMESPACE = "atomd", "serving"
VALUES = {"prefill.replicas": 1, "decode.replicas": 1, "router.replicas": 1,
          "prefill.dataParallelSize": 1, "decode.dataParallelSize": 1,
          "prefill.numThreads": 1, "decode.numThreads": 1, "engine.maxModelLen": 256}
PROMPT = "def fibonacci(n):"
MAX_TOKENS = 24
READY_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def daemon():
    before = image.network_state()
    image.ensure_installed()  # raises where apt cannot install it: the check fails
    d = image.Daemon()
    try:
        yield d
    finally:
        d.close()
    assert image.network_state() == before, "the Docker daemon changed the host's iptables or bridges"
    assert not image.mounts_under(d.tmp) and not d.tmp.exists(), f"the Docker daemon left {d.tmp} behind"


@pytest.fixture(scope="module")
def built(daemon):
    seconds = image.build_image(daemon)
    size = int(daemon.docker("image", "inspect", "-f", "{{.Size}}", image.IMAGE_TAG).stdout)
    return {"build_s": round(seconds, 1), "size_mb": round(size / 1e6)}


def docker_run_args(pod: Pod, name: str) -> list[str]:
    """`docker run` flags for a rendered pod: its security context, volumes and env."""
    sc, psc = pod.container["securityContext"], pod.spec["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"]["drop"] == ["ALL"]
    assert psc["runAsNonRoot"] and psc["runAsUser"] != 0
    args = ["--name", name, "--network", "host", "--read-only", "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges", "--user", f"{psc['runAsUser']}:{psc.get('runAsGroup', psc['runAsUser'])}",
            "--stop-timeout", str(pod.spec.get("terminationGracePeriodSeconds", 30))]
    volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
    for m in pod.container.get("volumeMounts", []):
        v = volumes[m["name"]]
        if "emptyDir" in v and m["mountPath"] == "/dev/shm":
            args += ["--shm-size", "256m"]
        elif "emptyDir" in v:
            args += ["--tmpfs", f"{m['mountPath']}:rw,mode=1777"]
        else:  # a Secret or ConfigMap: the files Pod wrote
            args += ["-v", f"{pod.mounts[m['mountPath']]}:{m['mountPath']}:ro"]
    for key, value in pod.env.items():
        args += ["-e", f"{key}={value}"]
    return args


def wait_ready(port: int, path: str, deadline: float) -> float:
    while time.monotonic() < deadline:
        try:
            if http_call("GET", f"http://127.0.0.1:{port}{path}", timeout=2)[0] == 200:
                return time.monotonic()
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"127.0.0.1:{port}{path} not ready")


def stream(port: int, request: dict, headers: dict, first: threading.Event, answer: dict) -> None:
    """POST a streaming completion; `first` is set at its first token, `answer["text"]` is
    the whole text once the stream ends ([DONE])."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", json.dumps(request), {**headers, "Content-Type": "application/json"})
        resp = conn.getresponse()
        text = ""
        for line in resp:
            if line.startswith(b"data: {"):
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
                first.set()
            elif line.startswith(b"data: [DONE]"):
                answer["text"] = text
    except OSError as e:
        answer["error"] = repr(e)
    finally:
        first.set()
        conn.close()


def test_the_charts_pods_run_from_the_image(daemon, built, tmp_path):
    objs = render(set_values=VALUES, release=RELEASE, namespace=NAMESPACE)
    domain = yaml.safe_load((CHART / "values.yaml").read_text())["clusterDomain"]
    pods = {pod_labels(w)["app.kubernetes.io/component"]: Pod(objs, w, tmp_path, pod_ip="127.0.0.1")
            for w in by_kind(objs, "StatefulSet") + by_kind(objs, "Deployment")}
    assert sorted(pods) == ["decode", "prefill", "router"]
    secrets = {flag_value(p.argv(), SECRET_FLAG) for p in pods.values()}
    assert len(secrets) == 1 and None not in secrets  # one signing secret, mounted in all three
    ports = {role: free_port() for role in pods}
    names = {role: f"atomd-check-{role}" for role in pods}
    hosts = {}
    for role in ("prefill", "decode"):
        svc = one(objs, "Service", one(objs, "StatefulSet", f"-{role}")["spec"]["serviceName"])
        hosts[role] = f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.{domain}"
    started: dict[str, float] = {}

    def run(role: str, name: str) -> None:
        pod = pods[role]
        argv = replace_flag(replace_flag(pod.argv(), "--host", "127.0.0.1"), "--port", str(ports[role]))
        if role != "router":
            argv = replace_flag(argv, "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}")
        if role == "prefill":
            argv = replace_flag(argv, "--kv-side-channel-port", str(free_port()))
        extra = []
        if role == "router":  # the Services' names -> this host, at the engines' ports
            for engine in ("prefill", "decode"):
                argv = replace_flag(argv, f"--{engine}-dns", f"{hosts[engine]}:{ports[engine]}")
                extra += ["--add-host", f"{hosts[engine]}:127.0.0.1"]
        started[name] = time.monotonic()
        daemon.docker("run", "-d", *docker_run_args(pod, name), *extra, "--entrypoint", argv[0],
                      image.IMAGE_TAG, *argv[1:])

    try:
        for role in ("prefill", "decode", "router"):
            run(role, names[role])

        from atomd import LLM, SamplingParams  # while the containers load

        engine_cfg = json.loads(one(objs, "ConfigMap", "-config")["data"]["decode.json"])
        expected = LLM(max_model_len=engine_cfg["max_model_len"], num_threads=1).generate(
            [PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0].outputs[0].text
        assert expected.strip()

        deadline = time.monotonic() + READY_TIMEOUT_S
        ready_s = {}
        for role in ("prefill", "decode", "router"):
            try:
                ready_s[role] = round(wait_ready(ports[role], pods[role].probes()["readinessProbe"][0], deadline)
                                      - started[names[role]], 1)
            except TimeoutError:
                pytest.fail(f"{role} never ready:\n{daemon.docker('logs', names[role], check=False).stderr[-4000:]}")
        for role, pod in pods.items():
            for kind, (path, port) in pod.probes().items():
                status, body = http_call("GET", f"http://127.0.0.1:{ports[role]}{path}")
                assert status == 200, f"{role} {kind} GET {path}: {status} {body[:200]}"

        auth = {"Authorization": f"Bearer {pods['router'].env['ATOMD_API_KEY']}"}
        for role in ("prefill", "decode"):  # the kernels the image ships, none built, none fallen back
            status, body = http_call("GET", f"http://127.0.0.1:{ports[role]}/kv_transfer_info", headers=auth)
            assert status == 200, body
            kernels = json.loads(body)["kernels"]
            assert {"attention-d32-g2", "layer-ops"} <= set(kernels), kernels
            assert all(path.startswith("prebuilt ") for path in kernels.values()), kernels
            logs = daemon.docker("logs", names[role])
            lines = [ln for ln in (logs.stdout + logs.stderr).splitlines() if "C kernel " in ln]
            assert lines and all(": prebuilt " in ln for ln in lines), lines  # what the engine logs

        url = f"http://127.0.0.1:{ports['router']}/v1/completions"
        request = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        status, body = http_call("POST", url, request, headers=auth, timeout=120)
        assert status == 200, body
        assert json.loads(body)["choices"][0]["text"] == expected
        status, body = http_call("GET", f"http://127.0.0.1:{ports['decode']}/metrics")
        assert b"atomd:kv_transfer_bytes_total" in body  # D pulled P's KV

        # docker stop drains: a stream in flight through the router (its first tokens already
        # out) completes with every token
        first, answer = threading.Event(), {}
        inflight = threading.Thread(target=stream, args=(ports["router"], dict(request, stream=True), auth,
                                                         first, answer))
        inflight.start()
        assert first.wait(120), answer
        for role in ("router", "decode", "prefill"):
            daemon.docker("stop", names[role], timeout=120)
        inflight.join(120)
        assert answer.get("text") == expected, answer
        for role in ("router", "decode", "prefill"):
            code = daemon.docker("inspect", "-f", "{{.State.ExitCode}}", names[role]).stdout.strip()
            assert code == "0", f"{role} exited {code}:\n{daemon.docker('logs', names[role]).stderr[-3000:]}"

        # start-up alone (the three above start together, beside the offline LLM): a decode
        # container from `docker run` to /ready with nothing else starting
        names["alone"], ports["decode"] = "atomd-check-decode-alone", free_port()
        run("decode", names["alone"])
        alone = wait_ready(ports["decode"], "/ready", time.monotonic() + READY_TIMEOUT_S) - started[names["alone"]]
        daemon.docker("stop", names["alone"], timeout=120)
        measured = dict(built, ready_s=ready_s, decode_alone_ready_s=round(alone, 1))
        (image.CACHE / "measurements.json").write_text(json.dumps(measured))
        print(f"\nimage check: {json.dumps(measured)}")
    finally:
        for name in names.values():
            daemon.docker("rm", "-f", name, check=False)
