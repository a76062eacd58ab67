"""Bad input to `atomd serve`: an OpenAI-style error with the right status, and the server
keeps serving with its KV pool back at its baseline. Also the API key and engine death."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import threading
import time

import pytest

from launch.process import http
from tests.server_fixtures import MAX_MODEL_LEN, model_dir, start_server

pytestmark = pytest.mark.integration

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 8192
GOOD = {"prompt": "def main():", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("server") / "serve.log"


@pytest.fixture(scope="module")
def server(server_log):
    srv = start_server(model_dir(), "--api-key", KEY, "--max-request-body-bytes", str(BODY_LIMIT),
                       "--served-model-name", "atomd-test", log_path=server_log)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def baseline(server):
    return server.stats(AUTH)["num_free_blocks"]


def long_ids(n: int) -> list[int]:
    return [(7 * i + 3) % 200 + 10 for i in range(n)]


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **fields}


# (route, body, status, param) -- param None means "no single field to blame"
CASES = {
    "invalid_json": ("/v1/completions", b'{"prompt": "hi", ', 400, None),
    "not_an_object": ("/v1/completions", b'["hi"]', 400, None),
    "max_tokens_string": ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    "prompt_int": ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    "temperature_string": ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    "messages_string": ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    "missing_prompt": ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    "missing_messages": ("/v1/chat/completions", {"max_tokens": 3}, 400, "messages"),
    "empty_prompt": ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    # several prompts are served (tests/test_multi_prompt.py); one bad among them refuses all
    "prompt_batch_one_empty": ("/v1/completions", {"prompt": ["a", ""]}, 400, "prompt"),
    "prompt_batch_mixed": ("/v1/completions", {"prompt": ["a", [1, "b"]]}, 400, "prompt"),
    "token_out_of_vocab": ("/v1/completions", {"prompt": [1, 10 ** 9]}, 400, "prompt"),
    "max_tokens_zero": ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    "max_tokens_negative": ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    "max_completion_tokens_zero": ("/v1/chat/completions", chat(max_completion_tokens=0), 400,
                                   "max_completion_tokens"),
    "temperature_negative": ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    "top_p_zero": ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    "top_p_above_one": ("/v1/chat/completions", chat(top_p=1.5), 400, "top_p"),
    "min_tokens_above_max_tokens": ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, 400,
                                    "min_tokens"),
    "stop_empty_string": ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    "n_zero": ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    "best_of_below_n": ("/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of"),
    "best_of_streamed": ("/v1/completions", {"prompt": "hi", "n": 1, "best_of": 2, "stream": True}, 400, "best_of"),
    "best_of_above_max_num_seqs": ("/v1/completions", {"prompt": "hi", "best_of": 100}, 400, "best_of"),
    "unknown_field": ("/v1/completions", {"prompt": "hi", "temprature": 0.5}, 400, "temprature"),
    "unknown_nested_field": ("/v1/chat/completions", chat(stream=True, stream_options={"usage": True}), 400,
                             "stream_options.usage"),
    "unsupported_field": ("/v1/chat/completions", chat(functions=[{"name": "f"}]), 400, "functions"),
    "tool_without_function": ("/v1/chat/completions", chat(tools=[{"type": "function"}]), 400, "tools[0].function"),
    "unsupported_value": ("/v1/completions", {"prompt": "hi", "skip_special_tokens": False}, 400,
                          "skip_special_tokens"),
    "presence_penalty_too_big": ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, 400,
                                 "presence_penalty"),
    "frequency_penalty_too_small": ("/v1/chat/completions", chat(frequency_penalty=-3), 400, "frequency_penalty"),
    "repetition_penalty_zero": ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400,
                                "repetition_penalty"),
    "min_p_above_one": ("/v1/completions", {"prompt": "hi", "min_p": 1.5}, 400, "min_p"),
    "logit_bias_too_big": ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    "logit_bias_not_a_token": ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    "logit_bias_outside_vocab": ("/v1/chat/completions", chat(logit_bias={str(10 ** 7): -1}), 400, "logit_bias"),
    "allowed_token_ids_outside_vocab": ("/v1/completions", {"prompt": "hi", "allowed_token_ids": [5, 10 ** 7]},
                                        400, "allowed_token_ids"),
    "allowed_token_ids_empty": ("/v1/completions", {"prompt": "hi", "allowed_token_ids": []}, 400,
                                "allowed_token_ids"),
    "bad_words_empty": ("/v1/completions", {"prompt": "hi", "bad_words": [" "]}, 400, "bad_words"),
    "prompt_logprobs_too_many": ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    "logprobs_too_many": ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    "top_logprobs_without_logprobs": ("/v1/chat/completions", chat(top_logprobs=2), 400, "top_logprobs"),
    "kv_transfer_params_bad_port": ("/v1/completions", {"prompt": "hi", "kv_transfer_params": {"remote_port": 0}},
                                    400, "kv_transfer_params"),
    "kv_transfer_params_not_object": ("/v1/chat/completions", chat(kv_transfer_params=[1]), 400,
                                      "kv_transfer_params"),
    "unknown_model": ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, "model"),
    "empty_messages": ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    "unknown_role": ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
                     "messages[0].role"),
    "image_part": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]}, 400,
                   "messages[0].content[1]"),
    "message_without_role": ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400,
                             "messages[0].role"),
    # prompt + max_tokens past the context: a 400 (vLLM's choice), not a silent clamp
    "prompt_plus_max_tokens_too_long": ("/v1/completions",
                                        {"prompt": long_ids(MAX_MODEL_LEN - 10), "max_tokens": 20}, 400,
                                        "max_tokens"),
    "oversized_body": ("/v1/completions", {"prompt": "x" * (2 * BODY_LIMIT)}, 413, None),
}


def assert_openai_error(status: int, body: bytes, want_status: int, want_param: str | None) -> dict:
    assert status == want_status, body
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == want_param
    if want_status == 400:  # every 400 says which kind of mistake, and names the field when there is one
        assert isinstance(err["code"], str) and err["code"], err
    return err


def assert_still_serving(server, baseline: int) -> None:
    status, body = http("POST", server.url + "/v1/completions", GOOD, AUTH)
    assert status == 200, body
    assert json.loads(body)["usage"]["completion_tokens"] == 4
    server.wait_idle(baseline, AUTH)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_request_is_answered_and_leaks_nothing(server, baseline, case):
    route, body, want_status, want_param = CASES[case]
    status, resp = http("POST", server.url + route, body, AUTH)
    assert_openai_error(status, resp, want_status, want_param)
    assert_still_serving(server, baseline)


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_longer_than_max_model_len_gets_the_schedulers_message(server, baseline, stream):
    body = {"prompt": long_ids(MAX_MODEL_LEN + 20), "max_tokens": 4, "stream": stream}
    status, resp = http("POST", server.url + "/v1/completions", body, AUTH)
    err = assert_openai_error(status, resp, 400, "prompt")
    assert err["code"] == "unschedulable" and err["message"].startswith("unschedulable")
    assert f"max_model_len={MAX_MODEL_LEN}" in err["message"]
    assert_still_serving(server, baseline)


def test_unknown_route_is_a_json_404(server, baseline):
    status, resp = http("GET", server.url + "/v1/nothing", headers=AUTH)
    assert_openai_error(status, resp, 404, None)


def test_api_key_required_except_on_health(server, baseline):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, resp = http("POST", server.url + "/v1/completions", GOOD, headers)
        err = assert_openai_error(status, resp, 401, None)
        assert err["type"] == "authentication_error"
    assert http("GET", server.url + "/health")[0] == 200
    assert http("GET", server.url + "/ready")[0] == 200
    assert http("GET", server.url + "/v1/models")[0] == 401
    assert_still_serving(server, baseline)


def access_lines(log: pathlib.Path) -> list[dict]:
    lines = [line for line in log.read_text().splitlines() if line.startswith("{")]
    return [json.loads(line) for line in lines]


def test_access_log_has_one_json_line_per_request(server, baseline, server_log):
    headers = dict(AUTH, **{"X-Request-Id": "req-abc-123"})
    status, _ = http("POST", server.url + "/v1/completions", {"prompt": "hi", "top_p": 7}, headers)
    assert status == 400
    status, _ = http("POST", server.url + "/v1/completions", dict(GOOD, stream=True),
                     dict(AUTH, **{"X-Request-Id": "req-abc-456"}))
    assert status == 200
    deadline = time.monotonic() + 10
    while not {"req-abc-123", "req-abc-456"} <= {e["request_id"] for e in access_lines(server_log)}:
        assert time.monotonic() < deadline, server_log.read_text()[-2000:]
        time.sleep(0.05)
    by_id = {e["request_id"]: e for e in access_lines(server_log)}
    bad, streamed = by_id["req-abc-123"], by_id["req-abc-456"]
    assert (bad["method"], bad["path"], bad["status"]) == ("POST", "/v1/completions", 400)
    assert streamed["status"] == 200 and streamed["latency_s"] > 0
    assert {"ts", "method", "path", "status", "latency_s", "request_id"} <= set(bad)
    # Probes (the fixture polled /ready; a router asks every few seconds) stay out of it.
    assert all(http("GET", server.url + path)[0] == 200 for path in ("/health", "/metrics"))
    assert not {"/health", "/ready", "/metrics"} & {e["path"] for e in access_lines(server_log)}


def test_openai_client_maps_errors(server, baseline):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="atomd-test", prompt="hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()
    assert_still_serving(server, baseline)


def test_engine_death_gives_503_and_fails_ready():
    srv = start_server(model_dir())
    try:
        # A long stream in flight when the engine dies must end, not hang.
        result = {}

        def stream_in_flight():
            body = {"prompt": "import os", "max_tokens": 200, "ignore_eos": True, "stream": True}
            result["status"], result["body"] = http("POST", srv.url + "/v1/completions", body, timeout=60)

        t = threading.Thread(target=stream_in_flight)
        t.start()
        os.kill(srv.engine_pid(), signal.SIGKILL)
        t.join(60)
        assert not t.is_alive()
        if result["status"] == 200:  # headers went out before the death: an SSE error event ends it
            assert result["body"].endswith(b'"code":"engine_dead"}}\n\ndata: [DONE]\n\n')
        else:
            assert result["status"] == 503
        status, resp = http("POST", srv.url + "/v1/completions", GOOD)
        assert_openai_error(status, resp, 503, None)
        assert http("GET", srv.url + "/ready")[0] == 503
        assert http("GET", srv.url + "/health")[0] == 503
        assert srv.proc.poll() is None  # the API process itself keeps answering
    finally:
        srv.stop()


@pytest.mark.parametrize("flags,logged", [
    ((), {"/v1/completions"}),
    (("--access-log-probes",), {"/v1/completions", "/health", "/ready", "/metrics"}),
    (("--disable-access-log",), set()),
    (("--disable-uvicorn-access-log",), set()),  # vLLM's name
])
def test_access_log_flags(flags, logged, caplog):
    """Which requests the access log keeps: all but the probes by default."""
    import argparse
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from atomd.config import EngineConfig
    from atomd.api.serve import add_arguments
    from atomd.api.server import Server

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(list(flags))
    server = Server(EngineConfig.from_args(args), args)

    async def handler(request):
        return web.Response(text="ok")

    async def requests():
        for method, path in (("POST", "/v1/completions"), ("GET", "/health"), ("GET", "/ready"),
                             ("GET", "/metrics")):
            await server.access_log(make_mocked_request(method, path), handler)

    with caplog.at_level("INFO", logger="atomd.access"):
        asyncio.run(requests())
    assert {json.loads(r.getMessage())["path"] for r in caplog.records if r.name == "atomd.access"} == logged
