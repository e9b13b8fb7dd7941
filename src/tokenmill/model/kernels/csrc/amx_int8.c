/* int8 x int8 matmuls on AMX tiles (Intel's Advanced Matrix Extensions), for many
 * activation rows.
 *
 * Included by int8.c after its VNNI kernels' definitions (TmLinear, the
 * VNNI packing, the shared epilogues int8_store_row, int8g_add_group and int8g_store_row) and only
 * in builds whose compiler targets AMX-INT8 (-march=native on such a CPU).
 *
 * Why: a VNNI dot product does 64 multiply-adds per instruction; one tdpbusd
 * does 16 x 16 x 64 = 16,384 of them in 16 cycles, four times the vector units'
 * peak, and prefill or a batch-64 decode step spends most of its time in these
 * matmuls. The integer sums are exact either way (u8 x s8 into int32, no
 * saturation), and the float epilogue is the VNNI path's own inline function, so
 * a row's result is the same bit for bit whichever unit computed its sums and
 * however many rows shared the call.
 *
 * The VNNI packing ([n / 16][k / 4][16][4] bytes) is already the AMX B-operand
 * layout: 64 inputs of one 16-row weight tile are 16 rows of 64 contiguous bytes.
 * The activations (u8 codes, x + 128, one row per token) are the A operand at a
 * row stride of k bytes. Each pass computes a 32 x 32 block of outputs (rows x
 * weight rows) in four accumulator tiles (tmm0-3) from two A tiles (tmm4-5) and
 * two B tiles (tmm6-7).
 *
 * Tiles need the kernel's permission once per process (arch_prctl with
 * XFEATURE_XTILEDATA): tm_kernels_amx_init asks for it, and until it has
 * succeeded every caller takes the VNNI path.
 */
#include "tm_kernels.h"
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_MIN_ROWS 16 /* activation rows from which a matmul goes to the tiles */
#define AMX_CHUNK_ROWS 128 /* activation rows that meet every weight tile before the next ones do: their
                            * codes stay in L1/L2 while the outputs they write stream out */
#define AMX_ARCH_REQ_XCOMP_PERM 0x1023
#define AMX_XFEATURE_XTILEDATA 18

static int tm_amx_ready; /* set once by tm_kernels_amx_init */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} AmxConfig;

/* Every tile 16 rows; k_bytes columns (bytes) for the A tiles and k_bytes / 4 rows
 * for the B tiles: 64 for int8 layers (a whole tile's depth), 32 for int8g layers
 * (one scale group). */
TM_INLINE void amx_configure(int k_bytes) {
    AmxConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.colsb[t] = 64, c.rows[t] = 16;
    for (int t = 4; t < 6; t++) c.colsb[t] = (uint16_t)k_bytes;
    for (int t = 6; t < 8; t++) c.rows[t] = (uint8_t)(k_bytes / 4);
    _tile_loadconfig(&c);
}

/* The int32 sums of one 32-row (MR 2) or 16-row (MR 1) block of activation rows
 * against one or two weight tiles over inputs [k0, k1): sums[t][r] lane i =
 * row r . weight row i of tile t. xa: the block's first row, w0/w1 the tiles' packed
 * codes. The tiles must be configured for k_step bytes (amx_configure). */
TM_INLINE void amx_sums(const uint8_t *xa, int64_t K, const int8_t *w0, const int8_t *w1, int64_t k0, int64_t k1,
                        int64_t k_step, const int NT, const int MR, int32_t sums[2][32][16]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = k0; k < k1; k += k_step) {
        _tile_loadd(4, xa + k, K);
        _tile_loadd(6, w0 + k * 16, 64);
        _tile_dpbusd(0, 4, 6);
        if (NT > 1) {
            _tile_loadd(7, w1 + k * 16, 64);
            _tile_dpbusd(1, 4, 7);
        }
        if (MR > 1) {
            _tile_loadd(5, xa + 16 * K + k, K);
            _tile_dpbusd(2, 5, 6);
            if (NT > 1) _tile_dpbusd(3, 5, 7);
        }
    }
    _tile_stored(0, sums[0][0], 64);
    if (NT > 1) _tile_stored(1, sums[1][0], 64);
    if (MR > 1) {
        _tile_stored(2, sums[0][16], 64);
        if (NT > 1) _tile_stored(3, sums[1][16], 64);
    }
}

#define AMX_SUMS_CASES(XA, K0, K1, STEP, SUMS)                                                             \
    if (NT == 2 && MR == 2)                                                                                \
        amx_sums(XA, K, w0, w1, K0, K1, STEP, 2, 2, SUMS);                                                 \
    else if (NT == 2)                                                                                      \
        amx_sums(XA, K, w0, w1, K0, K1, STEP, 2, 1, SUMS);                                                 \
    else if (MR == 2)                                                                                      \
        amx_sums(XA, K, w0, w1, K0, K1, STEP, 1, 2, SUMS);                                                 \
    else                                                                                                   \
        amx_sums(XA, K, w0, w1, K0, K1, STEP, 1, 1, SUMS);

/* int8_vnni_rows' work on the tiles for the first rows of the batch, a multiple of
 * 16 (the caller's VNNI loop takes the rest): rows [n0, n1) of an int8 layer (whole
 * weight tiles), from the same quantized planes. Returns how many activation rows
 * it did. */
static int64_t int8_amx_rows(const TmLinear *L, int bits, const uint8_t *xq, const float *xd, int64_t B, int64_t n0,
                             int64_t n1, float *y, int64_t ldy, int accumulate, int64_t y_col0) {
    const int64_t K = L->k, Bp = (B + 3) / 4 * 4, planes = bits == 16 ? 2 : 1, rows = B / 16 * 16;
    if (!tm_amx_ready || B < AMX_MIN_ROWS || K % 64) return 0;
    int32_t sums[2][2][32][16] __attribute__((aligned(64))); /* [plane][tile][row][lane] */
    amx_configure(64);
    for (int64_t c0 = 0; c0 < rows; c0 += AMX_CHUNK_ROWS)
    for (int64_t tile = n0 / VW; tile < n1 / VW;) {
        const int NT = tile + 1 < n1 / VW ? 2 : 1;
        const int8_t *w0 = L->packed + tile * K * VW, *w1 = w0 + K * VW;
        const int64_t c1 = c0 + AMX_CHUNK_ROWS < rows ? c0 + AMX_CHUNK_ROWS : rows;
        for (int64_t b0 = c0; b0 < c1; b0 += 32) {
            const int MR = c1 - b0 >= 32 ? 2 : 1;
            for (int64_t p = 0; p < planes; p++) {
                const uint8_t *xa = xq + (p * Bp + b0) * K;
                AMX_SUMS_CASES(xa, 0, K, 64, sums[p])
            }
            for (int t = 0; t < NT; t++)
                for (int b = 0; b < 16 * MR; b++) {
                    vi hi, lo = {0};
                    memcpy(&hi, sums[0][t][b], sizeof hi);
                    if (planes == 2) memcpy(&lo, sums[1][t][b], sizeof lo);
                    int8_store_row(L, (int)planes, (tile + t) * VW, hi, lo, xd[b0 + b], y + (b0 + b) * ldy - y_col0,
                                   accumulate);
                }
        }
        tile += NT;
    }
    _tile_release();
    return rows;
}

/* The same for an int8g layer (a scale per 32 inputs): one scale group a pass over
 * the tiles (configured 32 bytes deep), each group's int32 sums become float32 through
 * the VNNI path's own step (int8g_add_group) before the next group. */
static int64_t int8g_amx_rows(const TmLinear *L, int bits, const uint8_t *xq, const float *xd, int64_t B,
                              int64_t n0, int64_t n1, float *y, int64_t ldy, int accumulate, int64_t y_col0) {
    const int64_t K = L->k, G = K / 32, Bp = (B + 3) / 4 * 4, rows = B / 16 * 16;
    const int two = bits == 16;
    if (!tm_amx_ready || B < AMX_MIN_ROWS) return 0;
    int32_t sums[2][2][32][16] __attribute__((aligned(64))); /* [plane][tile][row][lane] */
    vf f[2][32];
    amx_configure(32);
    for (int64_t tile = n0 / VW; tile < n1 / VW;) {
        const int NT = tile + 1 < n1 / VW ? 2 : 1;
        const int8_t *w0 = L->packed + tile * K * VW, *w1 = w0 + K * VW;
        for (int64_t b0 = 0; b0 < rows; b0 += 32) {
            const int MR = rows - b0 >= 32 ? 2 : 1;
            const uint8_t *xh = xq + b0 * K, *xl = xq + (Bp + b0) * K;
            for (int t = 0; t < NT; t++)
                for (int b = 0; b < 16 * MR; b++) f[t][b] = (vf){0};
            for (int64_t g = 0; g < G; g++) {
                AMX_SUMS_CASES(xh, g * 32, g * 32 + 32, 32, sums[0])
                if (two) {
                    AMX_SUMS_CASES(xl, g * 32, g * 32 + 32, 32, sums[1])
                }
                for (int t = 0; t < NT; t++) {
                    const int64_t tg = (tile + t) * G + g;
                    vi start;
                    memcpy(&start, L->row_sums + tg * VW, sizeof start);
                    const vf dsv = vload(L->scale + tg * VW);
                    for (int b = 0; b < 16 * MR; b++) {
                        vi h, l = {0};
                        memcpy(&h, sums[0][t][b], sizeof h);
                        if (two) memcpy(&l, sums[1][t][b], sizeof l);
                        f[t][b] = int8g_add_group(f[t][b], h + start, l, two, dsv, two ? 0.0f : xd[(b0 + b) * G + g]);
                    }
                }
            }
            for (int t = 0; t < NT; t++)
                for (int b = 0; b < 16 * MR; b++)
                    int8g_store_row(L, bits, (tile + t) * VW, f[t][b], xd[b0 + b], y + (b0 + b) * ldy - y_col0,
                                    accumulate);
        }
        tile += NT;
    }
    _tile_release();
    return rows;
}
#undef AMX_SUMS_CASES

/* With `want`, asks the kernel for the tiles' state (once per process; repeat calls
 * are cheap) and uses them from then on; without, goes back to the VNNI path (tests
 * compare the two in one library). Returns whether the tiles are in use. */
int tm_kernels_amx_init(int want) {
    if (!want)
        tm_amx_ready = 0;
    else if (!tm_amx_ready && syscall(SYS_arch_prctl, AMX_ARCH_REQ_XCOMP_PERM, AMX_XFEATURE_XTILEDATA) == 0)
        tm_amx_ready = 1;
    return tm_amx_ready;
}
