"""`atomd bench serve --dataset shared-prefix --shared-prefix-groups G`: G system prompts,
one drawn per prompt (the workload the kv_aware router benchmark runs)."""
from __future__ import annotations

import argparse
import collections

import pytest

from atomd.bench import cli as bench_cli
from atomd.bench.datasets import TokenSpace, build_requests

pytestmark = pytest.mark.unit


def serve_args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    return parser.parse_args(["serve", "--base-url", "http://127.0.0.1:1", *extra])


def test_shared_prefix_groups_draw_one_of_g_prefixes():
    base = ("--dataset", "shared-prefix", "--shared-prefix-len", "32", "--input-len", "8", "--num-prompts", "40")
    args = serve_args(*base, "--shared-prefix-groups", "4")
    reqs = build_requests(args, TokenSpace(args.vocab_size), chat=False)
    groups = collections.Counter(tuple(r.prompt[:32]) for r in reqs)
    assert len(groups) == 4 and min(groups.values()) >= 4  # every group used, none alone
    assert all(r.prompt_len == 40 == len(r.prompt) for r in reqs)
    assert [r.prompt for r in build_requests(args, TokenSpace(args.vocab_size), chat=False)] == \
        [r.prompt for r in reqs]  # reproducible from --seed
    one = build_requests(serve_args(*base), TokenSpace(args.vocab_size), chat=False)
    assert len({tuple(r.prompt[:32]) for r in one}) == 1  # the default: one prefix, as before
    with pytest.raises(ValueError, match="shared_prefix_groups"):
        build_requests(serve_args(*base, "--shared-prefix-groups", "0"), TokenSpace(args.vocab_size), chat=False)
