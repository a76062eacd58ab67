/* float32 RMSNorm of one row (rms_norm_row_f32: out = RMSNorm(x) * w, after x += d in place where d is given; d may
 * be out) in one fixed order per ISA, F32_NORM_VEC 1 where there is one: layer_ops.c's per-op norms and fused decode
 * layer, and quant_w16_avx2.h's product with the norm after it, which must give the per-op norm's bits. */
#ifndef ATOMD_NORM_ROW_H
#define ATOMD_NORM_ROW_H
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#define F32_NORM_VEC 1

static inline __mmask16 tail(int64_t left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u); }

/* float32 RMSNorm of one row, 16 lanes at a time in one fixed order: the batch-1 fused layer
 * and the per-op rms_norm must give the same bits, and `omp simd` leaves the sum's order to
 * the compiler at each call site (GCC's tuning for some Intel cores split Qwen3's head-sized
 * q/k norm rows differently in the two). */
static inline void rms_norm_row_f32(float *x, const float *d, const float *w, float *o, int64_t hidden, float eps) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < hidden; i += 16) {
        const __mmask16 m = tail(hidden - i);
        __m512 v = _mm512_maskz_loadu_ps(m, x + i);
        if (d) {
            v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, d + i));
            _mm512_mask_storeu_ps(x + i, m, v);
        }
        acc = _mm512_fmadd_ps(v, v, acc);  /* masked-off lanes loaded as 0 */
    }
    const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)hidden + eps));
    for (int64_t i = 0; i < hidden; i += 16) {
        const __mmask16 m = tail(hidden - i);
        const __m512 n = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), inv);
        _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + i), n));
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
#include "lane_sums.h"  /* lanes_below8 */
#define F32_NORM_VEC 1
/* the same for AVX2 builds (the dense decode layer runs there too): 8 lanes in one fixed order */
static inline void rms_norm_row_f32(float *x, const float *d, const float *w, float *o, int64_t hidden, float eps) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < hidden; i += 8) {
        const __m256i m = lanes_below8(hidden - i);
        __m256 v = _mm256_maskload_ps(x + i, m);
        if (d) {
            v = _mm256_add_ps(v, _mm256_maskload_ps(d + i, m));
            _mm256_maskstore_ps(x + i, m, v);
        }
        acc = _mm256_fmadd_ps(v, v, acc);  /* masked-off lanes loaded as 0 */
    }
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(_mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s))) / (float)hidden + eps));
    for (int64_t i = 0; i < hidden; i += 8) {
        const __m256i m = lanes_below8(hidden - i);
        const __m256 n = _mm256_mul_ps(_mm256_maskload_ps(x + i, m), inv);
        _mm256_maskstore_ps(o + i, m, _mm256_mul_ps(_mm256_maskload_ps(w + i, m), n));
    }
}
#else
#define F32_NORM_VEC 0
#endif
#endif
