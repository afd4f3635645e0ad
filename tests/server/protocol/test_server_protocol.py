"""serve_protocol: unchanged asyncio protocols on the aoprim server."""
import asyncio
import asyncio.trsock
import threading

import pytest

from aoprim.server import serve_protocol

from server_support import (HOST, assert_no_leaks, recv_exact, recv_until_closed,  # noqa: F401
                                 wait_for)
import socket


class EchoProtocol(asyncio.Protocol):
    """Written the way asyncio users write it -- nothing aoprim-specific."""

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.transport.write(data)


class UpperBuffered(asyncio.BufferedProtocol):
    def __init__(self):
        self.buf = bytearray(7)     # small on purpose: several get_buffer calls per read

    def connection_made(self, transport):
        self.transport = transport

    def get_buffer(self, sizehint):
        return self.buf

    def buffer_updated(self, nbytes):
        self.transport.write(bytes(self.buf[:nbytes]).upper())


@pytest.fixture
def servers():
    made = []
    yield made
    for srv in made:
        srv.shutdown(timeout=15)
        assert_no_leaks(srv)


def client(srv):
    s = socket.create_connection(srv.address, timeout=10)
    return s


def test_unchanged_asyncio_echo_protocol(servers):
    srv = serve_protocol(EchoProtocol, HOST, 0)
    servers.append(srv)
    socks = [client(srv) for _ in range(10)]
    for i, s in enumerate(socks):
        msg = (b"protocol %d " % i) * 300
        s.sendall(msg)
        assert recv_exact(s, len(msg)) == msg
    for s in socks:
        s.close()


def test_buffered_protocol_gets_bytes_through_get_buffer(servers):
    srv = serve_protocol(UpperBuffered, HOST, 0)
    servers.append(srv)
    s = client(srv)
    s.sendall(b"hello buffered protocol")
    assert recv_exact(s, 23) == b"HELLO BUFFERED PROTOCOL"
    s.close()


def test_transport_api_and_lifecycle(servers):
    events = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport):
            self.t = transport
            events.append(("made", transport.get_extra_info("peername"),
                           transport.get_extra_info("sockname"),
                           type(transport.get_extra_info("socket"))))

        def data_received(self, data):
            if data == b"close":
                self.t.write(b"bye")
                self.t.close()
                events.append(("closing", self.t.is_closing()))
            elif data == b"abort":
                self.t.abort()
            else:
                self.t.writelines([b"a", b"b", data])

        def connection_lost(self, exc):
            events.append(("lost", exc))

    srv = serve_protocol(Probe, HOST, 0)
    servers.append(srv)
    s = client(srv)
    s.sendall(b"c")
    assert recv_exact(s, 3) == b"abc"
    s.sendall(b"close")
    assert recv_until_closed(s) == (b"bye", "eof")
    wait_for(lambda: any(e[0] == "lost" for e in events))
    made = events[0]
    assert made[0] == "made" and made[1] == s.getsockname() and made[2] == srv.address
    # asyncio's TransportSocket, as on asyncio's loop: no setblocking(True) behind our back
    assert issubclass(made[3], asyncio.trsock.TransportSocket)
    assert ("closing", True) in events and ("lost", None) in events
    s.close()
    s2 = client(srv)
    s2.sendall(b"abort")
    assert recv_until_closed(s2)[0] == b""
    s2.close()


def test_pause_and_resume_writing_at_the_limits(servers):
    calls = []
    chunk = b"q" * 65536

    class Producer(asyncio.Protocol):
        def connection_made(self, transport):
            self.t = transport
            # a small send buffer: the kernel must not take the whole 4 MiB (a quiet
            # machine's loopback took it, into the client's receive buffer: no pause)
            transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET,
                                                         socket.SO_SNDBUF, 65536)
            transport.set_write_buffer_limits(high=128 * 1024, low=16 * 1024)
            assert transport.get_write_buffer_limits() == (16 * 1024, 128 * 1024)

        def data_received(self, data):
            for _ in range(64):        # 4 MiB: far above the high limit
                self.t.write(chunk)
            calls.append(("size", self.t.get_write_buffer_size()))

        def pause_writing(self):
            calls.append(("pause", self.t.get_write_buffer_size()))

        def resume_writing(self):
            calls.append(("resume", self.t.get_write_buffer_size()))

    srv = serve_protocol(Producer, HOST, 0)
    servers.append(srv)
    s = client(srv)
    s.sendall(b"go")
    wait_for(lambda: any(c[0] == "pause" for c in calls))
    assert recv_exact(s, 64 * len(chunk), timeout=20) == chunk * 64
    wait_for(lambda: any(c[0] == "resume" for c in calls))
    kinds = [c[0] for c in calls]
    assert kinds.index("pause") < kinds.index("resume")
    assert [c for c in calls if c[0] == "pause"][0][1] > 128 * 1024
    assert [c for c in calls if c[0] == "resume"][0][1] <= 16 * 1024
    assert [c for c in calls if c[0] == "size"][0][1] > 0
    s.close()


def test_pause_reading_stops_data_received(servers):
    got = []

    class Pauser(asyncio.Protocol):
        def connection_made(self, transport):
            self.t = transport

        def data_received(self, data):
            got.append(data)
            if data.startswith(b"pause"):
                self.t.pause_reading()
                assert not self.t.is_reading()
            self.t.write(data)

    srv = serve_protocol(Pauser, HOST, 0)
    servers.append(srv)
    s = client(srv)
    s.sendall(b"pause")
    assert recv_exact(s, 5) == b"pause"
    s.sendall(b"later")
    s.settimeout(0.3)
    with pytest.raises(socket.timeout):
        s.recv(10)
    assert got == [b"pause"]
    srv.sessions[0].user.resume_reading()     # the transport, from another thread
    assert recv_exact(s, 5) == b"later"
    s.close()


def test_serve_protocol_rejects_framing():
    with pytest.raises(ValueError):
        serve_protocol(EchoProtocol, HOST, 0, framing="u16")


@pytest.mark.parametrize("backend", ["selectors", "epoll"])
@pytest.mark.parametrize("workers", [0, 2])
def test_pause_in_connection_made_holds_data_sent_with_the_proxy_header(servers, backend,
                                                                         workers):
    """HAProxy writes the PROXY header and the first request at once; the protocol pauses
    in connection_made: no data_received while is_reading() is False, then the request
    once, in order, after resume_reading()."""
    got = []
    while_paused = []
    made = []

    class PauseFirst(asyncio.Protocol):
        def connection_made(self, transport):
            self.t = transport
            transport.pause_reading()
            made.append(transport)

        def data_received(self, data):
            if not self.t.is_reading():
                while_paused.append(data)
            got.append(data)
            self.t.write(data)

    srv = serve_protocol(PauseFirst, HOST, 0, backend=backend, workers=workers,
                         proxy_protocol="v1")
    servers.append(srv)
    hdr = b"PROXY TCP4 192.0.2.7 192.0.2.1 40000 443\r\n"
    req = b"GET / HTTP/1.0\r\n\r\n" * 50
    with client(srv) as s:
        s.sendall(hdr + req)                # one write: header and request
        wait_for(lambda: made, what="connection_made")
        for _ in range(2):                  # the loop finished the read that had the header
            done = threading.Event()
            srv.loop.call_soon_threadsafe(done.set)
            assert done.wait(10)
        assert got == [] and while_paused == []
        assert made[0].get_extra_info("peername") == ("192.0.2.7", 40000)
        made[0].resume_reading()            # from this (another) thread
        assert recv_exact(s, len(req)) == req
        assert while_paused == [] and b"".join(got) == req
    wait_for(lambda: srv.stats()["connections"] == 0)
    st = srv.stats()
    assert st["rx_slots_in_use"] == 1 and st["rx_raw_slots_in_use"] == 1
