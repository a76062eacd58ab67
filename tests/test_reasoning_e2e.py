"""Issue 34 end to end: reasoning output, the llama3_json and hermes tool parsers and chat
templates through real `atomd serve` processes (built-in default model), read with the
official `openai` client (reasoning_content is an extra field: `model_extra`).

The model's raw text is the reference: the same seeded request on /v1/completions, with the
prompt ids rendered by Hugging Face transformers from the same template and kwargs, gives
the text the chat answer was parsed from; a grammar (guided_regex) makes that text contain
`<think>...</think>` and calls, and `re.fullmatch` of the regex's groups says what the split
must be. The prompt a chat request really got is read back from its `prompt_logprobs` and
compared to transformers' rendering. After every test the engines are idle with their whole
pool free (no block leaked by a refused request)."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import transformers

from launch.process import http
from tests.server_fixtures import ServerUnderTest, model_dir
from tests.test_chat_templates import TEMPLATE

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

NAME = "atomd-default"
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 9}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two digits.", "parameters": ADD,
                                           "strict": False}}]
THINK = r"<think>([a-z]{3,8}(?: [a-z]{3,8}){0,3})</think>"
OTHER_TEMPLATE = ("{{ bos_token }}<|system|>\n{{ style | default('plain') }}<|end|>\n"
                  "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                  "<|assistant|>\n")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """qwen3 + llama3_json + a --chat-template file (requests may bring their own), and
    deepseek_r1 + hermes on the checkpoint's template."""
    path = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    path.write_text(TEMPLATE)
    servers = []
    try:  # both load at once
        servers.append(ServerUnderTest(model_dir(), "--served-model-name", NAME, "--reasoning-parser", "qwen3",
                                       "--tool-call-parser", "llama3_json", "--chat-template", str(path),
                                       "--trust-request-chat-template", "--max-chat-template-chars", "4096"))
        servers.append(ServerUnderTest(model_dir(), "--served-model-name", NAME, "--reasoning-parser", "deepseek_r1",
                                       "--max-model-len", "768"))  # a prompt with tools is ~200 tokens
        for srv in servers:
            srv.wait_ready()
    except BaseException:
        for srv in servers:
            srv.stop()
        raise
    qwen, r1 = servers
    free = {name: srv.stats()["num_free_blocks"] for name, srv in (("qwen", qwen), ("r1", r1))}
    yield {"qwen": qwen, "r1": r1, "free": free}
    qwen.stop()
    r1.stop()


@pytest.fixture(autouse=True)
def settled(servers):
    yield
    for name in ("qwen", "r1"):
        servers[name].wait_idle(servers["free"][name])


@pytest.fixture(scope="module")
def hf():
    return transformers.AutoTokenizer.from_pretrained(model_dir())


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def reference_ids(hf, template: str | None = None, tools=None, **kwargs) -> list[int]:
    text = hf.apply_chat_template(MESSAGES, chat_template=template, tools=tools, add_generation_prompt=True,
                                  tokenize=False, **kwargs)
    return hf(text, add_special_tokens=False).input_ids


def raw_text(srv, prompt_ids: list[int], **params) -> str:
    """What the model writes for these prompt ids: /v1/completions parses nothing."""
    status, body = http("POST", srv.url + "/v1/completions", {"prompt": prompt_ids, **params})
    assert status == 200, body
    return json.loads(body)["choices"][0]["text"]


def chat(srv, stream: bool, **kw):
    """(reasoning, content, tool calls as (name, arguments), finish_reason) of one chat
    answer, through the openai client; streamed deltas are joined."""
    extra = {k: kw.pop(k) for k in ("guided_regex", "chat_template", "chat_template_kwargs", "prompt_logprobs")
             if k in kw}
    resp = client(srv).chat.completions.create(model=NAME, messages=MESSAGES, stream=stream, extra_body=extra, **kw)
    if not stream:
        choice = resp.choices[0]
        msg = choice.message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]
        return (msg.model_extra.get("reasoning_content"), msg.content, calls, choice.finish_reason)
    reasoning = content = ""
    calls: dict[int, list] = {}
    reason = None
    for chunk in resp:
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                entry = calls.setdefault(tc.index, [None, ""])
                entry[0] = tc.function.name or entry[0]
                entry[1] += tc.function.arguments or ""
            reason = choice.finish_reason or reason
    return (reasoning or None, content or None, [(n, json.loads(a)) for n, a in calls.values()], reason)


@pytest.mark.parametrize("seed", [0, 1])
def test_qwen3_reasoning_and_content_equal_the_models_text(servers, hf, seed):
    srv = servers["qwen"]
    regex = THINK + r"\n\n([A-Z][a-z]{2,8}(?: [a-z]{2,8}){0,3}\.)"
    params = dict(temperature=1.0, seed=seed, max_tokens=120)
    raw = raw_text(srv, reference_ids(hf, TEMPLATE), guided_regex=regex, **params)
    match = re.fullmatch(regex, raw)
    assert match, raw
    want = (match[1], "\n\n" + match[2], [], "stop")
    assert chat(srv, False, guided_regex=regex, **params) == want
    assert chat(srv, True, guided_regex=regex, **params) == want


def test_qwen3_output_without_the_tag_is_all_content(servers, hf):
    srv = servers["qwen"]
    raw = raw_text(srv, reference_ids(hf, TEMPLATE), temperature=0.0, max_tokens=24)
    assert not raw.lstrip().startswith("<think>")
    for stream in (False, True):
        reasoning, content, calls, _ = chat(srv, stream, temperature=0.0, max_tokens=24)
        assert reasoning is None and content == (raw or None) and calls == []


def test_reasoning_then_a_llama3_json_call(servers, hf):
    srv = servers["qwen"]
    regex = THINK + r'\{"name": "add", "parameters": \{"a": ([0-9]), "b": ([0-9])\}\}'
    params = dict(temperature=1.0, seed=5, max_tokens=120)
    raw = raw_text(srv, reference_ids(hf, TEMPLATE, tools=TOOLS), guided_regex=regex, **params)
    match = re.fullmatch(regex, raw)
    assert match, raw
    want = (match[1], None, [("add", {"a": int(match[2]), "b": int(match[3])})], "tool_calls")
    for stream in (False, True):
        assert chat(srv, stream, tools=TOOLS, guided_regex=regex, **params) == want


def test_forced_llama3_json_calls_validate(servers):
    srv = servers["qwen"]
    for tool_choice in ({"type": "function", "function": {"name": "add"}}, "required"):
        answers = [chat(srv, stream, tools=TOOLS, tool_choice=tool_choice, temperature=1.0, seed=2, max_tokens=120)
                   for stream in (False, True)]
        assert answers[0] == answers[1]
        reasoning, content, calls, reason = answers[0]
        assert reasoning is None and content is None and reason == "tool_calls" and calls
        for name, arguments in calls:
            assert name == "add"
            jsonschema.validate(arguments, ADD)
    status, raw = http("POST", srv.url + "/v1/chat/completions", {
        "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 120})
    assert status == 200 and json.loads(raw)["choices"][0]["message"]["reasoning_content"] is None  # present, null


def test_deepseek_r1_output_starts_in_reasoning(servers, hf):
    srv = servers["r1"]
    raw = raw_text(srv, reference_ids(hf), temperature=0.0, max_tokens=24)
    assert raw and "</think>" not in raw
    for stream in (False, True):
        assert chat(srv, stream, temperature=0.0, max_tokens=24) == (raw, None, [], "length")


def test_deepseek_r1_reasoning_then_a_hermes_call(servers, hf):
    srv = servers["r1"]
    regex = THINK + r'\n<tool_call>\n\{"name": "add", "arguments": \{"a": ([0-9]), "b": ([0-9])\}\}\n</tool_call>'
    params = dict(temperature=1.0, seed=7, max_tokens=120)
    raw = raw_text(srv, reference_ids(hf, tools=TOOLS), guided_regex=regex, **params)
    match = re.fullmatch(regex, raw)
    assert match, raw
    want = (match[1], None, [("add", {"a": int(match[2]), "b": int(match[3])})], "tool_calls")
    for stream in (False, True):
        assert chat(srv, stream, tools=TOOLS, guided_regex=regex, **params) == want


def test_qwen3_output_starts_in_reasoning_when_the_template_opened_think(servers, hf):
    """A template that ends its generation prompt with `<think>` (Qwen3-Thinking-2507's)."""
    srv = servers["qwen"]
    opening = OTHER_TEMPLATE + "<think>\n"
    raw = raw_text(srv, reference_ids(hf, opening), temperature=0.0, max_tokens=24)
    assert raw and "</think>" not in raw
    for stream in (False, True):
        assert chat(srv, stream, chat_template=opening, temperature=0.0, max_tokens=24) == (raw, None, [], "length")


def prompt_ids_seen(srv, **kw) -> list[int]:
    """The prompt a chat request was rendered to, read back from its prompt_logprobs (the
    first token has none)."""
    resp = client(srv).chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=1, extra_body={
        "prompt_logprobs": 0, **kw})
    entries = resp.model_extra["prompt_logprobs"]
    assert entries[0] is None and all(len(e) == 1 for e in entries[1:])
    return [int(next(iter(e))) for e in entries[1:]]


def test_templates_and_kwargs_reach_the_prompt(servers, hf):
    srv = servers["qwen"]
    assert prompt_ids_seen(srv) == reference_ids(hf, TEMPLATE)[1:]  # --chat-template's
    kwargs = {"enable_thinking": False, "persona": "terse"}
    assert prompt_ids_seen(srv, chat_template_kwargs=kwargs) == reference_ids(hf, TEMPLATE, **kwargs)[1:]
    assert prompt_ids_seen(srv, chat_template=OTHER_TEMPLATE, chat_template_kwargs={"style": "json"}) == \
        reference_ids(hf, OTHER_TEMPLATE, style="json")[1:]
    # Qwen3's enable_thinking: false closes the think block in the prompt, so the output is content
    reasoning, content, _, _ = chat(srv, False, chat_template_kwargs={"enable_thinking": False},
                                    temperature=0.0, max_tokens=8)
    assert reasoning is None and content
    assert prompt_ids_seen(servers["r1"], chat_template_kwargs={"x": 1}) == reference_ids(hf, x=1)[1:]


BAD = [("qwen", {"chat_template": "{% for m in messages %}"}, "chat_template", "does not compile"),
       ("qwen", {"chat_template": "{{ raise_exception('no user turn') }}"}, "chat_template", "no user turn"),
       ("qwen", {"chat_template": "{{ bos_token }}" + " " * 5000}, "chat_template", "--max-chat-template-chars"),
       ("qwen", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "'messages'"),
       ("qwen", {"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs", "object"),
       ("r1", {"chat_template": OTHER_TEMPLATE}, "chat_template", "--trust-request-chat-template"),
       ("r1", {"prompt": "x", "chat_template_kwargs": {"a": 1}}, "chat_template_kwargs", "not supported")]


@pytest.mark.parametrize("which, body, param, words", BAD)
def test_bad_templates_are_400s_and_the_server_keeps_serving(servers, which, body, param, words):
    srv = servers[which]
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    status, raw = http("POST", srv.url + path, {"messages": MESSAGES, "max_tokens": 2, **body}
                       if "prompt" not in body else {"max_tokens": 2, **body})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == param and words in error["message"], raw
    assert error["type"] == "invalid_request_error"
    reasoning, content, _, reason = chat(srv, False, max_tokens=2, temperature=0.0)  # still serving
    assert reason == "length" and (reasoning or content)
