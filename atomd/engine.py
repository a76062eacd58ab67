"""LLMEngine: one engine's loop, schedule -> forward -> sample -> postprocess.

`LLMEngine.step()` returns one `RequestOutput` (atomd/messages.py) per request that
changed: new tokens, or the end (finished by a stop, aborted, or ended without generating,
with `error` and `error_code` set). The engine core process runs it (atomd/core.py); the
offline `LLM` drives it in-process (atomd/llm.py).
"""
from __future__ import annotations

import pathlib
import time
from typing import Any

import numpy as np
import torch

from atomd.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig
from atomd.kv_cache import KVCache
from atomd.model.loader import load_model
from atomd.runner import ModelRunner
from atomd.sampler import Sampler
from atomd.tokenizer import Tokenizer
from atomd.messages import RequestOutput
from kv_transfer.connector import KVConnectorConfig
from kv_transfer.factory import create_connector
from kv_transfer.params import KVTransferParams, compat_fingerprint
from kv_transfer.trust import load_secret
from scheduler.prefill_delayer import PrefillDelayer
from scheduler.scheduler import ScheduledBatch, ScheduledBatchOutput, Scheduler, SchedulerConfig
from scheduler.sequence import SamplingParams, Sequence

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_LAYOUT_VERSION = "atomd-kv-1"  # block-major [layers, k|v, block_size, kv_heads, head_dim]


def resolve_model_dir(config: EngineConfig) -> pathlib.Path:
    if config.model is not None:
        return pathlib.Path(config.model)
    from atomd.model.default import default_model_dir

    return default_model_dir()


class LLMEngine:
    def __init__(self, config: EngineConfig, prefill_delayer: PrefillDelayer | None = None):
        """`prefill_delayer`: the DP group's (atomd/core.py builds it), asked every tick."""
        self.config = config
        torch.set_num_threads(config.num_threads_or_all())
        model_dir = resolve_model_dir(config)
        self.model_name = config.model or "atomd-default"
        self.model = load_model(model_dir, DTYPES[config.dtype], max_positions=config.max_model_len)
        mcfg = self.model.config
        if mcfg.sliding_window is not None and mcfg.sliding_window < config.max_model_len:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's sliding_window="
                             f"{mcfg.sliding_window}, which this engine does not implement; lower --max-model-len")
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.kv_cache = KVCache(self._num_blocks(), mcfg.num_layers, config.block_size, mcfg.num_kv_heads,
                                mcfg.head_dim, self.model.dtype)
        self.runner = ModelRunner(self.model, self.kv_cache, config.attention_backend)
        self.sampler = Sampler(config.seed)
        self.kv_connector = self._make_connector()
        eos = self.tokenizer.eos_token_id
        if eos is None and isinstance(mcfg.eos_token_id, int):
            eos = mcfg.eos_token_id
        self._end_token_ids = [t for t in [eos, *self.tokenizer.stop_token_ids] if t is not None]
        self.scheduler = Scheduler(SchedulerConfig(
            num_kvcache_blocks=self.kv_cache.num_blocks, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.max_model_len,
            block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching,
            enable_chunked_prefill=config.enable_chunked_prefill, eos_token_id=eos,
            stop_token_ids=self.tokenizer.stop_token_ids,
            scheduler_delay_factor=config.scheduler_delay_factor,
            long_prefill_token_threshold=config.long_prefill_token_threshold),
            kv_connector=self.kv_connector, prefill_delayer=prefill_delayer, detokenize=self.tokenizer.decode)
        self._requests: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []  # surfaced as finished outputs by the next step()

    def _make_connector(self):
        """The PD connector of a producer or consumer (None when colocated): both halves in one."""
        cfg, mcfg = self.config, self.model.config
        self.compat = compat_fingerprint(self.model_name, cfg.dtype, cfg.block_size, mcfg.num_layers,
                                         mcfg.num_kv_heads, mcfg.head_dim, KV_LAYOUT_VERSION)
        if cfg.kv_role == "both":
            return None
        port = cfg.kv_side_channel_port + cfg.data_parallel_rank if cfg.kv_side_channel_port else 0
        scheduler_side, worker_side = create_connector(cfg.kv_transfer_backend, cfg.kv_role, KVConnectorConfig(
            block_size=cfg.block_size, compat=self.compat, side_channel_host=cfg.kv_side_channel_host,
            side_channel_port=port, lease_s=cfg.kv_lease_s, recv_timeout_s=cfg.kv_recv_timeout_s,
            load_failure_policy=cfg.kv_load_failure_policy, dp_rank=cfg.data_parallel_rank,
            params_secret=load_secret(path=cfg.kv_params_secret_file), trusted_producers=cfg.trusted_producers()))
        worker_side.register_kv_caches(self.kv_cache.as_numpy_blocks())
        return scheduler_side

    def _num_blocks(self) -> int:
        cfg, mcfg = self.config, self.model.config
        if cfg.num_kvcache_blocks is not None:
            return cfg.num_kvcache_blocks
        per_block = KVCache.bytes_per_block(mcfg.num_layers, cfg.block_size, mcfg.num_kv_heads,
                                            mcfg.head_dim, self.model.dtype)
        memory = cfg.kv_cache_memory if cfg.kv_cache_memory is not None else DEFAULT_KV_CACHE_MEMORY
        blocks = memory // per_block
        if cfg.kv_cache_memory is None:  # more than every sequence at full length is never used
            blocks = min(blocks, cfg.max_num_seqs * -(-cfg.max_model_len // cfg.block_size))
        if blocks < 1:
            raise ValueError(f"kv_cache_memory={memory} bytes holds no KV block of {per_block} bytes")
        return int(blocks)

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                    kv_transfer_params: KVTransferParams | dict | None = None,
                    arrival_time: float | None = None) -> Sequence:
        """ValueError (the API's 400) for a duplicate id, a token outside the vocabulary, or
        kv_transfer_params that do not parse or do not fit this prompt."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        vocab = self.model.config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= int(t) < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {vocab})")
        seq = Sequence(list(prompt_token_ids), sampling_params, request_id=request_id,
                       arrive_time=arrival_time, kv_transfer_params=kv_transfer_params)
        if self.kv_connector is not None:  # ValueError: kv_transfer_params do not fit this prompt
            self.kv_connector.request_added(seq)
        self.scheduler.add(seq)
        self._requests[request_id] = seq
        return seq

    def abort_request(self, request_id: str) -> bool:
        seq = self._requests.get(request_id)
        if seq is None or self.scheduler.abort(seq.id) is None:
            return False
        self._aborted.append(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or not self.scheduler.is_finished()

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        outputs = [self._output(seq, [], None, True) for seq in self._aborted]
        self._aborted = []
        batch = self.scheduler.schedule()
        if batch is not None and self.kv_connector is not None:
            self.kv_connector.start_load_kv(batch.connector_meta)  # an empty batch may carry a pull
        if batch is not None and batch.seqs:
            for update in self.scheduler.postprocess(batch, self._forward(batch)):
                outputs.append(self._output(update.seq, update.new_token_ids, update.new_logprobs,
                                            update.finished))
        if self.kv_connector is not None:  # pulls landed, blocks released: before take_rejected
            self.scheduler.update_from_kv_connector_output(self.kv_connector.get_finished())
        outputs.extend(self._output(seq, [], None, True) for seq in self.scheduler.take_rejected())
        return outputs

    def _forward(self, batch: ScheduledBatch) -> ScheduledBatchOutput:
        logits = self.runner.execute(batch)
        rows = np.flatnonzero(batch.needs_sample).tolist()
        token_ids: list[list[int]] = [[] for _ in batch.seqs]
        logprobs: list[list[Any]] | None = None
        if rows:
            seqs = [batch.seqs[i] for i in rows]
            tokens, entries = self.sampler.sample(logits, [s.sampling_params for s in seqs], [s.id for s in seqs],
                                                  [self._banned(s) for s in seqs])
            for j, i in enumerate(rows):
                token_ids[i] = [tokens[j]]
            if entries is not None:
                logprobs = [[] for _ in batch.seqs]
                for j, i in enumerate(rows):
                    logprobs[i] = [entries[j]]
        return ScheduledBatchOutput(batch.seq_ids, token_ids, logprobs)

    def _banned(self, seq: Sequence) -> list[int]:
        """End tokens may not be sampled before min_tokens (vLLM masks them too)."""
        sp = seq.sampling_params
        if seq.num_completion_tokens >= sp.min_tokens:
            return []
        return list(sp.stop_token_ids) + ([] if sp.ignore_eos else self._end_token_ids)

    def _output(self, seq: Sequence, new_token_ids: list[int], new_logprobs: list | None,
                finished: bool) -> RequestOutput:
        if finished:
            self._requests.pop(seq.request_id, None)
            self.sampler.forget(seq.id)
        if not finished:
            return RequestOutput(seq.request_id, list(new_token_ids), new_logprobs, False, None,
                                 seq.num_prompt_tokens, seq.num_cached_tokens)
        return RequestOutput(
            seq.request_id, list(new_token_ids), new_logprobs, True, seq.finish_reason, seq.num_prompt_tokens,
            seq.num_cached_tokens, kv_transfer_params=seq.kv_transfer_params_output, error=seq.error,
            error_code=seq.error_code,
            timing=(seq.arrive_time, seq.first_scheduled_time, seq.first_token_time, time.time()))

    # ------------------------------------------------------------------ utilities

    def stats(self) -> dict[str, Any]:
        s = self.scheduler
        running, waiting = s.get_request_counts()
        bm = s.block_manager
        return {"num_running": running, "num_waiting": waiting, "num_free_blocks": bm.num_free_blocks,
                "num_total_blocks": bm.num_total_blocks, "kv_cache_usage": bm.usage,
                "prefix_cache_queries": s.cache_stats.queries, "prefix_cache_hits": s.cache_stats.hits,
                "num_preemptions": s.num_preemptions,
                "kv_transfer": self.kv_connector.stats() if self.kv_connector is not None else None}

    def only_serving_kv(self) -> bool:
        """Nothing to compute or pull: only blocks pinned for a consumer are pending, so the
        core may poll for their release less often than it steps a decode."""
        s = self.scheduler
        return not (s.running or s.waiting or self._aborted) and not s.parked

    def kv_transfer_info(self) -> dict[str, Any]:
        """Role, side channel, DP size and compat fingerprint (GET /kv_transfer_info)."""
        cfg = self.config
        info = {"role": cfg.kv_role, "side_channel": None, "engine_id": None, "compat": self.compat,
                "dp_rank": cfg.data_parallel_rank}
        if self.kv_connector is not None:
            info.update(self.kv_connector.info())
        return dict(info, dp_size=cfg.data_parallel_size, backend=cfg.kv_transfer_backend)

    def kv_transfer_abort(self, transfer_id: str) -> bool:
        """The router gave up a transfer D never pulled: free P's pinned blocks now."""
        return self.kv_connector is not None and self.kv_connector.revoke(transfer_id)

    def close(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.close()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()
