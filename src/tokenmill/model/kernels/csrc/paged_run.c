/* Decode attention's runs: long contexts in parts (then combined), the checks of a call's
 * arguments, the threads over (sequence, kv head) items, and the library's attention entry
 * points. Builds on paged_attention.c's item routine (attend_range, attend_dispatch). */
#include "tm_kernels.h"

}

/* Long contexts are attended in parts of PART_LEN positions, each its own work item, then
 * combined (combine_parts): one sequence's item alone cannot keep several threads busy, and a
 * batch of one with few kv heads (Gemma's one) left all threads but one waiting on it. The
 * parts depend only on the positions attended, never on the batch or the thread count, so a
 * sequence's result is the same alone and batched. PART_LEN is long enough that a part's
 * combine (its G x D sums read once) costs little next to reading its K and V rows. */
#ifndef PART_LEN /* benchmarks/context_parts.py's baseline: -DPART_LEN=(1 << 30), no parts */
#define PART_LEN 1024
#endif
#define PART_FLOATS(G, D) ((G) * (D) + 2 * (G)) /* a part's unnormalised sums, then max and sum per head */

/* Parts of PART_LEN positions a span of ``positions`` is attended in. */
TM_INLINE int64_t parts_of(int64_t positions) { return (positions + PART_LEN - 1) / PART_LEN; }

/* How many parts sequence n's item is attended in: 1 for contexts up to PART_LEN. */
TM_INLINE int64_t item_parts(const Args *a, int64_t n) {
    int64_t lo, len;
    attended(a, n, &lo, &len);
    return parts_of(len - lo);
}

/* Part j of sequence n's item: positions p0 .. p1 - 1. */
TM_INLINE void part_range(const Args *a, int64_t n, int64_t j, int64_t *p0, int64_t *p1) {
    int64_t lo, len;
    attended(a, n, &lo, &len);
    *p0 = lo + j * PART_LEN;
    *p1 = *p0 + PART_LEN < len ? *p0 + PART_LEN : len;
}

/* The output rows of item (n, kvh) from its P parts' results (PART_FLOATS each, in order):
 * each part's sums scaled by exp(its max - the overall max), over the scaled sum of
 * denominators; parts summed in order, so the result is deterministic. tmp: head_dim floats. */
TM_INLINE void combine_parts(const Args *a, int64_t n, int64_t kvh, const float *parts, int64_t P, int io_bf16,
                             float *tmp) {
    const int64_t G = a->heads / a->kv_heads, D = a->head_dim, stride = PART_FLOATS(G, D);
    for (int64_t g = 0; g < G; g++) {
        float m = -INFINITY, denom = 0.0f;
        for (int64_t j = 0; j < P; j++) {
            const float mj = parts[j * stride + G * D + g];
            m = mj > m ? mj : m;
        }
        memset(tmp, 0, D * sizeof(float));
        for (int64_t j = 0; j < P; j++) {
            const float *pj = parts + j * stride;
            const float w = exp_nonpos(pj[G * D + g] - m);
            denom += w * pj[G * D + G + g];
#pragma omp simd
            for (int64_t d = 0; d < D; d++) tmp[d] += w * pj[g * D + d];
        }
        store_out_row(a, n, kvh, g, D, tmp, 1.0f / denom, io_bf16);
    }
}

/* Checks every table entry a sequence uses and returns the longest length,
 * or -1 when an input would read outside the pool. */
static int64_t check_args(const Args *a, int64_t num_seqs, int64_t bt_width) {
    if (a->kv_heads <= 0 || a->heads % a->kv_heads || a->head_dim <= 0 || a->head_dim % VW ||
        a->block_size <= 0)
        return -1;
    int64_t max_len = 0;
    for (int64_t n = 0; n < num_seqs; n++) {
        const int64_t L = a->seq_lens[n];
        const int64_t used = (L + a->block_size - 1) / a->block_size;
        if (L <= 0 || used > bt_width) return -1;
        const int32_t *table = a->block_tables + n * a->bt_stride;
        for (int64_t b = 0; b < used; b++)
            if (table[b] < 0 || table[b] >= a->num_blocks) return -1;
        if (L > max_len) max_len = L;
    }
    return max_len;
}

/* Threads for `items` independent work items: at least one, at most one per item. */
TM_INLINE int threads_for(int num_threads, int64_t items) {
    if (num_threads > items) num_threads = (int)items;
    return num_threads < 1 ? 1 : num_threads;
}

/* One thread's scratch: `floats` floats, 64-byte aligned; NULL when out of memory. */
TM_INLINE float *scratch_floats(size_t floats) {
    return (float *)aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
}

/* A work item of the standalone kernel: a whole (sequence, kv head) pair, or part j of P of
 * one (its result at parts + slot * PART_FLOATS). */
typedef struct {
    int64_t n, kvh, j, parts, slot;
} Item;

static int run(const Args *a, int64_t num_seqs, int64_t bt_width, int num_threads, int fmt, int io_bf16) {
    const int64_t max_len = check_args(a, num_seqs, bt_width);
    if (max_len < 0) return 1;
    if (num_seqs == 0) return 0;
    const int64_t G = a->heads / a->kv_heads, D = a->head_dim;
    int64_t items = 0, slots = 0;
    for (int64_t n = 0; n < num_seqs; n++) {
        const int64_t P = item_parts(a, n);
        items += P * a->kv_heads;
        if (P > 1) slots += P * a->kv_heads;
    }
    Item *list = (Item *)malloc(items * sizeof(Item));
    float *parts = slots ? (float *)malloc(slots * PART_FLOATS(G, D) * sizeof(float)) : NULL;
    if (!list || (slots && !parts)) {
        free(list), free(parts);
        return 2;
    }
    int64_t k = 0, slot = 0;
    for (int64_t n = 0; n < num_seqs; n++) {
        const int64_t P = item_parts(a, n);
        for (int64_t kvh = 0; kvh < a->kv_heads; kvh++)
            for (int64_t j = 0; j < P; j++) list[k++] = (Item){n, kvh, j, P, P > 1 ? slot++ : -1};
    }
    const int64_t span = max_len < PART_LEN ? max_len : PART_LEN;
    const size_t floats = (size_t)(2 * G * D + G + VW * D + D + G * span);
    int failed = 0;
#pragma omp parallel num_threads(threads_for(num_threads, items)) reduction(| : failed)
    {
        float *buf = scratch_floats(floats);
        if (!buf) {
            failed = 1;
        } else {
            float *rows = buf + 2 * G * D + G, *zero = rows + VW * D;
            memset(zero, 0, D * sizeof(float));
            Scratch sc = {buf, buf + G * D, buf + 2 * G * D, rows, zero, zero + D, -1, -1};
            /* Runs of a few consecutive items per claim, so an item knows the next one (its
             * rows to prefetch); single items when there are few to share. */
            const int64_t run_len = items >= 8 * omp_get_num_threads() ? 4 : 1;
#pragma omp for schedule(dynamic, run_len)
            for (int64_t it = 0; it < items; it++) {
                const Item *i = &list[it];
                if (i->parts > 1) {
                    int64_t p0, p1;
                    part_range(a, i->n, i->j, &p0, &p1);
                    attend_range(a, i->n, i->kvh, fmt, io_bf16, &sc, p0, p1, parts + i->slot * PART_FLOATS(G, D));
                    continue;
                }
                const Item *nx = (it + 1) % run_len && it + 1 < items && list[it + 1].parts == 1 ? &list[it + 1] : NULL;
                sc.next_item = nx ? nx->n * a->kv_heads + nx->kvh : -1;
                attend_dispatch(a, i->n, i->kvh, fmt, io_bf16, &sc);
            }
            /* (the loop's barrier: every part is done) */
            if (slots) {
#pragma omp for schedule(dynamic, 1)
                for (int64_t it = 0; it < items; it++) {
                    const Item *i = &list[it];
                    if (i->parts > 1 && i->j == 0)
                        combine_parts(a, i->n, i->kvh, parts + i->slot * PART_FLOATS(G, D), i->parts, io_bf16, sc.acc);
                }
            }
            free(buf);
        }
    }
    free(list), free(parts);
    return failed ? 2 : 0;
}

#define TM_ENTRY(name, T, is_bf16)                                                                       \
    int name(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache, const int32_t *block_tables, \
             int64_t bt_stride, int64_t bt_width, const int32_t *seq_lens, int64_t num_seqs, int64_t heads,  \
             int64_t kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size, float scale, T *out, \
             int64_t out_stride, int num_threads, int64_t window) {                                      \
        Args a = {q, k_cache, v_cache, block_tables, seq_lens, out, q_stride, out_stride, bt_stride,      \
                  heads, kv_heads, head_dim, num_blocks, block_size, scale, NULL, NULL, window};         \
        return run(&a, num_seqs, bt_width, num_threads, is_bf16, is_bf16);                               \
    }

/* Returns 0 on success, 1 on arguments the kernel does not take or that would
 * read outside the pool (nothing written), 2 when scratch memory could not be
 * allocated. */
TM_ENTRY(tm_paged_decode_f32, float, 0)
TM_ENTRY(tm_paged_decode_bf16, uint16_t, 1)

/* A pool in another format than q, its rows widened to float32 as they are read: a
 * quantized pool (kv_fmt KV_I8 or KV_FP8: one byte a code) with its per-block scales
 * [kv_heads, num_blocks], q and out float32, or bf16 when io_bf16; or a bf16 pool
 * (KV_BF16, no scales) under float32 q and out. */
int tm_paged_decode_convert(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                            const float *k_scale, const float *v_scale, int kv_fmt, int io_bf16,
                            const int32_t *block_tables, int64_t bt_stride, int64_t bt_width, const int32_t *seq_lens,
                            int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t num_blocks,
                            int64_t block_size, float scale, void *out, int64_t out_stride, int num_threads,
                            int64_t window) {
    const int quant = kv_fmt == KV_I8 || kv_fmt == KV_FP8;
    if (!(quant && k_scale && v_scale) && !(kv_fmt == KV_BF16 && !io_bf16)) return 1;
    Args a = {q, k_cache, v_cache, block_tables, seq_lens, out, q_stride, out_stride, bt_stride,
              heads, kv_heads, head_dim, num_blocks, block_size, scale, k_scale, v_scale, window};
    return run(&a, num_seqs, bt_width, num_threads, kv_fmt, io_bf16 ? 1 : 0);
}

/* Lets the loader check it has the file it expects. */
int tm_kernels_abi_version(void) { return 14; }

/* 1 when decode attention over a bf16 pool multiplies bf16-rounded queries and softmax
 * weights (ROWS_BF16_DOT), 0 when its arithmetic is float32. */
int tm_kernels_bf16_attention(void) {
#ifdef TM_BF16_DOT
    return 1;
#else
    return 0;
#endif
}

/* Head sizes must be a multiple of this. */
int tm_kernels_vector_width(void) { return VW; }
