/* Decode attention that reads the paged KV cache in place (CPU, OpenMP).
 *
 * C with GNU vector extensions (no intrinsics, no torch headers): tokenmill
 * compiles this file with the system gcc on first use (model/kernels/cpu_kernels.py)
 * and calls it through ctypes.
 *
 * For every decode sequence n and query head h (kv head h / group):
 *     out[n, h, :] = softmax(scale * q[n, h] . K[n, :len]) @ V[n, :len]
 * where row p of K[n] is k_cache[kv, table[n][p / bs], p % bs, :]. In a
 * sliding-window layer (window > 0) only the last `window` positions are read:
 * K[n, len - window:len] (the positions before are skipped, not masked, so a long
 * context costs a windowed layer nothing).
 *
 * Pool layout per layer: [kv_heads, num_blocks, block_size, head_dim],
 * contiguous, float32 or bfloat16 (bf16 passed as raw uint16 bits), or
 * quantized: int8 or fp8 (e4m3) codes with one float32 scale per block and kv
 * head ([kv_heads, num_blocks]); a row's value is code * its block's scale.
 * Rows are read in place and widened to float32 in registers as they are loaded
 * (bf16; int8 under float32 q, its block's scale applied to the row's score and
 * folded into its softmax weight), or widened into a buffer first (fp8, by bit
 * moves: these CPUs have no fp8 instructions; int8 under bf16 q, scale applied),
 * so the arithmetic after the load is float32 for every format (ROWS_*); except
 * a bf16 pool on a CPU with AVX512-BF16, whose rows meet bf16-rounded queries and
 * softmax weights in vdpbf16ps (ROWS_BF16_DOT: exact products, float32 sums).
 *
 * One work item is a (sequence, kv head) pair and it handles the head's whole
 * query group, so every K and V row comes from memory once and is used
 * `group` times from L1. Items are independent and each runs start to end on
 * one thread with the same instruction sequence, so a sequence's result
 * depends neither on what else is in the batch nor on the thread count. A
 * context longer than PART_LEN positions is attended in parts, each its own
 * item, and the parts' results combined in order (combine_parts): the parts
 * are fixed by the sequence's own positions, so that stays true.
 *
 * Two passes over the context, in chunks of VW positions (VW = floats per
 * vector register): scores into a per-thread buffer; then max, exp and sum;
 * then the exp-weighted sum of V rows, divided by the sum at the end. The sums
 * are float32. (A one-pass online softmax measured slower.)
 *
 * Why vector types and not only auto-vectorized loops: a dot product per key
 * row ends in a horizontal sum, which gcc 12 emits (even under `omp simd
 * reduction`) as 16 dependent scalar adds through the stack, and the scores
 * pass then ran several times slower. Here a chunk's VW dot products stay as VW vectors of
 * partial sums, and one shuffle tree turns them into a vector of VW scores
 * (about 3 operations per row). The simple loops (softmax, conversions,
 * output) are plain loops under `#pragma omp simd`; gcc vectorizes them
 * (checked with -fopt-info-vec).
 *
 * Rows of a block are contiguous, but blocks are scattered over the pool, so
 * the hardware prefetcher loses the stream at every block boundary: each
 * chunk prefetches the rows PF_DIST chunks ahead into L2 (the best of
 * distances 1-8 and hints L1/L2/L3 when measured, and clearly faster than no
 * prefetch on scattered tables; docs/performance.md).
 *
 * That rolling prefetch keeps only a few blocks in flight, and one core reads
 * scattered 4 KB blocks that way at about half its streaming rate. So
 * each item also asks for its first PF_ITEM_BYTES of K and of V at once when
 * it starts: the misses overlap, and V arrives in L2 while pass 1 computes
 * scores (a measurable gain at 64 sequences from memory; docs/performance.md).
 * Longer contexts rely on the rolling prefetch past that. A thread that knows
 * the item it runs next (items are claimed in runs) spreads the requests for
 * that item's first rows over the current item's chunks instead, so its rows
 * arrive while this one computes and the next starts without waiting on memory.
 */
#include "tm_kernels.h"

#define PF_DIST 2 /* chunks ahead */
#define PF_HINT 2 /* __builtin_prefetch locality: 2 = into L2 */
#define PF_ITEM_BYTES (256 * 1024) /* of K and of V, prefetched when an item starts (L2 is >= 512 KB) */


/* How attention reads a chunk's rows (a compile-time constant where it is used): float32
 * rows in place; bf16 rows in place, widened in registers; int8 codes in place, widened in
 * registers, their block's scale applied to the row's score and to its softmax weight
 * (q . (s k) = s (q . k), sum p (s v) = sum (p s) v); rows of other formats widened into a
 * buffer first (fp8). */
enum { ROWS_F32 = 0, ROWS_BF16 = 1, ROWS_I8 = 2, ROWS_CONV = 3, ROWS_BF16_DOT = 4 };


/* Values c .. c + 2 VW - 1 of a bf16 row as two float32 vectors, exactly: one load of VW
 * 32-bit words, word i holding values c + 2i (low half) and c + 2i + 1 (high half); a
 * shift moves the even values' bits to the top, a mask keeps the odd ones'. Two
 * operations per 2 VW values, where widening each half (vload_bf16) takes four: on a CPU
 * without bf16 products, widening was a third of the arithmetic per row (ROWS_BF16 with
 * head_dim % (2 VW) == 0, the "pairs" order: queries and output sums kept with each
 * 2 VW-value block's even values first, then its odd ones). */
TM_INLINE void vload_bf16_pairs(const uint16_t *p, vf *even, vf *odd) {
    vu u;
    memcpy(&u, p, sizeof u);
    const vu e = u << 16, o = u & 0xffff0000u;
    memcpy(even, &e, sizeof e);
    memcpy(odd, &o, sizeof o);
}

/* Vector c / VW of a row read in place. */
TM_INLINE vf vload_row(const void *row, int64_t c, int kind) {
    if (kind == ROWS_BF16) return vload_bf16((const uint16_t *)row + c);
    if (kind == ROWS_I8) return vload_i8((const int8_t *)row + c);
    return vload((const float *)row + c);
}

TM_INLINE float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even; NaN stays NaN (quiet). */
TM_INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}


TM_INLINE size_t kv_esize(int fmt) { return fmt == KV_F32 ? 4 : fmt == KV_BF16 ? 2 : 1; }

/* Every e4m3 code's value (finite codes; 0x7f / 0xff are NaN), filled when the
 * library loads (the stores' requantization reads it; attention widens codes
 * arithmetically, see widen_row). */
static float fp8_values[256];

static void __attribute__((constructor)) init_fp8_values(void) {
    for (int i = 0; i < 256; i++) {
        const int e = (i >> 3) & 15, m = i & 7;
        float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + m / 8.0f, e - 7);
        if (e == 15 && m == 7) v = NAN;
        fp8_values[i] = i & 0x80 ? -v : v;
    }
}

/* D elements of a pool row in format fmt (not float32) -> float32, times the
 * block's scale (quantized formats). */
TM_INLINE void widen_row(const char *row, int fmt, float scale, int64_t D, float *restrict dst) {
    if (fmt == KV_BF16) {
        const uint16_t *restrict src = (const uint16_t *)row;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) dst[d] = bf16_to_f32(src[d]);
    } else if (fmt == KV_I8) {
        const int8_t *restrict src = (const int8_t *)row;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) dst[d] = (float)src[d] * scale;
    } else {
        /* e4m3 without a table: the code's exponent and mantissa bits, placed at the top of
         * a float32's exponent and mantissa fields, read as the code's value times 2^-120
         * (subnormal codes land on float32 subnormals, exactly); a vector shift, where a
         * table lookup is a gather per value. */
        const uint8_t *restrict src = (const uint8_t *)row;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) {
            const uint32_t c = src[d], u = (c & 0x7fu) << 20 | (c & 0x80u) << 24;
            float f;
            memcpy(&f, &u, sizeof f);
            dst[d] = f * 0x1p120f * scale;
        }
    }
}

/* exp(x) for x <= 0 (scores minus their max), written so that loops calling
 * it vectorize: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-7 Taylor
 * polynomial (truncation error below 1e-8 relative), 2^n put in the exponent
 * bits. Results below float's normal range flush to 0. */
TM_INLINE float exp_nonpos(float x) {
    const float log2e = 1.44269504088896341f;
    const float ln2_hi = 0.693145751953125f; /* few mantissa bits: n * ln2_hi is exact */
    const float ln2_lo = 1.42860682030941723e-6f;
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float xc = x < -87.0f ? -87.0f : x;
    float n = (xc * log2e + shifter) - shifter;
    float r = (xc - n * ln2_hi) - n * ln2_lo;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return x < -87.0f ? 0.0f : p * two_n;
}


typedef struct {
    const void *q;               /* [num_seqs, heads, head_dim] rows q_stride elements apart */
    const void *k_cache;         /* [kv_heads, num_blocks, block_size, head_dim] */
    const void *v_cache;
    const int32_t *block_tables; /* [num_seqs, bt_stride] */
    const int32_t *seq_lens;     /* [num_seqs] */
    void *out;                   /* like q, rows out_stride elements apart */
    int64_t q_stride, out_stride, bt_stride;
    int64_t heads, kv_heads, head_dim, num_blocks, block_size;
    float scale;
    const float *k_scale, *v_scale; /* quantized pools: [kv_heads, num_blocks] */
    int64_t window;                 /* a sliding-window layer's window (keys before len - window
                                       are skipped); 0: the whole context */
} Args;

/* Per-thread scratch, in floats. */
typedef struct {
    float *q;    /* group * head_dim: the queries in float32 */
    float *acc;  /* group * head_dim: weighted V sums */
    float *inv;  /* group: 1 / softmax denominators */
    float *rows; /* VW * head_dim: a chunk of bf16 rows in float32 */
    float *zero; /* head_dim zeros: the rows of a chunk past the context's end */
    float *s;    /* group * len: scores, then exp(score - max) */
    /* The thread's item pipeline (item = sequence * kv_heads + kv head; -1: none): the item
     * it runs after this one, whose first rows this one prefetches as it goes, and the item
     * whose rows the previous one prefetched (so they need no bulk request at its start). */
    int64_t next_item, warm_item;
} Scratch;

/* Addresses of the chunk's rows (positions pos0 .. pos0 + n - 1) in one kv
 * head's part of the pool, read as `kind` says (ROWS_*): in place, with each int8
 * row's block scale in rscale; or converted into conv as float32 (scales: this head's
 * per-block scales). Rows past n point at a zero row (zero bytes: 0 in any format,
 * scale 0). Also prefetches the next chunk's rows. */
TM_INLINE void chunk_rows(const char *base, const float *scales, const int32_t *table, int64_t pos0, int64_t n,
                          int64_t L, int64_t prefetched, int64_t BS, int64_t D, int fmt, int kind,
                          float *conv, const float *zero, const void *rows[VW], float rscale[VW]) {
    const size_t esize = kv_esize(fmt);
    int64_t b = pos0 / BS, o = pos0 % BS;
    for (int64_t t = 0; t < n; t++) {
        const char *row = base + ((size_t)table[b] * BS + o) * D * esize;
        if (kind != ROWS_CONV) {
            rows[t] = row;
            if (kind == ROWS_I8) rscale[t] = scales[table[b]];
        } else {
            widen_row(row, fmt, fmt >= KV_I8 ? scales[table[b]] : 1.0f, D, conv + t * D);
            rows[t] = conv + t * D;
        }
        if (++o == BS) o = 0, b++;
    }
    for (int64_t t = n; t < VW; t++) {
        rows[t] = zero;
        if (kind == ROWS_I8) rscale[t] = 0.0f;
    }
    /* Prefetch the rows PF_DIST chunks ahead, into L2, past those the item asked for
     * when it started (rows 0 .. prefetched - 1). */
    const int64_t start = pos0 + PF_DIST * VW;
    if (start < prefetched) return;
    const int64_t next_n = L - start < VW ? L - start : VW;
    b = start / BS, o = start % BS;
    for (int64_t t = 0; t < next_n; t++) {
        const char *row = base + ((size_t)table[b] * BS + o) * D * esize;
        if (++o == BS) o = 0, b++;
        for (size_t off = 0; off < D * esize; off += 64) __builtin_prefetch(row + off, 0, PF_HINT);
    }
}

/* Prefetch rows r0 .. r1 - 1 of one kv head's part of the pool into L2, a block's
 * contiguous rows at a time (an address per row, with its division, cost as much
 * as the prefetches themselves when the rows were already cached). */
TM_INLINE void prefetch_range(const char *base, const int32_t *table, int64_t r0, int64_t r1, int64_t BS,
                              size_t row_bytes) {
    while (r0 < r1) {
        const int64_t b = r0 / BS, o = r0 % BS, n = r1 - r0 < BS - o ? r1 - r0 : BS - o;
        const char *row = base + ((size_t)table[b] * BS + o) * row_bytes;
        for (size_t off = 0; off < (size_t)n * row_bytes; off += 64) __builtin_prefetch(row + off, 0, PF_HINT);
        r0 += n;
    }
}

/* Where an item's K and V rows lie: its kv head's part of each pool and its block table. */
typedef struct {
    const char *k, *v;
    const int32_t *table;
    int64_t lo, len; /* the positions attended: lo .. len - 1 */
} ItemRows;

TM_INLINE ItemRows item_rows(const Args *a, int64_t n, int64_t kvh, size_t esize) {
    const size_t head_bytes = (size_t)a->num_blocks * a->block_size * a->head_dim * esize;
    const int64_t len = a->seq_lens[n];
    return (ItemRows){(const char *)a->k_cache + kvh * head_bytes, (const char *)a->v_cache + kvh * head_bytes,
                      a->block_tables + n * a->bt_stride, a->window > 0 && len > a->window ? len - a->window : 0,
                      len};
}

/* Query heads of one kv head handled per load of a K or V row: each row vector
 * loaded feeds that many FMAs instead of one (the item was bound by loads), and
 * 3 heads x half a chunk of positions keep 24 accumulators in registers (12 of 16
 * with AVX2's 8-float vectors). Arithmetic and its order per score and output
 * element are those of one head at a time. */
#define HEADS_PER_PASS 3
#define PV_VECS (VW == 16 ? 4 : 2) /* output vectors per head kept in registers over a chunk in pass 2 */

/* The first levels of transpose_sum's tree over half a chunk's VW / 2 vectors of partial
 * sums (one per row): a vector whose lanes hold the half's row sums in pairs of halves. */
TM_INLINE vf half_tree(vf part[VW / 2]) {
    int n = VW / 2;
    for (int lev = 0; lev < TRANSPOSE_LEVELS - 1; lev++, n /= 2)
        for (int i = 0; i < n / 2; i++)
            part[i] = __builtin_shuffle(part[2 * i], part[2 * i + 1], TRANSPOSE_LO[lev]) +
                      __builtin_shuffle(part[2 * i], part[2 * i + 1], TRANSPOSE_HI[lev]);
    return part[0];
}

/* The tree's last level over both halves (lane t: row t's sum), times the rows' scales
 * (int8 rows) and `scale`, into s[g * ldS + t] for t < cnt. */
TM_INLINE void store_chunk_scores(vf half[2][HEADS_PER_PASS], const int NG, float scale, float *s, int64_t ldS,
                                  int64_t cnt, const int kind, const float rscale[VW]) {
    for (int g = 0; g < NG; g++) {
        vf sv = __builtin_shuffle(half[0][g], half[1][g], TRANSPOSE_LO[TRANSPOSE_LEVELS - 1]) +
                __builtin_shuffle(half[0][g], half[1][g], TRANSPOSE_HI[TRANSPOSE_LEVELS - 1]);
        if (kind == ROWS_I8) sv *= vload(rscale);
        sv *= scale;
        if (cnt == VW) {
            vstore(s + g * ldS, sv);
        } else {
            float tmp[VW];
            vstore(tmp, sv);
            memcpy(s + g * ldS, tmp, cnt * sizeof(float));
        }
    }
}

/* scale * q_g . row_t for NG heads (queries q, NG x D) against a chunk's VW rows
 * (read as `kind` says; int8 rows times their scale rscale[t]), into s[g * ldS + t]
 * for t < cnt. With ``pairs`` (a constant; bf16 rows): q holds each 2 VW-value block's
 * even values, then its odd ones, and a row's block is widened by vload_bf16_pairs, so
 * lane i of the block's two products covers values 2i and 2i + 1. Positions go in two
 * halves of VW / 2, each reduced by the first levels of transpose_sum's tree, and the
 * halves by its last level: the same sums, in the same order, as transpose_sum over the
 * whole chunk. */
TM_INLINE void chunk_scores(const float *q, const void *rows[VW], const int64_t D, const int NG, float scale,
                            float *s, int64_t ldS, int64_t cnt, const int kind, const float rscale[VW],
                            const int pairs) {
    enum { P = VW / 2 };
    vf half[2][HEADS_PER_PASS];
    for (int h = 0; h < 2; h++) {
        vf part[HEADS_PER_PASS][P];
        for (int g = 0; g < NG; g++)
            for (int t = 0; t < P; t++) part[g][t] = (vf){0};
        for (int64_t c = 0; pairs && c < D; c += 2 * VW) /* bf16 rows, q in the pairs order */
            for (int t = 0; t < P; t++) {
                vf re, ro;
                vload_bf16_pairs((const uint16_t *)rows[h * P + t] + c, &re, &ro);
                for (int g = 0; g < NG; g++) {
                    part[g][t] = vfma(vload(q + g * D + c), re, part[g][t]);
                    part[g][t] = vfma(vload(q + g * D + c + VW), ro, part[g][t]);
                }
            }
        for (int64_t c = 0; !pairs && c < D; c += VW) {
            vf qc[HEADS_PER_PASS];
            for (int g = 0; g < NG; g++) qc[g] = vload(q + g * D + c);
            for (int t = 0; t < P; t++) {
                const vf r = vload_row(rows[h * P + t], c, kind);
                for (int g = 0; g < NG; g++) part[g][t] += qc[g] * r;
            }
        }
        for (int g = 0; g < NG; g++) half[h][g] = half_tree(part[g]);
    }
    store_chunk_scores(half, NG, scale, s, ldS, cnt, kind, rscale);
}

/* acc_g += sum_t p_g[t] * row_t for NG heads (weights p, rows ldP apart; acc, NG x D)
 * over a chunk's cnt rows (read as `kind` says; an int8 row's scale rscale[t] folded
 * into its weight), PV_VECS vectors of each head's output at a time. With ``pairs`` (a
 * constant; bf16 rows): acc holds each 2 VW-column block's even columns, then its odd
 * ones (from_pairs_order puts them back), and a row's block is widened by
 * vload_bf16_pairs. */
TM_INLINE void chunk_values(const float *p, int64_t ldP, int64_t cnt, const void *rows[VW], const int64_t D,
                            const int NG, float *acc, const int kind, const float rscale[VW], const int pairs) {
    float pw[HEADS_PER_PASS][VW];
    for (int g = 0; g < NG; g++) {
        if (cnt == VW) { /* a constant size: a vector copy, not a string move */
            memcpy(pw[g], p + g * ldP, VW * sizeof(float));
        } else {
            memset(pw[g], 0, sizeof pw[g]);
            memcpy(pw[g], p + g * ldP, cnt * sizeof(float));
        }
        if (kind == ROWS_I8) vstore(pw[g], vload(pw[g]) * vload(rscale));
    }
    for (int64_t c = 0; pairs && c < D; c += 2 * VW) {
        vf o[HEADS_PER_PASS][2];
        for (int g = 0; g < NG; g++) {
            o[g][0] = vload(acc + g * D + c);
            o[g][1] = vload(acc + g * D + c + VW);
        }
        for (int t = 0; t < VW; t++) {
            vf re, ro;
            vload_bf16_pairs((const uint16_t *)rows[t] + c, &re, &ro);
            for (int g = 0; g < NG; g++) {
                const vf pt = (vf){0} + pw[g][t];
                o[g][0] = vfma(pt, re, o[g][0]);
                o[g][1] = vfma(pt, ro, o[g][1]);
            }
        }
        for (int g = 0; g < NG; g++) {
            vstore(acc + g * D + c, o[g][0]);
            vstore(acc + g * D + c + VW, o[g][1]);
        }
    }
    for (int64_t c0 = 0; !pairs && c0 < D; c0 += PV_VECS * VW) {
        const int64_t nv = (D - c0) / VW < PV_VECS ? (D - c0) / VW : PV_VECS;
        vf o[HEADS_PER_PASS][PV_VECS];
        for (int g = 0; g < NG; g++)
            for (int64_t j = 0; j < nv; j++) o[g][j] = vload(acc + g * D + c0 + j * VW);
        for (int t = 0; t < VW; t++) {
            vf r[PV_VECS];
            for (int64_t j = 0; j < nv; j++) r[j] = vload_row(rows[t], c0 + j * VW, kind);
            for (int g = 0; g < NG; g++) {
                const float pt = pw[g][t];
                for (int64_t j = 0; j < nv; j++) o[g][j] += pt * r[j];
            }
        }
        for (int g = 0; g < NG; g++)
            for (int64_t j = 0; j < nv; j++) vstore(acc + g * D + c0 + j * VW, o[g][j]);
    }
}

/* x rounded to the nearest bf16 (ties to even), as a float; x finite. */
TM_INLINE float round_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&x, &u, sizeof x);
    return x;
}

#ifdef TM_BF16_DOT
/* chunk_scores for bf16 rows and bf16 queries qh (NG x D, D % 32 == 0): a row's 32 values
 * a load, each multiplied pairwise into its heads' partial sums, then the same shuffle tree. */
TM_INLINE void chunk_scores_bf16(const uint16_t *qh, const void *rows[VW], const int64_t D, const int NG,
                                 float scale, float *s, int64_t ldS, int64_t cnt) {
    enum { P = VW / 2 };
    vf half[2][HEADS_PER_PASS];
    for (int h = 0; h < 2; h++) {
        __m512 part[HEADS_PER_PASS][P];
        for (int g = 0; g < NG; g++)
            for (int t = 0; t < P; t++) part[g][t] = _mm512_setzero_ps();
        for (int64_t c = 0; c < D; c += 32) {
            __m512bh qc[HEADS_PER_PASS];
            for (int g = 0; g < NG; g++) qc[g] = (__m512bh)_mm512_loadu_si512(qh + g * D + c);
            for (int t = 0; t < P; t++) {
                const __m512bh r = (__m512bh)_mm512_loadu_si512((const uint16_t *)rows[h * P + t] + c);
                for (int g = 0; g < NG; g++) part[g][t] = _mm512_dpbf16_ps(part[g][t], qc[g], r);
            }
        }
        for (int g = 0; g < NG; g++) {
            vf v[P];
            for (int t = 0; t < P; t++) v[t] = (vf)part[g][t];
            half[h][g] = half_tree(v);
        }
    }
    store_chunk_scores(half, NG, scale, s, ldS, cnt, ROWS_BF16_DOT, NULL);
}

/* chunk_values for bf16 rows and bf16-exact weights p: rows t and t + 1 interleaved
 * (vpunpck{l,h}wd: within each 128-bit lane, columns 8k + j and 8k + 4 + j, j < 4, of
 * both rows), so one vdpbf16ps against the broadcast weight pair (p_t, p_t+1) adds both
 * rows into 16 columns. acc holds each 32-column block in that order, lo half then hi
 * half (bf16_acc_columns puts it back). */
TM_INLINE void chunk_values_bf16(const float *p, int64_t ldP, int64_t cnt, const void *rows[VW], const int64_t D,
                                 const int NG, float *acc) {
    /* The weights as bf16 (exact: they are bf16 values already), so dword j holds the
     * pair (p_2j, p_2j+1); positions past cnt weigh 0. */
    uint32_t pair[HEADS_PER_PASS][VW / 2];
    for (int g = 0; g < NG; g++) {
        __m512 pv;
        if (cnt == VW) {
            pv = _mm512_loadu_ps(p + g * ldP);
        } else {
            float tmp[VW] = {0};
            memcpy(tmp, p + g * ldP, cnt * sizeof(float));
            pv = _mm512_loadu_ps(tmp);
        }
        _mm256_storeu_si256((__m256i *)pair[g], (__m256i)_mm512_cvtneps_pbh(pv));
    }
    for (int64_t c = 0; c < D; c += 32) {
        __m512 o[HEADS_PER_PASS][2];
        for (int g = 0; g < NG; g++) {
            o[g][0] = _mm512_loadu_ps(acc + g * D + c);
            o[g][1] = _mm512_loadu_ps(acc + g * D + c + 16);
        }
        for (int j = 0; j < VW / 2; j++) {
            const __m512i a = _mm512_loadu_si512((const uint16_t *)rows[2 * j] + c);
            const __m512i b = _mm512_loadu_si512((const uint16_t *)rows[2 * j + 1] + c);
            const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
            for (int g = 0; g < NG; g++) {
                const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pair[g][j]);
                o[g][0] = _mm512_dpbf16_ps(o[g][0], lo, w);
                o[g][1] = _mm512_dpbf16_ps(o[g][1], hi, w);
            }
        }
        for (int g = 0; g < NG; g++) {
            _mm512_storeu_ps(acc + g * D + c, o[g][0]);
            _mm512_storeu_ps(acc + g * D + c + 16, o[g][1]);
        }
    }
}

/* acc's 32-column blocks from chunk_values_bf16's order back to column order. */
TM_INLINE void bf16_acc_columns(float *acc, int64_t n) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t c = 0; c < n; c += 32) {
        const __m512 lo = _mm512_loadu_ps(acc + c), hi = _mm512_loadu_ps(acc + c + 16);
        _mm512_storeu_ps(acc + c, _mm512_permutex2var_ps(lo, first, hi));
        _mm512_storeu_ps(acc + c + 16, _mm512_permutex2var_ps(lo, second, hi));
    }
}
#endif

/* x (n values, n % (2 VW) == 0) into the pairs order of vload_bf16_pairs, in place:
 * each 2 VW-value block's even values, then its odd ones. */
TM_INLINE void to_pairs_order(float *x, int64_t n) {
    float tmp[2 * VW];
    for (int64_t c = 0; c < n; c += 2 * VW) {
        memcpy(tmp, x + c, sizeof tmp);
        for (int i = 0; i < VW; i++) x[c + i] = tmp[2 * i], x[c + VW + i] = tmp[2 * i + 1];
    }
}

/* to_pairs_order undone. */
TM_INLINE void from_pairs_order(float *x, int64_t n) {
    float tmp[2 * VW];
    for (int64_t c = 0; c < n; c += 2 * VW) {
        memcpy(tmp, x + c, sizeof tmp);
        for (int i = 0; i < VW; i++) x[c + 2 * i] = tmp[i], x[c + 2 * i + 1] = tmp[VW + i];
    }
}

/* Output row of query head g of item (n, kvh): src * w, float32 or rounded to bf16. */
TM_INLINE void store_out_row(const Args *a, int64_t n, int64_t kvh, int64_t g, int64_t D, const float *src,
                             float w, int io_bf16) {
    const int64_t off = n * a->out_stride + (kvh * (a->heads / a->kv_heads) + g) * D;
    if (io_bf16) {
        uint16_t *restrict o = (uint16_t *)a->out + off;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) o[d] = f32_to_bf16(src[d] * w);
    } else {
        float *restrict o = (float *)a->out + off;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) o[d] = src[d] * w;
    }
}

/* One (sequence, kv head) item over positions p0 .. p1 - 1 of its context; D % VW == 0.
 * ``fmt``: the pool's format (KV_*); ``io_bf16``: q and out are bf16 (the fused decode
 * step passes float32 q/out over a pool of any format); ``kind``: how rows are read
 * (ROWS_*, a compile-time constant: attend_dispatch). ``part`` NULL: the range is the
 * whole context the item attends, and the output rows are written; otherwise the range is
 * one part of it (item_parts) and ``part`` gets the unnormalised result, PART_FLOATS(G, D)
 * floats, for combine_parts. */
TM_INLINE void attend_item(const Args *a, int64_t n, int64_t kvh, int fmt, int io_bf16, const int kind,
                           const int64_t D, Scratch *sc, int64_t p0, int64_t p1, float *part) {
    const int64_t BS = a->block_size;
    const int64_t G = a->heads / a->kv_heads;
    const size_t esize = kv_esize(fmt);
    const ItemRows me = item_rows(a, n, kvh, esize);
    const int64_t L = p1, lo = p0, W = p1 - p0; /* scores kept at s[g * W + pos - lo], pos in lo .. L - 1 */
    const int32_t *table = me.table;
    const char *kbase = me.k, *vbase = me.v;
    const float *kscales = fmt >= KV_I8 ? a->k_scale + kvh * a->num_blocks : NULL;
    const float *vscales = fmt >= KV_I8 ? a->v_scale + kvh * a->num_blocks : NULL;
    float *restrict s = sc->s;
    const void *rows[VW];
    float rscale[VW];
#ifdef TM_NO_BF16_PAIRS /* benchmarks/attention_products.py's baseline: each half widened */
    const int pairs = 0;
#else
    const int pairs = kind == ROWS_BF16 && D % (2 * VW) == 0; /* (constant where D is) */
#endif

    for (int64_t g = 0; g < G; g++) {
        const int64_t off = n * a->q_stride + (kvh * G + g) * D;
        float *restrict qg = sc->q + g * D;
        if (kind == ROWS_BF16_DOT) { /* bf16 queries, G x D of them, at the start of sc->q */
            uint16_t *restrict qh = (uint16_t *)sc->q + g * D;
            if (io_bf16) {
                memcpy(qh, (const uint16_t *)a->q + off, D * sizeof(uint16_t));
            } else {
                const float *restrict src = (const float *)a->q + off;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) qh[d] = f32_to_bf16(src[d]);
            }
        } else if (io_bf16) {
#pragma omp simd
            for (int64_t d = 0; d < D; d++) qg[d] = bf16_to_f32(((const uint16_t *)a->q)[off + d]);
        } else {
            memcpy(qg, (const float *)a->q + off, D * sizeof(float));
        }
        if (pairs) to_pairs_order(qg, D);
    }

    /* The item's first rows of K and V, all requested now (see the top of the file), unless
     * the previous item requested them while it computed. */
    const int64_t cap = (int64_t)(PF_ITEM_BYTES / (D * esize));
    const int64_t ahead = L - lo < cap ? L : lo + cap; /* rows lo .. ahead - 1 requested at the start */
    const int64_t item = n * a->kv_heads + kvh;
    if (part || sc->warm_item != item) {
        prefetch_range(kbase, table, lo, ahead, BS, D * esize);
        prefetch_range(vbase, table, lo, ahead, BS, D * esize);
    }
    /* The next item's first rows, spread over this item's chunks: its K during pass 1, its
     * V during pass 2, a share per chunk. */
    ItemRows nx = {0};
    int64_t nx_step = 0;
#ifdef TM_NO_ITEM_PIPELINE /* benchmarks/attention_products.py's baseline: no look-ahead */
    sc->next_item = -1;
#endif
    if (sc->next_item >= 0 && !part) {
        nx = item_rows(a, sc->next_item / a->kv_heads, sc->next_item % a->kv_heads, esize);
        const int64_t chunks = (L - lo + VW - 1) / VW, rows = nx.len - nx.lo < cap ? nx.len - nx.lo : cap;
        nx_step = (rows + chunks - 1) / chunks;
        nx.len = nx.lo + rows;
    }
    sc->warm_item = part ? -1 : sc->next_item;

    /* Pass 1: scores, VW positions at a time, up to HEADS_PER_PASS query heads per row load. */
    for (int64_t pos0 = lo; pos0 < L; pos0 += VW) {
        const int64_t cnt = L - pos0 < VW ? L - pos0 : VW;
        chunk_rows(kbase, kscales, table, pos0, cnt, L, ahead, BS, D, fmt, kind, sc->rows, sc->zero, rows, rscale);
        if (nx_step) {
            const int64_t r0 = nx.lo + (pos0 - lo) / VW * nx_step;
            const int64_t r1 = r0 + nx_step < nx.len ? r0 + nx_step : nx.len;
            prefetch_range(nx.k, nx.table, r0, r1, BS, D * esize);
        }
        for (int64_t g0 = 0; g0 < G; g0 += HEADS_PER_PASS) {
            float *sg = s + g0 * W + (pos0 - lo);
            const float *qg = sc->q + g0 * D;
#ifdef TM_BF16_DOT
            if (kind == ROWS_BF16_DOT) {
                const uint16_t *qh = (const uint16_t *)sc->q + g0 * D;
                switch (G - g0) {
                case 1: chunk_scores_bf16(qh, rows, D, 1, a->scale, sg, W, cnt); break;
                case 2: chunk_scores_bf16(qh, rows, D, 2, a->scale, sg, W, cnt); break;
                default: chunk_scores_bf16(qh, rows, D, HEADS_PER_PASS, a->scale, sg, W, cnt); break;
                }
                continue;
            }
#endif
            switch (G - g0) {
            case 1: chunk_scores(qg, rows, D, 1, a->scale, sg, W, cnt, kind, rscale, pairs); break;
            case 2: chunk_scores(qg, rows, D, 2, a->scale, sg, W, cnt, kind, rscale, pairs); break;
            default: chunk_scores(qg, rows, D, HEADS_PER_PASS, a->scale, sg, W, cnt, kind, rscale, pairs); break;
            }
        }
    }

    /* Softmax numerators, in place; 1 / sum kept per query (a part keeps max and sum). */
    for (int64_t g = 0; g < G; g++) {
        float *restrict sg = s + g * W;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t i = 0; i < W; i++) m = sg[i] > m ? sg[i] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < W; i++) {
            float e = exp_nonpos(sg[i] - m);
            if (kind == ROWS_BF16_DOT) e = round_bf16(e);
            sg[i] = e;
            sum += e;
        }
        sc->inv[g] = 1.0f / sum;
        if (part) part[G * D + g] = m, part[G * D + G + g] = sum;
    }

    /* Pass 2: weighted sum of V rows, up to HEADS_PER_PASS query heads per row load. */
    memset(sc->acc, 0, G * D * sizeof(float));
    for (int64_t pos0 = lo; pos0 < L; pos0 += VW) {
        const int64_t cnt = L - pos0 < VW ? L - pos0 : VW;
        chunk_rows(vbase, vscales, table, pos0, cnt, L, ahead, BS, D, fmt, kind, sc->rows, sc->zero, rows, rscale);
        if (nx_step) {
            const int64_t r0 = nx.lo + (pos0 - lo) / VW * nx_step;
            const int64_t r1 = r0 + nx_step < nx.len ? r0 + nx_step : nx.len;
            prefetch_range(nx.v, nx.table, r0, r1, BS, D * esize);
        }
        for (int64_t g0 = 0; g0 < G; g0 += HEADS_PER_PASS) {
            const float *pg = s + g0 * W + (pos0 - lo);
            float *ag = sc->acc + g0 * D;
#ifdef TM_BF16_DOT
            if (kind == ROWS_BF16_DOT) {
                switch (G - g0) {
                case 1: chunk_values_bf16(pg, W, cnt, rows, D, 1, ag); break;
                case 2: chunk_values_bf16(pg, W, cnt, rows, D, 2, ag); break;
                default: chunk_values_bf16(pg, W, cnt, rows, D, HEADS_PER_PASS, ag); break;
                }
                continue;
            }
#endif
            switch (G - g0) {
            case 1: chunk_values(pg, W, cnt, rows, D, 1, ag, kind, rscale, pairs); break;
            case 2: chunk_values(pg, W, cnt, rows, D, 2, ag, kind, rscale, pairs); break;
            default: chunk_values(pg, W, cnt, rows, D, HEADS_PER_PASS, ag, kind, rscale, pairs); break;
            }
        }
    }

#ifdef TM_BF16_DOT
    if (kind == ROWS_BF16_DOT) bf16_acc_columns(sc->acc, G * D);
#endif
    if (pairs) from_pairs_order(sc->acc, G * D);
    if (part) {
        memcpy(part, sc->acc, G * D * sizeof(float));
        return;
    }
    for (int64_t g = 0; g < G; g++) store_out_row(a, n, kvh, g, D, sc->acc + g * D, sc->inv[g], io_bf16);
}

/* Head sizes with a compiled-in trip count (accumulators stay in registers). */
TM_INLINE void attend_any(const Args *a, int64_t n, int64_t kvh, int fmt, int io_bf16, int kind, Scratch *sc,
                          int64_t p0, int64_t p1, float *part) {
    switch (a->head_dim) {
    case 64: attend_item(a, n, kvh, fmt, io_bf16, kind, 64, sc, p0, p1, part); break;
    case 128: attend_item(a, n, kvh, fmt, io_bf16, kind, 128, sc, p0, p1, part); break;
    default: attend_item(a, n, kvh, fmt, io_bf16, kind, a->head_dim, sc, p0, p1, part); break;
    }
}

/* attend_any with the q/out dtype and how rows are read as compile-time constants:
 * float32, bf16 and (under float32 q, as the fused step and float32 models read it) int8
 * pools in place, widened in registers; the other quantized cases in one shared copy that
 * widens each row into a buffer by a runtime switch (a predictable branch per row; a copy
 * per format made the library several times slower to compile). Each case is one
 * out-of-line function that every caller shares (the standalone kernel's two loops, the
 * fused step's): inlined into each, the copies made single functions of hundreds of
 * kilobytes that took gcc minutes to allocate registers for, for one call per item saved. */
#define TM_ATTEND_CASE(name, FMT, IO, KIND)                                                                   \
    static __attribute__((noinline)) void name(const Args *a, int64_t n, int64_t kvh, int fmt, Scratch *sc,   \
                                               int64_t p0, int64_t p1, float *part) {                         \
        (void)fmt;                                                                                            \
        attend_any(a, n, kvh, FMT, IO, KIND, sc, p0, p1, part);                                               \
    }
TM_ATTEND_CASE(attend_f32, KV_F32, 0, ROWS_F32)
#ifdef TM_BF16_DOT
static __attribute__((noinline)) void attend_bf16_dot(const Args *a, int64_t n, int64_t kvh, int io_bf16,
                                                      Scratch *sc, int64_t p0, int64_t p1, float *part) {
    attend_any(a, n, kvh, KV_BF16, io_bf16, ROWS_BF16_DOT, sc, p0, p1, part);
}
#endif
TM_ATTEND_CASE(attend_bf16_io_bf16, KV_BF16, 1, ROWS_BF16)
TM_ATTEND_CASE(attend_bf16_io_f32, KV_BF16, 0, ROWS_BF16)
TM_ATTEND_CASE(attend_i8, KV_I8, 0, ROWS_I8)
TM_ATTEND_CASE(attend_conv_io_bf16, fmt, 1, ROWS_CONV)
TM_ATTEND_CASE(attend_conv_io_f32, fmt, 0, ROWS_CONV)

TM_INLINE void attend_range(const Args *a, int64_t n, int64_t kvh, int fmt, int io_bf16, Scratch *sc, int64_t p0,
                            int64_t p1, float *part) {
    if (fmt == KV_F32)
        attend_f32(a, n, kvh, fmt, sc, p0, p1, part); /* a float32 pool with bf16 q is refused by the entry points */
#ifdef TM_BF16_DOT
    else if (fmt == KV_BF16 && a->head_dim % 32 == 0) /* q's dtype a runtime flag: one copy, not two */
        attend_bf16_dot(a, n, kvh, io_bf16, sc, p0, p1, part);
#endif
    else if (fmt == KV_BF16 && io_bf16)
        attend_bf16_io_bf16(a, n, kvh, fmt, sc, p0, p1, part);
    else if (fmt == KV_BF16)
        attend_bf16_io_f32(a, n, kvh, fmt, sc, p0, p1, part);
    else if (fmt == KV_I8 && !io_bf16)
        attend_i8(a, n, kvh, fmt, sc, p0, p1, part);
    else if (io_bf16)
        attend_conv_io_bf16(a, n, kvh, fmt, sc, p0, p1, part);
    else
        attend_conv_io_f32(a, n, kvh, fmt, sc, p0, p1, part);
}

/* The positions a decode row of sequence n attends: lo .. len - 1 (a windowed layer's
 * window, else the whole context). */
TM_INLINE void attended(const Args *a, int64_t n, int64_t *lo, int64_t *len) {
    *len = a->seq_lens[n];
    *lo = a->window > 0 && *len > a->window ? *len - a->window : 0;
}

/* A whole (sequence, kv head) item: its output rows written. */
TM_INLINE void attend_dispatch(const Args *a, int64_t n, int64_t kvh, int fmt, int io_bf16, Scratch *sc) {
    int64_t lo, len;
    attended(a, n, &lo, &len);
    attend_range(a, n, kvh, fmt, io_bf16, sc, lo, len, NULL);
