/* Rotary position embedding on CUDA: q and k in one launch, bandwidth
 * bound (q, k, cos, sin read once; q, k written once).
 *
 * Grid: one block per (b, s) row (looping past the grid), threads (x, y):
 * x over the packs of one head vector's pairs, y over the heads of q then
 * k. A thread loads the cos/sin of its pack once (from the (b, s) row, or
 * the cache row position_ids names) and applies them to every head it
 * visits, so cos/sin cross DRAM once per (b, s) whatever the head counts.
 * 16-byte loads and stores when every pointer, stride and size allows them;
 * a scalar kernel otherwise. Each element is read before the same element
 * is written by the same thread, so in place (an output that is exactly its
 * input) is safe. Dims [rotary_dim, head_dim) are copied by the same block
 * (skipped in place). */
#include "common.cuh"
#include "internal/rotary.h"

namespace opsmith {
namespace {

constexpr int kThreads = 256;

/* N elements of U, moved as 16-byte packs when VEC, else one by one. */
template <typename U, int N, bool VEC> struct Vals {
    U v[N];
};

template <typename U, int N, bool VEC> __device__ __forceinline__ Vals<U, N, VEC> load_vals(const U *p) {
    Vals<U, N, VEC> out;
    if constexpr (VEC) {
        static_assert(N * sizeof(U) % 16 == 0, "whole packs");
#pragma unroll
        for (int k = 0; k < (int)(N * sizeof(U) / 16); k++)
            reinterpret_cast<uint4 *>(out.v)[k] = *(reinterpret_cast<const uint4 *>(p) + k);
    } else {
#pragma unroll
        for (int k = 0; k < N; k++) out.v[k] = p[k];
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

struct View {
    int64_t bs, ss, hs;
};

struct Args {
    const void *q, *k;
    void *qo, *ko;
    View vq, vqo, vk, vko;
    int hq, hk;
    int64_t seq, rows, head_dim, rotary_dim;
    const void *cos, *sin;
    int64_t cs_bs, cs_ss;
    const int64_t *pos;
    int64_t pos_bs, pos_ss, max_pos;
    bool copy_q, copy_k; /* pass-through part to copy (not in place) */
};

/* V elements a thread step: for rotate-half, V consecutive elements of the
 * first half and the V matching ones of the second; for interleaved, V/2
 * whole pairs. */
template <typename T, typename C, typename Acc, bool HALF, int V, bool VEC, bool BWD>
__global__ void __launch_bounds__(kThreads) rotary_kernel(Args a) {
    const int64_t half = a.rotary_dim / 2;
    const int64_t packs = HALF ? half / V : a.rotary_dim / V;
    const int heads = a.hq + a.hk;
    for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x) {
        const int64_t b = r / a.seq, s = r % a.seq;
        int64_t cs_off;
        bool bad = false;
        if (a.pos) {
            const int64_t p = a.pos[b * a.pos_bs + s * a.pos_ss];
            bad = p < 0 || p >= a.max_pos;
            cs_off = bad ? 0 : p * a.cs_ss;
        } else {
            cs_off = b * a.cs_bs + s * a.cs_ss;
        }
        const C *cosr = static_cast<const C *>(a.cos) + cs_off, *sinr = static_cast<const C *>(a.sin) + cs_off;
        for (int64_t pk = threadIdx.x; pk < packs; pk += blockDim.x) {
            /* this pack's pairs: element offsets of the first and second members */
            const int64_t ea = pk * V, eb = HALF ? half + pk * V : pk * V;
            Acc ca[V], cb[V], sa[V], sb[V];
            {
                const Vals<C, V, VEC> c1 = load_vals<C, V, VEC>(cosr + ea), s1 = load_vals<C, V, VEC>(sinr + ea);
                if constexpr (HALF) {
                    const Vals<C, V, VEC> c2 = load_vals<C, V, VEC>(cosr + eb), s2 = load_vals<C, V, VEC>(sinr + eb);
#pragma unroll
                    for (int k = 0; k < V; k++)
                        ca[k] = to_acc(c1.v[k]), cb[k] = to_acc(c2.v[k]), sa[k] = to_acc(s1.v[k]),
                        sb[k] = to_acc(s2.v[k]);
                } else {
#pragma unroll
                    for (int k = 0; k < V; k += 2)
                        ca[k] = to_acc(c1.v[k]), cb[k] = to_acc(c1.v[k + 1]), sa[k] = to_acc(s1.v[k]),
                        sb[k] = to_acc(s1.v[k + 1]);
                }
            }
            if (bad) {
#pragma unroll
                for (int k = 0; k < V; k++) ca[k] = cb[k] = sa[k] = sb[k] = Acc(NAN);
            }
            if constexpr (BWD) { /* the transpose: sines swapped between the pair and negated */
#pragma unroll
                for (int k = 0; k < V; k++) {
                    const Acc t = sa[k];
                    sa[k] = -sb[k], sb[k] = -t;
                }
            }
            for (int h = threadIdx.y; h < heads; h += blockDim.y) {
                const bool isq = h < a.hq;
                const int hh = isq ? h : h - a.hq;
                const View vi = isq ? a.vq : a.vk, vo = isq ? a.vqo : a.vko;
                const T *x = static_cast<const T *>(isq ? a.q : a.k) + b * vi.bs + s * vi.ss + hh * vi.hs;
                T *o = static_cast<T *>(isq ? a.qo : a.ko) + b * vo.bs + s * vo.ss + hh * vo.hs;
                if constexpr (HALF) {
                    const Vals<T, V, VEC> xa = load_vals<T, V, VEC>(x + ea), xb = load_vals<T, V, VEC>(x + eb);
                    Vals<T, V, VEC> oa, ob;
#pragma unroll
                    for (int k = 0; k < V; k++) {
                        const Acc u = to_acc(xa.v[k]), w = to_acc(xb.v[k]);
                        oa.v[k] = from_acc<T>(u * ca[k] - w * sa[k]);
                        ob.v[k] = from_acc<T>(w * cb[k] + u * sb[k]);
                    }
                    store_vals<T, V, VEC>(o + ea, oa);
                    store_vals<T, V, VEC>(o + eb, ob);
                } else {
                    const Vals<T, V, VEC> xv = load_vals<T, V, VEC>(x + ea);
                    Vals<T, V, VEC> ov;
#pragma unroll
                    for (int k = 0; k < V; k += 2) {
                        const Acc u = to_acc(xv.v[k]), w = to_acc(xv.v[k + 1]);
                        ov.v[k] = from_acc<T>(u * ca[k] - w * sa[k]);
                        ov.v[k + 1] = from_acc<T>(w * cb[k] + u * sb[k]);
                    }
                    store_vals<T, V, VEC>(o + ea, ov);
                }
            }
        }
        /* the pass-through dims, one element a thread (packs when VEC) */
        const int64_t rest = a.head_dim - a.rotary_dim;
        if (rest > 0 && (a.copy_q || a.copy_k)) {
            constexpr int W = VEC ? (int)(16 / sizeof(T)) : 1;
            const bool packed = VEC && rest % W == 0;
            const int64_t per = packed ? rest / W : rest;
            const int64_t tid = threadIdx.y * blockDim.x + threadIdx.x, nthreads = blockDim.x * blockDim.y;
            for (int64_t i = tid; i < heads * per; i += nthreads) {
                const int h = (int)(i / per);
                const int64_t j = i % per;
                const bool isq = h < a.hq;
                if (!(isq ? a.copy_q : a.copy_k)) continue;
                const int hh = isq ? h : h - a.hq;
                const View vi = isq ? a.vq : a.vk, vo = isq ? a.vqo : a.vko;
                const T *x = static_cast<const T *>(isq ? a.q : a.k) + b * vi.bs + s * vi.ss + hh * vi.hs + a.rotary_dim;
                T *o = static_cast<T *>(isq ? a.qo : a.ko) + b * vo.bs + s * vo.ss + hh * vo.hs + a.rotary_dim;
                if (packed)
                    *reinterpret_cast<uint4 *>(o + j * W) = *reinterpret_cast<const uint4 *>(x + j * W);
                else
                    o[j] = x[j];
            }
        }
    }
}

bool fits(int64_t v, int64_t w) { return v % w == 0; }

template <typename T, typename C, typename Acc, bool HALF, bool BWD>
void launch(const Args &a, bool vec, cudaStream_t stream) {
    constexpr int VV = (int)(16 / sizeof(T));
    const int64_t half = a.rotary_dim / 2;
    const int heads = a.hq + a.hk;
    auto go = [&](auto kernel, int64_t packs) {
        const int bx = (int)(packs < kThreads ? packs : kThreads);
        const int max_by = kThreads / bx;
        const int rounds = (heads + max_by - 1) / max_by;
        const int by = (heads + rounds - 1) / rounds;
        const int64_t max_grid = 2147483647;
        const unsigned grid = (unsigned)(a.rows < max_grid ? a.rows : max_grid);
        kernel<<<grid, dim3(bx, by), 0, stream>>>(a);
    };
    if (vec)
        go(rotary_kernel<T, C, Acc, HALF, VV, true, BWD>, HALF ? half / VV : a.rotary_dim / VV);
    else if (HALF)
        go(rotary_kernel<T, C, Acc, HALF, 1, false, BWD>, half);
    else
        go(rotary_kernel<T, C, Acc, HALF, 2, false, BWD>, a.rotary_dim / 2);
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
