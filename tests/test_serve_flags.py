"""`atomd serve --help` still offers every flag it offered before the code-health change,
with the same dest, default and (at least the same) choices.

tests/data/serve_flags_before_code_health.json is a FROZEN record of the old interface,
taken at commit 1fd6d28 (before the code-health refactor) by building
`argparse.ArgumentParser()` + `atomd.api.serve.add_arguments(parser)` and recording, for
every `--flag`, its dest, default and choices. It is not a snapshot of the current
output and must not be regenerated from the current code: flags may be added, but none
of the recorded ones may disappear, change its dest or default, or drop a choice.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT_PATH = ROOT / "tests" / "data" / "serve_flags_before_code_health.json"
SNAPSHOT: dict[str, dict] = json.loads(SNAPSHOT_PATH.read_text())


def serve_parser() -> argparse.ArgumentParser:
    from atomd.api import serve

    parser = argparse.ArgumentParser(prog="atomd serve")
    serve.add_arguments(parser)
    return parser


def current_flags(parser: argparse.ArgumentParser) -> dict[str, dict]:
    """The same record the snapshot holds, normalised through JSON like the snapshot was."""
    flags = {}
    for action in parser._actions:
        for opt in action.option_strings:
            if opt.startswith("--") and opt != "--help":
                flags[opt] = {"dest": action.dest, "default": action.default,
                              "choices": list(action.choices) if action.choices is not None else None}
    return json.loads(json.dumps(flags, default=repr))


@pytest.mark.unit
def test_snapshot_is_the_recorded_one():
    assert len(SNAPSHOT) >= 40 and all(k.startswith("--") for k in SNAPSHOT)
    assert {"--model", "--kv-role", "--prefill-delayer", "--host", "--port"} <= set(SNAPSHOT)


def still_accepts(old: dict, now: dict) -> bool:
    """Same dest and default, and every old choice still offered (a new choice, e.g.
    --kv-transfer-backend mooncake, breaks no command line)."""
    if old["choices"] is None or now["choices"] is None:
        return now == old
    return {**now, "choices": None} == {**old, "choices": None} and set(old["choices"]) <= set(now["choices"])


@pytest.mark.unit
def test_every_old_flag_kept_with_same_dest_default_and_choices():
    now = current_flags(serve_parser())
    missing = sorted(set(SNAPSHOT) - set(now))
    changed = {flag: {"before": old, "now": now[flag]}
               for flag, old in sorted(SNAPSHOT.items()) if flag in now and not still_accepts(old, now[flag])}
    assert not missing, f"flags gone from `atomd serve`: {missing}"
    assert not changed, "flags changed:\n" + json.dumps(changed, indent=1)


@pytest.mark.integration  # runs one subprocess (no model load, no server)
def test_real_help_output_lists_every_old_flag():
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "PYTHON_COLORS": "0"}
    proc = subprocess.run([sys.executable, "-m", "atomd", "serve", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    missing = [f for f in SNAPSHOT if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", proc.stdout)]
    assert not missing, f"`atomd serve --help` no longer shows {missing}\n{proc.stdout}"


@pytest.mark.unit
def test_no_flags_gives_default_engine_config():
    from atomd.config import EngineConfig

    args = serve_parser().parse_args([])
    assert EngineConfig.from_args(args) == EngineConfig()


@pytest.mark.unit
def test_flags_round_trip_into_engine_config():
    from atomd.config import EngineConfig

    args = serve_parser().parse_args(["--kv-role", "producer", "--kv-cache-memory", "512MiB",
                                      "--no-enable-prefix-caching", "--prefill-delayer", "align"])
    expected = msgspec.structs.replace(EngineConfig(), kv_role="producer", kv_cache_memory=512 << 20,
                                       enable_prefix_caching=False, prefill_delayer="align")
    assert EngineConfig.from_args(args) == expected


@pytest.mark.unit
@pytest.mark.parametrize("argv", [["--kv-role", "sideways"], ["--prefill-delayer", "sometimes"],
                                  ["--kv-cache-memory", "lots"]])
def test_bad_values_still_rejected_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as e:
        serve_parser().parse_args(argv)
    assert e.value.code == 2
