"""Text <-> token ids for one checkpoint: HF `tokenizer.json` through `tokenizers`, chat
templates through jinja2 (rendered the way `transformers.apply_chat_template` does), and
incremental detokenization for streaming.
"""
from __future__ import annotations

import datetime
import functools
import json
import pathlib
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers

_REPLACEMENT = "\ufffd"  # what a byte-level BPE decodes a split multi-byte character to

# A longer text is tokenized without the GIL, so the server's event loop runs meanwhile
# (the server tokenizes on a parser thread; issue 42). Shorter ones: encode() is cheaper.
GIL_FREE_CHARS = 8192
# A chat template may come with a request (atomd/api/chat_templates.py): one render builds at
# most this many range() items in all and strings or lists no longer than this by `*`
# (jinja's sandbox bounds one range() to 100,000 items, not nested ones, and `*` not at all).
MAX_RENDER_ITEMS = 1 << 20


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores special tokens as strings or as {"content": ...} objects."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, tokenizer: tokenizers.Tokenizer, config: dict[str, Any],
                 generation_config: dict[str, Any] | None = None):
        self._tok = tokenizer
        self.config = config
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.pad_token = _token_text(config.get("pad_token"))
        self.unk_token = _token_text(config.get("unk_token"))
        self.bos_token_id = self.token_to_id(self.bos_token)
        self.eos_token_id = self.token_to_id(self.eos_token)
        eos = (generation_config or {}).get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        # the model's other end-of-turn tokens (generation_config lists them): stop like EOS
        self.stop_token_ids = [int(t) for t in eos_ids if t != self.eos_token_id]
        if self.eos_token_id is None and eos_ids:
            self.eos_token_id = int(eos_ids[0])
        self.chat_template: str | None = config.get("chat_template")

    @classmethod
    def from_dir(cls, path: str | pathlib.Path) -> "Tokenizer":
        path = pathlib.Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"model directory {path} has no tokenizer.json")
        config = _read_json(path / "tokenizer_config.json")
        if config.get("chat_template") is None and (path / "chat_template.jinja").is_file():
            config["chat_template"] = (path / "chat_template.jinja").read_text()
        return cls(tokenizers.Tokenizer.from_file(str(tok_file)), config,
                   _read_json(path / "generation_config.json"))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary's string for an id (byte-level pieces as stored, e.g. "Ġhello")."""
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > GIL_FREE_CHARS:  # encode() holds the GIL throughout, encode_batch() drops it
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **extra: Any) -> str:
        """Render `messages` with `chat_template` (default: the checkpoint's); `extra` are more
        template variables (tools, chat_template_kwargs)."""
        source = chat_template if chat_template is not None else self.chat_template
        if source is None:
            raise ValueError("messages: this model's tokenizer_config.json has no chat_template")
        return compiled_template(source).render(range=_RangeBudget(), messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                     pad_token=self.pad_token, unk_token=self.unk_token, **extra)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **extra: Any) -> list[int]:
        # the template writes the special tokens itself (HF tokenizes it without adding any)
        text = self.apply_chat_template(messages, add_generation_prompt, **extra)
        return self.encode(text, add_special_tokens=False)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens)


class IncrementalDecoder:
    """Streams text token by token. Decoding each token alone breaks multi-byte characters
    and the spacing some decoders add; so decode a small window of recent tokens and emit
    only what grew past the already emitted part, holding back text that ends in a
    replacement character (a character whose remaining bytes are still to come)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # window start: context for the decoder
        self.read_offset = 0  # tokens before this are emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def step(self, token_id: int) -> str:
        self.token_ids.append(int(token_id))
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return full[len(prefix):]

    def flush(self) -> str:
        """Whatever is still held back (a truly invalid byte sequence stays a replacement char)."""
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open() as f:
        return json.load(f)


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
