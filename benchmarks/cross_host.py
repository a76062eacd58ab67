"""The cross-host columns of benchmarks/kv_transfer.py and benchmarks/pd_ttft.py (`--cross-host`).

Test hosts are network namespaces on one bridge (launch/netns.py), so the bytes cross real
(virtual) interfaces and the kernel's TCP stack between two network stacks, instead of
loopback inside one. Two links are measured in the same run, interleaved round by round:

  unshaped   veth pairs on a bridge: the kernel's own speed.
  shaped     every host's egress delayed 2 ms +- 1 ms and paced at 1 Gbit/s (netem's model:
             the kernel's netem qdisc, or launch/netns.py's link emulator where the kernel
             has no netem; the report says which).

kv_transfer (`python -m benchmarks.kv_transfer --cross-host`): P's KVSender in host a, D's
KVReceiver in host b, each its own process; against the link's own ceiling measured the same
way in the same run: a raw ZMQ stream a -> b (one request, the same frames zero-copy,
dropped on arrival; "+ copy" also copies them into D's buffer). Target: >= 0.7x the raw
stream from 64 blocks up.

pd_ttft (`python -m benchmarks.pd_ttft --cross-host`): P in host a, D in host b, the router in
c, a colocated engine in d, the client in the root namespace (on its own unshaped veth):
TTFT through PD against colocated TTFT over the same link, D's transfer time (READ to END)
for that request, and ITL (the gaps between a streamed request's SSE events) through PD and
colocated; unshaped against shaped.

Both need root and iproute2; every namespace and process is removed at the end.
"""
from __future__ import annotations

import argparse
import http.client as httplib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from benchmarks.machine import loadavg

# the engines of benchmarks/pd_ttft.py, on one host and across test hosts
ENGINE_ARGS = ["--max-model-len", "2048", "--num-threads", "1", "--max-num-seqs", "16"]

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SHAPED = dict(delay_ms=2.0, jitter_ms=1.0, rate_bps=1e9)


def _links(num_hosts: int, root_link: bool):
    """{"unshaped": cluster, "shaped": cluster}, both started."""
    from launch.netns import NetnsCluster
    from launch.shaping import Shaping

    links = {}
    try:
        links["unshaped"] = NetnsCluster(num_hosts, root_link=root_link).start()
        links["shaped"] = NetnsCluster(num_hosts, root_link=root_link, shaping=Shaping(**SHAPED)).start()
    except BaseException:
        for net in links.values():
            net.teardown()
        raise
    return links


def _shaped_label(net) -> str:
    s = net.shaping["a"]
    how = "kernel netem" if net.shaper == "netem" else "launch/netns.py's link emulator (this kernel has no netem)"
    return f"{s.describe()} per host egress, via {how}, MTU {net.mtu}"


def _med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# =============================================================================== kv_transfer

def _compat(args):
    from kv_transfer.params import compat_fingerprint

    return compat_fingerprint("bench", "float32", args.block_size, args.num_layers, args.num_kv_heads, args.head_dim,
                              "bench")


def _block_bytes(args) -> int:
    return args.num_layers * 2 * args.block_size * args.num_kv_heads * args.head_dim * args.dtype_bytes


def _buffer(args, num_blocks: int):
    import numpy as np

    bb = _block_bytes(args)
    data = np.random.default_rng(0).bytes(num_blocks * bb)
    return np.frombuffer(bytearray(data), dtype=np.uint8).reshape(num_blocks, bb)


def kv_sender(args) -> int:
    """Host a: KVSender, a bare raw-stream ROUTER and a control REP socket, on a's address."""
    import zmq

    from benchmarks.zmq_ceiling import raw_zmq_server
    from kv_transfer.side_channel import DEFAULT_MAX_MESSAGE_BYTES
    from kv_transfer.zmq_sender import KVSender

    src = _buffer(args, args.num_blocks)
    sender = KVSender(src, _compat(args), host=args.host)
    ctx = zmq.Context()
    raw, ctl = ctx.socket(zmq.ROUTER), ctx.socket(zmq.REP)
    raw_port = raw.bind_to_random_port(f"tcp://{args.host}")
    ctl_port = ctl.bind_to_random_port(f"tcp://{args.host}")
    stop = threading.Event()
    server = threading.Thread(target=raw_zmq_server,
                              args=(raw, src, max(1, DEFAULT_MAX_MESSAGE_BYTES // src.shape[1]), stop), daemon=True)
    server.start()
    print(json.dumps({"kv_port": sender.address[1], "raw_port": raw_port, "ctl_port": ctl_port}), flush=True)
    n = 0
    try:
        while True:
            sender.take_released()
            if not ctl.poll(5):
                continue
            msg = ctl.recv_json()
            if msg["op"] == "stop":
                ctl.send_json({})
                return 0
            n += 1
            tid, token = f"bench{n:08d}{os.getpid()}", os.urandom(16).hex()
            sender.grant(tid, list(range(msg["n"])), token, lease_s=120.0)
            ctl.send_json({"tid": tid, "token": token})
    finally:
        stop.set()
        server.join()
        ctx.destroy(linger=0)
        sender.close()


def kv_receiver(args) -> int:
    """Host b: time `repeats` pulls of each size, interleaved with the raw stream; JSON out."""
    import numpy as np
    import zmq

    from benchmarks.zmq_ceiling import time_raw
    from kv_transfer.zmq_receiver import KVReceiver

    ports = json.loads(args.ports)
    bb = _block_bytes(args)
    dst = np.zeros((args.num_blocks, bb), dtype=np.uint8)
    receiver = KVReceiver(dst, _compat(args))
    ctx = zmq.Context()
    dealer, ctl = ctx.socket(zmq.DEALER), ctx.socket(zmq.REQ)
    dealer.setsockopt(zmq.RCVHWM, 8)  # KVReceiver's bound too
    dealer.connect(f"tcp://{args.peer}:{ports['raw_port']}")
    ctl.connect(f"tcp://{args.peer}:{ports['ctl_port']}")

    def ours(n: int) -> float:
        ctl.send_json({"op": "grant", "n": n})
        g = ctl.recv_json()
        ids = list(range(n))
        t0 = time.perf_counter()
        receiver.start_pull(g["tid"], args.peer, ports["kv_port"], g["token"], ids, ids, timeout_s=60.0)
        while True:
            receiver.wait(60.0)
            done, failed = receiver.take_finished()
            if done or failed:
                break
        elapsed = time.perf_counter() - t0
        if failed:
            raise RuntimeError(f"pull failed: {failed}")
        return elapsed

    out = {}
    try:
        for n in [int(s) for s in args.sizes.split(",")]:
            ours(n), time_raw(dealer, n, bb)  # warm: connections, pages
            runs = {"ours": [], "raw": [], "raw_copy": []}
            for _ in range(args.repeats):
                runs["ours"].append(ours(n))
                runs["raw"].append(time_raw(dealer, n, bb))
                runs["raw_copy"].append(time_raw(dealer, n, bb, into=dst))
            out[n] = runs
        src = _buffer(args, max(out))
        dst[:] = 0
        ours(max(out))
        if not np.array_equal(dst[:max(out)], src):
            raise RuntimeError("bytes differ after a cross-host transfer")
        ctl.send_json({"op": "stop"})
        ctl.recv_json()
    finally:
        ctx.destroy(linger=0)
        receiver.close()
    print(json.dumps(out), flush=True)
    return 0


def _kv_flags(args, sizes: str) -> list[str]:
    return ["--num-layers", str(args.num_layers), "--num-kv-heads", str(args.num_kv_heads), "--head-dim",
            str(args.head_dim), "--block-size", str(args.block_size), "--dtype-bytes", str(args.dtype_bytes),
            "--num-blocks", str(max(int(s) for s in sizes.split(",")))]


def run_kv(args) -> None:
    """The cross-host table of benchmarks/kv_transfer.py."""
    sizes, repeats, rounds = args.cross_host_sizes, max(3, args.cross_host_repeats), max(3, args.rounds)
    links = _links(2, root_link=False)
    senders = {}
    per_round: dict[str, dict[int, dict[str, list[float]]]] = {k: {} for k in links}
    loads = [loadavg()]
    try:
        for r in range(rounds):
            for name, net in links.items():  # interleaved: background load hits both alike
                a, b = net.hosts
                # a fresh sender per round (the receiver's stop ends it)
                senders[name] = net.popen(a, [sys.executable, "-m", "benchmarks.cross_host", "kv-sender", "--host",
                                              a.ip, *_kv_flags(args, sizes)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
                ports = senders[name].stdout.readline().strip()
                if not ports:
                    raise RuntimeError(f"the sender in {name} did not start")
                result = net.run(b, [sys.executable, "-m", "benchmarks.cross_host", "kv-receiver", "--peer", a.ip,
                                     "--ports", ports, "--sizes", sizes, "--repeats", str(repeats),
                                     *_kv_flags(args, sizes)], cwd=ROOT, timeout=1800)
                if result.returncode != 0:
                    raise RuntimeError(f"receiver in {name} failed: {result.stderr[-3000:]}")
                senders[name].wait(30)
                for n, runs in json.loads(result.stdout.strip().splitlines()[-1]).items():
                    for kind, times in runs.items():
                        per_round[name].setdefault(int(n), {}).setdefault(kind, []).append(_med(times))
                print(f"round {r + 1}/{rounds} {name}: done (load {loadavg()})", flush=True)
            loads.append(loadavg())
        shaped_label = _shaped_label(links["shaped"])
    finally:
        for net in links.values():
            net.teardown()
    _write_kv_report(args, sizes, repeats, rounds, per_round, loads, shaped_label)


def _write(out: Path, lines: list[str]) -> None:
    """The report to `out` (a Markdown results file) and to stdout."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {out}")


def _write_kv_report(args, sizes, repeats, rounds, per_round, loads, shaped_label) -> None:
    from benchmarks.zmq_ceiling import machine_notes

    bb = _block_bytes(args)
    lines = [
        "# KV transfer across hosts (ZMQ side channel between two network namespaces)",
        "",
        f"P's KVSender in test host a, D's KVReceiver in test host b (each its own process, each its own network "
        f"stack), over a bridge; block_bytes = {bb} B ({args.num_layers} layers x 2 x {args.block_size} tokens x "
        f"{args.num_kv_heads} kv heads x {args.head_dim} x {args.dtype_bytes} B). Ceiling: a raw ZMQ stream a -> b "
        "on the same link in the same run (one request, the same frames zero-copy, dropped on arrival; + copy: "
        f"also copied into D's buffer). {rounds} rounds, each the median of {repeats} runs per size, the two links "
        "and all columns interleaved; the table gives the median over rounds (min-max of the rounds for the ratio).",
        "",
        "- unshaped: veth pairs on a bridge, MTU 9000.",
        f"- shaped: {shaped_label}.",
        "",
        "| link | blocks | MiB | zmq GB/s | raw stream GB/s | raw + copy GB/s | zmq / raw stream (rounds) | "
        "zmq / (raw + copy) | zmq ms | raw ms |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for name in ("unshaped", "shaped"):
        for n in [int(s) for s in sizes.split(",")]:
            runs = per_round[name][n]
            t_ours, t_raw, t_copy = (_med(runs[k]) for k in ("ours", "raw", "raw_copy"))
            ratios = [r / o for o, r in zip(runs["ours"], runs["raw"])]
            nbytes = n * bb
            lines.append(
                f"| {name} | {n} | {nbytes / (1 << 20):.2f} | {nbytes / t_ours / 1e9:.3f} | {nbytes / t_raw / 1e9:.3f} | "
                f"{nbytes / t_copy / 1e9:.3f} | {_med(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
                f"{t_copy / t_ours:.2f} | {t_ours * 1e3:.2f} | {t_raw * 1e3:.2f} |")
    lines += [
        "",
        f"Command: `.venv/bin/python -m benchmarks.kv_transfer --cross-host --cross-host-sizes {sizes} "
        f"--cross-host-repeats {repeats} --rounds {rounds}` (root).",
        "",
        f"Machine: {machine_notes()}. Load average (1, 5, 15 min) at the start and after each round: "
        f"{' | '.join(loads)}. Shared with other jobs: read the ratios, not the absolutes.",
        "",
    ]
    _write(Path(args.cross_host_out), lines)


# =============================================================================== pd_ttft

def stream_times(url: str, body: dict) -> tuple[float, list[float]]:
    """(seconds to the first SSE event, arrival times of every event after t0) of a streamed completion."""
    host, port = url.removeprefix("http://").split(":")
    conn = httplib.HTTPConnection(host, int(port), timeout=120)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(dict(body, stream=True)), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{url}: {resp.status} {resp.read()[:300]!r}")
    times = []
    while True:
        line = resp.readline()
        if not line:
            break
        if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
            times.append(time.perf_counter() - t0)
    conn.close()
    return times[0], times


def _pd_on(net, secret: Path, model, engine_args: list[str]):
    from launch.process import EngineServer, RouterServer

    a, b, c, d = net.hosts
    trust = ["--kv-params-secret-file", str(secret)]

    def engine(host, *flags):
        return EngineServer(model, *engine_args, *flags, host=host.ip, port=8100, log=os.devnull, cwd=ROOT,
                            wrapper=net.exec_prefix(host), name=f"engine on {host}")
    net.p = engine(a, "--kv-role", "producer", "--kv-side-channel-host", a.ip, *trust)
    net.d = engine(b, "--kv-role", "consumer", *trust)
    net.colocated = engine(d)
    for e in (net.p, net.d, net.colocated):
        e.wait_ready()
    net.router = RouterServer([net.p.url], [net.d.url], "--health-interval-s", "0.5", *trust, host=c.ip, port=8100,
                              log=os.devnull, cwd=ROOT, wrapper=net.exec_prefix(c), name=f"router on {c}")
    net.router.wait_ready()


def _transfer_seconds(d_url: str) -> float:
    from benchmarks.pd_vs_colocated import scrape, total

    return total(scrape(d_url), "atomd:kv_transfer_seconds_sum")


def _measure(net, n: int, reps: int, rng, itl_tokens: int) -> dict[str, list[float]]:
    rows = {k: [] for k in ("colocated", "router", "transfer", "itl colocated", "itl router")}
    for _ in range(reps):
        body = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}
        rows["colocated"].append(stream_times(net.colocated.url, dict(body, prompt=rng.integers(10, 4096, n).tolist()))[0])
        before = _transfer_seconds(net.d.url)
        rows["router"].append(stream_times(net.router.url, dict(body, prompt=rng.integers(10, 4096, n).tolist()))[0])
        rows["transfer"].append(_transfer_seconds(net.d.url) - before)
        long = dict(body, max_tokens=itl_tokens)
        for key, url in (("itl colocated", net.colocated.url), ("itl router", net.router.url)):
            _, times = stream_times(url, dict(long, prompt=rng.integers(10, 4096, n).tolist()))
            gaps = [t1 - t0 for t0, t1 in zip(times[1:], times[2:])]  # after the first event (T0, T1 on PD)
            rows[key].append(_med(gaps))
    return rows


def run_ttft(args) -> None:
    """The cross-host table of benchmarks/pd_ttft.py."""
    import numpy as np

    from atomd.model.default import default_model_dir

    rounds, reps = max(3, args.rounds), args.reps
    model = default_model_dir()
    links = _links(4, root_link=True)
    secret_dir = tempfile.mkdtemp(prefix="atomd-xhost-")
    secret = Path(secret_dir) / "kv-params-secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    per_round: dict[str, dict[int, dict[str, list[float]]]] = {k: {} for k in links}
    loads = [loadavg()]
    try:
        for net in links.values():
            _pd_on(net, secret, model, ENGINE_ARGS)
        rng = np.random.default_rng(0)
        for net in links.values():
            _measure(net, 16, 2, rng, 8)  # warm-up: first forwards, connections
        for r in range(rounds):
            for n in args.lengths:
                for name, net in links.items():
                    rows = _measure(net, n, reps, rng, args.itl_tokens)
                    for k, v in rows.items():
                        per_round[name].setdefault(n, {}).setdefault(k, []).append(_med(v))
            loads.append(loadavg())
            print(f"round {r + 1}/{rounds} done (load {loads[-1]})", flush=True)
        shaped_label = _shaped_label(links["shaped"])
    finally:
        for net in links.values():
            for proc in ("router", "p", "d", "colocated"):
                if hasattr(net, proc):
                    getattr(net, proc).stop()
            net.teardown()
        secret.unlink(missing_ok=True)
        os.rmdir(secret_dir)
    _write_ttft_report(args, rounds, reps, per_round, loads, shaped_label)


def _write_ttft_report(args, rounds, reps, per_round, loads, shaped_label) -> None:
    lines = [
        "# PD across hosts: TTFT, KV transfer and ITL (benchmarks/pd_ttft.py --cross-host)",
        "",
        "Default model (float32), every server `--num-threads 1`, each in its own test host (network namespace) "
        "on one bridge: P in a, D in b, the router in c, a colocated engine in d; the client in the root "
        "namespace on its own unshaped veth. Fresh random token prompts (no prefix-cache hit). TTFT: time to the "
        f"first SSE event of a `max_tokens=2` request; ITL: median gap between the SSE events of a "
        f"`max_tokens={args.itl_tokens}` request, after its first event; transfer: D's `atomd:kv_transfer_seconds` "
        f"(READ to END) during the PD request. {rounds} rounds x {reps} requests per cell, the two links "
        "interleaved; each cell is the median over rounds of the per-round medians.",
        "",
        "- unshaped: veth pairs on a bridge, MTU 9000.",
        f"- shaped: {shaped_label}. A PD request crosses shaped egress 6 times before its first token reaches the "
        "client (c -> a, a -> c, c -> b, b -> a, a -> b, b -> c) plus c's answer; a colocated one once (d's answer).",
        "",
        "| link | prompt tokens | colocated TTFT ms | PD TTFT ms | PD - colocated ms | PD / colocated | "
        "transfer ms | ITL colocated ms | ITL PD ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in ("unshaped", "shaped"):
        for n in args.lengths:
            m = {k: _med(v) * 1e3 for k, v in per_round[name][n].items()}
            lines.append(f"| {name} | {n} | {m['colocated']:.1f} | {m['router']:.1f} | "
                         f"{m['router'] - m['colocated']:.1f} | {m['router'] / m['colocated']:.2f}x | "
                         f"{m['transfer']:.2f} | {m['itl colocated']:.1f} | {m['itl router']:.1f} |")
    lines += [
        "",
        f"Command: `.venv/bin/python -m benchmarks.pd_ttft --cross-host --lengths {' '.join(map(str, args.lengths))} "
        f"--reps {reps} --rounds {rounds} --itl-tokens {args.itl_tokens}` (root).",
        "",
        f"Machine: nproc={os.cpu_count()}. Load average (1, 5, 15 min) at the start and after each round: "
        f"{' | '.join(loads)}. Shared with other jobs: read the differences and ratios within a round.",
        "",
    ]
    _write(Path(args.cross_host_out), lines)


# =============================================================================== entry points

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cross_host", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("kv-sender", "kv-receiver"):
        sp = sub.add_parser(name)
        for flag, default in (("--num-layers", 6), ("--num-kv-heads", 4), ("--head-dim", 32), ("--block-size", 16),
                              ("--dtype-bytes", 4), ("--num-blocks", 1024)):
            sp.add_argument(flag, type=int, default=default)
        if name == "kv-sender":
            sp.add_argument("--host", required=True)
        else:
            sp.add_argument("--peer", required=True)
            sp.add_argument("--ports", required=True)
            sp.add_argument("--sizes", required=True)
            sp.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    return kv_sender(args) if args.cmd == "kv-sender" else kv_receiver(args)


if __name__ == "__main__":
    sys.exit(main())
