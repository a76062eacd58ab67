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

/* y[0..MR, 0..32] (masks m0 / m1: the panel's weight rows below N) = (first ? 0 : y) + x . panel over kc
 * inputs (x: MR rows of stride ldx); yn: the next tile's first output, prefetched. One instance per panel
 * layout (B_T its element type, LOAD_B the two weight vectors of input k): the per-call float32 panels
 * (w16_pack), or a weight's 16-bit panels packed once at load (w16_prepack, widened here in registers). */
#define W16_TILE(NAME, MR, B_T, LOAD_B, PREFETCH_B)                                                                \
    static __attribute__((noinline)) void NAME##_##MR(const float *x, int64_t ldx, const void *panel, int64_t kc,  \
                                                       float *y, int64_t ldy, int first, __mmask16 m0,              \
                                                       __mmask16 m1, const float *yn) {                             \
        const B_T *bp = (const B_T *)panel;                                                                        \
        __m512 c0[MR], c1[MR];                                                                                     \
        const float *xr[MR];                                                                                       \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                                    \
            xr[i] = x + i * ldx;                                                                                   \
            c0[i] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m0, y + i * ldy);                          \
            c1[i] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m1, y + i * ldy + 16);                     \
        }                                                                                                          \
        for (int64_t k = 0; k < kc; k++) {                                                                         \
            PREFETCH_B(bp + k * W16_NR)                                                                            \
            if (k < MR) {                                                                                          \
                _mm_prefetch((const char *)(yn + k * ldy), _MM_HINT_T0);                                           \
                _mm_prefetch((const char *)(yn + k * ldy + 16), _MM_HINT_T0);                                      \
            }                                                                                                      \
            __m512 b0, b1;                                                                                         \
            LOAD_B(bp + k * W16_NR, b0, b1)                                                                        \
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
#define W16_TILES(NAME, B_T, LOAD_B, PREFETCH_B)                                                                   \
    W16_TILE(NAME, 1, B_T, LOAD_B, PREFETCH_B) W16_TILE(NAME, 2, B_T, LOAD_B, PREFETCH_B)                          \
    W16_TILE(NAME, 3, B_T, LOAD_B, PREFETCH_B) W16_TILE(NAME, 4, B_T, LOAD_B, PREFETCH_B)                          \
    W16_TILE(NAME, 5, B_T, LOAD_B, PREFETCH_B) W16_TILE(NAME, 6, B_T, LOAD_B, PREFETCH_B)                          \
    W16_TILE(NAME, 7, B_T, LOAD_B, PREFETCH_B) W16_TILE(NAME, 8, B_T, LOAD_B, PREFETCH_B)                          \
    W16_TILE(NAME, 9, B_T, LOAD_B, PREFETCH_B) W16_TILE(NAME, 10, B_T, LOAD_B, PREFETCH_B)                         \
    W16_TILE(NAME, 11, B_T, LOAD_B, PREFETCH_B) W16_TILE(NAME, 12, B_T, LOAD_B, PREFETCH_B)                        \
    W16_TILE(NAME, 13, B_T, LOAD_B, PREFETCH_B) W16_TILE(NAME, 14, B_T, LOAD_B, PREFETCH_B)                        \
    static const w16_tile_fn NAME##s[W16_MR + 1] = {NULL, NAME##_1, NAME##_2, NAME##_3, NAME##_4, NAME##_5,        \
                                                    NAME##_6, NAME##_7, NAME##_8, NAME##_9, NAME##_10, NAME##_11,  \
                                                    NAME##_12, NAME##_13, NAME##_14};
typedef void (*w16_tile_fn)(const float *, int64_t, const void *, int64_t, float *, int64_t, int, __mmask16,
                            __mmask16, const float *);
/* float32 panels [kc][32]: two vectors an input, two 64-byte lines prefetched */
#define W16_LOAD_F32(p, b0, b1) b0 = _mm512_load_ps(p), b1 = _mm512_load_ps((p) + 16);
#define W16_PREFETCH_F32(p)                                                         \
    _mm_prefetch((const char *)(p) + W16_PREFETCH, _MM_HINT_T0);                    \
    _mm_prefetch((const char *)(p) + W16_PREFETCH + 64, _MM_HINT_T0);
/* bf16 panels packed at load, one 64-byte line an input: 32-bit lane j holds weight row j in its low half and
 * row j + 16 in its high half, so each widens with one instruction (a bf16 is a float32's top 16 bits) */
#define W16_LOAD_B16(p, b0, b1) {                                                                       \
        const __m512i v = _mm512_load_si512((const void *)(p));                                          \
        b0 = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));                                             \
        b1 = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u))); }
/* float16 panels packed at load: rows 0..31 in order */
#define W16_LOAD_H16(p, b0, b1) b0 = load_h16(p), b1 = load_h16((p) + 16);
#define W16_PREFETCH_16(p) _mm_prefetch((const char *)(p) + W16_PREFETCH / 2, _MM_HINT_T0);
W16_TILES(w16_tile, float, W16_LOAD_F32, W16_PREFETCH_F32)
W16_TILES(w16_tile_b16, uint16_t, W16_LOAD_B16, W16_PREFETCH_16)
W16_TILES(w16_tile_h16, uint16_t, W16_LOAD_H16, W16_PREFETCH_16)

static inline __mmask16 w16_mask(int64_t cols) { return cols >= 16 ? 0xffff : cols <= 0 ? 0 : (__mmask16)((1u << cols) - 1); }

/* y [M, ldy] = x [M, ldx] @ w^T, w uint16 [N, K] of bf16 (f16 0) or float16 (f16 1) values; pre: the same weight
 * as w16_prepack packed it (NULL: packed here, per k-block, into each thread's buffer). The same sums either way.
 * 0 done, -1 out of memory (a thread's 1 MiB buffer) */
static int w16_gemm(const float *x, int64_t ldx, int64_t M, const uint16_t *q, const uint16_t *pre, const int f16,
                    int64_t N, int64_t K, float *y, int64_t ldy, int num_threads) {
    const int64_t panels = (N + W16_NR - 1) / W16_NR, nkb = (K + W16_KC - 1) / W16_KC;
    const int64_t kcs = (K + nkb - 1) / nkb, slivers = (M + W16_MR - 1) / W16_MR;  /* k-blocks of even size */
    const int64_t per_block = W16_BLOCK_FLOATS / (kcs * W16_NR) > 0 ? W16_BLOCK_FLOATS / (kcs * W16_NR) : 1;
    const w16_tile_fn *tiles = pre == NULL ? w16_tiles : f16 ? w16_tile_h16s : w16_tile_b16s;
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads) reduction(|: failed)") {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t pb = panels * t / nt, pe = panels * (t + 1) / nt;
        float *bp = pe > pb && pre == NULL ? w16_scratch((size_t)W16_BLOCK_FLOATS) : NULL;
        if (pe > pb && pre == NULL && bp == NULL) failed = 1;
        for (int64_t k0 = 0; !failed && k0 < K; k0 += kcs) {
            const int64_t kc = K - k0 < kcs ? K - k0 : kcs;
            for (int64_t p0 = pb; p0 < pe; p0 += per_block) {
                const int64_t p1 = p0 + per_block < pe ? p0 + per_block : pe;
                const int64_t n0 = p0 * W16_NR, nn = (p1 * W16_NR < N ? p1 * W16_NR : N) - n0;
                if (pre == NULL) w16_pack(q + n0 * K, K, nn, k0, kc, f16, bp);
                for (int64_t s = 0; s < slivers; s++) {
                    const int64_t m0 = M * s / slivers, m1 = M * (s + 1) / slivers;
                    for (int64_t p = p0; p < p1; p++) {
                        const int64_t cols = N - p * W16_NR;
                        const float *yn = p + 1 < p1 ? y + m0 * ldy + (p + 1) * W16_NR : y + (m1 < M ? m1 : m0) * ldy + p0 * W16_NR;
                        const void *panel = pre ? (const void *)(pre + (p * K + k0) * W16_NR)
                                                : (const void *)(bp + (p - p0) * kc * W16_NR);
                        tiles[m1 - m0](x + m0 * ldx + k0, ldx, panel, kc, y + m0 * ldy + p * W16_NR, ldy, k0 == 0,
                                       w16_mask(cols), w16_mask(cols - 16), yn);
                    }
                }
            }
        }
    }
    return failed ? -1 : 0;
}

/* w uint16 [N, K] (bf16: f16 0, float16: 1) into out uint16 [ceil(N / 32)][K][32], w16_gemm's `pre`: per panel
 * of 32 weight rows, each input's 32 values in one 64-byte line (bf16: row j and row j + 16 share lane j, as
 * W16_LOAD_B16 reads them; float16: rows in order); rows past N zeros. Once, at load (quant.prepack_panels). */
static void w16_prepack(const uint16_t *q, int64_t N, int64_t K, const int f16, uint16_t *out, int num_threads) {
    const int64_t panels = (N + W16_NR - 1) / W16_NR;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t p = 0; p < panels; p++)
        for (int64_t j = 0; j < W16_NR; j++) {
            const int64_t n = p * W16_NR + j, slot = f16 ? j : j < 16 ? 2 * j : 2 * (j - 16) + 1;
            uint16_t *dst = out + p * K * W16_NR + slot;
            for (int64_t k = 0; k < K; k++) dst[k * W16_NR] = n < N ? q[n * K + k] : 0;
        }
}
#endif
