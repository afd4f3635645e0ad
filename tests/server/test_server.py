"""The server end to end on loopback: echo under concurrency, framing over any split,
broadcast, workers, shutdown, lifetimes.  Limits and failures: test_server_limits.py."""
import logging
import random
import socket
import struct
import threading
import time

import pytest

from aoprim import AtomicInt
from aoprim.server import BackendUnavailable, Handler, Server
from aoprim.server.apps import Chat, Echo

from support import run_threads
from server_support import (HOST, assert_no_leaks, connect, frame, make_server,  # noqa: F401
                                 read_frame, recv_exact, recv_until_closed, wait_for)
from aoprim.server.loop import BACKENDS


class Ignore(Handler):
    """Reads and ignores every frame (the tests send from outside the hooks)."""

    def on_read(self, session, data):
        pass


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Every test here runs on every Layer 1 backend (make_server uses this fixture)."""
    return request.param


class Recorder(Echo):
    """Echo that also records each frame it got (as bytes), per session."""

    def __init__(self):
        self.frames = {}
        self.closed = []
        self.lock = threading.Lock()

    def on_connect(self, session):
        with self.lock:
            self.frames[session.id] = []

    def on_read(self, session, data):
        with self.lock:
            self.frames[session.id].append(bytes(data))
        session.send(data)

    def on_close(self, session, exc):
        with self.lock:
            self.closed.append((session.id, exc))


def test_echo_100_concurrent_clients_every_byte(make_server, connect):
    srv = make_server(Echo())
    socks = [connect(srv) for _ in range(100)]
    wait_for(lambda: srv.stats()["connections"] == 100, what="100 sessions")

    def client(s, seed):
        rng = random.Random(seed)
        def run():
            for _ in range(20):
                msg = rng.randbytes(rng.randrange(1, 5000))
                s.sendall(msg)
                assert recv_exact(s, len(msg)) == msg
        return run

    run_threads([client(s, i) for i, s in enumerate(socks)], timeout=60)
    # the loop counts a send just after its sendmsg returned: the client may be faster
    wait_for(lambda: srv.stats()["bytes_out"] == srv.stats()["bytes_in"], what="counters")
    st = srv.stats()
    assert st["bytes_in"] == st["bytes_out"] > 0
    assert st["connections_total"] == 100


@pytest.mark.parametrize("kind", ["u16", "u32"])
def test_framing_split_into_single_bytes_and_many_in_one_send(make_server, connect, kind):
    h = Recorder()
    srv = make_server(h, framing=kind)
    payloads = [b"", b"a", b"hello world", bytes(range(256)) * 4]
    s = connect(srv)
    stream = b"".join(frame(p, kind) for p in payloads)
    for i in range(len(stream)):          # one byte per send (TCP_NODELAY: one segment each)
        s.send(stream[i:i + 1])
    for p in payloads:
        assert read_frame(s, kind) == p
    many = [struct.pack(">I", i) * (i % 7) for i in range(500)]
    s.sendall(b"".join(frame(p, kind) for p in many))    # 500 frames in one send
    for p in many:
        assert read_frame(s, kind) == p
    sid = srv.sessions[0].id
    assert h.frames[sid] == payloads + many               # exact frame boundaries
    st = srv.stats()
    assert st["frames_in"] == st["frames_out"] == len(payloads) + len(many)


def test_frames_larger_than_a_slot(make_server, connect):
    srv = make_server(Recorder(), framing="u32", max_frame=1 << 20, rx_slot_size=4096)
    s = connect(srv)
    rng = random.Random(3)
    big = [rng.randbytes(n) for n in (4090, 4096, 5000, 300_000, 1 << 20)]
    s.sendall(b"".join(frame(p, "u32") for p in big))
    for p in big:
        assert read_frame(s, "u32") == p


def test_raw_large_message_is_one_read_not_one_per_slot(make_server, connect):
    # raw sessions read into rx_read_size slots, so a 64 KiB message takes about
    # one recv (16 KiB slots alone: at least four)
    srv = make_server(Echo(), framing="raw")
    s = connect(srv)
    msg = bytes(range(256)) * 256
    s.sendall(msg)
    assert recv_exact(s, len(msg)) == msg
    wait_for(lambda: srv.stats()["bytes_out"] == len(msg), what="the warm-up counted")
    before = srv.stats()["recv_syscalls"]
    for i in range(20):
        m = bytes([i]) * len(msg)
        s.sendall(m)
        assert recv_exact(s, len(m)) == m
    reads = srv.stats()["recv_syscalls"] - before
    assert reads < 20 * 3, reads


def test_raw_large_echoes_by_reference_every_byte_and_every_slot_back(make_server, connect):
    # large echoes go out by reference from the read slot: with 8 clients each
    # sending distinct 256 KiB messages, no reply may show another read's bytes; clients
    # that vanish with replies unsent give their slots back
    srv = make_server(Echo(), framing="raw", rx_read_slots=4)     # few: the heap fallback too
    rng = random.Random(20)
    errors = []

    def client(k):
        try:
            c = connect(srv)
            for j in range(6):
                m = rng.randbytes(256 << 10) if j % 2 else bytes([k, j]) * (128 << 10)
                c.sendall(m)
                got = recv_exact(c, len(m))
                if got != m:
                    errors.append((k, j))
        except Exception as e:          # reported below
            errors.append((k, repr(e)))
    run_threads([lambda k=k: client(k) for k in range(8)])
    assert errors == []
    # a peer that sends 1 MiB and resets without reading: its by-reference sends are dropped
    for _ in range(3):
        c = connect(srv, rcvbuf=4096)
        c.sendall(b"r" * (1 << 20))
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.close()
    wait_for(lambda: srv.stats()["connections"] == 8, what="the resets seen")
    wait_for(lambda: srv.stats()["rx_raw_slots_in_use"] == 1,
             what="every raw read slot back but the arena's")


def test_a_backlog_the_same_flush_drains_costs_no_registration_change():
    # a large echo crosses high_water on most read bursts; when the iteration's flush takes
    # the backlog to low_water, reading resumes without unregistering and re-registering
    # the fd (which would cost two epoll_ctl calls per burst)
    srv = Server(Echo(), HOST, 0, framing="raw", backend="selectors", high_water=32 << 10,
                 low_water=8 << 10)
    calls = []
    sel = srv.loop._sel
    for name in ("register", "unregister", "modify"):
        orig = getattr(sel, name)
        setattr(sel, name, lambda *a, _o=orig, _n=name: (calls.append(_n), _o(*a))[1])
    srv.start()
    try:
        s = socket.create_connection(srv.address, timeout=10)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        msg = bytes(range(256)) * 512               # 128 KiB: fits the client's buffers
        s.sendall(msg)
        assert recv_exact(s, len(msg)) == msg
        wait_for(lambda: srv.stats()["bytes_out"] == len(msg), what="the first echo")
        n0 = len(calls)
        for i in range(20):
            m = bytes([i]) * len(msg)
            s.sendall(m)
            assert recv_exact(s, len(m)) == m
        changes = len(calls) - n0
        s.close()
    finally:
        srv.shutdown(timeout=15)
    assert_no_leaks(srv)
    assert changes <= 6, (changes, calls[n0:][:20])


def test_replies_of_one_read_burst_leave_in_one_syscall(make_server, connect):
    srv = make_server(Echo(), framing="u16")
    s = connect(srv)
    s.sendall(frame(b"warm"))
    assert read_frame(s) == b"warm"
    # the loop counts a sendmsg after it returns, the client may read first: let it settle
    wait_for(lambda: srv.stats()["send_syscalls"] == 1, what="the warm-up send counted")
    before = srv.stats()
    s.sendall(b"".join(frame(struct.pack(">H", i)) for i in range(64)))
    for i in range(64):
        assert read_frame(s) == struct.pack(">H", i)
    wait_for(lambda: srv.stats()["bytes_out"] == srv.stats()["bytes_in"], what="counters")
    after = srv.stats()
    frames = after["frames_out"] - before["frames_out"]
    sends = after["send_syscalls"] - before["send_syscalls"]
    recvs = after["recv_syscalls"] - before["recv_syscalls"]
    assert frames == 64
    assert sends <= recvs and sends <= 4, (sends, recvs)


def test_broadcast_to_50_clients_one_slot(make_server, connect):
    srv = make_server(Echo(), framing="u16")
    socks = [connect(srv) for _ in range(50)]
    wait_for(lambda: srv.stats()["connections"] == 50, what="50 sessions")
    for k in range(5):
        srv.broadcast(b"news %d" % k)       # from a foreign thread; small: copied per batch
    assert srv.tx_pool.high_water == 0
    big = [bytes([k]) * 5000 for k in range(5)]
    for b in big:
        srv.broadcast(b)                    # large: one retained slot for all 50 sessions
    for s in socks:
        for k in range(5):
            assert read_frame(s) == b"news %d" % k
        for b in big:
            assert read_frame(s) == b
    assert 1 <= srv.tx_pool.high_water <= 5     # one slot per broadcast, not one per client
    # the last batch releases its reference just after its sendmsg returns
    wait_for(lambda: srv.tx_pool.in_use == 0, what="broadcast slots back in the pool")
    with pytest.raises(ValueError):
        srv.broadcast(b"x" * 70000)         # too long for a u16 header


def test_chat_app_broadcasts_to_the_others(make_server, connect):
    srv = make_server(Chat(), framing="u32")
    a, b, c = (connect(srv) for _ in range(3))
    wait_for(lambda: srv.stats()["connections"] == 3)
    a.sendall(frame(b"hi from a", "u32"))
    assert read_frame(b, "u32") == b"hi from a"
    assert read_frame(c, "u32") == b"hi from a"
    b.sendall(frame(b"b here", "u32"))
    assert read_frame(a, "u32") == b"b here"
    assert read_frame(c, "u32") == b"b here"
    a.settimeout(0.2)
    with pytest.raises(socket.timeout):     # a does not get its own message back
        a.recv(1)


class OrderChecker(Handler):
    """Records per-session sequence numbers on worker threads and detects two workers on one
    session at once."""

    def __init__(self):
        self.active = {}
        self.seqs = {}
        self.threads = set()
        self.overlaps = AtomicInt(0)
        self.lock = threading.Lock()

    def on_connect(self, session):
        with self.lock:
            self.active[session.id] = AtomicInt(0)
            self.seqs[session.id] = []

    def on_read(self, session, data):
        a = self.active[session.id]
        if a.fetch_add(1) != 0:
            self.overlaps.fetch_add(1)
        self.threads.add(threading.get_ident())
        self.seqs[session.id].append(struct.unpack(">I", data[:4])[0])
        if len(self.seqs[session.id]) % 50 == 0:
            time.sleep(0)           # let another worker try to barge in
        session.send(data)          # from a worker thread: queued, loop woken
        a.fetch_sub(1)


def test_workers_preserve_per_session_order(make_server, connect):
    h = OrderChecker()
    srv = make_server(h, framing="u32", workers=4)
    n, conns = 3000, 6
    socks = [connect(srv) for _ in range(conns)]

    def client(s):
        def run():
            for start in range(0, n, 500):
                s.sendall(b"".join(frame(struct.pack(">I", i) + b"x" * (i % 13), "u32")
                                   for i in range(start, start + 500)))
            for i in range(n):
                got = read_frame(s, "u32")
                assert struct.unpack(">I", got[:4])[0] == i
                assert got[4:] == b"x" * (i % 13)
        return run

    run_threads([client(s) for s in socks], timeout=90)
    assert h.overlaps.load() == 0
    assert all(seq == list(range(n)) for seq in h.seqs.values())
    assert len(h.seqs) == conns
    assert len(h.threads) >= 2, "only one worker ever ran"
    # counted from the loop and from worker threads: exact once each sender has counted --
    # a send is counted just after it is queued, so the client can read the last reply
    # before that count lands
    wait_for(lambda: srv.stats()["frames_out"] >= n * conns, what="the last send counted")
    st = srv.stats()
    assert st["frames_in"] == st["frames_out"] == n * conns


def test_on_close_runs_once_after_the_last_frame_with_workers(make_server, connect):
    h = Recorder()
    srv = make_server(h, framing="u16", workers=2)
    s = connect(srv)
    s.sendall(b"".join(frame(b"%d" % i) for i in range(100)))
    for i in range(100):
        assert read_frame(s) == b"%d" % i
    s.close()
    wait_for(lambda: len(h.closed) == 1, what="on_close")
    assert h.closed[0][1] is None


@pytest.mark.parametrize("framing", ["raw", "u16"])
def test_half_closing_client_gets_the_replies_workers_still_owe(make_server, connect,
                                                                framing):
    # The client sends its requests and shuts down its write side; the server reads the EOF
    # while a worker is still busy with the requests.  Their replies must still be sent
    # before the session closes (an EOF that closed the session at once would drop them).
    gate = threading.Event()

    class Slow(Handler):
        def on_read(self, session, data):
            assert gate.wait(10)
            session.send(b"re:" + bytes(data))

    srv = make_server(Slow(), framing=framing, workers=2)
    s = connect(srv)
    reqs = [b"a", b"bb", b"ccc"] if framing == "u16" else [b"abc"]
    s.sendall(b"".join(frame(r) for r in reqs) if framing == "u16" else reqs[0])
    s.shutdown(socket.SHUT_WR)
    # the EOF has been read (a data read and the EOF read) while the worker is held
    wait_for(lambda: srv.stats()["recv_syscalls"] >= 2, what="the EOF to be read")
    gate.set()
    data, how = recv_until_closed(s)
    assert how == "eof"
    want = b"".join(frame(b"re:" + r) for r in reqs) if framing == "u16" else b"re:abc"
    assert data == want
    wait_for(lambda: srv.stats()["connections"] == 0, what="the session to close")


def test_shutdown_flushes_pending_data_within_5s(make_server, connect):
    big = bytes(range(256)) * 8192          # 2 MiB per client, more than the socket buffers

    class Dump(Handler):
        def on_read(self, session, data):
            session.send(big)

    srv = make_server(Dump(), max_pending=8 << 20)
    readers = [connect(srv) for _ in range(3)]
    idle = [connect(srv) for _ in range(5)]
    for r in readers:
        r.sendall(b"go")
    wait_for(lambda: srv.stats()["frames_out"] >= 3, what="replies queued")
    t = threading.Thread(target=srv.shutdown)
    t0 = time.monotonic()
    t.start()
    for r in readers:                       # start reading only once shutdown has begun
        data, how = recv_until_closed(r, timeout=10)
        assert how == "eof" and data == big
    for s in idle:
        assert recv_until_closed(s, timeout=10) == (b"", "eof")
    t.join(10)
    assert not t.is_alive()
    assert time.monotonic() - t0 < 5.0
    assert_no_leaks(srv)


def test_shutdown_with_workers_and_clients_connected(make_server, connect):
    srv = make_server(Echo(), framing="u16", workers=3)
    socks = [connect(srv) for _ in range(10)]
    for s in socks:
        s.sendall(b"".join(frame(b"m%d" % i) for i in range(200)))
    for s in socks:
        assert read_frame(s) == b"m0"
    t0 = time.monotonic()
    srv.shutdown()
    assert time.monotonic() - t0 < 5.0
    for s in socks:       # every frame that was read was answered before the close
        data, how = recv_until_closed(s)
        assert how == "eof"
    assert_no_leaks(srv)


def test_send_from_many_threads_keeps_each_threads_order(make_server, connect):
    srv = make_server(Ignore(), framing="u32")
    s = connect(srv)
    wait_for(lambda: srv.sessions)
    sess = srv.sessions[0]
    n, k = 2000, 4

    def sender(t):
        def run():
            for i in range(n):
                sess.send(struct.pack(">II", t, i))
        return run

    got = {t: [] for t in range(k)}
    reader_err = []

    def reader():
        try:
            for _ in range(n * k):
                t, i = struct.unpack(">II", read_frame(s, "u32"))
                got[t].append(i)
        except BaseException as e:   # noqa: BLE001
            reader_err.append(e)

    rt = threading.Thread(target=reader)
    rt.start()
    run_threads([sender(t) for t in range(k)], timeout=60)
    rt.join(30)
    assert not rt.is_alive() and not reader_err
    assert all(got[t] == list(range(n)) for t in range(k))


def test_session_slot_send_and_pool_return(make_server, connect):
    from aoprim import SlabPool
    pool = SlabPool(256, 4)

    class SlotEcho(Handler):
        def on_read(self, session, data):
            slot = pool.acquire()
            mv = memoryview(slot)
            mv[:len(data)] = data
            mv.release()
            slot.length = len(data)
            session.send(slot)      # retained by the batch
            slot.release()          # our reference

    srv = make_server(SlotEcho(), framing="u16")
    s = connect(srv)
    for i in range(50):
        s.sendall(frame(b"slot %d" % i))
        assert read_frame(s) == b"slot %d" % i
    s.close()
    wait_for(lambda: srv.live_sessions == 0)
    assert pool.in_use == 0


def test_backend_accepts_only_what_works():
    from aoprim.server import BACKENDS
    assert BACKENDS == ("selectors", "epoll")
    with pytest.raises(BackendUnavailable, match="io_uring"):
        Server(Echo(), HOST, 0, backend="uring")
    with pytest.raises(ValueError, match="selectors"):
        Server(Echo(), HOST, 0, backend="auto")
    srv = Server(Echo(), HOST, 0)
    assert srv.backend == "selectors"      # the default (docs/server.md)
    srv.shutdown()
    for name in BACKENDS:
        srv = Server(Echo(), HOST, 0, backend=name)
        assert srv.backend == name
        srv.shutdown()


def test_bad_arguments():
    with pytest.raises(TypeError):
        Server(object())
    with pytest.raises(ValueError):
        Server(Echo(), HOST, 0, framing="u64")
    with pytest.raises(TypeError):
        Server(Echo(), HOST, 0, max_connections=10.5)
    with pytest.raises(ValueError):
        Server(Echo(), HOST, 0, idle_timeout=-1)
    with pytest.raises(TypeError):
        Server(Echo(), HOST, 0, workers="2")


def test_lifecycle_is_logged(make_server, connect, caplog):
    caplog.set_level(logging.DEBUG, logger="aoprim.server")
    srv = make_server(Echo())
    s = connect(srv)
    s.sendall(b"x")
    assert recv_exact(s, 1) == b"x"
    s.close()
    wait_for(lambda: srv.live_sessions == 0)
    srv.shutdown()
    text = caplog.text
    assert "listening on" in text and "connected" in text
    assert "peer closed the connection" in text and "server stopped" in text


@pytest.mark.parametrize("workers", [0, 2])
def test_random_frames_in_random_chunks_through_small_slots(make_server, connect, workers):
    """Frames straddling reads, slot relocation and the larger-than-a-slot path, all mixed."""
    h = Recorder()
    srv = make_server(h, framing="u16", rx_slot_size=64, workers=workers)
    s = connect(srv)
    rng = random.Random(11 + workers)
    payloads = [rng.randbytes(rng.choice([0, 1, 5, 30, 61, 62, 63, 64, 100, 500]))
                for _ in range(1500)]
    stream = b"".join(frame(p) for p in payloads)
    done = threading.Event()
    got = []

    def reader():
        for _ in payloads:
            got.append(read_frame(s))
        done.set()

    t = threading.Thread(target=reader)
    t.start()
    i = 0
    while i < len(stream):
        k = rng.randrange(1, 300)
        s.sendall(stream[i:i + k])
        i += k
    assert done.wait(30)
    t.join(10)
    assert got == payloads
    assert h.frames[srv.sessions[0].id] == payloads
    if not workers:     # with workers, each slot stays out until its frames are handled
        assert srv.rx_pool.high_water <= 3


def test_bind_failure_leaks_nothing():
    import os
    blocker = socket.socket()
    blocker.bind((HOST, 0))
    blocker.listen(1)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError):
        Server(Echo(), HOST, blocker.getsockname()[1])
    assert len(os.listdir("/proc/self/fd")) == before
    blocker.close()


@pytest.mark.parametrize("bad", [float("nan"), -1.0], ids=["nan", "negative"])
def test_a_shutdown_timeout_that_is_no_time_is_refused_before_anything_stops(bad):
    srv = Server(Echo(), HOST, 0)
    srv.start()
    try:
        with pytest.raises(ValueError, match="timeout"):
            srv.shutdown(timeout=bad)
        with socket.create_connection(srv.address[:2], timeout=10):
            pass                                # still serving
    finally:
        srv.shutdown(timeout=15)
