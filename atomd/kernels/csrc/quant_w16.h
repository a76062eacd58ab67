/* Part of quant.c (and of layer_ops.c, for moe_q8.h's 16-bit experts): 16-bit float weights (bfloat16 or float16, quant.h's row_w16 layout: uint16 [N, K])
 * times many rows of float32 x, float32 out, on AVX-512: prefill with `--quantization bf16 / fp16`
 * where the compute is float32 (a CPU without AVX512_BF16 / AMX; quant.py's QGEMM_W16_MIN_M).
 * And, where the build has AVX512_BF16 (W16_BF16_PAIRS), bf16 x times bf16 weights with float32 sums of the
 * exact products by vdpbf16ps (atomd_gemm_bf16_panels: a bf16 model's prefill on a CPU with AVX512_BF16 but no
 * AMX tiles, linear.py's BF16_PANELS_MIN_M, and a TP worker's float32 row-parallel partial, linear_f32): the
 * same loops over pairs of inputs, each packed 32-bit unit holding w[n][k], w[n][k + 1] (k even) and x's
 * pair broadcast as one 32-bit value; an odd K's last pair padded with zero (x's lone value read as 16 bits).
 *
 * BLIS's loops with the roles turned round (the weight is the vector operand, x the broadcast one), x read
 * in place as oneDNN's brgemm reads its A:
 * - each thread owns a run of 32-row weight panels (N split across the threads, never M: no two
 *   threads write one output);
 * - per k-block of at most W16_KC inputs (K split evenly) and per block of as many of its panels as fill
 *   W16_BLOCK_FLOATS, the weight is widened (exactly) and packed once into a per-thread float32 buffer that
 *   stays in L2: panels [32 rows][kc] transposed to [kc][32] (16 x 16 in-register transposes);
 * - for every W16_MR rows of x (M split into slivers of even size, so no sliver of 1 or 2 rows), each
 *   panel of the block through the micro-kernel: W16_MR x 32 outputs in 2 x W16_MR zmm accumulators; per
 *   input two weight vectors loaded (the panel streams from L2, prefetched W16_PREFETCH bytes ahead) and
 *   one x value per row broadcast from x's own rows, 2 x W16_MR FMAs; the next tile's output rows
 *   prefetched during the first W16_MR inputs.
 * bf16 x without vdpbf16ps (atomd_gemm_bf16_rounded): each sliver of x widened into a per-thread buffer before its
 * panels, and with a bf16 output each sliver's sums rounded as its last k-block ends (in a per-thread sliver
 * buffer where K is one k-block): no float32 copy of x or y goes through memory.
 * The output is the accumulator: zeroed at the first k-block, loaded and stored at each later one (so
 * long k-blocks: K <= 1024 is one pass; 2048 for bf16 pairs, the same bytes), so every y[m, n] is one chain of
 * FMAs over k = 0..K-1 in order (of vdpbf16ps over the pairs in order):
 * its bits do not depend on M, the threads or the blocking (only on x's row and w's row). A BLAS sums in
 * another order: results agree with a float matmul to float32 rounding, not bit for bit. Edges: rows of x
 * past M are never computed (the micro-kernel's row count is a compile-time 1..W16_MR), weight rows past N
 * are packed as zeros and their outputs masked off, any K. Measured against oneDNN's float32 linear on a
 * packed weight: benchmarks/qlinear_16.py (RESULTS.md, #35 16-bit weights' prefill on the VNNI kind). */
#if QUANT_PATH == 2
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_convert.h" /* bf16_of16 */
#include "lane_sums.h" /* transpose16 */
#define W16_PANELS 1
#if defined(__AVX512BF16__) && !defined(ATOMD_NO_BF16_DOT)
#define W16_BF16_PAIRS 1 /* atomd_gemm_bf16_panels: vdpbf16ps over packed bf16 pairs */
#endif
#define W16_MR 14     /* rows of x per micro-kernel: 28 accumulators + 2 weight vectors + a broadcast */
#define W16_NR 32     /* weight rows per panel: two vectors */
#define W16_KC 1024   /* packed 32-bit units per k-block at most: inputs, or pairs of bf16 inputs (blocks of 256
                         with x packed into L1: ~5% slower at K 1536 / 3072) */
#define W16_BLOCK_FLOATS (1 << 18)  /* a packed block of panels, in 32-bit units: 1 MiB (L2) */
#define W16_PREFETCH 1024  /* bytes of the panel ahead of the micro-kernel's loads (8 units) */
/* what the weight's 16-bit values become in the packed panels: float32 (bf16 or float16 widened), or pairs of
 * bf16 inputs kept as they are (vdpbf16ps's operand) */
enum { W16_B16 = 0, W16_H16 = 1, W16_PAIRS = 2 };

/* per thread, kept between calls (a fresh malloc each call would be mapped and faulted in again): the packed
 * weight block (W16_SCR_PANELS, 1 MiB), and for bf16 x widened and bf16 out rounded here (atomd_gemm_bf16_widened)
 * a sliver of x widened (W16_SCR_X) and a sliver of outputs (W16_SCR_Y) */
enum { W16_SCR_PANELS = 0, W16_SCR_X = 1, W16_SCR_Y = 2 };
static _Thread_local float *w16_buf[3];
static _Thread_local size_t w16_cap[3];

static float *w16_scratch(int slot, size_t floats) {
    if (floats > w16_cap[slot]) {
        free(w16_buf[slot]);
        w16_buf[slot] = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        w16_cap[slot] = w16_buf[slot] ? floats : 0;
    }
    return w16_buf[slot];
}

/* 16 packed units of row p from unit u: 16 values widened, or 16 pairs (32 bf16) as they are */
static inline __attribute__((always_inline)) __m512 w16_load(const uint16_t *p, int64_t u, const int kind) {
    return kind == W16_PAIRS ? _mm512_castsi512_ps(_mm512_loadu_si512(p + 2 * u))
           : kind == W16_H16 ? load_h16(p + u) : load_b16(p + u);
}

/* unit u of row p (kc inputs) into *dst: one value widened, or the pair (p[2u], p[2u + 1]) with zero past kc */
static inline void w16_unit(const uint16_t *p, int64_t u, int64_t kc, const int kind, float *dst) {
    if (kind == W16_PAIRS)
        *(uint32_t *)dst = p[2 * u] | (2 * u + 1 < kc ? (uint32_t)p[2 * u + 1] << 16 : 0u);
    else
        *dst = kind == W16_H16 ? h16_to_float(p[u]) : b16_to_float(p[u]);
}

static inline int64_t w16_units(int64_t kc, const int kind) { return kind == W16_PAIRS ? (kc + 1) / 2 : kc; }

/* weight rows 0..nn (q: the block's first row, row stride K), inputs k0..k0 + kc, packed into bp as
 * panels [ceil(nn / 32)][units][32] (units: w16_units); rows past nn zeros */
static void w16_pack(const uint16_t *q, int64_t K, int64_t nn, int64_t k0, int64_t kc, const int kind, float *bp) {
    const int64_t units = w16_units(kc, kind), full = kind == W16_PAIRS ? kc / 2 : kc;
    for (int64_t r0 = 0; r0 < (nn + W16_NR - 1) / W16_NR * W16_NR; r0 += 16) {
        float *dst = bp + r0 / W16_NR * units * W16_NR + r0 % W16_NR;
        const int rows = nn - r0 < 16 ? (int)(nn - r0) : 16;
        const uint16_t *src = q + r0 * K + k0;
        int64_t u = 0;
        for (; u + 16 <= full; u += 16) {
            __m512 v[16];
            for (int i = 0; i < 16; i++) v[i] = i < rows ? w16_load(src + i * K, u, kind) : _mm512_setzero_ps();
            transpose16(v);
            for (int i = 0; i < 16; i++) _mm512_store_ps(dst + (u + i) * W16_NR, v[i]);
        }
        for (; u < units; u++)
            for (int i = 0; i < 16; i++) {
                if (i < rows)
                    w16_unit(src + i * K, u, kc, kind, dst + u * W16_NR + i);
                else
                    dst[u * W16_NR + i] = 0.0f;  /* all bits zero: a zero pair too */
            }
    }
}

/* how the micro-kernel reads x: float32 values, or bf16 pairs (vdpbf16ps). (bf16 values widened at the
 * broadcast: a GPR -> zmm broadcast a port-5 uop per input, 1.5x the float32 kernel's time; quant.gemm_bf16_f32
 * widens x once instead) */
enum { W16_X_F32 = 0, W16_X_PAIRS = 1 };

/* x's unit u of a row (xr: its first input) broadcast: a float32 value, or a bf16 pair as one 32-bit value */
static inline __attribute__((always_inline)) __m512 w16_bcast(const char *xr, int64_t u, const int xk) {
    if (xk == W16_X_F32) return _mm512_set1_ps(((const float *)xr)[u]);
    uint32_t v;
    memcpy(&v, xr + 4 * u, sizeof v);
    return _mm512_castsi512_ps(_mm512_set1_epi32((int)v));
}

#ifdef W16_BF16_PAIRS
#define W16_FMA(xk, a, b, c) \
    ((xk) == W16_X_PAIRS ? _mm512_dpbf16_ps(c, (__m512bh)(a), (__m512bh)(b)) : _mm512_fmadd_ps(a, b, c))
#else
#define W16_FMA(xk, a, b, c) _mm512_fmadd_ps(a, b, c)
#endif

/* where the micro-kernel reads the weight's panel: the per-call float32 buffer (values widened, or bf16 pairs), or a
 * weight's 16-bit panels packed once at load (w16_prepack), bf16 or float16, widened here in registers */
enum { W16_B_F32 = 0, W16_B_B16 = 1, W16_B_H16 = 2 };

/* the panel's two weight vectors of unit k: float32 [k][32]; 16-bit one 64-byte line a unit (bf16: 32-bit lane j holds
 * weight row j in its low half and row j + 16 in its high half, so each widens with one instruction: a bf16 is a
 * float32's top 16 bits; float16: rows in order) */
#define W16_LOAD_B(BK, panel, k, b0, b1)                                                                           \
    if (BK == W16_B_F32) {                                                                                         \
        b0 = _mm512_load_ps((const float *)(panel) + (k) * W16_NR);                                                \
        b1 = _mm512_load_ps((const float *)(panel) + (k) * W16_NR + 16);                                           \
    } else if (BK == W16_B_B16) {                                                                                  \
        const __m512i v_ = _mm512_load_si512((const void *)((const uint16_t *)(panel) + (k) * W16_NR));            \
        b0 = _mm512_castsi512_ps(_mm512_slli_epi32(v_, 16));                                                       \
        b1 = _mm512_castsi512_ps(_mm512_and_si512(v_, _mm512_set1_epi32((int)0xffff0000u)));                       \
    } else {                                                                                                       \
        b0 = load_h16((const uint16_t *)(panel) + (k) * W16_NR);                                                   \
        b1 = load_h16((const uint16_t *)(panel) + (k) * W16_NR + 16);                                              \
    }

/* y[0..MR, 0..32] (masks m0 / m1: the panel's weight rows below N) = (first ? 0 : y) + x . panel over kc
 * inputs (x: MR rows of stride ldx elements, read as XK says; the panel as BK says); yn: the next tile's first
 * output, prefetched */
#define W16_TILE(NAME, XK, BK, MR)                                                                                 \
    static __attribute__((noinline)) void NAME##_##MR(const void *x, int64_t ldx, const void *panel, int64_t kc,   \
                                                      float *y, int64_t ldy, int first, __mmask16 m0,              \
                                                      __mmask16 m1, const float *yn) {                             \
        __m512 c0[MR], c1[MR];                                                                                     \
        const char *xr[MR];                                                                                        \
        const char *bp = (const char *)panel;                                                                      \
        const int64_t units = XK == W16_X_PAIRS ? kc / 2 : kc, unit_bytes = BK == W16_B_F32 ? 128 : 64;           \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                                    \
            xr[i] = (const char *)x + i * ldx * (XK == W16_X_F32 ? 4 : 2);                                         \
            c0[i] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m0, y + i * ldy);                          \
            c1[i] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m1, y + i * ldy + 16);                     \
        }                                                                                                          \
        for (int64_t k = 0; k < units; k++) {                                                                      \
            _mm_prefetch(bp + k * unit_bytes + W16_PREFETCH * unit_bytes / 128, _MM_HINT_T0);                      \
            if (BK == W16_B_F32) _mm_prefetch(bp + k * unit_bytes + W16_PREFETCH + 64, _MM_HINT_T0);              \
            if (k < MR) {                                                                                          \
                _mm_prefetch((const char *)(yn + k * ldy), _MM_HINT_T0);                                           \
                _mm_prefetch((const char *)(yn + k * ldy + 16), _MM_HINT_T0);                                      \
            }                                                                                                      \
            __m512 b0, b1;                                                                                         \
            W16_LOAD_B(BK, panel, k, b0, b1)                                                                       \
            _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                                \
                const __m512 a = w16_bcast(xr[i], k, XK);                                                          \
                c0[i] = W16_FMA(XK, a, b0, c0[i]);                                                                 \
                c1[i] = W16_FMA(XK, a, b1, c1[i]);                                                                 \
            }                                                                                                      \
        }                                                                                                          \
        if (XK == W16_X_PAIRS && (kc & 1)) { /* the last input alone: its pair (x, 0) against the packed (w, 0) */ \
            __m512 b0, b1;                                                                                         \
            W16_LOAD_B(BK, panel, units, b0, b1)                                                                   \
            _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                                \
                const __m512 a = _mm512_castsi512_ps(_mm512_set1_epi32(((const uint16_t *)xr[i])[kc - 1]));        \
                c0[i] = W16_FMA(XK, a, b0, c0[i]);                                                                 \
                c1[i] = W16_FMA(XK, a, b1, c1[i]);                                                                 \
            }                                                                                                      \
        }                                                                                                          \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                                    \
            _mm512_mask_storeu_ps(y + i * ldy, m0, c0[i]);                                                         \
            _mm512_mask_storeu_ps(y + i * ldy + 16, m1, c1[i]);                                                    \
        }                                                                                                          \
    }
#define W16_TILES(NAME, XK, BK)                                                                                    \
    W16_TILE(NAME, XK, BK, 1) W16_TILE(NAME, XK, BK, 2) W16_TILE(NAME, XK, BK, 3) W16_TILE(NAME, XK, BK, 4)        \
    W16_TILE(NAME, XK, BK, 5) W16_TILE(NAME, XK, BK, 6) W16_TILE(NAME, XK, BK, 7) W16_TILE(NAME, XK, BK, 8)        \
    W16_TILE(NAME, XK, BK, 9) W16_TILE(NAME, XK, BK, 10) W16_TILE(NAME, XK, BK, 11) W16_TILE(NAME, XK, BK, 12)     \
    W16_TILE(NAME, XK, BK, 13) W16_TILE(NAME, XK, BK, 14)                                                          \
    static const w16_tile_fn NAME[W16_MR + 1] = {NULL, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5,           \
                                                 NAME##_6, NAME##_7, NAME##_8, NAME##_9, NAME##_10, NAME##_11,     \
                                                 NAME##_12, NAME##_13, NAME##_14};
typedef void (*w16_tile_fn)(const void *, int64_t, const void *, int64_t, float *, int64_t, int, __mmask16,
                            __mmask16, const float *);
W16_TILES(w16_tiles, W16_X_F32, W16_B_F32)
W16_TILES(w16_b16_tiles, W16_X_F32, W16_B_B16)
W16_TILES(w16_h16_tiles, W16_X_F32, W16_B_H16)
#ifdef W16_BF16_PAIRS
W16_TILES(w16_pair_tiles, W16_X_PAIRS, W16_B_F32)
#endif

static inline __mmask16 w16_mask(int64_t cols) { return cols >= 16 ? 0xffff : cols <= 0 ? 0 : (__mmask16)((1u << cols) - 1); }

/* rows x16 [rows, ldx] of bf16, inputs 0..kc, widened (exactly) into xs [rows, ldxs] */
static inline void w16_widen_x(const uint16_t *x16, int64_t ldx, int64_t rows, int64_t kc, float *xs, int64_t ldxs) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t k = 0; k < kc; k += 16) {
            const __mmask16 m = w16_mask(kc - k);
            const __m256i h = _mm256_maskz_loadu_epi16(m, x16 + i * ldx + k);
            const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
            _mm512_mask_storeu_ps(xs + i * ldxs + k, m, _mm512_castsi512_ps(wide));
        }
}

/* y [rows, ldy] float32 columns 0..cols rounded to bf16 into y16 [rows, ldy16]: to nearest even, a NaN a quiet NaN
 * (bf16_convert.h's bf16_of16, as torch's .to(torch.bfloat16)) */
static inline void w16_round_y(const float *y, int64_t ldy, int64_t rows, int64_t cols, uint16_t *y16, int64_t ldy16) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t n = 0; n < cols; n += 16) {
            const __mmask16 m = w16_mask(cols - n);
            _mm256_mask_storeu_epi16(y16 + i * ldy16 + n, m, bf16_of16(_mm512_maskz_loadu_ps(m, y + i * ldy + n)));
        }
}

/* y [M, ldy] = x [M, ldx] @ w^T, w uint16 [N, K] of bf16 (kind W16_B16) or float16 (W16_H16) values widened and x
 * float32, or (W16_PAIRS, W16_BF16_PAIRS builds only) bf16 values and x bf16 by vdpbf16ps; pre (W16_B16 / W16_H16
 * only): the same weight as w16_prepack packed it (NULL: packed here, per k-block, into each thread's buffer), the
 * same sums either way. x16 (W16_B16 / W16_H16): x is bf16, widened here a sliver of rows at a time (the float32
 * x's bits). y16: the outputs also rounded to bf16 into y16 [M, ldy16], each sliver once its last k-block is done;
 * y NULL (only with y16 and K <= one k-block): the float32 outputs stay in a per-thread sliver. 0 done, -1 out of
 * memory (a thread's scratch) */
static int w16_gemm(const void *x, int64_t ldx, int64_t M, const uint16_t *q, const uint16_t *pre, const int kind,
                    int64_t N, int64_t K, float *y, int64_t ldy, int num_threads, int x16, uint16_t *y16,
                    int64_t ldy16) {
    const int pairs = kind == W16_PAIRS;
#ifdef W16_BF16_PAIRS
    const w16_tile_fn *tiles = pre ? (kind == W16_H16 ? w16_h16_tiles : w16_b16_tiles) : pairs ? w16_pair_tiles : w16_tiles;
#else
    const w16_tile_fn *tiles = pre ? (kind == W16_H16 ? w16_h16_tiles : w16_b16_tiles) : w16_tiles;
#endif
    const int64_t xsize = pairs ? 2 : 4, kmax = pairs ? 2 * W16_KC : W16_KC;  /* x's element bytes, inputs a block */
    const int64_t panels = (N + W16_NR - 1) / W16_NR, nkb = (K + kmax - 1) / kmax, slivers = (M + W16_MR - 1) / W16_MR;
    int64_t kcs = (K + nkb - 1) / nkb;  /* k-blocks of even size (pairs: an even number, none split) */
    kcs += pairs && kcs % 2 && kcs < K;
    const int64_t per_block = W16_BLOCK_FLOATS / (w16_units(kcs, kind) * W16_NR) > 0
                                  ? W16_BLOCK_FLOATS / (w16_units(kcs, kind) * W16_NR) : 1;
    const int64_t ldxs = (kcs + 15) / 16 * 16, ldys = per_block * W16_NR;  /* the slivers' scratch rows */
    if (y == NULL && (y16 == NULL || nkb > 1)) return -1;
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads) reduction(|: failed)") {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t pb = panels * t / nt, pe = panels * (t + 1) / nt;
        float *bp = pe > pb && pre == NULL ? w16_scratch(W16_SCR_PANELS, (size_t)W16_BLOCK_FLOATS) : NULL;
        float *xs = pe > pb && x16 ? w16_scratch(W16_SCR_X, (size_t)(W16_MR * ldxs)) : NULL;
        float *ys = pe > pb && y == NULL ? w16_scratch(W16_SCR_Y, (size_t)(W16_MR * ldys)) : NULL;
        if (pe > pb && ((pre == NULL && bp == NULL) || (x16 && xs == NULL) || (y == NULL && ys == NULL))) failed = 1;
        for (int64_t k0 = 0; !failed && k0 < K; k0 += kcs) {
            const int64_t kc = K - k0 < kcs ? K - k0 : kcs, units = w16_units(kc, kind);
            for (int64_t p0 = pb; p0 < pe; p0 += per_block) {
                const int64_t p1 = p0 + per_block < pe ? p0 + per_block : pe;
                const int64_t n0 = p0 * W16_NR, nn = (p1 * W16_NR < N ? p1 * W16_NR : N) - n0;
                if (pre == NULL) w16_pack(q + n0 * K, K, nn, k0, kc, kind, bp);
                for (int64_t s = 0; s < slivers; s++) {
                    const int64_t m0 = M * s / slivers, m1 = M * (s + 1) / slivers;
                    const char *xr = (const char *)x + (m0 * ldx + k0) * (x16 ? 2 : xsize);
                    if (x16) w16_widen_x((const uint16_t *)xr, ldx, m1 - m0, kc, xs, ldxs), xr = (const char *)xs;
                    /* this sliver's outputs: y's rows, or the per-thread sliver (column 0 = panel p0's) */
                    float *yb = ys ? ys : y + m0 * ldy + n0;
                    const int64_t ldb = ys ? ldys : ldy;
                    for (int64_t p = p0; p < p1; p++) {
                        const int64_t cols = N - p * W16_NR;
                        const float *yn = p + 1 < p1 ? yb + (p + 1 - p0) * W16_NR
                                                     : ys ? ys : y + (m1 < M ? m1 : m0) * ldy + n0;
                        const void *panel = pre ? (const void *)(pre + (p * K + k0) * W16_NR)
                                                : (const void *)(bp + (p - p0) * units * W16_NR);
                        tiles[m1 - m0](xr, x16 ? ldxs : ldx, panel, kc, yb + (p - p0) * W16_NR, ldb, k0 == 0,
                                       w16_mask(cols), w16_mask(cols - 16), yn);
                    }
                    if (y16 && k0 + kc == K) w16_round_y(yb, ldb, m1 - m0, nn, y16 + m0 * ldy16 + n0, ldy16);
                }
            }
        }
    }
    return failed ? -1 : 0;
}

/* w uint16 [N, K] (bf16: kind W16_B16, float16: W16_H16) into out uint16 [ceil(N / 32)][K][32], w16_gemm's `pre`:
 * per panel of 32 weight rows, each input's 32 values in one 64-byte line (bf16: row j and row j + 16 share lane j,
 * as W16_LOAD_B reads them; float16: rows in order); rows past N zeros. Once, at load (quant.prepack_panels). */
static void w16_prepack(const uint16_t *q, int64_t N, int64_t K, const int kind, uint16_t *out, int num_threads) {
    w16_prepack_rows(q, N, K, kind == W16_H16, W16_NR, out, num_threads);
}
#endif
