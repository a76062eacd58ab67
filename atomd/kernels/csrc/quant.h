/* The int8 / int4 weight rows of atomd/csrc/quant.c (its comment has the layout), shared with
 * atomd/csrc/layer_ops.c's fused batch-1 decode layer: a vector type per ISA (AVX-512 BW/VL,
 * AVX2 + FMA, scalar), the loads that dequantise in registers, and one weight row against up
 * to QGEMM_ROWS rows of float32 activations. */
#ifndef ATOMD_QUANT_H
#define ATOMD_QUANT_H
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

#define QGEMM_ROWS 8  /* rows of x per pass: 8 accumulators + the weight vector stay in registers */
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
            const vf w = VFMA(load_i8(q + k), vs, vo);
            for (int m = 0; m < mb; m++) acc[m] = VFMA(VLOAD(x + m * ldx + k), w, acc[m]);
        }
        for (; k < g1; k++) {
            const float w = (float)q[k] * sc + of;
            for (int m = 0; m < mb; m++) tail[m] += x[m * ldx + k] * w;
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
            load_i4(q + k / 2, w);
            for (int v = 0; v < I4_VECS; v++) {
                const vf wv = VFMA(w[v], vs, vo);
                for (int m = 0; m < mb; m++) acc[m] = VFMA(VLOAD(x + m * ldx + k + v * LANES), wv, acc[m]);
            }
        }
    }
    for (int m = 0; m < mb; m++) y[m * ldy] = VSUM(acc[m]);
}


/* One packed weight as the fused decode layer takes it (atomd/model/quant.py's QuantizedWeight) */
typedef struct {
    const void *q;
    const float *scales, *offsets;  /* offsets NULL: symmetric */
    int64_t group, bits;
} atomd_qweight;

/* y[n] = w[n] . x (+ bias[n]) for the N rows of w, K inputs: an orphaned `omp for` (the
 * caller's parallel region shares the rows), as layer_ops.c's float GEMV rows. */
static inline void atomd_qgemv_rows(const float *x, const atomd_qweight *w, const float *bias, float *y, int64_t K,
                                    int64_t N) {
    const int64_t groups = (K + w->group - 1) / w->group;
    _Pragma("omp for schedule(static)")
    for (int64_t n = 0; n < N; n++) {
        const float *s = w->scales + n * groups, *o = w->offsets ? w->offsets + n * groups : NULL;
        if (w->bits == 8)
            row_i8(x, K, (const int8_t *)w->q + n * K, s, o, K, w->group, y + n, 1, 1);
        else
            row_i4(x, K, (const uint8_t *)w->q + n * (K / 2), s, o, K, w->group, y + n, 1, 1);
        if (bias) y[n] += bias[n];
    }
}
#endif
