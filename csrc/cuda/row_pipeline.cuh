/* Building blocks for row kernels that stream many rows through a block:
 *
 * - a per-thread ring of row stages in shared memory, filled by cp.async
 *   (sm_80+) several rows ahead, so loads stay in flight while the block
 *   reduces and writes the current row, without holding the next rows in
 *   registers. Each thread copies its own packs and reads back only those,
 *   so the ring needs no barrier: cp.async.wait_group orders a thread's
 *   copies before its own reads.
 * - a sum across the CTAs of a thread-block cluster (sm_90) through
 *   distributed shared memory, for rows split over several SMs. Every CTA
 *   adds the same values in rank order, so all get the same bits.
 * A row op uses them as rms_norm.cu does: issue rows ahead, wait for the
 * oldest, reduce with block_sum (+ ClusterSum::sum), then write. */
#pragma once

#include "common.cuh"

namespace opsmith {

/* 16 bytes global -> shared, asynchronously, bypassing L1 (streamed data). */
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
#else
    *reinterpret_cast<uint4 *>(smem) = *reinterpret_cast<const uint4 *>(gmem);
#endif
}

/* Closes this thread's group of copies issued since the last commit (an
 * empty group is fine: it keeps the count of groups per row uniform). */
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

/* Waits until at most PENDING of this thread's groups are still in flight. */
template <int PENDING> __device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
#endif
}

/* The ring: STAGES stages x TENSORS tensors x ITERS packs x blockDim.x
 * threads of Pack<T>, thread-fastest so a warp's 16-byte accesses fall in
 * distinct banks. */
template <typename T, int STAGES, int TENSORS, int ITERS> struct RowRing {
    Pack<T> *base;
    __device__ Pack<T> &at(int stage, int tensor, int it) const {
        return base[((stage * TENSORS + tensor) * ITERS + it) * (int)blockDim.x + threadIdx.x];
    }
};

/* This CTA's rank in its cluster (0 without clusters). */
template <int CLUSTER> __device__ __forceinline__ int cluster_rank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (CLUSTER > 1) {
        unsigned r;
        asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
        return (int)r;
    }
#endif
    return 0;
}

/* Every thread of every CTA of the cluster arrives, then waits for all;
 * release/acquire makes memory writes before it visible after it (and so
 * waits for this thread's outstanding stores: once a kernel, not a row). */
__device__ __forceinline__ void cluster_barrier() {
    OPSMITH_SM90_ASM("barrier.cluster.arrive.release.aligned;\n"
                     "barrier.cluster.wait.acquire.aligned;");
}

/* Row by row exchange of K values per CTA over the CTAs of a cluster. Each
 * CTA pushes its values into every CTA's slots for its rank with st.async,
 * which signals that CTA's mbarrier; a CTA waits on its own mbarrier and
 * then holds every CTA's values, rank by rank, in its own shared memory.
 * No barrier with release semantics is taken per row: that would wait for
 * the row's global stores to land, a full memory latency a row.
 * Slots and mbarriers alternate between two sets row by row: a CTA can
 * only send row k + 2 after every CTA sent row k + 1, which each does after
 * it finished reading row k (a block barrier must separate a CTA's reads of
 * row k's values from its sending row k + 1). init() and finish() are
 * called by every thread of every CTA, once a kernel; gather() by every
 * thread, once a row, with the same values in every thread of a CTA. */
template <int CLUSTER, typename A, int K> struct ClusterGather {
    A *slots;          /* [2][CLUSTER][K], shared */
    uint64_t *barrier; /* [2], shared */
    int row = 0;

    __device__ void init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        if constexpr (CLUSTER > 1) {
            if (threadIdx.x == 0) {
                for (int i = 0; i < 2; i++) {
                    const unsigned b = (unsigned)__cvta_generic_to_shared(barrier + i);
                    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(b) : "memory");
                }
                asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
            }
            cluster_barrier(); /* every mbarrier is ready before any value is sent */
        }
#endif
    }

    /* every CTA's values of this row: value k of rank r at [r * K + k] */
    __device__ const A *gather(const A (&v)[K]) {
        const int set = row & 1;
        A *my_slots = slots + set * CLUSTER * K;
        if constexpr (CLUSTER == 1) {
            row++;
            if (threadIdx.x == 0)
#pragma unroll
                for (int k = 0; k < K; k++) my_slots[k] = v[k];
            __syncthreads();
            return my_slots;
        } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
            const unsigned phase = (row >> 1) & 1;
            row++;
            const unsigned bar = (unsigned)__cvta_generic_to_shared(barrier + set);
            if (threadIdx.x == 0) {
                unsigned rank;
                asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
#pragma unroll
                for (int k = 0; k < K; k++) my_slots[rank * K + k] = v[k];
                /* this CTA's arrival, and the bytes the other CTAs will send */
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
                             "r"((unsigned)((CLUSTER - 1) * K * sizeof(A)))
                             : "memory");
#pragma unroll 1
                for (unsigned r = 0; r < (unsigned)CLUSTER; r++) {
                    if (r == rank) continue;
                    unsigned rbar;
                    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(rbar) : "r"(bar), "r"(r));
#pragma unroll
                    for (int k = 0; k < K; k++) {
                        const unsigned slot = (unsigned)__cvta_generic_to_shared(my_slots + rank * K + k);
                        unsigned rslot;
                        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(rslot) : "r"(slot), "r"(r));
                        if constexpr (sizeof(A) == 8) {
                            asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b64 [%0], %1, [%2];\n" ::"r"(rslot),
                                         "l"(__double_as_longlong((double)v[k])), "r"(rbar)
                                         : "memory");
                        } else {
                            asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(rslot),
                                         "r"(__float_as_uint((float)v[k])), "r"(rbar)
                                         : "memory");
                        }
                    }
                }
            }
            unsigned done = 0;
            do {
                asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                             " selp.u32 %0, 1, 0, p;\n}\n"
                             : "=r"(done)
                             : "r"(bar), "r"(phase)
                             : "memory");
            } while (!done);
            return my_slots;
#else
            __trap(); /* clusters are only launched on sm_90 and newer */
            return my_slots;
#endif
        }
    }

    __device__ void finish() {
        if constexpr (CLUSTER > 1) cluster_barrier(); /* no CTA leaves while others may still send to it */
    }
};

/* Row by row sums of one value per CTA over the CTAs of a cluster
 * (ClusterGather of one value, added in rank order: the same bits in every
 * CTA). slots: [2][CLUSTER]. */
template <int CLUSTER, typename A> struct ClusterSum {
    ClusterGather<CLUSTER, A, 1> g;
    __device__ ClusterSum(A *slots, uint64_t *barrier) : g{slots, barrier} {}
    __device__ void init() { g.init(); }
    __device__ A sum(A v) {
        if constexpr (CLUSTER == 1) {
            return v;
        } else {
            const A one[1] = {v};
            const A *all = g.gather(one);
            A total = 0;
#pragma unroll
            for (int r = 0; r < CLUSTER; r++) total += all[r];
            return total;
        }
    }
    __device__ void finish() { g.finish(); }
};

/* A ClusterSum over shared memory of its own (static: one per kernel that
 * calls this), initialised: called by every thread of every CTA, once. */
template <int CLUSTER, typename A> __device__ __forceinline__ ClusterSum<CLUSTER, A> cluster_sum_in_smem() {
    __shared__ A slots[2 * CLUSTER];
    __shared__ uint64_t barriers[2];
    ClusterSum<CLUSTER, A> s{slots, barriers};
    s.init();
    return s;
}

} // namespace opsmith
