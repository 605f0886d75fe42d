"""The pure placement function, by example and by property (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from service.scheduler.placement import Host, QueuedJob, plan, queue_order


def test_gang_is_placed_whole_on_distinct_hosts() -> None:
    hosts = [Host(name="a", free=(0, 1)), Host(name="b", free=(0, 1))]
    result = plan([QueuedJob(id=1, priority=0, nodes=2, gpus_per_node=2)], hosts, starvation_s=300)
    nodes = result.placements[1]
    assert [n.node_rank for n in nodes] == [0, 1]
    assert {n.host for n in nodes} == {"a", "b"}
    assert all(n.gpus == (0, 1) for n in nodes)


def test_a_job_that_does_not_fit_says_why() -> None:
    hosts = [Host(name="a", free=(0, 1, 2, 3)), Host(name="b", free=(0,))]
    result = plan([QueuedJob(id=7, priority=0, nodes=2, gpus_per_node=4)], hosts, starvation_s=300)
    assert 7 not in result.placements
    assert result.pending_reasons[7] == "needs 2 nodes with 4 free GPUs; 1 has them"


def test_priority_then_age() -> None:
    hosts = [Host(name="a", free=(0,))]
    jobs = [
        QueuedJob(id=1, priority=0, nodes=1, gpus_per_node=1),
        QueuedJob(id=2, priority=5, nodes=1, gpus_per_node=1),
    ]
    assert list(plan(jobs, hosts, 300).placements) == [2]


def test_small_jobs_backfill_until_the_big_one_starves() -> None:
    hosts = [Host(name="a", free=(0, 1))]
    big = QueuedJob(id=1, priority=0, nodes=1, gpus_per_node=4)
    small = QueuedJob(id=2, priority=0, nodes=1, gpus_per_node=1)
    assert 2 in plan([big, small], hosts, starvation_s=300).placements
    starving = QueuedJob(id=1, priority=0, nodes=1, gpus_per_node=2, waited_s=301)
    busy = [Host(name="a", free=(1,))]
    result = plan([starving, small], busy, starvation_s=300)
    assert result.placements == {}
    assert "waiting behind job 1" in result.pending_reasons[2]


clusters = st.lists(
    st.tuples(st.integers(min_value=1, max_value=8), st.integers(min_value=0, max_value=8)),
    min_size=0,
    max_size=6,
)
queues = st.lists(
    st.tuples(st.integers(-2, 2), st.integers(1, 3), st.integers(1, 8), st.floats(0, 1000)),
    min_size=0,
    max_size=25,
)


@settings(max_examples=300, deadline=None)
@given(cluster=clusters, queue=queues)
def test_placement_properties(
    cluster: list[tuple[int, int]], queue: list[tuple[int, int, int, float]]
) -> None:
    hosts = []
    for i, (total, used) in enumerate(cluster):
        hosts.append(Host(name=f"h{i}", free=tuple(range(min(used, total), total))))
    jobs = [
        QueuedJob(id=i + 1, priority=p, nodes=n, gpus_per_node=g, waited_s=w)
        for i, (p, n, g, w) in enumerate(queue)
    ]
    result = plan(jobs, hosts, starvation_s=500)
    free = {h.name: set(h.free) for h in hosts}
    taken: dict[str, set[int]] = {h.name: set() for h in hosts}
    by_id = {j.id: j for j in jobs}
    for job_id, nodes in result.placements.items():
        job = by_id[job_id]
        assert len(nodes) == job.nodes  # whole gang
        assert len({n.host for n in nodes}) == job.nodes  # one node per host
        for node in nodes:
            assert len(node.gpus) == job.gpus_per_node
            assert set(node.gpus) <= free[node.host]  # only free slots
            assert not (set(node.gpus) & taken[node.host])  # never twice
            taken[node.host] |= set(node.gpus)
    # every job is either placed or has a reason
    assert set(result.placements) | set(result.pending_reasons) == set(by_id)
    # priority: a job left waiting for lack of room never has a lower-priority job placed
    # that it would have fitted into instead (without the starvation guard, backfill only
    # places jobs that the waiting job could not have used anyway)
    order = queue_order(jobs)
    for i, job in enumerate(order):
        if job.id in result.placements:
            continue
        for later in order[i + 1 :]:
            if later.id in result.placements and later.priority < job.priority:
                assert later.gpus_per_node < job.gpus_per_node or later.nodes < job.nodes


def test_an_unsandboxed_host_takes_only_the_admins_jobs() -> None:
    hosts = [Host(name="bare", free=(0, 1), open_to_all=False), Host(name="walled", free=(0,))]
    users = QueuedJob(id=1, priority=0, nodes=1, gpus_per_node=2, by_admin=False)
    admins = QueuedJob(id=2, priority=0, nodes=1, gpus_per_node=2)
    result = plan([users, admins], hosts, starvation_s=300)
    assert 1 not in result.placements and result.placements[2][0].host == "bare"
    assert result.pending_reasons[1] == (
        "needs 1 node with 2 free GPUs; 0 have them (1 more without a sandbox take only the admin's jobs)"
    )
    small = QueuedJob(id=3, priority=0, nodes=1, gpus_per_node=1, by_admin=False)
    assert plan([small], hosts, starvation_s=300).placements[3][0].host == "walled"
