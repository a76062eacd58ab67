"""The ceiling a KV transfer is measured against, and the machine notes its reports carry:
a raw ZMQ stream of the same frames (benchmarks/kv_transfer.py on one host,
benchmarks/cross_host.py between test hosts)."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import threading
import time

import numpy as np
import zmq

from kv_transfer import mooncake_transport as mooncake
from kv_transfer.side_channel import plan_messages


def raw_zmq_server(sock: zmq.Socket, kv: np.ndarray, blocks_per_message: int, stop: threading.Event) -> None:
    """Answer each request b"<n>" with the first n blocks, framed like KVSender does."""
    while not stop.is_set():
        if not sock.poll(50):
            continue
        rid, req = sock.recv_multipart()
        ids = np.arange(int(req), dtype=np.int64)
        for _, frames in plan_messages(ids, blocks_per_message):
            sock.send(rid, zmq.SNDMORE)
            sock.send(b"DATA", zmq.SNDMORE)
            for i, (first, n) in enumerate(frames):
                more = zmq.SNDMORE if i + 1 < len(frames) else 0
                sock.send(memoryview(kv[first : first + n]).cast("B"), more, copy=False)


def time_raw(dealer: zmq.Socket, num_blocks: int, block_bytes: int, into: np.ndarray | None = None) -> float:
    """Request num_blocks and receive them; with `into`, also copy each frame into place."""
    flat = into.reshape(-1) if into is not None else None
    t0 = time.perf_counter()
    dealer.send(str(num_blocks).encode())
    got = 0
    while got < num_blocks * block_bytes:
        for frame in dealer.recv_multipart(copy=False)[1:]:
            if flat is not None:
                flat[got : got + len(frame)] = np.frombuffer(frame.buffer, dtype=np.uint8)
            got += len(frame)
    return time.perf_counter() - t0


def machine_notes() -> str:
    flags = ""
    try:
        flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        pass
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    model = next((line.split(":", 1)[1].strip() for line in flags.splitlines() if line.startswith("Model name")), "?")
    try:
        mc = importlib.metadata.version(mooncake.PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        mc = "?"
    return (f"nproc={os.cpu_count()}, CPU: {model}, SIMD: {', '.join(simd) or 'none of avx2/avx512'}, Python "
            f"{platform.python_version()}, pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()}), "
            f"{mooncake.PACKAGE} {mc}")
