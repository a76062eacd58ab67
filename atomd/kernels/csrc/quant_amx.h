/* Part of quant.c (and of layer_ops.c, whose int8 MoE experts, moe_q8.h, run its n-tiles): int8 /
 * int4 weights times int8 activations as AMX-INT8 tile matmuls (Sapphire Rapids and later), for
 * M >= 2 rows of x: batch decode and prefill alike.
 *
 * The same numbers as quant.h's int8-activation rows: x quantised per act block of AB inputs
 * exactly as quantize_row_q8 does (the same int8 values, d and xsg), each act block's integer dot
 * product q[n, a] . xq[m, a] an exact int32, then
 *   y[m, n] = sum_g s[n, g] * sum_{a in g} d[m, a] * dot[m, n, a] + o[n, g] * xsg[m, g];
 * only the order of the float sums differs from the VNNI rows (and no +128 bias: int8 weights
 * are signed operands here, tdpbssd; int4's 0..15 unsigned ones, tdpbusd).
 *
 * Tiles, per 16 weight rows (an n-tile) and 16 rows of x (an m-tile), per k-step of KW inputs
 * (QAMX_KW: 64, or 32 for act blocks of 32), AB / KW products accumulated in one C tile per act block:
 * - A: the 16 weight rows' KW int8 values (16 rows x KW bytes). int8: loaded in place from
 *   the row-major weight (tile row stride K); int4: unpacked once per n-tile into thread
 *   scratch [k-step][16 rows][KW] (low nibbles then high ones: Q4_0's run order is k order),
 *   never to floats; a last n-tile of fewer than 16 rows also goes through the scratch,
 *   zero-padded.
 * - B: x's k-step in the tile B layout [KW / 4 rows of 4 inputs][16 rows of x][4]: qamx_quantize
 *   writes each 32 inputs' 512 bytes in turn, so a 64-input step is two of them, 16 tile rows (x rows
 *   past M are zeros with d = 0).
 * - C: the 16 x 16 int32 dots of an act block (exact: 256 x 128 x 128 fits); stored, converted and
 *   multiplied by the act block's d (a vector over the rows of x), summed in float per weight group,
 *   then scaled by s[n, g] (a scalar per weight row) and the group's o[n, g] * xsg term added.
 * Tiles 0-1 A, 2-3 B, 4-7 C (four act blocks in flight). Each thread configures its tiles and
 * releases them at the end of the call. Loop order: qgemm_amx below (few m-tiles: n-tile by
 * n-tile; many: chunks of n-tiles over every m-tile). */
#if Q8_PATH == 3 && defined(__AMX_TILE__) && defined(__AMX_INT8__)  /* an AMX CPU has VNNI: a no-VNNI build has neither */
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "lane_sums.h"  /* transpose16 */
#define QAMX_PATH 1

/* scratch of M rows of x, K inputs, groups of G (the caller's): bytes of the B tiles, floats
 * of d (one 16-vector a 32-input block: its act block's d), floats of xsg (one 16-vector a group), per m-tile */
#define QAMX_XT(M, K) (((M) + 15) / 16 * ((K) / Q8_BLOCK) * 512)
#define QAMX_DT(M, K) (((M) + 15) / 16 * ((K) / Q8_BLOCK) * 16)
#define QAMX_XSG(M, K, G) (((M) + 15) / 16 * ((K) / (G)) * 16)

/* the tile products' k-step (inputs) for act blocks of AB: 64 (a full tile row), 32 for AB = 32 */
#define QAMX_KW(AB) ((AB) >= 64 ? 64 : 32)

static void qamx_configure(int kw) {
    tile_config c = {0};
    c.palette = 1;
    for (int t = 0; t < 2; t++) c.rows[t] = 16, c.colsb[t] = (uint16_t)kw;      /* A: 16 weight rows x kw inputs */
    for (int t = 2; t < 4; t++) c.rows[t] = (uint8_t)(kw / 4), c.colsb[t] = 64;  /* B: kw / 4 x (16 rows of x x 4) */
    for (int t = 4; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;      /* C: 16 x 16 int32 */
    amx_load_config(&c);
}

/* x [M, ldx] -> the B tiles xt, d per 32-input block dt, xsg per group xsgt (layouts above); the int8
 * values, d and xsg are quantize_row_q8's to the bit (the same float operations in the same
 * order; cvtps rounds to nearest even as nearbyintf does) */
static void qamx_quantize(const float *x, int64_t ldx, int64_t M, int64_t K, int64_t G, int64_t AB, int8_t *xt,
                          float *dt, float *xsgt, int num_threads) {
    const int64_t nb = K / Q8_BLOCK, sub = AB / Q8_BLOCK, per = G / AB, groups = K / G, rows = (M + 15) / 16 * 16;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (M * K >= 65536)")
    for (int64_t m = 0; m < rows; m++) {
        const int64_t mt = m / 16, c = m % 16;
        int8_t *xb = xt + mt * nb * 512 + c * 4;
        float *db = dt + mt * nb * 16 + c, *sg = xsgt + mt * groups * 16 + c;
        for (int64_t g = 0; g < groups; g++) sg[g * 16] = 0.0f;
        for (int64_t a = 0; a < K / AB; a++) {
            float d = 0.0f;
            __m512 id = _mm512_setzero_ps();
            __m512i isum = _mm512_setzero_si512();
            if (m < M) {
                __m512 mx = _mm512_setzero_ps();
                for (int64_t i = 0; i < AB; i += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_loadu_ps(x + m * ldx + a * AB + i)));
                const float amax = _mm512_reduce_max_ps(mx);
                d = amax / 127.0f;
                id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            }
            for (int64_t b = a * sub; b < (a + 1) * sub; b++) {
                int32_t words[8] = {0};
                if (m < M) {
                    const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + m * ldx + b * Q8_BLOCK), id));
                    const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + m * ldx + b * Q8_BLOCK + 16), id));
                    _mm_storeu_si128((__m128i *)words, _mm512_cvtepi32_epi8(i0));
                    _mm_storeu_si128((__m128i *)(words + 4), _mm512_cvtepi32_epi8(i1));
                    isum = _mm512_add_epi32(isum, _mm512_add_epi32(i0, i1));
                }
                for (int k4 = 0; k4 < 8; k4++) memcpy(xb + b * 512 + k4 * 64, &words[k4], 4);
                db[b * 16] = d;
            }
            if (m < M) sg[(a / per) * 16] += d * (float)_mm512_reduce_add_epi32(isum);
        }
    }
}

/* rows n0 .. n0 + rows of the weight as int8 A tiles into a [K / kw][16][kw] (rows past `rows` zero) */
static void qamx_prepare(const void *q, int bits, int64_t n0, int64_t rows, int64_t K, int kw, int8_t *a) {
    const int64_t nb = K / Q8_BLOCK;
    if (rows < 16) memset(a, 0, (size_t)nb * 512);
    if (bits == 8) {
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < K / kw; c++) memcpy(a + c * 16 * kw + r * kw, (const int8_t *)q + (n0 + r) * K + c * kw, kw);
        return;
    }
    const uint8_t *q4 = (const uint8_t *)q + n0 * (K / 2);
    const __m512i low = _mm512_set1_epi8(15);
    const __m512i rows01 = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), rows23 = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    for (int64_t b = 0; b < nb; b++) {
        int8_t *ab = a + (b * 32 / kw) * 16 * kw + (b * 32) % kw;  /* block b's 32 bytes of row 0; rows kw apart */
        int64_t r = 0;
        for (; r + 4 <= rows; r += 4) {  /* 4 rows' 16 bytes: low nibbles are inputs 0-15, high ones 16-31 */
            __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(q4 + r * (K / 2) + b * 16)));
            v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(q4 + (r + 1) * (K / 2) + b * 16)), 1);
            v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(q4 + (r + 2) * (K / 2) + b * 16)), 2);
            v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(q4 + (r + 3) * (K / 2) + b * 16)), 3);
            const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            const __m512i r01 = _mm512_permutex2var_epi64(lo, rows01, hi), r23 = _mm512_permutex2var_epi64(lo, rows23, hi);
            _mm256_storeu_si256((__m256i *)(ab + r * kw), _mm512_castsi512_si256(r01));
            _mm256_storeu_si256((__m256i *)(ab + (r + 1) * kw), _mm512_extracti64x4_epi64(r01, 1));
            _mm256_storeu_si256((__m256i *)(ab + (r + 2) * kw), _mm512_castsi512_si256(r23));
            _mm256_storeu_si256((__m256i *)(ab + (r + 3) * kw), _mm512_extracti64x4_epi64(r23, 1));
        }
        for (; r < rows; r++)
            for (int i = 0; i < 16; i++) {
                const uint8_t v = q4[r * (K / 2) + b * 16 + i];
                ab[r * kw + i] = (int8_t)(v & 15);
                ab[r * kw + 16 + i] = (int8_t)(v >> 4);
            }
    }
}

/* k-step c's product added into C tile T (A tile TA, B tile TB; B: kw / 4 rows of 64 bytes at
 * xt + c * 16 kw): bits a constant, tdpbssd or tdpbusd */
#define QAMX_DOT(T, TA, TB, c)                                 \
    do {                                                       \
        _tile_loadd(TA, a + (c) * bstride, astride);           \
        _tile_loadd(TB, xt + (c) * 16 * kw, 64);               \
        if (bits == 8)                                         \
            _tile_dpbssd(T, TA, TB);                           \
        else                                                   \
            _tile_dpbusd(T, TA, TB);                           \
    } while (0)

/* In place, the n-tile QAMX_PF_TILES ahead is prefetched into L2 during the first m-tile, in order, 16 kw
 * bytes a product (strided tile rows miss the hardware prefetchers). Qwen3-0.6B's int8 linears at M = 16, one
 * thread: one tile ahead into L1 (the order before) 7-9 GB/s, two ahead into L2 9-10 GB/s (RESULTS.md, #35
 * the act block). */
#ifndef QAMX_PF_TILES
#define QAMX_PF_TILES 2
#endif
#ifndef QAMX_PF_HINT
#define QAMX_PF_HINT _MM_HINT_T1
#endif
/* one n-tile (A: k-step c at a + c * bstride, tile rows astride apart) times one m-tile: out[r][m]
 * = y[m, n0 + r] for the tile's 16 x 16; s, o: the n-tile's first row of scales / offsets,
 * rows of them valid. Four act blocks' products in flight (C tiles 4-7, each the sum of its act
 * block's AB / kw k-steps, the four interleaved: a tile store waits for its product, and four stores in
 * a row measured ~25 ns a block against ~31 for two), then each act block's C stored, converted and
 * times its d into the group sums ga, a group's last act block folding ga into acc (times s[n, g],
 * plus o[n, g] * xsg). bits and kw constants after inlining. */
static inline __attribute__((always_inline)) void qamx_tile(const int bits, const int kw, const int8_t *a,
                                                            int64_t astride, int64_t bstride, const int8_t *xt,
                                                            const float *dt, const float *xsg, const float *s,
                                                            const float *o, int64_t rows, int64_t AB, int64_t per,
                                                            int64_t groups, int64_t K, const int8_t *pf, float *y,
                                                            int64_t ldy, int64_t ms) {
    int32_t cbuf[4][256] __attribute__((aligned(64)));
    __m512 acc[16], ga[16];
    for (int r = 0; r < 16; r++) acc[r] = ga[r] = _mm512_setzero_ps();
    const int64_t na = K / AB, steps = AB / kw;  /* act blocks; k-steps an act block */
    int64_t g = 0, left = per;  /* act block a's group, and its act blocks from a on (no division a block) */
    int64_t pfo = 0;  /* the next n-tile's bytes prefetched */
    for (int64_t a0 = 0; a0 < na; a0 += 4) {
        const int cnt = na - a0 < 4 ? (int)(na - a0) : 4;
        _tile_zero(4);
        if (cnt > 1) _tile_zero(5);
        if (cnt > 2) _tile_zero(6);
        if (cnt > 3) _tile_zero(7);
        for (int64_t j = 0; j < steps; j++) {
            QAMX_DOT(4, 0, 2, a0 * steps + j);
            if (cnt > 1) QAMX_DOT(5, 1, 3, (a0 + 1) * steps + j);
            if (cnt > 2) QAMX_DOT(6, 0, 2, (a0 + 2) * steps + j);
            if (cnt > 3) QAMX_DOT(7, 1, 3, (a0 + 3) * steps + j);
            /* a later n-tile (its 16 rows: 16 K contiguous bytes, in place) in order, 16 kw bytes a product */
            for (int64_t l = 0; pf && l < cnt * 16 * kw; l += 64, pfo += 64) _mm_prefetch((const char *)(pf + pfo), QAMX_PF_HINT);
        }
        _tile_stored(4, cbuf[0], 64);
        if (cnt > 1) _tile_stored(5, cbuf[1], 64);
        if (cnt > 2) _tile_stored(6, cbuf[2], 64);
        if (cnt > 3) _tile_stored(7, cbuf[3], 64);
        for (int j = 0; j < cnt; j++) {
            const __m512 dv = _mm512_loadu_ps(dt + (a0 + j) * (AB / Q8_BLOCK) * 16);  /* its first 32-block's d */
            for (int r = 0; r < 16; r++)
                ga[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cbuf[j] + r * 16)), dv, ga[r]);
            if (--left == 0) {  /* the group's last act block */
                const __m512 xg = _mm512_loadu_ps(xsg + g * 16);
                for (int r = 0; r < rows; r++) {
                    acc[r] = _mm512_fmadd_ps(ga[r], _mm512_set1_ps(s[r * groups + g]), acc[r]);
                    if (o) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(o[r * groups + g]), xg, acc[r]);
                }
                for (int r = 0; r < 16; r++) ga[r] = _mm512_setzero_ps();
                g++, left = per;
            }
        }
    }
    transpose16(acc);  /* acc[m]: row m of x's outputs for the tile's weight rows */
    const __mmask16 k = (__mmask16)((1u << rows) - 1);
    for (int64_t m = 0; m < ms; m++) _mm512_mask_storeu_ps(y + m * ldy, k, acc[m]);
}

/* n-tile nt's A tiles: in place (int8, 16 full rows: the row-major weight, tile rows K apart) or
 * prepared into a ([K / kw][16][kw]: int4 unpacked, a short last n-tile zero-padded); astride /
 * bstride as qamx_tile takes them */
static inline const int8_t *qamx_a(const void *q, int bits, int kw, int64_t N, int64_t K, int64_t nt, int8_t *a,
                                   int64_t *astride, int64_t *bstride) {
    const int64_t n0 = nt * 16, rows = N - n0 < 16 ? N - n0 : 16;
    if (bits == 8 && rows == 16) {
        *astride = K, *bstride = kw;
        return (const int8_t *)q + n0 * K;
    }
    qamx_prepare(q, bits, n0, rows, K, kw, a);
    *astride = kw, *bstride = 16 * kw;
    return a;
}

/* n-tile nt (A tiles ab) times m-tiles mt0 .. mt1 of x into y; pf: a later n-tile's in-place rows
 * to prefetch during the first (NULL: none) */
static inline void qamx_ntile_mt(int bits, const int8_t *ab, int64_t astride, int64_t bstride, const float *scales,
                                 const float *offsets, int64_t N, int64_t K, int64_t G, int64_t AB, int64_t M, int64_t nt,
                                 const int8_t *xt, const float *dt, const float *xsgt, float *y, int64_t ldy,
                                 int64_t mt0, int64_t mt1, const int8_t *pf) {
    const int64_t nb = K / Q8_BLOCK, per = G / AB, groups = K / G;
    const int64_t n0 = nt * 16, rows = N - n0 < 16 ? N - n0 : 16;
    const float *s = scales + n0 * groups, *o = offsets ? offsets + n0 * groups : NULL;
    for (int64_t mt = mt0; mt < mt1; mt++) {
        const int8_t *xb = xt + mt * nb * 512;
        const float *db = dt + mt * nb * 16, *sg = xsgt + mt * groups * 16;
        const int64_t ms = M - mt * 16 < 16 ? M - mt * 16 : 16;
        float *yt = y + mt * 16 * ldy + n0;
        const int8_t *p = mt > mt0 ? NULL : pf;
        if (bits == 8 && QAMX_KW(AB) == 64)  /* bits and kw constants in each instance */
            qamx_tile(8, 64, ab, astride, bstride, xb, db, sg, s, o, rows, AB, per, groups, K, p, yt, ldy, ms);
        else if (bits == 8)
            qamx_tile(8, 32, ab, astride, bstride, xb, db, sg, s, o, rows, AB, per, groups, K, p, yt, ldy, ms);
        else if (QAMX_KW(AB) == 64)
            qamx_tile(4, 64, ab, astride, bstride, xb, db, sg, s, o, rows, AB, per, groups, K, p, yt, ldy, ms);
        else
            qamx_tile(4, 32, ab, astride, bstride, xb, db, sg, s, o, rows, AB, per, groups, K, p, yt, ldy, ms);
    }
}

/* n-tile nt (weight rows 16 nt ..) times every m-tile of M rows of x quantised by qamx_quantize (xt,
 * dt, xsgt) into y [M, ldy]; a: the caller's [K / 32][16][32] bytes of int8 scratch (int4 unpacked, a
 * short last n-tile). Tiles configured by qamx_configure(QAMX_KW(AB)). qgemm_amx's n-tiles at few rows
 * and the int8 MoE experts' (layer_ops.c, moe_q8.h). */
static inline void qamx_ntile(const void *q, int bits, const float *scales, const float *offsets, int64_t N,
                              int64_t K, int64_t G, int64_t AB, int64_t M, int64_t nt, const int8_t *xt, const float *dt,
                              const float *xsgt, int8_t *a, float *y, int64_t ldy) {
    int64_t astride, bstride;
    const int8_t *ab = qamx_a(q, bits, QAMX_KW(AB), N, K, nt, a, &astride, &bstride);
    /* in place, the n-tile QAMX_PF_TILES on (a static schedule's, or this expert's) fetched during the first m-tile */
    const int8_t *next = ab != a && nt * 16 + 16 * (QAMX_PF_TILES + 1) <= N ? ab + 16 * QAMX_PF_TILES * K : NULL;
    qamx_ntile_mt(bits, ab, astride, bstride, scales, offsets, N, K, G, AB, M, nt, xt, dt, xsgt, y, ldy, 0,
                  (M + 15) / 16, next);
}

/* From QAMX_MANY_MT m-tiles of x on (prefill), a thread's n-tiles go in chunks of about QAMX_CHUNK
 * bytes of weight (L2-resident, int4 unpacked once a chunk), each chunk times every m-tile in
 * turn: one m-tile's B tiles stay in L1 across the chunk and y is written a row run at a time.
 * n-tile by n-tile over every m-tile (the order below that) wrote y as 64-byte pieces of M rows
 * and streamed all of x's tiles per n-tile: M = 2048 took 1.5-2x the time per tile product of
 * M = 64 (Qwen3-0.6B linears, one thread). */
#ifndef QAMX_MANY_MT
#define QAMX_MANY_MT 8
#endif
#ifndef QAMX_CHUNK
#define QAMX_CHUNK (512 << 10)
#endif

/* y [M, ldy] = x [M, ldx] @ w^T on tiles; scratch as QAMX_XT / QAMX_DT / QAMX_XSG. Returns 0,
 * 1 where Linux refuses this process the tiles (the caller runs the VNNI rows), -1 out of memory. */
static int qgemm_amx(const float *x, int64_t ldx, int64_t M, const void *q, int bits, const float *scales,
                     const float *offsets, int64_t N, int64_t K, int64_t G, int64_t AB, float *y, int64_t ldy,
                     int8_t *xt, float *dt, float *xsgt, int num_threads) {
    if (!amx_granted()) return 1;
    qamx_quantize(x, ldx, M, K, G, AB, xt, dt, xsgt, num_threads);
    const int64_t nb = K / Q8_BLOCK, ntiles = (N + 15) / 16, mtiles = (M + 15) / 16;
    const int many = mtiles >= QAMX_MANY_MT;
    int64_t chunk = many ? QAMX_CHUNK / (16 * K) : 1;  /* n-tiles a chunk */
    const int64_t fair = (ntiles + num_threads - 1) / num_threads;  /* every thread a chunk */
    chunk = chunk < 1 ? 1 : chunk > fair ? fair : chunk;
    const int64_t chunks = (ntiles + chunk - 1) / chunk;
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        int8_t *a = aligned_alloc(64, (size_t)chunk * nb * 512);
        if (a == NULL) {
            _Pragma("omp atomic write")
            failed = 1;
        } else {
            qamx_configure(QAMX_KW(AB));
        }
        _Pragma("omp for schedule(static)")
        for (int64_t c = 0; c < chunks; c++) {
            if (a == NULL) continue;
            const int64_t nt0 = c * chunk, nt1 = nt0 + chunk < ntiles ? nt0 + chunk : ntiles;
            if (!many) {
                for (int64_t nt = nt0; nt < nt1; nt++)
                    qamx_ntile(q, bits, scales, offsets, N, K, G, AB, M, nt, xt, dt, xsgt, a, y, ldy);
                continue;
            }
            const int8_t *ab[nt1 - nt0];
            int64_t astride[nt1 - nt0], bstride[nt1 - nt0];
            for (int64_t nt = nt0; nt < nt1; nt++)
                ab[nt - nt0] = qamx_a(q, bits, QAMX_KW(AB), N, K, nt, a + (nt - nt0) * nb * 512, &astride[nt - nt0],
                                      &bstride[nt - nt0]);
            for (int64_t mt = 0; mt < mtiles; mt++)
                for (int64_t nt = nt0; nt < nt1; nt++)
                    qamx_ntile_mt(bits, ab[nt - nt0], astride[nt - nt0], bstride[nt - nt0], scales, offsets, N, K, G,
                                  AB, M, nt, xt, dt, xsgt, y, ldy, mt, mt + 1, NULL);
        }
        if (a != NULL) _tile_release();
        free(a);
    }
    return failed ? -1 : 0;
}
/* Widened products (prefill): from quant.py's QGEMM_WIDE_MIN_M rows of x on, an int8 / int4 linear runs
 * on bf16 AMX tiles instead: each work item (a chunk of n-tiles, about QWIDE_CHUNK bytes of bf16) has its
 * weight rows dequantised as QuantizedWeight.dequantize does (q * s, then + o, float32) and rounded to
 * bf16 straight into the tile B layout, once, in thread scratch (no copy kept past the call); x rounded
 * to bf16 into the A tile layout once a call; then amx_block (amx.h, moe_amx.h's) over every 32 rows of
 * x. Contract: bf16 activations and bf16-rounded weights, float32 sums (not the int8-activation bits;
 * docs/design.md). Why: each int8 tile product's 16 x 16 int32 result is stored, converted and scaled
 * every 32 inputs, which bounds the int8 tiles at ~0.34x atomd's bf16 prefill; a bf16 product
 * accumulates over all of K in the tile. Built where the bf16 tiles and AVX512_BF16 are (not in the
 * no-bf16-dot build: its bits stay the int8 tiles'). */
#if defined(__AMX_BF16__) && defined(__AVX512BF16__) && !defined(ATOMD_NO_BF16_DOT)
#define QAMX_WIDE 1
#ifndef QWIDE_CHUNK
#define QWIDE_CHUNK (1 << 20)
#endif

/* Weight rows 16 nt0 .. 16 nt1 (rows from N on zero) of an int8 / int4 weight [N, K] (K a multiple of
 * 32, G of 32) dequantised as QuantizedWeight.dequantize does (q * s, then + o, in float32) and rounded
 * to bf16 (nearest even), into pack_amx's layout [nt1 - nt0][K / 32][16 k pairs][16 n][2] at dst: each
 * 16 x 32 block one tile B operand (amx_block's b0 / b1). The widened MoE experts' (moe_q8.h) too. */
static void qamx_widen(const void *q, int bits, const float *scales, const float *offsets, int64_t N, int64_t K,
                       int64_t G, int64_t nt0, int64_t nt1, uint16_t *dst) {
    const int64_t groups = (K + G - 1) / G, per = G / Q8_BLOCK;
    for (int64_t nb = nt0; nb < nt1; nb++)
        for (int64_t c = 0; c < K / 32; c++) {
            __m512 r[16];
            for (int n = 0; n < 16; n++) {
                const int64_t row = nb * 16 + n, g = row * groups + c / per;
                if (row >= N) {
                    r[n] = _mm512_setzero_ps();
                    continue;
                }
                __m512 v[2];  /* the block's inputs 0-15 and 16-31 (quant.h's loads) */
                if (bits == 8) {
                    const int8_t *p = (const int8_t *)q + row * K + c * 32;
                    v[0] = load_i8(p), v[1] = load_i8(p + 16);
                } else {
                    load_i4((const uint8_t *)q + row * (K / 2) + c * 16, v);
                }
                __m512 lo = v[0], hi = v[1];
                /* the product rounded before the offset's add, as torch's two ops (GCC would fuse _mm512_mul_ps
                 * and _mm512_add_ps into one FMA: the rounding intrinsic keeps them apart) */
                const __m512 sc = _mm512_set1_ps(scales[g]);
                lo = _mm512_mul_round_ps(lo, sc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                hi = _mm512_mul_round_ps(hi, sc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                if (offsets) {
                    const __m512 o = _mm512_set1_ps(offsets[g]);
                    lo = _mm512_add_ps(lo, o), hi = _mm512_add_ps(hi, o);
                }
                r[n] = (__m512)_mm512_cvtne2ps_pbh(hi, lo);  /* 32-bit lane k: inputs 2k, 2k + 1 */
            }
            transpose16(r);  /* lane_sums.h; r[k]: the 16 rows' pair k */
            uint16_t *b = dst + ((nb - nt0) * (K / 32) + c) * 512;
            for (int k = 0; k < 16; k++) _mm512_storeu_ps((float *)(b + k * 32), r[k]);
        }
}

/* y [M, ldy] = bf16(x [M, ldx]) @ bf16(dequantised w)^T on bf16 tiles (above); K a multiple of 32, G of
 * 32. Items of ~1 MB measured best against 256 KB and 2 MB; k-blocks of 256 inputs accumulated in the C
 * tiles (x's block kept in L1 across the pairs) 0.8-1.1x: dropped. Returns 0, 1 where Linux refuses this
 * process the tiles, -1 out of memory. */
static int qgemm_wide(const float *x, int64_t ldx, int64_t M, const void *q, int bits, const float *scales,
                      const float *offsets, int64_t N, int64_t K, int64_t G, float *y, int64_t ldy, int num_threads) {
    if (!amx_granted()) return 1;
    const int64_t kc = K / 32, m16 = (M + 15) / 16 * 16, ntiles = (N + 15) / 16;
    uint16_t *xa = aligned_alloc(64, sizeof(uint16_t) * m16 * K);  /* x's A tiles [m16 / 16][K / 32][16][32] */
    if (xa == NULL) return -1;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t r = 0; r < m16; r++) {
        if (r < M) amx_put_row_f32(xa, r, x + r * ldx, K);
        else
            for (int64_t c = 0; c < kc; c++) memset(xa + (r / 16) * K * 16 + (r % 16) * 32 + c * 512, 0, 64);
    }
    int64_t chunk = QWIDE_CHUNK / (32 * K) / 2 * 2;  /* n-tiles an item, even (amx_block's pairs) */
    const int64_t fair = (ntiles + num_threads - 1) / num_threads;  /* every thread an item */
    chunk = chunk < 2 ? 2 : chunk > fair + fair % 2 ? fair + fair % 2 : chunk;
    const int64_t chunks = (ntiles + chunk - 1) / chunk;
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        uint16_t *wb = aligned_alloc(64, sizeof(uint16_t) * chunk * 16 * K);
        float *blk = aligned_alloc(64, sizeof(float) * 1024);
        const int ready = amx_thread_ready(wb != NULL && blk != NULL, &failed);
        _Pragma("omp for schedule(static)")
        for (int64_t c = 0; c < chunks; c++) {
            if (!ready) continue;
            const int64_t nt0 = c * chunk, nt1 = nt0 + chunk < ntiles ? nt0 + chunk : ntiles;
            qamx_widen(q, bits, scales, offsets, N, K, G, nt0, nt1, wb);
            for (int64_t m0 = 0; m0 < m16; m0 += 32) {
                const int two = m16 - m0 > 16;
                for (int64_t nt = nt0; nt < nt1; nt += 2) {
                    const uint16_t *b0 = wb + (nt - nt0) * kc * 512;
                    const int pair = nt + 1 < nt1;  /* a last odd n-tile: b0 twice, the copy's outputs dropped */
                    amx_block(xa + m0 * K, two, b0, pair ? b0 + kc * 512 : b0, kc, blk);
                    for (int t = 0; t < (two ? 4 : 2); t++) {
                        const int64_t n0 = (nt + t % 2) * 16, cols = N - n0 < 16 ? N - n0 : 16;
                        if (t % 2 && !pair) continue;
                        const __mmask16 k = (__mmask16)((1u << cols) - 1);
                        for (int64_t r = 0; r < 16 && m0 + 16 * (t / 2) + r < M; r++)
                            _mm512_mask_storeu_ps(y + (m0 + 16 * (t / 2) + r) * ldy + n0, k,
                                                  _mm512_load_ps(blk + t * 256 + r * 16));
                    }
                }
            }
        }
        if (ready) _tile_release();
        free(wb);
        free(blk);
    }
    free(xa);
    return failed ? -1 : 0;
}
#else
#define QAMX_WIDE 0
#endif
#else
#define QAMX_PATH 0
#define QAMX_WIDE 0
#endif
