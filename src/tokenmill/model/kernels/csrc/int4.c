/* int4 (and five-bit) codes in the nibble packing against int8 activations:
 * int4_q8_block and int4_q8_rows (AVX2's vpmaddubsw pair sums, AVX-512's vpdpbusd). */
#include "tm_kernels.h"

#ifdef TM_Q4_PACKED
/* int4 against int8 activations (TmLinear.packed set for an int4 layer): the codes in a nibble form of the VNNI packing, [n / VW][kp / 32][4][4 VW] bytes,
 * where byte 4r + i of step s holds input 4s + i of row r (low nibble) and input
 * 16 + 4s + i (high nibble). vpmaddubsw multiplies a step's unsigned codes (0..15) by
 * four broadcast activation bytes (|x| <= 127): each 16-bit lane is one row's sum of two
 * products, at most 2 x 15 x 127, so the eight products of a 32-input block add up in
 * 16 bits without overflow (30480 < 32767), and one vpmaddwd per block widens them.
 * That is 9 multiplies per 256 products where 8-bit weights need 16 (i16_dot_step).
 * A block's exact sum is scaled by its weight scale (packed_scale, [n / VW][groups][VW])
 * and the row's activation scale, then the zero term (packed_zero, z - 8 s) is added on
 * the quantized inputs' group sums, as int4_q8_tile does. The sums land in output order,
 * with no horizontal reduction: at every row count it beats int4_q8_tile (row-major codes,
 * one row at a time) and dequantizing tiles to float32 (measured in docs/performance.md).
 * out[t][b] lane i: row i of tile t . x_b. AVX-512 VNNI builds run the same packing with
 * 16-row tiles through vpdpbusd (unsigned codes times signed activations, added in 32 bits). */
#ifdef TM_Q4_VNNI
#define Q4_ROWS 6 /* activation rows per pass: two tiles' int32 and float accumulators each, 24 of 32 registers */
#else
#define Q4_ROWS 4 /* activation rows per pass: two tiles' 16-bit and float accumulators each */
#endif
#define Q4K_BYTES (20 * VW) /* Q4_KSCALES bytes per tile and super-block */
/* bytes per tile and 32-input block: four steps of nibbles, with Q4_FIFTH the fifth bits (the
 * codes' bytes: Q4_FACTORS_AT), and with Q4_F16 the block's factors after them (VW fp16 scales,
 * and VW fp16 zeros unless Q4_SYMMETRIC) */
#define Q4_FACTORS_AT(FORM) ((FORM) & Q4_FIFTH ? 20 * VW : 16 * VW)
#define Q4_BLOCK_BYTES(FORM) \
    (Q4_FACTORS_AT(FORM) + ((FORM) & Q4_F16 ? ((FORM) & Q4_SYMMETRIC ? 2 * VW : 4 * VW) : 0))
#define Q4_CODE_OFFSET(FORM) ((FORM) & Q4_FIFTH ? 16 : 8) /* codes - this: Q4_SYMMETRIC's weights */
#ifdef TM_Q4_VNNI
/* Q4_KSCALES: a factor of a tile's super-block sb, the fp16 vector at half_at times the
 * byte vector at bytes_at (d sc, or dmin m). */
TM_INLINE __m512 q4k_factor(const uint8_t *sb, int half_at, int64_t bytes_at) {
    return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + half_at))),
                         _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sb + bytes_at)))));
}
#else
/* Q4_KSCALES: as the AVX-512 q4k_factor, 8 lanes. */
TM_INLINE __m256 q4k_factor(const uint8_t *sb, int half_at, int64_t bytes_at) {
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + half_at))),
                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sb + bytes_at)))));
}
#endif

/* A tile pass's zero terms once its blocks are summed, then its sums into out (both instruction
 * sets): Q4_KSCALES, w = d sc q - dmin m, so dmin m x each group's activation sum off; an
 * asymmetric layer (neither Q4_SYMMETRIC nor Q4_F16, whose blocks took theirs), the packed
 * z - 8 s x each group's activation sum. */
TM_INLINE void int4_q8_finish(const uint8_t *kb, const float *pz, const float *gsum, int64_t C, int64_t G, const int NT,
                              const int NB, vf f[2][Q4_ROWS], vf out[2][Q4_ROWS], const int FORM) {
    if (FORM & Q4_KSCALES)
        for (int64_t j = 0; j < G; j++)
            for (int t = 0; t < NT; t++) {
                const vf mv = q4k_factor(kb + (t * (C / 8) + j / 8) * Q4K_BYTES, 2 * VW, 12 * VW + j % 8 * VW);
                for (int b = 0; b < NB; b++) f[t][b] = vfnma(mv, vsplat(gsum[b * G + j]), f[t][b]);
            }
    else if (!(FORM & (Q4_SYMMETRIC | Q4_F16)))
        for (int64_t j = 0; j < G; j++)
            for (int t = 0; t < NT; t++) {
                const vf zv = vload(pz + t * G * VW + j * VW);
                for (int b = 0; b < NB; b++) f[t][b] = vfma(zv, vsplat(gsum[b * G + j]), f[t][b]);
            }
    for (int t = 0; t < NT; t++)
        for (int b = 0; b < NB; b++) memcpy(&out[t][b], &f[t][b], sizeof(vf));
}

#ifdef TM_Q4_VNNI
TM_INLINE void int4_q8_block(const TmLinear *L, const int8_t *xq, const float *xd, const void *xsum, const int NT,
                             const int NB, int64_t tile, vf out[2][Q4_ROWS], const int FORM) {
    const int64_t kp = L->k * L->repeat, C = kp / 32, G = kp / L->group, per = L->group / 32;
    const int64_t CB = Q4_BLOCK_BYTES(FORM);
    const uint8_t *w0 = (const uint8_t *)L->packed + tile * C * CB, *w1 = w0 + C * CB;
    const float *ps = (const float *)L->packed_scale + tile * G * VW, *pz = (const float *)L->packed_zero + tile * G * VW;
    const uint8_t *kb = (const uint8_t *)L->packed_scale + tile * (C / 8) * Q4K_BYTES; /* Q4_KSCALES */
    const float *gsum = (const float *)xsum;
    const int32_t *bsum = (const int32_t *)xsum; /* Q4_SYMMETRIC: [NB][C] block code sums */
    const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
    vf f[2][Q4_ROWS];
    for (int t = 0; t < NT; t++)
        for (int b = 0; b < NB; b++) f[t][b] = (vf){0};
    int64_t group = 0, blocks_left = per;
    for (int64_t c = 0; c < C; c++) {
        __m512i a[2][Q4_ROWS], a2[2][Q4_ROWS], fifth[2];
        const uint8_t *factors = w0 + c * CB + Q4_FACTORS_AT(FORM); /* Q4_F16; tile 1's C x CB bytes on */
        /* one or two sums a pass (decode): the high codes' products on a chain of their own, or the
         * block's eight vpdpbusd wait on each other's latency rather than on memory */
        const int CHAINS = NB * NT <= 2 ? 2 : 1;
        /* Q4_SYMMETRIC: codes - 8 (- 16 with Q4_FIFTH), exactly, as that x the block's activation
         * code sum off each sum, put there before the products rather than subtracted after:
         * vpdpbusd and the float multiplies share two pipes on some CPUs (Zen 4), where each op
         * off counts. */
        for (int b = 0; b < NB; b++) {
            const __m512i start = FORM & Q4_SYMMETRIC ? _mm512_set1_epi32(-Q4_CODE_OFFSET(FORM) * bsum[b * C + c])
                                                      : _mm512_setzero_si512();
            for (int t = 0; t < NT; t++) a[t][b] = start, a2[t][b] = _mm512_setzero_si512();
        }
        if (FORM & Q4_FIFTH)
            for (int t = 0; t < NT; t++) fifth[t] = _mm512_loadu_si512((const void *)((t ? w1 : w0) + c * CB + 16 * VW));
#pragma GCC unroll 4
        for (int s = 0; s < 4; s++) {
            __m512i lo[2], hi[2];
            for (int t = 0; t < NT; t++) {
                const __m512i p = _mm512_loadu_si512((const void *)((t ? w1 : w0) + c * CB + s * 64));
                lo[t] = _mm512_and_si512(p, low4);
                hi[t] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low4);
                if (FORM & Q4_FIFTH) { /* bit s -> bit 4 of the low codes, bit 4 + s of the high ones */
                    const __m512i fl = s == 0 ? _mm512_slli_epi16(fifth[t], 4) : s == 1 ? _mm512_slli_epi16(fifth[t], 3)
                                       : s == 2 ? _mm512_slli_epi16(fifth[t], 2) : _mm512_slli_epi16(fifth[t], 1);
                    const __m512i fh = s == 0 ? fifth[t] : s == 1 ? _mm512_srli_epi16(fifth[t], 1)
                                       : s == 2 ? _mm512_srli_epi16(fifth[t], 2) : _mm512_srli_epi16(fifth[t], 3);
                    lo[t] = _mm512_ternarylogic_epi32(lo[t], fl, bit4, 0xF8); /* lo | (fl & bit4) */
                    hi[t] = _mm512_ternarylogic_epi32(hi[t], fh, bit4, 0xF8);
                }
            }
            for (int b = 0; b < NB; b++) {
                const int8_t *xb = xq + b * kp + c * 32 + 4 * s;
                int32_t x0, x1;
                memcpy(&x0, xb, sizeof x0);
                memcpy(&x1, xb + 16, sizeof x1);
                const __m512i v0 = _mm512_set1_epi32(x0), v1 = _mm512_set1_epi32(x1);
                for (int t = 0; t < NT; t++) {
                    a[t][b] = _mm512_dpbusd_epi32(a[t][b], lo[t], v0);
                    if (CHAINS == 2)
                        a2[t][b] = _mm512_dpbusd_epi32(a2[t][b], hi[t], v1);
                    else
                        a[t][b] = _mm512_dpbusd_epi32(a[t][b], hi[t], v1);
                }
            }
        }
        if (CHAINS == 2)
            for (int t = 0; t < NT; t++)
                for (int b = 0; b < NB; b++) a[t][b] = _mm512_add_epi32(a[t][b], a2[t][b]);
        for (int t = 0; t < NT; t++) {
            const __m512 sv = FORM & Q4_KSCALES ? q4k_factor(kb + (t * (C / 8) + c / 8) * Q4K_BYTES, 0, 4 * VW + c % 8 * VW)
                              : FORM & Q4_F16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(factors + t * C * CB)))
                                              : _mm512_loadu_ps(ps + t * G * VW + group * VW);
            for (int b = 0; b < NB; b++)
                f[t][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[t][b]), _mm512_mul_ps(sv, _mm512_set1_ps(xd[b * C + c])),
                                          f[t][b]);
            if ((FORM & Q4_F16) && !(FORM & Q4_SYMMETRIC)) { /* the block's zeros x its activation sum */
                const __m512 zv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(factors + t * C * CB + 2 * VW)));
                for (int b = 0; b < NB; b++) f[t][b] = _mm512_fmadd_ps(zv, _mm512_set1_ps(gsum[b * G + c]), f[t][b]);
            }
        }
        if (--blocks_left == 0) group++, blocks_left = per;
    }
    int4_q8_finish(kb, pz, gsum, C, G, NT, NB, f, out, FORM);
}
#else
/* Tiles [tile, tile + NT) (NT 1 or 2) against NB rows: both tiles share each broadcast
 * activation, and one pass keeps 4 x 2 x 2 accumulators with the codes of a step. Each
 * 16-bit sum is pinned to its register after every add (an empty asm): left free, gcc
 * reassociated the unrolled step loop's adds, computed a block's products first and
 * spilled them to the stack, at two thirds of this loop's rate. Five-bit codes (Q4_FIFTH)
 * make pair sums of up to 2 x 31 x 127, so two steps' worth (31496 < 32768) are widened into
 * int32 before the next two are added. */
TM_INLINE void int4_q8_block(const TmLinear *L, const int8_t *xq, const float *xd, const void *xsum, const int NT,
                             const int NB, int64_t tile, vf out[2][Q4_ROWS], const int FORM) {
    const int64_t kp = L->k * L->repeat, C = kp / 32, G = kp / L->group, per = L->group / 32;
    const int64_t CB = Q4_BLOCK_BYTES(FORM);
    const uint8_t *w0 = (const uint8_t *)L->packed + tile * C * CB, *w1 = w0 + C * CB;
    const float *ps = (const float *)L->packed_scale + tile * G * VW, *pz = (const float *)L->packed_zero + tile * G * VW;
    const uint8_t *kb = (const uint8_t *)L->packed_scale + tile * (C / 8) * Q4K_BYTES; /* Q4_KSCALES */
    const float *gsum = (const float *)xsum;
    const int32_t *bsum = (const int32_t *)xsum; /* Q4_SYMMETRIC: [NB][C] block code sums */
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), bit4 = _mm256_set1_epi8(0x10);
    vf f[2][Q4_ROWS];
    for (int t = 0; t < NT; t++)
        for (int b = 0; b < NB; b++) f[t][b] = (vf){0};
    int64_t group = 0, blocks_left = per; /* the block's weight-scale group, counted (no division a block) */
    for (int64_t c = 0; c < C; c++) {
        __m256i a[2][Q4_ROWS], first[2][Q4_ROWS], fifth[2];
        const uint8_t *factors = w0 + c * CB + Q4_FACTORS_AT(FORM); /* Q4_F16; tile 1's C x CB bytes on */
        for (int t = 0; t < NT; t++)
            for (int b = 0; b < NB; b++) a[t][b] = _mm256_setzero_si256();
        if (FORM & Q4_FIFTH)
            for (int t = 0; t < NT; t++) fifth[t] = _mm256_loadu_si256((const __m256i *)((t ? w1 : w0) + c * CB + 16 * VW));
#pragma GCC unroll 4
        for (int s = 0; s < 4; s++) {
            __m256i lo[2], hi[2];
            if ((FORM & Q4_FIFTH) && s == 2) /* the first two steps' pair sums into int32 */
                for (int t = 0; t < NT; t++)
                    for (int b = 0; b < NB; b++) first[t][b] = _mm256_madd_epi16(a[t][b], ones), a[t][b] = _mm256_setzero_si256();
            for (int t = 0; t < NT; t++) {
                const __m256i p = _mm256_loadu_si256((const __m256i *)((t ? w1 : w0) + c * CB + s * 32));
                lo[t] = _mm256_and_si256(p, low4);
                hi[t] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low4);
                if (FORM & Q4_FIFTH) { /* bit s -> bit 4 of the low codes, bit 4 + s of the high ones */
                    const __m256i fl = s == 0 ? _mm256_slli_epi16(fifth[t], 4) : s == 1 ? _mm256_slli_epi16(fifth[t], 3)
                                       : s == 2 ? _mm256_slli_epi16(fifth[t], 2) : _mm256_slli_epi16(fifth[t], 1);
                    const __m256i fh = s == 0 ? fifth[t] : s == 1 ? _mm256_srli_epi16(fifth[t], 1)
                                       : s == 2 ? _mm256_srli_epi16(fifth[t], 2) : _mm256_srli_epi16(fifth[t], 3);
                    lo[t] = _mm256_or_si256(lo[t], _mm256_and_si256(fl, bit4));
                    hi[t] = _mm256_or_si256(hi[t], _mm256_and_si256(fh, bit4));
                }
            }
            for (int b = 0; b < NB; b++) {
                const int8_t *xb = xq + b * kp + c * 32 + 4 * s;
                int32_t x0, x1;
                memcpy(&x0, xb, sizeof x0);
                memcpy(&x1, xb + 16, sizeof x1);
                const __m256i v0 = _mm256_set1_epi32(x0), v1 = _mm256_set1_epi32(x1);
                for (int t = 0; t < NT; t++) {
                    a[t][b] = _mm256_add_epi16(a[t][b], _mm256_maddubs_epi16(lo[t], v0));
                    __asm__("" : "+x"(a[t][b]));
                    a[t][b] = _mm256_add_epi16(a[t][b], _mm256_maddubs_epi16(hi[t], v1));
                    __asm__("" : "+x"(a[t][b]));
                }
            }
        }
        for (int t = 0; t < NT; t++) {
            const __m256 sv = FORM & Q4_KSCALES ? q4k_factor(kb + (t * (C / 8) + c / 8) * Q4K_BYTES, 0, 4 * VW + c % 8 * VW)
                              : FORM & Q4_F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(factors + t * C * CB)))
                                              : _mm256_loadu_ps(ps + t * G * VW + group * VW);
            for (int b = 0; b < NB; b++) {
                __m256i s32 = _mm256_madd_epi16(a[t][b], ones);
                if (FORM & Q4_FIFTH) s32 = _mm256_add_epi32(s32, first[t][b]);
                if (FORM & Q4_SYMMETRIC) /* codes - 8 (16), exactly: that x the block's activation code sum off */
                    s32 = _mm256_sub_epi32(s32, _mm256_set1_epi32(Q4_CODE_OFFSET(FORM) * bsum[b * C + c]));
                f[t][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), _mm256_mul_ps(sv, _mm256_set1_ps(xd[b * C + c])), f[t][b]);
            }
            if ((FORM & Q4_F16) && !(FORM & Q4_SYMMETRIC)) { /* the block's zeros x its activation sum */
                const __m256 zv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(factors + t * C * CB + 2 * VW)));
                for (int b = 0; b < NB; b++) f[t][b] = _mm256_fmadd_ps(zv, _mm256_set1_ps(gsum[b * G + c]), f[t][b]);
            }
        }
        if (--blocks_left == 0) group++, blocks_left = per;
    }
    int4_q8_finish(kb, pz, gsum, C, G, NT, NB, f, out, FORM);
}
#endif

/* One pass's sums (tile t's NB rows in acc_t) plus the bias into y (=, or += when
 * accumulate): int4_q8_rows_form and q6k_rows. */
TM_INLINE void store_tile_rows(const TmLinear *L, const vf *acc0, const vf *acc1, int NT, int64_t NB, int64_t tile,
                               int64_t b0, float *y, int64_t ldy, int accumulate, int64_t y_col0) {
    for (int t = 0; t < NT; t++) {
        const vf bias = L->bias ? vload(L->bias + (tile + t) * VW) : (vf){0};
        const vf *acc = t ? acc1 : acc0;
        for (int64_t b = 0; b < NB; b++) {
            float *yb = y + (b0 + b) * ldy - y_col0 + (tile + t) * VW;
            const vf v = acc[b] + bias;
            vstore(yb, accumulate ? vload(yb) + v : v);
        }
    }
}

/* y[b, n - y_col0] (=, or += when accumulate) for rows [n0, n1) (whole tiles) of an int4
 * layer in the nibble packing, from the input as quantize_q8_rows left it; FORM, the
 * layer's q4_form, compiled in (int4_q8_rows). */
TM_INLINE void int4_q8_rows_form(const TmLinear *L, const int8_t *xq, const float *xd, const float *xsum, int64_t B,
                                 int64_t n0, int64_t n1, float *y, int64_t ldy, int accumulate, int64_t y_col0,
                                 const int FORM) {
    const int64_t kp = L->k * L->repeat, C = kp / 32, G = FORM & Q4_SYMMETRIC ? C : kp / L->group;
    vf acc[2][Q4_ROWS];
    for (int64_t tile = n0 / VW; tile < n1 / VW;) {
        /* One activation row: one tile at a time. Two tiles' codes and scales are four short
         * streams of memory a pass, which the hardware prefetchers followed worse than two (the
         * shared activation broadcast saves nothing worth that when a row is all there is). */
        const int NT = B > 1 && tile + 1 < n1 / VW ? 2 : 1;
        for (int64_t b0 = 0; b0 < B; b0 += Q4_ROWS) {
            const int64_t left = B - b0;
            const int NB = left >= Q4_ROWS ? Q4_ROWS : (int)left;
            const int8_t *xb = xq + b0 * kp;
            const float *xdb = xd + b0 * C, *xsb = xsum + b0 * G;
#define Q4_BLOCK(T, N) int4_q8_block(L, xb, xdb, xsb, T, N, tile, acc, FORM)
#if Q4_ROWS == 6
#define Q4_WIDE_CASES(T) case 4: Q4_BLOCK(T, 4); break; case 5: Q4_BLOCK(T, 5); break;
#else
#define Q4_WIDE_CASES(T)
#endif
#define Q4_SWITCH(T)                                                                                    \
    switch (NB) {                                                                                       \
        case 1: Q4_BLOCK(T, 1); break;                                                                  \
        case 2: Q4_BLOCK(T, 2); break;                                                                  \
        case 3: Q4_BLOCK(T, 3); break;                                                                  \
        Q4_WIDE_CASES(T)                                                                                \
        default: Q4_BLOCK(T, Q4_ROWS); break;                                                           \
    }
            if (NT == 2) {
                Q4_SWITCH(2)
            } else {
                Q4_SWITCH(1)
            }
#undef Q4_SWITCH
#undef Q4_WIDE_CASES
#undef Q4_BLOCK
            store_tile_rows(L, acc[0], acc[1], NT, NB, tile, b0, y, ldy, accumulate, y_col0);
        }
        tile += NT;
    }
}

/* The five-bit forms (Q4_FIFTH), a function of their own: compiled into int4_q8_rows beside the
 * four-bit ones, the one function grew past what gcc optimizes as well, and the AVX2 build's
 * four-bit prefill slowed (docs/performance.md, "The judged figures again"). */
static __attribute__((noinline)) void int5_q8_rows(const TmLinear *L, const int8_t *xq, const float *xd,
                                                   const float *xsum, int64_t B, int64_t n0, int64_t n1, float *y,
                                                   int64_t ldy, int accumulate, int64_t y_col0) {
    if (L->q4_form & Q4_KSCALES) { /* GGUF Q5_K */
        int4_q8_rows_form(L, xq, xd, xsum, B, n0, n1, y, ldy, accumulate, y_col0, Q4_KSCALES | Q4_FIFTH);
        return;
    }
    switch (L->q4_form & (Q4_SYMMETRIC | Q4_F16)) { /* GGUF Q5_0 (symmetric, fp16), Q5_1 (fp16); else float32 */
        case Q4_SYMMETRIC | Q4_F16:
            int4_q8_rows_form(L, xq, xd, xsum, B, n0, n1, y, ldy, accumulate, y_col0, Q4_FIFTH | Q4_SYMMETRIC | Q4_F16);
            break;
        case Q4_F16: int4_q8_rows_form(L, xq, xd, xsum, B, n0, n1, y, ldy, accumulate, y_col0, Q4_FIFTH | Q4_F16); break;
        default: int4_q8_rows_form(L, xq, xd, xsum, B, n0, n1, y, ldy, accumulate, y_col0, Q4_FIFTH); break;
    }
}

static void int4_q8_rows(const TmLinear *L, const int8_t *xq, const float *xd, const float *xsum, int64_t B,
                         int64_t n0, int64_t n1, float *y, int64_t ldy, int accumulate, int64_t y_col0) {
    if (L->q4_form & Q4_FIFTH) {
        int5_q8_rows(L, xq, xd, xsum, B, n0, n1, y, ldy, accumulate, y_col0);
        return;
    }
    if (L->q4_form & Q4_KSCALES) {
        int4_q8_rows_form(L, xq, xd, xsum, B, n0, n1, y, ldy, accumulate, y_col0, Q4_KSCALES);
        return;
    }
    switch (L->q4_form & (Q4_SYMMETRIC | Q4_F16)) {
        case Q4_SYMMETRIC | Q4_F16:
            int4_q8_rows_form(L, xq, xd, xsum, B, n0, n1, y, ldy, accumulate, y_col0, Q4_SYMMETRIC | Q4_F16);
            break;
        case Q4_SYMMETRIC: int4_q8_rows_form(L, xq, xd, xsum, B, n0, n1, y, ldy, accumulate, y_col0, Q4_SYMMETRIC); break;
        case Q4_F16: int4_q8_rows_form(L, xq, xd, xsum, B, n0, n1, y, ldy, accumulate, y_col0, Q4_F16); break;
        default: int4_q8_rows_form(L, xq, xd, xsum, B, n0, n1, y, ldy, accumulate, y_col0, 0); break;
    }
}
#endif /* TM_Q4_PACKED */
