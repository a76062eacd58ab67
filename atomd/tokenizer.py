"""Text <-> token ids for one checkpoint: HF `tokenizer.json` through `tokenizers`, chat
templates through jinja2 (rendered the way `transformers.apply_chat_template` does), and
incremental detokenization for streaming.
"""
from __future__ import annotations

import json
import pathlib
from typing import Any

import tokenizers

from contracts.chat_template import SPECIAL_TOKENS, read_tokenizer_config, render, special_token_text

_REPLACEMENT = "\ufffd"  # what a byte-level BPE decodes a split multi-byte character to

# A longer text is tokenized without the GIL, so the server's event loop runs meanwhile
# (the server tokenizes on a parser thread; issue 42). Shorter ones: encode() is cheaper.
GIL_FREE_CHARS = 8192
class Tokenizer:
    def __init__(self, tokenizer: tokenizers.Tokenizer, config: dict[str, Any],
                 generation_config: dict[str, Any] | None = None):
        self._tok = tokenizer
        self.config = config
        self.specials = {k: special_token_text(config.get(k)) for k in SPECIAL_TOKENS}
        self.bos_token, self.eos_token = self.specials["bos_token"], self.specials["eos_token"]
        self.pad_token, self.unk_token = self.specials["pad_token"], self.specials["unk_token"]
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
        return cls(tokenizers.Tokenizer.from_file(str(tok_file)), read_tokenizer_config(path),
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
        return render(source, messages, add_generation_prompt, self.specials, **extra)

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
