/* fused_linear_cross_entropy on CUDA: the LM head's three matrix products
 * through cuBLASLt, cross_entropy's row pass between them, over chunks of
 * tokens, never holding more than a chunk of logits. One forward:
 *   prep: the mean's denominator over every target (on the device);
 *   per chunk of c tokens (logits buffer L: (c, vocab), in the workspace):
 *     L  = h_c W^T (+ bias: L filled with it first, the product added, beta 1)
 *     cross_entropy's rows pass: per-row losses, dL written over L (the
 *         gradient of the reduced loss; in float16 that of the summed loss,
 *         MEAN's 1 / denom left to the products' alpha, so that dL holds
 *         p - onehot rather than (p - onehot) / denom, whose p / denom
 *         underflows: at 300 tokens over 128256 classes most of it flushed
 *         to zero and dhidden came back 3% of its largest element off;
 *         the other dtypes have float32's range or more and keep the scale
 *         in dL, their products' alpha 1 from the host)
 *     dh_c = alpha dL W             (cuBLASLt, written into dhidden)
 *     dW  += alpha dL^T h_c         (cuBLASLt, beta 1 after the first chunk:
 *         into a float32 buffer under OPSMITH_FLCE_DWEIGHT_ACC_FLOAT32, else
 *         into dweight itself with float32 arithmetic inside each product;
 *         OPSMITH_FLCE_GRADS_FLOAT32: dhidden, dweight and dbias float32)
 *     db  += column sums of dL      (float accumulator, one thread a column:
 *         a fixed order, deterministic; alpha applied as it is narrowed)
 *   finish: the reduced loss and z-loss.
 * Nothing waits on the host; cuBLASLt runs on the stream it is given with
 * the workspace it is given (graph capture holds). One cuBLASLt handle per
 * device, made on first use under a mutex. cuBLASLt is column-major: a
 * row-major (r, c) matrix with row stride ld is its (c, r) transpose there. */
#include <cublasLt.h>

#include <mutex>

#include "common.cuh"
#include "internal/cross_entropy.h"
#include "internal/fused_linear_cross_entropy.h"

namespace opsmith {
namespace {

constexpr const char *kOp = "fused_linear_cross_entropy_fwd_cuda";

opsmith_status lt_fail(cublasStatus_t s, const char *what) {
    return opsmith_internal_fail(OPSMITH_STATUS_CUDA_ERROR, "%s: cuBLASLt %s failed: %s (%d)", kOp, what,
                                 cublasLtGetStatusString(s), (int)s);
}

#define LT_CHECK(call, what)                                                                                       \
    do {                                                                                                           \
        const cublasStatus_t st_ = (call);                                                                         \
        if (st_ != CUBLAS_STATUS_SUCCESS) return lt_fail(st_, what);                                               \
    } while (0)

constexpr int kMaxDevices = 128;
std::mutex g_lt_mutex;
cublasLtHandle_t g_lt[kMaxDevices];

opsmith_status lt_handle(cublasLtHandle_t *out) {
    int dev = 0;
    const cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) {
        opsmith_internal_set_cuda_error(cudaGetErrorString(e));
        return OPSMITH_STATUS_CUDA_ERROR;
    }
    if (dev < 0 || dev >= kMaxDevices)
        return opsmith_internal_fail(OPSMITH_STATUS_CUDA_ERROR, "%s: device %d is past the %d handles kept", kOp, dev,
                                     kMaxDevices);
    std::lock_guard<std::mutex> lock(g_lt_mutex);
    if (!g_lt[dev]) LT_CHECK(cublasLtCreate(&g_lt[dev]), "cublasLtCreate");
    *out = g_lt[dev];
    return OPSMITH_STATUS_SUCCESS;
}

/* cuBLASLt's types for one opsmith dtype */
struct LtTypes {
    cudaDataType_t ab;           /* A, B (and C/D unless overridden) */
    cublasComputeType_t compute;
    cudaDataType_t scale;
};

LtTypes lt_types(opsmith_dtype d) {
    switch (d) {
    case OPSMITH_DTYPE_F64: return {CUDA_R_64F, CUBLAS_COMPUTE_64F, CUDA_R_64F};
    case OPSMITH_DTYPE_F32: return {CUDA_R_32F, CUBLAS_COMPUTE_32F, CUDA_R_32F};
    case OPSMITH_DTYPE_F16: return {CUDA_R_16F, CUBLAS_COMPUTE_32F, CUDA_R_32F};
    default: return {CUDA_R_16BF, CUBLAS_COMPUTE_32F, CUDA_R_32F};
    }
}

/* the largest power of two (<= 256) dividing the address: what cuBLASLt may assume */
uint32_t alignment_of(const void *p) {
    const uintptr_t a = (uintptr_t)p;
    uint32_t al = 256;
    while (al > 1 && a % al) al /= 2;
    return al;
}

/* One column-major product D(m, n) = op(A)(m, k) op(B)(k, n) + beta * C, C == D:
 * A stored (ta == N ? m x k : k x m) with leading dim lda, likewise B. */
struct Gemm {
    cublasOperation_t ta, tb;
    int64_t m, n, k;
    const void *a;
    int64_t lda;
    const void *b;
    int64_t ldb;
    void *c;
    int64_t ldc;
    cudaDataType_t ctype;
    bool accumulate; /* beta = 1 */
    /* NULL: alpha 1 from the host; else {alpha, 0, 1} in the scale type on
     * the device (the reduction's scale, known only there) */
    const void *device_scales = nullptr;
};

/* Owns cuBLASLt's descriptors for one call (released on every path). */
struct LtCall {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
    cublasLtMatmulPreference_t pref = nullptr;
    ~LtCall() {
        if (pref) cublasLtMatmulPreferenceDestroy(pref);
        if (lc) cublasLtMatrixLayoutDestroy(lc);
        if (lb) cublasLtMatrixLayoutDestroy(lb);
        if (la) cublasLtMatrixLayoutDestroy(la);
        if (desc) cublasLtMatmulDescDestroy(desc);
    }
};

opsmith_status matmul(cublasLtHandle_t h, const LtTypes &t, const Gemm &g, void *ws, size_t ws_bytes,
                      cudaStream_t stream) {
    LtCall c;
    LT_CHECK(cublasLtMatmulDescCreate(&c.desc, t.compute, t.scale), "cublasLtMatmulDescCreate");
    if (g.device_scales) {
        const int32_t mode = CUBLASLT_POINTER_MODE_DEVICE;
        LT_CHECK(cublasLtMatmulDescSetAttribute(c.desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, &mode, sizeof mode),
                 "set POINTER_MODE");
    }
    const int32_t ta = g.ta, tb = g.tb;
    LT_CHECK(cublasLtMatmulDescSetAttribute(c.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), "set TRANSA");
    LT_CHECK(cublasLtMatmulDescSetAttribute(c.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), "set TRANSB");
    const bool an = g.ta == CUBLAS_OP_N, bn = g.tb == CUBLAS_OP_N;
    LT_CHECK(cublasLtMatrixLayoutCreate(&c.la, t.ab, an ? g.m : g.k, an ? g.k : g.m, g.lda), "layout A");
    LT_CHECK(cublasLtMatrixLayoutCreate(&c.lb, t.ab, bn ? g.k : g.n, bn ? g.n : g.k, g.ldb), "layout B");
    LT_CHECK(cublasLtMatrixLayoutCreate(&c.lc, g.ctype, g.m, g.n, g.ldc), "layout C");
    LT_CHECK(cublasLtMatmulPreferenceCreate(&c.pref), "cublasLtMatmulPreferenceCreate");
    const uint64_t wsb = ws_bytes;
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(c.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb),
             "set MAX_WORKSPACE_BYTES");
    const uint32_t al[3] = {alignment_of(g.a), alignment_of(g.b), alignment_of(g.c)};
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(c.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al[0], 4),
             "set MIN_ALIGNMENT_A_BYTES");
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(c.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al[1], 4),
             "set MIN_ALIGNMENT_B_BYTES");
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(c.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al[2], 4),
             "set MIN_ALIGNMENT_C_BYTES");
    LT_CHECK(cublasLtMatmulPreferenceSetAttribute(c.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al[2], 4),
             "set MIN_ALIGNMENT_D_BYTES");
    cublasLtMatmulHeuristicResult_t result = {};
    int found = 0;
    LT_CHECK(cublasLtMatmulAlgoGetHeuristic(h, c.desc, c.la, c.lb, c.lc, c.lc, c.pref, 1, &result, &found),
             "cublasLtMatmulAlgoGetHeuristic");
    if (found == 0)
        return opsmith_internal_fail(OPSMITH_STATUS_CUDA_ERROR,
                                     "%s: cuBLASLt has no algorithm for a %lld x %lld x %lld product of this dtype",
                                     kOp, (long long)g.m, (long long)g.n, (long long)g.k);
    const double one = 1.0, beta64 = g.accumulate ? 1.0 : 0.0;
    const float onef = 1.0f, betaf = g.accumulate ? 1.0f : 0.0f;
    const bool dbl = t.scale == CUDA_R_64F;
    const void *alpha = dbl ? (const void *)&one : (const void *)&onef;
    const void *beta = dbl ? (const void *)&beta64 : (const void *)&betaf;
    if (g.device_scales) {
        const char *d = static_cast<const char *>(g.device_scales);
        const size_t e = dbl ? sizeof(double) : sizeof(float);
        alpha = d, beta = d + (g.accumulate ? 2 : 1) * e;
    }
    LT_CHECK(cublasLtMatmul(h, c.desc, alpha, g.a, c.la, g.b, c.lb, beta, g.c, c.lc, g.c, c.lc, &result.algo, ws,
                            ws_bytes, stream),
             "cublasLtMatmul");
    return OPSMITH_STATUS_SUCCESS;
}

/* L[i, v] = bias[v] (L: (c, vocab)) */
template <typename T>
__global__ void fill_bias_kernel(int64_t c, int64_t vocab, const T *__restrict__ bias, T *__restrict__ L) {
    const int64_t total = c * vocab;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x)
        L[i] = bias[i % vocab];
}

/* db[v] += sum_i L[i, v]: a thread a column, rows in order */
template <typename T, typename A>
__global__ void colsum_kernel(int64_t c, int64_t vocab, const T *__restrict__ L, A *__restrict__ db) {
    const int64_t v = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (v >= vocab) return;
    A s = 0;
    for (int64_t i = 0; i < c; i++) s += to_acc(L[i * vocab + v]);
    db[v] += s;
}

/* out[i] = T(in[i] * scale[0]) (scale NULL: 1), through the accumulate type A */
template <typename S, typename T, typename A>
__global__ void narrow_kernel(int64_t n, const S *__restrict__ in, const A *__restrict__ scale, T *__restrict__ out) {
    const A k = scale ? scale[0] : A(1);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        out[i] = from_acc<T>((A)in[i] * k);
}

/* dw[2..4] = {alpha, 0, 1} for the products after cross_entropy's rows:
 * MEAN's 1 / denom (0 when every target is ignored: dL is all zeros then,
 * and 1 / 0 would make them NaN), SUM's 1 */
template <typename A> __global__ void product_scales_kernel(int red, A *dw) {
    const A d = dw[0];
    dw[2] = red == OPSMITH_CROSS_ENTROPY_REDUCTION_MEAN ? (d > A(0) ? A(1) / d : A(0)) : A(1);
    dw[3] = A(0);
    dw[4] = A(1);
}

unsigned grid_for(int64_t n, int threads) {
    const int64_t b = (n + threads - 1) / threads;
    return (unsigned)(b < 65535 * 16 ? (b > 0 ? b : 1) : 65535 * 16);
}

template <opsmith_dtype DT>
opsmith_status run(int64_t rows, int64_t dim, int64_t vocab, const void *hidden, int64_t hs, const void *weight,
                   const void *bias, const int64_t *target, int64_t ts, int64_t ignore, double ls, double z,
                   double cap, int red, int64_t chunk, int fp32_dweight, void *loss, void *z_out, void *dhidden,
                   void *dweight, void *dbias, int64_t *error, char *ws, const opsmith_flce_layout &l,
                   cudaStream_t stream) {
    using T = typename Storage<DT>::T;
    using A = typename Storage<DT>::Acc;
    const opsmith_dtype dtype = DT;
    const LtTypes lt = lt_types(dtype);
    cublasLtHandle_t h = nullptr;
    opsmith_status st = lt_handle(&h);
    if (st != OPSMITH_STATUS_SUCCESS) return st;
    void *lt_ws = ws + l.lt;
    const size_t lt_bytes = OPSMITH_FLCE_CUBLASLT_WORKSPACE;
    void *loss_rows = ws + l.loss_rows, *z_rows = ws + l.z_rows, *dw = ws + l.denom_wsum;
    T *L = reinterpret_cast<T *>(ws + l.logits);
    const bool grads = dhidden || dweight || dbias;
    /* the gradients in float32 (16-bit dtypes, OPSMITH_FLCE_GRADS_FLOAT32):
     * the products write float32 (cuBLASLt's 16-bit A and B, float32 C),
     * dweight accumulating in place, as dweight32 does */
    const bool g32 = fp32_dweight == OPSMITH_FLCE_GRADS_FLOAT32 && sizeof(T) == 2;
    const bool dw32 = fp32_dweight == OPSMITH_FLCE_DWEIGHT_ACC_FLOAT32 && sizeof(T) == 2 && dweight;
    void *dw_acc = dw32 ? (void *)(ws + l.dweight32) : dweight;
    A *db = reinterpret_cast<A *>(ws + l.dbias);
    const size_t size = sizeof(T), gsize = g32 ? sizeof(float) : size;
    const cudaDataType_t gtype = g32 ? CUDA_R_32F : lt.ab;

    st = opsmith_internal_cross_entropy_prep_cuda(dtype, rows, vocab, target, ts, nullptr, ignore, dw, stream);
    if (st != OPSMITH_STATUS_SUCCESS) return st;
    /* float16 only: p / denom underflows there (the header) */
    const bool scale_in_products = DT == OPSMITH_DTYPE_F16;
    const A *scales = scale_in_products ? static_cast<const A *>(dw) + 2 : nullptr;
    const int rows_red = scale_in_products ? (int)OPSMITH_CROSS_ENTROPY_REDUCTION_SUM : red;
    if (scale_in_products) {
        product_scales_kernel<A><<<1, 1, 0, stream>>>(red, static_cast<A *>(dw));
        if ((st = launch_status()) != OPSMITH_STATUS_SUCCESS) return st;
    }
    if (dbias && cudaMemsetAsync(db, 0, sizeof(A) * (size_t)vocab, stream) != cudaSuccess) return launch_status();
    if (dweight && rows == 0 &&
        cudaMemsetAsync(dweight, 0, gsize * (size_t)vocab * (size_t)dim, stream) != cudaSuccess)
        return launch_status();

    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
        const int64_t c = r0 + chunk < rows ? chunk : rows - r0;
        const char *hc = static_cast<const char *>(hidden) + (size_t)(r0 * hs) * size;
        if (bias) {
            fill_bias_kernel<T><<<grid_for(c * vocab, 256), 256, 0, stream>>>(c, vocab, static_cast<const T *>(bias), L);
            if ((st = launch_status()) != OPSMITH_STATUS_SUCCESS) return st;
        }
        /* logits^T (vocab x c) = W (vocab x dim; stored dim x vocab) . h_c^T (dim x c) */
        st = matmul(h, lt, Gemm{CUBLAS_OP_T, CUBLAS_OP_N, vocab, c, dim, weight, dim, hc, hs, L, vocab, lt.ab, bias != nullptr},
                    lt_ws, lt_bytes, stream);
        if (st != OPSMITH_STATUS_SUCCESS) return st;
        st = opsmith_internal_cross_entropy_rows_cuda(dtype, c, vocab, L, vocab, target + r0 * ts, ts, nullptr, ignore,
                                                      ls, z, cap, rows_red, dw, static_cast<A *>(loss_rows) + r0,
                                                      static_cast<A *>(z_rows) + r0, grads ? L : nullptr, vocab, error,
                                                      r0, stream);
        if (st != OPSMITH_STATUS_SUCCESS) return st;
        if (dhidden) {
            /* dh_c^T (dim x c) = W^T (dim x vocab, stored so) . dL^T (vocab x c, stored so) */
            void *dh = static_cast<char *>(dhidden) + (size_t)(r0 * dim) * gsize;
            st = matmul(h, lt,
                        Gemm{CUBLAS_OP_N, CUBLAS_OP_N, dim, c, vocab, weight, dim, L, vocab, dh, dim, gtype, false, scales},
                        lt_ws, lt_bytes, stream);
            if (st != OPSMITH_STATUS_SUCCESS) return st;
        }
        if (dweight) {
            /* dW^T (dim x vocab) += h_c^T (dim x c, stored so) . dL (c x vocab; stored vocab x c) */
            st = matmul(h, lt,
                        Gemm{CUBLAS_OP_N, CUBLAS_OP_T, dim, vocab, c, hc, hs, L, vocab, dw_acc, dim,
                             dw32 ? CUDA_R_32F : gtype, r0 > 0, scales},
                        lt_ws, lt_bytes, stream);
            if (st != OPSMITH_STATUS_SUCCESS) return st;
        }
        if (dbias) {
            colsum_kernel<T, A><<<grid_for(vocab, 256), 256, 0, stream>>>(c, vocab, L, db);
            if ((st = launch_status()) != OPSMITH_STATUS_SUCCESS) return st;
        }
    }
    /* the loss in A: cross_entropy's finish for the dtype whose storage is A */
    const opsmith_dtype acc = dtype == OPSMITH_DTYPE_F64 ? OPSMITH_DTYPE_F64 : OPSMITH_DTYPE_F32;
    st = opsmith_internal_cross_entropy_finish_cuda(acc, rows, red, loss_rows, z_rows, dw, loss, z_out, stream);
    if (st != OPSMITH_STATUS_SUCCESS) return st;
    if (dw32 && rows > 0) {
        const int64_t n = vocab * dim;
        narrow_kernel<float, T, A><<<grid_for(n, 256), 256, 0, stream>>>(n, static_cast<const float *>(dw_acc),
                                                                     nullptr, static_cast<T *>(dweight));
        if ((st = launch_status()) != OPSMITH_STATUS_SUCCESS) return st;
    }
    if (dbias) {
        if (g32)
            narrow_kernel<A, float, A><<<grid_for(vocab, 256), 256, 0, stream>>>(vocab, db, scales,
                                                                               static_cast<float *>(dbias));
        else
            narrow_kernel<A, T, A><<<grid_for(vocab, 256), 256, 0, stream>>>(vocab, db, scales, static_cast<T *>(dbias));
        if ((st = launch_status()) != OPSMITH_STATUS_SUCCESS) return st;
    }
    return OPSMITH_STATUS_SUCCESS;
}

} // namespace
} // namespace opsmith

using namespace opsmith;

extern "C" opsmith_status opsmith_fused_linear_cross_entropy_fwd_cuda(
    opsmith_dtype dtype, int64_t rows, int64_t dim, int64_t vocab, const void *hidden, int64_t hidden_row_stride,
    const void *weight, const void *bias, const int64_t *target, int64_t target_stride, int64_t ignore_index,
    double label_smoothing, double z_loss, double softcap, opsmith_cross_entropy_reduction reduction,
    int64_t chunk_rows, int fp32_dweight, void *loss, void *z_out, void *dhidden, void *dweight, void *dbias,
    int64_t *error, void *workspace, size_t workspace_bytes, opsmith_cuda_stream stream) {
    int64_t chunk = chunk_rows;
    opsmith_status st = opsmith_internal_flce_check(kOp, dtype, rows, dim, vocab, hidden, hidden_row_stride, weight,
                                                    bias, target, label_smoothing, z_loss, softcap, (int)reduction,
                                                    &chunk, fp32_dweight, loss, z_out, dhidden, dweight, dbias, error, 1,
                                                    workspace, workspace_bytes);
    if (st != OPSMITH_STATUS_SUCCESS) return st;
    if (chunk > 0x7fffffffLL || dim > 0x7fffffffLL || vocab > 0x7fffffffLL)
        return opsmith_internal_fail(OPSMITH_STATUS_INVALID_ARGUMENT,
                                     "%s: chunk_rows (%lld), dim (%lld) and vocab (%lld) must each be < 2^31", kOp,
                                     (long long)chunk, (long long)dim, (long long)vocab);
    const opsmith_flce_layout l =
        opsmith_internal_flce_layout(dtype, rows, dim, vocab, chunk, fp32_dweight, 1);
    if (chunk > rows) chunk = rows > 0 ? rows : 1;
    return dispatch_float(dtype, OPSMITH_STATUS_UNSUPPORTED_DTYPE, [&](auto tag) {
        return run<decltype(tag)::value>(rows, dim, vocab, hidden, hidden_row_stride, weight, bias, target,
                                         target_stride, ignore_index, label_smoothing, z_loss, softcap, (int)reduction,
                                         chunk, fp32_dweight, loss, z_out, dhidden, dweight, dbias, error,
                                         static_cast<char *>(workspace), l, stream);
    });
}
