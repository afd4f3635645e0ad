"""Framing for clients and tools: cutting a byte stream into frames and building frames --
no sockets, no selectors, no I/O.

There is one cutter and one encoder, both compiled, and this module is their Python face:
:meth:`Framing.scan` (and :class:`FrameDecoder`) cut with the compiled Receiver's own step
(``Receiver.scan_frames``, over the step the server cuts every read with), and
:meth:`Framing.header` / :meth:`Framing.encode` take their header from
``SendBatch.frame_header``, the code ``SendBatch.add_frame`` builds every header the server
sends with.  The Python model of the framing lives only in the tests
(tests/server/test_framing.py), which check both against it.  ``FRAMINGS`` and
``DEFAULT_MAX_FRAME`` are the server's settings too.

Three framings:

- ``raw``: every chunk the transport delivers is one frame (no header; nothing is buffered).
- ``u16``: a 2-byte big-endian length header, then that many payload bytes.
- ``u32``: a 4-byte big-endian length header, then that many payload bytes.

Rules (the server's receiver follows the same ones):

1. A length header is validated against ``max_frame`` as soon as its bytes are complete, and
   before any memory is reserved for its payload: a header above ``max_frame`` raises
   :class:`FrameTooLarge` (a ``ValueError``) and nothing after it is looked at.
2. Frames come out in stream order; many frames in one chunk and one frame over many chunks
   both work, and the result never depends on where the stream was split.
3. A zero-length frame is a valid frame (an empty payload).
4. Encoding a payload too long for the header (> 65535 for u16, > 2**32-1 for u32) raises
   ``ValueError``.

Two interfaces:

- :meth:`Framing.scan` -- given a buffer and a window ``[pos, end)`` it returns the spans of
  the complete frames in it, without copying, and how many bytes the next (incomplete) frame
  still needs.
- :class:`FrameDecoder` -- ``feed(bytes) -> [bytes, ...]``, the same rules with its own
  buffer; convenient for clients, tests and tools.
"""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

from aoprim import SendBatch
from aoprim.server._receiver import Receiver

if TYPE_CHECKING:
    from collections.abc import Iterable

    from typing_extensions import Buffer

    from aoprim import Slot

_scan_frames = Receiver.scan_frames
_frame_header = SendBatch.frame_header

__all__ = ["Framing", "FrameDecoder", "FrameTooLarge", "FRAMINGS", "DEFAULT_MAX_FRAME"]

FRAMINGS = ("raw", "u16", "u32")
DEFAULT_MAX_FRAME = 65536


class FrameTooLarge(ValueError):
    """A length header announced a frame above ``max_frame``."""

    def __init__(self, length: int, max_frame: int, spans: Iterable[tuple[int, int]] = (),
                 pos: int = 0) -> None:
        super().__init__(f"frame header announces {length} bytes, above max_frame={max_frame}")
        self.length = length
        self.max_frame = max_frame
        self.spans = list(spans)   # complete frames before the bad header (scan)
        self.pos = pos             # where the bad header starts (scan)
        self.frames: list[bytes] = []  # complete frames before the bad header (FrameDecoder)


def _payload_bytes(payload: Buffer | Slot) -> bytes:
    """The bytes add_frame / Session.send take from ``payload``: a Slot (or slot-like: retain,
    release and length) gives its first ``length`` bytes, anything else all its bytes in C
    order."""
    if type(payload) is bytes:
        return payload
    mv = memoryview(payload)
    if hasattr(payload, "retain") and hasattr(payload, "release") and hasattr(payload, "length"):
        n = operator.index(payload.length)
        if n < 0 or n > mv.nbytes:
            raise ValueError(f"slot.length {n} is outside 0..{mv.nbytes}")
        return mv.cast("B")[:n].tobytes()
    return mv.tobytes()


class Framing:
    """One framing kind with its limit.  Not changed after construction (nothing enforces it:
    do not assign its attributes); share it between decoders and connections."""

    __slots__ = ("kind", "max_frame", "header_size", "max_payload")

    kind: str                   # "raw", "u16" or "u32"
    max_frame: int
    header_size: int            # 0, 2 or 4
    max_payload: int | None     # the largest payload the header can announce (None: raw)

    def __init__(self, kind: str = "raw", max_frame: int = DEFAULT_MAX_FRAME) -> None:
        if kind not in FRAMINGS:
            raise ValueError(f"framing must be one of {FRAMINGS}, not {kind!r}")
        if isinstance(max_frame, bool) or not isinstance(max_frame, int):
            raise TypeError(f"max_frame must be an int, not {type(max_frame).__name__}")
        if max_frame < 1:
            raise ValueError(f"max_frame must be >= 1, not {max_frame}")
        self.kind = kind
        self.max_frame = max_frame
        if kind == "raw":
            self.header_size = 0
            self.max_payload = None
        else:
            self.header_size = 2 if kind == "u16" else 4
            self.max_payload = (1 << (8 * self.header_size)) - 1

    def __repr__(self) -> str:
        return f"Framing({self.kind!r}, max_frame={self.max_frame})"

    # -- decoding -------------------------------------------------------------------------
    def scan(self, buf: Buffer | Slot, pos: int, end: int
             ) -> tuple[list[tuple[int, int]], int, int]:
        """Find the complete frames in ``buf[pos:end]`` (any buffer: bytes, bytearray,
        memoryview, a Slot; not copied).

        Returns ``(spans, pos, need)``: ``spans`` is a list of ``(start, stop)`` payload
        offsets into ``buf`` in stream order, ``pos`` is where the first incomplete frame
        begins (== ``end`` when none is pending), and ``need`` is the total number of bytes
        (header included) that the incomplete frame occupies once complete -- the header size
        while the header itself is incomplete, 0 when nothing is pending.  Raises
        :class:`FrameTooLarge` on a header above ``max_frame`` (rule 1); the frames complete
        before it are in the exception's ``spans``.  Not for ``raw``.  ``ValueError`` unless
        ``0 <= pos <= end <= len(buf)``.
        """
        if self.kind == "raw":
            raise ValueError("raw framing has no frames to scan: every chunk is one frame")
        spans, pos, need, too_large = _scan_frames(buf, pos, end, self.header_size,
                                                   self.max_frame)
        if too_large is not None:
            raise FrameTooLarge(too_large, self.max_frame, spans, pos)
        return spans, pos, need

    # -- encoding -------------------------------------------------------------------------
    def header(self, n: int) -> bytes:
        """The header for an ``n``-byte payload (``b""`` for raw)."""
        if self.kind == "raw":
            return b""
        return _frame_header(n, self.header_size)

    def encode(self, payload: Buffer | Slot) -> bytes:
        """Header + payload as one bytes object, the bytes the server's ``add_frame`` sends:
        the header counts the payload's bytes (an ``array.array("I", [1, 2])`` is 8 of them),
        and a ``Slot`` gives its first ``length`` bytes (not the whole slot)."""
        body = _payload_bytes(payload)
        if self.kind == "raw":
            return body
        return _frame_header(len(body), self.header_size) + body


class FrameDecoder:
    """``feed(data) -> list[bytes]``: the frames completed by ``data``, in order.

    Keeps the unfinished tail in its own buffer.  :class:`FrameTooLarge` carries the frames
    completed before the bad header in ``.frames``; afterwards the decoder is poisoned (every
    later ``feed`` raises again): the stream has lost its framing.
    """

    __slots__ = ("framing", "_buf", "_error")

    framing: Framing

    def __init__(self, kind: str | Framing = "raw", max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.framing = kind if isinstance(kind, Framing) else Framing(kind, max_frame)
        self._buf = bytearray()
        self._error: FrameTooLarge | None = None

    @property
    def pending(self) -> int:
        """Bytes buffered for an unfinished frame."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        if self._error is not None:
            raise self._error
        fr = self.framing
        if fr.kind == "raw":
            return [bytes(data)] if len(data) else []
        buf = self._buf
        buf += data
        try:
            spans, pos, _need = fr.scan(buf, 0, len(buf))
        except FrameTooLarge as e:
            e.frames = [bytes(buf[a:b]) for a, b in e.spans]
            buf.clear()
            self._error = FrameTooLarge(e.length, e.max_frame)
            raise
        out = [bytes(buf[a:b]) for a, b in spans]
        del buf[:pos]
        return out
