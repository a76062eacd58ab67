"""`python -m tests.dns_router HOSTS.json ROUTER-ARGS...`: the real router (router.__main__.main)
with its DNS names looked up in HOSTS.json instead of the system resolver.

HOSTS.json maps "NAME:PORT" to the "HOST:PORT" addresses serving it, e.g.
{"atomd-prefill.serving.svc.cluster.local:8000": ["127.0.0.1:43121"]}; it is read at
every lookup, so a test can scale a name by rewriting the file. A name missing from it
does not exist (NXDOMAIN). Everything else -- flags, discovery, refresh -- is the router's own.
"""
from __future__ import annotations

import json
import pathlib
import sys

from router.__main__ import main
from router.discovery import NameNotFound


def file_resolver(path: pathlib.Path):
    async def resolve(name: str, port: int) -> list[tuple[str, int]]:
        table = json.loads(path.read_text())
        key = f"{name}:{port}"
        if key not in table:
            raise NameNotFound(key)
        return [(host, int(p)) for host, _, p in (a.rpartition(":") for a in table[key])]
    return resolve


if __name__ == "__main__":
    sys.exit(main(sys.argv[2:], resolver=file_resolver(pathlib.Path(sys.argv[1]))))
