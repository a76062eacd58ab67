"""benchmarks/llama_cpp.py's patched llama.cpp source trees (the anchor builds of issue #35).

A fake source tree stands for llama.cpp's (the real one is fetched from PyPI by the benchmark
alone): each patch's own "before" text is put where the patch expects it, then patched_source
must give a tree of hard links in which the patched files alone are new files with the
patch's "after" text, the shipped tree untouched, and refuse a source whose text differs.
"""
from __future__ import annotations

import os

import pytest

from benchmarks import llama_cpp as lc


def fake_source(root):
    src = root / "src"
    for rel, old, _ in lc.PATCHES.values():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(f"// before\n{old}// after\n")
    (src / "CMakeLists.txt").write_text("project(llama)\n")
    return src


@pytest.mark.parametrize("build", sorted(lc.BUILDS))
def test_each_build_patches_only_its_files(tmp_path, build):
    src = fake_source(tmp_path)
    shipped = {p: p.read_text() for p in src.rglob("*") if p.is_file()}
    patches = lc.BUILDS[build][2]
    out = lc.patched_source(src, patches)
    if not patches:
        assert out == src
        return
    patched = {lc.PATCHES[name][0] for name in patches}
    for path, text in shipped.items():
        rel = path.relative_to(src).as_posix()
        copy = out / rel
        if rel in patched:
            (name,) = [n for n in patches if lc.PATCHES[n][0] == rel]
            _, old, new = lc.PATCHES[name]
            assert copy.read_text() == text.replace(old, new) != text
            assert not os.path.samefile(copy, path)
        else:
            assert os.path.samefile(copy, path)  # a hard link: no copy of the 180 MB tree
    assert {p: p.read_text() for p in src.rglob("*") if p.is_file()} == shipped
    assert lc.patched_source(src, patches) == out  # made once, then reused


def test_a_source_without_the_patch_text_is_refused(tmp_path):
    src = fake_source(tmp_path)
    rel, old, _ = lc.PATCHES["amx-tile-config"]
    (src / rel).write_text("// another llama.cpp version\n")
    with pytest.raises(SystemExit, match="amx-tile-config"):
        lc.patched_source(src, ["amx-tile-config"])
    assert [p.name for p in tmp_path.iterdir()] == ["src"]  # no tree, half-made or not, left
