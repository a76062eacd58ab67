"""Run an atomd PD cluster on Ray: engines and the router as actors of one job.

    ray job submit --working-dir . -- python -m launch.ray_cluster --config launch/configs/1p1d.yaml
    python -m launch.ray_cluster --config launch/configs/1p1d.yaml      # ray.init(address="auto")

Shape. One placement group per engine, one EngineActor per node of an engine, one
RouterActor on the driver's node. An engine's DP ranks on one node are one `atomd serve`
process tree (one bundle, STRICT_PACK); an engine over nodes (`data_parallel_size_local`)
has a bundle a node (STRICT_SPREAD), and each node's actor runs `atomd serve` for its ranks
with the group's rank 0 address and port, found on the first bundle's node before any starts. Every actor owns one child process running the very CLI a user runs by
hand (`python -m atomd serve ...`, `python -m router ...`): there is no second data path,
and a bug fixed in the server is fixed here.

Failure. Engine actors have `max_restarts`: a restarted actor starts a fresh server on a
fresh port and registers it with the router (POST /workers). The router's health checks
take the dead server out of rotation within `router.health_interval_s`; the driver then
prunes it from /workers, so GET /workers shows the live cluster.

Stop. `ray job stop` SIGTERMs the driver: it asks every actor to stop its child (bounded
by `timeouts.shutdown_s`, Ray SIGKILLs the driver ~3 s after the SIGTERM), kills the
actors and removes the placement groups. Should the driver die without cleaning up, Ray
kills its actors, and every child dies with its actor (PR_SET_PDEATHSIG).

Every Ray wait has a timeout: a placement group or actor that cannot be placed fails
with the missing resources named instead of waiting forever.

Scaling. `RayCluster.add_engine(role)` / `remove_engine(url)` start one more engine (its
placement group and actor; the actor registers with the router) and stop one; `RayLauncher`
hands them to the online planner (launch/autoscale.py), which drains an engine before it
calls `remove_engine`.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from contracts.roles import Role
from kv_transfer.trust import SECRET_ENV
from launch.process import EngineServer, RouterServer, free_port, http
from launch.ray_config import ClusterConfig, DPPlace, RouterSpec, check_fits, load_config

ROOT = Path(__file__).resolve().parents[1]
READY_LINE = "atomd ray cluster ready:"
PROBE_INTERVAL_S = 0.25
HTTP_TIMEOUT_S = 2.0


def register(router_url: str, url: str, role: str, deadline: float) -> None:
    """POST /workers until the router takes it (it may still be starting)."""
    while True:
        try:
            status, body = http("POST", f"{router_url}/workers", {"url": url, "role": role}, timeout=HTTP_TIMEOUT_S)
            if status in (200, 201):
                return
            if 400 <= status < 500:
                raise RuntimeError(f"router refused {role} worker {url}: {status} {body.decode(errors='replace')}")
            error = f"{status} {body.decode(errors='replace')}"
        except OSError as e:
            error = repr(e)
        if time.monotonic() > deadline:
            raise TimeoutError(f"could not register {role} worker {url} with {router_url}: {error}")
        time.sleep(PROBE_INTERVAL_S)


def with_secret(kv_params_secret: str) -> dict:
    """The child's environment: ours plus the cluster's kv_transfer_params secret (an
    environment variable, so it shows in no command line)."""
    return {**os.environ, SECRET_ENV: kv_params_secret}


def engine_flags(role: str, config: ClusterConfig, host: str, place: DPPlace | None = None) -> list[str]:
    """`atomd serve` flags of a `role` engine listening on `host`, past --host, --port and --model;
    `place`: this node's share of an engine over nodes."""
    group = getattr(config, role)
    return ["--kv-role", Role(role).kv_role, "--num-threads", str(group.num_threads),
            "--data-parallel-size", str(group.data_parallel_size), *(place.flags() if place else []),
            *(["--enable-expert-parallel"] if group.enable_expert_parallel else []),
            *(["--tensor-parallel-size", str(group.tensor_parallel_size)] if group.tensor_parallel_size > 1 else []),
            "--kv-transfer-backend", config.kv_transfer_backend, "--kv-cache-dtype", config.kv_cache_dtype,
            "--kv-side-channel-host", host,  # decode engines on other nodes pull from here
            *lora_flags(role, config), *group.extra_args]


def lora_flags(role: str, config: ClusterConfig) -> list[str]:
    lora, modules = config.lora, config.lora_modules(role)
    if not lora.enabled:
        return []
    return ["--enable-lora", "--max-loras", str(lora.max_loras), "--max-lora-rank", str(lora.max_lora_rank),
            *(["--lora-modules", *(f"{n}={p}" for n, p in sorted(modules.items()))] if modules else [])]


@ray.remote
class EngineActor:
    """One prefill or decode engine; every (re)start serves on a fresh port and registers.

    Its child's stdout/stderr are the actor's (its Ray log, `ray job logs`), and the child
    dies with the actor (die_with_parent); so does the router's.
    """

    def __init__(self, role: str, config: ClusterConfig, router_url: str, kv_params_secret: str,
                 place: DPPlace | None = None):
        deadline = time.monotonic() + config.timeouts.ready_s
        host = config.engine_host or ray.util.get_node_ip_address()
        self.role = role
        self.server = EngineServer(config.model or None, *engine_flags(role, config, host, place), host=host,
                                   port=free_port(host), name=f"{role} engine", die_with_parent=True,
                                   env=with_secret(kv_params_secret))
        try:
            self.server.wait_ready(config.timeouts.ready_s)
            register(router_url, self.server.url, role, deadline)
        except BaseException:
            self.server.stop(1.0)
            raise

    def info(self) -> dict:
        return {"role": self.role, "url": self.server.url, "pid": self.server.pid,
                "alive": self.server.alive()}

    def shutdown(self, grace_s: float) -> None:
        self.server.stop(grace_s)


@ray.remote(num_cpus=0)
def group_address(engine_host: str | None) -> tuple[str, int]:
    """Rank 0's node address and a free port there: where an engine over nodes meets (run in
    the bundle rank 0's node holds)."""
    host = engine_host or ray.util.get_node_ip_address()
    return host, free_port(host)


@ray.remote
class RouterActor:
    """The router, on the driver's node so the printed URL is the head's."""

    def __init__(self, spec: RouterSpec, ready_s: float, kv_params_secret: str):
        ip = ray.util.get_node_ip_address()
        host = spec.host or ip
        url_host = ip if host in ("0.0.0.0", "::") else host
        # no workers yet (the engines register themselves), so not /ready: /health
        self.server = RouterServer((), (), "--policy", spec.policy, "--health-interval-s",
                                   str(spec.health_interval_s), *spec.extra_args, host=host, port=spec.port,
                                   url_host=url_host, die_with_parent=True, env=with_secret(kv_params_secret))
        try:
            self.server.wait_ready(ready_s, path="/health")
        except BaseException:
            self.server.stop(1.0)
            raise

    def info(self) -> dict:
        return {"role": "router", "url": self.server.url, "pid": self.server.pid,
                "alive": self.server.alive()}

    def shutdown(self, grace_s: float) -> None:
        self.server.stop(grace_s)


class RayCluster:
    """The driver's view: placement groups, actors, and the watch loop."""

    def __init__(self, config: ClusterConfig):
        self.config = config
        self.slots = [(role, i) for role in ("prefill", "decode") for i in range(getattr(config, role).count)]
        self.pgs: list = []
        self.engines: list[tuple[str, list]] = []  # per slot: its role and its actors, one a node of the engine
        self.router: ray.actor.ActorHandle | None = None
        self.router_url = ""
        self.gone: dict[str, str] = {}  # engine slot ("decode-0") -> why it is gone, as last reported
        # the router signs the kv_transfer_params it forwards with it; the engines pull only
        # for params signed with it (docs/design.md "Trust"); fresh per cluster
        self.kv_params_secret = secrets.token_hex(32)
        self._lock = threading.Lock()  # slots, pgs, engines: the planner's thread adds and removes

    def start(self) -> list[dict]:
        """Start the router, place the engines, start them; returns the engines' info."""
        c = self.config
        if c.check_resources:
            nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
            check_fits(c, ray.available_resources(), nodes)
        # The router first, so that its share of the head is taken before engines land there.
        self.router = RouterActor.options(
            name="atomd-router", num_cpus=c.router.num_cpus, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
        ).remote(c.router, c.timeouts.placement_s, self.kv_params_secret)
        try:
            self.router_url = ray.get(self.router.info.remote(), timeout=c.timeouts.placement_s)["url"]
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"the router (CPU={c.router.num_cpus:g} on the driver's node) did not start "
                               f"within {c.timeouts.placement_s:g} s; free CPU there or lower router.num_cpus") from None
        self._place()
        for (role, i), pg in zip(self.slots, self.pgs):
            self.engines.append((role, self._engine_actors(role, i, pg)))
        calls = {a.info.remote(): slot for (_, actors), slot in zip(self.engines, self.slots) for a in actors}
        _, pending = ray.wait(list(calls), num_returns=len(calls), timeout=c.timeouts.ready_s)
        if pending:
            late = ", ".join(f"{role}-{i}" for role, i in (calls[ref] for ref in pending))
            raise TimeoutError(f"engines not ready within timeouts.ready_s={c.timeouts.ready_s:g} s: {late} "
                               "(their logs are in `ray job logs`)")
        return ray.get(list(calls), timeout=c.timeouts.ready_s)  # raises why an engine died

    def _engine_actors(self, role: str, i: int, pg) -> list:
        """The actors of one engine, one per node (bundle). An engine over nodes: rank 0's node
        address and a free port there first, then each node's actor with its start rank. Those
        actors are not restarted alone: a rank restarted into a group whose other ranks have
        failed (expert parallelism fails them all) would wait for a rendezvous that never comes."""
        group = getattr(self.config, role)
        places: list[DPPlace | None] = [None]
        if group.nodes > 1:
            at_rank_0 = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
            address, port = ray.get(group_address.options(scheduling_strategy=at_rank_0).remote(self.config.engine_host),
                                    timeout=self.config.timeouts.placement_s)
            places = group.places(address, port)
        return [EngineActor.options(
            name=f"atomd-{role}-{i}" + (f"-node{node}" if place else ""), num_cpus=group.num_cpus,
            resources=group.resources, max_restarts=group.max_restarts if place is None else 0, max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=node),
        ).remote(role, self.config, self.router_url, self.kv_params_secret, place)
            for node, place in enumerate(places)]

    def _placement_group(self, role: str, i: int):
        """One engine's bundles: one a node, all on one node (STRICT_PACK) or each on its own (STRICT_SPREAD)."""
        group = getattr(self.config, role)
        return placement_group([group.bundle()] * group.nodes, name=f"atomd-{role}-{i}",
                               strategy="STRICT_PACK" if group.nodes == 1 else "STRICT_SPREAD")

    def add_engine(self, role: str) -> dict:
        """One more `role` engine: its placement group, then its actor (which registers with
        the router); its info once it serves. Nothing is left behind when it fails."""
        timeouts = self.config.timeouts
        with self._lock:
            i = 1 + max((j for r, j in self.slots if r == role), default=-1)
        pg = self._placement_group(role, i)
        actors = []
        try:
            if not ray.wait([pg.ready()], timeout=timeouts.placement_s)[0]:
                raise TimeoutError(f"{role}-{i}'s placement group was not placed within {timeouts.placement_s:g} s; "
                                   f"the cluster has {ray.available_resources()} free")
            actors = self._engine_actors(role, i, pg)
            infos = ray.get([a.info.remote() for a in actors], timeout=timeouts.ready_s)
        except BaseException:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            remove_placement_group(pg)
            raise
        with self._lock:
            self.slots.append((role, i))
            self.pgs.append(pg)
            self.engines.append((role, actors))
        return {**infos[0], "urls": [info["url"] for info in infos]}

    def remove_engine(self, url: str) -> None:
        """Stop the engine serving `url` (the planner drained it first): its child, its actor,
        its placement group. KeyError when no engine serves it."""
        with self._lock:
            entries = list(zip(self.engines, self.pgs, self.slots))
        infos = [ray.get([a.info.remote() for a in actors], timeout=30) for (_, actors), _, _ in entries]
        match = [entry for entry, hosts in zip(entries, infos) if any(info["url"] == url for info in hosts)]
        if not match:
            raise KeyError(f"no engine of this cluster serves {url}")
        (role, actors), pg, slot = match[0]  # an engine over nodes goes whole
        grace_s = self.config.timeouts.shutdown_s
        ray.wait([a.shutdown.remote(grace_s * 0.8) for a in actors], num_returns=len(actors), timeout=grace_s)
        for actor in actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(pg)
        with self._lock:
            k = self.slots.index(slot)
            del self.engines[k], self.pgs[k], self.slots[k]

    def _place(self) -> None:
        """One placement group per engine (a bundle a node), all ready within timeouts.placement_s."""
        for role, i in self.slots:
            self.pgs.append(self._placement_group(role, i))
        waits = {pg.ready(): slot for pg, slot in zip(self.pgs, self.slots)}
        timeout_s = self.config.timeouts.placement_s
        _, pending = ray.wait(list(waits), num_returns=len(waits), timeout=timeout_s)
        if pending:
            unplaced = ", ".join(f"{role}-{i} ({getattr(self.config, role).bundle()})"
                                 for role, i in (waits[ref] for ref in pending))
            raise TimeoutError(f"placement groups not placed within {timeout_s:g} s: {unplaced}; "
                               f"the cluster has {ray.available_resources()} free")

    def watch(self) -> None:
        """Until stopped: fail when the router dies, prune dead engines from /workers."""
        interval_s = self.config.router.health_interval_s
        while True:
            time.sleep(interval_s)
            if not ray.get(self.router.info.remote(), timeout=30)["alive"]:
                raise RuntimeError("the router process exited; stopping the cluster")
            self._prune_dead_workers(interval_s)

    def _prune_dead_workers(self, timeout_s: float) -> None:
        """Drop unhealthy router entries that no live engine actor serves any more, and say
        which engines are gone (their actor does not answer: restarting, e.g. after its node
        died, or dead) and which came back.

        A role is pruned only when every actor of it answered (a restarting actor's new
        URL is unknown until it does), and only entries the router already marks unhealthy.
        """
        with self._lock:
            engines = list(zip(self.engines, self.slots))
        calls = {a.info.remote(): (role, f"{role}-{i}" + (f"/node{node}" if len(actors) > 1 else ""))
                 for (role, actors), (_, i) in engines for node, a in enumerate(actors)}
        done, pending = ray.wait(list(calls), num_returns=len(calls), timeout=timeout_s)
        current, unsure = set(), {calls[ref][0] for ref in pending}
        gone = {calls[ref][1]: f"no answer within {timeout_s:g} s (Ray is restarting its actor, or its node "
                               "is gone)" for ref in pending}
        for ref in done:
            role, slot = calls[ref]
            try:
                info = ray.get(ref, timeout=1)
                current.add((role, info["url"]))
                if slot in self.gone:
                    print(f"ray_cluster: engine {slot} is back: {info['url']}", flush=True)
            except ray.exceptions.RayError as e:
                unsure.add(role)
                gone[slot] = f"its actor failed: {type(e).__name__}"
        for slot, why in gone.items():
            if slot not in self.gone:
                print(f"ray_cluster: engine {slot} is gone: {why}; the router takes it out of rotation", flush=True)
        self.gone = gone
        try:
            status, raw = http("GET", f"{self.router_url}/workers", timeout=HTTP_TIMEOUT_S)
            for w in (json.loads(raw) if status == 200 else {}).get("workers", []):
                if w["role"] not in unsure and (w["role"], w["url"]) not in current and not w["healthy"]:
                    http("DELETE", f"{self.router_url}/workers", {"url": w["url"], "role": w["role"]},
                         timeout=HTTP_TIMEOUT_S)
                    print(f"ray_cluster: removed dead {w['role']} engine {w['url']} from the router", flush=True)
        except (OSError, ValueError) as e:  # the router is busy or restarting its listener: next round
            print(f"ray_cluster: could not reach the router to prune workers: {e!r}", flush=True)

    def stop(self) -> None:
        """Stop every child (bounded), kill every actor, remove every placement group."""
        actors = [a for _, engine in self.engines for a in engine] + ([self.router] if self.router else [])
        grace_s = self.config.timeouts.shutdown_s
        calls = [a.shutdown.remote(grace_s * 0.8) for a in actors]
        ray.wait(calls, num_returns=len(calls), timeout=grace_s)
        for a in actors:
            ray.kill(a, no_restart=True)
        for pg in self.pgs:
            remove_placement_group(pg)


class RayLauncher:
    """The online planner's launcher (launch/autoscale.py `Launcher`) over a started
    RayCluster: engines are its actors."""

    def __init__(self, cluster: RayCluster):
        self.cluster = cluster

    def start(self, role: str) -> str:
        if getattr(self.cluster.config, role).nodes > 1:  # the planner counts, drains and stops one URL an engine
            raise ValueError(f"{role}: an engine over {getattr(self.cluster.config, role).nodes} nodes "
                             "(data_parallel_size_local) is not scaled online")
        return self.cluster.add_engine(role)["url"]

    def stop(self, url: str) -> None:
        self.cluster.remove_engine(url)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.ray_cluster", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="YAML config (see launch/ray_config.py)")
    p.add_argument("--address", default="auto",
                   help="Ray cluster to join when run directly (inside `ray job submit` Ray sets it)")
    p.add_argument("--node-ip-address", default=None, metavar="ADDR",
                   help="the address the engines and the router listen on and advertise, as given to `ray start "
                        "--node-ip-address` (Ray 2.60 swaps a loopback one for the machine's address; atomd keeps "
                        "it); overrides the config's engine_host and router.host")
    p.add_argument("--router-host", default=None,
                   help="the router's bind address (overrides router.host and --node-ip-address; e.g. 0.0.0.0)")
    p.add_argument("--router-port", type=int, default=None, help="the router's port (overrides router.port)")
    args = p.parse_args(argv)
    top = {"engine_host": args.node_ip_address} if args.node_ip_address else {}
    router = {k: v for k, v in (("host", args.router_host or args.node_ip_address), ("port", args.router_port))
              if v is not None}
    try:
        config = load_config(args.config, router, top)
    except (OSError, ValueError) as e:
        print(f"ray_cluster: error: {e}", file=sys.stderr)
        return 2
    in_job = "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ
    cluster = RayCluster(config)
    try:
        # A direct run ships this tree to the workers the way `--working-dir .` does.
        ray.init(address=args.address, runtime_env=None if in_job else {"working_dir": str(ROOT)})
        # `ray job stop` sends SIGTERM: clean up below. After ray.init, which installs its own.
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        engines = cluster.start()
        urls = {role: [e["url"] for e in engines if e["role"] == role] for role in ("prefill", "decode")}
        print(f"{READY_LINE} {cluster.router_url} (prefill: {' '.join(urls['prefill'])}; "
              f"decode: {' '.join(urls['decode'])})", flush=True)
        cluster.watch()
        return 1
    except KeyboardInterrupt:
        print("ray_cluster: stopping on signal", flush=True)
        return 0
    except (ValueError, TimeoutError, RuntimeError, ray.exceptions.RayError) as e:
        print(f"ray_cluster: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if ray.is_initialized():
            cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
