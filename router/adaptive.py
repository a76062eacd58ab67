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
- D's local prefill rate (tokens/s), learnt the same way from local legs: (D's local prefill
  tokens in flight ahead of the leg + its own) / its time to first event; and those local
  tokens in flight per decode worker (`local_pending`).

Rule: local when n <= local_prefill_max_tokens (`short_prompt`: too short to hurt running
decodes, and not worth a second leg) or when no prefill worker is in rotation
(`no_prefill_worker`). Otherwise remote (`long_prompt`) when the best P's extra delay —
its predicted wait (queue / rate) plus the transfer — is below what prefilling locally
takes D: its own local prefills in flight and n, at D's local rate (the time its running
streams share the engine with prefill work); else local (`prefill_backlog`: every P is
backed up) — unless D's running streams are already as slow as allowed
(`--local-prefill-max-itl-ms`: the moving mean of the gaps between the tokens the router
relays from D, while D has legs in flight, at or above it), then remote anyway
(`decode_busy`). What a local
prefill costs D's running streams is bounded on D itself, by its time cap
(`--max-local-prefill-ms-per-step`: a stream waits at most one capped chunk between two of
its tokens), and D's local rate is learnt under that load: chunks alternating with decode
steps of many streams make it slow, which sends prompts back to P. The ITL bound keeps
local prefills from running back to back: each alone holds a stream's gap within one
capped chunk, but D prefilling all the time leaves every stream at that gap for good
(session 6 on the built-in model: ITL median 9.5 ms for a whole round against a 6.2 ms TPOT
SLO; benchmarks/results/pd_adaptive.md). (Session 3's rule
multiplied a local prefill's time by D's running streams instead; on the SmolLM2-135M shape
that kept two thirds of the prompts on a backed-up P while D had TPOT headroom:
benchmarks/results/pd_adaptive.md.) `--pd-mode strict` always takes two
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
                 transfer_s: float = 0.01, local_tokens_per_s: float | None = None, alpha: float = 0.2,
                 local_prefill_max_itl_s: float | None = None):
        if local_prefill_max_tokens < 0:
            raise ValueError(f"local_prefill_max_tokens must be >= 0, got {local_prefill_max_tokens}")
        if local_prefill_max_itl_s is not None and local_prefill_max_itl_s <= 0:
            raise ValueError(f"local_prefill_max_itl_s must be > 0, got {local_prefill_max_itl_s}")
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.local_prefill_max_itl_s = local_prefill_max_itl_s
        self.prior_rate = prefill_tokens_per_s
        self.prior_transfer = transfer_s
        self.alpha = alpha
        self.rate: dict[str, Ewma] = {}  # prefill worker url -> tokens/s
        self.transfer: dict[str, Ewma] = {}  # prefill worker url -> s
        self.local_rate = Ewma(local_tokens_per_s or prefill_tokens_per_s, alpha)
        self.local_pending: dict[str, int] = {}  # decode worker url -> local prefill tokens in flight
        self.itl: dict[str, Ewma] = {}  # decode worker url -> s between the tokens relayed from it

    def _estimate(self, table: dict[str, Ewma], url: str, prior: float) -> Ewma:
        """`url`'s moving average in `table`, made from `prior` at its first use."""
        e = table.get(url)
        if e is None:
            e = table[url] = Ewma(prior, self.alpha)
        return e

    def _rate(self, url: str) -> Ewma:
        return self._estimate(self.rate, url, self.prior_rate)

    def _transfer(self, url: str) -> Ewma:
        return self._estimate(self.transfer, url, self.prior_transfer)

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

    def observe_itl(self, url: str, seconds: float) -> None:
        """A gap per token between two events relayed from decode worker `url`."""
        self._estimate(self.itl, url, seconds).observe(seconds)  # no prior: the first gap is the average

    def start_local(self, url: str, tokens: int) -> int:
        """A local prefill of `tokens` sent to decode worker `url`; returns the local tokens
        it has in flight ahead of them."""
        ahead = self.local_pending.get(url, 0)
        self.local_pending[url] = ahead + tokens
        return ahead

    def end_local(self, url: str, tokens: int) -> None:
        """That prefill is done (D's first event) or its leg ended without one."""
        left = self.local_pending.get(url, 0) - tokens
        if left > 0:
            self.local_pending[url] = left
        else:
            self.local_pending.pop(url, None)

    def forget(self, url: str) -> None:
        self.rate.pop(url, None)
        self.transfer.pop(url, None)
        self.itl.pop(url, None)

    # ------------------------------------------------------------------ deciding

    def remote_delay(self, worker) -> float:
        """Seconds a remote prefill on `worker` adds before D can decode, beyond the prefill
        itself: its queue ahead, then the transfer."""
        return worker.in_flight_tokens / max(self._rate(worker.url).value, 1e-9) + self._transfer(worker.url).value

    def local_time(self, decode_url: str, tokens: int) -> float:
        """Seconds decode worker `decode_url` would spend prefilling `tokens` locally, after
        the local prefills it has in flight."""
        return (self.local_pending.get(decode_url, 0) + tokens) / max(self.local_rate.value, 1e-9)

    def decode_busy(self, decode_url: str, decode_streams: int) -> bool:
        """Whether the streams on decode worker `decode_url` are at the ITL bound already."""
        bound, itl = self.local_prefill_max_itl_s, self.itl.get(decode_url)
        return bound is not None and decode_streams > 0 and itl is not None and itl.value >= bound

    def decide(self, uncached: int, prefill_workers: Iterable, decode_url: str = "",
               decode_streams: int = 0) -> tuple[str, str]:
        """("pd" | "local_prefill", reason) for a prompt of which decode worker `decode_url`
        (with `decode_streams` legs in flight) would compute `uncached` tokens."""
        if uncached <= self.local_prefill_max_tokens:
            return "local_prefill", "short_prompt"
        workers = list(prefill_workers)
        if not workers:
            return "local_prefill", "no_prefill_worker"
        best = min(self.remote_delay(w) for w in workers)
        if best < self.local_time(decode_url, uncached):
            return "pd", "long_prompt"
        if self.decode_busy(decode_url, decode_streams):
            return "pd", "decode_busy"
        return "local_prefill", "prefill_backlog"

    def describe(self) -> dict:
        return {"local_prefill_max_tokens": self.local_prefill_max_tokens,
                "local_tokens_per_s": self.local_rate.value,
                "local_tokens_in_flight": dict(self.local_pending),
                "decode_itl_s": {u: e.value for u, e in self.itl.items()},
                "prefill_tokens_per_s": {u: e.value for u, e in self.rate.items()},
                "transfer_s": {u: e.value for u, e in self.transfer.items()}}


class LocalPrefill:
    """One local prefill on decode worker `url`, the decider's from the decision on: counted
    in its local_pending until D's first event (which also teaches D's local rate: the
    tokens ahead plus these, over the leg's time to that event) or the leg's end."""

    __slots__ = ("decider", "url", "tokens", "ahead", "started")

    def __init__(self, decider: PDDecider, url: str, tokens: int):
        self.decider, self.url, self.tokens = decider, url, tokens
        self.ahead = decider.start_local(url, tokens)
        self.started: float | None = None

    def leg_started(self, now: float) -> None:
        self.started = now

    def first_event(self, now: float) -> None:
        if self.url is not None and self.tokens and self.started is not None:
            self.decider.observe_local(self.ahead + self.tokens, now - self.started)
        self.end()

    def end(self) -> None:
        if self.url is not None:
            self.decider.end_local(self.url, self.tokens)
            self.url = None


class RemotePrefill:
    """Prefill worker `url` answered with its KV params at `answered`: D's first event
    teaches the decider that P's transfer cost."""

    __slots__ = ("decider", "url", "answered")

    def __init__(self, decider: PDDecider, url: str, answered: float):
        self.decider, self.url, self.answered = decider, url, answered

    def leg_started(self, now: float) -> None:
        pass

    def first_event(self, now: float) -> None:
        self.decider.observe_transfer(self.url, now - self.answered)

    def end(self) -> None:
        pass

