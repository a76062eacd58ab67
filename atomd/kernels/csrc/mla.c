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
 * narrowing); bf16 is widened to float32 by a 16-bit shift (exact), every sum is float32. On AMX
 * CPUs bf16 calls of AMX_MIN_ROWS rows or more run all three phases as tile products (MLA_AMX below).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fast_exp.h"

#if !defined(RANK) || !defined(ROPE) || !defined(NOPE) || !defined(VDIM)
#error "build with -DRANK=<kv_lora_rank> -DROPE=<qk_rope_head_dim> -DNOPE=<qk_nope_head_dim> -DVDIM=<v_head_dim>"
#endif
#define LAT (RANK + ROPE)   /* a latent row: c then k_pe */
#define QDIM (NOPE + ROPE)  /* a query head: q_nope then q_pe (RoPE'd) */
#define RB 32               /* query rows per pass over a head's weights (phases 1 and 3) */
#define HC 16               /* at most this many heads per attention work item (its accumulators) */

#include "bf16_convert.h"

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

/* AVX-512 where every dot product runs over whole vectors: 16 dot products at once, their sums
 * by one transposing tree (lane_sums.h) instead of a reduction each. */
#if defined(__AVX512F__) && NOPE % 16 == 0 && ROPE % 16 == 0 && RANK % 16 == 0
#define VEC16 1
#include "lane_sums.h"
#else
#define VEC16 0
#endif

/* out[j] = w[j] . x, j < 16, for the rows w [16][n] (n a multiple of 16 on the AVX-512 path). */
static inline void dots16(const float *restrict w, const float *restrict x, int n, float *restrict out) {
#if VEC16
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    for (int k = 0; k < n; k += 16) {
        const __m512 xv = _mm512_loadu_ps(x + k);
        for (int j = 0; j < 16; j++) acc[j] = _mm512_fmadd_ps(_mm512_loadu_ps(w + j * n + k), xv, acc[j]);
    }
    _mm512_storeu_ps(out, sum_lanes16(acc));
#else
    for (int j = 0; j < 16; j++) out[j] = dot(w + j * n, x, n);
#endif
}

static inline void widen_rows16(const void *w, int64_t j0, int64_t rows, int bf16, float *restrict buf, int n);

/* dots16 of the weights as stored (float32, or bf16 widened in registers), w at element `at`
 * of `src`: for fewer rows than pay for widening a block once (batch 1: each weight read once). */
/* bytes ahead of the weight row being read that dots16_stored prefetches: the rows are short
 * (W_UK^T's NOPE values), and without it one thread waits on every line (~8 GB/s at batch 1) */
#define MLA_PREFETCH 4096
static inline void dots16_stored(const void *src, int64_t at, int bf16, const float *restrict x, int n,
                                 float *restrict out) {
#if VEC16
    __m512 acc[16];
    /* one weight row at a time, two chains: a sequential read the prefetcher follows */
    for (int j = 0; j < 16; j++) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0;
        if (bf16) {
            const uint16_t *w = (const uint16_t *)src + at + j * n;
            for (int k = 0; k < n; k += 32) {  /* n a multiple of 16: the second half may be past it */
                _mm_prefetch((const char *)(w + k) + MLA_PREFETCH, _MM_HINT_T0);
                const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w + k)));
                a0 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(lo, 16)), _mm512_loadu_ps(x + k), a0);
                if (k + 16 < n) {
                    const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w + k + 16)));
                    a1 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)), _mm512_loadu_ps(x + k + 16), a1);
                }
            }
        } else {
            const float *w = (const float *)src + at + j * n;
            for (int k = 0; k < n; k += 32) {
                _mm_prefetch((const char *)(w + k) + MLA_PREFETCH, _MM_HINT_T0);
                _mm_prefetch((const char *)(w + k) + MLA_PREFETCH + 64, _MM_HINT_T0);
                a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), a0);
                if (k + 16 < n) a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + 16), _mm512_loadu_ps(x + k + 16), a1);
            }
        }
        acc[j] = _mm512_add_ps(a0, a1);
    }
    _mm512_storeu_ps(out, sum_lanes16(acc));
#else
    float wb[16 * n > 0 ? 16 * n : 1];
    widen_rows16(src, at / n, at / n + 16, bf16, wb, n);
    dots16(wb, x, n, out);
#endif
}

/* out[4 r + j] = w[j] . x[r], j, r < 4, for the rows w [4][n] and x [4][x_stride]: 4 + 4 loads
 * per 16 products (dots16 takes 17), for blocks of 4 or more query rows. */
static inline void dots4x4(const float *restrict w, const float *restrict x, int64_t x_stride, int n,
                           float *restrict out) {
#if VEC16
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int k = 0; k < n; k += 16) {
        __m512 wv[4];
        for (int j = 0; j < 4; j++) wv[j] = _mm512_loadu_ps(w + j * n + k);
        for (int r = 0; r < 4; r++) {
            const __m512 xv = _mm512_loadu_ps(x + r * x_stride + k);
            for (int j = 0; j < 4; j++) acc[4 * r + j] = _mm512_fmadd_ps(wv[j], xv, acc[4 * r + j]);
        }
    }
    _mm512_storeu_ps(out, sum_lanes16(acc));
#else
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < 4; j++) out[4 * r + j] = dot(w + j * n, x + r * x_stride, n);
#endif
}

/* part[r][j] = w[j] . x[r] for the 16 rows w [16][n] and the nr rows x [nr][x_stride]. */
static inline void dots_block(const float *restrict w, const float *restrict x, int64_t x_stride, int64_t nr, int n,
                              float part[][16]) {
    int64_t r = 0;
    for (; r + 4 <= nr; r += 4)
        for (int jq = 0; jq < 16; jq += 4) {
            float out[16];
            dots4x4(w + jq * n, x + r * x_stride, x_stride, n, out);
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) part[r + i][jq + j] = out[4 * i + j];
        }
    for (; r < nr; r++) dots16(w, x + r * x_stride, n, part[r]);
}

/* rows [j0, j0 + 16) of w [., n] (float32, or bf16 when bf16) as float32 into buf [16][n]; rows
 * past `rows` zero. */
/* bf16 blocks of 4 or more query rows through a head's weights with AVX512_BF16 dot products
 * (pairs of exact bf16 products summed into float32): twice the products an instruction of the
 * widened float32 path, and no widening. The query rows are bf16 already; the weighted latent
 * is rounded to bf16 for it (as torch's path and the attention kernel's bf16 output did). */
#if VEC16 && defined(__AVX512BF16__) && defined(__AVX512BW__) && !defined(ATOMD_NO_BF16_DOT) && NOPE % 32 == 0 && \
    RANK % 32 == 0
#define BF16_DOT 1
/* part[r][jq + j] = w[jq + j] . x[r] for r < nr (a multiple of 4), j < 16: w bf16 [16][n], x bf16 [nr][x_stride]. */
static inline void dots_block_bf16(const uint16_t *restrict w, const uint16_t *restrict x, int64_t x_stride, int64_t nr,
                                   int n, float part[][16]) {
    for (int64_t r = 0; r + 4 <= nr; r += 4)
        for (int jq = 0; jq < 16; jq += 4) {
            __m512 acc[16];
            for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
            for (int k = 0; k < n; k += 32) {
                __m512bh wv[4];
                for (int j = 0; j < 4; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + (jq + j) * n + k);
                for (int i = 0; i < 4; i++) {
                    const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (r + i) * x_stride + k);
                    for (int j = 0; j < 4; j++) acc[4 * i + j] = _mm512_dpbf16_ps(acc[4 * i + j], wv[j], xv);
                }
            }
            float out[16];
            _mm512_storeu_ps(out, sum_lanes16(acc));
            for (int i = 0; i < 4; i++)
                for (int j = 0; j < 4; j++) part[r + i][jq + j] = out[4 * i + j];
        }
}
#else
#define BF16_DOT 0
#endif

static inline void widen_rows16(const void *w, int64_t j0, int64_t rows, int bf16, float *restrict buf, int n) {
    for (int64_t j = 0; j < 16; j++) {
        if (j0 + j < rows) {
            const float *src = as_f32(w, (j0 + j) * n, bf16, buf + j * n, n);
            if (src != buf + j * n) memcpy(buf + j * n, src, sizeof(float) * n);
        } else {
            memset(buf + j * n, 0, sizeof(float) * n);
        }
    }
}

/* Phase 1: ql [rows, heads, LAT] float32, the scaled queries in latent space. Work items: a
 * head and a block of RB rows; W_UK^T's rows widened 16 at a time, once per block. */
static void absorb_queries(const void *q, const void *uk_t, float *restrict ql, int64_t rows, int64_t heads,
                           float scale, int bf16, int num_threads) {
    const int64_t blocks = (rows + RB - 1) / RB;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t item = 0; item < heads * blocks; item++) {
        const int64_t h = item / blocks, r0 = item % blocks * RB, nr = min64(RB, rows - r0);
        float qn[RB][NOPE], qb[QDIM], wb[16 * NOPE], part[RB][16];
        for (int64_t r = 0; r < nr; r++) {
            const float *qr = as_f32(q, ((r0 + r) * heads + h) * QDIM, bf16, qb, QDIM);
            float *dst = ql + ((r0 + r) * heads + h) * LAT;
            memcpy(qn[r], qr, sizeof(float) * NOPE);
            for (int d = 0; d < ROPE; d++) dst[RANK + d] = scale * qr[NOPE + d];
        }
        const int64_t dot_rows = BF16_DOT && bf16 ? nr / 4 * 4 : 0;  /* the rows on AVX512_BF16 dot products */
        for (int64_t j0 = 0; j0 < RANK; j0 += 16) {
#if BF16_DOT
            if (dot_rows > 0)
                dots_block_bf16((const uint16_t *)uk_t + (h * RANK + j0) * NOPE, (const uint16_t *)q + (r0 * heads + h) * QDIM,
                                heads * QDIM, dot_rows, NOPE, part);
#endif
            if (VEC16 && nr < 4) {  /* batch 1: the weights read as stored, not widened into a block first */
                for (int64_t r = 0; r < nr; r++) dots16_stored(uk_t, (h * RANK + j0) * NOPE, bf16, qn[r], NOPE, part[r]);
            } else if (dot_rows < nr) {
                widen_rows16((const char *)uk_t + h * RANK * NOPE * (bf16 ? 2 : 4), j0, RANK, bf16, wb, NOPE);
                dots_block(wb, qn[dot_rows], NOPE, nr - dot_rows, NOPE, part + dot_rows);
            }
            for (int64_t r = 0; r < nr; r++) {
                float *dst = ql + ((r0 + r) * heads + h) * LAT + j0;
                for (int64_t j = 0; j < 16 && j0 + j < RANK; j++) dst[j] = scale * part[r][j];
            }
        }
    }
}

/* The latent rows of keys t0 .. t0 + n - 1 (n <= 16) of a sequence (its block table), their
 * first `width` values as float32 into buf [16][width], rows past n zero. */
static inline void latent_rows16(const void *kv, const int64_t *restrict table, int64_t t0, int64_t n,
                                 int64_t block_size, int64_t block_stride, int64_t layer_offset, int bf16, int width,
                                 float *restrict buf) {
    for (int64_t i = 0; i < 16; i++) {
        float *dst = buf + i * width;
        if (i < n) {
            const int64_t t = t0 + i;
            const float *src = as_f32(kv, table[t / block_size] * block_stride + layer_offset + t % block_size * LAT,
                                      bf16, dst, width);
            if (src != dst) memcpy(dst, src, sizeof(float) * width);
        } else {
            memset(dst, 0, sizeof(float) * width);
        }
    }
}

/* acc [RANK] += sum over i < n of p[i] * rows[i] (rows [16][RANK]). */
static inline void weighted_add(float *restrict acc, const float *restrict rows, const float *restrict p, int64_t n) {
#if VEC16
    for (int d0 = 0; d0 < RANK; d0 += 128) {  /* 8 vectors of the accumulator in registers */
        const int nv = (RANK - d0) / 16 < 8 ? (RANK - d0) / 16 : 8;
        __m512 a[8];
        for (int v = 0; v < nv; v++) a[v] = _mm512_loadu_ps(acc + d0 + 16 * v);
        for (int64_t i = 0; i < n; i++) {
            const __m512 pv = _mm512_set1_ps(p[i]);
            for (int v = 0; v < nv; v++) a[v] = _mm512_fmadd_ps(pv, _mm512_loadu_ps(rows + i * RANK + d0 + 16 * v), a[v]);
        }
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(acc + d0 + 16 * v, a[v]);
    }
#else
    for (int64_t i = 0; i < n; i++) {
        const float pi = p[i];
#pragma omp simd
        for (int d = 0; d < RANK; d++) acc[d] += pi * rows[i * RANK + d];
    }
#endif
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
            float m[HC], sum[HC], acc[HC][RANK], cb[16 * LAT], sc[16];
            for (int g = 0; g < nh; g++) {
                m[g] = -INFINITY;
                sum[g] = 0.0f;
                memset(acc[g], 0, sizeof(float) * RANK);
            }
            /* 16 keys at a time: their rows widened once for the chunk's heads */
            for (int64_t t0 = 0; t0 < ctx; t0 += 16) {
                const int64_t n = min64(16, ctx - t0);
                latent_rows16(kv, table, t0, n, block_size, block_stride, layer_offset, bf16, LAT, cb);
                for (int g = 0; g < nh; g++) {
                    dots16(cb, ql + (r * heads + h0 + g) * LAT, LAT, sc);
                    for (int64_t i = 0; i < n; i++) {
                        scores[g * ctx + t0 + i] = sc[i];
                        m[g] = sc[i] > m[g] ? sc[i] : m[g];
                    }
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
            for (int64_t t0 = 0; t0 < ctx; t0 += 16) {  /* the rows again, from cache: only their c part */
                const int64_t n = min64(16, ctx - t0);
                latent_rows16(kv, table, t0, n, block_size, block_stride, layer_offset, bf16, RANK, cb);
                for (int g = 0; g < nh; g++) weighted_add(acc[g], cb, scores + g * ctx + t0, n);
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
 * as phase 1's, W_UV's rows widened 16 at a time. */
static void project_values(const float *restrict ol, const void *uv, void *out, int64_t rows, int64_t heads,
                           int bf16, int num_threads) {
    const int64_t blocks = (rows + RB - 1) / RB;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t item = 0; item < heads * blocks; item++) {
        const int64_t h = item / blocks, r0 = item % blocks * RB, nr = min64(RB, rows - r0);
        float wb[16 * RANK], part[RB][16];
        const int64_t dot_rows = BF16_DOT && bf16 ? nr / 4 * 4 : 0;  /* the rows on AVX512_BF16 dot products */
#if BF16_DOT
        uint16_t ob[RB][RANK];  /* their weighted latents rounded to bf16 */
        for (int64_t r = 0; r < dot_rows; r++)
            for (int d = 0; d < RANK; d++) ob[r][d] = f32_to_bf16(ol[((r0 + r) * heads + h) * RANK + d]);
#endif
        for (int64_t j0 = 0; j0 < VDIM; j0 += 16) {
#if BF16_DOT
            if (dot_rows > 0 && j0 + 16 <= VDIM) {
                dots_block_bf16((const uint16_t *)uv + (h * VDIM + j0) * RANK, ob[0], RANK, dot_rows, RANK, part);
                if (dot_rows < nr) {
                    widen_rows16((const char *)uv + h * VDIM * RANK * 2, j0, VDIM, bf16, wb, RANK);
                    dots_block(wb, ol + ((r0 + dot_rows) * heads + h) * RANK, heads * RANK, nr - dot_rows, RANK,
                               part + dot_rows);
                }
            } else
#endif
            if (VEC16 && nr < 4 && j0 + 16 <= VDIM) {
                for (int64_t r = 0; r < nr; r++)
                    dots16_stored(uv, (h * VDIM + j0) * RANK, bf16, ol + ((r0 + r) * heads + h) * RANK, RANK, part[r]);
            } else {
                widen_rows16((const char *)uv + h * VDIM * RANK * (bf16 ? 2 : 4), j0, VDIM, bf16, wb, RANK);
                dots_block(wb, ol + (r0 * heads + h) * RANK, heads * RANK, nr, RANK, part);
            }
            for (int64_t r = 0; r < nr; r++) {
                const int64_t at = ((r0 + r) * heads + h) * VDIM + j0;
                for (int64_t j = 0; j < 16 && j0 + j < VDIM; j++) {
                    if (bf16)
                        ((uint16_t *)out)[at + j] = f32_to_bf16(part[r][j]);
                    else
                        ((float *)out)[at + j] = part[r][j];
                }
            }
        }
    }
}

/* AMX (Sapphire Rapids and later), bf16 at AMX_MIN_ROWS query rows or more: phases 1 and 3 as
 * tile products that read each head's weights once per block of RB rows. The weights are the A
 * operand as stored (a tile: 16 weight rows x 32 values, rows NOPE or RANK values apart: no packed
 * copy to keep), the block's rows the B operand (phase 1: q_nope; phase 3: the weighted latents
 * rounded to bf16, as the AVX512_BF16 path rounds them), packed per item into the tile's
 * [value pair][row][2] layout; a C tile is 16 outputs x 16 rows, transposed on the way out. Sums
 * float32 as the other paths (bf16 products exact), in another order. Fewer rows: the paths above
 * (batch 1's weights read as stored with a prefetch, the batch-1 C layer's bits unchanged). */
#if BF16_DOT && defined(__AMX_TILE__) && defined(__AMX_BF16__) && ROPE % 32 == 0 && VDIM % 16 == 0
/* (BF16_DOT: AVX-512 BW and BF16 dots, NOPE and RANK multiples of 32; off in the no-bf16-dot build,
 * which stands for an AVX-512 CPU without them, as every AMX path of the kernels) */
#include "amx.h"
#define MLA_AMX 1
#define AMX_MIN_ROWS 4

/* x as hi + lo, two bf16 vectors (hi = x rounded, lo = the rest rounded): ~16 significant bits
 * through two tile products, where one bf16 operand would lose phase 2's float32 precision */
static inline void split_bf16(__m512 x, uint16_t *hi, uint16_t *lo) {
    const __m256i h = bf16_of16(x);
    _mm256_storeu_si256((__m256i *)hi, h);
    const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    _mm256_storeu_si256((__m256i *)lo, bf16_of16(_mm512_sub_ps(x, hf)));
}

/* 16 rows (bf16, or float32 rounded to bf16 when f32; NULL: zeros), their first n values, as n / 32
 * contiguous B tiles [16 pairs][16 rows][2] at dst: per tile the rows' 16 value pairs (32-bit
 * each) transposed in registers. */
static inline void amx_pack16(const void *const rows[16], int f32, int n, uint16_t *restrict dst) {
    for (int k = 0; k < n; k += 32) {
        __m512 v[16];
        for (int i = 0; i < 16; i++) {
            if (rows[i] == NULL) {
                v[i] = _mm512_setzero_ps();
            } else if (f32) {
                const float *s = (const float *)rows[i] + k;
                v[i] = _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(bf16_of16(_mm512_loadu_ps(s))),
                                                              bf16_of16(_mm512_loadu_ps(s + 16)), 1));
            } else {
                v[i] = _mm512_castsi512_ps(_mm512_loadu_si512((const uint16_t *)rows[i] + k));
            }
        }
        transpose16(v);
        for (int i = 0; i < 16; i++) _mm512_storeu_ps(dst + k * 16 + 32 * i, v[i]);
    }
}

/* rows [0, nr) (nr <= RB) of src (rows `stride` elements apart, f32 as amx_pack16's), as B tiles:
 * dst [RB / 16 row blocks][n / 32][512] (a row block's tiles contiguous, 16 n values apart), rows
 * past nr zero. */
static inline void amx_pack_rows(const void *src, int f32, int64_t stride, int64_t nr, int n, uint16_t *restrict dst) {
    for (int64_t r0 = 0; r0 < nr; r0 += 16) {
        const void *rows[16];
        for (int64_t i = 0; i < 16; i++)
            rows[i] = r0 + i >= nr ? NULL
                      : f32 ? (const void *)((const float *)src + (r0 + i) * stride)
                            : (const void *)((const uint16_t *)src + (r0 + i) * stride);
        amx_pack16(rows, f32, n, dst + r0 * n);
    }
}

/* out [4][16 outputs][16 rows], tile t = (weight rows a + 16 (t % 2), packed row block t / 2):
 * the weight rows a (16, or 32 when two_a; rows a_stride values apart) times the packed rows b
 * (one row block, or two when two_b), over `chunks` chunks of 32 values. Tiles 0-3 accumulate,
 * 4-5 the weights, 6-7 the rows. */
static inline void amx_tiles(const uint16_t *a, int64_t a_stride, int two_a, const uint16_t *b, int64_t b_block,
                             int two_b, int chunks, float *out) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int c = 0; c < chunks; c++) {
        _tile_loadd(6, b + c * 512, 64);
        for (int i = 0; i < 32; i++)  /* the next 32 weight rows' chunk c: strided tile rows miss the prefetchers */
            _mm_prefetch((const char *)(a + (32 + i) * a_stride + c * 32), _MM_HINT_T0);
        _tile_loadd(4, a + c * 32, a_stride * 2);
        _tile_dpbf16ps(0, 4, 6);
        if (two_a) {
            _tile_loadd(5, a + 16 * a_stride + c * 32, a_stride * 2);
            _tile_dpbf16ps(1, 5, 6);
        }
        if (two_b) {
            _tile_loadd(7, b + b_block + c * 512, 64);
            _tile_dpbf16ps(2, 4, 7);
            if (two_a) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, out, 64);
    if (two_a) _tile_stored(1, out + 256, 64);
    if (two_b) _tile_stored(2, out + 512, 64);
    if (two_a && two_b) _tile_stored(3, out + 768, 64);
}

/* C tile t of amx_tiles' out, transposed: v[n] = row n's 16 outputs */
static inline void amx_rows_of(const float *out, int t, __m512 v[16]) {
    for (int j = 0; j < 16; j++) v[j] = _mm512_loadu_ps(out + t * 256 + j * 16);
    transpose16(v);
}

/* Phases 1 and 3 on tiles, the heads h_lo .. h_hi - 1 (a thread's, its tiles configured): per head h
 * and row r, dst row (r, h) = scale * W[h] x row (r, h), for the rows x (bf16, or float32 rounded to
 * bf16 when x_f32; row r's head h at (r * heads + h) * x_head) and the weights w [heads][n_out][k]
 * bf16; dst float32 (r * heads + h) * dst_head + j, or bf16 when dst_bf16. A head's weights are read
 * once per block of RB rows. */
static void heads_amx(const void *x, int x_f32, int64_t x_head, const uint16_t *w, int n_out, int k, void *dst,
                      int dst_bf16, int64_t dst_head, float scale, int64_t rows, int64_t heads, int64_t h_lo,
                      int64_t h_hi) {
    const size_t x_size = x_f32 ? sizeof(float) : sizeof(uint16_t);
    uint16_t xb[RB * (NOPE > RANK ? NOPE : RANK)];
    float c[4 * 256];
    for (int64_t h = h_lo; h < h_hi; h++)
        for (int64_t r0 = 0; r0 < rows; r0 += RB) {
            const int64_t nr = min64(RB, rows - r0);
            amx_pack_rows((const char *)x + (r0 * heads + h) * x_head * x_size, x_f32, heads * x_head, nr, k, xb);
            for (int64_t j0 = 0; j0 < n_out; j0 += 32) {
                const int two_a = j0 + 16 < n_out;
                amx_tiles(w + (h * n_out + j0) * k, k, two_a, xb, 16 * k, nr > 16, k / 32, c);
                for (int t = 0; t < (nr > 16 ? 4 : 2); t++) {
                    if (t % 2 && !two_a) continue;
                    __m512 v[16];
                    amx_rows_of(c, t, v);
                    for (int64_t n = 0; n < 16 && t / 2 * 16 + n < nr; n++) {
                        const int64_t at = ((r0 + t / 2 * 16 + n) * heads + h) * dst_head + j0 + t % 2 * 16;
                        if (dst_bf16)
                            _mm256_storeu_si256((__m256i *)((uint16_t *)dst + at), bf16_of16(v[n]));
                        else
                            _mm512_storeu_ps((float *)dst + at, _mm512_mul_ps(v[n], _mm512_set1_ps(scale)));
                    }
                }
            }
        }
}

/* The scratch (uint16_t elements) of attend_amx for a context of up to ctx keys: kt, vt, the
 * probabilities (bf16), the scores (float) */
static inline int64_t attend_amx_elems(int64_t ctx) {
    const int64_t n16 = (ctx + 15) / 16 > 0 ? (ctx + 15) / 16 : 1, n32 = (n16 + 1) / 2;
    return n16 * 16 * LAT + n32 * 32 * RANK + 32 * n32 * 32 + 2 * 16 * n16 * 16;
}

/* Phase 2 on tiles for sequence b and its heads h0 .. h0 + nh - 1 (nh <= 16; a thread's, its tiles
 * configured): ol as attend's, bf16 cache, kt its scratch (attend_amx_elems of the context). The
 * sequence's latent rows packed once: keys as B tiles kt [t / 16][LAT / 32][16 dim pairs][16 tokens]
 * [2], the c part as B tiles vt [RANK / 16][t / 32][16 token pairs][16 dims][2]. Per query row: the
 * heads' queries split into bf16 hi + lo halves (float32-like precision through the bf16 products)
 * are the A operand of the scores (A row g: head g's hi, row L + g its lo; L = 8 where nh <= 8, so
 * both halves share one 16-row tile, else 16), an exact float32 softmax per head, the probabilities
 * normalised and split the same way the A operand of P V into ol. */
static void attend_amx(const float *restrict ql, const uint16_t *kv, const int64_t *restrict table, int64_t full_ctx,
                       int64_t r_begin, int64_t r_end, float *restrict ol, int64_t heads, int64_t h0, int64_t nh,
                       int64_t block_size, int64_t block_stride, int64_t layer_offset, uint16_t *restrict kt) {
    const int64_t n16 = (full_ctx + 15) / 16 > 0 ? (full_ctx + 15) / 16 : 1, n32 = (n16 + 1) / 2;
    const int L = nh <= 8 ? 8 : 16, two_a = L == 16;
    float c[4 * 256];
    uint16_t qa[32 * LAT];
    uint16_t *vt = kt + n16 * 16 * LAT, *pb = vt + n32 * 32 * RANK;
    float *sc = (float *)(pb + 32 * n32 * 32);
    const uint16_t *row[32];
    for (int64_t t0 = 0; t0 < n32 * 32; t0 += 32) {
        for (int64_t i = 0; i < 32; i++) {
            const int64_t t = t0 + i;
            row[i] = t >= full_ctx ? NULL : kv + table[t / block_size] * block_stride + layer_offset + t % block_size * LAT;
        }
        amx_pack16((const void *const *)row, 0, LAT, kt + t0 * LAT);
        if (t0 + 16 < n16 * 16) amx_pack16((const void *const *)(row + 16), 0, LAT, kt + (t0 + 16) * LAT);
        /* values: tile row p = tokens 2p and 2p + 1 interleaved over 16 dims */
        const __m512i idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                             39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
        for (int64_t d0 = 0; d0 < RANK; d0 += 16) {
            uint16_t *tile = vt + (d0 / 16 * n32 + t0 / 32) * 512;
            for (int p = 0; p < 16; p++) {
                __m512i pair[2];
                for (int i = 0; i < 2; i++) {
                    const uint16_t *src = row[2 * p + i];
                    pair[i] = src == NULL ? _mm512_setzero_si512()
                                          : _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(src + d0)));
                }
                _mm512_storeu_si512(tile + 32 * p, _mm512_permutex2var_epi16(pair[0], idx, pair[1]));
            }
        }
    }
    for (int64_t r = r_begin; r < r_end; r++) {
        const int64_t ctx = full_ctx - (r_end - 1 - r), k16 = (ctx + 15) / 16, k32 = (ctx + 31) / 32;
        for (int g = 0; g < L; g++)
            for (int d = 0; d < LAT; d += 16)
                split_bf16(g < nh ? _mm512_loadu_ps(ql + (r * heads + h0 + g) * LAT + d) : _mm512_setzero_ps(),
                           qa + g * LAT + d, qa + (L + g) * LAT + d);
        for (int64_t tb = 0; tb < k16; tb += 2) {  /* scores, 32 keys a pass: hi and lo halves summed */
            const int two = tb + 1 < k16;
            amx_tiles(qa, LAT, two_a, kt + tb * 16 * LAT, 16 * LAT, two, LAT / 32, c);
            for (int g = 0; g < nh; g++)
                for (int k = 0; k < 1 + two; k++)  /* key block tb + k: A rows g (hi) and L + g (lo) */
                    _mm512_storeu_ps(sc + g * n16 * 16 + (tb + k) * 16,
                                     _mm512_add_ps(_mm512_loadu_ps(c + 512 * k + g * 16),
                                                   _mm512_loadu_ps(c + 512 * k + (L + g) * 16)));
        }
        for (int g = 0; g < L; g++) {
            uint16_t *pg = pb + g * n32 * 32, *pl = pb + (L + g) * n32 * 32;
            if (g >= nh || ctx <= 0) {
                memset(pg, 0, sizeof(uint16_t) * n32 * 32);
                memset(pl, 0, sizeof(uint16_t) * n32 * 32);
                continue;
            }
            float *sg = sc + g * n16 * 16, m = -INFINITY, total = 0.0f;
            for (int64_t t = 0; t < ctx; t++) m = sg[t] > m ? sg[t] : m;
#pragma omp simd reduction(+ : total)
            for (int64_t t = 0; t < ctx; t++) {
                sg[t] = exp_nonpositive(sg[t] - m);
                total += sg[t];
            }
            const __m512 inv = _mm512_set1_ps(1.0f / total);
            for (int64_t t = 0; t < n32 * 32; t += 16)
                split_bf16(_mm512_maskz_mul_ps(t + 16 <= ctx ? 0xffff : t < ctx ? (1u << (ctx - t)) - 1 : 0,
                                               _mm512_loadu_ps(sg + t), inv), pg + t, pl + t);
        }
        for (int64_t d0 = 0; d0 < RANK; d0 += 32) {  /* P V, 32 latent dims a pass */
            amx_tiles(pb, n32 * 32, two_a, vt + d0 / 16 * n32 * 512, n32 * 512, 1, (int)k32, c);
            for (int g = 0; g < nh; g++)
                for (int k = 0; k < 2; k++)  /* dims d0 + 16 k: hi row + lo row */
                    _mm512_storeu_ps(ol + (r * heads + h0 + g) * RANK + d0 + 16 * k,
                                     _mm512_add_ps(_mm512_loadu_ps(c + 512 * k + g * 16),
                                                   _mm512_loadu_ps(c + 512 * k + (L + g) * 16)));
        }
    }
}

/* All three phases on tiles in one OpenMP region: phase 1 (ql: absorb_queries', the rope part
 * copied, scaled) and phase 3 (out bf16, project_values') split by heads, each thread a contiguous
 * share (its W_UK / W_UV rows read once per RB rows); between them phase 2 over work items of a
 * sequence and a chunk of its heads (attend's: all of a sequence's heads, at most 16, where the batch
 * keeps the threads busy; its latent rows packed once an item), shared dynamically. Why one region:
 * three were three forks and joins a layer (a sleeping thread woken each, 26 layers a step); two
 * barriers remain. Returns 0 or -1 (no scratch memory). */
static int mla_decode_amx(const uint16_t *q, const uint16_t *uk_t, const uint16_t *uv, const uint16_t *kv,
                          const int64_t *restrict block_tables, const int64_t *restrict context_lens,
                          const int64_t *restrict query_starts, float *restrict ql, float *restrict ol, uint16_t *out,
                          int64_t batch, int64_t rows, int64_t heads, int64_t block_size, int64_t table_width,
                          int64_t block_stride, int64_t layer_offset, float scale, int num_threads) {
    int64_t most = 0, chunks = (heads + HC - 1) / HC;
    for (int64_t b = 0; b < batch; b++) most = context_lens[b] > most ? context_lens[b] : most;
    while (chunks < heads && batch * chunks < 2 * num_threads) chunks++;
    const int64_t hc = (heads + chunks - 1) / chunks;
    chunks = (heads + hc - 1) / hc;
    const size_t scratch = sizeof(uint16_t) * attend_amx_elems(most);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
        const int64_t h_lo = heads * t / n, h_hi = heads * (t + 1) / n;
        uint16_t *kt = malloc(scratch);
        const int ready = amx_thread_ready(kt != NULL, &failed);
        if (ready) {
            for (int64_t r = 0; r < rows; r++)
                for (int64_t h = h_lo; h < h_hi; h++)
                    for (int d = 0; d < ROPE; d++)
                        ql[(r * heads + h) * LAT + RANK + d] = scale * bf16_to_f32(q[(r * heads + h) * QDIM + NOPE + d]);
            heads_amx(q, 0, QDIM, uk_t, RANK, NOPE, ql, 0, LAT, scale, rows, heads, h_lo, h_hi);
        }
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < batch * chunks; item++) {
            const int64_t b = item / chunks, h0 = item % chunks * hc;
            if (ready)
                attend_amx(ql, kv, block_tables + b * table_width, context_lens[b],
                           query_starts ? query_starts[b] : b, query_starts ? query_starts[b + 1] : b + 1, ol, heads,
                           h0, min64(hc, heads - h0), block_size, block_stride, layer_offset, kt);
        }
        if (ready) {
            heads_amx(ol, 1, RANK, uv, VDIM, RANK, out, 1, VDIM, 1.0f, rows, heads, h_lo, h_hi);
            _tile_release();
        }
        free(kt);
    }
    return failed ? -1 : 0;
}
#else
#define MLA_AMX 0
#endif

static int use_amx = 1; /* atomd_mla_amx: the tile path allowed (the A/B switch, $ATOMD_MLA_AMX) */

/* 1 where the tile path runs: built with AMX tiles, the process granted their state and the path
 * not switched off; on >= 0 first switches it on (1) or off (0): atomd/model/mla.py's AMX. */
int atomd_mla_amx(int on) {
    if (on >= 0) use_amx = on != 0;
#if MLA_AMX
    return use_amx && amx_granted();
#else
    return 0;
#endif
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
#if MLA_AMX
    const int amx = bf16 && rows >= AMX_MIN_ROWS && use_amx && amx_granted();
#endif
    if (ql != NULL && ol != NULL) {
#if MLA_AMX
        if (amx) {
            status = mla_decode_amx(q, uk_t, uv, kv, block_tables, context_lens, query_starts, ql, ol, out, batch, rows,
                                    heads, block_size, table_width, block_stride, layer_offset, scale, num_threads);
        } else
#endif
        {
            absorb_queries(q, uk_t, ql, rows, heads, scale, bf16, num_threads);
            status = attend(ql, kv, block_tables, context_lens, query_starts, ol, batch, heads, block_size, table_width,
                            block_stride, layer_offset, bf16, num_threads);
            if (status == 0) project_values(ol, uv, out, rows, heads, bf16, num_threads);
        }
    }
    free(ql);
    free(ol);
    return status;
}
