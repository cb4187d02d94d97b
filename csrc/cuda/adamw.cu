/* AdamW on CUDA: one multi-tensor step over a list and the global gradient
 * norm (see opsmith/adamw.h).
 *
 * The list is cut into chunks of OPSMITH_ADAMW_CHUNK elements, one CUDA
 * block each. A launch carries, as its kernel argument (up to ~30 KB, CUDA
 * 12.1+ on sm_70+), the pointers and sizes of up to MAX_TENSORS tensors and
 * the number of each one's first block; a block finds its tensor by binary
 * search over those. Any number of chunks fits in one launch, so a launch
 * ends only when the tensor table is full: one launch for a 300-tensor
 * model, 21 for 8000 tensors, with no device buffer to upload, no
 * allocation and no host synchronisation (a CUDA graph captures it).
 *
 * On sm_90 the launches of one call overlap (programmatic dependent
 * launch): each block lets the next launch start as soon as it begins, and
 * waits for the previous launch to finish only after its own work. A call's
 * launches touch disjoint tensors, so nothing is read early; each launch
 * still ends after the one before it, so the call's last launch ends after
 * all of them and work queued after the call sees every update. Without
 * the overlap every launch of the 8000-tensor set paid its fill and drain
 * (about a third of its time). The gradient norm's launches overlap the
 * same way.
 *
 * Inside a chunk every thread moves 4 elements at a time: 16-byte loads of
 * the float32 roles (8-byte for 16-bit params and grads) where every
 * pointer of the chunk is aligned to it, element by element otherwise and
 * for the chunk's tail. All arithmetic is float32 (bias corrections in
 * double, as torch computes them from Python floats). */
#include <utility>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"
#include "adamw_spans.cuh"
#include "internal/adamw.h"
#include "launch_plan.cuh"

namespace opsmith {
namespace {

constexpr int MAX_TENSORS = 384;
constexpr int THREADS = adamw_spans::THREADS;
constexpr int FINAL_THREADS = 1024;

/* One launch's table: per tensor slot its pointers, size and the number of
 * its first block (first[nt] = the launch's block count). */
struct StepTable {
    void *p[MAX_TENSORS];
    const void *g[MAX_TENSORS];
    float *m[MAX_TENSORS];
    float *v[MAX_TENSORS];
    float *vmax[MAX_TENSORS];
    float *master[MAX_TENSORS];
    const float *step[MAX_TENSORS];
    int64_t n[MAX_TENSORS];
    int32_t first[MAX_TENSORS + 1];
    int32_t nt;
};

struct StepScalars {
    float lr;
    const float *lr_ptr;
    double beta1, beta2, eps, weight_decay;
    const float *clip_ptr;
    int amsgrad, maximize;
    int reversed; /* the launch's tensors and each one's chunks last first */
};

static_assert(sizeof(StepTable) + sizeof(StepScalars) < 32000, "kernel arguments stay under CUDA's 32764 bytes");
static_assert(sizeof(adamw_spans::Table) + sizeof(void *) < 32000, "kernel arguments stay under CUDA's 32764 bytes");

/* The slot whose blocks include block b: the last with first[slot] <= b. */
__device__ __forceinline__ int slot_of(const int32_t *first, int nt, int b) {
    int lo = 0, hi = nt - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (first[mid] <= b) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

template <typename T> __device__ __forceinline__ float load1(const T *p) { return to_acc(p[0]); }

/* 4 consecutive elements as floats (p aligned to 4 elements). STREAM:
 * a streaming load (evict-first in L2), for roles the step reads once. */
template <typename T, bool STREAM = false> __device__ __forceinline__ void load4(const T *p, float *out) {
    if constexpr (sizeof(T) == 4) {
        const float4 q = STREAM ? __ldcs(reinterpret_cast<const float4 *>(p)) : *reinterpret_cast<const float4 *>(p);
        out[0] = q.x, out[1] = q.y, out[2] = q.z, out[3] = q.w;
    } else {
        const uint2 q = STREAM ? __ldcs(reinterpret_cast<const uint2 *>(p)) : *reinterpret_cast<const uint2 *>(p);
        const T *e = reinterpret_cast<const T *>(&q);
#pragma unroll
        for (int k = 0; k < 4; k++) out[k] = to_acc(e[k]);
    }
}

/* STREAM: a streaming store (evict-first). After the norm pass the step's
 * writes, left as ordinary lines, would push out of L2 the gradients the
 * norm pass read last, which the step then reads first. */
template <typename T, bool STREAM = false> __device__ __forceinline__ void store4(T *p, const float *in) {
    if constexpr (sizeof(T) == 4) {
        const float4 q = make_float4(in[0], in[1], in[2], in[3]);
        if (STREAM) __stcs(reinterpret_cast<float4 *>(p), q);
        else *reinterpret_cast<float4 *>(p) = q;
    } else {
        uint2 q;
        T *e = reinterpret_cast<T *>(&q);
#pragma unroll
        for (int k = 0; k < 4; k++) e[k] = from_acc<T>(in[k]);
        if (STREAM) __stcs(reinterpret_cast<uint2 *>(p), q);
        else *reinterpret_cast<uint2 *>(p) = q;
    }
}

struct Consts {
    float decay, w1, beta2, omb2, step_size, bc2_sqrt, eps, coef;
};

/* One element: p the weight, g the raw grad; m, v, vmax updated. */
__device__ __forceinline__ float update(const Consts &c, bool amsgrad, float p, float g, float &m, float &v,
                                        float &vmax) {
    g *= c.coef;
    m = c.w1 < 0.5f ? m + c.w1 * (g - m) : g - (g - m) * (1.0f - c.w1);
    v = v * c.beta2 + c.omb2 * g * g;
    float vv = v;
    if (amsgrad) {
        vv = vmax > v ? vmax : v;
        vmax = vv;
    }
    const float denom = __fdiv_rn(__fsqrt_rn(vv), c.bc2_sqrt) + c.eps;
    return __fmul_rn(p, c.decay) + -c.step_size * __fdiv_rn(m, denom);
}

template <typename P, typename G, bool STREAM>
__device__ __forceinline__ void step_chunk(const StepTable &tab, const StepScalars &s);

/* STREAM: the state's loads and stores evict-first (the step after a norm pass) */
template <typename P, typename G, bool STREAM>
__global__ void __launch_bounds__(THREADS) adamw_step_kernel(const StepTable tab, const StepScalars s) {
    let_next_launch_start();
    step_chunk<P, G, STREAM>(tab, s);
    wait_for_previous_launch();
}

template <typename P, typename G, bool STREAM>
__device__ __forceinline__ void step_chunk(const StepTable &tab, const StepScalars &s) {
    const int t = slot_of(tab.first, tab.nt, (int)blockIdx.x);
    /* reversed (s.reversed): a tensor's last chunk first, as the host lists the tensors last first */
    const int chunk = s.reversed ? tab.first[t + 1] - 1 - (int)blockIdx.x : (int)blockIdx.x - tab.first[t];
    const int64_t off = (int64_t)chunk * OPSMITH_ADAMW_CHUNK;
    const int64_t rest = tab.n[t] - off;
    const int len = (int)(rest < OPSMITH_ADAMW_CHUNK ? rest : OPSMITH_ADAMW_CHUNK);
    P *__restrict__ p = static_cast<P *>(tab.p[t]) + off;
    const G *__restrict__ g = static_cast<const G *>(tab.g[t]) + off;
    float *__restrict__ m = tab.m[t] + off;
    float *__restrict__ v = tab.v[t] + off;
    float *__restrict__ vmax = s.amsgrad ? tab.vmax[t] + off : nullptr;
    float *__restrict__ master = tab.master[t] ? tab.master[t] + off : nullptr;

    const double step = (double)*tab.step[t];
    const double lr = s.lr_ptr ? (double)*s.lr_ptr : (double)s.lr;
    const double bc1 = 1.0 - pow(s.beta1, step), bc2 = 1.0 - pow(s.beta2, step);
    Consts c;
    c.decay = (float)(1.0 - lr * s.weight_decay);
    c.w1 = (float)(1.0 - s.beta1);
    c.beta2 = (float)s.beta2;
    c.omb2 = (float)(1.0 - s.beta2);
    c.step_size = (float)(lr / bc1);
    c.bc2_sqrt = (float)sqrt(bc2);
    c.eps = (float)s.eps;
    const float clip = s.clip_ptr ? *s.clip_ptr : 1.0f;
    c.coef = s.maximize ? -clip : clip;
    const bool ams = s.amsgrad != 0;

    /* 16 bytes for the float roles, 4 elements for p and g */
    const bool vec = aligned16(m) && aligned16(v) && (!vmax || aligned16(vmax)) && (!master || aligned16(master)) &&
                     (reinterpret_cast<uintptr_t>(p) % (4 * sizeof(P))) == 0 &&
                     (reinterpret_cast<uintptr_t>(g) % (4 * sizeof(G))) == 0;
    int start = 0;
    if (vec) {
        const int nvec = len / 4;
        for (int i = threadIdx.x; i < nvec; i += THREADS) {
            const int e = 4 * i;
            float pw[4], gw[4], mw[4], vw[4], xw[4] = {0.f, 0.f, 0.f, 0.f};
            load4(g + e, gw);
            if (master) load4<float, STREAM>(master + e, pw);
            else load4<P, STREAM>(p + e, pw);
            load4<float, STREAM>(m + e, mw);
            load4<float, STREAM>(v + e, vw);
            if (ams) load4<float, STREAM>(vmax + e, xw);
#pragma unroll
            for (int k = 0; k < 4; k++) pw[k] = update(c, ams, pw[k], gw[k], mw[k], vw[k], xw[k]);
            if (master) store4<float, STREAM>(master + e, pw);
            store4<P, STREAM>(p + e, pw);
            store4<float, STREAM>(m + e, mw);
            store4<float, STREAM>(v + e, vw);
            if (ams) store4<float, STREAM>(vmax + e, xw);
        }
        start = 4 * nvec;
    }
    for (int i = start + threadIdx.x; i < len; i += THREADS) {
        float mi = m[i], vi = v[i], xi = ams ? vmax[i] : 0.f;
        const float pi = update(c, ams, master ? master[i] : load1(p + i), load1(g + i), mi, vi, xi);
        if (master) master[i] = pi;
        p[i] = from_acc<P>(pi);
        m[i] = mi, v[i] = vi;
        if (ams) vmax[i] = xi;
    }
}

/* One launch of a call (THREADS a block); `overlap`: it may start while the
 * previous one drains (the kernel lets the next start and waits for the
 * previous at its end). */
template <typename... Params, typename... Args>
void launch_in_call(void (*kernel)(Params...), int32_t blocks, cudaStream_t stream, bool overlap, Args &&...args) {
    launch_after(kernel, dim3((unsigned)blocks), dim3(THREADS), 0, stream, overlap, std::forward<Args>(args)...);
}

/* The step counters a launch increments: as many as the kernel argument holds. */
constexpr int INC_COUNTERS = 3840;
struct IncTable {
    float *step[INC_COUNTERS];
    int n;
};

__global__ void __launch_bounds__(256) increment_steps_kernel(const IncTable tab) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < tab.n) *tab.step[i] += 1.0f;
}

/* A read-only pass over spans of equal length (adamw_spans.cuh): with ~8000
 * tensors of a few thousand elements, a block a tensor chunk did little
 * work for its fixed costs (0.63 of copy on the H200). A thread's groups are
 * found first and their loads all issued before the first multiply; summed
 * in a fixed order, so the bits do not depend on timing. */
template <typename G>
__global__ void __launch_bounds__(THREADS) adamw_norm_kernel(const adamw_spans::Table tab,
                                                             float *__restrict__ partial) {
    using namespace adamw_spans;
    __shared__ float scratch[32];
    let_next_launch_start();
    const BlockSlots b = block_slots(tab, (int)blockIdx.x);
    float w[GROUPS][4];
#pragma unroll
    for (int k = 0; k < GROUPS; k++) {
        w[k][0] = w[k][1] = w[k][2] = w[k][3] = 0.f;
        Group grp;
        if (!group_at(tab, b, (int)threadIdx.x, k, &grp)) continue;
        const int64_t n = tab.n[grp.slot];
        const G *g = static_cast<const G *>(tab.g[grp.slot]) + grp.i;
        if (grp.i + 4 <= n && reinterpret_cast<uintptr_t>(g) % (4 * sizeof(G)) == 0) {
            load4(g, w[k]);
        } else {
            for (int e = 0; e < 4; e++)
                if (grp.i + e < n) w[k][e] = load1(g + e);
        }
    }
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < GROUPS; k++)
        acc += (w[k][0] * w[k][0] + w[k][1] * w[k][1]) + (w[k][2] * w[k][2] + w[k][3] * w[k][3]);
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
    wait_for_previous_launch();
}

/* The partials summed in a fixed order (double), the norm and the clip
 * coefficient torch.nn.utils.clip_grad_norm_ uses. */
__global__ void __launch_bounds__(FINAL_THREADS) adamw_norm_final_kernel(const float *__restrict__ partial,
                                                                          int64_t count, float max_norm,
                                                                          float *norm, float *clip_coef) {
    __shared__ double scratch[32];
    double acc = 0.0;
    for (int64_t i = threadIdx.x; i < count; i += FINAL_THREADS) acc += (double)partial[i];
    acc = block_sum(acc, scratch);
    if (threadIdx.x == 0) {
        const float n = (float)sqrt(acc);
        *norm = n;
        if (clip_coef) {
            const float coef = max_norm / (n + 1e-6f);
            *clip_coef = coef > 1.0f ? 1.0f : coef; /* NaN stays NaN, as torch.clamp */
        }
    }
}

/* Calls f(T{}) for the storage type of dtype (f32, bf16, f16). */
template <typename F> opsmith_status dispatch_storage(opsmith_dtype dt, F f) {
    switch (dt) {
    case OPSMITH_DTYPE_F32: return f(float{});
    case OPSMITH_DTYPE_BF16: return f(__nv_bfloat16{});
    case OPSMITH_DTYPE_F16: return f(__half{});
    default: return OPSMITH_STATUS_UNSUPPORTED_DTYPE;
    }
}

} // namespace
} // namespace opsmith

using namespace opsmith;

extern "C" opsmith_status opsmith_adamw_step_cuda(
    int64_t count, const int64_t *numels, opsmith_dtype param_dtype, opsmith_dtype grad_dtype, void *const *params,
    const void *const *grads, float *const *exp_avgs, float *const *exp_avg_sqs, float *const *max_exp_avg_sqs,
    float *const *master_params, const float *const *steps, double lr, const float *lr_tensor, double beta1,
    double beta2, double eps, double weight_decay, int amsgrad, int maximize, const float *clip_coef,
    opsmith_cuda_stream stream) {
    opsmith_status st = opsmith_internal_adamw_step_check("adamw_step_cuda", count, numels, param_dtype, grad_dtype,
                                                          params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                                                          master_params, steps, lr, lr_tensor, beta1, beta2, eps,
                                                          weight_decay, amsgrad);
    if (st != OPSMITH_STATUS_SUCCESS || count == 0) return st;
    /* After the gradient-norm pass (clip_coef), the gradients it read last are
     * still in L2: the step walks the list backwards to read them first.
     * OPSMITH_ADAMW_CLIP_ORDER=0 turns that off; OPSMITH_ADAMW_CLIP_STREAM=1
     * makes the state's loads and stores evict-first (on the H200 the 8000
     * small tensors' clip 1.145x -> 1.124x the step, the Llama-like set's
     * 1.132x -> 1.178x: off unless asked). */
    static const bool clip_reversed = tuning_env("OPSMITH_ADAMW_CLIP_ORDER", 1, 0, 1) != 0;
    static const bool clip_stream = tuning_env("OPSMITH_ADAMW_CLIP_STREAM", 0, 0, 1) != 0;
    const bool reversed = clip_coef != nullptr && clip_reversed;
    const bool streaming = clip_coef != nullptr && clip_stream;
    const StepScalars s{(float)lr, lr_tensor, beta1,   beta2,   eps,
                        weight_decay, clip_coef, amsgrad, maximize, reversed ? 1 : 0};
    cudaStream_t cs = reinterpret_cast<cudaStream_t>(stream);
    DeviceInfo dev;
    int device;
    const bool overlap = device_info(&dev, &device) && dev.major >= 9;
    return dispatch_storage(param_dtype, [&](auto ptag) {
        return dispatch_storage(grad_dtype, [&](auto gtag) {
            using P = decltype(ptag);
            using G = decltype(gtag);
            static StepTable empty_table; /* zero: unused slots stay NULL */
            StepTable tab = empty_table;
            int nt = 0, launches = 0;
            int32_t nb = 0;
            auto flush = [&]() -> opsmith_status {
                if (nt == 0) return OPSMITH_STATUS_SUCCESS;
                tab.first[nt] = nb;
                tab.nt = nt;
                /* the first launch of the call waits for whatever came before it as usual */
                if (streaming)
                    launch_in_call(adamw_step_kernel<P, G, true>, nb, cs, overlap && launches > 0, tab, s);
                else
                    launch_in_call(adamw_step_kernel<P, G, false>, nb, cs, overlap && launches > 0, tab, s);
                launches++;
                nt = 0, nb = 0;
                return launch_status();
            };
            for (int64_t i = 0; i < count; i++) {
                const int64_t t = reversed ? count - 1 - i : i;
                const int64_t n = numels[t];
                if (n == 0) continue;
                if (nt == MAX_TENSORS) {
                    opsmith_status e = flush();
                    if (e != OPSMITH_STATUS_SUCCESS) return e;
                }
                tab.p[nt] = params[t];
                tab.g[nt] = grads[t];
                tab.m[nt] = exp_avgs[t];
                tab.v[nt] = exp_avg_sqs[t];
                tab.vmax[nt] = amsgrad ? max_exp_avg_sqs[t] : nullptr;
                tab.master[nt] = master_params ? master_params[t] : nullptr;
                tab.step[nt] = steps[t];
                tab.n[nt] = n;
                tab.first[nt] = nb;
                nb += (int32_t)opsmith_internal_adamw_chunks(n);
                nt++;
            }
            return flush();
        });
    });
}

extern "C" opsmith_status opsmith_adamw_increment_steps_cuda(int64_t count, float *const *steps,
                                                              opsmith_cuda_stream stream) {
    opsmith_status st = opsmith_internal_adamw_increment_check("adamw_increment_steps_cuda", count, steps);
    if (st != OPSMITH_STATUS_SUCCESS || count == 0) return st;
    cudaStream_t cs = reinterpret_cast<cudaStream_t>(stream);
    IncTable tab;
    for (int64_t t0 = 0; t0 < count; t0 += INC_COUNTERS) {
        tab.n = (int)(count - t0 < INC_COUNTERS ? count - t0 : INC_COUNTERS);
        for (int i = 0; i < tab.n; i++) tab.step[i] = steps[t0 + i];
        increment_steps_kernel<<<(tab.n + 255) / 256, 256, 0, cs>>>(tab);
        st = launch_status();
        if (st != OPSMITH_STATUS_SUCCESS) return st;
    }
    return OPSMITH_STATUS_SUCCESS;
}

extern "C" size_t opsmith_adamw_grad_norm_cuda_workspace_size(int64_t count, const int64_t *numels) {
    return (size_t)opsmith_internal_adamw_total_chunks(count, numels) * sizeof(float);
}

extern "C" opsmith_status opsmith_adamw_grad_norm_cuda(int64_t count, const int64_t *numels,
                                                       opsmith_dtype grad_dtype, const void *const *grads,
                                                       double max_norm, float *norm, float *clip_coef,
                                                       void *workspace, size_t workspace_bytes,
                                                       opsmith_cuda_stream stream) {
    int64_t chunks = 0;
    opsmith_status st = opsmith_internal_adamw_norm_check("adamw_grad_norm_cuda", count, numels, grad_dtype, grads,
                                                          max_norm, norm, clip_coef, workspace, workspace_bytes,
                                                          sizeof(float), &chunks);
    if (st != OPSMITH_STATUS_SUCCESS) return st;
    cudaStream_t cs = reinterpret_cast<cudaStream_t>(stream);
    float *partial = static_cast<float *>(workspace);
    DeviceInfo dev;
    int device;
    const bool overlap = device_info(&dev, &device) && dev.major >= 9;
    int64_t partials = 0;
    st = dispatch_storage(grad_dtype, [&](auto gtag) {
        using G = decltype(gtag);
        adamw_spans::Table tab = {};
        int64_t done = 0; /* partials written by earlier launches */
        const opsmith_status e = adamw_spans::tables(
            count, numels, grads, sizeof(G), &tab, [&](const adamw_spans::Table &t, int32_t blocks) {
                /* overlapped as the step's launches are; the final sum, an ordinary
                 * launch, waits for the last of them, which ends after all the others */
                launch_in_call(adamw_norm_kernel<G>, blocks, cs, overlap && done > 0, t, partial + done);
                done += blocks;
                return launch_status();
            });
        partials = done;
        return e;
    });
    if (st != OPSMITH_STATUS_SUCCESS) return st;
    /* at most one span a chunk (adamw_spans::SPAN >= OPSMITH_ADAMW_CHUNK): the workspace holds them */
    adamw_norm_final_kernel<<<1, FINAL_THREADS, 0, cs>>>(partial, partials, (float)max_norm, norm, clip_coef);
    return launch_status();
}
