"""LoRA adapters over HTTP: a colocated engine and a prefill / decode pair behind the router,
serving three PEFT adapters and the base model at once; each request's greedy ids equal
transformers + PeftModel (tests/test_lora.py's references); /v1/models lists the adapters
with their parent; an unknown adapter is a 404 naming it; D refuses KV computed under
another adapter; an adapter unloaded while a request streams under it finishes that request,
and new requests naming it get a 404; the router loads / unloads an adapter on a pool (a
partial failure named), and D loads a missing adapter by --lora-load-policy load."""
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
    # 4096 positions: room for a slot-holding stream that outlasts what the tests send meanwhile
    # (llama3 rope reads original_max_position_embeddings, so the outputs do not change)
    base = make_checkpoint(root / "base", "llama", seed=5, max_position_embeddings=4096)
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


def model_ids(url: str) -> set[str]:
    status, raw = http("GET", url + "/v1/models")
    assert status == 200, raw
    return {c["id"] for c in json.loads(raw)["data"]}


def test_router_loads_and_unloads_an_adapter_on_the_pd_pool(cluster, models, tokenizer):
    """Through the router: an adapter loaded on D alone is not servable (P lacks it), so
    /v1/models leaves it out; loaded on every role it is listed and served equal to PEFT; an
    unload of every role makes it a 404 again. Every engine's result is in the answer."""
    base, adapters = models
    url, p, d = cluster.router.url, cluster["P"].url, cluster["D"].url
    status, raw = http("POST", url + "/v1/load_lora_adapter",
                       {"lora_name": "pool", "lora_path": str(adapters["sql"]), "role": "decode"})
    assert status == 200, raw
    assert [(r["url"], r["ok"]) for r in json.loads(raw)["results"]] == [(d, True)]
    assert "pool" not in model_ids(url) and "sql" in model_ids(url)
    status, raw = http("POST", url + "/v1/load_lora_adapter", {"lora_name": "pool", "lora_path": str(adapters["sql"])})
    assert status == 200, raw
    results = {r["url"]: r for r in json.loads(raw)["results"]}
    assert set(results) == {p, d} and results[p]["message"] == "done" and results[d]["message"] == "already loaded"
    assert "pool" in model_ids(url)
    prompt = prompts_of([14], seed=19)[0]
    status, answer = complete(url, body(prompt, "pool"))
    assert status == 200 and text_of(answer) == tokenizer.decode(reference(base, adapters["sql"], prompt))
    status, raw = http("POST", url + "/v1/unload_lora_adapter", {"lora_name": "pool"})
    assert status == 200 and all(r["ok"] for r in json.loads(raw)["results"]), raw
    assert "pool" not in model_ids(url)
    status, answer = complete(url, body(prompt, "pool"))
    assert status == 404 and "'pool'" in answer["error"]["message"]
    # every engine refuses the same way: their 400, each engine named
    status, raw = http("POST", url + "/v1/load_lora_adapter", {"lora_name": "nope", "lora_path": str(base)})
    err = json.loads(raw)
    assert status == 400 and err["error"]["code"] == "lora_load_refused" and p in err["error"]["message"] \
        and d in err["error"]["message"] and not any(r["ok"] for r in err["results"])
    cluster.assert_settled()


def test_router_load_that_fails_on_one_engine_is_a_partial_failure(cluster, models, tokenizer):
    """Two colocated workers, one without --enable-lora: the load succeeds on one and the
    answer is a 502 naming the other; the adapter is listed and served where it loaded."""
    base, adapters = models
    if "plain" not in cluster.engines:
        cluster.start_engines(plain=[])
        cluster.baseline["plain"] = cluster["plain"].stats()["num_total_blocks"]
    router = RouterServer((), (), "--worker", cluster["ref"].url, "--worker", cluster["plain"].url,
                          "--health-interval-s", "0.3", log=server_log(), cwd=REPO)
    cluster.routers.append(router)
    router.wait_ready(START_TIMEOUT_S)
    status, raw = http("POST", router.url + "/v1/load_lora_adapter",
                       {"lora_name": "half", "lora_path": str(adapters["poet"]), "role": "worker"})
    err = json.loads(raw)
    assert status == 502 and err["error"]["code"] == "lora_partial_failure", raw
    assert cluster["plain"].url in err["error"]["message"] and cluster["ref"].url not in err["error"]["message"]
    results = {r["url"]: r for r in err["results"]}
    assert results[cluster["ref"].url]["ok"] and not results[cluster["plain"].url]["ok"]
    assert "--enable-lora" in results[cluster["plain"].url]["message"]
    assert "half" in model_ids(router.url)
    prompt = prompts_of([9], seed=23)[0]
    for _ in range(2):  # placement: only ref serves it
        status, answer = complete(router.url, body(prompt, "half"))
        assert status == 200 and text_of(answer) == tokenizer.decode(reference(base, adapters["poet"], prompt))
    assert http("POST", cluster["ref"].url + "/v1/unload_lora_adapter", {"lora_name": "half"})[0] == 200
    cluster.assert_settled()


@pytest.fixture(scope="module")
def more_engines(cluster, models):
    """Started together (each start is mostly a model load): D2, a decode engine with one
    adapter slot that loads sql on demand, and dp, a DP=2 engine with one adapter slot per rank."""
    adapters = models[1]
    cluster.start_engines(
        D2=["--kv-role", "consumer", "--max-model-len", "4096", "--enable-lora", "--max-loras", "1", "--max-lora-rank", "8",
            "--lora-modules", f"poet={adapters['poet']}", "--lora-load-policy", "load",
            "--lora-path-map", f"sql={adapters['sql']}"],
        dp=["--data-parallel-size", "2", "--num-threads", "1", "--max-model-len", "4096", "--enable-lora", "--max-loras", "1",
            "--max-lora-rank", "8", "--lora-modules", f"sql={adapters['sql']}"])
    for name in ("D2", "dp"):
        cluster.baseline[name] = cluster[name].stats()["num_total_blocks"]
    return cluster


def test_decode_loads_a_missing_adapter_by_policy(more_engines, models, tokenizer):
    """D with --lora-load-policy load and a path map: a pull for an adapter it has not loaded
    loads it first (two requests at once: both wait for one load; a second load of the name
    would be refused), then decodes equal to PEFT; a name the map lacks is still a 404."""
    cluster, (base, adapters) = more_engines, models
    assert "sql" not in model_ids(cluster["D2"].url)
    prompts = prompts_of([21, 13], seed=31)

    def pd_request(prompt):
        status, first = complete(cluster["P"].url, body(prompt, "sql", max_tokens=1, kv_transfer_params={
            "do_remote_decode": True, "transfer_id": uuid.uuid4().hex}))
        assert status == 200, first
        return complete(cluster["D2"].url, body(prompt, "sql", kv_transfer_params=first["kv_transfer_params"]))

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(pd_request, prompts))
    for prompt, (status, answer) in zip(prompts, answers):
        assert status == 200, answer
        assert text_of(answer) == tokenizer.decode(reference(base, adapters["sql"], prompt))
    assert "sql" in model_ids(cluster["D2"].url)
    status, answer = complete(cluster["D2"].url, body(prompts[0], "attn"))
    assert status == 404 and "'attn'" in answer["error"]["message"]
    cluster.assert_settled()


def prefill_for(cluster, prompt: list[int], name: str | None) -> dict:
    """P's leg of a PD request under `name`: the kv_transfer_params D pulls with."""
    status, first = complete(cluster["P"].url, body(prompt, name, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "transfer_id": uuid.uuid4().hex}))
    assert status == 200, first
    return first["kv_transfer_params"]


def test_decode_request_waits_for_a_slot_while_others_run(more_engines, models, tokenizer):
    """PD, D2 with one adapter slot: while a stream under poet holds it, a PD request under sql
    (loaded on demand: known, no room yet) waits in D2's queue with P's blocks pinned, and a base
    request pulled after it runs past it; once the stream is aborted sql loads, D2 pulls and
    decodes equal to PEFT, and P's blocks are released."""
    cluster, (base, adapters) = more_engines, models
    d2 = cluster["D2"].url
    held, waiting_prompt, other = prompts_of([25, 17, 12], seed=61)
    want_other = tokenizer.decode(reference(base, None, other, tokens=8))
    want = tokenizer.decode(reference(base, adapters["sql"], waiting_prompt))
    stream = open_stream(d2, body(held, "poet", max_tokens=HOLD_TOKENS, kv_transfer_params=prefill_for(cluster, held, "poet")))
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            params = prefill_for(cluster, waiting_prompt, "sql")
            waiting = pool.submit(complete, d2, body(waiting_prompt, "sql", kv_transfer_params=params))
            wait_for("sql's request queued on D2", lambda: cluster["D2"].stats()["num_waiting"] == 1)
            status, answer = complete(d2, body(other, None, max_tokens=8,
                                               kv_transfer_params=prefill_for(cluster, other, None)))
            assert status == 200 and text_of(answer) == want_other
            stats = cluster["D2"].stats()
            assert not waiting.done() and stats["num_waiting"] == 1 and stats["num_running"] == 1  # still held
            stream.close()  # the client goes: the stream is aborted, its slot frees
            stream = None
            status, answer = waiting.result()
        assert status == 200 and text_of(answer) == want
    finally:
        if stream is not None:
            stream.close()
    cluster.assert_settled()


RECORD = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["red", "green", "blue"]}},
          "required": ["name", "n", "tag"], "additionalProperties": False}
# the engines' documented JSON form (atomd/structured.py): no free whitespace, Python's separators
JSON_FORM = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def constrained_reference(base, adapter, prompt: list[int], schema: dict, max_tokens: int) -> tuple[list[int], bool]:
    """Greedy under the grammar, the reference way: transformers + PeftModel's logits, llguidance's
    mask of the tokens the schema allows next (from the checkpoint's tokenizer.json); the argmax
    of the allowed ones, until an end token. (ids, whether it ended)."""
    import llguidance
    import llguidance.numpy as lgnp
    import numpy as np
    import peft
    import torch
    from tokenizers import Tokenizer

    from tests.test_lora import hf_model_copy
    from tests.test_model_hf import VOCAB

    ends = sorted({2, Tokenizer.from_file(str(base / "tokenizer.json")).token_to_id("<|eos|>")} - {None})
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer((base / "tokenizer.json").read_text(), n_vocab=VOCAB,
                                                          eos_token=ends),
                                   llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_FORM))
    model = peft.PeftModel.from_pretrained(hf_model_copy(base), adapter).eval()
    mask = lgnp.allocate_token_bitmask(1, VOCAB)
    seq, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(max_tokens):
            lgnp.fill_next_token_bitmask(matcher, mask, 0)
            allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[:VOCAB].astype(bool)
            logits = model(torch.tensor([seq])).logits[0, -1].numpy()
            token = int(np.where(allowed, logits, -np.inf).argmax())
            if token in ends:
                return out, True
            assert matcher.consume_token(token)
            out.append(token)
            seq.append(token)
    return out, False


def test_json_schema_under_an_adapter_equals_constrained_peft(cluster, models, tokenizer):
    """response_format json_schema under a LoRA adapter, through the official openai client,
    colocated and through PD: the output parses and validates, and its tokens are the
    reference's (PEFT's greedy over the tokens the schema allows), ending where it ends."""
    import jsonschema
    import openai

    base, adapters = models
    prompt = prompts_of([17], seed=59)[0]
    want, ended = constrained_reference(base, adapters["sql"], prompt, RECORD, 64)
    assert ended  # the schema's object closed within the budget: the test compares a whole answer
    fmt = {"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD}}
    for url in (cluster["ref"].url, cluster.router.url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model="sql", prompt=prompt, max_tokens=64, temperature=0,
                                           extra_body={"response_format": fmt})
        text = answer.choices[0].text
        jsonschema.validate(json.loads(text), RECORD)
        assert text == tokenizer.decode(want) and answer.choices[0].finish_reason == "stop", url
        assert answer.usage.completion_tokens == len(want) + 1  # and the end token
    cluster.assert_settled()


HOLD_TOKENS = 4000  # a stream holding an adapter slot: ~4000 decode steps outlast the few requests sent meanwhile
# (470 on a 512-position engine raced them under load: the stream ended first); aborted once they are done


def wait_for(what, check, seconds: float = 60.0):
    """Poll `check()` until it is truthy (a deadline, not a sleep); its value."""
    deadline = time.monotonic() + seconds
    while not (value := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
    return value


def open_stream(url: str, body_: dict, headers: dict | None = None) -> httpclient.HTTPConnection:
    """A streamed completion whose first chunk is out (so it is running); close it to abort it."""
    target = urlparse(url)
    conn = httpclient.HTTPConnection(target.hostname, target.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(dict(body_, stream=True)),
                 {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    assert resp.readline().startswith(b"data: ")
    return conn


def test_dp_request_waits_for_a_slot_while_others_run(more_engines, models, tokenizer):
    """DP=2, one adapter slot per rank. While a stream under `sql` holds rank 0's slot, a
    run-time load of `poet` succeeds on both ranks (rank 0 knows it without room for it); a
    request for poet on rank 0 waits in its queue (not a 503), and base and sql requests sent
    after it on rank 0 run past it; once the stream is aborted (its client goes) poet loads
    into the freed slot and the waiting request answers equal to PEFT."""
    cluster, (base, adapters) = more_engines, models
    url = cluster["dp"].url

    def rank_loras() -> list[tuple[list, list]]:
        info = json.loads(http("GET", url + "/kv_transfer_info")[1])
        return [(sorted(r["loras"]), sorted(r["loras_resident"])) for r in info["ranks"]]

    assert rank_loras() == [(["sql"], ["sql"])] * 2
    prompt = prompts_of([30], seed=77)[0]
    others = list(zip(prompts_of([11, 19], seed=3), [None, "sql"]))
    wants = [tokenizer.decode(reference(base, adapters.get(name), other, tokens=8)) for other, name in others]
    want = tokenizer.decode(reference(base, adapters["poet"], prompt))
    stream = open_stream(url, body(prompt, "sql", max_tokens=HOLD_TOKENS), {"X-data-parallel-rank": "0"})
    try:
        status, raw = http("POST", url + "/v1/load_lora_adapter", {"lora_name": "poet", "lora_path": str(adapters["poet"])})
        assert status == 200, raw
        assert rank_loras() == [(["poet", "sql"], ["sql"]), (["poet", "sql"], ["poet"])]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(complete, url, body(prompt, "poet", data_parallel_rank=0))
            wait_for("poet's request queued on rank 0", lambda: cluster["dp"].stats()["num_waiting"] == 1)
            for (other, name), other_want in zip(others, wants):  # sent after it, same rank: run past it
                status, answer = complete(url, body(other, name, data_parallel_rank=0, max_tokens=8))
                assert status == 200 and text_of(answer) == other_want
            stats = cluster["dp"].stats()
            assert not waiting.done() or waiting.result() is None, waiting.result()
            assert stats["num_waiting"] == 1 and stats["num_running"] == 1  # still held
            stream.close()  # the client goes: the stream is aborted, its slot frees
            stream = None
            status, answer = waiting.result()
        assert status == 200 and text_of(answer) == want
    finally:
        if stream is not None:
            stream.close()
    assert rank_loras()[0] == (["poet", "sql"], ["poet"])  # sql evicted for it once idle
    cluster.assert_settled()
