"""Per-request output state: a request's choices (incremental detokenization, stop strings
held back, logprobs, tool calls), rendered as the completions or chat JSON / SSE chunks.
"""
from __future__ import annotations

import argparse
import time
from typing import Protocol

import msgspec

from atomd.api import responses, validation
from atomd.api.metrics import ServerMetrics
from atomd.api.reasoning import ReasoningParser, prompt_ids_open_reasoning
from atomd.api.tool_parsers import TOOL_CALL_PARSERS
from atomd.messages import RequestOutput
from atomd.tokenizer import Tokenizer
from kv_transfer.params import KVTransferParams
from scheduler.stop import cut_at_stop



class RendererHost(Protocol):
    """What a renderer reads of the server (atomd/api/server.py's Server)."""

    args: argparse.Namespace  # --tool-call-parser, --reasoning-parser
    model_name: str
    metrics: ServerMetrics
    tokenizer: Tokenizer


class Choice:
    """One choice's output so far: text (incremental, stop strings held back), tokens, logprobs."""

    __slots__ = ("index", "detok", "text", "emitted", "token_ids", "logprobs", "sent_logprobs", "finished",
                 "finish_reason", "started", "closed")

    def __init__(self, index: int, detok):
        self.index, self.detok = index, detok
        self.text = ""         # everything decoded so far
        self.emitted = 0       # chars of `text` already handed out
        self.token_ids: list[int] = []
        self.logprobs: list[tuple[int, dict]] = []  # (token id, engine entry)
        self.sent_logprobs = 0
        self.finished = False
        self.finish_reason: str | None = None
        self.started = False   # its first chunk went out (a stream's role / echo prefix)
        self.closed = False    # its last chunk went out


class RequestRenderer:
    """Accumulates one request's deltas: per choice text (incremental, stop strings held
    back) and logprobs, then usage and metrics for the request. Subclasses render the
    endpoint's JSON. Choices stream interleaved, in the order their tokens arrive."""

    opens_early = False  # a choice's first chunk goes out before it has text (chat's role, echo)

    def __init__(self, server: RendererHost, request_id: str, req, checked: validation.Checked, prompt_ids: list[int],
                 prompt_text: str | None = None):
        self.id, self.req, self.num_logprobs = request_id, req, checked.logprobs
        self.model, self.created = server.model_name, int(time.time())
        self.tokenizer, self.metrics = server.tokenizer, server.metrics
        self.choices = [Choice(i, server.tokenizer.incremental_decoder()) for i in range(req.n)]
        self.prompt_ids = prompt_ids
        self.prompt_text = prompt_text
        self.prompt_logprobs: list | None = None  # the engine's entries, from the first output
        self.stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.finished = False
        self.finish_reason: str | None = None
        self.num_prompt_tokens = self.num_cached_tokens = 0
        self.kv_transfer_params: KVTransferParams | None = None  # P's, for D
        self.t_arrival = self.t_last = time.perf_counter()
        self.first_token_seen = False
        self.index_base = 0  # several prompts in one request: this prompt's first choice index (prompt-major)

    def add(self, deltas: list[RequestOutput]) -> list[bytes]:
        """Fold `deltas` in; return the stream chunks for what is new (one per choice that has
        something to say, in arrival order)."""
        touched: dict[int, None] = {}
        last: RequestOutput | None = None
        for d in deltas:
            self.observe(d)
            if d.prompt_logprobs is not None:
                self.prompt_logprobs = d.prompt_logprobs
            c = self.choices[d.index] if d.index < len(self.choices) else self.choices[0]
            if d.finished:
                self.kv_transfer_params, last = d.kv_transfer_params, d
            if c.finished:  # cut at a stop string here already: the rest is past it
                continue
            touched[c.index] = None
            for i, tid in enumerate(d.new_token_ids):
                c.token_ids.append(tid)
                if self.num_logprobs is not None and d.new_logprobs:
                    c.logprobs.append((tid, d.new_logprobs[i]))
                c.text += c.detok.step(tid)
            if d.finish_reason is not None or d.finished:
                self.finish_choice(c, d.finish_reason)
            if d.finished:  # the request's last output: every choice is done
                for other in self.choices:
                    if not other.finished:
                        touched[other.index] = None
                        self.finish_choice(other, d.finish_reason)
        parts = []
        for index in touched:
            c = self.choices[index]
            self.cut_at_stop(c)
            start = c.emitted
            end = len(c.text) if c.finished else max(c.emitted, len(c.text) - self.hold)
            c.emitted = end
            items = c.logprobs[c.sent_logprobs:]
            c.sent_logprobs = len(c.logprobs)
            if c.text[start:end] or (c.finished and not c.closed) or items or (not c.started and self.opens_early):
                parts.append((c, c.text[start:end], items))
        if not self.finished and (last is not None or all(c.finished for c in self.choices)):
            self.finish(last)
            if not parts:  # the request's end still gets its chunk (it carries kv_transfer_params)
                parts.append((self.choices[0], "", []))
        chunks = []
        for j, (c, text, items) in enumerate(parts):
            final = self.finished and j == len(parts) - 1
            chunks.extend(self.chunks(c, text, items, c.finish_reason if c.finished else None, final))
            c.started = True
            c.closed = c.finished
        return chunks

    def finish_choice(self, c: Choice, reason: str | None) -> None:
        if c.finished:
            return
        c.text += c.detok.flush()
        self.cut_at_stop(c)
        if not c.finished:
            c.finished, c.finish_reason = True, reason

    def observe(self, d: RequestOutput) -> None:
        self.num_prompt_tokens, self.num_cached_tokens = d.num_prompt_tokens, d.num_cached_tokens
        now = time.perf_counter()
        if d.new_token_ids:
            if not self.first_token_seen:
                self.metrics.ttft.observe(now - self.t_arrival)
            self.metrics.on_tokens(len(d.new_token_ids), now - self.t_last if self.first_token_seen else None)
            self.first_token_seen, self.t_last = True, now

    def finish(self, d: RequestOutput | None) -> None:
        """Every choice is done: by the engine (`d`, the request's last output), or by the
        text of a stop string first."""
        self.finished = True
        self.finish_reason = self.choices[0].finish_reason
        self.metrics.on_finished(self.finish_reason or "unknown", self.num_prompt_tokens,
                                 time.perf_counter() - self.t_arrival, d.timing if d else None)

    def cut_at_stop(self, c: Choice) -> None:
        """Truncate a choice's text at the first stop string: the engine stops on it too, but
        the text of the token that completed it may run past it."""
        if not self.stops:
            return
        # text up to `emitted` was searched before (the last `hold` characters are held back)
        c.text, stop = cut_at_stop(c.text, self.stops, self.req.include_stop_str_in_output, c.emitted)
        if stop is not None and not c.finished:
            c.finished, c.finish_reason = True, "stop"

    def usage(self) -> responses.Usage:
        n = sum(len(c.token_ids) for c in self.choices)  # every returned choice counts
        return responses.Usage(self.num_prompt_tokens, n, self.num_prompt_tokens + n,
                       responses.PromptTokensDetails(self.num_cached_tokens))

    def token_text(self, tid: int) -> str:
        return self.tokenizer.decode([tid])

    def include_usage(self) -> bool:
        return bool(self.req.stream_options and self.req.stream_options.include_usage)

    def vllm_prompt_logprobs(self) -> responses.PromptLogprobs | msgspec.UnsetType:
        """vLLM's `prompt_logprobs` (when the request asked for them by that name)."""
        if self.req.prompt_logprobs is None:
            return msgspec.UNSET
        out: responses.PromptLogprobs = []
        for pos, entry in enumerate(self.prompt_logprobs or []):
            if entry is None:
                out.append(None)
                continue
            tid = self.prompt_ids[pos]
            tokens = {str(tid): responses.PromptLogprob(entry.logprob, entry.rank, self.token_text(tid))}
            for rank, (t, lp) in enumerate(entry.top, start=1):
                tokens.setdefault(str(t), responses.PromptLogprob(lp, rank, self.token_text(t)))
            out.append(tokens)
        return out

    def stream_end(self) -> list[bytes]:
        return []


class CompletionRenderer(RequestRenderer):
    @property
    def opens_early(self) -> bool:
        return self.req.echo

    def logprobs_block(self, items: list[tuple[int, dict]], offset: int,
                       echo: bool = False) -> responses.CompletionLogprobs:
        tokens, lps, tops, offsets = [], [], [], []
        if echo:  # the prompt's tokens first: the first has no logprob (OpenAI's echo)
            entries = self.prompt_logprobs or []
            for pos, tid in enumerate(self.prompt_ids):
                entry = entries[pos] if pos < len(entries) else None
                text = self.token_text(tid)
                tokens.append(text)
                lps.append(entry.logprob if entry else None)
                tops.append({self.token_text(t): lp for t, lp in entry.top} if entry else None)
                offsets.append(offset)
                offset += len(text)
        for tid, entry in items:
            text = self.token_text(tid)
            tokens.append(text)
            lps.append(entry.logprob)
            tops.append({self.token_text(t): lp for t, lp in entry.top})
            offsets.append(offset)
            offset += len(text)
        return responses.CompletionLogprobs(tokens, lps, tops, offsets)

    def echo_text(self) -> str:
        if self.prompt_text is None:
            self.prompt_text = self.tokenizer.decode(self.prompt_ids)
        return self.prompt_text

    def chunks(self, c: Choice, text: str, items, finish_reason, final: bool) -> list[bytes]:
        echo_now = self.req.echo and not c.started  # a choice's first chunk starts with the prompt
        prefix = self.echo_text() if self.req.echo else ""
        offset = 0 if echo_now else len(prefix) + c.emitted - len(text)  # of this chunk's text, echo included
        if echo_now:
            text = prefix + text
        lp = self.logprobs_block(items, offset, echo_now) if self.num_logprobs is not None else None
        usage = None if self.include_usage() else msgspec.UNSET
        kv = self.kv_transfer_params if final else msgspec.UNSET
        plp = self.vllm_prompt_logprobs() if not c.started else msgspec.UNSET
        return [msgspec.json.encode(responses.CompletionResponse(
            self.id, self.created, self.model,
            [responses.CompletionChoice(self.index_base + c.index, text, lp, finish_reason, plp)],
            usage=usage, kv_transfer_params=kv))]

    def response(self) -> responses.CompletionResponse:
        echo = self.req.echo
        plp = self.vllm_prompt_logprobs()
        choices = []
        for c in self.choices:
            lp = self.logprobs_block(c.logprobs, 0, echo) if self.num_logprobs is not None else None
            text = self.echo_text() + c.text if echo else c.text
            choices.append(responses.CompletionChoice(self.index_base + c.index, text, lp, c.finish_reason, plp))
        return responses.CompletionResponse(self.id, self.created, self.model, choices, usage=self.usage(),
                                            kv_transfer_params=self.kv_transfer_params)

    def full_response(self) -> bytes:
        return msgspec.json.encode(self.response())

    def stream_end(self) -> list[bytes]:
        if not self.include_usage():
            return []
        return [msgspec.json.encode(responses.CompletionResponse(self.id, self.created, self.model, [],
                                                         usage=self.usage()))]


class ChatRenderer(RequestRenderer):
    """Chat JSON / chunks. Each choice's text goes through the reasoning parser (with
    --reasoning-parser; atomd/api/reasoning.py): `<think>` text becomes `reasoning_content`;
    then, with tools (tool_choice not none), the rest through the tool-call parser
    (atomd/api/tool_parsers.py): calls become `tool_calls` (streamed as OpenAI's deltas: the
    call's id, type and name with empty arguments, then its arguments) and `finish_reason`
    "tool_calls"; the rest is `content`, the same streamed or not."""

    opens_early = True

    def __init__(self, server: RendererHost, request_id: str, req, checked: validation.Checked, prompt_ids: list[int]):
        super().__init__(server, request_id, req, checked, prompt_ids)
        self.tool_parser = TOOL_CALL_PARSERS[server.args.tool_call_parser] if checked.parse_tool_calls else None
        self.tool_parsers = [self.tool_parser() for _ in self.choices] if self.tool_parser else None
        # messages carry reasoning_content (maybe null) whenever the server parses reasoning
        self.reasoning_field = None if server.args.reasoning_parser else msgspec.UNSET
        self.reasoning = server.args.reasoning_parser if not checked.forced_tool_call else None  # output: the call
        # a grammar over the whole output (not one that waits for the reasoning to end)
        so = checked.structured_outputs
        self.constrained = so is not None and so.reasoning is None
        self.prompt_opened = bool(self.reasoning) and prompt_ids_open_reasoning(server.tokenizer, prompt_ids)
        self.reasoning_parsers = [self.new_reasoning_parser() for _ in self.choices] if self.reasoning else None
        self.include_reasoning = req.include_reasoning  # false: the reasoning is parsed out and dropped

    def new_reasoning_parser(self) -> ReasoningParser:
        return ReasoningParser.for_request(self.reasoning, self.constrained, self.prompt_opened)

    def tool_finish_reason(self, reason: str | None, num_calls: int) -> str | None:
        return "tool_calls" if num_calls and reason == "stop" else reason

    def logprobs_block(self, items: list[tuple[int, dict]]) -> responses.ChatLogprobs:
        def entry_of(tid: int, lp: float) -> tuple[str, float, list[int]]:
            text = self.token_text(tid)
            return text, lp, list(text.encode("utf-8"))

        content = []
        for tid, entry in items:
            tops = [responses.TopLogprob(*entry_of(t, lp)) for t, lp in entry.top]
            content.append(responses.TokenLogprob(*entry_of(tid, entry.logprob), top_logprobs=tops))
        return responses.ChatLogprobs(content)

    def chunk_of(self, index: int, delta: responses.ChatDelta, items, finish_reason, **extra) -> bytes:
        lp = self.logprobs_block(items) if self.num_logprobs is not None and items else None
        usage = None if self.include_usage() else msgspec.UNSET
        return msgspec.json.encode(responses.ChatCompletionChunk(
            self.id, self.created, self.model, [responses.ChatChunkChoice(index, delta, lp, finish_reason)],
            usage=usage, **extra))

    def chunks(self, c: Choice, text: str, items, finish_reason, final: bool) -> list[bytes]:
        out = []
        if not c.started:  # OpenAI: each choice opens with the role
            first = not any(o.started for o in self.choices)
            plp = self.vllm_prompt_logprobs() if first else msgspec.UNSET
            out.append(self.chunk_of(c.index, responses.ChatDelta(role="assistant", content=""), [], None,
                                     prompt_logprobs=plp))
            if not (text or items or finish_reason or final):
                return out
        kv = self.kv_transfer_params if final else msgspec.UNSET
        if self.tool_parsers is None and self.reasoning_parsers is None:
            out.append(self.chunk_of(c.index, responses.ChatDelta(content=text), items, finish_reason, kv_transfer_params=kv))
            return out
        deltas, num_calls = self.parsed_deltas(c, text)
        if not deltas:
            if not (items or finish_reason is not None or kv is not msgspec.UNSET):
                return out
            deltas.append(responses.ChatDelta(content=""))
        reason = self.tool_finish_reason(finish_reason, num_calls)
        return out + [self.chunk_of(c.index, d, items if j == 0 else [], reason if j == len(deltas) - 1 else None,
                                    **({"kv_transfer_params": kv} if j == len(deltas) - 1 else {}))
                      for j, d in enumerate(deltas)]

    def parsed_deltas(self, c: Choice, text: str) -> tuple[list[responses.ChatDelta], int]:
        """A choice's new text through its parsers: the deltas to send (reasoning and content
        in one, then each completed call as two) and the choice's calls so far."""
        reasoning = ""
        if self.reasoning_parsers is not None:
            parser = self.reasoning_parsers[c.index]
            reasoning, text = parser.stream(text)
            if c.finished:
                more_reasoning, more_text = parser.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
            if not self.include_reasoning:
                reasoning = ""
        calls, num_calls = [], 0
        if self.tool_parsers is not None:
            tools = self.tool_parsers[c.index]
            first_call = tools.num_calls
            text, calls = tools.stream(text)
            if c.finished:
                text += tools.finish()[0]
            calls, num_calls = list(enumerate(calls, start=first_call)), tools.num_calls
        deltas = [responses.ChatDelta(content=text or None, reasoning_content=reasoning or None)] if text or reasoning else []
        for k, call in calls:
            fn = call["function"]
            deltas.append(responses.ChatDelta(tool_calls=[{"index": k, "id": call["id"], "type": "function",
                                                   "function": {"name": fn["name"], "arguments": ""}}]))
            deltas.append(responses.ChatDelta(tool_calls=[{"index": k, "function": {"arguments": fn["arguments"]}}]))
        return deltas, num_calls

    def message(self, c: Choice) -> tuple[responses.ChatMessageOut, str | None]:
        if self.tool_parsers is None and self.reasoning_parsers is None:
            return responses.ChatMessageOut("assistant", c.text), c.finish_reason
        reasoning, content = self.reasoning_field, c.text
        if self.reasoning_parsers is not None:
            reasoning, content = self.new_reasoning_parser().parse(c.text)
            if not self.include_reasoning:
                reasoning = None
        calls = []
        if self.tool_parser is not None:
            content, calls = self.tool_parser.parse(content or "")
        return (responses.ChatMessageOut("assistant", content, tool_calls=calls or msgspec.UNSET, reasoning_content=reasoning),
                self.tool_finish_reason(c.finish_reason, len(calls)))

    def full_response(self) -> bytes:
        choices = []
        for c in self.choices:
            message, reason = self.message(c)
            choices.append(responses.ChatChoice(c.index, message, self.logprobs_block(c.logprobs)
                                        if self.num_logprobs is not None else None, reason))
        return msgspec.json.encode(responses.ChatCompletionResponse(
            self.id, self.created, self.model, choices, usage=self.usage(),
            kv_transfer_params=self.kv_transfer_params, prompt_logprobs=self.vllm_prompt_logprobs()))

    def stream_end(self) -> list[bytes]:
        if not self.include_usage():
            return []
        return [msgspec.json.encode(responses.ChatCompletionChunk(self.id, self.created, self.model, [],
                                                          usage=self.usage()))]
