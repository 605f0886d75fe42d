"""Where a webhook may send: an http(s) URL whose host resolves only to public addresses.

`check_target()` runs at registration (a refusal is the caller's 422) and again before every
delivery, so that a name re-pointed at a private address later is refused then too. The
addresses it checked are the ones the sender connects to (`Target.request_url`): the name is
not resolved a second time between the check and the connection (no DNS rebinding window).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, urlsplit, urlunsplit

Resolver = Callable[..., list[tuple[Any, ...]]]  # socket.getaddrinfo's shape
DEFAULT_PORTS = {"http": 80, "https": 443}


class TargetRefused(ValueError):
    """Why a URL is no webhook target; the message is shown to the user."""


class Unresolved(TargetRefused):
    """The host does not resolve now: no send is possible, yet nothing says it is private."""


@dataclass(frozen=True)
class Target:
    scheme: str
    host: str  # as in the URL, lowercased and in ASCII (IDNA); an IPv6 literal without brackets
    port: int
    path: str  # path and query, at least "/"
    addresses: tuple[str, ...]  # every address the host resolved to, each checked

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == DEFAULT_PORTS[self.scheme] else f"{host}:{self.port}"

    def request_url(self, address: str) -> str:
        """The URL with the host replaced by one checked address (the Host header and, for
        https, the TLS server name keep the host's own name: `host_header`, `host`)."""
        literal = f"[{address}]" if ":" in address else address
        return urlunsplit((self.scheme, f"{literal}:{self.port}", self.path, "", ""))


def parse_url(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, path) of an http(s) URL, or TargetRefused saying what is wrong."""
    parts, port = _split(url)
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise TargetRefused("only http and https URLs are allowed")
    if parts.username is not None or parts.password is not None:
        raise TargetRefused("credentials in the URL are not supported: the signature authenticates")
    host = _host(parts)
    if port == 0:
        raise TargetRefused("port 0 is no port to send to")
    path = parts.path or "/"
    if parts.query:
        path = f"{path}?{parts.query}"
    return scheme, host, port if port is not None else DEFAULT_PORTS[scheme], path


def _split(url: str) -> tuple[SplitResult, int | None]:
    """The URL's parts and its port (None: the scheme's default), or TargetRefused."""
    if any(ch.isspace() or not ch.isprintable() for ch in url):
        raise TargetRefused("the URL may not contain spaces or control characters")
    try:
        parts = urlsplit(url)
        return parts, parts.port
    except ValueError as exc:
        raise TargetRefused(f"not a valid URL: {exc}") from None


def _host(parts: SplitResult) -> str:
    """The URL's host without a trailing dot, a name in ASCII (IDNA), or TargetRefused."""
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise TargetRefused("the URL has no host")
    if ":" not in host:  # a name (or an IPv4 literal): as DNS is asked about it, in ASCII
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError:
            raise TargetRefused("the URL's host is not a valid host name") from None
        if len(host) > 253:
            raise TargetRefused("the URL's host is not a valid host name")
    return host


# IPv6 addresses that carry an IPv4 address inside them (contract §7): a send to one reaches, or
# is translated to, that IPv4 address, so each is judged as its IPv4 address would be.
NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052's well-known prefix: the last 32 bits
NAT64_LOCAL = ipaddress.IPv6Network("64:ff9b:1::/48")  # RFC 8215, local use: private as a whole
IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")  # deprecated (RFC 4291): the last 32 bits
IPV4_TRANSLATED = ipaddress.IPv6Network("::ffff:0:0:0/96")  # SIIT (RFC 2765): the last 32 bits


def embedded_ipv4(ip: ipaddress.IPv6Address) -> tuple[ipaddress.IPv4Address, ...]:
    """The IPv4 addresses an IPv6 address embeds: IPv4-mapped (``::ffff:a.b.c.d``),
    IPv4-compatible (``::a.b.c.d``, but not ``::`` or ``::1``), IPv4-translated, NAT64
    (``64:ff9b::a.b.c.d``), 6to4 (``2002:AABB:CCDD::/48``) and Teredo (its server and its
    client, whose bits are inverted); none for any other address."""
    if ip.ipv4_mapped is not None:
        return (ip.ipv4_mapped,)
    if ip.sixtofour is not None:
        return (ip.sixtofour,)
    if ip.teredo is not None:
        return ip.teredo
    last32 = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip in NAT64 or ip in IPV4_TRANSLATED:
        return (last32,)
    if ip in IPV4_COMPATIBLE and int(ip) > 1:  # `::` and `::1` are themselves, not 0.0.0.0 or 0.0.0.1
        return (last32,)
    return ()


def is_private(address: str) -> bool:
    """Loopback, link-local, private, reserved, multicast, unspecified, shared (CGNAT) or
    documentation space: anything but a global unicast address. An IPv6 address that embeds an
    IPv4 address (`embedded_ipv4`) is judged by that IPv4 address, whatever the Python
    version's tables say of the IPv6 prefix; a Teredo address is private when either of its
    IPv4 addresses is, or when the IPv6 address itself is. NAT64's local-use prefix
    ``64:ff9b:1::/48`` is private as a whole (what it translates to is the network's choice)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone ("%eth0") names no address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in NAT64_LOCAL:
            return True
        embedded = embedded_ipv4(ip)
        if any(_not_global(v4) for v4 in embedded):
            return True
        if embedded and ip.teredo is None:
            return False  # only the IPv4 address counts: it is where the packets go
    return _not_global(ip)


def _not_global(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return ip.is_multicast or ip.is_unspecified or not ip.is_global


def resolve(host: str, port: int, resolver: Resolver = socket.getaddrinfo) -> tuple[str, ...]:
    """Every address `host` resolves to, in the resolver's order, each once."""
    try:
        infos = resolver(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError) as exc:
        raise Unresolved(f"the host {host!r} does not resolve ({exc})") from None
    addresses: list[str] = []
    for info in infos:
        address = str(info[4][0])
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise Unresolved(f"the host {host!r} does not resolve")
    return tuple(addresses)


def check_target(url: str, *, allow_private: bool, resolver: Resolver = socket.getaddrinfo) -> Target:
    """The URL's target, resolved and checked; TargetRefused when it may not be sent to."""
    scheme, host, port, path = parse_url(url)
    addresses = resolve(host, port, resolver)
    if not allow_private:
        private = [a for a in addresses if is_private(a)]
        if private:
            raise TargetRefused(
                f"the host {host!r} resolves to {private[0]}, a loopback, link-local or private "
                "address (allowed only with TORCHJOBS_WEBHOOK_ALLOW_PRIVATE=true)"
            )
    return Target(scheme=scheme, host=host, port=port, path=path, addresses=addresses)
