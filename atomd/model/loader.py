"""Load a local Hugging Face checkpoint directory (config.json + safetensors, single file or
sharded with model.safetensors.index.json) into its family's model (atomd/model/registry.py).

Errors name what is wrong: the unsupported architecture, or the missing tensor and the
file it was expected in.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import pathlib

import torch
from safetensors import safe_open

from atomd.model import gguf_weights, quant, quant_formats, registry
from atomd.model.hub import read_hf_config
from atomd.model.config import ModelConfig
from atomd.model.decoder import DecoderModel
from atomd.model.tensor_parallel import ShardedSource
from atomd.model.tp_split import TPSplit, check_split, shard_config

log = logging.getLogger(__name__)
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def read_config(model_dir: str | pathlib.Path) -> ModelConfig:
    hf = read_hf_config(model_dir)
    arch = registry.architecture(hf)
    return registry.model_class(arch).config_from_hf(hf, arch)


class _TensorSource:
    """Tensor name -> tensor across the checkpoint's safetensors files."""

    def __init__(self, model_dir: pathlib.Path):
        self.dir = model_dir
        if (model_dir / INDEX_FILE).is_file():
            with (model_dir / INDEX_FILE).open() as f:
                self.where = json.load(f)["weight_map"]
            self.described = INDEX_FILE
        elif (model_dir / SINGLE_FILE).is_file():
            with safe_open(model_dir / SINGLE_FILE, framework="pt") as f:
                self.where = {name: SINGLE_FILE for name in f.keys()}
            self.described = SINGLE_FILE
        else:
            raise ValueError(f"model directory {model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")
        self._open: dict[str, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def _file(self, name: str):
        file = self.where.get(name)
        if file is None:
            raise ValueError(f"checkpoint {self.dir} is missing tensor {name!r} (not in {self.described})")
        if file not in self._open:
            path = self.dir / file
            if not path.is_file():
                raise ValueError(f"checkpoint {self.dir}: {self.described} puts {name!r} in missing file {file}")
            self._open[file] = safe_open(path, framework="pt")
        return self._open[file]

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        # always a copy: a tensor of the stored dtype is a view of the file's mmap, and one kept
        # (a float32 model's norms, router, embedding) keeps the whole file mapped and its read
        # pages in the process's RSS (the Qwen3-MoE shape's int8 engine: 5.8 GB of a 7.8 GB RSS)
        return self._file(name).get_tensor(name).to(dtype, copy=True)

    def stored_dtype(self, name: str) -> str:
        """How the checkpoint stores `name` (safetensors' code: F32, BF16, F16, ...)."""
        return self._file(name).get_slice(name).get_dtype()


def load_model(model_dir: str | pathlib.Path, dtype: torch.dtype = torch.float32,
               max_positions: int | None = None, quantization: str | None = None,
               activations: str = "float32", expert_shard: tuple[int, int] | None = None,
               tp: TPSplit | None = None) -> DecoderModel:
    """The checkpoint's model; RoPE tables cover `max_positions` (default: the model's own).
    A checkpoint with quantization_config loads its packed linears as they are;
    `quantization` (int8, int4) quantises a float checkpoint's (atomd/model/quant_formats.py);
    `activations` int8: the quantized linears quantise their activations (quant.use_int8_activations).
    `expert_shard` (rank, ranks): load only rank's slice of each sparse layer's experts.
    `tp` (tp_split's): load that tensor-parallel worker's shard (atomd/model/tensor_parallel.py);
    its config has that worker's heads and MLP rows."""
    model_dir = pathlib.Path(model_dir)
    cfg = whole = read_config(model_dir)  # whole: the checkpoint's sources read it unsplit, then it is sliced
    split = tp
    if split is not None:
        cfg = shard_config(cfg, split)
    if expert_shard is not None:
        rank, ranks = expert_shard
        if not cfg.sparse_layers:
            raise ValueError(f"expert parallelism needs an MoE model; {cfg.architecture} has no sparse layers")
        if cfg.num_experts % ranks:
            raise ValueError(f"expert parallelism: {cfg.num_experts} experts do not split evenly over "
                             f"data_parallel_size={ranks} ranks")
        cfg = dataclasses.replace(cfg, expert_rank=rank, expert_ranks=ranks)
    cls = registry.model_class(cfg.architecture)
    gguf = read_hf_config(model_dir).get("gguf_file")  # a GGUF file's directory (atomd/model/gguf_file.py)
    src = gguf_weights.GGUFSource(gguf, whole) if gguf else cls.tensor_source(_TensorSource(model_dir), whole)
    if gguf and src.quantized and quantization:
        raise ValueError(f"--quantization {quantization}: the checkpoint is already quantized (GGUF {gguf})")
    method = cfg.quantization["quant_method"] if cfg.quantization else quantization
    if method is not None:
        if cfg.quantization and quantization:
            raise ValueError(f"--quantization {quantization}: the checkpoint is already quantized ({method})")
        if cfg.sparse_layers and cfg.quantization:  # --quantization's round-to-nearest covers experts
            raise ValueError(f"{cfg.architecture}: quantized checkpoints ({method}) are not supported for MoE models")
    # the run's dtype is --dtype's, whatever the checkpoint's: said, since a cast changes speed
    log.info("weights stored as %s, run as %s", src.stored_dtype("model.embed_tokens.weight"),
             str(dtype).removeprefix("torch."))
    if method is not None:
        log.info("linear weights: %s, activations %s", method, str(dtype).removeprefix("torch."))
        src = quant_formats.CheckpointSource(src, cfg.quantization) if cfg.quantization else \
            quant_formats.RoundToNearest(src, quantization)
    if split is not None:  # sliced after quantising: each worker's part of the unsplit weight's integers and scales
        # TP x EP: rank 0 runs its DP rank's experts whole (the exchange is its own), the others none
        experts = "split" if expert_shard is None else "whole" if split.rank == 0 else "none"
        src = sharded_source(src, whole, split, q8_aligned=activations == "int8", experts=experts)
    embed = src.get("model.embed_tokens.weight", dtype)
    if cfg.tie_word_embeddings:  # a GGUF's packed token_embd stays packed as the head (llama.cpp's choice)
        lm_head = src.tied_head(embed) if gguf else embed
    else:
        lm_head = src.get("lm_head.weight", dtype)
    if quantization is not None:  # batch-1 decode reads it whole every token: SmolLM2-135M's is 113 of 540 MB
        lm_head = quant.quantize(lm_head, quant.LM_HEAD_QUANTIZATION[quantization])
    layers = [cls.load_layer(src, cfg, i, dtype) for i in range(cfg.num_layers)]
    if activations == "int8":
        packed = [t for w in layers for t in w.linears() if isinstance(t, quant.QuantizedWeight)]
        # the MoE experts' too (moe.py runs them in one C call a block, layer_ops.moe_q8)
        packed += [t for w in layers if getattr(w, "moe", None) is not None for t in w.moe.linears()]
        packed += [lm_head] if isinstance(lm_head, quant.QuantizedWeight) else []
        if not packed:
            raise ValueError("--quantized-activations int8 needs quantized linears (--quantization, a GPTQ / AWQ / "
                             "compressed-tensors checkpoint or a quantized GGUF file)")
        switched = quant.use_int8_activations(packed)
        blocks = sorted({t.act_block for t in packed if t.int8_activations})
        log.info("int8 activations: %d of %d quantized linears, act blocks of %s inputs (the rest: inputs or groups "
                 "not whole blocks of %d)", switched, len(packed), " / ".join(map(str, blocks)) or "-", quant.Q8_BLOCK)
    model = cls(config=cfg, embed=embed, layers=layers,
                norm=src.get("model.norm.weight", dtype), lm_head=lm_head,
                max_positions=max_positions or cfg.max_position_embeddings)
    model.tp_experts_rank0 = split is not None and expert_shard is not None
    return model


def sharded_source(src, whole: ModelConfig, split: TPSplit, q8_aligned: bool = False,
                   experts: str = "split") -> ShardedSource:
    """Worker split.rank's slice of `src` (a checkpoint of the whole model `whole`)."""
    mla = (whole.qk_head_dim, whole.qk_nope_head_dim + whole.v_head_dim, whole.v_head_dim) \
        if getattr(whole, "kv_lora_rank", 0) else None
    return ShardedSource(src, split, q8_aligned=q8_aligned, mla=mla, experts=experts)


def tp_split(cfg: ModelConfig, rank: int, size: int) -> TPSplit:
    """Worker rank's part of this model under tensor parallelism (ValueError naming the numbers
    when `size` workers cannot split it)."""
    inters = [cfg.intermediate_size] + ([cfg.moe_intermediate_size] if cfg.sparse_layers else [])
    # MLA (DeepSeek): one latent "KV head" a token, replicated on every worker (each caches it whole)
    kv_heads = 1 if getattr(cfg, "kv_lora_rank", 0) else cfg.num_kv_heads
    check_split(cfg.num_heads, kv_heads, inters, size, cfg.architecture)
    return TPSplit(rank, size, cfg.num_heads, kv_heads, cfg.head_dim, cfg.vocab_size)
