"""LLMEngine and the offline LLM API: request lifecycle (rejection, abort, stops), logprobs
against transformers, seeds, prompt forms, EngineConfig validation, the KV cache layout
the KV transfer relies on, and `atomd generate`."""
from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np
import pytest
import torch

from atomd.cli import main as cli_main
from atomd.config import EngineConfig, add_engine_args
from atomd.llm import LLM
from atomd.engine.kv_cache import KVCache
from contracts.sampling import SamplingParams
from tests.test_model_hf import hf_greedy, hf_model, make_checkpoint, prompts_of

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> pathlib.Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=3)


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), num_threads=1, max_model_len=128, num_kvcache_blocks=64)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def assert_idle(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert not llm.engine.has_unfinished_requests()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_running"] == 0


@pytest.mark.unit
def test_unschedulable_request_finishes_with_the_schedulers_message(llm):
    engine = llm.engine
    engine.add_request("too-long", list(range(3, 200)), greedy(4))
    outputs = engine.step()
    (out,) = [o for o in outputs if o.request_id == "too-long"]
    assert out.finished and out.new_token_ids == [] and "max_model_len=128" in out.error
    result = llm.generate([{"prompt_token_ids": list(range(3, 200))}], greedy(4))[0]
    assert result.error is not None and result.outputs[0].token_ids == []
    assert_idle(llm)


@pytest.mark.unit
def test_abort_surfaces_a_finished_output_and_frees_blocks(llm):
    engine = llm.engine
    engine.add_request("a", prompts_of([40])[0], greedy(50))
    engine.step()
    assert engine.stats()["num_free_blocks"] < engine.stats()["num_total_blocks"]
    assert engine.abort_request("a") and not engine.abort_request("a") and not engine.abort_request("nope")
    (out,) = engine.step()
    assert (out.request_id, out.finished, out.finish_reason) == ("a", True, "abort")
    assert_idle(llm)


@pytest.mark.unit
def test_stop_token_ids_and_max_tokens(llm, llama_dir):
    prompt = prompts_of([20], seed=1)[0]
    ref = hf_greedy(llama_dir, prompt, 6)
    stop_at = ref[2]
    cut = ref[:ref.index(stop_at) + 1]
    out = llm.generate([{"prompt_token_ids": prompt}], greedy(6, stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.token_ids == cut and out.finish_reason == "stop" and out.stop_reason == stop_at
    out = llm.generate([{"prompt_token_ids": prompt}], greedy(6))[0].outputs[0]
    assert out.token_ids == ref and out.finish_reason == "length"


@pytest.mark.unit
def test_stop_string_ends_the_text(llm):
    prompt = "def main():"
    full = llm.generate(prompt, greedy(12))[0].outputs[0]
    stop = full.text[4:6]
    at = full.text.index(stop)
    out = llm.generate(prompt, greedy(12, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == full.text[:at]
    kept = llm.generate(prompt, greedy(12, stop=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full.text[:at + len(stop)]


@pytest.mark.unit
def test_logprobs_equal_transformers(llm, llama_dir):
    prompt = prompts_of([19], seed=2)[0]
    out = llm.generate([{"prompt_token_ids": prompt}], greedy(5, logprobs=3))[0].outputs[0]
    with torch.inference_mode():
        res = hf_model(llama_dir).generate(torch.tensor([prompt]), max_new_tokens=5, min_new_tokens=5, do_sample=False,
                                           output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    assert out.token_ids == res.sequences[0, len(prompt):].tolist()
    for entry, logits in zip(out.logprobs, res.logits):
        ref = torch.log_softmax(logits[0].double(), -1)
        top = ref.topk(3)
        assert entry.logprob == pytest.approx(top.values[0].item(), abs=1e-4)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.unit
def test_seeded_sampling_is_reproducible_across_batches(llm):
    prompt = {"prompt_token_ids": prompts_of([10], seed=4)[0]}
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": p} for p in prompts_of([5, 30], seed=5)]
    mixed = llm.generate([others[0], prompt, others[1]],
                         [SamplingParams(max_tokens=7, temperature=1.0), seeded, SamplingParams(max_tokens=3)])
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=12, ignore_eos=True)
    assert llm.generate([prompt], other_seed)[0].outputs[0].token_ids != alone


@pytest.mark.unit
def test_string_prompts_are_tokenized_and_long_batches_show_progress(llm, capsys):
    tok = llm.get_tokenizer()
    by_text = llm.generate(["import os"] * 16, greedy(3))
    by_ids = llm.generate({"prompt_token_ids": tok.encode("import os")}, greedy(3))
    assert all(o.outputs[0].token_ids == by_ids[0].outputs[0].token_ids for o in by_text)
    assert by_text[0].prompt == "import os" and by_text[0].prompt_token_ids == tok.encode("import os")
    assert "Processed prompts" in capsys.readouterr().err


@pytest.mark.unit
def test_bad_prompts_are_refused_whole(llm):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [5, 10 ** 6]}], greedy(2))
    with pytest.raises(ValueError, match="prompts"):
        llm.generate([{"text": "x"}], greedy(2))
    llm.engine.step()  # the aborted first prompt surfaces and is gone
    assert_idle(llm)


@pytest.mark.unit
def test_default_model_when_none_is_given():
    llm = LLM(num_threads=1, max_model_len=64, num_kvcache_blocks=16)
    out = llm.generate("def ", greedy(4))[0].outputs[0]
    assert len(out.token_ids) == 4 and llm.engine.model_name == "atomd-default"


# ---------------------------------------------------------------------- config and KV layout

@pytest.mark.unit
def test_engine_args_parse_into_the_config(llama_dir):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", str(llama_dir), "--max-model-len", "512", "--no-enable-prefix-caching",
                              "--kv-cache-memory", "2MiB", "--kv-role", "producer", "--num-threads", "1"])
    config = EngineConfig.from_args(args)
    assert (config.model, config.max_model_len, config.enable_prefix_caching, config.kv_cache_memory,
            config.kv_role, config.num_threads) == (str(llama_dir), 512, False, 2 << 20, "producer", 1)
    assert EngineConfig().num_threads_or_all() >= 1 and EngineConfig().dtype == "float32"
    # 2 layers * (k, v) * 16 slots * 2 heads * 16 dims * 4 bytes = 8 KiB per block
    llm = LLM(str(llama_dir), num_threads=1, kv_cache_memory="1MiB")
    assert llm.engine.stats()["num_total_blocks"] == 128


@pytest.mark.unit
@pytest.mark.parametrize("kwargs, field", [({"dtype": "float64"}, "dtype"), ({"max_model_len": 0}, "max_model_len"),
                                           ({"kv_role": "x"}, "kv_role"), ({"num_kvcache_blocks": 0}, "num_kvcache_blocks"),
                                           ({"model": "/no/such/dir"}, "model"), ({"block_sizes": 8}, "block_sizes"),
                                           ({"kv_cache_memory": "lots"}, "kv_cache_memory")])
def test_bad_engine_args_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_kwargs(**kwargs)


@pytest.mark.unit
def test_kv_cache_is_block_major_and_numpy_view_shares_memory():
    cache = KVCache(num_blocks=4, num_layers=3, block_size=16, num_kv_heads=2, head_dim=8)
    assert cache.kv.shape == (4, 3, 2, 16, 2, 8)
    blocks = cache.as_numpy_blocks()
    assert blocks.shape == (4, 3 * 2 * 16 * 2 * 8 * 4) and blocks.dtype == np.uint8
    blocks[2].view(np.float32)[:] = 1.5  # one frame of bytes = block 2 of every layer
    assert (cache.kv[2] == 1.5).all() and (cache.kv[[0, 1, 3]] == 0).all()


# ---------------------------------------------------------------------- atomd generate

@pytest.mark.unit
def test_generate_command_prints_the_offline_result(llm, llama_dir, capsys):
    want = llm.generate("import os", greedy(5))[0].outputs[0]
    rc = cli_main(["generate", "--model", str(llama_dir), "--prompt", "import os", "--max-tokens", "5",
                   "--ignore-eos", "--json", "--num-threads", "1", "--max-model-len", "64"])
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and line["token_ids"] == want.token_ids and line["text"] == want.text
    assert cli_main(["generate", "--prompt", "x", "--max-tokens", "0"]) == 2


@pytest.mark.unit
def test_writes_into_the_numpy_block_view_are_what_the_model_reads(llama_dir):
    """What kv_transfer does: bytes written into the view are the KV a prefix hit attends to."""
    prompt = {"prompt_token_ids": prompts_of([3 * 16 + 4], seed=12)[0]}
    want = hf_greedy(llama_dir, prompt["prompt_token_ids"], 6)
    source = LLM(str(llama_dir), num_threads=1, max_model_len=128, num_kvcache_blocks=16)
    target = LLM(str(llama_dir), num_threads=1, max_model_len=128, num_kvcache_blocks=16)
    for llm in (source, target):
        assert llm.generate(prompt, greedy(6))[0].outputs[0].token_ids == want
    view = target.engine.kv_cache.as_numpy_blocks()
    view[:] = 0  # the target's cached prefix blocks now hold zeros
    hit = target.generate(prompt, greedy(6))[0]
    assert hit.num_cached_tokens == 48 and hit.outputs[0].token_ids != want
    view[:] = source.engine.kv_cache.as_numpy_blocks()  # same allocation order: same block ids
    assert target.generate(prompt, greedy(6))[0].outputs[0].token_ids == want
