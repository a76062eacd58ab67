"""The YAML config of a Ray-launched atomd cluster, validated with msgspec.

One file says everything `launch/ray_cluster.py` needs: the model, how many prefill and
decode engines, the data- and tensor-parallel sizes and Ray resources of each, the router's port and
policy, and the KV transport. Every error names the field (`prefill.count: ...`), so a
typo fails before Ray is even contacted.

`check_fits` compares the config's resource demand with what the cluster offers. It is
pure (dicts in, ValueError out) so it is tested without Ray; the launcher calls it before
creating placement groups, because a placement group that cannot be satisfied waits
forever instead of failing.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import msgspec
import yaml

from contracts.lora import check_name
from router.policies import POLICIES

KVTransport = Literal["zmq", "mooncake"]  # --kv-transfer-backend of every engine
KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"]  # --kv-cache-dtype of every engine (atomd.config's)


class EngineGroup(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`count` identical engines of one role; each gets its own placement group."""

    count: int = 1
    data_parallel_size: int = 1    # the engine's DP ranks, over all its nodes
    data_parallel_size_local: int | None = None  # ranks per node; None: all of them on one node
    enable_expert_parallel: bool = False  # MoE: the engine's DP ranks share the experts
    tensor_parallel_size: int = 1  # processes per DP rank (`--tensor-parallel-size`), one node
    num_cpus: float = 1.0          # Ray logical CPUs per engine process: the engine reserves x TP
    resources: dict[str, float] = {}  # extra Ray resources per engine, e.g. {"prefill_node": 1}
    num_threads: int = 1           # torch threads per DP rank (`--num-threads`)
    max_restarts: int = 3          # Ray restarts of a dead engine actor; -1 = forever
    lora_modules: dict[str, str] = {}  # LoRA adapters this role loads at start besides lora.modules
    extra_args: list[str] = []     # more `atomd serve` flags, passed through verbatim

    def __post_init__(self) -> None:
        _at_least("count", self.count, 1)
        _at_least("data_parallel_size", self.data_parallel_size, 1)
        _at_least("tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.enable_expert_parallel and self.data_parallel_size < 2:
            raise ValueError("enable_expert_parallel: needs data_parallel_size >= 2 (the ranks share the experts)")
        local = self.data_parallel_size_local
        if local is not None and (local < 1 or self.data_parallel_size % local):
            raise ValueError(f"data_parallel_size_local: must divide data_parallel_size={self.data_parallel_size} "
                             f"(the same number of ranks on every node), got {local}")
        _at_least("num_threads", self.num_threads, 1)
        _at_least("max_restarts", self.max_restarts, -1)
        if self.num_cpus <= 0:
            raise ValueError(f"num_cpus: must be > 0, got {self.num_cpus}")
        for name, amount in self.resources.items():
            if amount <= 0 or name in ("CPU", "GPU", "memory"):
                raise ValueError(f"resources.{name}: must be a custom resource with an amount > 0 "
                                 f"(use num_cpus for CPU), got {amount}")
        _check_modules("lora_modules", self.lora_modules)

    @property
    def nodes(self) -> int:
        """Nodes one engine spans: one `atomd serve` on each, data_parallel_size_local ranks apiece."""
        return self.data_parallel_size // (self.data_parallel_size_local or self.data_parallel_size)

    def bundle(self) -> dict[str, float]:
        """The placement-group bundle of one node of an engine: its DP ranks there and their TP
        processes share it (TP's collectives and KV cache are shared memory), num_cpus for each
        TP process. An engine over nodes has one bundle a node, each on another (STRICT_SPREAD)."""
        return {"CPU": float(self.num_cpus) * self.tensor_parallel_size, **self.resources}

    def places(self, address: str, port: int) -> list["DPPlace"]:
        """Where each node of an engine over nodes stands in its DP group: the node's first rank,
        and rank 0's node address and group port, the same for all; [] for an engine on one node."""
        if self.nodes == 1:
            return []
        local = self.data_parallel_size_local or self.data_parallel_size
        return [DPPlace(node * local, local, address, port) for node in range(self.nodes)]


class DPPlace(msgspec.Struct, frozen=True):
    """One node's share of an engine's DP group: `atomd serve --data-parallel-start-rank start_rank
    --data-parallel-size-local local --data-parallel-address address --dp-master-port port`."""

    start_rank: int
    local: int
    address: str   # rank 0's node: the group's store listens there
    port: int

    def flags(self) -> list[str]:
        return ["--data-parallel-size-local", str(self.local), "--data-parallel-start-rank", str(self.start_rank),
                "--data-parallel-address", self.address, "--dp-master-port", str(self.port)]


class LoraSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """LoRA adapters on every engine (`--enable-lora`, `--max-loras`, `--max-lora-rank`); PD needs
    an adapter on both roles: `modules` (name -> PEFT directory on every node) load on every
    engine at start, a role's `lora_modules` on that role's engines as well."""

    enabled: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    modules: dict[str, str] = {}

    def __post_init__(self) -> None:
        _at_least("max_loras", self.max_loras, 1)
        _at_least("max_lora_rank", self.max_lora_rank, 1)
        _check_modules("modules", self.modules)


class RouterSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The router actor; it runs on the node of the job driver (the head)."""

    host: str | None = None        # bind address; None = the node's IP
    port: int = 8000
    policy: str = "round_robin"   # a name in router.policies.POLICIES
    num_cpus: float = 0.5
    health_interval_s: float = 2.0  # a dead engine leaves rotation within this
    extra_args: list[str] = []     # more `python -m router` flags, passed through verbatim

    def __post_init__(self) -> None:
        if not 1 <= self.port <= 65535:
            raise ValueError(f"port: must be in 1..65535, got {self.port}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {sorted(POLICIES)}, got {self.policy!r}")
        if self.num_cpus < 0:
            raise ValueError(f"num_cpus: must be >= 0, got {self.num_cpus}")
        if self.health_interval_s <= 0:
            raise ValueError(f"health_interval_s: must be > 0, got {self.health_interval_s}")


class Timeouts(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Every Ray wait is bounded: an unplaceable actor fails instead of hanging."""

    placement_s: float = 60.0      # placement groups ready
    ready_s: float = 600.0         # engines loaded and registered, router answering
    shutdown_s: float = 2.0        # actors stop their servers on job stop (Ray allows ~3 s)

    def __post_init__(self) -> None:
        for name in ("placement_s", "ready_s", "shutdown_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")


class ClusterConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None       # HF checkpoint directory on every node; None = built-in default
    engine_host: str | None = None  # engines' bind address; None = the node's IP (multi-node),
                                    # 127.0.0.1 keeps a one-machine cluster on loopback
    kv_transfer_backend: KVTransport = "zmq"
    kv_cache_dtype: KVCacheDtype = "auto"  # both roles alike: P and D refuse to pair otherwise
    prefill: EngineGroup = msgspec.field(default_factory=EngineGroup)
    decode: EngineGroup = msgspec.field(default_factory=EngineGroup)
    router: RouterSpec = msgspec.field(default_factory=RouterSpec)
    timeouts: Timeouts = msgspec.field(default_factory=Timeouts)
    lora: LoraSpec = msgspec.field(default_factory=LoraSpec)
    check_resources: bool = True   # off for autoscaling clusters, where nodes arrive later

    def __post_init__(self) -> None:
        for role in ("prefill", "decode"):
            modules = self.lora_modules(role)
            if modules and not self.lora.enabled:
                raise ValueError(f"{role}.lora_modules: LoRA adapters need lora.enabled")

    def lora_modules(self, role: str) -> dict[str, str]:
        """The adapters a `role` engine loads at start: every engine's, then the role's own."""
        return {**self.lora.modules, **getattr(self, role).lora_modules}

    def demand(self) -> dict[str, float]:
        """Total Ray resources the whole cluster reserves."""
        total: dict[str, float] = {"CPU": self.router.num_cpus}
        for group in (self.prefill, self.decode):
            for name, amount in group.bundle().items():
                total[name] = total.get(name, 0.0) + amount * group.count * group.nodes
        return total


def _at_least(field: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"{field}: must be >= {low}, got {value}")


def _check_modules(field: str, modules: dict[str, str]) -> None:
    for name, path in modules.items():
        try:
            check_name(name)
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from None
        if not path:
            raise ValueError(f"{field}: {name!r} needs a path (a PEFT adapter directory)")


def _field_error(e: msgspec.ValidationError) -> ValueError:
    """msgspec says 'msg - at `$.prefill`'; we say 'prefill.count: msg'."""
    message, sep, where = str(e).rpartition(" - at `")
    if not sep:
        message, where = str(e), ""
    path = where.rstrip("`").removeprefix("$").lstrip(".")
    field = None
    if unknown := re.fullmatch(r"Object contains unknown field `(\w+)`", message):
        field, message = unknown.group(1), "unknown field"
    elif (own := re.fullmatch(r"([\w.]+): (.*)", message, re.S)):
        field, message = own.groups()  # our __post_init__ already names the field
    if field:
        path = f"{path}.{field}" if path else field
    return ValueError(f"{path}: {message}" if path else message)


def parse_config(data: object) -> ClusterConfig:
    try:
        return msgspec.convert(data if data is not None else {}, ClusterConfig)
    except msgspec.ValidationError as e:
        raise _field_error(e) from None


def load_config(path: str | Path, router: dict | None = None, top: dict | None = None) -> ClusterConfig:
    """Read and validate a YAML config; ValueError names the file and the field. `router`
    and `top`: fields of its `router` section and of the top level set from the command line
    (router host and port, engine_host), validated alike."""
    text = Path(path).read_text()
    try:
        data = yaml.safe_load(text)
        if router or top:
            data = {} if data is None else data
            if not isinstance(data, dict) or not isinstance(data.setdefault("router", {}), dict):
                raise ValueError("the config and its `router` section must be mappings")
            data.update(top or {})
            data["router"].update(router or {})
        return parse_config(data)
    except (ValueError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: {e}") from None


def _fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in sorted(resources.items())) or "nothing"


def check_fits(config: ClusterConfig, available: dict[str, float],
               node_totals: list[dict[str, float]]) -> None:
    """Raise ValueError naming the missing resources when the config cannot be placed.

    `available` is the cluster's free resources now, `node_totals` each alive node's
    total resources. An engine's bundle must fit on one node (its DP ranks there are one
    `atomd serve` process tree), an engine over N nodes' bundles on N different nodes; the
    sum must fit in what is free.
    """
    for role, group in (("prefill", config.prefill), ("decode", config.decode)):
        bundle = group.bundle()
        fitting = sum(all(node.get(k, 0.0) >= v for k, v in bundle.items()) for node in node_totals)
        if not fitting:
            largest = [_fmt({k: node.get(k, 0.0) for k in bundle}) for node in node_totals]
            raise ValueError(
                f"{role}: one {role} engine needs {_fmt(bundle)} on a single node, but no node "
                f"has that (nodes: {'; '.join(largest) or 'none alive'}); "
                f"lower {role}.num_cpus / {role}.resources or add a bigger node")
        if fitting < group.nodes:
            raise ValueError(
                f"{role}: one {role} engine spans {group.nodes} nodes (data_parallel_size "
                f"{group.data_parallel_size} / data_parallel_size_local {group.data_parallel_size_local}) with "
                f"{_fmt(bundle)} on each, but only {fitting} node(s) have that")
    demand = config.demand()
    missing = {k: v - available.get(k, 0.0) for k, v in demand.items() if v > available.get(k, 0.0) + 1e-9}
    if missing:
        raise ValueError(
            f"not enough Ray resources: the config needs {_fmt(demand)} "
            f"({config.prefill.count} prefill x {_fmt(config.prefill.bundle())}, "
            f"{config.decode.count} decode x {_fmt(config.decode.bundle())}, "
            f"router CPU={config.router.num_cpus:g}), the cluster has {_fmt(available)} free; "
            f"missing {_fmt(missing)}")
