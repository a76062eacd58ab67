"""A fleet of simulated engines in virtual time, for `atomd plan`: the real `Scheduler`
(block manager, prefix cache, chunked prefill, preemption, parking for remote KV) of every
engine, stepped by a discrete-event loop whose step lasts the profile's predicted time, so a
minute of traffic over 16 engines simulates in about a second, with no process or socket.

Layouts: `colocated` N engines, or `pd` x prefill and y decode engines. A PD request runs
P's leg (max_tokens 1) on the prefill engine with the fewest prompt tokens queued, then is
admitted on the decode engine with the fewest sequences (parked, its blocks allocated as
the real consumer does), whose link takes latency + prompt blocks x block bytes / bandwidth
(pulls queue on that D's link); its first token goes out when the pull lands, as on a real
decode engine (scheduler.take_first_tokens).

Adaptive PD (`Layout.adaptive`): each request asks the router's own rule
(router/adaptive.PDDecider, its default priors) whether to prefill on the least busy D
itself (one leg, no pull) or remotely; the decider learns as in the router: each P's rate
from its legs (the tokens queued ahead plus the leg's, over the leg's time), the transfer
from P's answer to D's first token, D's local rate from local legs. DP lockstep
(`Layout.dp_lockstep` = g): each pool's engines step in groups of g ranks, as `--dp-lockstep`
engines do: a group's step starts when every rank is free, every rank takes its batch (an
idle rank an empty pass) and the step lasts the slowest rank's time.

What is not modelled: P keeps no blocks pinned while D pulls, the adaptive rule's ITL bound
(`--local-prefill-max-itl-ms`, off by default), the router's own time, retries and failures.
"""
from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import numpy as np

from atomd.sim.hardware import Profile, StepShape
from kv_transfer.connector import KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler, RemotePrefill
from scheduler.scheduler import ScheduledBatchOutput, Scheduler, SchedulerConfig
from contracts.sampling import SamplingParams
from router.adaptive import LocalPrefill, PDDecider
from scheduler.sequence import Sequence

SIM_TOKEN = 11  # every simulated output token: the planner counts tokens, it never reads them


class Layout(msgspec.Struct, frozen=True):
    """`pd`: num_prefill P + num_decode D engines; `colocated`: num_decode engines doing both."""

    kind: str  # "pd" | "colocated"
    num_prefill: int
    num_decode: int
    decode_max_num_seqs: int = 256
    prefill_max_num_batched_tokens: int = 8192
    adaptive: bool = False  # pd: the router's --pd-mode adaptive per request
    local_prefill_max_tokens: int = 256  # adaptive: the router's --local-prefill-max-tokens
    dp_lockstep: int = 1  # ranks per lockstep group in each pool (1: every engine steps alone)

    @property
    def num_engines(self) -> int:
        return self.num_prefill + self.num_decode

    def label(self) -> str:
        extra = (", adaptive" if self.adaptive else "") + \
            (f", DP{self.dp_lockstep} lockstep" if self.dp_lockstep > 1 else "")
        if self.kind == "colocated":
            return f"{self.num_decode} colocated (max_num_seqs {self.decode_max_num_seqs}{extra})"
        return f"{self.num_prefill}P{self.num_decode}D (D max_num_seqs {self.decode_max_num_seqs}{extra})"

    def check(self) -> None:
        if self.kind not in ("pd", "colocated") or self.num_decode < 1 or \
                (self.kind == "pd") != (self.num_prefill >= 1):
            raise ValueError(f"layout {self.label()}: pd needs P >= 1 and D >= 1, colocated no P and D >= 1")
        if self.adaptive and self.kind != "pd":
            raise ValueError("adaptive PD needs a pd layout")
        if self.dp_lockstep < 1 or any(n % self.dp_lockstep for n in (self.num_prefill, self.num_decode)):
            raise ValueError(f"layout {self.label()}: each pool's size must be a multiple of dp_lockstep")


class Request(msgspec.Struct, frozen=True):
    arrival_s: float
    prompt: list[int]
    max_tokens: int


@dataclass
class Outcome:
    """One request's client-side times (virtual seconds)."""

    arrival_s: float
    num_tokens: int
    first_token_s: float | None = None
    finish_s: float | None = None
    failed: bool = False

    @property
    def ttft(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot(self) -> float:
        return 0.0 if self.num_tokens <= 1 else (self.finish_s - self.first_token_s) / (self.num_tokens - 1)


class _EmptyMeta(KVConnectorMetadata):
    def is_empty(self) -> bool:
        return True


class VirtualPull(KVConnectorScheduler):
    """A decode engine's connector in the fleet: a request with a remote prefill is parked
    with its blocks allocated; the fleet times its pull from then (`started`)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.remote: dict[int, int] = {}  # seq id -> T0 from P
        self.started: list[tuple[Sequence, int]] = []  # (sequence, blocks it pulls)

    @property
    def is_producer(self) -> bool:
        return False

    def get_num_new_matched_tokens(self, seq: Sequence) -> tuple[int, bool]:
        return (seq.num_prompt_tokens, True) if seq.id in self.remote else (0, False)

    def update_state_after_alloc(self, seq: Sequence) -> None:
        if seq.id in self.remote:  # every prompt block past D's own prefix hit, as the real consumer
            blocks = -(-seq.num_prompt_tokens // self.block_size) - seq.num_computed_tokens // self.block_size
            self.started.append((seq, blocks))

    def build_connector_meta(self) -> KVConnectorMetadata:
        return _EmptyMeta()

    def request_finished(self, seq: Sequence) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def request_aborted(self, seq: Sequence) -> None:
        pass

    def remote_prefill(self, seq: Sequence) -> RemotePrefill:
        return RemotePrefill(first_token_id=self.remote.pop(seq.id))


@dataclass(eq=False)
class _Engine:
    scheduler: Scheduler
    url: str  # its name for the adaptive decider
    pull: VirtualPull | None = None
    busy: bool = False
    link_free_s: float = 0.0
    queued_tokens: int = 0  # prompt tokens sent and not yet prefilled (P's queue)
    owners: dict[int, int] = field(default_factory=dict)  # seq id -> request index

    @property
    def in_flight_tokens(self) -> int:  # what the router's Worker counts for the decider
        return self.queued_tokens


class Fleet:
    def __init__(self, profile: Profile, layout: Layout, max_model_len: int = 8192, block_size: int = 16,
                 max_num_batched_tokens: int = 8192, prefix_caching: bool = True):
        """prefix_caching False: no block hashing, a third of a long-prompt run's time; the
        same times when no two prompts share a block (Workload.prefix_share 0)."""
        layout.check()
        self.profile, self.layout = profile, layout
        self.block_bytes = profile.model.kv_bytes_per_token * block_size
        pool = (profile.kv_cache_bytes or (1 << 30)) // self.block_bytes

        def engine(url: str, max_num_seqs: int, pull: VirtualPull | None, batched: int) -> _Engine:
            # as the engine sizes its pool: never more than every sequence at full length
            blocks = min(pool, max_num_seqs * -(-max_model_len // block_size))
            cfg = SchedulerConfig(num_kvcache_blocks=int(blocks), max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=batched, max_model_len=max_model_len,
                                  block_size=block_size, enable_prefix_caching=prefix_caching,
                                  enable_chunked_prefill=True,
                                  scheduler_delay_factor=0.0, long_prefill_token_threshold=0)
            return _Engine(Scheduler(cfg, kv_connector=pull), url, pull)

        self.prefill = [engine(f"p{k}", 256, None, layout.prefill_max_num_batched_tokens)
                        for k in range(layout.num_prefill)]
        self.decode = [engine(f"d{k}", layout.decode_max_num_seqs,
                              VirtualPull(block_size) if layout.kind == "pd" else None, max_num_batched_tokens)
                       for k in range(layout.num_decode)]
        g = layout.dp_lockstep
        self.groups = [pool[k:k + g] for pool in (self.prefill, self.decode) for k in range(0, len(pool), g)]
        self.decider = PDDecider(local_prefill_max_tokens=layout.local_prefill_max_tokens) \
            if layout.adaptive else None
        self._legs: dict[int, Any] = {}  # request index -> its LocalPrefill, or (P, answered at)
        self._p_legs: dict[int, tuple[float, int]] = {}  # request index -> (P leg start, tokens ahead + own)
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._misses: _Misses | None = None
        self._order = itertools.count()
        self.now = 0.0

    # ------------------------------------------------------------------ the loop

    def run(self, requests: list[Request], stop_below: SLO | None = None) -> list[Outcome]:
        """Every request's outcome; with `stop_below`, the run stops (outcomes left unfinished)
        as soon as so many requests missed it that its attainment cannot be reached: past
        capacity the queue grows to the end, and goodput's search only asks whether it held."""
        self.outcomes = [Outcome(r.arrival_s, r.max_tokens) for r in requests]
        for i, r in enumerate(requests):
            self._at(r.arrival_s, lambda i=i, r=r: self._arrive(i, r))
        self._misses = misses = _Misses(self.outcomes, stop_below) if stop_below is not None else None
        while self._events:
            if misses is not None and misses.hopeless(self.now):
                break
            self.now, _, fn = heapq.heappop(self._events)
            fn()
            while self._events and self._events[0][0] == self.now:  # what happens at once, then the steps
                heapq.heappop(self._events)[2]()
            for group in self.groups:
                if not any(e.busy for e in group):
                    self._step(group)
        return self.outcomes

    def _at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._order), fn))

    def _arrive(self, i: int, r: Request) -> None:
        if self.layout.kind == "colocated":
            e = min(self.decode, key=lambda e: len(e.scheduler.running) + len(e.scheduler.waiting))
            self._add(e, i, r.prompt, r.max_tokens)
            return
        if self.decider is not None:
            d = self._least_busy_decode()
            decision, _ = self.decider.decide(len(r.prompt), self.prefill, d.url, len(d.owners))
            if decision == "local_prefill":
                leg = self._legs[i] = LocalPrefill(self.decider, d.url, len(r.prompt))
                leg.leg_started(self.now)
                self._add(d, i, r.prompt, r.max_tokens)
                return
        e = min(self.prefill, key=lambda e: e.queued_tokens)
        self._p_legs[i] = (self.now, e.queued_tokens + len(r.prompt))
        e.queued_tokens += len(r.prompt)
        self._add(e, i, r.prompt, 1)

    def _least_busy_decode(self) -> _Engine:
        return min(self.decode, key=lambda d: len(d.scheduler.running) + len(d.scheduler.waiting)
                   + len(d.scheduler.parked))

    def _add(self, e: _Engine, i: int, prompt: list[int], max_tokens: int, first_token: int | None = None) -> None:
        seq = Sequence(list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=str(i))
        e.owners[seq.id] = i
        if first_token is not None:
            e.pull.remote[seq.id] = first_token
        e.scheduler.add(seq)

    def _step(self, group: list[_Engine]) -> None:
        """One step of a lockstep group (one engine without lockstep): it lasts the slowest
        rank's batch; ranks with nothing to run wait it out."""
        batches, seconds = [], 0.0
        for e in group:
            batch = e.scheduler.schedule()
            if e.pull is not None:
                self._start_pulls(e)
            for seq in e.scheduler.take_rejected():  # unschedulable (longer than the pool)
                self._end(e.owners.pop(seq.id), failed=True)
            if batch is None or not batch.seqs:
                continue
            seconds = max(seconds, self.profile.step_seconds(StepShape.of(
                batch.is_prefill, batch.num_scheduled_tokens.tolist(), batch.num_computed_tokens.tolist())))
            output = ScheduledBatchOutput(batch.seq_ids,
                                          [[SIM_TOKEN] if s else [] for s in batch.needs_sample.tolist()])
            batches.append((e, batch, output))
        if not batches:
            return
        for e in group:
            e.busy = True
        self._at(self.now + seconds, lambda: self._group_done(group, batches))

    def _group_done(self, group: list[_Engine], batches: list) -> None:
        for e in group:
            e.busy = False
        for e, batch, output in batches:
            self._step_done(e, batch, output)

    def _step_done(self, e: _Engine, batch, output) -> None:
        e.busy = False
        if batch.is_prefill and e in self.prefill:
            e.queued_tokens -= int(batch.num_scheduled_tokens.sum())
        for update in e.scheduler.postprocess(batch, output):
            self._tokens(e, update)

    def _tokens(self, e: _Engine, update) -> None:
        i = e.owners.get(update.seq.id)
        if i is None:
            return
        out = self.outcomes[i]
        if e in self.prefill:  # P's leg is done: to the least busy D
            if update.finished:
                del e.owners[update.seq.id]
                started, tokens = self._p_legs.pop(i)
                if self.decider is not None:  # as the router learns P's rate, then the transfer
                    self.decider.observe_prefill(e.url, tokens, self.now - started)
                    self._legs[i] = (e.url, self.now)
                self._add(self._least_busy_decode(), i, update.seq.token_ids[:update.seq.num_prompt_tokens],
                          out.num_tokens, first_token=SIM_TOKEN)
            return
        if update.new_token_ids and out.first_token_s is None:
            out.first_token_s = self.now
            if self._misses is not None:
                self._misses.first_token(i)
            leg = self._legs.pop(i, None)
            if isinstance(leg, LocalPrefill):
                leg.first_event(self.now)
            elif leg is not None:
                self.decider.observe_transfer(leg[0], self.now - leg[1])
        if update.finished:
            del e.owners[update.seq.id]
            out.finish_s = self.now
            self._end(i)

    def _end(self, i: int, failed: bool = False) -> None:
        self.outcomes[i].failed |= failed
        if self._misses is not None:
            self._misses.ended(i)

    def _start_pulls(self, e: _Engine) -> None:
        for seq, blocks in e.pull.started:
            begin = max(self.now, e.link_free_s)
            e.link_free_s = begin + blocks * self.block_bytes / self.profile.link.bandwidth
            self._at(e.link_free_s + self.profile.link.latency_s, lambda seq=seq: self._landed(e, seq))
        e.pull.started = []

    def _landed(self, e: _Engine, seq: Sequence) -> None:
        e.scheduler.update_from_kv_connector_output(KVConnectorOutput(finished_recving=[seq.id]))
        for update in e.scheduler.take_first_tokens():
            self._tokens(e, update)


# ---------------------------------------------------------------------- workloads and SLOs


class Workload(msgspec.Struct, frozen=True, kw_only=True):
    """Poisson arrivals; prompt and output lengths uniform in [mean * (1 - spread), mean *
    (1 + spread)]; `prefix_share` of each prompt is one of `num_prefixes` shared prefixes.
    A trace holds `num_requests`, or more so that it lasts `min_duration_s`: past capacity a
    queue grows with the trace's length, so a trace shorter than a few TTFT SLOs passes at
    any rate (its whole burst is served inside the SLO)."""

    input_len: int
    output_len: int
    spread: float = 0.5
    prefix_share: float = 0.0
    num_prefixes: int = 8
    num_requests: int = 300
    min_duration_s: float = 0.0
    seed: int = 0

    def requests(self, rate: float, vocab: int = 32000) -> list[Request]:
        """The same draws at every rate (only the arrival times scale): goodput searches see
        one workload."""
        n = max(self.num_requests, math.ceil(rate * self.min_duration_s))
        rng = np.random.default_rng(self.seed)
        gaps = rng.exponential(1.0, n)
        lo, hi = 1 - self.spread, 1 + self.spread
        ins = np.maximum(1, (self.input_len * rng.uniform(lo, hi, n)).astype(int))
        outs = np.maximum(1, (self.output_len * rng.uniform(lo, hi, n)).astype(int))
        prefixes = [rng.integers(10, vocab, int(self.input_len * self.prefix_share)).tolist()
                    for _ in range(self.num_prefixes)]
        which = rng.integers(0, self.num_prefixes, n)
        arrivals = np.cumsum(gaps) / rate
        out = []
        for k in range(n):
            shared = prefixes[which[k]][:int(ins[k])]
            own = rng.integers(10, vocab, int(ins[k]) - len(shared)).tolist()
            out.append(Request(float(arrivals[k]), shared + own, int(outs[k])))
        return out


class SLO(msgspec.Struct, frozen=True):
    ttft_s: float
    tpot_s: float
    attainment: float = 0.9  # DistServe's: the share of requests that must meet both


def meets(o: Outcome, slo: SLO) -> bool:
    return not o.failed and o.finish_s is not None and o.ttft <= slo.ttft_s and o.tpot <= slo.tpot_s


def attainment(outcomes: list[Outcome], slo: SLO) -> float:
    return sum(1 for o in outcomes if meets(o, slo)) / len(outcomes)


class _Misses:
    """Counts the requests that can no longer meet the SLO at virtual time `now`: finished
    (or failed) outside it, or still without a first token past their TTFT SLO. Each
    request is judged by TTFT in arrival order (outcomes are in arrival order), by TPOT once
    unfinished past its TPOT deadline (first token + TPOT SLO x its other tokens), and when
    it ends."""

    def __init__(self, outcomes: list[Outcome], slo: SLO) -> None:
        self.outcomes, self.slo = outcomes, slo
        self.allowed = len(outcomes) - math.ceil(slo.attainment * len(outcomes) - 1e-9)
        self.judged_ttft = 0  # outcomes[:judged_ttft] passed their TTFT check or count as missed
        self.missed: set[int] = set()
        self.deadlines: list[tuple[float, int]] = []  # (TPOT deadline, request) heap

    def hopeless(self, now: float) -> bool:
        while self.judged_ttft < len(self.outcomes):
            o = self.outcomes[self.judged_ttft]
            if o.arrival_s + self.slo.ttft_s >= now and o.first_token_s is None:
                break  # may still make it
            if o.first_token_s is None or o.ttft > self.slo.ttft_s:
                self.missed.add(self.judged_ttft)
            self.judged_ttft += 1
        while self.deadlines and self.deadlines[0][0] < now:
            i = heapq.heappop(self.deadlines)[1]
            if self.outcomes[i].finish_s is None:
                self.missed.add(i)
        return len(self.missed) > self.allowed

    def first_token(self, i: int) -> None:
        o = self.outcomes[i]
        heapq.heappush(self.deadlines, (o.first_token_s + self.slo.tpot_s * max(0, o.num_tokens - 1), i))

    def ended(self, i: int) -> None:
        if not meets(self.outcomes[i], self.slo):
            self.missed.add(i)


def max_goodput(profile: Profile, layout: Layout, workload: Workload, slo: SLO, max_model_len: int = 8192,
                iterations: int = 12) -> float:
    """The highest request rate (req/s) whose simulated SLO attainment is >= slo.attainment
    (DistServe's goodput): doubling to bracket it, then bisection."""
    def holds(rate: float) -> bool:
        fleet = Fleet(profile, layout, max_model_len=max_model_len, prefix_caching=workload.prefix_share > 0)
        return attainment(fleet.run(workload.requests(rate), stop_below=slo), slo) >= slo.attainment

    rate = 1.0
    if holds(rate):
        while holds(rate * 2):
            rate *= 2
            if rate > 1e5:
                raise ValueError(f"{layout.label()} meets the SLO at {rate:g} req/s: the trace is too short "
                                 f"to load it (raise num_requests or min_duration_s)")
        lo, hi = rate, rate * 2
    else:
        for _ in range(20):
            rate /= 2
            if holds(rate):
                break
        else:
            return 0.0
        lo, hi = rate, rate * 2
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if holds(mid):
            lo = mid
        else:
            hi = mid
    return lo
