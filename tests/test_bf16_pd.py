"""bfloat16 through PD: a prefill and a decode engine in bf16 answer as the colocated bf16
engine does, token for token (P's bf16 KV blocks are D's cache as they are: no conversion),
and move half of float32's bytes per KV block."""
from __future__ import annotations

import math

import pytest

from tests.pd_fixtures import block_bytes, metric, ref_and_pd
from tests.test_pd_e2e import complete, token_prompt

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
BLOCK = 16


@pytest.fixture(scope="module")
def cluster():
    with ref_and_pd("--dtype", "bfloat16") as pd:
        yield pd


@pytest.mark.parametrize("n", [5, 150])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}], ids=["greedy", "seeded"])
def test_bf16_pd_equals_colocated_and_moves_half_the_bytes(cluster, n, sampling):
    seed = n + (0 if sampling["temperature"] == 0 else 1000)  # a prompt of its own: no prefix hit on D
    body = {"prompt": token_prompt(seed, n), "max_tokens": 12, "ignore_eos": True, "logprobs": 1, **sampling}
    status, want = complete(cluster["ref"].url, body)
    assert status == 200, want
    d = cluster["D"]
    before = metric(d, "atomd:kv_transfer_bytes_total")
    status, got = complete(cluster.router.url, body)
    assert status == 200, got
    w, g = want["choices"][0], got["choices"][0]
    assert g["text"] == w["text"] and g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
    assert g["logprobs"]["token_logprobs"] == w["logprobs"]["token_logprobs"]  # the same bf16 arithmetic
    assert metric(cluster.router, "atomd_router:decision_total", decision="pd") >= 1
    bf16_block = block_bytes() // 2  # block_bytes(): float32's
    assert metric(d, "atomd:kv_transfer_bytes_total") - before == math.ceil(n / BLOCK) * bf16_block
    cluster.assert_settled()
