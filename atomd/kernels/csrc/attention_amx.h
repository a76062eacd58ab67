/* Part of attention.c's one translation unit (one library per model shape: HEAD_DIM and GROUP
 * are macros there), included by it only. */

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
#include "amx.h"
#define AMX_PATH 1

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

/* r[i][j] <-> r[j][i], 32-bit elements: 16 keys' 16 dim pairs become 16 dim pairs' keys (K's tile
 * rows), 64 shuffles where a scatter a key cost ~3x as long */
static inline void transpose16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {  /* pairs of rows interleaved by 32 bits, then 64 */
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {  /* r[i + 4g], lane l: rows 4g .. 4g + 3 of column 4l + i */
        const __m512i a = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88), b = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        const __m512i c = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88), d = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
        t[i] = _mm512_shuffle_i32x4(a, c, 0x88);
        t[i + 8] = _mm512_shuffle_i32x4(a, c, 0xdd);
        t[i + 4] = _mm512_shuffle_i32x4(b, d, 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(b, d, 0xdd);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
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
    /* not calloc: every value is written below (padding keys zeroed), and a reused heap block
     * would be cleared first (~1.5 ms a 0.6B-shape layer of 8 x 512) */
    uint16_t *kt = malloc(sizeof(uint16_t) * num_kv_heads * per_head);
    uint16_t *vt = malloc(sizeof(uint16_t) * num_kv_heads * per_head);
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
                const __m512i interleave = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                                            39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
                if (seq_lens[s] % 32) {  /* the last 32-key block's padding keys: zero (P @ V reads them) */
                    const int64_t last = seq_lens[s] / 32 * 32 * HEAD_DIM;
                    memset(kd + last, 0, sizeof(uint16_t) * 32 * HEAD_DIM);
                    memset(vd + last, 0, sizeof(uint16_t) * 32 * HEAD_DIM);
                }
                for (int64_t t0 = 0; t0 < seq_lens[s]; t0 += 16) {  /* K: 16 keys x 16 dim pairs transposed a chunk */
                    const int64_t nt = seq_lens[s] - t0 < 16 ? seq_lens[s] - t0 : 16;
                    const uint16_t *ks = k + (seq_starts[s] + t0) * k_stride + h * HEAD_DIM;
                    for (int c = 0; c < K_CHUNKS; c++) {
                        __m512i r[16];
                        for (int64_t i = 0; i < 16; i++)
                            r[i] = i < nt ? _mm512_loadu_si512(ks + i * k_stride + c * 32) : _mm512_setzero_si512();
                        transpose16_epi32(r);
                        uint16_t *dst = kd + k_tile_index(t0, c * 32);  /* [dim pair][key][2]: 16 rows of 64 bytes */
                        for (int p = 0; p < 16; p++) _mm512_storeu_si512(dst + p * 32, r[p]);
                    }
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
        const int ready = amx_thread_ready(sc != NULL && phi != NULL && plo != NULL, &failed);
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
