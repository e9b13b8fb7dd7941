/* The threads of a fused step or a projection: the spin barrier they meet at, and the
 * claims by which they share out a matmul's output tiles and the attention items. */
#include "tm_kernels.h"


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
