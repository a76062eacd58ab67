"""Prometheus metrics of one engine server (`GET /metrics`), vLLM's names under `atomd:`.

Two sources, one registry per server:
- request-level series (latency histograms, token and success counters) are observed by
  the API process as the deltas arrive;
- engine state (running / waiting, KV usage, prefix cache, preemptions) lives in the core,
  so `EngineStatsCollector` renders the snapshot fetched by a `stats` utility call at
  scrape time instead of mirroring it on every step.
Every series carries `model_name` and `dp_rank`.
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

LABELS = ("model_name", "dp_rank")
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class EngineStatsCollector:
    """Engine-side gauges and counters from the latest `LLMEngine.stats()` snapshot."""

    GAUGES = (("num_requests_running", "num_running", "Requests in the running queue."),
              ("num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
              ("kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV cache blocks in use (0-1)."))
    COUNTERS = (("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
                ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
                ("num_preemptions", "num_preemptions", "Sequences preempted (recompute)."),
                ("kv_window_released_blocks", "num_window_released_blocks",
                 "KV blocks returned to the pool while their sequence ran: wholly before every layer's sliding window."))

    def __init__(self, labels: tuple[str, str]):
        self.labels = list(labels)
        self.stats: dict[str, Any] = {}

    def collect(self):
        for name, key, doc in self.GAUGES:
            family = GaugeMetricFamily(f"atomd:{name}", doc, labels=LABELS)
            if key in self.stats:
                family.add_metric(self.labels, float(self.stats[key]))
            yield family
        for name, key, doc in self.COUNTERS:
            family = CounterMetricFamily(f"atomd:{name}", doc, labels=LABELS)
            if key in self.stats:
                family.add_metric(self.labels, float(self.stats[key]))
            yield family
        kv = self.stats.get("kv_transfer")
        if kv:  # a producer or consumer engine (PD)
            yield from self.collect_kv_transfer(kv)
        if any(rank.get("spec_decode") for rank in self.stats.get("ranks", [self.stats])):  # speculation on
            yield from self.collect_spec_decode(self.stats)

    SPEC_COUNTERS = (("spec_decode_num_drafts", "Verify steps of a sequence with drafts."),
                     ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified."),
                     ("spec_decode_num_accepted_tokens", "Draft tokens accepted."))

    def collect_spec_decode(self, stats: dict[str, Any]):
        """vLLM's spec_decode counters, the accepted drafts per position (position j: steps
        that accepted more than j drafts) and two gauges over the engine's life: the draft
        acceptance rate and the mean accepted length (tokens per verify step, the bonus included)."""
        for name, doc in self.SPEC_COUNTERS:
            family = CounterMetricFamily(f"atomd:{name}", doc, labels=LABELS)
            family.add_metric(self.labels, float(stats.get(name, 0)))
            yield family
        per_pos: dict[int, int] = {}
        for rank in stats.get("ranks", [stats]):
            for accepted, steps in ((rank.get("spec_decode") or {}).get("distribution") or {}).items():
                for pos in range(int(accepted)):
                    per_pos[pos] = per_pos.get(pos, 0) + steps
        family = CounterMetricFamily("atomd:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, "
                                     "by position in the draft.", labels=LABELS + ("position",))
        for pos in sorted(per_pos):
            family.add_metric(self.labels + [str(pos)], float(per_pos[pos]))
        yield family
        drafts, steps = stats.get("spec_decode_num_draft_tokens", 0), stats.get("spec_decode_num_drafts", 0)
        accepted = stats.get("spec_decode_num_accepted_tokens", 0)
        for name, value, doc in (
                ("spec_decode_draft_acceptance_rate", accepted / drafts if drafts else 0.0,
                 "Accepted / proposed draft tokens."),
                ("spec_decode_mean_accepted_length", 1 + accepted / steps if steps else 0.0,
                 "Tokens per verify step: accepted drafts plus the token sampled after them.")):
            family = GaugeMetricFamily(f"atomd:{name}", doc, labels=LABELS)
            family.add_metric(self.labels, value)
            yield family

    def collect_kv_transfer(self, kv: dict[str, Any]):
        """PD series: bytes moved (sent on P, received on D), refusals and failed pulls by
        reason, leases expired and blocks pinned (P), pull durations and fallbacks (D)."""
        def one(family, value):
            family.add_metric(self.labels, float(value))
            return family

        yield one(CounterMetricFamily("atomd:kv_transfer_bytes", "KV bytes sent (producer) or received "
                                      "(consumer) over the side channel.", labels=LABELS), kv["bytes"])
        yield one(CounterMetricFamily("atomd:kv_leases_expired", "Transfers whose lease expired without "
                                      "DONE or ABORT (producer).", labels=LABELS), kv["leases_expired"])
        yield one(GaugeMetricFamily("atomd:kv_blocks_pinned", "KV blocks pinned for a consumer's pull "
                                    "(producer).", labels=LABELS), kv["blocks_pinned"])
        for name, key, doc in (("kv_transfer_failures", "failures", "Refused reads (producer) or failed "
                                "pulls (consumer), by reason."),
                               ("pd_fallback", "fallbacks", "Failed pulls recomputed locally (consumer), "
                                "by reason."),
                               ("kv_params_refused", "params_refused", "Requests whose kv_transfer_params "
                                "were not trusted (consumer), by reason; refused before any connection.")):
            family = CounterMetricFamily(f"atomd:{name}", doc, labels=LABELS + ("reason",))
            for reason, n in sorted(kv.get(key, {}).items()):
                family.add_metric(self.labels + [reason], float(n))
            yield family
        seconds = kv["seconds"]
        cumulative, buckets = 0, []
        for bound, n in zip([*map(str, seconds["buckets"]), "+Inf"], seconds["counts"]):
            cumulative += n
            buckets.append((bound, cumulative))
        family = HistogramMetricFamily("atomd:kv_transfer_seconds", "Duration of a consumer's pull, READ "
                                       "to END.", labels=LABELS)
        family.add_metric(self.labels, buckets, seconds["sum"])
        yield family


class ServerMetrics:
    def __init__(self, model_name: str, dp_rank: int = 0):
        self.registry = CollectorRegistry()
        labels = (model_name, str(dp_rank))
        self.engine = EngineStatsCollector(labels)
        self.registry.register(self.engine)
        self.registry.register(PrefillDelayerCollector(self.engine, model_name))
        self.registry.register(ExpertLoadCollector(self.engine, model_name))

        def hist(name: str, doc: str, buckets=LATENCY_BUCKETS):
            return Histogram(f"atomd:{name}", doc, LABELS, buckets=buckets,
                             registry=self.registry).labels(*labels)

        def counter(name: str, doc: str):
            return Counter(f"atomd:{name}", doc, LABELS, registry=self.registry).labels(*labels)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token, as the API sees it.")
        self.itl = hist("inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Request latency from arrival to the last token.")
        self.queue = hist("request_queue_time_seconds", "Time in the waiting queue.")
        self.prefill = hist("request_prefill_time_seconds", "First schedule to first token.")
        self.decode = hist("request_decode_time_seconds", "First token to the last token.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._success = Counter("atomd:request_success", "Finished requests by finish reason.",
                                LABELS + ("finished_reason",), registry=self.registry)
        self._labels = labels

    def on_tokens(self, n: int, since_last_s: float | None) -> None:
        """`n` new tokens arrived; `since_last_s` is None for the request's first ones."""
        self.generation_tokens.inc(n)
        if since_last_s is None:
            return
        for _ in range(n):  # a coalesced delta spreads its gap over its tokens
            self.itl.observe(since_last_s / n)

    def on_aborted(self) -> None:
        """The engine confirmed an abort (the client went away): finished_reason="abort"."""
        self._success.labels(*self._labels, "abort").inc()

    def on_finished(self, finish_reason: str, num_prompt_tokens: int, e2e_s: float,
                    timing: tuple | None) -> None:
        self._success.labels(*self._labels, finish_reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.e2e.observe(e2e_s)
        if not timing:
            return
        arrival, scheduled, first_token, finished = timing
        for hist, start, end in ((self.queue, arrival, scheduled), (self.prefill, scheduled, first_token),
                                 (self.decode, first_token, finished)):
            if start is not None and end is not None:
                hist.observe(max(0.0, end - start))

    def render(self, engine_stats: dict[str, Any] | None) -> bytes:
        if engine_stats is not None:
            self.engine.stats = engine_stats
        return generate_latest(self.registry)


HOLD_TICK_BUCKETS = (0, 1, 2, 5, 10, 20, 30, 50, 100, 200)


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


class ExpertLoadCollector:
    """MoE models: `atomd:expert_tokens_total{expert}` per dp_rank, the (token, choice) pairs
    each expert held on that rank ran (summed over the sparse layers), so imbalance shows;
    with expert parallelism `atomd:expert_parallel_exchange_seconds_total` too, the time a
    rank spent in the sparse layers' all-to-alls (waiting on the slowest rank included), and
    with --enable-eplb `atomd:expert_parallel_rebalances_total` (replica placements computed)."""

    def __init__(self, engine_stats: Any, model_name: str):
        self.engine_stats, self.model_name = engine_stats, model_name

    def collect(self):
        labels = ["model_name", "dp_rank"]
        tokens = CounterMetricFamily("atomd:expert_tokens", "(token, choice) pairs an expert ran, over the "
                                     "sparse layers, per rank holding it.", labels=labels + ["expert"])
        exchange = CounterMetricFamily("atomd:expert_parallel_exchange_seconds", "Seconds a rank spent in "
                                       "the expert-parallel all-to-alls.", labels=labels)
        rebalances = CounterMetricFamily("atomd:expert_parallel_rebalances", "Hot-expert replica placements "
                                         "computed (--enable-eplb).", labels=labels)
        stats = self.engine_stats.stats or {}
        for rank_stats in stats.get("ranks", [stats]):
            lv = [self.model_name, str(rank_stats.get("dp_rank", 0))]
            for expert, n in rank_stats.get("expert_tokens") or ():
                tokens.add_metric(lv + [str(expert)], n)
            ep = rank_stats.get("expert_parallel")
            if ep:
                exchange.add_metric(lv, ep["exchange_s"])
                rebalances.add_metric(lv, ep["num_rebalances"])
        yield tokens
        yield exchange
        yield rebalances
