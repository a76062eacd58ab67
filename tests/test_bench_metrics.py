"""`atomd bench` metric definitions on hand-built timelines, against hand-computed answers
(vLLM's definitions: TPOT excludes the first token, ITL pooled per gap, goodput needs every SLO)."""
from __future__ import annotations

import math

import pytest

from atomd.bench.metrics import (RequestResult, binned_activity, compute_metrics, parse_goodput,
                                 percentile_key)
from atomd.bench.report import compare_table, format_table

pytestmark = pytest.mark.unit


def ok(ttft: float, itl: list[float], output_len: int | None = None, prompt_len: int = 8,
       start: float = 0.0) -> RequestResult:
    """A successful request whose stream ended with its last chunk."""
    return RequestResult(success=True, prompt_len=prompt_len,
                         output_len=len(itl) + 1 if output_len is None else output_len,
                         ttft=ttft, itl=list(itl), latency=ttft + sum(itl), start_time=start)


def failed(prompt_len: int = 50) -> RequestResult:
    return RequestResult(success=False, prompt_len=prompt_len, error="HTTP 500: boom")


def test_tpot_excludes_the_first_token():
    # 5 tokens: first at 100 ms, then 4 gaps adding 100 ms -> TPOT 100/4 = 25 ms (not 200/5 = 40).
    long = ok(0.100, [0.010, 0.020, 0.030, 0.040])
    single = ok(0.050, [])  # one output token: no TPOT sample
    m = compute_metrics([long, single], duration_s=1.0)
    assert m["mean_tpot_ms"] == pytest.approx(25.0)
    assert m["median_tpot_ms"] == pytest.approx(25.0)
    assert m["std_tpot_ms"] == pytest.approx(0.0, abs=1e-9)
    assert m["mean_e2el_ms"] == pytest.approx((200.0 + 50.0) / 2)
    assert m["mean_ttft_ms"] == pytest.approx(75.0)


def test_itl_pools_every_gap_of_every_request():
    # Gaps 10, 20, 30 (request 1) and 40 (request 2): pooled, not averaged per request (that gives 30).
    m = compute_metrics([ok(0.1, [0.010, 0.020, 0.030]), ok(0.1, [0.040])], duration_s=1.0)
    assert m["mean_itl_ms"] == pytest.approx(25.0)
    assert m["median_itl_ms"] == pytest.approx(25.0)
    assert m["std_itl_ms"] == pytest.approx(math.sqrt(125.0))
    # Linear interpolation over the sorted samples: rank (n-1)*p.
    assert m["p50_itl_ms"] == pytest.approx(25.0)
    assert m["p90_itl_ms"] == pytest.approx(30.0 + 0.7 * 10.0)
    assert m["p99_itl_ms"] == pytest.approx(30.0 + 0.97 * 10.0)
    assert m["itls"] == [[0.010, 0.020, 0.030], [0.040]]


def test_failed_requests_are_counted_but_excluded_from_latency_and_tokens():
    good = ok(0.100, [0.100, 0.100], prompt_len=7)  # 3 tokens, e2el 300 ms
    m = compute_metrics([good, failed(prompt_len=50)], duration_s=2.0)
    assert (m["completed"], m["failed"]) == (1, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (7, 3)
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["output_throughput"] == pytest.approx(1.5)
    assert m["total_token_throughput"] == pytest.approx(5.0)
    assert m["mean_ttft_ms"] == pytest.approx(100.0)
    assert m["mean_e2el_ms"] == pytest.approx(300.0)
    assert m["mean_tpot_ms"] == pytest.approx(100.0)
    # Per-request arrays keep every request, in order, as vLLM stores them.
    assert m["input_lens"] == [7, 50]
    assert m["output_lens"] == [3, 0]
    assert m["errors"] == ["", "HTTP 500: boom"]
    assert len(m["ttfts"]) == len(m["itls"]) == 2


def test_goodput_counts_a_request_only_if_it_meets_every_slo():
    a = ok(0.050, [0.020, 0.020])  # ttft 50, tpot 20: good
    b = ok(0.050, [0.040, 0.040])  # tpot 40 > 30: bad
    c = ok(0.150, [0.010, 0.010])  # ttft 150 > 100: bad
    d = ok(0.100, [])              # ttft exactly at the SLO, one token (tpot 0): good
    m = compute_metrics([a, b, c, d, failed()], duration_s=4.0, slos_ms={"ttft": 100.0, "tpot": 30.0})
    assert m["good_completed"] == 2
    assert m["request_goodput"] == pytest.approx(2 / 4.0)
    e2el_only = compute_metrics([a, b, c, d], duration_s=4.0, slos_ms={"e2el": 100.0})
    assert e2el_only["good_completed"] == 2  # a (90 ms) and d (100 ms)
    assert compute_metrics([a], duration_s=1.0)["request_goodput"] is None


def test_itl_slo_is_each_requests_own_p99_gap_so_one_stall_fails_a_request_tpot_would_pass():
    steady = ok(0.050, [0.020] * 20)
    stalled = ok(0.050, [0.005] * 19 + [0.300])  # TPOT ~20 ms, but one 300 ms stall
    single = ok(0.050, [])  # one chunk: no gaps, p99 0
    assert stalled.tpot * 1000 == pytest.approx(19.75)
    assert stalled.itl_p99 > 0.2 and steady.itl_p99 == pytest.approx(0.020) and single.itl_p99 == 0.0
    m = compute_metrics([steady, stalled, single], duration_s=1.0, slos_ms={"tpot": 25.0, "itl": 50.0})
    assert m["good_completed"] == 2  # steady and single
    assert compute_metrics([steady, stalled], duration_s=1.0, slos_ms={"tpot": 25.0})["good_completed"] == 2


def test_a_run_where_everything_failed_reports_zeros_not_nan():
    m = compute_metrics([failed(), failed()], duration_s=1.0, slos_ms={"ttft": 1.0})
    assert (m["completed"], m["failed"], m["request_goodput"]) == (0, 2, 0.0)
    numbers = [v for v in m.values() if isinstance(v, float)]
    assert numbers and all(math.isfinite(v) for v in numbers)
    assert m["mean_ttft_ms"] == m["p99_e2el_ms"] == m["max_output_tokens_per_s"] == 0.0


def test_peak_tokens_per_second_and_concurrency_in_one_second_buckets():
    r1 = ok(0.5, [0.3, 0.4], start=0.0)        # tokens at 0.5, 0.8, 1.2; in flight 0..1.2
    r2 = ok(0.1, [0.1], start=1.0)             # tokens at 1.1, 1.2; in flight 1.0..1.2
    r3 = ok(0.1, [0.1], output_len=4, start=0.0)  # 2 chunks holding 4 tokens, at 0.1 and 0.2
    tokens, active = binned_activity([r1, r2, r3], bin_s=1.0)
    assert tokens[:2].tolist() == pytest.approx([2 + 4, 3])
    assert active[:2].tolist() == [2, 2]
    m = compute_metrics([r1, r2, r3], duration_s=2.0)
    assert m["max_output_tokens_per_s"] == pytest.approx(6.0)
    assert m["max_concurrent_requests"] == 2


def test_parse_goodput_accepts_slo_pairs_and_names_the_field_on_bad_input():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:2000.5"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.5}
    assert parse_goodput(None) == {}
    assert parse_goodput(["itl:50"]) == {"itl": 50.0}  # our extension: per-request ITL p99
    for bad in (["queue:5"], ["ttft"], ["ttft:fast"], ["ttft:-1"], ["tpot:nan"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)


def test_percentile_keys_are_spelled_like_vllm():
    assert [percentile_key(p) for p in (99, 99.0, 50.0, 99.9)] == ["p99", "p99", "p50", "p99.9"]
    m = compute_metrics([ok(0.1, [0.01])], duration_s=1.0, percentiles=(25.0, 99.9))
    assert {"p25_ttft_ms", "p99.9_itl_ms"} <= set(m) and "p90_ttft_ms" not in m


def test_duration_must_be_positive():
    with pytest.raises(ValueError, match="duration_s"):
        compute_metrics([ok(0.1, [])], duration_s=0.0)


def test_the_table_uses_vllms_labels():
    result = {"max_concurrency": None, "request_rate": 4.0,
              **compute_metrics([ok(0.1, [0.01])], 1.0, {"ttft": 500.0}, (50.0, 99.0))}
    table = format_table(result, (50.0, 99.0))
    for label in ("Successful requests:", "Failed requests:", "Benchmark duration (s):",
                  "Request rate configured (RPS):", "Request goodput (req/s):",
                  "Output token throughput (tok/s):", "Total Token throughput (tok/s):",
                  "Mean TTFT (ms):", "Median TPOT (ms):", "P99 ITL (ms):", "P50 E2EL (ms):",
                  "Time per Output Token (excl. 1st token)"):
        assert label in table
    no_slo = {"max_concurrency": 2, "request_rate": "inf", **compute_metrics([ok(0.1, [])], 1.0)}
    text = format_table(no_slo, (99.0,))
    assert "goodput" not in text and "Maximum request concurrency:" in text and "Request rate" not in text


def test_compare_lists_shared_numeric_metrics_with_the_ratio():
    a = {"completed": 10, "mean_ttft_ms": 100.0, "failed": 0, "ttfts": [0.1], "label": "colocated",
         "ignore_eos": True, "only_in_a": 1.0}
    b = {"completed": 10, "mean_ttft_ms": 50.0, "failed": 2, "ttfts": [0.05], "label": "pd",
         "ignore_eos": True}
    rows = {line.split()[0]: line.split()[1:] for line in compare_table(a, b).splitlines()[1:]}
    assert set(rows) == {"completed", "mean_ttft_ms", "failed"}
    assert rows["completed"] == ["10.000", "10.000", "1.000"]
    assert rows["mean_ttft_ms"] == ["100.000", "50.000", "0.500"]
    assert rows["failed"][-1] == "-"  # B/A undefined when A is 0
    with pytest.raises(ValueError, match="no numeric metrics"):
        compare_table({"label": "x"}, {"label": "y"})
