"""launch/pd_pair.sh end to end: start P, D and the router on free ports, one request through
the router (equal to what P -> D must give: the colocated tokens are checked in
test_pd_e2e.py), SIGTERM, and then no process the script started is left.

The processes are found by walking /proc from the script's pid (children, grandchildren:
the engine cores and multiprocessing's resource trackers), never by name.
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import threading
import time

import pytest

from launch.process import free_port, http, listens_on, port_in_use
from tests.server_fixtures import REPO, START_TIMEOUT_S

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def proc_stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, start time) of a live process, None if it is gone."""
    try:
        text = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
    return int(fields[1]), fields[0], int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """{pid: start time} of every live descendant of `root`."""
    children: dict[int, list[int]] = {}
    stats = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit() and (st := proc_stat(int(entry.name))) is not None:
            stats[int(entry.name)] = st
            children.setdefault(st[0], []).append(int(entry.name))
    out, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out[child] = stats[child][2]
            todo.append(child)
    return out


def cmdline(pid: int) -> list[str]:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def alive(pid: int, start_time: int) -> bool:
    st = proc_stat(pid)
    return st is not None and st[2] == start_time and st[1] != "Z"


def pair_cmd(ports: dict, *flags: str) -> list[str]:
    return ["bash", str(REPO / "launch" / "pd_pair.sh"), "--router-port", str(ports["router"]),
            "--prefill-port", str(ports["prefill"]), "--decode-port", str(ports["decode"]), *flags,
            "--", "--max-model-len", "256", "--max-num-seqs", "16"]


@pytest.fixture
def start_pair(tmp_path):
    """start(*flags, sigint_ignored=False) -> (script, ports, seen): pd_pair.sh on free ports;
    whatever it started is killed at the end. sigint_ignored: started as a background job of
    a non-interactive shell is (SIGINT ignored). TMPDIR is the test's own folder, so the
    script's default log folder goes with it."""
    started = []

    def start(*flags: str, sigint_ignored: bool = False):
        ports = {name: free_port() for name in ("router", "prefill", "decode")}
        ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
        script = subprocess.Popen(pair_cmd(ports, *flags), cwd=REPO, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, start_new_session=True, preexec_fn=ignore,
                                  env=dict(os.environ, TMPDIR=str(tmp_path)))
        seen: dict[int, int] = {}
        started.append((script, seen))
        return script, ports, seen

    yield start
    for script, seen in started:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
            script.wait(10)
        for pid, start_time in seen.items():
            if alive(pid, start_time):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def pd_pair(start_pair):
    return start_pair()


def wait_for_banner(script) -> list[str]:
    """The script's stdout lines until it says ready (read on a thread that keeps reading)."""
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.decode() for line in script.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not any("PD pair ready" in line for line in lines):  # the script saw the router's /ready
        assert script.poll() is None, f"pd_pair.sh exited before it was ready: {lines}"
        assert time.monotonic() < deadline, "pd_pair.sh: not ready in time"
        time.sleep(0.2)
    return lines


def assert_all_gone(seen: dict[int, int], why: str) -> None:
    deadline = time.monotonic() + 15
    while (left := [p for p, start in seen.items() if alive(p, start)]) and time.monotonic() < deadline:
        time.sleep(0.1)  # orphans exit on their own once their parent is gone
    assert left == [], f"left running after {why}: {left}"


def test_start_request_sigterm_leaves_nothing(pd_pair):
    script, ports, seen = pd_pair
    url = f"http://127.0.0.1:{ports['router']}"
    banner = "".join(wait_for_banner(script))
    assert url in banner and "curl" in banner  # where it listens, what to paste
    seen.update(descendants(script.pid))
    assert len(seen) >= 5  # P, D, router, and the two engine cores

    status, body = http("POST", url + "/v1/completions",
                        {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert status == 200, body
    answer = json.loads(body)
    assert answer["usage"]["completion_tokens"] == 8 and answer["choices"][0]["text"]
    status, body = http("GET", f"http://127.0.0.1:{ports['prefill']}/kv_transfer_info")
    assert status == 200 and json.loads(body)["role"] == "producer"
    # The three share a fresh secret: D acts only on params the router signed.
    secret_files = {args[args.index("--kv-params-secret-file") + 1] for pid in seen
                    if "--kv-params-secret-file" in (args := cmdline(pid))}
    assert len(secret_files) == 1 and os.stat(next(iter(secret_files))).st_mode & 0o077 == 0
    unsigned = {"do_remote_prefill": True, "transfer_id": "t" * 32, "remote_host": "127.0.0.1",
                "remote_port": ports["prefill"], "remote_block_ids": [0], "num_prompt_tokens": 4,
                "access_token": "ab" * 16}
    status, body = http("POST", f"http://127.0.0.1:{ports['decode']}/v1/completions",
                        {"prompt": [11, 12, 13, 14], "max_tokens": 2, "kv_transfer_params": unsigned})
    assert status == 403 and json.loads(body)["error"]["code"] == "kv_params_untrusted"

    script.send_signal(signal.SIGTERM)
    script.wait(60)
    assert_all_gone(seen, "SIGTERM")
    assert not any(os.path.exists(path) for path in secret_files)  # the secret went with them


def prefill_kv_hits(router_url: str) -> float:
    """The router's count of prefill placements kv_aware made onto cached blocks."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = http("GET", router_url + "/metrics")
    assert status == 200
    return sum(s.value for fam in text_string_to_metric_families(body.decode()) for s in fam.samples
               if s.name == "atomd_router:decision_total"
               and s.labels == {"role": "prefill", "policy": "kv_aware", "decision": "kv_hit"})


def test_kv_aware_quiet_logs_and_sigint_in_the_background(start_pair, tmp_path):
    """--kv-aware: each engine its own KV-events ports and the router on kv_aware, so a
    repeated prefix goes to the engine holding it. The engines' probes stay out of the logs
    (one file each, named at start). Started as a background job (SIGINT ignored), SIGINT
    still stops all of it."""
    logs = tmp_path / "logs"
    script, ports, seen = start_pair("--kv-aware", "--log-dir", str(logs),
                                     "--router-args", "--health-interval-s 0.2", sigint_ignored=True)
    banner = "".join(wait_for_banner(script))
    names = [logs / f"{role}.log" for role in ("prefill", "decode", "router")]
    assert all(str(path) in banner for path in names)
    seen.update(descendants(script.pid))
    events = [args[args.index("--kv-events-endpoint") + 1] for pid in seen
              if "--kv-events-endpoint" in (args := cmdline(pid))]
    assert len(events) == 2 and len(set(events)) == 2, events  # P's and D's, apart

    url = f"http://127.0.0.1:{ports['router']}"
    prefix = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 2
    hits = prefill_kv_hits(url)
    for tail in ("print(fibonacci(10))", "print(fibonacci(20))"):
        status, body = http("POST", url + "/v1/completions", {"prompt": prefix + tail, "max_tokens": 2})
        assert status == 200, body
    assert prefill_kv_hits(url) == hits + 1  # the second request found its prefix on P

    # Idle, with the router probing every 0.2 s: no access-log line for a probe.
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        probes = [line for path in names[:2] for line in path.read_text().splitlines()
                  if line.startswith("{") and json.loads(line)["path"] in ("/health", "/ready", "/metrics")]
        assert probes == []
        time.sleep(0.2)
    assert '"/v1/completions"' in names[0].read_text()  # requests still are logged

    script.send_signal(signal.SIGINT)
    assert script.wait(60) != 0
    assert_all_gone(seen, "SIGINT")


@pytest.mark.parametrize("taken", ["router", "prefill", "decode"])
def test_a_taken_port_is_one_line_naming_its_flag(taken, tmp_path):
    """Another process listens on one of the pair's ports: the script says which flag to
    change, exits 2 and leaves nothing running (it never says ready for someone else's server)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        ports = {name: free_port() for name in ("router", "prefill", "decode")}
        ports[taken] = holder.getsockname()[1]
        script = subprocess.Popen(pair_cmd(ports), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, start_new_session=True, env=dict(os.environ, TMPDIR=str(tmp_path)))
        try:
            out, err = script.communicate(timeout=120)
        finally:
            if script.poll() is None:
                os.killpg(script.pid, signal.SIGKILL)
        assert script.returncode == 2
        assert "ready" not in out and "Traceback" not in err
        assert err.strip().splitlines() == [f"pd_pair.sh: port {ports[taken]} on 127.0.0.1 is in use by another "
                                            f"process; pick a free one with --{taken}-port"]
        mine = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
                if any(str(ports[role]) in cmdline(pid) for role in ports if role != taken)]
        assert mine == []  # no engine or router of this pair is running


def test_listens_on_tells_our_socket_from_anothers():
    with socket.socket() as ours:
        ours.bind(("127.0.0.1", 0))
        ours.listen()
        port = ours.getsockname()[1]
        assert listens_on(os.getpid(), port)
        assert not listens_on(os.getppid(), port)
        assert port_in_use(port)
    assert not listens_on(os.getpid(), port) and not port_in_use(port)
