"""Data parallelism inside one engine server: N engine-core ranks behind one API process.

API side (`DPEngineClient`, no torch): one EngineCoreClient per rank, each with its own KV
cache and prefix cache. A new request goes to the least-loaded live rank (its requests in
flight, i.e. waiting + running there; ties to the lower rank) unless the body field
`data_parallel_rank` or the header `X-data-parallel-rank` names one; it stays on that rank
for its lifetime (its stream lives in that rank's client, aborts follow it). The server is
ready only while every rank lives: a DP engine with a dead rank is dead as a unit (vLLM's
rule), though the requests already on the live ranks run to their end.

Rank side (`DPEngineCore`): with `--prefill-delayer` or `--dp-lockstep` the ranks join one
gloo group (atomd/dp_collective.py) and every rank steps every tick, an idle rank an empty
pass, because each tick holds exactly one delayer collective (and one lockstep all-reduce)
that every rank must join. So the loop never blocks on its socket longer than IDLE_TICK_MS.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
from typing import Any, Callable

import msgspec
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from atomd import protocol as P
from atomd.core import EngineCore, EngineCoreClient, EngineDeadError, Ready, RequestStream, StepOutputs, \
    UtilityCall, UtilityResult, to_delta

logger = logging.getLogger("atomd.dp")

IDLE_TICK_MS = 5  # an idle rank's wait on its socket between (empty) ticks
RANK_HEADER = "X-data-parallel-rank"
HOLD_TICK_BUCKETS = (0, 1, 2, 5, 10, 20, 30, 50, 100, 200)
_SUMMED = ("num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "prefix_cache_queries",
           "prefix_cache_hits", "num_preemptions")


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the ranks' gloo rendezvous (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ticks_every_rank(config: Any) -> bool:
    return config.data_parallel_size > 1 and (config.prefill_delayer != "off" or config.dp_lockstep)


def rank_config(config: Any, rank: int, master_port: int) -> Any:
    """Rank `rank`'s EngineConfig: its index, the group's port, its KV-events port (+ rank)."""
    events = config.kv_events_endpoint
    if events is not None:
        m = re.fullmatch(r"(.*:)(\d+)", events)
        if m is None:
            raise ValueError(f"kv_events_endpoint must end in :PORT with data_parallel_size > 1, got {events!r}")
        events = f"{m.group(1)}{int(m.group(2)) + rank}"
    return msgspec.structs.replace(config, data_parallel_rank=rank, dp_master_port=master_port,
                                   kv_events_endpoint=events)


# ---------------------------------------------------------------- the API side

class _RankField(msgspec.Struct):
    data_parallel_rank: int | None = None


async def requested_dp_rank(request: Any, size: int) -> int | None:
    """The rank a request asks for (body field first, then header), or None; a 400 when bad."""
    try:
        rank = msgspec.json.decode(await request.read(), type=_RankField).data_parallel_rank
    except (msgspec.ValidationError, msgspec.DecodeError):
        raise P.invalid("data_parallel_rank", "data_parallel_rank must be an integer") from None
    if rank is None and RANK_HEADER in request.headers:
        try:
            rank = int(request.headers[RANK_HEADER])
        except ValueError:
            raise P.invalid("data_parallel_rank", f"{RANK_HEADER} must be an integer") from None
    if rank is not None and not 0 <= rank < size:
        raise P.invalid("data_parallel_rank", f"data_parallel_rank must be in [0, {size}), got {rank}")
    return rank


def make_engine_client(config: Any, on_abort_confirmed: Callable[[], None] | None = None):
    if config.data_parallel_size == 1:
        return EngineCoreClient(config, on_abort_confirmed=on_abort_confirmed)
    return DPEngineClient(config, on_abort_confirmed=on_abort_confirmed)


class DPEngineClient:
    """EngineCoreClient's interface over N ranks (see the module docstring)."""

    def __init__(self, config: Any, on_abort_confirmed: Callable[[], None] | None = None):
        port = config.dp_master_port or free_port()
        self.config = config
        self.ranks = [EngineCoreClient(rank_config(config, r, port), on_abort_confirmed=on_abort_confirmed)
                      for r in range(config.data_parallel_size)]

    async def start(self, timeout_s: float = 600.0) -> Ready:
        readies = await asyncio.gather(*(c.start(timeout_s) for c in self.ranks))
        return readies[0]

    @property
    def alive(self) -> bool:
        return all(c.alive for c in self.ranks)

    @property
    def dead(self) -> str | None:
        return next((f"DP rank {r}: {c.dead}" for r, c in enumerate(self.ranks) if c.dead is not None), None)

    @property
    def streams(self) -> dict[str, RequestStream]:
        return {rid: s for c in self.ranks for rid, s in c.streams.items()}

    @property
    def aborting(self) -> set[str]:
        return set().union(*(c.aborting for c in self.ranks))

    def place(self, dp_rank: int | None) -> int:
        if dp_rank is not None:
            return dp_rank
        live = [r for r, c in enumerate(self.ranks) if c.dead is None]
        if not live:
            raise EngineDeadError(self.dead)
        return min(live, key=lambda r: (len(self.ranks[r].streams) + len(self.ranks[r].aborting), r))

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any,
                    kv_transfer_params: dict | None = None, dp_rank: int | None = None) -> RequestStream:
        return self.ranks[self.place(dp_rank)].add_request(request_id, prompt_token_ids, params,
                                                           kv_transfer_params)

    def rank_of(self, request_id: str) -> int | None:
        return next((r for r, c in enumerate(self.ranks) if request_id in c.streams), None)

    def abort(self, request_id: str) -> None:
        rank = self.rank_of(request_id)
        if rank is not None:
            self.ranks[rank].abort(request_id)

    async def call(self, method: str, *args: Any, timeout_s: float = 5.0) -> Any:
        """`stats`: the ranks' sums plus `ranks`, each rank's own; `kv_transfer_info`: rank 0's
        answer plus `ranks` (each rank has its own side channel); `kv_transfer_abort`: True when
        the rank holding the transfer revoked it; any other utility (e.g. reset_prefix_cache)
        runs on every rank and answers True when every rank did."""
        results = await asyncio.gather(*(c.call(method, *args, timeout_s=timeout_s) for c in self.ranks))
        if method == "kv_transfer_info":
            return {**results[0], "ranks": results}
        if method == "kv_transfer_abort":
            return any(results)
        if method != "stats":
            return all(results)
        total: dict[str, Any] = {k: sum(s.get(k, 0) for s in results) for k in _SUMMED}
        total["kv_cache_usage"] = sum(s["kv_cache_usage"] for s in results) / len(results)
        total["ranks"] = results
        return total

    async def shutdown(self, timeout_s: float = 5.0) -> None:
        await asyncio.gather(*(c.shutdown(timeout_s) for c in self.ranks if c.proc is not None))


class PrefillDelayerCollector:
    """`atomd:prefill_delayer_outcomes_total{policy,outcome,reason}` and the histogram
    `atomd:prefill_delayer_hold_ticks` (ticks each admitted prefill was held), per dp_rank,
    from the latest stats snapshot the server's EngineStatsCollector holds."""

    def __init__(self, engine_stats: Any, model_name: str):
        self.engine_stats, self.model_name = engine_stats, model_name

    def collect(self):
        labels = ["model_name", "dp_rank"]
        outcomes = CounterMetricFamily("atomd:prefill_delayer_outcomes", "PrefillDelayer decisions.",
                                       labels=labels + ["policy", "outcome", "reason"])
        holds = HistogramMetricFamily("atomd:prefill_delayer_hold_ticks",
                                      "Ticks an admitted prefill was held by the PrefillDelayer.", labels=labels)
        stats = self.engine_stats.stats or {}
        for rank_stats in stats.get("ranks", [stats]):
            delayer = rank_stats.get("prefill_delayer")
            if not delayer:
                continue
            lv = [self.model_name, str(rank_stats.get("dp_rank", 0))]
            for policy, outcome, reason, n in delayer["outcomes"]:
                outcomes.add_metric(lv + [policy, outcome, reason], n)
            counts = dict(delayer["hold_ticks"])
            buckets = [(str(b), sum(n for h, n in counts.items() if h <= b)) for b in HOLD_TICK_BUCKETS]
            buckets.append(("+Inf", sum(counts.values())))
            holds.add_metric(lv, buckets, sum_value=sum(h * n for h, n in counts.items()))
        yield outcomes
        yield holds


# ---------------------------------------------------------------- the rank side

def make_engine_core(engine: Any, inp: Any, out: Any, parent_pid: int) -> EngineCore:
    """The core loop for this rank: the plain one, or one that ticks with the DP group."""
    cfg = engine.config
    if cfg.prefill_delayer == "off" and not ticks_every_rank(cfg):
        return EngineCore(engine, inp, out, parent_pid)
    return DPEngineCore(engine, inp, out, parent_pid)


class DPEngineCore(EngineCore):
    def __init__(self, engine: Any, inp: Any, out: Any, parent_pid: int):
        from atomd.dp_collective import GlooCollective, Lockstep, make_prefill_delayer
        from scheduler.prefill_delayer import SingleRank

        super().__init__(engine, inp, out, parent_pid)
        cfg = engine.config
        self.rank, self.ticks = cfg.data_parallel_rank, ticks_every_rank(cfg)
        # joins the group: returns once every rank has built its engine
        self.collective = GlooCollective(cfg.data_parallel_rank, cfg.data_parallel_size, cfg.dp_master_port,
                                         timeout_s=cfg.dp_collective_timeout_s) if self.ticks else SingleRank()
        self.delayer = None
        if cfg.prefill_delayer != "off":
            self.delayer = make_prefill_delayer(cfg, self.collective)
            engine.scheduler.prefill_delayer = self.delayer  # asked every tick by schedule()
        self.lockstep = Lockstep(self.collective) if cfg.dp_lockstep and self.ticks else None

    def run(self) -> None:
        if not self.ticks:
            return super().run()
        while self.collective.broken is None:
            busy = self.engine.has_unfinished_requests()
            if self.inp.poll(0 if busy else IDLE_TICK_MS):
                self.drain_input()
            elif not busy and os.getppid() != self.parent_pid:
                return
            outputs = self.engine.step()  # every tick, idle or not: the group's collectives need every rank
            if self.lockstep is not None:
                self.lockstep.end_of_step()
            if outputs:
                self.send(StepOutputs([to_delta(o) for o in outputs]))
        # A peer is gone (its failure was counted): serve what this rank has, alone and
        # without the delayer, rather than fail open (and log it) on every tick from here on.
        logger.error("DP rank %d: the DP group is broken (%s); running alone", self.rank, self.collective.broken)
        self.engine.scheduler.prefill_delayer = self.lockstep = None
        super().run()

    def call_utility(self, call: UtilityCall) -> UtilityResult:
        res = super().call_utility(call)
        if call.method == "stats" and res.error is None:
            res.result = dict(res.result, dp_rank=self.rank,
                              prefill_delayer=self.delayer.stats() if self.delayer else None,
                              lockstep_errors=self.lockstep.num_errors if self.lockstep else 0)
        return res
