/* Part of quant.c (through quant_w16.h): 16-bit float weights (bfloat16 or float16, quant.h's row_w16
 * layout: uint16 [N, K]) times many rows of float32 x, float32 out, on AVX2 builds (CPUs without AVX-512:
 * Zen 3 and older EPYCs): atomd_qgemm_b16_panels / _h16_panels packed per call, from quant.py's QGEMM_W16_MIN_M rows
 * (the same threshold as AVX-512's), and atomd_qgemm_*_prepacked on strips packed once at load (w16_prepack, 16-bit:
 * no per-call pass; 1.5-1.8x the per-call panels' rate at 16 rows on the 135M / 0.6B linears, RESULTS.md); no bf16
 * x (that stays AVX-512).
 *
 * Where the rows (quant.h's row_w16) widen a weight vector for up to 8 rows of x and load x once an FMA,
 * here each thread widens its panel of weight rows (about W16_AVX2_PANEL bytes of float32, L2) once per call
 * into strips of 16 rows transposed, [K][16], and runs every W16_AVX2_MR rows of x against every strip: a
 * 6 x 16 micro-kernel of 12 accumulators, per input two weight loads and six broadcasts of x into 12 FMAs (a float32
 * GEMM's register blocking, on half the bytes from memory); from load-time strips the same micro-kernel widens each
 * input's 16 weights in registers. Against load-time strips x reaches the micro-kernel packed as a float32 GEMM packs
 * it, each group of rows [K][rows] (w16a_pack_x): its six broadcasts from one line instead of six rows' streams. Every y[m, n] is one chain
 * of FMAs over k = 0..K-1 in order: its bits do not depend on M, the threads, the panels or the blocks. */
#if QUANT_PATH == 1
#include <omp.h>
#include <stdlib.h>
#include "fast_exp.h"  /* silu */
#include "norm_row.h"  /* rms_norm_row_f32 */

#define W16_PANELS_AVX2 1
enum { W16_B16 = 0, W16_H16 = 1 };  /* (quant_w16.h's kinds: the weight's 16-bit values) */
#define W16_AVX2_NR 16  /* weight rows a strip: two vectors */
#define W16_AVX2_MR 6   /* rows of x a micro-kernel: 12 accumulators + 2 weight vectors + a broadcast */
#define W16_AVX2_PANEL (256 << 10)  /* packed float32 bytes a work item (L2) */
#define W16_AVX2_KC 512  /* inputs a pass of a load-time strip over a block of x's rows: the strip's part and six rows'
                            in L1 (K 1024: ~1.02x the whole K's rate, RESULTS.md #35 session 27) */
#define W16_AVX2_BY_ROWS 256  /* rows of x a thread from which the load-time strips' products split rows between
                                 the threads, not strips (w16a_part; RESULTS.md #35 session 28) */

/* weight rows n0 .. n0 + 16 strips widened into wp: strip j at wp + j * 16 K, [K][16] (rows from N on zero); 8 rows
 * x 8 inputs at a time widened and transposed in registers */
static void w16a_pack(const uint16_t *q, int f16, int64_t N, int64_t K, int64_t n0, int64_t strips, float *wp) {
    for (int64_t j = 0; j < strips; j++)
        for (int h = 0; h < W16_AVX2_NR / 8; h++) {
            const int64_t r0 = n0 + j * W16_AVX2_NR + h * 8;
            float *dst = wp + j * W16_AVX2_NR * K + h * 8;
            int64_t k = 0;
            for (; k + 8 <= K; k += 8) {
                __m256 v[8];
                for (int r = 0; r < 8; r++) {
                    const uint16_t *p = q + (r0 + r) * K + k;
                    v[r] = r0 + r >= N ? _mm256_setzero_ps() : f16 ? load_h16(p) : load_b16(p);
                }
                transpose8_ps(v);
                for (int i = 0; i < 8; i++) _mm256_storeu_ps(dst + (k + i) * W16_AVX2_NR, v[i]);
            }
            for (; k < K; k++)
                for (int r = 0; r < 8; r++) {
                    const uint16_t w = r0 + r < N ? q[(r0 + r) * K + k] : 0;  /* (0: +0.0 in both formats) */
                    dst[k * W16_AVX2_NR + r] = f16 ? h16_to_float(w) : b16_to_float(w);
                }
        }
}

/* where a micro-kernel's strip comes from: widened per call (float32 [K][16]) or packed at load (16-bit [K][16], bf16
 * rows 0-3, 8-11, 4-7, 12-15, float16 rows in order: w16_prepack) */
enum { W16A_F32 = 0, W16A_B16 = 1, W16A_H16 = 2 };

/* input k's 16 weights of a strip of layout src (a constant after inlining) at w, widened into w0 (outputs 0..7) and
 * w1 (8..15): a load-time strip in registers, bf16 by interleaving one 32-byte load with zeros (two shuffles, which
 * Intel can issue beside the FMAs, where a shift takes an FMA port: RESULTS.md #35 session 27), float16 by two
 * conversions */
static inline __attribute__((always_inline)) void w16a_load(const int src, const void *w, int64_t k, __m256 *w0,
                                                            __m256 *w1) {
    if (src == W16A_F32) {
        *w0 = _mm256_loadu_ps((const float *)w + k * W16_AVX2_NR);
        *w1 = _mm256_loadu_ps((const float *)w + k * W16_AVX2_NR + 8);
    } else if (src == W16A_B16) {
        const __m256i u = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k * W16_AVX2_NR));
        *w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), u));
        *w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), u));
    } else {
        *w0 = load_h16((const uint16_t *)w + k * W16_AVX2_NR);
        *w1 = load_h16((const uint16_t *)w + k * W16_AVX2_NR + 8);
    }
}

/* mr (a constant after inlining) rows of x times one strip's K inputs into y[r * ldy + 0 .. cols); src (a constant
 * too) its layout (w16a_load). x: against a load-time strip packed [K][mr] (w16a_pack_x), against a per-call float32
 * one its rows as they are, ldx apart (a per-call panel's strips are few: packing x for each would cost more than
 * it saves). from_y: the sums go on from y's (the inputs before these, w16a_strips' blocks), the same one chain of
 * FMAs over k as a single pass. */
static inline __attribute__((always_inline)) void w16a_kernel(const int mr, const int src, const float *x, int64_t ldx,
                                                              const void *w, int64_t K, float *y, int64_t ldy,
                                                              int64_t cols, int from_y) {
    __m256 a[W16_AVX2_MR][2];
    const __m256i m0 = lanes_below8(cols), m1 = lanes_below8(cols - 8);
    if (!from_y)
        for (int r = 0; r < mr; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    else if (cols >= W16_AVX2_NR)
        for (int r = 0; r < mr; r++) {
            a[r][0] = _mm256_loadu_ps(y + r * ldy);
            a[r][1] = _mm256_loadu_ps(y + r * ldy + 8);
        }
    else
        for (int r = 0; r < mr; r++) {
            a[r][0] = _mm256_maskload_ps(y + r * ldy, m0);
            a[r][1] = _mm256_maskload_ps(y + r * ldy + 8, m1);
        }
    for (int64_t k = 0; k < K; k++) {
        __m256 w0, w1;
        w16a_load(src, w, k, &w0, &w1);
        for (int r = 0; r < mr; r++) {
            const __m256 xb = _mm256_broadcast_ss(src == W16A_F32 ? x + r * ldx + k : x + k * mr + r);
            a[r][0] = _mm256_fmadd_ps(xb, w0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(xb, w1, a[r][1]);
        }
    }
    if (cols >= W16_AVX2_NR) {
        for (int r = 0; r < mr; r++) {
            _mm256_storeu_ps(y + r * ldy, a[r][0]);
            _mm256_storeu_ps(y + r * ldy + 8, a[r][1]);
        }
        return;
    }
    for (int r = 0; r < mr; r++) {
        _mm256_maskstore_ps(y + r * ldy, m0, a[r][0]);
        _mm256_maskstore_ps(y + r * ldy + 8, m1, a[r][1]);
    }
}

/* one row of x against two adjacent load-time strips (src W16A_B16 / W16A_H16) at w, into y[0 .. 16 + cols1) (cols1:
 * the second strip's outputs, up to 16): four FMA chains in flight where one strip has two waiting on the FMA latency
 * (~1.25x the read rate at batch 1, RESULTS.md); each output the same one chain over k as w16a_kernel's */
static inline __attribute__((always_inline)) void w16a_pair(const int src, const float *x, const uint16_t *w, int64_t K,
                                                            float *y, int64_t cols1) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    const uint16_t *v = w + K * W16_AVX2_NR;
    for (int64_t k = 0; k < K; k++) {
        __m256 w0, w1, v0, v1;
        w16a_load(src, w, k, &w0, &w1);
        w16a_load(src, v, k, &v0, &v1);
        const __m256 xb = _mm256_broadcast_ss(x + k);
        a0 = _mm256_fmadd_ps(xb, w0, a0);
        a1 = _mm256_fmadd_ps(xb, w1, a1);
        b0 = _mm256_fmadd_ps(xb, v0, b0);
        b1 = _mm256_fmadd_ps(xb, v1, b1);
    }
    _mm256_storeu_ps(y, a0);
    _mm256_storeu_ps(y + 8, a1);
    _mm256_maskstore_ps(y + 16, lanes_below8(cols1), b0);
    _mm256_maskstore_ps(y + 24, lanes_below8(cols1 - 8), b1);
}

/* rows m0 .. m1 of x [M, ldx] packed into xp as w16a_strip reads them from load-time strips: each group of
 * W16_AVX2_MR rows (the last one what is left) [K][rows], one after the other; a whole group 8 inputs at a time
 * transposed in registers, each input's 6 values stored as 8 (the 2 past them rewritten by the next input's: a
 * group's last input goes the scalar way, so nothing lands past the group) */
static void w16a_pack_x(const float *x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, float *xp) {
    for (int64_t m = m0; m < m1; m += W16_AVX2_MR) {
        const int mr = m1 - m < W16_AVX2_MR ? (int)(m1 - m) : W16_AVX2_MR;
        float *dst = xp + (m - m0) * K;
        int64_t k0 = 0;
        if (mr == W16_AVX2_MR)
            for (; k0 + 8 < K; k0 += 8) {
                __m256 v[8];
                for (int r = 0; r < W16_AVX2_MR; r++) v[r] = _mm256_loadu_ps(x + (m + r) * ldx + k0);
                v[6] = v[7] = _mm256_setzero_ps();
                transpose8_ps(v);
                for (int i = 0; i < 8; i++) _mm256_storeu_ps(dst + (k0 + i) * W16_AVX2_MR, v[i]);
            }
        for (int64_t k = k0; k < K; k++)
            for (int r = 0; r < mr; r++) dst[k * mr + r] = x[(m + r) * ldx + k];
    }
}

/* rows m0 .. m1 of x times inputs k0 .. k0 + kn of strip j (of layout src, at wj) into y, W16_AVX2_MR rows a
 * micro-kernel; x as w16a_kernel reads it: packed from row m0 on (w16a_pack_x) for a load-time strip, else x's rows
 * from m0 on, ldx apart. From k0 > 0 on the sums go on from y's (w16a_kernel's from_y). */
static void w16a_strip(const int src, const float *x, int64_t ldx, int64_t m0, int64_t m1, const void *wj, int64_t N,
                       int64_t K, int64_t j, float *y, int64_t ldy, int64_t k0, int64_t kn) {
    const int64_t cols = N - j * W16_AVX2_NR;
    const void *w = (const char *)wj + k0 * W16_AVX2_NR * (src == W16A_F32 ? 4 : 2);
    const int from_y = k0 > 0;
    for (int64_t m = m0; m < m1; m += W16_AVX2_MR) {
        const int mr = m1 - m < W16_AVX2_MR ? (int)(m1 - m) : W16_AVX2_MR;
        const float *xr = src == W16A_F32 ? x + (m - m0) * ldx + k0 : x + (m - m0) * K + k0 * mr;
        float *yj = y + m * ldy + j * W16_AVX2_NR;
#define W16A_ROWS(SRC)                                                                    \
        switch (mr) { /* mr a constant in each instance */                               \
            case 1: w16a_kernel(1, SRC, xr, ldx, w, kn, yj, ldy, cols, from_y); break;   \
            case 2: w16a_kernel(2, SRC, xr, ldx, w, kn, yj, ldy, cols, from_y); break;   \
            case 3: w16a_kernel(3, SRC, xr, ldx, w, kn, yj, ldy, cols, from_y); break;   \
            case 4: w16a_kernel(4, SRC, xr, ldx, w, kn, yj, ldy, cols, from_y); break;   \
            case 5: w16a_kernel(5, SRC, xr, ldx, w, kn, yj, ldy, cols, from_y); break;   \
            default: w16a_kernel(W16_AVX2_MR, SRC, xr, ldx, w, kn, yj, ldy, cols, from_y); break;\
        }
        if (src == W16A_F32) W16A_ROWS(W16A_F32)
        else if (src == W16A_B16) W16A_ROWS(W16A_B16)
        else W16A_ROWS(W16A_H16)
#undef W16A_ROWS
    }
}

/* one row of x against strips j0 .. j1 of a load-time layout (src W16A_B16 / W16A_H16) into y, two strips at a time
 * (w16a_pair), a last odd one alone: batch 1 (w16_strips_gemv, w16_gemm_avx2_prepacked at M 1) */
static void w16a_row(const int src, const float *x, const uint16_t *pre, int64_t N, int64_t K, int64_t j0, int64_t j1,
                     float *y) {
    int64_t j = j0;
    for (; j + 2 <= j1; j += 2) {
        const int64_t cols1 = N - (j + 1) * W16_AVX2_NR;
        if (src == W16A_B16)
            w16a_pair(W16A_B16, x, pre + j * W16_AVX2_NR * K, K, y + j * W16_AVX2_NR, cols1);
        else
            w16a_pair(W16A_H16, x, pre + j * W16_AVX2_NR * K, K, y + j * W16_AVX2_NR, cols1);
    }
    if (j < j1) w16a_strip(src, x, K, 0, 1, pre + j * W16_AVX2_NR * K, N, K, j, y, N, 0, K);  /* (one row: packed as it is) */
}

/* strips s0 .. s1 widened into wp and run against the M rows of x into y */
static void w16a_panel(const float *x, int64_t ldx, int64_t M, const uint16_t *q, int f16, int64_t N, int64_t K,
                       int64_t s0, int64_t s1, float *y, int64_t ldy, float *wp) {
    w16a_pack(q, f16, N, K, s0 * W16_AVX2_NR, s1 - s0, wp);
    for (int64_t m0 = 0; m0 < M; m0 += W16_AVX2_MR)
        for (int64_t j = s0; j < s1; j++)
            w16a_strip(W16A_F32, x + m0 * ldx, ldx, m0, m0 + W16_AVX2_MR < M ? m0 + W16_AVX2_MR : M,
                       wp + (j - s0) * W16_AVX2_NR * K, N, K, j, y, ldy, 0, K);
}

/* y [M, ldy] = x [M, ldx] @ widen(q)^T; 0 done, -1 out of memory */
static int w16_gemm_avx2(const float *x, int64_t ldx, int64_t M, const uint16_t *q, int f16, int64_t N, int64_t K,
                         float *y, int64_t ldy, int num_threads) {
    const int64_t strips = (N + W16_AVX2_NR - 1) / W16_AVX2_NR;
    int64_t most = W16_AVX2_PANEL / (W16_AVX2_NR * K * (int64_t)sizeof(float));
    most = most < 1 ? 1 : most;
    const int64_t panels = panel_items(strips, most, num_threads);
    const int64_t chunk = (strips + panels - 1) / panels;
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        float *wp = aligned_alloc(64, (size_t)chunk * W16_AVX2_NR * K * sizeof(float));
        if (wp == NULL) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(static)")
        for (int64_t p = 0; p < panels; p++)
            if (wp != NULL) w16a_panel(x, ldx, M, q, f16, N, K, p * strips / panels, (p + 1) * strips / panels, y, ldy, wp);
        free(wp);
    }
    return failed ? -1 : 0;
}

/* rows of x a block of w16a_strips: their packed float32 within W16_AVX2_PANEL bytes (L2), whole groups */
static inline int64_t w16a_block(int64_t K, int64_t M) {
    const int64_t block = W16_AVX2_PANEL / (K * (int64_t)sizeof(float)) / W16_AVX2_MR * W16_AVX2_MR;
    return block < W16_AVX2_MR ? W16_AVX2_MR : block > M ? M : block;
}

/* rows m0 .. m1 of x, packed from m0 on (w16a_pack_x), times the whole of load-time strip j (at wj) into y,
 * W16_AVX2_KC inputs at a time (the strip's part and six rows' in L1), the sums carried in y between them */
static void w16a_strip_blocks(const int src, const float *xp, int64_t m0, int64_t m1, const void *wj, int64_t N,
                              int64_t K, int64_t j, float *y, int64_t ldy) {
    for (int64_t k0 = 0; k0 < K; k0 += W16_AVX2_KC)
        w16a_strip(src, xp, 0, m0, m1, wj, N, K, j, y, ldy, k0, K - k0 < W16_AVX2_KC ? K - k0 : W16_AVX2_KC);
}

/* the residual add and RMSNorm after an output projection (w16_gemm_avx2_prepacked's norm): res [M, ldr] += the
 * product, then y = RMSNorm(res) * w, each row as layer_ops.c's rms_norm with delta (rms_norm_row_f32) */
typedef struct {
    float *res;
    int64_t ldr;
    const float *w;
    float eps;
} w16a_norm;

static inline void w16a_norm_rows(const w16a_norm *norm, int64_t m0, int64_t m1, int64_t N, float *y, int64_t ldy) {
    for (int64_t m = m0; m < m1; m++)
        rms_norm_row_f32(norm->res + m * norm->ldr, y + m * ldy, norm->w, y + m * ldy, N, norm->eps);
}

/* the M rows of x against strips s0 .. s1 of a load-time layout (src W16A_B16 / W16A_H16) into y, on this thread: per
 * block of x's rows that stays in L2 (W16_AVX2_PANEL bytes), packed (w16a_pack_x), each strip against every row of
 * the block W16_AVX2_KC inputs at a time (the strip, K * 32 bytes, read from memory once a block and from L1 after);
 * one row two strips at a time (w16a_row). Each output one FMA chain over k in order whatever the blocks: w16_gemm_avx2_prepacked's threads'
 * runs and moe_q8.h's 16-bit experts. 0 done, -1 no memory for the packed rows. */
static int w16a_strips(const int src, const float *x, int64_t ldx, int64_t M, const uint16_t *pre, int64_t N,
                       int64_t K, int64_t s0, int64_t s1, float *y, int64_t ldy, const w16a_norm *norm) {
    if (M == 1) {
        w16a_row(src, x, pre, N, K, s0, s1, y);
        if (norm) w16a_norm_rows(norm, 0, 1, N, y, ldy);
        return 0;
    }
    const int64_t block = w16a_block(K, M);
    float *xp = malloc((size_t)block * K * sizeof(float));
    if (xp == NULL) return -1;
    for (int64_t m0 = 0; m0 < M; m0 += block) {
        const int64_t m1 = m0 + block < M ? m0 + block : M;
        w16a_pack_x(x, ldx, m0, m1, K, xp);
        for (int64_t j = s0; j < s1; j++)
            w16a_strip_blocks(src, xp, m0, m1, pre + j * W16_AVX2_NR * K, N, K, j, y, ldy);
        if (norm) w16a_norm_rows(norm, m0, m1, N, y, ldy);  /* (the block's rows of y still in L2) */
    }
    free(xp);
    return 0;
}

/* this thread's part (t of n) of an M-row product over `items` runs of strips: from W16_AVX2_BY_ROWS rows a thread
 * its run of x's rows (m0 .. m1, whole groups) against every item, below it every row against its run of items (s0
 * .. s1). Splitting the strips, each thread packs all of x: at the rows of a prefill tile that costs more than each
 * reading all the strips (RESULTS.md #35 session 28), while at a batch's few rows the strips are the bytes to share. */
static inline void w16a_part(int64_t M, int64_t items, int t, int n, int64_t *m0, int64_t *m1, int64_t *s0,
                             int64_t *s1) {
    const int64_t groups = (M + W16_AVX2_MR - 1) / W16_AVX2_MR;
    if (M >= W16_AVX2_BY_ROWS * n) {
        *m0 = groups * t / n * W16_AVX2_MR;
        *m1 = groups * (t + 1) / n * W16_AVX2_MR < M ? groups * (t + 1) / n * W16_AVX2_MR : M;
        *s0 = 0;
        *s1 = items;
    } else {
        *m0 = 0;
        *m1 = M;
        *s0 = items * t / n;
        *s1 = items * (t + 1) / n;
    }
}

/* out [M, ldo] = silu(x @ gate^T) * (x @ up^T), gate and up the two halves of a load-time layout's 2 * inter rows
 * (inter % 16 == 0: a gate_up projection, gate first), pairs p0 .. p1 of strips (gate p, up inter / 16 + p) on
 * this thread: per block of x's rows as w16a_strips, each strip of a pair into a buffer of the block's rows x 16
 * and the two combined into out's columns 16p .. 16p + 16 as layer_ops.c's silu_mul combines them. The bits of the
 * product then silu_mul, without the [M, 2 inter] product in memory. 0 done, -1 no memory. */
static int w16a_strips_silu(const int src, const float *x, int64_t ldx, int64_t M, const uint16_t *pre, int64_t inter,
                            int64_t K, int64_t p0, int64_t p1, float *out, int64_t ldo) {
    const int64_t block = w16a_block(K, M), up = inter / W16_AVX2_NR;
    float *xp = malloc((size_t)block * (K + 2 * W16_AVX2_NR) * sizeof(float));
    if (xp == NULL) return -1;
    float *g = xp + block * K, *u = g + block * W16_AVX2_NR;
    for (int64_t m0 = 0; m0 < M; m0 += block) {
        const int64_t rows = m0 + block < M ? block : M - m0;
        w16a_pack_x(x, ldx, m0, m0 + rows, K, xp);
        for (int64_t p = p0; p < p1; p++) {  /* (each strip alone: its 16 columns from 0) */
            w16a_strip_blocks(src, xp, 0, rows, pre + p * W16_AVX2_NR * K, W16_AVX2_NR, K, 0, g, W16_AVX2_NR);
            w16a_strip_blocks(src, xp, 0, rows, pre + (up + p) * W16_AVX2_NR * K, W16_AVX2_NR, K, 0, u, W16_AVX2_NR);
            for (int64_t r = 0; r < rows; r++) {
                float *o = out + (m0 + r) * ldo + p * W16_AVX2_NR;
                const float *gr = g + r * W16_AVX2_NR, *ur = u + r * W16_AVX2_NR;
#pragma omp simd
                for (int i = 0; i < W16_AVX2_NR; i++) o[i] = silu(gr[i]) * ur[i];
            }
        }
    }
    free(xp);
    return 0;
}

/* y [M, ldy] = x [M, ldx] @ widen(pre)^T with pre packed at load (w16_prepack), each thread its part (w16a_part,
 * w16a_strips); with silu a gate_up projection's activation instead, y [M, N / 2] (w16a_strips_silu, each thread its
 * part of the strip pairs); with norm (not with silu) the residual add and RMSNorm after it, y their output: a
 * thread's rows per block while in L2 where it has whole rows, else after the product. 0 done, -1 out of memory. */
static int w16_gemm_avx2_prepacked(const float *x, int64_t ldx, int64_t M, const uint16_t *pre, int f16, int64_t N,
                                   int64_t K, float *y, int64_t ldy, int num_threads, const int silu,
                                   const w16a_norm *norm) {
    const int src = f16 ? W16A_H16 : W16A_B16;
    const int64_t items = silu ? N / 2 / W16_AVX2_NR : (N + W16_AVX2_NR - 1) / W16_AVX2_NR;
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        int64_t m0, m1, s0, s1;
        w16a_part(M, items, omp_get_thread_num(), omp_get_num_threads(), &m0, &m1, &s0, &s1);
        const int whole_rows = s0 == 0 && s1 == items;  /* (alike on every thread: M and the threads decide) */
        w16a_norm mine;
        if (norm) mine = (w16a_norm){norm->res + m0 * norm->ldr, norm->ldr, norm->w, norm->eps};
        if ((silu ? w16a_strips_silu(src, x + m0 * ldx, ldx, m1 - m0, pre, N / 2, K, s0, s1, y + m0 * ldy, ldy)
                  : w16a_strips(src, x + m0 * ldx, ldx, m1 - m0, pre, N, K, s0, s1, y + m0 * ldy, ldy,
                                norm && whole_rows ? &mine : NULL)) != 0) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        if (norm && !whole_rows) {
            _Pragma("omp barrier")
            int stop;
            _Pragma("omp atomic read")
            stop = failed;
            if (!stop) {
                _Pragma("omp for")
                for (int64_t m = 0; m < M; m++) w16a_norm_rows(norm, m, m + 1, N, y, ldy);
            }
        }
    }
    return failed ? -1 : 0;
}

/* y = strips . x (+ bias) for one row x at batch 1 (quant.h's atomd_qgemv_rows where the strips are the weight's only
 * copy): an orphaned `omp for` over the strips (the caller's region shares them), w16_gemm_avx2_prepacked's chains */
static void w16_strips_gemv(const float *x, const uint16_t *strips, int f16, const float *bias, float *y, int64_t K,
                            int64_t N) {
    const int64_t n_strips = (N + W16_AVX2_NR - 1) / W16_AVX2_NR;
    _Pragma("omp for schedule(static)")
    for (int64_t p = 0; p < (n_strips + 1) / 2; p++) {  /* two strips an item (w16a_row's pairs) */
        const int64_t j1 = 2 * p + 2 < n_strips ? 2 * p + 2 : n_strips;
        w16a_row(f16 ? W16A_H16 : W16A_B16, x, strips, N, K, 2 * p, j1, y);
        for (int64_t n = 2 * p * W16_AVX2_NR; bias && n < j1 * W16_AVX2_NR && n < N; n++) y[n] += bias[n];
    }
}

/* w uint16 [N, K] (kind W16_B16 or W16_H16) into out uint16 [ceil(N / 16)][K][16], w16_gemm_avx2_prepacked's `pre`:
 * per strip of 16 weight rows, each input's 16 values in one 32-byte load (bf16: rows 0-3, 8-11, 4-7, 12-15, which
 * w16a_load's interleaving with zeros widens into rows 0-7 and 8-15; float16: rows in order); rows past N zeros.
 * Once, at load (quant.prepack_panels). */
static void w16_prepack(const uint16_t *q, int64_t N, int64_t K, const int kind, uint16_t *out, int num_threads) {
    w16_prepack_rows(q, N, K, kind == W16_H16, W16_AVX2_NR, out, num_threads);
}
#endif

/* y [M, ldy] = x [M, ldx] @ widen(w)^T for a 16-bit weight (f16: float16 values, else bfloat16) through panels:
 * pre, packed once at load in 16 bits (atomd_qprepack_*: AVX-512's 32-row panels, quant_w16.h's w16_prepack, or
 * AVX2's 16-row strips, w16_prepack here), or (pre NULL) q widened into float32 panels per call (AVX-512's w16_gemm,
 * AVX2's w16_gemm_avx2). 0 done; 1 not built here (the caller widens tiles for a BLAS); -1
 * out of memory. atomd_qgemm_*_panels / _prepacked (quant.c) and the fused batch's rows (layer_ops.c). */
static inline int w16_panels_product(const float *x, int64_t ldx, int64_t M, const uint16_t *q, const uint16_t *pre,
                                     int f16, int64_t N, int64_t K, float *y, int64_t ldy, int num_threads) {
#ifdef W16_PANELS
    return w16_gemm(x, ldx, M, pre ? NULL : q, pre, f16 ? W16_H16 : W16_B16, N, K, y, ldy, num_threads, 0, NULL, 0);
#elif defined(W16_PANELS_AVX2)
    return pre ? w16_gemm_avx2_prepacked(x, ldx, M, pre, f16, N, K, y, ldy, num_threads, 0, NULL)
               : w16_gemm_avx2(x, ldx, M, q, f16, N, K, y, ldy, num_threads);
#else
    (void)x, (void)ldx, (void)M, (void)q, (void)pre, (void)f16, (void)N, (void)K, (void)y, (void)ldy, (void)num_threads;
    return 1;
#endif
}

/* the 16-bit panels this build has: 1 every form (AVX-512, quant_w16.h's 32-row panels), 2 float32 x's per call and
 * at load (AVX2, the 16-row strips here), 0 none: atomd_quant_w16_panels (quant.c) and atomd_layer_w16_layout
 * (layer_ops.c, the layout its quantized layer reads) */
static inline int w16_panels_kind(void) {
#if defined(W16_PANELS)
    return 1;
#elif defined(W16_PANELS_AVX2)
    return 2;
#else
    return 0;
#endif
}
