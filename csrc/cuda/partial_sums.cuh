/* Deterministic column sums of partial rows: how row kernels reduce a
 * weight (or bias) gradient without float atomics. Each block of the main
 * kernel writes its own partial row; these launches add the rows in a fixed
 * order, so the same inputs give the same bits on every run. */
#pragma once

#include "common.cuh"

namespace opsmith {

/* out[c] = the sum of partial rows [c * per_chunk, (c + 1) * per_chunk), in
 * a fixed order (deterministic). A block covers 32 columns of one chunk; its
 * 8 thread rows each sum every 8th partial row (coalesced 32-wide reads),
 * then one thread row adds the 8 results. With many partial rows the
 * backward runs it twice: chunks of kReduceChunk rows into the workspace
 * tail (many blocks, so many loads in flight), then the chunk sums into
 * dweight (one chunk). */
constexpr int kReduceCols = 32, kReduceSlices = 8;
constexpr int64_t kReduceChunk = 64;

/* One block's share of column_sum_kernel (below): chunk blockIdx.y. */
template <typename Out, typename A>
__device__ __forceinline__ void column_sum_block(int64_t parts, int64_t per_chunk, int64_t n,
                                                 const A *__restrict__ partial, Out *__restrict__ out) {
    __shared__ A tile[kReduceSlices][kReduceCols + 1];
    /* launched to overlap the launch before it (the backward writing the
     * partial rows, or the first pass): let the next start, wait for that one */
    let_next_launch_start();
    wait_for_previous_launch();
    const int64_t col = (int64_t)blockIdx.x * kReduceCols + threadIdx.x;
    const int64_t p0 = (int64_t)blockIdx.y * per_chunk;
    const int64_t p1 = p0 + per_chunk < parts ? p0 + per_chunk : parts;
    A s = 0;
    if (col < n)
        for (int64_t p = p0 + threadIdx.y; p < p1; p += kReduceSlices) s += partial[p * n + col];
    tile[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < n) {
        A total = 0;
#pragma unroll
        for (int k = 0; k < kReduceSlices; k++) total += tile[k][threadIdx.x];
        out[(int64_t)blockIdx.y * n + col] = from_acc<Out>(total);
    }
}

template <typename Out, typename A>
__global__ void column_sum_kernel(int64_t parts, int64_t per_chunk, int64_t n,
                                        const A *__restrict__ partial, Out *__restrict__ out) {
    column_sum_block<Out, A>(parts, per_chunk, n, partial, out);
}

/* Two sets of partial rows in one launch (a backward with two gradients,
 * LayerNorm's dweight and dbias): set blockIdx.z reads partial + z *
 * set_stride and writes out0 or out1; a NULL output skips its set. */
template <typename Out, typename A>
__global__ void column_sum_pair_kernel(int64_t parts, int64_t per_chunk, int64_t n, const A *__restrict__ partial,
                                       int64_t set_stride, Out *out0, Out *out1) {
    Out *const out = blockIdx.z ? out1 : out0;
    if (!out) return; /* the whole block: no barrier is left waiting */
    column_sum_block<Out, A>(parts, per_chunk, n, partial + blockIdx.z * set_stride, out);
}

/* Rows of chunk sums the two-pass reduction of `parts` partial rows keeps
 * after the partial rows in the workspace; 0 when one pass does. */
inline int64_t reduce_chunks(int64_t parts) {
    return parts > 4 * kReduceChunk ? (parts + kReduceChunk - 1) / kReduceChunk : 0;
}

/* out (n) = the column sums of partial (parts, n), in storage type Out.
 * With many partial rows, two launches: chunk sums into `scratch`
 * (reduce_chunks(parts) rows of n, after the partial rows in the
 * workspace), then the chunk sums into out. */
template <typename Out, typename A>
void sum_partial_rows(int64_t parts, int64_t n, const A *partial, A *scratch, Out *out, cudaStream_t stream) {
    const unsigned cols = (unsigned)((n + kReduceCols - 1) / kReduceCols);
    const dim3 block(kReduceCols, kReduceSlices);
    const int64_t chunks = reduce_chunks(parts);
    if (chunks) {
        launch_after(column_sum_kernel<A, A>, dim3(cols, (unsigned)chunks), block, 0, stream, true, parts,
                     kReduceChunk, n, partial, scratch);
        launch_after(column_sum_kernel<Out, A>, dim3(cols), block, 0, stream, true, chunks, chunks, n,
                     (const A *)scratch, out);
    } else {
        launch_after(column_sum_kernel<Out, A>, dim3(cols), block, 0, stream, true, parts, parts, n, partial, out);
    }
}

/* out0, out1 (n each, either may be NULL) = the column sums of the two sets
 * of partial rows (parts, n) at partial and partial + set_stride, in two
 * launches at most (sum_partial_rows' passes, both sets in each). With many
 * partial rows the chunk sums go to `scratch`: 2 x reduce_chunks(parts)
 * rows of n. */
template <typename Out, typename A>
void sum_partial_row_pair(int64_t parts, int64_t n, const A *partial, int64_t set_stride, A *scratch, Out *out0,
                          Out *out1, cudaStream_t stream) {
    const unsigned cols = (unsigned)((n + kReduceCols - 1) / kReduceCols);
    const dim3 block(kReduceCols, kReduceSlices);
    const int64_t chunks = reduce_chunks(parts);
    if (chunks) {
        launch_after(column_sum_pair_kernel<A, A>, dim3(cols, (unsigned)chunks, 2), block, 0, stream, true, parts,
                     kReduceChunk, n, partial, set_stride, out0 ? scratch : nullptr,
                     out1 ? scratch + chunks * n : nullptr);
        launch_after(column_sum_pair_kernel<Out, A>, dim3(cols, 1, 2), block, 0, stream, true, chunks, chunks, n,
                     (const A *)scratch, chunks * n, out0, out1);
    } else {
        launch_after(column_sum_pair_kernel<Out, A>, dim3(cols, 1, 2), block, 0, stream, true, parts, parts, n,
                     partial, set_stride, out0, out1);
    }
}

} // namespace opsmith
