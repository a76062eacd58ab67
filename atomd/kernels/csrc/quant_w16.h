/* Part of quant.c: 16-bit float weights (bfloat16 or float16, quant.h's row_w16 layout: uint16 [N, K])
 * times many rows of float32 x, float32 out, on AVX-512: prefill with `--quantization bf16 / fp16`
 * where the compute is float32 (a CPU without AVX512_BF16 / AMX; quant.py's QGEMM_W16_MIN_M).
 *
 * BLIS's loops with the roles turned round (the weight is the vector operand, x the broadcast one), x read
 * in place as oneDNN's brgemm reads its A:
 * - each thread owns a run of 32-row weight panels (N split across the threads, never M: no two
 *   threads write one output);
 * - per k-block of at most W16_KC inputs (K split evenly) and per block of as many of its panels as fill
 *   W16_BLOCK_FLOATS, the weight is widened (exactly) and packed once into a per-thread float32 buffer that
 *   stays in L2: panels [32 rows][kc] transposed to [kc][32] (16 x 16 in-register transposes);
 * - for every W16_MR rows of x (M split into slivers of even size, so no sliver of 1 or 2 rows), each
 *   panel of the block through the micro-kernel: W16_MR x 32 outputs in 2 x W16_MR zmm accumulators; per
 *   input two weight vectors loaded (the panel streams from L2, prefetched W16_PREFETCH bytes ahead) and
 *   one x value per row broadcast from x's own rows, 2 x W16_MR FMAs; the next tile's output rows
 *   prefetched during the first W16_MR inputs.
 * The output is the accumulator: zeroed at the first k-block, loaded and stored at each later one (so
 * long k-blocks: K <= 1024 is one pass), so every y[m, n] is one chain of FMAs over k = 0..K-1 in order:
 * its bits do not depend on M, the threads or the blocking (only on x's row and w's row). A BLAS sums in
 * another order: results agree with a float matmul to float32 rounding, not bit for bit. Edges: rows of x
 * past M are never computed (the micro-kernel's row count is a compile-time 1..W16_MR), weight rows past N
 * are packed as zeros and their outputs masked off, any K. Measured against oneDNN's float32 linear on a
 * packed weight: benchmarks/qlinear_16.py (RESULTS.md, #35 16-bit weights' prefill on the VNNI kind). */
#if QUANT_PATH == 2
#include <omp.h>
#include <stdlib.h>

#include "lane_sums.h" /* transpose16 */
#define W16_PANELS 1
#define W16_MR 14     /* rows of x per micro-kernel: 28 accumulators + 2 weight vectors + a broadcast */
#define W16_NR 32     /* weight rows per panel: two vectors */
#define W16_KC 1024   /* inputs per k-block at most (blocks of 256 with x packed into L1: ~5% slower at K 1536 / 3072) */
#define W16_BLOCK_FLOATS (1 << 18)  /* a packed block of panels: 1 MiB (L2) */
#define W16_PREFETCH 1024  /* bytes of the panel ahead of the micro-kernel's loads (8 inputs) */

/* per thread: the packed weight block, kept between calls (a fresh 1 MiB malloc each
 * call would be mapped and faulted in again) */
static _Thread_local float *w16_buf;
static _Thread_local size_t w16_cap;

static float *w16_scratch(size_t floats) {
    if (floats > w16_cap) {
        free(w16_buf);
        w16_buf = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        w16_cap = w16_buf ? floats : 0;
    }
    return w16_buf;
}

static inline __attribute__((always_inline)) __m512 w16_load(const uint16_t *p, const int f16) {
    return f16 ? load_h16(p) : load_b16(p);
}

/* weight rows 0..nn (q: the block's first row, row stride K), inputs k0..k0 + kc, widened into bp as
 * panels [ceil(nn / 32)][kc][32]; rows past nn zeros */
static void w16_pack(const uint16_t *q, int64_t K, int64_t nn, int64_t k0, int64_t kc, const int f16, float *bp) {
    for (int64_t r0 = 0; r0 < (nn + W16_NR - 1) / W16_NR * W16_NR; r0 += 16) {
        float *dst = bp + r0 / W16_NR * kc * W16_NR + r0 % W16_NR;
        const int rows = nn - r0 < 16 ? (int)(nn - r0) : 16;
        const uint16_t *src = q + r0 * K + k0;
        int64_t k = 0;
        for (; k + 16 <= kc; k += 16) {
            __m512 v[16];
            for (int i = 0; i < 16; i++) v[i] = i < rows ? w16_load(src + i * K + k, f16) : _mm512_setzero_ps();
            transpose16(v);
            for (int i = 0; i < 16; i++) _mm512_store_ps(dst + (k + i) * W16_NR, v[i]);
        }
        for (; k < kc; k++)
            for (int i = 0; i < 16; i++)
                dst[k * W16_NR + i] = i >= rows ? 0.0f : f16 ? h16_to_float(src[i * K + k]) : b16_to_float(src[i * K + k]);
    }
}

/* y[0..MR, 0..32] (masks m0 / m1: the panel's weight rows below N) = (first ? 0 : y) + x . bp over kc
 * inputs (x: MR rows of stride ldx); yn: the next tile's first output, prefetched */
#define W16_TILE(MR)                                                                                               \
    static __attribute__((noinline)) void w16_tile_##MR(const float *x, int64_t ldx, const float *bp, int64_t kc,  \
                                                         float *y, int64_t ldy, int first, __mmask16 m0,            \
                                                         __mmask16 m1, const float *yn) {                           \
        __m512 c0[MR], c1[MR];                                                                                     \
        const float *xr[MR];                                                                                       \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                                    \
            xr[i] = x + i * ldx;                                                                                   \
            c0[i] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m0, y + i * ldy);                          \
            c1[i] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m1, y + i * ldy + 16);                     \
        }                                                                                                          \
        for (int64_t k = 0; k < kc; k++) {                                                                         \
            _mm_prefetch((const char *)(bp + k * W16_NR) + W16_PREFETCH, _MM_HINT_T0);                             \
            _mm_prefetch((const char *)(bp + k * W16_NR) + W16_PREFETCH + 64, _MM_HINT_T0);                        \
            if (k < MR) {                                                                                          \
                _mm_prefetch((const char *)(yn + k * ldy), _MM_HINT_T0);                                           \
                _mm_prefetch((const char *)(yn + k * ldy + 16), _MM_HINT_T0);                                      \
            }                                                                                                      \
            const __m512 b0 = _mm512_load_ps(bp + k * W16_NR), b1 = _mm512_load_ps(bp + k * W16_NR + 16);           \
            _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                                \
                const __m512 a = _mm512_set1_ps(xr[i][k]);                                                         \
                c0[i] = _mm512_fmadd_ps(a, b0, c0[i]);                                                             \
                c1[i] = _mm512_fmadd_ps(a, b1, c1[i]);                                                             \
            }                                                                                                      \
        }                                                                                                          \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                                    \
            _mm512_mask_storeu_ps(y + i * ldy, m0, c0[i]);                                                         \
            _mm512_mask_storeu_ps(y + i * ldy + 16, m1, c1[i]);                                                    \
        }                                                                                                          \
    }
W16_TILE(1) W16_TILE(2) W16_TILE(3) W16_TILE(4) W16_TILE(5) W16_TILE(6) W16_TILE(7)
W16_TILE(8) W16_TILE(9) W16_TILE(10) W16_TILE(11) W16_TILE(12) W16_TILE(13) W16_TILE(14)
typedef void (*w16_tile_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, int, __mmask16,
                            __mmask16, const float *);
static const w16_tile_fn w16_tiles[W16_MR + 1] = {NULL, w16_tile_1, w16_tile_2, w16_tile_3, w16_tile_4,
                                                  w16_tile_5, w16_tile_6, w16_tile_7, w16_tile_8, w16_tile_9,
                                                  w16_tile_10, w16_tile_11, w16_tile_12, w16_tile_13, w16_tile_14};

static inline __mmask16 w16_mask(int64_t cols) { return cols >= 16 ? 0xffff : cols <= 0 ? 0 : (__mmask16)((1u << cols) - 1); }

/* y [M, ldy] = x [M, ldx] @ w^T, w uint16 [N, K] of bf16 (f16 0) or float16 (f16 1) values.
 * 0 done, -1 out of memory (a thread's 1 MiB buffer) */
static int w16_gemm(const float *x, int64_t ldx, int64_t M, const uint16_t *q, const int f16, int64_t N, int64_t K,
                    float *y, int64_t ldy, int num_threads) {
    const int64_t panels = (N + W16_NR - 1) / W16_NR, nkb = (K + W16_KC - 1) / W16_KC;
    const int64_t kcs = (K + nkb - 1) / nkb, slivers = (M + W16_MR - 1) / W16_MR;  /* k-blocks of even size */
    const int64_t per_block = W16_BLOCK_FLOATS / (kcs * W16_NR) > 0 ? W16_BLOCK_FLOATS / (kcs * W16_NR) : 1;
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads) reduction(|: failed)") {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t pb = panels * t / nt, pe = panels * (t + 1) / nt;
        float *bp = pe > pb ? w16_scratch((size_t)W16_BLOCK_FLOATS) : NULL;
        if (pe > pb && bp == NULL) failed = 1;
        for (int64_t k0 = 0; bp && k0 < K; k0 += kcs) {
            const int64_t kc = K - k0 < kcs ? K - k0 : kcs;
            for (int64_t p0 = pb; p0 < pe; p0 += per_block) {
                const int64_t p1 = p0 + per_block < pe ? p0 + per_block : pe;
                const int64_t n0 = p0 * W16_NR, nn = (p1 * W16_NR < N ? p1 * W16_NR : N) - n0;
                w16_pack(q + n0 * K, K, nn, k0, kc, f16, bp);
                for (int64_t s = 0; s < slivers; s++) {
                    const int64_t m0 = M * s / slivers, m1 = M * (s + 1) / slivers;
                    for (int64_t p = p0; p < p1; p++) {
                        const int64_t cols = N - p * W16_NR;
                        const float *yn = p + 1 < p1 ? y + m0 * ldy + (p + 1) * W16_NR : y + (m1 < M ? m1 : m0) * ldy + p0 * W16_NR;
                        w16_tiles[m1 - m0](x + m0 * ldx + k0, ldx, bp + (p - p0) * kc * W16_NR, kc, y + m0 * ldy + p * W16_NR,
                                           ldy, k0 == 0, w16_mask(cols), w16_mask(cols - 16), yn);
                    }
                }
            }
        }
    }
    return failed ? -1 : 0;
}
#endif
