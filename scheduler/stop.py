"""Stop strings: the one rule for finding and cutting them (vLLM's).

The scheduler uses it to stop a sequence, the server to cut the streamed text, the offline
`LLM` to cut its final text: the token that completes a stop string may decode to text
running past it, and that tail is never shown.
"""
from __future__ import annotations


def find_stop_string(text: str, stops: list[str], ends_after: int = 0) -> tuple[int, str] | None:
    """(index, stop) of the earliest stop string in `text` that ends after position
    `ends_after` (text up to there was searched before), or None."""
    hits = [(i, s) for s in stops if (i := text.find(s, max(0, ends_after - len(s) + 1))) >= 0]
    return min(hits) if hits else None


def cut_at_stop(text: str, stops: list[str], include_stop: bool, ends_after: int = 0) -> tuple[str, str | None]:
    """(text cut at the first stop string found, that stop) or (text, None); the stop
    itself is kept when `include_stop` (include_stop_str_in_output)."""
    hit = find_stop_string(text, stops, ends_after)
    if hit is None:
        return text, None
    i, stop = hit
    return text[:i + len(stop) if include_stop else i], stop
