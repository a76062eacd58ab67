"""A private Docker daemon, a local Debian base image and the project's image, for
tests/test_image.py (`make image-check`) and benchmarks/image_offline.py.

No container registry is reachable here, so nothing is pulled:
- the daemon: Debian's `docker.io` (installed with apt when there is no dockerd), started with
  its own socket, data root, exec root and pid file, and with --iptables=false
  --ip-forward=false --bridge=none: its defaults rewrite the host's iptables FORWARD policy
  and add a bridge, which breaks the namespaced tests running beside it. Containers use the
  host's network. Stopped after; the data root (images, build cache) is kept under CACHE so
  a rerun reuses the base and the layers.
- the base: `debootstrap --variant=minbase bookworm` with python3 and its venv module,
  `docker import`ed (BASE_TAG), made once;
- the package index the image build installs from: torch's CPU wheel from this machine's
  pip (PyPI's torch for Linux is the CUDA build) and every other dependency, downloaded by
  pip here into a PEP 503 tree that `python -m http.server` serves on 127.0.0.1 to the
  build (`--network host`), so the build needs neither PyPI nor this machine's CA bundle.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tomllib

from launch.process import free_port, http

REPO = pathlib.Path(__file__).resolve().parent.parent
CACHE = pathlib.Path(os.environ.get("ATOMD_IMAGE_CACHE") or pathlib.Path.home() / ".cache" / "atomd-image-check")
BASE_TAG = "atomd-base:bookworm"
IMAGE_TAG = "atomd:check"
BUILD_TAG = "atomd-build:check"  # the Dockerfile's build stage
BASE_PACKAGES = ["python3", "python3-venv", "python-is-python3"]
TORCH = re.search(r"torch==[\w.]+", (REPO / "Makefile").read_text()).group(0)  # the venv's pin


def run(*argv: str, timeout: float = 600, check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def ensure_installed() -> None:
    """dockerd and debootstrap, from Debian's packages (apt-get update once); raises if not."""
    if shutil.which("dockerd") and shutil.which("debootstrap"):
        return
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run("apt-get", "update", "-qq", env=env)
    run("apt-get", "install", "-y", "-qq", "docker.io", "debootstrap", env=env)


def network_state() -> dict[str, object]:
    """What a Docker daemon changes on the host unless told not to: the FORWARD chain's
    policy, DOCKER chains and rules, docker0 / br-* bridges. Only those, as other sessions'
    namespaced tests may add and remove their own rules and veths meanwhile."""
    rules = run("iptables-save", check=False).stdout if shutil.which("iptables-save") else ""
    links = run("ip", "-o", "link", "show").stdout if shutil.which("ip") else ""
    return {"forward_policy": re.findall(r"^:FORWARD (\w+)", rules, flags=re.M),
            "docker_rules": [ln for ln in rules.splitlines() if "DOCKER" in ln.upper()],
            "bridges": sorted(re.findall(r"^\d+: ((?:docker\d*|br-\w+))[:@]", links, flags=re.M))}


class Daemon:
    """A dockerd of our own: `docker(...)` runs the CLI against its socket."""

    def __init__(self):
        CACHE.mkdir(parents=True, exist_ok=True)
        self._lock = open(CACHE / "lock", "w")
        fcntl.flock(self._lock, fcntl.LOCK_EX)  # one daemon per data root at a time
        self.tmp = pathlib.Path(tempfile.mkdtemp(prefix="atomd-dockerd-"))
        self.socket = self.tmp / "docker.sock"
        self.env = dict(os.environ, DOCKER_HOST=f"unix://{self.socket}", DOCKER_BUILDKIT="0",
                        DOCKER_CONFIG=str(self.tmp / "config"))
        self.log = open(self.tmp / "dockerd.log", "w")
        self.proc = subprocess.Popen(
            ["dockerd", "--iptables=false", "--ip-forward=false", "--bridge=none", "--ip-masq=false",
             "--data-root", str(CACHE / "data"), "--exec-root", str(self.tmp / "exec"),
             "--pidfile", str(self.tmp / "dockerd.pid"), "-H", f"unix://{self.socket}",
             "--containerd-namespace", "atomd-check", "--containerd-plugins-namespace", "atomd-check-plugins"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while self.docker("version", check=False).returncode != 0:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"dockerd did not start:\n{(self.tmp / 'dockerd.log').read_text()[-3000:]}")
            time.sleep(0.5)

    def docker(self, *args: str, timeout: float = 600, check: bool = True, **kw) -> subprocess.CompletedProcess:
        return run("docker", *args, timeout=timeout, check=check, env=self.env, **kw)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # dockerd stops its containers and containerd, then exits
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        for point in mounts_under(self.tmp):  # dockerd leaves exec/netns/default bind-mounted
            run("umount", "--lazy", point, check=False)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._lock.close()


def mounts_under(folder: pathlib.Path) -> list[str]:
    """Mount points at or below `folder`, deepest first (/proc/self/mountinfo's fifth field)."""
    root = str(folder.resolve())
    points = [line.split()[4] for line in pathlib.Path("/proc/self/mountinfo").read_text().splitlines()]
    return sorted((p for p in points if p == root or p.startswith(root + "/")), key=len, reverse=True)


def ensure_base(daemon: Daemon) -> None:
    """BASE_TAG: Debian bookworm minbase with python3 and venv, made once and kept."""
    if daemon.docker("image", "inspect", BASE_TAG, check=False).returncode == 0:
        return
    with tempfile.TemporaryDirectory(prefix="atomd-rootfs-") as rootfs:
        run("debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", "bookworm", rootfs,
            "http://deb.debian.org/debian", timeout=1200)
        shutil.rmtree(pathlib.Path(rootfs) / "var/cache/apt/archives", ignore_errors=True)
        pathlib.Path(rootfs, "var/cache/apt/archives/partial").mkdir(parents=True)
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        run("docker", "import", "--change", "CMD [\"/bin/bash\"]", "-", BASE_TAG, stdin=tar.stdout,
            env=daemon.env, timeout=600)
        tar.wait(60)


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def package_index() -> pathlib.Path:
    """CACHE/index/simple/<project>/<files>: torch, the package's dependencies, the build's
    setuptools and pip, for the Python of the base image (Debian bookworm's 3.11)."""
    root = CACHE / "index"
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    want = [TORCH, *deps, tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"][0],
            "pip", "wheel"]
    stamp = root / "requirements.txt"
    if stamp.is_file() and stamp.read_text() == "\n".join(want):
        return root / "simple"
    files = root / "files"
    files.mkdir(parents=True, exist_ok=True)
    # this machine's pip and Python (3.11, as bookworm's): what it installs, the image installs
    run(sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(files), *want, timeout=1200)
    for f in files.iterdir():
        project = root / "simple" / _normalize(f.name.split("-")[0])
        project.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.link(f, project / f.name)
    stamp.write_text("\n".join(want))
    return root / "simple"


INDEX_PORT = 38611  # the index's usual port: its URL is a build argument, part of the layer cache's key


def _port() -> int:
    with contextlib.closing(socket.socket()) as s:
        try:
            s.bind(("127.0.0.1", INDEX_PORT))
            return INDEX_PORT
        except OSError:  # taken: a free one (this build then misses the cache)
            return free_port()


@contextlib.contextmanager
def served(directory: pathlib.Path):
    """`directory` over HTTP on 127.0.0.1: yields its URL."""
    port = _port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
                            cwd=directory, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/"
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError):
                if http("GET", url, timeout=2)[0] == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the package index did not start")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def build_image(daemon: Daemon) -> float:
    """IMAGE_TAG from the repository's Dockerfile on the local base and index; seconds taken."""
    ensure_base(daemon)
    index = package_index()
    with served(index) as url:
        start = time.monotonic()
        args = ["--network", "host", "--build-arg", f"BASE_IMAGE={BASE_TAG}", "--build-arg", f"TORCH_INDEX={url}",
                "--build-arg", f"PIP_INDEX_URL={url}", str(REPO)]
        # the build stage tagged too: its layers (torch) are then no dangling image for the prune below
        daemon.docker("build", "--target", "build", "-t", BUILD_TAG, *args, timeout=1800)
        daemon.docker("build", "-t", IMAGE_TAG, *args, timeout=1800)
        seconds = time.monotonic() - start
    # earlier builds' images (untagged now, ~1 GB each) go; the layers these two use stay cached
    daemon.docker("image", "prune", "-f")
    return seconds
