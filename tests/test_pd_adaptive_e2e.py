"""Adaptive disaggregation end to end (router/adaptive.py): real engines on 127.0.0.1 — a
producer P and a consumer D with --max-local-prefill-tokens-per-step — behind routers in
--pd-mode adaptive (two thresholds) and strict. Greedy output equals the offline engine's
(`atomd.LLM`, in this process; for simulated engines, `runner`, a colocated simulated
engine) on every path: local prefill on D (alone, and while D streams
another request, the capped path), two legs, and strict two legs."""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from launch.process import RouterServer, http
from tests.pd_fixtures import PDCluster, metric, sse_events
from tests.server_fixtures import REPO, START_TIMEOUT_S, model_dir, server_log
from tests.sim_fixtures import default_model_profile, sim_flags

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

VOCAB = 4096  # the default model's (config.json)
CAP = ["--max-local-prefill-tokens-per-step", "32", "--max-local-prefill-ms-per-step", "1"]  # the smaller cap wins


@pytest.fixture(scope="module", params=["real", "simulated"])
def runner(request, tmp_path_factory) -> list[str]:
    """The engines' model runner: the model, or the simulated one (atomd/sim/)."""
    if request.param == "real":
        return []
    return sim_flags(default_model_profile(tmp_path_factory.mktemp("sim") / "profile.json"))


@pytest.fixture(scope="module")
def cluster(runner):
    c = PDCluster()
    try:
        # simulated: a colocated simulated engine is the reference (`ref`)
        c.start_engines(P=["--kv-role", "producer", *runner], D=["--kv-role", "consumer", *CAP, *runner],
                        **({"ref": runner} if runner else {}))
        p, d = [c["P"].url], [c["D"].url]

        def router(*flags: str) -> RouterServer:
            r = RouterServer(p, d, "--health-interval-s", "0.5", *flags, log=server_log(), cwd=REPO)
            c.routers.append(r)
            return r.wait_ready(START_TIMEOUT_S)

        c.adaptive = router("--pd-mode", "adaptive", "--local-prefill-max-tokens", "64")
        c.local = router("--pd-mode", "adaptive", "--local-prefill-max-tokens", "100000")
        c.strict = router("--pd-mode", "strict")
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def offline(cluster, runner):
    """The reference: the offline engine (`atomd.LLM`, in this process), or for simulated
    engines the colocated simulated one."""
    if runner:
        return cluster["ref"]
    import torch

    from atomd import LLM

    torch.set_num_threads(1)
    return LLM(model=str(model_dir()), max_model_len=256, num_threads=1)


def reference(offline, body: dict) -> str:
    from atomd import LLM, SamplingParams

    if not isinstance(offline, LLM):
        return complete(offline.url, dict(body, stream=False))
    params = SamplingParams(max_tokens=body["max_tokens"], temperature=0.0, ignore_eos=True)
    return offline.generate([{"prompt_token_ids": body["prompt"]}], params)[0].outputs[0].text


def token_prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, VOCAB, n)]


def complete(url: str, body: dict):
    status, raw = http("POST", url + "/v1/completions", body)
    assert status == 200, raw
    if body.get("stream"):
        return "".join(ch["text"] for e in sse_events(raw) for ch in e.get("choices", []))
    return json.loads(raw)["choices"][0]["text"]


def body(seed: int, n: int, **kw) -> dict:
    return {"prompt": token_prompt(seed, n), "max_tokens": 10, "temperature": 0, "ignore_eos": True, **kw}


def decision(router, decision: str, reason: str) -> float:
    return metric(router, "atomd_router:decision_total", decision=decision, reason=reason)


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_every_path_equals_the_offline_engine(cluster, offline, stream):
    short, long = body(1, 20, stream=stream), body(2, 200, stream=stream)
    want_short, want_long = reference(offline, short), reference(offline, long)
    assert want_short and want_long
    before = {k: decision(cluster.adaptive, *k) for k in (("local_prefill", "short_prompt"), ("pd", "long_prompt"))}
    assert complete(cluster.adaptive.url, short) == want_short  # local prefill on D
    assert complete(cluster.adaptive.url, long) == want_long  # two legs
    assert decision(cluster.adaptive, "local_prefill", "short_prompt") == before["local_prefill", "short_prompt"] + 1
    assert decision(cluster.adaptive, "pd", "long_prompt") == before["pd", "long_prompt"] + 1
    strict_before = decision(cluster.strict, "pd", "strict")
    assert complete(cluster.strict.url, short) == want_short
    assert decision(cluster.strict, "pd", "strict") == strict_before + 1


def test_a_capped_local_prefill_beside_a_running_stream_keeps_both_outputs_exact(cluster, offline):
    running, long = body(3, 16, max_tokens=40, stream=True), body(4, 220)
    want_running, want_long = reference(offline, running), reference(offline, long)
    got = {}
    t = threading.Thread(target=lambda: got.__setitem__("running", complete(cluster.local.url, running)))
    t.start()
    got["long"] = complete(cluster.local.url, long)  # prefilled on D in 32-token chunks while it streams
    t.join(120)
    assert got == {"running": want_running, "long": want_long}
    assert decision(cluster.local, "local_prefill", "short_prompt") >= 2
