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

    from aoprim import SendBatch
    from aoprim.server._receiver import Receiver
    from aoprim.server._tls import TLSFlush

    from .session import Session

__all__ = ["Stats", "summary"]


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
        # a TLS server's TLSFlush (aoprim.server._tls), or None: it counts the sends of ciphertext
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


def _size(n: int) -> str:
    """``n`` bytes for a reader: ``512 B``, ``1.5 KiB``, ``12.0 MiB``."""
    if n < 1024:
        return f"{n} B"
    x = n / 1024
    for unit in ("KiB", "MiB"):
        if x < 1024:
            return f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} GiB"


def summary(st: dict[str, Any]) -> str:
    """One short line for a reader from a ``stats()`` dict: connections served, frames and
    bytes each way, handler errors and close causes (most frequent first), and any pool slot
    or session still held (a leak once the server has stopped).  ``stats()`` itself (JSON)
    is the record for programs."""
    n = st["connections_total"]
    parts = [f"{n} connection{'' if n == 1 else 's'}",
             f"frames {st['frames_in']} in, {st['frames_out']} out",
             f"{_size(st['bytes_in'])} in, {_size(st['bytes_out'])} out"]
    if st["handler_errors"]:
        parts.append(f"{st['handler_errors']} handler errors")
    closes = sorted(st["closes"].items(), key=lambda kv: (-kv[1], kv[0]))
    if closes:
        parts.append("closed: " + ", ".join(f"{k} {v}" for k, v in closes))
    held = [f"{k} {st[k]}" for k in ("live_sessions", "rx_slots_in_use", "tx_slots_in_use")
            if st.get(k)]
    if held:
        parts.append("still held: " + ", ".join(held))
    return "; ".join(parts)
