/* Declarations shared by the library's own translation units (C and CUDA),
 * not part of the public ABI: hidden from the shared library's symbol
 * table. What one op's launchers share lives in csrc/internal/<op>.h. */
#ifndef OPSMITH_INTERNAL_H
#define OPSMITH_INTERNAL_H

#include "opsmith.h"

#if defined(__GNUC__)
#define OPSMITH_INTERNAL __attribute__((visibility("hidden")))
#define OPSMITH_PRINTF(fmt_index) __attribute__((format(printf, fmt_index, fmt_index + 1)))
#else
#define OPSMITH_INTERNAL
#define OPSMITH_PRINTF(fmt_index)
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Records the message opsmith_last_error() returns (printf-style) and
 * returns `status`, so a validator can `return opsmith_internal_fail(...)`. */
OPSMITH_INTERNAL opsmith_status opsmith_internal_fail(opsmith_status status, const char *fmt, ...)
    OPSMITH_PRINTF(2);
/* Empties opsmith_last_error(); every launcher's validator calls it first. */
OPSMITH_INTERNAL void opsmith_internal_clear_error(void);
/* Records the CUDA runtime's message for a failed launch. */
OPSMITH_INTERNAL void opsmith_internal_set_cuda_error(const char *message);

/* 1 when p is non-NULL and not a multiple of `alignment`. */
OPSMITH_INTERNAL int opsmith_internal_misaligned(const void *p, size_t alignment);

/* The workspace rules of opsmith.h for a launcher that needs `needed` bytes. */
OPSMITH_INTERNAL opsmith_status opsmith_internal_check_workspace(const char *op, const void *workspace,
                                                                 size_t workspace_bytes, size_t needed);

#ifdef __cplusplus
}
#endif
/* Byte range [lo, hi) of a (rows, n) tensor with a row stride (rows >= 1),
 * and whether two ranges overlap: the validators' aliasing checks. */
typedef struct opsmith_span {
    uintptr_t lo, hi;
} opsmith_span;

static inline opsmith_span opsmith_internal_span(const void *p, int64_t rows, int64_t n, int64_t stride, size_t size) {
    opsmith_span s = {(uintptr_t)p, (uintptr_t)p + (size_t)((rows - 1) * stride + n) * size};
    return s;
}

static inline int opsmith_internal_overlap(opsmith_span a, opsmith_span b) { return a.lo < b.hi && b.lo < a.hi; }

/* Elements of work below which a CPU launcher stays on one thread, as
 * PyTorch's at::parallel_for grain: forking a team costs microseconds on an
 * idle machine and milliseconds on a loaded one, more than a small op. */
#define OPSMITH_CPU_GRAIN 32768

/* The threads a CPU launcher uses for `work` elements: opsmith_get_num_threads(),
 * fewer for small work (one per OPSMITH_CPU_GRAIN elements). */
OPSMITH_INTERNAL int opsmith_internal_threads_for(int64_t work);

#endif /* OPSMITH_INTERNAL_H */
