"""The DP ranks' gloo process group: the PrefillDelayer's Collective, the lockstep barrier
and the expert-parallel all-to-alls.

Each engine-core rank joins one `torch.distributed` gloo group at rank 0's address
(`--data-parallel-address`, 127.0.0.1 unless the ranks span hosts; CPU, no NCCL), its
traffic on the interface that reaches that address. The delayer sums a small int64 vector over it once per tick; `--dp-lockstep`
adds one all-reduce at the end of every tick, as MoE expert parallelism forces on GPUs;
`--enable-expert-parallel` runs three all-to-alls per sparse layer and step
(atomd/model/expert_parallel.py), after the tick's delayer collective: one group, one order.

Every collective has a deadline (the group's timeout). A collective that fails (a rank
died, or one rank skipped a call and the counts diverged) marks the group broken: from
then on every call raises at once, so the delayer fails open on every tick after (counted)
and nothing ever waits on a dead peer again.
"""
from __future__ import annotations

import datetime
import fcntl
import logging
import os
import socket
import struct
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from scheduler.prefill_delayer import DELAYER_KNOBS, Collective, PrefillDelayer

if TYPE_CHECKING:
    from atomd.config import EngineConfig

logger = logging.getLogger("atomd.engine.dp_collective")

SIOCGIFADDR = 0x8915  # linux: an interface's IPv4 address


def interface_towards(address: str) -> str:
    """The network interface this host reaches `address` through (lo for a loopback address):
    gloo's, where each rank listens for its peers. Without it gloo takes the address the host
    name resolves to, which a host inside a network namespace (or a container) may not have."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((socket.gethostbyname(address), 9))  # a UDP connect sends nothing: the kernel picks the route
        except OSError as e:
            raise RuntimeError(f"data_parallel_address {address!r} cannot be reached from this host: {e}") from None
        local = s.getsockname()[0]
        for _, name in socket.if_nameindex():
            try:
                ifaddr = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(ifaddr[20:24]) == local:
                return name
    raise RuntimeError(f"no network interface has {local}, the address that reaches {address}")


class CollectiveBroken(RuntimeError):
    """An earlier collective of this group failed; the group is not used again."""


class GlooCollective(Collective):
    """This process's rank of the DP group."""

    def __init__(self, rank: int, world_size: int, port: int, *, address: str = "127.0.0.1",
                 timeout_s: float = 60.0, join_timeout_s: float = 600.0):
        if not 0 <= rank < world_size:
            raise ValueError(f"data_parallel_rank must be in [0, {world_size}), got {rank}")
        self.rank, self.world_size = rank, world_size
        if not os.environ.get("GLOO_SOCKET_IFNAME"):  # one the user set wins
            os.environ["GLOO_SOCKET_IFNAME"] = interface_towards(address)
        # Joining waits for the slowest rank's model load (on every host); a tick waits only for one step.
        dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=join_timeout_s))
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.num_collectives = 0  # calls made, failed ones included: equal on every rank per tick
        self.num_all_to_all = 0  # expert parallelism's, counted apart from the delayer's
        self.broken: str | None = None

    def all_reduce_sum(self, vec: np.ndarray) -> np.ndarray:
        self.num_collectives += 1
        if self.broken is not None:
            raise CollectiveBroken(self.broken)
        t = torch.from_numpy(np.ascontiguousarray(vec, dtype=np.int64))
        try:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        except Exception as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            logger.error("DP rank %d: collective failed, the group is broken: %s", self.rank, self.broken)
            raise
        return t.numpy()

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                   in_splits: list[int]) -> None:
        """Rows inp[in_splits[r] chunk] to rank r, rank r's chunk for this rank into out; a
        failure breaks the group and raises CollectiveBroken (an expert-parallel rank cannot go
        on alone: it lacks the other ranks' experts)."""
        self.num_all_to_all += 1
        if self.broken is not None:
            raise CollectiveBroken(self.broken)
        try:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        except Exception as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            logger.error("DP rank %d: all-to-all failed, the group is broken: %s", self.rank, self.broken)
            raise CollectiveBroken(self.broken) from exc

    def barrier(self) -> None:
        """Wait for every rank, under the join timeout (the default group's)."""
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class Lockstep:
    """`--dp-lockstep`: one all-reduce after every tick's forward (empty or not), so the
    slowest rank's step sets every rank's pace, as with MoE expert parallelism."""

    def __init__(self, collective: Collective):
        self.collective = collective
        self.num_errors = 0

    def end_of_step(self) -> None:
        try:
            self.collective.all_reduce_sum(np.zeros(1, dtype=np.int64))
        except Exception:  # a dead peer must not stop this rank: it goes on alone
            self.num_errors += 1


class ObservedPrefillDelayer(PrefillDelayer):
    """PrefillDelayer that also counts, per admitted prefill, the ticks it was held."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.hold_ticks: dict[int, int] = defaultdict(int)

    def _decide(self, allow: bool, reason: str) -> bool:
        if allow and reason != "none":  # "none": nothing to prefill, nothing admitted
            self.hold_ticks[self._held] += 1
        return super()._decide(allow, reason)

    def stats(self) -> dict[str, Any]:
        """Plain data for the `stats` utility call (msgpack) and the /metrics collector."""
        return {"policy": self.policy,
                "outcomes": [[*key, n] for key, n in sorted(self.outcomes.items())],
                "hold_ticks": [[held, n] for held, n in sorted(self.hold_ticks.items())],
                "collective_errors": self.num_collective_errors,
                "num_collectives": getattr(self.collective, "num_collectives", None)}


def make_prefill_delayer(config: EngineConfig, collective: Collective) -> ObservedPrefillDelayer:
    """The delayer `--prefill-delayer` asks for, with the knobs from `config`
    (EngineConfig field `prefill_delayer_<knob>` for each of DELAYER_KNOBS)."""
    knobs = {k: getattr(config, f"prefill_delayer_{k}") for k in DELAYER_KNOBS}
    return ObservedPrefillDelayer(collective, config.prefill_delayer,
                                  max_num_batched_tokens=config.max_num_batched_tokens, **knobs)
