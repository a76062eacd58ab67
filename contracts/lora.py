"""LoRA adapter names: what a name may be and how `--lora-modules name=path` parses. The API
process, the engine and the router agree on names (block hashes chain from them:
contracts/block_hash.py)."""
from __future__ import annotations

import re
from typing import Any

MAX_NAME_CHARS = 256
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*")


def check_name(name: Any) -> None:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS or _NAME.fullmatch(name) is None:
        raise ValueError(f"LoRA adapter name must be 1-{MAX_NAME_CHARS} characters of letters, digits and ._:/- "
                         f"(starting with a letter or digit), got {name!r}")


def parse_lora_modules(items: list[str], flag: str = "lora_modules") -> list[tuple[str, str]]:
    """`--lora-modules name=path ...` (or another flag of that form) -> [(name, path)]; ValueError
    naming a bad item."""
    out: list[tuple[str, str]] = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not path:
            raise ValueError(f"{flag}: {item!r} is not name=path")
        check_name(name)
        if any(name == n for n, _ in out):
            raise ValueError(f"{flag}: {name!r} is named twice")
        out.append((name, path))
    return out
