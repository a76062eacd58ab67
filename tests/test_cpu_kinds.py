"""The engine on every kind of CPU this project's machines come in, on any one of them.

CI runs on whichever machine it gets: an AMD EPYC with AVX512_BF16, an Intel Xeon with AMX,
an Intel Xeon with AVX-512/VNNI but neither AVX512_BF16 nor AMX, or (since 2026-12-06) an AMD
EPYC with AVX2 alone. A test that passes on one must pass on the others, so each narrower kind
(and the no-compiler fallback) is simulated here by narrowing everything that looks at the CPU, in a child
process: our C kernels and the engine's CPU flags ($ATOMD_KERNEL_ISA, atomd/kernels/cbuild.py),
oneDNN's GEMMs ($ONEDNN_MAX_CPU_ISA) and ATen's vector kernels ($ATEN_CPU_CAPABILITY). The
engine-level tests against Hugging Face then run in that process, HF included, so the
reference computes as it would on that CPU too. A kind at or above this machine's own CPU
narrows nothing (the AMX kind is this file's parent run on an AMX machine). A kind wider than this
CPU cannot be simulated (its instructions are not there): on the AVX2-only EPYC only the
no-compiler run is left, and the AVX-512 kernels' tests skip (tests/cpu_builds.py).
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from atomd.kernels import cbuild

ROOT = pathlib.Path(__file__).resolve().parent.parent
# the engine against HF, fp32 and bf16: prompt logits, greedy ids, chunked prefill, prefix
# hits, preemption, speculative verify, the fused batch-1 decode layer
ENGINE_TESTS = ("hf or engine", ["tests/test_model_hf.py", "tests/test_bf16.py"])
# every other family and weight format against HF, fp32 and bf16: Qwen3, Qwen3-MoE, Mixtral,
# Phi-3 (longrope), Gemma 3, sliding windows, int8 / int4 / bf16 weights. Not DeepSeek's engine
# tests (test_models runs them with the rest): its absorbed MLA decode (csrc/mla.c, and the
# attention kernel on a 576-wide head for fp8 caches) is checked under every narrowing in
# tests/test_deepseek.py. Nor the PD runs (a PD pair computes with the colocated engine's kernels:
# the narrowing is checked by the colocated runs; ~10 s a narrowing)
FAMILY_TESTS = ("hf and not deepseek and not pd_", ["tests/test_models.py", "tests/test_gemma3.py", "tests/test_sliding_window.py",
                       "tests/test_quant_engine.py", "tests/test_longrope.py"])
# the AVX512_BF16 kind's own paths: bf16 compute (vdpbf16ps, oneDNN's avx512_core_bf16, the bf16 prefill panels)
# and `--dtype auto`'s choice there. Its float32 and int8 / int4 paths are the VNNI kind's (the same kernels: neither
# kind has AMX, both have VNNI; oneDNN's float32 GEMM is avx512_core under either cap), run there
BF16_ENGINE_TESTS = ("hf or engine", ["tests/test_bf16.py"])
BF16_FAMILY_TESTS = ("hf and not deepseek and not pd_ and (bf16 or bfloat16)", ["tests/test_models.py", "tests/test_gemma3.py"])
# AVX2 alone (the AMD EPYC of 2026-12-06, Zen 3, natively; narrowed on the others): the engine in fp32 against
# HF, and in bf16 (weights unpacked: oneDNN has no bf16 there) against its own torch ops. Not
# against HF bf16: HF's own bf16 generate leaves its fp32 from the first token under this
# narrowing (a single forward agrees)
AVX2_TESTS = ("(hf or engine) and not hf_bf16", [*ENGINE_TESTS[1], "tests/test_layer_ops.py"])
# without a compiler the tests that ask for the kernels by name cannot run: HF's against the
# engine's torch ops and SDPA, fp32 (the bf16 torch path is tests/test_layer_ops.py's)
TORCH_TESTS = ("hf and not native and not kernel and not sdpa and not hf_bf16", ["tests/test_model_hf.py"])
KINDS = {
    # AVX512_BF16 without AMX tiles (AMD EPYC Zen 4)
    "avx512-bf16": (cbuild.CPU_KIND_ENV["avx512-bf16"], [BF16_ENGINE_TESTS, BF16_FAMILY_TESTS]),
    # AVX-512 and VNNI, no AVX512_BF16, no AMX (the Intel Xeon where #31's bf16 test failed)
    "avx512-vnni": (cbuild.CPU_KIND_ENV["avx512-vnni"], [ENGINE_TESTS, FAMILY_TESTS]),
    # the families: on the AVX2-only EPYC natively (the whole suite runs there)
    "avx2": (cbuild.CPU_KIND_ENV["avx2"], [AVX2_TESTS]),
    "no-compiler": ({"CC": "/nonexistent/cc"}, [TORCH_TESTS]),  # torch ops and SDPA everywhere
}


def narrower_kinds() -> list[str]:
    """The kinds this CPU can be narrowed to: one whose narrowing takes nothing away (the
    AVX512_BF16 kind on an AMD EPYC) is what the rest of the suite runs already."""
    with open("/proc/cpuinfo") as f:
        line = next((ln for ln in f if ln.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    out = []
    for kind, (narrowing, _) in KINDS.items():
        isa = narrowing.get(cbuild.ISA_ENV)
        if isa is None or cbuild.narrow_flags(flags, isa) != flags:
            out.append(kind)
    return out


def narrowed_runs() -> list:
    """(kind, selection) pairs, each its own test and xdist group: the VNNI kind's engine and
    family runs (~100 s each) then go to both workers instead of one."""
    return [pytest.param(kind, i, marks=pytest.mark.xdist_group(f"cpu-{kind}-{i}"), id=f"{kind}-{i}")
            for kind in narrower_kinds() for i in range(len(KINDS[kind][1]))]


@pytest.mark.integration
@pytest.mark.timeout(900)  # one pytest run of up to 800 s (~220 s at load 9)
@pytest.mark.parametrize("kind,selection", narrowed_runs())
def test_engine_equals_hf_on_a_narrower_cpu(kind, selection):
    narrowing, selections = KINDS[kind]
    env = {**os.environ, **narrowing, "PYTHONPATH": str(ROOT)}
    select, files = selections[selection]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-k", select, *files]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=800)
    tail = run.stdout[-4000:] + run.stderr[-2000:]
    assert run.returncode == 0, f"{kind}: {tail}"
    assert " passed" in run.stdout and "failed" not in run.stdout and "error" not in run.stdout, tail
