"""Speculative decoding with a model-free drafter: n-gram prompt lookup (vLLM's `ngram`); the
verify, accept and SpecController parts serve DeepSeek's MTP drafter too (mtp_proposer.py).

`--speculative-config '{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
"prompt_lookup_max": 5}'` (atomd.config.SpeculativeConfig). Each step:

1. Propose (`NgramProposer.propose`, numpy, the whole batch at once): for each sequence, find
   the latest earlier occurrence of its last n tokens (the longest n in [prompt_lookup_min,
   prompt_lookup_max]) and copy up to k tokens that followed it. A match closer than k
   tokens to the end repeats with the match's period (a loop of period p continues as one).
   Each sequence's token history lives in one row of a [slots, max_model_len] int32 array,
   extended by the few tokens a step accepted, so a step costs a handful of array ops over
   [batch, longest history], not a Python pass over the tokens.
2. Verify (the engine, one forward): the scheduler feeds each sequence's last token and its
   drafts; the runner returns the logits of every one of those positions (the decode kernel
   takes several query rows per sequence, causal inside them). Row j is processed and
   sampled as the non-speculative sampler would after the sequence had accepted drafts[:j]
   (`Sampler.sample(..., extra=)`: penalties, bad_words, min_tokens and seeds see those
   tokens), and `accept` keeps drafts while each equals the token sampled at its position;
   the first mismatch is replaced by that sampled token, and a full match earns the token
   after the last draft (the bonus). Greedy: the argmax, so the output is the
   non-speculative output token for token. Sampled: the sampler's inverse-CDF draw at row j
   is an exact draw X_j ~ p_j, and accepting d_j iff X_j == d_j is rejection sampling for a
   deterministic draft (q = one-hot d_j): accepted with probability p_j(d_j) = min(1, p/q),
   and on rejection X_j ~ p_j restricted to tokens != d_j, renormalised = norm(max(0, p - q)).
   The output distribution is unchanged; with a seed, whose noise depends only on (seed,
   output index), the tokens are those of the non-speculative run.
3. Roll back (the scheduler): the KV slots written for rejected drafts are past the
   sequence's computed tokens; blocks holding only such slots go back to the pool
   (`BlockManager.trim`), and prefix-cache hashes are only ever taken over accepted tokens.

`SpecController` decides how many drafts each sequence proposes: a draft row pays when the
chance it is accepted (estimated from the sequence's recent verify steps) exceeds what the
row costs relative to a step's share per sequence; the cost comes from `CostModel`, a fit of
the engine's measured step time against its scheduled tokens (a row is nearly free at batch
1 and costs a third of a token's share at batch 16 with the default model on CPU). A
sequence where no draft pays, or whose acceptance falls below MIN_ACCEPTANCE, stops
proposing for a cool-down that doubles each time it fails again, so text the n-grams do not
predict costs the lookup only. Which drafts are proposed never changes the output.
"""
from __future__ import annotations

import numpy as np

MIN_ACCEPTANCE = 0.1  # a sequence whose drafts are accepted less often stops drafting a while
EMA_DECAY = 0.7  # weight of a verify step in a sequence's acceptance estimate, per later step
PRIOR_ACCEPTED, PRIOR_REJECTIONS = 2.0, 0.5  # a new sequence (or a probe) starts at r = 0.8
PAYBACK = 1.25  # a draft row must be expected to return this multiple of what it costs
COOLDOWN_STEPS = 8  # first pause of a sequence whose drafts do not pay; doubles per relapse
MAX_COOLDOWN_STEPS = 256
_PAD = -1  # past a history's end: never equal to a token


class NgramProposer:
    """Prompt-lookup drafts for a batch of sequences, vectorised with numpy."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int,
                 max_model_len: int):
        self.k, self.min_n, self.max_n = num_speculative_tokens, prompt_lookup_min, prompt_lookup_max
        self.max_len = max_model_len + num_speculative_tokens + 1  # history plus a step's accepted tokens
        self.tokens = np.full((0, self.max_len), _PAD, dtype=np.int32)  # one history per slot
        self.synced = np.zeros(0, dtype=np.int64)  # tokens of the sequence copied in (accepted ones)
        self.slot_of: dict[int, int] = {}
        self._free: list[int] = []
        self._num_slots = 0

    def forget(self, seq_id: int) -> None:
        slot = self.slot_of.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def _slot(self, seq_id: int) -> int:
        slot = self.slot_of.get(seq_id)
        if slot is not None:
            return slot
        if self._free:
            slot = self._free.pop()
        else:
            slot, self._num_slots = self._num_slots, self._num_slots + 1
            if slot >= len(self.tokens):
                grow = max(8, len(self.tokens))
                self.tokens = np.concatenate([self.tokens, np.full((grow, self.max_len), _PAD, dtype=np.int32)])
                self.synced = np.concatenate([self.synced, np.zeros(grow, dtype=np.int64)])
        self.synced[slot] = 0  # a reused row's old tokens are overwritten before they are read
        self.slot_of[seq_id] = slot
        return slot

    def _history(self, seq_id: int, token_ids: list[int], new: list[int]) -> tuple[int, int]:
        """Bring the slot of `seq_id` up to token_ids + new; returns (slot, length)."""
        slot = self._slot(seq_id)
        row, done, n = self.tokens[slot], int(self.synced[slot]), len(token_ids)
        if done < n:
            row[done:n] = token_ids[done:]
            self.synced[slot] = n
        end = min(n + len(new), self.max_len)
        row[n:end] = new[:end - n]
        return slot, end

    def propose(self, seq_ids: list[int], token_ids: list[list[int]], new: list[list[int]],
                limits: list[int]) -> list[list[int]]:
        """Drafts for each sequence whose history is token_ids[i] + new[i] (new: tokens this
        step accepted, not yet appended by the scheduler); at most limits[i] (<= k) each."""
        out: list[list[int]] = [[] for _ in seq_ids]
        rows = [i for i, m in enumerate(limits) if m > 0]
        if not rows:
            return out
        slots, lens = zip(*(self._history(seq_ids[i], token_ids[i], new[i]) for i in rows))
        lens_a = np.array(lens, dtype=np.int64)
        width = int(lens_a.max())
        if width <= self.min_n:
            return out
        hist = self.tokens[np.array(slots), :width]  # [B, width]; past each end: stale, never read
        last = hist[np.arange(len(rows)), lens_a - 1]
        # candidates: positions e before the last token holding the last token; then count how
        # far back (up to max_n) the tokens before e equal those before the last one
        row, e = np.nonzero(hist[:, :width - 1] == last[:, None])
        keep = e < lens_a[row] - 1
        row, e = row[keep], e[keep]
        if not len(e):
            return out
        run = np.ones(len(e), dtype=np.int64)
        alive = np.ones(len(e), dtype=bool)
        for t in range(1, self.max_n):
            back, suffix = e - t, lens_a[row] - 1 - t
            alive &= (back >= 0) & (hist[row, np.maximum(back, 0)] == hist[row, np.maximum(suffix, 0)])
            run += alive
        score = np.where(run >= self.min_n, run * width + e, -1)  # the longest match, then the latest
        best_score = np.full(len(rows), -1, dtype=np.int64)
        np.maximum.at(best_score, row, score)
        found = best_score >= 0
        best = best_score % width
        period = np.maximum(lens_a - 1 - best, 1)  # tokens from the match's end to the history's end
        index = best[:, None] + 1 + np.arange(self.k)[None, :] % period[:, None]
        drafts = hist[np.arange(len(rows))[:, None], np.minimum(index, width - 1)].tolist()
        for r, i in enumerate(rows):
            if found[r]:
                out[i] = drafts[r][:limits[i]]
        return out


class CostModel:
    """What a decode step costs: t(rows) ~ a + b * rows (the step's scheduled tokens), fitted
    by least squares over the recent steps (older ones weigh less: DECAY per step)."""

    DECAY = 0.98
    WARMUP = 32  # the first steps are left out: each new row count builds its matmul kernels once

    def __init__(self) -> None:
        self.sums = (0.0, 0.0, 0.0, 0.0, 0.0)  # weight, rows, rows^2, seconds, rows * seconds
        self.a = self.b = None  # None until rows varied enough to tell them apart
        self.seen = 0

    def observe(self, rows: int, seconds: float) -> None:
        self.seen += 1
        if self.seen <= self.WARMUP:
            return
        if self.b is not None:  # a step stalled by another process must not swing the fit
            seconds = min(seconds, 2 * (self.a + self.b * rows))
        d = self.DECAY
        w, r, r2, t, rt = self.sums
        w, r, r2, t, rt = d * w + 1.0, d * r + rows, d * r2 + rows * rows, d * t + seconds, d * rt + rows * seconds
        self.sums = (w, r, r2, t, rt)
        var = r2 / w - (r / w) ** 2
        if var >= 0.25:  # rows varied (drafts or batch size): the slope is measurable
            b = (rt / w - (r / w) * (t / w)) / var
            self.b = max(b, 0.0)
            self.a = max(t / w - self.b * r / w, 1e-9)

    def threshold(self, batch: int) -> float:
        """The acceptance probability a draft row must have to pay at this batch size: a row
        costs b; an accepted token is worth a step's share per sequence, (a + b * batch) / batch,
        discounted by PAYBACK (a batch whose sequences finish at different times fills less)."""
        if self.b is None:
            return 0.0  # not measured yet: speculate, which varies the rows
        return min(PAYBACK * self.b * batch / (self.a + self.b * batch), 1.0)


class SpecController:
    """How many drafts each sequence proposes: the drafts whose chance of being accepted
    pays for their rows. A sequence's chance per draft r is estimated from its recent verify
    steps (accepted drafts / (accepted + rejections)), so draft j is accepted with r^j; the
    cost model gives the threshold. None pays: the sequence stops drafting for a cool-down
    that doubles on each relapse, then probes again."""

    def __init__(self, num_speculative_tokens: int):
        self.k = num_speculative_tokens
        self.cost = CostModel()
        self.state: dict[int, list] = {}  # seq id -> [accepted, rejections, pause, cool-down, probe]

    def limit(self, seq_id: int, batch: int) -> int:
        """Drafts to propose for this sequence in a batch of `batch` sequences (0: none)."""
        s = self.state.get(seq_id)
        if s is None:
            s = self.state[seq_id] = [PRIOR_ACCEPTED, PRIOR_REJECTIONS, 0, COOLDOWN_STEPS, True]
        if s[2] > 0:
            s[2] -= 1
            return 0
        r, threshold = s[0] / (s[0] + s[1]), self.cost.threshold(batch)
        m, p = 0, r
        while m < self.k and p > threshold:
            m, p = m + 1, p * r
        if s[4]:  # a new sequence's or a pause's first step tries one draft whatever the estimates
            s[4] = False  # say (a noisy cost fit must not stop speculation for good)
            return max(m, 1)
        if m == 0:  # not paying: pause, longer after each relapse, then probe afresh
            self._pause(s)
        return m

    def update(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        """One verify step of this sequence: num_drafts proposed, the first num_accepted kept."""
        s = self.state.get(seq_id)
        if s is None or num_drafts == 0:
            return
        s[0] = EMA_DECAY * s[0] + num_accepted
        s[1] = EMA_DECAY * s[1] + (num_accepted < num_drafts)
        r = s[0] / (s[0] + s[1])
        if r < MIN_ACCEPTANCE:  # too low whatever the cost: pause now
            self._pause(s)
        elif num_accepted and r >= 2 * MIN_ACCEPTANCE:
            s[3] = COOLDOWN_STEPS  # paying again: the next pause starts short

    @staticmethod
    def _pause(s: list[float]) -> None:
        s[:] = [PRIOR_ACCEPTED, PRIOR_REJECTIONS, s[3], min(2 * s[3], MAX_COOLDOWN_STEPS), True]

    def forget(self, seq_id: int) -> None:
        self.state.pop(seq_id, None)


def accept(tokens: list[int], drafts: list[int]) -> list[int]:
    """The tokens one sequence keeps: tokens[j] was sampled at draft position j (len(drafts) + 1
    of them); drafts are kept while they equal the sampled token, then the sampled token at
    the first mismatch, or the bonus after a full match."""
    for j, d in enumerate(drafts):
        if tokens[j] != d:
            return tokens[:j + 1]
    return tokens[:len(drafts) + 1]
