"""The scheduler of one engine: which sequences run in the next forward, and what came out.

Queues: `waiting` (FIFO, preempted sequences back to its front; with the priority policy
ordered by (priority, arrival) instead), `running` (admitted, oldest first; with the priority
policy sorted most urgent first before each decode step, so the least urgent is preempted), `parked` (consumer side: blocks allocated, prompt KV being pulled) and
`deferred_free_blocks` (producer side: finished, blocks pinned until the consumer has
pulled them). A sequence is in exactly one of them until it finishes.

Each `schedule()` returns one kind of batch (the seed's semantics):

- prefill: Phase 1 resumes chunked prefills (`_prefilling`, admission order), Phase 2
  admits from `waiting` FIFO and stops at the first sequence that does not fit. A sequence
  the admission gate holds back (its LoRA adapter not resident yet) keeps its place while
  the ones behind it are admitted. A chunk
  cut by the token budget ends on a block boundary, so a 16384-token budget never
  leaves a 10-token sliver; only an otherwise empty batch takes an unaligned chunk.
- decode, when nothing prefills: every decode-ready running sequence schedules its last
  token (plus its drafts with speculative decoding). A sequence that cannot get a block
  preempts the newest running sequence (recompute: blocks freed, tokens kept).
- protected streams (`max_local_prefill_tokens_per_step` or `max_local_prefill_ms_per_step`
  > 0, chunked prefill): while decode-ready sequences run, a prefill step carries at most
  that many prompt tokens (or what fits in that many ms at the measured cost per prompt
  token) and the next step is a decode step, so a running stream waits at most one capped
  chunk between two of its tokens (a decode engine prefilling a prompt locally).
- mixed steps (`enable_mixed_chunk`, SGLang's `--enable-mixed-chunk`; off by default, where
  the seed's one-kind batches hold): every decode-ready sequence's next token goes first, then
  the prefill chunks in what is left of the token budget, all in one prefill batch (a decode
  row is a one-token chunk whose context is cached). A prefill step then costs the running
  streams no tick: under expert parallelism, where every rank steps with the slowest, a rank
  prefilling no longer stops its own decodes, and an aligned prefill no longer stops them on
  every rank (benchmarks/RESULTS.md, "#36 mixed steps").
- an aligned tick's share (the PrefillDelayer's `aligned_share()`, `--prefill-delayer-aligned-tokens`):
  a step in which several DP ranks prefill carries at most that many prompt tokens; the prompts
  then in flight (the aligned leftover) go on at that share in the next steps, on a held tick
  alone (nothing admitted), until none is left.

Invariant of a decode-ready sequence: `num_computed_tokens == num_tokens - 1`; the KV of
every token but the last is computed, and the last is the next one to forward.

Forks (n / best_of): a sequence with `num_forks > 0` is one sequence, one seat per
pending fork reserved against `max_num_seqs`, until the step that samples its first token.
The runner then samples `num_forks + 1` tokens from its row (`fork_token_ids`) and
`postprocess` forks it: each new choice shares the parent's blocks (the block manager
copies a shared block on write) and runs, stops, is preempted or aborted on its own.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Callable

import msgspec
import numpy as np

from kv_transfer.connector import KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler
from scheduler.block_manager import BlockManager
from contracts.errors import ErrorCode
from scheduler.sequence import Sequence, SequenceStatus, SequenceType
from scheduler.stop import find_stop_string
from scheduler.stats import CacheStats, SpecStats
from contracts.logprobs import Logprob

logger = logging.getLogger("atomd.scheduler")

_now = time.time  # one clock for arrival times and the delay factor (patched in tests)
_STOP_WINDOW_SLACK = 4  # extra tail tokens detokenized when looking for a stop string


class SchedulerConfig(msgspec.Struct, kw_only=True):
    """The engine passes every value (atomd.config.EngineConfig holds the defaults); only
    what the engine does not configure has a default here."""

    num_kvcache_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    scheduler_delay_factor: float
    long_prefill_token_threshold: int  # 0: off; else the largest chunk one sequence gets
    eos_token_id: int | None = None
    stop_token_ids: list[int] = []  # the model's extra end tokens: treated like EOS
    # speculative decoding (the engine's drafter, atomd/engine/spec_decode.py, proposes them): drafts
    # scheduled after each sequence's last token, the accepted ones appended, the blocks of
    # rejected ones returned; 0: off
    num_speculative_tokens: int = 0
    # log BlockStored/BlockRemoved for take_events(); the engine publishes them with
    # --kv-events-endpoint (atomd/engine/kv_events.py)
    enable_kv_events: bool = False
    # protect running streams from local prefills: while decode-ready sequences run, a prefill
    # step carries at most this many prompt tokens and is followed by a decode step (0: off;
    # only with chunked prefill). A remote prefill's KV arrives by pull, so it is not capped.
    max_local_prefill_tokens_per_step: int = 0
    # the same protection in time: a capped prefill step carries the prompt tokens that fit in
    # this many milliseconds at the engine's measured prefill cost (observe_prefill_step; with
    # the token cap too, the smaller; 0: off). One cap value then fits any model and dtype.
    max_local_prefill_ms_per_step: float = 0.0
    # the model's sliding window when every layer has one (the largest): a running sequence's
    # blocks wholly before it are returned to the pool (BlockManager.release_outside_window);
    # None: a model with a global layer, which reads every block to the end
    kv_window: int | None = None
    # fcfs | priority (atomd.config.SCHEDULING_POLICIES): see `Scheduler._enqueue`
    scheduling_policy: str = "fcfs"
    # mixed steps: the running streams' decode tokens ride in every prefill step (the module
    # docstring); not with speculative decoding (a decode row would carry drafts to verify)
    enable_mixed_chunk: bool = False

    def __post_init__(self) -> None:
        for name in ("num_kvcache_blocks", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("scheduler_delay_factor", "num_speculative_tokens",
                     "long_prefill_token_threshold", "max_local_prefill_tokens_per_step",
                     "max_local_prefill_ms_per_step"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.enable_mixed_chunk and self.num_speculative_tokens:
            raise ValueError("enable_mixed_chunk does not run with speculative decoding")
        if self.max_num_batched_tokens < self.num_speculative_tokens + 1:
            raise ValueError(f"max_num_batched_tokens must be >= num_speculative_tokens + 1 "
                             f"= {self.num_speculative_tokens + 1}, got {self.max_num_batched_tokens}")


class ScheduledBatch:
    """One forward's worth of work, packed for the model runner.

    For decode rows the packed `token_ids` hold the last token then the drafts
    (`spec_token_ids[i]`); `num_computed_tokens[i]` is the position of the first one.
    An empty batch (no seqs) only carries `connector_meta` for the worker side.
    """

    __slots__ = ("seqs", "is_prefill", "num_scheduled_tokens", "num_computed_tokens",
                 "token_ids", "block_tables", "needs_sample", "connector_meta", "spec_token_ids",
                 "block_copies")

    def __init__(self, *, seqs: list[Sequence], is_prefill: bool, num_scheduled_tokens: list[int],
                 num_computed_tokens: list[int], token_ids: list[int], needs_sample: list[bool],
                 spec_token_ids: list[list[int]], connector_meta: KVConnectorMetadata | None):
        self.seqs = seqs
        self.is_prefill = is_prefill
        self.num_scheduled_tokens = np.array(num_scheduled_tokens, dtype=np.int32)
        self.num_computed_tokens = np.array(num_computed_tokens, dtype=np.int32)
        self.token_ids = np.array(token_ids, dtype=np.int32)
        self.block_tables = [list(s.block_table) for s in seqs]
        self.needs_sample = np.array(needs_sample, dtype=bool)
        self.spec_token_ids = spec_token_ids
        self.connector_meta = connector_meta
        self.block_copies: list[tuple[int, int]] = []  # copy-on-write: copy src -> dst before the forward

    @property
    def seq_ids(self) -> list[int]:
        return [s.id for s in self.seqs]

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.size)


class ScheduledBatchOutput(msgspec.Struct):
    """What the runner produced, in batch order; token_ids[i] is empty where no sample was taken.

    With speculative decoding token_ids[i] holds the accepted drafts then the bonus
    token, and draft_token_ids[i] the drafts to verify next step.

    A row whose sequence has `num_forks = k > 0` samples k more first tokens, one per
    new choice, in fork_token_ids[i] (and their logprobs entries in fork_logprobs[i]).
    prompt_logprobs[i]: entries for the prompt tokens after each position of a prefill
    chunk (prompt_logprobs asked), else None.
    """

    seq_ids: list[int]
    token_ids: list[list[int]]
    logprobs: list[list[Any]] | None = None
    draft_token_ids: list[list[int]] | None = None
    fork_token_ids: list[list[int]] | None = None
    fork_logprobs: list[list[Any]] | None = None
    prompt_logprobs: list[list[Any] | None] | None = None


def priority_key(seq: Sequence) -> tuple[int, float, int]:
    """--scheduling-policy priority's order: the request's priority (lower first), then arrival."""
    return seq.sampling_params.priority, seq.arrive_time, seq.id


class SeqUpdate(msgspec.Struct):
    """What one step changed for one sequence, after stop cuts."""

    seq: Sequence
    new_token_ids: list[int]
    new_logprobs: list[Any] | None
    finished: bool


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_connector: KVConnectorScheduler | None = None,
                 prefill_delayer=None, detokenize: Callable[[list[int]], str] | None = None,
                 admission_gate: Callable[[Sequence], bool | tuple[ErrorCode, str]] | None = None):
        """`admission_gate(seq)`, asked before a waiting sequence is admitted: True admits it,
        False leaves it waiting while the ones behind it are admitted (its LoRA adapter is being
        loaded, or has no free slot: no head-of-line blocking), (code, message) refuses it."""
        self.config = config
        self.admission_gate = admission_gate
        self.kv_connector = kv_connector
        self.prefill_delayer = prefill_delayer
        self.detokenize = detokenize
        self.block_manager = BlockManager(config.num_kvcache_blocks, config.block_size,
                                          config.enable_prefix_caching, config.enable_kv_events)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: dict[int, Sequence] = {}
        self.deferred_free_blocks: dict[int, Sequence] = {}
        self._prefilling: dict[int, Sequence] = {}  # running, prompt not done; admission order
        self._live: dict[int, Sequence] = {}  # waiting, running or parked, by id
        self._aborting: dict[int, Sequence] = {}  # aborted while parked: free once the pull stops
        self._first_tokens: list[SeqUpdate] = []  # T0 of promoted sequences, for take_first_tokens
        self._local_only: set[int] = set()  # ids the connector must not load again
        self._rejected: list[Sequence] = []
        self._end_token_ids = set(config.stop_token_ids)
        if config.eos_token_id is not None:
            self._end_token_ids.add(config.eos_token_id)
        self.num_preemptions = 0
        self.num_recv_failures = 0
        self.num_recv_recomputes = 0
        self.cache_stats = CacheStats()
        k = config.num_speculative_tokens
        self.spec_stats = SpecStats(k) if k > 0 else None
        self._prev_time = 0.0
        self._prev_prompt = False
        self._last_prompt_latency = 0.0
        self._capped_prefill_last = False  # the last step was a capped prefill: decodes go next
        # an aligned tick's leftover: the prompts in flight after a step under the delayer's
        # aligned_share go on at that share in the next steps, held or not, until none is left
        self._leftover_share = 0
        self.prefill_s_per_token: float | None = None  # moving average over prefill steps (observe_prefill_step)

    # ------------------------------------------------------------------ requests in and out

    def add(self, seq: Sequence) -> None:
        if seq.sampling_params.stop and self.detokenize is None:
            raise ValueError("stop strings need a detokenize callback in the Scheduler")
        if seq.id in self._live:
            raise ValueError(f"sequence {seq.id} was already added")
        seq.status = SequenceStatus.WAITING
        self._live[seq.id] = seq
        self._enqueue(seq, front=False)

    def _enqueue(self, seq: Sequence, front: bool) -> None:
        """Into `waiting`: fcfs, at the back (a new request) or the front (a preempted one);
        priority, in (priority, arrival) order, preempted or not (vLLM's priority queue), so a
        more urgent request is admitted first and a preempted one waits behind it."""
        if self.config.scheduling_policy != "priority":
            self.waiting.appendleft(seq) if front else self.waiting.append(seq)
            return
        key = priority_key(seq)
        i = len(self.waiting)
        while i > 0 and priority_key(self.waiting[i - 1]) > key:
            i -= 1
        self.waiting.insert(i, seq)

    def abort(self, seq_id: int) -> Sequence | None:
        """Stop a sequence; its blocks are freed exactly once (for a parked one, after its pull
        has stopped writing). Returns the aborted sequence, or None when none is live."""
        seq = self._live.pop(seq_id, None)
        if seq is None:
            deferred = self.deferred_free_blocks.get(seq_id)
            if deferred is not None and deferred.status is not SequenceStatus.ABORTED:
                deferred.status = SequenceStatus.ABORTED  # its output is out; only the serving stops
                self.kv_connector.request_aborted(deferred)  # freed on its finished_sending
            return None
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._prefilling.pop(seq.id, None)
            self.block_manager.deallocate(seq)
        else:  # parked
            del self.parked[seq.id]
            self._aborting[seq.id] = seq  # its pull is still running: freed when it stops
        seq.status = SequenceStatus.ABORTED
        seq.leave_reason = "aborted"
        self._forget(seq)
        if self.kv_connector is not None:
            self.kv_connector.request_aborted(seq)
        return seq

    def take_rejected(self) -> list[Sequence]:
        """Sequences that finished without a forward: unschedulable, or a failed KV pull."""
        out, self._rejected = self._rejected, []
        return out

    def is_finished(self) -> bool:
        return not (self.waiting or self.running or self.parked or self._aborting
                    or self._rejected or self.deferred_free_blocks)

    def get_request_counts(self) -> tuple[int, int]:
        """(num_running, num_waiting); parked sequences count as waiting."""
        return len(self.running), len(self.waiting) + len(self.parked)

    def reset_prefix_cache(self) -> bool:
        self.block_manager.clear_index()
        return True

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> ScheduledBatch | None:
        if not self._prefilling:
            self._leftover_share = 0  # the aligned tick's prompts are done (or preempted)
        allow_prefill = self._ask_prefill_delayer()  # every tick, before any early return
        # running streams under a local prefill: capped prefill steps alternate with decode steps
        cap = self.local_prefill_cap()
        protect = cap > 0 and self.config.enable_chunked_prefill and len(self.running) > len(self._prefilling)
        share = self._aligned_share()
        # held, but an aligned tick's leftover goes on (its prompts only, at the share)
        resume_only = not allow_prefill and share > 0
        cap = min([c for c in (cap if protect else 0, share) if c > 0], default=0)
        if self.config.enable_mixed_chunk:  # decodes ride in every step: none has to follow a capped prefill
            rows = self._decode_rows()
            batch = self._schedule_prefill(cap, rows, resume_only) if allow_prefill or resume_only else None
            return self._finish_batch(batch or self._decode_batch(rows))
        batch = self._schedule_decode() if protect and self._capped_prefill_last else None
        if batch is None and (allow_prefill or resume_only):
            batch = self._schedule_prefill(cap, resume_only=resume_only)
        if batch is None:
            batch = self._schedule_decode()
        self._capped_prefill_last = protect and batch is not None and batch.is_prefill
        return self._finish_batch(batch)

    def _aligned_share(self) -> int:
        """Prompt tokens this step may carry under the delayer's aligned budget (0: no such
        limit): a new aligned tick's share, else the share of the aligned tick whose prompts
        are still in flight here (every prompt in flight then is its leftover: a held step
        admits none, an allowed one admits under the share)."""
        share = self.prefill_delayer.aligned_share() if self.prefill_delayer is not None else 0
        if share > 0:
            bs = self.config.block_size
            self._leftover_share = max(bs, share // bs * bs)  # on the block grid chunks end on
        return self._leftover_share

    def _finish_batch(self, batch: ScheduledBatch | None) -> ScheduledBatch | None:
        if batch is None and self.kv_connector is not None:
            meta = self.kv_connector.build_connector_meta()
            if not meta.is_empty():
                batch = ScheduledBatch(seqs=[], is_prefill=False, num_scheduled_tokens=[], num_computed_tokens=[],
                                       token_ids=[], needs_sample=[], spec_token_ids=[], connector_meta=meta)
        if batch is not None:
            batch.block_copies = self.block_manager.take_copies()
        return batch

    def local_prefill_cap(self) -> int:
        """Prompt tokens a prefill step may carry while streams run (0: no cap): the token cap,
        the time cap at the measured cost per token (a whole number of blocks, at least one;
        four blocks, the smallest step measured, until a prefill step was), the smaller of the
        two set."""
        caps = [self.config.max_local_prefill_tokens_per_step]
        ms = self.config.max_local_prefill_ms_per_step
        if ms > 0:
            block = self.config.block_size
            per_token = self.prefill_s_per_token
            caps.append(4 * block if per_token is None else max(block, int(ms / 1e3 / per_token) // block * block))
        caps = [c for c in caps if c > 0]
        return min(caps) if caps else 0

    def observe_prefill_step(self, num_tokens: int, seconds: float) -> None:
        """A prefill step of `num_tokens` took `seconds` (the forward and its sample): the cost
        per token the time cap divides by. A moving average (0.2), so the cap follows the
        context lengths and the machine's load. Steps under four blocks are not counted: their
        fixed cost (a pulled prompt's last token on a decode engine) would read as per token."""
        if num_tokens >= 4 * self.config.block_size and seconds > 0:
            x = seconds / num_tokens
            prev = self.prefill_s_per_token
            self.prefill_s_per_token = x if prev is None else prev + 0.2 * (x - prev)

    def _connector_meta(self) -> KVConnectorMetadata | None:
        return self.kv_connector.build_connector_meta() if self.kv_connector is not None else None

    def _schedule_prefill(self, cap: int = 0, decode: list[Sequence] = (),
                          resume_only: bool = False) -> ScheduledBatch | None:
        """`cap` > 0: at most that many prompt tokens this step (running streams wait on it).
        `decode` (mixed steps): decode rows scheduled first, one token each, in the same batch.
        `resume_only`: the delayer held this tick; only an aligned tick's leftover (the chunked
        prefills) goes on."""
        seqs: list[Sequence] = list(decode)
        chunks: list[int] = [1] * len(seqs)
        budget = self.config.max_num_batched_tokens - len(seqs)
        if cap > 0:
            budget = min(cap, budget)
        for seq in self._prefilling.values():  # Phase 1: resume chunked prefills
            if len(seqs) >= self.config.max_num_seqs or budget <= 0:
                break
            chunk = self._chunk_size(seq.num_tokens - seq.num_computed_tokens, seq.num_computed_tokens,
                                     budget, len(seqs) == len(decode))
            if chunk == 0:
                break
            seqs.append(seq)
            chunks.append(chunk)
            budget -= chunk
        if not resume_only and (self.config.scheduler_delay_factor <= 0 or self._passed_delay(_now())):
            self._admit_waiting(seqs, chunks, budget, len(decode))  # Phase 2
        if len(seqs) == len(decode):
            return None
        self._prev_prompt = True
        computed = [s.num_computed_tokens for s in seqs]
        token_ids: list[int] = []
        needs_sample = []
        for i, (seq, start, chunk) in enumerate(zip(seqs, computed, chunks)):
            if i >= len(decode):
                seq.type = SequenceType.PREFILL
            token_ids.extend(seq.token_ids[start:start + chunk])
            needs_sample.append(start + chunk == seq.num_tokens)
        return ScheduledBatch(seqs=seqs, is_prefill=True, num_scheduled_tokens=chunks, num_computed_tokens=computed,
                              token_ids=token_ids, needs_sample=needs_sample, spec_token_ids=[[] for _ in seqs],
                              connector_meta=self._connector_meta())

    def _seats_taken(self) -> int:
        """Running and parked sequences plus the forks they will make (each one a seat)."""
        return (len(self.running) + len(self.parked) + sum(s.num_forks for s in self.running)
                + sum(s.num_forks for s in self.parked.values()))

    def _admit_waiting(self, seqs: list[Sequence], chunks: list[int], budget: int, num_decode: int = 0) -> None:
        """`num_decode`: the first rows of `seqs` are decode rows (mixed steps), not prefill chunks."""
        held: list[Sequence] = []  # held back by the admission gate: back to the front, in order
        try:
            self._admit_from_queue(seqs, chunks, budget, held, num_decode)
        finally:
            self.waiting.extendleft(reversed(held))

    def _admit_from_queue(self, seqs: list[Sequence], chunks: list[int], budget: int, held: list[Sequence],
                          num_decode: int) -> None:
        cfg, bm = self.config, self.block_manager
        seats = self._seats_taken() if self.waiting else 0
        while self.waiting and len(seqs) < cfg.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            reason = self._unschedulable_reason(seq)
            if reason is not None:
                self.waiting.popleft()
                self._reject(seq, reason)
                continue
            if seats + 1 + seq.num_forks > cfg.max_num_seqs:
                break
            num_cached_blocks = bm.can_allocate(seq)
            if num_cached_blocks < 0:
                break
            verdict = True if self.admission_gate is None else self.admission_gate(seq)
            if verdict is False:
                held.append(self.waiting.popleft())
                continue
            if verdict is not True:
                self.waiting.popleft()
                self._refuse(seq, *verdict)
                continue
            asked = self.kv_connector is not None and seq.id not in self._local_only
            num_external, load_async = self._ask_connector(seq) if asked else (0, False)
            if load_async and seq.num_tokens >= cfg.max_model_len:
                self.waiting.popleft()  # T0 would sit at position max_model_len: no forward may go there
                self._reject(seq, f"input tokens={seq.num_tokens} leave no room for a decode step "
                                  f"after the remote prefill (max_model_len={cfg.max_model_len})")
                continue
            if load_async:
                self.waiting.popleft()
                self._allocate(seq, num_cached_blocks, asked)
                seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
                self.parked[seq.id] = seq
                seats += 1 + seq.num_forks
                continue
            start = min(num_cached_blocks * bm.block_size + num_external, seq.num_tokens - 1)
            chunk = self._chunk_size(seq.num_tokens - start, start, budget, len(seqs) == num_decode)
            if chunk == 0:
                break
            self.waiting.popleft()
            self._allocate(seq, num_cached_blocks, asked)
            seq.num_computed_tokens = start
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._prefilling[seq.id] = seq
            seats += 1 + seq.num_forks
            seqs.append(seq)
            chunks.append(chunk)
            budget -= chunk

    def _ask_connector(self, seq: Sequence) -> tuple[int, bool]:
        num_external, load_async = self.kv_connector.get_num_new_matched_tokens(seq)
        return int(num_external), bool(load_async)

    def _allocate(self, seq: Sequence, num_cached_blocks: int, tell_connector: bool) -> None:
        hit_tokens = self.block_manager.allocate(seq, num_cached_blocks)
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = _now()
            seq.num_cached_tokens = hit_tokens
        self.cache_stats.update(hit_tokens, seq.num_tokens)
        if tell_connector:  # not for local-only sequences: the connector would load them again
            params = seq.kv_transfer_params
            if self.config.kv_window is not None and params is not None and params.do_remote_prefill:
                self.block_manager.release_unpulled(seq, self.config.kv_window)  # D pulls the window only
            self.kv_connector.update_state_after_alloc(seq)

    def _chunk_size(self, remaining: int, start: int, budget: int, batch_empty: bool) -> int:
        """Tokens to prefill this step; 0 means "not this step"."""
        cfg = self.config
        if not cfg.enable_chunked_prefill:
            return remaining if remaining <= budget else 0
        limit = budget
        if cfg.long_prefill_token_threshold > 0:
            limit = min(limit, cfg.long_prefill_token_threshold)
        if remaining <= limit:
            return remaining
        bs = cfg.block_size
        chunk = (start + limit) // bs * bs - start  # end the chunk on the block grid
        if chunk > 0:
            return chunk
        return limit if batch_empty else 0

    def _schedule_decode(self) -> ScheduledBatch | None:
        return self._decode_batch(self._decode_rows())

    def _decode_rows(self) -> list[Sequence]:
        """Every decode-ready running sequence that fits this step, its slots taken (preempting
        the newest when the pool is full); drafts in `spec_token_ids`."""
        cfg, bm, running, prefilling = self.config, self.block_manager, self.running, self._prefilling
        if cfg.scheduling_policy == "priority":
            # most urgent first (stable: arrival order within a priority), so the slots go to
            # them first and _make_room preempts the least urgent, newest one
            running.sort(key=priority_key)
        seqs: list[Sequence] = []
        budget = cfg.max_num_batched_tokens
        i = 0
        while i < len(running) and len(seqs) < cfg.max_num_seqs:
            seq = running[i]
            if seq.id in prefilling:  # held by the delayer or the budget; not decode-ready
                i += 1
                continue
            n = 1 + len(seq.spec_token_ids)
            if n > budget:
                break
            if not bm.append_slots(seq, n):
                n = self._make_room(seq, n, i)
                if n == 0:
                    break
            seq.type = SequenceType.DECODE
            seqs.append(seq)
            budget -= n
            i += 1
        return seqs

    def _decode_batch(self, seqs: list[Sequence]) -> ScheduledBatch | None:
        if not seqs:
            return None
        num_scheduled, computed, token_ids, spec = [], [], [], []
        for seq in seqs:
            num_scheduled.append(1 + len(seq.spec_token_ids))
            computed.append(seq.num_computed_tokens)
            token_ids.append(seq.token_ids[-1])
            token_ids.extend(seq.spec_token_ids)
            spec.append(seq.spec_token_ids)
        return ScheduledBatch(seqs=seqs, is_prefill=False, num_scheduled_tokens=num_scheduled,
                              num_computed_tokens=computed, token_ids=token_ids, needs_sample=[True] * len(seqs),
                              spec_token_ids=spec, connector_meta=self._connector_meta())

    def _make_room(self, seq: Sequence, n: int, index: int) -> int:
        """Preempt the newest running sequences (never one scheduled this step) until the slots
        for `seq` are taken. Returns the tokens `seq` schedules: n, 1 when only dropping its
        drafts made it fit (else a lone sequence would preempt itself forever), 0 when it
        had to go itself."""
        while not self.block_manager.append_slots(seq, n):
            if len(self.running) - 1 > index:
                self.preempt(self.running[-1])
            elif n > 1:
                seq.spec_token_ids = []
                n = 1
            else:
                self.preempt(seq)
                return 0
        return n

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free the blocks, keep the tokens, back to the front of waiting."""
        if self.running and self.running[-1] is seq:
            self.running.pop()
        else:
            self.running.remove(seq)
        self._prefilling.pop(seq.id, None)
        self.block_manager.deallocate(seq)
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq, front=True)
        self.num_preemptions += 1

    # ------------------------------------------------------------------ admission checks

    def _unschedulable_reason(self, seq: Sequence) -> str | None:
        """Why `seq` can never run on this engine's configuration, or None."""
        cfg = self.config
        n = seq.num_tokens
        if seq.num_forks + 1 > cfg.max_num_seqs:
            return (f"best_of/n={seq.num_forks + 1} sequences > max_num_seqs={cfg.max_num_seqs}. "
                    f"Ask for fewer choices or increase --max-num-seqs.")
        if n > cfg.max_model_len:
            return (f"input tokens={n} > max_model_len={cfg.max_model_len}. "
                    f"Increase --max-model-len or shorten the prompt.")
        if not cfg.enable_chunked_prefill and n > cfg.max_num_batched_tokens:
            return (f"input tokens={n} > max_num_batched_tokens={cfg.max_num_batched_tokens}. "
                    f"Increase --max-num-batched-tokens, enable chunked prefill, or shorten the prompt.")
        # a preempted sequence must also fit the token it is about to produce
        need = self.block_manager.num_blocks_for(n + (1 if seq.num_completion_tokens else 0))
        total = self.block_manager.num_total_blocks
        if need > total:
            return (f"needs {need} KV blocks for {n} tokens > total pool blocks={total}. "
                    f"Shorten the prompt or give the KV cache more memory.")
        return None

    def _reject(self, seq: Sequence, reason: str) -> None:
        logger.warning("request %s rejected: %s", seq.request_id, reason)
        self._finish(seq, "unschedulable", ErrorCode.UNSCHEDULABLE, f"unschedulable: {reason}")
        self._rejected.append(seq)

    def _refuse(self, seq: Sequence, code: ErrorCode, message: str) -> None:
        """The admission gate refused a waiting sequence (e.g. its adapter's load failed)."""
        logger.warning("request %s refused: %s", seq.request_id, message)
        self._finish(seq, "refused", code, message)
        self._rejected.append(seq)

    def _passed_delay(self, now: float) -> bool:
        """scheduler_delay_factor: let the waiting queue fill for a fraction of the last
        prefill's latency before the next prefill (vLLM PR 3279)."""
        if self._prev_prompt:
            self._last_prompt_latency = now - self._prev_time
        self._prev_time, self._prev_prompt = now, False
        if not self.waiting or not self.running:
            return True
        earliest = min(s.arrive_time for s in self.waiting)
        return now - earliest > self.config.scheduler_delay_factor * self._last_prompt_latency

    # ------------------------------------------------------------------ postprocess

    def postprocess(self, batch: ScheduledBatch, output: ScheduledBatchOutput) -> list[SeqUpdate]:
        """Apply one forward's samples: advance computed KV, append tokens, stop, free."""
        if list(output.seq_ids) != [s.id for s in batch.seqs]:
            raise ValueError("output.seq_ids must list the batch's sequence ids in batch order")
        updates: list[SeqUpdate] = []
        any_finished = False
        logprobs, drafts = output.logprobs, output.draft_token_ids
        prompt_logprobs = output.prompt_logprobs
        for i, seq in enumerate(batch.seqs):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted or preempted after schedule()
            if batch.is_prefill:
                start = int(batch.num_computed_tokens[i])
                seq.num_computed_tokens += int(batch.num_scheduled_tokens[i])
                if prompt_logprobs is not None and prompt_logprobs[i] is not None and seq.prompt_logprobs is not None:
                    del seq.prompt_logprobs[start + 1:]  # a recomputed chunk replaces its entries
                    seq.prompt_logprobs.extend(prompt_logprobs[i])
                if not batch.needs_sample[i]:
                    self.block_manager.publish(seq)
                    self._release_outside_window(seq)
                    continue
                self._prefilling.pop(seq.id, None)
            children = self._fork(seq, i, output) if seq.num_forks else []
            update = self._apply_samples(seq, output.token_ids[i], logprobs[i] if logprobs else None,
                                         drafts[i] if drafts else None, len(batch.spec_token_ids[i]))
            updates.append(update)
            any_finished |= update.finished
            if not update.finished:
                self._release_outside_window(seq)
            for child, token, entry in children:
                update = self._apply_samples(child, [token], [entry] if entry is not None else None, None, 0)
                updates.append(update)
                any_finished |= update.finished
        if any_finished:
            self.running = [s for s in self.running if s.status is SequenceStatus.RUNNING]
        return updates

    def _release_outside_window(self, seq: Sequence) -> None:
        """Sliding window: return the blocks before it while the sequence runs; not P's blocks
        for a remote decode, which the connector sends whole (docs/design.md, "Sliding window")."""
        window = self.config.kv_window
        params = seq.kv_transfer_params
        if window is None or (params is not None and params.do_remote_decode):
            return
        self.block_manager.release_outside_window(seq, window)

    def _fork(self, seq: Sequence, row: int, output: ScheduledBatchOutput) -> list[tuple[Sequence, int, Any]]:
        """Fork `seq` at its first sampled token into its remaining choices: each shares its
        blocks and runs from here on its own. Returns (choice, its first token, its entry)."""
        tokens = output.fork_token_ids[row] if output.fork_token_ids is not None else []
        if len(tokens) != seq.num_forks:
            raise ValueError(f"sequence {seq.id}: expected {seq.num_forks} fork tokens, got {len(tokens)}")
        entries = output.fork_logprobs[row] if output.fork_logprobs is not None else [None] * len(tokens)
        seq.num_forks = 0
        children = []
        for index, (token, entry) in enumerate(zip(tokens, entries), start=1):
            child = seq.fork(index)
            self.block_manager.fork(seq, child)
            self._live[child.id] = child
            self.running.append(child)
            children.append((child, int(token), entry))
        return children

    def _apply_samples(self, seq: Sequence, tokens: list[int], logprobs: list | None,
                       next_drafts: list[int] | None, num_drafts: int) -> SeqUpdate:
        num_sampled = len(tokens)
        if not 1 <= num_sampled <= num_drafts + 1:
            raise ValueError(f"sequence {seq.id}: expected 1..{num_drafts + 1} sampled tokens, "
                             f"got {num_sampled}")
        if num_drafts and self.spec_stats is not None:
            self.spec_stats.update(num_drafts, num_sampled - 1)
        emitted: list[int] = []
        reason = None
        for token in tokens:
            token = int(token)
            seq.token_ids.append(token)
            emitted.append(token)
            reason = self._stop_reason(seq)
            if reason is not None:
                break  # drafts past a stop are cut
        kept = len(emitted)
        new_logprobs = None
        if logprobs is not None or seq.sampling_params.logprobs is not None:  # most rows want neither
            new_logprobs = self._record_logprobs(seq, list(logprobs[:kept]) if logprobs is not None else [None] * kept)
        seq.num_computed_tokens = len(seq.token_ids) - 1
        if num_drafts and reason is None:  # roll back: blocks that hold only rejected drafts' KV
            self.block_manager.trim(seq)
        if seq.num_computed_tokens // self.config.block_size > seq.num_published_blocks:
            self.block_manager.publish(seq)  # hashes name accepted tokens only: token_ids holds no draft
        if seq.first_token_time is None:
            seq.first_token_time = _now()
        seq.spec_token_ids = []
        if self.spec_stats is not None and next_drafts:
            if reason is None:  # drafts never pass max_model_len nor max_tokens
                room = min(self.config.max_model_len - len(seq.token_ids),
                           seq.sampling_params.max_tokens - seq.num_completion_tokens - 1)
                seq.spec_token_ids = [int(t) for t in next_drafts[:min(room, self.config.num_speculative_tokens)]]
            elif seq.kv_transfer_params is not None and seq.kv_transfer_params.do_remote_decode:
                # P: the drafts go to D in kv_transfer_params.draft_token_ids, verified in its first step
                seq.spec_token_ids = [int(t) for t in next_drafts[:self.config.num_speculative_tokens]]
        if reason is not None:
            self._finish(seq, reason)
        return SeqUpdate(seq, emitted, new_logprobs, reason is not None)

    def _stop_reason(self, seq: Sequence) -> str | None:
        """leave_reason if the sequence must stop after its last token (vLLM's order)."""
        sp = seq.sampling_params
        num_tokens = len(seq.token_ids)
        num_completion = num_tokens - seq.num_prompt_tokens
        if num_tokens >= self.config.max_model_len:
            return "max_model_len"
        if num_completion >= sp.min_tokens:
            token = seq.token_ids[-1]
            if not sp.ignore_eos and token in self._end_token_ids:
                return "eos"
            if token in sp.stop_token_ids:
                seq.stop_reason = token
                return "stop_token"
            if sp.stop and self._find_stop_string(seq) is not None:
                return "stop_string"
        if num_completion >= sp.max_tokens:
            return "max_tokens"
        return None

    def _find_stop_string(self, seq: Sequence) -> str | None:
        """A stop string that ends inside the last token's text (earlier ones stopped earlier)."""
        stops = seq.sampling_params.stop
        window = max(len(s) for s in stops) + _STOP_WINDOW_SLACK
        tail = seq.token_ids[max(seq.num_prompt_tokens, seq.num_tokens - window):]
        text = self.detokenize(tail)
        new_from = len(self.detokenize(tail[:-1]))
        hit = find_stop_string(text, stops, ends_after=new_from)  # earlier ones stopped earlier
        if hit is None:
            return None
        seq.stop_reason = hit[1]
        return hit[1]

    # ------------------------------------------------------------------ finishing

    def _finish(self, seq: Sequence, reason: str, error_code: ErrorCode | None = None,
                error: str | None = None) -> None:
        """The one place a sequence finishes: request_finished once, then free or defer.
        `reason`: a leave_reason code; `error`: the message of one that ended in an error."""
        seq.status = SequenceStatus.FINISHED
        seq.leave_reason = reason
        seq.error_code, seq.error = error_code, error
        self._live.pop(seq.id, None)
        self._forget(seq)
        delay_free = False
        if self.kv_connector is not None:
            delay_free, seq.kv_transfer_params_output = self.kv_connector.request_finished(seq)
        if delay_free and seq.block_table:
            self.deferred_free_blocks[seq.id] = seq  # the consumer still reads these blocks
        else:
            self.block_manager.deallocate(seq)

    def _forget(self, seq: Sequence) -> None:
        self._prefilling.pop(seq.id, None)
        self._local_only.discard(seq.id)

    # ------------------------------------------------------------------ KV connector

    def update_from_kv_connector_output(self, output: KVConnectorOutput | None) -> None:
        """Reconcile with transfers the worker side saw end; unknown or repeated ids are ignored."""
        if output is None:
            return
        bm = self.block_manager
        for seq_id in output.finished_sending:
            seq = self.deferred_free_blocks.pop(seq_id, None)
            if seq is not None:
                bm.deallocate(seq)
        received: dict[int, None] = {}  # parked ids whose pull landed, in order
        for seq_id in output.finished_recving:
            if seq_id in self._aborting:
                bm.deallocate(self._aborting.pop(seq_id))
            elif seq_id in self.parked:
                received[seq_id] = None
        for seq_id in output.failed_recving:
            if seq_id in self._aborting:
                bm.deallocate(self._aborting.pop(seq_id))
            elif seq_id in self.parked and seq_id not in received:
                self._recv_failed(self.parked.pop(seq_id))
        for seq_id in received:  # now, not at the next schedule(): T0 leaves with this step's outputs
            self._promote_received(self.parked.pop(seq_id))

    def _recv_failed(self, seq: Sequence) -> None:
        self.num_recv_failures += 1
        if self.kv_connector.recv_failure_policy(seq) == "recompute":
            self.num_recv_recomputes += 1
            self.block_manager.deallocate(seq)  # the pull has stopped; its blocks hold garbage
            self._local_only.add(seq.id)
            seq.status = SequenceStatus.WAITING
            self._enqueue(seq, front=True)
            return
        self._finish(seq, "kv_transfer_failed", ErrorCode.KV_TRANSFER_FAILED,
                     "kv_transfer_failed: the prompt KV could not be loaded from the prefill engine")
        self._rejected.append(seq)

    def _record_logprobs(self, seq: Sequence, entries: list[Logprob | None]) -> list[Logprob | None] | None:
        """Account new tokens' logprob entries (None where not computed): the cumulative
        logprob that ranks best_of candidates, and the entries the request asked for."""
        for entry in entries:
            if entry is not None:
                seq.cumulative_logprob += entry.logprob
        if seq.sampling_params.logprobs is None:
            return None
        seq.logprobs.extend(entries)
        return entries

    def take_first_tokens(self) -> list[SeqUpdate]:
        """T0 of the sequences promoted since the last call (received KV: P sampled T0, so
        the client has it as soon as the pull lands, a decode step before T1)."""
        out, self._first_tokens = self._first_tokens, []
        return out

    def _promote_received(self, seq: Sequence) -> None:
        """A parked sequence whose prompt KV arrived starts decoding, ahead of new admissions.

        D never forwards such a prompt: its KV is all there, so the sequence resumes at
        position num_prompt_tokens with P's first token T0 (and drafts) appended, and T0 goes
        out now (take_first_tokens), a decode step before T1.
        """
        remote = self.kv_connector.remote_prefill(seq)
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.num_cached_tokens = remote.num_cached_tokens
        self.block_manager.publish(seq)  # D's prefix cache learns the received blocks
        self._local_only.add(seq.id)  # a later preemption recomputes locally
        if remote.first_token_id is None or seq.num_forks:
            seq.num_computed_tokens -= 1  # recompute the last position to sample T0 (every choice's)
        else:
            seq.token_ids.append(int(remote.first_token_id))
            seq.first_token_time = _now()
            reason = self._stop_reason(seq)
            entries = self._record_logprobs(seq, [remote.first_token_logprobs])
            self._first_tokens.append(SeqUpdate(seq, [seq.token_ids[-1]], entries, reason is not None))
            if reason is not None:  # T0 ends it: D never steps it
                self._finish(seq, reason)
                return
            k = self.config.num_speculative_tokens
            drafts = remote.draft_token_ids[:min(k, self.config.max_model_len - seq.num_tokens)]
            seq.spec_token_ids = [int(t) for t in drafts]
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    # ------------------------------------------------------------------ prefill delayer

    def _ask_prefill_delayer(self) -> bool:
        if self.prefill_delayer is None:
            return True
        num_ready, pending_tokens = self._admittable_head_prefills(limit=4)
        # an aligned tick's leftover goes on whatever the delayer decides: not a prefill to
        # align, but this rank prefills in the tick (alignment-ready), so others may join it
        leftover = self._leftover_share > 0 and bool(self._prefilling)
        partial = [] if leftover else list(self._prefilling.values())
        has_partial = bool(partial)
        for seq in partial:
            pending_tokens += seq.num_tokens - seq.num_computed_tokens
        prefillable = num_ready > 0 or has_partial
        return self.prefill_delayer.should_allow_prefill(
            local_prefillable=prefillable, token_usage=self.block_manager.usage,
            local_alignment_ready=prefillable or leftover,
            pending_tokens=min(pending_tokens, self.config.max_num_batched_tokens),
            num_decodes=len(self.running) - len(self._prefilling), has_partial=has_partial)

    def _admittable_head_prefills(self, limit: int) -> tuple[int, int]:
        """(count, tokens) of head-of-queue prefills this rank could admit now (peek only).

        `bool(waiting)` is too coarse: under a burst every rank has a queue, but only the
        ranks with free blocks can admit, and those are the "mixed" case to align."""
        count = tokens = 0
        budget = self.config.max_num_batched_tokens
        if len(self.running) + len(self.parked) >= self.config.max_num_seqs:
            return 0, 0
        for i, seq in enumerate(self.waiting):
            if i >= limit:
                break
            if self._unschedulable_reason(seq) is not None:
                continue
            num_cached_blocks = self.block_manager.can_allocate(seq)
            if num_cached_blocks < 0:
                break
            new = seq.num_tokens - num_cached_blocks * self.config.block_size
            if tokens + new > budget and count > 0:
                break
            count += 1
            tokens += new
        return count, tokens
