"""A process started inside a running rank's sandbox (contract §14): its command line.

What the exec'd process gets is what the rank has, no more: on a root worker,
`nsenter` joins the rank's mount, PID, network, IPC, UTS and cgroup namespaces and its root
directory (taken from descriptors the worker opened on the rank's /proc entry and checked
against the node's PID namespace, so a recycled PID cannot point it elsewhere), after the
cgroup join program (cgroups.py) has put it in the node's control groups; then util-linux's
`setpriv` becomes the rank's own uid and gid, with no capabilities, an empty bounding set and
`no_new_privs`; then ENTRY (below) arms PR_SET_PDEATHSIG and execs the command with the
ranks' environment. The sandbox's seccomp filter (seccomp.py, the program sandbox.ENTRY
installs) is installed between nsenter and setpriv, by PREFILTER, still as root: after `setns`
(which it forbids) and before the process is the rank's uid. Installed later, by the exec'd
Python itself, it left a window in which that Python, already of the job's uid, dumpable and
unfiltered, could be ptrace'd by any process of the job and made to exec what it liked: a
shell without the filter (`unshare -U` worked there), or the admin's exec answering with the
job's output. PREFILTER also closes every descriptor but the standard ones and a pty's control
pipe, so the namespace descriptors nsenter was given never reach the rank's uid.

On a non-root worker (`bwrap-userns`) the ranks' sandbox is an unprivileged user namespace
the worker made, and the ranks are the worker's own uid, mapped. USERNS_JOIN (below) joins
that user namespace too, which gives it every capability inside it for the other joins and
the chroot, and sets the filter before any process of it is in the job's view; the exec of
ENTRY, as a uid that is not the namespace's root, leaves it no capability: what a rank has.
A worker without a sandbox runs the command as the ranks run, the worker's own uid in the
node's run folder, in its control groups.

Pure functions: the endpoint (workers/exec_endpoint.py) acts on them.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Mapping, Sequence

from workers.launcher import seccomp
from workers.launcher.command import SYSTEM_PATH

NAMESPACES = ("mnt", "pid", "net", "ipc", "uts", "cgroup")
NSENTER_FLAG = {"mnt": "mount", "pid": "pid", "net": "net", "ipc": "ipc", "uts": "uts", "cgroup": "cgroup"}

# Run inside: argv[1] seccomp program (hex, may be empty), argv[2] the environment (hex JSON),
# argv[3] the working directory, argv[4] "-" or the control descriptor of a pty session,
# argv[5:] the command. Every other inherited descriptor is closed first (the namespace
# descriptors nsenter was given must not reach the job's command).
ENTRY = r"""
import ctypes, json, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(1, signal.SIGKILL)
ctl = -1 if sys.argv[4] == "-" else int(sys.argv[4])
for fd in os.listdir("/proc/self/fd"):
    if int(fd) > 2 and int(fd) != ctl:
        try: os.close(int(fd))
        except OSError: pass
prog = bytes.fromhex(sys.argv[1])
if prog:
    class Prog(ctypes.Structure): _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
    fprog = Prog(len(prog) // 8, prog)
    ul = ctypes.c_ulong
    if libc.prctl(38, ul(1), ul(0), ul(0), ul(0)) or libc.prctl(22, ul(2), ctypes.byref(fprog), ul(0), ul(0)):
        sys.exit("torchjobs exec: seccomp filter refused: " + os.strerror(ctypes.get_errno()))
env = json.loads(bytes.fromhex(sys.argv[2]))
try: os.chdir(sys.argv[3])
except OSError: pass
argv = sys.argv[5:]
def run():
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as exc:
        os.write(2, ("torchjobs exec: %s: %s\n" % (argv[0], exc.strerror)).encode())
        os._exit(127 if isinstance(exc, FileNotFoundError) else 126)
if ctl < 0:
    try: os.setsid()
    except OSError: pass
    run()
import fcntl, pty, select, struct, termios
pid, master = pty.fork()
if pid == 0:
    libc.prctl(1, signal.SIGKILL)
    os.close(ctl)
    run()
signal.signal(signal.SIGTERM, lambda *a: os.kill(pid, signal.SIGKILL))
ins, buf = [0, master, ctl], b""
while master in ins:
    for fd in select.select(ins, [], [])[0]:
        try: data = os.read(fd, 65536)
        except OSError: data = b""
        if fd == master:
            if not data: ins.remove(master)
            else: os.write(1, data)
        elif fd == 0:
            if not data: ins.remove(0); os.write(master, b"\x04")
            else: os.write(master, data)
        else:
            if not data: ins.remove(ctl); continue
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                rows, cols = (int(x) for x in line.split())
                fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
                os.kill(pid, signal.SIGWINCH)
status = os.waitpid(pid, 0)[1]
sys.exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
"""

# `forward`: one TCP connection from inside the sandbox to 127.0.0.1:PORT, relayed over stdin
# and stdout. Its first byte says whether the connection was made (0) or not (1, then why).
FORWARD = r"""
import os, select, socket, sys
try:
    sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
except OSError as exc:
    os.write(1, b"\x01" + (exc.strerror or str(exc)).encode()[:200])
    sys.exit(1)
sock.settimeout(None)
os.write(1, b"\x00")
ins = [0, sock.fileno()]
while ins:
    for fd in select.select(ins, [], [])[0]:
        try: data = os.read(fd, 65536) if fd == 0 else sock.recv(65536)
        except OSError: data = b""
        if fd == 0:
            if data: sock.sendall(data)
            else: ins.remove(0); sock.shutdown(socket.SHUT_WR)
        else:
            if data: os.write(1, data)
            else: sys.exit(0)
"""


# Run as root inside the rank's namespaces: argv[1] seccomp program (hex), argv[2] "-" or the
# control descriptor to keep, argv[3:] what to exec (setpriv ...).
PREFILTER = r"""
import ctypes, os, sys
keep = -1 if sys.argv[2] == "-" else int(sys.argv[2])
for fd in os.listdir("/proc/self/fd"):
    if int(fd) > 2 and int(fd) != keep:
        try: os.close(int(fd))
        except OSError: pass
libc = ctypes.CDLL(None, use_errno=True)
prog = bytes.fromhex(sys.argv[1])
class Prog(ctypes.Structure): _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
fprog = Prog(len(prog) // 8, prog)
ul = ctypes.c_ulong
nnp = libc.prctl(38, ul(1), ul(0), ul(0), ul(0))
if not prog or nnp or libc.prctl(22, ul(2), ctypes.byref(fprog), ul(0), ul(0)):
    sys.exit("torchjobs exec: seccomp filter refused: " + os.strerror(ctypes.get_errno()))
os.execv(sys.argv[3], sys.argv[3:])
"""


class Refused(Exception):
    """This worker cannot enter that sandbox; the message says why (the caller's 400)."""


def forward_argv(python: str, port: int) -> list[str]:
    return [python, "-S", "-I", "-c", FORWARD, str(port)]


def entry_argv(
    python: str,
    env: Mapping[str, str],
    cwd: str,
    control_fd: int | None,
    argv: Sequence[str],
    *,
    filtered: bool,
) -> list[str]:
    """ENTRY's command line: the filter (or none, unsandboxed), the environment, the command."""
    prog = seccomp.program().hex() if filtered else ""
    env_hex = json.dumps(dict(env)).encode().hex()
    ctl = "-" if control_fd is None else str(control_fd)
    return [python, "-S", "-I", "-c", ENTRY, prog, env_hex, cwd, ctl, *argv]


def sandboxed_argv(
    ns_fds: Mapping[str, int],
    root_fd: int,
    uid: int,
    gid: int,
    inner: Sequence[str],
    *,
    control_fd: int | None = None,
) -> list[str]:
    """nsenter into the rank's namespaces and root (descriptors this process holds, passed
    on), then PREFILTER (the seccomp filter, as root), then setpriv to the rank's uid with
    nothing more, then `inner` (an ENTRY argv)."""
    if uid == 0 or gid == 0:
        raise Refused("the rank runs as root: refusing to start a process as root in it")
    nsenter = shutil.which("nsenter") or "/usr/bin/nsenter"
    setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
    args = [nsenter]
    for name in NAMESPACES:
        if name in ns_fds:
            args.append(f"--{NSENTER_FLAG[name]}=/proc/self/fd/{ns_fds[name]}")
    args.append(f"--root=/proc/self/fd/{root_fd}")
    keep = "-" if control_fd is None else str(control_fd)
    args += ["--", python(), "-S", "-I", "-c", PREFILTER, seccomp.program().hex(), keep]
    args += [setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
    args += ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    return [*args, *inner]


# A non-root worker's exec (`userns_argv`): joins the user namespace that owns the rank's
# namespaces (bubblewrap's outer one), then those namespaces, then the rank's own user
# namespace nested in it (`--disable-userns` made it), and the rank's root, in this one
# process, which no process of the job can see (it stays in the host's PID namespace). It
# empties the capability bounding set, sets no_new_privs and the seccomp filter while it still
# holds the capabilities the joins gave it; only then forks the child that lives in the job's
# PID namespace, and execs `inner` there, as the rank's uid, which is not the namespace's
# root: the exec leaves it no capability. (nsenter would exec between the join and the filter,
# and that exec alone drops the capabilities: the filter's program would start as a plain
# process of the job's uid, unfiltered, that a rank could ptrace.)
# argv[1] the namespace descriptors (JSON: "user", "mnt", ...), argv[2] the root's descriptor,
# argv[3] the seccomp program (hex), argv[4] "-" or the descriptor to keep, argv[5:] `inner`.
USERNS_JOIN = r"""
import ctypes, fcntl, json, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
def fail(what):
    sys.exit("torchjobs exec: %s: %s" % (what, os.strerror(ctypes.get_errno())))
def join(fd, what):
    if libc.setns(fd, 0) != 0:
        fail("cannot join the rank's %s namespace" % what)
fds = json.loads(sys.argv[1])
try:
    owner = fcntl.ioctl(fds["mnt"], 0xB701)  # NS_GET_USERNS: bwrap's outer user namespace
except OSError as exc:
    sys.exit("torchjobs exec: the owner of the rank's mount namespace: %s" % exc.strerror)
nested = os.fstat(owner).st_ino != os.fstat(fds["user"]).st_ino
join(owner, "owning user")
for name in ("mnt", "pid", "net", "ipc", "uts", "cgroup"):
    if name in fds:
        join(fds[name], name)
if nested:  # the rank's own, inside that one (bwrap --disable-userns)
    join(fds["user"], "user")
os.fchdir(int(sys.argv[2]))
os.chroot(".")
os.chdir("/")
keep = -1 if sys.argv[4] == "-" else int(sys.argv[4])
# (this process has no PID in the job's /proc, which it sees now: its descriptors by range)
if keep > 2:
    os.closerange(3, keep)
os.closerange(max(3, keep + 1), 1 << 20)
ul = ctypes.c_ulong
for cap in range(64):
    if libc.prctl(24, ul(cap), ul(0), ul(0), ul(0)) and ctypes.get_errno() != 22:  # PR_CAPBSET_DROP
        fail("cannot drop capability %d" % cap)
if libc.prctl(47, ul(4), ul(0), ul(0), ul(0)):  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
    fail("cannot clear the ambient capabilities")
prog = bytes.fromhex(sys.argv[3])
class Prog(ctypes.Structure): _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
fprog = Prog(len(prog) // 8, prog)
nnp = libc.prctl(38, ul(1), ul(0), ul(0), ul(0))
if not prog or nnp or libc.prctl(22, ul(2), ctypes.byref(fprog), ul(0), ul(0)):
    fail("seccomp filter refused")
pid = os.fork()
if pid == 0:
    try:
        os.setsid()  # this process is the job's uid: nothing in the job may signal its group
        os.execv(sys.argv[5], sys.argv[5:])
    finally:
        os._exit(127)
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, lambda *a: os.kill(pid, signal.SIGKILL))
status = os.waitpid(pid, 0)[1]
sys.exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
"""


def userns_argv(
    ns_fds: Mapping[str, int],
    root_fd: int,
    inner: Sequence[str],
    *,
    control_fd: int | None = None,
) -> list[str]:
    """`sandboxed_argv` for a sandbox in an unprivileged user namespace (a non-root worker's):
    USERNS_JOIN with the rank's namespaces ("user" among them) and root, then `inner`."""
    if "user" not in ns_fds or "mnt" not in ns_fds:
        raise Refused("the rank's namespaces could not be opened")
    keep = "-" if control_fd is None else str(control_fd)
    fds = json.dumps(dict(ns_fds))
    return [python(), "-S", "-I", "-c", USERNS_JOIN, fds, str(root_fd), seccomp.program().hex(), keep, *inner]


def host_env() -> dict[str, str]:
    """What nsenter and setpriv themselves get: nothing of the worker's environment."""
    return {"PATH": SYSTEM_PATH}


def python() -> str:
    return sys.executable
