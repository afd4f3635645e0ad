/*
 * aop_queue.h -- the C core of MPMCQueue and SPSCQueue, shared by both and by any
 * cimporting extension (declared for Cython in aoprim/_qwait.pxd).
 *
 * One idea, the bounded ring and its waiting (over 800 lines): both queue kinds share the
 * slot protocol and the park/wake machinery, argued once.
 *
 * Both queues move 64-bit words.  The Python classes store PyObject* in them (a strong
 * reference travels with the word); C callers store plain integers or pointers.  A queue is
 * used in exactly one of those modes for its whole life (see "Modes" below).
 *
 * ---- MPMC: the bounded array queue with a sequence number per cell (D. Vyukov) ----------
 *   tail: next position to fill; head: next position to empty.  Both only ever grow (64-bit:
 *   never wrap in practice), each alone on its own 128-byte block.
 *   cell[p & mask].seq encodes the state of that cell for position p (doubled, so that a
 *   capacity of 1 works: "full for p" and "free for p + cap" must differ):
 *       seq == 2p        free, waiting for the producer of position p
 *       seq == 2p + 1    holds the item of position p, waiting for its consumer
 *   Invariants:
 *     I1  head <= tail (positions), tail - head <= cap.
 *     I2  a position is claimed by exactly one producer (CAS tail p -> p+1) and exactly one
 *         consumer (CAS head p -> p+1); only the claimer touches the cell's value, and it
 *         publishes with a release store of seq that the other side's acquire load pairs with.
 *     I3  close() sets bit 63 of tail (AOP_Q_MARK).  A producer CASes tail from an unmarked
 *         value, so after the mark no position is ever claimed again: every put that
 *         succeeded claimed its position before close, and "head == tail position and tail
 *         marked" means nothing can ever arrive (exact "drained and closed").
 *   Batches: a producer that sees cells p..p+n-1 all free for their positions (seq == 2(p+i))
 *   and then wins CAS tail p -> p+n owns all n cells: nobody else could claim positions >= p
 *   while tail was p, and a free cell stays free until its claimer fills it.  Consumers
 *   batch the same way with seq == 2(p+i)+1.  Since tail/head only grow there is no ABA.
 *
 * ---- SPSC: a power-of-two ring with a producer-owned tail and a consumer-owned head -------
 *   buf[i & mask] for head <= i < tail holds items.  The producer writes the slot, then
 *   publishes tail (release); the consumer reads tail (acquire), reads the slot, then
 *   publishes head (release); the producer reads head (acquire) before reusing a slot.
 *   Each side keeps a private copy of the other's index (cached_head / cached_tail) and
 *   re-reads the shared one only when the copy says full / empty, so in steady state each
 *   side touches only its own cache line.  close() marks tail exactly as in MPMC; that is
 *   why the producer publishes tail with a CAS (it fails only if close marked it) rather
 *   than a plain store.
 *
 * ---- Waiting, and why no wake-up is lost ---------------------------------------------------
 *   Each queue has two aop_qwait_t: not_empty (consumers wait there) and not_full
 *   (producers).  A blocked thread spins briefly, yields, then parks:
 *       W1 waiters += 1 (seq_cst RMW)
 *       loop: W2 s = fetch_or(seq, SLEEPY) | SLEEPY (seq_cst RMW);  W3 seq_cst fence;
 *             W4 retry the operation;  if it cannot proceed: W5 futex-wait while seq == s
 *       waiters -= 1
 *   (The Python layer's W4 is a probe that reads what the operation would read and changes
 *   nothing; it then operates with the GIL held -- see "Probes" below.)
 *   Every operation that can let a waiter proceed (publish an item, free a cell, close):
 *       N1 a seq_cst RMW that announces it (SPSC: the CAS of tail / a seq_cst store of head,
 *          which is itself the publication; MPMC: the CAS that claims the position, made
 *          BEFORE the cell is filled / emptied; close: the CAS that marks tail)
 *       N2 w = waiters (seq_cst load)
 *       -- the publication itself (MPMC: release store of the cell's seq) --
 *       if (w != 0):  N3 if seq has SLEEPY: CAS seq -> next epoch, SLEEPY clear (seq_cst);
 *                     N4 and then futex-wake all
 *   W1, W2, W3 and N1, N2 are all in the single total order S of seq_cst operations.
 *   - If N2 reads waiters == 0, N2 precedes W1 in S, so N1 precedes the fence W3 and the
 *     re-check W4 sees N1.  SPSC: N1 is the publication, so W4 succeeds.  MPMC: W4 sees the
 *     claim (tail > pos for a consumer, head + cap > pos for a producer) while the cell is
 *     not yet published: the try returns AOP_Q_BUSY, and a BUSY waiter never parks, it
 *     yields and retries until the publication lands.
 *   - Otherwise W1 < W2 < N1 < N2 in S, so the notifier's seq_cst load in N3 sees W2's SLEEPY
 *     or a later value.  With SLEEPY it bumps the epoch: the kernel's compare in W5 fails or
 *     the wake N4 finds the waiter parked.  Without it, another notifier already bumped
 *     after W2 (only a bump clears SLEEPY), so the value differs from s: again W5 cannot
 *     sleep, or that notifier's wake (after its bump) finds it.  (A 31-bit epoch would
 *     have to wrap exactly between W2 and W5 to fool this.)
 *   Either way no waiter sleeps past a publication.  We wake all (not one) so that a woken
 *   waiter that leaves on timeout can never swallow the only wake.  The fast path pays no
 *   fence for this: the seq_cst CAS it needs anyway is N1, and N2 is a plain load on x86.
 *
 * ---- Task accounting: queue.Queue's task_done() / join() ---------------------------------
 *   unfinished = (successful puts) - (accepted task_done calls) = (tail position) - done.
 *   tail already counts every successful put exactly once -- an MPMC claim is always filled,
 *   a batch claim of k adds k, and SPSC's tail CAS fails only on close, when nothing was put
 *   -- so a put pays nothing for the count; only task_done touches the one extra counter.
 *   Invariants:
 *     T1 done <= tail position, always: task_done's CAS moves done from d to d + 1 only after
 *        reading a tail position t > d, and tail only grows.  A task_done that reads t <= d
 *        changes nothing (AOP_Q_RETRY: "called too many times").  A task_done that happens
 *        after the put of its item (by getting the item, say) reads a tail that counts it.
 *     T2 done only grows, one at a time, by that CAS.
 *   join() waits on tasks.all_done with the protocol above (W1..W5), its W4 being "done ==
 *   tail": done is read first, then tail; both only grow and done <= tail, so equal values
 *   mean the count was 0 at the read of tail.  A task_done's N1 is its seq_cst CAS of done,
 *   N2 its seq_cst load of waiters.  It notifies only when the tail it read was d + 1 (the
 *   count may have reached 0 at its CAS); with a larger tail the count stays above 0 after
 *   the CAS, so no joiner can proceed because of it.  The task_done that brings the count to
 *   0 always read tail == d + 1, so it always notifies.  A put never lets a joiner proceed
 *   and notifies nobody.
 *
 * ---- Modes ------------------------------------------------------------------------------------
 *   mode is 0 until the first operation, which sets it (CAS, once, forever) to
 *   AOP_Q_MODE_OBJ (the Python methods) or AOP_Q_MODE_RAW (the *_u64 C functions).  An
 *   operation of the other mode fails with AOP_Q_BADMODE and touches nothing, so a raw
 *   word can never be taken for a PyObject* (and an object reference never leaks into C).
 */
#ifndef AOP_QUEUE_H
#define AOP_QUEUE_H


#ifndef AOP_FUNC
/* A helper defined in this header: static, and unused in a module that does not call it
 * (no -Wunused-function warning in a cimporting extension). */
#define AOP_FUNC static __attribute__((unused))
#endif
#include <stdlib.h>
#include <string.h>
#include "aop_atomic.h"

#define AOP_Q_OK 0          /* done */
#define AOP_Q_RETRY 1       /* full (push) / empty (pop): try again later */
#define AOP_Q_CLOSED 2      /* closed (push), or closed and drained (pop) */
#define AOP_Q_BADMODE 3     /* the queue is used in the other mode (objects vs raw words) */
#define AOP_Q_BUSY 4        /* internal: full/empty only because the other side is mid-operation;
                               waiters retry without parking.  Public functions report RETRY */

#define AOP_Q_MODE_NONE 0u
#define AOP_Q_MODE_OBJ 1u
#define AOP_Q_MODE_RAW 2u

#define AOP_Q_MARK ((uint64_t)1 << 63)      /* "closed" bit of tail */
#define AOP_Q_MAX_CAPACITY ((uint64_t)1 << 32)

#define AOP_Q_SPIN 7       /* backoff doublings while spinning: 1 .. 64 pauses per retry */
#define AOP_Q_YIELD 20     /* sched_yield()s before parking (a Python-level waiter usually waits
                              for a thread that needs the GIL; yielding beats a futex round trip) */


#define AOP_Q_LIKELY(x) __builtin_expect(!!(x), 1)
#define AOP_Q_UNLIKELY(x) __builtin_expect(!!(x), 0)

/* ---- wait sets ------------------------------------------------------------------------- */

typedef struct {
    aop_atomic_u32 seq;       /* futex word: bit 0 = SLEEPY (a waiter may be asleep on this
                                 value), bits 1.. = epoch, bumped by a notifier that wakes */
    aop_atomic_u32 waiters;   /* threads inside the park phase of aop_q_wait */
    char _pad[AOP_CACHE_LINE - 8];
} aop_qwait_t;

#define AOP_QW_SLEEPY 1u

/* N3/N4: if a waiter may be asleep on the current value (SLEEPY), move to the next epoch
 * (clearing SLEEPY) and wake everybody; if not, every waiter will re-check before it sleeps
 * (it must first set SLEEPY, and re-checks after that), so the syscall is skipped.  This is
 * what keeps a producer from paying a futex syscall per item while woken consumers have not
 * yet run. */
AOP_INLINE void aop_qwait_wake_all(aop_qwait_t *w)
{
    /* seq_cst: in S after the caller's N1/N2, so that it sees a SLEEPY set before them */
    uint32_t v = aop_load_u32(&w->seq, AOP_SEQ_CST);
    while (v & AOP_QW_SLEEPY) {
        /* seq_cst CAS: a waiter whose W2 reads the new value synchronises with it; on failure
         * v is reloaded (another notifier bumped, or a waiter set SLEEPY) and re-tested */
        if (aop_cas_u32(&w->seq, &v, (v & ~AOP_QW_SLEEPY) + 2, AOP_SEQ_CST, AOP_SEQ_CST)) {
            aop_unpark(&w->seq, INT32_MAX);                         /* N4 */
            return;
        }
    }
}

/* Wake every waiter unconditionally (close()): bump the epoch whatever SLEEPY says. */
AOP_INLINE void aop_qwait_wake_all_force(aop_qwait_t *w)
{
    /* seq_cst RMW; +2 keeps bit 0 as it was (harmless: at worst one needless later wake) */
    aop_fetch_add_u32(&w->seq, 2, AOP_SEQ_CST);
    aop_unpark(&w->seq, INT32_MAX);
}

/* N2: call after the publishing seq_cst store or RMW. */
AOP_INLINE void aop_qwait_notify(aop_qwait_t *w)
{
    if (AOP_Q_UNLIKELY(aop_load_u32(&w->waiters, AOP_SEQ_CST) != 0))
        aop_qwait_wake_all(w);
}

/* Claim (or check) the queue's mode.  relaxed first read: the mode changes at most once (from
 * NONE), so a stale NONE only sends us to the CAS, which sees the current value. */
AOP_INLINE int aop_q_mode_ok(aop_atomic_u32 *mode, uint32_t want)
{
    uint32_t m = aop_load_u32(mode, AOP_RELAXED);
    if (AOP_Q_LIKELY(m == want)) return 1;
    if (m == AOP_Q_MODE_NONE) {
        /* acq_rel / acquire: a one-time decision; no data hangs on it, but be conservative */
        if (aop_cas_u32(mode, &m, want, AOP_ACQ_REL, AOP_ACQUIRE)) return 1;
    }
    return m == want;
}

/* A blocking operation with a uniform signature (see the *_wait_p functions). */
typedef int (*aop_q_wait_fn)(void *queue, uint64_t *word, int64_t timeout_ns);

/* One attempt of an operation: returns AOP_Q_OK / AOP_Q_RETRY / AOP_Q_CLOSED / ... */
typedef int (*aop_q_try_fn)(void *queue, void *arg);

#define AOP_Q_AGAIN(r) ((r) == AOP_Q_RETRY || (r) == AOP_Q_BUSY)

/* Block until try_fn returns something other than RETRY / BUSY, or timeout_ns (< 0: never)
 * has passed (then AOP_Q_RETRY).  Spin, yield, park on w (protocol at the top); BUSY (the
 * other side is mid-operation and will not notify) never parks, it yields.  Runs without the
 * GIL and touches no Python object. */
AOP_FUNC int aop_q_wait(aop_qwait_t *w, aop_q_try_fn try_fn, void *queue, void *arg,
                      int64_t timeout_ns)
{
    int64_t deadline = 0, left = -1;
    int step, i, r;
    uint32_t s;

    if (timeout_ns > 0) deadline = aop_deadline_ns(timeout_ns);   /* saturates */
    /* phase 1: spin with exponential backoff */
    for (step = 0; step < AOP_Q_SPIN; step++) {
        r = try_fn(queue, arg);
        if (!AOP_Q_AGAIN(r)) return r;
        if (timeout_ns == 0) return AOP_Q_RETRY;
        for (i = 0; i < (1 << step); i++) aop_cpu_relax();
    }
    /* phase 2: give our core to the other side if it is waiting for one */
    for (step = 0; step < AOP_Q_YIELD; step++) {
        aop_yield();
        r = try_fn(queue, arg);
        if (!AOP_Q_AGAIN(r)) return r;
        if (timeout_ns > 0 && aop_now_ns() >= deadline) return AOP_Q_RETRY;
    }
    /* phase 3: park */
    aop_fetch_add_u32(&w->waiters, 1, AOP_SEQ_CST);                 /* W1 */
    for (;;) {
        /* W2: seq_cst RMW: announce "I may sleep on this value" (SLEEPY) and learn it */
        s = aop_fetch_or_u32(&w->seq, AOP_QW_SLEEPY, AOP_SEQ_CST) | AOP_QW_SLEEPY;
        aop_thread_fence(AOP_SEQ_CST);                               /* W3 */
        r = try_fn(queue, arg);                                      /* W4 */
        if (!AOP_Q_AGAIN(r)) break;
        if (timeout_ns > 0) {
            left = deadline - aop_now_ns();
            if (left <= 0) { r = AOP_Q_RETRY; break; }
        }
        if (r == AOP_Q_BUSY) {
            aop_yield();          /* an in-flight operation completes without a wake */
            continue;
        }
        aop_park(&w->seq, s, left);                                  /* W5 */
        /* woken, spurious, EINTR or timeout: the loop re-checks every one of them */
    }
    /* release: our last try happens-before a notifier that reads the decrement (it orders
     * nothing a notifier needs; a stale non-zero count only costs it one needless wake) */
    aop_fetch_sub_u32(&w->waiters, 1, AOP_RELEASE);
    return r;
}

/* ---- task accounting (see "Task accounting" at the top) -------------------------------- */

typedef struct {
    uint64_t done;           /* accepted task_done() calls; only grows (T2), <= tail (T1) */
    char _pad[AOP_CACHE_LINE - 8];
    aop_qwait_t all_done;    /* join() parks here */
} aop_qtasks_t;

/* One task_done() against the tail word *tail.  AOP_Q_OK, or AOP_Q_RETRY (nothing changed)
 * when no task is unfinished. */
AOP_FUNC int aop_q_task_done(aop_qtasks_t *k, const uint64_t *tail)
{
    /* relaxed: a first guess for the CAS below, which re-validates it */
    uint64_t d = aop_load_u64p(&k->done, AOP_RELAXED), t;
    for (;;) {
        /* acquire: tail only grows, and the put of an item we got happened-before us (its
         * claim precedes the publication our get acquired), so t counts it (T1) */
        t = aop_load_u64p(tail, AOP_ACQUIRE) & ~AOP_Q_MARK;
        if (d >= t) return AOP_Q_RETRY;
        /* seq_cst CAS: N1 for joiners (their W4 must see it, or our N2 must see them);
         * its release half publishes the caller's work on the task to the joiner's load of
         * done.  On failure d receives the current value and t is read again. */
        if (aop_cas_weak_u64p(&k->done, &d, d + 1, AOP_SEQ_CST, AOP_RELAXED)) break;
    }
    if (t == d + 1)                          /* the count may be 0 now: wake joiners */
        aop_qwait_notify(&k->all_done);      /* N2 (seq_cst load of waiters), N3, N4 */
    return AOP_Q_OK;
}

/* join()'s probe (an aop_q_try_fn: tasks, tail word): AOP_Q_OK when nothing is unfinished,
 * else AOP_Q_RETRY.  Changes nothing. */
AOP_FUNC int aop_q_all_done_(void *tasks, void *tail)
{
    /* seq_cst: W4, after the waiter's fence; done first, then tail (see the top).  Its
     * acquire half pairs with task_done's CAS: what the task's worker wrote before
     * task_done() is visible to the thread that returns from join() */
    uint64_t d = aop_load_u64p(&((aop_qtasks_t *)tasks)->done, AOP_SEQ_CST);
    /* seq_cst: read after done (a later tail can only be larger: never a false OK) */
    uint64_t t = aop_load_u64p((const uint64_t *)tail, AOP_SEQ_CST) & ~AOP_Q_MARK;
    return d >= t ? AOP_Q_OK : AOP_Q_RETRY;
}

/* Set the close mark on *tail and wake everybody.  Idempotent. */
AOP_INLINE void aop_q_close(uint64_t *tail, aop_qwait_t *not_empty, aop_qwait_t *not_full)
{
    uint64_t t = aop_load_u64p(tail, AOP_RELAXED);
    /* seq_cst CAS: it is the "publication" (N1) that the waiters' re-checks must see; a
     * failed CAS reloads t and we retry (a producer moved tail meanwhile) */
    while (!(t & AOP_Q_MARK) &&
           !aop_cas_weak_u64p(tail, &t, t | AOP_Q_MARK, AOP_SEQ_CST, AOP_RELAXED)) {}
    aop_qwait_wake_all_force(not_empty);
    aop_qwait_wake_all_force(not_full);
}

AOP_INLINE uint64_t aop_q_round_capacity(uint64_t n)
{
    uint64_t c = 1;
    while (c < n) c <<= 1;
    return c;
}

AOP_INLINE void *aop_q_alloc(size_t size)
{
    void *p = NULL;
    if (posix_memalign(&p, AOP_CACHE_LINE, size) != 0) return NULL;
    memset(p, 0, size);
    return p;
}

/* ======================================================================= MPMC ========== */

typedef struct {
    uint64_t seq;     /* 2p: free for position p; 2p+1: holds the item of position p */
    uint64_t val;     /* the word; written by the claiming producer, read by the consumer */
} aop_mpmc_cell_t;

typedef struct {
    /* read-only after init (mode: written once) */
    aop_mpmc_cell_t *cells;  /* cap cells */
    uint64_t mask;           /* cap - 1 */
    uint64_t cap;            /* a power of two, >= 1 */
    aop_atomic_u32 mode;     /* AOP_Q_MODE_* */
    char _pad0[AOP_CACHE_LINE - 3 * 8 - 4];
    uint64_t tail;           /* next position to fill; bit 63: closed.  Producers' line */
    char _pad1[AOP_CACHE_LINE - 8];
    uint64_t head;           /* next position to empty.  Consumers' line */
    char _pad2[AOP_CACHE_LINE - 8];
    aop_qwait_t not_empty;   /* consumers park here */
    aop_qwait_t not_full;    /* producers park here */
    aop_qtasks_t tasks;      /* task_done() / join(); unfinished = tail position - done */
} aop_mpmc_t;

/* NULL on allocation failure.  capacity >= 1, rounded up to a power of two. */
AOP_FUNC aop_mpmc_t *aop_mpmc_new(uint64_t capacity)
{
    uint64_t cap = aop_q_round_capacity(capacity), i;
    aop_mpmc_t *q = (aop_mpmc_t *)aop_q_alloc(sizeof(aop_mpmc_t));
    if (!q) return NULL;
    q->cells = (aop_mpmc_cell_t *)aop_q_alloc(cap * sizeof(aop_mpmc_cell_t));
    if (!q->cells) { free(q); return NULL; }
    q->cap = cap;
    q->mask = cap - 1;
    for (i = 0; i < cap; i++) q->cells[i].seq = 2 * i;
    /* publication to other threads happens through whatever hands them the queue */
    return q;
}

AOP_FUNC void aop_mpmc_free(aop_mpmc_t *q)
{
    if (q) { free(q->cells); free(q); }
}

/* After a claim that did not fill the cell of pos: why not?  (Only called on the slow path.)
 * Producer side: the cell still holds position pos - cap.  If its consumer has already
 * claimed it (head > pos - cap) it is mid-operation: BUSY, retry soon, do not park.
 * acquire loads: pair with the seq_cst CASes of head / tail and of close(). */
AOP_INLINE int aop_mpmc_push_fail_(aop_mpmc_t *q, uint64_t pos)
{
    if (aop_load_u64p(&q->tail, AOP_ACQUIRE) & AOP_Q_MARK) return AOP_Q_CLOSED;
    if (aop_load_u64p(&q->head, AOP_ACQUIRE) + q->cap > pos) return AOP_Q_BUSY;
    return AOP_Q_RETRY;
}

/* Consumer side: nothing is published at pos.  If a producer has claimed pos (tail > pos)
 * it is mid-operation: BUSY.  If tail is marked and equals pos, nothing can ever come (I3). */
AOP_INLINE int aop_mpmc_pop_fail_(aop_mpmc_t *q, uint64_t pos)
{
    uint64_t t = aop_load_u64p(&q->tail, AOP_ACQUIRE);
    if ((t & ~AOP_Q_MARK) > pos) return AOP_Q_BUSY;
    return (t & AOP_Q_MARK) ? AOP_Q_CLOSED : AOP_Q_RETRY;
}

AOP_INLINE int aop_mpmc_push_(aop_mpmc_t *q, uint64_t v)
{
    aop_mpmc_cell_t *cell;
    uint64_t seq;
    uint32_t w;
    int64_t dif;
    /* relaxed: only a hint of where to start; the cell's seq and the CAS decide */
    uint64_t pos = aop_load_u64p(&q->tail, AOP_RELAXED);
    for (;;) {
        if (AOP_Q_UNLIKELY(pos & AOP_Q_MARK)) return AOP_Q_CLOSED;
        cell = &q->cells[pos & q->mask];
        /* acquire: pairs with the release store of the consumer that emptied this cell for
         * our lap: its read of val happened before we overwrite it */
        seq = aop_load_u64p(&cell->seq, AOP_ACQUIRE);
        dif = (int64_t)(seq - 2 * pos);
        if (AOP_Q_LIKELY(dif == 0)) {
            /* seq_cst CAS: the claim (N1 of the wake-up protocol); the data itself is
             * ordered by the cell's seq.  On failure pos receives the current tail. */
            if (aop_cas_weak_u64p(&q->tail, &pos, pos + 1, AOP_SEQ_CST, AOP_RELAXED)) break;
        } else if (dif < 0) {
            return aop_mpmc_push_fail_(q, pos);
        } else {
            pos = aop_load_u64p(&q->tail, AOP_RELAXED);  /* we are behind: reload (relaxed) */
        }
    }
    /* N2: seq_cst load, after the claim in S */
    w = aop_load_u32(&q->not_empty.waiters, AOP_SEQ_CST);
    cell->val = v;
    /* release: makes val visible to the consumer that acquires seq */
    aop_store_u64p(&cell->seq, 2 * pos + 1, AOP_RELEASE);
    if (AOP_Q_UNLIKELY(w != 0)) aop_qwait_wake_all(&q->not_empty);    /* N3, N4 */
    return AOP_Q_OK;
}

AOP_INLINE int aop_mpmc_pop_(aop_mpmc_t *q, uint64_t *out)
{
    aop_mpmc_cell_t *cell;
    uint64_t seq;
    uint32_t w;
    int64_t dif;
    uint64_t pos = aop_load_u64p(&q->head, AOP_RELAXED);     /* relaxed: a hint, as above */
    for (;;) {
        cell = &q->cells[pos & q->mask];
        /* acquire: pairs with the producer's release store that published val */
        seq = aop_load_u64p(&cell->seq, AOP_ACQUIRE);
        dif = (int64_t)(seq - (2 * pos + 1));
        if (AOP_Q_LIKELY(dif == 0)) {
            /* seq_cst CAS: the claim (N1 for waiting producers) */
            if (aop_cas_weak_u64p(&q->head, &pos, pos + 1, AOP_SEQ_CST, AOP_RELAXED)) break;
        } else if (dif < 0) {
            return aop_mpmc_pop_fail_(q, pos);
        } else {
            /* relaxed: another consumer took pos; a fresh guess, re-validated by the
             * acquire load of the cell and the CAS above */
            pos = aop_load_u64p(&q->head, AOP_RELAXED);
        }
    }
    w = aop_load_u32(&q->not_full.waiters, AOP_SEQ_CST);              /* N2 */
    *out = cell->val;
    /* release: orders our read of val before the next lap's producer (which acquires seq)
     * overwrites it */
    aop_store_u64p(&cell->seq, 2 * (pos + q->cap), AOP_RELEASE);
    if (AOP_Q_UNLIKELY(w != 0)) aop_qwait_wake_all(&q->not_full);     /* N3, N4 */
    return AOP_Q_OK;
}

/* Push up to n words with one claim.  *pushed receives how many (0 .. n); returns OK if any
 * were pushed (or n == 0), else RETRY / BUSY (full) or CLOSED. */
AOP_FUNC int aop_mpmc_push_many_(aop_mpmc_t *q, const uint64_t *v, uint64_t n, uint64_t *pushed)
{
    uint64_t pos = aop_load_u64p(&q->tail, AOP_RELAXED), k, seq, i;
    uint32_t w;
    int64_t dif;
    *pushed = 0;
    if (n == 0) return (pos & AOP_Q_MARK) ? AOP_Q_CLOSED : AOP_Q_OK;
    for (;;) {
        if (pos & AOP_Q_MARK) return AOP_Q_CLOSED;
        /* count the free cells from pos on (acquire: as in aop_mpmc_push_) */
        for (k = 0; k < n; k++) {
            seq = aop_load_u64p(&q->cells[(pos + k) & q->mask].seq, AOP_ACQUIRE);
            if (seq != 2 * (pos + k)) break;
        }
        if (k == 0) {
            seq = aop_load_u64p(&q->cells[pos & q->mask].seq, AOP_ACQUIRE);
            dif = (int64_t)(seq - 2 * pos);
            if (dif < 0) return aop_mpmc_push_fail_(q, pos);
            pos = aop_load_u64p(&q->tail, AOP_RELAXED);
            continue;
        }
        /* seq_cst CAS: claims positions pos .. pos+k-1 (see "Batches"); N1 */
        if (aop_cas_weak_u64p(&q->tail, &pos, pos + k, AOP_SEQ_CST, AOP_RELAXED)) break;
    }
    w = aop_load_u32(&q->not_empty.waiters, AOP_SEQ_CST);             /* N2 */
    for (i = 0; i < k; i++) {
        aop_mpmc_cell_t *cell = &q->cells[(pos + i) & q->mask];
        cell->val = v[i];
        /* release: publishes val to the consumer of pos + i */
        aop_store_u64p(&cell->seq, 2 * (pos + i) + 1, AOP_RELEASE);
    }
    if (AOP_Q_UNLIKELY(w != 0)) aop_qwait_wake_all(&q->not_empty);
    *pushed = k;
    return AOP_Q_OK;
}

/* Pop up to n words with one claim into out.  *popped receives how many; returns OK if any
 * (or n == 0 and not drained-and-closed), else RETRY / BUSY (empty) or CLOSED. */
AOP_FUNC int aop_mpmc_pop_many_(aop_mpmc_t *q, uint64_t *out, uint64_t n, uint64_t *popped)
{
    uint64_t pos = aop_load_u64p(&q->head, AOP_RELAXED), k, seq, i;
    uint32_t w;
    int r;
    int64_t dif;
    *popped = 0;
    for (;;) {
        for (k = 0; k < n; k++) {
            /* acquire: pairs with the producer's release of this cell */
            seq = aop_load_u64p(&q->cells[(pos + k) & q->mask].seq, AOP_ACQUIRE);
            if (seq != 2 * (pos + k) + 1) break;
        }
        if (k == 0) {
            seq = aop_load_u64p(&q->cells[pos & q->mask].seq, AOP_ACQUIRE);
            dif = (int64_t)(seq - (2 * pos + 1));
            if (dif < 0 || n == 0) {
                if (n == 0) {
                    r = aop_mpmc_pop_fail_(q, aop_load_u64p(&q->head, AOP_RELAXED));
                    return r == AOP_Q_CLOSED ? r : AOP_Q_OK;
                }
                return aop_mpmc_pop_fail_(q, pos);
            }
            if (dif == 0) continue;        /* became ready meanwhile: rescan */
            pos = aop_load_u64p(&q->head, AOP_RELAXED);
            continue;
        }
        /* seq_cst CAS: claims pos .. pos+k-1; N1 for waiting producers */
        if (aop_cas_weak_u64p(&q->head, &pos, pos + k, AOP_SEQ_CST, AOP_RELAXED)) break;
    }
    w = aop_load_u32(&q->not_full.waiters, AOP_SEQ_CST);              /* N2 */
    for (i = 0; i < k; i++) {
        aop_mpmc_cell_t *cell = &q->cells[(pos + i) & q->mask];
        out[i] = cell->val;
        /* release: our read of val happens before the next lap's producer reuses the cell */
        aop_store_u64p(&cell->seq, 2 * (pos + i + q->cap), AOP_RELEASE);
    }
    if (AOP_Q_UNLIKELY(w != 0)) aop_qwait_wake_all(&q->not_full);
    *popped = k;
    return AOP_Q_OK;
}

AOP_INLINE uint64_t aop_mpmc_size(aop_mpmc_t *q)
{
    /* relaxed snapshots: approximate by contract (docs/queues.md) */
    uint64_t h = aop_load_u64p(&q->head, AOP_RELAXED);
    uint64_t t = aop_load_u64p(&q->tail, AOP_RELAXED) & ~AOP_Q_MARK;
    int64_t n = (int64_t)(t - h);
    if (n < 0) return 0;
    return (uint64_t)n > q->cap ? q->cap : (uint64_t)n;
}

AOP_INLINE int aop_mpmc_closed(aop_mpmc_t *q)
{
    /* acquire: pairs with close()'s seq_cst CAS */
    return (aop_load_u64p(&q->tail, AOP_ACQUIRE) & AOP_Q_MARK) != 0;
}

AOP_INLINE void aop_mpmc_close(aop_mpmc_t *q) { aop_q_close(&q->tail, &q->not_empty, &q->not_full); }

AOP_FUNC int aop_mpmc_try_push_cb(void *q, void *arg)
{ return aop_mpmc_push_((aop_mpmc_t *)q, *(uint64_t *)arg); }
AOP_FUNC int aop_mpmc_try_pop_cb(void *q, void *arg)
{ return aop_mpmc_pop_((aop_mpmc_t *)q, (uint64_t *)arg); }

/* Blocking forms (no GIL needed): timeout_ns < 0 waits forever, 0 tries once. */
AOP_FUNC int aop_mpmc_push_wait_(aop_mpmc_t *q, uint64_t v, int64_t timeout_ns)
{
    int r = aop_mpmc_push_(q, v);
    if (!AOP_Q_AGAIN(r)) return r;
    if (timeout_ns == 0) return AOP_Q_RETRY;
    return aop_q_wait(&q->not_full, aop_mpmc_try_push_cb, q, &v, timeout_ns);
}
AOP_FUNC int aop_mpmc_pop_wait_(aop_mpmc_t *q, uint64_t *out, int64_t timeout_ns)
{
    int r = aop_mpmc_pop_(q, out);
    if (!AOP_Q_AGAIN(r)) return r;
    if (timeout_ns == 0) return AOP_Q_RETRY;
    return aop_q_wait(&q->not_empty, aop_mpmc_try_pop_cb, q, out, timeout_ns);
}

/* ---- Probes: "could a push / pop proceed now?" without changing anything ---------------
 * The Python layer waits with these (no GIL) and then performs the operation itself with
 * the GIL held, so in a GIL build the ring of an OBJ-mode queue only ever changes under the
 * GIL -- which is what lets the cyclic GC traverse the queued objects (see _qcore.pxd).  A
 * probe reads exactly what the operation would read first, with the same orders, so the
 * wake-up argument at the top holds for it unchanged (W4 sees N1 or the notifier sees the
 * waiter).  OK means "try the operation" (it may still lose a race: the caller waits again);
 * BUSY and RETRY mean what they mean for the operation; CLOSED is final. */
AOP_FUNC int aop_mpmc_can_push_(void *queue, void *unused)
{
    aop_mpmc_t *q = (aop_mpmc_t *)queue;
    /* relaxed, as in aop_mpmc_push_: the cell's seq (acquire) decides */
    uint64_t pos = aop_load_u64p(&q->tail, AOP_RELAXED), seq;
    (void)unused;
    if (pos & AOP_Q_MARK) return AOP_Q_CLOSED;
    /* acquire: as in aop_mpmc_push_ (pairs with the release of the consumer that freed it) */
    seq = aop_load_u64p(&q->cells[pos & q->mask].seq, AOP_ACQUIRE);
    if ((int64_t)(seq - 2 * pos) < 0) return aop_mpmc_push_fail_(q, pos);
    return AOP_Q_OK;                    /* free for pos, or tail moved on: try */
}
AOP_FUNC int aop_mpmc_can_pop_(void *queue, void *unused)
{
    aop_mpmc_t *q = (aop_mpmc_t *)queue;
    uint64_t pos = aop_load_u64p(&q->head, AOP_RELAXED), seq;    /* relaxed: as in pop_ */
    (void)unused;
    /* acquire: as in aop_mpmc_pop_ (pairs with the producer's release of the cell) */
    seq = aop_load_u64p(&q->cells[pos & q->mask].seq, AOP_ACQUIRE);
    if ((int64_t)(seq - (2 * pos + 1)) < 0) return aop_mpmc_pop_fail_(q, pos);
    return AOP_Q_OK;
}
/* Uniform signatures (queue, word pointer, timeout) for the Python layer's interruptible
 * wait loop, which calls these in slices so that signals (Ctrl-C) are seen. */
AOP_FUNC int aop_mpmc_room_wait_p(void *q, uint64_t *unused, int64_t timeout_ns)
{ (void)unused; return aop_q_wait(&((aop_mpmc_t *)q)->not_full, aop_mpmc_can_push_, q, NULL, timeout_ns); }
AOP_FUNC int aop_mpmc_item_wait_p(void *q, uint64_t *unused, int64_t timeout_ns)
{ (void)unused; return aop_q_wait(&((aop_mpmc_t *)q)->not_empty, aop_mpmc_can_pop_, q, NULL, timeout_ns); }

/* Task accounting (any mode, any thread).  task_done: AOP_Q_OK, or AOP_Q_RETRY when nothing
 * is unfinished (nothing changed).  all_done: 1 when nothing is unfinished.  join_wait_p
 * waits (no GIL) until all done: AOP_Q_OK, or AOP_Q_RETRY once timeout_ns (< 0: never) has
 * passed. */
AOP_FUNC int aop_mpmc_task_done(aop_mpmc_t *q) { return aop_q_task_done(&q->tasks, &q->tail); }
AOP_FUNC int aop_mpmc_all_done(aop_mpmc_t *q)
{ return aop_q_all_done_(&q->tasks, &q->tail) == AOP_Q_OK; }
AOP_FUNC int aop_mpmc_join_wait_p(void *q, uint64_t *unused, int64_t timeout_ns)
{
    aop_mpmc_t *m = (aop_mpmc_t *)q;
    (void)unused;
    return aop_q_wait(&m->tasks.all_done, aop_q_all_done_, &m->tasks, &m->tail, timeout_ns);
}

/* Call fn(word, arg) for every published item, oldest first; stops at the first non-zero
 * return, which it returns.  Only meaningful while nothing pushes or pops concurrently (the
 * cyclic GC: GIL held, every OBJ-mode operation runs under it).  relaxed loads: that caller
 * already synchronises with every operation through the GIL. */
AOP_FUNC int aop_mpmc_each_(aop_mpmc_t *q, int (*fn)(uint64_t, void *), void *arg)
{
    uint64_t h = aop_load_u64p(&q->head, AOP_RELAXED);
    uint64_t t = aop_load_u64p(&q->tail, AOP_RELAXED) & ~AOP_Q_MARK, pos;
    int r;
    for (pos = h; pos < t; pos++) {
        aop_mpmc_cell_t *cell = &q->cells[pos & q->mask];
        if (aop_load_u64p(&cell->seq, AOP_RELAXED) != 2 * pos + 1) continue;
        if ((r = fn(cell->val, arg)) != 0) return r;
    }
    return 0;
}

/* ---- MPMC public C API (raw 64-bit words; claims RAW mode) ---------------------------- */
AOP_INLINE int aop_mpmc_try_push_u64(aop_mpmc_t *q, uint64_t v)
{
    int r;
    if (AOP_Q_UNLIKELY(!aop_q_mode_ok(&q->mode, AOP_Q_MODE_RAW))) return AOP_Q_BADMODE;
    r = aop_mpmc_push_(q, v);
    return r == AOP_Q_BUSY ? AOP_Q_RETRY : r;
}
AOP_INLINE int aop_mpmc_try_pop_u64(aop_mpmc_t *q, uint64_t *out)
{
    int r;
    if (AOP_Q_UNLIKELY(!aop_q_mode_ok(&q->mode, AOP_Q_MODE_RAW))) return AOP_Q_BADMODE;
    r = aop_mpmc_pop_(q, out);
    return r == AOP_Q_BUSY ? AOP_Q_RETRY : r;
}
AOP_FUNC int aop_mpmc_push_u64(aop_mpmc_t *q, uint64_t v, int64_t timeout_ns)
{
    if (!aop_q_mode_ok(&q->mode, AOP_Q_MODE_RAW)) return AOP_Q_BADMODE;
    return aop_mpmc_push_wait_(q, v, timeout_ns);
}
AOP_FUNC int aop_mpmc_pop_u64(aop_mpmc_t *q, uint64_t *out, int64_t timeout_ns)
{
    if (!aop_q_mode_ok(&q->mode, AOP_Q_MODE_RAW)) return AOP_Q_BADMODE;
    return aop_mpmc_pop_wait_(q, out, timeout_ns);
}
AOP_FUNC int aop_mpmc_push_many_u64(aop_mpmc_t *q, const uint64_t *v, uint64_t n, uint64_t *pushed)
{
    int r;
    *pushed = 0;
    if (!aop_q_mode_ok(&q->mode, AOP_Q_MODE_RAW)) return AOP_Q_BADMODE;
    r = aop_mpmc_push_many_(q, v, n, pushed);
    return r == AOP_Q_BUSY ? AOP_Q_RETRY : r;
}
AOP_FUNC int aop_mpmc_pop_many_u64(aop_mpmc_t *q, uint64_t *out, uint64_t n, uint64_t *popped)
{
    int r;
    *popped = 0;
    if (!aop_q_mode_ok(&q->mode, AOP_Q_MODE_RAW)) return AOP_Q_BADMODE;
    r = aop_mpmc_pop_many_(q, out, n, popped);
    return r == AOP_Q_BUSY ? AOP_Q_RETRY : r;
}

/* ======================================================================= SPSC ========== */

typedef struct {
    /* read-only after init (mode: written once) */
    uint64_t *buf;           /* cap slots */
    uint64_t mask;           /* cap - 1 */
    uint64_t cap;            /* a power of two, >= 1 */
    aop_atomic_u32 mode;     /* AOP_Q_MODE_* */
    char _pad0[AOP_CACHE_LINE - 3 * 8 - 4];
    /* the producer's line */
    uint64_t tail;           /* next slot to fill; written only by the producer (CAS) and by
                                close() (sets bit 63); read by the consumer */
    uint64_t cached_head;    /* producer-private: last head it read */
    aop_atomic_u32 pclaim;   /* 1 while a Python-level put holds the producer side (below) */
    char _pad1[AOP_CACHE_LINE - 16 - 4];
    /* the consumer's line */
    uint64_t head;           /* next slot to empty; written only by the consumer */
    uint64_t cached_tail;    /* consumer-private: last tail position it read (no mark) */
    aop_atomic_u32 cclaim;   /* 1 while a Python-level get holds the consumer side */
    char _pad2[AOP_CACHE_LINE - 16 - 4];
    aop_qwait_t not_empty;   /* the consumer parks here */
    aop_qwait_t not_full;    /* the producer parks here */
    aop_qtasks_t tasks;      /* task_done() / join() (any thread); as in aop_mpmc_t */
} aop_spsc_t;

AOP_FUNC aop_spsc_t *aop_spsc_new(uint64_t capacity)
{
    uint64_t cap = aop_q_round_capacity(capacity);
    aop_spsc_t *q = (aop_spsc_t *)aop_q_alloc(sizeof(aop_spsc_t));
    if (!q) return NULL;
    q->buf = (uint64_t *)aop_q_alloc(cap * sizeof(uint64_t));
    if (!q->buf) { free(q); return NULL; }
    q->cap = cap;
    q->mask = cap - 1;
    return q;
}

AOP_FUNC void aop_spsc_free(aop_spsc_t *q)
{
    if (q) { free(q->buf); free(q); }
}

/* ---- Misuse detection for the Python surface --------------------------------------------
 * One producer and one consumer is SPSC's contract.  Two threads on one side would both
 * write the same slot (an item reference lost, another released twice: a crash), so the
 * Python methods detect it and raise instead.  A side is "claimed" (pclaim / cclaim = 1)
 * while an operation of that side runs without the GIL: always in a free-threaded build,
 * and in a GIL build only around a blocking wait -- everything else already runs under the
 * GIL, serialised, so there a side's fast path just checks that nobody holds the claim.
 * Each flag lives on its own side's cache line: no traffic between producer and consumer.
 * The nogil C API (*_u64) is not checked: C callers keep the contract themselves. */
AOP_INLINE int aop_spsc_side_claim(aop_atomic_u32 *c)
{
    /* acquire: pairs with the previous holder's release in aop_spsc_side_release, so its
     * writes of the side's private fields (cached index) happen before ours.  Returns 1 when
     * the side was free and is now ours. */
    return aop_exchange_u32(c, 1, AOP_ACQUIRE) == 0;
}
AOP_INLINE void aop_spsc_side_release(aop_atomic_u32 *c)
{
    aop_store_u32(c, 0, AOP_RELEASE);   /* release: publishes our side's writes (above) */
}
AOP_INLINE int aop_spsc_side_busy(const aop_atomic_u32 *c)
{
    /* relaxed: used in GIL builds only, by a thread holding the GIL; a claimer set the flag
     * before it released the GIL, and the GIL hand-over orders that store before this load */
    return aop_load_u32(c, AOP_RELAXED) != 0;
}

/* Free slots as the producer sees them (refreshing its copy of head if needed). */
AOP_INLINE uint64_t aop_spsc_room_(aop_spsc_t *q, uint64_t t, uint64_t want)
{
    uint64_t room = q->cap - (t - q->cached_head);
    if (room < want) {
        /* acquire: pairs with the consumer's seq_cst (release) store of head: its reads of
         * the slots below head happened before we overwrite them */
        q->cached_head = aop_load_u64p(&q->head, AOP_ACQUIRE);
        room = q->cap - (t - q->cached_head);
    }
    return room;
}

/* Items as the consumer sees them.  *tail_raw receives the tail word if it was re-read. */
AOP_INLINE uint64_t aop_spsc_avail_(aop_spsc_t *q, uint64_t h, uint64_t want, int *closed)
{
    uint64_t t, avail = q->cached_tail - h;
    *closed = 0;
    if (avail < want) {
        /* acquire: pairs with the producer's seq_cst (release) CAS of tail: the slots below
         * it are written */
        t = aop_load_u64p(&q->tail, AOP_ACQUIRE);
        q->cached_tail = t & ~AOP_Q_MARK;
        avail = q->cached_tail - h;
        *closed = (t & AOP_Q_MARK) != 0;
    }
    return avail;
}

/* Producer only.  Pushes up to n words; *pushed receives how many. */
AOP_INLINE int aop_spsc_push_many_(aop_spsc_t *q, const uint64_t *v, uint64_t n, uint64_t *pushed)
{
    /* relaxed: we are the only writer of tail besides close(), whose mark the CAS checks */
    uint64_t t = aop_load_u64p(&q->tail, AOP_RELAXED), room, i, expected;
    *pushed = 0;
    if (AOP_Q_UNLIKELY(t & AOP_Q_MARK)) return AOP_Q_CLOSED;
    if (n == 0) return AOP_Q_OK;
    room = aop_spsc_room_(q, t, n);
    if (room == 0) return AOP_Q_RETRY;
    if (room < n) n = room;
    for (i = 0; i < n; i++) q->buf[(t + i) & q->mask] = v[i];
    expected = t;
    /* seq_cst CAS (N1): release publishes the slots to the consumer's acquire of tail; it
     * fails only if close() set the mark meanwhile, and then the slots are never read */
    if (AOP_Q_UNLIKELY(!aop_cas_u64p(&q->tail, &expected, t + n, AOP_SEQ_CST, AOP_RELAXED)))
        return AOP_Q_CLOSED;
    aop_qwait_notify(&q->not_empty);
    *pushed = n;
    return AOP_Q_OK;
}

AOP_INLINE int aop_spsc_push_(aop_spsc_t *q, uint64_t v)
{
    uint64_t pushed;
    return aop_spsc_push_many_(q, &v, 1, &pushed);
}

/* Consumer only.  Pops up to n words into out; *popped receives how many. */
AOP_INLINE int aop_spsc_pop_many_(aop_spsc_t *q, uint64_t *out, uint64_t n, uint64_t *popped)
{
    /* relaxed: only we write head */
    uint64_t h = aop_load_u64p(&q->head, AOP_RELAXED), avail, i;
    int closed;
    *popped = 0;
    avail = aop_spsc_avail_(q, h, n ? n : 1, &closed);
    if (avail == 0) return closed ? AOP_Q_CLOSED : (n == 0 ? AOP_Q_OK : AOP_Q_RETRY);
    if (n == 0) return AOP_Q_OK;
    if (avail < n) n = avail;
    for (i = 0; i < n; i++) out[i] = q->buf[(h + i) & q->mask];
    /* seq_cst store (N1 for the producer): release orders our slot reads before the
     * producer's reuse (it acquires head) */
    aop_store_u64p(&q->head, h + n, AOP_SEQ_CST);
    aop_qwait_notify(&q->not_full);
    *popped = n;
    return AOP_Q_OK;
}

AOP_INLINE int aop_spsc_pop_(aop_spsc_t *q, uint64_t *out)
{
    uint64_t popped;
    return aop_spsc_pop_many_(q, out, 1, &popped);
}

AOP_INLINE uint64_t aop_spsc_size(aop_spsc_t *q)
{
    /* relaxed snapshots: approximate by contract */
    uint64_t h = aop_load_u64p(&q->head, AOP_RELAXED);
    uint64_t t = aop_load_u64p(&q->tail, AOP_RELAXED) & ~AOP_Q_MARK;
    int64_t n = (int64_t)(t - h);
    if (n < 0) return 0;
    return (uint64_t)n > q->cap ? q->cap : (uint64_t)n;
}

AOP_INLINE int aop_spsc_closed(aop_spsc_t *q)
{
    return (aop_load_u64p(&q->tail, AOP_ACQUIRE) & AOP_Q_MARK) != 0;   /* as MPMC */
}

AOP_INLINE void aop_spsc_close(aop_spsc_t *q) { aop_q_close(&q->tail, &q->not_empty, &q->not_full); }

AOP_FUNC int aop_spsc_try_push_cb(void *q, void *arg)
{ return aop_spsc_push_((aop_spsc_t *)q, *(uint64_t *)arg); }
AOP_FUNC int aop_spsc_try_pop_cb(void *q, void *arg)
{ return aop_spsc_pop_((aop_spsc_t *)q, (uint64_t *)arg); }

AOP_FUNC int aop_spsc_push_wait_(aop_spsc_t *q, uint64_t v, int64_t timeout_ns)
{
    int r = aop_spsc_push_(q, v);
    if (r != AOP_Q_RETRY || timeout_ns == 0) return r;   /* SPSC never reports BUSY */
    return aop_q_wait(&q->not_full, aop_spsc_try_push_cb, q, &v, timeout_ns);
}
AOP_FUNC int aop_spsc_pop_wait_(aop_spsc_t *q, uint64_t *out, int64_t timeout_ns)
{
    int r = aop_spsc_pop_(q, out);
    if (r != AOP_Q_RETRY || timeout_ns == 0) return r;
    return aop_q_wait(&q->not_empty, aop_spsc_try_pop_cb, q, out, timeout_ns);
}

/* Probes (see the MPMC ones).  Each runs on its own side's thread only, so updating that
 * side's private cached index is allowed, as the operations do. */
AOP_FUNC int aop_spsc_can_push_(void *queue, void *unused)
{
    aop_spsc_t *q = (aop_spsc_t *)queue;
    /* relaxed: we are the only writer of tail besides close(); as in push_many_ */
    uint64_t t = aop_load_u64p(&q->tail, AOP_RELAXED);
    (void)unused;
    if (t & AOP_Q_MARK) return AOP_Q_CLOSED;
    return aop_spsc_room_(q, t, 1) ? AOP_Q_OK : AOP_Q_RETRY;
}
AOP_FUNC int aop_spsc_can_pop_(void *queue, void *unused)
{
    aop_spsc_t *q = (aop_spsc_t *)queue;
    uint64_t h = aop_load_u64p(&q->head, AOP_RELAXED);   /* relaxed: only we write head */
    int closed;
    (void)unused;
    if (aop_spsc_avail_(q, h, 1, &closed)) return AOP_Q_OK;
    return closed ? AOP_Q_CLOSED : AOP_Q_RETRY;
}
AOP_FUNC int aop_spsc_room_wait_p(void *q, uint64_t *unused, int64_t timeout_ns)
{ (void)unused; return aop_q_wait(&((aop_spsc_t *)q)->not_full, aop_spsc_can_push_, q, NULL, timeout_ns); }
AOP_FUNC int aop_spsc_item_wait_p(void *q, uint64_t *unused, int64_t timeout_ns)
{ (void)unused; return aop_q_wait(&((aop_spsc_t *)q)->not_empty, aop_spsc_can_pop_, q, NULL, timeout_ns); }

/* Task accounting, as the MPMC ones (any thread: not tied to the producer or consumer side). */
AOP_FUNC int aop_spsc_task_done(aop_spsc_t *q) { return aop_q_task_done(&q->tasks, &q->tail); }
AOP_FUNC int aop_spsc_all_done(aop_spsc_t *q)
{ return aop_q_all_done_(&q->tasks, &q->tail) == AOP_Q_OK; }
AOP_FUNC int aop_spsc_join_wait_p(void *q, uint64_t *unused, int64_t timeout_ns)
{
    aop_spsc_t *s = (aop_spsc_t *)q;
    (void)unused;
    return aop_q_wait(&s->tasks.all_done, aop_q_all_done_, &s->tasks, &s->tail, timeout_ns);
}

/* Every published item, oldest first (see aop_mpmc_each_; same conditions). */
AOP_FUNC int aop_spsc_each_(aop_spsc_t *q, int (*fn)(uint64_t, void *), void *arg)
{
    uint64_t h = aop_load_u64p(&q->head, AOP_RELAXED);   /* relaxed: see aop_mpmc_each_ */
    uint64_t t = aop_load_u64p(&q->tail, AOP_RELAXED) & ~AOP_Q_MARK, i;
    int r;
    for (i = h; i < t; i++)
        if ((r = fn(q->buf[i & q->mask], arg)) != 0) return r;
    return 0;
}

/* ---- SPSC public C API (raw words; claims RAW mode; one producer, one consumer) ------- */
AOP_INLINE int aop_spsc_try_push_u64(aop_spsc_t *q, uint64_t v)
{
    if (AOP_Q_UNLIKELY(!aop_q_mode_ok(&q->mode, AOP_Q_MODE_RAW))) return AOP_Q_BADMODE;
    return aop_spsc_push_(q, v);
}
AOP_INLINE int aop_spsc_try_pop_u64(aop_spsc_t *q, uint64_t *out)
{
    if (AOP_Q_UNLIKELY(!aop_q_mode_ok(&q->mode, AOP_Q_MODE_RAW))) return AOP_Q_BADMODE;
    return aop_spsc_pop_(q, out);
}
AOP_FUNC int aop_spsc_push_u64(aop_spsc_t *q, uint64_t v, int64_t timeout_ns)
{
    if (!aop_q_mode_ok(&q->mode, AOP_Q_MODE_RAW)) return AOP_Q_BADMODE;
    return aop_spsc_push_wait_(q, v, timeout_ns);
}
AOP_FUNC int aop_spsc_pop_u64(aop_spsc_t *q, uint64_t *out, int64_t timeout_ns)
{
    if (!aop_q_mode_ok(&q->mode, AOP_Q_MODE_RAW)) return AOP_Q_BADMODE;
    return aop_spsc_pop_wait_(q, out, timeout_ns);
}
AOP_FUNC int aop_spsc_push_many_u64(aop_spsc_t *q, const uint64_t *v, uint64_t n, uint64_t *pushed)
{
    *pushed = 0;
    if (!aop_q_mode_ok(&q->mode, AOP_Q_MODE_RAW)) return AOP_Q_BADMODE;
    return aop_spsc_push_many_(q, v, n, pushed);
}
AOP_FUNC int aop_spsc_pop_many_u64(aop_spsc_t *q, uint64_t *out, uint64_t n, uint64_t *popped)
{
    *popped = 0;
    if (!aop_q_mode_ok(&q->mode, AOP_Q_MODE_RAW)) return AOP_Q_BADMODE;
    return aop_spsc_pop_many_(q, out, n, popped);
}

#endif /* AOP_QUEUE_H */
