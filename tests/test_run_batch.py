"""`atomd run-batch` (issue 40): an OpenAI batch file through an in-process engine. Each
answered line equals what `atomd serve` with the same flags answers to the same body
(greedy), its body parses as the official `openai` client's type for that endpoint, and bad
lines (not JSON, an unknown url, a stream, a refused request) get their error without
stopping the file; the output keeps the input's order."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import openai.types
import openai.types.chat
import openai.types.responses
import pytest

from launch.process import http
from tests.server_fixtures import ENGINE_ARGS, REPO, model_dir, start_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

FLAGS = [*ENGINE_ARGS, "--task", "embed"]
LINES = [
    {"custom_id": "cmpl", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": ["def f(x):", "import os\n"], "max_tokens": 6, "temperature": 0}},
    "this line is not JSON",
    {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0}},
    {"custom_id": "embd", "method": "POST", "url": "/v1/embeddings", "body": {"input": ["hello", "world"]}},
    {"custom_id": "resp", "method": "POST", "url": "/v1/responses",
     "body": {"input": "def f(x):", "max_output_tokens": 5, "temperature": 0}},
    {"custom_id": "bad", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": -1}},
    {"custom_id": "url", "method": "POST", "url": "/v1/nope", "body": {}},
    {"custom_id": "stream", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "stream": True}},
]
TYPES = {"/v1/completions": openai.types.Completion, "/v1/chat/completions": openai.types.chat.ChatCompletion,
         "/v1/embeddings": openai.types.CreateEmbeddingResponse, "/v1/responses": openai.types.responses.Response}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("batch")
    (d / "in.jsonl").write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in LINES))
    proc = subprocess.run([sys.executable, "-m", "atomd", "run-batch", "-i", str(d / "in.jsonl"), "-o",
                           str(d / "out.jsonl"), "--model", str(model_dir()), *FLAGS], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "8 lines, 4 with an error" in proc.stderr and "run-batch" in proc.stderr  # the summary, the bar
    return [json.loads(t) for t in (d / "out.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def server():
    srv = start_server(model_dir(), "--task", "embed")
    yield srv
    srv.stop()


def strip(body: dict) -> dict:
    """An answer without what differs between two runs (ids, times)."""
    body = {k: v for k, v in body.items() if k not in ("id", "created", "created_at", "request_id")}
    if "output" in body:
        body["output"] = [{k: v for k, v in item.items() if k != "id"} for item in body["output"]]
    return body


def test_each_line_is_answered_as_the_server_answers_it(outputs, server):
    assert [o["custom_id"] for o in outputs] == [x["custom_id"] if isinstance(x, dict) else None for x in LINES]
    for line, out in zip(LINES, outputs):
        if not isinstance(line, dict) or line["custom_id"] in ("url", "stream", "bad"):
            continue
        assert out["error"] is None and out["response"]["status_code"] == 200, out
        body = out["response"]["body"]
        TYPES[line["url"]].model_validate(body)
        status, raw = http("POST", server.url + line["url"], line["body"])
        assert status == 200, raw
        want = json.loads(raw)
        if line["url"] == "/v1/embeddings":
            for got_item, want_item in zip(body["data"], want["data"]):
                np.testing.assert_allclose(got_item["embedding"], want_item["embedding"], rtol=1e-5, atol=1e-6)
            assert body["usage"] == want["usage"]
        else:
            assert strip(body) == strip(want)


def test_bad_lines_get_errors_and_the_file_goes_on(outputs):
    by_id = {o["custom_id"]: o for o in outputs}
    not_json = outputs[1]
    assert not_json["response"] is None and not_json["error"]["code"] == "invalid_line"
    assert by_id["url"]["error"]["code"] == "invalid_line" and "url must be one of" in by_id["url"]["error"]["message"]
    assert by_id["stream"]["error"]["code"] == "invalid_line"
    bad = by_id["bad"]
    assert bad["response"]["status_code"] == 400 and bad["error"]["code"] == "invalid_value"
    assert bad["response"]["body"]["error"]["param"] == "max_tokens"
    assert all(o["id"].startswith("batch_req_") for o in outputs)


def test_a_missing_input_file_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "atomd", "run-batch", "-i", str(tmp_path / "nope.jsonl"), "-o",
                           str(tmp_path / "out.jsonl")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "nope.jsonl" in proc.stderr and "Traceback" not in proc.stderr
