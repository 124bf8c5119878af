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

#endif
