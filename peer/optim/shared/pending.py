"""An optimizer's background work: at most one run in flight, and the round it is in.

:class:`peer.Optimizer` (an epoch's delayed phases) and DiLoCo (a sync's overlapped round)
each run at most one piece of work in a background thread; the training thread applies what
it produced once it has finished. :class:`Pending` holds that run and the averaging round
running now (inline or in the background), and settles the run: waits for it, or calls it
off, then has the owner apply it. Training thread, except :meth:`Pending.interrupt`.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from peer.averaging.control import StepControl

__all__ = ["BackgroundRun", "Pending"]


class BackgroundRun(Protocol):
    """What a run needs for :class:`Pending`: a flag that stops it at its next stage, and
    the future of the thread running it."""

    cancelled: bool
    future: concurrent.futures.Future[None] | None


RunT = TypeVar("RunT", bound=BackgroundRun)


class Pending(Generic[RunT]):
    def __init__(self) -> None:
        self.run: RunT | None = None  # the background run not applied yet
        self.round: StepControl | None = None  # the averaging round in flight, if any
        # set by interrupt(): the rounds of the epoch under way are called off too (the
        # optimizer clears it when its next epoch begins)
        self.interrupted = False

    @property
    def landed(self) -> bool:
        """A background run has finished and waits to be applied."""
        run = self.run
        return run is not None and run.future is not None and run.future.done()

    def interrupt(self) -> None:
        """Call off the averaging round in flight, and the rounds of the epoch under way that
        have not begun; safe from any thread."""
        self.interrupted = True
        control = self.round
        if control is not None:
            control.cancel()

    def call_off(self) -> None:
        """Stop the background run at its next stage and its round now (its result is
        still applied when settled: a stage it finished may have changed the state)."""
        if self.run is not None:
            self.run.cancelled = True
        self.interrupt()

    def settle(
        self,
        apply: Callable[[RunT], None],
        *,
        cancel: bool = False,
        timeout: float | None = None,
    ) -> bool:
        """Wait for the background run (with ``cancel``, call it off first) and ``apply``
        it, even a cancelled one. False if it is still running after ``timeout``."""
        run = self.run
        if run is None:
            return True
        if cancel:
            self.call_off()
        assert run.future is not None
        try:
            run.future.result(timeout)
        except concurrent.futures.TimeoutError:
            return False
        finally:
            if run.future.done():
                self.run = None
        apply(run)
        return True
