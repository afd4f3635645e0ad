"""Hostile clients, run in their own process so that they load the server and not the test
process's GIL (no tests in here).

    python hostile_clients.py slowloris PORT N SECONDS
    python hostile_clients.py flood PORT KIND SECONDS MAX_COUNT SEED
    python hostile_clients.py bigpartial PORT N HOLD_SECONDS
    python hostile_clients.py cycles PORT COUNT

Each prints one JSON line with what it did and saw; the test asserts on it.  Every loop is
bounded by a count and by a time.

- ``slowloris``: keeps N connections open for SECONDS, re-opening those the server cuts;
  two in three trickle one byte of a never-ending u16 frame every 0.1 s, one in three stays
  silent.  Then it stops re-opening and waits (bounded) until the server has cut every one.
  Reports how many were opened and cut and the longest life of any connection.
- ``flood``: connect-act-close as fast as it can: ``oversize`` (a u16 header above
  max_frame), ``garbage`` (random bytes, then close or reset), ``reset`` (RST right after
  connect, SO_LINGER 0), ``reset_partial`` (half a frame, then RST).
- ``bigpartial``: N connections each send all but the last byte of a 65535-byte frame.
- ``cycles``: COUNT times connect, send one u16 frame, read its echo, close.
"""
import json
import random
import selectors
import socket
import struct
import sys
import time

HOST = "127.0.0.1"
LINGER0 = struct.pack("ii", 1, 0)


def _connect(port, timeout=5.0):
    s = socket.create_connection((HOST, port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _reset(s):
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER0)
    except OSError:
        pass
    s.close()


# -- slowloris ------------------------------------------------------------------------------

def slowloris(port, n, seconds):
    sel = selectors.DefaultSelector()
    conns = {}                  # socket -> (kind, t_open, bytes trickled)
    opened = cut = connect_errors = 0
    max_life = 0.0
    t_end = time.monotonic() + seconds
    tick = 0.1
    next_tick = time.monotonic()

    def open_one(i):
        nonlocal opened, connect_errors
        try:
            s = _connect(port)
        except OSError:
            connect_errors += 1
            return
        s.setblocking(False)
        kind = "silent" if i % 3 == 2 else "trickle"
        conns[s] = [kind, time.monotonic(), 0]
        sel.register(s, selectors.EVENT_READ)
        opened += 1

    def drop(s):
        nonlocal cut, max_life
        kind, t0, _ = conns.pop(s)
        sel.unregister(s)
        s.close()
        cut += 1
        max_life = max(max_life, time.monotonic() - t0)

    for i in range(n):
        open_one(i)
    frame_hdr = struct.pack(">H", 60000)    # a frame that never completes
    i = n
    hard_end = t_end + 30.0                 # bounded even if the server never cuts
    while conns or time.monotonic() < t_end:
        now = time.monotonic()
        if now > hard_end:
            break
        for key, _ in sel.select(max(0.0, min(tick, next_tick - now))):
            s = key.fileobj
            try:
                data = s.recv(4096)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if not data:
                drop(s)
        now = time.monotonic()
        if now >= next_tick:
            next_tick = now + tick
            for s, st in list(conns.items()):
                if st[0] != "trickle":
                    continue
                k = st[2]
                byte = frame_hdr[k:k + 1] if k < 2 else b"x"
                try:
                    s.send(byte)
                    st[2] += 1
                except BlockingIOError:
                    pass
                except OSError:
                    drop(s)
            if now < t_end:                 # keep N connections while the attack lasts
                while len(conns) < n:
                    open_one(i)
                    i += 1
    left = len(conns)
    for s in list(conns):
        sel.unregister(s)
        s.close()
    return {"opened": opened, "cut": cut, "left_open": left, "max_life": round(max_life, 3),
            "connect_errors": connect_errors}


# -- floods ---------------------------------------------------------------------------------

def flood(port, kind, seconds, max_count, seed):
    rnd = random.Random(seed)
    t_end = time.monotonic() + seconds
    done = errors = 0
    sent = 0
    while done < max_count and time.monotonic() < t_end:
        try:
            s = _connect(port)
        except OSError:
            errors += 1
            time.sleep(0.01)
            continue
        try:
            if kind == "oversize":
                s.sendall(struct.pack(">H", 0xFFFF) + b"o" * rnd.randrange(0, 64))
                s.settimeout(2.0)
                try:
                    while s.recv(4096):     # the server closes it
                        pass
                except OSError:
                    pass
                s.close()
            elif kind == "garbage":
                blob = rnd.randbytes(rnd.randrange(1, 20000))
                s.sendall(blob)
                sent += len(blob)
                if rnd.random() < 0.5:
                    _reset(s)
                else:
                    s.close()
            elif kind == "reset":
                _reset(s)
            elif kind == "reset_partial":
                s.sendall(struct.pack(">H", 3000) + b"p" * rnd.randrange(1, 2999))
                _reset(s)
            else:
                raise SystemExit(f"unknown flood kind {kind!r}")
        except OSError:
            errors += 1
            s.close()
        done += 1
    return {"kind": kind, "done": done, "errors": errors, "garbage_bytes": sent}


# -- big partial frames ----------------------------------------------------------------------

def bigpartial(port, n, hold):
    """N connections each announce a 65535-byte u16 frame and send all of it but the last
    byte; print "sent" once all of it is written; then wait (bounded by ``hold`` seconds)
    for the server to cut them."""
    sel = selectors.DefaultSelector()
    born = {}
    body = struct.pack(">H", 65535) + b"b" * 65534
    for _ in range(n):
        s = _connect(port)
        s.sendall(body)
        s.setblocking(False)
        born[s] = time.monotonic()
        sel.register(s, selectors.EVENT_READ)
    print("sent", flush=True)
    cut = 0
    max_life = 0.0
    t_end = time.monotonic() + hold
    while born and time.monotonic() < t_end:
        for key, _ in sel.select(0.1):
            s = key.fileobj
            try:
                if s.recv(4096):
                    continue
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                pass
            max_life = max(max_life, time.monotonic() - born.pop(s))
            sel.unregister(s)
            s.close()
            cut += 1
    for s in born:
        s.close()
    return {"cut": cut, "left_open": len(born), "max_life": round(max_life, 3)}


# -- connect/send/close cycles ---------------------------------------------------------------

def cycles(port, count, seconds=600.0):
    t0 = time.monotonic()
    done = failures = 0
    t_end = t0 + seconds
    while done < count and time.monotonic() < t_end:
        payload = b"c%d" % done
        try:
            with _connect(port) as s:
                s.sendall(struct.pack(">H", len(payload)) + payload)
                want = 2 + len(payload)
                buf = b""
                while len(buf) < want:
                    chunk = s.recv(want - len(buf))
                    if not chunk:
                        break
                    buf += chunk
                if buf[2:] != payload:
                    failures += 1
        except OSError:
            failures += 1
        done += 1
    return {"done": done, "failures": failures, "seconds": round(time.monotonic() - t0, 3)}


def main(argv):
    mode, port = argv[0], int(argv[1])
    if mode == "slowloris":
        r = slowloris(port, int(argv[2]), float(argv[3]))
    elif mode == "flood":
        r = flood(port, argv[2], float(argv[3]), int(argv[4]), int(argv[5]))
    elif mode == "bigpartial":
        r = bigpartial(port, int(argv[2]), float(argv[3]))
    elif mode == "cycles":
        r = cycles(port, int(argv[2]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
