"""Building and loading atomd's C kernels (atomd/csrc/): torch-free, so that the API process
may import a module that uses one (atomd/structured.py) without loading torch.

A kernel is compiled at first use with the system C compiler (`$CC`, else `cc`) for this
CPU (`-march=native`) into `~/.cache/atomd/kernels/` (`$ATOMD_CACHE_DIR/kernels`), named
`<name>-<key>.so` with the key a hash of the source and csrc's headers, the compiler's version, the flags and
the CPU, so a changed kernel or another machine sharing the home directory never loads a
stale build. `load` builds and loads one, or says in the caller's log why it cannot and
what runs instead. The users: atomd/native.py (attention), atomd/structured.py (the grammar
bitmask), atomd/model/layer_ops.py (RMSNorm, SiLU, RoPE).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

from atomd.model.default import cache_root

CSRC = pathlib.Path(__file__).parent / "csrc"
# every kernel's: this CPU's instructions, a shared object, and IEEE arithmetic (no
# -ffast-math: results match the Python paths they replace bit for bit where they claim to)
BASE_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math"]
# narrower builds, to run another CPU's paths on a CPU that has everything: no AMX tiles (an
# AVX512_BF16 CPU such as AMD's EPYC), no AVX512_BF16 instructions (the kernels'
# ATOMD_NO_BF16_DOT: an Intel Xeon with AVX-512/VNNI only), no AVX-512 at all (AVX2-only)
_NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
ISA_FLAGS = {"native": [], "no-amx": _NO_AMX, "no-bf16-dot": [*_NO_AMX, "-DATOMD_NO_BF16_DOT"],
             "no-avx512": [*_NO_AMX, "-mno-avx512f"]}
# `$ATOMD_KERNEL_ISA` narrows every kernel build of a process (and the CPU flags the engine
# reads, atomd.config.cpu_flags) to one of ISA_FLAGS: what tests/test_cpu_kinds.py runs
ISA_ENV = "ATOMD_KERNEL_ISA"
# the /proc/cpuinfo flags each narrowing takes away (a prefix ends in "*")
ISA_HIDES = {"native": (), "no-amx": ("amx_*",), "no-bf16-dot": ("amx_*", "avx512_bf16"),
             "no-avx512": ("amx_*", "avx512*")}


def kernel_isa() -> str:
    """The ISA every kernel build of this process is narrowed to ($ATOMD_KERNEL_ISA, else native)."""
    isa = os.environ.get(ISA_ENV) or "native"
    if isa not in ISA_FLAGS:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISA_FLAGS)}, got {isa!r}")
    return isa


def narrow_flags(flags: set[str], isa: str | None = None) -> set[str]:
    """A CPU's flags less what `isa` (default: $ATOMD_KERNEL_ISA) takes away."""
    hidden = ISA_HIDES[isa or kernel_isa()]
    return {f for f in flags if not any(f.startswith(h[:-1]) if h.endswith("*") else f == h for h in hidden)}


@functools.cache
def cpu_id() -> str:
    """The CPU's model and flags: -march=native code may not run on another CPU."""
    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


@functools.cache  # one `cc --version` per process, not one per kernel
def compiler_id(compiler: str) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    return f"{compiler}\n{version.stdout}"


def find_compiler() -> tuple[str | None, str]:
    """(the compiler's path or None, the name asked for: `$CC`, else `cc`)."""
    name = os.environ.get("CC", "cc")
    return shutil.which(name), name


def build(compiler: str, source: pathlib.Path, flags: list[str], name: str) -> pathlib.Path:
    """The shared library of `source` built with `flags` by `compiler` for this CPU, compiled
    unless cached: `<cache>/kernels/<name>-<key>.so`."""
    headers = [h.read_text() for h in sorted(CSRC.glob("*.h"))]  # what a source may #include
    parts = [source.read_text(), *headers, compiler_id(compiler), *flags, cpu_id()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    lib = cache_root() / "kernels" / f"{name}-{key}.so"
    if lib.is_file():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = pathlib.Path(tmp) / lib.name
        subprocess.run([compiler, *flags, str(source), "-o", str(out), "-lm"], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(out, lib)  # atomic: a concurrent engine loads either no file or a whole one
    return lib


def load(source: pathlib.Path, flags: list[str], name: str, log: logging.Logger,
         fallback: str) -> ctypes.CDLL | None:
    """`source` built (or found in the cache) and loaded, or None with the reason warned in
    `log`: no compiler, or the compiler's error; `fallback` says what runs instead."""
    compiler, asked = find_compiler()
    if compiler is None:
        log.warning("no C compiler (%s): %s", asked, fallback)
        return None
    try:
        return ctypes.CDLL(str(build(compiler, source, flags, name)))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("building %s failed, %s: %s", source.name, fallback, getattr(e, "stderr", None) or e)
        return None
