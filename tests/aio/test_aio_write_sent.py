"""When a write leaves: one made in resume_writing() and followed by loop.stop() or a raise,
and one made while the loop is not running, reach the peer as on asyncio's loop and uvloop.
Each runs on the three loops (asyncio is the baseline and is asserted too); the helpers are
test_aio_dropin's.
"""
import asyncio
import socket

import pytest

from test_aio_dropin import Rec, kinds, loop_of, read_until_eof  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(60)


class ResumeThen(Rec):
    """resume_writing() writes a last line, then stops the loop or raises ``exc``."""

    def __init__(self, loop, then):
        super().__init__(loop)
        self.then = then

    def resume_writing(self):
        super().resume_writing()
        self.transport.write(b"after-resume")
        if self.then == "stop":
            self.loop.stop()
        else:
            raise self.then()


def drain_now(sock):
    """Everything ``sock`` can receive without waiting."""
    sock.setblocking(False)
    got = bytearray()
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except BlockingIOError:
            return bytes(got)
        if not chunk:
            return bytes(got)
        got += chunk


def kernel_capacity(a, b):
    """How many bytes the kernel takes on ``a`` before the peer ``b`` reads (then drained)."""
    a.setblocking(False)
    n = 0
    try:
        while True:
            n += a.send(b"k" * 65536)
    except BlockingIOError:
        pass
    assert len(drain_now(b)) == n
    return n


@pytest.mark.parametrize("then", ["stop", KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("kind", kinds())
def test_write_in_resume_writing_then_stop_or_raise_is_sent(loop_of, kind, then):
    """A write made in resume_writing() once the kernel took the whole buffer is sent before
    run_forever() returns -- also when resume_writing() then stops the loop or raises
    KeyboardInterrupt / SystemExit (asyncio's write() sends it at once into the empty
    buffer; aoprim.aio kept it for the writer's next select(), which never came)."""
    if kind == "uvloop" and then != "stop":
        pytest.skip("uvloop reports an exception raised by resume_writing() and runs on")
    loop = loop_of(kind)
    a, b = socket.socketpair()
    cap = kernel_capacity(a, b)
    tr, pr = loop.run_until_complete(
        loop.create_connection(lambda: ResumeThen(loop, then), sock=a))
    # low=0: resume_writing() only once the transport's buffer is empty, on every loop
    tr.set_write_buffer_limits(high=100, low=0)
    payload = b"x" * (cap + 5000)
    tr.write(payload)                   # the kernel takes about cap: paused, ~5000 left
    assert pr.events == ["made", "pause"]
    first = drain_now(b)                # the kernel's buffer is empty again
    assert 0 < len(first) < len(payload)
    if then == "stop":
        loop.run_forever()
    else:
        with pytest.raises(then):
            loop.run_forever()
    # the writer sent the rest at once (it fits), resume_writing() wrote: the loop is not
    # running, so what the peer can read now was sent before run_forever() returned
    rest = drain_now(b)
    tr.abort()
    loop.run_until_complete(asyncio.wait_for(asyncio.shield(pr.lost), 5))
    b.close()
    assert pr.events[:3] == ["made", "pause", "resume"]
    assert first + rest == payload + b"after-resume"


@pytest.mark.parametrize("kind", kinds())
def test_write_while_the_loop_is_not_running_is_sent_at_once(loop_of, kind):
    """write() between two run_until_complete() calls, and after stop(): the peer has the
    bytes at once, as asyncio's and uvloop's write() send them (aoprim.aio kept them until
    the loop ran again)."""
    loop = loop_of(kind)
    a, b = socket.socketpair()
    tr, pr = loop.run_until_complete(loop.create_connection(lambda: Rec(loop), sock=a))
    b.setblocking(False)

    def now():
        try:
            return b.recv(100)              # no waiting: the kernel has it or not
        except BlockingIOError:
            return b""
    tr.write(b"between")
    tr.writelines([b"lines", bytearray(b"+array")])
    between = now()
    loop.call_soon(loop.stop)
    loop.run_forever()
    tr.write(b"after-stop")
    after_stop = now()
    tr.close()
    loop.run_until_complete(asyncio.wait_for(asyncio.shield(pr.lost), 5))
    b.close()
    assert (between, after_stop) == (b"betweenlines+array", b"after-stop")
