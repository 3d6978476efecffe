"""Progress reports waiting for the coordinator: a bounded queue that never drops silently.

Pure bookkeeping (no I/O, no clock): :class:`~peer.coordinator.session.CoordinatorSession`
turns the fields training produces into a :class:`~peer.formats.requests.ReportCreate`
(:func:`clean_report`), queues it and sends the queue, oldest first, when the coordinator
answers. While it does not, memory stays bounded: when the queue is full, its two oldest
reports waiting to be sent are merged into one (:func:`merge_reports`) — the gauges and
cumulative counters (``epoch``, ``samples``, ``samples_per_second``, ...) of the newer, the
per-report counts (``rounds_done``, ``rounds_failed``) summed, optional values (``loss``,
``failure``, ...) of the newer unless it has none — so the coordinator's totals stay right.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Protocol, TypedDict

from peer.formats.requests import (
    FAILURE_CHARACTERS,
    MAX_ABS_LOSS,
    MAX_FAILURE_LENGTH,
    MAX_INT,
    ReportCreate,
)

SUMMED_FIELDS = ("rounds_done", "rounds_failed")


class ReportFields(TypedDict, total=False):
    """A report's fields as training counts them, before :func:`clean_report`: those of
    :class:`~peer.formats.requests.ReportCreate`, any of them None (not sent), a loss or
    rate possibly NaN or infinite."""

    epoch: int
    samples: int
    samples_per_second: float
    loss: float | None
    loss_nan: bool
    group_size: int | None
    rounds_done: int
    rounds_failed: int
    failure: str | None
    eval_metric: float | None
    bytes_sent: int | None
    compute_utilisation: float | None


class ReportingOptimizer(Protocol):
    """What :class:`OptimizerReports` reads of a collaborative optimizer (``peer.Optimizer``,
    ``peer.DiLoCo``); its ``node``, when it has one, gives ``bytes_sent``."""

    @property
    def local_epoch(self) -> int: ...

    @property
    def rounds_done(self) -> int: ...

    @property
    def rounds_failed(self) -> int: ...

    @property
    def last_group_size(self) -> int | None: ...

    @property
    def last_failure(self) -> str | None: ...


_FAILURE_CHAR = re.compile(rf"[^{FAILURE_CHARACTERS}]")


def merge_reports(older: ReportCreate, newer: ReportCreate) -> ReportCreate:
    """One report standing for ``older`` then ``newer``: what ``newer`` sets (and is not
    None) over ``older``, the per-report counts summed (at most ``MAX_INT``)."""
    merged = older.model_dump(exclude_unset=True)
    merged.update(
        (name, value)
        for name, value in newer.model_dump(exclude_unset=True).items()
        if value is not None
    )
    for name in SUMMED_FIELDS:
        if name in older.model_fields_set or name in newer.model_fields_set:
            merged[name] = min(MAX_INT, getattr(older, name) + getattr(newer, name))
    return ReportCreate.model_validate(merged)


def clean_report(fields: ReportFields) -> ReportCreate:
    """``fields`` (as training counts them) as a report the coordinator accepts: a NaN or infinite ``loss`` or ``eval_metric``, or
    one past the coordinator's ±``MAX_ABS_LOSS``, becomes None (unknown; for the loss,
    ``loss_nan`` says so), a NaN or infinite ``samples_per_second`` 0, and ``failure`` is cut
    to the characters and length the report allows — a report the coordinator would refuse
    would lose its rounds. Fields that are None stay unset. ``TypeError`` for ``fields``
    that are not a mapping; ``ValueError`` (pydantic's ``ValidationError``) for values no
    report may carry (a negative epoch, an unknown field, ...)."""
    if not isinstance(fields, Mapping):
        raise TypeError("a progress report is a mapping of field names to values")
    report: dict[str, object] = dict(fields)
    for name in ("loss", "eval_metric"):
        value = report.get(name)
        if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= MAX_ABS_LOSS):
            report[name] = None
            if name == "loss":
                report["loss_nan"] = True  # what the organizer's dashboard alerts on
    speed = report.get("samples_per_second")
    if isinstance(speed, float) and not math.isfinite(speed):
        report["samples_per_second"] = 0.0
    failure = report.get("failure")
    if failure is not None:
        report["failure"] = _FAILURE_CHAR.sub("_", str(failure))[:MAX_FAILURE_LENGTH]
    return ReportCreate.model_validate({k: v for k, v in report.items() if v is not None})


class ReportQueue:
    """Reports in the order they were made, at most ``max_reports`` of them.

    :meth:`peek_batch` hands out the oldest ones to send and keeps them apart ("in
    flight") until :meth:`ack` says how many the coordinator took; merging never touches
    reports in flight, so an acknowledged report is exactly one that was sent. A batch
    holds at most ``max_reports - 1`` reports: there is always room to merge.
    """

    def __init__(self, max_reports: int = 256) -> None:
        if not isinstance(max_reports, int) or max_reports < 2:
            raise ValueError("max_reports must be an integer >= 2")
        self.max_reports = max_reports
        self._items: list[ReportCreate] = []
        self._in_flight = 0
        self.merges = 0  # how many times two reports became one

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def add(self, report: ReportCreate) -> None:
        """Append ``report``; when the queue is full, first merge its two oldest reports
        that are not in flight (the newest waiting one with ``report`` if only one waits)."""
        items = self._items
        if len(items) < self.max_reports:
            items.append(report)
            return
        self.merges += 1
        first = self._in_flight
        if len(items) - first >= 2:
            items[first : first + 2] = [merge_reports(items[first], items[first + 1])]
            items.append(report)
        else:
            items[-1] = merge_reports(items[-1], report)

    def peek_batch(self, limit: int | None = None) -> list[ReportCreate]:
        """The oldest reports (up to ``limit``), now in flight until :meth:`ack`. A new call
        replaces the previous batch (after a failed send, say). Reports are never changed
        in place: a merge makes a new one."""
        if limit is not None and limit < 1:
            raise ValueError("limit must be >= 1")
        n = min(len(self._items), self.max_reports - 1, limit or len(self._items))
        self._in_flight = n
        return self._items[:n]

    def ack(self, n: int) -> None:
        """The coordinator took the ``n`` oldest reports of the batch in flight."""
        if not 0 <= n <= self._in_flight:
            raise ValueError(f"can acknowledge 0 to {self._in_flight} reports, not {n}")
        del self._items[:n]
        self._in_flight -= n


class OptimizerReports:
    """The fields of a progress report from a collaborative optimizer's counters; its
    averaging rounds are sent as counts since the previous report (they are summed)."""

    def __init__(self) -> None:
        self._rounds = (0, 0)

    def fields(
        self,
        optimizer: ReportingOptimizer,
        *,
        samples: int,
        samples_per_second: float,
        loss: float | None,
        eval_metric: float | None = None,
        compute_utilisation: float | None = None,
    ) -> ReportFields:
        """The report's fields; ``compute_utilisation`` is the share of the training loop's
        time spent computing since the previous report (:mod:`peer.optim.utilisation`), and
        the bytes the optimizer's node has sent go along (a counter beside ``samples``)."""
        rounds = (int(optimizer.rounds_done), int(optimizer.rounds_failed))
        node = getattr(optimizer, "node", None)
        fields: ReportFields = {
            "epoch": optimizer.local_epoch,
            "samples": samples,
            "samples_per_second": samples_per_second,
            "loss": loss,
            "group_size": optimizer.last_group_size,
            "rounds_done": rounds[0] - self._rounds[0],
            "rounds_failed": rounds[1] - self._rounds[1],
            "failure": optimizer.last_failure,
            "eval_metric": eval_metric,
            "bytes_sent": None if node is None else int(node.bytes_sent),
            "compute_utilisation": compute_utilisation,
        }
        self._rounds = rounds
        return fields
