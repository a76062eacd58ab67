/* Part of attention.c's one translation unit (one library per model shape: HEAD_DIM and GROUP
 * are macros there), included by it only. */

/* ---------------------------------------------------------------------------------------------
 * The decode kernel over an fp8 paged KV cache (--kv-cache-dtype fp8_e4m3 / fp8_e5m2): one
 * byte a value, float32 q and out, every sum in float32. Each K or V row is widened to float32
 * once (exact: every fp8 value is a float32) and used for all the query heads of its group.
 * The per-tensor scales are the caller's: k_scale folds into the score scale, v_scale
 * multiplies the output (atomd/kernels/native.py).
 *
 * Widening: on AVX-512 (F + BW + VL) 16 values at a time through float16 (an exact bit move:
 * e5m2 is float16's top byte; e4m3's exponent and mantissa shifted into float16's are the
 * value times 2^-8, subnormals included), then _mm512_cvtph_ps; on AVX2 builds with F16C the
 * same 8 values at a time (attention_avx2.h's decode row); elsewhere a 256-entry table.
 * Prefill needs no fp8 kernel: fresh prompts attend to their own rows, which KVCache.write
 * has already rounded to what the cache holds.
 */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FP8_AVX512 1
#else
#define FP8_AVX512 0
#endif
#define FP8_AVX2 (DECODE_AVX2 && DECODE_AVX2_FP8) /* attention_avx2.h's decode row, through float16 (F16C) */

/* One fp8 byte as float32 (E4M3FN: bias 7, no infinity, S.1111.111 NaN; E5M2: bias 15, IEEE). */
static float fp8_to_f32(uint8_t b, int e5m2) {
    const float sign = b & 0x80 ? -1.0f : 1.0f;
    const int e = e5m2 ? (b >> 2) & 0x1f : (b >> 3) & 0xf, m = e5m2 ? b & 3 : b & 7;
    const int mbits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
    if (e5m2 && e == 31) return m ? NAN : sign * INFINITY;
    if (!e5m2 && e == 15 && m == 7) return NAN;
    if (e == 0) return sign * ldexpf((float)m, 1 - bias - mbits);
    return sign * ldexpf((float)(m + (1 << mbits)), e - bias - mbits);
}

/* Which fp8 widening this build runs: 1 AVX-512 through float16, 2 AVX2 through float16, 0 a table. */
int atomd_fp8_path(void) { return FP8_AVX512 ? 1 : FP8_AVX2 ? 2 : 0; }

#if FP8_AVX512
/* Dims w * 16 .. w * 16 + 15 of an fp8 row, widened to float32. */
static inline __m512 widen16_fp8(const uint8_t *p, int w, int e5m2) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(lanes16(w), p + w * 16));
    if (e5m2) return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
    const __m256i low7 = _mm256_and_si256(b, _mm256_set1_epi16(0x7f));
    const __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                         _mm256_slli_epi16(low7, 7));
    const __m512 x = _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.0f));
    return _mm512_mask_mov_ps(x, _mm256_cmpeq_epi16_mask(low7, _mm256_set1_epi16(0x7f)), _mm512_set1_ps(NAN));
}
#endif

/* An fp8 row of HEAD_DIM values as float32 into dst. */
static inline void widen_row_fp8(const uint8_t *restrict src, float *restrict dst, const float *restrict table,
                                 int e5m2) {
#if FP8_AVX512
    (void)table;
    for (int w = 0; w < NW; w++) _mm512_mask_storeu_ps(dst + w * 16, lanes16(w), widen16_fp8(src, w, e5m2));
#else
    (void)e5m2;
    for (int d = 0; d < HEAD_DIM; d++) dst[d] = table[src[d]];
#endif
}

static inline void prefetch_rows_fp8(const uint8_t *row, int64_t rows, int64_t row_stride) {
    for (int64_t i = 0; i < rows; i++, row += row_stride)
        for (int d = 0; d < HEAD_DIM; d += 64) __builtin_prefetch(row + d);
}

/* atomd_decode_attention's arguments over a uint8 cache of fp8 values (offsets and strides in
 * values = bytes), e5m2 selecting the format. */
static int decode_attention_fp8(const float *restrict q, const uint8_t *restrict kv,
                                const int64_t *restrict block_tables, const int64_t *restrict context_lens,
                                const int64_t *restrict query_starts, float *restrict out, int64_t batch,
                                int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int64_t table_width,
                                int64_t block_stride, int64_t k_offset, int64_t v_offset, float scale,
                                int64_t window, int num_threads, const int e5m2) {
#if FP8_AVX512 || FP8_AVX2
    const float *table = NULL;  /* widened in registers */
    (void)table;
#else
    float table[256];
    for (int b = 0; b < 256; b++) table[b] = fp8_to_f32((uint8_t)b, e5m2);
#endif
    const int64_t row_stride = num_kv_heads * HEAD_DIM;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < batch * num_kv_heads; item++) {
        const int64_t b = item / num_kv_heads, h = item % num_kv_heads, full_ctx = context_lens[b];
        const int64_t *tbl = block_tables + b * table_width;
        const int64_t r_begin = query_starts ? query_starts[b] : b, r_end = query_starts ? query_starts[b + 1] : b + 1;
        float *scores = malloc(sizeof(float) * GROUP * (full_ctx > 0 ? full_ctx : 1));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        for (int64_t r = r_begin; r < r_end; r++) {
            const int64_t ctx = full_ctx - (r_end - 1 - r);
            const float *qh = q + (r * num_heads + h * GROUP) * HEAD_DIM;
#if FP8_AVX2
            float qs[GROUP][HEAD_DIM];
            for (int g = 0; g < GROUP; g++)
                for (int d = 0; d < HEAD_DIM; d++) qs[g][d] = qh[g * HEAD_DIM + d] * scale;
            float (*o)[HEAD_DIM] = (float (*)[HEAD_DIM])(out + (r * num_heads + h * GROUP) * HEAD_DIM);
            if (e5m2)
                decode_row_avx2(qs, kv, KV_E5M2, tbl, window_start(ctx, window), ctx, h, block_size, block_stride,
                                k_offset, v_offset, row_stride, scores, o);
            else
                decode_row_avx2(qs, kv, KV_E4M3, tbl, window_start(ctx, window), ctx, h, block_size, block_stride,
                                k_offset, v_offset, row_stride, scores, o);
#else
            float qs[GROUP][HEAD_DIM], m[GROUP], sum[GROUP], acc[GROUP][HEAD_DIM], row[HEAD_DIM];
            for (int g = 0; g < GROUP; g++) {
                m[g] = -INFINITY;
                sum[g] = 0.0f;
                for (int d = 0; d < HEAD_DIM; d++) {
                    qs[g][d] = qh[g * HEAD_DIM + d] * scale;
                    acc[g][d] = 0.0f;
                }
            }
            const int64_t lo = window_start(ctx, window);
            for (int64_t t0 = lo, n; t0 < ctx; t0 += n) {
                const int64_t off = t0 % block_size;
                const uint8_t *k = kv + tbl[t0 / block_size] * block_stride + k_offset + off * row_stride + h * HEAD_DIM;
                n = ctx - t0 < block_size - off ? ctx - t0 : block_size - off;
                if (t0 - off + block_size < ctx)
                    prefetch_rows_fp8(kv + tbl[t0 / block_size + 1] * block_stride + k_offset + h * HEAD_DIM,
                                      block_size, row_stride);
                prefetch_rows_fp8(k + v_offset, n, row_stride);
#if FP8_AVX512
                /* 16 keys at a time, each K row widened once into registers for the group, one
                 * transposing tree for the 16 keys' sums (as the float32 kernel) */
                for (int64_t i0 = 0; i0 < n; i0 += 16) {
                    const int64_t c = n - i0 < 16 ? n - i0 : 16;
                    __m512 part[GROUP][16];
                    for (int64_t i = 0; i < 16; i++) {
                        __m512 kr[NW];
                        for (int w = 0; w < NW; w++)
                            kr[w] = i < c ? widen16_fp8(k + (i0 + i) * row_stride, w, e5m2) : _mm512_setzero_ps();
                        for (int g = 0; g < GROUP; g++) {
                            __m512 a = _mm512_setzero_ps();
                            for (int w = 0; w < NW; w++)
                                a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes16(w), qs[g] + w * 16), kr[w], a);
                            part[g][i] = a;
                        }
                    }
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
                for (int64_t i = 0; i < n; i++, k += row_stride) {
                    widen_row_fp8(k, row, table, e5m2);
                    for (int g = 0; g < GROUP; g++) {
                        float s = 0.0f;
#pragma omp simd reduction(+ : s)
                        for (int d = 0; d < HEAD_DIM; d++) s += qs[g][d] * row[d];
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
            /* weighted values: each V row widened once, the group's accumulators in registers */
            for (int64_t t0 = lo, n; t0 < ctx; t0 += n) {
                const int64_t off = t0 % block_size;
                const uint8_t *v = kv + tbl[t0 / block_size] * block_stride + k_offset + v_offset + off * row_stride + h * HEAD_DIM;
                n = ctx - t0 < block_size - off ? ctx - t0 : block_size - off;
                for (int64_t i = 0; i < n; i++, v += row_stride) {
                    widen_row_fp8(v, row, table, e5m2);
                    for (int g = 0; g < GROUP; g++) {
                        const float p = scores[g * ctx + t0 + i];
#pragma omp simd
                        for (int d = 0; d < HEAD_DIM; d++) acc[g][d] += p * row[d];
                    }
                }
            }
            float *o = out + (r * num_heads + h * GROUP) * HEAD_DIM;
            for (int g = 0; g < GROUP; g++)
                for (int d = 0; d < HEAD_DIM; d++) o[g * HEAD_DIM + d] = acc[g][d] / sum[g];
#endif
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* The exported entry points, one per format (the format a constant in each) */
#define FP8_DECODE_ENTRY(FORMAT, E5M2)                                                                           \
    int atomd_decode_attention_fp8_##FORMAT(                                                                     \
        const float *restrict q, const uint8_t *restrict kv, const int64_t *restrict block_tables,              \
        const int64_t *restrict context_lens, const int64_t *restrict query_starts, float *restrict out,         \
        int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int64_t table_width,         \
        int64_t block_stride, int64_t k_offset, int64_t v_offset, float scale, int64_t window, int num_threads) { \
        return decode_attention_fp8(q, kv, block_tables, context_lens, query_starts, out, batch, num_heads,       \
                                    num_kv_heads, block_size, table_width, block_stride, k_offset, v_offset,     \
                                    scale, window, num_threads, E5M2);                                           \
    }

FP8_DECODE_ENTRY(e4m3, 0)
FP8_DECODE_ENTRY(e5m2, 1)
