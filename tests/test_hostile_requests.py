"""#42's request-shaped attacks on an engine, each scaled to run in a second: every one is a
400 naming the field and its bound (an OpenAI-style error, no traceback or path), and the
engine keeps serving with no block held. The bounds are atomd/protocol.py's MAX_*."""
from __future__ import annotations

import json

import pytest

from atomd import protocol
from launch.process import http
from tests.server_fixtures import model_dir, start_server

pytestmark = pytest.mark.integration
PROMPT_CHARS = 100_000  # past OFF_LOOP_CHARS (the fixture's model: 32 x 256 would be under it)


@pytest.fixture(scope="module")
def server():
    srv = start_server(model_dir(), "--max-prompt-chars", str(PROMPT_CHARS))
    yield srv
    srv.stop()


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# (field, value, what the 400 must name) -- one past each bound, or the probe's own input
# where it fits the body limit
ATTACKS = [
    ("stop_token_ids", list(range(protocol.MAX_TOKEN_IDS + 1)), str(protocol.MAX_TOKEN_IDS)),
    ("bad_words", ["w"] * (protocol.MAX_BAD_WORDS + 1), str(protocol.MAX_BAD_WORDS)),
    ("stop", ["s"] * (protocol.MAX_STOP + 1), str(protocol.MAX_STOP)),
    ("stop", "x" * (protocol.MAX_STOP_CHARS + 1), str(protocol.MAX_STOP_CHARS)),
    ("logit_bias", {str(i): 1.0 for i in range(protocol.MAX_LOGIT_BIAS + 1)}, str(protocol.MAX_LOGIT_BIAS)),
    ("guided_choice", [f"c{i}" for i in range(100_000)], str(protocol.MAX_CHOICES)),  # the probe's count
    ("guided_choice", ["y" * 40_000, "z" * 40_000], str(protocol.MAX_GRAMMAR_CHARS)),
    ("guided_regex", "a" * (protocol.MAX_GRAMMAR_CHARS + 1), str(protocol.MAX_GRAMMAR_CHARS)),
    ("guided_json", json.dumps({"a": 1}) + " " * protocol.MAX_GRAMMAR_CHARS, str(protocol.MAX_GRAMMAR_CHARS)),
    ("guided_json", nested(5000), "nested too deeply"),  # the probe's input: JSON text 5,000 deep
    ("guided_json", {"a": json.loads(nested(protocol.MAX_NESTING + 5))}, f"deeper than {protocol.MAX_NESTING}"),
    ("kv_transfer_params", {"x": json.loads(nested(200))}, f"deeper than {protocol.MAX_NESTING}"),
]


@pytest.mark.parametrize("field,value,bound", ATTACKS, ids=[f"{a[0]}-{i}" for i, a in enumerate(ATTACKS)])
def test_an_oversized_field_is_a_400_naming_it_and_the_engine_serves_on(server, field, value, bound):
    baseline = server.stats()["num_free_blocks"]
    status, raw = http("POST", server.url + "/v1/completions",
                       {"prompt": "def f(", "max_tokens": 4, "temperature": 0, field: value})
    assert status == 400, raw[:300]
    error = json.loads(raw)["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error", error
    assert bound in error["message"], error["message"][:300]
    assert len(raw) < 2048 and b"Traceback" not in raw and b".py" not in raw and b"/src/" not in raw
    status, raw = http("POST", server.url + "/v1/completions", {"prompt": "def f(", "max_tokens": 4, "temperature": 0})
    assert status == 200, raw
    server.wait_idle(baseline)


def test_each_list_at_its_bound_is_served(server):
    """The bounds refuse only what is past them."""
    body = {"prompt": "def f(", "max_tokens": 4, "temperature": 0,
            "stop_token_ids": list(range(5, 5 + protocol.MAX_TOKEN_IDS)),
            "stop": ["never"] * protocol.MAX_STOP, "bad_words": ["zzzz"] * 16,
            "logit_bias": {str(i): 0.5 for i in range(protocol.MAX_LOGIT_BIAS)}}
    status, raw = http("POST", server.url + "/v1/completions", body)
    assert status == 200, raw[:300]
    status, raw = http("POST", server.url + "/v1/completions",
                       {"prompt": "def f(", "max_tokens": 4, "temperature": 0,
                        "guided_choice": [f"c{i}" for i in range(protocol.MAX_CHOICES)]})
    assert status == 200, raw[:300]
    assert json.loads(raw)["choices"][0]["text"].startswith("c")


@pytest.mark.parametrize("route,body,param", [
    ("/v1/completions", {"prompt": "ab " * 5_000_000}, "prompt"),  # the probe's 15 MB prompt
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab " * 500_000}] * 4}, "messages"),
])
def test_a_prompt_past_the_character_bound_is_refused_before_tokenizing(server, route, body, param):
    """A 15 MB prompt once held an engine's event loop for 33-41 s while it was tokenized."""
    status, raw = http("POST", server.url + route, {**body, "max_tokens": 1})
    assert status == 400, raw[:300]
    error = json.loads(raw)["error"]
    assert error["param"] == param and f"--max-prompt-chars {PROMPT_CHARS}" in error["message"], error
    assert len(raw) < 2048  # the prompt is not echoed back
    status, raw = http("POST", server.url + "/v1/completions", {"prompt": "def f(", "max_tokens": 4})
    assert status == 200, raw


def test_a_long_prompt_under_the_bound_is_tokenized_off_the_event_loop_and_counted(server):
    from atomd.server import OFF_LOOP_CHARS

    text = "def f(x):\n    return x\n" * (OFF_LOOP_CHARS // 20)  # past OFF_LOOP_CHARS: a worker thread
    status, raw = http("POST", server.url + "/v1/completions", {"prompt": text, "max_tokens": 1})
    assert status == 400, raw[:300]  # tokenized and counted: more tokens than the model's context
    assert "input tokens=" in json.loads(raw)["error"]["message"]


@pytest.fixture(scope="module")
def consumer():
    srv = start_server(model_dir(), "--kv-role", "consumer")
    yield srv
    srv.stop()


@pytest.mark.parametrize("bad", [{"first_token_id": 10**9},
                                 {"first_token_id": 5, "first_token_logprobs": {"top": [[5, -0.1]]}}])
def test_a_producers_bad_params_fail_that_request_and_d_serves_on(consumer, bad):
    """#42: these crashed D's engine core (IndexError, KeyError) and the 502 carried its traceback."""
    baseline = consumer.stats()["num_free_blocks"]
    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 9, "transfer_id": "t" * 32,
              "remote_block_ids": [0], "num_prompt_tokens": 4, "access_token": "ab" * 16, **bad}
    status, raw = http("POST", consumer.url + "/v1/completions",
                       {"prompt": [11, 12, 13, 14], "max_tokens": 2, "kv_transfer_params": params})
    assert status == 400, raw[:300]
    assert "kv_transfer_params" in json.loads(raw)["error"]["message"] and b"Traceback" not in raw
    status, raw = http("GET", consumer.url + "/health")
    assert status == 200
    status, raw = http("POST", consumer.url + "/v1/completions", {"prompt": "def f(", "max_tokens": 4})
    assert status == 200, raw
    consumer.wait_idle(baseline)
