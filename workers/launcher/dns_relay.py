"""Name look-ups for routed job nodes: a DNS relay the worker holds inside each node's network
namespace, as Docker's embedded DNS does for a container.

A routed node's sandbox reads `/etc/resolv.conf` naming `RELAY_ADDRESS` (the node's own
loopback, `relay_conf`). There the worker binds a UDP socket of its own (`open_in`: made in the
node's namespace, owned by the worker, so a rank cannot take the port, which is below 1024), and
passes each plain query on to the host's resolvers from the host's side, their answer back.
Why not open the host's resolvers to the job (what the walls did before): a resolver on the
host's loopback (systemd-resolved's 127.0.0.53, a dnsmasq or unbound cache: Ubuntu's default)
cannot be reached from a network namespace at all, so a routed job on such a host resolved no
name; and a resolver on the LAN is a service of the cluster's the job then talked to directly.

What passes: one plain question, as a stub resolver asks it (dns_wire.py: no update, no zone
transfer, no ANY), at most `RATE` datagrams a second per node (a burst of `BURST`; junk counts
too), `PENDING_MAX` in flight per node and `ALL_PENDING_MAX` in all (a flood costs the job its
own look-ups, not the worker's descriptors, nor the host's conntrack table, which the walls
cap per job node for the same reason). Back goes only the answer to that query: from the
resolver it was sent to (a connected socket, a new source port each), with its id, QR 1. An
unanswered query is sent to the next resolver after `TRY_S`, as glibc would; with none left,
the relay answers SERVFAIL itself (REFUSED when over the limits in flight), so the client
gives up at once rather than after its own timeout.

systemd-resolved's stub (127.0.0.53) is not asked where its upstream list says who it asks:
the stub also answers `_gateway`, `_outbound` and the host's own name with the host's
addresses (which the walls keep from jobs), and mDNS and LLMNR names from the LAN.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import logging
import os
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from workers.launcher import dns_wire

log = logging.getLogger("torchjobs.worker")

RELAY_ADDRESS = "127.0.0.11"  # in the node's namespace: its loopback, as Docker's
DNS_PORT = 53
DATAGRAM_MAX = 65535
TRY_S = 2.0
RATE, BURST = 100.0, 500.0  # datagrams a second per node: under 4,096 conntrack entries at 30 s each
PENDING_MAX = 32
ALL_PENDING_MAX = 512
TICK_S = 0.2
CLONE_NEWNET = 0x40000000
KEPT_OPTIONS = ("search", "domain", "options")  # of the host's resolv.conf, for the job's
HOST_CONF = Path("/etc/resolv.conf")
RESOLVED_STUB = "127.0.0.53"
RESOLVED_UPSTREAMS = Path("/run/systemd/resolve/resolv.conf")  # systemd-resolved's own list


def upstreams(text: str | None = None, resolved: str | None = None) -> list[str]:
    """The host's resolvers (`/etc/resolv.conf`), loopback ones included: the relay asks from
    the host's side. systemd-resolved's stub is replaced by the servers it asks (`resolved`,
    its own list), where it names any. None named means glibc's default, 127.0.0.1."""
    found = _nameservers(read_or_empty(HOST_CONF) if text is None else text)
    if RESOLVED_STUB in found:
        behind = _nameservers(read_or_empty(RESOLVED_UPSTREAMS) if resolved is None else resolved)
        behind = [a for a in behind if not ipaddress.ip_address(a.split("%")[0]).is_loopback]
        if behind:
            at = found.index(RESOLVED_STUB)
            found[at : at + 1] = [a for a in behind if a not in found]
    return found or ["127.0.0.1"]


def read_or_empty(path: Path) -> str:
    """A resolv.conf's text; a missing or unreadable one is an empty one (as glibc takes it)."""
    try:
        return path.read_text()
    except OSError:
        return ""


def _nameservers(text: str) -> list[str]:
    found: list[str] = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0] == "nameserver":
            with contextlib.suppress(ValueError):
                address = ipaddress.ip_address(fields[1])
                if not (address.is_unspecified or address.is_multicast) and str(address) not in found:
                    found.append(str(address))
    return found


def relay_conf(folder: Path, host_text: str | None = None) -> Path:
    """The resolv.conf a routed node's sandbox binds: the relay, and the host's search domains
    and options (`options edns0` lets answers past 512 bytes come by UDP, the relay's only way)."""
    if host_text is None:
        host_text = read_or_empty(HOST_CONF)
    kept = [line for line in host_text.splitlines() if (line.split() or [""])[0] in KEPT_OPTIONS]
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    path = folder / "resolv.conf"
    path.write_text("\n".join([f"nameserver {RELAY_ADDRESS}", *kept]) + "\n")
    path.chmod(0o644)
    return path


def open_in(netns_pid: int, port: int = DNS_PORT) -> socket.socket:
    """A UDP socket bound at RELAY_ADDRESS in the network namespace of process `netns_pid`,
    made by a thread of its own that enters it (a namespace is a thread's: the worker's others
    stay where they are) and dies after."""
    made: list[socket.socket] = []
    failed: list[BaseException] = []

    def make() -> None:
        try:
            made.append(_bound_in(netns_pid, port))
        except BaseException as exc:  # handed to the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=make, name="dns-relay-open", daemon=True)
    thread.start()
    thread.join()
    if failed:
        raise OSError(f"no DNS relay socket in the node's network: {failed[0]}") from failed[0]
    return made[0]


def _bound_in(netns_pid: int, port: int) -> socket.socket:
    libc = ctypes.CDLL(None, use_errno=True)
    with contextlib.ExitStack() as fds:
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        fds.callback(os.close, own)
        theirs = os.open(f"/proc/{netns_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        fds.callback(os.close, theirs)
        if libc.setns(theirs, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns into the node's network namespace")
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                sock.bind((RELAY_ADDRESS, port))
            except OSError:
                sock.close()
                raise
        finally:
            if libc.setns(own, CLONE_NEWNET) != 0:  # the thread ends here anyway
                log.error("DNS relay: could not leave a node's network namespace")
    sock.setblocking(False)
    return sock


@dataclass
class _Pending:
    listener: socket.socket
    client: tuple[str, int]
    query: bytes
    tried: int = 0
    deadline: float = 0.0


@dataclass
class _Listener:
    """A node's socket, its queries in flight and its token bucket (RATE, BURST)."""

    sock: socket.socket
    rate: float = RATE
    burst: float = BURST
    pending: int = 0
    tokens: float = field(init=False)  # a full bucket to start
    filled_at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.tokens = self.burst

    def spend(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.filled_at) * self.rate)
        self.filled_at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


@dataclass
class DnsRelay:
    """One per worker: a thread and a selector over every node's socket and every query's.
    Only `serve` and `close` are called from other threads (through `_adds`, `_removes`)."""

    servers: list[str]
    port: int = DNS_PORT  # the resolvers'
    try_s: float = TRY_S
    listen_port: int = DNS_PORT  # the relay's, in each node's namespace (tests: 0, any)
    rate: float = RATE
    burst: float = BURST
    _selector: selectors.BaseSelector = field(default_factory=selectors.DefaultSelector)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _adds: list[socket.socket] = field(default_factory=list)
    _removes: list[socket.socket] = field(default_factory=list)
    _listeners: dict[socket.socket, _Listener] = field(default_factory=dict)
    _pending: dict[socket.socket, _Pending] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _stopped: bool = False  # under _lock: the loop has ended, serve and close act alone
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="dns-relay", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def serve(self, netns_pid: int) -> socket.socket:
        """Relay for the node whose sandbox's first process is `netns_pid`, until `close`."""
        sock = open_in(netns_pid, self.listen_port)
        with self._lock:
            if not self._stopped:
                self._adds.append(sock)
                return sock
        sock.close()
        raise OSError("the worker's DNS relay has stopped")

    def close(self, sock: socket.socket) -> None:
        """The node ended: its socket goes (it holds the node's namespace, and its veth, alive)."""
        with self._lock:
            if not self._stopped:
                self._removes.append(sock)
                return
        sock.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._turn()
            except Exception:  # a defect here must not end every job's look-ups for good
                log.exception("DNS relay: a turn failed")
                time.sleep(TICK_S)
        with self._lock:
            self._stopped = True
            self._removes.extend(self._adds)
            self._adds.clear()
        self._removes.extend(self._listeners)
        self._apply_changes()

    def _turn(self) -> None:
        self._apply_changes()
        for key, _ in self._selector.select(TICK_S):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            with contextlib.suppress(OSError):  # a datagram that could not be read or sent
                if sock in self._listeners:
                    self._take_query(self._listeners[sock])
                elif sock in self._pending:
                    self._take_answer(sock)
        self._expire(time.monotonic())

    def _apply_changes(self) -> None:
        with self._lock:
            adds, removes = self._adds[:], self._removes[:]
            self._adds.clear()
            self._removes.clear()
        for sock in adds:
            self._listeners[sock] = _Listener(sock, self.rate, self.burst)
            self._selector.register(sock, selectors.EVENT_READ)
        for sock in removes:
            try:
                if self._listeners.pop(sock, None) is not None:
                    self._selector.unregister(sock)
                for upstream in [u for u, p in self._pending.items() if p.listener is sock]:
                    self._drop(upstream)
            finally:
                sock.close()

    def _take_query(self, listener: _Listener) -> None:
        data, client = listener.sock.recvfrom(DATAGRAM_MAX)
        if not listener.spend(time.monotonic()) or not dns_wire.plain_question(data):
            return  # over its rate, or not a question a stub asks: no answer at all
        if listener.pending >= PENDING_MAX or len(self._pending) >= ALL_PENDING_MAX:
            listener.sock.sendto(dns_wire.failure(data, dns_wire.REFUSED), client)
            return
        self._send(_Pending(listener.sock, client, data))

    def _send(self, pending: _Pending) -> None:
        """To the next resolver; with none left, SERVFAIL to the client."""
        while pending.tried < len(self.servers):
            server = self.servers[pending.tried]
            upstream = socket.socket(socket.AF_INET6 if ":" in server else socket.AF_INET, socket.SOCK_DGRAM)
            try:
                upstream.setblocking(False)
                upstream.connect((server, self.port))
                upstream.send(pending.query)
                self._selector.register(upstream, selectors.EVENT_READ)
            except OSError:
                upstream.close()
                pending.tried += 1
                continue
            pending.deadline = time.monotonic() + self.try_s
            self._pending[upstream] = pending
            self._listeners[pending.listener].pending += 1
            return
        if pending.listener in self._listeners:
            pending.listener.sendto(dns_wire.failure(pending.query, dns_wire.SERVFAIL), pending.client)

    def _take_answer(self, upstream: socket.socket) -> None:
        pending = self._pending[upstream]
        try:
            data = upstream.recv(DATAGRAM_MAX)
        except OSError:  # refused (no resolver there): the next one at once
            self._retry(upstream)
            return
        if not dns_wire.answers(pending.query, data):
            return  # not the answer: the query waits on for it
        self._drop(upstream)
        pending.listener.sendto(data, pending.client)

    def _expire(self, now: float) -> None:
        for upstream in [u for u, p in self._pending.items() if p.deadline <= now]:
            with contextlib.suppress(OSError):
                self._retry(upstream)

    def _retry(self, upstream: socket.socket) -> None:
        pending = self._drop(upstream)
        pending.tried += 1
        if pending.listener in self._listeners:
            self._send(pending)

    def _drop(self, upstream: socket.socket) -> _Pending:
        pending = self._pending.pop(upstream)
        listener = self._listeners.get(pending.listener)
        if listener is not None:
            listener.pending -= 1
        try:
            self._selector.unregister(upstream)
        finally:
            upstream.close()
        return pending
