"""Each kind of KV a family caches, through PD: a prefill engine and a decode engine of the same
model behind the router answer as the colocated engine does and as Hugging Face does, token for
token, and D pulls whole blocks as the family lays them out (P's blocks are D's cache as they
are). Qwen3-MoE (sparse and dense layers), DeepSeek V3 (MLA: one latent row a token and layer),
Mistral with every layer windowed (D pulls only the prompt blocks inside the window of its first
query and releases the rest at once) and Gemma 3 (a global layer every 3rd: every block moves)."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from tests.families import FAMILIES, Family
from tests.pd_fixtures import block_bytes, metric, ref_and_pd
from tests.test_model_hf import BLOCK, hf_greedy, prompts_of
from tests.test_pd_e2e import complete

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
WINDOW = 24
CASES = {
    "qwen3_moe": FAMILIES["qwen3_moe-mlp_only"],
    "deepseek-v3": FAMILIES["deepseek-v3"],
    "mistral-window": Family("mistral", 41, {"sliding_window": WINDOW}, ()),
    "gemma3": Family("gemma3", 41, {"num_hidden_layers": 4}, ()),
}


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory):
    path = CASES[request.param].write(tmp_path_factory.mktemp(request.param))
    with ref_and_pd("--max-model-len", "256", model=path) as pd:
        yield request.param, path, pd


# 5 tokens: one block, inside the window; 6 blocks and 3 tokens: the window of the first decode
# query covers the last 3 prompt blocks
@pytest.mark.parametrize("n", [5, 6 * BLOCK + 3])
def test_pd_equals_colocated_and_hf_moving_whole_blocks(family, n):
    name, path, cluster = family
    # a prompt of its own (no prefix hit on D), in the tokenizer's 300 ids (the model has 320)
    prompt = [t % 297 + 3 for t in prompts_of([n], seed=n + 100)[0]]
    body = {"prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    status, want = complete(cluster["ref"].url, body)
    assert status == 200, want
    moved = metric(cluster["D"], "atomd:kv_transfer_bytes_total")
    released = metric(cluster["D"], "atomd:kv_window_released_blocks_total")  # D's pool counter
    status, got = complete(cluster.router.url, body)
    assert status == 200, got
    w, g = want["choices"][0], got["choices"][0]
    assert g["text"] == w["text"] and g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
    assert metric(cluster.router, "atomd_router:decision_total", decision="pd") >= 1
    moved = metric(cluster["D"], "atomd:kv_transfer_bytes_total") - moved
    released = metric(cluster["D"], "atomd:kv_window_released_blocks_total") - released
    prompt_blocks = -(-n // BLOCK)
    if name == "mistral-window":  # the first query (position n - 1) reads keys from n - WINDOW on
        unpulled = max(0, n - WINDOW) // BLOCK
        assert moved == (prompt_blocks - unpulled) * block_bytes(path)
        assert released > unpulled  # the unpulled blocks at once, then those the decode steps moved past
    else:  # no window (a global layer every 3rd, for Gemma 3): every prompt block moves and stays
        assert moved == prompt_blocks * block_bytes(path)
        assert released == 0
    hf_text = Tokenizer.from_file(str(path / "tokenizer.json")).decode(hf_greedy(path, prompt, 48))
    assert g["text"] == hf_text
    cluster.assert_settled()
