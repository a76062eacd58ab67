"""The link emulator of launch/netns.py's test clusters where the kernel has no netem
(`python -m launch.link_emulator SPEC`, one process per cluster): each host's `eth0` is a TAP
device, and this process moves the frames between it and a TAP on the bridge, applying
netem's model: due = max(arrival + delay +- jitter, previous due) + size / rate, frames kept
in order, tail drop past `limit` queued frames. Also the namespace system calls the cluster
uses. Standard library only."""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import os
import random
import select
import signal
import struct
import sys
import time
from collections import deque
from pathlib import Path

from launch.shaping import Shaping

_TUNSETIFF = 0x400454CA
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000
_CLONE_NEWNET = 0x40000000


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _setns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc().setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


class _Direction:
    """Frames from one TAP to another, shaped like netem (or passed straight through)."""

    def __init__(self, src: int, dst: int):
        self.src, self.dst = src, dst
        self.queue: deque[tuple[float, bytes]] = deque()
        self.shaping: Shaping | None = None
        self.last_due = 0.0
        self.sent = self.dropped = 0

    def push(self, frame: bytes, now: float) -> None:
        s = self.shaping
        if s is None or s.noop:
            if not self.queue:
                self.write(frame)
                return
            due = now  # behind frames queued under the previous shaping: keep the order
        else:
            if len(self.queue) >= s.limit:
                self.dropped += 1
                return
            delay = s.delay_ms + (random.uniform(-s.jitter_ms, s.jitter_ms) if s.jitter_ms else 0.0)
            due = now + delay / 1e3
            if s.rate_bps:
                due = max(due, self.last_due) + len(frame) * 8 / s.rate_bps
        due = max(due, self.last_due)
        self.last_due = due
        self.queue.append((due, frame))

    def flush(self, now: float) -> float | None:
        """Write every due frame; the next due time, if any."""
        q = self.queue
        while q and q[0][0] <= now:
            self.write(q.popleft()[1])
        return q[0][0] if q else None

    def write(self, frame: bytes) -> None:
        try:
            os.write(self.dst, frame)
            self.sent += 1
        except OSError:  # the other end is down (a cut link) or its queue is full: the frame is lost
            self.dropped += 1


def _open_tap(ns: str, name: str) -> int:
    """A TAP named `name` created inside namespace `ns`, its fd non-blocking (it vanishes with the fd)."""
    _setns(f"/run/netns/{ns}")
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI))
    return fd


def run_wire(spec_path: str) -> int:
    """The link emulator: one process, one thread, every TAP pair of a cluster."""
    spec = json.loads(Path(spec_path).read_text())
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    by_src: dict[int, _Direction] = {}
    egress: dict[str, _Direction] = {}
    for link in spec["links"]:
        host_fd = _open_tap(link["host_ns"], link["host_if"])
        switch_fd = _open_tap(link["switch_ns"], link["switch_if"])
        out, back = _Direction(host_fd, switch_fd), _Direction(switch_fd, host_fd)
        by_src[host_fd], by_src[switch_fd] = out, back
        egress[link["label"]] = out
    if _libc().setns(home, _CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns back home")
    os.close(home)

    def apply(spec: dict) -> None:
        for link in spec["links"]:
            egress[link["label"]].shaping = Shaping.from_json(link["shaping"])
        tmp = Path(spec["status"] + ".tmp")
        tmp.write_text(f"{spec['generation']}\n")
        tmp.replace(spec["status"])

    apply(spec)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    reload = []
    signal.signal(signal.SIGHUP, lambda *_: reload.append(1))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the starter stopped reading
    fds = [*by_src, wake_r]
    directions = list(by_src.values())
    while True:
        now = time.monotonic()
        next_due = None
        for d in directions:
            due = d.flush(now)
            if due is not None and (next_due is None or due < next_due):
                next_due = due
        timeout = 1.0 if next_due is None else max(0.0, next_due - time.monotonic())
        ready, _, _ = select.select(fds, [], [], timeout)
        now = time.monotonic()
        for fd in ready:
            if fd == wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 512)
                if reload:
                    reload.clear()
                    with contextlib.suppress(OSError, ValueError):
                        apply(json.loads(Path(spec_path).read_text()))
                continue
            d = by_src[fd]
            for _ in range(256):
                try:
                    frame = os.read(fd, 65536)
                except BlockingIOError:
                    break
                except OSError:  # the interface is down
                    break
                d.push(frame, now)


if __name__ == "__main__":
    sys.exit(run_wire(sys.argv[1]))
