"""The KV connector registry: a connector by name ("zmq", "mooncake"), both halves.

Its own module so the connector implementations can import the interfaces of
kv_transfer/connector.py while this module imports the implementations (no cycle).
"""
from __future__ import annotations

import importlib
from typing import Any

from kv_transfer.connector import KVConnectorConfig, KVConnectorScheduler, KVConnectorWorker

_REGISTRY: dict[str, Any] = {}
_BUILTIN = {  # imported on first use
    "zmq": "kv_transfer.zmq_connector:create_zmq_connector",
    "mooncake": "kv_transfer.mooncake_transport:create_mooncake_connector",  # the ZMQ control plane + Mooncake
}


def register_connector(name: str, factory) -> None:
    """`factory(role, config) -> (KVConnectorScheduler, KVConnectorWorker)`."""
    _REGISTRY[name] = factory


def create_connector(name: str, role: str, config: KVConnectorConfig) -> tuple[KVConnectorScheduler, KVConnectorWorker]:
    """Both halves of the connector registered as `name` (e.g. "zmq", "mooncake")."""
    if role not in ("producer", "consumer", "both"):
        raise ValueError(f"kv_role must be producer, consumer or both, got {role!r}")
    if name not in _REGISTRY and name in _BUILTIN:
        module, factory = _BUILTIN[name].split(":")
        register_connector(name, getattr(importlib.import_module(module), factory))
    if name not in _REGISTRY:
        raise ValueError(f"kv_transfer_backend {name!r} is not registered; known: {sorted(_REGISTRY)}")
    return _REGISTRY[name](role, config)
