/* AdamW's gradient-norm pass cut into equal spans (adamw.cu): the tables a
 * call's launches take and where each thread's groups of 4 elements lie.
 * __host__ __device__ and header-only so tests/cuda_host/test_adamw_spans.cu
 * checks on the host, without a GPU, that every element of every tensor is
 * read exactly once and nothing else is. */
#pragma once

#include <stdint.h>

#include "opsmith.h" /* opsmith_status, OPSMITH_ADAMW_CHUNK (opsmith/adamw.h) */

namespace opsmith {
namespace adamw_spans {

constexpr int THREADS = 512;    /* a block */
constexpr int GROUPS = 8;       /* 4-element groups a thread */
constexpr int SPAN = GROUPS * 4 * THREADS;
constexpr int TENSORS = 1536;   /* table slots a launch */
constexpr int64_t PIECE = (int64_t)1 << 28; /* a longer tensor takes several slots: at[] stays int32 */
static_assert(SPAN >= OPSMITH_ADAMW_CHUNK, "at most one span a chunk: the workspace holds a partial a chunk");

/* A launch's tensors laid end to end, each started at a multiple of 4 (at[slot]:
 * where; at[nt]: the end), cut into SPAN-element spans, a block each. */
struct Table {
    const void *g[TENSORS];
    int64_t n[TENSORS];
    int32_t at[TENSORS + 1];
    int32_t nt;
};

/* The last slot in [lo, hi] with at[slot] <= v. */
__host__ __device__ inline int slot_at(const int32_t *at, int lo, int hi, int32_t v) {
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (at[mid] <= v) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Where group k of thread `tid` in block `block` lies: its slot and the
 * index of its first element in that slot's tensor; false past the launch's
 * end (and a group's elements from n[slot] on are padding, not read). */
struct Group {
    int slot;
    int64_t i;
};

struct BlockSlots {
    int32_t lo, hi; /* the block's span [lo, hi) */
    int first, last;
};

__host__ __device__ inline BlockSlots block_slots(const Table &tab, int block) {
    BlockSlots b;
    b.lo = (int32_t)block * SPAN;
    const int32_t end = tab.at[tab.nt];
    b.hi = end - b.lo < SPAN ? end : b.lo + SPAN;
    b.first = slot_at(tab.at, 0, tab.nt - 1, b.lo);
    b.last = slot_at(tab.at, b.first, tab.nt - 1, b.hi - 1);
    return b;
}

__host__ __device__ inline bool group_at(const Table &tab, const BlockSlots &b, int tid, int k, Group *out) {
    const int32_t v = b.lo + 4 * (tid + k * THREADS);
    if (v >= b.hi) return false;
    out->slot = slot_at(tab.at, b.first, b.last, v);
    out->i = v - tab.at[out->slot];
    return true;
}

/* Fills a table a launch from the call's tensors (grads[t] of numels[t]
 * elements of elem_size bytes) and calls launch(table, blocks) for each;
 * stops at the first status launch returns that is not success. */
template <typename F>
opsmith_status tables(int64_t count, const int64_t *numels, const void *const *grads, size_t elem_size, Table *tab,
                      F launch) {
    int nt = 0;
    int32_t at = 0;
    auto flush = [&]() -> opsmith_status {
        if (nt == 0) return OPSMITH_STATUS_SUCCESS;
        tab->at[nt] = at;
        tab->nt = nt;
        const int32_t blocks = (int32_t)((at + SPAN - 1) / SPAN);
        nt = 0, at = 0;
        return launch(*tab, blocks);
    };
    for (int64_t t = 0; t < count; t++) {
        for (int64_t off = 0; off < numels[t]; off += PIECE) {
            const int64_t n = numels[t] - off < PIECE ? numels[t] - off : PIECE;
            if (nt == TENSORS || (int64_t)at + n + 3 > (int64_t)INT32_MAX - SPAN) {
                const opsmith_status e = flush();
                if (e != OPSMITH_STATUS_SUCCESS) return e;
            }
            tab->g[nt] = static_cast<const char *>(grads[t]) + off * (int64_t)elem_size;
            tab->n[nt] = n;
            tab->at[nt] = at;
            at += (int32_t)((n + 3) / 4 * 4);
            nt++;
        }
    }
    return flush();
}

} // namespace adamw_spans
} // namespace opsmith
