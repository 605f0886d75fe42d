"""Where a webhook may send, with real name resolution: loopback, link-local and private
targets refused unless allowed; the checked addresses are the ones a send connects to."""

from __future__ import annotations

import ipaddress
import socket

import pytest

from service.webhooks.targets import TargetRefused, check_target, is_private, parse_url


@pytest.mark.parametrize(
    "url",
    [
        "http://localhost/",
        "http://127.0.0.1/",
        "http://127.1.2.3:8080/x",
        "http://10.0.0.1/",
        "http://172.16.5.4/",
        "http://192.168.0.1/",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::1]/",
        "http://[fe80::1]/",
        "http://[fc00::1]/",
        "http://[::ffff:10.0.0.1]/",
        "http://0.0.0.0/",
        "http://100.64.0.1/",  # shared address space (carrier-grade NAT)
        "http://224.0.0.1/",
        "http://240.0.0.1/",
        "http://192.0.2.1/",  # documentation
    ],
)
def test_private_targets_are_refused_unless_allowed(url: str) -> None:
    with pytest.raises(TargetRefused, match="loopback, link-local or private"):
        check_target(url, allow_private=False)
    assert check_target(url, allow_private=True).addresses


TEREDO_SERVER = int(ipaddress.IPv4Address("65.54.227.120"))  # a public Teredo server


def embedding(form: str, ipv4: str) -> str:
    """An IPv6 address that embeds `ipv4` the way `form` does."""
    n = int(ipaddress.IPv4Address(ipv4))
    value = {
        "mapped": (0xFFFF << 32) | n,  # ::ffff:a.b.c.d
        "compatible": n,  # ::a.b.c.d
        "translated": (0xFFFF << 48) | n,  # ::ffff:0:a.b.c.d
        "nat64": int(ipaddress.IPv6Address("64:ff9b::")) | n,  # 64:ff9b::a.b.c.d
        "6to4": (0x2002 << 112) | (n << 80) | 1,  # 2002:AABB:CCDD::1
        # 2001:0:SERVER:FLAGS:PORT:CLIENT, the client's port and address with their bits inverted
        "teredo": (0x2001 << 112)
        | (TEREDO_SERVER << 64)
        | (0x8000 << 48)
        | (0x9C40 << 32)
        | (n ^ 0xFFFFFFFF),
    }[form]
    return str(ipaddress.IPv6Address(value))


EMBEDDINGS = ["mapped", "compatible", "translated", "nat64", "6to4", "teredo"]
INTERNAL = ["169.254.169.254", "127.0.0.1", "10.0.0.1"]


def test_the_embeddings_embed_what_they_say() -> None:
    """The test's own addresses, checked against the standard library's reading of them."""
    assert embedding("mapped", "10.0.0.1") == "::ffff:a00:1"
    assert embedding("compatible", "10.0.0.1") == "::a00:1"
    assert embedding("nat64", "169.254.169.254") == "64:ff9b::a9fe:a9fe"
    assert ipaddress.IPv6Address(embedding("6to4", "127.0.0.1")).sixtofour == ipaddress.IPv4Address(
        "127.0.0.1"
    )
    teredo = ipaddress.IPv6Address(embedding("teredo", "169.254.169.254")).teredo
    assert teredo == (ipaddress.IPv4Address("65.54.227.120"), ipaddress.IPv4Address("169.254.169.254"))


@pytest.mark.parametrize("ipv4", INTERNAL)
@pytest.mark.parametrize("form", EMBEDDINGS)
def test_an_ipv6_address_embedding_an_internal_ipv4_one_is_refused(form: str, ipv4: str) -> None:
    """Contract §7: refused as the embedded IPv4 address would be, as a literal and as a name's AAAA."""
    address = embedding(form, ipv4)
    assert is_private(ipv4) and is_private(address)
    with pytest.raises(TargetRefused, match="loopback, link-local or private"):
        check_target(f"http://[{address}]/hook", allow_private=False)

    def resolver(host: str, port: int, **_kw: object) -> list[tuple]:
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", (address, port, 0, 0))]

    with pytest.raises(TargetRefused, match="loopback, link-local or private"):
        check_target("https://hooks.example.com/", allow_private=False, resolver=resolver)
    assert check_target(f"http://[{address}]/hook", allow_private=True).addresses


@pytest.mark.parametrize("form", ["mapped", "compatible", "translated", "nat64", "6to4"])
def test_an_ipv6_address_embedding_a_public_ipv4_one_is_judged_by_it(form: str) -> None:
    address = embedding(form, "8.8.8.8")
    assert not is_private(address)
    assert check_target(f"http://[{address}]/hook", allow_private=False).addresses
    assert is_private(embedding(form, "192.168.1.1")) and is_private(embedding(form, "100.64.0.1"))


@pytest.mark.parametrize(
    "address",
    [
        "64:ff9b:1::808:808",  # NAT64 for local use (RFC 8215): private whatever it embeds
        "64:ff9b:1::a00:1",
        embedding("teredo", "8.8.8.8"),  # 2001::/32 is no global space itself
        "::",  # IPv4-compatible space, yet itself: unspecified
        "::1",  # and loopback
        "::2",  # 0.0.0.2: "this network"
    ],
)
def test_embedding_ranges_that_are_private_whatever_they_carry(address: str) -> None:
    assert is_private(address)


def test_localhost_resolves_to_loopback_only() -> None:
    target = check_target("http://localhost:8123/hook?x=1", allow_private=True)
    assert target.addresses and all(is_private(a) for a in target.addresses)
    assert set(target.addresses) <= {"127.0.0.1", "::1"}
    assert (target.scheme, target.host, target.port, target.path) == ("http", "localhost", 8123, "/hook?x=1")


def test_a_public_address_passes() -> None:
    target = check_target("https://1.1.1.1/hook", allow_private=False)
    assert target.addresses == ("1.1.1.1",) and target.port == 443
    assert not is_private("1.1.1.1") and not is_private("2606:4700:4700::1111")


def test_a_name_is_judged_by_every_address_it_resolves_to() -> None:
    """A name with one public and one private address is refused: the sender could reach either."""

    def resolver(host: str, port: int, **_kw: object) -> list[tuple]:
        assert host == "hooks.example.com"
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("1.1.1.1", port)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.2.3", port)),
        ]

    with pytest.raises(TargetRefused, match="10.1.2.3"):
        check_target("https://hooks.example.com/", allow_private=False, resolver=resolver)


def test_an_unresolvable_name_is_refused() -> None:
    with pytest.raises(TargetRefused, match="does not resolve"):
        check_target("http://no-such-host.invalid/", allow_private=True)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("ftp://1.1.1.1/", "only http and https"),
        ("javascript:alert(1)", "only http and https"),
        ("http://", "no host"),
        ("http://[::1", "not a valid URL"),
        ("http://1.1.1.1:0/", "port 0"),
        ("http://a:b@1.1.1.1/", "credentials"),
        ("http://1.1.1.1/\n", "control characters"),
        ("http://" + "a" * 64 + ".com/", "not a valid host name"),
        ("http://a..b/", "not a valid host name"),
    ],
)
def test_what_is_no_http_url(url: str, why: str) -> None:
    with pytest.raises(TargetRefused, match=why):
        parse_url(url)


def test_the_request_goes_to_the_checked_address_with_the_hosts_own_name() -> None:
    def resolver(host: str, port: int, **_kw: object) -> list[tuple]:
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("2606:4700::1", port, 0, 0))]

    target = check_target("https://Hooks.Example.com/in?a=1#frag", allow_private=False, resolver=resolver)
    assert target.request_url("2606:4700::1") == "https://[2606:4700::1]:443/in?a=1"
    assert target.host_header == "hooks.example.com"  # default port: not written
    other_port = check_target("http://[::1]:8080/", allow_private=True)
    assert other_port.host_header == "[::1]:8080" and other_port.request_url("::1") == "http://[::1]:8080/"
    idn = parse_url("http://bücher.example/")
    assert idn[1] == "xn--bcher-kva.example"
