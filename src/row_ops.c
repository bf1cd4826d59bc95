/* The small float32 operations between a decode step's products on a CPU, for one row: RMS
 * norms, the residual add fused with the norm after it, and SwiGLU's SiLU(gate) * up (see
 * flashrt_ros/runtime/row_ops.py). One thread (rows of a few thousand floats), every sum in a
 * fixed order: the same bytes for any thread count.
 */
#include <math.h>

#ifdef __FAST_MATH__
#error "row_ops.c must not be built with -ffast-math: it would reorder the sums its callers rely on"
#endif

/* out = x * (1 / sqrt(eps + sum(x^2) / n)) * scale, as rms_norm in flashrt_ros/runtime/layers.py. */
void flashrt_rms_norm(const float *x, const float *scale, float eps, long n, float *out) {
    float sum = 0.0f;
    for (long i = 0; i < n; i++)
        sum += x[i] * x[i];
    const float inverse = 1.0f / sqrtf(eps + sum * (1.0f / (float)n));
    for (long i = 0; i < n; i++)
        out[i] = x[i] * inverse * scale[i];
}

/* sum = x + h, then normed = rms_norm(sum): a block's residual and the norm that follows it. */
void flashrt_add_rms_norm(const float *x, const float *h, const float *scale, float eps, long n, float *sum,
                          float *normed) {
    for (long i = 0; i < n; i++)
        sum[i] = x[i] + h[i];
    flashrt_rms_norm(sum, scale, eps, n, normed);
}

/* out = SiLU(gate) * up, with gate_up = [gate | up], n each. */
void flashrt_silu_mul(const float *gate_up, long n, float *out) {
    for (long i = 0; i < n; i++) {
        const float g = gate_up[i];
        out[i] = g / (1.0f + expf(-g)) * gate_up[n + i];
    }
}

/* Bumped whenever a change could alter a result's bytes: journals record it. */
int flashrt_row_ops_version(void) { return 1; }
