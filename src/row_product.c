/* y = x W for a few float32 rows x [m, k] and a row-major W [k, n]: the products of decode steps
 * (m = 1) and of speculative verify rows (m > 1) on a CPU; see
 * flashrt_ros/runtime/backends/cpu/row_product.py for why this is not left to BLAS.
 *
 * W is cut along k into SLABS slabs of consecutive rows. For every row of x, each slab's partial
 * row is one FMA chain per output, in W's row order; the partial rows are then added in slab
 * order. Nothing in an output's arithmetic depends on m, on the thread count or on the machine:
 * a row gives the same bytes alone or among others (batch invariance, which lets a verify over
 * several rows match single-row steps bit for bit), fmaf rounds once wherever it runs (one
 * instruction, or glibc's exact fallback), and the vector width only changes how many outputs
 * advance together, never any output's order. Threads take whole slabs, so with two each reads
 * one half of W once, for all m rows.
 */
#include <stddef.h>

#include "fma_loops.h"
#include "fp_mode.h"

#ifdef __FAST_MATH__
#error "row_product.c must not be built with -ffast-math: it would reorder the sums its callers rely on"
#endif

#define SLABS 8
#define ROWS 8     /* rows of W folded into one pass over a partial row: it is read and written once per ROWS */
#define MAX_M 8    /* rows of x in one call: the partials are SLABS * m * n floats */
#define CHUNK 256  /* outputs every row of x takes in turn from one block of W: ROWS * CHUNK floats, read
                      once from memory and then from L1 for the other rows */
#define TILE 32768 /* partial floats (all m rows) one pass over a slab's rows keeps: in L2, however wide W */

/* One slab for every row of x, compiled twice on x86 (see fma_loops.h). The outputs are taken in
 * tiles of whole chunks, so the partials a tile keeps stay in cache while its columns of the
 * slab stream past; within a tile, each block of ROWS rows of W is read once for all m rows.
 * Every output still sums the slab's rows in order. */
#define SLAB_PRODUCT(NAME, ATTRIBUTES)                                                          \
    ATTRIBUTES static void NAME(const float *restrict x, long ldx, long m, const float *restrict w, \
                                float *restrict partial, long rows, long n) {                   \
        for (long j = 0; j < m * n; j++)                                                        \
            partial[j] = 0.0f;                                                                  \
        long tile = (TILE / m) / CHUNK * CHUNK;                                                 \
        if (tile < CHUNK)                                                                       \
            tile = CHUNK;                                                                       \
        const long chunk = m == 1 ? tile : CHUNK;   /* one row shares a block with no other */   \
        for (long t0 = 0; t0 < n; t0 += tile) {                                                 \
            const long tn = t0 + tile < n ? t0 + tile : n;                                      \
            long i = 0;                                                                         \
            for (; i + ROWS <= rows; i += ROWS) {                                               \
                const float *restrict block = w + i * n;                                        \
                float xs[MAX_M][ROWS];                                                          \
                for (long q = 0; q < m; q++)                                                    \
                    for (int r = 0; r < ROWS; r++)                                              \
                        xs[q][r] = x[q * ldx + i + r];                                          \
                for (long c0 = t0; c0 < tn; c0 += chunk) {                                      \
                    const long cn = c0 + chunk < tn ? c0 + chunk : tn;                          \
                    for (long q = 0; q < m; q++) {                                              \
                        float *restrict out = partial + q * n;                                  \
                        _Pragma("omp simd")                                                     \
                        for (long j = c0; j < cn; j++) {                                        \
                            float acc = out[j];                                                 \
                            _Pragma("GCC unroll 8")                                             \
                            for (int r = 0; r < ROWS; r++)                                      \
                                acc = __builtin_fmaf(xs[q][r], block[r * n + j], acc);          \
                            out[j] = acc;                                                       \
                        }                                                                       \
                    }                                                                           \
                }                                                                               \
            }                                                                                   \
            for (; i < rows; i++) {                                                             \
                const float *restrict row = w + i * n;                                          \
                for (long q = 0; q < m; q++) {                                                  \
                    const float xi = x[q * ldx + i];                                            \
                    float *restrict out = partial + q * n;                                      \
                    _Pragma("omp simd")                                                         \
                    for (long j = t0; j < tn; j++)                                              \
                        out[j] = __builtin_fmaf(xi, row[j], out[j]);                            \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
    }

typedef void (*slab_fn)(const float *, long, long, const float *, float *, long, long);

SLAB_PRODUCT(slab_portable, )
#ifdef FMA_LOOPS
SLAB_PRODUCT(slab_fma, FMA_ATTRIBUTES)

static slab_fn pick_slab(void) { return has_fma() ? slab_fma : slab_portable; }
#else
static slab_fn pick_slab(void) { return slab_portable; }
#endif

/* Read once per call (atomically: a test may switch it meanwhile). */
static slab_fn slab_product;

/* Run the portable loops even where the FMA ones serve (on != 0), or pick again: for the test
 * that both give the same bytes. */
void flashrt_row_product_portable(int on) {
    __atomic_store_n(&slab_product, on ? slab_portable : pick_slab(), __ATOMIC_RELAXED);
}

/* Picked when the library is loaded, before any caller can race for it. */
__attribute__((constructor)) static void pick_loops(void) { flashrt_row_product_portable(0); }

/* x [m, k], y [m, n], both row-major; ``partials`` is scratch of SLABS * m * n floats; ``threads``
 * below 1 runs as 1. Returns 0, or -1 without touching anything when m is not in [1, MAX_M]. */
int flashrt_row_product(const float *x, const float *w, float *y, float *partials, long m, long k, long n,
                        int threads) {
    if (m < 1 || m > MAX_M)
        return -1;
    if (threads < 1)   /* OpenMP leaves num_threads(0) undefined */
        threads = 1;
    const slab_fn slab = __atomic_load_n(&slab_product, __ATOMIC_RELAXED);
    const fp_mode mode = get_fp_mode();
#pragma omp parallel num_threads(threads)
    {
        const fp_mode own = get_fp_mode();
        set_fp_mode(mode);
#pragma omp for schedule(static)
        for (int s = 0; s < SLABS; s++) {
            const long first = s * k / SLABS, last = (s + 1) * k / SLABS;
            slab(x + first, k, m, w + first * n, partials + s * m * n, last - first, n);
        }
        set_fp_mode(own);
    }
    for (long j = 0; j < m * n; j++) {
        float sum = partials[j];
        for (int s = 1; s < SLABS; s++)
            sum += partials[s * m * n + j];
        y[j] = sum;
    }
    return 0;
}

int flashrt_row_product_slabs(void) { return SLABS; }
int flashrt_row_product_max_rows(void) { return MAX_M; }

/* Bumped whenever a change could alter a product's bytes: journals record it. Version 2 takes
 * m rows; a row's bytes are version 1's row-major ones. */
int flashrt_row_product_version(void) { return 2; }
