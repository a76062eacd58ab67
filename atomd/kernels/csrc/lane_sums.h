/* AVX-512 horizontal sums shared by the kernels (attention_common.h, mla.c, layer_ops.c, quant_amx.h). */
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
#endif
