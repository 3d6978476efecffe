"""Whether the run's volunteers average together, and what would help when they do not.

:func:`findings` (pure rules, tested without a database) reads each online peer's reports
of the last :data:`LOOKBACK_S` (rounds done and failed, epoch, group size) and the
reachability the coordinator recorded for it. A peer "found no group" when at least
:data:`NO_GROUP_ROUNDS` rounds went by without one while other volunteers were online.

One peer speaks only for itself: it is flagged by name; "nobody is averaging" needs most
online reporting peers to say so, and islands need most averaging peers' largest groups to
be small. The reason and the help come from the coordinator's reachability records.

At most :data:`SAMPLE` online peers (the most recently heard) are read, so the cost does not
grow with the run; counts in the messages are the run's own, shares and names the sample's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from server.models import Peer, ProgressReport, Volunteer
from server.schemas_dashboard import Alert
from server.services import presence

LOOKBACK_S = 180.0  # reports behind the rules: a few rounds at any usual pace
NO_GROUP_ROUNDS = 3  # rounds without a group before a volunteer is flagged
NAMED = 3  # volunteers named in one alert; the rest counted
SAMPLE = 24  # online peers read for the rules: enough for a majority, a constant cost

FORWARD = "forward a port or turn on UPnP on the router (docs/volunteers.md)"
RELAY = "run a relay (docs/deploy.md)"


@dataclass(frozen=True, slots=True)
class PeerAveraging:
    """One online peer's recent averaging, as the coordinator holds it."""

    name: str  # its volunteer's display name
    reachability: str  # "dialable" | "punching" | "client" (the coordinator's own record)
    reported: bool  # it reported within the lookback
    averaged: bool  # a report within the lookback counted a completed round
    rounds_without: int  # rounds with no group since its last completed one
    largest_group: int | None  # the largest group of its completed rounds within the lookback


def _help(peers: Sequence[PeerAveraging]) -> tuple[str, str]:
    """Why ``peers`` cannot average and what would help, from the coordinator's records."""
    kinds = {p.reachability for p in peers}
    if kinds == {"client"}:
        return "none of them can be reached", f"{FORWARD}, or {RELAY}"
    if "dialable" not in kinds:
        return (
            "they are behind NATs and hole punching does not connect them",
            f"{RELAY} for the pairs that cannot punch, or {FORWARD}",
        )
    return (
        "their links to the others fail",
        f"check the firewalls between the volunteers, or {RELAY}",
    )


def _names(peers: Sequence[PeerAveraging]) -> str:
    names = sorted({p.name for p in peers})
    shown = ", ".join(names[:NAMED])
    return shown if len(names) <= NAMED else f"{shown} and {len(names) - NAMED} more"


def findings(peers: Sequence[PeerAveraging], online: int | None = None) -> list[Alert]:
    """The averaging alerts for the online ``peers`` of a running run: "nobody is
    averaging" (most reporting peers found no group), else the volunteers that found no
    group by name; and islands (most averaging peers' largest group at most half the group
    they would form together: a run's rounds gather every volunteer online)."""
    found: list[Alert] = []
    online = max(len(peers), online or 0)  # the run's count, where peers are a sample of it
    reporting = [p for p in peers if p.reported]
    if online < 2 or not reporting:
        return found
    alone = [p for p in reporting if p.rounds_without >= NO_GROUP_ROUNDS]
    if 2 * len(alone) > len(reporting):
        why, helps = _help(peers)
        found.append(
            Alert(
                kind="not_averaging",
                severity="critical",
                message=f"{online} volunteers online, "
                + (
                    "none averaged"
                    if len(alone) == len(peers)
                    else f"{len(alone)} of them found no group"
                    if len(peers) == online
                    else f"{len(alone)} of the {len(peers)} seen last found no group"
                )
                + f" in their last {NO_GROUP_ROUNDS}+ rounds: {why}.",
                help=f"What helps: {helps}.",
            )
        )
    elif alone:
        why, helps = _help(alone)
        found.append(
            Alert(
                kind="no_group",
                severity="warning",
                message=f"{_names(alone)} found no group for {NO_GROUP_ROUNDS}+ rounds while "
                f"{online} volunteers are online: {why}.",
                help=f"What helps: {helps}.",
            )
        )
    averaging = [p for p in reporting if p.averaged and p.largest_group is not None]
    if len(averaging) >= 3:
        small = [p for p in averaging if (p.largest_group or 0) <= len(averaging) // 2]
        if 2 * len(small) > len(averaging):
            largest = max(p.largest_group or 0 for p in small)
            _, helps = _help(peers)
            found.append(
                Alert(
                    kind="islands",
                    severity="warning",
                    message=f"{len(averaging)} volunteers average, but in separate groups of "
                    f"at most {largest} that never mix: some of them cannot reach the others.",
                    help=f"What helps: {helps}.",
                )
            )
    return found


def _reachability(client_mode: bool, addresses: Sequence[str] | None) -> str:
    if client_mode:
        return "client"
    if any(str(a).startswith("punch://") for a in addresses or ()):
        return "punching"
    return "dialable"


def observe(session: Session, run_id: str, *, now: int, since: int) -> list[PeerAveraging]:
    """The run's online peers (seen at or after ``since``) and their reports of the last
    :data:`LOOKBACK_S` before ``now`` (ms, the coordinator's clock): two aggregates over the
    run's recent reports, bounded by the lookback and the online peers."""
    start = now - int(LOOKBACK_S * 1000)
    recent = (ProgressReport.run_id == run_id) & (ProgressReport.reported_ms >= start)
    done = ProgressReport.rounds_done > 0
    last = (
        select(
            ProgressReport.peer_id.label("peer_pk"),
            func.max(case((done, ProgressReport.reported_ms), else_=None)).label("last_done"),
            func.max(case((done, ProgressReport.group_size), else_=None)).label("largest"),
        )
        .where(recent)
        .group_by(ProgressReport.peer_id)
        .subquery()
    )
    after = (
        select(
            ProgressReport.peer_id.label("peer_pk"),
            func.coalesce(func.sum(ProgressReport.rounds_failed), 0).label("failed"),
            (func.max(ProgressReport.epoch) - func.min(ProgressReport.epoch)).label("epochs"),
        )
        .join(last, last.c.peer_pk == ProgressReport.peer_id)
        .where(
            recent,
            last.c.last_done.is_(None) | (ProgressReport.reported_ms > last.c.last_done),
        )
        .group_by(ProgressReport.peer_id)
        .subquery()
    )
    rows = session.execute(
        select(
            Volunteer.display_name,
            Peer.client_mode,
            last.c.peer_pk,
            last.c.last_done,
            last.c.largest,
            after.c.failed,
            after.c.epochs,
            Peer.addresses,
        )
        .join(Volunteer, Volunteer.id == Peer.volunteer_id)
        .join(last, last.c.peer_pk == Peer.id, isouter=True)
        .join(after, after.c.peer_pk == Peer.id, isouter=True)
        .where(Peer.run_id == run_id, presence.online(since))
        .order_by(Peer.last_seen_ms.desc(), Peer.id)
        .limit(SAMPLE)
    ).all()
    return [
        PeerAveraging(
            name=name,
            reachability=_reachability(bool(client_mode), addresses),
            reported=peer_pk is not None,
            averaged=last_done is not None,
            # Rounds that failed and epochs stepped alone may be the same rounds: the larger.
            rounds_without=max(int(failed or 0), int(epochs or 0)),
            largest_group=None if largest is None else int(largest),
        )
        for name, client_mode, peer_pk, last_done, largest, failed, epochs, addresses in rows
    ]


def alerts(
    session: Session, run_id: str, *, now: int, since: int, online: int | None = None
) -> list[Alert]:
    """:func:`findings` for a sample of the run's ``online`` peers (see :func:`observe`)."""
    return findings(observe(session, run_id, now=now, since=since), online)
