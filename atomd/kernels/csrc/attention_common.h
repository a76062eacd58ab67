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
#include "lane_sums.h"
#define NW ((HEAD_DIM + 15) / 16) /* 16 floats per zmm */
static inline __mmask16 first_lanes16(int64_t n) {  /* the first n of 16 lanes (none for n <= 0) */
    return n >= 16 ? (__mmask16)0xffff : n > 0 ? (__mmask16)((1u << n) - 1u) : (__mmask16)0;
}

static inline __mmask16 lanes16(int w) { return first_lanes16(HEAD_DIM - w * 16); }  /* dims of vector w */

#endif
