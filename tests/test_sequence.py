"""SamplingParams validation and Sequence bookkeeping."""
from __future__ import annotations

import msgspec
import pytest

from contracts.sampling import SamplingParams
from kv_transfer.params import KVTransferParams
from scheduler.sequence import Sequence, SequenceStatus

pytestmark = pytest.mark.unit


def test_sampling_params_defaults_follow_vllm():
    sp = SamplingParams()
    assert (sp.max_tokens, sp.min_tokens, sp.temperature, sp.top_p, sp.top_k) == (16, 0, 1.0, 1.0, 0)
    assert sp.seed is None and sp.logprobs is None and sp.stop == [] and sp.stop_token_ids == []
    assert sp.ignore_eos is False and sp.include_stop_str_in_output is False


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("min_tokens", -1), ("temperature", -0.5), ("top_p", 0.0),
    ("top_p", 1.5), ("top_k", -2), ("logprobs", -1), ("stop", [""]), ("stop_token_ids", [-3]),
    ("max_tokens", None), ("temperature", "hot"), ("seed", 1.5),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


def test_sampling_params_roundtrip_msgpack_and_validate_on_decode():
    sp = SamplingParams(max_tokens=5, stop=["\n"], stop_token_ids=[7], logprobs=2, seed=3)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(sp), type=SamplingParams) == sp
    with pytest.raises(msgspec.ValidationError, match="max_tokens"):
        msgspec.json.decode(b'{"max_tokens": 0}', type=SamplingParams)


def test_sequence_views_and_unique_ids():
    a = Sequence([5, 6, 7], SamplingParams(), request_id="r1", kv_transfer_params=KVTransferParams(transfer_id="t1"))
    b = Sequence([5])
    assert a.id != b.id and a.request_id == "r1" and b.request_id == str(b.id)
    a.token_ids += [8, 9]
    assert a.num_tokens == 5 and a.num_prompt_tokens == 3
    assert a.prompt_token_ids == [5, 6, 7] and a.completion_token_ids == [8, 9]
    assert a.status is SequenceStatus.WAITING and a.finish_reason is None
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Sequence([])


@pytest.mark.parametrize("leave, finish", [
    ("eos", "stop"), ("stop_token", "stop"), ("stop_string", "stop"), ("max_tokens", "length"),
    ("max_model_len", "length"), ("aborted", "abort"), ("unschedulable", "abort"), ("kv_transfer_failed", "abort"),
])
def test_finish_reason_maps_leave_reason_to_openai(leave, finish):
    seq = Sequence([1])
    seq.leave_reason = leave
    assert seq.finish_reason == finish
