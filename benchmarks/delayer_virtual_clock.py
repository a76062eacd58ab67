#!/usr/bin/env python
"""The PrefillDelayer on expert-parallel coupling, timed on a virtual clock: what the delayer
buys two ranks on cores of their own, measured on a loaded shared machine.

Two rank processes (one torch thread each) each run an expert-parallel LLMEngine of `--shape`
over a gloo group, as `atomd serve --data-parallel-size 2 --enable-expert-parallel` does, with
this loop in place of the engine core's. Time is virtual: every tick each rank takes its
thread's CPU time in the step (a wait in a collective is not CPU), the ranks all-reduce it
and the clock advances by the slower rank's, the tick's critical path: what the tick would
take on two cores of its own, the transport's latency left out. Requests arrive on that clock
(gamma inter-arrival times: shape 1 is Poisson, < 1 bursts; prompts of mixed lengths, exactly
--output-len tokens each, or mixed output lengths with --output-range-ratio), go to the rank with fewer unfinished requests (ties to rank 0, as
DPEngineClient places them), and their TTFT and inter-token gaps are read on it; when no rank
has work the clock jumps to the next arrival. The machine's other load changes how long a run
takes, not what it reports.

Round 0 first floods the ranks (every request at 0, delayer off) for their capacity in
requests per virtual second; every run then offers --load x that capacity. Per round each
arrival pattern runs every mode in turn (the order rotating by round); one engine per rank
serves all runs (its prefix cache reset between them), so no run pays a fresh process's warm-up.

--modes: a delayer policy (off, align, coalesce; `align:N` / `coalesce:N`: with an aligned tick's
budget of N prompt tokens split between the ranks prefilling in it, --prefill-delayer-aligned-tokens N;
any of them `/C`: --max-local-prefill-tokens-per-step C for that mode, e.g. `off/384`; a delayer
policy `@D`: --prefill-delayer-max-delay-passes D for that mode, e.g. `align:512@4`), with `+mixed` for mixed steps
(--enable-mixed-chunk: decode rows ride in every prefill step) or `+mixed-gather` for mixed steps
whose decode rows take the prefill path (a gather + SDPA each, atomd/engine/runner.py's
DECODE_ROWS_KERNEL off: what mixed steps were before their decode rows went through the decode
kernel). A mixed mode has its own flood, offers --load x its own capacity (--same-arrivals: the
seed steps', every mode then sees the same requests at the same times) and is compared with `off`
of its kind (`off+mixed`, `off+mixed-gather`) and with the seed's `off`; `off+mixed` itself also
runs on the arrivals of `off`'s rate (`off+mixed@seed`: same requests, same times).

The ITL tail table: every gap at or over its run's ITL p99, which ticks it spanned, and of those
the longest (the one that made it long): both ranks prefilling, the gap's own rank prefilling
alone, the other rank prefilling alone, or no prefill.

    .venv/bin/python -m benchmarks.delayer_virtual_clock --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.multiprocessing as mp

from benchmarks.machine import cpu_model, loadavg
from benchmarks.model_shapes import CHOICES, flops_per_token, model_dir

POLICIES = ("off", "align", "coalesce")
KINDS = ("", "mixed", "mixed-gather")  # the seed's one-kind steps; mixed steps; mixed, decode rows gathered
MODES = tuple(p + (f"+{k}" if k else "") for k in KINDS for p in POLICIES)


def kind_of(mode: str) -> str:
    return mode.partition("+")[2]


def policy_of(mode: str) -> tuple[str, int, int, int]:
    """(delayer policy, aligned tokens, prompt-token cap, max delay passes; 0: off / the default,
    -1: not a number) of a mode such as `align:768+mixed`, `align:512@4+mixed` or `off/384+mixed`
    (`-own`, as in `align:512@4-own+mixed`, is own_release's)."""
    head, _, cap = mode.partition("+")[0].removesuffix("-own").partition("/")
    head, _, delay = head.partition("@")
    policy, _, tokens = head.partition(":")
    return (policy, *(int(n) if n.isdigit() else (0 if not n else -1) for n in (tokens, cap, delay)))


def head_of(mode: str) -> str:
    """The part of a mode its delayer config is made of: `align:512@4` of `align:512@4/256-own+mixed`."""
    return mode.partition("+")[0].removesuffix("-own").partition("/")[0]


def own_release(mode: str) -> bool:
    """`-own` (e.g. `align:512@4-own+mixed`): a lone release takes the rank's own budget, not
    the aligned share (scheduler/prefill_delayer.py's RELEASE_SHARE off: before issue #36's s36f)."""
    return mode.partition("+")[0].endswith("-own")


def valid_mode(mode: str) -> bool:
    (policy, tokens, cap, delay), kind = policy_of(mode), kind_of(mode)
    return (policy in POLICIES and kind in KINDS and min(tokens, cap, delay) >= 0
            and not ((tokens or delay) and policy == "off") and "@0" not in mode
            and not (own_release(mode) and not tokens))


def baseline(mode: str) -> str:
    """The mode a mode's ratios are taken against: off with the same kind of steps."""
    return "off" + (f"+{kind_of(mode)}" if kind_of(mode) else "")


def set_kind(engine, kind: str) -> None:
    """The engine's steps from now on: KINDS' `kind`."""
    from atomd.engine import runner

    engine.scheduler.config.enable_mixed_chunk = bool(kind)
    runner.DECODE_ROWS_KERNEL = kind != "mixed-gather"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workload(args: dict, seed: int, rate: float | None, burstiness: float) -> list[tuple[float, list[int], int]]:
    """(virtual arrival s, prompt, output tokens) per request, the same on every rank; rate None: all at 0."""
    rng = np.random.default_rng(seed)
    n, length, spread = args["num_prompts"], args["input_len"], args["range_ratio"]
    lengths = rng.integers(int(length * (1 - spread)), int(length * (1 + spread)) + 1, n)
    prompts = [[int(t) for t in rng.integers(10, args["vocab_size"], m)] for m in lengths]
    out, out_spread = args["output_len"], args["output_range_ratio"]
    outputs = [out] * n if not out_spread else \
        [int(m) for m in rng.integers(max(1, int(out * (1 - out_spread))), int(out * (1 + out_spread)) + 1, n)]
    if rate is None:
        return [(0.0, p, m) for p, m in zip(prompts, outputs)]
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), n)
    return list(zip(np.cumsum(gaps) - gaps[0], prompts, outputs))


def serve(engine, coll, rank: int, world: int, requests: list[tuple[float, list[int], int]]) -> dict:
    """Every request through the ranks on the virtual clock; this rank's requests' timings."""
    from contracts.sampling import SamplingParams

    now, nxt, unfinished = 0.0, 0, [0] * world
    arrival: dict[str, float] = {}
    times: dict[str, list[float]] = {}
    tick_of: dict[str, list[int]] = {}  # per request: the tick of each token
    kinds: list[int] = []  # per tick: 1 prefill, 0 decode, -1 no forward
    critical: list[float] = []  # per tick: the slower rank's CPU s
    cpus: list[list[float]] = []  # per tick: every rank's CPU s (critical minus a rank's: its wait)
    exchange: list[float] = []  # per tick: this rank's wall s inside the EP all-to-alls
    step_wall: list[float] = []  # per tick: this rank's wall s in the step
    ep = engine.model.ep
    wall = time.perf_counter()
    while nxt < len(requests) or any(unfinished):
        if not any(unfinished) and requests[nxt][0] > now:
            now = requests[nxt][0]  # nobody has work: the clock jumps to the next arrival
        while nxt < len(requests) and requests[nxt][0] <= now:
            to = min(range(world), key=lambda r: (unfinished[r], r))
            unfinished[to] += 1
            if to == rank:
                rid = f"r{nxt}"
                engine.add_request(rid, requests[nxt][1], SamplingParams(max_tokens=requests[nxt][2],
                                                                         temperature=0.0, ignore_eos=True))
                arrival[rid] = requests[nxt][0]
            nxt += 1
        cpu, in_exchange, started = time.thread_time(), ep.exchange_s if ep else 0.0, time.perf_counter()
        outputs = engine.step()
        cpu = time.thread_time() - cpu
        step_wall.append(time.perf_counter() - started)
        exchange.append((ep.exchange_s if ep else 0.0) - in_exchange)
        kinds.append(-1 if engine.last_forward is None else int(engine.last_forward[0]))
        vec = np.zeros(2 * world, dtype=np.int64)
        vec[rank], vec[world + rank] = int(cpu * 1e6), sum(engine.scheduler.get_request_counts())
        sums = coll.all_reduce_sum(vec)
        critical.append(int(sums[:world].max()) / 1e6)
        cpus.append([int(c) / 1e6 for c in sums[:world]])
        now += critical[-1]
        unfinished = [int(u) for u in sums[world:]]
        for out in outputs:
            times.setdefault(out.request_id, []).extend([now] * len(out.new_token_ids))
            tick_of.setdefault(out.request_id, []).extend([len(kinds) - 1] * len(out.new_token_ids))
    return {"end": now, "ticks": len(kinds), "prefill_ticks": kinds.count(1), "kinds": kinds, "critical": critical,
            "cpus": cpus, "exchange": exchange, "step_wall": step_wall,
            "wall_s": time.perf_counter() - wall,
            "ttft": [times[rid][0] - arrival[rid] for rid in arrival],
            "itl": [b - a for rid in arrival for a, b in zip(times[rid], times[rid][1:])],
            "itl_ticks": [(a, b) for rid in arrival for a, b in zip(tick_of[rid], tick_of[rid][1:])],
            "tokens": sum(len(t) for t in times.values())}


def probe_prefill_ticks(engine, coll, rank: int, world: int, args: dict, repeats: int = 5) -> dict:
    """What merging two prefills saves, measured: the critical path of the prefill tick of one
    --input-len prompt on rank 0 alone (rank 1 idle: it runs its share of the experts) and of one
    such prompt on each rank at once (the aligned tick), `repeats` times each, alternating."""
    rng = np.random.default_rng(7)
    lone, paired = [], []
    for _ in range(repeats):
        for n, into in ((1, lone), (2, paired)):
            prompts = [[int(t) for t in rng.integers(10, args["vocab_size"], args["input_len"])] for _ in range(n)]
            engine.reset_prefix_cache()
            result = serve(engine, coll, rank, world, [(0.0, p, 1) for p in prompts])
            into.append(result["critical"][result["kinds"].index(1)] if rank == 0 else 0.0)
    return {"round": -2, "policy": "probe", "lone": lone, "paired": paired}


def rank_main(rank: int, world: int, port: int, args: dict, out: str) -> None:
    torch.set_num_threads(1)
    from atomd.config import EngineConfig
    from atomd.engine.dp_collective import GlooCollective, make_prefill_delayer
    from atomd.engine.llm_engine import LLMEngine
    from scheduler import prefill_delayer

    coll = GlooCollective(rank, world, port, timeout_s=600, join_timeout_s=600)
    # room for every sequence of a full batch at the longest prompt: no preemption in any run
    max_len = int(args["input_len"] * (1 + args["range_ratio"])) + int(args["output_len"] * (1 + args["output_range_ratio"])) + 1
    blocks = args["max_num_seqs"] * -(-max_len // 16) + 16
    configs = {p: EngineConfig(model=args["model"], data_parallel_size=world, data_parallel_rank=rank,
                               enable_expert_parallel=True, prefill_delayer=policy_of(p)[0], num_threads=1,
                               max_model_len=max(1024, max_len), max_num_seqs=args["max_num_seqs"],
                               num_kvcache_blocks=max(512, blocks),
                               prefill_delayer_token_usage_low_watermark=args["low_watermark"],
                               max_local_prefill_tokens_per_step=args["prefill_cap"],
                               prefill_delayer_aligned_tokens=policy_of(p)[1],
                               **({"prefill_delayer_max_delay_passes": policy_of(p)[3] or args["max_delay"]}
                                  if policy_of(p)[3] or args["max_delay"] else {}))
               for p in {"off"} | {head_of(m) for m in args["modes"]}}
    engine = LLMEngine(configs["off"], expert_group=coll)
    coll.barrier()
    modes = args["modes"]
    kinds = sorted({kind_of(m) for m in modes}, key=KINDS.index)
    runs, capacity = [], {}
    for kind in kinds:
        set_kind(engine, kind)
        flood = serve(engine, coll, rank, world, workload(args, 999, None, 1.0))
        capacity[kind] = args["num_prompts"] / flood["end"]  # the same on every rank: the clock is shared
        runs.append({"round": -1, "burstiness": 0, "policy": "flood" + (f"+{kind}" if kind else ""), **flood})
    set_kind(engine, "")
    runs.append(probe_prefill_ticks(engine, coll, rank, world, args))
    started = time.monotonic()
    for rnd in range(args["rounds"]):
        # --time-budget-s: no round starts that would end past it (at the last round's pace);
        # decided together (rank 0's clock), so every rank runs the same runs
        elapsed = time.monotonic() - started
        over = args["time_budget_s"] > 0 and rnd > 0 and elapsed * (rnd + 1) / rnd > args["time_budget_s"]
        if coll.all_reduce_sum(np.array([int(over and rank == 0)], dtype=np.int64))[0]:
            print(f"rank {rank}: stopping after {rnd} rounds (--time-budget-s)", file=sys.stderr, flush=True)
            break
        for b in args["burstiness"]:
            order = modes[rnd % len(modes):] + modes[:rnd % len(modes)]
            for mode in order:
                policy, kind = head_of(mode), kind_of(mode)  # policy: e.g. align:768@4
                # off+mixed on the seed's rate too: what mixed steps buy on the same arrivals
                # (--same-arrivals: every mode on the seed's rate, so all of them see the same requests)
                if args["same_arrivals"] and "" in kinds:
                    rates_of = [""]
                else:
                    rates_of = [kind, ""] if mode == "off+mixed" and "" in kinds else [kind]
                for rate_of in rates_of:
                    rate = args["load"] * capacity[rate_of]
                    requests = workload(args, rnd * 100 + int(b * 10), rate, b)
                    engine.reset_prefix_cache()
                    set_kind(engine, kind)
                    engine.scheduler.config.max_local_prefill_tokens_per_step = policy_of(mode)[2] or args["prefill_cap"]
                    prefill_delayer.RELEASE_SHARE = not own_release(mode)
                    engine.scheduler.prefill_delayer = (make_prefill_delayer(configs[policy], coll)
                                                        if policy_of(mode)[0] != "off" else None)
                    result = serve(engine, coll, rank, world, requests)
                    delayer = engine.scheduler.prefill_delayer
                    name = mode if rate_of == kind or args["same_arrivals"] else "off+mixed@seed"
                    runs.append({"round": rnd, "burstiness": b, "policy": name, "rate": rate,
                                 "delayer": delayer.stats()["outcomes"] if delayer else [], **result})
                    print(f"rank {rank}: round {rnd} burstiness {b:g} {name} done ({result['wall_s']:.0f} s wall)",
                          file=sys.stderr, flush=True)
    with open(out, "w") as f:
        json.dump(runs, f)
    coll.close()


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=384)
    ap.add_argument("--range-ratio", type=float, default=0.9, help="prompt lengths in L*(1 -+ r)")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--output-range-ratio", type=float, default=0.0, help="output lengths in O*(1 -+ r) (vLLM's "
                    "random dataset draws both lengths so); 0: exactly --output-len each")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="per rank: below the requests in flight, the "
                    "ranks run full batches and admit a prefill whenever one of theirs finishes")
    ap.add_argument("--low-watermark", type=float, default=None, help="align's valve: a held rank whose KV usage is "
                    "under this prefills at once (--prefill-delayer-token-usage-low-watermark; default off)")
    ap.add_argument("--max-delay", type=int, default=0, help="align's bound: ticks a prefill may be held "
                    "(--prefill-delayer-max-delay-passes; 0: the engine's default)")
    ap.add_argument("--prefill-cap", type=int, default=0, help="prompt tokens a rank's step may carry while its "
                    "streams run (--max-local-prefill-tokens-per-step, every mode; 0: off)")
    ap.add_argument("--same-arrivals", action="store_true", help="every mode offered --load x the seed steps' "
                    "capacity (the same requests at the same times), not its own kind's")
    ap.add_argument("--load", type=float, default=0.9, help="offered load, a fraction of the flood's capacity")
    ap.add_argument("--burstiness", default="1,0.25", help="gamma shapes, comma-separated: 1 Poisson, < 1 bursts")
    ap.add_argument("--shape", choices=CHOICES, default="qwen3-moe-small", help="benchmarks/model_shapes.py")
    ap.add_argument("--time-budget-s", type=float, default=0, help="start no round that would end past this many "
                    "seconds of the rounds' wall time (0: every round)")
    ap.add_argument("--modes", default="off,align,coalesce", help=f"comma-separated, of {','.join(MODES)}, and "
                    "align:N / coalesce:N with any kind (N: --prefill-delayer-aligned-tokens), any policy with /C "
                    "(--max-local-prefill-tokens-per-step C for that mode), align / coalesce with @D "
                    "(--prefill-delayer-max-delay-passes D for that mode)")
    ap.add_argument("--against", default="", help="comma-separated modes of --modes: every other mode's ratios "
                    "against each of them too, per round (e.g. off/256+mixed: off with the same per-rank chunk)")
    ap.add_argument("--report", metavar="DIR", help="run nothing: report the per-rank JSON a run left in DIR "
                    "(with that run's arguments)")
    a = ap.parse_args()
    modes = a.modes.split(",")
    if not all(map(valid_mode, modes)) or not {baseline(m) for m in modes} <= set(modes):
        ap.error(f"--modes: of {MODES} (align:N, coalesce:N, /C too), each with its baseline (off, off+mixed)")
    against = [m for m in a.against.split(",") if m]
    if not set(against) <= set(modes):
        ap.error(f"--against {a.against}: every one of them must be in --modes")
    model = model_dir(a.shape)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    args = {"model": str(model), "vocab_size": vocab, "num_prompts": a.num_prompts, "input_len": a.input_len,
            "range_ratio": a.range_ratio, "output_len": a.output_len, "output_range_ratio": a.output_range_ratio, "low_watermark": a.low_watermark, "max_delay": a.max_delay, "prefill_cap": a.prefill_cap, "same_arrivals": a.same_arrivals, "load": a.load, "max_num_seqs": a.max_num_seqs, "rounds": a.rounds, "modes": modes, "time_budget_s": a.time_budget_s,
            "burstiness": [float(b) for b in a.burstiness.split(",")]}
    print(f"CPU: {cpu_model()}; load average before: {loadavg()}", flush=True)
    config = json.loads((model / "config.json").read_text())
    if config.get("num_experts"):  # a Qwen3-MoE shape: how much of a prefill EP spreads over the ranks
        share = flops_per_token(config, a.input_len)["expert_share"]
        print(f"{a.shape}: experts {100 * share:.0f} % of a {a.input_len}-token prefill's multiply-adds "
              f"(per rank: attention, router, head {100 * (1 - share):.0f} %)", flush=True)
    work = a.report or tempfile.mkdtemp(prefix="atomd-delayer-vclock-")
    outs = [os.path.join(work, f"rank{r}.json") for r in range(2)]
    if not a.report:
        port = free_port()
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=rank_main, args=(r, 2, port, args, outs[r])) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            sys.exit(f"a rank failed (exit codes {[p.exitcode for p in procs]})")
    ranks = [json.load(open(o)) for o in outs]
    rows, ratios = [], {}
    for flood in (r for r in ranks[0] if r["round"] == -1):
        print(f"{flood['policy']} (delayer off, every request at 0): {a.num_prompts} requests in {flood['end']:.2f} "
              f"virtual s -> capacity {a.num_prompts / flood['end']:.2f} req/s; offered {a.load:g}x that")
    probe = next(r for r in ranks[0] if r["round"] == -2)
    lone, paired = statistics.median(probe["lone"]), statistics.median(probe["paired"])
    print(f"prefill ticks of one {a.input_len}-token prompt (median of {len(probe['lone'])}): alone on a rank "
          f"{1e3 * lone:.0f} ms, one on each rank at once {1e3 * paired:.0f} ms -> merging two lone prefills saves "
          f"{100 * (1 - paired / (2 * lone)):.0f} % of their ticks (the experts' share of a prefill's time, from "
          f"alone = A + E/2, at once = A + E: {100 * (2 - 2 * lone / paired):.0f} %)")
    runs = [(r0, r1) for r0, r1 in zip(*ranks) if r0["round"] >= 0]
    by_key = {(r0["round"], r0["burstiness"], r0["policy"]): (r0, r1) for r0, r1 in runs}
    names = tuple(modes) + ("off+mixed@seed",)

    def tput_itl(pair) -> tuple[float, float]:
        return (pair[0]["tokens"] + pair[1]["tokens"]) / pair[0]["end"], pct(pair[0]["itl"] + pair[1]["itl"], 99)

    for (rnd, b, mode), (r0, r1) in sorted(by_key.items(), key=lambda kv: (kv[0][0], kv[0][1], names.index(kv[0][2]))):
        tput, itl99 = tput_itl((r0, r1))
        ttft, itl = r0["ttft"] + r1["ttft"], r0["itl"] + r1["itl"]
        base = "off" if mode == "off+mixed@seed" else baseline(mode)
        off_tput, off_itl = tput_itl(by_key[rnd, b, base])
        seed_tput, seed_itl = tput_itl(by_key[rnd, b, "off"]) if (rnd, b, "off") in by_key else (off_tput, off_itl)
        ratios.setdefault((b, mode), []).append((tput / off_tput, itl99 / off_itl, tput / seed_tput, itl99 / seed_itl))
        decisions = ", ".join(f"{o}/{why} {n}" for _, o, why, n in r0["delayer"]) or "-"
        rows.append(f"| {rnd} | {b:g} | {mode} | {tput:.1f} | {tput / off_tput:.2f} ({base}) | {1e3 * pct(ttft, 50):.0f} | "
                    f"{1e3 * pct(ttft, 99):.0f} | {1e3 * pct(itl, 50):.1f} | {1e3 * itl99:.1f} | "
                    f"{itl99 / off_itl:.2f} | {r0['ticks']} | {r0['prefill_ticks']} + {r1['prefill_ticks']} | "
                    f"{r0['wall_s']:.0f} | {decisions} |")
    print("\n| round | burstiness | mode | out tok per virtual s | vs baseline | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | "
          "ITL p99 ms | ITL p99 vs baseline | ticks | prefill ticks (rank 0 + 1) | wall s | rank 0 decisions |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("\n| burstiness | mode | baseline | tok/s vs baseline, median (range) | ITL p99 vs baseline, median (range) | "
          "tok/s vs seed off, median (range) | ITL p99 vs seed off, median (range) |\n|---|---|---|---|---|---|---|")

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"

    for (b, mode), v in sorted(ratios.items(), key=lambda kv: (kv[0][0], names.index(kv[0][1]))):
        base = "off" if mode == "off+mixed@seed" else baseline(mode)
        print(f"| {b:g} | {mode} | {base} | " + " | ".join(spread([r[j] for r in v]) for j in range(4)) + " |")
    for base in against:
        versus(by_key, base, names, tput_itl)
    breakdown(by_key)
    waits(by_key)
    itl_tail(by_key)
    print(f"\nload average after: {loadavg()}; per-rank JSON: {work}")


def versus(by_key: dict, base: str, names: tuple, tput_itl) -> None:
    """Every mode's throughput, ITL p99 and TTFT p50 against `base` (--against), run by run on
    the same arrivals: the median of the rounds' ratios and each round's."""
    ratios: dict[tuple[float, str], list[tuple[float, float, float]]] = {}
    for (rnd, b, mode), pair in by_key.items():
        if mode == base or (rnd, b, base) not in by_key:
            continue
        other = by_key[rnd, b, base]
        (tput, itl99), (base_tput, base_itl) = tput_itl(pair), tput_itl(other)
        ttft = pct(pair[0]["ttft"] + pair[1]["ttft"], 50) / pct(other[0]["ttft"] + other[1]["ttft"], 50)
        ratios.setdefault((b, mode), []).append((rnd, tput / base_tput, itl99 / base_itl, ttft))
    print(f"\nAgainst {base} (same arrivals; median of the rounds' ratios, then each round's in round order):\n")
    print(f"| burstiness | mode | tok/s vs {base} | per round | ITL p99 vs {base} | per round | TTFT p50 vs {base} |")
    print("|---|---|---|---|---|---|---|")
    for (b, mode), v in sorted(ratios.items(), key=lambda kv: (kv[0][0], names.index(kv[0][1]))):
        v.sort()
        cols = [[r[j] for r in v] for j in (1, 2, 3)]
        print(f"| {b:g} | {mode} | {statistics.median(cols[0]):.2f}x | {' / '.join(f'{x:.2f}' for x in cols[0])} | "
              f"{statistics.median(cols[1]):.2f}x | {' / '.join(f'{x:.2f}' for x in cols[1])} | "
              f"{statistics.median(cols[2]):.2f}x |")


def breakdown(by_key: dict) -> None:
    """Where each policy's virtual time went, all rounds: per pair of the ranks' tick kinds
    (P prefill, D decode, - no forward), the ticks and their critical-path seconds."""
    pairs = ["PP", "DP", "-P", "DD", "-D", "--"]
    table: dict[tuple[float, str], dict[str, list[float]]] = {}
    for (_, b, policy), (r0, r1) in by_key.items():
        cell = table.setdefault((b, policy), {p: [0, 0.0] for p in pairs})
        for k0, k1, cpu in zip(r0["kinds"], r1["kinds"], r0["critical"]):
            pair = "".join(sorted("-DP"[k + 1] for k in (k0, k1)))
            cell[pair][0] += 1
            cell[pair][1] += cpu
    print("\nWhere the virtual time went (all rounds; ticks, seconds), per pair of the ranks' tick kinds "
          "(P prefill, D decode, - no forward):\n")
    print("| burstiness | policy | " + " | ".join(pairs) + " |\n|---|---|" + "---|" * len(pairs))
    for (b, policy), cell in sorted(table.items()):
        print(f"| {b:g} | {policy} | " + " | ".join(f"{n}, {sec:.2f} s" for n, sec in cell.values()) + " |")


def waits(by_key: dict) -> None:
    """Where the ranks wait, all rounds: in a tick the faster rank waits out the slower one's
    extra CPU (critical path minus its own CPU) in the EP all-to-alls. Per run kind: the lone
    prefill ticks (one rank prefills, the other decodes or idles: DP, -P), the prefilling rank's
    CPU, the other's, the other's wait against the tick, and its wall inside the all-to-alls
    against its step's wall (both wall: noisy on a loaded machine); then every tick's wait
    summed (the faster rank's, as a share of the run's virtual time) and the balanced bound:
    the run's virtual time over what it would be if every tick's work were split evenly
    between the ranks (time / sum of the ranks' mean CPU per tick), an upper bound on what any
    reordering of the same work between ticks, a delayer's included, could buy."""
    table: dict[tuple[float, str], dict[str, list[float]]] = {}
    for (_, b, policy), (r0, r1) in by_key.items():
        cell = table.setdefault((b, policy), {"lone": [], "pre": [], "other": [], "exch": [], "wall": [],
                                              "time": [0.0], "wait": [0.0], "even": [0.0]})
        for t, (k0, k1, crit) in enumerate(zip(r0["kinds"], r1["kinds"], r0["critical"])):
            cpu = r0["cpus"][t]
            cell["time"][0] += crit
            cell["wait"][0] += crit - min(cpu)
            cell["even"][0] += sum(cpu) / len(cpu)
            if (k0 == 1) != (k1 == 1):  # a lone prefill tick
                pre, other = (0, r1) if k0 == 1 else (1, r0)
                cell["lone"].append(crit)
                cell["pre"].append(cpu[pre])
                cell["other"].append(cpu[1 - pre])
                cell["exch"].append(other["exchange"][t])
                cell["wall"].append(other["step_wall"][t])
    print("\nWhere the ranks wait (all rounds): lone prefill ticks (the prefilling rank's CPU, the other's, the "
          "other's wait = tick - its CPU), the other rank's wall in the EP all-to-alls / its step's wall; every "
          "tick's faster-rank wait as a share of the run; the balanced bound (time / evenly split work)\n")
    print("| burstiness | mode | lone ticks | tick ms, mean | prefilling rank CPU ms | other CPU ms | other waits, "
          "% of tick | other's all-to-all wall / step wall | all ticks' wait, % of time | balanced bound |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (b, policy), c in sorted(table.items()):
        n = max(len(c["lone"]), 1)
        lone, other = sum(c["lone"]), sum(c["other"])
        print(f"| {b:g} | {policy} | {len(c['lone'])} | {1e3 * lone / n:.0f} | {1e3 * sum(c['pre']) / n:.0f} | "
              f"{1e3 * other / n:.0f} | {100 * (lone - other) / max(lone, 1e-9):.0f} % | "
              f"{100 * sum(c['exch']) / max(sum(c['wall']), 1e-9):.0f} % | "
              f"{100 * c['wait'][0] / c['time'][0]:.0f} % | {c['time'][0] / c['even'][0]:.3f}x |")


def itl_tail(by_key: dict) -> None:
    """Why ITL p99 is what it is: every gap at or over its run's ITL p99 (both ranks' streams),
    all rounds, by the ticks it spanned and the longest of them (P prefill, D decode, - none)."""
    table: dict[tuple[float, str], list[tuple[float, int, int, str]]] = {}
    for (_, b, policy), pair in by_key.items():
        kinds = [r["kinds"] for r in pair]
        critical = pair[0]["critical"]
        p99 = pct(pair[0]["itl"] + pair[1]["itl"], 99)
        for rank, r in enumerate(pair):
            own, other = kinds[rank], kinds[1 - rank]
            for gap, (a, z) in zip(r["itl"], r["itl_ticks"]):
                if gap < p99:
                    continue
                span = range(a + 1, z + 1)
                top = max(span, key=lambda t: critical[t])
                why = ("both prefill" if own[top] == other[top] == 1 else "own prefill alone" if own[top] == 1
                       else "other's prefill alone" if other[top] == 1 else "no prefill")
                table.setdefault((b, policy), []).append((gap, len(span), sum(own[t] == 1 for t in span), why))
    whys = ["both prefill", "own prefill alone", "other's prefill alone", "no prefill"]
    print("\nITL tail (all rounds): the gaps at or over their run's ITL p99, the ticks each spanned, and what "
          "the longest of those ticks ran\n")
    print("| burstiness | mode | gaps | ms, median | ticks a gap, median | own prefill ticks a gap, mean | longest tick: "
          + " / ".join(whys) + " |\n|---|---|---|---|---|---|---|")
    for (b, policy), gaps in sorted(table.items()):
        n = len(gaps)
        print(f"| {b:g} | {policy} | {n} | {1e3 * statistics.median(g[0] for g in gaps):.0f} | "
              f"{statistics.median(g[1] for g in gaps):g} | {sum(g[2] for g in gaps) / n:.2f} | "
              + " / ".join(str(sum(g[3] == w for g in gaps)) for w in whys) + " |")


if __name__ == "__main__":
    main()
