/* Part of attention.c's one translation unit (one library per model shape: HEAD_DIM and GROUP
 * are macros there), included by it only. */

/* ---------------------------------------------------------------------------------------------
 * bfloat16: the same two kernels over bf16 q, k, v and a bf16 paged KV cache, writing bf16
 * output, with every sum (scores, softmax, weighted values) in float32. The cache is read as
 * it is stored: no conversion of the cache outside the kernels.
 *
 * Paths, chosen at build time from what the compiler targets (-march=native: this CPU):
 * - BF16_DOT (AVX512_BF16 + AVX512BW): q.k with _mm512_dpbf16_ps (pairs of bf16 products
 *   summed into float32 lanes; the products are exact in float32). Decode: a K row against
 *   each query head of its group; prefill: keys transposed once into pairs of dims
 *   [d / 2][token][2], so one dpbf16 adds two dims for 16 keys.
 * - otherwise (AVX-512F, AVX2, or plain C; also when built with -DATOMD_NO_BF16_DOT): every
 *   bf16 is widened to float32 by a 16-bit shift (exact) and the float32 code runs, which the
 *   compiler vectorises for whatever the target has; decode runs the float32 decode row of
 *   attention_avx2.h (AVX2 builds) or attention_narrow.h (the others), which widen in registers.
 * Weights times V are float32 FMAs on widened V rows on both paths (a weight rounded to bf16
 * would cost 3 significant digits); the AMX prefill keeps them as two bf16 terms instead.
 */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && !defined(ATOMD_NO_BF16_DOT) && HEAD_DIM % 2 == 0
#define BF16_DOT 1
#include <immintrin.h>
#else
#define BF16_DOT 0
#endif

/* Which bf16 path this build runs: 2 AVX512_BF16 dot products, 1 widening on AVX-512F,
 * 0 widening on whatever else the target has. */
int atomd_bf16_path(void) {
#if BF16_DOT
    return 2;
#elif defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

#include "bf16_convert.h"

static inline void widen_row(const uint16_t *restrict src, float *restrict dst) {
#pragma omp simd
    for (int d = 0; d < HEAD_DIM; d++) dst[d] = bf16_to_f32(src[d]);
}

/* The K rows of KV head h from token t0 to the end of its block of a context of ctx tokens,
 * *n of them (the first block of a window and the last block may be partial); asks for the next
 * block's K rows (an unpredictable address) and these V rows (the weighted-value pass) meanwhile. */
static inline const uint16_t *k_block_bf16(const uint16_t *kv, const int64_t *table, int64_t t0, int64_t ctx,
                                           int64_t h, int64_t block_size, int64_t block_stride, int64_t k_offset,
                                           int64_t v_offset, int64_t row_stride, int64_t *n) {
    const int64_t off = t0 % block_size;
    const uint16_t *k = kv + table[t0 / block_size] * block_stride + k_offset + off * row_stride + h * HEAD_DIM;
    *n = ctx - t0 < block_size - off ? ctx - t0 : block_size - off;
    if (t0 - off + block_size < ctx)
        prefetch_head_rows((const uint8_t *)(kv + table[t0 / block_size + 1] * block_stride + k_offset + h * HEAD_DIM),
                           block_size, row_stride * 2, 2);
    prefetch_head_rows((const uint8_t *)(k + v_offset), *n, row_stride * 2, 2);
    return k;
}

#if BF16_DOT
#define NV ((HEAD_DIM + 31) / 32) /* 32 bf16 per zmm */
static inline __mmask32 lanes(int v) {  /* the dims of vector v that exist: the tail is masked */
    const int rem = HEAD_DIM - v * 32;
    return rem >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << rem) - 1u);
}
static inline __m512bh load_bf16(const uint16_t *p, int v) {
    return (__m512bh)_mm512_maskz_loadu_epi16(lanes(v), p + v * 32);  /* masked lanes never fault */
}

/* 16 dims of a bf16 row, widened to float32 (exact) */
static inline __m512 widen16(const uint16_t *p, int w) {
    const __m256i h = _mm256_maskz_loadu_epi16(lanes16(w), p + w * 16);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#endif

#if BF16_DOT
/* One decode row (GROUP query heads qh of KV head h) over its first ctx cached tokens, into o.
 * Scores 16 keys at a time: each K row is read once for the group (dpbf16 into float32
 * lanes), the 16 keys' lane sums made by one transposing tree (sum_lanes16). Weighted values:
 * each V row widened once, the group's accumulators in registers. scores: [GROUP, ctx]. */
static inline void decode_row_bf16(const uint16_t *restrict qh, const uint16_t *restrict kv,
                                   const int64_t *restrict table, int64_t lo, int64_t ctx, int64_t h, int64_t block_size,
                                   int64_t block_stride, int64_t k_offset, int64_t v_offset, int64_t row_stride,
                                   float scale, float *restrict scores, uint16_t *restrict o) {
    __m512bh qv[GROUP][NV];
    __m512 mv[GROUP];
    for (int g = 0; g < GROUP; g++) {
        for (int v = 0; v < NV; v++) qv[g][v] = load_bf16(qh + g * HEAD_DIM, v);
        mv[g] = _mm512_set1_ps(-INFINITY);
    }
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t t0 = lo, n; t0 < ctx; t0 += n) {
        const uint16_t *k = k_block_bf16(kv, table, t0, ctx, h, block_size, block_stride, k_offset, v_offset,
                                         row_stride, &n);
        for (int64_t i0 = 0; i0 < n; i0 += 16) {
            const int64_t c = n - i0 < 16 ? n - i0 : 16;
            const __mmask16 live = first_lanes16(c);
            __m512 part[GROUP][16];
            for (int64_t i = 0; i < 16; i++) {
                if (i < c) {
                    const uint16_t *kr_row = k + (i0 + i) * row_stride;
                    __m512bh kr[NV];
                    for (int v = 0; v < NV; v++) kr[v] = load_bf16(kr_row, v);
                    for (int g = 0; g < GROUP; g++) {
                        __m512 a = _mm512_setzero_ps();
                        for (int v = 0; v < NV; v++) a = _mm512_dpbf16_ps(a, qv[g][v], kr[v]);
                        part[g][i] = a;
                    }
                } else {
                    for (int g = 0; g < GROUP; g++) part[g][i] = _mm512_setzero_ps();
                }
            }
            for (int g = 0; g < GROUP; g++) {
                const __m512 s = _mm512_mul_ps(sum_lanes16(part[g]), vscale);
                _mm512_mask_storeu_ps(scores + g * ctx + t0 + i0, live, s);
                mv[g] = _mm512_mask_max_ps(mv[g], live, mv[g], s);
            }
        }
    }
    float sum[GROUP];
    for (int g = 0; g < GROUP; g++) {
        float *sg = scores + g * ctx, mg = _mm512_reduce_max_ps(mv[g]), total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = lo; t < ctx; t++) {
            sg[t] = exp_nonpositive(sg[t] - mg);
            total += sg[t];
        }
        sum[g] = total;
    }
    __m512 acc[GROUP][NW];
    for (int g = 0; g < GROUP; g++)
        for (int w = 0; w < NW; w++) acc[g][w] = _mm512_setzero_ps();
    for (int64_t t0 = lo, n; t0 < ctx; t0 += n) {
        const int64_t off = t0 % block_size;
        const uint16_t *v = kv + table[t0 / block_size] * block_stride + k_offset + v_offset + off * row_stride + h * HEAD_DIM;
        n = ctx - t0 < block_size - off ? ctx - t0 : block_size - off;
        for (int64_t i = 0; i < n; i++, v += row_stride) {  /* prefetched by the score pass */
            __m512 vr[NW];
            for (int w = 0; w < NW; w++) vr[w] = widen16(v, w);
            for (int g = 0; g < GROUP; g++) {
                const __m512 p = _mm512_set1_ps(scores[g * ctx + t0 + i]);
                for (int w = 0; w < NW; w++) acc[g][w] = _mm512_fmadd_ps(p, vr[w], acc[g][w]);
            }
        }
    }
    for (int g = 0; g < GROUP; g++) {
        const __m512 inv = _mm512_set1_ps(1.0f / sum[g]);
        for (int w = 0; w < NW; w++)
            _mm256_mask_storeu_epi16(o + g * HEAD_DIM + w * 16, lanes16(w),
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][w], inv)));
    }
}
#endif

/* atomd_decode_attention over bf16: the same arguments and layout, q, kv and out bf16. */
int atomd_decode_attention_bf16(const uint16_t *restrict q, const uint16_t *restrict kv,
                                 const int64_t *restrict block_tables, const int64_t *restrict context_lens,
                                 const int64_t *restrict query_starts, uint16_t *restrict out, int64_t batch,
                                 int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int64_t table_width,
                                 int64_t block_stride, int64_t k_offset, int64_t v_offset, float scale,
                                 int64_t window, int num_threads) {
    const int64_t row_stride = num_kv_heads * HEAD_DIM;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < batch * num_kv_heads; item++) {
        const int64_t b = item / num_kv_heads, h = item % num_kv_heads, full_ctx = context_lens[b];
        const int64_t *table = block_tables + b * table_width;
        const int64_t r_begin = query_starts ? query_starts[b] : b, r_end = query_starts ? query_starts[b + 1] : b + 1;
        float *scores = malloc(sizeof(float) * GROUP * (full_ctx > 0 ? full_ctx : 1));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        for (int64_t r = r_begin; r < r_end; r++) {
            const int64_t ctx = full_ctx - (r_end - 1 - r), lo = window_start(ctx, window);
            const uint16_t *qh = q + (r * num_heads + h * GROUP) * HEAD_DIM;
            uint16_t *o = out + (r * num_heads + h * GROUP) * HEAD_DIM;
#if BF16_DOT
            decode_row_bf16(qh, kv, table, lo, ctx, h, block_size, block_stride, k_offset, v_offset, row_stride,
                            scale, scores, o);
#else
            float qs[GROUP][HEAD_DIM], of[GROUP][HEAD_DIM];
            for (int g = 0; g < GROUP; g++)
                for (int d = 0; d < HEAD_DIM; d++) qs[g][d] = bf16_to_f32(qh[g * HEAD_DIM + d]) * scale;
            decode_row(qs, (const uint8_t *)kv, KV_BF16, NULL, table, lo, ctx, h, block_size, block_stride, k_offset,
                       v_offset, row_stride, scores, of);  /* (attention_narrow.h) */
            for (int g = 0; g < GROUP; g++)
                for (int d = 0; d < HEAD_DIM; d++) o[g * HEAD_DIM + d] = f32_to_bf16(of[g][d]);
#endif
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* The transposed keys of the bf16 prefill: with BF16_DOT bf16 pairs of dims, [d / 2][token][2]
 * per KV head (KT_ELEMS: elements per token per dim pair = 2); otherwise widened float32
 * [d][token], exactly the float32 kernel's. */
#if BF16_DOT
typedef uint16_t kt_t;
#else
typedef float kt_t;
#endif

static void prefill_item_bf16(const uint16_t *restrict q, const kt_t *restrict kt, const uint16_t *restrict v,
                              uint16_t *restrict out, int64_t r0, int64_t nrows, int64_t h, int64_t num_heads,
                              int64_t q_stride, int64_t kt_stride, int64_t v_stride, float scale,
                              int64_t window) {
    float acc[GROUP * QT][HEAD_DIM], m[GROUP * QT], l[GROUP * QT];
    float sc[GROUP * QT][KT];
#if BF16_DOT
    uint32_t qp[GROUP * QT][HEAD_DIM / 2];  /* (q[d], q[d + 1]) as one 32-bit lane, unscaled */
#else
    float qs[GROUP * QT][HEAD_DIM];
#endif
    for (int64_t r = 0; r < QT; r++)
        for (int g = 0; g < GROUP; g++) {
            const int64_t row = g * QT + r;
            const uint16_t *src = q + (r0 + r) * q_stride + (h * GROUP + g) * HEAD_DIM;
#if BF16_DOT
            for (int d2 = 0; d2 < HEAD_DIM / 2; d2++)
                qp[row][d2] = r < nrows ? (uint32_t)src[2 * d2] | (uint32_t)src[2 * d2 + 1] << 16 : 0u;
#else
            for (int d = 0; d < HEAD_DIM; d++) qs[row][d] = r < nrows ? bf16_to_f32(src[d]) * scale : 0.0f;
#endif
            for (int d = 0; d < HEAD_DIM; d++) acc[row][d] = 0.0f;
            m[row] = -INFINITY;
            l[row] = 0.0f;
        }
    const int64_t nkeys = r0 + nrows, lo = window_start(r0 + 1, window);  /* row r0's first key */
    for (int64_t j0 = lo / KT * KT; j0 < nkeys; j0 += KT) {
        const int64_t nk = nkeys - j0 < KT ? nkeys - j0 : KT;
        for (int64_t b0 = 0; b0 < GROUP * QT; b0 += RB) {
            float sb[RB][KT];
#if BF16_DOT
            __m512 sv[RB][KT / 16];
            for (int rb = 0; rb < RB; rb++)
                for (int c = 0; c < KT / 16; c++) sv[rb][c] = _mm512_setzero_ps();
            for (int d2 = 0; d2 < HEAD_DIM / 2; d2++) {
                const kt_t *kd = kt + (d2 * kt_stride + j0) * 2;  /* 16 keys x 2 dims per vector */
                __m512bh kc[KT / 16];
                for (int c = 0; c < KT / 16; c++) kc[c] = (__m512bh)_mm512_loadu_si512(kd + 32 * c);
                for (int rb = 0; rb < RB; rb++) {
                    const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)qp[b0 + rb][d2]);
                    for (int c = 0; c < KT / 16; c++) sv[rb][c] = _mm512_dpbf16_ps(sv[rb][c], qb, kc[c]);
                }
            }
            const __m512 sc16 = _mm512_set1_ps(scale);
            for (int rb = 0; rb < RB; rb++)
                for (int c = 0; c < KT / 16; c++) _mm512_storeu_ps(sb[rb] + 16 * c, _mm512_mul_ps(sv[rb][c], sc16));
#else
            for (int rb = 0; rb < RB; rb++)
                for (int j = 0; j < KT; j++) sb[rb][j] = 0.0f;
            for (int d = 0; d < HEAD_DIM; d++) {
                const kt_t *kd = kt + d * kt_stride + j0;
                for (int rb = 0; rb < RB; rb++) {
                    const float qd = qs[b0 + rb][d];
#pragma omp simd
                    for (int j = 0; j < KT; j++) sb[rb][j] += qd * kd[j];
                }
            }
#endif
            for (int rb = 0; rb < RB; rb++) {
                const int64_t row = b0 + rb, pos = r0 + row % QT;
                float *srow = sb[rb], mx = m[row], sum = 0.0f;
                for (int j = 0; j < KT; j++) {
                    if (j >= nk || j0 + j > pos || j0 + j < window_start(pos + 1, window)) srow[j] = -INFINITY;
                    mx = srow[j] > mx ? srow[j] : mx;
                }
                const float alpha = mx == -INFINITY ? 1.0f : exp_nonpositive(m[row] - mx);
#pragma omp simd reduction(+ : sum)
                for (int j = 0; j < KT; j++) {
                    const float p = srow[j] == -INFINITY ? 0.0f : exp_nonpositive(srow[j] - mx);
                    sc[row][j] = p;
                    sum += p;
                }
                l[row] = l[row] * alpha + sum;
                m[row] = mx;
#pragma omp simd
                for (int d = 0; d < HEAD_DIM; d++) acc[row][d] *= alpha;
            }
        }
        for (int64_t b0 = 0; b0 < GROUP * QT; b0 += RB) {
            float ab[RB][HEAD_DIM];
            for (int rb = 0; rb < RB; rb++)
                for (int d = 0; d < HEAD_DIM; d++) ab[rb][d] = acc[b0 + rb][d];
            for (int64_t j = 0; j < nk; j++) {
                float vf[HEAD_DIM];
                widen_row(v + (j0 + j) * v_stride + h * HEAD_DIM, vf);
                for (int rb = 0; rb < RB; rb++) {
                    const float p = sc[b0 + rb][j];
#pragma omp simd
                    for (int d = 0; d < HEAD_DIM; d++) ab[rb][d] += p * vf[d];
                }
            }
            for (int rb = 0; rb < RB; rb++)
                for (int d = 0; d < HEAD_DIM; d++) acc[b0 + rb][d] = ab[rb][d];
        }
    }
    for (int64_t r = 0; r < nrows; r++)
        for (int g = 0; g < GROUP; g++) {
            const int64_t row = g * QT + r;
            uint16_t *dst = out + (r0 + r) * num_heads * HEAD_DIM + (h * GROUP + g) * HEAD_DIM;
            const float inv = 1.0f / l[row];
            for (int d = 0; d < HEAD_DIM; d++) dst[d] = f32_to_bf16(acc[row][d] * inv);
        }
}
