"""Progress reports waiting for the coordinator: a bounded queue that never drops silently.

Pure bookkeeping (no I/O, no clock): :class:`~peer.coordinator.session.CoordinatorSession`
adds reports as training produces them and sends them, oldest first, when the coordinator
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
from typing import Any

SUMMED_FIELDS = ("rounds_done", "rounds_failed")
# The coordinator refuses a report whose loss or metric is beyond this either way: such a
# value (a diverging run) is sent as unknown instead, the loss with ``loss_nan``.
MAX_ABS_VALUE = 1e6
MAX_FAILURE_CHARS = 64
_FAILURE_CHAR = re.compile(r"[^A-Za-z0-9_.:-]")


def merge_reports(older: Mapping[str, Any], newer: Mapping[str, Any]) -> dict[str, Any]:
    """One report standing for ``older`` then ``newer``."""
    merged = dict(older)
    merged.update((k, v) for k, v in newer.items() if v is not None)
    for name in SUMMED_FIELDS:
        if name in older or name in newer:
            merged[name] = int(older.get(name) or 0) + int(newer.get(name) or 0)
    return merged


def clean_report(fields: Mapping[str, Any]) -> dict[str, Any]:
    """``fields`` as the coordinator accepts them: a NaN or infinite ``loss`` or
    ``eval_metric``, or one beyond ±:data:`MAX_ABS_VALUE`, becomes None (unknown; for the
    loss, ``loss_nan`` says so), a NaN or infinite ``samples_per_second`` 0, and ``failure``
    is cut to 64 characters of ``[A-Za-z0-9_.:-]``. A report the coordinator would refuse
    would lose its rounds."""
    if not isinstance(fields, Mapping):
        raise TypeError("a progress report is a mapping of field names to values")
    report = dict(fields)
    for name in ("loss", "eval_metric"):
        value = report.get(name)
        if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= MAX_ABS_VALUE):
            report[name] = None
            if name == "loss":
                report["loss_nan"] = True  # what the organizer's dashboard alerts on
    speed = report.get("samples_per_second")
    if isinstance(speed, float) and not math.isfinite(speed):
        report["samples_per_second"] = 0.0
    failure = report.get("failure")
    if failure is not None:
        report["failure"] = _FAILURE_CHAR.sub("_", str(failure))[:MAX_FAILURE_CHARS]
    return report


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
        self._items: list[dict[str, Any]] = []
        self._in_flight = 0
        self.merges = 0  # how many times two reports became one

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def add(self, report: Mapping[str, Any]) -> None:
        """Append ``report``; when the queue is full, first merge its two oldest reports
        that are not in flight (the newest waiting one with ``report`` if only one waits)."""
        report = dict(report)
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

    def peek_batch(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Copies of the oldest reports (up to ``limit``), now in flight until :meth:`ack`.
        A new call replaces the previous batch (after a failed send, say)."""
        if limit is not None and limit < 1:
            raise ValueError("limit must be >= 1")
        n = min(len(self._items), self.max_reports - 1, limit or len(self._items))
        self._in_flight = n
        return [dict(r) for r in self._items[:n]]

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
        optimizer: Any,
        *,
        samples: int,
        samples_per_second: float,
        loss: float | None,
        eval_metric: float | None = None,
        compute_utilisation: float | None = None,
    ) -> dict[str, Any]:
        """The report's fields; ``compute_utilisation`` is the share of the training loop's
        time spent computing since the previous report (:mod:`peer.optim.utilisation`), and
        the bytes the optimizer's node has sent go along (a counter beside ``samples``)."""
        rounds = (int(optimizer.rounds_done), int(optimizer.rounds_failed))
        node = getattr(optimizer, "node", None)
        fields = {
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
