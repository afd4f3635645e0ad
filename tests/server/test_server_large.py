"""Large messages: what a session's receive memory may hold while its by-reference
echoes wait for a peer that does not read."""
import random
import socket
import struct
import threading

import pytest

from aoprim.server import Handler
from aoprim.server.loop import BACKENDS

from server_support import connect, frame, make_server, read_frame, recv_exact, wait_for  # noqa: F401


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


class SlowEcho(Handler):
    """Echo; each session's send buffer is made tiny, so what it sends stays pending."""

    def __init__(self):
        self.sessions = []

    def on_connect(self, session):
        session.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        self.sessions.append(session)

    def on_read(self, session, data):
        session.send(data)


@pytest.mark.timeout(60)
def test_raw_echoes_pending_to_a_non_reader_do_not_pin_a_read_slot_each(make_server, connect):
    # Each 40 KiB message arrives as its own recv into a 512 KiB raw read slot and is echoed
    # by reference.  A peer that does not read leaves those echoes pending (below
    # high_water, so reading goes on): pinning one whole slot per echo made a session hold
    # ~13x its pending bytes in receive memory (5 slots, 2.5 MiB, for 200 KiB pending).
    # Bound: one slot, plus slots at least half used (2x the pending bytes).
    h = SlowEcho()
    srv = make_server(h, framing="raw")
    c = connect(srv, rcvbuf=4096)
    wait_for(lambda: h.sessions, what="the session")
    s = h.sessions[0]
    msg = bytes(range(256)) * 160        # 40 KiB
    sent = 0
    while s.pending_bytes < 200 * 1024:
        c.sendall(msg)
        sent += len(msg)
        wait_for(lambda: srv.stats()["bytes_in"] == sent, what="the message read")
    st = srv.stats()
    read_size = srv._arena.raw_read_size
    pinned = st["rx_raw_slots_in_use"] - 1          # the arena's own read slot
    assert pinned * read_size <= read_size + 2 * s.pending_bytes, (pinned, st)
    # every echoed byte arrives intact once the peer reads
    assert recv_exact(c, sent, timeout=30) == msg * (sent // len(msg))


class Keeper(Handler):
    """Keeps a sub-view of every frame (each pins its raw read slot)."""

    def __init__(self):
        self.kept = []

    def on_read(self, session, data):
        self.kept.append(data[:])


@pytest.mark.timeout(60)
def test_raw_read_pool_exhaustion_is_logged_with_that_pools_counts(make_server, connect,
                                                                   caplog):
    # The warning named the 16 KiB receive pool ("1 of 1024 slots in use") when the raw
    # read pool was the one exhausted: nothing in it said which pool to enlarge.
    h = Keeper()
    srv = make_server(h, framing="raw", rx_read_slots=2)
    c = connect(srv)
    sent = 0
    try:
        with caplog.at_level("WARNING", logger="aoprim.server"):
            for i in range(4):
                c.sendall(bytes([i]) * 1000)
                sent += 1000
                wait_for(lambda: srv.stats()["bytes_in"] == sent, what="the message read")
            assert srv.stats()["rx_pool_fallbacks"] >= 1
            wait_for(lambda: any("exhausted" in r.getMessage() for r in caplog.records), 5,
                     "the pool warning")
        msg = next(r.getMessage() for r in caplog.records if "exhausted" in r.getMessage())
        assert "raw read pool" in msg and "of 2 slots" in msg, msg
    finally:
        h.kept.clear()          # the pinned slots go back before the leak checks


@pytest.mark.timeout(60)
def test_u32_echoes_pending_to_a_non_reader_do_not_pin_cached_max_frame_buffers(make_server,
                                                                                connect):
    # A 40 KiB frame took the smallest cached frame buffer of need..max_frame+header bytes
    # -- a 1 MiB one -- and its echo, by reference, pinned it while pending: a peer that
    # does not read made its session hold ~4 MiB of frame buffers for ~200 KiB pending
    # (and other sessions' 1 MiB frames refill the cache, so it grew with every such
    # session).  Bound: a frame buffer is at most twice its frame.
    h = SlowEcho()
    big = 1 << 20
    srv = make_server(h, framing="u32", max_frame=big)
    warm = [connect(srv) for _ in range(4)]
    payload = bytes(range(256)) * (big // 256)
    msg = frame(payload, "u32")
    for w in warm:                      # four 1 MiB frame buffers at once ...
        w.sendall(msg[:big // 2])
    wait_for(lambda: srv.stats()["rx_frame_buffers_in_use"] == 4, what="4 frame buffers")
    for w in warm:
        w.sendall(msg[big // 2:])
    for w in warm:                      # ... kept by the cache once echoed
        assert read_frame(w, "u32", timeout=30) == payload
    wait_for(lambda: srv.stats()["rx_frame_buffers_in_use"] == 0, what="the buffers back")
    kept = srv.stats()["rx_frame_cache_bytes"]
    assert kept >= 4 * big
    c = connect(srv, rcvbuf=4096)
    wait_for(lambda: len(h.sessions) == 5, what="the session")
    s = h.sessions[4]
    small = frame(bytes(range(256)) * 160, "u32")       # 40 KiB
    sent = srv.stats()["bytes_in"]
    n = 0
    while s.pending_bytes < 200 * 1024:
        c.sendall(small)
        sent += len(small)
        n += 1
        wait_for(lambda: srv.stats()["bytes_in"] == sent, what="the frame read")
    taken = kept - srv.stats()["rx_frame_cache_bytes"]
    assert taken <= 2 * s.pending_bytes, (taken, s.pending_bytes)
    assert recv_exact(c, n * len(small), timeout=30) == small * n


class EchoTwice(Handler):
    """Sends each frame back twice (the same view, by reference, twice when large)."""

    def on_read(self, session, data):
        session.send(data)
        session.send(data)


def _client(addr, hs, payloads, seed, slow, errors):
    try:
        _client_run(addr, hs, payloads, seed, slow, errors)
    except Exception as e:              # counted: a client that failed fails the test
        errors.append(f"seed {seed}: {e!r}")


def _client_run(addr, hs, payloads, seed, slow, errors):
    rng = random.Random(seed)
    fmt = {2: ">H", 4: ">I"}.get(hs)
    wire = b"".join((struct.pack(fmt, len(p)) if fmt else b"") + p for p in payloads)
    c = socket.create_connection(addr)
    c.settimeout(30)
    got = bytearray()

    def reader():
        try:
            while len(got) < 2 * len(wire):
                chunk = c.recv(4096 if slow else 1 << 20)
                if not chunk:
                    break
                got.extend(chunk)
        except OSError as e:
            errors.append(repr(e))

    t = threading.Thread(target=reader)
    t.start()
    i = 0
    while i < len(wire):                # writes cut at random, across frame boundaries
        k = rng.randint(1, 3 << 20)
        c.sendall(wire[i:i + k])
        i += k
    t.join(60)
    c.close()
    if hs:
        want = b"".join(2 * (struct.pack(fmt, len(p)) + p) for p in payloads)
        if bytes(got) != want:
            errors.append(f"seed {seed}: {len(got)} bytes echoed, {len(want)} expected, "
                          "or different bytes")
    elif len(got) != 2 * len(wire):     # raw: reads are echoed twice each, cut unknown
        errors.append(f"seed {seed}: {len(got)} bytes echoed, {2 * len(wire)} expected")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("framing", ["raw", "u16", "u32"])
def test_random_sizes_echo_twice_byte_for_byte(make_server, framing):
    # 1 B .. 2 MiB messages mixed with small ones, each echoed twice by reference, to fast
    # and slow readers at once: every echoed byte equals the byte received (a receive slot
    # or frame buffer reused before the kernel took the echo would show as different bytes)
    maxf = {"raw": 2 << 20, "u16": 65535, "u32": 2 << 20}[framing]
    srv = make_server(EchoTwice(), framing=framing, max_pending=64 << 20,
                      **({} if framing == "raw" else {"max_frame": maxf}))
    hs = {"raw": 0, "u16": 2, "u32": 4}[framing]
    rng = random.Random(20)
    errors = []
    threads = []
    for i in range(4):
        sizes = [min(maxf, rng.choice([rng.randint(1, 64), rng.randint(1, 70000),
                                       rng.randint(1, maxf)])) for _ in range(10)]
        payloads = [rng.randbytes(n) for n in sizes]
        threads.append(threading.Thread(target=_client, args=(srv.address, hs, payloads,
                                                              i, i % 2 == 0, errors)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert not errors, errors
    wait_for(lambda: srv.stats()["connections"] == 0, 10, "the sessions closed")
    st = srv.stats()
    assert st["rx_frame_buffers_in_use"] == 0 and st["rx_raw_slots_in_use"] <= 1, st


class SendThenLook(Handler):
    """Echo; records the pending bytes right after each send of a large frame view."""

    def __init__(self, shut_first=False):
        self.after = []
        self.closed = []
        self.shut_first = shut_first

    def on_connect(self, session):
        session.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)

    def on_read(self, session, data):
        if self.shut_first:
            session.socket.shutdown(socket.SHUT_WR)     # the write now fails (EPIPE)
        session.send(data)
        if data.nbytes >= 32768:
            self.after.append(session.pending_bytes)

    def on_close(self, session, exc):
        self.closed.append(session.id)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("framing", ["raw", "u32"])
def test_a_large_echo_is_handed_to_the_kernel_inside_send(make_server, connect, framing):
    # A by-reference echo waited for the iteration's flush: each session served in the
    # iteration kept its read slot (or frame buffer) pinned until then, so a burst of large
    # echoes copied them in and out of memory that had left the CPU's cache.  Now send()
    # writes it at once (as asyncio's write()): nothing is pending right after it.
    h = SendThenLook()
    srv = make_server(h, framing=framing, **({"max_frame": 1 << 20} if framing == "u32"
                                             else {}))
    c = connect(srv)
    payload = bytes(range(256)) * 256             # 64 KiB
    msg = payload if framing == "raw" else frame(payload, framing)
    for _ in range(8):
        c.sendall(msg)
        assert recv_exact(c, len(msg), timeout=30) == msg
    assert h.after and h.after == [0] * len(h.after), h.after
    # (the echo can arrive before on_read has returned and its frame view was released)
    wait_for(lambda: srv.stats()["rx_raw_slots_in_use"] == (1 if framing == "raw" else 0)
             and srv.stats()["rx_frame_buffers_in_use"] == 0, what="the buffers back")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("framing", ["raw", "u32"])
def test_a_large_echo_whose_write_fails_inside_send_aborts_and_returns_everything(
        make_server, connect, framing):
    # The close path of the write made inside send(): EPIPE there aborts the session (as
    # the iteration's flush reports it), on_close runs once, and the read slot / frame
    # buffer the echo referenced goes back (the fixture's leak checks after shutdown).
    h = SendThenLook(shut_first=True)
    srv = make_server(h, framing=framing, **({"max_frame": 1 << 20} if framing == "u32"
                                             else {}))
    c = connect(srv)
    payload = bytes(range(256)) * 256
    c.sendall(payload if framing == "raw" else frame(payload, framing))
    wait_for(lambda: h.closed, what="the session closed")
    assert len(h.closed) == 1
    wait_for(lambda: srv.stats()["connections"] == 0, what="the connection gone")
    wait_for(lambda: srv.stats()["rx_raw_slots_in_use"] == (1 if framing == "raw" else 0)
             and srv.stats()["rx_frame_buffers_in_use"] == 0, what="the buffers back")
    st = srv.stats()
    assert st["closes"].get("reset", 0) + st["closes"].get("send error", 0) == 1, st["closes"]
