"""Issue 22 end to end: structured outputs and tool calls against real `atomd serve`
processes on 127.0.0.1 with the built-in default model, colocated and through PD (router ->
P -> D; P samples T0 under the grammar, D replays it into its matcher), through the
official `openai` client where it has the API. References: `jsonschema`, pydantic (the
client's `parse`), `re.fullmatch`, `json`. After every test each engine is idle with its
whole pool free and P has nothing pinned."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest

from launch.process import http
from tests.pd_fixtures import ref_and_pd, sse_events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

RECORD = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "level": {"enum": ["low", "mid", "high"]},
    "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
    "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}},
              "required": ["id"], "additionalProperties": False}},
    "required": ["name", "level", "scores", "owner"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["a", "b"], "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
EMAIL = r"[a-z]{3,10}@[a-z]{3,8}\.(com|org|net)"
THINK = r"<think>[a-z]{2,8}( [a-z]{2,8}){0,2}</think>[A-Z][a-z]{2,8}\."


@pytest.fixture(scope="module")
def pd():
    # a prompt with tools is ~200 tokens; reasoning parsed (issue 34) on every engine, D included
    with ref_and_pd("--max-model-len", "768", "--reasoning-parser", "qwen3") as cluster:
        cluster.name = str(cluster.model)  # the served model name
        yield cluster


@pytest.fixture(autouse=True)
def settled(pd):
    yield
    pd.assert_settled()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def post(url: str, body: dict, path: str = "/v1/completions"):
    status, raw = http("POST", url + path, body)
    assert status == 200, raw
    return sse_events(raw) if body.get("stream") else json.loads(raw)


def chat(**kw) -> dict:
    return {"messages": MESSAGES, "max_tokens": 200, "temperature": 1.0, "seed": 3, **kw}


def test_response_format_json_schema_through_the_openai_client(pd):
    c = client(pd["ref"].url)
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD, "strict": True}}
    for seed in range(4):
        resp = c.chat.completions.create(model=pd.name, messages=MESSAGES, response_format=fmt, seed=seed,
                                         temperature=1.0, max_tokens=200)
        assert resp.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(resp.choices[0].message.content), RECORD)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=pd.name, messages=MESSAGES, response_format=fmt, seed=0, temperature=1.0, max_tokens=200,
        stream=True) if ch.choices)
    whole = c.chat.completions.create(model=pd.name, messages=MESSAGES, response_format=fmt, seed=0,
                                      temperature=1.0, max_tokens=200)
    assert streamed == whole.choices[0].message.content

    class Owner(pydantic.BaseModel):
        id: pydantic.conint(ge=1, le=999)

    class Record(pydantic.BaseModel):  # the client builds the strict schema and parses the answer
        name: pydantic.constr(max_length=12)
        level: str = pydantic.Field(json_schema_extra={"enum": ["low", "mid", "high"]})
        owner: Owner

    parsed = c.chat.completions.parse(model=pd.name, messages=MESSAGES, response_format=Record, seed=5,
                                      temperature=1.0, max_tokens=200)
    record = parsed.choices[0].message.parsed
    assert isinstance(record, Record) and record.level in ("low", "mid", "high") and 1 <= record.owner.id <= 999


def test_every_request_form_constrains_the_output(pd):
    url = pd["ref"].url
    forms = [({"response_format": {"type": "json_object"}}, "object"),
             ({"structured_outputs": {"json": RECORD}}, RECORD), ({"guided_json": json.dumps(RECORD)}, RECORD),
             ({"structured_outputs": {"regex": EMAIL}}, EMAIL), ({"guided_regex": EMAIL}, EMAIL),
             ({"structured_outputs": {"choice": ["red", "green"]}}, ["red", "green"]),
             ({"guided_choice": ["up", "down"]}, ["up", "down"]),
             ({"structured_outputs": {"grammar": 'start: "n=" /[0-9]{1,2}/'}}, r"n=[0-9]{1,2}"),
             ({"guided_grammar": 'root ::= "v" [0-9] [0-9]'}, r"v[0-9][0-9]")]  # GBNF converted
    for fields, want in forms:
        for path, body in (("/v1/completions", {"prompt": "import json\n"}), ("/v1/chat/completions",
                                                                               {"messages": MESSAGES})):
            resp = post(url, {**body, "max_tokens": 300, "temperature": 1.0, "seed": 11, **fields}, path)
            choice = resp["choices"][0]
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            if want == "object":
                assert choice["finish_reason"] == "length" or isinstance(json.loads(text), dict), text
            elif isinstance(want, dict):
                jsonschema.validate(json.loads(text), want)
            elif isinstance(want, list):
                assert text in want
            else:
                assert re.fullmatch(want, text), text


@pytest.mark.parametrize("body, param", [
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}),
     "response_format.json_schema.schema"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format.json_schema.schema"),
    (chat(response_format={"type": "xml"}), "response_format.type"),
    (chat(guided_regex="[a-z"), "guided_regex"),
    (chat(guided_json='{"type": '), "guided_json"),
    (chat(structured_outputs={"regex": "(", "json": {}}), "structured_outputs"),
    (chat(structured_outputs={"choice": []}), "structured_outputs.choice"),
    (chat(structured_outputs={"grammar": "start: a"}), "structured_outputs.grammar"),
    (chat(structured_outputs={"jsn": {}}), "structured_outputs.jsn"),
    (chat(guided_regex="a", guided_choice=["a"]), "guided_choice"),
    (chat(guided_regex="a+", ignore_eos=True), "ignore_eos"),
    (chat(tool_choice="required"), "tool_choice"),
    (chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
          tool_choice="required"), "tools[0].function.parameters"),
    (chat(tools=TOOLS, tool_choice="required", guided_regex="a"), "guided_regex"),
    (chat(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    ({"prompt": "x", "tools": TOOLS}, "tools"),  # completions have no tools
])
def test_bad_grammars_and_combinations_are_400s_naming_the_field(pd, body, param):
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    for url in (pd["ref"].url, pd.router.url):
        status, raw = http("POST", url + path, body)
        assert status == 400, raw
        assert json.loads(raw)["error"]["param"] == param, raw
    post(pd["ref"].url, {"prompt": "x", "max_tokens": 2, "guided_choice": ["ok"]})  # still serving


def test_named_and_required_tool_calls_through_the_openai_client(pd):
    c = client(pd["ref"].url)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice, parallel in ((named, None), ("required", False)):
        for seed in range(3):
            kw = {"parallel_tool_calls": parallel} if parallel is not None else {}
            resp = c.chat.completions.create(model=pd.name, messages=MESSAGES, tools=TOOLS,
                                             tool_choice=tool_choice, seed=seed, temperature=1.0, max_tokens=200, **kw)
            choice = resp.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            (call,) = choice.message.tool_calls
            assert call.type == "function" and call.id.startswith("call_")
            if tool_choice is named:
                assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    # streamed: the deltas reassemble to the same call
    whole = c.chat.completions.create(model=pd.name, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                      seed=1, temperature=1.0, max_tokens=200).choices[0].message.tool_calls[0]
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in c.chat.completions.create(model=pd.name, messages=MESSAGES, tools=TOOLS, tool_choice=named,
                                           seed=1, temperature=1.0, max_tokens=200, stream=True):
        delta = chunk.choices[0].delta
        reasons.append(chunk.choices[0].finish_reason)
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = tc.id or entry["id"]
            entry["name"] += (tc.function.name or "") if tc.function else ""
            entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
    assert list(calls) == [0] and reasons[-1] == "tool_calls"
    assert (calls[0]["name"], calls[0]["arguments"]) == (whole.function.name, whole.function.arguments)
    assert calls[0]["id"].startswith("call_")


def test_auto_tools_are_in_the_prompt_and_history_is_accepted(pd):
    c = client(pd["ref"].url)
    plain = c.chat.completions.create(model=pd.name, messages=MESSAGES, max_tokens=8, temperature=0)
    auto = c.chat.completions.create(model=pd.name, messages=MESSAGES, tools=TOOLS, max_tokens=8,
                                     temperature=0)
    none = c.chat.completions.create(model=pd.name, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                     max_tokens=8, temperature=0)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens == none.usage.prompt_tokens
    assert auto.choices[0].message.tool_calls is None  # this model does not call tools on its own
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    answer = c.chat.completions.create(model=pd.name, messages=history, tools=TOOLS, max_tokens=8,
                                       temperature=0)
    assert answer.usage.prompt_tokens > auto.usage.prompt_tokens


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", chat(response_format={"type": "json_schema",
                                                   "json_schema": {"name": "r", "schema": RECORD}})),
    ("/v1/completions", {"prompt": "email: ", "max_tokens": 40, "temperature": 1.0, "seed": 4, "guided_regex": EMAIL,
                         "logprobs": 1}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 200, "temperature": 1.0, "seed": 9, "n": 3,
                         "structured_outputs": {"json": RECORD}}),
    ("/v1/chat/completions", chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})),
    ("/v1/chat/completions", chat(guided_regex=THINK)),  # reasoning parsed on D, T0 (P's) included
])
def test_pd_answers_equal_colocated_token_for_token(pd, path, body):
    for stream in (False, True):
        b = dict(body, stream=stream) if stream and body.get("n", 1) == 1 else body
        ref, routed = post(pd["ref"].url, b, path), post(pd.router.url, b, path)
        if b.get("stream"):  # chunk boundaries differ (D's first output carries T0 and T1): join them
            def joined(events):
                text, reasoning, calls = "", "", []
                for e in events:
                    for ch in e["choices"]:
                        d = ch.get("delta", {})
                        text += ch.get("text", "") + (d.get("content") or "")
                        reasoning += d.get("reasoning_content") or ""
                        calls += [{k: v for k, v in tc.items() if k != "id"} for tc in d.get("tool_calls") or []]
                return text, reasoning, calls, [ch["finish_reason"] for e in events for ch in e["choices"]][-1]
            assert joined(ref) == joined(routed)
            continue
        assert ref["usage"]["completion_tokens"] == routed["usage"]["completion_tokens"]
        for a, b_ in zip(ref["choices"], routed["choices"]):
            if "text" in a:
                assert a["text"] == b_["text"] and a["logprobs"] == b_["logprobs"]
            else:
                ma, mb = a["message"], b_["message"]
                assert ma["content"] == mb["content"] and a["finish_reason"] == b_["finish_reason"]
                assert ma["reasoning_content"] == mb["reasoning_content"]
                assert [t["function"] for t in ma.get("tool_calls", [])] == \
                    [t["function"] for t in mb.get("tool_calls", [])]
        for a in ref["choices"]:
            text = a["text"] if "text" in a else a["message"]["content"]
            if body.get("guided_regex") == THINK:  # the parts, put back together, are what the grammar allowed
                assert re.fullmatch(THINK, f"<think>{a['message']['reasoning_content']}</think>{text}")
            elif "guided_regex" in body:
                assert re.fullmatch(EMAIL, text)
            elif text is not None:
                jsonschema.validate(json.loads(text), RECORD)
            else:
                args = json.loads(a["message"]["tool_calls"][0]["function"]["arguments"])
                jsonschema.validate(args, TOOLS[1]["function"]["parameters"])
