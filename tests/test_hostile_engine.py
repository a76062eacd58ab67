"""Hostile clients against one engine (issue 42, the engine's findings), each with the
probe's input scaled to seconds: the attacked engine keeps serving (/health 200, a normal
request after succeeds, the KV pool back at its baseline), the bad request gets a 4xx
naming its field and limit, and no body carries a traceback or a path.

The server is a consumer (D) with the KV secret and an API key, as in the probe."""
from __future__ import annotations

import json
import threading
import time

import pytest

from kv_transfer.params import KVTransferParams
from kv_transfer.trust import sign
from launch.process import http
from tests.server_fixtures import model_dir, start_server

pytestmark = pytest.mark.integration

KEY = "sk-hostile"
AUTH = {"Authorization": f"Bearer {KEY}"}
SECRET = "hostile-secret"
GOOD = {"prompt": "def main():", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    key = tmp_path_factory.mktemp("secret") / "key"
    key.write_text(SECRET)
    srv = start_server(model_dir(), "--api-key", KEY, "--kv-role", "consumer", "--kv-params-secret-file", str(key))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def baseline(server):
    return server.stats(AUTH)["num_free_blocks"]


def assert_clean(body: bytes) -> None:
    text = body.decode(errors="replace")
    assert "Traceback" not in text and 'File "' not in text and "/atomd/" not in text and ".py" not in text, text


def refused(server, body, status: int = 400, param: str | None = None, route: str = "/v1/completions",
            headers: dict | None = None) -> str:
    got, resp = http("POST", server.url + route, body, headers or AUTH)
    assert got == status, resp
    assert_clean(resp)
    err = json.loads(resp)["error"]
    if param is not None:
        assert err["param"] == param, err
    return err["message"]


def assert_still_serving(server, baseline: int) -> None:
    assert http("GET", server.url + "/health")[0] == 200
    status, body = http("POST", server.url + "/v1/completions", GOOD, AUTH)
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] == 4
    server.wait_idle(baseline, AUTH)


def remote_params(**changes) -> dict:
    """What the router forwards to D for a 3-token prompt, signed with the shared secret."""
    p = KVTransferParams(do_remote_prefill=True, transfer_id="t" * 32, remote_host="127.0.0.1", remote_port=9,
                         remote_block_ids=[0], num_prompt_tokens=3, first_token_id=5, access_token="a" * 32)
    return sign(KVTransferParams.from_json_obj({**p.to_json_obj(), **changes}), SECRET.encode()).to_json_obj()


def test_a_non_ascii_signature_is_a_403_and_the_core_lives(server, baseline):
    """Finding 1: hmac.compare_digest raised TypeError on "é" and D's core died for good."""
    msg = refused(server, {"prompt": [1, 2, 3], "max_tokens": 2,
                           "kv_transfer_params": dict(remote_params(), signature="é")}, 403)
    assert "signature" in msg
    assert_still_serving(server, baseline)


@pytest.mark.parametrize("changes", [{"first_token_id": 10**9}, {"draft_token_ids": [10**9]},
                                     {"first_token_logprobs": {"logprob": 0.0, "top": [[10**9, 0.0]]}}])
def test_a_producers_token_ids_outside_the_vocabulary_are_a_400(server, baseline, changes):
    """Finding 8: a first_token_id of 10^9 crashed D's scheduler with IndexError."""
    msg = refused(server, {"prompt": [1, 2, 3], "max_tokens": 2, "kv_transfer_params": remote_params(**changes)})
    assert "outside the vocabulary" in msg
    assert_still_serving(server, baseline)


def test_a_producers_malformed_logprobs_are_a_400(server, baseline):
    """Finding 8: a bad first_token_logprobs crashed D's scheduler with KeyError."""
    msg = refused(server, {"prompt": [1, 2, 3], "max_tokens": 2,
                           "kv_transfer_params": dict(remote_params(), first_token_logprobs={"top": []})},
                  param="kv_transfer_params")
    assert "first_token_logprobs" in msg
    assert_still_serving(server, baseline)


@pytest.mark.parametrize("route,body,param,flag", [
    ("/v1/completions", {"prompt": "x", "guided_json": "[" * 5000 + "]" * 5000}, "guided_json", "max-json-depth"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [7] * 150_000}, "stop_token_ids", "max-list-items"),
    ("/v1/completions", {"prompt": "x", "bad_words": ["w"] * 50_000}, "bad_words", "max-list-items"),
    ("/v1/completions", {"prompt": "x", "guided_choice": [f"c{i}" for i in range(100_000)]}, "guided_choice",
     "max-list-items"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "guided_regex": "a" * 100_000}, "guided_regex", "max-grammar-bytes"),
    ("/v1/completions", {"prompt": "x" * 1_100_000}, "prompt", "max-prompt-chars"),
])
def test_oversized_requests_are_a_400_naming_the_limit(server, baseline, route, body, param, flag):
    """Findings 2, 5, 6, 11: deep JSON, huge lists, grammars and prompts."""
    assert flag in refused(server, body, param=param, route=route)
    assert_still_serving(server, baseline)


def test_a_non_utf8_authorization_header_is_a_401(server, baseline):
    """Finding 12: it was a 500 (the header did not encode back to bytes)."""
    refused(server, GOOD, 401, headers={"Authorization": "Bearer \xff\xfe"})
    assert_still_serving(server, baseline)


def test_error_bodies_do_not_echo_oversized_input(server, baseline):
    got, resp = http("POST", server.url + "/v1/chat/completions",
                     {"messages": [{"role": "r" * 200_000, "content": "x"}]}, AUTH)
    assert got == 400 and len(resp) < 4096
    assert_still_serving(server, baseline)


def test_a_large_prompt_does_not_stall_the_event_loop(server, baseline):
    """Finding 5: a 15 MB prompt blocked the HTTP event loop (health 28.9 s). A prompt just
    under the limit is now parsed and tokenized on a parser thread without the GIL: /health
    answers many times while it is tokenized, each far faster than the attack takes."""
    body = {"prompt": "hello world, this is text " * 40_000, "max_tokens": 1}  # ~1 MB, > max_model_len
    status, attack_s = [], []

    def attack():
        t0 = time.perf_counter()
        status.append(http("POST", server.url + "/v1/completions", body, AUTH)[0])
        attack_s.append(time.perf_counter() - t0)

    thread = threading.Thread(target=attack)
    thread.start()
    health = []
    while thread.is_alive():
        t0 = time.perf_counter()
        assert http("GET", server.url + "/health")[0] == 200
        health.append(time.perf_counter() - t0)
    thread.join()
    assert status == [400]  # longer than max_model_len: the scheduler's refusal
    assert len(health) >= 3 and max(health) < attack_s[0] / 3, (max(health), attack_s[0], len(health))
    assert_still_serving(server, baseline)
