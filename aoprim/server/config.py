"""Settings: every server argument validated once, into one frozen object the parts share.

Every setting is validated here and nowhere else (the server checks only what is not a
setting: the handler's hooks, ``port``); nothing changes a ``Settings`` after it is built
(``dataclasses.replace`` makes a new one).
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import threading
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


# Bounds the compiled parts can really hold (the error messages name them):
_SSIZE_MAX = sys.maxsize        # a byte count in C (Py_ssize_t): rx_frame_cache
_BUDGET_MAX = 1 << 62           # FlushGroup's budget and SendBatch's max_bytes, at most
_INT_MAX = (1 << 31) - 1        # a C int: listen()'s backlog
_POOL_MAX_SLOTS = 1 << 30       # SlabPool's most slots (aop_slab.h: AOP_SLAB_MAX_SLOTS)
_QUEUE_MAX = 1 << 32            # MPMCQueue's largest capacity (aop_queue.h: AOP_Q_MAX_CAPACITY)
_QUEUE_CELL = 16                # bytes per MPMCQueue cell (the capacity rounded up to 2**k)
_FLOAT_MAX = sys.float_info.max  # seconds a loop timer takes (its wait is clamped to a day)
_JOIN_MAX = threading.TIMEOUT_MAX   # seconds a thread join / Event.wait takes: shutdown_timeout


def _physical_memory() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say): no pool
    larger than it can be allocated (a raw read pool is even written whole at start)."""
    try:
        n = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return n if n > 0 else None


def _cgroup_pids_max(proc_cgroup: str = "/proc/self/cgroup",
                     mount: str = "/sys/fs/cgroup") -> int | None:
    """The smallest ``pids.max`` on this process's cgroup path, from its own group up to
    the root (None: none set): the tasks -- threads included -- the group may hold, as
    systemd's ``TasksMax=`` and ``docker --pids-limit`` set it.  cgroup v1's pids
    controller where it is mounted, else v2 (the ``0::`` line of /proc/self/cgroup)."""
    found = None
    try:
        with open(proc_cgroup) as f:
            for ln in f:
                num, ctrls, path = ln.rstrip("\n").split(":", 2)
                if "pids" in ctrls.split(","):      # v1: the pids controller is there
                    found = (os.path.join(mount, "pids"), path)
                    break
                if num == "0" and not ctrls:
                    found = (mount, path)
    except (OSError, ValueError):
        return None
    if found is None:
        return None
    root, path = found
    limits = []
    parts = [p for p in path.split("/") if p]
    # (down to the mount's own top: inside a cgroup namespace -- a container's view -- the
    # process's group is that top, which holds the container's limit; the host's root
    # group has no pids.max)
    for i in range(len(parts), -1, -1):
        try:
            with open(os.path.join(root, *parts[:i], "pids.max")) as f:
                v = f.read().strip()
        except OSError:
            continue
        if v.isdigit():
            limits.append(int(v))
    return min(limits) if limits else None


def _max_threads() -> int | None:
    """The most threads this process may start (None: no limit known): the user's
    RLIMIT_NPROC (Linux counts threads in it), a pids cgroup's ``pids.max`` and the
    kernel's threads-max."""
    limits = []
    pids = _cgroup_pids_max()
    if pids is not None:
        limits.append(pids)
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
        if soft != resource.RLIM_INFINITY:
            limits.append(soft)
    except (ImportError, AttributeError, ValueError, OSError):
        pass
    try:
        with open("/proc/sys/kernel/threads-max") as f:
            limits.append(int(f.read()))
    except (OSError, ValueError):
        pass
    return min(limits) if limits else None


@overload
def _int(name: str, v: int, lo: int, allow_none: Literal[False] = ...,
         hi: int | None = ..., why: str = ...) -> int: ...
@overload
def _int(name: str, v: int | None, lo: int, allow_none: Literal[True],
         hi: int | None = ..., why: str = ...) -> int | None: ...
def _int(name: str, v: Any, lo: int, allow_none: bool = False, hi: int | None = None,
         why: str = "") -> int | None:
    """``v`` checked as an int setting in ``lo..hi`` (``hi`` None: no upper bound); the
    error names the setting, the value and the allowed range (``why``: the upper bound's
    reason)."""
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int" + (" or None" if allow_none else "")
                        + f", not {type(v).__name__}")
    if hi is None:
        if v < lo:
            raise ValueError(f"{name} must be >= {lo}, not {v}")
    elif not lo <= v <= hi:
        raise ValueError(f"{name} must be in {lo}..{hi}" + (f" ({why})" if why else "")
                         + f", not {v}")
    return v


def _fits(what: str, nbytes: int, memory: int | None) -> None:
    """A pool or queue of ``nbytes`` must fit in physical memory."""
    if memory is not None and nbytes > memory:
        raise ValueError(f"{what} = {nbytes} bytes, more than this machine's physical memory "
                         f"({memory} bytes): it cannot be allocated")


def _shown(v: Any) -> str:
    """``v`` for an error message: an int too long for ``str()`` (over 4300 digits) by its
    size instead of a second error."""
    try:
        return str(v)
    except ValueError:
        return f"an int of {v.bit_length()} bits"


def _seconds(name: str, v: Any, allow_none: bool = True, hi: float = _FLOAT_MAX,
             why: str = "") -> float | None:
    """``v`` checked as a number of seconds in ``0 < v <= hi``, as a float (None passes when
    ``allow_none``: no limit).  ``hi``: what the code hands it to can take -- any finite
    float (a loop timer: its wait is clamped to a day) or ``threading.TIMEOUT_MAX`` (a
    thread join); ``why`` names that.  An int too large for a float is refused by the same
    named error, not a bare OverflowError."""
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"{name} must be a number of seconds" + (" or None" if allow_none
                                                                   else "")
                        + f", not {type(v).__name__}")
    limit = (f"{name} must be a number of seconds > 0 and <= {hi!r}"
             + (f" ({why})" if why else " (the largest finite float)")
             + (" or None for no limit" if allow_none else ""))
    try:
        f = float(v)
    except OverflowError:
        raise ValueError(f"{limit}, not {_shown(v)}") from None
    if not f > 0:
        raise ValueError(f"{name} must be > 0" + (" (or None for no limit)" if allow_none
                                                   else "") + f", not {v}")
    if not math.isfinite(f):
        # inf is refused, not read as "forever": a timer cannot be armed for it, and for the
        # limits that may be off, None already says "no limit"
        raise ValueError(f"{name} must be a finite number of seconds" +
                         (" (None for no limit)" if allow_none else "") + f", not {v}")
    if f > hi:
        raise ValueError(f"{limit}, not {_shown(v)}")
    return f


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
        # (max_frame, max_connections, max_pending, worker_backlog, accept_batch and the
        # water marks are only compared with counts: any size is handled, none is clamped
        # silently -- a max_frame above what the header can announce limits nothing)
        _int("max_frame", self.max_frame, 1)
        _int("max_connections", self.max_connections, 1)
        _int("max_pending", self.max_pending, 1)
        _seconds("idle_timeout", self.idle_timeout)
        _seconds("frame_timeout", self.frame_timeout)
        threads = _max_threads()
        _int("workers", self.workers, 0, hi=threads,
             why="the threads this process may start: RLIMIT_NPROC, pids.max, "
                 "kernel.threads-max")
        if not isinstance(self.backend, str):
            raise TypeError(f"backend must be a str, not {type(self.backend).__name__}")
        _int("flush_budget", self.flush_budget, 1, hi=_BUDGET_MAX,
             why="the largest budget a FlushGroup and a SendBatch take")
        _int("backlog", self.backlog, 0, hi=_INT_MAX, why="listen() takes a C int")
        _int("rx_slot_size", self.rx_slot_size, 64)
        _int("rx_slots", self.rx_slots, 2, hi=_POOL_MAX_SLOTS, why="a pool's most slots")
        _int("rx_reads", self.rx_reads, 1, hi=1024)
        _int("rx_read_size", self.rx_read_size, 0, hi=1 << 30)
        _int("rx_read_slots", self.rx_read_slots, 2, hi=_POOL_MAX_SLOTS,
             why="a pool's most slots")
        _int("rx_frame_cache", self.rx_frame_cache, 0, hi=_SSIZE_MAX,
             why="a byte count in C, Py_ssize_t")
        _int("tx_slot_size", self.tx_slot_size, 64)
        _int("tx_slots", self.tx_slots, 1, hi=_POOL_MAX_SLOTS, why="a pool's most slots")
        _seconds("close_linger", self.close_linger, allow_none=False)
        # (shutdown() joins the worker threads and waits for the loop with it)
        _seconds("shutdown_timeout", self.shutdown_timeout, allow_none=False, hi=_JOIN_MAX,
                 why="threading.TIMEOUT_MAX: the longest thread join and wait")
        _int("worker_backlog", self.worker_backlog, 1)
        _int("worker_queue", self.worker_queue, 1, hi=_QUEUE_MAX,
             why="the completion queue's largest capacity")
        _int("accept_batch", self.accept_batch, 1)
        # the memory the server allocates at construction and start: its pools (the raw
        # read pool, with raw framing, is written whole at start) and, with workers, the
        # completion queue -- each alone, and all together, within physical memory
        mem = _physical_memory()
        pools = [("rx_slots * rx_slot_size", self.rx_slots * self.rx_slot_size,
                  f"rx_slots={self.rx_slots}, rx_slot_size={self.rx_slot_size}"),
                 ("tx_slots * tx_slot_size", self.tx_slots * self.tx_slot_size,
                  f"tx_slots={self.tx_slots}, tx_slot_size={self.tx_slot_size}")]
        if self.framing == "raw" and self.rx_read_size > self.rx_slot_size:
            pools.append(("rx_read_slots * rx_read_size",
                          self.rx_read_slots * self.rx_read_size,
                          f"rx_read_slots={self.rx_read_slots}, "
                          f"rx_read_size={self.rx_read_size}"))
        if self.workers:
            pools.append(("the worker queue",
                          (1 << (self.worker_queue - 1).bit_length()) * _QUEUE_CELL,
                          f"worker_queue={self.worker_queue} rounded up to a power of two, "
                          f"{_QUEUE_CELL} bytes each"))
        for what, nbytes, values in pools:
            _fits(f"{what} ({values})", nbytes, mem)
        _fits(" + ".join(what for what, _, _ in pools), sum(n for _, n, _ in pools), mem)
        hw = _int("high_water", self.high_water, 1, True)
        if hw is None:
            hw = min(256 << 10, max(1, self.max_pending // 2))
        lw = _int("low_water", self.low_water, 0, True)
        if lw is None:
            lw = hw // 4
        if lw > hw:
            raise ValueError(f"low_water must be <= high_water ({hw}), not {lw}")
        set_ = object.__setattr__        # the frozen object's derived fields, set once here
        set_(self, "high_water", hw)
        set_(self, "low_water", lw)
        set_(self, "idle_timeout", _seconds("idle_timeout", self.idle_timeout))
        set_(self, "frame_timeout", _seconds("frame_timeout", self.frame_timeout))
        if not isinstance(self.reuse_port, bool):
            # (a str such as "no" would otherwise read as True)
            raise TypeError(f"reuse_port must be True or False, not "
                            f"{type(self.reuse_port).__name__}")
        # PROXY protocol
        parse_mode(self.proxy_protocol)
        set_(self, "trusted_proxies", parse_trusted(self.trusted_proxies))
        if self.proxy_protocol is not None and not self.trusted_proxies:
            raise ValueError("proxy_protocol is on but trusted_proxies is empty: no "
                             "connection could be accepted")
        _int("proxy_max_header", self.proxy_max_header, 232, hi=16 + 65535,
             why="the longest header the format can announce")
        set_(self, "proxy_header_timeout",
             _seconds("proxy_header_timeout", self.proxy_header_timeout))
        set_(self, "handshake_timeout",
             _seconds("handshake_timeout", self.handshake_timeout, allow_none=False))

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
    :class:`Settings` field (tests/packaging/test_typing.py checks that they stay the same)."""

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
