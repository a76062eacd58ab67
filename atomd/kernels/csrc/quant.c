/* Weight-only int8 / int4 linears with float32 activations, loaded by atomd/model/quant.py.
 *
 * y[m, n] = sum_k x[m, k] * w[n, k], where w[n, k] = q[n, k] * scale[n, g] + offset[n, g],
 * g = k / G (G the group size; G = K is per-channel int8; offset NULL: a symmetric format).
 * The weight is read packed and dequantised in registers, never into a float copy:
 *
 * - int8: q int8 [N, K] row-major, any K (a tail of K % LANES runs scalar);
 * - int4: q uint8 [N, K / 2] of values 0..15, each run of 32 values in 16 bytes as
 *   llama.cpp's Q4_0 packs them: byte i of a run holds value i in its low nibble and value
 *   i + 16 in its high one (one load, one mask and one shift give 32 values in order);
 *   K % G == 0 and G % 32 == 0.
 *
 * atomd_qgemm_*: M rows of x at once, up to QGEMM_ROWS at a time, so each dequantised weight
 * vector serves every row (batch-1 decode is M = 1; small-M GEMM up to the caller's cut-over,
 * past which atomd_qdequant_* gives float tiles of the weight to a BLAS matmul).
 * atomd_qdequant_*: rows n0..n1 of w as float32 [n1 - n0, K].
 *
 * Paths, by the build's ISA (atomd_quant_path): 2 AVX-512 (BW/VL), 1 AVX2 + FMA, 0 scalar.
 * Float32 sums in another order than a BLAS, so results agree with a float matmul of the
 * dequantised weight to float32 rounding, not bit for bit.
 */
#include "quant.h"
#include "quant_amx.h"
#include "quant_gemm.h"
#include "quant_w16.h"
#include "quant_w16_avx2.h"

/* x [M, ldx] float32, y [M, ldy] float32; scales / offsets [N, ceil(K / G)] (offsets may be NULL) */
#define QGEMM(BITS, q_t)                                                                                    \
    void atomd_qgemm_i##BITS(const float *x, int64_t ldx, int64_t M, const q_t *q, const float *scales,    \
                             const float *offsets, int64_t N, int64_t K, int64_t G, float *y, int64_t ldy,  \
                             int num_threads) {                                                              \
        qgemm_int_rows(x, ldx, M, q, BITS, scales, offsets, N, K, G, y, ldy, num_threads);                  \
    }

QGEMM(8, int8_t)
QGEMM(4, uint8_t)

/* 16-bit float weights (quant.h's row_b16 / row_h16): x [M, ldx], y [M, ldy] float32, q uint16 [N, K];
 * and rows n0..n1 of such a weight as float32 into out [n1 - n0, K] */
#define QGEMM16(NAME, F16, WIDEN)                                                                                \
    void atomd_qgemm_##NAME(const float *x, int64_t ldx, int64_t M, const uint16_t *q, int64_t N, int64_t K,     \
                            float *y, int64_t ldy, int num_threads) {                                            \
        qgemm_w16_rows(x, ldx, M, q, F16, N, K, y, ldy, num_threads);                                            \
    }                                                                                                            \
    void atomd_qdequant_##NAME(const uint16_t *q, int64_t K, int64_t n0, int64_t n1, float *out, int num_threads) { \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                                   \
        for (int64_t n = n0; n < n1; n++)                                                                        \
            for (int64_t k = 0; k < K; k++) out[(n - n0) * K + k] = WIDEN(q[n * K + k]);                         \
    }

QGEMM16(b16, 0, b16_to_float)
QGEMM16(h16, 1, h16_to_float)

/* The same product for many rows of x through packed, widened weight panels (quant_w16.h; quant.py's
 * QGEMM_W16_MIN_M), packed per call or (_prepacked) once at load by atomd_qprepack_w16 into pre
 * (uint16 [ceil(N / 32) * 32 * K], each build's layout; F16 1: float16 values, 0: bfloat16): 0 done; 1 not built here
 * (no AVX-512 or AVX2: the caller widens tiles for a BLAS); -1 out of memory */
#define QGEMM16_PANELS(NAME, F16)                                                                                \
    int atomd_qgemm_##NAME##_panels(const float *x, int64_t ldx, int64_t M, const uint16_t *q, int64_t N,       \
                                    int64_t K, float *y, int64_t ldy, int num_threads) {                         \
        return w16_panels_product(x, ldx, M, q, NULL, F16, N, K, y, ldy, num_threads);                         \
    }                                                                                                            \
    int atomd_qgemm_##NAME##_prepacked(const float *x, int64_t ldx, int64_t M, const uint16_t *pre, int64_t N,  \
                                       int64_t K, float *y, int64_t ldy, int num_threads) {                      \
        PREPACKED_OR_NOT(w16_panels_product(x, ldx, M, NULL, pre, F16, N, K, y, ldy, num_threads))              \
    }                                                                                                            \
    int atomd_qprepack_##NAME(const uint16_t *q, int64_t N, int64_t K, uint16_t *pre, int num_threads) {         \
        PREPACKED_OR_NOT((w16_prepack(q, N, K, F16, pre, num_threads), 0))                                       \
    }
#ifdef W16_PANELS
#define PANELS_OR_NOT(call) return call;
#else
#define PANELS_OR_NOT(call) return 1;
#endif
#if defined(W16_PANELS) || defined(W16_PANELS_AVX2) /* (each its own w16_prepack layout) */
#define PREPACKED_OR_NOT(call) return call;
#else
#define PREPACKED_OR_NOT(call) return 1;
#endif
QGEMM16_PANELS(b16, 0)
QGEMM16_PANELS(h16, 1)

/* out [M, ldo] = silu(x @ gate^T) * (x @ up^T) for a gate_up weight [2 * inter, K] (gate rows first, inter % 16 ==
 * 0) held as an AVX2 build's load-time strips (quant_w16_avx2.h w16_gemm_avx2_prepacked with silu; quant.qlinear_silu):
 * the bits of the _prepacked product then layer_ops.c's silu_mul. 0 done; 1 not built here (not an AVX2 build); -1
 * out of memory */
static int prepacked_silu(const float *x, int64_t ldx, int64_t M, const uint16_t *pre, int f16, int64_t inter,
                          int64_t K, float *out, int64_t ldo, int num_threads) {
#ifdef W16_PANELS_AVX2
    return w16_gemm_avx2_prepacked(x, ldx, M, pre, f16, 2 * inter, K, out, ldo, num_threads, 1, NULL);
#else
    (void)x, (void)ldx, (void)M, (void)pre, (void)f16, (void)inter, (void)K, (void)out, (void)ldo, (void)num_threads;
    return 1;
#endif
}
int atomd_qgemm_b16_prepacked_silu(const float *x, int64_t ldx, int64_t M, const uint16_t *pre, int64_t inter,
                                   int64_t K, float *out, int64_t ldo, int num_threads) {
    return prepacked_silu(x, ldx, M, pre, 0, inter, K, out, ldo, num_threads);
}
int atomd_qgemm_h16_prepacked_silu(const float *x, int64_t ldx, int64_t M, const uint16_t *pre, int64_t inter,
                                   int64_t K, float *out, int64_t ldo, int num_threads) {
    return prepacked_silu(x, ldx, M, pre, 1, inter, K, out, ldo, num_threads);
}

/* res [M, ldr] += x @ w^T, then out [M, ldo] = RMSNorm(res) * norm_w, for an output projection w [N, K] held as an
 * AVX2 build's load-time strips (w16_gemm_avx2_prepacked with a norm; quant.qlinear_add_norm): the bits of the
 * _prepacked product then layer_ops.c's rms_norm with it as delta, the norm on a block's rows while they are in L2.
 * 0 done; 1 not built here (not an AVX2 build); -1 out of memory */
static int prepacked_norm(const float *x, int64_t ldx, int64_t M, const uint16_t *pre, int f16, int64_t N, int64_t K,
                          float *res, int64_t ldr, const float *norm_w, float eps, float *out, int64_t ldo,
                          int num_threads) {
#ifdef W16_PANELS_AVX2
    const w16a_norm norm = {res, ldr, norm_w, eps};
    return w16_gemm_avx2_prepacked(x, ldx, M, pre, f16, N, K, out, ldo, num_threads, 0, &norm);
#else
    (void)x, (void)ldx, (void)M, (void)pre, (void)f16, (void)N, (void)K, (void)res, (void)ldr, (void)norm_w, (void)eps;
    (void)out, (void)ldo, (void)num_threads;
    return 1;
#endif
}
int atomd_qgemm_b16_prepacked_norm(const float *x, int64_t ldx, int64_t M, const uint16_t *pre, int64_t N, int64_t K,
                                   float *res, int64_t ldr, const float *norm_w, float eps, float *out, int64_t ldo,
                                   int num_threads) {
    return prepacked_norm(x, ldx, M, pre, 0, N, K, res, ldr, norm_w, eps, out, ldo, num_threads);
}
int atomd_qgemm_h16_prepacked_norm(const float *x, int64_t ldx, int64_t M, const uint16_t *pre, int64_t N, int64_t K,
                                   float *res, int64_t ldr, const float *norm_w, float eps, float *out, int64_t ldo,
                                   int num_threads) {
    return prepacked_norm(x, ldx, M, pre, 1, N, K, res, ldr, norm_w, eps, out, ldo, num_threads);
}

/* y [M, ldy] float32, unrounded = x [M, ldx] @ w^T for bf16 x and a bf16 weight w [N, K] (uint16 bits): float32
 * sums of the exact products, vdpbf16ps over packed pairs of inputs (quant_w16.h; linear.py's bf16 prefill on a
 * CPU without AMX tiles, and linear_f32, where quant.BF16_DOT). 0 done; 1 not built here (no AVX512_BF16); -1 out
 * of memory */
int atomd_gemm_bf16_panels(const uint16_t *x, int64_t ldx, int64_t M, const uint16_t *w, int64_t N, int64_t K,
                           float *y, int64_t ldy, int num_threads) {
#ifdef W16_BF16_PAIRS
    return w16_gemm(x, ldx, M, w, NULL, W16_PAIRS, N, K, y, ldy, num_threads, 0, NULL, 0);
#else
    (void)x, (void)ldx, (void)M, (void)w, (void)N, (void)K, (void)y, (void)ldy, (void)num_threads;
    return 1;
#endif
}

/* rows n0..n1 of the weight as float32 into out [n1 - n0, K] */
void atomd_qdequant_i8(const int8_t *q, const float *scales, const float *offsets, int64_t K, int64_t G, int64_t n0,
                       int64_t n1, float *out, int num_threads) {
    const int64_t groups = (K + G - 1) / G;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t n = n0; n < n1; n++) {
        const int8_t *qn = q + n * K;
        float *dst = out + (n - n0) * K;
        for (int64_t g0 = 0, gi = 0; g0 < K; g0 += G, gi++) {
            const int64_t g1 = g0 + G < K ? g0 + G : K;
            const float sc = scales[n * groups + gi], of = offsets ? offsets[n * groups + gi] : 0.0f;
            const vf vs = VSET1(sc), vo = VSET1(of);
            int64_t k = g0;
            for (; k + LANES <= g1; k += LANES) VSTORE(dst + k, VFMA(load_i8(qn + k), vs, vo));
            for (; k < g1; k++) dst[k] = (float)qn[k] * sc + of;
        }
    }
}

void atomd_qdequant_i4(const uint8_t *q, const float *scales, const float *offsets, int64_t K, int64_t G,
                       int64_t n0, int64_t n1, float *out, int num_threads) {
    const int64_t groups = K / G;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *qn = q + n * (K / 2);
        float *dst = out + (n - n0) * K;
        for (int64_t g = 0; g < groups; g++) {
            const vf vs = VSET1(scales[n * groups + g]), vo = VSET1(offsets ? offsets[n * groups + g] : 0.0f);
            for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
                vf w[I4_VECS];
                load_i4(qn + k / 2, w);
                for (int v = 0; v < I4_VECS; v++) VSTORE(dst + k + v * LANES, VFMA(w[v], vs, vo));
            }
        }
    }
}

/* int8 activations (quant.h): x [M, ldx] quantised row by row into the caller's scratch (xq
 * [M, K], xd [M, Q8_XD(K)], xsg [M, Q8_XSG(K)]), then y [M, ldy] = x @ w^T, each weight row
 * read once for up to Q8_ROWS rows of x (q8_weight_row) */
void atomd_qgemm_q8(const float *x, int64_t ldx, int64_t M, const void *q, int64_t bits, const float *scales,
                    const float *offsets, int64_t N, int64_t K, int64_t G, int64_t AB, float *y, int64_t ldy,
                    int8_t *xq, float *xd, float *xsg, int num_threads) {
    qgemm_q8_rows(x, ldx, M, q, (int)bits, scales, offsets, N, K, G, AB, y, ldy, xq, xd, xsg, num_threads);
}

/* The same product on AMX-INT8 tiles (quant_amx.h), M >= 2 rows of x: scratch xt [QAMX_XT bytes],
 * dt [QAMX_DT floats], xsgt [QAMX_XSG floats]. 0 done; 1 no tiles here (not built with AMX-INT8,
 * or Linux refuses them): the caller runs atomd_qgemm_q8; -1 out of memory. */
int atomd_qgemm_amx(const float *x, int64_t ldx, int64_t M, const void *q, int64_t bits, const float *scales,
                    const float *offsets, int64_t N, int64_t K, int64_t G, int64_t AB, float *y, int64_t ldy,
                    int8_t *xt, float *dt, float *xsgt, int num_threads) {
#if QAMX_PATH
    return qgemm_amx(x, ldx, M, q, (int)bits, scales, offsets, N, K, G, AB, y, ldy, xt, dt, xsgt, num_threads);
#else
    (void)x, (void)ldx, (void)M, (void)q, (void)bits, (void)scales, (void)offsets, (void)N, (void)K, (void)G, (void)AB;
    (void)y, (void)ldy, (void)xt, (void)dt, (void)xsgt, (void)num_threads;
    return 1;
#endif
}

/* The same product as a register-blocked GEMM (quant_gemm.h: AVX512-VNNI or AVX2), for CPUs without AMX-INT8,
 * from quant.py's q8_gemm_min_m rows of x: the scratch of atomd_qgemm_q8. 0 done; 1 not built here (neither ISA):
 * the caller runs atomd_qgemm_q8; -1 out of memory. */
int atomd_qgemm_q8_gemm(const float *x, int64_t ldx, int64_t M, const void *q, int64_t bits, const float *scales,
                        const float *offsets, int64_t N, int64_t K, int64_t G, int64_t AB, float *y, int64_t ldy,
                        int8_t *xq, float *xd, float *xsg, int num_threads) {
#if QV_PATH
    return qgemm_q8_gemm(x, ldx, M, q, (int)bits, scales, offsets, N, K, G, AB, y, ldy, xq, xd, xsg, num_threads);
#else
    (void)x, (void)ldx, (void)M, (void)q, (void)bits, (void)scales, (void)offsets, (void)N, (void)K, (void)G, (void)AB;
    (void)y, (void)ldy, (void)xq, (void)xd, (void)xsg, (void)num_threads;
    return 1;
#endif
}

/* An int8 / int4 weight's load-time strips (quant_gemm_avx2.h qv_hold; quant.keep_strips_only) into held
 * [(N + 7) / 8][QV_STRIP_BYTES(K, G, bits)]: 0 done, 1 not built here (not an AVX2 build) */
int atomd_qhold_q8(const void *q, int64_t bits, const float *scales, const float *offsets, int64_t N, int64_t K,
                   int64_t G, uint8_t *held, int num_threads) {
#ifdef QV_HELD
    qv_hold(q, (int)bits, scales, offsets, N, K, G, held, num_threads);
    return 0;
#else
    (void)q, (void)bits, (void)scales, (void)offsets, (void)N, (void)K, (void)G, (void)held, (void)num_threads;
    return 1;
#endif
}

/* y [M, ldy] = x [M, ldx] @ w^T for a weight held as its strips (atomd_qhold_q8), at any M: the GEMM's bits; the
 * scratch of atomd_qgemm_q8. 0 done, 1 not built here */
int atomd_qgemm_q8_held(const float *x, int64_t ldx, int64_t M, const uint8_t *held, int64_t bits, int64_t N,
                        int64_t K, int64_t G, int64_t AB, float *y, int64_t ldy, int8_t *xq, float *xd, float *xsg,
                        int num_threads) {
#ifdef QV_HELD
    qv_held_gemm(x, ldx, M, held, (int)bits, N, K, G, AB, y, ldy, xq, xd, xsg, num_threads);
    return 0;
#else
    (void)x, (void)ldx, (void)M, (void)held, (void)bits, (void)N, (void)K, (void)G, (void)AB, (void)y, (void)ldy;
    (void)xq, (void)xd, (void)xsg, (void)num_threads;
    return 1;
#endif
}

/* the bytes of one strip of atomd_qhold_q8's layout (0: not built here) */
int64_t atomd_qhold_strip_bytes(int64_t K, int64_t G, int64_t bits) {
#ifdef QV_HELD
    return QV_STRIP_BYTES(K, G, bits);
#else
    (void)K, (void)G, (void)bits;
    return 0;
#endif
}

/* which GEMM atomd_qgemm_q8_gemm runs here: 3 AVX512-VNNI, 1 AVX2, 0 none (the Q8_PATH numbers) */
int atomd_quant_q8_gemm(void) { return QV_PATH; }

/* The same product widened (quant_amx.h's qgemm_wide: x and the dequantised weight rounded to bf16, bf16
 * AMX tiles, float32 sums), for many rows of x (quant.py's QGEMM_WIDE_MIN_M); K and G multiples of 32.
 * 0 done; 1 not here (not built with the bf16 tiles, or Linux refuses them); -1 out of memory. */
int atomd_qgemm_wide(const float *x, int64_t ldx, int64_t M, const void *q, int64_t bits, const float *scales,
                     const float *offsets, int64_t N, int64_t K, int64_t G, float *y, int64_t ldy, int num_threads) {
#if QAMX_WIDE
    return qgemm_wide(x, ldx, M, q, (int)bits, scales, offsets, N, K, G, y, ldy, num_threads);
#else
    (void)x, (void)ldx, (void)M, (void)q, (void)bits, (void)scales, (void)offsets, (void)N, (void)K, (void)G;
    (void)y, (void)ldy, (void)num_threads;
    return 1;
#endif
}

/* 1 when atomd_qgemm_wide runs here: built with the bf16 tiles and granted by Linux */
int atomd_quant_wide(void) {
#if QAMX_WIDE
    return amx_granted();
#else
    return 0;
#endif
}

/* y16 [M, ldy16] bf16 = x [M, ldx] @ w^T rounded once, for bf16 x and a bf16 weight w [N, K] (uint16 bits), each
 * sliver of rows' float32 sums rounded to bf16 as they are done, as torch rounds (linear.py's bf16 prefill on a CPU
 * with AVX512_BF16 but no AMX tiles): dot 0, the float32 FMAs of atomd_qgemm_b16_panels with x widened a sliver of
 * rows at a time inside the call (not a float32 copy of x); dot 1, atomd_gemm_bf16_panels' vdpbf16ps. The bits of
 * those two on x (widened) rounded by torch. y: float32 [M, ldy] for the unrounded sums where K is past one k-block
 * (atomd_w16_kc() inputs; with dot twice that), else NULL (they stay in a per-thread sliver). 0 done; 1 not built
 * here (no AVX-512; dot: no AVX512_BF16); -1 out of memory */
int atomd_gemm_bf16_rounded(const uint16_t *x, int64_t ldx, int64_t M, const uint16_t *w, int64_t N, int64_t K,
                            float *y, int64_t ldy, uint16_t *y16, int64_t ldy16, int dot, int num_threads) {
#ifdef W16_BF16_PAIRS
    if (dot) return w16_gemm(x, ldx, M, w, NULL, W16_PAIRS, N, K, y, ldy, num_threads, 0, y16, ldy16);
#else
    if (dot) return 1;
#endif
    PANELS_OR_NOT(w16_gemm(x, ldx, M, w, NULL, W16_B16, N, K, y, ldy, num_threads, 1, y16, ldy16))
}

/* inputs of one k-block of atomd_gemm_bf16_rounded (past it, the caller passes float32 y for the sums) */
int64_t atomd_w16_kc(void) {
#ifdef W16_PANELS
    return W16_KC;
#else
    return 0;
#endif
}

/* 1 when atomd_gemm_bf16_panels runs here (a build with AVX512_BF16) */
int atomd_quant_bf16_panels(void) {
#ifdef W16_BF16_PAIRS
    return 1;
#else
    return 0;
#endif
}

/* 1 when atomd_qgemm_b16_panels / _h16_panels and their load-time and bf16-x forms run here (an AVX-512 build);
 * 2 the per-call and load-time panels of float32 x (an AVX2 build, quant_w16_avx2.h); 0 none */
int atomd_quant_w16_panels(void) { return w16_panels_kind(); }

/* 1 when atomd_qgemm_amx runs on tiles here: built with AMX-INT8 and granted by Linux */
int atomd_quant_amx(void) {
#if QAMX_PATH
    return amx_granted();
#else
    return 0;
#endif
}

int atomd_quant_path(void) { return QUANT_PATH; }
/* the int8-activation path: 3 AVX512-VNNI, 2 AVX-512 BW, 1 AVX2, 0 scalar */
int atomd_quant_q8_path(void) { return Q8_PATH; }
