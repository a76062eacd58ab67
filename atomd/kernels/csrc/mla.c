/* The absorbed decode of multi-head latent attention (DeepSeek V2 / V3, atomd/model/mla.py) in
 * one call per layer, float32 and bfloat16, loaded by atomd/kernels/native.py (mla_kernels).
 *
 * Per query row r and head h, over the sequence's paged latent rows [c ; k_pe] (rank + rope
 * values a token, one row per token and layer, block-major as atomd/engine/kv_cache.py keeps them):
 *   1. the query into latent space: ql = scale * [W_UK[h]^T q_nope ; q_pe]      (uk_t [heads, rank, nope])
 *   2. scores ql . [c ; k_pe] over the context, softmax, o = sum_t p_t c_t     ([rank], float32)
 *   3. out = W_UV[h] o                                                         (uv [heads, v, rank])
 * Why one kernel: torch ran 1 and 3 as two batched matmuls a layer (at batch 1 a matrix-vector
 * product per head through its batched GEMM: a quarter of a deepseek-v2-lite batch-1 step), and
 * the attention kernel between them kept every head of a sequence in one work item (one thread
 * at batch 1) and summed the rope part of the values too, only to drop it. Here 1 and 3 read each
 * head's weights once for a block of RB rows, 2 splits a sequence's heads over the threads, and the
 * query and the weighted latent stay float32 between the phases (torch rounded both to bf16).
 *
 * Shape macros: RANK (kv_lora_rank), ROPE (qk_rope_head_dim), NOPE (qk_nope_head_dim), VDIM
 * (v_head_dim): one library per model shape, so the inner loops have fixed trip counts. Plain C
 * loops the compiler vectorises for whatever the build targets (every $ATOMD_KERNEL_ISA
 * narrowing); bf16 is widened to float32 by a 16-bit shift (exact), every sum is float32.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fast_exp.h"

#if !defined(RANK) || !defined(ROPE) || !defined(NOPE) || !defined(VDIM)
#error "build with -DRANK=<kv_lora_rank> -DROPE=<qk_rope_head_dim> -DNOPE=<qk_nope_head_dim> -DVDIM=<v_head_dim>"
#endif
#define LAT (RANK + ROPE)   /* a latent row: c then k_pe */
#define QDIM (NOPE + ROPE)  /* a query head: q_nope then q_pe (RoPE'd) */
#define RB 8                /* query rows per pass over a head's weights (phases 1 and 3) */
#define HC 16               /* at most this many heads per attention work item (its accumulators) */

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

/* n values at element `at` of src (float32, or bf16 when bf16) as float32: src itself, or widened into buf. */
static inline const float *as_f32(const void *src, int64_t at, int bf16, float *restrict buf, int n) {
    if (!bf16) return (const float *)src + at;
    const uint16_t *s = (const uint16_t *)src + at;
#pragma omp simd
    for (int i = 0; i < n; i++) buf[i] = bf16_to_f32(s[i]);
    return buf;
}

static inline float dot(const float *restrict a, const float *restrict b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Phase 1: ql [rows, heads, LAT] float32, the scaled queries in latent space. Work items: a
 * head and a block of RB rows, so each row of W_UK^T is widened once per block. */
static void absorb_queries(const void *q, const void *uk_t, float *restrict ql, int64_t rows, int64_t heads,
                           float scale, int bf16, int num_threads) {
    const int64_t blocks = (rows + RB - 1) / RB;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t item = 0; item < heads * blocks; item++) {
        const int64_t h = item / blocks, r0 = item % blocks * RB, nr = min64(RB, rows - r0);
        float qn[RB][NOPE], qb[QDIM], wb[NOPE];
        for (int64_t r = 0; r < nr; r++) {
            const float *qr = as_f32(q, ((r0 + r) * heads + h) * QDIM, bf16, qb, QDIM);
            float *dst = ql + ((r0 + r) * heads + h) * LAT;
            memcpy(qn[r], qr, sizeof(float) * NOPE);
            for (int d = 0; d < ROPE; d++) dst[RANK + d] = scale * qr[NOPE + d];
        }
        for (int j = 0; j < RANK; j++) {
            const float *w = as_f32(uk_t, (h * RANK + j) * NOPE, bf16, wb, NOPE);
            for (int64_t r = 0; r < nr; r++) ql[((r0 + r) * heads + h) * LAT + j] = scale * dot(w, qn[r], NOPE);
        }
    }
}

/* Phase 2: ol [rows, heads, RANK] float32, each row's softmax-weighted sum of its context's
 * latents c. Work items: a sequence and a chunk of its heads (hc of them, at most HC), so a
 * batch smaller than the threads still spreads; the chunk's heads share each latent row read. */
static int attend(const float *restrict ql, const void *kv, const int64_t *restrict block_tables,
                  const int64_t *restrict context_lens, const int64_t *restrict query_starts, float *restrict ol,
                  int64_t batch, int64_t heads, int64_t block_size, int64_t table_width, int64_t block_stride,
                  int64_t layer_offset, int bf16, int num_threads) {
    int64_t chunks = (heads + HC - 1) / HC;
    while (chunks < heads && batch * chunks < 2 * num_threads) chunks++;
    const int64_t hc = (heads + chunks - 1) / chunks;
    chunks = (heads + hc - 1) / hc;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < batch * chunks; item++) {
        const int64_t b = item / chunks, h0 = item % chunks * hc, nh = min64(hc, heads - h0);
        const int64_t full_ctx = context_lens[b], *table = block_tables + b * table_width;
        const int64_t r_begin = query_starts ? query_starts[b] : b, r_end = query_starts ? query_starts[b + 1] : b + 1;
        float *scores = malloc(sizeof(float) * HC * (full_ctx > 0 ? full_ctx : 1));  /* [nh, ctx], reused per row */
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        /* one row after the other: the context a later row (a draft) reads again is still in cache */
        for (int64_t r = r_begin; r < r_end; r++) {
            const int64_t ctx = full_ctx - (r_end - 1 - r);
            float m[HC], sum[HC], acc[HC][RANK], cb[LAT];
            for (int g = 0; g < nh; g++) {
                m[g] = -INFINITY;
                sum[g] = 0.0f;
                memset(acc[g], 0, sizeof(float) * RANK);
            }
            for (int64_t t = 0; t < ctx; t++) {
                const float *c = as_f32(kv, table[t / block_size] * block_stride + layer_offset + t % block_size * LAT,
                                        bf16, cb, LAT);
                for (int g = 0; g < nh; g++) {
                    const float s = dot(ql + (r * heads + h0 + g) * LAT, c, LAT);
                    scores[g * ctx + t] = s;
                    m[g] = s > m[g] ? s : m[g];
                }
            }
            for (int g = 0; g < nh; g++) {
                float *sg = scores + g * ctx, mg = m[g], total = 0.0f;
#pragma omp simd reduction(+ : total)
                for (int64_t t = 0; t < ctx; t++) {
                    sg[t] = exp_nonpositive(sg[t] - mg);
                    total += sg[t];
                }
                sum[g] = total;
            }
            for (int64_t t = 0; t < ctx; t++) {  /* the rows again, from cache: only their c part */
                const float *c = as_f32(kv, table[t / block_size] * block_stride + layer_offset + t % block_size * LAT,
                                        bf16, cb, RANK);
                for (int g = 0; g < nh; g++) {
                    const float p = scores[g * ctx + t];
#pragma omp simd
                    for (int d = 0; d < RANK; d++) acc[g][d] += p * c[d];
                }
            }
            for (int g = 0; g < nh; g++) {
                float *o = ol + (r * heads + h0 + g) * RANK;
                const float inv = ctx > 0 ? 1.0f / sum[g] : 0.0f;
                for (int d = 0; d < RANK; d++) o[d] = acc[g][d] * inv;
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* Phase 3: out [rows, heads, VDIM] (float32 or bf16) = W_UV[h] o per row and head; work items
 * as phase 1's. */
static void project_values(const float *restrict ol, const void *uv, void *out, int64_t rows, int64_t heads,
                           int bf16, int num_threads) {
    const int64_t blocks = (rows + RB - 1) / RB;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t item = 0; item < heads * blocks; item++) {
        const int64_t h = item / blocks, r0 = item % blocks * RB, nr = min64(RB, rows - r0);
        float wb[RANK];
        for (int j = 0; j < VDIM; j++) {
            const float *w = as_f32(uv, (h * VDIM + j) * RANK, bf16, wb, RANK);
            for (int64_t r = 0; r < nr; r++) {
                const float o = dot(w, ol + ((r0 + r) * heads + h) * RANK, RANK);
                const int64_t at = ((r0 + r) * heads + h) * VDIM + j;
                if (bf16)
                    ((uint16_t *)out)[at] = f32_to_bf16(o);
                else
                    ((float *)out)[at] = o;
            }
        }
    }
}

/* The whole absorbed decode of one layer. q [rows, heads, NOPE + ROPE] (RoPE'd), uk_t [heads,
 * RANK, NOPE], uv [heads, VDIM, RANK], out [rows, heads, VDIM]: all float32, or all bf16 (bf16
 * != 0), as the cache. kv: the cache's base pointer; token t of sequence b's latent row is at
 *   kv + block_tables[b][t / block_size] * block_stride + layer_offset + (t % block_size) * LAT
 * query_starts: NULL (row b is sequence b's one token, rows == batch), or [batch + 1] row offsets:
 * sequence b owns rows query_starts[b] .. query_starts[b + 1] - 1, the last positions of its
 * context (its last token and its drafts), each seeing the keys up to its own (causal).
 * num_threads: torch's intra-op count of the calling thread.
 * Returns 0, or -1 when a scratch buffer could not be allocated (out is then incomplete). */
int atomd_mla_decode(const void *q, const void *uk_t, const void *uv, const void *kv,
                     const int64_t *block_tables, const int64_t *context_lens, const int64_t *query_starts,
                     void *out, int64_t batch, int64_t rows, int64_t heads, int64_t block_size,
                     int64_t table_width, int64_t block_stride, int64_t layer_offset, float scale, int bf16,
                     int num_threads) {
    float *ql = malloc(sizeof(float) * (rows > 0 ? rows : 1) * heads * LAT);
    float *ol = malloc(sizeof(float) * (rows > 0 ? rows : 1) * heads * RANK);
    int status = -1;
    if (ql != NULL && ol != NULL) {
        absorb_queries(q, uk_t, ql, rows, heads, scale, bf16, num_threads);
        status = attend(ql, kv, block_tables, context_lens, query_starts, ol, batch, heads, block_size, table_width,
                        block_stride, layer_offset, bf16, num_threads);
        if (status == 0) project_values(ol, uv, out, rows, heads, bf16, num_threads);
    }
    free(ql);
    free(ol);
    return status;
}
