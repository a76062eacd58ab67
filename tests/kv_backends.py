"""The KV transfer backends the transport and PD suites run over, and their endpoints.

"zmq" always runs. "mooncake" needs the optional extra (`pip install 'atomd[mooncake]'`,
which `make test` installs with the Debian libraries it loads with); where it cannot load,
its cases fail with the reason, which names the command.
"""
from __future__ import annotations

import functools

import pytest

from kv_transfer.mooncake_transport import MooncakeReceiver, MooncakeSender, MooncakeUnavailable, load_transfer_engine
from kv_transfer.zmq_receiver import KVReceiver
from kv_transfer.zmq_sender import KVSender

BACKENDS = ("zmq", "mooncake")
ZMQ_ONLY_OPTIONS = ("max_message_bytes", "copy_below_bytes")  # how ZMQ frames DATA; Mooncake has no DATA


@functools.cache
def mooncake_unavailable() -> str | None:
    """Why Mooncake cannot run here (the message names the fix), or None."""
    try:
        load_transfer_engine()
    except MooncakeUnavailable as e:
        return str(e)
    return None


def require_backend(backend: str) -> None:
    """`make test` installs Mooncake, so a Mooncake that cannot load is a failure (naming
    the fix), never a silent skip."""
    if backend == "mooncake" and mooncake_unavailable():
        pytest.fail(mooncake_unavailable())


def make_sender(backend: str, kv, compat, *args, **kwargs) -> KVSender:
    if backend == "mooncake":
        for name in ZMQ_ONLY_OPTIONS:
            kwargs.pop(name, None)
        return MooncakeSender(kv, compat, *args, **kwargs)
    return KVSender(kv, compat, *args, **kwargs)


def make_receiver(backend: str, kv, compat, **kwargs) -> KVReceiver:
    return (MooncakeReceiver if backend == "mooncake" else KVReceiver)(kv, compat, **kwargs)
