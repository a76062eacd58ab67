"""LoRA on DeepSeek V2 / V3 (atomd/model/deepseek_lora.py) against transformers + PEFT: random
adapters written by `peft` on the tiny V2-Lite-shaped (no q_lora, yarn) and V3-shaped (q_lora,
interleaved RoPE) checkpoints of tests/families.py; one batch mixing the base model and
two adapters (MLA's projections; the dense MLP and the shared experts) gives PeftModel's
greedy ids, prefill and absorbed decode. kv_b_proj, which the absorbed decode folds into the
query and output, is refused by name."""
from __future__ import annotations

import contextlib
import pathlib

import peft
import pytest
import torch
from peft.utils import transformers_weight_conversion

from atomd.llm import LLM
from contracts.sampling import SamplingParams
from tests.families import FAMILIES
from tests.test_lora import hf_greedy_with, hf_model_copy, make_adapter
from tests.test_model_hf import hf_model, prompts_of

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]
torch.set_num_threads(1)

TOKENS = 24
MLP = ["gate_proj", "up_proj", "down_proj"]  # a dense layer's MLP, a sparse layer's shared experts
ATTENTION = {"v2-lite": ["q_proj", "kv_a_proj_with_mqa", "o_proj"],
             "v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"]}


@contextlib.contextmanager
def peft_on_linears():
    """PEFT under transformers v5 turns target_modules gate_proj / up_proj / down_proj of a
    DeepSeek model into target_parameters on the routed experts' fused weights (its v4 -> v5 MoE
    conversion), whichever module they name, so it cannot put LoRA on the dense MLP or the
    shared experts. With that conversion off, PEFT's LoRA goes on the nn.Linear modules the names
    match: the dense MLP's and the shared experts'."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transformers_weight_conversion, "_convert_peft_config_moe", lambda config, model: None)
        yield


@pytest.fixture(scope="module", params=["v2-lite", "v3"])
def setup(request, tmp_path_factory):
    name = request.param
    root = tmp_path_factory.mktemp(f"lora_{name}")
    base = FAMILIES[f"deepseek-{name}"].write(root / "base")
    adapters = {"attn": make_adapter(base, root / "attn", 8, 16, False, ATTENTION[name], seed=1),
                "kv_b": make_adapter(base, root / "kv_b", 4, 8, False, ["kv_b_proj"], seed=3),
                "experts": make_adapter(base, root / "experts", 4, 8, False, MLP, seed=4)}  # PEFT's own mapping
    with peft_on_linears():
        adapters["mlp"] = make_adapter(base, root / "mlp", 4, 8, True, MLP, seed=2)
    torch.manual_seed(5)  # o_proj of the last layer only: a linear no adapter has in layer 0
    peft.get_peft_model(hf_model_copy(base), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["o_proj"], layers_to_transform=[2], init_lora_weights=False,
    )).save_pretrained(root / "late")
    adapters["late"] = root / "late"
    return base, adapters


def reference(base: pathlib.Path, adapter: pathlib.Path | None, prompt: list[int]) -> list[int]:
    if adapter is None:
        return hf_greedy_with(hf_model(base), prompt, TOKENS)
    with peft_on_linears():
        model = peft.PeftModel.from_pretrained(hf_model_copy(base), adapter).eval()
    return hf_greedy_with(model, prompt, TOKENS)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_mixed_batch_equals_peft(setup, backend):
    base, adapters = setup
    llm = LLM(str(base), enable_lora=True, lora_modules=[f"{n}={adapters[n]}" for n in ("attn", "mlp", "late")],
              max_loras=3, max_lora_rank=8, num_threads=1, max_num_batched_tokens=64, attention_backend=backend)
    names = [None, "attn", "mlp", "attn", None, "late"]
    prompts = prompts_of([5, 37, 1, 70, 16, 9], seed=3)  # one token, chunked over steps by the 64-token budget
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True), lora_name=names)
    got = [o.outputs[0].token_ids for o in outs]
    for prompt, name, ids in zip(prompts, names, got):
        assert ids == reference(base, adapters.get(name), prompt), (name, len(prompt))
    for i in (1, 2, 5):  # each adapter changes the output: the equality above says something
        assert got[i] != reference(base, None, prompts[i])
    alone = llm.generate([{"prompt_token_ids": prompts[1]}],  # batch-1 decode (the GEMV rows) under an adapter
                         SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True), lora_name="attn")
    assert alone[0].outputs[0].token_ids == got[1]
    assert llm.engine.loras.in_use == {}


def test_kv_b_proj_and_routed_experts_refused_by_name(setup):
    base, adapters = setup
    with pytest.raises(ValueError, match="LoRA on kv_b_proj is not supported: the absorbed MLA decode folds"):
        LLM(str(base), enable_lora=True, lora_modules=[f"kv_b={adapters['kv_b']}"], max_lora_rank=8,
            num_threads=1, max_model_len=64)
    with pytest.raises(ValueError, match=r"target_parameters=\[.*'gate_up_proj'.*\] is not supported"):
        LLM(str(base), enable_lora=True, lora_modules=[f"experts={adapters['experts']}"], max_lora_rank=8,
            num_threads=1, max_model_len=64)


def test_tensor_parallel_equals_peft(setup):
    """TP=2 (tensor_parallel.shard_adapter's MLA cuts: qkv_a whole but for q_proj's heads, q_b by
    heads, o by the heads' value inputs, the dense MLP's and shared experts' rows): a batch mixing
    the base model and the three adapters gives PeftModel's greedy ids."""
    base, adapters = setup
    llm = LLM(str(base), enable_lora=True, lora_modules=[f"{n}={adapters[n]}" for n in ("attn", "mlp", "late")],
              max_loras=3, max_lora_rank=8, num_threads=1, max_model_len=256, tensor_parallel_size=2)
    try:
        names = [None, "attn", "mlp", "late"]
        prompts = prompts_of([5, 37, 1, 9], seed=3)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True), lora_name=names)
        for prompt, name, out in zip(prompts, names, outs):
            assert out.outputs[0].token_ids == reference(base, adapters.get(name), prompt), (name, len(prompt))
            if name is not None:  # each adapter changes the output: the equality says something
                assert out.outputs[0].token_ids != reference(base, None, prompt), name
    finally:
        llm.engine.close()
