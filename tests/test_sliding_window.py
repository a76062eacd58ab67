"""Sliding-window attention (a per-layer window, None = global) against references.

Kernels: the C decode and prefill kernels with a window against a float64 torch reference
with transformers' mask (position p sees keys p - window < j <= p), float32 and bfloat16,
under every $ATOMD_KERNEL_ISA narrowing this CPU allows (the kernels' code paths of the
three CPU kinds and AVX2), on a shuffled paged cache whose blocks before each window are
garbage (NaN): a kernel that reads a block outside the window fails.
"""
from __future__ import annotations

import pytest
import torch

from atomd.kernels import cbuild, native
from atomd.engine.kv_cache import KVCache
from tests.cpu_builds import ISAS



def windowed_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                       window: int | None, scale: float) -> torch.Tensor:
    """float64 softmax attention of q [R, H, D] at `positions` over keys, values [L, KV, D]
    (key j at position j), each row seeing keys p - window < j <= p."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    keys, values = keys.nan_to_num(), values.nan_to_num()  # the freed blocks' garbage: masked out below
    k = keys.double().repeat_interleave(heads // kv_heads, dim=1)
    v = values.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("rhd,lhd->rhl", q.double(), k) * scale
    j, p = torch.arange(keys.shape[0]).unsqueeze(0), positions.unsqueeze(1)
    allowed = (j <= p) & ((p - j < window) if window else True)
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    return torch.einsum("rhl,lhd->rhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


def _kernels(isa, head_dim, group):
    lib = native.attention_kernels(head_dim, group, isa=isa)
    if lib is None:  # as tests/test_kernel_targets.py: the windowed kernels are what this checks
        pytest.fail(f"the attention kernel (head_dim {head_dim}, group {group}, isa {isa}) did not build: "
                    f"{cbuild.kernel_paths()}")
    return lib


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.unit
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (8, 1, 64)])
@pytest.mark.parametrize("window", [1, 16, 37, None])
def test_decode_kernel_window_equals_reference(isa, dtype, heads, kv_heads, head_dim, window):
    torch.manual_seed(heads + head_dim + (window or 0))
    block = 16
    lens = torch.tensor([1, 15, 16, 17, 40, 100], dtype=torch.int64)  # inside, at and past the window
    width = int(-(-lens.max() // block))
    cache = KVCache(len(lens) * width + 3, 2, block, kv_heads, head_dim, dtype=dtype)
    cache.kv.normal_()
    tables = torch.randperm(cache.num_blocks)[:len(lens) * width].view(len(lens), width).contiguous()
    scale = 0.7 / head_dim ** 0.5  # not the default: query_pre_attn_scalar
    if window:  # blocks wholly before every window: garbage a kernel must not read (freed blocks)
        for b, n in enumerate(lens.tolist()):
            for i in range(max(0, n - window) // block):
                cache.kv[tables[b, i]] = float("nan")
    lib = _kernels(isa, head_dim, heads // kv_heads)
    for layer in range(2):
        q = (torch.randn(len(lens), heads, head_dim) * 3).to(dtype)
        got = native.decode_attention(lib, q, cache, layer, tables, lens, window=window, scale=scale)
        for b, n in enumerate(lens.tolist()):
            keys, values = cache.gather(layer, tables[b], n)
            want = windowed_reference(q[b:b + 1], keys.transpose(0, 1), values.transpose(0, 1),
                                      torch.tensor([n - 1]), window, scale)
            torch.testing.assert_close(got[b:b + 1].double(), want, **TOL[dtype])


@pytest.mark.unit
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 37, 100])
def test_decode_kernel_window_with_drafts(isa, dtype, window):
    """Speculative verify: rows of one sequence at consecutive positions, each its own window."""
    torch.manual_seed(window)
    heads, kv_heads, head_dim, block = 4, 2, 32, 16
    lens, drafts = torch.tensor([9, 70, 130], dtype=torch.int64), [1, 4, 3]
    width = int(-(-lens.max() // block))
    cache = KVCache(len(lens) * width, 1, block, kv_heads, head_dim, dtype=dtype)
    cache.kv.normal_()
    tables = torch.randperm(cache.num_blocks).view(len(lens), width).contiguous()
    starts = torch.tensor([0, *torch.tensor(drafts).cumsum(0).tolist()], dtype=torch.int64)
    q = (torch.randn(int(starts[-1]), heads, head_dim) * 3).to(dtype)
    lib = _kernels(isa, head_dim, heads // kv_heads)
    got = native.decode_attention(lib, q, cache, 0, tables, lens, starts, window=window)
    for b, n in enumerate(lens.tolist()):
        keys, values = cache.gather(0, tables[b], n)
        rows = slice(int(starts[b]), int(starts[b + 1]))
        positions = torch.arange(n - drafts[b], n)
        want = windowed_reference(q[rows], keys.transpose(0, 1), values.transpose(0, 1), positions, window,
                                  head_dim ** -0.5)
        torch.testing.assert_close(got[rows].double(), want, **TOL[dtype])


@pytest.mark.unit
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (8, 1, 64)])
@pytest.mark.parametrize("window", [1, 7, 65, 150, None])
def test_prefill_kernel_window_equals_reference(isa, dtype, heads, kv_heads, head_dim, window):
    torch.manual_seed(heads * head_dim + (window or 0))
    lens = [1, 15, 17, 70, 130, 200]  # under, at and over a query tile, a key tile and the window
    total = sum(lens)
    q = (torch.randn(total, heads, head_dim) * 2).to(dtype)
    k = (torch.randn(total, kv_heads, head_dim) * 2).to(dtype)
    v = torch.randn(total, kv_heads, head_dim).to(dtype)
    starts = torch.tensor([sum(lens[:i]) for i in range(len(lens))])
    lib = _kernels(isa, head_dim, heads // kv_heads)
    out = torch.full((total, heads * head_dim), float("nan"), dtype=dtype)
    scale = 1.3 / head_dim ** 0.5
    native.prefill_attention(lib, q, k, v, out, starts, torch.tensor(lens), window=window, scale=scale)
    for s, n in zip(starts.tolist(), lens):
        rows = slice(s, s + n)
        want = windowed_reference(q[rows], k[rows], v[rows], torch.arange(n), window, scale)
        torch.testing.assert_close(out[rows].double(), want, **TOL[dtype])


# ---------------------------------------------------------------------- models against HF

from atomd.llm import LLM  # noqa: E402
from atomd.model.config import ModelConfig  # noqa: E402
from contracts.sampling import SamplingParams  # noqa: E402
from tests.test_model_hf import (BLOCK, _prompt_logits, assert_equals_hf, engine_greedy, hf_greedy, hf_model,  # noqa: E402
                                 make_checkpoint, prompts_of)
from tests.test_spec_decode import SPEC_JSON  # noqa: E402

WINDOW = 24  # under a block and a half: prompts and outputs run well past it
PAST = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def mistral_sw(tmp_path_factory):
    """Mistral: the window on every layer."""
    return make_checkpoint(tmp_path_factory.mktemp("mistral_sw"), "mistral", seed=4, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def qwen2_sw(tmp_path_factory):
    """Qwen2, hybrid: layer 0 global, layers 1-2 windowed (max_window_layers=1)."""
    return make_checkpoint(tmp_path_factory.mktemp("qwen2_sw"), "qwen2", seed=5, use_sliding_window=True,
                           sliding_window=WINDOW - 4, max_window_layers=1, num_hidden_layers=3)


def _model(kind, mistral_sw, qwen2_sw):
    return mistral_sw if kind == "mistral" else qwen2_sw


@pytest.mark.unit
def test_window_per_layer_as_transformers_reads_it(mistral_sw, qwen2_sw):
    from atomd.model.loader import read_config

    assert read_config(mistral_sw).layer_windows == (WINDOW, WINDOW)
    assert read_config(qwen2_sw).layer_windows == (None, WINDOW - 4, WINDOW - 4)
    base = dict(num_hidden_layers=4, vocab_size=8, hidden_size=8, intermediate_size=8, num_attention_heads=1)
    # an older Qwen2 config.json, no layer_types: max_window_layers decides
    old = ModelConfig.from_hf({**base, "use_sliding_window": True, "sliding_window": 9, "max_window_layers": 3},
                              "Qwen2ForCausalLM", window_layers_by_type=True)
    assert old.layer_windows == (None, None, None, 9) and not old.all_windowed
    off = ModelConfig.from_hf({**base, "use_sliding_window": False, "sliding_window": 9}, "Qwen2ForCausalLM",
                              window_layers_by_type=True)
    assert off.layer_windows == (None,) * 4
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="sliding_window"):
            ModelConfig.from_hf({**base, "sliding_window": bad}, "MistralForCausalLM", sliding_by_default=True)
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf({**base, "use_sliding_window": True, "sliding_window": 9, "layer_types": ["x"] * 4},
                            "Qwen2ForCausalLM", window_layers_by_type=True)


@pytest.mark.unit
@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_greedy_48_tokens_past_the_window_equals_hf(kind, backend, mistral_sw, qwen2_sw):
    path = _model(kind, mistral_sw, qwen2_sw)
    # max_model_len far past the window: accepted (it was refused before the window was real)
    llm = LLM(str(path), num_threads=1, max_model_len=256, attention_backend=backend)
    prompts = prompts_of([3 * WINDOW + 5, 5, WINDOW + 1], seed=2)
    assert_equals_hf(path, prompts, engine_greedy(llm, prompts, PAST), n=48)


@pytest.mark.unit
@pytest.mark.parametrize("chunk", [None, BLOCK])
@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_prompt_logits_past_the_window_match_hf(kind, chunk, mistral_sw, qwen2_sw):
    path = _model(kind, mistral_sw, qwen2_sw)
    args = {"max_num_batched_tokens": chunk} if chunk else {}
    llm = LLM(str(path), num_threads=1, max_model_len=256, **args)
    prompt = prompts_of([5 * BLOCK + 3], seed=3)[0]
    got = _prompt_logits(llm, prompt)
    with torch.inference_mode():
        want = hf_model(path)(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.unit
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_prefix_hits_chunks_and_speculation_past_the_window_equal_hf(backend, mistral_sw):
    llm = LLM(str(mistral_sw), num_threads=1, max_model_len=256, max_num_batched_tokens=BLOCK,
              attention_backend=backend, speculative_config=SPEC_JSON)
    loops = [(p * 20)[:3 * BLOCK + 5] for p in prompts_of([3, 5, 7], seed=21)]  # repetitive: drafts
    first = engine_greedy(llm, loops, PAST)
    second = engine_greedy(llm, loops, PAST)  # prefix hits on blocks before and inside the window
    stats = llm.engine.stats()
    assert first == second
    assert stats["prefix_cache_hits"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert_equals_hf(mistral_sw, loops, second, n=48)


# ---------------------------------------------------------------------- blocks outside the window

def _run_counting_blocks(llm: LLM, prompt: list[int], n: int) -> tuple[list[int], int, int]:
    """Greedy ids of one request stepped by hand, the most blocks its table held live at any
    decode step (the whole prompt is allocated at admission), and the least free blocks of the
    pool meanwhile."""
    engine = llm.engine
    engine.add_request("counted", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    seq = engine.scheduler._live[next(iter(engine.scheduler._live))]
    ids, most_held, least_free = [], 0, engine.stats()["num_free_blocks"]
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids += out.new_token_ids
        if ids and seq.block_table:
            most_held = max(most_held, sum(1 for b in seq.block_table if b >= 0))
        least_free = min(least_free, engine.stats()["num_free_blocks"])
    return ids, most_held, least_free


@pytest.mark.unit
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_blocks_outside_the_window_return_to_the_pool_during_the_run(backend, mistral_sw):
    llm = LLM(str(mistral_sw), num_threads=1, max_model_len=256, attention_backend=backend,
              max_num_batched_tokens=BLOCK)  # chunked: earlier chunks' blocks go back during the prefill
    total = llm.engine.stats()["num_total_blocks"]
    prompt = prompts_of([5 * BLOCK + 3], seed=12)[0]
    ids, most_held, least_free = _run_counting_blocks(llm, prompt, 48)
    assert ids == hf_greedy(mistral_sw, prompt, 48)
    whole = -(-(len(prompt) + 48) // BLOCK)  # 8 blocks: what the sequence holds without the window
    # a decode query and the 23 keys before it span at most 3 blocks
    assert most_held <= -(-WINDOW // BLOCK) + 1 < whole
    stats = llm.engine.stats()
    assert stats["num_window_released_blocks"] >= whole - most_held
    # the pool, during the run: never more than the window's blocks and the prompt's allocation out
    assert total - least_free <= -(-len(prompt) // BLOCK) + 1
    assert stats["num_free_blocks"] == total  # and everything back at the end


@pytest.mark.unit
def test_a_hybrid_model_keeps_every_block(qwen2_sw, tmp_path):
    """A global layer reads every key: nothing is released (Qwen2 here, Gemma 3 the same)."""
    llm = LLM(str(qwen2_sw), num_threads=1, max_model_len=256)
    prompt = prompts_of([3 * BLOCK], seed=13)[0]
    _, most_held, _ = _run_counting_blocks(llm, prompt, 40)
    assert most_held == -(-(len(prompt) + 39) // BLOCK)
    assert llm.engine.stats()["num_window_released_blocks"] == 0
    assert llm.engine.scheduler.config.kv_window is None


@pytest.mark.unit
def test_released_blocks_stay_prefix_hits_until_taken(mistral_sw):
    """Released blocks keep their hashes in the LRU list: the same prompt hits them while they
    are cached; once other prompts took them for new KV, the prompt misses and recomputes, and
    both answers equal HF's (a reused block is never a hit)."""
    llm = LLM(str(mistral_sw), num_threads=1, max_model_len=256, num_kvcache_blocks=12)
    prompt = prompts_of([6 * BLOCK + 3], seed=14)[0]
    engine_greedy(llm, [prompt], PAST)
    assert llm.engine.stats()["num_window_released_blocks"] > 0
    hits = llm.engine.stats()["prefix_cache_hits"]
    again = engine_greedy(llm, [prompt], PAST)[0]
    assert llm.engine.stats()["prefix_cache_hits"] - hits >= 6 * BLOCK  # the released head blocks too
    engine_greedy(llm, prompts_of([6 * BLOCK + 3, 5 * BLOCK], seed=15), PAST)  # takes the 12 blocks over
    hits = llm.engine.stats()["prefix_cache_hits"]
    third = engine_greedy(llm, [prompt], PAST)[0]
    assert llm.engine.stats()["prefix_cache_hits"] - hits < 6 * BLOCK
    want = hf_greedy(mistral_sw, prompt, 48)
    assert again == want and third == want


@pytest.mark.unit
def test_preemption_and_forks_with_released_blocks_equal_hf(mistral_sw):
    """A tiny pool preempts sequences holding FREED entries (recomputed whole) and forks share
    tables with FREED entries (each choice releases its own references): greedy ids equal
    HF's and every block comes back."""
    llm = LLM(str(mistral_sw), num_threads=1, max_model_len=256, num_kvcache_blocks=12)
    prompts = prompts_of([BLOCK + 10] * 5, seed=16)
    got = engine_greedy(llm, prompts, PAST)
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["num_window_released_blocks"] > 0
    assert stats["num_free_blocks"] == 12
    assert_equals_hf(mistral_sw, prompts, got, n=48)
    prompt = prompts_of([2 * BLOCK + 3], seed=17)[0]
    outs = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(n=2, max_tokens=48, temperature=0.0,
                                                                      ignore_eos=True))
    want = hf_greedy(mistral_sw, prompt, 48)
    assert [c.token_ids for c in outs[0].outputs] == [want, want]
    assert llm.engine.stats()["num_free_blocks"] == 12


@pytest.mark.unit
def test_block_manager_releases_leading_blocks_once():
    from scheduler.block_manager import FREED, BlockManager
    from scheduler.sequence import Sequence

    bm = BlockManager(10, block_size=4)
    seq = Sequence(list(range(1, 24)))  # 23 tokens: 6 blocks
    bm.allocate(seq, bm.can_allocate(seq))
    seq.num_computed_tokens = 22
    bm.publish(seq)  # 5 full blocks named
    # the next query at 22 reads from 22 - 9 + 1 = 14 on: blocks 0-2 (tokens 0-11) wholly before
    assert bm.release_outside_window(seq, 9) == 3 and seq.block_table[:3] == [FREED] * 3
    assert bm.release_outside_window(seq, 9) == 0  # once
    assert bm.num_free_blocks == 10 - 3 and bm.num_window_released == 3
    again = Sequence(list(range(1, 24)))  # the released, still cached blocks are its prefix hit
    assert bm.can_allocate(again) == 5
    bm.deallocate(seq)
    assert bm.num_free_blocks == 10
    # D: the blocks before the first query's window are released unpulled and never published
    remote = Sequence(list(range(100, 123)))
    bm.allocate(remote, 0)
    assert bm.release_unpulled(remote, 9) == (23 - 9) // 4
    remote.num_computed_tokens = 23
    bm.publish(remote)
    assert remote.num_published_blocks == 5
    named = {b.block_id for b in bm.blocks if b.hash != -1 and b.token_ids and b.token_ids[0] >= 100}
    assert named == set(remote.block_table[3:5])  # the pulled full blocks only
    bm.deallocate(remote)
    assert bm.num_free_blocks == 10
