"""`atomd bench serve` (load an OpenAI-compatible server, report like `vllm bench serve`)
and `atomd bench compare A.json B.json`."""
from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import sys

DEFAULT_PERCENTILES = "50,90,99"
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="{serve,compare}", required=True)
    add_serve_arguments(sub.add_parser("serve", help="benchmark a running OpenAI-compatible server"))
    cmp = sub.add_parser("compare", help="side-by-side table of two result JSONs, with B/A")
    cmp.add_argument("a", help="baseline result JSON")
    cmp.add_argument("b", help="result JSON to compare against the baseline")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    from atomd.bench.datasets import DATASETS

    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions", choices=ENDPOINTS)
    p.add_argument("--model", default=None, help="model name to send (default: first of GET /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as `Authorization: Bearer KEY` (default: $OPENAI_API_KEY)")
    p.add_argument("--label", default=None, help="free-form label stored in the result JSON")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", default="random", choices=DATASETS)
    d.add_argument("--dataset-path", default=None, help="ShareGPT JSON for --dataset sharegpt-file")
    d.add_argument("--num-prompts", type=int, default=100)
    d.add_argument("--input-len", type=int, default=128,
                   help="prompt tokens (after the shared prefix); vLLM's GPU default is 1024")
    d.add_argument("--output-len", type=int, default=32, help="output tokens; vLLM's GPU default is 128")
    d.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from [L*(1-r), L*(1+r)]")
    d.add_argument("--shared-prefix-len", type=int, default=128,
                   help="tokens every prompt shares, for --dataset shared-prefix")
    d.add_argument("--shared-prefix-groups", type=int, default=1,
                   help="--dataset shared-prefix: this many distinct shared prefixes, one drawn per prompt")
    d.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="fixed output length for ShareGPT (default: the reply's length, needs --tokenizer)")
    d.add_argument("--tokenizer", default=None,
                   help="tokenizer.json or its directory: count prompt tokens client-side "
                        "(default: trust the server's usage)")
    d.add_argument("--vocab-size", type=int, default=4096,
                   help="random token ids are drawn below this when no --tokenizer is given "
                        "(default: the built-in model's vocabulary)")
    d.add_argument("--seed", type=int, default=0)
    t = p.add_argument_group("traffic")
    t.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s; inf sends all at once")
    t.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival gaps: 1 = Poisson, <1 burstier, >1 more even")
    t.add_argument("--max-concurrency", type=int, default=None)
    t.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask the server to ignore EOS so outputs have the requested length")
    t.add_argument("--request-timeout-s", type=float, default=3600.0)
    r = p.add_argument_group("report")
    r.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs (ttft, tpot, e2el in ms, as vLLM's; and itl: the p99 of each request's own "
                        "inter-token gaps, our extension); goodput counts requests meeting all of them")
    r.add_argument("--metric-percentiles", default=DEFAULT_PERCENTILES, help="comma-separated percentiles")
    r.add_argument("--result-json", default=None, help="write the result JSON here")
    r.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots into DIR")
    r.add_argument("--disable-tqdm", action="store_true")


def run(args: argparse.Namespace) -> int:
    try:
        if args.bench_command == "compare":
            return run_compare(args)
        return asyncio.run(run_serve(args))
    except ValueError as e:
        print(f"atomd bench {args.bench_command}: error: {e}", file=sys.stderr)
        return 2


def run_compare(args: argparse.Namespace) -> int:
    from atomd.bench.report import compare_table, load_result

    print(compare_table(load_result(args.a), load_result(args.b), args.a, args.b))
    return 0


def parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        ps = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"metric_percentiles: expected comma-separated numbers, got {text!r}") from None
    if not all(0 <= p <= 100 for p in ps):
        raise ValueError(f"metric_percentiles: each must be in [0, 100], got {text!r}")
    return ps


def check_traffic(args: argparse.Namespace) -> None:
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {args.max_concurrency}")
    if not args.request_timeout_s > 0:
        raise ValueError(f"request_timeout_s must be > 0, got {args.request_timeout_s}")


async def run_serve(args: argparse.Namespace) -> int:
    import aiohttp
    import numpy as np
    from tqdm import tqdm

    from atomd.bench import client, datasets, metrics, report

    percentiles = parse_percentiles(args.metric_percentiles)
    slos = metrics.parse_goodput(args.goodput)
    check_traffic(args)
    arrivals = client.arrival_times(args.num_prompts, args.request_rate, args.burstiness,
                                    np.random.default_rng([args.seed, 1]))
    tokenizer = datasets.load_tokenizer(args.tokenizer) if args.tokenizer else None
    space = datasets.TokenSpace(args.vocab_size, tokenizer)
    chat = args.endpoint == "/v1/chat/completions"
    requests = datasets.build_requests(args, space, chat)
    base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model
    if model is None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            model = await client.discover_model(session, base_url, headers)
    endpoint = client.Endpoint(base_url + args.endpoint, model, chat, args.ignore_eos, headers)

    print(f"Traffic request rate: {args.request_rate}, burstiness: {args.burstiness}, "
          f"max concurrency: {args.max_concurrency}", file=sys.stderr)
    with tqdm(total=len(requests), disable=args.disable_tqdm) as progress:
        results, duration = await client.run_load(endpoint, requests, arrivals, space, args.max_concurrency,
                                                  args.request_timeout_s, progress)
    result = {**run_header(args, model), **metrics.compute_metrics(results, duration, slos, percentiles)}
    print(report.format_table(result, percentiles))
    if args.result_json:
        report.write_json(result, args.result_json)
    if args.plot:
        for path in report.write_plots(results, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    if result["completed"] == 0:
        first_error = next((r.error for r in results if r.error), "")
        print(f"atomd bench serve: every request failed; first error: {first_error}", file=sys.stderr)
        return 1
    return 0


def run_header(args: argparse.Namespace, model: str) -> dict:
    """The run's configuration, under vLLM's result-JSON keys where it has one."""
    backend = "openai-chat" if args.endpoint == "/v1/chat/completions" else "openai"
    return {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": backend,
        "endpoint_type": backend,
        "label": args.label,
        "model_id": model,
        "tokenizer_id": args.tokenizer,
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "dataset_name": args.dataset,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "shared_prefix_len": args.shared_prefix_len if args.dataset == "shared-prefix" else 0,
        "seed": args.seed,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
    }
