"""The pure placement function, by example and by property (hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from service.scheduler.placement import Host, Owner, QueuedJob, plan, queue_order


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


def test_a_host_whose_multi_node_jobs_keep_its_network_takes_only_the_admins_multi_node_jobs() -> None:
    """A normal user's worker gives a multi-node job's ranks the host's network (contract §7
    v3: they would reach the host's services): another user's may run there on one node only."""
    hosts = [
        Host(name="laptop", free=(0, 1), multinode_open_to_all=False),
        Host(name="desk", free=(0, 1), multinode_open_to_all=False),
        Host(name="walled", free=(0,)),
    ]
    users = QueuedJob(id=1, priority=0, nodes=2, gpus_per_node=2, by_admin=False)
    elastic = QueuedJob(id=2, priority=0, nodes=1, max_nodes=2, gpus_per_node=2, by_admin=False)
    single = QueuedJob(id=3, priority=0, nodes=1, gpus_per_node=2, by_admin=False)
    result = plan([users, elastic, single], hosts, starvation_s=300)
    assert 1 not in result.placements and 2 not in result.placements
    assert result.pending_reasons[1] == (
        "needs 2 nodes with 2 free GPUs; 0 have them (2 more run multi-node jobs on their host's "
        "network and take only the admin's)"
    )
    assert result.placements[3][0].host in ("laptop", "desk")  # one node: its own loopback
    admins = QueuedJob(id=4, priority=0, nodes=2, gpus_per_node=2)
    assert {n.host for n in plan([admins], hosts, starvation_s=300).placements[4]} == {"laptop", "desk"}
    both = [Host(name="bare", free=(0, 1), open_to_all=False), *hosts]
    reason = plan([users], both, starvation_s=300).pending_reasons[1]
    assert "(1 more without a sandbox take only the admin's jobs) (2 more run multi-node" in reason


def test_a_multi_node_job_never_has_nodes_both_in_networks_of_their_own_and_on_a_host_s() -> None:
    """A meshed node meets its peers at their own addresses, which a host-network node never
    says: one job's nodes are all of one kind (meshed first where enough fit)."""

    def placed(*kinds: bool, nodes: int = 2) -> set[str] | None:
        names = [f"{'mesh' if k else 'plain'}{i}" for i, k in enumerate(kinds)]
        hosts = [Host(name=n, free=(0,), meshes=k) for n, k in zip(names, kinds, strict=True)]
        result = plan([QueuedJob(id=1, priority=0, nodes=nodes, gpus_per_node=1)], hosts, starvation_s=300)
        return {n.host for n in result.placements[1]} if 1 in result.placements else None

    assert placed(True, False, False) == {"plain1", "plain2"}
    assert placed(True, True, False) == {"mesh0", "mesh1"}
    assert placed(True, False) is None  # one of each: it waits, saying why
    split = [Host(name="mesh", free=(0,)), Host(name="plain", free=(0,), meshes=False)]
    reason = plan([QueuedJob(id=1, priority=0, nodes=2, gpus_per_node=1)], split, 300).pending_reasons[1]
    assert reason == (
        "needs 2 nodes with 1 free GPUs; 1 has them (1 more would put its nodes in another kind of "
        "network: a job's nodes all get networks of their own, or none)"
    )
    assert placed(True, False, nodes=1) is not None  # one node: either kind
    elastic = QueuedJob(id=2, priority=0, nodes=1, max_nodes=3, gpus_per_node=1)
    hosts = [Host(name="mesh", free=(0,)), Host(name="plain0", free=(0,), meshes=False)]
    hosts.append(Host(name="plain1", free=(0,), meshes=False))
    assert {n.host for n in plan([elastic], hosts, starvation_s=300).placements[2]} == {"plain0", "plain1"}


def test_a_quarantined_host_takes_nothing_and_the_reason_names_it() -> None:
    hosts = [Host(name="sick", free=(0, 1), quarantined=True), Host(name="well", free=(0,))]
    big = QueuedJob(id=1, priority=0, nodes=1, gpus_per_node=2)
    small = QueuedJob(id=2, priority=0, nodes=1, gpus_per_node=1)
    result = plan([big, small], hosts, starvation_s=300)
    assert 1 not in result.placements and result.placements[2][0].host == "well"
    assert result.pending_reasons[1] == (
        "needs 1 node with 2 free GPUs; 0 have them; quarantined, and would fit: sick "
        "(an admin's POST /v1/workers/NAME/readmit)"
    )
    too_big = QueuedJob(id=3, priority=0, nodes=1, gpus_per_node=4)
    assert "quarantined" not in plan([too_big], hosts, starvation_s=300).pending_reasons[3]


def test_fair_share_gives_the_next_gpus_to_whoever_holds_fewest() -> None:
    """dana holds 4 and has older jobs queued; eve holds none: eve's two go first (contract §9)."""
    hosts = [Host(name="a", free=(0, 1))]
    dana = [QueuedJob(id=i, priority=0, nodes=1, gpus_per_node=1, owner=1) for i in (1, 2, 3, 4)]
    eve = [QueuedJob(id=i, priority=0, nodes=1, gpus_per_node=1, owner=2) for i in (10, 11)]
    owners = {1: Owner(name="dana", in_use=4), 2: Owner(name="eve", in_use=0)}
    result = plan(dana + eve, hosts, starvation_s=300, owners=owners)
    assert set(result.placements) == {10, 11}
    assert owners[2].in_use == 0, "the inputs are not changed"


def test_within_a_pass_the_owners_take_turns() -> None:
    hosts = [Host(name="a", free=(0, 1, 2, 3))]
    jobs = [QueuedJob(id=i, priority=0, nodes=1, gpus_per_node=1, owner=1) for i in (1, 2, 3)]
    jobs += [QueuedJob(id=i, priority=0, nodes=1, gpus_per_node=1, owner=2) for i in (7, 8, 9)]
    result = plan(jobs, hosts, starvation_s=300, owners={1: Owner(), 2: Owner()})
    assert set(result.placements) == {1, 2, 7, 8}


def test_between_equal_holders_the_oldest_job_goes_first() -> None:
    """Contract §9: fewest GPUs held, then the oldest job (not the lighter past user)."""
    hosts = [Host(name="a", free=(0,))]
    jobs = [
        QueuedJob(id=2, priority=0, nodes=1, gpus_per_node=1, owner=1),
        QueuedJob(id=1, priority=0, nodes=1, gpus_per_node=1, owner=2),
    ]
    assert set(plan(jobs, hosts, 300, {1: Owner(), 2: Owner()}).placements) == {1}


def test_priority_still_comes_before_fair_share() -> None:
    hosts = [Host(name="a", free=(0,))]
    jobs = [
        QueuedJob(id=1, priority=5, nodes=1, gpus_per_node=1, owner=1),
        QueuedJob(id=2, priority=0, nodes=1, gpus_per_node=1, owner=2),
    ]
    assert set(plan(jobs, hosts, 300, {1: Owner(in_use=8), 2: Owner()}).placements) == {1}


def test_a_job_over_its_owners_quota_waits_and_blocks_nobody() -> None:
    """Even once it has waited past the starvation guard: a quota, not the cluster, holds it."""
    hosts = [Host(name="a", free=(0, 1, 2, 3))]
    alice = [QueuedJob(id=i, priority=0, nodes=1, gpus_per_node=1, owner=1, waited_s=9999) for i in (1, 2, 3)]
    bob = [QueuedJob(id=9, priority=0, nodes=1, gpus_per_node=1, owner=2)]
    owners = {1: Owner(name="alice", in_use=1, quota=2), 2: Owner(name="bob")}
    result = plan(alice + bob, hosts, starvation_s=300, owners=owners)
    assert set(result.placements) == {1, 9}
    assert result.pending_reasons[2] == (
        "waits for its owner's gpu_quota: alice holds 2 of 2 GPUs and this job needs 1"
    )
    assert 3 in result.pending_reasons and 9 not in result.pending_reasons


def test_a_quota_counts_every_gpu_of_a_multi_node_job() -> None:
    hosts = [Host(name="a", free=(0, 1)), Host(name="b", free=(0, 1))]
    job = QueuedJob(id=1, priority=0, nodes=2, gpus_per_node=2, owner=1)
    assert plan([job], hosts, 300, {1: Owner(quota=3)}).placements == {}
    assert set(plan([job], hosts, 300, {1: Owner(quota=4)}).placements) == {1}


def test_a_job_stuck_behind_another_users_job_is_not_told_its_id() -> None:
    """Contract §7: nothing of another user's jobs, not even in a pending_reason."""
    busy = [Host(name="a", free=(1,))]
    starving = QueuedJob(id=1, priority=0, nodes=1, gpus_per_node=2, waited_s=301, owner=10, by_admin=False)
    mine = QueuedJob(id=2, priority=0, nodes=1, gpus_per_node=1, owner=10, by_admin=False)
    theirs = QueuedJob(id=3, priority=0, nodes=1, gpus_per_node=1, owner=11, by_admin=False)
    admins = QueuedJob(id=4, priority=0, nodes=1, gpus_per_node=1, owner=12, by_admin=True)
    reasons = plan([starving, mine, theirs, admins], busy, starvation_s=300).pending_reasons
    assert reasons[2] == "waiting behind job 1, which has waited longest"
    assert reasons[3] == "waiting behind another user's job, which has waited longest"
    assert reasons[4] == "waiting behind job 1, which has waited longest"  # the admin sees all


def test_many_quarantined_hosts_are_counted_not_all_named() -> None:
    hosts = [Host(name=f"sick-{i:03d}-" + "x" * 100, free=(0, 1), quarantined=True) for i in range(40)]
    reason = plan([QueuedJob(id=1, priority=0, nodes=1, gpus_per_node=2)], hosts, 300).pending_reasons[1]
    assert "sick-004" in reason and "sick-005" not in reason and "and 35 more" in reason
    assert len(reason) <= 1000


def test_a_job_that_needs_cuda_is_never_placed_on_a_cpu_worker() -> None:
    """amp fp16 fails at its first step on a CPU worker of a mixed cluster (#37): it waits for
    a CUDA worker, and says so; any other job takes the CPU worker's slots."""
    hosts = [Host(name="cpu", free=(0, 1), cuda=False), Host(name="gpu", free=())]
    fp16 = QueuedJob(id=1, priority=5, nodes=1, gpus_per_node=1, needs_cuda=True)
    plain = QueuedJob(id=2, priority=0, nodes=1, gpus_per_node=1)
    result = plan([fp16, plain], hosts, starvation_s=1e9)
    assert 1 not in result.placements and "needs a CUDA worker" in result.pending_reasons[1]
    assert result.placements[2][0].host == "cpu"
    freed = [Host(name="cpu", free=(0, 1), cuda=False), Host(name="gpu", free=(0,))]
    assert plan([fp16], freed, starvation_s=1e9).placements[1][0].host == "gpu"
