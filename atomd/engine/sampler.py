"""Sampler: logits -> one token per row, plus logprobs when asked.

Each row is processed in vLLM's order (its V1 sampler), all of it batched: the Python
below only gathers indices (and folds each sequence's new tokens into its state); every
transform is one array op over the rows that use it.

0. `structured_outputs`: tokens the sequence's grammar does not allow next are dropped
   (atomd/structured.py: one bitmask row per constrained sequence; other rows untouched).
1. `allowed_token_ids`: every other token is -inf.
2. `bad_words` (token ids from the engine's tokenizer, vLLM's rule): a bad word's last
   token is -inf when its other tokens are the last tokens of the output so far.
3. `logit_bias` is added; before `min_tokens` tokens were generated, the request's
   `stop_token_ids` and (unless `ignore_eos`) the model's end tokens are -inf.
4. Penalties: `repetition_penalty` r over the prompt and output tokens (a positive logit
   is divided by r, a negative one multiplied: vLLM/HF), `frequency_penalty` f and
   `presence_penalty` p over the output tokens (logit - f * count - p * [count > 0]: OpenAI).
5. Temperature 0 is greedy: the argmax of the processed logits (so 1-4 apply to it).
6. Otherwise logits / temperature, then `min_p` (tokens with p < min_p * p_max are dropped),
   then top-k (the k most likely), then top-p (the smallest most-likely set whose
   probability reaches p), and the row draws by inverse CDF: one uniform U per row, the
   first token whose cumulative probability passes U x the row's total (an exact sample of
   p up to float32 rounding of the cumulative sum).

Logprobs are of the model's raw distribution (before any of the above), vLLM's default;
for a constrained row, of the distribution after step 0 (vLLM applies the grammar's
bitmask before its sampler too).

Seeds. A seeded row draws its uniform from a generator seeded with splitmix64(seed, i),
i = the index of the output token being drawn (`draw_seed`). Its tokens are therefore a
function of (seed, logits) alone: independent of what else is batched, of preemption, and
of where the draw happens (the decode engine of a PD pair draws token 1 exactly as a
colocated engine would). Choice i of an `n`/`best_of` request uses seed + i (vLLM's
derivation, contracts.sampling.SamplingParams.for_choice). Unseeded rows share the
engine's generator.

State per sequence (`RowState`, made at its first sample, dropped by `forget`): what its
params need, precomputed, and for the penalties and logit_bias a slot in `SparseRows`,
padded tables of token ids and values kept across steps. The penalties touch only the
tokens a sequence has seen (its prompt and output: hundreds, not the vocabulary): before
each sample its slot is brought up to date with the tokens it accepted since (any number:
speculative decoding's accepted runs too), then one gather / scatter over the batch
applies them. Only allowed_token_ids uses a dense row (it is dense by nature).

On CPU, a pass over a [batch, vocab] tensor that is not in cache costs ~50-100 us at batch
16 x 4096, and torch's comparisons, `where` and `masked_fill` over it cost 10-30x an
arithmetic op: hence the sparse state (applied with numpy on a view of the logits, one
fancy index per table), min_p as one shift and `threshold` (dropped tokens get -1e30,
which softmax turns into exactly 0), and one uniform per row (inverse CDF) rather than one
per token (the exponential race: `rand` over the whole [rows, vocab] tensor, a log, a divide
and an argmax; 4x the inverse CDF's cost, 3.8 vs 0.9 ms at 16 x 49152 on one thread).
benchmarks/sampling.py measures the cost per decode step.
"""
from __future__ import annotations

import math
from typing import Any, Sequence as Seq

import numpy as np
import torch

from atomd.structured import GrammarCompiler, apply_bitmask, apply_bitmask_at, bitmask_kernel
from contracts.sampling import SamplingParams
from scheduler.sequence import Sequence
from contracts.logprobs import Logprob

_MASK64 = (1 << 64) - 1
NEG_INF = float("-inf")
DROPPED = -1e30  # a dropped token's logit: exp() of it is 0, like -inf, without bool ops


def draw_seed(seed: int, index: int) -> int:
    """The generator seed of output token `index` of a row seeded `seed` (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + index) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uses_penalties(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


class SparseRows:
    """Per-slot rows of (token id, value) pairs, numpy, padded to a common width: ids
    [slots, width] (int64, -1 past a slot's `length`) and vals [slots, width] (float32, 0
    past it). Written one entry at a time as tokens are accepted (no torch op), read for a
    batch with one fancy index."""

    def __init__(self) -> None:
        self.ids = np.full((0, 0), -1, dtype=np.int64)
        self.vals = np.zeros((0, 0), dtype=np.float32)
        self.length = np.zeros(0, dtype=np.int64)

    def reserve(self, slots: int, width: int) -> None:
        old_slots, old_width = self.ids.shape
        if slots <= old_slots and width <= old_width:
            return
        new_slots = old_slots if slots <= old_slots else max(slots, 2 * old_slots, 8)
        new_width = old_width if width <= old_width else max(width, 2 * old_width, 8)
        ids = np.full((new_slots, new_width), -1, dtype=np.int64)
        vals = np.zeros((new_slots, new_width), dtype=np.float32)
        ids[:old_slots, :old_width], vals[:old_slots, :old_width] = self.ids, self.vals
        self.ids, self.vals = ids, vals
        self.length = np.concatenate([self.length, np.zeros(new_slots - old_slots, dtype=np.int64)])

    def reset(self, slot: int, ids: list[int], vals: list[float] | None = None) -> None:
        self.reserve(slot + 1, len(ids))
        self.length[slot] = len(ids)
        self.ids[slot] = -1
        self.vals[slot] = 0.0
        self.ids[slot, :len(ids)] = ids
        if vals is not None:
            self.vals[slot, :len(ids)] = vals

    def set(self, slot: int, column: int, token: int, value: float = 0.0) -> None:
        if column >= self.ids.shape[1]:
            self.reserve(self.ids.shape[0], column + 1)
        self.ids[slot, column] = token
        self.vals[slot, column] = value
        if column >= self.length[slot]:
            self.length[slot] = column + 1

    def flat_index(self, slots: np.ndarray, rows: np.ndarray, vocab: int, dummy: int) -> tuple[np.ndarray, np.ndarray]:
        """Indices into the flattened [rows, vocab] logits of every entry of `slots` (one per
        row), padding -> `dummy`; and the entries' values. Both [len(rows), width]."""
        width = int(self.length[slots].max())
        ids = self.ids[slots, :width]
        return np.where(ids < 0, dummy, ids + (rows * vocab)[:, None]), self.vals[slots, :width]


class RowState:
    """What the sampler keeps for one sequence."""

    __slots__ = ("slot", "trivial", "allowed", "penalized", "biased", "r", "f", "p", "synced", "seen", "counts",
                 "columns", "grammar")

    def __init__(self, p: SamplingParams):
        self.slot = -1  # in the SparseRows tables, when penalized or biased
        self.penalized = uses_penalties(p)
        self.biased = bool(p.logit_bias)
        self.allowed: torch.Tensor | None = None  # dense: 0 where allowed, -inf elsewhere
        self.trivial = not (self.penalized or self.biased or p.allowed_token_ids is not None
                            or p.bad_words_token_ids or p.min_tokens)
        self.r, self.f, self.p = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
        self.synced = 0  # output tokens folded into the tables
        self.seen: set[int] = set()  # prompt and output tokens (repetition penalty)
        self.counts: dict[int, int] = {}  # output token -> count (frequency / presence)
        self.columns: dict[int, int] = {}  # output token -> its column in the counts table
        self.grammar = None  # structured outputs: its GrammarMatcher (atomd/structured.py)


class Sampler:
    def __init__(self, seed: int = 0, end_token_ids: Seq[int] = (), grammars: GrammarCompiler | None = None):
        """`end_token_ids`: the model's EOS and extra stop tokens (banned before min_tokens).
        `grammars`: compiles structured outputs (None: a request asking for them is refused)."""
        self.grammars = grammars
        self.generator = torch.Generator().manual_seed(seed)
        self._draw = torch.Generator()  # reseeded for every seeded draw
        self.end_token_ids = list(end_token_ids)
        self.rows: dict[int, RowState] = {}  # seq id -> its state
        self.seen = SparseRows()  # repetition penalty: prompt and output token ids
        self.counts = SparseRows()  # frequency / presence: output token ids, f * count + p
        self.bias = SparseRows()  # logit_bias
        self._free: list[int] = []
        self._num_slots = 0
        self._bitmask: np.ndarray | None = None  # structured outputs: the rows' masks (_bitmask_rows)
        self._bitmask_base = 0

    def forget(self, seq_id: int) -> None:
        """The sequence finished: free its state."""
        row = self.rows.pop(seq_id, None)
        if row is not None and row.slot >= 0:
            self._free.append(row.slot)

    @property
    def num_slots_in_use(self) -> int:
        return self._num_slots - len(self._free)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence],
               params: list[SamplingParams] | None = None,
               extra: list[list[int]] | None = None) -> tuple[list[int], list[Logprob | None] | None]:
        """Token per row and, when any row asks, its logprobs entry (None for rows that did
        not ask).

        Row i samples for `seqs[i]` with `params[i]` (default: the sequence's own); a
        sequence about to fork appears once per choice, with that choice's params. Rows
        ranking best_of candidates get an entry (with an empty top) even without logprobs.
        `extra[i]` (speculative decoding): tokens row i's sequence is taken to have accepted
        after its own (the drafts before that row's position); the row is processed and drawn
        exactly as it would be once they were appended (penalties, bad_words, min_tokens, the
        seed's output index). A sequence may appear in several rows."""
        if params is None:
            params = [s.sampling_params for s in seqs]
        raw = logits.float()
        if self.grammars is not None and any(p.structured_outputs is not None for p in params):
            raw = self._mask_grammars(raw, logits, seqs, params, extra)
        logits = self.process_logits(raw, seqs, params, extra)
        random_rows = [i for i, p in enumerate(params) if p.temperature > 0]
        if len(random_rows) == len(params):
            tokens = self._sample_random(logits, seqs, params, extra)
        else:
            # the first largest, as argmax (ties, NaN alike): torch's CPU argmax takes ~3x as long (3.6 vs 1.2 ms
            # at 16 x 151936, Qwen3's vocabulary: ~3% of a batch-16 decode step; RESULTS.md #34 s34h)
            tokens = logits.max(dim=-1).indices
            if random_rows:
                rows = torch.tensor(random_rows)
                tokens[rows] = self._sample_random(logits[rows], [seqs[i] for i in random_rows],
                                                   [params[i] for i in random_rows],
                                                   [extra[i] for i in random_rows] if extra else None)
        token_list = tokens.tolist()
        if all(p.logprobs is None and not p.ranked for p in params):
            return token_list, None
        return token_list, _logprobs(raw, tokens, params)

    def _row(self, seq: Sequence, p: SamplingParams, vocab: int) -> RowState:
        if p.structured_outputs is not None and self.grammars is None:
            raise ValueError("structured_outputs: this sampler has no grammar compiler")
        row = self.rows[seq.id] = RowState(p)
        if p.structured_outputs is not None:  # replays the sequence's tokens at its first mask
            row.grammar = self.grammars.matcher(p.structured_outputs)
        if p.allowed_token_ids is not None:
            row.allowed = torch.full((vocab,), NEG_INF)
            row.allowed[torch.tensor(p.allowed_token_ids)] = 0.0
        if row.penalized or row.biased:
            if self._free:
                row.slot = self._free.pop()
            else:
                row.slot, self._num_slots = self._num_slots, self._num_slots + 1
            if row.r != 1.0:
                row.seen.update(seq.prompt_token_ids)
            self.seen.reset(row.slot, sorted(row.seen))
            self.counts.reset(row.slot, [])
            self.bias.reset(row.slot, list(p.logit_bias or ()), list((p.logit_bias or {}).values()))
        return row

    def _mask_grammars(self, raw: torch.Tensor, logits: torch.Tensor, seqs: list[Sequence],
                       params: list[SamplingParams], extra: list[list[int]] | None) -> torch.Tensor:
        """Step 0, structured outputs: in the rows of sequences with a grammar, every token the
        grammar does not allow next is dropped (~-1e30, probability exactly 0; before the
        other steps, so logprobs are of the constrained distribution, as in vLLM). Each
        matcher first takes the tokens its sequence accepted since (its own samples, a
        fork's first token, P's T0 on a decode engine); a row with `extra` tokens gets the
        mask after them (only the end tokens where they break the grammar: such a draft is
        rejected anyway). Other rows are untouched."""
        vocab = raw.shape[1]
        rows: list[int] = []
        grammars = []
        for i, seq in enumerate(seqs):
            row = self.rows.get(seq.id)
            if row is None:
                row = self._row(seq, params[i], vocab)
            if row.grammar is not None:
                rows.append(i)
                grammars.append(row.grammar)
        if not rows:
            return raw
        bitmask, base = self._bitmask_rows(len(rows))
        stride = bitmask.strides[0]
        filled: dict[int, int] = {}  # seq id -> its bitmask row (a forking sequence repeats)
        for j, (i, grammar) in enumerate(zip(rows, grammars)):
            seq = seqs[i]
            grammar.sync(seq.token_ids, seq.num_prompt_tokens)
            ext = extra[i] if extra is not None else None
            if ext:
                grammar.fill_after(ext, bitmask[j])
            elif seq.id in filled:
                bitmask[j] = bitmask[filled[seq.id]]
            else:
                grammar.fill_at(bitmask, j, base + j * stride)
                filled[seq.id] = j
        out = torch.empty_like(raw) if raw is logits else raw  # the caller's logits stay as they were
        kernel = bitmask_kernel()
        if kernel is not None and raw.stride(1) == out.stride(1) == 1:
            apply_bitmask_at(kernel, raw.data_ptr(), raw.stride(0), out.data_ptr(), out.stride(0), base,
                             stride // 4, rows, raw.shape[0], vocab)
        else:
            apply_bitmask(raw.numpy(), rows, bitmask[:len(rows)], out=out.numpy(), kernel=False)
        return out

    def _bitmask_rows(self, n: int) -> tuple[np.ndarray, int]:
        """The sampler's bitmask buffer, at least n rows, and its data pointer. Reused from
        step to step without zeroing: every row a step uses is written whole first (llguidance
        writes every word of a row it fills; the end mask and a repeated row are copies)."""
        if self._bitmask is None or len(self._bitmask) < n:
            grown = 2 * len(self._bitmask) if self._bitmask is not None else 16
            self._bitmask = self.grammars.new_bitmask(max(n, grown))
            self._bitmask_base = self._bitmask.ctypes.data
        return self._bitmask, self._bitmask_base

    def _sync(self, seq: Sequence, row: RowState) -> None:
        """Fold the tokens `seq` accepted since its last sample into its slot."""
        new = seq.token_ids[seq.num_prompt_tokens + row.synced:]
        row.synced += len(new)
        slot = row.slot
        for t in new:
            if row.r != 1.0 and t not in row.seen:
                row.seen.add(t)
                self.seen.set(slot, int(self.seen.length[slot]), t)
            if row.f or row.p:
                count = row.counts[t] = row.counts.get(t, 0) + 1
                column = row.columns.get(t)
                if column is None:
                    column = row.columns[t] = int(self.counts.length[slot])
                self.counts.set(slot, column, t, row.f * count + row.p)

    def process_logits(self, logits: torch.Tensor, seqs: list[Sequence],
                       params: list[SamplingParams] | None = None,
                       extra: list[list[int]] | None = None) -> torch.Tensor:
        """Steps 1-4 of the module docstring (float32 logits in; the same tensor when no
        row uses any of them, else a new one). `extra`: see `sample`."""
        if params is None:
            params = [s.sampling_params for s in seqs]
        num_rows, vocab = logits.shape
        allowed_rows, allowed, banned = [], [], []
        pen_rows, pen_slots, rep, bias_rows, bias_slots = [], [], [], [], []
        pen_extra: list[tuple[int, RowState, SamplingParams, list[int]]] = []
        rows = self.rows
        for i, seq in enumerate(seqs):
            row = rows.get(seq.id)
            if row is None:
                row = self._row(seq, params[i], vocab)
            if row.trivial:
                continue
            p = params[i]
            ext = extra[i] if extra is not None else None
            if row.allowed is not None:
                allowed_rows.append(i)
                allowed.append(row.allowed)
            num_out = len(seq.token_ids) - seq.num_prompt_tokens
            if p.bad_words_token_ids:
                banned += [i * vocab + t for t in _bad_word_bans(
                    p.bad_words_token_ids, seq.token_ids + ext if ext else seq.token_ids,
                    num_out + len(ext) if ext else num_out)]
            if ext:  # the syncs below fold only the accepted tokens: ext is added on top
                if row.penalized:
                    pen_extra.append((i, row, p, ext))
                num_out += len(ext)
            if num_out < p.min_tokens:
                banned += [i * vocab + t for t in p.stop_token_ids]
                if not p.ignore_eos:
                    banned += [i * vocab + t for t in self.end_token_ids]
            if row.biased:
                bias_rows.append(i)
                bias_slots.append(row.slot)
            if row.penalized:
                if row.synced < seq.num_completion_tokens:
                    self._sync(seq, row)
                pen_rows.append(i)
                pen_slots.append(row.slot)
                rep.append(row.r)
        if not (allowed_rows or banned or bias_rows or pen_rows):
            return logits
        dummy = num_rows * vocab  # padding entries land on one extra element past the logits
        buf = torch.empty(dummy + 1)
        out = buf[:dummy].view(num_rows, vocab)
        out.copy_(logits)
        flat = buf.numpy()
        flat[dummy] = 0.0
        if allowed_rows:  # 1. allowed_token_ids
            if len(allowed_rows) == num_rows:
                out.add_(torch.stack(allowed))
            else:
                index = torch.tensor(allowed_rows)
                out[index] = out[index] + torch.stack(allowed)
        if bias_rows:  # 3. logit_bias (the bans of 2 and 3 are -inf: their order does not matter)
            at, vals = self.bias.flat_index(np.array(bias_slots), np.array(bias_rows), vocab, dummy)
            flat[at] += vals
        if banned:  # 2. bad_words, 3. min_tokens
            flat[banned] = NEG_INF
        if pen_rows:  # 4. penalties: repetition over the seen tokens, then frequency / presence
            slots, prows = np.array(pen_slots), np.array(pen_rows)
            if any(r != 1.0 for r in rep):
                at, _ = self.seen.flat_index(slots, prows, vocab, dummy)
                r = np.array(rep, dtype=np.float32)[:, None]
                x = flat[at]
                flat[at] = np.where(x > 0, x / r, x * r)  # stays -inf where it was
            at, vals = self.counts.flat_index(slots, prows, vocab, dummy)
            flat[at] -= vals
        if pen_extra:
            self._penalize_extra(flat, logits.numpy(), vocab, pen_extra)
        return out

    @staticmethod
    def _penalize_extra(flat: np.ndarray, raw: np.ndarray, vocab: int,
                        items: list[tuple[int, "RowState", SamplingParams, list[int]]]) -> None:
        """Rows whose sequence is taken to have accepted `ext` more tokens: each of those
        tokens' processed logit is recomputed from the raw one with the counts that include
        them, in the same float32 operations as steps 3-4, so the row equals the one the
        sampler would process once they were appended. A banned token stays -inf."""
        f32 = np.float32
        for i, row, p, ext in items:
            for t in set(ext):
                at = i * vocab + t
                if flat[at] == NEG_INF:
                    continue
                x = f32(raw[i, t])
                if row.biased and t in p.logit_bias:
                    x = f32(x + f32(p.logit_bias[t]))
                if row.r != 1.0:  # t is now seen
                    r = f32(row.r)
                    x = f32(x / r) if x > 0 else f32(x * r)
                if row.f or row.p:
                    x = f32(x - f32(row.f * (row.counts.get(t, 0) + ext.count(t)) + row.p))
                flat[at] = x

    def _sample_random(self, logits: torch.Tensor, seqs: list[Sequence],
                       params: list[SamplingParams], extra: list[list[int]] | None = None) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
        logits = logits / temps
        min_p_rows = [i for i, p in enumerate(params) if p.min_p > 0]
        if min_p_rows:  # p < min_p * p_max  <=>  logit < max logit + log(min_p): shifted to < 0, dropped
            log_min_p = torch.tensor([math.log(params[i].min_p) for i in min_p_rows]).unsqueeze(1)
            whole = len(min_p_rows) == len(params)
            index = None if whole else torch.tensor(min_p_rows)
            sub = logits if whole else logits[index]
            sub = torch.threshold(sub - sub.amax(dim=-1, keepdim=True).add_(log_min_p), -1e-6, DROPPED)
            if whole:
                logits = sub
            else:
                logits[index] = sub
        top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
        top_p = [p.top_p for p in params]
        if any(top_k) or any(p < 1.0 for p in top_p):
            logits = apply_top_k_top_p(logits, top_k, top_p)
        return self._draw_from(logits.softmax(dim=-1), seqs, params, extra)

    def _draw_from(self, probs: torch.Tensor, seqs: list[Sequence], params: list[SamplingParams],
                   extra: list[list[int]] | None) -> torch.Tensor:
        """One token per row of `probs` by inverse CDF (the module docstring's step 6)."""
        cdf = probs.cumsum_(dim=-1)
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        if not seeded:
            u = torch.rand(len(params), 1, generator=self.generator)
        else:
            u = torch.empty(len(params), 1)
            if len(seeded) < len(params):
                unseeded = [i for i, p in enumerate(params) if p.seed is None]
                u[unseeded] = torch.rand(len(unseeded), 1, generator=self.generator)
            for i in seeded:
                index = len(seqs[i].token_ids) - seqs[i].num_prompt_tokens + (len(extra[i]) if extra else 0)
                self._draw.manual_seed(draw_seed(params[i].seed, index))
                torch.rand(1, generator=self._draw, out=u[i])
        # inverse CDF: the first token whose cumulative probability passes U x total (right=True
        # skips tokens of probability 0; total, not 1, absorbs the cumsum's rounding)
        return torch.searchsorted(cdf, u.mul_(cdf[:, -1:]), right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)


def _bad_word_bans(bad_words: list[list[int]], token_ids: list[int], num_out: int) -> list[int]:
    """The last token of each bad word whose other tokens end the output so far (vLLM)."""
    out = []
    for word in bad_words:
        prefix = len(word) - 1
        if prefix > num_out:
            continue
        if prefix == 0 or token_ids[len(token_ids) - prefix:] == word[:-1]:
            out.append(word[-1])
    return out


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Logits with the tokens outside each row's top-k / top-p set at -inf (0 / 1.0 = off)."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    k = torch.tensor([kk if 0 < kk < vocab else vocab for kk in top_k]).unsqueeze(1)
    drop = ranks >= k
    sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
    p = torch.tensor(top_p, dtype=logits.dtype).unsqueeze(1)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly more likely tokens
    drop |= (mass_before >= p) & (ranks > 0)  # the most likely token always stays
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, NEG_INF))


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]) -> list[Logprob | None]:
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    k_max = max(p.logprobs or 0 for p in params)
    top_vals = top_ids = None
    if k_max > 0:
        top_vals, top_ids = logprobs.topk(k_max, dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    out: list[Logprob | None] = []
    for i, p in enumerate(params):
        if p.logprobs is None and not p.ranked:
            out.append(None)
            continue
        k = p.logprobs or 0
        top = [(top_ids[i][j], top_vals[i][j]) for j in range(k)] if k else []
        out.append(Logprob(chosen[i], top))
    return out


def prompt_logprobs(logits: torch.Tensor, next_ids: list[int], k: int) -> list[Logprob]:
    """Entries for prompt tokens `next_ids`, logits row j predicting next_ids[j], with their
    rank and k top entries."""
    logprobs = logits.float().log_softmax(dim=-1)
    target = torch.tensor(next_ids)
    chosen = logprobs.gather(1, target.unsqueeze(1))
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    chosen = chosen.squeeze(1).tolist()
    top_vals = top_ids = None
    if k > 0:
        top_vals, top_ids = logprobs.topk(k, dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    return [Logprob(chosen[j], [(top_ids[j][m], top_vals[j][m]) for m in range(k)] if k else [], ranks[j])
            for j in range(len(next_ids))]
