"""`--model` as a vLLM user types it: a local checkpoint directory, or a Hugging Face hub id
(`Qwen/Qwen3-0.6B`) found in the local hub cache, offline (nothing is downloaded).
Stdlib only (a GGUF file's directory is made by atomd/model/gguf_file.py, numpy): the API process
resolves it too, without torch."""
from __future__ import annotations

import json
import os
import pathlib


def hub_cache() -> pathlib.Path:
    """The hub cache huggingface_hub writes: $HF_HUB_CACHE, else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return pathlib.Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return pathlib.Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return pathlib.Path(xdg).expanduser() / "huggingface" / "hub"


def _gguf(path: pathlib.Path) -> pathlib.Path | None:
    """The GGUF file `--model path` names: itself, or the one .gguf of a directory without a
    config.json; None for anything else."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise ValueError(f"model directory {path} holds {len(found)} .gguf files "
                             f"({', '.join(p.name for p in found)}): give --model the one to serve")
        return found[0] if found else None
    return None


def model_path(model: str) -> pathlib.Path:
    """The checkpoint directory of `model`: a GGUF file's (or a directory holding one .gguf)
    made by atomd/model/gguf_file.py; a directory itself; else the cached
    snapshot of that hub id (the one refs/main names, or the only one); ValueError saying
    where it looked otherwise."""
    gguf = _gguf(pathlib.Path(model))
    if gguf is not None:  # llama.cpp's file: a checkpoint directory made from it, cached
        from atomd.model import gguf_file

        return gguf_file.checkpoint_dir(gguf)
    if os.path.isdir(model):
        return pathlib.Path(model)
    parts = model.split("/")
    if len(parts) != 2 or not all(parts) or model.startswith((".", "~")):
        raise ValueError(f"model must be a local Hugging Face checkpoint directory or a hub id like "
                         f"Qwen/Qwen3-0.6B, got {model!r}")
    repo = hub_cache() / f"models--{parts[0]}--{parts[1]}"
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file() and (snapshots / ref.read_text().strip()).is_dir():
        return snapshots / ref.read_text().strip()
    found = sorted(p for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
    if len(found) == 1:
        return found[0]
    why = "several snapshots and no refs/main" if found else "not in the Hugging Face cache"
    raise ValueError(f"model {model!r} is neither a local directory nor usable from the hub cache ({why}: "
                     f"looked in {repo}; set HF_HOME or HF_HUB_CACHE, or download it first with "
                     f"`huggingface-cli download {model}`)")


def read_hf_config(model_dir: str | pathlib.Path) -> dict:
    """A checkpoint directory's config.json, with AutoGPTQ's quantize_config.json beside it
    folded in as its quantization_config (atomd/model/loader.py, and --dtype auto's choice)."""
    path = pathlib.Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model directory {model_dir} has no config.json")
    with path.open() as f:
        hf = json.load(f)
    legacy = pathlib.Path(model_dir) / "quantize_config.json"  # AutoGPTQ's file beside config.json
    if legacy.is_file() and "quantization_config" not in hf:
        with legacy.open() as f:
            hf["quantization_config"] = {"quant_method": "gptq", **json.load(f)}
    return hf
