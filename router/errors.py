"""What a router response body may say about a client's input or a worker's failure.

A body never echoes a client's value at length (`clip`: a 15 MB field must not come back
in a 400), and never carries a worker's traceback, native backtrace or file paths
(`worker_text`: the first line of a worker's message, paths replaced, clipped). The whole
message stays in the router's log and in the worker's `last_error` (/workers).
"""
from __future__ import annotations

import re

CLIP_CHARS = 100  # of a client's value echoed in an error
WORKER_TEXT_CHARS = 300  # of a worker's message relayed in a 502

# an absolute path (POSIX or Windows) ending in a source or library file, with a line number
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\\/][\w.+@-]+)+\.(?:py|pyx|pyi|c|cc|cpp|cxx|cu|h|hpp|rs|so)\b(?::\d+)*")
_TRACEBACK = "Traceback (most recent call last)"


def clip(value: object, limit: int = CLIP_CHARS) -> str:
    """repr(value), cut to `limit` characters (the cut said)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def worker_text(text: str, limit: int = WORKER_TEXT_CHARS) -> str:
    """A worker's error message fit for a client: no traceback, no file path, one line, short."""
    text = text.split(_TRACEBACK, 1)[0].strip()
    text = text.splitlines()[0].strip() if text else ""
    text = _PATH.sub("<path>", text) or "(no message)"
    return text if len(text) <= limit else text[:limit] + "..."
