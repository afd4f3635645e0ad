"""The server under true parallelism: ``workers=N`` worker threads run ``on_read`` while other
threads call ``Session.send()``, ``Server.broadcast()`` and ``Session.close()``, and a real
client load goes through it.  Every byte is accounted for at the client (exact counts, each
thread's order per session), every session's ``on_close`` runs exactly once, and the server's
gauges (sessions, pool slots, fds) are back to idle after shutdown.

These run on every build; they matter most on a free-threaded one (3.13t), where the worker
threads, the senders and the loop really run at the same time.  Also here: the table of
docs/threads.md names every public type.
"""
import collections
import importlib
import pathlib
import re
import socket
import struct
import subprocess
import sys
import sysconfig
import threading
import time

import pytest

import aoprim
from aoprim import SlabPool
from aoprim.server import Handler, Server
from aoprim.server.loop import BACKENDS

from support import join_all, scaled, start_threads
from server_support import HOST, assert_no_leaks, open_fds, wait_for

ROOT = pathlib.Path(__file__).resolve().parents[2]
FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


class Tally(Handler):
    """Echoes every frame tagged ``E``; records every on_connect and on_close."""

    def __init__(self):
        self.connected = []         # sessions, in on_connect order (list.append: atomic)
        self.closed = []            # session ids, one per on_close call
        self.threads = set()        # names of the threads on_read ran on
        self.overlaps = []          # sessions whose on_read ran on two threads at once

    def on_connect(self, session):
        session.user = threading.Lock()     # held during its on_read: per-session exclusion
        self.connected.append(session)

    def on_read(self, session, data):
        if not session.user.acquire(blocking=False):
            self.overlaps.append(session.id)
            return
        try:
            self.threads.add(threading.current_thread().name)
            session.send(b"E" + bytes(data))
        finally:
            session.user.release()

    def on_close(self, session, exc):
        self.closed.append(session.id)


def pad(t, i):
    """The filler of thread t's item i: its length and bytes depend on both, so a frame cut
    or spliced anywhere does not parse as another."""
    return bytes([(t * 31 + i) & 0xFF]) * ((t * 7 + i * 13) % 97)


def big_pad(t, i):
    return bytes([(t + i) & 0xFF]) * 3000      # above the copy limit: a tx pool slot


def echo_payload(j):
    return struct.pack(">I", j) + bytes([j & 0xFF]) * (j % 41)


class Client:
    """One connection: a writer thread sends ``m`` frames, a reader thread reads frames
    until EOF (or a reset after the server closed the session)."""

    def __init__(self, srv, m, expect):
        self.sock = socket.create_connection(srv.address, timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.addr = self.sock.getsockname()
        self.m = m
        self.expect = expect                # frames of an open session, in all
        self.frames = []
        self.leftover = b""
        self.how = None                     # "eof" | "reset"
        self.complete = threading.Event()   # every expected frame arrived
        self.write_error = None
        self.errors = []

    def write(self, midway=None):
        """Send the m frames; ``midway()`` is called once half of them are sent."""
        def frames(js):
            return b"".join(struct.pack(">H", len(p)) + p for p in map(echo_payload, js))
        try:
            self.sock.sendall(frames(range(self.m // 2)))
            if midway is not None:
                midway()
            data = frames(range(self.m // 2, self.m))
            for k in range(0, len(data), 1500):
                self.sock.sendall(data[k:k + 1500])
        except OSError as e:                # a session the test closes may be gone
            self.write_error = e

    def read(self):
        buf = bytearray()
        try:
            while True:
                try:
                    chunk = self.sock.recv(1 << 16)
                except ConnectionResetError:
                    self.how = "reset"
                    break
                if not chunk:
                    self.how = "eof"
                    break
                buf += chunk
                off = 0
                while len(buf) - off >= 2:
                    n = (buf[off] << 8) | buf[off + 1]
                    if len(buf) - off - 2 < n:
                        break
                    self.frames.append(bytes(buf[off + 2:off + 2 + n]))
                    off += 2 + n
                del buf[:off]
                if len(self.frames) >= self.expect:
                    self.complete.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.errors.append(e)
        finally:
            self.leftover = bytes(buf)
            self.complete.set()

    def sequences(self):
        """(echoed indices, {thread: [item indices]}) in arrival order; a frame that is
        neither an echo nor a thread's item, or whose bytes are wrong, fails the test."""
        echoes, items = [], collections.defaultdict(list)
        for f in self.frames:
            if f[:1] == b"E":
                (j,) = struct.unpack_from(">I", f, 1)
                assert f[1:] == echo_payload(j), f"corrupt echo {f[:16]!r}"
                echoes.append(j)
            elif f[:1] == b"T":
                t, i = struct.unpack_from(">BI", f, 1)
                body = f[6:]
                assert body in (pad(t, i), big_pad(t, i)), f"corrupt item {t}/{i}"
                items[t].append(i)
            else:
                raise AssertionError(f"unexpected frame {f[:16]!r}")
        return echoes, items


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers,nthreads", [(2, 3), (4, 8)])
def test_sends_broadcasts_and_closes_from_threads_under_a_worker_load(backend, workers,
                                                                      nthreads):
    """``nthreads - 1`` threads each send n items to every session -- ``send()`` of bytes,
    of a ``Slot``, and every third item a ``broadcast()`` (small, or large enough for a pool
    slot) -- while the clients' frames are echoed by the workers and one more thread closes
    two of the sessions half-way (one sender thread closes them too, racing it).  Open
    sessions get exactly every item and echo, each thread's items in order; a closed
    session gets a gap-free prefix of each thread's items that holds at least what that
    thread had finished before the close began, and of its echoes.  Half-way every thread
    waits for the others (a barrier), so the closes race the second half of the traffic."""
    n = scaled(300)
    m = scaled(400)
    nconn, nclose = 4, 2
    senders = nthreads - 1
    fds = open_fds()
    pool = SlabPool(256, 512)
    h = Tally()
    srv = Server(h, HOST, 0, framing="u16", workers=workers, backend=backend).start()
    clients = []
    try:
        for k in range(nconn):
            clients.append(Client(srv, m, m + senders * n))
            wait_for(lambda: len(h.connected) == k + 1, 10, "on_connect")
        by_addr = {s.peer: s for s in h.connected}
        sessions = [by_addr[c.addr] for c in clients]
        targets = sessions[:nclose]

        progress = [0] * senders            # items thread t finished to every session
        # half-way, every sender, client writer and the closer meet, so that the closes
        # land in the middle of the traffic (the senders would otherwise often be done
        # before the closer runs); then all of them go on at once
        midway = threading.Barrier(senders + nconn + 1)
        close_now = threading.Event()
        floors = {}

        def sender(t):
            def run():
                closed_here = False
                for i in range(n):
                    if i % 3 == 2:
                        body = big_pad(t, i) if i % 9 == 8 else pad(t, i)
                        srv.broadcast(b"T" + struct.pack(">BI", t, i) + body)
                    elif i % 3 == 1:
                        payload = b"T" + struct.pack(">BI", t, i) + pad(t, i)
                        slot = pool.try_acquire()
                        if slot is None:            # (the pool is only a variant)
                            item = payload
                        else:
                            mv = memoryview(slot)
                            mv[:len(payload)] = payload
                            mv.release()
                            slot.length = len(payload)
                            item = slot
                        for s in sessions:
                            s.send(item)
                        if slot is not None:
                            slot.release()          # each send retained its own reference
                    else:
                        payload = bytearray(b"T" + struct.pack(">BI", t, i) + pad(t, i))
                        for s in sessions:
                            s.send(payload)         # copied: reusable at once
                        payload[:] = b"X" * len(payload)
                    progress[t] = i + 1
                    if i == n // 2:
                        midway.wait(120)
                    if t == 1 and not closed_here and close_now.is_set():
                        closed_here = True
                        for s in targets:
                            s.close()
            return run

        def closer():
            midway.wait(120)
            floors.update(enumerate(list(progress)))    # before any close began
            close_now.set()
            for s in targets:
                s.close()

        readers, rerrs = start_threads([c.read for c in clients])
        writers, werrs = start_threads([lambda c=c: c.write(lambda: midway.wait(120))
                                        for c in clients])
        workers_ts, errs = start_threads([sender(t) for t in range(senders)] + [closer])
        join_all(workers_ts)
        assert not errs, errs
        join_all(writers)
        for c in clients[nclose:]:
            assert c.complete.wait(120), "an open session's frames did not all arrive"
            assert c.write_error is None, c.write_error
        # the closed sessions ended (their readers saw the server's FIN): end our side too
        for c in clients[:nclose]:
            assert c.complete.wait(120)
            try:
                c.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        wait_for(lambda: all(s.closed for s in targets), 30, "the closed sessions")
    finally:
        srv.shutdown(timeout=60)
        try:
            join_all(readers)
        finally:
            for c in clients:
                c.sock.close()
    assert not rerrs and not werrs, (rerrs, werrs)
    for c in clients:
        assert not c.errors, c.errors
        assert c.leftover == b"", f"a frame cut short: {c.leftover[:16]!r}"

    for k, c in enumerate(clients):
        echoes, items = c.sequences()
        if k >= nclose:
            assert echoes == list(range(m)), f"session {k}: echoes lost or reordered"
            for t in range(senders):
                assert items[t] == list(range(n)), f"session {k}: thread {t}'s items"
            assert len(c.frames) == m + senders * n
        else:
            assert echoes == list(range(len(echoes))), f"closed session {k}: echoes"
            for t in range(senders):
                got = items[t]
                assert got == list(range(len(got))), f"closed session {k}: thread {t} gap"
                assert len(got) >= floors[t], \
                    f"closed session {k}: thread {t} lost items sent before the close"

    assert not h.overlaps, f"on_read ran on two threads at once for sessions {h.overlaps}"
    assert h.threads and all(name.startswith("aoprim-worker") for name in h.threads), h.threads
    assert sorted(h.closed) == sorted(s.id for s in h.connected), \
        f"on_close not exactly once per session: {collections.Counter(h.closed)}"
    wait_for(lambda: pool.in_use == 0, 10, "every sent slot back in the test's pool")
    assert_no_leaks(srv, fds)
    st = srv.stats()
    assert st["live_sessions"] == 0 and st["connections"] == 0
    assert st["closes"].get("closed", 0) >= nclose


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", [2, 4])
def test_shutdown_while_threads_send_and_broadcast_leaves_nothing_held(backend, workers):
    """shutdown() while 4 threads go on sending bytes and ``Slot``s and broadcasting: no
    sender sees an exception (sends after the close are dropped), every client gets whole
    frames, each thread's items in order with no gap (the last frame may be cut only where
    the session was aborted: the senders can outrun a client past ``max_pending``),
    ``on_close`` exactly once, every slot back in the test's pool and in the server's, no
    fd left."""
    nconn, nthreads, warm = 4, 4, scaled(50)
    fds = open_fds()
    pool = SlabPool(256, 1024)
    h = Tally()
    # (the senders keep adding while the sessions flush: shutdown_timeout bounds the wait
    # before the rest are aborted)
    srv = Server(h, HOST, 0, framing="u16", workers=workers, backend=backend,
                 shutdown_timeout=2.0).start()
    clients = []
    try:
        for k in range(nconn):
            clients.append(Client(srv, 0, 1 << 62))
            wait_for(lambda: len(h.connected) == k + 1, 10, "on_connect")
        sessions = list(h.connected)
        stop = threading.Event()
        warmed = [threading.Event() for _ in range(nthreads)]

        def sender(t):
            def run():
                i = 0
                while not stop.is_set():
                    head = b"T" + struct.pack(">BI", t, i)
                    if i % 3 == 2:
                        srv.broadcast(head + (big_pad(t, i) if i % 9 == 8 else pad(t, i)))
                    else:
                        slot = pool.try_acquire() if i % 3 == 1 else None
                        item = head + pad(t, i)
                        if slot is not None:
                            mv = memoryview(slot)
                            mv[:len(item)] = item
                            mv.release()
                            slot.length = len(item)
                        for s in sessions:
                            s.send(item if slot is None else slot)
                        if slot is not None:
                            slot.release()
                    i += 1
                    if i == warm:
                        warmed[t].set()
            return run

        readers, rerrs = start_threads([c.read for c in clients])
        senders, serrs = start_threads([sender(t) for t in range(nthreads)])
        try:
            for e in warmed:
                assert e.wait(120), "a sender did not get going"
            srv.shutdown(timeout=60)        # the senders are still sending
        finally:
            stop.set()
            join_all(senders)
            join_all(readers)
            for c in clients:
                c.sock.close()
    finally:
        srv.shutdown(timeout=60)
    assert not serrs, serrs
    assert not rerrs, rerrs
    for k, c in enumerate(clients):
        assert not c.errors, c.errors
        # a stream the server closed gracefully ends on a frame boundary; one it aborted
        # (max_pending: the senders outrun this client; or shutdown_timeout) may not
        assert c.how == "reset" or c.leftover == b"", f"session {k}: a frame cut short"
        echoes, items = c.sequences()
        assert not echoes
        for t in range(nthreads):
            got = items[t]
            assert got == list(range(len(got))), f"session {k}: thread {t}'s items have a gap"
    assert sorted(h.closed) == sorted(s.id for s in h.connected), \
        f"on_close not exactly once per session: {collections.Counter(h.closed)}"
    assert pool.in_use == 0, f"{pool.in_use} slots the senders sent are still held"
    assert_no_leaks(srv, fds)


def lcg(x, rounds):
    """Pure-Python arithmetic: no call in it releases a lock or the GIL."""
    for _ in range(rounds):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
    return x


class Crunch(Handler):
    """A CPU-bound handler: every frame costs ``rounds`` steps of arithmetic."""

    rounds = 300

    def __init__(self):
        self.closed = []
        self.connected = []
        self.overlaps = []
        self.threads = set()

    def on_connect(self, session):
        session.user = threading.Lock()
        self.connected.append(session.id)

    def on_read(self, session, data):
        if not session.user.acquire(blocking=False):
            self.overlaps.append(session.id)
            return
        try:
            self.threads.add(threading.current_thread().name)
            (j, seed) = struct.unpack(">II", data)
            session.send(struct.pack(">II", j, lcg(seed, self.rounds)))
        finally:
            session.user.release()

    def on_close(self, session, exc):
        self.closed.append(session.id)


@pytest.mark.timeout(300)
def test_a_cpu_bound_handler_on_two_workers_answers_every_frame_in_order(backend):
    """workers=2 and a pure-Python CPU-bound on_read: every reply is the right result, in
    each session's order; a session's on_read never runs on two workers at once; on_close
    exactly once; nothing held after shutdown.  (Correctness only: the speed-up is
    measured by the benchmarks, never asserted.)"""
    nconn, m = 6, scaled(300)
    fds = open_fds()
    h = Crunch()
    srv = Server(h, HOST, 0, framing="u16", workers=2, backend=backend).start()
    socks = []
    results = {}
    try:
        for _ in range(nconn):
            s = socket.create_connection(srv.address, timeout=60)
            socks.append(s)

        def client(k):
            def run():
                s = socks[k]
                seeds = [(k * 1000003 + j * 7919) & 0x7FFFFFFF for j in range(m)]
                s.sendall(b"".join(struct.pack(">HII", 8, j, seeds[j]) for j in range(m)))
                got = bytearray()
                while len(got) < m * 10:
                    chunk = s.recv(1 << 16)
                    if not chunk:
                        raise ConnectionError(f"EOF after {len(got)} bytes")
                    got += chunk
                s.shutdown(socket.SHUT_WR)
                assert s.recv(1) == b""         # the server closes after our EOF
                results[k] = (seeds, bytes(got))
            return run

        ts, errs = start_threads([client(k) for k in range(nconn)])
        join_all(ts, 240)
        assert not errs, errs
    finally:
        srv.shutdown(timeout=60)
        for s in socks:
            s.close()
    for k in range(nconn):
        seeds, got = results[k]
        for j in range(m):
            hdr, jj, val = struct.unpack_from(">HII", got, j * 10)
            assert (hdr, jj) == (8, j), f"session {k}: reply {j} out of order"
            assert val == lcg(seeds[j], Crunch.rounds), f"session {k}: reply {j} wrong"
    assert not h.overlaps, h.overlaps
    assert all(name.startswith("aoprim-worker") for name in h.threads), h.threads
    assert sorted(h.closed) == sorted(h.connected) and len(h.closed) == nconn
    assert_no_leaks(srv, fds)


def refused(code):
    """Run ``code`` in a fresh interpreter (a crash must not take pytest with it: it shows
    as the exit status, -11 for a segfault) and return how many of its off-thread calls were
    refused with RuntimeError (its last line: "refused N")."""
    r = subprocess.run([sys.executable, "-c", code, "1"], capture_output=True, text=True,
                       timeout=100)
    assert r.returncode == 0, f"exit status {r.returncode}: {r.stderr[-2000:]}"
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    return int(r.stdout.split()[-1])


# Timers cancelled on four threads other than the loop's (loop-thread-only: misuse) while
# the loop runs due timers; cancelling many far ones would make the heap compact itself
# under the loop's feet.  Every such cancel() must be refused, and the loop must go on.
CANCEL_RACE = r"""
import sys, threading, time
from aoprim.server._eloop import EpollCore
secs = float(sys.argv[1])
core = EpollCore()
far = [core.call_later(3600, print) for _ in range(1024)]    # set-up: allowed
stop = threading.Event()
refused = [0] * 4
ran = [0]
def tick():
    ran[0] += 1
def arm():
    for _ in range(32):
        core.call_later(0, tick)
    if stop.is_set():
        core.stop()
    else:
        core.call_soon(arm)
done = []
def canceller(k):
    end = time.monotonic() + secs
    while time.monotonic() < end:
        try:
            far[-1].cancel()
        except RuntimeError as e:
            assert "call_soon_threadsafe" in str(e), e
            refused[k] += 1
    done.append(k)
    if len(done) == 4:          # the loop runs until every thread has made its calls
        stop.set()
ths = [threading.Thread(target=canceller, args=(k,)) for k in range(4)]
core.call_soon(arm)
core.call_soon(lambda: [t.start() for t in ths])
core.run()
for t in ths:
    t.join()
assert ran[0] > 0 and not any(t.cancelled for t in far)
far[0].cancel()                 # the loop has returned: its owner may cancel again
assert far[0].cancelled
core.close()
print("refused", sum(refused))
"""


@pytest.mark.timeout(120)
def test_an_epoll_timer_cancelled_on_another_thread_is_refused():
    """cancel() belongs to the loop thread while it runs (the timer phase walks the heap
    through borrowed pointers; a compaction on another thread would free timers under it):
    from another thread it raises RuntimeError and changes nothing, and the loop goes on."""
    assert refused(CANCEL_RACE) > 0


# An fd's callbacks replaced on four threads other than the loop's (misuse: loop-thread-only)
# while the loop dispatches that fd: the fd table holds the only reference to each callback.
# Every call_soon/call_at/add_iteration_hook from those threads must be refused as well.
SET_CALLBACKS_RACE = r"""
import socket, sys, threading, time
from aoprim.server._eloop import EpollCore
secs = float(sys.argv[1])
core = EpollCore()
pairs = [socket.socketpair() for _ in range(16)]
for a, b in pairs:
    b.send(b"x")
hits = [0]
def make():
    return lambda: hits.__setitem__(0, hits[0] + 1)
for a, _ in pairs:
    core.set_callbacks(a.fileno(), make(), None)
refused = [0] * 4
made = [0] * 4
calls = [lambda a: core.set_callbacks(a.fileno(), make(), None),
         lambda a: core.remove(a.fileno()),
         lambda a: core.call_soon(print),
         lambda a: core.call_later(0, print),
         lambda a: core.add_iteration_hook(print)]
def swapper(k):
    end = time.monotonic() + secs
    i = 0
    while time.monotonic() < end:
        for a, _ in pairs:
            i += 1
            made[k] += 1
            try:
                calls[i % len(calls)](a)
            except RuntimeError as e:
                assert "call_soon_threadsafe" in str(e), e
                refused[k] += 1
    done.append(k)
    if len(done) == 4:          # the loop runs until every thread has made its calls
        core.call_soon_threadsafe(core.stop)
done = []
ths = [threading.Thread(target=swapper, args=(k,)) for k in range(4)]
core.call_soon(lambda: [t.start() for t in ths])
core.run()
for t in ths:
    t.join()
assert hits[0] > 0 and refused == made     # every off-thread call refused
for a, b in pairs:
    core.remove(a.fileno())     # the loop has returned: allowed again
    a.close()
    b.close()
core.close()
print("refused", sum(refused))
"""


@pytest.mark.timeout(120)
def test_loop_thread_calls_from_another_thread_are_refused_while_the_epoll_loop_runs():
    """set_callbacks/remove/call_soon/call_later/add_iteration_hook belong to the loop
    thread while it runs (the fd table's store would free the callback the loop holds
    borrowed): from another thread they raise RuntimeError naming call_soon_threadsafe, the
    loop dispatches on, and every one of those calls is refused (the threads make nothing
    but them)."""
    assert refused(SET_CALLBACKS_RACE) > 0


# -- docs/threads.md names every public type ---------------------------------------------
# the server's compiled parts: classes a user of the server meets (a Session's receiver, the
# epoll backend's core, the TLS path)
SERVER_COMPILED = ("aoprim.server._receiver", "aoprim.server._proxyproto",
                   "aoprim.server._eloop", "aoprim.server._tls")


def _public_types():
    names = []
    for mod, exported in [(aoprim, aoprim.__all__)] + [
            (m, [n for n in vars(m) if not n.startswith("_")])
            for m in map(importlib.import_module, SERVER_COMPILED)]:
        for name in exported:
            obj = getattr(mod, name)
            if (isinstance(obj, type) and not issubclass(obj, BaseException)
                    and (mod is aoprim or obj.__module__ == mod.__name__)):
                names.append(name)
    return names


def test_the_threads_table_names_every_public_type():
    """Each public class of ``aoprim`` (its ``__all__``, exceptions aside) and of the server's
    compiled modules, the server's ``Server``/``Session``/``Handler`` and aoprim.aio's loop
    and transport has a row of its
    own in docs/threads.md's table: a type added without saying what may be shared between
    threads fails here."""
    text = (ROOT / "docs" / "threads.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    named = set()
    for row in rows:
        first = row.split("|")[1]
        named.update(re.findall(r"`([A-Za-z_][\w.]*)`", first))
    want = _public_types() + ["Server", "Session", "Handler", "aoprim.aio.Loop",
                              "SocketTransport"]
    assert "BlockTable" in want and "ProxyParser" in want      # the list is not empty
    missing = [w for w in want if w not in named]
    assert not missing, f"docs/threads.md has no row for {missing}"
