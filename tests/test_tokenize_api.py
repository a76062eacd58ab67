"""/tokenize, /detokenize and /tokenizer_info (issue 40) on an engine and through the router,
in vLLM's shapes, against the Hugging Face tokenizer of the same checkpoint; then lm-eval's
`local-completions` (its default tokenizer probe finds these routes) against the PD pair:
`--batch_size 4` (several prompts per completions request) gives the very answers of
`--batch_size 1`, and those of the colocated engine."""
from __future__ import annotations

import json
import pathlib

import pytest
import transformers

from launch.process import http
from tests.pd_fixtures import pd, settled  # noqa: F401 (fixtures)
from tests.server_fixtures import MAX_MODEL_LEN, model_dir

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TEXTS = ["def fibonacci(n):\n    return n", "héllo wörld, ünïcode ✓", "  leading spaces\tand\ttabs\n\n"]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def hf():
    return transformers.AutoTokenizer.from_pretrained(str(model_dir()))


def urls(pd) -> list[str]:
    return [pd["ref"].url, pd.router.url]


def post(url: str, path: str, body) -> tuple[int, dict]:
    status, raw = http("POST", url + path, body)
    return status, json.loads(raw)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_tokenize_prompt_equals_hf(pd, hf, add_special_tokens):
    for url in urls(pd):
        for text in TEXTS:
            status, got = post(url, "/tokenize", {"prompt": text, "add_special_tokens": add_special_tokens,
                                                  "return_token_strs": True})
            assert status == 200, got
            want = hf(text, add_special_tokens=add_special_tokens)["input_ids"]
            assert got["tokens"] == want and got["count"] == len(want)
            assert got["token_strs"] == hf.convert_ids_to_tokens(want)
            assert got["max_model_len"] == MAX_MODEL_LEN
            status, back = post(url, "/detokenize", {"tokens": got["tokens"]})
            assert status == 200 and back["prompt"] == hf.decode(want, skip_special_tokens=True)
            if not add_special_tokens:
                assert back["prompt"] == text  # byte-level BPE round-trips exactly


def hf_chat_ids(hf, add_generation_prompt: bool) -> list[int]:
    text = hf.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False)
    return hf(text, add_special_tokens=False)["input_ids"]  # the template wrote the special tokens


def test_tokenize_chat_is_the_chat_prompt(pd, hf):
    want = hf_chat_ids(hf, True)
    for url in urls(pd):
        status, got = post(url, "/tokenize", {"messages": MESSAGES})
        assert status == 200, got
        assert got["tokens"] == want and got["token_strs"] is None
        # exactly the prompt a chat request gets: its usage counts the same tokens
        status, chat = post(url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
        assert status == 200 and chat["usage"]["prompt_tokens"] == len(want)
    status, got = post(pd["ref"].url, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert got["tokens"] == hf_chat_ids(hf, False) != want


def test_tokenizer_info_names_the_special_tokens_and_template(pd, hf):
    for url in urls(pd):
        status, raw = http("GET", url + "/tokenizer_info")
        assert status == 200, raw
        info = json.loads(raw)
        assert (info["eos_token"], info["bos_token"]) == (hf.eos_token, hf.bos_token)
        assert info["chat_template"] == hf.chat_template
        assert info["tokenizer_class"]


BAD = [("/tokenize", {"prompt": 7}, "prompt"), ("/tokenize", {"prompt": "x", "nope": 1}, "nope"),
       ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
       ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
       ("/tokenize", {"messages": [{"role": "user", "content": "x"}] * 1025}, "messages"),
       ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
       ("/tokenize", [1, 2], None),
       ("/detokenize", {"tokens": [1, -1]}, "tokens"), ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
       ("/detokenize", {"tokens": "abc"}, "tokens"), ("/detokenize", {"tokens": [2 ** 70]}, "tokens")]


@pytest.mark.parametrize("path,body,param", BAD)
def test_bad_tokenize_bodies_are_openai_errors(pd, path, body, param):
    for url in urls(pd):
        status, got = post(url, path, body)
        assert 400 <= status < 500, (url, got)
        assert isinstance(got["error"]["message"], str) and got["error"]["param"] == param, got


def test_the_routes_are_in_both_openapi_documents(pd):
    for url in urls(pd):
        status, raw = http("GET", url + "/openapi.json")
        paths = json.loads(raw)["paths"]
        assert {"/tokenize", "/detokenize", "/tokenizer_info"} <= set(paths)


# ---------------------------------------------------------------------- lm-eval 0.4.13, local-completions

TASKS = {
    "atomd_mc": {"output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
                 "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}]},
    "atomd_gen": {"output_type": "generate_until", "doc_to_text": "{{question}}", "doc_to_target": "{{target}}",
                  "generation_kwargs": {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": False},
                  "metric_list": [{"metric": "exact_match"}]},
}
DOCS = [{"question": q, "choices": [" 1", " 2", " fib(n - 1)", " None"], "answer": 2, "target": " x"}
        for q in ("def fib(n):\n    return", "import os\nimport", "x = [1, 2,", "class A:\n    def",
                  "for i in range(", "print(", "while True:\n   ")]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> pathlib.Path:
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    (d / "docs.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    for name, spec in TASKS.items():
        spec = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(d / "docs.jsonl")}},
                "test_split": "test", **spec}
        (d / f"{name}.yaml").write_text(json.dumps(spec))  # YAML is a superset of JSON
    return d


def lm_eval_samples(url: str, batch_size: int, task_dir: pathlib.Path) -> dict:
    """lm-eval's answers per task and doc, run in this process as `lm_eval --model local-completions`."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model="local-completions", model_args={"base_url": url + "/v1/completions", "max_length": MAX_MODEL_LEN,
                                               "num_concurrent": 1, "max_retries": 1},
        tasks=sorted(TASKS), batch_size=batch_size,
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False), log_samples=True)
    assert out["config"]["model_args"]["base_url"].startswith(url)
    return {task: [s["resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]
            for task, samples in out["samples"].items()}


def test_lm_eval_batch_4_equals_batch_1_on_pd_and_colocated(pd, task_dir, monkeypatch):
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # the task's data is a local file; nothing is fetched

    probe = LocalCompletionsAPI(base_url=pd.router.url + "/v1/completions")
    assert probe.tokenizer_backend == "remote"  # its default probe found /tokenizer_info and /tokenize
    one = lm_eval_samples(pd.router.url, 1, task_dir)
    four = lm_eval_samples(pd.router.url, 4, task_dir)
    assert four == one
    ref = lm_eval_samples(pd["ref"].url, 4, task_dir)
    assert ref["atomd_gen"] == one["atomd_gen"]
    for got, want in zip(one["atomd_mc"], ref["atomd_mc"]):
        for (lp, greedy), (ref_lp, ref_greedy) in zip((r[0] for r in got), (r[0] for r in want)):
            assert lp == pytest.approx(ref_lp, abs=1e-5) and greedy == ref_greedy
