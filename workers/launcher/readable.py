"""Can the sandbox user read what its sandbox binds? Checked once, at a root worker's start.

A root worker's ranks run as another uid (sandbox.py: `bwrap-setuid`, setpriv with
`--clear-groups`). A script root, a PYTHONPATH folder or a Python environment that only root
can read does not stop the worker from starting: it fails every job that needs it, late, with
a PermissionError from inside the runtime. Here the worker says so at start instead, naming
the folder and the fix.

Pure stat logic (no fork, no setuid): the owner's, the group's or the others' bits, whichever
class the uid and the primary gid fall in, the way Linux checks them (one class only: an owner
is refused by the owner bits even where the others' bits would allow it). The sandbox user
has no supplementary groups, so none is looked at. ACLs, capabilities, SELinux/AppArmor and
read-only mounts are out of scope: a folder an ACL opens is reported anyway, one an ACL
closes is not. Only the folder and the folders above it are checked, not the files below it
(a worker's start stays cheap).

Which folders above count depends on the view (`bound`): on the host, all of them; in the
sandbox, bwrap makes the folders above a bound path itself, 0755 (sandbox._parents), so only
those under the system folders bound from the host (/usr...) and those inside another bound
folder keep the host's modes: a virtual environment under a root-only /root is fine there.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from service.config import Settings
from workers.environments import envs_root
from workers.launcher.sandbox import SYSTEM_DIRS, Isolation, python_paths

log = logging.getLogger("torchjobs.worker")

READ, TRAVERSE = 4, 1  # the r and x bits of one class

SCRIPT_ROOTS = "TORCHJOBS_SCRIPT_ROOTS folder"
PYTHONPATH = "PYTHONPATH folder"
PYTHON = "Python environment folder"
ENVIRONMENTS = "built environments folder"


@dataclass(frozen=True)
class Unreadable:
    """`path` (a `what`) is out of the uid's reach: `blocker` (the path itself, or a folder
    above it) lacks the `need`ed bits for it."""

    what: str
    path: Path
    uid: int
    blocker: Path
    mode: int
    owner: int
    group: int
    need: str  # "rx", "r" or "x" (for a folder above)

    def __str__(self) -> str:
        modes = f"mode {self.mode:04o}, owner {self.owner}, group {self.group}"
        if self.blocker == self.path:
            return f"{self.what} {self.path}: uid {self.uid} cannot read it ({modes})"
        return (
            f"{self.what} {self.path}: uid {self.uid} cannot reach it: {self.blocker} ({modes}) is above it"
        )

    @property
    def fix(self) -> str:
        return f"chmod o+{self.need} {self.blocker}"


def allowed(st: os.stat_result, uid: int, gid: int) -> int:
    """The rwx bits (0-7) `uid` has on a file, as primary group `gid` and no other group."""
    if st.st_uid == uid:
        return (st.st_mode >> 6) & 7
    if st.st_gid == gid:
        return (st.st_mode >> 3) & 7
    return st.st_mode & 7


def unreadable_for(
    paths: Sequence[Path],
    uid: int,
    gid: int,
    *,
    what: str = "folder",
    bound: Sequence[str | Path] | None = None,
) -> list[str]:
    """One message for each of `paths` that `uid`/`gid` (no supplementary groups) cannot
    read: a folder needs r and x, a file r, each folder above it x. A path that does not
    exist is not reported (bwrap's --ro-bind-try skips it as well). `bound`: the read-only
    paths of the sandbox the paths are seen in (see the module), None for the host's view.
    ACLs are not looked at (see the module)."""
    return [str(found) for found in find_unreadable(paths, uid, gid, what=what, bound=bound)]


def find_unreadable(
    paths: Sequence[Path],
    uid: int,
    gid: int,
    *,
    what: str = "folder",
    bound: Sequence[str | Path] | None = None,
    listed: bool = True,
) -> list[Unreadable]:
    """unreadable_for's findings, with the folder to change and how. `listed=False`: a folder
    the uid only needs to pass through (x), as the built environments' (0711)."""
    found: list[Unreadable] = []
    for path in map(Path, paths):
        try:
            own = os.stat(path)
        except FileNotFoundError:
            continue
        except OSError:  # a folder above that the worker itself cannot reach: not ours to judge
            continue
        for above in _checked_above(path, bound):
            try:
                st = os.stat(above)
            except OSError:
                break
            if not allowed(st, uid, gid) & TRAVERSE:
                found.append(_finding(what, path, uid, above, st, "x"))
                break
        else:
            need = (READ if listed else 0) | TRAVERSE if stat.S_ISDIR(own.st_mode) else READ
            if allowed(own, uid, gid) & need != need:
                found.append(_finding(what, path, uid, path, own, _bits(need)))
    return found


def _bits(need: int) -> str:
    return ("r" if need & READ else "") + ("x" if need & TRAVERSE else "")


def _finding(what: str, path: Path, uid: int, blocker: Path, st: os.stat_result, need: str) -> Unreadable:
    mode = stat.S_IMODE(st.st_mode)
    return Unreadable(what, path, uid, blocker, mode, st.st_uid, st.st_gid, need)


def _checked_above(path: Path, bound: Sequence[str | Path] | None) -> list[Path]:
    """The folders above `path` whose host modes apply, outermost first."""
    above = list(reversed(path.parents))
    if bound is None:
        return above
    holders = [Path(b) for b in bound if Path(b) == path or Path(b) in path.parents]
    if not holders:  # not in the sandbox at all: the host's view
        return above
    top = min(holders, key=lambda b: len(b.parts))  # what bwrap binds (sandbox._distinct)
    return [a for a in above if a == top or top in a.parents or _system(a)]


def _system(folder: Path) -> bool:
    """Under a system folder bound from the host (the same test as sandbox._parents)."""
    name = str(folder)
    return name != "/" and name.startswith(SYSTEM_DIRS)


def warn_unreadable(
    iso: Isolation,
    settings: Settings,
    rank_env: Mapping[str, str],
    bound: Sequence[str],
    python: str,
) -> list[Unreadable]:
    """At a root worker's start: one WARNING for each script root, PYTHONPATH folder, Python
    environment folder or built environments folder its sandbox user cannot read (the jobs
    that need it would fail). The worker starts anyway. Nothing where ranks are not another
    uid (no sandbox, or a user namespace)."""
    owner = iso.owner if iso.sandboxed else None
    if owner is None:
        return []
    uid, gid = owner
    groups: list[tuple[str, Sequence[Path], bool]] = [
        (SCRIPT_ROOTS, settings.script_root_paths, True),
        (PYTHONPATH, [Path(p) for p in rank_env.get("PYTHONPATH", "").split(":") if p], True),
        (PYTHON, [Path(p) for p in python_paths(python)], True),
        (ENVIRONMENTS, [envs_root(settings)], False),  # passed through, never listed (0711)
    ]
    found: list[Unreadable] = []
    for what, paths, listed in groups:
        seen = {item.path for item in found}  # a script root also on PYTHONPATH: said once
        mine = find_unreadable(paths, uid, gid, what=what, bound=bound, listed=listed)
        found += [f for f in mine if f.path not in seen]
    for item in found:
        log.warning("%s: jobs that need it will fail; %s, or set TORCHJOBS_SANDBOX_USER to a user "
                    "who can read it", item, item.fix)  # fmt: skip
    return found
