/* GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) widened to float32, row by row, exactly as ggml
 * dequantizes them: decode_step.c's linear_rows turns a tile of rows into float32 here and
 * runs its dense float32 tile over it (float32 activations, nothing re-quantized), so a
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
#include <stdint.h>
#include <string.h>

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

static void kq_dequant_q45(const uint8_t *b, float *y, int five) {
    const float d = kq_half(b), dmin = kq_half(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + (five ? 48 : 16);
    for (int j = 0; j < 4; j++) { /* 64 weights: two sub-blocks from the low and high nibbles */
        uint8_t s0, m0, s1, m1;
        kq_scale_min(2 * j, scales, &s0, &m0);
        kq_scale_min(2 * j + 1, scales, &s1, &m1);
        const float d0 = d * s0, n0 = dmin * m0, d1 = d * s1, n1 = dmin * m1;
        const uint8_t *q = qs + 32 * j;
        const uint8_t u0 = (uint8_t)(1u << (2 * j)), u1 = (uint8_t)(2u << (2 * j));
        for (int l = 0; l < 32; l++) {
            const int lo = (q[l] & 0xF) + (five && (qh[l] & u0) ? 16 : 0);
            const int hi = (q[l] >> 4) + (five && (qh[l] & u1) ? 16 : 0);
            y[64 * j + l] = d0 * (float)lo - n0;
            y[64 * j + 32 + l] = d1 * (float)hi - n1;
        }
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
