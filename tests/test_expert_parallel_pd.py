"""PD with expert parallelism on both sides: a prefill engine and a decode engine, each
`--data-parallel-size 2 --enable-expert-parallel` (two rank processes sharing the experts over
gloo), behind the router. Each request's KV moves from the P rank that prefilled it to the D
rank that decodes it (that rank's side channel); the answers are HF's greedy tokens, requests
pinned to either rank on each side included, and every pool is whole again after."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from tokenizers import Tokenizer

from launch.process import http
from tests.pd_fixtures import PDCluster, metric
from tests.test_model_hf import BLOCK, hf_greedy, make_checkpoint, prompts_of

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

EP = ["--data-parallel-size", "2", "--enable-expert-parallel", "--dp-collective-timeout-s", "10"]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", seed=36, norm_topk_prob=True)


@pytest.fixture(scope="module")
def cluster(moe_dir):
    pd = PDCluster(moe_dir)
    try:
        pd.start_engines(P=[*EP, "--kv-role", "producer"], D=[*EP, "--kv-role", "consumer"])
        pd.router = pd.start_router("P", "D")
        pd.baseline = {name: e.stats()["num_total_blocks"] for name, e in pd.engines.items()}
        yield pd
    finally:
        pd.stop()


def test_pd_with_ep2_on_both_sides_equals_hf(cluster, moe_dir):
    tokenizer = Tokenizer.from_file(str(moe_dir / "tokenizer.json"))
    # prompts of their own (no prefix hit on D), in the tokenizer's 300 ids (the model has 320)
    prompts = [[t % 297 + 3 for t in p] for p in prompts_of([5, 3 * BLOCK + 2, 2 * BLOCK, 11], seed=36)]

    def ask(prompt: list[int]) -> dict:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        status, raw = http("POST", cluster.router.url + "/v1/completions", body, timeout=120)
        assert status == 200, raw
        return json.loads(raw)

    with ThreadPoolExecutor(len(prompts)) as pool:  # in flight together: both ranks of each side serve
        answers = list(pool.map(ask, prompts))
    for prompt, answer in zip(prompts, answers):
        assert answer["choices"][0]["text"] == tokenizer.decode(hf_greedy(moe_dir, prompt, 12))
    assert metric(cluster.router, "atomd_router:decision_total", decision="pd") >= len(prompts)
    for side in ("P", "D"):  # both ranks of each side served requests of their own, KV moved rank to
        ranks = cluster[side].stats()["ranks"]  # rank (P's sent, D's received), every expert ran
        assert all(r["prefix_cache_queries"] > 0 and r["kv_transfer"]["bytes"] > 0 for r in ranks), (side, ranks)
        assert all(n > 0 for r in ranks for _, n in r["expert_tokens"]), (side, ranks)
    cluster.assert_settled()
