"""The router's Prometheus metrics (`atomd_router:` prefix, docs/design.md "Metrics").

Latencies are measured as the client sees them: from the request's arrival at the
router to the first SSE event it wrote (TTFT), between successive events it wrote
(ITL), to the last byte (request latency). Worker health and breaker state are read
from the registry at scrape time, so they are never stale.
"""
from __future__ import annotations

from typing import Callable, Iterable, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from router.workers import Worker

P = "atomd_router:"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class _WorkerCollector:
    def __init__(self, workers: Callable[[], Iterable[Worker]]):
        self.workers = workers

    def collect(self):
        healthy = GaugeMetricFamily(P + "worker_healthy", "1 when the worker's last health check passed",
                                    labels=["worker", "role"])
        breaker = GaugeMetricFamily(P + "circuit_breaker_state",
                                    "circuit breaker per worker: 0 closed, 1 open, 2 half-open",
                                    labels=["worker", "role"])
        in_flight = GaugeMetricFamily(P + "worker_requests_in_flight", "legs in flight per worker",
                                      labels=["worker", "role"])
        for w in self.workers():
            healthy.add_metric([w.url, w.role], float(w.healthy))
            breaker.add_metric([w.url, w.role], float(w.breaker.state))
            in_flight.add_metric([w.url, w.role], float(w.in_flight))
        return [healthy, breaker, in_flight]


class EndpointMetrics(NamedTuple):
    request_latency: Histogram
    ttft: Histogram
    itl: Histogram


class RouterMetrics:
    """One registry per router instance (several routers can live in one test process)."""

    def __init__(self, workers: Callable[[], Iterable[Worker]]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(P + "requests", "requests answered, by endpoint and HTTP status "
                                "(or client_disconnect)", ["endpoint", "status"], registry=r)
        self.request_latency = Histogram(P + "e2e_request_latency_seconds",
                                         "arrival at the router to the last byte sent", ["endpoint"],
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds",
                              "arrival at the router to the first SSE event sent", ["endpoint"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "gap between SSE events sent",
                             ["endpoint"], buckets=ITL_BUCKETS, registry=r)
        self.leg_latency = Histogram(P + "leg_latency_seconds", "one upstream leg, send to last byte",
                                     ["leg"], buckets=LATENCY_BUCKETS, registry=r)
        self.retries = Counter(P + "retries", "legs sent again after a connection failure", ["leg"],
                               registry=r)
        self.decisions = Counter(P + "decision", "routing decisions: pd (two legs), decode_without_kv "
                                 "(P kept no KV, D prefills), no_prefill_worker, no_decode_worker",
                                 ["decision"], registry=r)
        self.upstream_errors = Counter(P + "upstream_errors", "failed legs by reason",
                                       ["leg", "reason"], registry=r)
        self.aborts = Counter(P + "kv_transfer_aborts", "POST /kv_transfer/abort sent to a prefill "
                              "worker for a transfer no decode worker pulled", registry=r)
        self.client_kv_params_dropped = Counter(P + "client_kv_params_dropped", "client requests whose own "
                                                "kv_transfer_params the router dropped (only it writes them)",
                                                registry=r)
        r.register(_WorkerCollector(workers))
        self._endpoints: dict[str, EndpointMetrics] = {}
        # Children used on every request, resolved once.
        self.prefill_leg = self.leg_latency.labels("prefill")
        self.decode_leg = self.leg_latency.labels("decode")
        self.decision_pd = self.decisions.labels("pd")

    def endpoint(self, name: str) -> "EndpointMetrics":
        """The per-endpoint series, resolved once (`labels()` is a lock and a dict lookup per call)."""
        if name not in self._endpoints:
            self._endpoints[name] = EndpointMetrics(self.request_latency.labels(name), self.ttft.labels(name),
                                                    self.itl.labels(name))
        return self._endpoints[name]

    def render(self) -> bytes:
        return generate_latest(self.registry)
