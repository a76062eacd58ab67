/* Part of attention.c's one translation unit (one library per model shape: HEAD_DIM and GROUP
 * are macros there), included by it only. */

/* ---------------------------------------------------------------------------------------------
 * The decode row over a paged KV cache of any format, float32 q and out, every sum in float32:
 * the model's float32 cache (atomd_decode_attention), a bf16 model's cache where the build has
 * no AVX512_BF16 dot products (atomd_decode_attention_bf16), and a cache stored narrower than a
 * float32 model computes: fp8 (--kv-cache-dtype fp8_e4m3 / fp8_e5m2: one byte a value) or 16
 * bits (bfloat16 / float16: two). Each K or V row is widened to float32 once (exact: every fp8,
 * bf16 and float16 value is a float32; float32 rows are read in place) and used for all the
 * query heads of its group. The per-tensor scales are the caller's: k_scale folds into the score
 * scale, v_scale multiplies the output (atomd/kernels/native.py; 1 for the 16-bit caches).
 *
 * Widening: on AVX-512 (F + BW + VL) 16 values at a time, fp8 through float16 (an exact bit move:
 * e5m2 is float16's top byte; e4m3's exponent and mantissa shifted into float16's are the
 * value times 2^-8, subnormals included), then _mm512_cvtph_ps; on AVX2 builds with F16C the
 * same 8 values at a time (attention_avx2.h's decode row); elsewhere fp8 by a 256-entry table,
 * 16 bits by plain C.
 * Prefill needs no narrow kernel: fresh prompts attend to their own rows, which KVCache.write
 * has already rounded to what the cache holds.
 */
#include "bf16_convert.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define NARROW_AVX512 1
#else
#define NARROW_AVX512 0
#endif
#define NARROW_AVX2 (DECODE_AVX2 && DECODE_AVX2_F16C) /* attention_avx2.h's decode row (F16C for float16 and fp8) */

/* One fp8 byte as float32 (E4M3FN: bias 7, no infinity, S.1111.111 NaN; E5M2: bias 15, IEEE). */
static inline float fp8_to_f32(uint8_t b, int e5m2) {
    const float sign = b & 0x80 ? -1.0f : 1.0f;
    const int e = e5m2 ? (b >> 2) & 0x1f : (b >> 3) & 0xf, m = e5m2 ? b & 3 : b & 7;
    const int mbits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
    if (e5m2 && e == 31) return m ? NAN : sign * INFINITY;
    if (!e5m2 && e == 15 && m == 7) return NAN;
    if (e == 0) return sign * ldexpf((float)m, 1 - bias - mbits);
    return sign * ldexpf((float)(m + (1 << mbits)), e - bias - mbits);
}

/* Which widening of a narrow cache this build runs: 1 AVX-512, 2 AVX2 (with F16C), 0 plain C (fp8 by a table). */
int atomd_narrow_path(void) { return NARROW_AVX512 ? 1 : NARROW_AVX2 ? 2 : 0; }

#if NARROW_AVX512
/* Dims w * 16 .. w * 16 + 15 of a narrow row (format `kind`, attention_common.h), widened to float32. */
static inline __m512 widen16_narrow(const uint8_t *p, int w, int kind) {
    if (kind == KV_F32) return _mm512_maskz_loadu_ps(lanes16(w), (const float *)p + w * 16);
    if (kind == KV_BF16 || kind == KV_F16) {
        const __m256i h = _mm256_maskz_loadu_epi16(lanes16(w), p + w * 32);
        return kind == KV_F16 ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    const int e5m2 = kind == KV_E5M2;
    const __m256i b = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(lanes16(w), p + w * 16));
    if (e5m2) return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
    const __m256i low7 = _mm256_and_si256(b, _mm256_set1_epi16(0x7f));
    const __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                         _mm256_slli_epi16(low7, 7));
    const __m512 x = _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.0f));
    return _mm512_mask_mov_ps(x, _mm256_cmpeq_epi16_mask(low7, _mm256_set1_epi16(0x7f)), _mm512_set1_ps(NAN));
}
#endif

/* A narrow row of HEAD_DIM values as float32 into dst (table: fp8's widening without AVX-512). */
static inline void widen_row_narrow(const uint8_t *restrict src, float *restrict dst, const float *restrict table,
                                    int kind) {
#if NARROW_AVX512
    (void)table;
    for (int w = 0; w < NW; w++) _mm512_mask_storeu_ps(dst + w * 16, lanes16(w), widen16_narrow(src, w, kind));
#else
    const uint16_t *half = (const uint16_t *)src;
    for (int d = 0; d < HEAD_DIM; d++)
        dst[d] = kind == KV_F32   ? ((const float *)src)[d]
                 : kind == KV_BF16 ? bf16_to_f32(half[d])
                 : kind == KV_F16  ? f16_to_f32(half[d])
                                   : table[src[d]];
#endif
}

/* One decode row where attention_avx2.h's does not run (decode_row_avx2's arguments; table: fp8's
 * widening without AVX-512): the scores, their softmax, the weighted values. */
static inline __attribute__((always_inline)) void decode_row_narrow(
    const float qs[GROUP][HEAD_DIM], const uint8_t *restrict kv, const int kind, const float *restrict table,
    const int64_t *restrict tbl, int64_t lo, int64_t ctx, int64_t h, int64_t block_size, int64_t block_stride,
    int64_t k_offset, int64_t v_offset, int64_t row_stride, float *restrict scores, float o[GROUP][HEAD_DIM]) {
    const int64_t bytes = kv_value_bytes(kind), row_bytes = row_stride * bytes;
    float m[GROUP], sum[GROUP], acc[GROUP][HEAD_DIM], row[HEAD_DIM];
    for (int g = 0; g < GROUP; g++) {
        m[g] = -INFINITY;
        sum[g] = 0.0f;
        for (int d = 0; d < HEAD_DIM; d++) acc[g][d] = 0.0f;
    }
    /* scores: each K row is read once for all the query heads of its group; block by block from the
     * window's first key (no division per token) */
    for (int64_t t0 = lo, n; t0 < ctx; t0 += n) {
        const int64_t off = t0 % block_size;
        const uint8_t *k = kv + (tbl[t0 / block_size] * block_stride + k_offset + off * row_stride + h * HEAD_DIM) * bytes;
        n = ctx - t0 < block_size - off ? ctx - t0 : block_size - off;
        if (t0 - off + block_size < ctx)
            prefetch_head_rows(kv + (tbl[t0 / block_size + 1] * block_stride + k_offset + h * HEAD_DIM) * bytes,
                               block_size, row_bytes, bytes);
        prefetch_head_rows(k + v_offset * bytes, n, row_bytes, bytes);  /* this block's V rows, for the second pass */
#if NARROW_AVX512
        /* 16 keys at a time, each K row widened once into registers for the group, one transposing
         * tree for the 16 keys' sums */
        for (int64_t i0 = 0; i0 < n; i0 += 16) {
            const int64_t c = n - i0 < 16 ? n - i0 : 16;
            __m512 part[GROUP][16];
            for (int64_t i = 0; i < c; i++) {
                __m512 kr[NW];
                for (int w = 0; w < NW; w++) kr[w] = widen16_narrow(k + (i0 + i) * row_bytes, w, kind);
                for (int g = 0; g < GROUP; g++) {
                    __m512 a = _mm512_setzero_ps();
                    for (int w = 0; w < NW; w++)
                        a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes16(w), qs[g] + w * 16), kr[w], a);
                    part[g][i] = a;
                }
            }
            for (int64_t i = c; i < 16; i++)  /* past the block's last key: lanes the tree sums but nobody reads */
                for (int g = 0; g < GROUP; g++) part[g][i] = _mm512_setzero_ps();
            for (int g = 0; g < GROUP; g++) {
                float sv[16];
                _mm512_storeu_ps(sv, sum_lanes16(part[g]));
                for (int64_t i = 0; i < c; i++) {
                    scores[g * ctx + t0 + i0 + i] = sv[i];
                    m[g] = sv[i] > m[g] ? sv[i] : m[g];
                }
            }
        }
#else
        for (int64_t i = 0; i < n; i++, k += row_bytes) {
            const float *kr = row;
            if (kind == KV_F32) kr = (const float *)k; else widen_row_narrow(k, row, table, kind);
            for (int g = 0; g < GROUP; g++) {
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < HEAD_DIM; d++) s += qs[g][d] * kr[d];
                scores[g * ctx + t0 + i] = s;
                m[g] = s > m[g] ? s : m[g];
            }
        }
#endif
    }
    for (int g = 0; g < GROUP; g++) {
        float *sg = scores + g * ctx, mg = m[g], total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = lo; t < ctx; t++) {
            sg[t] = exp_nonpositive(sg[t] - mg);
            total += sg[t];
        }
        sum[g] = total;
    }
    /* weighted values: each V row widened once (float32 read in place, prefetched by the score pass),
     * the group's accumulators in registers */
    for (int64_t t0 = lo, n; t0 < ctx; t0 += n) {
        const int64_t off = t0 % block_size;
        const uint8_t *v = kv + (tbl[t0 / block_size] * block_stride + k_offset + v_offset + off * row_stride + h * HEAD_DIM) * bytes;
        n = ctx - t0 < block_size - off ? ctx - t0 : block_size - off;
        for (int64_t i = 0; i < n; i++, v += row_bytes) {
            const float *vr = row;
            if (kind == KV_F32) vr = (const float *)v; else widen_row_narrow(v, row, table, kind);
            for (int g = 0; g < GROUP; g++) {
                const float p = scores[g * ctx + t0 + i];
#pragma omp simd
                for (int d = 0; d < HEAD_DIM; d++) acc[g][d] += p * vr[d];
            }
        }
    }
    for (int g = 0; g < GROUP; g++)
        for (int d = 0; d < HEAD_DIM; d++) o[g][d] = acc[g][d] / sum[g];
}

/* One decode row over a cache of `kind`: attention_avx2.h's on AVX2 builds (float16 and fp8 with F16C
 * only), decode_row_narrow's otherwise. */
static inline __attribute__((always_inline)) void decode_row(
    const float qs[GROUP][HEAD_DIM], const uint8_t *restrict kv, const int kind, const float *restrict table,
    const int64_t *restrict tbl, int64_t lo, int64_t ctx, int64_t h, int64_t block_size, int64_t block_stride,
    int64_t k_offset, int64_t v_offset, int64_t row_stride, float *restrict scores, float o[GROUP][HEAD_DIM]) {
#if DECODE_AVX2
    if (DECODE_AVX2_F16C || kind == KV_F32 || kind == KV_BF16) {
        decode_row_avx2(qs, kv, kind, tbl, lo, ctx, h, block_size, block_stride, k_offset, v_offset, row_stride,
                        scores, o);
        return;
    }
#endif
    decode_row_narrow(qs, kv, kind, table, tbl, lo, ctx, h, block_size, block_stride, k_offset, v_offset,
                      row_stride, scores, o);
}

/* atomd_decode_attention's arguments over a cache of `kind` (offsets and strides in its values). */
static inline __attribute__((always_inline)) int decode_attention_narrow(const float *restrict q, const uint8_t *restrict kv,
                                const int64_t *restrict block_tables, const int64_t *restrict context_lens,
                                const int64_t *restrict query_starts, float *restrict out, int64_t batch,
                                int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int64_t table_width,
                                int64_t block_stride, int64_t k_offset, int64_t v_offset, float scale,
                                int64_t window, int num_threads, const int kind) {
    float table[256];  /* fp8's widening where the build widens by a table */
    if (!NARROW_AVX512 && !NARROW_AVX2 && (kind == KV_E4M3 || kind == KV_E5M2))
        for (int b = 0; b < 256; b++) table[b] = fp8_to_f32((uint8_t)b, kind == KV_E5M2);
    const int64_t row_stride = num_kv_heads * HEAD_DIM;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < batch * num_kv_heads; item++) {
        const int64_t b = item / num_kv_heads, h = item % num_kv_heads, full_ctx = context_lens[b];
        const int64_t *tbl = block_tables + b * table_width;
        const int64_t r_begin = query_starts ? query_starts[b] : b, r_end = query_starts ? query_starts[b + 1] : b + 1;
        float *scores = malloc(sizeof(float) * GROUP * (full_ctx > 0 ? full_ctx : 1));  /* [GROUP, ctx], reused per row */
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        /* one row after the other: the context a later row reads again is still in cache */
        for (int64_t r = r_begin; r < r_end; r++) {
            const int64_t ctx = full_ctx - (r_end - 1 - r);
            const float *qh = q + (r * num_heads + h * GROUP) * HEAD_DIM;  /* the group's query heads */
            float qs[GROUP][HEAD_DIM];
            for (int g = 0; g < GROUP; g++)
                for (int d = 0; d < HEAD_DIM; d++) qs[g][d] = qh[g * HEAD_DIM + d] * scale;
            float (*o)[HEAD_DIM] = (float (*)[HEAD_DIM])(out + (r * num_heads + h * GROUP) * HEAD_DIM);
            /* one row body per format, each with its kind a constant: GCC outlines this OpenMP loop
             * before it inlines, so `kind` is a variable in here (a branch per value otherwise) */
#define DECODE_ROW_OF(KIND)                                                                                   \
    case KIND:                                                                                                \
        decode_row(qs, kv, KIND, table, tbl, window_start(ctx, window), ctx, h, block_size, block_stride,     \
                   k_offset, v_offset, row_stride, scores, o);                                                \
        break;
            switch (kind) {
                DECODE_ROW_OF(KV_F32)
                DECODE_ROW_OF(KV_BF16)
                DECODE_ROW_OF(KV_F16)
                DECODE_ROW_OF(KV_E4M3)
                DECODE_ROW_OF(KV_E5M2)
            }
#undef DECODE_ROW_OF
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* The exported entry points, one per format (the format a constant in each) */
#define NARROW_DECODE_ENTRY(FORMAT, KIND)                                                                        \
    int atomd_decode_attention_narrow_##FORMAT(                                                                  \
        const float *restrict q, const uint8_t *restrict kv, const int64_t *restrict block_tables,              \
        const int64_t *restrict context_lens, const int64_t *restrict query_starts, float *restrict out,         \
        int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int64_t table_width,         \
        int64_t block_stride, int64_t k_offset, int64_t v_offset, float scale, int64_t window, int num_threads) { \
        return decode_attention_narrow(q, kv, block_tables, context_lens, query_starts, out, batch, num_heads,    \
                                       num_kv_heads, block_size, table_width, block_stride, k_offset, v_offset,  \
                                       scale, window, num_threads, KIND);                                        \
    }

NARROW_DECODE_ENTRY(e4m3, KV_E4M3)
NARROW_DECODE_ENTRY(e5m2, KV_E5M2)
NARROW_DECODE_ENTRY(bf16, KV_BF16)
NARROW_DECODE_ENTRY(f16, KV_F16)
