/* Part of attention.c's one translation unit (one library per model shape: HEAD_DIM and GROUP
 * are macros there), included by it only. */
/* Sliding window: a query that sees ctx keys (itself the last) attends to keys lo .. ctx - 1,
 * lo = ctx - window (position p sees p - window < j <= p, as transformers masks); window 0:
 * all of them (a global layer). */
static inline int64_t window_start(int64_t ctx, int64_t window) {
    return window > 0 && ctx > window ? ctx - window : 0;
}

/* The formats a decode row reads its cache in (a constant at each call, so each is its own code):
 * the model's float32 or bf16, or a narrow cache under a float32 model (attention_narrow.h) */
enum { KV_F32, KV_BF16, KV_E4M3, KV_E5M2, KV_F16 };
static inline int64_t kv_value_bytes(int kind) {
    return kind == KV_F32 ? 4 : kind == KV_BF16 || kind == KV_F16 ? 2 : 1;
}

/* A head's rows of `bytes`-byte values, row_bytes apart: the next block's (at an unpredictable
 * address) or the V rows the weighted-value pass reads after the scores. */
static inline void prefetch_head_rows(const uint8_t *row, int64_t rows, int64_t row_bytes, int64_t bytes) {
    for (int64_t i = 0; i < rows; i++, row += row_bytes)
        for (int64_t d = 0; d < HEAD_DIM * bytes; d += 64) __builtin_prefetch(row + d);
}

/* IEEE float16 bits as float32 (exact): the narrow cache's plain C widening. */
static inline float f16_to_f32(uint16_t h) {
    const float sign = h & 0x8000 ? -1.0f : 1.0f;
    const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 31) return m ? NAN : sign * INFINITY;
    return sign * (e ? ldexpf((float)(m + 1024), e - 25) : ldexpf((float)m, -24));
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
