"""tests/conftest.py's order of `make test`: the long xdist groups first, each group's tests together."""
from __future__ import annotations

import pathlib

import pytest

from tests import conftest
from tests.test_cpu_kinds import KINDS

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.unit
def test_every_long_group_names_a_group_the_suite_has():
    """A renamed file or kind would silently lose its place at the front."""
    kinds = {f"cpu-{kind}-{i}" for kind, (_, selections) in KINDS.items() for i in range(len(selections))}
    for name in conftest.LONG_GROUPS:
        assert (ROOT / name).is_file() or name in ("ray", "netns") or name in kinds, name
    assert len(set(conftest.LONG_GROUPS)) == len(conftest.LONG_GROUPS)


class Item:
    def __init__(self, nodeid: str, group: str):
        self.nodeid, self.mark = nodeid, pytest.mark.xdist_group(group).mark

    def get_closest_marker(self, name: str):
        return self.mark if name == "xdist_group" else None


@pytest.mark.unit
def test_long_groups_go_first_then_the_rest_by_test_count():
    first, second = conftest.LONG_GROUPS[:2]
    items = [Item("a::1", "small"), Item(f"{second}::1", second), Item("b::1", "big"), Item("b::2", "big"),
             Item(f"{first}::1", first), Item(f"{second}::2", second), Item("a::2", "small"), Item("b::3", "big")]
    conftest.LongestGroupsFirst().pytest_collection_modifyitems(items)
    assert [i.nodeid for i in items] == [f"{first}::1", f"{second}::1", f"{second}::2", "b::1", "b::2", "b::3",
                                         "a::1", "a::2"]
