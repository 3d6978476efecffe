"""``StepControl``: the handle of a step started with ``wait=False`` (hivemind's name).

A step moves through :class:`AveragingStage` values, in order::

    IDLE → LOOKING_FOR_GROUP → [AWAITING_TRIGGER] → RUNNING_ALLREDUCE → FINISHED
                      ↘ (deadline, failure)  ↘ (cancel)              ↘ (failure)  FAILED / CANCELLED

``AWAITING_TRIGGER`` happens only with ``require_trigger=True``: the group is formed and the
step waits for :meth:`StepControl.allow_allreduce` before streaming anything. Call it
promptly — the other members wait for this peer's parts at most ``sender_timeout``.
:meth:`StepControl.cancel` works until ``RUNNING_ALLREDUCE`` begins.

Thread-safety: every method may be called from any thread; the step itself runs on the
node's event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import threading
from collections.abc import Callable

from peer.averaging.exceptions import StepCancelled
from peer.formats.open_types import UserMetadata

__all__ = ["AveragingStage", "StepControl"]


class AveragingStage(enum.Enum):
    IDLE = "idle"
    LOOKING_FOR_GROUP = "looking_for_group"
    AWAITING_TRIGGER = "awaiting_trigger"
    RUNNING_ALLREDUCE = "running_allreduce"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


_FINAL = (AveragingStage.FINISHED, AveragingStage.FAILED, AveragingStage.CANCELLED)


class StepControl:
    """A future for one averaging step, with its stage and two levers.

    ``result(timeout=None)`` returns what ``step()`` would (a dict peer id → gathered data)
    or raises its :class:`~peer.averaging.exceptions.StepFailed` subclass.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        scheduled_time: float | None,
        weight: float,
        require_trigger: bool,
        data_for_gather: UserMetadata = None,
    ) -> None:
        self._loop = loop
        self._future: concurrent.futures.Future[dict[str, UserMetadata]] = (
            concurrent.futures.Future()
        )
        self._lock = threading.Lock()
        self._stage = AveragingStage.IDLE
        self.scheduled_time = scheduled_time
        self._weight = weight
        self.require_trigger = require_trigger
        self.data_for_gather = data_for_gather
        # loop-side events (created lazily on the loop by the step coroutine)
        self._trigger = asyncio.Event()
        self._cancel = asyncio.Event()
        self._triggered = not require_trigger
        if self._triggered:
            self._trigger.set()

    # ----------------------------------------------------------------- state

    @property
    def stage(self) -> AveragingStage:
        return self._stage

    def _set_stage(self, stage: AveragingStage) -> None:
        with self._lock:
            self._stage = stage

    @property
    def triggered(self) -> bool:
        return self._triggered

    @property
    def began_allreduce(self) -> bool:
        return self._stage in (AveragingStage.RUNNING_ALLREDUCE, AveragingStage.FINISHED) or (
            self._stage is AveragingStage.FAILED and self._ran_allreduce
        )

    _ran_allreduce = False

    @property
    def weight(self) -> float:
        return self._weight

    @weight.setter
    def weight(self, value: float) -> None:
        with self._lock:
            if self._stage in (AveragingStage.RUNNING_ALLREDUCE, *_FINAL):
                raise RuntimeError("the weight cannot change once all-reduce has begun")
            self._weight = float(value)

    # ---------------------------------------------------------------- levers

    def allow_allreduce(self) -> None:
        """Let a ``require_trigger=True`` step start its all-reduce (idempotent)."""
        self._triggered = True
        self._loop.call_soon_threadsafe(self._trigger.set)

    def cancel(self) -> bool:
        """Cancel the step if it has not begun all-reduce; returns whether it will be
        cancelled. ``result()`` then raises :class:`StepCancelled`."""
        with self._lock:
            if self._stage in (AveragingStage.RUNNING_ALLREDUCE, *_FINAL):
                return self._stage is AveragingStage.CANCELLED
            self._cancel_requested = True
        if self._loop.is_closed():
            return False
        self._loop.call_soon_threadsafe(self._cancel.set)
        return True

    _cancel_requested = False

    @property
    def cancel_requested(self) -> bool:
        return self._cancel_requested

    # ---------------------------------------------------------------- future

    def result(self, timeout: float | None = None) -> dict[str, UserMetadata]:
        return self._future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[StepControl], object]) -> None:
        self._future.add_done_callback(lambda _f: fn(self))

    def _finish(
        self, result: dict[str, UserMetadata] | None = None, error: BaseException | None = None
    ) -> None:
        if self._future.done():
            return
        if error is None:
            self._set_stage(AveragingStage.FINISHED)
            self._future.set_result({} if result is None else result)
        else:
            cancelled = isinstance(error, StepCancelled)
            self._set_stage(AveragingStage.CANCELLED if cancelled else AveragingStage.FAILED)
            self._future.set_exception(error)

    def __repr__(self) -> str:
        return f"StepControl(stage={self._stage.value}, weight={self._weight})"
