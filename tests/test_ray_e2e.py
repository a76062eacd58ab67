"""launch/ray_cluster.py end to end: `ray job submit` on one local Ray head per pytest session.

Ray costs seconds and ~0.5 GB per start on this box, so one head (session fixture) serves
every test and one 1p1d job (module fixture) serves the request, failure and stop tests.
The test process never calls ray.init: it talks to Ray through the `ray` CLI and the
dashboard's HTTP APIs (job submission client, state API), as an operator would.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from launch.process import free_port, http, proc_start_time
from launch.ray_cluster import READY_LINE
from tests.server_fixtures import ENGINE_ARGS, model_dir, start_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
# The job's `python` is the first on the PATH `ray start` had: this venv's.
RAY_ENV = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "RAY_USAGE_STATS_ENABLED": "0",
           # Ray >= 2.5x turns token auth on when ~/.ray/auth_token exists (an earlier local
           # ray.init may have written one): its job API then answers this test's probes 401
           "RAY_AUTH_MODE": "disabled"}
HEAD_START_TIMEOUT_S = 180.0
JOB_READY_TIMEOUT_S = 600.0
RECOVERY_TIMEOUT_S = 180.0
GREEDY = {"prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0}
# The server tests' engine flags, but the thread count is the config's (`num_threads`).
_THREADS = ENGINE_ARGS.index("--num-threads")
TEST_ENGINE_FLAGS = ENGINE_ARGS[:_THREADS] + ENGINE_ARGS[_THREADS + 2:]


def ray_cli(*args: str, timeout_s: float = 180.0) -> subprocess.CompletedProcess:
    return subprocess.run([str(VENV_BIN / "ray"), *args], env=RAY_ENV, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout_s)


def poll(what: str, check, timeout_s: float, interval_s: float = 0.5):
    """check() until it returns something truthy; AssertionError naming `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


# ------------------------------------------------------------------ processes by PID

def process_tree(pid: int) -> dict[int, int]:
    """{pid: start time} of `pid` and all its descendants, read from /proc."""
    tree, todo = {}, [pid]
    while todo:
        p = todo.pop()
        start = proc_start_time(p)
        if start is None:
            continue
        tree[p] = start
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return tree


def still_running(tree: dict[int, int]) -> list[int]:
    return [pid for pid, start in tree.items() if proc_start_time(pid) == start]


# ------------------------------------------------------------------ the Ray head

@dataclass
class RayHead:
    dashboard_url: str
    temp_dir: str

    def job_client(self):
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.dashboard_url)

    def actors(self, job_id: str) -> list:
        from ray.util.state import list_actors

        return list_actors(address=self.dashboard_url, filters=[("job_id", "=", job_id)],
                           detail=True, raise_on_missing_output=False, timeout=30)


def stop_head(proc: subprocess.Popen) -> None:
    """SIGTERM the blocking `ray start`: it stops every Ray process it started. Then its own
    process group is killed for anything left; no process is found by name."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


@pytest.fixture(scope="session")
def ray_head():
    temp_dir = tempfile.mkdtemp(prefix="atomd-ray-", dir="/tmp")  # short: Ray's socket paths
    dashboard_port = free_port()
    cmd = ["start", "--head", "--block", "--node-ip-address=127.0.0.1", "--port", str(free_port()),
           "--num-cpus", "4", "--temp-dir", temp_dir, "--disable-usage-stats",
           "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
           "--dashboard-port", str(dashboard_port), "--dashboard-agent-listen-port", str(free_port()),
           "--ray-client-server-port", str(free_port()), "--metrics-export-port", str(free_port()),
           "--object-store-memory", str(100 << 20)]
    log = open(Path(temp_dir) / "ray-start.log", "wb")
    proc = subprocess.Popen([str(VENV_BIN / "ray"), *cmd], env=RAY_ENV, cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    head = RayHead(f"http://127.0.0.1:{dashboard_port}", temp_dir)
    try:
        def jobs_api_up():
            assert proc.poll() is None, f"ray start exited with {proc.returncode}; see {log.name}"
            try:
                return http("GET", head.dashboard_url + "/api/jobs/", timeout=5)[0] == 200
            except OSError:
                return False
        poll("the Ray head's job API", jobs_api_up, HEAD_START_TIMEOUT_S)
        yield head
    finally:
        stop_head(proc)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


# ------------------------------------------------------------------ jobs

@dataclass
class Job:
    head: RayHead
    submission_id: str
    router_url: str = ""

    def status(self) -> str:
        return str(self.head.job_client().get_job_status(self.submission_id).value)

    def logs(self) -> str:
        return self.head.job_client().get_job_logs(self.submission_id)

    def job_id(self) -> str:
        return self.head.job_client().get_job_info(self.submission_id).job_id

    def alive_actors(self) -> list:
        return [a for a in self.head.actors(self.job_id()) if a.state == "ALIVE"]

    def stop(self) -> None:
        if self.status() not in ("STOPPED", "SUCCEEDED", "FAILED"):
            result = ray_cli("job", "stop", "--address", self.head.dashboard_url, self.submission_id)
            assert result.returncode == 0, result.stdout + result.stderr


def write_config(tmp_dir: Path, name: str, **overrides) -> Path:
    """A shipped config with the test engines' small pool. Nothing in it says where to listen:
    submit() gives the launcher the head's --node-ip-address and a free router port."""
    data = yaml.safe_load((ROOT / "launch" / "configs" / name).read_text())
    for role in ("prefill", "decode"):
        data[role]["extra_args"] = [*data[role].get("extra_args", []), *TEST_ENGINE_FLAGS]
        data[role].update(overrides.get(role, {}))
    path = tmp_dir / f"{os.getpid()}-{name}"
    path.write_text(yaml.safe_dump(data))
    return path


def submit(head: RayHead, config: Path) -> Job:
    job = Job(head, f"atomd-test-{os.getpid()}-{time.monotonic_ns()}")
    result = ray_cli("job", "submit", "--address", head.dashboard_url, "--no-wait",
                     "--submission-id", job.submission_id, "--working-dir", ".", "--",
                     "python", "-m", "launch.ray_cluster", "--config", str(config),
                     "--node-ip-address", "127.0.0.1", "--router-port", str(free_port()))
    assert result.returncode == 0, result.stdout + result.stderr
    return job


def wait_for_router_url(job: Job) -> str:
    def ready_line():
        status = job.status()
        assert status in ("PENDING", "RUNNING"), f"job {status}:\n{job.logs()[-5000:]}"
        lines = [ln for ln in job.logs().splitlines() if READY_LINE in ln]
        return lines and lines[-1].split(READY_LINE, 1)[1].split()[0]
    return poll("the job's ready line", ready_line, JOB_READY_TIMEOUT_S, interval_s=1.0)


@pytest.fixture(scope="module")
def job_1p1d(ray_head, tmp_path_factory):
    job = submit(ray_head, write_config(tmp_path_factory.mktemp("ray-configs"), "1p1d.yaml"))
    try:
        job.router_url = wait_for_router_url(job)
        yield job
    finally:
        job.stop()


def complete(url: str, body: dict = GREEDY) -> dict:
    status, raw = http("POST", url + "/v1/completions", body, timeout=120)
    assert status == 200, raw
    return json.loads(raw)


def workers(router_url: str, role: str) -> list[dict]:
    status, raw = http("GET", router_url + "/workers", timeout=10)
    assert status == 200, raw
    return [w for w in json.loads(raw)["workers"] if w["role"] == role]


def metric(engine_url: str, sample: str) -> float:
    """One series of an engine's /metrics, summed over its labels, read with prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    status, raw = http("GET", engine_url + "/metrics", timeout=10)
    assert status == 200, raw
    samples = [s for fam in text_string_to_metric_families(raw.decode()) for s in fam.samples if s.name == sample]
    assert samples, f"{engine_url}/metrics has no {sample}"
    return sum(s.value for s in samples)


# ------------------------------------------------------------------ tests

def test_greedy_through_the_ray_router_matches_colocated_serve(job_1p1d):
    [decode] = workers(job_1p1d.router_url, "decode")
    [prefill] = workers(job_1p1d.router_url, "prefill")
    # the launcher's --node-ip-address is what atomd binds (Ray 2.60 swaps a loopback one for the machine's)
    assert all(url.startswith("http://127.0.0.1:") for url in (job_1p1d.router_url, decode["url"], prefill["url"]))
    pulled_before = metric(decode["url"], "atomd:kv_transfer_bytes_total")
    through_ray = complete(job_1p1d.router_url)
    assert metric(decode["url"], "atomd:kv_transfer_bytes_total") > pulled_before, "D did not pull the prompt KV"
    colocated = start_server(model_dir())
    try:
        reference = complete(colocated.url)
    finally:
        colocated.stop()
    assert through_ray["choices"][0]["text"] == reference["choices"][0]["text"]
    assert through_ray["choices"][0]["finish_reason"] == reference["choices"][0]["finish_reason"]
    assert through_ray["usage"]["completion_tokens"] == reference["usage"]["completion_tokens"]
    # The launcher gave the router and the engines one secret: D acts only on signed params.
    unsigned = {"do_remote_prefill": True, "transfer_id": "u" * 32, "remote_host": "127.0.0.1",
                "remote_port": 1, "remote_block_ids": [0], "num_prompt_tokens": 3, "access_token": "ab" * 16}
    status, body = http("POST", decode["url"] + "/v1/completions",
                        {"prompt": [11, 12, 13], "max_tokens": 2, "kv_transfer_params": unsigned}, timeout=30)
    assert status == 403 and json.loads(body)["error"]["code"] == "kv_params_untrusted"


def stream_until_first_chunk(router_url: str, started: threading.Event, outcome: list) -> None:
    """A long streamed request; `started` is set once decode output flows."""
    body = json.dumps({**GREEDY, "max_tokens": 200, "stream": True, "ignore_eos": True}).encode()
    req = urllib.request.Request(router_url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            for line in r:
                if line.startswith(b"data: "):
                    started.set()
                outcome[:] = [line]
    except OSError as e:
        outcome[:] = [e]
    finally:
        started.set()


def test_killed_decode_actor_restarts_and_the_router_recovers(job_1p1d):
    router = job_1p1d.router_url
    before = complete(router)
    [old_decode] = workers(router, "decode")
    [prefill] = workers(router, "prefill")
    [actor] = [a for a in job_1p1d.alive_actors() if a.name == "atomd-decode-0"]
    old_tree = process_tree(actor.pid)

    started, outcome = threading.Event(), []
    streamer = threading.Thread(target=stream_until_first_chunk, args=(router, started, outcome), daemon=True)
    streamer.start()
    assert started.wait(120), "the streamed request never produced output"
    os.kill(actor.pid, signal.SIGKILL)  # the decode actor crashes mid-stream
    streamer.join(120)
    assert not streamer.is_alive(), "the interrupted stream never ended"

    def restarted():
        alive = [a for a in job_1p1d.alive_actors() if a.name == "atomd-decode-0"]
        return alive and alive[0].pid != actor.pid and alive[0].num_restarts >= 1 and alive[0]
    poll("Ray to restart the decode actor", restarted, RECOVERY_TIMEOUT_S)

    def recovered():
        decode = workers(router, "decode")
        return [w["url"] for w in decode] != [old_decode["url"]] and len(decode) == 1 \
            and decode[0]["healthy"] and decode[0]
    new_decode = poll("the router to serve the restarted decode engine only", recovered, RECOVERY_TIMEOUT_S)
    assert new_decode["url"] != old_decode["url"]
    poll("the dead actor's atomd processes to exit", lambda: not still_running(old_tree), 60)

    after = complete(router)
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    poll("P to release every pinned block", lambda: metric(prefill["url"], "atomd:kv_blocks_pinned") == 0, RECOVERY_TIMEOUT_S)


def test_job_stop_leaves_no_actor_and_no_process(job_1p1d):
    actors = job_1p1d.alive_actors()
    assert {a.name for a in actors} >= {"atomd-router", "atomd-prefill-0", "atomd-decode-0"}
    trees = {}
    for a in actors:
        trees.update(process_tree(a.pid))
    # Each of the three actors owns a server child (and an engine owns its engine core).
    assert len(trees) >= 2 * len(actors)

    result = ray_cli("job", "stop", "--address", job_1p1d.head.dashboard_url, job_1p1d.submission_id)
    assert result.returncode == 0, result.stdout + result.stderr
    poll("the job to stop", lambda: job_1p1d.status() == "STOPPED", 60)
    poll("every actor of the job to die", lambda: not job_1p1d.alive_actors(), 60)
    poll("every actor process and child to exit", lambda: not still_running(trees), 60)


def test_config_needing_more_cpus_than_the_cluster_fails_fast(ray_head, tmp_path):
    config = write_config(tmp_path, "2p1d.yaml", prefill={"num_cpus": 3})
    job = submit(ray_head, config)
    try:
        status = poll("the job to fail", lambda: job.status() in ("FAILED", "SUCCEEDED", "STOPPED")
                      and job.status(), 120)
        logs = job.logs()
        assert status == "FAILED", logs
        # 2 x 3 prefill + 1 decode + 0.5 router on a 4-CPU head: at least 3.5 CPUs missing (more
        # while the previous test's stopped actors still hold theirs: Ray frees them a little later)
        missing = re.search(r"missing CPU=([0-9.]+)", logs)
        assert "not enough Ray resources" in logs and missing and float(missing.group(1)) >= 3.5, logs
        assert not job.alive_actors()
    finally:
        job.stop()
