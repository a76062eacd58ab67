"""`atomd-autoscale`: the online planner (launch/autoscale.py) from the command line, over
Kubernetes StatefulSets or a Ray cluster. What the Helm chart's autoscaler Deployment runs.

    atomd-autoscale --launcher kubernetes --router-url http://atomd-router.serving.svc:80 \\
        --namespace serving --prefill-statefulset atomd-prefill --decode-statefulset atomd-decode \\
        --ttft-slo-s 2 --itl-slo-s 0.1 --prefill-max 4 --decode-max 8
    atomd-autoscale --launcher ray --ray-config launch/configs/1p1d.yaml --ray-address auto

kubernetes: the StatefulSets' pods that run are adopted (registered with the router), the
pools brought to their minimum, then one window every --interval-s. Run the router without
--prefill-dns / --decode-dns: the planner owns its membership (launch/kubernetes.py says why).
ray: this process is the cluster's driver: it starts the router and the config's engines
(launch/ray_cluster.py), scales them, and stops them all when it exits.

Every window prints one line (each pool's engines, p90 against its SLO, what it did);
--dry-run reads and decides but starts, drains and registers nothing. SIGTERM / SIGINT end
it after the window in progress. A separate console script rather than an `atomd`
subcommand: `atomd` never imports `launch` (tests/test_architecture.py), as `atomd-router`
lives in `router`.
"""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time

from launch.autoscale import Autoscaler, PoolPolicy
from launch.process import http

PROG = "atomd-autoscale"
log = logging.getLogger("atomd.autoscale")


class UsageError(Exception):
    """A flag or a setting the user must change (exit 2)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--launcher", required=True, choices=("kubernetes", "ray"),
                   help="where engines come from: the chart's StatefulSets, or Ray actors this process drives")
    p.add_argument("--router-url", default=None,
                   help="the router (kubernetes: required; ray: the cluster's own router is used)")
    p.add_argument("--admin-api-key", default=None,
                   help="the key the router's /workers and the engines' /debug/stats take: their admin key, or "
                        "their API key when they have no admin key")
    k8s = p.add_argument_group("kubernetes")
    k8s.add_argument("--namespace", default=None, help="the StatefulSets' namespace (default: this pod's)")
    k8s.add_argument("--prefill-statefulset", default=None, help="the prefill engines' StatefulSet")
    k8s.add_argument("--decode-statefulset", default=None, help="the decode engines' StatefulSet")
    k8s.add_argument("--engine-port", type=int, default=8000, help="the engines' HTTP port in their pods")
    k8s.add_argument("--kubernetes-api", default=None,
                     help="the API server (default: in-cluster, with this pod's service account token and CA)")
    k8s.add_argument("--kubernetes-token-file", default=None, help="a bearer token file for --kubernetes-api")
    k8s.add_argument("--ready-timeout-s", type=float, default=900.0,
                     help="how long a new pod may take to turn Ready (model loading included)")
    ray = p.add_argument_group("ray")
    ray.add_argument("--ray-config", default=None, help="the cluster's YAML config (launch/ray_config.py)")
    ray.add_argument("--ray-address", default="auto", help="the Ray cluster to join")
    pol = p.add_argument_group("policy (per pool: prefill by TTFT p90, decode by ITL p90)")
    pol.add_argument("--prefill-min", type=int, default=1)
    pol.add_argument("--prefill-max", type=int, default=4)
    pol.add_argument("--ttft-slo-s", type=float, default=2.0, help="the prefill pool's SLO: TTFT p90, seconds")
    pol.add_argument("--decode-min", type=int, default=1)
    pol.add_argument("--decode-max", type=int, default=4)
    pol.add_argument("--itl-slo-s", type=float, default=0.1, help="the decode pool's SLO: ITL p90, seconds")
    pol.add_argument("--up", type=float, default=0.9, help="scale up above up x SLO ...")
    pol.add_argument("--down", type=float, default=0.3, help="... down below down x SLO (or no traffic)")
    pol.add_argument("--up-windows", type=int, default=2, help="windows in a row above before a scale-up")
    pol.add_argument("--down-windows", type=int, default=3, help="windows in a row below before a scale-down")
    pol.add_argument("--cooldown-s", type=float, default=30.0, help="a pool holds still this long after a change")
    pol.add_argument("--up-cooldown-s", type=float, default=None,
                     help="... but may scale up again this soon after one (default: --cooldown-s)")
    pol.add_argument("--learn-rates", action="store_true",
                     help="learn the request rate each pool size ran hot at: scale up ahead of it, never drain into it")
    pol.add_argument("--rate-windows", type=int, default=5,
                     help="with --learn-rates: the arrival rate is the mean over this many windows")
    p.add_argument("--interval-s", type=float, default=5.0, help="the window: one read and decision per interval")
    p.add_argument("--drain-timeout-s", type=float, default=120.0,
                   help="a draining engine is stopped after this long even if it still works")
    p.add_argument("--router-timeout-s", type=float, default=300.0,
                   help="how long to wait at start for the router to answer")
    p.add_argument("--dry-run", action="store_true", help="read and decide, change nothing (no start, drain, POST)")
    p.add_argument("--windows", type=int, default=0, help="stop after this many windows (0: until SIGTERM)")


def policies(args) -> tuple[PoolPolicy, PoolPolicy]:
    shared = dict(up=args.up, down=args.down, up_windows=args.up_windows, down_windows=args.down_windows,
                  cooldown_s=args.cooldown_s, up_cooldown_s=args.up_cooldown_s,
                  learn_rates=args.learn_rates)
    out = []
    for role, lo, hi, slo, flag in (("prefill", args.prefill_min, args.prefill_max, args.ttft_slo_s, "--ttft-slo-s"),
                                    ("decode", args.decode_min, args.decode_max, args.itl_slo_s, "--itl-slo-s")):
        if not slo > 0:
            raise UsageError(f"{flag} must be > 0, got {slo:g}")
        try:
            out.append(PoolPolicy(lo, hi, slo, **shared))
        except ValueError as e:
            raise UsageError(f"{role} pool (--{role}-min / --{role}-max, --up / --down): {e}") from None
    for flag, value in (("--up-windows", args.up_windows), ("--down-windows", args.down_windows),
                        ("--rate-windows", args.rate_windows), ("--interval-s", args.interval_s)):
        if not value > 0:
            raise UsageError(f"{flag} must be > 0, got {value}")
    return out[0], out[1]


def wait_for_router(url: str, headers: dict, timeout_s: float) -> None:
    """GET /workers until the router answers 200 (it may still be starting); a refused key at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status, body = http("GET", url + "/workers", headers=headers, timeout=5.0)
        except OSError as e:
            status, body = None, str(e).encode()
        if status == 200:
            return
        if status in (401, 403):
            raise UsageError(f"the router at {url} refused the admin key ({status}): pass its --admin-api-key")
        if time.monotonic() > deadline:
            why = f"answered {status}" if status else f"no answer ({body.decode(errors='replace')[:200]})"
            raise RuntimeError(f"the router at {url} is not up after {timeout_s:g} s: {why}")
        time.sleep(1.0)


def kubernetes_autoscaler(args, prefill: PoolPolicy, decode: PoolPolicy) -> Autoscaler:
    from launch.kubernetes import StatefulSetLauncher

    if not args.router_url:
        raise UsageError("--launcher kubernetes needs --router-url")
    missing = [f for f, v in (("--prefill-statefulset", args.prefill_statefulset),
                              ("--decode-statefulset", args.decode_statefulset)) if not v]
    if missing:
        raise UsageError(f"--launcher kubernetes needs {' and '.join(missing)}")
    token = None
    if args.kubernetes_token_file:
        with open(args.kubernetes_token_file) as f:
            token = f.read().strip()
    try:
        launcher = StatefulSetLauncher({"prefill": args.prefill_statefulset, "decode": args.decode_statefulset},
                                       port=args.engine_port, namespace=args.namespace, api_url=args.kubernetes_api,
                                       token=token, ready_timeout_s=args.ready_timeout_s)
    except ValueError as e:
        raise UsageError(str(e)) from None
    router = args.router_url.rstrip("/")
    scaler = Autoscaler(router, launcher, prefill, decode, window_s=args.interval_s, admin_key=args.admin_api_key,
                        drain_timeout_s=args.drain_timeout_s, dry_run=args.dry_run, rate_windows=args.rate_windows)
    wait_for_router(router, scaler.headers, args.router_timeout_s)
    for role in ("prefill", "decode"):
        scaler.adopt(role, launcher.adopt(role))
    return scaler


def ray_autoscaler(args, prefill: PoolPolicy, decode: PoolPolicy):
    """(the Autoscaler, a callable stopping the cluster)."""
    if args.router_url:
        raise UsageError("--launcher ray starts its own router; drop --router-url")
    if not args.ray_config:
        raise UsageError("--launcher ray needs --ray-config (the cluster's YAML, launch/ray_config.py)")
    from launch.ray_config import load_config

    try:
        config = load_config(args.ray_config, {}, {})
    except ValueError as e:
        raise UsageError(f"{args.ray_config}: {e}") from None
    import ray

    from launch.ray_cluster import RayCluster, RayLauncher

    if not ray.is_initialized():  # a caller (a test, a notebook) may have joined already
        ray.init(address=args.ray_address)
    cluster = RayCluster(config)
    try:
        infos = cluster.start()
        scaler = Autoscaler(cluster.router_url, RayLauncher(cluster), prefill, decode, window_s=args.interval_s,
                            drain_timeout_s=args.drain_timeout_s, dry_run=args.dry_run,
                            rate_windows=args.rate_windows)
        for role in ("prefill", "decode"):  # the actors registered themselves: the pools only
            scaler.pools[role].urls.extend(i["url"] for i in infos if i["role"] == role)
    except ray.exceptions.RayError as e:
        cluster.stop()
        raise RuntimeError(f"ray: {e}") from None
    except BaseException:
        cluster.stop()
        raise
    return scaler, cluster.stop


def run(args) -> int:
    progress = logging.StreamHandler()  # to stderr: one line a window
    progress.setFormatter(logging.Formatter(f"%(asctime)s {PROG}: %(message)s"))
    log.addHandler(progress)
    log.setLevel(logging.INFO)
    stop_cluster = None
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        prefill, decode = policies(args)
        if args.launcher == "kubernetes":
            scaler = kubernetes_autoscaler(args, prefill, decode)
        else:
            scaler, stop_cluster = ray_autoscaler(args, prefill, decode)
        log.info("%s: router %s; prefill %d..%d engines, TTFT p90 SLO %g s; decode %d..%d, ITL p90 SLO %g s; "
                 "window %g s%s", args.launcher, scaler.router_url, prefill.min, prefill.max, prefill.slo_s,
                 decode.min, decode.max, decode.slo_s, args.interval_s, " (dry run)" if args.dry_run else "")
        scaler.start_minimum()
        windows = 0
        while not stop.wait(args.interval_s):
            try:
                scaler.tick()
            except OSError as e:  # the router restarting: the next window tries again
                log.warning("window skipped, the router did not answer: %s", e)
            windows += 1
            if args.windows and windows >= args.windows:
                break
        n = scaler.history[-1][1:] if scaler.history else (0, 0)
        log.info("stopping after %d windows with %d prefill and %d decode engines", windows, *n)
        return 0
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError, OSError, json.JSONDecodeError) as e:  # KubernetesError is a RuntimeError
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    finally:
        log.removeHandler(progress)
        for s, handler in previous.items():
            signal.signal(s, handler)
        if stop_cluster is not None:
            stop_cluster()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    return run(parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
