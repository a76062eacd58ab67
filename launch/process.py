"""Server child processes, in one place: start one, wait until it answers, stop it.

Everything that runs `python -m atomd serve` or `python -m router` as a child uses this
module: the tests' fixtures, the benchmarks and the Ray launcher (launch/ray_cluster.py).
Standard library only, so that anything can import it without paying for torch, aiohttp
or atomd.

    with EngineServer(None, "--kv-role", "producer", log="prefill.log") as p:
        p.wait_ready()
        status, body = http("GET", p.url + "/health")

A child is stopped by its PID only, never looked up by name: SIGTERM, SIGKILL once the
grace period has passed, then reaped.
"""
from __future__ import annotations

import json
import os
import pathlib
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from http.client import HTTPException

LOOPBACK = "127.0.0.1"
READY_TIMEOUT_S = 300.0  # a model load on a busy 2-core box
PROBE_INTERVAL_S = 0.1
PROBE_TIMEOUT_S = 2.0
STOP_GRACE_S = 20.0  # SIGTERM to SIGKILL
FAILED_START_GRACE_S = 5.0  # the same, for a child that never became ready
REAP_TIMEOUT_S = 5.0
_PR_SET_PDEATHSIG = 1


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on `host` now (bound, then released: someone else may take it first)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def reserve_port(port: int = 0, host: str = LOOPBACK) -> socket.socket:
    """A TCP port held for a server that will start, and maybe restart, on it (`port`, or a
    free one: the socket's getsockname()[1]; close the socket when done): a socket that never
    listens, bound while no other socket had the port (OSError otherwise), then marked
    SO_REUSEADDR. While it is open the kernel gives the port to no other bind (free_port's
    included) and no outgoing connection, so it is still free when its server comes back after
    a crash, yet a server binding it with SO_REUSEADDR (asyncio's and aiohttp's default, the
    router's, ZMQ's) listens on it; a second listener still cannot."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # after the bind: the port was ours alone
    except BaseException:
        s.close()
        raise
    return s


def port_in_use(port: int, host: str = LOOPBACK) -> bool:
    """Whether binding `host`:`port` fails now (someone listens there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is free
        try:
            s.bind((host, port))
        except OSError:
            return True
        return False


def listens_on(pid: int, port: int) -> bool:
    """Whether process `pid` itself holds a listening TCP socket on `port` (Linux: its
    /proc/PID/net/tcp{,6} rows in LISTEN state whose inode is one of its fds), so a caller
    can tell its own server from another process answering on the same port."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = pathlib.Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            return False
        for row in rows:
            f = row.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f[9])
    try:
        fds = list(pathlib.Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            return True
    return False


def proc_start_time(pid: int) -> int | None:
    """/proc start time (clock ticks) of a live, non-zombie process, None when it is gone or a
    zombie (dead, not yet reaped); with the pid it names one process even if pids are reused."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def http(method: str, url: str, body: bytes | dict | list | None = None, headers: dict | None = None,
         timeout: float = 60.0) -> tuple[int, bytes]:
    """(status, body) of one request; error statuses are returned, not raised.

    A dict or list body is sent as JSON, bytes as they are; either way with Content-Type
    application/json unless `headers` names one. No answer (refused, reset, timed out)
    raises OSError.
    """
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    headers = dict(headers or {})
    if data is not None and not any(k.lower() == "content-type" for k in headers):
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_until_ready(proc: subprocess.Popen, url: str, name: str, timeout_s: float, path: str = "/ready",
                     detail: str = "") -> None:
    """GET `url`+`path` until it answers 200.

    RuntimeError at once when `proc` exits, TimeoutError at the deadline (each probe is
    bounded by the time left); `detail` is appended to either message.
    """
    deadline = time.monotonic() + timeout_s
    suffix = f" ({detail})" if detail else ""
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode} before {path} answered 200{suffix}")
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{name} at {url} not ready ({path}) after {timeout_s:g} s{suffix}")
        try:
            if http("GET", url + path, timeout=min(PROBE_TIMEOUT_S, left))[0] == 200:
                return
        except (OSError, HTTPException):
            pass  # not listening yet
        time.sleep(max(0.0, min(PROBE_INTERVAL_S, deadline - time.monotonic())))


def set_parent_death_signal() -> None:
    """preexec_fn: the child gets SIGTERM when the thread that started it dies, even by SIGKILL.

    Linux ties PDEATHSIG to the thread that forked: start the child from a thread that lives
    as long as its owner (a Ray sync actor's methods run on the worker's main thread).
    """
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ServerProcess:
    """A child process running `argv` that serves HTTP at `url`.

    log: None leaves the child on this process's stdout and stderr; a path (os.devnull
    included) receives both, the file truncated first. die_with_parent: the child gets
    SIGTERM when its starter dies (Linux). wrapper: argv to run it under, e.g.
    `["ip", "netns", "exec", NS]` (launch/netns.py) for a test host; it must exec the command
    in place, so that the PID is the server's. Usable as a context manager that stops it.
    """

    ready_timeout_s = READY_TIMEOUT_S
    ready_path = "/ready"

    def __init__(self, argv: list[str], url: str, name: str | None = None, *,
                 log: str | os.PathLike | None = None, cwd: str | os.PathLike | None = None,
                 env: dict | None = None, die_with_parent: bool = False, wrapper: Iterable[str] = (),
                 held_port: socket.socket | None = None):
        """held_port: the reserve_port socket of the port the child will listen on, closed at stop."""
        self.name = name or pathlib.Path(str(argv[0])).name
        self.argv, self.url = [str(a) for a in [*wrapper, *argv]], url
        self.log_path = log
        self._held_port = held_port
        self._log = open(log, "wb") if log is not None else None
        try:
            self.proc = subprocess.Popen(self.argv, cwd=cwd, env=env, stdout=self._log,
                                         stderr=subprocess.STDOUT if self._log else None,
                                         preexec_fn=set_parent_death_signal if die_with_parent else None)
        except BaseException:
            self._close_log()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout_s: float | None = None, path: str | None = None) -> "ServerProcess":
        """Poll until `path` (default ready_path) answers 200; on failure the child is stopped."""
        where = f"its output: {self.log_path}" if self.log_path is not None else "its output went to ours"
        try:
            wait_until_ready(self.proc, self.url, self.name, self.ready_timeout_s if timeout_s is None else timeout_s,
                             path or self.ready_path, detail=f"{shlex.join(self.argv)}; {where}")
            port = getattr(self, "port", None)  # 200 from another server on our port is not ours
            if port is not None and not listens_on(self.proc.pid, port):
                raise RuntimeError(f"{self.name}: another process answers on port {port}, which it could not bind "
                                   f"({where})")
        except BaseException:
            self.stop(FAILED_START_GRACE_S)
            raise
        return self

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM, SIGKILL after `grace_s`, reap. Idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(REAP_TIMEOUT_S)
        self._close_log()

    def _close_log(self) -> None:
        """The log file and the held port (each closed once)."""
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._held_port is not None:
            self._held_port.close()
            self._held_port = None

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _server_url(host: str, port: int, url_host: str | None) -> str:
    return f"http://{url_host or host}:{port}"


def _server_port(host: str, port: int | None) -> tuple[int, socket.socket | None]:
    """`port`, or a free one held by reserve_port until the server stops (a number free_port returns can be bound
    by another process first, e.g. an engine's ZMQ socket on a random port), and its socket."""
    if port:
        return port, None
    held = reserve_port(0, host)
    return held.getsockname()[1], held


class EngineServer(ServerProcess):
    """`python -m atomd serve` on host:port (a free port unless given: _server_port); model None: the built-in one.

    url_host: the host in `url` when it differs from the listen address (e.g. 0.0.0.0).
    """

    def __init__(self, model: str | os.PathLike | None = None, *args: str, host: str = LOOPBACK,
                 port: int | None = None, url_host: str | None = None, name: str = "atomd serve", **kwargs):
        self.host, (self.port, held) = host, _server_port(host, port)
        argv = [sys.executable, "-m", "atomd", "serve", "--host", host, "--port", str(self.port),
                *(["--model", str(model)] if model is not None else []), *args]
        super().__init__(argv, _server_url(host, self.port, url_host), name, held_port=held, **kwargs)

    def engine_pids(self) -> list[int]:
        """The engine cores (one per DP rank): the server's live children but multiprocessing's
        resource tracker. A core that died and is not reaped yet (a zombie) is not one."""
        pid = self.proc.pid
        cores = []
        for child in pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            try:
                if proc_start_time(int(child)) is not None and \
                        b"resource_tracker" not in pathlib.Path(f"/proc/{child}/cmdline").read_bytes():
                    cores.append(int(child))
            except FileNotFoundError:
                pass  # exited meanwhile
        return cores

    def engine_pid(self) -> int:
        """The engine core of a server without data parallelism."""
        cores = self.engine_pids()
        if len(cores) != 1:
            raise RuntimeError(f"{self.name} has {len(cores)} engine cores, not one: {cores}")
        return cores[0]


class RouterServer(ServerProcess):
    """`python -m router` over the given prefill and decode URLs (more can join by POST /workers), on host:port (a
    free port unless given: _server_port)."""

    def __init__(self, prefill: Iterable[str] = (), decode: Iterable[str] = (), *args: str, host: str = LOOPBACK,
                 port: int | None = None, url_host: str | None = None, name: str = "router", **kwargs):
        self.host, (self.port, held) = host, _server_port(host, port)
        argv = [sys.executable, "-m", "router", "--host", host, "--port", str(self.port)]
        for url in prefill:
            argv += ["--prefill", url]
        for url in decode:
            argv += ["--decode", url]
        super().__init__([*argv, *args], _server_url(host, self.port, url_host), name, held_port=held, **kwargs)
