"""Bounds on what one request may ask for, checked before any of it is parsed further,
tokenized, compiled or sent to the engine core (issue 42): so one request's cost is
bounded and it never slows every other request. Every refusal is a 400 naming the field
and the limit. `atomd serve` takes the flagged ones (`add_arguments`); the rest are fixed.
"""
from __future__ import annotations

import argparse
from typing import Any

import msgspec

# Items per list field (and keys of logit_bias). vLLM bounds none of these but the body
# size; these are far above any real use. allowed_token_ids is bounded by the vocabulary.
LIST_FIELDS = ("stop", "stop_token_ids", "bad_words", "logit_bias", "guided_choice", "tools", "messages",
               "chat_template_kwargs")


class RequestLimits(msgspec.Struct, frozen=True, kw_only=True):
    max_prompt_chars: int = 0  # 0: 16 x max_model_len, at least 1 Mi (a prompt is tokenized on a worker thread)
    max_list_items: int = 1024  # per LIST_FIELDS field, and guided choices / structured_outputs.choice
    max_item_chars: int = 4096  # one stop string, bad word or choice
    max_grammar_bytes: int = 64 << 10  # a regex, grammar, JSON schema (as JSON) or all choices together
    max_json_depth: int = 64  # nesting of any JSON object or array a client sends (schemas, tools, ...)
    # a request's own chat template (Qwen3's is 4 KiB, Llama 3.1's 5 KiB, the largest common ones ~20 KiB)
    max_chat_template_chars: int = 64 << 10
    max_prompts: int = 256  # prompts in one completions request (each its own engine request)

    def prompt_chars(self, max_model_len: int) -> int:
        return self.max_prompt_chars or max(1 << 20, 16 * max_model_len)


DEFAULT = RequestLimits()


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--max-prompt-chars", type=int, default=0,
                       help="a longer prompt (all messages together for chat) is a 400 before it is tokenized "
                            "(0: 16 x max_model_len, at least 1,048,576)")
    group.add_argument("--max-list-items", type=int, default=DEFAULT.max_list_items,
                       help="most items in any list field of a request: " + ", ".join(LIST_FIELDS))
    group.add_argument("--max-item-chars", type=int, default=DEFAULT.max_item_chars,
                       help="longest stop string, bad word or guided choice")
    group.add_argument("--max-grammar-bytes", type=int, default=DEFAULT.max_grammar_bytes,
                       help="largest structured-output grammar: a regex, a Lark/GBNF grammar, a JSON schema "
                            "(as JSON) or the choices together")
    group.add_argument("--max-json-depth", type=int, default=DEFAULT.max_json_depth,
                       help="deepest nesting of any JSON object or array in a request (schemas, tools, "
                            "guided_json given as a string)")
    group.add_argument("--max-chat-template-chars", type=int, default=DEFAULT.max_chat_template_chars,
                       help="longest chat_template a chat request may bring (with --trust-request-chat-template)")
    group.add_argument("--max-prompts", type=int, default=DEFAULT.max_prompts,
                       help="most prompts in one completions request (a list of strings or of token-id lists; "
                            "each runs as its own request)")


def from_args(args: argparse.Namespace) -> RequestLimits:
    names = RequestLimits.__struct_fields__
    values = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    for name, value in values.items():
        if value < (0 if name == "max_prompt_chars" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    return RequestLimits(**values)


def json_depth(value: Any, limit: int) -> int:
    """The nesting depth of decoded JSON (0 for a scalar), counted up to `limit` + 1 only."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node)
                         if isinstance(child, (dict, list)))
    return deepest


def text_json_depth(text: str, limit: int) -> int:
    """The bracket nesting of JSON text, without parsing it (brackets in strings skipped),
    counted up to `limit` + 1: json.loads recurses and would raise RecursionError first."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    return deepest
        elif ch in "]}":
            depth -= 1
    return deepest
