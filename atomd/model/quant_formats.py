"""Quantised weights at load: the TensorSources (atomd/model/loader.py) that hand the decoder
QuantizedWeights (atomd/model/quant.py) for its linears.

- RoundToNearest: `--quantization int8|int4` on a float checkpoint (int4: a linear whose
  input size is no multiple of 32 is int8 per channel, said once).
- CheckpointSource: a checkpoint's own quantization_config, each format's tensors as its
  project writes them (unpacked here into quant.py's layout, exactly: same integers, scales
  and zero points):
  - gptq (AutoGPTQ / GPTQModel, transformers' GPTQ): `qweight` int32 [K / (32 / bits), N],
    each int32 holding 32 / bits consecutive input rows from the low bits up; `qzeros` int32
    [groups, N / (32 / bits)], zero points packed along the outputs, stored minus one unless
    checkpoint_format is gptq_v2; `scales` fp16 [groups, N]; `g_idx` int32 [K], each input's
    group (act-order / desc_act: not k // group_size, undone by quant.py's `perm`). 4 and 8 bit.
  - awq (AutoAWQ, version gemm): `qweight` int32 [K, N / 8], eight 4-bit outputs per int32 in
    the order 0, 2, 4, 6, 1, 3, 5, 7 from the low bits up; `qzeros` int32 [groups, N / 8] the
    same way (no minus one); `scales` fp16 [groups, N].
  - compressed-tensors (llm-compressor), symmetric int weights: format pack-quantized
    (`weight_packed` int32 [N, K / (32 / bits)], inputs from the low bits up, each value
    stored plus 2^(bits - 1)) or int-quantized (`weight` int8 [N, K]); `weight_scale` [N, groups]
    (channel strategy: [N, 1]). W4A16 and W8A16.
  Linears outside the decoder layers (an lm_head the format quantised) are dequantised to
  floats; MoE experts stay refused (quantised experts are not built).
"""
from __future__ import annotations

import logging
import re
from typing import Any

import torch

from atomd.model import quant
from atomd.model.quant import QuantizedWeight

log = logging.getLogger(__name__)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column of each nibble of an AWQ int32, low bits first


_EXPERT_WEIGHT = re.compile(r"model\.layers\.\d+\.\S+\.experts\.\d+\.(\w+_proj|w[123])\.weight")


def is_layer_linear(name: str) -> bool:
    """A decoder layer's linear weight (q/k/v/o, gate/up/down, Phi-3's fused ones, an MoE expert's)."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight") or bool(_EXPERT_WEIGHT.fullmatch(name))


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32 / bits values (low bits first) along `dim`, as int32."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    words = packed.to(torch.int32).unsqueeze(dim + 1)
    shape = [1] * words.dim()
    shape[dim + 1] = per
    values = (words >> shifts.view(shape)) & ((1 << bits) - 1)
    out = list(packed.shape)
    out[dim] *= per
    return values.reshape(out)


def _from_zero_points(values: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int, group: int,
                      perm: torch.Tensor | None = None) -> QuantizedWeight:
    """w = (values - zeros) * scales, values unsigned [N, K] in kernel column order, zeros and
    scales [N, groups]: quant.py's q * scale + offset (int8: q = values - 128)."""
    scales = scales.float()
    if bits == 8:
        return quant.pack(values - 128, scales, (128 - zeros).float() * scales, 8, group, perm)
    return quant.pack(values, scales, -zeros.float() * scales, 4, group, perm)


class RoundToNearest:
    """`--quantization int8|int4`: the float checkpoint's layer linears quantised as they load."""

    def __init__(self, src: Any, method: str):
        self.src, self.method, self.warned = src, method, False

    def __contains__(self, name: str) -> bool:
        return name in self.src

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor | QuantizedWeight:
        if not is_layer_linear(name):
            return self.src.get(name, dtype)
        w = self.src.get(name, torch.float32)
        if self.method == "int4" and w.shape[1] % 32:  # int4 groups are runs of 32 inputs
            if not self.warned:
                log.warning("int4: linears whose input size is not a multiple of 32 (%s: %d) are int8 per channel",
                            name, w.shape[1])
                self.warned = True
            return quant.quantize(w, "int8")
        return quant.quantize(w, self.method)


class CheckpointSource:
    """A checkpoint with quantization_config: its packed linears as QuantizedWeights."""

    def __init__(self, src: Any, config: dict[str, Any]):
        self.src, self.config, self.method = src, config, config["quant_method"]
        if self.method == "gptq":
            self.bits, self.group = int(config.get("bits", 4)), int(config.get("group_size", 128))
            self.marker = ".qweight"
            if self.bits not in (4, 8):
                raise ValueError(f"gptq checkpoint with {self.bits}-bit weights is not supported (4 and 8 bit)")
        elif self.method == "awq":
            self.bits, self.group, self.marker = int(config.get("bits", config.get("w_bit", 4))), \
                int(config.get("group_size", config.get("q_group_size", 128))), ".qweight"
            version = str(config.get("version", "gemm")).lower()
            if self.bits != 4 or version != "gemm":
                raise ValueError(f"awq checkpoint ({self.bits}-bit, version {version}) is not supported "
                                 f"(4-bit, version gemm)")
        else:
            self._compressed_tensors_scheme(config)

    def _compressed_tensors_scheme(self, config: dict[str, Any]) -> None:
        fmt = config.get("format")
        groups = [g for g in (config.get("config_groups") or {}).values() if isinstance(g, dict)]
        if fmt not in ("pack-quantized", "int-quantized") or len(groups) != 1:
            raise ValueError(f"compressed-tensors checkpoint (format {fmt!r}, {len(groups)} config groups) is not "
                             f"supported: one group of int weights, format pack-quantized or int-quantized")
        scheme = groups[0]
        weights, acts = scheme.get("weights") or {}, scheme.get("input_activations")
        self.bits = int(weights.get("num_bits", 0))
        strategy = weights.get("strategy")
        if acts or weights.get("type", "int") != "int" or not weights.get("symmetric", True) \
                or self.bits not in (4, 8) or strategy not in ("channel", "group") \
                or (fmt == "int-quantized" and self.bits != 8):
            raise ValueError(f"compressed-tensors scheme {scheme} is not supported: symmetric int4 / int8 weights "
                             f"per channel or group, float activations (W4A16, W8A16)")
        self.group = int(weights["group_size"]) if strategy == "group" else -1
        self.marker = ".weight_packed" if fmt == "pack-quantized" else ".weight_scale"

    def _packed(self, module: str) -> bool:
        return module + self.marker in self.src

    def __contains__(self, name: str) -> bool:
        return name in self.src or (name.endswith(".weight") and self._packed(name.removesuffix(".weight")))

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor | QuantizedWeight:
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or not self._packed(module):
            return self.src.get(name, dtype)
        if ".experts." in name:
            raise ValueError(f"{self.method} checkpoint: quantised MoE experts ({name}) are not supported")
        w = {"gptq": self._gptq, "awq": self._awq}.get(self.method, self._compressed_tensors)(module)
        return w if is_layer_linear(name) else w.dequantize().to(dtype)

    def _gptq(self, module: str) -> QuantizedWeight:
        get = lambda suffix: self.src.get(module + suffix, torch.int32)  # noqa: E731
        values = _unpack(get(".qweight"), self.bits, 0).T  # [N, K]
        n, k = values.shape
        zeros = _unpack(get(".qzeros"), self.bits, 1)[:, :n].T  # [N, groups]
        if str(self.config.get("checkpoint_format", "gptq")).lower() != "gptq_v2":
            zeros = zeros + 1  # GPTQ v1 stores zero - 1
        scales = self.src.get(module + ".scales", torch.float32).T
        group = k if self.group == -1 else self.group
        g_idx = get(".g_idx").long() if module + ".g_idx" in self.src else torch.arange(k) // group
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm], torch.arange(k) // group):
            raise ValueError(f"gptq {module}: g_idx does not give every group {group} inputs")
        if torch.equal(perm, torch.arange(k)):
            return _from_zero_points(values, zeros, scales, self.bits, group)
        return _from_zero_points(values[:, perm], zeros, scales, self.bits, group, perm)

    def _awq(self, module: str) -> QuantizedWeight:
        inverse = torch.argsort(torch.tensor(AWQ_ORDER))  # column j sits in nibble inverse[j]

        def columns(t: torch.Tensor) -> torch.Tensor:  # [rows, N / 8] int32 -> [rows, N]
            nibbles = _unpack(t, 4, 1).view(t.shape[0], -1, 8)
            return nibbles[:, :, inverse].reshape(t.shape[0], -1)

        values = columns(self.src.get(module + ".qweight", torch.int32)).T
        zeros = columns(self.src.get(module + ".qzeros", torch.int32)).T
        scales = self.src.get(module + ".scales", torch.float32).T
        return _from_zero_points(values, zeros, scales, 4, self.group if self.group != -1 else values.shape[1])

    def _compressed_tensors(self, module: str) -> QuantizedWeight:
        scales = self.src.get(module + ".weight_scale", torch.float32)
        if self.marker == ".weight_scale":  # int-quantized: int8 as they are
            values = self.src.get(module + ".weight", torch.int32)
        else:
            n, k = (int(v) for v in self.src.get(module + ".weight_shape", torch.int64))
            values = _unpack(self.src.get(module + ".weight_packed", torch.int32), self.bits, 1)[:, :k]
            values = values - (1 << (self.bits - 1))  # stored unsigned: value + 2^(bits - 1)
        k = values.shape[1]
        group = k if self.group == -1 else self.group
        if scales.shape[1] != -(-k // group):
            raise ValueError(f"compressed-tensors {module}: weight_scale {tuple(scales.shape)} does not match "
                             f"{k} inputs in groups of {group}")
        if self.bits == 8:
            return quant.pack(values, scales, None, 8, group)
        return quant.pack(values + 8, scales, -8 * scales, 4, group)
