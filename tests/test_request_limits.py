"""Request bounds (atomd/api/limits.py, issue 42): every list field, string, grammar, JSON
nesting and prompt is bounded before anything is parsed further, tokenized or compiled;
over a bound is a 400 naming the field, the limit and its flag, answered fast."""
from __future__ import annotations

import argparse
import json

import msgspec
import pytest

from atomd.api import limits as L
from atomd.api import protocol, validation

pytestmark = pytest.mark.unit

N = L.DEFAULT.max_list_items + 1
DEEP = 5000  # the probe's guided_json nesting


def validate(body: dict, limits: L.RequestLimits = L.DEFAULT, chat: bool = False) -> validation.Checked:
    kind = protocol.ChatCompletionRequest if chat else protocol.CompletionRequest
    req = protocol.decode_request(msgspec.json.encode(body), kind)
    return (validation.validate_chat_request if chat else validation.validate_completion_request)(req, limits)


def refused(body: dict, limits: L.RequestLimits = L.DEFAULT, chat: bool = False) -> protocol.APIError:
    with pytest.raises(protocol.APIError) as e:
        validate(body, limits, chat)
    assert e.value.status == 400 and e.value.code == "limit_exceeded"
    assert "the limit is" in e.value.message and "(--max-" in e.value.message
    return e.value


def nested(depth: int):
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize("field,value", [
    ("stop", ["x"] * N), ("stop_token_ids", [1] * N), ("bad_words", ["w"] * N),
    ("logit_bias", {str(i): 1.0 for i in range(N)}), ("guided_choice", ["a"] * N),
])
def test_every_list_field_is_bounded(field, value):
    err = refused({"prompt": "x", field: value})
    assert err.param == field and str(L.DEFAULT.max_list_items) in err.message


def test_the_probes_lists_are_refused(benchmark_sizes=(1_500_000, 50_000, 100_000)):
    stop_ids, bad_words, choices = benchmark_sizes
    assert refused({"prompt": "x", "stop_token_ids": [7] * stop_ids}).param == "stop_token_ids"
    assert refused({"prompt": "x", "bad_words": ["w"] * bad_words}).param == "bad_words"
    assert refused({"prompt": "x", "structured_outputs": {"choice": ["c"] * choices}}).param \
        == "structured_outputs.choice"


def test_messages_and_tools_are_bounded():
    msgs = [{"role": "user", "content": "x"}] * N
    assert refused({"messages": msgs}, chat=True).param == "messages"
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(N)]
    assert refused({"messages": msgs[:1], "tools": tools}, chat=True).param == "tools"


@pytest.mark.parametrize("field", ["stop", "bad_words", "guided_choice"])
def test_items_are_bounded(field):
    err = refused({"prompt": "x", field: ["y" * (L.DEFAULT.max_item_chars + 1)]})
    assert err.param == field and "max-item-chars" in err.message


@pytest.mark.parametrize("field,value", [
    ("guided_regex", "a" * (L.DEFAULT.max_grammar_bytes + 1)),
    ("guided_grammar", "start: " + "a" * L.DEFAULT.max_grammar_bytes),
    ("guided_json", {"type": "object", "description": "d" * L.DEFAULT.max_grammar_bytes}),
    ("guided_choice", ["c" * 100] * 700),
])
def test_grammars_are_bounded(field, value):
    assert "max-grammar-bytes" in refused({"prompt": "x", field: value}).message


@pytest.mark.parametrize("body", [
    {"guided_json": "[" * DEEP + "]" * DEEP},  # as a string: json.loads recursed (RecursionError, a 500)
    {"guided_json": {"type": "object", "properties": {"a": nested(200)}}},
    {"structured_outputs": {"json": '{"a": ' * DEEP + "1" + "}" * DEEP}},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {"x": nested(100)}}}},
    {"kv_transfer_params": {"compat": {"x": nested(100)}}},
])
def test_json_nesting_is_bounded_before_parsing(body):
    assert "max-json-depth" in refused({"prompt": "x", **body}).message


def test_a_schema_at_normal_depth_passes():
    validate({"prompt": "x", "guided_json": json.dumps({"type": "object", "properties": {
        "a": {"type": "array", "items": {"type": "object", "properties": {"b": {"type": "string"}}}}}})})


def test_prompt_chars_are_bounded():
    limits = L.RequestLimits(max_prompt_chars=100)
    assert refused({"prompt": "x" * 101}, limits).param == "prompt"
    assert refused({"prompt": list(range(101))}, limits).param == "prompt"
    assert refused({"messages": [{"role": "user", "content": "x" * 60}] * 2}, limits, chat=True).param == "messages"
    validate({"prompt": "x" * 100}, limits)
    assert L.DEFAULT.prompt_chars(256) == 1 << 20 and L.DEFAULT.prompt_chars(1 << 17) == 16 << 17


def test_limits_are_flags_and_named_in_help():
    parser = argparse.ArgumentParser()
    L.add_arguments(parser.add_argument_group("limits"))
    text = parser.format_help()
    for field in L.RequestLimits.__struct_fields__:
        assert "--" + field.replace("_", "-") in text
    args = parser.parse_args(["--max-list-items", "8", "--max-json-depth", "4"])
    limits = L.from_args(args)
    assert limits.max_list_items == 8 and limits.max_json_depth == 4
    assert refused({"prompt": "x", "stop": ["a"] * 9}, limits).param == "stop"
    with pytest.raises(ValueError, match="max-list-items"):
        L.from_args(parser.parse_args(["--max-list-items", "0"]))


def test_error_messages_never_echo_a_huge_value():
    req = protocol.decode_request(msgspec.json.encode({"messages": [{"role": "r" * 100_000, "content": "x"}]}),
                           protocol.ChatCompletionRequest)
    with pytest.raises(protocol.APIError) as e:
        validation.chat_messages(req)
    assert len(e.value.body()) < 2 * protocol.MAX_MESSAGE_CHARS


def test_text_json_depth_skips_brackets_in_strings():
    assert L.text_json_depth('{"a": "[[[[[[", "b": [1, {"c": "\\"]"}]}', 10) == 3
    assert L.text_json_depth("[" * 100, 10) == 11  # counted up to the limit + 1 only
