"""A sandboxed node's routed network (contract §7 v3, `TORCHJOBS_JOB_NETWORK=routed`), for real:
two real sandboxes (bubblewrap, each its own network namespace) plumbed by
`workers.launcher.job_network`, a "world" host in a network namespace of its own beyond the
host (in 198.18.0.0/15, a range no rule walls), and a service listening on the host. Each job
reaches the world; neither reaches the host's service (on the address it routes through, nor
on any other of the host's addresses), nor the other job, nor a private range.

Runs as root (CI does), with `nft` (.ci/setup installs nftables) and `ip`."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.context import WorkerContext
from workers.launcher import dns_relay, job_mesh, job_network, lifeline, procs, sandbox
from workers.launcher.sandbox import ENV_FILE, Isolation, Mounts

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="plumbs network namespaces as root")
SUBNET = "10.213.0.0/16"
WORLD_PORT = 18080
NET = os.getpid() % 250  # 198.18.NET.0/24: each test process its own world (xdist runs several)
WORLD = f"198.18.{NET}.2"
# the host's end of the world's link: an address of its own, not in the world's network (the
# world is reached by a route, as through a default gateway; the host's connected networks,
# its LAN, are walled)
WORLD_GATEWAY = f"198.19.{NET}.1"

PROBE = r"""
import json, socket, sys, time
def reach(host, port, timeout=2.0):
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            return s.recv(16).decode() or "connected"
    except OSError as exc:
        return type(exc).__name__
world, host_port, targets = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
deadline = time.monotonic() + 15
seen = reach(world, 18080)
while seen != "world" and time.monotonic() < deadline:  # the veth comes a moment after the start
    time.sleep(0.1)
    seen = reach(world, 18080)
import os
views = {d: sorted(os.listdir(d)) for d in ("/sys/class/net", "/sys/devices/virtual/net")}
reached = {name: reach(addr, port) for name, (addr, port) in targets.items()}
print(json.dumps({"world": seen, "sys": views, **reached}))
"""

LISTEN = r"""
import socket, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 9000)); s.listen()
s.settimeout(60)
try:
    while True:
        c, _ = s.accept(); c.sendall(b"job"); c.close()
except OSError:
    pass
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def world() -> Iterator[str]:
    """A host beyond this one: a network namespace reached through a veth, answering "world"."""
    if not (shutil.which("nft") and shutil.which("ip") and shutil.which("nsenter")):
        pytest.fail("nft, ip and nsenter are needed (bash .ci/setup installs nftables)")
    tag = f"{os.getpid() % 100000}"
    ns, outer, inner = f"tjw{tag}", f"tjwh{tag}", f"tjwn{tag}"
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", ns)
        _ip("addr", "add", f"{WORLD_GATEWAY}/32", "dev", outer)
        _ip("link", "set", outer, "up")
        _ip("route", "add", f"{WORLD}/32", "dev", outer)
        for cmd in (
            ["addr", "add", f"{WORLD}/24", "dev", inner],
            ["link", "set", inner, "up"],
            ["link", "set", "lo", "up"],
            ["route", "add", f"{WORLD_GATEWAY}/32", "dev", inner],
            ["route", "add", "default", "via", WORLD_GATEWAY],
        ):
            _ip("-n", ns, *cmd)
        server = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                "-c",
                LISTEN.replace('b"job"', 'b"world"').replace("9000", str(WORLD_PORT)),
            ],
        )
        try:
            yield ns
        finally:
            server.kill()
            server.wait()
    finally:
        subprocess.run(["ip", "link", "del", outer], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def host_service() -> Iterator[int]:
    """A service on the host (as PostgreSQL or Redis would be), on every address."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", 0))
    server.listen()
    server.settimeout(0.5)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            conn.sendall(b"host")
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    server.close()


def _sandbox(
    tmp_path: Path, name: str, argv: list[str], resolv_conf: Path | None = None
) -> subprocess.Popen[bytes]:
    bwrap = sandbox.find_bwrap()
    assert bwrap, "bubblewrap is a dependency of torchjobs"
    iso = Isolation(kind="sandbox", method="bwrap-setuid", bwrap=bwrap, uid=65534, gid=65534)
    run = tmp_path / name
    run.mkdir()
    (run / ENV_FILE).write_text(json.dumps({"PATH": "/usr/bin:/bin"}))
    for path in (run, run / ENV_FILE):
        os.chown(path, 65534, 65534)
    mounts = Mounts(
        run_dir=run,
        tmp_dir=run,
        read_only=sandbox.python_paths(sys.executable),
        private_network=True,
        resolv_conf=resolv_conf,
    )
    wrapped = sandbox.wrap(argv, iso, mounts, sys.executable)
    return subprocess.Popen(
        wrapped, env={}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=lifeline.pass_fds()
    )


def test_a_job_reaches_the_world_and_not_the_host_nor_another_job(
    tmp_path: Path, world: str, host_service: int
) -> None:
    job_network.prepare_host(SUBNET)
    other = _sandbox(tmp_path, "other", [sys.executable, "-c", LISTEN])
    try:
        other_net = job_network.attach(other.pid, SUBNET)
        targets = {
            "host_via_gateway": ["HOST", host_service],  # filled in below: the job's own gateway
            "host_world_side": [WORLD_GATEWAY, host_service],
            "own_loopback": ["127.0.0.1", host_service],
            "other_job": [other_net.job_address, 9000],
            "private_range": ["10.255.255.1", 80],
        }
        probe = _start_probe(tmp_path, targets, host_service)
        out, err = probe.communicate(timeout=60)
        seen = json.loads(out.decode().strip().splitlines()[-1])
    finally:
        _end(other)
    assert seen["world"] == "world", (seen, err.decode()[-2000:])
    for name in ("host_via_gateway", "host_world_side"):  # silent: the host's addresses unsaid
        assert seen[name] in ("TimeoutError", "timeout"), (name, seen)
    for name in ("other_job", "private_range"):
        # refused at once ("host unreachable", as with no route), never left to time out: a
        # look-up of the walled resolver would otherwise hang 5 s (job_network.REFUSE)
        assert seen[name] == "OSError", (name, seen)
    assert seen["own_loopback"] == "ConnectionRefusedError"  # its own loopback: nothing listens there
    # no interface of the host's (the other job's veth among them) in its /sys
    assert seen["sys"] == {"/sys/class/net": [], "/sys/devices/virtual/net": []}, seen["sys"]


def _end(outer: subprocess.Popen[bytes]) -> None:
    """The sandbox's PID 1 first (a namespace's init ignores what it has no handler for: only
    SIGKILL ends it), then bwrap; its network namespace and veth go with it."""
    ns = procs.sandbox_namespace(outer.pid)
    for pid in procs.pids_in_namespace(ns) if ns else []:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    outer.kill()
    outer.wait()


def _start_probe(tmp_path: Path, targets: dict[str, list[object]], host_port: int) -> subprocess.Popen[bytes]:
    """The probe, in its own sandbox; `HOST` becomes its gateway (the host's end of its veth),
    which the probe learns from its default route."""
    script = PROBE.replace(
        "world, host_port, targets = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])",
        "world, host_port, targets = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])\n"
        "deadline0 = time.monotonic() + 15\n"
        "gw = None\n"
        "while gw is None and time.monotonic() < deadline0:\n"
        "    for line in open('/proc/net/route').read().splitlines()[1:]:\n"
        "        f = line.split()\n"
        "        if f[1] == '00000000' and f[2] != '00000000':\n"
        "            gw = socket.inet_ntoa(bytes.fromhex(f[2])[::-1])\n"
        "    time.sleep(0.05)\n"
        "targets = {k: [gw if a == 'HOST' else a, p] for k, (a, p) in targets.items()}\n",
    )
    proc = _sandbox(
        tmp_path, "probe-run", [sys.executable, "-c", script, WORLD, str(host_port), json.dumps(targets)]
    )
    job_network.attach(proc.pid, SUBNET)
    return proc


def test_the_rules_wall_private_ranges_and_other_jobs_and_masquerade_the_rest() -> None:
    text = job_network.rules(SUBNET)
    refuse = "reject with icmpx type admin-prohibited"
    assert 'iifname "tjh*" drop' in text  # input: nothing from a job reaches the host itself
    assert f'iifname "tjh*" oifname "tjh*" {refuse}' in text
    assert "169.254.0.0/16" in text and "10.0.0.0/8" in text
    # only what a job's veth sends (not what a bridge on this host carries for others)
    assert 'iifname "tjh*" ip saddr @job_subnets oifname != "tjh*" masquerade' in text
    assert f"add element inet torchjobs job_subnets {{ {SUBNET} }}" in text
    # one transaction: the chains and `flows` made anew, the mesh elements kept
    assert text.startswith("add table inet torchjobs\nadd set inet torchjobs peers_out ")
    for chain in ("input", "forward", "postrouting"):
        assert f"add chain inet torchjobs {chain}\ndelete chain inet torchjobs {chain}\n" in text
    assert "delete set inet torchjobs flows\n" in text and "delete set inet torchjobs peers" not in text
    assert "delete set inet torchjobs job_subnets" not in text  # added to, never rewritten
    # nothing from elsewhere (another host's job routed here) reaches the host's own veth ends
    assert 'iifname != "lo" ip daddr @job_subnets drop' in text
    # nor a job a sibling worker's job subnet, wherever its admin put it
    assert f'iifname "tjh*" ip daddr @job_subnets {refuse}' in text
    # nor a process of the host's but root (a host-network job) into a job (UDP: TCP's
    # answers are refused by the input chain anyway)
    assert f'oifname "tjh*" ct state new meta skuid != 0 {refuse}' in text


def test_the_admin_opens_ranges_and_ports_in_the_walled_ones() -> None:
    allow = job_network.allowances("10.1.2.0/24, 192.168.5.7:443")
    assert allow == [("10.1.2.0/24", None), ("192.168.5.7/32", 443)]
    text = job_network.rules(SUBNET, allow)
    opened = text.index('iifname "tjh*" ip daddr 10.1.2.0/24 accept')
    assert "ip daddr 192.168.5.7/32 meta l4proto { tcp, udp } th dport 443 accept" in text
    assert opened < text.index("ip daddr { 10.0.0.0/8")  # before the wall
    for bad in ("10.1.2.0/33", "x", "10.0.0.1:0", "fe80::/64"):
        with pytest.raises(job_network.NetworkUnavailable, match="CIDR"):
            job_network.allowances(bad)
    job_network.prepare_host(SUBNET, "10.1.2.0/24,192.168.5.7:443")  # nft takes it
    listed = subprocess.run(["nft", "list", "table", "inet", "torchjobs"], capture_output=True, text=True)
    assert "192.168.5.7 meta l4proto { tcp, udp } th dport 443 accept" in listed.stdout, listed.stdout
    job_network.prepare_host(SUBNET)  # as the other tests expect it


FAKE_ADDRESS = "203.0.113.7"
LOOK_UP = r"""
import json, socket, time
deadline, answer = time.monotonic() + 15, None
while time.monotonic() < deadline:  # the veth, and the relay's socket, come a moment after the start
    try:
        answer = socket.getaddrinfo("model-hub.test", 443, socket.AF_INET)[0][4][0]
        break
    except OSError as exc:
        answer = type(exc).__name__
        time.sleep(0.1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(1.0)
odd = {}
for name, flags in (("update", 0x28), ("answer_shaped", 0x81)):  # opcode 5; QR 1
    s.sendto(b"\x12\x34" + bytes([flags, 0]) + bytes(8) + b"\x01x\x00\x00\x01\x00\x01", ("127.0.0.11", 53))
    try:
        s.recv(512)
        odd[name] = "answered"
    except OSError as exc:
        odd[name] = type(exc).__name__
print(json.dumps({"answer": answer, **odd}))
"""


def _answer(query: bytes) -> bytes:
    """An A record of FAKE_ADDRESS for the query's one question (its id, its question)."""
    end = 12
    while query[end]:
        end += 1 + query[end]
    question = query[12 : end + 5]
    header = query[:2] + bytes([0x81, 0x80]) + (1).to_bytes(2, "big") * 2 + bytes(4)
    record = b"\xc0\x0c" + bytes([0, 1, 0, 1]) + (60).to_bytes(4, "big") + (4).to_bytes(2, "big")
    return header + question + record + socket.inet_aton(FAKE_ADDRESS)


@pytest.fixture
def loopback_resolver() -> Iterator[tuple[int, list[int]]]:
    """A resolver on the host's loopback, as systemd-resolved's 127.0.0.53 is (a network
    namespace cannot reach it at all): every question answered FAKE_ADDRESS, every datagram's
    opcode recorded."""
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind(("127.0.0.77", 0))
    server.settimeout(0.2)
    opcodes: list[int] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                data, client = server.recvfrom(4096)
            except OSError:
                continue
            opcodes.append((data[2] >> 3) & 0xF)
            server.sendto(_answer(data), client)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], opcodes
    stop.set()
    thread.join()
    server.close()


def test_a_routed_job_resolves_names_through_the_worker_s_relay_to_a_loopback_resolver(
    tmp_path: Path, loopback_resolver: tuple[int, list[int]]
) -> None:
    """The job's resolv.conf names the relay on its own loopback; the worker passes plain
    queries to the host's resolver (here on the host's loopback, where no job could reach it)
    and its answers back; an update or an answer-shaped datagram is not passed on."""
    port, opcodes = loopback_resolver
    job_network.prepare_host(SUBNET)
    conf = dns_relay.relay_conf(tmp_path / "dns", "nameserver 127.0.0.53\nsearch corp.test\n")
    assert conf.read_text() == "nameserver 127.0.0.11\nsearch corp.test\n"
    relay = dns_relay.DnsRelay(["127.0.0.77"], port=port)
    relay.start()
    try:
        job = _sandbox(tmp_path, "look-up", [sys.executable, "-c", LOOK_UP], resolv_conf=conf)
        try:
            inner = job_network.move_in(job.pid, job_network.reserve(SUBNET))  # as the supervisor does
            listener = relay.serve(inner)
            out, err = job.communicate(timeout=60)
        finally:
            _end(job)
        relay.close(listener)
        seen = json.loads(out.decode().strip().splitlines()[-1])
        assert seen == {"answer": FAKE_ADDRESS, "update": "TimeoutError", "answer_shaped": "TimeoutError"}, (
            seen,
            err.decode()[-2000:],
        )
        assert opcodes and set(opcodes) == {0}  # the update never reached the resolver
        deadline = time.monotonic() + 5
        while listener.fileno() != -1 and time.monotonic() < deadline:  # closed by the relay's thread
            time.sleep(0.05)
        assert listener.fileno() == -1  # it held the node's namespace (and its veth) alive
    finally:
        relay.stop()
    # the walls open no resolver to jobs any more: the relay asks from the host's side
    listed = ["nft", "list", "chain", "inet", "torchjobs", "forward"]
    assert "dport 53" not in subprocess.run(listed, capture_output=True, text=True).stdout


def test_a_job_subnet_overlapping_the_host_s_own_network_is_refused() -> None:
    """The walls drop whatever reaches a job subnet: one over the host's LAN would cut the
    host's own traffic (SSH, PostgreSQL) until someone removed it by hand."""
    import ipaddress

    from workers.agent import prepare_job_network

    with pytest.raises(job_network.NetworkUnavailable, match="overlaps 192.0.2.0/24"):
        job_network.apart(ipaddress.IPv4Network("192.0.2.128/25"), ["192.0.2.0/24"])
    job_network.apart(ipaddress.IPv4Network(SUBNET), ["192.0.2.0/24"])
    lan = job_network.host_subnets()[0]  # this host's own (eth0's)
    iso = Isolation(kind="sandbox", method="bwrap-setuid", bwrap=sandbox.find_bwrap(), uid=65534, gid=65534)
    for mode in ("auto", "routed", "private"):
        with pytest.raises(SystemExit, match="a network of this host's"):
            prepare_job_network(worker(iso, job_network=mode, job_subnet=lan))


def test_a_mesh_s_hosts_file_names_each_node_as_ipv6_maps_it_too(tmp_path: Path) -> None:
    """c10d's sockets are IPv6 ones: a peer's name is asked of "::ffff:10.213.0.6". Without that
    line glibc asks DNS, and a walled or absent resolver cost each look-up 10 s (measured)."""
    sandbox.write_hosts(tmp_path, [("10.213.0.6", "torchjobs-node-0 vm")])
    lines = (tmp_path / "hosts").read_text().splitlines()
    assert "10.213.0.6 torchjobs-node-0 vm" in lines and "::ffff:10.213.0.6 torchjobs-node-0 vm" in lines
    assert "::ffff:127.0.0.1 localhost" in lines


def test_a_worker_asked_for_a_routed_network_it_cannot_give_does_not_start() -> None:
    from workers.agent import prepare_job_network
    from workers.launcher.sandbox import UNISOLATED

    bwrap = sandbox.find_bwrap()
    iso = Isolation(kind="sandbox", method="bwrap-setuid", bwrap=bwrap, uid=65534, gid=65534)
    with pytest.raises(SystemExit, match="needs the sandbox"):
        prepare_job_network(worker(UNISOLATED, job_network="routed"))
    with pytest.raises(SystemExit, match="at least a /30"):
        prepare_job_network(worker(iso, job_network="routed", job_subnet="10.213.0.0/31"))
    with pytest.raises(SystemExit, match="TORCHJOBS_JOB_NETWORK_ALLOW"):
        prepare_job_network(worker(iso, job_network="routed", job_subnet=SUBNET, job_network_allow="no"))
    private = worker(iso, job_network="private", job_subnet="10.250.0.0/24")
    prepare_job_network(private)  # a root worker: multi-node jobs' meshes, no nftables asked
    assert private.node_meshes and private.job_subnet == "10.250.0.0/24"
    # where nftables is (CI installs it), the host ends also drop whatever reaches the host
    listed = ["nft", "list", "table", "inet", "torchjobs_private"]
    wall = subprocess.run(listed, capture_output=True, text=True)
    assert 'iifname "tjh*" drop' in wall.stdout, wall.stderr
    # a worker that could wall them does not fall back to the host network for want of a subnet
    with pytest.raises(SystemExit, match="TORCHJOBS_JOB_SUBNET_POOL"):
        prepare_job_network(worker(iso, job_network="private", job_subnet_pool="10.0.0.0/25"))
    with pytest.raises(SystemExit, match="at least a /30"):  # nor for an admin's bad one
        prepare_job_network(worker(iso, job_network="private", job_subnet="10.250.0.0/31"))
    unsandboxed = worker(UNISOLATED, job_network="private")
    prepare_job_network(unsandboxed)
    assert not unsandboxed.node_meshes and unsandboxed.job_subnet is None


def test_auto_routes_the_world_where_the_worker_can_and_walls_as_much_where_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The default (`auto`): routed on a root, sandboxed worker whose nftables takes the
    table; the private network where the kernel refuses it (an `nft` that fails, as on a
    kernel without nf_tables) or the worker does not sandbox; a bad subnet stops it in any
    mode."""
    from workers.agent import prepare_job_network
    from workers.launcher.sandbox import UNISOLATED

    iso = Isolation(kind="sandbox", method="bwrap-setuid", bwrap=sandbox.find_bwrap(), uid=65534, gid=65534)
    routed = worker(iso, job_subnet=SUBNET)
    assert routed.settings.job_network == "auto"
    prepare_job_network(routed)
    assert (routed.job_network, routed.node_meshes, routed.job_subnet) == ("routed", True, SUBNET)
    assert routed.dns_relay is not None and routed.dns_conf is not None  # its nodes' look-ups
    routed.dns_relay.stop()
    assert routed.dns_conf.read_text().startswith("nameserver 127.0.0.11\n")
    with pytest.raises(SystemExit, match="at least a /30"):
        prepare_job_network(worker(iso, job_subnet="10.213.0.0/31"))
    unsandboxed = worker(UNISOLATED, job_subnet=SUBNET)
    prepare_job_network(unsandboxed)
    assert unsandboxed.job_network == "private" and not unsandboxed.node_meshes
    refusing = tmp_path / "bin"
    refusing.mkdir()
    (refusing / "nft").write_text("#!/bin/sh\necho 'Error: Not supported' >&2\nexit 1\n")
    (refusing / "nft").chmod(0o755)
    monkeypatch.setenv("PATH", f"{refusing}:{os.environ['PATH']}")
    fallback = worker(iso, job_subnet="10.250.0.0/24")
    with caplog.at_level("WARNING", logger="torchjobs.worker"):
        prepare_job_network(fallback)
    assert fallback.job_network == "private" and fallback.job_subnet == "10.250.0.0/24"
    assert fallback.node_meshes and not fallback.mesh_elements  # meshes still, with no nftables
    assert "no route to the world here" in caplog.text and "Not supported" in caplog.text


def test_a_sibling_worker_with_another_subnet_keeps_this_one_s_walled_and_masqueraded() -> None:
    job_network.prepare_host("10.251.0.0/24")
    job_network.prepare_host(SUBNET)  # as the other tests expect it, last
    listed = subprocess.run(
        ["nft", "list", "set", "inet", "torchjobs", "job_subnets"], capture_output=True, text=True
    )
    assert "10.251.0.0/24" in listed.stdout and SUBNET in listed.stdout, listed.stdout


def worker(iso: Isolation, **settings: str) -> WorkerContext:
    """A worker's context as far as its network's preparation reads it (no database: every
    case either fails before it or names its subnet)."""
    from service.config import Settings

    ctx = WorkerContext(
        settings=Settings(**settings),  # type: ignore[arg-type]
        db=None,  # type: ignore[arg-type]
        storage=None,  # type: ignore[arg-type]
        name="w",
        session_id="s",
        address="192.0.2.1",
        accelerator="cpu",
        gpus=1,
    )
    ctx.isolation = iso
    return ctx


def test_the_host_lan_is_walled_and_a_job_holds_a_bounded_number_of_flows() -> None:
    text = job_network.rules(SUBNET, extra_walled=["192.0.2.0/24", "10.1.0.0/16"])
    assert "192.0.2.0/24" in text and "10.1.0.0/16" not in text  # merged into 10.0.0.0/8
    assert f"ip saddr ct count over {job_network.FLOWS_MAX} }} drop" in text
    # a job's connections to its own other nodes count too: before the mesh is let through
    assert text.index("ct count over") < text.index("iifname . ip saddr . ip daddr @peers_out accept")
    # and on the receiving host, by destination
    assert text.index("add @flows_in { ip daddr ct count over") < text.index("@peers_in accept")
    subnets = job_network.host_subnets()
    assert subnets and not any(s.startswith("127.") for s in subnets), subnets


REACH = r"""
import socket, sys, time
deadline = time.monotonic() + float(sys.argv[2])
seen = "never tried"
while time.monotonic() < deadline:
    try:
        with socket.create_connection((sys.argv[1], 9000), timeout=1) as s:
            seen = s.recv(16).decode() or "connected"
            break
    except OSError as exc:
        seen = type(exc).__name__
        time.sleep(0.1)
print(seen)
"""


def _reach(tmp_path: Path, name: str, address: str, seconds: float) -> str:
    """What a sandbox of its own, with a veth reserved beforehand, finds at `address`:9000."""
    veth = job_network.reserve(SUBNET)
    proc = _sandbox(tmp_path, name, [sys.executable, "-c", REACH, address, str(seconds)])
    try:
        job_network.move_in(proc.pid, veth)
        out, err = proc.communicate(timeout=seconds + 30)
    finally:
        _end(proc)
    return out.decode().strip() or err.decode()[-500:]


def _elements_listed() -> str:
    return "".join(
        subprocess.run(
            ["nft", "list", "set", "inet", "torchjobs", name], capture_output=True, text=True
        ).stdout
        for name in ("peers_out", "peers_in")
    )


def _mesh_of(mine: job_network.Attached, *others: job_network.Attached) -> job_mesh.Mesh:
    """A node's mesh with other nodes of its job on this host."""
    peers = [job_mesh.Peer(job_address=o.job_address, host_address="192.0.2.1", local=True) for o in others]
    return job_mesh.Mesh(mine, peers)


def test_a_mesh_lets_a_job_s_nodes_reach_each_other_and_nobody_else(tmp_path: Path) -> None:
    """Two nodes of one job on this host (their veths made before their sandboxes, as
    node_mesh.join makes them), meshed: one reaches the other; a third node, of another job,
    reaches neither; once one node's mesh is closed, the other's elements stay; once both
    are, nothing of either is left."""
    job_network.prepare_host(SUBNET)
    listener_veth = job_network.reserve(SUBNET)
    listener = _sandbox(tmp_path, "node0", [sys.executable, "-c", LISTEN])
    try:
        job_network.move_in(listener.pid, listener_veth)
        address = listener_veth.job_address
        peer_veth = job_network.reserve(SUBNET)
        meshes = [_mesh_of(peer_veth, listener_veth), _mesh_of(listener_veth, peer_veth)]
        for mesh in meshes:
            mesh.open()
        try:
            sandbox_proc = _sandbox(tmp_path, "node1", [sys.executable, "-c", REACH, address, "15"])
            try:
                job_network.move_in(sandbox_proc.pid, peer_veth)
                out, err = sandbox_proc.communicate(timeout=60)
            finally:
                _end(sandbox_proc)
            assert out.decode().strip() == "job", err.decode()[-2000:]
            assert _reach(tmp_path, "other", address, 4) in ("TimeoutError", "timeout")
            meshes[0].close()
            listed = _elements_listed()
            assert f'"{listener_veth.host_if}" . {address} . {peer_veth.job_address}' in listed, listed
            assert f'"{peer_veth.host_if}"' not in listed, listed
        finally:
            for mesh in meshes:
                mesh.close()
        listed = _elements_listed()
        assert address not in listed and peer_veth.job_address not in listed, listed
    finally:
        _end(listener)


def test_a_new_node_forgets_what_a_killed_worker_left_under_its_veth_or_address() -> None:
    job_network.prepare_host(SUBNET)
    stale = (
        '"tjh3e80" . 10.213.250.2 . 10.214.0.6, "tjh3e81" . 10.213.250.6 . 10.213.250.2, '
        '"tjh3e82" . 10.213.250.10 . 10.214.0.10'
    )
    for name in ("peers_out", "peers_in"):
        subprocess.run(["nft", "add", "element", "inet", "torchjobs", name, f"{{ {stale} }}"], check=True)
    table = str(job_network.ROUTE_TABLE_BASE + 0x3E80)
    subprocess.run(["ip", "route", "add", "blackhole", "10.214.0.6/32", "table", table], check=True)
    job_network.prepare_host(SUBNET)  # a sibling worker's start keeps them (a running mesh's)
    assert "10.213.250.2 " in _elements_listed()
    job_network.forget(job_network.Attached(host_if="tjh3e80", host_address="", job_address="10.213.250.2"))
    listed = _elements_listed()
    assert "10.213.250.2 " not in listed and "tjh3e80" not in listed, listed
    assert '"tjh3e82" . 10.213.250.10 . 10.214.0.10' in listed, listed
    shown = subprocess.run(["ip", "route", "show", "table", table], capture_output=True, text=True)
    assert shown.stdout.strip() == ""
    job_network.forget(job_network.Attached(host_if="tjh3e82", host_address="", job_address=""))
    assert "tjh3e82" not in _elements_listed()


def test_a_mesh_routes_remote_nodes_through_their_hosts_in_a_table_of_its_own() -> None:
    job_network.prepare_host(SUBNET)
    mine = job_network.reserve(SUBNET)
    gateway_link = f"tjg{os.getpid() % 100000}"
    try:
        remote = job_mesh.Peer(job_address="10.214.0.6", host_address=WORLD_GATEWAY, local=False)
        # the remote host's address must be reachable for a route through it: on a link of ours
        _ip("link", "add", gateway_link, "type", "veth", "peer", "name", f"{gateway_link}p")
        _ip("addr", "add", f"{WORLD_GATEWAY}/32", "dev", gateway_link)
        _ip("link", "set", gateway_link, "up")
        _ip("route", "add", f"{WORLD_GATEWAY}/32", "dev", gateway_link)
        mesh = job_mesh.Mesh(mine, [remote])
        mesh.open()
        table = str(job_network.route_table(mine))
        shown = subprocess.run(["ip", "route", "show", "table", table], capture_output=True, text=True)
        assert f"10.214.0.6 via {WORLD_GATEWAY}" in shown.stdout, shown.stdout
        rules = subprocess.run(["ip", "rule", "show"], capture_output=True, text=True).stdout
        assert f"from {mine.job_address} lookup {table}" in rules, rules
        main = subprocess.run(["ip", "route", "show", "10.214.0.6/32"], capture_output=True, text=True)
        assert main.stdout.strip() == ""  # nothing in the host's own table: no other node routed there
        mesh.close()
        shown = subprocess.run(["ip", "route", "show", "table", table], capture_output=True, text=True)
        rules = subprocess.run(["ip", "rule", "show"], capture_output=True, text=True).stdout
        assert shown.stdout.strip() == "" and f"lookup {table}" not in rules
    finally:
        subprocess.run(["ip", "link", "del", gateway_link], capture_output=True)
        job_network.release(mine)


def test_a_starting_worker_sweeps_the_veths_a_killed_worker_never_moved_in() -> None:
    job_network.prepare_host(SUBNET)
    dead, alive = job_network.reserve(SUBNET), job_network.reserve(SUBNET)
    try:
        gone = subprocess.Popen(["true"])
        gone.wait()
        _ip("link", "set", dead.host_if, "alias", f"torchjobs {gone.pid}")
        swept = job_network.sweep_left()
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        assert dead.host_if in swept and f"{dead.host_if}@" not in links
        assert alive.host_if not in swept and f"{alive.host_if}@" in links  # this process made it
    finally:
        job_network.release(dead)
        job_network.release(alive)


BOUND_CONNECT = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, sys.argv[1].encode())
s.settimeout(4)
try:
    s.connect((sys.argv[2], int(sys.argv[3])))
    print(s.recv(16).decode())
except OSError as exc:
    print(type(exc).__name__)
"""


def _bound_probe(sealed: bool, port: int) -> str:
    """A namespace whose only address is a /32 on a veth, as a private mesh's node has, and
    whose unprivileged process connects to the host end's address through the interface
    bound by name (the kernel then takes the address as on the link and asks by ARP)."""
    tag = f"{os.getpid() % 100000}{int(sealed)}"
    ns, outer, inner = f"tjsn{tag}", f"tjso{tag}", f"tjsi{tag}"
    host, job = f"10.252.{int(sealed)}.1", f"10.252.{int(sealed)}.2"
    _ip("netns", "add", ns)
    try:
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("addr", "add", f"{host}/30", "dev", outer)
        if sealed:
            job_network._seal(outer)
            if os.path.exists(f"/proc/sys/net/ipv6/conf/{outer}"):  # no link-local address to reach
                assert Path(f"/proc/sys/net/ipv6/conf/{outer}/disable_ipv6").read_text().strip() == "1"
            mac = json.loads(subprocess.run(["ip", "-j", "link", "show", inner], capture_output=True).stdout)
            _ip("neigh", "replace", job, "lladdr", mac[0]["address"], "dev", outer, "nud", "permanent")
        _ip("link", "set", outer, "up")
        _ip("link", "set", inner, "netns", ns)
        for cmd in (["addr", "add", f"{job}/32", "dev", inner], ["link", "set", inner, "up"]):
            _ip("-n", ns, *cmd)
        probe = ["ip", "netns", "exec", ns, "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                 sys.executable, "-c", BOUND_CONNECT, inner, host, str(port)]  # fmt: skip
        return subprocess.run(probe, capture_output=True, text=True, timeout=60).stdout.strip()
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", outer], capture_output=True)


def test_a_sealed_host_end_answers_nothing_a_bound_socket_asks() -> None:
    """No route is not a wall: bound to its interface, an unprivileged process reaches a
    service listening on all the host's addresses through the unsealed end (the control) and
    not through a sealed one (job_network._seal), which also has no IPv6."""
    server = socket.create_server(("0.0.0.0", 0))
    port = server.getsockname()[1]

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = server.accept()
                conn.sendall(b"host")
                conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        assert _bound_probe(False, port) == "host"  # a test of the test: the attack works there
        assert _bound_probe(True, port) in ("TimeoutError", "OSError")
    finally:
        server.close()
