"""DeepSeek V3 (MLA) through PD: the prefill engine's latent blocks (one row of kv_lora_rank +
qk_rope_head_dim values per token and layer, atomd/model/mla.py) are the decode engine's cache
as they are: the router's answers equal the colocated engine's and HF's greedy ids, token for
token, and the bytes D pulled are whole latent blocks."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from tests.pd_fixtures import metric, ref_and_pd
from tests.test_deepseek import CASES, make_deepseek
from tests.test_model_hf import BLOCK, hf_greedy, prompts_of
from tests.test_pd_e2e import complete

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
LATENT_BLOCK_BYTES = 3 * BLOCK * (32 + 8) * 4  # 3 layers, float32


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory):
    cls, overrides = CASES["v3"]  # q_lora, a dense first layer, grouped sigmoid routing, yarn
    return make_deepseek(tmp_path_factory.mktemp("deepseek_v3"), cls, seed=61, **overrides)


@pytest.fixture(scope="module")
def cluster(v3_dir):
    with ref_and_pd(model=v3_dir) as pd:
        yield pd


@pytest.mark.parametrize("n", [5, 3 * BLOCK + 2])
def test_deepseek_v3_pd_equals_hf_and_colocated(cluster, v3_dir, n):
    # a prompt of its own (no prefix hit on D), in the tokenizer's 300 ids (the model has 320)
    prompt = [t % 297 + 3 for t in prompts_of([n], seed=n + 100)[0]]
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    pulled = metric(cluster["D"], "atomd:kv_transfer_bytes_total") or 0
    status, want = complete(cluster["ref"].url, body)
    assert status == 200, want
    status, got = complete(cluster.router.url, body)
    assert status == 200, got
    w, g = want["choices"][0], got["choices"][0]
    assert g["text"] == w["text"] and g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
    assert metric(cluster.router, "atomd_router:decision_total", decision="pd") >= 1
    moved = metric(cluster["D"], "atomd:kv_transfer_bytes_total") - pulled
    assert moved > 0 and moved % LATENT_BLOCK_BYTES == 0 and moved <= -(-n // BLOCK) * LATENT_BLOCK_BYTES
    hf_text = Tokenizer.from_file(str(v3_dir / "tokenizer.json")).decode(hf_greedy(v3_dir, prompt, 16))
    assert g["text"] == hf_text
    cluster.assert_settled()
