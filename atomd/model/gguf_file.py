"""GGUF files (llama.cpp's format) as atomd checkpoints, torch-free: the API process resolves
`--model file.gguf` too (atomd/model/hub.py).

`--model` a .gguf file, or a directory holding exactly one .gguf and no config.json, becomes a
checkpoint directory in the cache (`<cache>/gguf/<name>-<key>`, written once through a temp dir
and a rename; the key covers the file's path, size and mtime): config.json made from the GGUF
metadata (with `gguf_file`, the file's path, which sends atomd/model/loader.py to
atomd/model/gguf_weights.py for the tensors), and tokenizer.json + tokenizer_config.json
(chat template, bos / eos) made from the metadata's byte-level BPE vocabulary, or copied from
the directory when it holds its own tokenizer.json. The weights stay in the GGUF file.

The file (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): "GGUF", version (2, 3),
tensor and key-value counts, the key-values (typed, arrays included), per tensor its name,
dims (innermost first), ggml type and offset, then the tensor data from the next multiple of
general.alignment (32 by default). Little-endian only.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import struct
import tempfile
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

FORMAT_VERSION = "atomd-gguf-3"  # in the cache key: a change to what is written here rebuilds the directories
# metadata value types: struct code, or None for string (8), array (9)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
# ggml type -> (name, values per block, bytes per block)
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
              7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84),
              11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
              15: ("Q8_K", 256, 292), 30: ("BF16", 1, 2)}
# general.architecture -> the HF architecture it loads as; llama.cpp writes Llama's q / k rows
# permuted for its interleaved rotary (convert_hf_to_gguf.py's `permute`), undone at load
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM"}  # llama with experts: Mixtral
PERMUTED_QK = frozenset({"llama"})
# tokenizer.ggml.pre -> the split before byte-level BPE, as the HF tokenizers llama.cpp names them
# (None: GPT-2's own, ByteLevel's use_regex)
_LETTERS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PRE_TOKENIZERS: dict[str, str | None] = {
    "default": None, "gpt-2": None,
    "llama-bpe": _LETTERS + r"\p{N}{1,3}" + _REST, "llama3": _LETTERS + r"\p{N}{1,3}" + _REST,
    "qwen2": _LETTERS + r"\p{N}" + _REST,
}
MAX_METADATA_ITEMS = 1 << 24  # an array or count past this is a broken file, not a vocabulary
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values that are added tokens
# the others, by name only (refused by name: atomd reads none of them)
OTHER_GGML_TYPES = {16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
                    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 34: "TQ1_0",
                    35: "TQ2_0", 39: "MXFP4"}


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: outermost first (GGUF stores innermost first)
    type: int  # ggml type (GGML_TYPES)
    offset: int  # from the file's start

    @property
    def type_name(self) -> str:
        known = GGML_TYPES.get(self.type)
        return known[0] if known else OTHER_GGML_TYPES.get(self.type, f"ggml type {self.type}")

    @property
    def nbytes(self) -> int:
        _, per, size = GGML_TYPES[self.type]
        return int(np.prod(self.shape)) // per * size


class GGUFFile:
    """The metadata and tensor table of a GGUF file; `raw(name)` a tensor's bytes (memory-mapped)."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        with self.path.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic)")
            version, n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))
            if version not in (2, 3):
                raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 and 3)")
            if n_tensors > MAX_METADATA_ITEMS or n_kv > MAX_METADATA_ITEMS:
                raise ValueError(f"{self.path}: {n_tensors} tensors / {n_kv} keys: not a sane GGUF file")
            self.metadata = {}
            for _ in range(n_kv):
                key = _string(f)
                self.metadata[key] = _value(f, _unpack(f, "I"))
            infos = []
            for _ in range(n_tensors):
                name = _string(f)
                n_dims = _unpack(f, "I")
                if not 1 <= n_dims <= 4:  # GGML_MAX_DIMS
                    raise ValueError(f"{self.path}: tensor {name} has {n_dims} dimensions: not a sane GGUF file")
                dims = struct.unpack(f"<{n_dims}Q", _read(f, 8 * n_dims))
                infos.append((name, tuple(reversed(dims)), _unpack(f, "I"), _unpack(f, "Q")))
            align = int(self.metadata.get("general.alignment", 32))
            start = -(-f.tell() // align) * align
        size = self.path.stat().st_size
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, type_, offset in infos:
            info = TensorInfo(name, shape, type_, start + offset)
            if type_ in GGML_TYPES and info.offset + info.nbytes > size:
                raise ValueError(f"{self.path}: tensor {name} runs past the end of the file (truncated?)")
            self.tensors[name] = info
        self._map: np.memmap | None = None

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, uint8, read-only view of the mapped file."""
        info = self.tensors[name]
        if info.type not in GGML_TYPES:
            raise ValueError(f"{self.path}: tensor {name} has {info.type_name}, which atomd does not read")
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._map[info.offset:info.offset + info.nbytes]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


def _unpack(f: BinaryIO, code: str) -> Any:
    return struct.unpack("<" + code, _read(f, struct.calcsize("<" + code)))[0]


def _string(f: BinaryIO) -> str:
    n = _unpack(f, "Q")
    if n > 1 << 28:
        raise ValueError(f"GGUF string of {n} bytes: not a sane file")
    return _read(f, n).decode("utf-8", errors="replace")


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError("GGUF file ends inside its header (truncated?)")
    return data


def _value(f: BinaryIO, kind: int) -> Any:
    if kind in _SCALARS:
        return _unpack(f, _SCALARS[kind])
    if kind == 8:
        return _string(f)
    if kind == 9:
        item, n = _unpack(f, "I"), _unpack(f, "Q")
        if n > MAX_METADATA_ITEMS:
            raise ValueError(f"GGUF array of {n} items: not a sane file")
        if item in _NUMPY:  # numbers in one read (token scores, types)
            return np.frombuffer(_read(f, n * np.dtype(_NUMPY[item]).itemsize), _NUMPY[item]).tolist()
        return [_value(f, item) for _ in range(n)]
    raise ValueError(f"GGUF metadata value of unknown type {kind}")


# ---------------------------------------------------------------------- the checkpoint directory


def checkpoint_dir(gguf: pathlib.Path) -> pathlib.Path:
    """The cached checkpoint directory of `gguf` (module docstring), made if missing."""
    from atomd.model.default import cache_root

    gguf = gguf.resolve()
    stat = gguf.stat()
    beside = gguf.parent / "tokenizer.json"
    tok_stat = beside.stat().st_mtime_ns if beside.is_file() else None
    key = hashlib.sha256(json.dumps([FORMAT_VERSION, str(gguf), stat.st_size, stat.st_mtime_ns, tok_stat])
                         .encode()).hexdigest()[:16]
    target = cache_root() / "gguf" / f"{gguf.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        write_checkpoint_dir(GGUFFile(gguf), tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process (the engine core, the API) made it first: theirs is the same
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_checkpoint_dir(gg: GGUFFile, out: pathlib.Path) -> None:
    hf = hf_config(gg)
    beside = gg.path.parent / "tokenizer.json"
    if beside.is_file():  # the model's own tokenizer: used as it is, with its config where there is one
        shutil.copyfile(beside, out / "tokenizer.json")
        for extra in ("tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
            if (gg.path.parent / extra).is_file():
                shutil.copyfile(gg.path.parent / extra, out / extra)
        if not (out / "tokenizer_config.json").is_file():
            (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(gg)))
    else:
        (out / "tokenizer.json").write_text(json.dumps(tokenizer_json(gg)))
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(gg)))
    (out / "config.json").write_text(json.dumps(hf, indent=1))


def hf_config(gg: GGUFFile) -> dict[str, Any]:
    """The config.json a Hugging Face checkpoint of this model would have, from the metadata."""
    arch = gg.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported: atomd loads {', '.join(ARCHITECTURES)} GGUF files")
    m = lambda key, default=None: gg.get(f"{arch}.{key}", default)  # noqa: E731
    scaling = m("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported (unscaled rotary only)")
    if "rope_freqs.weight" in gg.tensors:
        raise ValueError("GGUF with rope_freqs.weight (Llama 3.1-style rotary frequency factors) is not supported")
    heads = int(m("attention.head_count"))
    hidden = int(m("embedding_length"))
    head_dim = int(m("attention.key_length", hidden // heads))
    if int(m("attention.value_length", head_dim)) != head_dim:
        raise ValueError("GGUF with attention.value_length != key_length is not supported")
    if int(m("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"GGUF with partial rotary ({m('rope.dimension_count')} of {head_dim} dims) is not supported")
    embed = gg.tensors.get("token_embd.weight")
    if embed is None:
        raise ValueError(f"{gg.path} has no token_embd.weight")
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch,
        "vocab_size": embed.shape[0], "hidden_size": hidden,  # the embedding's rows (a vocabulary may be shorter)
        "intermediate_size": int(m("feed_forward_length", 0)), "num_hidden_layers": int(m("block_count")),
        "num_attention_heads": heads, "num_key_value_heads": int(m("attention.head_count_kv", heads)),
        "head_dim": head_dim, "rms_norm_eps": float(m("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(m("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(m("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in gg.tensors, "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in gg.tensors, "mlp_bias": "blk.0.ffn_down.bias" in gg.tensors,
        "bos_token_id": gg.get("tokenizer.ggml.bos_token_id"), "eos_token_id": gg.get("tokenizer.ggml.eos_token_id"),
        "gguf_file": str(gg.path.resolve()),
    }
    if arch == "qwen2":  # Qwen2's q / k / v always have a bias, its o_proj none (ModelConfig's qkv_bias)
        hf["attention_bias"] = False
    experts = int(m("expert_count", 0))
    if experts:  # llama.cpp's MoE: softmax top-k, the k weights renormalised (its qwen3moe always does)
        if m("expert_shared_count", 0) or m("expert_gating_func", 1) != 1:
            raise ValueError(f"GGUF {arch} with shared experts or a gating function but softmax is not supported")
        hf.update(num_experts_per_tok=int(m("expert_used_count")), norm_topk_prob=True)
        if arch == "llama":
            hf.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=experts,
                      sliding_window=None)
        else:
            hf.update(num_experts=experts, moe_intermediate_size=int(m("expert_feed_forward_length")),
                      decoder_sparse_step=1, mlp_only_layers=[])
    return hf


def tokenizer_config(gg: GGUFFile) -> dict[str, Any]:
    tokens = gg.get("tokenizer.ggml.tokens") or []
    name = lambda key: tokens[gg.get(key)] if isinstance(gg.get(key), int) and gg.get(key) < len(tokens) else None  # noqa: E731
    config = {"bos_token": name("tokenizer.ggml.bos_token_id"), "eos_token": name("tokenizer.ggml.eos_token_id"),
              "pad_token": name("tokenizer.ggml.padding_token_id"), "unk_token": name("tokenizer.ggml.unknown_token_id")}
    if gg.get("tokenizer.chat_template") is not None:
        config["chat_template"] = gg.get("tokenizer.chat_template")
    return {k: v for k, v in config.items() if v is not None}


def tokenizer_json(gg: GGUFFile) -> dict[str, Any]:
    """A Hugging Face tokenizer.json for the metadata's vocabulary: byte-level BPE
    (tokenizer.ggml.model gpt2) with its pre-tokenizer by tokenizer.ggml.pre (PRE_TOKENIZERS), or
    SentencePiece's BPE (model llama: Llama 2, Mistral, ...; `sentencepiece_bpe`); control /
    user-defined tokens as added tokens, bos prepended when add_bos_token says so (SentencePiece:
    unless it says not, as llama.cpp). Others are refused: put the model's tokenizer.json beside
    the file."""
    model, pre = gg.get("tokenizer.ggml.model"), gg.get("tokenizer.ggml.pre", "default")
    hint = "; put the model's tokenizer.json beside the .gguf file"
    if model not in ("gpt2", "llama"):
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (byte-level BPE gpt2, SentencePiece "
                         f"BPE llama){hint}")
    if model == "gpt2" and pre not in PRE_TOKENIZERS:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported ({', '.join(PRE_TOKENIZERS)}){hint}")
    tokens, merges = gg.get("tokenizer.ggml.tokens"), gg.get("tokenizer.ggml.merges") or []
    if not tokens:
        raise ValueError(f"GGUF file has no vocabulary (tokenizer.ggml.tokens){hint}")
    types = gg.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": kind == TOKEN_CONTROL}
             for i, (t, kind) in enumerate(zip(tokens, types)) if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
    post = None
    bos = gg.get("tokenizer.ggml.bos_token_id")
    if gg.get("tokenizer.ggml.add_bos_token", model == "llama") and isinstance(bos, int) and 0 <= bos < len(tokens):
        post = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": tokens[bos], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": tokens[bos], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {tokens[bos]: {"id": tokens[bos], "ids": [bos], "tokens": [tokens[bos]]}}}
    head = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "post_processor": post}
    if model == "llama":
        return {**head, **sentencepiece_bpe(tokens, merges, gg.get("tokenizer.ggml.scores"), hint)}
    regex = PRE_TOKENIZERS[pre]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": regex is None}
    pre_tokenizer = byte_level if regex is None else {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}, byte_level]}
    return {**head, "normalizer": None, "pre_tokenizer": pre_tokenizer,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": pre in ("llama-bpe", "llama3"),
                      "vocab": {t: i for i, t in enumerate(tokens)}, "merges": list(merges)}}


def sentencepiece_bpe(tokens: list[str], merges: list[str], scores: list[float] | None, hint: str) -> dict[str, Any]:
    """The parts of a SentencePiece BPE tokenizer.json, as transformers' LlamaTokenizer builds it
    ("\u2581" for spaces, one prepended to the text, bytes outside the vocabulary as <0xNN>
    tokens). A SentencePiece GGUF lists no merges: they are recovered from the vocabulary as
    transformers' generate_merges does: every split of a token into two tokens, by the token's
    score, highest first (then the longer left, then the longer right piece; ties in
    vocabulary order)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    if not merges:
        if scores is None or len(scores) != len(tokens):
            raise ValueError(f"GGUF SentencePiece vocabulary without merges or one score per token{hint}")
        pairs = []
        for token, score in zip(tokens, scores):
            splits = [(token[:i], token[i:], float(score)) for i in range(1, len(token))
                      if token[:i] in vocab and token[i:] in vocab]
            pairs.extend(sorted(splits, key=lambda p: (vocab[p[0]], vocab[p[1]])))
        pairs.sort(key=lambda p: (p[2], len(p[0]), len(p[1])), reverse=True)
        merges = [f"{left} {right}" for left, right, _ in pairs]
    return {"normalizer": None,
            "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False},
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                      "vocab": vocab, "merges": list(merges)}}
