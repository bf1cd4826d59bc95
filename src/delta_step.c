/* One token through a Gated DeltaNet mixer on a CPU, float32: from the row its input projection
 * gives (mixed q|k|v, z, beta, a) to the row its output projection takes. The causal conv and
 * its state, the SiLU, the L2 norms of q and k, the gates, the delta-rule update of the
 * recurrent state and the gated output norm in one call: in torch they are some forty small
 * operations per layer, and at decode sizes each costs more to dispatch than to compute (see
 * flashrt_ros/runtime/delta_step.py).
 *
 * One thread, every sum in a fixed order: the same bytes for any thread count. Loops over the
 * value dimension are elementwise, so vectorising them changes no result.
 */
#include <math.h>

#ifdef __FAST_MATH__
#error "delta_step.c must not be built with -ffast-math: it would reorder the sums its callers rely on"
#endif

/* Everything but the token's row: bound once per layer (flashrt_ros/runtime/delta_step.py). */
struct flashrt_delta_layer {
    float *conv_state;          /* [kernel - 1, conv_dim], oldest row first; updated */
    const float *conv_weight;   /* [kernel, conv_dim] */
    const float *neg_a;         /* [value_heads]: -exp(A_log) */
    const float *dt_bias;       /* [value_heads] */
    float *state;               /* [value_heads, key_dim, value_dim]; updated */
    const float *norm_weight;   /* [value_dim] */
    float *scratch;             /* [conv_dim + value_dim]: the conv's output, then k^T S */
    long conv_dim;
    int kernel, key_heads, value_heads, key_dim, value_dim;
    /* q and k take an RMS norm (eps qk_eps) times these: key_dim^-1/2 makes it an L2 norm, and
     * the queries' own key_dim^-1/2 joins it (key_dim^-1 for queries, key_dim^-1/2 for keys). */
    float q_scale, k_scale;
    float qk_eps, norm_eps;
};

static float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* torch's softplus with beta 1 and threshold 20. */
static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* x * (1 / sqrt(eps + sum(x^2) / n)) * scale, as rms_norm in flashrt_ros/runtime/layers.py. */
static void rms_scale(float *x, int n, float eps, float scale) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++)
        sum += x[i] * x[i];
    const float inverse = 1.0f / sqrtf(eps + sum * (1.0f / (float)n));
    for (int i = 0; i < n; i++)
        x[i] = x[i] * inverse * scale;
}

void flashrt_delta_step(const struct flashrt_delta_layer *layer, const float *row, float *out) {
    const long c = layer->conv_dim;
    const int taps = layer->kernel, hk = layer->key_heads, hv = layer->value_heads;
    const int dk = layer->key_dim, dv = layer->value_dim;
    const float *z = row + c, *beta_in = row + c + (long)hv * dv, *a_in = beta_in + hv;
    float *mixed = layer->scratch, *ks = layer->scratch + c;

    /* The causal conv over the state's rows and this one, oldest first; then the state moves on. */
    for (long ch = 0; ch < c; ch++) {
        float acc = 0.0f;
        for (int t = 0; t < taps - 1; t++)
            acc += layer->conv_state[t * c + ch] * layer->conv_weight[t * c + ch];
        acc += row[ch] * layer->conv_weight[(long)(taps - 1) * c + ch];
        mixed[ch] = acc / (1.0f + expf(-acc));   /* SiLU */
    }
    for (int t = 0; t + 1 < taps - 1; t++)
        for (long ch = 0; ch < c; ch++)
            layer->conv_state[t * c + ch] = layer->conv_state[(t + 1) * c + ch];
    if (taps > 1)
        for (long ch = 0; ch < c; ch++)
            layer->conv_state[(long)(taps - 2) * c + ch] = row[ch];

    float *q = mixed, *k = mixed + (long)hk * dk, *v = mixed + 2L * hk * dk;
    for (int h = 0; h < hk; h++) {
        rms_scale(q + (long)h * dk, dk, layer->qk_eps, layer->q_scale);
        rms_scale(k + (long)h * dk, dk, layer->qk_eps, layer->k_scale);
    }

    /* Per value head: S = decay S; S += k (beta (v - S^T k))^T; o = S^T q. Key head h / group
     * serves value head h. */
    const int group = hv / hk;
    for (int h = 0; h < hv; h++) {
        const float *qh = q + (long)(h / group) * dk, *kh = k + (long)(h / group) * dk, *vh = v + (long)h * dv;
        float *s = layer->state + (long)h * dk * dv, *o = out + (long)h * dv;
        const float decay = expf(layer->neg_a[h] * softplus(a_in[h] + layer->dt_bias[h]));
        const float beta = sigmoid(beta_in[h]);
        for (int j = 0; j < dv; j++)
            ks[j] = 0.0f;
        for (int i = 0; i < dk; i++) {
            float *si = s + (long)i * dv;
            for (int j = 0; j < dv; j++) {
                si[j] *= decay;
                ks[j] += kh[i] * si[j];
            }
        }
        for (int j = 0; j < dv; j++) {
            ks[j] = (vh[j] - ks[j]) * beta;   /* the delta */
            o[j] = 0.0f;
        }
        for (int i = 0; i < dk; i++) {
            float *si = s + (long)i * dv;
            for (int j = 0; j < dv; j++) {
                si[j] += kh[i] * ks[j];
                o[j] += qh[i] * si[j];
            }
        }
        /* The gated output norm: RMS over the head, the weight, then SiLU(z). */
        float sum = 0.0f;
        for (int j = 0; j < dv; j++)
            sum += o[j] * o[j];
        const float inverse = 1.0f / sqrtf(layer->norm_eps + sum * (1.0f / (float)dv));
        const float *zh = z + (long)h * dv;
        for (int j = 0; j < dv; j++)
            o[j] = o[j] * inverse * layer->norm_weight[j] * (zh[j] / (1.0f + expf(-zh[j])));
    }
}

/* Bumped whenever a change could alter a step's bytes: journals record it. */
int flashrt_delta_step_version(void) { return 1; }
