/* Part of layer_ops.c's translation unit, included by it only (after the bf16 row helpers:
 * silu_mul_row_bf16, round16, to_bf16).
 *
 * atomd_moe_amx_bf16: an MoE block's experts over several tokens (atomd/model/moe.py moe()
 * and the TP partials) as AMX tile matmuls, atomd_moe_grouped_bf16's arguments and results
 * (rounded where the per-expert torch ops round: gate_up's output, silu's, the down output,
 * the scaled pair) over expert weights packed once for the tiles (layer_ops.pack_amx):
 * each [N, K] weight as [N / 16][K / 32][16 k pairs][16 n][2], so one 16 x 32 block of
 * it is one 1 KB tile B operand, contiguous.
 *
 * Why: on an AMX CPU (Sapphire Rapids and later) one tile product multiplies 16 rows by
 * 32 x 16 weights; the grouped GEMV kernel's dot products (AVX512_BF16) and torch's one
 * oneDNN GEMM pair per expert (whose weights are reordered for the tiles at every call)
 * both left the experts of a prefill and of a batch-16 decode step well below what the
 * tiles do (benchmarks/moe_block.py). Work items are (expert, up to AMX_CHUNK of its rows):
 * each gathers its token rows into a thread-owned buffer, runs gate_up over blocks of 32
 * rows x 32 outputs (tiles 0-3 accumulate, 4-5 hold two 16-row A tiles, 6-7 two B tiles;
 * in bf16 a block is 16 gate outputs and the matching 16 up ones, SiLU-and-mul on its sums
 * straight into down's A tiles), then down the same way, and writes each pair's row; weight
 * blocks the outer loop, a block's products issued before the previous block's sums are
 * finished (amx_item).
 * Returns 0, -1 (no scratch memory) or 1 (no AMX for this process: the caller runs the
 * grouped kernel). hidden and inter: multiples of 32. */
#if BF16_CVT && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <stdlib.h>

#include "amx.h"
#include "moe_items.h"
#define MOE_AMX 1
#define AMX_CHUNK 128 /* rows an item: an expert's weights are re-read from cache once a chunk */

/* Row r (K elements, or zeros where row is NULL) into the A tile layout at `tiles`:
 * [rows / 16][K / 32][16][32] */
static inline void amx_put_row(bf16_t *tiles, int64_t r, const bf16_t *row, int64_t K) {
    bf16_t *dst = tiles + (r / 16) * K * 16 + (r % 16) * 32;
    for (int64_t c = 0; c < K / 32; c++) {
        if (row) memcpy(dst + c * 512, row + c * 32, 64);
        else memset(dst + c * 512, 0, 64);
    }
}

/* One work item: m rows (already in xa's A tile layout, rows m.. up to a multiple of 16 zeros) through
 * one expert's packed weights wg [2 inter, hidden] and wd [hidden, inter] (pack_amx's layout): gate_up,
 * SiLU-and-mul, down, pair p0 + r's row into pairs (f32_pairs as atomd_moe_amx_bf16's). is_bf16 (a
 * constant after inlining): rounded where the per-expert torch ops round (gate_up's output, silu's,
 * the down output, the scaled pair); 0 (moe_q8.h's widened int8 / int4 experts of a float32 model):
 * gate_up's output and SiLU-and-mul in float32, the product rounded to bf16 for the down tiles, the
 * down output unrounded. Scratch: gu [m, 2 inter] (float32 where !is_bf16; unused where is_bf16), act the
 * products' A tiles, row inter floats then inter bf16, blk 1024 floats (the second sum buffer on the stack).
 * Tiles as amx_configure sets them. */
static inline __attribute__((always_inline)) void amx_item(const bf16_t *xa, int64_t m, const bf16_t *wg,
                                                           const bf16_t *wd, int64_t hidden, int64_t inter,
                                                           const int is_bf16, void *gu, bf16_t *act, float *row,
                                                           float *blk, int64_t p0, const int64_t *dest,
                                                           const void *scales, void *pairs, int f32_pairs) {
    const int64_t n_gu = 2 * inter, kc_gu = hidden / 32, kc_down = inter / 32, m16 = (m + 15) / 16 * 16;
    bf16_t *row16 = (bf16_t *)(row + inter);
    /* Software-pipelined: a block's tile products are issued, then the previous block's sums (stored into the
     * other half of bufs) are finished on the vector units while the tiles work, then this block's stored. */
    float spare[1024] __attribute__((aligned(64)));
    float *bufs[2] = {blk, spare};
    int64_t at = -1, prev_nb = 0, prev_m0 = 0;
    if (is_bf16) {  /* gate block j beside up block j: SiLU-and-mul on the tile sums, straight into act's tiles */
        for (int64_t nb = 0; nb <= inter / 16; nb++) {
            for (int64_t m0 = 0; m0 < m16; m0 += 32) {
                const int two = m16 - m0 > 16;
                if (nb < inter / 16)
                    amx_products(xa + m0 * hidden, two, wg + nb * kc_gu * 512, wg + (inter / 16 + nb) * kc_gu * 512,
                                 kc_gu);
                if (at >= 0) {
                    const float *done = bufs[at & 1];
                    for (int h = 0; h < (m16 - prev_m0 > 16 ? 2 : 1); h++) {
                        /* rows prev_m0 + 16 h .., outputs 16 prev_nb .. of act (rows past m: zeros) */
                        bf16_t *dst = act + (prev_m0 + 16 * h) * inter + (prev_nb / 2) * 512 + (prev_nb % 2) * 16;
                        for (int64_t r = 0; r < 16; r++) {
                            if (prev_m0 + 16 * h + r >= m) {  /* padding rows (a decode step's items: most of the 16) */
                                _mm256_storeu_si256((__m256i *)(dst + r * 32), _mm256_setzero_si256());
                                continue;
                            }
                            const __m512 g = round16(_mm512_loadu_ps(done + 512 * h + r * 16));
                            const __m512 u = round16(_mm512_loadu_ps(done + 512 * h + 256 + r * 16));
                            _mm256_storeu_si256((__m256i *)(dst + r * 32),
                                                to_bf16(_mm512_mul_ps(round16(silu16(g)), u)));
                        }
                    }
                }
                if (nb == inter / 16) break;
                amx_store(two, bufs[++at & 1]);
                prev_nb = nb, prev_m0 = m0;
            }
        }
    } else {
    for (int64_t m0 = 0; m0 < m16; m0 += 32) {  /* gate_up (rounded to bf16 as torch's linear in bf16) */
        const int two = m16 - m0 > 16;
        for (int64_t nb = 0; nb < n_gu / 16; nb += 2) {
            amx_block(xa + m0 * hidden, two, wg + nb * kc_gu * 512, wg + (nb + 1) * kc_gu * 512, kc_gu, blk);
            for (int t = 0; t < (two ? 4 : 2); t++)
                for (int64_t r = 0; r < 16 && m0 + 16 * (t / 2) + r < m; r++) {
                    const int64_t at = (m0 + 16 * (t / 2) + r) * n_gu + (nb + t % 2) * 16;
                    const __m512 v = _mm512_loadu_ps(blk + t * 256 + r * 16);
                    if (is_bf16)
                        _mm256_storeu_si256((__m256i *)((bf16_t *)gu + at), to_bf16(v));
                    else
                        _mm512_storeu_ps((float *)gu + at, v);
                }
        }
    }
    for (int64_t r = 0; r < m16; r++) {
        if (r < m && is_bf16) {
            silu_mul_row_bf16((const bf16_t *)gu + r * n_gu, row16, inter);
        } else if (r < m) {
            silu_mul_row((const char *)((const float *)gu + r * n_gu), (char *)row, inter, 0);
            for (int64_t i = 0; i < inter; i += 16) _mm256_storeu_si256((__m256i *)(row16 + i), to_bf16(_mm512_loadu_ps(row + i)));
        }
        amx_put_row(act, r, r < m ? row16 : NULL, inter);
    }
    }
    at = -1;
    for (int64_t nb = 0; nb <= hidden / 16; nb += 2) {  /* down, each pair's row (rounded,) scaled (, rounded) */
        for (int64_t m0 = 0; m0 < m16; m0 += 32) {
            const int two = m16 - m0 > 16;
            if (nb < hidden / 16)
                amx_products(act + m0 * inter, two, wd + nb * kc_down * 512, wd + (nb + 1) * kc_down * 512, kc_down);
            if (at >= 0) {
                const float *done = bufs[at & 1];
                const int64_t rows = m - prev_m0 < 32 ? m - prev_m0 : 32;
                if (!f32_pairs) {  /* bf16 pairs: a row's two 16-output blocks are one 64-byte line of it */
                    for (int64_t r = 0; r < rows; r++) {
                        const int64_t p = p0 + prev_m0 + r;
                        const float *y = done + (r / 16) * 512 + (r % 16) * 16;
                        const __m512 s = _mm512_set1_ps(bf16_to_float(((const bf16_t *)scales)[p]));
                        _mm512_storeu_si512((bf16_t *)pairs + dest[p] * hidden + prev_nb * 16,
                                            (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(round16(_mm512_loadu_ps(y + 256)), s),
                                                                         _mm512_mul_ps(round16(_mm512_loadu_ps(y)), s)));
                    }
                } else {
                    for (int64_t r = 0; r < rows; r++)
                        for (int t = 0; t < 2; t++) {
                            const int64_t p = p0 + prev_m0 + r, col = dest[p] * hidden + (prev_nb + t) * 16;
                            const __m512 y = _mm512_loadu_ps(done + (r / 16) * 512 + t * 256 + (r % 16) * 16);
                            if (f32_pairs == 2)
                                _mm512_storeu_ps((float *)pairs + col, y);
                            else
                                _mm512_storeu_ps((float *)pairs + col, _mm512_mul_ps(is_bf16 ? round16(y) : y,
                                                                                     _mm512_set1_ps(((const float *)scales)[p])));
                        }
                }
            }
            if (nb == hidden / 16) break;
            amx_store(two, bufs[++at & 1]);
            prev_nb = nb, prev_m0 = m0;
        }
    }
}

int atomd_moe_amx_bf16(const bf16_t *x, const bf16_t *gate_up, const bf16_t *down, const int64_t *experts,
                       const int64_t *starts, const int64_t *tokens, const int64_t *dest, const void *scales,
                       void *pairs, int f32_pairs, int64_t hidden, int64_t inter, int64_t n_experts,
                       int num_threads) {
    if (!amx_granted()) return 1;
    int64_t items, max_rows;
    int64_t *item_g = moe_items(starts, n_experts, AMX_CHUNK, &items, &max_rows);
    if (item_g == NULL) return -1;
    const int64_t n_gu = 2 * inter;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* thread-owned: the rows (xa), gate_up's output (gu), the activations (act), one row, one block's sums */
        bf16_t *xa = malloc(sizeof(bf16_t) * AMX_CHUNK * (hidden + n_gu + inter));
        float *blk = malloc(sizeof(float) * (1024 + 2 * inter));
        const int ready = amx_thread_ready(xa != NULL && blk != NULL, &failed);
        bf16_t *gu = xa + AMX_CHUNK * hidden, *act = gu + AMX_CHUNK * n_gu;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!ready) continue;
            const int64_t g = item_g[it];
            int64_t p0;
            const int64_t m = moe_item_rows(item_g, starts, it, AMX_CHUNK, &p0);
            for (int64_t r = 0; r < (m + 15) / 16 * 16; r++)  /* rows past m: zeros (their outputs are dropped) */
                amx_put_row(xa, r, r < m ? x + tokens[p0 + r] * hidden : NULL, hidden);
            amx_item(xa, m, gate_up + experts[g] * n_gu * hidden, down + experts[g] * hidden * inter, hidden, inter,
                     1, gu, act, blk + 1024, blk, p0, dest, scales, pairs, f32_pairs);
        }
        if (ready) _tile_release();
        free(xa);
        free(blk);
    }
    free(item_g);
    return failed ? -1 : 0;
}
#else
#define MOE_AMX 0
int atomd_moe_amx_bf16(const bf16_t *x, const bf16_t *gate_up, const bf16_t *down, const int64_t *experts,
                       const int64_t *starts, const int64_t *tokens, const int64_t *dest, const void *scales,
                       void *pairs, int f32_pairs, int64_t hidden, int64_t inter, int64_t n_experts,
                       int num_threads) {
    (void)x, (void)gate_up, (void)down, (void)experts, (void)starts, (void)tokens, (void)dest, (void)scales;
    (void)pairs, (void)f32_pairs, (void)hidden, (void)inter, (void)n_experts, (void)num_threads;
    return 1;
}
#endif

/* 1 where atomd_moe_amx_bf16 runs: built with AMX tiles and the process granted their state */
int atomd_moe_amx_kind(void) {
#if MOE_AMX
    return amx_granted();
#else
    return 0;
#endif
}
