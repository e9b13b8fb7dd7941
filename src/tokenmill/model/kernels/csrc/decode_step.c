/* One whole step of a Llama-family model in one native call (CPU, OpenMP): decode rows,
 * and prefill chunks with the decodes that share their step (tm_model_step).
 *
 * Why: at batch 1 an eager torch decode step dispatches ~4,000 ATen ops (norms,
 * rotary, splits, casts, residuals, the quantized matmuls and their wrappers),
 * and on a small CPU their fixed costs took most of an int4 step, far more
 * than reading the weights (docs/performance.md). Here every layer runs in one
 * OpenMP parallel region: the threads claim chunks of every matmul's output
 * rows and of the (sequence, kv head) attention items as they come free
 * (claim_chunk), and meet at six spin barriers per layer (libgomp's own barriers sleep under the
 * OMP_WAIT_POLICY=PASSIVE that tokenmill sets, and a futex wake-up per barrier
 * would cost more than the work between them).
 *
 * The math is the model's (model/models/llama.py), in float32 throughout: RMSNorm,
 * fused q/k/v projection (+ bias), optional per-head q/k RMSNorm (Qwen3),
 * rotate-half rotary from the model's cos/sin tables, the new K/V written into
 * the paged pool, attention over the pool in place (paged_attention.c's item
 * routine per row, prefill_attention.c's per block of a prefill chunk's query
 * positions; all rows store their K/V before any attends, so several rows of one
 * sequence at consecutive positions, a speculative verify or a chunk, run as one
 * step; a quantized pool's rows go through elementwise.c's requantizing store),
 * o projection + residual, RMSNorm, gate/up, SiLU(gate) * up, down
 * projection + residual, the final norm and the LM head of the rows that sample.
 *
 * Prefill chunks through here rather than the eager forward: a 512-row step of the
 * eager model spends a good part of its time between kernels (Python and torch
 * dispatch, threads waking and meeting per op) and on whole-step intermediates
 * (gate/up written out, then read back by SiLU); here SiLU runs on each gate/up tile
 * while it is in cache (docs/performance.md has the measured step times).
 *
 * Weights stay in their stored precision and are widened to float32 in
 * registers: float32, bfloat16, int8 with a scale per output row, and int4
 * with a (scale, zero) pair per group of input columns, packed so that byte i
 * of each 32-column chunk holds code i in its low nibble and code i + 16 in
 * its high nibble (so one byte load gives two vectors' worth of codes). The
 * exception: bf16 weights against several activation rows, on a CPU with
 * AVX512-BF16, multiply bf16-rounded activations with vdpbf16ps
 * (bf16_dot_tile).
 *
 * Matmuls are matrix-vector products over up to 6 rows of activations at a
 * time: a tile of VW output rows keeps one vector of partial sums per row and
 * activation row; one shuffle tree (transpose_sum) then turns the VW vectors
 * into VW results.
 */
#include "paged_attention.c"
#include "prefill_attention.c"
#include "argmax.c"
#include "elementwise.c"
#include "kquant.c"

#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <pthread.h>
#include <sched.h>

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

typedef struct {
    int count;
    int sense;
    int n;
} SpinBarrier;

TM_INLINE void spin_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Sense-reversing barrier; after a while of spinning it yields the core (a
 * shared machine may have descheduled the thread we wait for). */
TM_INLINE void barrier_wait(SpinBarrier *b, int *local_sense) {
    const int s = !*local_sense;
    *local_sense = s;
    if (__atomic_add_fetch(&b->count, 1, __ATOMIC_ACQ_REL) == b->n) {
        __atomic_store_n(&b->count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->sense, s, __ATOMIC_RELEASE);
        return;
    }
    for (long spins = 0; __atomic_load_n(&b->sense, __ATOMIC_ACQUIRE) != s; spins++) {
        if (spins < 2000)
            spin_pause();
        else
            sched_yield();
    }
}

/* ------------------------------------------------------------------ matmuls */

typedef uint8_t vu8 __attribute__((vector_size(VW)));
typedef uint16_t vu16 __attribute__((vector_size(2 * VW)));
typedef uint32_t vu32 __attribute__((vector_size(4 * VW)));

/* VW weights of one row, widened to float32. */
TM_INLINE vf load_f32w(const float *p) { return vload(p); }
TM_INLINE vf load_bf16w(const uint16_t *p) {
    vu16 h;
    memcpy(&h, p, sizeof h);
    vu32 u = __builtin_convertvector(h, vu32) << 16;
    vf f;
    memcpy(&f, &u, sizeof f);
    return f;
}
/* gcc 12 scalarizes a signed byte -> int conversion of a whole vector; flipping
 * the sign bit makes it an unsigned one (one vpmovzxbd), undone by the - 128. */
TM_INLINE vf load_int8w(const int8_t *p) {
    vu8 q;
    memcpy(&q, p, sizeof q);
    return __builtin_convertvector(__builtin_convertvector(q ^ 0x80, vi) - 128, vf);
}

/* VW weights of row `row` from column c, widened (dense kinds). */
TM_INLINE vf load_dense_w(const TmLinear *L, const int kind, int64_t row, int64_t c) {
    if (kind == W_F32) return load_f32w((const float *)L->w + row * L->k + c);
    if (kind == W_BF16) return load_bf16w((const uint16_t *)L->w + row * L->k + c);
    if (kind == W_INT8G) /* a scale per 32 columns; c is a multiple of VW, which divides 32 */
        return load_int8w((const int8_t *)L->w + row * L->k + c) * L->scale[row * (L->k / 32) + c / 32];
    return load_int8w((const int8_t *)L->w + row * L->k + c);
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

#if defined(__AVX512BF16__) && VW == 16
#define TM_BF16_DOT 1
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
TM_INLINE void int4_codes(vu8 bytes, vf *lo, vf *hi) {
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
                        vu8 bytes;
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

#if defined(__AVX2__) && !defined(__AVX512F__)
#define TM_Q8_DOT 1
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

#if VW == 16 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* AVX-512 with VNNI: int4 layers in the nibble packing multiply their codes by int8
 * activations with vpdpbusd (int4_q8_block below), as AVX2 builds do with vpmaddubsw.
 * One stream of a model too large for the caches is bound by the bytes of weights a
 * step reads: four bits a weight there, against eight for the int8 layers. */
#define TM_Q4_VNNI 1
#endif
#if defined(TM_Q8_DOT) || defined(TM_Q4_VNNI)
#define TM_Q4_PACKED 1 /* int4_q8_rows exists: int4 layers given the nibble packing use it */

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

#if VW == 16 && defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define TM_AMX_INT8 1
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
    __m512 f[2][Q4_ROWS];
    for (int t = 0; t < NT; t++)
        for (int b = 0; b < NB; b++) f[t][b] = _mm512_setzero_ps();
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
    if (FORM & Q4_KSCALES) /* w = d sc q - dmin m: dmin m x each group's activation sum off */
        for (int64_t j = 0; j < G; j++)
            for (int t = 0; t < NT; t++) {
                const __m512 mv = q4k_factor(kb + (t * (C / 8) + j / 8) * Q4K_BYTES, 2 * VW, 12 * VW + j % 8 * VW);
                for (int b = 0; b < NB; b++) f[t][b] = _mm512_fnmadd_ps(mv, _mm512_set1_ps(gsum[b * G + j]), f[t][b]);
            }
    else if (!(FORM & (Q4_SYMMETRIC | Q4_F16)))
        for (int64_t j = 0; j < G; j++)
            for (int t = 0; t < NT; t++) {
                const __m512 zv = _mm512_loadu_ps(pz + t * G * VW + j * VW);
                for (int b = 0; b < NB; b++) f[t][b] = _mm512_fmadd_ps(zv, _mm512_set1_ps(gsum[b * G + j]), f[t][b]);
            }
    for (int t = 0; t < NT; t++)
        for (int b = 0; b < NB; b++) memcpy(&out[t][b], &f[t][b], sizeof(vf));
}
#else
/* Q4_KSCALES: as the AVX-512 q4k_factor, 8 lanes. */
TM_INLINE __m256 q4k_factor(const uint8_t *sb, int half_at, int64_t bytes_at) {
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + half_at))),
                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sb + bytes_at)))));
}
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
    __m256 f[2][Q4_ROWS];
    for (int t = 0; t < NT; t++)
        for (int b = 0; b < NB; b++) f[t][b] = _mm256_setzero_ps();
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
    if (FORM & Q4_KSCALES) /* w = d sc q - dmin m: dmin m x each group's activation sum off */
        for (int64_t j = 0; j < G; j++)
            for (int t = 0; t < NT; t++) {
                const __m256 mv = q4k_factor(kb + (t * (C / 8) + j / 8) * Q4K_BYTES, 2 * VW, 12 * VW + j % 8 * VW);
                for (int b = 0; b < NB; b++) f[t][b] = _mm256_fnmadd_ps(mv, _mm256_set1_ps(gsum[b * G + j]), f[t][b]);
            }
    else if (!(FORM & (Q4_SYMMETRIC | Q4_F16)))
        for (int64_t j = 0; j < G; j++)
            for (int t = 0; t < NT; t++) {
                const __m256 zv = _mm256_loadu_ps(pz + t * G * VW + j * VW);
                for (int b = 0; b < NB; b++) f[t][b] = _mm256_fmadd_ps(zv, _mm256_set1_ps(gsum[b * G + j]), f[t][b]);
            }
    for (int t = 0; t < NT; t++)
        for (int b = 0; b < NB; b++) memcpy(&out[t][b], &f[t][b], sizeof(vf));
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
#define TM_Q6_TILES 1
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

#if defined(TM_KQ_DOT) && defined(TM_VNNI_DOT)
#define TM_KQ_INT8G 1
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
                    vu8 bytes;
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

/* Output rows are handed out by claiming, not split in fixed shares: on a machine
 * whose cores the server's other threads (HTTP, the load it answers) also use, a thread
 * the system deschedules for a moment would otherwise hold every other thread at the
 * next barrier with its whole share undone. A claim takes a guided chunk: half of what
 * is left over the thread count, whole pairs of tiles (the int8 kernels' step), at least
 * one pair; so equal threads end within a pair of tiles of each other and a slow one
 * leaves its tail to the rest. Which thread computes a tile never changes its values. */
#define CLAIM_TILES 2
/* Gate and up rows the fused step computes per pass before SiLU(gate) * up: a claim's pair
 * of tiles, so the int8 kernels run their two-tile step (one broadcast activation feeds two
 * tiles' products) rather than one tile at a time. */
#define GU_COLS (CLAIM_TILES * VW)

/* Claims the next chunk of `total` work units from *next: returns its first unit and
 * sets *end, or returns -1 when all are taken. */
TM_INLINE int64_t claim_chunk(int64_t *next, int64_t total, int T, int64_t step, int64_t *end) {
#ifdef TM_STATIC_SHARES
    /* The fixed shares the kernels used before (benchmarks/thread_claims.py builds this to
     * compare): thread t's one chunk, its t-th of total in whole steps; *next records who
     * has taken theirs. */
    const int t = omp_get_thread_num();
    if (__atomic_fetch_or(next, (int64_t)1 << t, __ATOMIC_RELAXED) & ((int64_t)1 << t)) return -1;
    const int64_t steps = (total + step - 1) / step, first = steps * t / T * step;
    const int64_t last = steps * (t + 1) / T * step;
    *end = last < total ? last : total;
    return first < *end ? first : -1;
#else
    int64_t cur = __atomic_load_n(next, __ATOMIC_RELAXED), stop;
    do {
        if (cur >= total) return -1;
        int64_t size = (total - cur) / (2 * T);
        size = (size + step - 1) / step * step;
        if (size < step) size = step;
        stop = cur + size < total ? cur + size : total;
    } while (!__atomic_compare_exchange_n(next, &cur, stop, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    *end = stop;
    return cur;
#endif
}

/* Rows [*n0, *n1) of L's n output rows claimed from *next (in tiles of VW); 0 when none
 * are left. */
TM_INLINE int claim_rows(int64_t *next, int64_t n, int T, int64_t *n0, int64_t *n1) {
    int64_t end;
    const int64_t first = claim_chunk(next, (n + VW - 1) / VW, T, CLAIM_TILES, &end);
    if (first < 0) return 0;
    *n0 = first * VW;
    *n1 = end * VW < n ? end * VW : n;
    return 1;
}

/* This thread's part of y = L(in) (or y += L(in)): the tiles of L's rows it claims from
 * *next, a counter at 0 that every thread of the call shares. */
static void thread_linear(const TmLinear *L, const float *in, int64_t ld_in, int64_t B, InputScratch *is,
                          int64_t *next, int T, float *y, int64_t ldy, int accumulate) {
    int64_t ldx, n0, n1;
    const float *x = prepare_input(L, in, ld_in, B, is, &ldx);
    while (claim_rows(next, L->n, T, &n0, &n1)) linear_rows(L, x, ldx, is, B, n0, n1, y, ldy, accumulate, 0);
}

/* ------------------------------------------------------------------ the step */

static int64_t max_k(const TmModel *m) {
    int64_t k = m->hidden > m->inter ? m->hidden : m->inter;
    k = k > m->heads * m->head_dim ? k : m->heads * m->head_dim;
    return 2 * k; /* room for a repeat-2 input */
}

/* One attention work item of a step: a decode row's (chunk -1, its row, a kv head, part j
 * of the row's whole context in PART_LEN positions: paged_attention.c), or a prefill chunk's
 * (its index, a block of its query positions, a kv head; part 0). A layer whose window
 * leaves a row fewer parts skips the items past them; a row of one part is attended whole.
 * slot: where a part's result goes (parts of rows with several, in order), else -1. */
typedef struct {
    int32_t chunk, index, kvh, part, slot;
} AttnItem;

/* Checks the prefill chunks of a step: pairs (first row, row count), in row order, apart,
 * inside [0, B); each chunk's rows at consecutive positions of one sequence (same block
 * table, seq_lens one apart). Returns 0 when they are sound. */
static int check_chunks(const int32_t *chunks, int64_t n_chunks, int64_t B, const int32_t *block_tables,
                        int64_t bt_stride, int64_t bt_width, const int32_t *seq_lens) {
    int64_t next_free = 0;
    for (int64_t c = 0; c < n_chunks; c++) {
        const int64_t first = chunks[2 * c], count = chunks[2 * c + 1];
        if (first < next_free || count < 1 || first + count > B) return 1;
        next_free = first + count;
        const int64_t last = first + count - 1;
        const int32_t *table = block_tables + last * bt_stride;
        for (int64_t r = first; r < last; r++) {
            if (seq_lens[r] != seq_lens[last] - (last - r)) return 1;
            if (memcmp(block_tables + r * bt_stride, table, (size_t)bt_width * sizeof(int32_t))) return 1;
        }
    }
    return 0;
}

/* x[b] += rms_norm(y[b]) * w for this thread's share of the B rows (Gemma's norms of a
 * block's output before its residual add, in float32 as the eager model computes them). */
static void normed_add(float *x, float *y, const float *w, int64_t B, int64_t H, float eps, int t, int T) {
    for (int64_t b = t; b < B; b += T) {
        float *yb = y + b * H, *xb = x + b * H;
        rms_norm(yb, w, H, eps, yb);
#pragma omp simd
        for (int64_t i = 0; i < H; i++) xb[i] += yb[i];
    }
}

/* Whether some decode row of the step is attended in parts under the window in ``a``. */
static int layer_has_parts(const Args *a, const AttnItem *items, int64_t n_items) {
    for (int64_t i = 0; i < n_items; i++)
        if (items[i].chunk < 0 && items[i].part == 1 && item_parts(a, items[i].index) > 1) return 1;
    return 0;
}

/* The step's attention items: the chunks' first (the prefill kernel's larger items; later
 * query blocks, which see more keys, before earlier ones), then every other row's, one per
 * kv head. NULL when out of memory. */
static AttnItem *attention_items(const TmModel *m, int64_t B, const int32_t *seq_lens, const int32_t *chunks,
                                 int64_t n_chunks, int64_t *count, int64_t *slots) {
    const int64_t KVH = m->kv_heads, per_block = PF_ROWS / (m->heads / m->kv_heads);
    int64_t n = 0;
    for (int64_t c = 0; c < n_chunks; c++) n += (chunks[2 * c + 1] + per_block - 1) / per_block * KVH;
    for (int64_t b = 0, c = 0; b < B; b++) {
        if (c < n_chunks && b == chunks[2 * c]) {
            b += chunks[2 * c + 1] - 1, c++;
            continue;
        }
        n += parts_of(seq_lens[b]) * KVH;
    }
    AttnItem *items = (AttnItem *)malloc((size_t)(n > 0 ? n : 1) * sizeof(AttnItem));
    if (!items) return NULL;
    int64_t i = 0;
    for (int64_t c = 0; c < n_chunks; c++)
        for (int64_t blk = (chunks[2 * c + 1] + per_block - 1) / per_block - 1; blk >= 0; blk--)
            for (int64_t kvh = 0; kvh < KVH; kvh++)
                items[i++] = (AttnItem){(int32_t)c, (int32_t)blk, (int32_t)kvh, 0, -1};
    int64_t c = 0, slot = 0;
    for (int64_t b = 0; b < B; b++) {
        if (c < n_chunks && b == chunks[2 * c]) {
            b += chunks[2 * c + 1] - 1, c++;
            continue;
        }
        const int64_t P = parts_of(seq_lens[b]); /* the whole context's: a window can only leave fewer */
        for (int64_t kvh = 0; kvh < KVH; kvh++)
            for (int64_t j = 0; j < P; j++)
                items[i++] = (AttnItem){-1, (int32_t)b, (int32_t)kvh, (int32_t)j, P > 1 ? (int32_t)slot++ : -1};
    }
    *count = i;
    *slots = slot;
    return items;
}


/* One step of the model over B rows, every layer, the final norm and the head in one
 * OpenMP region.
 *
 * x: [B, hidden] float32 token embeddings (the residual stream, overwritten).
 * block_tables [B, bt_stride] int32, seq_lens [B] int32: each row's sequence's table and
 * its context length including the row's token (the row's position is seq_len - 1).
 * Every row's K/V is stored before any row attends, so rows of one sequence at
 * consecutive positions see each other's keys.
 * chunks [n_chunks, 2] int32: (first row, row count) of the prefill chunks, whose rows the
 * prefill kernel attends as one chunk, as the eager model's attention does; every other
 * row is attended by the decode kernel on its own (a decode, or a speculative proposal).
 * A quantized pool takes no chunks (its store requantizes a block's rows together).
 * logit_rows [n_logits] int32: the rows whose logits are wanted, into logits
 * [n_logits, vocab]; NULL: every row, logits [B, vocab].
 * Returns 0, 1 when an input lies outside the pool/tables/rotary range or the chunks are
 * not sound (nothing written), 2 when memory could not be allocated. */
/* ------------------------------------------------------------------ LoRA */

/* Activation rows per pass over an adapter's A^T (a segment of up to that many rows reads it
 * once), and A^T's vectors per pass: the accumulators fill half the vector registers. */
#if VW == 16
#define LORA_ROWS 8
#else
#define LORA_ROWS 4
#endif
#define LORA_VECS 2
#define LORA_PREFETCH_ROWS 16 /* rows of A^T ahead of the one multiplied */

/* t[b][v0 .. v0 + NV * VW) = x[b] A^T for LORA_ROWS rows from b0 (rows past r1 repeat the
 * last one; their results are not kept), from at = A^T [K, rp]: per input feature, NV
 * (<= LORA_VECS) vectors of at against a broadcast of each row's feature, no horizontal sums. */
TM_INLINE void lora_shrink_tile(const float *at, int64_t rp, int64_t K, const float *const *xs, int64_t b0,
                                int64_t r1, int64_t v0, const int NV, float *t, int64_t ldt) {
    vf acc[LORA_ROWS][LORA_VECS];
    for (int i = 0; i < LORA_ROWS; i++)
        for (int v = 0; v < NV; v++) acc[i][v] = (vf){0};
    for (int64_t k = 0; k < K; k++) {
        vf w[LORA_VECS];
        /* A^T is streamed once per step from memory, in many short runs (one per adapter,
         * projection and layer): ask for it ahead rather than wait for the prefetcher to
         * find each run */
        __builtin_prefetch(at + (k + LORA_PREFETCH_ROWS) * rp + v0);
        for (int v = 0; v < NV; v++) w[v] = vload(at + k * rp + v0 + v * VW);
        for (int i = 0; i < LORA_ROWS; i++) {
            const vf xv = vsplat(xs[i][k]);
            for (int v = 0; v < NV; v++) acc[i][v] = vfma(xv, w[v], acc[i][v]);
        }
    }
    for (int i = 0; i < LORA_ROWS && b0 + i < r1; i++)
        for (int v = 0; v < NV; v++) vstore(t + (b0 + i) * ldt + v0 + v * VW, acc[i][v]);
}

static void lora_shrink_rows(const TmDelta *d, int64_t K, const float *x, int64_t ldx, int64_t b0, int64_t r1,
                             float *t, int64_t ldt) {
    const float *xs[LORA_ROWS];
    for (int i = 0; i < LORA_ROWS; i++) xs[i] = x + (b0 + i < r1 ? b0 + i : r1 - 1) * ldx;
    for (int64_t v0 = 0; v0 < d->rp; v0 += LORA_VECS * VW) {
        if (d->rp - v0 >= 2 * VW)
            lora_shrink_tile(d->at, d->rp, K, xs, b0, r1, v0, 2, t, ldt);
        else
            lora_shrink_tile(d->at, d->rp, K, xs, b0, r1, v0, 1, t, ldt);
    }
}

/* This thread's share of the shrink of every segment's rows for projection `proj`: groups of
 * LORA_ROWS rows dealt round robin; t[b] is row b's (ldt = the step's largest rank). */
static void lora_shrink(const TmSegment *segs, int64_t n_segs, int64_t li, int proj, int64_t K, const float *x,
                        int64_t ldx, float *t, int64_t ldt, int th, int T) {
    int64_t group = 0;
    for (int64_t s = 0; s < n_segs; s++) {
        const TmDelta *d = &segs[s].deltas[li * LORA_PROJECTIONS + proj];
        if (!d->r) continue;
        for (int64_t b = segs[s].row0; b < segs[s].row1; b += LORA_ROWS, group++)
            if (group % T == th) lora_shrink_rows(d, K, x, ldx, b, segs[s].row1, t, ldt);
    }
}

/* bt's columns in panels of two vectors (the MLP's gate/up tiles, GU_COLS, are one panel):
 * the ranks of a tile's columns are one contiguous block, where B^T's rows would be r streams
 * a row of B apart, more than the hardware prefetcher follows while a tile's rows run. */
#define LORA_PANEL (2 * VW)
TM_INLINE const float *lora_panel(const float *bt, int64_t r, int64_t j, int64_t c) {
    return bt + (c / LORA_PANEL) * r * LORA_PANEL + j * LORA_PANEL + c % LORA_PANEL;
}

/* y[b][c - col0 .. + NV * VW) += sum_j t[b][j] B^T[j0 + j][c ..], j < r, for rows [r0, r1), c a
 * whole vector of a panel (NV = 4: two panels). Two rows at a time share each load of bt, so
 * 2 * NV accumulators run independent FMA chains. Each output's sum runs over j in order
 * whatever the tile, so the tiling never changes a value. */
TM_INLINE void lora_expand_cols(const float *t, int64_t ldt, const float *bt, int64_t R, int64_t j0, int64_t r,
                                int64_t r0, int64_t r1, int64_t c, float *y, int64_t ldy, int64_t col0, const int NV) {
    const float *w0 = lora_panel(bt, R, j0, c), *w1 = NV == 4 ? lora_panel(bt, R, j0, c + 2 * VW) : w0;
    int64_t b = r0;
    for (; b + 2 <= r1; b += 2) {
        float *y0 = y + b * ldy - col0 + c, *y1 = y0 + ldy;
        const float *t0 = t + b * ldt, *t1 = t0 + ldt;
        vf a0[4], a1[4];
        for (int v = 0; v < NV; v++) a0[v] = vload(y0 + v * VW), a1[v] = vload(y1 + v * VW);
        for (int64_t j = 0; j < r; j++) {
            const vf s0 = vsplat(t0[j]), s1 = vsplat(t1[j]);
            for (int v = 0; v < NV; v++) {
                const vf w = vload((v < 2 ? w0 : w1) + j * LORA_PANEL + (v % 2) * VW);
                a0[v] = vfma(s0, w, a0[v]);
                a1[v] = vfma(s1, w, a1[v]);
            }
        }
        for (int v = 0; v < NV; v++) vstore(y0 + v * VW, a0[v]), vstore(y1 + v * VW, a1[v]);
    }
    if (b < r1) {
        float *y0 = y + b * ldy - col0 + c;
        const float *t0 = t + b * ldt;
        vf a0[4];
        for (int v = 0; v < NV; v++) a0[v] = vload(y0 + v * VW);
        for (int64_t j = 0; j < r; j++) {
            const vf s0 = vsplat(t0[j]);
            for (int v = 0; v < NV; v++)
                a0[v] = vfma(s0, vload((v < 2 ? w0 : w1) + j * LORA_PANEL + (v % 2) * VW), a0[v]);
        }
        for (int v = 0; v < NV; v++) vstore(y0 + v * VW, a0[v]);
    }
}

/* y[b][c - col0] += sum_j t[b][j] B^T[j0 + j][c], j < r, for rows [r0, r1) and columns
 * [c0, c1): pairs of panels, one panel, whole vectors, single columns, whichever fits where
 * c stands; a tile's block of bt stays in L1 over the rows. */
static void lora_expand_block(const float *t, int64_t ldt, const float *bt, int64_t R, int64_t j0, int64_t r,
                              int64_t r0, int64_t r1, int64_t c0, int64_t c1, float *y, int64_t ldy,
                              int64_t col0) {
    int64_t c = c0;
    while (c < c1) {
        if (c % LORA_PANEL == 0 && c + 2 * LORA_PANEL <= c1) {
            lora_expand_cols(t, ldt, bt, R, j0, r, r0, r1, c, y, ldy, col0, 4);
            c += 2 * LORA_PANEL;
        } else if (c % LORA_PANEL == 0 && c + LORA_PANEL <= c1) {
            lora_expand_cols(t, ldt, bt, R, j0, r, r0, r1, c, y, ldy, col0, 2);
            c += LORA_PANEL;
        } else if (c % VW == 0 && c + VW <= c1) {
            lora_expand_cols(t, ldt, bt, R, j0, r, r0, r1, c, y, ldy, col0, 1);
            c += VW;
        } else {
            for (int64_t b = r0; b < r1; b++) {
                float sum = y[b * ldy - col0 + c];
                for (int64_t j = 0; j < r; j++) sum += t[b * ldt + j] * *lora_panel(bt, R, j0 + j, c);
                y[b * ldy - col0 + c] = sum;
            }
            c++;
        }
    }
}

/* The updates of columns [c0, c1) of every segment's rows (t from lora_shrink), each part of
 * the projection with its own ranks only. */
static void lora_expand(const TmSegment *segs, int64_t n_segs, int64_t li, int proj, int64_t n, const float *t,
                        int64_t ldt, int64_t c0, int64_t c1, float *y, int64_t ldy, int64_t col0) {
    (void)n;
    for (int64_t s = 0; s < n_segs; s++) {
        const TmDelta *d = &segs[s].deltas[li * LORA_PROJECTIONS + proj];
        for (int64_t p = 0; d->r && p < d->n_parts; p++) {
            const int64_t lo = c0 > d->part[p][0] ? c0 : d->part[p][0];
            const int64_t hi = c1 < d->part[p][1] ? c1 : d->part[p][1];
            const int64_t j0 = d->part[p][2], j1 = d->part[p][3];
            if (lo < hi)
                lora_expand_block(t + j0, ldt, d->bt, d->r, j0, j1 - j0, segs[s].row0, segs[s].row1, lo, hi, y,
                                  ldy, col0);
        }
    }
}

/* This thread's share of a whole projection's output columns (whole vectors where it can). */
TM_INLINE void lora_columns(int64_t N, int t, int T, int64_t *c0, int64_t *c1) {
    const int64_t units = (N + VW - 1) / VW;
    *c0 = units * t / T * VW;
    *c1 = units * (t + 1) / T * VW;
    if (*c1 > N) *c1 = N;
}

/* The segments are rows of this step, in order, with a table each; the largest rank. */
static int64_t check_segments(const TmModel *m, const TmSegment *segs, int64_t n_segs, int64_t B) {
    int64_t rmax = 0, prev = 0;
    if (n_segs && !segs) return -1;
    for (int64_t s = 0; s < n_segs; s++) {
        if (!segs[s].deltas || segs[s].row0 < prev || segs[s].row1 <= segs[s].row0 || segs[s].row1 > B) return -1;
        prev = segs[s].row1;
        for (int64_t i = 0; i < m->num_layers * LORA_PROJECTIONS; i++) {
            const TmDelta *d = &segs[s].deltas[i];
            if (d->r < 0 || (d->r && (!d->at || !d->bt || d->n_parts < 1 || d->n_parts > 3 || d->rp < d->r ||
                                      d->rp % VW)))
                return -1;
            for (int64_t p = 0; d->r && p < d->n_parts; p++)
                if (d->part[p][0] < 0 || d->part[p][1] < d->part[p][0] || d->part[p][2] < 0 ||
                    d->part[p][3] < d->part[p][2] || d->part[p][3] > d->r)
                    return -1;
            if (d->rp > rmax) rmax = d->rp;
        }
    }
    return rmax;
}

int tm_model_step(const TmModel *m, float *x, int64_t B, const int32_t *block_tables, int64_t bt_stride,
                  int64_t bt_width, const int32_t *seq_lens, const int32_t *chunks, int64_t n_chunks,
                  const int32_t *logit_rows, int64_t n_logits, float *logits, const TmSegment *segs,
                  int64_t n_segs, int num_threads) {
    const int64_t H = m->hidden, D = m->head_dim, NQ = m->heads * D, NKV = m->kv_heads * D;
    const int64_t NQKV = NQ + 2 * NKV, I = m->inter, BS = m->block_size;
    const int64_t G = m->heads / m->kv_heads;
    if (B <= 0 || D % VW || D > 512 || D % 2 || m->heads % m->kv_heads || m->cache_fmt < KV_F32 ||
        m->cache_fmt > KV_FP8 || n_chunks < 0 || (n_chunks && !chunks) || G > PF_ROWS)
        return 1;
    const int quant = m->cache_fmt >= KV_I8;
    if (quant && n_chunks) return 1;
    if (quant)
        for (int64_t li = 0; li < m->num_layers; li++)
            if (!m->layers[li].k_scale || !m->layers[li].v_scale) return 1;
    Args check = {0};
    check.block_tables = block_tables, check.seq_lens = seq_lens, check.bt_stride = bt_stride;
    check.heads = m->heads, check.kv_heads = m->kv_heads, check.head_dim = D;
    check.num_blocks = m->num_blocks, check.block_size = BS;
    const int64_t max_len = check_args(&check, B, bt_width);
    if (max_len < 0 || max_len > m->max_positions) return 1;
    if (check_chunks(chunks, n_chunks, B, block_tables, bt_stride, bt_width, seq_lens)) return 1;
    const int64_t n_out = logit_rows ? n_logits : B;
    if (n_out < 0 || n_out > B) return 1;
    for (int64_t i = 0; logit_rows && i < n_out; i++)
        if (logit_rows[i] < 0 || logit_rows[i] >= B) return 1;
    const int64_t rmax = check_segments(m, segs, n_segs, B);
    if (rmax < 0) return 1;

    int64_t n_items = 0, n_slots = 0;
    AttnItem *items = attention_items(m, B, seq_lens, chunks, n_chunks, &n_items, &n_slots);
    /* [B, NQKV | NQ | I] shared, then [B, rmax]: each adapted row's x a^T (lora_shrink), then
     * the parts' results of rows attended in parts */
    const size_t part_floats = (size_t)n_slots * PART_FLOATS(G, D);
    /* and [B, H] for a block's output that is normed before its residual add (Gemma) */
    float *qkv = (float *)aligned_alloc(64, (((size_t)B * (NQKV + NQ + I + rmax + H) + part_floats) * 4 + 63) / 64 * 64);
    /* Per layer, the claim counters of its phases (see claim_chunk), then the head's. */
    enum { PH_QKV, PH_QKV_TAIL, PH_ATTEND, PH_COMBINE, PH_O, PH_GATE_UP, PH_DOWN, PHASES };
    int64_t *work = (int64_t *)calloc((size_t)m->num_layers * PHASES + 1, sizeof(int64_t));
    if (!items || !qkv || !work) {
        free(items);
        free(qkv);
        free(work);
        return 2;
    }
    float *attn = qkv + B * NQKV, *act = attn + B * NQ, *lora_t = act + B * I, *block_out = lora_t + B * rmax;
    float *parts = block_out + B * H;
    if (num_threads < 1) num_threads = 1;
    SpinBarrier bar = {0, 0, num_threads};
    int failed = 0;

#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
#pragma omp single
        bar.n = omp_get_num_threads(); /* the implicit barrier publishes it */
        const int T = bar.n, t = omp_get_thread_num();
        int sense = 0;
        const int64_t KM = max_k(m);
        const size_t att_floats = (size_t)(2 * G * D + G + VW * D + D + G * (max_len < PART_LEN ? max_len : PART_LEN));
        /* int4_q8_tile's / int8_vnni_rows' input (up to two planes of B + 3 rows) and its scales
         * (per 32 columns for up to B + 3 rows: int8g_vnni_rows reads its padding rows' too) */
        const size_t q8_floats = ((size_t)2 * (B + 3) * KM * TM_ACT_BYTES + 3) / 4 + (size_t)(B + 3) * KM / 32;
        const size_t pf_floats = n_chunks ? (PREFILL_SCRATCH_FLOATS(D) + 15) / 16 * 16 : 0;
        const size_t floats = pf_floats + (size_t)B * H + 2 * (size_t)B * KM + 2 * (size_t)B * GU_COLS + att_floats +
                              VW * KM + q8_floats;
        float *buf = (float *)aligned_alloc(64, (floats * 4 + 63) / 64 * 64);
        int ok = buf != NULL;
        /* Every thread must reach every barrier: a failed allocation only skips the work. */
        PrefillScratch ps = {0};
        if (ok && n_chunks) ps = prefill_scratch(buf, D);
        float *h = buf + pf_floats; /* [B, H]: this thread's normed copy of the residual stream */
        InputScratch is = {h + B * H, h + B * H + B * KM};
        float *gate = is.xsum + B * KM, *up = gate + B * GU_COLS; /* [B, GU_COLS]: gate / up rows */
        float *att = up + B * GU_COLS;
        is.wtile = att + att_floats;
        is.xq = (int8_t *)(is.wtile + VW * KM);
        is.xd = is.wtile + VW * KM + ((size_t)2 * (B + 3) * KM * TM_ACT_BYTES + 3) / 4;
        Scratch sc = {0};
        if (ok) {
            float *zero = att + 2 * G * D + G + VW * D;
            memset(zero, 0, D * sizeof(float));
            sc = (Scratch){att, att + G * D, att + 2 * G * D, att + 2 * G * D + G, zero, zero + D, -1, -1};
        }
        Args a = {qkv, NULL, NULL, block_tables, seq_lens, attn, NQKV, NQ, bt_stride,
                  m->heads, m->kv_heads, D, m->num_blocks, BS, m->scale};

        for (int64_t li = 0; li < m->num_layers; li++) {
            const TmLayer *L = &m->layers[li];
            /* 1. q/k/v projection of the normed input; the threads claim its rows. */
            if (ok) {
                for (int64_t b = 0; b < B; b++) rms_norm(x + b * H, L->input_norm, H, m->eps, h + b * H);
                thread_linear(&L->qkv, h, H, B, &is, &work[li * PHASES + PH_QKV], T, qkv, NQKV, 0);
                if (L->qkv_tail.n)
                    thread_linear(&L->qkv_tail, h, H, B, &is, &work[li * PHASES + PH_QKV_TAIL], T, qkv + L->qkv.n,
                                  NQKV, 0);
                if (n_segs) lora_shrink(segs, n_segs, li, LORA_QKV, H, h, H, lora_t, rmax, t, T);
            }
            barrier_wait(&bar, &sense);
            if (n_segs) { /* the adapters' updates once the base output and every x a^T are whole */
                int64_t c0, c1;
                lora_columns(NQKV, t, T, &c0, &c1);
                if (ok) lora_expand(segs, n_segs, li, LORA_QKV, NQKV, lora_t, rmax, c0, c1, qkv, NQKV, 0);
                barrier_wait(&bar, &sense);
            }
            /* 2. per (row, kv head): norms, rotary, K/V into the pool. */
            if (ok) {
                a.k_cache = L->k_cache, a.v_cache = L->v_cache;
                a.k_scale = L->k_scale, a.v_scale = L->v_scale;
                a.window = L->window;
                /* A quantized store may rewrite its block's earlier rows and scale: rows
                 * that share a block (a speculative verify's) go to one thread, in order,
                 * picked by block and head; otherwise items go round robin. */
                for (int64_t it = quant ? 0 : t; it < B * m->kv_heads; it += quant ? 1 : T) {
                    const int64_t b = it / m->kv_heads, kvh = it % m->kv_heads;
                    const int64_t pos = seq_lens[b] - 1;
                    if (quant && (block_tables[b * bt_stride + pos / BS] * m->kv_heads + kvh) % T != t) continue;
                    const float *cs = (L->cos ? L->cos : m->cos) + pos * D;
                    const float *sn = (L->sin ? L->sin : m->sin) + pos * D;
                    float *row = qkv + b * NQKV;
                    for (int64_t gq = 0; gq < G; gq++) {
                        float *q = row + (kvh * G + gq) * D;
                        if (L->q_norm) rms_norm(q, L->q_norm, D, m->eps, q);
                        rope_head(q, cs, sn, D);
                    }
                    float *k = row + NQ + kvh * D, *v = row + NQ + NKV + kvh * D;
                    if (L->k_norm) rms_norm(k, L->k_norm, D, m->eps, k);
                    rope_head(k, cs, sn, D);
                    const int32_t *table = block_tables + b * bt_stride;
                    const size_t slot = (size_t)table[pos / BS] * BS + pos % BS;
                    if (quant) {
                        const size_t head = (size_t)kvh * m->num_blocks;
                        const int64_t blk = table[pos / BS], fp8 = m->cache_fmt == KV_FP8;
                        store_quant((uint8_t *)L->k_cache + head * BS * D, L->k_scale + head, blk, BS, D,
                                    pos % BS, 1, k, D, 0, (int)fp8);
                        store_quant((uint8_t *)L->v_cache + head * BS * D, L->v_scale + head, blk, BS, D,
                                    pos % BS, 1, v, D, 0, (int)fp8);
                        continue;
                    }
                    const size_t off = ((size_t)kvh * m->num_blocks * BS + slot) * D;
                    store_row(L->k_cache, m->cache_fmt == KV_BF16, off, k, D);
                    store_row(L->v_cache, m->cache_fmt == KV_BF16, off, v, D);
                }
            }
            /* Every row's K/V is in the pool before anyone attends. */
            barrier_wait(&bar, &sense);
            /* 3. attention: the threads claim the step's items (attention_items). */
            if (ok) {
                int64_t it, end;
                while ((it = claim_chunk(&work[li * PHASES + PH_ATTEND], n_items, T, 1, &end)) >= 0)
                    for (; it < end; it++) {
                        const AttnItem *ai = &items[it];
                        if (ai->chunk < 0) {
                            const int64_t P = item_parts(&a, ai->index); /* under this layer's window */
                            if (ai->part >= P) continue;
                            if (P > 1) {
                                int64_t p0, p1;
                                part_range(&a, ai->index, ai->part, &p0, &p1);
                                attend_range(&a, ai->index, ai->kvh, m->cache_fmt, 0, &sc, p0, p1,
                                             parts + (size_t)ai->slot * PART_FLOATS(G, D));
                                continue;
                            }
                            const AttnItem *nx = it + 1 < end && items[it + 1].chunk < 0 && items[it + 1].part == 0
                                                     ? &items[it + 1] : NULL;
                            sc.next_item = nx ? (int64_t)nx->index * m->kv_heads + nx->kvh : -1;
                            attend_dispatch(&a, ai->index, ai->kvh, m->cache_fmt, 0, &sc);
                            continue;
                        }
                        const int64_t first = chunks[2 * ai->chunk], count = chunks[2 * ai->chunk + 1];
                        const int64_t last = first + count - 1, per_block = PF_ROWS / G;
                        const int64_t p0 = (int64_t)ai->index * per_block;
                        const PrefillArgs pa = {qkv + first * NQKV, L->k_cache, L->v_cache,
                                                block_tables + last * bt_stride, attn + first * NQ, NQKV, NQ,
                                                m->heads, m->kv_heads, D, m->num_blocks, BS, seq_lens[last], count,
                                                m->scale, L->k_scale, L->v_scale, L->window};
                        prefill_dispatch(&pa, ai->kvh, p0, count - p0 < per_block ? count - p0 : per_block,
                                         m->cache_fmt, 0, &ps);
                    }
            }
            barrier_wait(&bar, &sense);
            /* 3b. rows attended in parts under this layer's window: their parts combined. */
            a.window = L->window; /* (every thread decides alike, allocation failed or not) */
            if (n_slots && layer_has_parts(&a, items, n_items)) {
                if (ok) {
                    int64_t it, end;
                    while ((it = claim_chunk(&work[li * PHASES + PH_COMBINE], n_items, T, 1, &end)) >= 0)
                        for (; it < end; it++) {
                            const AttnItem *ai = &items[it];
                            if (ai->chunk >= 0 || ai->part != 0) continue;
                            const int64_t P = item_parts(&a, ai->index);
                            if (P > 1)
                                combine_parts(&a, ai->index, ai->kvh, parts + (size_t)ai->slot * PART_FLOATS(G, D), P,
                                              0, sc.acc);
                        }
                }
                barrier_wait(&bar, &sense);
            }
            /* 4. o projection, added into the residual stream (or, where the layer norms the
             * block's output first, written out, normed and added: normed_add). */
            float *o_out = L->attn_out_norm ? block_out : x;
            if (ok) {
                thread_linear(&L->o, attn, NQ, B, &is, &work[li * PHASES + PH_O], T, o_out, H, !L->attn_out_norm);
                if (n_segs) lora_shrink(segs, n_segs, li, LORA_O, NQ, attn, NQ, lora_t, rmax, t, T);
            }
            barrier_wait(&bar, &sense);
            if (n_segs) {
                int64_t c0, c1;
                lora_columns(H, t, T, &c0, &c1);
                if (ok) lora_expand(segs, n_segs, li, LORA_O, H, lora_t, rmax, c0, c1, o_out, H, 0);
                barrier_wait(&bar, &sense);
            }
            if (L->attn_out_norm) {
                if (ok) normed_add(x, block_out, L->attn_out_norm, B, H, m->eps, t, T);
                barrier_wait(&bar, &sense);
            }
            /* 5. gate and up rows of the same features on the same thread, then SiLU(gate) * up. */
            if (ok) {
                for (int64_t b = 0; b < B; b++) rms_norm(x + b * H, L->post_norm, H, m->eps, h + b * H);
                if (n_segs) lora_shrink(segs, n_segs, li, LORA_GATE_UP, H, h, H, lora_t, rmax, t, T);
            }
            if (n_segs) barrier_wait(&bar, &sense); /* every adapted row's h a^T before a tile adds its share */
            if (ok) {
                int64_t ldx, n0, n1;
                const float *xin = prepare_input(&L->gate_up, h, H, B, &is, &ldx);
                while (claim_rows(&work[li * PHASES + PH_GATE_UP], I, T, &n0, &n1))
                    for (int64_t c0 = n0; c0 < n1; c0 += GU_COLS) {
                        const int64_t c1 = c0 + GU_COLS < n1 ? c0 + GU_COLS : n1;
                        /* rows c0..c1 of gate, and of up (I rows further), as [B, GU_COLS] */
                        linear_rows(&L->gate_up, xin, ldx, &is, B, c0, c1, gate, GU_COLS, 0, c0);
                        linear_rows(&L->gate_up, xin, ldx, &is, B, I + c0, I + c1, up, GU_COLS, 0, I + c0);
                        if (n_segs) {
                            lora_expand(segs, n_segs, li, LORA_GATE_UP, 2 * I, lora_t, rmax, c0, c1, gate, GU_COLS,
                                        c0);
                            lora_expand(segs, n_segs, li, LORA_GATE_UP, 2 * I, lora_t, rmax, I + c0, I + c1, up,
                                        GU_COLS, I + c0);
                        }
                        for (int64_t b = 0; b < B; b++)
                            if (m->act == ACT_GELU_TANH)
                                gelu_tanh_mul(gate + b * GU_COLS, up + b * GU_COLS, act + b * I + c0, c1 - c0);
                            else
                                silu_mul(gate + b * GU_COLS, up + b * GU_COLS, act + b * I + c0, c1 - c0);
                    }
            }
            barrier_wait(&bar, &sense);
            /* 6. down projection, added into the residual stream (normed first where the layer says). */
            float *down_out = L->mlp_out_norm ? block_out : x;
            if (ok) {
                thread_linear(&L->down, act, I, B, &is, &work[li * PHASES + PH_DOWN], T, down_out, H,
                              !L->mlp_out_norm);
                if (n_segs) lora_shrink(segs, n_segs, li, LORA_DOWN, I, act, I, lora_t, rmax, t, T);
            }
            barrier_wait(&bar, &sense);
            if (n_segs) {
                int64_t c0, c1;
                lora_columns(H, t, T, &c0, &c1);
                if (ok) lora_expand(segs, n_segs, li, LORA_DOWN, H, lora_t, rmax, c0, c1, down_out, H, 0);
                barrier_wait(&bar, &sense);
            }
            if (L->mlp_out_norm) {
                if (ok) normed_add(x, block_out, L->mlp_out_norm, B, H, m->eps, t, T);
                barrier_wait(&bar, &sense);
            }
        }
        /* Final norm of the rows whose logits are wanted (every thread its own copy) and the head. */
        if (ok && n_out > 0) {
            for (int64_t i = 0; i < n_out; i++)
                rms_norm(x + (logit_rows ? logit_rows[i] : i) * H, m->final_norm, H, m->eps, h + i * H);
            thread_linear(&m->head, h, H, n_out, &is, &work[m->num_layers * PHASES], T, logits, m->head.n, 0);
        }
        free(buf);
        failed = !ok;
    }
    free(items);
    free(work);
    free(qkv);
    return failed ? 2 : 0;
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

/* Lets the loader check that the struct layouts match. */
int64_t tm_decode_struct_sizes(void) {
    return (int64_t)sizeof(TmLinear) * 1000000 + (int64_t)sizeof(TmLayer) * 1000 + (int64_t)sizeof(TmModel);
}
