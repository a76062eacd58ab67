"""Benchmark prompts: random, shared-prefix (one system prompt, many users; or
`--shared-prefix-groups` G system prompts, each prompt drawing one), or a ShareGPT file.

Completions prompts are sent as token-id lists, so their lengths are exact and shared
prefixes line up with the server's KV blocks without any tokenizer on the client.
The chat endpoint needs text: the ids are decoded with `--tokenizer` when one is given,
otherwise the prompt is random words and its length comes from the server's usage.
"""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

import numpy as np

DATASETS = ("random", "shared-prefix", "sharegpt-file")
# Without a tokenizer we do not know which ids are special; tokenizers keep them at the bottom.
FIRST_PLAIN_ID = 10
WORDS = ("the of and to in is was for on that with as by at from his her an it were which are "
         "this be had not or one their all new two has but first after also been its they more "
         "time who other into over year when city may some than only most she would during "
         "these about three world where under then many can him while out such before state").split()


@dataclass
class SampleRequest:
    """One prompt; `prompt_len` is None when only the server can count it."""

    prompt: str | list[int]
    prompt_len: int | None
    expected_output_len: int


class TokenSpace:
    """Where random prompts come from: a tokenizer's plain vocabulary, or ids below `vocab_size`."""

    def __init__(self, vocab_size: int, tokenizer=None):
        self.tokenizer = tokenizer
        if tokenizer is not None:
            special = set(tokenizer.get_added_tokens_decoder())
            self.ids = np.array([i for i in range(tokenizer.get_vocab_size()) if i not in special])
        else:
            if vocab_size <= FIRST_PLAIN_ID:
                raise ValueError(f"vocab_size must be > {FIRST_PLAIN_ID}, got {vocab_size}")
            self.ids = np.arange(FIRST_PLAIN_ID, vocab_size)

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        return [int(t) for t in rng.choice(self.ids, size=n)]

    def count(self, text: str) -> int | None:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids) if self.tokenizer else None

    def as_text(self, ids: list[int], rng: np.random.Generator) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.decode(ids)
        return " ".join(rng.choice(WORDS, size=len(ids)))


def load_tokenizer(path: str):
    """A Hugging Face `tokenizer.json` (or the directory holding it), via `tokenizers`."""
    from tokenizers import Tokenizer

    p = pathlib.Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise ValueError(f"tokenizer: no tokenizer.json at {path}")
    return Tokenizer.from_file(str(file))


def sample_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> np.ndarray:
    """Uniform integers in [length*(1-r), length*(1+r)], at least 1 (vLLM's random dataset)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if length < 1:
        raise ValueError(f"lengths must be >= 1, got {length}")
    low, high = max(1, int(length * (1 - range_ratio))), int(length * (1 + range_ratio))
    return rng.integers(low, max(low, high) + 1, size=n)


def random_requests(n: int, input_len: int, output_len: int, range_ratio: float, space: TokenSpace,
                    rng: np.random.Generator, chat: bool, prefix_len: int = 0,
                    prefix_groups: int = 1) -> list[SampleRequest]:
    """Random prompts; with `prefix_len`, every prompt starts with `prefix_len` shared tokens:
    one prefix, or with `prefix_groups` G, one of G prefixes drawn uniformly per prompt (what a
    cache-aware router can keep apart)."""
    if prefix_len < 0:
        raise ValueError(f"shared_prefix_len must be >= 0, got {prefix_len}")
    if prefix_groups < 1:
        raise ValueError(f"shared_prefix_groups must be >= 1, got {prefix_groups}")
    prefixes = [space.sample(rng, prefix_len) for _ in range(prefix_groups)]
    in_lens = sample_lengths(rng, n, input_len, range_ratio)
    out_lens = sample_lengths(rng, n, output_len, range_ratio)
    prefix_texts = [space.as_text(p, rng) + " " if chat and p else "" for p in prefixes]
    groups = rng.integers(0, prefix_groups, size=n) if prefix_groups > 1 else np.zeros(n, dtype=int)
    requests = []
    for in_len, out_len, g in zip(in_lens, out_lens, groups):
        prefix, prefix_text = prefixes[g], prefix_texts[g]
        ids = space.sample(rng, int(in_len))
        if chat:
            text = prefix_text + space.as_text(ids, rng)
            requests.append(SampleRequest(text, space.count(text), int(out_len)))
        else:
            requests.append(SampleRequest(prefix + ids, prefix_len + int(in_len), int(out_len)))
    return requests


def first_exchange(conversation) -> tuple[str, str] | None:
    """(first prompt, its reply) of one ShareGPT entry; None for entries without both."""
    turns = conversation.get("conversations") if isinstance(conversation, dict) else None
    if not isinstance(turns, list) or len(turns) < 2 or not all(isinstance(t, dict) for t in turns[:2]):
        return None
    prompt, reply = turns[0].get("value"), turns[1].get("value")
    return (prompt, reply) if isinstance(prompt, str) and isinstance(reply, str) and prompt else None


def sharegpt_requests(path: str, n: int, space: TokenSpace, rng: np.random.Generator,
                      output_len: int | None) -> list[SampleRequest]:
    """First human turn as prompt; the reply's token count as output length when a tokenizer can
    count it (vLLM's ShareGPT sampling, with its too-short / too-long filters), else `output_len`."""
    try:
        data = json.loads(pathlib.Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"dataset_path: cannot read ShareGPT JSON {path}: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"dataset_path: {path} is not a ShareGPT list of conversations")
    pairs = [turns for c in data if (turns := first_exchange(c)) is not None]
    order = rng.permutation(len(pairs))
    requests = []
    for i in order:
        prompt, reply = pairs[i]
        prompt_len = space.count(prompt)
        out_len = output_len if output_len is not None else space.count(reply)
        if out_len is None:
            raise ValueError("output_len: a ShareGPT run needs --sharegpt-output-len or --tokenizer to size replies")
        if prompt_len is not None and (prompt_len < 4 or prompt_len > 1024 or prompt_len + out_len > 2048):
            continue
        if out_len < 4 and output_len is None:
            continue
        requests.append(SampleRequest(prompt, prompt_len, out_len))
        if len(requests) == n:
            return requests
    raise ValueError(f"num_prompts: {path} has only {len(requests)} usable conversations, {n} requested")


def build_requests(args, space: TokenSpace, chat: bool) -> list[SampleRequest]:
    """The `--dataset` the user asked for, `--num-prompts` long, reproducible from `--seed`."""
    rng = np.random.default_rng(args.seed)
    if args.num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {args.num_prompts}")
    if args.dataset == "sharegpt-file":
        if not args.dataset_path:
            raise ValueError("dataset_path: --dataset sharegpt-file needs --dataset-path FILE")
        return sharegpt_requests(args.dataset_path, args.num_prompts, space, rng, args.sharegpt_output_len)
    prefix_len = args.shared_prefix_len if args.dataset == "shared-prefix" else 0
    groups = getattr(args, "shared_prefix_groups", 1) if args.dataset == "shared-prefix" else 1
    return random_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio, space, rng,
                           chat, prefix_len, groups)
