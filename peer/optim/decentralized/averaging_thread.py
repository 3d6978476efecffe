"""The background thread of :class:`peer.optim.DecentralizedOptimizer`: averaging rounds on
request (after a number of local steps) or on a clock, one at a time, counted.

A round started while the training thread steps reads and writes the averaged tensors under
the averager's lock (``concurrent_updates=True``); this thread only starts rounds, waits for
them and counts what they did. :meth:`AveragingThread.stop` cancels a round in flight.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from peer.averaging.averager import DecentralizedAverager
from peer.averaging.control import StepControl
from peer.averaging.exceptions import StepFailed
from peer.formats.open_types import UserMetadata

logger = logging.getLogger("peer.optim")

__all__ = ["AveragingThread"]


class AveragingThread:
    """Runs ``averager``'s rounds in a daemon thread named ``name``: one when
    :meth:`request` was called, and at least every ``period`` seconds if ``period > 0``.
    Each round gathers ``gather()`` (e.g. this peer's epoch) and is bounded by ``timeout``."""

    def __init__(
        self,
        averager: DecentralizedAverager,
        *,
        name: str,
        period: float,
        timeout: float | None,
        gather: Callable[[], UserMetadata],
        verbose: bool = False,
    ) -> None:
        self.averager = averager
        self.period = period
        self.timeout = timeout
        self.gather = gather
        self.verbose = verbose
        self.rounds_done = 0  # rounds that finished (tensors averaged)
        self.rounds_failed = 0
        self.last_group: tuple[str, ...] = ()  # peer ids of the last successful round
        self.current: StepControl | None = None  # the round in flight
        self._changed = threading.Condition()
        self._wanted = threading.Event()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def request(self) -> None:
        """Ask for a round now; one asked for while a round runs is served by the next."""
        self._wanted.set()

    def wait_for(self, count: int, timeout: float | None = None) -> bool:
        """Wait until ``rounds_done >= count``; False on timeout or once stopped."""
        with self._changed:
            return self._changed.wait_for(
                lambda: self.rounds_done >= count or self._stop.is_set(), timeout
            ) and (self.rounds_done >= count)

    def stop(self) -> None:
        """Stop the thread, cancelling the round in flight, and wake every waiter; then
        shut the averager down (which ends a round already streaming) and :meth:`join`."""
        self._stop.set()
        self._wanted.set()
        control = self.current
        if control is not None:
            control.cancel()
        with self._changed:
            self._changed.notify_all()

    def join(self, timeout: float) -> None:
        self.thread.join(timeout=timeout)

    def _loop(self) -> None:
        last_start = time.monotonic()
        while not self._stop.is_set():
            period = self.period
            wait = None if period <= 0 else max(0.0, last_start + period - time.monotonic())
            self._wanted.wait(wait)
            if self._stop.is_set():
                return
            self._wanted.clear()
            last_start = time.monotonic()
            self._average_once()

    def _average_once(self) -> None:
        try:
            control = self.averager.step(wait=False, timeout=self.timeout, gather=self.gather())
            assert isinstance(control, StepControl)  # wait=False always returns one
            self.current = control
            gathered = control.result()
        except StepFailed as exc:
            with self._changed:
                self.rounds_failed += 1
                self._changed.notify_all()
            if not self._stop.is_set():
                logger.log(
                    logging.INFO if self.verbose else logging.DEBUG,
                    "averaging round failed: %s",
                    exc,
                )
            return
        finally:
            self.current = None
        with self._changed:
            self.rounds_done += 1
            self.last_group = tuple(sorted(gathered))
            self._changed.notify_all()
        if self.verbose:
            logger.info("averaged with %d peers", len(gathered))
