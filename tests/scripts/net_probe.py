"""What a job's network reaches (contract §7 v3): each HOST:PORT given, as one JSON line.

`python net_probe.py WORLD:PORT [HOST:PORT ...]`: the first is retried for a while (a routed
network is plumbed a moment after the ranks start); `GATEWAY:PORT` probes the job's own
gateway (the host's end of its veth). Also said: the resolver its resolv.conf names, and what a
datagram that is no DNS query gets there ("TimeoutError": something holds the port and drops
it, as the worker's relay does; "ConnectionRefusedError": nothing listens)."""

import json
import socket
import sys
import time


def reach(host: str, port: int, timeout: float = 2.0) -> str:
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            return conn.recv(16).decode() or "connected"
    except OSError as exc:
        return type(exc).__name__


def gateway() -> str | None:
    with open("/proc/net/route") as fh:
        for line in fh.read().splitlines()[1:]:
            fields = line.split()
            if fields[1] == "00000000" and fields[2] != "00000000":
                return socket.inet_ntoa(bytes.fromhex(fields[2])[::-1])
    return None


first, *rest = sys.argv[1:]
host, port = first.rsplit(":", 1)
deadline = time.monotonic() + 20
seen = {first: reach(host, int(port))}
while seen[first] in ("OSError", "TimeoutError", "ConnectionRefusedError") and time.monotonic() < deadline:
    time.sleep(0.2)
    seen[first] = reach(host, int(port))
for target in rest:
    host, port = target.rsplit(":", 1)
    host = gateway() or "no-gateway" if host == "GATEWAY" else host
    seen[target] = reach(host, int(port)) if host != "no-gateway" else "no route"


def resolver() -> str:
    with open("/etc/resolv.conf") as fh:
        return " ".join(line.split()[1] for line in fh if line.startswith("nameserver"))


def not_a_query(address: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect((address, 53))
            sock.send(b"\x00\x01\x80\x00" + bytes(8))  # QR 1: an answer, never passed on
            sock.recv(512)
            return "answered"
        except OSError as exc:
            return type(exc).__name__


seen["resolver"] = resolver()
seen["not_a_query"] = not_a_query(seen["resolver"].split()[0]) if seen["resolver"] else "none"
print("PROBE " + json.dumps(seen), flush=True)
