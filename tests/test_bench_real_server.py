"""`python -m atomd bench serve` against a real `atomd serve` (the built-in default model):
the result JSON is consistent with itself and with what was asked, and the PNGs open."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.server_fixtures import REPO, model_dir, start_server

NUM_PROMPTS = 20
INPUT_LEN = 16
OUTPUT_LEN = 4


@pytest.fixture(scope="module")
def server():
    srv = start_server(model_dir())
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def bench_run(server, tmp_path_factory):
    """One bounded run: Poisson arrivals, ignore_eos so every output has OUTPUT_LEN tokens."""
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "-m", "atomd", "bench", "serve", "--base-url", server.url,
           "--dataset", "random", "--num-prompts", str(NUM_PROMPTS), "--input-len", str(INPUT_LEN),
           "--output-len", str(OUTPUT_LEN), "--range-ratio", "0", "--request-rate", "20", "--seed", "1",
           "--ignore-eos", "--goodput", "e2el:600000", "--disable-tqdm",
           "--result-json", str(out / "result.json"), "--plot", str(out / "plots")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads((out / "result.json").read_text()), out / "plots", proc.stdout


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_counts_and_throughputs_agree_with_the_requests_sent(bench_run):
    result, _, stdout = bench_run
    assert result["completed"] + result["failed"] == NUM_PROMPTS
    assert result["failed"] == 0, result["errors"]
    assert result["num_prompts"] == NUM_PROMPTS
    # ignore_eos and range_ratio 0: the server's usage must report exactly the requested lengths
    assert result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert result["input_lens"] == [INPUT_LEN] * NUM_PROMPTS
    assert result["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
    duration = result["duration"]
    assert duration > 0
    assert result["output_throughput"] == pytest.approx(result["total_output_tokens"] / duration)
    assert result["request_throughput"] == pytest.approx(NUM_PROMPTS / duration)
    assert result["total_token_throughput"] == pytest.approx(
        (result["total_input_tokens"] + result["total_output_tokens"]) / duration)
    # an SLO no request can miss: goodput is the request throughput
    assert result["good_completed"] == NUM_PROMPTS
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert "Serving Benchmark Result" in stdout


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_per_request_latencies_are_ordered_and_fit_the_run(bench_run):
    result, _, _ = bench_run
    starts, ttfts, e2els, itls = result["start_times"], result["ttfts"], result["e2els"], result["itls"]
    assert len(starts) == len(ttfts) == len(e2els) == len(itls) == NUM_PROMPTS
    for start, ttft, e2el, gaps in zip(starts, ttfts, e2els, itls):
        assert 0 < ttft <= e2el
        assert all(g >= 0 for g in gaps)
        # the first token, then the gaps, all inside the request's lifetime
        assert ttft + sum(gaps) <= e2el + 1e-6
        assert start >= 0 and start + e2el <= result["duration"] + 1e-6
    assert result["mean_ttft_ms"] == pytest.approx(1e3 * sum(ttfts) / NUM_PROMPTS)
    assert result["mean_e2el_ms"] == pytest.approx(1e3 * sum(e2els) / NUM_PROMPTS)
    assert result["mean_ttft_ms"] <= result["mean_e2el_ms"]
    assert result["p99_ttft_ms"] <= 1e3 * max(ttfts) + 1e-6


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_plots_are_pngs_that_open(bench_run):
    from PIL import Image

    _, plots, _ = bench_run
    names = sorted(p.name for p in plots.glob("*.png"))
    assert names == ["latency_cdf.png", "throughput_over_time.png", "ttft_vs_input_len.png"]
    for name in names:
        with Image.open(plots / name) as img:
            img.verify()  # raises on a truncated or corrupt file
        with Image.open(plots / name) as img:
            assert img.format == "PNG" and img.size[0] > 100 and img.size[1] > 100
