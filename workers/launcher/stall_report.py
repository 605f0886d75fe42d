"""What a stalled node leaves behind before it is stopped (contract §8): in each rank's log a
line starting `[stall]` and the rank's Python stack, and one `stall` event per rank."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from service.nodes.values import NodeKey
from workers.launcher.ingest import RankLogs
from workers.launcher.stacks import take_stacks

STACK_WRITE_S = 1.0  # how long a rank gets to write its own stack (faulthandler)


@dataclass(frozen=True, kw_only=True)
class Stall:
    seconds: float  # silent for, or alone for
    why: str  # one phrase: what was seen, and the timeout that ran out
    stall_timeout_s: float | None
    peer_exit_timeout_s: float | None = None  # set when every other node had ended


def silent(job_id: int, seconds: float, timeout: float | None) -> Stall:
    why = f"no rank of job {job_id} reported anything for {seconds:.0f} s (stall_timeout_s {timeout:g})"
    return Stall(seconds=seconds, why=why, stall_timeout_s=timeout)


def alone(seconds: float, stall_timeout: float | None, peer_timeout: float) -> Stall:
    why = (
        f"every other node ended {seconds:.0f} s ago and this one still runs "
        f"(peer exit timeout {peer_timeout:g} s)"
    )
    return Stall(seconds=seconds, why=why, stall_timeout_s=stall_timeout, peer_exit_timeout_s=peer_timeout)


def write_stacks(key: NodeKey, stall: Stall, rank_logs: Sequence[RankLogs], ranks: dict[int, int]) -> None:
    """Every rank's stack into its log (a note the next look stores), under its `[stall]` line."""
    nproc = len(rank_logs)
    asked_self = False
    for stack in take_stacks(ranks):
        rank = key.node_rank * nproc + stack.local_rank
        how = "py-spy dump" if stack.text else "written by the rank itself (faulthandler), below"
        header = (
            f"[stall] {stall.why}: node {key.node_rank} rank {rank} "
            f"(local rank {stack.local_rank}, pid {stack.pid}); its Python stack, {how}:"
        )
        rank_logs[stack.local_rank].note(header + ("\n" + stack.text if stack.text else ""))
        asked_self = asked_self or stack.text is None
    for local_rank in sorted(set(range(nproc)) - set(ranks)):
        rank_logs[local_rank].note(
            f"[stall] {stall.why}: node {key.node_rank} local rank {local_rank}: no process"
        )
    if asked_self:
        time.sleep(STACK_WRITE_S)  # the ranks' own dumps reach their stderr


def send_events(
    key: NodeKey, stall: Stall, nproc: int, send: Callable[[str, dict[str, Any]], object]
) -> None:
    for local_rank in range(nproc):
        data: dict[str, Any] = {
            "node_rank": key.node_rank,
            "rank": key.node_rank * nproc + local_rank,
            "local_rank": local_rank,
            "seconds": round(stall.seconds, 1),
            "stall_timeout_s": stall.stall_timeout_s,
        }
        if stall.peer_exit_timeout_s is not None:
            data["peer_exit_timeout_s"] = stall.peer_exit_timeout_s
        send("stall", data)
