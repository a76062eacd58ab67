"""A start-up error the user caused (a port in use, a model directory that is not a
checkpoint, a missing file, an unreachable server) is one line on stderr naming what to
change, exit code 2 and no traceback, from every entry point: `atomd serve`, the router,
`atomd generate`, `atomd bench`. `--debug` shows the traceback."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from launch.process import free_port
from tests.server_fixtures import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=90)


def assert_one_line(r: subprocess.CompletedProcess, *names: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr[-3000:]
    assert all(name in lines[0] for name in names), lines[0]


@pytest.fixture
def taken_port():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_serve_port_in_use(taken_port):
    r = run("-m", "atomd", "serve", "--port", str(taken_port))
    assert_one_line(r, f"port {taken_port}", "in use", "--port")


@pytest.mark.parametrize("command", [("atomd", "serve"), ("router",)])
def test_debug_shows_the_traceback(taken_port, command):
    r = run("-m", *command, "--port", str(taken_port), "--debug")
    assert r.returncode == 2 and "Traceback" in r.stderr and "--port" in r.stderr


def test_router_port_in_use(taken_port):
    r = run("-m", "router", "--port", str(taken_port))
    assert_one_line(r, f"port {taken_port}", "in use", "--port")


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_model_dir_without_config_json(command, tmp_path):
    extra = ["--prompt", "hi"] if command == "generate" else ["--port", str(free_port())]
    r = run("-m", "atomd", command, "--model", str(tmp_path), *extra)
    assert_one_line(r, str(tmp_path), "config.json", "--model")


@pytest.mark.parametrize("argv", [["-m", "atomd", "serve", "--port", "x"], ["-m", "router", "--port", "x"],
                                  ["-m", "atomd", "generate", "--prompt", "a", "--kv-role", "sideways"],
                                  ["-m", "atomd", "bench", "serve", "--base-url", "u", "--num-prompts", "many"]])
def test_bad_flag_value(argv):
    r = run(*argv)
    assert_one_line(r, "error: argument", argv[-2])


def test_bench_unreachable_server():
    url = f"http://127.0.0.1:{free_port()}"
    r = run("-m", "atomd", "bench", "serve", "--base-url", url, "--num-prompts", "1", "--disable-tqdm")
    assert_one_line(r, url)


def test_bench_compare_missing_file(tmp_path):
    missing = tmp_path / "a.json"
    r = run("-m", "atomd", "bench", "compare", str(missing), str(missing))
    assert_one_line(r, str(missing))


def test_a_script_beside_a_clone_named_atomd_imports_the_package(tmp_path):
    """`make venv` puts the repository root on the venv's sys.path, so a script next to the
    clone's folder (named atomd/) gets the package, not that folder as an empty namespace
    package ("cannot import name 'LLM' from 'atomd' (unknown location)")."""
    (tmp_path / "atomd").symlink_to(REPO, target_is_directory=True)
    script = tmp_path / "mine.py"
    script.write_text("from atomd import LLM, SamplingParams\nprint(LLM.__module__)\n")
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "atomd.llm", f"{r.stderr[-2000:]} (a venv made before: make venv)"
