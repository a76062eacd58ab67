/* Part of quant.c and layer_ops.c: int8 / int4 weights times int8 activations as a register-blocked GEMM
 * from quant.py's q8_gemm_min_m rows of x on (batch decode and prefill), on CPUs without AMX-INT8 tiles.
 * The ISA's half packs the weight and runs the micro-kernel: quant_vnni.h (AVX512-VNNI, QV_PATH 3) or
 * quant_gemm_avx2.h (AVX2, QV_PATH 1); each gives QV_NR (output columns a strip), QV_XD_ROW(K, AB) (the
 * floats of d a row of x), qv_quantize, qv_pack and qv_strip. This file shares the weight out: each
 * thread packs a panel of about QV_PANEL bytes of strips (L2-resident; nothing kept past the call: the
 * weight's memory does not grow) and runs every QV_MR rows of x (L1) against every strip of it. */
#include "quant_vnni.h"
#include "quant_gemm_avx2.h"
#ifndef QV_PATH
#define QV_PATH 0
#endif
#if QV_PATH
#ifndef QV_PANEL
#define QV_PANEL (256 << 10)  /* packed weight bytes a work item */
#endif

#define QV_PANEL_BYTES(strips, K) ((size_t)(strips) * QV_NR * (K))
#define QV_PANEL_FLOATS(strips, groups) ((size_t)(strips) * 2 * (groups) * QV_NR)
/* the most strips a panel of K inputs holds (QV_PANEL bytes, at least one) */
#define QV_MOST(K) (QV_PANEL / (QV_NR * (K)) < 1 ? 1 : QV_PANEL / (QV_NR * (K)))

/* strips s0 .. s1 of the weight (columns QV_NR s0 ..) packed into wp / sc (QV_PANEL_BYTES / QV_PANEL_FLOATS
 * of s1 - s0 strips) and run against M rows of x quantised by qv_quantize (xq, d, xsg) into y [M, ldy]: one
 * thread's work item (qgemm_q8_gemm's panels) */
static void qv_panel(const void *q, int bits, const float *scales, const float *offsets, int64_t N, int64_t K, int64_t G,
                     int64_t AB, int64_t M, int64_t s0, int64_t s1, const int8_t *xq, const float *d, const float *xsg,
                     float *y, int64_t ldy, uint8_t *wp, float *sc) {
    const int64_t groups = K / G;
    qv_pack(q, bits, scales, offsets, N, K, G, s0 * QV_NR, s1 - s0, wp, sc);
#if QV_PREFETCH_NEXT
    /* the next panel's weight bytes (this thread's next work item under a static schedule) into L2, a slice
     * after each strip run: its packing then reads L2, not memory (packing reads a panel's 8 rows without
     * computing, so its misses overlapped nothing) */
    const size_t row_bytes = bits == 8 ? (size_t)K : (size_t)K / 2, next = (size_t)(s1 * QV_NR) * row_bytes;
    const size_t end = (size_t)N * row_bytes, span = (size_t)(s1 - s0) * QV_NR * row_bytes;
    const size_t runs = (size_t)((M + QV_MR - 1) / QV_MR * (s1 - s0)), slice = (span / runs + 63) & ~(size_t)63;
    size_t ahead = next;
#endif
    for (int64_t m0 = 0; m0 < M; m0 += QV_MR) {  /* QV_MR rows of x (L1) against every strip of the panel (L2) */
        const int mr = M - m0 < QV_MR ? (int)(M - m0) : QV_MR;
        for (int64_t j = s0; j < s1; j++) {
#if QV_PREFETCH_NEXT
            for (const size_t stop = ahead + slice; ahead < stop && ahead < end && ahead < next + span; ahead += 64)
                _mm_prefetch((const char *)q + ahead, _MM_HINT_T1);
#endif
            qv_strip(mr, bits, wp + (j - s0) * QV_NR * K, sc + (j - s0) * 2 * groups * QV_NR, xq + m0 * K,
                     d + m0 * QV_XD_ROW(K, AB), xsg + m0 * Q8_XSG(K), K, G, AB, y + m0 * ldy + j * QV_NR, ldy,
                     N - j * QV_NR);
        }
    }
}

/* y [M, ldy] = x [M, ldx] @ w^T on one thread, panel after panel: the int8 MoE experts' (moe_q8.h), the same
 * bits as qgemm_q8_gemm's; scratch the rows' (xq, xd, xsg) and a panel's, wp [QV_PANEL_BYTES(QV_MOST(K), K)]
 * and sc [QV_PANEL_FLOATS(QV_MOST(K), K / G)] */
static inline void qv_gemm1(const float *x, int64_t M, const void *q, int bits, const float *scales,
                            const float *offsets, int64_t N, int64_t K, int64_t G, int64_t AB, float *y, int8_t *xq,
                            float *xd, float *xsg, uint8_t *wp, float *sc) {
    qv_quantize(x, K, M, K, G, AB, bits, xq, xd, xsg, 1);
    const int64_t strips = (N + QV_NR - 1) / QV_NR;
    for (int64_t s0 = 0; s0 < strips; s0 += QV_MOST(K))
        qv_panel(q, bits, scales, offsets, N, K, G, AB, M, s0, s0 + QV_MOST(K) < strips ? s0 + QV_MOST(K) : strips, xq,
                 xd, xsg, y, N, wp, sc);
}

/* y [M, ldy] = x [M, ldx] @ w^T; scratch the rows': xq [M, K], xd [M, Q8_XD(K)] (holds QV_XD_ROW), xsg
 * [M, Q8_XSG(K)]. Returns 0, or -1 out of memory. */
static int qgemm_q8_gemm(const float *x, int64_t ldx, int64_t M, const void *q, int bits, const float *scales,
                         const float *offsets, int64_t N, int64_t K, int64_t G, int64_t AB, float *y, int64_t ldy,
                         int8_t *xq, float *xd, float *xsg, int num_threads) {
    qv_quantize(x, ldx, M, K, G, AB, bits, xq, xd, xsg, num_threads);
    const int64_t strips = (N + QV_NR - 1) / QV_NR;
    const int64_t panels = panel_items(strips, QV_MOST(K), num_threads);  /* of at most QV_PANEL bytes */
    const int64_t chunk = (strips + panels - 1) / panels;  /* strips a panel, the last ones one fewer */
    int failed = 0;
    _Pragma("omp parallel num_threads(num_threads)")
    {
        uint8_t *wp = aligned_alloc(64, QV_PANEL_BYTES(chunk, K));
        float *sc = aligned_alloc(64, sizeof(float) * QV_PANEL_FLOATS(chunk, K / G));
        if (wp == NULL || sc == NULL) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(static)")
        for (int64_t p = 0; p < panels; p++)
            if (wp != NULL && sc != NULL)
                qv_panel(q, bits, scales, offsets, N, K, G, AB, M, p * strips / panels, (p + 1) * strips / panels, xq,
                         xd, xsg, y, ldy, wp, sc);
        free(wp);
        free(sc);
    }
    return failed ? -1 : 0;
}
#endif
