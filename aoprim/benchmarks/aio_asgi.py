"""The ASGI apps of the aio benchmarks, served by uvicorn's command line on each loop
(``python -m uvicorn aoprim.benchmarks.aio_asgi:hello --loop LOOP --http httptools``).

``hello``  a minimal Starlette app: GET / -> "Hello, World!" (text/plain)
``sse``    a Starlette app streaming server-sent events the way an LLM API does:
           GET /sse?n=N opens a stream of N tokens; one engine task wakes every
           ``AOPRIM_SSE_STEP_MS`` (20) milliseconds and hands every open stream one token (a
           per-request ``asyncio.Queue``, as inference servers feed their responses); the
           response is a ``StreamingResponse`` yielding one ``data: ...`` event per token
"""
import asyncio
import os

from starlette.applications import Starlette
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

__all__ = ["hello", "sse", "TOKEN_EVENT"]

STEP_S = float(os.environ.get("AOPRIM_SSE_STEP_MS", "20")) / 1000.0
# one token's event, the size of an OpenAI-style streaming chunk's "data:" line
TOKEN_EVENT = (b'data: {"object":"chat.completion.chunk","choices":[{"index":0,'
               b'"delta":{"content":" token"}}]}\n\n')


async def _hello(request):
    return PlainTextResponse("Hello, World!")


hello = Starlette(routes=[Route("/", _hello)])


class Engine:
    """One engine step every STEP_S: each open stream's queue gets one token."""

    def __init__(self):
        self.streams = set()
        self.task = None

    async def run(self):
        while self.streams:
            await asyncio.sleep(STEP_S)
            for q in list(self.streams):
                q.put_nowait(TOKEN_EVENT)
        self.task = None

    def open(self):
        q = asyncio.Queue()
        self.streams.add(q)
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self.run())
        return q

    def close(self, q):
        self.streams.discard(q)


ENGINE = Engine()


async def _sse(request):
    n = int(request.query_params.get("n", "100"))

    async def tokens():
        q = ENGINE.open()
        try:
            for _ in range(n):
                yield await q.get()
            yield b"data: [DONE]\n\n"
        finally:
            ENGINE.close(q)
    return StreamingResponse(tokens(), media_type="text/event-stream")


sse = Starlette(routes=[Route("/sse", _sse)])
