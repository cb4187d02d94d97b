/* Rotary position embedding on CUDA: q and k in one launch, bandwidth
 * bound (q, k, cos, sin read once; q, k written once).
 *
 * Work item: (row (b, s), group of 8 (or 6) heads of q or of k, slot). A slot
 * is one pack of a head's pairs (rotate-half: V elements of the first half
 * with the matching V of the second; interleaved: V/2 whole pairs), or,
 * past the packs, one piece of the pass-through dims [rotary_dim, head_dim)
 * to copy. One thread an item over a flat grid, slot fastest, then group,
 * then row: a warp reads whole 128-byte segments, and the groups of one row
 * sit in one block, so their cos/sin reads hit the same lines. A short
 * batch whose row's items fit one block takes a block a row instead, the
 * item read off the thread and block indices (rotary_row_kernel).
 *
 * A thread issues every load of its item (cos/sin of the row, or of the
 * cache row position_ids names, and its heads' packs) before its
 * first store: the stores are `asm volatile` with a memory clobber and in
 * place nothing could move a later load above them, so loads interleaved
 * with stores would keep one head in flight a thread (v1's limit). 16-byte
 * loads and stores when every pointer, stride and size allows them; a
 * scalar kernel otherwise. Each element is read and then written by the one
 * thread that owns it, so in place (an output that is exactly its input)
 * is safe; q/k are read with plain loads, not the non-coherent path, for
 * that reason. Pass-through dims are skipped in place. */
#include "common.cuh"
#include "internal/rotary.h"
#include "launch_plan.cuh"

#include <algorithm>

namespace opsmith {
namespace {

/* 128-thread blocks, at least 4 an SM: registers capped at 128 a thread,
 * 512 threads an SM, each with 8 heads x 32 bytes of loads in flight
 * (128 KB an SM). Measured on the H200 (bench/NOTES.md, rotary v2): 0.88
 * of copy bandwidth at the bf16 anchor; uncapped, the 16-bit kernel took
 * 222 registers (one 256-thread block an SM) and reached 0.50, and 4 heads
 * at 2 such blocks (64 KB in flight) 0.69. */
constexpr int kThreads = 128;
constexpr int kMinBlocks = 4;
/* below this many items at 8 heads a thread, 2 heads a thread (launch) */
constexpr int64_t kSmallItems = 132 * 512;

/* Heads a thread (16-byte kernel): rotate-half 8 (2 packs a head in
 * flight, 16 in all), 6 where 8 do not fit the register cap without
 * spilling (16-bit x with float32 cos/sin: 32 registers of tables);
 * interleaved 16 (1 pack a head) where x and cos/sin share a dtype of at
 * most 4 bytes, the same 16 packs and register count, else 8. The scalar
 * kernel: 8. */
template <typename T, typename C, bool HALF, bool VEC> constexpr int heads_a_thread() {
    if constexpr (!VEC) return 8;
    else if constexpr (HALF) return sizeof(T) == 2 && sizeof(C) == 4 ? 6 : 8;
    else return sizeof(T) == sizeof(C) && sizeof(T) <= 4 ? 16 : 8;
}

/* N elements of U, moved as 16-byte packs when VEC, else one by one. */
template <typename U, int N, bool VEC> struct Vals {
    U v[N];
};

/* NC: the read-only path (cos/sin, never written by the kernel) */
template <typename U, int N, bool VEC, bool NC = false>
__device__ __forceinline__ Vals<U, N, VEC> load_vals(const U *p) {
    Vals<U, N, VEC> out;
    if constexpr (VEC) {
        static_assert(N * sizeof(U) % 16 == 0, "whole packs");
#pragma unroll
        for (int k = 0; k < (int)(N * sizeof(U) / 16); k++) {
            const uint4 *src = reinterpret_cast<const uint4 *>(p) + k;
            reinterpret_cast<uint4 *>(out.v)[k] = NC ? __ldg(src) : *src;
        }
    } else {
#pragma unroll
        for (int k = 0; k < N; k++) out.v[k] = NC ? __ldg(p + k) : p[k];
    }
    return out;
}

template <typename U, int N, bool VEC> __device__ __forceinline__ void store_vals(U *p, const Vals<U, N, VEC> &x) {
    if constexpr (VEC) {
        constexpr int per = (int)(16 / sizeof(U));
#pragma unroll
        for (int k = 0; k < N / per; k++) store16(p + k * per, x.v + k * per);
    } else {
#pragma unroll
        for (int k = 0; k < N; k++) p[k] = x.v[k];
    }
}

/* x's elements all NaN where bad, word by word (once an item, on the
 * packed cos/sin: every rotation they enter is then NaN, with no select on
 * each head's outputs). */
template <typename U, int N, bool VEC> __device__ __forceinline__ void nan_if(Vals<U, N, VEC> &x, bool bad) {
    if constexpr (sizeof(x) % 4 == 0) {
        Vals<U, N, VEC> nan;
#pragma unroll
        for (int k = 0; k < N; k++) nan.v[k] = from_acc<U>(typename AccOf<U>::type(NAN));
        uint32_t w[sizeof(x) / 4], n[sizeof(x) / 4];
        memcpy(w, &x, sizeof x);
        memcpy(n, &nan, sizeof nan);
        /* a 32-bit select in PTX: written in C++, the 16-bit tables' words
         * were split into halves, selected one by one and joined again for
         * each head (opaque wants whole words) */
#pragma unroll
        for (int k = 0; k < (int)(sizeof(x) / 4); k++)
            asm("{ .reg .pred p; setp.ne.u32 p, %2, 0; selp.b32 %0, %3, %1, p; }"
                : "=r"(w[k])
                : "r"(w[k]), "r"((uint32_t)bad), "r"(n[k]));
        memcpy(&x, w, sizeof x);
    } else {
#pragma unroll
        for (int k = 0; k < N; k++) x.v[k] = bad ? from_acc<U>(typename AccOf<U>::type(NAN)) : x.v[k];
    }
}

template <typename I> struct View {
    I bs, ss, hs;
};

/* The flat plans' arguments: 64-bit offsets. */
struct Args {
    using Index = int64_t;
    const void *q, *k;
    void *qo, *ko;
    View<int64_t> vq, vqo, vk, vko;
    int hq, hk;
    int64_t seq, rows, head_dim, rotary_dim;
    const void *cos, *sin;
    int64_t cs_bs, cs_ss;
    const int64_t *pos;
    int64_t pos_bs, pos_ss, max_pos;
    bool copy_q, copy_k; /* pass-through part to copy (not in place) */
    /* the launch plan: items = rows x groups x slots (items and narrow:
     * the flat plans only) */
    int64_t packs;  /* rotation slots a head */
    int64_t slots;  /* packs + copy slots */
    int64_t groups; /* ceil(hq / heads a thread) + ceil(hk / heads a thread) */
    int64_t cw;     /* elements a copy slot: a 16-byte pack, or 1 */
    int64_t items;
    bool narrow;    /* items < 2^32: index arithmetic in 32 bits */
};

/* The row plan's arguments (a short batch: every offset fits 32 bits and
 * no stride is negative, so an offset is unsigned and a pointer is formed
 * by one wide multiply-add, with no sign extension): what a rotation reads
 * first fills the first 128 bytes, where the 264-byte Args spread it over
 * its whole length. At decode sizes a thread's chain is the kernel's time,
 * and each further constant line it touched was one more miss before its
 * loads (bench/NOTES.md, rotary at decode). */
struct RowArgs {
    using Index = uint32_t;
    const void *q, *k;
    void *qo, *ko;
    const void *cos, *sin;
    const int64_t *pos;
    View<uint32_t> vq, vqo, vk, vko;
    uint32_t cs_bs, cs_ss;
    int32_t hq, hk;
    uint32_t rotary_dim, packs;
    /* position_ids and the pass-through copy only */
    uint32_t pos_bs, pos_ss;
    int64_t max_pos;
    uint32_t cw;
    bool copy_q, copy_k;
};
static_assert(offsetof(RowArgs, pos_bs) == 128, "a rotation without position_ids reads the first 128 bytes");

/* A thread's group of heads of row (b, s): the first element of its j-th
 * head, in and out. The flat plans' groups each lie in one tensor (q's
 * groups, then k's), so a head's pointers are the group's first head's
 * plus j strides, an add a head; the row plan's (one or two heads of q then
 * k, 32-bit offsets) form a head's pointers where they are used, so the
 * output's come after the loads are issued. */
template <typename T, typename A, int kHeads, typename I = typename A::Index> struct Group {
    static constexpr bool kLazy = std::is_same<A, RowArgs>::value;
    const A &a;
    I b, s;
    int h0; /* the row plan: the first head, counted over q's then k's */
    int n;  /* the flat plans: heads in the group */
    const T *in0;
    T *out0;
    I ins, outs;
    bool copy;
    /* g: the flat plans' group (q's groups first), the row plan's first head */
    __device__ __forceinline__ Group(const A &a_, I b_, I s_, int g) : a(a_), b(b_), s(s_) {
        if constexpr (kLazy) {
            h0 = g;
        } else {
            const int gq = (a.hq + kHeads - 1) / kHeads;
            const bool isk = g >= gq;
            const int first = (isk ? g - gq : g) * kHeads;
            n = min(kHeads, (isk ? a.hk : a.hq) - first);
            const View<int64_t> &vi = isk ? a.vk : a.vq, &vo = isk ? a.vko : a.vqo;
            in0 = static_cast<const T *>(isk ? a.k : a.q) + (b * vi.bs + s * vi.ss + first * vi.hs);
            out0 = static_cast<T *>(isk ? a.ko : a.qo) + (b * vo.bs + s * vo.ss + first * vo.hs);
            ins = vi.hs, outs = vo.hs;
            copy = isk ? a.copy_k : a.copy_q;
        }
    }
    __device__ __forceinline__ bool has(int j) const {
        if constexpr (kLazy) return h0 + j < a.hq + a.hk;
        else return j < n;
    }
    __device__ __forceinline__ const T *in(int j) const {
        if constexpr (kLazy) {
            const int h = h0 + j;
            return h < a.hq ? static_cast<const T *>(a.q) + (b * a.vq.bs + s * a.vq.ss + h * a.vq.hs)
                            : static_cast<const T *>(a.k) + (b * a.vk.bs + s * a.vk.ss + (h - a.hq) * a.vk.hs);
        } else {
            return in0 + j * ins;
        }
    }
    __device__ __forceinline__ T *out(int j) const {
        if constexpr (kLazy) {
            const int h = h0 + j;
            return h < a.hq ? static_cast<T *>(a.qo) + (b * a.vqo.bs + s * a.vqo.ss + h * a.vqo.hs)
                            : static_cast<T *>(a.ko) + (b * a.vko.bs + s * a.vko.ss + (h - a.hq) * a.vko.hs);
        } else {
            return out0 + j * outs;
        }
    }
    __device__ __forceinline__ bool copies(int j) const {
        if constexpr (kLazy) return h0 + j < a.hq ? a.copy_q : a.copy_k;
        else return copy;
    }
};

/* POS: position_ids may be given (checked at run time); without it no
 * position load, no NaN selects for a position out of range. */
template <typename T, typename C, typename Acc, bool HALF, int V, bool VEC, bool BWD, int kHeads, bool POS,
          typename A, typename I = typename A::Index>
__device__ __forceinline__ void rotate_item(const A &a, const Group<T, A, kHeads> &grp, I pk) {
    const I b = grp.b, s = grp.s;
    const I half = a.rotary_dim / 2;
    const I ea = pk * V, eb = HALF ? half + pk * V : pk * V;
    I cs_off;
    bool bad = false;
    if (POS && a.pos) {
        const int64_t p = __ldg(a.pos + b * a.pos_bs + s * a.pos_ss);
        bad = p < 0 || p >= a.max_pos;
        cs_off = bad ? 0 : (I)p * a.cs_ss;
    } else {
        cs_off = b * a.cs_bs + s * a.cs_ss;
    }
    const C *cosr = static_cast<const C *>(a.cos) + cs_off, *sinr = static_cast<const C *>(a.sin) + cs_off;
    /* every load first: cos/sin, then each head's packs */
    Vals<C, V, VEC> c1 = load_vals<C, V, VEC, true>(cosr + ea), s1 = load_vals<C, V, VEC, true>(sinr + ea);
    Vals<C, V, VEC> c2, s2;
    if constexpr (HALF) c2 = load_vals<C, V, VEC, true>(cosr + eb), s2 = load_vals<C, V, VEC, true>(sinr + eb);
    if (POS) {
        nan_if(c1, bad), nan_if(s1, bad);
        if constexpr (HALF) nan_if(c2, bad), nan_if(s2, bad);
    }
    Vals<T, V, VEC> xa[kHeads], xb[kHeads];
#pragma unroll
    for (int j = 0; j < kHeads; j++) {
        if (grp.has(j)) {
            const T *x = grp.in(j);
            xa[j] = load_vals<T, V, VEC>(x + ea);
            if constexpr (HALF) xb[j] = load_vals<T, V, VEC>(x + eb);
        }
    }
    /* FWD: (u, w) -> (u ca - w sa, w cb + u sb), ca/sa the first member's
     * cos/sin, cb/sb the second's; BWD, its transpose: the sines swapped
     * within the pair and negated, (u ca + w sb, w cb - u sa). cos/sin stay
     * packed in registers and are converted for each head (16 registers of
     * 16-bit tables, not 32 of floats). */
#pragma unroll
    for (int j = 0; j < kHeads; j++) {
        if (grp.has(j)) {
            if constexpr (VEC && sizeof(T) == 2) {
                /* convert each head's packs only when its turn comes (after the
                 * previous head's stores): converted early, 8 heads of 16-bit
                 * packs become 128 live floats, 220 registers and one block an
                 * SM, half the bytes in flight */
                opaque(xa[j]);
                if constexpr (HALF) opaque(xb[j]);
                if constexpr (sizeof(C) == 2) { /* likewise the tables, converted again for each head */
                    opaque(c1), opaque(s1);
                    if constexpr (HALF) opaque(c2), opaque(s2);
                }
            }
            T *o = grp.out(j);
            Acc u[V], ca[V], sa[V];
            unpack_n(xa[j].v, u), unpack_n(c1.v, ca), unpack_n(s1.v, sa);
            if constexpr (HALF) {
                Acc w[V], cb[V], sb[V];
                unpack_n(xb[j].v, w), unpack_n(c2.v, cb), unpack_n(s2.v, sb);
                Vals<T, V, VEC> oa, ob;
#pragma unroll
                for (int k = 0; k < V; k++) {
                    oa.v[k] = from_acc<T>(BWD ? u[k] * ca[k] + w[k] * sb[k] : u[k] * ca[k] - w[k] * sa[k]);
                    ob.v[k] = from_acc<T>(BWD ? w[k] * cb[k] - u[k] * sa[k] : w[k] * cb[k] + u[k] * sb[k]);
                }
                store_vals<T, V, VEC>(o + ea, oa);
                store_vals<T, V, VEC>(o + eb, ob);
            } else {
                Vals<T, V, VEC> ov;
#pragma unroll
                for (int k = 0; k < V; k += 2) {
                    ov.v[k] = from_acc<T>(BWD ? u[k] * ca[k] + u[k + 1] * sa[k + 1]
                                              : u[k] * ca[k] - u[k + 1] * sa[k]);
                    ov.v[k + 1] = from_acc<T>(BWD ? u[k + 1] * ca[k + 1] - u[k] * sa[k]
                                                  : u[k + 1] * ca[k + 1] + u[k] * sa[k + 1]);
                }
                store_vals<T, V, VEC>(o + ea, ov);
            }
        }
    }
}

/* W elements at dim e of each of the group's heads copied unchanged (the
 * pass-through dims), loads first. */
template <typename T, int W, bool VEC, int kHeads, typename A, typename I = typename A::Index>
__device__ __forceinline__ void copy_item(const Group<T, A, kHeads> &grp, I e) {
    Vals<T, W, VEC> x[kHeads];
#pragma unroll
    for (int j = 0; j < kHeads; j++)
        if (grp.has(j) && grp.copies(j)) x[j] = load_vals<T, W, VEC>(grp.in(j) + e);
#pragma unroll
    for (int j = 0; j < kHeads; j++)
        if (grp.has(j) && grp.copies(j)) store_vals<T, W, VEC>(grp.out(j) + e, x[j]);
}

/* q = x / d, r = x % d, in 32 bits when the whole item range fits */
__device__ __forceinline__ void divmod(bool narrow, int64_t x, int64_t d, int64_t &q, int64_t &r) {
    if (narrow) {
        const uint32_t xq = (uint32_t)x / (uint32_t)d;
        q = xq, r = (int64_t)((uint32_t)x - xq * (uint32_t)d);
    } else {
        q = x / d, r = x - q * d;
    }
}

/* One item: the rotation slot or the pass-through piece `slot` of group g
 * (Group's g) of row (b, s). */
template <typename T, typename C, typename Acc, bool HALF, int V, bool VEC, bool BWD, int H, bool POS = true,
          typename A, typename I = typename A::Index>
__device__ __forceinline__ void item(const A &a, I b, I s, I slot, int g) {
    constexpr int W = (int)(16 / sizeof(T));
    const Group<T, A, H> grp(a, b, s, g);
    if (slot < a.packs) {
        rotate_item<T, C, Acc, HALF, V, VEC, BWD, H, POS>(a, grp, slot);
        return;
    }
    const I e = a.rotary_dim + (slot - a.packs) * a.cw;
    if constexpr (VEC) {
        if (a.cw == W) {
            copy_item<T, W, true, H>(grp, e);
            return;
        }
    }
    copy_item<T, 1, false, H>(grp, e);
}

template <typename T, typename C, typename Acc, bool HALF, int V, bool VEC, bool BWD, int H>
__global__ void __launch_bounds__(kThreads, kMinBlocks) rotary_kernel(Args a) {
    const int64_t step = (int64_t)gridDim.x * blockDim.x;
    for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < a.items; t += step) {
        int64_t rg, slot, r, g, b, s;
        divmod(a.narrow, t, a.slots, rg, slot);
        divmod(a.narrow, rg, a.groups, r, g);
        divmod(a.narrow, r, a.seq, b, s);
        item<T, C, Acc, HALF, V, VEC, BWD, H>(a, b, s, slot, (int)g);
    }
}

/* A short batch's plan: a block a row (b, s) and group of its heads, its
 * threads (slot, group of H heads) on the block's two dimensions, so no
 * thread divides an index or loops: at decode sizes a thread's chain of
 * dependent instructions is the kernel's time. With fewer rows than SMs a
 * row's heads are spread over blocks of about kRowBlockThreads
 * (OPSMITH_ROTARY_ROW_THREADS; 512: the whole row a block always): a
 * decode batch has a few rows, and a block a row
 * put each row's ~10 warps on one SM, 2-3 warps to a scheduler issuing
 * their instructions in turn, where blocks of 2 warps spread them over the
 * idle SMs (bench/NOTES.md, rotary's heads over blocks). */
constexpr int kRowThreads = 512;
constexpr int kRowBlockThreads = 64;
template <typename T, typename C, typename Acc, bool HALF, int V, bool BWD, int H>
__global__ void __launch_bounds__(kRowThreads) rotary_row_kernel(RowArgs a) {
    const int h0 = (int)(blockIdx.z * blockDim.y + threadIdx.y) * H;
    if (a.pos)
        item<T, C, Acc, HALF, V, true, BWD, H, true>(a, blockIdx.y, blockIdx.x, threadIdx.x, h0);
    else
        item<T, C, Acc, HALF, V, true, BWD, H, false>(a, blockIdx.y, blockIdx.x, threadIdx.x, h0);
}

bool fits(int64_t v, int64_t w) { return v % w == 0; }

/* the last element's offset + 1, or -1 where a stride is negative */
int64_t span(int64_t batch, int64_t seq, int64_t heads, const View<int64_t> &v, int64_t width) {
    if (v.bs < 0 || v.ss < 0 || v.hs < 0) return -1;
    return (batch - 1) * v.bs + (seq - 1) * v.ss + (heads - 1) * v.hs + width;
}

/* The row plan's 32-bit arguments, or false where an offset the kernel
 * forms (row, head, element of q, k, their outputs, cos/sin, position_ids)
 * could pass 2^31 - 1 or a stride is negative: the flat plan takes that
 * call. */
bool row_args(const Args &a, int64_t batch, RowArgs &r) {
    auto ok = [](int64_t span) { return span >= 0 && span <= INT32_MAX; };
    /* cos/sin: rows (b, s), or the cache's max_pos rows */
    const bool cs = a.pos ? ok(span(1, a.max_pos, 1, {0, a.cs_ss, 0}, a.rotary_dim))
                          : ok(span(batch, a.seq, 1, {a.cs_bs, a.cs_ss, 0}, a.rotary_dim));
    if (!cs || !ok(span(batch, a.seq, a.hq, a.vq, a.head_dim)) || !ok(span(batch, a.seq, a.hq, a.vqo, a.head_dim)) ||
        (a.hk && (!ok(span(batch, a.seq, a.hk, a.vk, a.head_dim)) ||
                  !ok(span(batch, a.seq, a.hk, a.vko, a.head_dim)))) ||
        (a.pos && !ok(span(batch, a.seq, 1, {a.pos_bs, a.pos_ss, 0}, 1))))
        return false;
    auto view = [](const View<int64_t> &v) { return View<uint32_t>{(uint32_t)v.bs, (uint32_t)v.ss, (uint32_t)v.hs}; };
    r.q = a.q, r.k = a.k, r.qo = a.qo, r.ko = a.ko, r.cos = a.cos, r.sin = a.sin, r.pos = a.pos;
    r.vq = view(a.vq), r.vqo = view(a.vqo), r.vk = view(a.vk), r.vko = view(a.vko);
    r.cs_bs = (uint32_t)a.cs_bs, r.cs_ss = (uint32_t)a.cs_ss;
    r.hq = a.hq, r.hk = a.hk;
    r.rotary_dim = (uint32_t)a.rotary_dim, r.packs = (uint32_t)a.packs;
    r.pos_bs = (uint32_t)a.pos_bs, r.pos_ss = (uint32_t)a.pos_ss; /* read only with position_ids */
    r.max_pos = a.max_pos;
    r.cw = (uint32_t)a.cw;
    r.copy_q = a.copy_q, r.copy_k = a.copy_k;
    return true;
}

template <typename T, typename C, typename Acc, bool HALF, bool BWD>
void launch(Args a, bool vec, cudaStream_t stream) {
    constexpr int VV = (int)(16 / sizeof(T));
    const int64_t half = a.rotary_dim / 2;
    const int64_t heads = a.hq + a.hk;
    const int64_t v = vec ? VV : HALF ? 1 : 2; /* elements a rotation slot reads from each head */
    a.packs = HALF ? half / v : a.rotary_dim / v;
    const int64_t rest = a.head_dim - a.rotary_dim;
    a.cw = vec && rest % VV == 0 ? VV : 1;
    a.slots = a.packs + (rest > 0 && (a.copy_q || a.copy_k) ? rest / a.cw : 0);
    /* 8 heads a thread fill the GPU only past about one wave of such items
     * (132 SMs x 512 threads); below that (decode, short prefill) the
     * 16-byte kernel takes 2 heads a thread: 4x the threads, a quarter of
     * the serial per-thread work (with a few warps on the GPU, each one's
     * instruction chain is the time). */
    constexpr int HV = heads_a_thread<T, C, HALF, true>(), HS = heads_a_thread<T, C, HALF, false>();
    const bool small = vec && a.rows * ((heads + HV - 1) / HV) * a.slots < kSmallItems;
    /* the row plan (OPSMITH_ROTARY_ROW_BLOCKS=0 turns it off, to compare):
     * one head a thread where a row's items fit a block, else two */
    static const bool row_blocks = tuning_env("OPSMITH_ROTARY_ROW_BLOCKS", 1, 0, 1) != 0;
    const int64_t batch = a.rows / a.seq;
    RowArgs r;
    if (small && row_blocks && batch <= kMaxGridY && a.seq <= 2147483647 &&
        a.slots * ((heads + 1) / 2) <= kRowThreads && row_args(a, batch, r)) {
        static const int row_threads =
            (int)tuning_env("OPSMITH_ROTARY_ROW_THREADS", kRowBlockThreads, 32, kRowThreads);
        /* the whole row a block where the rows alone fill the SMs (64 tokens x 4
         * sequences: 0.06 us faster than split on the H100; 4 x 4 rows split: 0.15 faster) */
        const bool whole = row_threads >= kRowThreads || a.seq * batch >= sm_count();
        const int per = whole && a.slots * heads > kRowThreads ? 2 : 1;
        const int64_t groups = (heads + per - 1) / per;
        const int64_t in_block = whole ? groups : std::max<int64_t>(1, std::min<int64_t>(groups, row_threads / a.slots));
        const dim3 grid((unsigned)a.seq, (unsigned)batch, (unsigned)((groups + in_block - 1) / in_block)),
            block((unsigned)a.slots, (unsigned)in_block);
        if (per == 1)
            rotary_row_kernel<T, C, Acc, HALF, VV, BWD, 1><<<grid, block, 0, stream>>>(r);
        else
            rotary_row_kernel<T, C, Acc, HALF, VV, BWD, 2><<<grid, block, 0, stream>>>(r);
        return;
    }
    const int64_t per = !vec ? HS : small ? 2 : HV;
    a.groups = (a.hq + per - 1) / per + (a.hk + per - 1) / per; /* a group's heads: q's or k's */
    a.items = a.rows * a.groups * a.slots;
    a.narrow = a.items <= (int64_t)UINT32_MAX; /* t < items inside the loop */
    const int64_t blocks = (a.items + kThreads - 1) / kThreads;
    const unsigned grid = (unsigned)(blocks < 2147483647 ? blocks : 2147483647);
    if (small)
        rotary_kernel<T, C, Acc, HALF, VV, true, BWD, 2><<<grid, kThreads, 0, stream>>>(a);
    else if (vec)
        rotary_kernel<T, C, Acc, HALF, VV, true, BWD, HV><<<grid, kThreads, 0, stream>>>(a);
    else if (HALF)
        rotary_kernel<T, C, Acc, HALF, 1, false, BWD, HS><<<grid, kThreads, 0, stream>>>(a);
    else
        rotary_kernel<T, C, Acc, HALF, 2, false, BWD, HS><<<grid, kThreads, 0, stream>>>(a);
}

template <typename T, typename C>
opsmith_status run(int backward, const opsmith_rotary_params *p, const void *q, void *qo, const void *k, void *ko,
                   const void *cos, const void *sin, const int64_t *pos, cudaStream_t stream) {
    using Acc = typename AccOf<T>::type;
    Args a;
    a.q = q, a.k = k, a.qo = qo, a.ko = ko;
    a.vq = {p->q.batch_stride, p->q.seq_stride, p->q.head_stride};
    a.vqo = {p->q_out.batch_stride, p->q_out.seq_stride, p->q_out.head_stride};
    a.vk = {p->k.batch_stride, p->k.seq_stride, p->k.head_stride};
    a.vko = {p->k_out.batch_stride, p->k_out.seq_stride, p->k_out.head_stride};
    a.hq = (int)p->q.heads, a.hk = k ? (int)p->k.heads : 0;
    a.seq = p->seq, a.rows = p->batch * p->seq, a.head_dim = p->head_dim, a.rotary_dim = p->rotary_dim;
    a.cos = cos, a.sin = sin, a.cs_bs = p->cs_batch_stride, a.cs_ss = p->cs_seq_stride;
    a.pos = pos, a.pos_bs = p->pos_batch_stride, a.pos_ss = p->pos_seq_stride, a.max_pos = p->max_pos;
    auto same = [](const opsmith_rotary_view &x, const opsmith_rotary_view &y) {
        return x.batch_stride == y.batch_stride && x.seq_stride == y.seq_stride && x.head_stride == y.head_stride;
    };
    a.copy_q = !(q == qo && same(p->q, p->q_out));
    a.copy_k = k && !(k == ko && same(p->k, p->k_out));
    /* 16-byte steps: every pointer aligned, every stride whole packs */
    constexpr int64_t V = 16 / sizeof(T), VC = 16 / sizeof(C);
    const bool style_half = p->style == OPSMITH_ROTARY_STYLE_HALF;
    bool vec = (style_half ? fits(p->rotary_dim / 2, V) : fits(p->rotary_dim, V)) && aligned16(cos) &&
               aligned16(sin) && fits(p->cs_seq_stride, VC) && fits(p->cs_batch_stride, VC);
    const void *ptrs[4] = {q, qo, k, ko};
    const opsmith_rotary_view *views[4] = {&p->q, &p->q_out, &p->k, &p->k_out};
    for (int i = 0; i < (k ? 4 : 2); i++)
        vec = vec && aligned16(ptrs[i]) && fits(views[i]->batch_stride, V) && fits(views[i]->seq_stride, V) &&
              fits(views[i]->head_stride, V);
    if (style_half) {
        if (backward) launch<T, C, Acc, true, true>(a, vec, stream);
        else launch<T, C, Acc, true, false>(a, vec, stream);
    } else {
        if (backward) launch<T, C, Acc, false, true>(a, vec, stream);
        else launch<T, C, Acc, false, false>(a, vec, stream);
    }
    return launch_status();
}

opsmith_status rope_cuda(const char *op, int backward, const opsmith_rotary_params *p, const void *q, void *qo,
                         const void *k, void *ko, const void *cos, const void *sin, const int64_t *pos,
                         opsmith_cuda_stream stream) {
    opsmith_status st = opsmith_internal_rotary_check(op, backward, p, q, qo, k, ko, cos, sin, pos);
    if (st != OPSMITH_STATUS_SUCCESS || p->batch == 0 || p->seq == 0) return st;
    if (p->q.heads + (k ? p->k.heads : 0) > 65535 * 256)
        return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT, "%s: too many heads", op);
    const cudaStream_t s = (cudaStream_t)stream;
    const bool f32cs = p->cs_dtype == OPSMITH_DTYPE_F32 && p->dtype != OPSMITH_DTYPE_F32;
    switch (p->dtype) {
    case OPSMITH_DTYPE_F64: return run<double, double>(backward, p, q, qo, k, ko, cos, sin, pos, s);
    case OPSMITH_DTYPE_F32: return run<float, float>(backward, p, q, qo, k, ko, cos, sin, pos, s);
    case OPSMITH_DTYPE_F16:
        return f32cs ? run<__half, float>(backward, p, q, qo, k, ko, cos, sin, pos, s)
                     : run<__half, __half>(backward, p, q, qo, k, ko, cos, sin, pos, s);
    default:
        return f32cs ? run<__nv_bfloat16, float>(backward, p, q, qo, k, ko, cos, sin, pos, s)
                     : run<__nv_bfloat16, __nv_bfloat16>(backward, p, q, qo, k, ko, cos, sin, pos, s);
    }
}

} // namespace
} // namespace opsmith

extern "C" opsmith_status opsmith_rotary_fwd_cuda(const opsmith_rotary_params *p, const void *q, void *q_out,
                                                  const void *k, void *k_out, const void *cos, const void *sin,
                                                  const int64_t *position_ids, opsmith_cuda_stream stream) {
    return opsmith::rope_cuda("rotary_fwd_cuda", 0, p, q, q_out, k, k_out, cos, sin, position_ids, stream);
}

extern "C" opsmith_status opsmith_rotary_bwd_cuda(const opsmith_rotary_params *p, const void *dq_out, void *dq,
                                                  const void *dk_out, void *dk, const void *cos, const void *sin,
                                                  const int64_t *position_ids, opsmith_cuda_stream stream) {
    return opsmith::rope_cuda("rotary_bwd_cuda", 1, p, dq_out, dq, dk_out, dk, cos, sin, position_ids, stream);
}
