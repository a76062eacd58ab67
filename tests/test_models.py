"""The model registry's families against Hugging Face transformers, on the tiny random
checkpoints of tests/families.py: Qwen3 (q/k norm; tied and untied head), Qwen3-MoE (dense and
sparse layers mixed through mlp_only_layers / decoder_sparse_step; norm_topk_prob both ways),
Mixtral, Phi-3 and DeepSeek V2 / V3 (MLA) share the prompt-logits and 48-token greedy checks;
then what is particular to the MoE block, against a per-token reference on chosen routings.
(Llama / Qwen2: tests/test_model_hf.py; DeepSeek's latent cache: tests/test_deepseek.py.)"""
from __future__ import annotations

import json
import logging
import math
import pathlib
import shutil

import pytest
import torch
import torch.nn.functional as F
import transformers

from atomd.llm import LLM
from atomd.model import huge_pages, moe as moe_mod
from atomd.model.loader import load_model
from atomd.model.moe import MoeWeights, moe
from contracts.sampling import SamplingParams
from tests.test_bf16 import _hf_greedy, assert_greedy_follows_hf_bf16, first_difference
from tests.families import DEEPSEEK, FAMILIES, write_families
from tests.test_model_hf import (BLOCK, MIXED, _prompt_logits, assert_equals_hf, engine_greedy, hf_model,
                                 make_checkpoint, prompts_of)

pytestmark = pytest.mark.unit
torch.set_num_threads(1)

NON_MLA = [name for name in FAMILIES if name not in DEEPSEEK]
GREEDY48 = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, pathlib.Path]:
    return write_families(tmp_path_factory)


@pytest.mark.parametrize("name", NON_MLA)  # DeepSeek's layers: tests/test_deepseek.py
def test_layers_are_what_the_config_says(name, checkpoints):
    model = LLM(str(checkpoints[name]), num_threads=1, max_model_len=128).engine.model
    assert tuple(i for i, w in enumerate(model.layers) if w.moe is not None) == FAMILIES[name].sparse
    assert all((w.gate_up is None) == (w.moe is not None) for w in model.layers)
    assert all((w.q_norm is not None) == name.startswith("qwen3") for w in model.layers)
    for w in model.layers:
        if w.moe is not None:
            assert w.moe.gate_up.shape[0] == 8 and w.moe.top_k == 2


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("chunk", [None, BLOCK])
def test_prompt_logits_match_hf(name, chunk, checkpoints):
    path = checkpoints[name]
    args = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = LLM(str(path), num_threads=1, max_model_len=256, **args)
    prompt = prompts_of([4 * BLOCK + 5], seed=3)[0]
    got = _prompt_logits(llm, prompt)
    with torch.inference_mode():
        want = hf_model(path)(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


# DeepSeek's absorbed MLA decode on the native kernel (auto), and on torch SDPA for one case
@pytest.mark.parametrize("name,backend", [*((name, "auto") for name in FAMILIES), ("deepseek-v2-lite", "torch")])
def test_greedy_48_tokens_equal_hf_mixed_lengths_chunked_and_prefix_hits(name, backend, checkpoints):
    path = checkpoints[name]
    prompts = prompts_of(MIXED, seed=4)
    llm = LLM(str(path), num_threads=1, max_model_len=256, attention_backend=backend)
    assert_equals_hf(path, prompts, engine_greedy(llm, prompts, GREEDY48), n=48)
    alone = prompts[2:3]  # batch-1 decode: the fused layer, or what the family falls back to
    assert_equals_hf(path, alone, engine_greedy(llm, alone, GREEDY48), n=48)
    # a shared 3-block prefix: the second run reads it (k / v rows, or latent rows) from the cache
    shared = prompts_of([3 * BLOCK], seed=5)[0]
    prompts = [shared + tail for tail in prompts_of([5, 1], seed=6)]
    chunked = LLM(str(path), num_threads=1, max_model_len=256, max_num_batched_tokens=BLOCK,
                  attention_backend=backend)
    first = engine_greedy(chunked, prompts, GREEDY48)
    hits = chunked.engine.stats()["prefix_cache_hits"]
    assert engine_greedy(chunked, prompts, GREEDY48) == first
    assert chunked.engine.stats()["prefix_cache_hits"] - hits >= 2 * 3 * BLOCK
    assert_equals_hf(path, prompts, first, n=48)


@pytest.mark.parametrize("name,quantization,fused,said", [
    ("qwen3_moe-step2", "int8", False, "has no MoE block with quantized experts"),
    ("qwen3_moe-step2", None, True, None),  # the router, the routing and the k experts in the fused layer
    ("qwen3-tied", None, True, None)])  # the q/k norm: in the fused head
def test_what_batch1_decode_cannot_fuse_is_said_once(name, quantization, fused, said, checkpoints, caplog,
                                                     monkeypatch):
    """Also: with every weight big enough for huge pages (MIN_BYTES 0 here), batch-1 decode's
    rows (and float MoE experts) are moved onto 2 MiB-aligned memory and held once (a tied head
    is the embedding)."""
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)
    with caplog.at_level(logging.INFO, logger="atomd.model.decoder"):
        model = LLM(str(checkpoints[name]), num_threads=1, max_model_len=128, quantization=quantization).engine.model
    if model.layers[0].rows is None:  # no GEMV kernel here: no batch-1 path to fuse at all
        return
    from atomd.model import layer_ops
    if fused and "moe" in name and not layer_ops.has_gemv(model.dtype):  # an AVX2 build: the dense layer only
        fused, said = False, "has no MoE block whose experts have no GEMV kernel here"
    lines = [r.getMessage() for r in caplog.records if "batch-1 decode" in r.getMessage()]
    assert (model.decode_layer is not None) == fused
    if said is None:
        assert lines == []
    else:
        assert len(lines) == 1 and model.config.architecture in lines[0] and said in lines[0], lines
    if quantization is not None:
        return
    assert all(t.data_ptr() % huge_pages.HUGE_PAGE == 0 for w in model.layers for t in w.rows if t is not None)
    assert all(t.data_ptr() % huge_pages.HUGE_PAGE == 0 for w in model.layers if w.moe is not None
               for t in (w.moe.gate_up, w.moe.down))
    assert model.lm_head_rows.data_ptr() % huge_pages.HUGE_PAGE == 0
    if model.config.tie_word_embeddings:
        assert model.embed is model.lm_head_rows


# ---------------------------------------------------------------- the MoE block


def per_token_reference(h: torch.Tensor, w: MoeWeights) -> torch.Tensor:
    """Each token on its own, in float64: softmax, top-k, optional renormalisation, the
    weighted sum of its experts' SwiGLU outputs."""
    out = torch.zeros(h.shape, dtype=torch.float64)
    for t in range(h.shape[0]):
        x = h[t].double()
        probs = torch.softmax(w.router.double() @ x, dim=-1)
        top, ids = probs.topk(w.top_k)
        if w.norm_topk_prob:
            top = top / top.sum()
        for p, e in zip(top.tolist(), ids.tolist()):
            gate, up = (w.gate_up[e].double() @ x).chunk(2)
            out[t] += p * (w.down[e].double() @ (F.silu(gate) * up))
    return out


def random_moe(experts: int = 8, hidden: int = 32, inter: int = 24, top_k: int = 2, norm: bool = True,
               dtype: torch.dtype = torch.float32, seed: int = 0) -> MoeWeights:
    g = torch.Generator().manual_seed(seed)
    return MoeWeights(router=torch.randn(experts, hidden, generator=g).to(dtype),
                      gate_up=(torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).to(dtype),
                      down=(torch.randn(experts, hidden, inter, generator=g) * 0.2).to(dtype),
                      top_k=top_k, norm_topk_prob=norm)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("tokens", [1, 3, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_block_equals_the_per_token_reference(norm, tokens, dtype):
    w = random_moe(norm=norm, dtype=dtype, seed=tokens)
    h = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = moe(h, w)
    assert got.dtype == dtype and got.shape == h.shape
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), per_token_reference(h, w), atol=tol, rtol=tol)


def test_moe_block_with_idle_experts_and_all_tokens_on_one():
    """A router that sends every token to experts 5 then 2 (six experts get nothing), and one
    where the choices spread unevenly: both equal the reference."""
    w = random_moe(seed=3)
    h = torch.randn(20, 32, generator=torch.Generator().manual_seed(2))
    h[:, 0] = h[:, 0].abs() + 1
    w.router.zero_()
    w.router[5, 0], w.router[2, 0] = 4.0, 2.0  # every token's largest logit, and its second
    _, ids = moe_mod.route(h, w)
    assert (ids[:, 0] == 5).all() and (ids[:, 1] == 2).all()
    torch.testing.assert_close(moe(h, w).double(), per_token_reference(h, w), atol=1e-5, rtol=1e-5)
    w.router.copy_(torch.randn(8, 32, generator=torch.Generator().manual_seed(9)))
    w.router[:4, 0] = -100.0  # h[:, 0] >= 1: experts 0-3 never chosen
    _, ids = moe_mod.route(h, w)
    assert ids.min() >= 4
    torch.testing.assert_close(moe(h, w).double(), per_token_reference(h, w), atol=1e-5, rtol=1e-5)


def test_batch1_reads_only_the_chosen_experts(monkeypatch):
    """One token: the experts run are exactly its top-k (the others' weights are not read):
    handed to the one-call C path (layer_ops.moe_experts) where it is built, else run one by one."""
    w = random_moe(seed=5)
    h = torch.randn(1, 32, generator=torch.Generator().manual_seed(6))
    ran = []
    real, real_c = moe_mod.expert, moe_mod.layer_ops.moe_experts
    monkeypatch.setattr(moe_mod, "expert", lambda x, w_, e: ran.append(e) or real(x, w_, e))
    monkeypatch.setattr(moe_mod.layer_ops, "moe_experts",
                        lambda x, gu, dn, ids, *rest: ran.extend(ids.tolist()) or real_c(x, gu, dn, ids, *rest))
    moe(h, w)
    assert sorted(ran) == sorted(moe_mod.route(h, w)[1][0].tolist())


# Qwen3-MoE's scales rounded to bf16, two threads: a whole expert each; Mixtral's float32 scales; four
# threads over top-2: each expert's rows shared by the threads
@pytest.mark.parametrize("name,dtype,threads", [("qwen3_moe-mlp_only", "bfloat16", 2), ("mixtral", "bfloat16", 1),
                                                ("qwen3_moe-mlp_only", "float32", 4)])
def test_fused_batch1_moe_layer_follows_the_per_op_path(name, dtype, threads, checkpoints):
    """Batch-1 decode with the MoE blocks inside the fused C layer (router GEMV, softmax top-k,
    the k experts, their sum) against the per-op path (moe.route in torch, then the experts'
    C call) on the same engine: the same greedy ids, logprobs within float32 rounding (the
    router's sums and the softmax's exp in another order), and the same expert load counters.
    Equality with HF through the fused path: test_greedy_48_tokens_equal_hf_... (its batch-1 run)."""
    from atomd.model import layer_ops

    llm = LLM(str(checkpoints[name]), num_threads=threads, dtype=dtype, max_model_len=128, enable_prefix_caching=False)
    model = llm.engine.model
    if not layer_ops.has_gemv(model.dtype):  # no experts' GEMV kernel for this dtype here (AVX2: dense layers only)
        assert model.decode_layer is None
        return
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)

    def run() -> tuple[list, list]:
        counts = torch.tensor(llm.engine.stats()["expert_tokens"])[:, 1]
        outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0]
                for p in prompts_of([3, 40], seed=11)]
        return outs, torch.tensor(llm.engine.stats()["expert_tokens"])[:, 1] - counts
    calls, run_layers = [], model.decode_layer.run_layers
    model.decode_layer.run_layers = lambda *a, **k: calls.append(1) or run_layers(*a, **k)
    fused, fused_counts = run()
    assert len(calls) == 2 * 11  # every decode step after the prompt's
    model.decode_layer = None
    per_op, per_op_counts = run()
    assert [o.token_ids for o in fused] == [o.token_ids for o in per_op]
    for a, b in zip(fused, per_op):
        for x, y in zip(a.logprobs, b.logprobs):
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            torch.testing.assert_close([v for _, v in x.top], [v for _, v in y.top], atol=1e-4, rtol=0)
    assert torch.equal(fused_counts, per_op_counts) and int(fused_counts.sum()) > 0


# ---------------------------------------------------------------- other engine paths


@pytest.mark.parametrize("name", ["qwen3-tied", "qwen3_moe-mlp_only", "mixtral"])
def test_greedy_equals_hf_through_preemption_and_ngram_speculation(name, checkpoints):
    path = checkpoints[name]
    # 6 sequences of 2 blocks each growing past a block boundary, 9 blocks in the pool
    llm = LLM(str(path), num_threads=1, max_model_len=256, num_kvcache_blocks=9)
    prompts = prompts_of([BLOCK + 10] * 6, seed=7)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert_equals_hf(path, prompts, engine_greedy(llm, prompts, params), n=12)
    assert llm.engine.stats()["num_preemptions"] > 0
    # a prompt that repeats itself: the n-gram drafts get accepted, verified several rows a sequence
    spec = LLM(str(path), num_threads=1, max_model_len=256,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    prompts = [prompts_of([12], seed=8)[0] * 4, prompts_of([7], seed=9)[0]]
    assert_equals_hf(path, prompts, engine_greedy(spec, prompts, GREEDY48), n=48)
    assert spec.engine.stats()["spec_decode_num_accepted_tokens"] > 0


def hf_both(path: pathlib.Path) -> dict[torch.dtype, torch.nn.Module]:
    return {dtype: transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
            for dtype in (torch.float32, torch.bfloat16)}


@pytest.mark.parametrize("name", ["qwen3-untied", "qwen3_moe-mlp_only", "mixtral", "phi3"])
def test_bf16_prompt_logits_as_close_to_hf_bf16_as_hf_fp32_is(name, checkpoints):
    """bfloat16 prompt logits off HF bf16 by at most twice what HF's bf16 is off its fp32."""
    path, hf = checkpoints[name], hf_both(checkpoints[name])
    llm = LLM(str(path), num_threads=1, max_model_len=256, dtype="bfloat16")
    prompt = prompts_of([4 * BLOCK + 5], seed=3)[0]
    got = _prompt_logits(llm, prompt)
    assert got.dtype == torch.bfloat16
    with torch.inference_mode():
        hf32, hf16 = (hf[dtype](torch.tensor([prompt])).logits[0].float() for dtype in hf)
    diff, own = (got.float() - hf16).abs(), (hf16 - hf32).abs()
    assert diff.max() <= 2 * own.max() and diff.mean() <= 2 * own.mean(), (diff.max(), own.max(), diff.mean(),
                                                                            own.mean())


def test_bf16_greedy_follows_hf_bf16_qwen3(checkpoints, monkeypatch):
    """tests/test_bf16.py's tie rule on Qwen3 dense (the MoE families: the next test); its
    weights moved onto huge pages as a full-size model's are (MIN_BYTES 0: every one)."""
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 0)
    path = checkpoints["qwen3-untied"]
    llm = LLM(str(path), num_threads=1, max_model_len=256, dtype="bfloat16")
    # HF's own bf16 leaves its fp32 after ~20 tokens on this random model: compared from 8 on
    prompts = prompts_of([BLOCK + 5, 40], seed=11)
    assert_greedy_follows_hf_bf16(hf_both(path), prompts, engine_greedy(llm, prompts, GREEDY48), n=48,
                                  min_compared=8)


def engine_greedy_and_routing(llm: LLM, prompt: list[int], layers: int, monkeypatch) -> tuple[list[int], list]:
    """The engine's 48 greedy ids for `prompt` and the experts it routed every position to as it
    ran them (prefill, then each decode step): per sparse layer, [positions, k]. Batch-1 decode per op:
    the fused layer routes in C, unrecorded (its routing and ids against the per-op path's:
    test_fused_batch1_moe_layer_follows_the_per_op_path)."""
    monkeypatch.setattr(llm.engine.model, "decode_layer", None)
    calls, real = [], moe_mod.route
    monkeypatch.setattr(moe_mod, "route", lambda h, w: (lambda r: calls.append(r[1].clone()) or r)(real(h, w)))
    ids = engine_greedy(llm, [prompt], GREEDY48)[0]
    monkeypatch.setattr(moe_mod, "route", real)
    return ids, [torch.cat(calls[i::layers]).sort(dim=-1).values for i in range(layers)]


def first_routing_flip(hf: dict, seq: list[int], engine: list[torch.Tensor]) -> tuple[int, bool] | None:
    """The first (position, then layer) where the routing of the sequence is not settled, and
    whether HF fp32 has a near-tie there: its k-th and (k+1)-th router logits closer than twice
    the largest error HF's own bf16 makes on that layer's router logits over the sequence (a
    choice bf16 cannot make reliably: the engine, another bf16 implementation, errs as much, not
    at the same positions). Not settled: the engine's experts differ from HF bf16's on the same
    tokens, or HF bf16's differ from HF fp32's at such a near-tie (HF bf16 itself routes it
    either way: its generate's one-row decode steps round otherwise than this one forward over
    the sequence, so its greedy ids after it are no reference). None when every position is
    settled."""
    with torch.inference_mode():
        out32, out16 = (hf[dtype](torch.tensor([seq]), output_router_logits=True).router_logits for dtype in hf)
    flips = []
    for layer, (l32, l16, mine) in enumerate(zip(out32, out16, engine)):
        l32, l16, k = l32.float(), l16.float(), mine.shape[1]
        top = l32.topk(k + 1, dim=-1).values
        near = top[:, k - 1] - top[:, k] < 2 * (l16 - l32).abs().max()
        experts16 = l16.topk(k, dim=-1).indices.sort(dim=-1).values
        differs = (experts16 != mine).any(dim=-1)
        hf_unsettled = near & (experts16 != l32.topk(k, dim=-1).indices.sort(dim=-1).values).any(dim=-1)
        if differs.any():
            pos = int(differs.nonzero()[0])
            flips.append((pos, layer, bool(near[pos])))
        if hf_unsettled.any():
            flips.append((int(hf_unsettled.nonzero()[0]), layer, True))
    return min(flips)[0::2] if flips else None


def logits_tie(hf: dict, prefix: list[int]) -> tuple[float, float]:
    """HF fp32's top-1 minus top-2 next-token logit after `prefix`, and what bf16 cannot
    resolve there: one bf16 ulp of the top logit (tests/test_bf16.py's rule) or twice HF bf16's
    own largest error on these logits, whichever is more (the MoE models' bf16 logits err by
    several ulps: a router's rounding moves a whole expert's share)."""
    with torch.inference_mode():
        l32, l16 = (hf[dtype](torch.tensor([prefix])).logits[0, -1].float() for dtype in hf)
    top2 = l32.topk(2).values.tolist()
    ulp = 2.0 ** (math.floor(math.log2(abs(top2[0]))) - 7)
    return top2[0] - top2[1], max(ulp, 2 * float((l16 - l32).abs().max()))


@pytest.mark.parametrize("name", ["qwen3_moe-mlp_only", "qwen3_moe-step2", "mixtral"])
def test_bf16_moe_greedy_follows_hf_bf16_up_to_routing_ties(name, checkpoints, monkeypatch):
    """bf16 MoE against HF bf16 with tests/test_bf16.py's tie rule extended to routers. The
    engine's routing (recorded as it ran) equals HF bf16's on the same tokens up to its first
    difference, which must be an fp32 near-tie of the router (after a flipped expert the two
    states differ, so later differences follow from it). The greedy ids follow HF bf16 for as
    long as HF's own bf16 and fp32 agree, except at a bf16 tie of the output logits (logits_tie;
    HF goes on from the engine's choice) or at a token after a routing near-tie flip (nothing after it is
    compared: the two caches hold different KV from there)."""
    path, hf = checkpoints[name], hf_both(checkpoints[name])
    llm = LLM(str(path), num_threads=1, max_model_len=256, dtype="bfloat16")
    hf32, hf16 = hf[torch.float32], hf[torch.bfloat16]
    compared = 0
    for prompt in prompts_of([BLOCK + 5, 40, 7], seed=11):
        ids, routing = engine_greedy_and_routing(llm, prompt, len(FAMILIES[name].sparse), monkeypatch)
        flip = first_routing_flip(hf, prompt + ids[:-1], routing)  # the last id was never forwarded
        assert flip is None or flip[1], (len(prompt), flip)  # only at a near-tie
        flip_at = len(ids) if flip is None else flip[0] - len(prompt)  # the first id computed after it
        start = 0
        while start < len(ids):
            prefix = prompt + ids[:start]
            ids32, ids16 = _hf_greedy(hf32, prefix, len(ids) - start), _hf_greedy(hf16, prefix, len(ids) - start)
            agree, same = first_difference(ids32, ids16), first_difference(ids[start:], ids16)
            if same >= agree:
                compared += agree
                break
            compared += same
            if start + same > flip_at:  # the engine's state is another since the flip
                break
            margin, bound = logits_tie(hf, prefix + ids[start:start + same])
            assert margin < bound, (len(prompt), start + same, margin, bound, ids, ids16)
            start += same + 1
    assert compared >= 8  # tokens checked in all


@pytest.mark.parametrize("name", ["qwen3_moe-mlp_only", "qwen3_moe-step2", "mixtral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_moe_layers_equal_hfs_sparse_blocks(name, dtype, checkpoints, monkeypatch):
    """Each sparse layer as the engine loads it against the HF module on the same input: the
    per-expert torch path bit-equal in bf16 for several rows (the same roundings: each expert's
    output and its weighted product, then one float32 sum over the k); the C kernels (one row:
    the GEMV's, several: the AMX tiles' (moe.AMX, where the CPU has them) or the grouped experts'
    (moe.GROUPED)) sum in another order: within bf16's rounding."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[name], dtype=dtype).eval()
    model = load_model(checkpoints[name], dtype)
    g = torch.Generator().manual_seed(0)
    for i in FAMILIES[name].sparse:
        for rows in (1, 5, 40):
            h = torch.randn(rows, 64, generator=g).to(dtype)
            with torch.inference_mode():
                want = hf.model.layers[i].mlp(h.unsqueeze(0))
                want = (want[0] if isinstance(want, tuple) else want).reshape(rows, 64)
            tol = 1e-6 if dtype == torch.float32 else 2 ** -7
            torch.testing.assert_close(moe(h, model.layers[i].moe), want, atol=tol, rtol=tol)
            if dtype == torch.bfloat16 and rows > 1:
                monkeypatch.setattr(moe_mod, "GROUPED", False)
                monkeypatch.setattr(moe_mod, "AMX", False)
                assert torch.equal(moe(h, model.layers[i].moe), want), (i, rows)
                monkeypatch.setattr(moe_mod, "GROUPED", True)
                monkeypatch.setattr(moe_mod, "AMX", True)


def test_phi3_partial_rotary_is_refused(tmp_path):  # longrope past the original length: tests/test_longrope.py
    path = make_checkpoint(tmp_path / "phi4", "phi3", seed=3, partial_rotary_factor=0.75)
    with pytest.raises(ValueError, match="partial_rotary_factor=0.75"):
        load_model(path)


def test_phi3_config_of_the_older_format_reads_the_same(checkpoints, tmp_path):
    """rope_scaling {"type": "su", factors} with rope_theta and original_max_position_embeddings
    beside it, as Phi-3's published config.json files have it: the same RoPE tables."""
    path = tmp_path / "old"
    shutil.copytree(checkpoints["phi3"], path)
    hf = json.loads((path / "config.json").read_text())
    rope = hf.pop("rope_parameters")
    hf.update(rope_theta=rope["rope_theta"], rope_scaling={"type": "su", "short_factor": rope["short_factor"],
                                                           "long_factor": rope["long_factor"]})
    (path / "config.json").write_text(json.dumps(hf))
    old, new = load_model(path, max_positions=256), load_model(checkpoints["phi3"], max_positions=256)
    assert torch.equal(old.cos, new.cos) and torch.equal(old.sin, new.sin)
    assert not torch.equal(new.cos[:, 0], torch.arange(256).float().cos())  # the attention factor is in


def test_a_loaded_model_keeps_no_view_of_its_checkpoint_file(tmp_path):
    """Tensors of the stored dtype are copied at load (float32 here: the norms, the embedding):
    nothing keeps the safetensors file mapped, whose read pages would stay in the process's RSS
    (the Qwen3-MoE shape's int8 engine: 7.8 GB RSS, 5.8 GB of it the float32 checkpoint)."""
    import gc

    path = make_checkpoint(tmp_path / "qwen3", "qwen3", seed=2)
    model = load_model(path, torch.float32)
    gc.collect()
    mapped = pathlib.Path("/proc/self/maps").read_text()
    assert model.layers and str(path.resolve()) not in mapped


def test_small_weights_share_one_huge_page_mapping():
    """huge_pages.side_by_side: tensors too small for a huge page of their own, copied in order
    into one 2 MiB-aligned mapping, each from a 64-byte boundary, values unchanged."""
    ts = [torch.randn(3, 5), torch.randint(0, 255, (7, 9), dtype=torch.uint8), torch.randn(2, 64).to(torch.bfloat16),
          torch.randint(-128, 127, (33,), dtype=torch.int8)]
    out = huge_pages.side_by_side(ts)
    assert out[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    for t, u in zip(ts, out):
        assert u.dtype == t.dtype and u.shape == t.shape and u.is_contiguous() and torch.equal(t, u)
        assert u.data_ptr() % 64 == 0
    ends = [u.data_ptr() + u.nbytes for u in out]
    assert all(end <= nxt.data_ptr() for end, nxt in zip(ends, out[1:]))  # in order, not overlapping
    assert out[-1].data_ptr() - out[0].data_ptr() < huge_pages.HUGE_PAGE


def test_the_kv_cache_is_zero_on_its_own_huge_page_mapping():
    """huge_pages.zeros_on_huge_pages (the paged KV cache's tensor): 2 MiB-aligned, zeros, writable,
    alive through its views after the cache object that made it is gone; a cache under one huge
    page is plain torch.zeros."""
    import gc

    from atomd.engine.kv_cache import KVCache

    cache = KVCache(40, 4, 16, 8, 64, torch.float16, compute_dtype=torch.float32)  # 40 blocks of 128 KiB
    assert cache.kv.nbytes > huge_pages.HUGE_PAGE and cache.kv.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert cache.kv.dtype == torch.float16 and cache.kv.is_contiguous() and not cache.kv.any()
    blocks = cache.as_numpy_blocks()
    del cache
    gc.collect()
    blocks[39, -1] = 7  # the mapping outlives the KVCache through its views
    assert blocks[39, -1] == 7 and blocks.sum() == 7
    small = huge_pages.zeros_on_huge_pages((4, 4), torch.float32)
    assert not small.any() and small.shape == (4, 4)
