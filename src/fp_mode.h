/* The caller's floating-point mode (flush-to-zero, denormals-are-zero), for OpenMP's worker
 * threads: the engine sets flush-to-zero on the thread that runs a step, and the workers, made
 * earlier, keep their own, so work would round tiny values one way or the other depending on
 * which thread took it. A parallel region reads the caller's mode before it and sets it in each
 * thread inside it (and puts the thread's own back after). */
#ifndef FLASHRT_FP_MODE_H
#define FLASHRT_FP_MODE_H

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
typedef unsigned int fp_mode;
static inline fp_mode get_fp_mode(void) { return _mm_getcsr(); }
static inline void set_fp_mode(fp_mode mode) { _mm_setcsr(mode); }
#elif defined(__aarch64__)
typedef unsigned long fp_mode;
static inline fp_mode get_fp_mode(void) { fp_mode mode; __asm__ volatile("mrs %0, fpcr" : "=r"(mode)); return mode; }
static inline void set_fp_mode(fp_mode mode) { __asm__ volatile("msr fpcr, %0" : : "r"(mode)); }
#else
typedef int fp_mode;
static inline fp_mode get_fp_mode(void) { return 0; }
static inline void set_fp_mode(fp_mode mode) { (void)mode; }
#endif

#endif
