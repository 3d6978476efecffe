"""Epochs claimed ahead of this peer that no state backs: found, named and discounted.

A peer behind the swarm's epoch looks for the newest state. When no donor has declared a
state newer than this peer's for a declaration period (a donor's ``state_sharing_priority``
is its state's epoch, and a live donor refreshes it well within that), or none came within
the time allowed, the peers claiming epochs ahead are named in a warning and
their reports past this peer's epoch are left out of its view of the swarm for a while
(:meth:`peer.optim.shared.progress.ProgressTracker.discount`). One peer claiming an epoch far
ahead — a bug or a hostile volunteer — then costs each other peer one download attempt,
not its training.
"""

from __future__ import annotations

import logging
import time

from peer.averaging.sharing.download import state_key
from peer.optim.seam import SwarmNode
from peer.optim.shared.progress import ProgressReport, ProgressTracker

logger = logging.getLogger("peer.optim.claims")

__all__ = [
    "DISCOUNT_S",
    "StateOffers",
    "claims_ahead",
    "discount_claims_ahead",
    "newer_state_offered",
]

#: how long a claim is discounted when the caller has no timeout of its own to go by
DISCOUNT_S = 300.0


def claims_ahead(tracker: ProgressTracker, local_epoch: int) -> list[ProgressReport]:
    """The other peers' reports past ``local_epoch`` (claims discounted left out)."""
    discounted = tracker.discounted()
    return [
        r
        for r in tracker.fetch()
        if r.peer_id != tracker.peer_id
        and r.epoch > local_epoch
        and r.epoch < discounted.get(r.peer_id, r.epoch + 1)
    ]


def newer_state_offered(node: SwarmNode, prefix: str, local_epoch: int) -> bool:
    """Whether some donor of the averager ``prefix`` declares a state newer than
    ``local_epoch`` (a fresh read of the declarations)."""
    found = node.get(state_key(prefix), latest=True)
    declared = found.value if found is not None and isinstance(found.value, dict) else {}
    return any(
        isinstance(priority := getattr(item, "value", None), int | float)
        and not isinstance(priority, bool)
        and priority > local_epoch
        for peer_id, item in declared.items()
        if peer_id != node.peer_id
    )


def discount_claims_ahead(
    tracker: ProgressTracker, local_epoch: int, seconds: float, why: str
) -> None:
    """Name every peer claiming an epoch past ``local_epoch`` and leave its reports past it
    out for ``seconds``."""
    for report in claims_ahead(tracker, local_epoch):
        logger.warning(
            "peer %s reports epoch %d, but %s: its reports past epoch %d are ignored for %g s",
            report.peer_id,
            report.epoch,
            why,
            local_epoch,
            seconds,
        )
        tracker.discount(report.peer_id, local_epoch + 1, seconds)


class StateOffers:
    """Whether some donor offers a state newer than this peer's, and since when none has.

    A live donor refreshes its declaration well within ``declare_state_period``: when none
    has offered a newer state for that long, none is coming, and the claims ahead are backed
    by nothing (:meth:`discount_if_unbacked`)."""

    def __init__(self, node: SwarmNode, prefix: str, declare_state_period: float) -> None:
        self.node = node
        self.prefix = prefix
        self.grace = float(declare_state_period)
        self._unoffered_since: float | None = None

    def newer_state_offered(self, local_epoch: int) -> bool:
        offered = newer_state_offered(self.node, self.prefix, local_epoch)
        if offered:
            self._unoffered_since = None
        elif self._unoffered_since is None:
            self._unoffered_since = time.monotonic()
        return offered

    def discount_if_unbacked(
        self, tracker: ProgressTracker, local_epoch: int, seconds: float
    ) -> bool:
        """Discount the claims ahead of ``local_epoch`` once no newer state has been offered
        for a declaration period; whether it did."""
        since = self._unoffered_since
        if since is None or time.monotonic() - since < self.grace:
            return False
        why = f"no peer has offered a state newer than this peer's for {self.grace:g} s"
        discount_claims_ahead(tracker, local_epoch, seconds, why)
        self._unoffered_since = None
        return True
