"""A root worker's check, at start, that its sandbox user can read the script roots and the
Python environment (workers/launcher/readable.py).

The folders are made under a fresh 0755 folder in /tmp (pytest's own tmp_path sits under a
0700 folder no other uid can reach). Owners are changed where the tests run as root; where
they do not, the folders are the test user's and uid 65534 falls in the others' class.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.config import Settings
from workers.environments import envs_root, prepare_envs_root
from workers.launcher import lifeline, sandbox
from workers.launcher.readable import SCRIPT_ROOTS, _checked_above, unreadable_for, warn_unreadable
from workers.launcher.sandbox import ENV_FILE, Isolation, Mounts

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="changes owners")


@pytest.fixture
def base() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="readable-", dir="/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def _folder(path: Path, mode: int, owner: tuple[int, int] | None = None) -> Path:
    path.mkdir()
    path.chmod(mode)
    if owner is not None:
        os.chown(path, *owner)
    return path


def test_a_closed_folder_is_reported_an_open_one_is_not(base: Path) -> None:
    closed = _folder(base / "closed", 0o700)
    group_only = _folder(base / "group-only", 0o750)
    open_ = _folder(base / "open", 0o755)
    missing = base / "missing"
    found = unreadable_for([closed, group_only, open_, missing], NOBODY, NOBODY, what=SCRIPT_ROOTS)
    me = os.geteuid()
    assert found == [
        f"TORCHJOBS_SCRIPT_ROOTS folder {closed}: uid {NOBODY} cannot read it "
        f"(mode 0700, owner {me}, group {os.getegid()})",
        f"TORCHJOBS_SCRIPT_ROOTS folder {group_only}: uid {NOBODY} cannot read it "
        f"(mode 0750, owner {me}, group {os.getegid()})",
    ]


def test_a_closed_folder_above_is_reported_with_the_folder_to_open(base: Path) -> None:
    above = _folder(base / "private", 0o700)
    scripts = _folder(above / "scripts", 0o755)
    (found,) = unreadable_for([scripts], NOBODY, NOBODY, what=SCRIPT_ROOTS)
    assert found.startswith(f"TORCHJOBS_SCRIPT_ROOTS folder {scripts}: uid {NOBODY} cannot reach it: {above}")
    # read but not traverse (r-- for others) is as closed as none
    above.chmod(0o744)
    assert len(unreadable_for([scripts], NOBODY, NOBODY)) == 1
    above.chmod(0o711)  # traverse without read is enough above
    assert unreadable_for([scripts], NOBODY, NOBODY) == []


def test_a_file_needs_read_only(base: Path) -> None:
    module = base / "factories.zip"
    module.write_bytes(b"")
    module.chmod(0o644)
    assert unreadable_for([module], NOBODY, NOBODY) == []
    module.chmod(0o600)
    assert len(unreadable_for([module], NOBODY, NOBODY)) == 1


@as_root
def test_root_owned_folders_and_the_owner_and_group_classes(base: Path) -> None:
    root_only = _folder(base / "root-only", 0o700, (0, 0))
    (found,) = unreadable_for([root_only], NOBODY, NOBODY, what=SCRIPT_ROOTS)
    assert found.endswith(f"{root_only}: uid {NOBODY} cannot read it (mode 0700, owner 0, group 0)")
    # the sandbox user's primary group opens a 0750 folder; no supplementary group does
    shared = _folder(base / "shared", 0o750, (0, NOBODY))
    assert unreadable_for([shared], NOBODY, NOBODY) == []
    assert len(unreadable_for([shared], NOBODY, 1234)) == 1
    # Linux looks at the owner's bits only for the owner, even where others' would allow it
    odd = _folder(base / "odd", 0o075, (NOBODY, NOBODY))
    assert len(unreadable_for([odd], NOBODY, NOBODY)) == 1
    assert unreadable_for([odd], 1234, 1234) == []


def test_in_the_sandbox_only_folders_above_that_keep_the_hosts_modes_count(base: Path) -> None:
    above = _folder(base / "private", 0o700)
    scripts = _folder(above / "scripts", 0o755)
    # bwrap makes the folders above a bound path itself, 0755: a closed one on the host is no bar
    assert unreadable_for([scripts], NOBODY, NOBODY, bound=[str(scripts)]) == []
    # inside another bound folder the host's folders are what the ranks see
    env = _folder(base / "env", 0o755)
    closed = _folder(env / "closed", 0o700)
    inner = _folder(closed / "scripts", 0o755)
    (found,) = unreadable_for([inner], NOBODY, NOBODY, bound=[str(env), str(inner)])
    assert f"cannot reach it: {closed} " in found
    # and so are the system folders bound from the host
    assert _checked_above(Path("/usr/lib/python3/dist-packages"), ["/usr/lib/python3/dist-packages"]) == [
        Path("/usr"),
        Path("/usr/lib"),
        Path("/usr/lib/python3"),
    ]
    assert _checked_above(Path("/srv/a/b"), ["/srv/a/b"]) == []
    assert _checked_above(Path("/srv/a/b"), None) == [Path("/"), Path("/srv"), Path("/srv/a")]


@as_root
def test_the_sandbox_agrees_with_the_check(base: Path) -> None:
    """The view the check assumes is bwrap's: run uid 65534 in a real sandbox and list."""
    bwrap = sandbox.find_bwrap()
    assert bwrap, "bubblewrap is a dependency of torchjobs"
    iso = Isolation(kind="sandbox", method="bwrap-setuid", bwrap=bwrap, uid=NOBODY, gid=NOBODY)
    private = _folder(base / "private", 0o700, (0, 0))
    reachable = _folder(private / "scripts", 0o755, (0, 0))
    closed = _folder(base / "closed", 0o700, (0, 0))
    run = _folder(base / "run", 0o700, (NOBODY, NOBODY))
    (run / ENV_FILE).write_text(json.dumps({"PATH": "/usr/bin:/bin"}))
    read_only = (*sandbox.python_paths(sys.executable), str(reachable), str(closed))
    mounts = Mounts(run_dir=run, tmp_dir=run, read_only=read_only)
    probe = "import json, os, sys\nout = {}\nfor p in sys.argv[1:]:\n"
    probe += "    try: os.listdir(p); out[p] = True\n    except OSError: out[p] = False\n"
    probe += "print(json.dumps(out))"
    argv = [sys.executable, "-c", probe, str(reachable), str(closed)]
    argv = sandbox.wrap(argv, iso, mounts, sys.executable)
    fds = lifeline.pass_fds()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={}, pass_fds=fds)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {str(reachable): True, str(closed): False}
    found = unreadable_for([reachable, closed], NOBODY, NOBODY, bound=read_only)
    assert [f.split(":")[0] for f in found] == [f"folder {closed}"]


def test_the_worker_warns_at_start_naming_the_folder_and_the_fix(
    base: Path, caplog: pytest.LogCaptureFixture
) -> None:
    closed = _folder(base / "closed", 0o700)
    open_ = _folder(base / "open", 0o755)
    settings = Settings(home=base / "home", script_roots=f"{closed}:{open_}")
    iso = Isolation(kind="sandbox", method="bwrap-setuid", bwrap="bwrap", uid=NOBODY, gid=NOBODY)
    bound = (*sandbox.python_paths(sys.executable), str(closed), str(open_))
    rank_env = {"PYTHONPATH": str(closed)}  # also a script root: said once
    with caplog.at_level(logging.WARNING, logger="torchjobs.worker"):
        found = warn_unreadable(iso, settings, rank_env, bound, sys.executable)
    mine = [r for r in caplog.records if str(base) in r.getMessage()]
    assert [f.path for f in found if str(base) in str(f.path)] == [closed]
    assert len(mine) == 1 and mine[0].levelno == logging.WARNING
    message = mine[0].getMessage()
    assert f"TORCHJOBS_SCRIPT_ROOTS folder {closed}: uid {NOBODY} cannot read it (mode 0700" in message
    assert f"chmod o+rx {closed}" in message and "TORCHJOBS_SANDBOX_USER" in message

    # ranks that are the worker's own uid (a user namespace), or no sandbox: nothing to say
    caplog.clear()
    userns = Isolation(kind="sandbox", method="bwrap-userns", bwrap="bwrap")
    assert warn_unreadable(userns, settings, rank_env, bound, sys.executable) == []
    assert warn_unreadable(sandbox.UNISOLATED, settings, rank_env, bound, sys.executable) == []
    assert caplog.records == []


def test_the_environments_folder_needs_only_to_be_passed_through(base: Path) -> None:
    """The built environments' folder is 0711 on purpose (a job may not list it): that is no
    finding. Closed to others altogether (0700), the jobs with an environment fail: one is."""
    settings = Settings(home=base / "home")
    envs = prepare_envs_root(envs_root(settings))
    for folder in (base / "home", settings.cache_dir):
        folder.chmod(0o755)
    iso = Isolation(kind="sandbox", method="bwrap-setuid", bwrap="bwrap", uid=NOBODY, gid=NOBODY)
    bound = (*sandbox.python_paths(sys.executable), str(envs))
    assert [f for f in warn_unreadable(iso, settings, {}, bound, sys.executable) if f.path == envs] == []
    envs.chmod(0o700)
    (found,) = [f for f in warn_unreadable(iso, settings, {}, bound, sys.executable) if f.path == envs]
    assert found.fix == f"chmod o+x {envs}"
