"""Sampler: logits -> one token per row, plus logprobs when asked.

Definitions (vLLM's): temperature 0 is greedy; otherwise logits / temperature, then top-k
keeps the k most likely tokens, then top-p keeps the smallest most-likely set whose
probability reaches p. Rows draw by the exponential race (argmax p_i / E_i with E_i ~
Exp(1), an exact sample of p), from a per-request generator when the request has a seed
(so its tokens do not depend on what else is batched) and from the engine's otherwise.
Logprobs are of the model's raw distribution (before temperature and truncation).
"""
from __future__ import annotations

from typing import Any

import torch

from scheduler.sequence import SamplingParams


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)
        self._seeded: dict[int, torch.Generator] = {}  # seq id -> its own generator

    def forget(self, seq_id: int) -> None:
        self._seeded.pop(seq_id, None)

    def _generator(self, seq_id: int, seed: int) -> torch.Generator:
        g = self._seeded.get(seq_id)
        if g is None:
            g = self._seeded[seq_id] = torch.Generator().manual_seed(seed)
        return g

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, params: list[SamplingParams], seq_ids: list[int],
               banned: list[list[int]] | None = None) -> tuple[list[int], list[Any] | None]:
        """Token per row and, when any row asks, its logprobs entry
        `{"logprob": lp, "top": [[id, lp], ...]}` (None for rows that did not ask).

        `banned[i]` are token ids row i may not sample (stop tokens before min_tokens)."""
        logits = logits.float()
        raw = logits
        if banned is not None and any(banned):
            logits = logits.clone()
            for i, ids in enumerate(banned):
                if ids:
                    logits[i, ids] = float("-inf")
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if p.temperature > 0]
        if random_rows:
            rows = torch.tensor(random_rows)
            sampled = self._sample_random(logits[rows], [params[i] for i in random_rows],
                                          [seq_ids[i] for i in random_rows])
            tokens[rows] = sampled
        token_list = tokens.tolist()
        if all(p.logprobs is None for p in params):
            return token_list, None
        return token_list, _logprobs(raw, tokens, params)

    def _sample_random(self, logits: torch.Tensor, params: list[SamplingParams],
                       seq_ids: list[int]) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
        logits = logits / temps
        top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
        top_p = [p.top_p for p in params]
        if any(top_k) or any(p < 1.0 for p in top_p):
            logits = apply_top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1]).exponential_(generator=self.generator)
        for i, p in enumerate(params):
            if p.seed is not None:
                noise[i].exponential_(generator=self._generator(seq_ids[i], p.seed))
        return (probs / noise).argmax(dim=-1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Logits with the tokens outside each row's top-k / top-p set at -inf (0 / 1.0 = off)."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    k = torch.tensor([kk if 0 < kk < vocab else vocab for kk in top_k]).unsqueeze(1)
    drop = ranks >= k
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    p = torch.tensor(top_p, dtype=logits.dtype).unsqueeze(1)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly more likely tokens
    drop |= (mass_before >= p) & (ranks > 0)  # the most likely token always stays
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]) -> list[Any]:
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    k_max = max(p.logprobs or 0 for p in params)
    top_vals = top_ids = None
    if k_max > 0:
        top_vals, top_ids = logprobs.topk(k_max, dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    out: list[Any] = []
    for i, p in enumerate(params):
        if p.logprobs is None:
            out.append(None)
            continue
        k = p.logprobs
        top = [[top_ids[i][j], top_vals[i][j]] for j in range(k)] if k else []
        out.append({"logprob": chosen[i], "top": top})
    return out
