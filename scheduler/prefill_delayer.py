"""PrefillDelayer: keep the prefills of data-parallel ranks in step.

With DP attention every rank runs each forward together, so one rank prefilling while
the others decode makes every rank wait for the slowest. Each tick, every rank calls
`should_allow_prefill` (before any early return in `schedule()`), which does exactly one
SUM all-reduce of a small int64 vector; every rank then derives the same decision from
the same sums and the same tick counters, so the ranks never diverge.

Policies:
- `align` (SGLang's semantics): all ranks ready -> allow; none prefillable -> allow
  (vacuous); mixed -> hold up to `max_delay_passes` ticks, released early when a
  prefillable rank's KV usage is under `token_usage_low_watermark`.
- `coalesce` (Nagle-style): hold prefills to gather a fuller batch and fire when the
  pending tokens reach `target_fill` of the ranks' budget, a rank's KV usage crosses a
  watermark (high: the batch cannot grow; low: the rank is starving), no rank decodes,
  a hold lasts `ttft_max_ticks` (or `partial_max_ticks` with a chunked prefill in flight),
  the pending tokens stop growing for `stall_ticks`, or a rank's queue has been
  prefillable for `queue_max_ticks`.

The aligned tick's budget (`aligned_tokens` > 0): a tick in which k >= 2 ranks prefill
together gives each of them `aligned_share()` = aligned_tokens // k prompt tokens, so the
tick's expert work is one budget's, not k ranks' whole queues (the prompts a hold gathered);
what a rank could not fit continues at that share in its next ticks, held or not (the
scheduler's aligned leftover). A rank counts as prefilling in a tick when it is alignment-ready
(`local_alignment_ready`: new prompts or a leftover), so k is the same on every rank. A rank
released alone (max delay, the valve, coalesce firing for it) gets aligned_tokens // world_size
and goes on as a leftover too, not held again between its chunks.

Time is counted in ticks (calls), never in per-rank wall clock, which would diverge.
A failing collective fails open (allow) and is counted. Every decision increments
`outcomes[(policy, outcome, reason)]`.
"""
from __future__ import annotations

import abc
import logging
from collections import defaultdict

import numpy as np

logger = logging.getLogger("atomd.prefill_delayer")

POLICIES = ("align", "coalesce")
# a lone release's aligned share (aligned_share()); False: the rank's own budget, as before
# (benchmarks/delayer_virtual_clock.py's `-own` modes: the A/B switch)
RELEASE_SHARE = True


class Collective(abc.ABC):
    """The DP group, as far as the delayer needs it."""

    world_size: int

    @abc.abstractmethod
    def all_reduce_sum(self, vec: np.ndarray) -> np.ndarray:
        """Element-wise sum of `vec` (int64) over all ranks; every rank gets the result."""


class SingleRank(Collective):
    """No data parallelism: the sum over one rank is the vector itself."""

    world_size = 1

    def all_reduce_sum(self, vec: np.ndarray) -> np.ndarray:
        return np.asarray(vec, dtype=np.int64).copy()


# The knobs, each an EngineConfig field `prefill_delayer_<knob>` (atomd/config.py holds the defaults)
DELAYER_KNOBS = ("max_delay_passes", "token_usage_low_watermark", "target_fill", "kv_high_watermark",
                 "kv_low_watermark", "ttft_max_ticks", "partial_max_ticks", "stall_ticks",
                 "queue_max_ticks", "aligned_tokens")


class PrefillDelayer:
    def __init__(self, collective: Collective, policy: str, *, max_delay_passes: int,
                 token_usage_low_watermark: float | None, max_num_batched_tokens: int, target_fill: float,
                 kv_high_watermark: float, kv_low_watermark: float, ttft_max_ticks: int,
                 partial_max_ticks: int, stall_ticks: int, queue_max_ticks: int, aligned_tokens: int):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if aligned_tokens < 0:
            raise ValueError(f"aligned_tokens must be >= 0 (0: off), got {aligned_tokens}")
        self.collective = collective
        self.policy = policy
        self.max_delay_passes = max_delay_passes
        self.token_usage_low_watermark = token_usage_low_watermark
        self.fill_tokens = target_fill * max_num_batched_tokens * collective.world_size
        self.kv_high_watermark, self.kv_low_watermark = kv_high_watermark, kv_low_watermark
        self.ttft_max_ticks, self.partial_max_ticks = ttft_max_ticks, partial_max_ticks
        self.stall_ticks, self.queue_max_ticks = stall_ticks, queue_max_ticks
        self.aligned_tokens = aligned_tokens
        self.num_ready = 0  # the last tick: ranks alignment-ready (they prefill if it allows)
        self.allowed = True  # the last tick's decision
        self.reason = "none"  # and its reason
        self.outcomes: dict[tuple[str, str, str], int] = defaultdict(int)
        self.num_collective_errors = 0
        self._held = 0  # consecutive ticks prefills were held (same on every rank)
        self._stalled = 0  # consecutive held ticks without more pending tokens
        self._last_pending = 0
        self._local_ready_ticks = 0  # this rank: consecutive ticks with something to prefill

    def should_allow_prefill(self, local_prefillable: bool, token_usage: float,
                             local_alignment_ready: bool | None = None, *, pending_tokens: int = 0,
                             num_decodes: int = 0, has_partial: bool = False) -> bool:
        ready = local_prefillable if local_alignment_ready is None else local_alignment_ready
        self._local_ready_ticks = self._local_ready_ticks + 1 if local_prefillable else 0
        if self.policy == "align":
            vec = [ready, local_prefillable, local_prefillable and self._under_low_watermark(token_usage)]
        else:
            vec = [local_prefillable, pending_tokens, num_decodes,
                   local_prefillable and token_usage >= self.kv_high_watermark,
                   local_prefillable and token_usage < self.kv_low_watermark,
                   has_partial, self._local_ready_ticks >= self.queue_max_ticks, ready]
        try:
            sums = self.collective.all_reduce_sum(np.asarray(vec, dtype=np.int64))
        except Exception as exc:  # a broken group must not stall the engine: fail open
            self.num_collective_errors += 1
            logger.warning("prefill delayer collective failed, allowing prefill: %s", exc)
            self.num_ready = 0  # unknown: no aligned share
            return self._decide(True, "collective_error")
        sums = [int(x) for x in sums]
        self.num_ready = sums[0] if self.policy == "align" else sums.pop()
        if self.policy == "align":
            return self._decide(*self._align(*sums))
        return self._decide(*self._coalesce(*sums))

    def aligned_share(self) -> int:
        """Prompt tokens this rank's step may carry in the tick just decided: aligned_tokens
        split between the k >= 2 ranks that prefill together in it; a release of one rank alone
        (max delay, the valve, coalesce firing for one rank) gets a share as if every rank
        prefilled with it, aligned_tokens // world_size, so it goes on as a leftover, unheld
        and at the size of an aligned tick's chunk; 0 (the rank's own budget) when the delayer
        held, allowed with nothing to prefill ("none") or failed open, or aligned_tokens is 0."""
        if not self.aligned_tokens or not self.allowed or self.num_ready < 1:
            return 0
        if self.num_ready == 1:
            if self.reason in ("none", "collective_error") or not RELEASE_SHARE:
                return 0
            return max(1, self.aligned_tokens // self.collective.world_size)
        return max(1, self.aligned_tokens // self.num_ready)

    def _under_low_watermark(self, token_usage: float) -> bool:
        return self.token_usage_low_watermark is not None and token_usage < self.token_usage_low_watermark

    def _align(self, num_ready: int, num_prefillable: int, num_released: int) -> tuple[bool, str]:
        if num_prefillable == 0:
            return True, "none"
        if num_ready == self.collective.world_size:
            return True, "all"
        if num_released > 0:
            return True, "low_watermark"
        if self._held >= self.max_delay_passes:
            return True, "max_delay"
        return False, "mixed"

    def _coalesce(self, num_prefillable: int, pending: int, decodes: int, kv_high: int, kv_low: int,
                  partial: int, queue_hot: int) -> tuple[bool, str]:
        if num_prefillable == 0:
            return True, "none"
        self._stalled = self._stalled + 1 if self._held and pending <= self._last_pending else 0
        self._last_pending = pending
        if decodes == 0:
            return True, "idle"
        if pending >= self.fill_tokens:
            return True, "fill"
        if kv_high or kv_low:
            return True, "kv"
        if partial and self._held >= self.partial_max_ticks:
            return True, "partial"
        if self._held >= self.ttft_max_ticks:
            return True, "ttft"
        if queue_hot:
            return True, "queue"
        if self._stalled >= self.stall_ticks:
            return True, "stall"
        return False, "coalescing"

    def _decide(self, allow: bool, reason: str) -> bool:
        self.outcomes[(self.policy, "allow" if allow else "delay", reason)] += 1
        self.allowed, self.reason = allow, reason
        if allow:
            self._held = self._stalled = 0
        else:
            self._held += 1
        return allow
