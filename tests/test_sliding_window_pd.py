"""Sliding-window models through PD: a prefill engine and a decode engine of the same model
behind the router answer as the colocated engine does and as Hugging Face does, 48 tokens
past the window. Mistral (every layer windowed): D pulls only the prompt blocks inside the
window of its first query (the transfer's bytes say so) and releases the rest at once;
Gemma 3 (a global layer every 3rd): every prompt block moves, since global layers read them all.
"""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from tests.pd_fixtures import metric, ref_and_pd
from tests.test_model_hf import BLOCK, hf_greedy, make_checkpoint, prompts_of
from tests.test_pd_e2e import complete

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
WINDOW = 24
# one KV block of these checkpoints: layers x (k, v) x 16 tokens x 2 KV heads x head_dim x float32
MISTRAL_BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4
GEMMA_BLOCK_BYTES = 4 * 2 * BLOCK * 2 * 16 * 4


@pytest.fixture(scope="module", params=["mistral", "gemma3"])
def model(request, tmp_path_factory):
    kind = request.param
    extra = {"sliding_window": WINDOW} if kind == "mistral" else {"num_hidden_layers": 4}
    path = make_checkpoint(tmp_path_factory.mktemp(kind), kind, seed=41, **extra)
    with ref_and_pd("--max-model-len", "256", model=path) as pd:
        yield kind, path, pd


def test_pd_past_the_window_equals_colocated_and_hf(model):
    kind, path, cluster = model
    # 6 blocks and 3 tokens: the window of the first decode query covers the last 3 prompt blocks
    prompt = [t % 297 + 3 for t in prompts_of([6 * BLOCK + 3], seed=43)[0]]  # in the tokenizer's 300 ids
    body = {"prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    status, want = complete(cluster["ref"].url, body)
    assert status == 200, want
    sent_before = metric(cluster["D"], "atomd:kv_transfer_bytes_total")
    status, got = complete(cluster.router.url, body)
    assert status == 200, got
    w, g = want["choices"][0], got["choices"][0]
    assert g["text"] == w["text"] and g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
    assert metric(cluster.router, "atomd_router:decision_total", decision="pd") >= 1
    moved = metric(cluster["D"], "atomd:kv_transfer_bytes_total") - sent_before
    prompt_blocks = -(-len(prompt) // BLOCK)
    released = metric(cluster["D"], "atomd:kv_window_released_blocks_total")  # D's pool counter, Prometheus
    if kind == "mistral":  # the first query (position len - 1) reads keys from len - WINDOW on
        unpulled = (len(prompt) - WINDOW) // BLOCK
        assert moved == (prompt_blocks - unpulled) * MISTRAL_BLOCK_BYTES
        assert released > unpulled  # the unpulled blocks at once, then those the decode steps moved past
    else:  # a global layer every 3rd: every block stays
        assert moved == prompt_blocks * GEMMA_BLOCK_BYTES
        assert released == 0
    hf_text = Tokenizer.from_file(str(path / "tokenizer.json")).decode(hf_greedy(path, prompt, 48))
    assert g["text"] == hf_text
    cluster.assert_settled()
