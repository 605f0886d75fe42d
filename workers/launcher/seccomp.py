"""The sandbox's system-call filter: what a rank may not ask the kernel (contract §7 v3).

In the spirit of Docker's default profile, for a process without capabilities: no kernel
keyrings (`add_key`, `keyctl`, `request_key`: a key one job leaves is another's to read under
the same uid), no new namespaces (`unshare`, `setns`, a `clone` with namespace flags; `clone3`
answers ENOSYS so the C library falls back to `clone`, whose flags can be checked), no mounts,
no `bpf`, no `perf_event_open`, no kernel modules, clocks, swap, reboot or `syslog`. Everything
else is allowed: PyTorch, gloo, NCCL and CUDA use none of these (ptrace, as in Docker, stays:
the ranks' PID namespace already holds only the job's own processes, and debuggers need it).

The filter is a classic BPF program assembled here (no libseccomp needed) and installed by the
sandbox's first program (`sandbox.ENTRY`), after `no_new_privs`, before torchrun starts: it holds
for every process of the node and cannot be lifted.
"""

from __future__ import annotations

import errno
import platform
import struct

AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000
CLONE_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
# NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET

DENIED = (
    "acct", "add_key", "bpf", "clock_adjtime", "clock_settime", "delete_module", "finit_module",
    "fsconfig", "fsmount", "fsopen", "fspick", "init_module", "kcmp", "kexec_file_load", "kexec_load",
    "keyctl", "lookup_dcookie", "mount", "mount_setattr", "move_mount", "name_to_handle_at",
    "nfsservctl", "open_by_handle_at", "open_tree", "perf_event_open", "pivot_root", "quotactl",
    "reboot", "request_key", "setns", "settimeofday", "swapoff", "swapon", "syslog", "umount2",
    "unshare", "userfaultfd", "vhangup",
    # x86_64 only
    "create_module", "get_kernel_syms", "ioperm", "iopl", "query_module", "_sysctl", "sysfs",
    "uselib", "ustat",
)  # fmt: skip

SYSCALLS = {
    "x86_64": {
        "clone": 56, "clone3": 435, "acct": 163, "add_key": 248, "bpf": 321, "clock_adjtime": 305,
        "clock_settime": 227, "delete_module": 176, "finit_module": 313, "fsconfig": 431,
        "fsmount": 432, "fsopen": 430, "fspick": 433, "init_module": 175, "kcmp": 312,
        "kexec_file_load": 320, "kexec_load": 246, "keyctl": 250, "lookup_dcookie": 212, "mount": 165,
        "mount_setattr": 442, "move_mount": 429, "name_to_handle_at": 303, "nfsservctl": 180,
        "open_by_handle_at": 304, "open_tree": 428, "perf_event_open": 298, "pivot_root": 155,
        "quotactl": 179, "reboot": 169, "request_key": 249, "setns": 308, "settimeofday": 164,
        "swapoff": 168, "swapon": 167, "syslog": 103, "umount2": 166, "unshare": 272,
        "userfaultfd": 323, "vhangup": 153, "create_module": 174, "get_kernel_syms": 177,
        "ioperm": 173, "iopl": 172, "query_module": 178, "_sysctl": 156, "sysfs": 139, "uselib": 134,
        "ustat": 136,
    },
    "aarch64": {
        "clone": 220, "clone3": 435, "acct": 89, "add_key": 217, "bpf": 280, "clock_adjtime": 266,
        "clock_settime": 112, "delete_module": 106, "finit_module": 273, "fsconfig": 431,
        "fsmount": 432, "fsopen": 430, "fspick": 433, "init_module": 105, "kcmp": 272,
        "kexec_file_load": 294, "kexec_load": 104, "keyctl": 219, "lookup_dcookie": 18, "mount": 40,
        "mount_setattr": 442, "move_mount": 429, "name_to_handle_at": 264, "nfsservctl": 42,
        "open_by_handle_at": 265, "open_tree": 428, "perf_event_open": 241, "pivot_root": 41,
        "quotactl": 60, "reboot": 142, "request_key": 218, "setns": 268, "settimeofday": 170,
        "swapoff": 225, "swapon": 224, "syslog": 116, "umount2": 39, "unshare": 97,
        "userfaultfd": 282, "vhangup": 58,
    },
}  # fmt: skip

_LD_ABS_W, _JEQ, _JSET, _RET = 0x20, 0x15, 0x45, 0x06
_ALLOW = 0x7FFF0000
_OFF_NR, _OFF_ARCH, _OFF_ARG0 = 0, 4, 16  # struct seccomp_data (arg0's low half, little-endian)


def _errno(code: int) -> int:
    return 0x00050000 | code  # SECCOMP_RET_ERRNO


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def program(machine: str | None = None) -> bytes:
    """The filter for this machine's architecture; b"" where we have no syscall table for it
    (the sandbox then runs without one, as `detect` says)."""
    machine = machine or platform.machine()
    table = SYSCALLS.get(machine)
    if table is None:
        return b""
    deny_eperm = _insn(_RET, _errno(errno.EPERM))
    out = [
        _insn(_LD_ABS_W, _OFF_ARCH),
        _insn(_JEQ, AUDIT_ARCH[machine], jt=1),  # another ABI (i386 on x86_64): refused outright
        deny_eperm,
        _insn(_LD_ABS_W, _OFF_NR),
    ]
    if machine == "x86_64":  # x32 numbers are the same calls by another number
        out += [_insn(_JSET, X32_SYSCALL_BIT, jf=1), deny_eperm]
    for name in sorted({n for n in DENIED if n in table}):
        out += [_insn(_JEQ, table[name], jf=1), deny_eperm]
    out += [_insn(_JEQ, table["clone3"], jf=1), _insn(_RET, _errno(errno.ENOSYS))]
    out += [
        _insn(_JEQ, table["clone"], jf=3),
        _insn(_LD_ABS_W, _OFF_ARG0),
        _insn(_JSET, CLONE_NAMESPACES, jf=1),
        deny_eperm,
        _insn(_RET, _ALLOW),
    ]
    return b"".join(out)
