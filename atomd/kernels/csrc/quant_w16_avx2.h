/* Part of quant.c (through quant_w16.h): 16-bit float weights (bfloat16 or float16, quant.h's row_w16
 * layout: uint16 [N, K]) times many rows of float32 x, float32 out, on AVX2 builds (CPUs without AVX-512:
 * Zen 3 and older EPYCs): atomd_qgemm_b16_panels / _h16_panels packed per call (no load-time panels, no
 * bf16 x: those stay AVX-512), from quant.py's QGEMM_W16_MIN_M rows (the same threshold as AVX-512's).
 *
 * Where the rows (quant.h's row_w16) widen a weight vector for up to 8 rows of x and load x once an FMA,
 * here each thread widens its panel of weight rows (about W16_AVX2_PANEL bytes of float32, L2) once per call
 * into strips of 16 rows transposed, [K][16], and runs every W16_AVX2_MR rows of x against every strip: a
 * 6 x 16 micro-kernel of 12 accumulators, per input two weight loads and six broadcasts of x from its own
 * rows into 12 FMAs (a float32 GEMM's register blocking, on half the bytes from memory). Every y[m, n] is
 * one chain of FMAs over k = 0..K-1 in order: its bits do not depend on M, the threads or the panels. */
#if QUANT_PATH == 1
#include <stdlib.h>

#define W16_PANELS_AVX2 1
enum { W16_B16 = 0, W16_H16 = 1 };  /* (quant_w16.h's kinds: the weight's 16-bit values) */
#define W16_AVX2_NR 16  /* weight rows a strip: two vectors */
#define W16_AVX2_MR 6   /* rows of x a micro-kernel: 12 accumulators + 2 weight vectors + a broadcast */
#define W16_AVX2_PANEL (256 << 10)  /* packed float32 bytes a work item (L2) */

/* weight rows n0 .. n0 + 16 strips widened into wp: strip j at wp + j * 16 K, [K][16] (rows from N on zero); 8 rows
 * x 8 inputs at a time widened and transposed in registers */
static void w16a_pack(const uint16_t *q, int f16, int64_t N, int64_t K, int64_t n0, int64_t strips, float *wp) {
    for (int64_t j = 0; j < strips; j++)
        for (int h = 0; h < W16_AVX2_NR / 8; h++) {
            const int64_t r0 = n0 + j * W16_AVX2_NR + h * 8;
            float *dst = wp + j * W16_AVX2_NR * K + h * 8;
            int64_t k = 0;
            for (; k + 8 <= K; k += 8) {
                __m256 v[8];
                for (int r = 0; r < 8; r++) {
                    const uint16_t *p = q + (r0 + r) * K + k;
                    v[r] = r0 + r >= N ? _mm256_setzero_ps() : f16 ? load_h16(p) : load_b16(p);
                }
                transpose8_ps(v);
                for (int i = 0; i < 8; i++) _mm256_storeu_ps(dst + (k + i) * W16_AVX2_NR, v[i]);
            }
            for (; k < K; k++)
                for (int r = 0; r < 8; r++) {
                    const uint16_t w = r0 + r < N ? q[(r0 + r) * K + k] : 0;  /* (0: +0.0 in both formats) */
                    dst[k * W16_AVX2_NR + r] = f16 ? h16_to_float(w) : b16_to_float(w);
                }
        }
}

/* mr (a constant after inlining) rows of x times one strip into y[r * ldy + 0 .. cols) */
static inline __attribute__((always_inline)) void w16a_kernel(const int mr, const float *x, int64_t ldx,
                                                              const float *w, int64_t K, float *y, int64_t ldy,
                                                              int64_t cols) {
    __m256 a[W16_AVX2_MR][2];
    for (int r = 0; r < mr; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m256 w0 = _mm256_loadu_ps(w + k * W16_AVX2_NR), w1 = _mm256_loadu_ps(w + k * W16_AVX2_NR + 8);
        for (int r = 0; r < mr; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);
            a[r][0] = _mm256_fmadd_ps(xb, w0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(xb, w1, a[r][1]);
        }
    }
    if (cols >= W16_AVX2_NR) {
        for (int r = 0; r < mr; r++) {
            _mm256_storeu_ps(y + r * ldy, a[r][0]);
            _mm256_storeu_ps(y + r * ldy + 8, a[r][1]);
        }
        return;
    }
    const __m256i m0 = lanes_below8(cols), m1 = lanes_below8(cols - 8);
    for (int r = 0; r < mr; r++) {
        _mm256_maskstore_ps(y + r * ldy, m0, a[r][0]);
        _mm256_maskstore_ps(y + r * ldy + 8, m1, a[r][1]);
    }
}

/* strips s0 .. s1 widened into wp and run against the M rows of x into y */
static void w16a_panel(const float *x, int64_t ldx, int64_t M, const uint16_t *q, int f16, int64_t N, int64_t K,
                       int64_t s0, int64_t s1, float *y, int64_t ldy, float *wp) {
    w16a_pack(q, f16, N, K, s0 * W16_AVX2_NR, s1 - s0, wp);
    for (int64_t m0 = 0; m0 < M; m0 += W16_AVX2_MR) {
        const int mr = M - m0 < W16_AVX2_MR ? (int)(M - m0) : W16_AVX2_MR;
        for (int64_t j = s0; j < s1; j++) {
            const float *wj = wp + (j - s0) * W16_AVX2_NR * K;
            float *yj = y + m0 * ldy + j * W16_AVX2_NR;
            const int64_t cols = N - j * W16_AVX2_NR;
            const float *xr = x + m0 * ldx;
            switch (mr) {  /* mr a constant in each instance */
                case 1: w16a_kernel(1, xr, ldx, wj, K, yj, ldy, cols); break;
                case 2: w16a_kernel(2, xr, ldx, wj, K, yj, ldy, cols); break;
                case 3: w16a_kernel(3, xr, ldx, wj, K, yj, ldy, cols); break;
                case 4: w16a_kernel(4, xr, ldx, wj, K, yj, ldy, cols); break;
                case 5: w16a_kernel(5, xr, ldx, wj, K, yj, ldy, cols); break;
                default: w16a_kernel(W16_AVX2_MR, xr, ldx, wj, K, yj, ldy, cols); break;
            }
        }
    }
}

/* y [M, ldy] = x [M, ldx] @ widen(q)^T; 0 done, -1 out of memory */
static int w16_gemm_avx2(const float *x, int64_t ldx, int64_t M, const uint16_t *q, int f16, int64_t N, int64_t K,
                         float *y, int64_t ldy, int num_threads) {
    const int64_t strips = (N + W16_AVX2_NR - 1) / W16_AVX2_NR;
    int64_t most = W16_AVX2_PANEL / (W16_AVX2_NR * K * (int64_t)sizeof(float));
    most = most < 1 ? 1 : most;
    const int64_t panels = panel_items(strips, most, num_threads);
    const int64_t chunk = (strips + panels - 1) / panels;
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        float *wp = aligned_alloc(64, (size_t)chunk * W16_AVX2_NR * K * sizeof(float));
        if (wp == NULL) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(static)")
        for (int64_t p = 0; p < panels; p++)
            if (wp != NULL) w16a_panel(x, ldx, M, q, f16, N, K, p * strips / panels, (p + 1) * strips / panels, y, ldy, wp);
        free(wp);
    }
    return failed ? -1 : 0;
}
#endif

/* y [M, ldy] = x [M, ldx] @ widen(w)^T for a 16-bit weight (f16: float16 values, else bfloat16) through widened
 * float32 panels: pre, packed once at load (atomd_qprepack_*, AVX-512 builds), or (pre NULL) q packed per call
 * (AVX-512's w16_gemm, AVX2's w16_gemm_avx2). 0 done; 1 not built here (the caller widens tiles for a BLAS); -1
 * out of memory. atomd_qgemm_*_panels / _prepacked (quant.c) and the fused batch's rows (layer_ops.c). */
static inline int w16_panels_product(const float *x, int64_t ldx, int64_t M, const uint16_t *q, const uint16_t *pre,
                                     int f16, int64_t N, int64_t K, float *y, int64_t ldy, int num_threads) {
#ifdef W16_PANELS
    return w16_gemm(x, ldx, M, pre ? NULL : q, pre, f16 ? W16_H16 : W16_B16, N, K, y, ldy, num_threads, 0, NULL, 0);
#elif defined(W16_PANELS_AVX2)
    return pre ? 1 : w16_gemm_avx2(x, ldx, M, q, f16, N, K, y, ldy, num_threads);
#else
    (void)x, (void)ldx, (void)M, (void)q, (void)pre, (void)f16, (void)N, (void)K, (void)y, (void)ldy, (void)num_threads;
    return 1;
#endif
}
