"""`atomd profile`: time the real engine's forward (model + sampler, what a simulated step
sleeps) over a grid of prefill batches (sequences x prompt length) and decode batches
(sequences x context length) for a checkpoint on this machine, fit the calibrated step
model (atomd/sim/hardware.py) and write it as a profile for `--hardware`.

Each grid point runs `--rounds` times after one warm-up request; prefix caching is off so
every prefill computes its whole prompt. The default grid runs in about a minute on the
built-in model with one thread.

`--from-servers URL...` fits the profile from engines as they serve instead: each started
with $ATOMD_STEP_SAMPLES=N keeps its last N forwards' shapes and wall times (GET
/debug/stats `step_samples`; atomd/engine/engine_loop.py). A served forward shares the
cores with its API process, the other engines, a router and the client, which a grid timed
alone does not see; the fit is in seconds (the mean, slow steps included) and the profile
carries the spread of measured - fitted seconds (hardware.Calibrated) that a simulated
engine draws from. Run the servers under the traffic you mean to simulate; the fit is as good as the
shapes they saw.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from atomd.sim.plan import positive_ints


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint directory or cached hub id (default: built-in)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads, as the engine will serve with")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--prefill-batches", type=positive_ints, default=[1, 4], help="sequences per prefill step")
    parser.add_argument("--prefill-lens", type=positive_ints, default=[32, 128, 384], help="prompt lengths")
    parser.add_argument("--decode-batches", type=positive_ints, default=[1, 4, 16], help="sequences per decode step")
    parser.add_argument("--decode-contexts", type=positive_ints, default=[64, 512], help="context lengths")
    parser.add_argument("--decode-steps", type=int, default=8, help="decode steps timed per grid point and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--link", default="loopback", help="the KV link the profile names (atomd/sim/hardware.py)")
    parser.add_argument("--name", default=None, help="the profile's name (default: model, dtype, threads)")
    parser.add_argument("--output", "-o", required=True, help="where to write the profile (JSON)")
    parser.add_argument("--from-servers", nargs="+", default=None, metavar="URL",
                        help="fit from these engines' served steps (started with $ATOMD_STEP_SAMPLES) instead of a grid")
    parser.add_argument("--gap-in-spread", action=argparse.BooleanOptionalAction, default=True,
                        help="--from-servers: add each busy gap's deviation from the gap model to its step's "
                             "residual (the spread), so a simulated step's gap varies as the served ones did")
    parser.add_argument("--contention", action=argparse.BooleanOptionalAction, default=True,
                        help="--from-servers with engines that shared the host's cores: fit how much longer a "
                             "forward is beside another engine's (simulated engines apply it with "
                             "$ATOMD_SIM_SHARED_CORES, atomd/sim/shared_cores.py)")
    parser.add_argument("--served-link", action=argparse.BooleanOptionalAction, default=True,
                        help="--from-servers with a PD pair's consumer: time pulls on the link it served (--link's "
                             "latency, the bandwidth its pulls' mean duration gives) instead of --link's constants")
    parser.add_argument("--spread-in-order", action="store_true",
                        help="--from-servers: keep the residuals in served order (walked in order by a simulated "
                             "engine: slow stretches stay stretches) instead of their quantiles (drawn independently)")


SPREAD_QUANTILES = 50
MIN_BY_SEQS_STEPS = 20  # served steps of one batch size before its own mean residual is kept


def served_samples(urls: list[str]) -> list[tuple]:
    """(StepShape, forward seconds, busy gap seconds or -1, the loop's work in the gap:
    (outputs, pulls, added), or None from an engine that does not record it, the engine's
    index in `urls`, the forward's start on the host's monotonic clock or None) of every
    step the engines at `urls` kept."""
    import urllib.request

    from atomd.sim.hardware import StepShape

    samples = []
    for url in urls:
        with urllib.request.urlopen(url.rstrip("/") + "/debug/stats", timeout=30) as r:
            stats = json.loads(r.read())
        if "step_samples" not in stats:
            raise ValueError(f"{url} keeps no step samples (start it with $ATOMD_STEP_SAMPLES=N)")
        for is_prefill, tokens, seqs, attention, context, seconds, gap, *work in stats["step_samples"]:
            samples.append((StepShape(bool(is_prefill), int(tokens), int(seqs), float(attention), int(context)),
                            float(seconds), float(gap), tuple(int(w) for w in work[:3]) if len(work) >= 3 else None,
                            urls.index(url), float(work[3]) if len(work) >= 4 else None))
    return samples


def served_link(base, urls: list[str]):
    """The KV link the consumers at `urls` served (a PD pair's D): `base`'s latency and the
    bandwidth their pulls' mean duration gives (the bytes pulled over their seconds less one
    latency each: with pulls of one size the two cannot be told apart, and only their sum
    matters to a simulated pull); None without a consumer's pull, or pulls no slower than the
    latency."""
    import urllib.request

    from atomd.sim.hardware import Link

    nbytes, seconds, pulls = 0, 0.0, 0
    for url in urls:
        with urllib.request.urlopen(url.rstrip("/") + "/debug/stats", timeout=30) as r:
            kv = json.loads(r.read()).get("kv_transfer") or {}
        if kv.get("role") == "consumer" and isinstance(kv.get("seconds"), dict):
            nbytes += int(kv.get("bytes", 0))
            seconds += float(kv["seconds"].get("sum", 0.0))
            pulls += int(sum(kv["seconds"].get("counts", [])))
    moving = seconds - pulls * base.latency_s
    if not pulls or nbytes <= 0 or moving <= 0:
        return None
    return Link(name=f"{base.name}-served", bandwidth=nbytes / moving, latency_s=base.latency_s,
                notes=f"{pulls} served pulls of {nbytes / pulls / 1e6:.2f} MB in {seconds / pulls * 1e3:.2f} ms "
                      f"on average; {base.name}'s latency")


MIN_CONTENTION_STEPS = 10  # steps alone and steps beside another engine's forward, each, to fit contention
ALONE_FRACTION = 0.05  # a step with at most this fraction of it beside another engine's forward is alone


def overlaps(samples: list[tuple]) -> np.ndarray:
    """Per sample (served_samples'), the seconds of its forward during which another
    engine's forward ran (engines told apart by index, lined up by start time); 0 where a
    start time is missing."""
    out = np.zeros(len(samples))
    engines = sorted({s[4] for s in samples if s[5] is not None})
    spans = {}
    for e in engines:  # each engine's forwards: sorted starts, ends, and busy seconds before each
        iv = sorted((s[5], s[5] + s[1]) for s in samples if s[4] == e and s[5] is not None)
        starts, ends = np.array([a for a, _ in iv]), np.array([b for _, b in iv])
        spans[e] = (starts, ends, np.concatenate([[0.0], np.cumsum(ends - starts)]))

    def busy(e: int, t: float) -> float:  # engine e's forward seconds up to time t
        starts, ends, before = spans[e]
        k = int(np.searchsorted(starts, t, side="right")) - 1
        return 0.0 if k < 0 else float(before[k] + min(max(t - starts[k], 0.0), ends[k] - starts[k]))

    for i, (_, seconds, _, _, engine, started) in enumerate(samples):
        if started is not None:
            out[i] = sum(busy(e, started + seconds) - busy(e, started) for e in engines if e != engine)
    return out


def fit_contention(samples: list[tuple], overlap: np.ndarray) -> float:
    """The seconds a forward is longer per second another engine's forward ran inside it
    (hardware.Calibrated.prefill_contention / decode_contention), from one kind's steps:
    a line fitted to the steps that ran alone (with each batch size's mean residual among
    them), then the overlapped steps' time over it per overlapped second. 0 without enough
    of either; within [0, 0.95]."""
    from atomd.sim.hardware import fit_linear

    seconds = np.array([s[1] for s in samples])
    alone = overlap <= ALONE_FRACTION * seconds
    if alone.sum() < MIN_CONTENTION_STEPS or (~alone).sum() < MIN_CONTENTION_STEPS:
        return 0.0
    shapes = [s[0] for s in samples]
    line = fit_linear([shapes[i] for i in np.flatnonzero(alone)], seconds[alone].tolist(), relative=False)
    expected = np.array([line.seconds(sh) for sh in shapes])
    seqs = np.array([sh.seqs for sh in shapes])
    for n in np.unique(seqs):
        mine = alone & (seqs == n)
        if mine.sum() >= 5:
            expected[seqs == n] += (seconds[mine] - expected[mine]).mean()
    return float(np.clip((seconds[~alone] - expected[~alone]).sum() / overlap[~alone].sum(), 0.0, 0.95))


def fit_served(samples: list[tuple], kind: str, in_order: bool = False):
    """The mean fit of one kind's served steps; the mean residual per batch size where it
    stands out of the noise (by_seqs); and the quantiles of what is left of measured - fitted
    seconds, at mean 0 (in_order: the last MAX_SPREAD residuals themselves, in served order,
    at mean 0). Additive, not a ratio: a shared machine delays a step by a time slice
    whatever its size, and a ratio learnt from short steps would stretch long ones."""
    from atomd.sim.hardware import MAX_SPREAD, MAX_SPREAD_S, fit_linear

    if len(samples) < 3:
        raise ValueError(f"{len(samples)} {kind} steps served: too few to fit (send traffic first)")
    fit = fit_linear([s for s, _ in samples], [t for _, t in samples], relative=False)
    residuals = np.array([t - fit.seconds(s) for s, t in samples])
    seqs = np.array([s.seqs for s, _ in samples])
    by_seqs = {}
    for n in np.unique(seqs).tolist():
        r = residuals[seqs == n]
        # a batch size seen often enough whose mean residual is beyond 3 standard errors: the
        # line misses it (not noise); the rest keep the line
        if len(r) >= MIN_BY_SEQS_STEPS and abs(r.mean()) > 3 * r.std(ddof=1) / np.sqrt(len(r)):
            by_seqs[int(n)] = round(float(np.clip(r.mean(), -0.999 * MAX_SPREAD_S, 0.999 * MAX_SPREAD_S)), 9)
    residuals = residuals - np.array([by_seqs.get(int(n), 0.0) for n in seqs])
    spread = residuals[-MAX_SPREAD:] if in_order else \
        np.quantile(residuals, (np.arange(SPREAD_QUANTILES) + 0.5) / SPREAD_QUANTILES)
    spread = spread - spread.mean()  # at mean 0: a simulated step's mean is the fit's
    # a stalled machine's minute-long step would make a profile the loader refuses: kept at its bound
    spread = np.clip(spread, -0.999 * MAX_SPREAD_S, 0.999 * MAX_SPREAD_S)
    return fit, [round(float(v), 6) for v in spread], by_seqs


class StepTimer:
    """Wraps an engine's forward: the shape and wall time of every step it runs."""

    def __init__(self, engine):
        from atomd.sim.hardware import StepShape

        self.samples: list[tuple[StepShape, float]] = []
        forward = engine._forward

        def timed(batch):
            started = time.perf_counter()
            out = forward(batch)
            self.samples.append((StepShape.of(batch.is_prefill, batch.num_scheduled_tokens.tolist(),
                                              batch.num_computed_tokens.tolist()), time.perf_counter() - started))
            return out
        engine._forward = timed

    def take(self):
        out, self.samples = self.samples, []
        return out


def grid_point(samples: list) -> tuple:
    """One grid point's steps as one fit sample: their mean shape and median time (a shared
    machine's preempted steps are outliers a least-squares fit must not see)."""
    from atomd.sim.hardware import StepShape

    shapes = [s for s, _ in samples]
    mean = StepShape(shapes[0].is_prefill, round(np.mean([s.tokens for s in shapes])),
                     round(np.mean([s.seqs for s in shapes])), float(np.mean([s.attention for s in shapes])),
                     round(np.mean([s.context for s in shapes])))
    return mean, float(np.median([t for _, t in samples]))


def run_batch(engine, rng, batch: int, length: int, max_tokens: int) -> None:
    from contracts.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        prompt = rng.integers(10, engine.vocab_size, length).tolist()
        engine.add_request(f"profile-{rng.integers(1 << 62)}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()


def run(args: argparse.Namespace) -> int:
    from atomd.config import EngineConfig
    from atomd.engine.llm_engine import LLMEngine
    from atomd.sim.hardware import Calibrated, fit_linear, resolve_link

    longest = max(args.prefill_lens + [c + args.decode_steps + 1 for c in args.decode_contexts])
    if longest > args.max_model_len:
        print(f"atomd profile: error: the grid needs {longest} tokens > --max-model-len {args.max_model_len}",
              file=sys.stderr)
        return 2
    if args.from_servers:
        return run_from_servers(args)
    try:
        link = resolve_link(args.link)
        config = EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.num_threads,
                              max_model_len=args.max_model_len, enable_prefix_caching=False,
                              max_num_seqs=max(args.prefill_batches + args.decode_batches),
                              max_num_batched_tokens=max(max(args.prefill_batches) * max(args.prefill_lens),
                                                         2048))
        config.check_model_dir()
    except ValueError as e:
        print(f"atomd profile: error: {e}", file=sys.stderr)
        return 2
    engine = LLMEngine(config)
    timer = StepTimer(engine)
    rng = np.random.default_rng(0)
    run_batch(engine, rng, 1, 16, 4)  # warm-up: first-touch allocations, kernel builds
    timer.take()
    prefill, decode = [], []
    for b in args.prefill_batches:
        for n in args.prefill_lens:
            for _ in range(args.rounds):
                run_batch(engine, rng, b, n, 1)
            got = [(s, t) for s, t in timer.take() if s.is_prefill]
            prefill.append(grid_point(got))
            print(f"prefill {b:>3} x {n:>5} tokens: {1e3 * np.median([t for _, t in got]):8.2f} ms", flush=True)
    for b in args.decode_batches:
        for c in args.decode_contexts:
            for _ in range(args.rounds):
                run_batch(engine, rng, b, c, args.decode_steps + 1)
            got = [(s, t) for s, t in timer.take() if not s.is_prefill and s.seqs == b]
            decode.append(grid_point(got))
            print(f"decode  {b:>3} x {c:>5} context: {1e3 * np.median([t for _, t in got]):8.2f} ms", flush=True)
    engine.close()
    fits = {}
    for name, samples in (("prefill", prefill), ("decode", decode)):
        shapes, seconds = [s for s, _ in samples], [t for _, t in samples]
        fits[name] = fit = fit_linear(shapes, seconds)
        err = np.median([abs(fit.seconds(s) - t) / t for s, t in samples])
        print(f"{name} fit: {fit.base_s * 1e3:.3f} ms + {fit.per_token_s * 1e6:.3f} us/token + "
              f"{fit.per_attention_s * 1e9:.4f} ns/{'pair' if name == 'prefill' else 'context token'}; "
              f"median error {100 * err:.1f}% over {len(samples)} grid points")
    name = args.name or f"{engine.model_name}-{config.dtype}-{config.num_threads}t"
    source = (f"atomd profile on {cpu_name()}, {config.num_threads} thread(s), {time.strftime('%Y-%m-%d %H:%M')}, "
              f"{len(prefill)} prefill and {len(decode)} decode grid points, median step times")
    write_profile(args, config, name, Calibrated(prefill=fits["prefill"], decode=fits["decode"], source=source), link)
    return 0


def write_profile(args, config, name: str, step, link) -> None:
    from atomd.engine.engine_loop import resolve_model_dir
    from atomd.sim.hardware import ModelShape, Profile

    model_name = config.model or "atomd-default"
    hf = json.loads((resolve_model_dir(config) / "config.json").read_text())
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[config.dtype]
    profile = Profile(name=name, model=ModelShape.from_hf_config(model_name, hf, dtype_bytes), step=step, link=link)
    with open(args.output, "wb") as f:
        f.write(profile.to_json())
    print(f"wrote {args.output}")


def run_from_servers(args: argparse.Namespace) -> int:
    from atomd.config import EngineConfig
    from atomd.sim.hardware import Calibrated, fit_gap, resolve_link

    try:
        link = resolve_link(args.link)
        config = EngineConfig(model=args.model, dtype=args.dtype)
        config.check_model_dir()
        samples = served_samples(args.from_servers)
        if args.served_link:
            link = served_link(link, args.from_servers) or link
        overlap = overlaps(samples)
        contention = {kind: fit_contention([x for x in samples if x[0].is_prefill == (kind == "prefill")],
                                           overlap[[x[0].is_prefill == (kind == "prefill") for x in samples]])
                      if args.contention else 0.0 for kind in ("prefill", "decode")}
        gaps = {kind: [(g, w) for s, _, g, w, *_ in samples if g >= 0 and s.is_prefill == (kind == "prefill")]
                for kind in ("prefill", "decode")}
        gap = {kind: float(np.mean([v for v, _ in g])) if g else 0.0 for kind, g in gaps.items()}
        models = {kind: fit_gap([w for _, w in g], [v for v, _ in g]) if g and all(w for _, w in g) else None
                  for kind, g in gaps.items()}

        def step_time(s, t, g, w, ov) -> float:
            """The forward's seconds less what another engine's forward beside it cost it
            (contention: the simulated engines of one host add it back, atomd/sim/shared_cores.py),
            plus (gap in spread) its busy gap's deviation from the gap model: a simulated
            engine waits the model's gap, so the gap's spread rides on the step's (a wait
            clamped at 0 per step would inflate its mean instead)."""
            kind = "prefill" if s.is_prefill else "decode"
            t -= contention[kind] * ov
            if not args.gap_in_spread or g < 0:
                return t
            model = models[kind]
            return t + g - (gap[kind] if model is None else model.seconds(*w))

        fits = {kind: fit_served([(s, step_time(s, t, g, w, ov)) for (s, t, g, w, *_), ov in zip(samples, overlap)
                                  if s.is_prefill == (kind == "prefill")], kind, in_order=args.spread_in_order)
                for kind in ("prefill", "decode")}
    except (ValueError, OSError) as e:
        print(f"atomd profile: error: {e}", file=sys.stderr)
        return 2
    for kind, (fit, spread, by_seqs) in fits.items():
        print(f"{kind} fit (served, mean): {fit.base_s * 1e3:.3f} ms + {fit.per_token_s * 1e6:.3f} us/token + "
              f"{fit.per_attention_s * 1e9:.4f} ns/{'pair' if kind == 'prefill' else 'context token'}; "
              "measured - fitted p10 %.2f ms, p50 %.2f ms, p90 %.2f ms" % tuple(np.quantile(spread, (0.1, 0.5, 0.9)) * 1e3)
              + "".join(f"; {n} seq{'s' * (n > 1)} {v * 1e3:+.3f} ms" for n, v in sorted(by_seqs.items())))
    name = args.name or f"{config.model or 'atomd-default'}-served"
    source = (f"atomd profile --from-servers on {cpu_name()}, {time.strftime('%Y-%m-%d %H:%M')}, "
              f"{len(samples)} served steps of {len(args.from_servers)} engine(s), mean fit"
              + (", busy gaps' deviations in the spread" if args.gap_in_spread else ""))
    print(f"KV link: {link.name}, {link.bandwidth / 1e9:.3f} GB/s + {link.latency_s * 1e3:.2f} ms"
          + (f" ({link.notes})" if link.notes else ""))
    for kind, q in contention.items():
        if q:
            print(f"{kind} contention: +{q:.3f} s per second another engine's forward ran beside it")
    for kind, g in gaps.items():
        m = models[kind]
        print(f"busy gap before a {kind} forward: mean {gap[kind] * 1e3:.2f} ms over {len(g)} steps" +
              ("" if m is None else f"; {m.base_s * 1e3:.2f} ms + {m.per_output_s * 1e3:.3f} ms/output + "
                                    f"{m.per_pull_s * 1e3:.2f} ms/pull landed + {m.per_request_s * 1e3:.2f} ms/request"))
    step = Calibrated(prefill=fits["prefill"][0], decode=fits["decode"][0], source=source,
                      prefill_spread=fits["prefill"][1], decode_spread=fits["decode"][1],
                      spread_in_order=args.spread_in_order,
                      prefill_gap_s=gap["prefill"], decode_gap_s=gap["decode"],
                      prefill_gap=models["prefill"], decode_gap=models["decode"],
                      prefill_by_seqs=fits["prefill"][2], decode_by_seqs=fits["decode"][2],
                      prefill_contention=contention["prefill"], decode_contention=contention["decode"])
    write_profile(args, config, name, step, link)
    return 0


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return "unknown CPU"
