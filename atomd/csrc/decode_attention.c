/* Paged decode attention, float32: one query token per sequence reads its context straight
 * from the block-major paged KV cache (atomd/kv_cache.py).
 *
 * Why a kernel: torch's CPU SDPA and batched matmul ran a decode step's attention at ~6 GB/s
 * of KV read (small per-head GEMMs; with GQA each KV head is read once per query head), a
 * third of a batch-16 decode step, and needed a contiguous copy of every context (the decode
 * workspace). This reads every K and V row once, in place, for all the query heads of its
 * group: ~15-20 GB/s on a cold cache here. Built at first use by atomd/native.py; OpenMP
 * resolves to the libgomp torch already loaded, so it shares torch's thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

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

#if !defined(HEAD_DIM) || !defined(GROUP)
#error "build with -DHEAD_DIM=<head_dim> -DGROUP=<query heads per KV head>"
#endif

/* The next block is at an unpredictable address: ask for its rows while this one computes. */
static inline void prefetch_rows(const float *row, int64_t rows, int64_t row_stride) {
    for (int64_t i = 0; i < rows; i++, row += row_stride)
        for (int d = 0; d < HEAD_DIM; d += 16) __builtin_prefetch(row + d);
}

/* HEAD_DIM and GROUP are fixed at build time (atomd/native.py builds one library per model
 * shape) so the per-row loops unroll and the group's queries and accumulators stay in registers. */

/* q, out: [batch, num_heads, HEAD_DIM] contiguous. kv: the cache's base pointer; the K row of
 * token t of sequence b, KV head h is at
 *   kv + table[b][t / block_size] * block_stride + k_offset + ((t % block_size) * num_kv_heads + h) * HEAD_DIM
 * and its V row v_offset elements further. block_tables: [batch, table_width]. num_threads:
 * torch's intra-op count of the calling thread (OpenMP's own default is per thread). */
void atomd_decode_attention(const float *restrict q, const float *restrict kv,
                            const int64_t *restrict block_tables, const int64_t *restrict context_lens,
                            float *restrict out, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                            int64_t block_size, int64_t table_width, int64_t block_stride, int64_t k_offset,
                            int64_t v_offset, float scale, int num_threads) {
    const int64_t row_stride = num_kv_heads * HEAD_DIM;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < batch * num_kv_heads; item++) {
        const int64_t b = item / num_kv_heads, h = item % num_kv_heads, ctx = context_lens[b];
        const int64_t *table = block_tables + b * table_width;
        const float *qh = q + (b * num_heads + h * GROUP) * HEAD_DIM;  /* the group's query heads */
        float qs[GROUP][HEAD_DIM], m[GROUP], sum[GROUP], acc[GROUP][HEAD_DIM];
        float *scores = malloc(sizeof(float) * GROUP * ctx);  /* [GROUP, ctx] */
        for (int g = 0; g < GROUP; g++) {
            m[g] = -INFINITY;
            sum[g] = 0.0f;
            for (int d = 0; d < HEAD_DIM; d++) {
                qs[g][d] = qh[g * HEAD_DIM + d] * scale;
                acc[g][d] = 0.0f;
            }
        }
        /* scores: each K row is read once for all the query heads of its group */
        for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {  /* block by block: no division per token */
            const float *k = kv + table[t0 / block_size] * block_stride + k_offset + h * HEAD_DIM;
            const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
            if (t0 + block_size < ctx)
                prefetch_rows(kv + table[t0 / block_size + 1] * block_stride + k_offset + h * HEAD_DIM,
                              block_size, row_stride);
            for (int64_t i = 0; i < n; i++, k += row_stride) {
                for (int g = 0; g < GROUP; g++) {
                    float s = 0.0f;
#pragma omp simd reduction(+ : s)
                    for (int d = 0; d < HEAD_DIM; d++) s += qs[g][d] * k[d];
                    scores[g * ctx + t0 + i] = s;
                    m[g] = s > m[g] ? s : m[g];
                }
            }
        }
        for (int g = 0; g < GROUP; g++) {
            float *sg = scores + g * ctx, mg = m[g], total = 0.0f;
#pragma omp simd reduction(+ : total)
            for (int64_t t = 0; t < ctx; t++) {
                sg[t] = exp_nonpositive(sg[t] - mg);
                total += sg[t];
            }
            sum[g] = total;
        }
        /* weighted values: each V row read once, the group's accumulators in registers */
        for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
            const float *v = kv + table[t0 / block_size] * block_stride + k_offset + v_offset + h * HEAD_DIM;
            const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
            if (t0 + block_size < ctx)
                prefetch_rows(kv + table[t0 / block_size + 1] * block_stride + k_offset + v_offset + h * HEAD_DIM,
                              block_size, row_stride);
            for (int64_t i = 0; i < n; i++, v += row_stride)
                for (int g = 0; g < GROUP; g++) {
                    const float p = scores[g * ctx + t0 + i];
#pragma omp simd
                    for (int d = 0; d < HEAD_DIM; d++) acc[g][d] += p * v[d];
                }
        }
        float *o = out + (b * num_heads + h * GROUP) * HEAD_DIM;
        for (int g = 0; g < GROUP; g++)
            for (int d = 0; d < HEAD_DIM; d++) o[g * HEAD_DIM + d] = acc[g][d] / sum[g];
        free(scores);
    }
}
