"""EngineConfig: every engine knob in one place, with vLLM's flag names and defaults.

Built from CLI flags (`add_engine_args` + `EngineConfig.from_args`) or from keyword
arguments (`LLM(**engine_args)`); a bad value is a ValueError naming the field.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import typing
from typing import Any

import msgspec

from atomd.kernels import cbuild
from atomd.model import hub
from kv_transfer.trust import SECRET_ENV

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")  # what an engine runs
DTYPE_CHOICES = (*DTYPES, "auto")  # what may be asked for: auto is resolved by EngineConfig (auto_dtype)
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs with fast bf16 dot products
KV_ROLES = ("both", "producer", "consumer")
KV_TRANSFER_BACKENDS = ("zmq", "mooncake")  # mooncake: the ZMQ control plane, Mooncake's TransferEngine for the bytes
KV_MOONCAKE_PROTOCOLS = ("tcp", "rdma")
KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")
LORA_LOAD_POLICIES = ("refuse", "load")
PREFILL_DELAYERS = ("off", "align", "coalesce")
ATTENTION_BACKENDS = ("auto", "native", "torch")
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy
QUANTIZATIONS = ("int8", "int4", "bf16", "fp16")  # --quantization: round-to-nearest at load (atomd/model/quant.py)
QUANTIZED_ACTIVATIONS = ("float32", "int8")  # --quantized-activations (atomd/model/quant.py, csrc/quant.h)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16")  # --kv-cache-dtype (atomd/engine/kv_cache.py)
DEFAULT_KV_CACHE_MEMORY = 256 << 20  # bytes; the pool never grows past max_num_seqs full contexts
SPECULATIVE_METHODS = ("ngram", "mtp")
MODEL_RUNNERS = ("real", "simulated")  # simulated: atomd/sim/engine.py
TP_COMMUNICATORS = ("shm", "gloo")  # atomd/engine/tp_collective.py's (which imports torch: not here)
TP_KV_TRANSFERS = ("staging", "direct")  # a TP engine's blocks on the PD wire (atomd/engine/tp_pd.py)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class EngineConfig(msgspec.Struct, kw_only=True):
    model: str | None = None  # None: the built-in default model (atomd.model.default)
    dtype: str = "float32"
    seed: int = 0
    num_threads: int | None = None  # None: all cores (torch's own default)
    # attention: native = the C kernels (atomd/kernels/native.py), torch = SDPA; auto: native for
    # float32 and bfloat16 where they build, else torch
    attention_backend: str = "auto"
    # weight-only int8 (per channel) / int4 (per group) linears quantised at load from a float
    # checkpoint; None: the checkpoint's own weights (a GPTQ / AWQ / compressed-tensors one loads as packed)
    quantization: str | None = None
    # the activations of the quantized linears' small-M matmuls: int8 = quantised per block of 32
    # with integer dot products (VNNI where the CPU has it), float32 = as they are
    quantized_activations: str = "float32"
    # the paged KV cache's values: auto = the model's dtype; fp8 (= fp8_e4m3) / fp8_e5m2: one byte each,
    # per-tensor scale 1.0; bfloat16 / float16: two bytes each under a float32 model (atomd/engine/kv_cache.py)
    kv_cache_dtype: str = "auto"
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    # SGLang's --enable-mixed-chunk: the running streams' decode tokens ride in every prefill step
    # (scheduler/scheduler.py); off: the seed's prefill-only or decode-only steps
    enable_mixed_chunk: bool = False
    max_local_prefill_tokens_per_step: int = 0
    max_local_prefill_ms_per_step: float = 0.0
    scheduler_delay_factor: float = 0.0
    # fcfs: arrival order, the newest running sequence preempted first; priority: requests'
    # `priority` (lower first, as vLLM), then arrival, for admission and preemption
    scheduling_policy: str = "fcfs"
    kv_cache_memory: int | None = None  # bytes; ignored when num_kvcache_blocks is set
    num_kvcache_blocks: int | None = None
    kv_role: str = "both"
    kv_transfer_backend: str = "zmq"
    # kv_transfer_backend mooncake: its transport, and for rdma the device(s), e.g. mlx5_0 (default: all found)
    kv_mooncake_protocol: str = "tcp"
    kv_mooncake_device: str | None = None
    # PD (kv_role producer / consumer): the side channel P binds (port 0: any; DP rank r: port + r)
    kv_side_channel_host: str = "127.0.0.1"
    kv_side_channel_port: int = 0
    kv_lease_s: float = 30.0  # P holds a finished prompt's blocks this long without a heartbeat
    kv_recv_timeout_s: float = 10.0  # D gives up a pull after P is silent this long
    kv_load_failure_policy: str = "fail"  # D after a failed pull: error out, or prefill locally
    # D's trust in producers (kv_transfer/trust.py): params signed with this secret, and/or
    # producers at these hosts / networks; neither: loopback producers only
    kv_params_secret_file: str | None = None  # else $ATOMD_KV_PARAMS_SECRET
    kv_trusted_producers: str | None = None  # comma-separated, e.g. "10.0.0.0/8,prefill-0.svc"
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # KV events (atomd/engine/kv_events.py, vLLM's wire): PUB endpoint, replay ROUTER endpoint (DP rank r: port + r)
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_buffer_steps: int = 10_000
    # data parallelism (atomd/engine/core.py): the PrefillDelayer's policy and knobs
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
    # an aligned tick's prompt-token budget, split between the ranks that prefill in it (0: off,
    # each rank its own max_num_batched_tokens); chunked prefill only (scheduler/prefill_delayer.py)
    prefill_delayer_aligned_tokens: int = 0
    dp_lockstep: bool = False
    # MoE models: the DP ranks share the experts, each holds 1/N (atomd/model/expert_parallel.py)
    enable_expert_parallel: bool = False
    # its load balancer (vLLM's EPLB flags): num_redundant_experts replica slots per sparse layer over
    # the ranks, refilled with the hottest experts every eplb_step_interval steps
    enable_eplb: bool = False
    num_redundant_experts: int = 0
    eplb_step_interval: int = 3000
    dp_collective_timeout_s: float = 60.0
    # the ranks' gloo group: rank 0's address and port (port unset: the API process picks one on
    # loopback); a group over hosts runs data_parallel_size_local ranks from data_parallel_start_rank
    # on each host (vLLM's flags), every host with the same address and port
    data_parallel_address: str = "127.0.0.1"
    dp_master_port: int | None = None
    data_parallel_size_local: int | None = None  # None: all of them, here
    data_parallel_start_rank: int = 0
    # tensor parallelism (atomd/engine/tp_workers.py): the engine core drives N - 1 worker processes,
    # each holding 1/N of every layer's heads and MLP rows; their collectives over shm or gloo
    tensor_parallel_size: int = 1
    tp_communicator: str = "shm"
    tp_collective_timeout_s: float = 5.0
    # PD of a TP engine: staging (a TP=1-layout copy, pairs with any TP size) or direct (each worker's
    # slice on the wire, no copy: the peer must be a direct engine of the same TP size)
    tp_kv_transfer: str = "staging"
    # speculative decoding, vLLM's JSON shape: '{"method": "ngram", "num_speculative_tokens": 4,
    # "prompt_lookup_min": 2, "prompt_lookup_max": 5}' (atomd/engine/spec_decode.py); None: off
    speculative_config: str | None = None
    # LoRA adapters (atomd/model/lora.py, atomd/engine/lora_registry.py): PEFT directories as name=path,
    # chosen per request by `model`; at most max_loras resident, each of rank <= max_lora_rank
    enable_lora: bool = False
    lora_modules: list[str] = []
    max_loras: int = 4
    max_lora_rank: int = 16
    # a request (or a KV pull) naming an adapter this engine has not loaded: a 404 (refuse), or
    # load it first (load) when lora_path_map names its directory (atomd/api/lora_routes.py)
    lora_load_policy: str = "refuse"
    lora_path_map: list[str] = []
    # simulated engines (atomd/sim/): the forward sleeps the hardware profile's step time
    model_runner: str = "real"
    hardware: str | None = None  # a profile file, or ACCELERATOR:MODEL (atomd/sim/hardware.py)
    kv_link: str | None = None  # the simulated KV link (nvlink, rdma400, tcp, loopback); None: the profile's

    def __post_init__(self) -> None:
        _choice("dtype", self.dtype, DTYPE_CHOICES)
        if self.dtype == "auto":  # resolved once, here: the engine, the KV compat fingerprint see the result
            self.dtype, reason = auto_dtype()
            log.info("dtype auto: %s (%s)", self.dtype, reason)
            if self.dtype == "float32" and self.quantization is None and self.model_runner == "real":
                self.quantization, reason = auto_weights(self.model)
                log.info("dtype auto: weights %s (%s)", self.quantization or "as the checkpoint's", reason)
        _choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        if self.quantization is not None:
            _choice("quantization", self.quantization, QUANTIZATIONS)
        _choice("quantized_activations", self.quantized_activations, QUANTIZED_ACTIVATIONS)
        if self.attention_backend == "native" and self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"attention_backend native runs float32 and bfloat16, got dtype {self.dtype!r}")
        _choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.kv_cache_dtype != "auto" and self.model_runner != "real":
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype} needs model_runner real (a hardware profile's "
                             f"KV bytes per token are the model dtype's)")
        _choice("kv_role", self.kv_role, KV_ROLES)
        _choice("kv_transfer_backend", self.kv_transfer_backend, KV_TRANSFER_BACKENDS)
        _choice("kv_mooncake_protocol", self.kv_mooncake_protocol, KV_MOONCAKE_PROTOCOLS)
        if self.kv_transfer_backend != "mooncake" and (self.kv_mooncake_protocol != "tcp" or self.kv_mooncake_device):
            raise ValueError("kv_mooncake_protocol and kv_mooncake_device apply only with kv_transfer_backend mooncake")
        if self.kv_mooncake_device and self.kv_mooncake_protocol != "rdma":
            raise ValueError(f"kv_mooncake_device needs kv_mooncake_protocol rdma, got {self.kv_mooncake_protocol!r}")
        if self.kv_transfer_backend == "mooncake" and self.kv_role != "both":
            from kv_transfer.mooncake_transport import MooncakeUnavailable, load_transfer_engine
            try:  # at start-up, in the API process: not after the model loaded in the engine core
                load_transfer_engine()
            except MooncakeUnavailable as e:
                raise ValueError(str(e)) from None
        _choice("kv_load_failure_policy", self.kv_load_failure_policy, KV_LOAD_FAILURE_POLICIES)
        self._check_lora()
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
        for name in ("long_prefill_token_threshold", "max_local_prefill_tokens_per_step",
                     "max_local_prefill_ms_per_step", "scheduler_delay_factor",
                     "data_parallel_rank", "prefill_delayer_aligned_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.prefill_delayer_aligned_tokens and self.prefill_delayer == "off":
            raise ValueError("prefill_delayer_aligned_tokens splits the ticks the delayer aligns: it needs "
                             "prefill_delayer align or coalesce")
        if self.prefill_delayer_aligned_tokens and not self.enable_chunked_prefill:
            raise ValueError("prefill_delayer_aligned_tokens needs enable_chunked_prefill (a prompt longer than "
                             "its rank's share of an aligned tick goes in chunks)")
        for name in ("prefill_delayer_target_fill", "prefill_delayer_kv_high_watermark",
                     "prefill_delayer_kv_low_watermark", "prefill_delayer_token_usage_low_watermark"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if self.kv_events_buffer_steps < 1:
            raise ValueError(f"kv_events_buffer_steps must be >= 1, got {self.kv_events_buffer_steps}")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"{name} must be a ZMQ endpoint like tcp://*:5557, got {value!r}")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        if self.dp_collective_timeout_s <= 0:
            raise ValueError(f"dp_collective_timeout_s must be > 0, got {self.dp_collective_timeout_s}")
        if self.data_parallel_rank >= self.data_parallel_size:
            raise ValueError(f"data_parallel_rank must be < data_parallel_size={self.data_parallel_size}, "
                             f"got {self.data_parallel_rank}")
        self._check_dp_hosts()
        if self.kv_params_secret_file is not None and not os.path.isfile(self.kv_params_secret_file):
            raise ValueError(f"kv_params_secret_file {self.kv_params_secret_file!r} is not a file")
        if self.model is not None:
            hub.model_path(self.model)  # a directory, or a hub id in the local cache: ValueError if neither
        self._check_simulated()
        self._check_tensor_parallel()
        self._check_eplb()
        if self.enable_expert_parallel and self.data_parallel_size > 1 and self.model_runner == "real":
            self._check_expert_split()
        spec = self.speculative()
        if spec is not None and self.enable_mixed_chunk:
            raise ValueError("enable_mixed_chunk does not run with speculative_config (a decode row would carry "
                             "drafts to verify inside a prefill step)")
        if spec is not None and spec.num_speculative_tokens + 1 > self.max_num_batched_tokens:
            raise ValueError(f"speculative_config: num_speculative_tokens + 1 = {spec.num_speculative_tokens + 1} "
                             f"> max_num_batched_tokens={self.max_num_batched_tokens}")

    @property
    def local_dp_ranks(self) -> range:
        """The DP ranks this server runs (all of them unless the group spans hosts)."""
        local = self.data_parallel_size if self.data_parallel_size_local is None else self.data_parallel_size_local
        return range(self.data_parallel_start_rank, self.data_parallel_start_rank + local)

    def _check_dp_hosts(self) -> None:
        local, size = self.data_parallel_size_local, self.data_parallel_size
        if local is not None and not 1 <= local <= size:
            raise ValueError(f"data_parallel_size_local must be in [1, data_parallel_size={size}], got {local}")
        if not 0 <= self.data_parallel_start_rank or self.local_dp_ranks.stop > size:
            raise ValueError(f"data_parallel_start_rank={self.data_parallel_start_rank} + data_parallel_size_local="
                             f"{len(self.local_dp_ranks)} must be <= data_parallel_size={size}")
        if self.dp_master_port is not None and not 1 <= self.dp_master_port <= 65535:
            raise ValueError(f"dp_master_port must be in [1, 65535], got {self.dp_master_port}")
        if not self.data_parallel_address or len(self.data_parallel_address) > 253:
            raise ValueError(f"data_parallel_address must be a host name or address, got "
                             f"{self.data_parallel_address!r}")
        if len(self.local_dp_ranks) < size and self.dp_master_port is None:
            raise ValueError("a DP group over hosts (data_parallel_size_local < data_parallel_size) needs "
                             "dp_master_port: every host joins rank 0's group at data_parallel_address:dp_master_port")

    def _check_eplb(self) -> None:
        if self.num_redundant_experts < 0 or self.eplb_step_interval < 1:
            raise ValueError(f"num_redundant_experts must be >= 0 and eplb_step_interval >= 1, got "
                             f"{self.num_redundant_experts} and {self.eplb_step_interval}")
        if self.num_redundant_experts and not self.enable_eplb:
            raise ValueError("num_redundant_experts needs enable_eplb (the replicas follow the load)")
        if not self.enable_eplb:
            return
        if not (self.enable_expert_parallel and self.data_parallel_size > 1):
            raise ValueError("enable_eplb balances expert parallelism: it needs enable_expert_parallel and "
                             "data_parallel_size > 1")
        n = self.data_parallel_size
        if self.num_redundant_experts < n or self.num_redundant_experts % n:
            raise ValueError(f"enable_eplb: num_redundant_experts={self.num_redundant_experts} must be a positive "
                             f"multiple of data_parallel_size={n} (each rank holds the same number of replicas; "
                             f"the experts each rank owns stay where they are)")

    def _check_expert_split(self) -> None:
        """At start-up, in the API process: the model has experts that split evenly over the ranks
        (the loader checks it again in each rank; from there the message reaches the log only)."""
        from atomd.model.default import default_model_dir

        path = hub.model_path(self.model) if self.model is not None else default_model_dir()
        try:
            hf = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            return  # the loader names what is wrong with the checkpoint
        # Qwen3-MoE, Mixtral, DeepSeek's names
        experts = hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts") or 0
        if not experts:
            raise ValueError(f"enable_expert_parallel needs an MoE model; {self.model or 'the built-in model'} "
                             f"has no experts")
        if experts % self.data_parallel_size:
            raise ValueError(f"enable_expert_parallel: {experts} experts do not split evenly over "
                             f"data_parallel_size={self.data_parallel_size} ranks")
        replicas, others = self.num_redundant_experts // self.data_parallel_size, \
            experts - experts // self.data_parallel_size
        if self.enable_eplb and replicas > others:
            raise ValueError(f"enable_eplb: {replicas} replica slots a rank but only {others} experts it does not "
                             f"own (num_redundant_experts={self.num_redundant_experts})")

    def _check_tensor_parallel(self) -> None:
        """At start-up, in the API process: N splits the model's heads and MLP (atomd/model/tp_split.py)."""
        from atomd.model.tp_split import check_hf_config

        _choice("tp_communicator", self.tp_communicator, TP_COMMUNICATORS)
        _choice("tp_kv_transfer", self.tp_kv_transfer, TP_KV_TRANSFERS)
        if not self.tp_collective_timeout_s > 0:
            raise ValueError(f"tp_collective_timeout_s must be > 0, got {self.tp_collective_timeout_s}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size == 1 or self.model_runner != "real":
            return
        from atomd.model.default import default_model_dir

        path = hub.model_path(self.model) if self.model is not None else default_model_dir()
        try:
            hf = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            return  # the loader names what is wrong with the checkpoint
        check_hf_config(hf, self.tensor_parallel_size, self.model or "the built-in model")

    def _check_simulated(self) -> None:
        _choice("model_runner", self.model_runner, MODEL_RUNNERS)
        if self.model_runner == "real":
            if self.hardware is not None or self.kv_link is not None:
                raise ValueError("hardware and kv_link apply only with model_runner simulated")
            return
        from atomd.sim.hardware import load_profile, resolve_link

        if self.hardware is None:
            raise ValueError("model_runner simulated needs hardware: a profile file (atomd profile) or "
                             "ACCELERATOR:MODEL, e.g. h100:llama3-8b")
        load_profile(self.hardware)  # ValueError naming what is wrong, in the API process
        if self.kv_link is not None:
            resolve_link(self.kv_link)
        for name in ("speculative_config", "dp_lockstep", "enable_expert_parallel"):
            if getattr(self, name):
                raise ValueError(f"{name} is not simulated (model_runner simulated)")

    def _check_lora(self) -> None:
        from contracts.lora import parse_lora_modules

        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora (--enable-lora)")
        _choice("lora_load_policy", self.lora_load_policy, LORA_LOAD_POLICIES)
        if self.lora_path_map and not (self.enable_lora and self.lora_load_policy == "load"):
            raise ValueError("lora_path_map needs enable_lora and lora_load_policy load")
        parse_lora_modules(self.lora_path_map, "lora_path_map")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras}, {self.max_lora_rank}")
        parse_lora_modules(self.lora_modules)  # more than max_loras is fine: the rest wait in a slot's turn

    def lora_adapters(self) -> list[tuple[str, str]]:
        """--lora-modules as (name, path) pairs."""
        from contracts.lora import parse_lora_modules

        return parse_lora_modules(self.lora_modules)

    def speculative(self) -> "SpeculativeConfig | None":
        """The parsed speculative_config (ValueError naming the bad key), or None when off."""
        return None if self.speculative_config is None else SpeculativeConfig.parse(self.speculative_config)

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
        if isinstance(kwargs.get("speculative_config"), dict):  # LLM(speculative_config={...}), as vLLM
            kwargs["speculative_config"] = json.dumps(kwargs["speculative_config"])
        return cls(**kwargs)

    def check_model_dir(self) -> None:
        """ValueError unless --model holds a checkpoint; checked where the model is about to load
        (serve, generate), so a bad directory is one line there instead of the engine core's trace."""
        if self.model is not None and not (hub.model_path(self.model) / "config.json").is_file():
            raise ValueError(f"model directory {self.model!r} has no config.json: give --model a Hugging Face "
                             f"checkpoint directory (config.json, tokenizer.json, *.safetensors) or a .gguf file")

    def trusted_producers(self) -> list[str]:
        return [h.strip() for h in (self.kv_trusted_producers or "").split(",") if h.strip()]

    def num_threads_or_all(self) -> int:
        return self.num_threads or os.cpu_count() or 1


class SpeculativeConfig(msgspec.Struct, frozen=True):
    """`speculative_config`, parsed (vLLM's keys and defaults). ngram (prompt lookup): up to
    `num_speculative_tokens` drafts copied from the tokens that followed the latest earlier
    occurrence of the sequence's last n tokens, n from prompt_lookup_max down to
    prompt_lookup_min (one missing: the other; both: 5). mtp: DeepSeek V3's MTP layer drafts
    one token, chained on its own output for each further one (atomd/engine/mtp_proposer.py);
    the prompt_lookup keys are not read."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int

    @classmethod
    def parse(cls, text: str) -> "SpeculativeConfig":
        try:
            raw = json.loads(text)
        except ValueError:
            raw = None
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {text!r}")
        known = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
        for key in raw:
            if key not in known:
                raise ValueError(f"speculative_config: unknown key {key!r} (known: {', '.join(known)})")
        for key in known[:2]:
            if key not in raw:
                raise ValueError(f"speculative_config: {key!r} is required")
        if raw["method"] not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {raw['method']!r}")
        for key in known[1:]:
            value = raw.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"speculative_config: {key} must be an integer >= 1, got {value!r}")
        low, high = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        low, high = (low or high or 5), (high or low or 5)
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min={low} > prompt_lookup_max={high}")
        return cls(raw["method"], raw["num_speculative_tokens"], low, high)


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo's `flags`; empty where there is none), less
    those $ATOMD_KERNEL_ISA hides (atomd.kernels.cbuild.narrow_flags). Tests monkeypatch it to be
    another CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return cbuild.narrow_flags(set(line.partition(":")[2].split()))
    except OSError:
        pass
    return set()


def auto_dtype() -> tuple[str, str]:
    """`--dtype auto`: bfloat16 where the CPU has bf16 dot products (AVX512_BF16 or AMX-BF16),
    float32 elsewhere (bf16 is 3-5x slower than float32 on AVX2-only CPUs); and why."""
    have = sorted(set(BF16_CPU_FLAGS) & cpu_flags())
    if have:
        return "bfloat16", f"the CPU has {' and '.join(have)}"
    return "float32", f"the CPU has none of {', '.join(BF16_CPU_FLAGS)}"


def auto_weights(model: str | None) -> tuple[str | None, str]:
    """`--dtype auto` where it chose float32 compute: the weights read as 16 bits, widened to
    float32 in registers (`--quantization bf16`; fp16 for a float16 checkpoint, which bf16 would
    round), halving decode's bytes as llama.cpp's BF16 / F16 do on such CPUs; None (as stored)
    for a checkpoint already quantized or a GGUF file; and why."""
    try:
        hf = hub.read_hf_config(hub.model_path(model) if model is not None else _default_checkpoint())
    except (OSError, ValueError) as e:  # a bad --model is reported where the model loads
        return None, f"the checkpoint's config could not be read: {e}"
    if hf.get("gguf_file"):
        return None, "a GGUF file keeps its own tensor types"
    if "quantization_config" in hf:
        return None, "the checkpoint is already quantized"
    stored = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    if stored == "float16":  # bf16 would round them
        return "fp16", "float16 weights read as float16 and widened to float32 in registers: half the bytes a " \
                       "decoded token reads"
    return "bf16", (f"{stored} weights read as bf16 and widened to float32 in registers: half the bytes a "
                    f"decoded token reads")


def _default_checkpoint():
    from atomd.model import default

    return default.PACKAGED_CHECKPOINT


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


# `atomd serve` / `atomd generate` flags: one per EngineConfig field (its name with dashes,
# its default), so every default is written once, on the field. What a flag needs beyond
# that is keyed by field here.
CHOICES = {"dtype": DTYPE_CHOICES, "tp_communicator": TP_COMMUNICATORS, "tp_kv_transfer": TP_KV_TRANSFERS, "attention_backend": ATTENTION_BACKENDS, "kv_role": KV_ROLES,
           "quantization": QUANTIZATIONS, "quantized_activations": QUANTIZED_ACTIVATIONS,
           "kv_cache_dtype": KV_CACHE_DTYPES,
           "kv_transfer_backend": KV_TRANSFER_BACKENDS, "kv_load_failure_policy": KV_LOAD_FAILURE_POLICIES,
           "kv_mooncake_protocol": KV_MOONCAKE_PROTOCOLS,
           "prefill_delayer": PREFILL_DELAYERS, "model_runner": MODEL_RUNNERS,
           "scheduling_policy": SCHEDULING_POLICIES, "lora_load_policy": LORA_LOAD_POLICIES}
HELP = {
    "scheduling_policy": "fcfs: first come first served, the newest running request preempted first; priority: "
                         "by the request's `priority` (lower first), then arrival, in admission and preemption",
    "model": "local Hugging Face checkpoint directory, a llama.cpp .gguf file (or a directory holding one), or a "
             "hub id (Qwen/Qwen3-0.6B) in the local Hugging Face cache (HF_HOME; nothing is downloaded) (default: "
             "the built-in default model)",
    "dtype": "weights and KV cache dtype; auto: bfloat16 where the CPU has AVX512_BF16 or AMX-BF16, "
             "else float32 with a float checkpoint's weights read as bf16 (--quantization bf16; logged at start-up)",
    "seed": "seed of unseeded sampling",
    "num_threads": "torch threads of this engine (default: all cores)",
    "attention_backend": "prefill and decode attention: native C kernels (float32 and bfloat16, prebuilt or built at first use), "
                         "torch SDPA, or auto (native where they build)",
    "quantization": "weight-only quantization at load of a float checkpoint, round-to-nearest: int8 (per output "
                    "channel, symmetric) or int4 (groups of 128, else 64 or 32 inputs, with zero points), or bf16 (16-bit "
                    "weights widened to float32 in registers: half float32's bytes on CPUs without AVX512_BF16) or fp16 (the same "
                    "with float16 values: a float16 checkpoint's weights exactly); activations "
                    "stay --dtype. GPTQ, AWQ and compressed-tensors checkpoints and GGUF files load quantized without it",
    "quantized_activations": "int8: the quantized linears' activations quantised to int8 per block of 32 for "
                             "batch 1 to 32 rows (integer dot products, AVX512-VNNI where present; ~0.5%% rms error against "
                             "float32 on a linear's output); float32: as they are",
    "kv_cache_dtype": "the paged KV cache's values: auto (the model's --dtype), or fp8 / fp8_e4m3 / fp8_e5m2: one "
                      "byte a value (scale 1.0, saturating), a quarter of float32's memory and PD bytes, half of "
                      "bfloat16's; or bfloat16 / float16 (float16 saturating at 65504) under a float32 model: half its "
                      "memory and PD bytes, as llama.cpp's default F16 cache; P and D must agree",
    "max_model_len": "prompt + completion tokens",
    "max_num_seqs": "sequences per step",
    "max_num_batched_tokens": "tokens per step",
    "block_size": "tokens per KV block",
    "long_prefill_token_threshold": "largest prefill chunk of one sequence (0: off)",
    "enable_mixed_chunk": "mixed steps (SGLang's): the running streams' decode tokens go into every prefill step, "
                          "ahead of the prompt chunks in the token budget, so a prefill costs them no step (with "
                          "expert parallelism a prefilling rank keeps decoding); off: a step prefills or decodes",
    "max_local_prefill_tokens_per_step": "while decodes run, prompt tokens one prefill step may carry, and a decode "
                                         "step after each such prefill step, so running streams are not stalled for a "
                                         "whole local prompt (e.g. a decode engine prefilling locally; 0: off)",
    "max_local_prefill_ms_per_step": "the same cap in time: while decodes run, a prefill step carries the prompt "
                                     "tokens that fit in this many ms at the engine's measured prefill cost (with "
                                     "the token cap, the smaller; 0: off)",
    "kv_cache_memory": "KV cache size, e.g. 512MiB (default: 256MiB, at most max_num_seqs full contexts)",
    "num_kvcache_blocks": "KV cache size in blocks",
    "kv_role": "PD role: both (colocated), producer (prefill), consumer (decode)",
    "kv_transfer_backend": "how KV blocks move between P and D: zmq, or mooncake (Mooncake's TransferEngine, "
                           "tcp or rdma; needs pip install 'atomd[mooncake]'); P and D must use the same",
    "kv_mooncake_protocol": "kv_transfer_backend mooncake: tcp, or rdma on hosts with an RDMA NIC",
    "kv_mooncake_device": "kv_transfer_backend mooncake with rdma: the RDMA device(s) to use, e.g. mlx5_0 "
                          "(default: every one Mooncake finds)",
    "kv_side_channel_host": "address a producer serves KV on",
    "kv_side_channel_port": "producer's side-channel port (0: any free one; DP rank r uses port + r)",
    "kv_lease_s": "producer: seconds a finished prompt's blocks stay pinned without a heartbeat",
    "kv_recv_timeout_s": "consumer: seconds a pull may see nothing from the producer before it fails",
    "kv_load_failure_policy": "consumer after a failed pull: fail the request, or recompute the prompt locally",
    "kv_params_secret_file": "file holding the secret the router signs kv_transfer_params with; a consumer "
                             f"then pulls only for params signed with it (default: ${SECRET_ENV})",
    "kv_trusted_producers": "comma-separated hosts / networks a consumer may pull KV from (default: loopback "
                            "only, unless a kv_transfer_params secret is set)",
    "kv_events_endpoint": "bind a ZMQ PUB socket here and publish the prefix cache's KV events, vLLM's wire "
                          "format (e.g. tcp://*:5557; DP rank r binds port + r); the kv_aware router follows them",
    "kv_events_replay_endpoint": "bind a ZMQ ROUTER socket here that replays buffered KV event batches from a "
                                 "sequence number (e.g. tcp://*:5558; DP rank r binds port + r)",
    "kv_events_topic": "topic frame of every KV events message",
    "kv_events_buffer_steps": "KV event batches (engine steps) kept for replay",
    "prefill_delayer": "keep the DP ranks' prefills in step: align (SGLang) or coalesce (ATOM)",
    "prefill_delayer_aligned_tokens": "a tick in which k >= 2 DP ranks prefill together carries at most this "
                                      "many prompt tokens, N / k a rank (what a rank cannot fit goes on at that "
                                      "share in its next ticks), so an aligned tick costs about one budget's "
                                      "prefill, not every rank's held queue; a rank released alone (max delay, "
                                      "the valve) goes on at N / ranks (0: off; needs --prefill-delayer "
                                      "and chunked prefill)",
    "dp_lockstep": "benchmark emulation: every step ends with an all-reduce over the DP ranks (MoE EP)",
    "enable_expert_parallel": "MoE models: each DP rank holds 1/N of every sparse layer's experts and the "
                              "ranks exchange tokens per layer (all-to-all), stepping in lockstep",
    "enable_eplb": "expert parallelism's load balancer: replicas of the hottest experts on the least loaded "
                   "ranks, moved every --eplb-step-interval steps by the load the ranks saw",
    "num_redundant_experts": "with --enable-eplb: replica slots per sparse layer, over all ranks (a multiple "
                             "of --data-parallel-size)",
    "eplb_step_interval": "with --enable-eplb: engine steps between rebalances (the load counted since the last)",
    "data_parallel_address": "rank 0's address: the DP ranks' gloo group meets there (every host of a group "
                             "over hosts gives the same one)",
    "dp_master_port": "the DP ranks' gloo group port on --data-parallel-address (default: a free loopback port; "
                      "needed when the ranks span hosts)",
    "data_parallel_size_local": "DP ranks this server runs (default: all); the others run on other hosts, each "
                                "server with its own --data-parallel-start-rank",
    "data_parallel_start_rank": "the first DP rank this server runs (a group over hosts)",
    "dp_collective_timeout_s": "a DP collective not done by then fails open and the group is given up "
                               "(expert parallel: the engine fails, its requests error)",
    "model_runner": "real: run the model; simulated: the real scheduler, KV cache accounting, connector and "
                    "server around a forward that sleeps --hardware's predicted step time and makes "
                    "deterministic tokens (--model gives the tokenizer and vocabulary only)",
    "hardware": "model_runner simulated: a profile file (atomd profile writes one) or ACCELERATOR:MODEL "
                "(h100, h200, mi300x : llama3-8b, qwen3-30b-a3b)",
    "kv_link": "model_runner simulated: the KV link a pull is timed on (nvlink, rdma400, tcp, loopback; "
               "default: the profile's)",
    "enable_lora": "serve LoRA adapters on the base model: --lora-modules at start, POST /v1/load_lora_adapter at "
                   "run time; a request picks one by its model name",
    "lora_modules": "LoRA adapters to load at start: name=path (a PEFT adapter directory) ...",
    "max_loras": "LoRA adapters resident at once; loading another evicts the least recently used one no "
                 "request holds",
    "max_lora_rank": "the largest LoRA rank an adapter may have",
    "lora_load_policy": "a request (or a KV pull) naming an adapter not loaded here: refuse (404), or load it "
                        "first from --lora-path-map",
    "lora_path_map": "LoRA adapters this engine may load when a request names one (--lora-load-policy load): "
                     "name=path ...",
    "tensor_parallel_size": "tensor parallelism: worker processes of this engine (the engine core and N - 1 it "
                            "starts), each with 1/N of every layer's attention heads (KV heads replicated where N "
                            "exceeds them), MLP rows and vocabulary; N must divide the heads",
    "tp_communicator": "tensor parallelism's collectives: shm (shared memory, one host) or gloo",
    "tp_kv_transfer": "PD of a TP engine: staging (a TP=1-layout copy of the blocks, pairs with any TP size) or "
                      "direct (each worker's slice sent and received in place, no copy; the peer's workers hold as "
                      "many KV heads: the same TP size, TP sizes at least the KV heads, or MLA)",
    "tp_collective_timeout_s": "a TP collective not done by then (a worker died or hangs) fails the engine: "
                               "/health 503, its requests error",
    "speculative_config": "speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5}'",
}
_SIZE_FIELDS = ("kv_cache_memory", "num_kvcache_blocks")  # one or the other
_DP_FIELDS = ("dp_lockstep", "enable_expert_parallel", "enable_eplb", "num_redundant_experts", "eplb_step_interval",
              "dp_collective_timeout_s", "data_parallel_address", "dp_master_port", "data_parallel_size_local",
              "data_parallel_start_rank")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (vLLM names), shared by `atomd serve` and `atomd generate`."""
    engine = parser.add_argument_group("engine")
    delayer = parser.add_argument_group("data parallel prefill delayer (ticks, not seconds)")
    size = engine.add_mutually_exclusive_group()
    hints = typing.get_type_hints(EngineConfig)
    for field, default in zip(EngineConfig.__struct_fields__, EngineConfig.__struct_defaults__):
        group = delayer if field.startswith("prefill_delayer") or field in _DP_FIELDS else \
            size if field in _SIZE_FIELDS else engine
        flag = "--" + field.replace("_", "-")
        kw: dict[str, Any] = {"default": default, "help": HELP.get(field)}
        kind = next(t for t in typing.get_args(hints[field]) or (hints[field],) if t is not type(None))
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction if default else "store_true"
        elif field == "kv_cache_memory":
            kw["type"] = _bytes_arg
        elif field in ("lora_modules", "lora_path_map"):  # the default is a msgspec factory: the flag's a list
            # extend: `--lora-modules a=x b=y` and `--lora-modules a=x --lora-modules b=y` (the chart) alike
            kw.update(nargs="+", action="extend", type=str, metavar="NAME=PATH", default=[])
        else:
            kw["type"] = kind
            if field in CHOICES:
                kw["choices"] = CHOICES[field]
        group.add_argument(flag, **kw)
