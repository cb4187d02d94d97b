/* The clone attribute of every CPU kernel's inner loops: compiled for
 * x86-64-v4 (AVX-512 F, BW, VL, DQ: 16-bit elements in 512-bit registers),
 * x86-64-v3 (AVX2) and the baseline (SSE2), the one the CPU supports picked
 * when the library loads. The library is ISO C (no FMA contraction) and
 * every sum runs in explicit lanes, so all three give the same bits. */
#ifndef OPSMITH_CPU_CLONES_H
#define OPSMITH_CPU_CLONES_H

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define OPSMITH_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define OPSMITH_CPU_CLONES
#endif

#endif /* OPSMITH_CPU_CLONES_H */
