"""TLS vs plain TCP, a differential test over random input: the same scenario --
a sequence of client writes (random sizes and split points, several frames per write, frames
split across TCP writes and, over TLS, across TLS records and record headers split across TCP
writes; frames near and above ``max_frame``) against the same handler (echo, several sends
per frame, a ``Slot`` sent and broadcast to several sessions, close after a write) -- runs
against a plain ``Server`` and a TLS ``Server`` of the same framing, backend and workers, and
what every peer decodes (bytes, order, how the stream ended) and the server's counts (frames
in/out, close causes, every slot and fd back to idle) must be equal.

The TLS client is an ``SSLObject`` over a ``MemoryBIO`` pair, so the test decides where the
plaintext is cut into records (one ``write`` per plaintext chunk) and, independently, where
the ciphertext is cut into TCP writes.  A reader thread per connection collects what the
server sends (ciphertext is decrypted after the connection ended, on the thread that owns the
``SSLObject``), so a server that stops reading while its replies back up never deadlocks the
client.  ``AOPRIM_TLS_DIFF_EXAMPLES`` raises the number of examples per configuration.
"""
import os
import random
import socket
import ssl
import struct
import threading

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from aoprim.server import Handler, Server  # noqa: E402
from aoprim.server.loop import BACKENDS  # noqa: E402

from tlscerts import bio_handshake, have_openssl, make_certs  # noqa: E402
from server_support import HOST, assert_no_leaks, open_fds, wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(300)

EXAMPLES = int(os.environ.get("AOPRIM_TLS_DIFF_EXAMPLES", "6"))

# framed ops: the first payload byte of a frame
ECHO, MULTI, BCAST, SLOT, SLOT_BCAST, CLOSE, COPY = range(7)
NOPS = 7
RAW_CLOSE = 0xFF            # raw framing: the handler closes after echoing this byte
WIRE_OUT = {}               # id(server) -> ciphertext sent in its last scenario
HANDLERS = {}               # id(server) -> its DiffHandler
IDLE = {}                   # id(server) -> its stats() once started (the idle gauges)
_XOR = bytes(i ^ 0x5A for i in range(256))

# (framing, max_frame): max_frame small enough that frames near and above it are cheap, one
# above the TLS record size (16 KiB), the receive slot (16 KiB) and the by-reference send
# threshold (32 KiB)
CONFIGS = [("raw", 65536), ("u16", 20000), ("u16", 65536), ("u32", 200000)]


class DiffHandler(Handler):
    """Deterministic replies, whatever the read boundaries (raw framing: every reply is a
    per-byte function of the stream)."""

    def __init__(self):
        self.srv = None
        self.lock = threading.Lock()
        self.connected = 0

    def on_connect(self, session):
        with self.lock:
            self.connected += 1

    def on_close(self, session, exc):
        with self.lock:
            self.connected -= 1

    def on_read(self, session, data):
        if self.srv.settings.header_size == 0:
            self._raw(session, data)
            return
        if not len(data):
            session.send(b"")
            return
        op = data[0] % NOPS
        if op == ECHO:
            session.send(data)                      # the view (by reference when large)
        elif op == COPY:
            session.send(bytes(data).translate(_XOR))
        elif op == MULTI:
            n = len(data)
            session.send(data[:n // 3])
            session.send(b"")
            session.send(bytearray(data[n // 3:]))
            session.send(memoryview(bytes(data))[n // 2:])
        elif op == BCAST:
            self.srv.broadcast(data)                # every session, this one too
            session.send(data[:1])
        elif op in (SLOT, SLOT_BCAST):
            slot = self.srv.tx_pool.acquire()
            try:
                n = min(len(data), slot.size)
                mv = memoryview(slot)
                mv[:n] = data[:n]
                mv.release()
                slot.length = n
                if op == SLOT:
                    session.send(slot)
                else:
                    self.srv.broadcast(slot)
            finally:
                slot.release()
        elif op == CLOSE:
            session.send(data)
            session.close()

    def _raw(self, session, data):
        b = bytes(data)
        i = b.find(RAW_CLOSE)
        if i >= 0:
            b = b[:i + 1]
        t = b.translate(_XOR)
        h = len(t) // 2
        session.send(t[:h])
        session.send(memoryview(t)[h:])
        self.srv.broadcast(b, exclude=session)      # the listeners get the stream itself
        if i >= 0:
            session.close()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    if not have_openssl():
        pytest.skip("no openssl binary")
    return make_certs(tmp_path_factory.mktemp("tlsdiff"))


@pytest.fixture
def servers(certs):
    """(backend, framing, max_frame, workers) -> (plain server, TLS server), started on
    first use, shut down (and checked for leaks) at the end of the test."""
    made = {}

    def get(backend, framing, max_frame, workers):
        key = (backend, framing, max_frame, workers)
        if key not in made:
            pair = []
            for tls in (False, True):
                h = DiffHandler()
                kw = dict(framing=framing, max_frame=max_frame, workers=workers,
                          backend=backend, max_pending=64 << 20, close_linger=10.0)
                if tls:
                    ctx = certs.server_ctx()
                    kw["ssl"] = ctx
                srv = Server(h, HOST, 0, **kw)
                h.srv = srv
                HANDLERS[id(srv)] = h
                pair.append(srv.start())
                IDLE[id(srv)] = srv.stats()
            made[key] = tuple(pair)
        return made[key]

    yield get
    for pair in made.values():
        for srv in pair:
            srv.shutdown(timeout=15)
    for pair in made.values():
        for srv in pair:
            assert_no_leaks(srv)


# -- the client side -----------------------------------------------------------------------

class Peer:
    """One client connection: writes on the calling thread, a reader thread collects what
    arrives (raw bytes off the socket) until EOF or a reset."""

    def __init__(self, srv, client_ctx):
        self.sock = socket.create_connection(srv.address, timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.tls = client_ctx is not None
        self.wire = bytearray()
        self.end = None
        self.early = b""
        if self.tls:
            self.inc = ssl.MemoryBIO()
            self.out = ssl.MemoryBIO()
            self.obj = client_ctx.wrap_bio(self.inc, self.out, server_hostname="localhost")
            self._handshake()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _handshake(self):
        bio_handshake(self.sock, self.obj, self.inc, self.out)

    def _read(self):
        while True:
            try:
                data = self.sock.recv(1 << 20)
            except ConnectionResetError:
                self.end = "reset"
                return
            except OSError as e:
                self.end = f"error {e.errno}"
                return
            if not data:
                self.end = "eof"
                return
            self.wire += data

    def send_stream(self, chunks, tcp_cuts):
        """Send the plaintext ``chunks`` (one TLS write each); the bytes on the wire are cut
        into TCP writes by ``tcp_cuts`` (a list of sizes, cycled; 0: as produced).  Stops
        quietly once the server is gone."""
        try:
            if not self.tls:
                self._send_cut(b"".join(chunks), tcp_cuts)
                return
            for c in chunks:
                if c:
                    self.obj.write(c)
                if tcp_cuts == [0]:         # each TLS write's records as one TCP write
                    self.sock.sendall(self.out.read())
            if tcp_cuts != [0]:
                self._send_cut(self.out.read(), tcp_cuts)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _send_cut(self, data, cuts):
        if cuts == [0]:
            self.sock.sendall(data)
            return
        i = 0
        k = 0
        n = len(data)
        while i < n:
            c = cuts[k % len(cuts)]
            k += 1
            self.sock.sendall(data[i:i + c])
            i += c

    def half_close(self, notify=True):
        """The client's EOF: over TLS ``close_notify`` first (or not, ``notify=False``)."""
        try:
            if self.tls and notify:
                try:
                    self.obj.unwrap()
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLError:
                    pass
                if self.out.pending:
                    self.sock.sendall(self.out.read())
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def finish(self, timeout=60):
        """Wait for the end of the stream; returns (plaintext received, how it ended)."""
        self.reader.join(timeout)
        assert not self.reader.is_alive(), "the server never closed the connection"
        self.sock.close()
        if not self.tls:
            return bytes(self.wire), self.end
        # decrypt what arrived, here (the thread that owns the SSLObject)
        self.inc.write(bytes(self.wire))
        self.inc.write_eof()
        got = bytearray()
        end = self.end
        while True:
            try:
                d = self.obj.read(1 << 20)
            except ssl.SSLZeroReturnError:
                break                               # close_notify: a clean EOF
            except ssl.SSLEOFError:
                end += f" (no close_notify; {len(self.wire)} bytes on the wire)"
                break
            except ssl.SSLWantReadError:
                end += " (truncated record)"
                break
            except ssl.SSLError as e:
                end += f" (TLS error {e.reason})"
                break
            if not d:
                break
            got += d
        return bytes(got), end


def split_frames(data, hs):
    """Framed bytes -> (payloads, trailing bytes of an incomplete frame)."""
    out = []
    i = 0
    fmt = ">H" if hs == 2 else ">I"
    while len(data) - i >= hs:
        (n,) = struct.unpack_from(fmt, data, i)
        if len(data) - i - hs < n:
            break
        out.append(data[i + hs:i + hs + n])
        i += hs + n
    return out, data[i:]


# -- the scenario --------------------------------------------------------------------------

@st.composite
def scenarios(draw, framing, max_frame):
    """A small description (printed by hypothesis when a test fails); build() makes the
    bytes from it."""
    hs = {"raw": 0, "u16": 2, "u32": 4}[framing]
    limit = min(max_frame, 65535) if hs == 2 else max_frame
    near = [limit - 1, limit] + ([max_frame + 1] if hs != 2 or max_frame < 65535 else [])
    size = st.one_of(st.integers(0, 40), st.integers(41, 3000), st.integers(3001, limit),
                     st.sampled_from(near))
    frames = draw(st.lists(st.tuples(st.integers(0, NOPS - 1), size, st.booleans()),
                           min_size=1, max_size=12))
    return dict(seed=draw(st.integers(0, 2**32 - 1)), frames=frames,
                ncuts=draw(st.integers(0, 8)),
                tcp=draw(st.sampled_from(["asis", "tiny", "random", "one"])),
                listeners=draw(st.integers(0, 2)),
                notify=draw(st.booleans()))     # TLS: the client's close_notify before EOF


def build(sc, hs):
    """(plaintext chunks, TCP cut sizes) of a scenario."""
    rng = random.Random(sc["seed"])
    stream = bytearray()
    for op, n, flag in sc["frames"]:
        if hs:
            stream += struct.pack(">H" if hs == 2 else ">I", n)
            stream += bytes([op] if n else b"") + rng.randbytes(max(n - 1, 0))
        else:
            body = rng.randbytes(n).replace(bytes([RAW_CLOSE]), b"\x01")
            if op == CLOSE and flag and n:
                body = body[:n // 2] + bytes([RAW_CLOSE]) + body[n // 2 + 1:]
            stream += body
    # plaintext chunks: random cut points (several frames per write, frames across writes)
    cuts = sorted({rng.randrange(len(stream) + 1) for _ in range(sc["ncuts"])})
    pts = [0] + cuts + [len(stream)]
    chunks = [bytes(stream[a:b]) for a, b in zip(pts, pts[1:])]
    tcp = sc["tcp"]
    if tcp == "asis":
        tcp_cuts = [0]
    elif tcp == "tiny":
        tcp_cuts = [1, 2, 3, 4, 5, 7, 4096]
    elif tcp == "one":
        tcp_cuts = [1 << 30]
    else:
        tcp_cuts = [rng.randrange(1, 20000) for _ in range(5)]
    return chunks, tcp_cuts


def close_counts(srv):
    return dict(srv.stats()["closes"])


def run_one(srv, ctx, chunks, tcp_cuts, listeners, notify):
    """One scenario against one server: (what each peer decoded, how each stream ended,
    the server's count deltas)."""
    before = srv.stats()
    ls = [Peer(srv, ctx) for _ in range(listeners)]
    handler = srv_handler(srv)
    wait_for(lambda: handler.connected == listeners, 10, "listeners connected")
    d = Peer(srv, ctx)
    wait_for(lambda: handler.connected == listeners + 1, 10, "driver connected")
    d.send_stream(chunks, tcp_cuts)
    d.half_close(notify)
    driver = d.finish()
    # the driver is gone: every broadcast it caused is queued; the listeners' EOF flushes it
    wait_for(lambda: srv.stats()["connections"] == listeners, 10, "driver closed")
    for p in ls:
        p.half_close(notify)
    outs = [driver] + [p.finish() for p in ls]
    wait_for(lambda: srv.stats()["connections"] == 0, 10, "every session closed")
    wait_for(lambda: handler.connected == 0, 10, "every on_close ran")
    after = srv.stats()
    for k in ("rx_slots_in_use", "tx_slots_in_use", "rx_raw_slots_in_use",
              "rx_frame_buffers_in_use"):
        assert after[k] == IDLE[id(srv)][k], (k, after[k])     # back to idle
    deltas = {k: after[k] - before[k] for k in ("bytes_out", "connections_total")}
    WIRE_OUT[id(srv)] = after["tls_bytes_out"] - before["tls_bytes_out"]   # (diagnostics)
    closes = {k: v - before["closes"].get(k, 0) for k, v in after["closes"].items()
              if v != before["closes"].get(k, 0)}
    if set(closes) == {"eof"}:
        # (the input read after a close the server decided is dropped unread, and how much
        # of it was read first depends on the read boundaries, as the raw framing's frames)
        deltas["bytes_in"] = after["bytes_in"] - before["bytes_in"]
        if srv.settings.header_size:
            deltas["frames_in"] = after["frames_in"] - before["frames_in"]
    if srv.settings.header_size:        # (raw: one on_read per read, so not comparable)
        deltas["frames_out"] = after["frames_out"] - before["frames_out"]
    return outs, deltas, closes


def srv_handler(srv):
    return HANDLERS[id(srv)]


def describe(out):
    """A short account of one peer's output, for a failure message."""
    if len(out) == 2:
        return f"{len(out[0])} bytes, {out[1]}"
    frames, rest, end = out
    return f"{len(frames)} frames {[len(f) for f in frames][:30]}, {len(rest)} left, {end}"


def normalise(outs, hs):
    res = []
    for data, end in outs:
        if hs:
            frames, rest = split_frames(data, hs)
            res.append(([bytes(f) for f in frames], bytes(rest), end))
        else:
            res.append((data, end))
    return res


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("framing,max_frame", CONFIGS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_tls_matches_plain(servers, certs, backend, framing, max_frame, workers):
    plain, tls = servers(backend, framing, max_frame, workers)
    client_ctx = certs.client_ctx()
    hs = plain.settings.header_size

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(scenarios(framing, max_frame))
    def check(sc):
        chunks, tcp_cuts = build(sc, hs)
        listeners, notify = sc["listeners"], sc["notify"]
        fds = open_fds()
        p_outs, p_deltas, p_closes = run_one(plain, None, chunks, tcp_cuts, listeners, notify)
        t_outs, t_deltas, t_closes = run_one(tls, client_ctx, chunks, tcp_cuts, listeners,
                                             notify)
        assert open_fds() == fds, "file descriptors leaked"
        p = normalise(p_outs, hs)
        t = normalise(t_outs, hs)
        for i, (a, b) in enumerate(zip(p, t)):
            who = "driver" if i == 0 else f"listener {i}"
            assert a[:-1] == b[:-1], f"{who}: TLS delivered other bytes than plain: " \
                f"{describe(a)} vs {describe(b)}; the server sent {WIRE_OUT[id(tls)]} " \
                "bytes of ciphertext in all"
            assert a[-1] == "eof", f"{who}: plain ended with {a[-1]}"
            assert b[-1] == "eof", f"{who}: TLS ended with {b[-1]}; the server sent " \
                f"{WIRE_OUT[id(tls)]} bytes of ciphertext in all"
        assert p_deltas == t_deltas
        assert p_closes == t_closes

    check()
