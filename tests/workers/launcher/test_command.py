"""The pure launch planner: argv, environment and folders for every mode and entrypoint."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from workers.launcher import lifeline, seccomp
from workers.launcher.command import NodeLaunch, build_launch, passthrough, processes_per_node
from workers.launcher.sandbox import ENTRY, Isolation

BUILTIN = {"kind": "builtin", "model": "cnn", "dataset": "digits"}
WORKER_ENV = {
    "PATH": "/root/bin:/bin",
    "HOME": "/root",
    "TORCHJOBS_DATABASE_URL": "postgresql://secret",
    "TORCHJOBS_ADMIN_TOKEN": "tj_admin",
    "AWS_SECRET_ACCESS_KEY": "s3cret",
    "DATABASE_URL": "postgresql://secret",
    "MASTER_PORT": "1",
    "RANK": "9",
    "OMP_NUM_THREADS": "1",
    "NCCL_SOCKET_IFNAME": "eth0",
    "BROWSER": "sh -c id",
}


def launch(**overrides: object) -> NodeLaunch:
    fields: dict[str, object] = dict(
        job_id=7,
        attempt=2,
        node_rank=0,
        nnodes=1,
        mode="ddp",
        gpus=(0, 1),
        accelerator="cpu",
        master_addr="127.0.0.1",
        master_port=29555,
        entrypoint=BUILTIN,
        hyperparameters={"epochs": 2},
        script_path=None,
        run_dir=Path("/runs/j7"),
        python="/py",
        base_env=passthrough(WORKER_ENV, "OMP_NUM_THREADS,NCCL_*,AWS_*,TORCHJOBS_*,RANK"),
        user_env={"MY_FLAG": "1"},
    )
    fields.update(overrides)
    return NodeLaunch(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("mode", "gpus", "nproc"), [("single", 1, 1), ("dp", 4, 1), ("ddp", 4, 4), ("ddp", 1, 1)]
)
def test_processes_per_node(mode: str, gpus: int, nproc: int) -> None:
    assert processes_per_node(mode, gpus) == nproc


def test_builtin_ddp_argv() -> None:
    plan = build_launch(launch())
    assert plan.argv[:3] == ["/py", "-m", "torch.distributed.run"]
    assert "--nproc-per-node=2" in plan.argv and "--nnodes=1" in plan.argv and "--node-rank=0" in plan.argv
    assert "--master-addr=127.0.0.1" in plan.argv and "--master-port=29555" in plan.argv
    assert "--rdzv-id=torchjobs-7-2" in plan.argv and "--redirects=3" in plan.argv
    # torchrun's SIGTERM-to-SIGKILL wait is the job's stop grace, not its own 30 s (contract §12)
    assert "--shutdown-timeout=120" in plan.argv
    assert "--shutdown-timeout=900" in build_launch(launch(stop_grace_s=900)).argv
    assert plan.argv[-4:] == ["-m", "workers.runtime.trainer.train", "--config", "/runs/j7/config.json"]
    assert plan.config == {
        "mode": "ddp",
        "accelerator": "cpu",
        "gpus_per_node": 2,
        "entrypoint": BUILTIN,
        "hyperparameters": {"epochs": 2},
    }


def test_script_argv_runs_the_file_with_its_args() -> None:
    plan = build_launch(
        launch(
            entrypoint={"kind": "script", "path": "t.py", "args": ["--lr", "0.1"]},
            script_path="/roots/t.py",
            mode="single",
            gpus=(1,),
        )
    )
    # the file itself runs unchanged, behind the pre-flight wrapper
    assert plan.argv[-5:] == ["-m", "workers.runtime.script", "/roots/t.py", "--lr", "0.1"]
    assert plan.config is None
    assert "--nproc-per-node=1" in plan.argv


def test_rank_environment_is_the_contract_and_nothing_of_ours() -> None:
    env = build_launch(launch(resume_path="/cache/abc.pt")).env
    assert env["TORCHJOBS_JOB_ID"] == "7"
    assert env["TORCHJOBS_CHECKPOINT_DIR"] == "/runs/j7/checkpoints"
    assert env["TORCHJOBS_EVENTS"] == "/runs/j7/events.jsonl"
    assert env["TORCHJOBS_RESUME_FROM"] == "/cache/abc.pt"
    assert env["MY_FLAG"] == "1" and env["PATH"] == "/:/usr/local/bin:/usr/bin:/bin"
    assert "TORCHJOBS_DATABASE_URL" not in env  # the worker's secrets never reach a rank
    assert "MASTER_PORT" not in env and "RANK" not in env  # torchrun sets these itself
    assert env["HOME"] == "/runs/j7/home" and env["LANG"] == "C.UTF-8"
    assert env["TMPDIR"].startswith("/tmp/torchjobs-")
    assert env["TORCHJOBS_PREFLIGHT_TIMEOUT_S"] == "60"


def test_the_rank_environment_is_an_allow_list_never_the_workers_minus_names() -> None:
    """Even an administrator who lets AWS_*, TORCHJOBS_* or RANK through passes none of them;
    a variable nobody named (DATABASE_URL, BROWSER) stays behind."""
    env = build_launch(launch(user_env={})).env
    ours = {k for k in env if k.startswith("TORCHJOBS_")}
    assert ours == {
        "TORCHJOBS_JOB_ID", "TORCHJOBS_ATTEMPT", "TORCHJOBS_CHECKPOINT_DIR", "TORCHJOBS_EVENTS",
        "TORCHJOBS_ACCELERATOR", "TORCHJOBS_PREFLIGHT_TIMEOUT_S", "TORCHJOBS_SLOTS",
    }  # fmt: skip
    rest = set(env) - ours
    assert rest == {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONUNBUFFERED", "CUDA_VISIBLE_DEVICES",
                    "OMP_NUM_THREADS", "NCCL_SOCKET_IFNAME", "USER", "LOGNAME"}  # fmt: skip
    for secret in ("postgresql://secret", "tj_admin", "s3cret", "sh -c id"):
        assert secret not in env.values()


def test_a_node_in_its_own_network_namespace_gets_no_host_interface_names() -> None:
    """A worker told GLOO_SOCKET_IFNAME=tj0 for its multi-node jobs: a single-node job in a
    namespace of its own has no tj0, and gloo would fail to start. The job's own env stays."""
    passed = passthrough({**WORKER_ENV, "GLOO_SOCKET_IFNAME": "tj0"}, "OMP_NUM_THREADS,NCCL_*,GLOO_*")
    host = build_launch(launch(base_env=passed, user_env={})).env
    assert (host["GLOO_SOCKET_IFNAME"], host["NCCL_SOCKET_IFNAME"]) == ("tj0", "eth0")
    iso = Isolation(kind="sandbox", method="bwrap-setuid", bwrap="/bw", uid=4242, gid=4243)
    own = build_launch(launch(base_env=passed, user_env={}, private_network=True, isolation=iso)).env
    assert "GLOO_SOCKET_IFNAME" not in own and "NCCL_SOCKET_IFNAME" not in own
    assert own["OMP_NUM_THREADS"] == "1"
    mine = build_launch(
        launch(base_env=passed, user_env={"GLOO_SOCKET_IFNAME": "lo"}, private_network=True, isolation=iso)
    ).env
    assert mine["GLOO_SOCKET_IFNAME"] == "lo"
    # a multi-node job keeps the host's network, and the names its peers are reached by
    two = build_launch(launch(base_env=passed, nnodes=2, private_network=True, isolation=iso)).env
    assert two["GLOO_SOCKET_IFNAME"] == "tj0"


def test_a_routed_multi_node_job_s_node_meets_its_peers_over_its_own_veth() -> None:
    """Its veth made beforehand (workers/node_mesh.py): its own namespace, gloo/NCCL/TensorPipe
    on eth0 (not the host's tj0; the job's own env still wins), and torchrun only once the
    veth's route is there (it is moved in a moment after the sandbox starts)."""
    from workers.launcher.command import AWAIT_ROUTE
    from workers.launcher.job_network import Attached

    passed = passthrough({**WORKER_ENV, "GLOO_SOCKET_IFNAME": "tj0"}, "OMP_NUM_THREADS,NCCL_*,GLOO_*")
    iso = Isolation(kind="sandbox", method="bwrap-setuid", bwrap="/bw", uid=4242, gid=4243)
    veth = Attached(host_if="tjh5", host_address="10.213.0.21", job_address="10.213.0.22")
    hosts = (("10.213.0.22", "torchjobs-node-0"), ("10.214.0.6", "torchjobs-node-1"))
    node = launch(base_env=passed, nnodes=2, private_network=True, isolation=iso, veth=veth,
                  master_addr="10.213.0.22", routed_subnet="10.213.0.0/16", mesh_hosts=hosts)  # fmt: skip
    plan = build_launch(node)
    assert "--unshare-net" in plan.argv and plan.veth == veth and plan.private_network
    # its own /etc/hosts names its nodes: a peer's reverse look-up never asks a walled resolver
    assert plan.hosts == hosts
    ours = plan.argv.index("/runs/j7.identity/hosts")
    assert plan.argv[ours - 1 : ours + 2] == ["--ro-bind", "/runs/j7.identity/hosts", "/etc/hosts"]
    assert plan.argv.index("/etc/hosts") < ours  # after the host's own: bound over it
    assert [plan.env[k] for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TP_SOCKET_IFNAME")] == [
        "eth0"
    ] * 3
    gate = plan.inner_argv[: plan.inner_argv.index("--") + 1]
    assert gate == [node.python, "-S", "-I", "-c", AWAIT_ROUTE, str(node.rendezvous_timeout_s), "0", "--"]
    assert plan.inner_argv[len(gate) : len(gate) + 3] == [node.python, "-m", "torch.distributed.run"]
    assert "--master-addr=10.213.0.22" in plan.inner_argv
    # a warm spare's agent gets torchrun's own line and waits for the same routes itself
    assert plan.torchrun_argv == plan.inner_argv[len(gate) :]
    assert plan.routes == (float(node.rendezvous_timeout_s), 0)
    own = build_launch(dataclasses.replace(node, user_env={"GLOO_SOCKET_IFNAME": "lo"}))
    assert own.env["GLOO_SOCKET_IFNAME"] == "lo"
    # a private mesh's node: no default route to wait for, but one host route per peer
    private = dataclasses.replace(veth, gateway=False, peers=("10.214.0.6", "10.214.0.10"))
    mesh = build_launch(dataclasses.replace(node, veth=private, routed_subnet=None))
    assert "--unshare-net" in mesh.argv and mesh.veth == private
    assert mesh.inner_argv[mesh.inner_argv.index("--") - 1] == "2" and mesh.routes == (
        float(node.rendezvous_timeout_s),
        2,
    )
    # without a veth made beforehand (a worker that cannot make one), the host's network
    host = build_launch(dataclasses.replace(node, veth=None))
    assert "--unshare-net" not in host.argv and host.env["GLOO_SOCKET_IFNAME"] == "tj0"
    assert host.inner_argv[:3] == [node.python, "-m", "torch.distributed.run"]
    assert host.torchrun_argv == host.inner_argv and host.routes is None


def test_the_route_gate_waits_for_a_default_route_then_becomes_the_command() -> None:
    """In a network namespace of its own (root, as CI runs): no default route, the gate gives
    up after its time, saying why; a route added a moment later, it becomes the command."""
    from workers.launcher.command import AWAIT_ROUTE

    gate = [sys.executable, "-S", "-I", "-c", AWAIT_ROUTE]
    none = subprocess.run(
        ["unshare", "--net", *gate, "0.5", "0", "--", "/bin/echo", "no"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert none.returncode == 1 and "never came up" in none.stderr and none.stdout == "", none.stderr
    later = 'ip link set lo up; (sleep 0.5; ip route add default dev lo) & exec "$@"'
    went = subprocess.run(
        ["unshare", "--net", "sh", "-c", later, "sh", *gate, "20", "0", "--", "/bin/echo", "went on"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (went.returncode, went.stdout) == (0, "went on\n"), went.stderr


def test_the_route_gate_of_a_private_mesh_waits_for_a_route_to_every_peer() -> None:
    """Two peers: one host route is not enough (the gate gives up), the second lets it on."""
    from workers.launcher.command import AWAIT_ROUTE

    gate = [sys.executable, "-S", "-I", "-c", AWAIT_ROUTE]
    one = 'ip link set lo up; ip route add 10.214.0.6/32 dev lo; exec "$@"'
    half = subprocess.run(
        ["unshare", "--net", "sh", "-c", one, "sh", *gate, "0.5", "2", "--", "/bin/echo", "no"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert half.returncode == 1 and "never came up" in half.stderr, half.stderr
    later = one.replace("exec", "(sleep 0.5; ip route add 10.214.0.10/32 dev lo) & exec")
    went = subprocess.run(
        ["unshare", "--net", "sh", "-c", later, "sh", *gate, "20", "2", "--", "/bin/echo", "went on"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (went.returncode, went.stdout) == (0, "went on\n"), went.stderr


def test_a_sandboxed_launch_runs_torchrun_inside_bubblewrap_with_its_own_view() -> None:
    iso = Isolation(kind="sandbox", method="bwrap-setuid", bwrap="/bw", uid=4242, gid=4243)
    plan = build_launch(
        launch(isolation=iso, resume_path="/home/tj/cache/abc.pt", read_only=("/venv",), private_network=True)
    )
    argv = plan.argv
    assert argv[0] == "/bw" and "--unshare-pid" in argv and "--clearenv" in argv
    assert "--reuid=4242" in argv and "--no-new-privs" in argv and plan.owner == (4242, 4243)
    assert argv[argv.index("--bind") + 1 : argv.index("--bind") + 3] == ["/runs/j7", "/job"]
    assert argv[argv.index("/home/tj/cache/abc.pt") - 1 :][:3] == [
        "--ro-bind",
        "/home/tj/cache/abc.pt",
        "/resume/abc.pt",
    ]
    assert argv[argv.index("/venv") - 1 :][:3] == ["--ro-bind-try", "/venv", "/venv"]
    # the entry program, then torchrun itself, unchanged, with paths as the ranks see them
    tail = argv[argv.index(ENTRY) + 1 :]
    assert tail[0] == str(lifeline.read_end()) and float(tail[1]) == lifeline.ORPHAN_GRACE_S  # its worker's
    assert bytes.fromhex(tail[2]) == seccomp.program()  # the system-call filter it installs
    tail = tail[3:]
    assert tail[0] == "/job/.rank-env.json" and tail[1:4] == ["/py", "-m", "torch.distributed.run"]
    # the node's uid has a name inside: /etc/passwd and /etc/group from beside its run folder
    assert (
        argv[argv.index("/runs/j7.identity/passwd") :][:2] == ["/runs/j7.identity/passwd", "/etc/passwd"]
        and "/runs/j7.identity/group" in argv
    )
    assert "--unshare-net" in argv  # a single-node job: a network of its own
    assert tail[-2:] == ["--config", "/job/config.json"] and "--log-dir=/job/logs" in tail
    env = plan.env
    assert env["TORCHJOBS_CHECKPOINT_DIR"] == "/job/checkpoints" and env["TMPDIR"] == "/tmp"
    assert env["TORCHJOBS_RESUME_FROM"] == "/resume/abc.pt" and env["HOME"] == "/job/home"
    assert plan.process_env == {"PATH": "/usr/local/bin:/usr/bin:/bin"}  # bwrap gets nothing of the job
    assert plan.paths.run_dir == Path("/runs/j7")  # the supervisor's side stays the host's


def test_a_user_namespace_sandbox_maps_another_uid_and_forbids_nested_namespaces() -> None:
    iso = Isolation(kind="sandbox", method="bwrap-userns", bwrap="/bw")
    plan = build_launch(launch(isolation=iso))
    assert "--unshare-user" in plan.argv and "--disable-userns" in plan.argv and plan.owner is None
    assert not any(a.startswith("--reuid") for a in plan.argv)


def test_tmpdir_stays_short_for_unix_sockets_however_deep_the_home() -> None:
    deep = Path("/" + "/".join(["very-long-folder-name"] * 12))
    env = build_launch(launch(run_dir=deep)).env
    # torch's multiprocessing puts sockets like TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX there
    assert len(env["TMPDIR"]) + len("/pymp-abcdefgh/listener-abcdefgh") < 100
    assert build_launch(launch(run_dir=deep / "other")).env["TMPDIR"] != env["TMPDIR"]


def test_cuda_hosts_pin_the_assigned_devices() -> None:
    env = build_launch(launch(accelerator="cuda", gpus=(2, 3))).env
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    cpu_env = build_launch(launch(accelerator="cpu", gpus=(2, 3))).env
    assert cpu_env["CUDA_VISIBLE_DEVICES"] == "" and cpu_env["TORCHJOBS_SLOTS"] == "2,3"
    assert "TORCHJOBS_WORKER_SLOTS" not in cpu_env and env["TORCHJOBS_SLOTS"] == "2,3"


def test_ranks_are_told_the_workers_slot_count_to_share_its_cores() -> None:
    """CPU ranks pin themselves to their share, CUDA ranks cap their threads at it (cpus.py)."""
    for accelerator in ("cpu", "cuda"):
        env = build_launch(launch(accelerator=accelerator, gpus=(2, 3), worker_slots=4)).env
        assert (env["TORCHJOBS_SLOTS"], env["TORCHJOBS_WORKER_SLOTS"]) == ("2,3", "4")
    with pytest.raises(ValueError, match="outside the worker's 2"):
        launch(gpus=(1, 2), worker_slots=2)


def test_user_and_logname_name_the_ranks_account_whatever_the_job_or_admin_pass() -> None:
    """The name /etc/passwd gives the ranks' uid: the sandbox user's `torchjobs` for a root
    worker, the worker's own account where the ranks run as it."""
    import os
    import pwd

    iso = Isolation(kind="sandbox", method="bwrap-setuid", bwrap="/bw", uid=4242, gid=4243)
    env = build_launch(launch(isolation=iso, user_env={"USER": "root", "LOGNAME": "root"})).env
    assert (env["USER"], env["LOGNAME"]) == ("torchjobs", "torchjobs")
    own = pwd.getpwuid(os.getuid()).pw_name
    assert build_launch(launch()).env["USER"] == own


def test_no_resume_means_no_variable() -> None:
    assert "TORCHJOBS_RESUME_FROM" not in build_launch(launch()).env


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (dict(mode="zz"), "unknown mode 'zz'"),
        (dict(node_rank=1), r"node_rank outside \[0, nnodes\)"),
        (dict(gpus=()), "a node needs at least one GPU slot"),
        (dict(entrypoint={"kind": "script", "path": "x"}), "a script entrypoint needs its resolved path"),
    ],
)
def test_inconsistent_launches_are_refused(bad: dict[str, object], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        launch(**bad)


def test_multi_node_argv() -> None:
    plan = build_launch(launch(nnodes=2, node_rank=1, master_addr="10.0.0.2"))
    assert (
        "--nnodes=2" in plan.argv and "--node-rank=1" in plan.argv and "--master-addr=10.0.0.2" in plan.argv
    )
