/* The AVX512-VNNI half of quant_gemm.h: int8 / int4 weights times int8 activations as a register-blocked
 * GEMM, for CPUs with VNNI but no AMX-INT8 (AMD EPYC, Intel Xeon before Sapphire Rapids) from quant.py's
 * QGEMM_VNNI_MIN_M rows of x on (batch decode and prefill).
 *
 * The same numbers as quant.h's int8-activation rows: x quantised per act block of AB inputs as
 * quantize_row_q8 does (qv_quantize: the same int8 values, d and xsg), each act block's integer dot product
 * q[n, a] . xq[m, a] an exact int32, then
 *   y[m, n] = sum_g sum_{a in g} dot[m, n, a] * (s[n, g] * d[m, a]) + c[n, g] * xsg[m, g],
 * c = o (0 without offsets) - 128 s for int8 weights (their + 128, as the rows take it back), c = o for
 * int4; only the order of the float operations differs from the rows (d times s before the dot, not after).
 *
 * Where the rows read each weight pair for at most Q8_ROWS rows of x and end every row with horizontal
 * sums, here the lanes are output columns: each thread packs a panel of weight columns (quant_gemm.h) into
 * the VNNI layout, per strip of QV_NR = 32 columns [K / 4][32 columns][4 inputs] as unsigned bytes (int8
 * weights + 128, int4 values 0..15), with the strip's s and c transposed beside it [groups][32]. Then
 * for every QV_MR rows of x (their int8 rows stay in L1) every strip of the panel runs the micro-kernel:
 * QV_MR x 2 int32 accumulators of 16 columns, per 4 inputs two weight loads and one broadcast of 4 bytes
 * of x a row (vpbroadcastd) into 2 QV_MR vpdpbusd (u8 weights x s8 x); per act block the int32 sums
 * converted and scaled into float accumulators (the dot is exact in float: |dot| <= 256 x 255 x 127
 * < 2^24); no horizontal sums. */
#if Q8_PATH == 3
#include <stdlib.h>
#include <string.h>

#include "lane_sums.h"  /* transpose16 */
#define QV_PATH 3
#define QV_NR 32  /* output columns a strip: two vectors */
#ifndef QV_MR
#define QV_MR 6   /* rows of x a micro-kernel: 12 int32 + 12 float accumulators + 2 weight vectors */
#endif

/* one 16 x 16 block of 32-bit words (row r: weight row r's 4-input groups 0..15) stored as its transpose:
 * 4-input group i of the 16 rows at dst + i * QV_NR * 4, words `count` of them */
static inline void qv_store_t(__m512 v[16], uint8_t *dst, int count) {
    transpose16(v);
    for (int i = 0; i < count; i++) _mm512_storeu_ps((float *)(dst + i * QV_NR * 4), v[i]);
}

/* weight rows n0 .. n0 + 32 strips (rows from N on zero) packed as the module doc says: strip j at
 * wp + j * 32 K, its s and c at sc + j * 64 groups ([groups][32] each) */
static void qv_pack(const void *q, int bits, const float *scales, const float *offsets, int64_t N, int64_t K,
                    int64_t G, int64_t n0, int64_t strips, uint8_t *wp, float *sc) {
    const int64_t groups = K / G;
    const __m512i flip = _mm512_set1_epi8((char)0x80), low = _mm512_set1_epi8(15);
    for (int64_t j = 0; j < strips; j++)
        for (int h = 0; h < QV_NR / 16; h++) {
            const int64_t r0 = n0 + j * QV_NR + h * 16;
            uint8_t *dst = wp + j * QV_NR * K + h * 64;
            for (int64_t k = 0; k < K; k += 64) {
                const int full = K - k >= 64;  /* else a last 32 inputs: words 8-15 zero */
                __m512 v[16];
                for (int r = 0; r < 16; r++) {
                    __m512i w = _mm512_setzero_si512();
                    if (r0 + r < N && bits == 8) {
                        const int8_t *p = (const int8_t *)q + (r0 + r) * K + k;
                        w = _mm512_xor_si512(full ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, p), flip);
                    } else if (r0 + r < N) {  /* Q4_0 runs: low nibbles inputs 0-15, high ones 16-31 */
                        const uint8_t *p = (const uint8_t *)q + (r0 + r) * (K / 2) + k / 2;
                        const __m256i b = full ? _mm256_loadu_si256((const __m256i *)p)
                                               : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)p));
                        const __m512i lh = _mm512_inserti64x4(_mm512_castsi256_si512(b), _mm256_srli_epi16(b, 4), 1);
                        w = _mm512_and_si512(_mm512_shuffle_i64x2(lh, lh, _MM_SHUFFLE(3, 1, 2, 0)), low);
                    }
                    v[r] = _mm512_castsi512_ps(w);
                }
                qv_store_t(v, dst + (k / 4) * QV_NR * 4, full ? 16 : 8);
            }
        }
    for (int64_t j = 0; j < strips; j++)
        for (int64_t g = 0; g < groups; g++)
            for (int c = 0; c < QV_NR; c++) {
                const int64_t n = n0 + j * QV_NR + c;
                const float s = n < N ? scales[n * groups + g] : 0.0f, o = n < N && offsets ? offsets[n * groups + g] : 0.0f;
                sc[(j * 2 * groups + g) * QV_NR + c] = s;
                sc[((j * 2 + 1) * groups + g) * QV_NR + c] = bits == 8 ? o - 128.0f * s : o;
            }
}

/* x [M, ldx] quantised as quantize_row_q8 does (the same float operations in the same order, so the same
 * int8 values, d and xsg to the bit; cvtps rounds to nearest even as nearbyintf does), vectorised, in plain
 * input order: xq [M, K], d [M, K / AB] (one float an act block: QV_D(K, AB) a row), xsg [M, Q8_XSG(K)] */
#define QV_D(K, AB) ((K) / (AB))
#define QV_XD_ROW(K, AB) QV_D(K, AB)  /* quant_gemm.h: d's row stride */
static void qv_quantize(const float *x, int64_t ldx, int64_t M, int64_t K, int64_t G, int64_t AB, int bits,
                        int8_t *xq, float *d, float *xsg, int num_threads) {
    const int64_t per = G / AB;
    (void)bits;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (M * K >= 65536)")
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * ldx;
        for (int64_t a = 0; a < K / AB; a++) {
            __m512 mx = _mm512_setzero_ps();
            for (int64_t i = 0; i < AB; i += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(xr + a * AB + i)));
            const float amax = _mm512_reduce_max_ps(mx);
            const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            __m512i isum = _mm512_setzero_si512();
            for (int64_t i = 0; i < AB; i += 16) {
                const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xr + a * AB + i), id));
                _mm_storeu_si128((__m128i *)(xq + m * K + a * AB + i), _mm512_cvtepi32_epi8(v));
                isum = _mm512_add_epi32(isum, v);
            }
            const float da = amax / 127.0f;
            d[m * QV_D(K, AB) + a] = da;
            if (a % per == 0) xsg[m * Q8_XSG(K) + a / per] = 0.0f;
            xsg[m * Q8_XSG(K) + a / per] += da * (float)_mm512_reduce_add_epi32(isum);
        }
    }
}

/* mr (a constant after inlining) rows of quantised x (xq rows K apart, d rows QV_D(K, AB) apart, xsg rows
 * Q8_XSG(K) apart) times one packed strip (wp, its s / c at sc) into y[r * ldy + 0 .. cols) */
static inline __attribute__((always_inline)) void qv_kernel(const int mr, const uint8_t *wp, const float *sc,
                                                            const int8_t *xq, const float *xd, const float *xsg,
                                                            int64_t K, int64_t G, int64_t AB, float *y, int64_t ldy,
                                                            int64_t cols) {
    const int64_t groups = K / G, per = G / AB;
    __m512 f[QV_MR][2];
    for (int r = 0; r < mr; r++) f[r][0] = f[r][1] = _mm512_setzero_ps();
    int64_t g = 0, left = per;
    for (int64_t a = 0; a < K / AB; a++) {
        __m512i acc[QV_MR][2];
        for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
        const uint8_t *wa = wp + a * AB * QV_NR;
        const int8_t *xa = xq + a * AB;
        for (int64_t k = 0; k < AB; k += 4) {
            const __m512i w0 = _mm512_loadu_si512(wa + k * QV_NR), w1 = _mm512_loadu_si512(wa + k * QV_NR + 64);
            for (int r = 0; r < mr; r++) {
                int32_t x4;
                memcpy(&x4, xa + r * K + k, 4);
                const __m512i xb = _mm512_set1_epi32(x4);
                acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], w0, xb);
                acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], w1, xb);
            }
        }
        const float *sg = sc + g * QV_NR;
        const __m512 s0 = _mm512_loadu_ps(sg), s1 = _mm512_loadu_ps(sg + 16);
        for (int r = 0; r < mr; r++) {
            const __m512 d = _mm512_set1_ps(xd[r * QV_D(K, AB) + a]);
            f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][0]), _mm512_mul_ps(s0, d), f[r][0]);
            f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][1]), _mm512_mul_ps(s1, d), f[r][1]);
        }
        if (--left == 0) {  /* the group's last act block: + c x xsg */
            const float *cg = sc + (groups + g) * QV_NR;
            const __m512 c0 = _mm512_loadu_ps(cg), c1 = _mm512_loadu_ps(cg + 16);
            for (int r = 0; r < mr; r++) {
                const __m512 xs = _mm512_set1_ps(xsg[r * Q8_XSG(K) + g]);
                f[r][0] = _mm512_fmadd_ps(c0, xs, f[r][0]);
                f[r][1] = _mm512_fmadd_ps(c1, xs, f[r][1]);
            }
            g++, left = per;
        }
    }
    const __mmask16 k0 = cols >= 16 ? 0xFFFF : (__mmask16)((1u << cols) - 1);
    const __mmask16 k1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (__mmask16)((1u << (cols - 16)) - 1);
    for (int r = 0; r < mr; r++) {
        _mm512_mask_storeu_ps(y + r * ldy, k0, f[r][0]);
        _mm512_mask_storeu_ps(y + r * ldy + 16, k1, f[r][1]);
    }
}

/* the ISA's micro-kernel for mr rows (quant_gemm.h's qv_panel): VNNI needs no bits (the packing's) */
static inline __attribute__((always_inline)) void qv_strip(int mr, int bits, const uint8_t *wp, const float *sc, const int8_t *xq, const float *xd,
                            const float *xsg, int64_t K, int64_t G, int64_t AB, float *y, int64_t ldy, int64_t cols) {
    (void)bits;
    switch (mr) {  /* mr a constant in each instance */
#define QV_CASE(R) \
    case R: qv_kernel(R < QV_MR ? R : QV_MR, wp, sc, xq, xd, xsg, K, G, AB, y, ldy, cols); break;
        QV_CASE(1) QV_CASE(2) QV_CASE(3) QV_CASE(4) QV_CASE(5) QV_CASE(6) QV_CASE(7)
        default: qv_kernel(QV_MR, wp, sc, xq, xd, xsg, K, G, AB, y, ldy, cols); break;
#undef QV_CASE
    }
}
#endif
