"""What a PD router costs, atomd's next to vllm-router's, on the same fake engines in one run.

Zero-delay fake engines (benchmarks/fake_engine.py, one process) stand in for P and D, so
every millisecond measured is HTTP and relay work. With one load generator, every round
measures, for streamed (SSE) and JSON completions (max_tokens=8: 8 token events + [DONE]):

  direct D     the client calls the fake decode worker itself (one leg, the floor)
  direct P+D   the client runs both legs itself, back to back (what any PD relay must do)
  atomd        `python -m router` (its own process), which runs both legs
  vllm-router  PyPI `vllm-router` (Rust) in PD mode (--vllm-pd-disaggregation), its own venv

- c=1: requests round-robin over the paths (one each per turn), so a load change on the
  shared machine hits every path alike: p50/p99 latency, first-event delay (streams), and
  the latency each router adds over direct P+D;
- c=64: each path alone for `--seconds`: req/s;
- router CPU: utime+stime of the router process (and its children) over a phase, divided
  by the requests it served: CPU ms per request, at c=1 and c=64.

Rounds (>= 3) alternate the paths' order; the report gives medians over rounds and the
load average (/proc/loadavg) before and after each round. Results: `--out` (markdown) and
`--json`. vllm-router is looked for in `--vllm-router` (default
.cache/vllm-router-venv/bin/vllm-router, a venv git ignores: `python3 -m venv
.cache/vllm-router-venv && .cache/vllm-router-venv/bin/pip install vllm-router`).

`--baseline-dir DIR` adds the router of another checkout (e.g. the last commit's:
`git archive HEAD router kv_transfer launch | tar -x -C DIR`) as `atomd (baseline)`.
`--profile DIR` runs py-spy on the atomd router during a c=64 stream phase (raw folded stacks).
Run: `.venv/bin/python -m benchmarks.router_overhead --rounds 3`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

import aiohttp
import uvloop

from benchmarks.fake_engine import FakeEngine
from launch.process import RouterServer, ServerProcess, free_port, http
from benchmarks.machine import loadavg

ROOT = pathlib.Path(__file__).resolve().parents[1]
VLLM_ROUTER = ROOT / ".cache" / "vllm-router-venv" / "bin" / "vllm-router"
BODY = {"model": "fake-model", "prompt": "the quick brown fox jumps", "max_tokens": 8}
TOKENS = tuple(f" t{i}" for i in range(8))
FAKES_PID: int | None = None


async def serve_fakes(p_port: int, d_port: int) -> None:
    p, d = FakeEngine("prefill", TOKENS, record=False), FakeEngine("decode", TOKENS, record=False)
    await p.start(p_port)
    await d.start(d_port)
    print("fakes ready", flush=True)
    await asyncio.Event().wait()


class Target:
    """One way of getting a completion: legs (url, body maker) run in order; `pid`: the router's."""

    def __init__(self, name: str, legs, pid: int | None = None):
        self.name, self.legs, self.pid = name, legs, pid

    async def once(self, session: aiohttp.ClientSession, stream: bool) -> tuple[float, float | None]:
        """(latency, first-event delay) of one request."""
        started = time.perf_counter()
        first = None
        kv = None
        for i, (url, make_body) in enumerate(self.legs):
            last = i == len(self.legs) - 1
            async with session.post(url, json=make_body(stream, kv)) as r:
                if last and stream:
                    chunk = await r.content.readany()
                    first = time.perf_counter() - started
                    data = chunk + await r.read()
                else:
                    data = await r.read()
                assert r.status == 200 and data, (url, r.status, data[:200])
                if not last:
                    kv = json.loads(data).get("kv_transfer_params")
        if stream:
            assert data.rstrip().endswith(b"[DONE]"), data[-200:]
        return time.perf_counter() - started, first


def client_body(stream, kv):
    return dict(BODY, stream=stream)


def prefill_leg(stream, kv):
    return dict(BODY, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True,
                                                                       "transfer_id": os.urandom(16).hex()})


def decode_leg(stream, kv):
    return dict(BODY, stream=stream, kv_transfer_params=kv or {"do_remote_prefill": True, "transfer_id": "x"})


def cpu_seconds(pid: int | None) -> float:
    """CPU time of a process, all its threads and its children: the schedulers' run time
    (/proc/PID/task/TID/schedstat, nanoseconds; utime+stime ticks are too coarse at c=1)."""
    if pid is None:
        return 0.0
    total = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            for task in pathlib.Path(f"/proc/{p}/task").iterdir():
                total += int((task / "schedstat").read_text().split()[0])
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total / 1e9


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] * 1e3


async def phase_c1(targets: list[Target], stream: bool, n: int) -> dict:
    sessions = [aiohttp.ClientSession() for _ in targets]
    try:
        for t, s in zip(targets, sessions):
            for _ in range(20):  # warm the pools
                await t.once(s, stream)
        lat = {t.name: [] for t in targets}
        first = {t.name: [] for t in targets}
        cpu0 = {t.name: cpu_seconds(t.pid) for t in targets}
        for _ in range(n):
            for t, s in zip(targets, sessions):
                latency, f = await t.once(s, stream)
                lat[t.name].append(latency)
                if f is not None:
                    first[t.name].append(f)
        out = {}
        for t in targets:
            out[t.name] = {"p50_ms": pct(lat[t.name], 50), "p99_ms": pct(lat[t.name], 99),
                           "first_p50_ms": pct(first[t.name], 50) if first[t.name] else None,
                           "req_s": n / sum(lat[t.name]),
                           "cpu_ms": (cpu_seconds(t.pid) - cpu0[t.name]) / n * 1e3 if t.pid else None}
        return out
    finally:
        for s in sessions:
            await s.close()


async def phase_c64(target: Target, stream: bool, concurrency: int, seconds: float) -> dict:
    done = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        for _ in range(concurrency):
            await target.once(s, stream)
        deadline = time.perf_counter() + seconds

        async def client():
            nonlocal done
            while time.perf_counter() < deadline:
                await target.once(s, stream)
                done += 1

        cpu0, fakes0, me0 = cpu_seconds(target.pid), cpu_seconds(FAKES_PID), cpu_seconds(os.getpid())
        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        return {"req_s": done / elapsed, "requests": done,
                "cpu_ms": (cpu_seconds(target.pid) - cpu0) / done * 1e3 if target.pid else None,
                "fakes_cpu_ms": (cpu_seconds(FAKES_PID) - fakes0) / done * 1e3,
                "client_cpu_ms": (cpu_seconds(os.getpid()) - me0) / done * 1e3}


def start_vllm_router(binary: pathlib.Path, p_url: str, d_url: str) -> ServerProcess:
    port, metrics_port = free_port(), free_port()
    proc = ServerProcess([str(binary), "--vllm-pd-disaggregation", "--prefill", p_url, "--decode", d_url,
                          "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(metrics_port),
                          "--policy", "round_robin", "--log-level", "warning"],
                         f"http://127.0.0.1:{port}", "vllm-router", log=os.devnull, cwd=ROOT)
    deadline = time.monotonic() + 60
    while True:  # ready once it routes a completion (it discovers its workers first)
        try:
            status, _ = http("POST", proc.url + "/v1/completions", BODY, timeout=5)
            if status == 200:
                return proc
        except OSError:
            pass
        if time.monotonic() > deadline or not proc.alive():
            proc.stop()
            raise RuntimeError("vllm-router did not start")
        time.sleep(0.2)


async def bench(args) -> dict:
    p_port, d_port = free_port(), free_port()
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    fakes = ServerProcess([sys.executable, "-m", "benchmarks.router_overhead", "--serve-fakes", str(p_port),
                           str(d_port)], d_url, "fake engines", cwd=ROOT)
    router = RouterServer([p_url], [d_url], log=os.devnull, cwd=ROOT)
    procs = [router, fakes]
    result = {"rounds": [], "machine": {"nproc": os.cpu_count(), "python": platform.python_version(),
                                        "aiohttp": aiohttp.__version__, "uvloop": uvloop.__version__}}
    global FAKES_PID
    FAKES_PID = fakes.pid
    try:
        fakes.wait_ready(30, path="/health")
        router.wait_ready(30)
        p, d, r = (u + "/v1/completions" for u in (p_url, d_url, router.url))
        targets = [Target("direct D", [(d, decode_leg)]),
                   Target("direct P+D", [(p, prefill_leg), (d, decode_leg)]),
                   Target("atomd", [(r, client_body)], router.pid)]
        if args.baseline_dir:
            base = RouterServer([p_url], [d_url], log=os.devnull, cwd=args.baseline_dir,
                                env=dict(os.environ, PYTHONPATH=str(pathlib.Path(args.baseline_dir).resolve())))
            procs.append(base)
            base.wait_ready(30)
            targets.append(Target("atomd (baseline)", [(base.url + "/v1/completions", client_body)], base.pid))
        vllm = None
        if not args.no_vllm_router:
            if not pathlib.Path(args.vllm_router).exists():
                raise SystemExit(f"vllm-router not found at {args.vllm_router} (see --help; --no-vllm-router skips it)")
            vllm = start_vllm_router(pathlib.Path(args.vllm_router), p_url, d_url)
            procs.append(vllm)
            targets.append(Target("vllm-router", [(vllm.url + "/v1/completions", client_body)], vllm.pid))
            result["machine"]["vllm_router"] = subprocess.run(
                [str(pathlib.Path(args.vllm_router).parent / "pip"), "show", "vllm-router"], capture_output=True,
                text=True).stdout.split("Version: ")[-1].split()[0]
        for rnd in range(args.rounds):
            order = targets[rnd % len(targets):] + targets[:rnd % len(targets)]
            rec = {"loadavg_before": loadavg(), "c1": {}, "c64": {}}
            for stream in (True, False):
                mode = "stream" if stream else "json"
                rec["c1"][mode] = await phase_c1(order, stream, args.n)
                rec["c64"][mode] = {}
                for t in order:
                    profile = None
                    if args.profile and t.name == "atomd" and stream and rnd == 0:
                        pathlib.Path(args.profile).mkdir(parents=True, exist_ok=True)
                        profile = subprocess.Popen([str(ROOT / ".venv" / "bin" / "py-spy"), "record", "-p",
                                                    str(t.pid), "-d", str(int(args.seconds) + 1), "-r", "200", "-f",
                                                    "raw", "-o", str(pathlib.Path(args.profile) / "atomd-router.txt")],
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    rec["c64"][mode][t.name] = await phase_c64(t, stream, args.concurrency, args.seconds)
                    if profile is not None:
                        profile.wait(60)
            rec["loadavg_after"] = loadavg()
            result["rounds"].append(rec)
            print(f"round {rnd + 1}/{args.rounds} done (load {rec['loadavg_before']} -> {rec['loadavg_after']})",
                  flush=True)
        result["names"] = [t.name for t in targets]
        return result
    finally:
        for proc in procs:
            proc.stop(10)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, digits=2):
    return "" if x is None else f"{x:.{digits}f}"


def report(result: dict, args) -> str:
    rounds, names = result["rounds"], result["names"]
    lines = [f"| path | mode | p50 c=1 (ms) | p99 c=1 (ms) | added p50 / p99 over direct P+D (ms) "
             f"| first event p50 (ms) | req/s c=1 | CPU ms/req c=1 | req/s c={args.concurrency} "
             f"| CPU ms/req c={args.concurrency} |", "|---|---|---|---|---|---|---|---|---|---|"]
    summary = {}
    for mode in ("stream", "json"):
        def m(phase, name, key):
            return median([r[phase][mode][name][key] for r in rounds])
        base50, base99 = m("c1", "direct P+D", "p50_ms"), m("c1", "direct P+D", "p99_ms")
        for name in names:
            p50, p99 = m("c1", name, "p50_ms"), m("c1", name, "p99_ms")
            added = f"{p50 - base50:+.2f} / {p99 - base99:+.2f}" if not name.startswith("direct") else ""
            row = (name, mode, fmt(p50), fmt(p99), added, fmt(m("c1", name, "first_p50_ms")),
                   fmt(m("c1", name, "req_s"), 0), fmt(m("c1", name, "cpu_ms"), 3),
                   fmt(m("c64", name, "req_s"), 0), fmt(m("c64", name, "cpu_ms"), 3))
            lines.append("| " + " | ".join(row) + " |")
            summary[(name, mode)] = {k: m(ph, name, k2) for k, (ph, k2) in
                                     {"cpu1": ("c1", "cpu_ms"), "cpu64": ("c64", "cpu_ms"),
                                      "rps64": ("c64", "req_s"), "p50": ("c1", "p50_ms")}.items()}
    out = ["\n".join(lines), ""]
    if "vllm-router" in names:
        for mode in ("stream", "json"):
            a, v = summary[("atomd", mode)], summary[("vllm-router", mode)]
            out.append(f"- {mode}: atomd CPU efficiency {v['cpu64'] / a['cpu64']:.2f}x vllm-router's at "
                       f"c={args.concurrency} ({a['cpu64']:.3f} vs {v['cpu64']:.3f} ms/req; c=1: "
                       f"{v['cpu1'] / a['cpu1']:.2f}x), req/s {a['rps64'] / v['rps64']:.2f}x at c={args.concurrency}, "
                       f"p50 at c=1 {a['p50'] - v['p50']:+.2f} ms")
            if ("atomd (baseline)", mode) in summary:
                b = summary[("atomd (baseline)", mode)]
                out.append(f"  baseline router: {b['cpu64']:.3f} ms/req at c={args.concurrency} "
                           f"({v['cpu64'] / b['cpu64']:.2f}x vllm-router's efficiency), {b['rps64']:.0f} req/s "
                           f"({b['rps64'] / v['rps64']:.2f}x)")
    for mode in ("stream", "json"):
        parts = []
        for name in names:
            f = median([r["c64"][mode][name]["fakes_cpu_ms"] for r in rounds])
            c = median([r["c64"][mode][name]["client_cpu_ms"] for r in rounds])
            parts.append(f"{name} {f:.3f} + {c:.3f}")
        out.append(f"- {mode}, c={args.concurrency}: fake engines + load generator CPU ms/req: " + ", ".join(parts))
    out.append("")
    out.append("Load average (1/5/15 min) before -> after each round: " +
               "; ".join(f"{r['loadavg_before']} -> {r['loadavg_after']}" for r in rounds))
    mach = result["machine"]
    out.append(f"Machine: nproc={mach['nproc']}, python {mach['python']}, aiohttp {mach['aiohttp']} (client, fakes), "
               f"uvloop {mach['uvloop']}, vllm-router {mach.get('vllm_router', '-')}; {len(rounds)} rounds, medians; "
               f"c=1: {args.n} requests per path per round; c={args.concurrency}: {args.seconds} s per path.")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200, help="requests per path per c=1 measurement")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=4.0, help="length of each c=64 measurement")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vllm-router", default=str(VLLM_ROUTER))
    ap.add_argument("--no-vllm-router", action="store_true")
    ap.add_argument("--baseline-dir", default=None, help="also run the router of this checkout")
    ap.add_argument("--profile", default=None, metavar="DIR", help="py-spy the atomd router (c=64 stream, round 1)")
    ap.add_argument("--json", default=None, help="write the raw results here")
    ap.add_argument("--out", default=None, help="write the markdown table here")
    ap.add_argument("--serve-fakes", nargs=2, type=int, metavar=("P_PORT", "D_PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_fakes:
        uvloop.run(serve_fakes(*args.serve_fakes))
        return
    result = uvloop.run(bench(args))
    text = report(result, args)
    print("\n" + text)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
