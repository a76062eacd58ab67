/* Attention kernels, float32 and bfloat16 (and decode over a narrower KV cache: fp8, or 16 bits under float32), loaded by atomd/kernels/native.py (the parts: below):
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
#include <string.h>

#include "fast_exp.h"

#if !defined(HEAD_DIM) || !defined(GROUP)
#error "build with -DHEAD_DIM=<head_dim> -DGROUP=<query heads per KV head>"
#endif

/* The kernels, one file each, in the order they build on one another:
 * attention_common.h  the sliding window's first key, the cache formats, prefetches, AVX-512 lane masks and sums
 * attention_avx2.h    the decode row on AVX2 builds, over every cache format (float32, bf16, float16, fp8)
 * attention_narrow.h  the decode row elsewhere, over every cache format, and the float32-query decode over
 *                     each (the model's float32 cache; a narrower one: fp8 e4m3 / e5m2, bf16 or float16)
 * attention_f32.h     float32 decode (paged cache) and prefill (fresh prompts)
 * attention_bf16.h    the same over bf16 (AVX512_BF16 dot products or widening to float32)
 * attention_amx.h     the bf16 prefill as AMX tile matmuls (Sapphire Rapids and later)
 * and below them the bf16 prefill's entry point, which picks AMX or the loop. */
#include "attention_common.h"
#include "attention_avx2.h"
#include "attention_narrow.h"
#include "attention_f32.h"
#include "attention_bf16.h"
#include "attention_amx.h"

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
