/* The gated delta rule over whole sequences, forward and backward, for training a policy on a
 * CPU; see flashrt_ros/runtime/backends/cpu/delta_train.py for where it is used and why.
 *
 * Per sequence and value head, with S a [dk, dv] state that starts at zero, for each step i:
 *
 *     a = exp(g_i),  r = v_i - a S^T k_i,  delta = beta_i r,  S <- a S + k_i delta^T,  o_i = S^T q_i
 *
 * The forward keeps every state S_0 .. S_t, so that the backward walks the steps in reverse
 * without inverting the decay (a factor near zero would make that unstable). Each sequence-head
 * is one thread's alone from start to end, and every thread works in the caller's floating-point
 * mode (fp_mode.h), so the bytes do not depend on the thread count.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fp_mode.h"

#define MAX_DIM 256   /* dk and dv at most: the per-step vectors live on the stack */

int flashrt_delta_train_version(void) { return 1; }

/* Whether the sizes are in range; a thread count below 1 becomes 1 (OpenMP leaves num_threads(0)
 * undefined). */
static int checked(long n, long t, long dk, long dv, int *threads) {
    if (*threads < 1)
        *threads = 1;
    return n >= 0 && t >= 0 && dk >= 1 && dv >= 1 && dk <= MAX_DIM && dv <= MAX_DIM;
}

/* q, k [n, t, dk]; v [n, t, dv]; g, beta [n, t]; out [n, t, dv]; states [n, t + 1, dk, dv] receives
 * S_0 = 0 .. S_t. Returns 0, or -1 without touching anything when the sizes are out of range. */
int flashrt_delta_train_forward(const float *q, const float *k, const float *v, const float *g,
                                const float *beta, float *out, float *states, long n, long t, long dk,
                                long dv, int threads) {
    if (!checked(n, t, dk, dv, &threads))
        return -1;
    const long area = dk * dv;
    const fp_mode mode = get_fp_mode();
#pragma omp parallel num_threads(threads)
    {
        const fp_mode own = get_fp_mode();
        set_fp_mode(mode);
#pragma omp for schedule(static)
        for (long h = 0; h < n; h++) {
            float *s = states + h * (t + 1) * area;
            memset(s, 0, (size_t)area * sizeof(float));
            for (long i = 0; i < t; i++) {
                const long at = h * t + i;
                const float *qi = q + at * dk, *ki = k + at * dk, *vi = v + at * dv;
                const float a = expf(g[at]), b = beta[at];
                const float *prev = s + i * area;
                float *next = s + (i + 1) * area, *o = out + at * dv;
                float delta[MAX_DIM];
                for (long j = 0; j < dv; j++)
                    delta[j] = 0.0f;
                for (long r = 0; r < dk; r++)
                    for (long j = 0; j < dv; j++)
                        delta[j] += prev[r * dv + j] * ki[r];
                for (long j = 0; j < dv; j++) {
                    delta[j] = b * (vi[j] - a * delta[j]);
                    o[j] = 0.0f;
                }
                for (long r = 0; r < dk; r++)
                    for (long j = 0; j < dv; j++) {
                        const float x = a * prev[r * dv + j] + ki[r] * delta[j];
                        next[r * dv + j] = x;
                        o[j] += x * qi[r];
                    }
            }
        }
        set_fp_mode(own);
    }
    return 0;
}

/* The gradients of a loss with respect to q, k, v, g and beta (dq .. dbeta, shaped as their
 * inputs, overwritten), given its gradient dout with respect to out and the states the forward
 * kept; the final state is taken to carry no gradient. Returns 0, -1 as the forward does, or -2
 * when a thread could not allocate its work space (the gradients are then incomplete). */
int flashrt_delta_train_backward(const float *q, const float *k, const float *v, const float *g,
                                 const float *beta, const float *states, const float *dout, float *dq,
                                 float *dk_out, float *dv_out, float *dg, float *dbeta, long n, long t,
                                 long dk, long dv, int threads) {
    if (!checked(n, t, dk, dv, &threads))
        return -1;
    const long area = dk * dv;
    const fp_mode mode = get_fp_mode();
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        const fp_mode own = get_fp_mode();
        set_fp_mode(mode);
        float *ds = malloc((size_t)area * sizeof(float));   /* dLoss/dS for the state after step i */
        if (ds == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long h = 0; h < n; h++) {
            if (ds == NULL)
                continue;
            memset(ds, 0, (size_t)area * sizeof(float));
            const float *s = states + h * (t + 1) * area;
            for (long i = t - 1; i >= 0; i--) {
                const long at = h * t + i;
                const float *qi = q + at * dk, *ki = k + at * dk, *vi = v + at * dv, *doi = dout + at * dv;
                const float a = expf(g[at]), b = beta[at];
                const float *prev = s + i * area, *next = s + (i + 1) * area;
                float r[MAX_DIM], delta[MAX_DIM], ddelta[MAX_DIM], e[MAX_DIM], dk_row[MAX_DIM];
                for (long j = 0; j < dv; j++) {
                    r[j] = 0.0f;
                    ddelta[j] = 0.0f;
                }
                for (long x = 0; x < dk; x++)
                    for (long j = 0; j < dv; j++)
                        r[j] += prev[x * dv + j] * ki[x];
                for (long j = 0; j < dv; j++) {
                    r[j] = vi[j] - a * r[j];
                    delta[j] = b * r[j];
                }
                /* o_i = S_i^T q_i: the state after the step gains q_i dout_i^T. Then S_i = a S +
                 * k delta^T gives delta's and k's gradients through the write. */
                for (long x = 0; x < dk; x++) {
                    float dqx = 0.0f, dkx = 0.0f;
                    for (long j = 0; j < dv; j++) {
                        const float d = ds[x * dv + j] + qi[x] * doi[j];
                        ds[x * dv + j] = d;
                        dqx += next[x * dv + j] * doi[j];
                        ddelta[j] += d * ki[x];
                        dkx += d * delta[j];
                    }
                    dq[at * dk + x] = dqx;
                    dk_row[x] = dkx;
                }
                float dbeta_i = 0.0f;
                for (long j = 0; j < dv; j++) {
                    dbeta_i += ddelta[j] * r[j];
                    e[j] = b * ddelta[j];
                    dv_out[at * dv + j] = e[j];
                }
                dbeta[at] = dbeta_i;
                /* r = v - (a S)^T k: the decayed state gains -k e^T, k gains -(a S) e; then the
                 * decay: dS_before = a dP, da = <dP, S_before>. */
                float da = 0.0f;
                for (long x = 0; x < dk; x++) {
                    float pe = 0.0f;
                    for (long j = 0; j < dv; j++) {
                        const float p = prev[x * dv + j];
                        const float dp = ds[x * dv + j] - ki[x] * e[j];
                        pe += p * e[j];
                        da += dp * p;
                        ds[x * dv + j] = a * dp;
                    }
                    dk_out[at * dk + x] = dk_row[x] - a * pe;
                }
                dg[at] = da * a;
            }
        }
        free(ds);
        set_fp_mode(own);
    }
    return failed ? -2 : 0;
}
