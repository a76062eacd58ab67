"""Adaptive disaggregation (`--pd-mode adaptive`, docs/design.md "Adaptive disaggregation"):
per request, prefill remotely (two legs: P, then D pulls the KV) or on the chosen decode
engine itself (one leg: the client's request straight to D, without kv_transfer_params).

What the router measures, per request and per prefill worker:
- n: the prompt tokens D would compute, i.e. the prompt minus D's cached prefix when the
  decode policy (kv_aware) knows it from KV events (`RouteRequest.leg_tokens("decode")`);
- each P's queue: prompt tokens sent to it and not yet answered (`Worker.in_flight_tokens`);
- each P's prefill rate (tokens/s), an exponential moving average over completed prefill
  legs: (tokens queued ahead of the leg + its own tokens) / the leg's time;
- each P's transfer cost (s): from P's answer to D's first streamed event, moving average;
- D's local prefill rate (tokens/s): a local leg's uncached tokens / its time to first event.

Rule: local when n <= local_prefill_max_tokens (`short_prompt`: too short to hurt running
decodes, and not worth a second leg) or when no prefill worker is in rotation
(`no_prefill_worker`). Otherwise remote (`long_prompt`) when the best P's extra delay —
its predicted wait (queue / rate) plus the transfer — is below what a local prefill would
cost: n / D's local rate, the stall of every stream running on D, times the number of
those streams (legs in flight on D; at least 1, so an idle D compares the prefill time
itself); else local (`prefill_backlog`: every P is backed up). `--pd-mode strict` always takes two
legs (reason `strict`; a fallback is an error); `always` (the default) takes two legs with
the fallbacks of router/pd.py, counted as before without a reason.

Counted as `atomd_router:decision_total{decision="pd"|"local_prefill", reason=...}`.
"""
from __future__ import annotations

from typing import Iterable

PD_MODES = ("always", "adaptive", "strict")


class Ewma:
    __slots__ = ("value", "alpha", "samples")

    def __init__(self, prior: float, alpha: float):
        self.value = prior
        self.alpha = alpha
        self.samples = 0

    def observe(self, x: float) -> None:
        # the first real sample replaces the prior; later ones move the average
        self.value = x if self.samples == 0 else self.value + self.alpha * (x - self.value)
        self.samples += 1


class PDDecider:
    def __init__(self, local_prefill_max_tokens: int = 256, prefill_tokens_per_s: float = 2000.0,
                 transfer_s: float = 0.01, local_tokens_per_s: float | None = None, alpha: float = 0.2):
        if local_prefill_max_tokens < 0:
            raise ValueError(f"local_prefill_max_tokens must be >= 0, got {local_prefill_max_tokens}")
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.prior_rate = prefill_tokens_per_s
        self.prior_transfer = transfer_s
        self.alpha = alpha
        self.rate: dict[str, Ewma] = {}  # prefill worker url -> tokens/s
        self.transfer: dict[str, Ewma] = {}  # prefill worker url -> s
        self.local_rate = Ewma(local_tokens_per_s or prefill_tokens_per_s, alpha)

    def _rate(self, url: str) -> Ewma:
        e = self.rate.get(url)
        if e is None:
            e = self.rate[url] = Ewma(self.prior_rate, self.alpha)
        return e

    def _transfer(self, url: str) -> Ewma:
        e = self.transfer.get(url)
        if e is None:
            e = self.transfer[url] = Ewma(self.prior_transfer, self.alpha)
        return e

    # ------------------------------------------------------------------ learning

    def observe_prefill(self, url: str, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self._rate(url).observe(tokens / seconds)

    def observe_transfer(self, url: str, seconds: float) -> None:
        if seconds >= 0:
            self._transfer(url).observe(seconds)

    def observe_local(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.local_rate.observe(tokens / seconds)

    def forget(self, url: str) -> None:
        self.rate.pop(url, None)
        self.transfer.pop(url, None)

    # ------------------------------------------------------------------ deciding

    def remote_delay(self, worker) -> float:
        """Seconds a remote prefill on `worker` adds before D can decode, beyond the prefill
        itself: its queue ahead, then the transfer."""
        return worker.in_flight_tokens / max(self._rate(worker.url).value, 1e-9) + self._transfer(worker.url).value

    def decide(self, uncached: int, prefill_workers: Iterable, decode_streams: int = 0) -> tuple[str, str]:
        """("pd" | "local_prefill", reason) for a prompt of which D would compute `uncached`
        tokens while `decode_streams` requests run on D."""
        if uncached <= self.local_prefill_max_tokens:
            return "local_prefill", "short_prompt"
        workers = list(prefill_workers)
        if not workers:
            return "local_prefill", "no_prefill_worker"
        best = min(self.remote_delay(w) for w in workers)
        local = uncached / max(self.local_rate.value, 1e-9) * max(1, decode_streams)
        return ("pd", "long_prompt") if best < local else ("local_prefill", "prefill_backlog")

    def describe(self) -> dict:
        return {"local_prefill_max_tokens": self.local_prefill_max_tokens,
                "local_tokens_per_s": self.local_rate.value,
                "prefill_tokens_per_s": {u: e.value for u, e in self.rate.items()},
                "transfer_s": {u: e.value for u, e in self.transfer.items()}}
