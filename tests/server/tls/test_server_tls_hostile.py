"""Hostile and broken TLS peers against the real server on loopback, on every
Layer 1 backend.

Scenarios: plain-text bytes where a ClientHello belongs; a ClientHello trickled a byte at a
time (cut by ``handshake_timeout``); hundreds of connections that never send a ClientHello;
truncated records, a reset mid-record, a corrupted record, an oversized record; a TLS 1.2
client that asks to renegotiate (``openssl s_client``'s ``R``: refused, the server goes on);
peers that close without ``close_notify``; client certificates that do not verify (or are
missing) when one is required; 10,000 handshakes in a row with the server's memory flat.

Each attack runs in a thread (or a child process) while a well-behaved TLS client keeps
echoing in the test's thread: it must be served throughout.  After every scenario: no
session left, the receive pool back to its idle value (1: the scratch slot), no send slot
held, this process's fd count back to where it was, no ERROR log line, and ``on_connect``
run for no connection whose handshake did not complete.

Knobs (environment): AOP_TLS_HANDSHAKES (the in-a-row run on the selectors backend, default
10000), AOP_TLS_HANDSHAKES_OTHER (the same on the other backends, default 2000: the TLS layer
is the same code on every backend, and CI runs this file on three Pythons),
AOP_TLS_SILENT (connections that never send a ClientHello, default 300), AOP_TLS_SLACK_S
(scheduling slack on top of a timeout before a cut counts as late, default 1.5).
"""
import gc
import json
import os
import select
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
import weakref

import pytest

from aoprim.server import Handler
from aoprim.server.loop import BACKENDS

from proc_support import NEUTRAL_CWD, child_env, rss_kib
from server_support import (error_lines, fd_limit, frame, logs,  # noqa: F401
                                 make_server, open_fds, read_frame, recv_until_closed,
                                 wait_for)
from tls_clients import RawTLS, SClient, client_hello
from tlscerts import tls_certs  # noqa: F401

pytestmark = pytest.mark.timeout(180)

IDLE_RX = 1                 # the scratch slot every session reads into
HS_TIMEOUT = 1.0            # handshake_timeout for the scenarios that wait for it
SLACK = float(os.environ.get("AOP_TLS_SLACK_S", "1.5"))
SILENT = int(os.environ.get("AOP_TLS_SILENT", "300"))
HANDSHAKES = int(os.environ.get("AOP_TLS_HANDSHAKES", "10000"))
HANDSHAKES_OTHER = int(os.environ.get("AOP_TLS_HANDSHAKES_OTHER", "2000"))
# the in-a-row run may grow this process's RSS at most this much after its warm-up: a leak
# of 2 KiB per handshake would show (an SSL object per session is tens of KiB)
RSS_GROWTH_KIB = 16 << 10


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Every test here runs on every Layer 1 backend (make_server uses this fixture)."""
    return request.param


@pytest.fixture(autouse=True)
def _enough_fds():
    with fd_limit(4 * SILENT + 256):
        yield


class Counting(Handler):
    """Echo; counts the sessions that reached on_connect (a completed handshake)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.connects = 0

    def on_connect(self, session):
        with self.lock:
            self.connects += 1

    def on_read(self, session, data):
        session.send(data)


_GOOD = []


@pytest.fixture(autouse=True)
def _close_good_clients():
    """A test that fails half-way leaves its Good client open: close it here, so the next
    test's descriptor count does not meet it."""
    yield
    while _GOOD:
        _GOOD.pop().close()


class Good:
    """A well-behaved TLS client: one u16 echo per ping(), every reply checked."""

    def __init__(self, srv, certs, with_cert=False, framing="u16"):
        raw = socket.create_connection(srv.address, timeout=10)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.s = certs.client_ctx(with_cert=with_cert).wrap_socket(
            raw, server_hostname="localhost")
        self.kind = framing
        self.n = 0
        _GOOD.append(self)
        self.worst = 0.0

    def ping(self):
        msg = b"still here %d" % self.n
        t = time.perf_counter()
        self.s.sendall(frame(msg, self.kind))
        assert read_frame(self.s, self.kind, timeout=10) == msg
        self.worst = max(self.worst, time.perf_counter() - t)
        self.n += 1

    def close(self):
        self.s.close()


def during(good, fn, *args):
    """Run ``fn(*args)`` in a thread while ``good`` keeps echoing; returns fn's result.  The
    good client must be served the whole time (at least a few round trips, none slow)."""
    out = {}

    def run():
        try:
            out["r"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            out["e"] = e

    before = good.n
    go = threading.Event()

    def run_when_told():
        go.wait(30)
        run()

    t = threading.Thread(target=run_when_told)
    t.start()
    try:
        # one round trip as the attack begins (a short attack can otherwise be over, on a
        # free-threaded build, before this thread looks), more while it runs, one after
        good.ping()
        go.set()
        while t.is_alive():
            good.ping()
            time.sleep(0.002)
    finally:
        go.set()
        t.join(120)
    assert not t.is_alive(), "the attack did not finish"
    if "e" in out:
        raise out["e"]
    good.ping()
    assert good.n - before >= 2, "the good client was not served during the attack"
    assert good.worst < 5.0, f"a good round trip took {good.worst:.2f} s"
    return out.get("r")


def settle(srv, handler, good, fds, caplog, connects=1):
    """The after-every-scenario check (closes the good client first)."""
    good.ping()
    good.close()
    wait_for(lambda: srv.stats()["connections"] == 0, 15, "the sessions to close")
    wait_for(lambda: srv.live_sessions == 0, 5, "the sessions' last references")
    wait_for(lambda: srv.stats()["rx_slots_in_use"] == IDLE_RX, 5, "the receive slots")
    st = srv.stats()
    assert st["tx_slots_in_use"] == 0, st
    wait_for(lambda: open_fds() == fds, 5, f"the fd count to return to {fds}")
    assert not error_lines(caplog), error_lines(caplog)[:5]
    assert handler.connects == connects, \
        f"on_connect ran {handler.connects} times, expected {connects}"
    return st


def start(make_server, certs, framing="u16", client_cert="none", **kw):
    h = Counting()
    srv = make_server(h, framing=framing, ssl=certs.server_ctx(client_cert=client_cert), **kw)
    fds = open_fds()
    good = Good(srv, certs, with_cert=client_cert != "none")
    good.ping()
    return h, srv, fds, good


def reset(sock):
    """Close with a RST (SO_LINGER 0)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def closed_within(sock, limit):
    """Read until the server closes (EOF or reset); fail if that takes longer than
    ``limit`` seconds.  Returns (bytes received, seconds)."""
    t0 = time.monotonic()
    data, _ = recv_until_closed(sock, timeout=limit)
    return data, time.monotonic() - t0


# -- plain text where a ClientHello belongs -----------------------------------------------------

PLAINTEXT = {
    "http request": b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n",
    "u16 frame": frame(b"hello"),
    "zeros": b"\0" * 64,
    "proxy header": b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2\r\n",
    "handshake record of garbage": b"\x16\x03\x01\x00\x20" + b"\xab" * 32,
    "alert record": b"\x15\x03\x03\x00\x02\x02\x28",
    "application data before the handshake": b"\x17\x03\x03\x00\x10" + b"x" * 16,
    "SSLv2-style hello": b"\x80\x2e\x01\x00\x02\x00\x15\x00\x00\x00\x10" + b"\x01" * 37,
}


def test_plain_text_where_a_clienthello_belongs(make_server, tls_certs, logs):
    """Every connection is closed promptly (a parse failure, not handshake_timeout), none
    reaches on_connect, and nothing it sent is echoed."""
    h, srv, fds, good = start(make_server, tls_certs, handshake_timeout=10.0)

    def attack():
        worst = 0.0
        for _ in range(10):
            for name, data in PLAINTEXT.items():
                with socket.create_connection(srv.address, timeout=10) as s:
                    s.sendall(data)
                    got, dt = closed_within(s, 5.0)
                    assert not got or got[0] == 0x15, (name, got[:20])   # an alert at most
                    worst = max(worst, dt)
        return worst

    worst = during(good, attack)
    assert worst < 3.0, f"a plain-text connection took {worst:.2f} s to be closed"
    settle(srv, h, good, fds, logs)


# -- a handshake trickled a byte at a time -------------------------------------------------------

def test_handshake_trickled_a_byte_at_a_time_is_cut_by_handshake_timeout(make_server, tls_certs,
                                                                         logs):
    h, srv, fds, good = start(make_server, tls_certs, handshake_timeout=HS_TIMEOUT)
    hello = client_hello(tls_certs.client_ctx())
    assert len(hello) > 200      # trickled at 20 ms a byte it would take seconds

    def trickle(results):
        with socket.create_connection(srv.address, timeout=10) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t0 = time.monotonic()
            sent = 0
            for i in range(len(hello)):
                try:
                    s.send(hello[i:i + 1])
                except OSError:
                    break
                sent += 1
                if select.select([s], [], [], 0.02)[0]:
                    break                            # the server answered: it is closing
            recv_until_closed(s, timeout=HS_TIMEOUT + SLACK + 5)
            results.append((time.monotonic() - t0, sent))

    def attack():
        results = []
        ths = [threading.Thread(target=trickle, args=(results,)) for _ in range(5)]
        for t in ths:
            t.start()
        for t in ths:
            t.join(60)
        return results

    results = during(good, attack)
    assert len(results) == 5
    for dt, sent in results:
        assert sent < len(hello), "the whole ClientHello went out before the cut"
        assert 0.8 * HS_TIMEOUT <= dt <= HS_TIMEOUT + SLACK, \
            f"cut after {dt:.2f} s (handshake_timeout {HS_TIMEOUT})"
    settle(srv, h, good, fds, logs)


# -- hundreds of connections that never send a ClientHello ---------------------------------------

def test_hundreds_of_silent_connections_are_cut_by_handshake_timeout(make_server, tls_certs,
                                                                     logs):
    h, srv, fds, good = start(make_server, tls_certs, handshake_timeout=HS_TIMEOUT)

    def attack():
        sel = select.epoll()
        opened = {}
        lives = []
        try:
            for _ in range(SILENT):
                s = socket.create_connection(srv.address, timeout=10)
                opened[s.fileno()] = (s, time.monotonic())
                sel.register(s.fileno(), select.EPOLLIN | select.EPOLLRDHUP)
            deadline = time.monotonic() + HS_TIMEOUT + SLACK + 10
            while opened and time.monotonic() < deadline:
                for fd, _ in sel.poll(0.1):
                    s, t0 = opened[fd]
                    try:
                        more = s.recv(4096)
                    except OSError:
                        more = b""
                    if more:
                        continue                     # an alert before the close
                    lives.append(time.monotonic() - t0)
                    sel.unregister(fd)
                    del opened[fd]
                    s.close()
            return lives, len(opened)
        finally:
            for s, _ in opened.values():
                s.close()
            sel.close()

    lives, left = during(good, attack)
    assert left == 0, f"{left} silent connections were never cut"
    assert len(lives) == SILENT
    assert min(lives) >= 0.8 * HS_TIMEOUT, f"one was cut after {min(lives):.2f} s"
    assert max(lives) <= HS_TIMEOUT + SLACK, f"one lived {max(lives):.2f} s"
    st = settle(srv, h, good, fds, logs)
    assert st["connections_total"] == SILENT + 1


# -- truncated records, a reset mid-record -------------------------------------------------------

def _half_hello(srv, certs, how):
    hello = client_hello(certs.client_ctx())
    s = socket.create_connection(srv.address, timeout=10)
    s.sendall(hello[:len(hello) // 2])
    if how == "rst":
        reset(s)
        return
    with s:
        s.shutdown(socket.SHUT_WR)
        closed_within(s, 5.0)


def _record_cut(srv, certs, how, cut):
    """A real handshake, one whole frame echoed, then ``cut`` of the next record."""
    t = RawTLS(srv.address, certs.client_ctx()).handshake()
    try:
        t.sock.sendall(t.record(frame(b"whole")))
        got = bytearray()
        while frame(b"whole") not in got:
            chunk = t.sock.recv(1 << 16)
            assert chunk, "closed before the echo"
            got += t.plaintext(chunk)
        rec = t.record(frame(b"secret"))
        t.sock.sendall(cut(rec))
        if how == "rst":
            reset(t.sock)
            return
        if how == "fin":
            t.sock.shutdown(socket.SHUT_WR)
        data, _ = closed_within(t.sock, 5.0)
        assert b"secret" not in t.plaintext(data), "a truncated/corrupt record was echoed"
    finally:
        t.sock.close()


def _flip_last(rec):
    return rec[:-1] + bytes([rec[-1] ^ 0x01])


TRUNCATIONS = {
    "half a ClientHello, then FIN": lambda srv, c: _half_hello(srv, c, "fin"),
    "half a ClientHello, then RST": lambda srv, c: _half_hello(srv, c, "rst"),
    "half a record, then FIN": lambda srv, c: _record_cut(srv, c, "fin",
                                                          lambda r: r[:len(r) // 2]),
    "half a record, then RST": lambda srv, c: _record_cut(srv, c, "rst",
                                                          lambda r: r[:len(r) // 2]),
    "a record header alone, then FIN": lambda srv, c: _record_cut(srv, c, "fin",
                                                                  lambda r: r[:3]),
    "a record with a bad tag (connection left open)":
        lambda srv, c: _record_cut(srv, c, "open", _flip_last),
    "a record longer than TLS allows (left open)":
        lambda srv, c: _record_cut(srv, c, "open",
                                   lambda r: b"\x17\x03\x03\xff\xff" + b"\x00" * 512),
}


@pytest.mark.parametrize("kind", list(TRUNCATIONS))
def test_truncated_and_corrupt_records(make_server, tls_certs, logs, kind):
    h, srv, fds, good = start(make_server, tls_certs)
    n = 20

    def attack():
        for _ in range(n):
            TRUNCATIONS[kind](srv, tls_certs)

    during(good, attack)
    completed = 0 if "ClientHello" in kind else n
    settle(srv, h, good, fds, logs, connects=1 + completed)


# -- renegotiation ---------------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl binary")
def test_tls12_renegotiation_is_refused_and_the_server_goes_on(make_server, tls_certs, logs):
    h, srv, fds, good = start(make_server, tls_certs, framing="raw")

    def attack():
        outs = []
        for _ in range(3):
            c = SClient(srv.address, ["-tls1_2", "-CAfile", tls_certs.ca_cert,
                                      "-servername", "localhost"])
            c.send(b"hello-before\n")
            assert c.wait_line("hello-before"), "no echo before the renegotiation"
            c.send(b"R\n")                  # s_client: renegotiate
            time.sleep(0.5)
            try:
                c.send(b"after\n")
            except OSError:
                pass                         # s_client already gone: the server refused
            echoed_after = c.wait_line("after", timeout=3.0)
            outs.append((c.finish(), echoed_after))
        return outs

    # a raw echo server echoes the good client's u16 frames byte for byte as well
    outs = during(good, attack)
    for out, echoed_after in outs:
        assert "RENEGOTIATING" in out, out[-2000:]
        assert not echoed_after, "the renegotiation went through:\n" + out[-2000:]
    settle(srv, h, good, fds, logs, connects=1 + len(outs))


# -- closing without close_notify ----------------------------------------------------------------

def _no_notify(srv, certs, how):
    raw = socket.create_connection(srv.address, timeout=10)
    s = certs.client_ctx().wrap_socket(raw, server_hostname="localhost")
    try:
        if how == "after an echo":
            s.sendall(frame(b"x" * 100))
            assert read_frame(s) == b"x" * 100
        elif how == "with replies pending":
            s.sendall(b"".join(frame(b"y" * 1000) for _ in range(300)))
        elif how == "reset after the handshake":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        s.close()               # SSLSocket.close(): no close_notify, just the fd


@pytest.mark.parametrize("how", ["right after the handshake", "after an echo",
                                 "with replies pending", "reset after the handshake"])
def test_peer_closes_without_close_notify(make_server, tls_certs, logs, how):
    h, srv, fds, good = start(make_server, tls_certs)
    n = 30

    def attack():
        for _ in range(n):
            _no_notify(srv, tls_certs, how)

    during(good, attack)
    settle(srv, h, good, fds, logs, connects=1 + n)


# -- client certificates that do not verify --------------------------------------------------------

@pytest.mark.parametrize("version", ["1.2", "1.3"])
@pytest.mark.parametrize("cert", ["none", "another CA's"])
def test_client_cert_that_does_not_verify_when_one_is_required(make_server, tls_certs, logs,
                                                               version, cert):
    h, srv, fds, good = start(make_server, tls_certs, client_cert="required")
    ctx = tls_certs.client_ctx(version=version, other_cert=(cert != "none"))
    n = 10

    def attack():
        refused = 0
        for _ in range(n):
            raw = socket.create_connection(srv.address, timeout=10)
            try:
                s = ctx.wrap_socket(raw, server_hostname="localhost")
            except (ssl.SSLError, OSError):
                refused += 1                 # TLS 1.2: the handshake itself fails
                raw.close()
                continue
            with s:
                # TLS 1.3: the client's handshake ends before the server has checked the
                # certificate; its first read gets the alert (or EOF), never an echo
                try:
                    s.sendall(frame(b"let me in"))
                    s.settimeout(5)
                    got = s.recv(100)
                    assert not got, f"served without a valid certificate: {got!r}"
                except (ssl.SSLError, OSError):
                    pass
                refused += 1
        return refused

    assert during(good, attack) == n
    settle(srv, h, good, fds, logs)


# -- 10,000 handshakes in a row ----------------------------------------------------------------------

_CYCLER = r"""
import json, socket, ssl, sys, time
host, port, n, ca = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
ctx.load_verify_locations(ca)
ctx.minimum_version = ssl.TLSVersion.TLSv1_3
msg = (5).to_bytes(2, "big") + b"hello"
t0 = time.monotonic()
failures = 0
for i in range(n):
    try:
        raw = socket.create_connection((host, port), timeout=10)
        s = ctx.wrap_socket(raw, server_hostname="localhost")
        s.sendall(msg)
        got = b""
        while len(got) < len(msg):
            chunk = s.recv(64)
            if not chunk:
                break
            got += chunk
        if got != msg:
            failures += 1
        if i % 2:
            try:
                s.unwrap().close()           # with close_notify
                continue
            except (ssl.SSLError, OSError):
                pass
        s.close()                            # without
    except (ssl.SSLError, OSError):
        failures += 1
print(json.dumps({"done": n, "failures": failures, "seconds": time.monotonic() - t0}))
"""


def holders(objs, depth=4):
    """Describe what keeps each of ``objs`` alive: chains of referrer types, ``depth`` deep."""
    out = []
    for o in objs[:3]:
        chain, seen, cur = [], {id(objs)}, [o]
        for _ in range(depth):
            nxt = []
            for c in cur:
                for r in gc.get_referrers(c):
                    if id(r) in seen or r is cur or r is nxt or r is chain:
                        continue
                    seen.add(id(r))
                    nxt.append(r)
            if not nxt:
                break
            chain.append(", ".join(sorted({type(r).__qualname__ for r in nxt})))
            cur = nxt[:8]
        out.append(f"{o!r} (server_side={o.server_side}) <- " + " <- ".join(chain))
    return f"{len(objs)} left; " + "; ".join(out)


def _cycles(srv, certs, n, timeout):
    p = subprocess.run([sys.executable, "-c", _CYCLER, srv.address[0], str(srv.address[1]),
                        str(n), certs.ca_cert], capture_output=True, text=True,
                       cwd=NEUTRAL_CWD, env=child_env(), timeout=timeout)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(600)
def test_ten_thousand_handshakes_in_a_row_memory_flat(make_server, tls_certs, logs, backend):
    n = HANDSHAKES if backend == "selectors" else HANDSHAKES_OTHER
    # the SSLObjects other tests in this process left are theirs to answer for
    before = weakref.WeakSet(o for o in gc.get_objects() if isinstance(o, ssl.SSLObject))
    h, srv, fds, good = start(make_server, tls_certs)
    warm = max(200, n // 10)
    r0 = _cycles(srv, tls_certs, warm, 120)          # the allocator's first fill
    assert r0["failures"] == 0, r0
    wait_for(lambda: srv.stats()["connections"] == 1, 10, "the warm-up sessions to close")
    rss0 = rss_kib()
    # a strict time bound: the child is killed (and the test fails) past it
    r = during(good, _cycles, srv, tls_certs, n, 300)
    wait_for(lambda: srv.stats()["connections"] == 1, 10, "the sessions to close")
    rss1 = rss_kib()
    print(f"[tls hostile] {n} handshakes in {r['seconds']:.1f} s ({n / r['seconds']:.0f}/s), "
          f"RSS {rss0} -> {rss1} KiB, good round trips {good.n}, worst "
          f"{good.worst * 1e3:.1f} ms")
    assert r["failures"] == 0, r
    assert rss1 - rss0 < RSS_GROWTH_KIB, f"RSS grew {rss1 - rss0} KiB over {n} handshakes"
    st = settle(srv, h, good, fds, logs, connects=1 + warm + n)
    assert st["connections_total"] == 1 + warm + n
    # nothing of a session outlives it: no server-side SSLObject is left (once the loop
    # thread is out of the callbacks that closed the last sessions: live_sessions drops
    # to 0 inside the last one, which still holds its session until it returns)
    def left():
        gc.collect()
        return [o for o in gc.get_objects()
                if isinstance(o, ssl.SSLObject) and o not in before]
    try:
        wait_for(lambda: not left(), 10, "no SSLObject left")
    except AssertionError:
        raise AssertionError(f"SSLObjects outlived their sessions: {holders(left())}") from None


# -- nothing in clear before the handshake; shutdown with handshakes in flight ------------------

class Broadcaster(Counting):
    """Every frame goes to every session (Server.broadcast), its sender included."""

    def on_read(self, session, data):
        session.server.broadcast(bytes(data))


def test_broadcasts_never_reach_a_connection_whose_handshake_is_not_done(make_server,
                                                                         tls_certs, logs):
    """Connections that never sent a ClientHello, or sent half of one, get no byte of the
    broadcasts (in clear or otherwise) and no on_connect; the TLS clients get every one."""
    h = Broadcaster()
    srv = make_server(h, framing="u16", ssl=tls_certs.server_ctx(), handshake_timeout=10.0)
    fds = open_fds()
    hello = client_hello(tls_certs.client_ctx())
    lurkers = []
    for i in range(10):
        s = socket.create_connection(srv.address, timeout=10)
        if i % 2:
            s.sendall(hello[:len(hello) // 2])
        lurkers.append(s)
    wait_for(lambda: srv.stats()["connections"] == 10, 5, "the lurkers' connections")
    good = [Good(srv, tls_certs) for _ in range(2)]
    try:
        wait_for(lambda: h.connects == 2, 5, "the TLS clients' on_connect")
        msgs = [b"secret %d " % i + b"s" * (i * 300) for i in range(40)]
        for m in msgs:
            good[0].s.sendall(frame(m))
        for g in good:
            for m in msgs:
                assert read_frame(g.s) == m
        srv.broadcast(b"secret from the server thread")
        for g in good:
            assert read_frame(g.s) == b"secret from the server thread"
        for s in lurkers:
            s.setblocking(False)
            try:
                got = s.recv(1 << 16)
            except BlockingIOError:
                got = b""
            assert b"secret" not in got and not got, got[:100]
    finally:
        for s in lurkers:
            s.close()
        for g in good:
            g.close()
    wait_for(lambda: srv.stats()["connections"] == 0, 15, "the sessions to close")
    wait_for(lambda: srv.stats()["rx_slots_in_use"] == IDLE_RX, 5, "the receive slots")
    assert srv.stats()["tx_slots_in_use"] == 0
    wait_for(lambda: open_fds() == fds, 5, "the fd count")
    assert not error_lines(logs), error_lines(logs)[:5]
    assert h.connects == 2


def test_shutdown_with_handshakes_in_flight(make_server, tls_certs, logs):
    """shutdown() closes silent and half-handshaken connections at once (it does not wait
    for handshake_timeout), sends close_notify to the established ones, and gives every
    slot and fd back (make_server's teardown checks)."""
    h = Counting()
    srv = make_server(h, framing="u16", ssl=tls_certs.server_ctx(), handshake_timeout=60.0)
    hello = client_hello(tls_certs.client_ctx())
    socks, est = [], []
    try:
        for i in range(60):
            s = socket.create_connection(srv.address, timeout=10)
            if i % 3 == 1:
                s.sendall(hello[:len(hello) // 2])
            elif i % 3 == 2:
                s.sendall(hello)                 # the server's flight, never answered
            socks.append(s)
        ctx = tls_certs.client_ctx()
        for _ in range(5):
            raw = socket.create_connection(srv.address, timeout=10)
            est.append(ctx.wrap_socket(raw, server_hostname="localhost",
                                       suppress_ragged_eofs=False))
        for s in est:
            s.sendall(frame(b"hi"))
            assert read_frame(s) == b"hi"
        wait_for(lambda: srv.stats()["connections"] == 65, 5, "every connection")
        t0 = time.monotonic()
        srv.shutdown(timeout=30)
        took = time.monotonic() - t0
        assert took < 10.0, f"shutdown took {took:.1f} s"
        for s in est:
            s.settimeout(5)
            assert s.recv(10) == b"", "expected close_notify from the shutdown"
        for s in socks:
            recv_until_closed(s, timeout=5)
    finally:
        for s in socks + est:
            s.close()
    assert not error_lines(logs), error_lines(logs)[:5]
    assert h.connects == 5


# -- worker threads and a broadcasting thread, many TLS clients at once -----------------------

def test_workers_and_cross_thread_broadcasts_lose_nothing(make_server, tls_certs, logs):
    """workers=2 (on_read on worker threads, so every echo is a send from a foreign thread)
    and a third thread broadcasting: 8 TLS clients each get all of their echoes in order and
    every broadcast in order, nothing lost or duplicated (each item counted)."""
    h = Counting()
    srv = make_server(h, framing="u16", ssl=tls_certs.server_ctx(), workers=2)
    fds = open_fds()
    nclients, nframes, nticks = 8, 1500, 300
    ctx = tls_certs.client_ctx()
    clients = []
    for _ in range(nclients):
        raw = socket.create_connection(srv.address, timeout=20)
        clients.append(ctx.wrap_socket(raw, server_hostname="localhost"))
    wait_for(lambda: h.connects == nclients, 10, "every handshake")
    errors = []
    results = {}

    def client(i, s):
        try:
            sent = [b"c%d-%d:" % (i, k) + bytes([k & 0xFF]) * ((k * 31 + i) % 2000)
                    for k in range(nframes)]
            echoes, ticks = [], []
            # one thread per SSL socket (OpenSSL objects must not be used by two threads at
            # once): 50 frames out, then their 50 echoes back (broadcasts in between)
            for k in range(0, nframes, 50):
                s.sendall(b"".join(frame(m) for m in sent[k:k + 50]))
                while len(echoes) < min(k + 50, nframes):
                    m = read_frame(s, timeout=30)
                    (ticks if m.startswith(b"tick ") else echoes).append(m)
            while len(ticks) < nticks:
                m = read_frame(s, timeout=30)
                (ticks if m.startswith(b"tick ") else echoes).append(m)
            results[i] = (echoes == sent,
                          ticks == [b"tick %d" % t for t in range(nticks)])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(f"client {i}: {type(e).__name__}: {e}")

    def ticker():
        for t in range(nticks):
            srv.broadcast(b"tick %d" % t)
            if t % 50 == 0:
                time.sleep(0.001)

    ths = [threading.Thread(target=client, args=(i, s)) for i, s in enumerate(clients)]
    ths.append(threading.Thread(target=ticker))
    for t in ths:
        t.start()
    for t in ths:
        t.join(120)
    try:
        assert not errors, errors
        assert all(not t.is_alive() for t in ths), "a client did not finish"
        assert results == {i: (True, True) for i in range(nclients)}, results
    finally:
        for s in clients:
            s.close()
    wait_for(lambda: srv.stats()["connections"] == 0, 15, "the sessions to close")
    wait_for(lambda: srv.stats()["rx_slots_in_use"] == IDLE_RX, 5, "the receive slots")
    assert srv.stats()["tx_slots_in_use"] == 0
    wait_for(lambda: open_fds() == fds, 5, "the fd count")
    assert not error_lines(logs), error_lines(logs)[:5]


# -- PROXY protocol in front of TLS ----------------------------------------------------------------

def _v2(src, dst):
    sig = b"\r\n\r\n\x00\r\nQUIT\n"
    block = (socket.inet_aton(src[0]) + socket.inet_aton(dst[0]) +
             struct.pack(">HH", src[1], dst[1]))
    return sig + b"\x21\x11" + struct.pack(">H", len(block)) + block


def test_proxy_header_then_tls_edge_cases(make_server, tls_certs, logs):
    """With proxy_protocol: the header and the ClientHello in one segment, or the whole
    first flight a byte per send, both work (peer from the header); a header followed by
    plain text is closed at once; a header followed by silence is cut by handshake_timeout;
    plain text instead of the header is refused -- and none of them log an ERROR."""
    class Peers(Counting):
        def __init__(self):
            super().__init__()
            self.peers = []

        def on_connect(self, session):
            super().on_connect(session)
            self.peers.append(session.peer)

    h = Peers()
    srv = make_server(h, framing="u16", ssl=tls_certs.server_ctx(), proxy_protocol="v2",
                      handshake_timeout=HS_TIMEOUT)
    fds = open_fds()
    ctx = tls_certs.client_ctx()
    dst = ("198.51.100.1", 443)
    for k, trickle in enumerate([False, True, False, True]):
        src = ("203.0.113.%d" % (k + 1), 40000 + k)
        t = RawTLS(srv.address, ctx).handshake(prefix=_v2(src, dst), trickle=trickle)
        try:
            assert t.echo(b"via the balancer %d" % k) == b"via the balancer %d" % k
        finally:
            t.sock.close()
        wait_for(lambda: len(h.peers) == k + 1, 5, "on_connect")
        assert h.peers[k] == src
    # a header, then plain text where the ClientHello belongs: closed at once
    with socket.create_connection(srv.address, timeout=10) as s:
        s.sendall(_v2(("203.0.113.9", 1), dst) + b"GET / HTTP/1.1\r\n\r\n")
        _, dt = closed_within(s, 5.0)
        assert dt < HS_TIMEOUT, f"closed after {dt:.2f} s"
    # a header, then nothing: cut by handshake_timeout
    with socket.create_connection(srv.address, timeout=10) as s:
        s.sendall(_v2(("203.0.113.10", 1), dst))
        _, dt = closed_within(s, HS_TIMEOUT + SLACK + 5)
        assert 0.8 * HS_TIMEOUT <= dt <= HS_TIMEOUT + SLACK, f"cut after {dt:.2f} s"
    # a ClientHello where the PROXY header belongs: refused
    with socket.create_connection(srv.address, timeout=10) as s:
        s.sendall(client_hello(ctx))
        closed_within(s, 5.0)
    wait_for(lambda: srv.stats()["connections"] == 0, 15, "the sessions to close")
    wait_for(lambda: srv.stats()["rx_slots_in_use"] == IDLE_RX, 5, "the receive slots")
    assert srv.stats()["tx_slots_in_use"] == 0
    wait_for(lambda: open_fds() == fds, 5, "the fd count")
    assert not error_lines(logs), error_lines(logs)[:5]
    assert h.connects == 4


# -- the timeouts see the bytes on the wire, not only the decrypted ones -------------------------

def test_a_begun_tls_record_is_cut_by_frame_timeout(make_server, tls_certs, logs):
    """Half a record (a whole frame inside it), then nothing: as a begun frame on plain TCP,
    cut once frame_timeout has passed -- else a peer holds a record's worth of memory in
    the server for as long as it likes (idle_timeout is off by default)."""
    frame_to = 1.0
    h = Counting()
    srv = make_server(h, framing="u16", ssl=tls_certs.server_ctx(), frame_timeout=frame_to)
    fds = open_fds()
    t = RawTLS(srv.address, tls_certs.client_ctx()).handshake()
    try:
        assert t.echo(b"first") == b"first"
        rec = t.record(frame(b"z" * 1000))
        t.sock.sendall(rec[:len(rec) // 2])
        _, dt = closed_within(t.sock, frame_to + SLACK + 3)
        assert dt <= frame_to + SLACK, f"cut after {dt:.2f} s"
    finally:
        t.sock.close()
    wait_for(lambda: srv.stats()["connections"] == 0, 15, "the session to close")
    wait_for(lambda: open_fds() == fds, 5, "the fd count")
    assert not error_lines(logs)


def test_ciphertext_arriving_keeps_a_session_from_idle_timeout(make_server, tls_certs, logs):
    """A record sent a byte every 50 ms (longer in all than idle_timeout): bytes keep
    arriving, so the session is not idle; the frame inside is echoed (as on plain TCP)."""
    idle_to = 1.0
    h = Counting()
    srv = make_server(h, framing="u16", ssl=tls_certs.server_ctx(), idle_timeout=idle_to)
    fds = open_fds()
    t = RawTLS(srv.address, tls_certs.client_ctx()).handshake()
    try:
        payload = b"slow but steady " * 3
        rec = t.record(frame(payload))
        t0 = time.monotonic()
        for i in range(len(rec)):
            t.sock.send(rec[i:i + 1])
            time.sleep(0.05)
        assert time.monotonic() - t0 > 1.5 * idle_to
        got = bytearray()
        t.sock.settimeout(5)
        while len(got) < 2 + len(payload):
            chunk = t.sock.recv(1 << 16)
            assert chunk, "closed as idle while bytes kept arriving"
            got += t.plaintext(chunk)
        assert bytes(got[2:]) == payload
    finally:
        t.sock.close()
    wait_for(lambda: srv.stats()["connections"] == 0, 15, "the session to close")
    wait_for(lambda: open_fds() == fds, 5, "the fd count")
    assert not error_lines(logs)


# -- close() owing megabytes to a peer that reads, or never does --------------------------------

class BigThenClose(Counting):
    """A frame ``bye``: three 1 MiB frames back, then session.close()."""

    def on_read(self, session, data):
        if bytes(data) == b"bye":
            for k in range(3):
                session.send(bytes([k]) * (1 << 20))
            session.close()
        else:
            session.send(data)


@pytest.mark.parametrize("reads", [True, False], ids=["peer reads", "peer never reads"])
def test_close_owing_megabytes(make_server, tls_certs, logs, reads):
    """close() with 3 MiB owed: a reading peer gets every byte, then close_notify (a clean
    TLS EOF); a peer that never reads is cut by close_linger -- either way every slot and
    fd comes back, and a good client is served meanwhile."""
    linger = 1.0
    h = BigThenClose()
    srv = make_server(h, framing="u32", max_frame=2 << 20, ssl=tls_certs.server_ctx(),
                      close_linger=linger)
    fds = open_fds()
    good = Good(srv, tls_certs, framing="u32")
    good.ping()
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.connect(srv.address)
    s = tls_certs.client_ctx().wrap_socket(raw, server_hostname="localhost",
                                           suppress_ragged_eofs=False)
    try:
        s.sendall(struct.pack(">I", 3) + b"bye")
        if reads:
            for k in range(3):
                assert read_frame(s, "u32") == bytes([k]) * (1 << 20)
            s.settimeout(10)
            assert s.recv(10) == b"", "expected close_notify after the data"
        else:
            t0 = time.monotonic()
            while srv.stats()["connections"] > 1 and time.monotonic() - t0 < linger + 10:
                good.ping()
                time.sleep(0.01)
            took = time.monotonic() - t0
            assert srv.stats()["connections"] == 1, "the sloth was never cut"
            assert took <= linger + SLACK + 1.0, f"cut after {took:.2f} s (close_linger {linger})"
    finally:
        s.close()
    good.ping()
    good.close()
    wait_for(lambda: srv.stats()["connections"] == 0, 15, "the sessions to close")
    wait_for(lambda: srv.live_sessions == 0, 5, "the sessions' last references")
    wait_for(lambda: srv.stats()["rx_slots_in_use"] == IDLE_RX, 5, "the receive slots")
    assert srv.stats()["tx_slots_in_use"] == 0
    wait_for(lambda: open_fds() == fds, 5, "the fd count")
    assert not error_lines(logs), error_lines(logs)[:5]

