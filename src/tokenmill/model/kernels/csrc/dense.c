/* Products that widen the weights to float32 in registers: float32, bf16 and int8 rows
 * (dense_tile), bf16 weights against bf16-rounded activations (bf16_dot_tile, AVX512-BF16),
 * and int4 codes in the project's row-major nibble order (int4_tile). */
#include "tm_kernels.h"

/* ------------------------------------------------------------------ matmuls */

/* VW weights of row `row` from column c, widened (dense kinds). */
TM_INLINE vf load_dense_w(const TmLinear *L, const int kind, int64_t row, int64_t c) {
    if (kind == W_F32) return vload((const float *)L->w + row * L->k + c);
    if (kind == W_BF16) return vload_bf16((const uint16_t *)L->w + row * L->k + c);
    if (kind == W_INT8G) /* a scale per 32 columns; c is a multiple of VW, which divides 32 */
        return vload_i8((const int8_t *)L->w + row * L->k + c) * L->scale[row * (L->k / 32) + c / 32];
    return vload_i8((const int8_t *)L->w + row * L->k + c);
}

/* gcc folds a vector load used by several FMAs into each of them (one load
 * per FMA instead of one in all): an empty asm that "changes" the value makes
 * it load once into a register. */
TM_INLINE void keep_in_register(vf *v) {
#if defined(__x86_64__) && defined(__AVX__) /* a vf fills one register only from AVX on */
    __asm__("" : "+v"(*v));
#else
    (void)v;
#endif
}

#define TM_ROW_BLOCK 4 /* weight rows per pass over the activations (dense kinds) */

/* The next row block's weights at column c, towards L2: interleaving a block's
 * rows leaves the hardware prefetcher that many short streams (one row is
 * 2.3 KB), and weights read from memory arrived measurably slower without
 * this. */
TM_INLINE void prefetch_dense_w(const TmLinear *L, const int kind, int64_t row, int64_t c) {
    const int64_t esize = kind == W_F32 ? 4 : kind == W_BF16 ? 2 : 1;
    for (int64_t i = row; i < row + TM_ROW_BLOCK && i < L->n; i++)
        __builtin_prefetch((const char *)L->w + (i * L->k + c) * esize, 0, 2);
}


/* Partial-sum vectors of rows [r0, r0 + nr) times NB activation rows of x,
 * reduced to out[b][r] (r < nr). Dense kinds (f32, bf16, int8 before its row
 * scale). With several activation rows, TM_ROW_BLOCK weight rows go together
 * against up to 6 activation rows: 4 + 6 loads feed 24 FMAs held in 24 of the
 * 32 vector registers, and a 16-row tile is 4 whole blocks (one row at a time
 * against 4 activation rows was 5 loads per 4 FMAs: load-bound; 3 rows x 8
 * left every 16th row to the slow loop; docs/performance.md has the rates). */
TM_INLINE void dense_tile(const TmLinear *L, const int kind, const float *x, int64_t ldx, const int NB, int64_t r0,
                          int64_t nr, float out[TM_MAX_ROWS][VW]) {
    const int64_t K = L->k;
    vf acc[TM_MAX_ROWS][VW];
    int64_t r = 0;
    /* One activation row (memory-bound) keeps the plain row-at-a-time loop below:
     * measured faster there. */
    for (; NB > 1 && r + TM_ROW_BLOCK <= nr; r += TM_ROW_BLOCK) {
        vf tot[TM_ROW_BLOCK][TM_MAX_ROWS];
        for (int i = 0; i < TM_ROW_BLOCK; i++)
            for (int b = 0; b < NB; b++) tot[i][b] = (vf){0};
        for (int64_t c = 0; c < K; c += VW) {
            vf w[TM_ROW_BLOCK];
            for (int i = 0; i < TM_ROW_BLOCK; i++) w[i] = load_dense_w(L, kind, r0 + r + i, c);
            prefetch_dense_w(L, kind, r0 + r + TM_ROW_BLOCK, c);
            for (int b = 0; b < NB; b++) {
                vf xv = vload(x + b * ldx + c);
                keep_in_register(&xv);
                for (int i = 0; i < TM_ROW_BLOCK; i++) tot[i][b] = vfma(w[i], xv, tot[i][b]);
            }
        }
        for (int i = 0; i < TM_ROW_BLOCK; i++)
            for (int b = 0; b < NB; b++) acc[b][r + i] = tot[i][b];
    }
    for (; r < VW; r++) { /* the rest: every row at batch 1, else the tile's last rows; zeros past n */
        vf tot[TM_MAX_ROWS];
        for (int b = 0; b < NB; b++) tot[b] = (vf){0};
        if (r < nr)
            for (int64_t c = 0; c < K; c += VW) {
                const vf w = load_dense_w(L, kind, r0 + r, c);
                for (int b = 0; b < NB; b++) tot[b] = vfma(w, vload(x + b * ldx + c), tot[b]);
            }
        for (int b = 0; b < NB; b++) acc[b][r] = tot[b];
    }
    for (int b = 0; b < NB; b++) vstore(out[b], transpose_sum(acc[b]));
}

#ifdef TM_BF16_DOT
/* bf16 weights against bf16-rounded activations with vdpbf16ps: each
 * instruction multiplies 32 pairs and adds them into 16 float32 lanes, the way
 * the eager bf16 model's oneDNN matmuls round their inputs. Used when several
 * activation rows share the weights (the step is then bound by arithmetic):
 * measured faster than the float32-widening tile, with half the activation
 * bytes (docs/performance.md).
 * A single row keeps float32 activations (memory-bound either way, and closer
 * to float32). K % 32 == 0. */
TM_INLINE void bf16_dot_tile(const TmLinear *L, const uint16_t *xh, const int NB, int64_t r0, int64_t nr,
                             float out[TM_MAX_ROWS][VW]) {
    const int64_t K = L->k;
    const uint16_t *W = (const uint16_t *)L->w;
    vf acc[TM_MAX_ROWS][VW];
    int64_t r = 0;
    for (; r + TM_ROW_BLOCK <= nr; r += TM_ROW_BLOCK) {
        __m512 tot[TM_ROW_BLOCK][TM_MAX_ROWS];
        for (int i = 0; i < TM_ROW_BLOCK; i++)
            for (int b = 0; b < NB; b++) tot[i][b] = _mm512_setzero_ps();
        for (int64_t c = 0; c < K; c += 32) {
            __m512bh w[TM_ROW_BLOCK];
            for (int i = 0; i < TM_ROW_BLOCK; i++) w[i] = (__m512bh)_mm512_loadu_si512(W + (r0 + r + i) * K + c);
            prefetch_dense_w(L, W_BF16, r0 + r + TM_ROW_BLOCK, c);
            for (int b = 0; b < NB; b++) {
                __m512bh xv = (__m512bh)_mm512_loadu_si512(xh + b * K + c);
                __asm__("" : "+v"(xv)); /* one load, not one per instruction (see keep_in_register) */
                for (int i = 0; i < TM_ROW_BLOCK; i++) tot[i][b] = _mm512_dpbf16_ps(tot[i][b], xv, w[i]);
            }
        }
        for (int i = 0; i < TM_ROW_BLOCK; i++)
            for (int b = 0; b < NB; b++) memcpy(&acc[b][r + i], &tot[i][b], sizeof(vf));
    }
    for (; r < VW; r++) {
        __m512 tot[TM_MAX_ROWS];
        for (int b = 0; b < NB; b++) tot[b] = _mm512_setzero_ps();
        if (r < nr)
            for (int64_t c = 0; c < K; c += 32) {
                const __m512bh w = (__m512bh)_mm512_loadu_si512(W + (r0 + r) * K + c);
                for (int b = 0; b < NB; b++)
                    tot[b] = _mm512_dpbf16_ps(tot[b], (__m512bh)_mm512_loadu_si512(xh + b * K + c), w);
            }
        for (int b = 0; b < NB; b++) memcpy(&acc[b][r], &tot[b], sizeof(vf));
    }
    for (int b = 0; b < NB; b++) vstore(out[b], transpose_sum(acc[b]));
}
#endif

/* The low and high nibbles of VW bytes as float32 codes. With AVX-512 a
 * table lookup does it: vpermps reads only the low 4 bits of each index, so
 * the zero-extended byte indexes the table by its low nibble as it is, and
 * shifted right by 4 by its high one: four vector operations for 32 codes
 * instead of eight (mask, shift, widen and convert each half); int4 decode at
 * batch 1 is bound by these, so the lookup shows in the step time. Intrinsics
 * here (and in bf16_dot_tile) only: gcc 12 lowers a variable-index
 * __builtin_shuffle of 16 floats to a long permute sequence, slower than the
 * converts it replaces. */
TM_INLINE void int4_codes(vb bytes, vf *lo, vf *hi) {
#if VW == 16
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m128i b;
    memcpy(&b, &bytes, sizeof b);
    const __m512i w = _mm512_cvtepu8_epi32(b);
    __m512 l = _mm512_permutexvar_ps(w, values), h = _mm512_permutexvar_ps(_mm512_srli_epi32(w, 4), values);
    memcpy(lo, &l, sizeof l);
    memcpy(hi, &h, sizeof h);
#else
    *lo = __builtin_convertvector(__builtin_convertvector(bytes & 15, vi), vf);
    *hi = __builtin_convertvector(__builtin_convertvector(bytes >> 4, vi), vf);
#endif
}

/* int4: per group, sum(code * x) scaled by s, plus zero * sum(x) (xsum holds
 * the per-group sums of x: [NB, groups], ldxs apart). */
TM_INLINE void int4_tile(const TmLinear *L, const float *x, int64_t ldx, const float *xsum, int64_t ldxs,
                         const int NB, int64_t r0, int64_t nr, float out[TM_MAX_ROWS][VW]) {
    const int64_t kp = L->k * L->repeat, g = L->group, G = kp / g;
    vf acc[TM_MAX_ROWS][VW];
    for (int64_t r = 0; r < VW; r++) {
        vf tot[TM_MAX_ROWS];
        float zs[TM_MAX_ROWS];
        for (int b = 0; b < NB; b++) tot[b] = (vf){0}, zs[b] = 0.0f;
        if (r < nr) {
            const int64_t row = r0 + r;
            const uint8_t *codes = (const uint8_t *)L->w + row * (kp / 2);
            const float *s = L->scale + row * G, *z = L->zero + row * G;
            for (int64_t j = 0; j < G; j++) {
                vf dot[TM_MAX_ROWS];
                for (int b = 0; b < NB; b++) dot[b] = (vf){0};
                for (int64_t c = j * g; c < (j + 1) * g; c += 32) {
                    const uint8_t *p = codes + c / 2;
                    for (int h = 0; h < 16 / VW; h++) {
                        vb bytes;
                        memcpy(&bytes, p + h * VW, sizeof bytes);
                        vf lo, hi;
                        int4_codes(bytes, &lo, &hi);
                        for (int b = 0; b < NB; b++) {
                            const float *xb = x + b * ldx + c + h * VW;
                            dot[b] += lo * vload(xb) + hi * vload(xb + 16);
                        }
                    }
                }
                for (int b = 0; b < NB; b++) {
                    tot[b] += dot[b] * s[j];
                    zs[b] += z[j] * xsum[b * ldxs + j];
                }
            }
            for (int b = 0; b < NB; b++) tot[b][0] += zs[b];
        }
        for (int b = 0; b < NB; b++) acc[b][r] = tot[b];
    }
    for (int b = 0; b < NB; b++) vstore(out[b], transpose_sum(acc[b]));
}
