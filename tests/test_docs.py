"""The documented contracts against the code: a table that drifts from its enum or a default
list that drifts from its struct fails here, not in a reader's hands. Each fact has one
home in the docs (docs/design.md or docs/contracts.md); the other file links to it."""
from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from atomd.api.server import ERROR_STATUS
from scheduler.scheduler import SchedulerConfig
from contracts.errors import ErrorCode

pytestmark = pytest.mark.unit
DOCS = Path(__file__).resolve().parents[1] / "docs"


def table_rows(text: str, first_header: str) -> list[list[str]]:
    """The body rows of the markdown table whose first header cell is `first_header`."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {first_header} |"))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([cell.strip() for cell in ln.strip("|").split("|")])
    return rows


def test_error_code_table_equals_the_enum_and_the_servers_statuses():
    rows = table_rows((DOCS / "design.md").read_text(), "`error_code`")
    documented = {row[0].strip("`"): int(row[-1]) for row in rows}
    assert documented == {code.value: ERROR_STATUS[code][0] for code in ErrorCode}


def test_scheduler_config_defaults_in_contracts_equal_the_struct():
    text = (DOCS / "contracts.md").read_text()
    section = text[text.index("- `SchedulerConfig` (msgspec)"):]
    section = section[:section.index("\n- ")]
    documented = dict(re.findall(r"`(\w+)=([^`]+)`", section))
    fields = msgspec.structs.fields(SchedulerConfig)
    defaults = {f.name: f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
                for f in fields if f.required is False}
    assert documented == {name: repr(value) for name, value in defaults.items()}
    required = {f.name for f in fields if f.required}
    assert required == set(re.findall(r"`(\w+)`", section.split("are\n  required")[0])) - {"SchedulerConfig"}
