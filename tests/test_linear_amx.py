"""A few bf16 rows through a oneDNN-packed linear on AMX tiles (atomd/kernels/csrc/linear_amx.h,
atomd/model/linear.py): the packed weight read in place, oneDNN's output bit for bit, every row count
the path takes, strided rows; narrowed builds and CPUs without AMX keep oneDNN's call."""
from __future__ import annotations

import pytest
import torch

from atomd.config import cpu_flags
from atomd.kernels import cbuild
from atomd.model import layer_ops, linear as linear_mod
from atomd.model.linear import linear, pack_linear_weight

# the tests read oneDNN's packed bf16 weight: a CPU with no oneDNN bf16 (AVX2 only) keeps bf16 weights unpacked
# (decoder.py) and never reaches linear_amx (its bf16 linears: tests/test_layer_ops.py, tests/test_bf16.py)
pytestmark = [pytest.mark.unit, pytest.mark.skipif(not linear_mod.onednn_runs(torch.bfloat16),
                                                   reason="oneDNN has no bf16 linear on this CPU")]


def onednn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


@pytest.mark.parametrize("n,k", [(96, 64), (1024, 2048), (3648, 1024)])
def test_tiles_give_onednns_bits(n, k, monkeypatch):
    """Rows 2 .. AMX_MAX_ROWS (one and two row tiles, partial ones) and a strided x (columns of a
    wider tensor, as qkv_a's slices): the tile path's output equals oneDNN's on the same packed
    weight, and float64's product within bf16 rounding. Taken where the CPU has AMX; on 3 threads."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    amx = {"amx_tile", "amx_bf16"} <= cpu_flags() and linear_mod.onednn_runs(torch.bfloat16)
    assert linear_mod.reads_onednn_layout(n, k, cbuild.kernel_isa()) == amx
    g = torch.Generator().manual_seed(n + k)
    plain = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    weight = pack_linear_weight(plain)
    wide = torch.randn(linear_mod.AMX_MAX_ROWS, k + 32, generator=g).to(torch.bfloat16)
    for rows in (2, 5, 16, 17, linear_mod.AMX_MAX_ROWS):
        for x in (wide[:rows, :k].contiguous(), wide[:rows, 32:]):
            tiles = layer_ops.linear_amx(x, weight) if amx else None
            got = linear(x, weight)
            assert torch.equal(got, onednn(x, weight))
            if amx:
                assert torch.equal(tiles, got)
            want = x.double() @ plain.double().T
            torch.testing.assert_close(got.double(), want, atol=0.02, rtol=0.01)


def test_narrowed_builds_and_other_rows_keep_onednn(monkeypatch):
    """Under the no-amx build the kernel reports itself off and linear() runs oneDNN; one row, more
    than AMX_MAX_ROWS, a bias or the switch off never call the tiles."""
    n, k = 64, 64
    weight = pack_linear_weight(torch.randn(n, k).to(torch.bfloat16))
    calls = []
    monkeypatch.setattr(layer_ops, "linear_amx", lambda x, w: calls.append(len(x)))
    for rows, bias in ((1, None), (linear_mod.AMX_MAX_ROWS + 1, None), (4, torch.randn(n).to(torch.bfloat16))):
        x = torch.randn(rows, k).to(torch.bfloat16)
        assert torch.equal(linear(x, weight, bias), torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], ""))
    monkeypatch.setattr(linear_mod, "AMX", False)
    linear(torch.randn(4, k).to(torch.bfloat16), weight)
    assert calls == []
    monkeypatch.undo()
    monkeypatch.setenv("ATOMD_KERNEL_ISA", "no-amx")
    assert not layer_ops.has_linear_amx()
    assert not linear_mod.reads_onednn_layout(n, k, cbuild.kernel_isa())
    x = torch.randn(4, k).to(torch.bfloat16)
    assert torch.equal(linear(x, weight), onednn(x, weight))
