"""Shared fixtures: real PostgreSQL databases, a real Redis database, real torchjobs stacks;
and how the suite is split for `.ci/test` (tiers, xdist groups, Redis databases per process)."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

from service.testing import harness
from tests.redis_dbs import fresh_redis_url, release_redis_url

pytest_plugins = ["tests.ci_report"]

# What each module does that makes it slow or fragile (`.ci/test` runs the unmarked tests
# first with -x, then these). tests/test_tiers.py checks this table against the modules.
_INTEGRATION = ("stack", "torchrun")
MARKS: dict[str, tuple[str, ...]] = {
    "integration/test_cli.py": _INTEGRATION,
    "integration/test_dependencies.py": _INTEGRATION,
    "integration/test_elastic.py": (*_INTEGRATION, "fault"),
    "integration/test_exec.py": _INTEGRATION,
    "integration/test_non_root.py": _INTEGRATION,
    "integration/test_failures.py": (*_INTEGRATION, "fault"),
    "integration/test_fair_queue.py": _INTEGRATION,
    "integration/test_folder_checkpoints.py": _INTEGRATION,
    "integration/test_hf_trainer.py": (*_INTEGRATION, "fault"),
    "integration/test_json_logs.py": _INTEGRATION,
    "integration/test_metrics_sweeps.py": _INTEGRATION,
    "integration/test_multinode.py": _INTEGRATION,
    "integration/test_own_code.py": _INTEGRATION,
    "integration/test_private_mesh.py": _INTEGRATION,
    "integration/test_routed_network.py": _INTEGRATION,
    "integration/test_preemption.py": (*_INTEGRATION, "fault"),
    "integration/test_sandbox.py": (*_INTEGRATION, "fault"),
    "integration/test_server_processes.py": ("stack", "fault"),
    "integration/test_sick_hosts.py": (*_INTEGRATION, "fault"),
    "integration/test_skeleton.py": _INTEGRATION,
    "integration/test_sweeps.py": _INTEGRATION,
    "integration/test_time_limits.py": _INTEGRATION,
    "integration/test_up.py": (*_INTEGRATION, "fault"),
    "integration/test_walls_v3.py": _INTEGRATION,
    "integration/test_webhooks.py": (*_INTEGRATION, "fault"),
    "service/checkpoints/test_checkpoints_api.py": _INTEGRATION,
    "service/checkpoints/test_code_storage.py": ("stack",),
    "service/dashboard/test_browser.py": ("stack", "browser"),
    "service/streams/test_events_stream.py": _INTEGRATION,
    "service/streams/test_logs.py": _INTEGRATION,
    "service/streams/test_revoked_streams.py": ("stack",),
    "service/test_concurrent_requests.py": ("stack",),
    "service/test_fuzz_api.py": ("stack",),
    "service/test_hostile_strings.py": ("stack",),
    "service/test_parent_death.py": ("fault",),
    "service/scheduler/test_leadership.py": ("fault",),
    "service/scheduler/test_database_outages.py": ("fault",),
    "service/jobs/test_record_end_retries.py": ("fault",),
    "test_bench_smoke.py": ("bench", "stack", "torchrun"),
    "test_scale_smoke.py": ("bench", "stack"),
    "workers/test_worker_exit_status.py": ("fault",),
    "workers/launcher/test_cgroups.py": ("fault",),
    "workers/launcher/test_launch_plan_runs.py": ("torchrun",),
    "workers/launcher/test_log_cap.py": ("torchrun",),
    "workers/launcher/test_log_ingestion.py": ("torchrun",),
    "workers/launcher/test_sandbox.py": ("torchrun",),
    "workers/launcher/test_seccomp.py": ("torchrun",),
    "workers/launcher/test_supervisor_storing.py": ("torchrun",),
    "workers/launcher/test_warm_pool.py": ("torchrun",),
    "workers/launcher/test_worker_node.py": ("torchrun",),
    "workers/runtime/test_runtime_checkpoint.py": ("torchrun",),
    "workers/runtime/test_runtime_cpu_slots.py": ("torchrun",),
    "workers/runtime/test_runtime_ddp_knobs.py": ("torchrun",),
    "workers/runtime/test_runtime_dp.py": ("torchrun",),
    "workers/runtime/test_runtime_exit.py": ("torchrun",),
    "workers/runtime/test_runtime_factory_order.py": ("torchrun",),
    "workers/runtime/test_runtime_fsdp.py": ("torchrun",),
    "workers/runtime/test_runtime_isolation.py": ("torchrun",),
    "workers/runtime/test_runtime_loader_seeds.py": ("torchrun",),
    "workers/runtime/test_runtime_loader_workers.py": ("torchrun", "fault"),
    "workers/runtime/test_runtime_preflight.py": ("torchrun",),
    "workers/runtime/test_runtime_stop_agreement.py": ("torchrun",),
    "workers/runtime/test_runtime_syncbn.py": ("torchrun",),
    "workers/runtime/test_runtime_train_ddp.py": ("torchrun",),
    "workers/runtime/test_runtime_train_single.py": ("torchrun",),
    "workers/runtime/test_runtime_units.py": ("torchrun",),
    "workers/runtime/test_runtime_v2_hyper.py": ("torchrun",),
    "workers/runtime/test_warm_ranks.py": ("torchrun",),
}
# Modules that use one of the fixed Redis databases 12-15 (the benchmarks use 12 and 13 too):
# one xdist group, so one process at a time uses them (two stacks on one database would take
# each other's tasks).
FIXED_REDIS = (
    "integration/test_sandbox.py",
    "service/checkpoints/",
    "service/streams/",
    "test_bench_smoke.py",
    "test_scale_smoke.py",
)
TESTS = Path(__file__).resolve().parent


def module_key(path: Path) -> str:
    return path.resolve().relative_to(TESTS).as_posix()


def xdist_group_of(key: str) -> str:
    """A module's tests stay in one process, so its module fixtures (a whole stack) are made
    once, not once per process; the modules on the fixed Redis databases share one group."""
    return "redis-fixed" if key.startswith(FIXED_REDIS) else key


class ModuleGroupScheduling(LoadScopeScheduling):
    """xdist's loadgroup cannot keep groups under pytest 9: it writes the group into
    `item._nodeid`, and pytest 9 reads a test's id from `item._id`, so every test was its own
    work unit (seen with `-v`, 2026-12-06) and two processes built the same module's stack at
    once. This scheduler groups by the node id alone, which both processes report alike."""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return xdist_group_of(path.removeprefix("tests/"))


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> ModuleGroupScheduling:
    return ModuleGroupScheduling(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        key = module_key(item.path)
        for mark in MARKS.get(key, ()):
            item.add_marker(getattr(pytest.mark, mark))
    items[:] = longest_groups_first(items)


# A module not yet in tests/module_seconds.json: as long as this per test if it is marked
# (a stack, torchrun), else as a unit test.
UNKNOWN_MARKED_S, UNKNOWN_UNIT_S = 8.0, 0.2
MODULE_SECONDS = TESTS / "module_seconds.json"


def longest_groups_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """xdist hands whole groups to whichever process is free, in collection order: longest
    first, the two processes end close together (a long module last leaves one idle for its
    whole length). Each group's tests keep their order. The times are the last CI's
    (tests/ci_report.py writes them)."""
    try:
        known: dict[str, float] = json.loads(MODULE_SECONDS.read_text())
    except (OSError, ValueError):
        known = {}
    cost: dict[str, float] = defaultdict(float)
    seen: set[str] = set()
    for item in items:
        key = module_key(item.path)
        group = xdist_group_of(key)
        if key in known:
            if key not in seen:
                cost[group] += known[key]
        else:
            cost[group] += UNKNOWN_MARKED_S if key in MARKS else UNKNOWN_UNIT_S
        seen.add(key)
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        first.setdefault(xdist_group_of(module_key(item.path)), index)
    position = {id(item): index for index, item in enumerate(items)}

    def order(item: pytest.Item) -> tuple[float, int, int]:
        group = xdist_group_of(module_key(item.path))
        return (-cost[group], first[group], position[id(item)])

    return sorted(items, key=order)


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A database at the newest migration (a copy of the session's migrated template)."""
    url = harness.create_pg_database(migrated=True)
    yield url
    harness.drop_pg_database(url)


@pytest.fixture
def empty_pg_url() -> Iterator[str]:
    """A database with nothing in it, for the tests of the migrations themselves."""
    url = harness.create_pg_database()
    yield url
    harness.drop_pg_database(url)


@pytest.fixture(scope="module")
def module_pg_url() -> Iterator[str]:
    url = harness.create_pg_database(migrated=True)
    yield url
    harness.drop_pg_database(url)


@pytest.fixture
def redis_url() -> Iterator[str]:
    url = fresh_redis_url()
    yield url
    release_redis_url(url)


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.Stack]:
    stack = harness.embedded_stack(Path(tmp_path_factory.mktemp("embedded")))
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def production(tmp_path_factory: pytest.TempPathFactory, module_pg_url: str) -> Iterator[harness.Stack]:
    redis_url = fresh_redis_url()
    stack = harness.production_stack(Path(tmp_path_factory.mktemp("production")), module_pg_url, redis_url)
    yield stack
    stack.stop()
    release_redis_url(redis_url)
