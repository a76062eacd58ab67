"""Issue 34's output parsers driven directly (no server): the reasoning parsers
(atomd/api/reasoning.py) and the tool-call parsers (atomd/api/tool_parsers.py).

References: the reasoning split is checked against a regex/str.partition statement of
vLLM's rules (qwen3: `<think>` first opens reasoning, else all content; deepseek_r1: output
starts inside it; the first `</think>` ends it), the llama3_json calls against `json`
decoding of the `;`-separated objects; streaming is checked at every split point of each
text (one cut, and every pair of cuts for short texts, so a tag split across deltas is
covered), and character by character, against the whole-text parse."""
from __future__ import annotations

import itertools
import json
import re

import pytest

from atomd.api import tools as T
from atomd.api.reasoning import REASONING_PARSERS, ReasoningParser, prompt_opens_reasoning
from atomd.api.tool_parsers import TOOL_CALL_PARSERS, HermesParser, Llama3JsonParser

pytestmark = pytest.mark.unit

TEXTS = ["<think>\nLet me add 2 and 2.\n</think>\n\nThe answer is 4.", "The answer is 4.", "<think>never closed",
         "  \n<think>a</think>b</think>c", "x</think>y", "<think></think>", "<think>a<think>b</think>", "",
         "\n\n", "<th", "<thinking>no</thinking>", "say <think>late</think> then", "<think>a</thin", "</think>",
         "ü<think>ß</think>€"]


def reference_split(name: str, text: str, constrained: bool = False,
                    prompt_opened: bool = False) -> tuple[str | None, str | None]:
    """vLLM's split, stated with a regex and str.partition."""
    opened = re.match(r"\s*<think>", text)
    if opened:
        body = text[opened.end():]
    elif (name == "deepseek_r1" or prompt_opened) and not constrained:
        body = text
    else:
        return None, text or None
    reasoning, end, content = body.partition("</think>")
    return reasoning or None, (content if end else "") or None


def feed(parser, pieces: list[str]) -> tuple[str | None, str | None]:
    reasoning = content = ""
    for piece in pieces:
        r, c = parser.stream(piece)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return (reasoning + r) or None, (content + c) or None


def cuts(text: str) -> list[list[str]]:
    """`text` split at every point, at every pair of points when short, and per character."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    if len(text) <= 40:
        out += [[text[:i], text[i:j], text[j:]] for i, j in itertools.combinations(range(len(text) + 1), 2)]
    out.append(list(text))
    return out


@pytest.mark.parametrize("prompt_opened", [False, True])
@pytest.mark.parametrize("constrained", [False, True])
@pytest.mark.parametrize("name", REASONING_PARSERS)
def test_reasoning_split_equals_the_reference_at_every_split_point(name, constrained, prompt_opened):
    for text in TEXTS:
        expected = reference_split(name, text, constrained, prompt_opened)
        assert ReasoningParser.for_request(name, constrained, prompt_opened).parse(text) == expected, text
        for pieces in cuts(text):
            assert feed(ReasoningParser.for_request(name, constrained, prompt_opened), pieces) == expected, pieces


def test_reasoning_rules_by_parser():
    qwen3, r1 = (ReasoningParser.for_request(n, False) for n in ("qwen3", "deepseek_r1"))
    assert qwen3.parse("<think>\nhm\n</think>\n\nok") == ("\nhm\n", "\n\nok")  # the text kept as written
    assert ReasoningParser.for_request("qwen3", False).parse("no tags") == (None, "no tags")
    assert r1.parse("hm</think>ok") == ("hm", "ok")  # the template opened <think>
    assert ReasoningParser.for_request("deepseek_r1", False).parse("never ends") == ("never ends", None)
    assert ReasoningParser.for_request("deepseek_r1", True).parse('{"a": 1}') == (None, '{"a": 1}')  # a grammar's
    thinking = ReasoningParser.for_request("qwen3", False, prompt_opened=True)  # Qwen3-Thinking-2507's template
    assert thinking.parse("hm</think>ok") == ("hm", "ok")
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking off
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningParser.for_request("granite", False)


def test_reasoning_stream_holds_back_only_a_possible_tag():
    parser = ReasoningParser.for_request("qwen3", False)
    assert parser.stream("<thi") == ("", "")  # may still open reasoning
    assert parser.stream("nk>abc</th") == ("abc", "")  # "</th" may end it
    assert parser.stream("ink>") == ("", "")
    assert parser.stream("done <think>") == ("", "done <think>")  # after the end: all content, at once
    plain = ReasoningParser.for_request("qwen3", False)
    assert plain.stream("Hello") == ("", "Hello")  # not a tag: no delay


# ---------------------------------------------------------------------------- tool calls

def hermes_text(calls: list[tuple[str, dict]], before: str = "", after: str = "") -> str:
    body = "\n".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls)
    return before + body + after


def llama_text(calls: list[tuple[str, dict]], tag: bool = False, key: str = "parameters", after: str = "") -> str:
    return ("<|python_tag|>" if tag else "") + "; ".join(json.dumps({"name": n, key: a}) for n, a in calls) + after


def reference_llama(text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    """Llama 3's format by json: the `;`-separated objects, all of them calls."""
    body = text.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return text or None, []
    objs = [json.loads(part) for part in body.split("; ")]
    return None, [(o["name"], o.get("parameters", o.get("arguments"))) for o in objs]


def calls_of(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def stream_tools(parser, pieces: list[str]) -> tuple[str | None, list[dict]]:
    content, calls = "", []
    for piece in pieces:
        c, new = parser.stream(piece)
        content, calls = content + c, calls + new
    c, _ = parser.finish()
    return (content + c) or None, calls


CALLS = [[("get_weather", {"city": "Paris", "unit": "celsius"})],
         [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "a;b}{", "unit": "f"})],
         [("noop", {})]]


def test_llama3_json_calls_equal_json_decoding_streamed_and_not():
    texts = [llama_text(c, tag) for c in CALLS for tag in (False, True)]
    texts += [llama_text(CALLS[0], key="arguments"), "  " + llama_text(CALLS[1]), "The weather is fine.", ""]
    for text in texts:
        content, expected = reference_llama(text)
        whole_content, whole = Llama3JsonParser.parse(text)
        assert (whole_content, calls_of(whole)) == (content, expected), text
        for pieces in cuts(text) if len(text) < 80 else [[text[:i], text[i:]] for i in range(len(text) + 1)]:
            got_content, got = stream_tools(Llama3JsonParser(), pieces)
            assert (got_content, calls_of(got)) == (content, expected), pieces


def test_llama3_json_what_is_not_a_call_is_content():
    assert Llama3JsonParser.parse('{"answer": 42}') == ('{"answer": 42}', [])  # JSON, but no name
    assert Llama3JsonParser.parse('{"name": "f", "parameters": {') == ('{"name": "f", "parameters": {', [])
    content, calls = Llama3JsonParser.parse(llama_text(CALLS[0]) + "; and some words")
    assert content == "and some words" and calls_of(calls) == CALLS[0]
    assert Llama3JsonParser.parse("Sure: {}")[0] == "Sure: {}"  # not at the start: prose
    ids = {c["id"] for c in Llama3JsonParser.parse(llama_text(CALLS[1]))[1]}
    assert len(ids) == 2 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


def test_json_nested_too_deep_for_the_decoder_is_content():
    """A model can write JSON deeper than Python's json recursion allows: content, no crash."""
    deep = "[" * 100_000 + "]" * 100_000
    llama = '{"name": "f", "parameters": ' + deep + "}"
    assert Llama3JsonParser.parse(llama) == (llama, [])
    assert stream_tools(Llama3JsonParser(), [llama[:7], llama[7:]]) == (llama, [])
    hermes = f"<tool_call>\n{llama}\n</tool_call>"
    assert HermesParser.parse(hermes) == (hermes, [])


def test_llama3_json_streams_each_call_once_its_json_closed():
    parser = Llama3JsonParser()
    first, second = json.dumps({"name": "a", "parameters": {"x": 1}}), json.dumps({"name": "b", "parameters": {}})
    assert parser.stream(first[:-1]) == ("", [])
    content, calls = parser.stream(first[-1] + "; ")
    assert content == "" and calls_of(calls) == [("a", {"x": 1})]
    content, calls = parser.stream(second)
    assert calls_of(calls) == [("b", {})] and parser.num_calls == 2


def test_hermes_streamed_equals_whole_at_every_split_point():
    for text in [hermes_text(CALLS[1], "Let me check. ", "\n"), hermes_text(CALLS[0]), "no call <tool_call>{bad}"]:
        whole_content, whole = HermesParser.parse(text)
        for pieces in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
            content, calls = stream_tools(HermesParser(), pieces)
            assert (content, calls_of(calls)) == (whole_content, calls_of(whole)), pieces
    content, calls = HermesParser.parse(hermes_text(CALLS[1], "Let me check. "))
    assert content == "Let me check." and calls_of(calls) == CALLS[1]


def grammar_accepts(grammar: str, text: str) -> bool:
    """Whether llguidance (the engine's grammar compiler) accepts `text` whole under `grammar`."""
    from atomd.model.default import default_model_dir
    from atomd.structured import GrammarCompiler
    from atomd.tokenizer import Tokenizer
    from contracts.sampling import StructuredOutputsParams

    tokenizer = Tokenizer.from_dir(default_model_dir())
    compiler = GrammarCompiler((default_model_dir() / "tokenizer.json").read_text(), tokenizer.vocab_size,
                               [tokenizer.eos_token_id])
    matcher = compiler.compile(StructuredOutputsParams(grammar=grammar)).deep_copy()
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
def test_forced_call_grammar_is_written_in_the_parsers_format(name):
    """A forced call's grammar (atomd/api/tools.py) accepts calls written in the parser's
    format, which the parser reads back, and refuses the other parser's format."""
    params = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    grammar = T.forced_grammar([("add", params)], several=True, tool_call_parser=name)
    calls = [("add", {"a": 1}), ("add", {"a": 22})]
    own = hermes_text(calls) if name == "hermes" else llama_text(calls)
    other = llama_text(calls) if name == "hermes" else hermes_text(calls)
    assert calls_of(TOOL_CALL_PARSERS[name].parse(own)[1]) == calls
    assert grammar_accepts(grammar, own) and not grammar_accepts(grammar, other)


@pytest.mark.parametrize("name", REASONING_PARSERS)
def test_tags_as_single_added_tokens_split_in_a_token_stream(name):
    """A checkpoint whose tokenizer has `<think>` / `</think>` as added (not special) tokens, as
    Qwen3 and DeepSeek-R1 do: streamed token by token through the incremental detokenizer,
    the tags survive decoding and the split equals the reference on the whole text."""
    import tokenizers

    from atomd.model.default import default_model_dir
    from atomd.tokenizer import Tokenizer

    tok = tokenizers.Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    tok.add_tokens([tokenizers.AddedToken("<think>", special=False), tokenizers.AddedToken("</think>", special=False)])
    tokenizer = Tokenizer(tok, {})
    for text in TEXTS[:4]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if "<think>" in text:
            assert tokenizer.token_to_id("<think>") in ids  # one token, not its characters
        detok, parser = tokenizer.incremental_decoder(), ReasoningParser.for_request(name, False)
        pieces = [detok.step(t) for t in ids] + [detok.flush()]
        assert feed(parser, pieces) == reference_split(name, text), text
