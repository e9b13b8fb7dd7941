/* Causal attention for one prefill chunk, reading the paged KV cache in place.
 *
 * Follows paged_attention.c in the library's one unit (kernels.c) (one library; it reuses
 * that file's vector type, loads, bf16 conversions and exp_nonpos).
 *
 * The chunk's queries sit at absolute positions seq_len - q_len ... seq_len - 1
 * and query p sees keys 0 ... p. For every query head h (kv head h / group):
 *     out[p, h, :] = softmax(scale * q[p, h] . K[:p + 1]) @ V[:p + 1]
 * where row j of K is k_cache[kv, table[j / bs], j % bs, :]. In a sliding-window
 * layer (window > 0) query p sees keys p - window + 1 ... p only: key blocks wholly
 * before a tile's window are skipped, and only blocks that cross a row's window
 * edge are masked there.
 * The pool may be quantized (int8 / fp8 codes with per-block scales, see
 * paged_attention.c): key blocks are widened to float32 as they are loaded.
 *
 * Why not torch's SDPA: its CPU flash kernel ran SmolLM2's shapes (9 query
 * heads, 3 kv heads, head_dim 64) well below the dense matmuls' rate (see
 * docs/performance.md), and a chunk after a cached
 * prefix first had to gather K/V out of the pool into contiguous copies. Here
 * both matmuls are register tiles like the dense ones in dense.c:
 *
 * - an item is (kv head, block of query positions); its rows are the block's
 *   positions x the group's query heads, position-major, in float32;
 * - keys go in blocks of KB = 4 vectors of positions: the block's K rows are
 *   transposed once into Kt[d][key] (shared by every row of the item) and its
 *   V rows copied into Vs[key][d];
 * - scores: TR rows x KB keys, TR x 4 accumulators, one broadcast of q[r][d]
 *   per row and 4 loads of Kt per d;
 * - scale, then online softmax per row (running max and sum, earlier output
 *   rescaled); scaling the scores rather than q keeps peaked scores as exact
 *   as the reference's;
 * - output: TR rows x 4 vectors of head_dim, one broadcast of p[r][key] per
 *   row and 4 loads of V per key.
 * Key blocks past a tile's last position are skipped (causal), and only blocks
 * that cross a row's own position are masked. All arithmetic is float32, except
 * over a bf16 pool on a CPU with AVX512-BF16, which multiplies bf16 pairs as
 * decode attention does (ROWS_BF16_DOT): K transposed into pairs of dimensions,
 * V into pairs of keys, q and the softmax weights rounded to bf16, sums float32.
 */
#include "tm_kernels.h"

#if VW == 16
#define PF_TR 6 /* rows per register tile: 6 x 4 accumulators of 16 floats */
#else
#define PF_TR 3 /* 8-float vectors, 16 registers */
#endif
#define PF_NV 4            /* vectors of keys per score tile, of head_dim per output tile */
#define PF_KB (PF_NV * VW) /* keys per block */
#define PF_ROWS 192        /* query rows (positions x group heads) per item, at most: 64 positions of
                              * SmolLM2's 3-head groups: smaller items measured slower, larger ones
                              * slower on a short chunk after a prefix (docs/performance.md) */

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int32_t *table;
    void *out;
    int64_t q_stride, out_stride; /* elements between consecutive positions' rows */
    int64_t heads, kv_heads, head_dim, num_blocks, block_size, seq_len, q_len;
    float scale;
    const float *k_scale, *v_scale; /* quantized pools: [kv_heads, num_blocks] */
    int64_t window;                 /* sliding window (keys before p - window + 1 unseen); 0: none */
} PrefillArgs;

typedef struct {
    float *q;     /* PF_ROWS x D: the item's queries */
    float *o;     /* PF_ROWS x D: unnormalised output */
    float *m, *l; /* PF_ROWS: running max and sum of exp */
    float *kt;    /* D x PF_KB: a key block, transposed */
    float *vs;    /* PF_KB x D: the block's values */
    float *p;     /* PF_TR x PF_KB: a tile's probabilities */
    float *alpha; /* PF_TR: a tile's rescale factors */
} PrefillScratch;

/* Scores of rows r0 .. r0 + NR - 1 against the key block (keys past nk are
 * zero rows of Kt; the caller masks them). */
TM_INLINE void prefill_scores(const float *restrict q, const float *restrict kt, int64_t D, int NR, float *s) {
    vf acc[PF_TR][PF_NV];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < PF_NV; c++) acc[r][c] = (vf){0};
    for (int64_t d = 0; d < D; d++) {
        vf k[PF_NV];
        for (int c = 0; c < PF_NV; c++) k[c] = vload(kt + d * PF_KB + c * VW);
        for (int r = 0; r < NR; r++) {
            const float qv = q[r * D + d];
            for (int c = 0; c < PF_NV; c++) acc[r][c] += qv * k[c];
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < PF_NV; c++) vstore(s + r * PF_KB + c * VW, acc[r][c]);
}

/* o[r] = o[r] * alpha[r] + sum over keys j < nk of p[r][j] * vs[j], for NR rows. */
TM_INLINE void prefill_output(float *restrict o, const float *restrict p, const float *restrict alpha,
                              const float *restrict vs, int64_t D, int64_t nk, int NR) {
    for (int64_t c0 = 0; c0 < D; c0 += PF_NV * VW) {
        const int nv = (D - c0) / VW < PF_NV ? (int)((D - c0) / VW) : PF_NV;
        vf acc[PF_TR][PF_NV];
        for (int r = 0; r < NR; r++)
            for (int c = 0; c < nv; c++) acc[r][c] = vload(o + r * D + c0 + c * VW) * alpha[r];
        for (int64_t j = 0; j < nk; j++) {
            vf v[PF_NV];
            for (int c = 0; c < nv; c++) v[c] = vload(vs + j * D + c0 + c * VW);
            for (int r = 0; r < NR; r++) {
                const float pj = p[r * PF_KB + j];
                for (int c = 0; c < nv; c++) acc[r][c] += pj * v[c];
            }
        }
        for (int r = 0; r < NR; r++)
            for (int c = 0; c < nv; c++) vstore(o + r * D + c0 + c * VW, acc[r][c]);
    }
}

#ifdef TM_BF16_DOT
/* prefill_scores with bf16 products (ROWS_BF16_DOT in paged_attention.c): kt2 holds the
 * key block as [D / 2][PF_KB] pairs (K[key][2i], K[key][2i + 1]), q2 each row's query as
 * D / 2 such pairs; one vdpbf16ps per pair of dimensions does two FMAs' work. */
TM_INLINE void prefill_scores_bf16(const uint32_t *restrict q2, const uint32_t *restrict kt2, int64_t D, int NR,
                                   float *s) {
    __m512 acc[PF_TR][PF_NV];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < PF_NV; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t d2 = 0; d2 < D / 2; d2++) {
        __m512bh k[PF_NV];
        for (int c = 0; c < PF_NV; c++) k[c] = (__m512bh)_mm512_loadu_si512(kt2 + d2 * PF_KB + c * VW);
        for (int r = 0; r < NR; r++) {
            const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)q2[r * (D / 2) + d2]);
            for (int c = 0; c < PF_NV; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], k[c], qv);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < PF_NV; c++) _mm512_storeu_ps(s + r * PF_KB + c * VW, acc[r][c]);
}

/* prefill_output with bf16 products: vs2 holds the block's values as [PF_KB / 2][D]
 * pairs (V[2j][d], V[2j + 1][d]); p's rows are bf16 values already (prefill_softmax
 * rounded them), paired up (p[r][2j], p[r][2j + 1]) by one conversion per 16. */
TM_INLINE void prefill_output_bf16(float *restrict o, const float *restrict p, const float *restrict alpha,
                                   const uint32_t *restrict vs2, int64_t D, int64_t nk, int NR) {
    uint32_t pp[PF_TR][PF_KB / 2];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < PF_NV; c++)
            _mm256_storeu_si256((__m256i *)(pp[r] + c * VW / 2),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p + r * PF_KB + c * VW)));
    const int64_t pairs = (nk + 1) / 2;
    for (int64_t c0 = 0; c0 < D; c0 += PF_NV * VW) {
        const int nv = (D - c0) / VW < PF_NV ? (int)((D - c0) / VW) : PF_NV;
        __m512 acc[PF_TR][PF_NV];
        for (int r = 0; r < NR; r++)
            for (int c = 0; c < nv; c++)
                acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + c0 + c * VW), _mm512_set1_ps(alpha[r]));
        for (int64_t j2 = 0; j2 < pairs; j2++) {
            __m512bh v[PF_NV];
            for (int c = 0; c < nv; c++) v[c] = (__m512bh)_mm512_loadu_si512(vs2 + j2 * D + c0 + c * VW);
            for (int r = 0; r < NR; r++) {
                const __m512bh pv = (__m512bh)_mm512_set1_epi32((int)pp[r][j2]);
                for (int c = 0; c < nv; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], v[c], pv);
            }
        }
        for (int r = 0; r < NR; r++)
            for (int c = 0; c < nv; c++) _mm512_storeu_ps(o + r * D + c0 + c * VW, acc[r][c]);
    }
}
#endif

/* Scores -> probabilities for NR rows, in place in s, updating
 * the running max and sum. Row r's query is at absolute position pos[r]; key j
 * of the block at kb0 + j is visible when kb0 + j <= pos[r], j < nk and (window > 0)
 * kb0 + j > pos[r] - window. */
TM_INLINE void prefill_softmax(float *restrict s, float *restrict m, float *restrict l, float *restrict alpha,
                               const int64_t *pos, int64_t kb0, int64_t nk, float scale, int NR, const int dot,
                               int64_t window) {
    for (int r = 0; r < NR; r++) {
        float *restrict sr = s + r * PF_KB;
        int64_t visible = pos[r] - kb0 + 1;
        if (visible > nk) visible = nk;
        const int64_t first = window > 0 && pos[r] - window + 1 > kb0 ? pos[r] - window + 1 - kb0 : 0;
        if (visible <= first) { /* the whole block is in this row's future, or before its window */
            alpha[r] = 1.0f;
            memset(sr, 0, PF_KB * sizeof(float));
            continue;
        }
#pragma omp simd
        for (int64_t j = 0; j < PF_KB; j++) sr[j] = j < visible && j >= first ? sr[j] * scale : -INFINITY;
        float mx = m[r];
#pragma omp simd reduction(max : mx)
        for (int64_t j = 0; j < PF_KB; j++) mx = sr[j] > mx ? sr[j] : mx;
        const float a = exp_nonpos(m[r] - mx); /* 0 when m[r] is still -inf */
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < PF_KB; j++) {
            float e = j < visible && j >= first ? exp_nonpos(sr[j] - mx) : 0.0f;
            if (dot) e = round_bf16(e); /* bf16 products: the weights summed are those multiplied */
            sr[j] = e;
            sum += e;
        }
        l[r] = l[r] * a + sum;
        m[r] = mx;
        alpha[r] = a;
    }
}

/* Key block kb0 .. kb0 + nk - 1 of one kv head: K transposed into kt, V into vs
 * (float32), zeros past nk. fmt: the pool's format (KV_*). */
TM_INLINE void prefill_load_block(const PrefillArgs *a, int64_t kvh, int64_t kb0, int64_t nk, int fmt,
                                  PrefillScratch *sc) {
    const int64_t D = a->head_dim, BS = a->block_size;
    const size_t esize = kv_esize(fmt);
    const size_t head_bytes = (size_t)a->num_blocks * BS * D * esize;
    const char *kbase = (const char *)a->k_cache + kvh * head_bytes;
    const char *vbase = (const char *)a->v_cache + kvh * head_bytes;
    for (int64_t j = 0; j < PF_KB; j++) {
        float *restrict vrow = sc->vs + j * D;
        if (j >= nk) {
            for (int64_t d = 0; d < D; d++) sc->kt[d * PF_KB + j] = 0.0f;
            memset(vrow, 0, D * sizeof(float));
            continue;
        }
        const int64_t key = kb0 + j;
        const int64_t blk = a->table[key / BS];
        const size_t off = ((size_t)blk * BS + key % BS) * D * esize;
        if (fmt == KV_BF16) {
            const uint16_t *krow = (const uint16_t *)(kbase + off), *vsrc = (const uint16_t *)(vbase + off);
            for (int64_t d = 0; d < D; d++) sc->kt[d * PF_KB + j] = bf16_to_f32(krow[d]);
#pragma omp simd
            for (int64_t d = 0; d < D; d++) vrow[d] = bf16_to_f32(vsrc[d]);
        } else if (fmt != KV_F32) {
            const int64_t si = kvh * a->num_blocks + blk;
            float krow[512]; /* head_dim <= 512 (checked by the entry point) */
            widen_row(kbase + off, fmt, a->k_scale[si], D, krow);
            for (int64_t d = 0; d < D; d++) sc->kt[d * PF_KB + j] = krow[d];
            widen_row(vbase + off, fmt, a->v_scale[si], D, vrow);
        } else {
            const float *krow = (const float *)(kbase + off);
            for (int64_t d = 0; d < D; d++) sc->kt[d * PF_KB + j] = krow[d];
            memcpy(vrow, vbase + off, D * sizeof(float));
        }
    }
}

#ifdef TM_BF16_DOT
/* prefill_load_block for a bf16 pool under bf16 products: K as [D / 2][PF_KB] pairs of
 * dimensions (a transpose of 32-bit words), V as [PF_KB / 2][D] pairs of keys, zeros
 * past nk. */
TM_INLINE void prefill_load_block_bf16(const PrefillArgs *a, int64_t kvh, int64_t kb0, int64_t nk,
                                       PrefillScratch *sc) {
    static const uint16_t zeros[512] = {0};
    const int64_t D = a->head_dim, BS = a->block_size;
    const size_t head_bytes = (size_t)a->num_blocks * BS * D * 2;
    const char *kbase = (const char *)a->k_cache + kvh * head_bytes;
    const char *vbase = (const char *)a->v_cache + kvh * head_bytes;
    uint32_t *restrict kt2 = (uint32_t *)sc->kt, *restrict vs2 = (uint32_t *)sc->vs;
    const uint16_t *vrows[PF_KB];
    for (int64_t j = 0; j < PF_KB; j++) {
        if (j >= nk) {
            for (int64_t d2 = 0; d2 < D / 2; d2++) kt2[d2 * PF_KB + j] = 0;
            vrows[j] = zeros;
            continue;
        }
        const int64_t key = kb0 + j;
        const size_t off = ((size_t)a->table[key / BS] * BS + key % BS) * D * 2;
        const uint32_t *krow = (const uint32_t *)(kbase + off);
        for (int64_t d2 = 0; d2 < D / 2; d2++) kt2[d2 * PF_KB + j] = krow[d2];
        vrows[j] = (const uint16_t *)(vbase + off);
    }
    for (int64_t j2 = 0; j2 < PF_KB / 2; j2++) {
        const uint16_t *restrict v0 = vrows[2 * j2], *restrict v1 = vrows[2 * j2 + 1];
        uint32_t *restrict dst = vs2 + j2 * D;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) dst[d] = (uint32_t)v0[d] | (uint32_t)v1[d] << 16;
    }
}
#endif

/* One item: kv head kvh, query positions p0 .. p0 + np - 1 of the chunk. ``dot``: a
 * bf16 pool read with bf16 products (prefill_*_bf16), else float32 arithmetic. */
TM_INLINE void prefill_item(const PrefillArgs *a, int64_t kvh, int64_t p0, int64_t np, int fmt, int bf16,
                            int64_t D, const int dot, PrefillScratch *sc) {
    const int64_t G = a->heads / a->kv_heads;
    const int64_t R = np * G;
    const int64_t first_abs = a->seq_len - a->q_len; /* absolute position of the chunk's query 0 */
    int64_t pos[PF_ROWS];
    for (int64_t r = 0; r < R; r++) {
        const int64_t p = p0 + r / G, h = kvh * G + r % G;
        pos[r] = first_abs + p;
        float *restrict qr = sc->q + r * D;
        if (dot) { /* the query as bf16, rows of D at the start of sc->q */
            uint16_t *restrict qh = (uint16_t *)sc->q + r * D;
            if (bf16) {
                memcpy(qh, (const uint16_t *)a->q + p * a->q_stride + h * D, D * sizeof(uint16_t));
            } else {
                const float *src = (const float *)a->q + p * a->q_stride + h * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) qh[d] = f32_to_bf16(src[d]);
            }
        } else if (bf16) {
            const uint16_t *src = (const uint16_t *)a->q + p * a->q_stride + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) qr[d] = bf16_to_f32(src[d]);
        } else {
            const float *src = (const float *)a->q + p * a->q_stride + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) qr[d] = src[d];
        }
        sc->m[r] = -INFINITY;
        sc->l[r] = 0.0f;
    }
    memset(sc->o, 0, R * D * sizeof(float));
    const int64_t keys = pos[R - 1] + 1; /* the last row sees the most */
    const int64_t W = a->window;
    const int64_t key0 = W > 0 && pos[0] - W + 1 > 0 ? pos[0] - W + 1 : 0; /* the first row's window */
    for (int64_t kb0 = key0; kb0 < keys; kb0 += PF_KB) {
        const int64_t nk = keys - kb0 < PF_KB ? keys - kb0 : PF_KB;
#ifdef TM_BF16_DOT
        if (dot)
            prefill_load_block_bf16(a, kvh, kb0, nk, sc);
        else
#endif
            prefill_load_block(a, kvh, kb0, nk, fmt, sc);
        for (int64_t r0 = 0; r0 < R; r0 += PF_TR) {
            const int nr = R - r0 < PF_TR ? (int)(R - r0) : PF_TR;
            if (pos[r0 + nr - 1] < kb0) continue; /* every row of the tile is before this block */
            if (W > 0 && pos[r0] - W + 1 >= kb0 + nk) continue; /* the block is before every row's window */
            float *s = sc->p;
#ifdef TM_BF16_DOT
            if (dot) {
                const uint32_t *q2 = (const uint32_t *)sc->q + r0 * (D / 2);
                if (nr == PF_TR)
                    prefill_scores_bf16(q2, (const uint32_t *)sc->kt, D, PF_TR, s);
                else
                    prefill_scores_bf16(q2, (const uint32_t *)sc->kt, D, nr, s);
                prefill_softmax(s, sc->m + r0, sc->l + r0, sc->alpha, pos + r0, kb0, nk, a->scale, nr, 1, W);
                if (nr == PF_TR)
                    prefill_output_bf16(sc->o + r0 * D, s, sc->alpha, (const uint32_t *)sc->vs, D, nk, PF_TR);
                else
                    prefill_output_bf16(sc->o + r0 * D, s, sc->alpha, (const uint32_t *)sc->vs, D, nk, nr);
                continue;
            }
#endif
            if (nr == PF_TR)
                prefill_scores(sc->q + r0 * D, sc->kt, D, PF_TR, s);
            else
                prefill_scores(sc->q + r0 * D, sc->kt, D, nr, s);
            prefill_softmax(s, sc->m + r0, sc->l + r0, sc->alpha, pos + r0, kb0, nk, a->scale, nr, 0, W);
            if (nr == PF_TR)
                prefill_output(sc->o + r0 * D, s, sc->alpha, sc->vs, D, nk, PF_TR);
            else
                prefill_output(sc->o + r0 * D, s, sc->alpha, sc->vs, D, nk, nr);
        }
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t p = p0 + r / G, h = kvh * G + r % G;
        const float inv = 1.0f / sc->l[r]; /* l >= 1: the row's own key is visible */
        const float *restrict orow = sc->o + r * D;
        if (bf16) {
            uint16_t *dst = (uint16_t *)a->out + p * a->out_stride + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) dst[d] = f32_to_bf16(orow[d] * inv);
        } else {
            float *dst = (float *)a->out + p * a->out_stride + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) dst[d] = orow[d] * inv;
        }
    }
}

/* prefill_item with the q/out dtype and head size 64 as compile-time constants; the
 * pool format is a runtime switch in prefill_load_block (once per key row). Not inlined:
 * prefill_run and the fused step (step.c) share one copy of its variants, each
 * call an item's worth of work. */
static __attribute__((noinline)) void prefill_dispatch(const PrefillArgs *a, int64_t kvh, int64_t p0, int64_t np, int fmt, int bf16,
                                PrefillScratch *sc) {
#ifdef TM_BF16_DOT
    if (fmt == KV_BF16 && a->head_dim % 32 == 0 && a->head_dim <= 512) { /* bf16 products, as in decode */
        if (a->head_dim == 64)
            prefill_item(a, kvh, p0, np, fmt, bf16, 64, 1, sc);
        else
            prefill_item(a, kvh, p0, np, fmt, bf16, a->head_dim, 1, sc);
        return;
    }
#endif
    if (bf16) {
        if (a->head_dim == 64)
            prefill_item(a, kvh, p0, np, fmt, 1, 64, 0, sc);
        else
            prefill_item(a, kvh, p0, np, fmt, 1, a->head_dim, 0, sc);
    } else {
        if (a->head_dim == 64)
            prefill_item(a, kvh, p0, np, fmt, 0, 64, 0, sc);
        else
            prefill_item(a, kvh, p0, np, fmt, 0, a->head_dim, 0, sc);
    }
}

/* A thread's scratch for prefill items (PREFILL_SCRATCH_FLOATS(D) floats, 64-byte aligned
 * at `buf`), laid out. */
#define PREFILL_SCRATCH_FLOATS(D) ((size_t)(2 * PF_ROWS * (D) + 2 * PF_ROWS + 2 * (D) * PF_KB + PF_TR * PF_KB + PF_TR))
static PrefillScratch prefill_scratch(float *buf, int64_t D) {
    PrefillScratch sc;
    sc.q = buf;
    sc.o = sc.q + PF_ROWS * D;
    sc.m = sc.o + PF_ROWS * D;
    sc.l = sc.m + PF_ROWS;
    sc.kt = sc.l + PF_ROWS;
    sc.vs = sc.kt + D * PF_KB;
    sc.p = sc.vs + PF_KB * D;
    sc.alpha = sc.p + PF_TR * PF_KB;
    return sc;
}

/* fmt: the pool's format (KV_*); bf16: q and out are bf16. */
static int prefill_run(const PrefillArgs *a, int64_t table_len, int num_threads, int fmt, int bf16) {
    const int64_t D = a->head_dim;
    if (a->kv_heads <= 0 || a->heads <= 0 || a->heads % a->kv_heads || D <= 0 || D % VW || a->block_size <= 0 ||
        (fmt >= KV_I8 && (D > 512 || !a->k_scale || !a->v_scale)) ||
        a->q_len <= 0 || a->seq_len < a->q_len || a->heads / a->kv_heads > PF_ROWS)
        return 1;
    const int64_t used = (a->seq_len + a->block_size - 1) / a->block_size;
    if (used > table_len) return 1;
    for (int64_t b = 0; b < used; b++)
        if (a->table[b] < 0 || a->table[b] >= a->num_blocks) return 1;
    const int64_t G = a->heads / a->kv_heads;
    const int64_t per_item = PF_ROWS / G; /* query positions per item */
    const int64_t blocks = (a->q_len + per_item - 1) / per_item;
    const int64_t items = blocks * a->kv_heads;
    const size_t floats = PREFILL_SCRATCH_FLOATS(D);
    int failed = 0;
#pragma omp parallel num_threads(threads_for(num_threads, items)) reduction(| : failed)
    {
        float *buf = scratch_floats(floats);
        if (!buf) {
            failed = 1;
        } else {
            PrefillScratch sc = prefill_scratch(buf, D);
            /* Later query blocks see more keys: hand them out first. */
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < items; it++) {
                const int64_t blk = blocks - 1 - it / a->kv_heads, kvh = it % a->kv_heads;
                const int64_t p0 = blk * per_item;
                const int64_t np = a->q_len - p0 < per_item ? a->q_len - p0 : per_item;
                prefill_dispatch(a, kvh, p0, np, fmt, bf16, &sc);
            }
            free(buf);
        }
    }
    return failed ? 2 : 0;
}

#define TM_PREFILL_ENTRY(name, T, is_bf16)                                                                   \
    int name(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache, const int32_t *table,        \
             int64_t table_len, int64_t seq_len, int64_t q_len, int64_t heads, int64_t kv_heads,            \
             int64_t head_dim, int64_t num_blocks, int64_t block_size, float scale, T *out,                  \
             int64_t out_stride, int num_threads, int64_t window) {                                         \
        PrefillArgs a = {q, k_cache, v_cache, table, out, q_stride, out_stride, heads, kv_heads, head_dim,  \
                         num_blocks, block_size, seq_len, q_len, scale, NULL, NULL, window};               \
        return prefill_run(&a, table_len, num_threads, is_bf16, is_bf16);                                   \
    }

/* Returns 0 on success, 1 on arguments the kernel does not take or that would
 * read outside the pool (nothing written), 2 when scratch memory could not be
 * allocated. */
TM_PREFILL_ENTRY(tm_paged_prefill_f32, float, 0)
TM_PREFILL_ENTRY(tm_paged_prefill_bf16, uint16_t, 1)

/* A pool in another format than q (as tm_paged_decode_convert): a quantized pool
 * (kv_fmt KV_I8 or KV_FP8) with its per-block scales [kv_heads, num_blocks], q and out
 * float32, or bf16 when io_bf16; or a bf16 pool under float32 q and out. */
int tm_paged_prefill_convert(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                             const float *k_scale, const float *v_scale, int kv_fmt, int io_bf16,
                             const int32_t *table, int64_t table_len, int64_t seq_len, int64_t q_len, int64_t heads,
                             int64_t kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size, float scale,
                             void *out, int64_t out_stride, int num_threads, int64_t window) {
    if (kv_fmt != KV_I8 && kv_fmt != KV_FP8 && !(kv_fmt == KV_BF16 && !io_bf16)) return 1;
    PrefillArgs a = {q, k_cache, v_cache, table, out, q_stride, out_stride, heads, kv_heads, head_dim,
                     num_blocks, block_size, seq_len, q_len, scale, k_scale, v_scale, window};
    return prefill_run(&a, table_len, num_threads, kv_fmt, io_bf16 ? 1 : 0);
}
