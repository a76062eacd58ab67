"""The engines' ZMQ sockets listen only where configured (issue #18): the KV side channel
binds the --kv-side-channel-host it advertises (a wildcard is refused: tests/test_kv_bind.py),
the KV events PUB and replay sockets the endpoints given. Read from the kernel's own table
of listening sockets (/proc/net/tcp), not from what the code reports."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

from atomd.engine.kv_events import KVEventPublisher
from kv_transfer.params import compat_fingerprint
from kv_transfer.zmq_sender import KVSender

pytestmark = pytest.mark.unit

LISTEN = "0A"


def listening(port: int) -> set[str]:
    """The local addresses (dotted IPv4, or IPv6 hex) with a socket listening on TCP `port`."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = pathlib.Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state = fields[1], fields[3]
            addr, _, hex_port = local.partition(":")
            if state != LISTEN or int(hex_port, 16) != port:
                continue
            if len(addr) == 8:  # IPv4, little-endian
                out.add(".".join(str(b) for b in reversed(bytes.fromhex(addr))))
            else:
                out.add(addr)
    return out


def test_the_kv_side_channel_listens_on_its_host_only():
    compat = compat_fingerprint("m", "float32", 16, 1, 1, 8, "v")
    sender = KVSender(np.zeros((2, 1024), dtype=np.uint8), compat, host="127.0.0.1")
    try:
        host, port = sender.address
        assert host == "127.0.0.1"
        assert listening(port) == {"127.0.0.1"}  # not 0.0.0.0, not ::
    finally:
        sender.close()


def test_the_kv_events_sockets_listen_on_the_configured_host_only():
    pub = KVEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    try:
        for endpoint in (pub.endpoint, pub.replay_endpoint):
            port = int(endpoint.rsplit(":", 1)[1])
            assert listening(port) == {"127.0.0.1"}, endpoint
    finally:
        pub.close()
