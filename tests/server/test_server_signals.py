"""``serve_forever()`` on the main thread and its SIGINT/SIGTERM handler (docs/server.md):
the first signal asks for the graceful shutdown; a second SIGINT while a handler holds the
loop (a blocking call that does not return) raises ``KeyboardInterrupt`` out of that code,
as ``asyncio.run()`` does; a second SIGINT while the shutdown is under way (the loop going
round), and any SIGTERM, is only logged.  Each server runs in a process of its own (the
signals go to it), which the test ends whatever happens."""
import os
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from aoprim.server.loop import BACKENDS
from aoprim.server.server import SAME_CTRL_C

from server_support import wait_for

pytestmark = pytest.mark.timeout(60)

# on_read blocks reading the process's stdin: it returns when the test writes a byte there
SERVER = textwrap.dedent("""
    import logging, os, signal, sys, threading, traceback
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s",
                        stream=sys.stdout)
    from aoprim.server import Handler, Server

    backend, workers = sys.argv[1], int(sys.argv[2])

    class Stuck(Handler):
        def on_read(self, session, data):
            if bytes(data) == b"r":
                # one Ctrl-C as a wrapper relays it: the terminal's SIGINT, then the
                # wrapper's copy milliseconds later -- each taken by the handler (the
                # loops between run it) while this call holds the loop
                for _ in range(2):
                    os.kill(os.getpid(), signal.SIGINT)
                    for _ in range(10000):
                        pass
                print("relayed", flush=True)
                session.send(data)
                return
            print("in on_read", flush=True)
            os.read(0, 1)
            session.send(data)

    srv = Server(Stuck(), "127.0.0.1", 0, backend=backend, workers=workers,
                 shutdown_timeout=30)
    print("port", srv.address[1], flush=True)
    try:
        srv.serve_forever()
        print("serve_forever returned", flush=True)
    except KeyboardInterrupt as e:
        names = [f.name for f in traceback.extract_tb(e.__traceback__)]
        print("KeyboardInterrupt", "through on_read" if "on_read" in names else names,
              flush=True)
    print("SIGINT handler put back:",
          signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)
    srv.shutdown(timeout=5)
    left = [t.name for t in threading.enumerate() if t.name.startswith("aoprim")]
    print("threads left:", left, "rx slots:", srv.stats()["rx_slots_in_use"], flush=True)
""")


class Child:
    """The server process; its output (prints and log lines, one stream) read line by
    line by a thread, so that each wait is bounded."""

    def __init__(self, backend, workers):
        self.p = subprocess.Popen([sys.executable, "-c", SERVER, backend, str(workers)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        self.lines = queue.Queue()
        self.seen = []
        threading.Thread(target=self._read, daemon=True).start()
        self.port = int(self.expect("port ").split()[1])

    def _read(self):
        for line in self.p.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def expect(self, start, timeout=15.0):
        """The next line that starts with ``start`` (AssertionError, with every line seen,
        if the process ends or says nothing of the kind within ``timeout``)."""
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                line = None
            if line is None:
                raise AssertionError(f"no line starting {start!r}; seen: {self.seen}")
            self.seen.append(line)
            if line.startswith(start):
                return line

    def signal(self, sig):
        self.p.send_signal(sig)
        self.signalled = time.monotonic()

    def after_the_same_ctrl_c(self):
        """A person's second Ctrl-C: later than a wrapper's relayed copy of the first
        (SAME_CTRL_C), which counts as the same one."""
        while time.monotonic() - self.signalled < 2 * SAME_CTRL_C:
            time.sleep(0.01)

    def _wchan(self):
        try:
            with open(f"/proc/{self.p.pid}/wchan") as f:
                return f.read()
        except OSError:
            return ""

    def back_in_read(self):
        """Wait until the main thread (the only one: workers=0) is blocked in its read of
        stdin again.  A signal that reaches the process while its Python handler for the
        previous one still runs is taken only at the next check -- and the read that
        handler interrupted is retried, in the kernel, first: a second signal sent then
        waits for a third.  A person's second Ctrl-C comes long after; the test's must
        too."""
        wait_for(lambda: "pipe_read" in self._wchan(), 15, "on_read back in its read")

    def release(self):
        self.p.stdin.write("x")
        self.p.stdin.flush()

    def end(self):
        self.p.kill()
        self.p.wait()
        self.p.stdin.close()
        self.p.stdout.close()


@pytest.fixture
def child():
    made = []

    def make(backend, workers):
        made.append(Child(backend, workers))
        return made[-1]
    yield make
    for c in made:
        c.end()


def _stick(c):
    """A client's byte puts on_read in its blocking call."""
    s = socket.create_connection(("127.0.0.1", c.port), timeout=10)
    s.sendall(b"x")
    c.expect("in on_read")
    return s


def _stick_main_thread(c):
    s = _stick(c)
    try:
        c.back_in_read()
    except AssertionError:
        s.close()
        if c._wchan().strip() in ("", "0"):
            pytest.skip("the kernel does not say where a task waits (/proc/PID/wchan)")
        raise
    return s


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_second_ctrl_c_interrupts_a_handler_that_holds_the_loop(child, backend):
    c = child(backend, 0)
    s = _stick_main_thread(c)
    c.signal(signal.SIGINT)
    c.expect("INFO received SIGINT: shutting down")
    c.back_in_read()
    c.after_the_same_ctrl_c()
    c.signal(signal.SIGINT)
    assert c.expect("KeyboardInterrupt") == "KeyboardInterrupt through on_read"
    assert any(line.startswith("WARNING received SIGINT again while the loop is held")
               for line in c.seen), c.seen
    assert c.expect("SIGINT handler put back:").endswith("True")
    assert c.expect("threads left:") == "threads left: [] rx slots: 0"
    assert c.p.wait(timeout=15) == 0
    assert not [line for line in c.seen if "crashed" in line or "Traceback" in line], c.seen
    s.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_ctrl_c_relayed_by_a_wrapper_is_one_graceful_shutdown(child, backend):
    """Under `timeout` (or a script that forwards it) one Ctrl-C reaches the server twice,
    milliseconds apart: one request for the graceful shutdown, not Ctrl-C twice -- even
    while a handler holds the loop."""
    c = child(backend, 0)
    with socket.create_connection(("127.0.0.1", c.port), timeout=10) as s:
        s.sendall(b"r")
        c.expect("relayed")
        c.expect("serve_forever returned")
    assert c.expect("threads left:") == "threads left: [] rx slots: 0"
    assert c.p.wait(timeout=15) == 0
    assert [line for line in c.seen if "received SIGINT" in line] == \
        ["INFO received SIGINT: shutting down"], c.seen
    assert not [line for line in c.seen if "KeyboardInterrupt" in line], c.seen


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_second_ctrl_c_during_a_shutdown_under_way_is_only_logged(child, backend):
    """The loop goes round (a worker holds the handler, not the loop): the second SIGINT
    does not interrupt the graceful shutdown, which ends once the handler returns."""
    c = child(backend, 1)
    s = _stick(c)
    c.signal(signal.SIGINT)
    c.expect("INFO aoprim server shutting down (1 sessions)")   # (the loop took it)
    c.after_the_same_ctrl_c()
    c.signal(signal.SIGINT)
    c.expect("INFO received SIGINT: the shutdown is under way")
    c.release()
    c.expect("serve_forever returned")
    assert c.expect("threads left:") == "threads left: [] rx slots: 0"
    assert c.p.wait(timeout=15) == 0
    assert not [line for line in c.seen if "KeyboardInterrupt" in line], c.seen
    s.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_second_sigterm_never_interrupts(child, backend):
    """A service manager may send SIGTERM twice: the held loop is left to its handler."""
    c = child(backend, 0)
    s = _stick_main_thread(c)
    c.signal(signal.SIGTERM)
    c.expect("INFO received SIGTERM: shutting down")
    c.back_in_read()
    c.signal(signal.SIGTERM)
    c.expect("INFO received SIGTERM: the shutdown is under way")
    c.release()
    c.expect("serve_forever returned")
    assert c.expect("threads left:") == "threads left: [] rx slots: 0"
    assert c.p.wait(timeout=15) == 0
    s.close()
