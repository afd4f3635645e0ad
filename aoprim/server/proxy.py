"""Layer 2 -- PROXY protocol policy: behind a load balancer (HAProxy, nginx ``stream``, Envoy,
a cloud network balancer) the real client's address arrives in a PROXY protocol header
(v1 text or v2 binary) that the balancer puts before the stream.

The header itself is parsed and validated in the compiled receive path
(:class:`aoprim.server._proxyproto.ProxyParser`, run by ``Receiver(proxy=...)``); this module
holds the policy around it, in Python:

- ``proxy_protocol`` (``None`` off, ``"v1"``, ``"v2"``, ``"any"``) and ``trusted_proxies``
  (networks, validated once into :class:`~.config.Settings`);
- the accept-time check: a connection whose socket peer is outside ``trusted_proxies`` is
  closed before a byte is read (logged at INFO, counted as ``closes["proxy_untrusted"]``);
  an AF_UNIX peer (``sock=`` a Unix socket) is trusted: the filesystem guards it;
- what a parsed header means for the session: ``peer`` becomes the client's ``(host,
  port)`` and ``proxy_peer`` the balancer's.  v2 LOCAL (the balancer's own health checks),
  v1 UNKNOWN, v2 UNSPEC and v2 UNIX (no (host, port) to give) keep the balancer's address
  as ``peer``; ``proxy_peer`` is then the same address, so ``peer == proxy_peer`` tells
  such a session apart.  A header refused (malformed, wrong version, too long, EOF inside
  it) closes the session with a logged WARNING, counted as ``closes["proxy"]``; a header not
  complete ``proxy_header_timeout`` seconds (default 10) after the accept closes it, counted
  as ``closes["timeout"]``.

The handler meets a session only once its header is read: ``on_connect`` runs then (with
``peer`` already the client's), and a session refused before that gets no ``on_close``
and no broadcasts.
"""
from __future__ import annotations

import ipaddress
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import socket

    from .config import _TrustedProxies
    from .stats import Stats

__all__ = ["PROXY_MODES", "DEFAULT_TRUSTED", "DEFAULT_MAX_HEADER", "DEFAULT_HEADER_TIMEOUT", "parse_mode",
           "parse_trusted", "TrustedPeers", "client_address", "refuse_untrusted"]

log = logging.getLogger("aoprim.server")

# proxy_protocol -> Receiver(proxy=...): which versions the parser accepts
PROXY_MODES: dict[str | None, int] = {None: 0, "v1": 1, "v2": 2, "any": 3}
DEFAULT_TRUSTED = ("127.0.0.0/8", "::1/128")
_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")    # IPv4-mapped IPv6 addresses
# The longest header accepted (16-byte v2 fixed part + addresses + TLVs).  The format allows
# 16 + 65535; balancers send far less (HAProxy's TLVs, AWS's VPC endpoint id: tens of
# bytes), and nothing above 232 bytes is ever stored -- the limit bounds the bytes read
# before the first frame.
DEFAULT_MAX_HEADER = 4096
# Seconds a connection has to complete its PROXY header, from the moment it is accepted
# (whatever frame_timeout is: None there must not keep a silent connection forever).  A
# balancer sends the header with or right after its connect; None: no deadline.
DEFAULT_HEADER_TIMEOUT = 10.0


def parse_mode(v: object) -> int:
    """``proxy_protocol`` -> 0..3 (TypeError for a non-string, ValueError for another
    string)."""
    if v is not None and not isinstance(v, str):
        raise TypeError(f"proxy_protocol must be None, 'v1', 'v2' or 'any', not "
                        f"{type(v).__name__}")
    if v not in PROXY_MODES:
        raise ValueError(f"proxy_protocol must be None, 'v1', 'v2' or 'any', not {v!r}")
    return PROXY_MODES[v]


def parse_trusted(v: _TrustedProxies
                  ) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """``trusted_proxies`` (a network string or an iterable of them, or of ipaddress
    networks/addresses) -> a tuple of ipaddress networks.  Host bits are allowed
    ("10.1.2.3/8" means 10.0.0.0/8); a bare address is a /32 or /128."""
    if isinstance(v, (str, ipaddress.IPv4Network, ipaddress.IPv6Network)):
        v = (v,)
    try:
        items = tuple(v)
    except TypeError:
        raise TypeError("trusted_proxies must be a network (str) or an iterable of "
                        f"networks, not {type(v).__name__}") from None
    nets = []
    for item in items:
        try:
            nets.append(ipaddress.ip_network(item, strict=False))
        except (ValueError, TypeError):
            raise ValueError(f"trusted_proxies: {item!r} is not an IP network "
                             "(e.g. 10.0.0.0/8, 192.0.2.7, ::1/128)") from None
    return tuple(nets)


class TrustedPeers:
    """``trusted(addr) -> bool`` for an accepted socket's peer address."""

    __slots__ = ("v4", "v6")

    def __init__(self, networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
                 ) -> None:
        v4 = [n for n in networks if isinstance(n, ipaddress.IPv4Network)]
        v6 = []
        for n in networks:
            if isinstance(n, ipaddress.IPv6Network):
                if n.subnet_of(_MAPPED) and n.prefixlen >= 96:
                    # an IPv4-mapped network ("::ffff:127.0.0.1/128") is that IPv4 network:
                    # it matches the peer whether a dual-stack or an IPv4 listener saw it
                    v4.append(ipaddress.IPv4Network((int(n.network_address) & 0xFFFFFFFF,
                                                     n.prefixlen - 96)))
                v6.append(n)
        self.v4 = tuple(v4)
        self.v6 = tuple(v6)

    def __call__(self, addr: Any) -> bool:
        if not isinstance(addr, tuple):
            return True                 # AF_UNIX: guarded by the filesystem
        try:
            ip = ipaddress.ip_address(addr[0].split("%", 1)[0])
        except ValueError:
            return False
        if ip.version == 6 and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped         # a dual-stack listener's IPv4 peer (see __init__)
        nets = self.v4 if ip.version == 4 else self.v6
        return any(ip in n for n in nets)


def client_address(header: tuple[int, str, str, Any, Any], balancer: Any) -> Any:
    """The session's ``peer`` for a parsed header ``(version, command, family, src, dst)``:
    the client's ``(host, port)`` when the header carries one, else ``balancer``."""
    src = header[3]
    if header[1] == "PROXY" and type(src) is tuple:
        return src
    return balancer


def refuse_untrusted(sock: socket.socket, addr: Any, stats: Stats) -> None:
    """Close an accepted connection from outside ``trusted_proxies`` before reading it."""
    stats.count_close("proxy_untrusted")
    log.info("connection from %s refused: not in trusted_proxies (proxy_protocol is on)",
             addr)
    try:
        sock.close()
    except OSError:
        pass
