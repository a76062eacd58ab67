"""KVTransferParams: the JSON wire contract of docs/design.md, checked against the stdlib json/uuid."""
from __future__ import annotations

import json
import uuid

import pytest

from kv_transfer.params import (
    COMPAT_FIELDS,
    KVTransferParams,
    compat_fingerprint,
    compat_mismatch,
    new_access_token,
    new_transfer_id,
)

pytestmark = pytest.mark.unit

DESIGN_FIELDS = {
    "do_remote_decode", "do_remote_prefill", "transfer_id", "remote_engine_id", "remote_host", "remote_port",
    "remote_block_ids", "num_prompt_tokens", "first_token_id", "first_token_logprobs", "draft_token_ids",
    "prefix_cache_hit_tokens", "access_token", "lease_s", "compat", "dp_rank", "num_computed_blocks", "signature",
    "prompt_logprobs", "lora_name",
}


def p_response() -> dict:
    """What P returns to the router, as a plain JSON object."""
    return {
        "do_remote_prefill": True,
        "transfer_id": uuid.uuid4().hex,
        "remote_engine_id": "127.0.0.1:5601",
        "remote_host": "127.0.0.1",
        "remote_port": 5601,
        "remote_block_ids": [7, 3, 9],
        "num_prompt_tokens": 40,
        "first_token_id": 1234,
        "first_token_logprobs": {"logprob": -0.25, "top": [[1234, -0.25], [5, -2.0]]},
        "draft_token_ids": [5, 6],
        "prefix_cache_hit_tokens": 16,
        "access_token": "ab" * 16,
        "lease_s": 12.5,
        "compat": compat_fingerprint("m", "float32", 16, 6, 4, 32, "0.1.0"),
        "dp_rank": 1,
    }


def test_fields_are_exactly_the_design_table():
    assert set(KVTransferParams.__struct_fields__) == DESIGN_FIELDS


def test_missing_fields_take_defaults_and_defaults_are_omitted():
    params = KVTransferParams.from_json_obj({})
    assert params.do_remote_decode is False and params.do_remote_prefill is False
    assert params.transfer_id is None and params.remote_block_ids == [] and params.lease_s == 30.0
    assert params.to_json_obj() == {}


def test_router_to_p_leg_carries_only_what_it_sets():
    tid = new_transfer_id()
    obj = KVTransferParams(do_remote_decode=True, transfer_id=tid).to_json_obj()
    assert obj == {"do_remote_decode": True, "transfer_id": tid}


def test_p_response_round_trips_through_json_text():
    obj = p_response()
    params = KVTransferParams.from_json_obj(json.loads(json.dumps(obj)))
    assert json.loads(json.dumps(params.to_json_obj())) == obj
    assert params.remote_block_ids == [7, 3, 9] and params.first_token_logprobs.top[1] == (5, -2.0)


def test_unknown_fields_are_ignored():
    obj = {**p_response(), "from_a_newer_peer": {"x": 1}, "lease_ms": 5}
    params = KVTransferParams.from_json_obj(obj)
    assert "from_a_newer_peer" not in params.to_json_obj()
    assert params.remote_port == 5601


def test_d_sets_num_computed_blocks():
    params = KVTransferParams.from_json_obj({**p_response(), "num_computed_blocks": 2})
    assert params.num_computed_blocks == 2


@pytest.mark.parametrize(
    "field, value",
    [
        ("remote_port", "5601"),
        ("remote_port", 0),
        ("remote_port", 70000),
        ("remote_block_ids", [1, -2]),
        ("remote_block_ids", [1, "2"]),
        ("do_remote_prefill", "yes"),
        ("lease_s", 0),
        ("transfer_id", ""),
        ("transfer_id", 12),
        ("first_token_id", 1.5),
        ("compat", ["not", "an", "object"]),
        ("num_computed_blocks", 4),  # more than the 3 remote blocks
    ],
)
def test_malformed_value_is_a_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        KVTransferParams.from_json_obj({**p_response(), field: value})


@pytest.mark.parametrize("obj", ["a string", [1, 2], 3, None])
def test_not_an_object_is_a_value_error(obj):
    with pytest.raises(ValueError, match="kv_transfer_params"):
        KVTransferParams.from_json_obj(obj)


def test_transfer_ids_are_uuid4_hex_and_unique():
    ids = {new_transfer_id() for _ in range(1000)}
    assert len(ids) == 1000
    for tid in list(ids)[:20]:
        assert uuid.UUID(hex=tid).version == 4 and uuid.UUID(hex=tid).hex == tid


def test_access_tokens_are_128_bit_hex_and_unique():
    tokens = {new_access_token() for _ in range(1000)}
    assert len(tokens) == 1000
    for token in list(tokens)[:20]:
        assert len(token) == 32 and int(token, 16) < 2**128


def test_compat_fingerprint_has_every_design_field():
    fp = compat_fingerprint("m", "float32", 16, 6, 4, 32, "0.1.0")
    assert list(fp) == list(COMPAT_FIELDS)
    assert fp == {"model_id": "m", "dtype": "float32", "kv_cache_dtype": "float32", "block_size": 16,
                  "num_layers": 6, "num_kv_heads": 4, "head_dim": 32, "version": "0.1.0"}
    assert compat_fingerprint("m", "bfloat16", 16, 6, 4, 32, "0.1.0", kv_cache_dtype="fp8_e5m2")["kv_cache_dtype"] == \
        "fp8_e5m2"  # what the cache stores, beside the model's dtype
    assert json.loads(json.dumps(fp)) == fp


def test_compat_mismatch_names_the_first_differing_field():
    mine = compat_fingerprint("m", "float32", 16, 6, 4, 32, "0.1.0")
    assert compat_mismatch(mine, dict(mine)) is None
    theirs = compat_fingerprint("m", "float32", 32, 6, 4, 64, "0.1.0")  # block_size and head_dim differ
    message = compat_mismatch(mine, theirs)
    assert "block_size" in message and "head_dim" not in message
    assert "16" in message and "32" in message


def test_compat_mismatch_on_missing_fingerprint_or_field():
    mine = compat_fingerprint("m", "float32", 16, 6, 4, 32, "0.1.0")
    assert "missing" in compat_mismatch(mine, None)
    partial = {k: v for k, v in mine.items() if k != "version"}
    assert "version" in compat_mismatch(mine, partial)


@pytest.mark.parametrize("field,value", [
    ("first_token_logprobs", {}),  # no logprob: D's scheduler raised KeyError (issue 42)
    ("first_token_logprobs", {"logprob": "high"}),
    ("first_token_logprobs", {"logprob": -0.1, "top": "x"}),
    ("first_token_logprobs", {"logprob": -0.1, "top": [[-1, 0.0]]}),
    ("first_token_logprobs", {"logprob": -0.1, "top": [[1, 0.0]] * 1000}),
    ("prompt_logprobs", [None, {"logprob": -0.1, "rank": "first", "top": []}]),
])
def test_a_producers_logprob_entries_are_checked_at_parse(field, value):
    with pytest.raises(ValueError, match=field):
        KVTransferParams.from_json_obj({**p_response(), field: value})
    ok = {"logprob": -0.1, "rank": 1, "top": [[3, -0.1]]}
    KVTransferParams.from_json_obj({**p_response(), "first_token_logprobs": ok, "prompt_logprobs": [None, ok]})
