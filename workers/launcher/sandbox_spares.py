"""Warm torchrun agents inside a sandbox: made before the job, moved under it when it comes.

A warm agent (warm_agent.py) saves a launch the agent's interpreter start and torch import,
about a second. A sandbox is bound to one run folder, which does not exist before its job, so
a spare sandbox gets folders of its own: `run` (bound at /job), `tmp` (bound at /tmp) and
`resume` (bound read-only at /resume). When a launch comes, those folders are *renamed* to the
node's run folder and TMPDIR: a bind mount follows the folder, not its name, so inside the
spare's sandbox /job is now the node's folder, and everything the supervisor does on the
host's side (logs, events, checkpoints, clean-up) works on the usual paths. The resume file
is hard-linked into `resume` (copied when that cannot be), read-only inside as for a cold
launch, and `resume` is moved beside the run folder, to go with it.

Only on CPU workers: a spare would have to hold every GPU's device file, where a cold launch
binds only its own job's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

from service.parent_death import dying_with_parent
from workers.launcher import lifeline
from workers.launcher.command import SYSTEM_PATH, LaunchPlan, resume_dir_of
from workers.launcher.jobfiles import remove_tree
from workers.launcher.sandbox import ENV_FILE, Isolation, Mounts, wrap, write_hosts, write_identity
from workers.launcher.uids import UidPool

WARM_RANKS_FLAG = "--warm-ranks"  # warm_agent.py's (which imports torch: not imported here)
# With warm ranks, a spare starts with room in its environment and its command line, where
# the rank server's forks write theirs for /proc to show (workers/runtime/warm_rank.py). A
# rank's environment is 2-4 KB but for the job's own `env`; a larger one starts cold. /proc
# shows the rest of the room as NULs, so it is kept small.
ROOM_VAR, ROOM_BYTES = "TORCHJOBS_ENV_ROOM", 32_768
COMMAND_ROOM = 4096


@dataclass(frozen=True)
class SpareDirs:
    root: Path  # what is left of it after placing goes
    run: Path  # bound at /job
    tmp: Path  # bound at /tmp
    resume: Path  # bound at /resume, read-only
    owner: tuple[int, int] | None = None  # the uid and gid the spare runs as (a root worker's)


class SpareSandboxes:
    def __init__(
        self,
        iso: Isolation,
        read_only: tuple[str, ...],
        spares_root: Path,
        tmp_root: Path,
        python: str,
        private_network: bool = False,
        resolv_conf: Path | None = None,
        uids: UidPool | None = None,
        warm_ranks: bool = False,
    ) -> None:
        self.warm_ranks = warm_ranks  # each spare also forks its node's ranks (warm_agent.py)
        self.uids = uids  # each spare a uid of its own, which the node it serves keeps
        self.iso, self.read_only, self.python = iso, read_only, python
        self.private_network = private_network  # a spare serves only nodes with the same network
        self.resolv_conf = resolv_conf  # a routed worker's: the DNS relay's (dns_relay.py)
        self.spares_root, self.tmp_root = spares_root, tmp_root

    def spawn(self) -> tuple[subprocess.Popen[bytes], SpareDirs]:
        iso = self.iso
        if self.uids is not None:
            uid = self.uids.take()
            iso = dataclasses.replace(iso, uid=uid, gid=uid)
        dirs = self._make_dirs(iso.owner)
        mounts = Mounts(
            run_dir=dirs.run,
            tmp_dir=dirs.tmp,
            resume_dir=dirs.resume,
            read_only=self.read_only,
            private_network=self.private_network,
            identity=dirs.root / "identity" if dirs.owner is not None else None,
            hosts=self._own_hosts(dirs.owner),
            resolv_conf=self.resolv_conf,
        )
        agent = [self.python, "-m", "workers.launcher.warm_agent"]
        if self.warm_ranks:  # and room for its forks' command lines (warm_rank.show_command)
            agent += [WARM_RANKS_FLAG, " " * COMMAND_ROOM]
        argv = wrap(agent, iso, mounts, self.python)
        try:
            proc = subprocess.Popen(
                dying_with_parent(argv),
                env={"PATH": SYSTEM_PATH},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,  # its one line, `up` (warm_agent.py), then nothing
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=lifeline.pass_fds(),
            )
        except OSError:
            self.discard(dirs)
            raise
        return proc, dirs

    def _make_dirs(self, owner: tuple[int, int] | None) -> SpareDirs:
        name = uuid.uuid4().hex[:12]
        root = self.spares_root / name
        if owner is not None:
            write_identity(root / "identity", *owner)
        if self._own_hosts(owner):  # the host's until a multi-node job's node takes it
            spare_hosts(root / "identity")
        tmp = self.tmp_root / f"torchjobs-spare-{name}"
        dirs = SpareDirs(root=root, run=root / "run", tmp=tmp, resume=root / "resume", owner=owner)
        for folder in (dirs.run, dirs.tmp, dirs.resume):
            folder.mkdir(parents=True)
        env_file = dirs.run / ENV_FILE
        env = {"PATH": SYSTEM_PATH, "PYTHONUNBUFFERED": "1"}
        if self.warm_ranks:  # room for its forks' environments in /proc (warm_rank.py)
            env[ROOM_VAR] = "x" * ROOM_BYTES
        env_file.write_text(json.dumps(env))
        if owner is not None:
            for path in (dirs.run, dirs.tmp, env_file):
                os.chown(path, *owner)
        return dirs

    def place(self, dirs: SpareDirs, plan: LaunchPlan) -> None:
        """The spare's folders become the node's (the sandbox inside sees no change)."""
        paths = plan.paths
        paths.run_dir.parent.mkdir(parents=True, exist_ok=True)
        os.rename(dirs.run, paths.run_dir)
        os.rename(dirs.tmp, paths.tmp)
        if plan.resume:
            target = dirs.resume / Path(plan.resume).name
            if Path(plan.resume).is_dir():  # a folder checkpoint (contract §11): the staged copy's
                shutil.copytree(plan.resume, target)
            else:
                try:
                    os.link(plan.resume, target)
                except OSError:
                    shutil.copyfile(plan.resume, target)
        os.rename(dirs.resume, resume_dir_of(paths.run_dir))
        remove_tree(dirs.root)

    def name_nodes(self, dirs: SpareDirs, names: tuple[tuple[str, str], ...]) -> bool:
        """A multi-node job's nodes named in the spare's /etc/hosts (written in place: the
        sandbox binds the file), before its folders are placed; False where it binds none."""
        if not self._own_hosts(dirs.owner):
            return False
        write_hosts(dirs.root / "identity", names)
        return True

    def _own_hosts(self, owner: tuple[int, int] | None) -> bool:
        """Whether a spare binds an /etc/hosts of its own (beside its identity, which a root
        worker's spare has): one in a network of its own, which a mesh node may take."""
        return owner is not None and self.private_network

    def discard(self, dirs: SpareDirs) -> None:
        for folder in (dirs.root, dirs.tmp):  # the spare's uid may have shaped them
            remove_tree(folder)


def spare_hosts(folder: Path) -> None:
    """A spare's /etc/hosts: the host's (what a cold single-node job's sandbox binds), in a
    file of the spare's own that write_hosts can rewrite in place for a mesh node."""
    try:
        text = Path("/etc/hosts").read_text()
    except OSError:
        text = "127.0.0.1 localhost\n"
    (folder / "hosts").write_text(text)
    (folder / "hosts").chmod(0o644)
