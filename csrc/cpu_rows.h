/* What the CPU row kernels (rms_norm.c, layer_norm.c) share: row sums in
 * fixed lanes, and the column sums of per-chunk partial rows that make
 * their weight gradients deterministic (and, included from here, the clone
 * attribute of cpu_clones.h). Header-only, static; works on the blocks of
 * convert_block.h. */
#ifndef OPSMITH_CPU_ROWS_H
#define OPSMITH_CPU_ROWS_H

#include "convert_block.h"
#include "cpu_clones.h"

/* Elements of a row widened to the accumulate type at a time: a few
 * buffers of them stay in L1. */
#define OPSMITH_CPU_BLOCK 512

/* Row sums run block by block: inside a block, LANES interleaved partial
 * sums (element i into lane i % LANES) added pairwise; the block sums go
 * into LANES more, block b into lane b % LANES. Rounding error then grows
 * with BLOCK / LANES + n / (BLOCK * LANES) rather than n; the fixed lanes
 * are what the compiler keeps in vector registers without reordering a
 * sum, and more lanes mean more independent add chains.
 *
 * lanes[i % LANES] += EXPR for i in [0, len), EXPR an expression of i. */
#define OPSMITH_LANES_ADD(LANES, lanes, len, i, EXPR)                      \
    do {                                                                   \
        int64_t i##_0 = 0;                                                 \
        for (; i##_0 + (LANES) <= (len); i##_0 += (LANES))                 \
            for (int k_ = 0; k_ < (LANES); k_++) {                         \
                const int64_t i = i##_0 + k_;                              \
                (lanes)[k_] += (EXPR);                                     \
            }                                                              \
        for (int k_ = 0; i##_0 < (len); i##_0++, k_++) {                   \
            const int64_t i = i##_0;                                       \
            (lanes)[k_] += (EXPR);                                         \
        }                                                                  \
    } while (0)

/* Per accumulate type ACC (float, double; SUFFIX names the convert_block.h
 * helpers): the pairwise total of the lanes, and the column sums. */
#define OPSMITH_DEFINE_CPU_ROWS(SUFFIX, ACC)                                                          \
    /* l[k] += l[k + w] for w = lanes/2 .. 1; l[0] (lanes a power of two) */                          \
    static inline ACC opsmith_lanes_total_##SUFFIX(ACC *l, int lanes) {                              \
        for (int w = lanes / 2; w > 0; w /= 2)                                                       \
            for (int k = 0; k < w; k++) l[k] += l[k + w];                                            \
        return l[0];                                                                                 \
    }                                                                                                \
                                                                                                     \
    /* out[i] = the sum over c in [0, chunks), in order from 0, of part[c * n + i], for the          \
     * columns i in [i0, i0 + len) (len <= OPSMITH_CPU_BLOCK), stored in out's dtype */              \
    OPSMITH_CPU_CLONES static void opsmith_sum_chunks_##SUFFIX(opsmith_dtype out_dtype, void *out,    \
                                                               const ACC *part, int64_t chunks,      \
                                                               int64_t n, int64_t i0, int64_t len) { \
        ACC buf[OPSMITH_CPU_BLOCK];                                                                  \
        ACC *o = opsmith_out_##SUFFIX(out_dtype, out, i0, buf);                                      \
        for (int64_t i = 0; i < len; i++) o[i] = 0;                                                  \
        /* chunk by chunk over the columns: a loop that vectorizes, each                             \
         * column still summed in chunk order */                                                     \
        for (int64_t c = 0; c < chunks; c++) {                                                       \
            const ACC *p = part + c * n + i0;                                                        \
            for (int64_t i = 0; i < len; i++) o[i] += p[i];                                          \
        }                                                                                            \
        opsmith_narrow_##SUFFIX(out_dtype, o, out, i0, len);                                         \
    }

OPSMITH_DEFINE_CPU_ROWS(f64, double)
OPSMITH_DEFINE_CPU_ROWS(f32, float)

/* Column sums of partial rows: for each k < outs with out[k] non-NULL,
 * out[k] (n, of out_dtype) = the column sums of part[k]'s `chunks` rows of
 * n (in the accumulate type of x_dtype), over `threads` by column blocks. */
static inline void opsmith_cpu_sum_chunks(opsmith_dtype x_dtype, opsmith_dtype out_dtype, int outs,
                                          void *const *out, const void *const *part, int64_t chunks, int64_t n,
                                          int threads) {
    const int64_t blocks = (n + OPSMITH_CPU_BLOCK - 1) / OPSMITH_CPU_BLOCK;
    const int f64 = x_dtype == OPSMITH_DTYPE_F64;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t i0 = b * OPSMITH_CPU_BLOCK, len = n - i0 < OPSMITH_CPU_BLOCK ? n - i0 : OPSMITH_CPU_BLOCK;
        for (int k = 0; k < outs; k++) {
            if (!out[k]) continue;
            if (f64) opsmith_sum_chunks_f64(out_dtype, out[k], (const double *)part[k], chunks, n, i0, len);
            else opsmith_sum_chunks_f32(out_dtype, out[k], (const float *)part[k], chunks, n, i0, len);
        }
    }
}

#endif /* OPSMITH_CPU_ROWS_H */
