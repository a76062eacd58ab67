/* bfloat16 <-> float32 for the kernels that store bf16 (attention_bf16.h, mla.c, quant_w16.h). */
#ifndef ATOMD_BF16_CONVERT_H
#define ATOMD_BF16_CONVERT_H
#include <stdint.h>

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t i; float f; } u;
    u.i = (uint32_t)h << 16;
    return u.f;
}

/* Round to nearest even, as torch's float -> bfloat16; a NaN stays a (quiet) NaN. */
static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t i; } u;
    u.f = f;
    if ((u.i & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u.i >> 16) | 0x40);
    return (uint16_t)((u.i + 0x7fffu + ((u.i >> 16) & 1u)) >> 16);
}

#ifdef __AVX512F__
#include <immintrin.h>
/* 16 float32 lanes rounded to bf16: f32_to_bf16's bits, a vector at a time */
static inline __m256i bf16_of16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}
#endif
#endif
