/* Fused element-wise steps of a decoder layer on CPU (see cpu_kernels.py).
 *
 * Each replaces a chain of small torch ops (each one a dispatch, a fresh tensor
 * and a pass over memory) with one pass:
 *   dpserve_add_rms_norm: residual += delta (optional), out = rms_norm(residual) * w
 *   dpserve_rotary_kv:    RoPE on the step's q and k heads into one [T, H + KV, d]
 *                         buffer, and the rotated k and the v written to their
 *                         slots of the paged KV cache
 * Tensors are float32 or bfloat16 (one dtype for all); arithmetic is float32 and a
 * bfloat16 result is rounded (nearest even) where torch's ops round theirs: the
 * residual after the add, the normalised row before the weight, each output.
 *
 * Built by cpu_kernels.py with the host compiler, -O3 -march=native -fopenmp.
 */
#include <math.h>

#include "cpu_kernels.h"

#define PARALLEL_MIN 65536 /* elements below which one thread does it all */

static inline float load1(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store1(void *p, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

static inline float to_dtype(float v, int bf16) {
    return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v;
}

static inline v16f to_dtype16(v16f v, int bf16) {
    return bf16 ? round_bf16(v) : v;
}

/* One row of n values (see dpserve_add_rms_norm). */
static void add_rms_norm_row(void *res, const void *delta, const void *w, void *out,
                             int64_t n, float eps, int bf16) {
    size_t es = bf16 ? 2 : 4;
    char *r = res;
    const char *d = delta, *wp = w;
    char *o = out;
    v16f acc = {0};
    float tail = 0.0f;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        v16f x = load16(r + i * es, bf16);
        if (d) {
            x = to_dtype16(x + load16(d + i * es, bf16), bf16);
            store16(r + i * es, x, bf16);
        }
        acc += x * x;
    }
    for (; i < n; i++) {
        float x = load1(r, i, bf16);
        if (d) {
            x = to_dtype(x + load1(d, i, bf16), bf16);
            store1(r, i, x, bf16);
        }
        tail += x * x;
    }
    float sum = tail;
    for (int j = 0; j < 16; j++)
        sum += acc[j];
    float inv = 1.0f / sqrtf(sum / (float)n + eps);
    for (i = 0; i + 16 <= n; i += 16) {
        v16f x = to_dtype16(load16(r + i * es, bf16) * inv, bf16);
        store16(o + i * es, x * load16(wp + i * es, bf16), bf16);
    }
    for (; i < n; i++)
        store1(o, i, to_dtype(load1(r, i, bf16) * inv, bf16) * load1(w, i, bf16), bf16);
}

/* residual, out: [rows, n] contiguous; delta: [rows, n] contiguous or NULL; w: [n].
 * residual += delta (rounded to the dtype), then
 * out = residual / sqrt(mean(residual^2) + eps) * w. Returns 0. */
int dpserve_add_rms_norm(void *residual, const void *delta, const void *w, void *out,
                         int bf16, int64_t rows, int64_t n, float eps, int threads) {
    size_t row_bytes = (size_t)n * (bf16 ? 2 : 4);
    if (threads < 1 || rows * n < PARALLEL_MIN)
        threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t m = 0; m < rows; m++)
        add_rms_norm_row((char *)residual + m * row_bytes,
                         delta ? (const char *)delta + m * row_bytes : NULL, w,
                         (char *)out + m * row_bytes, n, eps, bf16);
    return 0;
}

/* x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin over the halves of one head. */
static void rotate_head(const char *x, const char *c, const char *s, char *out, int64_t half,
                        int bf16) {
    size_t es = bf16 ? 2 : 4;
    int64_t i = 0;
    for (; i + 16 <= half; i += 16) {
        v16f x1 = load16(x + i * es, bf16), x2 = load16(x + (half + i) * es, bf16);
        v16f cv = load16(c + i * es, bf16), sv = load16(s + i * es, bf16);
        store16(out + i * es, x1 * cv - x2 * sv, bf16);
        store16(out + (half + i) * es, x2 * cv + x1 * sv, bf16);
    }
    for (; i < half; i++) {
        float x1 = load1(x, i, bf16), x2 = load1(x, half + i, bf16);
        float cv = load1(c, i, bf16), sv = load1(s, i, bf16);
        store1(out, i, x1 * cv - x2 * sv, bf16);
        store1(out, half + i, x2 * cv + x1 * sv, bf16);
    }
}

/* qkv: [T, (heads + 2 kv_heads) * d], row stride qkv_stride elements (q | k | v heads);
 * cos, sin: [T, d / 2] contiguous; slots: [T] int64 (block * block_size + offset);
 * kv_cache: [2, num_slots, kv_heads, d] contiguous; qk_out: [T, heads + kv_heads, d]
 * contiguous. Writes RoPE(q | k) into qk_out, RoPE(k) and v into each token's slot.
 * Returns 0, or -1 (nothing written) when a slot is outside [0, num_slots). */
int dpserve_rotary_kv(const void *qkv, int64_t qkv_stride, const void *cos, const void *sin,
                      const int64_t *slots, void *kv_cache, int64_t num_slots, void *qk_out,
                      int bf16, int64_t tokens, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, int threads) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots)
            return -1;
    size_t es = bf16 ? 2 : 4, head_bytes = (size_t)head_dim * es;
    int64_t half = head_dim / 2, qk_heads = heads + kv_heads;
    size_t slot_bytes = (size_t)kv_heads * head_bytes;
    char *k_cache = kv_cache, *v_cache = (char *)kv_cache + (size_t)num_slots * slot_bytes;
    if (threads < 1 || tokens * (qk_heads + kv_heads) * head_dim < PARALLEL_MIN)
        threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const char *row = (const char *)qkv + (size_t)t * qkv_stride * es;
        const char *c = (const char *)cos + (size_t)t * half * es;
        const char *s = (const char *)sin + (size_t)t * half * es;
        char *out_row = (char *)qk_out + (size_t)t * qk_heads * head_bytes;
        for (int64_t h = 0; h < qk_heads; h++)
            rotate_head(row + h * head_bytes, c, s, out_row + h * head_bytes, half, bf16);
        memcpy(k_cache + slots[t] * slot_bytes, out_row + heads * head_bytes, slot_bytes);
        memcpy(v_cache + slots[t] * slot_bytes, row + qk_heads * head_bytes, slot_bytes);
    }
    return 0;
}
