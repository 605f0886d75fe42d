"""`depends_on` (contract §10): jobs that wait for jobs.

A dependency names a job that exists when the dependant is submitted, so no cycle can ever
form (a job cannot name one not yet created: that is a `422`, as is another user's job). The
scheduler keeps a waiting job out of its plan with a `pending_reason` naming what it waits
for, and fails it once a condition can no longer hold; a cancel fails the dependants at once,
in its own transaction, and so on down the chain.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy.orm import Session

from service.checkpoints import repository as checkpoints_repo
from service.errors import InvalidSpec
from service.jobs import repository as repo
from service.jobs.spec import JobSpec
from service.jobs.states import QUEUED, lock_job, transition_job
from service.models import Job, JobDependency, User
from service.states import JOB_TERMINAL, JobState

NEVER_SUCCEEDS = frozenset({JobState.FAILED, JobState.CANCELLED, JobState.CANCELLING})


def check_dependencies(session: Session, spec: JobSpec, user: User) -> None:
    """Each named job exists and is the caller's (for the admin too). One that can no longer
    meet its condition is no error in the spec: the job is taken, and fails at once
    (`add_dependencies`), with an `error` naming it, as contract §10 says."""
    if not spec.depends_on:
        return
    ids = [d.job_id for d in spec.depends_on]
    found = repo.states_and_owners(session, ids)
    for i, dep in enumerate(spec.depends_on):
        row = found.get(dep.job_id)
        if row is None or row.owner_id != user.id:  # another user's, the admin's own too (contract §10)
            raise InvalidSpec(
                ("depends_on", i, "job_id"), "no such job (a dependency names one of your existing jobs)"
            )


def resumes_from_dependency(spec: JobSpec) -> bool:
    """`resume_from: {job_id: X}` with X among the dependencies: X's final checkpoint, taken
    when the job is placed (it may not exist yet at submit)."""
    ref = spec.resume_from
    return ref is not None and ref.job_id is not None and ref.job_id in {d.job_id for d in spec.depends_on}


def add_dependencies(session: Session, job: Job, spec: JobSpec) -> None:
    """The job's dependencies; when one already failed or was cancelled, the job fails now, in
    the submit's transaction, as a cancel fails the jobs waiting on it."""
    repo.add_dependency_rows(
        session,
        (
            JobDependency(job_id=job.id, depends_on_id=d.job_id, condition=d.condition)
            for d in spec.depends_on
        ),
    )
    session.flush()
    fail_doomed(session, readiness(session, [job.id]).doomed)


@dataclass
class Readiness:
    """The queued jobs that must not be planned now: waiting (why), or doomed (why)."""

    waiting: dict[int, str] = field(default_factory=dict)
    doomed: dict[int, str] = field(default_factory=dict)


def readiness(session: Session, queued_ids: list[int]) -> Readiness:
    """One query for every dependency of the queued jobs, joined to the state it waits on."""
    result = Readiness()
    if not queued_ids:
        return result
    for job_id, other, condition, state in repo.dependencies_of(session, queued_ids):
        if job_id in result.doomed:
            continue
        if condition == "succeeded" and state in NEVER_SUCCEEDS:
            result.waiting.pop(job_id, None)
            result.doomed[job_id] = (
                f"dependency job {other} {state}: the condition 'succeeded' can never hold"
            )
        elif not _holds(condition, state) and job_id not in result.waiting:
            word = "succeed" if condition == "succeeded" else "end"
            result.waiting[job_id] = f"waits for job {other} to {word} (it is {state})"
    return result


def _holds(condition: str, state: str) -> bool:
    return state == JobState.SUCCEEDED if condition == "succeeded" else state in JOB_TERMINAL


def fail_doomed(session: Session, doomed: dict[int, str]) -> None:
    """Queued jobs that can never run fail, and the chain behind each of them with it."""
    for job_id, reason in doomed.items():
        job = lock_job(session, job_id)
        if job is not None and job.state == QUEUED:
            job.error = reason
            transition_job(session, job, JobState.FAILED, reason)
            fail_dependants(session, job_id, "failed")


def fail_dependants(session: Session, job_id: int, what: str) -> None:
    """`job_id` will never succeed (`what` says why): every queued job that needs it to
    succeed fails now, and so does every job waiting on those."""
    todo = [(job_id, what)]
    while todo:
        failed_id, why = todo.pop()
        # in id order: every writer locks jobs in id order, so no deadlock cycle
        for dependant in repo.dependants_needing_success(session, failed_id):
            job = lock_job(session, dependant)
            if job is None or job.state != QUEUED:
                continue
            reason = f"dependency job {failed_id} {why}: the condition 'succeeded' can never hold"
            job.error = reason
            transition_job(session, job, JobState.FAILED, reason)
            todo.append((dependant, "failed"))


def take_dependency_checkpoint(session: Session, job: Job) -> str | None:
    """At placement, a job resuming from a dependency gets that job's final checkpoint; the
    reason it cannot run when there is none."""
    ref = job.resume_from or {}
    other = ref.get("job_id")
    if other is None or job.resume_checkpoint_id is not None or ref.get("checkpoint_id") is not None:
        return None
    latest = checkpoints_repo.latest_id_of_job(session, other)
    if latest is None:
        return f"dependency job {other} left no checkpoint to resume from"
    job.resume_checkpoint_id = latest
    return None
