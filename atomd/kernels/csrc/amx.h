/* AMX tile state (Sapphire Rapids and later), shared by attention_amx.h (bf16 prefill),
 * moe_amx.h (bf16 MoE experts), quant_amx.h (int8 / int4 weights with int8 activations, or widened
 * to bf16) and mla.c (the absorbed MLA decode of a batch): the tile configuration record, Linux's
 * per-process permission, the all-16x64 tile set-up, the bf16 block product of moe_amx.h and
 * quant_amx.h. Include only where __AMX_TILE__ is defined. */
#ifndef ATOMD_AMX_H
#define ATOMD_AMX_H
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Linux hands AMX's tile state to a process that asks; 1 when granted (torch's oneDNN asks too). */
static int amx_granted(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

/* ldtilecfg of the whole record. Not GCC 12's _tile_loadconfig: its asm names only the first 8 bytes
 * as read, so the optimizer may drop the stores of rows / colsb and ldtilecfg then faults (#GP) on
 * the stack's old bytes: what crashes llama.cpp 11434's AMX path here (benchmarks/llama_cpp.py). */
static inline void amx_load_config(const tile_config *c) {
    __asm__ volatile("ldtilecfg %0" : : "m"(*c));
}

static inline void amx_configure(void) {  /* every tile 16 rows of 64 bytes */
    tile_config c = {0};
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    amx_load_config(&c);
}

/* A thread's start inside a tile kernel's parallel region: its tiles configured when its scratch
 * is ready, else the kernel marked failed (it returns -1). Returns `ready`. */
static inline int amx_thread_ready(int ready, int *failed) {
    if (ready) {
        amx_configure();
    } else {
#pragma omp atomic write
        *failed = 1;
    }
    return ready;
}

#if defined(__AMX_BF16__)
/* bf16 tile products over operands in tile layout (moe_amx.h's experts, quant_amx.h's widened int
 * linears). 16 rows (two == 0) or 32 of A times the 32 outputs of B blocks b0 and b1 into out
 * [4][16][16] floats: tile t = (rows 16 * (t / 2), outputs 16 * (t % 2)). A and B in tile layout:
 * a's 16-row blocks and each B block as `chunks` consecutive 1 KB tiles (contiguous tile rows:
 * strided ones miss the prefetchers, attention_amx.h). bf16 values as uint16_t. Tiles as
 * amx_configure sets them. amx_products leaves the sums in tiles 0-3; amx_products_ld reads B tile c at
 * b + c * b_step (in bf16 values) with rows b_ld bytes apart (linear_amx.h: oneDNN's packed blocks). */
static inline void amx_products_ld(const uint16_t *a, int two, const uint16_t *b0, const uint16_t *b1,
                                   int64_t chunks, int64_t b_step, int64_t b_ld) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c = 0; c < chunks; c++) {
        _tile_loadd(4, a + c * 512, 64);
        _tile_loadd(6, b0 + c * b_step, b_ld);
        _tile_loadd(7, b1 + c * b_step, b_ld);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, a + (chunks + c) * 512, 64);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
}

static inline void amx_products(const uint16_t *a, int two, const uint16_t *b0, const uint16_t *b1,
                                int64_t chunks) {
    amx_products_ld(a, two, b0, b1, chunks, 512, 64);
}

/* the sums of amx_products into out, laid out as amx_block's (apart, so that a caller can run the
 * next block's products before it stores and works on this one's: moe_amx.h's pipelined experts) */
static inline void amx_store(int two, float *out) {
    _tile_stored(0, out, 64);
    _tile_stored(1, out + 256, 64);
    if (two) {
        _tile_stored(2, out + 512, 64);
        _tile_stored(3, out + 768, 64);
    }
}

static inline void amx_block(const uint16_t *a, int two, const uint16_t *b0, const uint16_t *b1, int64_t chunks,
                             float *out) {
    amx_products(a, two, b0, b1, chunks);
    amx_store(two, out);
}

#if defined(__AVX512BF16__)
/* Row r (K floats, K a multiple of 32) rounded to bf16 (nearest even) into the A tile layout at
 * `tiles`: [rows / 16][K / 32][16][32] */
static inline void amx_put_row_f32(uint16_t *tiles, int64_t r, const float *row, int64_t K) {
    uint16_t *dst = tiles + (r / 16) * K * 16 + (r % 16) * 32;
    for (int64_t c = 0; c < K / 32; c++)
        _mm512_storeu_si512(dst + c * 512, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + c * 32 + 16),
                                                                       _mm512_loadu_ps(row + c * 32)));
}
#endif
#endif
#endif
