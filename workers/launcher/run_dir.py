"""The node's run folder on disk: laid out before torchrun starts, the job's code copied into
it, and removed with everything the worker put beside it once the node is over.

Where each file is (`NodePaths` and the `*_of` helpers) is a pure computation in command.py;
this module is what acts on it, and what reads this machine: `tmp_root`, where the ranks'
short TMPDIRs go.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from workers.launcher.command import (
    LaunchPlan,
    NodePaths,
    environment_log_of,
    identity_dir_of,
    resume_dir_of,
)
from workers.launcher.jobfiles import remove_tree


def tmp_root() -> Path:
    """Where nodes' short TMPDIRs live: the same for a launch and for its clean-up."""
    return Path(tempfile.gettempdir())


def config_json(plan: LaunchPlan) -> str:
    return json.dumps(plan.config, indent=2, sort_keys=True)


def lay_out_run_dir(plan: LaunchPlan) -> tuple[Path, ...]:
    """The node's folders and the trainer's config: what `torchrun` needs in place before it
    starts. Returns the folders the ranks write to (a sandboxed node
    hands them to its user)."""
    paths = plan.paths
    folders = (paths.run_dir, paths.checkpoints, paths.logs, paths.tmp, paths.home)
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
    if plan.config is not None:
        paths.config.write_text(config_json(plan))
    return folders


def copy_code(source: Path, dest: Path, owner: tuple[int, int] | None) -> None:
    """The node's private copy of the job's code (contract §6): each node writes in its own copy,
    and in a sandbox the copy belongs to the sandbox's user, so no other job can touch it.
    Links are kept as links: they were checked to stay inside it."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(source, dest, symlinks=True)
    if owner is None:
        return
    os.chown(dest, *owner)
    for folder, dirs, files in os.walk(dest):
        for name in (*dirs, *files):
            os.chown(os.path.join(folder, name), *owner, follow_symlinks=False)


def remove_run_dir(paths: NodePaths) -> None:
    """A node's folder, its short TMPDIR and a warm sandbox's /resume folder beside it: each a
    path the worker chose and keeps, never one read from the job's folder (contract §7 v3).
    `remove_tree` follows no link inside them and walks any depth."""
    run_dir = paths.run_dir
    for folder in (paths.tmp, run_dir, resume_dir_of(run_dir), identity_dir_of(run_dir)):
        remove_tree(folder)
    environment_log_of(run_dir).unlink(missing_ok=True)
