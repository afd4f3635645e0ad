"""Layer 2 -- the receive side of a session: the compiled ``Receiver`` (read into pooled
memory, cut frames, hand each to ``on_read``), why reading is paused, and the clocks of the
idle and frame timeouts.

The per-read and per-frame work is all in ``aoprim.server._receiver.Receiver``: the loop's
read callback *is* ``Receiver.on_readable``, which calls the frame callback (the handler's
``on_read``, or the worker dispatcher's ``post_frame``) directly from C.  This module decides
only policy:

- a readiness event reads until the socket has no more (a recv that fills its buffer is
  followed by another, up to ``Settings.rx_reads``), so a message larger than a slot costs one
  event, not one per slot;
- reading runs while no *pause reason* is set: the application (``pause_reading``),
  back-pressure (too many unsent bytes), the worker backlog, the peer's EOF, closing, or the
  server's shutdown;
- the idle and frame timeouts are measured by a sweep every ``Settings.sweep_every`` seconds:
  a session whose byte count moved was active; a session that has held the same unfinished
  frame (no frame completed since the sweep first saw bytes buffered) for longer than
  ``frame_timeout`` is cut.  Both are exact to within one sweep period.  Neither clock runs
  while the server itself keeps the session from being read (``pause_reading``, a full
  worker backlog, shutdown, the peer's EOF while its frames still wait for a worker, or
  back-pressure while the peer still takes our bytes): a frame
  cannot complete while we do not read it.  Back-pressure from a peer that takes nothing
  does not stop them (that peer is the one stalling).  With the PROXY protocol the header
  has its own deadline, ``proxy_header_timeout``, from the connection's start.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from aoprim.server._receiver import (RX_EOF, RX_ERROR, RX_FORKED, RX_HANDLER, RX_PROXY,
                                     RX_PROXY_ERROR, RX_TOO_LARGE, Receiver)

if TYPE_CHECKING:
    from aoprim.server._rxbuf import RxArena

    from .config import Settings

__all__ = ["Rx", "PAUSE_USER", "PAUSE_BACKPRESSURE", "PAUSE_BACKLOG", "PAUSE_EOF",
           "PAUSE_CLOSING", "PAUSE_SHUTDOWN", "RX_EOF", "RX_ERROR", "RX_FORKED", "RX_HANDLER",
           "RX_TOO_LARGE", "RX_PROXY", "RX_PROXY_ERROR"]

PAUSE_USER = 1
PAUSE_BACKPRESSURE = 2
PAUSE_BACKLOG = 4
PAUSE_EOF = 8
PAUSE_CLOSING = 16
PAUSE_SHUTDOWN = 32


class Rx:
    """One session's receive side.  ``on_read`` is called by the compiled ``Receiver``
    built here (``receiver.on_readable`` is the loop's read callback), through ``on_frame``
    -- the handler's ``on_read`` or the worker dispatcher's ``post_frame``."""

    __slots__ = ("receiver", "paused", "_seen_bytes", "_ft_mark", "_ft_since", "last_active",
                 "_born", "_swept", "wire", "header_wait")

    def __init__(self, arena: RxArena, fd: int, settings: Settings,
                 on_frame: Callable[[Any, Any], object],
                 on_event: Callable[[Any, int, Any], object], owner: object,
                 copy_frames: bool, now: float, proxy: bool = True) -> None:
        # proxy: the receiver reads the PROXY header (when on); False for a TLS session,
        # which reads it itself, before the handshake
        self.receiver = Receiver(arena, fd, settings.header_size, settings.max_frame,
                                 on_frame, on_event, owner, copy_frames,
                                 settings.proxy_mode if proxy else 0,
                                 settings.proxy_max_header,                      # PROXY
                                 settings.rx_reads)
        self.paused = 0             # bit set of PAUSE_* reasons; reading while 0
        self._seen_bytes = 0        # receiver.bytes_in when the sweep last looked
        self._ft_mark = -1          # receiver.frames_in when the unfinished frame was seen
        self._ft_since = 0.0        # ... and when
        self.last_active = now
        self._born = now            # the connection's start (the PROXY header's deadline)
        self._swept = now           # when the sweep last looked
        # None, or a callable () -> (bytes received, bytes buffered) on the wire, for a
        # session whose receiver sees other bytes than the socket's (TLS: the decrypted
        # ones): the idle and frame clocks then measure what arrives, as on plain TCP
        self.wire: Callable[[], tuple[int, int]] | None = None
        # None, or a callable () -> True while the PROXY header is still due, for a session
        # that reads the header itself (TLS: before the handshake) instead of its receiver
        self.header_wait: Callable[[], bool] | None = None

    @property
    def reading(self) -> bool:
        return not self.paused

    def pause(self, reason: int) -> bool:
        """Set a pause reason; True if reading stopped because of it."""
        was = self.paused
        self.paused = was | reason
        self.receiver.hold = True       # also within the read burst that is running
        return not was

    def resume(self, reason: int) -> bool:
        """Clear a pause reason; True if reading resumes because of it."""
        was = self.paused
        self.paused = was & ~reason
        if not self.paused:
            self.receiver.hold = False
        return bool(was) and not self.paused

    def sweep(self, now: float, idle_timeout: float | None, frame_timeout: float | None,
              proxy_timeout: float | None = None, held: bool = False,
              active: bool = False) -> str | None:
        """The timeout check; returns a reason to cut the session, or None.  ``held``: the
        server itself kept this session from being read since the last sweep (see
        Session.check_timeouts): neither the idle nor the frame clock runs meanwhile -- a
        frame cannot complete while we do not read it.  ``proxy_timeout``: the PROXY
        header's own deadline, from the connection's start (None: no deadline).  ``active``:
        the peer took bytes we owed since the last sweep -- the idle clock restarts (a byte
        moved), the frame clock does not stop."""
        dt = now - self._swept
        self._swept = now
        r = self.receiver
        if self.wire is None:
            b = r.bytes_in
            buffered = r.buffered
        else:
            b, buffered = self.wire()
        if b != self._seen_bytes or held or active:
            self._seen_bytes = b
            self.last_active = now
        if idle_timeout is not None and now - self.last_active > idle_timeout:
            return f"idle timeout ({idle_timeout:g} s without a byte)"
        if (r.proxy_pending if self.header_wait is None else self.header_wait()):
            # PROXY protocol: the header is due from the start
            if proxy_timeout is not None and now - self._born > proxy_timeout:
                return (f"PROXY header timeout (not complete after {now - self._born:.2f} "
                        f"s, limit {proxy_timeout:g} s)")
            return None
        if frame_timeout is not None and buffered:
            f = r.frames_in
            if f != self._ft_mark:
                self._ft_mark = f
                self._ft_since = now
            elif held:
                self._ft_since += dt    # the frame clock stops while the server holds
            elif now - self._ft_since > frame_timeout:
                return (f"frame timeout (a frame begun {now - self._ft_since:.2f} s ago is "
                        f"incomplete, limit {frame_timeout:g} s)")
        else:
            self._ft_mark = -1
        return None

    def close(self) -> None:
        """Give every receive buffer back (exactly once; idempotent)."""
        self.receiver.close()
