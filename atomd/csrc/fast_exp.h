/* Vectorisable float math shared by the kernels (included by attention.c and layer_ops.c). */
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

#endif
