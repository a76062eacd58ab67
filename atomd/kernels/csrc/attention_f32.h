/* Part of attention.c's one translation unit (one library per model shape: HEAD_DIM and GROUP
 * are macros there), included by it only. */
/* HEAD_DIM and GROUP are fixed at build time (atomd/native.py builds one library per model
 * shape) so the per-row loops unroll and the group's queries and accumulators stay in registers. */

/* q, out: [batch, num_heads, HEAD_DIM] contiguous. kv: the cache's base pointer; the K row of
 * token t of sequence b, KV head h is at
 *   kv + table[b][t / block_size] * block_stride + k_offset + ((t % block_size) * num_kv_heads + h) * HEAD_DIM
 * and its V row v_offset elements further. block_tables: [batch, table_width]. query_starts:
 * NULL (query row b is sequence b's one token), or [batch + 1] row offsets: sequence b owns
 * query rows query_starts[b] .. query_starts[b + 1] - 1, its last ones, so row r sees the keys
 * 0 .. context_lens[b] - (query_starts[b + 1] - r) (causal inside the run: a sequence's last
 * token and its drafts, verified in one step). num_threads: torch's intra-op count of the
 * calling thread (OpenMP's own default is per thread).
 * Returns 0, or -1 when a scratch buffer could not be allocated (out is then incomplete). */
int atomd_decode_attention(const float *restrict q, const float *restrict kv,
                            const int64_t *restrict block_tables, const int64_t *restrict context_lens,
                            const int64_t *restrict query_starts, float *restrict out, int64_t batch,
                            int64_t num_heads, int64_t num_kv_heads, int64_t block_size, int64_t table_width,
                            int64_t block_stride, int64_t k_offset, int64_t v_offset, float scale,
                            int64_t window, int num_threads) {
    return decode_attention_narrow(q, (const uint8_t *)kv, block_tables, context_lens, query_starts, out, batch,
                                   num_heads, num_kv_heads, block_size, table_width, block_stride, k_offset,
                                   v_offset, scale, window, num_threads, KV_F32);  /* (attention_narrow.h) */
}

/* Prefill work items: RB query rows of one KV head share each key tile load; QT tokens x GROUP
 * heads rows per item (a multiple of RB), KT keys per tile. */
#define RB 4
#define QT ((32 / GROUP) >= 4 ? (32 / GROUP) / 4 * 4 : 4)
#define KT 64

/* One work item: query tokens [r0, r0 + nrows) of a sequence whose rows start at q, k, v, KV
 * head h. Keys 0 .. r0 + nrows - 1, causally masked per row. */
static void prefill_item(const float *restrict q, const float *restrict kt, const float *restrict v,
                         float *restrict out, int64_t r0, int64_t nrows, int64_t h, int64_t num_heads,
                         int64_t q_stride, int64_t kt_stride, int64_t v_stride, float scale, int64_t window) {
    float qs[GROUP * QT][HEAD_DIM], acc[GROUP * QT][HEAD_DIM], m[GROUP * QT], l[GROUP * QT];
    float sc[GROUP * QT][KT];
    for (int64_t r = 0; r < QT; r++)  /* rows past the chunk's end compute on zeros, unused */
        for (int g = 0; g < GROUP; g++) {
            const int64_t row = g * QT + r;
            for (int d = 0; d < HEAD_DIM; d++) {
                qs[row][d] = r < nrows ? q[(r0 + r) * q_stride + (h * GROUP + g) * HEAD_DIM + d] * scale : 0.0f;
                acc[row][d] = 0.0f;
            }
            m[row] = -INFINITY;
            l[row] = 0.0f;
        }
    const int64_t nkeys = r0 + nrows, lo = window_start(r0 + 1, window);  /* row r0's first key */
    for (int64_t j0 = lo / KT * KT; j0 < nkeys; j0 += KT) {
        const int64_t nk = nkeys - j0 < KT ? nkeys - j0 : KT;
        for (int64_t b0 = 0; b0 < GROUP * QT; b0 += RB) {
            float sb[RB][KT] = {{0}};
            for (int d = 0; d < HEAD_DIM; d++) {
                const float *kd = kt + d * kt_stride + j0;  /* keys past nk: padding or the next prompt, masked */
                for (int rb = 0; rb < RB; rb++) {
                    const float qd = qs[b0 + rb][d];
#pragma omp simd
                    for (int j = 0; j < KT; j++) sb[rb][j] += qd * kd[j];
                }
            }
            for (int rb = 0; rb < RB; rb++) {  /* online softmax: rescale what came before */
                const int64_t row = b0 + rb, pos = r0 + row % QT;
                float *srow = sb[rb], mx = m[row], sum = 0.0f;
                for (int j = 0; j < KT; j++) {
                    if (j >= nk || j0 + j > pos || j0 + j < window_start(pos + 1, window)) srow[j] = -INFINITY;
                    mx = srow[j] > mx ? srow[j] : mx;
                }
                /* first tile: m = -inf, acc = 0; a row whose window starts past this tile: all -inf */
                const float alpha = mx == -INFINITY ? 1.0f : exp_nonpositive(m[row] - mx);
#pragma omp simd reduction(+ : sum)
                for (int j = 0; j < KT; j++) {
                    const float p = srow[j] == -INFINITY ? 0.0f : exp_nonpositive(srow[j] - mx);
                    sc[row][j] = p;
                    sum += p;
                }
                l[row] = l[row] * alpha + sum;
                m[row] = mx;
#pragma omp simd
                for (int d = 0; d < HEAD_DIM; d++) acc[row][d] *= alpha;
            }
        }
        for (int64_t b0 = 0; b0 < GROUP * QT; b0 += RB) {  /* RB accumulators stay in registers */
            float ab[RB][HEAD_DIM];
            for (int rb = 0; rb < RB; rb++)
                for (int d = 0; d < HEAD_DIM; d++) ab[rb][d] = acc[b0 + rb][d];
            for (int64_t j = 0; j < nk; j++) {
                const float *vr = v + (j0 + j) * v_stride + h * HEAD_DIM;
                for (int rb = 0; rb < RB; rb++) {
                    const float p = sc[b0 + rb][j];
#pragma omp simd
                    for (int d = 0; d < HEAD_DIM; d++) ab[rb][d] += p * vr[d];
                }
            }
            for (int rb = 0; rb < RB; rb++)
                for (int d = 0; d < HEAD_DIM; d++) acc[b0 + rb][d] = ab[rb][d];
        }
    }
    for (int64_t r = 0; r < nrows; r++)
        for (int g = 0; g < GROUP; g++) {
            const int64_t row = g * QT + r;
            float *dst = out + (r0 + r) * num_heads * HEAD_DIM + (h * GROUP + g) * HEAD_DIM;
            const float inv = 1.0f / l[row];
            for (int d = 0; d < HEAD_DIM; d++) dst[d] = acc[row][d] * inv;
        }
}

/* Causal attention of fresh sequences packed back to back. q [T, num_heads, HEAD_DIM], k, v
 * [T, num_kv_heads, HEAD_DIM], each with its own token stride (they are views into the QKV
 * projection); out [T, num_heads * HEAD_DIM] contiguous. Sequence s is rows
 * [seq_starts[s], seq_starts[s] + seq_lens[s]). Returns 0, or -1 when its buffers could not
 * be allocated (out untouched). */
int atomd_prefill_attention(const float *restrict q, const float *restrict k, const float *restrict v,
                             float *restrict out, const int64_t *restrict seq_starts,
                             const int64_t *restrict seq_lens, int64_t num_seqs, int64_t num_heads,
                             int64_t num_kv_heads, int64_t q_stride, int64_t k_stride, int64_t v_stride,
                             float scale, int64_t window, int num_threads) {
    int64_t rows = 0;  /* keys are read up to the furthest sequence end */
    for (int64_t s = 0; s < num_seqs; s++)
        rows = seq_starts[s] + seq_lens[s] > rows ? seq_starts[s] + seq_lens[s] : rows;
    const int64_t kt_stride = rows + KT;
    /* every key transposed once, [kv_head][d][token] (+ KT padding): the score loops become axpys
     * over contiguous keys, and no query tile transposes the same keys again */
    float *kt = calloc((size_t)num_kv_heads * HEAD_DIM * kt_stride, sizeof(float));
    int64_t *first = malloc(sizeof(int64_t) * (num_seqs + 1));  /* first work item of each sequence */
    if (kt == NULL || first == NULL) {
        free(kt);
        free(first);
        return -1;
    }
    first[0] = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        first[s + 1] = first[s] + num_kv_heads * ((seq_lens[s] + QT - 1) / QT);
#pragma omp parallel for num_threads(num_threads)
    for (int64_t t = 0; t < rows; t++)
        for (int64_t h = 0; h < num_kv_heads; h++)
            for (int d = 0; d < HEAD_DIM; d++)
                kt[(h * HEAD_DIM + d) * kt_stride + t] = k[t * k_stride + h * HEAD_DIM + d];
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = first[num_seqs] - 1; item >= 0; item--) {  /* the longest (last) tiles first */
        int64_t s = 0;
        while (first[s + 1] <= item) s++;
        const int64_t tiles = (seq_lens[s] + QT - 1) / QT, h = (item - first[s]) / tiles;
        const int64_t r0 = (item - first[s]) % tiles * QT, n = seq_lens[s] - r0 < QT ? seq_lens[s] - r0 : QT;
        const int64_t base = seq_starts[s];
        prefill_item(q + base * q_stride, kt + h * HEAD_DIM * kt_stride + base, v + base * v_stride,
                     out + base * num_heads * HEAD_DIM, r0, n, h, num_heads, q_stride, kt_stride, v_stride, scale,
                     window);
    }
    free(kt);
    free(first);
    return 0;
}
