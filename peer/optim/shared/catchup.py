"""Catching up with the swarm: one policy for every optimizer that counts swarm epochs.

A peer behind the swarm's epoch — a newcomer, or one that fell behind (a slow state
download, a laptop lid, a partition healed) — brings itself to the swarm's epoch with
:class:`CatchUp`, the same for :class:`peer.Optimizer`,
:class:`peer.optim.DecentralizedOptimizer` and DiLoCo. The optimizer says what catching up
needs of it with a :class:`CatchUpHost` and how long to try with a :class:`CatchUpPolicy`;
:meth:`CatchUp.run` downloads the newest state and adopts it (the policy, step by step, is
:class:`CatchUp`'s docstring).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from peer.optim.seam import SwarmNode
from peer.optim.shared.claims import StateOffers, claims_ahead, discount_claims_ahead
from peer.optim.shared.optimizer_state import StateSharingAverager
from peer.optim.shared.progress import ProgressReport, ProgressTracker

__all__ = ["CatchUp", "CatchUpHost", "CatchUpPolicy"]

logger = logging.getLogger("peer.optim.catchup")

#: the first retry's wait; it doubles up to :data:`MAX_BACKOFF_S`
FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 2.0


@dataclass(frozen=True)
class CatchUpPolicy:
    """What differs between optimizer families: how long to try, and what to do when no
    state came in time.

    * ``timeout`` — seconds for one call (None: no bound on the download);
    * ``retry`` — retry with backoff within ``timeout`` while still behind (False: one
      download attempt per call);
    * ``on_timeout`` — ``"discount"``: the claims ahead are backed by nothing, discount them
      and stay at this peer's epoch; ``"move_on"``: if some donor offered a newer state,
      move to the swarm's epoch with this peer's own state;
    * ``discount_s`` — how long discounted claims are left out.

    Whether donors offer a newer state is judged within one call when it retries, and
    across calls when each call makes one attempt (then the declaration period spans
    calls).
    """

    timeout: float | None
    retry: bool
    on_timeout: Literal["discount", "move_on"]
    discount_s: float

    def __post_init__(self) -> None:
        if self.timeout is not None and not self.timeout >= 0:
            raise ValueError("the catch-up timeout must be non-negative")
        if self.on_timeout not in ("discount", "move_on"):
            raise ValueError(f"unknown on_timeout {self.on_timeout!r}")
        if not self.discount_s >= 0:
            raise ValueError("discount_s must be non-negative")


@dataclass(frozen=True)
class CatchUpHost:
    """What catching up needs of the optimizer it brings to the swarm's epoch, as callables
    (the optimizer's own methods; all run in the training thread).

    * ``local_epoch()`` — the epoch this peer is at;
    * ``settle()`` — stop background work and apply what it finished;
    * ``report()`` — this peer's progress report as it stands;
    * ``adopt(epoch, metadata, tensors)`` — load a downloaded state and move to its epoch
      (not older than this peer's); ``ValueError`` if it does not fit (nothing changed);
    * ``move_to(epoch)`` — move to the swarm's ``epoch`` keeping this peer's own state;
    * ``holds_state()`` — whether this peer holds a state of its own worth keeping (it took
      part in the run: a sync, an epoch, a state loaded); such a peer replaces it only with
      a newer state another volunteer confirms. Default: never (a newcomer every time);
    * ``round_mates(epoch)`` — the peers that began the round ending ``epoch`` with this
      peer (its last try), when this peer did not finish it: their state of the next epoch
      is that round's result, an extension of this peer's own, and needs no other witness
      (unless two others agree on another state). Default: none.
    """

    local_epoch: Callable[[], int]
    settle: Callable[[], object]
    report: Callable[[], ProgressReport]
    adopt: Callable[[int, object, Sequence[torch.Tensor]], None]
    move_to: Callable[[int], None]
    holds_state: Callable[[], bool] = lambda: False
    round_mates: Callable[[int], frozenset[str]] = lambda epoch: frozenset()


def _epoch_refused(metadata: object, *, limit: int, floor: int | None) -> str | None:
    """Why a downloaded state's epoch cannot be used, or None: past ``limit``, or (for a
    peer that holds a state of its own) under ``floor``."""
    epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
    if isinstance(epoch, int) and epoch > limit:
        return f"its epoch {epoch} is past the swarm's {limit - 1} by more than one"
    if floor is not None and (
        not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < floor
    ):
        return f"its epoch {epoch!r} is not newer than this peer's {floor - 1}"
    return None


class CatchUp:
    """Brings ``host`` to the swarm's epoch; one per optimizer. The policy:

    * **settle first**: background work of the optimizer's is stopped and applied (the state
      replaces it; :attr:`CatchUpHost.settle`);
    * **from whom**: the donor with the newest state, never one past the swarm's epoch (as it
      stands now, pulled fresh) by more than the epoch it is finishing: donors declare their
      state's epoch as their ``state_sharing_priority``, so newer states come first and a
      donor claiming an epoch nobody reports is not asked, and a state whose epoch says more
      is dropped;
    * **whom to believe**: a peer that holds a state of its own (:attr:`CatchUpHost.holds_state`:
      it took part in the run) replaces it only with a newer one that another volunteer confirms
      (:mod:`peer.averaging.sharing.witnesses`); a newcomer takes a single donor's state unless
      other volunteers outvote it. A donor whose state was dropped is not downloaded from again at
      that priority (outvoted: not at all), and its claims ahead are discounted at once, so one
      volunteer's claim costs this peer at most one download and resets nothing;
    * **how to apply it**: a state older than this peer's is ignored (for a peer that holds
      one, a state not newer than its own); otherwise the optimizer loads it and moves to its
      epoch (:attr:`CatchUpHost.adopt`; ``ValueError``: it did not fit, and is ignored);
    * **when to stop**: once this peer is at the swarm's epoch (as it stood when catching up
      began, or lower if the swarm's reports went away meanwhile); at once when only
      client-mode peers (nobody can dial them, so they serve no state) are ahead — then it
      moves to their epoch with its own state (:attr:`CatchUpHost.move_to`); when no
      donor has offered a state newer than this peer's for a declaration period, the claims
      ahead are backed by nothing and are discounted (:mod:`peer.optim.shared.claims`);
    * **when nothing came in time** (:class:`CatchUpPolicy`): a collaborative peer retries
      with backoff within its window, then discounts the claims ahead and goes on at its own
      epoch (its gradient rounds need the others' parameters, not just their epoch); a
      decentralized peer tries once per call and, if a newer state was offered, moves to the
      swarm's epoch with its own state (background averaging pulls it towards the others).

    ``node``, ``tracker`` and ``averager`` are the optimizer's: the swarm's reports, and the
    averager that downloads state (its donors' declarations are its ``prefix``'s).
    ``closing`` is set when the optimizer shuts down: a retry ends then."""

    def __init__(
        self,
        host: CatchUpHost,
        *,
        node: SwarmNode,
        tracker: ProgressTracker,
        averager: StateSharingAverager,
        policy: CatchUpPolicy,
        closing: threading.Event,
    ) -> None:
        self.host = host
        self.node = node
        self.tracker = tracker
        self.averager = averager
        self.policy = policy
        self.closing = closing
        config = averager.config
        self.offers = StateOffers(node, config.prefix, config.declare_state_period)

    def swarm_epoch(self) -> int:
        """The swarm's epoch from a fresh read of the reports."""
        return self.tracker.progress(self.host.report(), self.tracker.fetch(fresh=True)).epoch

    def run(self, *, chase: bool = True, timeout: float | None = None) -> bool:
        """Download the newest state and adopt it; True if one was loaded. With ``chase``,
        go on (per the policy) until this peer is at the swarm's epoch; without, one
        attempt. ``timeout`` overrides the policy's."""
        policy = self.policy
        window = policy.timeout if timeout is None else timeout
        self.host.settle()
        if policy.retry:
            self.offers = StateOffers(self.node, self.offers.prefix, self.offers.grace)
        deadline = None if window is None else time.monotonic() + window
        # The swarm's epoch now, from a fresh pull (a newcomer's replica may still be empty);
        # a donor at that epoch snapshots later, so its state is at least that new.
        self.node.get(self.tracker.key, latest=True)
        target = self.swarm_epoch()
        loaded = False
        backoff = FIRST_BACKOFF_S
        while True:
            # no honest donor is past the swarm's epoch by more than the epoch it is finishing
            limit = self.swarm_epoch() + 1
            holding = self.host.holds_state()
            # a peer's own state is replaced by a newer one only: one at its own epoch would
            # reset its progress for nothing
            local = self.host.local_epoch()
            floor = local + 1 if holding else None
            found = self.averager.load_state_from_peers(
                timeout=None if deadline is None else max(0.0, deadline - time.monotonic()),
                max_priority=limit,
                min_priority=-math.inf if floor is None else floor,
                check=functools.partial(_epoch_refused, limit=limit, floor=floor),
                holding=holding,
                partners=self.host.round_mates(local) if holding else frozenset(),
            )
            if isinstance(found, tuple) and self._adopt(*found):
                loaded = True
            self._discount_refused()
            if not chase:
                return loaded
            # never chase a swarm that moves on meanwhile; but stop waiting for an epoch
            # whose reports went away (peers that left retract theirs; a dead one's expire)
            target = min(target, self.swarm_epoch())
            local = self.host.local_epoch()
            if local >= target or self.closing.is_set():
                return loaded
            if not any(not r.client_mode for r in claims_ahead(self.tracker, local)):
                logger.warning(
                    "the peers at epoch %d are in client mode and cannot share their state; "
                    "continuing from this peer's own state at that epoch",
                    target,
                )
                self.host.move_to(target)
                return loaded
            offered = self.offers.newer_state_offered(local)
            if not offered and self.offers.discount_if_unbacked(
                self.tracker, local, policy.discount_s
            ):
                return loaded
            remaining = None if deadline is None else deadline - time.monotonic()
            if not policy.retry or (remaining is not None and remaining <= 0):
                self._no_state_in_time(target, window, offered=offered)
                return loaded
            wait = backoff if remaining is None else min(backoff, remaining)
            logger.info(
                "no donor provided the swarm's state at epoch %d yet (this peer is at %d); "
                "retrying in %.1f s",
                target,
                local,
                wait,
            )
            if self.closing.wait(wait):
                return loaded
            backoff = min(2 * backoff, MAX_BACKOFF_S)

    def _discount_refused(self) -> None:
        """Discount the claims ahead of donors whose states this peer dropped: what they
        claim is backed by nothing this peer can use, and must not send it back to them."""
        refused = self.averager.refused_state_donors()
        if not refused:
            return
        local = self.host.local_epoch()
        for report in claims_ahead(self.tracker, local):
            if report.peer_id in refused:
                logger.warning(
                    "peer %s reports epoch %d, but this peer dropped its state: its reports "
                    "past epoch %d are ignored for %g s",
                    report.peer_id,
                    report.epoch,
                    local,
                    self.policy.discount_s,
                )
                self.tracker.discount(report.peer_id, local + 1, self.policy.discount_s)

    def _no_state_in_time(self, target: int, window: float | None, *, offered: bool) -> None:
        local = self.host.local_epoch()
        if self.policy.on_timeout == "discount":
            logger.warning(
                "no peer provided the swarm's state at epoch %d within %s s; continuing at "
                "epoch %d",
                target,
                window,
                local,
            )
            why = f"no state came within {window} s"
            discount_claims_ahead(self.tracker, local, self.policy.discount_s, why)
        elif offered:
            logger.warning(
                "could not load the state of epoch %d from peers; continuing from this "
                "peer's own state at that epoch",
                target,
            )
            self.host.move_to(target)
        # else: a donor could serve, yet none offers a newer state; once none has for a
        # declaration period, the claims ahead are discounted (a later call)

    def _adopt(self, metadata: object, tensors: Sequence[torch.Tensor]) -> bool:
        """Adopt a downloaded ``(metadata, tensors)`` unless it is older than this peer's."""
        epoch = metadata.get("epoch") if isinstance(metadata, dict) else None
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < self.host.local_epoch():
            return False
        try:
            self.host.adopt(epoch, metadata, tensors)
        except ValueError as exc:
            logger.warning("ignoring a downloaded state that does not fit: %s", exc)
            return False
        logger.info("loaded state from %s at epoch %d", self.averager.last_state_donor, epoch)
        return True
