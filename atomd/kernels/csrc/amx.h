/* AMX tile state (Sapphire Rapids and later), shared by attention_amx.h (bf16 prefill) and
 * quant_amx.h (int8 / int4 weights with int8 activations): the tile configuration record and
 * Linux's per-process permission. Include only where __AMX_TILE__ is defined. */
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
#endif
