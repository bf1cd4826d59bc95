/* y = x W for ONE float32 row x [k] and a W [k, n], row-major or tiled: the products of a decode
 * step on a CPU (see flashrt_ros/runtime/row_product.py for why this is not left to BLAS).
 *
 * W is cut along k into SLABS slabs of consecutive rows. Each slab's partial row is one FMA
 * chain per output, in row order; the partial rows are then added in slab order. The slab
 * count is fixed, so the bytes of y depend neither on the thread count nor on the machine:
 * fmaf rounds once wherever it runs (one instruction, or glibc's exact fallback), and the
 * vector width only changes how many outputs advance together, never any output's order.
 * Threads take whole slabs: with two, each streams one contiguous half of W.
 *
 * Tiled, each block of ROWS rows is stored as tiles of ROWS x TILE (all ROWS rows of TILE
 * consecutive columns, row-major), tile after tile: a slab is then read as ONE sequential
 * stream, where the row-major loop reads ROWS rows side by side (ROWS streams n floats apart,
 * which the hardware prefetchers follow less well: 28 against 35 GB/s over the bench model's
 * weights, where a plain sum read 38). Every output's FMA chain is the same, in the same
 * order: the two layouts give the same bytes.
 */
#include <stddef.h>

#include "fma_loops.h"
#include "fp_mode.h"

#ifdef __FAST_MATH__
#error "row_product.c must not be built with -ffast-math: it would reorder the sums its callers rely on"
#endif

#define SLABS 8
#define ROWS 8   /* rows folded into one pass over the partial row: it is read and written once per ROWS */
#define TILE 8   /* columns of a tile in the tiled layout */

/* The slab loops, compiled twice on x86 (see fma_loops.h). */
#define SLAB_PRODUCT(NAME, ATTRIBUTES)                                                          \
    ATTRIBUTES static void NAME(const float *restrict x, const float *restrict w,               \
                                float *restrict partial, long rows, long n) {                   \
        for (long j = 0; j < n; j++)                                                            \
            partial[j] = 0.0f;                                                                  \
        long i = 0;                                                                             \
        for (; i + ROWS <= rows; i += ROWS) {                                                   \
            const float *restrict block = w + i * n;                                            \
            float xs[ROWS];                                                                     \
            for (int r = 0; r < ROWS; r++)                                                      \
                xs[r] = x[i + r];                                                               \
            _Pragma("omp simd")                                                                 \
            for (long j = 0; j < n; j++) {                                                      \
                float acc = partial[j];                                                         \
                _Pragma("GCC unroll 8")                                                         \
                for (int r = 0; r < ROWS; r++)                                                  \
                    acc = __builtin_fmaf(xs[r], block[r * n + j], acc);                         \
                partial[j] = acc;                                                               \
            }                                                                                   \
        }                                                                                       \
        for (; i < rows; i++) {                                                                 \
            const float xi = x[i];                                                              \
            const float *restrict row = w + i * n;                                              \
            _Pragma("omp simd")                                                                 \
            for (long j = 0; j < n; j++)                                                        \
                partial[j] = __builtin_fmaf(xi, row[j], partial[j]);                            \
        }                                                                                       \
    }

/* The same for the tiled layout, where rows is a multiple of ROWS and n of TILE. */
#define TILED_SLAB_PRODUCT(NAME, ATTRIBUTES)                                                    \
    ATTRIBUTES static void NAME(const float *restrict x, const float *restrict w,               \
                                float *restrict partial, long rows, long n) {                   \
        for (long j = 0; j < n; j++)                                                            \
            partial[j] = 0.0f;                                                                  \
        for (long i = 0; i < rows; i += ROWS) {                                                 \
            const float *restrict block = w + i * n;                                            \
            float xs[ROWS];                                                                     \
            for (int r = 0; r < ROWS; r++)                                                      \
                xs[r] = x[i + r];                                                               \
            for (long t = 0; t < n; t += TILE) {                                                \
                const float *restrict tile = block + t * ROWS;                                  \
                float acc[TILE];                                                                \
                for (int c = 0; c < TILE; c++)                                                  \
                    acc[c] = partial[t + c];                                                    \
                _Pragma("GCC unroll 8")                                                         \
                for (int r = 0; r < ROWS; r++)                                                  \
                    for (int c = 0; c < TILE; c++)                                              \
                        acc[c] = __builtin_fmaf(xs[r], tile[r * TILE + c], acc[c]);             \
                for (int c = 0; c < TILE; c++)                                                  \
                    partial[t + c] = acc[c];                                                    \
            }                                                                                   \
        }                                                                                       \
    }

typedef void (*slab_fn)(const float *, const float *, float *, long, long);

SLAB_PRODUCT(slab_portable, )
TILED_SLAB_PRODUCT(tiled_portable, )
#ifdef FMA_LOOPS
SLAB_PRODUCT(slab_fma, FMA_ATTRIBUTES)
TILED_SLAB_PRODUCT(tiled_fma, FMA_ATTRIBUTES)

static slab_fn pick_slab(void) { return has_fma() ? slab_fma : slab_portable; }
static slab_fn pick_tiled(void) { return has_fma() ? tiled_fma : tiled_portable; }
#else
static slab_fn pick_slab(void) { return slab_portable; }
static slab_fn pick_tiled(void) { return tiled_portable; }
#endif

/* Read once per call (atomically: a test may switch them meanwhile). */
static slab_fn slab_product, tiled_product;

/* Run the portable loops even where the FMA ones serve (on != 0), or pick again: for the test
 * that both give the same bytes. */
void flashrt_row_product_portable(int on) {
    __atomic_store_n(&slab_product, on ? slab_portable : pick_slab(), __ATOMIC_RELAXED);
    __atomic_store_n(&tiled_product, on ? tiled_portable : pick_tiled(), __ATOMIC_RELAXED);
}

/* Picked when the library is loaded, before any caller can race for it. */
__attribute__((constructor)) static void pick_loops(void) { flashrt_row_product_portable(0); }

/* ``partials`` is scratch of SLABS * n floats; ``threads`` below 1 runs as 1; ``tiled``: W is
 * in the tiled layout, which needs k a multiple of SLABS * ROWS and n of TILE. Returns 0, or -1
 * without touching anything when the shape does not allow the layout. */
int flashrt_row_product(const float *x, const float *w, float *y, float *partials, long k, long n, int threads,
                        int tiled) {
    if (tiled && (k % (SLABS * ROWS) || n % TILE))
        return -1;
    if (threads < 1)   /* as the delta and attention kernels do: OpenMP leaves num_threads(0) undefined */
        threads = 1;
    const slab_fn slab = __atomic_load_n(tiled ? &tiled_product : &slab_product, __ATOMIC_RELAXED);
    const fp_mode mode = get_fp_mode();
#pragma omp parallel num_threads(threads)
    {
        const fp_mode own = get_fp_mode();
        set_fp_mode(mode);
#pragma omp for schedule(static)
        for (int s = 0; s < SLABS; s++) {
            const long first = s * k / SLABS, last = (s + 1) * k / SLABS;
            slab(x + first, w + first * n, partials + s * n, last - first, n);
        }
        set_fp_mode(own);
    }
    for (long j = 0; j < n; j++) {
        float sum = partials[j];
        for (int s = 1; s < SLABS; s++)
            sum += partials[s * n + j];
        y[j] = sum;
    }
    return 0;
}

/* The tiled layout's tile: ROWS rows of TILE columns. */
int flashrt_row_product_tile_rows(void) { return ROWS; }
int flashrt_row_product_tile_columns(void) { return TILE; }

int flashrt_row_product_slabs(void) { return SLABS; }

/* Bumped whenever a change could alter a product's bytes: journals record it. */
int flashrt_row_product_version(void) { return 1; }
