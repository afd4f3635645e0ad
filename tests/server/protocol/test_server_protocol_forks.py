"""A process a protocol forks from a loop callback (``call_soon``, ``call_later``), a task
step or ``resume_writing`` that ends with ``sys.exit(n)`` exits with ``n`` (docs/server.md,
"Forks and the standard fds"), as from ``data_received`` -- asyncio's Handle and Task let
the ``SystemExit`` through, and it must not end the fork's loop thread with status 0.  Both
Layer 1 backends, with and without workers."""
import asyncio
import os
import socket
import sys

import pytest

from server_support import recv_until_closed
from protocol_support import backend, serve, workers  # noqa: F401

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")]

BIG = 3_000_000         # a reply the socket does not take at once: resume_writing follows


def fork_and_report(transport, code):
    """Fork; the child ends with sys.exit(code), the parent writes the child's status."""
    pid = os.fork()
    if pid == 0:
        sys.exit(code)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    transport.write(b"status:%d;" % status)
    transport.close()


class ForksFrom(asyncio.Protocol):
    """The request names where to fork: b"call_soon", b"call_later", b"task",
    b"resume_writing" (after a reply of BIG bytes), b"data_received"."""

    def connection_made(self, transport):
        self.t = transport
        self.where = None
        # (a small send buffer: the kernel cannot take the BIG reply at once)
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                                      1 << 16)

    def data_received(self, data):
        loop = asyncio.get_running_loop()
        self.where = where = data.decode()
        if where == "call_soon":
            loop.call_soon(fork_and_report, self.t, 7)
        elif where == "call_later":
            loop.call_later(0.001, fork_and_report, self.t, 7)
        elif where == "task":
            loop.create_task(self.step())
        elif where == "resume_writing":
            self.t.write(b"x" * BIG)
        else:
            fork_and_report(self.t, 7)

    async def step(self):
        await asyncio.sleep(0)
        fork_and_report(self.t, 7)

    def resume_writing(self):
        if self.where == "resume_writing":
            self.where = None
            fork_and_report(self.t, 7)


@pytest.mark.parametrize("where", ["call_soon", "call_later", "task", "resume_writing",
                                   "data_received"])
def test_a_fork_from_a_loop_callback_exits_with_its_sys_exit_status(serve, where):
    srv = serve(ForksFrom)
    with socket.socket() as c:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        c.settimeout(30)
        c.connect(srv.address)
        c.sendall(where.encode())
        data, how = recv_until_closed(c, timeout=30)
    pad = BIG if where == "resume_writing" else 0
    assert data[pad:] == b"status:7;", (len(data), data[-40:], how)
    assert data[:pad] == b"x" * pad


class ExitInsideWrite(asyncio.Protocol):
    """A fork whose write() calls pause_writing, which ends the fork with sys.exit(5), in
    code that guards the write with ``except Exception`` (as much application code does)."""

    def connection_made(self, transport):
        self.t = transport
        self.pid = os.getpid()

    def pause_writing(self):
        if os.getpid() != self.pid:
            sys.exit(5)

    def data_received(self, data):
        pid = os.fork()
        if pid == 0:
            self.t.set_write_buffer_limits(high=1)
            try:
                self.t.write(b"x" * 10_000_000)
            except Exception:
                os._exit(3)             # caught: the fork's SystemExit taken for an error
            os._exit(4)                 # went on past sys.exit(5)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        self.t.write(b"status:%d;" % status)
        self.t.close()


def test_a_forks_sys_exit_inside_write_is_no_exception_to_the_code_around_it(serve, workers):
    """asyncio: a SystemExit raised by pause_writing inside write() passes the application's
    ``except Exception`` and ends the fork with its status; so here.  (What the fork wrote
    before it may reach the peer: the fork shares the socket, as asyncio's does.)"""
    if workers:
        pytest.skip("on a worker, write() hands the bytes to the loop thread, which calls "
                    "pause_writing there (docs/server.md): none comes inside a fork's write")
    srv = serve(ExitInsideWrite)
    with socket.create_connection(srv.address, timeout=30) as c:
        c.sendall(b"go")
        data, how = recv_until_closed(c, timeout=30)
    assert data.endswith(b"status:5;") and data.strip(b"x") == b"status:5;", (data[-40:], how)
