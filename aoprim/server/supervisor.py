"""``--procs N``: N server processes on one port, and the process that supervises them.

One idea, the supervisor (over 800 lines): starting, watching, relaying the output of and
stopping its children are one process's state machine.

The kernel spreads the connections over the children (``SO_REUSEPORT``).  The supervisor
runs no server code (this module imports none of it; the ``aoprim.server`` package around
it is loaded, but no server, loop or session is made): a child is any command that reports to it on a pipe of its own (see
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
- ``listening on HOST:PORT`` (``[HOST]:PORT`` for IPv6) is printed once, when every child
  has said it listens.  A child that exits before that (the first start), or a start that
  takes longer than ``start_timeout``, stops the others; the supervisor then exits
  non-zero (2 if that child exited 2) and never prints it.  ``start_timeout`` is None by
  default: the supervisor waits as long as its children are alive, as ``serve`` alone
  does (a handler module that loads a model for minutes); a child that dies still ends the
  start at once.
- What happens when a child exits is decided by what it said on its status pipe, never by
  its exit status alone (which a handler can choose: ``sys.exit(2)``, ``os._exit(0)``):
    - at the first start, it exited before saying ``ready``: a usage or configuration
      error (status 2) or a start-up that fails, which a restart would only repeat: stop
      every child, exit 2 (or 1);
    - it said ``stopped`` and exited 0, or died of a stop signal (SIGTERM, SIGINT, SIGHUP,
      SIGQUIT: one that came before its handlers were in place), without the supervisor
      having asked (an operator's ``kill``, ``kill -HUP``, an OOM daemon): it is replaced
      -- the service keeps its N processes -- and that is not counted as a crash;
    - anything else is a crash: restart it after a back-off that doubles from ``backoff``
      up to ``backoff_max``; a child that lived ``stable_after`` seconds starts the back-off
      again.  A restart that fails -- its process exits before ``ready`` (status 2 too: a
      handler file half-way through a deploy) or cannot be spawned at all (``EMFILE``,
      ``EAGAIN``) -- is a crash of that place, logged once per back-off step and retried
      while the other children serve.  Only such failures before ``ready`` count toward
      giving up, and only while no other child serves: a place that failed more than
      ``give_up_after`` times in a row then stops every child and the supervisor exits 1.
      A restart that has not said ``ready`` within ``start_timeout`` (an import that
      blocks, a bind that never comes) is such a failure too: it is killed with its
      process group, logged, and retried after the back-off.  With no ``start_timeout`` a
      restart is waited for as long as it lives, and logged once when it has not said
      ``ready`` after 30 s.
      A crash while serving (a handler's ``os._exit``, a request that kills the process)
      is restarted for as long as the supervisor runs: no request can end the service.
- SIGINT/SIGTERM are forwarded (once) to every child -- the child alone, as ``kill PID``
  stops ``serve`` alone; what it started is its own to stop, see below -- each followed by
  SIGCONT to its process group (a stopped process -- SIGSTOP, a debugger, job control --
  acts on its signal only once continued; systemd does the same); the supervisor waits up
  to ``stop_timeout`` seconds (and 1 s more: a child's own bound is ``stop_timeout``,
  and its own message -- what holds it -- comes first), kills what is left, and exits 0 if
  every child exited 0, else 1.  During that wait a second SIGINT (Ctrl-C twice) or a
  SIGQUIT kills the children at once -- a SIGINT within 0.2 s of the last is that Ctrl-C,
  relayed by a wrapper in the terminal's process group (``timeout``), and changes nothing;
  a repeated SIGTERM or SIGHUP changes nothing
  (``timeout`` sends SIGTERM to the command and then to its process group, systemd to every
  process of the unit: a clean stop stays one).  SIGHUP (its terminal hung up) and SIGQUIT stop the service the same
  way, the children getting SIGTERM: their default action would end the supervisor alone,
  and a supervisor that ends leaves no service behind (no core file either: a
  supervisor's is of no use).  Either one ignored when the supervisor starts (``nohup``, a
  shell's background job) stays ignored, as it does for ``serve`` alone -- and for its
  children, which inherit the ignore.
- A child takes SIGHUP and SIGQUIT as SIGTERM (cli.py's ``_stop_also_on_hup_and_quit``,
  from its start): a clean stop, its stats line, its replies in flight sent, ``stopped``
  said, exit 0.  Sent to every process of the service (``pkill -HUP -f 'aoprim serve'``,
  systemd's ``SendSIGHUP=yes`` after its SIGTERM, ``kill -HUP`` of each pid) that is the
  supervisor's stop above, exit 0; a child still starting that dies of one before its
  handlers are in place counts as stopped cleanly, as it does for SIGTERM.  Sent to one
  child alone it is that child's SIGTERM: a child that stops cleanly on its own signal is
  replaced at once, not counted as a crash (see above), and the service serves on.
- What a child started (a handler's subprocess, a process it forked) is in the child's
  process group and does not outlive it: at a stop it is the child's to stop first (a
  ``fork`` Pool its module made is ended by the Pool's finalizer at the child's exit; killed
  with the child, a worker holding the Pool's queue lock would hang that exit), gets
  SIGTERM once the child exited, and SIGKILL if still there ``stop_timeout`` after the
  stop began; when a child exits on its own (a crash, an
  operator's ``kill PID``) its group gets SIGTERM then, and SIGKILL ``stop_timeout`` later.
  (Left for the service's stop, it would outlive a supervisor killed meanwhile -- SIGKILL,
  an OOM kill -- and nothing would stop it; so only what ignores SIGTERM and is inside
  that ``stop_timeout`` when the supervisor is killed is left: a cgroup -- systemd's
  ``KillMode=control-group`` -- is the complete answer.)  A restart killed at
  ``start_timeout`` is killed with its group.  (A process that leaves the group --
  ``setsid``, ``start_new_session=True`` -- is its own.)
- As PID 1 (a container's) or a subreaper, the supervisor is sent every orphan of its
  children's process trees (a handler's ``cmd &``, a double fork): it reaps them all on
  each turn of its loop (SIGCHLD wakes it), not only its children, or they would stay
  zombies while the child that made them serves.
- Children die with the supervisor, even if it is killed with SIGKILL: each child asks the
  kernel for SIGTERM when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``, set between fork
  and exec), then checks that its parent is still the supervisor, which closes the race of a
  supervisor that died before the request was made.  The death signal follows the *thread*
  that forked the child, so the supervisor forks in one thread, the caller's, which lives as
  long as it does (its stdout's writer thread, if it has one, forks nothing).  A child that
  gets its stop signal after its supervisor died passes it on to its own process group
  (what its handlers started) and, before it exits, kills what is left of the group after
  ``stop_timeout`` (cli.py): what a child started goes with it, as at any stop.
- Children run in their own process group: a Ctrl-C at the terminal reaches the supervisor
  only, which forwards it once.  Their stdout is read by the supervisor and passed on line by
  line, whole up to 64 KiB (a longer one in pieces of that size, between which another
  child's lines may come: the supervisor's memory stays bounded), as bytes: never decoded, so what reaches the supervisor's stdout is what the
  child wrote, whatever its encoding; their stderr is the supervisor's.  A child's output is never waited for once
  it has exited (what it wrote is in the pipe; a process it started may hold the pipe
  open): the loop never stalls on it, and a stop takes the time of the slowest child.
- Writing its stdout never blocks the supervisor (:class:`_Output`): what the stdout does
  not take waits, up to 1 MiB, then the children's output waits in their pipes (a slow
  reader loses nothing); a stdout that took nothing for 2 s (a stalled log shipper) has the
  lines beyond 1 MiB dropped, counted, and said on stderr (when dropping begins, and the
  count once the stdout is read again or the supervisor ends); SIGINT/SIGTERM are handled
  as ever.  At a stop, what waits is written to a reader that is slow but alive until it
  is all out or the children's time to stop is up, as ``serve`` alone writes it.  A
  write that fails for a moment (``ENOSPC``: a full disk) drops what waited, counted, and
  the next lines are tried as ever.  When the supervisor's stdout is
  gone (closed, or a pipe whose reader exited: ``| head -1``) the lines are dropped --
  logged once -- and everything else goes on: serving, restarts, the exit status.
  Output a child ends without a newline (it died in the middle of a line: ``os._exit``, an
  OOM kill) is ended with one when its pipe reaches its end, so that no other line is glued
  to it.
- Its own log lines never block it either: while it runs, the logging handlers that write
  to its stderr write through a second :class:`_Output` (256 KiB kept; a stderr that took
  nothing for 2 s has the lines beyond that dropped and counted).  When it ends it waits
  for a stderr that still takes bytes, never more than 2 s after the last it took.  The
  children write that stderr themselves (blocking, as any program's writes do).

The status pipe
---------------
``child_argv(port, status_fd)`` gives each child the number of an inherited pipe's write end.
The child writes ``ready\n`` once it accepts connections (its settings were accepted, no
handler code has run yet), and ``stopped\n`` when it was told to stop (SIGINT, SIGTERM,
SIGHUP or SIGQUIT) and has shut down cleanly, just before it exits 0.  ``stopped`` matters
only when the supervisor asked for the stop: said on its own, the child is replaced.  A
child that cannot serve as told (a handler that does not import, a port in use: what
``serve`` alone says in one ``aoprim: ...`` line, exit 2) writes ``usage "MESSAGE"\n``
(the message as a JSON string) instead of printing it, and exits 2: the supervisor prints
each message once, however many children fail alike (a typo in MODULE:HANDLER fails in all
N).  Nothing else is read.
"""
from __future__ import annotations

import ctypes
import errno
import json
import logging
import math
import os
import select
import selectors
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from types import FrameType
from typing import IO, Any, Callable, Sequence

__all__ = ["Supervisor", "reserve_port"]

log = logging.getLogger("aoprim.server")

_PR_SET_PDEATHSIG = 1
_PR_GET_CHILD_SUBREAPER = 37
_READY = b"ready"           # the child's status messages (see "The status pipe")
_STOPPED = b"stopped"
USAGE = b"usage "           # ... and the prefix of a usage error's message
# the signals that stop the service, and a child that gets one of them itself; the children
# get the first two as they came, the others as SIGTERM (a child takes SIGHUP and SIGQUIT
# as SIGTERM unless ignored at its start or handled by its handler's module; SIGTERM stops
# it either way)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# ... those of them that stay ignored when they are at the start (``nohup``, a background
# job's SIGQUIT), as they do for ``serve`` alone (cli._stop_also_on_hup_and_quit)
KEEP_IGNORED = (signal.SIGHUP, signal.SIGQUIT)
# during a stop, these end the wait at once (Ctrl-C again, SIGQUIT); a repeated SIGTERM or
# SIGHUP does not (``timeout`` sends SIGTERM to the command and then to its group; systemd
# signals every process of the unit)
_KILL_NOW = (signal.SIGINT, signal.SIGQUIT)
# a SIGINT this soon after the last one is the same Ctrl-C, relayed: the terminal signals its
# foreground process group, and a wrapper in that group (``timeout``, a shell script that
# traps and forwards) sends the supervisor its own copy milliseconds later -- a person's
# second Ctrl-C takes longer.  (serve_forever's handler has the same window: server.py's
# SAME_CTRL_C; this module imports no server code.)
_SAME_CTRL_C = 0.2
_SAID_MAX = 1 << 16         # bytes of a child's status pipe kept: more than the longest usage
                            # message a child sends (cli.py's _USAGE_MAX) and its words
_MAX_LINE = 65536           # a longer stdout line is passed on in pieces of this size
_OUT_MAX = 1 << 20          # bytes of output kept for a stdout that is not read, at most
_STALL = 2.0                # seconds a stdout may take nothing before it counts as stalled
_FINAL_READS = 64           # reads of an exited child's stdout, at most (64 x 64 KiB)
_MAX_SECONDS = 86400.0      # the largest start_timeout, stop_timeout and backoff_max
_ERR_MAX = 1 << 18          # bytes of log lines kept for a stderr that is not read, at most
_KILL_GRACE = 1.0           # seconds past stop_timeout before a stopping child is killed: its
                            # own bound is stop_timeout (serve's), so its message comes first
_SLOW_START = 30.0          # seconds after which a restart not yet listening is logged (once)
_SPAWNS_KEPT = 32           # the newest spawns Supervisor.spawned records: a record of every
                            # one would grow with each restart, for as long as it runs
_GROUP_CHECK = 0.2          # seconds between two looks at the leftover process groups
                            # while they are being stopped
_GROUP_IDLE = 5.0           # ... while they are not (a look forgets the empty ones: a
                            # group's number is reused once it is empty)
# write errors that mean the stream is gone for good; any other (ENOSPC, EDQUOT, EIO, EFBIG:
# a full disk) costs what waited, and the next lines are tried again
_GONE = frozenset({errno.EPIPE, errno.EBADF, errno.EINVAL, errno.ECONNRESET, errno.ENOTCONN,
                   errno.ESHUTDOWN})


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


def stop_signals() -> list[int]:
    """The stop signals to handle: STOP_SIGNALS but those of KEEP_IGNORED that are ignored
    now (a caller asks before it puts any handler of its own in place)."""
    return [s for s in STOP_SIGNALS
            if not (s in KEEP_IGNORED and signal.getsignal(s) == signal.SIG_IGN)]


def _is_reaper(prctl: Any) -> bool:
    """Whether orphaned processes are re-parented to this process: PID 1 (of a PID
    namespace: a container) or a subreaper (``PR_SET_CHILD_SUBREAPER``)."""
    if os.getpid() == 1:
        return True
    if prctl is None:
        return False
    flag = ctypes.c_int(0)
    if prctl(_PR_GET_CHILD_SUBREAPER, ctypes.addressof(flag), 0, 0, 0) != 0:
        return False
    return flag.value != 0


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


class _Output:
    """The supervisor's stdout, written without ever blocking the supervisor.

    A pipe, a FIFO or a terminal is opened again (``/proc/self/fd/N``: a file description of
    the supervisor's own) with ``O_NONBLOCK``, so the flag touches no other process sharing
    the stream (the shell's terminal, a ``| tee``); a socket (systemd's journal) is written
    with ``MSG_DONTWAIT``; a regular file or ``/dev/null`` never blocks and is written as it
    is; a file object without an fd (``io.StringIO``) too.  What the stream does not take at
    once waits here, in order, and is written as the stream becomes writable (the
    supervisor's loop polls it).  Once ``limit`` bytes wait, the supervisor stops reading
    its children's output (``blocked``): a slow reader slows the children's printing, as a
    pipe does, and loses nothing.  A stream that took nothing for ``_STALL`` seconds is
    stalled: the children's output is read again, and a line that does not fit is dropped
    and counted -- logged once when dropping begins, and how many lines went once the
    stream takes output again (or when the supervisor ends).

    Where the stream cannot be opened again (a pipe or terminal of another user:
    ``EACCES``), a thread of its own writes it, blocking, on a duplicate of the fd (the same
    file description, its flags untouched: ``fcntl(O_NONBLOCK)`` there would change them
    for every process sharing it -- the shell's terminal, the other writers of a pipe, which
    would meet ``EAGAIN`` where they never expect it).  The supervisor only hands it bytes,
    so a stalled reader blocks that thread alone; everything above holds the same.  (The
    thread forks nothing: the children's death signal follows the supervisor's own
    thread.)

    A write that fails for a moment (``ENOSPC``, ``EDQUOT``, ``EIO``: a full disk) drops
    what waited -- counted, logged once -- and the next lines are tried as ever; the count
    is logged once a write succeeds again.  Only a stream that is gone (``EPIPE``: its
    reader exited; a closed fd) is given up.

    The supervisor's stderr is one too (``name`` "stderr", what it carries: the
    supervisor's log lines); nothing waits on it (``blocked()`` is for stdout only)."""

    def __init__(self, out: IO[str] | None, limit: int = _OUT_MAX, name: str = "stdout",
                 carries: str = "the server processes' output") -> None:
        self._file = out
        self._limit = limit
        self._name = name
        self._carries = carries
        self.watched = False          # self.fd is in the supervisor's selector
        self.source = -1              # the stream's own fd, once open() found one
        self._enc = (getattr(out, "encoding", None) or "utf-8") if out is not None else ""
        self.fd = -1                  # the fd the loop polls while bytes wait (-1: none)
        self._own = -1                # the reopened fd, ours to close
        self._sock: socket.socket | None = None
        self._text = False            # written through the file object (no fd of its own)
        self._pending = bytearray()
        self._moved = 0.0             # monotonic time the stream last took bytes
        self._dropped = 0             # lines dropped since the stream last took everything
        self._stalled = False         # dropping was logged and its count not yet
        self._failed = 0              # lines dropped by failed writes (ENOSPC) since the
        self._failing = False         # ... first of them was logged; the count not yet
        self.lost = False             # the stream is gone: everything is dropped
        # the writer thread (a stream that cannot be opened again), and what it shares with
        # the supervisor's thread under _cond: _pending, _moved, _error, _wrote, _closing,
        # wake_fd
        self._cond = threading.Condition(threading.Lock())
        self._writer: threading.Thread | None = None
        self._error: OSError | None = None   # a failed write of the thread, not yet handled
        self._thread_failed = 0       # the lines it dropped with it
        self._wrote = False           # the thread wrote bytes since the last flush()
        self._closing = False
        self._in_write = False        # the thread is in a write (which may block)
        self.wake_fd = -1             # the thread writes a byte here when it wrote (it wakes
                                      # the supervisor's loop); -1: none

    @property
    def waiting(self) -> bool:
        return bool(self._pending) and not self.lost

    @property
    def threaded(self) -> bool:
        """Written by a thread of its own (the stream could not be opened again)."""
        return self._writer is not None and not self.lost

    @property
    def direct(self) -> bool:
        """Written through an fd of its own (never blocking), not the file object."""
        return not self._text and not self.lost and (
            self._own >= 0 or self._sock is not None or self._writer is not None)

    def stalled(self) -> bool:
        """Bytes wait, and the stream took none for ``_STALL`` seconds."""
        return self.waiting and time.monotonic() - self._moved >= _STALL

    def blocked(self) -> bool:
        """``limit`` bytes wait and the stream still moves: the children's output is to
        wait in their pipes."""
        return self.waiting and len(self._pending) >= self._limit and not self.stalled()

    def open(self) -> None:
        out = self._file
        if out is None:                        # sys.stdout is None: fd 1 was closed
            self._lose("no stdout")
            return
        try:
            fd = out.fileno()
        except (OSError, ValueError, AttributeError):     # io.UnsupportedOperation: no fd
            self._text = True
            return
        try:
            out.flush()                        # what was printed before: first, in order
            mode = os.fstat(fd).st_mode
        except (OSError, ValueError) as e:
            self._lose(e)
            return
        self.source = fd
        if stat.S_ISREG(mode) or stat.S_ISBLK(mode):
            self._own = os.dup(fd)             # a file's writes do not wait for a reader
        elif stat.S_ISSOCK(mode):
            self._sock = socket.socket(fileno=os.dup(fd))
            self.fd = self._sock.fileno()
        else:
            try:
                self._own = self.fd = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY |
                                              os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
            except OSError as e:
                if e.errno == errno.ENXIO and stat.S_ISFIFO(mode):
                    self._lose(BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE)))
                    return
                # (EACCES: another user's pipe or terminal; no /proc): a writer thread
                try:
                    wfd = os.dup(fd)
                except OSError as e2:
                    self._lose(e2)
                    return
                self._writer = threading.Thread(target=self._write_loop, args=(wfd,),
                                                name=f"aoprim-supervisor-{self._name}",
                                                daemon=True)
                self._writer.start()

    def write(self, text: str | bytes, keep: bool = False) -> None:
        """Write ``text`` (whole lines, or a piece of a line too long to keep) or keep it to
        be written; ``keep``: never dropped (the supervisor's own ``listening on`` line).
        Bytes (a child's output) are written as they are; a str (the supervisor's own
        lines) is encoded in the stream's encoding, with a backslash escape for what it
        cannot encode (as Python's own stderr writes a lone surrogate: an undecodable file
        name in a child's usage message reads as with ``serve`` alone)."""
        if self.lost:
            return
        if self._text:
            try:
                self._write_file(text)
            except ValueError as e:            # a closed file
                self._lose(e)
            except OSError as e:               # EPIPE: gone; ENOSPC: that line only
                self._write_failed(e, 1)
            else:
                self._took()
            return
        data = text if isinstance(text, bytes) else text.encode(self._enc, "backslashreplace")
        if self._pending:
            # over the limit only by what was read before reading paused (or an exited
            # child's last output, or a log line), unless the stream stalled: then dropped
            if len(self._pending) + len(data) > self._limit and not keep and self.stalled():
                self._drop()
                return
            with self._cond:
                self._pending += data          # after what waits: order is kept
            return
        with self._cond:
            self._pending += data
        self._moved = time.monotonic()         # (the wait starts now)
        self.flush()

    def _write_file(self, text: str | bytes) -> None:
        """Write through the file object (blocking): bytes to its binary buffer where it has
        one (``sys.stdout``), else decoded as UTF-8 (an ``io.StringIO``: text only)."""
        out = self._file
        if isinstance(text, bytes):
            raw = getattr(out, "buffer", None)
            if raw is not None:
                out.flush()                    # type: ignore[union-attr]  # (order kept)
                raw.write(text)
                raw.flush()
                return
            text = text.decode("utf-8", "replace")
        out.write(text)                        # type: ignore[union-attr]
        out.flush()                            # type: ignore[union-attr]

    def _drop(self) -> None:
        self._dropped += 1
        if not self._stalled:
            self._stalled = True
            log.warning("%s is not being read (%d bytes waiting): %s is dropped until it "
                        "is; serving goes on", self._name, len(self._pending), self._carries)

    def _write_failed(self, e: OSError, lines: int) -> None:
        """A write failed with ``e``: a stream that is gone is given up; any other error
        (``ENOSPC``, ``EIO``) costs the ``lines`` that waited (dropped, counted) and the
        next lines are tried as ever."""
        if e.errno in _GONE:
            self._lose(e)
            return
        self._failed += lines
        if not self._failing:
            self._failing = True           # (first: the line below may be written here)
            log.warning("%s cannot be written (%s): %s is dropped until it can be; serving "
                        "goes on", self._name, e.strerror or e, self._carries)

    def _took(self) -> None:
        """The stream took bytes: a run of failed writes (if any) is over; say its count."""
        if self._failing:
            failed = self._failed
            self._failing = False          # (first: the line below may be written here)
            self._failed = 0
            log.warning("%s takes output again: %d lines of %s were dropped meanwhile",
                        self._name, failed, self._carries)

    def flush(self) -> None:
        """Write what waits, as much as the stream takes now (a writer thread's stream:
        wake the thread, and take up what it met)."""
        if self._writer is not None:
            with self._cond:
                error, self._error = self._error, None
                wrote, self._wrote = self._wrote, False
                failed, self._thread_failed = self._thread_failed, 0
                self._cond.notify_all()
            if error is not None and not self.lost:
                self._write_failed(error, failed)
            if wrote and not self.lost:
                self._took()
        while self._pending and not self.lost and self._writer is None:
            try:
                if self._sock is not None:
                    n = self._sock.send(self._pending, socket.MSG_DONTWAIT)
                else:
                    n = os.write(self._own, self._pending)
            except BlockingIOError:
                return
            except InterruptedError:
                continue
            except OSError as e:
                lines = _lines(self._pending)
                self._pending.clear()
                self._write_failed(e, lines)
                return
            if n:
                self._moved = time.monotonic()
            del self._pending[:n]
            if n:
                self._took()
        if self._stalled and not self._pending:
            dropped = self._dropped
            self._stalled = False          # (first: the line below may be written here)
            self._dropped = 0
            log.warning("%s is read again: %d lines of %s were dropped meanwhile",
                        self._name, dropped, self._carries)

    def _write_loop(self, fd: int) -> None:
        """The writer thread: write what waits to ``fd`` (blocking), in order, until
        close(); what goes wrong is left for flush() (the supervisor's thread) to log."""
        try:
            while True:
                with self._cond:
                    while not self._pending and not self._closing:
                        self._cond.wait()
                    if not self._pending:          # closing, and all written
                        return
                    chunk = bytes(self._pending[:_MAX_LINE])
                    self._in_write = True
                try:
                    n = os.write(fd, chunk)
                except BlockingIOError:        # O_NONBLOCK set by another program
                    self._in_write = False
                    try:
                        select.select([], [fd], [], 1.0)
                    except (OSError, ValueError):
                        pass
                    continue
                except InterruptedError:
                    continue
                except OSError as e:
                    with self._cond:
                        self._in_write = False
                        self._error = e
                        self._thread_failed += _lines(self._pending)
                        self._pending.clear()
                        self._wake()
                    if e.errno in _GONE:
                        return
                    continue
                with self._cond:
                    self._in_write = False
                    del self._pending[:n]
                    if n:
                        self._moved = time.monotonic()
                        self._wrote = True
                    self._cond.notify_all()
                    self._wake()
        finally:
            os.close(fd)

    def _wake(self) -> None:
        """(The writer thread, under _cond) wake the supervisor's loop."""
        if self.wake_fd >= 0:
            try:
                os.write(self.wake_fd, b"\0")
            except OSError:                    # full (a wake-up is pending anyway)
                pass

    def drain(self, seconds: float | None = None, deadline: float = math.inf) -> None:
        """Write what waits, waiting for the stream until ``deadline`` (monotonic time) and,
        with ``seconds``, only while it takes some within ``seconds`` of its last progress
        (a log shipper that is slow, not stalled, gets the last lines)."""
        self.flush()
        while self.waiting:
            end = deadline if seconds is None else min(deadline, self._moved + seconds)
            left = end - time.monotonic()
            if left <= 0:
                return
            if self._writer is not None:
                with self._cond:
                    if self._pending:
                        self._cond.wait(min(left, 0.5))
            elif self.fd >= 0:
                try:
                    select.select([], [self.fd], [], left)
                except InterruptedError:
                    pass
                except (OSError, ValueError):
                    return
            else:                              # a file: written as it is, never waited for
                return
            self.flush()

    def close(self, report: bool = True) -> None:
        """Write what the stream takes now (never waiting), say what was dropped (``report``:
        not for the stream the log itself goes to), let go."""
        self.flush()
        with self._cond:
            left = len(self._pending) if not self.lost else 0
            self._pending.clear()
            self._closing = True
            self.wake_fd = -1
            in_write = self._in_write
            self._cond.notify_all()
        dropped = self._dropped + self._failed
        if report and (self._stalled or self._failing or left):
            log.warning("%s was not read to the end: %d lines of %s were dropped and %d "
                        "bytes not written", self._name, dropped, self._carries, left)
        self._stalled = self._failing = False
        self._dropped = self._failed = 0
        if self._writer is not None and not in_write:
            self._writer.join(1.0)             # (one blocked in a write is left: a daemon)
        if self._sock is not None:
            self._sock.close()
        elif self._own >= 0:
            os.close(self._own)
        self._sock = None
        self._own = self.fd = -1

    def _lose(self, why: str | BaseException) -> None:
        if isinstance(why, OSError) and why.strerror:
            why = why.strerror
        self.lost = True
        with self._cond:
            self._pending.clear()
            self._cond.notify_all()
        log.warning("%s is unusable (%s): %s is dropped from now on; serving goes on",
                    self._name, why, self._carries)
        out = self._file
        if self._text and out is not None and out is sys.stdout:
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


def _lines(data: bytes | bytearray) -> int:
    """The lines in ``data`` (a piece of a line counts as one)."""
    return max(1, data.count(b"\n")) if data else 0


class _LogStream:
    """The stream a logging handler writes the supervisor's stderr through while the
    supervisor runs: an :class:`_Output`, so that a log line never blocks it."""

    def __init__(self, out: _Output) -> None:
        self._out = out

    def write(self, text: str) -> int:
        self._out.write(text)
        return len(text)

    def flush(self) -> None:
        self._out.flush()


def _stderr_handlers(logger: logging.Logger, fd: int) -> list[logging.StreamHandler[Any]]:
    """The stream handlers that ``logger``'s records reach (its own and its ancestors', as
    far as they propagate) and that write to file descriptor ``fd``."""
    found = []
    lg: logging.Logger | None = logger
    while lg is not None:
        for h in lg.handlers:
            if isinstance(h, logging.StreamHandler):
                try:
                    if h.stream.fileno() == fd:
                        found.append(h)
                except (AttributeError, OSError, ValueError):
                    pass
        lg = lg.parent if lg.propagate else None
    return found


class _Child:
    """One of the N places: the process filling it now, and its history."""
    __slots__ = ("index", "proc", "buf", "status", "said", "started", "ready", "listened",
                 "crashes", "early", "respawn_at", "timed_out", "slow_noted", "usage",
                 "usage_shown")

    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: subprocess.Popen[bytes] | None = None    # the running process, or None
        self.buf = bytearray()    # the start of a stdout line not yet complete
        self.status: int | None = None  # the read end of its status pipe, while open
        self.said = b""           # what the current process wrote on its status pipe
        self.started = 0.0        # time.monotonic() at spawn
        self.ready = False        # the current process said "ready"
        self.listened = False     # some process in this place did
        self.crashes = 0          # exits in a row, each soon after its start (the back-off)
        self.early = 0            # exits in a row before "ready" (the crash-loop count)
        self.respawn_at: float | None = None    # monotonic time of the pending restart
        self.timed_out = False    # the current process was killed for not saying "ready"
        self.slow_noted = False   # ... or logged once as slow to say it
        self.usage: str | None = None   # the usage error the current process said, if any
        self.usage_shown = False  # ... printed (or left out: a sibling's same one was)


class Supervisor:
    """Run ``procs`` children of ``child_argv(port, status_fd)`` on one reserved port; see the
    module docstring for the rules.  ``run()`` blocks (in the main thread) and returns the exit
    status for the command line."""

    def __init__(self, child_argv: Callable[[int, int], Sequence[str]], procs: int,
                 host: str | None = "127.0.0.1", port: int = 0, *,
                 stdout: IO[str] | None = None, start_timeout: float | None = None,
                 stop_timeout: float = 15.0, backoff: float = 0.5, backoff_max: float = 30.0,
                 give_up_after: int = 5, stable_after: float = 10.0) -> None:
        if not isinstance(procs, int) or procs < 1:
            raise ValueError("procs must be an int >= 1")
        self._child_argv = child_argv
        self._procs = procs
        self._host = host
        self._port = port
        self._output = _Output(stdout if stdout is not None else sys.stdout)
        self._err = _Output(sys.stderr, _ERR_MAX, "stderr", "the supervisor's log")
        self._start_timeout = (None if start_timeout is None
                               else check_seconds("start_timeout", start_timeout))
        self._stop_timeout = check_seconds("stop_timeout", stop_timeout)
        self._backoff = check_seconds("backoff", backoff)
        self._backoff_max = check_seconds("backoff_max", backoff_max)
        self._give_up_after = int(give_up_after)
        self._stable_after = float(stable_after)
        self._prctl = _find_prctl()       # looked up here: the child only calls it
        self._children = [_Child(i) for i in range(procs)]
        self._sel: selectors.BaseSelector = None    # type: ignore[assignment]  # (run() makes it)
        self._signals: list[int] = []     # stop signals received, not yet handled
        self._suspend = False               # a SIGTSTP (Ctrl-Z) received, not yet handled
        self._sigint_at = -math.inf         # when the last SIGINT counted came
        self._announced = False           # "listening on" was printed
        self._usage_said: set[str] = set()  # the children's usage errors printed (once each)
        # process groups of exited children that still have processes (what a child
        # started): pgid -> monotonic time they are killed at if still there
        self._groups: dict[int, float] = {}
        self._groups_checked = 0.0        # monotonic time of the last look at them
        self._paused = False              # the children's stdout is not read (blocked)
        self._reap_all = False            # every child re-parented to it is its to reap
        self._drain_until = 0.0           # monotonic time the last output is written until
        self.address: tuple[str, int] | None = None     # (host, port) once reserved
        # the newest processes started, oldest first: (monotonic time, index, pid) -- a
        # tuple replaced at each spawn, so another thread may iterate it while it grows
        self.spawned: tuple[tuple[float, int, int], ...] = ()

    # -- the child's side of fork (runs between fork and exec: no locks, no logging) -----

    def _preexec(self, parent: int) -> Callable[[], None]:
        prctl = self._prctl

        def setup() -> None:
            os.setpgid(0, 0)
            # a process group of its own is a background group of the supervisor's terminal:
            # under `stty tostop` its first write to that terminal (a log line on stderr)
            # would stop it (SIGTTOU); with the signal ignored the write proceeds
            signal.signal(signal.SIGTTOU, signal.SIG_IGN)
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
        if not self._paused:
            self._sel.register(c.proc.stdout.fileno(), selectors.EVENT_READ, c)
        self._sel.register(status_r, selectors.EVENT_READ, (c, status_r))
        c.status = status_r
        c.said = b""
        c.usage = None
        c.usage_shown = False
        c.buf.clear()
        c.started = time.monotonic()
        c.ready = False
        c.timed_out = c.slow_noted = False
        c.respawn_at = None
        self.spawned = (*self.spawned, (c.started, c.index, c.proc.pid))[-_SPAWNS_KEPT:]
        log.debug("started server process %d (place %d)", c.proc.pid, c.index)

    def _start(self, c: _Child, now: float) -> bool:
        """Spawn a process for place ``c``.  False if the supervisor is to stop: the spawn
        failed at the first start, or a restart failed and no other process serves and
        this place failed more than ``give_up_after`` times in a row.  A restart that fails
        while others serve (``EMFILE`` from ``os.pipe``, ``EAGAIN`` from ``fork``, a
        program gone mid-deploy) is a crash before ``ready``: retried after the back-off."""
        try:
            self._spawn(c)
        except (OSError, subprocess.SubprocessError) as e:
            c.proc = None
            c.respawn_at = None
            what = f"cannot start server process {c.index + 1} of {self._procs}: {e}"
            if not self._announced and not c.listened:
                log.error("%s", what)
                return False
            c.early += 1
            if c.early > self._give_up_after and not self._serving(c):
                log.error("%s; %d failures in a row and no server process serves: giving up",
                          what, c.early)
                return False
            c.respawn_at = now + self._next_delay(c, now)
            log.error("%s: retrying in %.2g s", what, c.respawn_at - now)
        return True

    def _suspend_all(self) -> float:
        """Ctrl-Z (SIGTSTP): stop every server process and what each started, then the
        supervisor itself, as a shell stops a job; once the supervisor is continued (``fg``,
        ``bg``, SIGCONT), continue them all.  Each child leads a process group of its own,
        which the terminal's SIGTSTP does not reach, so without this a stopped service's
        processes would keep accepting connections that nothing then reads past a full
        pipe.  SIGSTOP, which no handler can catch, for the children and for the
        supervisor (SIGTSTP would be discarded if its process group is orphaned).  The
        time spent stopped is not counted against a restart's start_timeout.  Returns
        that time."""
        groups = [c.proc.pid for c in self._children
                  if c.proc is not None and c.proc.returncode is None]
        groups += [g for g in self._groups if g not in groups]
        for pgid in groups:
            _signal_group(pgid, signal.SIGSTOP)
        log.info("received SIGTSTP: %d server processes stopped; SIGCONT continues them",
                 len(groups))
        stopped_at = time.monotonic()
        os.kill(os.getpid(), signal.SIGSTOP)       # returns once continued
        stopped = time.monotonic() - stopped_at
        for pgid in groups:
            _signal_group(pgid, signal.SIGCONT)
        for c in self._children:
            if c.proc is not None and c.started:
                c.started += stopped                # (a restart's start_timeout)
        log.info("continued after %.1f s: server processes continued", stopped)
        return stopped

    def _starting(self, c: _Child, now: float) -> float | None:
        """A restart of place ``c`` that has not said "ready": killed (with its process
        group) once it is ``start_timeout`` old -- its exit is then a failed start -- or,
        with no start_timeout, logged once when it is _SLOW_START old.  Returns the time
        left until that, or None."""
        age = now - c.started
        if self._start_timeout is not None:
            if c.timed_out:
                return None
            if age >= self._start_timeout:
                c.timed_out = True
                _signal(c.proc, signal.SIGKILL)     # type: ignore[arg-type]
                return None
            return self._start_timeout - age
        if c.slow_noted:
            return None
        if age >= _SLOW_START:
            c.slow_noted = True
            log.warning("server process %d (restarted) has not listened after %.0f s; "
                        "waiting for it (no start timeout)", c.proc.pid, age)  # type: ignore[union-attr]
            return None
        return _SLOW_START - age

    def _serving(self, but: _Child) -> bool:
        """Some place other than ``but`` has a process that serves."""
        return any(o.ready and o.proc is not None for o in self._children if o is not but)

    def _next_delay(self, c: _Child, now: float) -> float:
        """The back-off before place ``c``'s next start, one more crash counted."""
        if c.started and now - c.started >= self._stable_after:
            c.crashes = 0                  # it served a while: the back-off starts again
        c.started = 0.0                    # (a failed spawn: counted from the first crash)
        c.crashes += 1
        return min(self._backoff * 2 ** (c.crashes - 1), self._backoff_max)

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
                if len(c.said) > _SAID_MAX:    # two short words and one usage message
                    c.said = c.said[-_SAID_MAX:]
                continue
            if chunk == b"" or final:
                self._sel.unregister(fd)
                os.close(fd)
                c.status = None
            break
        words = c.said.split(b"\n")[:-1]
        for w in words:
            if w.startswith(USAGE) and c.usage is None:
                try:
                    said = json.loads(w[len(USAGE):])
                except ValueError:
                    said = None
                c.usage = said if isinstance(said, str) else repr(w[len(USAGE):])
                # printed as it arrives, not at the child's exit, which a thread its
                # handler's import started may hold back
                self._say_usage(c, 2, once=not self._announced)
        if _READY in words and not c.ready:
            c.ready = c.listened = True
            c.early = 0
            if self._announced:
                log.info("server process %d (restarted) is listening", c.proc.pid)

    def _read(self, c: _Child, final: bool = False) -> None:
        """Pass on what child ``c`` printed.  ``final``: it has exited; take what is in its
        pipes and close them, never waiting.  Everything it wrote before it exited is in the
        pipe already; what may still come is from a process it started that holds the pipe
        (a sidecar spawned at import), which the supervisor does not wait for -- waiting
        would stall its loop, once per exited child."""
        if final and c.status is not None:
            self._read_status(c, c.status, final=True)
        if c.proc.stdout.closed:           # its end of output was read already
            return
        fd = c.proc.stdout.fileno()
        reads = 0
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                if not final:
                    return
                chunk = b""                # all there is: let go of the pipe
            if final:
                reads += 1                 # a helper writing without end: bounded
                if reads > _FINAL_READS:
                    chunk = b""
            if not chunk:
                if not self._paused:           # (paused: not in the selector)
                    self._sel.unregister(fd)
                c.proc.stdout.close()
                if c.buf:
                    # its last output, without a newline (it died in the middle of a line:
                    # os._exit, an OOM kill): ended with one, or the next line written --
                    # another child's, the supervisor's own -- would be glued to it
                    c.buf += b"\n"
                    self._line(c, bytes(c.buf))
                    c.buf.clear()
                return
            # the line's start grows in place (a bytearray: no copy of what is kept per
            # read), and each complete line is cut out of it once
            buf = c.buf
            start = len(buf)
            buf += chunk
            nl = buf.find(b"\n", start)
            if nl >= 0:
                done = 0
                while nl >= 0:
                    self._line(c, bytes(buf[done:nl + 1]))
                    done = nl + 1
                    nl = buf.find(b"\n", done)
                del buf[:done]
            if len(c.buf) >= _MAX_LINE:
                # a line without end (progress output, a binary dump): kept whole, it would
                # grow without bound and be joined again on every read; passed on now, it
                # costs at most _MAX_LINE + one read, and each byte is copied a bounded
                # number of times
                self._line(c, bytes(c.buf))
                c.buf.clear()
            if not final and self._output.blocked():
                return                     # the rest waits in the pipe (see _Output)

    def _line(self, c: _Child, line: bytes) -> None:
        if line:
            self._output.write(line)

    def _stop_all(self, sig: int = signal.SIGTERM) -> bool:
        """Signal every live child's process group (the child and the processes it started),
        wait for them (bounded by stop_timeout, or not at all for SIGKILL), kill the rest.
        Returns True if every child that was running exited 0.  What the children started
        (and what exited children left) gets the same signal and the same time, then is
        killed if still there; that does not change the result.

        A child still starting (it has not said "listening on") may not have its handlers
        yet: it gets SIGTERM, whose default action ends it, and ending so counts as a clean
        stop (SIGINT there would be a KeyboardInterrupt anywhere in its start-up), as ending
        by any stop signal's default action does (the SIGHUP or SIGQUIT of a ``pkill`` that
        reached it too)."""
        live = [c for c in self._children if c.proc is not None]
        was_ready = {c: c.ready for c in live}
        for c in live:
            if sig == signal.SIGKILL:
                _signal(c.proc, sig)
                continue
            # the child alone, as `kill PID` stops `serve` alone: what it started (a
            # multiprocessing Pool its module made) is its own to stop at its exit, and a
            # Pool whose workers were killed at the same moment -- one of them holding the
            # Pool's queue lock -- hangs that exit; what is left of its group gets SIGTERM
            # once it exited (below), and SIGKILL at the same deadline
            _signal_one(c.proc, sig if c.ready else signal.SIGTERM)
            # a stopped process (SIGSTOP: a debugger, `kill -STOP`, job control) acts on
            # its signal only once continued: SIGCONT right after it, as systemd sends
            _signal(c.proc, signal.SIGCONT)
        for c in self._children:
            c.respawn_at = None
        deadline = time.monotonic() + (0.0 if sig == signal.SIGKILL
                                       else self._stop_timeout + _KILL_GRACE)
        stop_at = deadline                     # for what the children started
        self._drain_until = max(self._drain_until, deadline)    # for their last output
        for pgid in self._groups:
            _signal_group(pgid, sig)
            if sig != signal.SIGKILL:
                _signal_group(pgid, signal.SIGCONT)
            self._groups[pgid] = min(self._groups[pgid], stop_at)
        ok = True
        while live or self._groups:
            self._poll(max(0.0, min(0.2, deadline - time.monotonic())) if live
                       else _GROUP_CHECK)
            again, self._signals[:] = self._signals[:], []
            if any(s in _KILL_NOW for s in again):
                # Ctrl-C again, or SIGQUIT: no more waiting (a repeated SIGTERM or SIGHUP
                # changes nothing: the stop is bounded by stop_timeout anyway)
                log.info("received %s during the stop: killing what is left",
                         signal.Signals(next(s for s in again if s in _KILL_NOW)).name)
                deadline = stop_at = 0.0
                for pgid in self._groups:
                    self._groups[pgid] = 0.0
            still = []
            for c in live:
                rc = c.proc.poll()
                if rc is None:
                    still.append(c)
                    continue
                self._read(c, final=True)
                if rc == 2 and c.usage is not None and c.usage in self._usage_said:
                    pass        # a sibling failed alike, before the stop reached it: said
                elif not (rc == 0 or (-rc in STOP_SIGNALS and not was_ready[c])):
                    self._say_usage(c, rc)
                    # the supervisor's exit status says the stop was not clean: say which
                    # process and how (a crash in its on_close, a segfault, an OOM kill)
                    log.error("server process %d exited with %s while stopping",
                              c.proc.pid, _how(rc))
                    ok = False
                if self._left_behind(c.proc.pid, stop_at):
                    _signal_group(c.proc.pid, signal.SIGTERM)
                    _signal_group(c.proc.pid, signal.SIGCONT)
                c.proc = None
            live = still
            now = time.monotonic()
            if live and now >= deadline:
                for c in live:
                    log.error("server process %d did not stop: killing it", c.proc.pid)
                    _signal(c.proc, signal.SIGKILL)
                deadline = float("inf")
                ok = False
            self._tend_groups(now)
        return ok

    def _left_behind(self, pgid: int, kill_at: float) -> bool:
        """Child ``pgid`` (its process group's number) was reaped: the processes it started
        and left in its group (a handler's subprocess, a worker it forked), if any, are
        killed at ``kill_at`` if still there.  Returns whether there are any."""
        if _group_alive(pgid):
            self._groups[pgid] = kill_at
            return True
        return False

    def _tend_groups(self, now: float) -> None:
        """Forget the leftover process groups that are empty, kill those past their time
        (a look may read /proc: at most every _GROUP_CHECK seconds while some are being
        stopped, every _GROUP_IDLE seconds otherwise)."""
        if not self._groups:
            return
        every = (_GROUP_CHECK if min(self._groups.values()) < math.inf else _GROUP_IDLE)
        if now - self._groups_checked < every:
            return
        self._groups_checked = now
        for pgid, kill_at in list(self._groups.items()):
            if not _group_alive(pgid):
                del self._groups[pgid]
            elif now >= kill_at:
                log.warning("processes started by server process %d did not stop: killing "
                            "them", pgid)
                _signal_group(pgid, signal.SIGKILL)
                del self._groups[pgid]          # (SIGKILL: not waited for)

    def _poll(self, timeout: float | None) -> None:
        self._reap()
        for out in (self._output, self._err):
            if out.threaded:                   # what its thread met; wake it for new bytes
                out.flush()
            if out.fd >= 0 and out.waiting != out.watched:   # polled while bytes wait
                if not out.waiting:
                    self._sel.unregister(out.fd)
                    out.watched = False
                else:
                    try:
                        self._sel.register(out.fd, selectors.EVENT_WRITE, out)
                        out.watched = True
                    except OSError:        # a device epoll refuses (EPERM): tried each turn
                        out.fd = -1
            if out.fd < 0 and out.waiting:
                out.flush()
        out = self._output
        pause = out.blocked()
        if pause != self._paused:
            # a full stdout that still moves: the children's output waits in their pipes
            # (they slow down printing) until it takes more; a stalled one: read and dropped
            self._paused = pause
            for c in self._children:
                if c.proc is not None and not c.proc.stdout.closed:
                    if pause:
                        self._sel.unregister(c.proc.stdout.fileno())
                    else:
                        self._sel.register(c.proc.stdout.fileno(), selectors.EVENT_READ, c)
        for key, _ in self._sel.select(timeout):
            if isinstance(key.data, _Output):
                key.data.flush()
            elif key.data is None:             # the signal wake-up pipe
                try:
                    while os.read(key.fd, 512):
                        pass
                except BlockingIOError:
                    pass
            elif type(key.data) is tuple:      # a status pipe: (child, fd)
                self._read_status(key.data[0], key.data[1])
            else:
                self._read(key.data)
        self._reap()

    def _reap(self) -> None:
        """As PID 1 (a container's) or a subreaper, every process that ends re-parented to
        the supervisor (an orphan of a handler's ``cmd &``, a double fork) is its to reap:
        reaped here, on each turn of the loop (SIGCHLD wakes it), or it stays a zombie for
        ever.  A child of its own reaped here has its status handed to its ``Popen``.
        Otherwise (an ordinary process) only its own children end as its zombies, and they
        are reaped by ``Popen.poll()``: the caller's other children (a test's) are never
        touched."""
        if not self._reap_all:
            return
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            except InterruptedError:
                continue
            if pid == 0:
                return
            for c in self._children:
                if c.proc is not None and c.proc.pid == pid and c.proc.returncode is None:
                    c.proc.returncode = os.waitstatus_to_exitcode(status)

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        """The supervisor's signal handler: a stop signal is noted, to be handled by
        ``run()``.  A caller may install it before ``run()`` (which keeps what was noted),
        so that no stop signal falls between its own handler and the supervisor's."""
        if signum == signal.SIGCHLD:
            return
        if signum == signal.SIGTSTP:
            self._suspend = True
            return
        if signum == signal.SIGINT:
            now = time.monotonic()
            if now - self._sigint_at < _SAME_CTRL_C:
                return          # the same Ctrl-C, relayed by a wrapper (see _SAME_CTRL_C)
            self._sigint_at = now
        self._signals.append(signum)

    def _say_usage(self, c: _Child, rc: int, once: bool = True) -> None:
        """Print the usage error child ``c`` said on its status pipe (it exits 2 without
        printing it), once per process; ``once``: not if another child's same message was
        printed."""
        if rc == 2 and c.usage is not None and not c.usage_shown:
            c.usage_shown = True
            if not (once and c.usage in self._usage_said):
                self._usage_said.add(c.usage)
                self._err.write(f"aoprim: {c.usage}\n", keep=True)

    def _fail(self, message: str, status: int) -> int:
        self._err.write(f"aoprim: {message}\n", keep=True)
        self._stop_all()
        return status

    def _reaped(self, c: _Child, rc: int, now: float) -> int | None:
        """Child ``c`` exited with ``rc``.  Returns an exit status for the supervisor, or None
        to keep going.  What it said on its status pipe decides, not ``rc`` alone: a handler
        can exit with any status, but it runs only after ``ready``."""
        pid = c.proc.pid
        self._read(c, final=True)          # it may have said "ready" just before
        c.proc = None
        # what it started is stopped with it, as at a stop (SIGTERM; SIGKILL after
        # stop_timeout): left to the service's stop, it would outlive a supervisor killed
        # meanwhile (SIGKILL, an OOM kill), which nothing could then stop
        if self._left_behind(pid, now + self._stop_timeout):
            log.info("stopping what server process %d started", pid)
            _signal_group(pid, signal.SIGTERM)
            _signal_group(pid, signal.SIGCONT)     # (a stopped one acts on it once continued)
        words = c.said.split(b"\n")[:-1]
        # (each restart's failure is said: at the first start, one line for all children)
        self._say_usage(c, rc, once=not self._announced)
        if not self._announced and not c.listened:
            # the first start: what a restart would only repeat
            if rc == 2:
                return self._fail(f"server process {pid} ({c.index + 1} of {self._procs}) "
                                  "exited with status 2 (a usage or configuration error) "
                                  "before it listened: stopping", 2)
            return self._fail(f"server process {pid} ({c.index + 1} of {self._procs}) exited "
                              f"with {_how(rc)} before it listened: stopping", 1)
        delay = self._next_delay(c, now)
        if (rc == 0 and _STOPPED in words) or -rc in STOP_SIGNALS:
            # stopped by someone else (an operator's kill, kill -HUP, an OOM daemon's
            # SIGTERM; a stop signal's default action if it came before the child's
            # handlers): the supervisor did not ask (its own stops are reaped by _stop_all),
            # so the place is filled again -- not a crash: never a reason to give up
            log.warning("server process %d stopped (%s) without the supervisor asking: "
                        "replacing it in %.2g s", pid, _how(rc), delay)
            c.respawn_at = now + delay
            return None
        how = f"exited with {_how(rc)}"
        if not c.ready:
            # a restart that failed before "ready": its start-up (a handler file half-way
            # through a deploy exits 2; an import that hangs, killed at start_timeout),
            # which the back-off retries while other processes serve; with none serving, a
            # start-up that fails every time ends the service
            c.early += 1
            if c.timed_out:
                how = (f"did not listen within {self._start_timeout:g} s and was killed, "
                       "with the processes it started")
            else:
                how += " before it listened"
            if c.early > self._give_up_after and not self._serving(c):
                return self._fail(f"server process {pid} {how}; {c.early} crashes in a "
                                  "row, each before it listened: giving up", 1)
        else:
            # a crash while serving (a handler's bad request, os._exit, a signal): restarted
            # after the back-off for as long as the supervisor runs; requests must never be
            # able to end the service
            if rc in (0, 2):               # a status a handler chose (sys.exit, os._exit)
                how += " while serving, not told to stop (a crash)"
        log.error("server process %d %s: restarting it in %.2g s", pid, how, delay)
        c.respawn_at = now + delay
        return None

    def run(self) -> int:
        self._sel = selectors.DefaultSelector()
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        self._sel.register(wake_r, selectors.EVENT_READ, None)
        # (a stop signal ignored at the start stays so; a caller that put this handler in
        # place already has left it out too)
        # SIGTSTP (Ctrl-Z) suspends the whole service (_suspend_all), unless it is ignored
        # at the start (not a job of an interactive shell's)
        tstp = [signal.SIGTSTP] if signal.getsignal(signal.SIGTSTP) == signal.SIG_DFL else []
        old = {s: signal.signal(s, self.on_signal)
               for s in [*stop_signals(), signal.SIGCHLD, *tstp]}
        old_wake = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        self._reap_all = _is_reaper(self._prctl)
        reserve = None
        moved: list[tuple[logging.StreamHandler[Any], Any]] = []
        try:
            self._output.open()
            self._err.open()
            self._output.wake_fd = self._err.wake_fd = wake_w     # (their writer threads)
            if self._err.direct:
                # the log's handlers on stderr write through self._err while this runs: a
                # stalled stderr must not block the supervisor
                stream = _LogStream(self._err)
                for handler in _stderr_handlers(log, self._err.source):
                    moved.append((handler, handler.setStream(stream)))
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
            for pgid in self._groups:           # (only after an error of our own)
                _signal_group(pgid, signal.SIGKILL)
            self._groups.clear()
            # the children's last output, to a reader that is slow but alive, as `serve`
            # alone writes it: until it is all out or stop_timeout after the stop began
            self._output.drain(deadline=self._drain_until)
            self._output.close()
            self._err.drain(_STALL)            # the last lines, to a slow reader too
            for handler, was in moved:
                handler.setStream(was)
            self._err.close(report=False)
            signal.set_wakeup_fd(old_wake)
            self._reap_all = False
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
            if not self._start(c, time.monotonic()):
                return self._fail("cannot start a server process: stopping", 1)
        deadline = time.monotonic() + (math.inf if self._start_timeout is None
                                       else self._start_timeout)
        while True:
            if self._suspend and not self._signals:
                self._suspend = False
                deadline += self._suspend_all()
            if self._signals:
                sig = self._signals.pop(0)
                log.info("received %s: stopping %d server processes",
                         signal.Signals(sig).name, self._procs)
                # SIGHUP and SIGQUIT go on as SIGTERM, which stops every child cleanly: a
                # child keeps one ignored at its start ignored, and its handler's module may
                # have a handler of its own for it
                forward = sig if sig in (signal.SIGINT, signal.SIGTERM) else signal.SIGTERM
                return 0 if self._stop_all(forward) else 1
            now = time.monotonic()
            waits = []
            for c in self._children:
                if c.proc is not None:
                    rc = c.proc.poll()
                    if rc is not None:
                        status = self._reaped(c, rc, now)
                        if status is not None:
                            return status
                    elif self._announced and not c.ready:
                        left = self._starting(c, now)
                        if left is not None:
                            waits.append(left)
                elif c.respawn_at is not None and now >= c.respawn_at:
                    if not self._start(c, now):
                        return self._fail("cannot restart a server process: stopping", 1)
            self._tend_groups(now)
            if not self._announced:
                if all(c.listened for c in self._children):
                    self._announced = True
                    shown = f"[{host}]" if ":" in host else host     # IPv6: bracketed
                    self._output.write(f"listening on {shown}:{port}\n", keep=True)
                    log.info("supervising %d server processes on %s:%s", self._procs, shown,
                             port)
                elif now >= deadline:
                    return self._fail(f"the server processes did not all listen within "
                                      f"{self._start_timeout:g} s: stopping", 1)
            waits += [c.respawn_at - now for c in self._children if c.respawn_at is not None]
            if not self._announced:
                waits.append(deadline - now)
            self._poll(max(0.0, min([0.5] + waits)))


def check_seconds(name: str, value: object) -> float:
    """``value`` as a float if it is a finite number of seconds above 0 and at most a day,
    else ValueError naming ``name`` and the value."""
    try:
        x = float(value)        # type: ignore[arg-type]  # (any object: TypeError)
    except (TypeError, ValueError):
        x = math.nan
    if not 0 < x <= _MAX_SECONDS:          # (nan and inf fail this too)
        raise ValueError(f"{name} must be a number of seconds above 0 and at most "
                         f"{_MAX_SECONDS:g}, not {value!r}")
    return x


def _how(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"status {rc}"


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Signal child ``proc``'s process group: the child and what it started (each child
    leads a group of its own, numbered by its pid).  Not once it was reaped: its number may
    be another process's by then; until then (a zombie too) the number is the group's."""
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:            # a member of another user (setuid): the child alone
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


def _signal_one(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Signal child ``proc`` alone (not once it was reaped)."""
    if proc.returncode is not None:
        return
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` (an exited child's: its leader was reaped) still has a
    process that is not a zombie.  The supervisor first reaps those that are its own to
    reap (it runs as init, or as a subreaper); a zombie whose parent does not reap it (an
    init that never does) stays in the group for ever, and is not waited for."""
    try:
        while os.waitpid(-pgid, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:            # another user's process: not ours to stop
        return False
    members = group_members(pgid)
    return True if members is None else bool(members)    # (no /proc: the kernel's word)


def group_members(pgid: int) -> list[int] | None:
    """The live (not zombie) processes of process group ``pgid``, from /proc; None when
    /proc cannot be read."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    found: list[int] = []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        # after the command's ")": state, ppid, pgrp, ...
        fields = data[data.rindex(b")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            found.append(int(name))
    return found
