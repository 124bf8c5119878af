/* What the kernels (gemv.c, decode_attention.c, fused_ops.c) share: 16-float
 * vectors (GCC/Clang vector extensions: 512-bit with AVX-512, pairs of 256-bit
 * otherwise) and bfloat16 conversions (bfloat16 is the top half of a float32;
 * rounding to nearest even). */
#ifndef DPSERVE_CPU_KERNELS_H
#define DPSERVE_CPU_KERNELS_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7f800000u) == 0x7f800000u) /* inf, nan: keep, quiet a nan */
        return (uint16_t)((u >> 16) | ((u & 0xffffu) ? 0x40u : 0u));
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline v16f load_f32(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}

#ifdef __AVX512F__
#include <immintrin.h>
#endif

static inline v16f load_bf16(const uint16_t *p) {
#ifdef __AVX512F__
    /* one widening load and a shift (the generic form below splits into 256-bit
     * halves under GCC's preferred vector width: five instructions) */
    return (v16f)_mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)p)), 16));
#else
    v16h h;
    memcpy(&h, p, sizeof h);
    v16u u = __builtin_convertvector(h, v16u) << 16;
    v16f v;
    memcpy(&v, &u, sizeof v);
    return v;
#endif
}

/* 16 values at p as floats: bfloat16 when `bf16`, else float32. */
static inline v16f load16(const void *p, int bf16) {
    return bf16 ? load_bf16(p) : load_f32(p);
}

/* v rounded to bfloat16 (nearest even; inf and nan kept, a nan quieted), as floats. */
static inline v16f round_bf16(v16f v) {
    v16u u;
    memcpy(&u, &v, sizeof u);
    v16u special = (u & 0x7f800000u) == 0x7f800000u; /* all ones where inf or nan */
    v16u nan_bit = ((u & 0xffffu) != 0) & 0x400000u;
    v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    v16u kept = (u & 0xffff0000u) | nan_bit;
    u = (special & kept) | (~special & rounded);
    memcpy(&v, &u, sizeof v);
    return v;
}

/* Store 16 floats at p: bfloat16 (rounded) when `bf16`, else float32. */
static inline void store16(void *p, v16f v, int bf16) {
    if (!bf16) {
        memcpy(p, &v, sizeof v);
        return;
    }
    v16u u;
    v = round_bf16(v);
    memcpy(&u, &v, sizeof u);
    v16h h = __builtin_convertvector(u >> 16, v16h);
    memcpy(p, &h, sizeof h);
}

/* exp(x) for x <= 0, 16 lanes: 2^(x log2 e)
 * = 2^n * e^g with n an integer and |g| <= ln(2) / 2, e^g by its degree-6 Taylor
 * polynomial (relative error under 2e-7); x below -87 counts as -87 (1.6e-38). */
static inline v16f exp16(v16f x) {
#ifdef __AVX512F__
    /* In AVX-512 intrinsics (GCC leaves the portable loop below scalar: its float to
     * int conversions and the select do not vectorize), with n rounded to nearest
     * (|g| <= ln(2) / 2 still) and 2^n applied by scalef. */
    __m512 xm = _mm512_max_ps((__m512)x, _mm512_set1_ps(-87.0f));
    __m512 y = _mm512_mul_ps(xm, _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 g = _mm512_mul_ps(_mm512_sub_ps(y, n), _mm512_set1_ps(0.693147180559945309f));
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.0f));
    return (v16f)_mm512_scalef_ps(p, n);
#else
    v16f out;
    for (int j = 0; j < 16; j++) {
        float xj = x[j] < -87.0f ? -87.0f : x[j];
        float y = xj * 1.44269504088896341f;
        float z = y + 0.5f, n = (float)(int32_t)z; /* floor(z), in vectorizable steps */
        n -= n > z ? 1.0f : 0.0f;
        float g = (y - n) * 0.693147180559945309f;
        float p = 1.0f + g * (1.0f + g * (0.5f + g * (1.0f / 6 + g * (1.0f / 24
                  + g * (1.0f / 120 + g * (1.0f / 720))))));
        int32_t e = ((int32_t)n + 127) << 23;
        float scale;
        memcpy(&scale, &e, sizeof scale);
        out[j] = p * scale;
    }
    return out;
#endif
}

/* The kernels each file exports (decode_layers.c calls the others'). */
int dpserve_gemv(const void *w, int w_bf16, const void *x, void *y, int xy_bf16,
                 int64_t rows, int64_t n_len, int64_t k_len, int threads);
int dpserve_add_rms_norm(void *residual, const void *delta, const void *w, void *out,
                         int bf16, int64_t rows, int64_t n, float eps, int threads);
int dpserve_rotary_kv(const void *qkv, int64_t qkv_stride, const void *cos, const void *sin,
                      const int64_t *slots, void *kv_cache, int64_t num_slots, void *qk_out,
                      int bf16, int64_t tokens, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, int threads);
int dpserve_decode_attention(const void *q, int64_t q_row_stride, const void *cache, void *out,
                             const int64_t *block_table, int64_t table_width,
                             const int64_t *seq_lens, int is_bf16, int64_t rows, int64_t heads,
                             int64_t kv_heads, int64_t head_dim, int64_t num_blocks,
                             int64_t block_size, float scale, int threads);

#endif
