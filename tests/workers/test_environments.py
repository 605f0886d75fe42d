"""environment.pip builds (workers/environments.py) with the real uv and the real registry."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from service.config import Settings
from workers.environments import (
    EnvironmentFailed,
    ensure_environment,
    environment_key,
    host_salt,
    planned_additions,
    remove_unsalted,
    worker_packages,
)

FIND_LINKS = Path("/opt/wheels")  # where this machine's CPU torch comes from (see README)


def settings(home: Path) -> Settings:
    args = f"--find-links {FIND_LINKS}" if FIND_LINKS.is_dir() else ""
    return Settings(home=home, env_installer_args=args)


def test_concurrent_nodes_wait_for_one_build_then_reuse_it(tmp_path: Path) -> None:
    s = settings(tmp_path)
    logs = [tmp_path / f"node{i}.log" for i in range(3)]
    results: list[object] = [None] * 3

    def node(i: int) -> None:
        results[i] = ensure_environment(s, ["tabulate==0.10.0"], logs[i])

    threads = [threading.Thread(target=node, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    built = [r for r in results if r is not None and not r.reused]  # type: ignore[attr-defined]
    assert len(built) == 1  # one build; the other two waited for it and found it
    sites = {r.site for r in results}  # type: ignore[attr-defined]
    assert len(sites) == 1 and (next(iter(sites)) / "tabulate-0.10.0.dist-info").is_dir()
    text = "".join(log.read_text() for log in logs)
    assert text.count("environment: building") == 1 and text.count("environment: reusing") == 2
    assert not list((s.cache_dir / "environments").glob(".*building*"))


def test_a_requirement_on_the_workers_own_torch_needs_no_admin_setting(tmp_path: Path) -> None:
    """accelerate depends on torch; this worker's torch came from a local wheel (`+cpu`) that
    no index holds. The installed torch satisfies it as it is (#37): no index is asked for
    torch, nothing needs TORCHJOBS_ENV_INSTALLER_ARGS, and torch is not installed again."""
    built = ensure_environment(Settings(home=tmp_path), ["accelerate==1.15.0"], tmp_path / "log")
    names = {p.name.split("-")[0].lower() for p in built.site.glob("*.dist-info")}
    assert "accelerate" in names and "torch" not in names, names


def test_what_the_worker_has_is_not_installed_again(tmp_path: Path) -> None:
    version = worker_packages()["packaging"]
    built = ensure_environment(settings(tmp_path), [f"packaging=={version}"], tmp_path / "log")
    assert list(built.site.iterdir()) == []


@pytest.mark.parametrize(
    ("requirement", "reason"),
    [
        ("torchvision==0.19.0", "torch==2.4.0"),  # its own dependency; the worker's torch stays
        (f"packaging=={'0.1'}", "packaging"),  # another version of one of the worker's packages
        ("nosuchpackage-torchjobs-xyz==1.0", "not found"),
    ],
)
def test_a_build_that_cannot_be_made_fails_with_uvs_reason(
    tmp_path: Path, requirement: str, reason: str
) -> None:
    s = settings(tmp_path)
    with pytest.raises(EnvironmentFailed) as failed:
        ensure_environment(s, [requirement], tmp_path / "log")
    assert reason in str(failed.value) and "unsatisfiable" in str(failed.value)
    assert [p for p in (s.cache_dir / "environments").iterdir() if not p.name.startswith(".")] == []


def test_the_plan_adds_only_and_never_replaces_the_workers_own() -> None:
    plan = (
        "Using Python 3.11.7 environment at: /venv\nResolved 14 packages in 80ms\n"
        "Would download 2 packages\nWould install 2 packages\n + accelerate==1.15.0\n + psutil==7.2.2\n"
    )
    assert planned_additions(plan) == ["accelerate==1.15.0", "psutil==7.2.2"]
    assert planned_additions("Audited 1 package in 3ms\nWould make no changes\n") == []
    with pytest.raises(EnvironmentFailed, match="would replace the worker's torch==2.13.0"):
        planned_additions(" - torch==2.13.0\n + torch==2.4.0\n")


def test_environment_names_are_salted_per_host_and_the_folder_is_not_listable(tmp_path: Path) -> None:
    """A job sees the environments folder (read-only, every sandbox): it must neither list it
    (0711) nor compute another job's environment name from requirements it guesses (it runs
    the same Python, so everything else in the name is known to it)."""
    s = settings(tmp_path)
    built = ensure_environment(s, ["tabulate==0.10.0"], tmp_path / "log")
    root = s.cache_dir / "environments"
    assert root.stat().st_mode & 0o777 == 0o711
    salt = host_salt(s.cache_dir)
    assert salt == host_salt(s.cache_dir) and len(salt) == 64  # kept: the build is reused
    assert (s.cache_dir / "envs.salt").stat().st_mode & 0o777 == 0o600
    assert not (root / "envs.salt").exists()  # beside the folder the sandboxes see, not in it
    assert built.site.parent.name == environment_key(["tabulate==0.10.0"], s.env_installer_args, salt)
    unsalted = environment_key(["tabulate==0.10.0"], s.env_installer_args, "")
    assert built.site.parent.name != unsalted
    assert [p.name for p in root.iterdir()] == [built.site.parent.name]  # no lock file there either
    again = ensure_environment(s, ["tabulate==0.10.0"], tmp_path / "log")
    assert again.reused and again.site == built.site


def test_an_empty_salt_is_replaced_and_the_unsalted_folder_removed(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "envs.salt").write_text("")  # a full disk's leftover: never a salt
    salt = host_salt(cache)
    assert len(salt) == 64 and (cache / "envs.salt").read_text().strip() == salt
    assert [p.name for p in cache.iterdir()] == ["envs.salt"]  # no temporary file left
    old = cache / "envs" / "0123abcd" / "site"  # names a job could compute
    old.mkdir(parents=True)
    remove_unsalted(cache)
    assert not (cache / "envs").exists()
