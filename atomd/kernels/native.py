"""The C attention kernels (atomd/kernels/csrc/attention.c): built once, loaded by ctypes.

`decode_attention` (the decode queries of each sequence over its paged context: one token,
or with speculative decoding its last token and its drafts, causal inside that run) and `prefill_attention`
(causal attention of fresh prompts over their own rows) for float32 and bfloat16 (q, KV cache
and output in bf16, sums in float32; AVX512_BF16 dot products where the CPU has them, bf16
widened to float32 where not: the build picks, `bf16_path()` says which); decode also over an
narrow cache (fp8 e4m3 / e5m2, one byte a value, or bf16 / float16 under a float32 model, widened to float32 in
registers; `lib.narrow_path`).

`$ATOMD_KERNEL_ISA` (atomd.kernels.cbuild, or `attention_kernels(..., isa=)`) narrows what a build may
use, for testing the fallbacks on a CPU that has everything: `native` (default: all this CPU has),
`no-amx` (no AMX tiles: the bf16 prefill's AVX512_BF16 loop), `no-bf16-dot` (no AVX512_BF16
instructions), `no-avx512` (no AVX-512 at all: what an AVX2-only CPU runs). `prefill_amx`
says whether a build's bf16 prefill runs on AMX tiles (the CPU has them, the build targets
them, the head size is a multiple of 32, and Linux granted the process the tile state).

One library per model shape (head size, query heads per KV head): prebuilt in an installed
wheel for the shapes it ships, else compiled at first use for this CPU (atomd/kernels/cbuild.py).
No torch headers: a build takes about a second. Where it cannot be built, `attention_kernels()` is
None, the reason is logged, and the engine keeps torch's SDPA path (`--attention-backend
torch` asks for that path outright).
"""
from __future__ import annotations

import ctypes
import functools
import logging

import torch

from atomd.kernels import cbuild
from atomd.engine.kv_cache import KVCache

log = logging.getLogger(__name__)
ISA_ENV, ISA_FLAGS = cbuild.ISA_ENV, cbuild.ISA_FLAGS
BF16_PATHS = {2: "AVX512_BF16 dot products", 1: "bf16 widened to float32 on AVX-512F",
              0: "bf16 widened to float32 (no AVX-512)"}
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


def attention_kernels(head_dim: int, group: int, isa: str | None = None) -> ctypes.CDLL | None:
    """The kernels for heads of `head_dim` with `group` query heads per KV head, or None.
    `isa`: one of ISA_FLAGS (default: cbuild.kernel_isa())."""
    return _attention_kernels(head_dim, group, isa or cbuild.kernel_isa())


@functools.cache
def _attention_kernels(head_dim: int, group: int, isa: str) -> ctypes.CDLL | None:
    lib = cbuild.load(*cbuild.attention_kernel(head_dim, group), log, "attention uses torch SDPA", isa)
    if lib is None:
        return None
    for name in ("atomd_decode_attention", "atomd_decode_attention_bf16", *NARROW_KERNELS.values()):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = [_PTR] * 6 + [_I64] * 8 + [ctypes.c_float, _I64, ctypes.c_int]
    for name in ("atomd_prefill_attention", "atomd_prefill_attention_bf16"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = [_PTR] * 6 + [_I64] * 6 + [ctypes.c_float, _I64, ctypes.c_int]
    lib.atomd_bf16_path.restype, lib.atomd_bf16_path.argtypes = ctypes.c_int, []
    lib.atomd_prefill_amx.restype, lib.atomd_prefill_amx.argtypes = ctypes.c_int, []
    lib.atomd_narrow_path.restype, lib.atomd_narrow_path.argtypes = ctypes.c_int, []
    lib.head_dim, lib.group = head_dim, group  # the shape it was built for: checked at every call
    lib.isa = isa  # the absorbed MLA decode's kernel (mla_kernels) is built alike
    lib.bf16_path = lib.atomd_bf16_path()
    lib.prefill_amx = bool(lib.atomd_prefill_amx())  # the bf16 prefill on AMX tiles
    lib.narrow_path = NARROW_PATHS[lib.atomd_narrow_path()]
    if isa != "native":
        log.info("attention kernels built with %s=%s: bf16 path %s", ISA_ENV, isa, BF16_PATHS[lib.bf16_path])
    return lib


attention_kernels.cache_clear = _attention_kernels.cache_clear  # type: ignore[attr-defined]
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what the kernels compute in
# the decode kernel over a narrow cache (csrc/attention_narrow.h): float32 q and out
NARROW_KERNELS = {torch.float8_e4m3fn: "atomd_decode_attention_narrow_e4m3", torch.float8_e5m2: "atomd_decode_attention_narrow_e5m2",
                  torch.bfloat16: "atomd_decode_attention_narrow_bf16", torch.float16: "atomd_decode_attention_narrow_f16"}
NARROW_PATHS = {1: "widened to float32 on AVX-512", 2: "widened to float32 on AVX2 (F16C)",
                0: "widened to float32 in plain C (fp8 by a table)"}


def bf16_path(lib: ctypes.CDLL) -> str:
    """How this build computes bfloat16 attention (BF16_PATHS)."""
    return BF16_PATHS[lib.bf16_path]


def check_shape(lib: ctypes.CDLL, heads: int, kv_heads: int, head_dim: int) -> None:
    """The C code trusts its compiled shape: a mismatch would read out of bounds, not fail."""
    if head_dim != lib.head_dim or heads != kv_heads * lib.group:
        raise ValueError(f"attention kernel built for head_dim {lib.head_dim}, group {lib.group}; "
                         f"called with head_dim {head_dim}, {heads} heads / {kv_heads} KV heads")


def _check_status(status: int, what: str) -> None:
    if status != 0:
        raise MemoryError(f"{what}: the attention kernel could not allocate its scratch memory")


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, kv_cache: KVCache, layer: int,
                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                     query_starts: torch.Tensor | None = None, window: int | None = None,
                     scale: float | None = None) -> torch.Tensor:
    """Attention of q [R, heads, head_dim] (float32 or bfloat16, the cache's compute dtype) over the
    paged cache (stored in that dtype or a narrow one: fp8, 16 bits under float32), read through block_tables [B, width] (int64). Without query_starts, R == B:
    row b is sequence b's one token and sees its first context_lens[b] cached tokens. With query_starts [B + 1] (int64 offsets), sequence
    b owns rows query_starts[b] .. query_starts[b + 1] - 1, the last positions of its context
    (its last token and its drafts), each seeing the keys up to its own position (causal).
    window: a sliding window, each row sees only its last `window` keys (blocks before them
    are not read: they may be freed); None: all. scale: the score scale (default head_dim ** -0.5).
    A one-plane cache (MLA's latent, KVGeometry) is read as its own values: out holds the
    weighted sums of the whole rows. `lib` is attention_kernels(head_dim, heads // kv_heads)."""
    c = kv_cache
    rows, heads, head_dim = q.shape
    batch = context_lens.shape[0]
    check_shape(lib, heads, c.num_kv_heads, head_dim)
    assert q.dtype == c.compute_dtype and q.dtype in KERNEL_DTYPES, (q.dtype, c.kv.dtype)
    assert block_tables.dtype == context_lens.dtype == torch.int64
    assert c.kv.is_contiguous() and block_tables.is_contiguous() and context_lens.is_contiguous()
    assert block_tables.shape[0] == batch
    if query_starts is None:
        assert rows == batch, "one query token per sequence (else pass query_starts)"
    else:  # its values (increasing, at most a context per sequence) are the caller's to check, once a step
        assert query_starts.dtype == torch.int64 and query_starts.is_contiguous() and len(query_starts) == batch + 1
    scale = head_dim ** -0.5 if scale is None else scale
    if c.narrow:  # float32 q and out (a bf16 model's widened and rounded back); k_scale folds into the scores'
        q, scale = q.float(), scale * c.k_scale
        kernel = getattr(lib, NARROW_KERNELS[c.kv.dtype])
    else:
        kernel = lib.atomd_decode_attention if q.dtype == torch.float32 else lib.atomd_decode_attention_bf16
    q = q.contiguous()
    out = torch.empty_like(q)
    row, planes = c.num_kv_heads * head_dim, c.kv.shape[2]
    block_stride = c.num_layers * planes * c.block_size * row
    # one plane (MLA's latent): the values are the key rows themselves (their leading dims count)
    v_offset = c.block_size * row if planes == 2 else 0
    _check_status(kernel(
        q.data_ptr(), c.kv.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
        None if query_starts is None else query_starts.data_ptr(), out.data_ptr(), batch,
        heads, c.num_kv_heads, c.block_size, block_tables.shape[1], block_stride, layer * planes * c.block_size * row,
        v_offset, scale, _window(window), torch.get_num_threads()),
        "decode attention")
    if c.narrow and c.v_scale != 1.0:
        out.mul_(c.v_scale)
    return out.view(rows, heads * head_dim).to(c.compute_dtype)


def prefill_attention(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      out: torch.Tensor, seq_starts: torch.Tensor, seq_lens: torch.Tensor,
                      window: int | None = None, scale: float | None = None) -> None:
    """Causal attention of fresh sequences (no cached prefix) packed back to back, written into
    their rows of out [T, heads * head_dim]. q [T, heads, head_dim], k, v [T, kv_heads, head_dim]
    (all float32 or all bfloat16, out too) may be views with any token stride; seq_starts, seq_lens: int64 [num_seqs]."""
    heads, head_dim = q.shape[1], q.shape[2]
    check_shape(lib, heads, k.shape[1], head_dim)
    assert q.dtype in KERNEL_DTYPES, q.dtype
    for t in (q, k, v, out):
        assert t.dtype == q.dtype, (t.dtype, q.dtype)
    for t in (q, k, v):
        assert t.stride(2) == 1 and t.stride(1) == t.shape[2], t.stride()
    assert k.shape == v.shape and q.shape[0] == k.shape[0] == out.shape[0] and out.is_contiguous()
    assert seq_starts.dtype == seq_lens.dtype == torch.int64 and seq_starts.is_contiguous() and seq_lens.is_contiguous()
    assert len(seq_lens) == 0 or int((seq_starts + seq_lens).max()) <= q.shape[0], "a sequence past the rows"
    kernel = lib.atomd_prefill_attention if q.dtype == torch.float32 else lib.atomd_prefill_attention_bf16
    _check_status(kernel(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), seq_starts.data_ptr(), seq_lens.data_ptr(),
        len(seq_lens), heads, k.shape[1], q.stride(0), k.stride(0), v.stride(0),
        head_dim ** -0.5 if scale is None else scale, _window(window), torch.get_num_threads()), "prefill attention")


def mla_kernels(rank: int, rope: int, nope: int, v: int, isa: str | None = None) -> ctypes.CDLL | None:
    """The absorbed MLA decode (csrc/mla.c) for kv_lora_rank `rank`, qk_rope / qk_nope head dims
    `rope` / `nope` and v_head_dim `v`, or None (mla.py's torch path then runs)."""
    return _mla_kernels(rank, rope, nope, v, isa or cbuild.kernel_isa())


@functools.cache
def _mla_kernels(rank: int, rope: int, nope: int, v: int, isa: str) -> ctypes.CDLL | None:
    lib = cbuild.load(*cbuild.mla_kernel(rank, rope, nope, v), log, "the absorbed MLA decode runs torch bmm", isa)
    if lib is not None:
        lib.atomd_mla_decode.restype = ctypes.c_int
        lib.atomd_mla_decode.argtypes = [_PTR] * 8 + [_I64] * 7 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
        lib.atomd_mla_amx.argtypes, lib.atomd_mla_amx.restype = [ctypes.c_int], ctypes.c_int
        lib.amx_on = True  # the kernel's own default (mla_amx switches it)
        lib.shape = (rank, rope, nope, v)
    return lib


def mla_amx(lib: ctypes.CDLL, on: bool) -> bool:
    """Let the kernel's bf16 blocks of 4 or more rows run on AMX tiles (on), or keep them on the
    AVX-512 path; True where the tiles then run (built with them, the process granted their state)."""
    if lib.amx_on != on:
        lib.amx_on = on
        return bool(lib.atomd_mla_amx(int(on)))
    return bool(lib.atomd_mla_amx(-1))


def mla_decode(lib: ctypes.CDLL, q: torch.Tensor, uk_t: torch.Tensor, uv: torch.Tensor, kv_cache: KVCache,
               layer: int, block_tables: torch.Tensor, context_lens: torch.Tensor,
               query_starts: torch.Tensor | None, scale: float) -> torch.Tensor:
    """The absorbed MLA decode of one layer ([R, heads * v], q's dtype): q [R, heads, nope + rope]
    (RoPE'd) into latent space through uk_t [heads, rank, nope], attention over the paged latent
    rows (rank + rope values, a one-plane cache in q's dtype), the weighted latents through uv
    [heads, v, rank]. Rows and query_starts as decode_attention's."""
    c = kv_cache
    rows, heads, qdim = q.shape
    rank, rope, nope, v = lib.shape
    batch = context_lens.shape[0]
    # the C code trusts its compiled shape: a mismatch would read out of bounds, not fail
    assert (qdim, c.head_dim, c.num_kv_heads, c.kv.shape[2]) == (nope + rope, rank + rope, 1, 1), (q.shape, c.kv.shape)
    assert uk_t.shape == (heads, rank, nope) and uv.shape == (heads, v, rank)
    assert q.dtype == uk_t.dtype == uv.dtype == c.kv.dtype and q.dtype in KERNEL_DTYPES, (q.dtype, c.kv.dtype)
    assert uk_t.is_contiguous() and uv.is_contiguous() and c.kv.is_contiguous()
    assert block_tables.dtype == context_lens.dtype == torch.int64 and block_tables.shape[0] == batch
    assert block_tables.is_contiguous() and context_lens.is_contiguous()
    if query_starts is None:
        assert rows == batch, "one query token per sequence (else pass query_starts)"
    else:
        assert query_starts.dtype == torch.int64 and query_starts.is_contiguous() and len(query_starts) == batch + 1
    q = q.contiguous()
    out = torch.empty(rows, heads * v, dtype=q.dtype)
    _check_status(lib.atomd_mla_decode(
        q.data_ptr(), uk_t.data_ptr(), uv.data_ptr(), c.kv.data_ptr(), block_tables.data_ptr(),
        context_lens.data_ptr(), None if query_starts is None else query_starts.data_ptr(), out.data_ptr(), batch,
        rows, heads, c.block_size, block_tables.shape[1], c.num_layers * c.block_size * c.head_dim,
        layer * c.block_size * c.head_dim, scale, int(q.dtype == torch.bfloat16), torch.get_num_threads()),
        "MLA decode")
    return out


def _window(window: int | None) -> int:
    """The kernels' window argument: 0 for none (a global layer)."""
    if window is None:
        return 0
    if window < 1:
        raise ValueError(f"sliding window {window} must be at least 1")
    return window
