"""MTP drafts through PD: a prefill and a decode engine of a DeepSeek V3 checkpoint with an MTP
layer, both with `--speculative-config '{"method": "mtp", ...}'`, behind the router, answer as the
colocated MTP engine does and as Hugging Face does; D pulls whole blocks with the MTP's latent
layer in them (P's MTP rows over the prompt are D's), and D's drafts are accepted (the mimicking
MTP layer of tests/test_deepseek_mtp.py drafts the token the main model repeats). Three drafts a
step: P's chain runs past the prompt's last block (a borrowed scratch block, not moved)."""
from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from tests.pd_fixtures import block_bytes, metric, ref_and_pd
from tests.test_deepseek_mtp import LAYERS, MTP3, write_v3_with_mtp
from tests.test_model_hf import BLOCK, hf_greedy, prompts_of
from tests.test_pd_e2e import complete

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path, _, _ = write_v3_with_mtp(tmp_path_factory.mktemp("v3mimic"), seed=51, own_head=False, mimic=True)
    with ref_and_pd("--max-model-len", "256", "--speculative-config", json.dumps(MTP3), model=path) as pd:
        yield path, pd


def test_pd_with_mtp_drafts_equals_colocated_and_hf(cluster):
    path, pd = cluster
    n = 4 * BLOCK - 1  # P's chained drafts' rows: the last prompt block's last slot, then past it
    prompt = [t % 297 + 3 for t in prompts_of([n], seed=21)[0]]  # in the tokenizer's 300 ids
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    status, want = complete(pd["ref"].url, body)
    assert status == 200, want
    moved = metric(pd["D"], "atomd:kv_transfer_bytes_total")
    accepted = pd["D"].stats()["spec_decode_num_accepted_tokens"]
    status, got = complete(pd.router.url, body)
    assert status == 200, got
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["choices"][0]["text"] == Tokenizer.from_file(str(path / "tokenizer.json")).decode(
        hf_greedy(path, prompt, 40))
    # each block carries the MTP's latent rows beside the main layers'
    moved = metric(pd["D"], "atomd:kv_transfer_bytes_total") - moved
    assert moved == -(-n // BLOCK) * block_bytes(path) * (LAYERS + 1) // LAYERS
    assert pd["D"].stats()["spec_decode_num_accepted_tokens"] > accepted
    pd.assert_settled()
