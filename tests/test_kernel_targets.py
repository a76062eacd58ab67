"""The prebuilt kernels' dispatch (atomd/kernels/cbuild.py): which target each kind of CPU we run on
loads, under each ISA override, and that a prebuilt object is loaded without a compiler.
CPUs are given as /proc/cpuinfo flags, never taken from this machine."""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

import pytest

from atomd.kernels import cbuild

pytestmark = pytest.mark.unit

AVX2 = "avx2 fma bmi2 f16c movbe"
AVX512 = AVX2 + " avx512f avx512bw avx512cd avx512dq avx512vl avx512_vnni"
CPUS = {  # the three kinds of machine these sessions get, and two older ones
    "epyc (avx512_bf16)": (AVX512 + " avx512_bf16", "avx512bf16"),
    "xeon sapphire rapids (amx)": (AVX512 + " avx512_bf16 amx_tile amx_bf16 amx_int8", "amx"),
    "xeon (avx-512, vnni)": (AVX512, "avx512"),
    "xeon skylake (avx-512, no vnni)": (AVX2 + " avx512f avx512bw avx512cd avx512dq avx512vl", "avx2"),
    "avx2 only": (AVX2, "avx2"),
    "older than avx2": ("sse4_2 avx", None),
}


@pytest.fixture
def cpu(monkeypatch):
    def set_flags(flags: str) -> None:
        monkeypatch.setattr(cbuild, "cpu_id", lambda: f"flags\t\t: {flags}\nmodel name\t: test")
        monkeypatch.setattr(cbuild.platform, "machine", lambda: "x86_64")
    return set_flags


@pytest.mark.parametrize("name", CPUS)
def test_each_cpu_gets_the_best_target_it_runs(cpu, name):
    flags, best = CPUS[name]
    cpu(flags)
    assert cbuild.best_target() == best


def test_an_isa_override_caps_the_target(cpu):
    cpu(CPUS["xeon sapphire rapids (amx)"][0])
    assert {isa: cbuild.best_target(isa) for isa in cbuild.ISA_TARGET_CAP} == {
        "native": "amx", "no-amx": "avx512bf16", "no-bf16-dot": "avx512", "no-avx512": "avx2"}
    cpu(CPUS["avx2 only"][0])
    assert cbuild.best_target("no-amx") == "avx2"  # a cap, never more than the CPU has


def test_no_prebuilt_target_off_x86(monkeypatch):
    monkeypatch.setattr(cbuild.platform, "machine", lambda: "aarch64")
    assert cbuild.best_target() is None


def test_a_prebuilt_kernel_loads_without_a_compiler_and_says_so(tmp_path, monkeypatch, caplog):
    """load() takes the prebuilt object for this CPU's target from the package's kernels/
    directory: no compiler is asked for, the path is logged and in kernel_paths()."""
    if cbuild.best_target() is None or cbuild.find_compiler()[0] is None:
        pytest.fail("this test builds the object it then loads: it needs x86-64 with AVX2 and a compiler")
    target = cbuild.best_target()
    source, flags, name = cbuild.bitmask_kernel()
    monkeypatch.setattr(cbuild, "PREBUILT", tmp_path)
    monkeypatch.setattr(cbuild, "_PATHS", {})  # this process's record, not the other tests'
    lib = cbuild.prebuilt_path(source, flags, name, target, directory=tmp_path)
    cbuild._compile(cbuild.find_compiler()[0], source, [*flags, *cbuild.TARGETS[target][0]], lib)
    monkeypatch.setenv("CC", "atomd-no-such-compiler")
    monkeypatch.setenv("ATOMD_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO):
        loaded = cbuild.load(source, flags, name, logging.getLogger("t"), "numpy")
    assert loaded is not None and loaded.atomd_apply_bitmask
    assert cbuild.kernel_paths()[name] == f"prebuilt {target}"
    assert f"C kernel {name}: prebuilt {target}" in caplog.text
    assert not (tmp_path / "cache").exists()  # nothing built


def test_a_missing_prebuilt_kernel_without_a_compiler_is_a_logged_fallback(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cbuild, "PREBUILT", tmp_path)  # an installed package, without this shape
    monkeypatch.setattr(cbuild, "_PATHS", {})
    monkeypatch.setenv("CC", "atomd-no-such-compiler")
    source, flags, name = cbuild.attention_kernel(96, 5)
    with caplog.at_level(logging.INFO):
        assert cbuild.load(source, flags, name, logging.getLogger("t"), "attention uses torch SDPA") is None
    assert cbuild.kernel_paths()[name] == ("fallback: no C compiler (atomd-no-such-compiler): "
                                               "attention uses torch SDPA")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"no prebuilt {name}" in m and cbuild.PREBUILD_ENV in m for m in warned) or cbuild.best_target() is None
    assert any("fallback" in m for m in warned)


def test_engines_building_one_kernel_at_once_compile_it_once(tmp_path, monkeypatch):
    """Processes started together on a fresh cache (a PD pair, TP workers) that want the same
    kernel wait for the first one's compile (a lock per kernel) and load its object. Threads here:
    each opens the lock file itself, and flock locks of separate opens exclude each other."""
    compiler = cbuild.find_compiler()[0]
    if compiler is None:
        pytest.fail("this test compiles a kernel: it needs a C compiler")
    monkeypatch.setenv("ATOMD_CACHE_DIR", str(tmp_path))
    compiles, real = [], cbuild._compile

    def slow_compile(*args):
        compiles.append(args[-1])
        time.sleep(0.3)  # the others arrive while this one compiles
        return real(*args)

    monkeypatch.setattr(cbuild, "_compile", slow_compile)
    start = threading.Barrier(4)

    def build():
        start.wait()
        return cbuild.build(compiler, *cbuild.bitmask_kernel())

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        libs = list(pool.map(lambda _: build(), range(4)))
    assert len(compiles) == 1 and set(libs) == {compiles[0]} and compiles[0].is_file()
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [compiles[0].name]  # no lock file left
