"""A two-node Ray cluster across test hosts: the head on host a, a worker node joining from host
b with `ray start --address`, the 1p1d job submitted from the root namespace with
launch/configs/1p1d-2nodes.yaml, whose per-node custom resources put the prefill engine
on a (`prefill_node`) and the decode engine on b (`decode_node`).

- The job gets ready and serves the offline engine's greedy tokens; the engines are on the
  nodes the config asked for, as Ray's own node and actor listings say; the KV crossed the
  bridge (D's received bytes, P's side channel on a's address).
- The worker node's processes all killed (host b loses every process: raylet, workers,
  the decode engine): the job log names the engine that is gone, the router takes it out
  of rotation; `ray start --address` on b again brings it back (Ray reschedules the
  decode placement group on the new node and restarts the actor, up to `max_restarts`),
  and the cluster serves the same tokens again.
- `ray job stop` stops every actor and engine process; stopping the two nodes leaves no
  process in either host, and the fixture then removes the namespaces.

`make e2e-netns` runs this file (`netns_full`): two Ray nodes cost ~1 GB and a minute of
start-up on a 2-core machine.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from launch.netns import netns_pids
from launch.process import http
from launch.ray_cluster import READY_LINE
from tests.netns import complete, hosts, offline_llm, prometheus
from tests.server_fixtures import ENGINE_ARGS
from tests.test_ray_e2e import RAY_ENV, VENV_BIN, poll, process_tree, ray_cli, still_running

pytestmark = [pytest.mark.e2e, pytest.mark.netns, pytest.mark.netns_full, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[1]
GCS_PORT = 6379
DASHBOARD_PORT = 8265
ROUTER_PORT = 8000
START_TIMEOUT_S = 240.0
JOB_READY_TIMEOUT_S = 600.0
RECOVERY_TIMEOUT_S = 300.0
GREEDY = {"prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0}
_THREADS = ENGINE_ARGS.index("--num-threads")
TEST_ENGINE_FLAGS = ENGINE_ARGS[:_THREADS] + ENGINE_ARGS[_THREADS + 2:]
# The head notices a dead node after ~5 s of failed health checks instead of ~30 s.
HEAD_ENV = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "2000",
            "RAY_health_check_failure_threshold": "5"}


class Node:
    """`ray start --block` inside a test host; stop() ends it and everything it started."""

    def __init__(self, net, host, args: list[str], env: dict, log: Path):
        self.net, self.host, self.log_path = net, host, log
        with open(log, "ab") as f:
            self.proc = net.popen(host, [str(VENV_BIN / "ray"), "start", "--block", f"--node-ip-address={host.ip}",
                                         "--temp-dir", net.ray_temp_dir, "--disable-usage-stats",
                                         "--object-store-memory", str(100 << 20), *args],
                                  env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        """SIGTERM the blocking `ray start` (it stops the Ray processes it started), then its group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


def start_worker(net, tmp: Path, n: int) -> Node:
    a, b = net.hosts
    return Node(net, b, [f"--address={a.ip}:{GCS_PORT}", "--num-cpus", "2", "--resources",
                         json.dumps({"decode_node": 1})], RAY_ENV, tmp / f"ray-worker-{n}.log")


def dashboard(net) -> str:
    return f"http://{net.hosts[0].ip}:{DASHBOARD_PORT}"


def alive_nodes(net) -> list:
    from ray.util.state import list_nodes

    return [n for n in list_nodes(address=dashboard(net), detail=True, raise_on_missing_output=False, timeout=30)
            if n.state == "ALIVE"]


@pytest.fixture(scope="module")
def ray2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("netns-ray")
    with hosts(2) as net:
        a, b = net.hosts
        net.nodes = []
        net.ray_temp_dir = tempfile.mkdtemp(prefix="atomd-ray-", dir="/tmp")  # short: Ray's socket paths
        try:
            net.head = Node(net, a, ["--head", "--port", str(GCS_PORT), "--num-cpus", "2", "--resources",
                                     json.dumps({"prefill_node": 1}), "--include-dashboard", "true",
                                     "--dashboard-host", a.ip, "--dashboard-port", str(DASHBOARD_PORT)],
                            {**RAY_ENV, **HEAD_ENV}, tmp / "ray-head.log")
            net.nodes.append(net.head)

            def jobs_api_up():
                assert net.head.proc.poll() is None, f"the head exited; see {net.head.log_path}"
                try:  # from the root namespace, over its veth onto the bridge
                    return http("GET", dashboard(net) + "/api/jobs/", timeout=5)[0] == 200
                except OSError:
                    return False
            poll("the Ray head's job API", jobs_api_up, START_TIMEOUT_S)
            net.worker = start_worker(net, tmp, 1)
            net.nodes.append(net.worker)
            poll("the worker node to join", lambda: len(alive_nodes(net)) == 2, START_TIMEOUT_S)
            net.tmp = tmp
            yield net
        finally:
            for node in reversed(net.nodes):
                node.stop()
            shutil.rmtree(net.ray_temp_dir, ignore_errors=True)


def write_config(tmp: Path) -> Path:
    data = yaml.safe_load((ROOT / "launch" / "configs" / "1p1d-2nodes.yaml").read_text())
    data["router"]["port"] = ROUTER_PORT
    for role in ("prefill", "decode"):
        data[role]["extra_args"] = [*data[role].get("extra_args", []), *TEST_ENGINE_FLAGS]
    path = tmp / "1p1d-2nodes.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class Job:
    def __init__(self, net, submission_id: str):
        self.net, self.submission_id = net, submission_id
        self.router_url = ""

    def client(self):
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(dashboard(self.net))

    def status(self) -> str:
        return str(self.client().get_job_status(self.submission_id).value)

    def logs(self) -> str:
        return self.client().get_job_logs(self.submission_id)

    def actors(self) -> list:
        from ray.util.state import list_actors

        job_id = self.client().get_job_info(self.submission_id).job_id
        return list_actors(address=dashboard(self.net), filters=[("job_id", "=", job_id)], detail=True,
                           raise_on_missing_output=False, timeout=30)

    def alive(self, name: str):
        found = [x for x in self.actors() if x.name == name and x.state == "ALIVE"]
        return found[0] if found else None


@pytest.fixture(scope="module")
def job(ray2):
    config = write_config(ray2.tmp)
    j = Job(ray2, f"atomd-netns-{os.getpid()}-{time.monotonic_ns()}")
    result = ray_cli("job", "submit", "--address", dashboard(ray2), "--no-wait", "--submission-id", j.submission_id,
                     "--working-dir", ".", "--", "python", "-m", "launch.ray_cluster", "--config", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    try:
        def ready_line():
            status = j.status()
            assert status in ("PENDING", "RUNNING"), f"job {status}:\n{j.logs()[-5000:]}"
            lines = [ln for ln in j.logs().splitlines() if READY_LINE in ln]
            return lines and lines[-1].split(READY_LINE, 1)[1].split()[0]
        j.router_url = poll("the job's ready line", ready_line, JOB_READY_TIMEOUT_S, interval_s=1.0)
        ray2.llm = offline_llm()
        yield j
    finally:  # a test that stopped the nodes stopped the job with them
        if ray2.head.proc.poll() is None and j.status() not in ("STOPPED", "SUCCEEDED", "FAILED"):
            ray_cli("job", "stop", "--address", dashboard(ray2), j.submission_id)


def workers(router_url: str, role: str) -> list[dict]:
    status, raw = http("GET", router_url + "/workers", timeout=10)
    assert status == 200, raw
    return [w for w in json.loads(raw)["workers"] if w["role"] == role]


def metrics(url: str) -> dict[str, float]:
    status, body = http("GET", url + "/metrics", timeout=10)
    assert status == 200, body
    return prometheus(body)


def expected(net) -> str:
    from atomd import SamplingParams

    out = net.llm.generate([GREEDY["prompt"]], SamplingParams(max_tokens=GREEDY["max_tokens"], temperature=0),
                           use_tqdm=False)
    return out[0].outputs[0].text


def node_of(net, actor) -> str:
    """The IP of the node an actor runs on, from Ray's own node listing."""
    return {n.node_id: n.node_ip for n in alive_nodes(net)}[actor.node_id]


def test_two_node_job_places_engines_by_node_resources_and_serves(ray2, job):
    a, b = ray2.hosts
    assert job.router_url == f"http://{a.ip}:{ROUTER_PORT}"  # the router is on the head
    prefill, decode, router = (job.alive(f"atomd-{r}") for r in ("prefill-0", "decode-0", "router"))
    assert prefill and decode and router, [(x.name, x.state) for x in job.actors()]
    assert node_of(ray2, prefill) == a.ip and node_of(ray2, decode) == b.ip and node_of(ray2, router) == a.ip
    nodes = {n.node_ip: n.resources_total for n in alive_nodes(ray2)}
    assert nodes[a.ip].get("prefill_node") == 1 and nodes[b.ip].get("decode_node") == 1

    [p] = workers(job.router_url, "prefill")
    [d] = workers(job.router_url, "decode")
    assert p["url"].startswith(f"http://{a.ip}:") and d["url"].startswith(f"http://{b.ip}:")
    status, raw = http("GET", p["url"] + "/kv_transfer_info", timeout=10)
    assert json.loads(raw)["side_channel"]["host"] == a.ip
    pulled = metrics(d["url"])["atomd:kv_transfer_bytes_total"]
    b_rx = ray2.link_bytes("b")[1]
    status, got = complete(job.router_url, GREEDY)
    assert status == 200, got
    assert got["choices"][0]["text"] == expected(ray2)
    moved = metrics(d["url"])["atomd:kv_transfer_bytes_total"] - pulled
    assert moved > 0 and ray2.link_bytes("b")[1] - b_rx >= moved  # D pulled it over b's interface


def test_worker_node_killed_then_rejoining(ray2, job):
    a, b = ray2.hosts
    want = expected(ray2)
    [old] = workers(job.router_url, "decode")
    decode = job.alive("atomd-decode-0")
    # every process of host b: the raylet, its workers, the decode actor, its engine
    for pid in netns_pids(b.ns):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    ray2.worker.proc.wait(30)
    poll("host b to have no process left", lambda: not netns_pids(b.ns), 60)

    poll("the job log to name the decode engine as gone",
         lambda: "engine decode-0 is gone" in job.logs(), RECOVERY_TIMEOUT_S)
    poll("the router to take the decode engine out of rotation",
         lambda: not any(w["healthy"] for w in workers(job.router_url, "decode")), RECOVERY_TIMEOUT_S)
    assert http("GET", job.router_url + "/ready", timeout=10)[0] == 503
    status, raw = complete(job.router_url, GREEDY)
    assert status >= 500, raw  # no decode engine: an error, not a hang
    poll("Ray to see the worker node dead", lambda: len(alive_nodes(ray2)) == 1, RECOVERY_TIMEOUT_S)

    ray2.worker = start_worker(ray2, ray2.tmp, 2)  # the node rejoins
    ray2.nodes.append(ray2.worker)

    def restarted():
        x = job.alive("atomd-decode-0")
        return x and x.actor_id == decode.actor_id and x.num_restarts >= 1 and x
    again = poll("Ray to restart the decode actor on the new node", restarted, RECOVERY_TIMEOUT_S)
    assert node_of(ray2, again) == b.ip

    def back():
        live = workers(job.router_url, "decode")
        return len(live) == 1 and live[0]["healthy"] and live[0]["url"] != old["url"] and live[0]
    new = poll("the router to serve the restarted decode engine only", back, RECOVERY_TIMEOUT_S)
    assert new["url"].startswith(f"http://{b.ip}:")
    assert "engine decode-0 is back" in job.logs()
    status, got = complete(job.router_url, GREEDY)
    assert status == 200 and got["choices"][0]["text"] == want, got
    [p] = workers(job.router_url, "prefill")
    poll("P to release every pinned block", lambda: metrics(p["url"])["atomd:kv_blocks_pinned"] == 0, 60)


def test_an_expert_parallel_engine_over_both_nodes_serves_hf_greedy(ray2, tmp_path):
    """A second job beside the first: its decode engine is EP=2 over the two nodes
    (`data_parallel_size: 2`, `data_parallel_size_local: 1`): one actor a node, each node's
    `atomd serve` running its rank, rank 0's address and port found on a's bundle; the router
    gets both hosts' servers; requests through it equal HF's greedy tokens; each host's /metrics
    counts its own experts only (4 of 8), some on each. Then node b's actor is killed: the
    engine fails whole and cleanly (host a's server unhealthy within the group timeout, the
    router's request an error, not a hang; the driver names the lost share and lives on)."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.test_expert_parallel import hf_text
    from tests.test_model_hf import hf_greedy, make_checkpoint, prompts_of

    a, b = ray2.hosts
    model = make_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe", seed=40)  # 8 experts, top-2, 2 layers
    config = {"model": str(model), "router": {"port": ROUTER_PORT + 1, "num_cpus": 0},
              "prefill": {"num_cpus": 0.25, "extra_args": TEST_ENGINE_FLAGS},
              "decode": {"data_parallel_size": 2, "data_parallel_size_local": 1, "enable_expert_parallel": True,
                         "num_cpus": 0.25, "extra_args": [*TEST_ENGINE_FLAGS, "--dp-collective-timeout-s", "10"]}}
    path = tmp_path / "ep-2nodes.yaml"
    path.write_text(yaml.safe_dump(config))
    ep = Job(ray2, f"atomd-netns-ep-{os.getpid()}-{time.monotonic_ns()}")
    result = ray_cli("job", "submit", "--address", dashboard(ray2), "--no-wait", "--submission-id", ep.submission_id,
                     "--working-dir", ".", "--", "python", "-m", "launch.ray_cluster", "--config", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    try:
        def ready_line():
            status = ep.status()
            assert status in ("PENDING", "RUNNING"), f"job {status}:\n{ep.logs()[-5000:]}"
            return any(READY_LINE in ln for ln in ep.logs().splitlines())
        poll("the EP job's ready line", ready_line, JOB_READY_TIMEOUT_S, interval_s=1.0)
        router_url = f"http://{a.ip}:{ROUTER_PORT + 1}"
        nodes = [ep.alive(f"atomd-decode-0-node{n}") for n in range(2)]
        assert all(nodes), [(x.name, x.state) for x in ep.actors()]
        assert sorted(node_of(ray2, x) for x in nodes) == sorted([a.ip, b.ip])  # STRICT_SPREAD
        decode = workers(router_url, "decode")
        assert sorted(w["url"].split("//")[1].split(":")[0] for w in decode) == sorted([a.ip, b.ip])
        prompts = [[t % 297 + 3 for t in p] for p in prompts_of([5, 23, 40, 17], seed=5)]
        for prompt in prompts:  # round robin: both hosts' servers serve some
            status, got = complete(router_url, {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                "ignore_eos": True})
            assert status == 200, got
            assert got["choices"][0]["text"] == hf_text(model, hf_greedy(model, prompt, 8))
        owned = []
        for w in decode:
            status, raw = http("GET", w["url"] + "/metrics", timeout=10)
            assert status == 200
            families = {f.name: f for f in text_string_to_metric_families(raw.decode())}
            samples = [x for x in families["atomd:expert_tokens"].samples if x.name.endswith("_total")]
            owned.append({(x.labels["dp_rank"], x.labels["expert"]) for x in samples})
            assert sum(x.value for x in samples) > 0  # every decode step ran both hosts' experts
        assert sorted(owned, key=sorted) == [{("0", str(e)) for e in range(4)}, {("1", str(e)) for e in range(4, 8)}]

        # node b's actor dies (its `atomd serve` dies with it): host a's rank fails its next
        # collective within the group timeout (10 s), so the engine is down as a whole, cleanly:
        # a's server says unhealthy, a request through the router errors instead of hanging,
        # the driver names the lost node's share and keeps running
        [on_b] = [x for x in nodes if node_of(ray2, x) == b.ip]
        [url_a] = [w["url"] for w in decode if f"//{a.ip}:" in w["url"]]
        os.kill(on_b.pid, signal.SIGKILL)
        killed = time.monotonic()
        poll("host a's rank to report the group dead", lambda: http("GET", url_a + "/health", timeout=10)[0] == 503,
             10 + 20)
        assert time.monotonic() - killed < 10 + 20
        status, got = complete(router_url, {"prompt": prompts[0], "max_tokens": 8, "temperature": 0}, timeout=60)
        assert status >= 500, got
        poll("the job log to name node b's share as gone", lambda: "engine decode-0/node1 is gone" in ep.logs()
             or "engine decode-0/node0 is gone" in ep.logs(), RECOVERY_TIMEOUT_S)
        assert ep.status() == "RUNNING"
    finally:
        ray_cli("job", "stop", "--address", dashboard(ray2), ep.submission_id)
        poll("the EP job to stop", lambda: ep.status() in ("STOPPED", "FAILED", "SUCCEEDED"), 60)


def test_clean_stop_leaves_no_process(ray2, job):
    actors = [x for x in job.actors() if x.state == "ALIVE"]
    assert {x.name for x in actors} >= {"atomd-router", "atomd-prefill-0", "atomd-decode-0"}
    trees = {}
    for x in actors:
        trees.update(process_tree(x.pid))  # actor pids are per host, but /proc is shared: one pid space
    result = ray_cli("job", "stop", "--address", dashboard(ray2), job.submission_id)
    assert result.returncode == 0, result.stdout + result.stderr
    poll("the job to stop", lambda: job.status() == "STOPPED", 60)
    poll("every actor process and engine to exit", lambda: not still_running(trees), 60)

    for node in reversed(ray2.nodes):
        node.stop()
    for host in ray2.hosts:
        poll(f"{host} to have no process left", lambda: not netns_pids(host.ns), 60)
    # the fixture's teardown then asserts that no namespace, link or process is left
