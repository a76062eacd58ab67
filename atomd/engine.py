"""LLMEngine: one engine's loop, schedule -> forward -> sample -> postprocess.

`LLMEngine.step()` returns one `RequestOutput` (atomd/messages.py) per request choice that
changed: new tokens, or the end (finished by a stop, aborted, or ended without generating,
with `error` and `error_code` set). The engine core process runs it (atomd/core.py); the
offline `LLM` drives it in-process (atomd/llm.py).

n / best_of: a request is one sequence until its first sample, then the scheduler forks it
into its choices (scheduler.sequence, "forks"); the engine samples every choice's first
token from the one prompt row and copies shared KV blocks a choice is about to write
(`ScheduledBatch.block_copies`) before the forward. With best_of > n the choices are
ranked by cumulative logprob once all are done (`ranked_choices`).
"""
from __future__ import annotations

import pathlib
import time
from typing import Any

import msgspec
import numpy as np
import torch

from atomd import cbuild
from atomd.allocator import retain_freed_memory
from atomd.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig
from atomd.kv_cache import KVCache
from atomd.kv_events import KVEventPublisher, offset_port
from atomd.model import hub
from atomd.model.loader import load_model
from atomd.runner import ModelRunner
from atomd.sampler import Sampler, prompt_logprobs
from atomd.spec_decode import NgramProposer, SpecController, accept
from atomd.structured import GrammarCompiler
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
        return hub.model_path(config.model)
    from atomd.model.default import default_model_dir

    return default_model_dir()


class LLMEngine:
    def __init__(self, config: EngineConfig, prefill_delayer: PrefillDelayer | None = None):
        """`prefill_delayer`: the DP group's (atomd/core.py builds it), asked every tick."""
        self.config = config
        torch.set_num_threads(config.num_threads_or_all())
        retain_freed_memory()  # a prefill's activations reuse their pages (atomd/allocator.py)
        model_dir = resolve_model_dir(config)
        self.model_name = config.model or "atomd-default"
        self.model = load_model(model_dir, DTYPES[config.dtype], max_positions=config.max_model_len,
                                quantization=config.quantization)
        mcfg = self.model.config
        if mcfg.sliding_window is not None and mcfg.sliding_window < config.max_model_len:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's sliding_window="
                             f"{mcfg.sliding_window}, which this engine does not implement; lower --max-model-len")
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.kv_cache = KVCache(self._num_blocks(), mcfg.num_layers, config.block_size, mcfg.num_kv_heads,
                                mcfg.head_dim, self.model.dtype)
        self.runner = ModelRunner(self.model, self.kv_cache, config.attention_backend)
        self.kv_connector = self._make_connector()
        eos = self.tokenizer.eos_token_id
        if eos is None and isinstance(mcfg.eos_token_id, int):
            eos = mcfg.eos_token_id
        self._end_token_ids = [t for t in [eos, *self.tokenizer.stop_token_ids] if t is not None]
        grammars = GrammarCompiler((model_dir / "tokenizer.json").read_text(), mcfg.vocab_size, self._end_token_ids)
        self.sampler = Sampler(config.seed, self._end_token_ids, grammars)  # end tokens: banned before min_tokens
        spec = config.speculative()  # speculative decoding (atomd/spec_decode.py), None: off
        self.proposer = self.spec_control = None
        if spec is not None:
            self.proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                          spec.prompt_lookup_max, config.max_model_len)
            self.spec_control = SpecController(spec.num_speculative_tokens)
        self.scheduler = Scheduler(SchedulerConfig(
            num_kvcache_blocks=self.kv_cache.num_blocks, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.max_model_len,
            block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching,
            enable_chunked_prefill=config.enable_chunked_prefill, eos_token_id=eos,
            stop_token_ids=self.tokenizer.stop_token_ids,
            scheduler_delay_factor=config.scheduler_delay_factor,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            max_local_prefill_tokens_per_step=config.max_local_prefill_tokens_per_step,
            max_local_prefill_ms_per_step=config.max_local_prefill_ms_per_step,
            num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
            enable_kv_events=config.kv_events_endpoint is not None),
            kv_connector=self.kv_connector, prefill_delayer=prefill_delayer, detokenize=self.tokenizer.decode)
        self.kv_events = self._make_kv_events(model_dir)  # None without --kv-events-endpoint
        self._requests: dict[str, _Request] = {}
        self._aborted: list[Sequence] = []  # surfaced as finished outputs by the next step()

    def _make_connector(self):
        """The PD connector of a producer or consumer (None when colocated): both halves in one."""
        cfg, mcfg = self.config, self.model.config
        # weights quantised at load give other KV than the checkpoint's: another model to a peer
        model_id = self.model_name if cfg.quantization is None else f"{self.model_name}+{cfg.quantization}"
        self.compat = compat_fingerprint(model_id, cfg.dtype, cfg.block_size, mcfg.num_layers,
                                         mcfg.num_kv_heads, mcfg.head_dim, KV_LAYOUT_VERSION)
        if cfg.kv_role == "both":
            return None
        port = cfg.kv_side_channel_port + cfg.data_parallel_rank if cfg.kv_side_channel_port else 0
        scheduler_side, worker_side = create_connector(cfg.kv_transfer_backend, cfg.kv_role, KVConnectorConfig(
            block_size=cfg.block_size, compat=self.compat, side_channel_host=cfg.kv_side_channel_host,
            side_channel_port=port, lease_s=cfg.kv_lease_s, recv_timeout_s=cfg.kv_recv_timeout_s,
            load_failure_policy=cfg.kv_load_failure_policy, dp_rank=cfg.data_parallel_rank,
            params_secret=load_secret(path=cfg.kv_params_secret_file), trusted_producers=cfg.trusted_producers(),
            extra_config={"mooncake_protocol": cfg.kv_mooncake_protocol, "mooncake_device": cfg.kv_mooncake_device}))
        worker_side.register_kv_caches(self.kv_cache.as_numpy_blocks())
        return scheduler_side

    def _make_kv_events(self, model_dir: pathlib.Path) -> KVEventPublisher | None:
        """This rank's KV events publisher (atomd/kv_events.py); `tokenizer` tells a router on
        this host where to find the tokenizer the event hashes are made from."""
        cfg = self.config
        if cfg.kv_events_endpoint is None:
            return None
        return KVEventPublisher(cfg.kv_events_endpoint, offset_port(cfg.kv_events_replay_endpoint,
                                                                    cfg.data_parallel_rank),
                                cfg.kv_events_topic, cfg.kv_events_buffer_steps, cfg.data_parallel_rank,
                                cfg.block_size, extra_info={"tokenizer": str(model_dir),
                                                            "prefix_caching": cfg.enable_prefix_caching},
                                secret=load_secret(path=cfg.kv_params_secret_file))

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
        if isinstance(kv_transfer_params, dict):  # ValueError names the field
            kv_transfer_params = KVTransferParams.from_json_obj(kv_transfer_params)
        if kv_transfer_params is not None:
            self._check_producer_tokens(kv_transfer_params, vocab)
        params = self._prepare_params(sampling_params or SamplingParams(), kv_transfer_params)
        seq = Sequence(list(prompt_token_ids), params, request_id=request_id,
                       arrive_time=arrival_time, kv_transfer_params=kv_transfer_params)
        if kv_transfer_params is not None and kv_transfer_params.do_remote_prefill \
                and seq.prompt_logprobs is not None:  # P computed them in its prefill
            if kv_transfer_params.prompt_logprobs is None:
                raise ValueError("prompt_logprobs: the prefill engine's kv_transfer_params carry none")
            seq.prompt_logprobs = list(kv_transfer_params.prompt_logprobs)
        if self.kv_connector is not None:  # ValueError: kv_transfer_params do not fit this prompt
            self.kv_connector.request_added(seq)
        self.scheduler.add(seq)
        self._requests[request_id] = _Request(seq)
        return seq

    @staticmethod
    def _check_producer_tokens(p: KVTransferParams, vocab: int) -> None:
        """The token ids a producer sent (T0, drafts, logprob tops) are in this vocabulary:
        the scheduler indexes with them, so a bad one is this request's 400, not a crash."""
        ids = [] if p.first_token_id is None else [p.first_token_id]
        ids += p.draft_token_ids
        for entry in [p.first_token_logprobs, *(p.prompt_logprobs or ())]:
            ids += [t[0] for t in (entry or {}).get("top", ())]
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"kv_transfer_params: token id {bad} is outside the vocabulary [0, {vocab})")

    def _prepare_params(self, sp: SamplingParams, kv_params: KVTransferParams | None) -> SamplingParams:
        """Check token ids against the vocabulary, tokenize bad_words; a prefill leg for a
        remote decode (P) runs one sequence: the decode engine makes the choices."""
        vocab = self.model.config.vocab_size
        for name, ids in (("logit_bias", sp.logit_bias or ()), ("allowed_token_ids", sp.allowed_token_ids or ())):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})")
        if sp.structured_outputs is not None:  # compiled once per distinct grammar (cached)
            try:
                self.sampler.grammars.compile(sp.structured_outputs)
            except ValueError as e:
                raise ValueError(f"structured_outputs: the grammar does not compile: {e}") from None
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

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        outputs = [self._aborted_output(seq) for seq in self._aborted]
        self._aborted = []
        batch = self.scheduler.schedule()
        if batch is not None and self.kv_connector is not None:
            self.kv_connector.start_load_kv(batch.connector_meta)  # an empty batch may carry a pull
        if batch is not None and batch.seqs:
            started = time.perf_counter()
            output = self._forward(batch)
            elapsed = time.perf_counter() - started
            if batch.is_prefill:  # what a prompt token costs: the time cap of local prefills
                self.scheduler.observe_prefill_step(batch.num_tokens, elapsed)
            elif self.proposer is not None:  # what a decode step costs per scheduled token: when drafts pay
                self.spec_control.cost.observe(batch.num_tokens, elapsed)
            for update in self.scheduler.postprocess(batch, output):
                outputs.extend(self._outputs(update.seq, update.new_token_ids, update.new_logprobs,
                                             update.finished))
        if self.kv_connector is not None:  # pulls landed, blocks released: before take_rejected
            self.scheduler.update_from_kv_connector_output(self.kv_connector.get_finished())
            for update in self.scheduler.take_first_tokens():
                outputs.extend(self._outputs(update.seq, update.new_token_ids, update.new_logprobs,
                                             update.finished))
        for seq in self.scheduler.take_rejected():
            outputs.extend(self._outputs(seq, [], None, True))
        if self.kv_events is not None:  # after the forward that wrote (and indexed) the blocks
            self.kv_events.publish(self.scheduler.block_manager.take_events())
        return outputs

    def _forward(self, batch: ScheduledBatch) -> ScheduledBatchOutput:
        if batch.block_copies:  # copy-on-write of blocks shared by forked choices, before any write
            src, dst = zip(*batch.block_copies)
            kv = self.kv_cache.kv
            kv[list(dst)] = kv[list(src)]
        want_prompt = batch.is_prefill and any(s.prompt_logprobs is not None for s in batch.seqs)
        # speculative decoding: the runner returns every scheduled row's logits; row j of a
        # sequence samples the token after its j-th draft, as if drafts[:j] were accepted
        verify = not batch.is_prefill and any(batch.spec_token_ids)
        logits = self.runner.execute(batch, all_logits=want_prompt)
        prompt_entries = None
        if want_prompt:
            logits, prompt_entries = self._prompt_logprobs(batch, logits)
        rows = np.flatnonzero(batch.needs_sample).tolist()
        token_ids: list[list[int]] = [[] for _ in batch.seqs]
        logprobs: list[list[Any]] | None = None
        fork_ids: list[list[int]] | None = None
        fork_entries: list[list[Any]] | None = None
        if rows:
            drafts = batch.spec_token_ids if verify else [[] for _ in batch.seqs]
            first_row = (np.cumsum(batch.num_scheduled_tokens) - batch.num_scheduled_tokens).tolist() if verify else None
            seqs, params, source = [], [], []  # a row about to fork samples once per choice
            extra: list[list[int]] | None = [] if verify else None
            for j, i in enumerate(rows):
                seq = batch.seqs[i]
                at = first_row[i] if verify else j
                for d in range(len(drafts[i]) + 1):  # the last token, then each draft
                    seqs.append(seq)
                    params.append(seq.sampling_params)
                    source.append(at + d)
                    if verify:
                        extra.append(drafts[i][:d])
                for choice in range(1, seq.num_forks + 1):
                    seqs.append(seq)
                    params.append(seq.sampling_params.for_choice(choice))
                    source.append(at)
                    if verify:
                        extra.append([])
            if source != list(range(len(logits))):
                logits = logits[torch.tensor(source)]
            tokens, entries = self.sampler.sample(logits, seqs, params, extra)
            if entries is not None:
                logprobs = [[] for _ in batch.seqs]
            at = 0
            for i in rows:
                k, n = batch.seqs[i].num_forks, len(drafts[i])
                token_ids[i] = accept(tokens[at:at + n + 1], drafts[i]) if n else [tokens[at]]
                if entries is not None:
                    logprobs[i] = entries[at:at + len(token_ids[i])]
                if n:
                    self.spec_control.update(batch.seqs[i].id, n, len(token_ids[i]) - 1)
                at += n + 1
                if k:
                    if fork_ids is None:
                        fork_ids, fork_entries = [[] for _ in batch.seqs], [[] for _ in batch.seqs]
                    fork_ids[i] = tokens[at:at + k]
                    fork_entries[i] = entries[at:at + k] if entries is not None else [None] * k
                at += k
        next_drafts = None
        if self.proposer is not None and rows:
            next_drafts = self._propose(batch, rows, token_ids)
        return ScheduledBatchOutput(batch.seq_ids, token_ids, logprobs, draft_token_ids=next_drafts,
                                    fork_token_ids=fork_ids, fork_logprobs=fork_entries,
                                    prompt_logprobs=prompt_entries)

    def _propose(self, batch: ScheduledBatch, rows: list[int], token_ids: list[list[int]]) -> list[list[int]]:
        """Drafts for the next step of every sequence that sampled, from its history plus the
        tokens it just got (the scheduler cuts them at stops and limits; P hands them to D).
        None ([]) for a sequence the controller paused or that is at its max_tokens."""
        seq_ids, histories, new, limits = [], [], [], []
        running = max(len(self.scheduler.running), len(rows))  # the next decode batch, roughly
        for i in rows:
            seq = batch.seqs[i]
            limit = self.spec_control.limit(seq.id, running)
            params = seq.kv_transfer_params
            if params is None or not params.do_remote_decode:  # P's leg stops at 1 token: D goes on
                limit = min(limit, seq.sampling_params.max_tokens - seq.num_completion_tokens - len(token_ids[i]) - 1)
            seq_ids.append(seq.id)
            histories.append(seq.token_ids)
            new.append(token_ids[i])
            limits.append(limit)
        drafts = self.proposer.propose(seq_ids, histories, new, limits)
        out: list[list[int]] = [[] for _ in batch.seqs]
        for i, d in zip(rows, drafts):
            out[i] = d
        return out

    def _prompt_logprobs(self, batch: ScheduledBatch, logits: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Split the logits of every scheduled token into the sampling rows and, for the
        sequences that ask, the prompt logprobs entries this chunk computes (position p
        predicts prompt token p + 1)."""
        num = batch.num_scheduled_tokens.astype(np.int64)
        ends = np.cumsum(num)
        starts = ends - num
        entries: list[Any] = [None] * len(batch.seqs)
        for i, seq in enumerate(batch.seqs):
            if seq.prompt_logprobs is None:
                continue
            start = int(batch.num_computed_tokens[i])
            count = min(start + int(num[i]), seq.num_prompt_tokens - 1) - start
            entries[i] = [] if count <= 0 else prompt_logprobs(
                logits[int(starts[i]):int(starts[i]) + count], seq.token_ids[start + 1:start + 1 + count],
                seq.sampling_params.prompt_logprobs)
        return logits[torch.from_numpy((ends - 1)[batch.needs_sample])], entries

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
        out.error, out.error_code = last.error, last.error_code
        out.timing = (parent.arrive_time, parent.first_scheduled_time, parent.first_token_time, time.time())

    def _forget(self, seq_id: int) -> None:
        """A sequence ended: drop its sampler and drafter state."""
        self.sampler.forget(seq_id)
        if self.proposer is not None:
            self.proposer.forget(seq_id)
            self.spec_control.forget(seq_id)

    def _aborted_output(self, seq: Sequence) -> RequestOutput:
        self._requests.pop(seq.request_id, None)
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
                "num_preemptions": s.num_preemptions,
                **self._spec_stats(),
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
        """Role, side channel, DP size, compat fingerprint and how each C kernel runs
        (`kernels`: prebuilt, built here or a fallback; GET /kv_transfer_info)."""
        cfg = self.config
        info = {"role": cfg.kv_role, "side_channel": None, "engine_id": None, "compat": self.compat,
                "dp_rank": cfg.data_parallel_rank}
        if self.kv_connector is not None:
            info.update(self.kv_connector.info())
        return dict(info, dp_size=cfg.data_parallel_size, backend=cfg.kv_transfer_backend,
                    kv_events=self.kv_events.info() if self.kv_events is not None else None,
                    kernels=cbuild.kernel_paths())

    def kv_transfer_abort(self, transfer_id: str) -> bool:
        """The router gave up a transfer D never pulled: free P's pinned blocks now."""
        return self.kv_connector is not None and self.kv_connector.revoke(transfer_id)

    def close(self) -> None:
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
