/* GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) as stored. Many activation rows: linear.c's
 * linear_rows widens a tile of rows to float32 here, exactly as ggml dequantizes them, and
 * runs its dense float32 tile over it (float32 activations). Few rows (decode): the codes
 * times int8 activations with integer dot products (kq_dot_rows, below). Either way a
 * K-quant file keeps its own bytes in memory and its exact weights in the products.
 *
 * Layouts (256 weights per super-block, rows of k / 256 super-blocks):
 *   Q4_K, 144 bytes: d, dmin (fp16), 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32,
 *     128 bytes of nibbles; w = (d * sc) * q - (dmin * m).
 *   Q5_K, 176 bytes: the same, plus 32 bytes holding each weight's fifth bit.
 *   Q6_K, 210 bytes: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one
 *     per 16 weights), d (fp16); w = (d * sc) * (q - 32).
 * Every product here is exact in float32 (the codes and scales are short), so a compiler's
 * fused multiply-add rounds nothing differently from ggml's separate multiply and subtract. */
#include "tm_kernels.h"

enum { KQ_Q4_K = 12, KQ_Q5_K = 13, KQ_Q6_K = 14 }; /* ggml's type ids */

static inline float kq_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, mant = h & 1023;
    uint32_t bits;
    if (exp == 31) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant) { /* subnormal: normalise */
        int e = -1;
        uint32_t m = mant;
        do {
            e++;
            m <<= 1;
        } while (!(m & 1024));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 1023) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Bytes per 256-weight super-block, 0 for a type this file does not take. */
static inline int64_t kq_block_bytes(int type) {
    return type == KQ_Q4_K ? 144 : type == KQ_Q5_K ? 176 : type == KQ_Q6_K ? 210 : 0;
}

/* Sub-block j's 6-bit scale and min from the 12 packed bytes (Q4_K, Q5_K). */
static inline void kq_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* A Q4_K / Q5_K super-block's 256 codes in input order: 0..15, or 0..31 with Q5_K's fifth
 * bits. Each 32 bytes of nibbles hold two sub-blocks, the low nibbles' then the high ones'. */
static inline void kq_codes_q45(const uint8_t *b, int five, uint8_t *q) {
    const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
    for (int j = 0; j < 4; j++) {
        const uint8_t u0 = (uint8_t)(1u << (2 * j)), u1 = (uint8_t)(2u << (2 * j));
        for (int l = 0; l < 32; l++) {
            q[64 * j + l] = (uint8_t)((qs[32 * j + l] & 0xF) + (five && (qh[l] & u0) ? 16 : 0));
            q[64 * j + 32 + l] = (uint8_t)((qs[32 * j + l] >> 4) + (five && (qh[l] & u1) ? 16 : 0));
        }
    }
}

static void kq_dequant_q45(const uint8_t *b, float *y, int five) {
    const float d = kq_half(b), dmin = kq_half(b + 2);
    uint8_t q[256];
    kq_codes_q45(b, five, q);
    for (int j = 0; j < 8; j++) { /* sub-block j: w = (d * sc_j) * q - dmin * m_j */
        uint8_t sc, m;
        kq_scale_min(j, b + 4, &sc, &m);
        const float dj = d * sc, nj = dmin * m;
        for (int l = 0; l < 32; l++) y[32 * j + l] = dj * (float)q[32 * j + l] - nj;
    }
}

static void kq_dequant_q6(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = kq_half(b + 208);
    for (int n = 0; n < 2; n++) { /* two halves of 128 weights */
        for (int l = 0; l < 32; l++) {
            const int is = l / 16;
            const int q1 = (int)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = (int)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = d * (float)sc[is] * (float)q1;
            y[l + 32] = d * (float)sc[is + 2] * (float)q2;
            y[l + 64] = d * (float)sc[is + 4] * (float)q3;
            y[l + 96] = d * (float)sc[is + 6] * (float)q4;
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
    }
}

/* Rows [r0, r0 + nr) of a K-quant matrix of k inputs (k % 256 == 0) into w ([nr, k]). */
static void kq_dequant_rows(int type, const uint8_t *blocks, int64_t k, int64_t r0, int64_t nr, float *w) {
    const int64_t bb = kq_block_bytes(type), per_row = k / 256;
    for (int64_t r = 0; r < nr; r++) {
        const uint8_t *row = blocks + (r0 + r) * per_row * bb;
        for (int64_t s = 0; s < per_row; s++) {
            float *y = w + r * k + s * 256;
            if (type == KQ_Q6_K)
                kq_dequant_q6(row + s * bb, y);
            else
                kq_dequant_q45(row + s * bb, y, type == KQ_Q5_K);
        }
    }
}

/* ------------------------------------------------------------------ integer tiles for many rows
 *
 * Many activation rows (prefill chunks) multiply a Q4_K / Q5_K tile on the int8g kernels
 * (linear.c's kq_int8g_rows: AMX tiles or VNNI / AVX2 integer products) instead of
 * widening it to float32: per 32-weight sub-block the codes q (0..15, or 0..31) are int8
 * codes with the group scale d * sc, and the min's part, dmin * m times the activations'
 * group sum, is taken off after. The weights stay exactly the file's. Q6_K's scales are per
 * 16 weights, finer than the int8g groups, so its tiles stay float32. */

/* Rows [r0, r0 + nr) (nr a multiple of VW) of a Q4_K / Q5_K matrix of k inputs as int8g
 * tiles: packed [nr / VW][k / 4][VW][4] codes (the VNNI packing), scale, row_sums (-128 x
 * each group's code sum, for the u8 activations' offset) and zero (dmin * m), each
 * [nr / VW][k / 32][VW]. rowbuf: VW * 256 bytes of scratch. */
static void kq_int8g_tiles(int type, const uint8_t *blocks, int64_t k, int64_t r0, int64_t nr, uint8_t *rowbuf,
                           int8_t *packed, float *scale, int32_t *row_sums, float *zero) {
    const int five = type == KQ_Q5_K;
    const int64_t bb = kq_block_bytes(type), nsb = k / 256, G = k / 32;
    for (int64_t t = 0; t < nr / VW; t++) {
        int8_t *pt = packed + t * k * VW;
        float *st = scale + t * G * VW, *zt = zero + t * G * VW;
        int32_t *rt = row_sums + t * G * VW;
        for (int64_t s = 0; s < nsb; s++) {
            for (int r = 0; r < VW; r++) {
                const uint8_t *b = blocks + ((r0 + t * VW + r) * nsb + s) * bb;
                const float d = kq_half(b), dmin = kq_half(b + 2);
                uint8_t *q = rowbuf + r * 256;
                kq_codes_q45(b, five, q);
                for (int j = 0; j < 8; j++) {
                    uint8_t sc, m;
                    kq_scale_min(j, b + 4, &sc, &m);
                    int sum = 0;
                    for (int l = 0; l < 32; l++) sum += q[32 * j + l];
                    const int64_t g = s * 8 + j;
                    st[g * VW + r] = d * (float)sc;
                    zt[g * VW + r] = dmin * (float)m;
                    rt[g * VW + r] = -128 * sum;
                }
            }
            /* VNNI packing: 4 consecutive inputs of a row form one 32-bit word, VW rows' words side by side */
            int32_t *words = (int32_t *)(pt + s * 256 * VW);
            for (int64_t c4 = 0; c4 < 64; c4++)
                for (int r = 0; r < VW; r++) memcpy(words + c4 * VW + r, rowbuf + r * 256 + 4 * c4, 4);
        }
    }
}

/* ------------------------------------------------------------------ integer dot products
 *
 * Decode rows (few activation rows, linear.c's TM_KQ_DOT_ROWS) multiply the blocks'
 * codes by int8 activations instead: widening a tile of rows to float32 costs more than
 * the products it feeds when only a row or two of activations shares it, while the
 * integer path reads the bytes as stored and multiplies 64 (AVX-512 VNNI, vpdpbusd) or
 * 32 (AVX2, vpmaddubsw + vpmaddwd, or AVX-VNNI's vpdpbusd) codes by activations in one
 * instruction. Each activation row is quantized on its own, with one scale per 32 inputs
 * (kq_quantize_rows), so a row's result depends neither on the rows beside it nor on the
 * thread count. Per 32-weight sub-block j of a Q4_K / Q5_K row and 32 inputs c:
 *   d * sc_j * xd_c * sum(q * xq) - dmin * m_j * (xd_c * sum(xq)),
 * and per 16-weight sub-block of Q6_K: d * sc_j * xd_c * (sum(q * xq) - 32 * sum(xq)); the
 * integer sums are exact (a vpmaddubsw pair is at most 2 x 63 x 127, no saturation), so
 * every build with this path gives the same sums, rounded differently only in float. */
#ifdef TM_KQ_DOT
#define KQ_ROWS 6 /* activation rows per pass over a row's blocks */

static inline float kq_f16(const uint8_t *p) {
#ifdef __F16C__
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h); /* exact, as kq_half */
#else
    return kq_half(p);
#endif
}

/* Q4_K / Q5_K's 12 packed bytes as 8 scales then 8 mins, one byte each (kq_scale_min for
 * all eight sub-blocks at once), in a register: bytes stored and read back as a vector
 * would wait on the store. */
static inline __m128i kq_unpack_scales(const uint8_t *q) {
    uint32_t u[3];
    memcpy(u, q, 12);
    const uint32_t m6 = 0x3f3f3f3fu, m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
    return _mm_setr_epi32((int)(u[0] & m6), (int)((u[2] & m4) | (((u[0] >> 6) & m2) << 4)), (int)(u[1] & m6),
                          (int)(((u[2] >> 4) & m4) | (((u[1] >> 6) & m2) << 4)));
}

/* The largest |x| of 32 floats: the int8 scale of one activation block (amax / 127), as
 * the per-32 activation quantizers take it (kq_quantize_rows below, int8.c's
 * quantize_group_rows). */
static inline float amax_32(const float *xs) {
    float amax = 0.0f;
#pragma omp simd reduction(max : amax)
    for (int i = 0; i < 32; i++) {
        const float v = fabsf(xs[i]);
        amax = v > amax ? v : amax;
    }
    return amax;
}

/* Rows of x as int8 codes q = round(x / d), d = amax / 127 per 32 inputs (xq [B, k], xd
 * [B, k / 32]), with each 32 and each 16 inputs' code sums times their d (s32 [B, k / 32],
 * s16 [B, k / 16]) for the min and offset terms. */
static void kq_quantize_rows(const float *x, int64_t ldx, int64_t B, int64_t k, int8_t *xq, float *xd, float *s32,
                             float *s16) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t c0 = 0; c0 < k; c0 += 32) {
            const float *xs = x + b * ldx + c0;
            const float amax = amax_32(xs);
            const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
            int8_t *q = xq + b * k + c0;
            int sum[2] = {0, 0};
            for (int h = 0; h < 2; h++) {
                int t = 0;
#pragma omp simd reduction(+ : t)
                for (int i = 16 * h; i < 16 * h + 16; i++) {
                    const int v = (int)nearbyintf(xs[i] * id);
                    q[i] = (int8_t)v;
                    t += v;
                }
                sum[h] = t;
            }
            xd[b * (k / 32) + c0 / 32] = d;
            s32[b * (k / 32) + c0 / 32] = d * (float)(sum[0] + sum[1]);
            s16[b * (k / 16) + c0 / 16] = d * (float)sum[0];
            s16[b * (k / 16) + c0 / 16 + 1] = d * (float)sum[1];
        }
}

#if VW == 16
/* One Q4_K / Q5_K row against NB activation rows: f[b] lane sums to row . x_b. A 64-code
 * vector holds sub-blocks 2j (low nibbles) and 2j + 1 (high), in input order, so it meets
 * 64 consecutive activation bytes; lanes 0-7 of its vpdpbusd sums are sub-block 2j's,
 * 8-15 sub-block 2j + 1's, scaled by a permute of the 8 sub-block scales (d sc_j xd_c). */
TM_INLINE void kq_row_q45(const uint8_t *row, int64_t nsb, const int five, const int8_t *xq, int64_t k,
                          const float *xd, const float *s32, const int NB, __m512 f[KQ_ROWS]) {
    const int64_t bb = five ? 176 : 144;
    const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
    for (int b = 0; b < NB; b++) f[b] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *blk = row + s * bb;
        const __m128i smv = kq_unpack_scales(blk + 4);
        const __m512 wsc = _mm512_mul_ps(_mm512_set1_ps(kq_f16(blk)),
                                         _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(smv, _mm_setzero_si128()))));
        const __m512 wmn = _mm512_mul_ps(_mm512_set1_ps(kq_f16(blk + 2)),
                                         _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi64(smv, _mm_setzero_si128()))));
        const uint8_t *qs = blk + (five ? 48 : 16);
        const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
        __m512i codes[4];
        for (int j = 0; j < 4; j++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
            if (five) { /* the fifth bit: bit 2j of qh for the low codes, 2j + 1 for the high */
                const __m256i ml = _mm256_set1_epi8((char)(1 << (2 * j))), mh = _mm256_set1_epi8((char)(2 << (2 * j)));
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, ml), ml), bit4));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, mh), mh), bit4));
            }
            codes[j] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        }
        for (int b = 0; b < NB; b++) {
            const int8_t *xb = xq + b * k + s * 256;
            const __m512 p = _mm512_mul_ps(wsc, _mm512_maskz_loadu_ps(0xFF, xd + b * (k / 32) + s * 8));
            for (int j = 0; j < 4; j++) {
                const __m512i idx = _mm512_set_epi32(2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1,
                                                     2 * j + 1, 2 * j + 1, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j,
                                                     2 * j, 2 * j);
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[j], _mm512_loadu_si512(xb + 64 * j));
                f[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(idx, p), f[b]);
            }
            f[b] = _mm512_fnmadd_ps(wmn, _mm512_maskz_loadu_ps(0xFF, s32 + b * (k / 32) + s * 8), f[b]);
        }
    }
}

/* One Q6_K row against NB activation rows. Each half of 128 weights: ql's 64 bytes give
 * weights 0-63 (low nibbles) and 64-127 (high), qh's 32 bytes their top two bits (pairs 0
 * and 1 for the first 64, 2 and 3 for the rest); a 64-code vector's lanes 4i..4i+3 are
 * 16-weight sub-block i's. The -32 offset goes on the 16-input sums (s16). */
TM_INLINE void kq_row_q6(const uint8_t *row, int64_t nsb, const int8_t *xq, int64_t k, const float *xd,
                         const float *s16, const int NB, __m512 f[KQ_ROWS]) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x03);
    const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    for (int b = 0; b < NB; b++) f[b] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *blk = row + s * 210;
        const __m512 wsc = _mm512_mul_ps(_mm512_set1_ps(kq_f16(blk + 208)),
                                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192)))));
        __m512i codes[4];
        for (int n = 0; n < 2; n++) {
            const __m512i ql = _mm512_loadu_si512((const void *)(blk + 64 * n));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n));
            const __m512i h01 = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
            const __m512i h23 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(h, 4)), _mm256_srli_epi16(h, 6), 1);
            codes[2 * n] = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_slli_epi16(_mm512_and_si512(h01, two), 4));
            codes[2 * n + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                               _mm512_slli_epi16(_mm512_and_si512(h23, two), 4));
        }
        for (int b = 0; b < NB; b++) {
            const int8_t *xb = xq + b * k + s * 256;
            const __m512 xd16 = _mm512_permutexvar_ps(pairs, _mm512_maskz_loadu_ps(0xFF, xd + b * (k / 32) + s * 8));
            const __m512 p = _mm512_mul_ps(wsc, xd16); /* per 16-weight sub-block */
            for (int j = 0; j < 4; j++) {
                const __m512i idx = _mm512_set_epi32(4 * j + 3, 4 * j + 3, 4 * j + 3, 4 * j + 3, 4 * j + 2, 4 * j + 2,
                                                     4 * j + 2, 4 * j + 2, 4 * j + 1, 4 * j + 1, 4 * j + 1, 4 * j + 1,
                                                     4 * j, 4 * j, 4 * j, 4 * j);
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[j], _mm512_loadu_si512(xb + 64 * j));
                f[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(idx, p), f[b]);
            }
            f[b] = _mm512_fnmadd_ps(_mm512_mul_ps(wsc, _mm512_set1_ps(32.0f)), _mm512_loadu_ps(s16 + b * (k / 16) + s * 16),
                                    f[b]);
        }
    }
}
typedef __m512 kq_acc;
#else
/* 32 unsigned codes times 32 int8 activations, added into 8 int32 lanes (4 inputs each). */
TM_INLINE __m256i kq_dot32(__m256i codes, const int8_t *x) {
    const __m256i xv = _mm256_loadu_si256((const __m256i *)x);
#ifdef __AVXVNNI__
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), codes, xv);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(codes, xv), _mm256_set1_epi16(1));
#endif
}

/* AVX2: a 32-code vector is one 32-weight sub-block, scaled by a broadcast of its d sc_j xd_c. */
TM_INLINE void kq_row_q45(const uint8_t *row, int64_t nsb, const int five, const int8_t *xq, int64_t k,
                          const float *xd, const float *s32, const int NB, __m256 f[KQ_ROWS]) {
    const int64_t bb = five ? 176 : 144;
    const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
    for (int b = 0; b < NB; b++) f[b] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *blk = row + s * bb;
        const __m128i smv = kq_unpack_scales(blk + 4);
        const __m256 wsc = _mm256_mul_ps(_mm256_set1_ps(kq_f16(blk)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(smv)));
        const __m256 wmn = _mm256_mul_ps(_mm256_set1_ps(kq_f16(blk + 2)),
                                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(smv, 8))));
        const uint8_t *qs = blk + (five ? 48 : 16);
        const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
        __m256 p[KQ_ROWS];
        for (int b = 0; b < NB; b++) {
            p[b] = _mm256_mul_ps(wsc, _mm256_loadu_ps(xd + b * (k / 32) + s * 8));
            f[b] = _mm256_fnmadd_ps(wmn, _mm256_loadu_ps(s32 + b * (k / 32) + s * 8), f[b]);
        }
        for (int j = 0; j < 4; j++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
            if (five) {
                const __m256i ml = _mm256_set1_epi8((char)(1 << (2 * j))), mh = _mm256_set1_epi8((char)(2 << (2 * j)));
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, ml), ml), bit4));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, mh), mh), bit4));
            }
            const __m256i il = _mm256_set1_epi32(2 * j), ih = _mm256_set1_epi32(2 * j + 1);
            for (int b = 0; b < NB; b++) {
                const int8_t *xb = xq + b * k + s * 256 + 64 * j;
                f[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(kq_dot32(lo, xb)), _mm256_permutevar8x32_ps(p[b], il), f[b]);
                f[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(kq_dot32(hi, xb + 32)), _mm256_permutevar8x32_ps(p[b], ih), f[b]);
            }
        }
    }
}

/* AVX2 Q6_K: 32 weights (two 16-weight sub-blocks: lanes 0-3 and 4-7) a vector. */
TM_INLINE void kq_row_q6(const uint8_t *row, int64_t nsb, const int8_t *xq, int64_t k, const float *xd,
                         const float *s16, const int NB, __m256 f[KQ_ROWS]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03);
    for (int b = 0; b < NB; b++) f[b] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *blk = row + s * 210;
        const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 192));
        const __m256 d = _mm256_set1_ps(kq_f16(blk + 208));
        const __m256 w0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));                   /* 0-7 */
        const __m256 w1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))); /* 8-15 */
        const __m256 t32 = _mm256_set1_ps(32.0f);
        for (int b = 0; b < NB; b++) {
            const float *sb = s16 + b * (k / 16) + s * 16;
            f[b] = _mm256_fnmadd_ps(_mm256_mul_ps(w0, t32), _mm256_loadu_ps(sb), f[b]);
            f[b] = _mm256_fnmadd_ps(_mm256_mul_ps(w1, t32), _mm256_loadu_ps(sb + 8), f[b]);
        }
        for (int n = 0; n < 2; n++) {
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * n));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * n + 32));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * n));
            const __m256 w = n ? w1 : w0;
            for (int m = 0; m < 4; m++) { /* weights 32m .. 32m + 31 of this half */
                const __m256i ql = m & 1 ? ql1 : ql0;
                const __m256i lo = m < 2 ? _mm256_and_si256(ql, low4) : _mm256_and_si256(_mm256_srli_epi16(ql, 4), low4);
                const __m256i hb = _mm256_and_si256(_mm256_srli_epi16(h, 2 * m), two);
                const __m256i codes = _mm256_or_si256(lo, _mm256_slli_epi16(hb, 4));
                const __m256 ws = _mm256_permutevar8x32_ps(
                    w, _mm256_setr_epi32(2 * m, 2 * m, 2 * m, 2 * m, 2 * m + 1, 2 * m + 1, 2 * m + 1, 2 * m + 1));
                const int64_t c = s * 256 + 128 * n + 32 * m;
                for (int b = 0; b < NB; b++)
                    f[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(kq_dot32(codes, xq + b * k + c)),
                                           _mm256_mul_ps(ws, _mm256_set1_ps(xd[b * (k / 32) + c / 32])), f[b]);
            }
        }
    }
}
typedef __m256 kq_acc;
#endif

/* y[b, n - y_col0] (=, or += when accumulate) for rows [n0, n1) of a K-quant matrix, from
 * the input as kq_quantize_rows left it: a tile of VW rows at a time (each row's lane sums
 * reduced together by transpose_sum), up to KQ_ROWS activation rows a pass. */
static void kq_dot_rows(int type, const uint8_t *blocks, int64_t k, const int8_t *xq, const float *xd,
                        const float *s32, const float *s16, int64_t B, int64_t n0, int64_t n1, const float *bias,
                        float *y, int64_t ldy, int accumulate, int64_t y_col0) {
    const int64_t nsb = k / 256, row_bytes = nsb * kq_block_bytes(type);
    for (int64_t r0 = n0; r0 < n1; r0 += VW) {
        const int64_t nr = n1 - r0 < VW ? n1 - r0 : VW;
        for (int64_t b0 = 0; b0 < B; b0 += KQ_ROWS) {
            const int NB = B - b0 < KQ_ROWS ? (int)(B - b0) : KQ_ROWS;
            const int8_t *xb = xq + b0 * k;
            const float *xdb = xd + b0 * (k / 32), *s32b = s32 + b0 * (k / 32), *s16b = s16 + b0 * (k / 16);
            vf acc[KQ_ROWS][VW];
            for (int64_t r = 0; r < VW; r++) {
                kq_acc f[KQ_ROWS];
                if (r < nr) {
                    const uint8_t *row = blocks + (r0 + r) * row_bytes;
#define KQ_ROW(N)                                                                                       \
    if (type == KQ_Q6_K)                                                                                \
        kq_row_q6(row, nsb, xb, k, xdb, s16b, N, f);                                                    \
    else if (type == KQ_Q5_K)                                                                           \
        kq_row_q45(row, nsb, 1, xb, k, xdb, s32b, N, f);                                                \
    else                                                                                                \
        kq_row_q45(row, nsb, 0, xb, k, xdb, s32b, N, f);
                    switch (NB) {
                        case 1: KQ_ROW(1) break;
                        case 2: KQ_ROW(2) break;
                        case 3: KQ_ROW(3) break;
                        case 4: KQ_ROW(4) break;
                        case 5: KQ_ROW(5) break;
                        default: KQ_ROW(KQ_ROWS) break;
                    }
#undef KQ_ROW
                    for (int b = 0; b < NB; b++) memcpy(&acc[b][r], &f[b], sizeof(vf));
                } else {
                    for (int b = 0; b < NB; b++) acc[b][r] = (vf){0};
                }
            }
            for (int b = 0; b < NB; b++) {
                float out[VW];
                vstore(out, transpose_sum(acc[b]));
                float *yb = y + (b0 + b) * ldy - y_col0 + r0;
                for (int64_t r = 0; r < nr; r++) {
                    const float v = out[r] + (bias ? bias[r0 + r] : 0.0f);
                    yb[r] = accumulate ? yb[r] + v : v;
                }
            }
        }
    }
}
#endif
