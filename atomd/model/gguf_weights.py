"""A GGUF file's tensors under Hugging Face's names: the TensorSource atomd/model/loader.py uses
for a checkpoint directory made by atomd/model/gguf_file.py (its config.json names the file).

Layer linears stored quantised become QuantizedWeights (atomd/model/quant.py) holding the same
integers and scales, exactly (w = q * scale + offset reproduces ggml's dequantisation, float32):
- Q8_0 (blocks of 32: fp16 d, 32 int8): int8, group 32, w = d * q;
- Q4_0 (blocks of 32: fp16 d, 16 bytes of nibbles, value i low / i + 16 high, as quant.py's
  int4 runs): int4, group 32, offset -8 d;
- Q4_1 (as Q4_0 with an fp16 minimum m after d): int4, group 32, offset m;
- Q5_0 / Q5_1 (as Q4_0 / Q4_1 with each value's fifth bit in a 32-bit qh before the nibbles):
  int8, group 32, w = d * (q - 16) / d * q + m;
- Q4_K (super-blocks of 256: fp16 d, dmin, 12 bytes of eight 6-bit scales and mins, 128
  bytes of nibbles, each 64 values in 32 bytes, first 32 low): int4, group 32, scale d * sc,
  offset -dmin * m;
- Q5_K (as Q4_K with a fifth bit per value in 32 more bytes): int8, group 32, same scale / offset;
- Q2_K (super-blocks of 256: 16 bytes of 4-bit scale / min pairs, 64 bytes of 2-bit values,
  fp16 d, dmin): int8, group 16, scale d * sc, offset -dmin * m;
- Q3_K (super-blocks of 256: 32 bytes of each value's third bit, 64 of 2-bit values, twelve
  bytes of sixteen 6-bit scales, fp16 d): int8, group 16, w = d * (sc - 32) * (q - 4 if the
  bit is clear);
- Q6_K (super-blocks of 256: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales,
  fp16 d): int8, group 16, w = d * sc * (q - 32).
Linears that share an input (q / k / v, gate / up) must be packed alike (quant.cat): when a
file stores them in different types (Q4_K_M's Q6_K v beside Q4_K q, k) all are int8 at the
finest group among them (still exact); a float one among them makes all float. F32 / F16 /
BF16 tensors, and everything outside the layer linears but a quantised output.weight (the LM
head, kept packed; a tied model's packed token_embd: floats for the lookup, packed for the
head), are floats of the run's dtype. Other ggml types are refused by name.
llama.cpp stores Llama's q / k rows permuted for its interleaved rotary; they are put back in
HF's order (a row permutation: exact for packed rows too).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import numpy as np
import torch

from atomd.model import quant
from atomd.model.config import ModelConfig
from atomd.model.gguf_file import PERMUTED_QK, GGUFFile, TensorInfo
from atomd.model.quant import QuantizedWeight

log = logging.getLogger(__name__)
FLOAT_TYPES = ("F32", "F16", "BF16")
PACKED_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_SIBLINGS = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"), ("ffn_gate_exps", "ffn_up_exps"))
_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
LAYER_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                 "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# MoE: the router, and each expert's linear as one slice of the layer's stacked [experts, out, in]
# tensor (Qwen3-MoE's and Mixtral's HF names)
_ROUTERS = ("mlp.gate", "block_sparse_moe.gate")
_EXPERT_NAME = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_LINEARS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps",
                   "w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}


def _module(gguf: str) -> str | None:
    """blk.3.attn_q.weight -> attn_q; None outside the layers."""
    parts = gguf.split(".")
    return parts[2] if parts[0] == "blk" and len(parts) == 4 else None


def gguf_name(name: str) -> str | None:
    """The GGUF tensor name of an HF one (None: no counterpart); an expert's: its layer's stacked
    tensor (expert_of says which slice)."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _EXPERT_NAME.fullmatch(name)
    if m is not None:
        return f"blk.{m.group(1)}.{_EXPERT_LINEARS[m.group(3)]}.weight" if m.group(3) in _EXPERT_LINEARS else None
    m = _LAYER_NAME.fullmatch(name)
    if m is not None and m.group(2) in _ROUTERS and m.group(3) == "weight":
        return f"blk.{m.group(1)}.ffn_gate_inp.weight"
    if m is None or m.group(2) not in _LAYER:
        return None
    return f"blk.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"


def expert_of(name: str) -> int | None:
    """The expert an HF expert weight's name names (None: not an expert's)."""
    m = _EXPERT_NAME.fullmatch(name)
    return None if m is None else int(m.group(2))


@dataclass
class IntWeight:
    """w[n, k] = values[n, k] * scales[n, k // group] + (offsets[n, k // group] or 0)."""
    values: np.ndarray  # int16 [N, K]
    scales: np.ndarray  # float32 [N, groups]
    offsets: np.ndarray | None
    bits: int  # what the values fit: 4 (0..15) or 8 (-128..127)
    group: int

    def rows(self, order: np.ndarray) -> "IntWeight":
        off = None if self.offsets is None else self.offsets[order]
        return IntWeight(self.values[order], self.scales[order], off, self.bits, self.group)

    def as_int8(self, group: int) -> "IntWeight":
        """The same weight as int8 values at `group` (a divisor of this one's): scales repeated."""
        rep = self.group // group
        off = np.zeros_like(self.scales) if self.offsets is None else self.offsets
        return IntWeight(self.values, np.repeat(self.scales, rep, axis=1), np.repeat(off, rep, axis=1), 8, group)

    def packed(self) -> QuantizedWeight:
        off = None if self.offsets is None else torch.from_numpy(np.ascontiguousarray(self.offsets))
        return quant.pack(torch.from_numpy(self.values), torch.from_numpy(np.ascontiguousarray(self.scales)), off,
                          self.bits, self.group)

    def dequantize(self) -> np.ndarray:
        g = lambda t: np.repeat(t, self.group, axis=1)  # noqa: E731
        w = self.values.astype(np.float32) * g(self.scales)
        return w if self.offsets is None else w + g(self.offsets)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> eight 6-bit scales and eight mins: sub-blocks 0..3 in the low
    6 bits of bytes 0..3 (scales) and 4..7 (mins); 4..7 in the nibbles of bytes 8..11 with their
    top two bits in the top bits of bytes 0..3 (scales) and 4..7 (mins)."""
    p = packed.astype(np.int32)
    lo_s, lo_m, hi = p[..., 0:4], p[..., 4:8], p[..., 8:12]
    sc = np.concatenate([lo_s & 63, (hi & 15) | ((lo_s >> 6) << 4)], axis=-1)
    mn = np.concatenate([lo_m & 63, (hi >> 4) | ((lo_m >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def int_weight(info: TensorInfo, raw: np.ndarray) -> IntWeight:
    """A packed 2-D tensor's integers and scales (module docstring)."""
    n, k = info.shape
    kind = info.type_name
    if kind in SMALL_BLOCK_BYTES:  # blocks of 32 values
        blocks = raw.reshape(n, k // 32, SMALL_BLOCK_BYTES[kind])
        d = _f16(blocks[..., 0:2])
        if kind == "Q8_0":
            return IntWeight(blocks[..., 2:].view(np.int8).reshape(n, k).astype(np.int16), d, None, 8, 32)
        m = _f16(blocks[..., 2:4]) if kind in ("Q4_1", "Q5_1") else None  # the block's minimum
        qs = blocks[..., -16:]  # value j in the low nibble of byte j, value j + 16 in its high one
        values = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, k // 32, 32).astype(np.int16)
        if kind == "Q4_0":
            return IntWeight(values.reshape(n, k), d, -8 * d, 4, 32)
        if kind == "Q4_1":
            return IntWeight(values.reshape(n, k), d, m, 4, 32)
        # Q5_0 / Q5_1: bit j of the 32-bit qh (little-endian, before qs) is value j's fifth bit
        qh = blocks[..., -20:-16].copy().view("<u4").astype(np.int64)  # [n, k / 32, 1]
        values = values | (((qh >> np.arange(32)) & 1) << 4).astype(np.int16)
        if kind == "Q5_0":  # w = d (q - 16)
            return IntWeight(values.reshape(n, k) - 16, d, None, 8, 32)
        return IntWeight(values.reshape(n, k), d, m, 8, 32)
    blocks = raw.reshape(n, k // 256, GGUF_BLOCK_BYTES[kind])
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks[..., 0:2])[..., None], _f16(blocks[..., 2:4])[..., None]
        sc, mn = _k_scales(blocks[..., 4:16])
        qs = blocks[..., -128:].reshape(n, k // 256, 4, 1, 32)  # per 64 values: 32 bytes, low nibbles first
        values = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(n, k // 256, 256).astype(np.int16)
        if kind == "Q5_K":  # bit 2j of qh[l]: value 64j + l; bit 2j + 1: value 64j + 32 + l
            qh = blocks[..., 16:48].astype(np.int16)
            bits = (qh[..., None, :] >> np.arange(8, dtype=np.int16)[:, None]) & 1  # [.., 8, 32]
            values = values | (bits.reshape(n, k // 256, 256) << 4)
        scales, offsets = (d * sc).reshape(n, -1), (-dmin * mn).reshape(n, -1)
        return IntWeight(values.reshape(n, k), scales, offsets, 4 if kind == "Q4_K" else 8, 32)
    if kind in ("Q2_K", "Q3_K"):
        # 2-bit values: per 128, 32 bytes, bits 2s..2s+1 of byte l are value 32 s + l; 16 groups of 16
        at = 16 if kind == "Q2_K" else 32
        qs = blocks[..., at:at + 64].reshape(n, k // 256, 2, 1, 32).astype(np.int16)
        low = ((qs >> (2 * np.arange(4, dtype=np.int16))[:, None]) & 3).reshape(n, k // 256, 256)
        if kind == "Q2_K":  # a byte per group: low nibble its scale, high nibble its min; then d, dmin
            sm = blocks[..., 0:16].astype(np.float32)
            d, dmin = _f16(blocks[..., 80:82])[..., None], _f16(blocks[..., 82:84])[..., None]
            scales, offsets = (d * (sm % 16)).reshape(n, -1), (-dmin * (sm // 16)).reshape(n, -1)
            return IntWeight(low.reshape(n, k), scales, offsets, 8, 16)
        # Q3_K: the third bit of value 32 b + l is bit b of hmask[l], and a clear bit means minus 4;
        # sixteen 6-bit scales (offset 32): low nibbles in bytes 0..7 (groups 0..7 low, 8..15 high
        # nibble), top 2 bits of group g at bits 2 (g // 4) of byte 8 + g % 4
        hm = blocks[..., 0:32].reshape(n, k // 256, 1, 32).astype(np.int16)
        high = ((hm >> np.arange(8, dtype=np.int16)[:, None]) & 1).reshape(n, k // 256, 256)
        packed = blocks[..., 96:108].astype(np.int16)
        g = np.arange(16)
        lo = (packed[..., g % 8] >> (4 * (g // 8))) & 15
        hi = (packed[..., 8 + g % 4] >> (2 * (g // 4))) & 3
        d = _f16(blocks[..., 108:110])[..., None]
        scales = (d * ((lo | (hi << 4)) - 32)).reshape(n, -1)
        return IntWeight((low - 4 * (1 - high)).reshape(n, k), scales, None, 8, 16)
    # Q6_K: per 128 values, ql 64 bytes (l: values l, l + 64 low / high nibble; l + 32: 32 + l, 96 + l)
    # and qh 32 bytes (bits 0-1: value l, 2-3: l + 32, 4-5: l + 64, 6-7: l + 96)
    ql = blocks[..., 0:128].reshape(n, k // 256, 2, 2, 32).astype(np.int16)
    qh = blocks[..., 128:192].reshape(n, k // 256, 2, 1, 32).astype(np.int16)
    low = np.concatenate([ql & 15, ql >> 4], axis=3)  # [.., half, 4 (l, l+32, l+64, l+96), 32]
    high = (qh >> (2 * np.arange(4, dtype=np.int16))[:, None]) & 3
    values = (low | (high << 4)) - 32
    sc = blocks[..., 192:208].view(np.int8).astype(np.float32)  # one per 16 values
    d = _f16(blocks[..., 208:210])[..., None]
    return IntWeight(values.reshape(n, k), (d * sc).reshape(n, -1), None, 8, 16)


GGUF_BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
GROUPS_OF_16 = {"Q2_K", "Q3_K", "Q6_K"}  # the types whose scales cover 16 values, not 32
SMALL_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24}


def float_array(info: TensorInfo, raw: np.ndarray) -> np.ndarray:
    """Any tensor atomd reads, as float32 in its numpy shape."""
    kind = info.type_name
    if kind == "F32":
        return raw.view(np.float32).reshape(info.shape)
    if kind == "F16":
        return raw.view(np.float16).astype(np.float32).reshape(info.shape)
    if kind == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(info.shape)
    return int_weight(info, raw).dequantize().reshape(info.shape)


class GGUFSource:
    """Tensor name (HF's) -> tensor or QuantizedWeight from a GGUF file, as loader.load_model asks."""

    def __init__(self, path: str, cfg: ModelConfig):
        self.file, self.cfg = GGUFFile(path), cfg
        self.permuted = self.file.get("general.architecture") in PERMUTED_QK
        for info in self.file.tensors.values():
            if info.type_name not in FLOAT_TYPES + PACKED_TYPES:
                raise ValueError(f"GGUF tensor {info.name} is {info.type_name}: atomd reads "
                                 f"{', '.join(FLOAT_TYPES + PACKED_TYPES)} tensors")
        types = {self.file.tensors[f"blk.{i}.{n}.weight"].type_name for i in range(cfg.num_layers)
                 for n in LAYER_LINEARS if f"blk.{i}.{n}.weight" in self.file.tensors}
        self.quantized = bool(types - set(FLOAT_TYPES))
        log.info("GGUF %s: layer linears %s", self.file.path.name, ", ".join(sorted(types)))

    def __contains__(self, name: str) -> bool:
        return gguf_name(name) in self.file.tensors

    def _info(self, name: str) -> TensorInfo:
        g = gguf_name(name)
        if g not in self.file.tensors:
            raise ValueError(f"GGUF file {self.file.path} is missing tensor {g or name!r} (for {name})")
        return self.file.tensors[g]

    def stored_dtype(self, name: str) -> str:
        return self._info(name).type_name

    def _rows(self, info: TensorInfo) -> np.ndarray | None:
        """The row order that undoes llama.cpp's q / k permutation (None: as stored)."""
        head = _module(info.name)
        if not self.permuted or head not in ("attn_q", "attn_k"):
            return None
        heads = self.cfg.num_heads if head == "attn_q" else self.cfg.num_kv_heads
        half = info.shape[0] // heads // 2  # GGUF row h*hd + 2i + a holds HF's h*hd + a*hd/2 + i
        return np.arange(info.shape[0]).reshape(heads, half, 2).transpose(0, 2, 1).reshape(-1)

    def tied_head(self, embed: torch.Tensor) -> torch.Tensor | QuantizedWeight:
        """The LM head of a tied model: token_embd packed where the file stores it packed (the
        head reads it whole every token), else the embedding itself."""
        info = self.file.tensors["token_embd.weight"]
        if info.type_name not in PACKED_TYPES:
            return embed
        return int_weight(info, self.file.raw(info.name)).packed()

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor | QuantizedWeight:
        info = self._info(name)
        order = self._rows(info)
        module = _module(info.name)
        layer_linear = module in LAYER_LINEARS and name.endswith(".weight")
        packed_head = info.name == "output.weight"
        raw = self.file.raw(info.name)
        expert = expert_of(name)
        if expert is not None:  # its slice of the layer's stacked experts
            if len(info.shape) != 3 or info.shape[0] != self.cfg.num_experts:
                raise ValueError(f"GGUF tensor {info.name} has shape {info.shape}: expected "
                                 f"[{self.cfg.num_experts} experts, out, in] (expert_count)")
            size = info.nbytes // info.shape[0]
            raw = raw[expert * size:(expert + 1) * size]
            info = TensorInfo(info.name, info.shape[1:], info.type, info.offset + expert * size)
        if info.type_name in PACKED_TYPES and (layer_linear or packed_head):
            siblings = next((s for s in _SIBLINGS if module in s), ()) if layer_linear else ()
            names = [f"blk.{info.name.split('.')[1]}.{s}.weight" for s in siblings]
            kinds = {self.file.tensors[n].type_name for n in names if n in self.file.tensors} | {info.type_name}
            if not kinds & set(FLOAT_TYPES):
                w = int_weight(info, raw)
                if len(kinds) > 1:  # stored differently from the linears it is concatenated with
                    w = w.as_int8(min(16 if kinds & GROUPS_OF_16 else 32, w.group))
                return (w if order is None else w.rows(order)).packed()
        w = float_array(info, raw)
        if order is not None:
            w = w[order]
        return torch.from_numpy(np.array(w, dtype=np.float32)).to(dtype)
