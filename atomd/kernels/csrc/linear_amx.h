/* Part of layer_ops.c's translation unit, included by it only (after the bf16 row helpers: to_bf16,
 * and moe_amx.h: amx_put_row, the rows' A tile layout).
 *
 * atomd_linear_amx_bf16: y [M][N] = x [M][K] @ W^T, bf16 in and out, float32 sums, for a few rows
 * (a batch's decode step) as AMX tile products over the weight as oneDNN packed it at load
 * (atomd/model/linear.py pack_linear_weight: on AMX CPUs its AB16b32a2b layout, [N / 32][K / 32]
 * [16 k pairs][32 n][2], each 32 x 32 block two 1 KB B tiles side by side: rows 128 bytes apart).
 * No copy of the weight: the one oneDNN reads. Per block of 32 outputs the products run over K in
 * order, 32 values a tile product, and round once at the end, as oneDNN's AMX kernel does: the
 * same bits (linear.py checks that once per weight shape before it uses this, else oneDNN runs).
 * Why: at 16 rows oneDNN's call (its primitive look-up, its own threading) streamed the weights
 * ~1.2-1.6x slower than these tiles (an ad-hoc run, one thread; DeepSeek-V2-Lite's q / kv_a and
 * o_proj, benchmarks/RESULTS.md #37).
 * Work: the output blocks shared statically by the threads, each thread packing the rows into A
 * tiles once per 32 rows. Returns 0, -1 (no scratch memory) or 1 (no AMX tiles here: nothing done).
 * K and N multiples of 32. */
#if MOE_AMX
#define LINEAR_AMX 1

int atomd_linear_amx_bf16(const bf16_t *x, int64_t x_stride, const bf16_t *w, bf16_t *y, int64_t M, int64_t K,
                          int64_t N, int num_threads) {
    if (!amx_granted()) return 1;
    const int64_t KB = K / 32, NB = N / 32;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        bf16_t *xa = malloc(sizeof(bf16_t) * 32 * K);  /* 32 rows in A tile layout [2][K / 32][16][32] */
        const int ready = amx_thread_ready(xa != NULL, &failed);
        float c[4][256];
        for (int64_t m0 = 0; m0 < M; m0 += 32) {
            const int64_t mr = M - m0 < 32 ? M - m0 : 32;
            const int two = mr > 16;
            for (int64_t r = 0; ready && r < (two ? 32 : 16); r++)  /* rows past mr: zeros (outputs dropped) */
                amx_put_row(xa, r, r < mr ? x + (m0 + r) * x_stride : NULL, K);
#pragma omp for schedule(static)
            for (int64_t j = 0; j < NB; j++) {
                if (!ready) continue;
                const bf16_t *b = w + j * KB * 1024;
                amx_products_ld(xa, two, b, b + 32, KB, 1024, 128);  /* the block's two B tiles side by side */
                amx_store(two, c[0]);
                for (int t = 0; t < (two ? 4 : 2); t++)  /* tile t: rows 16 (t / 2) .., outputs 16 (t % 2) .. */
                    for (int64_t r = 0; r < 16 && t / 2 * 16 + r < mr; r++)
                        _mm256_storeu_si256((__m256i *)(y + (m0 + t / 2 * 16 + r) * N + j * 32 + t % 2 * 16),
                                            to_bf16(_mm512_loadu_ps(c[t] + r * 16)));
            }
        }
        if (ready) _tile_release();
        free(xa);
    }
    return failed ? -1 : 0;
}
#else
#define LINEAR_AMX 0
int atomd_linear_amx_bf16(const bf16_t *x, int64_t x_stride, const bf16_t *w, bf16_t *y, int64_t M, int64_t K,
                          int64_t N, int num_threads) {
    (void)x, (void)x_stride, (void)w, (void)y, (void)M, (void)K, (void)N, (void)num_threads;
    return 1;
}
#endif

/* 1 where atomd_linear_amx_bf16 runs: built with AMX tiles and the process granted their state */
int atomd_linear_amx_kind(void) {
#if LINEAR_AMX
    return amx_granted();
#else
    return 0;
#endif
}
