/* opsmith: fused operators for transformer training, behind a plain C ABI.
 *
 * This header is the core every op shares (status codes, dtypes, errors,
 * threads, streams, version) and includes one header per op, opsmith/<op>.h.
 * No CUDA header is needed to include it: a CUDA stream travels as
 * opsmith_cuda_stream, which is the same type as cudaStream_t.
 *
 * Conventions every launcher follows (ABI version 1):
 *
 * Names. Every exported symbol starts with opsmith_; launchers are
 *   opsmith_<op>_<fwd|bwd|...>_<cpu|cuda>, references opsmith_<op>_<dir>_reference.
 *   Enums are append-only; each has a _COUNT sentinel that sizes its name table.
 *
 * Errors. No function exits or aborts: each returns an opsmith_status. A
 *   failing call also leaves a message naming the argument in
 *   opsmith_last_error() ("rms_norm_fwd: x_row_stride (3) must be >= n (8)
 *   when rows > 1"); a successful launcher call empties it.
 *
 * Tensors. A tensor crosses as (pointer, int64 sizes, int64 row stride in
 *   elements). The innermost dimension is always contiguous; inputs AND
 *   outputs take a row stride. Rows of an input may share memory (stride 0)
 *   only when there is one row; otherwise a row must not overlap the next.
 *
 * Aliasing. Outputs never overlap inputs or each other, except where an
 *   op's header says that an output may alias an input: then it is exactly
 *   the same memory (same pointer and same row stride), never a partial
 *   overlap, and the launcher computes the same result as without aliasing
 *   (in-place variants are built on this).
 *
 * Mixed dtypes. A launcher whose tensors may differ in dtype takes one
 *   opsmith_dtype per tensor role, named after it (x_dtype, weight_dtype,
 *   grad_dtype, ...), in the order of the tensors; its header lists the
 *   combinations it supports, and any other is OPSMITH_STATUS_UNSUPPORTED_DTYPE.
 *   A launcher with a single `dtype` argument takes every float tensor in it;
 *   per-row statistics are kept in opsmith_dtype_accumulate(dtype).
 *
 * Tensor lists. A list of tensors (a multi-tensor optimizer step) crosses
 *   as `int64_t count` and, per tensor role, a host array of `count`
 *   pointers (`void *const *params`), with one host array of element counts
 *   (`const int64_t *numels`) shared by the roles that have the same sizes.
 *   The host arrays are read during the call only: a CUDA launcher copies
 *   what its kernels need into kernel arguments or its workspace before it
 *   returns, so the caller may free or reuse them at once.
 *
 * Workspace. A launcher that needs scratch memory takes
 *   (void *workspace, size_t workspace_bytes) just before its stream (or
 *   last, on the CPU) and has a companion <launcher>_workspace_size taking
 *   the launcher's own arguments up to the workspace; of its pointers only
 *   NULL or not matters. The caller allocates at least that many bytes on
 *   the launcher's device, aligned to OPSMITH_WORKSPACE_ALIGNMENT (so an
 *   allocator being captured into a CUDA graph can provide it). A size of 0
 *   means none is needed and the workspace may be NULL; a NULL workspace
 *   with a nonzero size is OPSMITH_STATUS_INVALID_ARGUMENT, a smaller one
 *   OPSMITH_STATUS_WORKSPACE_TOO_SMALL, a misaligned one
 *   OPSMITH_STATUS_MISALIGNED. Launchers never allocate memory themselves.
 *
 * Threads and streams. CPU launchers run on OpenMP threads, as many as
 *   opsmith_get_num_threads() says on the calling thread. CUDA launchers
 *   take device pointers, run asynchronously on `stream` of the current
 *   device and never synchronise. */
#ifndef OPSMITH_H
#define OPSMITH_H

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define OPSMITH_API __attribute__((visibility("default")))
#else
#define OPSMITH_API
#endif

#define OPSMITH_VERSION_MAJOR 3
#define OPSMITH_VERSION_MINOR 0
#define OPSMITH_VERSION_PATCH 0
/* Bumped only when a published declaration changes incompatibly; appending
 * functions or enum values keeps it. */
#define OPSMITH_ABI_VERSION 3

/* Bytes a workspace pointer must be aligned to. */
#define OPSMITH_WORKSPACE_ALIGNMENT 64

#ifdef __cplusplus
extern "C" {
#endif

/* OPSMITH_ABI_VERSION of the library actually linked (compare with the
 * header's to detect a mismatch at run time). */
OPSMITH_API int opsmith_abi_version(void);
/* "MAJOR.MINOR.PATCH" of the library actually linked. Static storage. */
OPSMITH_API const char *opsmith_version(void);

typedef enum opsmith_status {
    OPSMITH_STATUS_SUCCESS = 0,
    OPSMITH_STATUS_INVALID_ARGUMENT = 1, /* a size, stride or pointer is out of range */
    OPSMITH_STATUS_UNSUPPORTED_DTYPE = 2,
    OPSMITH_STATUS_MISALIGNED = 3,       /* a pointer is not aligned as required */
    OPSMITH_STATUS_OUT_OF_MEMORY = 4,    /* host memory could not be allocated */
    OPSMITH_STATUS_WORKSPACE_TOO_SMALL = 5,
    OPSMITH_STATUS_CUDA_ERROR = 6,       /* a CUDA launch or runtime call failed */
    OPSMITH_STATUS_CUDA_UNAVAILABLE = 7, /* the library was built without CUDA */
    OPSMITH_STATUS_COUNT
} opsmith_status;

/* A static string for every status, e.g. "invalid argument". Never NULL. */
OPSMITH_API const char *opsmith_status_string(opsmith_status status);

/* What the last failing call on this thread said: the argument at fault and
 * what was expected, or the CUDA runtime's message for a CUDA error. "" when
 * the last launcher call succeeded. Thread-local; valid until the next call. */
OPSMITH_API const char *opsmith_last_error(void);

typedef enum opsmith_dtype {
    OPSMITH_DTYPE_F64 = 0,
    OPSMITH_DTYPE_F32 = 1,
    OPSMITH_DTYPE_F16 = 2,  /* IEEE binary16 */
    OPSMITH_DTYPE_BF16 = 3, /* bfloat16: the top half of a binary32 */
    OPSMITH_DTYPE_I32 = 4,  /* indices, positions */
    OPSMITH_DTYPE_I64 = 5,  /* targets, positions */
    OPSMITH_DTYPE_COUNT
} opsmith_dtype;

/* "f64", "f32", "f16", "bf16", "i32", "i64"; "?" for a value outside the enum. */
OPSMITH_API const char *opsmith_dtype_name(opsmith_dtype dtype);
/* Bytes per element; 0 for a value outside the enum. */
OPSMITH_API size_t opsmith_dtype_size(opsmith_dtype dtype);
/* 1 for the floating-point dtypes, 0 otherwise. */
OPSMITH_API int opsmith_dtype_is_float(opsmith_dtype dtype);
/* The type statistics are kept and accumulated in: F64 for F64, F32 for the
 * other float types, I64 for the integer types. */
OPSMITH_API opsmith_dtype opsmith_dtype_accumulate(opsmith_dtype dtype);

/* Threads the CPU launchers called from this thread use: n >= 1 fixes it,
 * 0 returns to the OpenMP runtime's default. Thread-local, so callers on
 * different threads do not change each other's. */
OPSMITH_API void opsmith_set_num_threads(int n);
/* The number the next CPU launcher called from this thread will use. */
OPSMITH_API int opsmith_get_num_threads(void);

/* 1 when the CUDA launchers were compiled in, 0 when they return
 * OPSMITH_STATUS_CUDA_UNAVAILABLE. */
OPSMITH_API int opsmith_has_cuda(void);

typedef struct CUstream_st *opsmith_cuda_stream; /* == cudaStream_t; NULL = legacy default stream */

/* Element conversions between the storage types and double, for callers
 * that prepare inputs or read outputs (tests, benchmarks). Floats round to
 * nearest even (NaN stays NaN); integers convert exactly within +-2^53 and
 * are truncated towards zero on store. */
OPSMITH_API double opsmith_load_as_double(opsmith_dtype dtype, const void *base, int64_t index);
OPSMITH_API void opsmith_store_from_double(opsmith_dtype dtype, void *base, int64_t index, double value);

#ifdef __cplusplus
}
#endif

/* The ops, one header each (one line per op). */
#include "opsmith/rms_norm.h"
#include "opsmith/glu.h"
#include "opsmith/layer_norm.h"
#include "opsmith/fused_add_rms_norm.h"
#include "opsmith/rotary.h"
#include "opsmith/adamw.h"
#include "opsmith/cross_entropy.h"
#include "opsmith/softmax.h"
#include "opsmith/fused_linear_cross_entropy.h"

#endif /* OPSMITH_H */
