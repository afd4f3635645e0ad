"""The accept policy (aoprim/server/listener.py), driven through a recording stand-in of the
Layer 1 interface: what the listener registers, when it pauses, when it resumes."""
import errno
import socket

import pytest

from aoprim.server.config import Settings
from aoprim.server.listener import Listener, make_listening_socket


class FakeLoop:
    """Just the Layer 1 methods the listener uses; timers are run by the test."""

    def __init__(self):
        self.readers = {}
        self.timers = []

    def add_reader(self, fd, cb):
        self.readers[fd] = cb

    def remove_reader(self, fd):
        self.readers.pop(fd, None)

    def call_later(self, delay, cb, *args):
        t = FakeTimer(delay, cb, args)
        self.timers.append(t)
        return t

    def fire_timers(self):
        ts, self.timers = self.timers, []
        for t in ts:
            if not t.cancelled:
                t.cb(*t.args)


class FakeTimer:
    def __init__(self, delay, cb, args):
        self.delay, self.cb, self.args, self.cancelled = delay, cb, args, False

    def cancel(self):
        self.cancelled = True


@pytest.fixture
def lsock():
    s = make_listening_socket("127.0.0.1", 0, 128, False)
    yield s
    s.close()


def connect_n(addr, n):
    return [socket.create_connection(addr, timeout=5) for _ in range(n)]


def test_one_readiness_event_accepts_at_most_accept_batch(lsock):
    loop = FakeLoop()
    got = []
    lst = Listener(loop, lsock, Settings(accept_batch=4), lambda s, a: got.append(s),
                   lambda: True)
    lst.start()
    clients = connect_n(lsock.getsockname(), 10)
    try:
        loop.readers[lsock.fileno()]()
        assert len(got) == 4                # the old code accepted all 10 in one event
        loop.readers[lsock.fileno()]()      # level-triggered: called again for the rest
        loop.readers[lsock.fileno()]()
        assert len(got) == 10
    finally:
        for s in got + clients:
            s.close()


def test_at_the_limit_connections_wait_in_the_backlog(lsock):
    loop = FakeLoop()
    got = []
    room = [2]
    lst = Listener(loop, lsock, Settings(), lambda s, a: got.append(s),
                   lambda: len(got) < room[0])
    lst.start()
    clients = connect_n(lsock.getsockname(), 4)
    try:
        loop.readers[lsock.fileno()]()
        assert len(got) == 2
        assert lsock.fileno() not in loop.readers       # stopped accepting: not closing
        assert lst.pauses_full == 1
        room[0] = 3
        lst.room_freed()
        assert lsock.fileno() in loop.readers
        loop.readers[lsock.fileno()]()
        assert len(got) == 3                # the waiting connection, accepted intact
        got[2].sendall(b"x")
    finally:
        for s in got + clients:
            s.close()


class FailingListenSocket(socket.socket):
    """A listening socket whose accept fails with a chosen errno."""
    err = errno.EINVAL

    def accept(self):
        raise OSError(self.err, "injected")


@pytest.mark.parametrize("err,delay", [(errno.EINVAL, 0.01), (errno.EMFILE, 0.1),
                                       (errno.ENOBUFS, 0.1)])
def test_an_accept_error_pauses_instead_of_spinning(err, delay):
    """With level-triggered readiness, returning after an unexpected accept error (the old
    code, for anything but EMFILE/ENFILE) makes the loop spin at 100 % CPU."""
    s = FailingListenSocket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    s.setblocking(False)
    FailingListenSocket.err = err
    loop = FakeLoop()
    lst = Listener(loop, s, Settings(), lambda s, a: None, lambda: True)
    lst.start()
    try:
        loop.readers[s.fileno()]()
        assert s.fileno() not in loop.readers       # paused: no spin
        assert [t.delay for t in loop.timers] == [delay]
        assert lst.accept_errors == 1
        loop.fire_timers()
        assert s.fileno() in loop.readers           # and it comes back
        if err == errno.EINVAL:                     # unknown errors back off further
            loop.readers[s.fileno()]()
            assert [t.delay for t in loop.timers] == [0.02]
    finally:
        lst.close()


def test_errors_of_one_connection_are_skipped(lsock):
    loop = FakeLoop()
    got = []
    calls = []
    real_accept = lsock.accept

    class Wrapper:
        def fileno(self):
            return lsock.fileno()

        def accept(self):
            calls.append(1)
            if len(calls) == 1:
                raise OSError(errno.ECONNABORTED, "aborted before accept")
            return real_accept()

        def close(self):
            pass

    lst = Listener(loop, Wrapper(), Settings(), lambda s, a: got.append(s), lambda: True)
    lst.start()
    c = socket.create_connection(lsock.getsockname(), timeout=5)
    try:
        loop.readers[lsock.fileno()]()
        assert len(got) == 1 and not loop.timers
    finally:
        c.close()
        for x in got:
            x.close()
