"""SimulatedEngine: the real engine loop, scheduler, block manager, prefix cache, KV
connector and KV events around a forward that sleeps the hardware profile's predicted step
time and makes deterministic tokens (`atomd serve --model-runner simulated --hardware ...`).

Tokens: a hash of (the request's seed, else --seed; the choice index; the sequence's length
and last 8 tokens), so a sequence gets the same tokens on a colocated engine and across a
prefill and a decode engine, and after a preemption. A token is never sampled from a
distribution: sampling knobs other than allowed_token_ids and min_tokens change nothing;
structured outputs, prompt logprobs and speculative decoding are refused (a 400 / a start-up
error). Logprobs are hash-made numbers in [-16, 0), the same on every engine.

Embeddings (`--task embed`): a request that pools gets, when its prompt is done, a standard
normal vector of the profile's hidden size seeded by a hash of its prompt tokens and pooling
type: the same input gives the same vector on any engine, for any batching or chunking. Its
steps are prefill steps, timed by the profile like any prefill.

Step time: the profile's prediction for the step's shape; with a served profile (`atomd
profile --from-servers`) plus a residual drawn from its measured spread (or, with
`spread_in_order`, the next of the served residuals, walked from a seeded start), plus whatever of the
served engine's busy gap between forwards (its gap model's, for the work this loop did since
its last forward; else the mean) this loop's own gap (measured, EWMA) leaves;
a step that woke late (a shared machine) shortens the next busy one by as much. Simulated
engines of one host ($ATOMD_SIM_SHARED_CORES, atomd/sim/shared_cores.py) also stretch a
forward by the profile's contention x the seconds another one's forward ran inside it, and
spin through it (a real forward holds its core) instead of sleeping.

KV: the pool is counted in blocks of the profile's model shape, never allocated; the
connector moves one byte per block over its real side channel (leases, heartbeats, aborts
as in production), and `SimulatedLink` holds each landed pull back until the profile's link
would have moved its real size (pulls queue on the decode engine's link).
"""
from __future__ import annotations

import hashlib
import heapq
import json
import time
from typing import Any

import numpy as np

from atomd.config import EngineConfig
from atomd.engine.engine_loop import EngineLoop, resolve_model_dir
from atomd.model.text_config import text_model_config
from atomd.sim.hardware import Calibrated, Link, Profile, StepShape, load_profile
from atomd.sim.shared_cores import MAX_RECHECKS, hold_core, shared_cores_from_env
from atomd.tokenizer import Tokenizer
from kv_transfer.connector import KVConnectorOutput
from kv_transfer.params import KVTransferParams, compat_fingerprint
from scheduler.prefill_delayer import PrefillDelayer
from scheduler.scheduler import ScheduledBatch, ScheduledBatchOutput
from contracts.sampling import SamplingParams, StructuredOutputsParams
from scheduler.sequence import Sequence
from contracts.logprobs import Logprob

SIM_KV_LAYOUT_VERSION = "atomd-sim-kv-1"  # one byte per block: never pairs with a real engine
TOKEN_CONTEXT = 8  # last tokens a simulated token depends on
MAX_LATE_S = 1.0  # lateness carried to the next step at most


class SimulatedEngine(EngineLoop):
    def __init__(self, config: EngineConfig, prefill_delayer: PrefillDelayer | None = None):
        self.config = config
        self.profile: Profile = load_profile(config.hardware).with_link(config.kv_link)
        model_dir = resolve_model_dir(config)
        self.model_name = config.model or "atomd-default"
        hf = text_model_config(json.loads((model_dir / "config.json").read_text()))  # nested: as the loader
        self.vocab_size = int(hf["vocab_size"])
        self.tokenizer = Tokenizer.from_dir(model_dir)
        eos = self.tokenizer.eos_token_id
        if eos is None and isinstance(hf.get("eos_token_id"), int):
            eos = hf["eos_token_id"]
        self._end_token_ids = [t for t in [eos, *self.tokenizer.stop_token_ids] if t is not None]
        shape = self.profile.model
        self.block_bytes = shape.kv_bytes_per_token * config.block_size
        num_blocks = self._pool_blocks(self.block_bytes)
        if self.profile.kv_cache_bytes is not None and config.num_kvcache_blocks is None \
                and config.kv_cache_memory is None:  # the accelerator's memory after the weights
            num_blocks = min(self.profile.kv_cache_bytes // self.block_bytes,
                             config.max_num_seqs * -(-config.max_model_len // config.block_size))
        self.compat = compat_fingerprint(self.model_name, config.dtype, config.block_size,
                                         shape.num_layers, shape.num_kv_heads, shape.head_dim, SIM_KV_LAYOUT_VERSION)
        kv_blocks = np.zeros((num_blocks, 1), dtype=np.uint8)  # what the side channel moves: a byte a block
        self.forward_seconds = 0.0  # simulated forward time so far (GET /debug/stats `sim`)
        step = self.profile.step  # a served profile's measured spread, drawn per step (seeded)
        self._spread = {True: step.prefill_spread, False: step.decode_spread} if isinstance(step, Calibrated) else {}
        self._spread_rng = np.random.default_rng(config.seed)
        # in served order: each kind walks its residuals from a seeded start (hardware.Calibrated)
        self._spread_at = {kind: int(self._spread_rng.integers(len(v))) for kind, v in self._spread.items() if v} \
            if isinstance(step, Calibrated) and step.spread_in_order else None
        # a served profile's busy gap: this loop's own (EWMA) is measured and the rest waited out
        self._gap_s = {True: step.prefill_gap_s, False: step.decode_gap_s} if isinstance(step, Calibrated) else {}
        # ... or, when the profile has one, its gap model given the loop's work since the last forward
        self._gap_model = {True: step.prefill_gap, False: step.decode_gap} if isinstance(step, Calibrated) else {}
        self._own_gap_s: dict[bool, float] = {}  # is_prefill -> this loop's gap (EWMA)
        self._last_forward_end: float | None = None
        self._late_s = 0.0  # how much later than its target the last busy step ended
        # engines sharing a host's cores (atomd/sim/shared_cores.py): a forward is longer by the
        # profile's contention x the seconds another engine's forward ran inside it
        self.cores = shared_cores_from_env()
        self._contention = {True: step.prefill_contention, False: step.decode_contention} \
            if isinstance(step, Calibrated) else {}
        self.forward_steps = 0
        self._start(num_blocks, kv_blocks, eos, prefill_delayer, model_dir)

    def _make_connector(self, kv_blocks: Any):
        inner = super()._make_connector(kv_blocks)
        return None if inner is None else SimulatedLink(inner, self.profile.link, self.block_bytes)

    def _check_grammar(self, grammar: StructuredOutputsParams) -> None:
        raise ValueError("structured_outputs: the simulated model runner does not follow grammars")

    def _prepare_params(self, sp: SamplingParams, kv_params: KVTransferParams | None) -> SamplingParams:
        if sp.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: the simulated model runner computes no prompt logprobs")
        return super()._prepare_params(sp, kv_params)

    def kernels_info(self) -> Any:
        return {"simulated": self.profile.name}

    def stats(self) -> dict[str, Any]:
        return dict(super().stats(), sim={"profile": self.profile.name, "link": self.profile.link.name,
                                          "block_bytes": self.block_bytes, "forward_steps": self.forward_steps,
                                          "forward_seconds": self.forward_seconds})

    # ------------------------------------------------------------------ the forward

    def _forward(self, batch: ScheduledBatch) -> ScheduledBatchOutput:
        started = time.perf_counter()
        seconds = self.profile.step_seconds(StepShape.of(
            batch.is_prefill, batch.num_scheduled_tokens.tolist(), batch.num_computed_tokens.tolist()))
        spread = self._spread.get(batch.is_prefill)
        if spread:
            if self._spread_at is None:
                k = self._spread_rng.integers(len(spread))
            else:
                k = self._spread_at[batch.is_prefill]
                self._spread_at[batch.is_prefill] = (k + 1) % len(spread)
            seconds = max(0.0, seconds + spread[k])
        wait = 0.0
        served_gap = self._gap_s.get(batch.is_prefill)
        model = self._gap_model.get(batch.is_prefill)
        if (model is not None or served_gap) and self._last_forward_end is not None:
            # the served gap (for this gap's work, with a model) less this loop's own (EWMA: a
            # step's own gap, spikes included, would make max(0, served - own) biased upward)
            gap = started - self._last_forward_end
            own = self._own_gap_s.get(batch.is_prefill)
            own = self._own_gap_s[batch.is_prefill] = gap if own is None else own + 0.1 * (gap - own)
            wait = max(0.0, (served_gap if model is None else model.seconds(*self.gap_work)) - own)
        token_ids: list[list[int]] = [[] for _ in batch.seqs]
        logprobs: list[list[Any]] | None = None
        if batch.is_prefill:
            self._pool(batch)
        fork_ids: list[list[int]] | None = None
        fork_entries: list[list[Any]] | None = None
        for i in np.flatnonzero(batch.needs_sample).tolist():
            seq = batch.seqs[i]
            token, entry = self._sample(seq, seq.sampling_params, seq.index)
            token_ids[i] = [token]
            if entry is not None:
                logprobs = logprobs or [[] for _ in batch.seqs]
                logprobs[i] = [entry]
            if seq.num_forks:
                fork_ids = fork_ids or [[] for _ in batch.seqs]
                fork_entries = fork_entries or [[] for _ in batch.seqs]
                for choice in range(1, seq.num_forks + 1):
                    token, entry = self._sample(seq, seq.sampling_params.for_choice(choice), choice)
                    fork_ids[i].append(token)
                    fork_entries[i].append(entry)
        self.forward_steps += 1
        self.forward_seconds += seconds
        # a shared machine wakes a sleeper late: the lateness is paid back from the next busy
        # steps, so a busy engine's steps add up to the profile's times
        target = started + seconds + wait - self._late_s
        if self.cores is None:
            remaining = target - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)
        else:
            target = self._share_cores(started, target, self._contention.get(batch.is_prefill, 0.0))
        end = time.perf_counter()
        if self.cores is not None:
            self.cores.end(started, end)
        busy = bool(self.scheduler.running)
        self._late_s = min(max(0.0, end - target), MAX_LATE_S) if busy else 0.0
        self._last_forward_end = end if busy else None
        return ScheduledBatchOutput(batch.seq_ids, token_ids, logprobs, fork_token_ids=fork_ids,
                                    fork_logprobs=fork_entries)

    def _share_cores(self, started: float, target: float, contention: float) -> float:
        """Waits out the forward on a host shared with other simulated engines (spinning,
        hold_core), to its end: the
        uncontended `target` plus `contention` x the other engines' forward seconds inside
        [started, end] (what ran so far, and what their running forwards plan ahead), read
        again at the end in case one started meanwhile. Returns the end planned last."""
        base = self.cores.begin(started, target)
        end = target
        for _ in range(MAX_RECHECKS):
            now = time.perf_counter()
            past = float((self.cores.busy(now) - base).sum())
            for _ in range(4):  # the end depends on the overlap ahead of it: a few fixed-point steps
                end = target + contention * (past + self.cores.ahead(now, end))
            self.cores.plan(end)
            if end <= now:
                break
            hold_core(end, time.perf_counter, time.sleep, self.cores.spin)
        return end

    def _pool(self, batch: ScheduledBatch) -> None:
        """A pooling request's vector once its prompt is done (the real engine's last output
        carries it; engine_loop pops it there)."""
        for i, seq in enumerate(batch.seqs):
            pooling = seq.sampling_params.pooling
            if pooling is not None and batch.needs_sample[i]:
                self._embeddings[seq.request_id] = pseudo_embedding(
                    seq.prompt_token_ids, pooling, self.profile.model.hidden_size).tolist()

    def _busy_span_ended(self) -> None:
        super()._busy_span_ended()
        self._last_forward_end = None  # the loop waits now: no served busy gap follows (engine_loop)

    def _sample(self, seq: Sequence, params: SamplingParams, index: int) -> tuple[int, dict | None]:
        """The next token of `seq` as choice `index`, and its logprobs entry when asked (or
        when best_of candidates are ranked)."""
        seed = params.seed if params.seed is not None else self.config.seed
        tokens = seq.token_ids
        ban_end = seq.num_completion_tokens < params.min_tokens
        for attempt in range(4):  # min_tokens: an end token is redrawn (1 in vocab / len(end ids) chance)
            h = simulated_hash(seed, index, len(tokens) + attempt, tokens[-TOKEN_CONTEXT:])
            allowed = params.allowed_token_ids
            token = allowed[h % len(allowed)] if allowed else h % self.vocab_size
            if not (ban_end and token in self._end_token_ids):
                break
        if params.logprobs is None and not params.ranked:
            return token, None
        logprob = -((h >> 32) % 16384) / 1024.0 - 1e-3  # in [-16, 0)
        k = params.logprobs or 0
        top = [(token, logprob)] + [((token + j * 7919) % self.vocab_size, logprob - j) for j in range(1, k)]
        return token, Logprob(logprob, top[:k])


def pseudo_embedding(prompt: list[int], pooling: str, size: int) -> np.ndarray:
    """A float32 standard normal vector of `size`, a function of the prompt and the pooling."""
    h = hashlib.blake2b(pooling.encode(), digest_size=8)
    h.update(np.asarray(prompt, dtype=np.int64).tobytes())
    return np.random.default_rng(int.from_bytes(h.digest(), "little")).standard_normal(size, dtype=np.float32)


def simulated_hash(seed: int, index: int, length: int, tail: list[int]) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(np.array([seed, index, length, *tail], dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


class SimulatedLink:
    """A consumer's or producer's connector whose landed pulls are held back until the link
    would have moved them: a pull of n blocks starts when its load is handed to the worker
    side (or when the decode engine's link frees), takes n * block_bytes / bandwidth, and is
    reported latency later. Everything else goes to the real connector; its byte counters
    (one byte a block) are scaled to the simulated block size."""

    def __init__(self, inner: Any, link: Link, block_bytes: int):
        self.inner, self.link, self.block_bytes = inner, link, block_bytes
        self._loads: dict[int, tuple[float, int]] = {}  # seq id -> (started, blocks)
        self._held: list[tuple[float, int]] = []  # (ready at, seq id), a heap
        self._link_free_at = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def is_producer(self) -> bool:
        return self.inner.is_producer

    def start_load_kv(self, meta: Any) -> None:
        now = time.monotonic()
        for load in getattr(meta, "loads", ()):
            self._loads[load.seq_id] = (now, len(load.local_block_ids))
        self.inner.start_load_kv(meta)

    def get_finished(self) -> KVConnectorOutput:
        out = self.inner.get_finished()
        now = time.monotonic()
        for seq_id in out.finished_recving:
            started, blocks = self._loads.pop(seq_id, (now, 0))
            begin = max(started, self._link_free_at)
            self._link_free_at = begin + blocks * self.block_bytes / self.link.bandwidth
            heapq.heappush(self._held, (self._link_free_at + self.link.latency_s, seq_id))
        for seq_id in out.failed_recving:
            self._loads.pop(seq_id, None)
        ready = []
        while self._held and self._held[0][0] <= now:
            ready.append(heapq.heappop(self._held)[1])
        return KVConnectorOutput(finished_sending=out.finished_sending, finished_recving=ready,
                                 failed_recving=out.failed_recving)

    def stats(self) -> dict[str, Any]:
        s = dict(self.inner.stats())
        s["bytes"] = s.get("bytes", 0) * self.block_bytes
        return s
