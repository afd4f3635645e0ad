/*
 * aop_atomic.h -- the one C header under every aoprim primitive.
 *
 * Static inline wrappers over the GCC/Clang __atomic builtins.  Every call site names its
 * memory order explicitly (AOP_RELAXED, AOP_ACQUIRE, AOP_RELEASE, AOP_ACQ_REL, AOP_SEQ_CST):
 * the functions take the order as an argument and, being static inline with a constant
 * argument, compile down to exactly the instruction that order needs.
 *
 * Also here: a CPU pause hint, a monotonic clock, a futex-style park/unpark on a 32-bit word
 * (Linux futex; a sleeping poll elsewhere), and aop_spinlock_t, the lock behind SpinLock.
 *
 * Everything is usable without the GIL and without any Python object.
 */
#ifndef AOP_ATOMIC_H
#define AOP_ATOMIC_H


#ifndef AOP_FUNC
/* A helper defined in this header: static, and unused in a module that does not call it
 * (no -Wunused-function warning in a cimporting extension). */
#define AOP_FUNC static __attribute__((unused))
#endif
#include <stdint.h>
#include <time.h>
#include <errno.h>
#include <sched.h>

#if !defined(__GNUC__) && !defined(__clang__)
#error "aoprim needs the GCC/Clang __atomic builtins"
#endif

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define AOP_RELAXED __ATOMIC_RELAXED
#define AOP_CONSUME __ATOMIC_CONSUME
#define AOP_ACQUIRE __ATOMIC_ACQUIRE
#define AOP_RELEASE __ATOMIC_RELEASE
#define AOP_ACQ_REL __ATOMIC_ACQ_REL
#define AOP_SEQ_CST __ATOMIC_SEQ_CST

/* Destructive-interference size.  128, not 64: x86's adjacent-line prefetcher pulls cache
 * lines in pairs, so two hot words 64 bytes apart still ping-pong between cores. */
#define AOP_CACHE_LINE 128

#define AOP_INLINE static inline __attribute__((always_inline))

/* ---- 64-bit and 32-bit integer atomics on plain memory ------------------------------- */

typedef struct { int64_t v; } aop_atomic_i64;   /* a naturally aligned 64-bit word */
typedef struct { uint32_t v; } aop_atomic_u32;   /* a 32-bit word (futex-sized) */

AOP_INLINE int64_t aop_load_i64(const aop_atomic_i64 *a, int order)
{ return __atomic_load_n(&a->v, order); }
AOP_INLINE void aop_store_i64(aop_atomic_i64 *a, int64_t v, int order)
{ __atomic_store_n(&a->v, v, order); }
AOP_INLINE int64_t aop_exchange_i64(aop_atomic_i64 *a, int64_t v, int order)
{ return __atomic_exchange_n(&a->v, v, order); }
/* Wrapping (two's complement) add/sub: done on the unsigned type so that overflow is
 * defined behaviour in C as well as in the hardware. */
AOP_INLINE int64_t aop_fetch_add_i64(aop_atomic_i64 *a, int64_t d, int order)
{ return (int64_t)__atomic_fetch_add((uint64_t *)&a->v, (uint64_t)d, order); }
AOP_INLINE int64_t aop_fetch_sub_i64(aop_atomic_i64 *a, int64_t d, int order)
{ return (int64_t)__atomic_fetch_sub((uint64_t *)&a->v, (uint64_t)d, order); }
/* Bitwise read-modify-writes (one locked instruction or LL/SC loop each); return the value
 * before the change.  On the unsigned type, as above: the bits are the same. */
AOP_INLINE int64_t aop_fetch_and_i64(aop_atomic_i64 *a, int64_t m, int order)
{ return (int64_t)__atomic_fetch_and((uint64_t *)&a->v, (uint64_t)m, order); }
AOP_INLINE int64_t aop_fetch_or_i64(aop_atomic_i64 *a, int64_t m, int order)
{ return (int64_t)__atomic_fetch_or((uint64_t *)&a->v, (uint64_t)m, order); }
AOP_INLINE int64_t aop_fetch_xor_i64(aop_atomic_i64 *a, int64_t m, int order)
{ return (int64_t)__atomic_fetch_xor((uint64_t *)&a->v, (uint64_t)m, order); }
/* Strong CAS.  On failure *expected receives the current value.  Returns 1 on success. */
AOP_INLINE int aop_cas_i64(aop_atomic_i64 *a, int64_t *expected, int64_t desired,
                           int success_order, int failure_order)
{ return __atomic_compare_exchange_n(&a->v, expected, desired, 0, success_order, failure_order); }
/* Weak CAS: may fail spuriously; for retry loops. */
AOP_INLINE int aop_cas_weak_i64(aop_atomic_i64 *a, int64_t *expected, int64_t desired,
                                int success_order, int failure_order)
{ return __atomic_compare_exchange_n(&a->v, expected, desired, 1, success_order, failure_order); }

AOP_INLINE uint32_t aop_load_u32(const aop_atomic_u32 *a, int order)
{ return __atomic_load_n(&a->v, order); }
AOP_INLINE void aop_store_u32(aop_atomic_u32 *a, uint32_t v, int order)
{ __atomic_store_n(&a->v, v, order); }
AOP_INLINE uint32_t aop_exchange_u32(aop_atomic_u32 *a, uint32_t v, int order)
{ return __atomic_exchange_n(&a->v, v, order); }
AOP_INLINE uint32_t aop_fetch_add_u32(aop_atomic_u32 *a, uint32_t d, int order)
{ return __atomic_fetch_add(&a->v, d, order); }
AOP_INLINE uint32_t aop_fetch_sub_u32(aop_atomic_u32 *a, uint32_t d, int order)
{ return __atomic_fetch_sub(&a->v, d, order); }
AOP_INLINE uint32_t aop_fetch_or_u32(aop_atomic_u32 *a, uint32_t bits, int order)
{ return __atomic_fetch_or(&a->v, bits, order); }
AOP_INLINE int aop_cas_u32(aop_atomic_u32 *a, uint32_t *expected, uint32_t desired,
                           int success_order, int failure_order)
{ return __atomic_compare_exchange_n(&a->v, expected, desired, 0, success_order, failure_order); }

/* Raw-pointer forms, for arrays of words (queue cells, free rings) that are not wrapped in a
 * struct.  Same semantics as above. */
AOP_INLINE uint64_t aop_load_u64p(const uint64_t *p, int order) { return __atomic_load_n(p, order); }
AOP_INLINE void aop_store_u64p(uint64_t *p, uint64_t v, int order) { __atomic_store_n(p, v, order); }
AOP_INLINE uint64_t aop_fetch_add_u64p(uint64_t *p, uint64_t d, int order)
{ return __atomic_fetch_add(p, d, order); }
AOP_INLINE int aop_cas_u64p(uint64_t *p, uint64_t *expected, uint64_t desired,
                            int success_order, int failure_order)
{ return __atomic_compare_exchange_n(p, expected, desired, 0, success_order, failure_order); }
AOP_INLINE int aop_cas_weak_u64p(uint64_t *p, uint64_t *expected, uint64_t desired,
                                 int success_order, int failure_order)
{ return __atomic_compare_exchange_n(p, expected, desired, 1, success_order, failure_order); }
AOP_INLINE void *aop_load_ptr(void *const *p, int order) { return __atomic_load_n(p, order); }
AOP_INLINE void aop_store_ptr(void **p, void *v, int order) { __atomic_store_n(p, v, order); }
AOP_INLINE void *aop_exchange_ptr(void **p, void *v, int order) { return __atomic_exchange_n(p, v, order); }

AOP_INLINE void aop_thread_fence(int order) { __atomic_thread_fence(order); }

/* ---- waiting ------------------------------------------------------------------------- */

/* CPU hint for spin-wait loops: lets the sibling hyperthread run and avoids the
 * memory-order-violation pipeline flush on loop exit. */
AOP_INLINE void aop_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
    __asm__ __volatile__("yield" ::: "memory");
#else
    __asm__ __volatile__("" ::: "memory");
#endif
}

AOP_INLINE void aop_yield(void) { sched_yield(); }

/* Monotonic time in nanoseconds. */
AOP_INLINE int64_t aop_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* The deadline of a wait of timeout_ns (> 0) starting now, saturated at INT64_MAX instead of
 * wrapping: a huge timeout (threading.TIMEOUT_MAX, INT64_MAX) is a very long wait, never one
 * that expired before it began.  The monotonic clock is >= 0, so INT64_MAX - now cannot
 * overflow. */
AOP_INLINE int64_t aop_deadline_ns(int64_t timeout_ns)
{
    int64_t now = aop_now_ns();
    return timeout_ns > INT64_MAX - now ? INT64_MAX : now + timeout_ns;
}

/* Sleep for ns nanoseconds (used by the portable park fallback). */
AOP_INLINE void aop_sleep_ns(int64_t ns)
{
    struct timespec ts;
    if (ns <= 0) return;
    ts.tv_sec = (time_t)(ns / 1000000000LL);
    ts.tv_nsec = (long)(ns % 1000000000LL);
    nanosleep(&ts, NULL);
}

/* Park the calling thread while *word == expected, for at most timeout_ns (< 0: no limit).
 * May return spuriously: callers always re-check their condition in a loop.  The kernel
 * compares *word with expected atomically with going to sleep, so a wake that follows a
 * change of *word can never be lost between the caller's check and the sleep.
 * Returns 0 when woken or when *word != expected, ETIMEDOUT on timeout, EINTR on a signal. */
AOP_INLINE int aop_park(aop_atomic_u32 *word, uint32_t expected, int64_t timeout_ns)
{
#ifdef __linux__
    struct timespec ts, *tsp = NULL;
    long r;
    if (timeout_ns >= 0) {
        ts.tv_sec = (time_t)(timeout_ns / 1000000000LL);
        ts.tv_nsec = (long)(timeout_ns % 1000000000LL);
        tsp = &ts;
    }
    r = syscall(SYS_futex, &word->v, FUTEX_WAIT_PRIVATE, expected, tsp, NULL, 0);
    if (r == 0) return 0;
    if (errno == EAGAIN) return 0;          /* *word had already changed */
    return errno;                            /* ETIMEDOUT or EINTR */
#else
    /* Portable fallback: a short sleep, then the caller re-checks.  Never burns a core. */
    int64_t step = 50000;  /* 50 us */
    if (__atomic_load_n(&word->v, __ATOMIC_ACQUIRE) != expected) return 0;
    if (timeout_ns >= 0 && timeout_ns < step) step = timeout_ns;
    aop_sleep_ns(step);
    return (timeout_ns >= 0 && timeout_ns <= step) ? ETIMEDOUT : 0;
#endif
}

/* Wake up to n threads parked on word (n = INT32_MAX: all). */
AOP_INLINE void aop_unpark(aop_atomic_u32 *word, int n)
{
#ifdef __linux__
    syscall(SYS_futex, &word->v, FUTEX_WAKE_PRIVATE, n, NULL, NULL, 0);
#else
    (void)word; (void)n;
#endif
}

/* ---- spin lock ------------------------------------------------------------------------
 *
 * A test-and-test-and-set lock with three waiting phases (as crossbeam's Backoff):
 *   1. spin: re-read the word (a plain load stays in the local cache, no bus traffic) with
 *      1, 2, 4 ... 64 pause hints between reads (exponential backoff);
 *   2. yield: sched_yield() a few times, so a preempted holder on this core can finish;
 *   3. park: sleep in the kernel (futex) until the holder's unlock wakes us.
 *
 * State word:  0 = unlocked, 1 = locked, 2 = locked and someone may be parked.
 * Invariants:
 *   - only a thread that moved the word from 0 to 1 or 2 owns the lock;
 *   - a thread parks only after setting the word to 2, so the unlocker (which exchanges the
 *     word to 0 and sees the 2) always issues a wake: no wake-up is lost;
 *   - a thread that wakes from a park takes the lock with exchange(2), never 1, because other
 *     parked threads may remain and must be woken by the next unlock.
 * Uncontended lock = one CAS (acquire); uncontended unlock = one exchange (release), and the
 * futex syscall happens only when the word says a waiter may be parked.
 */
typedef struct { aop_atomic_u32 state; } aop_spinlock_t;

#define AOP_SPIN_LIMIT 6     /* backoff doublings: 1 .. 64 pauses */
#define AOP_YIELD_LIMIT 4    /* sched_yield()s before parking */

AOP_INLINE void aop_spin_init(aop_spinlock_t *l) { aop_store_u32(&l->state, 0, AOP_RELAXED); }

AOP_INLINE int aop_spin_trylock(aop_spinlock_t *l)
{
    uint32_t expected = 0;
    /* relaxed pre-read: don't take the line exclusive (and bounce it) when visibly held */
    if (aop_load_u32(&l->state, AOP_RELAXED) != 0) return 0;
    /* acquire on success: the critical section cannot move above the lock;
     * relaxed on failure: we learned nothing we act on */
    return aop_cas_u32(&l->state, &expected, 1, AOP_ACQUIRE, AOP_RELAXED);
}

AOP_INLINE int aop_spin_locked(aop_spinlock_t *l)
{
    /* relaxed: a snapshot for introspection only, it orders nothing */
    return aop_load_u32(&l->state, AOP_RELAXED) != 0;
}

#define AOP_SPIN_INTR (-1)   /* aop_spin_lock_intr: a signal interrupted the park */

/* Acquire, waiting at most timeout_ns (< 0: forever).  Returns 1 if acquired, 0 on timeout,
 * and, when intr is set, AOP_SPIN_INTR as soon as a signal interrupts the park (so that the
 * caller can run signal handlers: Ctrl-C).  Leaving early is always consistent: a waiter
 * that leaves never owns the lock, and the word it leaves at 2 at worst costs the next
 * unlock one needless wake.  A park that ended in EINTR was not woken (the kernel reports a
 * wake that raced with the signal as a wake), so leaving then swallows no wake-up. */
AOP_FUNC int aop_spin_lock_wait_(aop_spinlock_t *l, int64_t timeout_ns, int intr)
{
    int64_t deadline = 0;
    int step, i, r;
    if (aop_spin_trylock(l)) return 1;
    if (timeout_ns == 0) return 0;

    /* phase 1: spin with exponential backoff, reading (not writing) the word */
    for (step = 0; step <= AOP_SPIN_LIMIT; step++) {
        for (i = 0; i < (1 << step); i++) aop_cpu_relax();
        if (aop_spin_trylock(l)) return 1;
    }
    /* the clock is read only now: a lock handed over while we spin costs no clock read
     * (the timeout then counts from here, a few hundred pauses late) */
    if (timeout_ns > 0) deadline = aop_deadline_ns(timeout_ns);
    /* phase 2: give the holder our core if it is waiting for one */
    for (step = 0; step < AOP_YIELD_LIMIT; step++) {
        aop_yield();
        if (aop_spin_trylock(l)) return 1;
        if (timeout_ns > 0 && aop_now_ns() >= deadline) return 0;
    }
    /* phase 3: announce a waiter (state 2) and park until unlocked.
     * exchange with acquire: if it returns 0 we own the lock (marked 2, which at worst
     * costs one needless wake on unlock). */
    while (aop_exchange_u32(&l->state, 2, AOP_ACQUIRE) != 0) {
        int64_t left = -1;
        if (timeout_ns > 0) {
            left = deadline - aop_now_ns();
            if (left <= 0) return 0;
        }
        r = aop_park(&l->state, 2, left);
        if (r == EINTR && intr) return AOP_SPIN_INTR;
        /* woken, spurious, signal or timeout: the loop re-checks all of them */
    }
    return 1;
}

/* Acquire, waiting at most timeout_ns (< 0: forever).  Returns 1 if acquired, 0 on timeout.
 * Signals do not end the wait. */
AOP_FUNC int aop_spin_lock_timed(aop_spinlock_t *l, int64_t timeout_ns)
{
    return aop_spin_lock_wait_(l, timeout_ns, 0);
}

/* As aop_spin_lock_timed, but returns AOP_SPIN_INTR when a signal interrupts the park. */
AOP_FUNC int aop_spin_lock_intr(aop_spinlock_t *l, int64_t timeout_ns)
{
    return aop_spin_lock_wait_(l, timeout_ns, 1);
}

AOP_INLINE void aop_spin_lock(aop_spinlock_t *l)
{
    if (!aop_spin_trylock(l)) aop_spin_lock_timed(l, -1);
}

AOP_INLINE void aop_spin_unlock(aop_spinlock_t *l)
{
    /* release: everything written in the critical section is visible to the next owner,
     * whose acquire CAS/exchange pairs with this store */
    if (aop_exchange_u32(&l->state, 0, AOP_RELEASE) == 2)
        aop_unpark(&l->state, 1);   /* someone may be parked: wake one */
}

/* Unlock, reporting whether the lock was held: the check and the release are one atomic
 * exchange, so two racing releases of a once-held lock cannot both succeed.  Returns 0 (and
 * changes nothing) if it was not locked. */
AOP_INLINE int aop_spin_unlock_checked(aop_spinlock_t *l)
{
    /* release: as aop_spin_unlock */
    uint32_t old = aop_exchange_u32(&l->state, 0, AOP_RELEASE);
    if (old == 2)
        aop_unpark(&l->state, 1);
    return old != 0;
}

#endif /* AOP_ATOMIC_H */
