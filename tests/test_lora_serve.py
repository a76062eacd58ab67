"""LoRA adapters over HTTP: a colocated engine and a prefill / decode pair behind the router,
serving three PEFT adapters and the base model at once; each request's greedy ids equal
transformers + PeftModel (tests/test_lora.py's references); /v1/models lists the adapters
with their parent; an unknown adapter is a 404 naming it; D refuses KV computed under
another adapter; an adapter unloaded while a request streams under it finishes that request,
and new requests naming it get a 404."""
from __future__ import annotations

import concurrent.futures
import time
import http.client as httpclient
import json
import uuid
from urllib.parse import urlparse

import pytest

from launch.process import RouterServer, http
from tests.pd_fixtures import ref_and_pd
from tests.server_fixtures import REPO, START_TIMEOUT_S, server_log
from tests.test_lora import ADAPTERS, TOKENS, make_adapter, reference
from tests.test_model_hf import make_checkpoint
from tests.test_model_hf import prompts_of as random_prompts
from tests.test_pd_e2e import complete

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_serve")
    base = make_checkpoint(root / "base", "llama", seed=5)
    adapters = {name: make_adapter(base, root / name, r, a, rs, t, seed=i + 11)
                for i, (name, r, a, rs, t) in enumerate(ADAPTERS)}
    return base, adapters


@pytest.fixture(scope="module")
def cluster(models):
    base, adapters = models
    flags = ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "8", "--lora-modules",
             *[f"{n}={p}" for n, p in adapters.items()]]
    with ref_and_pd(*flags, model=base) as pd:
        yield pd


def body(prompt: list[int], model: str | None, **extra) -> dict:
    out = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": 0, **extra}
    if model is not None:
        out["model"] = model
    return out


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    """Random prompts in the tokenizer's 300 ids (the model has 320)."""
    return [[t % 297 + 3 for t in p] for p in random_prompts(lengths, seed=seed)]


def text_of(answer: dict) -> str:
    return answer["choices"][0]["text"]


@pytest.fixture(scope="module")
def tokenizer(models):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(models[0] / "tokenizer.json"))


def test_mixed_adapters_colocated_and_pd_equal_peft(cluster, models, tokenizer):
    base, adapters = models
    names = [None, "sql", "poet", "attn"]
    prompts = prompts_of([5, 37, 16, 23], seed=41)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # in flight together: one mixed batch
        futures = {(url, i): pool.submit(complete, url, body(p, n))
                   for url in (cluster["ref"].url, cluster.router.url) for i, (p, n) in enumerate(zip(prompts, names))}
        answers = {k: f.result() for k, f in futures.items()}
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        want = reference(base, adapters.get(name), prompt)
        for url in (cluster["ref"].url, cluster.router.url):
            status, answer = answers[(url, i)]
            assert status == 200, answer
            assert text_of(answer) == tokenizer.decode(want), (url, name)
            assert len(answer["choices"][0]["logprobs"]["tokens"]) == TOKENS
    cluster.assert_settled()


def test_models_lists_adapters_with_parent_and_unknown_is_404(cluster, models):
    status, raw = http("GET", cluster["ref"].url + "/v1/models")
    cards = {c["id"]: c for c in json.loads(raw)["data"]}
    base_id = str(models[0])
    assert status == 200 and set(cards) == {base_id, "sql", "poet", "attn"}
    assert all(cards[n]["parent"] == base_id for n in ("sql", "poet", "attn"))
    for url in (cluster["ref"].url, cluster.router.url):
        status, answer = complete(url, body([3, 4, 5], "nope"))
        assert status == 404 and "'nope'" in answer["error"]["message"] and answer["error"]["code"] == "model_not_found"


def test_decode_refuses_kv_of_another_adapter(cluster):
    prompt = prompts_of([20], seed=5)[0]
    status, first = complete(cluster["P"].url, body(prompt, "sql", max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "transfer_id": uuid.uuid4().hex}))
    assert status == 200 and first["kv_transfer_params"]["lora_name"] == "sql"
    status, answer = complete(cluster["D"].url, body(prompt, "poet", kv_transfer_params=first["kv_transfer_params"]))
    assert status == 400 and "'sql'" in answer["error"]["message"] and "'poet'" in answer["error"]["message"]
    http("POST", cluster["P"].url + "/kv_transfer/abort", {"transfer_id": first["kv_transfer_params"]["transfer_id"]})
    cluster.assert_settled()


def test_unload_while_streaming_then_load_again(cluster, models, tokenizer):
    base, adapters = models
    url = cluster["ref"].url
    prompt = prompts_of([30], seed=77)[0]
    long = 200  # long enough to be running when the unload lands (checked below)
    want = reference(base, adapters["poet"], prompt, tokens=long)
    target = urlparse(url)
    conn = httpclient.HTTPConnection(target.hostname, target.port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body(prompt, "poet", stream=True, max_tokens=long)),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        first = resp.readline()  # the first chunk is out: the request runs under poet
        assert first.startswith(b"data: ")
        status, raw = http("POST", url + "/v1/unload_lora_adapter", {"lora_name": "poet"})
        assert status == 200, raw
        assert cluster["ref"].stats()["num_running"] == 1  # so the unload came while it ran
        status, answer = complete(url, body(prompt, "poet"))
        assert status == 404 and "'poet'" in answer["error"]["message"]
        events = [first] + resp.read().split(b"\n")
    finally:
        conn.close()
    chunks = [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]
    streamed = "".join(ch["text"] for c in chunks for ch in c["choices"])
    assert streamed == tokenizer.decode(want)  # finished under poet after its unload
    status, raw = http("POST", url + "/v1/load_lora_adapter", {"lora_name": "poet2", "lora_path": str(adapters["poet"])})
    assert status == 200, raw
    status, answer = complete(url, body(prompt, "poet2"))
    assert status == 200 and text_of(answer) == tokenizer.decode(want[:TOKENS])
    status, raw = http("POST", url + "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(base)})
    assert status == 400 and b"not a PEFT adapter directory" in raw
    cluster.assert_settled()


def test_router_places_adapter_requests_where_the_adapter_is_loaded(cluster, models, tokenizer):
    """Two colocated workers, one serving the adapters (ref) and one without --enable-lora:
    every `model: sql` request lands on ref (the other would answer 404), base requests on
    either; /workers shows each worker's adapters, and follows a run-time load."""
    base, adapters = models
    cluster.start_engines(plain=[])
    cluster.baseline["plain"] = cluster["plain"].stats()["num_total_blocks"]
    router = RouterServer((), (), "--worker", cluster["ref"].url, "--worker", cluster["plain"].url,
                          "--policy", "round_robin", "--health-interval-s", "0.3", log=server_log(), cwd=REPO)
    cluster.routers.append(router)
    router.wait_ready(START_TIMEOUT_S)
    deadline = time.monotonic() + 30
    while True:  # both in rotation, their adapters known
        status, raw = http("GET", router.url + "/workers")
        loras = {w["url"]: w.get("loras") for w in json.loads(raw)["workers"]} if status == 200 else {}
        if len(loras) == 2 and loras.get(cluster["ref"].url) and all(
                w["healthy"] for w in json.loads(raw)["workers"]):
            break
        assert time.monotonic() < deadline, raw
        time.sleep(0.1)
    assert loras[cluster["plain"].url] is None and {"sql", "attn"} <= set(loras[cluster["ref"].url])
    prompt = prompts_of([12], seed=8)[0]
    want = tokenizer.decode(reference(base, adapters["sql"], prompt))
    for _ in range(4):  # round robin would send every other one to plain
        status, answer = complete(router.url, body(prompt, "sql"))
        assert status == 200 and text_of(answer) == want
    # an adapter loaded at run time shows up at the next health round
    status, raw = http("POST", cluster["ref"].url + "/v1/load_lora_adapter",
                       {"lora_name": "late", "lora_path": str(adapters["attn"])})
    assert status == 200, raw
    while "late" not in (next(w for w in json.loads(http("GET", router.url + "/workers")[1])["workers"]
                              if w["url"] == cluster["ref"].url)["loras"] or []):
        assert time.monotonic() < deadline + 30
        time.sleep(0.1)
    status, answer = complete(router.url, body(prompt, "late"))
    assert status == 200 and text_of(answer) == tokenizer.decode(reference(base, adapters["attn"], prompt))
    cluster.assert_settled()
