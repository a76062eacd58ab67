"""Reasoning output on /v1/chat/completions (issue 34): `--reasoning-parser qwen3|deepseek_r1`
splits a choice's text at `<think>...</think>` into `reasoning_content` (the message's, and
streamed `delta.reasoning_content`) and `content` (what follows `</think>`), as vLLM does.

- `qwen3`: reasoning only when the output opens with `<think>` (leading whitespace allowed),
  or when the rendered prompt ends with `<think>` (a template that opens the block itself, as
  Qwen3-Thinking-2507's does: the output starts inside it); any other output (Qwen3 with
  `enable_thinking: false`, whose template already closed an empty think block) is all content.
- `deepseek_r1`: the chat template already opened `<think>`, so the output starts inside the
  reasoning (a `<think>` the model writes first anyway, as R1-0528 does, is dropped); without
  `</think>` the whole output is reasoning and content is null.

The tags are matched in text, so a tag split across tokens or deltas is found: text that may
be the start of a tag is held back until the next delta shows whether it is. The text is
kept as the model wrote it (no whitespace trimmed), so the streamed reasoning and content
concatenate to the non-streamed ones. Only the first `</think>` ends reasoning; later tags
are content. Tool calls are parsed from the content part only (as vLLM does).

Under a grammar (`response_format`, `structured_outputs`, `guided_*`) the grammar starts
after the reasoning, as vLLM's structured outputs do: the server gives the grammar a
`ReasoningSpan` (`reasoning_span`: the tags' token ids) and the engine's matcher
(atomd/structured.py) lets the reasoning run free, then holds the output to the grammar
from the token after `</think>`; the parsers keep their rules. That takes tags that are
one non-special token each (Qwen3's, DeepSeek-R1's); with any other tokenizer the grammar
spans the whole output and both parsers take the qwen3 rule (reasoning only if the output
opens with `<think>`, which the grammar must then allow). A forced tool call is not parsed
for reasoning at all (the output is the call).
"""
from __future__ import annotations

import msgspec

from atomd.api.tool_parsers import partial_suffix
from contracts.sampling import ReasoningSpan, StructuredOutputsParams

REASONING_PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"
PROMPT_TAIL_TOKENS = 16  # decoded to see whether the chat template opened <think> (<= 7 tokens + whitespace)

_OPENING, _INSIDE, _AFTER = "opening", "inside", "after"  # before the first text; in reasoning; content


class ReasoningParser:
    """One choice's output: (reasoning, content) text, fed delta by delta or whole."""

    def __init__(self, starts_inside: bool):
        self.starts_inside = starts_inside  # the prompt opened <think> (deepseek_r1: always)
        self.state = _OPENING
        self.buffer = ""  # text held back: a possible tag (or its start)

    @classmethod
    def for_request(cls, name: str, constrained: bool, prompt_opened: bool = False) -> "ReasoningParser":
        """The parser `--reasoning-parser name` uses for one choice (`constrained`: a grammar
        shapes the whole output, so it starts where the grammar says (not so for a grammar
        with a ReasoningSpan); `prompt_opened`: the rendered prompt ends with `<think>`; see
        the module doc)."""
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; expected one of {', '.join(REASONING_PARSERS)}")
        return cls(starts_inside=(name == "deepseek_r1" or prompt_opened) and not constrained)

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for an empty part."""
        reasoning, content = self.stream(text)
        more_reasoning, more_content = self.finish()
        return (reasoning + more_reasoning) or None, (content + more_content) or None

    def stream(self, delta: str) -> tuple[str, str]:
        """Feed `delta`; return the (reasoning, content) text that can go out now."""
        self.buffer += delta
        reasoning, content = "", ""
        if self.state == _OPENING:
            head = self.buffer.lstrip()
            if head.startswith(START):
                self.buffer, self.state = head[len(START):], _INSIDE
            elif START.startswith(head):
                return "", ""  # empty, whitespace, or the start of <think>: wait
            else:
                self.state = _INSIDE if self.starts_inside else _AFTER
        if self.state == _INSIDE:
            end = self.buffer.find(END)
            if end >= 0:
                reasoning, self.buffer = self.buffer[:end], self.buffer[end + len(END):]
                self.state = _AFTER
            else:
                keep = partial_suffix(self.buffer, END)
                cut = len(self.buffer) - keep
                reasoning, self.buffer = self.buffer[:cut], self.buffer[cut:]
        if self.state == _AFTER:
            content, self.buffer = self.buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The end of the output: held-back text is what the state says it is."""
        rest, self.buffer = self.buffer, ""
        if self.state == _INSIDE or (self.state == _OPENING and self.starts_inside):
            return rest, ""
        return "", rest


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """Whether a rendered chat prompt (its last characters suffice) leaves a think block open."""
    return prompt_tail.rstrip().endswith(START)


def prompt_ids_open_reasoning(tokenizer, prompt_ids: list[int]) -> bool:
    """prompt_opens_reasoning of a tokenized prompt (the template opened `<think>` itself:
    Qwen3-Thinking, DeepSeek-R1): its last few tokens hold the tag."""
    return prompt_opens_reasoning(tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False))


def grammar_after_reasoning(tokenizer, name: str, so: StructuredOutputsParams, prompt_ids: list[int]
                            ) -> StructuredOutputsParams:
    """`so` with the ReasoningSpan the grammar waits for (unchanged where the tags are no
    single tokens: the grammar then spans the whole output)."""
    span = reasoning_span(tokenizer, name, prompt_ids_open_reasoning(tokenizer, prompt_ids))
    return so if span is None else msgspec.structs.replace(so, reasoning=span)


def reasoning_span(tokenizer, name: str, prompt_opened: bool) -> ReasoningSpan | None:
    """Where the engine lets `--reasoning-parser name`'s reasoning run before a grammar takes
    over, the parser's own rule in token ids: inside from the start (deepseek_r1, or a prompt
    that opened `<think>`), else a block the first token may open; None when a tag it needs
    is not one token that decodes to itself (a special token's text is dropped from the
    output, the parser could not see it)."""
    def single(tag: str) -> int | None:
        ids = tokenizer.encode(tag, add_special_tokens=False)
        return ids[0] if len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) == tag else None

    end = single(END)
    inside = name == "deepseek_r1" or prompt_opened
    start = None if inside else single(START)
    if end is None or (not inside and start is None):
        return None
    return ReasoningSpan(end_token_id=end, start_token_id=start)
