/* One whole step of a Llama-family model in one native call (CPU, OpenMP): decode rows,
 * and prefill chunks with the decodes that share their step (tm_model_step).
 *
 * Why: at batch 1 an eager torch decode step dispatches ~4,000 ATen ops (norms,
 * rotary, splits, casts, residuals, the quantized matmuls and their wrappers),
 * and on a small CPU their fixed costs took most of an int4 step, far more
 * than reading the weights (docs/performance.md). Here every layer runs in one
 * OpenMP parallel region: the threads claim chunks of every matmul's output
 * rows and of the (sequence, kv head) attention items as they come free
 * (claim_chunk), and meet at six spin barriers per layer (libgomp's own barriers sleep under the
 * OMP_WAIT_POLICY=PASSIVE that tokenmill sets, and a futex wake-up per barrier
 * would cost more than the work between them).
 *
 * The math is the model's (model/models/llama.py), in float32 throughout: RMSNorm,
 * fused q/k/v projection (+ bias), optional per-head q/k RMSNorm (Qwen3),
 * rotate-half rotary from the model's cos/sin tables, the new K/V written into
 * the paged pool, attention over the pool in place (paged_attention.c's item
 * routine per row, prefill_attention.c's per block of a prefill chunk's query
 * positions; all rows store their K/V before any attends, so several rows of one
 * sequence at consecutive positions, a speculative verify or a chunk, run as one
 * step; a quantized pool's rows go through elementwise.c's requantizing store),
 * o projection + residual, RMSNorm, gate/up, SiLU(gate) * up, down
 * projection + residual, the final norm and the LM head of the rows that sample.
 *
 * Prefill chunks through here rather than the eager forward: a 512-row step of the
 * eager model spends a good part of its time between kernels (Python and torch
 * dispatch, threads waking and meeting per op) and on whole-step intermediates
 * (gate/up written out, then read back by SiLU); here SiLU runs on each gate/up tile
 * while it is in cache (docs/performance.md has the measured step times).
 *
 * Weights stay in their stored precision and are widened to float32 in
 * registers: float32, bfloat16, int8 with a scale per output row, and int4
 * with a (scale, zero) pair per group of input columns, packed so that byte i
 * of each 32-column chunk holds code i in its low nibble and code i + 16 in
 * its high nibble (so one byte load gives two vectors' worth of codes). The
 * exception: bf16 weights against several activation rows, on a CPU with
 * AVX512-BF16, multiply bf16-rounded activations with vdpbf16ps
 * (bf16_dot_tile).
 *
 * Matmuls are matrix-vector products over up to 6 rows of activations at a
 * time: a tile of VW output rows keeps one vector of partial sums per row and
 * activation row; one shuffle tree (transpose_sum) then turns the VW vectors
 * into VW results (dense.c).
 */
#include "tm_kernels.h"

/* ------------------------------------------------------------------ the step */

static int64_t max_k(const TmModel *m) {
    int64_t k = m->hidden > m->inter ? m->hidden : m->inter;
    k = k > m->heads * m->head_dim ? k : m->heads * m->head_dim;
    return 2 * k; /* room for a repeat-2 input */
}

/* One attention work item of a step: a decode row's (chunk -1, its row, a kv head, part j
 * of the row's whole context in PART_LEN positions: paged_attention.c), or a prefill chunk's
 * (its index, a block of its query positions, a kv head; part 0). A layer whose window
 * leaves a row fewer parts skips the items past them; a row of one part is attended whole.
 * slot: where a part's result goes (parts of rows with several, in order), else -1. */
typedef struct {
    int32_t chunk, index, kvh, part, slot;
} AttnItem;

/* Checks the prefill chunks of a step: pairs (first row, row count), in row order, apart,
 * inside [0, B); each chunk's rows at consecutive positions of one sequence (same block
 * table, seq_lens one apart). Returns 0 when they are sound. */
static int check_chunks(const int32_t *chunks, int64_t n_chunks, int64_t B, const int32_t *block_tables,
                        int64_t bt_stride, int64_t bt_width, const int32_t *seq_lens) {
    int64_t next_free = 0;
    for (int64_t c = 0; c < n_chunks; c++) {
        const int64_t first = chunks[2 * c], count = chunks[2 * c + 1];
        if (first < next_free || count < 1 || first + count > B) return 1;
        next_free = first + count;
        const int64_t last = first + count - 1;
        const int32_t *table = block_tables + last * bt_stride;
        for (int64_t r = first; r < last; r++) {
            if (seq_lens[r] != seq_lens[last] - (last - r)) return 1;
            if (memcmp(block_tables + r * bt_stride, table, (size_t)bt_width * sizeof(int32_t))) return 1;
        }
    }
    return 0;
}

/* x[b] += rms_norm(y[b]) * w for this thread's share of the B rows (Gemma's norms of a
 * block's output before its residual add, in float32 as the eager model computes them). */
static void normed_add(float *x, float *y, const float *w, int64_t B, int64_t H, float eps, int t, int T) {
    for (int64_t b = t; b < B; b += T) {
        float *yb = y + b * H, *xb = x + b * H;
        rms_norm(yb, w, H, eps, yb);
#pragma omp simd
        for (int64_t i = 0; i < H; i++) xb[i] += yb[i];
    }
}

/* Whether some decode row of the step is attended in parts under the window in ``a``. */
static int layer_has_parts(const Args *a, const AttnItem *items, int64_t n_items) {
    for (int64_t i = 0; i < n_items; i++)
        if (items[i].chunk < 0 && items[i].part == 1 && item_parts(a, items[i].index) > 1) return 1;
    return 0;
}

/* The step's attention items: the chunks' first (the prefill kernel's larger items; later
 * query blocks, which see more keys, before earlier ones), then every other row's, one per
 * kv head. NULL when out of memory. */
static AttnItem *attention_items(const TmModel *m, int64_t B, const int32_t *seq_lens, const int32_t *chunks,
                                 int64_t n_chunks, int64_t *count, int64_t *slots) {
    const int64_t KVH = m->kv_heads, per_block = PF_ROWS / (m->heads / m->kv_heads);
    int64_t n = 0;
    for (int64_t c = 0; c < n_chunks; c++) n += (chunks[2 * c + 1] + per_block - 1) / per_block * KVH;
    for (int64_t b = 0, c = 0; b < B; b++) {
        if (c < n_chunks && b == chunks[2 * c]) {
            b += chunks[2 * c + 1] - 1, c++;
            continue;
        }
        n += parts_of(seq_lens[b]) * KVH;
    }
    AttnItem *items = (AttnItem *)malloc((size_t)(n > 0 ? n : 1) * sizeof(AttnItem));
    if (!items) return NULL;
    int64_t i = 0;
    for (int64_t c = 0; c < n_chunks; c++)
        for (int64_t blk = (chunks[2 * c + 1] + per_block - 1) / per_block - 1; blk >= 0; blk--)
            for (int64_t kvh = 0; kvh < KVH; kvh++)
                items[i++] = (AttnItem){(int32_t)c, (int32_t)blk, (int32_t)kvh, 0, -1};
    int64_t c = 0, slot = 0;
    for (int64_t b = 0; b < B; b++) {
        if (c < n_chunks && b == chunks[2 * c]) {
            b += chunks[2 * c + 1] - 1, c++;
            continue;
        }
        const int64_t P = parts_of(seq_lens[b]); /* the whole context's: a window can only leave fewer */
        for (int64_t kvh = 0; kvh < KVH; kvh++)
            for (int64_t j = 0; j < P; j++)
                items[i++] = (AttnItem){-1, (int32_t)b, (int32_t)kvh, (int32_t)j, P > 1 ? (int32_t)slot++ : -1};
    }
    *count = i;
    *slots = slot;
    return items;
}


/* One step of the model over B rows, every layer, the final norm and the head in one
 * OpenMP region.
 *
 * x: [B, hidden] float32 token embeddings (the residual stream, overwritten).
 * block_tables [B, bt_stride] int32, seq_lens [B] int32: each row's sequence's table and
 * its context length including the row's token (the row's position is seq_len - 1).
 * Every row's K/V is stored before any row attends, so rows of one sequence at
 * consecutive positions see each other's keys.
 * chunks [n_chunks, 2] int32: (first row, row count) of the prefill chunks, whose rows the
 * prefill kernel attends as one chunk, as the eager model's attention does; every other
 * row is attended by the decode kernel on its own (a decode, or a speculative proposal).
 * A quantized pool takes no chunks (its store requantizes a block's rows together).
 * logit_rows [n_logits] int32: the rows whose logits are wanted, into logits
 * [n_logits, vocab]; NULL: every row, logits [B, vocab].
 * Returns 0, 1 when an input lies outside the pool/tables/rotary range or the chunks are
 * not sound (nothing written), 2 when memory could not be allocated. */
/* What every thread of a step reads and none changes: the model, the step's inputs, its sizes,
 * its attention items and the buffers the threads share. */
typedef struct {
    const TmModel *m;
    float *x;
    int64_t B, bt_stride, n_chunks, n_segs, n_items, n_slots, rmax, max_len;
    const int32_t *block_tables, *seq_lens, *chunks;
    const TmSegment *segs;
    const AttnItem *items;
    int64_t H, D, NQ, NKV, NQKV, I, BS, G;
    int quant;
    float *qkv, *attn, *act, *lora_t, *block_out, *parts; /* [B, NQKV | NQ | I | rmax | H], then the parts */
    int64_t *work; /* per layer, the claim counters of its phases (see claim_chunk), then the head's */
} Step;

/* Per layer, the claim counters of its phases. */
enum { PH_QKV, PH_QKV_TAIL, PH_ATTEND, PH_COMBINE, PH_O, PH_GATE_UP, PH_DOWN, PHASES };

/* One thread's part of a step: its place among the threads, its scratch and its copy of the
 * attention arguments. ok is 0 when its scratch could not be allocated: it still reaches
 * every barrier, and only skips the work. */
typedef struct {
    int t, T, ok, sense;
    SpinBarrier *bar;
    float *buf, *h, *gate, *up; /* h: [B, H], this thread's normed copy of the residual stream */
    InputScratch is;
    Scratch sc;
    PrefillScratch ps;
    Args a;
} StepThread;

/* Checks a step's inputs (1: unsound, nothing written); sets its longest context and the
 * adapters' largest rank. */
static int check_step(const TmModel *m, int64_t B, const int32_t *block_tables, int64_t bt_stride, int64_t bt_width,
                      const int32_t *seq_lens, const int32_t *chunks, int64_t n_chunks, const int32_t *logit_rows,
                      int64_t n_out, const TmSegment *segs, int64_t n_segs, int64_t *max_len, int64_t *rmax) {
    const int64_t D = m->head_dim, G = m->heads / m->kv_heads;
    if (B <= 0 || D % VW || D > 512 || D % 2 || m->heads % m->kv_heads || m->cache_fmt < KV_F32 ||
        m->cache_fmt > KV_FP8 || n_chunks < 0 || (n_chunks && !chunks) || G > PF_ROWS)
        return 1;
    const int quant = m->cache_fmt >= KV_I8;
    if (quant && n_chunks) return 1;
    if (quant)
        for (int64_t li = 0; li < m->num_layers; li++)
            if (!m->layers[li].k_scale || !m->layers[li].v_scale) return 1;
    Args check = {0};
    check.block_tables = block_tables, check.seq_lens = seq_lens, check.bt_stride = bt_stride;
    check.heads = m->heads, check.kv_heads = m->kv_heads, check.head_dim = D;
    check.num_blocks = m->num_blocks, check.block_size = m->block_size;
    *max_len = check_args(&check, B, bt_width);
    if (*max_len < 0 || *max_len > m->max_positions) return 1;
    if (check_chunks(chunks, n_chunks, B, block_tables, bt_stride, bt_width, seq_lens)) return 1;
    if (n_out < 0 || n_out > B) return 1;
    for (int64_t i = 0; logit_rows && i < n_out; i++)
        if (logit_rows[i] < 0 || logit_rows[i] >= B) return 1;
    *rmax = check_segments(m, segs, n_segs, B);
    return *rmax < 0;
}

/* This thread's scratch, carved from one allocation (th->buf; NULL: th->ok is 0). */
TM_INLINE void thread_scratch(const Step *s, StepThread *th) {
    const int64_t B = s->B, D = s->D, G = s->G, KM = max_k(s->m);
    const size_t att_floats = (size_t)(2 * G * D + G + VW * D + D + G * (s->max_len < PART_LEN ? s->max_len : PART_LEN));
    /* int4_q8_tile's / int8_vnni_rows' input (up to two planes of B + 3 rows) and its scales
     * (per 32 columns for up to B + 3 rows: int8g_vnni_rows reads its padding rows' too) */
    const size_t q8_floats = ((size_t)2 * (B + 3) * KM * TM_ACT_BYTES + 3) / 4 + (size_t)(B + 3) * KM / 32;
    const size_t pf_floats = s->n_chunks ? (PREFILL_SCRATCH_FLOATS(D) + 15) / 16 * 16 : 0;
    const size_t floats = pf_floats + (size_t)B * s->H + 2 * (size_t)B * KM + 2 * (size_t)B * GU_COLS + att_floats +
                          VW * KM + q8_floats;
    float *buf = (float *)aligned_alloc(64, (floats * 4 + 63) / 64 * 64);
    th->buf = buf;
    th->ok = buf != NULL;
    if (th->ok && s->n_chunks) th->ps = prefill_scratch(buf, D);
    th->h = buf + pf_floats;
    th->is = (InputScratch){th->h + B * s->H, th->h + B * s->H + B * KM};
    th->gate = th->is.xsum + B * KM, th->up = th->gate + B * GU_COLS; /* [B, GU_COLS]: gate / up rows */
    float *att = th->up + B * GU_COLS;
    th->is.wtile = att + att_floats;
    th->is.xq = (int8_t *)(th->is.wtile + VW * KM);
    th->is.xd = th->is.wtile + VW * KM + ((size_t)2 * (B + 3) * KM * TM_ACT_BYTES + 3) / 4;
    if (th->ok) {
        float *zero = att + 2 * G * D + G + VW * D;
        memset(zero, 0, D * sizeof(float));
        th->sc = (Scratch){att, att + G * D, att + 2 * G * D, att + 2 * G * D + G, zero, zero + D, -1, -1};
    }
    const TmModel *m = s->m;
    th->a = (Args){s->qkv, NULL, NULL, s->block_tables, s->seq_lens, s->attn, s->NQKV, s->NQ, s->bt_stride,
                   m->heads, m->kv_heads, D, m->num_blocks, s->BS, m->scale};
}

/* The adapters' updates of a projection's output once the base output and every x a^T are
 * whole: this thread's share of its N columns, then a barrier. */
TM_INLINE void step_lora_expand(const Step *s, StepThread *th, int64_t li, int proj, int64_t N, float *y,
                                int64_t ldy) {
    int64_t c0, c1;
    lora_columns(N, th->t, th->T, &c0, &c1);
    if (th->ok) lora_expand(s->segs, s->n_segs, li, proj, N, s->lora_t, s->rmax, c0, c1, y, ldy, 0);
    barrier_wait(th->bar, &th->sense);
}

/* 1. q/k/v projection of the normed input; the threads claim its rows. */
TM_INLINE void layer_qkv(const Step *s, StepThread *th, int64_t li) {
    const TmModel *m = s->m;
    const TmLayer *L = &m->layers[li];
    const int64_t B = s->B, H = s->H;
    if (th->ok) {
        for (int64_t b = 0; b < B; b++) rms_norm(s->x + b * H, L->input_norm, H, m->eps, th->h + b * H);
        thread_linear(&L->qkv, th->h, H, B, &th->is, &s->work[li * PHASES + PH_QKV], th->T, s->qkv, s->NQKV, 0);
        if (L->qkv_tail.n)
            thread_linear(&L->qkv_tail, th->h, H, B, &th->is, &s->work[li * PHASES + PH_QKV_TAIL], th->T,
                          s->qkv + L->qkv.n, s->NQKV, 0);
        if (s->n_segs) lora_shrink(s->segs, s->n_segs, li, LORA_QKV, H, th->h, H, s->lora_t, s->rmax, th->t, th->T);
    }
    barrier_wait(th->bar, &th->sense);
    if (s->n_segs) step_lora_expand(s, th, li, LORA_QKV, s->NQKV, s->qkv, s->NQKV);
}

/* 2. per (row, kv head): norms, rotary, K/V into the pool. A quantized store may rewrite its
 * block's earlier rows and scale: rows that share a block (a speculative verify's) go to one
 * thread, in order, picked by block and head; otherwise items go round robin. */
TM_INLINE void layer_store_kv(const Step *s, StepThread *th, const TmLayer *L) {
    const TmModel *m = s->m;
    const int64_t D = s->D, BS = s->BS, G = s->G, NQ = s->NQ, NKV = s->NKV, NQKV = s->NQKV;
    const int quant = s->quant, t = th->t, T = th->T;
    const int32_t *block_tables = s->block_tables, *seq_lens = s->seq_lens;
    for (int64_t it = quant ? 0 : t; it < s->B * m->kv_heads; it += quant ? 1 : T) {
        const int64_t b = it / m->kv_heads, kvh = it % m->kv_heads;
        const int64_t pos = seq_lens[b] - 1;
        if (quant && (block_tables[b * s->bt_stride + pos / BS] * m->kv_heads + kvh) % T != t) continue;
        const float *cs = (L->cos ? L->cos : m->cos) + pos * D;
        const float *sn = (L->sin ? L->sin : m->sin) + pos * D;
        float *row = s->qkv + b * NQKV;
        for (int64_t gq = 0; gq < G; gq++) {
            float *q = row + (kvh * G + gq) * D;
            if (L->q_norm) rms_norm(q, L->q_norm, D, m->eps, q);
            rope_head(q, cs, sn, D);
        }
        float *k = row + NQ + kvh * D, *v = row + NQ + NKV + kvh * D;
        if (L->k_norm) rms_norm(k, L->k_norm, D, m->eps, k);
        rope_head(k, cs, sn, D);
        const int32_t *table = block_tables + b * s->bt_stride;
        const size_t slot = (size_t)table[pos / BS] * BS + pos % BS;
        if (quant) {
            const size_t head = (size_t)kvh * m->num_blocks;
            const int64_t blk = table[pos / BS], fp8 = m->cache_fmt == KV_FP8;
            store_quant((uint8_t *)L->k_cache + head * BS * D, L->k_scale + head, blk, BS, D, pos % BS, 1, k, D, 0,
                        (int)fp8);
            store_quant((uint8_t *)L->v_cache + head * BS * D, L->v_scale + head, blk, BS, D, pos % BS, 1, v, D, 0,
                        (int)fp8);
            continue;
        }
        const size_t off = ((size_t)kvh * m->num_blocks * BS + slot) * D;
        store_row(L->k_cache, m->cache_fmt == KV_BF16, off, k, D);
        store_row(L->v_cache, m->cache_fmt == KV_BF16, off, v, D);
    }
}

/* 3. attention: the threads claim the step's items (attention_items). */
TM_INLINE void layer_attend(const Step *s, StepThread *th, const TmLayer *L, int64_t li) {
    const TmModel *m = s->m;
    const AttnItem *items = s->items;
    const int64_t G = s->G, D = s->D;
    int64_t it, end;
    while ((it = claim_chunk(&s->work[li * PHASES + PH_ATTEND], s->n_items, th->T, 1, &end)) >= 0)
        for (; it < end; it++) {
            const AttnItem *ai = &items[it];
            if (ai->chunk < 0) {
                const int64_t P = item_parts(&th->a, ai->index); /* under this layer's window */
                if (ai->part >= P) continue;
                if (P > 1) {
                    int64_t p0, p1;
                    part_range(&th->a, ai->index, ai->part, &p0, &p1);
                    attend_range(&th->a, ai->index, ai->kvh, m->cache_fmt, 0, &th->sc, p0, p1,
                                 s->parts + (size_t)ai->slot * PART_FLOATS(G, D));
                    continue;
                }
                const AttnItem *nx =
                    it + 1 < end && items[it + 1].chunk < 0 && items[it + 1].part == 0 ? &items[it + 1] : NULL;
                th->sc.next_item = nx ? (int64_t)nx->index * m->kv_heads + nx->kvh : -1;
                attend_dispatch(&th->a, ai->index, ai->kvh, m->cache_fmt, 0, &th->sc);
                continue;
            }
            const int64_t first = s->chunks[2 * ai->chunk], count = s->chunks[2 * ai->chunk + 1];
            const int64_t last = first + count - 1, per_block = PF_ROWS / G;
            const int64_t p0 = (int64_t)ai->index * per_block;
            const PrefillArgs pa = {s->qkv + first * s->NQKV, L->k_cache, L->v_cache,
                                    s->block_tables + last * s->bt_stride, s->attn + first * s->NQ, s->NQKV, s->NQ,
                                    m->heads, m->kv_heads, D, m->num_blocks, s->BS, s->seq_lens[last], count,
                                    m->scale, L->k_scale, L->v_scale, L->window};
            prefill_dispatch(&pa, ai->kvh, p0, count - p0 < per_block ? count - p0 : per_block, m->cache_fmt, 0,
                             &th->ps);
        }
}

/* 3b. rows attended in parts under this layer's window: their parts combined. */
TM_INLINE void layer_combine(const Step *s, StepThread *th, int64_t li) {
    int64_t it, end;
    while ((it = claim_chunk(&s->work[li * PHASES + PH_COMBINE], s->n_items, th->T, 1, &end)) >= 0)
        for (; it < end; it++) {
            const AttnItem *ai = &s->items[it];
            if (ai->chunk >= 0 || ai->part != 0) continue;
            const int64_t P = item_parts(&th->a, ai->index);
            if (P > 1)
                combine_parts(&th->a, ai->index, ai->kvh, s->parts + (size_t)ai->slot * PART_FLOATS(s->G, s->D), P, 0,
                              th->sc.acc);
        }
}

/* 2 and 3: every row's K/V is in the pool before anyone attends. */
TM_INLINE void layer_attention(const Step *s, StepThread *th, int64_t li) {
    const TmLayer *L = &s->m->layers[li];
    if (th->ok) {
        th->a.k_cache = L->k_cache, th->a.v_cache = L->v_cache;
        th->a.k_scale = L->k_scale, th->a.v_scale = L->v_scale;
        th->a.window = L->window;
        layer_store_kv(s, th, L);
    }
    barrier_wait(th->bar, &th->sense);
    if (th->ok) layer_attend(s, th, L, li);
    barrier_wait(th->bar, &th->sense);
    th->a.window = L->window; /* (every thread decides alike, allocation failed or not) */
    if (s->n_slots && layer_has_parts(&th->a, s->items, s->n_items)) {
        if (th->ok) layer_combine(s, th, li);
        barrier_wait(th->bar, &th->sense);
    }
}

/* A projection of the layer added into the residual stream (or, where the layer norms the
 * block's output first, written out, normed and added: normed_add): 4. o, or 6. down. */
TM_INLINE void layer_residual(const Step *s, StepThread *th, int64_t li, const TmLinear *P, int proj, const float *in,
                              int64_t ld_in, const float *out_norm, int phase) {
    const TmModel *m = s->m;
    const int64_t B = s->B, H = s->H;
    float *out = out_norm ? s->block_out : s->x;
    if (th->ok) {
        thread_linear(P, in, ld_in, B, &th->is, &s->work[li * PHASES + phase], th->T, out, H, !out_norm);
        if (s->n_segs) lora_shrink(s->segs, s->n_segs, li, proj, ld_in, in, ld_in, s->lora_t, s->rmax, th->t, th->T);
    }
    barrier_wait(th->bar, &th->sense);
    if (s->n_segs) step_lora_expand(s, th, li, proj, H, out, H);
    if (out_norm) {
        if (th->ok) normed_add(s->x, s->block_out, out_norm, B, H, m->eps, th->t, th->T);
        barrier_wait(th->bar, &th->sense);
    }
}

/* 5. gate and up rows of the same features on the same thread, then SiLU(gate) * up. */
TM_INLINE void layer_gate_up(const Step *s, StepThread *th, int64_t li) {
    const TmModel *m = s->m;
    const TmLayer *L = &m->layers[li];
    const int64_t B = s->B, H = s->H, I = s->I;
    if (th->ok) {
        for (int64_t b = 0; b < B; b++) rms_norm(s->x + b * H, L->post_norm, H, m->eps, th->h + b * H);
        if (s->n_segs)
            lora_shrink(s->segs, s->n_segs, li, LORA_GATE_UP, H, th->h, H, s->lora_t, s->rmax, th->t, th->T);
    }
    if (s->n_segs) barrier_wait(th->bar, &th->sense); /* every adapted row's h a^T before a tile adds its share */
    if (th->ok) {
        int64_t ldx, n0, n1;
        float *gate = th->gate, *up = th->up;
        const float *xin = prepare_input(&L->gate_up, th->h, H, B, &th->is, &ldx);
        while (claim_rows(&s->work[li * PHASES + PH_GATE_UP], I, th->T, &n0, &n1))
            for (int64_t c0 = n0; c0 < n1; c0 += GU_COLS) {
                const int64_t c1 = c0 + GU_COLS < n1 ? c0 + GU_COLS : n1;
                /* rows c0..c1 of gate, and of up (I rows further), as [B, GU_COLS] */
                linear_rows(&L->gate_up, xin, ldx, &th->is, B, c0, c1, gate, GU_COLS, 0, c0);
                linear_rows(&L->gate_up, xin, ldx, &th->is, B, I + c0, I + c1, up, GU_COLS, 0, I + c0);
                if (s->n_segs) {
                    lora_expand(s->segs, s->n_segs, li, LORA_GATE_UP, 2 * I, s->lora_t, s->rmax, c0, c1, gate,
                                GU_COLS, c0);
                    lora_expand(s->segs, s->n_segs, li, LORA_GATE_UP, 2 * I, s->lora_t, s->rmax, I + c0, I + c1, up,
                                GU_COLS, I + c0);
                }
                for (int64_t b = 0; b < B; b++)
                    if (m->act == ACT_GELU_TANH)
                        gelu_tanh_mul(gate + b * GU_COLS, up + b * GU_COLS, s->act + b * I + c0, c1 - c0);
                    else
                        silu_mul(gate + b * GU_COLS, up + b * GU_COLS, s->act + b * I + c0, c1 - c0);
            }
    }
    barrier_wait(th->bar, &th->sense);
}

/* One thread's whole step: every layer, then the final norm of the rows whose logits are
 * wanted (every thread its own copy) and the head. */
TM_INLINE void step_thread(const Step *s, StepThread *th, const int32_t *logit_rows, int64_t n_out, float *logits) {
    const TmModel *m = s->m;
    const int64_t H = s->H;
    thread_scratch(s, th);
    for (int64_t li = 0; li < m->num_layers; li++) {
        const TmLayer *L = &m->layers[li];
        layer_qkv(s, th, li);
        layer_attention(s, th, li);
        layer_residual(s, th, li, &L->o, LORA_O, s->attn, s->NQ, L->attn_out_norm, PH_O);
        layer_gate_up(s, th, li);
        layer_residual(s, th, li, &L->down, LORA_DOWN, s->act, s->I, L->mlp_out_norm, PH_DOWN);
    }
    if (th->ok && n_out > 0) {
        for (int64_t i = 0; i < n_out; i++)
            rms_norm(s->x + (logit_rows ? logit_rows[i] : i) * H, m->final_norm, H, m->eps, th->h + i * H);
        thread_linear(&m->head, th->h, H, n_out, &th->is, &s->work[m->num_layers * PHASES], th->T, logits,
                      m->head.n, 0);
    }
    free(th->buf);
}

int tm_model_step(const TmModel *m, float *x, int64_t B, const int32_t *block_tables, int64_t bt_stride,
                  int64_t bt_width, const int32_t *seq_lens, const int32_t *chunks, int64_t n_chunks,
                  const int32_t *logit_rows, int64_t n_logits, float *logits, const TmSegment *segs,
                  int64_t n_segs, int num_threads) {
    const int64_t n_out = logit_rows ? n_logits : B;
    int64_t max_len = 0, rmax = 0;
    if (check_step(m, B, block_tables, bt_stride, bt_width, seq_lens, chunks, n_chunks, logit_rows, n_out, segs,
                   n_segs, &max_len, &rmax))
        return 1;
    const int64_t D = m->head_dim, NQ = m->heads * D, NKV = m->kv_heads * D, H = m->hidden, I = m->inter;
    Step s = {m, x, B, bt_stride, n_chunks, n_segs, 0, 0, rmax, max_len, block_tables, seq_lens, chunks, segs,
              NULL, H, D, NQ, NKV, NQ + 2 * NKV, I, m->block_size, m->heads / m->kv_heads,
              m->cache_fmt >= KV_I8};
    AttnItem *items = attention_items(m, B, seq_lens, chunks, n_chunks, &s.n_items, &s.n_slots);
    s.items = items;
    /* [B, NQKV | NQ | I] shared, then [B, rmax]: each adapted row's x a^T (lora_shrink), then
     * the parts' results of rows attended in parts */
    const size_t part_floats = (size_t)s.n_slots * PART_FLOATS(s.G, D);
    /* and [B, H] for a block's output that is normed before its residual add (Gemma) */
    s.qkv = (float *)aligned_alloc(64, (((size_t)B * (s.NQKV + NQ + I + rmax + H) + part_floats) * 4 + 63) / 64 * 64);
    s.work = (int64_t *)calloc((size_t)m->num_layers * PHASES + 1, sizeof(int64_t));
    if (!items || !s.qkv || !s.work) {
        free(items);
        free(s.qkv);
        free(s.work);
        return 2;
    }
    s.attn = s.qkv + B * s.NQKV, s.act = s.attn + B * NQ, s.lora_t = s.act + B * I, s.block_out = s.lora_t + B * rmax;
    s.parts = s.block_out + B * H;
    if (num_threads < 1) num_threads = 1;
    SpinBarrier bar = {0, 0, num_threads};
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
#pragma omp single
        bar.n = omp_get_num_threads(); /* the implicit barrier publishes it */
        StepThread th = {omp_get_thread_num(), bar.n, 0, 0, &bar};
        step_thread(&s, &th, logit_rows, n_out, logits);
        failed = !th.ok;
    }
    free(items);
    free(s.work);
    free(s.qkv);
    return failed ? 2 : 0;
}

/* Lets the loader check that the struct layouts match. */
int64_t tm_decode_struct_sizes(void) {
    return (int64_t)sizeof(TmLinear) * 1000000 + (int64_t)sizeof(TmLayer) * 1000 + (int64_t)sizeof(TmModel);
}
