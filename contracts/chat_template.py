"""Chat templates, rendered the way `transformers.apply_chat_template` renders them, in one
environment for every side that renders one: the engines' API process (atomd/tokenizer.py) and
the router's kv_aware tokenizer (router/tokenizer.py) must turn the same messages into the same
text, or the router's block hashes miss what the engine cached. jinja2 and the standard library
only.
"""
from __future__ import annotations

import datetime
import functools
import json
import pathlib
from typing import Any

import jinja2
import jinja2.sandbox

# A chat template may come with a request (atomd/api/chat_templates.py): one render builds at
# most this many range() items in all and strings or lists no longer than this by `*`
# (jinja's sandbox bounds one range() to 100,000 items, not nested ones, and `*` not at all).
MAX_RENDER_ITEMS = 1 << 20
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def special_token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or as {"content": ...} objects."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def read_tokenizer_config(directory: pathlib.Path) -> dict[str, Any]:
    """A checkpoint's tokenizer_config.json ({} without one), its `chat_template` taken from
    chat_template.jinja when the JSON has none (newer transformers saves it there)."""
    path = directory / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    if config.get("chat_template") is None and (directory / "chat_template.jinja").is_file():
        config["chat_template"] = (directory / "chat_template.jinja").read_text()
    return config


def render(source: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
           specials: dict[str, str | None], **extra: Any) -> str:
    """`messages` through the template `source`; `specials` the checkpoint's special tokens'
    texts (SPECIAL_TOKENS), `extra` more template variables (tools, chat_template_kwargs)."""
    return compiled_template(source).render(
        range=_RangeBudget(), messages=messages, add_generation_prompt=add_generation_prompt,
        bos_token=specials.get("bos_token") or "", eos_token=specials.get("eos_token") or "",
        pad_token=specials.get("pad_token"), unk_token=specials.get("unk_token"), **extra)


def _raise_exception(message: str) -> None:
    raise ValueError(f"messages: {message}")


class _BoundedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """transformers' sandbox, with `*` and `**` bounded (MAX_RENDER_ITEMS)."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(right, int) and right > 64 and left not in (0, 1, -1):
            raise jinja2.sandbox.SecurityError(f"{left} ** {right}: too large a power for a chat template")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_RENDER_ITEMS:
                    raise jinja2.sandbox.SecurityError(f"a sequence of {len(seq) * n} items: a chat template "
                                                       f"builds at most {MAX_RENDER_ITEMS}")
        return super().call_binop(context, operator, left, right)


class _RangeBudget:
    """range() for one render: MAX_RENDER_ITEMS items in all, so nested loops are bounded too."""

    def __init__(self) -> None:
        self.left = MAX_RENDER_ITEMS

    def __call__(self, *args: int) -> range:
        items = range(*args)
        self.left -= len(items)
        if self.left < 0:
            raise jinja2.sandbox.SecurityError(f"range(): a chat template iterates at most {MAX_RENDER_ITEMS} "
                                               "range items in all")
        return items


@functools.lru_cache(maxsize=16)  # the checkpoint's, --chat-template's and a few requests' own
def compiled_template(source: str) -> jinja2.Template:
    """The environment transformers renders chat templates in (sandboxed, trimmed blocks),
    with the sizes a template builds bounded."""
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)
