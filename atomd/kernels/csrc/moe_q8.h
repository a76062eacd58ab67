/* Part of layer_ops.c's translation unit, included by it only (after quant.h and the SiLU rows:
 * silu_mul_row, silu_mul_row_bf16, float_to_bf16).
 *
 * atomd_moe_q8: an MoE block's int8 / int4 experts (atomd/model/quant.py's QuantizedWeights,
 * `--quantization int8|int4 --quantized-activations int8`) over one or several tokens in one call
 * (atomd/model/moe.py: moe(), its batch-1 form and grouped_experts), where each expert's two
 * linears otherwise run as two qlinear calls and a SiLU call from Python. moe_grouped's arguments
 * (experts, starts, tokens, dest, scales, pairs) and results, the weights as two arrays of
 * atomd_qweight (one per expert slot, pointing at the experts' own packed integers and scales:
 * no copy of the experts is made, and a token reads only its experts' bytes).
 *
 * Work items are (expert, up to Q8_CHUNK of its rows), shared dynamically by the threads; per item
 * its token rows are gathered (bf16 widened), gate_up runs, SiLU-and-mul (layer_ops' own rows),
 * down runs, and each pair's row is written (rounded and scaled where the per-expert torch ops
 * round: bf16 models round gate_up's output, silu's, the down output and the scaled pair). Each
 * linear runs as qlinear would run it on the item's rows: on AMX-INT8 tiles (quant_amx.h:
 * qamx_quantize and qamx_ntile, x quantised per act block as quantize_row_q8 does) from
 * `min_m[0]` rows an expert (int4 linears; `min_m[1]` int8 ones: quant.py's QGEMM_AMX_MIN_M) where the build and
 * the process have them, else the int8 GEMM of quant_gemm.h (VNNI or AVX2) from that many rows (quant.py's
 * q8_gemm_min_m), below them the int8-activation rows of quant.h (gemv4_q8 for one row of x, q8_weight_row: VNNI,
 * AVX-512 BW or AVX2 by the build). Every row's products and sums are those of a qlinear call over
 * the expert's rows alone, so the pairs equal the per-expert path's to the bit.
 * 16-bit experts (bf16 / float16 weights, `--quantization bf16|fp16` or `--dtype auto` on a CPU without
 * AVX512_BF16: float activations, no int8) run in the same call: each linear as qlinear runs it on the
 * item's expert's rows, from `w16_min` rows of the expert (quant.py's QGEMM_W16_MIN_M; 0 never) the panels
 * packed per call (quant_w16.h's w16_gemm on this thread), below that the rows of quant.h (row_w16); on an AVX2 build
 * the strips packed at load (quant_w16_avx2.h; the weight's only copy, quant.keep_strips_only) at every m: the
 * per-expert path's bits, without its two qlinear calls and a SiLU call an expert from Python (which left
 * such experts slower than float32 ones at decode: benchmarks/RESULTS.md, #35 the MoE shape's 16-bit experts).
 * Returns 0, -1 (no scratch memory) or 1 (not built, atomd_moe_q8_kind 0: the caller runs the experts
 * one by one). */
#include <stdlib.h>
#include <string.h>

#include "moe_items.h"
#define Q8_CHUNK 128 /* rows an item */

#if defined(__AVX512F__) || QUANT_PATH == 1  /* AVX-512, or AVX2 (Zen 3): the rows, the GEMM, the strips */
#if QAMX_PATH
#define MOE_Q8_TILES 1
#else
#define MOE_Q8_TILES 0
#endif

typedef struct {  /* one thread's scratch (sizes for the largest item's rows and K up to kmax) */
    float *x, *gu, *act, *y;
    bf16_t *gu16, *act16;
    int8_t *xq, *xt, *a;
    float *xd, *xsg, *dt, *xsgt;
    uint8_t *wp;  /* the int8 GEMM's panel (quant_gemm.h), its scales and offsets in sc */
    float *sc;
} moe_q8_scratch;

#define QW_16BIT(w) ((w)->bits == 16 || (w)->bits == QBITS_F16)

/* y [m, N] = x [m, K] @ w^T for a 16-bit weight as qlinear runs it on m rows: an AVX2 build's load-time strips where
 * the weight is held as them (w->panels, q NULL) at every m, else the panels packed per call from w16_min rows (0:
 * never), else quant.h's rows. 0 done, -1 no scratch for the panels or the packed rows */
static int moe_w16_linear(const atomd_qweight *w, const float *x, int64_t m, int64_t N, int64_t K, float *y,
                          int64_t w16_min) {
    const int f16 = w->bits == QBITS_F16;
    const uint16_t *q = (const uint16_t *)w->q;
#ifdef W16_PANELS
    if (w16_min > 0 && m >= w16_min)
        return w16_gemm(x, K, m, q, NULL, f16 ? W16_H16 : W16_B16, N, K, y, N, 1, 0, NULL, 0);
#elif defined(W16_PANELS_AVX2)
    if (w->panels != NULL)
        return w16a_strips(f16 ? W16A_H16 : W16A_B16, x, K, m, (const uint16_t *)w->panels, N, K, 0,
                           (N + W16_AVX2_NR - 1) / W16_AVX2_NR, y, N, NULL);
    if (w16_min > 0 && m >= w16_min) return w16_gemm_avx2(x, K, m, q, f16, N, K, y, N, 1);
#else
    (void)w16_min;
#endif
    for (int64_t n = 0; n < N; n++) w16_weight_row(x, K, m, q, K, n, y, N, f16);
    return 0;
}

/* y [m, N] = x [m, K] @ w^T (int8 / int4 w) as qlinear runs it on m rows: tiles from min_m rows (x already quantised
 * into s's tiles where `quantised`), without them the int8 GEMM from that many rows (`gemm`), else the rows */
static void moe_q8_linear(const atomd_qweight *w, const float *x, int64_t m, int64_t N, int64_t K, float *y,
                          const moe_q8_scratch *s, int tiles, int quantised, int gemm) {
    const int bits = (int)w->bits;
#ifdef QV_HELD
    if (w->q == NULL) {  /* held as its load-time strips only (quant.keep_strips_only): them at every m */
        qv_held1(x, m, (const uint8_t *)w->panels, bits, N, K, w->group, w->ablock, y, s->xq, s->xd, s->xsg);
        return;
    }
#endif
#if QV_PATH
    if (gemm) {
        qv_gemm1(x, m, w->q, bits, w->scales, w->offsets, N, K, w->group, w->ablock, y, s->xq, s->xd, s->xsg, s->wp,
                 s->sc);
        return;
    }
#else
    (void)gemm;
#endif
#if MOE_Q8_TILES
    if (tiles) {
        if (!quantised) qamx_quantize(x, K, m, K, w->group, w->ablock, s->xt, s->dt, s->xsgt, 1);
        for (int64_t nt = 0; nt < (N + 15) / 16; nt++)
            qamx_ntile(w->q, bits, w->scales, w->offsets, N, K, w->group, w->ablock, m, nt, s->xt, s->dt, s->xsgt, s->a,
                       y, N);
        return;
    }
#else
    (void)tiles, (void)quantised;
#endif
    for (int64_t r = 0; r < m; r++)
        quantize_row_q8(x + r * K, K, w->group, w->ablock, bits, s->xq + r * K, s->xd + r * Q8_XD(K),
                        s->xsg + r * Q8_XSG(K));
    if (m == 1 && Q8_GEMV4(N, bits)) {
        for (int64_t i = 0; i < (N + Q8_R - 1) / Q8_R; i++)
            gemv4_q8(w->q, bits, w->scales, w->offsets, N, K, w->group, w->ablock, s->xq, s->xd, s->xsg, i, y);
        return;
    }
    for (int64_t n = 0; n < N; n++)
        q8_weight_row(w->q, bits, w->scales, w->offsets, K, w->group, w->ablock, n, m, s->xq, s->xd, s->xsg, y, N);
}

/* one row x through an expert's linear w [N, K] (int8 / int4 with int8 activations, or 16-bit) as an item of one
 * row runs it above, on this thread (_own) or with its rows shared by the caller's parallel region's threads
 * (_rows: an orphaned omp for, atomd_qgemv_rows' arithmetic for one row, the same): the fused batch-1 layer's
 * quantized MoE experts (layer_ops.c QUANT_EXPERT, DecodeLayer); x quantised into each thread's own row
 * (quant.h q8_own: K up to Q8_OWN_K, which the caller checks) */
static void moe_q_expert_own(const float *x, const atomd_qweight *w, float *y, int64_t K, int64_t N) {
    if (QW_16BIT(w)) {
        moe_w16_linear(w, x, 1, N, K, y, 0);
        return;
    }
    const moe_q8_scratch s = {.xq = q8_own.xq, .xd = q8_own.xd, .xsg = q8_own.xsg};
    moe_q8_linear(w, x, 1, N, K, y, &s, 0, 0, 0);
}
static void moe_q_expert_rows(const float *x, const atomd_qweight *w, float *y, int64_t K, int64_t N) {
    atomd_qweight q = *w;
    if (!QW_16BIT(w)) q.xq = q8_own.xq;  /* int8 activations (atomd_qgemv_rows quantises into q8_own) */
    atomd_qgemv_rows(x, &q, NULL, y, K, N);
}

#if MOE_Q8_TILES
/* An item's m token rows (tok) in qamx_quantize's tile layout (xt, dt, xsgt; rows past m zero, d and
 * xsg 0, as qamx_quantize leaves them), copied from every token's tiles (all_*: qamx_quantize's over
 * all the block's tokens): the same bytes and floats as quantising the rows here */
static void qamx_gather(const int8_t *all_xt, const float *all_dt, const float *all_xsg, const int64_t *tok,
                        int64_t m, int64_t K, int64_t G, int8_t *xt, float *dt, float *xsgt) {
    const int64_t nb = K / Q8_BLOCK, groups = K / G;
    for (int64_t r = 0; r < (m + 15) / 16 * 16; r++) {
        int8_t *xb = xt + (r / 16) * nb * 512 + (r % 16) * 4;
        float *db = dt + (r / 16) * nb * 16 + r % 16, *sg = xsgt + (r / 16) * groups * 16 + r % 16;
        const int64_t t = r < m ? tok[r] : 0;
        const int8_t *sb = all_xt + (t / 16) * nb * 512 + (t % 16) * 4;
        const float *sd = all_dt + (t / 16) * nb * 16 + t % 16, *ss = all_xsg + (t / 16) * groups * 16 + t % 16;
        for (int64_t b = 0; b < nb; b++) {
            for (int k4 = 0; k4 < 8; k4++) {
                if (r < m) memcpy(xb + b * 512 + k4 * 64, sb + b * 512 + k4 * 64, 4);
                else memset(xb + b * 512 + k4 * 64, 0, 4);
            }
            db[b * 16] = r < m ? sd[b * 16] : 0.0f;
        }
        for (int64_t g = 0; g < groups; g++) sg[g * 16] = r < m ? ss[g * 16] : 0.0f;
    }
}
#endif

#if MOE_Q8_TILES && MOE_AMX && QAMX_WIDE
#define MOE_Q8_WIDE 1
/* rows an item where experts are widened: each item widens its expert once, then runs moe_amx's items of
 * AMX_CHUNK rows over it (bigger ones left the weights' L2 to the rows' A tiles: 4096 tokens 1.3x slower) */
#define Q8_WIDE_CHUNK 1024

#else
#define MOE_Q8_WIDE 0
#endif

int atomd_moe_q8(const void *x, int is_bf16, const atomd_qweight *gate_up, const atomd_qweight *down,
                 const int64_t *experts, const int64_t *starts, const int64_t *tokens, const int64_t *dest,
                 const void *scales, void *pairs, int f32_pairs, int64_t hidden, int64_t inter, int64_t n_experts,
                 const int64_t *min_m, int64_t wide_min, int64_t w16_min, int num_threads) {
#define Q8_MIN_M(w) min_m[(w)->bits == 4 ? 0 : 1]  /* the rows an expert from which linear w leaves the rows */
#if MOE_Q8_WIDE
    const int wide_ok = wide_min > 0 && amx_granted();
#else
    const int wide_ok = 0;
#endif
#define Q8_WIDE_EXPERT(g) (wide_ok && starts[(g) + 1] - starts[(g)] >= wide_min && !QW_16BIT(gate_up + experts[(g)]))
    int any_wide = 0;
    for (int64_t g = 0; g < n_experts; g++) any_wide |= Q8_WIDE_EXPERT(g);
#if MOE_Q8_WIDE
    const int64_t chunk = any_wide ? Q8_WIDE_CHUNK : Q8_CHUNK;
#else
    const int64_t chunk = Q8_CHUNK;
#endif
    int64_t items, ch;  /* ch: the largest item's rows, the scratch's */
    int64_t *item_g = moe_items(starts, n_experts, chunk, &items, &ch);
    if (item_g == NULL) return -1;
    const int64_t n_gu = 2 * inter, kmax = hidden > inter ? hidden : inter;
#if MOE_Q8_TILES
    const int granted = amx_granted();
#else
    const int granted = 0;
#endif
    /* more tile rows than tokens (a prefill's k pairs a token): every token quantised once, in the tile
     * layout, and each item's rows gathered from it, where each item would quantise its own rows (the
     * same values: quantisation is per row); where every expert's gate_up has one group size */
    int8_t *all_xt = NULL;
    float *all_dt = NULL, *all_xf = NULL;
    int64_t n_tok = 0, tile_rows = 0;
#if MOE_Q8_TILES
    const int64_t G = n_experts ? gate_up[experts[0]].group : Q8_BLOCK, AB = n_experts ? gate_up[experts[0]].ablock : Q8_BLOCK;
    int one_group = 1;
    for (int64_t g = 0; g < n_experts; g++) {
        one_group &= gate_up[experts[g]].group == G && gate_up[experts[g]].ablock == AB;
        for (int64_t r = starts[g]; r < starts[g + 1] && !Q8_WIDE_EXPERT(g); r += chunk)
            tile_rows += starts[g + 1] - starts[g] >= Q8_MIN_M(gate_up + experts[g]) && !QW_16BIT(gate_up + experts[g])
                             ? (starts[g + 1] - r < chunk ? starts[g + 1] - r : chunk) : 0;
    }
    for (int64_t p = 0; p < starts[n_experts]; p++) n_tok = tokens[p] >= n_tok ? tokens[p] + 1 : n_tok;
    if (granted && one_group && tile_rows > n_tok) {
        all_xt = malloc(QAMX_XT(n_tok, hidden));
        all_dt = malloc(sizeof(float) * 2 * QAMX_DT(n_tok, hidden));  /* d per block, then xsg per group */
        all_xf = is_bf16 ? malloc(sizeof(float) * n_tok * hidden) : NULL;
        if (all_xt == NULL || all_dt == NULL || (is_bf16 && all_xf == NULL)) {
            free(all_xt), free(all_dt), free(all_xf), free(item_g);
            return -1;
        }
        if (is_bf16)
            for (int64_t i = 0; i < n_tok * hidden; i++) all_xf[i] = bf16_to_float(((const bf16_t *)x)[i]);
        qamx_quantize(is_bf16 ? all_xf : (const float *)x, hidden, n_tok, hidden, G, AB, all_xt, all_dt,
                      all_dt + QAMX_DT(n_tok, hidden), num_threads);
    }
#endif
    int failed = 0;
#pragma omp parallel num_threads(items < num_threads ? (int)(items > 0 ? items : 1) : num_threads)
    {
        moe_q8_scratch s = {0};
        const size_t floats = (size_t)ch * (hidden + n_gu + inter + hidden + Q8_XD(kmax) + Q8_XSG(kmax));
        s.x = malloc(sizeof(float) * floats);
        s.xq = malloc((size_t)ch * kmax);
        s.gu16 = is_bf16 ? malloc(sizeof(bf16_t) * ch * (n_gu + inter)) : NULL;
        int ready = s.x != NULL && s.xq != NULL && (!is_bf16 || s.gu16 != NULL);
#if QV_PATH
        if (!granted) {  /* a panel of either linear's (groups of 32 inputs at least) */
            const size_t bytes_h = QV_PANEL_BYTES(QV_MOST(hidden), hidden), bytes_i = QV_PANEL_BYTES(QV_MOST(inter), inter);
            const size_t floats_h = QV_PANEL_FLOATS(QV_MOST(hidden), hidden / Q8_BLOCK);
            const size_t floats_i = QV_PANEL_FLOATS(QV_MOST(inter), inter / Q8_BLOCK);
            s.wp = aligned_alloc(64, bytes_h > bytes_i ? bytes_h : bytes_i);
            s.sc = aligned_alloc(64, sizeof(float) * (floats_h > floats_i ? floats_h : floats_i));
            ready = ready && s.wp != NULL && s.sc != NULL;
        }
#endif
#if MOE_Q8_TILES
        if (granted) {
            s.xt = malloc(QAMX_XT(ch, kmax));
            s.a = aligned_alloc(64, (size_t)(kmax / Q8_BLOCK) * 512);
            s.dt = malloc(sizeof(float) * 2 * QAMX_DT(ch, kmax));  /* d per block; xsg per group (>= 32) */
            s.xsgt = s.dt ? s.dt + QAMX_DT(ch, kmax) : NULL;
            ready = ready && s.xt != NULL && s.a != NULL && s.dt != NULL;
        }
#endif
#if MOE_Q8_WIDE
        /* widened items: the expert's weights as bf16 tiles (gate_up, then down), the rows' A tiles, the
         * products' A tiles; a row and one block's sums */
        bf16_t *wbuf = NULL, *xa = NULL, *act = NULL;
        float *blk = NULL;
        int64_t have = -1;  /* the expert in wbuf */
        if (any_wide) {
            wbuf = aligned_alloc(64, sizeof(bf16_t) * ((n_gu + inter) * hidden + AMX_CHUNK * (hidden + inter)));
            xa = wbuf ? wbuf + (n_gu + inter) * hidden : NULL, act = xa ? xa + AMX_CHUNK * hidden : NULL;
            blk = malloc(sizeof(float) * (1024 + 2 * inter));
            ready = ready && wbuf != NULL && blk != NULL;
        }
#endif
        int config = 0;  /* the tiles' configuration: 1 amx_configure's (bf16), else qamx_configure's k-step (int8) */
        if (!ready) {
#pragma omp atomic write
            failed = 1;
        } else {
            s.gu = s.x + ch * hidden, s.act = s.gu + ch * n_gu, s.y = s.act + ch * inter;
            s.xd = s.y + ch * hidden, s.xsg = s.xd + ch * Q8_XD(kmax);
            s.act16 = s.gu16 ? s.gu16 + ch * n_gu : NULL;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!ready) continue;
            const int64_t g = item_g[it];
            int64_t p0;
            const int64_t m = moe_item_rows(item_g, starts, it, chunk, &p0);
            /* by the expert's rows, as qlinear over them decides (an item's bits do not depend on its rows) */
            const int64_t rows_g = starts[g + 1] - starts[g];
            const atomd_qweight *wg = gate_up + experts[g], *wd = down + experts[g];
            const int w16 = QW_16BIT(wg);  /* 16-bit experts: float activations, neither tiles nor the VNNI GEMM */
            /* tiles: both linears (one min_m where granted); the GEMM: each by its own bits' rows */
            const int tiles = !w16 && granted && rows_g >= Q8_MIN_M(wg);
            const int gemm = !w16 && QV_PATH && !granted && rows_g >= Q8_MIN_M(wg);
            const int gemm_d = !w16 && QV_PATH && !granted && rows_g >= Q8_MIN_M(wd);
#if MOE_Q8_WIDE
            if (Q8_WIDE_EXPERT(g)) {  /* bf16 tiles over the dequantised weights (atomd_moe_q8_kind) */
                if (config != 1) amx_configure(), config = 1;
                if (have != experts[g]) {
                    qamx_widen(wg->q, (int)wg->bits, wg->scales, wg->offsets, n_gu, hidden, wg->group, 0, n_gu / 16, wbuf);
                    qamx_widen(wd->q, (int)wd->bits, wd->scales, wd->offsets, hidden, inter, wd->group, 0, hidden / 16,
                               wbuf + n_gu * hidden);
                    have = experts[g];
                }
                for (int64_t s0 = 0; s0 < m; s0 += AMX_CHUNK) {
                    const int64_t ms = m - s0 < AMX_CHUNK ? m - s0 : AMX_CHUNK, q0 = p0 + s0;
                    for (int64_t r = 0; r < (ms + 15) / 16 * 16; r++) {
                        const int64_t t = r < ms ? tokens[q0 + r] : 0;
                        if (r >= ms) amx_put_row(xa, r, NULL, hidden);
                        else if (is_bf16) amx_put_row(xa, r, (const bf16_t *)x + t * hidden, hidden);
                        else amx_put_row_f32(xa, r, (const float *)x + t * hidden, hidden);
                    }
                    if (is_bf16)
                        amx_item(xa, ms, wbuf, wbuf + n_gu * hidden, hidden, inter, 1, s.gu, act, blk + 1024, blk, q0,
                                 dest, scales, pairs, f32_pairs);
                    else
                        amx_item(xa, ms, wbuf, wbuf + n_gu * hidden, hidden, inter, 0, s.gu, act, blk + 1024, blk, q0,
                                 dest, scales, pairs, f32_pairs);
                }
                continue;
            }
#endif
#if MOE_Q8_TILES
            const int kw = QAMX_KW(wg->ablock), kwd = QAMX_KW(wd->ablock);
            if (tiles && config != kw) qamx_configure(kw), config = kw;
#else
            (void)config;
#endif
            const int quantised = tiles && all_xt != NULL;
#if MOE_Q8_TILES
            if (quantised)
                qamx_gather(all_xt, all_dt, all_dt + QAMX_DT(n_tok, hidden), tokens + p0, m, hidden, G, s.xt, s.dt,
                            s.xsgt);
#endif
            for (int64_t r = 0; r < m && !quantised; r++) {  /* the item's token rows, as float32 */
                const int64_t t = tokens[p0 + r];
                if (is_bf16)
                    for (int64_t i = 0; i < hidden; i++) s.x[r * hidden + i] = bf16_to_float(((const bf16_t *)x)[t * hidden + i]);
                else
                    memcpy(s.x + r * hidden, (const float *)x + t * hidden, sizeof(float) * hidden);
            }
            if (!w16)
                moe_q8_linear(wg, s.x, m, n_gu, hidden, s.gu, &s, tiles, quantised, gemm);
            else if (moe_w16_linear(wg, s.x, m, n_gu, hidden, s.gu, w16_min) != 0) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            if (is_bf16) {  /* gate_up's output rounded (qlinear's .to(bf16)), silu's and the product too */
                for (int64_t i = 0; i < m * n_gu; i++) s.gu16[i] = float_to_bf16(s.gu[i]);
                for (int64_t r = 0; r < m; r++) {
#if BF16_CVT
                    silu_mul_row_bf16(s.gu16 + r * n_gu, s.act16 + r * inter, inter);
#else
                    silu_mul_row((const char *)(s.gu16 + r * n_gu), (char *)(s.act16 + r * inter), inter, 1);
#endif
                }
                for (int64_t i = 0; i < m * inter; i++) s.act[i] = bf16_to_float(s.act16[i]);
            } else {
                for (int64_t r = 0; r < m; r++)
                    silu_mul_row((const char *)(s.gu + r * n_gu), (char *)(s.act + r * inter), inter, 0);
            }
#if MOE_Q8_TILES
            if (tiles && config != kwd) qamx_configure(kwd), config = kwd;  /* down's act block may differ */
#endif
            if (!w16)
                moe_q8_linear(wd, s.act, m, hidden, inter, s.y, &s, tiles, 0, gemm_d);
            else if (moe_w16_linear(wd, s.act, m, hidden, inter, s.y, w16_min) != 0) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            for (int64_t r = 0; r < m; r++) {  /* each pair's row: (rounded,) scaled (, rounded) */
                const int64_t p = p0 + r;
                const float *y = s.y + r * hidden;
                if (f32_pairs == 2) {
                    memcpy((float *)pairs + dest[p] * hidden, y, sizeof(float) * hidden);
                } else if (f32_pairs) {
                    const float sc = ((const float *)scales)[p];
                    float *o = (float *)pairs + dest[p] * hidden;
                    for (int64_t i = 0; i < hidden; i++) o[i] = round_to(y[i], is_bf16) * sc;
                } else {  /* bf16 pairs: bf16 scales, the product rounded */
                    const float sc = bf16_to_float(((const bf16_t *)scales)[p]);
                    bf16_t *o = (bf16_t *)pairs + dest[p] * hidden;
                    for (int64_t i = 0; i < hidden; i++) o[i] = float_to_bf16(round_to(y[i], 1) * sc);
                }
            }
        }
#if MOE_Q8_WIDE
        free(wbuf);
        free(blk);
#endif
#if MOE_Q8_TILES
        if (config) _tile_release();
        free(s.xt);
        free(s.a);
        free(s.dt);
#endif
        free(s.x);
        free(s.xq);
        free(s.gu16);
        free(s.wp);
        free(s.sc);
    }
    free(all_xt), free(all_dt), free(all_xf);
    free(item_g);
    return failed ? -1 : 0;
#undef Q8_WIDE_EXPERT
#undef Q8_MIN_M
}

/* how atomd_moe_q8 runs here: 1 the int8-activation rows, 2 also AMX-INT8 tiles from min_m rows
 * (built with them and granted by Linux), 3 also the int8 GEMM (VNNI or AVX2) from min_m rows (no tiles) */
int atomd_moe_q8_kind(void) {
#if MOE_Q8_TILES
    if (amx_granted()) return 2;
#endif
    return QV_PATH ? 3 : 1;
}
#else
int atomd_moe_q8(const void *x, int is_bf16, const void *gate_up, const void *down, const int64_t *experts,
                 const int64_t *starts, const int64_t *tokens, const int64_t *dest, const void *scales, void *pairs,
                 int f32_pairs, int64_t hidden, int64_t inter, int64_t n_experts, const int64_t *min_m, int64_t wide_min,
                 int64_t w16_min, int num_threads) {
    (void)wide_min, (void)w16_min, (void)x, (void)is_bf16, (void)gate_up, (void)down, (void)experts, (void)starts, (void)tokens, (void)dest;
    (void)scales, (void)pairs, (void)f32_pairs, (void)hidden, (void)inter, (void)n_experts, (void)min_m;
    (void)num_threads;
    return 1;
}

int atomd_moe_q8_kind(void) { return 0; }  /* not built: neither AVX-512 nor AVX2 */
#endif
