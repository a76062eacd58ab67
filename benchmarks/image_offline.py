"""Offline throughput of the installed package inside the image vs the editable checkout,
one run: benchmarks/offline.py's batch-1 and batch-16 workloads (128-token prompts, 128
greedy tokens each, ignore_eos) on its `small` checkpoint, float32 and bfloat16.

Each workload runs once untimed, then timed (steady state: a fresh process's first pass at
a shape pays one-off costs, more in a container). Each round runs one worker process per
side, alternating (image, then checkout), so both
see the same background load; medians over `--rounds`, the load average recorded per
round. The image side: `docker run` of the image built by `make image-check` (the private
daemon of benchmarks/image.py, started and stopped here; `--network none`, read-only root,
the chart's user), the checkpoint and this directory mounted read-only, atomd from the
image's installed package (its kernels prebuilt); the checkout side: this virtualenv's
editable atomd (its kernels built here with -march=native). Each worker reports how its
kernels run (atomd.kernels.cbuild.kernel_paths()).

    .venv/bin/python -m benchmarks.image_offline [--rounds 3] [--threads 1] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile

WORKLOADS = {"batch1": (1, 128, 128, 1), "batch16": (16, 128, 128, 2)}  # as benchmarks/offline.py's
DTYPES = ("float32", "bfloat16")


def worker(model: str, threads: int) -> dict:
    """One round of every workload at every dtype: output tokens/s, and the kernels' paths."""
    from atomd.kernels import cbuild
    from benchmarks.offline import atomd_generator, prompts, timed

    out: dict = {}
    for dtype in DTYPES:
        gen = atomd_generator(pathlib.Path(model), threads, dtype=dtype)
        gen(prompts(2, 16, 9), 4)  # warm-up
        for workload, (n, length, new, seed) in WORKLOADS.items():
            batch = prompts(n, length, seed)
            gen(batch, new)  # once untimed: a process's first pass at a shape pays one-off costs
            out[f"{dtype}/{workload}"] = n * new / timed(lambda: gen(batch, new))
    return {"tok_s": out, "kernels": cbuild.kernel_paths()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    # one: the machine is shared, and two OpenMP threads on two busy cores swing ~10x
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=pathlib.Path, default=None)
    p.add_argument("--worker", metavar="MODEL", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.threads)))
        return 0

    import subprocess

    from benchmarks import image
    from benchmarks.machine import loadavg
    from benchmarks.offline import make_checkpoint

    here = pathlib.Path(__file__).resolve().parent
    with tempfile.TemporaryDirectory() as tmp:
        model = make_checkpoint(pathlib.Path(tmp) / "llama")
        for path in (pathlib.Path(tmp), model, *model.iterdir()):  # readable by the image's user
            path.chmod(0o755 if path.is_dir() else 0o644)
        daemon = image.Daemon()
        try:
            if daemon.docker("image", "inspect", image.IMAGE_TAG, check=False).returncode != 0:
                image.build_image(daemon)
            sides = {
                "image": lambda: daemon.docker(
                    "run", "--rm", "--network", "none", "--read-only", "--tmpfs", "/tmp:rw,mode=1777",
                    "--user", "10001:10001", "-e", "ATOMD_CACHE_DIR=/tmp/atomd", "-e", "PYTHONPATH=/bench",
                    "-v", f"{model}:/model:ro", "-v", f"{here}:/bench/benchmarks:ro", "--workdir", "/tmp",
                    "--entrypoint", "python", image.IMAGE_TAG, "-m", "benchmarks.image_offline",
                    "--threads", str(args.threads), "--worker", "/model", timeout=1200).stdout,
                "checkout": lambda: subprocess.run(
                    [sys.executable, "-m", "benchmarks.image_offline", "--threads", str(args.threads),
                     "--worker", str(model)], cwd=here.parent, capture_output=True, text=True, check=True,
                    timeout=1200).stdout,
            }
            runs: dict[str, list[dict]] = {side: [] for side in sides}
            loads = []
            for r in range(args.rounds):
                for side, run in sides.items():
                    runs[side].append(json.loads(run().strip().splitlines()[-1]))
                loads.append(loadavg())
                print(f"round {r + 1}/{args.rounds} done (load {loads[-1]})", file=sys.stderr, flush=True)
        finally:
            daemon.close()
    result = {"rounds": args.rounds, "threads": args.threads, "load": loads,
              "kernels": {side: rs[0]["kernels"] for side, rs in runs.items()},
              "tok_s": {side: {k: round(statistics.median(r["tok_s"][k] for r in rs), 1) for k in rs[0]["tok_s"]}
                        for side, rs in runs.items()}}
    result["image_over_checkout"] = {k: round(result["tok_s"]["image"][k] / v, 3)
                                     for k, v in result["tok_s"]["checkout"].items()}
    # each round's own ratio (the two sides ran back to back): the spread is the noise
    result["ratio_per_round"] = {k: [round(i["tok_s"][k] / c["tok_s"][k], 3) for i, c in zip(runs["image"], runs["checkout"])]
                                 for k in runs["image"][0]["tok_s"]}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
