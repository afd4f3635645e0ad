"""Layer 2 -- statistics: the server's counters and the JSON-serialisable ``stats()`` dict.

Hot counters live where they are bumped for free (the compiled receiver counts reads, bytes
and frames; each send batch counts syscalls, messages and bytes; a session counts the frames
it sent on the loop thread); a session folds its figures into :class:`Stats` at teardown
(once closed, not while closing), and a snapshot adds the figures of the sessions not torn
down yet (open and closing) to the folded ones.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aoprim import AtomicInt

if TYPE_CHECKING:
    from collections.abc import Sequence

    from aoprim import Receiver, SendBatch, TLSFlush

    from .session import Session

__all__ = ["Stats"]


class Stats:
    """Counters of one server.  Loop-thread counters are plain ints; counters bumped by other
    threads are ``AtomicInt``."""

    def __init__(self) -> None:
        self.connections_total = 0
        self.reads = 0                  # recv calls that returned data (closed sessions)
        self.bytes_in = 0
        self.frames_in = 0
        self.frames_out = 0             # loop-thread sends (closed sessions) and broadcasts
        self.frames_out_x = AtomicInt(0)    # sends from other threads
        self.eofs = 0                   # recv calls that returned EOF
        self.handler_errors = AtomicInt(0)
        self.closes: dict[str, int] = {}    # close cause -> count (reset, protocol, ...)
        self.batches = {"syscalls": 0, "messages": 0, "bytes": 0}
        # a TLS server's TLSFlush (aoprim._tls), or None: it counts the sends of ciphertext
        # (`sends`: not the batches' -- a TLS batch is encrypted, not written) and their
        # bytes (`bytes_out`: the bytes on the wire are not the plaintext bytes_out counts)
        self.tls: TLSFlush | None = None

    def count_close(self, cause: str) -> None:
        self.closes[cause] = self.closes.get(cause, 0) + 1

    def fold_session(self, receiver: Receiver, batch: SendBatch, frames_out: int) -> None:
        """A session ended: keep its figures."""
        self.reads += receiver.reads
        self.bytes_in += receiver.bytes_in
        self.frames_in += receiver.frames_in
        self.frames_out += frames_out
        st = batch.stats
        for k in self.batches:
            self.batches[k] += st.get(k, 0)

    def snapshot(self, sessions: Sequence[Session], extra: dict[str, Any]) -> dict[str, Any]:
        """The ``stats()`` dict: folded figures plus the open ``sessions``' own; ``extra``
        adds the parts' gauges (pool slots, listener, loop)."""
        agg = dict(self.batches)
        reads, bin_, fin, fout = self.reads, self.bytes_in, self.frames_in, self.frames_out
        for s in sessions:
            r, b, n = s.counters()
            reads += r.reads
            bin_ += r.bytes_in
            fin += r.frames_in
            fout += n
            st = b.stats
            for k in agg:
                agg[k] += st.get(k, 0)
        frames_out = fout + self.frames_out_x.load()
        tls = self.tls
        tls_sends, tls_bytes = (tls.sends, tls.bytes_out) if tls is not None else (0, 0)
        sends = agg["syscalls"] + tls_sends
        d: dict[str, Any] = {
            "connections": len(sessions),
            "connections_total": self.connections_total,
            "frames_in": fin,
            "frames_out": frames_out,
            "bytes_in": bin_,
            "bytes_out": agg["bytes"],
            "recv_syscalls": reads + self.eofs,
            "send_syscalls": sends,
            "messages_per_send": (frames_out / sends) if sends else 0.0,
            "tls_bytes_out": tls_bytes,
            "handler_errors": self.handler_errors.load(),
            "closes": dict(self.closes),
        }
        d.update(extra)
        return d
