/* Greedy sampling on CPU: the index of each row's largest logit.
 *
 * torch.argmax's CPU index-tracking reduction is not vectorized, so over a
 * batch of vocabulary-wide rows it costs many times a vectorized max of the
 * same rows (docs/performance.md). Here each row is
 * cut into blocks of ARGMAX_BLOCK floats: a vectorized max (and NaN test) per
 * block keeps the first block holding the row's maximum; one scalar scan of
 * that block then finds the index.
 *
 * Same answer as torch.argmax: the first index among equal maxima, and a NaN
 * counts as larger than everything (the first NaN's index wins); a row of
 * -inf gives 0. Part of the library's one unit (kernels.c).
 */
#include "tm_kernels.h"

#define ARGMAX_BLOCK 256

static int64_t argmax_row(const float *x, int64_t n) {
    float best = -INFINITY;
    int64_t best_block = 0;
    for (int64_t b = 0; b < n; b += ARGMAX_BLOCK) {
        const int64_t len = n - b < ARGMAX_BLOCK ? n - b : ARGMAX_BLOCK;
        const float *p = x + b;
        float m = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t i = 0; i < len; i++) {
            m = p[i] > m ? p[i] : m;
            nan |= p[i] != p[i];
        }
        if (nan) { /* the first NaN of the row is in this block */
            for (int64_t i = 0; i < len; i++)
                if (p[i] != p[i]) return b + i;
        }
        if (m > best) {
            best = m;
            best_block = b;
        }
    }
    const float *p = x + best_block;
    for (int64_t i = 0; best_block + i < n; i++)
        if (p[i] == best) return best_block + i;
    return 0; /* every entry is -inf */
}

/* out[r] = argmax of row r of x (`rows` rows of `cols` floats, `row_stride` apart). */
int tm_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t row_stride, int64_t *out,
                   int num_threads) {
    if (rows < 0 || cols < 1 || row_stride < cols) return 1;
    /* below ~256K floats a second thread costs more than it saves */
    const int threads = rows * cols < (1 << 18) ? 1 : threads_for(num_threads, rows);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * row_stride, cols);
    return 0;
}
