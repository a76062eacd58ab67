"""What a run leaves behind: vLLM's printed result table, the result JSON, PNG plots, and
`bench compare`'s side-by-side table."""
from __future__ import annotations

import json
import math
import pathlib

import numpy as np

from atomd.bench.metrics import RequestResult, binned_activity, percentile_key

WIDTH = 50
SECTIONS = (("ttft", "TTFT", "Time to First Token"),
            ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
            ("itl", "ITL", "Inter-token Latency"),
            ("e2el", "E2EL", "End-to-end Latency"))


def format_table(result: dict, percentiles: tuple[float, ...]) -> str:
    """The block `vllm bench serve` prints, same labels, plus a Std line per latency."""
    lines = [" Serving Benchmark Result ".center(WIDTH, "=")]

    def row(label: str, value, fmt: str = ".2f") -> None:
        lines.append(f"{label:<40} {value:<10{fmt}}")

    row("Successful requests:", result["completed"], "")
    row("Failed requests:", result["failed"], "")
    if result.get("max_concurrency") is not None:
        row("Maximum request concurrency:", result["max_concurrency"], "")
    if result.get("request_rate") not in (None, "inf"):
        row("Request rate configured (RPS):", result["request_rate"])
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"], "")
    row("Total generated tokens:", result["total_output_tokens"], "")
    row("Request throughput (req/s):", result["request_throughput"])
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"])
    row("Peak concurrent requests:", result["max_concurrent_requests"], "")
    row("Total Token throughput (tok/s):", result["total_token_throughput"])
    for key, short, header in SECTIONS:
        lines.append(header.center(WIDTH, "-"))
        row(f"Mean {short} (ms):", result[f"mean_{key}_ms"])
        row(f"Median {short} (ms):", result[f"median_{key}_ms"])
        row(f"Std {short} (ms):", result[f"std_{key}_ms"])
        for p in percentiles:
            name = percentile_key(p)
            row(f"{name.upper()} {short} (ms):", result[f"{name}_{key}_ms"])
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def write_json(result: dict, path: str) -> None:
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


def _cdf(ax, values_ms: list[float], title: str) -> None:
    xs = np.sort(np.asarray(values_ms, dtype=float))
    if xs.size:
        ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post")
    ax.set(title=title, xlabel="ms", ylabel="fraction of samples", ylim=(0, 1.02))
    ax.grid(alpha=0.3)


def write_plots(results: list[RequestResult], out_dir: str) -> list[pathlib.Path]:
    """latency_cdf.png, throughput_over_time.png, ttft_vs_input_len.png under `out_dir`."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a server
    import matplotlib.pyplot as plt

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ok = [r for r in results if r.success]
    paths = [out / "latency_cdf.png", out / "throughput_over_time.png", out / "ttft_vs_input_len.png"]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    _cdf(axes[0], [r.ttft * 1e3 for r in ok], "TTFT CDF")
    _cdf(axes[1], [g * 1e3 for r in ok for g in r.itl], "ITL CDF")
    _cdf(axes[2], [r.latency * 1e3 for r in ok], "E2E latency CDF")
    fig.tight_layout()
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)

    # ~50 buckets whatever the run length: 1-second buckets flatten a short run into one point.
    span = max((r.start_time + r.latency for r in ok), default=0.0) - min((r.start_time for r in ok), default=0.0)
    bin_s = max(span / 50, 0.01)
    rate, active = binned_activity(results, bin_s)
    starts = np.arange(rate.size) * bin_s
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.step(starts, rate, where="post", label="output tokens/s")
    ax.set(title=f"Output tokens per second ({bin_s:.2g} s buckets)", xlabel="s since first request",
           ylabel="tokens/s")
    twin = ax.twinx()
    twin.step(starts, active, where="post", color="tab:orange", alpha=0.6, label="requests in flight")
    twin.set_ylabel("requests in flight")
    fig.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter([r.prompt_len for r in ok], [r.ttft * 1e3 for r in ok], s=10)
    ax.set(title="TTFT vs input length", xlabel="input tokens", ylabel="TTFT (ms)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(paths[2], dpi=100)
    plt.close(fig)
    return paths


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def compare_table(a: dict, b: dict, name_a: str = "A", name_b: str = "B") -> str:
    """Every numeric metric both results have, with B/A ('-' where A is 0)."""
    keys = [k for k, v in a.items() if _is_number(v) and _is_number(b.get(k))]
    if not keys:
        raise ValueError("compare: the two result files share no numeric metrics")
    w = max(len(k) for k in keys) + 2
    lines = [f"{'metric':<{w}} {name_a[-20:]:>20} {name_b[-20:]:>20} {'B/A':>8}"]
    for k in keys:
        ratio = f"{b[k] / a[k]:.3f}" if a[k] else "-"
        lines.append(f"{k:<{w}} {a[k]:>20.3f} {b[k]:>20.3f} {ratio:>8}")
    return "\n".join(lines)


def load_result(path: str) -> dict:
    try:
        result = json.loads(pathlib.Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"compare: cannot read result JSON {path}: {e}") from None
    if not isinstance(result, dict):
        raise ValueError(f"compare: {path} is not a result object")
    return result
