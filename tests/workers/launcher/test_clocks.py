"""The node's clocks of contract §8, on made-up times: when a node is past its time limit,
and when a job is silent (counted from its ranks' start, restarted by any node's report)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from service.nodes.values import NodeLimits
from workers.launcher.clocks import LOST_PEERS, STALL, TIME_LIMIT, NodeClock

WALL = datetime(2026, 12, 2, 8, 0, tzinfo=UTC)


def test_no_limits_never_stop_a_node() -> None:
    clock = NodeClock(NodeLimits(), now=0)
    clock.ranks_up(now=0)
    assert clock.verdict(now=10**9, wall=WALL) is None


def test_the_time_limit_counts_what_earlier_attempts_left() -> None:
    clock = NodeClock(NodeLimits(time_left_s=15, max_duration_s=60), now=100)
    assert clock.verdict(now=114.9, wall=WALL) is None
    assert clock.verdict(now=115, wall=WALL) == TIME_LIMIT


def test_silence_counts_only_once_the_ranks_exist() -> None:
    """Waiting in the queue, building an environment, meeting peers: none of it is silence."""
    clock = NodeClock(NodeLimits(stall_timeout_s=20), now=0)
    assert clock.silent_for(now=1000, wall=WALL) is None
    assert clock.verdict(now=1000, wall=WALL) is None
    clock.ranks_up(now=1000)
    clock.ranks_up(now=1010)  # the first sight counts
    assert clock.verdict(now=1019, wall=WALL) is None
    assert clock.verdict(now=1020, wall=WALL) == STALL


def test_this_node_hearing_its_ranks_restarts_the_clock() -> None:
    clock = NodeClock(NodeLimits(stall_timeout_s=20), now=0)
    clock.ranks_up(now=0)
    clock.heard(now=15)
    assert clock.verdict(now=34, wall=WALL) is None
    assert clock.verdict(now=35, wall=WALL) == STALL


def test_another_nodes_stored_report_keeps_a_quiet_node_alive() -> None:
    """Node 1's ranks print nothing while node 0's report: the job is not silent."""
    clock = NodeClock(NodeLimits(stall_timeout_s=20), now=0)
    clock.ranks_up(now=0)
    clock.stored_report(WALL - timedelta(seconds=5))
    assert clock.silent_for(now=100, wall=WALL) == 5
    assert clock.verdict(now=100, wall=WALL) is None
    clock.stored_report(WALL - timedelta(seconds=50))  # an older one changes nothing
    assert clock.silent_for(now=100, wall=WALL) == 5
    assert clock.verdict(now=100, wall=WALL + timedelta(seconds=15)) == STALL


def test_a_report_from_before_the_ranks_started_does_not_shorten_their_time() -> None:
    clock = NodeClock(NodeLimits(stall_timeout_s=20), now=0)
    clock.stored_report(WALL - timedelta(seconds=500))  # the previous attempt's
    clock.ranks_up(now=0)
    assert clock.silent_for(now=10, wall=WALL) == 10


def test_a_node_still_running_after_every_peer_ended_is_stopped_within_its_own_timeout() -> None:
    clock = NodeClock(NodeLimits(stall_timeout_s=600, peer_exit_timeout_s=120), now=0)
    clock.ranks_up(now=0)
    clock.heard(now=0)
    assert clock.verdict(now=50, wall=WALL) is None  # peers still running
    clock.peers_ended(WALL - timedelta(seconds=119))
    assert clock.verdict(now=130, wall=WALL) is None
    assert clock.verdict(now=131, wall=WALL + timedelta(seconds=1)) == LOST_PEERS
    clock.peers_ended(None)  # a look that found one running again (a retry's node)
    assert clock.verdict(now=131, wall=WALL + timedelta(seconds=1)) is None


def test_a_node_alone_but_still_writing_is_not_a_lost_peer() -> None:
    """Rank 0's final evaluation after the other nodes are done: it reports, so it runs on."""
    clock = NodeClock(NodeLimits(peer_exit_timeout_s=120), now=0)
    clock.ranks_up(now=0)
    clock.peers_ended(WALL - timedelta(seconds=300))
    clock.heard(now=250)
    assert clock.verdict(now=300, wall=WALL) is None
    assert clock.verdict(now=370, wall=WALL) == LOST_PEERS
