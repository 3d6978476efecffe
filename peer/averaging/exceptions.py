"""Exceptions raised by the averaging package (:mod:`peer.averaging`).

Hierarchy (all under :class:`peer.exceptions.SwarmgradError`)::

    SwarmgradError
    ├── CompressionError (ValueError)   peer.compression: a compressed tensor that does not decode
    └── AveragingError                  root of everything raised by peer.averaging
        ├── BadContribution (ValueError) a sender's part has the wrong size, dtype or weight,
        │   │                            NaN/Inf values, a duplicate or unknown part index;
        │   │                            carries ``sender`` and ``part_index`` so the caller can
        │   │                            exclude the offender (``WeightedMeanReducer.exclude``)
        │   └── UnexpectedSender         a contribution from a peer that is not a sender
        └── StepFailed                   ``DecentralizedAverager.step`` did not average
            ├── MatchmakingFailed        no group of at least min_group_size by the deadline
            ├── AllreduceFailed          the group formed but the all-reduce round failed
            │   └── AllreduceTimeout     ... because it ran past ``allreduce_timeout``
            ├── NonFiniteTensors         this peer's own values have NaN/Inf (not retried)
            └── StepCancelled            ``StepControl.cancel()`` (or shutdown) before all-reduce

A failed ``step()`` raises a :class:`StepFailed` subclass and leaves the tensors unchanged;
a remote peer's misbehaviour in matchmaking is a typed outcome, never an exception.
"""

from __future__ import annotations

from collections.abc import Hashable

from peer.exceptions import SwarmgradError


class AveragingError(SwarmgradError):
    """Root of every error the averaging package raises on purpose."""


class BadContribution(AveragingError, ValueError):
    """A sender's contribution is invalid; exclude ``sender`` from the round.

    Raised, the reducer's state is unchanged by the rejected contribution: nothing of it
    was added. Found when a part completes (NaN/Inf), it is queued in the reducer's
    ``rejected`` list instead, the sender already excluded.
    """

    def __init__(self, sender: Hashable, part_index: int | None, reason: str) -> None:
        self.sender = sender
        self.part_index = part_index
        self.reason = reason
        where = "" if part_index is None else f" in part {part_index}"
        super().__init__(f"bad contribution from {sender!r}{where}: {reason}")


class UnexpectedSender(BadContribution):
    """A contribution arrived from a peer that is not among the reducer's senders."""


class StepFailed(AveragingError):
    """An averaging step did not complete; the averaged tensors are unchanged."""


class MatchmakingFailed(StepFailed):
    """No group of at least ``min_group_size`` peers formed before the step's deadline."""


class AllreduceFailed(StepFailed):
    """The group formed, but this peer could not finish the all-reduce round."""


class AllreduceTimeout(AllreduceFailed):
    """The all-reduce round ran past ``allreduce_timeout``."""


class NonFiniteTensors(StepFailed, ValueError):
    """This peer's averaged tensors hold NaN or Inf: it left the round (the group goes on
    without it). Not retried: fix the tensors first. The non-finite values stay as they
    were; found in the peer's own span before the round (all its values, if it reduces
    nothing), the tensors are unchanged; found by the reducer they were sent to (the peer
    then checks them itself), parts averaged meanwhile keep their average."""


class StepCancelled(StepFailed):
    """The step was cancelled (``StepControl.cancel()`` or shutdown) before its all-reduce."""
