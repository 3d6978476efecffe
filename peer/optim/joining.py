"""A collaborative peer behind the swarm: download the newest state, or catch up.

The part of :class:`peer.Optimizer` that brings a newcomer, or a peer that fell behind, to
the swarm's epoch. Donors declare the epoch of the state they serve as their
``state_sharing_priority``, so the newest state is downloaded first; when only client-mode
peers (which nobody can dial) are ahead, the peer moves on with its own parameters.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from peer.optim.claims import StateOffers, claims_ahead, discount_claims_ahead
from peer.optim.live_state import LiveState
from peer.optim.progress import ProgressReport, ProgressTracker, SwarmProgress
from peer.optim.seam import SwarmNode
from peer.optim.state import StateSharingAverager

__all__ = ["JoiningSwarm"]

logger = logging.getLogger("peer.optim.collaborative")


def _epoch_beyond(metadata: Any, *, limit: int) -> str | None:
    """Why a downloaded state's epoch cannot be believed, or None."""
    epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
    if isinstance(epoch, int) and epoch > limit:
        return f"its epoch {epoch} is past the swarm's {limit - 1} by more than one"
    return None


class JoiningSwarm:
    """Mixed into :class:`peer.Optimizer`, whose attributes these are."""

    node: SwarmNode
    live: LiveState
    tracker: ProgressTracker
    state_averager: StateSharingAverager
    scheduler: Any
    local_epoch: int
    load_state_timeout: float
    _samples: int
    _acc: list[torch.Tensor]
    _averaged_grads: list[torch.Tensor]
    _closed: bool
    _closing: threading.Event

    if TYPE_CHECKING:  # provided by peer.Optimizer

        def _settle_pending(
            self, *, cancel: bool = False, timeout: float | None = None
        ) -> bool: ...

        def _live_state(self) -> AbstractContextManager[Any]: ...

        def _local_report(self) -> ProgressReport: ...

        def _report(self, new_samples: int = 0) -> None: ...

    def load_state_from_peers(self) -> bool:
        """Download parameters, optimizer state and epoch from the peer with the newest state;
        True if a state was loaded. A background epoch still in progress is abandoned first
        (the state replaces it).

        Donors are tried newest state first (their priority is their state's epoch). While
        this peer is still behind the swarm's epoch as it stood when the download began —
        no donor answered (none visible yet, all busy or timing out) or only a straggler
        did — the download is retried with backoff, for ``load_state_timeout`` seconds in
        all: a newcomer joining a running swarm starts from the swarm's state, not from
        scratch. A peer that finds no one ahead of it (the first peer) does not wait. Claims
        of epochs ahead that no donor backs — none has offered a newer state for a
        declaration period, or none came in time — are discounted (:mod:`peer.optim.claims`)
        and the peer goes on at its own epoch."""
        self._settle_pending(cancel=True)
        deadline = time.monotonic() + self.load_state_timeout
        # The swarm's epoch now, from a fresh pull (a newcomer's replica may still be empty);
        # a donor at that epoch snapshots later, so its state is at least that new.
        self.node.get(self.tracker.key, latest=True)
        target = self._fresh_progress().epoch
        loaded = False
        backoff = 0.1
        config = self.state_averager.config
        offers = StateOffers(self.node, config.prefix, config.declare_state_period)
        while True:
            # no honest donor is past the swarm's epoch by more than the epoch it is finishing
            limit = self._fresh_progress().epoch + 1
            found = self.state_averager.load_state_from_peers(
                timeout=max(0.0, deadline - time.monotonic()),
                max_priority=limit,
                check=functools.partial(_epoch_beyond, limit=limit),
            )
            if isinstance(found, tuple) and self._load_downloaded_state(*found):
                loaded = True
            # never chase a swarm that moves on meanwhile; but stop waiting for an epoch
            # whose reports went away (peers that left retract theirs; a dead one's expire)
            target = min(target, self._fresh_progress().epoch)
            if self.local_epoch >= target or self._closed:
                return loaded
            if not self._a_donor_may_be_ahead():
                logger.warning(
                    "the peers at epoch %d are in client mode and cannot share their state; "
                    "continuing from this peer's own state at that epoch",
                    target,
                )
                self._catch_up(target)
                return loaded
            if not offers.newer_state_offered(self.local_epoch) and offers.discount_if_unbacked(
                self.tracker, self.local_epoch, self.load_state_timeout
            ):
                return loaded
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                logger.warning(
                    "no peer provided the swarm's state at epoch %d within %s s; "
                    "continuing at epoch %d",
                    target,
                    self.load_state_timeout,
                    self.local_epoch,
                )
                self._discount_claims_ahead(f"no state came within {self.load_state_timeout} s")
                return loaded
            logger.info(
                "no donor provided the swarm's state at epoch %d yet (this peer is at %d); "
                "retrying in %.1f s",
                target,
                self.local_epoch,
                min(backoff, remaining),
            )
            if self._closing.wait(min(backoff, remaining)):
                return loaded
            backoff = min(2 * backoff, 2.0)

    def _a_donor_may_be_ahead(self) -> bool:
        """Whether some peer ahead of this one could serve its state: client-mode peers
        cannot be dialled, so a swarm led only by them has no donor to wait for."""
        return any(not r.client_mode for r in claims_ahead(self.tracker, self.local_epoch))

    def _discount_claims_ahead(self, why: str) -> None:
        """No state backs the epochs claimed ahead of this peer: the claimers' reports past
        its epoch do not count for ``load_state_timeout`` seconds (:mod:`peer.optim.claims`)."""
        discount_claims_ahead(self.tracker, self.local_epoch, self.load_state_timeout, why)

    def _fresh_progress(self) -> SwarmProgress:
        return self.tracker.progress(self._local_report(), self.tracker.fetch(fresh=True))

    def _catch_up(self, epoch: int) -> None:
        """Move to the swarm's ``epoch`` keeping this peer's parameters (nobody can give
        theirs); what was accumulated for an older epoch is dropped, as after a download."""
        with self._live_state():
            if self.scheduler is not None:
                for _ in range(epoch - self.live.epoch):
                    self.scheduler.step()
            self._set_state_epoch(epoch)
        self._start_epoch_at(epoch)

    def _start_epoch_at(self, epoch: int) -> None:
        with torch.no_grad():
            for buffer in (self._acc, self._averaged_grads):
                for g in buffer:
                    g.zero_()
        self._samples = 0
        self.local_epoch = epoch
        self._report()

    def _load_downloaded_state(self, metadata: Any, tensors: Sequence[torch.Tensor]) -> bool:
        """Adopt a downloaded ``(metadata, tensors)`` unless it is older than this peer's."""
        epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
        if not isinstance(epoch, int) or epoch < self.local_epoch:
            return False
        try:
            with self._live_state():
                self.live.load(tensors)
                if self.scheduler is not None:
                    for _ in range(epoch - self.live.epoch):
                        self.scheduler.step()
                self._set_state_epoch(epoch)
        except ValueError as exc:
            logger.warning("could not load state from peers: %s", exc)
            return False
        self._start_epoch_at(epoch)
        logger.info("loaded state from %s at epoch %d", self.state_averager.last_state_donor, epoch)
        return True

    def _set_state_epoch(self, epoch: int) -> None:
        """The live state now belongs to ``epoch``. It is also the state's sharing priority, so
        newcomers download the newest state rather than a straggler's (hivemind does the
        same). Live-state lock held; any thread."""
        self.live.epoch = epoch
        self.state_averager.state_sharing_priority = float(epoch)
