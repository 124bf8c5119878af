/* A decode step's decoder layers in one call (see cpu_kernels.decode_layers).
 *
 * A step of a few decode rows is bound by reading the weights, and its Python between
 * the kernels (a dozen calls per layer: each a dispatch, argument checks, a fresh
 * tensor) cost about 4 ms of a 15.7 ms one-row bfloat16 step of the default model
 * (11.6 ms in one call). Here the same kernels run in the same order as
 * `LlamaDecoderLayer.forward` calls them:
 *   residual += mlp (the previous layer's), h = rms_norm(residual) * w_in,
 *   qkv = h W_qkv^T, RoPE and the KV cache write, decode attention,
 *   residual += attn W_o^T, h = rms_norm(residual) * w_post,
 *   mlp = (silu(gate) * up) W_down^T for [gate | up] = h W_gate_up^T,
 * and the last layer's mlp is added to residual before returning. Tensors are
 * float32 or bfloat16 (one dtype); a bfloat16 result is rounded where torch's ops
 * round theirs (the residual after each add, silu, its product with up).
 *
 * Built by cpu_kernels.py with the host compiler, -O3 -march=native -fopenmp.
 */
#include "cpu_kernels.h"

/* The table's columns: one row of pointers per layer. */
enum { IN_NORM, QKV, O, POST_NORM, GATE_UP, DOWN, KV_CACHE, COLUMNS };

/* residual += delta over n values, rounded to the dtype (torch's add_). */
static void add_into(void *residual, const void *delta, int64_t n, int bf16) {
    size_t es = bf16 ? 2 : 4;
    char *r = residual;
    const char *d = delta;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        store16(r + i * es, load16(r + i * es, bf16) + load16(d + i * es, bf16), bf16);
    for (; i < n; i++) {
        float v = (bf16 ? bf16_to_f32(((uint16_t *)r)[i]) : ((float *)r)[i])
                  + (bf16 ? bf16_to_f32(((const uint16_t *)d)[i]) : ((const float *)d)[i]);
        if (bf16)
            ((uint16_t *)r)[i] = f32_to_bf16(v);
        else
            ((float *)r)[i] = v;
    }
}

/* silu(x) = x / (1 + e^-x), from e^-|x| (exp16's domain): x e^x / (1 + e^x) below 0. */
static inline v16f silu16(v16f x) {
    v16u below = (v16u)(x < 0); /* all ones where x < 0 */
    v16f e = exp16(-(v16f)((v16u)x & 0x7fffffffu));
    v16f num = (v16f)((below & (v16u)(x * e)) | (~below & (v16u)x));
    return num / (e + 1.0f);
}

/* out[m, i] = silu(gu[m, i]) * gu[m, inter + i], rounded as torch's silu and mul_ are
 * (inter a multiple of 16: checked by the caller). */
static void silu_mul(const void *gu, void *out, int64_t rows, int64_t inter, int bf16) {
    size_t es = bf16 ? 2 : 4;
    for (int64_t m = 0; m < rows; m++) {
        const char *g = (const char *)gu + (size_t)m * 2 * inter * es;
        const char *u = g + (size_t)inter * es;
        char *o = (char *)out + (size_t)m * inter * es;
        for (int64_t i = 0; i < inter; i += 16) {
            v16f a = silu16(load16(g + i * es, bf16));
            if (bf16)
                a = round_bf16(a);
            store16(o + i * es, a * load16(u + i * es, bf16), bf16);
        }
    }
}

/* table: [layers, COLUMNS] addresses (the norms' weights [hidden], the projections
 * [out, in] row-major, the layer's KV cache [2, num_blocks, block_size, kv_heads, d]);
 * residual: [rows, hidden], the embeddings in, the last layer's sum out; cos, sin:
 * [rows, d / 2]; slots, seq_lens: [rows] int64; block_table: [rows, table_width] int64.
 * Returns 0; else the first failing kernel's status (-1: no memory, a slot or block
 * outside the cache; -2: an attention shape decode_attention does not run), having
 * left the step unfinished. */
int dpserve_decode_layers(const int64_t *table, int64_t layers, void *residual,
                          const void *cos, const void *sin, const int64_t *slots,
                          const int64_t *block_table, int64_t table_width,
                          const int64_t *seq_lens, int bf16, int64_t rows, int64_t hidden,
                          int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter,
                          int64_t num_blocks, int64_t block_size, float eps, float scale,
                          int threads) {
    const size_t es = bf16 ? 2 : 4;
    const int64_t qkv_out = (heads + 2 * kv_heads) * head_dim;
    const int64_t qk_heads = heads + kv_heads, attn_width = heads * head_dim;
    /* the step's buffers, one allocation: h | qkv | qk | attn | o | gate_up | act | mlp */
    const int64_t sizes[] = {hidden, qkv_out, qk_heads * head_dim, attn_width, hidden,
                             2 * inter, inter, hidden};
    size_t offsets[9] = {0}; /* 64-byte aligned parts */
    for (int i = 0; i < 8; i++)
        offsets[i + 1] = offsets[i] + ((size_t)rows * sizes[i] * es + 63) / 64 * 64;
    char *buf = aligned_alloc(64, offsets[8]);
    if (!buf)
        return -1;
    char *parts[8];
    for (int i = 0; i < 8; i++)
        parts[i] = buf + offsets[i];
    char *h = parts[0], *qkv = parts[1], *qk = parts[2], *attn = parts[3], *o = parts[4],
         *gu = parts[5], *act = parts[6], *mlp = parts[7];
    int status = 0;
    for (int64_t l = 0; l < layers && status == 0; l++) {
        const int64_t *w = table + l * COLUMNS;
        void *cache = (void *)w[KV_CACHE];
        if (l > 0)
            add_into(residual, mlp, rows * hidden, bf16);
        dpserve_add_rms_norm(residual, NULL, (const void *)w[IN_NORM], h, bf16, rows, hidden,
                             eps, threads);
        status = dpserve_gemv((const void *)w[QKV], bf16, h, qkv, bf16, rows, qkv_out, hidden,
                              threads);
        if (status == 0)
            status = dpserve_rotary_kv(qkv, qkv_out, cos, sin, slots, cache,
                                       num_blocks * block_size, qk, bf16, rows, heads,
                                       kv_heads, head_dim, threads);
        if (status == 0)
            status = dpserve_decode_attention(qk, qk_heads * head_dim, cache, attn,
                                              block_table, table_width, seq_lens, bf16, rows,
                                              heads, kv_heads, head_dim, num_blocks,
                                              block_size, scale, threads);
        if (status == 0)
            status = dpserve_gemv((const void *)w[O], bf16, attn, o, bf16, rows, hidden,
                                  attn_width, threads);
        if (status != 0)
            break;
        dpserve_add_rms_norm(residual, o, (const void *)w[POST_NORM], h, bf16, rows, hidden,
                             eps, threads);
        status = dpserve_gemv((const void *)w[GATE_UP], bf16, h, gu, bf16, rows, 2 * inter,
                              hidden, threads);
        if (status == 0) {
            silu_mul(gu, act, rows, inter, bf16);
            status = dpserve_gemv((const void *)w[DOWN], bf16, act, mlp, bf16, rows, hidden,
                                  inter, threads);
        }
    }
    if (status == 0 && layers > 0)
        add_into(residual, mlp, rows * hidden, bf16);
    free(buf);
    return status;
}
