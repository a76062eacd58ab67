"""The online planner: scale a PD cluster's prefill and decode pools from the router's
latencies (issue #38). Standard library + the Prometheus text parser; no torch.

Every `window_s` the loop reads the router's /metrics and takes, over the window, the p90 of
`time_to_first_token_seconds` (the prefill pool's signal) and of
`inter_token_latency_seconds` (the decode pool's), from the histograms' bucket deltas (the
upper bound of the bucket holding the 90th percentile). Per pool, with its SLO:

* above `up` x SLO for `up_windows` windows in a row: one engine more (up to `max`);
* below `down` x SLO (or no traffic) for `down_windows` windows in a row: one fewer (down to
  `min`), by draining: the newest engine leaves the router's rotation (DELETE /workers; the
  router lets its requests in flight finish), the loop waits until the engine has nothing
  running, waiting, in flight or pinned for a consumer, records that its whole KV pool is
  free, then stops it;
* after any change the pool holds still for `cooldown_s` (for a scale-up, `up_cooldown_s`
  when set: a ramp adds engines a window apart); between `down` and `up` nothing happens
  (the hysteresis band);
* `learn_rates`: the arrival rate (the router's answered requests a second, over the last
  `rate_windows` windows) at which a pool size scaled up on latency is remembered; at
  `rate_margin` x that rate the same size counts as hot before its latency shows it, and a
  pool never drains into a size that ran hot at that rate (with coarse latency buckets, one
  engine fewer can go from "cold" straight to past the SLO: drain, queue, re-add).

Engines come from a `Launcher`: `ProcessLauncher` starts `atomd serve` children on this
host (tests, one-machine clusters, simulated fleets), `RayLauncher` (launch/ray_cluster.py)
engine actors, `StatefulSetLauncher` (launch/kubernetes.py) StatefulSet pods; engines that
already run join by `adopt`. The planner owns the router's membership of its pools: every
window it re-registers an engine of its pools the router lost (a restarted router).
`dry_run` reads and decides but changes nothing. `atomd-autoscale` (launch/autoscale_cli.py)
runs it from the command line.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from contracts.roles import Role
from launch.process import EngineServer, http

log = logging.getLogger("atomd.autoscale")

ROLES = ("prefill", "decode")
SIGNALS = {"prefill": "atomd_router:time_to_first_token_seconds", "decode": "atomd_router:inter_token_latency_seconds"}
SIGNAL_NAMES = {"prefill": "TTFT", "decode": "ITL"}
REQUESTS = "atomd_router:requests"  # the arrival rate's proxy: requests answered


@dataclass
class PoolPolicy:
    min: int
    max: int
    slo_s: float  # the pool's latency SLO (TTFT for prefill, ITL for decode)
    up: float = 0.9  # scale up above up x SLO ...
    down: float = 0.3  # ... down below down x SLO
    up_windows: int = 2
    down_windows: int = 3
    cooldown_s: float = 30.0
    # after a change, how long before the next scale-up (None: cooldown_s): on a ramp one more
    # engine may not be enough, and a fresh up_windows of hot windows already waited for it
    up_cooldown_s: float | None = None
    # learn, per pool size, the arrival rate at which it ran hot (a scale-up on latency), and
    # use it ahead of the latency: above rate_margin x that rate at the present size, scale up
    # (the rate's trend reaches it before the queue does); never drain to a size that ran hot
    # at rate_margin x the present rate or less (a drain, then a re-add after its queue built)
    learn_rates: bool = False
    rate_margin: float = 0.9

    def __post_init__(self) -> None:
        if not 1 <= self.min <= self.max:
            raise ValueError(f"pool bounds must be 1 <= min <= max, got {self.min}..{self.max}")
        if not 0 < self.down < self.up:
            raise ValueError(f"need 0 < down < up, got down={self.down} up={self.up}")


class Launcher(Protocol):
    def start(self, role: str) -> str: ...  # a ready engine's URL

    def stop(self, url: str) -> None: ...


class ProcessLauncher:
    """`atomd serve` children of this process, one per engine, with `flags[role]`."""

    def __init__(self, model: str | None, flags: dict[str, list[str]], log_dir: str | None = None,
                 ready_timeout_s: float = 300.0):
        self.model, self.flags, self.log_dir, self.ready_timeout_s = model, flags, log_dir, ready_timeout_s
        self.servers: dict[str, EngineServer] = {}

    def start(self, role: str) -> str:
        kv_role = Role(role).kv_role
        n = len(self.servers)
        logfile = f"{self.log_dir}/{role}-{n}.log" if self.log_dir else None
        server = EngineServer(self.model, "--kv-role", kv_role, *self.flags.get(role, []), log=logfile)
        server.wait_ready(self.ready_timeout_s)
        self.servers[server.url] = server
        return server.url

    def stop(self, url: str) -> None:
        self.servers.pop(url).stop()

    def stop_all(self) -> None:
        for url in list(self.servers):
            self.stop(url)


@dataclass
class Drained:
    """An engine the planner drained: its stats when it went (its pool whole, or not)."""

    url: str
    role: str
    free_blocks: int
    total_blocks: int
    seconds: float


@dataclass
class _Pool:
    policy: PoolPolicy
    urls: list[str] = field(default_factory=list)
    above: int = 0
    below: int = 0
    changed_at: float = float("-inf")
    hot_rate: dict[int, float] = field(default_factory=dict)  # pool size -> lowest rate it ran hot at


def window_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """The q-quantile (a bucket's upper bound) of what a cumulative histogram counted between
    two reads ({le: count}); None when nothing was counted."""
    les = sorted(after)
    delta = [after[le] - before.get(le, 0.0) for le in les]
    total = delta[-1] if delta else 0.0
    if total <= 0:
        return None
    for le, count in zip(les, delta):
        if count >= q * total:
            return le
    return les[-1]


def counter_total(text: str, name: str) -> float:
    """Counter `name` summed over its label sets (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name + "_total")


def histogram_buckets(text: str, name: str) -> dict[float, float]:
    """{le: cumulative count} of histogram `name`, summed over its label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name + "_bucket":
                le = float(s.labels["le"])
                out[le] = out.get(le, 0.0) + s.value
    return out


class Autoscaler:
    def __init__(self, router_url: str, launcher: Launcher, prefill: PoolPolicy, decode: PoolPolicy,
                 window_s: float = 5.0, admin_key: str | None = None, drain_timeout_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic, dry_run: bool = False, rate_windows: int = 5):
        self.router_url, self.launcher, self.window_s, self.dry_run = router_url, launcher, window_s, dry_run
        self.headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.drain_timeout_s, self.clock = drain_timeout_s, clock
        self.pools = {"prefill": _Pool(prefill), "decode": _Pool(decode)}
        self.drained: list[Drained] = []
        self.history: list[tuple[float, int, int]] = []  # (time, prefill engines, decode engines)
        self._last: dict[str, dict[float, float]] = {}
        self._answered: tuple[float, float] | None = None  # (time, the router's answered requests)
        self._rates: list[float] = []  # the last rate_windows windows' rates (req/s)
        self.rate_windows = rate_windows
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ engines

    def start_minimum(self) -> None:
        for role, pool in self.pools.items():
            while len(pool.urls) < pool.policy.min:
                if self.dry_run:
                    log.info("dry run: would start %s engines up to min %d (has %d)", role, pool.policy.min,
                             len(pool.urls))
                    break
                self._add(role)
        self._record()

    def adopt(self, role: str, urls: list[str]) -> None:
        """Engines already running join the pool (oldest first: the newest drains first) and
        the router's rotation."""
        for url in urls:
            if not self.dry_run:
                self._register(role, url)
            self.pools[role].urls.append(url)
            log.info("adopted %s engine %s", role, url)

    def _register(self, role: str, url: str) -> None:
        status, body = http("POST", self.router_url + "/workers", {"url": url, "role": role}, headers=self.headers)
        if status not in (200, 201):
            raise RuntimeError(f"the router refused {role} worker {url}: {status} {body[:200]!r}")

    def _add(self, role: str) -> None:
        url = self.launcher.start(role)
        try:
            self._register(role, url)
        except (RuntimeError, OSError):
            self.launcher.stop(url)
            raise
        self.pools[role].urls.append(url)
        log.info("scaled %s up to %d: %s", role, len(self.pools[role].urls), url)

    def _drain(self, role: str) -> None:
        """The newest engine out of rotation, idle, then stopped (module docstring)."""
        url = self.pools[role].urls.pop()
        started = self.clock()
        http("DELETE", self.router_url + "/workers", {"url": url, "role": role}, headers=self.headers)
        deadline = time.monotonic() + self.drain_timeout_s
        while True:
            stats = json.loads(http("GET", url + "/debug/stats", headers=self.headers)[1])
            kv = stats.get("kv_transfer") or {}
            idle = stats["num_running"] == 0 and stats["num_waiting"] == 0 and \
                stats.get("api_requests_in_flight", 0) == 0 and kv.get("blocks_pinned", 0) == 0
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        self.drained.append(Drained(url, role, stats["num_free_blocks"], stats["num_total_blocks"],
                                    self.clock() - started))
        self.launcher.stop(url)
        log.info("scaled %s down to %d: drained %s", role, len(self.pools[role].urls), url)

    # ------------------------------------------------------------------ the loop

    def tick(self) -> None:
        """Read the router's latencies over the last window and act on each pool."""
        status, body = http("GET", self.router_url + "/metrics", headers=self.headers)
        if status != 200:
            log.warning("router /metrics answered %d: no decision this window", status)
            return
        text = body.decode()
        if not self.dry_run:
            self._resync()
        now = self.clock()
        rate = self._rate(now, counter_total(text, REQUESTS))
        report = []
        for role, pool in self.pools.items():
            buckets = histogram_buckets(text, SIGNALS[role])
            p90 = window_quantile(self._last.get(role, {}), buckets, 0.9)
            self._last[role] = buckets
            n = len(pool.urls)
            action = self._decide(role, pool, p90, now, rate)
            report.append(f"{role} {n} engine{'s' * (n != 1)}, {SIGNAL_NAMES[role]} p90 "
                          f"{'-' if p90 is None else f'{p90:g} s'} (SLO {pool.policy.slo_s:g} s){action}")
        log.info("window: %s%s", "; ".join(report), "" if rate is None else f"; {rate:.2f} req/s")
        self._record()

    def _resync(self) -> None:
        """Follow engines the launcher says moved (a restarted pod's new IP), and re-register
        an engine of the pools that the router does not list (it restarted)."""
        refresh = getattr(self.launcher, "refresh", None)
        for role, pool in self.pools.items():
            for old, new in (refresh(role) if refresh else {}).items():
                log.warning("%s engine %s came back as %s: swapping it in the router", role, old, new)
                pool.urls[pool.urls.index(old)] = new
                http("DELETE", self.router_url + "/workers", {"url": old, "role": role}, headers=self.headers)
                self._register(role, new)
        status, body = http("GET", self.router_url + "/workers", headers=self.headers)
        if status != 200:
            return
        listed = {(w["role"], w["url"].rstrip("/")) for w in json.loads(body).get("workers", [])}
        for role, pool in self.pools.items():
            for url in pool.urls:
                if (role, url.rstrip("/")) not in listed:
                    log.warning("the router does not list %s engine %s: registering it again", role, url)
                    self._register(role, url)

    def _rate(self, now: float, answered: float) -> float | None:
        """The router's answered requests a second over the last rate_windows windows (None
        until two reads)."""
        last, self._answered = self._answered, (now, answered)
        if last is None or now <= last[0] or answered < last[1]:  # first read, or a restarted router
            return None
        self._rates = (self._rates + [(answered - last[1]) / (now - last[0])])[-self.rate_windows:]
        return sum(self._rates) / len(self._rates)

    def _decide(self, role: str, pool: _Pool, p90: float | None, now: float, rate: float | None = None) -> str:
        """Act on one pool's window; what it did, for the progress line ("" when nothing)."""
        p = pool.policy
        n = len(pool.urls)
        slow = p90 is not None and p90 > p.up * p.slo_s
        learnt = p.learn_rates and rate is not None
        hot = slow or learnt and rate >= p.rate_margin * pool.hot_rate.get(n, float("inf"))
        cold = (p90 is None or p90 < p.down * p.slo_s) and \
            not (learnt and rate >= p.rate_margin * pool.hot_rate.get(n - 1, float("inf")))
        pool.above = pool.above + 1 if hot else 0
        pool.below = pool.below + 1 if cold else 0
        since = now - pool.changed_at
        up_cooldown = p.cooldown_s if p.up_cooldown_s is None else p.up_cooldown_s
        can_up, can_down = since >= up_cooldown, since >= p.cooldown_s
        if not (can_up and hot or can_down and cold):
            return " [cooldown]" if hot or cold else ""
        if can_up and pool.above >= p.up_windows and len(pool.urls) < p.max:
            # this size could not hold this rate; a window with nothing answered (a stalled
            # pool, a burst of long prompts) says nothing, and a 0 req/s rate would block every drain
            if slow and learnt and rate > 0:
                pool.hot_rate[n] = min(pool.hot_rate.get(n, float("inf")), rate)
            action = f" -> up to {len(pool.urls) + 1}"
            if self.dry_run:
                action = " -> would scale up (dry run)"
            else:
                self._add(role)
        elif can_down and pool.below >= p.down_windows and len(pool.urls) > p.min:
            action = f" -> drained, down to {len(pool.urls) - 1}"
            if self.dry_run:
                action = " -> would drain one (dry run)"
            else:
                self._drain(role)
        else:
            return ""
        pool.changed_at, pool.above, pool.below = self.clock(), 0, 0
        return action

    def _record(self) -> None:
        self.history.append((self.clock(), len(self.pools["prefill"].urls), len(self.pools["decode"].urls)))

    def run(self) -> None:
        while not self._stop.wait(self.window_s):
            try:
                self.tick()
            except OSError as e:  # the router restarting: try again next window
                log.warning("autoscale tick failed: %s", e)

    def start(self) -> "Autoscaler":
        self._thread = threading.Thread(target=self.run, name="autoscale", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.drain_timeout_s + 60)
