"""aoprim.aio's compiled call_soon / call_at / call_later against asyncio's own
selector loop, on the same script: odd callbacks and deadlines (what raises, with what
message), equal deadlines scheduled from a timer, mass cancellation (the cancelled-handle
cleanup), a raising callback (the exception handler's context keys), use after close."""
import asyncio
import decimal

import pytest

import aoprim.aio

pytestmark = pytest.mark.timeout(30)


def _scenario(loop):
    out = []
    def rec(*a): out.append(a)
    async def coro(): pass
    tries = {
      'noncall': lambda: loop.call_soon(5),
      'coro': lambda: loop.call_soon(coro),
            'ctx': lambda: loop.call_soon(rec, context=5),
      'nan': lambda: loop.call_at(float('nan'), rec, 'nan'),
      'inf': lambda: loop.call_at(float('inf'), rec, 'inf'),
      'huge': lambda: loop.call_at(1e300, rec, 'huge'),
      'neg': lambda: loop.call_at(-5, rec, 'neg'),
      'int': lambda: loop.call_at(int(loop.time()), rec, 'int'),
      'bool': lambda: loop.call_at(True, rec, 'bool'),
      'dec': lambda: loop.call_at(decimal.Decimal(1), rec, 'dec'),
      'later_neg': lambda: loop.call_later(-1, rec, 'ln'),
      'later_nan': lambda: loop.call_later(float('nan'), rec, 'lnan'),
    }
    res = {}
    for k, f in tries.items():
        try: h = f(); res[k] = ('ok', type(h).__name__)
        except BaseException as e: res[k] = (type(e).__name__, str(e))
    # equal deadlines inside timer
    t = loop.time() + 0.01
    def tcb(i):
        out.append(('t', i))
        if i < 3:
            for j in range(3): loop.call_at(t, tcb, i * 10 + j + 10)
    for i in range(3): loop.call_at(t, tcb, i)
    hs = [loop.call_later(0.005, rec, 'c', i) for i in range(200)]
    for h in hs[::3] + hs[1::3]: h.cancel()
    loop.call_later(0.05, loop.stop)
    ctxs = []
    def exc(l, c): ctxs.append(sorted(c)); 
    loop.set_exception_handler(exc)
    loop.call_soon(lambda: 1/0)
    try: loop.run_forever()
    except BaseException as e: out.append(('raised', type(e).__name__))
    for _ in range(2):    # timers a late (loaded) iteration left due: no ordering by load
        loop.call_soon(loop.stop)
        loop.run_forever()
    res['out'] = out; res['ctxs'] = ctxs
    res['sched'] = (len(loop._scheduled), loop._timer_cancelled_count)
    loop.close()
    for k, f in [('closed_soon', lambda: loop.call_soon(rec)), ('closed_at', lambda: loop.call_at(1, rec)), ('closed_later', lambda: loop.call_later(1, rec))]:
        try: f(); res[k]='ok'
        except BaseException as e: res[k] = (type(e).__name__, str(e))
    return res


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_scheduling_calls_behave_as_asyncios():
    want = _scenario(asyncio.SelectorEventLoop())
    got = _scenario(aoprim.aio.new_event_loop())
    assert got == want


def test_call_soon_rejects_keyword_arguments_like_asyncio():
    loop = aoprim.aio.new_event_loop()
    try:
        with pytest.raises(TypeError, match="unexpected keyword argument 'x'"):
            loop.call_soon(print, x=1)
        assert not loop._ready
    finally:
        loop.close()


def _run_after_selector_close(loop):
    loop.call_soon(loop.stop)
    loop.run_forever()
    loop._close_self_pipe()         # now: it unregisters from the selector
    loop._close_self_pipe = lambda: None
    loop._selector.close()
    loop.call_soon(loop.stop)
    try:
        with pytest.raises(ValueError) as info:
            loop.run_forever()
        return str(info.value)
    finally:
        loop._selector = None       # closed already
        loop.close()


def test_a_closed_selector_raises_as_asyncios_and_never_waits_on_its_old_fd():
    """The compiled wait kept the epoll fd number: after the selector closed it waited on
    it (EBADF, or an unrelated fd once the number was reused)."""
    want = _run_after_selector_close(asyncio.SelectorEventLoop())
    assert _run_after_selector_close(aoprim.aio.new_event_loop()) == want
