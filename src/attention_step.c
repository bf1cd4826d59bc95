/* One token through a gated full-attention layer on a CPU, float32: from the row its input
 * projection gives (q|k, gate, v) to the row its output projection takes. The per-head RMS
 * norms of q and k, partial RoPE, the K and V rows written at the position, attention over
 * the rows so far (query heads grouped over fewer KV heads) and the sigmoid gate, in one call:
 * in torch they are some twenty operations per layer, plus a copy of the keys to multiply them
 * (see flashrt_ros/runtime/attention_step.py).
 *
 * Threads take whole KV heads, with the caller's floating-point mode, and every sum runs in a
 * fixed order: the same bytes for any thread count. Dot products keep eight partial sums in a
 * fixed pattern, so the compiler may vectorise them without changing a result. The MTP layer's
 * K and V rows, which nothing attends over yet, take the same norm and RoPE (flashrt_kv_rows).
 */
#include <math.h>
#include <stdint.h>

#include "fp_mode.h"

#ifdef __FAST_MATH__
#error "attention_step.c must not be built with -ffast-math: it would reorder the sums its callers rely on"
#endif

#define LANES 8

/* Everything but the token's row: bound once per layer (flashrt_ros/runtime/attention_step.py). */
struct flashrt_attention_layer {
    float *keys, *values;       /* row 0 of the layer's K and V caches, [rows, kv_heads, head_dim] each */
    long row_stride;            /* floats from one cache row to the next */
    long rows;                  /* the caches' capacity */
    const int64_t *position;    /* the arena's position counter: this token's row */
    const float *norm;          /* [heads + kv_heads, head_dim]: 1 + w of q_norm, then of k_norm */
    const float *cos, *sin;     /* [rows, rotary] */
    float *scores;              /* scratch [heads, rows] */
    float *qk;                  /* scratch [(heads + kv_heads) * head_dim] */
    int heads, kv_heads, head_dim, rotary;
    float eps, scale;
};

/* Cache rows are far apart (every layer's K and V rows of a position lie together), which the
 * hardware prefetchers follow poorly: K and V were read at ~1 GB/s at 16k rows without this. */
#ifndef AHEAD
#define AHEAD 32   /* rows */
#endif
static void prefetch_row(const float *row, int d) {
    for (int i = 0; i < d; i += 16)
        __builtin_prefetch(row + i, 0, 3);
}

static float dot(const float *a, const float *b, int n) {
    float lane[LANES] = {0.0f};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++)
            lane[l] += a[i + l] * b[i + l];
    for (; i < n; i++)
        lane[i % LANES] += a[i] * b[i];
    float sum = 0.0f;
    for (int l = 0; l < LANES; l++)
        sum += lane[l];
    return sum;
}

/* KV head g and the query heads it serves, over rows [0, pos]: its K and V rows are read once,
 * by one thread. */
static void attend_kv_head(const struct flashrt_attention_layer *layer, const float *gate, float *out, long pos,
                           int g) {
    const int d = layer->head_dim, group = layer->heads / layer->kv_heads;
    float *scores = layer->scores + (long)g * group * layer->rows;   /* [group, pos + 1] */
    const float *q = layer->qk + (long)g * group * d;
    for (long t = 0; t <= pos; t++) {
        const float *kt = layer->keys + t * layer->row_stride + (long)g * d;
        if (t + AHEAD <= pos)
            prefetch_row(kt + AHEAD * layer->row_stride, d);
        for (int h = 0; h < group; h++)
            scores[h * layer->rows + t] = dot(q + (long)h * d, kt, d) * layer->scale;
    }
    for (int h = 0; h < group; h++) {
        float *s = scores + h * layer->rows, top = -INFINITY, total = 0.0f;
        for (long t = 0; t <= pos; t++)
            top = s[t] > top ? s[t] : top;
        for (long t = 0; t <= pos; t++) {
            s[t] = expf(s[t] - top);
            total += s[t];
        }
        for (long t = 0; t <= pos; t++)
            s[t] = s[t] / total;
        float *o = out + (long)(g * group + h) * d;
        for (int j = 0; j < d; j++)
            o[j] = 0.0f;
    }
    for (long t = 0; t <= pos; t++) {
        const float *vt = layer->values + t * layer->row_stride + (long)g * d;
        if (t + AHEAD <= pos)
            prefetch_row(vt + AHEAD * layer->row_stride, d);
        for (int h = 0; h < group; h++) {
            const float p = scores[h * layer->rows + t];
            float *o = out + (long)(g * group + h) * d;
            for (int j = 0; j < d; j++)
                o[j] += p * vt[j];
        }
    }
    for (int h = 0; h < group; h++) {
        float *o = out + (long)(g * group + h) * d;
        const float *gh = gate + (long)(g * group + h) * d;
        for (int j = 0; j < d; j++)
            o[j] = o[j] * (1.0f / (1.0f + expf(-gh[j])));
    }
}

/* RMS norm of the first ``heads`` heads of ``row`` into the layer's qk scratch (norm weights
 * row by row), then RoPE on each one's first ``rotary`` features at position ``pos``. */
static void norm_rope_heads(const struct flashrt_attention_layer *layer, const float *row, int heads, long pos) {
    const int d = layer->head_dim, rot = layer->rotary, half = rot / 2;
    const float *cos = layer->cos + pos * rot, *sin = layer->sin + pos * rot;
    for (int h = 0; h < heads; h++) {
        const float *x = row + (long)h * d, *w = layer->norm + (long)h * d;
        float *y = layer->qk + (long)h * d;
        float sum = 0.0f;
        for (int i = 0; i < d; i++)
            sum += x[i] * x[i];
        const float inverse = 1.0f / sqrtf(layer->eps + sum * (1.0f / (float)d));
        for (int i = 0; i < d; i++)
            y[i] = x[i] * inverse * w[i];
        float rotated[rot > 0 ? rot : 1];
        for (int i = 0; i < rot; i++)
            rotated[i] = i < half ? -y[i + half] : y[i - half];
        for (int i = 0; i < rot; i++)
            y[i] = y[i] * cos[i] + rotated[i] * sin[i];
    }
}

/* This token's K and V rows at ``pos``. */
static void write_kv_rows(const struct flashrt_attention_layer *layer, const float *k, const float *v, long pos) {
    float *k_row = layer->keys + pos * layer->row_stride, *v_row = layer->values + pos * layer->row_stride;
    for (long i = 0; i < (long)layer->kv_heads * layer->head_dim; i++) {
        k_row[i] = k[i];
        v_row[i] = v[i];
    }
}

/* A layer whose K and V rows are kept but never attended over here (the MTP layer's, until
 * speculative decoding reads them): ``row`` = k | v, and the layer's norm is the k norm's rows
 * alone (``heads`` 0). Returns 0, or -1 without touching anything when the position is outside
 * the caches. */
int flashrt_kv_rows(const struct flashrt_attention_layer *layer, const float *row) {
    const long pos = *layer->position;
    if (pos < 0 || pos >= layer->rows)
        return -1;
    norm_rope_heads(layer, row, layer->kv_heads, pos);
    write_kv_rows(layer, layer->qk, row + (long)layer->kv_heads * layer->head_dim, pos);
    return 0;
}

/* Returns 0, or -1 without touching anything when the position is outside the caches. */
int flashrt_attention_step(const struct flashrt_attention_layer *layer, const float *row, float *out,
                           int threads) {
    const int hq = layer->heads, hkv = layer->kv_heads, d = layer->head_dim;
    if (threads < 1)
        threads = 1;
    const long pos = *layer->position;
    const float *gate = row + (long)(hq + hkv) * d, *v = gate + (long)hq * d;
    if (pos < 0 || pos >= layer->rows)
        return -1;

    norm_rope_heads(layer, row, hq + hkv, pos);
    write_kv_rows(layer, layer->qk + (long)hq * d, v, pos);
    /* Threads take whole KV heads: no head's sums depend on which thread ran it. */
    const fp_mode mode = get_fp_mode();
#pragma omp parallel num_threads(threads)
    {
        const fp_mode own = get_fp_mode();
        set_fp_mode(mode);
#pragma omp for schedule(static)
        for (int g = 0; g < hkv; g++)
            attend_kv_head(layer, gate, out, pos, g);
        set_fp_mode(own);
    }
    return 0;
}

/* Bumped whenever a change could alter a step's bytes: journals record it. */
int flashrt_attention_step_version(void) { return 1; }
