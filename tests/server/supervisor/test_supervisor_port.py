"""--procs N: the supervisor's port reservation (supervisor.reserve_port).

It takes a port only if nothing else holds it -- a listening server, another supervisor's
reservation, another --procs group -- even when two supervisors race for it, and TIME_WAIT
connections of an earlier server do not stop it.
"""
import errno
import signal
import socket
import subprocess
import sys
import threading

import pytest

from aoprim.server.supervisor import reserve_port

from proc_support import NEUTRAL_CWD, child_env
from server_support import HOST, recv_exact, wait_for

TIME_WAIT = "06"        # the st column of /proc/net/tcp


def group_member(port):
    """A listening socket as a --procs child makes it (SO_REUSEADDR + SO_REUSEPORT)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind((HOST, port))
    s.listen()
    return s


def test_a_port_another_reservation_holds_is_refused():
    """The reservation had SO_REUSEPORT from the start, so a second one of the same user
    bound beside the first, and its children joined the first's group."""
    first = reserve_port(HOST, 0)
    try:
        port = first.getsockname()[1]
        with pytest.raises(OSError) as ei:
            reserve_port(HOST, port).close()
        assert ei.value.errno == errno.EADDRINUSE
        member = group_member(port)           # the first one's children still bind
        member.close()
    finally:
        first.close()


def test_a_port_a_procs_group_serves_is_refused():
    r = reserve_port(HOST, 0)
    port = r.getsockname()[1]
    r.close()
    member = group_member(port)               # another supervisor's child, listening
    try:
        with pytest.raises(OSError) as ei:
            reserve_port(HOST, port).close()
        assert ei.value.errno == errno.EADDRINUSE
    finally:
        member.close()


@pytest.mark.timeout(120)
def test_two_supervisors_racing_for_one_port_never_both_get_it():
    """Two reservations made at the same instant: at most one holds the port (checking
    first and binding with SO_REUSEPORT afterwards would let both through)."""
    rounds, won = 200, 0
    for _ in range(rounds):
        r = reserve_port(HOST, 0)
        port = r.getsockname()[1]
        r.close()
        start = threading.Barrier(2)
        got = []

        def take():
            start.wait(10)
            try:
                got.append(reserve_port(HOST, port))
            except OSError as e:
                assert e.errno == errno.EADDRINUSE
        threads = [threading.Thread(target=take) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
            assert not t.is_alive()
        for s in got:
            s.close()
        assert len(got) <= 1, f"both reservations of port {port} succeeded"
        won += len(got)
    assert won >= rounds // 2          # the check refuses a race, not every reservation


def _serve(*args, cwd=NEUTRAL_CWD):
    p = subprocess.Popen([sys.executable, "-m", "aoprim", "serve", "--host", HOST, *args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                         env=child_env())
    line = p.stdout.readline()
    if not line.startswith("listening on "):
        p.kill()
        out, err = p.communicate(timeout=30)
        raise AssertionError(f"did not start: {line!r} {err}")
    return p, int(line.rsplit(":", 1)[1])


def _stop(p):
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    return err


@pytest.mark.timeout(180)
def test_a_second_procs_server_on_a_busy_port_is_refused():
    first, port = _serve("--port", "0", "--procs", "2")
    try:
        r = subprocess.run([sys.executable, "-m", "aoprim", "serve", "--host", HOST, "--port",
                            str(port), "--procs", "2"], capture_output=True, text=True,
                           timeout=60, cwd=NEUTRAL_CWD, env=child_env())
        assert r.returncode == 2, r.stderr
        assert r.stderr.splitlines()[-1] == (
            f"aoprim: cannot listen on {HOST}:{port}: address already in use: another server "
            "-- perhaps another aoprim -- is listening there; stop it or choose another port")
        assert "listening on" not in r.stdout and "started server process" not in r.stderr
        assert "Traceback" not in r.stderr
        # every connection still reaches the first server
        for i in range(20):
            with socket.create_connection((HOST, port), timeout=30) as s:
                s.sendall(b"n%d" % i)
                assert recv_exact(s, len(b"n%d" % i), timeout=30) == b"n%d" % i
    finally:
        if first.poll() is None:
            _stop(first)


CLOSER = """
from aoprim.server import Handler

class Closer(Handler):
    # answers, then closes first: the server's side of the connection ends in TIME_WAIT
    def on_read(self, session, data):
        session.send(data)
        session.close()
"""


def _time_wait_on(port):
    n = 0
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == TIME_WAIT:
                n += 1
    return n


@pytest.mark.timeout(180)
def test_procs_starts_at_once_after_a_procs_1_server_closed_connections(tmp_path):
    """Scaling from 1 process to N on the same port failed for ~60 s: the reservation was
    bound without SO_REUSEADDR and tripped over the first server's TIME_WAIT."""
    (tmp_path / "closer.py").write_text(CLOSER)
    one, port = _serve("--port", "0", "closer:Closer", cwd=str(tmp_path))
    try:
        for i in range(5):
            with socket.create_connection((HOST, port), timeout=30) as s:
                s.sendall(b"x")
                assert recv_exact(s, 1, timeout=30) == b"x"
                assert s.recv(1) == b""       # the server closed first
        wait_for(lambda: _time_wait_on(port) >= 1, timeout=30,
                 what="TIME_WAIT on the server's side")
    finally:
        _stop(one)
    assert _time_wait_on(port) >= 1
    many, port2 = _serve("--port", str(port), "--procs", "2", "--app", "echo")
    try:
        assert port2 == port
        with socket.create_connection((HOST, port), timeout=30) as s:
            s.sendall(b"scaled")
            assert recv_exact(s, 6, timeout=30) == b"scaled"
    finally:
        _stop(many)
