"""get_async() and put_async() of MPMCQueue and SPSCQueue, as Python coroutine functions.

They are written in Python, not as compiled ``async def`` methods, so that they are what
inspect, asyncio and unittest.mock take for coroutine functions: inspect.iscoroutinefunction
is True for them, mock.create_autospec makes AsyncMocks of them, and a call returns a native
coroutine.  The fast path (an item, or room, at once) is one get_nowait() / put_nowait();
the wait itself (register a future, re-check, await a wake-up) is the queue's compiled
_get_async_wait() / _put_async_wait() (aoprim/_qcore.pxd, "asyncio waiters").
"""
from aoprim.errors import Empty, Full


def async_methods(cls_name, module):
    """The (get_async, put_async) functions of the class cls_name of module."""

    async def get_async(self):
        """Remove and return an item, awaiting one if the queue is empty (for coroutines;
        threads may put meanwhile: their put wakes this coroutine through its loop).  Closed
        once the queue is closed and drained.  Cancelling it takes no item and leaves
        nothing registered."""
        try:
            return self.get_nowait()
        except Empty:
            pass
        return await self._get_async_wait()

    async def put_async(self, item):
        """Put item, awaiting room if the queue is full (for coroutines; a get in any thread
        wakes this coroutine).  Closed if the queue is (or gets) closed.  Cancelling it
        before it returns leaves the item not queued and nothing registered."""
        try:
            return self.put_nowait(item)
        except Full:
            pass
        return await self._put_async_wait(item)

    for f in (get_async, put_async):
        f.__qualname__ = f"{cls_name}.{f.__name__}"
        f.__module__ = module
    return get_async, put_async
