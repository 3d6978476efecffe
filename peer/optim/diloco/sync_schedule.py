"""DiLoCo's schedule, without I/O: fragments, when each syncs, whom to wait for, timeouts.

Pure pieces of :class:`peer.DiLoCo` (:mod:`peer.optim.diloco.outer`), tested without a swarm.
*Syncs* are numbered ``0, 1, 2, ...`` across the run: sync ``k`` averages fragment
``k % F`` (:func:`fragment_of`) after :func:`steps_before_sync` inner steps, so every
fragment syncs once every ``H`` inner steps and only ``1/F`` of the model is in flight at a
time (Streaming DiLoCo, arXiv:2501.18512; with ``F = 1``, DiLoCo, arXiv:2311.08105).
:func:`split_fragments` cuts the parameters into fragments, :func:`stragglers` names the
peers still worth waiting for before a round, :class:`RoundTimer` sets round timeouts.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from peer.optim.shared.progress import ProgressReport

__all__ = [
    "RoundTimer",
    "fragment_of",
    "split_fragments",
    "steps_before_sync",
    "stragglers",
]


def split_fragments(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """The indices of the tensors (``sizes``: their element counts) in each of ``fragments``
    fragments: consecutive tensors, each fragment non-empty, cut where the running total
    crosses a multiple of ``total / fragments`` (so fragments are about equally large
    when no tensor dominates). ``ValueError`` for fewer tensors than fragments."""
    if not isinstance(fragments, int) or isinstance(fragments, bool) or fragments < 1:
        raise ValueError("fragments must be a positive integer")
    if len(sizes) < fragments:
        raise ValueError(
            f"{fragments} fragments need at least as many parameter tensors; there are {len(sizes)}"
        )
    total = sum(sizes)
    out: list[list[int]] = [[]]
    running = 0
    for i, size in enumerate(sizes):
        to_open = fragments - len(out)
        # open the next fragment when the rest of the tensors are needed one each, or when
        # this tensor lies mostly past the current fragment's share of the total
        if (
            out[-1]
            and to_open
            and (len(sizes) - i == to_open or running + size / 2 > total * len(out) / fragments)
        ):
            out.append([])
        out[-1].append(i)
        running += size
    return out


def _boundary(sync: int, inner_steps: int, fragments: int) -> int:
    """Inner steps from the start of the run to sync ``sync - 1``'s end (``sync >= 0``)."""
    return (sync * inner_steps) // fragments


def steps_before_sync(sync: int, inner_steps: int, fragments: int) -> int:
    """How many inner steps come between sync ``sync - 1`` and sync ``sync``: about
    ``inner_steps / fragments``, so that each fragment syncs every ``inner_steps``."""
    if sync < 0:
        raise ValueError("sync numbers start at 0")
    return _boundary(sync + 1, inner_steps, fragments) - _boundary(sync, inner_steps, fragments)


def fragment_of(sync: int, fragments: int) -> int:
    """The fragment that sync ``sync`` averages."""
    return sync % fragments


def stragglers(
    reports: Iterable[ProgressReport],
    *,
    me: str,
    sync: int,
    target_steps: float,
    now: float,
    stale_after: float,
) -> list[str]:
    """The peers this one waits for before sync ``sync``'s round: at that sync, fewer than
    ``target_steps`` inner steps done, and reporting within ``stale_after`` seconds of
    ``now`` (a live peer reports every step; one that stopped is presumed dead)."""
    return sorted(
        r.peer_id
        for r in reports
        if r.peer_id != me
        and r.epoch == sync
        and r.done_at_epoch < target_steps
        and now - r.time <= stale_after
    )


@dataclass
class RoundTimer:
    """A round's timeout from the swarm's recent rounds: ``factor`` times the slowest of the
    last ``window`` rounds that succeeded, at least ``floor`` and at most ``ceiling``
    seconds. Before any round is measured it is ``ceiling``; each round that timed out
    doubles it (up to ``ceiling``) until one succeeds again, so links that slowed down are
    caught up with instead of failing every round."""

    ceiling: float
    floor: float = 1.0
    factor: float = 3.0
    window: int = 8

    def __post_init__(self) -> None:
        if not (0 < self.floor <= self.ceiling) or not math.isfinite(self.ceiling):
            raise ValueError("need 0 < floor <= ceiling < inf")
        if self.factor < 1 or self.window < 1:
            raise ValueError("factor must be at least 1 and window at least 1")
        self._recent: deque[float] = deque(maxlen=self.window)
        self._backoff = 1.0

    def timeout(self) -> float:
        """The timeout for the next round, in seconds."""
        if not self._recent:
            return self.ceiling
        base = self.factor * max(self._recent) * self._backoff
        return min(self.ceiling, max(self.floor, base))

    def succeeded(self, seconds: float) -> None:
        """A round took ``seconds`` and succeeded."""
        if seconds >= 0 and math.isfinite(seconds):
            self._recent.append(seconds)
        self._backoff = 1.0

    def timed_out(self) -> None:
        """A round ran out of its timeout."""
        self._backoff = min(self._backoff * 2, 1 << 20)
