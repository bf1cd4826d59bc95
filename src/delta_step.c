/* Tokens through a Gated DeltaNet mixer on a CPU, float32: from the rows its input projection
 * gives (mixed q|k|v, z, beta, a) to the rows its output projection takes. The causal conv and
 * its state, the SiLU, the L2 norms of q and k, the gates, the delta-rule update of the
 * recurrent state and the gated output norm in one call (see flashrt_ros/runtime/delta_step.py).
 * One token is a decode step: in torch some forty small operations per layer, each costing more
 * to dispatch than to compute. Many are a prefill: the rule runs token after token, as in
 * decode. On a CPU that is cheaper than the chunked form torch uses (gated_delta.chunked): a
 * head's state (key_dim x value_dim floats, 16 KiB at 64 x 64) stays in the L1 cache, and each
 * token costs two passes over it, where the chunked form multiplies several chunk-sized
 * matrices per chunk and solves a triangular system to run in parallel on a GPU.
 *
 * Threads take whole channels (the conv), whole tokens (the norms) or whole value heads (the
 * rule), with the caller's floating-point mode, and every sum runs in a fixed order: the same
 * bytes for any thread count, and a token's bytes are the same whether it comes alone (decode)
 * or in a prefill. Loops over channels or the value dimension are elementwise and sums over a
 * head keep LANES partial sums in a fixed pattern, so vectorising changes no result; fmaf
 * rounds once wherever it runs.
 */
#include <math.h>
#include <string.h>

#include "fma_loops.h"
#include "fp_mode.h"

#ifdef __FAST_MATH__
#error "delta_step.c must not be built with -ffast-math: it would reorder the sums its callers rely on"
#endif

#define LANES 8
#define BLOCK 16      /* value columns whose sums stay in registers through a pass over the state */
#define CHANNELS 64   /* conv channels per unit of work */
#define TOKENS 16     /* tokens per unit of the norms' work */

/* Everything but the tokens' rows: bound once per layer (flashrt_ros/runtime/delta_step.py). */
struct flashrt_delta_layer {
    float *conv_state;          /* [kernel - 1, conv_dim], oldest row first; updated */
    const float *conv_weight;   /* [kernel, conv_dim] */
    const float *neg_a;         /* [value_heads]: -exp(A_log) */
    const float *dt_bias;       /* [value_heads] */
    float *state;               /* [value_heads, key_dim, value_dim]; updated */
    const float *norm_weight;   /* [value_dim] */
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

/* The helpers below are inlined into both copies of each loop (see below), so that their fmaf
 * is one instruction where the copy is built for FMA. */
#define INLINE static inline __attribute__((always_inline))

INLINE float sum_squares(const float *x, int n) {
    float lane[LANES] = {0.0f};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++)
            lane[l] = __builtin_fmaf(x[i + l], x[i + l], lane[l]);
    for (; i < n; i++)
        lane[i % LANES] = __builtin_fmaf(x[i], x[i], lane[i % LANES]);
    float sum = 0.0f;
    for (int l = 0; l < LANES; l++)
        sum += lane[l];
    return sum;
}

/* x * (1 / sqrt(eps + sum(x^2) / n)) * scale, as rms_norm in flashrt_ros/runtime/layers.py. */
INLINE void rms_scale(float *x, int n, float eps, float scale) {
    const float inverse = 1.0f / sqrtf(eps + sum_squares(x, n) * (1.0f / (float)n));
    for (int i = 0; i < n; i++)
        x[i] = x[i] * inverse * scale;
}

/* e^x within one unit in the last place (0.92 at worst over [-87, 88]), in arithmetic alone so
 * that a loop of them vectorises (libm's expf is a call per element: it took half the conv's
 * time). x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^7 (the next term is
 * under 1e-8 relative), times 2^n built in the exponent bits. Arguments are clamped to
 * [-87, 88], where 2^n stays a normal float: SiLU, its one caller, needs no more. */
INLINE float exp_inline(float x) {
    x = x > -87.0f ? x : -87.0f;
    x = x < 88.0f ? x : 88.0f;
    const float round = 12582912.0f;   /* 1.5 * 2^23: adding it rounds to an integer */
    const float n = (x * 1.44269504088896341f + round) - round;
    float r = __builtin_fmaf(n, -0.693145751953125f, x);        /* ln2 in two parts, the first */
    r = __builtin_fmaf(n, -1.428606765330187045e-06f, r);       /* exact in n * it */
    float p = 1.0f / 5040.0f;
    p = __builtin_fmaf(p, r, 1.0f / 720.0f);
    p = __builtin_fmaf(p, r, 1.0f / 120.0f);
    p = __builtin_fmaf(p, r, 1.0f / 24.0f);
    p = __builtin_fmaf(p, r, 1.0f / 6.0f);
    p = __builtin_fmaf(p, r, 0.5f);
    p = __builtin_fmaf(p, r, 1.0f);
    p = __builtin_fmaf(p, r, 1.0f);
    const int bits = ((int)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* Below -88, e^-x is past what exp_inline serves: SiLU is then under 6e-37 in magnitude, and -0
 * here (torch gives -0 from about -88.7 down, and NaN at -inf, as this does). */
INLINE float silu(float x) { return x < -88.0f ? x * 0.0f : x / (1.0f + exp_inline(-x)); }

/* The loops that carry the work, compiled twice on x86 (see fma_loops.h) and chosen when the
 * library loads. */

/* Channels [from, to) of the causal conv and its SiLU for tokens [0, n), into ``mixed``
 * [n, conv_dim]; then those channels of the conv state move on. Token t reads the window rows
 * t .. t + kernel - 1 of [state rows | input rows], oldest first. */
#define CONV_CHANNELS(NAME, ATTRIBUTES)                                                           \
    ATTRIBUTES static void NAME(const struct flashrt_delta_layer *layer, const float *rows, long width, \
                                long n, float *mixed, long from, long to) {                        \
        const long c = layer->conv_dim;                                                            \
        const int taps = layer->kernel, kept = taps - 1;                                           \
        const float *restrict w = layer->conv_weight;                                              \
        for (long t = 0; t < n; t++) {                                                             \
            float *restrict m = mixed + t * c;                                                     \
            for (long ch = from; ch < to; ch++)                                                    \
                m[ch] = 0.0f;                                                                      \
            for (int tap = 0; tap < taps; tap++) {                                                 \
                const long src = t - kept + tap;                                                   \
                const float *restrict x = src < 0 ? layer->conv_state + (kept + src) * c : rows + src * width; \
                const float *restrict wt = w + (long)tap * c;                                      \
                _Pragma("omp simd")                                                                \
                for (long ch = from; ch < to; ch++)                                                \
                    m[ch] = __builtin_fmaf(x[ch], wt[ch], m[ch]);                                  \
            }                                                                                      \
            _Pragma("omp simd")                                                                    \
            for (long ch = from; ch < to; ch++)                                                    \
                m[ch] = silu(m[ch]);                                                               \
        }                                                                                          \
        /* Row r of the new state is row n + r of the window: read before it is overwritten. */   \
        for (int r = 0; r < kept; r++) {                                                           \
            const long src = n + r - kept;                                                         \
            const float *src_row = src < 0 ? layer->conv_state + (kept + src) * c : rows + src * width; \
            float *s = layer->conv_state + (long)r * c;                                            \
            for (long ch = from; ch < to; ch++)                                                    \
                s[ch] = src_row[ch];                                                               \
        }                                                                                          \
    }

/* The L2 norms (RMS norms with their scales) of q and k, for tokens [from, to). */
#define NORM_TOKENS(NAME, ATTRIBUTES)                                                             \
    ATTRIBUTES static void NAME(const struct flashrt_delta_layer *layer, float *mixed, long from, long to) { \
        const long c = layer->conv_dim;                                                            \
        const int hk = layer->key_heads, dk = layer->key_dim;                                      \
        for (long t = from; t < to; t++)                                                           \
            for (int h = 0; h < hk; h++) {                                                         \
                rms_scale(mixed + t * c + (long)h * dk, dk, layer->qk_eps, layer->q_scale);        \
                rms_scale(mixed + t * c + (long)(hk + h) * dk, dk, layer->qk_eps, layer->k_scale); \
            }                                                                                      \
    }

/* Value head h over tokens [0, n): per token S = decay S; delta = beta (v - S^T k);
 * S += k delta^T; o = S^T q; then the gated output norm (RMS over the head, the weight, SiLU(z))
 * into ``out`` [n, value_heads * value_dim]. Each column's sums run over the key rows in order;
 * a BLOCK of columns keeps its sums in registers through a pass. */
#define HEAD_TOKENS(NAME, ATTRIBUTES)                                                             \
    ATTRIBUTES static void NAME(const struct flashrt_delta_layer *layer, const float *rows, long width, \
                                const float *mixed, long n, int h, float *out) {                   \
        const long c = layer->conv_dim;                                                            \
        const int hk = layer->key_heads, hv = layer->value_heads, dk = layer->key_dim, dv = layer->value_dim; \
        const int group = hv / hk;                                                                 \
        float *restrict s = layer->state + (long)h * dk * dv;                                      \
        float delta[dv];                                                                           \
        for (long t = 0; t < n; t++) {                                                             \
            const float *restrict m = mixed + t * c;                                               \
            const float *restrict q = m + (long)(h / group) * dk;                                  \
            const float *restrict k = m + (long)(hk + h / group) * dk;                             \
            const float *restrict v = m + 2L * hk * dk + (long)h * dv;                             \
            const float *row = rows + t * width;                                                   \
            const float *restrict z = row + c + (long)h * dv;                                      \
            const float decay = expf(layer->neg_a[h] * softplus(row[c + (long)hv * dv + hv + h] + layer->dt_bias[h])); \
            const float beta = sigmoid(row[c + (long)hv * dv + h]);                                \
            float *restrict o = out + t * (long)hv * dv + (long)h * dv;                            \
            int j0 = 0;                                                                            \
            for (; j0 + BLOCK <= dv; j0 += BLOCK) {                                                \
                float acc[BLOCK] = {0.0f};                                                         \
                for (int i = 0; i < dk; i++) {                                                     \
                    float *restrict si = s + (long)i * dv + j0;                                    \
                    const float ki = k[i];                                                         \
                    _Pragma("omp simd")                                                            \
                    for (int j = 0; j < BLOCK; j++) {                                              \
                        const float x = si[j] * decay;                                             \
                        si[j] = x;                                                                 \
                        acc[j] = __builtin_fmaf(ki, x, acc[j]);                                    \
                    }                                                                              \
                }                                                                                  \
                for (int j = 0; j < BLOCK; j++)                                                    \
                    delta[j0 + j] = (v[j0 + j] - acc[j]) * beta;                                   \
            }                                                                                      \
            for (int j = j0; j < dv; j++) {                                                        \
                float acc = 0.0f;                                                                  \
                for (int i = 0; i < dk; i++) {                                                     \
                    s[(long)i * dv + j] *= decay;                                                  \
                    acc = __builtin_fmaf(k[i], s[(long)i * dv + j], acc);                          \
                }                                                                                  \
                delta[j] = (v[j] - acc) * beta;                                                    \
            }                                                                                      \
            for (j0 = 0; j0 + BLOCK <= dv; j0 += BLOCK) {                                          \
                float acc[BLOCK] = {0.0f};                                                         \
                const float *restrict d = delta + j0;                                              \
                for (int i = 0; i < dk; i++) {                                                     \
                    float *restrict si = s + (long)i * dv + j0;                                    \
                    const float ki = k[i], qi = q[i];                                              \
                    _Pragma("omp simd")                                                            \
                    for (int j = 0; j < BLOCK; j++) {                                              \
                        const float x = __builtin_fmaf(ki, d[j], si[j]);                           \
                        si[j] = x;                                                                 \
                        acc[j] = __builtin_fmaf(qi, x, acc[j]);                                    \
                    }                                                                              \
                }                                                                                  \
                for (int j = 0; j < BLOCK; j++)                                                    \
                    o[j0 + j] = acc[j];                                                            \
            }                                                                                      \
            for (int j = j0; j < dv; j++) {                                                        \
                float acc = 0.0f;                                                                  \
                for (int i = 0; i < dk; i++) {                                                     \
                    s[(long)i * dv + j] = __builtin_fmaf(k[i], delta[j], s[(long)i * dv + j]);     \
                    acc = __builtin_fmaf(q[i], s[(long)i * dv + j], acc);                          \
                }                                                                                  \
                o[j] = acc;                                                                        \
            }                                                                                      \
            const float inverse = 1.0f / sqrtf(layer->norm_eps + sum_squares(o, dv) * (1.0f / (float)dv)); \
            _Pragma("omp simd")                                                                    \
            for (int j = 0; j < dv; j++)                                                           \
                o[j] = o[j] * inverse * layer->norm_weight[j] * silu(z[j]);                        \
        }                                                                                          \
    }

typedef void (*conv_fn)(const struct flashrt_delta_layer *, const float *, long, long, float *, long, long);
typedef void (*norm_fn)(const struct flashrt_delta_layer *, float *, long, long);
typedef void (*head_fn)(const struct flashrt_delta_layer *, const float *, long, const float *, long, int,
                        float *);

CONV_CHANNELS(conv_portable, )
NORM_TOKENS(norm_portable, )
HEAD_TOKENS(head_portable, )
#ifdef FMA_LOOPS
CONV_CHANNELS(conv_fma, FMA_ATTRIBUTES)
NORM_TOKENS(norm_fma, FMA_ATTRIBUTES)
HEAD_TOKENS(head_fma, FMA_ATTRIBUTES)
#else
#define conv_fma conv_portable
#define norm_fma norm_portable
#define head_fma head_portable
#endif

/* The loops in use, read once per call (atomically: a test may switch them meanwhile). */
static struct loops { conv_fn conv; norm_fn norm; head_fn head; } const fma_loops = {conv_fma, norm_fma, head_fma},
    portable_loops = {conv_portable, norm_portable, head_portable};
static const struct loops *loops = &portable_loops;

/* Run the portable loops even where the FMA ones serve (on != 0), or pick again: for the test
 * that both give the same bytes. */
void flashrt_delta_portable(int on) {
    __atomic_store_n(&loops, !on && has_fma() ? &fma_loops : &portable_loops, __ATOMIC_RELAXED);
}

/* Picked when the library is loaded, before any caller can race for it. */
__attribute__((constructor)) static void pick_loops(void) { flashrt_delta_portable(0); }

/* ``rows`` [n, width]: mixed | z | beta | a per token (width >= conv_dim + value_heads * (value_dim
 * + 2); the rest of a row is not read); ``mixed`` scratch [n, conv_dim]; ``out`` [n, value_heads
 * * value_dim]; ``threads`` >= 1; every dimension of the layer >= 1. */
void flashrt_delta_rows(const struct flashrt_delta_layer *layer, const float *rows, long width, long n,
                        float *mixed, float *out, int threads) {
    const long c = layer->conv_dim, units = (c + CHANNELS - 1) / CHANNELS;
    const struct loops *use = __atomic_load_n(&loops, __ATOMIC_RELAXED);
    if (threads < 1)
        threads = 1;
    const fp_mode mode = get_fp_mode();
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const fp_mode own = get_fp_mode();
        set_fp_mode(mode);
#pragma omp for schedule(static)
        for (long u = 0; u < units; u++)
            use->conv(layer, rows, width, n, mixed, u * CHANNELS, u + 1 < units ? (u + 1) * CHANNELS : c);
#pragma omp for schedule(static)
        for (long u = 0; u < (n + TOKENS - 1) / TOKENS; u++)
            use->norm(layer, mixed, u * TOKENS, (u + 1) * TOKENS < n ? (u + 1) * TOKENS : n);
#pragma omp for schedule(static)
        for (int h = 0; h < layer->value_heads; h++)
            use->head(layer, rows, width, mixed, n, h, out);
        set_fp_mode(own);
    }
}

/* Bumped whenever a change could alter the bytes of a step or of a prefill: journals record it. */
int flashrt_delta_step_version(void) { return 2; }
