"""The DNS relay's rules, without a network (the live relay into a routed sandbox:
test_job_network.py)."""

from __future__ import annotations

from pathlib import Path

from workers.launcher import dns_relay


def test_only_a_standard_query_is_passed_and_only_its_answer_comes_back() -> None:
    query = b"\x12\x34\x01\x00" + bytes(8)
    assert dns_relay.is_query(query)
    assert not dns_relay.is_query(b"\x12\x34\x28\x00" + bytes(8))  # opcode 5: a dynamic update
    assert not dns_relay.is_query(b"\x12\x34\x81\x80" + bytes(8))  # QR 1: an answer
    assert not dns_relay.is_query(b"\x12\x34\x01")  # no whole header
    assert dns_relay.answers(query, b"\x12\x34\x81\x80" + bytes(8))
    assert not dns_relay.answers(query, b"\x43\x21\x81\x80" + bytes(8))  # another query's id
    assert not dns_relay.answers(query, query)  # not an answer


def test_the_host_s_resolvers_loopback_ones_included_are_asked() -> None:
    text = (
        "# systemd-resolved\nnameserver 127.0.0.53\nnameserver 0.0.0.0\nnameserver 224.0.0.1\n"
        "nameserver 10.255.255.53\nnameserver 2001:db8::53\nnameserver fe80::1%eth0\n"
        "nameserver 127.0.0.53\noptions edns0 trust-ad\n"
    )
    assert dns_relay.upstreams(text) == ["127.0.0.53", "10.255.255.53", "2001:db8::53", "fe80::1%eth0"]
    assert dns_relay.upstreams("search x\n") == ["127.0.0.1"]  # glibc's default: none named


def test_the_job_s_resolv_conf_names_the_relay_and_keeps_the_host_s_options(tmp_path: Path) -> None:
    host = "nameserver 127.0.0.53\nsearch corp.test\noptions edns0 trust-ad\nsortlist 10.0.0.0\n"
    conf = dns_relay.relay_conf(tmp_path / "dns", host)
    assert conf.read_text() == "nameserver 127.0.0.11\nsearch corp.test\noptions edns0 trust-ad\n"
    assert conf.stat().st_mode & 0o777 == 0o644
