/* Lane helpers shared by the kernels: AVX-512 horizontal sums and transposes (attention_common.h, mla.c, layer_ops.c,
 * quant_amx.h), and their AVX2 forms (quant.h's AVX2 path, quant_gemm_avx2.h, quant_w16_avx2.h, layer_ops.c,
 * attention_avx2.h). */
#ifndef ATOMD_LANE_SUMS_H
#define ATOMD_LANE_SUMS_H
#if defined(__AVX512F__)
#include <immintrin.h>

/* Lane j of the result: the sum of the 16 lanes of v[j]. A transposing tree, 45 shuffles and
 * adds for 16 sums, where one _mm512_reduce_add_ps a vector costs ~8 in a dependent chain:
 * the decode scores of 16 keys at once. */
static inline __m512 sum_lanes16(const __m512 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)  /* per 128-bit lane: the 4 vectors' sums over that lane */
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++)  /* 128-bit lanes 0+1 and 2+3 of two such */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
/* v[i][j] <- v[j][i]: a 16 x 16 matrix of 32-bit values in 16 vectors transposed in registers
 * (mla.c's tile operands and results: rows <-> the tile layout's columns; moe_q8.h's widened weights;
 * quant_amx.h's tile results into y's rows). */
static inline void transpose16(__m512 v[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        v[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        v[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        v[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        v[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(v[i], v[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(v[i], v[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(v[i + 8], v[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(v[i + 8], v[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        v[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        v[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}
#endif

#if defined(__AVX2__)
#include <immintrin.h>
#include <stdint.h>

/* lanes 0 .. n - 1 of 8 set (a masked load's or store's mask; n <= 0: none, n >= 8: all) */
static inline __m256i lanes_below8(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n < 0 ? 0 : n > 8 ? 8 : (int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
/* 4 vectors of 8 32-bit words, each 128-bit half a 4 x 4 matrix transposed in place: word j of v[i]'s half to
 * word i of v[j]'s (qv_pack4's packed int4 rows; the first two stages of transpose8_ps) */
static inline void transpose4_halves_ps(__m256 v[4]) {
    const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
    const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
    v[0] = _mm256_shuffle_ps(t0, t2, 0x44), v[1] = _mm256_shuffle_ps(t0, t2, 0xEE);
    v[2] = _mm256_shuffle_ps(t1, t3, 0x44), v[3] = _mm256_shuffle_ps(t1, t3, 0xEE);
}
/* Lane j of the result: the sum of the 8 lanes of v[j] (sum_lanes16's tree at 8: the AVX2 decode scores of 8 keys
 * at once, attention_avx2.h) */
static inline __m256 sum_lanes8(const __m256 v[8]) {
    __m256 a[4], b[2];
    for (int i = 0; i < 4; i++)  /* per 128-bit half: [x0+x2, y0+y2, x1+x3, y1+y3] */
        a[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++)  /* per 128-bit half: the 4 vectors' sums over that half */
        b[i] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
}
/* 8 vectors of 8 32-bit words transposed in place (the AVX2 GEMMs' packing: quant_gemm_avx2.h, quant_w16_avx2.h):
 * word j of v[i] to word i of v[j] */
static inline void transpose8_ps(__m256 v[8]) {
    transpose4_halves_ps(v);
    transpose4_halves_ps(v + 4);
    for (int i = 0; i < 4; i++) {
        const __m256 a = v[i], b = v[i + 4];
        v[i] = _mm256_permute2f128_ps(a, b, 0x20);
        v[i + 4] = _mm256_permute2f128_ps(a, b, 0x31);
    }
}
#endif
#endif
