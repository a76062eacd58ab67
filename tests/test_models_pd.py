"""The new families through PD: a Qwen3-MoE prefill engine and decode engine behind the
router answer with HF's greedy ids and as the colocated engine does, token for token
(P's KV blocks are D's cache as they are, whatever the family)."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from tests.pd_fixtures import metric, ref_and_pd
from tests.test_model_hf import BLOCK, hf_greedy, make_checkpoint, prompts_of
from tests.test_pd_e2e import complete

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    # dense layer 1 between sparse 0 and 2: both MLP kinds on both sides
    return make_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", seed=31, num_hidden_layers=3,
                           mlp_only_layers=[1], norm_topk_prob=True)


@pytest.fixture(scope="module")
def cluster(moe_dir):
    with ref_and_pd(model=moe_dir) as pd:
        yield pd


@pytest.mark.parametrize("n", [5, 3 * BLOCK + 2])
def test_qwen3_moe_pd_equals_hf_and_colocated(cluster, moe_dir, n):
    # a prompt of its own (no prefix hit on D), in the tokenizer's 300 ids (the model has 320)
    prompt = [t % 297 + 3 for t in prompts_of([n], seed=n)[0]]
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    status, want = complete(cluster["ref"].url, body)
    assert status == 200, want
    status, got = complete(cluster.router.url, body)
    assert status == 200, got
    w, g = want["choices"][0], got["choices"][0]
    assert g["text"] == w["text"] and g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
    assert metric(cluster.router, "atomd_router:decision_total", decision="pd") >= 1
    assert metric(cluster["D"], "atomd:kv_transfer_bytes_total") > 0
    hf_text = Tokenizer.from_file(str(moe_dir / "tokenizer.json")).decode(hf_greedy(moe_dir, prompt, 16))
    assert g["text"] == hf_text
    cluster.assert_settled()
