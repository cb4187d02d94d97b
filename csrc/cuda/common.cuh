/* Helpers shared by every CUDA kernel file: storage <-> accumulate
 * conversions, 16-byte packed loads, warp and block sums, launch checks.
 * Everything here is static or inline, so any number of .cu files can
 * include it. */
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <utility>

#include "internal.h"

/* An sm_90 instruction without operands (PTX text, a memory clobber);
 * nothing when compiled for an older target. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define OPSMITH_SM90_ASM(text) asm volatile(text ::: "memory")
#else
#define OPSMITH_SM90_ASM(text) ((void)0)
#endif

/* #pragma unroll where nvcc compiles device code; the host compiler, which
 * also sees __host__ __device__ bodies, does not know the pragma. */
#if defined(__CUDA_ARCH__)
#define OPSMITH_HD_UNROLL _Pragma("unroll")
#else
#define OPSMITH_HD_UNROLL
#endif

namespace opsmith {

/* the largest grid y (and z) dimension a launch may have */
constexpr int64_t kMaxGridY = 65535;

/* Programmatic dependent launch (sm_90). A kernel that calls
 * let_next_launch_start lets the next launch of the stream, when that one
 * was launched with launch_after (below), start its blocks now;
 * wait_for_previous_launch returns once the previous launch has completed
 * and its writes are visible. Both are no-ops without the overlap (and
 * before sm_90), so a kernel may call them whatever launched it. */
__device__ __forceinline__ void let_next_launch_start() { OPSMITH_SM90_ASM("griddepcontrol.launch_dependents;"); }
__device__ __forceinline__ void wait_for_previous_launch() { OPSMITH_SM90_ASM("griddepcontrol.wait;"); }

/* kernel<<<grid, block, smem, stream>>>(args...), allowed to start while the
 * previous launch of the stream drains (`overlap`): the kernel must call
 * wait_for_previous_launch before it reads what that launch wrote. */
template <typename... Params, typename... Args>
void launch_after(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool overlap,
                  Args &&...args) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = &attr;
    cfg.numAttrs = overlap ? 1 : 0;
    cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

/* Storage type for each dtype, and the type sums are kept in. */
template <opsmith_dtype D> struct Storage;
template <> struct Storage<OPSMITH_DTYPE_F64> { using T = double; using Acc = double; };
template <> struct Storage<OPSMITH_DTYPE_F32> { using T = float; using Acc = float; };
template <> struct Storage<OPSMITH_DTYPE_F16> { using T = __half; using Acc = float; };
template <> struct Storage<OPSMITH_DTYPE_BF16> { using T = __nv_bfloat16; using Acc = float; };

__host__ __device__ __forceinline__ double to_acc(double v) { return v; }
__host__ __device__ __forceinline__ float to_acc(float v) { return v; }
__host__ __device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__host__ __device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __host__ __device__ __forceinline__ T from_acc(double v);
template <> __host__ __device__ __forceinline__ double from_acc<double>(double v) { return v; }
/* a float tensor beside float64 sums (layer_norm's float32 weight with float64 x) */
template <> __host__ __device__ __forceinline__ float from_acc<float>(double v) { return (float)v; }
template <typename T> __host__ __device__ __forceinline__ T from_acc(float v);
template <> __host__ __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <> __host__ __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <> __host__ __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

constexpr float kLog2e = 1.4426950408889634f;

/* 2^v on the hardware unit (one MUFU.EX2), denormal inputs and results
 * flushed to zero: without .ftz (exp2f's approximate form, __expf) each
 * call also takes a compare and two predicated multiplies that scale
 * around denormals. */
__device__ __forceinline__ float ex2_ftz(float v) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
    return r;
}

__device__ __forceinline__ double rsqrt_acc(double v) { return rsqrt(v); }
__device__ __forceinline__ float rsqrt_acc(float v) { return rsqrtf(v); }

/* The one packed-load type: 16 bytes, VEC elements of T. */
template <typename T> struct alignas(16) Pack {
    static constexpr int VEC = 16 / sizeof(T);
    T v[VEC];
};

template <typename T> __device__ __forceinline__ Pack<T> load_pack(const T *p) {
    Pack<T> out;
    *reinterpret_cast<uint4 *>(&out) = __ldg(reinterpret_cast<const uint4 *>(p));
    return out;
}

/* A float from its bits, in device and host code (the pack conversions
 * below are host-callable so a host test checks them bit for bit). */
__host__ __device__ __forceinline__ float float_of_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* A pack's elements in the accumulate type, exactly as to_acc gives them.
 * bfloat16 by bit moves on each 32-bit pair: the low element shifted up,
 * the high one masked (one instruction an element; element by element the
 * high one takes a byte permute and a multiply). */
template <typename T, typename A>
__host__ __device__ __forceinline__ void unpack(const Pack<T> p, A (&v)[Pack<T>::VEC]) {
    /* p by value: the caller's one 16-byte load, then register moves (a
     * memcpy from a reference into global memory became byte loads) */
    if constexpr (std::is_same<T, __nv_bfloat16>::value) {
        uint32_t w[4];
        memcpy(w, &p, sizeof w);
OPSMITH_HD_UNROLL
        for (int k = 0; k < 4; k++) {
            v[2 * k] = (A)float_of_bits(w[k] << 16);
            v[2 * k + 1] = (A)float_of_bits(w[k] & 0xffff0000u);
        }
    } else {
OPSMITH_HD_UNROLL
        for (int k = 0; k < Pack<T>::VEC; k++) v[k] = (A)to_acc(p.v[k]);
    }
}

/* N values of T already in registers, in the accumulate type, exactly as
 * to_acc gives them: by unpack a 16-byte pack at a time where N fills
 * whole packs (bfloat16's bit moves), else element by element. */
template <typename T, typename A, int N>
__host__ __device__ __forceinline__ void unpack_n(const T (&x)[N], A (&v)[N]) {
    constexpr int per = Pack<T>::VEC;
    if constexpr (N % per == 0) {
OPSMITH_HD_UNROLL
        for (int p = 0; p < N / per; p++) {
            Pack<T> pk;
            memcpy(&pk, x + p * per, sizeof pk);
            unpack(pk, *reinterpret_cast<A(*)[per]>(v + p * per));
        }
    } else {
OPSMITH_HD_UNROLL
        for (int k = 0; k < N; k++) v[k] = (A)to_acc(x[k]);
    }
}

/* The pack of VEC values rounded to T, exactly as from_acc<T> rounds each:
 * 16-bit types a pair per conversion (one F2FP a pair; element by element
 * the compiler converts each alone, then moves bytes to pair them again). */
template <typename T, typename A> __host__ __device__ __forceinline__ Pack<T> pack_of(const A (&v)[Pack<T>::VEC]) {
    Pack<T> p;
    if constexpr (std::is_same<A, float>::value && std::is_same<T, __nv_bfloat16>::value) {
OPSMITH_HD_UNROLL
        for (int k = 0; k < 4; k++) {
            const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
            memcpy(reinterpret_cast<char *>(&p) + 4 * k, &h, 4);
        }
    } else if constexpr (std::is_same<A, float>::value && std::is_same<T, __half>::value) {
OPSMITH_HD_UNROLL
        for (int k = 0; k < 4; k++) {
            const __half2 h = __floats2half2_rn(v[2 * k], v[2 * k + 1]);
            memcpy(reinterpret_cast<char *>(&p) + 4 * k, &h, 4);
        }
    } else {
OPSMITH_HD_UNROLL
        for (int k = 0; k < Pack<T>::VEC; k++) p.v[k] = from_acc<T>(v[k]);
    }
    return p;
}

__device__ __forceinline__ uint32_t bits16(__half v) { return __half_as_ushort(v); }
__device__ __forceinline__ uint32_t bits16(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }

/* 16 bytes of elements e to p (16-byte aligned) as one vector store, in
 * PTX: written as a uint4 store, a pack whose elements were computed one by
 * one (a row's outputs) reached the PTX as four 4-byte stores (st.global
 * .v2.u16 or .u32) in place of one st.global.v4: half the forward's y
 * stores at 4 packs a thread, every dx store of the staged backward. The
 * "memory" clobber keeps the compiler from moving other accesses across it
 * (a kernel may read back what it stored). */
template <typename U> __device__ __forceinline__ void store16(U *p, const U *e) {
    uint32_t w[4];
    if constexpr (sizeof(U) == 2) {
#pragma unroll
        for (int k = 0; k < 4; k++) w[k] = bits16(e[2 * k]) | bits16(e[2 * k + 1]) << 16;
    } else {
#pragma unroll
        for (int k = 0; k < 4; k++) w[k] = reinterpret_cast<const uint32_t *>(e)[k];
    }
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
                 : "memory");
}

template <typename T> __device__ __forceinline__ void store_pack(T *p, const Pack<T> &v) { store16(p, v.v); }

/* N consecutive elements of U moved as 16-byte packs (N * sizeof(U) a
 * multiple of 16): a weight or output whose dtype is wider than x's, read or
 * written in step with x's packs. Elems<T, Pack<T>::VEC> is one Pack<T>. */
template <typename U, int N> struct alignas(16) Elems {
    static_assert(N * sizeof(U) % 16 == 0, "whole 16-byte packs");
    U v[N];
};


/* Read-only loads the compiler keeps where they are written (asm
 * volatile), for the loads-only loops of the row kernels (load_my_packs):
 * as plain loads, each was sunk into the branch that first used it, after
 * the previous pack's math, so a thread waited a memory round trip a pack. */
__device__ __forceinline__ uint4 ldg16_here(const void *p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ uint2 ldg8_here(const void *p) {
    uint2 v;
    asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

template <typename T> __device__ __forceinline__ Pack<T> load_pack_here(const T *p) {
    Pack<T> out;
    *reinterpret_cast<uint4 *>(&out) = ldg16_here(p);
    return out;
}

/* HERE: with ldg16_here's loads, for the loads-only loops */
template <typename U, int N, bool HERE = false> __device__ __forceinline__ Elems<U, N> load_elems(const U *p) {
    Elems<U, N> out;
#pragma unroll
    for (int k = 0; k < (int)(N * sizeof(U) / 16); k++) {
        const uint4 *q = reinterpret_cast<const uint4 *>(p) + k;
        if constexpr (HERE) reinterpret_cast<uint4 *>(&out)[k] = ldg16_here(q);
        else reinterpret_cast<uint4 *>(&out)[k] = __ldg(q);
    }
    return out;
}

template <typename U, int N> __device__ __forceinline__ void store_elems(U *p, const Elems<U, N> &v) {
    constexpr int per = (int)(16 / sizeof(U));
#pragma unroll
    for (int k = 0; k < N / per; k++) store16(p + k * per, v.v + k * per);
}

/* The type sums are kept in for storage type T. */
template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };

/* Hides a pack's value from the optimiser. A kernel that reads a row into
 * registers, reduces it, then uses it again calls this between the two uses:
 * the compiler then converts the packed values again instead of keeping a
 * float copy of every element live across the reduction, which would double
 * the registers a row takes and halve the bytes an SM keeps in flight. */
template <typename P> __device__ __forceinline__ void opaque(P &p) {
    static_assert(sizeof(P) % 16 == 0, "a pack, or whole packs");
    uint32_t *u = reinterpret_cast<uint32_t *>(&p);
#pragma unroll
    for (int k = 0; k < (int)(sizeof(P) / 4); k += 4)
        asm volatile("" : "+r"(u[k]), "+r"(u[k + 1]), "+r"(u[k + 2]), "+r"(u[k + 3]));
}

/* The scalar version (float or double): v unknown to the compiler from here
 * on (asm volatile: not moved above an earlier asm volatile load), so what
 * is computed from it is computed here, not hoisted. */
template <typename A> __device__ __forceinline__ A opaque_acc(A v) {
    if constexpr (sizeof(A) == 4) asm volatile("" : "+f"(v));
    else asm volatile("" : "+d"(v));
    return v;
}

__host__ __device__ __forceinline__ bool aligned16(const void *p) {
    return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

template <typename A> __device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

/* Sum over the whole block, returned to every thread. `scratch` holds 32
 * values; the leading barrier makes it safe to call again in a loop.
 * LEAD false: no leading barrier, for a row loop that alternates two
 * 32-value scratch buffers between calls (a call's writes to a buffer come
 * after every thread's reads of it two calls before, which precede the
 * middle barrier of the call between). Without a barrier ahead of the sum
 * the compiler keeps the row's loads ahead of the first barrier (it had
 * moved the leading one above them). */
template <typename A, bool LEAD = true> __device__ __forceinline__ A block_sum(A v, A *scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    if constexpr (LEAD) __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : A(0);
    return warp_sum(v);
}

/* The one dtype dispatch: calls f(DtypeTag<D>{}) for the float dtype D
 * that `dtype` names, so a launcher writes its body once as a template;
 * `fallback` is returned for any other value. */
template <opsmith_dtype D> struct DtypeTag {
    static constexpr opsmith_dtype value = D;
};

template <typename R, typename F> R dispatch_float(opsmith_dtype dtype, R fallback, F f) {
    switch (dtype) {
    case OPSMITH_DTYPE_F64: return f(DtypeTag<OPSMITH_DTYPE_F64>{});
    case OPSMITH_DTYPE_F32: return f(DtypeTag<OPSMITH_DTYPE_F32>{});
    case OPSMITH_DTYPE_F16: return f(DtypeTag<OPSMITH_DTYPE_F16>{});
    case OPSMITH_DTYPE_BF16: return f(DtypeTag<OPSMITH_DTYPE_BF16>{});
    default: return fallback;
    }
}

/* The dtype combinations a launcher with per-role dtypes (x, weight, y)
 * supports: one dtype, or f16/bf16 x with an f32 weight and y in x's dtype
 * or f32. Calls f(Types<T, W, Y>{}); `fallback` for any other. */
template <typename TX, typename TW, typename TY> struct Types {
    using T = TX;
    using W = TW;
    using Y = TY;
};

template <typename R, typename F> R dispatch_mixed(opsmith_dtype x, opsmith_dtype w, opsmith_dtype y, R fallback, F f) {
    using bf16 = __nv_bfloat16;
    if (x == w && w == y) {
        switch (x) {
        case OPSMITH_DTYPE_F64: return f(Types<double, double, double>{});
        case OPSMITH_DTYPE_F32: return f(Types<float, float, float>{});
        case OPSMITH_DTYPE_F16: return f(Types<__half, __half, __half>{});
        case OPSMITH_DTYPE_BF16: return f(Types<bf16, bf16, bf16>{});
        default: return fallback;
        }
    }
    if (w != OPSMITH_DTYPE_F32) return fallback;
    if (x == OPSMITH_DTYPE_BF16 && y == x) return f(Types<bf16, float, bf16>{});
    if (x == OPSMITH_DTYPE_BF16 && y == OPSMITH_DTYPE_F32) return f(Types<bf16, float, float>{});
    if (x == OPSMITH_DTYPE_F16 && y == x) return f(Types<__half, float, __half>{});
    if (x == OPSMITH_DTYPE_F16 && y == OPSMITH_DTYPE_F32) return f(Types<__half, float, float>{});
    return fallback;
}

/* Map the state after a launch to a status, keeping the runtime's message. */
static inline opsmith_status launch_status(void) {
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) return OPSMITH_STATUS_SUCCESS;
    opsmith_internal_set_cuda_error(cudaGetErrorString(e));
    return OPSMITH_STATUS_CUDA_ERROR;
}

} // namespace opsmith
