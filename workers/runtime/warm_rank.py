"""What the rank server (warm_rank_server.py) imports before any job, what it declines, and
how its forked child becomes the rank that `python ARGV` would have started.

A warm rank must be indistinguishable from a cold one to the job and to the worker, so the
child takes, before the job's first line runs: the rank's descriptors 0-2, a session of its own
(torchrun starts each rank in one, and kills it by its group), its folder, its environment (in
`os.environ`, in the C library's, and where /proc shows it), its command line where /proc
shows it (`python -u -m MODULE ARGS`, as far as the server's own leaves room: `ps` inside the
job reads it), `sys.path` and `sys.argv` as
Python computes them for `-m` or a script, unbuffered output (`-u`, as torchrun passes it), the
thread count the environment asks for, and fresh random state (a cold process seeds `random`,
numpy and, in this torch, its default generator from the OS; a torch that starts from its fixed
seed gets that state back).

It declines, and the rank starts cold, where that cannot hold: an interpreter flag other than
`-u`, a Python or library variable read only at start that the job sets differently, a module
of the job's (its environment's packages, its code, its folder) named like one already
imported, or an environment larger than the room the server's own left in /proc.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import locale
import os
import random
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, NoReturn

ENTRY_MODULES = ("workers.runtime.trainer.train", "workers.runtime.script")
# Read once, at the interpreter's or a library's start: a job that sets them differently from
# the server starts cold. PYTHONPATH, -u and OMP_NUM_THREADS are applied in the child instead.
APPLIED = frozenset({"PYTHONPATH", "PYTHONUNBUFFERED", "OMP_NUM_THREADS"})
START_ONLY_PREFIXES: tuple[str, ...] = ("PYTHON", "TORCHDYNAMO", "TORCHINDUCTOR", "TORCH_LOGS", "OMP_")
START_ONLY_PREFIXES += ("TORCH_COMPILE", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "LD_", "MALLOC_")
PR_SET_PDEATHSIG = 1
TORCH_FIXED_SEED = 67280421310721  # torch's default seed where it does not draw one at start
_server_env: dict[str, str] = {}
_base_path: list[str] = []
_torch_start_state: list[Any] = []  # the generator's state at start, where that is fixed


def preload() -> None:
    """Everything a rank of the builtin trainer or a script imports before its first step, and
    that first step's own lazy imports (torch._dynamo, via the optimizers), once."""
    _server_env.update(os.environ)
    own = set(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    _base_path[:] = [p for p in sys.path[1:] if p not in own]
    import numpy  # noqa: F401
    import torch
    import torch.distributed
    import torch.nn.parallel

    import workers.runtime.script
    import workers.runtime.trainer.train  # noqa: F401

    if torch.initial_seed() == TORCH_FIXED_SEED:
        _torch_start_state.append(torch.get_rng_state())
    for make in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        weight = torch.nn.Parameter(torch.ones(4))
        optimizer = make([weight], lr=0.1)
        (weight * 2).sum().backward()
        optimizer.step()
    gc.collect()
    gc.freeze()  # the children's pages stay shared until they write them


def room() -> int:
    """Bytes of environment this process (and so each child) can show in /proc."""
    start, end = _env_region()
    return end - start


def declines(request: dict[str, Any]) -> str | None:
    """Why this request must start cold, or None."""
    argv, env, cwd, shown = (request.get(k) for k in ("argv", "env", "cwd", "shown"))
    if not (isinstance(argv, list) and isinstance(env, dict) and isinstance(cwd, str)):
        return "a malformed request"
    if not isinstance(shown, str):
        return "a malformed request"
    entry = _entry(argv)
    if entry is None:
        return "an entry point other than the runtime's"
    for name in set(env) | set(_server_env):
        start_only = name.startswith(START_ONLY_PREFIXES) and name not in APPLIED
        if start_only and env.get(name) != _server_env.get(name):
            return f"{name} differs from the warm process's"
    if not _utf8_locale(env):
        return "a locale other than UTF-8 (Python fixes its encodings at start)"
    if len(_raw(shown)) > room():
        return "an environment larger than the room in /proc"
    shadowed = _shadowed(_job_folders(argv, env, cwd))
    if shadowed:
        return f"the job's own {shadowed} would be shadowed"
    return None


def _utf8_locale(env: dict[str, str]) -> bool:
    """The character type the rank's locale names is UTF-8 (or the C locale, which Python
    coerces to C.UTF-8), as the server's own is."""
    name = env.get("LC_ALL") or env.get("LC_CTYPE") or env.get("LANG") or "C"
    return name in ("C", "POSIX") or name.lower().replace("-", "").endswith(("utf8", ".utf8"))


def _entry(argv: list[Any]) -> list[str] | None:
    """argv without `-u`, when it runs one of the runtime's entry modules."""
    if not all(isinstance(a, str) for a in argv):
        return None
    rest = argv[1:] if argv[:1] == ["-u"] else argv
    if len(rest) >= 2 and rest[0] == "-m" and rest[1] in ENTRY_MODULES:
        return rest
    return None


def _job_folders(argv: list[str], env: dict[str, str], cwd: str) -> list[str]:
    """Where a cold rank of this request would look for modules before site-packages."""
    folders = [cwd, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    folders.append(env.get("TORCHJOBS_WORKDIR", ""))
    entry = _entry(argv) or []
    if entry[1:2] == ["workers.runtime.script"] and len(entry) > 2:
        folders.append(os.path.dirname(os.path.join(cwd, entry[2])))
    return [f for f in folders if f and f not in _base_path]


def _shadowed(folders: list[str]) -> str | None:
    """A module in `folders` named like one this process has imported (`workers` aside: the
    runtime merges a job's `workers` package into its own, warm or cold)."""
    imported = {name.partition(".")[0] for name in sys.modules} - {"workers", "__main__"}
    for folder in folders:
        try:
            entries = os.listdir(folder)
        except OSError:
            continue
        for entry in entries:
            name = entry.partition(".")[0]
            if name in imported and _is_module(Path(folder, entry)):
                return str(Path(folder, entry))
    return None


def _is_module(path: Path) -> bool:
    if path.is_dir():
        return (path / "__init__.py").exists()
    return path.suffix in (".py", ".pyc", ".so", ".pth")


def run(request: dict[str, Any], fds: list[int], server: int) -> NoReturn:
    """In the child forked by the server (pid `server`): become the rank, run it, and exit as
    Python would."""
    code = 1
    try:
        _take_descriptors(fds, server)
        for sig in range(1, signal.NSIG):
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                if signal.getsignal(sig) not in (signal.SIG_DFL, None):
                    signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python sets it at start
        os.chdir(request["cwd"])
        _take_environment(request["env"], _raw(request["shown"]))
        show_command([sys.executable, *request["argv"]])
        code = _run_entry(request["argv"], request["cwd"])
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _take_descriptors(fds: list[int], server: int) -> None:
    """The client's stdin, stdout and stderr as this rank's; its life pipe is the server's to
    watch (RankServer), not a thread of the rank's: a cold rank has no such thread, and a rank
    with a second thread cannot fork its loaders' forkserver (loader_workers.py), which then
    imports torch afresh (2-3 s before the first step)."""
    os.setsid()
    _die_with_server(server)
    for target, fd in zip((0, 1, 2), fds[:3], strict=True):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)


def _die_with_server(server: int) -> None:
    """SIGKILL when the server goes: it is what watches the client's life pipe for this rank."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != server:  # the server died before this could take
        os.kill(os.getpid(), signal.SIGKILL)


def _take_environment(env: dict[str, str], shown: bytes) -> None:
    """The rank's environment everywhere: os.environ (and the C library's, through
    putenv/unsetenv: clear first, while the old strings are still whole), the locale's
    character type from it (as Python sets it at start), then /proc: `shown`, what exec gave
    the client, before Python's own additions (LC_CTYPE, when it coerces the C locale)."""
    os.environ.clear()
    os.environ.update(env)
    with contextlib.suppress(locale.Error):
        locale.setlocale(locale.LC_CTYPE, "")
    _overwrite(_env_region(), shown)
    import torch

    if "OMP_NUM_THREADS" in env:
        with contextlib.suppress(ValueError):
            torch.set_num_threads(max(1, int(env["OMP_NUM_THREADS"])))
    random.seed()
    sys.modules["numpy"].random.seed()
    if _torch_start_state:
        torch.set_rng_state(_torch_start_state[0])
    else:
        torch.seed()


def _run_entry(argv: list[str], cwd: str) -> int:
    import runpy

    entry = _entry(argv)
    assert entry is not None
    if argv[:1] == ["-u"] or os.environ.get("PYTHONUNBUFFERED"):
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, io.TextIOWrapper):
                stream.reconfigure(write_through=True)
    pythonpath = list(filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    sys.path[:] = [cwd, *pythonpath, *_base_path]
    sys.argv = ["-m", *entry[2:]]
    sys.modules.pop(entry[1], None)  # run afresh as __main__, as `-m` would (its imports stay)
    try:
        runpy.run_module(entry[1], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads, as at exit
    atexit._run_exitfuncs()
    return code


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    with contextlib.suppress(BaseException):
        print(exc.code, file=sys.stderr)
    return 1


def show_command(argv: list[str]) -> None:
    """The rank's command line in /proc, cut to the room there (nothing reads it but people)."""
    start, end = _regions()[0]
    shown = b"\0".join(a.encode() for a in argv)[: end - start - 1]
    _overwrite((start, end), shown)


def _overwrite(region: tuple[int, int], data: bytes) -> None:
    """This process's own memory, through /proc (what setproctitle does for the command line)."""
    start, end = region
    with open("/proc/self/mem", "r+b", buffering=0) as mem:
        mem.seek(start)
        mem.write(data.ljust(end - start, b"\0"))


def _env_region() -> tuple[int, int]:
    return _regions()[1]


def _regions() -> tuple[tuple[int, int], tuple[int, int]]:
    """(arg_start, arg_end), (env_start, env_end): proc(5)'s fields 48 to 51 of stat."""
    with open("/proc/self/stat", "rb") as fh:
        fields = fh.read().rsplit(b")", 1)[1].split()
    return (int(fields[45]), int(fields[46])), (int(fields[47]), int(fields[48]))


def _raw(shown: str) -> bytes:
    return shown.encode("utf-8", "surrogateescape")
