"""PD over a narrow KV cache: a prefill and a decode engine with --kv-cache-dtype fp8 (or float16 under the
float32 model) answer as the colocated engine with that cache (in-process) does and as Hugging Face does on
K/V rounded alike, token for token, with a sliding window on every layer (Mistral); D moves one byte a value
for fp8 (half a bfloat16 cache's bytes, a quarter of float32's), two for float16; a float32-cache decode
engine refuses an fp8 producer's blocks by the fingerprint's kv_cache_dtype before any byte moves."""
from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from tests.families import Family
from tests.pd_fixtures import PDCluster, block_bytes, metric
from tests.test_kv_fp8 import hf_on_narrow_kv
from tests.test_model_hf import BLOCK, prompts_of
from tests.test_pd_e2e import complete, prefill_leg
from tests.test_quant_engine import greedy, hf_greedy
from atomd.llm import LLM

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
WINDOW = 24


@pytest.fixture(scope="module")
def fp8_pd(tmp_path_factory):
    path = Family("mistral", 43, {"sliding_window": WINDOW}, ()).write(tmp_path_factory.mktemp("mistral_fp8"))
    flags, flags16 = (["--max-model-len", "256", "--kv-cache-dtype", kv] for kv in ("fp8", "float16"))
    cluster = PDCluster(path)
    try:
        cluster.start_engines(P=[*flags, "--kv-role", "producer"], D=[*flags, "--kv-role", "consumer"],
                              D32=["--max-model-len", "256", "--kv-role", "consumer"],
                              P16=[*flags16, "--kv-role", "producer"], D16=[*flags16, "--kv-role", "consumer"])
        cluster.router = cluster.start_router("P", "D")
        cluster.router16 = cluster.start_router("P16", "D16")
        cluster.baseline = {name: e.stats()["num_total_blocks"] for name, e in cluster.engines.items()}
        yield path, cluster
    finally:
        cluster.stop()


@pytest.mark.parametrize("kv,n", [("fp8", 5), ("fp8", 6 * BLOCK + 3), ("float16", 6 * BLOCK + 3)])
def test_narrow_pd_equals_colocated_and_hf_moving_the_caches_bytes(fp8_pd, kv, n):
    path, cluster = fp8_pd
    router, d, dtype = ((cluster.router, cluster["D"], torch.float8_e4m3fn) if kv == "fp8"
                        else (cluster.router16, cluster["D16"], torch.float16))
    prompt = [t % 297 + 3 for t in prompts_of([n], seed=n + 200)[0]]  # the tokenizer's 300 ids
    body = {"prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    moved = metric(d, "atomd:kv_transfer_bytes_total")
    status, got = complete(router.url, body)
    assert status == 200, got
    assert metric(router, "atomd_router:decision_total", decision="pd") >= 1
    moved = metric(d, "atomd:kv_transfer_bytes_total") - moved
    # the blocks inside the first decode query's window, at one byte a value for fp8, two for float16
    pulled = -(-n // BLOCK) - max(0, n - WINDOW) // BLOCK
    assert moved == pulled * block_bytes(path, value_bytes=dtype.itemsize) == pulled * block_bytes(path) * dtype.itemsize // 4
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    colocated = LLM(str(path), num_threads=1, max_model_len=256, kv_cache_dtype=kv)  # in-process: one server fewer
    text = got["choices"][0]["text"]
    assert text == tokenizer.decode(greedy(colocated, [prompt])[0])
    assert text == tokenizer.decode(hf_greedy(hf_on_narrow_kv(path, dtype), prompt, 48))
    cluster.assert_settled()


def test_a_float32_cache_refuses_fp8_blocks_before_any_byte_moves(fp8_pd):
    _, cluster = fp8_pd
    prompt = [t % 297 + 3 for t in prompts_of([20], seed=5)[0]]
    params = prefill_leg(cluster["P"], prompt)
    assert params["compat"]["kv_cache_dtype"] == "fp8_e4m3" and params["compat"]["dtype"] == "float32"
    d32 = cluster["D32"]
    refused = metric(d32, "atomd:kv_transfer_failures_total", reason="compat_mismatch")
    status, err = complete(d32.url, {"prompt": prompt, "max_tokens": 4, "temperature": 0, "kv_transfer_params": params})
    assert status == 503 and err["error"]["code"] == "kv_transfer_failed", err
    # the reason names both dtypes ("compat mismatch on kv_cache_dtype: expected 'float32', got 'fp8_e4m3'":
    # test_kv_fp8.test_fingerprint_names_the_kv_cache_dtype); the client sees kv_transfer_failed
    assert metric(d32, "atomd:kv_transfer_failures_total", reason="compat_mismatch") == refused + 1
    assert metric(d32, "atomd:kv_transfer_bytes_total") == 0
    cluster.assert_settled()  # P's lease of the refused blocks runs out or is given back

