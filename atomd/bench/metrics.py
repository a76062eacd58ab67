"""Per-request timelines -> the metrics `vllm bench serve` reports, with its names and definitions.

Definitions (vLLM's `calculate_metrics`):
- TTFT: request sent -> first streamed chunk carrying generated text.
- ITL: every gap between two consecutive text chunks, pooled over all requests.
- TPOT: per request, (e2el - ttft) / (output_len - 1): the first token is excluded, so a
  slow prefill does not hide in the decode number. Requests with one output token have none.
- E2EL: request sent -> response complete.
- goodput: completed requests that meet *every* given SLO, per second of benchmark duration.
  SLO names are vLLM's (ttft, tpot, e2el) plus one extension of ours: `itl`, the p99 of that
  request's own gaps between text chunks (numpy's linear percentile; 0 with fewer than two
  chunks), since token stalls are what a per-request TPOT averages away and what PD removes.
Failed requests count in `failed` and in nothing else (no latency, no tokens).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el", "itl")  # itl: per-request ITL p99, our extension of vLLM's keys
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class RequestResult:
    """What one request left behind; times in seconds, `start_time` relative to the benchmark start."""

    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    generated_text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float:
        """0 for a single-token output, as vLLM counts it for goodput."""
        if self.output_len <= 1:
            return 0.0
        return (self.latency - self.ttft) / (self.output_len - 1)

    @property
    def itl_p99(self) -> float:
        """The p99 of this request's own ITL gaps (the `itl` goodput SLO); 0 without gaps."""
        return float(np.percentile(self.itl, 99)) if self.itl else 0.0


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"goodput: expected NAME:MS with NAME one of {SLO_METRICS}, got {pair!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"goodput: {name} needs a number of milliseconds, got {value!r}") from None
        if not math.isfinite(slos[name]) or slos[name] < 0:
            raise ValueError(f"goodput: {name} must be a non-negative number of milliseconds, got {value!r}")
    return slos


def percentile_key(p: float) -> str:
    """vLLM's spelling: 99 -> 'p99', 99.9 -> 'p99.9'."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def summarize_ms(values_s: list[float], name: str, percentiles: tuple[float, ...]) -> dict[str, float]:
    """mean/median/std/pXX of `values_s` in milliseconds, keyed like `mean_ttft_ms`.
    An empty list gives zeros (vLLM's `np.mean(x or 0)`), so a run where all failed still writes JSON."""
    arr = np.asarray(values_s if values_s else [0.0], dtype=np.float64) * 1000.0
    out = {f"mean_{name}_ms": float(np.mean(arr)), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(np.std(arr))}
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def meets_slos(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    observed = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency, "itl": r.itl_p99 if "itl" in slos_ms else 0.0}
    return all(observed[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def token_times(r: RequestResult) -> list[float]:
    """When each text chunk arrived, relative to the benchmark start (vLLM's peak-throughput timeline)."""
    t = r.start_time + r.ttft
    times = [t]
    for gap in r.itl:
        t += gap
        times.append(t)
    return times


def binned_activity(results: list[RequestResult], bin_s: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(output tokens per second, requests in flight) per `bin_s` bucket since the first successful
    request. With 1-second buckets this is vLLM's peak-throughput / peak-concurrency timeline;
    each text chunk weighs output_len / chunks, so a chunk holding several tokens counts them all."""
    ok = [r for r in results if r.success]
    if not ok:
        return np.zeros(0), np.zeros(0)
    t0 = min(r.start_time for r in ok)
    n_bins = int(np.ceil((max(r.start_time + r.latency for r in ok) - t0) / bin_s)) + 1
    tokens, active = np.zeros(n_bins), np.zeros(n_bins)
    for r in ok:
        times = token_times(r)
        for t in times:
            tokens[min(int((t - t0) / bin_s), n_bins - 1)] += r.output_len / len(times)
        first, last = int((r.start_time - t0) / bin_s), int((r.start_time + r.latency - t0) / bin_s)
        active[first:last + 1] += 1
    return tokens / bin_s, active


def compute_metrics(results: list[RequestResult], duration_s: float, slos_ms: dict[str, float] | None = None,
                    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES) -> dict:
    """The result dict: vLLM's aggregate keys, then its per-request arrays."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    tokens_per_s, active = binned_activity(results)
    out: dict = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "max_output_tokens_per_s": float(tokens_per_s.max()) if tokens_per_s.size else 0.0,
        "max_concurrent_requests": int(active.max()) if active.size else 0,
    }
    if slos_ms:
        good = sum(meets_slos(r, slos_ms) for r in ok)
        out.update(request_goodput=good / duration_s, good_completed=good,
                   goodput_slos_ms=dict(slos_ms))
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.output_len > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for name in LATENCY_METRICS:
        out.update(summarize_ms(samples[name], name, percentiles))
    out.update(
        input_lens=[r.prompt_len for r in results],
        output_lens=[r.output_len if r.success else 0 for r in results],
        ttfts=[r.ttft for r in results],
        itls=[r.itl for r in results],
        e2els=[r.latency for r in results],
        start_times=[r.start_time for r in results],
        errors=[r.error for r in results],
    )
    return out
