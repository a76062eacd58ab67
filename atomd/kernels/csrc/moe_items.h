/* The work items of layer_ops.c's several-token MoE expert kernels (moe_amx.h, moe_q8.h): each
 * active expert's sorted pairs cut into chunks of at most `chunk` rows, one item a chunk, shared
 * by the threads in any order. */
#ifndef ATOMD_MOE_ITEMS_H
#define ATOMD_MOE_ITEMS_H
#include <stdint.h>
#include <stdlib.h>

/* item -> its expert's index g into starts (malloc'd, NULL out of memory); *items their number,
 * *max_rows the largest item's rows (at least 1) */
static int64_t *moe_items(const int64_t *starts, int64_t n_experts, int64_t chunk, int64_t *items, int64_t *max_rows) {
    int64_t n = 0, most = 1;
    for (int64_t g = 0; g < n_experts; g++) {
        const int64_t rows = starts[g + 1] - starts[g];
        n += (rows + chunk - 1) / chunk;
        most = rows > most ? (rows < chunk ? rows : chunk) : most;
    }
    int64_t *item_g = malloc(sizeof(int64_t) * (n + 1));
    if (item_g != NULL) {
        n = 0;
        for (int64_t g = 0; g < n_experts; g++)
            for (int64_t r = starts[g]; r < starts[g + 1]; r += chunk) item_g[n++] = g;
    }
    *items = n, *max_rows = most;
    return item_g;
}

/* item it's rows: returns how many, *p0 its first pair */
static inline int64_t moe_item_rows(const int64_t *item_g, const int64_t *starts, int64_t it, int64_t chunk,
                                    int64_t *p0) {
    const int64_t g = item_g[it];
    int64_t first = it;  /* this item's chunk of its expert's pairs */
    while (first > 0 && item_g[first - 1] == g) first--;
    *p0 = starts[g] + (it - first) * chunk;
    return starts[g + 1] - *p0 < chunk ? starts[g + 1] - *p0 : chunk;
}
#endif
