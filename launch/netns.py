"""Test hosts made of Linux network namespaces: N hosts on one bridge, links optionally shaped.

    with NetnsCluster(3, root_link=True) as net:               # hosts a, b, c
        a, b, c = net.hosts                                    # a.ip == "10.213.S.1", ...
        proc = net.popen(a, [sys.executable, "-m", "atomd", "serve", "--host", a.ip, ...])
        net.shape(a, Shaping(delay_ms=2, jitter_ms=1, rate_bps=1e9))
        net.cut(a); net.restore(a)                             # unplug / replug a's cable
    # every process in the namespaces is gone, and every namespace and link

Layout (root only: `ip netns`, veth, bridge, tun/tap, `tc` from iproute2). Namespace
`atomdnet-TAG-sw` holds the bridge `br0` (the switch); each host `atomdnet-TAG-a`, `-b`, ...
has one interface `eth0` with 10.213.S.i/24 (i = 1, 2, ...) plugged into it, and no other
route: a host reaches the other hosts of its cluster and nothing else. With `root_link`,
the root namespace gets one veth onto the bridge (`atnTAG`, 10.213.S.254/24), so a test or
a user in the root namespace reaches the hosts; the root namespace gains exactly one
route, the cluster's /24, on that veth. S is picked per cluster, unused by the root
namespace and by every other cluster on the machine.

Shaping (`Shaping`: delay, uniform jitter, rate, queue limit) applies to a host's egress,
as `tc qdisc add dev eth0 root netem delay 2ms 1ms rate 1gbit` inside the host would: a
packet from a to b is delayed by a's shaping (one way: 2 ms +- 1 ms) and paced at a's
rate, b's answer by b's. Two shapers do it:

- `netem`: the kernel's netem qdisc on the host's veth, where the kernel has it
  (CONFIG_NET_SCH_NETEM).
- `wire`: where it does not (netem is often left out of VM and container kernels), each
  host's `eth0` is a TAP device and `python -m launch.link_emulator` (one process per
  cluster) moves the frames between it and a TAP on the bridge, applying netem's model:
  due = max(arrival + delay +- jitter, previous due) + size / rate, frames kept in order,
  tail drop past `limit` queued frames. Links default to MTU 9000 so that it moves few
  frames; it paces to well above 1 Gbit/s on one core.

`shaper="auto"` takes netem where the kernel has it. A cluster made without shaping and
with `shapeable=False` uses plain veth pairs (no userspace hop at all).

Cleanup. The cluster's state (names, subnet, owner PID, the wire's PID) is written to
/run/atomd-netns/TAG.json before anything is created; `teardown()` (also on failure, and
from the context manager) SIGTERMs, then SIGKILLs, by PID, every process inside the
cluster's namespaces, stops the wire, deletes the namespaces (their veths and TAPs go with
them) and the root veth, then the state file. `clean_stale()` tears down the clusters of
owners that died without doing so (a killed pytest); `launch/netns_cluster.sh clean` runs
it. Nothing outside names with the `atomdnet-` / `atn` prefixes is ever touched.

Standard library only (the CLI runs on the system python: launch/netns_cluster.sh).
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import ipaddress
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from launch.process import proc_start_time, set_parent_death_signal
from launch.shaping import Shaping

STATE_DIR = Path(os.environ.get("ATOMD_NETNS_STATE_DIR", "/run/atomd-netns"))
NS_PREFIX = "atomdnet-"
ROOT_IF_PREFIX = "atn"
SUBNET_PREFIX = os.environ.get("ATOMD_NETNS_SUBNET_PREFIX", "10.213")  # clusters use PREFIX.S.0/24
HOST_IF = "eth0"
BRIDGE = "br0"
ROOT_HOST = 254  # the root namespace's address in a cluster's /24
DEFAULT_MTU = 9000
LABELS = "abcdefghijklmnopqrstuvwxyz"
STOP_GRACE_S = 5.0
WIRE_READY_TIMEOUT_S = 20.0
_TAG_RE = re.compile(r"^[a-z0-9]{1,11}$")

# tun/tap and setns


# ------------------------------------------------------------------------------- helpers

def _run(argv: list[str], check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check=check)


def _alive(pid: int | None, start: int | None) -> bool:
    return pid is not None and proc_start_time(pid) is not None and (start is None or proc_start_time(pid) == start)


def unavailable_reason() -> str | None:
    """Why test hosts cannot be made here (None: they can): root, iproute2, /dev/net/tun."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    try:
        ip("netns", "list")
    except (RuntimeError, OSError) as e:
        return f"`ip netns` does not work here: {e}"
    return None


def netns_pids(ns: str) -> list[int]:
    """PIDs of the processes inside namespace `ns` (zombies are not listed)."""
    result = ip("netns", "pids", ns, check=False)
    return [int(p) for p in result.stdout.split()] if result.returncode == 0 else []


def existing_namespaces() -> list[str]:
    result = ip("netns", "list", check=False)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


_netem_cache: bool | None = None


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (tried in a throwaway namespace)."""
    global _netem_cache
    if _netem_cache is None:
        ns = f"{NS_PREFIX}probe{os.getpid():x}"
        ip("netns", "add", ns)
        try:
            ip("-n", ns, "link", "set", "lo", "up")
            _netem_cache = _run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                                check=False).returncode == 0
        finally:
            ip("netns", "del", ns, check=False)
    return _netem_cache


# ------------------------------------------------------------------------------- the cluster

@dataclasses.dataclass
class Host:
    label: str      # "a", "b", ...
    index: int      # 1-based: the last byte of `ip`
    ns: str         # the namespace's name (`ip netns exec NS ...`)
    ip: str
    switch_if: str  # its port on the bridge, in the switch namespace

    def __str__(self) -> str:
        return f"host {self.label} ({self.ip})"


class NetnsCluster:
    """N test hosts on one bridge. See the module docstring; use as a context manager."""

    def __init__(self, num_hosts: int, *, shaping: Shaping | dict[str, Shaping | None] | None = None,
                 shapeable: bool | None = None, root_link: bool = False, mtu: int = DEFAULT_MTU,
                 shaper: str = "auto", tag: str | None = None, persistent: bool = False):
        if not 1 <= num_hosts <= len(LABELS):
            raise ValueError(f"num_hosts must be in 1..{len(LABELS)}, got {num_hosts}")
        if shaper not in ("auto", "netem", "wire"):
            raise ValueError(f"shaper must be auto, netem or wire, got {shaper!r}")
        self.tag = tag or f"t{os.getpid():x}{next(_counter)}"
        if not _TAG_RE.match(self.tag):
            raise ValueError(f"cluster name must be 1-11 characters of [a-z0-9], got {self.tag!r}")
        self.num_hosts, self.root_link, self.mtu, self.persistent = num_hosts, root_link, mtu, persistent
        labels = LABELS[:num_hosts]
        if not isinstance(shaping, dict):
            shaping = {label: shaping for label in labels}
        unknown = set(shaping) - set(labels)
        if unknown:
            raise ValueError(f"shaping names unknown hosts: {sorted(unknown)}")
        self._initial_shaping = {label: shaping.get(label) for label in labels}
        self.shapeable = any(s is not None for s in shaping.values()) if shapeable is None else shapeable
        self.requested_shaper = shaper
        self.shaper: str | None = None  # "netem", "wire" or "veth" (unshaped) once started
        self.hosts: list[Host] = []
        self.switch_ns = f"{NS_PREFIX}{self.tag}-sw"
        self.root_if = f"{ROOT_IF_PREFIX}{self.tag}" if root_link else None
        self.root_ip: str | None = None
        self.subnet: str | None = None
        self.shaping: dict[str, Shaping | None] = {}
        self._procs: list[subprocess.Popen] = []
        self._wire: subprocess.Popen | None = None
        self._generation = 0
        self._started = False

    # ---- lifecycle

    def __enter__(self) -> "NetnsCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.teardown()

    @property
    def state_path(self) -> Path:
        return STATE_DIR / f"{self.tag}.json"

    @property
    def spec_path(self) -> Path:
        return STATE_DIR / f"{self.tag}.wire.json"

    def start(self) -> "NetnsCluster":
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(f"cannot make test hosts: {reason}")
        clean_stale()
        if self.shapeable:
            netem = netem_available()
            if self.requested_shaper == "netem" and not netem:
                raise RuntimeError("shaper netem: this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM); "
                                   "use shaper wire (or auto)")
            self.shaper = "netem" if (netem and self.requested_shaper != "wire") else "wire"
        else:
            self.shaper = "veth"
        with _state_lock():
            if self.state_path.exists() or any(n.startswith(f"{NS_PREFIX}{self.tag}-") for n in existing_namespaces()):
                raise RuntimeError(f"a cluster named {self.tag!r} exists already (`launch/netns_cluster.sh down "
                                   f"{self.tag}`)")
            self.subnet = _free_subnet()
            base = self.subnet.rsplit(".", 1)[0]  # "10.213.S"
            self.hosts = [Host(label, i + 1, f"{NS_PREFIX}{self.tag}-{label}", f"{base}.{i + 1}", f"p{label}")
                          for i, label in enumerate(LABELS[:self.num_hosts])]
            self.root_ip = f"{base}.{ROOT_HOST}" if self.root_link else None
            self._started = True
            self._write_state()
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def _build(self) -> None:
        for ns in [self.switch_ns, *(h.ns for h in self.hosts)]:
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
            # IPv4 only: no IPv6 autoconfiguration chatter on the test links
            self._sysctl(ns, "net.ipv6.conf.all.disable_ipv6", "1")
            self._sysctl(ns, "net.ipv6.conf.default.disable_ipv6", "1")
        sw = ["-n", self.switch_ns]
        ip(*sw, "link", "add", BRIDGE, "type", "bridge")
        ip(*sw, "link", "set", BRIDGE, "mtu", str(self.mtu), "up")
        if self.shaper == "wire":
            self._start_wire()
        else:
            for h in self.hosts:
                ip(*sw, "link", "add", h.switch_if, "type", "veth", "peer", "name", HOST_IF, "netns", h.ns)
        for h in self.hosts:
            ip(*sw, "link", "set", h.switch_if, "mtu", str(self.mtu), "master", BRIDGE, "up")
            ip("-n", h.ns, "link", "set", HOST_IF, "mtu", str(self.mtu), "up")
            ip("-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", HOST_IF)
            self.shaping[h.label] = None
        if self.root_link:
            ip(*sw, "link", "add", "root", "type", "veth", "peer", "name", self.root_if, "netns", str(os.getpid()))
            ip(*sw, "link", "set", "root", "mtu", str(self.mtu), "master", BRIDGE, "up")
            _sysctl_root(f"net.ipv6.conf.{self.root_if}.disable_ipv6", "1")
            ip("link", "set", self.root_if, "mtu", str(self.mtu), "up")
            ip("addr", "add", f"{self.root_ip}/24", "dev", self.root_if)
        for label, s in self._initial_shaping.items():
            if s is not None:
                self.shape(self.host(label), s)

    @staticmethod
    def _sysctl(ns: str, key: str, value: str) -> None:
        path = "/proc/sys/" + key.replace(".", "/")
        _run(["ip", "netns", "exec", ns, "sh", "-c", f"echo {value} > {path}"], check=False)

    def _start_wire(self) -> None:
        self._write_spec()
        cmd = [sys.executable, "-m", "launch.link_emulator", str(self.spec_path)]
        root = Path(__file__).resolve().parents[1]
        log = open(STATE_DIR / f"{self.tag}.wire.log", "ab")
        try:
            if self.persistent:  # outlives this process: `down` stops it by its PID
                self._wire = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=log,
                                              stdin=subprocess.DEVNULL, start_new_session=True)
            else:
                self._wire = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=log,
                                              stdin=subprocess.DEVNULL, preexec_fn=set_parent_death_signal)
        finally:
            log.close()
        self._write_state()
        ready, _, _ = select.select([self._wire.stdout], [], [], WIRE_READY_TIMEOUT_S)
        line = self._wire.stdout.readline() if ready else b""
        self._wire.stdout.close()
        if line.strip() != b"ready":
            raise RuntimeError(f"the link emulator did not start (see {STATE_DIR / (self.tag + '.wire.log')})")

    def _write_spec(self) -> None:
        spec = {"generation": self._generation, "status": str(STATE_DIR / f"{self.tag}.wire.status"),
                "links": [{"label": h.label, "host_ns": h.ns, "switch_ns": self.switch_ns, "host_if": HOST_IF,
                           "switch_if": h.switch_if, "mtu": self.mtu,
                           "shaping": s.to_json() if (s := self.shaping.get(h.label)) else None}
                          for h in self.hosts]}
        tmp = self.spec_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(spec))
        tmp.replace(self.spec_path)

    def _write_state(self) -> None:
        owner = None if self.persistent else os.getpid()
        state = {"tag": self.tag, "subnet": self.subnet, "owner_pid": owner,
                 "owner_start": proc_start_time(owner) if owner else None, "shaper": self.shaper, "mtu": self.mtu,
                 "switch_ns": self.switch_ns, "root_if": self.root_if, "root_ip": self.root_ip,
                 "hosts": [dataclasses.asdict(h) for h in self.hosts],
                 "shaping": {k: (v.to_json() if v else None) for k, v in self.shaping.items()},
                 "wire_pid": self._wire.pid if self._wire else None,
                 "wire_start": proc_start_time(self._wire.pid) if self._wire else None}
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.state_path)

    def teardown(self) -> None:
        """Stop every process in the cluster (ours gracefully first), delete everything. Idempotent."""
        if not self._started:
            return
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        teardown_state(json.loads(self.state_path.read_text()) if self.state_path.exists() else self._fallback_state())
        for proc in [*self._procs, *([self._wire] if self._wire else [])]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)  # reap
        self._started = False

    def _fallback_state(self) -> dict:
        return {"tag": self.tag, "switch_ns": self.switch_ns, "root_if": self.root_if,
                "hosts": [dataclasses.asdict(h) for h in self.hosts],
                "wire_pid": self._wire.pid if self._wire else None, "wire_start": None}

    # ---- using it

    def host(self, label: str | Host) -> Host:
        if isinstance(label, Host):
            return label
        for h in self.hosts:
            if h.label == label:
                return h
        raise KeyError(f"no host {label!r} in cluster {self.tag} (hosts: {', '.join(h.label for h in self.hosts)})")

    def exec_prefix(self, host: str | Host) -> list[str]:
        """Prepend to an argv to run it inside `host`."""
        return ["ip", "netns", "exec", self.host(host).ns]

    # A test cluster's link emulator gets SIGTERM when the thread that started the cluster
    # exits (PR_SET_PDEATHSIG is per thread): start clusters from a thread that outlives them.

    def popen(self, host: str | Host, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start `argv` inside `host`; teardown() stops it (SIGTERM, then SIGKILL) if still running."""
        proc = subprocess.Popen([*self.exec_prefix(host), *map(str, argv)], **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, host: str | Host, argv: list[str], timeout: float = 60.0, **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run([*self.exec_prefix(host), *map(str, argv)], timeout=timeout, **kwargs)

    def shape(self, host: str | Host, shaping: Shaping | None) -> None:
        """Set (None: clear) the shaping of `host`'s egress, now."""
        h = self.host(host)
        if self.shaper == "veth":
            raise RuntimeError("this cluster was made without shaping: pass shaping= or shapeable=True")
        self.shaping[h.label] = shaping
        if self.shaper == "netem":
            if shaping is None or shaping.noop:
                _run(["tc", "-n", h.ns, "qdisc", "del", "dev", HOST_IF, "root"], check=False)
            else:
                _run(["tc", "-n", h.ns, "qdisc", "replace", "dev", HOST_IF, "root", *shaping.netem_args()])
        else:
            self._generation += 1
            self._write_spec()
            os.kill(self._wire.pid, signal.SIGHUP)
            status = STATE_DIR / f"{self.tag}.wire.status"
            deadline = time.monotonic() + 10
            while True:
                with contextlib.suppress(OSError, ValueError, IndexError):  # not written yet
                    if int(status.read_text().split()[0]) >= self._generation:
                        break
                if self._wire.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the link emulator did not take the new shaping")
                time.sleep(0.01)
        self._write_state()

    def cut(self, host: str | Host) -> None:
        """Unplug `host` from the switch: its packets and those sent to it vanish (no RST, no ICMP)."""
        ip("-n", self.switch_ns, "link", "set", self.host(host).switch_if, "down")

    def restore(self, host: str | Host) -> None:
        ip("-n", self.switch_ns, "link", "set", self.host(host).switch_if, "up")

    def link_bytes(self, host: str | Host) -> tuple[int, int]:
        """(tx, rx) bytes of `host`'s eth0, as the host counts them."""
        h = self.host(host)
        data = json.loads(ip("-n", h.ns, "-s", "-j", "link", "show", HOST_IF).stdout)[0]["stats64"]
        return data["tx"]["bytes"], data["rx"]["bytes"]

    def pids(self) -> list[int]:
        """Every process inside the cluster's namespaces now."""
        return [p for ns in [self.switch_ns, *(h.ns for h in self.hosts)] for p in netns_pids(ns)]

    def namespaces(self) -> list[str]:
        return [n for n in existing_namespaces() if n.startswith(f"{NS_PREFIX}{self.tag}-")]

    def describe(self) -> str:
        lines = [f"cluster {self.tag}: {self.subnet}, shaper {self.shaper}, MTU {self.mtu}"]
        for h in self.hosts:
            s = self.shaping.get(h.label)
            lines.append(f"  {h.label}  {h.ip:<15} netns {h.ns}  egress shaping: {s.describe() if s else 'none'}")
        if self.root_link:
            lines.append(f"  root namespace: {self.root_ip} on {self.root_if}")
        return "\n".join(lines)


_counter = iter(range(10**9))


def _sysctl_root(key: str, value: str) -> None:
    with contextlib.suppress(OSError):
        Path("/proc/sys/" + key.replace(".", "/")).write_text(value)


@contextlib.contextmanager
def _state_lock():
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cluster_states() -> list[dict]:
    out = []
    for path in sorted(STATE_DIR.glob("*.json")):
        if path.name.endswith(".wire.json"):
            continue
        with contextlib.suppress(OSError, ValueError):
            out.append(json.loads(path.read_text()))
    return out


def _free_subnet() -> str:
    """A PREFIX.S.0/24 no other cluster holds and that the root namespace neither routes nor addresses."""
    taken = {s.get("subnet") for s in cluster_states()}
    used = []
    for route in json.loads(ip("-4", "-j", "route", "show", "table", "all", check=False).stdout or "[]"):
        if route.get("dst", "default") != "default":
            with contextlib.suppress(ValueError):
                used.append(ipaddress.ip_network(route["dst"], strict=False))
    for link in json.loads(ip("-4", "-j", "addr", "show", check=False).stdout or "[]"):
        for a in link.get("addr_info", []):
            used.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))
    for s in range(1, 255):
        net = ipaddress.ip_network(f"{SUBNET_PREFIX}.{s}.0/24")
        if str(net) not in taken and not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return str(net)
    raise RuntimeError(f"no free /24 left in {SUBNET_PREFIX}.0.0/16")


def _kill_all(pids: list[int], grace_s: float) -> list[int]:
    """SIGTERM `pids`, SIGKILL what is left after grace_s; returns what still runs after that."""
    starts = {p: proc_start_time(p) for p in pids}
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p, s) for p, s in starts.items()):
        time.sleep(0.05)
    for p, s in starts.items():
        if _alive(p, s):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p, s) for p, s in starts.items()):
        time.sleep(0.05)
    return [p for p, s in starts.items() if _alive(p, s)]


def teardown_state(state: dict, grace_s: float = STOP_GRACE_S) -> list[str]:
    """Remove one cluster from its state: processes (by PID), the wire, namespaces, root veth, files.
    Returns what could not be removed (empty when all went)."""
    tag = state["tag"]
    namespaces = [state["switch_ns"], *(h["ns"] for h in state.get("hosts", []))]
    namespaces += [n for n in existing_namespaces() if n.startswith(f"{NS_PREFIX}{tag}-") and n not in namespaces]
    left = []
    # Everything inside, more than once: a dying process may still spawn (Ray restarts its workers).
    for _ in range(3):
        pids = [p for ns in namespaces for p in netns_pids(ns)]
        if not pids:
            break
        left = _kill_all(pids, grace_s)
        grace_s = 1.0
    if state.get("wire_pid") and _alive(state["wire_pid"], state.get("wire_start")):
        _kill_all([state["wire_pid"]], 2.0)
    problems = [f"process {p} still runs" for p in left]
    for ns in namespaces:
        if ns in existing_namespaces():
            r = ip("netns", "del", ns, check=False)
            if r.returncode != 0:
                problems.append(f"netns {ns}: {r.stderr.strip()}")
    root_if = state.get("root_if")
    if root_if and Path(f"/sys/class/net/{root_if}").exists():
        ip("link", "del", root_if, check=False)
    for suffix in (".json", ".wire.json", ".wire.status", ".wire.status.tmp", ".wire.log", ".tmp", ".wire.tmp"):
        with contextlib.suppress(OSError):
            (STATE_DIR / f"{tag}{suffix}").unlink()
    return problems


def clean_stale() -> list[str]:
    """Tear down clusters whose owner process is gone (a crashed test run), and namespaces with
    our prefix that no state file accounts for. Returns the tags removed."""
    if not STATE_DIR.exists() and not any(n.startswith(NS_PREFIX) for n in existing_namespaces()):
        return []
    removed = []
    with _state_lock():
        states = cluster_states()
        for state in states:
            if state.get("owner_pid") is not None and not _alive(state["owner_pid"], state.get("owner_start")):
                teardown_state(state, grace_s=1.0)
                removed.append(state["tag"])
        known = {s["tag"] for s in states}
        for ns in existing_namespaces():
            m = re.fullmatch(rf"{re.escape(NS_PREFIX)}([a-z0-9]+)-[a-z]+", ns)
            if m and m.group(1) not in known:
                teardown_state({"tag": m.group(1), "switch_ns": f"{NS_PREFIX}{m.group(1)}-sw",
                                "root_if": f"{ROOT_IF_PREFIX}{m.group(1)}"}, grace_s=1.0)
                removed.append(m.group(1))
        # a probe namespace left by a killed netem_available()
        for ns in existing_namespaces():
            m = re.fullmatch(rf"{re.escape(NS_PREFIX)}probe([0-9a-f]+)", ns)
            if m and proc_start_time(int(m.group(1), 16)) is None:
                ip("netns", "del", ns, check=False)
    return sorted(set(removed))


def load_cluster(tag: str) -> NetnsCluster:
    """A handle on a running cluster (made by `up`), from its state file."""
    path = STATE_DIR / f"{tag}.json"
    if not path.exists():
        raise RuntimeError(f"no cluster named {tag!r} (`launch/netns_cluster.sh status` lists them)")
    state = json.loads(path.read_text())
    c = NetnsCluster(len(state["hosts"]), tag=tag, root_link=bool(state["root_if"]), mtu=state["mtu"],
                     persistent=state["owner_pid"] is None)
    c.shaper, c.subnet, c.root_ip = state["shaper"], state["subnet"], state["root_ip"]
    c.hosts = [Host(**h) for h in state["hosts"]]
    c.shaping = {k: Shaping.from_json(v) for k, v in state["shaping"].items()}
    c._started = True
    if state.get("wire_pid"):
        c._wire = _Detached(state["wire_pid"], state.get("wire_start"))
        with contextlib.suppress(OSError, ValueError):
            c._generation = json.loads(c.spec_path.read_text())["generation"]
    return c


class _Detached:
    """Enough of Popen for a wire started by another `launch/netns_cluster.sh` invocation."""

    def __init__(self, pid: int, start: int | None):
        self.pid, self._start = pid, start

    def poll(self):
        return None if _alive(self.pid, self._start) else 0

    def wait(self, timeout=None):
        return self.poll()
