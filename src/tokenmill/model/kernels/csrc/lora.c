/* LoRA adapters in the fused step: x A^T for a segment's rows (lora_shrink), then each
 * projection's output columns += that times B (lora_expand); check_segments. */
#include "tm_kernels.h"

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
