"""Prompt -> token ids in the router, the way the engines tokenize, for kv_aware routing.

kv_aware scores a worker by the chained block hashes of the request's tokens
(contracts/block_hash.py), so the router must see the same token ids the engine will:
a completion prompt is encoded with the special tokens (atomd/tokenizer.py `encode`), a
token-id prompt is taken as is, chat messages are rendered with the checkpoint's chat
template (or the engines' --chat-template, given to the router by the same flag; the
environment transformers uses) and the request's `chat_template_kwargs`,
and encoded without special tokens; a request that brings its own `chat_template` is not
rendered here (the engines run one only with --trust-request-chat-template). Only
`tokenizers` and jinja2, never the engine's code (the router does not import atomd).

A wrong guess costs only a worse placement, never a wrong answer: the engines tokenize
for themselves.
"""
from __future__ import annotations

import datetime
import json
import logging
import pathlib
from typing import Any

logger = logging.getLogger("atomd.router.tokenizer")


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


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
        cfg_file = tok_file.parent / "tokenizer_config.json"
        config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        template = config.get("chat_template")
        if template is None and (tok_file.parent / "chat_template.jinja").is_file():
            template = (tok_file.parent / "chat_template.jinja").read_text()
        if chat_template is not None:
            template = _file_or_text(chat_template)
        self._template_source = template
        self._template = None
        self._specials = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> list[int] | None:
        if self._template_source is None:
            return None
        if self._template is None:
            import jinja2.sandbox

            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                               extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
            self._template = env.from_string(self._template_source)
        sp = self._specials
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=sp["bos_token"] or "", eos_token=sp["eos_token"] or "",
                                     pad_token=sp["pad_token"], unk_token=sp["unk_token"], **extra)
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


def _raise(message: str) -> None:
    raise ValueError(message)


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
