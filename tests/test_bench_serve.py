"""`atomd bench serve`: the arrival process, the datasets, and whole runs of
`python -m atomd bench serve` against tests/fake_openai_server.py."""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

from atomd.bench import cli as bench_cli
from atomd.bench.client import arrival_times
from atomd.bench.datasets import TokenSpace, build_requests, load_tokenizer
from atomd.cli import main as atomd_main
from launch.process import ServerProcess, free_port

REPO = pathlib.Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "atomd/model/default_checkpoint/tokenizer.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# The keys vLLM's readers of `vllm bench serve` results use: the result dict of
# vllm/benchmarks/serve.py and serving_column_mapping in vLLM's
# .buildkite/nightly-benchmarks/scripts/convert-results-json-to-markdown.py.
VLLM_NUMERIC_KEYS = (
    ["duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
     "output_throughput", "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests",
     "num_prompts", "burstiness"]
    + [f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p99")])
VLLM_OTHER_KEYS = ["date", "backend", "endpoint_type", "label", "model_id", "tokenizer_id", "request_rate",
                   "max_concurrency", "request_goodput", "input_lens", "output_lens", "ttfts", "itls", "errors"]


def serve_args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    return parser.parse_args(["serve", "--base-url", "http://127.0.0.1:1", *extra])


# ---------------------------------------------------------------- arrivals

def gaps(times: np.ndarray) -> np.ndarray:
    return np.diff(np.concatenate([[0.0], times]))


@pytest.mark.unit
@pytest.mark.parametrize("burstiness, expected_cv", [(1.0, 1.0), (4.0, 0.5), (0.25, 2.0)])
def test_arrivals_have_mean_gap_one_over_rate_and_gamma_spread(burstiness, expected_cv):
    # gamma(shape k) gaps have coefficient of variation 1/sqrt(k): Poisson (k=1) has CV 1.
    g = gaps(arrival_times(4000, 4.0, burstiness, np.random.default_rng(0)))
    assert g.mean() == pytest.approx(1 / 4.0, rel=1e-9)
    assert (g >= 0).all()  # shape < 1 draws gaps that round to 0: a burst
    assert g.std() / g.mean() == pytest.approx(expected_cv, rel=0.1)


@pytest.mark.unit
def test_arrivals_are_reproducible_and_handle_the_limits():
    a = arrival_times(50, 2.0, 1.0, np.random.default_rng(7))
    assert np.array_equal(a, arrival_times(50, 2.0, 1.0, np.random.default_rng(7)))
    assert not np.array_equal(a, arrival_times(50, 2.0, 1.0, np.random.default_rng(8)))
    assert (np.diff(a) >= 0).all()
    assert arrival_times(5, math.inf, 1.0, np.random.default_rng(0)).tolist() == [0.0] * 5
    assert gaps(arrival_times(4, 2.0, math.inf, np.random.default_rng(0))).tolist() == pytest.approx([0.5] * 4)
    for rate, burst, field in ((0.0, 1.0, "request_rate"), (-1.0, 1.0, "request_rate"), (1.0, 0.0, "burstiness")):
        with pytest.raises(ValueError, match=field):
            arrival_times(3, rate, burst, np.random.default_rng(0))


# ---------------------------------------------------------------- datasets

@pytest.mark.unit
def test_random_prompts_are_token_ids_with_lengths_in_the_range():
    args = serve_args("--num-prompts", "200", "--input-len", "20", "--output-len", "10", "--range-ratio", "0.5",
                      "--vocab-size", "300", "--seed", "3")
    reqs = build_requests(args, TokenSpace(args.vocab_size), chat=False)
    assert len(reqs) == 200
    assert all(10 <= len(r.prompt) <= 30 and r.prompt_len == len(r.prompt) for r in reqs)
    assert all(5 <= r.expected_output_len <= 15 for r in reqs)
    assert all(10 <= t < 300 for r in reqs for t in r.prompt)  # below the vocabulary, above the specials
    assert len({r.prompt_len for r in reqs}) > 5
    again = build_requests(args, TokenSpace(args.vocab_size), chat=False)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]


@pytest.mark.unit
def test_shared_prefix_prompts_start_with_the_same_tokens():
    args = serve_args("--dataset", "shared-prefix", "--shared-prefix-len", "32", "--input-len", "8",
                      "--num-prompts", "6")
    reqs = build_requests(args, TokenSpace(args.vocab_size), chat=False)
    prefixes = {tuple(r.prompt[:32]) for r in reqs}
    assert len(prefixes) == 1
    assert len({tuple(r.prompt[32:]) for r in reqs}) == 6
    assert all(r.prompt_len == 40 == len(r.prompt) for r in reqs)


@pytest.mark.unit
def test_chat_prompts_are_text_counted_by_the_tokenizer_when_one_is_given():
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(TOKENIZER))
    words = build_requests(serve_args("--input-len", "12", "--num-prompts", "3"), TokenSpace(4096), chat=True)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 12 and r.prompt_len is None for r in words)
    space = TokenSpace(4096, load_tokenizer(str(TOKENIZER.parent)))
    special = set(reference.get_added_tokens_decoder())
    assert special and not special & set(space.ids.tolist())
    texts = build_requests(serve_args("--input-len", "12", "--num-prompts", "3"), space, chat=True)
    for r in texts:
        assert r.prompt_len == len(reference.encode(r.prompt, add_special_tokens=False).ids)


@pytest.mark.unit
def test_sharegpt_file_takes_first_turns(tmp_path):
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(str(TOKENIZER))
    convs = [{"conversations": [{"from": "human", "value": f"question number {i} about the city and its time"},
                                {"from": "gpt", "value": f"answer {i} " + "more words here " * (i + 2)}]}
             for i in range(4)]
    convs += [{"conversations": [{"from": "human", "value": "a lonely turn"}]},  # malformed: skipped
              {"conversations": [{"from": "human"}, {"from": "gpt", "value": "no question"}]}, "junk"]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    fixed = build_requests(serve_args("--dataset", "sharegpt-file", "--dataset-path", str(path), "--num-prompts",
                                      "4", "--sharegpt-output-len", "5"), TokenSpace(4096), chat=True)
    assert sorted(r.prompt for r in fixed) == sorted(c["conversations"][0]["value"] for c in convs[:4])
    assert all(r.expected_output_len == 5 for r in fixed)
    space = TokenSpace(4096, load_tokenizer(str(TOKENIZER)))
    sized = build_requests(serve_args("--dataset", "sharegpt-file", "--dataset-path", str(path),
                                      "--num-prompts", "4"), space, chat=False)
    replies = {c["conversations"][0]["value"]: c["conversations"][1]["value"] for c in convs[:4]}
    for r in sized:
        assert r.expected_output_len == len(reference.encode(replies[r.prompt], add_special_tokens=False).ids)
    with pytest.raises(ValueError, match="num_prompts"):
        build_requests(serve_args("--dataset", "sharegpt-file", "--dataset-path", str(path), "--num-prompts", "5",
                                  "--sharegpt-output-len", "5"), TokenSpace(4096), chat=True)
    (tmp_path / "not_a_list.json").write_text('{"conversations": []}')
    with pytest.raises(ValueError, match="dataset_path"):
        build_requests(serve_args("--dataset", "sharegpt-file", "--dataset-path", str(tmp_path / "not_a_list.json"),
                                  "--sharegpt-output-len", "5"), TokenSpace(4096), chat=True)
    with pytest.raises(ValueError, match="output_len"):
        build_requests(serve_args("--dataset", "sharegpt-file", "--dataset-path", str(path)), TokenSpace(4096), True)


@pytest.mark.unit
@pytest.mark.parametrize("flags, field", [
    (["--goodput", "queue:5"], "goodput"),
    (["--request-rate", "0"], "request_rate"),
    (["--burstiness", "-1"], "burstiness"),
    (["--range-ratio", "1.5"], "range_ratio"),
    (["--num-prompts", "0"], "num_prompts"),
    (["--max-concurrency", "0"], "max_concurrency"),
    (["--metric-percentiles", "99,abc"], "metric_percentiles"),
    (["--dataset", "sharegpt-file"], "dataset_path"),
    (["--tokenizer", "/nonexistent"], "tokenizer"),
    ([], "model"),  # nothing listens on port 1: GET /v1/models fails, and no --model was given
])
def test_bad_input_is_a_clear_error_naming_the_field(flags, field, capsys):
    rc = atomd_main(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--num-prompts", "2", *flags])
    assert rc == 2
    assert f"error: {field}" in capsys.readouterr().err


@pytest.mark.unit
def test_compare_prints_ratios_of_two_result_files(tmp_path, capsys):
    (tmp_path / "a.json").write_text(json.dumps({"output_throughput": 40.0, "p99_itl_ms": 20.0, "itls": [[0.1]]}))
    (tmp_path / "b.json").write_text(json.dumps({"output_throughput": 100.0, "p99_itl_ms": 10.0, "itls": [[0.2]]}))
    assert atomd_main(["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    rows = {line.split()[0]: line.split()[-1] for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows == {"output_throughput": "2.500", "p99_itl_ms": "0.500"}
    (tmp_path / "bad.json").write_text("[1, 2")
    assert atomd_main(["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "bad.json")]) == 2
    assert "error: compare: cannot read" in capsys.readouterr().err


# ---------------------------------------------------------------- whole runs against the fake server

class FakeServer(ServerProcess):
    """tests/fake_openai_server.py on a free port, ready once it lists its model."""

    def __init__(self, *flags: str):
        port = free_port()
        super().__init__([sys.executable, "-m", "tests.fake_openai_server", "--port", str(port), *flags],
                         f"http://127.0.0.1:{port}", "fake server", cwd=REPO)
        self.wait_ready(30, path="/v1/models")

    def stats(self) -> dict:
        return json.loads(urllib.request.urlopen(self.url + "/stats", timeout=5).read())


@pytest.fixture
def fake_server(request):
    """fake_server(*flags) starts one; every one started is stopped by the finalizer."""
    started: list[FakeServer] = []

    def start(*flags: str) -> FakeServer:
        started.append(FakeServer(*flags))
        return started[-1]

    request.addfinalizer(lambda: [s.stop() for s in started])
    return start


def bench(server: FakeServer, tmp_path: pathlib.Path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", "atomd", "bench", "serve", "--base-url", server.url,
                           "--result-json", str(out), "--disable-tqdm", *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OPENAI_API_KEY": ""})
    result = json.loads(out.read_text()) if out.exists() else {}
    return proc, result


def check_consistent(r: dict, n: int) -> None:
    """The identities every result must satisfy, whatever the timings were."""
    assert r["completed"] + r["failed"] == n == r["num_prompts"]
    for key in ("input_lens", "output_lens", "ttfts", "itls", "errors"):
        assert len(r[key]) == n
    assert r["total_output_tokens"] == sum(r["output_lens"])
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration"], rel=1e-12)
    assert r["request_throughput"] == pytest.approx(r["completed"] / r["duration"], rel=1e-12)
    assert r["total_token_throughput"] == pytest.approx(
        (r["total_input_tokens"] + r["total_output_tokens"]) / r["duration"], rel=1e-12)
    for ttft, e2el, err in zip(r["ttfts"], r["e2els"], r["errors"]):
        if not err:
            assert 0 < ttft <= e2el <= r["duration"]


@pytest.mark.integration
def test_completions_run_writes_consistent_json_and_pngs(fake_server, tmp_path):
    server = fake_server("--ttft-ms", "20", "--token-delay-ms", "2")
    proc, r = bench(server, tmp_path, "--num-prompts", "12", "--request-rate", "50", "--input-len", "16",
                    "--output-len", "8", "--range-ratio", "0.5", "--goodput", "ttft:60000", "e2el:60000", "itl:60000",
                    "--plot", str(tmp_path / "plots"), "--seed", "5")
    assert proc.returncode == 0, proc.stderr
    assert "Serving Benchmark Result" in proc.stdout and "Mean TTFT (ms):" in proc.stdout
    check_consistent(r, 12)
    assert r["failed"] == 0 and r["model_id"] == "fake-model"  # discovered from GET /v1/models
    assert server.stats()["requests"] == server.stats()["ignore_eos"] == 12  # --ignore-eos is the default
    # Token-id prompts: lengths known client-side; the fake streams one token per chunk,
    # so each request has output_len - 1 ITL gaps and the usage count of tokens.
    assert all(8 <= n <= 24 for n in r["input_lens"]) and r["total_input_tokens"] == sum(r["input_lens"])
    assert all(4 <= n <= 12 for n in r["output_lens"])
    assert [len(g) for g in r["itls"]] == [n - 1 for n in r["output_lens"]]
    assert min(r["ttfts"]) >= 0.015  # the fake holds the first token back 20 ms
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # generous SLOs: all good
    for key in VLLM_NUMERIC_KEYS:
        assert isinstance(r[key], (int, float)) and math.isfinite(r[key]), key
    assert set(VLLM_OTHER_KEYS) <= set(r)
    assert r["backend"] == "openai" and r["request_rate"] == 50.0 and r["burstiness"] == 1.0
    import matplotlib.image

    for name in ("latency_cdf.png", "throughput_over_time.png", "ttft_vs_input_len.png"):
        png = tmp_path / "plots" / name
        assert png.read_bytes()[:8] == PNG_MAGIC
        img = matplotlib.image.imread(png)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


@pytest.mark.integration
def test_chat_run_takes_prompt_tokens_from_usage_and_respects_max_concurrency(fake_server, tmp_path):
    server = fake_server("--ttft-ms", "5", "--token-delay-ms", "1")
    proc, r = bench(server, tmp_path, "--endpoint", "/v1/chat/completions", "--dataset", "shared-prefix",
                    "--shared-prefix-len", "4", "--input-len", "6", "--output-len", "3", "--num-prompts", "8",
                    "--max-concurrency", "2", "--no-ignore-eos")
    assert proc.returncode == 0, proc.stderr
    check_consistent(r, 8)
    assert r["failed"] == 0 and r["backend"] == "openai-chat" and r["max_concurrency"] == 2
    # No tokenizer: the fake counts 4 + 6 words per prompt and reports it as usage.prompt_tokens.
    assert r["input_lens"] == [10] * 8 and r["output_lens"] == [3] * 8
    # The opening role-only chunk is not a token: 3 tokens, 2 gaps.
    assert [len(g) for g in r["itls"]] == [2] * 8
    stats = server.stats()
    assert stats["max_inflight"] <= 2 and stats["ignore_eos"] == 0


@pytest.mark.integration
def test_failures_are_counted_and_kept_out_of_the_numbers(fake_server, tmp_path):
    # Requests 4, 8, 12 get HTTP 500; 3, 6, 9 end with an SSE error event after two tokens.
    server = fake_server("--fail-every", "4", "--error-event-every", "3", "--ttft-ms", "2", "--token-delay-ms", "1")
    proc, r = bench(server, tmp_path, "--num-prompts", "12", "--input-len", "8", "--output-len", "5",
                    "--model", "fake-model", "--goodput", "ttft:60000")
    assert proc.returncode == 0, proc.stderr
    check_consistent(r, 12)
    assert (r["completed"], r["failed"]) == (6, 6)
    errors = [e for e in r["errors"] if e]
    assert sum("HTTP 500" in e for e in errors) == 3
    assert sum("injected stream error" in e for e in errors) == 3
    assert [n for n, e in zip(r["output_lens"], r["errors"]) if e] == [0] * 6
    assert r["input_lens"] == [8] * 12  # token-id prompts: known even for the failed ones
    assert r["total_output_tokens"] == 6 * 5 and r["total_input_tokens"] == 6 * 8
    assert r["request_goodput"] == pytest.approx(6 / r["duration"])


@pytest.mark.integration
def test_a_run_where_every_request_fails_exits_nonzero(fake_server, tmp_path):
    server = fake_server("--fail-every", "1")
    proc, r = bench(server, tmp_path, "--num-prompts", "3", "--input-len", "4", "--output-len", "2",
                    "--plot", str(tmp_path / "plots"))
    assert proc.returncode == 1
    assert "every request failed" in proc.stderr and "HTTP 500" in proc.stderr
    assert (r["completed"], r["failed"]) == (0, 3)
    assert r["mean_ttft_ms"] == 0.0 and r["output_throughput"] == 0.0
    assert len(list((tmp_path / "plots").glob("*.png"))) == 3  # empty plots, not a crash
