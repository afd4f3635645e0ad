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
 * Stash: AOP_SLAB_STASH words, each alone on its cache line, each holding at most one free
 * index; a thread uses the word its pthread_self() hashes to.  A give-back goes to the
 * thread's word when it is empty, else to the ring; an acquire takes the thread's word first,
 * then the ring, then any other word.  So a thread that acquires and releases in turn (the
 * common shape: a buffer per request) touches only its own line -- nothing another core
 * writes -- where the ring's two positions are written by every thread at every acquire and
 * release, and move between the cores at each.  Two threads that hash to one word share it
 * (correct, only slower).  A word is version << 32 | (index + 1), 0 in the low half when
 * empty; every change bumps the version, so the exhaustion check below can tell "unchanged"
 * from "changed and changed back".
 *
 * Exhaustion.  An acquire reports "none free" only after two collects of the ring positions
 * and every word read the same values: nothing moved in between, so at that instant the ring
 * and every word were empty together -- every slot held.  (One pass would not do: an index
 * could move from a word not yet read to one already read, through a holder that took it and
 * gave it back, without the pass ever seeing it.)  A word's version is 32 bits: exactly 2^32
 * changes of one word between the two reads would fool the check -- minutes of a thread
 * descheduled inside it at ten million changes a second.
 *
 * Invariants
 *  - every index 0 <= i < nslots is either in the ring exactly once, or in exactly one stash
 *    word, or held by exactly one owner (a Python Slot, or C code that called
 *    aop_slab_acquire);
 *  - only the owner of i writes slot i's bytes; the enqueue that gives i back publishes with
 *    a release store and the dequeue that takes it reads seq with acquire, so the next owner
 *    sees every write of the previous one;
 *  - free == enq - deq + (stash words holding an index), 0 <= free <= nslots (exact when
 *    quiescent; a snapshot otherwise); failed counts acquires that found no free slot;
 *    high_water only grows.  It is exact single-threaded and whenever the pool ran dry (then
 *    it is nslots); with concurrent acquires it is a lower bound, because in-use is derived
 *    from positions and words read one after the other rather than kept in a counter (which
 *    would cost two more locked instructions on a shared line per acquire/release).  An
 *    acquire counts the words only when the ring alone says a new maximum may have been
 *    reached (nslots - (enq - deq) > high_water), which a thread reusing its own word never
 *    does;
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

#include <pthread.h>

#define AOP_SLAB_MAX_SLOTS ((int64_t)1 << 30)
#define AOP_SLAB_STASH_BITS 4
#define AOP_SLAB_STASH (1 << AOP_SLAB_STASH_BITS)     /* stash words per pool */
#define AOP_SLAB_LOW ((uint64_t)0xFFFFFFFFu)          /* a word's index + 1 */
#define AOP_SLAB_VERSION ((uint64_t)1 << 32)          /* a word's version step */

typedef struct {
    aop_atomic_i64 w;           /* version << 32 | (index + 1); low half 0: empty */
    char _pad[AOP_CACHE_LINE - sizeof(aop_atomic_i64)];
} aop_slab_stash_t;

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
    aop_slab_stash_t *stash;    /* AOP_SLAB_STASH words (see the top) */
} aop_slab_t;

/* Free slots in the ring now (a snapshot). */
AOP_INLINE int64_t aop_slab_ring_free(aop_slab_t *s)
{
    /* relaxed: a statistic; deq first so that a concurrent acquire can only lower the result */
    int64_t d = aop_load_i64(&s->deq, AOP_RELAXED);
    int64_t e = aop_load_i64(&s->enq, AOP_RELAXED);
    int64_t f = e - d;
    return f < 0 ? 0 : (f > s->nslots ? s->nslots : f);
}

/* Stash words holding an index now (a snapshot). */
AOP_INLINE int64_t aop_slab_stashed(aop_slab_t *s)
{
    int64_t n = 0;
    int k;
    for (k = 0; k < AOP_SLAB_STASH; k++)
        /* relaxed: a statistic */
        n += ((uint64_t)aop_load_i64(&s->stash[k].w, AOP_RELAXED) & AOP_SLAB_LOW) != 0;
    return n;
}

/* Free slots now (a snapshot): the ring's and the stash's. */
AOP_INLINE int64_t aop_slab_free_count(aop_slab_t *s)
{
    int64_t f = aop_slab_ring_free(s) + aop_slab_stashed(s);
    return f > s->nslots ? s->nslots : f;
}

/* The calling thread's stash word. */
AOP_INLINE aop_slab_stash_t *aop_slab_mine(aop_slab_t *s)
{
    /* Fibonacci hashing of the thread's id (its TCB address on glibc: aligned, so the high
     * bits of the product are the well-mixed ones) */
    uint64_t h = (uint64_t)(uintptr_t)pthread_self() * UINT64_C(0x9E3779B97F4A7C15);
    return &s->stash[h >> (64 - AOP_SLAB_STASH_BITS)];
}

/* Take the index in word e, or -1 if it is empty. */
AOP_INLINE int64_t aop_slab_stash_take(aop_slab_stash_t *e)
{
    /* relaxed: a guess for the CAS; an empty word is left unwritten (no line to own) */
    uint64_t w = (uint64_t)aop_load_i64(&e->w, AOP_RELAXED);
    while (w & AOP_SLAB_LOW) {
        /* acquire CAS: pairs with the release CAS that stashed the index, so every write the
         * previous owner made to the slot is visible to us; the version moves on */
        if (aop_cas_weak_i64(&e->w, (int64_t *)&w, (int64_t)((w & ~AOP_SLAB_LOW) + AOP_SLAB_VERSION),
                             AOP_ACQUIRE, AOP_RELAXED))
            return (int64_t)(w & AOP_SLAB_LOW) - 1;
    }
    return -1;
}

/* Put index i in word e if it is empty: 1, else 0 (nothing changed). */
AOP_INLINE int aop_slab_stash_put(aop_slab_stash_t *e, uint64_t i)
{
    uint64_t w = (uint64_t)aop_load_i64(&e->w, AOP_RELAXED);   /* relaxed: a guess for the CAS */
    while (!(w & AOP_SLAB_LOW)) {
        /* release CAS: publishes the slot's bytes (and the Slot object parked for i) to the
         * acquire CAS of whoever takes i from the word */
        if (aop_cas_weak_i64(&e->w, (int64_t *)&w,
                             (int64_t)(((w & ~AOP_SLAB_LOW) + AOP_SLAB_VERSION) | (i + 1)),
                             AOP_RELEASE, AOP_RELAXED))
            return 1;
    }
    return 0;
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

/* Enqueue index i (which the caller owns and gives up) in the ring. */
AOP_INLINE void aop_slab_ring_push(aop_slab_t *s, uint64_t i)
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

/* Give index i (which the caller owns and gives up) back: to the thread's stash word if it
 * is empty, else to the ring. */
AOP_INLINE void aop_slab_push(aop_slab_t *s, uint64_t i)
{
    if (!aop_slab_stash_put(aop_slab_mine(s), i))
        aop_slab_ring_push(s, i);
}

/* The ring and the stash were empty: take an index from another thread's word, or the ring
 * if something came back meanwhile; -1 once two collects agree that nothing is free (see
 * "Exhaustion" at the top). */
AOP_FUNC int64_t aop_slab_steal(aop_slab_t *s)
{
    int64_t snap[AOP_SLAB_STASH], d, e, i;
    int k, same;
    for (;;) {
        /* seq_cst loads, here and in the second collect: the two collects and the values
         * they compare are read in one order every thread agrees on (the exhaustion
         * argument); the slow path only */
        d = aop_load_i64(&s->deq, AOP_SEQ_CST);
        e = aop_load_i64(&s->enq, AOP_SEQ_CST);
        for (k = 0; k < AOP_SLAB_STASH; k++) snap[k] = aop_load_i64(&s->stash[k].w, AOP_SEQ_CST);
        for (k = 0; k < AOP_SLAB_STASH; k++) {
            if ((uint64_t)snap[k] & AOP_SLAB_LOW) {
                i = aop_slab_stash_take(&s->stash[k]);
                if (i >= 0) return i;
            }
        }
        if (e != d) {                       /* the ring had (or was being given) an index */
            i = aop_slab_pop(s);
            if (i >= 0) return i;
            continue;
        }
        same = aop_load_i64(&s->deq, AOP_SEQ_CST) == d && aop_load_i64(&s->enq, AOP_SEQ_CST) == e;
        for (k = 0; same && k < AOP_SLAB_STASH; k++)
            same = aop_load_i64(&s->stash[k].w, AOP_SEQ_CST) == snap[k];
        if (same) return -1;
    }
}

/* Note a successful acquire in the statistics (high water). */
AOP_INLINE void aop_slab_note_acquire(aop_slab_t *s)
{
    /* the ring alone gives an upper bound of the slots in use; the words are counted only
     * when that bound is above the high water (the top: a thread reusing its word never) */
    int64_t used = s->nslots - aop_slab_ring_free(s);
    int64_t hw = aop_load_i64(&s->high_water, AOP_RELAXED);      /* relaxed: a statistic */
    if (used <= hw) return;
    used -= aop_slab_stashed(s);
    /* relaxed CAS-max: a statistic; the loop only runs when a new maximum is reached */
    while (used > hw && !aop_cas_weak_i64(&s->high_water, &hw, used, AOP_RELAXED, AOP_RELAXED)) {}
}

/* Python path: take a free index for a Slot (-1: none free, counted as failed). */
AOP_INLINE int64_t aop_slab_take(aop_slab_t *s)
{
    int64_t i = aop_slab_stash_take(aop_slab_mine(s));
    if (i < 0) {
        i = aop_slab_pop(s);
        if (i < 0) i = aop_slab_steal(s);
    }
    if (i < 0) {
        aop_fetch_add_i64(&s->failed, 1, AOP_RELAXED);   /* relaxed: a statistic */
        /* every slot was held at one instant (the two collects): exact high water */
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
    if (posix_memalign(&mem, AOP_CACHE_LINE, sizeof(aop_slab_stash_t) * AOP_SLAB_STASH) != 0)
        mem = NULL;
    s->stash = (aop_slab_stash_t *)mem;
    if (s->cells == NULL || s->busy == NULL || s->stash == NULL) {
        free(s->cells); free(s->busy); free(s->stash); free(arena); free(s); return NULL;
    }
    /* every word empty, version 0 */
    memset(s->stash, 0, sizeof(aop_slab_stash_t) * AOP_SLAB_STASH);
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
    for (i = 0; i < nslots; i++) aop_slab_ring_push(s, (uint64_t)i);
    *err = 0;
    return s;
}

/* Free a pool.  The caller guarantees nobody uses it any more. */
AOP_FUNC void aop_slab_destroy(aop_slab_t *s)
{
    if (s == NULL) return;
    free(s->cells);
    free(s->busy);
    free(s->stash);
    free(s->arena);
    free(s);
}

#endif /* AOP_SLAB_H */
