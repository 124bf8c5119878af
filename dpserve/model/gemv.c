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

/* One bfloat16 row of x against rows [n0, n1) of a bfloat16 w with AVX512-BF16's
 * `vdpbf16ps`: 32 products of bfloat16 pairs summed into 16 float32 lanes per
 * instruction, no conversion of w. The products are exact in float32 (a bfloat16
 * has 8 significant bits), so results differ from the float32 path only in the
 * order of the float32 sums. Denormal inputs count as zero (the instruction's rule). */
static void bf16_dot_rows(const uint16_t *w, const uint16_t *x, float *yf, int64_t n0,
                          int64_t n1, int64_t k_len) {
    const int64_t k_vec = k_len / 32 * 32;
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *wr = w + n * k_len;
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 64 <= k_vec; k += 64) {
            acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(wr + k),
                                    (__m512bh)_mm512_loadu_si512(x + k));
            acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(wr + k + 32),
                                    (__m512bh)_mm512_loadu_si512(x + k + 32));
        }
        if (k < k_vec) {
            acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(wr + k),
                                    (__m512bh)_mm512_loadu_si512(x + k));
            k += 32;
        }
        float s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
        for (; k < k_len; k++)
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
