"""The queue's counts per priority (service/models/jobs.py `QueueCount`), kept in the
transactions that move jobs into and out of the queue (`service.jobs.states`, the gate).

A move is noted in the session (`count_queue`) and added to the table when the transaction
commits, after its other writes: the counts' row locks are then held for the commit alone (a
scheduling pass would otherwise hold them for the whole pass, and every cancel and submit at
those priorities would wait for it), and every transaction takes them in one order
(`repository.add_queue_counts`), so two never wait on each other's crosswise. A SAVEPOINT's
moves are its own until it is released: rolled back, they never happened.

The one count written at once is a new job's own, by `states.create_job_if`, which needs it
to answer the job's position (and takes the row lock before the job's id is drawn).
"""

from __future__ import annotations

from sqlalchemy import event
from sqlalchemy.orm import Session, SessionTransaction

from service.jobs import repository as repo

QUEUE_DELTAS = "queue_count_deltas"  # session.info: [(transaction, {(source, priority): jobs})]
Deltas = dict[tuple[str, int], int]


def count_queue(session: Session, priority: int, delta: int, source: str = repo.MOVED) -> None:
    """A job counted into (+1) or out of (-1) the queue at its priority, at commit."""
    deltas = _level(session, session.get_nested_transaction() or session.get_transaction())
    deltas[(source, priority)] = deltas.get((source, priority), 0) + delta


def _level(session: Session, transaction: SessionTransaction | None) -> Deltas:
    """The moves noted in `transaction` itself (the stack holds one level per open one that
    noted any, innermost last)."""
    stack: list[tuple[SessionTransaction | None, Deltas]] = session.info.setdefault(QUEUE_DELTAS, [])
    if not stack or stack[-1][0] is not transaction:
        stack.append((transaction, {}))
    return stack[-1][1]


def _merge(into: Deltas, deltas: Deltas) -> None:
    for key, delta in deltas.items():
        into[key] = into.get(key, 0) + delta


@event.listens_for(Session, "before_commit")
def _add_counts(session: Session) -> None:
    if session.in_nested_transaction() or not session.info.get(QUEUE_DELTAS):
        return
    session.flush()  # every other write first: the counts' locks are the transaction's last
    total: Deltas = {}
    for _transaction, deltas in session.info.pop(QUEUE_DELTAS):
        _merge(total, deltas)
    repo.add_queue_counts(session, total)


@event.listens_for(Session, "after_commit")
def _keep_released_savepoint(session: Session) -> None:
    """A SAVEPOINT released: its moves are its parent's now."""
    nested = session.get_nested_transaction()
    stack = session.info.get(QUEUE_DELTAS)
    if nested is None or not stack or stack[-1][0] is not nested:
        return
    _transaction, deltas = stack.pop()
    _merge(_level(session, nested.parent), deltas)


@event.listens_for(Session, "after_transaction_end")
def _drop_rolled_back(session: Session, transaction: SessionTransaction) -> None:
    """A transaction ended with its moves still noted was rolled back: they never happened."""
    stack = session.info.get(QUEUE_DELTAS)
    if transaction.parent is None:
        session.info.pop(QUEUE_DELTAS, None)
    elif stack and stack[-1][0] is transaction:
        stack.pop()


def recount_queue(session: Session) -> dict[int, int]:
    """Set the counts to the queue itself, and return {priority: correction} where they had
    drifted from it (by a write outside the gate: a hand-edited row, a restored backup).

    The count rows are locked first, in the writers' order; a move not yet committed then
    waits behind this transaction, and its job's state is not yet visible here, so its delta,
    added after, lands on counts that are right without it. A drift is also a bug: logged by
    the caller, which runs this every `queue_recount_s` (service.scheduler.thread)."""
    counted = repo.lock_queue_counts(session)
    queued = repo.queued_by_priority(session)
    corrections = {
        priority: queued.get(priority, 0) - counted.get(priority, 0)
        for priority in counted.keys() | queued.keys()
        if queued.get(priority, 0) != counted.get(priority, 0)
    }
    repo.add_queue_counts(session, {(repo.MOVED, priority): delta for priority, delta in corrections.items()})
    return corrections
