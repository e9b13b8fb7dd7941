/* The small per-token operations of a Llama layer, float32 (CPU, OpenMP).
 *
 * Two users: the fused decode step (step.c) calls the one-row
 * routines inline, and the eager model (model/models/llama.py) calls the row-parallel
 * entry points on prefill and mixed steps. There, torch ran each of these as
 * several ATen ops over the whole [tokens, features] tensor, each a pass
 * through memory with a fresh output: RMSNorm as pow, mean, add, rsqrt and two
 * multiplications; rotary as two multiplications, a roll (itself a cat) and an
 * add; SiLU(gate) * up as two. At 512 tokens on a small CPU they took a
 * noticeable share of a mixed step whose matmuls run near the FMA peak
 * (docs/performance.md).
 * Here each is one pass, row by row, the rows split over the threads.
 *
 * Rows are float32 or bfloat16 (the model's dtype; bf16 passed as raw uint16
 * bits). Numerics follow the torch ops they replace, rounding to bf16 where
 * each of those ops rounds its output: the rotary entry point computes
 * torch's formula operation by operation with contraction into FMAs switched
 * off, so it is bit-identical to model/models/llama.py's `_rotate` in both dtypes.
 * RMSNorm sums its squares in another order than torch's mean (a few float32
 * ulp apart), and SiLU uses exp_nonpos (within ~2 ulp of expf): the same
 * arithmetic the fused decode step has always used; in bf16 that rarely moves
 * a rounded result, by one bf16 step (two for RMSNorm, whose weight multiply
 * rounds again). Part of the library's one unit (kernels.c).
 */
#include "tm_kernels.h"

/* Below this many floats a call runs on one thread: waking the second costs more. */
#define EW_SERIAL_FLOATS (1 << 15)

/* ------------------------------------------------------------------ one row */

/* out = w * x / rms(x), float32. */
TM_INLINE void rms_norm(const float *x, const float *w, int64_t n, float eps, float *out) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

/* Rotate-half rotary embedding of one head, in place (the fused decode step's). Each
 * product and the sum are rounded on their own, as in rotate_f32 below (the eager model's):
 * a decode row then gets the same keys in either path, so a request's tokens do not depend
 * on which path its steps took. */
__attribute__((optimize("fp-contract=off"))) static void rope_head(float *x, const float *cos, const float *sin,
                                                                    int64_t D) {
    const int64_t h = D / 2;
#pragma omp simd
    for (int64_t i = 0; i < h; i++) {
        const float lo = x[i], hi = x[i + h];
        x[i] = lo * cos[i] - hi * sin[i];
        x[i + h] = hi * cos[i + h] + lo * sin[i + h];
    }
}

TM_INLINE void store_row(void *cache, int bf16, size_t offset, const float *src, int64_t D) {
    if (bf16) {
        uint16_t *dst = (uint16_t *)cache + offset;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) dst[d] = f32_to_bf16(src[d]);
    } else {
        memcpy((float *)cache + offset, src, D * sizeof(float));
    }
}

/* g * sigmoid(g), vectorizable: e = exp(-|g|) <= 1 keeps exp_nonpos in range; sigmoid(g) is
 * 1 / (1 + e) for g >= 0 and e / (1 + e) below, one division either way. */
TM_INLINE float silu(float g) {
    const float e = exp_nonpos(g < 0.0f ? g : -g);
    return g * ((g >= 0.0f ? 1.0f : e) / (1.0f + e));
}

/* silu(g) * u, float32. */
TM_INLINE void silu_mul(const float *g, const float *u, float *out, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = silu(g[i]) * u[i];
}

/* gelu with the tanh approximation (torch's gelu(approximate="tanh"), Gemma's GeGLU):
 * 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), with tanh(y) = sign(y) (1 - e) / (1 + e)
 * for e = exp(-2 |y|) <= 1 (exp_nonpos in range, no cancellation where it matters: for
 * small |y| the result is dominated by the 1 it is added to). */
TM_INLINE float gelu_tanh(float g) {
    const float y = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    const float e = exp_nonpos(y < 0.0f ? 2.0f * y : -2.0f * y);
    const float t = (1.0f - e) / (1.0f + e);
    return 0.5f * g * (1.0f + (y < 0.0f ? -t : t));
}

/* gelu_tanh(g) * u, float32. */
TM_INLINE void gelu_tanh_mul(const float *g, const float *u, float *out, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) out[i] = gelu_tanh(g[i]) * u[i];
}

/* ------------------------------------------------------------------ row-parallel entry points */

TM_INLINE int ew_threads(int num_threads, int64_t rows, int64_t floats_per_row) {
    return rows * floats_per_row < EW_SERIAL_FLOATS ? 1 : threads_for(num_threads, rows);
}

/* torch's RMSNorm on bf16: the norm in float32, rounded to bf16, times the bf16 weight, rounded. */
TM_INLINE void rms_norm_bf16(const uint16_t *x, const uint16_t *w, int64_t n, float eps, uint16_t *out) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; i++) ss += bf16_to_f32(x[i]) * bf16_to_f32(x[i]);
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        out[i] = f32_to_bf16(bf16_to_f32(w[i]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(x[i]) * r)));
}

/* out[r] = rms_norm(x[r]) for `rows` rows of n floats (row strides ldx, ldo, in elements);
 * bf16: x, w and out are bf16. */
int tm_rms_norm_rows(const void *x, int64_t ldx, const void *w, int64_t rows, int64_t n, float eps, void *out,
                     int64_t ldo, int bf16, int num_threads) {
    if (rows < 0 || n < 1 || ldx < n || ldo < n) return 1;
#pragma omp parallel for num_threads(ew_threads(num_threads, rows, n)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (bf16)
            rms_norm_bf16((const uint16_t *)x + r * ldx, (const uint16_t *)w, n, eps, (uint16_t *)out + r * ldo);
        else
            rms_norm((const float *)x + r * ldx, (const float *)w, n, eps, (float *)out + r * ldo);
    }
    return 0;
}

/* torch's F.silu(gate) * up on bf16: silu in float32, rounded; the product, rounded. */
TM_INLINE void silu_mul_bf16(const uint16_t *g, const uint16_t *u, uint16_t *out, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        out[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(silu(bf16_to_f32(g[i])))) * bf16_to_f32(u[i]));
}

/* out[r, :inter] = silu(gu[r, :inter]) * gu[r, inter : 2 * inter]: gate and up side by side,
 * as the fused gate/up projection leaves them. */
int tm_silu_mul_rows(const void *gu, int64_t ldg, int64_t rows, int64_t inter, void *out, int64_t ldo, int bf16,
                     int num_threads) {
    if (rows < 0 || inter < 1 || ldg < 2 * inter || ldo < inter) return 1;
#pragma omp parallel for num_threads(ew_threads(num_threads, rows, 3 * inter)) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        if (bf16) {
            const uint16_t *row = (const uint16_t *)gu + r * ldg;
            silu_mul_bf16(row, row + inter, (uint16_t *)out + r * ldo, inter);
        } else {
            const float *row = (const float *)gu + r * ldg;
            silu_mul(row, row + inter, (float *)out + r * ldo, inter);
        }
    }
    return 0;
}

/* One head of D values, in place: x * cos + roll(x, D/2) * ssin, where ssin is the sin table
 * with its first half negated (model/models/llama.py's `_rotate`). Each product and the sum are
 * rounded as torch's three ops round them: float32, each on its own (no FMA contraction
 * here); bf16, each product (exact in float32) and the float32 sum rounded to bf16. Positions
 * i and i + D/2 only read each other, so the pair is read before either is written. */
#define TM_ROTATE(NAME, T, MUL, ROUND)                                                                      \
    __attribute__((optimize("fp-contract=off"))) static void NAME(T *p, int64_t D, const T *cos,          \
                                                                  const T *ssin) {                         \
        const int64_t h = D / 2;                                                                            \
        _Pragma("omp simd") for (int64_t i = 0; i < h; i++) {                                               \
            const T lo = p[i], hi = p[i + h];                                                               \
            p[i] = ROUND(MUL(lo, cos[i]) + MUL(hi, ssin[i]));                                               \
            p[i + h] = ROUND(MUL(hi, cos[i + h]) + MUL(lo, ssin[i + h]));                                   \
        }                                                                                                   \
    }

TM_INLINE float f32_product(float a, float b) { return a * b; }
TM_INLINE float f32_as_is(float a) { return a; }
TM_INLINE float bf16_product(uint16_t a, uint16_t b) {
    return bf16_to_f32(f32_to_bf16(bf16_to_f32(a) * bf16_to_f32(b)));
}
TM_ROTATE(rotate_f32, float, f32_product, f32_as_is)
TM_ROTATE(rotate_bf16, uint16_t, bf16_product, f32_to_bf16)

/* Rotary embedding in place over `rows` token rows (stride ldx elements), each holding `heads`
 * heads of D values from its start; cos and ssin: [rows, D], contiguous, this step's tables,
 * in the rows' dtype. */
int tm_rope_rows(void *x, int64_t ldx, int64_t rows, int64_t heads, int64_t D, const void *cos, const void *ssin,
                 int bf16, int num_threads) {
    if (rows < 0 || heads < 1 || D < 2 || D % 2 || D > 512 || ldx < heads * D) return 1;
#pragma omp parallel for num_threads(ew_threads(num_threads, rows, heads * D)) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t hd = 0; hd < heads; hd++) {
            if (bf16)
                rotate_bf16((uint16_t *)x + r * ldx + hd * D, D, (const uint16_t *)cos + r * D,
                            (const uint16_t *)ssin + r * D);
            else
                rotate_f32((float *)x + r * ldx + hd * D, D, (const float *)cos + r * D,
                           (const float *)ssin + r * D);
        }
    return 0;
}

/* The new keys and values of `rows` tokens into one layer's pools ([kv_heads, num_slots, D]
 * each; slot s of head h at (h * num_slots + s) * D): row r's kv head h comes from
 * k + r * ldk + h * D (and likewise v). src_esize: bytes an element of k and v (4 or 2);
 * esize: of the pools (4 or 2). Rows are copied, or rounded from float32 to a bf16 pool
 * (to nearest even, as torch converts). 1 when a slot is out of range (checked before
 * anything is written) or the pair of sizes is not one of those. */
int tm_store_kv_rows(const void *k, int64_t ldk, const void *v, int64_t ldv, int64_t rows, int64_t kv_heads,
                     int64_t D, const int64_t *slots, void *k_cache, void *v_cache, int64_t num_slots,
                     int64_t src_esize, int64_t esize, int num_threads) {
    if (rows < 0 || kv_heads < 1 || D < 1 || ldk < kv_heads * D || ldv < kv_heads * D || (esize != 2 && esize != 4) ||
        !(src_esize == esize || (src_esize == 4 && esize == 2)))
        return 1;
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) return 1;
    const size_t row_bytes = (size_t)D * esize;
    const int narrow = src_esize != esize;
#pragma omp parallel for num_threads(ew_threads(num_threads, rows, 2 * kv_heads * D)) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < kv_heads; h++) {
            const size_t dst = ((size_t)h * num_slots + slots[r]) * row_bytes;
            const size_t src = ((size_t)r * ldk + h * D) * src_esize, src_v = ((size_t)r * ldv + h * D) * src_esize;
            if (narrow) {
                store_row(k_cache, 1, dst / 2, (const float *)((const char *)k + src), D);
                store_row(v_cache, 1, dst / 2, (const float *)((const char *)v + src_v), D);
            } else {
                memcpy((char *)k_cache + dst, (const char *)k + src, row_bytes);
                memcpy((char *)v_cache + dst, (const char *)v + src_v, row_bytes);
            }
        }
    return 0;
}

/* ------------------------------------------------------------------ quantized K/V stores */

/* A quantized pool (int8 or fp8 e4m3 codes, see paged_attention.c) keeps one
 * scale per block and kv head: value = code * scale, scale = the block's
 * largest |value| / QMAX. Writing rows into a block: if they fit its scale they
 * are quantized with it; otherwise the scale is raised to fit them and only
 * that block's earlier rows (offsets below the first new row) are requantized,
 * each to the code nearest its dequantized value. A block's first row (offset
 * 0) starts it afresh: whatever the block held before is not read again. Full
 * blocks, which the prefix cache shares, are never written, so a shared
 * block's codes and scale never change under a reader. The requantized value
 * is rounded again; a row's error stays within its final scale / 2 per
 * requantization it went through, plus its own rounding (tests state it). */

/* float32 -> e4m3 (finite, saturating at 448), rounding to nearest even: as
 * torch's conversion to float8_e4m3fn rounds a value in range. */
TM_INLINE uint8_t f32_to_e4m3(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80);
    const float a = fabsf(x);
    if (a != a) return sign | 0x7f;      /* NaN */
    if (a >= 448.0f) return sign | 0x7e; /* saturate (the stores clamp first) */
    if (a < 0.015625f)                   /* below 2^-6: subnormal steps of 2^-9, code 8 is 2^-6 */
        return sign | (uint8_t)rintf(a * 512.0f);
    uint32_t ua;
    memcpy(&ua, &a, sizeof ua);
    int32_t e = (int32_t)(ua >> 23) - 127;
    uint32_t m = ua & 0x7fffffu;
    m = (m + 0x7ffffu + ((m >> 20) & 1u)) >> 20; /* 3 bits, nearest even */
    if (m == 8) m = 0, e++;
    uint32_t code = (uint32_t)(e + 7) << 3 | m;
    if (code > 0x7e) code = 0x7e;
    return sign | (uint8_t)code;
}

TM_INLINE float quant_max(int fp8) { return fp8 ? 448.0f : 127.0f; }

/* The code of x with 1 / scale = inv; out-of-range values clamp, NaN codes 0. Comparisons,
 * not fminf / fmaxf (whose NaN rules keep gcc from vectorizing the loops that call this). */
TM_INLINE uint8_t quant_code(float x, float inv, int fp8) {
    const float q = quant_max(fp8);
    float y = x * inv;
    y = y != y ? 0.0f : y < -q ? -q : y > q ? q : y;
    return fp8 ? f32_to_e4m3(y) : (uint8_t)(int8_t)(int32_t)rintf(y);
}

TM_INLINE float code_value(uint8_t c, int fp8) { return fp8 ? fp8_values[c] : (float)(int8_t)c; }

TM_INLINE float src_value(const void *p, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* n rows (row i at src + i * ld elements, float32 or bf16) into offsets o0 .. o0 + n - 1 of
 * block blk of one kv head: codes is that head's [num_blocks, BS, D] pool, scales its
 * [num_blocks] scales. The caller keeps o0 + n <= BS and gives a block to one thread.
 * Called through store_quant, which makes src_bf16 and fp8 compile-time constants (with
 * the flag a runtime value the per-value loops did not vectorize). */
TM_INLINE void store_quant_run(uint8_t *codes, float *scales, int64_t blk, int64_t BS, int64_t D, int64_t o0,
                               int64_t n, const void *src, int64_t ld, int src_bf16, int fp8) {
    float amax = 0.0f;
    for (int64_t i = 0; i < n; i++) {
#pragma omp simd reduction(max : amax)
        for (int64_t d = 0; d < D; d++) {
            const float a = fabsf(src_value(src, src_bf16, i * ld + d));
            amax = a > amax ? a : amax; /* a NaN is passed over, as fmaxf would */
        }
    }
    uint8_t *block = codes + (size_t)blk * BS * D;
    const float old = o0 == 0 ? 0.0f : scales[blk];
    const float need = amax / quant_max(fp8);
    float s = old;
    if (need > old) {
        s = need;
        if (old > 0.0f) { /* the block's earlier rows, onto the raised scale */
            const float inv = 1.0f / s;
            for (int64_t j = 0; j < o0 * D; j++) block[j] = quant_code(code_value(block[j], fp8) * old, inv, fp8);
        }
    }
    scales[blk] = s;
    const float inv = s > 0.0f ? 1.0f / s : 0.0f;
    for (int64_t i = 0; i < n; i++) {
        uint8_t *restrict dst = block + (o0 + i) * D;
        if (src_bf16) {
            const uint16_t *restrict row = (const uint16_t *)src + i * ld;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) dst[d] = quant_code(bf16_to_f32(row[d]), inv, fp8);
        } else {
            const float *restrict row = (const float *)src + i * ld;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) dst[d] = quant_code(row[d], inv, fp8);
        }
    }
}

/* store_quant_run with the source dtype and the code format as constants. */
TM_INLINE void store_quant(uint8_t *codes, float *scales, int64_t blk, int64_t BS, int64_t D, int64_t o0,
                           int64_t n, const void *src, int64_t ld, int src_bf16, int fp8) {
    if (src_bf16) {
        if (fp8)
            store_quant_run(codes, scales, blk, BS, D, o0, n, src, ld, 1, 1);
        else
            store_quant_run(codes, scales, blk, BS, D, o0, n, src, ld, 1, 0);
    } else {
        if (fp8)
            store_quant_run(codes, scales, blk, BS, D, o0, n, src, ld, 0, 1);
        else
            store_quant_run(codes, scales, blk, BS, D, o0, n, src, ld, 0, 0);
    }
}

static int cmp_i64(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The new keys and values of `rows` tokens into one layer's quantized pools (codes
 * [kv_heads, num_blocks, block_size, D], one byte each; scales [kv_heads, num_blocks]):
 * row r's kv head h comes from k + r * ldk + h * D (likewise v), float32 or bf16
 * (src_bf16). Consecutive rows whose slots are consecutive in one block go in as one
 * run (one scale decision for all of them: a prefill chunk fills each block with
 * no requantization). Runs of different blocks go to the threads in parallel
 * (serially when a block appears in two runs). 1 when a slot is out of range
 * (checked before anything is written), 2 when scratch memory could not be had. */
int tm_store_kv_quant_rows(const void *k, int64_t ldk, const void *v, int64_t ldv, int64_t rows, int64_t kv_heads,
                           int64_t D, const int64_t *slots, void *k_codes, void *v_codes, float *k_scale,
                           float *v_scale, int64_t num_blocks, int64_t block_size, int fp8, int src_bf16,
                           int num_threads) {
    if (rows < 0 || kv_heads < 1 || D < 1 || block_size < 1 || ldk < kv_heads * D || ldv < kv_heads * D) return 1;
    const int64_t num_slots = num_blocks * block_size;
    for (int64_t r = 0; r < rows; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) return 1;
    if (rows == 0) return 0;
    int64_t *start = (int64_t *)malloc(2 * (size_t)(rows + 1) * sizeof(int64_t));
    if (!start) return 2;
    int64_t *sorted = start + rows + 1;
    int64_t runs = 0;
    for (int64_t r = 0; r < rows; r++)
        if (r == 0 || slots[r] != slots[r - 1] + 1 || slots[r] % block_size == 0) start[runs++] = r;
    start[runs] = rows;
    for (int64_t i = 0; i < runs; i++) sorted[i] = slots[start[i]] / block_size;
    qsort(sorted, (size_t)runs, sizeof(int64_t), cmp_i64);
    int repeated = 0;
    for (int64_t i = 1; i < runs; i++) repeated |= sorted[i] == sorted[i - 1];
    const int64_t items = runs * kv_heads;
    const size_t esize = src_bf16 ? 2 : 4;
    const int threads = repeated ? 1 : ew_threads(num_threads, items, rows * 2 * kv_heads * D / items + 1);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t it = 0; it < items; it++) {
        const int64_t run = it / kv_heads, h = it % kv_heads, r0 = start[run], n = start[run + 1] - r0;
        const int64_t blk = slots[r0] / block_size, o0 = slots[r0] % block_size;
        const size_t head = (size_t)h * num_blocks;
        store_quant((uint8_t *)k_codes + head * block_size * D, k_scale + head, blk, block_size, D, o0, n,
                    (const char *)k + ((size_t)r0 * ldk + h * D) * esize, ldk, src_bf16, fp8);
        store_quant((uint8_t *)v_codes + head * block_size * D, v_scale + head, blk, block_size, D, o0, n,
                    (const char *)v + ((size_t)r0 * ldv + h * D) * esize, ldv, src_bf16, fp8);
    }
    free(start);
    return 0;
}
