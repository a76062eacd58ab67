"""Which KV producers a decode engine may pull from: configured, never client-chosen.

A `do_remote_prefill` request names a producer (`remote_host:remote_port`) that the decode
engine will connect to. Left open, any client that reaches an engine could make it open
connections to any address. So a consumer pulls only from params it trusts:

- signed: the router signs the kv_transfer_params it forwards with HMAC-SHA256 under a
  secret shared by the router and the engines (`--kv-params-secret-file`, or the
  ATOMD_KV_PARAMS_SECRET environment variable); an engine that has the secret accepts
  only params whose `signature` matches, and
- allow-listed: `--kv-trusted-producers` names the hosts / networks a producer may be at.

With neither configured an engine trusts loopback producers only (the one-machine case:
`launch/pd_pair.sh`, tests). Refusals happen before any connection is made and are
counted by reason.

The same secret keys the KV events' ZMQ CURVE sockets (`kv_events_curve_keys` below).
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from typing import NamedTuple

import msgspec
import zmq
from zmq.utils import z85

from kv_transfer.params import KVTransferParams

SECRET_ENV = "ATOMD_KV_PARAMS_SECRET"
LOOPBACK = ("127.0.0.0/8", "::1/128", "localhost")
# refusal reasons (the label of the refusal counters)
UNSIGNED, BAD_SIGNATURE, UNTRUSTED_PRODUCER = "unsigned", "bad_signature", "untrusted_producer"


class UntrustedKVParams(ValueError):
    """kv_transfer_params this engine will not act on; `reason` is one of the constants above."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def load_secret(value: str | None = None, path: str | None = None, env: dict | None = None) -> bytes | None:
    """The shared secret: given outright, read from a file (surrounding whitespace dropped),
    or from ATOMD_KV_PARAMS_SECRET; None when none is configured. ValueError when empty."""
    env = os.environ if env is None else env
    if value is None and path is not None:
        try:
            with open(path, "rb") as f:
                value = f.read().decode().strip()
        except OSError as e:
            raise ValueError(f"kv_params_secret_file {path!r} cannot be read: {e.strerror}") from None
    if value is None:
        value = env.get(SECRET_ENV)
    if value is None:
        return None
    if not value.strip():
        raise ValueError("the kv_transfer_params secret is empty")
    return value.strip().encode()


# Labels of the KV events' CURVE keys (atomd/engine/kv_events.py): each Curve25519 secret key
# is HMAC-SHA256(KV secret, label), 32 bytes, so every holder of the secret derives the
# same two keypairs and nobody else can. The engine's PUB / replay sockets are the CURVE
# server; a subscriber must present the client public key (checked by the engine's ZAP).
CURVE_SERVER_LABEL = b"atomd-kv-events-curve-server-v1"
CURVE_CLIENT_LABEL = b"atomd-kv-events-curve-client-v1"


class CurveKeys(NamedTuple):
    """Z85-encoded (40 bytes each), as zmq's CURVE socket options take them."""
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def kv_events_curve_keys(secret: bytes) -> CurveKeys:
    """The KV events' CURVE keypairs derived from the KV secret (labels above)."""
    def pair(label: bytes) -> tuple[bytes, bytes]:
        secret_key = z85.encode(hmac.new(secret, label, hashlib.sha256).digest())
        return zmq.curve_public(secret_key), secret_key
    return CurveKeys(*pair(CURVE_SERVER_LABEL), *pair(CURVE_CLIENT_LABEL))


def _payload(params: KVTransferParams) -> bytes:
    """What is signed: every field of the parsed params but the signature (defaults
    included) as compact JSON with every key sorted (nested objects too), so both sides get
    the same bytes whatever order or explicit defaults the JSON came with."""
    fields = msgspec.structs.asdict(params)
    del fields["signature"]
    return msgspec.json.encode(fields, order="sorted")


def signature_of(params: KVTransferParams, secret: bytes) -> str:
    return hmac.new(secret, _payload(params), hashlib.sha256).hexdigest()


def sign(params: KVTransferParams, secret: bytes) -> KVTransferParams:
    return msgspec.structs.replace(params, signature=signature_of(params, secret))


class ProducerTrust:
    """A consumer's rule for which producers it pulls from (see the module docstring)."""

    def __init__(self, secret: bytes | None, trusted_producers: list[str] | tuple[str, ...] = ()):
        self.secret = secret
        entries = list(trusted_producers) or ([] if secret is not None else list(LOOPBACK))
        self.networks, self.hosts = parse_producers(entries)

    def check(self, params: KVTransferParams) -> None:
        """Raise UntrustedKVParams unless `params` may be acted on."""
        if self.secret is not None:
            if not params.signature:
                raise UntrustedKVParams(UNSIGNED, "kv_transfer_params must be signed by the router "
                                                  "(this engine has a kv_transfer_params secret)")
            # bytes, not str: compare_digest raises TypeError on a non-ASCII str (a client's "é")
            if not hmac.compare_digest(params.signature.encode("utf-8", "surrogateescape"),
                                       signature_of(params, self.secret).encode()):
                raise UntrustedKVParams(BAD_SIGNATURE, "kv_transfer_params signature does not match")
        if (self.networks or self.hosts) and not self.allows(params.remote_host):
            raise UntrustedKVParams(UNTRUSTED_PRODUCER, f"kv_transfer_params.remote_host "
                                                        f"{params.remote_host!r} is not a trusted producer")

    def allows(self, host: str | None) -> bool:
        if host is None:
            return False
        if host.lower() in self.hosts:
            return True
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(addr in net for net in self.networks)


def parse_producers(entries: list[str]) -> tuple[list, set[str]]:
    """'10.0.0.0/8', '10.1.2.3', 'prefill-0.atomd-prefill' -> (networks, host names)."""
    networks, hosts = [], set()
    for entry in entries:
        entry = entry.strip()
        if not entry:
            continue
        try:
            networks.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            hosts.add(entry.lower())
    return networks, hosts
