"""The sampler against the definitions, by way of a small numpy reference sampler.

Deterministic transforms (allowed_token_ids, bad_words, logit_bias, min_tokens, the
repetition / frequency / presence penalties, greedy) must equal the reference on fixed
logits; sampled ones (temperature, top-k, top-p, min_p, and all of it together) must draw
each token with the reference probability within 4 sigma. Rows with different settings
share one batch, so the vectorised code is checked against a row-by-row reference. A
seed reproduces its draws whatever else is batched; logprobs are of the raw logits."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from atomd.engine.sampler import Sampler, draw_seed
from contracts.sampling import SamplingParams
from scheduler.sequence import Sequence

pytestmark = pytest.mark.unit
torch.set_num_threads(1)
LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
N = 20000  # draws per distribution: 4-sigma of a frequency near 0.5 is ~0.014
END = [5]  # the "model's" end token in these tests


# ---------------------------------------------------------------------- the numpy reference

def ref_process(logits: np.ndarray, prompt: list[int], output: list[int], p: SamplingParams) -> np.ndarray:
    """vLLM's logits processing, one row at a time, in float64."""
    x = np.asarray(logits, dtype=np.float64).copy()
    vocab = x.size
    if p.allowed_token_ids is not None:
        keep = np.zeros(vocab, bool)
        keep[p.allowed_token_ids] = True
        x[~keep] = -np.inf
    for word in p.bad_words_token_ids:
        prefix = word[:-1]
        if len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix:
            x[word[-1]] = -np.inf
    for token, bias in (p.logit_bias or {}).items():
        x[token] += bias
    if len(output) < p.min_tokens:
        x[list(p.stop_token_ids) + ([] if p.ignore_eos else END)] = -np.inf
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=vocab).astype(np.float64)
    seen = counts > 0
    seen[prompt] = True
    r = p.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    return x


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def ref_probs(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The distribution a row samples from, given its processed logits."""
    if p.temperature == 0:
        out = np.zeros_like(x)
        out[np.argmax(x)] = 1.0
        return out
    z = x / p.temperature
    if p.min_p > 0:
        probs = softmax(z)
        z = np.where(probs < p.min_p * probs.max(), -np.inf, z)
    order = np.argsort(-z, kind="stable")
    if 0 < p.top_k < z.size:
        z[order[p.top_k:]] = -np.inf
    if p.top_p < 1.0:
        probs = softmax(z)
        mass = 0.0
        for rank, i in enumerate(order):
            if rank > 0 and mass >= p.top_p:
                z[i] = -np.inf
            mass += probs[i]
    return softmax(z)


# ---------------------------------------------------------------------- helpers

def seq_with(prompt: list[int], output: list[int], params: SamplingParams | None = None) -> Sequence:
    seq = Sequence(prompt, params or SamplingParams())
    seq.token_ids += output
    return seq


def draw(params: SamplingParams, n: int = N, seed: int = 0, prompt=(0,), output=(), logits=LOGITS) -> np.ndarray:
    """Frequencies of n draws of one row (n unseeded rows of the same sequence)."""
    seq = seq_with(list(prompt), list(output), params)
    tokens, _ = Sampler(seed, END).sample(logits.repeat(n, 1), [seq] * n)
    return np.bincount(tokens, minlength=logits.numel()) / n


def assert_frequencies(freq: np.ndarray, probs: np.ndarray) -> None:
    sigma = np.sqrt(probs * (1 - probs) / N)
    assert (np.abs(freq - probs) <= 4 * sigma + 1e-9).all(), (freq, probs)
    assert (freq[probs == 0] == 0).all()


# ---------------------------------------------------------------------- deterministic transforms

VOCAB = 40
CASES = {
    "none": SamplingParams(),
    "allowed_token_ids": SamplingParams(allowed_token_ids=[3, 7, 11, 39]),
    "bad_words": SamplingParams(bad_words_token_ids=[[9], [4, 12], [20, 21, 22], [6, 30]]),
    "logit_bias": SamplingParams(logit_bias={0: -100.0, 3: 5.5, 17: 100.0, 39: -0.25}),
    "min_tokens": SamplingParams(min_tokens=10, stop_token_ids=[2, 8]),
    "min_tokens_ignore_eos": SamplingParams(min_tokens=10, stop_token_ids=[2], ignore_eos=True),
    "repetition_penalty": SamplingParams(repetition_penalty=1.7),
    "repetition_penalty_below_one": SamplingParams(repetition_penalty=0.6),
    "frequency_penalty": SamplingParams(frequency_penalty=0.8),
    "presence_penalty": SamplingParams(presence_penalty=-1.3),
    "all_penalties": SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.7),
    "everything": SamplingParams(allowed_token_ids=list(range(0, 40, 2)), bad_words_token_ids=[[4], [12, 14]],
                                 logit_bias={2: 3.0, 10: -4.0}, min_tokens=8, stop_token_ids=[6],
                                 repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2),
}
PROMPT = [1, 3, 3, 17, 25]
OUTPUT = [4, 12, 20, 21, 3, 3, 30, 9, 4]  # ends in 4: bad word [4, 12] bans 12


def test_each_deterministic_transform_equals_the_reference_in_one_batch():
    """Every case in one batch (plus rows without any setting) equals the row-by-row reference."""
    logits = torch.randn(len(CASES) * 2, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    names = sorted(CASES) * 2
    seqs = [seq_with(PROMPT if i % 2 else [7, 8], OUTPUT[:9 - i % 4], CASES[name]) for i, name in enumerate(names)]
    got = Sampler(0, END).process_logits(logits.clone(), seqs).double().numpy()
    for i, (name, seq) in enumerate(zip(names, seqs)):
        want = ref_process(logits[i].double().numpy(), seq.prompt_token_ids, seq.completion_token_ids, CASES[name])
        np.testing.assert_array_equal(np.isinf(got[i]), np.isinf(want), err_msg=name)
        finite = ~np.isinf(want)
        np.testing.assert_allclose(got[i][finite], want[finite], rtol=1e-6, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_is_the_argmax_of_the_processed_logits(name):
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    params = SamplingParams(temperature=0.0, **{f: getattr(CASES[name], f) for f in (
        "allowed_token_ids", "bad_words_token_ids", "logit_bias", "min_tokens", "stop_token_ids", "ignore_eos",
        "repetition_penalty", "frequency_penalty", "presence_penalty")})
    seq = seq_with(PROMPT, OUTPUT, params)
    tokens, _ = Sampler(0, END).sample(logits, [seq])
    assert tokens == [int(np.argmax(ref_process(logits[0].numpy(), PROMPT, OUTPUT, params)))]


def test_greedy_takes_the_first_of_equal_largest_logits_as_numpy_argmax():
    """Ties (and a row with NaN: torch's and numpy's argmax both pick it) go to the first index, row by row."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randint(0, 4, (6, VOCAB), generator=g).float()  # every row: many equal largest values
    logits[2, VOCAB // 2] = float("nan")
    seqs = [seq_with([1], [], SamplingParams(temperature=0.0)) for _ in range(6)]
    tokens, _ = Sampler(0, END).sample(logits.clone(), seqs)
    assert tokens == [int(np.argmax(row)) for row in logits.numpy()]


def test_logit_bias_minus_100_removes_the_greedy_token():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4))
    best = int(logits.argmax())
    seq = seq_with([1], [], SamplingParams(temperature=0.0, logit_bias={best: -100.0}))
    assert Sampler().sample(logits, [seq])[0] != [best]


def test_penalty_counts_follow_the_sequence_across_steps_and_accepted_runs():
    """The counts are kept per sequence and brought up to date with whatever was appended
    since the last sample: one token, a run of several (speculative decoding), or none."""
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3)
    sampler = Sampler(0, END)
    seq, other = seq_with([1, 2, 3], [], params), seq_with([9], [], params)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5))
    for appended in ([4], [4, 4, 7], [], [3], [30, 31, 4, 4]):
        seq.token_ids += appended
        got = sampler.process_logits(logits.clone(), [seq, other]).double().numpy()
        for row, s in enumerate((seq, other)):
            want = ref_process(logits[row].numpy(), s.prompt_token_ids, s.completion_token_ids, params)
            np.testing.assert_allclose(got[row], want, rtol=1e-6, atol=1e-5)
    assert sampler.num_slots_in_use == 2
    sampler.forget(seq.id)
    fresh = seq_with([5], [6, 6], params)  # reuses the freed row: starts from zero counts
    got = sampler.process_logits(logits[:1].clone(), [fresh]).double().numpy()
    np.testing.assert_allclose(got[0], ref_process(logits[0].numpy(), [5], [6, 6], params), rtol=1e-6, atol=1e-5)
    assert sampler.num_slots_in_use == 2


def test_penalty_state_grows_past_its_first_allocation():
    params = SamplingParams(frequency_penalty=1.0)
    sampler = Sampler(0, END)
    seqs = [seq_with([1], [i % VOCAB, 3], params) for i in range(30)]
    logits = torch.zeros(30, VOCAB)
    got = sampler.process_logits(logits.clone(), seqs).numpy()
    for row, s in enumerate(seqs):
        np.testing.assert_allclose(got[row], ref_process(np.zeros(VOCAB), [1], s.completion_token_ids, params))


# ---------------------------------------------------------------------- sampled transforms (4 sigma)

def test_greedy_is_argmax_and_ignores_top_k_p():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    seqs = [seq_with([1], [], SamplingParams(temperature=0.0, top_k=3, top_p=0.5)) for _ in range(8)]
    tokens, logprobs = Sampler().sample(logits, seqs)
    assert tokens == logits.argmax(-1).tolist() and logprobs is None


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0), SamplingParams(temperature=0.5), SamplingParams(temperature=2.0),
    SamplingParams(top_k=3), SamplingParams(top_p=0.5), SamplingParams(top_p=0.8), SamplingParams(top_p=0.95),
    SamplingParams(top_k=4, top_p=0.7), SamplingParams(min_p=0.1), SamplingParams(min_p=0.3, temperature=1.5),
    SamplingParams(min_p=0.2, top_k=4, top_p=0.9, temperature=0.8),
    SamplingParams(logit_bias={0: -2.0, 4: 2.5}, temperature=0.9),
    SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.5, min_p=0.05),
    SamplingParams(allowed_token_ids=[1, 2, 4], bad_words_token_ids=[[3, 2]], temperature=1.3),
], ids=lambda p: ",".join(f"{k}={v}" for k, v in msgspec_items(p)))
def test_sampled_frequencies_match_the_reference(params):
    prompt, output = [0, 2], [1, 3, 1]
    want = ref_probs(ref_process(LOGITS.numpy(), prompt, output, params), params)
    assert_frequencies(draw(params, prompt=prompt, output=output), want)


def msgspec_items(p: SamplingParams):
    default = SamplingParams()
    return [(k, getattr(p, k)) for k in p.__struct_fields__ if getattr(p, k) != getattr(default, k)]


def test_min_p_099_equals_greedy():
    assert_frequencies(draw(SamplingParams(min_p=0.99, temperature=1.0)), np.eye(LOGITS.numel())[0])


# ---------------------------------------------------------------------- seeds, logprobs

def test_seed_reproduces_whatever_else_is_batched():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))

    def run(sampler_seed: int, rows: int, seed: int) -> list[int]:
        sampler = Sampler(sampler_seed)
        seqs = [seq_with([1], [], SamplingParams(temperature=1.0, seed=seed))] + \
            [seq_with([1], [], SamplingParams(temperature=1.0)) for _ in range(rows - 1)]
        out = []
        for _ in range(20):  # 20 successive output positions
            out.append(sampler.sample(logits[:rows], seqs)[0][0])
            for s in seqs:
                s.token_ids.append(out[-1])
        return out

    alone = run(0, 1, 42)
    assert run(5, 3, 42) == alone
    assert len(set(alone)) > 1  # it does sample, not argmax
    assert run(0, 1, 43) != alone


def test_a_seeded_draw_depends_only_on_seed_and_position():
    """The PD case: the decode engine draws output token 1 as the colocated engine would."""
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1.0, seed=7)
    here = [Sampler(0).sample(logits, [seq_with([1], [5] * i, params)])[0][0] for i in range(30)]
    there = [Sampler(9).sample(logits, [seq_with([1], [5] * i, params)])[0][0] for i in range(30)]
    assert here == there and len(set(here)) > 1
    assert draw_seed(7, 0) != draw_seed(7, 1) != draw_seed(8, 0)


def test_seeded_draws_follow_the_distribution():
    """Seeds over positions draw the distribution as well as the engine's generator does."""
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(N)]
    seqs = [seq_with([1], [], p) for p in params]
    tokens, _ = Sampler().sample(LOGITS.repeat(N, 1), seqs)
    assert_frequencies(np.bincount(tokens, minlength=LOGITS.numel()) / N, softmax(LOGITS.double().numpy()))


def test_logprobs_are_raw_log_softmax_with_top_k():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(2))
    seqs = [seq_with([1], [], SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=2.0)),
            seq_with([1], [], SamplingParams(temperature=0.7, logprobs=0))]
    tokens, entries = Sampler().sample(logits, seqs)
    ref = torch.log_softmax(logits.double(), -1)
    for row, (token, entry) in enumerate(zip(tokens, entries)):
        assert math.isclose(entry.logprob, ref[row, token].item(), abs_tol=1e-5)
    top = ref[0].topk(3)
    assert [t for t, _ in entries[0].top] == top.indices.tolist()
    assert [lp for _, lp in entries[0].top] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert entries[1].top == []


def test_best_of_rows_get_a_logprob_without_asking():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(6))
    seqs = [seq_with([1], [], SamplingParams(temperature=0.0, n=1, best_of=2)), seq_with([1], [], SamplingParams())]
    tokens, entries = Sampler().sample(logits, seqs)
    assert entries[1] is None and entries[0].top == []
    assert math.isclose(entries[0].logprob, torch.log_softmax(logits[0].double(), -1)[tokens[0]].item(),
                        abs_tol=1e-5)


def test_stop_tokens_are_banned_before_min_tokens():
    seqs = [seq_with([1], [], SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[0])),
            seq_with([1], [], SamplingParams(temperature=1.0, min_tokens=2, stop_token_ids=[0, 1, 2, 3]))]
    tokens, _ = Sampler(0, END).sample(LOGITS.repeat(2, 1), seqs)
    assert tokens == [1, 4]  # row 2: the stop tokens and the end token 5 are out
