"""Separate hosts on one machine: network namespaces joined by a bridge, made and removed here.

Each host gets its own namespace, its own address on a private bridge that exists only in
this sandbox, and the interface name `tj0` (so gloo can be told which interface to use).
PostgreSQL and Redis listen on the root namespace's loopback only, so a small TCP forwarder
on the bridge address carries the hosts' connections to them.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
from dataclasses import dataclass, field


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def netns_available() -> bool:
    probe = f"tjprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
        return True
    except (subprocess.CalledProcessError, FileNotFoundError):
        return False


@dataclass
class Network:
    tag: str
    subnet: str = "10.231.0"
    hosts: dict[str, str] = field(default_factory=dict)  # name -> address
    forwarders: list[Forwarder] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"tjbr{self.tag}"

    @property
    def gateway(self) -> str:
        return f"{self.subnet}.1"

    def up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def add_host(self, name: str) -> str:
        index = len(self.hosts) + 2
        ns, outer = f"tj{self.tag}{name}", f"tjv{self.tag}{index}"
        address = f"{self.subnet}.{index}"
        _ip("netns", "add", ns)
        _ip("link", "add", outer, "type", "veth", "peer", "name", "tj0", "netns", ns)
        _ip("link", "set", outer, "master", self.bridge)
        _ip("link", "set", outer, "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "tj0")
        _ip("-n", ns, "link", "set", "tj0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        self.hosts[name] = address
        return address

    def add_isolated_interface(self, name: str, interface: str, address: str) -> None:
        """A second interface in host `name` whose address no other host can route to, as on a
        multi-homed machine whose collectives were pointed at the wrong network."""
        ns = self.namespace(name)
        # a veth pair with both ends in the namespace: the kernel here has no dummy interfaces
        _ip("-n", ns, "link", "add", interface, "type", "veth", "peer", "name", f"{interface}p")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", interface)
        _ip("-n", ns, "link", "set", interface, "up")

    def route(self, name: str, destination: str, via: str) -> None:
        """Send `destination` from host `name` through `via` (an address nobody holds makes a
        black hole: packets leave and nothing ever answers)."""
        _ip("-n", self.namespace(name), "route", "add", destination, "via", via)

    def namespace(self, name: str) -> str:
        return f"tj{self.tag}{name}"

    def forward(self, target_port: int) -> int:
        """Expose 127.0.0.1:target_port on the bridge; returns the bridge-side port."""
        fwd = Forwarder(self.gateway, ("127.0.0.1", target_port))
        fwd.start()
        self.forwarders.append(fwd)
        return fwd.port

    def down(self) -> None:
        for fwd in self.forwarders:
            fwd.stop()
        for name in self.hosts:
            subprocess.run(["ip", "netns", "del", self.namespace(name)], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


class Forwarder:
    """A plain threaded TCP relay: enough for the test's database and broker connections."""

    def __init__(self, host: str, target: tuple[str, int]) -> None:
        self.target = target
        self.server = socket.create_server((host, 0))
        self.port = self.server.getsockname()[1]
        self.stopped = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._accept, daemon=True).start()

    def stop(self) -> None:
        self.stopped.set()
        self.server.close()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
