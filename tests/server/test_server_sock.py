"""``Server(sock=...)``: a socket the server cannot accept on -- closed, not a stream
socket, not listening -- is refused at construction with a ``ValueError`` naming ``sock=``
and what is wrong, before anything is opened or started; the socket stays the caller's."""
import os
import socket
import tempfile
import threading

import pytest

from aoprim.server import Server
from aoprim.server.apps import Echo
from aoprim.server.loop import BACKENDS

from server_support import HOST, connect, make_server  # noqa: F401  (fixtures)


def _fds():
    return sorted(os.listdir("/proc/self/fd"))


def _bound():
    s = socket.socket()
    s.bind((HOST, 0))
    return s


def _udp():
    s = socket.socket(type=socket.SOCK_DGRAM)
    s.bind((HOST, 0))
    return s


def _unix_dgram():
    return socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)


def _seqpacket():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(os.path.join(tempfile.mkdtemp(), "s"))
    s.listen()
    return s


def _unix_bound():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(os.path.join(tempfile.mkdtemp(), "s"))
    return s


# what each socket is, the socket, and what the message must say
CASES = {
    "bound, not listening": (_bound, r"sock= is not listening \(fd \d+\): call bind\(\) "
                                     r"and listen\(\)"),
    "AF_UNIX, bound, not listening": (_unix_bound, r"sock= is not listening"),
    "UDP": (_udp, r"sock= is a SOCK_DGRAM socket \(UDP.*\), fd \d+: .*listening SOCK_STREAM"),
    "AF_UNIX datagram": (_unix_dgram, r"sock= is a SOCK_DGRAM"),
    "AF_UNIX seqpacket, listening": (_seqpacket, r"sock= is a SOCK_SEQPACKET socket"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_sock_that_cannot_accept_is_refused_naming_what_is_wrong(backend, case):
    make, match = CASES[case]
    sock = make()
    try:
        fds, threads = _fds(), threading.active_count()
        with pytest.raises(ValueError, match=match):
            Server(Echo(), sock=sock, backend=backend)
        assert _fds() == fds, "Server() left an fd open"
        assert threading.active_count() == threads
        assert sock.fileno() >= 0, "a refused sock= was closed: it is the caller's"
    finally:
        sock.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_connected_sock_is_refused_naming_its_peer(backend):
    ls = socket.socket()
    ls.bind((HOST, 0))
    ls.listen()
    c = socket.create_connection(ls.getsockname())
    peer, _ = ls.accept()
    try:
        fds = _fds()
        with pytest.raises(ValueError, match=r"sock= is connected to 127\.0\.0\.1:%d, "
                                             r"not listening" % c.getsockname()[1]):
            Server(Echo(), sock=peer, backend=backend)
        assert _fds() == fds
    finally:
        for s in (c, peer, ls):
            s.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_closed_sock_is_refused_by_name(backend):
    sock = socket.socket()
    sock.bind((HOST, 0))
    sock.listen()
    sock.close()
    fds = _fds()
    with pytest.raises(ValueError, match=r"sock= is closed .*: pass a bound and listening"):
        Server(Echo(), sock=sock, backend=backend)
    assert _fds() == fds


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sock_whose_fd_was_closed_behind_it_is_refused_by_name(backend):
    """The socket object still holds its number, but the fd was closed (os.close by other
    code): EBADF, said as sock=, not as a bare OSError."""
    sock = socket.socket()
    sock.bind((HOST, 0))
    sock.listen()
    fd = sock.fileno()
    os.close(fd)
    try:
        fds = _fds()
        with pytest.raises(ValueError, match=r"sock= cannot be used: fd %d is not an open "
                                             r"socket \(" % fd):
            Server(Echo(), sock=sock, backend=backend)
        assert _fds() == fds
    finally:
        sock.detach()               # (its number is no longer its own to close)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bound_and_listening_sock_is_served(backend, connect):
    """The check refuses nothing that can serve (a listening TCP socket, blocking or not)."""
    ls = socket.socket()
    ls.bind((HOST, 0))
    ls.listen()
    with Server(Echo(), sock=ls, backend=backend) as srv:
        c = connect(srv)
        c.sendall(b"ping")
        assert c.recv(4) == b"ping"
