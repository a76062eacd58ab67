/* Vectorisable float math shared by the kernels (included by attention.c, layer_ops.c, mla.c and quant.c). */
#ifndef ATOMD_FAST_EXP_H
#define ATOMD_FAST_EXP_H

#include <math.h>
#include <stdint.h>

/* exp(x) for x <= 0 (a score minus the row max), vectorisable: 2^n * e^r, |r| <= ln2 / 2,
 * degree-7 Taylor on r (relative error < 1e-7, below float32 rounding of the sum). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;  /* keeps 2^n a normal float; e^-87 is 0 beside the max's 1 */
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;  /* ln 2 in two parts */
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* silu(g) = g * sigmoid(g) through the exp of a non-positive argument only: layer_ops.c's silu_mul and quant.c's
 * gate_up product with silu (quant_w16_avx2.h), the same bits */
static inline float silu(float g) {
    float e = exp_nonpositive(-fabsf(g));
    return (g >= 0.0f ? g : g * e) / (1.0f + e);
}

#ifdef __AVX512F__
#include <immintrin.h>

/* 2^x of 16 lanes x <= 0, lanes outside m 0: 2^n * 2^f, n = round(x), |f| <= 0.5, 2^f by its
 * degree-6 Taylor polynomial (relative error < 1.3e-7, float32's rounding); vscalefps takes
 * any n, underflow included, so no clamp. The hand-vectorised kernels' exp (the score
 * exponent folded into one FMA: e^(s - max) = 2^(s log2(e) - max log2(e))). */
static inline __m512 exp2_nonpositive16(__m512 x, __mmask16 m) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);                  /* ln2^6 / 6! */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));  /* ln2^5 / 5! */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-3f));   /* ln2^4 / 4! */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-2f));   /* ln2^3 / 3! */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265069591007f));     /* ln2^2 / 2! */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471805599453f));     /* ln2 */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(m, p, n);
}
#endif

#endif
