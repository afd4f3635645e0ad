"""Helpers shared by the tests (importable because conftest puts tests/ on sys.path)."""
import os
import sys
import threading

# A free-threaded build running without the GIL (sys._is_gil_enabled: 3.13+)
FREE_THREADED = not getattr(sys, "_is_gil_enabled", lambda: True)()

# Scale factor for stress tests: AOPRIM_STRESS=10 for a long soak.
STRESS = float(os.environ.get("AOPRIM_STRESS", "1"))


def scaled(n):
    return max(1, int(n * STRESS))


def run_threads(targets, timeout=60):
    """Start one thread per callable (all released together by a barrier), join them all
    within `timeout`, and re-raise the first exception any of them raised."""
    errors = []
    barrier = threading.Barrier(len(targets))

    def wrap(fn):
        def run():
            try:
                barrier.wait(timeout)
                fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
                errors.append(e)
        return run

    threads = [threading.Thread(target=wrap(t), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    alive = [t for t in threads if t.is_alive()]
    assert not alive, f"{len(alive)} thread(s) still running after {timeout}s"
    if errors:
        raise errors[0]


def start_threads(fns):
    """Start one thread per callable and return (threads, errors) at once, for a test that
    works (a loop to run, a server to drive) while they run; join them with join_all."""
    errors = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - the test asserts errors is empty
                errors.append(e)
        return run

    ts = [threading.Thread(target=wrap(f)) for f in fns]
    for t in ts:
        t.start()
    return ts, errors


def join_all(ts, timeout=120):
    for t in ts:
        t.join(timeout)
    alive = [t.name for t in ts if t.is_alive()]
    assert not alive, f"threads still running: {alive}"


def skip_nomemory_on_free_threaded():
    """Skip a test that injects allocation failures with ``_testcapi.set_nomemory`` on a
    free-threaded build: there a failed allocation inside CPython itself can corrupt
    mimalloc's heaps (on 3.13.5t a pure-Python script that makes one list allocation fail
    hangs at interpreter exit, spinning in ``_mi_page_free_collect``), so what the test
    checks cannot be told from the interpreter's own damage -- and a damaged test worker
    hangs later tests."""
    import pytest
    if FREE_THREADED:
        pytest.skip("_testcapi.set_nomemory corrupts the free-threaded build's mimalloc heaps "
                    "(CPython's own allocations do not survive the injected failures)")
