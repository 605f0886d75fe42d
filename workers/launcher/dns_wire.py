"""What the DNS relay (dns_relay.py) reads of a job's datagram, and the one answer it writes
itself. A pure module: bytes in, a verdict or bytes out.

A job's datagram is passed on only when it is one plain question, as a stub resolver asks it
(glibc, musl, c-ares): the header of a standard query (QR 0, opcode 0), one question and no
records but an EDNS0 OPT, class IN, a type other than a zone transfer (AXFR, IXFR: IXFR may be
asked over UDP) or ANY, and a name written out label by label (no compression pointer: a
question has nothing to point at). Anything else (an update, a notify, a datagram shaped like
an answer, a CHAOS `version.bind`) never reaches the host's resolver.
"""

from __future__ import annotations

HEADER = 12
QUERY_MAX = 4096  # bytes: a question with an OPT record is well under; the rest is not a stub's
NAME_MAX = 255
CLASS_IN = 1
REFUSED_TYPES = frozenset({251, 252, 255})  # IXFR, AXFR, ANY
OPT = 41
SERVFAIL, REFUSED = 2, 5


def plain_question(data: bytes) -> bool:
    if not HEADER <= len(data) <= QUERY_MAX or data[2] & 0xF8:  # QR and opcode
        return False
    qd, an, ns, ar = (int.from_bytes(data[i : i + 2], "big") for i in (4, 6, 8, 10))
    if (qd, an, ns) != (1, 0, 0) or ar > 1:
        return False
    end = _name_end(data, HEADER)
    if end is None or end + 4 > len(data):
        return False
    qtype, qclass = int.from_bytes(data[end : end + 2], "big"), int.from_bytes(data[end + 2 : end + 4], "big")
    if qclass != CLASS_IN or qtype in REFUSED_TYPES:
        return False
    rest = data[end + 4 :]
    return not rest if ar == 0 else _is_opt(rest)


def _name_end(data: bytes, at: int) -> int | None:
    """Where the question's name ends (past its root label), or None for a malformed one."""
    length = 0
    while at < len(data):
        label = data[at]
        if label == 0:
            return at + 1
        if label > 63:  # a compression pointer, or a reserved label type
            return None
        length += label + 1
        if length > NAME_MAX:
            return None
        at += 1 + label
    return None


def _is_opt(record: bytes) -> bool:
    """An EDNS0 OPT pseudo-record: the root name, type 41, its fixed fields and its data."""
    if len(record) < 11 or record[0] != 0 or int.from_bytes(record[1:3], "big") != OPT:
        return False
    return int.from_bytes(record[9:11], "big") == len(record) - 11


def answers(query: bytes, data: bytes) -> bool:
    """An answer to this query: its id, QR 1."""
    return len(data) >= HEADER and data[:2] == query[:2] and data[2] & 0x80 != 0


def failure(query: bytes, rcode: int) -> bytes:
    """The relay's own answer to a plain question it could not get answered (SERVFAIL) or will
    not ask now (REFUSED): the client tries again or gives up at once, not after its timeout."""
    end = _name_end(query, HEADER)
    question = query[HEADER : end + 4] if end is not None else b""
    flags = bytes([0x80 | (query[2] & 0x01), 0x80 | rcode])  # QR, RD as asked; RA, the code
    counts = (1 if question else 0).to_bytes(2, "big") + bytes(6)
    return query[:2] + flags + counts + question
