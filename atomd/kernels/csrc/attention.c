/* Attention kernels, float32 (and bfloat16: the *_bf16 functions at the end), loaded by atomd/native.py:
 *
 * - atomd_decode_attention: the decode queries of each sequence read its context straight from
 *   the block-major paged KV cache (atomd/kv_cache.py): one token per sequence, or with
 *   speculative decoding its last token and its drafts (causal inside that run).
 * - atomd_prefill_attention: causal attention of fresh prompts (no cached prefix) over their
 *   own packed k, v rows, flash-style (key tiles, online softmax); in bf16 on AMX CPUs as
 *   tile matmuls with an exact softmax per row instead (prefill_tile_amx).
 *
 * Why a decode kernel: torch's CPU SDPA and batched matmul ran a decode step's attention at ~6 GB/s
 * of KV read (small per-head GEMMs; with GQA each KV head is read once per query head), a
 * third of a batch-16 decode step, and needed a contiguous copy of every context (the decode
 * workspace). This reads every K and V row once, in place, for all the query heads of its
 * group: ~15-20 GB/s on a cold cache here. Why a prefill kernel: torch's CPU flash SDPA runs
 * 8 x 512-token causal attention at ~40 GFLOP/s, ~30% of a prefill; register-blocked tiles
 * over keys transposed once reach ~2x that. Built at first use by atomd/native.py; OpenMP
 * resolves to the libgomp torch already loaded, so both share torch's thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "fast_exp.h"

#if !defined(HEAD_DIM) || !defined(GROUP)
#error "build with -DHEAD_DIM=<head_dim> -DGROUP=<query heads per KV head>"
#endif

/* Sliding window: a query that sees ctx keys (itself the last) attends to keys lo .. ctx - 1,
 * lo = ctx - window (position p sees p - window < j <= p, as transformers masks); window 0:
 * all of them (a global layer). */
static inline int64_t window_start(int64_t ctx, int64_t window) {
    return window > 0 && ctx > window ? ctx - window : 0;
}

/* The next block is at an unpredictable address: ask for its rows while this one computes. */
static inline void prefetch_rows(const float *row, int64_t rows, int64_t row_stride) {
    for (int64_t i = 0; i < rows; i++, row += row_stride)
        for (int d = 0; d < HEAD_DIM; d += 16) __builtin_prefetch(row + d);
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define NW ((HEAD_DIM + 15) / 16) /* 16 floats per zmm */
static inline __mmask16 first_lanes16(int64_t n) {  /* the first n of 16 lanes (none for n <= 0) */
    return n >= 16 ? (__mmask16)0xffff : n > 0 ? (__mmask16)((1u << n) - 1u) : (__mmask16)0;
}

static inline __mmask16 lanes16(int w) { return first_lanes16(HEAD_DIM - w * 16); }  /* dims of vector w */

/* Lane j of the result: the sum of the 16 lanes of v[j]. A transposing tree, 45 shuffles and
 * adds for 16 sums, where one _mm512_reduce_add_ps a vector costs ~8 in a dependent chain:
 * the decode scores of 16 keys at once. */
static inline __m512 sum_lanes16(const __m512 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)  /* per 128-bit lane: the 4 vectors' sums over that lane */
        b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++)  /* 128-bit lanes 0+1 and 2+3 of two such */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

/* HEAD_DIM and GROUP are fixed at build time (atomd/native.py builds one library per model
 * shape) so the per-row loops unroll and the group's queries and accumulators stay in registers. */

/* q, out: [batch, num_heads, HEAD_DIM] contiguous. kv: the cache's base pointer; the K row of
 * token t of sequence b, KV head h is at
 *   kv + table[b][t / block_size] * block_stride + k_offset + ((t % block_size) * num_kv_heads + h) * HEAD_DIM
 * and its V row v_offset elements further. block_tables: [batch, table_width]. query_starts:
 * NULL (query row b is sequence b's one token), or [batch + 1] row offsets: sequence b owns
 * query rows query_starts[b] .. query_starts[b + 1] - 1, its last ones, so row r sees the keys
 * 0 .. context_lens[b] - (query_starts[b + 1] - r) (causal inside the run: a sequence's last
 * token and its drafts, verified in one step). num_threads: torch's intra-op count of the
 * calling thread (OpenMP's own default is per thread).
 * Returns 0, or -1 when a scratch buffer could not be allocated (out is then incomplete). */
int atomd_decode_attention(const float *restrict q, const float *restrict kv,
                            const int64_t *restrict block_tables, const int64_t *restrict context_lens,
                            const int64_t *restrict query_starts, float *restrict out, int64_t batch,
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
            float qs[GROUP][HEAD_DIM], m[GROUP], sum[GROUP], acc[GROUP][HEAD_DIM];
            for (int g = 0; g < GROUP; g++) {
                m[g] = -INFINITY;
                sum[g] = 0.0f;
                for (int d = 0; d < HEAD_DIM; d++) {
                    qs[g][d] = qh[g * HEAD_DIM + d] * scale;
                    acc[g][d] = 0.0f;
                }
            }
            /* scores: each K row is read once for all the query heads of its group; block by block
             * from the window's first key (no division per token) */
            const int64_t lo = window_start(ctx, window);
            for (int64_t t0 = lo, n; t0 < ctx; t0 += n) {
                const int64_t off = t0 % block_size;
                const float *k = kv + table[t0 / block_size] * block_stride + k_offset + off * row_stride + h * HEAD_DIM;
                n = ctx - t0 < block_size - off ? ctx - t0 : block_size - off;
                if (t0 - off + block_size < ctx)
                    prefetch_rows(kv + table[t0 / block_size + 1] * block_stride + k_offset + h * HEAD_DIM,
                                  block_size, row_stride);
                prefetch_rows(k + v_offset, n, row_stride);  /* this block's V rows, for the second pass */
#if defined(__AVX512F__)
                /* 16 keys at a time: a K row's products for each query head in float32 lanes,
                 * then one transposing tree for the 16 keys' sums (as the bf16 path) */
                for (int64_t i0 = 0; i0 < n; i0 += 16) {
                    const int64_t c = n - i0 < 16 ? n - i0 : 16;
                    __m512 part[GROUP][16];
                    for (int64_t i = 0; i < 16; i++)
                        for (int g = 0; g < GROUP; g++) {
                            __m512 a = _mm512_setzero_ps();
                            if (i < c)
                                for (int w = 0; w < NW; w++)
                                    a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes16(w), qs[g] + w * 16),
                                                        _mm512_maskz_loadu_ps(lanes16(w), k + (i0 + i) * row_stride + w * 16), a);
                            part[g][i] = a;
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
                    for (int g = 0; g < GROUP; g++) {
                        float s = 0.0f;
#pragma omp simd reduction(+ : s)
                        for (int d = 0; d < HEAD_DIM; d++) s += qs[g][d] * k[d];
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
            /* weighted values: each V row read once, the group's accumulators in registers */
            for (int64_t t0 = lo, n; t0 < ctx; t0 += n) {
                const int64_t off = t0 % block_size;
                const float *v = kv + table[t0 / block_size] * block_stride + k_offset + v_offset + off * row_stride + h * HEAD_DIM;
                n = ctx - t0 < block_size - off ? ctx - t0 : block_size - off;
                for (int64_t i = 0; i < n; i++, v += row_stride)  /* prefetched by the score pass */
                    for (int g = 0; g < GROUP; g++) {
                        const float p = scores[g * ctx + t0 + i];
#pragma omp simd
                        for (int d = 0; d < HEAD_DIM; d++) acc[g][d] += p * v[d];
                    }
            }
            float *o = out + (r * num_heads + h * GROUP) * HEAD_DIM;
            for (int g = 0; g < GROUP; g++)
                for (int d = 0; d < HEAD_DIM; d++) o[g * HEAD_DIM + d] = acc[g][d] / sum[g];
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* Prefill work items: RB query rows of one KV head share each key tile load; QT tokens x GROUP
 * heads rows per item (a multiple of RB), KT keys per tile. */
#define RB 4
#define QT ((32 / GROUP) >= 4 ? (32 / GROUP) / 4 * 4 : 4)
#define KT 64

/* One work item: query tokens [r0, r0 + nrows) of a sequence whose rows start at q, k, v, KV
 * head h. Keys 0 .. r0 + nrows - 1, causally masked per row. */
static void prefill_item(const float *restrict q, const float *restrict kt, const float *restrict v,
                         float *restrict out, int64_t r0, int64_t nrows, int64_t h, int64_t num_heads,
                         int64_t q_stride, int64_t kt_stride, int64_t v_stride, float scale, int64_t window) {
    float qs[GROUP * QT][HEAD_DIM], acc[GROUP * QT][HEAD_DIM], m[GROUP * QT], l[GROUP * QT];
    float sc[GROUP * QT][KT];
    for (int64_t r = 0; r < QT; r++)  /* rows past the chunk's end compute on zeros, unused */
        for (int g = 0; g < GROUP; g++) {
            const int64_t row = g * QT + r;
            for (int d = 0; d < HEAD_DIM; d++) {
                qs[row][d] = r < nrows ? q[(r0 + r) * q_stride + (h * GROUP + g) * HEAD_DIM + d] * scale : 0.0f;
                acc[row][d] = 0.0f;
            }
            m[row] = -INFINITY;
            l[row] = 0.0f;
        }
    const int64_t nkeys = r0 + nrows, lo = window_start(r0 + 1, window);  /* row r0's first key */
    for (int64_t j0 = lo / KT * KT; j0 < nkeys; j0 += KT) {
        const int64_t nk = nkeys - j0 < KT ? nkeys - j0 : KT;
        for (int64_t b0 = 0; b0 < GROUP * QT; b0 += RB) {
            float sb[RB][KT] = {{0}};
            for (int d = 0; d < HEAD_DIM; d++) {
                const float *kd = kt + d * kt_stride + j0;  /* keys past nk: padding or the next prompt, masked */
                for (int rb = 0; rb < RB; rb++) {
                    const float qd = qs[b0 + rb][d];
#pragma omp simd
                    for (int j = 0; j < KT; j++) sb[rb][j] += qd * kd[j];
                }
            }
            for (int rb = 0; rb < RB; rb++) {  /* online softmax: rescale what came before */
                const int64_t row = b0 + rb, pos = r0 + row % QT;
                float *srow = sb[rb], mx = m[row], sum = 0.0f;
                for (int j = 0; j < KT; j++) {
                    if (j >= nk || j0 + j > pos || j0 + j < window_start(pos + 1, window)) srow[j] = -INFINITY;
                    mx = srow[j] > mx ? srow[j] : mx;
                }
                /* first tile: m = -inf, acc = 0; a row whose window starts past this tile: all -inf */
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
        for (int64_t b0 = 0; b0 < GROUP * QT; b0 += RB) {  /* RB accumulators stay in registers */
            float ab[RB][HEAD_DIM];
            for (int rb = 0; rb < RB; rb++)
                for (int d = 0; d < HEAD_DIM; d++) ab[rb][d] = acc[b0 + rb][d];
            for (int64_t j = 0; j < nk; j++) {
                const float *vr = v + (j0 + j) * v_stride + h * HEAD_DIM;
                for (int rb = 0; rb < RB; rb++) {
                    const float p = sc[b0 + rb][j];
#pragma omp simd
                    for (int d = 0; d < HEAD_DIM; d++) ab[rb][d] += p * vr[d];
                }
            }
            for (int rb = 0; rb < RB; rb++)
                for (int d = 0; d < HEAD_DIM; d++) acc[b0 + rb][d] = ab[rb][d];
        }
    }
    for (int64_t r = 0; r < nrows; r++)
        for (int g = 0; g < GROUP; g++) {
            const int64_t row = g * QT + r;
            float *dst = out + (r0 + r) * num_heads * HEAD_DIM + (h * GROUP + g) * HEAD_DIM;
            const float inv = 1.0f / l[row];
            for (int d = 0; d < HEAD_DIM; d++) dst[d] = acc[row][d] * inv;
        }
}

/* Causal attention of fresh sequences packed back to back. q [T, num_heads, HEAD_DIM], k, v
 * [T, num_kv_heads, HEAD_DIM], each with its own token stride (they are views into the QKV
 * projection); out [T, num_heads * HEAD_DIM] contiguous. Sequence s is rows
 * [seq_starts[s], seq_starts[s] + seq_lens[s]). Returns 0, or -1 when its buffers could not
 * be allocated (out untouched). */
int atomd_prefill_attention(const float *restrict q, const float *restrict k, const float *restrict v,
                             float *restrict out, const int64_t *restrict seq_starts,
                             const int64_t *restrict seq_lens, int64_t num_seqs, int64_t num_heads,
                             int64_t num_kv_heads, int64_t q_stride, int64_t k_stride, int64_t v_stride,
                             float scale, int64_t window, int num_threads) {
    int64_t rows = 0;  /* keys are read up to the furthest sequence end */
    for (int64_t s = 0; s < num_seqs; s++)
        rows = seq_starts[s] + seq_lens[s] > rows ? seq_starts[s] + seq_lens[s] : rows;
    const int64_t kt_stride = rows + KT;
    /* every key transposed once, [kv_head][d][token] (+ KT padding): the score loops become axpys
     * over contiguous keys, and no query tile transposes the same keys again */
    float *kt = calloc((size_t)num_kv_heads * HEAD_DIM * kt_stride, sizeof(float));
    int64_t *first = malloc(sizeof(int64_t) * (num_seqs + 1));  /* first work item of each sequence */
    if (kt == NULL || first == NULL) {
        free(kt);
        free(first);
        return -1;
    }
    first[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        first[s + 1] = first[s] + num_kv_heads * ((seq_lens[s] + QT - 1) / QT);
#pragma omp parallel for num_threads(num_threads)
    for (int64_t t = 0; t < rows; t++)
        for (int64_t h = 0; h < num_kv_heads; h++)
            for (int d = 0; d < HEAD_DIM; d++)
                kt[(h * HEAD_DIM + d) * kt_stride + t] = k[t * k_stride + h * HEAD_DIM + d];
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = first[num_seqs] - 1; item >= 0; item--) {  /* the longest (last) tiles first */
        int64_t s = 0;
        while (first[s + 1] <= item) s++;
        const int64_t tiles = (seq_lens[s] + QT - 1) / QT, h = (item - first[s]) / tiles;
        const int64_t r0 = (item - first[s]) % tiles * QT, n = seq_lens[s] - r0 < QT ? seq_lens[s] - r0 : QT;
        const int64_t base = seq_starts[s];
        prefill_item(q + base * q_stride, kt + h * HEAD_DIM * kt_stride + base, v + base * v_stride,
                     out + base * num_heads * HEAD_DIM, r0, n, h, num_heads, q_stride, kt_stride, v_stride, scale,
                     window);
    }
    free(kt);
    free(first);
    return 0;
}

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
 *   compiler vectorises for whatever the target has.
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

static inline void widen_row(const uint16_t *restrict src, float *restrict dst) {
#pragma omp simd
    for (int d = 0; d < HEAD_DIM; d++) dst[d] = bf16_to_f32(src[d]);
}

static inline void prefetch_rows_bf16(const uint16_t *row, int64_t rows, int64_t row_stride) {
    for (int64_t i = 0; i < rows; i++, row += row_stride)
        for (int d = 0; d < HEAD_DIM; d += 32) __builtin_prefetch(row + d);
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
        prefetch_rows_bf16(kv + table[t0 / block_size + 1] * block_stride + k_offset + h * HEAD_DIM, block_size,
                           row_stride);
    prefetch_rows_bf16(k + v_offset, *n, row_stride);
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
            float m[GROUP], sum[GROUP], acc[GROUP][HEAD_DIM], qs[GROUP][HEAD_DIM];
            for (int g = 0; g < GROUP; g++) {
                m[g] = -INFINITY;
                sum[g] = 0.0f;
                for (int d = 0; d < HEAD_DIM; d++) acc[g][d] = 0.0f;
                for (int d = 0; d < HEAD_DIM; d++) qs[g][d] = bf16_to_f32(qh[g * HEAD_DIM + d]) * scale;
            }
            for (int64_t t0 = lo, n; t0 < ctx; t0 += n) {
                const uint16_t *k = k_block_bf16(kv, table, t0, ctx, h, block_size, block_stride, k_offset, v_offset,
                                                 row_stride, &n);
                for (int64_t i = 0; i < n; i++, k += row_stride) {
                    float kf[HEAD_DIM];
                    widen_row(k, kf);
                    for (int g = 0; g < GROUP; g++) {
                        float s = 0.0f;
#pragma omp simd reduction(+ : s)
                        for (int d = 0; d < HEAD_DIM; d++) s += qs[g][d] * kf[d];
                        scores[g * ctx + t0 + i] = s;
                        m[g] = s > m[g] ? s : m[g];
                    }
                }
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
            for (int64_t t0 = lo, n; t0 < ctx; t0 += n) {
                const int64_t off = t0 % block_size;
                const uint16_t *v = kv + table[t0 / block_size] * block_stride + k_offset + v_offset + off * row_stride + h * HEAD_DIM;
                n = ctx - t0 < block_size - off ? ctx - t0 : block_size - off;
                for (int64_t i = 0; i < n; i++, v += row_stride) {
                    float vf[HEAD_DIM];
                    widen_row(v, vf);
                    for (int g = 0; g < GROUP; g++) {
                        const float p = scores[g * ctx + t0 + i];
#pragma omp simd
                        for (int d = 0; d < HEAD_DIM; d++) acc[g][d] += p * vf[d];
                    }
                }
            }
            for (int g = 0; g < GROUP; g++) {
                const float inv = 1.0f / sum[g];
                for (int d = 0; d < HEAD_DIM; d++) o[g * HEAD_DIM + d] = f32_to_bf16(acc[g][d] * inv);
            }
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

#if BF16_DOT && defined(__AMX_TILE__) && defined(__AMX_BF16__) && HEAD_DIM % 32 == 0
/* AMX (Sapphire Rapids and later): the bf16 prefill's two products as tile matmuls.
 *
 * Why: the AVX512_BF16 loop above runs 8 x 512 causal tokens of the 135M shape at ~34 ms a
 * layer, torch's SDPA at ~8 ms; tiles multiply 16 x 32 by 32 x 16 bf16 in one instruction.
 * Per work item (one query head, 16 query rows): every score of the rows against their
 * causal keys (tiles of 16 keys: Q [16 x 32 dims] times the keys' [dim pair][key][2]
 * layout, which is the tile B operand as stored), an exact softmax per row in float32 (no
 * online rescaling: the rows' scores fit in L2), then P @ V over tiles of 32 keys with V
 * interleaved by key pairs [pair][dim][2] (B's layout). P is split into two bf16 terms,
 * hi = p's top 16 bits and lo = bf16(p - hi), both multiplied: the weights keep ~16 bits, as
 * accurate as the float32 weights of the loop above (one bf16 P would cost 3 digits). */
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_PATH 1
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Linux hands AMX's tile state to a process that asks; 1 when granted (torch's oneDNN asks too). */
static int amx_granted(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

static void amx_configure(void) {  /* every tile 16 rows of 64 bytes */
    tile_config c = {0};
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* The tile operands as stored, each tile 1 KB contiguous (strided tile rows miss the
 * prefetchers: a layout shared across tokens measured ~2x slower). Per KV head and sequence,
 * the sequence padded with zero keys to a multiple of 32:
 * - K: [16-key block][32-dim chunk][dim pair][key][2]: the B operand of Q [16 x 32 dims];
 * - V: [32-key block][16-dim chunk][key pair][dim][2]: the B operand of P [16 x 32 keys]. */
#define K_CHUNKS (HEAD_DIM / 32)
#define V_CHUNKS (HEAD_DIM / 16)

static inline int64_t k_tile_index(int64_t t, int d) {
    return ((((t / 16) * K_CHUNKS + d / 32) * 16 + (d % 32) / 2) * 16 + t % 16) * 2 + (d & 1);
}

static inline int64_t v_tile_index(int64_t t, int d) {
    return ((((t / 32) * V_CHUNKS + d / 16) * 16 + (t % 32) / 2) * 16 + d % 16) * 2 + (t & 1);
}

/* Query rows [r0, r0 + n) (n <= 16) of query head hq of one sequence (its rows start at q
 * and out; kb, vb: its KV head's tiles). sc: [16][nk32] floats, phi / plo: [16][nk32] bf16,
 * thread-owned scratch. */
static void prefill_tile_amx(const uint16_t *restrict q, const uint16_t *restrict kb, const uint16_t *restrict vb,
                             uint16_t *restrict out, int64_t r0, int64_t n, int64_t hq, int64_t num_heads,
                             int64_t q_stride, float scale, int64_t window, float *restrict sc,
                             uint16_t *restrict phi, uint16_t *restrict plo) {
    const int64_t nkeys = r0 + n, nk32 = (nkeys + 31) / 32 * 32;
    uint16_t qb[16][HEAD_DIM];  /* the rows, zero past n: a tile always loads 16 */
    for (int64_t r = 0; r < 16; r++)
        for (int d = 0; d < HEAD_DIM; d++) qb[r][d] = r < n ? q[(r0 + r) * q_stride + hq * HEAD_DIM + d] : 0;
    /* scores: tiles 0-1 (two blocks of 16 keys) += Q chunk x K tiles (2-3); with up to 4
     * chunks Q stays in tiles 4-7 */
#define Q_RESIDENT (K_CHUNKS <= 4)
#if Q_RESIDENT
#define Q_LOAD(C, T) if (C < K_CHUNKS) _tile_loadd(T, &qb[0][C * 32], HEAD_DIM * 2);
    Q_LOAD(0, 4) Q_LOAD(1, 5) Q_LOAD(2, 6) Q_LOAD(3, 7)
#undef Q_LOAD
#endif
    for (int64_t j0 = 0; j0 < nkeys; j0 += 32) {
        const uint16_t *k0 = kb + j0 / 16 * K_CHUNKS * 512, *k1 = k0 + K_CHUNKS * 512;
        _tile_zero(0);
        _tile_zero(1);
#if Q_RESIDENT
#define Q_DOT(C, T)                            \
    if (C < K_CHUNKS) {                        \
        _tile_loadd(2, k0 + C * 512, 64);      \
        _tile_loadd(3, k1 + C * 512, 64);      \
        _tile_dpbf16ps(0, T, 2);               \
        _tile_dpbf16ps(1, T, 3);               \
    }
        Q_DOT(0, 4) Q_DOT(1, 5) Q_DOT(2, 6) Q_DOT(3, 7)
#undef Q_DOT
#else
        for (int c = 0; c < K_CHUNKS; c++) {
            _tile_loadd(4, &qb[0][c * 32], HEAD_DIM * 2);
            _tile_loadd(2, k0 + c * 512, 64);
            _tile_loadd(3, k1 + c * 512, 64);
            _tile_dpbf16ps(0, 4, 2);
            _tile_dpbf16ps(1, 4, 3);
        }
#endif
        _tile_stored(0, sc + j0, nk32 * 4);
        _tile_stored(1, sc + j0 + 16, nk32 * 4);
    }
    /* softmax of each row over its keys 0 .. r0 + r, in base 2: p = 2^(s * scale * log2(e) - max') */
    float inv[16];
    const float to_log2 = scale * 1.44269504088896341f;
    const __m512 vlog2 = _mm512_set1_ps(to_log2);
    for (int64_t r = 0; r < 16; r++) {
        const float *row = sc + r * nk32;
        uint16_t *hr = phi + r * nk32, *lr = plo + r * nk32;
        const int64_t valid = r < n ? r0 + r + 1 : 0, lo = window_start(valid, window);
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < valid; j += 16) {
            const __mmask16 m = first_lanes16(valid - j) & (__mmask16)~first_lanes16(lo - j);
            mx = _mm512_mask_max_ps(mx, m, mx, _mm512_loadu_ps(row + j));
        }
        const __m512 shift = _mm512_set1_ps(valid ? -_mm512_reduce_max_ps(mx) * to_log2 : 0.0f);
        __m512 total = _mm512_setzero_ps();
        for (int64_t j = 0; j < nk32; j += 16) {  /* keys outside the row's window: p = 0 */
            const __mmask16 m = first_lanes16(valid - j) & (__mmask16)~first_lanes16(lo - j);
            const __m512 p = exp2_nonpositive16(_mm512_fmadd_ps(_mm512_loadu_ps(row + j), vlog2, shift), m);
            total = _mm512_add_ps(total, p);
            /* hi: p's top 16 bits (exact in bf16), lo: the rest, rounded */
            const __m512 hf = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(p), _mm512_set1_epi32((int)0xffff0000u)));
            _mm256_storeu_si256((__m256i *)(hr + j), (__m256i)_mm512_cvtneps_pbh(hf));
            _mm256_storeu_si256((__m256i *)(lr + j), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(p, hf)));
        }
        inv[r] = valid ? 1.0f / _mm512_reduce_add_ps(total) : 0.0f;
    }
    /* P @ V, 64 dims a pass: tiles 0-3 accumulate hi then lo products (back-to-back
     * products into one tile issue as fast as independent ones here), P in 4 (hi) and 5
     * (lo), V's 16-dim tiles in 6 and 7 alternately */
    for (int c0 = 0; c0 < V_CHUNKS; c0 += 4) {
        const int nc = V_CHUNKS - c0 < 4 ? V_CHUNKS - c0 : 4;  /* 2 or 4: HEAD_DIM % 32 == 0 */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t j0 = 0; j0 < nk32; j0 += 32) {
            const uint16_t *vt = vb + (j0 / 32 * V_CHUNKS + c0) * 512;
            _tile_loadd(4, phi + j0, nk32 * 2);
            _tile_loadd(5, plo + j0, nk32 * 2);
            _tile_loadd(6, vt, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(0, 5, 6);
            _tile_loadd(7, vt + 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(1, 5, 7);
            if (nc == 4) {
                _tile_loadd(6, vt + 1024, 64);
                _tile_dpbf16ps(2, 4, 6);
                _tile_dpbf16ps(2, 5, 6);
                _tile_loadd(7, vt + 1536, 64);
                _tile_dpbf16ps(3, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        float o[4][16][16];
        _tile_stored(0, o[0], 64);
        _tile_stored(1, o[1], 64);
        _tile_stored(2, o[2], 64);
        _tile_stored(3, o[3], 64);
        for (int64_t r = 0; r < n; r++) {
            uint16_t *dst = out + (r0 + r) * num_heads * HEAD_DIM + hq * HEAD_DIM + c0 * 16;
            const __m512 iv = _mm512_set1_ps(inv[r]);
            for (int t = 0; t < nc; t++)
                _mm256_storeu_si256((__m256i *)(dst + t * 16),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o[t][r]), iv)));
        }
    }
}

/* The AMX prefill (atomd_prefill_attention_bf16's arguments): 0, -1 (buffers), or 1: no
 * AMX for this process, the caller runs the AVX512_BF16 loop. */
static int prefill_amx(const uint16_t *restrict q, const uint16_t *restrict k, const uint16_t *restrict v,
                       uint16_t *restrict out, const int64_t *restrict seq_starts, const int64_t *restrict seq_lens,
                       int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t q_stride,
                       int64_t k_stride, int64_t v_stride, float scale, int64_t window, int num_threads) {
    if (!amx_granted()) return 1;
    /* keys[s]: sequence s's first key in the tile layouts (32-key padded); first[s]: its first work item */
    int64_t *keys = malloc(sizeof(int64_t) * (num_seqs + 1)), *first = malloc(sizeof(int64_t) * (num_seqs + 1));
    if (keys == NULL || first == NULL) {
        free(keys);
        free(first);
        return -1;
    }
    int64_t longest = 0;
    keys[0] = first[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t padded = (seq_lens[s] + 31) / 32 * 32;
        keys[s + 1] = keys[s] + padded;
        first[s + 1] = first[s] + num_heads * ((seq_lens[s] + 15) / 16);
        longest = padded > longest ? padded : longest;
    }
    if (keys[num_seqs] == 0) {  /* no query rows */
        free(keys);
        free(first);
        return 0;
    }
    const int64_t per_head = keys[num_seqs] * HEAD_DIM;  /* elements of one KV head's tiles */
    uint16_t *kt = calloc((size_t)num_kv_heads * per_head, sizeof(uint16_t));
    uint16_t *vt = calloc((size_t)num_kv_heads * per_head, sizeof(uint16_t));
    if (kt == NULL || vt == NULL) {
        free(kt);
        free(vt);
        free(keys);
        free(first);
        return -1;
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(dynamic, 1) collapse(2)  /* one long prompt: its heads on both threads */
        for (int64_t s = 0; s < num_seqs; s++)
            for (int64_t h = 0; h < num_kv_heads; h++) {
                uint16_t *kd = kt + h * per_head + keys[s] * HEAD_DIM, *vd = vt + h * per_head + keys[s] * HEAD_DIM;
                const __m512i pairs = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                                         _mm512_set1_epi32(16));  /* dim pair p -> its K tile row */
                const __m512i interleave = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                                            39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
                for (int64_t t = 0; t < seq_lens[s]; t++) {  /* K: each 32-dim chunk's 16 dim pairs scattered to their rows */
                    const uint16_t *ks = k + (seq_starts[s] + t) * k_stride + h * HEAD_DIM;
                    for (int c = 0; c < K_CHUNKS; c++)
                        _mm512_i32scatter_epi32(kd + k_tile_index(t, c * 32), pairs, _mm512_loadu_si512(ks + c * 32), 4);
                }
                for (int64_t t = 0; t < seq_lens[s]; t += 2) {  /* V: two tokens' rows interleaved, 16 dims a store */
                    const uint16_t *v0 = v + (seq_starts[s] + t) * v_stride + h * HEAD_DIM, *v1 = v0 + v_stride;
                    const int pair = t + 1 < seq_lens[s];
                    for (int w = 0; w < V_CHUNKS; w++) {
                        const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(v0 + w * 16)));
                        const __m512i b = pair ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(v1 + w * 16)))
                                               : _mm512_setzero_si512();
                        _mm512_storeu_si512(vd + v_tile_index(t, w * 16), _mm512_permutex2var_epi16(a, interleave, b));
                    }
                }
            }
        float *sc = malloc(sizeof(float) * 16 * longest);
        uint16_t *phi = malloc(sizeof(uint16_t) * 16 * longest), *plo = malloc(sizeof(uint16_t) * 16 * longest);
        const int ready = sc != NULL && phi != NULL && plo != NULL;
        if (ready) {
            amx_configure();
        } else {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = first[num_seqs] - 1; item >= 0; item--) {  /* the longest (last) rows first */
            if (!ready) continue;
            int64_t s = 0;
            while (first[s + 1] <= item) s++;
            const int64_t tiles = (seq_lens[s] + 15) / 16, hq = (item - first[s]) / tiles;
            const int64_t r0 = (item - first[s]) % tiles * 16, n = seq_lens[s] - r0 < 16 ? seq_lens[s] - r0 : 16;
            const int64_t base = seq_starts[s], h = hq / GROUP;
            prefill_tile_amx(q + base * q_stride, kt + h * per_head + keys[s] * HEAD_DIM,
                             vt + h * per_head + keys[s] * HEAD_DIM, out + base * num_heads * HEAD_DIM, r0, n, hq,
                             num_heads, q_stride, scale, window, sc, phi, plo);
        }
        if (ready) _tile_release();
        free(sc);
        free(phi);
        free(plo);
    }
    free(kt);
    free(vt);
    free(keys);
    free(first);
    return failed ? -1 : 0;
}
#else
#define AMX_PATH 0
#endif

/* 1 when the bf16 prefill runs on AMX tiles here: the build has them and Linux grants them. */
int atomd_prefill_amx(void) {
#if AMX_PATH
    return amx_granted();
#else
    return 0;
#endif
}

/* atomd_prefill_attention over bf16: the same arguments, q, k, v and out bf16. */
int atomd_prefill_attention_bf16(const uint16_t *restrict q, const uint16_t *restrict k, const uint16_t *restrict v,
                                  uint16_t *restrict out, const int64_t *restrict seq_starts,
                                  const int64_t *restrict seq_lens, int64_t num_seqs, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t q_stride, int64_t k_stride, int64_t v_stride,
                                  float scale, int64_t window, int num_threads) {
#if AMX_PATH
    const int amx = prefill_amx(q, k, v, out, seq_starts, seq_lens, num_seqs, num_heads, num_kv_heads, q_stride,
                                k_stride, v_stride, scale, window, num_threads);
    if (amx <= 0) return amx;
#endif
    int64_t rows = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        rows = seq_starts[s] + seq_lens[s] > rows ? seq_starts[s] + seq_lens[s] : rows;
    const int64_t kt_stride = rows + KT;
    kt_t *kt = calloc((size_t)num_kv_heads * HEAD_DIM * kt_stride, sizeof(kt_t));
    int64_t *first = malloc(sizeof(int64_t) * (num_seqs + 1));
    if (kt == NULL || first == NULL) {
        free(kt);
        free(first);
        return -1;
    }
    first[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        first[s + 1] = first[s] + num_kv_heads * ((seq_lens[s] + QT - 1) / QT);
#pragma omp parallel for num_threads(num_threads)
    for (int64_t t = 0; t < rows; t++)
        for (int64_t h = 0; h < num_kv_heads; h++)
            for (int d = 0; d < HEAD_DIM; d++) {
                const uint16_t x = k[t * k_stride + h * HEAD_DIM + d];
#if BF16_DOT
                kt[h * HEAD_DIM * kt_stride + ((d / 2) * kt_stride + t) * 2 + (d & 1)] = x;
#else
                kt[(h * HEAD_DIM + d) * kt_stride + t] = bf16_to_f32(x);
#endif
            }
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = first[num_seqs] - 1; item >= 0; item--) {
        int64_t s = 0;
        while (first[s + 1] <= item) s++;
        const int64_t tiles = (seq_lens[s] + QT - 1) / QT, h = (item - first[s]) / tiles;
        const int64_t r0 = (item - first[s]) % tiles * QT, n = seq_lens[s] - r0 < QT ? seq_lens[s] - r0 : QT;
        const int64_t base = seq_starts[s];
        prefill_item_bf16(q + base * q_stride, kt + h * HEAD_DIM * kt_stride + base * (BF16_DOT ? 2 : 1),
                          v + base * v_stride, out + base * num_heads * HEAD_DIM, r0, n, h, num_heads, q_stride,
                          kt_stride, v_stride, scale, window);
    }
    free(kt);
    free(first);
    return 0;
}
