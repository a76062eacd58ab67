"""From a decoded OpenAI request to the engine's input: the range and limit checks msgspec cannot
express, structured outputs and tool plans, then SamplingParams. Every failure is an APIError (400).
"""
from __future__ import annotations

from typing import Any

import msgspec

from atomd.api import limits as L
from atomd.api.protocol import (CHAT_ONLY_FIELDS, CHAT_ROLES, MAX_LOGPROBS, MAX_N, UNSUPPORTED, APIError,
                                ChatCompletionRequest, CompletionRequest, ContentPart, SamplingFields,
                                UnsupportedFields, invalid)
from contracts.sampling import SamplingParams, StructuredOutputsParams
from kv_transfer.params import KVTransferParams


def prompt_inputs(prompt: str | list[Any], max_prompts: int = L.DEFAULT.max_prompts) -> list[str | list[int]]:
    """The prompts of a completion request, each text or token ids: a string, a list of token
    ids, or a list of several of either (OpenAI's batch form; each its own sequences)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > max_prompts:
            raise too_large("prompt", f"{len(prompt)} prompts", max_prompts, "max-prompts")
        return [_one_prompt(p, f"prompt[{i}]" if len(prompt) > 1 else "prompt") for i, p in enumerate(prompt)]
    return [_one_prompt(prompt, "prompt")]


def _one_prompt(prompt: Any, where: str) -> str | list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt", f"{where} must not be empty")
        return prompt
    if not prompt:
        raise invalid("prompt", f"{where} must not be empty")
    if all(type(t) is int for t in prompt):
        return prompt
    raise invalid("prompt", "prompt must be a string, a list of token ids, or a list of strings or of token-id "
                            f"lists; {where} is neither")


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """Messages as the chat template wants them: role and plain-text content."""
    if not req.messages:
        raise invalid("messages", "messages must not be empty")
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role",
                          f"unknown role {m.role!r}; expected one of {', '.join(CHAT_ROLES)}")
        if isinstance(m.content, list):
            for j, p in enumerate(m.content):
                if p.type != "text":  # a vision-language checkpoint (Gemma 3) is served as its text model
                    raise APIError(400, f"{p.type!r} content parts are not supported: this server runs text "
                                        f"models only (no image, audio or file inputs); send text parts",
                                   param=f"messages[{i}].content[{j}]", code="unsupported_content")
            if any(p.text is None for p in m.content):
                raise invalid(f"messages[{i}].content", "a text content part needs its text")
            content = "".join(p.text for p in m.content)
        else:
            content = m.content or ""
        message: dict[str, Any] = {"role": m.role, "content": content}
        if m.tool_calls:  # the template gets arguments as objects (vLLM does the same)
            message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def _json_or_text(text: str) -> Any:
    try:
        return msgspec.json.decode(text)
    except (msgspec.DecodeError, RecursionError):
        return text


class Checked(msgspec.Struct):
    """What validation derived from a request: the logprobs count (None: no logprobs), the
    parsed kv_transfer_params (parsed here once; the engine keeps this struct), the
    prompt logprobs count (asked, or echo with logprobs) and logit_bias by token id."""

    logprobs: int | None
    kv_transfer_params: KVTransferParams | None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None  # the grammar the output must follow
    tools: list[dict[str, Any]] | None = None  # chat: for the template (None: no tools in the prompt)
    parse_tool_calls: bool = False  # chat: the output's tool calls become `tool_calls`
    forced_tool_call: bool = False  # chat: a grammar forces the output to be tool calls


def check_unsupported(req: UnsupportedFields) -> None:
    """A 400 naming the first unsupported field sent with a value that asks for something."""
    for name, noops in UNSUPPORTED.items():
        if name in CHAT_ONLY_FIELDS and isinstance(req, ChatCompletionRequest):
            continue  # implemented there
        value = getattr(req, name)
        if value is not msgspec.UNSET and not any(_same(value, v) for v in noops):
            raise APIError(400, f"{name}={value!r} is not supported by this server; leave it out",
                           param=name, code="unsupported_field")


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but true is not 1."""
    return (isinstance(a, bool) == isinstance(b, bool)) and a == b


INT_MIN, INT_MAX = -2**63, 2**64 - 1  # what the engine's IPC (msgpack) can carry


def _first_huge_int(value: Any, path: str) -> str | None:
    """The path of the first integer in `value` no 64-bit field can hold, or None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return path if not INT_MIN <= value <= INT_MAX else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, int) and not INT_MIN <= key <= INT_MAX:
            return f"{path}.{key}"
        found = _first_huge_int(item, f"{path}[{key}]" if isinstance(value, list) else f"{path}.{key}")
        if found is not None:
            return found
    return None


def check_int_ranges(req: msgspec.Struct) -> None:
    """JSON integers are unbounded; every integer the engine takes is 64-bit: a 400 naming
    the field, instead of an overflow deep in the IPC."""
    for name in req.__struct_fields__:
        found = _first_huge_int(getattr(req, name), name)
        if found is not None:
            raise invalid(found.split(".")[0].split("[")[0], f"{found}: integer out of the 64-bit range")


def too_large(param: str, what: str, limit: int, flag: str | None) -> APIError:
    named = f" (--{flag})" if flag else ""
    return APIError(400, f"{param}: {what}; the limit is {limit}{named}", param=param, code="limit_exceeded")


def check_limits(req: SamplingFields, limits: L.RequestLimits) -> None:
    """A 400 naming the field and the limit (atomd/api/limits.py) for a request whose lists,
    strings, grammars, JSON nesting or prompt exceed them: checked before anything is
    parsed further, tokenized or compiled."""
    if limits.max_prompt_chars:
        prompt = getattr(req, "prompt", None)
        if prompt is not None:
            size, name = (len(prompt) if isinstance(prompt, str) else
                          sum(len(p) if isinstance(p, (str, list)) else 1 for p in prompt)), "prompt"
        else:
            size, name = sum(_content_chars(m.content) for m in req.messages), "messages"
            if req.chat_template_kwargs:  # rendered into the prompt too
                size += len(msgspec.json.encode(req.chat_template_kwargs))
        if size > limits.max_prompt_chars:
            raise too_large(name, f"a prompt of {size} characters (or token ids)", limits.max_prompt_chars,
                            "max-prompt-chars")
    template = req.chat_template
    if isinstance(template, str) and len(template) > limits.max_chat_template_chars:
        raise too_large("chat_template", f"a template of {len(template)} characters", limits.max_chat_template_chars,
                        "max-chat-template-chars")
    so = req.structured_outputs
    lists = [(name, getattr(req, name, None)) for name in L.LIST_FIELDS]
    lists.append(("structured_outputs.choice", so.choice if so is not None else None))
    for name, value in lists:
        if isinstance(value, (list, dict)) and len(value) > limits.max_list_items:
            raise too_large(name, f"{len(value)} items", limits.max_list_items, "max-list-items")
    deepest = L.json_depth(msgspec.to_builtins(req), limits.max_json_depth)
    if deepest > limits.max_json_depth:
        raise too_large("body", f"JSON nested deeper than {limits.max_json_depth} levels", limits.max_json_depth,
                        "max-json-depth")
    for name, value in lists:
        if name not in ("stop", "bad_words", "guided_choice", "structured_outputs.choice"):
            continue
        for item in ([value] if isinstance(value, str) else value or ()):
            if len(item) > limits.max_item_chars:
                raise too_large(name, f"an item of {len(item)} characters", limits.max_item_chars,
                                "max-item-chars")
    grammars = [("guided_regex", req.guided_regex), ("guided_grammar", req.guided_grammar),
                ("guided_json", req.guided_json), ("guided_choice", req.guided_choice)]
    if so is not None:
        grammars += [(f"structured_outputs.{k}", getattr(so, k)) for k in ("json", "regex", "choice", "grammar")]
    rf = req.response_format
    if rf is not None and rf.json_schema is not None:
        grammars.append(("response_format.json_schema.schema", rf.json_schema.schema))
    for name, value in grammars:
        if value is None:
            continue
        size = (len(value.encode()) if isinstance(value, str) else
                sum(len(c.encode()) for c in value) if isinstance(value, list) else len(msgspec.json.encode(value)))
        if size > limits.max_grammar_bytes:
            raise too_large(name, f"{size} bytes", limits.max_grammar_bytes, "max-grammar-bytes")
        if isinstance(value, str) and name.endswith("json") and \
                L.text_json_depth(value, limits.max_json_depth) > limits.max_json_depth:
            raise too_large(name, f"JSON nested deeper than {limits.max_json_depth} levels",
                            limits.max_json_depth, "max-json-depth")


def _content_chars(content: str | list[ContentPart] | None) -> int:
    if isinstance(content, list):
        return sum(len(p.text or "") for p in content)
    return len(content or "")


def _check_common(req: SamplingFields, limits: L.RequestLimits) -> tuple[KVTransferParams | None,
                                                                           dict[int, float] | None]:
    """Checks of the fields SamplingParams does not own (it checks the sampling ranges)."""
    check_limits(req, limits)  # first: the checks below walk the request recursively
    check_unsupported(req)
    check_int_ranges(req)
    kv_params = None
    if req.kv_transfer_params is not None:
        try:  # a malformed one never reaches the engine
            kv_params = KVTransferParams.from_json_obj(req.kv_transfer_params)
        except ValueError as e:
            raise invalid("kv_transfer_params", str(e)) from None
    # SamplingParams owns n >= 1, best_of >= n and logit_bias's ranges; the API adds its bounds
    if req.n > MAX_N:
        raise invalid("n", f"n must be at most {MAX_N}, got {req.n}")
    if req.best_of is not None:
        if req.best_of > MAX_N:
            raise invalid("best_of", f"best_of must be at most {MAX_N}, got {req.best_of}")
        if req.stream and req.best_of > req.n:
            raise invalid("best_of", "best_of > n cannot be streamed (the best choices are known only at the end)")
    if req.stream_options is not None and not req.stream:
        raise invalid("stream_options", "stream_options is only allowed with stream=true")
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
        raise invalid("prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {req.prompt_logprobs}")
    logit_bias = None
    if req.logit_bias is not None:
        logit_bias = {}
        for key, bias in req.logit_bias.items():
            try:  # JSON keys are strings
                logit_bias[int(key)] = bias
            except ValueError:
                raise invalid("logit_bias", f"logit_bias keys must be token ids, got {key!r}") from None
    return kv_params, logit_bias


def structured_request(req: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The grammar a request's structured-output fields ask for, and the field that asked
    (None, None: none). A 400 for two forms at once, an empty or ill-formed one, or a
    combination the grammar cannot honour; the grammar is compiled by `check_structured`."""
    forms: list[tuple[str, StructuredOutputsParams]] = []

    def make(param: str, **kw: Any) -> None:
        try:
            forms.append((param, StructuredOutputsParams(**kw)))
        except ValueError as e:
            raise invalid(param, str(e).replace("structured_outputs ", "", 1)) from None

    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            if rf.json_schema is not None:
                raise invalid("response_format.json_schema", "json_schema goes with type json_schema")
            make("response_format", json_object=True)
        elif rf.json_schema is None or rf.json_schema.schema is None:
            raise invalid("response_format.json_schema.schema", "type json_schema needs json_schema.schema")
        else:
            make("response_format.json_schema.schema", json=rf.json_schema.schema)
    so = req.structured_outputs
    if so is not None:
        given = {k: getattr(so, k) for k in ("json", "regex", "choice", "grammar") if getattr(so, k) is not None}
        if so.json_object:
            given["json_object"] = True
        if len(given) != 1:
            raise invalid("structured_outputs", "structured_outputs must set exactly one of json, regex, choice, "
                                                f"grammar, json_object; got {sorted(given) or 'none'}")
        (key, value), = given.items()
        make(f"structured_outputs.{key}", **{key: value})
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        value = getattr(req, name)
        if value is not None:
            make(name, **{name[len("guided_"):]: value})
    if not forms:
        return None, None
    if len(forms) > 1:
        raise invalid(forms[1][0].split(".")[0], f"only one structured-output form per request: "
                                                 f"{forms[0][0].split('.')[0]} and {forms[1][0].split('.')[0]} given")
    param, params = forms[0]
    if req.ignore_eos:
        raise invalid("ignore_eos", "ignore_eos cannot be combined with structured outputs (the grammar ends the "
                                    "output with the end token)")
    if req.min_tokens:
        raise invalid("min_tokens", "min_tokens cannot be combined with structured outputs (it could ban the only "
                                    "token the grammar allows)")
    return params, param


def check_structured(params: StructuredOutputsParams | None, param: str | None) -> None:
    """A 400 naming `param` when the grammar does not compile (llguidance's message)."""
    if params is None:
        return
    from atomd import structured

    try:
        structured.check(params)
    except ValueError as e:
        raise invalid(param, f"{param}: {e}") from None


def tool_plan(req: ChatCompletionRequest, tool_call_parser: str = "hermes") -> tuple[list[dict[str, Any]] | None, bool,
                                                   StructuredOutputsParams | None, str | None]:
    """(tools for the template, parse the output, grammar of a forced call, its field)."""
    from atomd.api import tools as T

    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none":
            raise invalid("tool_choice", "tool_choice needs tools")
        return None, False, None, None
    for i, t in enumerate(req.tools):
        if not t.function.name:
            raise invalid(f"tools[{i}].function.name", "a function needs a name")
    if choice == "none":
        return None, False, None, None
    listed = [msgspec.to_builtins(t) for t in req.tools]
    if choice is None or choice == "auto":
        return listed, True, None, None
    if choice == "required":
        used = list(enumerate(req.tools))
    else:
        used = [(i, t) for i, t in enumerate(req.tools) if t.function.name == choice.function.name]
        if not used:
            raise invalid("tool_choice", f"tool_choice names function {choice.function.name!r}, which is not in tools")
        used = used[:1]
    for i, t in used:  # each schema on its own first: a bad one is named
        if t.function.parameters:
            check_structured(StructuredOutputsParams(json=t.function.parameters), f"tools[{i}].function.parameters")
    several = choice == "required" and req.parallel_tool_calls is not False
    grammar = T.forced_grammar([(t.function.name, t.function.parameters) for _, t in used], several,
                               tool_call_parser)
    return listed, True, StructuredOutputsParams(grammar=grammar), "tool_choice"


def validate_completion_request(req: CompletionRequest, limits: L.RequestLimits = L.DEFAULT) -> Checked:
    """Every check of a /v1/completions body but the sampling ranges (`sampling_params`)
    and the length policy (the server's, which needs the tokenized prompt)."""
    kv_params, logit_bias = _check_common(req, limits)
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise invalid("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}")
    check_max_tokens("max_tokens", req.max_tokens)
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo and req.logprobs is not None:  # vLLM: echo's logprobs
        prompt_logprobs = req.logprobs
    structured, param = structured_request(req)
    check_structured(structured, param)
    return Checked(req.logprobs, kv_params, prompt_logprobs, logit_bias, structured)


def validate_chat_request(req: ChatCompletionRequest, limits: L.RequestLimits = L.DEFAULT,
                          tool_call_parser: str = "hermes") -> Checked:
    """As validate_completion_request, for /v1/chat/completions."""
    kv_params, logit_bias = _check_common(req, limits)
    if req.echo is not msgspec.UNSET and not _same(req.echo, False) and req.echo is not None:
        raise APIError(400, f"echo={req.echo!r} is not supported on chat completions; leave it out",
                       param="echo", code="unsupported_field")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise invalid("top_logprobs", "top_logprobs requires logprobs=true")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise invalid("top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}")
    check_max_tokens("max_tokens", req.max_tokens)
    check_max_tokens("max_completion_tokens", req.max_completion_tokens)
    structured, param = structured_request(req)
    tools, parse, forced, forced_param = tool_plan(req, tool_call_parser)
    if forced is not None:
        if structured is not None:
            raise invalid(param.split(".")[0], f"{param.split('.')[0]} cannot be combined with tool_choice "
                                               f"{'required' if req.tool_choice == 'required' else 'naming a function'}")
        structured, param = forced, forced_param
        if req.ignore_eos or req.min_tokens:
            raise invalid("ignore_eos" if req.ignore_eos else "min_tokens",
                          "cannot be combined with a forced tool call (a grammar ends the output)")
    check_structured(structured, param)
    return Checked((req.top_logprobs or 0) if req.logprobs else None, kv_params, req.prompt_logprobs, logit_bias,
                   structured, tools, parse, forced is not None)


def check_max_tokens(param: str, value: int | None) -> None:
    if value is not None and value <= 0:
        raise invalid(param, f"{param} must be at least 1, got {value}")


def sampling_params(req: SamplingFields, max_tokens: int, checked: Checked) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    try:
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=req.min_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
            min_p=req.min_p or 0.0, seed=req.seed, stop=stop, stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos, logprobs=checked.logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output, n=req.n, best_of=req.best_of,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=checked.logit_bias or None, bad_words=list(req.bad_words or []),
            allowed_token_ids=req.allowed_token_ids, prompt_logprobs=checked.prompt_logprobs,
            structured_outputs=checked.structured_outputs, priority=req.priority)
    except ValueError as e:  # SamplingParams starts its message with the field's name
        field = str(e).split(" ", 1)[0]
        raise invalid(field if field in SamplingParams.__struct_fields__ else None, str(e)) from None
