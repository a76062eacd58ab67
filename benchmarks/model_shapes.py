"""Benchmark checkpoints shaped like real small models, with random weights (no download
possible here): made once with transformers into the atomd cache, with the built-in
model's tokenizer (prompt ids stay below its 4096; ids the tokenizer lacks decode to
nothing, which the benchmarks' ignore_eos runs do not mind).

    smollm-135m: SmolLM2-135M's shape: hidden 576, 30 layers, 9 query / 3 KV heads (head
    dim 64), intermediate 1536, vocabulary 49152, tied embeddings, float32 (~540 MB).
    A 512-token prefill there costs dozens of decode steps, as on real deployments; on
    the built-in model (hidden 256, 4 layers) it costs a few.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import sys
import tempfile

from atomd.model.default import cache_root, default_model_dir

SHAPES = {
    "smollm-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                        head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                        max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=100000.0),
}
CHOICES = ["builtin", *SHAPES]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def model_dir(shape: str) -> pathlib.Path:
    """The checkpoint directory of `shape` ("builtin": the default model), made on first use."""
    if shape == "builtin":
        return default_model_dir()
    target = cache_root() / f"shape-{shape}-random"
    if (target / "model.safetensors").is_file():
        return target
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    print(f"writing a random-weight {shape}-shaped checkpoint to {target} (once)", file=sys.stderr, flush=True)
    builtin = default_model_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        torch.manual_seed(0)
        config = LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2, pad_token_id=0,
                             torch_dtype="float32")
        LlamaForCausalLM(config).save_pretrained(tmp, safe_serialization=True)
        for name in TOKENIZER_FILES:
            shutil.copyfile(builtin / name, tmp / name)
        os.chmod(tmp, 0o755)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
