"""The engine against Hugging Face transformers, the reference, on tiny random checkpoints.

Greedy token ids must equal `transformers` greedy generation and prompt logits must match
within 1e-4, through every path the scheduler can take: mixed prompt lengths (1 token,
exactly one block, many blocks), chunked prefill, prefix-cache hits and preemption.
Checkpoints: a Llama with llama3 RoPE scaling, GQA and untied embeddings; a Qwen2 with
(randomised) qkv bias and tied embeddings; both written by `save_pretrained`.
"""
from __future__ import annotations

import json
import pathlib

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from atomd.llm import LLM
from scheduler.scheduler import ScheduledBatchOutput
from contracts.sampling import SamplingParams

torch.set_num_threads(1)
VOCAB = 320
BLOCK = 16
CORPUS = ["def main():\n    print('hello, world')\n", "import os\nimport sys\n",
          "for i in range(10):\n    total += i  # naïve sum, café, 日本語, 🙂\n"] * 20
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_tokenizer(path: pathlib.Path, vocab_size: int = 300) -> None:
    """A byte-level BPE (tokenizer.json) plus tokenizer_config.json with a chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|end|>"]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 1)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>",
        "pad_token": "<|pad|>", "chat_template": CHAT_TEMPLATE}))


def _randomise_biases(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.5)


def make_checkpoint(path: pathlib.Path, kind: str = "llama", seed: int = 0, **overrides) -> pathlib.Path:
    """A tiny random HF checkpoint of `kind` (llama | qwen2 | mistral | qwen3 | qwen3_moe |
    mixtral | phi3 | gemma3) with a tokenizer. The MoE kinds: 8 experts, top-2; phi3: longrope with
    original_max_position_embeddings 256."""
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512,
                  initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    common.update(overrides)
    if kind == "llama":
        common.setdefault("rope_parameters", {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
                                              "rope_theta": 10000.0})
        config = transformers.LlamaConfig(**common)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**{"tie_word_embeddings": True, **common})
    elif kind == "mistral":
        config = transformers.MistralConfig(**{"sliding_window": None, **common})
    elif kind == "qwen3":  # head_dim given: Qwen3Config's default is 128
        config = transformers.Qwen3Config(**{"head_dim": 16, **common})
    elif kind == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**{"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                                                "moe_intermediate_size": 32, **common})
    elif kind == "mixtral":
        config = transformers.MixtralConfig(**{"sliding_window": None, "num_local_experts": 8,
                                               "num_experts_per_tok": 2, **common})
    elif kind == "phi3":
        partial = common.pop("partial_rotary_factor", 1.0)
        half = int(common["hidden_size"] // common["num_attention_heads"] * partial) // 2
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 256,
                "short_factor": [1.0 + 0.25 * i for i in range(half)], "long_factor": [4.0] * half,
                "partial_rotary_factor": partial}
        config = transformers.Phi3Config(**{"sliding_window": None, "original_max_position_embeddings": 256,
                                            "rope_parameters": rope, **common})
    elif kind == "gemma3":  # every 3rd layer global, windows of 24, the scores' own scale, soft-capped logits
        rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}
        config = transformers.Gemma3TextConfig(**{
            "head_dim": 16, "sliding_window": 24, "query_pre_attn_scalar": 24, "final_logit_softcapping": 3.0,
            "rope_parameters": rope, "sliding_window_pattern": 3, **common})
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    _randomise_biases(model, seed)
    if kind == "gemma3":  # its norms start at w = 0 (a factor 1 + w): random, so the 1 + w is tested
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)) * 0.3)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> pathlib.Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> pathlib.Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2", seed=1)


_HF: dict[pathlib.Path, torch.nn.Module] = {}


def hf_model(path: pathlib.Path) -> torch.nn.Module:
    if path not in _HF:
        _HF[path] = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _HF[path]


def hf_greedy(path: pathlib.Path, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens, EOS taken like any other (the engine's ignore_eos): generate()'s
    min_new_tokens would instead forbid EOS, a different argmax wherever it is the top."""
    model, ids = hf_model(path), []
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            ids.append(int(out.logits[0, -1].argmax()))
            # transformers >= 5.2x names the cache `cache` (past_key_values deprecated)
            cache = {"cache": out.cache} if "cache" in out else {"past_key_values": out.past_key_values}
            out = model(torch.tensor([ids[-1:]]), use_cache=True, **cache)
    return ids


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


MIXED = [1, BLOCK, 5 * BLOCK + 3, 7, 2 * BLOCK]  # one token, exactly one block, many blocks
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def engine_greedy(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def assert_equals_hf(path: pathlib.Path, prompts: list[list[int]], got: list[list[int]], n: int = 8) -> None:
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(path, prompt, n), f"prompt of {len(prompt)} tokens"


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_mixed_lengths_equal_hf(kind, llama_dir, qwen2_dir):
    path = llama_dir if kind == "llama" else qwen2_dir
    prompts = prompts_of(MIXED)
    assert_equals_hf(path, prompts, engine_greedy(LLM(str(path), num_threads=1, max_model_len=256), prompts))


@pytest.mark.unit
def test_default_model_greedy_equals_hf():
    from atomd.model.default import default_model_dir

    path = default_model_dir()
    prompts = [[1], [1] + list(range(100, 115)), [1] + list(range(200, 290, 1))]
    got = engine_greedy(LLM(None, num_threads=1, max_model_len=256), prompts)
    assert_equals_hf(path, prompts, got)


def _prompt_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Logits of every prompt position, through the scheduler's (possibly chunked) batches."""
    engine = llm.engine
    seq = engine.add_request("logits", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    rows = []
    while seq.leave_reason is None:  # one step per prefill chunk; the last samples and finishes
        batch = engine.scheduler.schedule()
        rows.append(engine.runner.execute(batch, all_logits=True))
        engine.scheduler.postprocess(batch, _one_token_output(batch))
    engine._requests.pop("logits")
    return torch.cat(rows)


def _one_token_output(batch):
    return ScheduledBatchOutput(batch.seq_ids, [[3] if s else [] for s in batch.needs_sample.tolist()])


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("chunk", [None, BLOCK])
def test_prompt_logits_match_hf(kind, chunk, llama_dir, qwen2_dir):
    path = llama_dir if kind == "llama" else qwen2_dir
    args = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = LLM(str(path), num_threads=1, max_model_len=256, **args)
    prompt = prompts_of([4 * BLOCK + 5], seed=3)[0]
    got = _prompt_logits(llm, prompt)
    with torch.inference_mode():
        want = hf_model(path)(torch.tensor([prompt])).logits[0]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


BACKENDS = ["native", "torch"]  # atomd/kernels/native.py's C kernels, torch SDPA


@pytest.mark.unit
@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_forced_small_equals_hf(backend, llama_dir):
    llm = LLM(str(llama_dir), num_threads=1, max_model_len=256, max_num_batched_tokens=BLOCK,
              attention_backend=backend)
    prompts = prompts_of(MIXED, seed=1)
    assert_equals_hf(llama_dir, prompts, engine_greedy(llm, prompts))


@pytest.mark.unit
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_prefix_cache_hit_equals_hf(kind, backend, llama_dir, qwen2_dir):
    path = llama_dir if kind == "llama" else qwen2_dir
    llm = LLM(str(path), num_threads=1, max_model_len=256, attention_backend=backend)
    shared = prompts_of([3 * BLOCK], seed=5)[0]
    prompts = [shared + tail for tail in prompts_of([5, BLOCK, 1], seed=6)]
    first = engine_greedy(llm, prompts)
    hits_before = llm.engine.stats()["prefix_cache_hits"]
    second = engine_greedy(llm, prompts)
    assert llm.engine.stats()["prefix_cache_hits"] - hits_before >= 3 * 3 * BLOCK
    assert first == second
    assert_equals_hf(path, prompts, second)


@pytest.mark.unit
@pytest.mark.parametrize("backend", BACKENDS)
def test_preemption_by_tiny_pool_equals_hf(backend, llama_dir):
    # 6 sequences of 2 blocks each growing past a block boundary, 9 blocks in the pool
    llm = LLM(str(llama_dir), num_threads=1, max_model_len=256, num_kvcache_blocks=9,
              attention_backend=backend)
    prompts = prompts_of([BLOCK + 10] * 6, seed=7)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = engine_greedy(llm, prompts, params)
    assert llm.engine.stats()["num_preemptions"] > 0
    assert llm.engine.stats()["num_free_blocks"] == 9
    assert_equals_hf(llama_dir, prompts, got, n=12)


@pytest.mark.unit
def test_decode_without_workspace_equals_hf(llama_dir, monkeypatch):
    import atomd.engine.runner

    monkeypatch.setattr(atomd.engine.runner, "WORKSPACE_MAX_BYTES", 0)  # gather from the paged cache every step
    llm = LLM(str(llama_dir), num_threads=1, max_model_len=256, attention_backend="torch")
    prompts = prompts_of(MIXED, seed=9)
    assert_equals_hf(llama_dir, prompts, engine_greedy(llm, prompts))
    assert llm.engine.runner.workspace is None


@pytest.mark.unit
def test_mistral_loads_and_equals_hf(tmp_path):
    path = make_checkpoint(tmp_path / "mistral", "mistral", seed=2)
    prompts = prompts_of([BLOCK + 1, 3], seed=8)
    assert_equals_hf(path, prompts, engine_greedy(LLM(str(path), num_threads=1, max_model_len=128), prompts))


@pytest.mark.unit
@pytest.mark.parametrize("tile", [7, None])
def test_prefill_in_row_tiles_equals_hf(tile, llama_dir, monkeypatch):
    import atomd.model.decoder

    if tile is not None:  # uneven tiles that cut through sequences and blocks
        monkeypatch.setattr(atomd.model.decoder, "ROW_TILE", tile)
    lengths = [150, 1, 150, 150, 150]  # one packed prefill of 601 tokens: past the default tile
    assert sum(lengths) > atomd.model.decoder.ROW_TILE
    prompts = prompts_of(lengths, seed=13)
    llm = LLM(str(llama_dir), num_threads=1, max_model_len=256)
    assert_equals_hf(llama_dir, prompts, engine_greedy(llm, prompts))


@pytest.mark.unit
def test_a_16_bit_model_prefills_in_wider_row_tiles_with_the_same_tokens(llama_dir, monkeypatch):
    """16-bit weights with float32 compute (`--quantization bf16`) prefill 4x ROW_TILE rows a tile (decoder.ROW_TILE:
    each tile reads the weights again); the float32 model ROW_TILE. The tiles change no token: the 601-row prefill in
    one tile gives the greedy ids of tiles of 28 rows that cut through sequences and blocks."""
    import atomd.model.decoder

    lengths = [150, 1, 150, 150, 150]
    prompts = prompts_of(lengths, seed=13)
    llm = LLM(str(llama_dir), num_threads=1, max_model_len=256, quantization="bf16",
              enable_prefix_caching=False)  # (the second run prefills again)
    model = llm.engine.model
    assert model.prefill_row_tile(torch.float32) == 4 * atomd.model.decoder.ROW_TILE >= sum(lengths)
    assert LLM(str(llama_dir), num_threads=1, max_model_len=256).engine.model.prefill_row_tile(torch.float32) == \
        atomd.model.decoder.ROW_TILE
    one_tile = engine_greedy(llm, prompts)
    monkeypatch.setattr(atomd.model.decoder, "ROW_TILE", 7)
    assert engine_greedy(llm, prompts) == one_tile
