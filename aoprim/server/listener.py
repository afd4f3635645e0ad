"""Layer 2 -- the listener and its accept policy.

- Each readiness event accepts at most ``accept_batch`` connections (the loop stays fair to
  the sessions it already serves during a connection storm; level-triggered readiness calls
  again for the rest).
- At ``max_connections`` it stops accepting: new connections wait in the kernel's backlog
  (bounded by ``backlog``) until a session ends, instead of being accepted and closed.
- ``EMFILE``/``ENFILE``/``ENOBUFS``/``ENOMEM`` (out of descriptors or memory) pause accepting
  for 0.1 s; any other unexpected error pauses it with an exponential back-off (10 ms to 1 s)
  -- with level-triggered readiness, returning without pausing would spin.  Errors that
  concern only the one connection being accepted (``ECONNABORTED``, ``EPROTO``, ``EPERM``
  from a firewall) are skipped.
"""
from __future__ import annotations

import errno
import logging
import socket
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from .config import Settings
    from .loop import EventLoop, Timer

__all__ = ["Listener", "make_listening_socket", "check_port", "sock_address",
           "describe_address", "listen_error"]

log = logging.getLogger("aoprim.server")

_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_ONE_CONNECTION = {errno.ECONNABORTED, errno.EPROTO, errno.EPERM}


def check_port(port: object) -> int:
    """``port`` as an int in 0..65535 (0: the kernel picks one); TypeError/ValueError else
    (the kernel would silently take it modulo 65536)."""
    if isinstance(port, bool) or not isinstance(port, int):
        raise TypeError(f"port must be an int in 0..65535, not {type(port).__name__}")
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be in 0..65535 (0 picks a free one), not {port}")
    return port


def sock_address(sock: socket.socket) -> Any:
    """A listening socket's address: ``(host, port)``, or the path of an AF_UNIX one."""
    name = sock.getsockname()
    return tuple(name[:2]) if isinstance(name, tuple) else name


def describe_address(addr: Any) -> str:
    """``host:port`` (``[host]:port`` for IPv6), or an AF_UNIX path as it is."""
    if not isinstance(addr, tuple):
        return addr.decode(errors="replace") if isinstance(addr, bytes) else str(addr)
    host, port = addr[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _needs_scope(host: str | None) -> bool:
    """``host`` is a link-local IPv6 address without a ``%scope`` (the interface): the
    kernel cannot tell which link it is on, and bind() says only "invalid argument"."""
    import ipaddress
    try:
        return isinstance(host, str) and ipaddress.IPv6Address(host).is_link_local
    except ValueError:              # not an IPv6 address, or one with a scope already
        return False


def listen_error(host: str | None, port: int, exc: OSError) -> OSError:
    """The error to raise for ``exc``, an ``OSError`` from resolving, binding or listening on
    ``(host, port)``: same type and ``errno``, and a message that names the address and says
    what to do -- ``cannot listen on HOST:PORT: address already in use (...)``."""
    # an IPv6 address given in brackets (a URL's form, which no resolver takes) is named as
    # given, not bracketed twice
    bracketed = isinstance(host, str) and host.startswith("[") and host.endswith("]")
    if not isinstance(host, str):
        where = f"{host!r}:{port}"
    else:
        where = f"{host}:{port}" if bracketed else describe_address((host, port))
    reason = exc.strerror or str(exc)
    if isinstance(exc, socket.gaierror):
        if bracketed and isinstance(host, str):
            return socket.gaierror(exc.errno, (
                f"cannot listen on {where}: cannot resolve {host!r}: give the IPv6 address "
                f"without brackets ({host[1:-1]})"))
        return socket.gaierror(exc.errno, (
            f"cannot listen on {where}: cannot resolve {host!r} ({reason}): give an IP "
            f"address of this machine (127.0.0.1, or 0.0.0.0 for every interface) or a "
            f"host name that resolves to one"))
    if exc.errno == errno.EADDRINUSE:
        hint = ("address already in use: another server -- perhaps another aoprim -- is "
                "listening there; stop it or choose another port")
    elif exc.errno == errno.EADDRNOTAVAIL:
        hint = (f"address not available: {host} is not an address of this machine; give "
                f"one of its addresses (127.0.0.1, or 0.0.0.0 for every interface)")
    elif exc.errno == errno.EACCES and 0 < port < 1024:
        hint = ("permission denied: ports below 1024 need root or CAP_NET_BIND_SERVICE; "
                "choose a port of 1024 or above")
    elif exc.errno == errno.EINVAL and _needs_scope(host):
        hint = (f"{host} is a link-local IPv6 address: it needs a scope id, the interface "
                f"it is on ({host}%eth0)")
    else:
        hint = reason[:1].lower() + reason[1:]
    # OSError(errno, text) is the errno's own subclass (PermissionError for EACCES)
    return OSError(exc.errno, f"cannot listen on {where}: {hint}")


def make_listening_socket(host: str | None, port: int, backlog: int,
                          reuse_port: bool) -> socket.socket:
    """A non-blocking socket listening on ``(host, port)``.  ``OSError`` (``socket.gaierror``
    for a host that does not resolve) with a message naming the address, see
    :func:`listen_error`; ``TypeError`` for a host that is not a str or None."""
    check_port(port)
    if host is not None and not isinstance(host, str):
        raise TypeError(f"host must be a str (an IP address or a host name), not "
                        f"{type(host).__name__} {host!r}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
        family, stype, proto, _, addr = infos[0]
        s = socket.socket(family, stype, proto)
    except OSError as e:
        raise listen_error(host, port, e) from None
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(addr)
        s.listen(backlog)
        s.setblocking(False)
    except OSError as e:
        s.close()
        raise listen_error(host, port, e) from None
    except BaseException:
        s.close()
        raise
    return s


class Listener:
    """Accepts connections for ``on_accept(sock, addr)`` while ``has_room()`` says so."""

    def __init__(self, loop: EventLoop, sock: socket.socket, settings: Settings,
                 on_accept: Callable[[socket.socket, Any], object],
                 has_room: Callable[[], bool]) -> None:
        self.sock = sock
        self._loop = loop
        self._fd = sock.fileno()
        self._batch = settings.accept_batch
        self._on_accept = on_accept
        self._has_room = has_room
        self._active = False        # registered with the loop
        self._full = False          # paused at max_connections
        self._timer: Timer | None = None    # pending resume after an error
        self._backoff = 0.01
        self.closed = False
        self.pauses_full = 0        # statistics
        self.accept_errors = 0

    @property
    def address(self) -> Any:
        return sock_address(self.sock)

    def start(self) -> None:
        self._arm()

    def _arm(self) -> None:
        if not self._active and not self.closed:
            self._active = True
            self._loop.add_reader(self._fd, self._on_ready)

    def _disarm(self) -> None:
        if self._active:
            self._active = False
            self._loop.remove_reader(self._fd)

    def _on_ready(self) -> None:
        accept = self.sock.accept
        for _ in range(self._batch):
            if not self._has_room():
                self._full = True
                self.pauses_full += 1
                log.warning("max_connections reached: new connections wait in the backlog")
                self._disarm()
                return
            try:
                sock, addr = accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self.accept_errors += 1
                if e.errno in _ONE_CONNECTION:
                    continue
                if e.errno in _OUT_OF_RESOURCES:
                    delay = 0.1
                else:
                    delay = self._backoff
                    self._backoff = min(1.0, self._backoff * 2)
                log.warning("accept failed (%s): pausing accepts for %.2f s", e, delay)
                self._pause(delay)
                return
            self._backoff = 0.01
            self._on_accept(sock, addr)

    def _pause(self, delay: float) -> None:
        self._disarm()
        if self._timer is None:
            self._timer = self._loop.call_later(delay, self._resume_after_error)

    def _resume_after_error(self) -> None:
        self._timer = None
        if not self._full:
            self._arm()

    def room_freed(self) -> None:
        """A session ended: resume accepting if the limit had paused it (loop thread)."""
        if self._full:
            self._full = False
            if self._timer is None:
                self._arm()

    def close(self) -> None:
        if self.closed:
            return
        self._disarm()
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            self.sock.close()
        except OSError:
            pass
