# cython: language_level=3
"""One-owner claims for the compiled types that belong to one thread at a time.

With the GIL, every method of such a type runs alone; on a free-threaded build two
threads can be inside one object at once, and its C fields, its buffers and the Python
objects it holds (read with a plain load, then an INCREF) would be raced on.  A claim
keeps that from crashing: each entry point claims the object's word with one atomic
exchange (or compare-exchange) and gives it back with a release store.  A second thread
entering meanwhile is refused with RuntimeError naming the type, and nothing changes.
Nothing ever waits: a claim that fails raises at once, so no claim can deadlock.

Two kinds, as SendBatch's ``busy``:

- ``claim``/``unclaim`` on an ``aop_atomic_u32``: not re-entrant.  For types whose methods
  never call back into Python while claimed (BlockTable, ProxyParser): convert arguments
  (``__index__``, buffer exports) before claiming.
- ``wclaim``/``rclaim`` on an ``aop_atomic_u32``: a readers-writer claim (BlockTable), for a
  type whose reads may be shared: any number of readers at once (the word counts them), or
  one writer (the word is RW_WRITER).  A writer meeting a reader, or a reader meeting a
  writer, is refused as above; readers never refuse each other.  A writer claims with a
  compare-exchange from 0 (an exchange would overwrite the readers' count) and gives the
  word back with ``unclaim``; a reader gives its share back with ``runclaim``.
- ``tclaim``/``tunclaim`` on an ``aop_atomic_i64`` holding the owner's thread ident: a
  nested call from the owning thread (a handler that calls back into its own object, as a
  Receiver's on_frame calling close()) is let through, and only the outermost entry gives
  the claim back.  For types that call Python code while claimed (Receiver, RxArena).

Cost: one locked exchange (or compare-exchange) and one plain store per call, uncontended
(the word lives in the object's own cache line, which the owner already holds).
"""
from libc.stdint cimport int64_t
from cpython.pythread cimport PyThread_get_thread_ident
from libc.stdint cimport uint32_t
from aoprim.atomic_h cimport (
    AOP_ACQUIRE, AOP_RELAXED, AOP_RELEASE, aop_atomic_i64, aop_atomic_u32, aop_cas_i64,
    aop_cas_u32, aop_exchange_u32, aop_fetch_sub_u32, aop_load_u32, aop_store_i64,
    aop_store_u32,
)


cdef inline bint claim(aop_atomic_u32 *w) noexcept nogil:
    # acquire: pairs with the release store in unclaim() by the previous owner, so every
    # field it wrote (and every buffer byte) is visible to us before we read them
    return aop_exchange_u32(w, 1, AOP_ACQUIRE) == 0


cdef inline void unclaim(aop_atomic_u32 *w) noexcept nogil:
    # release: our writes to the object happen-before the next owner's acquire in claim()
    aop_store_u32(w, 0, AOP_RELEASE)


cdef enum:
    RW_WRITER = 0x80000000     # a readers-writer word held by its writer (else: readers)


cdef inline bint wclaim(aop_atomic_u32 *w) noexcept nogil:
    """Claim a readers-writer word for writing: only when nobody (reader or writer) holds it."""
    cdef uint32_t seen = 0
    # acquire on success: pairs with the release in unclaim()/runclaim() of the previous
    # holders, so what a previous writer wrote is visible, and no reader still reads what we
    # are about to change.  relaxed on failure: we only refuse.
    return aop_cas_u32(w, &seen, RW_WRITER, AOP_ACQUIRE, AOP_RELAXED)


cdef inline bint rclaim(aop_atomic_u32 *w) noexcept nogil:
    """Claim a readers-writer word for reading: refused only while a writer holds it."""
    # relaxed first read: the compare-exchange below re-checks it
    cdef uint32_t seen = aop_load_u32(w, AOP_RELAXED)
    while True:
        if seen & RW_WRITER:
            return False
        # acquire on success: pairs with the last writer's release in unclaim(), so every
        # field and buffer byte it wrote is visible before we read them.  relaxed on
        # failure: ``seen`` is reloaded and checked again (another reader came or left)
        if aop_cas_u32(w, &seen, seen + 1, AOP_ACQUIRE, AOP_RELAXED):
            return True


cdef inline void runclaim(aop_atomic_u32 *w) noexcept nogil:
    # release: our reads happen-before a later writer's acquire in wclaim(), so it cannot
    # change (or free) what we read while we still read it
    aop_fetch_sub_u32(w, 1, AOP_RELEASE)


cdef inline int owner_busy(str what) except -1:
    raise RuntimeError(f"{what} is in use by another thread (one owner at a time: "
                       "hand it over between calls, not during one)")


cdef enum:
    TCLAIM_OUTER = 1        # claimed: call tunclaim() when done
    TCLAIM_NESTED = 0       # the calling thread already owns it: do not tunclaim()


cdef inline int tclaim(aop_atomic_i64 *w, str what) except -1:
    """Claim ``w`` for the calling thread: TCLAIM_OUTER (release it with tunclaim), or
    TCLAIM_NESTED when this thread is already inside (leave it claimed), or RuntimeError
    when another thread is."""
    cdef int64_t me = <int64_t>PyThread_get_thread_ident()
    cdef int64_t seen = 0
    # acquire on success: pairs with tunclaim()'s release store by the previous owner.
    # relaxed on failure: we then only compare the ident we saw with our own, and only our
    # own thread ever stores our ident, so a stale value can never equal it wrongly.
    if aop_cas_i64(w, &seen, me, AOP_ACQUIRE, AOP_RELAXED):
        return TCLAIM_OUTER
    if seen == me:
        return TCLAIM_NESTED
    owner_busy(what)
    return -1


cdef inline void tunclaim(aop_atomic_i64 *w) noexcept nogil:
    # release: our writes happen-before the next owner's acquire in tclaim()
    aop_store_i64(w, 0, AOP_RELEASE)
