"""A process a handler forks that ends with ``sys.exit(n)`` exits with ``n`` -- from every
hook's thread: the loop thread of ``start()``, a worker, the main thread -- as the
interpreter's exit would give it (None 0, an int itself, anything else 1), without running
the parent's exit handlers."""
import os
import signal
import socket
import sys

import pytest

from aoprim.server import Handler
from aoprim.server.loop import BACKENDS

from server_support import make_server  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


class ForksAndExits(Handler):
    """Each frame names the exit code (b"3", b"none", b"text"); the fork exits with it and
    the parent replies with the fork's status."""

    def on_read(self, session, data):
        arg = bytes(data)
        pid = os.fork()
        if pid == 0:
            if arg == b"interrupt":
                raise KeyboardInterrupt
            sys.exit(None if arg == b"none" else "bye" if arg == b"text" else int(arg))
        session.send(b"%d" % os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("arg, status", [
    (b"3", 3), (b"0", 0), (b"none", 0), (b"text", 1),
    # as the interpreter reads a code: a C long cast to int, anything larger -1
    (b"%d" % (2**40 + 3), 3), (b"%d" % 2**70, 255), (b"%d" % -2**70, 255), (b"-1", 255),
    # an uncaught KeyboardInterrupt: plain Python ends by SIGINT's default action
    (b"interrupt", -signal.SIGINT)],
    ids=["3", "0", "none", "text", "long", "huge", "minus-huge", "minus-1", "interrupt"])
def test_a_forks_sys_exit_is_its_status(make_server, workers, arg, status):
    srv = make_server(ForksAndExits(), framing="raw", workers=workers)
    with socket.create_connection(srv.address, timeout=20) as c:
        c.sendall(arg)
        assert int(c.recv(16)) == status


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, 5)],
                         ids=["SIGTERM", "SIGINT"])
def test_serve_forevers_signal_handler_in_a_fork_acts_as_plain_python(make_server, sig, status):
    """A stop signal that reaches a fork before its hook put the old handlers back finds
    serve_forever's handler: in the fork it acts as in a plain Python program (SIGTERM's
    default action; SIGINT a KeyboardInterrupt), never a request to the parent's loop."""
    srv = make_server(ForksAndExits(), framing="raw")
    pid = os.fork()
    if pid == 0:                        # (the fork: only this thread; always os._exit)
        try:
            srv._on_signal(sig, None)
            os._exit(3)                 # asked the parent's loop and returned
        except KeyboardInterrupt:
            os._exit(5)
        except BaseException:
            os._exit(4)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == status
    with socket.create_connection(srv.address, timeout=20) as c:     # the parent serves on
        c.sendall(b"0")
        assert int(c.recv(16)) == 0
