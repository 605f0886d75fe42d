"""A routed multi-node job's walls from inside (contract §7 v3), one JSON line per rank.

`python mesh_probe.py HOST:PORT ...` under torchrun, `ddp` on 2 nodes of 1 rank: the ranks
meet over gloo and all-reduce (their own nodes reach each other), rank 0 listens on
MESH_PORT and rank 1 connects to it at MASTER_ADDR (node 0's own address), and every rank
tries each HOST:PORT given (the hosts' services: none may answer); `VIA:PORT` is the host's
end of the node's own veth (the gateway its routes name, else its peers' neighbour's
address: the /30's first); `BOUND:HOST:PORT` connects through eth0 bound by name."""

import json
import os
import socket
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

MESH_PORT = 29911


def reach(host: str, port: int, timeout: float = 2.0, bound: bool = False) -> str:
    """`bound`: through eth0 by SO_BINDTODEVICE (no privilege needed), where the kernel takes
    any address without a route for one on the link."""
    try:
        with socket.socket() as conn:
            if bound:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, b"eth0")
            conn.settimeout(timeout)
            conn.connect((host, port))
            return conn.recv(16).decode() or "connected"
    except OSError as exc:
        return type(exc).__name__


def via() -> str:
    with open("/proc/net/route") as fh:
        for line in fh.read().splitlines()[1:]:
            fields = line.split()
            if fields[2] != "00000000":
                return socket.inet_ntoa(bytes.fromhex(fields[2])[::-1])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:  # sends nothing: its own address
        udp.connect((os.environ["MASTER_ADDR"], 9))
        own = socket.inet_aton(udp.getsockname()[0])
    first = int.from_bytes(own, "big") & ~3 | 1  # the host end: the /30's first address
    return socket.inet_ntoa(first.to_bytes(4, "big"))


def serve(server: socket.socket) -> None:
    conn, _ = server.accept()
    conn.sendall(b"peer")
    conn.close()


dist.init_process_group("gloo")
rank = dist.get_rank()
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
if rank == 0:
    server = socket.create_server(("0.0.0.0", MESH_PORT))
    threading.Thread(target=serve, args=(server,), daemon=True).start()
dist.barrier()
# forked from a warm spare's rank server (workers/runtime/warm_rank.py), or started cold
seen = {
    "sum": total.item(),
    "master": os.environ["MASTER_ADDR"],
    "warm": "workers.runtime.warm_rank" in sys.modules,
    # a routed node's look-ups go to the worker's relay on its own loopback (dns_relay.py)
    "resolver": Path("/etc/resolv.conf").read_text().split("nameserver", 1)[-1].split()[0],
}
if rank == 1:
    seen["peer"] = reach(os.environ["MASTER_ADDR"], MESH_PORT)
for target in sys.argv[1:]:
    host, port = target.removeprefix("BOUND:").rsplit(":", 1)
    seen[target] = reach(via() if host == "VIA" else host, int(port), bound=target.startswith("BOUND:"))
print("PROBE " + json.dumps(seen), flush=True)
dist.barrier()
dist.destroy_process_group()
