"""A job's `environment.pip` (contract §6), built once per requirement set and worker Python.

The build layers the job's packages over the worker's own Python, never into it:

1. `uv pip install --dry-run --python <the worker's Python>` resolves the requirements against
   the worker's installed packages, each pinned at its installed version (torch above all). An
   installed package satisfies a requirement as it is, so no index is asked about it: a torch
   from a local wheel, `+cpu` or `+cu126`, is never looked for in an index that does not hold
   it. A requirement that would need another torch, or another version of anything the
   worker holds, fails here with uv's own reason. Nothing is installed by this step.
2. What the plan adds to the worker's packages is installed with `uv pip install --no-deps
   --target` into a folder of its own, which the ranks put first on `PYTHONPATH`.

Only wheels are taken (`--no-build`): building a source distribution would run its code with
the worker's rights. Concurrent nodes with the same set wait on a file lock for one build; a
finished environment is renamed into place whole, reused while it exists, and the least
recently used ones are removed when the cache passes `TORCHJOBS_ENV_CACHE_MAX_BYTES`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from service.config import Settings
from workers.code_cache import locked, prune

READY = "site"  # the installed folder inside an environment; its presence means "built"


class EnvironmentFailed(Exception):
    """The build failed: the job fails with `environment: <reason>`, and is not retried."""


@dataclass(frozen=True)
class BuiltEnvironment:
    site: Path  # first on the ranks' PYTHONPATH
    reused: bool
    seconds: float


SALT_FILE = "envs.salt"  # in the cache folder, beside (not in) the folder the sandboxes see
LOCKS = "env-locks"  # the build locks, named by key: beside it too (a job could stat them)
UNSALTED = "envs"  # the folder of the names before they were salted: removed at worker start


def envs_root(settings: Settings) -> Path:
    return settings.cache_dir / "environments"


def prepare_envs_root(root: Path) -> Path:
    """The built environments' folder, traversable and not listable by the ranks (0711): every
    sandbox binds it read-only, a job reaches its own environment by the name the worker puts
    on its PYTHONPATH, and it can neither list which environments this host holds (other
    users' requirements) nor guess their names (`environment_key` is salted per host).
    A non-root worker's ranks are its own uid, the folder's owner: there they can list it."""
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o711)
    return root


def remove_unsalted(cache_dir: Path) -> None:
    """The environments built before their names were salted: a job can compute those names
    (it runs the worker's Python), so the folder goes whole, at worker start."""
    old = cache_dir / UNSALTED
    if old.is_dir():
        shutil.rmtree(old, ignore_errors=True)


def host_salt(cache_dir: Path) -> str:
    """This host's secret for environment names, made once and kept (0600, the worker's): the
    same requirements keep their built environment across worker restarts and between the
    workers sharing the cache. Made beside and linked into place, so two workers starting
    together agree on one; an empty file (a full disk) is replaced, never taken as a salt."""
    path = cache_dir / SALT_FILE
    for _ in range(3):
        if salt := _read_salt(path):
            return salt
        made = _new_salt(cache_dir)
        try:
            try:
                os.link(made, path)
            except FileExistsError:  # another worker's, or an empty one
                if not _read_salt(path):
                    os.replace(made, path)
        finally:
            made.unlink(missing_ok=True)
    raise EnvironmentFailed(f"{path}: no secret for environment names could be kept there")


def _read_salt(path: Path) -> str:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return ""


def _new_salt(cache_dir: Path) -> Path:
    cache_dir.mkdir(parents=True, exist_ok=True)
    made = cache_dir / f".{SALT_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(made, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_hex(32) + "\n")
    return made


@cache
def worker_packages() -> dict[str, str]:
    """The worker Python's installed distributions: {canonical name: version}."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(canonicalize_name(name), dist.version)
    return found


def environment_key(requirements: list[str], installer_args: str, salt: str) -> str:
    fingerprint = {
        "salt": salt,
        "requirements": sorted(str(Requirement(r)) for r in requirements),
        "python": sys.version,
        "platform": platform.platform(),
        "worker": sorted(worker_packages().items()),
        "installer_args": installer_args,
    }
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()


def ensure_environment(settings: Settings, requirements: list[str], log: Path) -> BuiltEnvironment:
    """The environment for these requirements, built now or found; its story goes to `log`."""
    started = time.monotonic()
    root = prepare_envs_root(envs_root(settings))
    key = environment_key(requirements, settings.env_installer_args, host_salt(settings.cache_dir))
    dest = root / key
    reused = (dest / READY).is_dir()
    if not reused:
        locks = settings.cache_dir / LOCKS
        locks.mkdir(parents=True, exist_ok=True)
        with locked(locks / f"{key}.lock"):
            reused = (dest / READY).is_dir()  # another node built it while this one waited
            if not reused:
                _build(settings, requirements, dest, log)
    with contextlib.suppress(FileNotFoundError):
        os.utime(dest)
    prune(root, settings.env_cache_max_bytes, keep=dest)
    seconds = time.monotonic() - started
    if reused:
        _say(log, f"environment: reusing {key[:12]} ({len(requirements)} requirements)\n")
    return BuiltEnvironment(site=dest / READY, reused=reused, seconds=seconds)


def _build(settings: Settings, requirements: list[str], dest: Path, log: Path) -> None:
    staging = dest.with_name(f".{dest.name}.building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        (staging / "requirements.in").write_text("\n".join(requirements) + "\n")
        pins = sorted(f"{n}=={v}" for n, v in worker_packages().items() if n != "torchjobs")
        (staging / "worker.txt").write_text("\n".join(pins) + "\n")
        _say(log, f"environment: building for {', '.join(requirements)}\n")
        plan = _uv(
            settings, log, "install", "--dry-run", *_plan_args(), "-r", "requirements.in", "-c", "worker.txt",
            cwd=staging,
        )  # fmt: skip
        extra = planned_additions(plan)
        (staging / "install.txt").write_text("\n".join(extra) + "\n")
        if extra:
            _uv(settings, log, "install", "--no-deps", "--target", READY, "-r", "install.txt", cwd=staging)
        else:
            (staging / READY).mkdir()
        for name in ("requirements.in", "worker.txt", "install.txt"):
            (staging / name).unlink()  # a job that knows the name can read it: keep no requirements there
        staging.rename(dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _plan_args() -> list[str]:
    """A system Python (no virtual environment) may be marked externally managed; the plan is
    a dry run, so it breaks nothing there."""
    return ["--break-system-packages"] if sys.prefix == sys.base_prefix else []


def _uv(settings: Settings, log: Path, command: str, *args: str, cwd: Path) -> str:
    """Run uv, its output appended to `log`; returns what it wrote this time."""
    argv = [
        *uv_command(),
        "pip",
        command,
        "--python",
        sys.executable,
        "--no-build",
        *args,
        *shlex.split(settings.env_installer_args),
    ]
    # The worker's own environment: the host's certificates, proxies and registry settings are
    # the installer's too (uv is ours, and --no-build runs no package's code).
    env = {
        **os.environ,
        "UV_CACHE_DIR": str(settings.cache_dir / "uv"),
        "UV_NO_PROGRESS": "1",
        "NO_COLOR": "1",
    }
    start = log.stat().st_size if log.exists() else 0
    with log.open("ab") as out:
        try:
            done = subprocess.run(
                argv,
                cwd=cwd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=settings.env_build_timeout_s,
            )
        except subprocess.TimeoutExpired:
            raise EnvironmentFailed(
                f"the installer took longer than {settings.env_build_timeout_s:g} s"
            ) from None
    if done.returncode != 0:
        raise EnvironmentFailed(_reason(log, start))
    return _written(log, start)


def uv_command() -> list[str]:
    beside = Path(sys.executable).parent / "uv"
    if beside.exists():
        return [str(beside)]
    found = shutil.which("uv")
    return [found] if found else [sys.executable, "-m", "uv"]


def planned_additions(plan: str) -> list[str]:
    """The `name==version` lines uv's dry run would add (` + name==version`). A line taking a
    package away (` - name==version`) means the plan would replace one of the worker's own,
    which the constraints forbid: refused rather than layered over."""
    extra = []
    for line in plan.splitlines():
        text = line.strip()
        if text.startswith("- "):
            raise EnvironmentFailed(f"the installer would replace the worker's {text[2:]}")
        if not text.startswith("+ "):
            continue
        try:
            req = Requirement(text[2:].strip())
        except InvalidRequirement as exc:
            raise EnvironmentFailed(f"the installer planned {text!r}, which cannot be read: {exc}") from exc
        if not any(spec.operator == "==" for spec in req.specifier):
            raise EnvironmentFailed(f"the installer planned {text!r}, which names no version")
        extra.append(str(req))
    return extra


def _written(log: Path, start: int) -> str:
    with log.open("rb") as fh:
        fh.seek(start)
        return fh.read().decode(errors="replace")


def _reason(log: Path, start: int) -> str:
    """uv's own words: the last lines it wrote this time, without blank ones."""
    lines = [ln.strip() for ln in _written(log, start).splitlines() if ln.strip()]
    return " ".join(lines[-6:])[-2000:] or "the installer failed"


def _say(log: Path, text: str) -> None:
    with log.open("a") as fh:
        fh.write(text)
