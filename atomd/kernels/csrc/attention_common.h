/* Part of attention.c's one translation unit (one library per model shape: HEAD_DIM and GROUP
 * are macros there), included by it only. */
/* Sliding window: a query that sees ctx keys (itself the last) attends to keys lo .. ctx - 1,
 * lo = ctx - window (position p sees p - window < j <= p, as transformers masks); window 0:
 * all of them (a global layer). */
static inline int64_t window_start(int64_t ctx, int64_t window) {
    return window > 0 && ctx > window ? ctx - window : 0;
}

/* The next block is at an unpredictable address: ask for its rows while this one computes. */
static inline void prefetch_rows(const float *row, int64_t rows, int64_t row_stride) {
    for (int64_t i = 0; i < rows; i++, row += row_stride)
        for (int d = 0; d < HEAD_DIM; d += 16) __builtin_prefetch(row + d);
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define NW ((HEAD_DIM + 15) / 16) /* 16 floats per zmm */
static inline __mmask16 first_lanes16(int64_t n) {  /* the first n of 16 lanes (none for n <= 0) */
    return n >= 16 ? (__mmask16)0xffff : n > 0 ? (__mmask16)((1u << n) - 1u) : (__mmask16)0;
}

static inline __mmask16 lanes16(int w) { return first_lanes16(HEAD_DIM - w * 16); }  /* dims of vector w */

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
#endif
