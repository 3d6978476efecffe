"""The averaged tensors as an averager's rounds use them: their lock, and the flat buffer a
round averages.

By default a round holds the lock throughout and averages in place
(:meth:`AveragedTensors.in_place`): directly in the tensors' memory when laid out back to
back, else through one flat copy written back at the end (:meth:`AveragedTensors.copy_back`).
With ``concurrent_updates=True`` a round averages a snapshot
(:meth:`AveragedTensors.snapshot`) and adds ``alpha · (average - snapshot)`` back at the end
(:meth:`AveragedTensors.apply`), so updates made during the round are kept. Buffers are
reused across rounds; the averager decides when to run a round.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator, Sequence

import torch

from peer.averaging.allreduce.partition import FlatLayout

__all__ = ["AveragedTensors"]


class AveragedTensors:
    """An averager's tensors, their lock and its rounds' buffers. The tensors are those
    given, never copied.

    By default (as in hivemind) a round holds the tensors' lock from the start of its
    all-reduce to the end and averages them in place (:meth:`AveragedTensors.in_place`),
    reading and writing their memory directly when they are laid out back to back (one tensor,
    or views of one flat buffer) and through one flat copy otherwise, written back at the end
    (:meth:`AveragedTensors.copy_back`, whether the round finished or not: each element then
    holds either its local value or its group's average). With ``concurrent_updates=True`` a
    round instead averages a snapshot (:meth:`AveragedTensors.snapshot`) and adds ``alpha ·
    (average - snapshot)`` back at the end (:meth:`AveragedTensors.apply`), so the lock is held
    only for two copies and updates made to the tensors during the round are kept (the
    optimizers use this to train while averaging in the background); it costs two more passes
    over the tensors and a snapshot's memory.

    The snapshot or copy and the reducer's accumulator are buffers reused across rounds. Tensor
    arithmetic and locking only: the averager decides when, and runs the round.
    """

    def __init__(self, tensors: tuple[torch.Tensor, ...], layout: FlatLayout) -> None:
        self.tensors = tensors
        self.layout = layout
        self._lock = threading.RLock()
        self._round_holds_lock = False  # an in-place round holds _lock (loop thread)
        self._flat: torch.Tensor | None = None  # flat snapshot or copy, then deltas (reused)
        self._acc: torch.Tensor | None = None  # reducer accumulator (reused)

    # ------------------------------------------------------------------- locking

    @contextlib.contextmanager
    def hold(self) -> Iterator[Sequence[torch.Tensor]]:
        """The tensors, locked against a round's writes (blocking: for other threads)."""
        with self._lock:
            yield self.tensors

    @contextlib.asynccontextmanager
    async def locked(self) -> AsyncIterator[None]:
        """The lock, taken on the event loop without blocking it."""
        # never block the event loop on a lock a training thread holds; and the lock is
        # reentrant, so code on the loop (a state donor's snapshot) must also wait for an
        # in-place round that holds it, rather than read half-averaged tensors
        while self._round_holds_lock or not self._lock.acquire(blocking=False):  # noqa: ASYNC110
            await asyncio.sleep(0.001)
        try:
            yield
        finally:
            self._lock.release()

    @contextlib.asynccontextmanager
    async def held_for_round(self) -> AsyncIterator[None]:
        """The lock for a whole in-place round: code on the loop waits for it to end."""
        async with self.locked():
            self._round_holds_lock = True
            try:
                yield
            finally:
                self._round_holds_lock = False

    # ------------------------------------------------------------ round buffers

    def snapshot(self) -> torch.Tensor:
        """A flat copy of the tensors, in a buffer reused across rounds (lock held)."""
        return self.layout.flatten(self.tensors, out=self._flat_buffer())

    def in_place(self, *, auxiliary: bool) -> tuple[torch.Tensor, bool]:
        """The flat buffer an in-place round averages (lock held for the round), and
        whether it must be written back with :meth:`copy_back`: the tensors' own memory
        when laid out back to back, else a flat copy. An auxiliary peer reduces the others'
        parts on a copy and keeps its own tensors as they were (as hivemind's does): weight
        0, nothing of the round is theirs."""
        alias = None if auxiliary else self.layout.alias(self.tensors)
        copy_back = alias is None and not auxiliary
        if alias is None:
            return self.layout.flatten(self.tensors, out=self._flat_buffer()), copy_back
        return alias, copy_back

    def copy_back(self, flat: torch.Tensor) -> None:
        """Write an in-place round's flat copy back into the tensors (lock held)."""
        with torch.no_grad():
            for tensor, view in zip(self.tensors, self.layout.views(flat), strict=True):
                tensor.copy_(view)

    def apply(self, deltas: torch.Tensor, alpha: float) -> None:
        """Add ``alpha ·`` a snapshot round's ``average - snapshot`` to the tensors (lock
        held)."""
        with torch.no_grad():
            for tensor, delta in zip(self.tensors, self.layout.views(deltas), strict=True):
                if alpha:
                    tensor.add_(delta.to(tensor.dtype), alpha=alpha)

    def accumulator(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The reducer's accumulator, reused across rounds while large enough."""
        buffer = self._acc
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
            buffer = self._acc = torch.empty(numel, dtype=dtype)
        return buffer[:numel]

    def _flat_buffer(self) -> torch.Tensor:
        if self._flat is None:
            self._flat = torch.empty(self.layout.total, dtype=self.layout.dtype)
        return self._flat
