"""The ``serve`` command of ``python -m aoprim serve ...`` (aoprim.cli dispatches it, and the
other commands, ``loadgen`` and ``bench``, to their own modules; this one imports neither).

One idea, the ``serve`` command (over 800 lines): its options, the handler's loading, the
serving process's life (signals, its stop, the status pipe to a supervisor) and its output.

``serve [MODULE:HANDLER]`` serves the user's own handler, named as uvicorn and gunicorn name
an app: ``MODULE:ATTR`` where ATTR (dotted for a nested attribute) is what ``Server()``
takes, by its own rule (``server.as_handler``): a ``Handler`` subclass (instantiated with no
arguments), a ``Handler`` instance or any object with callable ``on_connect``, ``on_read``
and ``on_close`` (used as is); or a factory, called with no arguments, whose result is taken
by that rule.  The module is imported
with ``--app-dir`` (default: the current directory) first on ``sys.path``.  Without it,
``--app echo|chat`` picks a built-in app (default echo).

``serve`` prints ``listening on HOST:PORT`` (one line, flushed) once it accepts connections,
logs lifecycle and close reasons to stderr, and on SIGINT/SIGTERM shuts down cleanly (flushes
what is pending), logs the stats as one readable summary line and exits 0 with no traceback
(SIGHUP and SIGQUIT act as SIGTERM, in a ``--procs`` child too, unless ignored at the start:
``_stop_also_on_hup_and_quit``);
with ``--stats-json`` it also prints the whole ``stats()`` dict as one ``stats {...}`` JSON
line on stdout, for programs (a ``--procs`` supervisor passes the flag to its children).
The process's stdout is the user's, written as any program's is (blocking): a handler's
``print()`` into a pipe nobody reads blocks that handler.  A stop therefore has a bound,
``--stop-timeout`` (15 s): a process that has not ended that long after its stop signal (or
after serving ended) says so on stderr and exits 1 (``_StopWatchdog``).

Exit status: 0 after a clean shutdown (only a real stop signal ends it so); 2 for a usage
or configuration error (a bad option, a handler that cannot be loaded -- whatever its import
raises, ``SystemExit(0)`` and ``KeyboardInterrupt`` included --, settings the server refuses,
an address it cannot bind), with one ``aoprim: ...`` line on stderr and no traceback; 1 when serving failed -- a
``SystemExit`` or ``KeyboardInterrupt`` a handler raises while serving included (with
``workers=0`` it stops the server, see handler.py): whatever status it carries, that is a
failure, not a clean stop nor a usage error.

``--procs N`` runs N server processes on one port under a supervisor (see supervisor.py);
each is ``serve`` with the hidden ``--reuse-port --status-fd FD``, and says ``ready`` and
``stopped`` on that pipe instead of printing ``listening on``.  The pipe is kept out of the
handler's way (``_StatusPipe``), and a process a handler forks loses the server's fds
(``_hide_in_forks``).
"""
from __future__ import annotations

import _thread
import argparse
import errno
import fcntl
import importlib
import io
import json
import logging
import math
import os
import select
import signal
import stat
import subprocess
import sys
import threading
import time
import traceback
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, NoReturn

import dataclasses

from aoprim.server import BACKENDS, BackendUnavailable, Handler, Server

from .config import Settings
from .framing import FRAMINGS
from .listener import check_port, describe_address, listen_error
from .proxy import PROXY_MODES
from .server import CTRL_C_TWICE, as_handler, as_plain_python, hide_with_devnull
from .supervisor import (STOP_SIGNALS, USAGE, Supervisor, check_seconds, group_members,
                         stop_signals)
from .workers import ThreadLimitError

if TYPE_CHECKING:
    import ssl

__all__ = ["main", "build_parser", "add_serve_command", "CommandParser", "load_handler",
           "split_spec", "UsageError"]

log = logging.getLogger("aoprim.server")

# aoprim's own source files: an error raised there names its cause itself
_AOPRIM_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# the built-in apps, loaded the way a user's handler is
BUILTIN_APPS = {"echo": "aoprim.server.apps:Echo", "chat": "aoprim.server.apps:Chat"}
# the flags' defaults are the settings' own (one place: config.Settings)
DEFAULTS = {f.name: f.default for f in dataclasses.fields(Settings)}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
HOOKS = ("on_connect", "on_read", "on_close")


class UsageError(Exception):
    """A mistake in the command line or in what it names: one ``aoprim: ...`` line, exit 2
    (``told``: a supervised child said it on its status pipe; its supervisor prints it)."""
    told = False


class _Stop(BaseException):
    """SIGINT/SIGTERM before the server installs its own handlers (start-up: loading the
    handler, building and preparing the server).  A BaseException, like KeyboardInterrupt:
    raised wherever the signal lands, it must not be caught by an ``except Exception`` on
    the way -- logging's emit reported it as a logging error and the stop was lost (a
    --procs sibling stopped while starting served on until it was killed)."""


_STOP_PID = 0          # the process that put _raise_stop in place (main())


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    """SIGINT/SIGTERM in the serving process: :class:`_Stop`.  A process forked from it gets
    plain handlers at the fork (``_plain_signals_in_forks``); one forked where no fork hook
    runs (C code's own fork()) still has this handler, and there the signal acts as in a
    plain Python program: SIGTERM's default action (the handler is put back to it and the
    signal raised again), SIGINT a KeyboardInterrupt -- never a ``_Stop`` traceback or a
    stop raised into the server."""
    if os.getpid() == _STOP_PID:
        raise _Stop()
    as_plain_python(signum)


_FORK_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT})
_forking = threading.local()        # the forking thread's signal mask before the fork
_fork_hooks_in_place = False        # registered once per process (they cannot be removed)


def _plain_signals_in_forks() -> None:
    """In every process forked from this one (a ``fork`` multiprocessing Pool's workers,
    made at import or while serving; a handler's ``os.fork()``), SIGINT and SIGTERM act
    as in a plain Python program from the fork on: SIGTERM's default action, SIGINT
    Python's KeyboardInterrupt, no signal wake-up fd; SIGHUP and SIGQUIT, which serve
    takes as SIGTERM (``_forward_to_sigterm``), get their default action back.  SIGTERM
    must be the kernel's default, not a Python handler that acts as it: a Python handler
    runs only once the interpreter looks, and a signal that lands while the process is
    inside a C call that retries on its own (a Pool worker's ``sem_wait`` woken and going
    back to sleep) is never looked at -- the Pool's finalizer, which ends its workers with
    SIGTERM and then joins them, would wait forever.  The four signals are blocked in the
    forking thread across the fork, so one sent to the new process before its handlers are
    reset waits (pending) and gets the default action once they are."""

    def before() -> None:
        _forking.mask = signal.pthread_sigmask(signal.SIG_BLOCK, _FORK_SIGNALS)

    def unblock() -> None:
        mask = getattr(_forking, "mask", None)
        _forking.mask = None
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def in_child() -> None:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            for sig in (signal.SIGHUP, signal.SIGQUIT):
                if signal.getsignal(sig) is _forward_to_sigterm:
                    signal.signal(sig, signal.SIG_DFL)
            signal.set_wakeup_fd(-1)
        except (ValueError, OSError):   # (not the main thread: as_plain_python stays)
            pass
        unblock()

    global _fork_hooks_in_place
    if _fork_hooks_in_place:
        return      # (a second set would save the mask the first had already blocked)
    _fork_hooks_in_place = True
    os.register_at_fork(before=before, after_in_parent=unblock, after_in_child=in_child)


def _stop_on_signals() -> None:
    """Until the server installs its own handlers, SIGINT/SIGTERM end the process quietly;
    SIGHUP and SIGQUIT act as SIGTERM from here on (``_stop_also_on_hup_and_quit``)."""
    global _STOP_PID
    _STOP_PID = os.getpid()
    signal.signal(signal.SIGINT, _raise_stop)
    signal.signal(signal.SIGTERM, _raise_stop)
    _stop_also_on_hup_and_quit()


# -- loading the user's handler -------------------------------------------------------------

def _raised_by_aoprim(exc: BaseException) -> bool:
    """``exc`` was raised in aoprim's own code (a call with the wrong arguments, a handler
    aoprim refuses): its message says what is wrong, where is of no use."""
    tb = traceback.extract_tb(exc.__traceback__)
    return not tb or os.path.abspath(tb[-1].filename).startswith(_AOPRIM_DIR)


def _describe(exc: BaseException) -> str:
    """``Type: message (file:line)``, the line being where it was raised; an exception that
    is not an ``Exception`` (``SystemExit``, ``KeyboardInterrupt``) as ``Type(args)``, its
    message being often empty or a bare status (``SystemExit(0)``, ``SystemExit(None)``)."""
    if isinstance(exc, SystemExit):
        text = f"SystemExit({exc.code!r})"
    elif not isinstance(exc, Exception):
        text = f"{type(exc).__name__}({', '.join(map(repr, exc.args))})"
    else:
        text = f"{type(exc).__name__}: {exc}"
    tb = traceback.extract_tb(exc.__traceback__)
    # where it was raised, unless that is aoprim's own code or a SyntaxError (which names
    # its own line)
    if not _raised_by_aoprim(exc) and not isinstance(exc, SyntaxError):
        text += f" ({tb[-1].filename}:{tb[-1].lineno})"
    return text


def _reason(exc: BaseException) -> str:
    """The one-line text of a configuration error: an ``OSError``'s own message without its
    ``[Errno N]`` prefix (the messages of listener.py and tls.py name the address or file
    themselves)."""
    if isinstance(exc, OSError) and exc.strerror and exc.filename is None:
        return exc.strerror
    return str(exc)


def _put_on_path(app_dir: str) -> None:
    """Make ``app_dir`` importable, first, as uvicorn does.  aoprim itself is imported by now,
    so a checkout's uncompiled aoprim/ in that folder cannot shadow the built package.  A
    relative ``app_dir`` in a working directory that was deleted (a deploy pruned the release
    directory the service started in; each --procs restart meets it) is a UsageError."""
    try:
        want = os.path.abspath(app_dir)
        there = any(os.path.abspath(p or os.curdir) == want for p in sys.path[:1])
    except OSError as e:               # (getcwd: ENOENT)
        raise UsageError(f"--app-dir {app_dir!r} is relative to the working directory, which "
                         f"is gone ({e.strerror}): start in a directory that exists or give "
                         "--app-dir as an absolute path") from None
    if not there:
        sys.path.insert(0, want)


def split_spec(spec: str) -> tuple[str, str]:
    """``MODULE:ATTR`` -> (MODULE, ATTR); UsageError if it is not of that form."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise UsageError(f"{spec!r} is not MODULE:HANDLER (for example mypkg.game:GameHandler)")
    return mod_name, attr


def load_handler(spec: str) -> Handler:
    """The handler that ``MODULE:ATTR`` names (see the module docstring).  Raises UsageError
    with a one-line reason."""
    mod_name, attr = split_spec(spec)
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name and (mod_name == e.name or mod_name.startswith(e.name + ".")):
            raise UsageError(f"cannot import {mod_name!r} for {spec}: no module named "
                             f"{e.name!r} (looked in {sys.path[0]!r} first)") from None
        raise UsageError(f"importing {mod_name!r} failed: {_describe(e)}") from None
    except _Stop:                                   # a real SIGINT/SIGTERM: a quiet exit 0
        raise
    except BaseException as e:                      # the module's own error, whatever it is
        # a KeyboardInterrupt or SystemExit(0) raised by the module (one that runs a CLI or
        # a prompt at import) is a failure to load it, not a stop: a real stop signal
        # arrives as _Stop
        raise UsageError(f"importing {mod_name!r} failed: {_describe(e)}") from None
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise UsageError(f"module {mod_name!r} has no attribute {attr!r}") from None
    if callable(obj) and not isinstance(obj, type) and \
            any(not callable(getattr(obj, h, None)) for h in HOOKS):
        # a factory (a function, not a handler itself): called with no arguments, and what
        # it returns is taken by Server's rule
        try:
            obj = obj()
        except _Stop:
            raise
        except BaseException as e:
            raise UsageError(f"{spec}() raised {_describe(e)}") from None
        spec += "()"
    # Server's own rule (as_handler): a handler object as it is, a class instantiated with
    # no arguments, anything else refused
    try:
        return as_handler(obj)
    except TypeError as e:
        if _raised_by_aoprim(e):            # refused: the message says why
            raise UsageError(f"{spec}: {e}") from None
        raise UsageError(f"{spec}() raised {_describe(e)}") from None
    except _Stop:
        raise
    except BaseException as e:
        raise UsageError(f"{spec}() raised {_describe(e)}") from None


# -- the parser -----------------------------------------------------------------------------

def _seconds_or_none(v: str) -> float | None:
    """A limit in seconds above 0, or ``none``/``off`` for no limit.  0 is refused, as
    ``Server()`` refuses it, whatever its spelling (``0``, ``0.0``): it is not a way to say
    "no limit"."""
    if v.lower() in ("none", "off"):
        return None
    try:
        x = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {v!r}") from None
    if not x > 0 or x == math.inf:
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds above 0 ('none' or 'off' for no limit), not {v!r}")
    return x


def _seconds_bounded(none_ok: bool) -> Callable[[str], float | None]:
    """An option's type: a number of seconds above 0 and at most a day (the supervisor's
    check_seconds); with ``none_ok``, ``none`` for no limit."""
    def parse(v: str) -> float | None:
        if none_ok and v.lower() in ("none", "off"):
            return None
        try:
            return check_seconds("it", v)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).replace("it must", "must")) from None
    return parse


def _port(v: str) -> int:
    try:
        return check_port(int(v))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e) if "port" in str(e)
                                         else f"not a port number: {v!r}") from None


def _seconds_text(v: float | None) -> str:
    return "none" if v is None else repr(v)


class _ServeOptions:
    """The ``serve`` options, recorded as they are added, so that a supervisor can hand its
    children the same settings (``argv``) without parsing its own command line again."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser
        # (dest, flag, to_text or None for a store_true flag)
        self.flags: list[tuple[str, str, Callable[[Any], str] | None]] = []

    def add(self, flag: str, *, text: Callable[[Any], str] = str, **kw: Any) -> None:
        act = self.parser.add_argument(flag, **kw)
        self.flags.append((act.dest, flag, None if kw.get("action") == "store_true" else text))

    def argv(self, ns: argparse.Namespace, **override: Any) -> list[str]:
        out: list[str] = []
        for dest, flag, text in self.flags:
            v = override.get(dest, getattr(ns, dest))
            if text is None:
                if v:
                    out.append(flag)
            elif isinstance(v, list):         # a repeatable option (action="append")
                for item in v:
                    out += _option(flag, text(item))
            elif v is not None:
                out += _option(flag, text(v))
        return out


def _option(flag: str, value: str) -> list[str]:
    """``flag`` and its ``value`` as a command line's arguments: one, ``--flag=value``, for a
    value that starts with ``-`` (``--app-dir=-apps``), which argparse would otherwise take
    for an option (``--app-dir: expected one argument``); else two."""
    return [f"{flag}={value}"] if value.startswith("-") else [flag, value]


class CommandParser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too: add_subparsers makes them of this class),
    whose errors -- a bad ``--port``, an unknown option -- are one ``aoprim: --port: ...``
    line and exit 2, as every other configuration error is, instead of the usage block
    (``--help`` shows that)."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("argument "):         # "argument --port: ..."
            message = message[len("argument "):]
        self.exit(2, f"aoprim: {message}\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """A ``python -m aoprim`` parser with the ``serve`` command only (aoprim.cli.build_parser
    adds the other commands); ``only``, the command about to run, can only be ``serve``
    here."""
    p = CommandParser(prog="python -m aoprim",
                      description="aoprim's server and its load generator")
    add_serve_command(p.add_subparsers(dest="cmd", required=True, metavar="COMMAND"))
    return p


def add_serve_command(sub: Any) -> argparse.ArgumentParser:
    """Add ``serve`` and its options to ``sub`` (the action ``add_subparsers`` returned)."""
    s: argparse.ArgumentParser = sub.add_parser(
        "serve", help="run the server: your handler (MODULE:HANDLER) or a built-in app",
        description="Serve MODULE:HANDLER (a Handler subclass, a Handler instance or a "
                    "factory returning a handler), or a built-in app (--app).")
    s.add_argument("handler", nargs="?", metavar="MODULE:HANDLER",
                   help="your handler, imported from MODULE (--app-dir is importable); "
                        "default: none, the built-in --app is served")
    o = _ServeOptions(s)
    o.add("--app", choices=sorted(BUILTIN_APPS), default=None,
          help="a built-in app, when no MODULE:HANDLER is given (default: echo)")
    o.add("--app-dir", default=".",
          help="directory put first on sys.path to import MODULE (default: %(default)s)")
    o.add("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    o.add("--port", type=_port, default=8888, help="port; 0 picks a free one (default: %(default)s)")
    o.add("--framing", choices=FRAMINGS, default=DEFAULTS["framing"],
          help="raw bytes, or a u16/u32 big-endian length before each frame "
               "(default: %(default)s)")
    o.add("--workers", type=int, default=DEFAULTS["workers"],
          help="threads running on_read; 0 runs it on the loop thread (default: %(default)s)")
    o.add("--procs", type=int, default=1,
          help="server processes sharing the port (SO_REUSEPORT) under a supervisor "
               "(default: %(default)s)")
    o.add("--max-frame", type=int, default=DEFAULTS["max_frame"],
          help="largest u16/u32 frame accepted, bytes (default: %(default)s)")
    o.add("--idle-timeout", type=_seconds_or_none, default=DEFAULTS["idle_timeout"],
          text=_seconds_text,
          help="close a session silent this many seconds; 'none' for never "
               "(default: %(default)s)")
    o.add("--frame-timeout", type=_seconds_or_none, default=DEFAULTS["frame_timeout"],
          text=_seconds_text,
          help="seconds a begun frame may take to complete; 'none' for no limit "
               "(default: %(default)s)")
    o.add("--max-connections", type=int, default=DEFAULTS["max_connections"],
          help="open sessions at most (default: %(default)s)")
    o.add("--max-pending", type=int, default=DEFAULTS["max_pending"],
          help="unsent bytes per session before it is cut off (default: %(default)s)")
    o.add("--backend", choices=BACKENDS, default=DEFAULTS["backend"],
          help="the event loop backend (default: %(default)s)")
    o.add("--proxy-protocol", choices=[m for m in PROXY_MODES if m], default=None,
          help="behind a load balancer: every connection starts with a PROXY protocol "
               "header of this version, and a session's peer is the client's address from "
               "it (default: off)")
    o.add("--trusted-proxy", action="append", default=None, metavar="NET",
          help="a network allowed to connect and send the PROXY header, e.g. 10.0.0.0/8; "
               "repeat for more (default: " +
               ", ".join(str(n) for n in DEFAULTS["trusted_proxies"]) + ")")
    o.add("--proxy-max-header", type=int, default=DEFAULTS["proxy_max_header"],
          help="longest PROXY header accepted, bytes, 232..65551 (default: %(default)s)")
    o.add("--proxy-header-timeout", type=_seconds_or_none,
          default=DEFAULTS["proxy_header_timeout"], text=_seconds_text,
          help="seconds a connection has, from its accept, to complete its PROXY header; "
               "'none' for no limit (default: %(default)s)")
    o.add("--certfile", default=None, metavar="F",
          help="TLS: serve TLS with this PEM certificate chain (default: plain TCP)")
    o.add("--keyfile", default=None, metavar="F",
          help="TLS: the certificate's PEM private key (default: in --certfile)")
    o.add("--ca-certs", default=None, metavar="F",
          help="TLS: PEM CA certificates that client certificates are verified against "
               "(default: none)")
    o.add("--client-cert", choices=("none", "optional", "required"), default="none",
          help="TLS: ask for a client certificate (verified with --ca-certs) "
               "(default: %(default)s)")
    o.add("--handshake-timeout", type=float, default=DEFAULTS["handshake_timeout"],
          help="TLS: seconds from the accept to a completed handshake (the PROXY header, "
               "when on, included) (default: %(default)s)")
    o.add("--log-level", type=str.upper, choices=LOG_LEVELS, default="INFO",
          help="stderr log level (default: %(default)s)")
    o.add("--stats-json", action="store_true",
          help="at shutdown, also print the whole stats() dict as one 'stats {...}' JSON "
               "line on stdout, for programs; the log's one readable summary line is "
               "there either way (default: off)")
    o.add("--start-timeout", type=_seconds_bounded(True), default=None, metavar="S",
          text=_seconds_text,
          help="--procs: seconds the server processes have to start and listen before the "
               "supervisor gives up (exit 1); a restarted one that takes longer is killed "
               "and restarted again after the back-off; 'none' waits as long as they are "
               "alive, as serve alone does (default: none)")
    o.add("--stop-timeout", type=_seconds_bounded(False), default=15.0, metavar="S",
          help="seconds a stop (SIGINT/SIGTERM) may take; then what has not stopped is "
               "killed (--procs) or the process exits (alone), with status 1 "
               "(default: %(default)s)")
    o.add("--backoff-max", type=_seconds_bounded(False), default=30.0, metavar="S",
          help="--procs: the longest wait before a crashed server process is restarted "
               "(the wait doubles from 0.5 s up to this) (default: %(default)s)")
    o.add("--reuse-port", action="store_true", help=argparse.SUPPRESS)   # a supervised child
    # a supervised child: its status pipe to the supervisor (supervisor.py)
    o.add("--status-fd", type=int, default=None, help=argparse.SUPPRESS)
    s.set_defaults(child_argv=o.argv)
    return s


# -- serving --------------------------------------------------------------------------------

def _check_choice(a: argparse.Namespace) -> None:
    if a.handler is not None and a.app is not None:
        raise UsageError(f"give MODULE:HANDLER ({a.handler}) or --app {a.app}, not both")
    if a.procs < 1:
        raise UsageError("--procs must be >= 1")
    most, why = _max_procs()
    if a.procs > most:
        raise UsageError(f"--procs {a.procs} is more than this supervisor can start: at most "
                         f"{most} ({why})")


def _max_procs() -> tuple[int, str]:
    """The most server processes a supervisor can start, and why: the user's process limit
    (RLIMIT_NPROC, which this user's other processes share; not root's) and the
    supervisor's fds (two pipes a child, RLIMIT_NOFILE, a few kept for itself)."""
    import resource
    bounds = [(sys.maxsize, "no limit")]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    # (the kernel does not hold root -- CAP_SYS_RESOURCE/CAP_SYS_ADMIN -- to RLIMIT_NPROC)
    if nproc != resource.RLIM_INFINITY and os.geteuid() != 0:
        bounds.append((nproc, f"RLIMIT_NPROC {nproc}"))
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if nofile != resource.RLIM_INFINITY:
        bounds.append((max(1, (nofile - 32) // 2),
                       f"RLIMIT_NOFILE {nofile}: two pipes a process"))
    return min(bounds)


def _settings(a: argparse.Namespace) -> dict[str, Any]:
    """The Server keyword arguments the options give (host and port aside).  The
    server's ``shutdown_timeout`` is a third of ``--stop-timeout`` (5 s of the default 15):
    its graceful shutdown takes at most that, then the workers get as long again to exit,
    all inside the stop's bound -- an operator who gives the stop more time gives the
    requests in progress more too."""
    return dict(shutdown_timeout=a.stop_timeout / 3, framing=a.framing, max_frame=a.max_frame, max_connections=a.max_connections,
                max_pending=a.max_pending, idle_timeout=a.idle_timeout,
                frame_timeout=a.frame_timeout, workers=a.workers, backend=a.backend,
                reuse_port=a.reuse_port, proxy_protocol=a.proxy_protocol,
                proxy_max_header=a.proxy_max_header,
                proxy_header_timeout=a.proxy_header_timeout,
                trusted_proxies=(tuple(a.trusted_proxy) if a.trusted_proxy
                                 else DEFAULTS["trusted_proxies"]),
                ssl=_ssl_context(a), handshake_timeout=a.handshake_timeout)


def _ssl_context(a: argparse.Namespace) -> ssl.SSLContext | None:
    """The TLS options as a server ``ssl.SSLContext`` (None without --certfile); a usage
    error for options that do not go together or files that do not load."""
    if a.certfile is None:
        if a.keyfile or a.ca_certs or a.client_cert != "none":
            raise UsageError("--keyfile, --ca-certs and --client-cert need --certfile")
        return None
    if a.client_cert != "none" and not a.ca_certs:
        raise UsageError(f"--client-cert {a.client_cert} needs --ca-certs (the CAs client "
                         "certificates are verified against)")
    from .tls import server_context
    try:
        return server_context(a.certfile, a.keyfile, a.ca_certs, a.client_cert)
    except (OSError, ValueError) as e:      # (ssl.SSLError is an OSError)
        raise UsageError(f"TLS: {_reason(e)}") from None


def _check_settings(a: argparse.Namespace) -> None:
    """Validate the settings as the server will (UsageError): once, in the supervisor,
    before any child starts -- not once per child."""
    kw = _settings(a)
    kw.pop("reuse_port")
    try:
        Settings(**kw)
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None


def _print_stats(srv: Server) -> None:
    """The final ``stats {...}`` line (``--stats-json``).  A reader that went away (a killed
    --procs supervisor) costs the line, not a traceback: stdout is pointed at /dev/null, so
    the interpreter's own flush at exit does not fail either."""
    try:
        print("stats " + json.dumps(srv.stats()), flush=True)
    except (BrokenPipeError, ValueError):
        _stdout_to_devnull()
    except OSError as e:
        # a full disk, an I/O error: the line is lost, the stop is still a clean one
        log.warning("stdout cannot be written (%s): the stats line is lost", e.strerror or e)
        _stdout_to_devnull()


def _stdout_to_devnull() -> None:
    """Point fd 1 at /dev/null: the interpreter's flush at exit then writes what is left
    there instead of failing again ("Exception ignored ... BrokenPipeError")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


# bytes of a usage message sent on the status pipe, at most: well under a pipe's 64 KiB, so
# the child's write never waits for the supervisor (which keeps this much of what a child
# says); a longer message is cut, with a mark that says so
_USAGE_MAX = 16384


def _json_word(text: str) -> bytes:
    try:
        return USAGE + json.dumps(text, ensure_ascii=False).encode()
    except UnicodeEncodeError:         # a lone surrogate (an undecodable file name): escaped
        return USAGE + json.dumps(text).encode()


def _usage_word(message: str) -> bytes:
    """``usage "MESSAGE"`` for the status pipe: the message as a JSON string in UTF-8
    (``ensure_ascii=False``: a Cyrillic or CJK character is its 2-3 bytes, not a
    6-byte ``\\uXXXX``), at most _USAGE_MAX bytes; a longer one is cut at a character's
    boundary and ends with `` ... (N more characters cut)``."""
    word = _json_word(message)
    if len(word) <= _USAGE_MAX:
        return word
    # the longest start whose JSON fits, mark included (each character is 1 to 12 bytes)
    keep, lo, hi = _json_word(""), 0, len(message)
    while lo <= hi:
        mid = (lo + hi) // 2
        text = f"{message[:mid]} ... ({len(message) - mid} more characters cut)"
        cand = _json_word(text)
        if len(cand) <= _USAGE_MAX:
            keep, lo = cand, mid + 1
        else:
            hi = mid - 1
    return keep


class _StatusPipe:
    """The supervisor's status pipe (``--status-fd``), kept out of the handler's way: the
    inherited fd is moved to a high number, close-on-exec, and its number is taken out of
    ``sys.argv``, so handler code does not find it by chance, nor do the processes it starts.
    The pipe's identity (device, inode) is recorded: a word is written only while the fd is
    still that pipe, so a handler that closed the fd and opened a file of its own under the
    number does not get ``stopped`` written into its file."""

    def __init__(self, fd: int) -> None:
        try:
            st = os.fstat(fd)
            if not stat.S_ISFIFO(st.st_mode):
                raise OSError(errno.EINVAL, "not a pipe")
            try:
                high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 256)
            except OSError:                # RLIMIT_NOFILE below 257: any free number
                high = os.dup(fd)          # (close-on-exec: Python's fds are not inheritable)
            os.close(fd)
        except OSError as e:
            raise UsageError(f"--status-fd {fd}: {_reason(e)}") from None
        self.fd = high
        self._id = (st.st_dev, st.st_ino)
        _drop_status_fd_arg(sys.argv)

    def is_open(self) -> bool:
        """Whether the fd is still the supervisor's pipe."""
        try:
            st = os.fstat(self.fd)
        except OSError:
            return False
        return stat.S_ISFIFO(st.st_mode) and (st.st_dev, st.st_ino) == self._id

    def tell(self, word: bytes) -> bool:
        """Write ``word``; False if the pipe is gone (or the fd is no longer that pipe)."""
        if not self.is_open():
            return False
        data = word + b"\n"
        try:
            while data:                # (a pipe takes a long word in parts)
                data = data[os.write(self.fd, data):]
        except OSError:
            return False
        return True


def _drop_status_fd_arg(argv: list[str]) -> None:
    """Remove ``--status-fd N`` (or ``--status-fd=N``) from ``argv`` in place."""
    i = 0
    while i < len(argv):
        if argv[i] == "--status-fd":
            del argv[i:i + 2]
        elif argv[i].startswith("--status-fd="):
            del argv[i]
        else:
            i += 1


def _tell(pipe: _StatusPipe | None, word: bytes) -> bool:
    """Write ``word`` on the supervisor's status pipe; False if it is gone."""
    return True if pipe is None else pipe.tell(word)


def _hide_in_forks(status: _StatusPipe) -> None:
    """In a process forked from this one by handler code (a ``fork`` multiprocessing worker,
    ``os.fork()``), put ``/dev/null`` in place of the status pipe -- while its fd is still
    that pipe: a number the handler reused is the handler's.  (The server hides its
    listening socket and its loop's fds itself, those it still has at the fork: see
    aoprim.server.server; the signals are ``_plain_signals_in_forks``'.)  A forked process
    that outlives this one must not be able to tell the supervisor anything.
    ``/dev/null`` rather than close(): the Python object copied into the fork still owns
    that number, and its close() must not close an fd the fork opened meanwhile.  A
    subprocess (fork + exec) loses it by close-on-exec anyway."""

    def after_in_child() -> None:
        if status.is_open():
            hide_with_devnull({status.fd})      # (at the fd limit too)

    os.register_at_fork(after_in_child=after_in_child)


class _StopWatchdog:
    """``serve``'s bound on its own stop: once armed (a stop signal, or the end of serving),
    the process exits with status 1 if it has not ended ``seconds`` later.  The serving
    process's stdout is the user's and is written as any program's is: a handler whose
    ``print()`` meets a pipe nobody reads blocks there, on the loop thread or a worker,
    and the shutdown that SIGTERM starts could never run; this thread ends the process
    instead (one line on stderr, written by a thread of its own so that a stalled stderr
    cannot hold it either).  A daemon thread: a process that ended in time is not kept.
    Its thread starts when it is armed, not before: a process with a second thread is
    multi-threaded, and CPython 3.12+ warns at every ``fork()`` a handler makes
    (``DeprecationWarning: This process ... is multi-threaded``).  A server at its thread
    limit (its workers took what RLIMIT_NPROC or a pids cgroup allows) can start no thread
    at the stop, which must not need one: the kernel then keeps the bound instead --
    SIGALRM at its default action after ``seconds`` (``setitimer``), which kills the
    process if it has not ended (one log line says so)."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._armed = False
        self._why = ""
        self.deadline = math.inf          # monotonic time it ends the process at, once armed
        self.before_exit: Callable[[], None] | None = None   # run just before it does
        self.ended = False                # serving and its last output are done: what is
                                          # left is the interpreter's exit

    def arm(self, why: str) -> None:
        """Start the count (once): called by the stop signals' handler, on the main thread,
        and by the end of serving.  ``_armed`` is set first, so a signal that lands inside
        this call (its handler calls it again) returns at once.  The thread is started with
        ``_thread``, which takes none of ``threading``'s locks: this runs in a signal
        handler, which may have interrupted the main thread while it held one."""
        if not self._armed:
            self._armed = True
            self.deadline = time.monotonic() + self._seconds
            self._why = why
            try:
                _thread.start_new_thread(self._run, ())
            except RuntimeError as e:      # "can't start new thread": at its thread limit
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                signal.setitimer(signal.ITIMER_REAL, self._seconds)
                log.warning("cannot start the stop's watchdog thread (%s): if the server "
                            "has not stopped %g s after %s, SIGALRM kills it", e,
                            self._seconds, why)

    def _run(self) -> None:
        time.sleep(max(0.0, self.deadline - time.monotonic()))
        why = self._why
        msg = (f"aoprim: the server did not stop within {self._seconds:g} s of {why} "
               f"({self._blocker(self.ended)}): exiting with status 1\n").encode()
        say = threading.Thread(target=_write_all, args=(2, msg), daemon=True)
        try:
            say.start()
        except RuntimeError:
            # the interpreter is finalizing (it waits for non-daemon threads), where Python
            # 3.12+ starts no thread: written here, once stderr can take it within 1 s (a
            # line under PIPE_BUF: a pipe that polls writable takes it whole, at once)
            _write_if_ready(2, msg[:select.PIPE_BUF], 1.0)
        else:
            say.join(1.0)
        if self.before_exit is not None:
            self.before_exit()
        os._exit(1)

    @staticmethod
    def _blocker(ended: bool) -> str:
        """What holds the process, as far as it can tell: once serving ended, the non-daemon
        threads a handler started that still run (the interpreter waits for them at exit);
        else a thread of the server's that is blocked."""
        names = [t.name for t in threading.enumerate()
                 if not t.daemon and t is not threading.main_thread() and t.is_alive()]
        if ended and names:
            return (f"non-daemon threads still run, which the interpreter waits for at exit: "
                    f"{', '.join(repr(n) for n in names[:5])}"
                    + (f" and {len(names) - 5} more" if len(names) > 5 else "")
                    + "; a handler's background thread should be a daemon or be ended "
                    "in on_close")
        return ("a thread of it is blocked: a handler that does not return, or that writes to "
                "a stdout nobody reads")


def _write_if_ready(fd: int, data: bytes, seconds: float) -> None:
    try:
        if select.select([], [fd], [], seconds)[1]:
            os.write(fd, data)
    except (OSError, ValueError):
        pass


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        pass


class _Heirs:
    """What a supervised child started -- its process group, which the supervisor made it
    the leader of -- when the supervisor is gone (killed, even with SIGKILL: the child got
    its death signal, SIGTERM).  The supervisor would have signalled the group, waited
    ``--stop-timeout`` and killed what was left; with no supervisor the child does it: its
    stop signal is passed on to the group (``stop()``), and before the child exits what is
    still there is waited for until ``deadline`` and then killed (``finish()``)."""

    def __init__(self, supervisor: int) -> None:
        self._supervisor = supervisor      # the parent's pid at start: the supervisor
        self._signalled = False

    def _orphaned(self) -> bool:
        # a group of its own only: a ``serve --status-fd`` started by hand is no leader,
        # and its process group is not its to stop
        return os.getppid() != self._supervisor and os.getpgrp() == os.getpid()

    def stop(self, sig: int) -> None:
        """Pass ``sig`` on to the rest of the group if the supervisor is gone (in the main
        thread: a signal handler, or after serving)."""
        if self._signalled or not self._orphaned():
            return
        self._signalled = True
        # ignored here while it is sent: this process is stopping already, and a second
        # stop signal is not to reach it (an ignored signal is discarded when sent)
        prev = signal.signal(sig, signal.SIG_IGN)
        try:
            os.killpg(0, sig)
        except OSError:
            pass
        finally:
            signal.signal(sig, prev)

    def others(self) -> list[int]:
        """The live processes of the group other than this one (from /proc)."""
        me = os.getpid()
        return [pid for pid in group_members(me) or () if pid != me]

    def kill_rest(self) -> None:
        if self._signalled:
            for pid in self.others():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def finish(self, deadline: float) -> None:
        """Before the child exits: with the supervisor gone, the group gets SIGTERM (if it
        got no stop signal yet), is waited for until ``deadline``, and what is left is
        killed."""
        self.stop(signal.SIGTERM)
        if not self._signalled:
            return
        while self.others() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.kill_rest()


def _watch_stop_signals(watchdog: _StopWatchdog, heirs: _Heirs | None = None) -> None:
    """Arm ``watchdog`` when SIGINT/SIGTERM arrives (SIGHUP/SIGQUIT too: they reach
    SIGTERM's handler, ``_forward_to_sigterm``), before the handler in place (the server's,
    which starts the shutdown) runs; pass the signal on to ``heirs`` (what a supervised
    child started) if its supervisor is gone."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        prev = signal.getsignal(sig)
        if not callable(prev):
            continue

        def on_stop(signum: int, frame: FrameType | None, prev: Callable[..., Any] = prev
                    ) -> None:
            watchdog.arm(signal.Signals(signum).name)
            if heirs is not None:
                heirs.stop(signum)
            prev(signum, frame)
        signal.signal(sig, on_stop)


def _forward_to_sigterm(signum: int, frame: FrameType | None) -> None:
    """SIGHUP or SIGQUIT: what SIGTERM's handler in place does, told by its own name --
    ``_raise_stop`` while starting, the server's stop while serving (armed by
    ``_watch_stop_signals``), nothing once the stop began (SIGTERM is then ignored)."""
    handler = signal.getsignal(signal.SIGTERM)
    if callable(handler):
        handler(signum, frame)


def _stop_also_on_hup_and_quit() -> None:
    """``serve`` -- alone or a ``--procs`` child -- stops on SIGHUP (the terminal hung up,
    ``kill -HUP``, ``pkill -HUP``, systemd's ``SendSIGHUP=yes``) and SIGQUIT as on SIGTERM,
    from the start of ``main()`` to its end: a clean stop, its stats line, replies in
    flight sent, exit 0, no core file, and under ``--procs`` the same word to the
    supervisor (``stopped``) as for SIGTERM -- as a ``--procs`` supervisor stops on them.
    One ignored at the start (``nohup``, a background job's SIGQUIT; a supervisor started
    so passes the ignore on to its children) stays ignored, and one with a handler of its
    own (the handler's module puts it there at import) is left to it."""
    for sig in (signal.SIGHUP, signal.SIGQUIT):
        if signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, _forward_to_sigterm)


def _serve_one(a: argparse.Namespace) -> int:
    status = _StatusPipe(a.status_fd) if a.status_fd is not None else None
    try:
        return _serve(a, status)
    except UsageError as e:
        # a supervised child tells its supervisor, which prints it once for all its
        # children (N children that fail alike are one line, not N); the child prints it
        # itself only if the supervisor is gone
        if status is not None and status.tell(_usage_word(str(e))):
            e.told = True
        raise


def _serve(a: argparse.Namespace, status: _StatusPipe | None) -> int:
    # a supervised child: what it starts is stopped with it if the supervisor dies
    heirs = _Heirs(os.getppid()) if status is not None else None
    _plain_signals_in_forks()           # (before the handler's module can fork)
    try:
        if a.handler is not None:
            _put_on_path(a.app_dir)
            handler = load_handler(a.handler)
        else:
            handler = load_handler(BUILTIN_APPS[a.app or "echo"])
    except _Stop:
        # stopped while the handler's module loads: what its import started goes too
        if heirs is not None:
            heirs.finish(time.monotonic() + a.stop_timeout)
        raise
    watchdog = _StopWatchdog(a.stop_timeout)
    if heirs is not None:
        watchdog.before_exit = heirs.kill_rest
    try:
        srv = Server(handler, a.host, a.port, **_settings(a))
    except (ValueError, TypeError, OSError, BackendUnavailable) as e:
        raise UsageError(_reason(e)) from None
    host, port = srv.address[:2]
    failed = []

    def announce() -> None:
        # run by the loop's first callback, before any accept (so before any handler code):
        # once it is out, the loop runs (its signal wake-up pipe exists: the process's fds
        # are those it serves with).  A supervised child says it on its status pipe only.
        if status is not None:
            # before handler code runs
            _hide_in_forks(status)
        # (serve_forever has put its signal handlers in place by now: the loop runs)
        _watch_stop_signals(watchdog, heirs)
        try:
            if status is None:
                print(f"listening on {describe_address((host, port))}", flush=True)
            elif not _tell(status, b"ready"):
                raise BrokenPipeError
        except BrokenPipeError:
            failed.append(True)
            srv.shutdown()              # (on the loop thread: starts the shutdown)
        except OSError as e:
            # a full disk, an I/O error on stdout: serving goes on (as under --procs), and
            # what it prints is dropped from here on (pointed at /dev/null: the line left
            # in the stream's buffer would fail every later write, and the exit's flush)
            log.warning("stdout cannot be written (%s): what serve prints there is dropped; "
                        "serving goes on", e.strerror or e)
            _stdout_to_devnull()

    srv.loop.call_soon(announce)
    serving_pid = os.getpid()
    try:
        try:
            srv.serve_forever()
        except ThreadLimitError as e:
            # (its start gave back what it took; one line, as for a port already in use)
            raise UsageError(f"--workers {a.workers}: {e}") from None
    except (SystemExit, KeyboardInterrupt) as e:
        if os.getpid() != serving_pid:
            # a handler's fork ending itself (sys.exit in the child): the fork's own exit,
            # with its own status -- nothing of the server's stop runs there
            raise
        # raised by a handler on the loop thread (SIGINT/SIGTERM only start a clean shutdown
        # while serve_forever runs): the server stopped because of it, which is a failure
        # whatever status it carries -- a handler must not end the process as if told to
        # stop (0) or as if the settings were wrong (2); or serve_forever's own at a second
        # Ctrl-C while a handler held the loop (logged there)
        if isinstance(e, KeyboardInterrupt) and e.args == (CTRL_C_TWICE,):
            log.error("interrupted by a second Ctrl-C while a handler held the loop: the "
                      "server stopped (exit status 1)")
        else:
            log.error("a handler raised %s while serving: the server stopped (exit status "
                      "1)", f"{type(e).__name__}({', '.join(map(repr, e.args))})")
        failed.append(True)
    finally:
        if os.getpid() == serving_pid:          # (a fork leaving: none of this is its)
            # the stop began: a second stop signal (systemd signals every process of the
            # service, SIGTERM and then SIGHUP with SendSIGHUP=yes, and the supervisor
            # forwards its own) must neither interrupt the rest nor kill the process while
            # the interpreter finalizes (which puts back the default action of a signal
            # with a Python handler): ignored from here until exit (SIGHUP/SIGQUIT if they
            # are serve's, not the handler's module's)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            for sig in (signal.SIGHUP, signal.SIGQUIT):
                if signal.getsignal(sig) is _forward_to_sigterm:
                    signal.signal(sig, signal.SIG_IGN)
            # what is left -- the stats line, what handlers printed without flushing -- goes
            # to a stdout that may not be read: bounded too
            watchdog.arm("the end of serving")
            if heirs is not None:
                heirs.finish(watchdog.deadline)
    if not failed:
        _tell(status, b"stopped")    # told to stop, and done: not to be restarted
    if a.stats_json:
        _print_stats(srv)
    try:
        sys.stdout.flush()           # here, under the watchdog, not at interpreter exit
    except (OSError, ValueError, AttributeError):
        _stdout_to_devnull()         # gone (a reader that exited): no second failure at exit
    watchdog.ended = True            # what is left: the interpreter's exit (its threads)
    return 1 if failed else 0


def _interpreter_options() -> list[str]:
    """The options this interpreter was started with, for a child started with
    ``sys.executable``: ``-X dev``, ``-W ...``, ``-O``, ``-X gil=N`` and the rest that
    multiprocessing hands its children (``subprocess._args_from_interpreter_flags()``), and
    ``-u``, which that leaves out (no ``sys.flags`` field says it: under ``-u`` the standard
    streams have no buffer, their binary layer is the raw ``FileIO``)."""
    options = subprocess._args_from_interpreter_flags()    # type: ignore[attr-defined]
    std = sys.__stdout__ if sys.__stdout__ is not None else sys.__stderr__
    if isinstance(getattr(std, "buffer", None), io.FileIO):
        options.append("-u")
    return options


def _serve_procs(a: argparse.Namespace) -> int:
    if a.handler is not None:
        split_spec(a.handler)          # a malformed name fails once, before any child starts
    _check_settings(a)
    tail = [a.handler] if a.handler is not None else []
    # the children run under this interpreter's options (a handler's print() reaches the
    # log at once under -u; -X dev, -W error, -O, -X gil=0 hold for the handler's code)
    python = [sys.executable, *_interpreter_options()]

    def child_argv(port: int, status_fd: int) -> list[str]:
        return [*python, "-m", "aoprim", "serve",
                *a.child_argv(a, port=port, procs=1, reuse_port=True, status_fd=status_fd),
                *tail]

    sup = Supervisor(child_argv, a.procs, a.host, a.port, start_timeout=a.start_timeout,
                     stop_timeout=a.stop_timeout, backoff_max=a.backoff_max)
    # from here on a stop signal is the supervisor's (noted, never raised): _raise_stop,
    # which run() would put back when it returns, could raise a pending one anywhere on the
    # way out, even in a finalizer ("Exception ignored ... _Stop" on stderr).  A SIGHUP
    # or SIGQUIT ignored at the start (nohup) stays ignored, as with `serve` alone.
    for sig in stop_signals():
        signal.signal(sig, sup.on_signal)
    try:
        return sup.run()
    except OSError as e:
        if sup.address is not None:    # not the reservation: a failure of the supervisor's
            raise
        # the port cannot be reserved: in use (by anything, another --procs server
        # included: see supervisor.reserve_port), or not an address of this machine
        raise UsageError(_reason(listen_error(a.host, a.port, e))) from None
    finally:
        # every child is gone: a late signal must not kill the supervisor as it finalizes
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def _ignore(signum: int, frame: FrameType | None) -> None:
    pass


def main(argv: list[str] | None = None) -> int:
    _stop_on_signals()
    try:
        args = sys.argv[1:] if argv is None else list(argv)
        a = build_parser().parse_args(args)
        logging.basicConfig(level=a.log_level, stream=sys.stderr,
                            format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
        _check_choice(a)
        if a.procs > 1:
            return _serve_procs(a)
        return _serve_one(a)
    except (_Stop, KeyboardInterrupt):
        # stopped before serving (while the handler's module loads, or the server starts):
        # a non-daemon thread that import started must not hold the exit either
        _exit_past_threads(0)
        return 0
    except UsageError as e:
        # exiting anyway: a stop signal now (a --procs supervisor stopping this child's
        # siblings) must not interrupt the message with a traceback
        # (a no-op handler, not SIG_IGN, which children would inherit)
        signal.signal(signal.SIGINT, _ignore)
        signal.signal(signal.SIGTERM, _ignore)
        if not e.told:
            print(f"aoprim: {e}", file=sys.stderr, flush=True)
        _exit_past_threads(2)
        return 2


def _exit_past_threads(status: int) -> None:
    """Exit with ``status`` at once if a non-daemon thread other than the main one runs --
    one the handler's import started (a config watcher): the interpreter would wait for it
    at exit, for ever, with the stop signals ignored or already taken -- an exit before
    serving is not the handler's to hold.  (Else return: the normal exit follows.)"""
    if not _other_threads():
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(status)


def _other_threads() -> bool:
    """Whether a non-daemon thread other than the main one runs (the interpreter waits for
    it at exit)."""
    return any(not t.daemon and t is not threading.main_thread() and t.is_alive()
               for t in threading.enumerate())
