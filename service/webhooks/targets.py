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
from urllib.parse import urlsplit, urlunsplit

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
    if any(ch.isspace() or not ch.isprintable() for ch in url):
        raise TargetRefused("the URL may not contain spaces or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise TargetRefused(f"not a valid URL: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise TargetRefused("only http and https URLs are allowed")
    if parts.username is not None or parts.password is not None:
        raise TargetRefused("credentials in the URL are not supported: the signature authenticates")
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
    if port == 0:
        raise TargetRefused("port 0 is no port to send to")
    path = parts.path or "/"
    if parts.query:
        path = f"{path}?{parts.query}"
    return scheme, host, port if port is not None else DEFAULT_PORTS[scheme], path


def is_private(address: str) -> bool:
    """Loopback, link-local, private, reserved, multicast, unspecified, shared (CGNAT) or
    documentation space: anything but a global unicast address. An IPv4-mapped IPv6 address
    is judged by its IPv4 address."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone ("%eth0") names no address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
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
