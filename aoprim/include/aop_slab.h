/*
 * aop_slab.h -- the C core of SlabPool: one aligned arena cut into fixed-size slots, and a
 * lock-free ring of free slot indices.  Usable without the GIL and without any Python object.
 *
 * Free ring: Dmitry Vyukov's bounded MPMC queue (as crossbeam's ArrayQueue) holding slot
 * indices.  `deq` and `enq` are 64-bit positions that only grow; cell p & mask carries a
 * sequence number `seq` saying which lap it is on: seq == p means "empty, ready for the
 * enqueue at position p", seq == p + 1 means "full, ready for the dequeue at position p".
 * A thread claims a position with a CAS on deq/enq, then moves the data and publishes the
 * cell with a release store of seq.  One locked instruction per acquire and per release; the
 * number of free slots is enq - deq, read for free (no counter to maintain).
 *
 * Why it is ABA-safe.  Positions never repeat: a thread holding a stale position fails its
 * CAS because the position has moved on, and a cell's seq names the exact position (not just
 * the index) it serves, so a thread that read a cell on an earlier lap sees a mismatch.  A
 * position repeats only after 2^64 operations -- never.  Nothing is freed while the pool
 * lives (indices, not pointers).
 *
 * Capacity is the power of two >= nslots, and each index is in the ring at most once, so an
 * enqueue always finds room; a dequeue that meets a cell whose enqueue is claimed but not yet
 * published (the enqueuer is between its CAS and its store) waits for it with a pause/yield
 * backoff instead of reporting "empty" -- so acquire fails only when every slot is held.
 *
 * Invariants
 *  - every index 0 <= i < nslots is either in the ring exactly once or held by exactly one
 *    owner (a Python Slot, or C code that called aop_slab_acquire);
 *  - only the owner of i writes slot i's bytes; the enqueue that gives i back publishes with
 *    a release store and the dequeue that takes it reads seq with acquire, so the next owner
 *    sees every write of the previous one;
 *  - free == enq - deq, 0 <= free <= nslots (exact when quiescent; a snapshot otherwise);
 *    failed counts acquires that found no free slot; high_water only grows.  It is exact
 *    single-threaded and whenever the pool ran dry (then it is nslots); with concurrent
 *    acquires it is a lower bound, because in-use is derived from two positions read one
 *    after the other rather than kept in a counter (which would cost two more locked
 *    instructions per acquire/release);
 *  - busy[i] == 1 exactly while i is held by C code (aop_slab_acquire .. aop_slab_release);
 *    Python Slots do not use it, so C code can never release an index a Slot holds.
 *
 * Layout: deq and enq each sit alone in a 128-byte block (acquirers and releasers are often
 * different threads); the statistics and read-only fields on their own lines.
 */
#ifndef AOP_SLAB_H
#define AOP_SLAB_H


#ifndef AOP_FUNC
/* A helper defined in this header: static, and unused in a module that does not call it
 * (no -Wunused-function warning in a cimporting extension). */
#define AOP_FUNC static __attribute__((unused))
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <unistd.h>
#include "aop_atomic.h"

#define AOP_SLAB_MAX_SLOTS ((int64_t)1 << 30)

/* A Python Slot's state word (see aoprim/_slab.pyx): references, a DEFER flag, views. */
#define AOP_SLOT_REF_MASK ((int64_t)0x7FFFFFFF)
#define AOP_SLOT_DEFER ((int64_t)0x80000000)
#define AOP_SLOT_VIEW_ONE ((int64_t)1 << 32)

typedef struct {
    uint64_t seq;         /* lap stamp (see the top of the file); atomic access only */
    uint64_t value;       /* the slot index held by this cell while full */
} aop_slab_cell_t;

typedef struct {
    aop_atomic_i64 deq;         /* next position to dequeue (acquire) */
    char _pad0[AOP_CACHE_LINE - sizeof(aop_atomic_i64)];
    aop_atomic_i64 enq;         /* next position to enqueue (release) */
    char _pad1[AOP_CACHE_LINE - sizeof(aop_atomic_i64)];
    aop_atomic_i64 high_water;  /* most slots ever held at once (statistics) */
    aop_atomic_i64 failed;      /* acquires that found no free slot (statistics) */
    char _pad2[AOP_CACHE_LINE - 2 * sizeof(aop_atomic_i64)];
    /* ---- read-only after aop_slab_new ---- */
    char *arena;                /* slot i starts at arena + i * stride */
    int64_t slot_size;          /* usable bytes per slot */
    int64_t stride;             /* distance between slots: slot_size rounded up to align */
    int64_t nslots;             /* number of slots */
    int64_t align;              /* alignment of the arena and of every slot (64 or a page) */
    uint64_t mask;              /* ring capacity - 1 (capacity: power of two >= nslots) */
    aop_slab_cell_t *cells;     /* the ring */
    aop_atomic_u32 *busy;       /* busy[i]: 1 while C code holds index i */
} aop_slab_t;

/* Free slots now (a snapshot). */
AOP_INLINE int64_t aop_slab_free_count(aop_slab_t *s)
{
    /* relaxed: a statistic; deq first so that a concurrent acquire can only lower the result */
    int64_t d = aop_load_i64(&s->deq, AOP_RELAXED);
    int64_t e = aop_load_i64(&s->enq, AOP_RELAXED);
    int64_t f = e - d;
    return f < 0 ? 0 : (f > s->nslots ? s->nslots : f);
}

/* Dequeue a free index, or -1 when every slot is held. */
AOP_INLINE int64_t aop_slab_pop(aop_slab_t *s)
{
    uint64_t pos = (uint64_t)aop_load_i64(&s->deq, AOP_RELAXED);   /* relaxed: a guess, see CAS */
    int spins = 0;
    for (;;) {
        aop_slab_cell_t *c = &s->cells[pos & s->mask];
        /* acquire: pairs with the release store of seq by the enqueuer of this cell, so its
         * value -- and every write the previous owner made to the slot -- is visible */
        uint64_t seq = __atomic_load_n(&c->seq, __ATOMIC_ACQUIRE);
        int64_t dif = (int64_t)(seq - (pos + 1));
        if (dif == 0) {
            /* relaxed CAS: claiming the position publishes nothing; the data is ordered by
             * seq (acquire above, release below) */
            if (aop_cas_weak_i64(&s->deq, (int64_t *)&pos, (int64_t)(pos + 1),
                                 AOP_RELAXED, AOP_RELAXED)) {
                uint64_t v = c->value;
                /* release: the cell is free for the enqueue one lap later (pairs with the
                 * acquire load of seq in aop_slab_push) */
                __atomic_store_n(&c->seq, pos + s->mask + 1, __ATOMIC_RELEASE);
                return (int64_t)v;
            }
        } else if (dif < 0) {
            /* not published.  relaxed: enq == pos means nothing was even claimed: empty */
            if ((uint64_t)aop_load_i64(&s->enq, AOP_RELAXED) == pos) return -1;
            /* an enqueue is between its CAS and its store: wait for it (backoff) */
            if (++spins < 64) aop_cpu_relax(); else aop_yield();
            pos = (uint64_t)aop_load_i64(&s->deq, AOP_RELAXED);   /* relaxed: a guess */
        } else {
            pos = (uint64_t)aop_load_i64(&s->deq, AOP_RELAXED);   /* lost a race: retry */
        }
    }
}

/* Enqueue index i (which the caller owns and gives up). */
AOP_INLINE void aop_slab_push(aop_slab_t *s, uint64_t i)
{
    uint64_t pos = (uint64_t)aop_load_i64(&s->enq, AOP_RELAXED);   /* relaxed: a guess, see CAS */
    int spins = 0;
    for (;;) {
        aop_slab_cell_t *c = &s->cells[pos & s->mask];
        /* acquire: pairs with the dequeuer's release store, so its read of value is done */
        uint64_t seq = __atomic_load_n(&c->seq, __ATOMIC_ACQUIRE);
        int64_t dif = (int64_t)(seq - pos);
        if (dif == 0) {
            /* relaxed CAS: claiming the position; the data is published by seq below */
            if (aop_cas_weak_i64(&s->enq, (int64_t *)&pos, (int64_t)(pos + 1),
                                 AOP_RELAXED, AOP_RELAXED)) {
                c->value = i;
                /* release: value and the slot's bytes become visible to the dequeuer that
                 * reads seq == pos + 1 with acquire */
                __atomic_store_n(&c->seq, pos + 1, __ATOMIC_RELEASE);
                return;
            }
        } else if (dif < 0) {
            /* the dequeue one lap earlier is between its CAS and its store (the ring is never
             * full: capacity >= nslots > entries): wait for it */
            if (++spins < 64) aop_cpu_relax(); else aop_yield();
            pos = (uint64_t)aop_load_i64(&s->enq, AOP_RELAXED);
        } else {
            pos = (uint64_t)aop_load_i64(&s->enq, AOP_RELAXED);   /* lost a race: retry */
        }
    }
}

/* Note a successful pop in the statistics (high water). */
AOP_INLINE void aop_slab_note_acquire(aop_slab_t *s)
{
    int64_t used = s->nslots - aop_slab_free_count(s);
    int64_t hw = aop_load_i64(&s->high_water, AOP_RELAXED);      /* relaxed: a statistic */
    /* relaxed CAS-max: a statistic; the loop only runs when a new maximum is reached */
    while (used > hw && !aop_cas_weak_i64(&s->high_water, &hw, used, AOP_RELAXED, AOP_RELAXED)) {}
}

/* Python path: take a free index for a Slot (-1: none free, counted as failed). */
AOP_INLINE int64_t aop_slab_take(aop_slab_t *s)
{
    int64_t i = aop_slab_pop(s);
    if (i < 0) {
        aop_fetch_add_i64(&s->failed, 1, AOP_RELAXED);   /* relaxed: a statistic */
        /* the ring was empty: at that instant every slot was held (exact high water) */
        if (aop_load_i64(&s->high_water, AOP_RELAXED) != s->nslots)   /* relaxed: statistic */
            aop_store_i64(&s->high_water, s->nslots, AOP_RELAXED);
        return -1;
    }
    aop_slab_note_acquire(s);
    return i;
}

/* C API: take a free slot and mark it held by C code: its index, or -1 when none is free. */
AOP_INLINE int64_t aop_slab_acquire(aop_slab_t *s)
{
    int64_t i = aop_slab_take(s);
    /* relaxed: we own i exclusively (the pop); only aop_slab_release's exchange reads it */
    if (i >= 0) aop_store_u32(&s->busy[i], 1, AOP_RELAXED);
    return i;
}

/* C API: give back slot i, which C code holds.  0 on success; -1 if i is out of range or not
 * held by C code (a double release is detected and changes nothing). */
AOP_INLINE int aop_slab_release(aop_slab_t *s, int64_t i)
{
    if (i < 0 || i >= s->nslots) return -1;
    /* relaxed exchange: RMWs on one word are totally ordered, so of two racing releases of
     * the same index exactly one sees 1; the data hand-over is ordered by the push */
    if (aop_exchange_u32(&s->busy[i], 0, AOP_RELAXED) != 1) return -1;
    aop_slab_push(s, (uint64_t)i);
    return 0;
}

/* The first byte of slot i (no check). */
AOP_INLINE char *aop_slab_ptr(aop_slab_t *s, int64_t i) { return s->arena + i * s->stride; }

/* Allocate a pool.  Returns NULL with *err = EINVAL (bad sizes) or ENOMEM.
 * Alignment: a page for slots of at least a page (each slot then starts on a page), else 64
 * bytes (each slot starts on its own cache line; no false sharing between neighbours). */
AOP_FUNC aop_slab_t *aop_slab_new(int64_t slot_size, int64_t nslots, int *err)
{
    aop_slab_t *s = NULL;
    void *arena = NULL, *mem = NULL;
    int64_t page = (int64_t)sysconf(_SC_PAGESIZE), align, stride, i;
    uint64_t cap;
    if (page <= 0) page = 4096;
    *err = EINVAL;
    if (slot_size < 1 || nslots < 1 || nslots > AOP_SLAB_MAX_SLOTS) return NULL;
    align = slot_size >= page ? page : 64;
    if (slot_size > INT64_MAX / 2) return NULL;
    stride = (slot_size + align - 1) / align * align;
    if (stride > INT64_MAX / nslots || stride * nslots > (int64_t)(SIZE_MAX / 2)) {
        *err = ENOMEM;
        return NULL;
    }
    *err = ENOMEM;
    if (posix_memalign(&mem, AOP_CACHE_LINE, sizeof(aop_slab_t)) != 0) return NULL;
    s = (aop_slab_t *)mem;
    memset(s, 0, sizeof(*s));
    if (posix_memalign(&arena, (size_t)align, (size_t)(stride * nslots)) != 0) { free(s); return NULL; }
    for (cap = 1; cap < (uint64_t)nslots; cap <<= 1) {}
    s->cells = (aop_slab_cell_t *)calloc((size_t)cap, sizeof(aop_slab_cell_t));
    s->busy = (aop_atomic_u32 *)calloc((size_t)nslots, sizeof(aop_atomic_u32));
    if (s->cells == NULL || s->busy == NULL) {
        free(s->cells); free(s->busy); free(arena); free(s); return NULL;
    }
    s->mask = cap - 1;
    s->arena = (char *)arena;
    s->slot_size = slot_size;
    s->stride = stride;
    s->nslots = nslots;
    s->align = align;
    /* relaxed: not yet shared with any other thread.  Cell p starts empty for lap 0
     * (seq = p), then indices 0..n-1 are enqueued in order: 0 is handed out first */
    for (i = 0; i < (int64_t)cap; i++) __atomic_store_n(&s->cells[i].seq, (uint64_t)i, __ATOMIC_RELAXED);
    aop_store_i64(&s->deq, 0, AOP_RELAXED);
    aop_store_i64(&s->enq, 0, AOP_RELAXED);
    for (i = 0; i < nslots; i++) aop_slab_push(s, (uint64_t)i);
    *err = 0;
    return s;
}

/* Free a pool.  The caller guarantees nobody uses it any more. */
AOP_FUNC void aop_slab_destroy(aop_slab_t *s)
{
    if (s == NULL) return;
    free(s->cells);
    free(s->busy);
    free(s->arena);
    free(s);
}

#endif /* AOP_SLAB_H */
