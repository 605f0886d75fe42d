"""Metric series and sweep rungs (contract §13).

A report is one row of `metric_points` (its numbers as one JSON object), keyed by the job and
the `seq` of the progress event it came with: a job's series is one range read of the primary
key, however many names it holds. `metric_names` lists each job's names once, so that
`names` costs one small read. `sweep_rungs` holds the ASHA values of a sweep, one per child
and rung: the first one recorded stays (a retried child does not vote twice).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, Float, Integer, String
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from service.models.base import Base, UTCDateTime, utcnow


class MetricPoint(Base):
    __tablename__ = "metric_points"

    job_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    attempt: Mapped[int] = mapped_column(Integer)
    step: Mapped[int | None] = mapped_column(Integer)
    epoch: Mapped[int | None] = mapped_column(Integer)
    ts: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # jsonb on PostgreSQL: `?names=` picks a few names out of each point without parsing it
    # (migration 0019; 3x faster than `->>` on json text for 100,000 points of 20 names)
    values: Mapped[dict[str, float]] = mapped_column(JSON().with_variant(JSONB(), "postgresql"))
    # the value of the job's sweep objective in this report, when it has one: rungs read it
    objective: Mapped[float | None] = mapped_column(Float)


class MetricName(Base):
    __tablename__ = "metric_names"

    job_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    name: Mapped[str] = mapped_column(String(64), primary_key=True)


class SweepRung(Base):
    __tablename__ = "sweep_rungs"

    parent_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    rung: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    child_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    epoch: Mapped[int] = mapped_column(Integer)  # the epoch of the report whose value it is
    value: Mapped[float] = mapped_column(Float)
    verdict: Mapped[str] = mapped_column(String(16))  # "continue" | "stop" | "waiting"
    recorded_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
