"""LLMEngine: the engine that runs the model: schedule -> forward -> sample -> postprocess.

The loop, requests and outputs are `EngineLoop`'s (atomd/engine/engine_loop.py, torch-free); this
adds the model, the KV cache tensor, the sampler and speculative decoding: `_forward` turns
a `ScheduledBatch` into logits (atomd/engine/runner.py) and samples them. The engine core process
runs it (atomd/engine/core.py); the offline `LLM` drives it in-process (atomd/llm.py).

n / best_of: the engine samples every choice's first token from the one prompt row and
copies shared KV blocks a choice is about to write (`ScheduledBatch.block_copies`) before
the forward.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from atomd.kernels import cbuild
from atomd.engine.allocator import retain_freed_memory
from atomd.config import EngineConfig
from atomd.engine.engine_loop import EngineLoop, ranked_choices, resolve_model_dir
from atomd.engine.kv_cache import KVCache, check_kv_planes, kv_dtype_name, kv_storage_dtype
from atomd.engine.lora_registry import LoraRegistry
from atomd.model.deepseek import DeepseekModel
from atomd.model.deepseek_lora import load_deepseek_adapter
from atomd.model import layer_ops, quant
from atomd.model.lora import load_adapter
from atomd.model.expert_parallel import ExpertParallel
from atomd.model.loader import load_model
from atomd.model.tensor_parallel import load_tp_adapter
from atomd.model.rotary import has_long_rows
from atomd.engine.runner import ModelRunner
from atomd.engine.tp_pd import TPDirectConnector, TPKVStaging, TPStagedConnector, direct_rows, written_blocks
from atomd.engine.tp_workers import TPRunner, start_workers
from atomd.engine.sampler import Sampler, prompt_logprobs
from atomd.engine.spec_decode import NgramProposer, SpecController, accept
from atomd.engine.mtp_proposer import MtpProposer
from atomd.model.deepseek_mtp import load_mtp
from atomd.structured import GrammarCompiler
from atomd.tokenizer import Tokenizer
from kv_transfer.params import compat_fingerprint, tp_layout
from scheduler.prefill_delayer import PrefillDelayer
from scheduler.scheduler import ScheduledBatch, ScheduledBatchOutput
from contracts.sampling import StructuredOutputsParams

__all__ = ["LLMEngine", "ranked_choices", "resolve_model_dir"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


log = logging.getLogger(__name__)


class LLMEngine(EngineLoop):
    def __init__(self, config: EngineConfig, prefill_delayer: PrefillDelayer | None = None,
                 expert_group: Any = None):
        """`prefill_delayer`: the DP group's (atomd/engine/core.py builds it), asked every tick;
        `expert_group`: the DP group the sparse layers' experts are sharded over (its
        all_to_all), None: this engine holds every expert."""
        self.config = config
        torch.set_num_threads(config.num_threads_or_all())
        retain_freed_memory()  # a prefill's activations reuse their pages (atomd/engine/allocator.py)
        model_dir = resolve_model_dir(config)
        self.model_name = config.model or "atomd-default"
        shard = None if expert_group is None else (config.data_parallel_rank, config.data_parallel_size)
        self.tp_workers = split = None
        if config.tensor_parallel_size > 1:  # rank 0 of N (atomd/engine/tp_workers.py): the workers load meanwhile
            self.tp_workers, split = start_workers(config, model_dir, DTYPES[config.dtype], self._pool_blocks)
        try:
            self.model = load_model(model_dir, DTYPES[config.dtype], max_positions=config.max_model_len,
                                    quantization=config.quantization, activations=config.quantized_activations,
                                    expert_shard=shard, tp=split)
            if self.tp_workers is not None:
                self.model.use_tensor_parallel(self.tp_workers.join(split))
        except BaseException:
            if self.tp_workers is not None:
                self.tp_workers.close()
            raise
        if expert_group is not None:
            self.model.use_expert_parallel(ExpertParallel(
                expert_group, *shard, redundant_experts=config.num_redundant_experts if config.enable_eplb else 0,
                rebalance_every=config.eplb_step_interval))
        mcfg = self.model.config
        self.vocab_size = mcfg.vocab_size
        self.tokenizer = Tokenizer.from_dir(model_dir)
        spec = config.speculative()  # speculative decoding (atomd/engine/spec_decode.py), None: off
        mtp = None  # DeepSeek V3's MTP layer as the drafter: one more latent layer in the cache
        if spec is not None and spec.method == "mtp":
            mtp = load_mtp(model_dir, self.model, split)
        kv = self.model.kv_geometry()  # what a token caches per layer: k and v heads, or MLA's latent
        kv_dtype = kv_storage_dtype(config.kv_cache_dtype, self.model.dtype)  # fp8: one byte a value, 16 bits: two
        check_kv_planes(kv_dtype, self.model.dtype, kv.planes, config.kv_cache_dtype, mcfg.architecture)
        kv_layers = mcfg.num_layers + (mtp is not None)
        per_block = KVCache.bytes_per_block(kv_layers, config.block_size, kv.heads, kv.head_dim, kv_dtype, kv.planes)
        kv_all = None if self.tp_workers is None else self.tp_workers.kv_all  # every rank's, shared memory
        self.kv_cache = KVCache(self._pool_blocks(per_block) if kv_all is None else kv_all.shape[1], kv_layers,
                                config.block_size, kv.heads, kv.head_dim, kv_dtype, kv.planes,
                                kv=None if kv_all is None else kv_all[0],
                                compute_dtype=self.model.dtype)
        if (self.kv_cache.narrow and getattr(self.model, "decode_layer", None) is not None
                and not layer_ops.fused_kv_narrow(self.model.dtype, self.kv_cache)):
            log.info("kv_cache_dtype %s: batch-1 decode runs per op (the fused C layer takes a narrow cache with "
                     "float32 activations only)", config.kv_cache_dtype)
        self.runner = ModelRunner(self.model, self.kv_cache, config.attention_backend)
        if self.tp_workers is not None:
            self.runner = TPRunner(self.runner, self.tp_workers)
        if config.enable_lora:  # adapters by name; the runner groups each step's rows by adapter
            self.loras = self.runner.loras = LoraRegistry(config.max_loras, self._load_adapter)
            for name, path in config.lora_adapters():
                self.loras.add(name, path)
        self._pool_sums: dict[int, tuple[torch.Tensor, int]] = {}  # mean pooling: (sum, rows) by sequence id
        # weights quantised at load give other KV than the checkpoint's: another model to a peer
        model_id = self.model_name if config.quantization is None else f"{self.model_name}+{config.quantization}"
        if config.quantized_activations != "float32":  # other numerics, other KV
            model_id += f"+a{config.quantized_activations}"
            if config.quantized_activations == "int8":  # act blocks: the weight's group capped at 256 (#35)
                model_id += f"b{quant.ACT_BLOCKS[0]}"
        # a TP engine's blocks go on the wire in the TP=1 layout (atomd/engine/tp_pd.py): every KV head
        kv_heads = kv.heads if split is None else split.num_kv_heads
        # --tp-kv-transfer direct: the workers' slices on the wire as they lie (tp_pd.direct_rows)
        self.tp_direct = self.tp_workers is not None and config.kv_role != "both" and config.tp_kv_transfer == "direct"
        direct = {"tp_size": split.size, "tp_rows": self.kv_cache.num_blocks} if self.tp_direct else {}
        self.compat = compat_fingerprint(model_id, config.dtype, config.block_size, kv_layers, kv_heads, kv.head_dim,
                                         kv.version, kv_cache_dtype=kv_dtype_name(kv_dtype), **direct)
        self.tp_staging = self.tp_direct_connector = None
        if self.tp_workers is not None and config.kv_role != "both" and not self.tp_direct:
            self.tp_staging = TPKVStaging(self.tp_workers.kv_all, kv_heads, kv_dtype_name(kv_dtype))
        eos = self.tokenizer.eos_token_id
        if eos is None and isinstance(mcfg.eos_token_id, int):
            eos = mcfg.eos_token_id
        self._end_token_ids = [t for t in [eos, *self.tokenizer.stop_token_ids] if t is not None]
        grammars = GrammarCompiler((model_dir / "tokenizer.json").read_text(), mcfg.vocab_size, self._end_token_ids)
        self.sampler = Sampler(config.seed, self._end_token_ids, grammars)  # end tokens: banned before min_tokens
        if mtp is not None:
            self.proposer = MtpProposer(self.model, mtp, spec.num_speculative_tokens, config.max_model_len,
                                        self.kv_cache, self.runner.kernels, self.tp_workers)
        elif spec is not None:
            self.proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                          spec.prompt_lookup_max, config.max_model_len)
        if spec is not None:
            self.spec_control = SpecController(spec.num_speculative_tokens)
        prefix_caching = config.enable_prefix_caching
        if prefix_caching and has_long_rows(mcfg, config.max_model_len):
            # a block's KV depends on the step that computed it (long factors once the step reaches past
            # the original length, transformers' rule), which its hash cannot name: a hit could reuse the other kind
            log.warning("longrope past original_max_position_embeddings=%d (max_model_len=%d): prefix caching is off",
                        mcfg.rope_scaling["original_max_position_embeddings"], config.max_model_len)
            prefix_caching = False
        kv_blocks = self.kv_cache.as_numpy_blocks() if self.tp_workers is None or config.kv_role == "both" else \
            direct_rows(self.tp_workers.kv_all) if self.tp_direct else self.tp_staging.blocks
        self._start(self.kv_cache.num_blocks, kv_blocks, eos, prefill_delayer, model_dir,
                    prefix_caching=prefix_caching, kv_window=max(mcfg.layer_windows) if mcfg.all_windowed else None)
        if mtp is not None:  # chained drafts past a sequence's blocks borrow scratch blocks there
            self.proposer.pool = self.scheduler.block_manager.pool
        if self.tp_staging is not None and config.kv_role == "consumer":  # landed pulls -> the workers' slices
            self.kv_connector = TPStagedConnector(self.kv_connector, self.tp_staging)

    def _make_connector(self, kv_blocks: Any):
        connector = super()._make_connector(kv_blocks)
        if not self.tp_direct:
            return connector
        self.tp_direct_connector = TPDirectConnector(
            connector, tp_layout(self.compat, self.tp_workers.kv_all.shape[3]), self.kv_cache.num_blocks, kv_blocks)
        return self.tp_direct_connector

    def close(self) -> None:
        super().close()
        if self.tp_workers is not None:
            self.tp_workers.close()

    def check_alive(self) -> None:
        if self.tp_workers is not None:
            self.tp_workers.check_alive()

    def _load_adapter(self, name: str, path: str):
        """A PEFT adapter for this model (ValueError naming what is wrong, also an unreadable file)."""
        try:
            if self.tp_workers is not None:  # checked against the whole model, then this rank's part
                return load_tp_adapter(name, path, self.tp_workers.model_config, self.tp_workers.split,
                                       self.model.dtype, self.config.max_lora_rank)
            load = load_deepseek_adapter if isinstance(self.model, DeepseekModel) else load_adapter  # MLA's linears
            return load(name, path, self.model.config, self.model.dtype, self.config.max_lora_rank)
        except ValueError:
            raise
        except Exception as e:  # a missing or corrupt file: the caller's 400, not the engine's death
            raise ValueError(f"LoRA adapter {name!r} at {path}: {type(e).__name__}: {e}") from None

    def _check_grammar(self, grammar: StructuredOutputsParams) -> None:
        try:  # compiled once per distinct grammar (cached)
            self.sampler.grammars.compile(grammar)
        except ValueError as e:
            raise ValueError(f"structured_outputs: the grammar does not compile: {e}") from None

    def _forget(self, seq_id: int) -> None:
        self.sampler.forget(seq_id)
        self._pool_sums.pop(seq_id, None)
        super()._forget(seq_id)

    # ------------------------------------------------------------------ embeddings (pooling)

    def _pooling_rows(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[tuple[int, int, int]]] | None:
        """The packed rows whose hidden states embedding sequences pool in this prefill, and
        per such sequence (batch index, first of its rows in the result, how many): mean, every
        row it forwards; last, its last row once its prompt is done."""
        parts, spans, at = [], [], 0
        ends = np.cumsum(batch.num_scheduled_tokens)
        for i, seq in enumerate(batch.seqs):
            pooling = seq.sampling_params.pooling
            if pooling is None:
                continue
            end = int(ends[i])
            start = end - int(batch.num_scheduled_tokens[i])
            if pooling == "mean":
                rows = np.arange(start, end)
            elif batch.needs_sample[i]:
                rows = np.array([end - 1])
            else:
                continue
            parts.append(rows)
            spans.append((i, at, len(rows)))
            at += len(rows)
        if not parts:
            return None
        return torch.from_numpy(np.concatenate(parts)), spans

    def _pool(self, batch: ScheduledBatch, spans: list[tuple[int, int, int]], hidden: torch.Tensor) -> None:
        """Fold this chunk's rows into each sequence's pooled vector (float32; a chunk that
        starts at position 0, a first pass or a recompute after preemption, starts over); the
        last chunk leaves the vector for the request's last output."""
        for i, first, count in spans:
            seq = batch.seqs[i]
            rows = hidden[first:first + count].float()
            if seq.sampling_params.pooling == "mean":
                total, n = self._pool_sums.get(seq.id, (None, 0)) if batch.num_computed_tokens[i] else (None, 0)
                chunk = rows.sum(dim=0)
                total, n = (chunk if total is None else total + chunk), n + count
                self._pool_sums[seq.id] = (total, n)
                if not batch.needs_sample[i]:
                    continue
                vector = total / n
                del self._pool_sums[seq.id]
            else:
                vector = rows[-1]
            self._embeddings[seq.request_id] = vector.tolist()

    def kernels_info(self) -> Any:
        return cbuild.kernel_paths()

    def _idle_step(self) -> None:
        ep = self.model.ep
        if ep is not None and ep.anyone_has_rows(False):  # the others' tokens still need this rank's experts
            self.model.idle_forward()
            if isinstance(self.proposer, MtpProposer):  # and the MTP layer's, each pass
                self.proposer.idle()

    def stats(self) -> dict[str, Any]:
        """Plus the expert load counters: (token, choice) pairs each expert ran here, summed
        over the sparse layers (`expert_tokens`: [[expert id, n], ...], the experts this rank
        owns, and any other a replica slot ran)."""
        sparse = [w.moe for w in self.model.layers if w.moe is not None]
        out = super().stats()
        if sparse:
            first, owned = sparse[0].first_expert, len(sparse[0].gate_up) - (
                self.model.ep.replica_slots if self.model.ep is not None else 0)
            total = sum(m.routed for m in sparse).tolist()
            out["expert_tokens"] = [[e, n] for e, n in enumerate(total) if n or first <= e < first + owned]
        if self.model.ep is not None:
            out["expert_parallel"] = self.model.ep.stats()
        if self.tp_workers is not None:
            copies = self.tp_staging if self.tp_staging is not None else self.tp_direct_connector
            out["tensor_parallel"] = {"size": self.config.tensor_parallel_size, "worker_pids": self.tp_workers.pids,
                                      "kv_transfer": "direct" if self.tp_direct else "staging",
                                      # bytes copied locally around the pulls: what the staging copies gathered /
                                      # scattered; direct: a replicated KV head's copies on landing (else none)
                                      "kv_staging_bytes": copies.copied_bytes if copies is not None else 0}
        return out

    def _forward(self, batch: ScheduledBatch) -> ScheduledBatchOutput:
        if self.model.ep is not None:  # the step's expert-parallel gate: this rank has rows
            self.model.ep.anyone_has_rows(True)
        if batch.block_copies:  # copy-on-write of blocks shared by forked choices, before any write
            src, dst = zip(*batch.block_copies)
            kv = self.kv_cache.kv
            kv[list(dst)] = kv[list(src)]
        want_prompt = batch.is_prefill and any(s.prompt_logprobs is not None for s in batch.seqs)
        # speculative decoding: the runner returns every scheduled row's logits; row j of a
        # sequence samples the token after its j-th draft, as if drafts[:j] were accepted
        verify = not batch.is_prefill and any(batch.spec_token_ids)
        pooled = self._pooling_rows(batch) if batch.is_prefill else None
        mtp = self.proposer if isinstance(self.proposer, MtpProposer) else None
        if mtp is not None:  # the MTP layer reads every row's hidden state
            logits, hidden = self.runner.execute(batch, all_logits=want_prompt,
                                                 hidden_indices=torch.arange(batch.num_tokens))
            if pooled is not None:
                self._pool(batch, pooled[1], hidden[pooled[0]])
        elif pooled is not None:
            logits, hidden = self.runner.execute(batch, all_logits=want_prompt, hidden_indices=pooled[0])
            self._pool(batch, pooled[1], hidden)
        else:
            logits = self.runner.execute(batch, all_logits=want_prompt)
        if self.tp_staging is not None and self.config.kv_role == "producer":  # what D may pull, in its wire layout
            self.tp_staging.gather(written_blocks(batch, self.config.block_size))
        prompt_entries = None
        if want_prompt:
            logits, prompt_entries = self._prompt_logprobs(batch, logits)
        rows = np.flatnonzero(batch.needs_sample).tolist()
        token_ids: list[list[int]] = [[] for _ in batch.seqs]
        logprobs: list[list[Any]] | None = None
        fork_ids: list[list[int]] | None = None
        fork_entries: list[list[Any]] | None = None
        sampled: list[list[int]] = [[] for _ in batch.seqs]  # every row's sample (the MTP's next tokens)
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
                sampled[i] = tokens[at:at + n + 1]
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
        if mtp is not None:
            mtp.run(batch, hidden, *self.runner.last_step, self.kv_cache, sampled, token_ids)
        next_drafts = None
        if self.proposer is not None and rows:
            next_drafts = self._propose(batch, rows, token_ids)
        if mtp is not None:
            mtp.end_step()
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
