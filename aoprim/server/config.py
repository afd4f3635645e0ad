"""Settings: every server argument validated once, into one frozen object the parts share.

Every setting is validated here and nowhere else (the server checks only what is not a
setting: the handler's hooks, ``port``); nothing changes a ``Settings`` after it is built
(``dataclasses.replace`` makes a new one).
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Literal, TypedDict, overload

from .framing import DEFAULT_MAX_FRAME, FRAMINGS
from .proxy import (DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_HEADER, DEFAULT_TRUSTED, parse_mode,
                    parse_trusted)

if TYPE_CHECKING:
    import ssl as _ssl
    from collections.abc import Iterable
    from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

    from typing_extensions import TypeAlias

    _Network: TypeAlias = "str | IPv4Network | IPv6Network"
    #: trusted_proxies as given: one network, or an iterable of networks or addresses
    #: (stored as a tuple of ipaddress networks)
    _TrustedProxies: TypeAlias = ("_Network | Iterable[_Network | IPv4Address | IPv6Address] "
                                 "| tuple[IPv4Network | IPv6Network, ...]")

__all__ = ["Settings", "SettingsArgs"]

_HEADER_SIZE = {"raw": 0, "u16": 2, "u32": 4}


@overload
def _int(name: str, v: int, lo: int, allow_none: Literal[False] = ...) -> int: ...
@overload
def _int(name: str, v: int | None, lo: int, allow_none: Literal[True]) -> int | None: ...
def _int(name: str, v: Any, lo: int, allow_none: bool = False) -> int | None:
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, not {type(v).__name__}")
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, not {v}")
    return v


def _seconds(name: str, v: Any, allow_none: bool = True) -> float | None:
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number of seconds" + (" or None" if allow_none
                                                                   else ""))
    if not v > 0:
        raise ValueError(f"{name} must be > 0" + (" (or None for no limit)" if allow_none
                                                   else "") + f", not {v}")
    if not math.isfinite(v):
        # inf is refused, not read as "forever": a timer cannot be armed for it, and for the
        # limits that may be off, None already says "no limit"
        raise ValueError(f"{name} must be a finite number of seconds" +
                         (" (None for no limit)" if allow_none else "") + f", not {v}")
    return float(v)


@dataclasses.dataclass(frozen=True)
class Settings:
    """The server's settings (see :class:`aoprim.server.Server` for their meaning)."""

    framing: str = "raw"
    max_frame: int = DEFAULT_MAX_FRAME
    max_connections: int = 10000
    max_pending: int = 4 << 20
    idle_timeout: float | None = None
    frame_timeout: float | None = 30.0
    workers: int = 0
    backend: str = "selectors"
    high_water: int | None = None   # None: min(256 KiB, max_pending // 2)
    low_water: int | None = None    # None: high_water // 4
    flush_budget: int = 256 << 10
    backlog: int = 1024
    reuse_port: bool = False
    rx_slot_size: int = 16384
    rx_slots: int = 1024
    rx_reads: int = 8               # recvs per readiness event while each fills its buffer
    rx_read_size: int = 512 << 10   # raw framing: bytes per recv (slots of the raw read pool;
                                    # not above rx_slot_size: no pool, slot-sized reads)
    rx_read_slots: int = 16         # raw framing: slots of that pool (pre-faulted at start)
    rx_frame_cache: int = 16 << 20  # u16/u32: bytes of large frame buffers kept for reuse
    tx_slot_size: int = 16384
    tx_slots: int = 256
    close_linger: float = 5.0       # a closing session's unsent data / unread input
    shutdown_timeout: float = 5.0
    worker_backlog: int = 256       # frames queued per session before its reading pauses
    worker_queue: int = 4096        # completion-queue capacity (sessions ready for a worker)
    accept_batch: int = 64          # connections accepted per readiness event
    # PROXY protocol (proxy.py): None (off), "v1", "v2" or "any"; who may send the header
    # (networks; stored as a tuple of ipaddress networks); the longest header accepted
    proxy_protocol: str | None = None
    trusted_proxies: _TrustedProxies = DEFAULT_TRUSTED
    proxy_max_header: int = DEFAULT_MAX_HEADER
    proxy_header_timeout: float | None = DEFAULT_HEADER_TIMEOUT   # from the connection's start
    # TLS (tls.py): a server-side ssl.SSLContext, or None (plain TCP); the handshake's limit
    # in seconds from the accept (the PROXY header, when on, included)
    ssl: _ssl.SSLContext | None = None
    handshake_timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.framing not in FRAMINGS:
            raise ValueError(f"framing must be one of {FRAMINGS}, not {self.framing!r}")
        _int("max_frame", self.max_frame, 1)
        _int("max_connections", self.max_connections, 1)
        _int("max_pending", self.max_pending, 1)
        _seconds("idle_timeout", self.idle_timeout)
        _seconds("frame_timeout", self.frame_timeout)
        _int("workers", self.workers, 0)
        if not isinstance(self.backend, str):
            raise TypeError("backend must be a str")
        _int("flush_budget", self.flush_budget, 1)
        _int("backlog", self.backlog, 0)
        _int("rx_slot_size", self.rx_slot_size, 64)
        _int("rx_slots", self.rx_slots, 2)
        _int("rx_reads", self.rx_reads, 1)
        if self.rx_reads > 1024:
            raise ValueError("rx_reads must be <= 1024")
        _int("rx_read_size", self.rx_read_size, 0)
        if self.rx_read_size > 1 << 30:
            raise ValueError("rx_read_size must be <= 2**30")
        _int("rx_read_slots", self.rx_read_slots, 2)
        _int("rx_frame_cache", self.rx_frame_cache, 0)
        _int("tx_slot_size", self.tx_slot_size, 64)
        _int("tx_slots", self.tx_slots, 1)
        _seconds("close_linger", self.close_linger, allow_none=False)
        _seconds("shutdown_timeout", self.shutdown_timeout, allow_none=False)
        _int("worker_backlog", self.worker_backlog, 1)
        _int("worker_queue", self.worker_queue, 1)
        _int("accept_batch", self.accept_batch, 1)
        hw = _int("high_water", self.high_water, 1, True)
        if hw is None:
            hw = min(256 << 10, max(1, self.max_pending // 2))
        lw = _int("low_water", self.low_water, 0, True)
        if lw is None:
            lw = hw // 4
        if lw > hw:
            raise ValueError("low_water must be <= high_water")
        set_ = object.__setattr__        # the frozen object's derived fields, set once here
        set_(self, "high_water", hw)
        set_(self, "low_water", lw)
        set_(self, "idle_timeout", _seconds("idle_timeout", self.idle_timeout))
        set_(self, "frame_timeout", _seconds("frame_timeout", self.frame_timeout))
        set_(self, "reuse_port", bool(self.reuse_port))
        # PROXY protocol
        parse_mode(self.proxy_protocol)
        set_(self, "trusted_proxies", parse_trusted(self.trusted_proxies))
        if self.proxy_protocol is not None and not self.trusted_proxies:
            raise ValueError("proxy_protocol is on but trusted_proxies is empty: no "
                             "connection could be accepted")
        _int("proxy_max_header", self.proxy_max_header, 232)
        set_(self, "proxy_header_timeout",
             _seconds("proxy_header_timeout", self.proxy_header_timeout))
        set_(self, "handshake_timeout",
             _seconds("handshake_timeout", self.handshake_timeout, allow_none=False))
        if self.proxy_max_header > 16 + 65535:
            raise ValueError(f"proxy_max_header must be <= {16 + 65535} (the longest "
                             f"header the format can announce), not {self.proxy_max_header}")

    @property
    def header_size(self) -> int:
        """Bytes of the length header: 0 (raw), 2 (u16) or 4 (u32)."""
        return _HEADER_SIZE[self.framing]

    @property
    def proxy_mode(self) -> int:
        """PROXY header versions accepted: 0 (off), 1 (v1), 2 (v2), 3 (either)."""
        return parse_mode(self.proxy_protocol)

    @property
    def sweep_every(self) -> float | None:
        """How often the timeout sweep runs (None: no timeouts set): a tenth of the shortest
        timeout, between 10 ms and 1 s."""
        ticks = [t for t in (self.idle_timeout, self.frame_timeout,
                             self.proxy_header_timeout if self.proxy_protocol else None) if t]
        return min(1.0, max(0.01, min(ticks) / 10)) if ticks else None


class SettingsArgs(TypedDict, total=False):
    """The keyword settings ``Server(...)`` takes besides ``framing``, ``ssl`` and
    ``handshake_timeout``, for type checkers (``**settings: Unpack[SettingsArgs]``): a
    misspelt or mistyped setting is an error there, as it is at run time.  One key per
    :class:`Settings` field (tests/test_typing.py checks that they stay the same)."""

    max_frame: int
    max_connections: int
    max_pending: int
    idle_timeout: float | None
    frame_timeout: float | None
    workers: int
    backend: str
    high_water: int | None
    low_water: int | None
    flush_budget: int
    backlog: int
    reuse_port: bool
    rx_slot_size: int
    rx_slots: int
    rx_reads: int
    rx_read_size: int
    rx_read_slots: int
    rx_frame_cache: int
    tx_slot_size: int
    tx_slots: int
    close_linger: float
    shutdown_timeout: float
    worker_backlog: int
    worker_queue: int
    accept_batch: int
    proxy_protocol: str | None
    trusted_proxies: _TrustedProxies
    proxy_max_header: int
    proxy_header_timeout: float | None
