"""LoRA serving against PEFT, the reference: tiny random adapters written by `peft` on tiny
random Llama and Qwen2 checkpoints; every request's greedy ids equal transformers + PeftModel
(and the merged model) for 48 tokens, in one batch that mixes three adapters and the base model;
the prefix cache keeps adapters apart; the registry never evicts an adapter in use."""
from __future__ import annotations

import pathlib
import re
import shutil

import numpy as np
import peft
import pytest
import torch

from atomd.engine.lora_registry import MAX_KNOWN, LoraLoadFailed, LoraNotLoaded, LoraRegistry
from atomd.llm import LLM
from atomd.model.lora import LoraStep
from contracts.block_hash import block_hashes
from contracts.sampling import SamplingParams
from tests.test_model_hf import hf_model, make_checkpoint, prompts_of

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]
TOKENS = 48
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (name, r, alpha, rsLoRA, targets): every target kind, two ranks, both scalings
ADAPTERS = [("sql", 8, 16, False, ALL), ("poet", 4, 8, True, ALL), ("attn", 8, 32, False, ["q_proj", "v_proj", "o_proj"])]


def make_adapter(base: pathlib.Path, out: pathlib.Path, r: int, alpha: int, rslora: bool, targets: list[str],
                 seed: int) -> pathlib.Path:
    """A random PEFT LoRA adapter (B random too: PEFT's default B = 0 would be the base model)."""
    torch.manual_seed(seed)
    model = peft.get_peft_model(hf_model_copy(base), peft.LoraConfig(
        r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, init_lora_weights=False))
    model.save_pretrained(out)
    return out


def hf_model_copy(base: pathlib.Path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()


def hf_greedy_with(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids: list[int] = []
    with torch.inference_mode():
        seq = list(prompt)
        for _ in range(n):  # no cache: PeftModel and the merged model take the same path
            ids.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            seq.append(ids[-1])
    return ids


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(f"lora_{kind}")
    base = make_checkpoint(root / "base", kind, seed=5)
    adapters = {name: make_adapter(base, root / name, r, a, rs, t, seed=i + 11)
                for i, (name, r, a, rs, t) in enumerate(ADAPTERS)}
    return base, adapters


def reference(base: pathlib.Path, adapter: pathlib.Path | None, prompt: list[int], merged: bool = False,
              tokens: int = TOKENS) -> list[int]:
    if adapter is None:
        return hf_greedy_with(hf_model(base), prompt, tokens)
    model = peft.PeftModel.from_pretrained(hf_model_copy(base), adapter).eval()
    if merged:
        model = model.merge_and_unload()
    return hf_greedy_with(model, prompt, tokens)


def test_mixed_batch_equals_peft(setup, monkeypatch):
    base, adapters = setup
    llm = LLM(str(base), enable_lora=True, lora_modules=[f"{n}={p}" for n, p in adapters.items()],
              max_loras=3, max_lora_rank=8, num_threads=1, max_num_batched_tokens=64)
    names = [None, "sql", "poet", "attn", "sql", None]
    # one block, many blocks (chunked over steps by the 64-token budget), one token: tiles and groups
    prompts = prompts_of([5, 16, 37, 1, 70, 23], seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True), lora_name=names)
    got = [o.outputs[0].token_ids for o in outs]
    wants = [reference(base, adapters.get(name), prompt) for prompt, name in zip(prompts, names)]
    for prompt, name, ids, want in zip(prompts, names, got, wants):
        assert ids == want, (name, len(prompt))
    # the torch forms (grouped: more than STACKED_MAX adapters; bf16) on the same batch (float32 runs the SGMV kernel)
    for mode in ("grouped", "stacked"):
        monkeypatch.setattr(LoraStep, "mode", mode)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True), lora_name=names)
        assert [o.outputs[0].token_ids for o in outs] == wants, mode
    # every adapter changes the output (so equality above says something), and merging gives the same
    for i in (1, 2, 3):
        assert got[i] != reference(base, None, prompts[i])
    assert got[2] == reference(base, adapters["poet"], prompts[2], merged=True)
    assert llm.engine.loras.in_use == {}  # every request gave its adapter back


def test_prefix_cache_keeps_adapters_apart(setup):
    base, adapters = setup
    llm = LLM(str(base), enable_lora=True, lora_modules=[f"sql={adapters['sql']}", f"attn={adapters['attn']}"],
              max_loras=2, max_lora_rank=8, num_threads=1)
    prompt = prompts_of([40], seed=9)[0]
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    bm = llm.engine.scheduler.block_manager
    runs = {}
    for name in ["sql", "attn", None, "sql"]:
        out = llm.generate([{"prompt_token_ids": prompt}], sp, lora_name=name)[0]
        runs.setdefault(name, []).append(out)
    # a second run under the same adapter hits its own chain; the others computed theirs
    assert runs["sql"][1].num_cached_tokens == 32 and runs["attn"][0].num_cached_tokens == 0
    assert runs[None][0].num_cached_tokens == 0
    assert runs["sql"][1].outputs[0].token_ids == reference(base, adapters["sql"], prompt)[:4]
    chains = {name: block_hashes(prompt, 16, lora_name=name) for name in ["sql", "attn", None]}
    assert len({h for c in chains.values() for h in c}) == 6  # three chains of 2, no block shared
    for chain in chains.values():
        assert all(h in bm.pool.index for h in chain)


def test_registry_evicts_lru_never_one_in_use_and_requests_wait():
    loaded, broken = [], set()

    def load(name, path):
        if path in broken:
            raise ValueError(f"LoRA adapter {name!r} at {path}: gone")
        loaded.append(name)
        return name

    reg = LoraRegistry(2, load)
    reg.add("a", "pa")
    reg.add("b", "pb")
    assert reg.admit("r1", "a")  # a pinned, b least recently used and free
    answer = reg.start_add("c", "pc")  # read on the background thread
    reg.wait_for_loads()
    reg.finish_loads()
    assert answer.result() == {"name": "c"} and list(reg.resident) == ["a", "c"]  # b evicted
    assert reg.admit("r2", "c")
    assert reg.admit("r3", "b") is False and not reg.loading  # a and c held: b waits, nothing evicted
    reg.release("r2")  # c free: r3's next try evicts it and loads b into its slot
    assert reg.admit("r3", "b") is False and list(reg.loading) == ["b"] and list(reg.resident) == ["a"]
    assert reg.admit("r4", "b") is False  # a second request waits for the same load
    reg.wait_for_loads()
    reg.finish_loads()
    assert reg.admit("r3", "b") and reg.admit("r4", "b") and list(reg.resident) == ["a", "b"]
    assert loaded.count("b") == 2 and reg.request_loads == 1
    assert reg.admit("r3", "b")  # a pinned request is admitted again (a preempted choice), no second pin
    assert reg.in_use == {"a": 1, "b": 2}
    reg.remove("a")  # in use: the name goes now, the weights when the request ends
    with pytest.raises(LoraNotLoaded):
        reg.admit("r5", "a")
    assert "a" in reg.resident
    reg.release("r1")
    assert "a" not in reg.resident
    # a failed load refuses the requests that waited for it, once; a later request tries again
    reg.release("r3"), reg.release("r4")
    broken.add("pc")  # c's file went bad since
    assert reg.admit("r6", "c") is False  # c was evicted: its load takes the free slot
    reg.wait_for_loads()
    reg.finish_loads()
    broken.discard("pc")
    with pytest.raises(LoraLoadFailed, match="'c' at pc: gone"):
        reg.admit("r6", "c")
    assert reg.admit("r7", "c") is False and "c" in reg.loading and reg.failed == {}
    reg.release("r7")  # it left while waiting: no pin, no wait entry left behind
    assert reg.pins == {} and reg.in_use == {} and all(not load.waiters for load in reg.loading.values())
    for i in range(MAX_KNOWN - len(reg.paths)):  # names are bounded (the admin API adds them)
        reg.paths[f"n{i}"] = "p"
    with pytest.raises(ValueError, match=f"{MAX_KNOWN} LoRA adapters are loaded already"):
        reg.add("one-more", "p")


def test_requests_wait_for_a_slot_and_a_load_without_stopping_others(setup):
    """--max-loras 1: a request for an evicted adapter while the only slot is held waits in the
    queue; requests behind it (the base model, the resident adapter) run meanwhile (no
    head-of-line blocking). When the slot frees, its adapter is read on the background thread
    (held here on an Event): the engine keeps producing other requests' tokens meanwhile; then
    it runs equal to PEFT. A load that fails refuses its waiter with the error; no block leaks."""
    import threading

    from contracts.errors import ErrorCode

    base, adapters = setup
    llm = LLM(str(base), enable_lora=True, lora_modules=[f"sql={adapters['sql']}", f"poet={adapters['poet']}"],
              max_loras=1, max_lora_rank=8, num_threads=1)
    engine, loras = llm.engine, llm.engine.loras
    assert list(loras.resident) == ["poet"]  # sql was evicted for poet at start-up
    release, real_load, broken = threading.Event(), loras._load, set()

    def held_load(name, path):  # the test's delay hook: the read waits for `release`
        assert release.wait(60)
        if name in broken:
            raise ValueError(f"LoRA adapter {name!r} at {path}: no such file")
        return real_load(name, path)

    loras._load = held_load
    sp = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = dict(zip("ABCDE", prompts_of([9, 14, 6, 11, 7], seed=17)))
    tokens: dict[str, list[int]] = {k: [] for k in [*prompts, "F"]}
    done: dict[str, object] = {}

    def step(n=1):
        for _ in range(n):
            for out in engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    done[out.request_id] = out

    engine.add_request("A", prompts["A"], sp, lora_name="poet")
    step()  # A holds the only slot
    engine.add_request("B", prompts["B"], sp, lora_name="sql")  # waits for it
    engine.add_request("C", prompts["C"], short)  # behind B: the base model
    engine.add_request("D", prompts["D"], short, lora_name="poet")  # behind B: the resident adapter
    for _ in range(200):
        step()
        if "C" in done and "D" in done:
            break
    assert len(tokens["C"]) == len(tokens["D"]) == 8 and tokens["B"] == [] and "A" not in done
    assert engine.stats()["num_waiting"] == 1 and not loras.loading  # B waits; nothing evicted under A
    for _ in range(200):  # A ends: B's next admission evicts poet and starts reading sql (held)
        step()
        if loras.loading:
            break
    assert "A" in done and list(loras.loading) == ["sql"] and tokens["B"] == []
    engine.add_request("E", prompts["E"], short)
    step(40)  # the read is held: E runs to its end meanwhile
    assert len(tokens["E"]) == 8 and "E" in done and tokens["B"] == [] and "sql" in loras.loading
    release.set()
    loras.wait_for_loads()  # the read lands between two steps (no timing: the test waits for it)
    for _ in range(400):
        step()
        if "B" in done:
            break
    assert "B" in done and done["B"].error is None, (done.get("B"), loras.loading)
    assert list(loras.resident) == ["sql"] and loras.request_loads == 1
    for name, key in [("poet", "A"), ("sql", "B"), (None, "C"), ("poet", "D"), (None, "E")]:
        want = reference(base, adapters.get(name), prompts[key], tokens=len(tokens[key]))
        assert tokens[key] == want, key
    broken.add("poet")  # poet's file went bad since it was evicted
    engine.add_request("F", prompts["A"], short, lora_name="poet")
    for _ in range(400):
        step()
        loras.wait_for_loads()
        if "F" in done:
            break
    assert done["F"].error_code is ErrorCode.LORA_LOAD_FAILED and "'poet'" in done["F"].error and tokens["F"] == []
    assert loras.pins == {} and loras.in_use == {}
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks


def test_bad_adapters_are_refused_by_name(setup, tmp_path):
    base, adapters = setup
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=4, num_threads=1)
    res = llm.load_lora_adapter("sql", str(adapters["sql"]))  # rank 8 > 4
    assert res["status"] == 400 and "rank 8 is above --max-lora-rank 4" in res["error"]
    res = llm.load_lora_adapter("none", str(tmp_path))
    assert res["status"] == 400 and "not a PEFT adapter directory" in res["error"]
    assert llm.load_lora_adapter("poet", str(adapters["poet"])) == {"name": "poet"}
    with pytest.raises(LoraNotLoaded, match="'sql' is not loaded"):
        llm.generate([{"prompt_token_ids": [3, 4, 5]}], lora_name="sql")
    assert llm.engine.unload_lora_adapter("poet") == {"name": "poet"}
    assert llm.engine.unload_lora_adapter("poet")["status"] == 404
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.scheduler.block_manager.num_total_blocks


@pytest.mark.parametrize("edit,message", [
    ("unknown", r"tensor '.*\.mlp\.fc_proj\.lora_A\.weight' is not a LoRA weight of q_proj"),
    ("layer", "the model has 2 layers"),
    ("missing", "has lora_B missing"),
    ("shape", r"lora_A \(\d+, 5\) / lora_B .* do not fit rank"),
])
def test_adapter_tensors_that_do_not_fit_are_refused_naming_them(setup, tmp_path, edit, message):
    """lora.read_pairs / checked_pair (shared with DeepSeek's loader) on a copy of a PEFT adapter
    with one tensor renamed, moved past the last layer, dropped or cut."""
    from safetensors.torch import load_file, save_file

    from atomd.model.lora import WEIGHTS_FILE

    base, adapters = setup
    bad = tmp_path / "bad"
    shutil.copytree(adapters["poet"], bad)
    tensors = load_file(bad / WEIGHTS_FILE)
    key = next(k for k in sorted(tensors) if "layers.0." in k and ".lora_A." in k)
    if edit == "unknown":
        tensors[re.sub(r"(self_attn|mlp)\.\w+\.lora_A", "mlp.fc_proj.lora_A", key)] = tensors.pop(key)
    elif edit == "layer":
        tensors[key.replace("layers.0.", "layers.7.")] = tensors.pop(key)
    elif edit == "missing":
        tensors.pop(key.replace(".lora_A.", ".lora_B."))
    else:
        tensors[key] = tensors[key][:, :5].contiguous()
    save_file(tensors, bad / WEIGHTS_FILE)
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=64, num_threads=1)
    res = llm.load_lora_adapter("bad", str(bad))
    assert res["status"] == 400 and re.search(message, res["error"]), res


def hf_prompt_logprobs(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    return logp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]


def test_bf16_adapter_rows_track_peft_fp32(setup):
    """bf16: prompt logprobs under an adapter are as close to PEFT's float32 ones as the base
    model's bf16 logprobs are to its float32 ones (bf16 rounding, not a wrong delta), and far
    from the base model's."""
    base, adapters = setup
    llm = LLM(str(base), dtype="bfloat16", enable_lora=True, lora_modules=[f"sql={adapters['sql']}"],
              max_loras=1, max_lora_rank=8, num_threads=1)
    prompt = prompts_of([40], seed=21)[0]
    sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    ours = {name: torch.tensor([e.logprob for e in out.prompt_logprobs[1:]]) for name, out in zip(
        ["sql", None], [llm.generate([{"prompt_token_ids": prompt}], sp, lora_name=n)[0] for n in ["sql", None]])}
    want_base = hf_prompt_logprobs(hf_model(base), prompt)
    want_sql = hf_prompt_logprobs(peft.PeftModel.from_pretrained(hf_model_copy(base), adapters["sql"]).eval(), prompt)
    base_err = (ours[None] - want_base).abs().max().item()
    sql_err = (ours["sql"] - want_sql).abs().max().item()
    assert sql_err <= 2 * base_err + 0.05, (sql_err, base_err)
    assert (want_sql - want_base).abs().max().item() > 10 * (sql_err + 0.05)


@pytest.mark.parametrize("kind,targets", [
    ("qwen3", ALL), ("gemma3", ALL), ("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
    ("qwen3_moe", ["q_proj", "k_proj", "v_proj", "o_proj"])])
def test_every_family_equals_peft(tmp_path, kind, targets):
    """The deltas are a property of the shared layers: each family, one adapter row beside a
    base row (phi3: its fused checkpoint names; an MoE: attention targets)."""
    overrides = {"mlp_only_layers": [1]} if kind == "qwen3_moe" else {}
    base = make_checkpoint(tmp_path / "base", kind, seed=7, **overrides)
    adapter = make_adapter(base, tmp_path / "a", 8, 16, False, targets, seed=3)
    llm = LLM(str(base), enable_lora=True, lora_modules=[f"a={adapter}"], max_loras=1, max_lora_rank=8,
              num_threads=1)
    prompts = prompts_of([19, 9], seed=13)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), lora_name=["a", None])
    assert outs[0].outputs[0].token_ids == reference(base, adapter, prompts[0], tokens=16)
    assert outs[1].outputs[0].token_ids == reference(base, None, prompts[1], tokens=16)


def test_speculative_decoding_under_adapters_equals_peft(setup):
    """ngram drafts verified in rows of their sequence's adapter: greedy output unchanged."""
    base, adapters = setup
    llm = LLM(str(base), enable_lora=True, lora_modules=[f"sql={adapters['sql']}"], max_loras=1, max_lora_rank=8,
              num_threads=1, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompt = prompts_of([12], seed=2)[0] * 3  # repeats: the proposer finds drafts
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2, SamplingParams(max_tokens=TOKENS, temperature=0,
                                                                           ignore_eos=True), lora_name=["sql", None])
    assert outs[0].outputs[0].token_ids == reference(base, adapters["sql"], prompt)
    assert outs[1].outputs[0].token_ids == reference(base, None, prompt)
    assert llm.engine.scheduler.spec_stats.num_draft_tokens > 0


def test_router_places_by_adapter_and_kv_aware_scores_the_adapters_chain():
    """with_adapter keeps the workers serving the request's adapter; kv_aware then hashes the
    prompt as the engines do under it (a worker holding the base model's blocks of the same
    prompt scores no hit)."""
    from router.pd import with_adapter
    from router.policies import KVAware, RouteRequest
    from tests.test_router_policies import FakeIndex, workers

    ws = workers(3)
    ws[0].loras, ws[1].loras, ws[2].loras = frozenset({"sql"}), frozenset({"sql", "poet"}), None
    for w in ws:
        w.loras_resident = frozenset()  # what /kv_transfer_info says is in memory: nothing here
    tokens = list(range(1, 42))
    index = FakeIndex()
    index.hold(ws[0].url, 0, block_hashes(tokens, 4)[:9])  # the base model's chain
    index.hold(ws[1].url, 0, block_hashes(tokens, 4, lora_name="sql")[:5])
    index.hold(ws[2].url, 0, block_hashes(tokens, 4, lora_name="sql"))  # serves no adapter: never chosen
    p = KVAware(kv_index=index)
    p.role = "decode"
    route = RouteRequest({"prompt": tokens, "model": "sql"}, {})
    candidates = with_adapter(ws, route)
    assert candidates == ws[:2] and route.lora == "sql"
    assert p.choose(candidates, route) is ws[1] and route.expected_hit == {"decode": 20}
    assert with_adapter(ws, RouteRequest({"prompt": tokens, "model": "poet"}, {})) == [ws[1]]
    assert with_adapter(ws, RouteRequest({"prompt": tokens, "model": "nope"}, {})) == ws  # the engines' 404
    assert with_adapter(ws, RouteRequest({"prompt": tokens}, {})) == ws


@pytest.mark.parametrize("mode", ["stacked", "grouped", "sgmv"])
def test_both_step_forms_add_each_rows_own_delta(monkeypatch, mode):
    """A step mixing two adapters and base rows, whole and in tiles: every row gets
    x @ A_t @ B_t of its own adapter (computed row by row here), base rows nothing."""
    from atomd.model.lora import LoraAdapter, LoraLinear, LoraStep

    monkeypatch.setattr(LoraStep, "mode", mode)
    g = torch.Generator().manual_seed(0)

    def adapter(name: str) -> LoraAdapter:
        return LoraAdapter(name, "p", 4, [{"qkv": LoraLinear(torch.randn(8, 4, generator=g), torch.randn(4, 6, generator=g))}])

    a, b = adapter("a"), adapter("b")
    seqs, counts = [a, None, b, a, b], np.array([2, 1, 3, 1, 2])
    x = torch.randn(9, 8, generator=g)
    owner = [seqs[i] for i in np.repeat(np.arange(5), counts)]
    want = torch.stack([torch.zeros(6) if o is None else x[r] @ o.layers[0]["qkv"].a_t @ o.layers[0]["qkv"].b_t
                        for r, o in enumerate(owner)])
    step = LoraStep(seqs, counts)
    for lo, hi in [(0, 9), (0, 4), (4, 9), (2, 3)]:
        out = torch.zeros(hi - lo, 6)
        rows = step.tile(lo, hi)
        if rows is not None:
            rows.layer(0).add("qkv", x[lo:hi], out)
        torch.testing.assert_close(out, want[lo:hi])
    assert step.tile(2, 3) is None  # the base row alone
