/* The AVX2 half of quant_gemm.h: int8 / int4 weights times int8 activations as a register-blocked GEMM for
 * CPUs without AVX-512 (Zen 3 and older AMD EPYCs, Intel before Skylake-SP), from quant.py's
 * QGEMM_AVX2_GEMM_MIN_M rows of x on.
 *
 * The same numbers as quant.h's int8-activation rows: x quantised by quantize_row_q8 itself (the same int8
 * values, d and xsg), each integer dot q[n, a] . xq[m, a] exact (int8: an act block's, int4: a block's), then
 *   y[m, n] = sum_g sum_{a in g} dot[m, n, a] * (s[n, g] * d[m, a]) + o[n, g] * xsg[m, g];
 * only the order of the float operations differs from the rows (s times d before the dot, not after).
 *
 * Where the rows take one weight row at a time, its lanes along K, and pay a conversion, a scale and a
 * horizontal sum per row of x and weight row, here the lanes are 8 output columns: each thread packs its
 * panel (quant_gemm.h) per strip of QV_NR = 8 columns as [K / 4][8 columns][4 inputs] bytes (int8 weights
 * as stored, int4 values 0..15; an 8 x 8 transpose of 4-byte words a block), the strip's s and o
 * transposed beside it [groups][8]. Then for every QV_MR rows of x every strip of the panel runs the
 * micro-kernel: per 4 inputs one weight load and, a row of x, a broadcast of its 4 bytes (vpbroadcastd)
 * into vpmaddubsw (quant.h's sign trick for int8: |w| times x carrying w's sign, then vpmaddwd by ones
 * into int32 over the act block; int4's nibbles times x directly, summed in int16 over a block of 32 inputs:
 * at most 8 x 2 x 15 x 127 = 30480), the integer sums then converted and scaled into float accumulators
 * (one FMA for 8 columns; exact: |dot| <= 256 x 128 x 127 < 2^24). */
#if Q8_PATH == 1
#include <stdlib.h>
#include <string.h>

#define QV_PATH 1
#define QV_NR 8  /* output columns a strip: one vector */
#define QV_XD_ROW(K, AB) Q8_XD(K)  /* quantize_row_q8's d: one float a block of 32 */
#ifndef QV_PREFETCH_NEXT
#define QV_PREFETCH_NEXT 1  /* quant_gemm.h's qv_panel: the next panel's weights prefetched during this one's strips */
#endif
#ifndef QV_MR
#define QV_MR 4  /* rows of x a micro-kernel: 4 float + 4 integer accumulators, of 16 registers */
#endif

/* one strip of int4 rows r0 .. r0 + 8 (rows from N on zero) into dst, as the int8 path's transposed blocks but
 * from the packed bytes: a block's 16 bytes a row hold inputs i (low nibble) and 16 + i (high), so its 4-byte
 * words are transposed 8 rows x 4 words while still packed (rows r and r + 4 in a register's halves, a 4 x 4
 * transpose in each half), then each word vector gives inputs 4c.. (low nibbles) and 16 + 4c.. (high): half
 * the instructions of unpacking each row first and transposing 8 words (at 16 rows of x the packing cost
 * about what the micro-kernel did) */
static inline void qv_pack4(const void *q, int64_t N, int64_t K, int64_t r0, uint8_t *dst, int held) {
    const __m256i low = _mm256_set1_epi8(15);
    for (int64_t k = 0; k < K; k += Q8_BLOCK) {
        __m256 v[4];
        for (int r = 0; r < 4; r++) {
            __m128i h[2];
            for (int i = 0; i < 2; i++)
                h[i] = r0 + r + 4 * i < N ? _mm_loadu_si128((const __m128i *)((const uint8_t *)q + (r0 + r + 4 * i) * (K / 2) + k / 2))
                                          : _mm_setzero_si128();
            v[r] = _mm256_castsi256_ps(_mm256_set_m128i(h[1], h[0]));
        }
        transpose4_halves_ps(v);
        for (int c = 0; c < 4; c++) {  /* v[c]: word c of rows 0-3 | rows 4-7 */
            const __m256i b = _mm256_castps_si256(v[c]);
            if (held) {  /* load-time strips: the words still two values a byte (QV_STRIP_BYTES) */
                _mm256_storeu_si256((__m256i *)(dst + (k / 8 + c) * QV_NR * 4), b);
                continue;
            }
            _mm256_storeu_si256((__m256i *)(dst + (k / 4 + c) * QV_NR * 4), _mm256_and_si256(b, low));
            _mm256_storeu_si256((__m256i *)(dst + (k / 4 + 4 + c) * QV_NR * 4), _mm256_and_si256(_mm256_srli_epi16(b, 4), low));
        }
    }
}

/* weight rows n0 .. n0 + 8 strips (rows from N on zero) packed as the module doc says: strip j at
 * wp + j * 8 K, its s and o at sc + j * 16 groups ([groups][8] each); `held` (one strip: qv_hold's): int4 two
 * values a byte */
static void qv_pack_strips(const void *q, int bits, const float *scales, const float *offsets, int64_t N, int64_t K,
                           int64_t G, int64_t n0, int64_t strips, uint8_t *wp, float *sc, int held) {
    const int64_t groups = K / G;
    for (int64_t j = 0; j < strips; j++) {
        const int64_t r0 = n0 + j * QV_NR;
        uint8_t *dst = wp + j * QV_NR * K;
        if (bits == 4) {
            qv_pack4(q, N, K, r0, dst, held);
            continue;
        }
        for (int64_t k = 0; k < K; k += Q8_BLOCK) {  /* int8: K is whole blocks of 32 (the act blocks') */
            __m256 v[8];
            for (int r = 0; r < 8; r++)  /* the block's 32 weights as stored (q8_block's w) */
                v[r] = _mm256_castsi256_ps(r0 + r < N ? q8_block((const int8_t *)q + (r0 + r) * K, k / Q8_BLOCK, 8).w
                                                      : _mm256_setzero_si256());
            transpose8_ps(v);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps((float *)(dst + (k / 4 + i) * QV_NR * 4), v[i]);
        }
    }
    for (int64_t j = 0; j < strips; j++)
        for (int64_t g = 0; g < groups; g++)
            for (int c = 0; c < QV_NR; c++) {
                const int64_t n = n0 + j * QV_NR + c;
                sc[(j * 2 * groups + g) * QV_NR + c] = n < N ? scales[n * groups + g] : 0.0f;
                sc[((j * 2 + 1) * groups + g) * QV_NR + c] = n < N && offsets ? offsets[n * groups + g] : 0.0f;
            }
}
static void qv_pack(const void *q, int bits, const float *scales, const float *offsets, int64_t N, int64_t K,
                    int64_t G, int64_t n0, int64_t strips, uint8_t *wp, float *sc) {
    qv_pack_strips(q, bits, scales, offsets, N, K, G, n0, strips, wp, sc, 0);
}

/* x [M, ldx] quantised row by row by quantize_row_q8: xq [M, K], xd [M, Q8_XD(K)], xsg [M, Q8_XSG(K)] */
static void qv_quantize(const float *x, int64_t ldx, int64_t M, int64_t K, int64_t G, int64_t AB, int bits,
                        int8_t *xq, float *xd, float *xsg, int num_threads) {
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (M * K >= 65536)")
    for (int64_t m = 0; m < M; m++)
        quantize_row_q8(x + m * ldx, K, G, AB, bits, xq + m * K, xd + m * Q8_XD(K), xsg + m * Q8_XSG(K));
}

/* mr (a constant after inlining) rows of quantised x (rows K, Q8_XD(K) and Q8_XSG(K) apart) times one packed
 * strip (wp, its s / o at sc) into y[r * ldy + 0 .. cols); bits a constant too */
static inline __attribute__((always_inline)) void qv_kernel(const int mr, const int bits, const int held,
                                                            const uint8_t *wp, const float *sc, const int8_t *xq,
                                                            const float *xd, const float *xsg, int64_t K, int64_t G,
                                                            int64_t AB, float *y, int64_t ldy, int64_t cols) {
    const int64_t groups = K / G, per = G / AB, run = AB / Q8_BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 f[QV_MR];
    for (int r = 0; r < mr; r++) f[r] = _mm256_setzero_ps();
    int64_t g = 0, left = per;
    for (int64_t a = 0; a < K / AB; a++) {
        const __m256 s = _mm256_loadu_ps(sc + g * QV_NR);
        /* integer sums: int8's in int32 over the act block, int4's in int16 over a block (its bound), then each
         * converted and scaled; as few live vectors as that allows (no spills at QV_MR rows) */
        __m256i acc[QV_MR];
        for (int64_t b = a * run; b < (a + 1) * run; b++) {
            const uint8_t *wb = wp + b * Q8_BLOCK * QV_NR / (held && bits == 4 ? 2 : 1);
            const int8_t *xb = xq + b * Q8_BLOCK;
            if (bits == 4 || b == a * run)
                for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_si256();
            if (held && bits == 4) {  /* a word vector c: inputs 4c.. (low nibbles) and 16 + 4c.. (high) */
                const __m256i low = _mm256_set1_epi8(15);
                for (int c = 0; c < Q8_BLOCK / 8; c++) {
                    const __m256i p = _mm256_loadu_si256((const __m256i *)(wb + c * 32));
                    const __m256i lo = _mm256_and_si256(p, low), hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
                    for (int r = 0; r < mr; r++) {
                        int32_t x0, x1;
                        memcpy(&x0, xb + r * K + c * 4, 4);
                        memcpy(&x1, xb + r * K + 16 + c * 4, 4);
                        acc[r] = _mm256_add_epi16(acc[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0)));
                        acc[r] = _mm256_add_epi16(acc[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1)));
                    }
                }
            } else {
                /* two 4-input steps an iteration: unrolled whole, GCC gathers the block's 32 products of 4 rows
                 * before summing them and spills (1.2-1.5x the time) */
                _Pragma("GCC unroll 2")
                for (int c = 0; c < Q8_BLOCK / 4; c++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(wb + c * 32));
                    const __m256i u = bits == 8 ? _mm256_abs_epi8(w) : w;
                    for (int r = 0; r < mr; r++) {
                        int32_t x4;
                        memcpy(&x4, xb + r * K + c * 4, 4);
                        const __m256i xv = _mm256_set1_epi32(x4);
                        if (bits == 8)
                            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(xv, w)), ones));
                        else
                            acc[r] = _mm256_add_epi16(acc[r], _mm256_maddubs_epi16(u, xv));
                    }
                }
            }
            if (bits == 4 || b == (a + 1) * run - 1)
                for (int r = 0; r < mr; r++) {
                    const __m256i i32 = bits == 8 ? acc[r] : _mm256_madd_epi16(acc[r], ones);
                    const __m256 d = _mm256_set1_ps(xd[r * Q8_XD(K) + b]);  /* (the act block's d, every block) */
                    f[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), _mm256_mul_ps(s, d), f[r]);
                }
        }
        if (--left == 0) {  /* the group's last act block: + o x xsg */
            const __m256 o = _mm256_loadu_ps(sc + (groups + g) * QV_NR);
            for (int r = 0; r < mr; r++) f[r] = _mm256_fmadd_ps(o, _mm256_set1_ps(xsg[r * Q8_XSG(K) + g]), f[r]);
            g++, left = per;
        }
    }
    if (cols >= QV_NR) {
        for (int r = 0; r < mr; r++) _mm256_storeu_ps(y + r * ldy, f[r]);
    } else {
        const __m256i mask = lanes_below8(cols);
        for (int r = 0; r < mr; r++) _mm256_maskstore_ps(y + r * ldy, mask, f[r]);
    }
}

/* the micro-kernel for mr rows, mr and bits constants in each instance (quant_gemm.h's qv_panel) */
static inline __attribute__((always_inline)) void qv_strip_of(int mr, int bits, int held, const uint8_t *wp,
                                                              const float *sc, const int8_t *xq, const float *xd,
                                                              const float *xsg, int64_t K, int64_t G, int64_t AB,
                                                              float *y, int64_t ldy, int64_t cols) {
#define QV_CASE(R)                                                            \
    case R:                                                                   \
        if (bits == 8)                                                        \
            qv_kernel(R, 8, 0, wp, sc, xq, xd, xsg, K, G, AB, y, ldy, cols);  \
        else if (held)                                                        \
            qv_kernel(R, 4, 1, wp, sc, xq, xd, xsg, K, G, AB, y, ldy, cols);  \
        else                                                                  \
            qv_kernel(R, 4, 0, wp, sc, xq, xd, xsg, K, G, AB, y, ldy, cols);  \
        break;
    switch (mr) {
        QV_CASE(1) QV_CASE(2) QV_CASE(3)
        default: QV_CASE(QV_MR)
    }
#undef QV_CASE
}
static inline __attribute__((always_inline)) void qv_strip(int mr, int bits, const uint8_t *wp, const float *sc,
                                                           const int8_t *xq, const float *xd, const float *xsg,
                                                           int64_t K, int64_t G, int64_t AB, float *y, int64_t ldy,
                                                           int64_t cols) {
    qv_strip_of(mr, bits, 0, wp, sc, xq, xd, xsg, K, G, AB, y, ldy, cols);
}

/* An int8 / int4 weight held as its load-time strips (quant.keep_strips_only on an AVX2 build: the MoE experts),
 * its only copy: strip j (rows 8j .. 8j + 7, from N on zero) at j * QV_STRIP_BYTES, its weights as qv_pack lays a
 * panel's strip out except that int4 stays two values a byte (qv_pack4's word vectors before they split: a block
 * of 32 inputs is 4 vectors, c holding inputs 4c .. 4c + 3 in its low nibbles, 16 + 4c .. in its high), then its
 * s and o [groups][8] each. Every M, one row too, runs the micro-kernel on them (qv_held): the GEMM's sums, so the
 * GEMM's bits at every M, and no panel packed per call (at the ~2 rows an expert of a batch-16 MoE block the
 * packing was what the products cost; below the GEMM's rows the int8-activation rows took ~4x the ALU work of the
 * micro-kernel's a product: RESULTS.md, #35 the int experts held as strips). */
#define QV_HELD 1
#ifndef QV_HELD_AHEAD
#define QV_HELD_AHEAD 8192  /* bytes of strips a thread prefetches ahead (whole strips, one at least) */
#endif
#ifndef QV_HELD_PANEL
#define QV_HELD_PANEL (256 << 10)  /* bytes of strips against every QV_MR rows of x in turn (quant_gemm.h QV_PANEL) */
#endif
#define QV_STRIP_WBYTES(K, bits) ((int64_t)QV_NR * (K) * (bits) / 8)
#define QV_STRIP_BYTES(K, G, bits) (QV_STRIP_WBYTES(K, bits) + (int64_t)2 * ((K) / (G)) * QV_NR * (int64_t)sizeof(float))

/* the strips of q [N, K] (with its scales / offsets [N, K / G]) into out [(N + 7) / 8][QV_STRIP_BYTES] */
static void qv_hold(const void *q, int bits, const float *scales, const float *offsets, int64_t N, int64_t K,
                    int64_t G, uint8_t *out, int num_threads) {
    const int64_t SB = QV_STRIP_BYTES(K, G, bits), WB = QV_STRIP_WBYTES(K, bits);
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t j = 0; j < (N + QV_NR - 1) / QV_NR; j++)
        qv_pack_strips(q, bits, scales, offsets, N, K, G, j * QV_NR, 1, out + j * SB, (float *)(out + j * SB + WB), 1);
}

/* strips s0 .. s1 of a held weight against M rows of x quantised by qv_quantize into y [M, ldy], as qv_panel runs a
 * panel: QV_HELD_PANEL bytes of strips (L2) at a time against every QV_MR rows of x (L1), the strips prefetched ahead on
 * the first rows' pass */
static inline void qv_held_run(const uint8_t *held, int bits, int64_t N, int64_t K, int64_t G, int64_t AB, int64_t M,
                               int64_t s0, int64_t s1, const int8_t *xq, const float *xd, const float *xsg, float *y,
                               int64_t ldy) {
    const int64_t SB = QV_STRIP_BYTES(K, G, bits), WB = QV_STRIP_WBYTES(K, bits);
    const int64_t ahead = QV_HELD_AHEAD / SB > 1 ? QV_HELD_AHEAD / SB : 1, most = QV_HELD_PANEL / SB > 1 ? QV_HELD_PANEL / SB : 1;
    for (int64_t p0 = s0; p0 < s1; p0 += most) {
        const int64_t p1 = p0 + most < s1 ? p0 + most : s1;
        for (int64_t m0 = 0; m0 < M; m0 += QV_MR) {
            const int mr = M - m0 < QV_MR ? (int)(M - m0) : QV_MR;
            for (int64_t j = p0; j < p1; j++) {
                const uint8_t *st = held + j * SB;
                for (int64_t off = 0; m0 == 0 && j + ahead < s1 && off < SB; off += 64)
                    _mm_prefetch((const char *)st + ahead * SB + off, _MM_HINT_T0);
                qv_strip_of(mr, bits, 1, st, (const float *)(st + WB), xq + m0 * K, xd + m0 * Q8_XD(K),
                            xsg + m0 * Q8_XSG(K), K, G, AB, y + m0 * ldy + j * QV_NR, ldy, N - j * QV_NR);
            }
        }
    }
}

/* y [M, N] = x [M, K] @ w^T on this thread for a held weight (moe_q8.h's experts); scratch xq, xd, xsg of M rows */
static inline void qv_held1(const float *x, int64_t M, const uint8_t *held, int bits, int64_t N, int64_t K, int64_t G,
                            int64_t AB, float *y, int8_t *xq, float *xd, float *xsg) {
    qv_quantize(x, K, M, K, G, AB, bits, xq, xd, xsg, 1);
    qv_held_run(held, bits, N, K, G, AB, M, 0, (N + QV_NR - 1) / QV_NR, xq, xd, xsg, y, N);
}

/* y [M, ldy] = x [M, ldx] @ w^T for a held weight, the strips shared by the threads */
static void qv_held_gemm(const float *x, int64_t ldx, int64_t M, const uint8_t *held, int bits, int64_t N, int64_t K,
                         int64_t G, int64_t AB, float *y, int64_t ldy, int8_t *xq, float *xd, float *xsg,
                         int num_threads) {
    qv_quantize(x, ldx, M, K, G, AB, bits, xq, xd, xsg, num_threads);
    const int64_t strips = (N + QV_NR - 1) / QV_NR;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
        qv_held_run(held, bits, N, K, G, AB, M, t * strips / n, (t + 1) * strips / n, xq, xd, xsg, y, ldy);
    }
}

/* one row x (K <= Q8_OWN_K) through a held weight, the strips shared by the caller's parallel region (an orphaned
 * omp for; x quantised into each thread's own row): quant.h atomd_qgemv_rows' (the fused batch-1 layer's experts) */
static void q8_held_gemv(const float *x, const atomd_qweight *w, const float *bias, float *y, int64_t K, int64_t N) {
    const int bits = (int)w->bits;
    quantize_row_q8(x, K, w->group, w->ablock, bits, q8_own.xq, q8_own.xd, q8_own.xsg);
    const int64_t SB = QV_STRIP_BYTES(K, w->group, bits), WB = QV_STRIP_WBYTES(K, bits);
    const uint8_t *held = (const uint8_t *)w->panels;
    _Pragma("omp for schedule(static)")
    for (int64_t j = 0; j < (N + QV_NR - 1) / QV_NR; j++) {
        const uint8_t *st = held + j * SB;
        qv_strip_of(1, bits, 1, st, (const float *)(st + WB), q8_own.xq, q8_own.xd, q8_own.xsg, K, w->group, w->ablock,
                    y + j * QV_NR, N, N - j * QV_NR);
        for (int64_t n = j * QV_NR; bias && n < (j + 1) * QV_NR && n < N; n++) y[n] += bias[n];
    }
}
#endif
