/* Streaming matrix-vector products for decode steps on CPU (see cpu_kernels.py).
 *
 * y[m, n] = sum_k x[m, k] * w[n, k] for a few rows m of x: each thread reads its
 * share of w's rows once, front to back, with wide independent accumulators, so
 * the loop runs at memory bandwidth (oneDNN's kernels stream one row at 60% of it).
 * w is float32 or bfloat16; x and y are float32 or bfloat16 (same for both);
 * sums are float32; bfloat16 results round to nearest even. One bfloat16 row
 * against bfloat16 weights uses AVX512-BF16's dot products where the CPU has them
 * (`bf16_dot_rows`): the float32 path there is bound by converting w, not by memory.
 *
 * Built by cpu_kernels.py with the host compiler, -O3 -march=native -fopenmp.
 */
#include "cpu_kernels.h"

#define MAX_ROWS 4
#define BLOCK 64 /* k per loop: four 16-float vectors, four independent sums per row */
/* Rows of w ahead that each loop asks the memory for (a software prefetch): without it
 * the hardware's prefetchers kept one-row bfloat16 streaming at 16-17 GB/s, with it
 * 24-25 (4 to 16 rows ahead are alike on a 2-core Xeon, 32 is too far). */
#define PF 8

/* out[m] = dot(w_row, x[m]) for m < rows. Inlined with constant rows and w_bf16,
 * so the sums stay in registers and each w vector is loaded (converted) once. */
static inline __attribute__((always_inline)) void
row_dots(const void *w_row, const int w_bf16, const float *x, const int rows, int64_t k_len,
         float *out) {
    v16f acc[MAX_ROWS][4];
    for (int m = 0; m < rows; m++)
        for (int u = 0; u < 4; u++)
            acc[m][u] = (v16f){0};
    const uint16_t *wh = w_row;
    const float *wf = w_row;
    int64_t k = 0;
    for (; k + BLOCK <= k_len; k += BLOCK) {
        for (int u = 0; u < 4; u++) {
            if (w_bf16 && u < 2) /* a block's two lines of bfloat16 w */
                __builtin_prefetch(wh + k + 32 * u + PF * k_len);
            v16f wv = w_bf16 ? load_bf16(wh + k + 16 * u) : load_f32(wf + k + 16 * u);
            for (int m = 0; m < rows; m++)
                acc[m][u] += wv * load_f32(x + m * k_len + k + 16 * u);
        }
    }
    for (int m = 0; m < rows; m++) {
        v16f v = acc[m][0] + acc[m][1] + acc[m][2] + acc[m][3];
        float s = 0.0f;
        for (int j = 0; j < 16; j++)
            s += v[j];
        for (int64_t t = k; t < k_len; t++)
            s += (w_bf16 ? bf16_to_f32(wh[t]) : wf[t]) * x[m * k_len + t];
        out[m] = s;
    }
}

#define ROWS_CASE(R, BF)                                                                 \
    case R:                                                                              \
        for (int64_t n = n0; n < n1; n++) {                                              \
            float o[MAX_ROWS];                                                           \
            row_dots((const char *)w + n * k_len * (BF ? 2 : 4), BF, xf, R, k_len, o);  \
            for (int m = 0; m < R; m++)                                                  \
                yf[m * n_len + n] = o[m];                                                \
        }                                                                                \
        break;

/* Rows [n0, n1) of w against every row of xf, into yf. */
static void rows_range(const void *w, int w_bf16, const float *xf, float *yf, int64_t rows,
                       int64_t n0, int64_t n1, int64_t n_len, int64_t k_len) {
    if (w_bf16) {
        switch (rows) { ROWS_CASE(1, 1) ROWS_CASE(2, 1) ROWS_CASE(3, 1) ROWS_CASE(4, 1) }
    } else {
        switch (rows) { ROWS_CASE(1, 0) ROWS_CASE(2, 0) ROWS_CASE(3, 0) ROWS_CASE(4, 0) }
    }
}

#ifdef __AVX512BF16__
#include <immintrin.h>

/* The sums of four float32 vectors, one lane each of the result. */
static inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    __m256 b0 = _mm256_add_ps(_mm512_castps512_ps256(a0), _mm512_extractf32x8_ps(a0, 1));
    __m256 b1 = _mm256_add_ps(_mm512_castps512_ps256(a1), _mm512_extractf32x8_ps(a1, 1));
    __m256 b2 = _mm256_add_ps(_mm512_castps512_ps256(a2), _mm512_extractf32x8_ps(a2, 1));
    __m256 b3 = _mm256_add_ps(_mm512_castps512_ps256(a3), _mm512_extractf32x8_ps(a3, 1));
    __m256 d = _mm256_hadd_ps(_mm256_hadd_ps(b0, b1), _mm256_hadd_ps(b2, b3));
    return _mm_add_ps(_mm256_castps256_ps128(d), _mm256_extractf128_ps(d, 1));
}

/* One bfloat16 row of x against rows [n0, n1) of a bfloat16 w with AVX512-BF16's
 * `vdpbf16ps`: 32 products of bfloat16 pairs summed into 16 float32 lanes per
 * instruction, no conversion of w. Four rows of w at a time, each its own chain of
 * sums, share each load of x and one reduction (a row at a time waited on its
 * chain's latency and its own reduction: 17.7 GB/s, against 22.9 in float32). The
 * products are exact in float32 (a bfloat16 has 8 significant bits), so results
 * differ from the float32 path only in the order of the float32 sums. Denormal
 * inputs count as zero (the instruction's rule). */
#ifndef PF
#define PF 32
#endif
static void bf16_dot_rows(const uint16_t *w, const uint16_t *x, float *yf, int64_t n0,
                          int64_t n1, int64_t k_len) {
    const int64_t k_vec = k_len / 32 * 32;
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
        const uint16_t *w0 = w + n * k_len, *w1 = w0 + k_len, *w2 = w1 + k_len,
                       *w3 = w2 + k_len;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t k = 0; k < k_vec; k += 32) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
            __builtin_prefetch(w0 + k + PF * k_len);
            __builtin_prefetch(w1 + k + PF * k_len);
            __builtin_prefetch(w2 + k + PF * k_len);
            __builtin_prefetch(w3 + k + PF * k_len);
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w0 + k), xv);
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w1 + k), xv);
            a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(w2 + k), xv);
            a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(w3 + k), xv);
        }
        float s[4];
        _mm_storeu_ps(s, sum4(a0, a1, a2, a3));
        for (int64_t k = k_vec; k < k_len; k++) {
            float xk = bf16_to_f32(x[k]);
            s[0] += bf16_to_f32(w0[k]) * xk;
            s[1] += bf16_to_f32(w1[k]) * xk;
            s[2] += bf16_to_f32(w2[k]) * xk;
            s[3] += bf16_to_f32(w3[k]) * xk;
        }
        for (int r = 0; r < 4; r++)
            yf[n + r] = s[r];
    }
    for (; n < n1; n++) {
        const uint16_t *wr = w + n * k_len;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t k = 0; k < k_vec; k += 32)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(wr + k),
                                   (__m512bh)_mm512_loadu_si512(x + k));
        float s = _mm512_reduce_add_ps(acc);
        for (int64_t k = k_vec; k < k_len; k++)
            s += bf16_to_f32(wr[k]) * bf16_to_f32(x[k]);
        yf[n] = s;
    }
}
#endif

/* w: [n_len, k_len] (w_bf16: bfloat16 bits, else float32), row-major;
 * x: [rows, k_len], y: [rows, n_len] (xy_bf16: bfloat16 bits, else float32).
 * Returns 0, or -1 for rows outside 1..MAX_ROWS or no memory. */
int dpserve_gemv(const void *w, int w_bf16, const void *x, void *y, int xy_bf16,
                 int64_t rows, int64_t n_len, int64_t k_len, int threads) {
    if (rows < 1 || rows > MAX_ROWS)
        return -1;
#ifdef __AVX512BF16__
    if (rows == 1 && w_bf16 && xy_bf16) {
        float *yf = malloc(sizeof(float) * n_len);
        if (!yf)
            return -1;
        if (threads < 1)
            threads = 1;
#pragma omp parallel num_threads(threads)
        {
            int t = omp_get_thread_num(), nt = omp_get_num_threads();
            bf16_dot_rows(w, x, yf, n_len * t / nt, n_len * (t + 1) / nt, k_len);
        }
        for (int64_t i = 0; i < n_len; i++)
            ((uint16_t *)y)[i] = f32_to_bf16(yf[i]);
        free(yf);
        return 0;
    }
#endif
    float *xf = malloc(sizeof(float) * rows * k_len);
    float *yf = malloc(sizeof(float) * rows * n_len);
    if (!xf || !yf) {
        free(xf);
        free(yf);
        return -1;
    }
    for (int64_t i = 0; i < rows * k_len; i++)
        xf[i] = xy_bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
    /* One contiguous range of w's rows per thread: each streams its part once. */
    if (threads < 1)
        threads = 1;
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t n0 = n_len * t / nt, n1 = n_len * (t + 1) / nt;
        rows_range(w, w_bf16, xf, yf, rows, n0, n1, n_len, k_len);
    }
    for (int64_t i = 0; i < rows * n_len; i++) {
        if (xy_bf16)
            ((uint16_t *)y)[i] = f32_to_bf16(yf[i]);
        else
            ((float *)y)[i] = yf[i];
    }
    free(xf);
    free(yf);
    return 0;
}
