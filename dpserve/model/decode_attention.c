/* Decode attention straight from the paged KV cache (see cpu_kernels.py).
 *
 * One query token per row attends to that row's first seq_len cached tokens,
 * found through its block table: no gathered copy of K/V, no padding mask.
 * One task per (row, KV head) computes the scores of the query heads sharing
 * that KV head, a float32 softmax, and the weighted sum of the values; tasks
 * are spread over `threads` OpenMP threads. float32 or bfloat16 (q, cache and
 * out share it); bfloat16 results round to nearest even.
 *
 * Layout (attention.py): cache [2, num_blocks, block_size, kv_heads, head_dim],
 * keys then values; token p of a row sits in block block_table[p / block_size]
 * at offset p % block_size.
 */
#include "cpu_kernels.h"

#define MAX_CHUNKS 16 /* head_dim: a multiple of 16 up to 256 */
#define MAX_GROUP 16  /* query heads per KV head */

typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

/* Sum of the 16 lanes as a tree (4 shuffles and adds, not a chain of 15). */
static inline float hsum(v16f v) {
    v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)
            + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* One (row, KV head): the scores of its `group` query heads over the row's `len`
 * tokens, softmax, and the weighted sum of values into out. Inlined with constant
 * group, chunks (head_dim / 16) and is_bf16, so the q vectors and the sums stay in
 * registers. Returns 0, or -1 (no memory, a block id outside the cache). */
static inline __attribute__((always_inline)) int
attend_one(const void *q, int64_t q_row_stride, const char *keys, const char *values, void *out,
           const int64_t *block_table, int64_t table_width, int64_t r, int64_t kvh, int64_t len,
           int64_t heads, int64_t head_dim, int64_t token_stride, int64_t num_blocks,
           int64_t block_size, float scale, const int64_t group, const int64_t chunks,
           const int is_bf16) {
    const int64_t elem = is_bf16 ? 2 : 4;
    float *buf = malloc(sizeof(float) * group * len);
    if (!buf) {
        return -1;
    }
    float *scores = buf; /* [group, len] */
    const char *qrow = (const char *)q + (r * q_row_stride + kvh * group * head_dim) * elem;
    v16f qv[MAX_GROUP][MAX_CHUNKS], acc[MAX_GROUP][MAX_CHUNKS];
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < chunks; c++) {
            qv[g][c] = load16(qrow + (g * head_dim + 16 * c) * elem, is_bf16) * scale;
            acc[g][c] = (v16f){0};
        }
    const int64_t *table = block_table + r * table_width;
    const int64_t blocks = (len + block_size - 1) / block_size;
    for (int64_t b = 0; b < blocks; b++) /* checked once, before any is read */
        if (table[b] < 0 || table[b] >= num_blocks) {
            free(buf);
            return -1;
        }
    /* Block by block, token by token: no division per token (two per token and pass,
     * at a runtime block size, cost more than the token's arithmetic). */
    const int64_t kv_offset = kvh * head_dim * elem, token_bytes = token_stride * elem;
    for (int64_t b = 0, t0 = 0; b < blocks; b++, t0 += block_size) {
        const char *kb = keys + table[b] * block_size * token_bytes + kv_offset;
        const int64_t n = len - t0 < block_size ? len - t0 : block_size;
        for (int64_t i = 0; i < n; i++) {
            const char *k = kb + i * token_bytes;
            v16f dot[MAX_GROUP];
            for (int64_t g = 0; g < group; g++)
                dot[g] = (v16f){0};
            for (int64_t c = 0; c < chunks; c++) {
                v16f kc = load16(k + 16 * c * elem, is_bf16);
                for (int64_t g = 0; g < group; g++)
                    dot[g] += qv[g][c] * kc;
            }
            for (int64_t g = 0; g < group; g++)
                scores[g * len + t0 + i] = hsum(dot[g]);
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * len, top = sg[0], sum = 0.0f;
        int64_t t = 0;
        if (len >= 16) { /* the maximum, 16 lanes at a time */
            v16f m = load_f32(sg);
            for (t = 16; t + 16 <= len; t += 16) {
                v16f e = load_f32(sg + t);
                v16u more = (v16u)(e > m); /* all ones where e > m */
                m = (v16f)(((v16u)e & more) | ((v16u)m & ~more));
            }
            for (int j = 0; j < 16; j++)
                top = m[j] > top ? m[j] : top;
        }
        for (; t < len; t++)
            top = sg[t] > top ? sg[t] : top;
        t = 0;
        for (; t + 16 <= len; t += 16) {
            v16f e;
            memcpy(&e, sg + t, sizeof e);
            e = exp16(e - top);
            memcpy(sg + t, &e, sizeof e);
            sum += hsum(e);
        }
        if (t < len) { /* the tail; its padding lanes give ~1e-38, left out of sum */
            v16f e = (v16f){0} - 1e30f;
            memcpy(&e, sg + t, sizeof(float) * (len - t));
            e = exp16(e - top);
            memcpy(sg + t, &e, sizeof(float) * (len - t));
            for (int64_t j = 0; j < len - t; j++)
                sum += e[j];
        }
        float inv = 1.0f / sum;
        for (t = 0; t < len; t++)
            sg[t] *= inv;
    }
    for (int64_t b = 0, t0 = 0; b < blocks; b++, t0 += block_size) {
        const char *vb = values + table[b] * block_size * token_bytes + kv_offset;
        const int64_t n = len - t0 < block_size ? len - t0 : block_size;
        for (int64_t i = 0; i < n; i++) {
            const char *v = vb + i * token_bytes;
            for (int64_t c = 0; c < chunks; c++) {
                v16f vc = load16(v + 16 * c * elem, is_bf16);
                for (int64_t g = 0; g < group; g++)
                    acc[g][c] += scores[g * len + t0 + i] * vc;
            }
        }
    }
    int64_t o = (r * heads + kvh * group) * head_dim;
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < chunks; c++)
            for (int j = 0; j < 16; j++) {
                float a = acc[g][c][j];
                int64_t i = o + g * head_dim + 16 * c + j;
                if (is_bf16)
                    ((uint16_t *)out)[i] = f32_to_bf16(a);
                else
                    ((float *)out)[i] = a;
            }
    free(buf);
    return 0;
}

/* q: rows of `heads * head_dim` elements, `q_row_stride` elements apart;
 * out: [rows, heads * head_dim] contiguous; block_table: [rows, table_width]
 * int64; seq_lens: [rows] int64 (each >= 1). Returns 0; -1 when out of memory or
 * a row's blocks run past the table or the cache; -2 for a head_dim that is not a
 * multiple of 16 up to 256 or more than 16 query heads per KV head (not run). */
int dpserve_decode_attention(const void *q, int64_t q_row_stride, const void *cache, void *out,
                             const int64_t *block_table, int64_t table_width,
                             const int64_t *seq_lens, int is_bf16, int64_t rows, int64_t heads,
                             int64_t kv_heads, int64_t head_dim, int64_t num_blocks,
                             int64_t block_size, float scale, int threads) {
    const int64_t group = heads / kv_heads, elem = is_bf16 ? 2 : 4;
    if (head_dim % 16 || head_dim > 16 * MAX_CHUNKS || group > MAX_GROUP)
        return -2;
    const int64_t token_stride = kv_heads * head_dim; /* elements between tokens */
    const char *keys = cache;
    const char *values = (const char *)cache + num_blocks * block_size * token_stride * elem;
    int status = 0;
    if (threads < 1)
        threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < rows * kv_heads; task++) {
        const int64_t r = task / kv_heads, kvh = task % kv_heads, len = seq_lens[r];
        if (len < 1 || (len - 1) / block_size >= table_width) {
#pragma omp atomic write
            status = -1;
            continue;
        }
#define ATTEND(G, C, B) attend_one(q, q_row_stride, keys, values, out, block_table, table_width, \
                                   r, kvh, len, heads, head_dim, token_stride, num_blocks,       \
                                   block_size, scale, G, C, B)
        int rc;
        const int64_t chunks = head_dim / 16;
        if (is_bf16 && chunks == 4 && group == 3) /* SmolLM2 */
            rc = ATTEND(3, 4, 1);
        else if (!is_bf16 && chunks == 4 && group == 3)
            rc = ATTEND(3, 4, 0);
        else if (is_bf16 && chunks == 8 && group == 4) /* Llama 3 8B, Qwen2 7B */
            rc = ATTEND(4, 8, 1);
        else if (!is_bf16 && chunks == 8 && group == 4)
            rc = ATTEND(4, 8, 0);
        else if (is_bf16)
            rc = ATTEND(group, chunks, 1);
        else
            rc = ATTEND(group, chunks, 0);
#undef ATTEND
        if (rc) {
#pragma omp atomic write
            status = -1;
        }
    }
    return status;
}
