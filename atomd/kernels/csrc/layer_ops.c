/* The small per-layer ops of the Llama family, float32 and bfloat16, loaded by atomd/model/layer_ops.py:
 *
 * - atomd_rms_norm_*: out = RMSNorm(x) * w, optionally after x += delta in place (the
 *   residual add fused with the norm that follows it);
 * - atomd_silu_mul_*: out = silu(gate) * up of the fused gate/up projection's rows;
 * - atomd_rope_*: rotate-half RoPE in place on the query and key heads of the QKV rows;
 * - atomd_moe_experts_* / atomd_moe_grouped_*: an MoE block's experts, one token / several.
 *
 * Why: torch runs RMSNorm as six passes (pow, mean, add, rsqrt, mul, mul), SiLU-and-mul as
 * two, RoPE as eight ops and a cat, each a call of ~5-20 us at decode sizes and a pass over
 * the activations at prefill sizes (512 x 576 RMSNorm: ~300 us on one core). One pass each
 * here, one call per op.
 *
 * bfloat16 rounds where Hugging Face's bf16 modules round (the norm's fp32 result to bf16
 * before the weight multiply, the residual sum, silu's output, each RoPE product), so the
 * results equal HF's up to float32 summation order; sums are float32.
 */
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "fast_exp.h"

typedef uint16_t bf16_t;

static inline float bf16_to_float(bf16_t v) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)v << 16;
    return c.f;
}

static inline bf16_t float_to_bf16(float f) {  /* round to nearest even; NaN stays NaN (a select: vectorises) */
    union { uint32_t u; float f; } c;
    c.f = f;
    const uint32_t rounded = (c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16, quiet_nan = (c.u >> 16) | 0x40u;
    return (bf16_t)((c.u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

/* `is_bf16` is a constant in every caller: each op is instantiated once per dtype. */
static inline __attribute__((always_inline)) float load(const void *p, int64_t i, const int is_bf16) {
    return is_bf16 ? bf16_to_float(((const bf16_t *)p)[i]) : ((const float *)p)[i];
}

static inline __attribute__((always_inline)) void store(void *p, int64_t i, float v, const int is_bf16) {
    if (is_bf16) ((bf16_t *)p)[i] = float_to_bf16(v);
    else ((float *)p)[i] = v;
}

static inline __attribute__((always_inline)) float round_to(float v, const int is_bf16) {
    return is_bf16 ? bf16_to_float(float_to_bf16(v)) : v;
}

#include "norm_row.h"  /* rms_norm_row_f32, F32_NORM_VEC (and tail on AVX-512 builds) */

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && !defined(ATOMD_NO_BF16_DOT)
/* bf16 rows with AVX512_BF16's float -> bf16 conversion (vcvtneps2bf16: round to nearest
 * even, as float_to_bf16), 16 lanes at a time, the tail masked: the portable code's integer
 * rounding costs ~2x the float32 op; this makes the bf16 ops about as cheap as fp32's. */
#include <immintrin.h>
#define BF16_CVT 1

static inline __m512 load16(const bf16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

static inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

static inline __m512 round16(__m512 v) {  /* v rounded to bf16 precision, as a float */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

static void rms_norm_row_bf16(bf16_t *x, const bf16_t *d, const bf16_t *w, bf16_t *o, int64_t hidden, float eps) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < hidden; i += 16) {
        const __mmask16 m = tail(hidden - i);
        __m512 v = load16(x + i, m);
        if (d) {
            v = round16(_mm512_add_ps(v, load16(d + i, m)));
            _mm256_mask_storeu_epi16(x + i, m, to_bf16(v));
        }
        acc = _mm512_fmadd_ps(v, v, acc);  /* masked-off lanes loaded as 0 */
    }
    const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(acc) / (float)hidden + eps));
    for (int64_t i = 0; i < hidden; i += 16) {
        const __mmask16 m = tail(hidden - i);
        const __m512 n = round16(_mm512_mul_ps(load16(x + i, m), inv));
        _mm256_mask_storeu_epi16(o + i, m, to_bf16(_mm512_mul_ps(load16(w + i, m), n)));
    }
}

/* silu(g) = g / (1 + e^-|g|) for g >= 0, g e^-|g| / (1 + e^-|g|) below: the exp of a
 * non-positive argument only; the division as a reciprocal estimate and one Newton step
 * (about 1 float32 ulp; vdivps alone took as long as the rest of the row) */
static inline __m512 silu16(__m512 g) {
    const __m512 a = _mm512_mul_ps(_mm512_abs_ps(g), _mm512_set1_ps(-1.44269504088896341f));
    const __m512 e = exp2_nonpositive16(a, (__mmask16)0xffff);
    const __m512 num = _mm512_mask_mul_ps(g, _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), g, e);
    const __m512 den = _mm512_add_ps(e, _mm512_set1_ps(1.0f));
    const __m512 r = _mm512_rcp14_ps(den);
    return _mm512_mul_ps(num, _mm512_fmadd_ps(r, _mm512_fnmadd_ps(den, r, _mm512_set1_ps(1.0f)), r));
}

static void silu_mul_row_bf16(const bf16_t *g, bf16_t *o, int64_t inter) {
    const bf16_t *u = g + inter;
    for (int64_t i = 0; i < inter; i += 16) {
        const __mmask16 m = tail(inter - i);
        const __m512 s = round16(silu16(load16(g + i, m)));  /* silu's output in bf16, as HF's */
        _mm256_mask_storeu_epi16(o + i, m, to_bf16(_mm512_mul_ps(s, load16(u + i, m))));
    }
}
#else
#define BF16_CVT 0
#endif

/* Rows below this many elements run on the calling thread: a parallel region costs more. */
#define PARALLEL_MIN_ELEMENTS 32768
#define ELEM(is_bf16) ((is_bf16) ? 2 : 4)

/* The per-row bodies are inlined into each dtype's exported function, whose own parallel
 * loop calls them: GCC outlines a parallel region before it propagates constants, so a
 * region shared by both dtypes would test is_bf16 per element and never vectorise. */

static inline __attribute__((always_inline)) void rms_norm_row(
        char *xr, const char *dr, const void *w, char *o, int64_t hidden, float eps, const int is_bf16) {
    float sum = 0.0f;
    if (dr) {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; i++) {
            float v = round_to(load(xr, i, is_bf16) + load(dr, i, is_bf16), is_bf16);
            store(xr, i, v, is_bf16);
            sum += v * v;
        }
    } else {
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; i++) {
            float v = load(xr, i, is_bf16);
            sum += v * v;
        }
    }
    const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
#pragma omp simd
    for (int64_t i = 0; i < hidden; i++)
        store(o, i, load(w, i, is_bf16) * round_to(load(xr, i, is_bf16) * inv, is_bf16), is_bf16);
}

#define RMS_NORM(is_bf16)                                                                              \
    _Pragma("omp parallel for num_threads(num_threads) if (rows * hidden >= PARALLEL_MIN_ELEMENTS)")     \
    for (int64_t r = 0; r < rows; r++)                                                                    \
        rms_norm_row((char *)(x + r * x_stride), delta ? (const char *)(delta + r * delta_stride) : NULL, \
                     w, (char *)(out + r * out_stride), hidden, eps, is_bf16);

/* x [rows, hidden] (row stride x_stride elements; updated in place when delta is not NULL),
 * delta [rows, hidden] or NULL, w [hidden], out [rows, hidden] (row stride out_stride). */
void atomd_rms_norm_f32(float *x, int64_t x_stride, const float *delta, int64_t delta_stride, const float *w,
                        float *out, int64_t out_stride, int64_t rows, int64_t hidden, float eps, int num_threads) {
#if F32_NORM_VEC
#pragma omp parallel for num_threads(num_threads) if (rows * hidden >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++)
        rms_norm_row_f32(x + r * x_stride, delta ? delta + r * delta_stride : NULL, w, out + r * out_stride, hidden, eps);
#else
    RMS_NORM(0)
#endif
}

void atomd_rms_norm_bf16(bf16_t *x, int64_t x_stride, const bf16_t *delta, int64_t delta_stride, const bf16_t *w,
                         bf16_t *out, int64_t out_stride, int64_t rows, int64_t hidden, float eps, int num_threads) {
#if BF16_CVT
#pragma omp parallel for num_threads(num_threads) if (rows * hidden >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++)
        rms_norm_row_bf16(x + r * x_stride, delta ? delta + r * delta_stride : NULL, w, out + r * out_stride, hidden, eps);
#else
    RMS_NORM(1)
#endif
}

/* Qwen3's per-head q / k RMSNorm in place: each row of qkv [rows, width] (row stride width), its first q_heads
 * heads of head_dim by q_w, the next kv_heads by k_w, each head as atomd_rms_norm_* normalises a row (the same
 * bits as that call on the heads copied out), without the copies: a prefill's strided copies out and back took
 * ~36 ms a layer at 4096 rows (benchmarks/RESULTS.md "#34 eighth session"). The vector row functions sum in one
 * fixed order, so a row loop here; the portable one (`omp simd`) may sum in another order at another call site:
 * there, atomd_rms_norm_* itself, a head at a time. */
#define QK_NORM(suffix, type, vec_row)                                                                         \
    void atomd_qk_norm_##suffix(type *qkv, int64_t rows, int64_t width, int64_t q_heads, int64_t kv_heads,      \
                                int64_t head_dim, const type *q_w, const type *k_w, float eps, int num_threads) { \
        if (!(vec_row)) {                                                                                      \
            for (int64_t h = 0; h < q_heads + kv_heads; h++)                                                   \
                atomd_rms_norm_##suffix(qkv + h * head_dim, width, NULL, 0, h < q_heads ? q_w : k_w,           \
                                        qkv + h * head_dim, width, rows, head_dim, eps, num_threads);          \
            return;                                                                                            \
        }                                                                                                      \
        _Pragma("omp parallel for num_threads(num_threads) if (rows * width >= PARALLEL_MIN_ELEMENTS)")        \
        for (int64_t r = 0; r < rows; r++)                                                                     \
            for (int64_t h = 0; h < q_heads + kv_heads; h++) {                                                 \
                type *x = qkv + r * width + h * head_dim;                                                      \
                QK_NORM_ROW_##suffix(x, h < q_heads ? q_w : k_w, head_dim, eps);                               \
            }                                                                                                  \
    }
#if F32_NORM_VEC
#define QK_NORM_ROW_f32(x, w, n, eps) rms_norm_row_f32(x, NULL, w, x, n, eps)
#else
#define QK_NORM_ROW_f32(x, w, n, eps) (void)0
#endif
#if BF16_CVT
#define QK_NORM_ROW_bf16(x, w, n, eps) rms_norm_row_bf16(x, NULL, w, x, n, eps)
#else
#define QK_NORM_ROW_bf16(x, w, n, eps) (void)0
#endif
QK_NORM(f32, float, F32_NORM_VEC)
QK_NORM(bf16, bf16_t, BF16_CVT)

static inline __attribute__((always_inline)) void silu_mul_row(const char *g, char *o, int64_t inter,
                                                              const int is_bf16) {
    const char *u = g + inter * ELEM(is_bf16);
#pragma omp simd
    for (int64_t i = 0; i < inter; i++)
        store(o, i, round_to(silu(load(g, i, is_bf16)), is_bf16) * load(u, i, is_bf16), is_bf16);
}

#define SILU_MUL(is_bf16)                                                                         \
    _Pragma("omp parallel for num_threads(num_threads) if (rows * inter >= PARALLEL_MIN_ELEMENTS)") \
    for (int64_t r = 0; r < rows; r++)                                                            \
        silu_mul_row((const char *)(gate_up + r * 2 * inter), (char *)(out + r * inter), inter, is_bf16);

/* gate_up [rows, 2 * inter] contiguous (gate then up), out [rows, inter] contiguous. */
void atomd_silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter, int num_threads) {
    SILU_MUL(0)
}

void atomd_silu_mul_bf16(const bf16_t *gate_up, bf16_t *out, int64_t rows, int64_t inter, int num_threads) {
#if BF16_CVT
#pragma omp parallel for num_threads(num_threads) if (rows * inter >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) silu_mul_row_bf16(gate_up + r * 2 * inter, out + r * inter, inter);
#else
    SILU_MUL(1)
#endif
}

static inline __attribute__((always_inline)) void rope_row(char *row, int64_t heads, int64_t head_dim,
                                                          const char *c, const char *s, const int is_bf16) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        char *x = row + h * head_dim * ELEM(is_bf16), *x2p = x + half * ELEM(is_bf16);
#pragma omp simd
        for (int64_t i = 0; i < half; i++) {
            float x1 = load(x, i, is_bf16), x2 = load(x2p, i, is_bf16);
            float ci = load(c, i, is_bf16), si = load(s, i, is_bf16);
            store(x, i, round_to(x1 * ci, is_bf16) - round_to(x2 * si, is_bf16), is_bf16);
            store(x2p, i, round_to(x2 * ci, is_bf16) + round_to(x1 * si, is_bf16), is_bf16);
        }
    }
}

#define ROPE(is_bf16)                                                                                    \
    _Pragma("omp parallel for num_threads(num_threads) if (rows * heads * head_dim >= PARALLEL_MIN_ELEMENTS)") \
    for (int64_t r = 0; r < rows; r++)                                                                   \
        rope_row((char *)(qkv + r * row_stride), heads, head_dim, (const char *)(cos + positions[r] * (head_dim / 2)), \
                 (const char *)(sin + positions[r] * (head_dim / 2)), is_bf16);

/* qkv [rows, row_stride]: its first `heads` heads of head_dim (the query heads, then the key
 * heads) rotated in place by the angles of positions[r]; cos, sin [max_position, head_dim / 2]. */
void atomd_rope_f32(float *qkv, int64_t row_stride, int64_t heads, int64_t head_dim, const float *cos,
                    const float *sin, const int64_t *positions, int64_t rows, int num_threads) {
    ROPE(0)
}

void atomd_rope_bf16(bf16_t *qkv, int64_t row_stride, int64_t heads, int64_t head_dim, const bf16_t *cos,
                     const bf16_t *sin, const int64_t *positions, int64_t rows, int num_threads) {
    ROPE(1)
}

/* RoPE as atomd_rope_* on the query and key heads of each row of qkv [rows, row_stride] (q_heads
 * query heads, then kv_heads key heads, then as many value heads), then the row's key and
 * value heads copied to its slot in the paged KV cache: the K row at cache + (slot_rows[r] +
 * layer_rows) * kv_heads * head_dim, the V row v_rows rows further (atomd/kv_cache.py's
 * layout). One pass over the rows where RoPE and the cache write were two calls. */
/* float -> fp8 (E4M3FN: bias 7, 3 mantissa bits, no infinity; E5M2: bias 15, 2 bits) as
 * atomd/engine/kv_cache.py's to_narrow at scale 1: saturated at the format's largest finite value,
 * rounded to nearest even, NaN kept (torch's cast). */
static inline uint8_t float_to_fp8(float f, const int e5m2) {
    union { float f; uint32_t u; } c = {f};
    const uint8_t sign = (uint8_t)((c.u >> 24) & 0x80);
    const int mbits = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
    const float limit = e5m2 ? 57344.0f : 448.0f, min_normal = e5m2 ? 0x1p-14f : 0x1p-6f;
    if (f != f) return (uint8_t)(sign | (e5m2 ? 0x7f : 0x7f));
    float a = fabsf(f);
    if (a > limit) a = limit;
    if (a < min_normal)  /* subnormal (or 0): a multiple of the smallest step, rounded to nearest even */
        return (uint8_t)(sign | (uint8_t)nearbyintf(a * (e5m2 ? 0x1p16f : 0x1p9f)));
    c.f = a;
    const int shift = 23 - mbits;
    uint32_t u = (c.u + ((1u << (shift - 1)) - 1u) + ((c.u >> shift) & 1u)) >> shift;
    return (uint8_t)(sign | (uint8_t)(u - ((uint32_t)(127 - bias) << mbits)));
}

/* float -> IEEE float16 as KVCache.write's to_narrow: saturated at +-65504, rounded to nearest
 * even (subnormals included), NaN kept. */
static inline uint16_t float_to_f16(float f) {
    union { float f; uint32_t u; } c = {f};
    const uint16_t sign = (uint16_t)((c.u >> 16) & 0x8000);
    if (f != f) return (uint16_t)(sign | 0x7e00);
    float a = fabsf(f);
    if (a > 65504.0f) a = 65504.0f;
    if (a < 0x1p-14f) return (uint16_t)(sign | (uint16_t)nearbyintf(a * 0x1p24f));  /* multiples of 2^-24 */
    c.f = a;
    const uint32_t u = (c.u + 0xfffu + ((c.u >> 13) & 1u)) >> 13;
    return (uint16_t)(sign | (uint16_t)(u - ((uint32_t)(127 - 15) << 10)));
}

/* What a float32 model's fused layer stores its K / V rows as (decode_attention_args.kv_narrow) */
enum { KV_STORE_MODEL, KV_STORE_E4M3, KV_STORE_E5M2, KV_STORE_BF16, KV_STORE_F16 };

/* n float32 values stored into a narrow cache's row as KVCache.write's to_narrow stores them */
static inline void store_narrow(const float *x, void *dst, int64_t n, const int kv_narrow) {
    for (int64_t i = 0; i < n; i++)
        if (kv_narrow == KV_STORE_BF16 || kv_narrow == KV_STORE_F16)
            ((uint16_t *)dst)[i] = kv_narrow == KV_STORE_BF16 ? float_to_bf16(x[i]) : float_to_f16(x[i]);
        else
            ((uint8_t *)dst)[i] = float_to_fp8(x[i], kv_narrow == KV_STORE_E5M2);
}

/* store_narrow as its own call: the tests hold it to torch's casts over every rounding case */
void atomd_kv_store(const float *x, void *dst, int64_t n, int kv_narrow) { store_narrow(x, dst, n, kv_narrow); }

/* One row: RoPE on its q_heads + kv_heads heads, then its key and value heads copied to k / v
 * (the token's rows in the paged cache; kv_narrow: a float32 row stored as fp8 e4m3 / e5m2 at
 * scale 1, bf16 or float16, as KVCache.write does). Shared by atomd_rope_store_* and the batch-1 layer. */
static inline __attribute__((always_inline)) void rope_store_row(
        char *row, int64_t q_heads, int64_t kv_heads, int64_t head_dim, const char *c, const char *s, char *k,
        char *v, const int is_bf16, const int kv_narrow) {
    const int64_t kv_size = kv_heads * head_dim, kv_bytes = kv_size * ELEM(is_bf16);
    const int64_t q_bytes = q_heads * head_dim * ELEM(is_bf16);
    rope_row(row, q_heads + kv_heads, head_dim, c, s, is_bf16);
    if (kv_narrow != KV_STORE_MODEL && !is_bf16) {
        const float *kr = (const float *)(row + q_bytes);
        store_narrow(kr, k, kv_size, kv_narrow);
        store_narrow(kr + kv_size, v, kv_size, kv_narrow);
        return;
    }
    memcpy(k, row + q_bytes, kv_bytes);
    memcpy(v, row + q_bytes + kv_bytes, kv_bytes);
}

/* With q_w (Qwen3's q / k norm): each row's query and key heads first normed in place as
 * atomd_qk_norm_* norms them (the same bits), on the row while it is in cache: a prefill's
 * separate pass over q and k cost ~3% of its time on the 0.6B shape (benchmarks/RESULTS.md, #34
 * s34h). Where the vector row norm is not built, atomd_qk_norm_* runs first as its own call. */
#define ROPE_STORE(is_bf16, suffix, vec_row)                                                                   \
    const int64_t kv_size = kv_heads * head_dim, q_size = q_heads * head_dim;                                  \
    if (q_w != NULL && !(vec_row)) {                                                                           \
        atomd_qk_norm_##suffix(qkv, rows, row_stride, q_heads, kv_heads, head_dim, q_w, k_w, eps, num_threads); \
        q_w = NULL;                                                                                            \
    }                                                                                                          \
    _Pragma("omp parallel for num_threads(num_threads) if (rows * (q_size + 2 * kv_size) >= PARALLEL_MIN_ELEMENTS)") \
    for (int64_t r = 0; r < rows; r++) {                                                                       \
        char *k = (char *)(cache + (slot_rows[r] + layer_rows) * kv_size);                                     \
        if (q_w != NULL)                                                                                       \
            for (int64_t h = 0; h < q_heads + kv_heads; h++)                                                   \
                QK_NORM_ROW_##suffix(qkv + r * row_stride + h * head_dim, h < q_heads ? q_w : k_w, head_dim, eps); \
        rope_store_row((char *)(qkv + r * row_stride), q_heads, kv_heads, head_dim,                            \
                       (const char *)(cos + positions[r] * (head_dim / 2)),                                    \
                       (const char *)(sin + positions[r] * (head_dim / 2)), k,                                 \
                       k + v_rows * kv_size * ELEM(is_bf16), is_bf16, 0);                                      \
    }

/* q_w, k_w: the q / k norm's weights (head_dim each), or NULL for none. */
void atomd_rope_store_f32(float *qkv, int64_t row_stride, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                          const float *cos, const float *sin, const int64_t *positions, float *cache,
                          const int64_t *slot_rows, int64_t layer_rows, int64_t v_rows, int64_t rows,
                          const float *q_w, const float *k_w, float eps, int num_threads) {
    ROPE_STORE(0, f32, F32_NORM_VEC)
}

void atomd_rope_store_bf16(bf16_t *qkv, int64_t row_stride, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                           const bf16_t *cos, const bf16_t *sin, const int64_t *positions, bf16_t *cache,
                           const int64_t *slot_rows, int64_t layer_rows, int64_t v_rows, int64_t rows,
                           const bf16_t *q_w, const bf16_t *k_w, float eps, int num_threads) {
    ROPE_STORE(1, bf16, BF16_CVT)
}

/* Batch-1 decode linears: y[n] = sum_k x[k] w[n, k] over a plain row-major weight [N, K]
 * (atomd_gemv_*), for one row of activations. Why: at M = 1 a linear only streams its
 * weight once, and oneDNN's packed matmul reads it at ~15-17 GB/s here where this loop
 * reaches the machine's read bandwidth (benchmarks/results/offline.md, session 6). One weight
 * row at a time (one read stream), two accumulators, and on AVX-512 builds the row GEMV_PREFETCH bytes
 * ahead prefetched into L2 (PREFETCH_AHEAD: not on AVX2 ones): one thread streams memory only as fast as it keeps misses in flight
 * (135M shape's linears, one thread: four rows sharing each x load 12-13 GB/s, one row 15-18,
 * one row + this prefetch 20-21, a plain sum of the same bytes 16-19; benchmarks/RESULTS.md
 * #35 decode step profile). Float32 sums; bf16 output rounded to nearest even. Built where
 * the vector ISA is (atomd_gemv_kinds: bit 0 float32 with AVX-512F, bit 1 bfloat16 with
 * AVX512_BF16's dot product, bit 2 float32 with AVX2 + FMA: the GEMV and the dense decode
 * layers only, not the grouped experts or the MLA layers); the Python side uses oneDNN elsewhere. */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define GEMV_PREFETCH 4096
#if defined(__AVX512F__)
/* the two cache lines GEMV_PREFETCH bytes past p, into L2 (past the weight's end: harmless, a prefetch never faults) */
#define PREFETCH_AHEAD(p)                                                          \
    do {                                                                          \
        _mm_prefetch((const char *)(p) + GEMV_PREFETCH, _MM_HINT_T1);             \
        _mm_prefetch((const char *)(p) + GEMV_PREFETCH + 64, _MM_HINT_T1);        \
    } while (0)
#else
/* none on AVX2 builds: on the AVX2 EPYC (Zen 3) the hardware prefetcher alone streams a float32 row faster,
 * 1.06-1.15x the GEMV's GB/s without the prefetches (one or two a line, 2-16 KiB ahead: no better;
 * RESULTS.md, #35 session 18); the int8 / int4 rows keep theirs (1.2-1.4x with them there) */
#define PREFETCH_AHEAD(p) ((void)(p))
#endif

#if defined(__AVX512F__)
typedef __m512 gemv_acc;
#define GEMV_ZERO() _mm512_setzero_ps()
#define GEMV_HSUM(a0, a1) _mm512_reduce_add_ps(_mm512_add_ps(a0, a1))
#else
/* AVX2: 8 lanes, masks as bits (a prefix of K's tail: lanes_below8 of its count), sums in one fixed order */
typedef __m256 gemv_acc;
#define GEMV_ZERO() _mm256_setzero_ps()
static inline float gemv_hsum8(__m256 a0, __m256 a1) {
    const __m256 a = _mm256_add_ps(a0, a1);
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}
#define GEMV_HSUM(a0, a1) gemv_hsum8(a0, a1)
#endif

/* One instance per dtype: VEC / STEP the vector of x and w elements, VLOAD a masked load
 * (all lanes but in K's tail), VFMA acc += x * w summed into float32 lanes. NAME##_rows is
 * an orphaned `omp for`: its rows are shared by the threads of the caller's parallel region
 * (atomd_decode_layer_*), or all run on the calling thread outside one. NAME##_own runs them
 * all on the calling thread inside a parallel region (a thread's own expert, MOE_EXPERTS). */
#define GEMV(NAME, elem_t, mask_t, VEC, STEP, VLOAD, VFMA, IS_BF16)                                              \
    static inline void NAME##_row(const elem_t *x, const elem_t *w, const elem_t *bias, elem_t *y, int64_t K,   \
                                  int64_t n, mask_t tail) {                                                      \
        const mask_t all = (mask_t)~(mask_t)0;                                                                   \
        const elem_t *wn = w + n * K;                                                                            \
        gemv_acc a0 = GEMV_ZERO(), a1 = a0;                                                                      \
        int64_t k = 0;                                                                                           \
        for (; k + 2 * STEP <= K; k += 2 * STEP) {                                                               \
            PREFETCH_AHEAD(wn + k);                                                                              \
            a0 = VFMA(a0, VLOAD(all, x + k), VLOAD(all, wn + k));                                                \
            a1 = VFMA(a1, VLOAD(all, x + k + STEP), VLOAD(all, wn + k + STEP));                                  \
        }                                                                                                        \
        for (; k < K; k += STEP) {                                                                               \
            const mask_t mk = K - k >= STEP ? all : tail;                                                        \
            a0 = VFMA(a0, VLOAD(mk, x + k), VLOAD(mk, wn + k));                                                  \
        }                                                                                                        \
        /* the bias added to the rounded product, as torch's add_ */                                             \
        store(y, n, GEMV_HSUM(a0, a1), IS_BF16);                                                                 \
        if (bias) store(y, n, load(y, n, IS_BF16) + load(bias, n, IS_BF16), IS_BF16);                            \
    }                                                                                                            \
    static void NAME##_rows(const elem_t *x, const elem_t *w, const elem_t *bias, elem_t *y, int64_t K,         \
                            int64_t N) {                                                                         \
        const mask_t tail = (mask_t)((1ull << (K % STEP)) - 1u);                                                 \
        _Pragma("omp for schedule(static)")                                                                      \
        for (int64_t n = 0; n < N; n++) NAME##_row(x, w, bias, y, K, n, tail);                                   \
    }                                                                                                            \
    /* NAME##_row of two rows of x (x, x1 -> y[n], y1[n]) sharing each load of the weight row: per row \
     * the same accumulators, in the same order, as NAME##_row (the same bits) */                              \
    static inline void NAME##_row2(const elem_t *x, const elem_t *x1, const elem_t *w, elem_t *y, elem_t *y1,  \
                                   int64_t K, int64_t n, mask_t tail) {                                         \
        const mask_t all = (mask_t)~(mask_t)0;                                                                   \
        const elem_t *wn = w + n * K;                                                                            \
        gemv_acc a0 = GEMV_ZERO(), a1 = a0, b0 = a0, b1 = a0;                                                    \
        int64_t k = 0;                                                                                           \
        for (; k + 2 * STEP <= K; k += 2 * STEP) {                                                               \
            PREFETCH_AHEAD(wn + k);                                                                              \
            const VEC w0 = VLOAD(all, wn + k), w1 = VLOAD(all, wn + k + STEP);                                   \
            a0 = VFMA(a0, VLOAD(all, x + k), w0);                                                                \
            a1 = VFMA(a1, VLOAD(all, x + k + STEP), w1);                                                         \
            b0 = VFMA(b0, VLOAD(all, x1 + k), w0);                                                               \
            b1 = VFMA(b1, VLOAD(all, x1 + k + STEP), w1);                                                        \
        }                                                                                                        \
        for (; k < K; k += STEP) {                                                                               \
            const mask_t mk = K - k >= STEP ? all : tail;                                                        \
            const VEC w0 = VLOAD(mk, wn + k);                                                                    \
            a0 = VFMA(a0, VLOAD(mk, x + k), w0);                                                                 \
            b0 = VFMA(b0, VLOAD(mk, x1 + k), w0);                                                                \
        }                                                                                                        \
        store(y, n, GEMV_HSUM(a0, a1), IS_BF16);                                                                 \
        store(y1, n, GEMV_HSUM(b0, b1), IS_BF16);                                                                \
    }                                                                                                            \
    /* R rows of x [R][K] -> y [R][N]: each weight row once from memory, each load of it shared by two \
     * rows (a verify step's rows); per row the same sums as NAME##_rows */                                     \
    static inline void NAME##_rows_m_n(const elem_t *x, int64_t R, const elem_t *w, elem_t *y, int64_t K,       \
                                       int64_t N, int64_t n, mask_t tail) {                                      \
        int64_t r = 0;                                                                                           \
        for (; r + 2 <= R; r += 2) NAME##_row2(x + r * K, x + (r + 1) * K, w, y + r * N, y + (r + 1) * N, K, n, tail); \
        if (r < R) NAME##_row(x + r * K, w, NULL, y + r * N, K, n, tail);                                        \
    }                                                                                                            \
    static void NAME##_rows_m(const elem_t *x, int64_t R, const elem_t *w, elem_t *y, int64_t K, int64_t N) {   \
        const mask_t tail = (mask_t)((1ull << (K % STEP)) - 1u);                                                 \
        _Pragma("omp for schedule(static)")                                                                      \
        for (int64_t n = 0; n < N; n++) NAME##_rows_m_n(x, R, w, y, K, N, n, tail);                              \
    }                                                                                                            \
    static void NAME##_own(const elem_t *x, const elem_t *w, const elem_t *bias, elem_t *y, int64_t K,          \
                           int64_t N) {                                                                          \
        const mask_t tail = (mask_t)((1ull << (K % STEP)) - 1u);                                                 \
        for (int64_t n = 0; n < N; n++) NAME##_row(x, w, bias, y, K, n, tail);                                   \
    }                                                                                                            \
    /* NAME##_own of two rows x, x1 -> y, y1 (two verify rows routed to the same expert) */                    \
    static void NAME##_own2(const elem_t *x, const elem_t *x1, const elem_t *w, elem_t *y, elem_t *y1, int64_t K, \
                            int64_t N) {                                                                         \
        const mask_t tail = (mask_t)((1ull << (K % STEP)) - 1u);                                                 \
        for (int64_t n = 0; n < N; n++) NAME##_row2(x, x1, w, y, y1, K, n, tail);                                \
    }                                                                                                            \
    void NAME(const elem_t *x, const elem_t *w, elem_t *y, int64_t K, int64_t N, int num_threads) {             \
        _Pragma("omp parallel num_threads(num_threads)")                                                         \
        NAME##_rows(x, w, NULL, y, K, N);                                                                        \
    }

#if defined(__AVX512F__)
#define F32_LOAD(mask, p) _mm512_maskz_loadu_ps(mask, p)
#define F32_FMA(acc, a, b) _mm512_fmadd_ps(a, b, acc)
GEMV(atomd_gemv_f32, float, __mmask16, __m512, 16, F32_LOAD, F32_FMA, 0)
#else
#define F32_LOAD(mask, p) ((mask) == 0xFF ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes_below8(__builtin_popcount(mask))))
#define F32_FMA(acc, a, b) _mm256_fmadd_ps(a, b, acc)
GEMV(atomd_gemv_f32, float, uint8_t, __m256, 8, F32_LOAD, F32_FMA, 0)
#endif

#if !defined(__AVX512F__)
#define GEMV_KINDS 4
#elif defined(__AVX512BF16__) && defined(__AVX512BW__) && !defined(ATOMD_NO_BF16_DOT)
#define BF16_LOAD(mask, p) ((__m512bh)_mm512_maskz_loadu_epi16(mask, p))
GEMV(atomd_gemv_bf16, bf16_t, __mmask32, __m512bh, 32, BF16_LOAD, _mm512_dpbf16_ps, 1)
#define GEMV_KINDS 3
#else
#define GEMV_KINDS 1
#endif

/* One decoder layer of batch-1 decode around its attention, in two calls (attention, which
 * reads the paged cache, is atomd_decode_attention_* between them), each one parallel
 * region whose steps are separated by barriers. Why: a layer at batch 1 is ~11 small calls
 * from Python (~10-20 us each of dispatch, checks and an OpenMP fork each) around ~4 weight
 * reads; on a model whose weights fit in cache that overhead is half the step. Every
 * intermediate is rounded where the unfused ops round it (the GEMV's output, the bias add,
 * RoPE's products, the residual sums, the norm), so the two paths give the same bits.
 *
 * head: qkv = h @ w_qkv^T (+ bias), each query / key head RMSNormed where q_norm / k_norm are
 * given (Qwen3), RoPE on its query and key heads at cos / sin (the
 * position's rows), then the token's key and value rows copied to k_dst / v_dst (its slot
 * in the paged cache). qkv: [q_size + 2 * kv_size] out.
 * tail: x += attn @ w_o^T (attn: q_size = query heads x head_dim); h = RMSNorm(x) * post_w; a = silu(h @ w_gate^T) * (h @ w_up^T);
 * x += a @ w_down^T; next_h = RMSNorm(x) * next_w (next_w NULL, the last layer: the add
 * alone). scratch: hidden + 2 * inter + num_threads * (2 * hidden + inter) elements
 * (DECODE_SCRATCH). */
/* The whole model's layers at batch 1 in one call (atomd_decode_layers_*): per layer the head,
 * the decode attention kernel (atomd/kernels/csrc/attention.c, built per shape in its own
 * library: called through the pointer the caller passes) and the tail. Why: the per-layer
 * Python loop around the three calls (argument checks, ctypes conversions) was ~1.5-2 ms of a
 * ~12 ms int8 step on the 135M shape (benchmarks/decode_step_profile.py). `layers` holds each
 * layer's weights (next_norm NULL on the last) and sliding window (0: none); the attention
 * arguments are the step's (one sequence: block_tables its one row). */
typedef int (*decode_attention_fn)(const void *q, const void *kv, const int64_t *block_tables,
                                   const int64_t *context_lens, const int64_t *query_starts, void *out, int64_t batch,
                                   int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int64_t table_width,
                                   int64_t block_stride, int64_t k_offset, int64_t v_offset, float scale,
                                   int64_t window, int num_threads);
/* An MoE layer's sparse block (Qwen3-MoE, Mixtral) in the fused layer: the router's logits in
 * the model's dtype (F.linear's), softmax in float32, the top_k (first index on ties), renormalised
 * where norm_topk, each scale rounded to the dtype unless f32_pairs (moe.route's cast_weights);
 * then atomd_moe_experts_*'s products and the k pairs summed in float32 in choice order, rounded
 * once (moe.py's sum). Why here: per op, the block cost ~8 Python-level calls a layer (router,
 * softmax, top-k, the experts, the sum, the residual norm), 24 layers a token on the Qwen3-MoE
 * shape. routed: the expert load counters (MoeWeights.routed), one += a choice. */
typedef struct {
    /* [E, hidden]; [E, 2 * inter, hidden]; [E, hidden, inter] (the q_f32 layer: gate_up / down each an array of E
     * atomd_qweight, moe_q8's experts, MoeWeights.q8_experts) */
    const void *router, *gate_up, *down;
    int64_t *routed;                      /* [E] */
    int64_t experts, top_k, inter;
    int norm_topk, f32_pairs;
} decode_moe_weights;
#define MOE_MAX_EXPERTS 1024 /* the routing's probabilities live on each thread's stack */
#define MOE_MAX_K 64
typedef struct {
    const void *qkv, *bias, *o, *post_norm, *gate_up, *down, *next_norm;
    int64_t window;
    const void *q_norm, *k_norm;  /* [head_dim] each, or NULL: no q/k norm (Qwen3 has one) */
    const decode_moe_weights *moe; /* NULL: the dense MLP (gate_up, down) */
} decode_layer_weights;

/* moe.route for one row of logits (see decode_moe_weights): ids [k] and their scales */
static void moe_route(const void *logits, const int is_bf16, int64_t experts, int64_t k, int norm_topk,
                      int round_scales, int64_t *ids, float *scales) {
    float p[MOE_MAX_EXPERTS], top = -INFINITY, sum = 0.f;
    for (int64_t e = 0; e < experts; e++) {
        p[e] = load(logits, e, is_bf16);
        top = p[e] > top ? p[e] : top;
    }
    for (int64_t e = 0; e < experts; e++) sum += (p[e] = expf(p[e] - top));
    for (int64_t e = 0; e < experts; e++) p[e] /= sum;
    float chosen = 0.f;
    unsigned char taken[MOE_MAX_EXPERTS];
    memset(taken, 0, (size_t)experts);
    for (int64_t j = 0; j < k; j++) {
        /* the first untaken expert at least: NaN logits (p all NaN) still give k distinct experts in range */
        int64_t best = -1;
        for (int64_t e = 0; e < experts; e++)
            if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
        ids[j] = best;
        scales[j] = p[best];
        chosen += p[best];
        taken[best] = 1;
    }
    for (int64_t j = 0; j < k; j++) {
        if (norm_topk) scales[j] /= chosen;
        if (round_scales) scales[j] = round_to(scales[j], is_bf16);
    }
}
/* The (row, choice) pairs ids [P] (k a row, weights wts [P]) grouped by expert, pair order kept within (moe.py's
 * stable argsort), as atomd_moe_q8 / atomd_moe_amx_bf16 take them: counts [E] each expert's pairs, experts [n] those
 * with any and starts [n + 1] their first slots, each slot's row tokens, pair dest and weight scales [P]; at [E]
 * scratch. Returns n. */
static inline int64_t group_pairs(const int64_t *ids, const float *wts, int64_t P, int64_t k, int64_t E,
                                  int64_t *counts, int64_t *at, int64_t *experts, int64_t *starts, int64_t *tokens,
                                  int64_t *dest, float *scales) {
    memset(counts, 0, (size_t)E * sizeof(int64_t));
    for (int64_t p = 0; p < P; p++) counts[ids[p]]++;
    int64_t n = 0;
    starts[0] = 0;
    for (int64_t e = 0; e < E; e++) {
        at[e] = starts[n];
        if (counts[e]) {
            experts[n] = e;
            starts[n + 1] = starts[n] + counts[e];
            n++;
        }
    }
    for (int64_t p = 0; p < P; p++) {
        const int64_t slot = at[ids[p]]++;
        tokens[slot] = p / k, dest[slot] = p, scales[slot] = wts[p];
    }
    return n;
}
typedef struct {
    decode_attention_fn fn;
    const void *kv;
    const int64_t *block_tables, *context_lens;
    int64_t block_size, table_width, block_stride, layer_stride, v_offset;  /* elements; layer_stride: k_offset per layer */
    float scale;
    int kv_narrow;  /* KV_STORE_MODEL: the cache holds the model's dtype; else (float32 models) fp8 at scale 1, bf16, float16 */
} decode_attention_args;

/* Inside a parallel region: the layer's QKV from hh (+ bias) into qkv, then on one thread its
 * q/k norm, RoPE and the key / value rows' store (HEAD_STEPS); the layer after attention
 * (TAIL_STEPS). Each thread keeps its own copies of the residual x (xp), the normed row (hp) and
 * the SiLU output (ap), computed alike on every thread (the same bits), so the norms and the SiLU
 * need no barrier: the only ones are each GEMV's (its rows are shared), three a tail. d
 * [hidden], gu [2 * inter] are shared. */
#define HEAD_STEPS(hh, w_qkv, bias, q_norm, k_norm, k_dst, v_dst, NORM_ROW, GEMV_ROWS, IS_BF16)                  \
    do {                                                                                                       \
        GEMV_ROWS(hh, w_qkv, bias, qkv, hidden, q_size + 2 * kv_size);                                         \
        _Pragma("omp single")                                                                                  \
        {                                                                                                      \
            if ((q_norm) != NULL) /* Qwen3: RMSNorm of each query and key head, in place, before RoPE */       \
                for (int64_t j = 0; j < q_heads + kv_heads; j++)                                               \
                    NORM_ROW(qkv + j * head_dim, NULL, j < q_heads ? (q_norm) : (k_norm), qkv + j * head_dim,  \
                             head_dim, eps);                                                                   \
            rope_store_row((char *)qkv, q_heads, kv_heads, head_dim, (const char *)cos, (const char *)sin,     \
                           (char *)(k_dst), (char *)(v_dst), IS_BF16, kv_narrow);                              \
        }                                                                                                      \
    } while (0)
#define TAIL_STEPS(w_o, post_w, w_gate_up, w_down, next_w, moe_w, NORM_ROW, SILU_ROW, GEMV_ROWS, MOE_GEMV,      \
                   EXPERT, IS_BF16, elem_t)                                                                    \
    do {                                                                                                       \
        GEMV_ROWS(attn, w_o, NULL, d, q_size, hidden);                                                         \
        NORM_ROW(xp, d, post_w, hp, hidden, eps);                                                              \
        const elem_t *dd_ = d; /* the MLP's output: shared (dense) or the thread's own sum (MoE) */            \
        if ((moe_w) != NULL) {                                                                                 \
            MOE_STEPS(moe_w, MOE_GEMV, EXPERT, SILU_ROW, IS_BF16, elem_t, dd_);                                \
        } else {                                                                                               \
            GEMV_ROWS(hp, w_gate_up, NULL, gu, hidden, 2 * inter);                                             \
            SILU_ROW(gu, ap, inter);                                                                           \
            GEMV_ROWS(ap, w_down, NULL, d, inter, hidden);                                                     \
        }                                                                                                      \
        if ((next_w) != NULL) {                                                                                \
            NORM_ROW(xp, dd_, next_w, hp, hidden, eps);                                                        \
        } else {                                                                                               \
            for (int64_t i_ = 0; i_ < hidden; i_++)                                                            \
                store(xp, i_, load(xp, i_, IS_BF16) + load(dd_, i_, IS_BF16), IS_BF16);                        \
        }                                                                                                      \
    } while (0)
/* The sparse block of TAIL_STEPS (decode_moe_weights) on the normed row hp: the router's GEMV
 * (rows shared), the routing on every thread alike (the same bits, no barrier), the experts as
 * atomd_moe_experts_* runs them (whole experts a thread when k >= threads, one barrier), then
 * each thread sums the k pairs into its own row (dd). moe_scratch (floats): the logits [E], the
 * pairs [k, hidden], shared rows [3 * inter + hidden], then each thread's [3 * inter + 2 * hidden].
 * EXPERT(GEMV, FORM, elem_t, x, experts, id, y, K, N): expert id's linear [N, K] of `experts` on x, FORM _own (this
 * thread) or _rows (shared): STACKED_EXPERT (float experts stacked) or QUANT_EXPERT (the q_f32 layer's). */
#define STACKED_EXPERT(GEMV, FORM, elem_t, x, experts, id, y, K, N)                                            \
    GEMV##FORM(x, (const elem_t *)(experts) + (id) * (N) * (K), NULL, y, K, N)
#define MOE_STEPS(mw, GEMV, EXPERT, SILU_ROW, IS_BF16, elem_t, dd)                                             \
    do {                                                                                                       \
        const int64_t ne_ = (mw)->experts, k_ = (mw)->top_k, mi_ = (mw)->inter;                                \
        const int t_ = omp_get_thread_num(), nt_ = omp_get_num_threads();                                      \
        elem_t *logits_ = (elem_t *)moe_scratch;                                                               \
        float *pairs_ = moe_scratch + ne_, *shared_ = pairs_ + k_ * hidden;                                    \
        elem_t *gu_ = (elem_t *)(shared_ + 3 * mi_ + hidden + t_ * (3 * mi_ + 2 * hidden)), *a_ = gu_ + 2 * mi_; \
        elem_t *y_ = a_ + mi_;                                                                                 \
        const int f32_ = (mw)->f32_pairs;                                                                      \
        int64_t ids_[MOE_MAX_K];                                                                               \
        float sc_[MOE_MAX_K];                                                                                  \
        GEMV##_rows(hp, (const elem_t *)(mw)->router, NULL, logits_, hidden, ne_);                             \
        moe_route(logits_, IS_BF16, ne_, k_, (mw)->norm_topk, !(mw)->f32_pairs, ids_, sc_);                    \
        if (t_ == 0)                                                                                           \
            for (int64_t j = 0; j < k_; j++) (mw)->routed[ids_[j]]++;                                          \
        if (k_ >= nt_) {                                                                                       \
            for (int64_t j = t_; j < k_; j += nt_) {                                                           \
                EXPERT(GEMV, _own, elem_t, hp, (mw)->gate_up, ids_[j], gu_, hidden, 2 * mi_);                  \
                SILU_ROW(gu_, a_, mi_);                                                                        \
                EXPERT(GEMV, _own, elem_t, a_, (mw)->down, ids_[j], y_, mi_, hidden);                          \
                for (int64_t i = 0; i < hidden; i++) MOE_PAIR(j, i, y_, IS_BF16, f32_);                              \
            }                                                                                                  \
            _Pragma("omp barrier")                                                                             \
        } else {                                                                                               \
            elem_t *sgu_ = (elem_t *)shared_, *sa_ = sgu_ + 2 * mi_, *sy_ = sa_ + mi_;                         \
            for (int64_t j = 0; j < k_; j++) {                                                                 \
                EXPERT(GEMV, _rows, elem_t, hp, (mw)->gate_up, ids_[j], sgu_, hidden, 2 * mi_);                \
                _Pragma("omp single")                                                                          \
                SILU_ROW(sgu_, sa_, mi_);                                                                      \
                EXPERT(GEMV, _rows, elem_t, sa_, (mw)->down, ids_[j], sy_, mi_, hidden);                       \
                _Pragma("omp for schedule(static)")                                                            \
                for (int64_t i = 0; i < hidden; i++) MOE_PAIR(j, i, sy_, IS_BF16, f32_);                             \
            }                                                                                                  \
        }                                                                                                      \
        for (int64_t i = 0; i < hidden; i++) {                                                                 \
            float s_ = 0.f;                                                                                    \
            for (int64_t j = 0; j < k_; j++) s_ += pairs_[j * hidden + i];                                     \
            store(y_, i, s_, IS_BF16);                                                                         \
        }                                                                                                      \
        dd = y_;                                                                                               \
    } while (0)
/* pair j's value i: the expert's output times its scale, rounded to the dtype unless f32_pairs */
#define MOE_PAIR(j, i, y, IS_BF16, f32)                                                                        \
    pairs_[(j) * hidden + (i)] = (f32) ? load(y, i, IS_BF16) * sc_[j] : round_to(load(y, i, IS_BF16) * sc_[j], IS_BF16)
/* a thread's copies (TAIL_STEPS) in scratch after the shared d and gu; x copied in */
#define THREAD_COPIES(elem_t)                                                                                  \
    elem_t *xp = scratch + hidden + 2 * inter + omp_get_thread_num() * (2 * hidden + inter), *hp = xp + hidden, \
           *ap = hp + hidden;                                                                                  \
    memcpy(xp, x, hidden * sizeof(elem_t))

#define DECODE_LAYER(SUFFIX, elem_t, IS_BF16, NORM_ROW, SILU_ROW, w_t, GEMV_ROWS, MOE_GEMV, EXPERT)                \
    void atomd_decode_layer_head_##SUFFIX(const elem_t *h, w_t w_qkv, const elem_t *bias, const elem_t *q_norm,  \
                                          const elem_t *k_norm, elem_t *qkv, const elem_t *cos, const elem_t *sin, \
                                          elem_t *k_dst, elem_t *v_dst, int64_t hidden, int64_t q_heads,          \
                                          int64_t kv_heads, int64_t head_dim, float eps, int num_threads) {       \
        const int64_t q_size = q_heads * head_dim, kv_size = kv_heads * head_dim;                                  \
        const int kv_narrow = KV_STORE_MODEL;                                                                      \
        _Pragma("omp parallel num_threads(num_threads)")                                                           \
        HEAD_STEPS(h, w_qkv, bias, q_norm, k_norm, k_dst, v_dst, NORM_ROW, GEMV_ROWS, IS_BF16);                   \
    }                                                                                                              \
    void atomd_decode_layer_tail_##SUFFIX(const elem_t *attn, elem_t *x, w_t w_o, const elem_t *post_w,            \
                                          w_t w_gate_up, w_t w_down, const elem_t *next_w,                         \
                                          elem_t *next_h, elem_t *scratch, int64_t hidden, int64_t q_size,        \
                                          int64_t inter, float eps, int num_threads) {                            \
        elem_t *d = scratch, *gu = d + hidden;                                                                     \
        float *moe_scratch = NULL; /* a dense layer */                                                             \
        _Pragma("omp parallel num_threads(num_threads)")                                                           \
        {                                                                                                          \
            THREAD_COPIES(elem_t);                                                                                 \
            TAIL_STEPS(w_o, post_w, w_gate_up, w_down, next_w, (const decode_moe_weights *)NULL, NORM_ROW,         \
                       SILU_ROW, GEMV_ROWS, MOE_GEMV, EXPERT, IS_BF16, elem_t);                                    \
            if (omp_get_thread_num() == 0) {                                                                       \
                memcpy(x, xp, hidden * sizeof(elem_t));                                                            \
                if (next_w != NULL) memcpy(next_h, hp, hidden * sizeof(elem_t));                                   \
            }                                                                                                      \
        }                                                                                                          \
    }                                                                                                              \
    int atomd_decode_layers_##SUFFIX(const decode_layer_weights *layers, int64_t num_layers,                       \
                                     const decode_attention_args *att, elem_t *h, elem_t *x, elem_t *qkv,           \
                                     elem_t *attn, const elem_t *cos, const elem_t *sin, char *k_dst, char *v_dst,  \
                                     int64_t layer_bytes, elem_t *scratch, float *moe_scratch, int64_t hidden,     \
                                     int64_t q_heads,                                                               \
                                     int64_t kv_heads, int64_t head_dim, int64_t inter, float eps,                 \
                                     int num_threads) {                                                             \
        const int64_t q_size = q_heads * head_dim, kv_size = kv_heads * head_dim;                                  \
        elem_t *d = scratch, *gu = d + hidden;                                                                     \
        const int kv_narrow = IS_BF16 ? KV_STORE_MODEL : att->kv_narrow;                                           \
        _Pragma("omp parallel num_threads(num_threads)")                                                           \
        HEAD_STEPS(h, (w_t)layers->qkv, (const elem_t *)layers->bias, (const elem_t *)layers->q_norm,              \
                   (const elem_t *)layers->k_norm, k_dst, v_dst, NORM_ROW, GEMV_ROWS, IS_BF16);                    \
        for (int64_t i = 0; i < num_layers; i++) {                                                                 \
            const decode_layer_weights *w = layers + i, *nw = i + 1 < num_layers ? w + 1 : NULL;                   \
            const int status = att->fn(qkv, att->kv, att->block_tables, att->context_lens, NULL, attn, 1, q_heads, \
                                       kv_heads, att->block_size, att->table_width, att->block_stride,              \
                                       i * att->layer_stride, att->v_offset, att->scale, w->window, num_threads);   \
            if (status != 0) return status;                                                                        \
            /* this layer's tail and the next one's head in one region: one fork a layer besides attention's */    \
            _Pragma("omp parallel num_threads(num_threads)")                                                       \
            {                                                                                                      \
                THREAD_COPIES(elem_t);                                                                             \
                TAIL_STEPS((w_t)w->o, (const elem_t *)w->post_norm, (w_t)w->gate_up, (w_t)w->down,                  \
                           (const elem_t *)w->next_norm, w->moe, NORM_ROW, SILU_ROW, GEMV_ROWS, MOE_GEMV, EXPERT,   \
                           IS_BF16, elem_t);                                                                       \
                if (nw != NULL)                                                                                    \
                    HEAD_STEPS(hp, (w_t)nw->qkv, (const elem_t *)nw->bias, (const elem_t *)nw->q_norm,              \
                               (const elem_t *)nw->k_norm, k_dst + (i + 1) * layer_bytes,                          \
                               v_dst + (i + 1) * layer_bytes, NORM_ROW, GEMV_ROWS, IS_BF16);                       \
                if (omp_get_thread_num() == 0) memcpy(x, xp, hidden * sizeof(elem_t));                             \
            }                                                                                                      \
        }                                                                                                          \
        return 0;                                                                                                  \
    }

#if F32_NORM_VEC
#define NORM_ROW_F32 rms_norm_row_f32
#else
#define NORM_ROW_F32(x, d, w, o, hidden, eps) rms_norm_row((char *)(x), (const char *)(d), w, (char *)(o), hidden, eps, 0)
#endif
#define SILU_ROW_F32(g, o, inter) silu_mul_row((const char *)(g), (char *)(o), inter, 0)
DECODE_LAYER(f32, float, 0, NORM_ROW_F32, SILU_ROW_F32, const float *, atomd_gemv_f32_rows, atomd_gemv_f32,
             STACKED_EXPERT)
#if GEMV_KINDS & 2
DECODE_LAYER(bf16, bf16_t, 1, rms_norm_row_bf16, silu_mul_row_bf16, const bf16_t *, atomd_gemv_bf16_rows,
             atomd_gemv_bf16, STACKED_EXPERT)
#endif
/* Batch-1 decode of an MoE block's experts (atomd/model/moe.py's _moe_one) in one call: for
 * each of the token's k experts e = ids[j], gu = x @ gate_up[e]^T, a = silu(gate) * up,
 * y = a @ down[e]^T and pairs[j] = y * scales[j] (pairs and scales float32 when f32_pairs,
 * else the model's dtype), every intermediate rounded where the per-op path rounds it: the
 * same bits. Why: per op that is ~5 Python-level calls an expert, each with its OpenMP fork
 * (benchmarks/moe_decode.py). With k >= num_threads each thread runs whole experts on its
 * own scratch (one barrier a call: the experts' rows shared between threads cost four an
 * expert, and a barrier whose other thread lost its core spins for the rest of its time
 * slice on a loaded machine); with fewer, every thread takes part of each expert's rows.
 * gate_up [E, 2 * inter, hidden], down [E, hidden, inter] stacked and contiguous; scratch:
 * num_threads * (3 * inter + hidden) elements. */
#define MOE_EXPERT(j, gu, a, y, GEMV, SILU_ROW)                                                                    \
    do {                                                                                                           \
        GEMV(x, gate_up + ids[j] * 2 * inter * hidden, NULL, gu, hidden, 2 * inter);                               \
        SILU_ROW(gu, a, inter);                                                                                    \
        GEMV(a, down + ids[j] * hidden * inter, NULL, y, inter, hidden);                                           \
    } while (0)
#define MOE_SCALE(j, i, y, IS_BF16)                                                                                \
    do {                                                                                                           \
        if (f32_pairs)                                                                                             \
            ((float *)pairs)[(j) * hidden + (i)] = load(y, i, IS_BF16) * ((const float *)scales)[j];               \
        else                                                                                                       \
            store(pairs, (j) * hidden + (i), load(y, i, IS_BF16) * load(scales, j, IS_BF16), IS_BF16);             \
    } while (0)
#define MOE_EXPERTS(SUFFIX, elem_t, IS_BF16, SILU_ROW, GEMV)                                                       \
    void atomd_moe_experts_##SUFFIX(const elem_t *x, const elem_t *gate_up, const elem_t *down, const int64_t *ids, \
                                    const void *scales, void *pairs, int f32_pairs, elem_t *scratch,                \
                                    int64_t hidden, int64_t inter, int64_t k, int num_threads) {                    \
        if (k >= num_threads) {                                                                                    \
            _Pragma("omp parallel num_threads(num_threads)")                                                       \
            {                                                                                                      \
                const int t = omp_get_thread_num(), threads = omp_get_num_threads();                              \
                elem_t *gu = scratch + t * (3 * inter + hidden), *a = gu + 2 * inter, *y = a + inter;              \
                for (int64_t j = t; j < k; j += threads) {                                                         \
                    MOE_EXPERT(j, gu, a, y, GEMV##_own, SILU_ROW);                                                 \
                    for (int64_t i = 0; i < hidden; i++) MOE_SCALE(j, i, y, IS_BF16);                              \
                }                                                                                                  \
            }                                                                                                      \
            return;                                                                                                \
        }                                                                                                          \
        elem_t *gu = scratch, *a = gu + 2 * inter, *y = a + inter;                                                 \
        _Pragma("omp parallel num_threads(num_threads)")                                                           \
        for (int64_t j = 0; j < k; j++) {                                                                          \
            GEMV##_rows(x, gate_up + ids[j] * 2 * inter * hidden, NULL, gu, hidden, 2 * inter);                    \
            _Pragma("omp single")                                                                                  \
            SILU_ROW(gu, a, inter);                                                                                \
            GEMV##_rows(a, down + ids[j] * hidden * inter, NULL, y, inter, hidden);                                \
            _Pragma("omp for schedule(static)")                                                                    \
            for (int64_t i = 0; i < hidden; i++) MOE_SCALE(j, i, y, IS_BF16);                                      \
        }                                                                                                          \
    }

MOE_EXPERTS(f32, float, 0, SILU_ROW_F32, atomd_gemv_f32)
#if GEMV_KINDS & 2
MOE_EXPERTS(bf16, bf16_t, 1, silu_mul_row_bf16, atomd_gemv_bf16)
#endif

#if defined(__AVX512F__)  /* (their 16-lane sums and the MLA attention library are AVX-512 only) */
/* An MoE block's experts over more than one token (atomd/model/moe.py's moe()) in one call:
 * the (token, choice) pairs grouped by expert, for each active expert e = experts[g] its
 * pairs starts[g] .. starts[g + 1] - 1 (token rows tokens[i] of x [T, hidden]) through
 * gu = x @ gate_up[e]^T, a = silu(gate) * up, y = a @ down[e]^T, and pairs[dest[i]] = y *
 * scales[i] (scales in pair order; pairs and scales float32 when f32_pairs, else the model's
 * dtype), rounded where the per-expert torch ops round (the products' sums in another order).
 * f32_pairs == 2: pairs[dest[i]] = y in float32, unrounded and unscaled (a TP worker's partial of
 * the pair's down output: moe.py's moe_tp all-reduces those before TP=1's rounding; scales unread).
 * Why: the per-expert path is one torch linear pair per active expert (a batch-16 decode step
 * of the deepseek-v2-lite shape made ~26k such calls, 31% of its time, each a small GEMM
 * through oneDNN on an unpacked weight). Here each expert's weights are read in blocks of 16
 * rows that stay in L1 while every one of its tokens passes over them, the 16 dot products
 * summed by one transposing tree (lane_sums.h). Experts are the work items (dynamic: they get
 * different token counts), each thread on its own scratch of max_rows * (3 * inter + hidden). */
#include "lane_sums.h"
#define MOE_GROUPED(SUFFIX, elem_t, mask_t, VEC, STEP, VLOAD, VFMA, IS_BF16, SILU_ROW)                             \
    /* y[j] = x . w[j] for the rows w [nn <= 16][K], rounded as the model's dtype (yf: float32, unrounded) */       \
    static inline void moe_dots16_##SUFFIX(const elem_t *x, const elem_t *w, elem_t *y, float *yf, int64_t K,      \
                                           int64_t nn) {                                                            \
        __m512 acc[16];                                                                                             \
        for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();                                                  \
        const mask_t all = (mask_t)~(mask_t)0, tail = (mask_t)((1ull << (K % STEP)) - 1u);                         \
        for (int64_t j = 0; j < nn; j++) { /* one row at a time: two chains, x from L1 */                       \
            const elem_t *wj = w + j * K;                                                                           \
            __m512 a0 = _mm512_setzero_ps(), a1 = a0;                                                               \
            int64_t k = 0;                                                                                          \
            for (; k + 2 * STEP <= K; k += 2 * STEP) {                                                              \
                a0 = VFMA(a0, VLOAD(all, x + k), VLOAD(all, wj + k));                                               \
                a1 = VFMA(a1, VLOAD(all, x + k + STEP), VLOAD(all, wj + k + STEP));                                 \
            }                                                                                                       \
            for (; k < K; k += STEP) {                                                                              \
                const mask_t mk = K - k >= STEP ? all : tail;                                                       \
                a0 = VFMA(a0, VLOAD(mk, x + k), VLOAD(mk, wj + k));                                                 \
            }                                                                                                       \
            acc[j] = _mm512_add_ps(a0, a1);                                                                         \
        }                                                                                                           \
        float sums[16];                                                                                             \
        _mm512_storeu_ps(sums, sum_lanes16(acc));                                                                   \
        for (int64_t j = 0; j < nn; j++) {                                                                          \
            if (yf)                                                                                                 \
                yf[j] = sums[j];                                                                                    \
            else                                                                                                    \
                store(y, j, sums[j], IS_BF16);                                                                      \
        }                                                                                                           \
    }                                                                                                               \
    void atomd_moe_grouped_##SUFFIX(const elem_t *x, const elem_t *gate_up, const elem_t *down,                    \
                                    const int64_t *experts, const int64_t *starts, const int64_t *tokens,           \
                                    const int64_t *dest, const void *scales, void *pairs, int f32_pairs,            \
                                    elem_t *scratch, int64_t hidden, int64_t inter, int64_t n_experts,              \
                                    int64_t max_rows, int num_threads) {                                            \
        _Pragma("omp parallel num_threads(num_threads)")                                                            \
        {                                                                                                           \
            elem_t *gu = scratch + omp_get_thread_num() * max_rows * (3 * inter + hidden);                          \
            elem_t *a = gu + max_rows * 2 * inter, *y = a + max_rows * inter;                                       \
            _Pragma("omp for schedule(dynamic, 1)")                                                                 \
            for (int64_t g = 0; g < n_experts; g++) {                                                               \
                const int64_t p0 = starts[g], m = starts[g + 1] - p0;                                               \
                const elem_t *wg = gate_up + experts[g] * 2 * inter * hidden, *wd = down + experts[g] * hidden * inter; \
                for (int64_t n0 = 0; n0 < 2 * inter; n0 += 16)                                                      \
                    for (int64_t r = 0; r < m; r++)                                                                 \
                        moe_dots16_##SUFFIX(x + tokens[p0 + r] * hidden, wg + n0 * hidden, gu + r * 2 * inter + n0, \
                                            NULL, hidden, 2 * inter - n0 < 16 ? 2 * inter - n0 : 16);               \
                for (int64_t r = 0; r < m; r++) SILU_ROW(gu + r * 2 * inter, a + r * inter, inter);                 \
                for (int64_t n0 = 0; n0 < hidden; n0 += 16)                                                         \
                    for (int64_t r = 0; r < m; r++)                                                                 \
                        moe_dots16_##SUFFIX(a + r * inter, wd + n0 * inter, y + r * hidden + n0,                   \
                                            f32_pairs == 2 ? (float *)pairs + dest[p0 + r] * hidden + n0 : NULL,     \
                                            inter, hidden - n0 < 16 ? hidden - n0 : 16);                            \
                for (int64_t r = 0; r < m && f32_pairs != 2; r++)                                                   \
                    for (int64_t i = 0; i < hidden; i++) {                                                          \
                        const float v = load(y, r * hidden + i, IS_BF16);                                           \
                        if (f32_pairs)                                                                              \
                            ((float *)pairs)[dest[p0 + r] * hidden + i] = v * ((const float *)scales)[p0 + r];     \
                        else                                                                                        \
                            store(pairs, dest[p0 + r] * hidden + i, v * load(scales, p0 + r, IS_BF16), IS_BF16);    \
                    }                                                                                               \
            }                                                                                                       \
        }                                                                                                           \
    }

MOE_GROUPED(f32, float, __mmask16, __m512, 16, F32_LOAD, F32_FMA, 0, SILU_ROW_F32)
#if GEMV_KINDS & 2
MOE_GROUPED(bf16, bf16_t, __mmask32, __m512bh, 32, BF16_LOAD, _mm512_dpbf16_ps, 1, silu_mul_row_bf16)
#endif
/* DeepSeek V2 / V3 decode of one sequence's rows (atomd/model/deepseek.py MlaDecodeLayers): its
 * token, or its token and drafts (a verify step, up to max_rows rows), every layer in one call
 * (atomd_mla_layers), per layer:
 *
 * head: qa = h @ qkv_a^T ([q part ; latent ; rope key]); with q_lora the q part RMSNormed and
 *   through q_b, else it is q; the latent RMSNormed (kv_a_norm); RoPE (at each row's position)
 *   on each query head's rope part and on the rope key; each row's latent [c ; k_pe] written to
 *   its cache slot.
 * attention: csrc/mla.c's absorbed decode (its library is built per shape: by pointer), the rows
 *   causal within the sequence.
 * tail: x += attn @ o^T; h = RMSNorm(x) * post_norm; then a dense layer's MLP, or DeepSeekMoE:
 *   the router in float32 (softmax top-k, group-limited, or V3's sigmoid with the correction
 *   bias within the best groups; x routed_scaling_factor), each row's k experts' outputs scaled
 *   in float32 and summed (rounded once), plus the shared experts' MLP; x += that, next_h =
 *   RMSNorm(x) * next_norm (NULL: the add alone).
 * Why: the per-op layer was ~30 Python-level calls (each ~10-40 us with its OpenMP fork: ~10 ms
 * of a ~60 ms deepseek-v2-lite token, benchmarks/RESULTS.md #37 third session); a verify step's
 * rows read each weight once (GEMV ..._rows_m). Every intermediate is rounded where the per-op
 * path rounds it; the router's sums and its exp run in another order (float32 ulps). */
typedef struct {
    const void *qkv_a, *q_a_norm, *q_b, *kv_a_norm, *o, *post_norm;
    const void *gate_up, *down;  /* a dense layer's MLP, or a sparse layer's shared experts (NULL: none) */
    const float *router, *correction;  /* sparse: [experts, hidden]; V3's correction bias [experts] or NULL */
    const void *experts_gate_up, *experts_down;  /* [experts, 2 * moe_inter, hidden], [experts, hidden, moe_inter] */
    int64_t *routed;  /* [experts]: the expert load counters, += 1 per chosen expert */
    const void *next_norm;  /* NULL on the last layer */
    int64_t inter;  /* gate_up's rows / 2: the dense MLP's or the shared experts' width */
    const void *uk_t, *uv;  /* the absorbed decode's W_UK^T [heads, rank, nope] and W_UV [heads, v, rank] */
} mla_layer_weights;
typedef struct {
    int64_t hidden, heads, nope, rope, rank, v, q_lora, experts, moe_inter, top_k, n_group, topk_group, max_inter;
    int scoring;  /* 0: softmax greedy, 1: softmax group_limited_greedy, 2: sigmoid noaux_tc (V3) */
    int norm_topk_prob;
    float routed_scaling_factor, eps;
    int64_t max_rows;  /* the most rows a call takes (the scratch's size) */
} mla_layer_config;
typedef int (*mla_decode_fn)(const void *q, const void *uk_t, const void *uv, const void *kv,
                             const int64_t *block_tables, const int64_t *context_lens, const int64_t *query_starts,
                             void *out, int64_t batch, int64_t rows, int64_t heads, int64_t block_size,
                             int64_t table_width, int64_t block_stride, int64_t layer_offset, float scale, int bf16,
                             int num_threads);
typedef struct {
    mla_decode_fn fn;
    const void *kv;  /* the cache's base */
    const int64_t *block_tables, *context_lens, *query_starts;  /* the one sequence's; query_starts [0, rows] */
    int64_t block_size, table_width, block_stride, layer_stride;  /* elements; layer_stride: a layer's latent rows */
    float scale;
    const int64_t *slots;  /* [rows]: each row's latent slot in layer 0, elements from kv */
    const int64_t *positions;  /* [rows]: each row's RoPE table row */
} mla_attention_args;

/* DeepSeek V3's MTP layer around its decoder layer (atomd_mtp_pass): plain row-major weights */
typedef struct {
    const void *embed, *enorm, *hnorm, *eh_proj, *input_norm, *head_norm, *head;  /* eh_proj [hidden][2 hidden] */
    int64_t vocab;
} mtp_weights;

/* elements of the model's dtype in the scratch of a call (float32 / int64 parts counted in pairs) */
static int64_t mla_scratch_elems(const mla_layer_config *c, int num_threads) {
    const int64_t R = c->max_rows, qk = c->nope + c->rope, q_first = c->q_lora ? c->q_lora : c->heads * qk;
    const int64_t head = R * (q_first + c->rank + c->rope + c->q_lora);
    const int64_t tail = 2 * R * c->hidden + 2 * R * c->max_inter
                         + num_threads * (2 * R * c->hidden + R * c->max_inter + 4 * c->max_inter + 2 * c->hidden)
                         + 2 * (R * c->top_k * c->hidden + c->experts + 2 * R * c->top_k + 64);
    return head > tail ? head : tail;
}
int64_t atomd_mla_scratch_elems(const mla_layer_config *c, int num_threads) { return mla_scratch_elems(c, num_threads); }

/* the router of one row (one thread): ids [k] and float32 weights [k] (DeepseekRouting's) */
static void mla_route(const mla_layer_config *c, const float *router, const float *correction, const float *hf,
                      float *logits, int64_t *ids, float *wts) {
    const int64_t E = c->experts, H = c->hidden, k = c->top_k, per_group = E / c->n_group;
    for (int64_t e = 0; e < E; e++) {
        const float *we = router + e * H;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < H; i++) s += hf[i] * we[i];
        logits[e] = s;
    }
    float choice[E], scores[E];
    if (c->scoring == 2) {
        for (int64_t e = 0; e < E; e++) {
            scores[e] = 1.0f / (1.0f + expf(-logits[e]));
            choice[e] = scores[e] + correction[e];
        }
    } else {
        float m = -INFINITY, total = 0.0f;
        for (int64_t e = 0; e < E; e++) m = logits[e] > m ? logits[e] : m;
        for (int64_t e = 0; e < E; e++) total += scores[e] = expf(logits[e] - m);
        for (int64_t e = 0; e < E; e++) choice[e] = scores[e] /= total;
    }
    if (c->scoring != 0 && c->n_group > 1) {  /* keep the topk_group best groups; the others' experts out */
        float group[c->n_group];
        for (int64_t g = 0; g < c->n_group; g++) {
            float best = -INFINITY, second = -INFINITY;
            for (int64_t e = g * per_group; e < (g + 1) * per_group; e++) {
                if (choice[e] > best) { second = best; best = choice[e]; }
                else if (choice[e] > second) second = choice[e];
            }
            group[g] = c->scoring == 2 ? best + second : best;  /* V3: the two best biased scores; V2: the best */
        }
        char keep[c->n_group];
        memset(keep, 0, sizeof keep);
        for (int64_t j = 0; j < c->topk_group; j++) {
            int64_t at = -1;
            for (int64_t g = 0; g < c->n_group; g++)
                if (!keep[g] && (at < 0 || group[g] > group[at])) at = g;
            keep[at] = 1;
        }
        for (int64_t e = 0; e < E; e++)
            if (!keep[e / per_group]) choice[e] = c->scoring == 2 ? -INFINITY : 0.0f;
    }
    char taken[E];
    memset(taken, 0, sizeof taken);
    float sum = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        int64_t at = -1;
        for (int64_t e = 0; e < E; e++)
            if (!taken[e] && (at < 0 || choice[e] > choice[at])) at = e;
        taken[at] = 1;
        ids[j] = at;
        wts[j] = c->scoring == 2 ? scores[at] : choice[at];
        sum += wts[j];
    }
    for (int64_t j = 0; j < k; j++) {
        if (c->scoring == 2 && c->norm_topk_prob) wts[j] /= sum + 1e-20f;
        wts[j] *= c->routed_scaling_factor;
    }
}

/* a thread's part of the tail's scratch: x, h copies [R][hidden], the SiLU rows [R][max_inter],
 * one expert's gate/up [2 max_inter] and output [hidden] for each of two rows */
#define MLA_THREAD_AT(t) (threads_at + (t) * (2 * R * H + R * c->max_inter + 4 * c->max_inter + 2 * H))

#define MLA_LAYERS(SUFFIX, elem_t, IS_BF16, NORM_ROW, SILU_ROW, GEMV)                                               \
    /* one row after its projections: q (from q_src: the qkv_a row or q_b's) and each head's rope part \
     * RoPE'd; the latent (ar: the kv_a part of the qkv_a row) normed, its rope part RoPE'd, into lat */         \
    static inline void mla_head_row_##SUFFIX(const mla_layer_config *c, const elem_t *q_src, elem_t *qr,         \
                                             const elem_t *ar, const elem_t *kv_a_norm, elem_t *lat,             \
                                             const elem_t *cos, const elem_t *sin, int64_t position) {          \
        const int64_t qk = c->nope + c->rope, half = c->rope / 2;                                              \
        const char *cr = (const char *)(cos + position * half), *sr = (const char *)(sin + position * half);  \
        if (q_src != qr) memcpy(qr, q_src, c->heads * qk * sizeof(elem_t));                                   \
        NORM_ROW((elem_t *)ar, NULL, kv_a_norm, lat, c->rank, c->eps); /* x written only with a delta */      \
        memcpy(lat + c->rank, ar + c->rank, c->rope * sizeof(elem_t));                                         \
        rope_row((char *)(lat + c->rank), 1, c->rope, cr, sr, IS_BF16);                                         \
        for (int64_t j = 0; j < c->heads; j++) rope_row((char *)(qr + j * qk + c->nope), 1, c->rope, cr, sr, IS_BF16); \
    }                                                                                                              \
    /* A batch's decode rows between the linears (atomd/model/deepseek.py, the rows path: oneDNN runs  \
     * the projections): mla_head_row of each row r, its q from q_src + r * q_stride (the qkv_a output \
     * or q_b's) into q [R][heads][nope + rope], its latent from qa + r * qa_stride + q_first into the \
     * cache at latent + slots[r]. One call where the per-op layer made ~15 (cat, slices, RoPE's muls). */ \
    void atomd_mla_rows_head_##SUFFIX(const mla_layer_config *c, int64_t R, const elem_t *qa, int64_t qa_stride,  \
                                      int64_t q_first, const elem_t *q_src, int64_t q_stride,                   \
                                      const elem_t *kv_a_norm, const elem_t *cos, const elem_t *sin,            \
                                      const int64_t *positions, elem_t *latent, const int64_t *slots, elem_t *q, \
                                      int num_threads) {                                                        \
        const int64_t q_size = c->heads * (c->nope + c->rope);                                                  \
        _Pragma("omp parallel for num_threads(num_threads) if (R * q_size >= PARALLEL_MIN_ELEMENTS)")           \
        for (int64_t r = 0; r < R; r++)                                                                         \
            mla_head_row_##SUFFIX(c, q_src + r * q_stride, q + r * q_size, qa + r * qa_stride + q_first,       \
                                  kv_a_norm, latent + slots[r], cos, sin, positions[r]);                        \
    }                                                                                                              \
    static void mla_head_##SUFFIX(const mla_layer_weights *w, const mla_layer_config *c, int64_t R,              \
                                  const elem_t *h, const elem_t *cos, const elem_t *sin, const int64_t *positions, \
                                  elem_t *latent, const int64_t *slots, elem_t *q, elem_t *scratch, int num_threads) { \
        const int64_t qk = c->nope + c->rope, q_size = c->heads * qk, q_first = c->q_lora ? c->q_lora : q_size;    \
        const int64_t qa_w = q_first + c->rank + c->rope;                                                     \
        elem_t *qa = scratch, *qn = qa + R * qa_w;                                                                 \
        _Pragma("omp parallel num_threads(num_threads)")                                                           \
        {                                                                                                          \
            GEMV##_rows_m(h, R, (const elem_t *)w->qkv_a, qa, c->hidden, qa_w);                                    \
            if (c->q_lora) {                                                                                       \
                _Pragma("omp single")                                                                              \
                for (int64_t r = 0; r < R; r++)                                                                    \
                    NORM_ROW(qa + r * qa_w, NULL, (const elem_t *)w->q_a_norm, qn + r * c->q_lora, c->q_lora, c->eps); \
                GEMV##_rows_m(qn, R, (const elem_t *)w->q_b, q, c->q_lora, q_size);                                \
            }                                                                                                      \
            _Pragma("omp single")                                                                                  \
            for (int64_t r = 0; r < R; r++)                                                                        \
                mla_head_row_##SUFFIX(c, c->q_lora ? q + r * q_size : qa + r * qa_w, q + r * q_size,              \
                                      qa + r * qa_w + q_first, (const elem_t *)w->kv_a_norm, latent + slots[r],   \
                                      cos, sin, positions[r]);                                                     \
        }                                                                                                          \
    }                                                                                                              \
    static void mla_tail_##SUFFIX(const mla_layer_weights *w, const mla_layer_config *c, int64_t R,              \
                                  const elem_t *attn, elem_t *x, elem_t *next_h, elem_t *scratch, int num_threads) { \
        const int64_t H = c->hidden, k = c->top_k, mi = c->moe_inter, si = w->inter, mx = c->max_inter;           \
        elem_t *d = scratch, *sd = d + R * H, *gu = sd + R * H, *threads_at = gu + R * 2 * mx;                     \
        float *pairs = (float *)MLA_THREAD_AT(num_threads), *logits = pairs + R * k * H, *wts = logits + c->experts; \
        int64_t *ids = (int64_t *)(wts + R * k + (R * k & 1));                                                     \
        const int sparse = w->experts_gate_up != NULL;                                                             \
        int64_t job[2 * R * k], jobs = 0; /* the experts' work: (pair, pair or -1), shared by the threads */      \
        _Pragma("omp parallel num_threads(num_threads)")                                                           \
        {                                                                                                          \
            const int t = omp_get_thread_num(), threads = omp_get_num_threads();                                   \
            elem_t *xp = MLA_THREAD_AT(t), *hp = xp + R * H, *ap = hp + R * H, *egu = ap + R * mx, *ey = egu + 2 * mx; \
            elem_t *egu1 = ey + H, *ey1 = egu1 + 2 * mx;                                                               \
            memcpy(xp, x, R * H * sizeof(elem_t));                                                                 \
            GEMV##_rows_m(attn, R, (const elem_t *)w->o, d, c->heads * c->v, H);                                   \
            for (int64_t r = 0; r < R; r++)                                                                        \
                NORM_ROW(xp + r * H, d + r * H, (const elem_t *)w->post_norm, hp + r * H, H, c->eps);              \
            if (sparse) {                                                                                          \
                _Pragma("omp single")                                                                              \
                {                                                                                                  \
                    for (int64_t r = 0; r < R; r++) {                                                              \
                        float hf[H];                                                                               \
                        for (int64_t i = 0; i < H; i++) hf[i] = load(hp + r * H, i, IS_BF16);                      \
                        mla_route(c, w->router, w->correction, hf, logits, ids + r * k, wts + r * k);              \
                        for (int64_t j = 0; j < k; j++) w->routed[ids[r * k + j]] += 1;                            \
                    }                                                                                              \
                    /* jobs: (row, expert) pairs, two rows routed to the same expert in one (its weight read once) */ \
                    char paired[R * k];                                                                            \
                    memset(paired, 0, sizeof paired);                                                              \
                    jobs = 0;                                                                                      \
                    for (int64_t p = 0; p < R * k; p++) {                                                          \
                        if (paired[p]) continue;                                                                   \
                        int64_t other = -1;                                                                        \
                        for (int64_t q = (p / k + 1) * k; q < R * k && other < 0; q++)                             \
                            if (!paired[q] && ids[q] == ids[p]) other = q;                                         \
                        if (other >= 0) paired[other] = 1;                                                         \
                        job[2 * jobs] = p;                                                                         \
                        job[2 * jobs++ + 1] = other;                                                               \
                    }                                                                                              \
                }                                                                                                  \
                for (int64_t j = t; j < jobs; j += threads) { /* a thread's own jobs: no barrier */                \
                    const int64_t p = job[2 * j], q = job[2 * j + 1], e = ids[p];                                  \
                    const elem_t *wg = (const elem_t *)w->experts_gate_up + e * 2 * mi * H;                        \
                    const elem_t *wd = (const elem_t *)w->experts_down + e * H * mi;                               \
                    if (q < 0) {                                                                                   \
                        GEMV##_own(hp + p / k * H, wg, NULL, egu, H, 2 * mi);                                      \
                        SILU_ROW(egu, ap, mi);                                                                     \
                        GEMV##_own(ap, wd, NULL, ey, mi, H);                                                       \
                    } else {                                                                                       \
                        GEMV##_own2(hp + p / k * H, hp + q / k * H, wg, egu, egu1, H, 2 * mi);                     \
                        SILU_ROW(egu, ap, mi);                                                                     \
                        SILU_ROW(egu1, ap + mx, mi);                                                               \
                        GEMV##_own2(ap, ap + mx, wd, ey, ey1, mi, H);                                              \
                        for (int64_t i = 0; i < H; i++) pairs[q * H + i] = load(ey1, i, IS_BF16) * wts[q];         \
                    }                                                                                              \
                    for (int64_t i = 0; i < H; i++) pairs[p * H + i] = load(ey, i, IS_BF16) * wts[p];              \
                }                                                                                                  \
            }                                                                                                      \
            if (w->gate_up != NULL) {                                                                              \
                GEMV##_rows_m(hp, R, (const elem_t *)w->gate_up, gu, H, 2 * si);                                   \
                for (int64_t r = 0; r < R; r++) SILU_ROW(gu + r * 2 * si, ap + r * si, si); /* a thread's own */   \
                GEMV##_rows_m(ap, R, (const elem_t *)w->down, sparse ? sd : d, si, H);                             \
            }                                                                                                      \
            if (sparse) {                                                                                          \
                _Pragma("omp barrier")                                                                             \
                _Pragma("omp for schedule(static)")                                                                \
                for (int64_t ri = 0; ri < R * H; ri++) {                                                           \
                    const int64_t r = ri / H, i = ri % H;                                                          \
                    float s = 0.0f;                                                                                \
                    for (int64_t j = 0; j < k; j++) s += pairs[(r * k + j) * H + i];                               \
                    const float routed = round_to(s, IS_BF16);                                                     \
                    store(d, ri, w->gate_up != NULL ? routed + load(sd, ri, IS_BF16) : routed, IS_BF16);           \
                }                                                                                                  \
            }                                                                                                      \
            for (int64_t r = 0; r < R; r++) {                                                                      \
                if (w->next_norm != NULL) {                                                                        \
                    NORM_ROW(xp + r * H, d + r * H, (const elem_t *)w->next_norm, hp + r * H, H, c->eps);          \
                } else {                                                                                           \
                    for (int64_t i = 0; i < H; i++)                                                                \
                        store(xp, r * H + i, load(xp, r * H + i, IS_BF16) + load(d, r * H + i, IS_BF16), IS_BF16); \
                }                                                                                                  \
            }                                                                                                      \
            if (t == 0) {                                                                                          \
                memcpy(x, xp, R * H * sizeof(elem_t));                                                             \
                if (w->next_norm != NULL) memcpy(next_h, hp, R * H * sizeof(elem_t));                              \
            }                                                                                                      \
        }                                                                                                          \
    }                                                                                                              \
    /* Every layer over the R rows x [R][hidden] (updated in place), h [R][hidden] the first layer's        \
     * normed input (then each next layer's). Returns atomd_mla_decode's status (0, or -1: no scratch  \
     * memory; x and h are then incomplete). */                                                                    \
    int atomd_mla_layers_##SUFFIX(const mla_layer_weights *layers, int64_t num_layers, const mla_layer_config *c,  \
                                  const mla_attention_args *a, int64_t R, elem_t *h, elem_t *x, const elem_t *cos, \
                                  const elem_t *sin, elem_t *q, elem_t *attn, elem_t *scratch, int num_threads) {  \
        for (int64_t i = 0; i < num_layers; i++) {                                                                 \
            mla_head_##SUFFIX(layers + i, c, R, h, cos, sin, a->positions, (elem_t *)a->kv + i * a->layer_stride,  \
                              a->slots, q, scratch, num_threads);                                                  \
            const int status = a->fn(q, layers[i].uk_t, layers[i].uv, a->kv, a->block_tables, a->context_lens,    \
                                     a->query_starts, attn, 1, R, c->heads, a->block_size, a->table_width,         \
                                     a->block_stride, i * a->layer_stride, a->scale, IS_BF16, num_threads);        \
            if (status != 0) return status;                                                                        \
            mla_tail_##SUFFIX(layers + i, c, R, attn, x, h, scratch, num_threads);                                 \
        }                                                                                                          \
        return 0;                                                                                                  \
    }                                                                                                              \
    /* DeepSeek V3's MTP pass over one sequence's R decode rows (atomd/model/deepseek_mtp.py's mtp_forward \
     * in one call): eh [R][2 hidden] = [enorm(embed[next_ids[r]]) ; hnorm(hidden[r])], x = eh_proj(eh), \
     * the MTP's layer over x (atomd_mla_layers: x left holding its output states), then logits [L][vocab] \
     * = head(shared_head.norm(x[logits_rows[l]])). h [R][hidden] and eh: the caller's scratch. */           \
    int atomd_mtp_pass_##SUFFIX(const mtp_weights *m, const mla_layer_weights *layer, const mla_layer_config *c,  \
                                const mla_attention_args *a, int64_t R, const int64_t *next_ids,                  \
                                const elem_t *hidden, elem_t *eh, elem_t *h, elem_t *x, int64_t L,                \
                                const int64_t *logits_rows, elem_t *logits, const elem_t *cos, const elem_t *sin, \
                                elem_t *q, elem_t *attn, elem_t *scratch, int num_threads) {                      \
        const int64_t H = c->hidden;                                                                              \
        for (int64_t r = 0; r < R; r++) {                                                                         \
            NORM_ROW((elem_t *)m->embed + next_ids[r] * H, NULL, (const elem_t *)m->enorm, eh + r * 2 * H, H, c->eps); \
            NORM_ROW((elem_t *)hidden + r * H, NULL, (const elem_t *)m->hnorm, eh + r * 2 * H + H, H, c->eps);     \
        }                                                                                                          \
        _Pragma("omp parallel num_threads(num_threads)")                                                           \
        GEMV##_rows_m(eh, R, (const elem_t *)m->eh_proj, x, 2 * H, H);                                             \
        for (int64_t r = 0; r < R; r++) NORM_ROW(x + r * H, NULL, (const elem_t *)m->input_norm, h + r * H, H, c->eps); \
        const int status = atomd_mla_layers_##SUFFIX(layer, 1, c, a, R, h, x, cos, sin, q, attn, scratch, num_threads); \
        if (status != 0) return status;                                                                            \
        for (int64_t l = 0; l < L; l++) /* the normed states into eh's first rows: L <= R */                      \
            NORM_ROW(x + logits_rows[l] * H, NULL, (const elem_t *)m->head_norm, eh + l * H, H, c->eps);          \
        _Pragma("omp parallel num_threads(num_threads)")                                                           \
        GEMV##_rows_m(eh, L, (const elem_t *)m->head, logits, H, m->vocab);                                        \
        return 0;                                                                                                  \
    }

MLA_LAYERS(f32, float, 0, NORM_ROW_F32, SILU_ROW_F32, atomd_gemv_f32)
#if GEMV_KINDS & 2
MLA_LAYERS(bf16, bf16_t, 1, rms_norm_row_bf16, silu_mul_row_bf16, atomd_gemv_bf16)
#endif
#endif  /* AVX-512: the grouped experts and the MLA layers */
/* the same layer over int8 / int4 linears (atomd/csrc/quant.h), float32 activations: instantiated below moe_q8.h */
#include "quant.h"
#else
#define GEMV_KINDS 0
#endif

int atomd_gemv_kinds(void) { return GEMV_KINDS; }

/* LoRA of a step's rows under several adapters in one call (an SGMV, atomd/model/lora.py's sgmv form):
   out[i] += (x[i] @ a[s].T) @ b[s] for each row i whose slot s = slots[i] >= 0, a [adapters, w, k] (each
   rank's A row) and b [adapters, w, n] contiguous (an adapter narrower than w padded with zeros). Each row
   does only its own adapter's columns. The shrink's dot products keep 64 partial sums (independent lanes:
   they vectorise without reassociating, and four chains hide the FMA latency); the expand adds four
   ranks per pass over the row's outputs. */
#define SGMV_LANES 64
#define SGMV_MAX_W 256
void atomd_lora_sgmv_f32(const float *x, int64_t x_stride, const float *a, const float *b, const int64_t *slots,
                         float *out, int64_t out_stride, int64_t rows, int64_t k, int64_t w, int64_t n) {
    float t[SGMV_MAX_W + 3];
    for (int64_t i = 0; i < rows; i++) {
        const int64_t s = slots[i];
        if (s < 0) continue;
        const float *xi = x + i * x_stride, *as = a + s * w * k, *bs = b + s * w * n;
        float *oi = out + i * out_stride;
        for (int64_t r = 0; r < w; r++) {
            const float *ar = as + r * k;
            float acc[SGMV_LANES] = {0};
            int64_t j = 0;
            for (; j + SGMV_LANES <= k; j += SGMV_LANES)
                for (int l = 0; l < SGMV_LANES; l++) acc[l] += xi[j + l] * ar[j + l];
            float sum = 0.0f;
            for (; j < k; j++) sum += xi[j] * ar[j];
            for (int l = 0; l < SGMV_LANES; l++) sum += acc[l];
            t[r] = sum;
        }
        int64_t r = 0;
        for (; r + 4 <= w; r += 4) {
            const float t0 = t[r], t1 = t[r + 1], t2 = t[r + 2], t3 = t[r + 3];
            const float *b0 = bs + r * n, *b1 = b0 + n, *b2 = b1 + n, *b3 = b2 + n;
            for (int64_t c = 0; c < n; c++) oi[c] += t0 * b0[c] + t1 * b1[c] + t2 * b2[c] + t3 * b3[c];
        }
        for (; r < w; r++) {
            const float tr = t[r], *br = bs + r * n;
            for (int64_t c = 0; c < n; c++) oi[c] += tr * br[c];
        }
    }
}

/* An MoE block's output from its (token, choice) pairs (atomd/model/moe.py moe()): out[r] = bf16(the
 * float32 sum of pairs[r * k + j] over j = 0 .. k - 1, in that order), pairs bf16 or float32
 * (f32_pairs): torch's pairs.view(rows, k, hidden).sum(dim=1) to the bit, which took ~10% of a
 * 4096-token block on AMX (benchmarks/moe_block.py). */
void atomd_moe_sum_bf16(const void *pairs, int f32_pairs, bf16_t *out, int64_t rows, int64_t k, int64_t hidden,
                        int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * k * hidden >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i0 = 0; i0 < hidden; i0 += 512) {
            const int64_t n = hidden - i0 < 512 ? hidden - i0 : 512;
            float acc[512];
            for (int64_t i = 0; i < n; i++) acc[i] = 0.0f;
            for (int64_t j = 0; j < k; j++) {
                const int64_t base = (r * k + j) * hidden + i0;
                if (f32_pairs)
                    for (int64_t i = 0; i < n; i++) acc[i] += ((const float *)pairs)[base + i];
                else
                    for (int64_t i = 0; i < n; i++) acc[i] += bf16_to_float(((const bf16_t *)pairs)[base + i]);
            }
            for (int64_t i = 0; i < n; i++) out[r * hidden + i0 + i] = float_to_bf16(acc[i]);
        }
}

/* the MoE experts on AMX tiles (bf16) */
#include "moe_amx.h"
/* a few rows through a oneDNN-packed bf16 linear on AMX tiles */
#include "linear_amx.h"
/* int8 / int4 MoE experts: AMX-INT8 tiles (quant_amx.h), the int8 GEMM (quant_gemm.h) or the int8-activation
 * rows (quant.h); 16-bit ones: the panels (quant_w16.h) or the rows */
#include "quant_amx.h"
#include "quant_gemm.h"
#include "quant_w16.h"
#include "quant_w16_avx2.h"
#include "moe_q8.h"

#if GEMV_KINDS
/* the q_f32 layer's experts (QUANT_EXPERT): quantized ones, as moe_q8 runs them at one row an expert (its bits);
 * MOE_GEMV the router's float32 GEMV */
#define QUANT_EXPERT(GEMV, FORM, elem_t, x, experts, id, y, K, N)                                              \
    moe_q_expert##FORM(x, (const atomd_qweight *)(experts) + (id), y, K, N)
DECODE_LAYER(q_f32, float, 0, NORM_ROW_F32, SILU_ROW_F32, const atomd_qweight *, atomd_qgemv_rows, atomd_gemv_f32,
             QUANT_EXPERT)
#endif

/* the 16-bit panels' layout this build's quantized layer and batch rows read (quant_w16_avx2.h w16_panels_kind: 2 an
 * AVX2 build's strips, also where q is NULL, 1 AVX-512's panels): DecoderModel checks it against the strips'
 * quant.QuantizedWeight.panels_layout */
int atomd_layer_w16_layout(void) { return w16_panels_kind(); }

/* DeepSeekMoE's routed experts for the R rows h [R][hidden] of a batch (atomd/model/deepseek.py,
 * the rows path) in one call: moe.moe()'s steps with DeepseekRouting's router: each row's router
 * (mla_route, as the batch-1 layer: float32, the same choice), the (row, choice) pairs sorted by
 * expert (row order kept within: argsort(stable)), the experts on AMX tiles (moe_amx.h's amx_item,
 * atomd_moe_amx_bf16's work) into float32 pairs [R * top_k][hidden] scaled by their weights, each
 * row's pairs summed in choice order and rounded once into out (atomd_moe_sum_bf16's sum);
 * routed [experts] += the pairs per expert. shared_gate_up / shared_down (packed as one expert of
 * shared_inter, or NULL): the shared experts' MLP over every row on the tiles too (bf16 rows into
 * shared [R][hidden], scale 1), added to out as a bf16 add (routed + shared, as the per-op layer's
 * `down + shared`).
 * One OpenMP region: the routed experts' items and the shared expert's (first: the largest) shared
 * by the threads in one dynamic loop, then the rows' sums; the router and the pair sort run on the
 * calling thread before it (a 16-row batch's router is ~0.3 M multiply-adds). Why: the per-op
 * layer was ~25 Python-level calls a layer, then four parallel regions a call (router, routed
 * experts, the shared expert alone on one thread while the other idled, the sum): each fork and
 * join a wait for a sleeping thread, 26 layers a step (benchmarks/RESULTS.md #37).
 * Returns 0, -1 (no memory) or 1 (no AMX tiles here: nothing done, the counters untouched). */
#if MOE_AMX
#define MLA_ROUTE_PARALLEL_MIN (1 << 22) /* router multiply-adds from which its rows get their own region */
int atomd_mla_rows_moe_bf16(const mla_layer_config *c, const float *router, const float *correction,
                            const bf16_t *gate_up, const bf16_t *down, int64_t *routed, const bf16_t *h, int64_t R,
                            float *pairs, bf16_t *out, const bf16_t *shared_gate_up, const bf16_t *shared_down,
                            int64_t shared_inter, bf16_t *shared, int num_threads) {
    if (!amx_granted()) return 1;
    const int64_t k = c->top_k, E = c->experts, H = c->hidden, P = R * k, I = c->moe_inter;
    const int64_t shared_items = shared_gate_up != NULL ? (R + AMX_CHUNK - 1) / AMX_CHUNK : 0;
    const int64_t inter_max = shared_items && shared_inter > I ? shared_inter : I;
    int64_t *ids = malloc((size_t)(5 * P + 3 * E + 2 * R + 3) * sizeof(int64_t));
    float *wts = malloc((size_t)(2 * P + E * num_threads) * sizeof(float));
    bf16_t *ones = malloc((size_t)R * sizeof(bf16_t));
    if (ids == NULL || wts == NULL || ones == NULL) {
        free(ids);
        free(wts);
        free(ones);
        return -1;
    }
    int64_t *tokens = ids + P, *dest = tokens + P, *counts = dest + P, *at = counts + E, *experts = at + E;
    int64_t *starts = experts + E;  /* [active + 1] */
    float *scales = wts + P, *logits = scales + P;
#pragma omp parallel for num_threads(num_threads) if (R * E * H >= MLA_ROUTE_PARALLEL_MIN)
    for (int64_t r = 0; r < R; r++) {
        float hf[H];
        for (int64_t i = 0; i < H; i++) hf[i] = bf16_to_float(h[r * H + i]);
        mla_route(c, router, correction, hf, logits + omp_get_thread_num() * E, ids + r * k, wts + r * k);
    }
    const int64_t active = group_pairs(ids, wts, P, k, E, counts, at, experts, starts, tokens, dest, scales);
    int64_t *rows = starts + active + 1;  /* the shared expert's rows and pairs: 0 .. R - 1, scale 1 */
    for (int64_t r = 0; r < R; r++) rows[r] = r, ones[r] = float_to_bf16(1.0f);
    int64_t routed_items, most;
    int64_t *item_g = moe_items(starts, active, AMX_CHUNK, &routed_items, &most);
    if (item_g == NULL) {
        free(ids);
        free(wts);
        free(ones);
        return -1;
    }
    const int64_t items = shared_items + routed_items;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* thread-owned, as atomd_moe_amx_bf16's: the rows' tiles, gate_up's output, the activations; a row, a block */
        bf16_t *xa = malloc(sizeof(bf16_t) * AMX_CHUNK * (H + 3 * inter_max));
        float *blk = malloc(sizeof(float) * (1024 + 2 * inter_max));
        const int ready = amx_thread_ready(xa != NULL && blk != NULL, &failed);
        bf16_t *gu = xa + AMX_CHUNK * H, *act = gu + AMX_CHUNK * 2 * inter_max;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!ready) continue;
            if (it < shared_items) {  /* AMX_CHUNK rows of the shared expert: bf16 rows of shared, scale 1 */
                const int64_t p0 = it * AMX_CHUNK, m = R - p0 < AMX_CHUNK ? R - p0 : AMX_CHUNK;
                for (int64_t r = 0; r < (m + 15) / 16 * 16; r++)
                    amx_put_row(xa, r, r < m ? h + (p0 + r) * H : NULL, H);
                amx_item(xa, m, shared_gate_up, shared_down, H, shared_inter, 1, gu, act, blk + 1024, blk, p0, rows,
                         ones, shared, 0);
                continue;
            }
            const int64_t j = it - shared_items, g = item_g[j];
            int64_t p0;
            const int64_t m = moe_item_rows(item_g, starts, j, AMX_CHUNK, &p0);
            for (int64_t r = 0; r < (m + 15) / 16 * 16; r++)  /* rows past m: zeros (their outputs are dropped) */
                amx_put_row(xa, r, r < m ? h + tokens[p0 + r] * H : NULL, H);
            amx_item(xa, m, gate_up + experts[g] * 2 * I * H, down + experts[g] * H * I, H, I, 1, gu, act,
                     blk + 1024, blk, p0, dest, scales, pairs, 1);
        }
        if (ready) _tile_release();
        free(xa);
        free(blk);
        if (!failed) {  /* (the loop's barrier passed: every pair written) each row's pairs summed, + shared */
#pragma omp for schedule(static)
            for (int64_t r = 0; r < R; r++) {
                atomd_moe_sum_bf16(pairs + r * k * H, 1, out + r * H, 1, k, H, 1);
                if (shared_items)
                    for (int64_t i = r * H; i < (r + 1) * H; i++)
                        out[i] = float_to_bf16(bf16_to_float(out[i]) + bf16_to_float(shared[i]));
            }
        }
    }
    if (!failed)
        for (int64_t e = 0; e < E; e++) routed[e] += counts[e];
    free(item_g);
    free(ids);
    free(wts);
    free(ones);
    return failed ? -1 : 0;
}
#else
int atomd_mla_rows_moe_bf16(const void *c, const float *router, const float *correction, const bf16_t *gate_up,
                            const bf16_t *down, int64_t *routed, const bf16_t *h, int64_t R, float *pairs, bf16_t *out,
                            const bf16_t *shared_gate_up, const bf16_t *shared_down, int64_t shared_inter,
                            bf16_t *shared, int num_threads) {
    (void)c, (void)router, (void)correction, (void)gate_up, (void)down, (void)routed, (void)h, (void)R, (void)pairs;
    (void)out, (void)shared_gate_up, (void)shared_down, (void)shared_inter, (void)shared, (void)num_threads;
    return 1;
}
#endif

#if GEMV_KINDS
/* A batch's decode step, R >= 2 sequences one row each, over quantized linears (atomd/model/quant.py's
 * QuantizedWeight: int8 / int4 with int8 or float activations, bf16 / float16 weights widened: `--quantization`,
 * `--dtype auto` on a CPU without bf16 arithmetic), every layer in one call: per layer the QKV product, each row's
 * q / k norm, RoPE and K / V store (as atomd_rope_store_f32, or as KVCache.write stores a narrow cache's rows),
 * the decode attention kernel over the R rows (att->fn), the o product, the residual add and norm, gate_up,
 * SiLU-and-mul, down, and the next layer's residual norm. Why: per op, a layer was ~9 Python-level calls (~15-60
 * us each on the AVX2 EPYC) with an OpenMP fork in five, whose sleeping worker the next fork wakes (the Python
 * between them outlasts the spin before the sleep): on the 135M shape at batch 16 a third of the step
 * (benchmarks/RESULTS.md, #35 the fused batch). Each product runs as qlinear runs it on R rows
 * (quant.product_of), kinds[4 i + j] for layer i's linear j (qkv, o, gate_up, down): ROWS_* below; the row
 * ops are the per-op calls' row functions (a row a thread from as many values as theirs): the per-op path's bits. An
 * MoE layer's block (w->moe: quantized experts as moe_q8 runs them, kinds[4 i + 2 ..] unused) runs as rows_moe: its
 * router and softmax in C, so its logits differ from the per-op path's in the last bits, as the batch-1 layer's do
 * (the batch-16 step of the Qwen3-MoE shape was ~15% Python between the per-op calls: RESULTS.md, #35 the MoE
 * block in the fused rows); min_m, w16_min: moe_q8's, as moe.py passes them. h [R][hidden]: layer 0's normed input; x
 * [R][hidden] the residual, updated; buffers qkv [R][q_size + 2 kv_size], q and attn [R][q_size], d
 * [R][hidden], gu [R][2 inter], a [R][inter]. positions [R]: rows of the cos / sin tables; slot_rows [R]: each
 * row's K row in the cache seen as rows of kv_size values (KVCache.slot_rows), a layer's K rows layer_rows
 * further on, its V rows v_rows after its K rows; kv_elem the cache's bytes a value. Returns 0, -1 out of
 * memory (the scratch, a product's panels), -2 a product not built here, or the attention kernel's status. */
enum { ROWS_Q8, ROWS_Q8_GEMM, ROWS_INT, ROWS_W16, ROWS_W16_PANELS, ROWS_W16_PREPACKED, ROWS_Q8_AMX };
/* the int8 activations' scratch, as qlinear's: the rows' and the GEMM's (xq, xd, xsg), the AMX tiles' (xt, dt, xsgt:
 * NULL where no linear runs on them) */
typedef struct {
    int8_t *xq, *xt;
    float *xd, *xsg, *dt, *xsgt;
} rows_scratch;
#define ROWS_SCRATCH(bytes) (((size_t)(bytes) + 63) / 64 * 64)  /* aligned_alloc's sizes: whole alignments */
static int rows_product(const void *weight, const float *x, int64_t R, int64_t K, int64_t N, const float *bias,
                        float *y, int64_t kind, const rows_scratch *s, int num_threads) {
    const atomd_qweight *w = weight;
    int8_t *xq = s->xq;
    float *xd = s->xd, *xsg = s->xsg;
    const int bits = (int)w->bits, f16 = bits == QBITS_F16;
    if (w->q == NULL && kind != ROWS_W16_PREPACKED) return -2;  /* strips only: quant.product_of reads them */
    switch (kind) {
        case ROWS_Q8:
            qgemm_q8_rows(x, K, R, w->q, bits, w->scales, w->offsets, N, K, w->group, w->ablock, y, N, xq, xd, xsg,
                          num_threads);
            break;
        case ROWS_Q8_GEMM:
#if QV_PATH
            if (qgemm_q8_gemm(x, K, R, w->q, bits, w->scales, w->offsets, N, K, w->group, w->ablock, y, N, xq, xd,
                              xsg, num_threads) != 0)
                return -1;
            break;
#else
            return -2;
#endif
        case ROWS_Q8_AMX: {
#if QAMX_PATH  /* (its scratch allocated by the caller, which saw this kind among the layers') */
            const int status = qgemm_amx(x, K, R, w->q, bits, w->scales, w->offsets, N, K, w->group, w->ablock, y, N,
                                         s->xt, s->dt, s->xsgt, num_threads);
            if (status != 0) return status == 1 ? -2 : -1;  /* 1: Linux refused this process the tiles */
            break;
#else
            return -2;
#endif
        }
        case ROWS_INT:
            qgemm_int_rows(x, K, R, w->q, bits, w->scales, w->offsets, N, K, w->group, y, N, num_threads);
            break;
        case ROWS_W16:
            qgemm_w16_rows(x, K, R, w->q, f16, N, K, y, N, num_threads);
            break;
        case ROWS_W16_PANELS:
        case ROWS_W16_PREPACKED: {
            const int status = w16_panels_product(x, K, R, w->q, kind == ROWS_W16_PREPACKED ? w->panels : NULL, f16,
                                                  N, K, y, N, num_threads);
            if (status != 0) return status == 1 ? -2 : -1;
            break;
        }
        default:
            return -2;
    }
    if (bias != NULL)  /* qlinear's out.add_(bias) */
        for (int64_t r = 0; r < R; r++)
            for (int64_t n = 0; n < N; n++) y[r * N + n] += bias[n];
    return 0;
}

/* An MoE layer's sparse block (decode_moe_weights, quantized experts as moe_q8 takes them) on the R normed rows h
 * [R][hidden] into d [R][hidden]: each row's router logits (the GEMV rows' sums, as the batch-1 layer's), its routing
 * (moe_route), the (row, choice) pairs grouped by expert in pair order (moe.py's stable argsort) and run by
 * atomd_moe_q8 (each expert's rows as qlinear runs them: min_m, w16_min as moe.py passes them), then each row's k
 * pairs summed in float32 in choice order (moe.py's sum); routed += the pairs per expert. fs, is: the caller's
 * scratch of ROWS_MOE_FLOATS / ROWS_MOE_INTS. Returns 0, -1 out of memory, -2 moe_q8 not built here. */
#define ROWS_MOE_FLOATS(mw, R, hidden) ((R) * (mw)->experts + (R) * (mw)->top_k * (2 + (hidden)))
#define ROWS_MOE_INTS(mw, R) (4 * (R) * (mw)->top_k + 4 * (mw)->experts + 1)
static int rows_moe(const decode_moe_weights *mw, const float *h, int64_t R, int64_t hidden, float *d,
                    const int64_t *min_m, int64_t w16_min, float *fs, int64_t *is, int num_threads) {
    const int64_t E = mw->experts, k = mw->top_k, P = R * k;
    float *logits = fs, *sc = logits + R * E, *scales = sc + P, *pairs = scales + P;
    int64_t *ids = is, *tokens = ids + P, *dest = tokens + P, *experts = dest + P, *starts = experts + E;
    int64_t *counts = starts + E + 1, *at = counts + E;
    _Pragma("omp parallel num_threads(num_threads)")
    atomd_gemv_f32_rows_m(h, R, (const float *)mw->router, logits, hidden, E);
    for (int64_t r = 0; r < R; r++)
        moe_route(logits + r * E, 0, E, k, mw->norm_topk, !mw->f32_pairs, ids + r * k, sc + r * k);
    const int64_t n = group_pairs(ids, sc, P, k, E, counts, at, experts, starts, tokens, dest, scales);
    for (int64_t e = 0; e < E; e++) mw->routed[e] += counts[e];
    const int status = atomd_moe_q8(h, 0, mw->gate_up, mw->down, experts, starts, tokens, dest, scales, pairs, 1,
                                    hidden, mw->inter, n, min_m, 0, w16_min, num_threads);
    if (status != 0) return status == 1 ? -2 : status;
    _Pragma("omp parallel for num_threads(num_threads) if (P * hidden >= PARALLEL_MIN_ELEMENTS)")
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < hidden; i++) {
            float s = 0.f;
            for (int64_t j = 0; j < k; j++) s += pairs[(r * k + j) * hidden + i];
            d[r * hidden + i] = s;
        }
    return 0;
}

int atomd_decode_rows_q_f32(const decode_layer_weights *layers, int64_t num_layers, const decode_attention_args *att,
                            int64_t R, float *h, float *x, float *qkv, float *q, float *attn, float *d, float *gu,
                            float *a, const float *cos, const float *sin, const int64_t *positions,
                            const int64_t *slot_rows, int64_t layer_rows, int64_t v_rows, int64_t kv_elem,
                            const int64_t *kinds, const int64_t *moe_min_m, int64_t w16_min, int64_t hidden,
                            int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t inter, float eps,
                            int num_threads) {
    const int64_t q_size = q_heads * head_dim, kv_size = kv_heads * head_dim, width = q_size + 2 * kv_size;
    int64_t kmax = hidden > q_size ? hidden : q_size;
    kmax = inter > kmax ? inter : kmax;
    rows_scratch s = {0};  /* (as qlinear's torch.empty scratch) */
    s.xq = aligned_alloc(64, ROWS_SCRATCH(R * kmax));
    s.xd = aligned_alloc(64, ROWS_SCRATCH(sizeof(float) * R * Q8_XD(kmax)));
    s.xsg = aligned_alloc(64, ROWS_SCRATCH(sizeof(float) * R * Q8_XSG(kmax)));
    int tiles = 0;
    for (int64_t i = 0; i < 4 * num_layers; i++) tiles |= kinds[i] == ROWS_Q8_AMX;
#if QAMX_PATH
    if (tiles) {  /* (a group is at least a 32-input block: QAMX_XSG <= QAMX_DT) */
        s.xt = aligned_alloc(64, ROWS_SCRATCH(QAMX_XT(R, kmax)));
        s.dt = aligned_alloc(64, ROWS_SCRATCH(sizeof(float) * QAMX_DT(R, kmax)));
        s.xsgt = aligned_alloc(64, ROWS_SCRATCH(sizeof(float) * QAMX_DT(R, kmax)));
    }
#endif
    int64_t moe_floats = 0, moe_ints = 0;  /* rows_moe's scratch, for the largest MoE block */
    for (int64_t i = 0; i < num_layers; i++)
        if (layers[i].moe != NULL) {
            const int64_t f = ROWS_MOE_FLOATS(layers[i].moe, R, hidden), n = ROWS_MOE_INTS(layers[i].moe, R);
            moe_floats = f > moe_floats ? f : moe_floats, moe_ints = n > moe_ints ? n : moe_ints;
        }
    float *moe_fs = moe_floats ? malloc(sizeof(float) * moe_floats) : NULL;
    int64_t *moe_is = moe_ints ? malloc(sizeof(int64_t) * moe_ints) : NULL;
    const int no_tile_scratch = tiles && QAMX_PATH && (s.xt == NULL || s.dt == NULL || s.xsgt == NULL);
    int status = s.xq == NULL || s.xd == NULL || s.xsg == NULL || no_tile_scratch ||
                 (moe_floats && (moe_fs == NULL || moe_is == NULL)) ? -1 : 0;
    for (int64_t i = 0; i < num_layers && status == 0; i++) {
        const decode_layer_weights *w = layers + i;
        const int64_t *kind = kinds + 4 * i;
        status = rows_product(w->qkv, h, R, hidden, width, (const float *)w->bias, qkv, kind[0], &s, num_threads);
        if (status != 0) break;
        _Pragma("omp parallel for num_threads(num_threads) if (R * width >= PARALLEL_MIN_ELEMENTS)")
        for (int64_t r = 0; r < R; r++) {
            float *row = qkv + r * width;
            if (w->q_norm != NULL)
                for (int64_t j = 0; j < q_heads + kv_heads; j++)
                    NORM_ROW_F32(row + j * head_dim, NULL, (const float *)(j < q_heads ? w->q_norm : w->k_norm),
                                 row + j * head_dim, head_dim, eps);
            char *k = (char *)att->kv + (slot_rows[r] + i * layer_rows) * kv_size * kv_elem;
            rope_store_row((char *)row, q_heads, kv_heads, head_dim, (const char *)(cos + positions[r] * (head_dim / 2)),
                           (const char *)(sin + positions[r] * (head_dim / 2)), k, k + v_rows * kv_size * kv_elem, 0,
                           att->kv_narrow);
            memcpy(q + r * q_size, row, sizeof(float) * q_size);
        }
        status = att->fn(q, att->kv, att->block_tables, att->context_lens, NULL, attn, R, q_heads, kv_heads,
                         att->block_size, att->table_width, att->block_stride, i * att->layer_stride, att->v_offset,
                         att->scale, w->window, num_threads);
        if (status != 0) break;
        status = rows_product(w->o, attn, R, q_size, hidden, NULL, d, kind[1], &s, num_threads);
        if (status != 0) break;
        _Pragma("omp parallel for num_threads(num_threads) if (R * hidden >= PARALLEL_MIN_ELEMENTS)")
        for (int64_t r = 0; r < R; r++)
            NORM_ROW_F32(x + r * hidden, d + r * hidden, (const float *)w->post_norm, h + r * hidden, hidden, eps);
        if (w->moe != NULL) {
            status = rows_moe(w->moe, h, R, hidden, d, moe_min_m, w16_min, moe_fs, moe_is, num_threads);
        } else {
            status = rows_product(w->gate_up, h, R, hidden, 2 * inter, NULL, gu, kind[2], &s, num_threads);
            if (status != 0) break;
            _Pragma("omp parallel for num_threads(num_threads) if (R * inter >= PARALLEL_MIN_ELEMENTS)")
            for (int64_t r = 0; r < R; r++) SILU_ROW_F32(gu + r * 2 * inter, a + r * inter, inter);
            status = rows_product(w->down, a, R, inter, hidden, NULL, d, kind[3], &s, num_threads);
        }
        if (status != 0) break;
        _Pragma("omp parallel for num_threads(num_threads) if (R * hidden >= PARALLEL_MIN_ELEMENTS)")
        for (int64_t r = 0; r < R; r++)
            if (w->next_norm != NULL)
                NORM_ROW_F32(x + r * hidden, d + r * hidden, (const float *)w->next_norm, h + r * hidden, hidden, eps);
            else
                for (int64_t j = 0; j < hidden; j++) x[r * hidden + j] += d[r * hidden + j];
    }
    free(s.xq);
    free(s.xd);
    free(s.xsg);
    free(s.xt);
    free(s.dt);
    free(s.xsgt);
    free(moe_fs);
    free(moe_is);
    return status;
}
#endif
