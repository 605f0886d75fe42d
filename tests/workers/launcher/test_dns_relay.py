"""The DNS relay's rules, without a network (the live relay into a routed sandbox:
test_job_network.py)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.launcher import dns_relay, dns_wire


def _question(
    name: bytes = b"\x05model\x03hub\x00", qtype: int = 1, qclass: int = 1, flags: int = 0x01
) -> bytes:
    header = b"\x12\x34" + bytes([flags, 0]) + b"\x00\x01" + bytes(6)
    return header + name + qtype.to_bytes(2, "big") + qclass.to_bytes(2, "big")


OPT_RECORD = b"\x00\x00\x29\x04\xd0" + bytes(4) + b"\x00\x00"  # EDNS0, 1232 bytes, no options


def test_only_one_plain_question_is_passed_and_only_its_answer_comes_back() -> None:
    query = _question()
    assert dns_wire.plain_question(query)
    with_opt = bytearray(_question() + OPT_RECORD)
    with_opt[11] = 1  # ARCOUNT 1: the OPT record
    assert dns_wire.plain_question(bytes(with_opt))
    assert dns_wire.plain_question(_question(qtype=28)) and dns_wire.plain_question(_question(qtype=12))
    refused = [
        _question(flags=0x28),  # opcode 5: a dynamic update
        _question(flags=0x20),  # opcode 4: a notify
        _question(flags=0x81),  # QR 1: shaped like an answer
        _question(qtype=252),  # AXFR
        _question(qtype=251),  # IXFR, which may be asked over UDP
        _question(qtype=255),  # ANY
        _question(b"\x07version\x04bind\x00", qtype=16, qclass=3),  # CHAOS
        _question(b"\xc0\x0c"),  # a compression pointer
        _question(b"\x05model"),  # a name never ended
        _question() + b"trailing",
        _question() + OPT_RECORD,  # a record the header does not count
        query[:4] + b"\x00\x02" + query[6:],  # two questions
        query[:6] + b"\x00\x01" + query[8:],  # an answer record in a query
        _question(b"\x3f" + b"a" * 63) * 5,  # no end, and far too long a name
        _question() + bytes(5000),
        b"\x12\x34\x01",  # no whole header
    ]
    for datagram in refused:
        assert not dns_wire.plain_question(datagram), datagram[:40]
    assert dns_wire.answers(query, b"\x12\x34\x81\x80" + bytes(8))
    assert not dns_wire.answers(query, b"\x43\x21\x81\x80" + bytes(8))  # another query's id
    assert not dns_wire.answers(query, query)  # not an answer


def test_the_relay_s_own_failure_answers_the_question_asked() -> None:
    query = _question()
    failed = dns_wire.failure(query, dns_wire.SERVFAIL)
    assert failed[:2] == query[:2] and dns_wire.answers(query, failed)
    assert failed[3] & 0x0F == dns_wire.SERVFAIL and failed[2] & 0x01  # RD as asked
    assert failed[4:6] == b"\x00\x01" and failed[12:] == query[12:]  # its question, nothing more


def test_systemd_resolved_s_stub_is_replaced_by_the_servers_it_asks() -> None:
    """The stub answers `_gateway`, `_outbound` and the host's name with the host's addresses:
    the relay asks resolved's upstreams instead, where resolved names any."""
    host = "nameserver 127.0.0.53\noptions edns0 trust-ad\nsearch corp.test\n"
    behind = "nameserver 10.0.0.2\nnameserver 127.0.0.1\nnameserver 10.0.0.3\n"
    assert dns_relay.upstreams(host, behind) == ["10.0.0.2", "10.0.0.3"]
    assert dns_relay.upstreams(host, "# no upstream known\n") == ["127.0.0.53"]  # the stub, then
    assert dns_relay.upstreams("nameserver 10.0.0.9\n", behind) == ["10.0.0.9"]


def test_the_host_s_resolvers_loopback_ones_included_are_asked() -> None:
    text = (
        "# systemd-resolved\nnameserver 127.0.0.53\nnameserver 0.0.0.0\nnameserver 224.0.0.1\n"
        "nameserver 10.255.255.53\nnameserver 2001:db8::53\nnameserver fe80::1%eth0\n"
        "nameserver 127.0.0.53\noptions edns0 trust-ad\n"
    )
    expected = ["127.0.0.53", "10.255.255.53", "2001:db8::53", "fe80::1%eth0"]
    assert dns_relay.upstreams(text, "") == expected  # a stub that names no upstream stays
    assert dns_relay.upstreams("search x\n", "") == ["127.0.0.1"]  # glibc's default: none named


def test_the_job_s_resolv_conf_names_the_relay_and_keeps_the_host_s_options(tmp_path: Path) -> None:
    host = "nameserver 127.0.0.53\nsearch corp.test\noptions edns0 trust-ad\nsortlist 10.0.0.0\n"
    conf = dns_relay.relay_conf(tmp_path / "dns", host)
    assert conf.read_text() == "nameserver 127.0.0.11\nsearch corp.test\noptions edns0 trust-ad\n"
    assert conf.stat().st_mode & 0o777 == 0o644


@pytest.fixture
def silent_resolver() -> Iterator[int]:
    """A resolver that takes every question and answers none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
        server.bind(("127.0.0.1", 0))
        yield server.getsockname()[1]


def _relay(
    servers: list[str], port: int, **limits: float
) -> tuple[dns_relay.DnsRelay, socket.socket, socket.socket]:
    """A relay serving this process's own namespace on a free port, and a client of it."""
    relay = dns_relay.DnsRelay(servers, port=port, try_s=0.3, listen_port=0, **limits)
    relay.start()
    listener = relay.serve(os.getpid())
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.connect(listener.getsockname())
    client.settimeout(2.0)
    return relay, listener, client


def _code(answer: bytes) -> int:
    return answer[3] & 0x0F


@pytest.mark.skipif(os.geteuid() != 0, reason="setns needs root")
def test_a_question_no_resolver_answers_gets_servfail_and_one_over_the_limits_refused(
    silent_resolver: int,
) -> None:
    relay, listener, client = _relay(["127.0.0.1"], silent_resolver)
    try:
        for n in range(dns_relay.PENDING_MAX + 3):  # the first PENDING_MAX wait on the resolver
            client.send(b"%c%c" % (n // 256, n % 256) + _question()[2:])
        refused = [client.recv(512) for _ in range(3)]
        assert {_code(a) for a in refused} == {dns_wire.REFUSED}
        late = [client.recv(512) for _ in range(dns_relay.PENDING_MAX)]  # after try_s, each
        assert {_code(a) for a in late} == {dns_wire.SERVFAIL}
    finally:
        relay.close(listener)
        relay.stop()
        client.close()
    assert listener.fileno() == -1


@pytest.mark.skipif(os.geteuid() != 0, reason="setns needs root")
def test_a_node_past_its_rate_gets_no_answer_and_a_dead_resolver_gives_servfail_at_once() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as closed:
        closed.bind(("127.0.0.1", 0))
        dead = closed.getsockname()[1]  # nothing listens there once this is closed
    relay, listener, client = _relay(["127.0.0.1"], dead, rate=5.0, burst=20.0)
    try:
        sent = 60
        for _ in range(sent):
            client.send(_question())
        client.settimeout(0.5)
        answered = []
        with contextlib.suppress(TimeoutError):
            while True:
                answered.append(client.recv(512))
        assert {_code(a) for a in answered} == {dns_wire.SERVFAIL}  # refused at once, so answered
        # the burst and what refilled meanwhile; the rest dropped unanswered
        assert 20 <= len(answered) < 30, len(answered)
    finally:
        relay.stop()
        client.close()
    assert listener.fileno() == -1  # closed with the relay
