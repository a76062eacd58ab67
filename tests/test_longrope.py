"""Phi-3's longrope past original_max_position_embeddings against Hugging Face transformers
(a tiny random `Phi3ForCausalLM`, original length 256, max_position_embeddings 512, long
factors unlike the short ones). transformers takes the long factors for a whole forward when
its furthest position reaches past the original length: a prompt longer than it runs long
everywhere, a short prompt's decode switches to them at position 256 while the cached keys
before stay short. The engine follows that per sequence and step (atomd/model/rotary.py):
prompt logits of short and long prompts, and 48 greedy ids across the boundary in one
batch, equal HF's through both attention backends, with n-gram drafts straddling it."""
from __future__ import annotations

import pytest
import torch

from atomd.llm import LLM
from atomd.model.loader import load_model
from contracts.sampling import SamplingParams
from tests.test_model_hf import _prompt_logits, assert_equals_hf, engine_greedy, hf_model, make_checkpoint, prompts_of
from tests.test_spec_decode import SPEC_JSON

ORIGINAL = 256
PAST = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("phi3_long"), "phi3", seed=6)


@pytest.mark.unit
def test_tables_hold_the_short_rows_then_the_long_ones(phi3_dir):
    short, both = load_model(phi3_dir, max_positions=ORIGINAL), load_model(phi3_dir, max_positions=2 * ORIGINAL)
    assert short.cos.shape[0] == ORIGINAL and both.cos.shape[0] == 4 * ORIGINAL
    assert torch.equal(both.cos[:ORIGINAL], short.cos)
    assert not torch.allclose(both.cos[2 * ORIGINAL + 5], both.cos[5])  # the long factors' row of position 5


@pytest.mark.unit
@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("length", [ORIGINAL - 56, ORIGINAL + 44])  # short factors; long ones for every position
def test_prompt_logits_match_hf(phi3_dir, backend, length, caplog):
    llm = LLM(str(phi3_dir), num_threads=1, max_model_len=2 * ORIGINAL, attention_backend=backend)
    assert "prefix caching is off" in caplog.text  # a block's KV depends on its step's length
    prompt = prompts_of([length], seed=3)[0]
    got = _prompt_logits(llm, prompt)
    with torch.inference_mode():
        want = hf_model(phi3_dir)(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.unit
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_greedy_across_the_original_length_equals_hf(phi3_dir, backend):
    llm = LLM(str(phi3_dir), num_threads=1, max_model_len=2 * ORIGINAL, attention_backend=backend)
    prompts = prompts_of([ORIGINAL - 16, ORIGINAL + 44, 10], seed=2)  # crosses during decode; past; short
    assert_equals_hf(phi3_dir, prompts, engine_greedy(llm, prompts, PAST), n=48)
    alone = prompts_of([ORIGINAL - 5], seed=9)  # batch 1: the fused decode layer reads the long rows
    assert_equals_hf(phi3_dir, alone, engine_greedy(llm, alone, PAST), n=48)


@pytest.mark.unit
def test_drafts_straddling_the_original_length_equal_hf(phi3_dir):
    """Each draft row runs the factors of its own position, as transformers' token-by-token decode."""
    llm = LLM(str(phi3_dir), num_threads=1, max_model_len=2 * ORIGINAL, speculative_config=SPEC_JSON)
    loops = [(p * 80)[:ORIGINAL - 10] for p in prompts_of([3, 5], seed=21)]  # repetitive: drafts
    got = engine_greedy(llm, loops, PAST)
    assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0
    assert_equals_hf(phi3_dir, loops, got, n=48)
