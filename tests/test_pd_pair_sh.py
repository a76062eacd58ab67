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
import subprocess
import threading
import time

import pytest

from launch.process import free_port, http
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


@pytest.fixture
def pd_pair():
    ports = {name: free_port() for name in ("router", "prefill", "decode")}
    cmd = ["bash", str(REPO / "launch" / "pd_pair.sh"), "--router-port", str(ports["router"]),
           "--prefill-port", str(ports["prefill"]), "--decode-port", str(ports["decode"]),
           "--", "--max-model-len", "256", "--max-num-seqs", "16"]
    script = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    seen: dict[int, int] = {}
    try:
        yield script, ports, seen
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
            script.wait(10)
        for pid, start in seen.items():
            if alive(pid, start):
                os.kill(pid, signal.SIGKILL)


def test_start_request_sigterm_leaves_nothing(pd_pair):
    script, ports, seen = pd_pair
    url = f"http://127.0.0.1:{ports['router']}"
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.decode() for line in script.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not any("PD pair ready" in line for line in lines):  # the script saw the router's /ready
        assert script.poll() is None, f"pd_pair.sh exited before it was ready: {lines}"
        assert time.monotonic() < deadline, "pd_pair.sh: not ready in time"
        time.sleep(0.2)
    banner = "".join(lines)
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
    deadline = time.monotonic() + 15
    while (left := [p for p, start in seen.items() if alive(p, start)]) and time.monotonic() < deadline:
        time.sleep(0.1)  # orphans exit on their own once their parent is gone
    assert left == [], f"left running after SIGTERM: {left}"
    assert not any(os.path.exists(path) for path in secret_files)  # the secret went with them
