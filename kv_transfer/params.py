"""KVTransferParams: the `kv_transfer_params` object of a PD request (docs/design.md, "`kv_transfer_params`").

It travels as JSON in HTTP bodies: router -> P (`do_remote_decode`, `transfer_id`),
P -> router -> D (everything D needs to pull the prompt KV). Unknown fields are ignored so
an older peer can talk to a newer one; missing fields take their defaults; a value of the
wrong type or out of range raises ValueError naming the field, which a server answers
with a 400.

The compat fingerprint pins what the raw block bytes mean: two engines may exchange KV
only if every field of COMPAT_FIELDS matches, otherwise the bytes would be silently misread.
`tp_size` (absent: 1) is not compared exactly: engines of different TP sizes exchange KV
when one layout maps onto the other (contracts/kv_layout.py), checked before any byte moves.
"""
from __future__ import annotations

import secrets
import uuid
from typing import Annotated, Any

import msgspec

from contracts.kv_layout import TPKVLayout, check_mappable, slices_match
from contracts.logprobs import Logprob

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
Ident = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]

COMPAT_FIELDS = ("model_id", "dtype", "kv_cache_dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "version")


class KVTransferParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One row per field of the docs/design.md table; see there for who writes and reads what."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    transfer_id: Ident | None = None
    remote_engine_id: str | None = None
    remote_host: str | None = None
    remote_port: Port | None = None
    remote_block_ids: list[NonNegInt] = []
    num_prompt_tokens: NonNegInt = 0
    first_token_id: NonNegInt | None = None
    first_token_logprobs: Logprob | None = None
    draft_token_ids: list[NonNegInt] = []
    prefix_cache_hit_tokens: NonNegInt = 0
    access_token: Ident | None = None
    lease_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    compat: dict[str, Any] | None = None
    dp_rank: NonNegInt = 0
    num_computed_blocks: NonNegInt = 0
    signature: str | None = None  # the router's HMAC of the other fields (kv_transfer/trust.py)
    # P's prompt logprobs (asked by `prompt_logprobs` or echo + logprobs): D returns them
    # (a producer's logprob entries are typed, so a bad one is this request's 400, never D's crash)
    prompt_logprobs: list[Logprob | None] | None = None
    # the LoRA adapter P computed the prompt's KV under (None: the base model): D serves the
    # pull only for a request under the same adapter, loaded there
    lora_name: Ident | None = None

    def __post_init__(self) -> None:
        if self.num_computed_blocks > len(self.remote_block_ids):
            raise ValueError(
                f"num_computed_blocks ({self.num_computed_blocks}) exceeds "
                f"the number of remote_block_ids ({len(self.remote_block_ids)})"
            )

    @classmethod
    def from_json_obj(cls, obj: Any) -> KVTransferParams:
        """Parse the decoded JSON object; ValueError names the offending field."""
        try:
            return msgspec.convert(obj, cls)
        except msgspec.ValidationError as e:
            # msgspec says e.g. "Expected `int` >= 1 - at `$.remote_port`"; keep its path.
            raise ValueError(f"invalid kv_transfer_params: {e}") from None

    def to_json_obj(self) -> dict[str, Any]:
        """Plain dict for a JSON body; fields at their default are left out."""
        return msgspec.to_builtins(self)


def new_transfer_id() -> str:
    """Cluster-unique id of one transfer (the router mints it)."""
    return uuid.uuid4().hex


def new_access_token() -> str:
    """128 random bits, hex: only its holder may READ the transfer's blocks."""
    return secrets.token_hex(16)


def compat_fingerprint(
    model_id: str, dtype: str, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, version: str,
    tp_size: int = 1, kv_cache_dtype: str | None = None, tp_rows: int | None = None,
) -> dict[str, Any]:
    """What must be equal on both engines for block bytes to be interchangeable, and the TP
    size their blocks are split by (`num_kv_heads`: the model's, all TP workers' together).
    `kv_cache_dtype`: what the cache stores (fp8_e4m3, fp8_e5m2; default: `dtype`, the model's).
    `tp_rows`: a TP engine whose workers' slices travel as they lie (--tp-kv-transfer direct,
    atomd/engine/tp_pd.py): its blocks per worker, the stride of its slice rows (not compared)."""
    fp = {
        "model_id": model_id,
        "dtype": dtype,
        "kv_cache_dtype": kv_cache_dtype or dtype,
        "block_size": block_size,
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "version": version,
    }
    if tp_size != 1:  # left out at 1, so a TP=1 engine's fingerprint is what it always was
        fp["tp_size"] = tp_size
    if tp_rows is not None:
        fp["tp_rows"] = tp_rows
    return fp


def tp_layout(fp: dict[str, Any], planes: int = 2) -> TPKVLayout:
    """The TP KV layout a fingerprint describes (`planes`: the cache's, 1 for MLA's latent;
    equal on two engines whose versions match). ValueError when a field is malformed."""
    try:
        return TPKVLayout(fp.get("tp_size", 1), fp.get("num_kv_heads"), fp.get("head_dim"), planes,
                          fp.get("num_layers"), fp.get("block_size"), fp.get("dtype"))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"malformed KV layout in the fingerprint: {exc}") from None


def compat_mismatch(expected: dict[str, Any] | None, got: dict[str, Any] | None, *,
                    peer: str = "producer") -> str | None:
    """None when compatible, else a message naming the first field that differs, or both TP
    layouts when they cannot map. `expected`: this engine's; `got`: the peer's, whose role
    (`peer`: producer on D, consumer on P) orders the layouts in the message."""
    if not isinstance(got, dict):
        return f"compat fingerprint missing (got {got!r})"
    expected = expected or {}
    for name in COMPAT_FIELDS:
        if expected.get(name) != got.get(name):
            return f"compat mismatch on {name}: expected {expected.get(name)!r}, got {got.get(name)!r}"
    if expected.get("tp_size", 1) != got.get("tp_size", 1):
        try:
            mine, theirs = tp_layout(expected), tp_layout(got)
            producer, consumer = (theirs, mine) if peer == "producer" else (mine, theirs)
            check_mappable(producer, consumer)
        except ValueError as exc:
            return f"compat mismatch on tp_size: {exc}"
        # per-worker slices on the wire (atomd/engine/tp_pd.py): D maps its workers' slices onto P's, but
        # nobody converts one slice into another, so the workers on both sides must hold as many KV heads
        if ("tp_rows" in expected or "tp_rows" in got) and not slices_match(producer, consumer):
            return (f"compat mismatch on tp_size: workers' slices travel as they lie (tp_kv_transfer direct) "
                    f"only between layouts whose workers hold as many KV heads: producer {producer.describe()}; "
                    f"consumer {consumer.describe()} (run both with tp_kv_transfer staging)")
    return None
