/* int8 linears with AVX512-VNNI for `--quantization int8` (see quant.py).
 *
 * y[m, n] = xs[m] * ws[n] * sum_k (qx[m, k] - zx[m]) * w[n, k] + bias[n], where w is
 * the int8 weight with one scale ws[n] per output channel (quantised once, at load)
 * and qx is x quantised per row on the fly to unsigned bytes over the row's own
 * range: xs[m] = (max - min) / 255 with 0 inside the range, zero point zx[m] (the
 * byte of 0.0), rounded to nearest. VNNI multiplies unsigned by signed bytes
 * (vpdpbusd: four u8 x s8 products summed into each int32 lane, no saturation);
 * the zero point comes off as zx[m] * wsum[n], wsum[n] = sum_k w[n, k].
 *
 * Weights are packed once as [n_pad / 16][k_pad / 4][16][4] bytes: for four
 * consecutive k, the 16 outputs of a block side by side, so one vpdpbusd with
 * four activation bytes broadcast adds into 16 outputs at once (no horizontal
 * sums). A tile is TILE_ROWS rows by two blocks (32 outputs): 16 accumulators in
 * registers; its 32 weight rows (k_len * 32 bytes) stay in L1 while the rows
 * stream past. Threads split the output blocks.
 *
 * Without AVX512-VNNI at build time, dpserve_int8_vnni() returns 0 and quant.py
 * keeps fbgemm's kernel.
 *
 * Built by cpu_kernels.py with the host compiler, -O3 -march=native -fopenmp.
 */
#include "cpu_kernels.h"

#include <math.h>

#ifdef __AVX512VNNI__
#include <immintrin.h>
#endif

#define TILE_ROWS 8

int dpserve_int8_vnni(void) {
#ifdef __AVX512VNNI__
    return 1;
#else
    return 0;
#endif
}

/* w [n_len, k_len] int8, row-major -> packed [n_pad / 16][k_pad / 4][16][4] (zero
 * padded; n_pad, k_pad: n_len, k_len rounded up to 16 and 4) and wsum [n_pad]. */
int dpserve_int8_pack(const int8_t *w, int64_t n_len, int64_t k_len, int8_t *packed,
                      int32_t *wsum) {
    int64_t n_pad = (n_len + 15) / 16 * 16, k_pad = (k_len + 3) / 4 * 4, kq = k_pad / 4;
    memset(packed, 0, (size_t)(n_pad * k_pad));
    for (int64_t n = 0; n < n_pad; n++) {
        int32_t sum = 0;
        for (int64_t k = 0; n < n_len && k < k_len; k++) {
            int8_t v = w[n * k_len + k];
            sum += v;
            packed[(((n / 16) * kq + k / 4) * 16 + n % 16) * 4 + k % 4] = v;
        }
        wsum[n] = sum;
    }
    return 0;
}

#ifdef __AVX512VNNI__

/* Row m of x [rows, k_len] float32 -> qx[m] (k_pad bytes; the padding zx), its
 * scale xs[m] and zero point zx[m]. */
static void quantize_row(const float *x, int64_t k_len, int64_t k_pad, uint8_t *q, float *xs,
                         int32_t *zx) {
    __m512 vmax = _mm512_setzero_ps(), vmin = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= k_len; k += 16) {
        __m512 v = _mm512_loadu_ps(x + k);
        vmax = _mm512_max_ps(vmax, v);
        vmin = _mm512_min_ps(vmin, v);
    }
    float hi = _mm512_reduce_max_ps(vmax), lo = _mm512_reduce_min_ps(vmin);
    for (; k < k_len; k++) {
        hi = fmaxf(hi, x[k]);
        lo = fminf(lo, x[k]);
    }
    float scale = hi > lo ? (hi - lo) / 255.0f : 1.0f;
    int32_t zero = (int32_t)nearbyintf(-lo / scale);
    zero = zero < 0 ? 0 : zero > 255 ? 255 : zero;
    *xs = scale;
    *zx = zero;
    __m512 inv = _mm512_set1_ps(1.0f / scale);
    __m512i vzero = _mm512_set1_epi32(zero), top = _mm512_set1_epi32(255);
    for (k = 0; k + 16 <= k_len; k += 16) {
        __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), inv));
        v = _mm512_min_epi32(_mm512_max_epi32(_mm512_add_epi32(v, vzero),
                                              _mm512_setzero_si512()), top);
        _mm_storeu_si128((__m128i *)(q + k), _mm512_cvtepi32_epi8(v));
    }
    for (; k < k_len; k++) {
        int v = (int)nearbyintf(x[k] / scale) + zero;
        q[k] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
    }
    for (; k < k_pad; k++)
        q[k] = (uint8_t)zero;
}

/* Rows [m0, m0 + R) against blocks b0 .. b0 + NB - 1 (NB = 1 or 2), into y. Inlined
 * with constant R and NB, so the accumulators live in registers. */
static inline __attribute__((always_inline)) void
tile(const uint8_t *q, int64_t k_pad, const int8_t *packed, int64_t b0, const int NB,
     int64_t m0, const int R, const float *xs, const int32_t *zx, const int32_t *wsum,
     const float *ws,
     const float *bias, int64_t n_len, float *y) {
    __m512i acc[TILE_ROWS][2];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < NB; j++)
            acc[r][j] = _mm512_setzero_si512();
    int64_t kq = k_pad / 4;
    const int8_t *w0 = packed + b0 * kq * 64;
    for (int64_t kk = 0; kk < kq; kk++) {
        __m512i wv[2];
        for (int j = 0; j < NB; j++)
            wv[j] = _mm512_loadu_si512(w0 + (j * kq + kk) * 64);
        for (int r = 0; r < R; r++) {
            int32_t four;
            memcpy(&four, q + (m0 + r) * k_pad + kk * 4, 4);
            __m512i a = _mm512_set1_epi32(four);
            for (int j = 0; j < NB; j++)
                acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], a, wv[j]);
        }
    }
    for (int j = 0; j < NB; j++) {
        int64_t n0 = (b0 + j) * 16;
        if (n0 >= n_len)
            break;
        __mmask16 mask = n_len - n0 >= 16 ? (__mmask16)0xffff
                                           : (__mmask16)((1u << (n_len - n0)) - 1u);
        __m512i c = _mm512_loadu_si512(wsum + n0);
        __m512 s = _mm512_loadu_ps(ws + n0);
        __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            __m512i sum = _mm512_sub_epi32(acc[r][j],
                                           _mm512_mullo_epi32(c, _mm512_set1_epi32(zx[m0 + r])));
            __m512 v = _mm512_cvtepi32_ps(sum);
            v = _mm512_fmadd_ps(v, _mm512_mul_ps(s, _mm512_set1_ps(xs[m0 + r])), b);
            _mm512_mask_storeu_ps(y + (m0 + r) * n_len + n0, mask, v);
        }
    }
}

#define TILE_CASE(R)                                                                     \
    case R:                                                                              \
        if (nb == 2)                                                                     \
            tile(q, k_pad, packed, b, 2, m, R, xs, zx, wsum, ws, bias, n_len, y);            \
        else                                                                             \
            tile(q, k_pad, packed, b, 1, m, R, xs, zx, wsum, ws, bias, n_len, y);            \
        break;

#endif /* __AVX512VNNI__ */

/* x [rows, k_len] float32 -> y [rows, n_len] float32 through the packed weight
 * (dpserve_int8_pack), its wsum and scales ws [n_pad] (zero padded) and bias
 * [n_len] (or NULL). Returns 0; -1 without VNNI or memory. */
int dpserve_int8_linear(const float *x, int64_t rows, int64_t k_len, const int8_t *packed,
                        const int32_t *wsum, const float *ws, const float *bias, int64_t n_len,
                        float *y, int threads) {
#ifdef __AVX512VNNI__
    int64_t k_pad = (k_len + 3) / 4 * 4, blocks = (n_len + 15) / 16;
    uint8_t *q = malloc((size_t)(rows * k_pad));
    float *xs = malloc(sizeof(float) * (size_t)rows);
    int32_t *zx = malloc(sizeof(int32_t) * (size_t)rows);
    if (!q || !xs || !zx) {
        free(q);
        free(xs);
        free(zx);
        return -1;
    }
    if (threads < 1)
        threads = 1;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < rows; m++)
            quantize_row(x + m * k_len, k_len, k_pad, q + m * k_pad, xs + m, zx + m);
        /* Pairs of blocks, split evenly: each thread reads its weights once per tile
         * of rows (from L1 after the first). */
        int64_t pairs = (blocks + 1) / 2;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            int64_t b = 2 * p;
            int nb = b + 1 < blocks ? 2 : 1;
            for (int64_t m = 0; m < rows; m += TILE_ROWS) {
                int r = rows - m < TILE_ROWS ? (int)(rows - m) : TILE_ROWS;
                switch (r) {
                    TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4)
                    TILE_CASE(5) TILE_CASE(6) TILE_CASE(7) TILE_CASE(8)
                }
            }
        }
    }
    free(q);
    free(xs);
    free(zx);
    return 0;
#else
    (void)x, (void)rows, (void)k_len, (void)packed, (void)wsum, (void)ws, (void)bias;
    (void)n_len, (void)y, (void)threads;
    return -1;
#endif
}
