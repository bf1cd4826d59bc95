/* dst[j * ld + i] = (float) src[i * stride + j]: a checkpoint's [out, in] matrix, stored in float32
 * or bfloat16, written into columns of a float32 [in, out] weight, in one pass; see
 * flashrt_ros/runtime/backends/cpu/transpose_cast.py for why torch's copies are not enough.
 *
 * Both conversions are exact (a bfloat16 is the top half of the float32 of the same value), so
 * the bytes written depend on nothing but the source. The matrix is walked in TILE x TILE tiles,
 * so that each tile's source rows and destination rows stay in cache while it is turned; threads
 * take whole bands of TILE destination rows and never write the same memory.
 */
#include <stdint.h>
#include <string.h>

#define TILE 32

static inline float from_bf16(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* src [rows, cols] with rows ``stride`` elements apart (stride >= cols when rows > 1); dst has
 * ``ld`` floats per row (ld >= rows) and receives the transpose in its first ``rows`` columns.
 * ``bf16`` != 0: src holds bfloat16, else float32. ``threads`` below 1 runs as 1. Returns 0, or
 * -1 without touching anything when a size or stride cannot describe such matrices. */
int flashrt_transpose_cast(const void *src, int bf16, long rows, long cols, long stride, float *dst, long ld,
                           int threads) {
    if (rows < 0 || cols < 0 || (rows > 1 && stride < cols) || ld < rows)
        return -1;
    if (threads < 1)   /* OpenMP leaves num_threads(0) undefined */
        threads = 1;
    const long bands = (cols + TILE - 1) / TILE;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long band = 0; band < bands; band++) {
        const long j0 = band * TILE, j1 = j0 + TILE < cols ? j0 + TILE : cols;
        for (long i0 = 0; i0 < rows; i0 += TILE) {
            const long i1 = i0 + TILE < rows ? i0 + TILE : rows;
            if (bf16) {
                const uint16_t *s = (const uint16_t *)src;
                for (long j = j0; j < j1; j++)
                    for (long i = i0; i < i1; i++)
                        dst[j * ld + i] = from_bf16(s[i * stride + j]);
            } else {
                const float *s = (const float *)src;
                for (long j = j0; j < j1; j++)
                    for (long i = i0; i < i1; i++)
                        dst[j * ld + i] = s[i * stride + j];
            }
        }
    }
    return 0;
}

/* Bumped whenever a change could alter the bytes written. Journals do not record it: the
 * conversions are exact, so every version writes what torch's copies write. */
int flashrt_transpose_cast_version(void) { return 1; }
