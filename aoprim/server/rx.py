"""Layer 2 -- the receive side of a session: the compiled ``Receiver`` (read into pooled
memory, cut frames, hand each to ``on_read``), why reading is paused, and the clocks of the
idle and frame timeouts.

The per-read and per-frame work is all in ``aoprim.Receiver``: the loop's read callback *is*
``Receiver.on_readable``, which calls the frame callback (the handler's ``on_read``, or the
worker dispatcher's ``post``) directly from C.  This module decides only policy:

- a readiness event reads until the socket has no more (a recv that fills its buffer is
  followed by another, up to ``Settings.rx_reads``), so a message larger than a slot costs one
  event, not one per slot;
- reading runs while no *pause reason* is set: the application (``pause_reading``),
  back-pressure (too many unsent bytes), the worker backlog, the peer's EOF, closing, or the
  server's shutdown;
- the idle and frame timeouts are measured by a sweep every ``Settings.sweep_every`` seconds:
  a session whose byte count moved was active; a session that has held the same unfinished
  frame (no frame completed since the sweep first saw bytes buffered) for longer than
  ``frame_timeout`` is cut.  Both are exact to within one sweep period.
"""
from aoprim import (RX_EOF, RX_ERROR, RX_HANDLER, RX_PROXY, RX_PROXY_ERROR, RX_TOO_LARGE,
                    Receiver)

__all__ = ["Rx", "PAUSE_USER", "PAUSE_BACKPRESSURE", "PAUSE_BACKLOG", "PAUSE_EOF",
           "PAUSE_CLOSING", "PAUSE_SHUTDOWN", "RX_EOF", "RX_ERROR", "RX_HANDLER",
           "RX_TOO_LARGE", "RX_PROXY", "RX_PROXY_ERROR"]

PAUSE_USER = 1
PAUSE_BACKPRESSURE = 2
PAUSE_BACKLOG = 4
PAUSE_EOF = 8
PAUSE_CLOSING = 16
PAUSE_SHUTDOWN = 32


class Rx:
    """One session's receive side."""

    __slots__ = ("receiver", "paused", "_seen_bytes", "_ft_mark", "_ft_since", "last_active")

    def __init__(self, arena, fd, settings, on_frame, on_event, owner, copy_frames, now):
        self.receiver = Receiver(arena, fd, settings.header_size, settings.max_frame,
                                 on_frame, on_event, owner, copy_frames,
                                 settings.proxy_mode, settings.proxy_max_header,  # PROXY
                                 settings.rx_reads)
        self.paused = 0             # bit set of PAUSE_* reasons; reading while 0
        self._seen_bytes = 0        # receiver.bytes_in when the sweep last looked
        self._ft_mark = -1          # receiver.frames_in when the unfinished frame was seen
        self._ft_since = 0.0        # ... and when
        self.last_active = now

    @property
    def reading(self):
        return not self.paused

    def pause(self, reason):
        """Set a pause reason; True if reading stopped because of it."""
        was = self.paused
        self.paused = was | reason
        self.receiver.hold = True       # also within the read burst that is running
        return not was

    def resume(self, reason):
        """Clear a pause reason; True if reading resumes because of it."""
        was = self.paused
        self.paused = was & ~reason
        if not self.paused:
            self.receiver.hold = False
        return bool(was) and not self.paused

    def sweep(self, now, idle_timeout, frame_timeout):
        """The timeout check; returns a reason to cut the session, or None."""
        r = self.receiver
        b = r.bytes_in
        if b != self._seen_bytes:
            self._seen_bytes = b
            self.last_active = now
        if idle_timeout is not None and now - self.last_active > idle_timeout:
            return f"idle timeout ({idle_timeout:g} s without a byte)"
        # PROXY protocol: the header is due from the connection's start (proxy_pending)
        if frame_timeout is not None and (r.buffered or r.proxy_pending):
            f = r.frames_in
            if f != self._ft_mark:
                self._ft_mark = f
                self._ft_since = now
            elif now - self._ft_since > frame_timeout:
                if r.proxy_pending:
                    return (f"PROXY header timeout (not complete after "
                            f"{now - self._ft_since:.2f} s, limit {frame_timeout:g} s)")
                return (f"frame timeout (a frame begun {now - self._ft_since:.2f} s ago is "
                        f"incomplete, limit {frame_timeout:g} s)")
        else:
            self._ft_mark = -1
        return None

    def close(self):
        """Give every receive buffer back (exactly once; idempotent)."""
        self.receiver.close()
