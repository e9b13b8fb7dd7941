/* Products of integer codes by int8-quantized activations: AVX2's int4 and int8 row tiles
 * (int4_q8_tile, int8_q8_tile), the activation quantizers, and the int8 layers' VNNI
 * packing (int8_vnni_rows, int8g_vnni_rows; AMX tiles in amx_int8.c where the build has
 * them). */
#include "tm_kernels.h"

#ifdef TM_Q8_DOT
/* int4 against int8 activations with integer dot products, on AVX2 (no AVX-512):
 * widening each code to float costs more there than the rest of the step, so
 * the input is quantized per 32 columns (x ~ xq * d, as llama.cpp's q8_0) and
 * vpmaddubsw multiplies 32 unsigned codes by 32 signed activations at once.
 * Per group: s * sum(d_c * (codes . xq)) over its 32-column chunks, plus the
 * zero term on the exact float sums. Activations lose ~1/254 of their range.
 * (AVX-512 builds with VNNI do the same from the nibble packing: int4_q8_block.) */
TM_INLINE void int4_q8_tile(const TmLinear *L, const int8_t *xq, const float *xd, const float *xsum, int64_t ldxs,
                            const int NB, int64_t r0, int64_t nr, float out[TM_MAX_ROWS][VW]) {
    const int64_t kp = L->k * L->repeat, g = L->group, G = kp / g, C = kp / 32;
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    vf acc[TM_MAX_ROWS][VW];
    for (int64_t r = 0; r < VW; r++) {
        __m256 tot[TM_MAX_ROWS];
        float zs[TM_MAX_ROWS];
        for (int b = 0; b < NB; b++) tot[b] = _mm256_setzero_ps(), zs[b] = 0.0f;
        if (r < nr) {
            const int64_t row = r0 + r;
            const uint8_t *codes = (const uint8_t *)L->w + row * (kp / 2);
            const float *s = L->scale + row * G, *z = L->zero + row * G;
            for (int64_t j = 0; j < G; j++) {
                for (int64_t c = j * g; c < (j + 1) * g; c += 32) {
                    const __m128i bytes = _mm_loadu_si128((const __m128i *)(codes + c / 2));
                    const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4),
                                                       _mm_and_si128(bytes, low4)); /* codes c .. c + 31 */
                    for (int b = 0; b < NB; b++) {
                        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * kp + c));
                        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones);
                        tot[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s[j] * xd[b * C + c / 32]),
                                                 tot[b]);
                    }
                }
                for (int b = 0; b < NB; b++) zs[b] += z[j] * xsum[b * ldxs + j];
            }
        }
        for (int b = 0; b < NB; b++) {
            memcpy(&acc[b][r], &tot[b], sizeof(vf));
            acc[b][r][0] += zs[b];
        }
    }
    for (int b = 0; b < NB; b++) vstore(out[b], transpose_sum(acc[b]));
}

/* int8 weights (a scale per row, applied by the caller) against int8 activations:
 * vpmaddubsw wants one unsigned operand, so |w| meets x with w's sign (vpsignb),
 * as llama.cpp's q8_0 kernel does. K % 32 == 0. */
TM_INLINE void int8_q8_tile(const TmLinear *L, const int8_t *xq, const float *xd, const int NB, int64_t r0,
                            int64_t nr, float out[TM_MAX_ROWS][VW]) {
    const int64_t K = L->k, C = K / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    vf acc[TM_MAX_ROWS][VW];
    for (int64_t r = 0; r < VW; r++) {
        __m256 tot[TM_MAX_ROWS];
        for (int b = 0; b < NB; b++) tot[b] = _mm256_setzero_ps();
        if (r < nr) {
            const int8_t *w = (const int8_t *)L->w + (r0 + r) * K;
            for (int64_t c = 0; c < K; c += 32) {
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + c));
                const __m256i aw = _mm256_sign_epi8(wv, wv);
                for (int b = 0; b < NB; b++) {
                    const __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq + b * K + c)), wv);
                    const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), ones);
                    tot[b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(xd[b * C + c / 32]), tot[b]);
                }
            }
        }
        for (int b = 0; b < NB; b++) memcpy(&acc[b][r], &tot[b], sizeof(vf));
    }
    for (int b = 0; b < NB; b++) vstore(out[b], transpose_sum(acc[b]));
}

#endif

#ifdef TM_Q4_PACKED

/* Rows of x as int8 with one scale per 32 columns (round to nearest), and each
 * group's sum of the quantized values (into xsum, [B, kp / group]): the zero
 * term must see the same input as the codes, or a large zero point would turn
 * the input's rounding into a large error. bsum, when given: each 32-column
 * block's integer code sum, [B, kp / 32] (a symmetric int4 layer's offset); hsum, when
 * given: each 16-column half's, [B, kp / 16] (q6k_rows' offset). */
/* The sum of 16 int16 lanes (ones: sixteen 1s) as one int32. */
TM_INLINE int32_t sum_i16x16(__m256i v, __m256i ones) {
    const __m256i s32 = _mm256_madd_epi16(v, ones);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s4);
}

static void quantize_q8_rows(const float *x, int64_t ldx, int64_t B, int64_t kp, int64_t group, int8_t *xq, float *xd,
                             float *xsum, int32_t *bsum, int32_t *hsum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < B; b++)
        for (int64_t c0 = 0; c0 < kp; c0 += 32) {
            /* One block in vectors: vcvtps2dq rounds half to even, as lrintf does. */
            const float *xs = x + b * ldx + c0;
            __m256 v[4], m = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(xs + 8 * i), m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float amax = _mm_cvtss_f32(m4);
            const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
            const __m256 idv = _mm256_set1_ps(id);
            __m256i q[4];
            for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], idv));
            const __m256i q16a = _mm256_packs_epi32(q[0], q[1]), q16b = _mm256_packs_epi32(q[2], q[3]);
            const __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16a, q16b), order);
            _mm256_storeu_si256((__m256i *)(xq + b * kp + c0), q8);
            int32_t qsum;
            if (hsum) { /* each 16-column half's code sum: q16a holds columns 0-15, q16b 16-31 */
                const int32_t lo_sum = sum_i16x16(q16a, ones), hi_sum = sum_i16x16(q16b, ones);
                hsum[b * (kp / 16) + c0 / 16] = lo_sum, hsum[b * (kp / 16) + c0 / 16 + 1] = hi_sum;
                qsum = lo_sum + hi_sum;
            } else {
                qsum = sum_i16x16(_mm256_add_epi16(q16a, q16b), ones);
            }
            xd[b * (kp / 32) + c0 / 32] = d;
            if (bsum) bsum[b * (kp / 32) + c0 / 32] = qsum;
            if (xsum) {
                float *gs = xsum + b * (kp / group) + c0 / group;
                if (c0 % group == 0) *gs = 0.0f;
                *gs += d * (float)qsum;
            }
        }
}
#endif


#ifdef TM_VNNI_DOT
#ifdef TM_I16_DOT
/* Activation codes as the kernels read them: u8 codes widened to 16 bits on AVX2 (a
 * 16-bit activation row of an int8g layer holds its signed value in one plane). */
typedef int16_t tm_act;
#define VNNI_ROWS 8 /* activation rows per pass: one accumulator each */
#define VNNI_G_ROWS 8 /* the grouped kernel's: two accumulators a row (the float one spills cheaply) */
/* Activation rows in a pass of at most MAX with `left` to go: all of them, each count
 * compiled (ROWS_SWITCH), so no padding rows are read. */
#define PASS_ROWS(left, MAX) ((left) >= (MAX) ? (MAX) : (int)(left))
#define ROWS_SWITCH(NB, MAX, CALL)                                                                      \
    switch (NB) {                                                                                       \
        case 1: CALL(1); break;                                                                         \
        case 2: CALL(2); break;                                                                         \
        case 3: CALL(3); break;                                                                         \
        case 4: CALL(4); break;                                                                         \
        case 5: CALL(5); break;                                                                         \
        case 6: CALL(6); break;                                                                         \
        case 7: CALL(7); break;                                                                         \
        default: CALL(MAX); break;                                                                      \
    }
#else
typedef uint8_t tm_act;
#define VNNI_ROWS 12 /* activation rows per pass: 2 tiles x 12 rows = 24 accumulators */
#define VNNI_G_ROWS 8 /* the grouped kernel's: 3 accumulators a row */
/* Activation rows in a pass of at most MAX with `left` to go: the rest rounded up to 1,
 * 2, 4, 8 or MAX (the padding rows are zeros), so few counts are compiled. */
#define PASS_ROWS(left, MAX) ((left) >= (MAX) ? (MAX) : (left) <= 2 ? (int)(left) : (int)(((left) + 3) / 4 * 4))
#define ROWS_SWITCH(NB, MAX, CALL)                                                                      \
    switch (NB) {                                                                                       \
        case 1: CALL(1); break;                                                                         \
        case 2: CALL(2); break;                                                                         \
        case 4: CALL(4); break;                                                                         \
        case 8: CALL(8); break;                                                                         \
        default: CALL(MAX); break;                                                                      \
    }
#endif

/* The float epilogue of one activation row against one tile (VW output rows, from
 * `row`) of an int8 layer, from its int32 sums: hi the 8-bit plane's (or the 16-bit
 * input's high plane's), lo the low plane's when planes is 2. Less 128 x the weight
 * row's code sum (the u8 offset), times the activation row's scale xd and the weight
 * rows' scales, plus the bias; into yb[row ..] (=, or += when accumulate). One
 * function for every unit that computes the sums, so they agree bit for bit. */
TM_INLINE void int8_store_row(const TmLinear *L, int planes, int64_t row, vi hi, vi lo, float xd, float *yb,
                              int accumulate) {
    vi comp;
    memcpy(&comp, L->row_sums + row, sizeof comp);
    const vf ws = vload(L->scale + row), bias = L->bias ? vload(L->bias + row) : (vf){0};
    vf dot = __builtin_convertvector(hi - 128 * comp, vf);
    if (planes == 2) dot = vfma(dot, (vf){0} + 256.0f, __builtin_convertvector(lo, vf));
    const vf v = vfma(dot, ws * xd, bias);
    vstore(yb + row, accumulate ? vload(yb + row) + v : v);
}

/* One scale group's step of an int8g row: f plus the group's sums (h from the
 * group's -128 x code-sum offset; with `two` the 16-bit input's high plane, lo its low
 * one) times the weight rows' group scales dsv (and, at 8 bits, the activations'
 * group scale xdg). */
TM_INLINE vf int8g_add_sum(vf f, vi v, vf scale) { return vfma(__builtin_convertvector(v, vf), scale, f); }
TM_INLINE vf int8g_add_group(vf f, vi h, vi lo, int two, vf dsv, float xdg) {
    return int8g_add_sum(f, two ? (h << 8) + lo : h, two ? dsv : dsv * xdg);
}

/* An int8g row's result: at 16 bits times the activation row's scale xd, plus the
 * bias, into yb[row ..]. */
TM_INLINE void int8g_store_row(const TmLinear *L, int bits, int64_t row, vf acc, float xd, float *yb, int accumulate) {
    const vf bias = L->bias ? vload(L->bias + row) : (vf){0};
    const vf v = bits == 16 ? vfma(acc, (vf){0} + xd, bias) : acc + bias;
    vstore(yb + row, accumulate ? vload(yb + row) + v : v);
}

#ifdef TM_AMX_INT8
#include "amx_int8.c"
#endif

#ifdef TM_I16_DOT
/* What vpdpbusd does for one tile (VW = 8 rows, 4 inputs each in a 32-byte vector of the
 * VNNI packing), in 16-bit products: the codes widened (rows 0-3 and 4-7) and regrouped
 * by pairs of inputs, so that one vpmaddwd of *w01 against inputs 0-1 of an activation
 * row (as a 16-bit pair in every 32-bit lane) and one of *w23 against inputs 2-3 add
 * each row's four products into its own lane. The lanes hold rows in the order
 * 0 1 4 5 2 3 6 7 (the 128-bit halves of the regrouping); i16_rows puts them back.
 * One accumulator a row (two, one per half tile, left gcc spilling 9 of 12 to the
 * stack at 6 rows); at 8 rows a pass it keeps all but two in registers. */
TM_INLINE void i16_dot_step(const int8_t *w, vdot *w01, vdot *w23) {
    const __m256 lo = _mm256_castsi256_ps(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w)));
    const __m256 hi = _mm256_castsi256_ps(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 16))));
    *w01 = _mm256_castps_si256(_mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)));
    *w23 = _mm256_castps_si256(_mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)));
}
TM_INLINE vdot i16_pair(const tm_act *x) {
    int32_t two;
    memcpy(&two, x, sizeof two);
    return _mm256_set1_epi32(two);
}
TM_INLINE vdot i16_madd2(vdot acc, vdot w01, vdot w23, const tm_act *x) {
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(w01, i16_pair(x)));
    __asm__("" : "+x"(acc)); /* each sum in its register, as int4_q8_block's */
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(w23, i16_pair(x + 2)));
    __asm__("" : "+x"(acc));
    return acc;
}
TM_INLINE vdot i16_rows(vdot acc) { return _mm256_permute4x64_epi64(acc, 0xD8); }

/* Tiles [tile, tile + NT) of an int8 layer against NB activation rows of 16-bit codes:
 * acc[t][b] lane i = w_(row i of tile t) . xq_b, as int8_vnni_block's. One tile at a
 * time. */
TM_INLINE void int8_vnni_block(const TmLinear *L, const tm_act *xq, const int NT, const int NB, int64_t tile,
                               vdot acc[2][VNNI_ROWS]) {
    const int64_t K = L->k;
    for (int t = 0; t < NT; t++) {
        const int8_t *w = L->packed + (tile + t) * K * VW;
        vdot a[VNNI_ROWS];
        for (int b = 0; b < NB; b++) a[b] = dot_zero();
        for (int64_t c = 0; c < K; c += 4) {
            vdot w01, w23;
            i16_dot_step(w + c * VW, &w01, &w23);
            for (int b = 0; b < NB; b++) a[b] = i16_madd2(a[b], w01, w23, xq + b * K + c);
        }
        for (int b = 0; b < NB; b++) acc[t][b] = i16_rows(a[b]);
    }
}
#else
/* Tiles [tile, tile + NT) of an int8 layer (VW output rows each, NT 1 or 2) against NB
 * activation rows: acc[t][b] lane i = w_(row i of tile t) . xq_b, offset-128 inputs
 * included. The weights are in the VNNI packing ([n / VW][k / 4][VW][4] bytes,
 * TmLinear.packed), so one vector holds 4 columns of VW rows, each activation row
 * gives 4 bytes broadcast to every lane, and the sums land in output order: no
 * horizontal reduction, unlike the row-major tiles above (measured ~2x faster). */
TM_INLINE void int8_vnni_block(const TmLinear *L, const tm_act *xq, const int NT, const int NB, int64_t tile,
                               vdot acc[2][VNNI_ROWS]) {
    const int64_t K = L->k;
    const int8_t *w0 = L->packed + tile * K * VW, *w1 = w0 + K * VW;
    vdot a0[VNNI_ROWS], a1[VNNI_ROWS]; /* locals, so that gcc keeps them in registers */
    for (int b = 0; b < NB; b++) a0[b] = dot_zero(), a1[b] = dot_zero();
    for (int64_t c = 0; c < K; c += 4) {
        const vdot wa = dot_load(w0 + c * VW);
        const vdot wb = NT > 1 ? dot_load(w1 + c * VW) : dot_zero();
        for (int b = 0; b < NB; b++) {
            int32_t four;
            memcpy(&four, xq + b * K + c, sizeof four);
            const vdot xv = dot_set1(four);
            a0[b] = dot_acc(a0[b], xv, wa);
            if (NT > 1) a1[b] = dot_acc(a1[b], xv, wb);
        }
    }
    for (int b = 0; b < NB; b++) acc[0][b] = a0[b], acc[1][b] = a1[b];
}
#endif

/* y[b, n - y_col0] (=, or += when accumulate) for rows [n0, n1) (whole tiles) of an
 * int8 layer, from activations quantized by quantize_rows (B rows, padded with
 * zero rows to a multiple of 4). 8 bits: one u8 plane (x + 128), the int32 sums less
 * 128 x the row's code sum. 16 bits: x + 32768 as a high and a low u8 plane (rows
 * 0..B-1 high, then the low ones, each padded), each multiplied as above:
 * 256 (hi . w - 128 sum w) + lo . w. Then times the activation row's scale and the
 * weight row's, plus the bias. */
static void int8_vnni_rows(const TmLinear *L, int bits, const tm_act *xq, const float *xd, int64_t B, int64_t n0,
                           int64_t n1, float *y, int64_t ldy, int accumulate, int64_t y_col0) {
    const int64_t K = L->k, Bp = (B + 3) / 4 * 4, planes = bits == 16 ? 2 : 1;
#ifdef TM_AMX_INT8
    const int64_t first = int8_amx_rows(L, bits, xq, xd, B, n0, n1, y, ldy, accumulate, y_col0);
#else
    const int64_t first = 0;
#endif
    vdot acc[2][2][VNNI_ROWS]; /* [plane][tile][row] */
    for (int64_t tile = n0 / VW; tile < n1 / VW;) {
        const int NT = tile + 1 < n1 / VW ? 2 : 1;
        for (int64_t b0 = first; b0 < B; b0 += VNNI_ROWS) {
            const int64_t left = B - b0;
            const int NB = PASS_ROWS(left, VNNI_ROWS);
            for (int64_t p = 0; p < planes; p++) {
                const tm_act *xb = xq + (p * Bp + b0) * K;
#define VNNI_BLOCK_1(N) int8_vnni_block(L, xb, 1, N, tile, acc[p])
#define VNNI_BLOCK_2(N) int8_vnni_block(L, xb, 2, N, tile, acc[p])
                if (NT == 2) {
                    ROWS_SWITCH(NB, VNNI_ROWS, VNNI_BLOCK_2)
                } else {
                    ROWS_SWITCH(NB, VNNI_ROWS, VNNI_BLOCK_1)
                }
#undef VNNI_BLOCK_2
#undef VNNI_BLOCK_1
            }
            for (int t = 0; t < NT; t++)
                for (int64_t b = 0; b < left && b < VNNI_ROWS; b++) {
                    vi hi, lo = {0};
                    memcpy(&hi, &acc[0][t][b], sizeof hi);
                    if (planes == 2) memcpy(&lo, &acc[1][t][b], sizeof lo);
                    int8_store_row(L, (int)planes, (tile + t) * VW, hi, lo, xd[b0 + b], y + (b0 + b) * ldy - y_col0,
                                   accumulate);
                }
        }
        tile += NT;
    }
}

#ifdef TM_I16_DOT

/* int8g_vnni_block from 16-bit codes: at 8 bits (xh, u8 codes widened, a scale per
 * 32 inputs in xdg) each group's sums start at its -128 x code-sum offset, as there; at
 * 16 bits (`two`) xh holds each row's signed 16-bit value in one plane, whose products
 * vpmaddwd takes whole: the group's sum is the high and low planes' (h << 8) + lo of the
 * VNNI path, exactly (|sum| < 2^27 for 32 inputs), at half the work. */
TM_INLINE void int8g_vnni_block(const TmLinear *L, const tm_act *xh, const tm_act *xl, const float *xdg,
                                const int two, const int NB, int64_t tile, vf out[VNNI_G_ROWS]) {
    (void)xl;
    const int64_t K = L->k, G = K / 32;
    const int8_t *w = L->packed + tile * K * VW;
    const int32_t *offsets = L->row_sums + tile * G * VW;
    const float *ds = L->scale + tile * G * VW;
    vf f[VNNI_G_ROWS];
    for (int b = 0; b < NB; b++) f[b] = (vf){0};
    for (int64_t g = 0; g < G; g++) {
        vdot a[VNNI_G_ROWS];
        for (int b = 0; b < NB; b++) a[b] = dot_zero();
        for (int64_t c = g * 32; c < g * 32 + 32; c += 4) {
            vdot w01, w23;
            i16_dot_step(w + c * VW, &w01, &w23);
            for (int b = 0; b < NB; b++) a[b] = i16_madd2(a[b], w01, w23, xh + b * K + c);
        }
        const vf dsv = vload(ds + g * VW);
        const vdot start = dot_load(offsets + g * VW);
        for (int b = 0; b < NB; b++) {
            const vdot sums = i16_rows(a[b]);
            vi v;
            if (two) {
                memcpy(&v, &sums, sizeof v);
                f[b] = int8g_add_sum(f[b], v, dsv);
            } else {
                const vdot h = _mm256_add_epi32(sums, start);
                memcpy(&v, &h, sizeof v);
                f[b] = int8g_add_group(f[b], v, (vi){0}, 0, dsv, xdg[b * G + g]);
            }
        }
    }
    for (int b = 0; b < NB; b++) out[b] = f[b];
}
#else

/* One tile (VW output rows) of an int8g layer (a scale per 32 inputs) in the VNNI
 * packing against NB activation rows: with `two`, quantized per row to 16 bits by
 * quantize_rows (xh the high byte plane, xl the low one); else to 8 bits (xh) with a
 * scale per row and 32 inputs (xdg, [NB, k / 32]) by quantize_group_rows, as
 * llama.cpp's Q8_0 product takes them (w8a8's down projections; for the bundled
 * model's head they cost 0.4 points of next-token agreement, so the head keeps 16
 * bits). Per group of 32 inputs the int32 sums start at the group's -128 x code sum
 * (the offset of the high plane) and become float32 scaled by the group's weight
 * scales (and 8-bit activation scales) before the next group: the per-group scales
 * keep a Q8_0 table exact. out[b] lane i: row i of the tile . x_b, at 16 bits in the
 * row's quantized units (the caller applies the row scale). */
TM_INLINE void int8g_vnni_block(const TmLinear *L, const tm_act *xh, const tm_act *xl, const float *xdg,
                                const int two, const int NB, int64_t tile, vf out[VNNI_G_ROWS]) {
    const int64_t K = L->k, G = K / 32;
    const int8_t *w = L->packed + tile * K * VW;
    const int32_t *offsets = L->row_sums + tile * G * VW;
    const float *ds = L->scale + tile * G * VW;
    vf f[VNNI_G_ROWS];
    for (int b = 0; b < NB; b++) f[b] = (vf){0};
    for (int64_t g = 0; g < G; g++) {
        const vdot start = dot_load(offsets + g * VW);
        vdot h[VNNI_G_ROWS], l[VNNI_G_ROWS];
        for (int b = 0; b < NB; b++) h[b] = start, l[b] = dot_zero();
        for (int64_t c = g * 32; c < g * 32 + 32; c += 4) {
            const vdot wv = dot_load(w + c * VW);
            for (int b = 0; b < NB; b++) {
                int32_t four;
                memcpy(&four, xh + b * K + c, sizeof four);
                h[b] = dot_acc(h[b], dot_set1(four), wv);
                if (two) {
                    memcpy(&four, xl + b * K + c, sizeof four);
                    l[b] = dot_acc(l[b], dot_set1(four), wv);
                }
            }
        }
        const vf dsv = vload(ds + g * VW);
        for (int b = 0; b < NB; b++) {
            vi v, lo = {0};
            memcpy(&v, &h[b], sizeof v);
            if (two) memcpy(&lo, &l[b], sizeof lo);
            f[b] = int8g_add_group(f[b], v, lo, two, dsv, two ? 0.0f : xdg[b * G + g]);
        }
    }
    for (int b = 0; b < NB; b++) out[b] = f[b];
}
#endif

/* int8_vnni_rows for an int8g layer (TmLinear.packed set: scale and row_sums in the
 * grouped packing), from 16-bit activation planes or (bits 8) 8-bit activations with a
 * scale per 32 inputs. One tile at a time, up to VNNI_G_ROWS activation rows a pass. */
static void int8g_vnni_rows(const TmLinear *L, int bits, const tm_act *xq, const float *xd, int64_t B, int64_t n0,
                            int64_t n1, float *y, int64_t ldy, int accumulate, int64_t y_col0) {
    const int64_t K = L->k, Bp = (B + 3) / 4 * 4;
#ifdef TM_AMX_INT8
    const int64_t first = int8g_amx_rows(L, bits, xq, xd, B, n0, n1, y, ldy, accumulate, y_col0);
#else
    const int64_t first = 0;
#endif
    vf acc[VNNI_G_ROWS];
    for (int64_t tile = n0 / VW; tile < n1 / VW; tile++) {
        for (int64_t b0 = first; b0 < B; b0 += VNNI_G_ROWS) {
            const int64_t left = B - b0;
            const int NB = PASS_ROWS(left, VNNI_G_ROWS);
            const tm_act *xh = xq + b0 * K, *xl = xq + (Bp + b0) * K;
            const float *xdg = xd + b0 * (K / 32);
#define G_BLOCK_16(N) int8g_vnni_block(L, xh, xl, xdg, 1, N, tile, acc)
#define G_BLOCK_8(N) int8g_vnni_block(L, xh, xl, xdg, 0, N, tile, acc)
            if (bits == 16) {
                ROWS_SWITCH(NB, VNNI_G_ROWS, G_BLOCK_16)
            } else {
                ROWS_SWITCH(NB, VNNI_G_ROWS, G_BLOCK_8)
            }
#undef G_BLOCK_8
#undef G_BLOCK_16
            for (int64_t b = 0; b < left && b < VNNI_G_ROWS; b++)
                int8g_store_row(L, bits, tile * VW, acc[b], xd[b0 + b], y + (b0 + b) * ldy - y_col0, accumulate);
        }
    }
}

#endif /* TM_VNNI_DOT */

#ifdef TM_VNNI_DOT
static void fill_codes(tm_act *q, int64_t n, int code) {
    for (int64_t i = 0; i < n; i++) q[i] = (tm_act)code;
}

/* Rows of x quantized with one scale per row, round to nearest (as the eager w8a8
 * layer does), for int8_vnni_rows: 8 bits as x / d + 128 (d = amax / 127), or 16 bits
 * as x / d + 32768 (d = amax / 32767) split into a high and a low byte plane; xd[b]
 * the row's scale. Rows past B up to a multiple of 4 are zeros. With one_plane, on
 * AVX2 builds (an int8g layer's 16 bits), the signed value x / d in one plane instead. */

static void quantize_rows(const float *x, int64_t ldx, int64_t B, int64_t K, int bits, int one_plane, tm_act *xq,
                          float *xd) {
    const int64_t Bp = (B + 3) / 4 * 4;
    const float qmax = bits == 16 ? 32767.0f : 127.0f;
    tm_act *hi = xq, *lo = xq + Bp * K;
#ifdef TM_I16_DOT
    one_plane = one_plane && bits == 16;
#else
    one_plane = 0;
#endif
    fill_codes(hi + B * K, (Bp - B) * K, one_plane ? 0 : 128);
    if (bits == 16 && !one_plane) fill_codes(lo + B * K, (Bp - B) * K, 0);
    for (int64_t b = 0; b < B; b++) {
        const float *xs = x + b * ldx;
        float amax = 0.0f;
#pragma omp simd reduction(max : amax)
        for (int64_t c = 0; c < K; c++) {
            const float v = fabsf(xs[c]);
            amax = v > amax ? v : amax;
        }
        const float d = amax > 1e-12f ? amax / qmax : 1e-12f / qmax;
        tm_act *qh = hi + b * K, *ql = lo + b * K;
        if (one_plane) {
#pragma omp simd
            for (int64_t c = 0; c < K; c++) qh[c] = (tm_act)(int)nearbyintf(xs[c] / d);
        } else if (bits == 16) {
#pragma omp simd
            for (int64_t c = 0; c < K; c++) {
                const int v = (int)nearbyintf(xs[c] / d) + 32768;
                qh[c] = (tm_act)(v >> 8);
                ql[c] = (tm_act)(v & 255);
            }
        } else {
#pragma omp simd
            for (int64_t c = 0; c < K; c++) qh[c] = (tm_act)((int)nearbyintf(xs[c] / d) + 128);
        }
        xd[b] = d;
    }
}

/* Rows of x as 8-bit codes x / d + 128 with a scale d = amax / 127 per 32 columns (round
 * to nearest), as llama.cpp quantizes activations for its Q8_0 product, for
 * int8g_vnni_rows: xq [Bp, K] and xd [Bp, K / 32], rows past B up to a multiple of 4
 * holding the zero code and scale 0 (the kernel runs 4 rows where 3 are asked for, and
 * reads theirs). A scale per group keeps one large input from flattening the rest of
 * its row. */
static void quantize_group_rows(const float *x, int64_t ldx, int64_t B, int64_t K, tm_act *xq, float *xd) {
    const int64_t Bp = (B + 3) / 4 * 4;
    fill_codes(xq + B * K, (Bp - B) * K, 128);
    memset(xd + B * (K / 32), 0, (size_t)(Bp - B) * (K / 32) * sizeof(float));
    for (int64_t b = 0; b < B; b++)
        for (int64_t c0 = 0; c0 < K; c0 += 32) {
            const float *xs = x + b * ldx + c0;
            const float amax = amax_32(xs);
            const float d = amax > 1e-30f ? amax / 127.0f : 1.0f;
            tm_act *q = xq + b * K + c0;
#pragma omp simd
            for (int i = 0; i < 32; i++) q[i] = (tm_act)((int)nearbyintf(xs[i] / d) + 128);
            xd[b * (K / 32) + c0 / 32] = amax > 1e-30f ? d : 0.0f;
        }
}

#endif
