"""Issue 34's chat templates without a server (atomd/api/chat_templates.py): `--chat-template`
(a file or inline), a request's `chat_template` and `chat_template_kwargs`, rendered to the
prompt ids that Hugging Face transformers' `apply_chat_template` (the reference, the same
kwargs passed through) gives, the router rendering the same ids for kv_aware placement, and
every bad template, kwarg or size a 400 naming the field."""
from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
import transformers

from atomd.api import chat_templates as CT
from atomd.api import limits as L
from atomd.api import protocol, validation
from atomd.model.default import default_model_dir
from atomd.tokenizer import Tokenizer
from router.tokenizer import RouterTokenizer
from tests.server_fixtures import REPO

pytestmark = pytest.mark.unit

# Qwen3's switch (enable_thinking: false closes an empty think block in the prompt) and a
# kwarg of the template's own, on the default model's special tokens.
TEMPLATE = ("{{ bos_token }}{% if persona is defined %}<|system|>\nYou are {{ persona }}.<|end|>\n{% endif %}"
            "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n"
            "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
            "{% endif %}")
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
# every field given: the template sees OpenAI's tool dicts with their defaults filled in (as vLLM's model_dump)
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                           "parameters": {"type": "object"}, "strict": False}}]
LIMITS = msgspec.structs.replace(L.DEFAULT, max_prompt_chars=1 << 20)


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir())


@pytest.fixture(scope="module")
def hf():
    return transformers.AutoTokenizer.from_pretrained(default_model_dir())


def request(**kw) -> protocol.ChatCompletionRequest:
    return protocol.decode_request(msgspec.json.encode({"messages": MESSAGES, **kw}), protocol.ChatCompletionRequest)


def ids_of(ours: Tokenizer, trusted: bool = True, max_prompt_chars: int = 1 << 20, **kw) -> list[int]:
    req = request(**kw)
    checked = validation.validate_chat_request(req, LIMITS)
    return CT.prompt_ids(ours, req, validation.chat_messages(req), checked.tools, trusted, max_prompt_chars)


def reference_ids(hf, template: str | None = None, **kwargs) -> list[int]:
    text = hf.apply_chat_template(MESSAGES, chat_template=template, add_generation_prompt=True, tokenize=False,
                                  **kwargs)
    return hf(text, add_special_tokens=False).input_ids


@pytest.mark.parametrize("kwargs", [None, {}, {"enable_thinking": False}, {"enable_thinking": True},
                                    {"persona": "a pirate", "enable_thinking": False}])
def test_request_template_and_kwargs_render_as_transformers_does(ours, hf, kwargs):
    got = ids_of(ours, chat_template=TEMPLATE, **({} if kwargs is None else {"chat_template_kwargs": kwargs}))
    assert got == reference_ids(hf, TEMPLATE, **(kwargs or {}))


def test_the_kwargs_take_the_templates_branches(ours, hf):
    plain = ids_of(ours, chat_template=TEMPLATE)
    no_thinking = ids_of(ours, chat_template=TEMPLATE, chat_template_kwargs={"enable_thinking": False})
    text = ours.decode(no_thinking, skip_special_tokens=False)
    assert text.endswith("<|assistant|>\n<think>\n\n</think>\n\n") and no_thinking[:len(plain)] == plain


def test_the_checkpoints_template_with_kwargs_and_tools(ours, hf):
    assert ids_of(ours, chat_template_kwargs={"unused": 1}) == reference_ids(hf, unused=1)
    assert ids_of(ours, tools=TOOLS) == reference_ids(hf, tools=TOOLS)


def test_the_router_renders_the_same_ids_with_the_kwargs(ours):
    router = RouterTokenizer(default_model_dir())
    body = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
    assert router.token_ids(body) == ids_of(ours, chat_template_kwargs={"enable_thinking": False})
    assert router.token_ids({**body, "chat_template": TEMPLATE}) is None  # not run in the router: placed by load


def test_the_router_takes_the_engines_chat_template_flag(tmp_path):
    """`--chat-template` on the router (file or inline) renders what an engine with the same
    flag renders (atomd.api.server sets it on the engine's tokenizer)."""
    engine = Tokenizer.from_dir(default_model_dir())
    engine.chat_template = CT.load_chat_template(TEMPLATE)
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    body = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
    want = ids_of(engine, chat_template_kwargs={"enable_thinking": False})
    assert RouterTokenizer(default_model_dir(), str(path)).token_ids(body) == want
    assert RouterTokenizer(default_model_dir(), TEMPLATE).token_ids(body) == want
    assert RouterTokenizer(default_model_dir()).token_ids(body) != want  # the model's own differs


def test_chat_template_flag_takes_a_file_or_inline_text(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert CT.load_chat_template(str(path)) == TEMPLATE
    assert CT.load_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ValueError, match="no such file, and not an inline jinja template"):
        CT.load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match=r"does not compile: .*\(line 2\)"):
        CT.load_chat_template("ok\n{% if %}")


def test_serve_refuses_a_bad_chat_template_at_start():
    proc = subprocess.run([sys.executable, "-m", "atomd", "serve", "--chat-template", "{% for x in %}",
                           "--port", "0"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2 and "--chat-template: the template does not compile" in proc.stderr


def api_error(ours: Tokenizer, limits: L.RequestLimits = LIMITS, trusted: bool = True,
              max_prompt_chars: int = 1 << 20, **kw) -> protocol.APIError:
    with pytest.raises(protocol.APIError) as info:
        req = protocol.decode_request(msgspec.json.encode({"messages": MESSAGES, **kw}), protocol.ChatCompletionRequest)
        checked = validation.validate_chat_request(req, limits)
        CT.prompt_ids(ours, req, validation.chat_messages(req), checked.tools, trusted, max_prompt_chars)
    assert info.value.status == 400
    return info.value


def test_bad_templates_and_kwargs_are_400s_naming_the_field(ours):
    e = api_error(ours, trusted=False, chat_template=TEMPLATE)
    assert e.param == "chat_template" and "--trust-request-chat-template" in e.message
    e = api_error(ours, chat_template="{% for m in messages %}")
    assert e.param == "chat_template" and "does not compile" in e.message
    for deep in ("{{ " + "(" * 20000 + "1" + ")" * 20000 + " }}", "{% if a %}" * 3000 + "{% endif %}" * 3000):
        e = api_error(ours, chat_template=deep)  # jinja's parser recurses per level
        assert e.param == "chat_template" and "nested too deeply" in e.message
    e = api_error(ours, chat_template="{{ raise_exception('no system role here') }}")
    assert e.param == "chat_template" and "no system role here" in e.message
    e = api_error(ours, chat_template="{{ messages.pop() }}")  # the sandbox refuses mutation
    assert e.param == "chat_template"
    e = api_error(ours, chat_template_kwargs={"messages": []})
    assert e.param == "chat_template_kwargs" and "'messages'" in e.message
    e = api_error(ours, chat_template=7)
    assert e.param == "chat_template"
    e = api_error(ours, chat_template_kwargs=["enable_thinking"])
    assert e.param == "chat_template_kwargs"
    e = api_error(ours, chat_template="{{ 'x' * 5000 }}", max_prompt_chars=4096)  # rendered too long
    assert e.code == "limit_exceeded" and "max-prompt-chars" in e.message
    e = api_error(ours, chat_template="{% for i in range(10**9) %}{% endfor %}")  # jinja's sandbox bounds range()
    assert e.param == "chat_template"
    e = api_error(ours, chat_template="{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}")
    assert e.param == "chat_template" and "range items in all" in e.message  # nested: the render's budget
    for huge in ("{{ 'x' * 10**9 }}", "{{ [1] * 10**9 }}", "{{ 2 ** 100000000 }}"):
        e = api_error(ours, chat_template=huge)
        assert e.param == "chat_template" and "chat template" in e.message, huge
    e = api_error(ours, chat_template="{% if false %}x{% endif %}")
    assert e.param == "chat_template" and "empty prompt" in e.message
    e = api_error(ours, chat_template_kwargs={"range": 3})
    assert e.param == "chat_template_kwargs"


def test_sizes_are_bounded_by_the_limits(ours):
    small = msgspec.structs.replace(LIMITS, max_chat_template_chars=100, max_list_items=4, max_json_depth=8,
                                    max_prompt_chars=500)
    e = api_error(ours, small, chat_template="{{ bos_token }}" + " " * 100)
    assert e.param == "chat_template" and "--max-chat-template-chars" in e.message
    e = api_error(ours, small, chat_template_kwargs={f"k{i}": i for i in range(5)})
    assert e.param == "chat_template_kwargs" and "--max-list-items" in e.message
    deep: dict = {}
    for _ in range(10):
        deep = {"d": deep}
    e = api_error(ours, small, chat_template_kwargs={"k": deep})
    assert "--max-json-depth" in e.message
    e = api_error(ours, small, chat_template_kwargs={"k": "x" * 600})  # counted with the messages
    assert e.param == "messages" and "--max-prompt-chars" in e.message


def test_completions_have_no_chat_template():
    for field, value in (("chat_template", TEMPLATE), ("chat_template_kwargs", {"enable_thinking": False})):
        req = protocol.decode_request(msgspec.json.encode({"prompt": "x", field: value}), protocol.CompletionRequest)
        with pytest.raises(protocol.APIError) as info:
            validation.validate_completion_request(req)
        assert info.value.param == field and info.value.code == "unsupported_field"


@pytest.mark.parametrize("body", [
    {"input": "add 2 and 3"},
    {"instructions": "Be brief.", "reasoning": {"effort": "low"}, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "add 2 and 3"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{\"a\": 2, \"b\": 3}"},
        {"type": "function_call_output", "call_id": "c1", "output": "5"},
        {"role": "user", "content": "thanks"}]}])
def test_the_router_renders_a_responses_request_to_the_engines_prompt(ours, body):
    """kv_aware places /v1/responses by the chat prompt it becomes (router/responses.py
    routing_view): the ids the engine renders (responses_api.to_chat, then the chat template)."""
    from atomd.api import responses_api
    from atomd.api.responses_store import ResponseStore
    from router.responses import routing_view

    template = "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}" + ours.chat_template
    engine = Tokenizer.from_dir(default_model_dir())
    engine.chat_template = template
    rreq = protocol.decode_request(msgspec.json.encode(body), responses_api.ResponsesRequest)
    chat, _ = responses_api.to_chat(rreq, ResponseStore(0), LIMITS, template)
    want = CT.prompt_ids(engine, chat, validation.chat_messages(chat), None, False, 1 << 20)
    assert RouterTokenizer(default_model_dir(), template).token_ids(routing_view(body)) == want
    if "reasoning" in body:
        assert engine.decode(want, skip_special_tokens=False).count("Reasoning: low") == 1
