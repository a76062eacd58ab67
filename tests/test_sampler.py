"""The sampler against the definitions: greedy is argmax, temperature samples softmax(l / T),
top-k and top-p sample the renormalised truncated distribution, a seed reproduces its
draws whatever else is batched, logprobs are log_softmax of the raw logits."""
from __future__ import annotations

import math

import pytest
import torch

from atomd.sampler import Sampler
from scheduler.sequence import SamplingParams

torch.set_num_threads(1)
LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
N = 20000  # draws per distribution: 4-sigma of a frequency near 0.5 is ~0.014


def draw(params: SamplingParams, n: int = N, seed: int = 0) -> torch.Tensor:
    tokens, _ = Sampler(seed).sample(LOGITS.repeat(n, 1), [params] * n, list(range(n)))
    return torch.bincount(torch.tensor(tokens), minlength=LOGITS.numel()).double() / n


def assert_frequencies(freq: torch.Tensor, probs: torch.Tensor) -> None:
    sigma = (probs * (1 - probs) / N).sqrt()
    assert ((freq - probs).abs() <= 4 * sigma + 1e-9).all(), (freq, probs)
    assert (freq[probs == 0] == 0).all()


@pytest.mark.unit
def test_greedy_is_argmax_and_ignores_top_k_p():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0, top_k=3, top_p=0.5)] * 8
    tokens, logprobs = Sampler().sample(logits, params, list(range(8)))
    assert tokens == logits.argmax(-1).tolist() and logprobs is None


@pytest.mark.unit
@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_samples_softmax_of_scaled_logits(temperature):
    assert_frequencies(draw(SamplingParams(temperature=temperature)), torch.softmax(LOGITS.double() / temperature, 0))


@pytest.mark.unit
def test_top_k_keeps_the_k_most_likely_renormalised():
    probs = torch.softmax(LOGITS.double(), 0)
    probs[3:] = 0
    assert_frequencies(draw(SamplingParams(temperature=1.0, top_k=3)), probs / probs.sum())


@pytest.mark.unit
@pytest.mark.parametrize("top_p", [0.5, 0.8, 0.95])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p):
    probs = torch.softmax(LOGITS.double(), 0)
    # hand-computed nucleus: tokens in descending order until their mass reaches top_p
    keep, mass = [], 0.0
    for i in probs.argsort(descending=True).tolist():
        if mass >= top_p:
            break
        keep.append(i)
        mass += probs[i].item()
    want = torch.zeros_like(probs)
    want[keep] = probs[keep] / probs[keep].sum()
    assert_frequencies(draw(SamplingParams(temperature=1.0, top_p=top_p)), want)


@pytest.mark.unit
def test_top_k_then_top_p_combined():
    probs = torch.softmax(LOGITS.double(), 0)
    probs[4:] = 0
    probs /= probs.sum()  # top_k=4 renormalised: then top_p=0.7 keeps the first two
    assert probs[0] < 0.7 <= probs[0] + probs[1]
    want = torch.zeros_like(probs)
    want[:2] = probs[:2] / probs[:2].sum()
    assert_frequencies(draw(SamplingParams(temperature=1.0, top_k=4, top_p=0.7)), want)


@pytest.mark.unit
def test_seed_reproduces_whatever_else_is_batched():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(temperature=1.0, seed=42)
    other = SamplingParams(temperature=1.0)

    def run(sampler_seed: int, rows: list[int], params: list[SamplingParams]) -> list[int]:
        sampler = Sampler(sampler_seed)
        return [sampler.sample(logits[rows], params, [7, 8, 9][:len(rows)])[0][0] for _ in range(20)]

    alone = run(0, [0], [seeded])
    batched = run(5, [0, 1, 2], [seeded, other, other])
    assert alone == batched
    assert len(set(alone)) > 1  # it does sample, not argmax
    assert run(0, [0], [SamplingParams(temperature=1.0, seed=43)]) != alone


@pytest.mark.unit
def test_logprobs_are_raw_log_softmax_with_top_k():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.7, logprobs=0)]
    tokens, entries = Sampler().sample(logits, params, [0, 1])
    ref = torch.log_softmax(logits.double(), -1)
    for row, (token, entry) in enumerate(zip(tokens, entries)):
        assert math.isclose(entry["logprob"], ref[row, token].item(), abs_tol=1e-5)
    top = ref[0].topk(3)
    assert [t for t, _ in entries[0]["top"]] == top.indices.tolist()
    assert [lp for _, lp in entries[0]["top"]] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert entries[1]["top"] == []


@pytest.mark.unit
def test_banned_tokens_are_never_sampled():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)]
    tokens, _ = Sampler().sample(LOGITS.repeat(2, 1), params, [0, 1], banned=[[0], [0, 1, 2, 3, 4]])
    assert tokens == [1, 5]
