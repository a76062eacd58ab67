"""Prompt -> token ids in the router, the way the engines tokenize, for kv_aware routing.

kv_aware scores a worker by the chained block hashes of the request's tokens
(contracts/block_hash.py), so the router must see the same token ids the engine will:
a completion prompt is encoded with the special tokens (atomd/tokenizer.py `encode`), a
token-id prompt is taken as is, chat messages are rendered with the checkpoint's chat
template (or the engines' --chat-template, given to the router by the same flag) in the
engines' own environment (contracts/chat_template.py) and the request's `chat_template_kwargs`,
and encoded without special tokens; a request that brings its own `chat_template` is not
rendered here (the engines run one only with --trust-request-chat-template). Only
`tokenizers` and contracts/, never the engine's code (the router does not import atomd).

A wrong guess costs only a worse placement, never a wrong answer: the engines tokenize
for themselves.
"""
from __future__ import annotations

import logging
import pathlib
from typing import Any

from contracts.chat_template import SPECIAL_TOKENS, read_tokenizer_config, render, special_token_text

logger = logging.getLogger("atomd.router.tokenizer")


class RouterTokenizer:
    def __init__(self, path: str | pathlib.Path, chat_template: str | None = None):
        """`chat_template`: the engines' --chat-template (a file, or the template itself)."""
        import tokenizers

        path = pathlib.Path(path)
        tok_file = path if path.is_file() else path / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"tokenizer: no tokenizer.json at {path}")
        self.path = str(path)
        self._tok = tokenizers.Tokenizer.from_file(str(tok_file))
        config = read_tokenizer_config(tok_file.parent)
        template = config.get("chat_template")
        if chat_template is not None:
            template = _file_or_text(chat_template)
        self._template_source = template
        self._specials = {k: special_token_text(config.get(k)) for k in SPECIAL_TOKENS}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> list[int] | None:
        if self._template_source is None:
            return None
        text = render(self._template_source, messages, add_generation_prompt, self._specials, **extra)
        return self.encode(text, add_special_tokens=False)

    def token_ids(self, body: dict) -> list[int] | None:
        """The prompt's token ids as an engine would see them; None when it cannot tell."""
        try:
            if "messages" in body:
                messages = body["messages"]
                if not isinstance(messages, list) or body.get("chat_template") is not None:
                    return None  # a request's own template is not run here (an engine may refuse it): by load
                extra = body.get("chat_template_kwargs") or {}
                return self.encode_chat(messages, body.get("add_generation_prompt", True),
                                        **(extra if isinstance(extra, dict) else {}))
            return prompt_token_ids(body.get("prompt"), self)
        except Exception as e:  # a template the router cannot render: place by load
            logger.debug("cannot tokenize a request: %s", e)
            return None


def _file_or_text(value: str) -> str:
    """A template flag's value: the file it names, else the template itself."""
    try:
        return pathlib.Path(value).read_text()
    except OSError:  # no such file (or a name no path can have): inline
        return value


def prompt_token_ids(prompt: Any, tokenizer: RouterTokenizer | None) -> list[int] | None:
    """A completion prompt's ids: a list of ints as is, a string through the tokenizer; a
    batch (list of prompts) by its first."""
    if isinstance(prompt, list) and prompt:
        if all(type(t) is int for t in prompt):
            return prompt
        return prompt_token_ids(prompt[0], tokenizer)
    if isinstance(prompt, str) and tokenizer is not None:
        return tokenizer.encode(prompt)
    return None
