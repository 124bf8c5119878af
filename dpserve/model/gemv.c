/* Streaming matrix products for decode steps on CPU (see cpu_kernels.py).
 *
 * y[m, n] = sum_k x[m, k] * w[n, k] for up to 32 rows m of x: each thread reads its
 * share of w's rows once, front to back. One row: wide independent accumulators, so
 * the loop runs at memory bandwidth (oneDNN's kernels stream one row at 60% of it).
 * Two rows or more (`tiles_range`): 4 x 4 tiles of sums, each w vector converted
 * once for four rows of x, so bfloat16 weights feed float32 FMAs (on CPUs without
 * AMX, faster than bfloat16 dot products or oneDNN's bfloat16 GEMM up to 32 rows).
 * w is float32 or bfloat16; x and y are float32 or bfloat16 (same for both);
 * sums are float32; bfloat16 results round to nearest even. One bfloat16 row
 * against bfloat16 weights uses AVX512-BF16's dot products where the CPU has them
 * (`bf16_dot_rows`): the float32 path there is bound by converting w, not by memory.
 *
 * Built by cpu_kernels.py with the host compiler, -O3 -march=native -fopenmp.
 */
#include "cpu_kernels.h"

#define MAX_ROWS 4       /* rows_range: one row, and the last rows of w past the tiles */
#define MAX_MANY_ROWS 32 /* tiles_range: 2 to 32 rows */
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

/* ---- several rows: tiles of four rows of w by up to four rows of x ------------ */

#define TILE 4 /* 4 x 4 sums, 4 w vectors and an x vector fit in 32 registers */

/* a + b of two halves: [a's 8 pairwise sums, b's 8] (lanes lo+hi). */
#define FOLD8(a, b)                                                                     \
    (__builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) + \
     __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
#define FOLD4(a, b)                                                                     \
    (__builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) + \
     __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31))
#define FOLD2(a, b)                                                                     \
    (__builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) + \
     __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31))
#define FOLD1(a, b)                                                                     \
    (__builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) + \
     __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31))

/* The lane sums of 16 vectors, in order, as one vector (a transposing tree of adds). */
static inline v16f sum16(const v16f a[16]) {
    v16f b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = FOLD8(a[2 * i], a[2 * i + 1]);
    for (int i = 0; i < 4; i++)
        c[i] = FOLD4(b[2 * i], b[2 * i + 1]);
    for (int i = 0; i < 2; i++)
        d[i] = FOLD2(c[2 * i], c[2 * i + 1]);
    return FOLD1(d[0], d[1]);
}

/* y[m0 + m, n + j] for m < G, j < TILE: w's rows n..n+3 against xf's rows m0..m0+G-1.
 * Each w vector is loaded (converted) once for G rows of x, each x vector once for four
 * rows of w: a sum takes half a load (two rows of w at a time took 18 loads for 16
 * sums and ran at half the FMA rate). Inlined with constant G and w_bf16, so the sums
 * stay in registers. */
static inline __attribute__((always_inline)) void
tile(const void *w, const int w_bf16, int64_t n, const float *xf, int64_t m0, const int G,
     float *yf, int64_t n_len, int64_t k_len) {
    const size_t esize = w_bf16 ? 2 : 4;
    const char *wr[TILE];
    for (int j = 0; j < TILE; j++)
        wr[j] = (const char *)w + (n + j) * k_len * esize;
    const float *x = xf + m0 * k_len;
    v16f acc[16]; /* acc[m * TILE + j]: x row m, w row j */
    for (int i = 0; i < 16; i++)
        acc[i] = (v16f){0};
    int64_t k = 0;
    for (; k + 16 <= k_len; k += 16) {
        v16f wv[TILE];
        for (int j = 0; j < TILE; j++) {
            __builtin_prefetch(wr[j] + (k + PF * k_len) * esize);
            wv[j] = load16(wr[j] + k * esize, w_bf16);
        }
        for (int m = 0; m < G; m++) {
            v16f xv = load_f32(x + m * k_len + k);
            for (int j = 0; j < TILE; j++)
                acc[m * TILE + j] += wv[j] * xv;
        }
    }
    float sums[16];
    v16f all = sum16(acc);
    memcpy(sums, &all, sizeof sums);
    if (k < k_len)
        for (int m = 0; m < G; m++)
            for (int j = 0; j < TILE; j++)
                for (int64_t t = k; t < k_len; t++)
                    sums[m * TILE + j] += (w_bf16 ? bf16_to_f32(((const uint16_t *)wr[j])[t])
                                                  : ((const float *)wr[j])[t])
                                         * x[m * k_len + t];
    for (int m = 0; m < G; m++) /* row m's four sums are y's four neighbours */
        memcpy(yf + (m0 + m) * n_len + n, sums + m * TILE, TILE * sizeof(float));
}

#ifdef __AVX512F__
/* xd: each full 32-element chunk of each row of xf as its 16 even elements, then its
 * 16 odd ones; the rest of a row (k_len % 32) as it is. */
static void deinterleave(const float *xf, float *xd, int64_t rows, int64_t k_len) {
    for (int64_t m = 0; m < rows; m++) {
        const float *src = xf + m * k_len;
        float *dst = xd + m * k_len;
        int64_t k = 0;
        for (; k + 32 <= k_len; k += 32)
            for (int i = 0; i < 16; i++) {
                dst[k + i] = src[k + 2 * i];
                dst[k + 16 + i] = src[k + 2 * i + 1];
            }
        for (; k < k_len; k++)
            dst[k] = src[k];
    }
}

/* `tile` for bfloat16 w with AVX-512: 32 weights per load, split into the float32
 * vectors of its even and odd elements by a shift and a mask (two instructions for 32
 * weights, where a widening load and a shift take two for 16), against xd (x's even
 * and odd elements apart, `deinterleave`). The conversions share the FMA ports, so
 * halving them leaves more of those ports to the sums. */
static inline __attribute__((always_inline)) void
tile_bf16(const uint16_t *w, int64_t n, const float *xd, int64_t m0, const int G, float *yf,
          int64_t n_len, int64_t k_len) {
    const uint16_t *wr[TILE];
    for (int j = 0; j < TILE; j++)
        wr[j] = w + (n + j) * k_len;
    const float *x = xd + m0 * k_len;
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    __m512 acc[16]; /* acc[m * TILE + j]: x row m, w row j */
    for (int i = 0; i < 16; i++)
        acc[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= k_len; k += 32) {
        __m512 even[TILE], odd[TILE];
        for (int j = 0; j < TILE; j++) {
            __builtin_prefetch(wr[j] + k + PF * k_len);
            __m512i v = _mm512_loadu_si512((const void *)(wr[j] + k));
            even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
            odd[j] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
        }
        for (int m = 0; m < G; m++) {
            __m512 xe = _mm512_loadu_ps(x + m * k_len + k);
            __m512 xo = _mm512_loadu_ps(x + m * k_len + k + 16);
            for (int j = 0; j < TILE; j++) {
                acc[m * TILE + j] = _mm512_fmadd_ps(even[j], xe, acc[m * TILE + j]);
                acc[m * TILE + j] = _mm512_fmadd_ps(odd[j], xo, acc[m * TILE + j]);
            }
        }
    }
    v16f lanes[16];
    memcpy(lanes, acc, sizeof lanes);
    float sums[16];
    v16f all = sum16(lanes);
    memcpy(sums, &all, sizeof sums);
    if (k < k_len) /* the last k_len % 32 elements, kept in order in xd */
        for (int m = 0; m < G; m++)
            for (int j = 0; j < TILE; j++)
                for (int64_t t = k; t < k_len; t++)
                    sums[m * TILE + j] += bf16_to_f32(wr[j][t]) * x[m * k_len + t];
    for (int m = 0; m < G; m++)
        memcpy(yf + (m0 + m) * n_len + n, sums + m * TILE, TILE * sizeof(float));
}

#define TILE_BF16_CASE(G)                                                                \
    case G:                                                                              \
        tile_bf16(w, n, xd, m0, G, yf, n_len, k_len);                                    \
        break;
#endif

#define TILE_CASE(G, BF)                                                                 \
    case G:                                                                              \
        tile(w, BF, n, xf, m0, G, yf, n_len, k_len);                                     \
        break;

/* Rows [n0, n1) of w (n1 - n0 a multiple of TILE) against every row of xf, into yf;
 * xd: xf deinterleaved for bfloat16 w (`tile_bf16`), or NULL. */
static void tiles_range(const void *w, int w_bf16, const float *xf, const float *xd,
                        float *yf, int64_t rows, int64_t n0, int64_t n1, int64_t n_len,
                        int64_t k_len) {
    for (int64_t n = n0; n < n1; n += TILE)
        for (int64_t m0 = 0; m0 < rows; m0 += TILE) {
            int g = rows - m0 < TILE ? (int)(rows - m0) : TILE;
#ifdef __AVX512F__
            if (w_bf16 && xd) {
                switch (g) { TILE_BF16_CASE(1) TILE_BF16_CASE(2) TILE_BF16_CASE(3)
                             TILE_BF16_CASE(4) }
                continue;
            }
#endif
            (void)xd;
            if (w_bf16) {
                switch (g) { TILE_CASE(1, 1) TILE_CASE(2, 1) TILE_CASE(3, 1) TILE_CASE(4, 1) }
            } else {
                switch (g) { TILE_CASE(1, 0) TILE_CASE(2, 0) TILE_CASE(3, 0) TILE_CASE(4, 0) }
            }
        }
}

#ifdef __AVX512BF16__ /* (immintrin.h: cpu_kernels.h, under __AVX512F__) */

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
 * Returns 0, or -1 for rows outside 1..MAX_MANY_ROWS or no memory. */
int dpserve_gemv(const void *w, int w_bf16, const void *x, void *y, int xy_bf16,
                 int64_t rows, int64_t n_len, int64_t k_len, int threads) {
    if (rows < 1 || rows > MAX_MANY_ROWS)
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
    /* 64-byte aligned: each row's loads then split no cache line where k_len is a
     * multiple of 16 (split loads cost twice; several rows ran at half speed) */
    float *xf = aligned_alloc(64, (sizeof(float) * rows * k_len + 63) / 64 * 64);
    float *yf = aligned_alloc(64, (sizeof(float) * rows * n_len + 63) / 64 * 64);
    if (!xf || !yf) {
        free(xf);
        free(yf);
        return -1;
    }
    for (int64_t i = 0; i < rows * k_len; i++)
        xf[i] = xy_bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
    float *xd = NULL; /* bfloat16 tiles with AVX-512: x's even and odd elements apart */
#ifdef __AVX512F__
    if (rows > 1 && w_bf16) {
        xd = aligned_alloc(64, (sizeof(float) * rows * k_len + 63) / 64 * 64);
        if (!xd) {
            free(xf);
            free(yf);
            return -1;
        }
        deinterleave(xf, xd, rows, k_len);
    }
#endif
    /* One contiguous range of w's rows per thread: each streams its part once. */
    if (threads < 1)
        threads = 1;
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        if (rows == 1) {
            int64_t n0 = n_len * t / nt, n1 = n_len * (t + 1) / nt;
            rows_range(w, w_bf16, xf, yf, rows, n0, n1, n_len, k_len);
        } else { /* tiles of w's rows; the last n_len % TILE rows as single rows */
            int64_t tiles = n_len / TILE, q0 = tiles * t / nt, q1 = tiles * (t + 1) / nt;
            tiles_range(w, w_bf16, xf, xd, yf, rows, TILE * q0, TILE * q1, n_len, k_len);
            if (t == nt - 1)
                for (int64_t m0 = 0; m0 < rows; m0 += MAX_ROWS) /* MAX_ROWS at a time */
                    rows_range(w, w_bf16, xf + m0 * k_len, yf + m0 * n_len,
                               rows - m0 < MAX_ROWS ? rows - m0 : MAX_ROWS, TILE * tiles,
                               n_len, n_len, k_len);
        }
    }
    for (int64_t i = 0; i < rows * n_len; i++) {
        if (xy_bf16)
            ((uint16_t *)y)[i] = f32_to_bf16(yf[i]);
        else
            ((float *)y)[i] = yf[i];
    }
    free(xf);
    free(xd);
    free(yf);
    return 0;
}
