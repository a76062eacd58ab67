"""`atomd serve` through the official `openai` client, against the offline `atomd.LLM`.

Greedy requests over HTTP must produce exactly what the offline engine produces for the
same prompt; chat prompts are rendered by Hugging Face's tokenizer (the reference chat
template implementation) and fed to the offline engine as token ids.
"""
from __future__ import annotations

import json

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launch.process import http
from tests.server_fixtures import MAX_MODEL_LEN, model_dir, start_server

pytestmark = pytest.mark.integration

NAME = "atomd-default"
PROMPTS = ["def add(a, b):", "import os\nimport sys\n", "class Stack:\n    def push(self, item):"]
CHATS = [[{"role": "user", "content": "Return the largest item of a list."}],
         [{"role": "system", "content": "You write Python."},
          {"role": "user", "content": "Split a string on commas."}]]


@pytest.fixture(scope="module")
def server():
    srv = start_server(model_dir(), "--served-model-name", NAME)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline():
    import torch

    from atomd import LLM

    torch.set_num_threads(1)
    return LLM(model=str(model_dir()), max_model_len=MAX_MODEL_LEN, num_threads=1)


@pytest.fixture(scope="module")
def hf_tokenizer():
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir())


def offline_run(offline, prompts, **params):
    from atomd import SamplingParams

    inputs = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    return [o.outputs[0] for o in offline.generate(inputs, SamplingParams(**params))]


def chat_ids(hf_tokenizer, messages) -> list[int]:
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return hf_tokenizer(text, add_special_tokens=False).input_ids  # the template wrote BOS itself


def test_models_lists_the_served_name(client):
    models = client.models.list().data
    assert [m.id for m in models] == [NAME]


def test_completions_greedy_equal_offline(client, offline):
    want = offline_run(offline, PROMPTS, max_tokens=12, temperature=0.0)
    for prompt, ref in zip(PROMPTS, want):
        resp = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
        choice = resp.choices[0]
        assert choice.text == ref.text
        assert choice.finish_reason == ref.finish_reason
        assert resp.usage.completion_tokens == len(ref.token_ids)
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_completions_stream_equals_offline(client, offline):
    ref = offline_run(offline, PROMPTS[:1], max_tokens=12, temperature=0.0)[0]
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_token_id_prompts_and_a_list_of_one_string(client, offline, hf_tokenizer):
    ids = hf_tokenizer(PROMPTS[1]).input_ids
    ref = offline_run(offline, [ids], max_tokens=8, temperature=0.0)[0]
    by_ids = client.completions.create(model=NAME, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == ref.text and by_ids.usage.prompt_tokens == len(ids)
    one = client.completions.create(model=NAME, prompt=[PROMPTS[1]], max_tokens=8, temperature=0)
    assert one.choices[0].text == offline_run(offline, PROMPTS[1:2], max_tokens=8, temperature=0.0)[0].text


def test_completion_logprobs_equal_offline(client, offline):
    ref = offline_run(offline, PROMPTS[:1], max_tokens=6, temperature=0.0, logprobs=3)[0]
    resp = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    want = [entry.logprob for entry in ref.logprobs]
    assert lp.token_logprobs == pytest.approx(want, abs=1e-4)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    # greedy: the sampled token is the most likely one
    assert all(max(top.values()) == pytest.approx(t, abs=1e-6) for top, t in zip(lp.top_logprobs, lp.token_logprobs))
    assert len(lp.tokens) == len(ref.token_ids) and lp.text_offset[0] == 0


def test_chat_greedy_equal_offline(client, offline, hf_tokenizer):
    want = offline_run(offline, [chat_ids(hf_tokenizer, m) for m in CHATS], max_tokens=16, temperature=0.0)
    for messages, ref in zip(CHATS, want):
        resp = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0)
        assert resp.choices[0].message.role == "assistant"
        assert resp.choices[0].message.content == ref.text
        assert resp.usage.prompt_tokens == len(chat_ids(hf_tokenizer, messages))
        assert resp.usage.completion_tokens == len(ref.token_ids)


def test_chat_stream_and_logprobs(client, offline, hf_tokenizer):
    ref = offline_run(offline, [chat_ids(hf_tokenizer, CHATS[0])], max_tokens=10, temperature=0.0,
                      logprobs=2)[0]
    chunks = list(client.chat.completions.create(
        model=NAME, messages=CHATS[0], max_completion_tokens=10, temperature=0, stream=True,
        logprobs=True, top_logprobs=2, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    content = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.logprob for t in content] == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-4)
    assert all(len(t.top_logprobs) == 2 for t in content)
    # greedy: the sampled token is the first of the top list
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-6) for t in content)
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_seeded_sampling_equals_offline(client, offline):
    ref = offline_run(offline, PROMPTS[:1], max_tokens=10, temperature=1.0, top_p=0.9, top_k=20, seed=7)[0]
    for _ in range(2):
        resp = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=10, temperature=1.0,
                                         top_p=0.9, seed=7, extra_body={"top_k": 20})
        assert resp.choices[0].text == ref.text


def test_stop_string_and_stop_token_ids(client, offline):
    full = offline_run(offline, PROMPTS[1:2], max_tokens=16, temperature=0.0, ignore_eos=True)[0]
    assert len(full.text) >= 5, full.text
    stop = full.text[3:5]  # some text the greedy output is known to contain
    resp = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                     stop=[stop], extra_body={"ignore_eos": True})
    assert resp.choices[0].text == full.text[: full.text.index(stop)]
    assert resp.choices[0].finish_reason == "stop"
    third = full.token_ids[2]
    resp = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                     extra_body={"stop_token_ids": [third], "ignore_eos": True})
    assert resp.usage.completion_tokens == full.token_ids.index(third) + 1
    assert resp.choices[0].finish_reason == "stop"


def test_min_tokens_and_max_completion_tokens(client):
    resp = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                     extra_body={"min_tokens": 5, "ignore_eos": True})
    assert resp.usage.completion_tokens == 5 and resp.choices[0].finish_reason == "length"
    resp = client.chat.completions.create(model=NAME, messages=CHATS[0], max_completion_tokens=3,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 3 and resp.choices[0].finish_reason == "length"


def test_prefix_cache_hits_show_as_cached_tokens(server, client, hf_tokenizer):
    assert http("POST", server.url + "/reset_prefix_cache")[0] == 200
    ids = (hf_tokenizer("\n".join(f"import mod{i}" for i in range(20))).input_ids * 2)[:40]
    first = client.completions.create(model=NAME, prompt=ids, max_tokens=2, temperature=0)
    second = client.completions.create(model=NAME, prompt=ids, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # 40 tokens = two full 16-token blocks + a partial one; only full blocks are reused
    assert second.usage.prompt_tokens_details.cached_tokens == 32
    assert second.choices[0].text == first.choices[0].text
    assert http("POST", server.url + "/reset_prefix_cache")[0] == 200
    third = client.completions.create(model=NAME, prompt=ids, max_tokens=2, temperature=0)
    assert third.usage.prompt_tokens_details.cached_tokens == 0


def test_kv_transfer_params_round_trip(client):
    resp = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=2, temperature=0,
                                     extra_body={"kv_transfer_params": {"transfer_id": "t-1"}})
    assert "kv_transfer_params" in resp.model_extra  # the engine's answer (null without a connector)
    resp = client.chat.completions.create(model=NAME, messages=CHATS[0], max_tokens=2, temperature=0)
    assert "kv_transfer_params" in resp.model_extra


def metric_values(server) -> dict[tuple, float]:
    status, body = http("GET", server.url + "/metrics")
    assert status == 200
    values = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            assert s.labels.get("model_name") == NAME and s.labels.get("dp_rank") == "0", s
            values[(s.name, s.labels.get("finished_reason"))] = s.value
    return values


def test_metrics_parse_and_counters_move(server, client):
    before = metric_values(server)
    resp = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=7, temperature=0,
                                     extra_body={"ignore_eos": True})
    after = metric_values(server)

    def moved(name, reason=None):
        return after.get((name, reason), 0) - before.get((name, reason), 0)

    assert moved("atomd:generation_tokens_total") == 7
    assert moved("atomd:prompt_tokens_total") == resp.usage.prompt_tokens
    assert moved("atomd:request_success_total", "length") == 1
    assert moved("atomd:time_to_first_token_seconds_count") == 1
    assert moved("atomd:e2e_request_latency_seconds_count") == 1
    assert moved("atomd:inter_token_latency_seconds_count") == 6
    assert moved("atomd:request_queue_time_seconds_count") == 1
    assert moved("atomd:prefix_cache_queries_total") >= resp.usage.prompt_tokens
    assert after[("atomd:num_requests_running", None)] == 0
    assert 0 <= after[("atomd:kv_cache_usage_perc", None)] <= 1
