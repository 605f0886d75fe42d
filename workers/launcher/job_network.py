"""A sandboxed node's veth: a routed node's (contract §7 v3, `TORCHJOBS_JOB_NETWORK=routed`),
and a multi-node job's node's in the `private` mode (its peers only: `_inside`); `auto`, the
default, is `routed` where the worker can give it (workers/agent.py).

The node's sandbox has a network namespace of its own (`bwrap --unshare-net`), as in the
`private` mode; here the worker then plumbs a veth pair into it: `tjhN` on the host with the
first address of a /30 from `TORCHJOBS_JOB_SUBNET`, `eth0` inside with the second and a default
route through the first. One nftables table, `inet torchjobs`, the same for every node of the
host (its chains written whole at worker start, so several workers on one host agree; the job
subnets of all of them kept in one set, added to), walls it:

- **input**: nothing from a job's veth reaches the host itself (any of its addresses, any
  port: PostgreSQL, Redis, the API, another job's torchrun store on the host network);
- **forward**: no job reaches another job's veth, nor a private, shared, link-local (cloud
  metadata), loopback or multicast range anywhere, nor any network the host has an address in
  (its LAN: the cluster's other hosts, whatever their addresses), where a cluster's own
  services live, but what the admin opens (`TORCHJOBS_JOB_NETWORK_ALLOW`); the rest (the
  world) is routed and masqueraded, and only replies come back in. No IPv6 is routed. A job
  node holds at most `FLOWS_MAX` tracked connections (the host's conntrack table is shared:
  one job filling it would stop new connections host-wide).

Why a veth and not user-mode NAT (`pasta`, `slirp4netns`) or uid-matching rules on the host
network: ARCHITECTURE.md, "A job's network". The plumbing happens right after the sandbox
starts, from outside: the ranks find the world reachable a moment after their start (their own
loopback, the rendezvous of a single-node job, is there from the first instant). A multi-node
job's node makes its veth before its sandbox (`reserve`, then `move_in`), and its nodes are let
through to each other by the `peers` pairs and the routes of a `Mesh` (workers/node_mesh.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import logging
import os
import random
import shutil
import subprocess
import time
from dataclasses import dataclass

log = logging.getLogger("torchjobs.worker")

TABLE = "torchjobs"
# a multi-node job's nodes, let through to each other (job_mesh.py); each element names the
# node's own host veth, so it is that node's alone and binds the address to its interface:
# out (its veth . its address . a peer's), in (its veth . a peer's address . its own)
PEERS_OUT, PEERS_IN = "peers_out", "peers_in"
PEER_SET = "type ifname . ipv4_addr . ipv4_addr;"
CHAINS = ("input", "forward", "output", "postrouting")
ROUTE_TABLE_BASE = 1_000_000  # + the veth's index: a node's own routes to its remote peers
RULE_PREF = 5000
ALIAS = "torchjobs"  # a reserved veth's alias: "torchjobs PID", the worker that made it
HOST_IF = "tjh"  # + the slot's index in hex: the host end of a node's veth
PEER_IF = "tjj"  # its other end, renamed eth0 inside the sandbox
WALLED = (
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",  # shared (carrier-grade NAT)
    "169.254.0.0/16",  # link-local: the cloud metadata services
    "127.0.0.0/8",
    "168.63.129.16/32",  # Azure's wire server
    "224.0.0.0/4",  # multicast
    "255.255.255.255/32",
)
FLOWS_MAX = 4096  # tracked connections one job node may hold open: the host's conntrack table is shared
FLOWS = ("flows", "flows_in")  # counted by the job's address as source; as destination
FLOW_SET = "type ipv4_addr; size 65535; flags dynamic;"
# every job subnet a worker of this host hands out: added to, never rewritten, so a sibling
# worker's start with another subnet (an admin's) keeps this one's jobs walled and masqueraded
SUBNETS = "job_subnets"
SUBNET_SET = "type ipv4_addr; flags interval; auto-merge;"
ATTACH_WAIT_S = 10.0
BROADCAST = ipaddress.IPv4Address("255.255.255.255")
# what a job's packet to a wall beyond the host gets: an answer at once ("host unreachable",
# from its own gateway), not silence, so that a job's look-up or connection fails as fast as
# in a namespace with no route (a dropped DNS query to the host's walled resolver cost each
# reverse look-up 5-10 s; see dns_relay.py). The kernel rate-limits these answers (a
# burst, then about one a second per job address): past that, a packet is dropped.
REFUSE = "reject with icmpx type admin-prohibited"


class NetworkUnavailable(Exception):
    """The host cannot give routed job networks (not root, no `nft` or `ip`, no forwarding)."""


class TableRefused(NetworkUnavailable):
    """`nft` is there but the kernel took no table (no nf_tables): nothing was written, so an
    `auto` worker may fall back to the private network."""


def allowances(text: str) -> list[tuple[str, int | None]]:
    """`TORCHJOBS_JOB_NETWORK_ALLOW`: "CIDR" or "CIDR:PORT" (TCP and UDP), comma-separated; what
    the admin opens in the walled ranges (a data store on the private network, say)."""
    out: list[tuple[str, int | None]] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        address, _, port = item.partition(":") if item.count(":") == 1 else (item, "", "")
        bad = NetworkUnavailable(f"TORCHJOBS_JOB_NETWORK_ALLOW: {item!r} is not CIDR or CIDR:PORT")
        try:
            network = ipaddress.ip_network(address, strict=False)
            number = int(port) if port else None
        except ValueError as exc:
            raise bad from exc
        if network.version != 4 or (number is not None and not 0 < number < 65536):
            raise bad
        out.append((str(network), number))
    return out


def host_subnets() -> list[str]:
    """Every IPv4 network the host has an address in (but the jobs' veths and loopback): its
    LAN, where the cluster's other hosts and their services are, walled like the private
    ranges whatever its addresses look like."""
    found = {str(net) for name, net in _ipv4_networks() if not name.startswith(HOST_IF) and name != "lo"}
    return sorted(found)


def local_job_networks() -> list[ipaddress.IPv4Network]:
    """The /30s of this host's job veths (any worker's): a peer there is reached directly."""
    return [net for name, net in _ipv4_networks() if name.startswith(HOST_IF)]


def _ipv4_networks() -> list[tuple[str, ipaddress.IPv4Network]]:
    """(interface, network) for each IPv4 address of the host, as `ip -4 -o addr` lists them."""
    done = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=30)
    found = []
    for line in done.stdout.splitlines():
        fields = line.split()
        if len(fields) < 4 or fields[2] != "inet":
            continue
        with contextlib.suppress(ValueError):
            network = ipaddress.ip_interface(fields[3]).network
            if isinstance(network, ipaddress.IPv4Network):
                found.append((fields[1], network))
    return found


def rules(
    subnet: str,
    allow: list[tuple[str, int | None]] | None = None,
    extra_walled: list[str] | None = None,
) -> str:
    """The whole `inet torchjobs` table, for `nft -f` (one transaction: never half written).
    No resolver is opened: a routed node's look-ups go through the worker (dns_relay.py)."""
    walled = ", ".join(_merged([*WALLED, subnet, *(extra_walled or [])]))
    jobs = f'iifname "{HOST_IF}*"'
    over = f"ct count over {FLOWS_MAX}"
    opened = [
        f"    {jobs} ip daddr {cidr} accept"
        if port is None
        else f"    {jobs} ip daddr {cidr} meta l4proto {{ tcp, udp }} th dport {port} accept"
        for cidr, port in allow or []
    ]
    return "\n".join(
        [
            # the chains and the `flows` sets rewritten whole in one transaction; the mesh sets
            # kept: a sibling worker's start must not cut the multi-node jobs running beside it
            f"add table inet {TABLE}",
            *(f"add set inet {TABLE} {name} {{ {PEER_SET} }}" for name in (PEERS_OUT, PEERS_IN)),
            f"add set inet {TABLE} {SUBNETS} {{ {SUBNET_SET} }}",
            f"add element inet {TABLE} {SUBNETS} {{ {subnet} }}",
            *(f"add chain inet {TABLE} {c}\ndelete chain inet {TABLE} {c}" for c in CHAINS),
            *(
                f"add set inet {TABLE} {name} {{ {FLOW_SET} }}\ndelete set inet {TABLE} {name}"
                for name in FLOWS
            ),
            f"table inet {TABLE} {{",
            *(f"  set {name} {{ {FLOW_SET} }}" for name in FLOWS),  # open connections per job address
            "  chain input {",
            "    type filter hook input priority -10; policy accept;",
            # silent: a refusal here would come from the very address a job probed, telling it
            # which addresses are the host's (its LAN's, other jobs' veth ends)
            f"    {jobs} drop",
            # nor from elsewhere (another host's job, routed here) to the host's own veth ends
            f'    iifname != "lo" ip daddr @{SUBNETS} drop',
            "  }",
            "  chain forward {",
            "    type filter hook forward priority -10; policy accept;",
            # first: a job's connections to its own other nodes fill the shared table too, on
            # the sending host and on the receiving one
            f"    {jobs} ct state new add @flows {{ ip saddr {over} }} drop",
            f'    oifname "{HOST_IF}*" ct state new add @flows_in {{ ip daddr {over} }} drop',
            f"    iifname . ip saddr . ip daddr @{PEERS_OUT} accept",  # a node to its job's others
            f"    oifname . ip saddr . ip daddr @{PEERS_IN} accept",  # and theirs to it
            f'    {jobs} oifname "{HOST_IF}*" {REFUSE}',
            *opened,
            f"    {jobs} ip daddr {{ {walled} }} {REFUSE}",
            f"    {jobs} ip daddr @{SUBNETS} {REFUSE}",  # a sibling worker's, wherever it lies
            f"    {jobs} meta nfproto ipv6 drop",
            f"    {jobs} accept",
            f'    oifname "{HOST_IF}*" ct state established,related accept',
            f'    oifname "{HOST_IF}*" drop',
            "  }",
            # nor does a process of the host's that is not root (a host-network job, a normal
            # user's worker's ranks) open a connection into a job: the worker is root
            "  chain output {",
            "    type filter hook output priority -10; policy accept;",
            f'    oifname "{HOST_IF}*" ct state new meta skuid != 0 {REFUSE}',
            "  }",
            "  chain postrouting {",
            "    type nat hook postrouting priority 100; policy accept;",
            f"    iifname . ip saddr . ip daddr @{PEERS_OUT} accept",  # routed as they are, not masqueraded
            # what a job veth sends: not what a bridge on this host carries for others
            f'    {jobs} ip saddr @{SUBNETS} oifname != "{HOST_IF}*" masquerade',
            "  }",
            "}",
            "",
        ]
    )


def _merged(cidrs: list[str]) -> list[str]:
    """Overlapping networks as one (nft refuses overlapping elements of an interval set)."""
    networks = [ipaddress.ip_network(c) for c in cidrs]
    return [str(n) for n in ipaddress.collapse_addresses(n for n in networks if n.version == 4)]


def prepare_host(subnet: str, allow: str = "") -> None:
    """At worker start: the table, and IPv4 forwarding on (the host routes its jobs' traffic)."""
    if os.geteuid() != 0:
        raise NetworkUnavailable("TORCHJOBS_JOB_NETWORK=routed needs a worker running as root")
    network = check_subnet(subnet)
    lan = host_subnets()
    apart(network, lan)
    opened = allowances(allow)
    if not os.access("/proc/sys/net/ipv4/ip_forward", os.W_OK):  # a read-only /proc/sys
        raise TableRefused("IPv4 forwarding cannot be turned on here (/proc/sys is read-only)")
    try:
        _run(["nft", "-f", "-"], rules(str(network), opened, lan))
    except NetworkUnavailable as exc:
        raise TableRefused(str(exc)) from exc
    try:  # the table is written: from here a failure stops the worker, cleanly
        for name in sweep_left():
            log.info("removed job veth %s, made by a worker no longer running", name)
        forward_all()
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        raise NetworkUnavailable(f"after the table was written: {exc}") from exc


def routed_unavailable() -> str | None:
    """Why this worker cannot give routed networks before it tries (not root, no `nft`, `ip`
    or `nsenter`), or None."""
    return _unavailable("a routed job network", ("nft", "ip", "nsenter"))


def _unavailable(what: str, tools: tuple[str, ...]) -> str | None:
    """Why `what` cannot be given here: the worker is not root, or a tool is missing."""
    if os.geteuid() != 0:
        return f"{what} needs a worker running as root"
    missing = [tool for tool in tools if shutil.which(tool) is None]
    return f"{what} needs {' and '.join(missing)}" if missing else None


def apart(network: ipaddress.IPv4Network, lan: list[str] | None = None) -> None:
    """A job subnet must not overlap a network the host has an address in: the host's walls
    drop what reaches a job subnet, and its LAN's traffic with it (SSH, PostgreSQL)."""
    for other in host_subnets() if lan is None else lan:
        if network.overlaps(ipaddress.ip_network(other)):
            raise NetworkUnavailable(f"job subnet {network} overlaps {other}, a network of this host's")


def private_mesh_unavailable() -> str | None:
    """Why this worker cannot give multi-node jobs meshes (not root, or no `ip`/`nsenter`):
    then they keep the host's network. None: it can, and must (a failure after is fatal)."""
    return _unavailable("a multi-node job's own network", ("ip", "nsenter"))


def prepare_private(subnet: str) -> bool:
    """At worker start, `private`, where the worker can give meshes: its subnet checked, what
    a killed worker left of one removed, and where nftables is, the sets (so that looking for
    a killed node's elements never depends on an error's wording) and the host ends' wall.
    Whether its meshes add elements (mesh_elements)."""
    apart(check_subnet(subnet))
    elements = mesh_elements()
    if elements:
        _run(["nft", "-f", "-"], MESH_SETS + PRIVATE_WALL)
    for name in sweep_left(elements):
        log.info("removed job veth %s, made by a worker no longer running", name)
    return elements


def check_subnet(subnet: str) -> ipaddress.IPv4Network:
    try:
        network = ipaddress.ip_network(subnet)
    except ValueError as exc:
        raise NetworkUnavailable(f"TORCHJOBS_JOB_SUBNET {subnet!r} is not a network") from exc
    if not isinstance(network, ipaddress.IPv4Network) or network.prefixlen > 30:
        raise NetworkUnavailable(f"TORCHJOBS_JOB_SUBNET {subnet!r}: an IPv4 network of at least a /30")
    return network


# The table and its two mesh sets, where no routed worker made them (adding is a no-op where
# one did; a routed worker's start keeps them).
MESH_SETS = f"add table inet {TABLE}\n" + "".join(
    f"add set inet {TABLE} {name} {{ {PEER_SET} }}\n" for name in (PEERS_OUT, PEERS_IN)
)


# Where nftables is, a private mesh's host ends also drop whatever reaches the host itself
# (a routed host's own table does the same): a sealed end still takes a UDP broadcast a rank
# sends through its interface, which a host service on all addresses would read.
PRIVATE_TABLE = "torchjobs_private"
PRIVATE_WALL = (
    f"add table inet {PRIVATE_TABLE}\n"
    f"add chain inet {PRIVATE_TABLE} input\n"
    f"delete chain inet {PRIVATE_TABLE} input\n"
    f"table inet {PRIVATE_TABLE} {{\n"
    "  chain input {\n"
    "    type filter hook input priority -10; policy accept;\n"
    f'    iifname "{HOST_IF}*" drop\n'
    "  }\n"
    "}\n"
)


@dataclass(frozen=True)
class Attached:
    """One node's veth: its host end's name, and the addresses of both ends. A routed node
    (`gateway`) gets the host end as its default route; a private multi-node job's node gets
    a route to each of its `peers` (its job's other nodes) and nothing else, not even to the
    host end itself (a service listening on all the host's addresses would answer there)."""

    host_if: str
    host_address: str
    job_address: str
    gateway: bool = True
    peers: tuple[str, ...] = ()
    host_mac: str = ""  # sealed (a private mesh's): the ends know each other's MAC, never ask
    job_mac: str = ""

    @property
    def peer_if(self) -> str:
        return PEER_IF + self.host_if.removeprefix(HOST_IF)


def attach(outer_pid: int, subnet: str) -> Attached:
    """Plumb a veth into the network namespace of the sandbox whose bwrap is `outer_pid`."""
    veth = reserve(subnet)
    move_in(outer_pid, veth)
    return veth


def reserve(subnet: str, elements: bool = True, sealed: bool = False) -> Attached:
    """A veth pair and its /30, made before the sandbox exists: a multi-node job's nodes learn
    each other's addresses (and node 0's, their rendezvous) before any of them starts.
    `elements`: the host has nftables, so mesh elements may name this veth (mesh_elements).
    `sealed`: a private mesh's, where no nftables rule walls the host end (`_seal`) and no
    default route goes through it (`gateway`)."""
    network = ipaddress.ip_network(subnet)
    slots = network.num_addresses // 4
    start = random.randrange(slots)
    for step in range(slots):
        index = (start + step) % slots
        name = f"{HOST_IF}{index:x}"
        made = subprocess.run(
            ["ip", "link", "add", name, "type", "veth", "peer", "name", f"{PEER_IF}{index:x}"],
            capture_output=True,
            text=True,
        )
        if made.returncode == 0:
            break
        if "exists" not in made.stderr:
            raise NetworkUnavailable(f"could not make a veth pair: {made.stderr.strip()}")
    else:
        raise NetworkUnavailable(f"every /30 of {subnet} is in use on this host")
    base = network.network_address + 4 * index
    veth = Attached(host_if=name, host_address=str(base + 1), job_address=str(base + 2))
    try:
        _run(["ip", "link", "set", name, "alias", f"{ALIAS} {os.getpid()}"])
        _run(["ip", "addr", "add", f"{veth.host_address}/30", "dev", name])
        _strict_source(name)
        _forwarding(name)
        forget(veth, elements)
        if sealed:
            _seal(name)
            veth = dataclasses.replace(veth, gateway=False, host_mac=_mac(name), job_mac=_mac(veth.peer_if))
    except NetworkUnavailable:
        release(veth)
        raise
    return veth


def _seal(host_if: str) -> None:
    """A private mesh's host end answers nothing: no ARP reply for any address (a rank that
    sends "on-link" through its interface, which needs no privilege, could otherwise reach
    every address of the host, this end's own included) and no IPv6 (its link-local address
    would answer the host's services that listen on `::`). Its neighbours are written, both
    ways (move_in): nothing is ever asked on this link."""
    _sysctl(f"ipv4/conf/{host_if}/arp_ignore", "8", f"could not turn ARP replies off for {host_if}")
    if os.path.exists(f"/proc/sys/net/ipv6/conf/{host_if}"):
        _sysctl(f"ipv6/conf/{host_if}/disable_ipv6", "1", f"could not turn IPv6 off for {host_if}")


def _sysctl(name: str, value: str, failure: str) -> None:
    """One of the host's `net` settings (`/proc/sys/net/NAME`), or NetworkUnavailable saying
    `failure`."""
    try:
        with open(f"/proc/sys/net/{name}", "w") as fh:
            fh.write(value + "\n")
    except OSError as exc:
        raise NetworkUnavailable(f"{failure}: {exc}") from exc


def _mac(interface: str) -> str:
    try:
        done = subprocess.run(
            ["ip", "-j", "link", "show", interface], capture_output=True, text=True, timeout=30
        )
        return str(json.loads(done.stdout)[0]["address"])
    except (OSError, subprocess.TimeoutExpired, ValueError, LookupError) as exc:
        raise NetworkUnavailable(f"no MAC address for {interface}: {exc}") from exc


def move_in(outer_pid: int, veth: Attached) -> int:
    """The veth's inner end into the sandbox's namespace, as `eth0`, its routes added last
    (command.AWAIT_ROUTE waits for them). Returns the sandbox's first process, whose namespace
    it is (_sandbox_child), for what else the worker puts there (dns_relay.py)."""
    try:
        inner = _sandbox_child(outer_pid)
        _run(["ip", "link", "set", veth.peer_if, "netns", str(inner)])
        if veth.job_mac:  # sealed: the host never asks who holds the job's address (the
            # answer would teach the job the host end's address and MAC), so before it is up
            _run(["ip", "neigh", "replace", veth.job_address, "lladdr", veth.job_mac, "dev", veth.host_if,
                  "nud", "permanent"])  # fmt: skip
        _run(["ip", "link", "set", veth.host_if, "up"])
        inside = [f"link set {veth.peer_if} name eth0", *_inside(veth)]
        _run(["nsenter", f"--net=/proc/{inner}/ns/net", "ip", "-batch", "-"], "\n".join(inside) + "\n")
    except NetworkUnavailable:
        release(veth)
        raise
    return inner


def _inside(veth: Attached) -> list[str]:
    """Routed: the /30 and a default route through the host end. Private: the job's address
    alone (/32: no connected route, so not even the host end is routable), each peer's
    neighbour entry written (the host end's MAC: the sealed end answers no ARP) and a link
    route to each peer, last."""
    if veth.gateway:
        return [
            f"addr add {veth.job_address}/30 dev eth0",
            "link set eth0 up",
            "link set lo up",
            f"route add default via {veth.host_address}",
        ]
    return [
        f"addr add {veth.job_address}/32 dev eth0",
        "link set eth0 up",
        "link set lo up",
        *(f"neigh replace {peer} lladdr {veth.host_mac} dev eth0 nud permanent" for peer in veth.peers),
        *(f"route add {peer}/32 dev eth0" for peer in veth.peers),
    ]


def release(veth: Attached) -> None:
    """The pair, where the sandbox never took it (once inside, it dies with the namespace)."""
    subprocess.run(["ip", "link", "del", veth.host_if], capture_output=True)


def route_table(veth: Attached) -> int:
    return ROUTE_TABLE_BASE + int(veth.host_if.removeprefix(HOST_IF), 16)


def _strict_source(host_if: str) -> None:
    """Strict reverse-path filtering on the host end: a packet from the job must carry the
    job's own address. Defence in depth: the job has no capability to forge one, and the mesh
    elements name the veth a packet must come from anyway (the kernel takes the looser of this
    and `conf.all`)."""
    _sysctl(f"ipv4/conf/{host_if}/rp_filter", "1", f"could not turn reverse-path filtering on for {host_if}")


def _forwarding(host_if: str) -> None:
    """Forwarding on the host end (IPv4 checks the interface a packet comes in by): a node's
    packets to its peers on this host are forwarded without turning the whole host into a
    router. Peers on other hosts need the host's own forwarding (job_mesh.Mesh.open)."""
    _sysctl(f"ipv4/conf/{host_if}/forwarding", "1", f"could not turn forwarding on for {host_if}")


def forward_all() -> None:
    """IPv4 forwarding for the whole host: its jobs' packets to and from other hosts."""
    _sysctl("ipv4/ip_forward", "1", "could not turn IPv4 forwarding on")


def sweep_left(elements: bool = True) -> list[str]:
    """At worker start: the veths a killed worker made and never moved into a sandbox (its
    nodes were waiting for their peers), with what they held; a sibling worker's (its PID
    alive) stay. The names taken away."""
    listed = subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True, timeout=30)
    links = {link.get("ifname", ""): link for link in json.loads(listed.stdout or "[]")}
    swept = []
    for name, link in links.items():
        alias = str(link.get("ifalias", ""))
        owner = alias.removeprefix(f"{ALIAS} ")
        ours = name.startswith(HOST_IF) and alias.startswith(f"{ALIAS} ") and owner.isdigit()
        unmoved = PEER_IF + name.removeprefix(HOST_IF) in links
        if ours and unmoved and not os.path.exists(f"/proc/{owner}"):
            veth = Attached(host_if=name, host_address="", job_address="")
            release(veth)
            forget(veth, elements)
            swept.append(name)
    return swept


def mesh_elements() -> bool:
    """Whether a private mesh adds its elements too: wherever nftables works, a routed worker
    may write the walls (now, or while the mesh runs), which drop what no element lets
    through, and the host ends get their wall (PRIVATE_WALL). An `nft` the kernel refuses
    (no nf_tables) walls nothing, which is said: the host ends then take a UDP broadcast.
    An `nft` that does not answer stops the worker (NetworkUnavailable)."""
    if shutil.which("nft") is None:
        return False
    try:
        done = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetworkUnavailable(f"nft list tables: {exc}") from exc
    if done.returncode != 0:
        log.warning("nftables is installed but the kernel refuses it (%s): a private mesh's host ends "
                    "are not walled against a UDP broadcast (docs/security.md, Network)",
                    done.stderr.strip())  # fmt: skip
    return done.returncode == 0


def forget(veth: Attached, elements: bool = True) -> None:
    """What a node whose worker was killed left under this veth's name or address (mesh
    elements, its own routes): a new node there starts with nothing of it."""
    if elements:
        _forget_elements(veth)
    table = str(route_table(veth))
    subprocess.run(["ip", "route", "flush", "table", table], capture_output=True)
    while subprocess.run(["ip", "rule", "del", "table", table], capture_output=True).returncode == 0:
        pass


def _forget_elements(veth: Attached) -> None:
    stale = {}
    mine = {veth.host_if, veth.job_address} - {""}
    for name in (PEERS_OUT, PEERS_IN):
        listed = subprocess.run(
            ["nft", "-j", "list", "set", "inet", TABLE, name], capture_output=True, text=True, timeout=30
        )
        if listed.returncode != 0:
            raise NetworkUnavailable(f"nft list set {name}: {listed.stderr.strip()}")
        gone = [e for e in _elements(listed.stdout) if mine & set(e)]
        stale[name] = [f'"{a}" . {b} . {c}' for a, b, c in gone]
    script = "".join(
        f"delete element inet {TABLE} {name} {{ {', '.join(items)} }}\n"
        for name, items in stale.items()
        if items
    )
    if script:
        _run(["nft", "-f", "-"], script)


def _elements(listing: str) -> list[tuple[str, str, str]]:
    out = []
    for item in json.loads(listing).get("nftables", []):
        for elem in item.get("set", {}).get("elem", []):
            parts = elem.get("concat") if isinstance(elem, dict) else None
            if isinstance(parts, list) and len(parts) == 3:
                out.append((str(parts[0]), str(parts[1]), str(parts[2])))
    return out


def _sandbox_child(outer_pid: int) -> int:
    """The sandbox's first process (bwrap's child, in its own network namespace)."""
    mine = _netns("self")
    deadline = time.monotonic() + ATTACH_WAIT_S
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            if entry.isdigit() and _parent(entry) == outer_pid:
                ns = _netns(entry)
                if ns is not None and ns != mine:
                    return int(entry)
        time.sleep(0.02)
    raise NetworkUnavailable(f"the sandbox of process {outer_pid} has no network namespace of its own")


def _parent(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _netns(pid: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _run(argv: list[str], stdin: str | None = None) -> None:
    try:
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetworkUnavailable(f"{argv[0]}: {exc}") from exc
    if done.returncode != 0:
        raise NetworkUnavailable(f"{' '.join(argv[:3])}: {done.stderr.strip()}")
