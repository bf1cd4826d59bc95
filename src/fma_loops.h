/* Loops written once and compiled twice on x86: for AVX2 with FMA (FMA_ATTRIBUTES), and for any
 * x86-64; the caller picks one at run time with has_fma(). GCC's target_clones on a static
 * function called from an OpenMP region ran the generic copy (measured 8x slower), so the
 * choice is made by hand. Elsewhere (ARM has FMA anyway) there is only the portable copy. Both
 * copies give the same bytes when every product-sum is a fmaf: one rounding wherever it runs (an
 * instruction, or glibc's exact fallback).
 */
#ifndef FLASHRT_FMA_LOOPS_H
#define FLASHRT_FMA_LOOPS_H

#if defined(__x86_64__) && defined(__GNUC__)
#define FMA_LOOPS 1
#define FMA_ATTRIBUTES __attribute__((target("avx2,fma")))
static inline int has_fma(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#else
static inline int has_fma(void) { return 0; }
#endif

#endif
