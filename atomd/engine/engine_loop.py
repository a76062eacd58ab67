"""EngineLoop: the torch-free half of an engine: requests in, the step loop, outputs out.

`EngineLoop.step()` returns one `RequestOutput` (atomd/messages.py) per request choice that
changed: new tokens, or the end (finished by a stop, aborted, or ended without generating,
with `error` and `error_code` set). A subclass supplies the forward, `_forward(batch) ->
ScheduledBatchOutput`: `LLMEngine` (atomd/engine/llm_engine.py) runs the model, `SimulatedEngine`
(atomd/sim/engine.py) sleeps a predicted step time and makes deterministic tokens. The
engine core process runs either (atomd/engine/core.py); the offline `LLM` drives `LLMEngine`.

n / best_of: a request is one sequence until its first sample, then the scheduler forks it
into its choices (scheduler.sequence, "forks"). With best_of > n the choices are ranked by
cumulative logprob once all are done (`ranked_choices`).
"""
from __future__ import annotations

import collections
import concurrent.futures
import os
import pathlib
import time
from typing import Any

import msgspec

from atomd.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig
from atomd.engine.kv_events import KVEventPublisher, offset_port
from atomd.engine.lora_registry import LoraLoadFailed, LoraNotLoaded, LoraRegistry
from contracts.errors import ErrorCode
from atomd.messages import RequestOutput
from atomd.model import hub
from atomd.sim.hardware import StepShape
from kv_transfer.connector import KVConnectorConfig, KVConnectorOutput
from kv_transfer.factory import create_connector
from kv_transfer.params import KVTransferParams
from kv_transfer.trust import load_secret
from scheduler.prefill_delayer import PrefillDelayer
from scheduler.scheduler import ScheduledBatch, ScheduledBatchOutput, Scheduler, SchedulerConfig
from contracts.sampling import SamplingParams, StructuredOutputsParams, check_in_vocabulary
from scheduler.sequence import Sequence

# N > 0: the engine keeps its last N forwards' shapes and wall times (and the loop's busy
# gaps) for GET /debug/stats `step_samples`, from which `atomd profile --from-servers` fits a
# profile of the engine as it serves (atomd/sim/profile.py).
STEP_SAMPLES_ENV = "ATOMD_STEP_SAMPLES"
MAX_STEP_SAMPLES = 100_000


def step_sample_buffer() -> collections.deque | None:
    try:
        n = int(os.environ.get(STEP_SAMPLES_ENV) or 0)
    except ValueError:
        raise ValueError(f"{STEP_SAMPLES_ENV} must be an integer") from None
    return collections.deque(maxlen=min(n, MAX_STEP_SAMPLES)) if n > 0 else None


def resolve_model_dir(config: EngineConfig) -> pathlib.Path:
    if config.model is not None:
        return hub.model_path(config.model)
    from atomd.model.default import default_model_dir

    return default_model_dir()


class EngineLoop:
    """A subclass's __init__ sets `config`, `model_name`, `vocab_size`, `tokenizer`, `compat`,
    `proposer` / `spec_control` (None: no speculative decoding), then calls
    `_start(num_blocks, kv_blocks, eos, prefill_delayer, model_dir)`."""

    proposer: Any = None
    spec_control: Any = None
    loras: LoraRegistry | None = None  # --enable-lora: the adapters (a subclass that runs them sets it)

    def _start(self, num_blocks: int, kv_blocks: Any, eos: int | None, prefill_delayer: PrefillDelayer | None,
               model_dir: pathlib.Path, *, prefix_caching: bool | None = None, kv_window: int | None = None) -> None:
        """The connector (over `kv_blocks`, the cache as a uint8 [num_blocks, block_bytes]
        array), the scheduler over `num_blocks` blocks, the KV events publisher. `prefix_caching`:
        None is the config's; `kv_window`: every layer's window (blocks before it are returned)."""
        config = self.config
        self.kv_connector = self._make_connector(kv_blocks)
        spec = config.speculative()
        self.scheduler = Scheduler(SchedulerConfig(
            num_kvcache_blocks=num_blocks, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.max_model_len,
            block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching if prefix_caching is None else prefix_caching,
            enable_chunked_prefill=config.enable_chunked_prefill, eos_token_id=eos,
            stop_token_ids=self.tokenizer.stop_token_ids,
            scheduler_delay_factor=config.scheduler_delay_factor,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            enable_mixed_chunk=config.enable_mixed_chunk,
            kv_window=kv_window,
            max_local_prefill_tokens_per_step=config.max_local_prefill_tokens_per_step,
            max_local_prefill_ms_per_step=config.max_local_prefill_ms_per_step,
            num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
            enable_kv_events=config.kv_events_endpoint is not None,
            scheduling_policy=config.scheduling_policy),
            kv_connector=self.kv_connector, prefill_delayer=prefill_delayer, detokenize=self.tokenizer.decode,
            admission_gate=self._admit_lora if self.loras is not None else None)
        self.kv_events = self._make_kv_events(model_dir)  # None without --kv-events-endpoint
        self._requests: dict[str, _Request] = {}
        self._embeddings: dict[str, list[float]] = {}  # pooled vectors by request id, until the last output
        self._aborted: list[Sequence] = []  # surfaced as finished outputs by the next step()
        self.step_samples = step_sample_buffer()
        self.last_forward: tuple[bool, int] | None = None  # the last step's (is_prefill, tokens); None: no forward
        self._busy_since: float | None = None  # the last forward's end while sequences still ran
        # what the loop did since the last forward: the sequences whose outputs it handled (that
        # forward's), the KV pulls that landed, the requests added: a busy gap's explanation
        self.gap_work = [0, 0, 0]

    def _make_connector(self, kv_blocks: Any):
        """The PD connector of a producer or consumer (None when colocated): both halves in one."""
        cfg = self.config
        if cfg.kv_role == "both":
            return None
        port = cfg.kv_side_channel_port + cfg.data_parallel_rank if cfg.kv_side_channel_port else 0
        scheduler_side, worker_side = create_connector(cfg.kv_transfer_backend, cfg.kv_role, KVConnectorConfig(
            block_size=cfg.block_size, compat=self.compat, side_channel_host=cfg.kv_side_channel_host,
            side_channel_port=port, lease_s=cfg.kv_lease_s, recv_timeout_s=cfg.kv_recv_timeout_s,
            load_failure_policy=cfg.kv_load_failure_policy, dp_rank=cfg.data_parallel_rank,
            params_secret=load_secret(path=cfg.kv_params_secret_file), trusted_producers=cfg.trusted_producers(),
            extra_config={"mooncake_protocol": cfg.kv_mooncake_protocol, "mooncake_device": cfg.kv_mooncake_device}))
        worker_side.register_kv_caches(kv_blocks)
        return scheduler_side

    def _make_kv_events(self, model_dir: pathlib.Path) -> KVEventPublisher | None:
        """This rank's KV events publisher (atomd/engine/kv_events.py); `tokenizer` tells a router on
        this host where to find the tokenizer the event hashes are made from."""
        cfg = self.config
        if cfg.kv_events_endpoint is None:
            return None
        return KVEventPublisher(cfg.kv_events_endpoint, offset_port(cfg.kv_events_replay_endpoint,
                                                                    cfg.data_parallel_rank),
                                cfg.kv_events_topic, cfg.kv_events_buffer_steps, cfg.data_parallel_rank,
                                cfg.block_size, extra_info={"tokenizer": str(model_dir),
                                                            "prefix_caching": cfg.enable_prefix_caching,
                                                            "tp_size": cfg.tensor_parallel_size},
                                secret=load_secret(path=cfg.kv_params_secret_file))

    def _pool_blocks(self, bytes_per_block: int) -> int:
        """KV blocks of the pool: --num-kvcache-blocks, else --kv-cache-memory (default 256 MiB,
        then at most max_num_seqs full contexts) over `bytes_per_block`."""
        cfg = self.config
        if cfg.num_kvcache_blocks is not None:
            return cfg.num_kvcache_blocks
        memory = cfg.kv_cache_memory if cfg.kv_cache_memory is not None else DEFAULT_KV_CACHE_MEMORY
        blocks = memory // bytes_per_block
        if cfg.kv_cache_memory is None:  # more than every sequence at full length is never used
            blocks = min(blocks, cfg.max_num_seqs * -(-cfg.max_model_len // cfg.block_size))
        if blocks < 1:
            raise ValueError(f"kv_cache_memory={memory} bytes holds no KV block of {bytes_per_block} bytes")
        return int(blocks)

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                    kv_transfer_params: KVTransferParams | None = None,
                    arrival_time: float | None = None, lora_name: str | None = None) -> Sequence:
        """ValueError (the API's 400) for a duplicate id, a token outside the vocabulary, or
        kv_transfer_params that do not fit this prompt; LoraNotLoaded for an adapter this
        engine does not know (404). `lora_name`: the LoRA adapter the request runs under (None:
        the base model); the scheduler admits it once that adapter is resident (`_admit_lora`)."""
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        check_in_vocabulary("prompt_token_ids", prompt_token_ids, self.vocab_size)
        if kv_transfer_params is not None:
            self._check_producer_tokens(kv_transfer_params, self.vocab_size)
        params = self._prepare_params(sampling_params or SamplingParams(), kv_transfer_params)
        self._check_lora_params(lora_name, kv_transfer_params)
        seq = Sequence(list(prompt_token_ids), params, request_id=request_id,
                       arrive_time=arrival_time, kv_transfer_params=kv_transfer_params, lora_name=lora_name)
        if kv_transfer_params is not None and kv_transfer_params.do_remote_prefill \
                and seq.prompt_logprobs is not None:  # P computed them in its prefill
            if kv_transfer_params.prompt_logprobs is None:
                raise ValueError("prompt_logprobs: the prefill engine's kv_transfer_params carry none")
            seq.prompt_logprobs = list(kv_transfer_params.prompt_logprobs)
        if self.kv_connector is not None:  # ValueError: kv_transfer_params do not fit this prompt
            self.kv_connector.request_added(seq)
        if lora_name is not None:
            seq.lora_id = self.loras.lora_id(lora_name)
        self.scheduler.add(seq)
        self._requests[request_id] = _Request(seq)
        self.gap_work[2] += 1
        return seq

    def _check_lora_params(self, lora_name: str | None, kv_params: KVTransferParams | None) -> None:
        """The adapter is one this engine knows, and a pull's KV was computed under it (P's
        params name P's adapter: another one's KV would be read as this one's)."""
        if lora_name is not None and (self.loras is None or lora_name not in self.loras.paths):
            raise LoraNotLoaded(f"LoRA adapter {lora_name!r} is not loaded on this engine" if self.loras is not None
                                else f"LoRA adapter {lora_name!r}: this engine runs without --enable-lora")
        if kv_params is not None and kv_params.do_remote_prefill and kv_params.lora_name != lora_name:
            raise ValueError(f"kv_transfer_params: the prefill ran under LoRA adapter {kv_params.lora_name!r}, "
                             f"this request asks for {lora_name!r}")

    def _admit_lora(self, seq: Sequence) -> bool | tuple[ErrorCode, str]:
        """The scheduler's admission gate: True once the sequence's adapter is resident and pinned
        for its request, False while it waits for a load or a free slot (the scheduler admits
        others past it), (code, message) when it can no longer run (unloaded: 404; its load
        failed: 400)."""
        if seq.lora_name is None:
            return True
        try:
            return self.loras.admit(seq.request_id, seq.lora_name)
        except LoraNotLoaded as e:
            return ErrorCode.MODEL_NOT_FOUND, str(e)
        except LoraLoadFailed as e:
            return ErrorCode.LORA_LOAD_FAILED, str(e)

    def _release_lora(self, seq: Sequence) -> None:
        if seq.lora_name is not None and self.loras is not None:
            self.loras.release(seq.request_id)

    @staticmethod
    def _check_producer_tokens(p: KVTransferParams, vocab: int) -> None:
        """The token ids a producer sent (T0, drafts, logprob tops) are in this vocabulary:
        the scheduler indexes with them, so a bad one is this request's 400, not a crash."""
        ids = [] if p.first_token_id is None else [p.first_token_id]
        ids += p.draft_token_ids
        for entry in [p.first_token_logprobs, *(p.prompt_logprobs or ())]:
            ids += [t[0] for t in (entry.top if entry is not None else ())]
        check_in_vocabulary("kv_transfer_params", ids, vocab)

    def _prepare_params(self, sp: SamplingParams, kv_params: KVTransferParams | None) -> SamplingParams:
        """Check token ids against the vocabulary, tokenize bad_words; a prefill leg for a
        remote decode (P) runs one sequence: the decode engine makes the choices."""
        sp.check_vocabulary(self.vocab_size)
        if sp.structured_outputs is not None:
            self._check_grammar(sp.structured_outputs)
        changes: dict[str, Any] = {}
        if sp.bad_words and not sp.bad_words_token_ids:
            changes["bad_words_token_ids"] = self.bad_words_token_ids(sp.bad_words)
        if kv_params is not None and kv_params.do_remote_decode and sp.num_samples > 1:
            changes.update(n=1, best_of=None)
        return msgspec.structs.replace(sp, **changes) if changes else sp

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's rule: each word's tokens as written and, when that is another token
        sequence of the same length, after a space (the word inside a text)."""
        out: list[list[int]] = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if plain:
                out.append(plain)
            if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
                out.append(spaced)
        return out

    def abort_request(self, request_id: str) -> bool:
        req = self._requests.get(request_id)
        if req is None:
            return False
        aborted = [s for s in list(req.seq.group) if self.scheduler.abort(s.id) is not None]
        if not aborted:
            return False
        self._aborted.append(req.seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or not self.scheduler.is_finished()

    def check_alive(self) -> None:
        """Raise if a part of this engine outside the process is gone (LLMEngine: a TP worker); the
        idle core asks, so the engine is reported dead without waiting for a request to find out."""

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        if self.loras is not None:  # adapters read in the background since the last step become resident
            self.loras.finish_loads()
        outputs = [self._aborted_output(seq) for seq in self._aborted]
        self._aborted = []
        batch = self.scheduler.schedule()
        if batch is not None and self.kv_connector is not None:
            self.kv_connector.start_load_kv(batch.connector_meta)  # an empty batch may carry a pull
        self.last_forward = (batch.is_prefill, batch.num_tokens) if batch is not None and batch.seqs else None
        if batch is not None and batch.seqs:
            started = time.perf_counter()
            output = self._forward(batch)
            elapsed = time.perf_counter() - started
            if self.step_samples is not None:
                self._sample_step(batch, started, elapsed)
            self.gap_work = [len(batch.seqs), 0, 0]
            if batch.is_prefill:  # what a prompt token costs: the time cap of local prefills
                self.scheduler.observe_prefill_step(batch.num_tokens, elapsed)
            elif self.proposer is not None:  # what a decode step costs per scheduled token: when drafts pay
                self.spec_control.cost.observe(batch.num_tokens, elapsed)
            for update in self.scheduler.postprocess(batch, output):
                outputs.extend(self._outputs(update.seq, update.new_token_ids, update.new_logprobs,
                                             update.finished))
        else:  # the loop will wait (for input, a pull, a release): the gap to the next forward is not busy
            self._busy_span_ended()
            self._idle_step()
        if self.kv_connector is not None:  # pulls landed, blocks released: before take_rejected
            finished = self._kv_connector_output()
            self.gap_work[1] += len(finished.finished_recving)
            self.scheduler.update_from_kv_connector_output(finished)
            for update in self.scheduler.take_first_tokens():
                outputs.extend(self._outputs(update.seq, update.new_token_ids, update.new_logprobs,
                                             update.finished))
        for seq in self.scheduler.take_rejected():
            outputs.extend(self._outputs(seq, [], None, True))
        if self.kv_events is not None:  # after the forward that wrote (and indexed) the blocks
            self.kv_events.publish(self.scheduler.block_manager.take_events())
        if not self.has_unfinished_requests():  # the core waits for input without stepping: not busy
            self._busy_span_ended()
        return outputs

    def _busy_span_ended(self) -> None:
        """The loop goes on to wait: the time to the next forward is no busy gap (step samples)."""
        self._busy_since = None

    def _sample_step(self, batch: ScheduledBatch, started: float, elapsed: float) -> None:
        """[is_prefill, tokens, seqs, attention, context, forward s, gap s, outputs, pulls,
        added, started]: the gap is the loop's time since the previous forward ended
        (scheduling, outputs, IPC), or -1 when the engine was idle in between (a step without
        a forward: the loop waited for input, a pull, a release); outputs, pulls and added its
        work then (`gap_work`); started the forward's start on time.perf_counter's clock
        (CLOCK_MONOTONIC on Linux, the same in every process of a host: atomd profile lines
        up engines that shared the cores by it)."""
        shape = StepShape.of(batch.is_prefill, batch.num_scheduled_tokens.tolist(),
                             batch.num_computed_tokens.tolist())
        gap = -1.0 if self._busy_since is None else started - self._busy_since
        self.step_samples.append([shape.is_prefill, shape.tokens, shape.seqs, shape.attention, shape.context,
                                  elapsed, gap, *self.gap_work, started])
        self._busy_since = started + elapsed if self.scheduler.running else None

    def _forward(self, batch: ScheduledBatch) -> ScheduledBatchOutput:
        raise NotImplementedError

    def _idle_step(self) -> None:
        """A step without a forward: a rank whose model's layers exchange with the other ranks
        (expert parallelism) still takes its part."""

    def _check_grammar(self, grammar: StructuredOutputsParams) -> None:
        """ValueError (a 400) when this engine cannot follow `grammar`."""
        raise NotImplementedError

    def _kv_connector_output(self) -> KVConnectorOutput:
        """Transfers the connector saw end since the last step."""
        return self.kv_connector.get_finished()

    def kernels_info(self) -> Any:
        """How the forward's kernels run (GET /kv_transfer_info `kernels`)."""
        return None

    # ------------------------------------------------------------------ outputs

    def _outputs(self, seq: Sequence, new_token_ids: list[int], new_logprobs: list | None,
                 finished: bool) -> list[RequestOutput]:
        """The outputs one choice's update makes (none for an unfinished best_of candidate)."""
        req = self._requests.get(seq.request_id)
        if req is None or req.seq.group is not seq.group:
            return []
        if finished:
            self._forget(seq.id)
            req.num_finished += 1
        parent = req.seq
        done = req.num_finished == len(parent.group)
        if done:
            del self._requests[seq.request_id]
            self._release_lora(parent)
        if parent.sampling_params.ranked:
            return self._ranked_outputs(parent, seq) if done else []
        out = RequestOutput(seq.request_id, list(new_token_ids), new_logprobs, done,
                            seq.finish_reason if finished else None, seq.num_prompt_tokens, seq.num_cached_tokens,
                            index=seq.index)
        if not req.prompt_logprobs_sent and (new_token_ids or done):
            out.prompt_logprobs, req.prompt_logprobs_sent = parent.prompt_logprobs, True
        if done:
            self._finish_output(out, parent, seq)
        return [out]

    def _ranked_outputs(self, parent: Sequence, last: Sequence) -> list[RequestOutput]:
        """best_of > n, every candidate done: the n best, each whole, index = rank."""
        choices = ranked_choices(parent)
        outs = []
        for rank, seq in enumerate(choices):
            logprobs = list(seq.logprobs) if seq.sampling_params.logprobs is not None else None
            outs.append(RequestOutput(seq.request_id, seq.completion_token_ids, logprobs, False, seq.finish_reason,
                                      seq.num_prompt_tokens, seq.num_cached_tokens, index=rank,
                                      prompt_logprobs=parent.prompt_logprobs if rank == 0 else None))
        outs[-1].finished = True
        self._finish_output(outs[-1], parent, last)
        return outs

    def _finish_output(self, out: RequestOutput, parent: Sequence, last: Sequence) -> None:
        """The request's last output: its params for D, the error, the engine's timing."""
        out.kv_transfer_params = parent.kv_transfer_params_output
        out.embedding = self._embeddings.pop(parent.request_id, None)
        out.error, out.error_code = last.error, last.error_code
        out.timing = (parent.arrive_time, parent.first_scheduled_time, parent.first_token_time, time.time())

    def _forget(self, seq_id: int) -> None:
        """A sequence ended: drop its drafter state (a subclass: its sampler's too)."""
        if self.proposer is not None:
            self.proposer.forget(seq_id)
            self.spec_control.forget(seq_id)

    def _aborted_output(self, seq: Sequence) -> RequestOutput:
        if self._requests.pop(seq.request_id, None) is not None:
            self._release_lora(seq)
        for s in seq.group:
            self._forget(s.id)
        out = RequestOutput(seq.request_id, [], None, True, "abort", seq.num_prompt_tokens, seq.num_cached_tokens)
        self._finish_output(out, seq, seq)
        return out

    # ------------------------------------------------------------------ utilities

    def stats(self) -> dict[str, Any]:
        s = self.scheduler
        running, waiting = s.get_request_counts()
        bm = s.block_manager
        return {"num_running": running, "num_waiting": waiting, "num_free_blocks": bm.num_free_blocks,
                "num_total_blocks": bm.num_total_blocks, "kv_cache_usage": bm.usage,
                "prefix_cache_queries": s.cache_stats.queries, "prefix_cache_hits": s.cache_stats.hits,
                "num_preemptions": s.num_preemptions, "num_window_released_blocks": bm.num_window_released,
                **self._spec_stats(),
                **({} if self.step_samples is None else {"step_samples": list(self.step_samples)}),
                "lora_request_loads": self.loras.request_loads if self.loras is not None else 0,
                "kv_transfer": self.kv_connector.stats() if self.kv_connector is not None else None}

    def _spec_stats(self) -> dict[str, Any]:
        """Speculative decoding's counters (vLLM's spec_decode names) and the SpecStats."""
        spec = self.scheduler.spec_stats
        if spec is None:
            return {"spec_decode": None}
        return {"spec_decode_num_drafts": spec.num_steps, "spec_decode_num_draft_tokens": spec.num_draft_tokens,
                "spec_decode_num_accepted_tokens": spec.num_accepted_tokens, "spec_decode": spec.as_dict()}

    def only_serving_kv(self) -> bool:
        """Nothing to compute or pull: only blocks pinned for a consumer are pending, so the
        core may poll for their release less often than it steps a decode."""
        s = self.scheduler
        return not (s.running or s.waiting or self._aborted) and not s.parked

    def kv_transfer_info(self) -> dict[str, Any]:
        """Role, side channel, DP and TP sizes, compat fingerprint and how each C kernel runs
        (`kernels`: prebuilt, built here or a fallback; GET /kv_transfer_info)."""
        cfg = self.config
        info = {"role": cfg.kv_role, "side_channel": None, "engine_id": None, "compat": self.compat,
                "dp_rank": cfg.data_parallel_rank}
        if self.kv_connector is not None:
            info.update(self.kv_connector.info())
        return dict(info, dp_size=cfg.data_parallel_size, tp_size=cfg.tensor_parallel_size, backend=cfg.kv_transfer_backend,
                    kv_events=self.kv_events.info() if self.kv_events is not None else None,
                    kernels=self.kernels_info(), loras=list(self.loras.paths) if self.loras is not None else None,
                    loras_resident=list(self.loras.resident) if self.loras is not None else None)

    def load_lora_adapter(self, name: str, path: str) -> dict[str, Any] | concurrent.futures.Future:
        """POST /v1/load_lora_adapter: {"name"} or {"error", "status": 400} (a bad adapter or a
        name taken); the read runs on a background thread while the engine steps, so the answer
        is a Future the core sends once the load landed (`finish_lora_loads`)."""
        if self.loras is None:
            return {"error": "this engine runs without --enable-lora", "status": 400}
        try:
            return self.loras.start_add(name, path)
        except ValueError as e:
            return {"error": str(e), "status": 400}

    def lora_loads_pending(self) -> bool:
        """An adapter is being read: the core polls (finish_lora_loads) instead of sleeping."""
        return self.loras is not None and bool(self.loras.loading)

    def finish_lora_loads(self) -> None:
        """Between steps: loads that landed become resident and answer their callers."""
        if self.loras is not None:
            self.loras.finish_loads()

    def unload_lora_adapter(self, name: str) -> dict[str, Any]:
        """POST /v1/unload_lora_adapter: {"name"} or {"error", "status": 404}; requests running
        under it finish under it (atomd/engine/lora_registry.py)."""
        if self.loras is None or name not in self.loras.paths:
            return {"error": f"LoRA adapter {name!r} is not loaded", "status": 404}
        self.loras.remove(name)
        return {"name": name}

    def list_lora_adapters(self) -> list[dict[str, Any]]:
        return self.loras.info() if self.loras is not None else []

    def kv_transfer_abort(self, transfer_id: str) -> bool:
        """The router gave up a transfer D never pulled: free P's pinned blocks now."""
        return self.kv_connector is not None and self.kv_connector.revoke(transfer_id)

    def close(self) -> None:
        if self.loras is not None:
            self.loras.close()
        if self.kv_connector is not None:
            self.kv_connector.close()
        if self.kv_events is not None:
            self.kv_events.close()

    def reset_prefix_cache(self) -> bool:
        reset = self.scheduler.reset_prefix_cache()
        if self.kv_events is not None:  # AllBlocksCleared now, not at the next step
            self.kv_events.publish(self.scheduler.block_manager.take_events())
        return reset


class _Request:
    """One request in flight: its first sequence (whose group holds every choice)."""

    __slots__ = ("seq", "num_finished", "prompt_logprobs_sent")

    def __init__(self, seq: Sequence):
        self.seq = seq
        self.num_finished = 0  # choices finished so far
        self.prompt_logprobs_sent = False


def ranked_choices(parent: Sequence) -> list[Sequence]:
    """The choices a finished request returns, in order: with best_of > n the n with the
    highest cumulative logprob (ties: lower index first), else every choice by index."""
    group = sorted(parent.group, key=lambda s: s.index)
    if not parent.sampling_params.ranked or len(group) == 1:
        return group
    return sorted(group, key=lambda s: (-s.cumulative_logprob, s.index))[:parent.sampling_params.n]
