/* Part of attention.c's one translation unit (one library per model shape: HEAD_DIM and GROUP
 * are macros there), included by it only. */

/* ---------------------------------------------------------------------------------------------
 * The decode row on AVX2 builds (no AVX-512; HEAD_DIM a multiple of 8), for every cache format:
 * float32, bf16 and (with F16C) float16 and fp8 e4m3 / e5m2, each value widened to float32 in registers.
 *
 * Why its own code: the plain C loops it replaces summed each key's score in one vector
 * accumulator (a chain of HEAD_DIM / 8 dependent FMAs and a horizontal sum per key and head)
 * and kept the group's weighted-value accumulators (GROUP x HEAD_DIM floats: 32 ymm at
 * Qwen3's 2 x 128) in memory, a load and a store per FMA: ~10-15 GB/s of KV read on 2 threads
 * of the AVX2 EPYC, a sixth of a Qwen3-0.6B-shaped int4 token at 192 keys. Here the scores
 * take 8 keys at a time (8 x GROUP independent chains, one transposing tree, sum_lanes8, for
 * the 8 keys' sums) and the weighted values run over a block's keys a chunk of dims at a time,
 * the chunk's accumulators of every head of the group in registers.
 */
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__) && HEAD_DIM % 8 == 0
#define DECODE_AVX2 1
#include <immintrin.h>
#include "lane_sums.h"

#define NV8 (HEAD_DIM / 8) /* 8 floats per ymm */
/* vectors of dims a weighted-value chunk holds per head: the group's accumulators in 8 registers */
#define VCHUNK (GROUP >= 8 ? 1 : 8 / GROUP < NV8 ? 8 / GROUP : NV8)

/* Dims w * 8 .. w * 8 + 7 of a cache row (format `kind`, attention_common.h) as float32: exact for every
 * format (bf16: a 16-bit shift; fp8 through float16 as attention_narrow.h's AVX-512 widening: e5m2 is
 * float16's top byte, e4m3's exponent and mantissa shifted into float16's are the value times 2^-8,
 * S.1111.111 NaN). */
static inline __m256 widen8(const uint8_t *row, int w, int kind) {
    if (kind == KV_F32) return _mm256_loadu_ps((const float *)row + w * 8);
    if (kind == KV_BF16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(row + w * 16))), 16));
#if defined(__F16C__)
    if (kind == KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + w * 16)));
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(row + w * 8)));
    if (kind == KV_E5M2) return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
    const __m128i low7 = _mm_and_si128(b, _mm_set1_epi16(0x7f));
    const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8), _mm_slli_epi16(low7, 7));
    const __m256 x = _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(256.0f));
    const __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(low7, _mm_set1_epi16(0x7f))));
    return _mm256_blendv_ps(x, _mm256_set1_ps(NAN), nan);
#else
    return _mm256_setzero_ps(); /* unreachable: float16 and fp8 take this path only with F16C (DECODE_AVX2_F16C) */
#endif
}
#if defined(__F16C__)
#define DECODE_AVX2_F16C 1
#else
#define DECODE_AVX2_F16C 0
#endif

/* One decode row: the GROUP query heads qs (float32, times the score scale) of KV head h over
 * context keys lo .. ctx - 1 of the paged cache kv (offsets and strides in values of `kind`, as
 * atomd_decode_attention's); the heads' outputs into o. scores: [GROUP, ctx] scratch. */
static inline __attribute__((always_inline)) void decode_row_avx2(
    const float qs[GROUP][HEAD_DIM], const uint8_t *restrict kv, const int kind, const int64_t *restrict table,
    int64_t lo, int64_t ctx, int64_t h, int64_t block_size, int64_t block_stride, int64_t k_offset,
    int64_t v_offset, int64_t row_stride, float *restrict scores, float o[GROUP][HEAD_DIM]) {
    const int64_t bytes = kv_value_bytes(kind), row_bytes = row_stride * bytes;
    __m256 mv[GROUP];
    for (int g = 0; g < GROUP; g++) mv[g] = _mm256_set1_ps(-INFINITY);
    for (int64_t t0 = lo, n; t0 < ctx; t0 += n) {
        const int64_t off = t0 % block_size;
        const uint8_t *k = kv + (table[t0 / block_size] * block_stride + k_offset + off * row_stride + h * HEAD_DIM) * bytes;
        n = ctx - t0 < block_size - off ? ctx - t0 : block_size - off;
        if (t0 - off + block_size < ctx)  /* the next block is at an unpredictable address */
            prefetch_head_rows(kv + (table[t0 / block_size + 1] * block_stride + k_offset + h * HEAD_DIM) * bytes,
                               block_size, row_bytes, bytes);
        prefetch_head_rows(k + v_offset * bytes, n, row_bytes, bytes);  /* this block's V rows, for the second pass */
        for (int64_t i0 = 0; i0 < n; i0 += 8) {
            const int64_t c = n - i0 < 8 ? n - i0 : 8;
            __m256 part[GROUP][8];
            for (int i = 0; i < 8; i++) {
                __m256 a[GROUP];
                for (int g = 0; g < GROUP; g++) a[g] = _mm256_setzero_ps();
                if (i < c) {
                    const uint8_t *kr = k + (i0 + i) * row_bytes;
                    for (int w = 0; w < NV8; w++) {
                        const __m256 x = widen8(kr, w, kind);
                        for (int g = 0; g < GROUP; g++) a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qs[g] + w * 8), x, a[g]);
                    }
                }
                for (int g = 0; g < GROUP; g++) part[g][i] = a[g];
            }
            const __m256i live = lanes_below8(c);
            for (int g = 0; g < GROUP; g++) {
                const __m256 s = sum_lanes8(part[g]);
                _mm256_maskstore_ps(scores + g * ctx + t0 + i0, live, s);
                mv[g] = _mm256_max_ps(mv[g], _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, _mm256_castsi256_ps(live)));
            }
        }
    }
    float sum[GROUP];
    for (int g = 0; g < GROUP; g++) {
        float lanes[8], mg = -INFINITY, total = 0.0f, *sg = scores + g * ctx;
        _mm256_storeu_ps(lanes, mv[g]);
        for (int j = 0; j < 8; j++) mg = lanes[j] > mg ? lanes[j] : mg;
#pragma omp simd reduction(+ : total)
        for (int64_t t = lo; t < ctx; t++) {
            sg[t] = exp_nonpositive(sg[t] - mg);
            total += sg[t];
        }
        sum[g] = total;
        for (int d = 0; d < HEAD_DIM; d++) o[g][d] = 0.0f;
    }
    /* weighted values: per block, a chunk of dims at a time over the block's keys (in L1 after the first chunk) */
    for (int64_t t0 = lo, n; t0 < ctx; t0 += n) {
        const int64_t off = t0 % block_size;
        const uint8_t *v = kv + (table[t0 / block_size] * block_stride + k_offset + v_offset + off * row_stride + h * HEAD_DIM) * bytes;
        n = ctx - t0 < block_size - off ? ctx - t0 : block_size - off;
        for (int w0 = 0; w0 < NV8; w0 += VCHUNK) {
            __m256 acc[GROUP][VCHUNK];
            for (int g = 0; g < GROUP; g++)
                for (int u = 0; u < VCHUNK; u++) acc[g][u] = w0 + u < NV8 ? _mm256_loadu_ps(o[g] + (w0 + u) * 8) : _mm256_setzero_ps();
            for (int64_t i = 0; i < n; i++) {
                const uint8_t *vr = v + i * row_bytes;
                for (int u = 0; u < VCHUNK; u++)
                    if (w0 + u < NV8) {
                        const __m256 x = widen8(vr, w0 + u, kind);
                        for (int g = 0; g < GROUP; g++)
                            acc[g][u] = _mm256_fmadd_ps(_mm256_broadcast_ss(scores + g * ctx + t0 + i), x, acc[g][u]);
                    }
            }
            for (int g = 0; g < GROUP; g++)
                for (int u = 0; u < VCHUNK; u++)
                    if (w0 + u < NV8) _mm256_storeu_ps(o[g] + (w0 + u) * 8, acc[g][u]);
        }
    }
    for (int g = 0; g < GROUP; g++) {
        const __m256 total = _mm256_set1_ps(sum[g]);
        for (int w = 0; w < NV8; w++) _mm256_storeu_ps(o[g] + w * 8, _mm256_div_ps(_mm256_loadu_ps(o[g] + w * 8), total));
    }
}
#else
#define DECODE_AVX2 0
#define DECODE_AVX2_F16C 0
#endif
