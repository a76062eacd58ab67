/* AMX tile state (Sapphire Rapids and later), shared by attention_amx.h (bf16 prefill),
 * moe_amx.h (bf16 MoE experts), quant_amx.h (int8 / int4 weights with int8 activations) and
 * mla.c (the absorbed MLA decode of a batch): the tile configuration record, Linux's
 * per-process permission, the all-16x64 tile set-up. Include only where __AMX_TILE__ is defined. */
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
#endif
