"""A sweep's objective and its ASHA early stopping (contract §13).

**Best.** A child's last reported value of the objective is on its own row
(`jobs.objective_value`, written with the report: `service.jobs.metrics`); the parent's
`sweep.best` is the best of those (ties: the lowest id), rewritten when it moves.

**Rungs.** With `early_stop: {"kind": "asha", "min_epochs": R, "reduction_factor": η}`, rung k
sits at epoch R·η^k, for every such epoch below the child's `hyperparameters.epochs` (a rung at
the last epoch would stop nothing). A child *completes* rung k with its first report of the
objective whose `epoch` (epochs completed) is at least R·η^k: for the builtin trainer, the
report at the end of that epoch, with its `val_loss`/`val_accuracy`. That value is recorded in
`sweep_rungs` once (a retried child, reporting that epoch again, does not vote twice) and
compared with every value recorded at that rung so far, its own included: with fewer than η of
them the child goes on; otherwise it goes on only when fewer than ⌊n/η⌋ values are strictly
better than its own (it is among the best 1/η), else it is stopped. A stopped child's row gets
`stop_intent = "early_stop"` and `stopped_early: {"epoch", "value"}`: its nodes' supervisors
see it at their next look, SIGTERM the ranks (the builtin trainer checkpoints, as on
preemption) and end the node `succeeded`; the child then ends `succeeded` and its GPUs go to
the sweep's next child.

**When.** Right after each report's transaction that moved a child's objective
(`review_after_report`, called by the report writer), and again in every scheduler pass for
each live sweep (`review_sweeps`), which makes up for a report whose review was lost (a crash
between the two transactions, a database error): every decision is made from the database,
in a transaction that holds the parent's row lock (lock order: parent, then child), so that
concurrent reports are compared one after the other, and a second look decides nothing twice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from service.jobs import repository as repo
from service.jobs.states import append_event, lock_job
from service.models import Job
from service.states import JOB_TERMINAL, SWEEP

log = logging.getLogger("torchjobs.sweeps")

EARLY_STOP = "early_stop"
MAX_RUNGS = 64


@dataclass(frozen=True, slots=True)
class Asha:
    min_epochs: int
    reduction_factor: int

    def rung_epoch(self, k: int) -> int:
        return int(self.min_epochs * self.reduction_factor**k)

    def rungs_below(self, last_epoch: int, epochs: int | None) -> list[tuple[int, int]]:
        """(k, epoch) of every rung a child that reported `last_epoch` has reached, below its
        last epoch when that is known."""
        out = []
        for k in range(MAX_RUNGS):
            at = self.rung_epoch(k)
            if at > last_epoch or (epochs is not None and at >= epochs):
                break
            out.append((k, at))
        return out


def asha_of(sweep: dict[str, Any] | None) -> Asha | None:
    stop = (sweep or {}).get("early_stop")
    if not stop or stop.get("kind") != "asha" or not (sweep or {}).get("objective"):
        return None
    return Asha(int(stop["min_epochs"]), int(stop["reduction_factor"]))


def keeps_going(value: float, recorded: list[float], mode: str, reduction_factor: int) -> bool:
    """The ASHA verdict for `value` among the rung's `recorded` values (its own included)."""
    n = len(recorded)
    if n < reduction_factor:
        return True
    better = sum(1 for v in recorded if (v < value if mode == "min" else v > value))
    return better < n // reduction_factor


def review_after_report(db: Any, parent_id: int, child_id: int) -> bool:
    """The sweep's best and the child's rungs, in a transaction of its own after the report's
    (which held the child's lock; the parent's is taken first here). True when the child is
    to stop now: the report's writer tells its supervisor at once. A failure is logged, not
    raised: the report is stored, and the next scheduler pass reviews the sweep again."""
    try:
        with db.transaction() as session:
            parent = lock_job(session, parent_id)
            if parent is None or parent.kind != SWEEP or parent.state in JOB_TERMINAL:
                return False
            stopped = review_child(session, parent, child_id)
            update_best(session, parent)
            return stopped
    except Exception:
        log.warning("sweep %s: review after a report of job %s failed", parent_id, child_id, exc_info=True)
        return False


def review_sweeps(session: Session) -> int:
    """Every live sweep with an objective: its best, and the rungs of children whose reports
    passed one not yet recorded. Parents are locked only where something is to be done.
    Returns how many parents changed."""
    rows = repo.running_sweep_specs(session)
    changed = 0
    for row in rows:
        objective = (row.sweep or {}).get("objective")
        if not objective:
            continue
        behind = _children_behind(session, row.id, asha_of(row.sweep))
        if behind or _best_of(session, row.id, objective) != (row.sweep or {}).get("best"):
            parent = lock_job(session, row.id)
            if parent is None or parent.state in JOB_TERMINAL:
                continue
            for child_id in behind:
                review_child(session, parent, child_id)
            update_best(session, parent)
            changed += 1
    return changed


def _children_behind(session: Session, parent_id: int, asha: Asha | None) -> list[int]:
    """Children running (not stopped) whose last objective epoch reached a rung they have no
    value at yet."""
    if asha is None:
        return []
    done = repo.rungs_recorded(session, parent_id)
    children = repo.reporting_children(session, parent_id)
    out = []
    for child in children:
        reached = asha.rungs_below(int(child.objective_epoch), _epochs(child.hyperparameters))
        if len(reached) > done.get(child.id, 0):
            out.append(child.id)
    return out


def review_child(session: Session, parent: Job, child_id: int) -> bool:
    """Record the child's values at the rungs it completed and not yet recorded, and stop it
    at the first whose verdict says so (True). The caller holds the parent's row lock."""
    asha = asha_of(parent.sweep)
    if asha is None or parent.sweep is None:
        return False
    mode = parent.sweep["objective"]["mode"]
    child = repo.sweep_child(session, parent.id, child_id)
    if child is None or child.stop_intent is not None or child.state in JOB_TERMINAL:
        return False
    last_epoch = repo.last_objective_epoch(session, child_id)
    if last_epoch is None:
        return False
    recorded = repo.child_rungs(session, parent.id, child_id)
    for k, at in asha.rungs_below(int(last_epoch), _epochs(child.hyperparameters)):
        if k in recorded:
            continue
        point = repo.first_objective_at(session, child_id, at)
        value = float(point.objective)
        others = repo.rung_values(session, parent.id, k)
        going = keeps_going(value, [*others, value], mode, asha.reduction_factor)
        verdict = "continue" if going else "stop"
        repo.add_rung(session, parent.id, k, child_id, int(point.epoch), value, verdict)
        if not going:
            return stop_child(session, parent.id, child_id, k, int(point.epoch), value, len(others) + 1)
    return False


def stop_child(
    session: Session, parent_id: int, child_id: int, rung: int, epoch: int, value: float, n: int
) -> bool:
    """Ask the child's ranks to checkpoint and stop (its nodes' supervisors read the intent);
    it ends `succeeded`, with `stopped_early`."""
    child = lock_job(session, child_id)
    if child is None or child.state in JOB_TERMINAL or child.stop_intent is not None:
        return False
    child.stop_intent = EARLY_STOP
    child.stopped_early = {"epoch": epoch, "value": value}
    append_event(
        session,
        child_id,
        "early_stop",
        {"epoch": epoch, "value": value, "rung": rung, "compared": n, "sweep": parent_id},
    )
    log.info(
        "sweep %s: job %s stopped early at epoch %s (rung %s, value %s)",
        parent_id,
        child_id,
        epoch,
        rung,
        value,
    )
    return True


def _best_of(session: Session, parent_id: int, objective: dict[str, Any]) -> dict[str, Any] | None:
    row = repo.best_child(session, parent_id, minimise=objective.get("mode") == "min")
    if row is None:
        return None
    return {"job_id": row.id, "point": row.sweep_point, "value": row.objective_value}


def update_best(session: Session, parent: Job) -> bool:
    """The parent's `sweep.best` from its children's last values (parent locked by the caller)."""
    sweep = parent.sweep or {}
    objective = sweep.get("objective")
    if not objective:
        return False
    best = _best_of(session, parent.id, objective)
    if best == sweep.get("best"):
        return False
    parent.sweep = {**sweep, "best": best}
    return True


def _epochs(hyperparameters: dict[str, Any] | None) -> int | None:
    epochs = (hyperparameters or {}).get("epochs")
    return epochs if isinstance(epochs, int) and not isinstance(epochs, bool) else None
