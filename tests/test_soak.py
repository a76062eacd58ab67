"""Soak: steady mixed traffic through the router to a REAL 1P+1D pair (issue #18).

Workers send, back to back, completions and chat, streamed and not, streams closed after
the first event, requests abandoned before the first byte, and bad requests (truncated
JSON, invalid UTF-8, wrong types, unknown fields, negative max_tokens, prompts and
max_tokens past max_model_len, chat without messages) that must each get a 4xx
(benchmarks/load_soak.py: SOAK_MIX, Traffic.BAD). RSS (/proc/PID/status VmRSS) and open
fds (/proc/PID/fd) of the router and of each engine's API server and engine core are
sampled every second.

Checked: no error beyond the injected ones and no stuck worker; every process still
alive; RSS and fds flat after the warm-up, i.e. the peak of the last quarter of the run
minus the peak of its second quarter within the tolerance below; at the end the cluster
settles within 15 s, half P's lease (pools at baseline, nothing pinned on P, nothing
running or in flight in the engines or the router, no client connection left, nothing in
CLOSE_WAIT), and P released no transfer by its lease expiring.

Tolerances, and how they were chosen (runs on this 2-core machine, 8 workers, 90 s):
- fds: the router holds at most one client connection and one connection to each engine
  per worker, an API server one per router leg, so they move with the requests in flight
  (33-42 at the router); peak to peak they stayed within +-2. Allowed: the worker count
  (a leak of one fd per disconnect, ~10/s here, exceeds it within seconds). Engine cores
  hold no HTTP connection: their fd count never moved; allowed 4.
- RSS: router and API servers grew < 0.2 MiB from the second quarter to the end; allowed
  8 MiB. Engine cores: torch's CPU allocator and glibc arenas keep freed activations,
  whose sizes follow the prefill batches' shapes, so the prefill core's RSS creeps while
  new batch shapes turn up (native memory: tracemalloc saw its Python heap flat), slowing
  down: second quarter to end +20 MiB in a 90 s run, +16 MiB in a 300 s one (8 workers),
  +4 to +8 MiB in 300 s runs with 16 workers after a 1000-client load; the decode core
  +0.2 to +1.2 MiB. Allowed 64 MiB for a core.

`test_soak_bounded` (unmarked: runs in `make test`): 4 workers, ATOMD_SOAK_BOUNDED_SECONDS
(default 20) of traffic, ~35 s with start-up. `test_soak_long` (marker `chaos`: `make chaos`):
8 workers for ATOMD_SOAK_SECONDS (default 300).
"""
from __future__ import annotations

import asyncio
import json
import os

import pytest

from benchmarks.load_soak import PDStack, Sampler, growth, run_soak
from benchmarks.machine import loadavg

MIB = 1 << 20
RSS_TOLERANCE = {"router": 8 * MIB, "P api": 8 * MIB, "D api": 8 * MIB, "P core": 64 * MIB, "D core": 64 * MIB}
CORE_FD_TOLERANCE = 4
SETTLE_TIMEOUT_S = 15.0


def soak(tmp_path, seconds: float, workers: int) -> None:
    with PDStack(tmp_path) as stack:
        stack.start()
        sampler = Sampler(stack)
        before = stack.snapshot()
        tally = asyncio.run(run_soak(stack, seconds, workers, sampler=sampler))
        summary = tally.summary()
        grown = growth(sampler.samples, tally.seconds)
        alive = stack.alive()
        # settled well within P's 30 s lease, and no transfer released by its lease expiring
        settle_s = stack.wait_settled(SETTLE_TIMEOUT_S) if all(alive.values()) else None
        leases_expired = stack.stats("P")["kv_transfer"]["leases_expired"] if all(alive.values()) else None
        after = stack.snapshot()
        report = {"loadavg": loadavg(), "seconds": seconds, "workers": workers, "summary": summary,
                  "settle_s": settle_s, "leases_expired": leases_expired, "samples": len(sampler.samples),
                  "growth_mib_fds": {k: (round(r / MIB, 2), f) for k, (r, f) in grown.items()},
                  "rss_mib_before_after": {k: (round(before[k][0] / MIB, 1), round(after[k][0] / MIB, 1))
                                           for k in before},
                  "fds_before_after": {k: (before[k][1], after[k][1]) for k in before}}
        print("soak:", json.dumps(report))
        assert all(alive.values()), (alive, report)
        assert tally.stuck == 0, report
        assert leases_expired == 0, report
        assert not tally.errors, report
        # every kind of the mix was exercised, bad requests included (and all got a 4xx)
        assert set(summary["by_kind"]) == {"completion_stream", "chat_stream", "completion_json", "chat_json",
                                           "disconnect_mid", "disconnect_early", "bad_request"}, report
        assert sum(1 for o in tally.outcomes if o.kind == "bad_request" and 400 <= o.status < 500) \
            == summary["by_kind"]["bad_request"], report
        for name, (rss, fds) in grown.items():
            assert rss <= RSS_TOLERANCE[name], (name, report)
            assert fds <= (CORE_FD_TOLERANCE if name.endswith("core") else workers), (name, report)


@pytest.mark.e2e  # (make e2e: ~35 s of a real pair's start-up and traffic, out of make test's 10 minutes)
@pytest.mark.timeout(300)
def test_soak_bounded(tmp_path):
    soak(tmp_path, float(os.environ.get("ATOMD_SOAK_BOUNDED_SECONDS", "20")), workers=4)


@pytest.mark.chaos
@pytest.mark.timeout(3600)
def test_soak_long(tmp_path):
    soak(tmp_path, float(os.environ.get("ATOMD_SOAK_SECONDS", "300")), workers=8)
