"""EngineConfig: every engine knob in one place, with vLLM's flag names and defaults.

Built from CLI flags (`add_engine_args` + `EngineConfig.from_args`) or from keyword
arguments (`LLM(**engine_args)`); a bad value is a ValueError naming the field.
"""
from __future__ import annotations

import argparse
import os
import re
from typing import Any

import msgspec

DTYPES = ("float32", "bfloat16", "float16")
KV_ROLES = ("both", "producer", "consumer")
KV_TRANSFER_BACKENDS = ("zmq",)  # mooncake: not implemented yet
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")
PREFILL_DELAYERS = ("off", "align", "coalesce")
ATTENTION_BACKENDS = ("auto", "native", "torch")
DEFAULT_KV_CACHE_MEMORY = 256 << 20  # bytes; the pool never grows past max_num_seqs full contexts
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class EngineConfig(msgspec.Struct, kw_only=True):
    model: str | None = None  # None: the built-in default model (atomd.model.default)
    dtype: str = "float32"
    seed: int = 0
    num_threads: int | None = None  # None: all cores (torch's own default)
    # attention: native = the C kernels (atomd/native.py), torch = SDPA; auto: native for
    # float32 where they build, else torch
    attention_backend: str = "auto"
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduler_delay_factor: float = 0.0
    kv_cache_memory: int | None = None  # bytes; ignored when num_kvcache_blocks is set
    num_kvcache_blocks: int | None = None
    kv_role: str = "both"
    kv_transfer_backend: str = "zmq"
    # PD (kv_role producer / consumer): the side channel P binds (port 0: any; DP rank r: port + r)
    kv_side_channel_host: str = "127.0.0.1"
    kv_side_channel_port: int = 0
    kv_lease_s: float = 30.0  # P holds a finished prompt's blocks this long without a heartbeat
    kv_recv_timeout_s: float = 10.0  # D gives up a pull after P is silent this long
    kv_load_failure_policy: str = "fail"  # D after a failed pull: error out, or prefill locally
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    kv_events_endpoint: str | None = None
    # data parallelism (atomd/dp.py): the PrefillDelayer's policy and knobs (DESIGN.md defaults)
    prefill_delayer: str = "off"
    prefill_delayer_max_delay_passes: int = 30
    prefill_delayer_token_usage_low_watermark: float | None = None
    prefill_delayer_target_fill: float = 0.9
    prefill_delayer_kv_high_watermark: float = 0.9
    prefill_delayer_kv_low_watermark: float = 0.1
    prefill_delayer_ttft_max_ticks: int = 200
    prefill_delayer_partial_max_ticks: int = 100
    prefill_delayer_stall_ticks: int = 10
    prefill_delayer_queue_max_ticks: int = 50
    dp_lockstep: bool = False
    dp_collective_timeout_s: float = 60.0
    dp_master_port: int | None = None  # the ranks' gloo group; picked by the API process

    def __post_init__(self) -> None:
        _choice("dtype", self.dtype, DTYPES)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if self.attention_backend == "native" and self.dtype != "float32":
            raise ValueError(f"attention_backend native runs float32 only, got dtype {self.dtype!r}")
        _choice("kv_role", self.kv_role, KV_ROLES)
        _choice("kv_transfer_backend", self.kv_transfer_backend, KV_TRANSFER_BACKENDS)
        _choice("kv_load_failure_policy", self.kv_load_failure_policy, KV_LOAD_FAILURE_POLICIES)
        for name in ("kv_lease_s", "kv_recv_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.kv_side_channel_port <= 65535:
            raise ValueError(f"kv_side_channel_port must be in [0, 65535], got {self.kv_side_channel_port}")
        _choice("prefill_delayer", self.prefill_delayer, PREFILL_DELAYERS)
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "data_parallel_size", "prefill_delayer_max_delay_passes",
                     "prefill_delayer_ttft_max_ticks", "prefill_delayer_partial_max_ticks",
                     "prefill_delayer_stall_ticks", "prefill_delayer_queue_max_ticks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_threads", "num_kvcache_blocks", "kv_cache_memory"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name in ("long_prefill_token_threshold", "scheduler_delay_factor", "data_parallel_rank"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("prefill_delayer_target_fill", "prefill_delayer_kv_high_watermark",
                     "prefill_delayer_kv_low_watermark", "prefill_delayer_token_usage_low_watermark"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if self.dp_collective_timeout_s <= 0:
            raise ValueError(f"dp_collective_timeout_s must be > 0, got {self.dp_collective_timeout_s}")
        if self.data_parallel_rank >= self.data_parallel_size:
            raise ValueError(f"data_parallel_rank must be < data_parallel_size={self.data_parallel_size}, "
                             f"got {self.data_parallel_rank}")
        if self.model is not None and not os.path.isdir(self.model):
            raise ValueError(f"model must be a local Hugging Face checkpoint directory, got {self.model!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineConfig":
        fields = {f: getattr(args, f) for f in cls.__struct_fields__ if hasattr(args, f)}
        return cls(**fields)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        unknown = sorted(set(kwargs) - set(cls.__struct_fields__))
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
        if isinstance(kwargs.get("kv_cache_memory"), str):
            kwargs["kv_cache_memory"] = parse_bytes(kwargs["kv_cache_memory"], "kv_cache_memory")
        return cls(**kwargs)

    def num_threads_or_all(self) -> int:
        return self.num_threads or os.cpu_count() or 1


def _choice(field: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{field} must be one of {', '.join(choices)}, got {value!r}")


def parse_bytes(text: str, field: str = "kv_cache_memory") -> int:
    """'512MiB', '2G', '1073741824' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text).lower())
    if m is None:
        raise ValueError(f"{field} must be a size like 512MiB, 2GiB or a byte count, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _bytes_arg(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (vLLM names), shared by `atomd serve` and `atomd generate`."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="local Hugging Face checkpoint directory (default: the built-in default model)")
    g.add_argument("--dtype", default="float32", choices=DTYPES, help="weights and KV cache dtype")
    g.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    g.add_argument("--num-threads", type=int, default=None,
                   help="torch threads of this engine (default: all cores)")
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="prefill and decode attention: native C kernels (float32, built at first use), "
                        "torch SDPA, or auto (native where they build)")
    g.add_argument("--max-model-len", type=int, default=2048, help="prompt + completion tokens")
    g.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=8192, help="tokens per step")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="largest prefill chunk of one sequence (0: off)")
    g.add_argument("--scheduler-delay-factor", type=float, default=0.0)
    size = g.add_mutually_exclusive_group()
    size.add_argument("--kv-cache-memory", type=_bytes_arg, default=None,
                      help="KV cache size, e.g. 512MiB (default: 256MiB, at most max_num_seqs full contexts)")
    size.add_argument("--num-kvcache-blocks", type=int, default=None, help="KV cache size in blocks")
    g.add_argument("--kv-role", default="both", choices=KV_ROLES,
                   help="PD role: both (colocated), producer (prefill), consumer (decode)")
    g.add_argument("--kv-transfer-backend", default="zmq", choices=KV_TRANSFER_BACKENDS)
    g.add_argument("--kv-side-channel-host", default="127.0.0.1", help="address a producer serves KV on")
    g.add_argument("--kv-side-channel-port", type=int, default=0,
                   help="producer's side-channel port (0: any free one; DP rank r uses port + r)")
    g.add_argument("--kv-lease-s", type=float, default=30.0,
                   help="producer: seconds a finished prompt's blocks stay pinned without a heartbeat")
    g.add_argument("--kv-recv-timeout-s", type=float, default=10.0,
                   help="consumer: seconds a pull may see nothing from the producer before it fails")
    g.add_argument("--kv-load-failure-policy", default="fail", choices=KV_LOAD_FAILURE_POLICIES,
                   help="consumer after a failed pull: fail the request, or recompute the prompt locally")
    g.add_argument("--data-parallel-size", type=int, default=1)
    g.add_argument("--data-parallel-rank", type=int, default=0)
    g.add_argument("--kv-events-endpoint", default=None, help="ZMQ PUB endpoint for KV events")
    _add_dp_args(parser)


def _add_dp_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data parallel prefill delayer (ticks, not seconds)")
    g.add_argument("--prefill-delayer", default="off", choices=PREFILL_DELAYERS,
                   help="keep the DP ranks' prefills in step: align (SGLang) or coalesce (ATOM)")
    for name, kind, default in (("max-delay-passes", int, 30), ("token-usage-low-watermark", float, None),
                                ("target-fill", float, 0.9), ("kv-high-watermark", float, 0.9),
                                ("kv-low-watermark", float, 0.1), ("ttft-max-ticks", int, 200),
                                ("partial-max-ticks", int, 100), ("stall-ticks", int, 10),
                                ("queue-max-ticks", int, 50)):
        g.add_argument(f"--prefill-delayer-{name}", type=kind, default=default)
    g.add_argument("--dp-lockstep", action="store_true",
                   help="benchmark emulation: every step ends with an all-reduce over the DP ranks (MoE EP)")
    g.add_argument("--dp-collective-timeout-s", type=float, default=60.0,
                   help="a DP collective not done by then fails open and the group is given up")
