"""``--procs N``: N server processes on one port, and the process that supervises them.

The kernel spreads the connections over the children (``SO_REUSEPORT``).  The supervisor
imports no server code: a child is any command that reports to it on a pipe of its own (see
"The status pipe") and exits.

Rules
-----
- The port is reserved for the supervisor's whole life (:func:`reserve_port`): one socket,
  never listening, so it receives no connection.  It takes the port only if nothing else
  holds it -- no listening socket, no other reservation, ``SO_REUSEPORT`` or not -- and
  TIME_WAIT connections of an earlier server do not stop it.  Once bound it holds the port
  with ``SO_REUSEPORT`` (and without ``SO_REUSEADDR``): children bind beside it, a child
  restarted after every child died gets the same port, and no other program can take the
  port meanwhile (a socket with ``SO_REUSEADDR`` only -- asyncio's default -- is refused).
  Two supervisors never share a port, even when they start at the same instant.  What the
  kernel still allows: a program of the same user that sets ``SO_REUSEPORT`` itself joins
  the group (Linux's rule; docs/server.md).
- ``listening on HOST:PORT`` (``[HOST]:PORT`` for IPv6) is printed once, when every child has said it listens.  A child
  that exits before that, or a start that takes longer than ``start_timeout``, stops the
  others; the supervisor then exits non-zero (2 if that child exited 2) and never prints it.
- What happens when a child exits is decided by what it said on its status pipe, never by
  its exit status alone (which a handler can choose: ``sys.exit(2)``, ``os._exit(0)``):
    - it exited 2 before saying ``ready``: a usage or configuration error, which a restart
      would only repeat: stop every child, exit 2;
    - it said ``stopped`` and exited 0, or died of SIGTERM/SIGINT, without the supervisor
      having asked (an operator's ``kill``, an OOM daemon): it is replaced -- the service
      keeps its N processes -- and that is not counted as a crash;
    - anything else is a crash: restart it after a back-off that doubles from ``backoff``
      up to ``backoff_max``; a child that lived ``stable_after`` seconds starts the back-off
      again.  Only crashes before ``ready`` (bad settings, a start-up that fails) count
      toward giving up: a place whose child crashed before ``ready`` more than
      ``give_up_after`` times in a row stops every child and the supervisor exits 1.  A
      crash while serving (a handler's ``os._exit``, a request that kills the process) is
      restarted for as long as the supervisor runs: no request can end the service.
- SIGINT/SIGTERM are forwarded (once) to every child; the supervisor waits up to
  ``stop_timeout`` seconds, kills what is left, and exits 0 if every child exited 0, else 1.
  A second signal kills the children at once.
- Children die with the supervisor, even if it is killed with SIGKILL: each child asks the
  kernel for SIGTERM when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``, set between fork
  and exec), then checks that its parent is still the supervisor, which closes the race of a
  supervisor that died before the request was made.  The death signal follows the *thread*
  that forked the child, so the supervisor runs in one thread: the caller's.
- Children run in their own process group: a Ctrl-C at the terminal reaches the supervisor
  only, which forwards it once.  Their stdout is read by the supervisor and passed on line by
  line (a line longer than 64 KiB in pieces of that size: the supervisor's memory stays
  bounded); their stderr is the supervisor's.  When the supervisor's stdout is gone (closed, or a
  pipe whose reader exited: ``| head -1``) the lines are dropped -- logged once -- and
  everything else goes on: serving, restarts, the exit status.

The status pipe
---------------
``child_argv(port, status_fd)`` gives each child the number of an inherited pipe's write end.
The child writes ``ready\n`` once it accepts connections (its settings were accepted, no
handler code has run yet), and ``stopped\n`` when it was told to stop (SIGINT/SIGTERM) and
has shut down cleanly, just before it exits 0.  Nothing else is read from it.  ``stopped``
matters only when the supervisor asked for the stop: said on its own, the child is replaced.
"""
from __future__ import annotations

import codecs
import ctypes
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from types import FrameType
from typing import IO, Any, Callable, Sequence

__all__ = ["Supervisor", "reserve_port"]

log = logging.getLogger("aoprim.server")

_PR_SET_PDEATHSIG = 1
_READY = b"ready"           # the child's status messages (see "The status pipe")
_STOPPED = b"stopped"
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_MAX_LINE = 65536           # a longer stdout line is passed on in pieces of this size


def _find_prctl() -> Any:
    """libc's prctl() as a ctypes function, or None where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                   ctypes.c_ulong]
    fn.restype = ctypes.c_int
    return fn


def reserve_port(host: str | None, port: int) -> socket.socket:
    """A socket bound to (host, port) that holds the port (port 0: the kernel picks one)
    without taking any connection, for children that bind with ``SO_REUSEPORT``.  Returns
    the socket; ``OSError`` (``EADDRINUSE``) if anything else holds the port.

    Bound with ``SO_REUSEADDR``, so TIME_WAIT connections of an earlier server on the port do
    not stop it; then a second socket, also with ``SO_REUSEADDR``, listens on the port for an
    instant: Linux refuses that ``listen()`` while any other socket listens there or holds it
    without ``SO_REUSEADDR`` -- another server, or another supervisor's reservation -- and
    it is one atomic check in the kernel.  Then, while the probe still listens, the
    reservation drops ``SO_REUSEADDR`` (a socket with ``SO_REUSEADDR`` only could otherwise
    listen beside it) and takes ``SO_REUSEPORT`` (its children may bind beside it); the
    probe is closed last.  Of two supervisors racing for one port at most one gets it: each
    one's ``listen()`` happens while its own reservation still has ``SO_REUSEADDR``, so the
    first to listen has its way, and the other meets that probe listening or, once it is
    closed, the first reservation without ``SO_REUSEADDR``."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                               flags=socket.AI_PASSIVE)[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(s.getsockname())
            probe.listen(1)
            # still listening: until the reservation has dropped SO_REUSEADDR, the probe is
            # what refuses another supervisor's probe
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    except BaseException:
        s.close()
        raise
    return s


class _Child:
    """One of the N places: the process filling it now, and its history."""
    __slots__ = ("index", "proc", "buf", "status", "said", "started", "ready", "listened",
                 "crashes", "early", "respawn_at", "dec")

    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: subprocess.Popen[bytes] | None = None    # the running process, or None
        self.buf = b""            # the start of a stdout line not yet complete
        self.status: int | None = None  # the read end of its status pipe, while open
        self.said = b""           # what the current process wrote on its status pipe
        self.started = 0.0        # time.monotonic() at spawn
        self.ready = False        # the current process said "ready"
        self.listened = False     # some process in this place did
        self.crashes = 0          # exits in a row, each soon after its start (the back-off)
        self.early = 0            # exits in a row before "ready" (the crash-loop count)
        self.respawn_at: float | None = None    # monotonic time of the pending restart
        self.dec: Any = None      # its stdout's UTF-8 decoder (a character may span reads)


class Supervisor:
    """Run ``procs`` children of ``child_argv(port, status_fd)`` on one reserved port; see the
    module docstring for the rules.  ``run()`` blocks (in the main thread) and returns the exit
    status for the command line."""

    def __init__(self, child_argv: Callable[[int, int], Sequence[str]], procs: int,
                 host: str | None = "127.0.0.1", port: int = 0, *,
                 stdout: IO[str] | None = None, start_timeout: float = 30.0,
                 stop_timeout: float = 15.0, backoff: float = 0.5, backoff_max: float = 30.0,
                 give_up_after: int = 5, stable_after: float = 10.0) -> None:
        if not isinstance(procs, int) or procs < 1:
            raise ValueError("procs must be an int >= 1")
        self._child_argv = child_argv
        self._procs = procs
        self._host = host
        self._port = port
        self._out: IO[str] | None = stdout if stdout is not None else sys.stdout
        self._start_timeout = float(start_timeout)
        self._stop_timeout = float(stop_timeout)
        self._backoff = float(backoff)
        self._backoff_max = float(backoff_max)
        self._give_up_after = int(give_up_after)
        self._stable_after = float(stable_after)
        self._prctl = _find_prctl()       # looked up here: the child only calls it
        self._children = [_Child(i) for i in range(procs)]
        self._sel: selectors.BaseSelector = None    # type: ignore[assignment]  # (run() makes it)
        self._signals: list[int] = []     # stop signals received, not yet handled
        self._announced = False           # "listening on" was printed
        self._out_lost = False            # stdout failed (or is None): output is dropped
        self.address: tuple[str, int] | None = None     # (host, port) once reserved
        self.spawned: list[tuple[float, int, int]] = []  # (monotonic time, index, pid)

    # -- the child's side of fork (runs between fork and exec: no locks, no logging) -----

    def _preexec(self, parent: int) -> Callable[[], None]:
        prctl = self._prctl

        def setup() -> None:
            os.setpgid(0, 0)
            if prctl is not None:
                if prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
                    e = ctypes.get_errno()
                    raise OSError(e, "prctl(PR_SET_PDEATHSIG): " + os.strerror(e))
                if os.getppid() != parent:    # the supervisor died before prctl: no signal
                    os._exit(1)               # will come, so do not start at all
        return setup

    # -- the parent's side ----------------------------------------------------------------

    def _spawn(self, c: _Child) -> None:
        port = self.address[1]
        status_r, status_w = os.pipe()
        try:
            c.proc = subprocess.Popen(self._child_argv(port, status_w), stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, pass_fds=(status_w,),
                                      preexec_fn=self._preexec(os.getpid()))
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)          # the child's now: EOF once it (and its heirs) exit
        os.set_blocking(status_r, False)
        os.set_blocking(c.proc.stdout.fileno(), False)
        self._sel.register(c.proc.stdout.fileno(), selectors.EVENT_READ, c)
        self._sel.register(status_r, selectors.EVENT_READ, (c, status_r))
        c.status = status_r
        c.said = b""
        c.buf = b""
        c.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        c.started = time.monotonic()
        c.ready = False
        c.respawn_at = None
        self.spawned.append((c.started, c.index, c.proc.pid))
        log.debug("started server process %d (place %d)", c.proc.pid, c.index)

    def _start(self, c: _Child) -> bool:
        try:
            self._spawn(c)
        except (OSError, subprocess.SubprocessError) as e:
            log.error("cannot start %s: %s", self._child_argv(self.address[1], -1)[:4], e)
            c.proc = None
            c.respawn_at = None
            return False
        return True

    def _read_status(self, c: _Child, fd: int, final: bool = False) -> None:
        """Take what child ``c`` wrote on its status pipe (``ready`` marks it ready).
        ``final``: it has exited; take what is left and close the pipe (what it wrote before
        it exited is in the pipe already: no waiting)."""
        if c.status != fd:                 # closed already
            return
        while True:
            try:
                chunk = os.read(fd, 512)
            except BlockingIOError:
                chunk = None
            if chunk:
                c.said += chunk
                if len(c.said) > 4096:     # only two short words are expected
                    c.said = c.said[-4096:]
                continue
            if chunk == b"" or final:
                self._sel.unregister(fd)
                os.close(fd)
                c.status = None
            break
        words = c.said.split(b"\n")[:-1]
        if _READY in words and not c.ready:
            c.ready = c.listened = True
            c.early = 0
            if self._announced:
                log.info("server process %d (restarted) is listening", c.proc.pid)

    def _read(self, c: _Child, final: bool = False) -> None:
        """Pass on what child ``c`` printed.  ``final``: it has exited; read to the end of its
        output, for a bounded time, and what it said on its status pipe."""
        if final and c.status is not None:
            self._read_status(c, c.status, final=True)
        if c.proc.stdout.closed:           # its end of output was read already
            return
        fd = c.proc.stdout.fileno()
        deadline = time.monotonic() + 2.0
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                if not final:
                    return
                if time.monotonic() < deadline:
                    _wait_readable(fd, deadline - time.monotonic())
                    continue
                chunk = b""              # something it started holds the pipe: let go
            if not chunk:
                self._sel.unregister(fd)
                c.proc.stdout.close()
                if c.buf:
                    self._line(c, c.buf + b"\n")
                    c.buf = b""
                self._line(c, b"", final=True)
                return
            *lines, c.buf = (c.buf + chunk).split(b"\n")
            for line in lines:
                self._line(c, line + b"\n")
            if len(c.buf) >= _MAX_LINE:
                # a line without end (progress output, a binary dump): kept whole, it would
                # grow without bound and be joined again on every read; passed on now, it
                # costs at most _MAX_LINE + one read, and each byte is copied a bounded
                # number of times
                self._line(c, c.buf)
                c.buf = b""

    def _line(self, c: _Child, line: bytes, final: bool = False) -> None:
        text = c.dec.decode(line, final) if c.dec is not None else line.decode(errors="replace")
        if text:
            self._write(text)

    def _write(self, text: str) -> None:
        """Write to the supervisor's stdout; once that is gone, drop the text (logged once):
        a reader that went away must not stop the servers."""
        if self._out_lost:
            return
        out = self._out
        if out is None:                        # sys.stdout is None: fd 1 was closed
            why = "no stdout"
        else:
            try:
                out.write(text)
                out.flush()
                return
            except (OSError, ValueError) as e:     # EPIPE, EBADF; ValueError: closed file
                why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        self._out_lost = True
        log.warning("stdout is unusable (%s): the server processes' output is dropped "
                    "from now on; serving goes on", why)
        if out is not None and out is sys.stdout:
            # the interpreter's own flush at exit would fail again, with a traceback-like
            # "Exception ignored" on stderr: what is left in its buffer goes to /dev/null
            try:
                fd = out.fileno()
                devnull = os.open(os.devnull, os.O_WRONLY)
                try:
                    os.dup2(devnull, fd)
                finally:
                    os.close(devnull)
            except (OSError, ValueError):
                pass

    def _stop_all(self, sig: int = signal.SIGTERM) -> bool:
        """Signal every live child, wait for them (bounded by stop_timeout, or not at all for
        SIGKILL), kill the rest.  Returns True if every child that was running exited 0.

        A child still starting (it has not said "listening on") may not have its handlers
        yet: it gets SIGTERM, whose default action ends it, and ending so counts as a clean
        stop (SIGINT there would be a KeyboardInterrupt anywhere in its start-up)."""
        live = [c for c in self._children if c.proc is not None]
        was_ready = {c: c.ready for c in live}
        for c in live:
            _signal(c.proc, sig if c.ready or sig == signal.SIGKILL else signal.SIGTERM)
        for c in self._children:
            c.respawn_at = None
        deadline = time.monotonic() + (0.0 if sig == signal.SIGKILL else self._stop_timeout)
        ok = True
        while live:
            self._poll(max(0.0, min(0.2, deadline - time.monotonic())))
            if self._signals:                  # a second signal: no more waiting
                self._signals.clear()
                deadline = 0.0
            still = []
            for c in live:
                rc = c.proc.poll()
                if rc is None:
                    still.append(c)
                    continue
                self._read(c, final=True)
                ok = ok and (rc == 0 or (rc == -signal.SIGTERM and not was_ready[c]))
                c.proc = None
            live = still
            if live and time.monotonic() >= deadline:
                for c in live:
                    log.error("server process %d did not stop: killing it", c.proc.pid)
                    _signal(c.proc, signal.SIGKILL)
                deadline = float("inf")
                ok = False
        return ok

    def _poll(self, timeout: float | None) -> None:
        for key, _ in self._sel.select(timeout):
            if key.data is None:               # the signal wake-up pipe
                try:
                    while os.read(key.fd, 512):
                        pass
                except BlockingIOError:
                    pass
            elif type(key.data) is tuple:      # a status pipe: (child, fd)
                self._read_status(key.data[0], key.data[1])
            else:
                self._read(key.data)

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        """The supervisor's signal handler: a stop signal is noted, to be handled by
        ``run()``.  A caller may install it before ``run()`` (which keeps what was noted),
        so that no stop signal falls between its own handler and the supervisor's."""
        if signum != signal.SIGCHLD:
            self._signals.append(signum)

    def _fail(self, message: str, status: int) -> int:
        print(f"aoprim: {message}", file=sys.stderr, flush=True)
        self._stop_all()
        return status

    def _reaped(self, c: _Child, rc: int, now: float) -> int | None:
        """Child ``c`` exited with ``rc``.  Returns an exit status for the supervisor, or None
        to keep going.  What it said on its status pipe decides, not ``rc`` alone: a handler
        can exit with any status, but it runs only after ``ready``."""
        pid = c.proc.pid
        self._read(c, final=True)          # it may have said "ready" just before
        c.proc = None
        words = c.said.split(b"\n")[:-1]
        if rc == 2 and not c.ready:
            return self._fail(f"server process {pid} ({c.index + 1} of {self._procs}) exited "
                              "with status 2 (a usage or configuration error) before it "
                              "listened: stopping", 2)
        if not self._announced and not c.listened:
            return self._fail(f"server process {pid} ({c.index + 1} of {self._procs}) exited "
                              f"with {_how(rc)} before it listened: stopping", 1)
        if now - c.started >= self._stable_after:
            c.crashes = 0                  # it served a while: the back-off starts again
        c.crashes += 1
        delay = min(self._backoff * 2 ** (c.crashes - 1), self._backoff_max)
        if (rc == 0 and _STOPPED in words) or rc in (-signal.SIGTERM, -signal.SIGINT):
            # stopped by someone else (an operator's kill, an OOM daemon's SIGTERM): the
            # supervisor did not ask (its own stops are reaped by _stop_all), so the place
            # is filled again -- not a crash: never a reason to give up
            log.warning("server process %d stopped (%s) without the supervisor asking: "
                        "replacing it in %.2g s", pid, _how(rc), delay)
            c.respawn_at = now + delay
            return None
        how = _how(rc)
        if not c.ready:
            # a crash before "ready": its settings or its start-up, which a restart repeats
            c.early += 1
            if c.early > self._give_up_after:
                return self._fail(f"server process {pid} exited with {how} before it "
                                  f"listened; {c.early} crashes in a row, each before it "
                                  "listened: giving up", 1)
        else:
            # a crash while serving (a handler's bad request, os._exit, a signal): restarted
            # after the back-off for as long as the supervisor runs; requests must never be
            # able to end the service
            if rc in (0, 2):               # a status a handler chose (sys.exit, os._exit)
                how += " while serving, not told to stop (a crash)"
        log.error("server process %d exited with %s: restarting it in %.2g s", pid, how,
                  delay)
        c.respawn_at = now + delay
        return None

    def run(self) -> int:
        self._sel = selectors.DefaultSelector()
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        self._sel.register(wake_r, selectors.EVENT_READ, None)
        old = {s: signal.signal(s, self.on_signal) for s in _STOP_SIGNALS + (signal.SIGCHLD,)}
        old_wake = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        reserve = None
        try:
            reserve = reserve_port(self._host, self._port)
            self.address = reserve.getsockname()[:2]
            return self._supervise()
        finally:
            for c in self._children:
                if c.proc is not None:          # only after an error of our own
                    _signal(c.proc, signal.SIGKILL)
                    c.proc.wait()
                    if c.proc.stdout is not None:
                        c.proc.stdout.close()
                if c.status is not None:
                    os.close(c.status)
                    c.status = None
            signal.set_wakeup_fd(old_wake)
            for s, h in old.items():
                signal.signal(s, h)
            self._sel.close()
            os.close(wake_r)
            os.close(wake_w)
            if reserve is not None:
                reserve.close()

    def _supervise(self) -> int:
        host, port = self.address
        for c in self._children:
            if not self._start(c):
                return self._fail("cannot start a server process: stopping", 1)
        deadline = time.monotonic() + self._start_timeout
        while True:
            if self._signals:
                sig = self._signals.pop(0)
                log.info("received %s: stopping %d server processes",
                         signal.Signals(sig).name, self._procs)
                return 0 if self._stop_all(sig) else 1
            now = time.monotonic()
            for c in self._children:
                if c.proc is not None:
                    rc = c.proc.poll()
                    if rc is not None:
                        status = self._reaped(c, rc, now)
                        if status is not None:
                            return status
                elif c.respawn_at is not None and now >= c.respawn_at:
                    if not self._start(c):
                        return self._fail("cannot restart a server process: stopping", 1)
            if not self._announced:
                if all(c.listened for c in self._children):
                    self._announced = True
                    shown = f"[{host}]" if ":" in host else host     # IPv6: bracketed
                    self._write(f"listening on {shown}:{port}\n")
                    log.info("supervising %d server processes on %s:%s", self._procs, host,
                             port)
                elif now >= deadline:
                    return self._fail(f"the server processes did not all listen within "
                                      f"{self._start_timeout:g} s: stopping", 1)
            waits = [c.respawn_at - now for c in self._children if c.respawn_at is not None]
            if not self._announced:
                waits.append(deadline - now)
            self._poll(max(0.0, min([0.5] + waits)))


def _how(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"status {rc}"


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def _wait_readable(fd: int, timeout: float) -> None:
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        sel.select(max(0.0, timeout))
