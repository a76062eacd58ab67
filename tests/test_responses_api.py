"""/v1/responses (issue 40) through the official `openai` client's `responses.create`, stream
and not, on a colocated engine and through the router's PD pair (`--reasoning-parser qwen3`,
the hermes tool parser, the built-in model). The reference is /v1/chat/completions on the
colocated engine with the same conversation (itself tested against Hugging Face elsewhere):
a response's text, reasoning, function calls and token counts must be the chat answer's;
streamed events must add up to the non-streamed response; previous_response_id must
continue the stored conversation (its prompt is the chat prompt of the whole conversation)
and an evicted one is a clear 404. After every test each engine is idle with its pool free."""
from __future__ import annotations

import json
import re
import time

import jsonschema
import openai
import openai.types.responses
import pytest

from atomd.model.default import default_model_dir
from launch.process import http
from tests.pd_fixtures import ref_and_pd

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STORED = 3  # --max-stored-responses
BACKGROUND = 2  # --max-background-responses
CONTEXT = 2048  # --max-model-len: room for a long background response (cancelled long before its end)
# the default model's template, reading `reasoning_effort` (as gpt-oss's does) for reasoning.effort
EFFORT_TEMPLATE = "{% if reasoning_effort %}<|system|>\nReasoning: {{ reasoning_effort }}<|end|>\n{% endif %}" + \
    json.loads((default_model_dir() / "tokenizer_config.json").read_text())["chat_template"]
LONG = {"structured_outputs": {"regex": "[a-z]{4000}"}}  # no end before max_output_tokens: runs long
INSTRUCTIONS = "Answer in Python."
QUESTION = "def fibonacci(n):"
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 9}},
       "required": ["a", "b"], "additionalProperties": False}
TOOL = {"type": "function", "name": "add", "description": "Add two digits.", "parameters": ADD}
THINK = r"<think>([a-z]{3,8}(?: [a-z]{3,8}){0,2})</think>([a-z]{3,8}(?: [a-z]{3,8}){0,2})"


@pytest.fixture(scope="module")
def pd():
    # a prompt with tools is ~220 tokens
    with ref_and_pd("--reasoning-parser", "qwen3", "--max-stored-responses", str(STORED),
                    "--max-model-len", str(CONTEXT),
                    "--max-background-responses", str(BACKGROUND), "--chat-template", EFFORT_TEMPLATE) as cluster:
        yield cluster


@pytest.fixture(autouse=True)
def settled(pd):
    yield
    pd.assert_settled()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def chat(pd, messages: list[dict], **kw) -> dict:
    status, raw = http("POST", pd["ref"].url + "/v1/chat/completions", {"messages": messages, **kw})
    assert status == 200, raw
    return json.loads(raw)


def where(pd) -> list[str]:
    return [pd["ref"].url, pd.router.url]


BASE = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]


def test_text_in_text_out_equals_chat(pd):
    want = chat(pd, BASE, max_completion_tokens=12, temperature=0)
    for url in where(pd):
        r = client(url).responses.create(input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=12,
                                         temperature=0)
        assert r.object == "response" and r.id.startswith("resp_")
        assert r.output_text == want["choices"][0]["message"]["content"]
        assert r.usage.input_tokens == want["usage"]["prompt_tokens"]
        assert r.usage.output_tokens == want["usage"]["completion_tokens"]
        length = want["choices"][0]["finish_reason"] == "length"
        assert r.status == ("incomplete" if length else "completed")
        assert [item.type for item in r.output] == ["message"]
        status, raw = http("POST", url + "/v1/responses", {"input": QUESTION, "max_output_tokens": 4})
        assert status == 200
        openai.types.responses.Response.model_validate_json(raw)  # every field the type requires, strictly


def test_message_items_and_sampling_fields(pd):
    items = [{"role": "developer", "content": INSTRUCTIONS},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    want = chat(pd, [{"role": "developer", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}],
                max_completion_tokens=10, temperature=0.8, top_p=0.9, seed=5)
    for url in where(pd):
        r = client(url).responses.create(input=items, max_output_tokens=10, temperature=0.8, top_p=0.9,
                                         extra_body={"seed": 5})
        assert r.output_text == want["choices"][0]["message"]["content"]


def collect(stream) -> tuple[list, object]:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[-1].type == "response.completed"
    return events, events[-1].response


def test_stream_events_add_up_to_the_response(pd):
    for url in where(pd):
        c = client(url)
        whole = c.responses.create(input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=12, temperature=0)
        events, final = collect(c.responses.create(input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=12,
                                                   temperature=0, stream=True))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == whole.output_text == final.output_text
        done = [e for e in events if e.type == "response.output_text.done"]
        assert len(done) == 1 and done[0].text == text
        kinds = [e.type for e in events]
        assert kinds.index("response.output_item.added") < kinds.index("response.content_part.added") < \
            kinds.index("response.output_text.delta") < kinds.index("response.output_item.done")
        assert final.usage.output_tokens == whole.usage.output_tokens


def test_reasoning_items(pd):
    """A grammar makes the output `<think>...</think>...`: the reasoning item and the message
    are chat's reasoning_content and content, streamed or not."""
    so = {"structured_outputs": {"regex": THINK}, "seed": 3}
    want = chat(pd, [{"role": "user", "content": QUESTION}], max_completion_tokens=40, temperature=1.0, **so)
    message = want["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"]
    for url in where(pd):
        c = client(url)
        r = c.responses.create(input=QUESTION, max_output_tokens=40, temperature=1.0, extra_body=so)
        assert [item.type for item in r.output] == ["reasoning", "message"]
        assert r.output[0].content[0].text == message["reasoning_content"]
        assert r.output_text == message["content"]
        assert r.usage.output_tokens_details.reasoning_tokens > 0
        events, final = collect(c.responses.create(input=QUESTION, max_output_tokens=40, temperature=1.0,
                                                   extra_body=so, stream=True))
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
            message["reasoning_content"]
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == message["content"]
        assert [item.type for item in final.output] == ["reasoning", "message"]


def test_function_calls_and_the_conversation_continued(pd):
    """tool_choice required: a function_call item (chat's tool call); its output sent back with
    previous_response_id: the prompt is the chat prompt of the whole conversation."""
    want = chat(pd, [{"role": "user", "content": "add 2 and 3"}], tools=[{"type": "function", "function": {
        "name": "add", "description": "Add two digits.", "parameters": ADD}}], tool_choice="required",
        parallel_tool_calls=False, max_completion_tokens=60, temperature=0)
    call = want["choices"][0]["message"]["tool_calls"][0]["function"]
    for url in where(pd):
        for stream in (False, True):
            c = client(url)
            kw = dict(input="add 2 and 3", tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
                      max_output_tokens=60, temperature=0)
            r = collect(c.responses.create(stream=True, **kw))[1] if stream else c.responses.create(**kw)
            calls = [item for item in r.output if item.type == "function_call"]
            assert calls and (calls[0].name, json.loads(calls[0].arguments)) == (call["name"],
                                                                                  json.loads(call["arguments"]))
            jsonschema.validate(json.loads(calls[0].arguments), ADD)
            follow = c.responses.create(previous_response_id=r.id, input=[
                {"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"}], tools=[TOOL],
                max_output_tokens=4, temperature=0)
            history = [{"role": "user", "content": "add 2 and 3"},
                       {"role": "assistant", "content": r.output_text or None, "tool_calls": [
                           {"id": calls[0].call_id, "type": "function",
                            "function": {"name": calls[0].name, "arguments": calls[0].arguments}}]},
                       {"role": "tool", "tool_call_id": calls[0].call_id, "content": "5"}]
            ref = chat(pd, history, tools=[{"type": "function", "function": {
                "name": "add", "description": "Add two digits.", "parameters": ADD}}], max_completion_tokens=4,
                temperature=0)
            assert follow.usage.input_tokens == ref["usage"]["prompt_tokens"]
            assert follow.output_text == (ref["choices"][0]["message"]["content"] or "")


def test_json_schema_format(pd):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    for url in where(pd):
        r = client(url).responses.create(input="a number", max_output_tokens=30, temperature=0, text={
            "format": {"type": "json_schema", "name": "num", "schema": schema, "strict": True}})
        jsonschema.validate(json.loads(r.output_text), schema)


def test_previous_response_evicted_or_unknown_is_404(pd):
    for url in where(pd):
        c = client(url)
        first = c.responses.create(input="x = 1", max_output_tokens=2, temperature=0)
        second = c.responses.create(previous_response_id=first.id, input="y = 2", max_output_tokens=2, temperature=0)
        assert second.usage.input_tokens > first.usage.input_tokens  # the first turn is in its prompt
        for _ in range(STORED):
            c.responses.create(input="z = 3", max_output_tokens=1, temperature=0)
        with pytest.raises(openai.NotFoundError) as e:
            c.responses.create(previous_response_id=first.id, input="again", max_output_tokens=1)
        assert e.value.body["code"] == "previous_response_not_found"
        assert e.value.body["param"] == "previous_response_id"
        unstored = c.responses.create(input="w", max_output_tokens=1, store=False)
        with pytest.raises(openai.NotFoundError):
            c.responses.create(previous_response_id=unstored.id, input="again", max_output_tokens=1)


@pytest.mark.parametrize("body,param,code", [
    ({"input": "x", "reasoning": {"effort": "high", "summary": "auto"}}, "reasoning.summary", "unsupported_field"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort", "invalid_value"),
    ({"input": "x", "tools": [{"type": "web_search", "search_context_size": "low"}]}, "tools[0].type",
     "unsupported_field"),
    ({"input": "x", "tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "tools[0].type",
     "unsupported_field"),
    ({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[0].type",
     "unsupported_field"),
    ({"input": "x", "tools": [{"type": "computer_use_preview", "display_width": 1, "display_height": 1,
                               "environment": "linux"}]}, "tools[0].type", "unsupported_field"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include", "unsupported_field"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include", "unsupported_field"),
    ({"input": "x", "top_logprobs": 21, "include": ["message.output_text.logprobs"]}, "top_logprobs",
     "invalid_value"),
    ({"input": "x", "background": True, "store": False}, "background", "invalid_value"),
    ({"input": "x", "background": True, "stream": True}, "background", "unsupported_field"),
    ({"input": [{"type": "image", "url": "x"}]}, "input[0].type", "invalid_value"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]", "invalid_value"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format.schema", "invalid_value"),
    ({"input": "x", "unknown": 1}, "unknown", "unknown_field"),
    ({"input": [{"role": "user", "content": "x"}] * 1025}, "input", "limit_exceeded"),
    ({"input": "x", "request_id": "bad id"}, "request_id", "invalid_value"),
    # longer than the context
    ({"input": "x " * (CONTEXT + 100), "instructions": "be brief"}, "input", "unschedulable"),
])
def test_bad_requests_are_400_naming_the_field(pd, body, param, code):
    for url in where(pd):
        status, raw = http("POST", url + "/v1/responses", body)
        assert status == 400, raw
        error = json.loads(raw)["error"]
        assert (error["param"], error["code"]) == (param, code), error
        assert re.search(r"Traceback|/work|\.py", error["message"]) is None
        # the message names the tool type / the value refused
        if code == "unsupported_field" and ("tools" in body or "include" in body):
            assert (body["tools"][0]["type"] if "tools" in body else body["include"][0]) in error["message"]


def until(fetch, done, deadline_s: float = 60.0):
    """fetch() until done(its value), before a deadline."""
    deadline = time.monotonic() + deadline_s
    while True:
        value = fetch()
        if done(value):
            return value
        assert time.monotonic() < deadline, f"still {value!r} after {deadline_s} s"
        time.sleep(0.05)


def test_retrieve_input_items_and_delete(pd):
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    for url in where(pd):
        c = client(url)
        r = c.responses.create(input=items, instructions=INSTRUCTIONS, max_output_tokens=6, temperature=0,
                               metadata={"k": "v"})
        got = c.responses.retrieve(r.id)
        assert got.model_dump() == r.model_dump()  # the response as it was answered
        listed = c.responses.input_items.list(r.id, order="asc")
        assert [(i.type, i.role, [p.text for p in i.content]) for i in listed.data] == [
            ("message", "developer", ["Be brief."]), ("message", "user", [QUESTION])]  # no instructions
        assert [i.id for i in c.responses.input_items.list(r.id).data] == [i.id for i in listed.data][::-1]
        page = c.responses.input_items.list(r.id, order="asc", limit=1)
        assert [i.role for i in page.data] == ["developer"] and page.has_more
        after = c.responses.input_items.list(r.id, order="asc", after=page.data[0].id)
        assert [i.role for i in after.data] == ["user"] and not after.has_more
        if url == pd.router.url:  # a router that did not relay it (a replica, a restart) asks the engines
            other = client(pd.start_router("P", "D").url)
            assert other.responses.retrieve(r.id).model_dump() == r.model_dump()
            assert [i.id for i in other.responses.input_items.list(r.id, order="asc").data] == \
                [i.id for i in listed.data]
            with pytest.raises(openai.NotFoundError) as e:
                other.responses.retrieve("resp_unknown")
            assert e.value.body["code"] == "response_not_found"
        c.responses.delete(r.id)
        for call in (lambda: c.responses.retrieve(r.id), lambda: c.responses.delete(r.id),
                     lambda: c.responses.input_items.list(r.id)):
            with pytest.raises(openai.NotFoundError) as e:
                call()
            assert e.value.body["code"] == "response_not_found"
        unstored = c.responses.create(input="w", max_output_tokens=1, store=False)
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(unstored.id)
        status, raw = http("GET", url + "/v1/responses/resp_unknown")
        assert status == 404 and json.loads(raw)["error"]["code"] == "response_not_found", raw
        status, raw = http("GET", f"{url}/v1/responses/{r.id}/input_items?limit=0")
        assert status == 404  # deleted first


def test_background_polled_until_completed(pd):
    """background: answered at once (queued / in_progress), then GET gives the response the
    same request gets in the foreground."""
    kw = dict(input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=12, temperature=0)
    for url in where(pd):
        c = client(url)
        want = c.responses.create(**kw)
        r = c.responses.create(background=True, **kw)
        assert r.status in ("queued", "in_progress") and r.background and r.output == []
        done = until(lambda: c.responses.retrieve(r.id), lambda x: x.status not in ("queued", "in_progress"))
        assert done.status == want.status and done.output_text == want.output_text
        assert done.usage.output_tokens == want.usage.output_tokens
        follow = c.responses.create(previous_response_id=r.id, input="more", max_output_tokens=2, temperature=0)
        assert follow.usage.input_tokens > done.usage.input_tokens  # the background turn is in its prompt
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.cancel(r.id)  # finished
        assert e.value.body["code"] == "response_not_cancellable"
    # a prompt longer than the context: the engine's scheduler refuses it after the answer, so the
    # colocated engine's background response ends failed; through PD, P's leg refuses it first (a 400)
    too_long = dict(input="x " * (CONTEXT + 100), max_output_tokens=4, background=True)
    failed = client(pd["ref"].url).responses.create(**too_long)
    assert failed.status in ("queued", "in_progress")
    failed = until(lambda: client(pd["ref"].url).responses.retrieve(failed.id), lambda x: x.status == "failed")
    assert failed.error.code == "invalid_prompt" and "max_model_len" in failed.error.message, failed.error
    with pytest.raises(openai.BadRequestError) as e:
        client(pd.router.url).responses.create(**too_long)
    assert e.value.body["code"] == "unschedulable"


def test_background_cancel_frees_the_request_and_the_bound_is_a_429(pd):
    """Cancel aborts the engine request (the `settled` fixture checks every block is free);
    past --max-background-responses running, a 429."""
    for url in where(pd):
        c = client(url)
        running = [c.responses.create(input="a", max_output_tokens=2000, temperature=0, background=True,
                                      extra_body=LONG) for _ in range(BACKGROUND)]
        with pytest.raises(openai.RateLimitError) as e:
            c.responses.create(input="a", max_output_tokens=4, background=True)
        assert e.value.body["code"] == "too_many_background_responses"
        assert c.responses.create(input="a", max_output_tokens=2).status in ("completed", "incomplete")
        until(lambda: c.responses.retrieve(running[0].id).status, lambda s: s == "in_progress")
        for r in running:
            cancelled = c.responses.cancel(r.id)
            assert cancelled.status == "cancelled", cancelled.status
            assert c.responses.retrieve(r.id).status == "cancelled"
            assert c.responses.cancel(r.id).status == "cancelled"  # again: the same answer
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(previous_response_id=running[0].id, input="x", max_output_tokens=1)
        assert e.value.body["code"] == "previous_response_not_completed"
        early = c.responses.create(input="b", max_output_tokens=2000, background=True, extra_body=LONG)
        assert c.responses.cancel(early.id).status == "cancelled"  # at once: queued, or just started
        again = c.responses.create(input="a", max_output_tokens=3, temperature=0, background=True)
        assert until(lambda: c.responses.retrieve(again.id).status, lambda s: s not in ("queued", "in_progress")) \
            in ("completed", "incomplete")


def test_include_output_text_logprobs_equal_chat(pd):
    want = chat(pd, BASE, max_completion_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    ref = [(t["token"], t["logprob"], [x["token"] for x in t["top_logprobs"]])
           for t in want["choices"][0]["logprobs"]["content"]]
    for url in where(pd):
        c = client(url)
        kw = dict(input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=8, temperature=0, top_logprobs=2,
                  include=["message.output_text.logprobs"])
        for stream in (False, True):
            if stream:
                events = list(c.responses.create(stream=True, **kw))
                done, = [e for e in events if e.type == "response.output_text.done"]
                lps = done.logprobs
                assert [x.model_dump() for x in events[-1].response.output[0].content[0].logprobs] == \
                    [x.model_dump() for x in lps]
            else:
                lps = c.responses.create(**kw).output[0].content[0].logprobs
            got = [(t.token, t.logprob, [x.token for x in t.top_logprobs]) for t in lps]
            assert [g[0] for g in got] == [r[0] for r in ref] and [g[2] for g in got] == [r[2] for r in ref]
            assert got[0][1] == pytest.approx(ref[0][1], abs=1e-4)
        plain = c.responses.create(input=QUESTION, max_output_tokens=2, temperature=0)
        assert plain.output[0].content[0].logprobs == []  # not asked for


def test_reasoning_effort_is_the_templates_reasoning_effort(pd):
    """As vLLM: reasoning.effort renders as the chat template's `reasoning_effort`."""
    want = chat(pd, BASE, max_completion_tokens=6, temperature=0, chat_template_kwargs={"reasoning_effort": "low"})
    plain = chat(pd, BASE, max_completion_tokens=6, temperature=0)
    assert want["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    for url in where(pd):
        r = client(url).responses.create(input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=6,
                                         temperature=0, reasoning={"effort": "low"})
        assert r.usage.input_tokens == want["usage"]["prompt_tokens"]
        assert r.output_text == want["choices"][0]["message"]["content"]
        assert r.reasoning.effort == "low"
