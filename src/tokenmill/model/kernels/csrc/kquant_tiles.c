/* GGUF Q6_K layers in pack_q6_tiles' tiles against int8 activations (q6k_rows), on the
 * int4 files' packing conventions (store_tile_rows). */
#include "tm_kernels.h"

#ifdef TM_Q6_TILES
/* GGUF Q6_K layers in tiles (AVX-512 VNNI, AVX2): w = d sc (q - 32), q 6 bits, sc an int8 scale per
 * 16 weights, d an fp16 per 256. L->packed holds, per tile of VW rows and 32-input block, the
 * codes' low nibbles as the int4 nibble packing has them (four steps of 4 VW bytes), then two
 * 4 VW-byte vectors of their top two bits (byte 4r + i: bits 2s..2s+1 hold step s's input i of
 * row r, for the block's first 16 inputs, then for its last 16); L->packed_scale, per tile and
 * super-block, d (VW fp16) and the 16 sub-blocks' sc (VW bytes each): cpu_kernels.pack_q6_tiles,
 * 6.6 bits a weight as in the file. Each block's first and last 16 inputs are summed apart
 * (their scales differ), starting at -32 x the activations' code sum of those 16 (hsum), so
 * the sums are exact; the two are scaled and added in float32 with the row's activation scale.
 * out[t][b] lane i: row i of tile t . x_b. */
#define Q6_CODE_BYTES (24 * VW) /* per tile and 32-input block */
#define Q6_SCALE_BYTES (18 * VW) /* per tile and super-block */
#ifdef TM_Q4_VNNI
#define Q6_ROWS 3 /* activation rows per pass: two tiles' two int32 and one float accumulators each (18 registers) */
#define Q6_TILES_PER_PASS 2
TM_INLINE __m512i q6_code(__m512i nib, __m512i top, int s) {
    const __m512i t = s == 0 ? _mm512_slli_epi16(top, 4) : s == 1 ? _mm512_slli_epi16(top, 2)
                      : s == 2 ? top : _mm512_srli_epi16(top, 2);
    return _mm512_or_si512(nib, _mm512_and_si512(t, _mm512_set1_epi8(0x30)));
}
/* A 16-weight sub-block's scales d sc for the tile's VW rows (sc: VW int8). */
TM_INLINE __m512 q6_scale(__m512 d, const uint8_t *sc) {
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sc))));
}
TM_INLINE void q6k_block(const TmLinear *L, const int8_t *xq, const float *xd, const int32_t *hsum, const int NT,
                         const int NB, int64_t tile, vf out[2][Q6_ROWS]) {
    const int64_t K = L->k, C = K / 32;
    const uint8_t *w0 = (const uint8_t *)L->packed + tile * C * Q6_CODE_BYTES;
    const uint8_t *k0 = (const uint8_t *)L->packed_scale + tile * (C / 8) * Q6_SCALE_BYTES;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 f[2][Q6_ROWS];
    for (int t = 0; t < NT; t++)
        for (int b = 0; b < NB; b++) f[t][b] = _mm512_setzero_ps();
    for (int64_t c = 0; c < C; c++) {
        __m512i alo[2][Q6_ROWS], ahi[2][Q6_ROWS], tlo[2], thi[2];
        for (int b = 0; b < NB; b++) {
            const __m512i slo = _mm512_set1_epi32(-32 * hsum[b * 2 * C + 2 * c]);
            const __m512i shi = _mm512_set1_epi32(-32 * hsum[b * 2 * C + 2 * c + 1]);
            for (int t = 0; t < NT; t++) alo[t][b] = slo, ahi[t][b] = shi;
        }
        for (int t = 0; t < NT; t++) {
            const uint8_t *wc = w0 + (t * C + c) * Q6_CODE_BYTES;
            tlo[t] = _mm512_loadu_si512((const void *)(wc + 16 * VW));
            thi[t] = _mm512_loadu_si512((const void *)(wc + 20 * VW));
        }
#pragma GCC unroll 4
        for (int s = 0; s < 4; s++) {
            __m512i lo[2], hi[2];
            for (int t = 0; t < NT; t++) {
                const __m512i p = _mm512_loadu_si512((const void *)(w0 + (t * C + c) * Q6_CODE_BYTES + s * 4 * VW));
                lo[t] = q6_code(_mm512_and_si512(p, low4), tlo[t], s);
                hi[t] = q6_code(_mm512_and_si512(_mm512_srli_epi16(p, 4), low4), thi[t], s);
            }
            for (int b = 0; b < NB; b++) {
                const int8_t *xb = xq + b * K + c * 32 + 4 * s;
                int32_t x0, x1;
                memcpy(&x0, xb, sizeof x0);
                memcpy(&x1, xb + 16, sizeof x1);
                const __m512i v0 = _mm512_set1_epi32(x0), v1 = _mm512_set1_epi32(x1);
                for (int t = 0; t < NT; t++) {
                    alo[t][b] = _mm512_dpbusd_epi32(alo[t][b], lo[t], v0);
                    ahi[t][b] = _mm512_dpbusd_epi32(ahi[t][b], hi[t], v1);
                }
            }
        }
        for (int t = 0; t < NT; t++) {
            const uint8_t *sb = k0 + (t * (C / 8) + c / 8) * Q6_SCALE_BYTES;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sb));
            const uint8_t *sc = sb + 2 * VW + (c % 8) * 2 * VW;
            const __m512 slo = q6_scale(d, sc), shi = q6_scale(d, sc + VW);
            for (int b = 0; b < NB; b++) {
                const __m512 g = _mm512_fmadd_ps(shi, _mm512_cvtepi32_ps(ahi[t][b]), _mm512_mul_ps(slo, _mm512_cvtepi32_ps(alo[t][b])));
                f[t][b] = _mm512_fmadd_ps(g, _mm512_set1_ps(xd[b * C + c]), f[t][b]);
            }
        }
    }
    for (int t = 0; t < NT; t++)
        for (int b = 0; b < NB; b++) memcpy(&out[t][b], &f[t][b], sizeof(vf));
}
#else
/* AVX2: vpmaddubsw's 16-bit pair sums (at most 2 x 63 x 128 in size) hold two steps' worth
 * (32256 < 32768) before one vpmaddwd widens them into the block half's int32 sum. Sixteen
 * registers: one tile a pass, two rows. */
#define Q6_ROWS 2
#define Q6_TILES_PER_PASS 1
TM_INLINE __m256i q6_code(__m256i nib, __m256i top, int s) {
    const __m256i t = s == 0 ? _mm256_slli_epi16(top, 4) : s == 1 ? _mm256_slli_epi16(top, 2)
                      : s == 2 ? top : _mm256_srli_epi16(top, 2);
    return _mm256_or_si256(nib, _mm256_and_si256(t, _mm256_set1_epi8(0x30)));
}
/* As the AVX-512 q6_scale, 8 lanes. */
TM_INLINE __m256 q6_scale(__m256 d, const uint8_t *sc) {
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)sc))));
}
TM_INLINE void q6k_block(const TmLinear *L, const int8_t *xq, const float *xd, const int32_t *hsum, const int NT,
                         const int NB, int64_t tile, vf out[2][Q6_ROWS]) {
    const int64_t K = L->k, C = K / 32;
    const uint8_t *w0 = (const uint8_t *)L->packed + tile * C * Q6_CODE_BYTES;
    const uint8_t *k0 = (const uint8_t *)L->packed_scale + tile * (C / 8) * Q6_SCALE_BYTES;
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 f[Q6_ROWS];
    (void)NT; /* one tile a pass */
    for (int b = 0; b < NB; b++) f[b] = _mm256_setzero_ps();
    for (int64_t c = 0; c < C; c++) {
        const uint8_t *wc = w0 + c * Q6_CODE_BYTES;
        const __m256i tlo = _mm256_loadu_si256((const __m256i *)(wc + 16 * VW));
        const __m256i thi = _mm256_loadu_si256((const __m256i *)(wc + 20 * VW));
        __m256i alo[Q6_ROWS], ahi[Q6_ROWS];
        for (int b = 0; b < NB; b++) {
            alo[b] = _mm256_set1_epi32(-32 * hsum[b * 2 * C + 2 * c]);
            ahi[b] = _mm256_set1_epi32(-32 * hsum[b * 2 * C + 2 * c + 1]);
        }
        for (int s = 0; s < 4; s += 2) {
            __m256i lo[2], hi[2];
            for (int u = 0; u < 2; u++) {
                const __m256i p = _mm256_loadu_si256((const __m256i *)(wc + (s + u) * 4 * VW));
                lo[u] = q6_code(_mm256_and_si256(p, low4), tlo, s + u);
                hi[u] = q6_code(_mm256_and_si256(_mm256_srli_epi16(p, 4), low4), thi, s + u);
            }
            for (int b = 0; b < NB; b++) {
                const int8_t *xb = xq + b * K + c * 32 + 4 * s;
                int32_t x0, x1, x2, x3;
                memcpy(&x0, xb, 4), memcpy(&x1, xb + 16, 4), memcpy(&x2, xb + 4, 4), memcpy(&x3, xb + 20, 4);
                const __m256i plo = _mm256_add_epi16(_mm256_maddubs_epi16(lo[0], _mm256_set1_epi32(x0)),
                                                     _mm256_maddubs_epi16(lo[1], _mm256_set1_epi32(x2)));
                const __m256i phi = _mm256_add_epi16(_mm256_maddubs_epi16(hi[0], _mm256_set1_epi32(x1)),
                                                     _mm256_maddubs_epi16(hi[1], _mm256_set1_epi32(x3)));
                alo[b] = _mm256_add_epi32(alo[b], _mm256_madd_epi16(plo, ones));
                ahi[b] = _mm256_add_epi32(ahi[b], _mm256_madd_epi16(phi, ones));
            }
        }
        const uint8_t *sb = k0 + (c / 8) * Q6_SCALE_BYTES;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sb));
        const uint8_t *sc = sb + 2 * VW + (c % 8) * 2 * VW;
        const __m256 slo = q6_scale(d, sc), shi = q6_scale(d, sc + VW);
        for (int b = 0; b < NB; b++) {
            const __m256 g = _mm256_fmadd_ps(shi, _mm256_cvtepi32_ps(ahi[b]), _mm256_mul_ps(slo, _mm256_cvtepi32_ps(alo[b])));
            f[b] = _mm256_fmadd_ps(g, _mm256_set1_ps(xd[b * C + c]), f[b]);
        }
    }
    for (int b = 0; b < NB; b++) memcpy(&out[0][b], &f[b], sizeof(vf));
}
#endif

/* y[b, n - y_col0] (=, or += when accumulate) for rows [n0, n1) (whole tiles) of a Q6_K layer
 * in tiles, from the input as quantize_q8_rows left it (codes, scales, 16-input code sums). */
static void q6k_rows(const TmLinear *L, const int8_t *xq, const float *xd, const int32_t *hsum, int64_t B, int64_t n0,
                     int64_t n1, float *y, int64_t ldy, int accumulate, int64_t y_col0) {
    const int64_t K = L->k, C = K / 32;
    vf acc[2][Q6_ROWS];
    for (int64_t tile = n0 / VW; tile < n1 / VW;) {
        /* one row: one stream of codes (int4_q8_rows_form) */
        const int NT = Q6_TILES_PER_PASS == 2 && B > 1 && tile + 1 < n1 / VW ? 2 : 1;
        for (int64_t b0 = 0; b0 < B; b0 += Q6_ROWS) {
            const int64_t left = B - b0;
            const int NB = left >= Q6_ROWS ? Q6_ROWS : (int)left;
            const int8_t *xb = xq + b0 * K;
            const float *xdb = xd + b0 * C;
            const int32_t *hb = hsum + b0 * 2 * C;
#define Q6_BLOCK(T, N) q6k_block(L, xb, xdb, hb, T, N, tile, acc)
#if Q6_ROWS == 3
#define Q6_THREE_CASE(T) case 2: Q6_BLOCK(T, 2); break;
#else
#define Q6_THREE_CASE(T)
#endif
#define Q6_SWITCH(T)                                                                                    \
    switch (NB) {                                                                                       \
        case 1: Q6_BLOCK(T, 1); break;                                                                  \
        default: Q6_BLOCK(T, Q6_ROWS); break;                                                           \
        Q6_THREE_CASE(T)                                                                                \
    }
            if (NT == 2) {
                Q6_SWITCH(2)
            } else {
                Q6_SWITCH(1)
            }
#undef Q6_SWITCH
#undef Q6_THREE_CASE
#undef Q6_BLOCK
            store_tile_rows(L, acc[0], acc[1], NT, NB, tile, b0, y, ldy, accumulate, y_col0);
        }
        tile += NT;
    }
}
#endif
