"""The volunteers' table of a run's dashboard, one page at a time.

A run of 10,000 volunteers cannot send its whole table with every update (about 2 MB of
JSON): the dashboard's document carries the run's totals and one page, and the page asks for
others (``GET /api/v1/runs/{id}/volunteers``). Sorting, filtering and paging happen in SQL
over one aggregate of the run's peers per volunteer, so the rows built in Python are a page's,
whatever the size of the run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple, TypeAlias, cast, get_args

from sqlalchemy import ColumnElement, Select, String, case, false, func, select
from sqlalchemy import Row as SqlRow
from sqlalchemy import cast as sql_cast
from sqlalchemy.orm import Session

from server.models import Peer, Volunteer
from server.schemas import MAX_INT
from server.schemas_dashboard import VolunteerPageInfo, VolunteerSort
from server.services import presence
from server.services.run_totals import float_sum, saturated

DEFAULT_PER_PAGE = 50
MAX_PER_PAGE = 200
MAX_PAGE = 1_000_000
MAX_QUERY = 64  # a display name is at most this long
SORTS: tuple[str, ...] = get_args(VolunteerSort)


class Row(NamedTuple):  # a tuple: a frozen dataclass per row costs more than the query
    id: int
    display_name: str
    banned: bool
    samples: int
    online_ms: int
    last_seen_ms: int | None
    reachable_peers: int
    peers: int
    first_seen_ms: int | None
    online: bool
    punching_peers: int  # behind a NAT, reached by hole punching (a punch:// address)


@dataclass(frozen=True, slots=True)
class View:
    """Which page, in which order, of which volunteers. The default is what the live feed
    sends: the first page by samples, most first."""

    page: int = 1
    per_page: int = DEFAULT_PER_PAGE
    sort: VolunteerSort = "samples"
    order: Literal["asc", "desc"] = "desc"
    q: str = ""

    def __post_init__(self) -> None:
        if not 1 <= self.page <= MAX_PAGE:
            raise ValueError(f"page must be in [1, {MAX_PAGE}]")
        if not 1 <= self.per_page <= MAX_PER_PAGE:
            raise ValueError(f"per_page must be in [1, {MAX_PER_PAGE}]")
        if self.sort not in SORTS:
            raise ValueError(f"sort must be one of {', '.join(SORTS)}")
        if self.order not in ("asc", "desc"):
            raise ValueError("order must be asc or desc")
        if len(self.q) > MAX_QUERY:
            raise ValueError(f"q must be at most {MAX_QUERY} characters")


def _online_ms_expression() -> ColumnElement[int]:
    """A peer's time online: its closed sessions plus the open one."""
    open_session = case(
        (Peer.session_started_ms.is_not(None), Peer.last_seen_ms - Peer.session_started_ms),
        else_=0,
    )
    return Peer.online_ms + open_session


# The columns of :func:`aggregate`, as SQLAlchemy types them: id, display_name, banned (0 or 1),
# samples, online_ms, last_seen_ms, reachable_peers, peers, first_seen_ms, present_ms,
# punching_peers. The sums and maxima are None for a volunteer without peers.
Aggregate: TypeAlias = tuple[
    int, str, int, float | None, int, int | None, int, int, int | None, int | None, int
]


def _name_filter(q: str) -> ColumnElement[bool] | None:
    q = q.strip()
    if not q:
        return None
    if "\x00" in q:  # no name holds one (PostgreSQL text cannot): nothing matches
        return false()
    return func.lower(Volunteer.display_name).contains(q.lower(), autoescape=True)


def _punching() -> ColumnElement[bool]:
    """SQL: a peer behind a NAT that others reach by hole punching (its address is the
    rendezvous's punch://, server.services.reachability)."""
    return Peer.client_mode.is_(False) & sql_cast(Peer.addresses, String).like("%punch://%")


def _dialable() -> ColumnElement[bool]:
    """SQL: a peer the coordinator reached (any peer may dial it)."""
    return Peer.client_mode.is_(False) & ~sql_cast(Peer.addresses, String).like("%punch://%")


def aggregate(run_id: str, q: str = "") -> Select[*Aggregate]:
    """One row per volunteer of the run (matching ``q``): its peers summed."""
    statement = (
        select(
            Volunteer.id.label("id"),
            Volunteer.display_name.label("display_name"),
            # A flag, not the timestamp: converting a thousand datetimes costs more than the query.
            case((Volunteer.banned_at.is_(None), 0), else_=1).label("banned"),
            float_sum(Peer.samples_base + Peer.samples).label("samples"),
            func.coalesce(func.sum(_online_ms_expression()), 0).label("online_ms"),
            func.max(Peer.last_seen_ms).label("last_seen_ms"),
            func.coalesce(func.sum(case((_dialable(), 1), else_=0)), 0).label("reachable_peers"),
            func.count(Peer.id).label("peers"),
            func.min(Peer.first_seen_ms).label("first_seen_ms"),
            func.max(presence.present_seen_ms()).label("present_ms"),
            func.coalesce(func.sum(case((_punching(), 1), else_=0)), 0).label("punching_peers"),
        )
        .join(Peer, Peer.volunteer_id == Volunteer.id, isouter=True)
        .where(Volunteer.run_id == run_id)
        .group_by(Volunteer.id, Volunteer.display_name, Volunteer.banned_at)
    )
    condition = _name_filter(q)
    return statement if condition is None else statement.where(condition)


def to_row(values: SqlRow[*Aggregate], since: int) -> Row:
    last_seen = values[5]
    return Row(
        id=int(values[0]),
        display_name=values[1],
        banned=bool(values[2]),
        samples=saturated(values[3]),
        online_ms=int(values[4]),
        last_seen_ms=None if last_seen is None else int(last_seen),
        reachable_peers=int(values[6]),
        peers=int(values[7]),
        first_seen_ms=None if values[8] is None else int(values[8]),
        online=values[9] is not None and int(values[9]) >= since,
        punching_peers=int(values[10]),
    )


class Standing(NamedTuple):
    row: Row
    rank: int  # 1 for the most samples; ties in the table's order (by id)
    of: int  # the run's volunteers
    total_samples: int  # theirs, summed


def standing(session: Session, run_id: str, volunteer_id: int, since: int) -> Standing | None:
    """One volunteer's row and its place among the run's volunteers by samples (None if it
    is not one of them). Counted in SQL, two rows read back: a volunteer's page, which
    rereads itself while it is open, costs the same at 10,000 volunteers as at ten."""
    found = session.execute(aggregate(run_id).where(Volunteer.id == volunteer_id)).first()
    if found is None:
        return None
    row = to_row(found, since)
    sums = (
        select(
            Volunteer.id.label("id"),
            func.coalesce(float_sum(Peer.samples_base + Peer.samples), 0.0).label("samples"),
        )
        .join(Peer, Peer.volunteer_id == Volunteer.id, isouter=True)
        .where(Volunteer.run_id == run_id)
        .group_by(Volunteer.id)
        .subquery()
    )
    samples = case((sums.c.samples >= MAX_INT, MAX_INT), else_=sums.c.samples)  # as saturated()
    ahead = (samples > row.samples) | ((samples == row.samples) & (sums.c.id < row.id))
    of, total, above = session.execute(
        select(
            func.count(),
            func.coalesce(func.sum(samples), 0.0),
            func.coalesce(func.sum(case((ahead, 1), else_=0)), 0),
        ).select_from(sums)
    ).one()
    return Standing(row, int(above) + 1, int(of), int(total))


def page(
    session: Session, run_id: str, since: int, view: View
) -> tuple[list[Row], VolunteerPageInfo]:
    """The rows of ``view`` (its page clamped to the last one) and what the pager shows.

    ``since``: a volunteer with a machine seen at or after it (ms) counts as online."""
    table = aggregate(run_id, view.q).subquery()
    key: ColumnElement[object] = {
        "samples": table.c.samples,
        "share": table.c.samples,
        "display_name": func.lower(table.c.display_name),
        "online_s": table.c.online_ms,
        # Never seen sorts below any time.
        "last_seen": func.coalesce(table.c.last_seen_ms, -1),
        "reachable": case((table.c.reachable_peers > 0, 1), (table.c.peers > 0, 0), else_=-1),
    }[view.sort]
    condition = _name_filter(view.q)
    count = select(func.count()).select_from(Volunteer).where(Volunteer.run_id == run_id)
    total = int(session.scalar(count) or 0)
    matching = total if condition is None else int(session.scalar(count.where(condition)) or 0)
    online = int(
        session.scalar(
            select(func.count(func.distinct(Peer.volunteer_id))).where(
                Peer.run_id == run_id, presence.online(since)
            )
        )
        or 0
    )
    pages = max(1, math.ceil(matching / view.per_page))
    number = min(view.page, pages)
    ordered = key.desc() if view.order == "desc" else key.asc()
    rows = [
        to_row(r, since)
        for r in session.execute(
            select(table)
            .order_by(ordered, table.c.id)
            .limit(view.per_page)
            .offset((number - 1) * view.per_page)
        )
    ]
    info = VolunteerPageInfo(
        page=number,
        per_page=view.per_page,
        pages=pages,
        matching=matching,
        total=total,
        online=online,
        sort=view.sort,
        order=view.order,
        q=view.q,
    )
    return rows, info


def view_from_query(params: Mapping[str, str]) -> View:
    """The view a page's address asks for (``?page=&per_page=&sort=&order=&q=``), each
    value that does not fit left at its default: for links followed without JavaScript."""

    def number(name: str, default: int, top: int) -> int:
        value = params.get(name, "")
        return int(value) if value.isdigit() and 1 <= int(value) <= top else default

    sort = params.get("sort", "samples")
    order = params.get("order", "desc")
    return View(
        page=number("page", 1, MAX_PAGE),
        per_page=number("per_page", DEFAULT_PER_PAGE, MAX_PER_PAGE),
        sort=cast(VolunteerSort, sort) if sort in SORTS else "samples",
        order="asc" if order == "asc" else "desc",
        q=params.get("q", "")[:MAX_QUERY],
    )
