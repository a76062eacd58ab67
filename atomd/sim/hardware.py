"""Hardware profiles of a simulated engine: how long a step takes, how fast KV moves, how
much KV fits. Torch-free (the router side, `atomd plan` and the simulated engine read it).

A step is summarised by its `StepShape` (scheduled tokens, sequences, attention work,
context read); a profile turns that into seconds in one of two ways:

* **calibrated** (`atomd profile` writes it): least-squares coefficients fitted to the real
  engine's measured forward times on this machine, prefill and decode apart:
  prefill = base + per_token * tokens + per_attention * attention work, decode = base +
  per_seq * rows + per_context * context tokens read.
* **derived** for an accelerator and a model shape, a roofline: max(FLOPs / (peak FLOPs *
  compute efficiency), bytes / (peak bandwidth * memory efficiency)) + a fixed per-step
  overhead. FLOPs: 2 per active parameter per token (lm_head only for the rows that
  sample) plus attention's 4 * heads * head_dim per (query, key) pair. Bytes: every weight
  once per step (MoE: the experts the batch's tokens touch, in expectation under uniform
  routing), the KV read and the KV written.

`--hardware` names a profile file (JSON, `Profile`) or ACCELERATOR:MODEL from the tables
below (h100:llama3-8b). The accelerators' peak numbers are the vendors' public dense BF16
figures; the efficiency factors are assumptions, said on each entry.
"""
from __future__ import annotations

import math
import os

import msgspec
import numpy as np

from atomd.model.text_config import text_model_config


class ModelShape(msgspec.Struct, frozen=True, kw_only=True):
    """What the step time and the KV size depend on (an HF config.json's numbers)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the dense MLP's (0: every layer is MoE)
    vocab_size: int
    dtype_bytes: int = 2
    num_experts: int = 0  # MoE: experts per layer, routed top-k, each of moe_intermediate_size
    experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    tie_word_embeddings: bool = False

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attention_params(self) -> int:  # per layer: q, k, v, o
        return self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)

    @property
    def expert_params(self) -> int:  # one expert of one layer
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def dense_layer_params(self) -> int:  # per layer, every token reads all of it
        return self.attention_params + 3 * self.hidden_size * self.intermediate_size + \
            self.hidden_size * self.num_experts  # the router

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def active_params(self) -> int:
        """Parameters one token's forward multiplies by (embeddings lookup aside)."""
        return self.num_layers * (self.dense_layer_params + self.experts_per_tok * self.expert_params) + \
            self.lm_head_params

    @property
    def total_params(self) -> int:
        embeddings = self.lm_head_params * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (self.dense_layer_params + self.num_experts * self.expert_params) + embeddings

    @classmethod
    def from_hf_config(cls, name: str, hf: dict, dtype_bytes: int) -> "ModelShape":
        """A checkpoint's config.json (a nested one, Gemma 3's text_config, read as the loader does)."""
        hf = text_model_config(hf)
        heads = hf["num_attention_heads"]
        experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
        return cls(name=name, num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_heads=heads,
                   num_kv_heads=hf.get("num_key_value_heads") or heads,
                   head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                   intermediate_size=0 if experts and not hf.get("mlp_only_layers") else hf["intermediate_size"],
                   vocab_size=hf["vocab_size"], dtype_bytes=dtype_bytes, num_experts=experts,
                   experts_per_tok=hf.get("num_experts_per_tok") or 0,
                   moe_intermediate_size=hf.get("moe_intermediate_size") or (hf["intermediate_size"] if experts else 0),
                   tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)))


class StepShape(msgspec.Struct, frozen=True):
    """One forward's work: scheduled tokens, sequences, attention pairs (query, key) over
    the batch (a prefill chunk of n tokens after c computed: n * (c + (n + 1) / 2)), and
    context tokens whose KV is read (c + n per sequence)."""

    is_prefill: bool
    tokens: int
    seqs: int
    attention: float
    context: int

    @classmethod
    def of(cls, is_prefill: bool, scheduled: list[int], computed: list[int]) -> "StepShape":
        attention = sum(n * (c + (n + 1) / 2) for n, c in zip(scheduled, computed))
        return cls(is_prefill, sum(scheduled), len(scheduled), attention, sum(scheduled) + sum(computed))


class Accelerator(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    peak_flops: float  # dense BF16, FLOP/s
    memory_bandwidth: float  # bytes/s
    memory_bytes: int
    compute_efficiency: float  # achieved / peak FLOPs in a large prefill (assumption)
    memory_efficiency: float  # achieved / peak bandwidth in decode (assumption)
    step_overhead_s: float  # per forward: launches, sync, sampling (assumption)
    memory_utilization: float = 0.9  # of memory_bytes for weights + KV (vLLM's default)
    notes: str = ""


class Link(msgspec.Struct, frozen=True, kw_only=True):
    """How KV moves between a prefill and a decode engine: one pull of B bytes takes
    latency_s + B / bandwidth, and a decode engine's pulls queue on its link."""

    name: str
    bandwidth: float  # bytes/s, achieved
    latency_s: float
    notes: str = ""

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth


# Peaks: NVIDIA H100 SXM5 and H200 SXM datasheets (989 TFLOPS dense BF16; 3.35 / 4.8 TB/s;
# 80 / 141 GB), AMD Instinct MI300X datasheet (1307 TFLOPS dense BF16, 5.3 TB/s, 192 GB).
# Efficiencies: ~60% MFU in large prefills and ~80% of HBM bandwidth in decode are what
# vLLM/SGLang reach on Hopper; ROCm stacks reach less (45% / 70% assumed). 1 ms per step
# for kernel launches (graphs), the sync and sampling.
ACCELERATORS = {a.name: a for a in (
    Accelerator(name="h100", peak_flops=989e12, memory_bandwidth=3.35e12, memory_bytes=80 * 10**9,
                compute_efficiency=0.6, memory_efficiency=0.8, step_overhead_s=1e-3,
                notes="H100 SXM5: 989 TFLOPS dense BF16, 3.35 TB/s HBM3, 80 GB"),
    Accelerator(name="h200", peak_flops=989e12, memory_bandwidth=4.8e12, memory_bytes=141 * 10**9,
                compute_efficiency=0.6, memory_efficiency=0.8, step_overhead_s=1e-3,
                notes="H200 SXM: 989 TFLOPS dense BF16, 4.8 TB/s HBM3e, 141 GB"),
    Accelerator(name="mi300x", peak_flops=1307e12, memory_bandwidth=5.3e12, memory_bytes=192 * 10**9,
                compute_efficiency=0.45, memory_efficiency=0.7, step_overhead_s=1e-3,
                notes="MI300X: 1307 TFLOPS dense BF16, 5.3 TB/s HBM3, 192 GB"),
)}

# Links: NVLink 4 is 450 GB/s each way (900 GB/s both), 80% achieved; a 400 Gb/s RDMA NIC
# (ConnectX-7) is 50 GB/s, 85% achieved; TCP: one stream through the kernel stack of a
# 100 GbE NIC, ~25 Gb/s; loopback: this machine's ZMQ side channel (docs/design.md's
# facts: 2-2.7 GB/s), its latency a control round trip plus the consumer's 1 ms poll.
LINKS = {link.name: link for link in (
    Link(name="nvlink", bandwidth=0.8 * 450e9, latency_s=10e-6, notes="NVLink 4, one direction, 80%"),
    Link(name="rdma400", bandwidth=0.85 * 50e9, latency_s=20e-6, notes="400 Gb/s RDMA, 85%"),
    Link(name="tcp", bandwidth=25e9 / 8, latency_s=100e-6, notes="TCP over 100 GbE, one stream, ~25 Gb/s"),
    Link(name="loopback", bandwidth=2.5e9, latency_s=1e-3, notes="ZMQ over 127.0.0.1 on the CPU hosts"),
)}

MODELS = {m.name: m for m in (
    # meta-llama/Meta-Llama-3-8B config.json
    ModelShape(name="llama3-8b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
               intermediate_size=14336, vocab_size=128256),
    # Qwen/Qwen3-30B-A3B config.json: every layer sparse, 128 experts, top 8
    ModelShape(name="qwen3-30b-a3b", num_layers=48, hidden_size=2048, num_heads=32, num_kv_heads=4, head_dim=128,
               intermediate_size=0, vocab_size=151936, num_experts=128, experts_per_tok=8,
               moe_intermediate_size=768),
)}


class LinearStep(msgspec.Struct, frozen=True, kw_only=True):
    """prefill: base_s + per_token_s * tokens + per_attention_s * attention;
    decode: base_s + per_token_s * rows + per_attention_s * context (fitted by atomd profile)."""

    base_s: float
    per_token_s: float
    per_attention_s: float

    def seconds(self, step: StepShape) -> float:
        return self.base_s + self.per_token_s * step.tokens + \
            self.per_attention_s * (step.attention if step.is_prefill else step.context)


class LinearGap(msgspec.Struct, frozen=True):
    """A served engine's busy gap before a forward (its loop's time since the last forward
    ended) from what the loop did in it: base_s + per_output_s x the last forward's sequences
    (their outputs) + per_pull_s x KV pulls landed + per_request_s x requests added."""

    base_s: float
    per_output_s: float
    per_pull_s: float
    per_request_s: float

    def seconds(self, outputs: int, pulls: int, added: int) -> float:
        return self.base_s + self.per_output_s * outputs + self.per_pull_s * pulls + self.per_request_s * added


class Calibrated(msgspec.Struct, frozen=True, kw_only=True, tag="calibrated"):
    prefill: LinearStep
    decode: LinearStep
    source: str = ""  # where and how it was measured
    # A profile fitted from served steps (`atomd profile --from-servers`): measured - fitted
    # step seconds at evenly spaced quantiles (mean 0), prefill and decode apart. A simulated
    # engine adds one drawn at random to each step (at least 0 in all), so its steps spread as
    # the served ones did (a shared machine's preemptions included); empty: the fit's time.
    prefill_spread: list[float] = []
    decode_spread: list[float] = []
    # ... or, when True, the served steps' own residuals in the order they were served (the
    # last MAX_SPREAD, mean 0), which a simulated engine walks from a seeded start: a shared
    # machine's slow stretches stay stretches (the served steps' times are autocorrelated;
    # independent draws give every request the mean slowness, too high a median latency and
    # too low a tail)
    spread_in_order: bool = False
    # ... and the served engine's mean time from a forward's end to the next prefill / decode
    # forward's start while it had sequences running (scheduling, outputs, IPC, its API
    # process: under the load it had); a simulated engine waits out what its own loop,
    # sleeping through its forwards, does not take of it (atomd/sim/engine.py)
    prefill_gap_s: float = 0.0
    decode_gap_s: float = 0.0
    # ... and, fitted from the same steps, that gap given the loop's work in it (outputs of
    # the last forward, pulls landed, requests added); when set, a simulated engine waits
    # this model's gap for its own work less its own gap, instead of the means above
    prefill_gap: LinearGap | None = None
    decode_gap: LinearGap | None = None
    # ... and the served steps' mean residual per batch size (sequences in the step), where it
    # stands out of the noise: {seqs: seconds} added to the fit. A served step's time is not
    # linear in its batch: on a shared machine a decode batch of 2 is one whose new request's
    # prefill ran beside it on the other core (1P+1D here: 1.5 ms at 1 sequence, 4.9 ms at 2),
    # and a line through both over-predicts the batch of 1 that most steps are
    prefill_by_seqs: dict[int, float] = {}
    decode_by_seqs: dict[int, float] = {}
    # ... and, fitted from engines that shared a host's cores (1P+1D on a small machine), the
    # seconds a forward is longer per second another engine's forward ran inside it (in
    # [0, 1): processor sharing, it progresses at 1 - contention of its speed then); simulated
    # engines apply it on a shared board (atomd/sim/shared_cores.py), the fit above is the
    # forward alone
    prefill_contention: float = 0.0
    decode_contention: float = 0.0


class Derived(msgspec.Struct, frozen=True, kw_only=True, tag="derived"):
    accelerator: Accelerator


class Profile(msgspec.Struct, frozen=True, kw_only=True):
    """A simulated engine's hardware: the step-time model, the model shape its KV blocks
    and FLOPs are counted for, the KV link, and the KV pool (None: --kv-cache-memory's rule;
    a derived profile: what the accelerator's memory holds after the weights)."""

    name: str
    model: ModelShape
    step: Calibrated | Derived
    link: Link
    kv_cache_bytes: int | None = None

    def step_seconds(self, step: StepShape) -> float:
        if isinstance(self.step, Calibrated):
            fit, by_seqs = (self.step.prefill, self.step.prefill_by_seqs) if step.is_prefill else \
                (self.step.decode, self.step.decode_by_seqs)
            return max(0.0, fit.seconds(step) + by_seqs.get(step.seqs, 0.0))
        return roofline_seconds(self.step.accelerator, self.model, step)

    def with_link(self, link: str | None) -> "Profile":
        return self if link is None else msgspec.structs.replace(self, link=resolve_link(link))

    def to_json(self) -> bytes:
        return msgspec.json.format(msgspec.json.encode(self), indent=2)


def roofline_seconds(acc: Accelerator, m: ModelShape, step: StepShape) -> float:
    """The derived step time (module docstring)."""
    layers = m.num_layers
    flops = 2 * (m.active_params - m.lm_head_params) * step.tokens + 2 * m.lm_head_params * step.seqs + \
        4 * layers * m.num_heads * m.head_dim * step.attention
    experts_read = 0.0
    if m.num_experts:  # expected distinct experts the batch's tokens route to, per layer
        k_over_e = m.experts_per_tok / m.num_experts
        experts_read = m.num_experts * (1 - (1 - k_over_e) ** step.tokens)
    weights = layers * (m.dense_layer_params + experts_read * m.expert_params) + m.lm_head_params
    nbytes = weights * m.dtype_bytes + m.kv_bytes_per_token * (step.context + step.tokens)
    return acc.step_overhead_s + max(flops / (acc.peak_flops * acc.compute_efficiency),
                                     nbytes / (acc.memory_bandwidth * acc.memory_efficiency))


def resolve_link(name: str) -> Link:
    if name not in LINKS:
        raise ValueError(f"kv_link must be one of {', '.join(LINKS)}, got {name!r}")
    return LINKS[name]


def derived_profile(accelerator: str, model: str, link: str = "rdma400") -> Profile:
    """ACCELERATOR:MODEL from the tables; the KV pool is the accelerator's usable memory
    after the weights (ValueError when the weights do not fit)."""
    if accelerator not in ACCELERATORS:
        raise ValueError(f"hardware: unknown accelerator {accelerator!r} (known: {', '.join(ACCELERATORS)})")
    if model not in MODELS:
        raise ValueError(f"hardware: unknown model shape {model!r} (known: {', '.join(MODELS)})")
    acc, shape = ACCELERATORS[accelerator], MODELS[model]
    kv = int(acc.memory_bytes * acc.memory_utilization) - shape.total_params * shape.dtype_bytes
    if kv <= 0:
        raise ValueError(f"hardware: {model}'s weights do not fit one {accelerator}")
    return Profile(name=f"{accelerator}:{model}", model=shape, step=Derived(accelerator=acc),
                   link=resolve_link(link), kv_cache_bytes=kv)


MAX_PROFILE_BYTES = 1 << 20  # a profile file is a few hundred bytes (a few KB with spreads)
MAX_SPREAD = 1000  # values in a calibrated step spread (quantiles, or residuals in served order)
MAX_SPREAD_S = 60.0  # ... each under this in magnitude


def load_profile(spec: str) -> Profile:
    """`--hardware`: a profile file (JSON) or ACCELERATOR:MODEL; ValueError naming what is wrong."""
    if os.path.isfile(spec):
        if os.path.getsize(spec) > MAX_PROFILE_BYTES:
            raise ValueError(f"hardware: {spec} is larger than {MAX_PROFILE_BYTES} bytes: not a profile")
        with open(spec, "rb") as f:
            raw = f.read()
        try:
            profile = msgspec.json.decode(raw, type=Profile)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ValueError(f"hardware: {spec} is not a profile: {e}") from None
        check_profile(profile)
        return profile
    accelerator, sep, model = spec.partition(":")
    if not sep:
        raise ValueError(f"hardware must be a profile file or ACCELERATOR:MODEL (e.g. h100:llama3-8b), got {spec!r}")
    return derived_profile(accelerator, model)


def check_profile(p: Profile) -> None:
    if p.link.bandwidth <= 0 or p.link.latency_s < 0 or not math.isfinite(p.link.bandwidth):
        raise ValueError(f"hardware {p.name}: link bandwidth must be > 0 and latency >= 0")
    if p.model.kv_bytes_per_token <= 0:
        raise ValueError(f"hardware {p.name}: the model shape holds no KV")
    if p.kv_cache_bytes is not None and p.kv_cache_bytes <= 0:
        raise ValueError(f"hardware {p.name}: kv_cache_bytes must be > 0")
    if isinstance(p.step, Calibrated):
        for spread in (p.step.prefill_spread, p.step.decode_spread):
            if len(spread) > MAX_SPREAD or not all(abs(v) < MAX_SPREAD_S for v in spread):
                raise ValueError(f"hardware {p.name}: a step spread holds at most {MAX_SPREAD} values in "
                                 f"(-{MAX_SPREAD_S:g}, {MAX_SPREAD_S:g}) s")
        for by_seqs in (p.step.prefill_by_seqs, p.step.decode_by_seqs):
            if len(by_seqs) > MAX_SPREAD or not all(k >= 1 and abs(v) < MAX_SPREAD_S for k, v in by_seqs.items()):
                raise ValueError(f"hardware {p.name}: a per-batch-size residual table holds at most {MAX_SPREAD} "
                                 f"batch sizes >= 1, each in (-{MAX_SPREAD_S:g}, {MAX_SPREAD_S:g}) s")
        if not (0 <= p.step.prefill_contention < 1 and 0 <= p.step.decode_contention < 1):
            raise ValueError(f"hardware {p.name}: prefill_contention and decode_contention must be in [0, 1)")
        if not (0 <= p.step.prefill_gap_s < 10 and 0 <= p.step.decode_gap_s < 10):
            raise ValueError(f"hardware {p.name}: prefill_gap_s and decode_gap_s must be in [0, 10) seconds")
        for gap in (p.step.prefill_gap, p.step.decode_gap):
            if gap is not None and not all(0 <= v < 10 for v in msgspec.structs.astuple(gap)):
                raise ValueError(f"hardware {p.name}: a gap model's coefficients must be in [0, 10) seconds")
    for shape in (StepShape(True, 1, 1, 1.0, 1), StepShape(False, 1, 1, 1.0, 1)):
        if not math.isfinite(p.step_seconds(shape)):
            raise ValueError(f"hardware {p.name}: the step model is not finite")


def fit_linear(steps: list[StepShape], seconds: list[float], relative: bool = True) -> LinearStep:
    """Least squares of `LinearStep` over measured steps (all prefill or all decode), no
    coefficient negative: a term whose fitted coefficient is < 0 is dropped and the rest
    refit. `relative`: in relative error (a 2 ms step counts as much as a 100 ms one: grid
    medians); else in seconds, the conditional mean (served steps, whose slow outliers are
    part of what a simulation must reproduce)."""
    if not steps:
        raise ValueError("no steps to fit")
    y = np.asarray(seconds, dtype=np.float64)
    x = np.array([[1.0, s.tokens, s.attention if s.is_prefill else s.context] for s in steps])
    if relative:
        x, y = x / y[:, None], np.ones_like(y)
    base, per_token, per_attention = nonnegative_lstsq(x, y)
    return LinearStep(base_s=base, per_token_s=per_token, per_attention_s=per_attention)


def fit_gap(work: list[tuple[int, int, int]], gaps: list[float]) -> LinearGap:
    """The served busy gaps' conditional mean given the loop's work (LinearGap), least
    squares in seconds, no coefficient negative."""
    if not work:
        raise ValueError("no gaps to fit")
    x = np.array([[1.0, *w] for w in work], dtype=np.float64)
    return LinearGap(*nonnegative_lstsq(x, np.asarray(gaps, dtype=np.float64)))


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> list[float]:
    """Least squares coefficients of x's columns, none negative: a column whose coefficient
    comes out < 0 is dropped (0) and the rest refit."""
    keep = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    full = [0.0] * x.shape[1]
    for k, c in zip(keep, coef):
        full[k] = max(0.0, float(c))
    return full
