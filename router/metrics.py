"""The router's Prometheus metrics (`atomd_router:` prefix, docs/design.md "Metrics").

Latencies are measured as the client sees them: from the request's arrival at the
router to the first SSE event it wrote (TTFT), between successive events it wrote
(ITL), to the last byte (request latency). Worker health, breaker state, load and the
KV-events index are read at scrape time, so they are never stale.

Hot-path counters are plain dicts rendered by a collector (a prometheus_client child's
`inc()` takes a lock per call); histograms keep their own buckets and also feed the
dashboard's recent-latency windows.
"""
from __future__ import annotations

import bisect
from collections import deque
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from router.workers import CircuitBreaker, Worker

P = "atomd_router:"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
HIT_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)
RECENT = 512  # values kept per series for the dashboard's percentiles


class Hist:
    """A histogram without locks (the router's loop is its only writer)."""

    __slots__ = ("bounds", "counts", "sum", "recent")

    def __init__(self, bounds: tuple):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.recent: deque[float] = deque(maxlen=RECENT)

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.sum += v
        self.recent.append(v)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def buckets(self) -> list[tuple[str, float]]:
        out, acc = [], 0
        for b, c in zip(self.bounds, self.counts):
            acc += c
            out.append((_fmt(b), acc))
        out.append(("+Inf", acc + self.counts[-1]))
        return out


def _fmt(b: float) -> str:
    return repr(float(b))


def percentile(values: Iterable[float], q: float) -> float | None:
    xs = sorted(values)
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class EndpointMetrics:
    __slots__ = ("request_latency", "ttft", "itl")

    def __init__(self) -> None:
        self.request_latency = Hist(LATENCY_BUCKETS)
        self.ttft = Hist(LATENCY_BUCKETS)
        self.itl = Hist(ITL_BUCKETS)


class Counts(dict):
    """{label values tuple: count}."""

    def inc(self, key: tuple, n: float = 1) -> None:
        self[key] = self.get(key, 0) + n


class RouterMetrics:
    """One registry per router instance (several routers can live in one test process)."""

    def __init__(self, workers: Callable[[], Iterable[Worker]], extra: Callable[[], list[Metric]] | None = None):
        self.workers = workers
        self.extra = extra
        self.requests = Counts()  # (endpoint, status)
        self.endpoints: dict[str, EndpointMetrics] = {}
        self.legs = {"prefill": Hist(LATENCY_BUCKETS), "decode": Hist(LATENCY_BUCKETS),
                     "worker": Hist(LATENCY_BUCKETS)}
        self.retries = Counts()  # (leg,)
        # (decision,) / (decision, reason): relay decisions; (role, policy, decision): policy choices
        self.decisions = Counts()
        self.fallbacks = Counts()  # (reason,)
        self.upstream_errors = Counts()  # (leg, reason)
        self.rejected = Counts()  # (reason,)
        self.aborts = 0
        self.client_kv_params_dropped = 0
        self.kv_hit = {"prefill": Hist(HIT_BUCKETS), "decode": Hist(HIT_BUCKETS), "worker": Hist(HIT_BUCKETS)}
        self.queue_state: Callable[[], tuple[int, int]] = lambda: (0, 0)  # (active, queued)
        self.adaptive: Callable[[], dict] | None = None  # --pd-mode adaptive: the decider's estimates
        self._with_workers = True
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def endpoint(self, name: str) -> EndpointMetrics:
        m = self.endpoints.get(name)
        if m is None:
            m = self.endpoints[name] = EndpointMetrics()
        return m

    def decide(self, role: str) -> Callable[[str, str], None]:
        """The callback a role's policy counts its choices with."""
        inc = self.decisions.inc
        return lambda policy, decision: inc((role, policy, decision))

    def observe_hit(self, role: str, tokens: int) -> None:
        self.kv_hit[role].observe(tokens)

    def render(self, workers: bool = True) -> bytes:
        """`workers=False`: without the per-worker series (their `worker` label is an engine's
        URL: the cluster's layout, for callers the router trusts with it)."""
        self._with_workers = workers
        try:
            return generate_latest(self.registry)
        finally:
            self._with_workers = True

    # ------------------------------------------------------------------ collector

    def describe(self):
        return []

    def collect(self):
        req = CounterMetricFamily(P + "requests", "requests answered, by endpoint and HTTP status "
                                  "(or client_disconnect)", labels=["endpoint", "status"])
        for (endpoint, status), v in sorted(self.requests.items()):
            req.add_metric([endpoint, status], v)
        yield req
        for name, doc, attr in (("e2e_request_latency_seconds", "arrival at the router to the last byte sent",
                                 "request_latency"),
                                ("time_to_first_token_seconds", "arrival at the router to the first SSE event sent",
                                 "ttft"),
                                ("inter_token_latency_seconds", "gap between SSE events sent", "itl")):
            fam = HistogramMetricFamily(P + name, doc, labels=["endpoint"])
            for endpoint, m in sorted(self.endpoints.items()):
                h = getattr(m, attr)
                fam.add_metric([endpoint], h.buckets(), h.sum)
            yield fam
        legs = HistogramMetricFamily(P + "leg_latency_seconds", "one upstream leg, send to last byte",
                                     labels=["leg"])
        for leg, h in self.legs.items():
            if h.count or leg != "worker":
                legs.add_metric([leg], h.buckets(), h.sum)
        yield legs
        hit = HistogramMetricFamily(P + "kv_aware_expected_hit_tokens", "prompt tokens the kv_aware policy "
                                    "expected the chosen worker to hold, per choice", labels=["role"])
        for role, h in self.kv_hit.items():
            if h.count:
                hit.add_metric([role], h.buckets(), h.sum)
        yield hit
        retries = CounterMetricFamily(P + "retries", "legs sent again on another (or the same) worker",
                                      labels=["leg"])
        for leg in ("prefill", "decode", "worker"):
            if leg != "worker" or (leg,) in self.retries:
                retries.add_metric([leg], self.retries.get((leg,), 0))
        yield retries
        # relay decisions carry {decision}, adaptive / strict PD {decision, reason}, policy choices
        # {role, policy, decision}
        dec = Metric(P + "decision", "routing decisions: the relay's (pd, decode_without_kv, no_prefill_worker, "
                     "no_decode_worker, colocated, ...; with --pd-mode adaptive|strict pd / local_prefill by "
                     "reason) and each policy's choices by role", "counter")
        for key, v in sorted(self.decisions.items()):
            labels = {"decision": key[0]} if len(key) == 1 else {"decision": key[0], "reason": key[1]} \
                if len(key) == 2 else {"role": key[0], "policy": key[1], "decision": key[2]}
            dec.add_sample(P + "decision_total", labels, v)
        yield dec
        fb = CounterMetricFamily(P + "fallbacks", "requests served another way than two legs with KV moved, "
                                 "by reason (--strict-pd makes them errors)", labels=["reason"])
        for (reason,), v in sorted(self.fallbacks.items()):
            fb.add_metric([reason], v)
        yield fb
        up = CounterMetricFamily(P + "upstream_errors", "failed legs by reason", labels=["leg", "reason"])
        for (leg, reason), v in sorted(self.upstream_errors.items()):
            up.add_metric([leg, reason], v)
        yield up
        rej = CounterMetricFamily(P + "rejected", "requests refused before routing: queue_full (429), "
                                  "queue_timeout (429)", labels=["reason"])
        for (reason,), v in sorted(self.rejected.items()):
            rej.add_metric([reason], v)
        yield rej
        aborts = CounterMetricFamily(P + "kv_transfer_aborts", "POST /kv_transfer/abort sent to a prefill "
                                     "worker for a transfer no decode worker pulled")
        aborts.add_metric([], self.aborts)
        yield aborts
        dropped = CounterMetricFamily(P + "client_kv_params_dropped", "client requests whose own "
                                      "kv_transfer_params the router dropped (only it writes them)")
        dropped.add_metric([], self.client_kv_params_dropped)
        yield dropped
        active, queued = self.queue_state()
        g = GaugeMetricFamily(P + "requests_active", "routing slots in use (under --max-concurrent-requests; "
                              "a completions request of several prompts takes one per prompt)")
        g.add_metric([], active)
        yield g
        g = GaugeMetricFamily(P + "requests_queued", "requests waiting for a routing slot")
        g.add_metric([], queued)
        yield g
        if not self._with_workers:
            return
        healthy = GaugeMetricFamily(P + "worker_healthy", "1 when the worker's last health check passed",
                                    labels=["worker", "role"])
        breaker = GaugeMetricFamily(P + "circuit_breaker_state",
                                    "circuit breaker per worker: 0 closed, 1 open, 2 half-open", labels=["worker", "role"])
        in_flight = GaugeMetricFamily(P + "worker_requests_in_flight", "legs in flight per worker",
                                      labels=["worker", "role"])
        tokens = GaugeMetricFamily(P + "worker_tokens_in_flight", "prompt tokens of the legs in flight per worker",
                                   labels=["worker", "role"])
        opened = CounterMetricFamily(P + "circuit_breaker_opened", "times a worker's breaker opened",
                                     labels=["worker", "role"])
        for w in self.workers():
            healthy.add_metric([w.url, w.role], float(w.healthy))
            breaker.add_metric([w.url, w.role], float(w.breaker.state))
            in_flight.add_metric([w.url, w.role], float(w.in_flight))
            tokens.add_metric([w.url, w.role], float(w.in_flight_tokens))
            opened.add_metric([w.url, w.role], w.breaker.times_opened)
        yield from (healthy, breaker, in_flight, tokens, opened)
        if self.adaptive is not None:
            yield from adaptive_families(self.adaptive())
        if self.extra is not None:
            yield from self.extra()


def adaptive_families(state: dict):
    """The adaptive-PD decider's learnt estimates (router/adaptive.py `PDDecider.describe`)."""
    rate = GaugeMetricFamily(P + "pd_prefill_tokens_per_second", "adaptive PD: each prefill worker's prefill "
                             "rate, a moving average over its completed legs", labels=["worker"])
    for url, v in sorted(state["prefill_tokens_per_s"].items()):
        rate.add_metric([url], v)
    transfer = GaugeMetricFamily(P + "pd_transfer_seconds", "adaptive PD: P's answer to D's first event, a "
                                 "moving average per prefill worker", labels=["worker"])
    for url, v in sorted(state["transfer_s"].items()):
        transfer.add_metric([url], v)
    local = GaugeMetricFamily(P + "pd_local_prefill_tokens_per_second", "adaptive PD: a local prefill's "
                              "uncached tokens, and the local ones in flight on D ahead of them, over its time to "
                              "first event on D, a moving average")
    local.add_metric([], state["local_tokens_per_s"])
    pending = GaugeMetricFamily(P + "pd_local_prefill_tokens_in_flight", "adaptive PD: uncached prompt tokens of "
                                "local prefills sent to each decode worker and not yet answered", labels=["worker"])
    for url, v in sorted(state["local_tokens_in_flight"].items()):
        pending.add_metric([url], v)
    itl = GaugeMetricFamily(P + "pd_decode_itl_seconds", "adaptive PD: the gap per token between the events "
                            "relayed from each decode worker, a moving average (--local-prefill-max-itl-ms)",
                            labels=["worker"])
    for url, v in sorted(state["decode_itl_s"].items()):
        itl.add_metric([url], v)
    return rate, transfer, local, pending, itl


BREAKER_NAMES = CircuitBreaker.NAMES
