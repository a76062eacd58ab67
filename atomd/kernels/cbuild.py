"""Building and loading atomd's C kernels (atomd/kernels/csrc/): torch-free, so that the API process
may import a module that uses one (atomd/structured.py) without loading torch, and so that
setup.py can build them into a wheel without atomd's dependencies.

Two ways to a kernel, tried in this order by `load`:
- Prebuilt: an installed wheel (and the image) ships each kernel compiled for every x86-64
  TARGET in atomd/kernels/ (setup.py calls `prebuild`; absent in a source checkout); `load`
  takes the best target this CPU runs (`best_target`), so a pod never compiles and never
  needs a compiler. Named `<name>-<target>-<key>.so`, the key a hash of the source, csrc's
  headers and the flags, so a stale object never loads.
- Built here: compiled at first use with the system C compiler (`$CC`, else `cc`) for this
  CPU (`-march=native`) into `~/.cache/atomd/kernels/` (`$ATOMD_CACHE_DIR/kernels`), named
  `<name>-<key>.so` with the key a hash of the source and csrc's headers, the compiler's
  version, the flags and the CPU, so a changed kernel or another machine sharing the home
  directory never loads a stale build. What a checkout runs.
Where neither works `load` returns None and the caller's torch/numpy path runs. Every
outcome is logged and kept in `kernel_paths()` (GET /kv_transfer_info's `kernels`). The
users: atomd/kernels/native.py (attention), atomd/structured.py (the grammar bitmask),
atomd/model/layer_ops.py (RMSNorm, SiLU, RoPE), atomd/model/quant.py (int8 / int4 linears),
atomd/model/mla.py (the absorbed MLA decode, through native.py).
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

CSRC = pathlib.Path(__file__).parent / "csrc"
PREBUILT = pathlib.Path(__file__).parent / "prebuilt"  # a wheel's shared objects (setup.py)
# every kernel's: a shared object and IEEE arithmetic (no -ffast-math: results match the
# Python paths they replace bit for bit where they claim to); the ISA is added apart:
# -march=native built here, a TARGET's prebuilt
BASE_FLAGS = ["-O3", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math"]
# narrower builds, to run another CPU's paths on a CPU that has everything: no AMX tiles (an
# AVX512_BF16 CPU such as AMD's EPYC), no AVX512_BF16 instructions (the kernels'
# ATOMD_NO_BF16_DOT: an Intel Xeon with AVX-512/VNNI only), no AVX-512 at all (AVX2-only)
NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
# (no-bf16-dot: no AMX either, as on that CPU: the kernels' AMX-INT8 paths test __AMX_INT8__ alone)
ISA_FLAGS = {"native": [], "no-amx": NO_AMX, "no-bf16-dot": [*NO_AMX, "-DATOMD_NO_BF16_DOT"], "no-avx512": ["-mno-avx512f"]}
# `$ATOMD_KERNEL_ISA` narrows every kernel of a process (built here or prebuilt: ISA_TARGET_CAP)
# and the CPU flags the engine reads (atomd.config.cpu_flags) to one of ISA_FLAGS: what
# tests/test_cpu_kinds.py runs
ISA_ENV = "ATOMD_KERNEL_ISA"
# the /proc/cpuinfo flags each narrowing takes away (a prefix ends in "*")
ISA_HIDES = {"native": (), "no-amx": ("amx_*",), "no-bf16-dot": ("amx_*", "avx512_bf16"),
             "no-avx512": ("amx_*", "avx512*")}
# A whole process narrowed to one of the kinds of CPU ours come in (and AVX2-only), on a CPU that
# has more: the kernels and the engine's CPU flags ($ATOMD_KERNEL_ISA), torch's oneDNN GEMMs
# ($ONEDNN_MAX_CPU_ISA), ATen's vector kernels ($ATEN_CPU_CAPABILITY, AVX2 only: ATen has no
# AVX512_BF16 level), MKL's (torch.mm: $MKL_ENABLE_INSTRUCTIONS, AVX2 only: unnarrowed, a 2048-row
# sgemm of the 135M shape ran 1.5x oneDNN's AVX2 one here, #35 session 26). Same code paths as
# that CPU, this CPU's memory and caches: what tests/test_cpu_kinds.py and
# benchmarks/engine_compare.py --cpu-kind run
CPU_KIND_ENV = {
    "avx512-bf16": {ISA_ENV: "no-amx", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},  # AMD EPYC (Zen 4)
    "avx512-vnni": {ISA_ENV: "no-bf16-dot", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"},  # Intel Xeon, no BF16 / AMX
    "avx2": {ISA_ENV: "no-avx512", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
# The x86-64 targets a wheel ships every kernel for, worst first: each one's compiler flags
# and the /proc/cpuinfo flags it needs on top of the targets before it. The kernels test the
# compiler's macros (__AVX512F__, __AVX512VNNI__, __AVX512BF16__, __AMX_TILE__), so these four
# builds are the four paths a -march=native build can take on the three kinds of CPU we run on
# (each has VNNI: the int8-activation rows and GEMM need it; an AVX-512 CPU without, such as
# Skylake-SP, takes the AVX2 target)
TARGETS = {
    "avx2": (["-march=x86-64-v3"], ("avx2", "fma", "bmi2", "f16c", "movbe")),
    "avx512": (["-march=x86-64-v4", "-mavx512vnni"], ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl",
                                                      "avx512_vnni")),
    "avx512bf16": (["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"], ("avx512_bf16",)),
    "amx": (["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mamx-int8"],
            ("amx_tile", "amx_bf16", "amx_int8")),
}
# the best target each narrowed build may take: the instructions that build would use
ISA_TARGET_CAP = {"native": "amx", "no-amx": "avx512bf16", "no-bf16-dot": "avx512", "no-avx512": "avx2"}
# the attention shapes (head_dim, query heads per KV head) a wheel ships: the built-in model's,
# benchmarks/offline.py's small one, SmolLM2-135M's, Llama-3-8B's; more with
# $ATOMD_PREBUILD_ATTENTION="64x7,128x8" when building the wheel (a Docker build argument)
PREBUILT_ATTENTION = ((32, 2), (64, 2), (64, 3), (128, 4))
PREBUILD_ENV = "ATOMD_PREBUILD_ATTENTION"
_PATHS: dict[str, str] = {}  # kernel name -> how it runs (kernel_paths())


def kernel_isa() -> str:
    """The ISA every kernel of this process is narrowed to ($ATOMD_KERNEL_ISA, else native)."""
    isa = os.environ.get(ISA_ENV) or "native"
    if isa not in ISA_FLAGS:
        raise ValueError(f"{ISA_ENV} must be one of {', '.join(ISA_FLAGS)}, got {isa!r}")
    return isa


def narrow_flags(flags: set[str], isa: str | None = None) -> set[str]:
    """A CPU's flags less what `isa` (default: $ATOMD_KERNEL_ISA) takes away."""
    hidden = ISA_HIDES[isa or kernel_isa()]
    return {f for f in flags if not any(f.startswith(h[:-1]) if h.endswith("*") else f == h for h in hidden)}


def bitmask_kernel() -> tuple[pathlib.Path, list[str], str]:
    """(source, flags, name) of the grammar bitmask kernel (atomd/structured.py)."""
    return CSRC / "bitmask.c", BASE_FLAGS, "bitmask"


def layer_ops_kernel() -> tuple[pathlib.Path, list[str], str]:
    """(source, flags, name) of RMSNorm, SiLU and RoPE (atomd/model/layer_ops.py). 512-bit
    vectors where the CPU has them (GCC prefers 256 on Intel): 512 x 576 RMSNorm 40 -> 24 us
    fp32, 86 -> 68 us bf16; bf16 SiLU-and-mul 432 -> 312 us (2 threads)."""
    return CSRC / "layer_ops.c", [*BASE_FLAGS, "-fopenmp", "-mprefer-vector-width=512"], "layer-ops"


def quant_kernel() -> tuple[pathlib.Path, list[str], str]:
    """(source, flags, name) of the weight-only int8 / int4 linears (atomd/model/quant.py)."""
    return CSRC / "quant.c", [*BASE_FLAGS, "-fopenmp", "-mprefer-vector-width=512"], "quant"


def attention_kernel(head_dim: int, group: int) -> tuple[pathlib.Path, list[str], str]:
    """(source, flags, name) of the attention kernels for one shape (atomd/kernels/native.py)."""
    return (CSRC / "attention.c", [*BASE_FLAGS, "-fopenmp", f"-DHEAD_DIM={head_dim}", f"-DGROUP={group}"],
            f"attention-d{head_dim}-g{group}")


def mla_kernel(rank: int, rope: int, nope: int, v: int) -> tuple[pathlib.Path, list[str], str]:
    """(source, flags, name) of the absorbed MLA decode for one DeepSeek shape (atomd/kernels/native.py)."""
    return (CSRC / "mla.c", [*BASE_FLAGS, "-fopenmp", "-mprefer-vector-width=512", f"-DRANK={rank}", f"-DROPE={rope}",
                             f"-DNOPE={nope}", f"-DVDIM={v}"], f"mla-r{rank}-p{rope}-n{nope}-v{v}")


def shipped_kernels() -> list[tuple[pathlib.Path, list[str], str]]:
    """Every kernel a wheel ships (for each TARGET)."""
    shapes = list(PREBUILT_ATTENTION)
    for item in filter(None, os.environ.get(PREBUILD_ENV, "").replace(",", " ").split()):
        head_dim, group = (int(x) for x in item.lower().split("x"))
        shapes.append((head_dim, group))
    return [bitmask_kernel(), layer_ops_kernel(), quant_kernel(), *(attention_kernel(d, g) for d, g in dict.fromkeys(shapes))]


@functools.cache
def cpu_id() -> str:
    """The CPU's model and flags: -march=native code may not run on another CPU."""
    try:
        lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD); empty where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.partition(":")[2].strip() for ln in f if ln.startswith("vendor_id")), "")
    except OSError:
        return ""


def cpu_flags() -> set[str]:
    return {f for ln in cpu_id().splitlines() if ln.startswith("flags") for f in ln.partition(":")[2].split()}


def best_target(isa: str = "native") -> str | None:
    """The best TARGET this CPU runs, no better than `isa` allows; None off x86-64 or below AVX2."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    have, best = cpu_flags(), None
    for target, (_, needs) in TARGETS.items():
        if not set(needs) <= have:
            break
        best = target
        if target == ISA_TARGET_CAP[isa]:
            break
    return best


@functools.cache  # one `cc --version` per process, not one per kernel
def compiler_id(compiler: str) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
    return f"{compiler}\n{version.stdout}"


def find_compiler() -> tuple[str | None, str]:
    """(the compiler's path or None, the name asked for: `$CC`, else `cc`)."""
    name = os.environ.get("CC", "cc")
    return shutil.which(name), name


def _key(source: pathlib.Path, *parts: str) -> str:
    headers = [h.read_text() for h in sorted(CSRC.glob("*.h"))]  # what a source may #include
    return hashlib.sha256("\0".join([source.read_text(), *headers, *parts]).encode()).hexdigest()[:16]


def _compile(compiler: str, source: pathlib.Path, flags: list[str], lib: pathlib.Path) -> pathlib.Path:
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        out = pathlib.Path(tmp) / lib.name
        subprocess.run([compiler, *flags, str(source), "-o", str(out), "-lm"], check=True,
                       capture_output=True, text=True, timeout=300)
        os.replace(out, lib)  # atomic: a concurrent engine loads either no file or a whole one
    return lib


def build(compiler: str, source: pathlib.Path, flags: list[str], name: str) -> pathlib.Path:
    """The shared library of `source` built with `flags` by `compiler` for this CPU, compiled
    unless cached: `<cache>/kernels/<name>-<key>.so`."""
    from atomd.model.default import cache_root  # (here: setup.py loads this file alone)

    lib = cache_root() / "kernels" / f"{name}-{_key(source, compiler_id(compiler), *flags, cpu_id())}.so"
    if lib.is_file():
        return lib
    # one compile of a kernel at a time: engines started together on a fresh cache (a PD pair,
    # TP workers, a test suite's processes) wait for the first one's build instead of each
    # compiling the same source (on a fresh machine: layer_ops 4-5 CPU seconds each)
    lib.parent.mkdir(parents=True, exist_ok=True)
    lock_path = lib.with_suffix(".lock")
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return lib if lib.is_file() else _compile(compiler, source, flags, lib)
        finally:  # (who opens it after this finds the library, or compiles again after a failure)
            lock_path.unlink(missing_ok=True)


def prebuilt_path(source: pathlib.Path, flags: list[str], name: str, target: str,
                  directory: pathlib.Path | None = None) -> pathlib.Path:
    """Where a wheel holds `source` built for `target` (directory: PREBUILT)."""
    flags = [*flags, *TARGETS[target][0]]
    return (directory or PREBUILT) / f"{name}-{target}-{_key(source, target, *flags)}.so"


def prebuild(directory: pathlib.Path, compiler: str = "cc", jobs: int | None = None) -> list[pathlib.Path]:
    """Every shipped kernel compiled for every TARGET into `directory` (setup.py; the image)."""
    work = [(source, flags, name, target) for source, flags, name in shipped_kernels() for target in TARGETS]
    with concurrent.futures.ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda w: _compile(compiler, w[0], [*w[1], *TARGETS[w[3]][0]],
                                                prebuilt_path(*w, directory=directory)), work))


def kernel_paths() -> dict[str, str]:
    """How each kernel this process loaded runs: `prebuilt <target>`, `built here
    (-march=native)`, or `fallback: <why>: <what runs instead>` (GET /kv_transfer_info)."""
    return dict(_PATHS)


def _record(name: str, path: str, log: logging.Logger) -> None:
    _PATHS[name] = path
    (log.warning if path.startswith("fallback") else log.info)("C kernel %s: %s", name, path)


def load(source: pathlib.Path, flags: list[str], name: str, log: logging.Logger,
         fallback: str, isa: str = "native") -> ctypes.CDLL | None:
    """`source` with `flags` narrowed to `isa` (ISA_FLAGS): prebuilt, else built
    here (or found in the cache) and loaded, or None with the reason warned in `log`: no
    compiler, or the compiler's error; `fallback` says what runs instead."""
    tagged = name if isa == "native" else f"{name}-{isa}"
    target = best_target(isa)
    if target is not None:
        lib = prebuilt_path(source, flags, name, target)
        if lib.is_file():
            loaded = ctypes.CDLL(str(lib))
            _record(tagged, f"prebuilt {target}", log)
            return loaded
        if PREBUILT.is_dir():  # an installed wheel without this one: a shape it was not built for
            log.warning("no prebuilt %s for %s in %s (build the wheel with %s for more attention shapes)",
                        name, target, PREBUILT, PREBUILD_ENV)
    compiler, asked = find_compiler()
    if compiler is None:
        _record(tagged, f"fallback: no C compiler ({asked}): {fallback}", log)
        return None
    try:
        loaded = ctypes.CDLL(str(build(compiler, source, ["-march=native", *flags, *ISA_FLAGS[isa]],
                                       tagged)))
    except (OSError, subprocess.SubprocessError) as e:
        _record(tagged, f"fallback: building {source.name} failed: {fallback}", log)
        log.warning("building %s failed: %s", source.name, getattr(e, "stderr", None) or e)
        return None
    _record(tagged, "built here (-march=native)", log)
    return loaded
