/* The int8 / int4 weight rows of atomd/csrc/quant.c (its comment has the layout), shared with
 * atomd/csrc/layer_ops.c's fused batch-1 decode layer: a vector type per ISA (AVX-512 BW/VL,
 * AVX2 + FMA, scalar), the loads that dequantise in registers, and one weight row against up
 * to QGEMM_ROWS rows of float32 activations. */
#ifndef ATOMD_QUANT_H
#define ATOMD_QUANT_H
#include <math.h>
#include <omp.h>
#include "lane_sums.h"  /* (AVX2 builds: lanes_below8, transpose8_ps; abs_max's intrinsics) */
#include <stddef.h>
#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define QUANT_PATH 2
#define LANES 16
typedef __m512 vf;
#define VZERO() _mm512_setzero_ps()
#define VSET1(a) _mm512_set1_ps(a)
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSUM(a) _mm512_reduce_add_ps(a)
static inline vf load_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* 32 int4 values (16 bytes) -> 2 vectors, in order */
static inline void load_i4(const uint8_t *p, vf out[32 / LANES]) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(15);
    out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, low)));
    out[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), low)));
}
/* LANES bf16 weights widened to float32: the 16 bits moved to the top of each lane (exact) */
static inline vf load_b16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
/* LANES float16 weights widened to float32 (exact, subnormals included) */
static inline vf load_h16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QUANT_PATH 1
#define LANES 8
typedef __m256 vf;
#define VZERO() _mm256_setzero_ps()
#define VSET1(a) _mm256_set1_ps(a)
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline float VSUM(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline vf load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline void load_i4(const uint8_t *p, vf out[32 / LANES]) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}
static inline vf load_b16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#ifdef __F16C__ /* every AVX2 CPU has it (x86-64-v3); a build without the flag widens one value at a time */
static inline vf load_h16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#else
#define LOAD_H16_SCALAR 1
#endif
#else
#define QUANT_PATH 0
#define LANES 1
typedef float vf;
#define VZERO() 0.0f
#define VSET1(a) (a)
#define VLOAD(p) (*(p))
#define VSTORE(p, v) (*(p) = (v))
#define VFMA(a, b, c) ((a) * (b) + (c))
#define VSUM(a) (a)
static inline vf load_i8(const int8_t *p) { return (float)*p; }
static inline void load_i4(const uint8_t *p, vf out[32]) {
    for (int i = 0; i < 16; i++) {
        out[i] = (float)(p[i] & 15);
        out[i + 16] = (float)(p[i] >> 4);
    }
}
#endif

static inline float b16_to_float(uint16_t v) {  /* bf16 -> float32: exact, the bits moved up */
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)v << 16;
    return c.f;
}
/* float16 -> float32: exact (normal, subnormal, zero, inf, NaN) */
static inline float h16_to_float(uint16_t h) {
    union { uint32_t u; float f; } c;
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f)
        c.u = sign | 0x7f800000u | (man << 13);
    else if (exp != 0)
        c.u = sign | ((exp + 112) << 23) | (man << 13);
    else {  /* zero or subnormal: man x 2^-24, exact in float32 */
        c.f = (float)man * 0x1p-24f;
        c.u |= sign;
    }
    return c.f;
}
#if QUANT_PATH == 0
static inline vf load_b16(const uint16_t *p) { return b16_to_float(*p); }
static inline vf load_h16(const uint16_t *p) { return h16_to_float(*p); }
#elif defined(LOAD_H16_SCALAR)
static inline vf load_h16(const uint16_t *p) {
    float f[LANES];
    for (int i = 0; i < LANES; i++) f[i] = h16_to_float(p[i]);
    return VLOAD(f);
}
#endif

/* a weight row's bytes this far ahead prefetched into L2 as it streams (layer_ops.c's GEMV_PREFETCH: why) */
#define QPREFETCH(p) __builtin_prefetch((const char *)(p) + 4096, 0, 2)

/* work items of whole strips for a per-call packed GEMM (quant_gemm.h, quant_w16_avx2.h): panels of at most `most`
 * strips (or one), as many for every thread (a static schedule), sizes one strip apart: item p is strips
 * p * strips / items .. (p + 1) * strips / items */
static inline int64_t panel_items(int64_t strips, int64_t most, int num_threads) {
    int64_t items = (strips + most - 1) / most;
    items = (items + num_threads - 1) / num_threads * num_threads;
    return items > strips ? strips : items;
}

/* a 16-bit weight uint16 [N, K] into out uint16 [ceil(N / nr)][K][nr], the load-time panels (quant_w16.h, nr 32) or
 * strips (quant_w16_avx2.h, nr 16): per nr weight rows each input's nr values in one line; bfloat16 (f16 0) panels'
 * rows j and j + 16 sharing 32-bit lane j (a shift and a mask widen them), strips' rows 0-3, 8-11, 4-7, 12-15 (AVX2's
 * in-lane interleaving with zeros widens them), float16 rows in order; rows past N zeros */
static inline void w16_prepack_rows(const uint16_t *q, int64_t N, int64_t K, int f16, int64_t nr, uint16_t *out,
                                    int num_threads) {
    const int64_t panels = (N + nr - 1) / nr;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t p = 0; p < panels; p++)
        for (int64_t j = 0; j < nr; j++) {
            const int64_t n = p * nr + j, slot = f16 ? j : nr == 16 ? (j & 3) | (j >> 3) << 2 | (j >> 2 & 1) << 3
                                                         : j < nr / 2 ? 2 * j : 2 * (j - nr / 2) + 1;
            uint16_t *dst = out + p * K * nr + slot;
            for (int64_t k = 0; k < K; k++) dst[k * nr] = n < N ? q[n * K + k] : 0;
        }
}

#define QGEMM_ROWS 8  /* rows of x per pass: 8 accumulators + the weight vector stay in registers */
/* mb as a compile-time constant (1..QGEMM_ROWS): ROW(..., mb) so acc[] stays in registers */
#define DISPATCH_ROWS(ROW, ...)                       \
    switch (mb) {                                     \
        case 1: ROW(__VA_ARGS__, 1); break;           \
        case 2: ROW(__VA_ARGS__, 2); break;           \
        case 3: ROW(__VA_ARGS__, 3); break;           \
        case 4: ROW(__VA_ARGS__, 4); break;           \
        case 5: ROW(__VA_ARGS__, 5); break;           \
        case 6: ROW(__VA_ARGS__, 6); break;           \
        case 7: ROW(__VA_ARGS__, 7); break;           \
        default: ROW(__VA_ARGS__, 8); break;          \
    }

#define I4_VECS (32 / LANES)

/* One weight row n against mb (a constant after inlining) rows of x: y[m * ldy] for m < mb. */
static inline __attribute__((always_inline)) void row_i8(const float *x, int64_t ldx, const int8_t *q,
                                                         const float *s, const float *o, int64_t K, int64_t G,
                                                         float *y, int64_t ldy, const int mb) {
    vf acc[QGEMM_ROWS];
    float tail[QGEMM_ROWS];
    for (int m = 0; m < mb; m++) {
        acc[m] = VZERO();
        tail[m] = 0.0f;
    }
    for (int64_t g0 = 0, gi = 0; g0 < K; g0 += G, gi++) {
        const int64_t g1 = g0 + G < K ? g0 + G : K;
        const float sc = s[gi], of = o ? o[gi] : 0.0f;
        const vf vs = VSET1(sc), vo = VSET1(of);
        int64_t k = g0;
        for (; k + LANES <= g1; k += LANES) {
            QPREFETCH(q + k);
            const vf w = VFMA(load_i8(q + k), vs, vo);
            for (int m = 0; m < mb; m++) acc[m] = VFMA(VLOAD(x + m * ldx + k), w, acc[m]);
        }
        for (; k < g1; k++) {
            /* fmaf: the same operation in every instance of mb (a plain a * b + c is contracted into an FMA
             * in some and not others, so a row's bits would depend on the rows beside it) */
            const float w = fmaf((float)q[k], sc, of);
            for (int m = 0; m < mb; m++) tail[m] = fmaf(x[m * ldx + k], w, tail[m]);
        }
    }
    for (int m = 0; m < mb; m++) y[m * ldy] = VSUM(acc[m]) + tail[m];
}

static inline __attribute__((always_inline)) void row_i4(const float *x, int64_t ldx, const uint8_t *q,
                                                         const float *s, const float *o, int64_t K, int64_t G,
                                                         float *y, int64_t ldy, const int mb) {
    vf acc[QGEMM_ROWS];
    for (int m = 0; m < mb; m++) acc[m] = VZERO();
    for (int64_t g0 = 0, gi = 0; g0 < K; g0 += G, gi++) {
        const vf vs = VSET1(s[gi]), vo = VSET1(o ? o[gi] : 0.0f);
        for (int64_t k = g0; k < g0 + G; k += 32) {
            vf w[I4_VECS];
            QPREFETCH(q + k / 2);
            load_i4(q + k / 2, w);
            for (int v = 0; v < I4_VECS; v++) {
                const vf wv = VFMA(w[v], vs, vo);
                for (int m = 0; m < mb; m++) acc[m] = VFMA(VLOAD(x + m * ldx + k + v * LANES), wv, acc[m]);
            }
        }
    }
    for (int m = 0; m < mb; m++) y[m * ldy] = VSUM(acc[m]);
}

/* 16-bit float weights (q uint16 [N, K] of bfloat16 values, bits 16, or float16 values,
 * bits QBITS_F16; no scales) widened in registers, float32 activations and sums: half the bytes
 * of a float32 weight, any ISA (no 16-bit arithmetic needed). Two accumulators per row of x: the
 * loop is a load, a widen and an FMA per vector. f16 is a constant after inlining. */
#define QBITS_F16 (-16)
static inline __attribute__((always_inline)) void row_w16(const float *x, int64_t ldx, const uint16_t *q, int64_t K,
                                                          float *y, int64_t ldy, const int mb, const int f16) {
    vf acc[QGEMM_ROWS], acc2[QGEMM_ROWS];
    float tail[QGEMM_ROWS];
    for (int m = 0; m < mb; m++) {
        acc[m] = acc2[m] = VZERO();
        tail[m] = 0.0f;
    }
    int64_t k = 0;
    for (; k + 2 * LANES <= K; k += 2 * LANES) {
        QPREFETCH(q + k);
        const vf w0 = f16 ? load_h16(q + k) : load_b16(q + k), w1 = f16 ? load_h16(q + k + LANES) : load_b16(q + k + LANES);
        for (int m = 0; m < mb; m++) {
            acc[m] = VFMA(VLOAD(x + m * ldx + k), w0, acc[m]);
            acc2[m] = VFMA(VLOAD(x + m * ldx + k + LANES), w1, acc2[m]);
        }
    }
    for (; k < K; k++) {
        const float w = f16 ? h16_to_float(q[k]) : b16_to_float(q[k]);
        for (int m = 0; m < mb; m++) tail[m] = fmaf(x[m * ldx + k], w, tail[m]);  /* (fmaf: row_i8's tail) */
    }
    for (int m = 0; m < mb; m++) y[m * ldy] = VSUM(acc[m]) + VSUM(acc2[m]) + tail[m];
}
static inline __attribute__((always_inline)) void row_b16(const float *x, int64_t ldx, const uint16_t *q, int64_t K,
                                                          float *y, int64_t ldy, const int mb) {
    row_w16(x, ldx, q, K, y, ldy, mb, 0);
}
static inline __attribute__((always_inline)) void row_h16(const float *x, int64_t ldx, const uint16_t *q, int64_t K,
                                                          float *y, int64_t ldy, const int mb) {
    row_w16(x, ldx, q, K, y, ldy, mb, 1);
}
/* weight row n of a 16-bit q [N, K] (f16: float16 values, else bfloat16) against M rows of x into y[m * ldy + n],
 * QGEMM_ROWS rows a pass: atomd_qgemm_b16 / _h16's rows and moe_q8.h's 16-bit experts below their panels */
static inline __attribute__((always_inline)) void w16_weight_row(const float *x, int64_t ldx, int64_t M,
                                                                 const uint16_t *q, int64_t K, int64_t n, float *y,
                                                                 int64_t ldy, const int f16) {
    for (int64_t m0 = 0; m0 < M; m0 += QGEMM_ROWS) {
        const int mb = M - m0 < QGEMM_ROWS ? (int)(M - m0) : QGEMM_ROWS;
        if (f16) {
            DISPATCH_ROWS(row_h16, x + m0 * ldx, ldx, q + n * K, K, y + m0 * ldy + n, ldy)
        } else {
            DISPATCH_ROWS(row_b16, x + m0 * ldx, ldx, q + n * K, K, y + m0 * ldy + n, ldy)
        }
    }
}

/* y [M, ldy] = x [M, ldx] @ w^T with float activations, w int8 (bits 8) or int4 rows dequantised in registers,
 * QGEMM_ROWS rows of x a pass: atomd_qgemm_i8 / _i4 (quant.c) and the fused batch's rows (layer_ops.c) */
static inline __attribute__((always_inline)) void qgemm_int_rows(const float *x, int64_t ldx, int64_t M, const void *q,
                                                                 const int bits, const float *scales,
                                                                 const float *offsets, int64_t N, int64_t K, int64_t G,
                                                                 float *y, int64_t ldy, int num_threads) {
    const int64_t groups = (K + G - 1) / G;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (N * K >= 16384)")
    for (int64_t n = 0; n < N; n++) {
        const float *sn = scales + n * groups, *on = offsets ? offsets + n * groups : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += QGEMM_ROWS) {
            const int mb = M - m0 < QGEMM_ROWS ? (int)(M - m0) : QGEMM_ROWS;
            if (bits == 8) {
                const int8_t *qn = (const int8_t *)q + n * K;
                DISPATCH_ROWS(row_i8, x + m0 * ldx, ldx, qn, sn, on, K, G, y + m0 * ldy + n, ldy)
            } else {
                const uint8_t *qn = (const uint8_t *)q + n * (K / 2);
                DISPATCH_ROWS(row_i4, x + m0 * ldx, ldx, qn, sn, on, K, G, y + m0 * ldy + n, ldy)
            }
        }
    }
}

/* the same for a 16-bit weight q [N, K] (f16: float16 values, else bfloat16): atomd_qgemm_b16 / _h16 and the
 * fused batch's rows */
static inline __attribute__((always_inline)) void qgemm_w16_rows(const float *x, int64_t ldx, int64_t M,
                                                                 const uint16_t *q, const int f16, int64_t N, int64_t K,
                                                                 float *y, int64_t ldy, int num_threads) {
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (N * K >= 16384)")
    for (int64_t n = 0; n < N; n++) w16_weight_row(x, ldx, M, q, K, n, y, ldy, f16);
}

/* ---- int8 activations (llama.cpp's Q8_0 of the activation row): integer dot products ----
 *
 * x is quantised once per linear in act blocks of AB inputs (the weight's: its group, capped at
 * 256, quant.py's act_block_of; 32 = Q8_BLOCK is llama.cpp's Q8_0): amax = max |x|, d = amax / 127,
 * xq = rint(x * (127 / amax)) (0 for an all-zero block); per weight group g of G inputs
 * xsg_g = sum_{a in g} d_a * sum(xq_a) (in act-block order, each sum(xq_a) an exact int32). Then
 *   y[n] = sum_g s[n, g] * sum_{a in g} d_a * (q[n, a] . xq_a) + o[n, g] * xsg_g
 * with each q . xq an exact int32 (the weight's integers as stored). Only the rounding of x
 * to 8 bits and the order of the float sums differ from the float-activation rows above. K
 * and G must be multiples of AB, AB one of 32 / 64 / 128 / 256 (the caller checks). The kernels
 * below work in blocks of Q8_BLOCK = 32 inputs (the weights' int4 runs, VNNI's pairs); xd holds
 * each 32-block's d (its act block's, repeated). A row's scratch: xq [K] int8, xd [Q8_XD(K)] and
 * xsg [Q8_XSG(K)] floats. Paths (Q8_PATH): 3 AVX512-VNNI, two blocks a
 * vpdpbusd (u8 x s8; int8 weights + 128, taken back as 128 * s * xsg, so -128 stays exact),
 * up to Q8_ROWS rows of x per weight load, xd one 16-float vector per pair of blocks; 2
 * AVX-512 BW (int16 widening, vpmaddwd), 1 AVX2 (vpmaddubsw: q8_dot below) and 0 scalar, integer sums
 * over an act block, xd one float a block (read once an act block). Path 3's int4 pair: the pair's 32 bytes broadcast to both halves of a
 * register and masked, low nibbles (& 0x0F) below and high ones left in place (& 0xF0, so
 * 16 x the value) above: no shift or shuffle. x is stored to match (quantize_row_q8, bits 4:
 * per pair [b0 0-15, b1 0-15, b0 16-31, b1 16-31]) and the upper lanes' xd is d / 16, which
 * gives the same products exactly (16 x an int32 below 2^24, times a power of two). */
#define Q8_BLOCK 32
#define Q8_ROWS 4
#define Q8_R 4     /* weight rows a batch-1 pass (rows4_q8) */
#define Q8_XD(K) (((K) / Q8_BLOCK + 1) / 2 * 16)  /* one 16-float vector per pair of blocks */
#define Q8_XSG(K) ((K) / Q8_BLOCK)
#if QUANT_PATH == 2 && defined(__AVX512VNNI__) && !defined(ATOMD_NO_VNNI)
#define Q8_PATH 3
#else
#define Q8_PATH QUANT_PATH
#endif

/* max |x[i]| over n inputs (a multiple of 8), NaN skipped as a scalar `|x| > amax` skips it (vmaxps returns
 * its second operand, the running max, when the first is NaN): exact, whatever the order. Vectorised by hand:
 * GCC keeps the scalar loop's compare chain without -ffinite-math-only (~3 cycles an input, on every linear's
 * critical path at batch 1) */
static inline float abs_max(const float *x, int64_t n) {
#if defined(__AVX2__)
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), magnitude), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#else
    float amax = 0.0f;
    for (int64_t i = 0; i < n; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    return amax;
#endif
}

static inline void quantize_row_q8(const float *x, int64_t K, int64_t G, int64_t AB, int bits, int8_t *xq, float *xd,
                                   float *xsg) {
    const int64_t nb = K / Q8_BLOCK, sub = AB / Q8_BLOCK, per = G / AB;
    (void)bits;
    for (int64_t a = 0; a < K / AB; a++) {
        const float amax = abs_max(x + a * AB, AB);
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int64_t b = a * sub; b < (a + 1) * sub; b++) {  /* its 32-blocks */
            const float *xb = x + b * Q8_BLOCK;
#if Q8_PATH == 3
            /* int4 in a whole pair: halves interleaved with the pair's other block (the doc above) */
            const int mix = bits == 4 && (b | 1) < nb;
            int8_t *dst = xq + (b & ~(int64_t)1) * Q8_BLOCK + (mix ? (b % 2) * 16 : (b % 2) * Q8_BLOCK);
#else
            int8_t *dst = xq + b * Q8_BLOCK;
#endif
            for (int i = 0; i < Q8_BLOCK; i++) {
                const int8_t v = (int8_t)nearbyintf(xb[i] * id);
#if Q8_PATH == 3
                dst[mix && i >= 16 ? i + 16 : i] = v;
#else
                dst[i] = v;
#endif
                sum += v;
            }
#if Q8_PATH == 3
            float *dv = xd + (b / 2) * 16;
            if (mix)
                for (int i = 0; i < 4; i++) dv[(b % 2) * 4 + i] = d, dv[8 + (b % 2) * 4 + i] = d * 0.0625f;
            else
                for (int i = 0; i < 8; i++) dv[(b % 2) * 8 + i] = d;
#else
            xd[b] = d;
#endif
        }
        if (a % per == 0) xsg[a / per] = 0.0f;
        xsg[a / per] += d * (float)sum;
    }
#if Q8_PATH == 3
    if (nb % 2)
        for (int i = 0; i < 8; i++) xd[(nb / 2) * 16 + 8 + i] = 0.0f;
#endif
}

/* the part that does not depend on the products: sum_g (o_g - bias * s_g) * xsg_g */
static inline __attribute__((always_inline)) float q8_rest(const float *s, const float *o, int64_t groups,
                                                           const float *xsg, const float bias) {
    if (!o && bias == 0.0f) return 0.0f;
    vf acc = VZERO();
    int64_t g = 0;
    for (; g + LANES <= groups; g += LANES) {  /* groups of 32 (Q4_0, Q8_0): one term per 32 weights */
        vf c = o ? VLOAD(o + g) : VZERO();
        if (bias != 0.0f) c = VFMA(VSET1(-bias), VLOAD(s + g), c);
        acc = VFMA(c, VLOAD(xsg + g), acc);
    }
    float rest = VSUM(acc);
    for (; g < groups; g++) rest += (bias != 0.0f ? (o ? o[g] : 0.0f) - bias * s[g] : o[g]) * xsg[g];
    return rest;
}

#if Q8_PATH == 3
/* q8_rest's terms as one vector to add before the row's horizontal sum (masked loads: no scalar tail) */
static inline __attribute__((always_inline)) __m512 q8_rest_v(const float *s, const float *o, int64_t groups,
                                                              const float *xsg, const float bias) {
    __m512 acc = _mm512_setzero_ps();
    if (!o && bias == 0.0f) return acc;
    for (int64_t g = 0; g < groups; g += 16) {
        const __mmask16 k = groups - g >= 16 ? 0xFFFF : (__mmask16)((1u << (groups - g)) - 1);
        __m512 c = o ? _mm512_maskz_loadu_ps(k, o + g) : _mm512_setzero_ps();
        if (bias != 0.0f) c = _mm512_fnmadd_ps(_mm512_set1_ps(bias), _mm512_maskz_loadu_ps(k, s + g), c);
        acc = _mm512_fmadd_ps(c, _mm512_maskz_loadu_ps(k, xsg + g), acc);
    }
    return acc;
}

/* two blocks of weights as 64 unsigned bytes (full 0: the second block is past K, zeros; an
 * int4 pair in path 3's mixed order, a lone int4 block in order: low nibbles, high, zeros) */
static inline __m512i pair_u8(const void *q, int64_t b, int bits, int full) {
    if (bits == 8) {
        const int8_t *p = (const int8_t *)q + b * Q8_BLOCK;
        const __m512i w = full ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, p);
        return _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
    }
    const uint8_t *p = (const uint8_t *)q + b * (Q8_BLOCK / 2);
    if (full)
        return _mm512_and_si512(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p)),
                                _mm512_inserti64x4(_mm512_set1_epi8(15), _mm256_set1_epi8((char)0xF0), 1));
    const __m512i t = _mm512_zextsi128_si512(_mm_loadu_si128((const __m128i *)p));
    const __m512i lanes = _mm512_shuffle_i64x2(t, t, _MM_SHUFFLE(1, 1, 0, 0));  /* block 0, 0, then zeros */
    return _mm512_and_si512(_mm512_mask_blend_epi64(0xCC, lanes, _mm512_srli_epi16(lanes, 4)), _mm512_set1_epi8(15));
}

/* the sums of 4 vectors, lane r = sum of a[r] */
static inline __m128 sum4_ps(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    const __m512 t01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 t23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512 u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t01), _mm512_castps_pd(t23))),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t01), _mm512_castps_pd(t23))));
    const __m256 v = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
    return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
}

/* one weight row against mb (a constant after inlining) quantised rows of x: y[m * ldy] */
static inline __attribute__((always_inline)) void rows_q8(const void *q, int bits, const float *s, const float *o,
                                                          int64_t K, int64_t G, int64_t AB, const int8_t *xq,
                                                          const float *xd, const float *xsg, float *y, int64_t ldy,
                                                          const int mb) {
    (void)AB;  /* xd is a vector a pair of blocks here */
    __m512 acc[Q8_ROWS];
    for (int m = 0; m < mb; m++) acc[m] = _mm512_setzero_ps();
    const int64_t nb = K / Q8_BLOCK, per = G / Q8_BLOCK, groups = K / G;
    if (per % 2 == 0) {  /* groups of whole pairs (per channel, 64, 128): the weight scale once per group */
        for (int64_t g = 0; g < groups; g++) {
            __m512 gacc[Q8_ROWS];
            for (int m = 0; m < mb; m++) gacc[m] = _mm512_setzero_ps();
            for (int64_t b = g * per; b < (g + 1) * per; b += 2) {
                QPREFETCH((const uint8_t *)q + b * (bits == 8 ? Q8_BLOCK : Q8_BLOCK / 2));
                const __m512i w = pair_u8(q, b, bits, 1);
                for (int m = 0; m < mb; m++) {
                    const __m512i xv = _mm512_loadu_si512(xq + m * K + b * Q8_BLOCK);
                    gacc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv)),
                                              _mm512_loadu_ps(xd + m * Q8_XD(K) + (b / 2) * 16), gacc[m]);
                }
            }
            const __m512 sv = _mm512_set1_ps(s[g]);
            for (int m = 0; m < mb; m++) acc[m] = _mm512_fmadd_ps(gacc[m], sv, acc[m]);
        }
    }
    int64_t g = 0, left = per;  /* the group of block b, and its blocks from b on */
    for (int64_t b = per % 2 == 0 ? nb : 0; b < nb; b += 2) {
        const int full = b + 1 < nb;
        const __m512i w = pair_u8(q, b, bits, full);
        const float s0 = s[g];
        if (--left == 0) g++, left = per;
        const float s1 = full ? s[g] : 0.0f;
        if (full && --left == 0) g++, left = per;
        /* the lanes of the pair's second block: 8-15, or 4-7 and 12-15 in an int4 pair's mixed order */
        const __m512 sv = _mm512_mask_blend_ps(bits == 4 && full ? 0xF0F0 : 0xFF00, _mm512_set1_ps(s0), _mm512_set1_ps(s1));
        for (int m = 0; m < mb; m++) {
            const int8_t *xr = xq + m * K + b * Q8_BLOCK;
            const __m512i xv = full ? _mm512_loadu_si512(xr) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, xr);
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv));
            acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dot, _mm512_loadu_ps(xd + m * Q8_XD(K) + (b / 2) * 16)), sv, acc[m]);
        }
    }
    /* rows4_q8's horizontal sum (sum4_ps, absent rows zero): a row's bits beside other rows are its bits at
     * batch 1, where gemv4_q8 runs it (_mm512_reduce_add_ps adds the lanes in another order) */
    __m512 v[Q8_ROWS];
    for (int m = 0; m < Q8_ROWS; m++)
        v[m] = m < mb ? _mm512_add_ps(acc[m], q8_rest_v(s, o, groups, xsg + m * Q8_XSG(K), bits == 8 ? 128.0f : 0.0f))
                      : _mm512_setzero_ps();
    float sums[Q8_ROWS];
    _mm_storeu_ps(sums, sum4_ps(v[0], v[1], v[2], v[3]));
    for (int m = 0; m < mb; m++) y[m * ldy] = sums[m];
}

/* batch 1: 4 weight rows (row r at q + r * rstride, scales / offsets
 * at s / o + r * groups) against one quantised row of x, sharing its loads and one horizontal
 * sum for the four: y[0..3] */
static inline __attribute__((always_inline)) void rows4_q8(const void *q, const int bits, int64_t rstride,
                                                           const float *s, const float *o, int64_t K, int64_t G,
                                                           int64_t AB, const int8_t *xq, const float *xd,
                                                           const float *xsg, float y[Q8_R]) {
    (void)AB;  /* xd is a vector a pair of blocks here */
    const int64_t per = G / Q8_BLOCK, groups = K / G, pb = bits == 8 ? Q8_BLOCK : Q8_BLOCK / 2;
    const uint8_t *qr = (const uint8_t *)q;
    __m512 acc[Q8_R];
    for (int r = 0; r < Q8_R; r++) acc[r] = _mm512_setzero_ps();
    const int64_t nb = K / Q8_BLOCK;
    for (int64_t b = per % 2 ? 0 : nb; b < nb; b += 2) {  /* groups of an odd count of blocks (32: Q4_0, Q8_0) */
        const int full = b + 1 < nb;
        const int8_t *xr = xq + b * Q8_BLOCK;
        const __m512i xv = full ? _mm512_loadu_si512(xr) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, xr);
        const __m512 dv = _mm512_loadu_ps(xd + (b / 2) * 16);
        const int64_t g0 = b / per, g1 = full ? (b + 1) / per : g0;
        for (int r = 0; r < Q8_R; r++) {
            QPREFETCH(qr + r * rstride + b * pb);
            /* the second block's lanes: 8-15, or 4-7 and 12-15 in an int4 pair's mixed order (pair_u8) */
            const __m512 sv = _mm512_mask_blend_ps(bits == 4 && full ? 0xF0F0 : 0xFF00, _mm512_set1_ps(s[r * groups + g0]),
                                                   _mm512_set1_ps(s[r * groups + g1]));
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), pair_u8(qr + r * rstride, b, bits, full), xv));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dot, dv), sv, acc[r]);
        }
    }
    for (int64_t g = 0; per % 2 == 0 && g < groups; g++) {  /* groups of whole pairs: the weight scale once a group */
        __m512 gacc[Q8_R];
        for (int r = 0; r < Q8_R; r++) gacc[r] = _mm512_setzero_ps();
        for (int64_t b = g * per; b < (g + 1) * per; b += 2) {
            const __m512i xv = _mm512_loadu_si512(xq + b * Q8_BLOCK);
            const __m512 dv = _mm512_loadu_ps(xd + (b / 2) * 16);
            for (int r = 0; r < Q8_R; r++) {
                QPREFETCH(qr + r * rstride + b * pb);
                gacc[r] = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), pair_u8(qr + r * rstride, b, bits, 1), xv)),
                    dv, gacc[r]);
            }
        }
        for (int r = 0; r < Q8_R; r++) acc[r] = _mm512_fmadd_ps(gacc[r], _mm512_set1_ps(s[r * groups + g]), acc[r]);
    }
    for (int r = 0; r < Q8_R; r++)
        acc[r] = _mm512_add_ps(acc[r], q8_rest_v(s + r * groups, o ? o + r * groups : NULL, groups, xsg,
                                                 bits == 8 ? 128.0f : 0.0f));
    _mm_storeu_ps(y, sum4_ps(acc[0], acc[1], acc[2], acc[3]));
}

#else
/* The other paths' integer dot products, a weight block of Q8_BLOCK inputs at a time: q8_block reads
 * (and unpacks) the block once for every row of x; q8_dot adds its products with one row's block of xq
 * to that row's integer sums, which stay integers over an act block (one d and one weight scale: AB
 * divides G), so there is one conversion and one FMA an act block, not one a block. */
#if Q8_PATH == 2
typedef __m512 vq;
typedef __m512i vqi;  /* int32 lanes */
typedef __m512i qblock;  /* the block's weights widened to int16 */
#define VQZERO() _mm512_setzero_ps()
#define VQIZERO() _mm512_setzero_si512()
#define VQFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VQSET1(a) _mm512_set1_ps(a)
#define VQSUM(a) _mm512_reduce_add_ps(a)
static inline qblock q8_block(const void *q, int64_t b, int bits) {
    if (bits == 8) return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)((const int8_t *)q + b * Q8_BLOCK)));
    const __m128i p = _mm_loadu_si128((const __m128i *)((const uint8_t *)q + b * (Q8_BLOCK / 2))), low = _mm_set1_epi8(15);
    return _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(p, 4), low), _mm_and_si128(p, low)));
}
static inline vqi q8_dot(vqi acc, qblock w, int bits, const int8_t *xq) {
    (void)bits;
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)xq))));
}
static inline vq q8_float(vqi acc, int bits) { (void)bits; return _mm512_cvtepi32_ps(acc); }
#elif Q8_PATH == 1
typedef __m256 vq;
typedef __m256i vqi;  /* int8 weights: int32 lanes; int4: int16 lanes (below) */
typedef struct { __m256i u, w; } qblock;  /* u: the unsigned factor of vpmaddubsw; w: int8 weights' signs */
#define VQZERO() _mm256_setzero_ps()
#define VQIZERO() _mm256_setzero_si256()
#define VQFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VQSET1(a) _mm256_set1_ps(a)
#define VQSUM(a) VSUM(a)
/* vpmaddubsw (unsigned bytes times signed bytes, adjacent products summed to int16): 32 products a block in
 * one instruction, no widening. int8 weights: |w| (vpabsb: -128 reads as the unsigned 128) times x carrying
 * w's sign (vpsignb; x is in [-127, 127], so never negated out of range): a pair's sum is at most
 * 2 * 128 * 127 < 2^15, never saturated, and summed into int32 by vpmaddwd by ones. int4: the unsigned
 * nibbles times x directly, a pair at most 2 * 15 * 127 = 3810, so an act block's 8 blocks at most (256
 * inputs) sum in int16 lanes without saturating (30480) and go to int32 once, in q8_float. */
static inline qblock q8_block(const void *q, int64_t b, int bits) {
    qblock r;
    if (bits == 8) {
        r.w = _mm256_loadu_si256((const __m256i *)((const int8_t *)q + b * Q8_BLOCK));
        r.u = _mm256_abs_epi8(r.w);
    } else {
        const __m128i p = _mm_loadu_si128((const __m128i *)((const uint8_t *)q + b * (Q8_BLOCK / 2))), low = _mm_set1_epi8(15);
        r.u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(p, 4), low), _mm_and_si128(p, low));
        r.w = r.u;
    }
    return r;
}
static inline vqi q8_dot(vqi acc, qblock w, int bits, const int8_t *xq) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)xq);
    if (bits == 8)
        return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w.u, _mm256_sign_epi8(x, w.w)), _mm256_set1_epi16(1)));
    return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w.u, x));
}
static inline vq q8_float(vqi acc, int bits) {
    return _mm256_cvtepi32_ps(bits == 8 ? acc : _mm256_madd_epi16(acc, _mm256_set1_epi16(1)));
}
#else
typedef float vq;
typedef int32_t vqi;
typedef const void *qblock;
#define VQZERO() 0.0f
#define VQIZERO() 0
#define VQFMA(a, b, c) ((a) * (b) + (c))
#define VQSET1(a) (a)
#define VQSUM(a) (a)
static inline qblock q8_block(const void *q, int64_t b, int bits) {
    return bits == 8 ? (const void *)((const int8_t *)q + b * Q8_BLOCK) : (const void *)((const uint8_t *)q + b * (Q8_BLOCK / 2));
}
static inline vqi q8_dot(vqi sum, qblock w, int bits, const int8_t *xq) {
    if (bits == 8) {
        const int8_t *p = (const int8_t *)w;
        for (int i = 0; i < Q8_BLOCK; i++) sum += (int32_t)p[i] * xq[i];
    } else {
        const uint8_t *p = (const uint8_t *)w;
        for (int i = 0; i < 16; i++) sum += (int32_t)(p[i] & 15) * xq[i] + (int32_t)(p[i] >> 4) * xq[i + 16];
    }
    return sum;
}
static inline vq q8_float(vqi acc, int bits) { (void)bits; return (float)acc; }
#endif

/* blocks b and b + 1 of a row: w[0], w[1] as q8_block reads them; AVX2 int4 from one 32-byte load, its
 * nibbles masked once for both blocks and the halves swapped into each block's order (6 instructions for
 * the pair, not 10: a batch-1 int4 row is bound by its unpacking, not by memory) */
static inline void q8_block2(const void *q, int64_t b, int bits, qblock w[2]) {
#if Q8_PATH == 1
    if (bits == 4) {
        const __m256i p = _mm256_loadu_si256((const __m256i *)((const uint8_t *)q + b * (Q8_BLOCK / 2)));
        const __m256i low = _mm256_set1_epi8(15), lo = _mm256_and_si256(p, low), hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
        w[0].u = w[0].w = _mm256_permute2x128_si256(lo, hi, 0x20);  /* block b: low nibbles, then high */
        w[1].u = w[1].w = _mm256_permute2x128_si256(lo, hi, 0x31);
        return;
    }
#endif
    w[0] = q8_block(q, b, bits);
    w[1] = q8_block(q, b + 1, bits);
}

/* An act block's sums are exact integers (at most 8 blocks x 32 x 128 x 127 < 2^24: exact as floats too).
 * The mb rows' chains side by side, a block of the weight read once for all of them; each row's sums are
 * in the same order whatever mb is (same bits alone or in a batch). */
static inline __attribute__((always_inline)) void rows_q8(const void *q, int bits, const float *s, const float *o,
                                                          int64_t K, int64_t G, int64_t AB, const int8_t *xq,
                                                          const float *xd, const float *xsg, float *y, int64_t ldy,
                                                          const int mb) {
    const int64_t per = G / Q8_BLOCK, run = AB / Q8_BLOCK;
    vq acc[Q8_ROWS];
    for (int m = 0; m < mb; m++) acc[m] = VQZERO();
    for (int64_t g = 0; g < K / G; g++) {  /* (by group, not a / per: no division an act block) */
        const float sa = s[g];
        for (int64_t a = g * per; a < (g + 1) * per; a += run) {
            vqi isum[Q8_ROWS];
            for (int m = 0; m < mb; m++) isum[m] = VQIZERO();
            for (int64_t b = a; b < a + run; b++) {
                QPREFETCH((const uint8_t *)q + b * (bits == 8 ? Q8_BLOCK : Q8_BLOCK / 2));
                const qblock w = q8_block(q, b, bits);
                for (int m = 0; m < mb; m++) isum[m] = q8_dot(isum[m], w, bits, xq + m * K + b * Q8_BLOCK);
            }
            for (int m = 0; m < mb; m++) acc[m] = VQFMA(q8_float(isum[m], bits), VQSET1(sa * xd[m * Q8_XD(K) + a]), acc[m]);
        }
    }
    for (int m = 0; m < mb; m++) y[m * ldy] = VQSUM(acc[m]) + q8_rest(s, o, K / G, xsg + m * Q8_XSG(K), 0.0f);
}

/* batch 1: Q8_R weight rows (row r at q + r * rstride, its scales / offsets at s / o + r * groups) against
 * one quantised row of x, their chains side by side: each load of x shared by the four and four independent
 * sums in flight (one row's chain alone waits on its own latency). Per row the operations and their order of
 * rows_q8 with one row of x: the same bits. */
static inline __attribute__((always_inline)) void rows4_q8(const void *q, const int bits, int64_t rstride,
                                                           const float *s, const float *o, int64_t K, int64_t G,
                                                           int64_t AB, const int8_t *xq, const float *xd,
                                                           const float *xsg, float y[Q8_R]) {
    const int64_t per = G / Q8_BLOCK, run = AB / Q8_BLOCK, groups = K / G, nb = K / Q8_BLOCK;
    const uint8_t *qr = (const uint8_t *)q;
    vq acc[Q8_R];
    for (int r = 0; r < Q8_R; r++) acc[r] = VQZERO();
    /* act blocks of one block (groups of 32: Q4_0 / Q8_0 files): two act blocks' weights unpacked together */
    for (int64_t b = 0, g = 0, left = per; run == 1 && b < nb; b += 2) {  /* g: block b's group, left: its blocks from b */
        const int64_t g0 = g, two = b + 1 < nb;
        if (--left == 0) g++, left = per;
        const int64_t g1 = g;
        if (two && --left == 0) g++, left = per;
        for (int r = 0; r < Q8_R; r++) {
            QPREFETCH(qr + r * rstride + b * (bits == 8 ? Q8_BLOCK : Q8_BLOCK / 2));
            qblock w[2];
            if (two)
                q8_block2(qr + r * rstride, b, bits, w);
            else
                w[0] = q8_block(qr + r * rstride, b, bits);
            acc[r] = VQFMA(q8_float(q8_dot(VQIZERO(), w[0], bits, xq + b * Q8_BLOCK), bits), VQSET1(s[r * groups + g0] * xd[b]), acc[r]);
            if (two)
                acc[r] = VQFMA(q8_float(q8_dot(VQIZERO(), w[1], bits, xq + (b + 1) * Q8_BLOCK), bits),
                               VQSET1(s[r * groups + g1] * xd[b + 1]), acc[r]);
        }
    }
    for (int64_t g = 0; run > 1 && g < groups; g++)
        for (int64_t a = g * per; a < (g + 1) * per; a += run) {
            vqi isum[Q8_R];
            for (int r = 0; r < Q8_R; r++) isum[r] = VQIZERO();
            int64_t b = a;
            for (; b + 2 <= a + run; b += 2)
                for (int r = 0; r < Q8_R; r++) {
                    QPREFETCH(qr + r * rstride + b * (bits == 8 ? Q8_BLOCK : Q8_BLOCK / 2));
                    qblock w[2];
                    q8_block2(qr + r * rstride, b, bits, w);
                    isum[r] = q8_dot(q8_dot(isum[r], w[0], bits, xq + b * Q8_BLOCK), w[1], bits, xq + (b + 1) * Q8_BLOCK);
                }
            for (int r = 0; r < Q8_R; r++) acc[r] = VQFMA(q8_float(isum[r], bits), VQSET1(s[r * groups + g] * xd[a]), acc[r]);
        }
    for (int r = 0; r < Q8_R; r++) y[r] = VQSUM(acc[r]) + q8_rest(s + r * groups, o ? o + r * groups : NULL, groups, xsg, 0.0f);
}
#endif

/* rows 4i..4i+3 of an [N, K] weight (N >= 4; the last four rows for a short last set, each
 * row's sum the same whichever set computes it) at batch 1 into y[4i..]: per-op and fused
 * layer alike, so both give the same bits */
static inline __attribute__((always_inline)) void gemv4_q8(const void *q, int bits, const float *scales,
                                                           const float *offsets, int64_t N, int64_t K, int64_t G,
                                                           int64_t AB, const int8_t *xq, const float *xd, const float *xsg,
                                                           int64_t i, float *y) {
    const int64_t n0 = i * Q8_R, n = n0 + Q8_R <= N ? n0 : N - Q8_R, groups = K / G, rb = bits == 8 ? K : K / 2;
    const float *s = scales + n * groups, *o = offsets ? offsets + n * groups : NULL;
    float y4[Q8_R];
    if (bits == 8)
        rows4_q8((const uint8_t *)q + n * rb, 8, rb, s, o, K, G, AB, xq, xd, xsg, y4);
    else
        rows4_q8((const uint8_t *)q + n * rb, 4, rb, s, o, K, G, AB, xq, xd, xsg, y4);
    for (int64_t j = n0; j < n0 + Q8_R && j < N; j++) y[j] = y4[j - n];
}
/* batch 1 through gemv4_q8: on VNNI builds, and for int4 weights on the others (whose int8 rows share
 * nothing between rows but x's load: four rows side by side were 0.9x the single rows' speed, 135M's layer
 * linears on the AVX2 EPYC; RESULTS.md, #35 the AVX2 batch-1 rows) */
#define Q8_GEMV4(N, bits) ((N) >= Q8_R && (Q8_PATH == 3 || (bits) == 4))

/* mb and bits as compile-time constants in rows_q8 */
#define Q8_DISPATCH_BITS(BITS, ...)                         \
    switch (mb) {                                           \
        case 1: rows_q8(qn, BITS, __VA_ARGS__, 1); break;   \
        case 2: rows_q8(qn, BITS, __VA_ARGS__, 2); break;   \
        case 3: rows_q8(qn, BITS, __VA_ARGS__, 3); break;   \
        default: rows_q8(qn, BITS, __VA_ARGS__, 4); break;  \
    }

/* weight row n (of int8 / int4 q with scales / offsets [N, K / G]) against M rows of x quantised
 * by quantize_row_q8 (xq [M, K], xd [M, Q8_XD(K)], xsg [M, Q8_XSG(K)]), Q8_ROWS at a time, into
 * y[m * ldy + n]: atomd_qgemm_q8's rows and the int8 MoE experts' (layer_ops.c, moe_q8.h) */
static inline void q8_weight_row(const void *q, int bits, const float *scales, const float *offsets, int64_t K,
                                 int64_t G, int64_t AB, int64_t n, int64_t M, const int8_t *xq, const float *xd,
                                 const float *xsg, float *y, int64_t ldy) {
    const int64_t groups = K / G;
    const uint8_t *qn = (const uint8_t *)q + n * (bits == 8 ? K : K / 2);
    const float *sn = scales + n * groups, *on = offsets ? offsets + n * groups : NULL;
    for (int64_t m0 = 0; m0 < M; m0 += Q8_ROWS) {
        const int mb = M - m0 < Q8_ROWS ? (int)(M - m0) : Q8_ROWS;
        if (bits == 8) {
            Q8_DISPATCH_BITS(8, sn, on, K, G, AB, xq + m0 * K, xd + m0 * Q8_XD(K), xsg + m0 * Q8_XSG(K), y + m0 * ldy + n, ldy)
        } else {
            Q8_DISPATCH_BITS(4, sn, on, K, G, AB, xq + m0 * K, xd + m0 * Q8_XD(K), xsg + m0 * Q8_XSG(K), y + m0 * ldy + n, ldy)
        }
    }
}

/* y [M, ldy] = x [M, ldx] @ w^T with int8 activations, each weight row read once for up to Q8_ROWS rows of x
 * (q8_weight_row): x quantised row by row into the scratch xq [M, K], xd [M, Q8_XD(K)], xsg [M, Q8_XSG(K)];
 * one row through gemv4_q8 where it takes the weight (as the fused batch-1 layer's rows). atomd_qgemm_q8
 * (quant.c) and the fused batch's rows (layer_ops.c atomd_decode_rows_q_f32). */
static inline void qgemm_q8_rows(const float *x, int64_t ldx, int64_t M, const void *q, int bits, const float *scales,
                                 const float *offsets, int64_t N, int64_t K, int64_t G, int64_t AB, float *y,
                                 int64_t ldy, int8_t *xq, float *xd, float *xsg, int num_threads) {
    for (int64_t m = 0; m < M; m++)
        quantize_row_q8(x + m * ldx, K, G, AB, bits, xq + m * K, xd + m * Q8_XD(K), xsg + m * Q8_XSG(K));
    if (M == 1 && Q8_GEMV4(N, bits)) {
        _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (N * K >= 16384)")
        for (int64_t i = 0; i < (N + Q8_R - 1) / Q8_R; i++) gemv4_q8(q, bits, scales, offsets, N, K, G, AB, xq, xd, xsg, i, y);
        return;
    }
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (N * K >= 16384)")
    for (int64_t n = 0; n < N; n++) q8_weight_row(q, bits, scales, offsets, K, G, AB, n, M, xq, xd, xsg, y, ldy);
}

/* One packed weight as the fused decode layer takes it (atomd/model/quant.py's QuantizedWeight);
 * xq non-NULL: int8 activations (above), xq / xd / xsg its scratch for one quantised row */
typedef struct {
    const void *q;
    const float *scales, *offsets;  /* offsets NULL: symmetric */
    int64_t group, bits;  /* bits 16: bf16 weights, QBITS_F16: float16 ones; scales / offsets unused for both */
    int8_t *xq;
    float *xd, *xsg;
    int64_t ablock;  /* int8 activations' act block (the doc above) */
    const uint16_t *panels;  /* a 16-bit weight's panels packed at load (quant.prepack_panels), or NULL; with q
                                NULL (an AVX2 build's quant.keep_strips_only) the only copy of the weight */
} atomd_qweight;

/* Each thread's own quantised row of x for atomd_qgemv_rows (thread-local: an OpenMP team's threads, and
 * those of another Python thread's team, each have theirs), inputs up to Q8_OWN_K: ~70 KiB a thread */
#define Q8_OWN_K 32768
static _Thread_local struct {
    int8_t xq[Q8_OWN_K];
    float xd[Q8_XD(Q8_OWN_K)], xsg[Q8_XSG(Q8_OWN_K)];
} q8_own;

#if QUANT_PATH == 1
/* quant_w16_avx2.h: a 16-bit weight held as its load-time strips only (q NULL), batch 1 */
static void w16_strips_gemv(const float *x, const uint16_t *strips, int f16, const float *bias, float *y, int64_t K,
                            int64_t N);
/* quant_gemm_avx2.h: an int8 / int4 one so held */
static void q8_held_gemv(const float *x, const atomd_qweight *w, const float *bias, float *y, int64_t K, int64_t N);
#endif

/* y[n] = w[n] . x (+ bias[n]) for the N rows of w, K inputs: an orphaned `omp for` (the
 * caller's parallel region shares the rows), as layer_ops.c's float GEMV rows. */
static inline void atomd_qgemv_rows(const float *x, const atomd_qweight *w, const float *bias, float *y, int64_t K,
                                    int64_t N) {
#if QUANT_PATH == 1
    if (w->q == NULL) {  /* an AVX2 build's weight kept as its strips only (quant.keep_strips_only) */
        if (w->bits == 4 || w->bits == 8)
            q8_held_gemv(x, w, bias, y, K, N);
        else
            w16_strips_gemv(x, w->panels, w->bits == QBITS_F16, bias, y, K, N);
        return;
    }
#endif
    const int64_t groups = (K + w->group - 1) / w->group;
    atomd_qweight q8 = *w;  /* its scratch: this thread's own row */
    if (w->xq && K <= Q8_OWN_K) {
        /* every thread quantises x (the same values on each: x is shared or each thread's identical copy) into
         * its own row: no barrier, where one thread quantising had every other wait for it and a barrier (two
         * a linear with the rows' own) */
        q8.xq = q8_own.xq, q8.xd = q8_own.xd, q8.xsg = q8_own.xsg;
        quantize_row_q8(x, K, w->group, w->ablock, (int)w->bits, q8.xq, q8.xd, q8.xsg);
    } else if (w->xq) {
        _Pragma("omp single")  /* its barrier: every thread's rows read the whole quantised x */
        quantize_row_q8(x, K, w->group, w->ablock, (int)w->bits, w->xq, w->xd, w->xsg);
    }
    w = &q8;
    if (w->xq && Q8_GEMV4(N, w->bits)) {
        _Pragma("omp for schedule(static)")
        for (int64_t i = 0; i < (N + Q8_R - 1) / Q8_R; i++) {
            gemv4_q8(w->q, (int)w->bits, w->scales, w->offsets, N, K, w->group, w->ablock, w->xq, w->xd, w->xsg, i, y);
            for (int64_t n = i * Q8_R; bias && n < (i + 1) * Q8_R && n < N; n++) y[n] += bias[n];
        }
        return;
    }
    _Pragma("omp for schedule(static)")
    for (int64_t n = 0; n < N; n++) {
        const float *s = w->scales + n * groups, *o = w->offsets ? w->offsets + n * groups : NULL;
        if (w->xq && w->bits == 8)  /* bits a constant in each call: its branches folded */
            rows_q8((const int8_t *)w->q + n * K, 8, s, o, K, w->group, w->ablock, w->xq, w->xd, w->xsg, y + n, 1, 1);
        else if (w->xq)
            rows_q8((const int8_t *)w->q + n * (K / 2), 4, s, o, K, w->group, w->ablock, w->xq, w->xd, w->xsg, y + n, 1, 1);
        else if (w->bits == 16)
            row_b16(x, K, (const uint16_t *)w->q + n * K, K, y + n, 1, 1);
        else if (w->bits == QBITS_F16)
            row_h16(x, K, (const uint16_t *)w->q + n * K, K, y + n, 1, 1);
        else if (w->bits == 8)
            row_i8(x, K, (const int8_t *)w->q + n * K, s, o, K, w->group, y + n, 1, 1);
        else
            row_i4(x, K, (const uint8_t *)w->q + n * (K / 2), s, o, K, w->group, y + n, 1, 1);
        if (bias) y[n] += bias[n];
    }
}
#endif
