"""`atomd plan`: pick a prefill:decode layout for a model, a hardware profile, SLOs and a
traffic description by simulating it (atomd/sim/fleet.py), and write it as a Ray config and
as Helm values.

For every accelerator count G up to --max-gpus the planner simulates G colocated engines and
the xPyD layouts (x + y = G) near the split the profile predicts (x / G = a prompt's prefill
time over a prompt's prefill time plus its decode time at a full batch: the layouts one
either side of it), for each decode --decode-max-seqs, with the router's adaptive PD off and
on (--adaptive); --dp-lockstep G groups each pool's engines into DP servers of G lockstep
ranks (pool sizes multiples of G); --exhaustive simulates every x. Each
layout's goodput is DistServe's: the highest Poisson rate at which --attainment of the
requests meet both the TTFT and the TPOT SLO. Layouts are ranked by goodput per accelerator.
"""
from __future__ import annotations

import argparse
import sys
import time

import msgspec
import yaml

from atomd.sim.fleet import SLO, Layout, Workload, max_goodput
from atomd.sim.hardware import Profile, StepShape, load_profile


class Ranked(msgspec.Struct, frozen=True):
    layout: Layout
    goodput: float  # requests/s within the SLO

    @property
    def per_gpu(self) -> float:
        return self.goodput / self.layout.num_engines


def positive_ints(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1 (`atomd plan` and `atomd profile`)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hardware", required=True, help="profile file or ACCELERATOR:MODEL (e.g. h100:llama3-8b)")
    parser.add_argument("--kv-link", default=None, help="nvlink | rdma400 | tcp | loopback (default: the profile's)")
    parser.add_argument("--input-len", type=int, required=True, help="mean prompt tokens")
    parser.add_argument("--output-len", type=int, required=True, help="mean output tokens")
    parser.add_argument("--spread", type=float, default=0.5, help="lengths uniform in mean x [1 - s, 1 + s]")
    parser.add_argument("--prefix-share", type=float, default=0.0, help="share of a prompt that is a common prefix")
    parser.add_argument("--ttft-ms", type=float, required=True)
    parser.add_argument("--tpot-ms", type=float, required=True)
    parser.add_argument("--attainment", type=float, default=0.9)
    parser.add_argument("--max-gpus", type=int, default=4)
    parser.add_argument("--decode-max-seqs", type=positive_ints, default=[256], help="decode engines' --max-num-seqs to try")
    parser.add_argument("--num-requests", type=int, default=100, help="requests per engine per simulated run")
    parser.add_argument("--min-duration-s", type=float, default=None,
                        help="a simulated run lasts at least this long (default: 10 x the TTFT SLO), so a "
                             "rate past capacity builds the queue it would")
    parser.add_argument("--adaptive", choices=("off", "on", "both"), default="both",
                        help="xPyD layouts with the router's --pd-mode adaptive off, on, or both")
    parser.add_argument("--dp-lockstep", type=int, default=1,
                        help="engines per DP server stepping in lockstep (--dp-lockstep; 1: none)")
    parser.add_argument("--exhaustive", action="store_true", help="simulate every xPyD split")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--model", default=None, help="the checkpoint the written configs serve (default: built-in)")
    parser.add_argument("--ray-config", default=None, help="write the best PD layout as a Ray launcher config here")
    parser.add_argument("--helm-values", default=None, help="write the best PD layout as Helm values here")


def predicted_prefill_share(profile: Profile, workload: Workload, decode_batch: int) -> float:
    """A prompt's prefill time over that plus its decode time (its share of a decode step at
    `decode_batch`, over its output tokens): the P share of a balanced layout."""
    n = workload.input_len
    prefill = profile.step_seconds(StepShape.of(True, [n], [0]))
    context = n + workload.output_len // 2
    step = profile.step_seconds(StepShape.of(False, [1] * decode_batch, [context] * decode_batch))
    decode = workload.output_len * step / decode_batch
    return prefill / (prefill + decode)


def candidate_layouts(profile: Profile, workload: Workload, max_gpus: int, decode_max_seqs: list[int],
                      exhaustive: bool, min_gpus: int = 1, adaptive: tuple[bool, ...] = (False,),
                      dp_lockstep: int = 1) -> list[Layout]:
    """Pool sizes in multiples of `dp_lockstep` (each lockstep group one DP server)."""
    out = []
    k = dp_lockstep
    for seqs in decode_max_seqs:
        share = predicted_prefill_share(profile, workload, min(seqs, 64))
        for g in range(max(min_gpus, k), max_gpus + 1, k):
            out.append(Layout("colocated", 0, g, decode_max_num_seqs=seqs, dp_lockstep=k))
            if g < 2 * k:
                continue
            guess = min(g - k, max(k, k * round(share * g / k)))
            splits = range(k, g, k) if exhaustive else \
                sorted({x for x in (guess - k, guess, guess + k) if k <= x < g})
            out += [Layout("pd", x, g - x, decode_max_num_seqs=seqs, adaptive=a, dp_lockstep=k)
                    for x in splits for a in adaptive]
    return out


def plan(profile: Profile, workload: Workload, slo: SLO, max_gpus: int, decode_max_seqs: list[int],
         exhaustive: bool = False, progress=None, min_gpus: int = 1, iterations: int = 12,
         adaptive: tuple[bool, ...] = (False,), dp_lockstep: int = 1) -> list[Ranked]:
    """Every candidate layout of min_gpus..max_gpus accelerators with its goodput (the rate
    bisected `iterations` times), best goodput per accelerator first."""
    max_len = 2 * (workload.input_len + workload.output_len) + 16
    ranked = []
    for layout in candidate_layouts(profile, workload, max_gpus, decode_max_seqs, exhaustive, min_gpus, adaptive,
                                    dp_lockstep):
        # as many requests per engine at every size: a short trace flatters a large layout
        scaled = msgspec.structs.replace(workload, num_requests=workload.num_requests * layout.num_engines)
        ranked.append(Ranked(layout, max_goodput(profile, layout, scaled, slo, max_model_len=max_len,
                                                 iterations=iterations)))
        if progress is not None:
            progress(ranked[-1])
    return sorted(ranked, key=lambda r: (-r.per_gpu, r.layout.num_engines))


def ray_config(layout: Layout, model: str | None) -> dict:
    """The Ray launcher's config for `layout` (launch/ray_config.py's schema; the rest its
    defaults). Written as plain data: atomd never imports launch, which starts it. A
    lockstep group is one engine of data_parallel_size ranks with --dp-lockstep."""
    k, dp = layout.dp_lockstep, (["--dp-lockstep"] if layout.dp_lockstep > 1 else [])
    out = {"model": model, "prefill": {"count": layout.num_prefill // k, "data_parallel_size": k, "extra_args": dp},
           "decode": {"count": layout.num_decode // k, "data_parallel_size": k,
                      "extra_args": ["--max-num-seqs", str(layout.decode_max_num_seqs), *dp]}}
    if layout.adaptive:
        out["router"] = {"extra_args": ["--pd-mode", "adaptive"]}
    return out


def helm_values(layout: Layout) -> dict:
    k, dp = layout.dp_lockstep, (["--dp-lockstep"] if layout.dp_lockstep > 1 else [])
    out = {"prefill": {"replicas": layout.num_prefill // k, "dataParallelSize": k, "extraArgs": dp},
           "decode": {"replicas": layout.num_decode // k, "dataParallelSize": k,
                      "extraArgs": ["--max-num-seqs", str(layout.decode_max_num_seqs), *dp]}}
    if layout.adaptive:
        out["router"] = {"extraArgs": ["--pd-mode", "adaptive"]}
    return out


def run(args: argparse.Namespace) -> int:
    try:
        profile = load_profile(args.hardware).with_link(args.kv_link)
        min_duration = args.min_duration_s if args.min_duration_s is not None else 10 * args.ttft_ms / 1e3
        workload = Workload(input_len=args.input_len, output_len=args.output_len, spread=args.spread,
                            prefix_share=args.prefix_share, num_requests=args.num_requests,
                            min_duration_s=min_duration)
        slo = SLO(args.ttft_ms / 1e3, args.tpot_ms / 1e3, args.attainment)
        if not (args.max_gpus >= 1 and args.dp_lockstep >= 1 and 0 <= args.spread < 1 and 0 <= args.prefix_share <= 1
                and 0 < args.attainment <= 1 and args.input_len >= 1 and args.output_len >= 1):
            raise ValueError("need --max-gpus >= 1, --dp-lockstep >= 1, 0 <= --spread < 1, 0 <= --prefix-share <= 1, "
                             "0 < --attainment <= 1, lengths >= 1")
    except ValueError as e:
        print(f"atomd plan: error: {e}", file=sys.stderr)
        return 2
    started = time.monotonic()

    def progress(r: Ranked) -> None:
        print(f"  {r.layout.label():<40} {r.goodput:9.2f} req/s  {r.per_gpu:8.2f} per GPU", flush=True)

    print(f"simulating on {profile.name} (link {profile.link.name}): {args.input_len} in / {args.output_len} out, "
          f"TTFT {args.ttft_ms} ms, TPOT {args.tpot_ms} ms at {args.attainment:.0%}", flush=True)
    adaptive = {"off": (False,), "on": (True,), "both": (False, True)}[args.adaptive]
    ranked = plan(profile, workload, slo, args.max_gpus, args.decode_max_seqs, args.exhaustive, progress,
                  adaptive=adaptive, dp_lockstep=args.dp_lockstep)
    pd = [r for r in ranked if r.layout.kind == "pd"]
    colocated = [r for r in ranked if r.layout.kind == "colocated"]
    print(f"\nbest by goodput per accelerator ({time.monotonic() - started:.0f} s):")
    for r in pd[:args.top]:
        vs = f"{r.per_gpu / colocated[0].per_gpu:5.2f}x colocated" if colocated and colocated[0].per_gpu else ""
        print(f"  {r.layout.label():<40} {r.per_gpu:8.2f} req/s per GPU  {vs}")
    if colocated:
        print(f"  best colocated: {colocated[0].layout.label():<24} {colocated[0].per_gpu:8.2f} req/s per GPU")
    if pd and (args.ray_config or args.helm_values):
        best = pd[0].layout
        if args.ray_config:
            with open(args.ray_config, "w") as f:
                f.write(f"# atomd plan: {best.label()} on {profile.name}\n")
                yaml.safe_dump(ray_config(best, args.model), f, sort_keys=False)
        if args.helm_values:
            with open(args.helm_values, "w") as f:
                f.write(f"# atomd plan: {best.label()} on {profile.name}\n")
                yaml.safe_dump(helm_values(best), f, sort_keys=False)
    return 0
