"""The report queue and report clean-up: pure logic, no I/O."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from peer.coordinator.reports import ReportQueue, clean_report, merge_reports
from peer.formats.requests import MAX_INT, ReportCreate


def fields(i: int, **extra: Any) -> dict[str, Any]:
    return {
        "epoch": i,
        "samples": 100 * i,
        "samples_per_second": float(i),
        "rounds_done": 1,
        "rounds_failed": 0,
        **extra,
    }


def report(i: int, **extra: Any) -> ReportCreate:
    return clean_report(fields(i, **extra))


def test_merge_takes_gauges_from_the_newer_sums_rounds_and_keeps_the_latest_failure() -> None:
    older = report(1, loss=2.0, rounds_done=3, rounds_failed=1, failure="AllreduceTimeout")
    newer = report(2, loss=None, rounds_done=4, rounds_failed=0, failure=None, eval_metric=0.5)
    merged = merge_reports(older, newer)
    assert merged.model_dump(exclude_unset=True) == {
        "epoch": 2,
        "samples": 200,
        "samples_per_second": 2.0,
        "rounds_done": 7,
        "rounds_failed": 1,
        "failure": "AllreduceTimeout",  # the newer window had no failure: the last one stays
        "loss": 2.0,  # the newer window had no loss yet: the last known one
        "eval_metric": 0.5,
    }
    assert merge_reports(older, report(3, failure="NonFiniteTensors")).failure == (
        "NonFiniteTensors"
    )


def test_merge_keeps_a_nan_loss_the_newer_does_not_contradict() -> None:
    older = report(1, loss=math.nan)
    assert merge_reports(older, report(2)).loss_nan
    assert not merge_reports(older, report(2, loss=0.5, loss_nan=False)).loss_nan


def test_merged_rounds_saturate() -> None:
    merged = merge_reports(report(1, rounds_done=MAX_INT), report(2, rounds_done=5))
    assert merged.rounds_done == MAX_INT


def test_queue_keeps_order_and_acks_the_oldest() -> None:
    queue = ReportQueue(max_reports=8)
    for i in range(3):
        queue.add(report(i))
    assert [r.epoch for r in queue.peek_batch()] == [0, 1, 2]
    queue.ack(2)
    assert [r.epoch for r in queue.peek_batch()] == [2]
    queue.ack(1)
    assert not queue and queue.peek_batch() == []


def test_full_queue_merges_its_two_oldest() -> None:
    queue = ReportQueue(max_reports=3)
    for i in range(5):
        queue.add(report(i))
    batch = queue.peek_batch()
    assert len(queue) == 3 and queue.merges == 2
    assert [r.epoch for r in batch] == [2, 3, 4][: len(batch)]
    assert batch[0].rounds_done == 3  # reports 0, 1 and 2 in one


def test_reports_in_flight_are_never_merged() -> None:
    """A report handed out for sending is acknowledged as itself, even if the queue filled
    up meanwhile: merges happen among the waiting ones only."""
    queue = ReportQueue(max_reports=3)
    queue.add(report(0))
    queue.add(report(1))
    assert [r.epoch for r in queue.peek_batch()] == [0, 1]  # both in flight
    for i in range(2, 6):
        queue.add(report(i))  # one waits; each new one merges into it
    assert len(queue) == 3
    queue.ack(2)  # epochs 0 and 1 were taken
    (rest,) = queue.peek_batch()
    assert rest.epoch == 5 and rest.rounds_done == 4


def test_a_batch_leaves_room_to_merge() -> None:
    queue = ReportQueue(max_reports=2)
    queue.add(report(0))
    queue.add(report(1))
    assert len(queue.peek_batch()) == 1
    queue.add(report(2))
    assert len(queue) == 2 and queue.peek_batch(1)[0].epoch == 0


def test_caller_mistakes() -> None:
    with pytest.raises(ValueError, match="max_reports"):
        ReportQueue(1)
    queue = ReportQueue()
    queue.add(report(0))
    with pytest.raises(ValueError, match="acknowledge 0 to 0"):
        queue.ack(1)
    queue.peek_batch()
    with pytest.raises(ValueError):
        queue.ack(2)
    with pytest.raises(ValueError, match="limit"):
        queue.peek_batch(0)


def test_clean_report_makes_values_the_coordinator_accepts() -> None:
    cleaned = clean_report(
        fields(1, loss=math.nan, eval_metric=math.inf, failure="peer.X: bad thing!" * 10)
        | {"samples_per_second": math.inf}
    )
    assert cleaned.loss is None and cleaned.eval_metric is None and cleaned.loss_nan
    assert cleaned.samples_per_second == 0.0
    assert cleaned.failure is not None
    assert len(cleaned.failure) == 64 and cleaned.failure.startswith("peer.X:_bad_thing_")
    assert report(1, loss=1.5).loss == 1.5
    diverged = report(1, loss=-3e6, eval_metric=1e7)
    assert (diverged.loss, diverged.loss_nan, diverged.eval_metric) == (None, True, None)
    # None is unset: not sent, and not taken over an older value by a merge
    assert "loss" not in report(1, loss=None).model_fields_set
    with pytest.raises(TypeError):
        clean_report([("epoch", 1)])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [{"epoch": -1}, {"group_size": 0}, {"colour": "blue"}, {"samples": MAX_INT + 1}],
)
def test_clean_report_refuses_what_no_report_may_carry(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        clean_report(fields(1) | bad)


# One step of a producer and a sender: add a report, take a batch, acknowledge part of it.
steps = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 5), st.integers(0, 3)),
        st.tuples(st.just("peek"), st.integers(1, 10), st.just(0)),
        st.tuples(st.just("ack"), st.integers(0, 10), st.just(0)),
    ),
    max_size=200,
)


@given(st.integers(2, 12), steps)
def test_rounds_are_never_lost_and_the_queue_stays_bounded(
    bound: int, ops: list[tuple[str, int, int]]
) -> None:
    queue = ReportQueue(bound)
    added = [0, 0]
    acked = [0, 0]
    batch: list[ReportCreate] = []
    seen: list[int] = []  # epochs in the order the coordinator took them
    epoch = 0
    for op, a, b in ops:
        if op == "add":
            epoch += 1
            queue.add(report(epoch, rounds_done=a, rounds_failed=b))
            added[0] += a
            added[1] += b
        elif op == "peek":
            batch = queue.peek_batch(a)
        else:
            n = min(a, queue.in_flight)
            for r in batch[:n]:
                acked[0] += r.rounds_done
                acked[1] += r.rounds_failed
                seen.append(r.epoch)
            queue.ack(n)
            batch = batch[n:]
        assert len(queue) <= bound
        assert queue.in_flight <= len(queue)
    everything = queue.peek_batch()
    while everything:
        for r in everything:
            acked[0] += r.rounds_done
            acked[1] += r.rounds_failed
            seen.append(r.epoch)
        queue.ack(len(everything))
        everything = queue.peek_batch()
    assert acked == added
    # in order, and what was added last is what the coordinator sees last
    assert seen == sorted(set(seen))
    assert seen[-1:] == ([epoch] if epoch else [])
