/* One projection y = L(x): what this build multiplies with (tm_kernels_*), each layer's
 * input prepared once (prepare_input), the dispatch of a tile of output rows to the
 * kernel of its kind (linear_rows), a thread's share (thread_linear), and tm_linear, the
 * entry point outside the fused step. */
#include "tm_kernels.h"

#ifdef TM_VNNI_DOT
#define TM_ACT_BYTES sizeof(tm_act) /* bytes per quantized activation in the scratch */
#else
#define TM_ACT_BYTES 1
#endif

/* Whether this build multiplies int8 weights by int8 activations with integer dot
 * products when a layer has the VNNI packing (a8_rows, a16_rows): 1 with VNNI, 2 with
 * AVX2's 16-bit products (the same sums), 0 not at all. */
int tm_kernels_int8_dot(void) {
#if defined(TM_I16_DOT)
    return 2;
#elif defined(TM_VNNI_DOT)
    return 1;
#else
    return 0;
#endif
}

#ifndef TM_AMX_INT8
/* Builds without AMX-INT8 never use tiles (amx_int8.c has the real one). */
int tm_kernels_amx_init(int want) { return 0 * want; }
#endif

/* Whether this build multiplies int4 weights by int8-quantized activations (tests
 * compare it within activation-quantization error instead of float rounding). */
int tm_kernels_q8_activations(void) {
#ifdef TM_Q8_DOT
    return 1;
#else
    return 0;
#endif
}

/* Whether int4 layers given the nibble packing (pack_int4_q8) multiply their codes by
 * int8 activations at every row count (AVX2, and AVX-512 with VNNI). */
int tm_kernels_q4_int8_dot(void) {
#ifdef TM_Q4_PACKED
    return 1;
#else
    return 0;
#endif
}

/* Per-thread activation scratch for one matmul input. */
typedef struct {
    float *xext; /* [rows, k * repeat]: the input, fed twice for repeat-2 int4; or as bf16 (xh) */
    float *xsum; /* [rows, groups]; a Q4_SYMMETRIC layer's input: int32 block code sums, [rows, k * repeat / 32] */
    const uint16_t *xh; /* [rows, k] bf16 copy of the input for bf16_dot_tile, or NULL */
    float *wtile;       /* [VW, k * repeat]: one int4 row tile, dequantized (int4_dequant_rows) */
    int8_t *xq;         /* [rows, k * repeat]: the input as int8, a scale per 32 columns (int4_q8_tile) */
    float *xd;          /* [rows, k * repeat / 32]: those scales */
    int int_bits;       /* 8 or 16: the input was quantized per row to that for int8_vnni_rows */
} InputScratch;

#ifdef TM_KQ_INT8G
/* y[b, n - y_col0] (=, or += when accumulate) for rows [n0, n1) (whole tiles) of a Q4_K /
 * Q5_K layer with many activation rows: two tiles at a time widened to int8g tiles in the
 * thread's scratch (kquant.c's kq_int8g_tiles), multiplied by int8g_vnni_rows (AMX tiles
 * where the build has them), then each group's dmin * m times the activations' group sums
 * (xsum, prepare_input) taken off. */
static void kq_int8g_rows(const TmLinear *L, const InputScratch *is, int64_t B, int64_t n0, int64_t n1, float *y,
                          int64_t ldy, int accumulate, int64_t y_col0) {
    const int64_t K = L->k, G = K / 32;
    int8_t *packed = (int8_t *)is->wtile; /* 2 VW K codes, 3 x 2 VW G floats, VW 256 bytes: within VW K floats */
    float *scale = (float *)(packed + 2 * VW * K), *zero = scale + 2 * VW * G;
    int32_t *sums = (int32_t *)(zero + 2 * VW * G);
    uint8_t *rowbuf = (uint8_t *)(sums + 2 * VW * G);
    for (int64_t r0 = n0; r0 < n1; r0 += 2 * VW) {
        const int64_t nr = n1 - r0 < 2 * VW ? n1 - r0 : 2 * VW;
        kq_int8g_tiles(L->group, (const uint8_t *)L->w, K, r0, nr, rowbuf, packed, scale, sums, zero);
        TmLinear t = {0};
        t.kind = W_INT8G, t.n = nr, t.k = K, t.scale = scale, t.row_sums = sums, t.packed = packed;
        t.bias = L->bias ? L->bias + r0 : NULL;
        int8g_vnni_rows(&t, 8, (const tm_act *)is->xq, is->xd, B, 0, nr, y, ldy, accumulate, y_col0 - r0);
        for (int64_t b = 0; b < B; b++) {
            const float *xs = is->xsum + b * G;
            float *yb = y + b * ldy - y_col0 + r0;
            for (int64_t r = 0; r < nr; r += VW) {
                const float *zt = zero + (r / VW) * G * VW;
                vf c = {0};
                for (int64_t g = 0; g < G; g++) c = vfma(vload(zt + g * VW), (vf){0} + xs[g], c);
                vstore(yb + r, vload(yb + r) - c);
            }
        }
    }
}
#endif

#define TM_INT4_DEQUANT_ROWS 8 /* from this many activation rows, int4 tiles are dequantized first */

/* Rows [r0, r0 + nr) of an int4 matrix as float32 (code * scale + zero), into
 * w ([nr, k * repeat]). With many activation rows, unpacking a tile once and
 * running the dense float32 tile over it beats unpacking inside the dot
 * products: those are load-bound (two activation loads per two FMAs). */
static void int4_dequant_rows(const TmLinear *L, int64_t r0, int64_t nr, float *w) {
    const int64_t kp = L->k * L->repeat, g = L->group, G = kp / g;
    for (int64_t r = 0; r < nr; r++) {
        const uint8_t *codes = (const uint8_t *)L->w + (r0 + r) * (kp / 2);
        const float *s = L->scale + (r0 + r) * G, *z = L->zero + (r0 + r) * G;
        float *wr = w + r * kp;
        for (int64_t j = 0; j < G; j++) {
            const vf sv = (vf){0} + s[j], zv = (vf){0} + z[j];
            for (int64_t c = j * g; c < (j + 1) * g; c += 32)
                for (int h = 0; h < 16 / VW; h++) {
                    vb bytes;
                    memcpy(&bytes, codes + c / 2 + h * VW, sizeof bytes);
                    vf lo, hi;
                    int4_codes(bytes, &lo, &hi);
                    vstore(wr + c + h * VW, lo * sv + zv);
                    vstore(wr + c + 16 + h * VW, hi * sv + zv);
                }
        }
    }
}

/* Whether an int4 layer's products run int4_q8_rows (AVX2 and AVX-512 VNNI builds, the
 * nibble packing given) rather than int4_q8_tile, int4_tile or dequantized float32 tiles. */
TM_INLINE int int4_q8_packed(const TmLinear *L) {
#ifdef TM_Q4_PACKED
    return L->kind == W_INT4 && L->packed &&
           ((L->q4_form & Q4_F16) || (L->packed_scale && (L->packed_zero || (L->q4_form & (Q4_SYMMETRIC | Q4_KSCALES))))) &&
           L->n % VW == 0;
#else
    (void)L;
    return 0;
#endif
}

/* Whether a K-quant layer runs q6k_rows: Q6_K given its tiles (cpu_kernels.pack_q6_tiles). */
TM_INLINE int q6_tiles(const TmLinear *L) {
#ifdef TM_Q6_TILES
    return L->kind == W_KQ && L->group == KQ_Q6_K && L->packed && L->packed_scale && L->n % VW == 0;
#else
    (void)L;
    return 0;
#endif
}

int tm_kernels_q6_tiles(void) {
#ifdef TM_Q6_TILES
    return 1;
#else
    return 0;
#endif
}

#define TM_KQ_DOT_ROWS 32 /* below this many activation rows, K-quant layers take kq_dot_rows */

/* Whether a K-quant layer's products run on int8 activations (kquant.c's kq_dot_rows)
 * rather than on tiles widened to float32: with few activation rows the widening costs
 * more than the products it feeds; with many it is shared by them all and the float32
 * tile's products are faster. */
TM_INLINE int kq_int8_dot(const TmLinear *L, int64_t B) {
#ifdef TM_KQ_DOT
    return L->kind == W_KQ && B < TM_KQ_DOT_ROWS && !q6_tiles(L);
#else
    (void)L, (void)B;
    return 0;
#endif
}

/* Whether Q4_K / Q5_K layers multiply many activation rows on int8g tiles (kq_int8g_rows)
 * rather than on tiles widened to float32. */
int tm_kernels_kquant_int8_tiles(void) {
#ifdef TM_KQ_INT8G
    return 1;
#else
    return 0;
#endif
}

/* Whether a K-quant layer's many-row products run on int8g tiles (kq_int8g_rows): Q4_K and
 * Q5_K (a scale per 32 weights) in whole tiles, where the build has integer products. */
TM_INLINE int kq_int8g(const TmLinear *L, int64_t B) {
#ifdef TM_KQ_INT8G
    return L->kind == W_KQ && B >= TM_KQ_DOT_ROWS && L->group != KQ_Q6_K && L->n % VW == 0;
#else
    (void)L, (void)B;
    return 0;
#endif
}

/* Below how many activation rows K-quant layers multiply their codes by int8 activations
 * (kq_dot_rows; tests compare those within the activations' rounding); 0: never. */
int tm_kernels_kquant_int8_rows(void) {
#ifdef TM_KQ_DOT
    return TM_KQ_DOT_ROWS;
#else
    return 0;
#endif
}

/* What a matmul over input x reads: x itself, or for int4 the per-group sums
 * (and for repeat 2 the doubled input) in this thread's scratch; for bf16
 * weights and several rows, also a bf16 copy of x (is->xh). */
static const float *prepare_input(const TmLinear *L, const float *x, int64_t ldx, int64_t B, InputScratch *is,
                                  int64_t *ldx_out) {
    *ldx_out = ldx;
    is->xh = NULL;
    is->int_bits = 0;
#ifdef TM_VNNI_DOT
    if ((L->kind == W_INT8 || L->kind == W_INT8G) && L->packed) {
        const int a8 = L->a8_rows > 0 && B >= L->a8_rows;
        const int bits = a8 ? 8 : L->a16_rows > 0 && B >= L->a16_rows ? 16 : 0;
        if (bits == 8 && L->kind == W_INT8G) { /* 8 bits with a scale per 32 inputs */
            quantize_group_rows(x, ldx, B, L->k, (tm_act *)is->xq, is->xd);
            is->int_bits = bits;
            return x;
        }
        if (bits) {
            quantize_rows(x, ldx, B, L->k, bits, L->kind == W_INT8G, (tm_act *)is->xq, is->xd);
            is->int_bits = bits;
            return x;
        }
    }
#endif
#ifdef TM_BF16_DOT
    if (L->kind == W_BF16 && B > 1 && L->k % 32 == 0) {
        uint16_t *xh = (uint16_t *)is->xext;
        for (int64_t b = 0; b < B; b++)
#pragma omp simd
            for (int64_t c = 0; c < L->k; c++) xh[b * L->k + c] = f32_to_bf16(x[b * ldx + c]);
        is->xh = xh;
    }
#endif
#ifdef TM_Q6_TILES
    if (q6_tiles(L)) { /* q6k_rows' input: codes a scale per 32 inputs, each 16 inputs' code sum */
        quantize_q8_rows(x, ldx, B, L->k, 32, is->xq, is->xd, NULL, NULL, (int32_t *)is->xsum);
        return x;
    }
#endif
#ifdef TM_KQ_INT8G
    if (kq_int8g(L, B)) { /* kq_int8g_rows' input: 8-bit codes a scale per 32 inputs, and their group sums */
        const int64_t G = L->k / 32;
        quantize_group_rows(x, ldx, B, L->k, (tm_act *)is->xq, is->xd);
        for (int64_t b = 0; b < B; b++)
            for (int64_t g = 0; g < G; g++) {
                const tm_act *q = (const tm_act *)is->xq + b * L->k + g * 32;
                int sum = 0;
#pragma omp simd reduction(+ : sum)
                for (int i = 0; i < 32; i++) sum += (int)q[i] - 128;
                is->xsum[b * G + g] = is->xd[b * G + g] * (float)sum;
            }
        return x;
    }
#endif
#ifdef TM_KQ_DOT
    if (kq_int8_dot(L, B)) { /* kq_dot_rows' input: codes, scales and sums in the scratch */
        kq_quantize_rows(x, ldx, B, L->k, is->xq, is->xd, is->xsum, is->xsum + B * (L->k / 32));
        return x;
    }
#endif
#ifdef TM_Q8_DOT
    if (L->kind == W_INT8 && B < TM_INT4_DEQUANT_ROWS && L->k % 32 == 0) { /* int8_q8_tile's input */
        quantize_q8_rows(x, ldx, B, L->k, 32, is->xq, is->xd, NULL, NULL, NULL);
        return x;
    }
#endif
    if (L->kind != W_INT4) return x;
    const int64_t kp = L->k * L->repeat, g = L->group, G = kp / g;
    if (L->repeat != 1) {
        for (int64_t b = 0; b < B; b++)
            for (int64_t r = 0; r < L->repeat; r++) memcpy(is->xext + b * kp + r * L->k, x + b * ldx, L->k * 4);
        x = is->xext;
        *ldx_out = kp;
    }
    if (B >= TM_INT4_DEQUANT_ROWS && !int4_q8_packed(L)) return x; /* dequantized tiles: no group sums */
#ifdef TM_Q4_PACKED
    if (int4_q8_packed(L) && (L->q4_form & Q4_SYMMETRIC)) { /* block code sums where group sums would go */
        quantize_q8_rows(x, *ldx_out, B, kp, g, is->xq, is->xd, NULL, (int32_t *)is->xsum, NULL);
        return x;
    }
#endif
#ifndef TM_Q8_DOT
#ifdef TM_Q4_VNNI
    if (int4_q8_packed(L)) {
        quantize_q8_rows(x, *ldx_out, B, kp, g, is->xq, is->xd, is->xsum, NULL, NULL);
        return x;
    }
#endif
    for (int64_t b = 0; b < B; b++)
        for (int64_t j = 0; j < G; j++) {
            const float *xb = x + b * *ldx_out + j * g;
            float t = 0.0f;
#pragma omp simd reduction(+ : t)
            for (int64_t c = 0; c < g; c++) t += xb[c];
            is->xsum[b * G + j] = t;
        }
#else
    quantize_q8_rows(x, *ldx_out, B, kp, g, is->xq, is->xd, is->xsum, NULL, NULL);
#endif
    return x;
}

/* A compile-time weight kind and activation row count keep the loops branch-free
 * and the accumulators in registers. */
#define DENSE_CASE(LIN, KIND, R0, N) \
    case N: dense_tile(LIN, KIND, xb, ldx, N, R0, nr, out); break;
#define DENSE_KIND_CASES(LIN, KIND, R0)                                                                     \
    switch (NB) {                                                                                           \
        DENSE_CASE(LIN, KIND, R0, 1) DENSE_CASE(LIN, KIND, R0, 2) DENSE_CASE(LIN, KIND, R0, 3)              \
        DENSE_CASE(LIN, KIND, R0, 4) DENSE_CASE(LIN, KIND, R0, 5)                                           \
        default: dense_tile(LIN, KIND, xb, ldx, 6, R0, nr, out); break;                                     \
    }
#define DENSE_CASES(KIND) DENSE_KIND_CASES(L, KIND, r0)
#define DENSE_TILE_CASES(LIN, R0) DENSE_KIND_CASES(LIN, W_F32, R0)

#define BF16_DOT_CASE(N) \
    case N: bf16_dot_tile(L, xhb, N, r0, nr, out); break;
#define BF16_DOT_CASES                                                                                      \
    switch (NB) {                                                                                           \
        BF16_DOT_CASE(1) BF16_DOT_CASE(2) BF16_DOT_CASE(3) BF16_DOT_CASE(4) BF16_DOT_CASE(5)                \
        default: bf16_dot_tile(L, xhb, 6, r0, nr, out); break;                                              \
    }

#ifdef TM_Q8_DOT /* the input as int8 rows (prepare_input quantized it) */
#define INT4_CALL(N) \
    int4_q8_tile(L, is->xq + b0 * L->k * L->repeat, is->xd + b0 * (L->k * L->repeat / 32), xs, G, N, r0, nr, out)
#else
#define INT4_CALL(N) int4_tile(L, xb, ldx, xs, G, N, r0, nr, out)
#endif
#define INT4_CASE(N) \
    case N: INT4_CALL(N); break;
#define INT4_CASES                                                                                          \
    switch (NB) {                                                                                           \
        INT4_CASE(1) INT4_CASE(2) INT4_CASE(3) INT4_CASE(4) INT4_CASE(5)                                    \
        default: INT4_CALL(6); break;                                                                       \
    }

/* y[b, n - y_col0] (=, or += when accumulate) for n in [n0, n1), from a prepared input.
 * Row tiles outside, activation rows inside: a tile's weights (VW rows) are read
 * from memory once and reused from cache by every group of activation rows. */
static void linear_rows(const TmLinear *L, const float *x, int64_t ldx, const InputScratch *is, int64_t B,
                        int64_t n0, int64_t n1, float *y, int64_t ldy, int accumulate, int64_t y_col0) {
    const int64_t G = L->kind == W_INT4 ? L->k * L->repeat / L->group : 0;
    const float *xsum = is->xsum;
    const uint16_t *xh = is->xh;
    /* K-quant tiles not taken by kq_dot_rows are widened first (kquant.c): float32 activations */
    const int dequant = (L->kind == W_INT4 && B >= TM_INT4_DEQUANT_ROWS) || L->kind == W_KQ;
    float out[TM_MAX_ROWS][VW];
#ifdef TM_Q4_PACKED
    if (int4_q8_packed(L)) { /* the input quantized by prepare_input (quantize_q8_rows) */
        int4_q8_rows(L, is->xq, is->xd, xsum, B, n0, n1, y, ldy, accumulate, y_col0);
        return;
    }
#endif
#ifdef TM_Q6_TILES
    if (q6_tiles(L)) { /* the input quantized by prepare_input (quantize_q8_rows with 16-input sums) */
        q6k_rows(L, is->xq, is->xd, (const int32_t *)xsum, B, n0, n1, y, ldy, accumulate, y_col0);
        return;
    }
#endif
#ifdef TM_KQ_INT8G
    if (kq_int8g(L, B)) { /* the input quantized by prepare_input (quantize_group_rows) */
        kq_int8g_rows(L, is, B, n0, n1, y, ldy, accumulate, y_col0);
        return;
    }
#endif
#ifdef TM_KQ_DOT
    if (kq_int8_dot(L, B)) { /* the input quantized by prepare_input (kq_quantize_rows) */
        kq_dot_rows(L->group, (const uint8_t *)L->w, L->k, is->xq, is->xd, xsum, xsum + B * (L->k / 32), B, n0, n1,
                    L->bias, y, ldy, accumulate, y_col0);
        return;
    }
#endif
#ifdef TM_VNNI_DOT
    if (is->int_bits) {
        if (L->kind == W_INT8G)
            int8g_vnni_rows(L, is->int_bits, (const tm_act *)is->xq, is->xd, B, n0, n1, y, ldy, accumulate, y_col0);
        else
            int8_vnni_rows(L, is->int_bits, (const tm_act *)is->xq, is->xd, B, n0, n1, y, ldy, accumulate, y_col0);
        return;
    }
#endif
    for (int64_t r0 = n0; r0 < n1; r0 += VW) {
        const int64_t nr = n1 - r0 < VW ? n1 - r0 : VW;
        TmLinear tile = {0}; /* the dequantized int4 tile as a float32 matrix of nr rows */
        if (dequant) {
            if (L->kind == W_KQ)
                kq_dequant_rows(L->group, (const uint8_t *)L->w, L->k, r0, nr, is->wtile);
            else
                int4_dequant_rows(L, r0, nr, is->wtile);
            tile.kind = W_F32, tile.n = nr, tile.k = L->k * L->repeat, tile.w = is->wtile;
        }
        for (int64_t b0 = 0; b0 < B; b0 += TM_MAX_ROWS) {
            const int NB = B - b0 < TM_MAX_ROWS ? (int)(B - b0) : TM_MAX_ROWS;
            const float *xb = x + b0 * ldx;
            if (dequant) {
                DENSE_TILE_CASES(&tile, 0)
            } else if (L->kind == W_INT4) {
                const float *xs = xsum + b0 * G;
                INT4_CASES
            } else if (L->kind == W_F32) {
                DENSE_CASES(W_F32)
            } else if (L->kind == W_BF16) {
#ifdef TM_BF16_DOT
                if (xh) {
                    const uint16_t *xhb = xh + b0 * L->k;
                    BF16_DOT_CASES
                } else
#endif
                {
                    DENSE_CASES(W_BF16)
                }
            } else if (L->kind == W_INT8G) {
                DENSE_CASES(W_INT8G)
            } else {
#ifdef TM_Q8_DOT
                if (B < TM_INT4_DEQUANT_ROWS && L->k % 32 == 0) {
                    int8_q8_tile(L, is->xq + b0 * L->k, is->xd + b0 * (L->k / 32), NB, r0, nr, out);
                } else
#endif
                {
                    DENSE_CASES(W_INT8)
                }
            }
            for (int b = 0; b < NB; b++) {
                float *yb = y + (b0 + b) * ldy - y_col0 + r0;
                for (int64_t r = 0; r < nr; r++) {
                    float v = out[b][r];
                    if (L->kind == W_INT8) v *= L->scale[r0 + r];
                    if (L->bias) v += L->bias[r0 + r];
                    if (accumulate)
                        yb[r] += v;
                    else
                        yb[r] = v;
                }
            }
        }
    }
}


/* This thread's part of y = L(in) (or y += L(in)): the tiles of L's rows it claims from
 * *next, a counter at 0 that every thread of the call shares. */
static void thread_linear(const TmLinear *L, const float *in, int64_t ld_in, int64_t B, InputScratch *is,
                          int64_t *next, int T, float *y, int64_t ldy, int accumulate) {
    int64_t ldx, n0, n1;
    const float *x = prepare_input(L, in, ld_in, B, is, &ldx);
    while (claim_rows(next, L->n, T, &n0, &n1)) linear_rows(L, x, ldx, is, B, n0, n1, y, ldy, accumulate, 0);
}


/* This thread's scratch for tm_linear, at least `floats` long, kept from call to call: a
 * prefill's projections each want megabytes, and a buffer freed after every call came
 * back from the system page by page on the next (the page faults took about as long as
 * the arithmetic of a 512-row int8 projection). It grows to the largest call the thread
 * has served and is freed when the thread ends (a thread-specific key's destructor), so
 * engines that come and go with their threads leave nothing behind. */
typedef struct {
    float *buf;
    size_t cap;
} LinearScratch;

static pthread_key_t linear_scratch_key;
static pthread_once_t linear_scratch_once = PTHREAD_ONCE_INIT;

static void linear_scratch_free(void *p) {
    LinearScratch *s = (LinearScratch *)p;
    free(s->buf);
    free(s);
}

static void linear_scratch_key_init(void) { pthread_key_create(&linear_scratch_key, linear_scratch_free); }

static float *linear_scratch(size_t floats) {
    pthread_once(&linear_scratch_once, linear_scratch_key_init);
    LinearScratch *s = (LinearScratch *)pthread_getspecific(linear_scratch_key);
    if (!s) {
        s = (LinearScratch *)calloc(1, sizeof *s);
        if (!s || pthread_setspecific(linear_scratch_key, s)) {
            free(s);
            return NULL;
        }
    }
    if (floats > s->cap) {
        free(s->buf);
        s->buf = (float *)aligned_alloc(64, (floats * 4 + 63) / 64 * 64);
        s->cap = s->buf ? floats : 0;
    }
    return s->buf;
}

/* One projection y = L(x) outside the fused step: the eager model's int4 layers
 * (and tests) use it, so that int4 weights are read in the project's own nibble
 * order on every CPU instead of a library's instruction-set-dependent packing.
 * x: [B, k] float32 rows ldx apart; y: [B, n] float32 rows ldy apart. Threads
 * claim the output rows in whole tiles, as in the step. Returns 0, 1 for a
 * layer description the kernel cannot take (nothing written), 2 when scratch
 * memory could not be allocated. */
int tm_linear(const TmLinear *L, const float *x, int64_t ldx, int64_t B, float *y, int64_t ldy, int num_threads) {
    if (B < 0 || L->n <= 0 || L->k <= 0 || ldx < L->k || ldy < L->n) return 1;
    if (L->kind == W_INT4 && (L->group <= 0 || L->group % 32 || L->repeat < 1 || (L->k * L->repeat) % L->group))
        return 1;
    if (L->kind != W_INT4 && L->k % VW) return 1;
    if (L->kind == W_KQ && (L->k % 256 || !kq_block_bytes(L->group) || L->repeat != 1)) return 1;
    if (L->kind == W_INT8G && L->k % 32) return 1;
    /* the row-major weights may be gone where the layer holds only the packing its kernel reads */
    if (!L->w && !((L->kind == W_INT8 || L->kind == W_INT8G) && L->packed && tm_kernels_int8_dot() &&
                   L->a16_rows == 1) && !int4_q8_packed(L) && !q6_tiles(L))
        return 1;
    if (B == 0) return 0;
    if (num_threads < 1) num_threads = 1;
    /* int4's group sums, or a symmetric layer's block code sums (kp / 32 a row: room for either),
     * or a K-quant input's 32- and 16-input code sums (kq_quantize_rows) */
    const int64_t kp = L->k * L->repeat, G = L->kind == W_INT4 ? kp / 32 : L->kind == W_KQ ? 3 * kp / 32 : 0;
    int failed = 0;
    int64_t next = 0; /* the threads' claim counter (claim_chunk) */
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const int T = omp_get_num_threads();
        const size_t q8 = ((size_t)2 * (B + 3) * kp * TM_ACT_BYTES + 3) / 4; /* the quantized input: two planes */
        const size_t floats = (size_t)B * kp + (size_t)B * G + (size_t)VW * kp + q8 + (size_t)(B + 3) * kp / 32;
        float *buf = linear_scratch(floats);
        if (buf) {
            float *q8_at = buf + B * kp + B * G + VW * kp;
            InputScratch is = {buf, buf + B * kp, NULL, buf + B * kp + B * G, (int8_t *)q8_at, q8_at + q8};
            thread_linear(L, x, ldx, B, &is, &next, T, y, ldy, 0);
        }
        failed = buf == NULL;
    }
    return failed ? 2 : 0;
}
