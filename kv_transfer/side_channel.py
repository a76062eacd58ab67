"""The side channel's wire: what P and D say about a transfer (docs/design.md, "Side channel").

Every message is `[header, *payload]`; the header is a msgpack tagged struct, the payload
frames are raw block bytes.

    D -> P  READ {transfer_id, access_token, block_ids, compat, backend}
    P -> D  DATA {transfer_id, start, counts} + one frame per count (counts[i] blocks), ...
    P -> D  END {transfer_id, num_blocks}       after every DATA frame left P's memory
    D -> P  DONE {transfer_id, access_token}    P frees the blocks (idempotent)
    D -> P  HEARTBEAT {transfer_ids, access_tokens}  P renews the leases
    D -> P  ABORT {transfer_id, access_token}   P frees now
    P -> D  ERROR {transfer_id, code, message}  refused: bad token, foreign blocks, compat, ...
    P -> D  REFUSED {[[transfer_id, code]]}     a HEARTBEAT's ids P does not hold, in one reply
    D -> P  HELLO {backend}                     handshake: P answers WELCOME {backend, instance, info}

Bounds (issue 42): inbound messages are bounded by zmq (MAXMSGSIZE: MAX_CONTROL_BYTES at P,
MAX_DATA_FRAME_BYTES at D; a larger one drops the connection) and by field (ids, strings,
ids per message).
"""
from __future__ import annotations

from typing import Any
from typing import Annotated

import msgspec
import numpy as np

# ERROR codes (P -> D) and the receiver's own failure reasons.
BAD_TOKEN = "bad_token"
FOREIGN_BLOCKS = "foreign_blocks"
COMPAT_MISMATCH = "compat_mismatch"
UNKNOWN_TRANSFER = "unknown_transfer"
MALFORMED = "malformed"
PEER_GONE = "peer_gone"
TIMEOUT = "timeout"
INCOMPLETE = "incomplete"
# Release reasons (P), also sent as ERROR codes for late messages about a released transfer.
DONE = "done"
ABORTED = "aborted"
EXPIRED = "expired"
REVOKED = "revoked"
# P and D run different data planes (--kv-transfer-backend, or Mooncake's protocol)
BACKEND_MISMATCH = "backend_mismatch"

DEFAULT_MAX_MESSAGE_BYTES = 8 << 20  # tcp loopback peaks with 4-16 MiB frames (docs/design.md, "CPU facts")
MAX_CONTROL_BYTES = 4 << 20  # P's inbound messages (control only: READ's block ids at most)
MAX_DATA_FRAME_BYTES = 64 << 20  # D's inbound frames (DATA payload; raised to one block when larger)
MAX_IDS_PER_MESSAGE = 4096  # transfer ids in one HEARTBEAT

Ident = Annotated[str, msgspec.Meta(max_length=256)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
BlockIds = Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=1 << 18)]


class Msg(msgspec.Struct, tag_field="kind", array_like=True):
    pass


class Read(Msg, tag="READ"):
    transfer_id: Ident
    access_token: Ident
    block_ids: BlockIds
    compat: Annotated[dict[str, Any], msgspec.Meta(max_length=64)]
    backend: Ident = "zmq"  # the consumer's data plane; P refuses any other than its own


class Data(Msg, tag="DATA"):
    transfer_id: str
    start: int  # position in the READ's block_ids of the first block of the first frame
    counts: list[int]  # blocks per payload frame


class End(Msg, tag="END"):
    transfer_id: str
    num_blocks: int


class Done(Msg, tag="DONE"):
    transfer_id: Ident
    access_token: Ident = ""


class Heartbeat(Msg, tag="HEARTBEAT"):
    transfer_ids: Annotated[list[Ident], msgspec.Meta(max_length=MAX_IDS_PER_MESSAGE)]
    access_tokens: Annotated[list[Ident], msgspec.Meta(max_length=MAX_IDS_PER_MESSAGE)] = []  # one per id


class Abort(Msg, tag="ABORT"):
    transfer_id: Ident
    access_token: Ident = ""


class Error(Msg, tag="ERROR"):
    transfer_id: Ident
    code: Ident
    message: Text = ""


class Refused(Msg, tag="REFUSED"):
    """P -> D: the ids of one HEARTBEAT that P does not hold, with the reason of each."""

    refusals: Annotated[list[tuple[Ident, Ident]], msgspec.Meta(max_length=MAX_IDS_PER_MESSAGE)]


class Hello(Msg, tag="HELLO"):
    """D -> P handshake, once per producer before the first READ of a one-sided data plane."""

    backend: str


class Welcome(Msg, tag="WELCOME"):
    """P's handshake answer: its backend, an id of this sender instance (a restarted P has
    another), and what the data plane needs (Mooncake: session port, buffer base, geometry)."""

    backend: str
    instance: str
    info: dict[str, Any] = {}


class Ready(Msg, tag="READY"):
    """P -> D, one-sided data planes: the READ passed every check and its blocks may be read now."""

    transfer_id: str
    instance: str
    num_blocks: int


Message = Read | Data | End | Done | Heartbeat | Abort | Error | Hello | Welcome | Ready | Refused
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Msg) -> bytes:
    return _encoder.encode(msg)


def decode(buf: bytes | memoryview) -> Message:
    """Raises msgspec.DecodeError (or ValidationError) for anything that is not a header."""
    return _decoder.decode(buf)


def block_runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """(position, length) of each run of consecutive ids, in order."""
    if len(ids) == 0:
        return []
    breaks = (np.flatnonzero(np.diff(ids) != 1) + 1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, len(ids)]
    return [(a, b - a) for a, b in zip(starts, ends)]


def plan_messages(block_ids: np.ndarray, blocks_per_message: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """Split a READ into DATA messages: (start position, [(first block id, count) per frame]).

    Runs of consecutive ids become one frame each, split so no message carries more than
    `blocks_per_message` blocks; short runs share a message, so frames stay few and large.
    """
    # Even out the messages (256 blocks at 85 per message: 4 x 64, not 85, 85, 85, 1).
    num_messages = -(-len(block_ids) // blocks_per_message)
    blocks_per_message = -(-len(block_ids) // num_messages) if num_messages else blocks_per_message
    messages, frames, filled, start = [], [], 0, 0
    for pos, length in block_runs(block_ids):
        first, done = int(block_ids[pos]), 0
        while done < length:
            n = min(blocks_per_message - filled, length - done)
            frames.append((first + done, n))
            filled += n
            done += n
            if filled == blocks_per_message:
                messages.append((start, frames))
                start, frames, filled = start + filled, [], 0
    if frames:
        messages.append((start, frames))
    return messages
