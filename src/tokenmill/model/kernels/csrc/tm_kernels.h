/* What every kernel file of the library shares: the system headers, which instruction
 * set this build targets and the features it has (each decided once, here), the vector
 * vocabulary the kernels are written in, and the structures the Python side fills
 * (model/kernels/cpu_kernels.py mirrors them with ctypes).
 *
 * The library is one translation unit (kernels.c includes the files in order); each file
 * includes this header so it reads on its own. Why one unit: the step inlines the
 * one-row routines of the attention and elementwise files and the matmul tiles into its
 * loops, and separate units would lose that without link-time optimisation.
 *
 * The vocabulary: vf / vi are VW lanes of float32 / int32 (GNU vector extensions, so
 * +, *, shuffles and conversions are written once for every width); vload, vstore,
 * vsplat, vfma, transpose_sum (the reduce of VW vectors into one) and the widening loads
 * vload_bf16 and vload_i8. VW is 16 on AVX-512 builds and 8 on AVX2 and portable ones.
 * Integer dot products (u8 x s8 summed into int32 lanes, the VNNI step) are vdot with
 * dot_zero, dot_load, dot_set1 and dot_acc where the build has one instruction for them.
 * Kernels whose algorithm differs between instruction sets (AVX2's 16-bit pair sums
 * against AVX-512's vpdpbusd, vdpbf16ps, AMX tiles) keep their own bodies under the
 * feature macros below. */
#ifndef TM_KERNELS_H
#define TM_KERNELS_H

#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__FMA__)
#include <immintrin.h>
#endif

#define TM_INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(VW * sizeof(float))));

TM_INLINE vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

TM_INLINE void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* a * b + c, fused where the CPU has FMA, spelled out: left to -ffp-contract, gcc fuses the
 * same expression in some inlined copies of a kernel and not in others (one per activation
 * row count), and a row's result must not depend on which copy computed it. */
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif
TM_INLINE vf vfma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    return _mm512_fmadd_ps(a, b, c);
#elif defined(__FMA__)
    return _mm256_fmadd_ps(a, b, c);
#else
    return a * b + c; /* no FMA instruction to contract into */
#endif
}

/* c - a * b, fused where the CPU has FMA (as vfma). */
TM_INLINE vf vfnma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
    return _mm512_fnmadd_ps(a, b, c);
#elif defined(__FMA__)
    return _mm256_fnmadd_ps(a, b, c);
#else
    return c - a * b;
#endif
}

/* Every lane s, in one broadcast: `(vf){0} + s` spends an add on it too (kept for -0.0's sign),
 * which in a loop of broadcast and FMA pairs is a third of the instructions. */
TM_INLINE vf vsplat(float s) {
#if defined(__AVX512F__)
    return _mm512_set1_ps(s);
#elif defined(__FMA__)
    return _mm256_set1_ps(s);
#else
    return (vf){0} + s;
#endif
}

typedef uint16_t vh __attribute__((vector_size(VW * sizeof(uint16_t))));
typedef uint32_t vu __attribute__((vector_size(VW * sizeof(uint32_t))));

/* VW bf16 values as float32 lanes, exactly (each value's bits moved to the top half). */
TM_INLINE vf vload_bf16(const uint16_t *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    const vu u = __builtin_convertvector(h, vu) << 16;
    vf f;
    memcpy(&f, &u, sizeof f);
    return f;
}

typedef uint8_t vb __attribute__((vector_size(VW)));

/* VW int8 codes as float32 lanes. gcc 12 scalarizes a signed byte -> int conversion of a
 * whole vector; flipping the sign bit makes it an unsigned one (one vpmovzxbd), undone by
 * the - 128. */
TM_INLINE vf vload_i8(const int8_t *p) {
    vb q;
    memcpy(&q, p, sizeof q);
    return __builtin_convertvector(__builtin_convertvector(q ^ 0x80, vi) - 128, vf);
}

/* a[t] holds VW partial sums of row t's dot product; returns the vector whose
 * lane t is the full sum of a[t]. Each level adds pairs of half-groups, so
 * VW vectors become VW / 2, each holding the partial sums of two rows, etc.
 * One definition for float sums and for exact int32 ones (the int8 dot products). */
#if VW == 16
static const vi TRANSPOSE_LO[4] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
    {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
    {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
    {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}};
static const vi TRANSPOSE_HI[4] = {
    {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
    {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31},
    {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31},
    {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}};
#define TRANSPOSE_LEVELS 4
#else
static const vi TRANSPOSE_LO[3] = {{0, 1, 2, 3, 8, 9, 10, 11}, {0, 1, 4, 5, 8, 9, 12, 13}, {0, 2, 4, 6, 8, 10, 12, 14}};
static const vi TRANSPOSE_HI[3] = {{4, 5, 6, 7, 12, 13, 14, 15}, {2, 3, 6, 7, 10, 11, 14, 15}, {1, 3, 5, 7, 9, 11, 13, 15}};
#define TRANSPOSE_LEVELS 3
#endif
#define TM_TRANSPOSE_SUM(T, NAME)                                                                   \
    TM_INLINE T NAME(T a[VW]) {                                                                     \
        int n = VW;                                                                                 \
        for (int lev = 0; lev < TRANSPOSE_LEVELS; lev++) {                                          \
            for (int i = 0; i < n / 2; i++)                                                         \
                a[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], TRANSPOSE_LO[lev]) +               \
                       __builtin_shuffle(a[2 * i], a[2 * i + 1], TRANSPOSE_HI[lev]);                \
            n /= 2;                                                                                 \
        }                                                                                           \
        return a[0];                                                                                \
    }
TM_TRANSPOSE_SUM(vf, transpose_sum)
TM_TRANSPOSE_SUM(vi, transpose_sum_i)

/* KV pool formats: element type of the pool's rows. */
enum { KV_F32 = 0, KV_BF16 = 1, KV_I8 = 2, KV_FP8 = 3 };

/* ------------------------------------------------------------------ build features */

/* On a CPU with AVX512-BF16, bf16 rows meet bf16-rounded queries and softmax weights in
 * vdpbf16ps (ROWS_BF16_DOT): a row is used as loaded, where widening it took a shuffle
 * per vector, and one instruction multiplies twice the pairs an FMA does. The products
 * are exact and the sums float32, so the rounding of q and of the weights (8 bits of
 * mantissa, as the pool's rows already have) is the only change; the weights are
 * rounded before they are summed, so they still add up to one.
 * The same instruction multiplies bf16 weights by bf16-rounded activations (bf16_dot_tile). */
#if defined(__AVX512BF16__) && VW == 16
#define TM_BF16_DOT 1
#endif

/* int4 against int8 activations with integer dot products on AVX2 (no AVX-512): the row
 * tiles of int8.c (int4_q8_tile, int8_q8_tile); widening each code to float costs more
 * there than the rest of the step. */
#if defined(__AVX2__) && !defined(__AVX512F__)
#define TM_Q8_DOT 1
#endif
#if VW == 16 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* AVX-512 with VNNI: int4 layers in the nibble packing multiply their codes by int8
 * activations with vpdpbusd (int4.c's int4_q8_block), as AVX2 builds do with vpmaddubsw.
 * One stream of a model too large for the caches is bound by the bytes of weights a
 * step reads: four bits a weight there, against eight for the int8 layers. */
#define TM_Q4_VNNI 1
#endif
#if defined(TM_Q8_DOT) || defined(TM_Q4_VNNI)
#define TM_Q4_PACKED 1 /* int4_q8_rows exists: int4 layers given the nibble packing use it */
#define TM_Q6_TILES 1  /* q6k_rows exists: Q6_K layers given pack_q6_tiles' copy use it */
#endif

/* u8 x s8 dot products summed into int32 lanes, four pairs a lane (the VNNI step) */
#if VW == 16 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TM_VNNI_DOT 1
typedef __m512i vdot;
#define dot_zero() _mm512_setzero_si512()
#define dot_load(p) _mm512_loadu_si512((const void *)(p))
#define dot_acc(acc, x, w) _mm512_dpbusd_epi32(acc, x, w)
#define dot_set1(v) _mm512_set1_epi32(v)
#elif VW == 8 && defined(__AVXVNNI__)
#define TM_VNNI_DOT 1
typedef __m256i vdot;
#define dot_zero() _mm256_setzero_si256()
#define dot_load(p) _mm256_loadu_si256((const __m256i *)(p))
#define dot_acc(acc, x, w) _mm256_dpbusd_avx_epi32(acc, x, w)
#define dot_set1(v) _mm256_set1_epi32(v)
#elif VW == 8 && defined(__AVX2__)
/* AVX2 without VNNI: the same integer products, the same packing, the same exact int32
 * sums, from 16-bit multiplies (i16_dot_step): vpmaddubsw would saturate on u8 x s8 pairs,
 * vpmaddwd on the codes widened to 16 bits cannot. Two vpmaddwd per 32 multiply-adds
 * against one FMA per 8 for float32: about twice the float32 tile's rate. */
#define TM_VNNI_DOT 1
#define TM_I16_DOT 1
typedef __m256i vdot;
#define dot_zero() _mm256_setzero_si256()
#define dot_load(p) _mm256_loadu_si256((const __m256i *)(p))
#endif

/* GGUF K-quant codes times int8 activations with integer dot products (kquant.c). */
#if (VW == 16 && defined(__AVX512VNNI__) && defined(__AVX512BW__)) || (VW == 8 && defined(__AVX2__))
#define TM_KQ_DOT 1
#endif
#if defined(TM_KQ_DOT) && defined(TM_VNNI_DOT)
#define TM_KQ_INT8G 1 /* Q4_K / Q5_K tiles of many rows run on the int8g kernels (kq_int8g_rows) */
#endif

/* int8 products on AMX tiles (amx_int8.c) */
#if VW == 16 && defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define TM_AMX_INT8 1
#endif

/* ------------------------------------------------------------------ shared structures */

#define TM_MAX_ROWS 6 /* activation rows per pass over a weight tile */

enum { W_F32 = 0, W_BF16 = 1, W_INT8 = 2, W_INT4 = 3, W_INT8G = 4, W_KQ = 5 /* GGUF K-quant blocks, kquant.c */ };

typedef struct {
    int32_t kind;
    int32_t group;         /* int4: columns per (scale, zero) pair, a multiple of 32; K-quant: ggml's type id */
    int32_t repeat;        /* int4: 2 when each row holds [hi | lo] codes of one input fed twice (GGUF Q8_0) */
    int32_t a8_rows;       /* int8 with packed: from this many activation rows, activations quantized
                              per row to 8 bits (w8a8 layers; 0: never); int8g: to 8 bits
                              with a scale per 32 inputs */
    int64_t n, k;          /* output rows, input features */
    const void *w;         /* f32 / bf16 / int8 / int8g: [n, k]; int4: [n, k * repeat / 2] bytes */
    const float *scale;    /* int8: [n]; int8g: [n, k / 32] (GGUF Q8_0's layout), with packed
                              [n / VW][k / 32][VW]; int4: [n, k * repeat / group] */
    const float *zero;     /* int4: [n, k * repeat / group], holds z - 8 s: w = code * s + zero */
    const float *bias;     /* [n] or NULL */
    const int32_t *row_sums; /* int8 with packed: [n] sums of each row's codes; int8g with packed:
                                [n / VW][k / 32][VW], -128 x each group's code sum */
    const int8_t *packed;    /* int8, int8g: the codes in the VNNI packing (int8_vnni_block), or NULL; needs
                                n % VW == 0 and k % 4 == 0 */
    int32_t a16_rows;        /* int8, int8g with packed: from this many rows (below a8_rows), 16-bit activations
                                as two u8 planes (0: never); w may be NULL when this is 1 */
    int32_t q4_form;         /* int4 with packed: Q4_SYMMETRIC | Q4_F16 | Q4_KSCALES | Q4_FIFTH bits (int4_q8_block),
                                fixed at packing */
    const void *packed_scale; /* int4 with packed (AVX2, AVX-512 VNNI builds): [n / VW][groups][VW] scales
                                 (none with Q4_F16: in the tiles) */
    const void *packed_zero;  /* and z - 8 s in the same order (int4_q8_rows); NULL with Q4_SYMMETRIC, Q4_F16 */
} TmLinear;

typedef struct {
    const float *input_norm, *post_norm; /* [hidden]; post_norm: the norm before the MLP */
    const float *q_norm, *k_norm;        /* [head_dim] or NULL */
    TmLinear qkv, o, gate_up, down;
    void *k_cache, *v_cache;             /* [kv_heads, num_blocks, block_size, head_dim] */
    float *k_scale, *v_scale;            /* quantized pools: [kv_heads, num_blocks], else NULL */
    int64_t window;                      /* a sliding-window layer's window (paged_attention.c); 0: none */
    /* Gemma's layer: norms of the attention block's and the MLP's outputs before their residual
     * adds ([hidden], or NULL: added as they are), and its own rotary tables ([max_positions,
     * head_dim], or NULL: the model's). */
    const float *attn_out_norm, *mlp_out_norm;
    const float *cos, *sin;
    /* The q/k/v projection's second part, n = 0 where there is none: its outputs follow qkv's
     * (a GGUF Q4_K_M file stores v in Q6_K blocks beside q and k in Q4_K). */
    TmLinear qkv_tail;
} TmLayer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter, num_layers;
    int64_t num_blocks, block_size, max_positions;
    float eps, scale;
    int32_t cache_fmt; /* KV_F32, KV_BF16, KV_I8 or KV_FP8 */
    const TmLayer *layers;
    const float *final_norm;
    const float *cos, *sin; /* [max_positions, head_dim] */
    TmLinear head;
    int32_t act; /* the MLP's activation of its gate: ACT_SILU (SwiGLU) or ACT_GELU_TANH (GeGLU) */
    int32_t pad;
} TmModel;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

/* TmLinear.q4_form: Q4_SYMMETRIC, every zero is -8 x its scale (GGUF Q4_0: w = d (q - 8)),
 * so no zero is read and the -8 is taken on each activation block's code sum in int32;
 * Q4_F16, groups of 32 with fp16 scales (and zeros), exact where the packing chose it, stored in
 * the tiles after each block's codes (one stream of memory a tile, as the file's blocks are):
 * packed_scale and packed_zero are not read;
 * Q4_KSCALES, GGUF Q4_K's own factors (w = d sc q - dmin m, groups of 32): packed_scale holds,
 * per tile and 256-weight super-block, d and dmin (VW fp16 each) and the 8 groups' 6-bit sc
 * and m (VW bytes each), no packed_zero (cpu_kernels.pack_kscales);
 * Q4_FIFTH, five-bit codes (GGUF Q5_0, Q5_1, Q5_K: 0..31): each tile's 32-input block holds,
 * after its four steps of low nibbles, one 4 VW-byte vector of the fifth bits (byte 4r + i: bit
 * s for step s's input i of row r in the low nibble, bit 4 + s for the high nibble's), 5.5 bits
 * a weight where two nibble planes would read 8; Q4_SYMMETRIC then means w = d (q - 16)
 * (cpu_kernels.pack_int4_q8). */
enum { Q4_SYMMETRIC = 1, Q4_F16 = 2, Q4_KSCALES = 4, Q4_FIFTH = 8 };

/* One LoRA adapter's update of one fused projection, y += (x A^T) bt: A [r, k], bt B transposed
 * and scaled, [r, n], stored in panels of LORA_PANEL columns (see lora_panel). B is
 * block-diagonal over the projection's parts (q, k, v; gate, up): output columns
 * [part[0], part[1]) take only the ranks [part[2], part[3]). */
typedef struct {
    const float *at; /* A^T [k, rp], ranks past r zero */
    const float *bt; /* [ceil(n / LORA_PANEL), r, LORA_PANEL]: column c of rank j at lora_panel */
    int64_t r;       /* 0: this projection is not adapted */
    int64_t rp;      /* r rounded up to whole vectors */
    int64_t n_parts; /* 1 to 3 */
    int64_t part[3][4];
} TmDelta;

/* The step's rows [row0, row1) run under one adapter; its deltas are [num_layers][4]
 * (qkv, o, gate_up, down). Rows in no segment are the base model's and pay nothing. */
typedef struct {
    const TmDelta *deltas;
    int64_t row0, row1;
} TmSegment;

enum { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN, LORA_PROJECTIONS };

/* ------------------------------------------------------------------ barrier */

#endif
