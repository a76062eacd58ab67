/* Structured outputs: a grammar's token bitmask applied to the logits, loaded by
 * atomd/structured.py (built by atomd/cbuild.py, like the attention kernels).
 *
 * out[rows[j], t] = logits[rows[j], t] - drop for every token t whose bit in bitmask row j is
 * 0 (bit t % 32 of int32 word t / 32, llguidance's layout), logits[rows[j], t] - 0 where it
 * is 1: the numpy fallback's arithmetic exactly (`apply_bitmask`), so both give the same
 * bits. A word whose 32 bits are all set (most of a mask that allows much: a JSON string's
 * characters) is a plain copy, or nothing at all in place; a word of zeros (most of a mask
 * that allows little) is one subtraction per token; a mixed word selects 0 or drop per bit
 * and subtracts (vectorised by the compiler). No table, no temporary: the numpy path writes a
 * [rows, vocab] array of drops (a 256-entry table looked up per mask byte) and reads it back
 * to subtract, twice the memory traffic of the logits themselves.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* One row: n tokens, bits[0 .. (n + 31) / 32 - 1]. */
static void mask_row(const float *src, float *dst, const uint32_t *restrict bits,
                     int64_t n, float drop, int in_place) {
    int64_t full = n / 32;
    for (int64_t w = 0; w < full; w++, src += 32, dst += 32) {
        uint32_t m = bits[w];
        if (m == 0xFFFFFFFFu) {
            if (!in_place) memcpy(dst, src, 32 * sizeof(float));
        } else if (m == 0) {
            for (int k = 0; k < 32; k++) dst[k] = src[k] - drop;
        } else {
            for (int k = 0; k < 32; k++) dst[k] = src[k] - (((m >> k) & 1u) ? 0.0f : drop);
        }
    }
    int64_t tail = n - full * 32;  /* a vocabulary that is not a multiple of 32 */
    if (tail) {
        uint32_t m = bits[full];
        for (int64_t k = 0; k < tail; k++) dst[k] = src[k] - (((m >> k) & 1u) ? 0.0f : drop);
    }
}

/* logits, out: float32 [batch, vocab], rows `logits_stride` / `out_stride` floats apart (out
 * may be logits: in place, same stride). bitmask: int32 [n_rows, >= (vocab + 31) / 32], rows
 * `mask_stride` words apart. rows: the logits row of each bitmask row (NULL: 0 .. n_rows - 1),
 * distinct. With out != logits and copy_others set, the batch rows not in `rows` are copied
 * unchanged. Returns 0, or -1 when a row index is out of range (nothing written then) or the
 * scratch could not be allocated. */
int atomd_apply_bitmask(const float *logits, int64_t logits_stride, float *out, int64_t out_stride,
                        const int32_t *bitmask, int64_t mask_stride, const int64_t *rows, int64_t n_rows,
                        int64_t batch, int64_t vocab, float drop, int copy_others) {
    int in_place = out == logits;
    if (rows)
        for (int64_t j = 0; j < n_rows; j++)
            if (rows[j] < 0 || rows[j] >= batch) return -1;
    if (!in_place && copy_others && n_rows < batch) {
        unsigned char stack[256];
        unsigned char *masked = batch <= 256 ? stack : calloc((size_t)batch, 1);
        if (!masked) return -1;
        if (masked == stack) memset(stack, 0, (size_t)batch);
        for (int64_t j = 0; j < n_rows; j++) masked[rows ? rows[j] : j] = 1;
        for (int64_t r = 0; r < batch; r++)
            if (!masked[r]) memcpy(out + r * out_stride, logits + r * logits_stride, (size_t)vocab * sizeof(float));
        if (masked != stack) free(masked);
    }
    for (int64_t j = 0; j < n_rows; j++) {
        int64_t r = rows ? rows[j] : j;
        mask_row(logits + r * logits_stride, out + r * out_stride, (const uint32_t *)(bitmask + j * mask_stride),
                 vocab, drop, in_place);
    }
    return 0;
}
